"""The FederatedDataset value: one schema for every client, sorted client order, seeded splits."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.fleet.federated_data import DataLayoutError, FederatedDataset, split_clients, split_examples


def test_clients_iterate_sorted_whatever_order_they_came_in() -> None:
    data = FederatedDataset({"b": {"x": np.zeros((2, 3))}, "a": {"x": np.ones((1, 3))}, "c": {"x": np.zeros((0, 3))}})
    assert data.client_ids == ("a", "b") and [c for c, _ in data] == ["a", "b"]
    assert data.features["x"].shape == (3,) and data.sizes() == {"a": 1, "b": 2}


@pytest.mark.parametrize(
    ("clients", "message"),
    [
        ({"a": {"x": np.zeros((2, 3)), "y": np.zeros(3)}}, "ragged features"),
        ({"a": {"x": np.zeros((2, 3))}, "b": {"z": np.zeros((2, 3))}}, "every client needs the same features"),
        ({"a": {"x": np.zeros((2, 3))}, "b": {"x": np.zeros((2, 3), dtype=np.int64)}}, "one dtype and shape"),
        ({"a": {"x": [[1.0, 2.0], [3.0]]}}, "ragged"),
        ({"a": {"x": np.zeros((0, 3))}}, "no client with training examples"),
    ],
)
def test_clients_that_do_not_share_one_schema_are_refused(clients: dict, message: str) -> None:
    with pytest.raises(DataLayoutError, match=message):
        FederatedDataset(clients)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=2, max_size=12), st.floats(0.05, 0.9), st.integers(0, 2**32 - 1))
def test_splits_keep_every_example_once_and_depend_only_on_the_seed(
    sizes: list[int], fraction: float, seed: int
) -> None:
    clients = {f"c{i}": {"x": np.arange(n) + 1000 * i} for i, n in enumerate(sizes)}
    train, test = split_examples(clients, fraction, seed)
    for cid, examples in clients.items():
        got = np.concatenate([train[cid]["x"], test.get(cid, {"x": np.zeros(0, int)})["x"]])
        assert sorted(got) == list(examples["x"]) and len(train[cid]["x"]) >= 1
    assert all(np.array_equal(train[c]["x"], split_examples(clients, fraction, seed)[0][c]["x"]) for c in clients)
    kept, held = split_clients(clients, fraction, seed)
    assert set(kept) | set(held) == set(clients) and not set(kept) & set(held) and kept and held


def test_text_features_are_python_strings_whether_given_as_bytes_or_unicode() -> None:
    data = FederatedDataset({"a": {"t": np.array([b"caf\xc3\xa9", b"x"]), "u": ["p", "q"]}})
    assert data.features["t"].dtype == "str" == data.features["u"].dtype
    assert list(data.examples("a")["t"]) == ["café", "x"] and data.examples("a")["u"].dtype == object
    with pytest.raises(DataLayoutError, match="ragged or mixed"):
        FederatedDataset({"a": {"t": np.array([None, "x"], dtype=object)}})


def test_a_test_split_of_examples_that_holds_out_none_says_so() -> None:
    """Clients of one example keep it for training: the run measured no accuracy and said nothing."""
    from emulator.fleet.federated_data import load_data

    single = load_data("digits,partition=iid,clients=1797")
    says = (
        "no test split, so no accuracy: each client's one example stays for training; "
        "test_split=clients holds out whole clients"
    )
    assert single.test_split == "none" and single.test_note == says and single.describe().endswith(f"; {says}")
    assert single.renamed({"x": "pixels"}).test_note == says and says not in single.source
    assert not load_data("digits,partition=iid,clients=1797,test_split=none").test_note
    assert not load_data("digits,partition=iid,clients=10").test_note
