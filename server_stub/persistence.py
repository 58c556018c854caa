"""SQLite persistence through SQLAlchemy: populations, tasks, content-addressed resources (plans
and checkpoints) and rounds. Individual device updates are never stored here."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

from sqlalchemy import (
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    and_,
    create_engine,
    exists,
    func,
    inspect,
    literal,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.engine import Connection, CursorResult, Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.elements import ColumnElement

from example_store.sqlite_engine import sqlite_advice, sqlite_engine, write_locked

log = logging.getLogger(__name__)

metadata = MetaData()

#: The layout of the server's tables this server writes, kept in the table ``schema``. A layout
#: change adds a migration from the one before (``MIGRATIONS``) and raises this by one; a database
#: of a later layout (written by a newer server) is refused rather than written in a layout it does
#: not know. 1: populations, resources, tasks, rounds. 2: the rounds' indexes (by task, and by the
#: model they name), and ``pruned_rounds`` (what retention removed of each task's history, which a
#: server of layout 1 would not count). 3: ``removed_rounds`` (where in the order of ``GET /rounds``
#: the records retention removed were, so that a page's cursor naming one still pages back). 4:
#: ``summed_sessions`` (the sessions whose updates each task's last committed round holds).
SCHEMA_VERSION = 4

schema = Table(
    "schema",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("version", Integer, nullable=False),
)

populations = Table(
    "populations",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(128), unique=True, nullable=False),
    Column("created_at", Float, nullable=False),
)

resources = Table(
    "resources",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("kind", String(16), nullable=False),
    Column("data", LargeBinary, nullable=False),
    Column("created_at", Float, nullable=False),
)

tasks = Table(
    "tasks",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("population_id", Integer, ForeignKey("populations.id"), nullable=False),
    Column("name", String(128), nullable=False),
    Column("plan_id", String(64), ForeignKey("resources.id"), nullable=False),
    Column("initial_checkpoint_id", String(64), ForeignKey("resources.id"), nullable=False),
    Column("config", Text, nullable=False),
    Column("status", String(16), nullable=False),
    Column("created_at", Float, nullable=False),
    UniqueConstraint("population_id", "name"),
)

rounds = Table(
    "rounds",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("task_id", Integer, ForeignKey("tasks.id"), nullable=False),
    Column("number", Integer, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("status", String(16), nullable=False),
    Column("checkpoint_id", String(64), ForeignKey("resources.id")),
    Column("metrics", Text, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("ended_at", Float, nullable=False),
    # a task's rounds in the order pages of ``GET /rounds`` read them (``round_page``), and by
    # number (a round's record is looked up before it is written, a task's history and its last
    # committed round): without them each of those reads scanned every round of every task
    Index("rounds_by_task_start", "task_id", "started_at", "number", "attempt"),
    Index("rounds_by_task_number", "task_id", "number", "attempt"),
    # the rounds that name a model: deleting a checkpoint (retention, ``fedfleet prune``) has SQLite
    # check that no round names it (a foreign key), which scanned every round for each checkpoint
    Index("rounds_by_checkpoint", "checkpoint_id"),
)

# What retention (``ServerStore.prune_rounds``) removed of a task's rounds: how many records, and
# how many of them had committed. A task's committed rounds count towards its ``max_rounds``, and
# the turns of tasks that take turns count every record, after a restart as before it.
pruned_rounds = Table(
    "pruned_rounds",
    metadata,
    Column("task_id", Integer, ForeignKey("tasks.id"), primary_key=True),
    Column("rounds", Integer, nullable=False),
    Column("committed", Integer, nullable=False),
)


# Where each round record retention removed was in the order of ``round_page`` (its start, task,
# number and attempt), kept ``REMOVED_CURSOR_S`` after its removal: an operator paging back through
# a history whose cursor's round was removed between two pages goes on from where it was.
removed_rounds = Table(
    "removed_rounds",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("task_id", Integer, ForeignKey("tasks.id"), nullable=False),
    Column("number", Integer, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("removed_at", Float, nullable=False),
)

# The sessions whose updates each task's last committed round holds (their tokens' SHA-256), written
# in the commit's transaction and replaced by the task's next commit. A server killed once a round
# committed and before its devices heard so (the device whose report or Secure Aggregation message
# closed it waits for its commit) forgot their sessions: asked again, it told them their sessions
# were unknown, and each kept its session as refused, not as taking part, and trained and sent the
# same examples again though the model held them. The restarted server tells them their updates
# are in the round (``FLService``: a report already taken, a secure group completed).
summed_sessions = Table(
    "summed_sessions",
    metadata,
    Column("token_hash", LargeBinary(32), primary_key=True),
    Column("session_id", String(64), nullable=False),
    Column("task_id", Integer, ForeignKey("tasks.id"), nullable=False, index=True),
    Column("number", Integer, nullable=False),
)

#: Seconds a removed round's place in the order of pages is kept (a day: far longer than an
#: operator takes between two pages, about 40 bytes a removed record).
REMOVED_CURSOR_S = 86_400.0


def _layout_2(conn: Connection) -> None:
    """Layout 1 to 2: the rounds' indexes (a server of layout 1 made the first two, unrecorded,
    from a point on) and the table of pruned rounds."""
    for index in rounds.indexes:
        index.create(conn, checkfirst=True)
    pruned_rounds.create(conn, checkfirst=True)


def _layout_3(conn: Connection) -> None:
    """Layout 2 to 3: the table of removed rounds' places in the order of pages."""
    removed_rounds.create(conn, checkfirst=True)


