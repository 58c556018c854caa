"""The README's "Federated datasets" section: every Python block in it runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[4] / "README.md"


def _blocks() -> list[str]:
    text = README.read_text(encoding="utf-8")
    start = text.index("## Federated datasets\n")
    end = text.index("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end], flags=re.S)


def test_the_section_has_python_blocks() -> None:
    assert len(_blocks()) >= 2


@pytest.mark.parametrize("index", range(2))
def test_each_python_block_of_the_section_runs(index: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(README.parent)
    exec(compile(_blocks()[index], f"README.md#federated-datasets-{index}", "exec"), {"__name__": "readme"})
