"""The README's "A task file and a dataset": its fleet config is examples/fleets/small.toml, and every
command of its shell block runs as written (through the CLI entry, from the repository's root)."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from emulator.cli import main

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"


def _section() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index("### A task file and a dataset\n")
    end = text.index("\nPast one machine", start)
    return text[start:end]


def _commands() -> list[str]:
    (block,) = re.findall(r"```sh\n(.*?)```", _section(), flags=re.S)
    return [line for line in block.splitlines() if line.strip()]


def test_the_sections_fleet_config_is_the_shipped_one() -> None:
    (block,) = re.findall(r"```toml\n(.*?)```", _section(), flags=re.S)
    assert block.splitlines()[0] == "# examples/fleets/small.toml"
    assert tomllib.loads(block) == tomllib.loads((ROOT / "examples" / "fleets" / "small.toml").read_text(encoding="utf-8"))


@pytest.mark.parametrize("index", range(3))
def test_each_command_of_the_section_runs(index: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(ROOT)
    command = _commands()[index]
    program, verb, *args = shlex.split(command)
    assert program == ".venv/bin/fedfleet" and verb == "simulate"
    assert main([verb, *args, "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["rounds_committed"] >= 1 and summary["accuracy"] is not None
    assert summary["data_clients"] is not None and summary["client_accuracy_percentiles"] is not None
    assert "time_to_target_accuracy_s" in summary
