"""One way to open an SQLite database for the project: the app's database (example store, opstats,
scheduler jobs) and the server's. WAL so that readers and the writer do not block each other;
synchronous=NORMAL because in WAL mode it is still crash-safe (only the last commits may roll back
on power loss), and FULL (``durable``) for the records that must survive a power cut too: opstats'
record that a session's update is about to leave.

The app's database holds its users' data: it is opened ``private`` (see ``sqlite_engine``), made
readable by its owner only and with the rows it deletes overwritten with zeros."""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import URL, Connection, Engine, create_engine, event

#: The bytes SQLite leaves its write-ahead log at once a checkpoint has copied it back
#: (``PRAGMA journal_size_limit``; about what it checkpoints at, 1,000 pages of 4 KiB): without it
#: the log kept the size of the largest transaction ever written, a server's 20 MB model commit
#: 20 MB on disk beside the database for as long as the file was open.
WAL_SIZE_LIMIT = 4 << 20


def configure_connection(
    dbapi_connection: sqlite3.Connection,
    *,
    foreign_keys: bool = False,
    busy_timeout_s: float = 30.0,
    durable: bool = False,
    secure_delete: bool = False,
) -> None:
    """``durable``: every commit is on disk when it returns (``synchronous=FULL``: the WAL is
    synced at each commit), for records that must outlive a power cut, not only a killed process.
    ``secure_delete``: SQLite overwrites what it deletes with zeros (``PRAGMA secure_delete``), where
    builds without ``SQLITE_SECURE_DELETE`` (the default of SQLite's own sources) leave a deleted
    row's bytes in the file's free pages until they are reused."""
    cursor = dbapi_connection.cursor()
    try:
        _to_wal(cursor, busy_timeout_s)
        cursor.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        if secure_delete:
            cursor.execute("PRAGMA secure_delete=ON")
        cursor.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
        if foreign_keys:
            cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def _to_wal(cursor: sqlite3.Cursor, wait_s: float) -> None:
    """``PRAGMA journal_mode=WAL``, waited for as a write is: on a new file, another process turning
    it to WAL at the same moment holds a lock that SQLite's busy handler does not wait on, and the
    pragma failed at once with 'database is locked'."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL").fetchall()
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.005)


def sqlite_engine(
    path: str | os.PathLike,
    *,
    foreign_keys: bool = False,
    busy_timeout_s: float = 30.0,
    durable: bool = False,
    private: bool = False,
    **engine_kwargs: Any,
) -> Engine:
    """An engine over the SQLite file ``path``, shared across threads, every connection in WAL.
    A writer waits up to ``busy_timeout_s`` for another process's lock, then fails. ``durable``:
    each commit is synced to disk before it returns (see ``configure_connection``). ``private``
    (the app's database, which holds its users' examples and history): the file is made
    readable and writable by its owner only, a missing one as it is made and an existing one too
    (SQLite gives its ``-wal`` and ``-shm`` files the database's mode), where SQLite made it 0644
    under the usual umask, readable by every user of the machine; and deleted rows are overwritten with zeros (``secure_delete``)."""
    if private:
        _create_private(path)
    engine = create_engine(
        URL.create("sqlite", database=os.fspath(path)),
        connect_args={"check_same_thread": False, "timeout": busy_timeout_s},
        **engine_kwargs,
    )
    event.listen(
        engine,
        "connect",
        lambda conn, _record: configure_connection(
            conn, foreign_keys=foreign_keys, busy_timeout_s=busy_timeout_s, durable=durable, secure_delete=private
        ),
    )
    return engine


def _create_private(path: str | os.PathLike) -> None:
    """Creates ``path`` empty with mode 0600 if it is missing (SQLite takes an empty file for a new
    database), or takes the group's and others' access away from an existing one and its ``-wal``
    and ``-shm`` (an app's database from before, made 0644); a file that cannot be made or changed
    here (another user's, a read-only folder) is left for SQLite to open or to refuse with its own
    error. ``:memory:`` is no file: it made one of that name in the working folder."""
    name = os.fspath(path)
    if name in ("", ":memory:"):
        return
    try:
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        return
    except OSError:
        pass
    for existing in (name, f"{name}-wal", f"{name}-shm"):
        try:
            mode = stat.S_IMODE(os.stat(existing).st_mode)
            if mode & 0o077:
                os.chmod(existing, mode & 0o700)
        except OSError:
            pass


def scrub_wal(dbapi_connection: sqlite3.Connection) -> bool:
    """Copies the write-ahead log into the database and truncates it to 0 bytes (``PRAGMA
    wal_checkpoint(TRUNCATE)``), so that the log keeps no earlier copy of the pages a delete just
    overwrote; without it a deleted example's bytes stayed in ``-wal`` until SQLite happened to
    write over them. Does not wait: False when a read that began before the delete (a session's
    iterator, another process) still holds an older snapshot, and the log could not be cut yet.
    The connection's own wait for locks is put back after (it was set to 30 s whatever the engine's)."""
    cursor = dbapi_connection.cursor()
    try:
        (waited_ms,) = cursor.execute("PRAGMA busy_timeout").fetchone()
        cursor.execute("PRAGMA busy_timeout=0")
        try:
            busy, _, _ = cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            cursor.execute(f"PRAGMA busy_timeout={int(waited_ms)}")
    except sqlite3.Error:
        return False
    finally:
        cursor.close()
    return not busy


#: The first four bytes of a write-ahead log SQLite wrote (big-endian; the last bit is its
#: checksums' byte order).
_WAL_MAGIC = (0x377F0682, 0x377F0683)


def damaged_wal(path: str | os.PathLike) -> bool:
    """Whether ``path``'s write-ahead log holds bytes that are not one SQLite wrote: zeroed or
    garbled, as a power cut can leave it. SQLite takes such a log for an empty one and opens the
    database as its last checkpoint left it, saying nothing of the commits the log held. SQLite
    writes a log's header before any of its frames, and a reset rewrites it in place with the same
    magic, so a log of some bytes without it is never one that SQLite is writing."""
    try:
        with open(os.fspath(path) + "-wal", "rb") as wal:
            head = wal.read(4)
    except OSError:  # no log: the database was closed cleanly, or never written
        return False
    return len(head) > 0 and (len(head) < 4 or int.from_bytes(head, "big") not in _WAL_MAGIC)


@contextmanager
def write_locked(engine: Engine) -> Iterator[Connection]:
    """A transaction that holds the database's write lock from its start (``BEGIN IMMEDIATE``), so
    that what it reads before it writes (the tables made on a first open, a store's metadata) is
    not raced by another process opening the same file at the same moment: with a deferred
    transaction two processes both found no table, and the second to create one failed."""
    with engine.begin() as conn:
        conn.exec_driver_sql("BEGIN IMMEDIATE")
        yield conn


#: What to do about an SQLite error on an app's database, by its primary result code.
_ADVICE = {
    sqlite3.SQLITE_FULL: "the disk is full: free space and retry (nothing of the failed write was kept)",
    sqlite3.SQLITE_IOERR: "the disk failed the write, is full, or the process reached its file size limit: free "
    "space and retry (nothing of the failed write was kept)",
    sqlite3.SQLITE_BUSY: "another process holds it locked: retry later",
    sqlite3.SQLITE_LOCKED: "another connection holds it locked: retry later",
    sqlite3.SQLITE_CORRUPT: "the file is damaged: move it aside or delete it to start afresh",
    sqlite3.SQLITE_NOTADB: "the file is not an SQLite database: give another path, or move it aside or delete it",
    # a folder given for the file came here too, and was told to create its folder
    sqlite3.SQLITE_CANTOPEN: "it cannot be opened: give the path of a file (not a folder) in a folder that exists, "
    "and check its permissions",
    sqlite3.SQLITE_READONLY: "it is read-only: check its permissions and its file system",
}


def sqlite_locked(exc: BaseException) -> bool:
    """Whether an SQLite (or SQLAlchemy over SQLite) error is another holder's lock, which waiting
    ends (``SQLITE_BUSY``, ``SQLITE_LOCKED``): the one failure a later retry of the same call mends."""
    reason = getattr(exc, "orig", None) or exc
    code = getattr(reason, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def sqlite_advice(exc: BaseException) -> str:
    """The reason an SQLite (or SQLAlchemy over SQLite) error gives, and what to do about it."""
    reason = getattr(exc, "orig", None) or exc
    code = getattr(reason, "sqlite_errorcode", None)
    advice = None if code is None else _ADVICE.get(code & 0xFF)
    generic = "if the file is damaged, move it aside or delete it to start afresh; if it is locked, retry later"
    return f"{reason}; {advice or generic}"
