"""Each device's examples: a non-IID sample of a dataset that ships with a package (the default),
or one client of a federated dataset (``[data] format``/``path``, ``fedfleet simulate --data``).

The default: a device's label mix comes from a Dirichlet draw (Hsu et al. 2019's non-IID benchmark: small
concentration, a few dominant classes per device), its size from a log-normal (devices hold very
different amounts of data). Devices sample the training split independently rather than cutting
it into disjoint shards, so a dataset of 1,437 digits serves a fleet of 100,000 devices; the
held-out test split is never sampled for training. Its held-out examples (an evaluation task's
collection) are drawn the same way from the test split, and 100 such draws are the test clients
whose per-client accuracy the summary reports.

A federated dataset (:class:`ClientData`): the fleet's devices are matched to the dataset's training
clients through a seeded permutation of the sorted client ids: device ``i`` holds client
``perm[i mod K]`` of ``K``. A fleet of more devices than clients reuses every client about
``devices / K`` times (devices with the same client hold the same examples); one of fewer devices
holds a seeded sample of distinct clients. A device's held-out examples are its client's test
examples when the client has some (LEAF's by-sample split), else those of test client
``test_perm[i mod K_test]`` (a by-user split: held-out clients). The model is measured on the whole
test split, and per test client, unless the test split is one central test set (no client's own).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

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


#: Test clients drawn from the default dataset's test split for per-client accuracy.
DEFAULT_TEST_CLIENTS = 100

Examples = dict[str, np.ndarray]


class DigitsSampling:
    """The default data: each device's own Dirichlet sample of the digits (``device_examples``)."""

    label = "y"

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.dataset = fleet_dataset(config)
        from .federated_data import FeatureSpec

        self.features = {"x": FeatureSpec("float32", (self.dataset.num_features,)), "y": FeatureSpec("int64", ())}
        self.source = f"{config.data.dataset} (a Dirichlet label mix per device, alpha {config.data.label_alpha:g})"
        self.clients: int | None = None

    def train(self, spec: DeviceSpec) -> Examples:
        x, y = device_examples(self.config, spec)
        return {"x": x, "y": y}

    def held_out(self, spec: DeviceSpec) -> Examples:
        return self._draw(device_seed(self.config.fleet.seed, spec.index, "heldout"))

    def central_test(self) -> Examples:
        return {"x": self.dataset.x_test, "y": self.dataset.y_test}

    def test_clients(self) -> dict[str, Examples]:
        return {
            f"t{i:03d}": self._draw(device_seed(self.config.fleet.seed, i, "testclient"))
            for i in range(DEFAULT_TEST_CLIENTS)
        }

    def labels(self) -> np.ndarray:
        return np.concatenate([self.dataset.y_train, self.dataset.y_test])

    def _draw(self, seed: int) -> Examples:
        """A sample of the test split with a device's Dirichlet label mix and log-normal size."""
        section, data = self.config.data, self.dataset
        rng = np.random.default_rng(seed)
        pools = [np.flatnonzero(data.y_test == label) for label in range(data.num_classes)]
        n = example_count(section, rng)
        counts = rng.multinomial(n, rng.dirichlet(np.full(len(pools), section.label_alpha)))
        index = np.concatenate(
            [rng.choice(pools[c], size=int(k), replace=True) for c, k in enumerate(counts) if k > 0 and len(pools[c])]
        )
        return {"x": data.x_test[index], "y": data.y_test[index]}


