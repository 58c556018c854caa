"""The generated reference pages (docs/hooks.py) cover what they document: every ``fedfleet``
command and option from the parser, every route of /openapi.json with its schemas."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


HOOKS = _hooks()


def _commands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for _name, _help, sub in HOOKS._subparsers(parser):
        found += _commands(sub)
    return found


def test_the_cli_page_has_every_command_and_option_of_the_parser() -> None:
    page = HOOKS.cli_markdown()
    commands = _commands(HOOKS.cli_parser())
    assert len(commands) > 10  # demo, server, simulate, plan build, plan test, deploy, ...
    for command in commands:
        assert f"`{command.prog.replace(command.prog.split()[0], 'fedfleet', 1)}`" in page, command.prog
        for action in command._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in page, (command.prog, option)


def test_parse_args_is_restored_after_the_parser_is_taken() -> None:
    HOOKS.cli_parser()
    assert argparse.ArgumentParser.parse_args.__name__ == "parse_args"
    assert argparse.ArgumentParser(prog="x").parse_args([]) == argparse.Namespace()


def test_the_http_page_has_every_route_and_schema_of_the_openapi_document() -> None:
    document = HOOKS.openapi_document()
    page = HOOKS.openapi_markdown()
    for path, item in document["paths"].items():
        for method in item:
            if method in ("get", "post", "put", "patch", "delete"):
                assert f"### `{method.upper()} {path}`" in page
    for name in document.get("components", {}).get("schemas", {}):
        assert f"{{ #{HOOKS._anchor(name)} }}" in page


def test_a_marker_is_replaced_by_its_generated_section_and_an_unknown_one_is_refused() -> None:
    page = HOOKS.expand_markers("# CLI\n\n<!-- generated: cli -->\n")
    assert "## `fedfleet`" in page and "<!-- generated" not in page
    try:
        HOOKS.expand_markers("<!-- generated: nothing -->")
    except ValueError as exc:
        assert "nothing" in str(exc)
    else:
        raise AssertionError("an unknown generated section was accepted")


def test_dev_docs_says_it_installs_the_docs_extra_then_builds_strictly(tmp_path: Path) -> None:
    """``./dev docs`` in a copy of the checkout whose Python is a stand-in that logs and has no
    mkdocs: it says what it installs (on stderr) before pip installs the docs extra, then runs a
    strict build into site/."""
    import subprocess

    from tests.support import checkout_with_stand_in_python

    work, env = checkout_with_stand_in_python(tmp_path, checks_fail=True)
    done = subprocess.run(["./dev", "docs"], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    said = next(i for i, line in enumerate(lines) if line.startswith("./dev: installing the docs tools"))
    pip = next(i for i, line in enumerate(lines) if "-m pip install" in line and ".[test,docs]" in line)
    build = next(i for i, line in enumerate(lines) if "-m mkdocs build --strict --site-dir site" in line)
    assert said < pip < build
