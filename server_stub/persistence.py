"""SQLite persistence through SQLAlchemy: populations, tasks, content-addressed resources (plans
and checkpoints) and rounds. Individual device updates are never stored here."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Column,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    select,
    update,
)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from example_store import sqlite_engine

metadata = MetaData()

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
)


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




class ServerStore:
    """The server's database. One instance per server process."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.engine: Engine = sqlite_engine(self.path, foreign_keys=True)
        metadata.create_all(self.engine)

    def close(self) -> None:
        self.engine.dispose()

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
        rid = resource_id(data)
        with self.engine.begin() as conn:
            exists = conn.execute(select(resources.c.id).where(resources.c.id == rid)).scalar()
            if exists is None:
                conn.execute(resources.insert().values(id=rid, kind=kind, data=data, created_at=time.time()))
        return rid

    def get_resource(self, rid: str) -> bytes | None:
        with self.engine.connect() as conn:
            return conn.execute(select(resources.c.data).where(resources.c.id == rid)).scalar()

    # tasks
    def add_task(self, population: str, name: str, plan_id: str, checkpoint_id: str, config: dict) -> TaskRecord:
        pid = self.population_id(population)
        if pid is None:
            raise KeyError(population)
        with self.engine.begin() as conn:
            tid = conn.execute(
                tasks.insert().values(
                    population_id=pid,
                    name=name,
                    plan_id=plan_id,
                    initial_checkpoint_id=checkpoint_id,
                    config=json.dumps(config),
                    status="active",
                    created_at=time.time(),
                )
            ).inserted_primary_key[0]
        return TaskRecord(tid, population, name, plan_id, checkpoint_id, config, "active")

    def tasks(self, population: str | None = None) -> list[TaskRecord]:
        query = select(tasks, populations.c.name.label("population")).join(populations).order_by(tasks.c.id)
        if population is not None:
            query = query.where(populations.c.name == population)
        with self.engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        return [
            TaskRecord(r["id"], r["population"], r["name"], r["plan_id"], r["initial_checkpoint_id"], json.loads(r["config"]), r["status"])
            for r in rows
        ]

    def set_task_status(self, task_id: int, status: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(tasks).where(tasks.c.id == task_id).values(status=status))

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
    ) -> RoundRecord:
        """Store a finished round, with its new model for a committed one, in one transaction."""
        with self.engine.begin() as conn:
            checkpoint_id = None
            if checkpoint is not None:
                checkpoint_id = resource_id(checkpoint)
                if conn.execute(select(resources.c.id).where(resources.c.id == checkpoint_id)).scalar() is None:
                    conn.execute(
                        resources.insert().values(id=checkpoint_id, kind="checkpoint", data=checkpoint, created_at=time.time())
                    )
            rid = conn.execute(
                rounds.insert().values(
                    task_id=task_id,
                    number=number,
                    attempt=attempt,
                    status=status,
                    checkpoint_id=checkpoint_id,
                    metrics=json.dumps(metrics),
                    started_at=started_at,
                    ended_at=ended_at,
                )
            ).inserted_primary_key[0]
        return RoundRecord(rid, task_id, number, attempt, status, checkpoint_id, metrics, started_at, ended_at)

    def update_round_metrics(self, round_id: int, metrics: dict) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(rounds).where(rounds.c.id == round_id).values(metrics=json.dumps(metrics)))

    def rounds(self, task_id: int) -> list[RoundRecord]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(rounds).where(rounds.c.task_id == task_id).order_by(rounds.c.id)).mappings().all()
        return [
            RoundRecord(r["id"], r["task_id"], r["number"], r["attempt"], r["status"], r["checkpoint_id"], json.loads(r["metrics"]), r["started_at"], r["ended_at"])
            for r in rows
        ]

    def last_committed_round(self, task_id: int) -> RoundRecord | None:
        committed = [r for r in self.rounds(task_id) if r.status == "committed"]
        return committed[-1] if committed else None
