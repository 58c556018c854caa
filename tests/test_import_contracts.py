"""The import contracts of pyproject.toml hold: DESIGN.md's package rules, and no import cycle inside
any package (imports inside functions included, which is where the cycles used to hide).

`./dev check` runs the same `lint-imports`; this test keeps the rule in the suite, with its output on
failure, for a checkout whose check extra is installed (import-linter is not a test dependency).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def lint_imports() -> str:
    found = Path(sys.executable).with_name("lint-imports")
    command = str(found) if found.exists() else shutil.which("lint-imports")
    if command is None:
        pytest.skip("import-linter is not installed (pyproject.toml [check]; ./dev check installs it)")
    return command


def test_no_package_imports_what_design_forbids_nor_holds_an_import_cycle() -> None:
    done = subprocess.run([lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


PACKAGES = ("device_runtime", "example_store", "secagg", "server_stub", "emulator")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The modules ``node`` imports: a name of a package that is one of its submodules is that
    submodule (``from . import wire``), any other name is the package's ``__init__``."""
    if node.level:
        base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    found = []
    for alias in node.names:
        sub = ROOT / Path(*f"{target}.{alias.name}".split("."))
        found.append(f"{target}.{alias.name}" if sub.is_dir() or sub.with_suffix(".py").is_file() else target)
    return found


def test_no_module_imports_the_package_it_is_part_of() -> None:
    """The cycle the sibling contract cannot see: ``pkg.mod`` importing ``pkg`` (its ``__init__``,
    which imports ``pkg.mod``), anywhere in the module, functions included. A module imports its
    siblings from their modules."""
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = _module_name(path)
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                targets = (
                    [alias.name for alias in node.names]
                    if isinstance(node, ast.Import)
                    else _imported(module, path.name == "__init__.py", node)
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                offenders += [
                    f"{module}:{node.lineno} imports {target}"
                    for target in targets
                    if module.startswith(target + ".") and (ROOT / Path(*target.split("."))).is_dir()
                ]
    assert not offenders, "\n".join(offenders)
