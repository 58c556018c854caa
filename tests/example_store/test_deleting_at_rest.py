"""What a delete leaves on disk: no byte of a deleted example in the database file, its free
pages or its write-ahead log, whatever SQLite's build defaults to; and files only their owner reads."""

from __future__ import annotations

import os
import sqlite3
import stat

import numpy as np
import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine

from example_store import ExampleSelector, RetentionPolicy, SQLiteExampleStore
from example_store.sqlite_iterator import READ_CHUNK
from tests.example_store.store_helpers import FakeClock

MARK = b"ZQXPRIVATE"
URI = "app:/notes"


def _examples(n: int, first: int = 0) -> list[dict[str, np.ndarray]]:
    return [
        {"note": np.frombuffer(MARK + f"{i:06d}".encode(), dtype=np.uint8).copy(), "y": np.int64(i)}
        for i in range(first, first + n)
    ]


def _on_disk(path: os.PathLike) -> int:
    """How many marked examples the database file and its write-ahead log hold, as `strings` finds them."""
    found = 0
    for name in (os.fspath(path), f"{os.fspath(path)}-wal"):
        if os.path.exists(name):
            with open(name, "rb") as f:
                found += f.read().count(MARK)
    return found


@pytest.fixture
def build_without_secure_delete():
    """Connections start as SQLite builds without SQLITE_SECURE_DELETE start (the default of its
    sources; this machine's Debian build has it on): this class-level listener runs before the store's."""

    def off(dbapi_connection, _record):
        dbapi_connection.execute("PRAGMA secure_delete=OFF")

    event.listen(Engine, "connect", off)
    yield
    event.remove(Engine, "connect", off)


DELETES = {
    "delete_collection": lambda store, clock: store.delete_collection(URI),
    "delete_before": lambda store, clock: store.delete_before(URI, 1e9),
    "delete_all": lambda store, clock: store.delete_all(),
    "set_retention": lambda store, clock: store.set_retention(URI, RetentionPolicy(ttl_seconds=60)),
    "apply_retention": lambda store, clock: (setattr(clock, "now", clock.now + 3600), store.apply_retention()),
}


@pytest.mark.parametrize(
    ("delete", "checkpointed"),
    # every delete on examples an earlier run of the app left in the file; two of them (each path
    # to the log's cut: a call's own, retention's) on examples still in the log
    [*((name, True) for name in DELETES), ("delete_collection", False), ("apply_retention", False)],
)
def test_a_deleted_example_leaves_no_byte_in_the_file_or_its_log(
    tmp_path, build_without_secure_delete, delete, checkpointed
):
    clock = FakeClock(1_000_000.0)
    path = tmp_path / "app.db"
    store = SQLiteExampleStore(path, clock=clock, retention=RetentionPolicy(ttl_seconds=600))
    store.add(URI, _examples(200), timestamps=[clock.now - 300] * 200)
    if checkpointed:  # the examples of an earlier run of the app, copied into the database file
        store.close()
        store = SQLiteExampleStore(path, clock=clock, retention=RetentionPolicy(ttl_seconds=600))
    assert _on_disk(path) >= 200
    DELETES[delete](store, clock)
    try:
        assert sum(store.count(ExampleSelector(uri)) for uri in store.collections()) == 0
        assert _on_disk(path) == 0  # while the app runs on, its database open
    finally:
        store.close()


def test_a_read_in_progress_keeps_the_log_until_it_ends_and_the_next_write_cuts_it(tmp_path):
    path = tmp_path / "app.db"
    store = SQLiteExampleStore(path)
    store.add(URI, _examples(READ_CHUNK + 1))  # more than one read's chunk: the read stays open
    reading = store.query(ExampleSelector(URI))  # a session's read, begun before the user's delete
    next(reading)
    assert store.delete_all() == READ_CHUNK + 1
    assert _on_disk(path) > 0  # its snapshot holds the log: SQLite cannot cut it yet
    reading.close()
    store.add("app:/other", [{"y": np.int64(1)}])
    assert _on_disk(path) == 0
    store.close()


