"""SQLiteExampleStore: round trips, selection, streaming, schema checks, retention, durability."""

from __future__ import annotations

import sqlite3
import threading

import numpy as np
import pytest

from example_store import (
    ExampleIterator,
    ExampleSelector,
    ExampleStore,
    ExampleStoreError,
    InMemoryKeyStore,
    InvalidArgumentError,
    RetentionPolicy,
    SchemaMismatchError,
    SQLiteExampleStore,
)
from example_store.sqlite_engine import WAL_SIZE_LIMIT
from tests.example_store.store_helpers import URI, FakeClock, labels, make_examples


@pytest.fixture(params=["plain", "sealed"])
def store(request, tmp_path):
    key_store = InMemoryKeyStore() if request.param == "sealed" else None
    with SQLiteExampleStore(tmp_path / "app.db", key_store=key_store) as s:
        yield s


def test_python_scalars_and_lists_are_accepted(store):
    store.add("app:/py", [{"x": [1.0, 2.0], "y": 3}, {"x": [4.0, 5.0], "y": 6}])
    got = list(store.query(ExampleSelector("app:/py")))
    assert got[1]["x"].tolist() == [4.0, 5.0] and got[1]["y"].dtype == np.int64


def test_query_batches_shapes_and_contents(store):
    examples = make_examples(10)
    store.add(URI, examples, timestamps=range(10))
    with store.query_batches(ExampleSelector(URI), 4) as batches:
        got = list(batches)
    assert [b["x"].shape for b in got] == [(4, 3), (4, 3), (2, 3)]
    assert [b["y"].shape for b in got] == [(4,), (4,), (2,)]
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in got]), np.stack([e["x"] for e in examples]))
    assert got[0]["x"].flags["C_CONTIGUOUS"] and got[0]["x"].dtype == np.float32
    with pytest.raises(InvalidArgumentError):
        store.query_batches(ExampleSelector(URI), 0)


def test_query_batches_larger_than_a_read_chunk(store):
    store.add(URI, make_examples(3000), timestamps=range(3000))
    sizes = [len(b["y"]) for b in store.query_batches(ExampleSelector(URI, order="newest"), 1500)]
    assert sizes == [1500, 1500]
    first = next(iter(store.query_batches(ExampleSelector(URI, order="newest"), 1500)))
    assert first["y"][0] == 2999


def test_closing_early_releases_the_connection_and_snapshot(store, tmp_path):
    store.add(URI, make_examples(5000))
    pool = store._engine.pool
    it = store.query(ExampleSelector(URI))
    assert labels([next(it), next(it)]) == [0, 1]
    # WAL: a writer is not blocked by the open reader ...
    assert store.add(URI, make_examples(1, start=5000)) == 1
    probe = sqlite3.connect(tmp_path / "app.db", timeout=0)
    try:
        # ... but the reader's snapshot keeps a full checkpoint from completing.
        assert probe.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 1
        assert pool.checkedout() == 1
        it.close()
        it.close()  # idempotent
        assert pool.checkedout() == 0
        with pytest.raises(StopIteration):
            next(it)
        assert store.add(URI, make_examples(1, start=5001)) == 1
        assert probe.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
    finally:
        probe.close()
    with store.query_batches(ExampleSelector(URI), 8) as batches:
        next(batches)
    assert pool.checkedout() == 0
    assert store.count(ExampleSelector(URI)) == 5002


def test_exhausted_iterator_closes_itself(store):
    store.add(URI, make_examples(3))
    it = store.query(ExampleSelector(URI))
    assert isinstance(it, ExampleIterator) and iter(it) is it
    assert len(list(it)) == 3
    assert store._engine.pool.checkedout() == 0


def test_store_close_closes_open_iterators(tmp_path):
    store = SQLiteExampleStore(tmp_path / "app.db")
    store.add(URI, make_examples(3000))
    it = store.query(ExampleSelector(URI))
    next(it)
    store.close()
    store.close()
    assert list(it) == []  # closed with the store, decoded leftovers dropped
    with pytest.raises(ExampleStoreError, match="closed"):
        store.query(ExampleSelector(URI))


