"""Operational statistics: every phase of every session as an event in the app's SQLite
database (paper, section 3: "OpStats"), and session shapes from them (paper, Table 1).

The same database keeps the example resumption tokens of plans that resume reading (one per
population, task and collection), so that they survive an app restart with the rest of the
device's history."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from sqlalchemy import Column, Float, Integer, MetaData, String, Table, Text, delete, select
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine

from example_store.sqlite_engine import sqlite_engine

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


@dataclass(frozen=True)
class Event:
    kind: str
    at: float
    detail: dict = field(default_factory=dict)


def shape_of(events: list[Event]) -> str:
    return "".join(SHAPE_SYMBOLS[e.kind] for e in events)


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
    session_id: str
    population: str
    task: str | None
    started_at: float
    shape: str
    events: list[Event]


class OpStatsStore:
    """The event log in the app's database; a session's events are written in one transaction."""

    def __init__(self, database: str | os.PathLike) -> None:
        self.engine: Engine = sqlite_engine(database)
        _metadata.create_all(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def record_session(self, session_id: str, population: str, task: str | None, events: list[Event]) -> None:
        """Keep the session's events, replacing what was kept of it before (its events so far)."""
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
            with self.engine.begin() as conn:
                conn.execute(delete(events_table).where(events_table.c.session_id == session_id))
                conn.execute(events_table.insert(), rows)

    def sessions(self, population: str | None = None, since: float | None = None) -> list[SessionSummary]:
        query = select(events_table).order_by(events_table.c.id)
        if population is not None:
            query = query.where(events_table.c.population == population)
        if since is not None:
            query = query.where(events_table.c.at >= since)
        grouped: dict[str, list] = {}
        with self.engine.connect() as conn:
            for row in conn.execute(query).mappings():
                grouped.setdefault(row["session_id"], []).append(row)
        out = []
        for sid, rows in grouped.items():
            events = [Event(r["kind"], r["at"], json.loads(r["detail"])) for r in rows]
            out.append(
                SessionSummary(sid, rows[0]["population"], rows[0]["task"], events[0].at, shape_of(events), events)
            )
        return out

    def shape_counts(self, population: str | None = None, since: float | None = None) -> Counter[str]:
        return Counter(s.shape for s in self.sessions(population, since))

    def last_participation(self, population: str, task: str | None = None) -> SessionSummary | None:
        """The newest session that uploaded an accepted update (for eligibility policies), or
        whose upload started and nothing followed (the app was killed: the server may have it)."""
        done = [
            s for s in self.sessions(population) if s.shape.endswith(("^", "+")) and (task is None or s.task == task)
        ]
        return done[-1] if done else None

    # -- resumption tokens (device_runtime.reading.ResumptionTokenKeeper) -------------------------

    def resumption_token(self, population: str, task: str, collection_uri: str) -> str | None:
        """The token saved by the last completed session of this task and collection, if any."""
        t = resumption_table.c
        query = select(t.token).where(t.population == population, t.task == task, t.collection_uri == collection_uri)
        with self.engine.connect() as conn:
            return conn.execute(query).scalar()

    def save_resumption_token(
        self, population: str, task: str, collection_uri: str, token: str, at: float | None = None
    ) -> None:
        """Replace the saved token (one row per population, task and collection)."""
        at = time.time() if at is None else at
        stmt = sqlite_insert(resumption_table).values(
            population=population, task=task, collection_uri=collection_uri, token=token, saved_at=at
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=["population", "task", "collection_uri"], set_={"token": token, "saved_at": at}
        )
        with self.engine.begin() as conn:
            conn.execute(stmt)

    def forget_resumption_token(self, population: str, task: str, collection_uri: str) -> None:
        """Drop a saved token (the store refused it): the next session reads from the start."""
        t = resumption_table.c
        with self.engine.begin() as conn:
            conn.execute(
                delete(resumption_table).where(
                    t.population == population, t.task == task, t.collection_uri == collection_uri
                )
            )
