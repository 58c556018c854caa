"""Seeded partitioners that cut a centralized dataset into clients, as flwr-datasets' do.

Each function takes the labels (or the example count), the number of clients and a seed, and
returns one index array per client; the same arguments give the same arrays. The names and
parameters mean what they mean in flwr-datasets (``flwr_datasets.partitioner``):

- ``iid``: a seeded permutation cut into ``num_clients`` nearly equal parts (``IidPartitioner``).
- ``dirichlet``: for each class, the shares of its examples over the clients are drawn from
  Dirichlet(``alpha``) (``DirichletPartitioner``, after Yurochkin et al. 2019); small alpha: a few
  dominant classes per client, large alpha: close to IID. Not Hsu et al. 2019's scheme, which gives
  each client the same size and draws its class mix from Dirichlet(alpha p): over C balanced classes
  their alpha / C skews about as ``alpha`` does here. As in flwr, a draw that leaves a client
  below ``min_size`` examples is redrawn (here up to 100 draws, flwr 11); flwr's default
  ``min_size`` is 10, here it is 1, so that small datasets cut into many clients work. No
  self-balancing (flwr's ``self_balancing`` is off by default too).
- ``shards``: McMahan et al. 2017's pathological non-IID split (``ShardPartitioner``): sort by label,
  cut into ``num_clients * shards_per_client`` shards, deal each client ``shards_per_client`` of them
  at random. A shard that straddles two classes gives its client both, so a client holds at most
  ``2 * shards_per_client`` labels, and exactly ``shards_per_client`` when every class's count is a
  multiple of the shard size (McMahan's MNIST: 200 shards of 300). Here every example is dealt
  (shards differ in size by at most one) where flwr drops the remainder.
- ``pathological``: each client gets ``classes_per_client`` distinct classes and each class's
  examples are split evenly among the clients that have it (``PathologicalPartitioner``, after Li et
  al. 2022); ``mode`` is flwr's ``class_assignment_mode``. The default here is
  ``"first-deterministic"`` (client i's first class is i mod the number of classes, as in the paper),
  which uses every class once there are at least as many clients as classes; flwr's default
  ``"random"`` can leave classes unused, and their examples then belong to no client.
- ``quantity_skew``: IID labels, client sizes proportional to log-normal(0, ``sigma``) draws (as
  LEAF's synthetic data sizes its users), each at least ``min_size``.

Every partitioner but ``pathological`` with unused classes assigns every example exactly once;
``partition_arrays`` says in the dataset's ``source`` (which a fleet run prints and records) how many
examples of which classes no client holds. How each compares with flwr-datasets 0.6.1 on the same
labels: docs/howto/datasets.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ._dataset import CENTRAL, FederatedDataset, TestSplit, take, with_test_split
from ._errors import PartitionError

Scheme = Literal["iid", "dirichlet", "shards", "pathological", "quantity"]
SCHEMES: tuple[str, ...] = ("iid", "dirichlet", "shards", "pathological", "quantity")
MAX_DIRICHLET_DRAWS = 100  # flwr stops after 11; a draw is cheap, and many clients at a small alpha need more


def _check_clients(n: int, num_clients: int, per_client: int = 1) -> None:
    if num_clients < 1:
        raise PartitionError(f"num_clients (the data spec's clients=) must be at least 1, got {num_clients}")
    if n < num_clients * per_client:
        raise PartitionError(
            f"{n} examples cannot give {num_clients} clients {per_client} each; use at most {n // per_client} clients"
        )


def _shuffled(parts: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    out = []
    for part in parts:
        part = np.asarray(part, dtype=np.int64)
        rng.shuffle(part)
        out.append(part)
    return out


def _class_ids(labels: np.ndarray, scheme: str) -> np.ndarray:
    """Labels as one class id per example, for a partitioner that cuts by class: Keras' CIFAR
    labels are [N, 1] (sorted along their single column, every shard held one example N/shards
    times); one-hot rows are refused, as each row's values are no class id."""
    labels = np.asarray(labels)
    if labels.ndim > 1 and all(d == 1 for d in labels.shape[1:]):
        return labels.reshape(len(labels))
    if labels.ndim != 1:
        raise PartitionError(
            f"{scheme} cuts by class, one id per example, but the labels are {list(labels.shape[1:])} per example; "
            "give class ids (one-hot rows: np.argmax(y, axis=1))"
        )
    return labels


