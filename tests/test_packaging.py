"""What the built distribution ships besides the code: a ``py.typed`` marker in every package, so a
user's type checker reads the packages' annotations (PEP 561), and the measured onnxruntime record."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("device_runtime", "example_store", "secagg", "server_stub", "emulator")


def test_every_package_ships_its_py_typed_marker(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in (*PACKAGES, "benchmarks"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    built = tmp_path / "lib"
    # build_py is the step that copies a wheel's files: packages and their package data
    done = subprocess.run(
        [sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py", "--build-lib", str(built)],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert [p for p in PACKAGES if not (built / p / "py.typed").is_file()] == []
    assert (built / "device_runtime" / "ort_support.json").is_file()
