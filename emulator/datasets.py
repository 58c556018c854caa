"""Real data available offline: scikit-learn's handwritten digits, split and partitioned non-IID."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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


def load_digits_dataset(*, test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """8x8 digits scaled to [0, 1], with a stratified held-out test split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
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
