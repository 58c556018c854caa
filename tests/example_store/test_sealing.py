"""Sealing at rest: what is on disk, tampering, keys and modes, and the key stores."""

from __future__ import annotations

import os
import sqlite3
import stat
import threading
from pathlib import Path

import numpy as np
import pytest

from example_store import (
    ExampleSelector,
    ExampleStoreError,
    FileKeyStore,
    InMemoryKeyStore,
    KeyStore,
    KeyStoreError,
    SealingModeError,
    SQLiteExampleStore,
    TamperedExampleError,
    WrongKeyError,
)
from tests.example_store.store_helpers import URI, labels, make_examples

# A float pattern nobody writes by chance: 16 float32 -> 64 distinctive bytes.
PATTERN = (np.arange(16, dtype=np.float32) * np.float32(3.14159) + np.float32(271828.0)).astype(np.float32)


def marked_examples(n: int) -> list[dict]:
    return [{"x": PATTERN.copy(), "y": np.int64(i)} for i in range(n)]


def bytes_on_disk(path: Path) -> bytes:
    """The database file and its WAL, as an attacker with the files would read them."""
    data = path.read_bytes()
    wal = Path(f"{path}-wal")
    return data + (wal.read_bytes() if wal.exists() else b"")


def raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def payload(conn: sqlite3.Connection, row_id: int) -> bytes:
    return conn.execute("SELECT payload FROM examples WHERE id = ?", (row_id,)).fetchone()[0]


def flip(blob: bytes, index: int) -> bytes:
    b = bytearray(blob)
    b[index] ^= 0x01
    return bytes(b)


@pytest.fixture
def key_store():
    return InMemoryKeyStore()


@pytest.fixture
def sealed_path(tmp_path, key_store):
    path = tmp_path / "app.db"
    with SQLiteExampleStore(path, key_store=key_store) as store:
        store.add(URI, make_examples(6), timestamps=[1, 2, 3, 3, 5, 6])
        store.add("app:/twin", make_examples(3, start=100), timestamps=[1, 2, 3])  # same schema
    return path


@pytest.mark.parametrize("sealed", [False, True])
def test_bytes_on_disk_are_not_the_plaintext(tmp_path, sealed):
    path = tmp_path / "app.db"
    key_store = InMemoryKeyStore() if sealed else None
    with SQLiteExampleStore(path, key_store=key_store) as store:
        assert store.sealed is sealed
        store.add(URI, marked_examples(50))
        on_disk_while_open = bytes_on_disk(path)
        got = list(store.query(ExampleSelector(URI)))
        np.testing.assert_array_equal(got[7]["x"], PATTERN)
    needle = PATTERN.tobytes()
    assert (needle in on_disk_while_open) is not sealed
    assert (needle in bytes_on_disk(path)) is not sealed
    # nor any 8-byte window of it
    assert any(needle[i : i + 8] in bytes_on_disk(path) for i in range(0, 56, 8)) is not sealed


def test_sealed_rows_carry_nonce_ciphertext_and_tag(sealed_path):
    conn = raw(sealed_path)
    try:
        blobs = [r[0] for r in conn.execute("SELECT payload FROM examples")]
    finally:
        conn.close()
    assert {len(b) for b in blobs} == {12 + 20 + 16}  # nonce, 20 payload bytes, tag
    assert len({b[:12] for b in blobs}) == len(blobs)  # a fresh nonce per row


@pytest.mark.parametrize("where, index", [("payload", 20), ("payload", -1), ("nonce", 0), ("nonce", 11)])
def test_a_flipped_byte_is_detected_naming_collection_and_row(sealed_path, key_store, where, index):
    conn = raw(sealed_path)
    try:
        conn.execute("UPDATE examples SET payload = ? WHERE id = 3", (flip(payload(conn, 3), index),))
    finally:
        conn.close()
    with SQLiteExampleStore(sealed_path, key_store=key_store) as store:
        for read in (
            lambda: list(store.query(ExampleSelector(URI))),
            lambda: list(store.query_batches(ExampleSelector(URI), 2)),
        ):
            with pytest.raises(TamperedExampleError, match=r"example 3 of collection 'app:/digits'") as info:
                read()
            assert info.value.collection_uri == URI and info.value.row_id == 3
            assert isinstance(info.value, ExampleStoreError)
        assert store._engine.pool.checkedout() == 0  # the failing iterator closed itself
        # examples before the damaged chunk are still readable, the rest is untouched
        assert labels(store.query(ExampleSelector(URI, limit=2))) == [0, 1]
        assert labels(store.query(ExampleSelector(URI, start_time=4))) == [4, 5]


