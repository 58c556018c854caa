"""A dataset folder reads the same wherever it was copied: a folder's files in sorted order, and
the ``._name`` files macOS writes beside each file it copies to another file system (AppleDouble:
its resource fork, binary) left out, as a table folder leaves out ``.*`` and ``_*`` files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np

from emulator.fleet.federated_data import load_data

#: The first bytes of an AppleDouble file (its magic number and version, then "Mac OS X").
APPLE_DOUBLE = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(64)


def _leaf(folder: Path) -> Path:
    for split, offset in (("train", 0), ("test", 100)):
        (folder / split).mkdir(parents=True)
        for part in range(2):
            users = {f"w{part}{i}": {"x": [[float(offset + i)] * 4] * 3, "y": [i] * 3} for i in range(3)}
            body = {"users": list(users), "num_samples": [3] * 3, "user_data": users}
            (folder / split / f"part{part}.json").write_text(json.dumps(body))
    return folder


def _as_copied_by_macos(folder: Path, to: Path) -> Path:
    shutil.copytree(folder, to)
    for file in [p for p in to.rglob("*") if p.is_file()]:
        file.with_name(f"._{file.name}").write_bytes(APPLE_DOUBLE)
    return to


def _same(a, b) -> None:
    assert list(a.train) == list(b.train) and list(a.test) == list(b.test)
    for split in ("train", "test"):
        for client, examples in getattr(a, split).items():
            other = getattr(b, split)[client]
            assert all(np.array_equal(examples[k], other[k]) for k in examples)


def test_a_leaf_folder_copied_by_macos_reads_as_the_original(tmp_path):
    original = _leaf(tmp_path / "leaf")
    copy = _as_copied_by_macos(original, tmp_path / "stick" / "leaf")
    _same(load_data(f"leaf:{original}"), load_data(f"leaf:{copy}"))


def test_an_hdf5_folder_copied_by_macos_reads_as_the_original(tmp_path):
    original = tmp_path / "h5"
    original.mkdir()
    for split in ("train", "test"):
        with h5py.File(original / f"digits_{split}.h5", "w") as f:
            for i in range(3):
                group = f.create_group(f"examples/c{i}")
                group.create_dataset("pixels", data=np.full((2, 4), i, np.float32))
                group.create_dataset("label", data=np.array([i, i], np.int32))
    copy = _as_copied_by_macos(original, tmp_path / "stick" / "h5")
    _same(load_data(f"tff-h5:{original},lazy=no"), load_data(f"tff-h5:{copy},lazy=no"))
