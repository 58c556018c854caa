"""The partitioners' promises for any labels, client count and seed: the disjoint ones deal every
example exactly once, a seed gives the same cut, label skew shrinks as alpha grows, pathological
clients hold exactly k classes, and shards hold at most k labels when shards do not straddle. The
flwr-datasets comparison behind these is in docs/howto/datasets.md; flwr-datasets is not imported."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.fleet.federated_data import (
    Partitioner,
    PartitionError,
    dirichlet,
    iid,
    partition_arrays,
    pathological,
    quantity_skew,
    shards,
)

FAST = settings(max_examples=40, deadline=None)


@st.composite
def labelled(draw: st.DrawFn) -> tuple[np.ndarray, int, int]:
    classes = draw(st.integers(1, 8))
    n = draw(st.integers(classes * 4, 300))
    seed = draw(st.integers(0, 2**32 - 1))
    labels = np.random.default_rng(seed).integers(0, classes, n)
    labels[:classes] = np.arange(classes)  # every class present
    clients = draw(st.integers(1, max(1, n // 4)))
    return labels, clients, seed


def _exactly_once(parts: list[np.ndarray], n: int) -> None:
    joined = np.concatenate(parts)
    assert len(joined) == n and np.array_equal(np.sort(joined), np.arange(n))


@FAST
@given(labelled(), st.sampled_from(["iid", "dirichlet", "shards", "quantity"]))
def test_every_example_goes_to_exactly_one_client_and_the_seed_fixes_the_cut(
    case: tuple[np.ndarray, int, int], scheme: str
) -> None:
    labels, clients, seed = case
    k = 2 if len(labels) >= 2 * clients else 1
    partitioner = Partitioner(scheme, clients, alpha=1.0, shards_per_client=k, min_size=0)  # type: ignore[arg-type]
    parts = partitioner.assign(labels, seed)
    assert len(parts) == clients
    _exactly_once(parts, len(labels))
    again = partitioner.assign(labels, seed)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


@FAST
@given(labelled(), st.sampled_from(["dirichlet", "shards", "pathological"]))
def test_labels_of_one_column_are_cut_as_the_class_ids_they_hold(
    case: tuple[np.ndarray, int, int], scheme: str
) -> None:
    """Keras' CIFAR labels are [N, 1]: shards sorted along that one column and dealt one example
    over and over."""
    labels, clients, seed = case
    partitioner = Partitioner(scheme, clients, shards_per_client=1, classes_per_client=1, min_size=0)  # type: ignore[arg-type]
    flat, column = partitioner.assign(labels, seed), partitioner.assign(labels[:, None], seed)
    assert all(np.array_equal(a, b) for a, b in zip(flat, column, strict=True))


@FAST
@given(labelled(), st.integers(1, 4))
def test_pathological_clients_hold_at_most_k_classes_and_no_example_twice(
    case: tuple[np.ndarray, int, int], k: int
) -> None:
    labels, clients, seed = case
    classes = len(np.unique(labels))
    k = min(k, classes)
    clients = min(clients, int(np.bincount(labels).min()))  # every class can reach every client
    parts = pathological(labels, clients, seed, classes_per_client=k)
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined)  # disjoint
    assert all(len(np.unique(labels[p])) == k for p in parts)  # each holder of a class gets some of it
    if clients >= classes:  # first-deterministic uses every class, so every example is dealt
        _exactly_once(parts, len(labels))


@FAST
@given(st.integers(1, 6), st.integers(1, 10), st.integers(1, 3), st.integers(0, 2**32 - 1))
def test_shards_that_do_not_straddle_classes_give_each_client_at_most_k_labels(
    classes: int, clients: int, k: int, seed: int
) -> None:
    shard = 5
    shards_total = clients * k
    per_class = np.full(classes, shards_total // classes)
    per_class[: shards_total % classes] += 1
    labels = np.repeat(np.arange(classes), per_class * shard)  # every class a multiple of the shard size
    if len(labels) == 0 or np.any(per_class == 0):
        return
    parts = shards(labels, clients, seed, shards_per_client=k)
    _exactly_once(parts, len(labels))
    assert all(len(np.unique(labels[p])) <= k for p in parts)


def _skew(parts: list[np.ndarray], labels: np.ndarray) -> float:
    """Mean total-variation distance between a client's label mix and the global one."""
    classes = np.unique(labels)
    overall = np.array([(labels == c).mean() for c in classes])
    dists = [
        0.5 * np.abs(np.array([(labels[p] == c).mean() for c in classes]) - overall).sum() for p in parts if len(p)
    ]
    return float(np.mean(dists))


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_label_skew_decreases_as_alpha_grows(seed: int) -> None:
    labels = np.repeat(np.arange(10), 200)
    skews = [_skew(dirichlet(labels, 20, alpha, seed, min_size=0), labels) for alpha in (0.05, 1.0, 100.0)]
    assert skews[0] > skews[1] > skews[2]


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_a_large_alpha_deals_every_client_examples_when_clients_outnumber_a_class(seed: int) -> None:
    """Near-equal shares cut at floor(cumsum) left the same clients empty in every class: the
    digits' 180 examples a class over 200 clients at alpha 1e9 failed 100 draws in a row."""
    labels = np.repeat(np.arange(10), 180)
    parts = dirichlet(labels, 200, 1e9, seed)
    assert min(len(p) for p in parts) >= 1
    _exactly_once(parts, len(labels))


