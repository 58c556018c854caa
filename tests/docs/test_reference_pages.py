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