def test_tampering_is_detected_mid_stream_before_any_of_its_chunk_is_returned(tmp_path, key_store):
    path = tmp_path / "app.db"
    with SQLiteExampleStore(path, key_store=key_store) as store:
        store.add(URI, make_examples(3000), timestamps=range(3000))
        conn = raw(path)
        try:
            conn.execute("UPDATE examples SET payload = ? WHERE id = 1500", (flip(payload(conn, 1500), 30),))
        finally:
            conn.close()
        seen = []
        with pytest.raises(TamperedExampleError, match="example 1500"):
            for example in store.query(ExampleSelector(URI)):
                seen.append(int(example["y"]))
        assert seen == list(range(1024))  # whole first chunk, nothing from the damaged one


def test_a_row_moved_to_another_collection_is_detected(sealed_path, key_store):
    conn = raw(sealed_path)
    try:
        (twin,) = conn.execute("SELECT id FROM collections WHERE uri = 'app:/twin'").fetchone()
        conn.execute("UPDATE examples SET collection_id = ? WHERE id = 2", (twin,))
    finally:
        conn.close()
    with SQLiteExampleStore(sealed_path, key_store=key_store) as store:
        with pytest.raises(TamperedExampleError, match="example 2 of collection 'app:/twin'"):
            list(store.query(ExampleSelector("app:/twin")))
        assert labels(store.query(ExampleSelector(URI))) == [0, 2, 3, 4, 5]  # row 2 (label 1) is gone from here


@pytest.mark.parametrize(
    "edit",
    [
        "UPDATE examples SET timestamp = timestamp + 1 WHERE id = 5",  # an edited timestamp
        # two rows with the same timestamp swap payloads (row ids are authenticated)
        "UPDATE examples SET payload = CASE id WHEN 3 THEN (SELECT payload FROM examples WHERE id = 4) "
        "ELSE (SELECT payload FROM examples WHERE id = 3) END WHERE id IN (3, 4)",
        # the schema reinterpreted with the same record size
        "UPDATE collections SET schema = replace(schema, '<f4', '<i4') WHERE uri = 'app:/digits'",
        # another collection's URI swapped in
        "UPDATE collections SET uri = 'tmp' WHERE uri = 'app:/digits'; "
        "UPDATE collections SET uri = 'app:/digits' WHERE uri = 'app:/twin'; "
        "UPDATE collections SET uri = 'app:/twin' WHERE uri = 'tmp';",
    ],
)
def test_edited_metadata_is_detected(sealed_path, key_store, edit):
    conn = raw(sealed_path)
    try:
        conn.executescript(edit)
        assert conn.total_changes >= 1
    finally:
        conn.close()
    with SQLiteExampleStore(sealed_path, key_store=key_store) as store:
        with pytest.raises(TamperedExampleError):
            list(store.query(ExampleSelector(URI)))


def test_unsealed_store_does_not_detect_tampering(tmp_path):
    """The control: the same edit is silently read back without sealing."""
    path = tmp_path / "app.db"
    with SQLiteExampleStore(path) as store:
        store.add(URI, make_examples(3))
        conn = raw(path)
        try:
            conn.execute("UPDATE examples SET payload = ? WHERE id = 2", (flip(payload(conn, 2), 0),))
        finally:
            conn.close()
        assert len(list(store.query(ExampleSelector(URI)))) == 3


def test_opening_a_sealed_store_without_a_key_store_is_refused(sealed_path):
    with pytest.raises(SealingModeError, match=r"is sealed.*key_store=.*'example_store'"):
        SQLiteExampleStore(sealed_path)


def test_opening_an_unsealed_store_with_a_key_store_is_refused(tmp_path):
    path = tmp_path / "app.db"
    SQLiteExampleStore(path).close()  # the mode is recorded at creation, even when empty
    with pytest.raises(SealingModeError, match="created unsealed"):
        SQLiteExampleStore(path, key_store=InMemoryKeyStore())
    with SQLiteExampleStore(path) as store:
        assert not store.sealed