def test_schema_mismatch_is_rejected_with_a_clear_message_and_nothing_is_written(store):
    store.add(URI, make_examples(2))
    bad = [
        [{"x": np.zeros(3, np.float64), "y": np.int64(0)}],
        [{"x": np.zeros(4, np.float32), "y": np.int64(0)}],
        [{"x": np.zeros(3, np.float32)}],
        [{"x": np.zeros(3, np.float32), "y": np.int64(0), "z": np.int64(0)}],
        [{"x": np.zeros(3, np.float32), "label": np.int64(0)}],
    ]
    for examples in bad:
        with pytest.raises(SchemaMismatchError, match=r"x: float32\[3\], y: int64\[\]"):
            store.add(URI, make_examples(3, start=10) + examples)
    assert store.count(ExampleSelector(URI)) == 2


def test_invalid_examples_and_timestamps(store):
    with pytest.raises(InvalidArgumentError, match="numeric"):
        store.add(URI, [{"s": np.array(["a"])}])
    with pytest.raises(InvalidArgumentError, match="dict"):
        store.add(URI, [np.zeros(3)])
    with pytest.raises(InvalidArgumentError, match="fewer timestamps"):
        store.add(URI, make_examples(3), timestamps=[1, 2])
    with pytest.raises(InvalidArgumentError, match="more timestamps"):
        store.add(URI, make_examples(3), timestamps=[1, 2, 3, 4])
    with pytest.raises(InvalidArgumentError, match="finite"):
        store.add(URI, make_examples(1), timestamps=[float("nan")])
    assert store.add(URI, []) == 0
    assert store.collections() == []  # failed adds rolled back, the empty one created nothing


def test_ttl_eviction_with_injected_clock(tmp_path):
    clock = FakeClock(1000.0)
    with SQLiteExampleStore(tmp_path / "app.db", retention=RetentionPolicy(ttl_seconds=100), clock=clock) as store:
        store.add(URI, make_examples(4), timestamps=[850, 950, 990, 1000])  # 850 expires on add
        assert labels(store.query(ExampleSelector(URI))) == [1, 2, 3]
        clock.now = 1089.0
        assert labels(store.query(ExampleSelector(URI))) == [2, 3]  # TTL runs before reads
        clock.now = 1200.0
        assert store.apply_retention() == 2
        assert store.count(ExampleSelector(URI)) == 0
        store.add(URI, make_examples(2, start=10))  # default timestamp: clock()
        assert labels(store.query(ExampleSelector(URI))) == [10, 11]


def test_size_cap_evicts_oldest_first(tmp_path):
    # one example = 3 float32 + 1 int64 = 20 bytes; 110 bytes hold 5 of them
    with SQLiteExampleStore(tmp_path / "app.db", retention=RetentionPolicy(max_bytes=110)) as store:
        store.add(URI, make_examples(4), timestamps=[10, 40, 20, 30])
        store.add(URI, make_examples(4, start=4), timestamps=[5, 50, 25, 40])
        # kept: the 5 newest by (timestamp, insertion order)
        assert labels(store.query(ExampleSelector(URI))) == [6, 3, 1, 7, 5]
        store.set_retention(URI, RetentionPolicy(max_bytes=40))  # per-collection override applies now
        assert labels(store.query(ExampleSelector(URI))) == [7, 5]
        store.add("app:/other", make_examples(8))  # the default cap still applies elsewhere
        assert store.count(ExampleSelector("app:/other")) == 5
        assert store.retention_for(URI) == RetentionPolicy(max_bytes=40)


def test_persistence_across_reopen_and_wal_mode(tmp_path):
    path = tmp_path / "app.db"
    with SQLiteExampleStore(path) as store:
        assert store.journal_mode == "wal"
        store.add(URI, make_examples(5), timestamps=range(5))
    with SQLiteExampleStore(path) as store:
        assert store.journal_mode == "wal"
        assert store.collections() == [URI]
        assert labels(store.query(ExampleSelector(URI, order="newest", limit=2))) == [4, 3]
        with pytest.raises(SchemaMismatchError):
            store.add(URI, [{"x": np.zeros(2, np.float32), "y": np.int64(0)}])
    raw = sqlite3.connect(path)
    try:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        raw.close()


def test_the_write_ahead_log_shrinks_back_after_a_large_write(tmp_path):
    """The log kept the size of the largest transaction ever written (12 MB of examples added at
    once: 12 MB beside the database for as long as the app ran)."""
    path = tmp_path / "app.db"
    with SQLiteExampleStore(path) as store:
        big = [{"x": np.full(1 << 16, i, np.float32), "y": np.int64(i)} for i in range(48)]  # 12 MiB
        store.add(URI, big, timestamps=range(48))
        assert (tmp_path / "app.db-wal").stat().st_size > 3 * WAL_SIZE_LIMIT
        for t in range(48, 52):
            store.add(URI, [{"x": np.zeros(1 << 16, np.float32), "y": np.int64(0)}], timestamps=[t])
        assert (tmp_path / "app.db-wal").stat().st_size <= WAL_SIZE_LIMIT
        assert store.count(ExampleSelector(URI)) == 52


