"""Operational statistics: every phase of every session as an event in the app's SQLite
database (paper, section 3: "OpStats"), and session shapes from them (paper, Table 1).

The same database keeps the example resumption tokens of plans that resume reading (one per
population, task and collection), so that they survive an app restart with the rest of the
device's history; a completed session's token is written in the transaction of its last events.

The log is bounded (``OpStatsStore(keep_s=..., keep_sessions=...)``): each session recorded drops
the sessions that ended more than ``keep_s`` (30 days) before it, and all but the newest
``keep_sessions`` (1,000), except the newest session of each population and task that took part
(what eligibility policies read, ``last_participation``), which is kept whatever its age. Without
a bound the log grew by every session for the life of the app, and a server that named a new task
or a long reason in every session grew it faster. The resumption tokens are bounded alike: each
one saved drops those saved more than ``keep_s`` before it and all but the newest ``keep_sessions``
(a task whose token is gone reads its collection from the start again)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import sqlite3
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import Column, Float, Integer, MetaData, String, Table, Text, delete, func, select
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from example_store.sqlite_engine import scrub_wal, sqlite_advice, sqlite_engine, sqlite_locked, write_locked

from .errors import RuntimeSdkError, check_count, check_number, check_path

logger = logging.getLogger(__name__)

#: Event symbols of the paper's Table 1 ('*' is an error, as in the paper's text).
SHAPE_SYMBOLS = {
    "checkin": "-",
    "plan_downloaded": "v",
    "training_started": "[",
    "training_completed": "]",
    "upload_started": "+",
    "upload_completed": "^",
    "upload_rejected": "#",
    "interrupted": "!",
    "error": "*",
}
SHAPE_ALPHABET = frozenset(SHAPE_SYMBOLS.values())
#: The last event of a session that took part (shape ending in '^' or '+', see ``last_participation``).
PARTICIPATED = ("upload_completed", "upload_started")
#: In the detail of the last event of a session whose report failed once an attempt of it may
#: have reached the server (its answer lost, then the server unreachable or the runtime closed:
#: shape ``-v[]+*`` or ``-v[]+!``): the server may hold its update, and the session takes part as
#: one killed during its upload does (``took_part``).
MAY_BE_HELD = "may_be_held"
#: The ``upload_started`` detail of a session of a plan that resumes reading: [collection URI,
#: token] where its reading stopped (see ``OpStatsStore.resumption_token``).
READ_TO = "read_to"
#: How long the log keeps a session (from its last event), and how many sessions at most.
KEEP_S = 30 * 86_400.0
KEEP_SESSIONS = 1_000

_metadata = MetaData()
events_table = Table(
    "fl_opstats_events",
    _metadata,
    Column("id", Integer, primary_key=True),
    Column("session_id", String(64), nullable=False, index=True),
    Column("population", String(128), nullable=False),
    Column("task", String(128)),
    Column("kind", String(32), nullable=False),
    Column("at", Float, nullable=False, index=True),
    Column("detail", Text, nullable=False),
)
# Where the last completed session of a resuming plan stopped reading (see device_runtime.reading).
resumption_table = Table(
    "fl_resumption_tokens",
    _metadata,
    Column("population", String(128), primary_key=True),
    Column("task", String(128), primary_key=True),
    Column("collection_uri", String(1024), primary_key=True),
    Column("token", Text, nullable=False),
    Column("saved_at", Float, nullable=False),
)


class AppDatabaseError(RuntimeSdkError):
    """The app's database (opstats, scheduled jobs) cannot be opened or written: not an SQLite
    file, damaged, its folder missing, locked past the wait, the disk full, or closed. The message
    names the file and what to do. ``retryable`` only where another process held it locked past
    the wait."""


@contextmanager
def app_database_errors(path: str | os.PathLike, action: str) -> Iterator[None]:
    """SQLite's and SQLAlchemy's errors while ``action`` on the app's database ``path`` as an
    ``AppDatabaseError`` that says what happened and what to do."""
    try:
        yield
    except (SQLAlchemyError, sqlite3.Error) as exc:
        failed = AppDatabaseError(f"could not {action} in the app's database {os.fspath(path)}: {sqlite_advice(exc)}")
        failed.retryable = sqlite_locked(exc)
        raise failed from exc


@dataclass(frozen=True)
class Event:
    """One phase of a session as opstats records it: ``kind`` (a key of ``SHAPE_SYMBOLS``:
    ``checkin``, ``plan_downloaded``, ...), when (``at``, on the runtime's clock) and what it
    measured (``detail``: example counts, bytes, the server's codes)."""

    kind: str
    at: float
    detail: dict = field(default_factory=dict)


def shape_of(events: list[Event]) -> str:
    """The events' symbols in order (``SHAPE_SYMBOLS``): ``-v[]+^`` is a session that checked in,
    downloaded its plan, trained, uploaded and had its update accepted."""
    return "".join(SHAPE_SYMBOLS[e.kind] for e in events)


def took_part(last: Event) -> bool:
    """Whether a session whose last event is ``last`` took part: its update was taken ('^'), its
    upload started and nothing followed ('+': the app was killed), or its report failed once it may
    have reached the server (``MAY_BE_HELD``)."""
    return last.kind in PARTICIPATED or last.detail.get(MAY_BE_HELD) is True


def rss_mb() -> float:
    """Resident memory now (Linux), else the process's peak; measured, never estimated."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024


@dataclass(frozen=True)
class SessionSummary:
    """One session as the opstats log keeps it (``OpStatsStore.sessions``): its id, population,
    task, when it started and its ``shape``, with every event (whose repr leaves them out)."""

    session_id: str
    population: str
    task: str | None
    started_at: float
    shape: str
    events: list[Event] = field(repr=False)


class OpStatsStore:
    """The event log in the app's database; a session's events are written in one transaction."""

    def __init__(
        self, database: str | os.PathLike, *, keep_s: float = KEEP_S, keep_sessions: int = KEEP_SESSIONS
    ) -> None:
        """``keep_s`` and ``keep_sessions`` bound the log (see the module's doc); the newest
        participation of each population and task is kept beyond them."""
        check_path("OpStatsStore's database", database)  # InvalidSetting, a ValueError as it was
        self.keep_s = check_number("keep_s", keep_s, positive=True)
        self.keep_sessions = check_count("keep_sessions", keep_sessions, least=1)
        self.path = database
        self._closed = False
        self._unreadable_said = False  # events another version wrote: said once in the log
        # durable: the session kept before its update leaves is what tells the app, after a power
        # cut as after a kill, that the update may be the server's (not to train and report it
        # again); at synchronous=NORMAL a power cut could roll that commit back after the upload
        self.engine: Engine = sqlite_engine(database, durable=True, private=True)
        try:
            with self._db("open the opstats log"), write_locked(self.engine) as conn:
                _metadata.create_all(conn)
        except BaseException:
            self.engine.dispose()
            raise

    def __repr__(self) -> str:
        return f"OpStatsStore({os.fspath(self.path)!r}{', closed' if self._closed else ''})"

    def close(self) -> None:
        """Closes the database's connections; the store cannot be used after (idempotent)."""
        self._closed = True
        self.engine.dispose()

    def __enter__(self) -> OpStatsStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _db(self, action: str) -> Iterator[None]:
        if self._closed:
            raise AppDatabaseError(f"the opstats store of {os.fspath(self.path)} is closed; open a new OpStatsStore")
        with app_database_errors(self.path, action):
            yield

    def record_session(
        self,
        session_id: str,
        population: str,
        task: str | None,
        events: list[Event],
        *,
        resumption: tuple[str, str, str, str] | None = None,
    ) -> None:
        """Keep the session's events, replacing what was kept of it before (its events so far).
        ``resumption``: (population, task, collection URI, token) where the completed session
        stopped reading, saved in the same transaction as its events (as of its last event): an
        app killed while they are written has both or neither, never a token moved past examples
        whose session its log does not show completed."""
        rows = [
            {
                "session_id": session_id,
                "population": population,
                "task": task,
                "kind": e.kind,
                "at": e.at,
                "detail": json.dumps(e.detail),
            }
            for e in events
        ]
        if rows:
            with self._db("record a session"), self.engine.begin() as conn:
                conn.execute(delete(events_table).where(events_table.c.session_id == session_id))
                conn.execute(events_table.insert(), rows)
                if resumption is not None:
                    self._save_token(conn, *resumption, at=events[-1].at)
                self._prune(conn, now=max(e.at for e in events))

    def _prune(self, conn: Any, *, now: float) -> None:
        """Drop the sessions past ``keep_s`` before ``now`` (the time of the session just recorded:
        the store reads no clock of its own) or past the newest ``keep_sessions``, but the newest
        participation of each population and task. Decided and done in one statement inside SQLite
        (``_PRUNE``): reading every kept session into Python to pick the one to drop made recording a
        session cost 5 ms with 10 sessions on record and 40 ms with 1,000 (the bound every app's log
        reaches), twice per session."""
        raw = conn.connection.dbapi_connection
        raw.create_function("fl_opstats_held", 1, _held, deterministic=True)
        conn.exec_driver_sql(_PRUNE, (now - self.keep_s, self.keep_sessions))

    def sessions(self, population: str | None = None, since: float | None = None) -> list[SessionSummary]:
        query = select(events_table).order_by(events_table.c.id)
        if population is not None:
            query = query.where(events_table.c.population == population)
        if since is not None:
            query = query.where(events_table.c.at >= since)
        grouped: dict[str, list] = {}
        with self._db("read the sessions"), self.engine.connect() as conn:
            for row in conn.execute(query).mappings():
                grouped.setdefault(row["session_id"], []).append(row)
        out = []
        for sid, rows in grouped.items():
            events = [e for e in (self._event(sid, r) for r in rows) if e is not None]
            if not events:
                continue
            out.append(
                SessionSummary(sid, rows[0]["population"], rows[0]["task"], events[0].at, shape_of(events), events)
            )
        return out

    def _event(self, session_id: str, row: Any) -> Event | None:
        """A stored event, or None for one this version cannot read (a kind or detail another
        version wrote, then this one run over its database), said once a store in the log and left
        as it is: the session is read from its other events. Refused, it stopped every session of
        the population (their check of the app's last participation) until the log's pruning
        dropped it, up to 30 days later."""
        kind, detail = row["kind"], None
        with contextlib.suppress(ValueError, TypeError):
            detail = json.loads(row["detail"])
        if kind in SHAPE_SYMBOLS and isinstance(detail, dict):
            return Event(kind, row["at"], detail)
        if not self._unreadable_said:
            self._unreadable_said = True
            what = (
                f"an event of kind {kind!r}"
                if kind not in SHAPE_SYMBOLS
                else f"an event {kind!r} of detail {row['detail']!r:.60}"
            )
            logger.warning(
                "the app's database %s holds events another fedfleet version wrote, which this one passes over "
                "(session %r has %s); the sessions are read from their other events and the log is left as it is",
                os.fspath(self.path),
                session_id,
                what,
            )
        return None

    def shape_counts(self, population: str | None = None, since: float | None = None) -> Counter[str]:
        return Counter(s.shape for s in self.sessions(population, since))

    def last_participation(self, population: str, task: str | None = None) -> SessionSummary | None:
        """The newest session that uploaded an accepted update (for eligibility policies), or
        whose upload started and nothing followed (the app was killed: the server may have it), or
        whose report failed once it may have reached the server (``took_part``)."""
        done = [s for s in self.sessions(population) if took_part(s.events[-1]) and (task is None or s.task == task)]
        return done[-1] if done else None

    # -- resumption tokens (device_runtime.reading.ResumptionTokenKeeper) -------------------------

    def resumption_token(self, population: str, task: str, collection_uri: str) -> str | None:
        """The token saved by the last completed session of this task and collection, or, when a
        later session of theirs was killed once its update had started to leave (its last event
        ``upload_started``, shape ``-v[]+``), or its report failed once it may have reached the
        server (``MAY_BE_HELD``), where that session stopped reading (``READ_TO``): the server may
        hold its update, and the session counts as taking part, so its examples count as read.
        Read from the saved token alone, the next session trained and sent that slice again."""
        t, e = resumption_table.c, events_table.c
        query = select(t.token, t.saved_at).where(
            t.population == population, t.task == task, t.collection_uri == collection_uri
        )
        ends = (
            select(func.max(e.id).label("last_id"))
            .where(e.population == population, e.task == task)
            .group_by(e.session_id)
            .subquery()
        )
        killed = (
            select(e.at, e.kind, e.detail)
            .join(ends, e.id == ends.c.last_id)
            .where(e.kind.in_(("upload_started", "error", "interrupted")))
            .order_by(e.id.desc())
        )
        with self._db("read a resumption token"), self.engine.connect() as conn:
            saved = conn.execute(query).first()
            for at, kind, detail in conn.execute(killed):
                if saved is not None and at <= saved.saved_at:
                    break
                if kind != "upload_started" and not _held(detail):
                    continue
                read_to = json.loads(detail).get(READ_TO)
                if isinstance(read_to, list) and len(read_to) == 2 and read_to[0] == collection_uri:
                    return str(read_to[1])
        return saved.token if saved is not None else None

    def save_resumption_token(
        self, population: str, task: str, collection_uri: str, token: str, at: float | None = None
    ) -> None:
        """Replace the saved token (one row per population, task and collection)."""
        with self._db("save a resumption token"), self.engine.begin() as conn:
            self._save_token(conn, population, task, collection_uri, token, at=time.time() if at is None else at)

    def _save_token(self, conn: Any, population: str, task: str, collection_uri: str, token: str, *, at: float) -> None:
        stmt = sqlite_insert(resumption_table).values(
            population=population, task=task, collection_uri=collection_uri, token=token, saved_at=at
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=["population", "task", "collection_uri"], set_={"token": token, "saved_at": at}
        )
        t = resumption_table.c
        conn.execute(stmt)
        # bounded as the log is: a server that named a new task in every session added a row each time
        conn.execute(delete(resumption_table).where(t.saved_at < at - self.keep_s))
        beyond = conn.execute(
            select(t.population, t.task, t.collection_uri)
            .order_by(t.saved_at.desc(), t.population.desc(), t.task.desc(), t.collection_uri.desc())
            .offset(self.keep_sessions)
        ).all()
        for population_, task_, uri in beyond:
            conn.execute(
                delete(resumption_table).where(t.population == population_, t.task == task_, t.collection_uri == uri)
            )

    def delete_all(self) -> int:
        """Deletes every session's events and every resumption token (an app's "delete my data"):
        the device's eligibility policies then see no earlier participation, and plans that resume
        reading start from the beginning. Returns how many events were deleted. As the example
        store's ``delete_all``, the rows are overwritten on disk and the write-ahead log is cut to
        0 bytes when no read of another connection holds it."""
        with self._db("delete the opstats log"), self.engine.begin() as conn:
            deleted = conn.execute(delete(events_table)).rowcount
            conn.execute(delete(resumption_table))
        with self._db("delete the opstats log"):
            raw = self.engine.raw_connection()
            try:
                scrub_wal(cast(sqlite3.Connection, raw.driver_connection))
            finally:
                raw.close()
        return int(deleted)

    def forget_resumption_token(self, population: str, task: str, collection_uri: str) -> None:
        """Drop a saved token (the store refused it): the next session reads from the start."""
        t = resumption_table.c
        with self._db("forget a resumption token"), self.engine.begin() as conn:
            conn.execute(
                delete(resumption_table).where(
                    t.population == population, t.task == task, t.collection_uri == collection_uri
                )
            )


# Which sessions ``_prune`` drops, newest first by their last event: a session that took part
# (``took_part`` of its last event) is its population and task's newest participation when no newer
# one of theirs took part, and is kept; any other session is kept while it ended within ``keep_s``
# (the first parameter: the earliest end kept) and fewer than ``keep_sessions`` (the second) newer
# sessions are kept. The kept other sessions are thus the first of them that ended in time, as many
# as the newest participations before each leave room for: the j-th with n newest participations
# before it is kept when n + j - 1 < keep_sessions.
_PRUNE = f"""
WITH ends AS (
    SELECT session_id, MAX(id) AS last_id, MAX(at) AS ended FROM {events_table.name} GROUP BY session_id
), sessions AS (
    SELECT ends.session_id, ends.last_id, ends.ended >= ?1 AS recent, e.population, e.task,
        CASE WHEN e.kind IN ({", ".join(f"'{k}'" for k in PARTICIPATED)}) THEN 1
             WHEN instr(e.detail, '{MAY_BE_HELD}') > 0 THEN fl_opstats_held(e.detail) ELSE 0 END AS took_part
    FROM ends JOIN {events_table.name} AS e ON e.id = ends.last_id
), newest AS (
    SELECT session_id, last_id, recent,
        took_part AND ROW_NUMBER() OVER (PARTITION BY population, task, took_part ORDER BY last_id DESC) = 1
            AS participation
    FROM sessions
), counted AS (
    SELECT session_id, recent, participation,
        COALESCE(SUM(participation) OVER (ORDER BY last_id DESC ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)
            AS participations_before,
        SUM(NOT participation AND recent) OVER (ORDER BY last_id DESC ROWS UNBOUNDED PRECEDING) AS others_so_far
    FROM newest
)
DELETE FROM {events_table.name} WHERE session_id IN (
    SELECT session_id FROM counted
    WHERE NOT participation AND NOT (recent AND participations_before + others_so_far - 1 < ?2)
)
"""


def _held(detail: str) -> bool:
    """Whether an event's stored detail (JSON) says the server may hold the session's update."""
    try:
        return json.loads(detail).get(MAY_BE_HELD) is True
    except (ValueError, AttributeError):
        return False