def _layout_4(conn: Connection) -> None:
    """Layout 3 to 4: the table of the sessions each task's last committed round holds."""
    summed_sessions.create(conn, checkfirst=True)


#: The migration from each layout to the next, by the layout it starts from.
MIGRATIONS: dict[int, Callable[[Connection], None]] = {1: _layout_2, 2: _layout_3, 3: _layout_4}


def _inserted_id(result: CursorResult[Any]) -> int:
    """The primary key of the one row an INSERT added."""
    key = result.inserted_primary_key
    assert key is not None  # an INSERT of one row into a table with a primary key
    return int(key[0])


def _json(value: object) -> str:
    """Strict JSON: a NaN or infinity is a bug upstream, never something to store."""
    return json.dumps(value, allow_nan=False, separators=(",", ":"))


def _load_metrics(text: str) -> dict:
    """Metrics as stored; a NaN or infinity written by an older server reads as null."""
    return json.loads(text, parse_constant=lambda _constant: None)


#: What to do about an operating system's error on the database's files (its lock file, a file
#: SQLite could not make), by its errno: SQLite's own errors say theirs (``sqlite_advice``).
OS_ADVICE = {
    errno.ENOSPC: "the disk is full: free space and retry (nothing of the failed write was kept)",
    errno.EDQUOT: "the disk quota is used up: free space and retry (nothing of the failed write was kept)",
    errno.EROFS: "its file system is read-only: give --db a file on a writable one",
    errno.EACCES: "permission denied: check the permissions of the file and its folder",
    errno.EPERM: "permission denied: check the permissions of the file and its folder",
}


def store_advice(exc: BaseException) -> str:
    """The reason a database error gives and what to do about it, in one line: SQLite's and
    SQLAlchemy's (``sqlite_advice``), and the operating system's on the files beside the database."""
    if isinstance(exc, OSError) and exc.errno in OS_ADVICE:
        return f"{exc.strerror or exc}; {OS_ADVICE[exc.errno]}"
    return sqlite_advice(exc)


class DamagedStore(Exception):
    """A stored plan or checkpoint whose bytes no longer match their content id (a storage fault,
    or the database edited by hand): the server refuses to build on it."""


class StoreLayoutError(Exception):
    """A database whose tables are not in a layout this server knows (written by a newer server, or
    not the server's): it is refused before anything is read or written. The message says what to do."""


class DatabaseInUse(Exception):
    """Another server process holds the database: two servers on one database would each run the
    same rounds and serve models the other does not know."""


@dataclass(frozen=True)
class NewTask:
    """A task to store: its name, plan and initial checkpoint bytes, its config (JSON), and the
    other resources its config names as (bytes, kind) (a release's versioned plans and report)."""

    name: str
    plan: bytes
    checkpoint: bytes
    config: dict
    resources: tuple[tuple[bytes, str], ...] = ()


