"""Retention in the SQLite store against a model: after any adds, policies and clock moves, the
examples left are exactly those the policies allow, and every call reports what it deleted.

The model is the README's rule: an example expires once ``now - timestamp > ttl_seconds``; a
collection keeps at most ``max_bytes // record_size`` examples, the newest by (timestamp, id)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from example_store import ExampleSelector, InMemoryKeyStore, InvalidArgumentError, RetentionPolicy, SQLiteExampleStore
from tests.example_store.store_helpers import FakeClock

RECORD = 8  # one float64 per example
A, B = "app:/a", "app:/b"

policies = st.builds(
    RetentionPolicy,
    ttl_seconds=st.none() | st.integers(0, 40).map(float),
    max_bytes=st.none() | st.integers(0, 6).map(lambda k: k * RECORD + (RECORD - 1 if k % 2 else 0)),
)

steps = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from([A, B]), st.lists(st.integers(-30, 30), min_size=1, max_size=4)),
        st.tuples(st.just("set"), st.sampled_from([A, B]), policies),
        st.tuples(st.just("clear"), st.sampled_from([A, B])),
        st.tuples(st.just("tick"), st.integers(0, 25)),
        st.tuples(
            st.just("apply"),
        ),
        st.tuples(st.just("delete_before"), st.sampled_from([A, B]), st.integers(-30, 60)),
        st.tuples(st.just("stats"), st.sampled_from([A, B])),
    ),
    min_size=3,
    max_size=14,
)


class Model:
    def __init__(self, default: RetentionPolicy) -> None:
        self.default = default
        self.own: dict[str, RetentionPolicy] = {}
        self.rows: dict[str, list[tuple[float, int]]] = {A: [], B: []}  # (timestamp, id)
        self.next_id = 0

    def policy(self, uri: str) -> RetentionPolicy:
        return self.own.get(uri, self.default)

    def apply(self, uri: str, now: float, policy: RetentionPolicy | None = None) -> int:
        policy = policy or self.policy(uri)
        before = len(self.rows[uri])
        rows = self.rows[uri]
        if policy.ttl_seconds is not None:
            rows = [r for r in rows if not now - r[0] > policy.ttl_seconds]
        if policy.max_bytes is not None:
            keep = policy.max_bytes // RECORD
            rows = sorted(rows)[len(rows) - keep :] if len(rows) > keep else rows
        self.rows[uri] = sorted(rows)
        return before - len(self.rows[uri])

    def expire(self, uri: str, now: float) -> None:
        ttl = self.policy(uri).ttl_seconds
        if ttl is not None:
            self.rows[uri] = [r for r in self.rows[uri] if not now - r[0] > ttl]


def stored(store: SQLiteExampleStore, uri: str) -> list[float]:
    if uri not in store.collections():
        return []
    return sorted(float(e["t"]) for e in store.query(ExampleSelector(uri)))


@settings(max_examples=60, deadline=None)
@given(default=policies, sealed=st.booleans(), script=steps)
def test_the_examples_left_are_those_the_policies_allow(tmp_path_factory, default, sealed, script):
    clock = FakeClock(100.0)
    kwargs = {"key_store": InMemoryKeyStore()} if sealed else {}
    store = SQLiteExampleStore(tmp_path_factory.mktemp("r") / "app.db", retention=default, clock=clock, **kwargs)
    model = Model(default)
    try:
        for step in script:
            kind = step[0]
            now = clock.now
            if kind == "add":
                _, uri, offsets = step
                stamps = [now + o for o in offsets]
                store.add(uri, [{"t": np.float64(t)} for t in stamps], timestamps=stamps)
                for t in stamps:
                    model.rows[uri].append((t, model.next_id))
                    model.next_id += 1
                model.apply(uri, now)
            elif kind == "set":
                _, uri, policy = step
                store.set_retention(uri, policy)
                model.own[uri] = policy
                if store.collections().count(uri):
                    model.apply(uri, now, policy)
                assert store.retention_for(uri) == policy
            elif kind == "clear":
                store.clear_retention(step[1])
                model.own.pop(step[1], None)
                assert store.retention_for(step[1]) == default
            elif kind == "tick":
                clock.now += step[1]
            elif kind == "apply":
                expected = sum(model.apply(uri, now) for uri in (A, B) if uri in store.collections())
                assert store.apply_retention() == expected
            elif kind == "delete_before":
                _, uri, offset = step
                cutoff = now + offset
                gone = [r for r in model.rows[uri] if r[0] < cutoff]
                model.rows[uri] = [r for r in model.rows[uri] if r[0] >= cutoff]
                assert store.delete_before(uri, cutoff) == len(gone)
            else:
                uri = step[1]
                if uri in store.collections():
                    model.expire(uri, now)
                    stats = store.stats(uri)
                    assert stats.count == len(model.rows[uri])
                    assert stats.payload_bytes == RECORD * len(model.rows[uri])
                    assert stats.retention == model.policy(uri)
            for uri in (A, B):
                if kind == "stats" or kind == "apply" or (kind in ("add", "set", "delete_before") and uri == step[1]):
                    model.expire(uri, now)  # a read first drops what the TTL no longer allows
                    assert stored(store, uri) == [t for t, _ in model.rows[uri]], (kind, uri)
    finally:
        store.close()


def test_the_policies_another_process_saved_hold_at_once(tmp_path):
    """A policy another process saved holds in this store from its next add or read, where this
    store kept the policies it read when it opened until its own apply_retention (and read, for
    as long, examples past a TTL the app had set)."""
    clock = FakeClock(100.0)
    path = tmp_path / "app.db"
    mine = SQLiteExampleStore(path, clock=clock)
    for uri in (A, B):
        mine.add(uri, [{"t": np.float64(t)} for t in (10, 50, 90)], timestamps=[10.0, 50.0, 90.0])
    other = SQLiteExampleStore(path, clock=clock)
    other.set_retention(A, RetentionPolicy(max_bytes=2 * RECORD))  # applied at once: one deleted
    other.set_retention(B, RetentionPolicy(max_bytes=RECORD))  # two deleted
    other.close()
    assert mine.retention_for(A) == RetentionPolicy(max_bytes=2 * RECORD)
    mine.add(A, [{"t": np.float64(95)}], timestamps=[95.0])  # A: 90, 95
    mine.add(B, [{"t": np.float64(96)}], timestamps=[96.0])  # B: 96
    assert stored(mine, A) == [90.0, 95.0] and stored(mine, B) == [96.0]
    assert mine.apply_retention() == 0
    mine.close()


def test_a_policy_with_both_rules_reports_everything_it_deleted(tmp_path):
    """The TTL and then the cap, in one pass, both counted in what apply_retention returns (here
    the store's default policy, which another store on the file did not apply)."""
    clock = FakeClock(100.0)
    other = SQLiteExampleStore(tmp_path / "app.db", clock=clock)
    other.add(
        A, [{"t": np.float64(t)} for t in (10, 20, 80, 90, 95, 99)], timestamps=[10.0, 20.0, 80.0, 90.0, 95.0, 99.0]
    )
    other.close()
    mine = SQLiteExampleStore(
        tmp_path / "app.db", clock=clock, retention=RetentionPolicy(ttl_seconds=50.0, max_bytes=2 * RECORD)
    )
    assert mine.apply_retention() == 4  # 10 and 20 by age, then 80 and 90 by the cap
    assert stored(mine, A) == [95.0, 99.0]
    mine.close()


def test_apply_retention_applies_a_ttl_as_well_as_a_cap(tmp_path):
    clock = FakeClock(100.0)
    other = SQLiteExampleStore(tmp_path / "app.db", clock=clock)
    other.add(
        A, [{"t": np.float64(t)} for t in (10, 20, 80, 90, 95, 99)], timestamps=[10.0, 20.0, 80.0, 90.0, 95.0, 99.0]
    )
    other.close()
    mine = SQLiteExampleStore(
        tmp_path / "app.db", clock=clock, retention=RetentionPolicy(ttl_seconds=15.0, max_bytes=5 * RECORD)
    )
    assert mine.apply_retention() == 3  # older than 85 s; the cap of five alone would take one
    assert stored(mine, A) == [90.0, 95.0, 99.0]
    mine.close()


def test_expiry_before_a_read_uses_the_collections_own_ttl(tmp_path):
    clock = FakeClock(100.0)
    store = SQLiteExampleStore(tmp_path / "app.db", clock=clock, retention=RetentionPolicy(ttl_seconds=1000.0))
    store.add(A, [{"t": np.float64(0)}] * 2, timestamps=[60.0, 100.0])
    store.set_retention(A, RetentionPolicy(ttl_seconds=30.0))  # deletes 60 at once
    clock.now = 120.0
    assert store.stats(A).count == 1
    clock.now = 131.0
    assert store.stats(A).count == 0
    store.close()


def test_clearing_a_policy_that_was_never_set_changes_nothing(tmp_path):
    store = SQLiteExampleStore(tmp_path / "app.db", retention=RetentionPolicy(max_bytes=RECORD))
    store.clear_retention(A)
    assert store.retention_for(A) == RetentionPolicy(max_bytes=RECORD)
    store.close()


@given(ttl=st.integers(0, 10**6) | st.floats(0, 1e9), cap=st.integers(0, 10**9))
def test_zero_and_every_finite_non_negative_value_are_valid_limits(ttl, cap):
    policy = RetentionPolicy(ttl_seconds=ttl, max_bytes=cap)
    assert type(policy.ttl_seconds) is float and policy.ttl_seconds == ttl
    assert policy.max_bytes == cap
    assert not policy.is_noop


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ttl_seconds": True},
        {"ttl_seconds": "60"},
        {"ttl_seconds": -1.0},
        {"ttl_seconds": math.inf},
        {"ttl_seconds": math.nan},
        {"max_bytes": True},
        {"max_bytes": 1.5},
        {"max_bytes": -1},
    ],
)
def test_a_limit_that_is_not_a_finite_non_negative_number_is_refused(kwargs):
    with pytest.raises(InvalidArgumentError):
        RetentionPolicy(**kwargs)