@FAST
@given(
    st.integers(20, 400),
    st.integers(1, 10),
    st.floats(0.0, 3.0) | st.floats(3.0, 1.7976931348623157e308),  # sigma=1000 overflowed numpy's lognormal
    st.integers(0, 2**32 - 1),
)
def test_quantity_skew_gives_every_client_at_least_min_size(n: int, clients: int, sigma: float, seed: int) -> None:
    parts = quantity_skew(n, clients, sigma, seed, min_size=2)
    assert min(len(p) for p in parts) >= 2
    _exactly_once(parts, n)


@FAST
@given(labelled(), st.integers(1, 3))
def test_iid_sizes_differ_by_at_most_one_and_shard_sizes_by_at_most_the_shards_a_client_holds(
    case: tuple[np.ndarray, int, int], k: int
) -> None:
    labels, clients, seed = case
    sizes = [len(p) for p in iid(len(labels), clients, seed)]
    assert max(sizes) - min(sizes) <= 1
    k = min(k, len(labels) // clients)
    sizes = [len(p) for p in shards(labels, clients, seed, shards_per_client=k)]
    assert max(sizes) - min(sizes) <= k  # k shards each, shards differ by at most one example


@FAST
@given(labelled(), st.floats(0.01, 1000.0), st.integers(0, 3))
def test_a_dirichlet_cut_gives_every_client_min_size_or_says_what_to_change(
    case: tuple[np.ndarray, int, int], alpha: float, min_size: int
) -> None:
    labels, clients, seed = case
    try:
        parts = dirichlet(labels, clients, alpha, seed, min_size=min_size)
    except PartitionError as e:
        assert str(e).endswith("or use fewer clients") and ("raise alpha" in str(e)) == (alpha < 1)
        return
    assert min(len(p) for p in parts) >= min_size
    _exactly_once(parts, len(labels))


@settings(max_examples=10, deadline=None)
@given(st.floats(1e300, 1.7976931348623157e308), st.integers(0, 2**32 - 1))
def test_an_alpha_that_overflows_numpy_s_gamma_draws_cuts_near_equal_shares(alpha: float, seed: int) -> None:
    """numpy's Dirichlet at alpha=1.7e308 is all zeros (NaN in other versions); such draws put each
    class on one client, and the cut failed saying "raise alpha". The limit is equal shares."""
    labels = np.repeat(np.arange(10), 50)
    parts = dirichlet(labels, 10, alpha, seed)
    _exactly_once(parts, len(labels))
    assert all(len(np.unique(labels[p])) == 10 for p in parts)
    assert max(len(p) for p in parts) <= 60


@FAST
@given(labelled(), st.sampled_from(["random", "deterministic", "first-deterministic"]))
def test_pathological_examples_no_client_holds_are_named_in_the_dataset_source(
    case: tuple[np.ndarray, int, int], mode: str
) -> None:
    labels, clients, seed = case
    clients = min(clients, int(np.bincount(labels).min()))
    x = np.arange(len(labels), dtype=np.float32)  # the example's own index, to find it again
    partitioner = Partitioner("pathological", clients, classes_per_client=1, mode=mode)  # type: ignore[arg-type]
    data = partition_arrays({"x": x, "y": labels}, partitioner, label="y", seed=seed, test_split="none")
    held = np.concatenate([examples["x"] for _, examples in data]).astype(np.int64)
    assert len(np.unique(held)) == len(held)
    left = np.setdiff1d(np.arange(len(labels)), held)
    if len(left) == 0:
        assert "left out" not in data.source
    else:
        missing = np.unique(labels[left])
        assert not np.isin(missing, labels[held]).any()  # whole classes are left out, nothing else
        assert f"({len(left)} of {len(labels)} examples left out: no client has class " in data.source
        assert data.source.endswith(", ".join(str(c) for c in missing[:10]) + (", ...)" if len(missing) > 10 else ")"))


def test_impossible_cuts_say_what_to_change() -> None:
    with pytest.raises(PartitionError, match="use at most 5 clients"):
        iid(5, 6, seed=0)
    with pytest.raises(PartitionError, match=r"^num_clients \(the data spec's clients=\) must be at least 1, got -3$"):
        iid(5, -3, seed=0)  # what --data digits,clients=-3 is told
    with pytest.raises(PartitionError, match="classes_per_client"):
        pathological(np.array([0, 1, 0, 1]), 2, 0, classes_per_client=3)
    with pytest.raises(PartitionError, match=r"into 10 clients x 1000 shards .*; give at most 179 shards a client"):
        shards(np.arange(1797) % 10, 10, 0, shards_per_client=1000)  # was "use at most 1 clients"
    with pytest.raises(PartitionError, match="raise alpha"):
        dirichlet(np.repeat(np.arange(2), 10), 10, 0.01, 0, min_size=2)
    with pytest.raises(PartitionError, match=r"alpha=1e\+09\) .*; lower min_size or use fewer clients$"):
        dirichlet(np.repeat(np.arange(10), 50), 200, 1e9, 0)  # classes of 50 over 200 clients: alpha is not why
    with pytest.raises(PartitionError, match="alpha must be"):
        dirichlet(np.zeros(4), 2, 0.0, 0)
    with pytest.raises(PartitionError, match=r"labels are \[3\] per example; give class ids \(one-hot rows"):
        shards(np.eye(3)[[0, 1, 2, 0]], 2, 0)  # an IndexError from dirichlet, nonsense cuts from the others
    labels = np.r_[np.zeros(20, np.int64), [10**12]]  # one example of class 10**12, and 20 clients that want it
    with pytest.raises(PartitionError, match=r"^class 1000000000000 has 1 examples but \d+ clients need some"):
        pathological(labels, 20, 0, classes_per_client=2)


def test_partition_arrays_makes_a_dataset_with_per_client_test_examples() -> None:
    rng = np.random.default_rng(0)
    x, y = rng.random((200, 3)).astype(np.float32), rng.integers(0, 4, 200)
    data = partition_arrays({"x": x, "y": y}, Partitioner("dirichlet", 8, alpha=0.5), label="y", seed=1)
    assert len(data) == 8 and data.test_split == "examples"
    assert data.num_examples("train") + data.num_examples("test") == 200
    assert set(data.test) <= set(data.train)
    same = partition_arrays({"x": x, "y": y}, Partitioner("dirichlet", 8, alpha=0.5), label="y", seed=1)
    assert all(np.array_equal(same.train[c]["x"], data.train[c]["x"]) for c in data.client_ids)
