"""Real data available offline: scikit-learn's handwritten digits, split and partitioned non-IID."""

from __future__ import annotations

import gzip
import importlib.metadata
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

#: The digits' file in the scikit-learn distribution, the one its ``load_digits`` reads.
DIGITS_FILE = "sklearn/datasets/data/digits.csv.gz"


@dataclass(frozen=True)
class Dataset:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_features(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max()) + 1)


@lru_cache(maxsize=1)
def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 8x8 digits scaled to [0, 1] (float32) and their labels (int64), read-only.

    Read from the file scikit-learn ships, as its ``load_digits`` reads it, without importing
    scikit-learn: its import costs each process that loads the digits (a benchmark's baseline, the
    demo, a CLI run) about 2 CPU-s. Cached: every load in a process shares the arrays."""
    try:
        path = Path(str(importlib.metadata.distribution("scikit-learn").locate_file(DIGITS_FILE)))
    except importlib.metadata.PackageNotFoundError:
        raise ModuleNotFoundError("the digits come with scikit-learn: pip install scikit-learn") from None
    with gzip.open(path, mode="rt", encoding="utf-8") as rows:
        data = np.loadtxt(rows, delimiter=",")
    x = (data[:, :-1] / 16.0).astype(np.float32)
    y = data[:, -1].astype(np.int64)
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y


def load_digits_dataset(*, test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """8x8 digits scaled to [0, 1], with a stratified held-out test split."""
    x, y = digits_arrays()
    rng = np.random.default_rng(seed)
    test_idx: list[int] = []
    for label in np.unique(y):
        idx = np.flatnonzero(y == label)
        rng.shuffle(idx)
        test_idx.extend(idx[: int(round(len(idx) * test_fraction))])
    test_mask = np.zeros(len(y), dtype=bool)
    test_mask[test_idx] = True
    return Dataset(x[~test_mask], y[~test_mask], x[test_mask], y[test_mask])


def partition_by_shards(
    labels: np.ndarray, num_devices: int, *, shards_per_device: int = 2, seed: int = 0
) -> list[np.ndarray]:
    """McMahan et al.'s non-IID split: sort by label, cut into shards, deal each device a few.

    Each device then holds examples of only about ``shards_per_device`` classes.
    """
    if num_devices < 1:
        raise ValueError("num_devices must be at least 1")
    num_shards = num_devices * shards_per_device
    if num_shards > len(labels):
        raise ValueError(f"{len(labels)} examples cannot be cut into {num_shards} shards; use fewer devices")
    rng = np.random.default_rng(seed)
    order = np.argsort(labels, kind="stable")
    shards = np.array_split(order, num_shards)
    assignment = rng.permutation(num_shards)
    return [
        np.concatenate([shards[s] for s in assignment[d * shards_per_device : (d + 1) * shards_per_device]])
        for d in range(num_devices)
    ]