def test_a_collection_schema_a_newer_version_wrote_is_refused_as_such_and_the_file_kept(tmp_path):
    """It was called damaged, with the advice to delete the file: the app's examples, gone."""
    path = tmp_path / "app.db"
    with SQLiteExampleStore(path) as store:
        store.add(URI, make_examples(3))
    raw = sqlite3.connect(path)
    try:
        raw.execute("UPDATE collections SET schema = replace(schema, '\"version\": 1', '\"version\": 2')")
        raw.commit()
    finally:
        raw.close()
    kept = path.read_bytes()
    with pytest.raises(ExampleStoreError) as refused:
        with SQLiteExampleStore(path) as store:
            store.count(ExampleSelector(URI))
    said = str(refused.value)
    assert "version 2, written by a newer version of the example store" in said, said
    assert "delete" not in said and "damaged" not in said
    assert path.read_bytes() == kept


@pytest.mark.parametrize("damage", ["zeroed", "garbled", "intact"])
def test_a_store_whose_write_ahead_log_a_power_cut_damaged_says_what_it_lost(tmp_path, caplog, damage):
    """The files as a power cut leaves them while the app runs: the database as of its last
    checkpoint (one collection, 3 examples) and a log holding the adds since (4 more, and a
    second collection). Zeroed or garbled, SQLite took the log for an empty one and the store
    opened without those adds, saying nothing; it still opens with the rest, and says so."""
    import shutil

    live, cut = tmp_path / "live", tmp_path / "cut"
    live.mkdir(), cut.mkdir()
    with SQLiteExampleStore(live / "app.db") as store:  # closed: its log checkpointed into the file
        store.add(URI, make_examples(3))
    store = SQLiteExampleStore(live / "app.db")
    store.add(URI, make_examples(4)), store.add("app:/other", make_examples(2))
    for name in ("app.db", "app.db-wal"):  # the disk as the cut leaves it, the app still running
        shutil.copyfile(live / name, cut / name)
    store.close()
    wal = cut / "app.db-wal"
    size = wal.stat().st_size
    wal.write_bytes(
        {"zeroed": b"\0" * size, "garbled": bytes(range(256)) * (size // 256), "intact": wal.read_bytes()}[damage]
    )
    with caplog.at_level("WARNING", logger="example_store"), SQLiteExampleStore(cut / "app.db") as reopened:
        kept = reopened.count(ExampleSelector(URI))
        assert kept == (7 if damage == "intact" else 3)
    said = [r.getMessage() for r in caplog.records if "write-ahead log" in r.getMessage()]
    assert len(said) == (0 if damage == "intact" else 1)
    assert damage == "intact" or "app.db-wal) is damaged" in said[0] and "added since" in said[0]
    with caplog.at_level("WARNING", logger="example_store"), SQLiteExampleStore(cut / "app.db"):
        pass  # said once: the log is SQLite's again from the first open on
    assert len([r for r in caplog.records if "write-ahead log" in r.getMessage()]) == len(said)


@pytest.mark.parametrize("content", [b"this is not a database" * 100, b"SQLite format 3\x00" + b"\xff" * 200])
def test_corrupt_file_raises_example_store_error_naming_the_path(tmp_path, content):
    path = tmp_path / "broken.db"
    path.write_bytes(content)
    with pytest.raises(ExampleStoreError, match="broken.db"):
        SQLiteExampleStore(path)


def test_foreign_sqlite_file_and_missing_directory(tmp_path):
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE examples (name TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(ExampleStoreError, match="other.db"):
        SQLiteExampleStore(other)
    with pytest.raises(ExampleStoreError, match="missing"):
        SQLiteExampleStore(tmp_path / "missing" / "app.db")


def test_usable_from_a_worker_thread_while_the_creator_reads(store):
    store.add(URI, make_examples(100), timestamps=range(100))
    errors: list[BaseException] = []
    reader = store.query(ExampleSelector(URI))
    next(reader)

    def worker(first: int) -> None:
        try:
            for i in range(5):
                start = first + 10 * i
                store.add(URI, make_examples(10, start=start), timestamps=range(start, start + 10))
                seen = [int(y) for b in store.query_batches(ExampleSelector(URI, start_time=first), 16) for y in b["y"]]
                assert seen[: 10 * (i + 1)] == list(range(first, start + 10))
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(first,)) for first in (1000, 2000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(list(reader)) == 99  # the open reader kept its snapshot
    reader.close()
    assert store.count(ExampleSelector(URI)) == 200


class ListStore(ExampleStore):
    """A minimal app-side implementation: the interface's default query_batches must work."""

    def __init__(self, examples: list[dict]) -> None:
        self.examples = examples
        self.closed = 0

    def query(self, selector: ExampleSelector) -> ExampleIterator:
        outer = self
        items = iter(self.examples[: selector.limit])

        class It(ExampleIterator):
            def __next__(self):
                return next(items)

            def close(self):
                outer.closed += 1

        return It()

    def count(self, selector: ExampleSelector) -> int:
        return len(self.examples[: selector.limit])


def test_default_query_batches_on_a_custom_store():
    store = ListStore(make_examples(5))
    batches = list(store.query_batches(ExampleSelector(URI), 2))
    assert [b["x"].shape for b in batches] == [(2, 3), (2, 3), (1, 3)]
    assert batches[2]["y"].tolist() == [4]
    with store.query_batches(ExampleSelector(URI), 2) as it:
        next(it)
    assert store.closed >= 2


def test_abandoned_iterator_gives_its_connection_back(store):
    import gc

    store.add(URI, make_examples(3000))
    it = store.query_batches(ExampleSelector(URI), 10)
    next(it)
    assert store._engine.pool.checkedout() == 1
    del it
    gc.collect()
    assert store._engine.pool.checkedout() == 0
    assert store.add(URI, make_examples(1)) == 1


def test_a_store_locked_by_another_process_says_a_retry_may_succeed_and_a_damaged_one_says_it_will_not(
    tmp_path, monkeypatch
):
    """``retryable``, as on the runtime's errors: True only where another holder's lock made the
    call fail (the same call later succeeds, as here once the lock is let go), False for a file
    that is no database. Before, a store's errors had no ``retryable`` beside the runtime's."""
    import functools

    from device_runtime import AppDatabaseError, OpStatsStore
    from device_runtime import opstats as opstats_module
    from example_store import sqlite_store
    from example_store.sqlite_engine import sqlite_engine

    quick = functools.partial(sqlite_engine, busy_timeout_s=0.05)  # not the 30 s an app waits
    monkeypatch.setattr(sqlite_store, "sqlite_engine", quick)
    monkeypatch.setattr(opstats_module, "sqlite_engine", quick)
    store = SQLiteExampleStore(tmp_path / "app.db")
    log = OpStatsStore(tmp_path / "app.db")
    other = sqlite3.connect(tmp_path / "app.db", isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another process of the app, in the middle of a write
    with pytest.raises(ExampleStoreError) as locked:
        store.add(URI, make_examples(3))
    assert locked.value.retryable and "retry later" in str(locked.value)
    with pytest.raises(AppDatabaseError) as busy:
        log.delete_all()
    assert busy.value.retryable
    other.execute("ROLLBACK")
    store.add(URI, make_examples(3))  # the same call, later: taken
    assert store.stats(URI).count == 3
    store.close()

    (tmp_path / "text.db").write_bytes(b"not a database, " * 512)
    with pytest.raises(ExampleStoreError) as damaged:
        SQLiteExampleStore(tmp_path / "text.db")
    assert not damaged.value.retryable and "not an SQLite database" in str(damaged.value)
    assert not ExampleStoreError("a mistake of the app's").retryable


def test_cutting_the_log_after_a_delete_keeps_the_connections_own_wait_for_locks(tmp_path):
    """The cut waits for no lock, then put every connection it ran on back to a 30 s wait, whatever
    its engine's: an engine made to wait 50 ms then waited 30 s on its next write."""
    from example_store.sqlite_engine import scrub_wal

    connection = sqlite3.connect(tmp_path / "app.db", timeout=0.05)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("CREATE TABLE t (x)")
    connection.execute("INSERT INTO t VALUES (1)")
    connection.commit()
    assert scrub_wal(connection)
    assert connection.execute("PRAGMA busy_timeout").fetchone() == (50,)
