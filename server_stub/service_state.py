"""What ``FLService`` holds in memory: its populations and their active tasks, the device sessions,
the rounds closed but not yet on record. Plain data guarded by the service's lock; the modules
that act on it (``admission``, ``reports``, ``secure_driver``, ``commit``) take it as arguments."""

from __future__ import annotations

import base64
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from device_runtime.eligibility import EligibilityPolicies
from device_runtime.executor import PlanExecutor
from device_runtime.plan import Plan
from device_runtime.secure_sum import SecureSumCodec

from . import ddp_rounds
from .dp_rounds import CentralRound, TaskDP
from .metrics import RoundMetrics
from .pace import CheckinPace, Rendezvous, RoundPace
from .persistence import RoundRecord, TaskRecord
from .rounds import Phase, RoundConfig, RoundCore
from .secure_rounds import SecureRound
from .task_choice import Strategy


def hash_token(token: str) -> bytes:
    """Only a token's hash is kept: a leak of the server's memory opens no session."""
    return hashlib.sha256(token.encode()).digest()


#: What a token is compared with when no session has the id it came with (so that the refusal
#: takes the time a wrong token for a real session takes).
NO_SESSION = hash_token("")


def urlsafe(raw: bytes) -> str:
    """``raw`` as ``secrets.token_urlsafe`` writes its bytes: URL-safe base64, unpadded."""
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


@dataclass
class Session:
    session_id: str
    token_hash: bytes
    run: TaskRun
    core: RoundCore
    resources: tuple[str, str]  # the plan and checkpoint this session may download
    revoked: bool = False  # its device aborted it: its token opens nothing more


@dataclass
class SessionTable:
    """The sessions by id and by their token's hash (a resource download names only its token)."""

    by_id: dict[str, Session] = field(default_factory=dict)
    by_token: dict[bytes, Session] = field(default_factory=dict)

    def add(self, session: Session) -> None:
        self.by_id[session.session_id] = session
        self.by_token[session.token_hash] = session

    def forget_token(self, session_id: str) -> None:
        """The session's current token stops working (its device checked in again for its seat)."""
        self.by_token.pop(self.by_id[session_id].token_hash, None)

    def forget_closed(self, run: TaskRun) -> None:
        """Drop the sessions of ``run``'s rounds that are no longer kept in ``run.closed``."""
        live = {id(c.core) for c in run.closed}  # ids of live objects: no two are alike
        for sid, session in list(self.by_id.items()):
            if session.run is run and id(session.core) not in live:
                del self.by_id[sid]
                self.by_token.pop(session.token_hash, None)


@dataclass
class ClosedRound:
    core: RoundCore
    record_id: int | None
    metrics: dict
    secure: SecureRound | None = None
    #: the record's task, number and attempt: late metrics are written to it, never to a record
    #: that took its id after retention removed it (SQLite gives a removed newest id again)
    record_key: tuple[int, int, int] | None = None


@dataclass
class TaskRun:
    """What the server holds in memory for one active task."""

    record: TaskRecord
    plan: Plan
    executor: PlanExecutor
    config: RoundConfig
    eligibility: EligibilityPolicies
    state: dict[str, np.ndarray]
    broadcast_id: str
    round_number: int
    attempt: int
    committed_rounds: int
    report_limit: int
    weight: float = 1.0
    evaluates: TaskRun | None = None
    versions: dict[str, str] = field(default_factory=dict)  # minor release ('1.17') -> its plan's id
    codec: SecureSumCodec | None = None
    ddp: ddp_rounds.DistributedDP | None = None  # the devices add the noise (distributed DP)
    secure: SecureRound | None = None
    core: RoundCore | None = None
    pace: RoundPace = field(default_factory=RoundPace)
    started_wall: float = 0.0
    accumulator: dict[str, np.ndarray] | None = None
    device_metrics: RoundMetrics = field(default_factory=RoundMetrics)
    bounded: dict[str, int] = field(default_factory=lambda: {"capped": 0, "clipped": 0})
    closed: list[ClosedRound] = field(default_factory=list)
    seats: dict[tuple[int, int, int], dict[bytes, str]] = field(
        default_factory=dict
    )  # open round: attested device -> session
    idle_record: RoundRecord | None = None  # the task's last record, while it is a selection nobody came to
    dp: TaskDP | None = None  # differential privacy: the task's ledger and next clip (``dp_rounds``)
    dp_round: CentralRound | None = None  # the open round's central DP sum (clip, counts)

    @property
    def seat_key(self) -> tuple[int, int, int]:
        """The open round's identity (task, round, attempt), under which its seats are held. Not
        ``id()`` of the round's object: a later round's object can take a freed one's address."""
        return (self.record.id, self.round_number, self.attempt)

    @property
    def label(self) -> str:
        """The task as the log names it: ``population/task`` (task names are a population's own)."""
        return f"{self.record.population}/{self.record.name}"

    @property
    def is_training(self) -> bool:
        return self.plan.kind == "train"


