"""Each device's examples: a non-IID sample of a dataset that ships with a package.

A device's label mix comes from a Dirichlet draw (Hsu et al. 2019's non-IID benchmark: small
concentration, a few dominant classes per device), its size from a log-normal (devices hold very
different amounts of data). Devices sample the training split independently rather than cutting
it into disjoint shards, so a dataset of 1,437 digits serves a fleet of 100,000 devices; the
held-out test split is never sampled.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from emulator.datasets import Dataset, load_digits_dataset

from .config import DataSection, FleetConfig
from .population import DeviceSpec, device_seed


@lru_cache(maxsize=4)
def _load(dataset: str, test_fraction: float) -> tuple[Dataset, tuple[np.ndarray, ...]]:
    if dataset != "digits":  # the config's Literal admits only datasets this module can load
        raise ValueError(f"unknown dataset {dataset!r}; use 'digits'")
    data = load_digits_dataset(test_fraction=test_fraction, seed=0)
    pools = tuple(np.flatnonzero(data.y_train == label) for label in range(data.num_classes))
    return data, pools


def fleet_dataset(config: FleetConfig) -> Dataset:
    """The dataset the fleet's examples come from, with its held-out test split for evaluation."""
    return _load(config.data.dataset, config.data.test_fraction)[0]


def example_count(data: DataSection, rng: np.random.Generator) -> int:
    n = int(round(data.examples_median * float(np.exp(data.examples_sigma * rng.standard_normal()))))
    return min(data.examples_max, max(data.examples_min, n))


def device_examples(config: FleetConfig, spec: DeviceSpec) -> tuple[np.ndarray, np.ndarray]:
    """The device's examples ``(x, y)``; the same config and device give the same arrays."""
    section = config.data
    dataset, pools = _load(section.dataset, section.test_fraction)
    rng = np.random.default_rng(device_seed(config.fleet.seed, spec.index, "data"))
    n = example_count(section, rng)
    mix = rng.dirichlet(np.full(len(pools), section.label_alpha))
    counts = rng.multinomial(n, mix)
    chosen = [
        rng.choice(pools[label], size=int(k), replace=bool(k > len(pools[label])))
        for label, k in enumerate(counts)
        if k > 0
    ]
    index = np.concatenate(chosen)
    rng.shuffle(index)
    return dataset.x_train[index], dataset.y_train[index]
