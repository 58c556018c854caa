"""MkDocs hooks: the CLI and HTTP API reference pages are generated at build time, from the
``fedfleet`` argparse parser and from the server app's ``/openapi.json``, so they cannot drift
from the code. A page asks for them with a marker line, ``<!-- generated: cli -->`` or
``<!-- generated: openapi -->``, which is replaced by the generated Markdown."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- generated: (\w+) -->$", re.M)


# --- the CLI, from its parser ---------------------------------------------------------------


class _Captured(Exception):
    """Raised from inside ``parse_args`` to hand the finished parser out of ``emulator.cli.commands.main``."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser captured")
        self.parser = parser


@contextlib.contextmanager
def _capturing_parse_args() -> Iterator[None]:
    original = argparse.ArgumentParser.parse_args

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]


def cli_parser() -> argparse.ArgumentParser:
    """The parser ``fedfleet`` parses its arguments with: the one ``emulator.cli.commands.main`` builds
    (taken at its ``parse_args`` call, so the page follows whatever main builds), or its
    ``build_parser()`` where the CLI has one."""
    sys.path.insert(0, str(ROOT))
    import emulator.cli.commands

    build = getattr(emulator.cli.commands, "build_parser", None)
    if callable(build):
        return build()
    with _capturing_parse_args():
        try:
            emulator.cli.commands.main(["--help"])
        except _Captured as captured:
            return captured.parser
    raise RuntimeError("emulator.cli.commands.main never parsed its arguments; cannot document the CLI")


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.metavar or action.dest}`"
        if action.option_strings and action.nargs != 0:
            metavar = action.metavar or action.dest.upper()
            name += f" `{' '.join(metavar) if isinstance(metavar, tuple) else metavar}`"
        default = action.default
        shown = "" if default in (None, argparse.SUPPRESS, False) or action.nargs == 0 else f"`{default}`"
        if isinstance(action, argparse._VersionAction):
            shown = ""
        choices = f" (one of {', '.join(f'`{c}`' for c in action.choices)})" if action.choices else ""
        helptext = (action.help or "").replace("%(default)s", str(default)).replace("%(prog)s", parser.prog)
        rows.append(f"| {name} | {shown} | {_escape(helptext)}{choices} |")
    return rows


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:  # aliases share a parser
                    seen.add(id(sub))
                    found.append((name, helps.get(name, ""), sub))
    return found


def _cli_section(parser: argparse.ArgumentParser, level: int, help_line: str) -> list[str]:
    lines = [f"{'#' * level} `{parser.prog}`", ""]
    if help_line or parser.description:
        lines += [_escape(parser.description or help_line), ""]
    usage = parser.format_usage().removeprefix("usage: ").strip()
    lines += ["```text", usage, "```", ""]
    rows = _option_rows(parser)
    if rows:
        lines += ["| argument | default | meaning |", "|---|---|---|", *rows, ""]
    for _name, sub_help, sub in _subparsers(parser):
        lines += _cli_section(sub, min(level + 1, 4), sub_help)
    return lines


def cli_markdown() -> str:
    parser = cli_parser()
    parser.prog = "fedfleet"
    return "\n".join(_cli_section(parser, 2, ""))


# --- the HTTP API, from /openapi.json -------------------------------------------------------


def openapi_document() -> dict[str, Any]:
    """The server's OpenAPI document, as ``GET /openapi.json`` answers it (over an empty
    in-memory store: the document does not depend on the data)."""
    sys.path.insert(0, str(ROOT))
    from server_stub import AdminKeys, FLService, ServerStore, create_app

    app = create_app(FLService(ServerStore("sqlite://")), admin_keys=AdminKeys.generate()[0], telemetry=False)
    return json.loads(json.dumps(app.openapi()))


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _anchor(name: str) -> str:
    return "schema-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _type_of(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = _ref_name(schema["$ref"])
        return f"[{name}](#{_anchor(name)})"
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return " or ".join(_type_of(s) for s in schema[key])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"array of {_type_of(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema and isinstance(schema["additionalProperties"], dict):
        return f"object of {_type_of(schema['additionalProperties'])}"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    fmt = f" ({schema['format']})" if "format" in schema else ""
    return f"{kind}{fmt}"


def _content_lines(content: dict[str, Any]) -> list[str]:
    lines = []
    for media, body in content.items():
        schema = body.get("schema", {})
        lines.append(f"`{media}`: {_type_of(schema) if schema else 'any'}")
    return lines


def _answer_row(status: str, answer: dict[str, Any]) -> str:
    bodies = "; ".join(_content_lines(answer.get("content", {}))) or "none"
    return f"| {status} {_escape(answer.get('description', ''))} | {bodies} |"


def _operations(doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (path, method, op)
        for path, item in sorted(doc.get("paths", {}).items())
        for method, op in item.items()
        if method in ("get", "post", "put", "patch", "delete")
    ]


def _shared_answers(doc: dict[str, Any]) -> dict[str, str]:
    """The answers (status -> table row) every route documents alike: listed once, not per route."""
    rows = [
        {status: _answer_row(status, a) for status, a in op.get("responses", {}).items()}
        for _, _, op in _operations(doc)
    ]
    if not rows:
        return {}
    return {status: row for status, row in rows[0].items() if all(r.get(status) == row for r in rows[1:])}


def _operation_lines(path: str, method: str, op: dict[str, Any], shared: dict[str, str]) -> list[str]:
    lines = [f"### `{method.upper()} {path}`", ""]
    if op.get("summary"):
        lines += [f"**{_escape(op['summary'])}**", ""]
    if op.get("description"):
        lines += [op["description"].strip(), ""]
    if op.get("security"):
        schemes = sorted({name for requirement in op["security"] for name in requirement})
        lines += [f"Credential: {', '.join(f'`{s}`' for s in schemes)}.", ""]
    params = op.get("parameters", [])
    if params:
        lines += ["| parameter | in | type | required | meaning |", "|---|---|---|---|---|"]
        for p in params:
            lines.append(
                f"| `{p['name']}` | {p['in']} | {_type_of(p.get('schema', {}))} | "
                f"{'yes' if p.get('required') else 'no'} | {_escape(p.get('description', ''))} |"
            )
        lines.append("")
    if "requestBody" in op:
        body = op["requestBody"]
        lines += ["Request body: " + "; ".join(_content_lines(body.get("content", {}))), ""]
    lines += ["| answer | body |", "|---|---|"]
    for status, answer in sorted(op.get("responses", {}).items()):
        if status not in shared:
            lines.append(_answer_row(status, answer))
    return [*lines, ""]


def _schema_lines(name: str, schema: dict[str, Any]) -> list[str]:
    lines = [f"### {name} {{ #{_anchor(name)} }}", ""]
    if schema.get("description"):
        lines += [schema["description"].strip(), ""]
    props = schema.get("properties", {})
    if props:
        required = set(schema.get("required", []))
        lines += ["| field | type | required | meaning |", "|---|---|---|---|"]
        for field, sub in props.items():
            lines.append(
                f"| `{field}` | {_type_of(sub)} | {'yes' if field in required else 'no'} | "
                f"{_escape(sub.get('description', sub.get('title', '')))} |"
            )
        lines.append("")
    else:
        lines += [f"Type: {_type_of(schema)}", ""]
    return lines


def openapi_markdown() -> str:
    doc = openapi_document()
    info = doc.get("info", {})
    lines = [f"## Routes (OpenAPI {doc.get('openapi')}, API version {info.get('version')})", ""]
    shared = _shared_answers(doc)
    if shared:
        lines += [
            "Besides its own answers below, every route may answer:",
            "",
            "| answer | body |",
            "|---|---|",
            *(shared[s] for s in sorted(shared)),
            "",
        ]
    for path, method, op in _operations(doc):
        lines += _operation_lines(path, method, op, shared)
    schemas = doc.get("components", {}).get("schemas", {})
    if schemas:
        lines += ["## Schemas", ""]
        for name, schema in sorted(schemas.items()):
            lines += _schema_lines(name, schema)
    schemes = doc.get("components", {}).get("securitySchemes", {})
    if schemes:
        lines += ["## Credentials", "", "| scheme | kind | meaning |", "|---|---|---|"]
        for name, scheme in sorted(schemes.items()):
            kind = f"{scheme.get('type', '')} {scheme.get('scheme', '')}".strip()
            lines.append(f"| `{name}` | {kind} | {_escape(scheme.get('description', ''))} |")
        lines.append("")
    return "\n".join(lines)


GENERATORS: dict[str, Callable[[], str]] = {"cli": cli_markdown, "openapi": openapi_markdown}


def expand_markers(markdown: str) -> str:
    """The page with each ``<!-- generated: NAME -->`` line replaced by what NAME's generator writes."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"unknown generated section {name!r}; one of {sorted(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(replace, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs hook: expand the generated sections of a page."""
    return expand_markers(markdown)