def test_wrong_or_missing_key_is_refused_with_a_clear_error(sealed_path, key_store):
    with pytest.raises(WrongKeyError, match="is not the key .*app.db was sealed with"):
        SQLiteExampleStore(sealed_path, key_store=InMemoryKeyStore({"example_store": os.urandom(32)}))
    with pytest.raises(WrongKeyError, match="has no key 'example_store'"):
        SQLiteExampleStore(sealed_path, key_store=InMemoryKeyStore())
    key_store.get_or_create_key("other")
    with pytest.raises(WrongKeyError, match="sealed under alias 'example_store', not 'other'"):
        SQLiteExampleStore(sealed_path, key_store=key_store, key_alias="other")
    with SQLiteExampleStore(sealed_path, key_store=key_store) as store:  # the right key still works
        assert labels(store.query(ExampleSelector(URI))) == [0, 1, 2, 3, 4, 5]


def test_per_app_key_aliases(tmp_path):
    keys = InMemoryKeyStore()
    with (
        SQLiteExampleStore(tmp_path / "a.db", key_store=keys, key_alias="app.a") as a,
        SQLiteExampleStore(tmp_path / "b.db", key_store=keys, key_alias="app.b") as b,
    ):
        a.add(URI, make_examples(2))
        b.add(URI, make_examples(2))
    assert keys.aliases() == ["app.a", "app.b"]
    with pytest.raises(WrongKeyError):
        SQLiteExampleStore(tmp_path / "a.db", key_store=keys, key_alias="app.b")


def test_sealed_store_from_several_threads(tmp_path, key_store):
    path = tmp_path / "app.db"
    errors: list[BaseException] = []
    with SQLiteExampleStore(path, key_store=key_store) as store:

        def worker(first: int) -> None:
            try:
                for i in range(5):
                    start = first + 10 * i
                    store.add(URI, make_examples(10, start=start), timestamps=range(start, start + 10))
                    assert len(
                        list(store.query(ExampleSelector(URI, start_time=first, end_time=first + 1000)))
                    ) == 10 * (i + 1)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(f,)) for f in (0, 1000, 2000)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert store.count(ExampleSelector(URI)) == 150
        conn = raw(path)
        try:
            ids = [r[0] for r in conn.execute("SELECT id FROM examples ORDER BY id")]
        finally:
            conn.close()
        assert ids == list(range(1, 151))