def resource_id(data: bytes) -> str:
    """Resources are content-addressed, so an id names exactly one byte string and can be cached."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class TaskRecord:
    id: int
    population: str
    name: str
    plan_id: str
    initial_checkpoint_id: str
    config: dict
    status: str


@dataclass(frozen=True)
class RoundRecord:
    id: int
    task_id: int
    number: int
    attempt: int
    status: str
    checkpoint_id: str | None
    metrics: dict
    started_at: float
    ended_at: float

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.number,
            "attempt": self.attempt,
            "status": self.status,
            "checkpoint_id": self.checkpoint_id,
            "metrics": self.metrics,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
        }


@dataclass(frozen=True)
class PrunedRounds:
    """What ``ServerStore.prune_rounds`` removed: round records (and how many of them had
    committed), and the checkpoints nothing names any more and their bytes."""

    rounds: int = 0
    committed: int = 0
    checkpoints: int = 0
    bytes: int = 0

    def __add__(self, other: PrunedRounds) -> PrunedRounds:
        return PrunedRounds(
            self.rounds + other.rounds,
            self.committed + other.committed,
            self.checkpoints + other.checkpoints,
            self.bytes + other.bytes,
        )


@dataclass(frozen=True)
class Pruned:
    """What ``ServerStore.prune_models`` dropped: the rounds whose model went, and the checkpoints
    (with the plans and release reports no task names) deleted and their bytes."""

    rounds: int
    checkpoints: int
    bytes: int


def _round_record(row: Any) -> RoundRecord:
    return RoundRecord(
        row["id"],
        row["task_id"],
        row["number"],
        row["attempt"],
        row["status"],
        row["checkpoint_id"],
        _load_metrics(row["metrics"]),
        row["started_at"],
        row["ended_at"],
    )


def lock_path(file: str) -> str:
    """The lock file of the SQLite ``file``: beside the file its path leads to, so that a server
    started on a symbolic link to a database and a command given the database itself (or another
    link) take one lock."""
    return f"{os.path.realpath(file)}.lock"


#: The database file's own descriptor that each held lock file's descriptor keeps (``hold_file``).
_DATABASE_FDS: dict[int, int] = {}


def hold_file(file: str, shown: str | None = None, *, probe: bool = False) -> int:
    """Take the advisory lock a server holds its SQLite ``file`` by (``ServerStore.hold``): a
    descriptor of ``<file>.lock`` whose closing (``release_file``) releases it, with this process's
    id written in it. ``DatabaseInUse`` (naming ``shown``, the holder's pid and the lock file) when
    another process holds it. With ``probe``, the lock is released at once, nothing is written, and
    -1 returned.

    The database file itself is locked too (``flock``, which SQLite's own byte-range locks do not
    touch): a hard link to it is another name with a lock file of its own, and two servers started
    on two names of one file would otherwise each hold a lock and run the same rounds."""
    lock = lock_path(file)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise DatabaseInUse(
            f"the database {shown or file} is in use by another server (pid {holder}, {lock})"
        ) from None
    except OSError:
        os.close(fd)
        raise
    try:
        data_fd = hold_data(file, shown)
    except BaseException:
        os.close(fd)
        raise
    if probe:
        if data_fd is not None:
            os.close(data_fd)
        os.close(fd)
        return -1
    if data_fd is not None:
        _DATABASE_FDS[fd] = data_fd
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def hold_data(file: str, shown: str | None) -> int | None:
    """The database file's own lock (``hold_file``): its descriptor, None for a file not made yet
    (a new database has no other name) or without ``fcntl``."""
    if fcntl is None:
        return None
    try:
        data_fd = os.open(file, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(data_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        links = os.fstat(data_fd).st_nlink
        os.close(data_fd)
        raise DatabaseInUse(
            f"the database {shown or file} is in use by another server, started on another of its {links} names "
            "(a hard link to the file: its lock file is beside that name)"
        ) from None
    except OSError:
        os.close(data_fd)
        raise
    return data_fd


def hold_data_made(fd: int, file: str, shown: str | None) -> None:
    """Take the database file's own lock for the lock ``fd`` that ``hold_file`` took before the
    file was made (``hold_data`` had nothing to lock): a server that made its database held no lock
    on it until it restarted, and a second server on a hard link made meanwhile ran beside it."""
    if fd not in _DATABASE_FDS:
        data_fd = hold_data(file, shown)
        if data_fd is not None:
            _DATABASE_FDS[fd] = data_fd


def release_file(fd: int) -> None:
    """Release a lock ``hold_file`` took: its lock file's descriptor and the database file's."""
    data_fd = _DATABASE_FDS.pop(fd, None)
    if data_fd is not None:
        os.close(data_fd)
    os.close(fd)


#: How often (seconds of real time) the server looks whether its database file is still at its path.
GONE_CHECK_EVERY_S = 1.0


class ServerStore:
    """The server's database. One instance per server process."""

    def __init__(self, path: str | os.PathLike, *, busy_timeout_s: float = 5.0, hold: bool = False) -> None:
        """``path``: a SQLite file, or a SQLAlchemy URL such as ``sqlite:///fl.db`` or
        ``postgresql+psycopg://...`` (with its driver installed). ``hold``: ``hold`` the database
        before its layout is read or upgraded, so that a database another server runs on is
        refused (``DatabaseInUse``) untouched."""
        self.path = os.fspath(path)
        if "://" in self.path:
            self.engine: Engine = create_engine(self.path, pool_pre_ping=True)
            if self.engine.dialect.name == "sqlite":
                self.engine.dispose()
                self.engine = sqlite_engine(
                    self.engine.url.database or ":memory:", foreign_keys=True, busy_timeout_s=busy_timeout_s
                )
        else:
            self.engine = sqlite_engine(self.path, foreign_keys=True, busy_timeout_s=busy_timeout_s)
        self._lock_fd: int | None = None
        self._file = self._database_file()
        try:
            if hold and (self._file is None or os.path.isdir(os.path.dirname(os.path.abspath(self._file)))):
                self.hold()  # (a file in no folder is no other server's: SQLite says what to do about it)
            self._open_layout()
            if self._lock_fd is not None and self._file is not None:  # a database made just now: its file's lock
                hold_data_made(self._lock_fd, self._file, self.path)
        except BaseException:
            self.close()
            raise
        self._identity = self._file_identity()
        self._gone: str | None = None
        self._gone_checked_at = time.monotonic()

    def _database_file(self) -> str | None:
        """The SQLite file the engine opens, or None (another database, or one in memory)."""
        database = self.engine.url.database if self.engine.dialect.name == "sqlite" else None
        return None if not database or database == ":memory:" else database

    def _file_identity(self) -> tuple[int, int] | None:
        if self._file is None:
            return None
        try:
            st = os.stat(self._file)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def gone(self) -> str | None:
        """Why the database file the server writes is no longer at its path (deleted, or replaced
        by another file), or None while it is: SQLite goes on writing into the file it opened, and
        all of it is lost when the server stops."""
        if self._identity is None:
            return None
        # at most one stat a second of real time: the server asks on every tick, and a simulated
        # fleet's server ticks every simulated second, thousands of times a wall second
        checked = time.monotonic()
        if self._gone is None and checked - self._gone_checked_at < GONE_CHECK_EVERY_S:
            return None
        self._gone_checked_at = checked
        now = self._file_identity()
        if now == self._identity:
            self._gone = None
        else:
            what = "deleted" if now is None else "replaced by another file"
            self._gone = (
                f"the database {self.path} was {what} while the server runs: what it writes now is lost when "
                "it stops; stop the server, put the database (or its latest backup) back at its path, and start "
                "it again"
            )
        return self._gone

    def _open_layout(self) -> None:
        """Make the tables of a new database, or check an existing one's layout and bring it up to
        this server's (``MIGRATIONS``), in one transaction that holds the write lock from its start:
        a file this process cannot write (read-only, or locked by another process past the busy
        timeout) fails here, before the server serves, and an upgrade is all done or not at all. A
        database of a later layout, or tables of the server's names without their columns, are
        refused with ``StoreLayoutError`` before anything is written; one from before the layout
        was recorded (the tables of layout 1) is upgraded as layout 1."""
        with self._write_transaction() as conn:
            existing = set(inspect(conn).get_table_names())
            version = (
                conn.execute(select(schema.c.version).where(schema.c.id == 1)).scalar()
                if "schema" in existing
                else None
            )
            if version is not None and version > SCHEMA_VERSION:
                raise StoreLayoutError(
                    f"the database {self.path} has layout {version}, written by a newer server (this one knows "
                    f"layouts up to {SCHEMA_VERSION}): run that server version, or restore a backup this one wrote"
                )
            for table in metadata.sorted_tables:
                if table.name not in existing:
                    continue
                have = {c["name"] for c in inspect(conn).get_columns(table.name)}
                missing = [c.name for c in table.columns if c.name not in have]
                if missing:
                    raise StoreLayoutError(
                        f"the database {self.path} is not in a layout this server knows: its table {table.name} "
                        f"has no column {', '.join(missing)}; give --db another file, or run the server "
                        "version that wrote it"
                    )
            recorded = version
            if version is None and existing & {t.name for t in metadata.sorted_tables}:
                version = 1  # the tables every server wrote before the layout was recorded
            if version is not None:
                for step in range(version, SCHEMA_VERSION):
                    MIGRATIONS[step](conn)
            metadata.create_all(conn)  # a new database's tables (and any table a layout's migration made)
            if "schema" in existing and conn.execute(select(schema.c.id).where(schema.c.id == 1)).scalar():
                conn.execute(update(schema).where(schema.c.id == 1).values(version=SCHEMA_VERSION))
            else:
                conn.execute(schema.insert().values(id=1, version=SCHEMA_VERSION))
        if version is not None and version < SCHEMA_VERSION:  # once the upgrade is on record
            # said once, as it happens: the server of the release that wrote the file refuses it
            # from now on (or, from before the layout was recorded, runs on it without a word)
            log.info(
                "upgraded the database %s from layout %s to layout %d, every row kept; to go back to the "
                "release that wrote it, restore a backup taken before this start",
                self.path,
                version if recorded is not None else f"{version} (not recorded)",
                SCHEMA_VERSION,
            )

    @contextmanager
    def _write_transaction(self) -> Iterator[Connection]:
        """A transaction that holds the write lock from its start on SQLite (``BEGIN IMMEDIATE``):
        what it reads before it writes is not changed by another process meanwhile."""
        if self.engine.dialect.name == "sqlite":
            with write_locked(self.engine) as conn:
                yield conn
        else:
            with self.engine.begin() as conn:
                yield conn

    def schema_version(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(select(schema.c.version).where(schema.c.id == 1)).scalar_one())

    def hold(self) -> None:
        """Hold the database for this process until ``close``: another server process that calls
        ``hold`` on the same SQLite file gets ``DatabaseInUse`` (naming this one's pid) instead of
        running the same rounds beside it. An advisory lock on ``<file>.lock`` beside the database
        (SQLite's own locks are per write, not per process's lifetime), released by the kernel when
        the process ends, however it ends. Other databases (a server URL) are not held."""
        if fcntl is None or self._file is None:
            return
        try:
            self._lock_fd = hold_file(self._file, self.path)
        except DatabaseInUse as exc:
            raise DatabaseInUse(
                f"{exc}: stop it first, or give --db another file; two servers on one database would run the "
                "same rounds twice"
            ) from None

    @property
    def held(self) -> bool:
        """Whether ``hold`` holds the database for this process (never for a database URL)."""
        return self._lock_fd is not None

    def close(self) -> None:
        self.engine.dispose()
        if self._lock_fd is not None:
            release_file(self._lock_fd)  # the lock goes with the last descriptor
            self._lock_fd = None

    # populations
    def create_population(self, name: str) -> bool:
        """Returns False if it already existed (creating is idempotent)."""
        try:
            with self.engine.begin() as conn:
                conn.execute(populations.insert().values(name=name, created_at=time.time()))
            return True
        except IntegrityError:
            return False

    def population_id(self, name: str) -> int | None:
        with self.engine.connect() as conn:
            return conn.execute(select(populations.c.id).where(populations.c.name == name)).scalar()

    def population_names(self) -> list[str]:
        with self.engine.connect() as conn:
            return list(conn.execute(select(populations.c.name).order_by(populations.c.id)).scalars())

    # resources
    def put_resource(self, data: bytes, kind: str) -> str:
        with self.engine.begin() as conn:
            return self._put(conn, data, kind)

    @staticmethod
    def _put(conn: Connection, data: bytes, kind: str) -> str:
        """Store ``data`` (once: resources are content-addressed). ``created_at`` is when it was
        last stored: a model stored again (the same bytes as an old one) is as new as its round, and
        no pruning of old resources takes it from under the round that stored it."""
        rid = resource_id(data)
        now = time.time()
        if conn.execute(select(resources.c.id).where(resources.c.id == rid)).scalar() is None:
            conn.execute(resources.insert().values(id=rid, kind=kind, data=data, created_at=now))
        else:
            conn.execute(update(resources).where(resources.c.id == rid).values(created_at=now))
        return rid

    def get_resource(self, rid: str) -> bytes | None:
        with self.engine.connect() as conn:
            return conn.execute(select(resources.c.data).where(resources.c.id == rid)).scalar()

    def resource(self, rid: str) -> bytes:
        """A resource that must exist (a stored task's plan or checkpoint); KeyError when it does
        not, ``DamagedStore`` when its bytes no longer match their id."""
        with self.engine.connect() as conn:
            row = conn.execute(select(resources.c.data, resources.c.kind).where(resources.c.id == rid)).first()
        if row is None:
            raise KeyError(rid)
        data, kind = row
        if resource_id(data) != rid:
            raise DamagedStore(
                f"the database {self.path} is damaged: its {kind} {rid} no longer matches its id (SHA-256); "
                "restore the database from a backup"
            )
        return data

    # tasks
    def add_tasks(self, population: str, items: list[NewTask]) -> list[TaskRecord]:
        """Store tasks deployed together, with their plans, checkpoints and the resources their
        configs name, in one transaction: a refused deploy (a name taken meanwhile, a full disk)
        or a server killed during it leaves nothing behind."""
        pid = self.population_id(population)
        if pid is None:
            raise KeyError(population)
        records = []
        with self.engine.begin() as conn:
            for item in items:
                plan_id = self._put(conn, item.plan, "plan")
                ckpt_id = self._put(conn, item.checkpoint, "checkpoint")
                for data, kind in item.resources:
                    self._put(conn, data, kind)
                tid = _inserted_id(
                    conn.execute(
                        tasks.insert().values(
                            population_id=pid,
                            name=item.name,
                            plan_id=plan_id,
                            initial_checkpoint_id=ckpt_id,
                            config=_json(item.config),
                            status="active",
                            created_at=time.time(),
                        )
                    )
                )
                records.append(TaskRecord(tid, population, item.name, plan_id, ckpt_id, item.config, "active"))
        return records

    def tasks(self, population: str | None = None) -> list[TaskRecord]:
        query = select(tasks, populations.c.name.label("population")).join(populations).order_by(tasks.c.id)
        if population is not None:
            query = query.where(populations.c.name == population)
        with self.engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        return [
            TaskRecord(
                r["id"],
                r["population"],
                r["name"],
                r["plan_id"],
                r["initial_checkpoint_id"],
                json.loads(r["config"]),
                r["status"],
            )
            for r in rows
        ]

    def set_task_status(self, task_id: int, status: str) -> None:
        self.set_tasks_status([task_id], status)

    def set_tasks_status(self, task_ids: list[int], status: str) -> None:
        """Give the tasks ``status``, all of them or none (one transaction)."""
        with self.engine.begin() as conn:
            conn.execute(update(tasks).where(tasks.c.id.in_(task_ids)).values(status=status))

    # rounds
    def record_round(
        self,
        task_id: int,
        number: int,
        attempt: int,
        status: str,
        metrics: dict,
        started_at: float,
        ended_at: float,
        checkpoint: bytes | None = None,
        broadcast: bytes | None = None,
        *,
        overwrite: bool = False,
        summed: Iterable[tuple[str, bytes]] = (),
    ) -> RoundRecord:
        """Store a finished round, with its new model (and what devices are sent of it) for a
        committed one, in one transaction: either all of it is durable or none of it is.

        Idempotent: a round already on record under (task, number, attempt) is returned as it is,
        not written again. A write whose error came after its transaction had committed, then
        written again, must not leave the round twice. With ``overwrite`` the round on record is
        made to say what is written now (status, metrics, model): the server has acted on this
        outcome, e.g. abandoned a round whose commit it could not see go through.

        ``summed``: for a committed round, the sessions (id, token hash) whose updates it holds;
        they replace the task's earlier ones (``summed_session``)."""
        with self.engine.begin() as conn:
            existing = (
                conn.execute(
                    select(rounds)
                    .where(rounds.c.task_id == task_id, rounds.c.number == number, rounds.c.attempt == attempt)
                    .order_by(rounds.c.id)
                    .limit(1)
                )
                .mappings()
                .first()
            )
            if existing is not None and not overwrite:
                return _round_record(existing)
            checkpoint_id = self._put(conn, checkpoint, "checkpoint") if checkpoint is not None else None
            if broadcast is not None:
                self._put(conn, broadcast, "checkpoint")
            rows = [{"token_hash": h, "session_id": sid, "task_id": task_id, "number": number} for sid, h in summed]
            if rows and status == "committed":
                conn.execute(summed_sessions.delete().where(summed_sessions.c.task_id == task_id))
                conn.execute(summed_sessions.insert(), rows)
            if existing is not None:
                conn.execute(
                    update(rounds)
                    .where(rounds.c.id == existing["id"])
                    .values(status=status, checkpoint_id=checkpoint_id, metrics=_json(metrics))
                )
                return RoundRecord(
                    existing["id"],
                    task_id,
                    number,
                    attempt,
                    status,
                    checkpoint_id,
                    metrics,
                    existing["started_at"],
                    existing["ended_at"],
                )
            rid = _inserted_id(
                conn.execute(
                    rounds.insert().values(
                        task_id=task_id,
                        number=number,
                        attempt=attempt,
                        status=status,
                        checkpoint_id=checkpoint_id,
                        metrics=_json(metrics),
                        started_at=started_at,
                        ended_at=ended_at,
                    )
                )
            )
        return RoundRecord(rid, task_id, number, attempt, status, checkpoint_id, metrics, started_at, ended_at)

    def summed_session(self, session_id: str, token_hash: bytes) -> int | None:
        """The number of the committed round that holds the update of the session ``session_id``
        whose token hashes to ``token_hash``, if it is its task's last committed round; else None."""
        c = summed_sessions.c
        with self.engine.connect() as conn:
            row = conn.execute(select(c.session_id, c.number).where(c.token_hash == token_hash)).first()
        return int(row.number) if row is not None and row.session_id == session_id else None

    def update_round_metrics(self, round_id: int, metrics: dict, key: tuple[int, int, int] | None = None) -> bool:
        """Make the round record ``round_id`` say ``metrics``; with ``key`` (its task, number and
        attempt) only if the record of that id is still that round's. Whether one was changed: not
        when retention removed the record (and SQLite may have given its id to a newer one)."""
        match = [rounds.c.id == round_id]
        if key is not None:
            match += [rounds.c.task_id == key[0], rounds.c.number == key[1], rounds.c.attempt == key[2]]
        with self.engine.begin() as conn:
            return bool(conn.execute(update(rounds).where(*match).values(metrics=_json(metrics))).rowcount)

    def extend_round(self, round_id: int, metrics: dict, ended_at: float) -> RoundRecord:
        """Make a round on record end later and say ``metrics``: the selection timeouts of an idle
        task are one record that grows, not a record each (see ``FLService._commit``)."""
        with self.engine.begin() as conn:
            conn.execute(
                update(rounds).where(rounds.c.id == round_id).values(metrics=_json(metrics), ended_at=ended_at)
            )
            row = conn.execute(select(rounds).where(rounds.c.id == round_id)).mappings().one()
        return _round_record(row)

    def rounds(self, task_id: int, last: int | None = None) -> list[RoundRecord]:
        """A task's rounds in the order they ran: a record kept in memory while the database was
        locked is written after rounds that ran later. ``last``: only the newest so many, read
        alone (a long-running task's whole history is 2 KB a round)."""
        with self.engine.connect() as conn:
            if last is None:
                order = (rounds.c.number, rounds.c.attempt, rounds.c.id)
                query = select(rounds).where(rounds.c.task_id == task_id).order_by(*order)
                rows = list(conn.execute(query).mappings().all())
            else:
                newest = (rounds.c.number.desc(), rounds.c.attempt.desc(), rounds.c.id.desc())
                query = select(rounds).where(rounds.c.task_id == task_id).order_by(*newest).limit(last)
                rows = list(reversed(conn.execute(query).mappings().all()))
        return [_round_record(r) for r in rows]

    def round_page(
        self, task_ids: list[int], last: int | None = None, before: int | None = None
    ) -> tuple[list[RoundRecord], bool] | None:
        """The rounds of ``task_ids`` in the order they ran across the tasks (their start, then task,
        number, attempt and id), oldest first: the newest ``last`` (every one with None) of those
        before the round whose record id is ``before``; and whether older ones are on record. A round
        retention removed (within ``REMOVED_CURSOR_S``) pages from where it was; None when ``before``
        is the id of no round of these tasks. Only the page's rows are read whole
        (a long-running task's whole history is 2 KB a round)."""
        order = (rounds.c.started_at, rounds.c.task_id, rounds.c.number, rounds.c.attempt, rounds.c.id)
        ids = select(rounds.c.id).where(rounds.c.task_id.in_(task_ids))
        with self.engine.connect() as conn:
            if before is not None:
                cursor = conn.execute(
                    select(*order).where(rounds.c.id == before, rounds.c.task_id.in_(task_ids))
                ).first()
                if cursor is None:  # a round retention removed since the page that named it
                    gone = removed_rounds.c
                    cursor = conn.execute(
                        select(gone.started_at, gone.task_id, gone.number, gone.attempt, gone.id).where(
                            gone.id == before, gone.task_id.in_(task_ids)
                        )
                    ).first()
                if cursor is None:
                    return None
                ids = ids.where(tuple_(*order) < tuple_(*cursor))
            more = False
            if last is not None:
                newest = ids.order_by(*(c.desc() for c in order))
                more = conn.execute(newest.offset(last).limit(1)).first() is not None
                ids = newest.limit(last)
            rows = conn.execute(select(rounds).where(rounds.c.id.in_(ids)).order_by(*order)).mappings().all()
        return [_round_record(r) for r in rows], more

    def prune_models(self, ended_before: float, *, dry_run: bool = False) -> Pruned:
        """Drop the models of committed rounds that ended before ``ended_before`` (unix seconds),
        but each task's latest committed one (the model the task goes on from, or its final one):
        their records stay, with no ``checkpoint_id``. Then drop every checkpoint created before
        then that nothing on record names any more (those models, and what devices were sent of
        them), and the plans and release reports stored before then that no task names (what a
        server killed during a deploy kept, before a deploy was stored in one transaction). Tasks'
        plans, initial checkpoints and the rounds' records (metrics and privacy figures) are
        kept. Only for a database no server runs on: a running server's current model is in its
        memory, and a server stores what devices are sent of it again when it starts. With
        ``dry_run``, what would be dropped, and nothing is."""
        kept = {r.id for t in self.tasks() if (r := self.last_committed_round(t.id)) is not None}
        with self.engine.connect() as conn, conn.begin() as transaction:
            old = select(rounds.c.id).where(rounds.c.checkpoint_id.is_not(None), rounds.c.ended_at < ended_before)
            dropped = [rid for rid in conn.execute(old).scalars() if rid not in kept]
            for start in range(0, len(dropped), 500):
                chunk = dropped[start : start + 500]
                conn.execute(update(rounds).where(rounds.c.id.in_(chunk)).values(checkpoint_id=None))
            named = (
                select(rounds.c.checkpoint_id.label("id"))
                .where(rounds.c.checkpoint_id.is_not(None))
                .union(select(tasks.c.initial_checkpoint_id), select(tasks.c.plan_id))
            )
            unnamed = (
                resources.c.kind == "checkpoint",
                resources.c.created_at < ended_before,
                resources.c.id.not_in(named),
            )
            found = conn.execute(
                select(func.count(), func.coalesce(func.sum(func.length(resources.c.data)), 0)).where(*unnamed)
            ).one()
            conn.execute(resources.delete().where(*unnamed))
            releases = self._drop_unnamed_releases(conn, ended_before)
            if dry_run:
                transaction.rollback()
        if not dry_run and self.engine.dialect.name == "sqlite":
            with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.exec_driver_sql("VACUUM")  # the file gives the space back
        return Pruned(len(dropped), int(found[0]) + releases[0], int(found[1]) + releases[1])

    def pruned_counts(self, task_id: int) -> tuple[int, int]:
        """How many of a task's round records retention removed, and how many of them had committed."""
        with self.engine.connect() as conn:
            row = conn.execute(
                select(pruned_rounds.c.rounds, pruned_rounds.c.committed).where(pruned_rounds.c.task_id == task_id)
            ).first()
        return (0, 0) if row is None else (int(row[0]), int(row[1]))

    def prune_rounds(
        self,
        *,
        keep_rounds: int | None,
        ended_before: float | None,
        limit: int,
        keep_ids: Iterable[int] = (),
        keep_resources: Iterable[str] = (),
        resources_before: float | None = None,
        private: Callable[[str, dict], bool] = lambda _status, _metrics: False,
        removed_at: float | None = None,
    ) -> PrunedRounds:
        """Remove at most ``limit`` round records, oldest first, in one transaction: of each task,
        those beyond its newest ``keep_rounds`` records (each attempt is one) or that ended before
        ``ended_before`` (unix seconds); either limit None keeps everything it would remove. Never
        removed: each task's last committed round (the model it goes on from) and its newest record
        (the attempt its next round follows), the records ``keep_ids`` names, and, of a task with
        differential privacy, every record ``private(status, metrics)`` says spent privacy (its
        ledger is read from them). Each task's count of removed records (and of removed commits) is
        kept in ``pruned_rounds``, and each removed record's place in the order of pages in
        ``removed_rounds`` (those removed ``REMOVED_CURSOR_S`` before ``removed_at``, unix seconds, now
        without it, go). Then the models of the removed records go too, those stored
        before ``resources_before`` that no round or task names any more and ``keep_resources``
        does not list (``drop_unnamed_checkpoints`` finds the others)."""
        if keep_rounds is None and ended_before is None:
            return PrunedRounds()
        newest = (rounds.c.number.desc(), rounds.c.attempt.desc(), rounds.c.id.desc())
        oldest = (rounds.c.number, rounds.c.attempt, rounds.c.id)
        kept_ids = set(keep_ids)
        chosen: list[tuple[int, int, bool]] = []  # task, record id, committed
        with self._write_transaction() as conn:
            for task_id, config in conn.execute(select(tasks.c.id, tasks.c.config).order_by(tasks.c.id)).all():
                if len(chosen) >= limit:
                    break
                of_task = rounds.c.task_id == task_id
                protected = set(kept_ids)
                for query in (
                    select(rounds.c.id).where(of_task).order_by(*newest).limit(1),
                    select(rounds.c.id).where(of_task, rounds.c.status == "committed").order_by(*newest).limit(1),
                ):
                    protected.update(conn.execute(query).scalars())
                beyond: list[ColumnElement[bool]] = []
                if keep_rounds is not None:
                    beyond.append(
                        rounds.c.id.in_(select(rounds.c.id).where(of_task).order_by(*newest).offset(keep_rounds))
                    )
                if ended_before is not None:
                    beyond.append(rounds.c.ended_at < ended_before)
                has_dp = json.loads(config).get("round", {}).get("dp") is not None
                columns = (rounds.c.id, rounds.c.status, rounds.c.metrics) if has_dp else (rounds.c.id, rounds.c.status)
                query = select(*columns).where(of_task, or_(*beyond), rounds.c.id.not_in(protected)).order_by(*oldest)
                if has_dp:  # a committed round spent privacy; an abandoned one may have
                    query = query.where(rounds.c.status != "committed")
                for row in conn.execute(query if has_dp else query.limit(limit - len(chosen))).all():
                    rid, status = row[0], row[1]
                    if has_dp and private(status, _load_metrics(row[2])):
                        continue
                    chosen.append((task_id, rid, status == "committed"))
                    if len(chosen) >= limit:
                        break
            if not chosen:
                return PrunedRounds()
            by_task: dict[int, list[tuple[int, bool]]] = {}
            for task_id, rid, committed in chosen:
                by_task.setdefault(task_id, []).append((rid, committed))
            ids = [rid for _, rid, _ in chosen]
            models = list(
                conn.execute(
                    select(rounds.c.checkpoint_id).where(rounds.c.id.in_(ids), rounds.c.checkpoint_id.is_not(None))
                ).scalars()
            )
            now = time.time() if removed_at is None else removed_at
            conn.execute(removed_rounds.delete().where(removed_rounds.c.removed_at < now - REMOVED_CURSOR_S))
            conn.execute(removed_rounds.delete().where(removed_rounds.c.id.in_(ids)))  # an id SQLite gave again
            place = (rounds.c.id, rounds.c.task_id, rounds.c.number, rounds.c.attempt, rounds.c.started_at)
            conn.execute(
                removed_rounds.insert().from_select(
                    ["id", "task_id", "number", "attempt", "started_at", "removed_at"],
                    select(*place, literal(now, Float)).where(rounds.c.id.in_(ids)),
                )
            )
            for task_id, removed in by_task.items():
                conn.execute(rounds.delete().where(rounds.c.id.in_([rid for rid, _ in removed])))
                count, commits = len(removed), sum(committed for _, committed in removed)
                if conn.execute(select(pruned_rounds.c.task_id).where(pruned_rounds.c.task_id == task_id)).first():
                    conn.execute(
                        update(pruned_rounds)
                        .where(pruned_rounds.c.task_id == task_id)
                        .values(rounds=pruned_rounds.c.rounds + count, committed=pruned_rounds.c.committed + commits)
                    )
                else:
                    conn.execute(pruned_rounds.insert().values(task_id=task_id, rounds=count, committed=commits))
            found = (0, 0)
            if resources_before is not None and models:
                found = self._drop_checkpoints(conn, resources_before, keep_resources, resources.c.id.in_(models))
        return PrunedRounds(len(chosen), sum(c for _, _, c in chosen), int(found[0]), int(found[1]))

    def drop_unnamed_checkpoints(self, resources_before: float, keep_resources: Iterable[str] = ()) -> tuple[int, int]:
        """Delete the checkpoints stored before ``resources_before`` that no round or task names
        and ``keep_resources`` does not list (what devices were sent of models no longer current,
        the models of records removed before), and the plans and release reports stored before then
        that no task names (``_drop_unnamed_releases``): how many, and their bytes."""
        with self._write_transaction() as conn:
            count, size = self._drop_checkpoints(conn, resources_before, keep_resources)
            releases = self._drop_unnamed_releases(conn, resources_before)
        return count + releases[0], size + releases[1]

    @staticmethod
    def _drop_unnamed_releases(conn: Connection, before: float) -> tuple[int, int]:
        """Delete, in ``conn``'s transaction, the resources of kind ``plan`` and ``release_report``
        stored before ``before`` that no task names (as its plan, or in its config's ``versions``
        and ``release.report_id``): what a server killed during a deploy kept, when a release's
        versioned plans and report were stored apart from its task. How many, and their bytes."""
        named: set[str] = set()
        for plan_id, config in conn.execute(select(tasks.c.plan_id, tasks.c.config)).all():
            loaded = json.loads(config)
            named.add(plan_id)
            named.update(loaded.get("versions", {}).values())
            if (report := loaded.get("release", {}).get("report_id")) is not None:
                named.add(report)
        unnamed = (resources.c.kind.in_(("plan", "release_report")), resources.c.created_at < before)
        orphans = [
            (rid, size)
            for rid, size in conn.execute(select(resources.c.id, func.length(resources.c.data)).where(*unnamed))
            if rid not in named
        ]
        for start in range(0, len(orphans), 500):
            conn.execute(resources.delete().where(resources.c.id.in_([rid for rid, _ in orphans[start : start + 500]])))
        return len(orphans), sum(int(size) for _, size in orphans)

    @staticmethod
    def _drop_checkpoints(
        conn: Connection, before: float, keep: Iterable[str], *among: ColumnElement[bool]
    ) -> tuple[int, int]:
        """``drop_unnamed_checkpoints`` in ``conn``'s transaction, of the checkpoints ``among`` says."""
        unnamed = and_(
            resources.c.kind == "checkpoint",
            resources.c.created_at < before,
            ~exists().where(rounds.c.checkpoint_id == resources.c.id),  # through rounds_by_checkpoint
            ~exists().where(or_(tasks.c.initial_checkpoint_id == resources.c.id, tasks.c.plan_id == resources.c.id)),
            resources.c.id.not_in(list(set(keep))),
            *among,
        )
        count, size = conn.execute(
            select(func.count(), func.coalesce(func.sum(func.length(resources.c.data)), 0)).where(unnamed)
        ).one()
        if count:
            conn.execute(resources.delete().where(unnamed))
        return int(count), int(size)

    def last_committed_round(self, task_id: int) -> RoundRecord | None:
        """The last committed round in the order ``rounds`` gives, read alone: the model an
        operator fetches must not read a long-running task's every record (2 KB each) to find it."""
        with self.engine.connect() as conn:
            row = (
                conn.execute(
                    select(rounds)
                    .where(rounds.c.task_id == task_id, rounds.c.status == "committed")
                    .order_by(rounds.c.number.desc(), rounds.c.attempt.desc(), rounds.c.id.desc())
                    .limit(1)
                )
                .mappings()
                .first()
            )
        return None if row is None else _round_record(row)