@dataclass
class Population:
    """The active tasks of a population (those deployed together) and whose round is open."""

    name: str
    runs: list[TaskRun] = field(default_factory=list)
    strategy: Strategy = Strategy.ALTERNATE
    current: TaskRun | None = None
    turn: int = 0
    committing: bool = False
    checkins: CheckinPace = field(default_factory=CheckinPace)  # pace steering across its tasks
    rendezvous: Rendezvous = field(default_factory=Rendezvous)  # ... and for a small population
    opens_at: float | None = None  # the next selection, deferred until its devices gather
    deferrals: int = 0  # how many times in a row that selection was put off
    #: when its last task ended (its devices are asked back the less often the longer it is
    #: idle, ``admission.idle_window``); None while it runs a task or never had one since the
    #: server started (idle since the server's start, as a population that does not exist is)
    idle_since: float | None = None
    #: its active tasks whose stored config or plan this server refuses, each with the reason (``task_runs.refusals``)
    refused: dict[str, str] = field(default_factory=dict)
    #: the task whose round opens next once the record of its last round is on record: the database
    #: refused it (a full disk, a lock held past the busy timeout), and a round opened meanwhile would
    #: have its devices train for a commit the database refuses too (``commit``)
    held: TaskRun | None = None

    def find(self, task: str) -> TaskRun | None:
        return next((r for r in self.runs if r.record.name == task), None)


@dataclass
class PendingCommit:
    """A closed round waiting to be written, with what is needed to write it outside the lock."""

    population: Population
    run: TaskRun
    core: RoundCore
    phase: Phase
    metrics: dict
    accumulator: dict[str, np.ndarray] | None
    secure: SecureRound | None
    started_wall: float
    ended_wall: float
    dp_round: CentralRound | None = None
    written: threading.Event = field(default_factory=threading.Event)
    outcome: Phase | None = None  # what the round became once its commit was tried


@dataclass
class UnwrittenRound:
    """A closed round whose record could not be written (the database locked or full): its
    outcome is already applied in memory, and the ticker writes the record again until it is on
    record. Writes are idempotent (``ServerStore.record_round``), so a retry never adds a second."""

    run: TaskRun
    core: RoundCore
    attempt: int
    status: str
    metrics: dict
    started_wall: float
    ended_wall: float
    tries: int = 1
    next_try_at: float = 0.0
    population: Population | None = None  # held until this record is on record (``Population.held``)


def task_states(pop: Population, tasks: list[TaskRecord]) -> dict[str, dict]:
    """Each task's state as an operator sees it (see ``FLService.task_states``)."""
    running = [r.record.name for r in pop.runs]
    states: dict[str, dict] = {}
    for t in tasks:
        if t.status == "active" and t.name in pop.refused:
            states[t.name] = {"status": "refused", "reason": pop.refused[t.name]}
        elif t.status != "active" or t.name in running or not running:
            states[t.name] = {"status": t.status}
        else:
            states[t.name] = {"status": "queued", "queued_behind": running}
    return states


def _last_strategy(tasks: list[TaskRecord]) -> str | None:
    """The strategy of the newest deploy on record (None before the first): an idle population's
    status named none, as if its tasks had never shared rounds, where a running one named it."""
    if not tasks:
        return None
    return str(tasks[-1].config.get("group", {}).get("strategy", Strategy.ALTERNATE.value))


def population_status(pop: Population, tasks: list[TaskRecord], now: float) -> dict:
    """The population as an operator sees it (``FLService.population_status``): its tasks' states,
    the active tasks, and the open round's counts so far."""
    active = [
        {
            "name": run.record.name,
            "kind": run.plan.kind,
            "round": run.round_number,
            "committed_rounds": run.committed_rounds,
            "checkpoint_id": run.broadcast_id,
            **({"runtimes": run.record.config["release"]["claimed"]} if run.versions else {}),
        }
        for run in pop.runs
    ]
    run = pop.current
    states = task_states(pop, tasks)
    status: dict[str, Any] = {
        "population": pop.name,
        "strategy": pop.strategy.value if pop.runs else _last_strategy(tasks),
        "active_task": run.record.name if run is not None else None,
        "active_tasks": active,
        "tasks": [{"name": t.name, **states[t.name]} for t in tasks],
    }
    if pop.held is not None:
        status["waiting"] = (
            "the database refused the record of its last round: its next round opens once it is on record"
        )
    if run is not None:
        assert run.core is not None
        status.update(
            round=run.round_number,
            committed_rounds=run.committed_rounds,
            phase=run.core.phase.value,
            current_round=run.core.stats(now),
            checkpoint_id=run.broadcast_id,
        )
    return status