def test_a_version_1_file_is_upgraded_and_stays_unsealed(tmp_path):
    path = tmp_path / "old.db"
    with SQLiteExampleStore(path) as store:
        store.add(URI, make_examples(3))
    conn = raw(path)  # make it look like a file written before sealing existed
    try:
        conn.execute("DROP TABLE store_meta")
        conn.execute("DROP TABLE retention_policies")
        conn.execute("PRAGMA user_version = 1")
    finally:
        conn.close()
    with pytest.raises(SealingModeError, match="unsealed examples"):
        SQLiteExampleStore(path, key_store=InMemoryKeyStore())
    with SQLiteExampleStore(path) as store:
        assert labels(store.query(ExampleSelector(URI))) == [0, 1, 2] and not store.sealed
    conn = raw(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
    finally:
        conn.close()


# -- key stores ---------------------------------------------------------------------------------


def test_in_memory_key_store():
    keys = InMemoryKeyStore()
    k = keys.get_or_create_key("a")
    assert len(k) == 32 and keys.get_or_create_key("a") == k and keys.get_key("b") is None
    assert keys.delete_key("a") and keys.get_key("a") is None
    with pytest.raises(KeyStoreError):
        keys.get_or_create_key("")
    with pytest.raises(KeyStoreError, match="16, 24 or 32"):
        InMemoryKeyStore({"a": b"short"})


def test_file_key_store_keeps_keys_in_a_0600_file(tmp_path):
    path = tmp_path / "keys.json"
    keys = FileKeyStore(path)
    assert keys.get_key("app") is None and not path.exists()
    k = keys.get_or_create_key("app")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert FileKeyStore(path).get_or_create_key("app") == k  # survives a restart
    FileKeyStore(path).get_or_create_key("other")
    assert FileKeyStore(path).aliases() == ["app", "other"]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    # a sealed store opened again with a fresh FileKeyStore on the same file
    with SQLiteExampleStore(tmp_path / "app.db", key_store=keys, key_alias="app") as store:
        store.add(URI, make_examples(2))
    with SQLiteExampleStore(tmp_path / "app.db", key_store=FileKeyStore(path), key_alias="app") as store:
        assert labels(store.query(ExampleSelector(URI))) == [0, 1]
    assert keys.delete_key("app") and not keys.delete_key("app")
    with pytest.raises(WrongKeyError, match="has no key 'app'"):
        SQLiteExampleStore(tmp_path / "app.db", key_store=FileKeyStore(path), key_alias="app")


def test_file_key_store_refuses_open_permissions_and_damage(tmp_path):
    path = tmp_path / "keys.json"
    FileKeyStore(path).get_or_create_key("app")
    os.chmod(path, 0o644)
    with pytest.raises(KeyStoreError, match="readable by other users.*chmod 600"):
        FileKeyStore(path).get_key("app")
    os.chmod(path, 0o600)
    path.write_text("{not json")
    os.chmod(path, 0o600)
    with pytest.raises(KeyStoreError, match="damaged"):
        FileKeyStore(path).get_key("app")
    with pytest.raises(KeyStoreError, match="directory"):
        FileKeyStore(tmp_path / "missing" / "keys.json").get_or_create_key("app")


def test_file_key_store_creates_one_key_under_concurrency(tmp_path):
    path = tmp_path / "keys.json"
    results: list[bytes] = []
    threads = [
        threading.Thread(target=lambda: results.append(FileKeyStore(path).get_or_create_key("app"))) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 8


def test_a_custom_key_store_and_its_failures(tmp_path):
    class Minimal(KeyStore):  # only the abstract method: get_key falls back to it
        def __init__(self, key: object) -> None:
            self.key = key

        def get_or_create_key(self, alias: str) -> bytes:
            if isinstance(self.key, Exception):
                raise self.key
            return self.key

    key = os.urandom(16)  # AES-128 keys are accepted too
    with SQLiteExampleStore(tmp_path / "app.db", key_store=Minimal(key)) as store:
        store.add(URI, make_examples(2))
    with SQLiteExampleStore(tmp_path / "app.db", key_store=Minimal(key)) as store:
        assert labels(store.query(ExampleSelector(URI))) == [0, 1]
    with pytest.raises(KeyStoreError, match="unusable key"):
        SQLiteExampleStore(tmp_path / "app.db", key_store=Minimal(b"x" * 5))
    with pytest.raises(KeyStoreError, match="failed to give the key 'example_store': keystore locked"):
        SQLiteExampleStore(tmp_path / "app.db", key_store=Minimal(RuntimeError("keystore locked")))
    with pytest.raises(ExampleStoreError, match="KeyStore"):
        SQLiteExampleStore(tmp_path / "x.db", key_store=object())  # type: ignore[arg-type]


def test_a_key_store_write_removes_the_copies_of_writers_killed_before_their_rename(tmp_path):
    """A FileKeyStore writes its keys aside and renames the copy over the file: an app killed
    between the two (SIGKILL, a power cut) left the copy, keys and all, beside the file for good."""
    path = tmp_path / "keys.json"
    FileKeyStore(path).get_or_create_key("app")
    left = tmp_path / ".keys.json.0123abcd.tmp"  # what a writer killed before its rename leaves
    left.write_text('{"version": 1, "keys": {}}')
    os.chmod(left, 0o600)
    other = tmp_path / ".other.json.0123abcd.tmp"  # another key store's: not this one's to remove
    other.write_text("{}")
    FileKeyStore(path).get_or_create_key("another")
    assert not left.exists() and other.exists()
    assert FileKeyStore(path).aliases() == ["another", "app"]


def test_a_key_store_write_syncs_the_file_then_its_folder_after_the_rename(tmp_path, monkeypatch):
    """The rename of the key file into place is on disk only once its folder is synced: without
    that, a power cut could undo the write of a new key, and the examples sealed with it be lost."""
    path = tmp_path / "keys.json"
    synced: list[tuple[str, bool]] = []  # (what the descriptor is, whether the key file was in place)
    fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        st = os.fstat(fd)
        is_folder = stat.S_ISDIR(st.st_mode) and os.path.samestat(st, os.stat(tmp_path))
        synced.append(("folder" if is_folder else "file", path.exists()))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    FileKeyStore(path).get_or_create_key("app")
    assert synced == [("file", False), ("folder", True)]
