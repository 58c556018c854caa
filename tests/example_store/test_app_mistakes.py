"""An app developer's mistakes with the example store's calls, on every store: each is refused
with a typed error (an ``ExampleStoreError``) saying what to give, and nothing is written."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess

import numpy as np
import pytest

from example_store import (
    ExampleSelector,
    ExampleStoreError,
    FileKeyStore,
    InMemoryExampleStore,
    InMemoryKeyStore,
    InvalidArgumentError,
    KeyStoreError,
    ResumptionTokens,
    RetentionPolicy,
    SQLiteExampleStore,
    UnknownCollectionError,
)
from tests.example_store.store_helpers import URI, make_examples


@pytest.mark.parametrize(
    ("examples", "timestamps", "match"),
    [
        (None, None, "add\\(\\) takes an iterable of examples .* got NoneType None"),
        (5, None, "got int 5"),
        (make_examples(1)[0], None, "got one dict: to add one example, pass \\[example\\]"),
        (make_examples(2), 1000.0, "add\\(\\) takes an iterable of timestamps, one per example .* got float"),
    ],
)
def test_examples_and_timestamps_that_are_not_iterables_are_refused(any_store, examples, timestamps, match):
    """None, a number or one example where an iterable of them goes failed with a bare TypeError
    (one dict: 'an example must be a dict..., got str', its first tensor name)."""
    with pytest.raises(InvalidArgumentError, match=match):
        any_store.add(URI, examples, timestamps=timestamps)
    assert any_store.collections() == []


def test_a_clock_that_is_not_a_function_is_refused_when_the_store_is_made(tmp_path):
    """A clock of 1000.0 (the time instead of what gives it) was taken, and the first add failed
    with "'float' object is not callable"."""
    with pytest.raises(InvalidArgumentError, match="clock is a function giving unix seconds"):
        SQLiteExampleStore(tmp_path / "app.db", clock=1000.0)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="clock is a function giving unix seconds"):
        InMemoryExampleStore(clock=1000.0)  # type: ignore[arg-type]


MILLIS = 1_767_225_600_000.0  # 2026-01-01 in milliseconds: Android's System.currentTimeMillis()
SAYS_MILLIS = "past the year 3000: the example store takes seconds since the epoch .* looks like milliseconds"


def test_times_in_milliseconds_are_refused_wherever_the_app_gives_a_time(make_store):
    """Milliseconds were taken for seconds, 55,000 years ahead: such examples never expired under a
    TTL, and sorted after every example stamped in seconds."""
    store = make_store()
    with pytest.raises(InvalidArgumentError, match=f"add\\(\\)'s timestamp {MILLIS!r} is {SAYS_MILLIS}"):
        store.add(URI, make_examples(2), timestamps=[1_767_225_600.0, MILLIS])
    assert store.collections() == []
    store.add(URI, make_examples(1), timestamps=[32_503_679_999.0])  # 2999-12-31: seconds still
    with pytest.raises(InvalidArgumentError, match=f"timestamp {MILLIS!r} is {SAYS_MILLIS}"):
        store.delete_before(URI, MILLIS)
    with pytest.raises(InvalidArgumentError, match=f"ExampleSelector.end_time {MILLIS!r} is {SAYS_MILLIS}"):
        ExampleSelector(URI, end_time=MILLIS)
    in_millis = make_store(clock=lambda: MILLIS, fresh=True)
    with pytest.raises(InvalidArgumentError, match=f"the store's clock\\(\\) time {MILLIS!r} is {SAYS_MILLIS}"):
        in_millis.add(URI, make_examples(1))
    if isinstance(store, InMemoryExampleStore):
        with pytest.raises(InvalidArgumentError, match=f"timestamp {MILLIS!r} is {SAYS_MILLIS}"):
            store.add_columns("app:/columns", {"y": np.arange(2)}, timestamp=MILLIS)


def test_times_columns_and_keys_of_the_wrong_kind_are_refused_saying_what_to_give(any_store):
    """An int past float's range as a timestamp failed with an OverflowError (add) or a TypeError
    from numpy (delete_before, add_columns); columns as a list, keys as a number and a resumption
    key as a str failed with an AttributeError or a bare ValueError."""
    with pytest.raises(InvalidArgumentError, match="timestamps must be numbers of unix seconds"):
        any_store.add(URI, make_examples(1), timestamps=[2**2000])
    with pytest.raises(InvalidArgumentError, match="timestamp must be a finite number of unix seconds, got 1"):
        any_store.delete_before(URI, 2**2000)
    if isinstance(any_store, InMemoryExampleStore):
        with pytest.raises(InvalidArgumentError, match="timestamp must be a finite number of unix seconds"):
            any_store.add_columns(URI, {"y": np.arange(2)}, timestamp=2**2000)
        with pytest.raises(InvalidArgumentError, match="add_columns takes a dict of tensor name -> array"):
            any_store.add_columns(URI, [np.arange(2)])  # type: ignore[arg-type]
    assert any_store.collections() == []
    with pytest.raises(KeyStoreError, match="InMemoryKeyStore takes a dict of alias -> key bytes or None"):
        InMemoryKeyStore(5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="a resumption token key is at least 16 secret bytes .* not str"):
        ResumptionTokens("a secret of 32 characters, a str")  # type: ignore[arg-type]


@pytest.mark.parametrize("uri", [5, None, b"app:/digits", ""])
def test_a_retention_query_of_a_collection_that_is_not_a_uri_is_refused(any_store, uri):
    """``retention_for(5)`` answered with the store's default policy, as if 5 were a collection
    with no policy of its own (a list failed with "unhashable type" on the memory store)."""
    with pytest.raises(InvalidArgumentError, match="a collection URI must be a non-empty string"):
        any_store.retention_for(uri)


def test_a_misspelt_collection_names_the_one_meant(any_store):
    any_store.add(URI, make_examples(2))
    with pytest.raises(UnknownCollectionError, match=f"no collection 'app:/digit' \\(did you mean '{URI}'\\?"):
        any_store.count(ExampleSelector("app:/digit"))
    any_store.add("app:/contacts", make_examples(2))
    with pytest.raises(UnknownCollectionError, match=f"no collection 'app:/digts' \\(did you mean '{URI}'\\?"):
        any_store.query(ExampleSelector("app:/digts"))
    with pytest.raises(UnknownCollectionError, match=r"no collection 'app:/photos' \(it has \['app:/contacts'"):
        any_store.stats("app:/photos")  # none close: no guess


def test_a_size_cap_past_the_largest_integer_the_store_keeps_is_refused(tmp_path):
    """``max_bytes=2**64`` passed the policy's checks and failed with an OverflowError when saved."""
    with pytest.raises(InvalidArgumentError, match="max_bytes must be an int from 0 to 2\\^63 - 1"):
        RetentionPolicy(max_bytes=2**63)
    with SQLiteExampleStore(tmp_path / "app.db") as store:
        store.set_retention(URI, RetentionPolicy(max_bytes=2**63 - 1))
        assert store.retention_for(URI).max_bytes == 2**63 - 1


