"""Backing a server's SQLite database up while it serves, and restoring one onto a stopped server's
path (``fedfleet server backup`` / ``restore``).

Why not a file copy: the database is in WAL mode, and its latest writes are in ``fl.db-wal``
beside it; ``cp fl.db`` while the server runs copies a file without them, torn if a checkpoint
writes it meanwhile. SQLite's backup API reads one consistent snapshot (in one step: a reader in
WAL mode blocks no writer, and a backup in several steps starts again at each write of another
process, so under a busy server it might never end). The copy is written beside its destination,
checked (``PRAGMA integrity_check``, and the server's tables) and only then renamed into place, so
a failed or killed backup leaves no half file under the name an operator restores from. The copy is
one self-contained file (rollback journal, not WAL): it can be moved and copied as it is.

Why a restore command: the steps by hand have three ways to go wrong that it rules out. A server
still running on the file goes on writing into the file it opened, and what it writes is lost
(restore holds the database as a server does, and refuses one a server holds); ``fl.db-wal`` left
from the replaced file would be applied to the restored one (restore removes it and ``fl.db-shm``
first); and a copy cut short would be started on (restore renames a checked copy into place)."""

from __future__ import annotations

import contextlib
import glob
import os
import sqlite3
import tempfile
from dataclasses import dataclass, replace
from urllib.parse import quote

from example_store.keystore import sync_folder

from .persistence import (
    OS_ADVICE,
    SCHEMA_VERSION,
    DatabaseInUse,
    hold_data,
    hold_file,
    lock_path,
    release_file,
    store_advice,
)

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows has no flock: a part left there stays
    fcntl = None  # type: ignore[assignment]


def _os_reason(exc: OSError) -> str:
    """An operating system's error on a file this module writes, with what to do about it."""
    if exc.errno in OS_ADVICE:  # a full disk, a read-only file system, permissions
        return store_advice(exc)
    return f"{exc.strerror or exc}; check that the folder exists and is on a file system this user may write"


#: The tables every server database has, from the first layout on.
SERVER_TABLES = ("populations", "resources", "tasks", "rounds")


class BackupError(Exception):
    """A backup or restore that cannot be made; the message says why and what to do, in one line."""


@dataclass(frozen=True)
class Contents:
    """What a server database holds, as the operator checks a backup by it."""

    populations: int
    tasks: int
    rounds: int
    bytes: int
    #: The database layout a restored backup was stamped with (None: from before layouts were
    #: recorded, or not read).
    layout: int | None = None

    def describe(self) -> str:
        return (
            f"{self.populations} population(s), {self.tasks} task(s), {self.rounds} round record(s), {self.bytes} bytes"
        )


def _connect(path: str, what: str) -> sqlite3.Connection:
    """An existing SQLite file opened for reading and writing (never created: a missing file is
    refused before, a file that vanished since fails here)."""
    try:
        return sqlite3.connect(f"file:{quote(os.path.abspath(path))}?mode=rw", uri=True, timeout=5.0)
    except sqlite3.Error as exc:
        raise BackupError(f"cannot open {what} {path}: {store_advice(exc)}") from None


def _server_contents(conn: sqlite3.Connection, path: str, what: str) -> Contents:
    """The counts of a server database, or ``BackupError`` for a file that is not one (``what``
    names it: the option it was given to)."""
    advice = "give a file fedfleet server backup wrote" if what == "--backup" else "give the --db a server runs with"
    try:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        missing = [t for t in SERVER_TABLES if t not in tables]
        if missing:
            raise BackupError(
                f"{what} {path} is not a server database (it has no table {', '.join(missing)}); {advice}"
            )
        count = {
            t: int(conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]) for t in ("populations", "tasks", "rounds")
        }
        size = conn.execute("PRAGMA page_count").fetchone()[0] * conn.execute("PRAGMA page_size").fetchone()[0]
    except sqlite3.OperationalError as exc:  # locked past the busy timeout, unreadable
        raise BackupError(f"cannot read {what} {path}: {store_advice(exc)}") from None
    except sqlite3.DatabaseError as exc:  # not an SQLite file at all
        raise BackupError(f"{what} {path} is not a server database ({exc}); {advice}") from None
    return Contents(count["populations"], count["tasks"], count["rounds"], int(size))


def server_database(path: str, option: str = "--db") -> Contents:
    """What the server database at ``path`` holds; ``BackupError`` for a file that does not exist
    or is not one (checked without writing to it: a server's store would make its tables there)."""
    _check_file(path, "server database", option)
    conn = _connect(path, "the database")
    try:
        return _server_contents(conn, path, option)
    finally:
        conn.close()


