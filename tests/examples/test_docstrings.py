"""The commands the examples' docstrings give work as a reader types them at the checkout's root: a
command that asks a server for what only its operator may do names the operator key (the server
answers 401 without one, and ``fedfleet`` refuses to send it), and a Python run is the venv's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: The fedfleet commands that take --server and an operator key.
OPERATOR = re.compile(r"\bfedfleet (deploy|status|rounds|stop|model)\b.*--server")


def _command_lines() -> list[tuple[str, str]]:
    lines = []
    for path in sorted(EXAMPLES.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        lines += [(path.relative_to(EXAMPLES.parent).as_posix(), line.strip()) for line in doc.splitlines()]
    return lines


def test_the_examples_server_commands_name_the_operator_key_and_python_is_the_venvs() -> None:
    lines = _command_lines()
    assert any(OPERATOR.search(line) for _, line in lines), "the examples give server commands; none found"
    keyless = [f"{path}: {line}" for path, line in lines if OPERATOR.search(line) and "--admin-key-file" not in line]
    assert not keyless, keyless
    bare = [f"{path}: {line}" for path, line in lines if re.match(r"python3? ", line)]
    assert not bare, bare
