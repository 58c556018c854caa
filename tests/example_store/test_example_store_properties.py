"""Property: a query, by example or by batch, returns exactly what a plain Python filter and
sort of the inserted examples gives (ties in timestamp broken by insertion order), in SQLite and
in memory alike; a batch iterator's token resumes right after the last batch returned."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from example_store import (
    ExampleSelector,
    InMemoryExampleStore,
    InvalidArgumentError,
    SchemaMismatchError,
    SQLiteExampleStore,
)

_uris = itertools.count()

timestamps = st.integers(0, 20).map(float) | st.floats(0, 20, allow_nan=False, allow_infinity=False)
bounds = st.none() | st.integers(-1, 21).map(float) | st.floats(-1, 21, allow_nan=False, allow_infinity=False)


@st.composite
def scenarios(draw):
    batches = draw(st.lists(st.lists(timestamps, max_size=12), min_size=1, max_size=3))
    selector = dict(
        start_time=draw(bounds),
        end_time=draw(bounds),
        limit=draw(st.none() | st.integers(0, 40)),
        order=draw(st.sampled_from(["oldest", "newest"])),
    )
    batch_size = draw(st.integers(1, 7))
    return batches, selector, batch_size, draw(st.integers(0, 2**32 - 1))


def expected(inserted, sel):
    keep = [
        (ts, i)
        for i, (ts, _) in enumerate(inserted)
        if (sel["start_time"] is None or ts >= sel["start_time"]) and (sel["end_time"] is None or ts < sel["end_time"])
    ]
    keep.sort(reverse=sel["order"] == "newest")
    return [i for _, i in keep][: sel["limit"]]


@pytest.fixture(scope="module", params=["sqlite", "memory"])
def shared_store(request, tmp_path_factory):
    """One store for the whole property run (a fresh collection per example) keeps it fast."""
    if request.param == "memory":
        with InMemoryExampleStore() as store:
            yield store
        return
    with SQLiteExampleStore(tmp_path_factory.mktemp("prop") / "app.db") as store:
        yield store


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_query_matches_a_python_filter_and_sort(shared_store, scenario):
    batches, sel, batch_size, seed = scenario
    rng = np.random.default_rng(seed)
    uri = f"app:/prop{next(_uris)}"
    inserted = []  # (timestamp, example) in insertion order
    store = shared_store
    for ts_batch in batches:
        examples = [
            {
                "id": np.int64(len(inserted) + k),
                "x": rng.standard_normal((2, 3)).astype(np.float32),
                "flag": rng.random(2) < 0.5,
            }
            for k in range(len(ts_batch))
        ]
        assert store.add(uri, examples, timestamps=ts_batch) == len(ts_batch)
        inserted.extend(zip(ts_batch, examples))
    if not inserted:
        return
    selector = ExampleSelector(uri, **sel)
    want = expected(inserted, sel)

    with store.query(selector) as it:
        got = list(it)
    assert [int(e["id"]) for e in got] == want
    for e, i in zip(got, want):
        np.testing.assert_array_equal(e["x"], inserted[i][1]["x"])
        np.testing.assert_array_equal(e["flag"], inserted[i][1]["flag"])
    assert store.count(selector) == len(want)

    batches_out = list(store.query_batches(selector, batch_size))
    assert all(len(b["id"]) == batch_size for b in batches_out[:-1])
    ids = np.concatenate([b["id"] for b in batches_out]).tolist() if batches_out else []
    assert ids == want
    if want:
        xs = np.concatenate([b["x"] for b in batches_out])
        np.testing.assert_array_equal(xs, np.stack([inserted[i][1]["x"] for i in want]))
    if len(batches_out) > 1:  # stop after the first batch: the token continues from there
        it = store.query_batches(selector, batch_size)
        next(it)
        token = it.resumption_token()
        it.close()
        rest = store.query_batches(ExampleSelector(uri, **{**sel, "limit": None}, resume_after=token), batch_size)
        assert np.concatenate([b["id"] for b in rest]).tolist()[: len(want) - batch_size] == want[batch_size:]


@settings(max_examples=60, deadline=None)
@given(
    before=st.integers(0, 5),
    n=st.integers(0, 12),
    stamp=timestamps,
    shape=st.sampled_from([(), (3,), (2, 2)]),
    dtype=st.sampled_from(["<f4", ">f4", "<i8", "?"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_columns_go_in_as_their_rows_would(before, n, stamp, shape, dtype, seed):
    """``add_columns`` stores what ``add`` of each row as an example stores: the same count, keys
    and payloads, so every query answers alike."""
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, *shape)) * 3).astype(dtype)
    y = rng.integers(0, 9, size=n)
    earlier = [{"x": np.zeros(shape, dtype=dtype), "y": np.int64(1)} for _ in range(before)]
    by_rows, by_columns = InMemoryExampleStore(clock=lambda: 5.0), InMemoryExampleStore(clock=lambda: 5.0)
    for store in (by_rows, by_columns):
        store.add("app:/c", earlier, timestamps=[10.0] * before)
    assert by_rows.add("app:/c", [{"x": x[i], "y": y[i]} for i in range(n)], timestamps=[stamp] * n) == n
    assert by_columns.add_columns("app:/c", {"x": x, "y": y}, timestamp=stamp) == n
    if before + n == 0:
        assert by_rows.collections() == by_columns.collections() == []
        return
    for order in ("oldest", "newest"):
        selector = ExampleSelector("app:/c", order=order)
        rows = [(e["x"].tobytes(), int(e["y"])) for e in by_rows.query(selector)]
        assert [(e["x"].tobytes(), int(e["y"])) for e in by_columns.query(selector)] == rows
    assert by_rows._collections["app:/c"].keys == by_columns._collections["app:/c"].keys


def test_columns_that_do_not_fit_the_collection_are_refused():
    store = InMemoryExampleStore()
    store.add("app:/c", [{"x": np.zeros(3, np.float32)}])
    with pytest.raises(SchemaMismatchError, match="tensor 'x' has shape"):
        store.add_columns("app:/c", {"x": np.zeros((2, 4), np.float32)})
    with pytest.raises(SchemaMismatchError, match="tensor 'x' has dtype float64"):
        store.add_columns("app:/c", {"x": np.zeros((2, 3))})
    with pytest.raises(SchemaMismatchError, match="tensors \\['x', 'y'\\]"):
        store.add_columns("app:/c", {"x": np.zeros((2, 3), np.float32), "y": np.zeros(2)})
    with pytest.raises(InvalidArgumentError, match="one length"):
        store.add_columns("app:/c", {"x": np.zeros((2, 3), np.float32), "y": np.zeros(3)})
    assert store.count(ExampleSelector("app:/c")) == 1  # nothing of a refused call went in