def _refuse_newer(backup_path: str) -> int | None:
    """The backup's layout (None: none recorded), or ``BackupError`` for one later than this
    server's (``SCHEMA_VERSION``): put in place, it was said to go on from its last committed
    rounds, and this server then refused to start on it; the file it would have replaced was gone."""
    conn = _connect(backup_path, "the backup")
    try:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        row = conn.execute("SELECT version FROM schema WHERE id = 1").fetchone() if "schema" in tables else None
    except sqlite3.Error as exc:
        raise BackupError(f"cannot read --backup {backup_path}: {store_advice(exc)}") from None
    finally:
        conn.close()
    if row is not None and isinstance(row[0], int) and row[0] > SCHEMA_VERSION:
        raise BackupError(
            f"--backup {backup_path} has layout {row[0]}, written by a newer server (this one knows layouts up to "
            f"{SCHEMA_VERSION}): restore it with that version's fedfleet, or give a backup of layout {SCHEMA_VERSION} or earlier"
        )
    return row[0] if row is not None and isinstance(row[0], int) else None


def _check_file(path: str, what: str, option: str) -> None:
    if "://" in path:
        raise BackupError(
            f"{option} {path} is a URL; give the SQLite file's path (a database server has its own backups)"
        )
    if os.path.isdir(path):
        raise BackupError(f"{option} {path} is a folder; give the {what}'s file")
    if not os.path.exists(path):
        raise BackupError(f"{option} {path} does not exist; give the {what}'s file")


#: The files SQLite and a server keep beside a database ``fl.db``, by what they are.
COMPANIONS = {
    "-wal": "write-ahead log",
    "-shm": "shared memory index",
    "-journal": "rollback journal",
    ".lock": "lock file",
}


def _refuse_companion(path: str, option: str) -> None:
    """``BackupError`` for ``path`` that is a file SQLite or a server keeps beside a database
    (``fl.db-wal`` beside ``fl.db``): written there, it would be applied to that database."""
    for suffix, what in COMPANIONS.items():
        base = path[: -len(suffix)]
        if path.endswith(suffix) and base and os.path.isfile(base):
            raise BackupError(
                f"{option} {path} is the {what} of the database {base}, where SQLite would apply it; give another path"
            )


def _same_file(a: str, b: str) -> bool:
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


def _remove_stale_parts(folder: str, name: str) -> None:
    """Remove the copies a killed backup or restore of ``name`` left in ``folder`` (SIGKILL, a power
    cut): a copy being written is locked (``flock``) by its process, so only those of no live one go."""
    if fcntl is None:
        return
    for part in glob.glob(os.path.join(glob.escape(folder), f".{glob.escape(name)}.*.part")):
        try:
            fd = os.open(part, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # another backup writes it
        finally:
            os.close(fd)
        for leftover in (part, f"{part}-journal"):
            try:
                os.unlink(leftover)
            except OSError:
                pass


def _checked_copy(source_path: str, what: str, dest: str, option: str) -> tuple[str, Contents, int]:
    """Copy the database ``source_path`` (``what`` it is; one snapshot, SQLite's backup API) into a
    new file beside ``dest``, check it and make it durable: its path (the caller renames it into
    place, or removes it), what it holds, and a descriptor holding it as this process's (the caller
    closes it once the copy is in place)."""
    folder = os.path.dirname(os.path.abspath(dest))
    if not os.path.isdir(folder):
        raise BackupError(f"{option} {dest}: its folder {folder} does not exist; make it first, or give another path")
    _remove_stale_parts(folder, os.path.basename(dest))
    try:
        fd, part = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(dest)}.", suffix=".part")
    except OSError as exc:
        raise BackupError(f"cannot write in {folder} ({option}): {_os_reason(exc)}") from None
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held until the copy is in place or removed: not a stale one
        part, contents = _write_copy(source_path, what, dest, part)
    except BaseException:
        os.close(fd)
        raise
    return part, contents, fd


def _write_copy(source_path: str, what: str, dest: str, part: str) -> tuple[str, Contents]:
    try:
        with (
            contextlib.closing(_connect(source_path, what)) as source,
            contextlib.closing(sqlite3.connect(part)) as copy,
        ):
            source.backup(copy)  # in one step: one consistent snapshot, however busy the server is
            copy.execute("PRAGMA journal_mode=DELETE")  # one self-contained file, no -wal beside it
            verdict = copy.execute("PRAGMA integrity_check").fetchone()[0]
            if verdict != "ok":
                raise BackupError(
                    f"the copy of {source_path} fails SQLite's integrity check ({verdict}): {source_path} itself is "
                    "damaged; keep it as it is and restore an earlier backup"
                )
            contents = _server_contents(copy, source_path, "the copy of")
        with open(part, "rb+") as written:
            os.fsync(written.fileno())
    except BaseException as exc:
        for leftover in (part, f"{part}-journal"):
            if os.path.exists(leftover):
                os.unlink(leftover)
        if isinstance(exc, sqlite3.Error):
            raise BackupError(f"cannot copy {source_path} to {dest}: {store_advice(exc)}") from None
        if isinstance(exc, OSError):
            raise BackupError(f"cannot write {dest}: {_os_reason(exc)}") from None
        raise
    return part, contents


