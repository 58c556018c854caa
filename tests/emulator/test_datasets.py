"""The digits split and the non-IID partition."""

from __future__ import annotations

import sys

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


def test_the_digits_are_scikit_learns_read_without_importing_it(monkeypatch):
    """Each process that loads the digits (a benchmark's baseline, the demo, a CLI run) once paid
    scikit-learn's import, about 2 CPU-s, for a file of 1,797 rows; the loader reads the file itself."""
    from sklearn.datasets import load_digits

    from emulator.datasets import digits_arrays

    reference = load_digits()
    digits_arrays.cache_clear()
    for name in ("sklearn", "sklearn.datasets"):
        monkeypatch.setitem(sys.modules, name, None)  # importing either now raises ImportError
    x, y = digits_arrays()
    assert x.dtype == np.float32 and y.dtype == np.int64 and x.shape == (1797, 64)
    np.testing.assert_array_equal(x, (reference.data / 16.0).astype(np.float32))
    np.testing.assert_array_equal(y, reference.target)
    assert not x.flags.writeable and not y.flags.writeable  # shared between loads