class ClientData:
    """A federated dataset's clients as the fleet's devices (see the module docstring)."""

    def __init__(self, dataset: Any, devices: int, seed: int) -> None:
        self.dataset = dataset
        self.features = dict(dataset.features)
        self.label = dataset.label
        self.source = dataset.source
        #: The tokens of the dataset's id features (characters, words), if it has some.
        self.vocabulary: tuple[str, ...] = tuple(getattr(dataset, "vocabulary", ()))
        self.devices = devices
        self._ids = dataset.client_ids
        self._test_ids = dataset.test_client_ids
        self._perm = np.random.default_rng([int(seed) & 0xFFFFFFFF, 0xDA7A]).permutation(len(self._ids))
        self._test_perm = np.random.default_rng([int(seed) & 0xFFFFFFFF, 0x7E57]).permutation(len(self._test_ids))
        self.clients: int | None = len(self._ids)

    def client_of(self, index: int) -> str:
        return self._ids[int(self._perm[index % len(self._ids)])]

    def train(self, spec: DeviceSpec) -> Examples:
        return dict(self.dataset.train[self.client_of(spec.index)])

    def held_out(self, spec: DeviceSpec) -> Examples:
        client = self.client_of(spec.index)
        if client in self.dataset.test:
            return dict(self.dataset.test[client])
        if not self._test_ids:
            return {}
        return dict(self.dataset.test[self._test_ids[int(self._test_perm[spec.index % len(self._test_ids)])]])

    def central_test(self) -> Examples:
        return self.dataset.central_test()

    def test_clients(self) -> dict[str, Examples]:
        """The clients whose accuracy on their own test examples the summary's percentiles are over:
        none for a central test set (an npz's x_test, a DatasetDict's test split beside a
        partitioner's clients), whose one accuracy made p10, p50 and p90 alike."""
        if self.dataset.test_split == "central":
            return {}
        return {c: dict(e) for c, e in self.dataset.test.items()}

    def labels(self) -> np.ndarray:
        return self.dataset.values(self.label or "y")

    def values(self, feature: str) -> np.ndarray:
        """One feature's values over both splits (a token feature's ids, checked against the plan)."""
        return self.dataset.values(feature)


def data_spec_text(section: DataSection) -> str:
    """``[data] format``/``path``/``options`` as the one-string data spec ``load_data`` reads."""
    head: str = section.format or "digits"
    if section.path is not None:
        head += f":{section.path}"
    return ",".join([head, *(f"{k}={v}" for k, v in section.options.items())])


def fleet_data(config: FleetConfig) -> DigitsSampling | ClientData:
    """The fleet's data: the default sampling, or the federated dataset ``[data]`` names (raises
    ``FederatedDataError`` with a one-line message when it cannot be read)."""
    if config.data.format is None:
        return DigitsSampling(config)
    spec = data_spec_text(config.data)
    return ClientData(
        _federated(spec, config.fleet.seed, data_stamp(config.data)), config.fleet.devices, config.fleet.seed
    )


@lru_cache(maxsize=2)
def _federated(spec: str, seed: int, stamp: tuple[Any, ...]) -> Any:
    from .federated_data import load_data

    return load_data(spec, seed=seed)


#: The data spec's options that name a file or folder beside ``[data] path``.
PATH_OPTIONS = ("test", "vocab")

Stamp = tuple[tuple[str, int, int, int, int], ...]


def files_stamp(paths: Iterable[str | os.PathLike[str]], *, recursive: bool = True) -> Stamp:
    """What the file system says of the files at ``paths`` without reading them: each one's path,
    inode, size, and modification and change times (a folder's files, those in its subfolders too
    when ``recursive``), in sorted order; a path that cannot be read is left out (its loader says
    why). The caches of what was read from files are keyed by it beside the config's text, so that
    a file changed in place (a task file's model made larger, a dataset's labels corrected, a copy
    put over it with its old modification time) is read again by the next run in the process: the
    cache gave it the run of the old file, digest and all. Only the cache sees it: a run's digest
    depends on what the files hold, never on where they are or when they were written."""
    out = []
    for given in paths:
        root = Path(given)
        try:
            if root.is_dir():
                files = [p for p in (root.rglob("*") if recursive else root.iterdir()) if not p.is_dir()]
            else:
                files = [root]
            for path in files:
                info = path.stat()
                out.append((str(path), info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns))
        except OSError:
            continue
    return tuple(sorted(out))


def data_stamp(section: DataSection) -> Stamp:
    """``files_stamp`` of the federated dataset ``section`` names: its path and its options' paths."""
    named = [section.path, *(section.options.get(k) for k in PATH_OPTIONS)]
    return files_stamp(p for p in named if isinstance(p, str) and p)


def devices_per_client(devices: int, clients: Mapping[str, Any] | int) -> float:
    return round(devices / (clients if isinstance(clients, int) else len(clients)), 3)