def _put_in_place(part: str, dest: str, before: tuple[str, ...] = ()) -> None:
    """Rename the checked copy ``part`` to ``dest`` once the files ``before`` are removed (the
    replaced database's -wal and -shm); ``part`` is removed if that fails."""
    try:
        for leftover in before:
            if os.path.exists(leftover):
                os.unlink(leftover)
        os.replace(part, dest)
    except OSError as exc:
        os.unlink(part)
        raise BackupError(f"cannot write {dest}: {_os_reason(exc)}") from None
    try:
        sync_folder(os.path.dirname(os.path.abspath(dest)))
    except OSError as exc:  # the copy is in place; its name may not survive a power cut
        raise BackupError(f"wrote {dest} but could not sync its folder: {_os_reason(exc)}") from None


def _keep_owner(part: str, db: str) -> None:
    """Give the restored copy the replaced database's permissions and, where this user may, its
    owner: a server that runs as another user opens it as it opened the file it replaces."""
    try:
        st = os.stat(db)
    except OSError:
        return  # none replaced: the copy stays readable by this user only, as a backup is
    os.chmod(part, st.st_mode & 0o777)
    try:
        os.chown(part, st.st_uid, st.st_gid)
    except OSError:
        pass  # not this user's to give: the copy is this user's, with the replaced file's permissions


def _refuse_held(path: str, what: str) -> None:
    """``BackupError`` when a server holds ``path`` (its lock file, as ``ServerStore.hold`` takes it)."""
    try:
        if os.path.exists(lock_path(path)):
            hold_file(path, probe=True)
        else:  # no server ran on this name; one may run on another (a hard link): the file's own lock
            held = hold_data(path, None)
            if held is not None:
                os.close(held)
    except DatabaseInUse as exc:
        raise BackupError(f"{what}: {exc}; stop it first, or give another path") from None


def backup(db: str, out: str, *, force: bool = False) -> Contents:
    """Copy the server database ``db`` to ``out`` while a server may run on it: one consistent
    snapshot, integrity-checked, written whole or not at all. ``out`` must not exist unless
    ``force`` (and no server may run on it)."""
    _check_file(db, "server database", "--db")
    if "://" in out:
        raise BackupError(f"--out {out} is a URL; give the path of the backup file to write")
    if _same_file(db, out):
        raise BackupError(f"--out {out} is the database itself; give another path for the backup")
    _refuse_companion(out, "--out")
    if os.path.isdir(out):
        raise BackupError(f"--out {out} is a folder; give the path of the backup file to write")
    if os.path.exists(out):
        if not force:
            raise BackupError(f"--out {out} exists; give another path, or --force to replace it")
        _refuse_held(out, f"--out {out}")
    server_database(db)
    part, contents, held = _checked_copy(db, "the database", out, "--out")
    try:
        if not force and os.path.exists(out):  # made meanwhile
            os.unlink(part)
            raise BackupError(f"--out {out} exists; give another path, or --force to replace it")
        _put_in_place(part, out)
    finally:
        os.close(held)
    return contents


def restore(backup_path: str, db: str) -> Contents:
    """Put the backup ``backup_path`` in place of the database ``db`` of a stopped server: refused
    while a server holds ``db``, which is held meanwhile so that none starts on it; ``db-wal`` and
    ``db-shm`` of the replaced file are removed before the checked copy is renamed into place."""
    _check_file(backup_path, "backup", "--backup")
    if "://" in db:
        raise BackupError(f"--db {db} is a URL; give the path of the server's SQLite file")
    if os.path.isdir(db):
        raise BackupError(f"--db {db} is a folder; give the server's database file")
    if _same_file(backup_path, db):
        raise BackupError(f"--backup {backup_path} is the database itself; give the backup file")
    _refuse_companion(db, "--db")
    folder = os.path.dirname(os.path.abspath(db))
    if not os.path.isdir(folder):
        raise BackupError(f"--db {db}: its folder {folder} does not exist; make it first, or give another path")
    server_database(backup_path, "--backup")  # (before the hold: a refused restore makes no lock file)
    layout = _refuse_newer(backup_path)
    try:
        lock = hold_file(db)
    except DatabaseInUse as exc:
        raise BackupError(f"{exc}: stop it before restoring, and restore again") from None
    except OSError as exc:
        raise BackupError(f"cannot write in {folder} (--db): {_os_reason(exc)}") from None
    try:
        part, contents, held = _checked_copy(backup_path, "the backup", db, "--db")
        try:
            _keep_owner(part, db)
            # the replaced file's journals go first: applied to the restored file, they would damage it
            _put_in_place(part, db, before=(f"{db}-wal", f"{db}-shm", f"{db}-journal"))
        finally:
            os.close(held)
        return replace(contents, layout=layout)
    finally:
        release_file(lock)