@pytest.mark.parametrize("sealed", [False, True])
def test_an_example_larger_than_a_row_is_refused_before_it_is_copied(tmp_path, sealed):
    """An example past SQLite's 10^9 bytes a row was copied into one payload (a second GB of memory),
    then refused by SQLite with advice to move the database aside or delete it. A broadcast view
    stands for it here without taking the memory."""
    store = SQLiteExampleStore(tmp_path / "app.db", key_store=InMemoryKeyStore() if sealed else None)
    huge = np.broadcast_to(np.zeros(1, np.uint8), (1_000_000_001,))
    with store:
        with pytest.raises(InvalidArgumentError, match="more than the 1,000,000,000 .* split it into examples"):
            store.add("app:/media", [{"image": huge}])
        assert store.collections() == []


def test_a_store_a_newer_version_wrote_is_refused_in_one_line_saying_what_to_do(tmp_path):
    """The app downgraded: what its newer version wrote is not read as if it were this version's."""
    from example_store.sqlite_store import FORMAT_VERSION

    SQLiteExampleStore(tmp_path / "app.db").close()
    with sqlite3.connect(tmp_path / "app.db") as conn:
        conn.execute(f"PRAGMA user_version = {FORMAT_VERSION + 1}")
    with pytest.raises(ExampleStoreError) as refused:
        SQLiteExampleStore(tmp_path / "app.db")
    message = str(refused.value)
    assert "\n" not in message and f"format version {FORMAT_VERSION + 1}" in message
    assert message.endswith("open it with the matching fedfleet version, or move it aside")
    with sqlite3.connect(tmp_path / "app.db") as conn:  # left as it was
        assert conn.execute("PRAGMA user_version").fetchone()[0] == FORMAT_VERSION + 1


def test_a_path_that_is_not_one_is_refused_saying_what_to_give():
    """``SQLiteExampleStore(7)`` failed with a bare TypeError from pathlib."""
    with pytest.raises(InvalidArgumentError, match="SQLiteExampleStore's path is a file's path .* not int 7"):
        SQLiteExampleStore(7)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="FileKeyStore's path is a file's path .* not NoneType"):
        FileKeyStore(None)  # type: ignore[arg-type]


def test_a_folder_given_for_the_app_database_is_said_to_be_one(tmp_path):
    """The app gave its data folder for the database file, and was told to create its folder (the
    advice the app's opstats and scheduled jobs give too, from the same engine)."""
    with pytest.raises(ExampleStoreError, match="give the path of a file \\(not a folder\\) in a folder that exists"):
        SQLiteExampleStore(tmp_path)


@contextlib.contextmanager
def _read_only(path):
    """``path`` made read-only for this process: its mode for a user, its immutable flag for root
    (whom modes do not stop); skips where neither holds."""
    os.chmod(path, 0o444)
    immutable = (
        os.access(path, os.W_OK) and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
    )
    try:
        if os.access(path, os.W_OK) and not immutable:
            pytest.skip("this process writes to read-only files, and chattr cannot make one immutable here")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        os.chmod(path, 0o644)


def test_a_read_only_store_reads_and_refuses_writes_saying_so(tmp_path):
    with SQLiteExampleStore(tmp_path / "app.db") as store:
        store.add(URI, make_examples(3))
    with _read_only(tmp_path / "app.db"), SQLiteExampleStore(tmp_path / "app.db") as store:
        assert store.count(ExampleSelector(URI)) == 3
        with pytest.raises(ExampleStoreError, match="it is read-only: check its permissions and its file system"):
            store.add(URI, make_examples(1))
        assert store.count(ExampleSelector(URI)) == 3
