"""The digits split and the non-IID partition."""

from __future__ import annotations

import numpy as np
import pytest

from emulator import partition_by_shards


def test_split_is_stratified_and_disjoint(digits):
    assert digits.num_features == 64 and digits.num_classes == 10
    assert len(digits.y_test) == pytest.approx(0.2 * (len(digits.y_train) + len(digits.y_test)), abs=10)
    assert set(np.unique(digits.y_test)) == set(range(10))
    assert 0.0 <= digits.x_train.min() and digits.x_train.max() <= 1.0


def test_partition_covers_every_example_once_and_is_skewed(digits):
    parts = partition_by_shards(digits.y_train, 50, seed=3)
    flat = np.concatenate(parts)
    assert sorted(flat.tolist()) == list(range(len(digits.y_train)))
    classes_per_device = [len(np.unique(digits.y_train[p])) for p in parts]
    assert np.mean(classes_per_device) <= 3.0
    assert partition_by_shards(digits.y_train, 50, seed=3)[7].tolist() == parts[7].tolist()
    with pytest.raises(ValueError):
        partition_by_shards(digits.y_train, 10_000)