def iid(num_examples: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """A seeded permutation cut into ``num_clients`` parts whose sizes differ by at most one."""
    _check_clients(num_examples, num_clients)
    rng = np.random.default_rng(seed)
    return [np.asarray(p, dtype=np.int64) for p in np.array_split(rng.permutation(num_examples), num_clients)]


def dirichlet(labels: np.ndarray, num_clients: int, alpha: float, seed: int, *, min_size: int = 1) -> list[np.ndarray]:
    """Per class, shares over the clients drawn from a symmetric Dirichlet(alpha)."""
    labels = _class_ids(labels, "dirichlet")
    if not alpha > 0 or not np.isfinite(alpha):
        raise PartitionError(f"alpha must be a positive number, got {alpha}")
    _check_clients(len(labels), num_clients, max(min_size, 1))
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    smallest = 0
    for _ in range(MAX_DIRICHLET_DRAWS):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = np.flatnonzero(labels == c)
            rng.shuffle(idx)
            shares = rng.dirichlet(np.full(num_clients, float(alpha)))
            if not (np.all(np.isfinite(shares)) and abs(shares.sum() - 1) < 1e-6):
                # a tiny alpha can underflow every gamma draw (the limit: the class on one client), a
                # huge one overflow them (numpy then gives NaN or zeros; the limit: equal shares, where
                # alpha=1.7e308 put each class on one client and said "raise alpha")
                shares = (
                    np.eye(num_clients)[rng.integers(num_clients)]
                    if alpha < 1
                    else np.full(num_clients, 1 / num_clients)
                )
            cuts = (np.cumsum(shares) * len(idx)).astype(np.int64)[:-1]
            # the chunks go to the clients in an order drawn per class: cutting at floor(cumsum) gives
            # the same clients the empty chunks of every class when the shares are nearly equal (a
            # large alpha over more clients than a class has examples), and they ended up with nothing
            for k, chunk in zip(rng.permutation(num_clients), np.split(idx, np.clip(cuts, 0, len(idx)))):
                parts[k].append(chunk)
        merged = [np.concatenate(p) for p in parts]
        smallest = min(len(p) for p in merged)
        if smallest >= min_size:
            return _shuffled(merged, rng)
    # at a large alpha every class is cut in nearly equal shares, so a class of fewer examples than
    # clients leaves most clients none of it whatever alpha is: raising it does not help then
    fixes = "raise alpha, lower min_size" if alpha < 1 else "lower min_size"
    raise PartitionError(
        f"after {MAX_DIRICHLET_DRAWS} Dirichlet draws (alpha={alpha:g}) some client still had {smallest} examples, "
        f"under min_size={min_size}; {fixes} or use fewer clients"
    )


def shards(labels: np.ndarray, num_clients: int, seed: int, *, shards_per_client: int = 2) -> list[np.ndarray]:
    """McMahan et al.'s split: sort by label, cut into shards, deal ``shards_per_client`` to each."""
    labels = _class_ids(labels, "shards")
    if shards_per_client < 1:
        raise PartitionError(f"shards_per_client must be at least 1, got {shards_per_client}")
    if 1 <= num_clients <= len(labels) < num_clients * shards_per_client:  # the shards are what to cut down
        raise PartitionError(
            f"{len(labels)} examples cannot be cut into {num_clients} clients x {shards_per_client} shards of one "
            f"example or more; give at most {len(labels) // num_clients} shards a client (shards=), or fewer clients"
        )
    _check_clients(len(labels), num_clients, shards_per_client)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(labels))  # which examples of a class share a shard is drawn too
    order = perm[np.argsort(labels[perm], kind="stable")]
    cut = np.array_split(order, num_clients * shards_per_client)
    deal = rng.permutation(num_clients * shards_per_client).reshape(num_clients, shards_per_client)
    return _shuffled([np.concatenate([cut[s] for s in row]) for row in deal], rng)