def test_close_cuts_a_log_that_a_read_held_at_the_delete(tmp_path):
    path = tmp_path / "app.db"
    store = SQLiteExampleStore(path)
    store.add(URI, _examples(READ_CHUNK + 1))
    other = SQLiteExampleStore(path)  # another part of the app keeps the file open (opstats, say)
    reading = store.query(ExampleSelector(URI))
    next(reading)
    store.delete_collection(URI)
    assert _on_disk(path) > 0
    store.close()  # closes the read, then cuts the log; the file stays open in `other`
    assert _on_disk(path) == 0
    other.close()


@pytest.mark.parametrize("policy", ["max_bytes", "ttl"])
def test_apply_retention_on_a_schedule_cuts_what_retention_deleted_as_examples_were_added_or_read(
    tmp_path, build_without_secure_delete, policy
):
    """Retention's deletes as examples are added (past max_bytes) or read (past their TTL) leave the
    log for the next delete call: the scheduled apply_retention() the tutorial names, which then
    finds nothing left to delete, still cuts it."""
    clock = FakeClock(1_000_000.0)
    path = tmp_path / "app.db"
    retention = RetentionPolicy(max_bytes=2_000) if policy == "max_bytes" else RetentionPolicy(ttl_seconds=600)
    store = SQLiteExampleStore(path, clock=clock, retention=retention)
    store.add(URI, _examples(100))
    if policy == "max_bytes":
        store.add(URI, [{"note": np.zeros(len(MARK) + 6, np.uint8), "y": np.int64(0)}] * 100)
    else:
        clock.now += 3600
    assert store.count(ExampleSelector(URI)) < 100
    assert _on_disk(path) > 0  # in the log until a delete call
    assert store.apply_retention() == 0
    assert _on_disk(path) == 0
    store.close()


def test_the_database_and_its_log_are_readable_by_their_owner_only(tmp_path):
    old = os.umask(0o022)  # the usual umask, under which SQLite made the file 0644
    try:
        store = SQLiteExampleStore(tmp_path / "app.db")
        store.add(URI, _examples(3))
        modes = {
            name: stat.S_IMODE(os.stat(tmp_path / name).st_mode) for name in ("app.db", "app.db-wal", "app.db-shm")
        }
        store.close()
    finally:
        os.umask(old)
    assert modes == dict.fromkeys(modes, 0o600)


def test_an_earlier_apps_database_readable_by_every_user_is_made_its_owners_only(tmp_path):
    """An app's database from before (0644 under the usual umask, its log too) is the one an
    updated app opens: it was left readable by every user of the machine."""
    old = os.umask(0o022)
    try:
        earlier = sqlite3.connect(tmp_path / "app.db")
        earlier.execute("PRAGMA journal_mode=WAL")
        earlier.execute("CREATE TABLE earlier (x)")
        earlier.commit()  # -wal and -shm stay while it is open
        store = SQLiteExampleStore(tmp_path / "app.db")
        store.add(URI, _examples(3))
        modes = {
            name: stat.S_IMODE(os.stat(tmp_path / name).st_mode) for name in ("app.db", "app.db-wal", "app.db-shm")
        }
        store.close()
        earlier.close()
    finally:
        os.umask(old)
    assert modes == dict.fromkeys(modes, 0o600)


def test_an_app_killed_before_the_log_was_cut_has_it_cut_when_it_opens_the_store(tmp_path):
    app, after_kill = tmp_path / "app", tmp_path / "after-kill"
    app.mkdir()
    after_kill.mkdir()
    store = SQLiteExampleStore(app / "app.db")
    store.add(URI, _examples(READ_CHUNK + 1))
    reading = store.query(ExampleSelector(URI))  # holds the log past the delete
    next(reading)
    store.delete_collection(URI)
    for name in ("app.db", "app.db-wal"):  # the disk as a kill at this moment leaves it
        (after_kill / name).write_bytes((app / name).read_bytes())
    reading.close()
    store.close()
    assert _on_disk(after_kill / "app.db") > 0
    with SQLiteExampleStore(after_kill / "app.db") as again:
        assert again.collections() == []
        assert _on_disk(after_kill / "app.db") == 0
