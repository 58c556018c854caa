"""`fedfleet plan build` of one task file writes the same bytes wherever and whenever it runs: the
same plans (the same plan ids, their sha256), versioned plans, checkpoint and manifest; only
``source.json`` names where the task file was."""

from __future__ import annotations

import shutil
from pathlib import Path

from emulator.cli.commands import main

ROOT = Path(__file__).resolve().parents[3]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_task_file_built_twice_from_two_places_gives_the_same_bundle_bytes(tmp_path, monkeypatch, capsys):
    there = tmp_path / "copy"
    there.mkdir()
    shutil.copy(ROOT / "examples" / "tasks" / "digits_task.py", there / "digits_task.py")
    assert main(["plan", "build", str(ROOT / "examples" / "tasks" / "digits_task.py"), "-o", str(tmp_path / "a")]) == 0
    monkeypatch.chdir(there)
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    assert main(["plan", "build", "digits_task.py", "-o", "../b"]) == 0
    capsys.readouterr()
    first, second = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert first.keys() == second.keys() and "digits_mlp/plan.fedplan" in first
    assert [name for name in first if first[name] != second[name]] == ["source.json"]
