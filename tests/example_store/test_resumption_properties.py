"""Property: reading a selection in pieces, each resuming from the previous piece's token, gives
exactly the sequence of one read, on every implementation, whatever the pieces (limits, early
closes, batches)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from example_store import ExampleSelector, InMemoryExampleStore, InMemoryKeyStore, SQLiteExampleStore
from tests.example_store.store_helpers import IMPLEMENTATIONS

_uris = itertools.count()

timestamps = st.integers(0, 6).map(float) | st.floats(0, 6, allow_nan=False, allow_infinity=False)
bounds = st.none() | st.integers(-1, 7).map(float)
pieces = st.lists(
    st.one_of(
        st.tuples(st.just("limit"), st.integers(0, 6)),  # a session with selector.limit
        st.tuples(st.just("take"), st.integers(0, 6)),  # a session interrupted after k examples
        st.tuples(st.just("batches"), st.integers(1, 4), st.integers(0, 3)),  # k batches of b, then stop
    ),
    max_size=6,
)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    made = {
        "sqlite": SQLiteExampleStore(root / "plain.db"),
        "sqlite-sealed": SQLiteExampleStore(root / "sealed.db", key_store=InMemoryKeyStore()),
        "memory": InMemoryExampleStore(),
    }
    assert set(made) == set(IMPLEMENTATIONS)
    yield made
    for store in made.values():
        store.close()


def read_piece(store, selector: ExampleSelector, piece: tuple) -> tuple[list[int], str]:
    kind = piece[0]
    if kind == "limit":
        it = store.query(ExampleSelector(**{**selector.to_dict(), "limit": piece[1]}))
        got = [int(e["id"]) for e in it]
    elif kind == "take":
        it = store.query(selector)
        got = [int(e["id"]) for e in itertools.islice(it, piece[1])]
        it.close()
    else:
        _, batch_size, n_batches = piece
        it = store.query_batches(selector, batch_size)
        got = [int(i) for batch in itertools.islice(it, n_batches) for i in batch["id"]]
        it.close()
    return got, it.resumption_token()


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    impl=st.sampled_from(IMPLEMENTATIONS),
    ts=st.lists(timestamps, min_size=1, max_size=25),
    start=bounds,
    end=bounds,
    order=st.sampled_from(["oldest", "newest"]),
    plan=pieces,
)
def test_reading_in_pieces_with_tokens_equals_one_read(stores, impl, ts, start, end, order, plan):
    store = stores[impl]
    uri = f"app:/resume{next(_uris)}"
    store.add(uri, [{"id": np.int64(i), "v": np.float32(t)} for i, t in enumerate(ts)], timestamps=ts)
    base = ExampleSelector(uri, start_time=start, end_time=end, order=order)
    want = [int(e["id"]) for e in store.query(base)]

    got: list[int] = []
    token = None
    for piece in plan:
        selector = base.resuming(token)
        remaining = store.count(selector)
        assert remaining == len(want) - len(got)
        part, token = read_piece(store, selector, piece)
        got.extend(part)
    rest = [int(e["id"]) for e in store.query(base.resuming(token))]
    assert got + rest == want
