"""Behaviour every ExampleStore implementation shares: SQLite (plain and sealed) and in-memory.

Also the app's-own-store path: a custom store through the interface only."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from example_store import (
    CollectionStats,
    ExampleIterator,
    ExampleSelector,
    ExampleStore,
    InMemoryExampleStore,
    InvalidArgumentError,
    InvalidResumptionTokenError,
    ResumptionNotSupportedError,
    ResumptionTokens,
    RetentionPolicy,
    SchemaMismatchError,
    UnknownCollectionError,
)
from tests.example_store.store_helpers import URI, FakeClock, labels, make_examples


def test_round_trip_keeps_names_dtypes_shapes_and_values(any_store):
    examples = [
        {
            "img": np.random.default_rng(i).random((2, 3)).astype(np.float16),
            "label": np.int32(i),
            "mask": np.array([True, False, i % 2 == 0]),
            "w": np.float64(i) / 3,
        }
        for i in range(7)
    ]
    assert any_store.add(URI, examples) == 7
    with any_store.query(ExampleSelector(URI)) as it:
        got = list(it)
    assert len(got) == 7
    for want, have in zip(examples, got):
        assert list(have) == list(want)
        for name in want:
            assert isinstance(have[name], np.ndarray)
            assert have[name].dtype == np.asarray(want[name]).dtype and have[name].shape == np.shape(want[name])
            np.testing.assert_array_equal(have[name], want[name])
    assert any_store.collections() == [URI]
    assert any_store.schema(URI)["img"] == (np.dtype("<f2"), (2, 3))


def test_order_window_and_limit(any_store):
    any_store.add(URI, make_examples(10), timestamps=[5, 1, 9, 3, 3, 7, 0, 8, 2, 6])
    assert labels(any_store.query(ExampleSelector(URI))) == [6, 1, 8, 3, 4, 0, 9, 5, 7, 2]
    assert labels(any_store.query(ExampleSelector(URI, order="newest"))) == [2, 7, 5, 9, 0, 4, 3, 8, 1, 6]
    window = ExampleSelector(URI, start_time=2, end_time=7)
    assert labels(any_store.query(window)) == [8, 3, 4, 0, 9] and any_store.count(window) == 5
    limited = ExampleSelector(URI, start_time=2, end_time=7, limit=2, order="newest")
    assert labels(any_store.query(limited)) == [9, 0] and any_store.count(limited) == 2
    assert labels(any_store.query(ExampleSelector(URI, limit=0))) == []
    assert any_store.count(ExampleSelector(URI, start_time=100)) == 0


def test_query_batches(any_store):
    examples = make_examples(10)
    any_store.add(URI, examples, timestamps=range(10))
    with any_store.query_batches(ExampleSelector(URI), 4) as batches:
        got = list(batches)
    assert [b["x"].shape for b in got] == [(4, 3), (4, 3), (2, 3)]
    assert [b["y"].shape for b in got] == [(4,), (4,), (2,)]
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in got]), np.stack([e["x"] for e in examples]))
    with pytest.raises(InvalidArgumentError):
        any_store.query_batches(ExampleSelector(URI), 0)


def test_schema_mismatch_and_bad_input_write_nothing(any_store):
    any_store.add(URI, make_examples(2))
    with pytest.raises(SchemaMismatchError, match=r"x: float32\[3\], y: int64\[\]"):
        any_store.add(URI, make_examples(3, start=10) + [{"x": np.zeros(4, np.float32), "y": np.int64(0)}])
    with pytest.raises(InvalidArgumentError, match="fewer timestamps"):
        any_store.add(URI, make_examples(3), timestamps=[1, 2])
    with pytest.raises(InvalidArgumentError, match="more timestamps"):
        any_store.add(URI, make_examples(3), timestamps=[1, 2, 3, 4])
    assert any_store.count(ExampleSelector(URI)) == 2
    assert any_store.add("app:/empty", []) == 0 and any_store.collections() == [URI]


def test_unknown_collection(any_store):
    any_store.add(URI, make_examples(1))
    for call in (
        lambda: any_store.query(ExampleSelector("app:/other")),
        lambda: any_store.count(ExampleSelector("app:/other")),
        lambda: any_store.stats("app:/other"),
    ):
        with pytest.raises(UnknownCollectionError, match=r"app:/other.*store.add"):
            call()


def test_ttl_with_injected_clock(make_store):
    clock = FakeClock(1000.0)
    store = make_store(retention=RetentionPolicy(ttl_seconds=100), clock=clock)
    store.add(URI, make_examples(4), timestamps=[850, 950, 990, 1000])  # 850 expires on add
    assert labels(store.query(ExampleSelector(URI))) == [1, 2, 3]
    clock.now = 1089.0
    assert labels(store.query(ExampleSelector(URI))) == [2, 3]
    clock.now = 1200.0
    assert store.apply_retention() == 2
    assert store.count(ExampleSelector(URI)) == 0


def test_size_cap_and_per_collection_policy(make_store):
    store = make_store(retention=RetentionPolicy(max_bytes=110))  # 5 examples of 20 bytes
    store.add(URI, make_examples(4), timestamps=[10, 40, 20, 30])
    store.add(URI, make_examples(4, start=4), timestamps=[5, 50, 25, 40])
    assert labels(store.query(ExampleSelector(URI))) == [6, 3, 1, 7, 5]
    store.set_retention(URI, RetentionPolicy(max_bytes=40))
    assert labels(store.query(ExampleSelector(URI))) == [7, 5]
    store.add("app:/other", make_examples(8))
    assert store.count(ExampleSelector("app:/other")) == 5
    assert store.retention_for(URI) == RetentionPolicy(max_bytes=40)
    store.clear_retention(URI)
    assert store.retention_for(URI) == RetentionPolicy(max_bytes=110)


def test_helpers_stats_delete_before_delete_collection(make_store):
    clock = FakeClock(100.0)
    store = make_store(clock=clock)
    store.add(URI, make_examples(6), timestamps=[10, 20, 30, 40, 50, 60])
    stats = store.stats(URI)
    assert isinstance(stats, CollectionStats)
    assert (stats.count, stats.payload_bytes, stats.oldest, stats.newest) == (6, 120, 10.0, 60.0)
    assert stats.stored_bytes >= stats.payload_bytes
    assert stats.retention == RetentionPolicy()

    assert store.delete_before(URI, 30) == 2  # strictly before
    assert labels(store.query(ExampleSelector(URI))) == [2, 3, 4, 5]
    assert store.stats(URI).oldest == 30.0
    assert store.delete_before("app:/none", 30) == 0
    with pytest.raises(InvalidArgumentError):
        store.delete_before(URI, float("nan"))

    store.set_retention(URI, RetentionPolicy(ttl_seconds=55))  # cutoff 45: drops 30 and 40
    assert store.stats(URI).count == 2
    assert store.delete_collection(URI) == 2
    assert store.collections() == [] and store.delete_collection(URI) == 0
    with pytest.raises(UnknownCollectionError):
        store.query(ExampleSelector(URI))
    # a deleted collection may come back with a new schema
    store.add(URI, [{"z": np.zeros(2, np.int8)}], timestamps=[99])
    assert store.schema(URI) == {"z": (np.dtype("int8"), (2,))}
    assert store.stats(URI).count == 1


def test_empty_collection_stats(make_store):
    store = make_store()
    store.add(URI, make_examples(2), timestamps=[1, 2])
    store.delete_before(URI, 10)
    stats = store.stats(URI)
    assert (stats.count, stats.payload_bytes, stats.stored_bytes, stats.oldest, stats.newest) == (0, 0, 0, None, None)


@pytest.mark.parametrize("order", ["oldest", "newest"])
def test_resumption_tokens_continue_strictly_after_the_last_example(any_store, order):
    any_store.add(URI, make_examples(10), timestamps=[5, 1, 9, 3, 3, 7, 0, 8, 2, 6])
    full = labels(any_store.query(ExampleSelector(URI, order=order)))
    it = any_store.query(ExampleSelector(URI, order=order))
    start = it.resumption_token()  # nothing read yet: resumes at the start
    first = [int(next(it)["y"]) for _ in range(4)]
    mid = it.resumption_token()
    it.close()
    assert it.resumption_token() == mid  # stable after close
    assert labels(any_store.query(ExampleSelector(URI, order=order, resume_after=start))) == full
    rest_sel = ExampleSelector(URI, order=order, resume_after=mid)
    assert any_store.count(rest_sel) == 6
    with any_store.query(rest_sel) as rest_it:
        rest = labels(rest_it)
    assert first + rest == full
    # after exhaustion the token points past the end; new examples come next time (oldest first)
    done = rest_it.resumption_token()
    assert labels(any_store.query(ExampleSelector(URI, order=order, resume_after=done))) == []
    any_store.add(URI, make_examples(1, start=10), timestamps=[100 if order == "oldest" else -1])
    assert labels(any_store.query(ExampleSelector(URI, order=order, resume_after=done))) == [10]


def test_resumption_tokens_from_batches(any_store):
    any_store.add(URI, make_examples(10), timestamps=range(10))
    it = any_store.query_batches(ExampleSelector(URI), 3)
    assert next(it)["y"].tolist() == [0, 1, 2]
    assert next(it)["y"].tolist() == [3, 4, 5]
    token = it.resumption_token()
    it.close()
    got = [y for b in any_store.query_batches(ExampleSelector(URI, resume_after=token), 3) for y in b["y"].tolist()]
    assert got == [6, 7, 8, 9]


def test_bad_tokens_are_refused_with_a_clear_error(make_store):
    store = make_store()
    store.add(URI, make_examples(5), timestamps=range(5))
    store.add("app:/other", make_examples(5), timestamps=range(5))
    it = store.query(ExampleSelector(URI))
    next(it)
    token = it.resumption_token()
    it.close()
    with pytest.raises(InvalidResumptionTokenError, match="collection 'app:/digits'"):
        store.query(ExampleSelector("app:/other", resume_after=token))
    with pytest.raises(InvalidResumptionTokenError, match="order 'oldest'"):
        store.query(ExampleSelector(URI, order="newest", resume_after=token))
    with pytest.raises(InvalidResumptionTokenError, match="order 'oldest'"):
        store.count(ExampleSelector(URI, order="newest", resume_after=token))
    with pytest.raises(InvalidResumptionTokenError, match="not a resumption token"):
        store.query(ExampleSelector(URI, resume_after="garbage"))
    # a forged token: the same JSON body, edited to skip ahead, without the store's key
    body, tag = token.split(".")
    doc = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    doc["p"] = [3.0, doc["p"][1] + 3]
    forged_body = (
        base64.urlsafe_b64encode(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()).rstrip(b"=").decode()
    )
    with pytest.raises(InvalidResumptionTokenError, match="not issued by this example store"):
        store.query(ExampleSelector(URI, resume_after=f"{forged_body}.{tag}"))
    with pytest.raises(InvalidResumptionTokenError, match="not issued by this example store"):
        store.query(ExampleSelector(URI, resume_after=ResumptionTokens(b"k" * 32).issue(URI, "oldest", (3.0, 1))))
    # a token of another store (another key) is refused too
    other = make_store(fresh=True)
    other.add(URI, make_examples(5), timestamps=range(5))
    with other.query(ExampleSelector(URI)) as it2:
        next(it2)
        foreign = it2.resumption_token()
    with pytest.raises(InvalidResumptionTokenError, match="not issued by this example store"):
        store.query(ExampleSelector(URI, resume_after=foreign))


def test_sqlite_tokens_survive_a_reopen(make_store):
    if make_store.kind == "memory":
        pytest.skip("nothing to reopen")
    store = make_store()
    store.add(URI, make_examples(6), timestamps=range(6))
    with store.query(ExampleSelector(URI, limit=2)) as it:
        list(it)
    token = it.resumption_token()
    store.close()
    reopened = make_store()
    assert labels(reopened.query(ExampleSelector(URI, resume_after=token))) == [2, 3, 4, 5]


def test_persisted_retention_survives_reopen(make_store):
    if make_store.kind == "memory":
        pytest.skip("nothing persists in memory")
    store = make_store()
    store.set_retention(URI, RetentionPolicy(max_bytes=40, ttl_seconds=3600.0))
    store.set_retention("app:/later", RetentionPolicy(ttl_seconds=60))  # a collection not created yet
    store.set_retention("app:/gone", RetentionPolicy(ttl_seconds=1))
    store.clear_retention("app:/gone")
    store.close()
    reopened = make_store(retention=RetentionPolicy(max_bytes=10_000))
    assert reopened.retention_for(URI) == RetentionPolicy(ttl_seconds=3600.0, max_bytes=40)
    assert reopened.retention_for("app:/later") == RetentionPolicy(ttl_seconds=60)
    assert reopened.retention_for("app:/gone") == RetentionPolicy(max_bytes=10_000)  # the default
    reopened.add(URI, make_examples(5))
    assert reopened.count(ExampleSelector(URI)) == 2  # the saved cap applied on add


# -- an app's own store, through the interface only ---------------------------------------------


class ListStore(ExampleStore):
    """A minimal app-side store: no resumption, default query_batches."""

    def __init__(self, examples: list[dict]) -> None:
        self.examples = examples

    def query(self, selector: ExampleSelector) -> ExampleIterator:
        items = iter(self.examples[: selector.limit])

        class It(ExampleIterator):
            def __next__(self):
                return next(items)

            def close(self):
                pass

        return It()

    def count(self, selector: ExampleSelector) -> int:
        return len(self.examples[: selector.limit])


def test_a_custom_store_without_resumption_says_so():
    store = ListStore(make_examples(3))
    batches = store.query_batches(ExampleSelector(URI), 2)
    assert [b["y"].tolist() for b in batches] == [[0, 1], [2]]
    with pytest.raises(ResumptionNotSupportedError, match="ListStore|It"):
        batches.resumption_token()
    with pytest.raises(NotImplementedError):
        store.query(ExampleSelector(URI)).resumption_token()


def test_in_memory_store_serves_the_runtime_interface():
    store = InMemoryExampleStore()
    assert isinstance(store, ExampleStore)
    store.add(URI, make_examples(5), timestamps=range(5))
    batches = store.query_batches(ExampleSelector(URI, order="newest"), 2)
    assert [b["y"].tolist() for b in batches] == [[4, 3], [2, 1], [0]]
    assert batches.resumption_token()
    store.close()
    with pytest.raises(Exception, match="closed"):
        store.query(ExampleSelector(URI))


def test_delete_all_leaves_no_collection_nor_policy_and_the_store_goes_on(any_store):
    any_store.add(URI, make_examples(4))
    any_store.add("app:/other", [{"y": np.int64(1)}])
    any_store.set_retention(URI, RetentionPolicy(ttl_seconds=60))
    assert any_store.delete_all() == 5
    assert any_store.collections() == [] and any_store.retention_for(URI) == RetentionPolicy()
    with pytest.raises(UnknownCollectionError):
        any_store.count(ExampleSelector(URI))
    any_store.add(URI, [{"y": np.int64(7)}])  # a new schema: the old one went with its collection
    assert labels(any_store.query(ExampleSelector(URI))) == [7]