def pathological(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    classes_per_client: int = 2,
    mode: Literal["random", "deterministic", "first-deterministic"] = "first-deterministic",
) -> list[np.ndarray]:
    """Each client gets ``classes_per_client`` classes; a class's examples are split evenly among its clients."""
    labels = _class_ids(labels, "pathological")
    _check_clients(len(labels), num_clients)
    classes = np.unique(labels)
    if not 1 <= classes_per_client <= len(classes):
        raise PartitionError(
            f"classes_per_client must be between 1 and the {len(classes)} classes of the labels, got {classes_per_client}"
        )
    rng = np.random.default_rng(seed)
    chosen: list[list[int]] = []
    for client in range(num_clients):
        if mode == "random":
            picks = [int(i) for i in rng.choice(len(classes), size=classes_per_client, replace=False)]
        elif mode == "deterministic":
            picks = [(client + i) % len(classes) for i in range(classes_per_client)]
        elif mode == "first-deterministic":
            picks = [client % len(classes)]
            rest = [i for i in range(len(classes)) if i != picks[0]]
            picks += [int(i) for i in rng.choice(rest, size=classes_per_client - 1, replace=False)]
        else:
            raise PartitionError(f"mode must be 'random', 'deterministic' or 'first-deterministic', got {mode!r}")
        chosen.append(picks)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for ci, c in enumerate(classes):
        holders = [k for k in range(num_clients) if ci in chosen[k]]
        if not holders:
            continue
        idx = np.flatnonzero(labels == c)
        if len(idx) < len(holders):
            raise PartitionError(
                f"class {c.item()!r} has {len(idx)} examples but {len(holders)} clients need some; "
                "use fewer clients, fewer classes_per_client or mode=deterministic"
            )
        rng.shuffle(idx)
        for k, chunk in zip(holders, np.array_split(idx, len(holders))):
            parts[k].append(chunk)
    return _shuffled([np.concatenate(p) for p in parts], rng)


def quantity_skew(
    num_examples: int, num_clients: int, sigma: float, seed: int, *, min_size: int = 1
) -> list[np.ndarray]:
    """IID examples, client sizes proportional to log-normal(0, sigma) draws, at least ``min_size``."""
    if not sigma >= 0 or not np.isfinite(sigma):
        raise PartitionError(f"sigma must be a non-negative number, got {sigma}")
    if min_size < 0:
        raise PartitionError(f"min_size must not be negative, got {min_size}")
    _check_clients(num_examples, num_clients, max(min_size, 1))
    rng = np.random.default_rng(seed)
    # log-normal(0, sigma) weights over the largest, from the normal draws rng.lognormal makes (over
    # 12,000 seeds and sigmas the same sizes as its weights gave), so that a large sigma does not
    # overflow them: sigma=1000 made NaN shares and a ValueError
    normal = rng.standard_normal(num_clients)
    with np.errstate(over="ignore"):  # a product past float's range is -inf, a weight of 0
        weights = np.exp(float(sigma) * (normal - normal.max()))
    sizes = rng.multinomial(num_examples - num_clients * min_size, weights / weights.sum()) + min_size
    order = rng.permutation(num_examples)
    return [np.asarray(p, dtype=np.int64) for p in np.split(order, np.cumsum(sizes)[:-1])]


