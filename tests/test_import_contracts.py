"""The import contracts of pyproject.toml hold: DESIGN.md's package rules, and no import cycle inside
any package (imports inside functions included, which is where the cycles used to hide).

`./dev check` runs the same `lint-imports`; this test keeps the rule in the suite, with its output on
failure, for a checkout whose check extra is installed (import-linter is not a test dependency).
"""

from __future__ import annotations

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