@dataclass(frozen=True)
class Partitioner:
    """Which partitioner to run and its parameters (what ``partition=...`` in a data spec names)."""

    scheme: Scheme
    num_clients: int
    alpha: float = 0.5
    shards_per_client: int = 2
    classes_per_client: int = 2
    mode: Literal["random", "deterministic", "first-deterministic"] = "first-deterministic"
    sigma: float = 1.0
    min_size: int = 1

    def assign(self, labels: np.ndarray, seed: int) -> list[np.ndarray]:
        """One index array per client."""
        labels = np.asarray(labels)
        if self.scheme == "iid":
            return iid(len(labels), self.num_clients, seed)
        if self.scheme == "dirichlet":
            return dirichlet(labels, self.num_clients, self.alpha, seed, min_size=self.min_size)
        if self.scheme == "shards":
            return shards(labels, self.num_clients, seed, shards_per_client=self.shards_per_client)
        if self.scheme == "pathological":
            return pathological(
                labels, self.num_clients, seed, classes_per_client=self.classes_per_client, mode=self.mode
            )
        if self.scheme == "quantity":
            return quantity_skew(len(labels), self.num_clients, self.sigma, seed, min_size=self.min_size)
        raise PartitionError(f"unknown partition scheme {self.scheme!r}; use one of {', '.join(SCHEMES)}")


def client_names(num_clients: int) -> list[str]:
    """Zero-padded ids, so that sorted order is numeric order."""
    width = len(str(max(num_clients - 1, 0)))
    return [f"{i:0{width}d}" for i in range(num_clients)]


def partition_arrays(
    features: Mapping[str, np.ndarray],
    partitioner: Partitioner,
    *,
    label: str,
    seed: int,
    test_split: TestSplit = "examples",
    test_fraction: float = 0.2,
    test: Mapping[str, np.ndarray] | None = None,
    source: str = "",
    vocabulary: tuple[str, ...] = (),
) -> FederatedDataset:
    """A centralized dataset (named arrays, ``label`` among them) cut into clients.

    The test split is, by default, a seeded share of each client's examples (so that per-client
    accuracy means something); ``test_split="clients"`` holds out whole clients instead, and a
    ``test`` set of arrays, if given, becomes one central test client named ``"central"`` (the
    dataset's ``test_split`` is then ``"central"``: no client has test examples of its own).
    """
    if label not in features:
        raise PartitionError(f"label {label!r} is not among the arrays {sorted(features)}")
    arrays = {name: np.asarray(a) for name, a in features.items()}
    n = len(arrays[label])
    for name, a in arrays.items():
        if a.ndim == 0 or len(a) != n:
            entries = len(a) if a.ndim else 0
            raise PartitionError(f"array {name!r} has {entries} entries but {label!r} has {n}; give one per example")
    parts = partitioner.assign(arrays[label], seed)
    clients = {cid: take(arrays, idx) for cid, idx in zip(client_names(len(parts)), parts)}
    source = source or f"{partitioner.scheme} partition into {partitioner.num_clients} clients"
    dealt = sum(len(p) for p in parts)
    if dealt < n:  # pathological classes no client drew: said where the run prints and records its data
        left = np.setdiff1d(np.unique(arrays[label]), np.unique(arrays[label][np.concatenate(parts)]))
        named = ", ".join(str(c.item()) for c in left[:10]) + (", ..." if len(left) > 10 else "")
        source += f" ({n - dealt} of {n} examples left out: no client has class {named})"
    if test_split == "none" and test is None:
        return FederatedDataset(clients, {}, label=label, test_split="none", source=source, vocabulary=vocabulary)
    if test_split not in ("examples", "clients", "none"):
        raise PartitionError(f"test_split must be 'examples', 'clients' or 'none', got {test_split!r}")
    if test is not None:  # no client's own test examples: per-client accuracy has nothing to measure
        return FederatedDataset(
            clients, {CENTRAL: dict(test)}, label=label, test_split="central", source=source, vocabulary=vocabulary
        )
    return with_test_split(
        clients,
        how="clients" if test_split == "clients" else "examples",
        fraction=test_fraction,
        seed=seed,
        label=label,
        source=source,
        vocabulary=vocabulary,
    )
