"""The FL server's logic between the HTTP shell and the pure round core: populations, tasks,
sessions, aggregation of reports as they arrive, and committing rounds to the database.

Concurrency rules, each from a failure seen under load:
- the service lock guards memory only; no database write happens while it is held, so a slow or
  locked database never freezes check-ins and reports;
- a finished round becomes a pending commit: the server part of the plan runs and the round is
  written outside the lock, and only once the write succeeded does the new model replace the old
  one in memory. A failed write abandons the round: nothing is ever applied twice. Should the
  abandoned round's record fail to be written too (the database locked past its busy timeout),
  it is kept in memory and written again, with backoff, until it is on record: a round is never
  lost while the server runs, and the device whose report closed it is told what became of it;
- one population runs one round at a time; with several tasks, a strategy picks the next one."""

from __future__ import annotations

import base64
import functools
import hashlib
import heapq
import hmac
import json
import logging
import math
import random
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from device_runtime.attestation import AttestationError, RateLimited
from device_runtime.checkpoint import CheckpointError, decode_checkpoint, encode_checkpoint
from device_runtime.eligibility import EligibilityPolicies
from device_runtime.executor import PlanExecutor
from device_runtime.plan import Plan, PlanError, load_plan
from device_runtime.secure_sum import SecureSumCodec
from device_runtime.versions import version_tuple
from secagg import OutOfOrder, Round, SecAggError, UnexpectedClient

from . import ddp_rounds, dp_rounds
from .attestation import AttestationVerifier
from .dp_rounds import CentralRound, TaskDP
from .errors import (
    ApiError,
    BadRequest,
    Conflict,
    DuplicateReport,
    InvalidCheckpoint,
    InvalidPlan,
    InvalidUpdate,
    NotFound,
    ReportLate,
    SessionClosed,
    TooManyRequests,
    Unauthorized,
)
from .influence import bound_update, check_group_sum
from .metrics import MetricsOutOfRange, RoundMetrics, cap_metric_weight, check_metric_sums, device_metrics
from .pace import MAX_DEFERRALS, CheckinPace, Rendezvous, RoundPace
from .persistence import NewTask, RoundRecord, ServerStore, TaskRecord
from .release_gate import ReleaseGateError, check_release_report, minor_key
from .rounds import Phase, ReportVerdict, RoundConfig, RoundCore, SessionState
from .schemas import NAME_RULE
from .secagg_limits import SECAGG_SLACK_BYTES, secagg_upload_limit
from .secure_rounds import SecureRound, SecureSettings
from .task_choice import Strategy, choose_task

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: How many closed rounds per task keep their session table, so a late report is told it was late.
CLOSED_ROUNDS_KEPT = 4
#: Header and framing allowance on top of the tensors a report must carry.
REPORT_SLACK_BYTES = 64 * 1024
#: Retry window for devices of a population that has nothing to train.
IDLE_RETRY_WINDOW_S = (60.0, 180.0)
#: Retry window for a device whose onnxruntime release the task's plan does not serve: nothing
#: changes for it until another task is deployed, so it comes back in half an hour to an hour
#: (pace steering: as often as it may be needed, no more). A fleet in which a third of the
#: devices run older releases otherwise sends most of its check-ins from them.
VERSION_RETRY_WINDOW_S = (1800.0, 3600.0)
#: Resources kept in memory after they were read (the active tasks' plans and checkpoints).
RECENT_RESOURCES = 8
#: Tasks one deploy may bring together.
MAX_TASKS_PER_GROUP = 16
#: Seconds between writes of the metrics late reports change: stragglers trickle in for minutes
#: after their round closed, and each write serializes the round's whole metrics. A crash loses
#: at most this long of late-report counts; the round itself is on record already.
LATE_METRICS_EVERY_S = 30.0
#: Backoff, on the service's clock, between the writes of a round's record that failed: the
#: ticker tries again after this long, then after twice the last wait, up to WRITE_RETRY_MAX_S.
WRITE_RETRY_FIRST_S = 0.5
WRITE_RETRY_MAX_S = 60.0
#: What a name may be made of: it travels in URLs, headers and logs (and is not only dots:
#: ``NAME_RULE``).
NAME_ALPHABET = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def _hash_token(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


#: What a token is compared with when no session has the id it came with (so that the refusal
#: takes the time a wrong token for a real session takes).
_NO_SESSION = _hash_token("")


def _urlsafe(raw: bytes) -> str:
    """``raw`` as ``secrets.token_urlsafe`` writes its bytes: URL-safe base64, unpadded."""
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


@dataclass(frozen=True)
class TaskSpec:
    """One task of a deploy. ``evaluates`` names a training task of the same deploy whose
    current model an evaluation task measures (it then needs no checkpoint of its own).
    ``versioned_plans`` (onnxruntime release -> plan bytes) and ``release_report`` (the JSON
    ``fedfleet plan test`` wrote) come together: devices are then served the plan of their release."""

    name: str
    plan: bytes
    checkpoint: bytes | None
    config: RoundConfig = RoundConfig()
    eligibility: EligibilityPolicies = EligibilityPolicies()
    weight: float = 1.0
    evaluates: str | None = None
    versioned_plans: dict[str, bytes] = field(default_factory=dict)
    release_report: dict | None = None


@dataclass
class _Session:
    session_id: str
    token_hash: bytes
    run: _TaskRun
    core: RoundCore
    resources: tuple[str, str]  # the plan and checkpoint this session may download
    revoked: bool = False  # its device aborted it: its token opens nothing more


@dataclass
class _ClosedRound:
    core: RoundCore
    record_id: int | None
    metrics: dict
    secure: SecureRound | None = None


@dataclass
class _TaskRun:
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
    evaluates: _TaskRun | None = None
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
    closed: list[_ClosedRound] = field(default_factory=list)
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
    def is_training(self) -> bool:
        return self.plan.kind == "train"


@dataclass
class _Population:
    """The active tasks of a population (those deployed together) and whose round is open."""

    name: str
    runs: list[_TaskRun] = field(default_factory=list)
    strategy: Strategy = Strategy.ALTERNATE
    current: _TaskRun | None = None
    turn: int = 0
    committing: bool = False
    checkins: CheckinPace = field(default_factory=CheckinPace)  # pace steering across its tasks
    rendezvous: Rendezvous = field(default_factory=Rendezvous)  # ... and for a small population
    opens_at: float | None = None  # the next selection, deferred until its devices gather
    deferrals: int = 0  # how many times in a row that selection was put off

    def find(self, task: str) -> _TaskRun | None:
        return next((r for r in self.runs if r.record.name == task), None)


@dataclass
class _PendingCommit:
    """A closed round waiting to be written, with what is needed to write it outside the lock."""

    population: _Population
    run: _TaskRun
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
class _UnwrittenRound:
    """A closed round whose record could not be written (the database locked or full): its
    outcome is already applied in memory, and the ticker writes the record again until it is on
    record. Writes are idempotent (``ServerStore.record_round``), so a retry never adds a second."""

    run: _TaskRun
    core: RoundCore
    attempt: int
    status: str
    metrics: dict
    started_wall: float
    ended_wall: float
    tries: int = 1
    next_try_at: float = 0.0


class FLService:
    """Thread-safe; every public method takes the lock for as short a time as it can and never
    writes to the database while holding it."""

    def __init__(
        self,
        store: ServerStore,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        verifier: AttestationVerifier | None = None,
        rng: random.Random | None = None,
        require_release_reports: bool = False,
        release_trust: frozenset[bytes] = frozenset(),
        secagg_random_bytes: Callable[[int], bytes] = secrets.token_bytes,
        token_bytes: Callable[[int], bytes] = secrets.token_bytes,
        late_metrics_every_s: float = LATE_METRICS_EVERY_S,
        dp_random: Callable[[], np.random.Generator] = dp_rounds.secure_generator,
    ) -> None:
        """``require_release_reports``: accept only tasks whose release report covers every runtime
        they claim (see ``release_gate``); a task deployed with a report is checked either way.
        ``release_trust``: the raw Ed25519 public keys whose signature on a release report the
        server trusts (``--release-trust``); with none, a server that requires reports refuses
        them all, and one that does not checks reports for consistency only.
        ``secagg_random_bytes``: where Secure Aggregation rounds draw their seeds, and
        ``token_bytes``: where session ids and tokens are drawn (seeded sources only in a
        simulation, whose run must repeat and whose sessions are not secrets).
        ``late_metrics_every_s``: how often, on ``clock``, ``tick`` writes what late reports
        changed (a simulation, whose clock runs a day in a minute, writes far less often).
        ``dp_random``: a new noise source for each central DP round's commit (cryptographically
        seeded by default; a seeded one only where a run must repeat, never in a deployment)."""
        self.store = store
        self.require_release_reports = require_release_reports
        self.release_trust = frozenset(release_trust)
        self.verifier = verifier
        self.clock = clock
        self.wall_clock = wall_clock
        self.rng = rng or random.Random()
        self.secagg_random_bytes = secagg_random_bytes
        self.token_bytes = token_bytes
        self.late_metrics_every_s = late_metrics_every_s
        self.dp_random = dp_random
        self._lock = threading.RLock()
        self._write_lock = threading.Lock()
        # Called (from any thread) when some device's Secure Aggregation state may have changed:
        # the HTTP layer wakes its long polls with it.
        self.on_secagg_change: Callable[[], None] | None = None
        self._populations: dict[str, _Population] = {}
        self._sessions: dict[str, _Session] = {}
        self._by_token: dict[bytes, _Session] = {}
        self._pending: list[_PendingCommit] = []
        self._unwritten: list[_UnwrittenRound] = []  # closed rounds not yet on record, oldest first
        #: closed rounds' metrics changed by late reports, by round record id: written every
        #: ``late_metrics_every_s`` and on a read of the rounds, once per round however many came
        self._late_due: dict[int, dict] = {}
        self._late_written_at = -math.inf
        self._closed_here = threading.local()  # commits the current thread's call created
        # The last resources read: every selected device downloads the same plan and checkpoint,
        # and resources are content-addressed, so a copy can never go stale.
        self._recent: dict[str, bytes] = {}
        for name in store.population_names():
            self._populations[name] = _Population(name)
            self._activate(name)

    # ----------------------------------------------------------------- admin
    def create_population(self, name: str) -> bool:
        _check_name(name, "population")
        created = self.store.create_population(name)
        with self._lock:
            self._populations.setdefault(name, _Population(name))
        return created

    def populations(self) -> list[str]:
        return self.store.population_names()

    def deploy_task(
        self,
        population: str,
        name: str,
        plan_bytes: bytes,
        checkpoint_bytes: bytes | None,
        config: RoundConfig,
        eligibility: EligibilityPolicies = EligibilityPolicies(),
    ) -> TaskRecord:
        """Validate and store one task; it starts once no earlier task of the population is active."""
        return self.deploy_tasks(population, [TaskSpec(name, plan_bytes, checkpoint_bytes, config, eligibility)])[0]

    def deploy_tasks(
        self, population: str, specs: list[TaskSpec], strategy: Strategy = Strategy.ALTERNATE
    ) -> list[TaskRecord]:
        """Validate and store tasks that share the population's rounds (chosen per round by
        ``strategy``). Every plan is executed once here, so a plan that loads but does not run is
        refused now, with nothing stored, instead of failing rounds later."""
        if not specs or len(specs) > MAX_TASKS_PER_GROUP:
            raise BadRequest(f"a deploy holds 1 to {MAX_TASKS_PER_GROUP} tasks", code="BAD_CONFIG")
        names = [s.name for s in specs]
        for spec in specs:
            _check_name(spec.name, "task")
        if len(set(names)) != len(names):
            raise BadRequest("the tasks of one deploy need distinct names", code="BAD_CONFIG")
        if self.store.population_id(population) is None:
            raise NotFound(f"population {population!r} does not exist; create it first", code="UNKNOWN_POPULATION")
        existing = {t.name for t in self.store.tasks(population)}
        taken = sorted(existing & set(names))
        if taken:
            raise Conflict(f"population {population!r} already has a task named {taken[0]!r}", code="TASK_EXISTS")
        checked: dict[str, tuple[Plan, bytes]] = {}
        for spec in sorted(specs, key=lambda s: s.evaluates is not None):  # trained tasks first
            trained = None
            if spec.evaluates is not None:
                if spec.evaluates not in checked or checked[spec.evaluates][0].kind != "train":
                    raise BadRequest(
                        f"task {spec.name!r} evaluates {spec.evaluates!r}, which is not a training task of this deploy",
                        code="BAD_CONFIG",
                    )
                trained = checked[spec.evaluates][0]
            checkpoint = (
                spec.checkpoint
                if spec.checkpoint is not None
                else (checked[spec.evaluates][1] if spec.evaluates is not None else None)
            )
            if checkpoint is None:
                raise BadRequest(f"task {spec.name!r} needs an initial checkpoint", code="MISSING_FIELD")
            checked[spec.name] = (_validate_task(spec, checkpoint, trained), checkpoint)
        by_name = {s.name: s for s in specs}
        releases = {
            s.name: _check_release(
                s,
                checked[s.name][0],
                self.require_release_reports,
                by_name[s.evaluates] if s.evaluates is not None else None,
                trusted=self.release_trust,
            )
            for s in specs
        }
        stored = [
            NewTask(
                s.name,
                s.plan,
                checked[s.name][1],
                {
                    "round": s.config.to_dict(),
                    "eligibility": s.eligibility.to_dict(),
                    "group": {
                        "strategy": strategy.value,
                        "weight": s.weight,
                        "evaluates": s.evaluates,
                        "first": specs[0].name,
                    },
                    **self._store_release(s, releases[s.name]),
                },
            )
            for s in specs
        ]
        try:
            records = self.store.add_tasks(population, stored)
        except IntegrityError:
            raise Conflict(
                f"population {population!r} already has a task with one of the names {names}", code="TASK_EXISTS"
            ) from None
        self._activate(population)
        return records

    def _store_release(self, spec: TaskSpec, versions: dict[str, tuple[str, bytes]]) -> dict:
        """The versioned plans and the report as resources; the task's config keeps their ids."""
        if spec.release_report is None:
            return {}
        report = json.dumps(spec.release_report, sort_keys=True, separators=(",", ":")).encode()
        return {
            "versions": {key: self.store.put_resource(data, "plan") for key, (_, data) in versions.items()},
            "release": {
                "report_id": self.store.put_resource(report, "release_report"),
                "claimed": sorted(release for release, _ in versions.values()),
            },
        }

    # ----------------------------------------------------------------- device protocol
    def eligibility_info(self, population: str) -> dict:
        """What a device needs to evaluate the active task's policies before it checks in. A
        population that does not exist is answered as one with no task: devices cannot probe
        which names exist (operators list them with ``populations``)."""
        with self._lock:
            pop = self._populations.get(population)
            run = None if pop is None else pop.current or (pop.runs[0] if pop.runs else None)
            if run is None:
                return {"task": None}
            return {
                "task": run.record.name,
                "round": run.round_number,
                "policies": run.eligibility.to_dict(),
                "selector": run.plan.device.selector.to_dict(),
            }

    def attestation_challenge(self) -> dict:
        if self.verifier is None:
            raise NotFound("this server does not ask for attestation", code="ATTESTATION_DISABLED")
        return self.verifier.nonces.challenge(self.wall_clock())

    def checkin(
        self, population: str, runtime_version: str, eligibility: dict | None = None, attestation: object = None
    ) -> dict:
        try:
            device_version = version_tuple(runtime_version)
        except ValueError:
            raise BadRequest(
                f"runtime_version {runtime_version!r} is not a version like '1.31.1'", code="BAD_RUNTIME_VERSION"
            ) from None
        device: bytes | None = None
        if self.verifier is not None:
            if attestation is None:
                raise Unauthorized(
                    "this server only admits attested devices; send an attestation", code="ATTESTATION_REQUIRED"
                )
            try:
                device = self.verifier.verify(
                    attestation, population, runtime_version, self.wall_clock()
                ).device_key_hash
            except RateLimited as exc:
                raise TooManyRequests(exc.message, code=exc.code, retry_after_s=exc.retry_after_s) from None
            except AttestationError as exc:
                raise ApiError(exc.message, code=exc.code, status=exc.http_status) from None
        try:
            now = self.clock()
            with self._lock:
                pop = self._populations.get(population)
                if pop is None:  # as a population with no task (see eligibility_info)
                    return _rejected(IDLE_RETRY_WINDOW_S, "NO_TASK")
                self._advance(pop, now)
                pop.checkins.observe_checkin(now)
                pop.rendezvous.observe_checkin(now)
                run = pop.current
                if run is None:
                    if pop.runs and pop.opens_at is not None:  # a small population gathers for the next selection
                        return _rejected(_told(pop, pop.runs[0], now, pop.opens_at), "ROUND_NOT_OPEN")
                    if pop.runs:  # a round is being committed
                        last = pop.runs[0]
                        if _small(pop, last, now):
                            return _rejected(_told(pop, last, now, pop.rendezvous.aimed_at or now), "ROUND_FULL")
                        return _rejected(
                            last.pace.retry_window(now, now, _paced(pop, last, now), last.config.report_timeout_s),
                            "ROUND_FULL",
                        )
                    return _rejected(IDLE_RETRY_WINDOW_S, "NO_TASK")
                meta = run.plan.metadata
                plan_id = run.record.plan_id
                if run.versions:  # served per minor release: only the releases the report covers
                    plan_id = run.versions.get(f"{device_version[0]}.{device_version[1]}", "")
                    if not plan_id:
                        return _rejected(VERSION_RETRY_WINDOW_S, "RUNTIME_VERSION_NOT_CLAIMED")
                elif device_version < version_tuple(meta.min_runtime_version) or (
                    meta.max_runtime_version is not None and device_version > version_tuple(meta.max_runtime_version)
                ):
                    return _rejected(VERSION_RETRY_WINDOW_S, "RUNTIME_VERSION_UNSUPPORTED")
                if not run.eligibility.empty:
                    if not eligibility or eligibility.get("task") != run.record.name:
                        return _rejected(run.config.retry_window_s, "ELIGIBILITY_REQUIRED")
                    if not eligibility.get("eligible"):
                        failed = ",".join(str(f) for f in eligibility.get("failed", []))[:200]
                        return _rejected(IDLE_RETRY_WINDOW_S, f"INELIGIBLE:{failed}" if failed else "INELIGIBLE")
                assert run.core is not None
                seats = run.seats.setdefault(run.seat_key, {}) if device is not None else {}
                if device is not None and device in seats:
                    # One seat per attested device and round, so its reports count as one device's.
                    # A device whose answer was lost checks in again: it gets its seat back under a
                    # new token (the old one stops working) while the seat is still open.
                    session_id = seats[device]
                    if run.core.sessions.get(session_id) is not SessionState.SELECTED:
                        return _rejected(self._turned_away(pop, run, now), "ALREADY_SELECTED")
                    self._by_token.pop(self._sessions[session_id].token_hash, None)
                else:
                    session_id = _urlsafe(self.token_bytes(16))
                    if not run.core.try_select(session_id, now):
                        return _rejected(self._turned_away(pop, run, now), "ROUND_FULL")
                    if device is not None:
                        run.seats = {run.seat_key: {**seats, device: session_id}}
                token = _urlsafe(self.token_bytes(32))
                session = _Session(session_id, _hash_token(token), run, run.core, (plan_id, run.broadcast_id))
                self._sessions[session_id] = session
                self._by_token[session.token_hash] = session
                return {
                    "status": "accepted",
                    "session_id": session_id,
                    "token": token,
                    "task": run.record.name,
                    "round": run.round_number,
                    "plan_id": plan_id,
                    "checkpoint_id": run.broadcast_id,
                    "aggregation": "secure_sum" if run.plan.server.secure_sum else "simple",
                    "report_deadline_s": run.config.report_timeout_s,
                    "max_report_bytes": run.report_limit,
                    # H(seed) of the round's Secure Aggregation groups, shown before selection ends
                    **({"secagg_commitment": run.secure.commitment_b64} if run.secure is not None else {}),
                    # under Secure Aggregation the device bounds its own update: it must know the bounds
                    **(
                        {
                            "max_examples_per_report": run.config.max_examples_per_report,
                            "clip_update_norm": run.config.clip_update_norm,
                        }
                        if run.codec is not None
                        else {}
                    ),
                }
        finally:
            self._flush()

    def report_limit(self, session_id: str, token: str) -> int:
        """The largest report body the session may send, once its token is checked: asked before
        the body is read, so that a stranger's upload is refused unread."""
        return self._authorize(session_id, token).run.report_limit

    def secagg_limit(self, session_id: str, token: str) -> int:
        """The largest Secure Aggregation message the session may send, once its token is checked:
        the largest its group can need (``secagg_limits``); a session in no group of the open round
        has nothing to send, and gets room for a refusal only."""
        session = self._authorize(session_id, token)
        with self._lock:
            run = session.run
            group = (
                run.secure.by_session.get(session_id) if run.secure is not None and session.core is run.core else None
            )
            if group is None:
                return SECAGG_SLACK_BYTES
            config = group.server.config
            return secagg_upload_limit(len(group.members), config.vector_length, config.modulus)

    def report(self, session_id: str, token: str, body: bytes, stats: dict | None = None) -> dict:
        """Aggregate one device's update; nothing of it is kept apart from the running sum. The
        answer's ``round_status`` says what became of the round as the answer leaves: ``open``
        (it goes on), or, for the report that closed it, ``committed`` (on record with the new
        model) or ``abandoned`` (the update is discarded with the round, e.g. because the
        commit could not be written: a plain "accepted" would have claimed a commit)."""
        session = self._authorize(session_id, token)
        run = session.run
        if run.codec is not None:
            raise Conflict(
                "this task aggregates with Secure Aggregation; use the session's secagg endpoint",
                code="SECURE_AGGREGATION_REQUIRED",
            )
        try:
            update = decode_checkpoint(body, max_bytes=run.report_limit)
        except CheckpointError as exc:
            raise InvalidUpdate(f"the report is not a valid checkpoint: {exc}", code="MALFORMED_UPDATE") from None
        try:
            run.executor.validate_update(update)
        except PlanError as exc:
            raise InvalidUpdate(f"the report does not match the plan: {exc}") from None
        try:
            check_metric_sums(update)
        except MetricsOutOfRange as exc:
            raise InvalidUpdate(
                f"the report's metrics are out of range: {exc}; the update was not taken", code="INVALID_METRICS"
            ) from None
        central = run.config.dp is not None and run.config.dp.mode == "central"
        bounded = bound_update(
            update,
            run.plan.weight_names if run.is_training else (),
            max_examples=run.config.max_examples_per_report,
            clip_norm=None if central else run.config.clip_update_norm,  # central DP clips to its own clip below
        )
        summed, metrics_capped = cap_metric_weight(bounded.update, run.config.max_examples_per_report)
        # with DP, no summary of one device's update or metrics is published beside the noised model
        weights = run.plan.weight_names if run.is_training else ()
        observed = device_metrics(summed, weights) if run.config.dp is None else {}
        observed.update(_stats_metrics(stats))
        shape = _stats_shape(stats)
        try:
            now = self.clock()
            with self._lock:
                verdict = session.core.report(session_id, now)
                if verdict is ReportVerdict.DUPLICATE:
                    raise DuplicateReport("this session has already reported")
                if verdict is ReportVerdict.LATE:
                    session.core.note_shape(shape and shape + "#")
                    self._note_late(run, session.core)
                    raise ReportLate("the reporting window of this session has closed; the update was discarded")
                if verdict is not ReportVerdict.ACCEPT:
                    raise SessionClosed("this session was aborted or is no longer part of a round")
                assert run.accumulator is not None
                try:
                    if run.dp_round is not None:
                        summed = run.dp_round.take(summed, run.plan.weight_names, run.config.max_examples_per_report)
                    run.accumulator = run.executor.accumulate(run.accumulator, summed)
                except Exception as exc:  # the plan's own accumulate failed on this update
                    raise InvalidUpdate(f"the plan could not aggregate this report: {type(exc).__name__}") from None
                run.device_metrics.add(observed)
                run.bounded["capped"] += bounded.capped or metrics_capped
                run.bounded["clipped"] += bounded.clipped
                session.core.note_shape(shape and shape + "^")
                session.core.confirm_report(session_id, now)
                pop = self._populations[run.record.population]
                self._advance(pop, now)
                answer = {
                    "status": "accepted",
                    "round": session.core.number,
                    "round_status": "open",
                    **_participant_window(pop, run, now),
                }
                closing = next((p for p in self._pending if p.core is session.core), None)  # this report closed it
        finally:
            self._flush()
        if closing is not None:  # its commit has been tried: _flush waits for the rounds this call closed
            with self._lock:
                if closing.outcome is not None:
                    answer["round_status"] = closing.outcome.value
        return answer

    def abort(self, session_id: str, token: str, reason: str, stats: dict | None = None) -> dict:
        """The device stopped: its session is closed and its token revoked (it downloads nothing
        more); its bookkeeping (shape, drop-out) stays with the round. A repeated abort is ignored."""
        session = self._authorize(session_id, token, revoked_ok=True)
        shape = _stats_shape(stats)
        try:
            with self._lock:
                if session.revoked:
                    return {"status": "ignored"}
                session.revoked = True
                now = self.clock()
                aborted = session.core.abort(session_id, now)
                if aborted:
                    session.core.note_shape(shape)
                if session.core is session.run.core and session.run.secure is not None:
                    session.run.secure.leave(session_id, now)
                log.debug("session %s aborted (%s)", session_id, reason)
                self._advance(self._populations[session.run.record.population], now)
                return {"status": "aborted" if aborted else "ignored"}
        finally:
            self._flush()

    def tick(self) -> None:
        """Let time-based transitions happen even when no device is talking to the server."""
        now = self.clock()
        with self._lock:
            for pop in list(self._populations.values()):
                self._advance(pop, now)
        self._flush(retry=True)
        if now - self._late_written_at >= self.late_metrics_every_s:
            self._late_written_at = now
            self.write_late_metrics()

    # ----------------------------------------------------------------- queries
    def resource(self, rid: str, token: str | None = None, *, admin: bool = False) -> bytes:
        """A plan or checkpoint by id: an operator may read any; a device only those of the
        session its bearer token belongs to."""
        if len(rid) != 64 or any(c not in "0123456789abcdef" for c in rid):
            raise NotFound(f"no resource with id {rid!r}", code="UNKNOWN_RESOURCE")
        if not admin:
            with self._lock:
                session = self._by_token.get(_hash_token(token)) if token else None
            if session is None or session.revoked:
                raise Unauthorized(
                    "send the token of an open session (or an admin key) as 'Authorization: Bearer <token>'",
                    code="MISSING_TOKEN" if not token else "BAD_SESSION_TOKEN",
                )
            if rid not in session.resources:
                raise NotFound(f"no resource with id {rid!r} for this session", code="UNKNOWN_RESOURCE")
        data = self._recent.get(rid)
        if data is None:
            data = self.store.get_resource(rid)
            if data is None:
                raise NotFound(f"no resource with id {rid!r}", code="UNKNOWN_RESOURCE")
            with self._lock:
                if len(self._recent) >= RECENT_RESOURCES:
                    self._recent.pop(next(iter(self._recent)))
                self._recent[rid] = data
        return data

    def rounds(self, population: str, task: str | None = None) -> list[dict]:
        self.write_late_metrics()
        if self.store.population_id(population) is None:
            raise NotFound(f"population {population!r} does not exist", code="UNKNOWN_POPULATION")
        records = self.store.tasks(population)
        if task is not None and all(r.name != task for r in records):
            raise NotFound(f"population {population!r} has no task {task!r}", code="UNKNOWN_TASK")
        per_task = [
            [{**r.to_json(), "task": record.name} for r in self.store.rounds(record.id)]
            for record in records
            if task is None or record.name == task
        ]
        # oldest first across tasks (each task's own order kept): an operator reads a history
        return list(heapq.merge(*per_task, key=lambda item: item["started_at"]))

    def population_status(self, population: str) -> dict:
        tasks = self.store.tasks(population)
        with self._lock:
            pop = self._population(population)
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
            states = self._task_states(pop, tasks)
            status: dict[str, Any] = {
                "population": population,
                "strategy": pop.strategy.value if pop.runs else None,
                "active_task": run.record.name if run is not None else None,
                "active_tasks": active,
                "tasks": [{"name": t.name, **states[t.name]} for t in tasks],
            }
            if run is not None:
                assert run.core is not None
                status.update(
                    round=run.round_number,
                    committed_rounds=run.committed_rounds,
                    phase=run.core.phase.value,
                    current_round=run.core.stats(self.clock()),
                    checkpoint_id=run.broadcast_id,
                )
            return status

    def task_states(self, population: str) -> dict[str, dict]:
        """Each task's state as an operator sees it: ``active`` (its rounds run), ``queued`` with
        ``queued_behind`` (the running tasks it waits for: a population runs one deploy at a time,
        and a task without ``max_rounds`` never ends), or ``completed``."""
        tasks = self.store.tasks(population)
        with self._lock:
            return self._task_states(self._population(population), tasks)

    def _task_states(self, pop: _Population, tasks: list[TaskRecord]) -> dict[str, dict]:
        running = [r.record.name for r in pop.runs]
        states: dict[str, dict] = {}
        for t in tasks:
            if t.status != "active" or t.name in running or not running:
                states[t.name] = {"status": t.status}
            else:
                states[t.name] = {"status": "queued", "queued_behind": running}
        return states

    def current_model(self, population: str, task: str | None = None) -> tuple[bytes, int, str]:
        """The newest global model of a task (by default the population's current training
        task, else its latest one): bytes, round, task name."""
        if self.store.population_id(population) is None:
            raise NotFound(f"population {population!r} does not exist", code="UNKNOWN_POPULATION")
        tasks = self.store.tasks(population)
        if not tasks:
            raise NotFound(f"population {population!r} has no task yet", code="NO_TASK")
        if task is not None:
            chosen = next((t for t in tasks if t.name == task), None)
            if chosen is None:
                raise NotFound(f"population {population!r} has no task {task!r}", code="UNKNOWN_TASK")
        else:
            with self._lock:
                pop = self._populations.get(population)
                training = [r.record for r in pop.runs if r.is_training] if pop is not None else []
            chosen = training[0] if training else tasks[-1]
        last = self.store.last_committed_round(chosen.id)
        rid = last.checkpoint_id if last is not None and last.checkpoint_id else chosen.initial_checkpoint_id
        return self.resource(rid, admin=True), (last.number if last else 0), chosen.name

    # ----------------------------------------------------------------- internals
    def _population(self, name: str) -> _Population:
        pop = self._populations.get(name)
        if pop is None:
            raise NotFound(f"population {name!r} does not exist", code="UNKNOWN_POPULATION")
        return pop

    def _authorize(self, session_id: str, token: str, *, revoked_ok: bool = False) -> _Session:
        """The session ``token`` opens. An unknown id and a wrong token get one answer, and the
        token is compared in constant time either way, so neither ids nor tokens can be probed.
        A session its device aborted answers ``SESSION_CLOSED`` (unless ``revoked_ok``)."""
        with self._lock:
            session = self._sessions.get(session_id)
        known = session.token_hash if session is not None else _NO_SESSION
        if not hmac.compare_digest(_hash_token(token or ""), known) or session is None or not token:
            raise Unauthorized(
                "no session has this id and token; the device must check in again", code="BAD_SESSION_TOKEN"
            )
        if session.revoked and not revoked_ok:
            raise SessionClosed("the device aborted this session; it must check in again")
        return session

    def _activate(self, population: str) -> None:
        """Load the population's first group of active tasks if it has none running. The
        database is read (and written) outside the lock; the result is installed under it."""
        with self._lock:
            pop = self._populations.setdefault(population, _Population(population))
            if pop.runs or pop.committing:
                return
        loaded = self._load_group(population)
        with self._lock:
            if pop.runs or pop.committing or loaded is None:
                return
            pop.runs, pop.strategy, pop.turn = loaded
            self._start_next(pop, self.clock())

    def _load_group(self, population: str) -> tuple[list[_TaskRun], Strategy, int] | None:
        """The first deploy (group of tasks) with an active task, continuing after each task's
        last committed round (and, for alternating tasks, with the turn after the last round
        run); tasks that reached ``max_rounds`` are marked completed."""
        groups: dict[str, list[TaskRecord]] = {}
        for task in self.store.tasks(population):
            group = task.config.get("group", {})
            groups.setdefault(group.get("first", task.name), []).append(task)
        for members in groups.values():
            runs: dict[str, _TaskRun] = {}
            for task in members:
                if task.status != "active":
                    continue
                run = self._load_run(task)
                if run is None:
                    self.store.set_task_status(task.id, "completed")
                    continue
                runs[task.name] = run
            for task in members:
                evaluated = task.config.get("group", {}).get("evaluates")
                if task.name in runs and evaluated is not None:
                    if evaluated not in runs:  # its model is final: nothing more to evaluate
                        self.store.set_task_status(task.id, "completed")
                        del runs[task.name]
                    else:
                        runs[task.name].evaluates = runs[evaluated]
            if runs:
                strategy = Strategy(members[0].config.get("group", {}).get("strategy", Strategy.ALTERNATE.value))
                turn = sum(len(self.store.rounds(task.id)) for task in members)
                return list(runs.values()), strategy, turn
        return None

    def _load_run(self, task: TaskRecord) -> _TaskRun | None:
        plan = load_plan(self.store.resource(task.plan_id))
        executor = PlanExecutor(plan)
        config = RoundConfig.from_dict(task.config["round"])
        eligibility = EligibilityPolicies.from_dict(task.config["eligibility"])
        history = self.store.rounds(task.id)
        committed = [r for r in history if r.status == "committed"]
        if config.max_rounds is not None and len(committed) >= config.max_rounds:
            return None
        dp = TaskDP.load(config, [r.metrics for r in committed])
        if dp is not None and not dp.allows_next():  # its privacy budget is spent
            return None
        last = committed[-1] if committed else None
        ckpt_id = last.checkpoint_id if last is not None and last.checkpoint_id else task.initial_checkpoint_id
        state = {k: np.array(v) for k, v in decode_checkpoint(self.store.resource(ckpt_id)).items()}
        number = (last.number + 1) if last else 1
        # after the last attempt on record (not their count: one whose record a stopped server
        # never wrote leaves a gap, and a round on record under (number, attempt) is not written again)
        attempt = 1 + max((r.attempt for r in history if r.number == number), default=0)
        spec = executor.client_update_spec()
        limit = REPORT_SLACK_BYTES + sum(int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in spec.values())
        return _TaskRun(
            record=task,
            plan=plan,
            executor=executor,
            config=config,
            eligibility=eligibility,
            state=state,
            broadcast_id=self.store.put_resource(encode_checkpoint(executor.prepare(state)), "checkpoint"),
            round_number=number,
            attempt=attempt,
            committed_rounds=len(committed),
            report_limit=limit,
            weight=float(task.config.get("group", {}).get("weight", 1.0)),
            codec=SecureSumCodec(plan, executor) if plan.server.secure_sum else None,
            ddp=ddp_rounds.distributed_dp(plan, executor, config),
            versions=dict(task.config.get("versions", {})),
            dp=dp,
        )

    def _start_next(self, pop: _Population, now: float) -> None:
        """Open the next round of the task the population's strategy picks."""
        if not pop.runs:
            pop.current = None
            return
        run = pop.runs[choose_task(pop.strategy, [r.weight for r in pop.runs], pop.turn, self.rng)]
        pop.turn += 1
        if run.evaluates is not None:  # measure the model its training task has now
            run.state = run.evaluates.state
            run.broadcast_id = run.evaluates.broadcast_id
        run.core = RoundCore(run.round_number, run.config, now, deadlines_from_selection_end=run.codec is not None)
        if run.codec is not None:
            cfg = run.config
            settings = SecureSettings(
                cfg.secagg_min_group_size, cfg.secagg_round_timeout_s, consistency_check=cfg.secagg_consistency_check
            )
            run.secure = SecureRound(
                run.codec,
                settings,
                f"{run.record.name}/{run.round_number}/{run.attempt}",
                random_bytes=self.secagg_random_bytes,
                ddp=run.ddp,
            )
        run.accumulator = run.executor.zero()
        run.dp_round = run.dp.open_round(run.codec is not None) if run.dp is not None else None
        run.device_metrics = RoundMetrics()
        run.bounded = {"capped": 0, "clipped": 0}
        run.started_wall = self.wall_clock()
        pop.current = run

    def _turned_away(self, pop: _Population, run: _TaskRun, now: float) -> tuple[float, float]:
        """The retry window of a device the open round has no seat for: in a small population, a
        rendezvous at the next round's expected opening (``Rendezvous``); otherwise the task's
        window stretched to the population and shifted to that opening (``CheckinPace``, ``RoundPace``)."""
        core = run.core
        assert core is not None
        if _small(pop, run, now):
            if core.selection_ended_at is not None:
                opens_at = core.selection_ended_at + (run.pace.mean_reporting_s or run.config.report_timeout_s)
            else:
                opens_at = core.started_at + (run.pace.mean_duration_s or run.config.selection_timeout_s)
            return _told(pop, run, now, opens_at)
        cap = run.config.selection_timeout_s + run.config.report_timeout_s
        return run.pace.retry_window(now, core.started_at, _paced(pop, run, now), cap)

    def _open_next(self, pop: _Population, run: _TaskRun, now: float) -> None:
        """Open the next round now, or, in a small population, once enough devices are expected
        to come to its selection (``Rendezvous.plan``); the devices turned away meanwhile are told
        when it opens."""
        if pop.opens_at is None and not _small(pop, run, now):
            self._start_next(pop, now)
            return
        cfg = run.config
        opens_at = pop.rendezvous.plan(now, cfg.selection_target, cfg.selection_timeout_s)
        if opens_at <= now:
            pop.opens_at, pop.deferrals = None, 0
            self._start_next(pop, now)
        else:
            pop.opens_at, pop.deferrals = opens_at, pop.deferrals + 1
            log.info(
                "population %s: the next selection opens in %.0f s, once its devices have gathered",
                pop.name,
                opens_at - now,
            )

    def _advance(self, pop: _Population, now: float) -> None:
        if pop.current is None and not pop.committing and pop.opens_at is not None and now >= pop.opens_at:
            # A deferred selection is planned again when its time comes (a rate misjudged low costs
            # one wait), but at most MAX_DEFERRALS times: then it opens with the devices that came, or
            # a population that never gathers enough would never train.
            if pop.runs and pop.deferrals < MAX_DEFERRALS:
                self._open_next(pop, pop.runs[0], now)
            else:
                pop.opens_at, pop.deferrals = None, 0
                self._start_next(pop, now)
        run = pop.current
        if run is None or run.core is None:
            return
        core = run.core
        if run.secure is not None and core.open:
            before = run.secure.version
            self._advance_secure(run, core, run.secure, now)
            if run.secure.version != before:
                self._secagg_changed()
        phase = core.advance(now)
        if core.open:
            return
        self._close_round(pop, run, core, phase, now)

    def _advance_secure(self, run: _TaskRun, core: RoundCore, secure: SecureRound, now: float) -> None:
        """Form the groups once selection is over; add each finished group's sum (the Master
        Aggregator), count its summed devices as reported and the rest of the group as dropped,
        so that the round need not wait for their deadlines. A sum outside the bounds honest
        devices keep (``check_group_sum``; under distributed DP ``ddp_rounds.sum_problem``) is dropped, its devices with it, and the reason kept
        for the round's metrics: one device's update is never seen, so its group answers for it."""
        core.advance(now)
        if core.phase is Phase.REPORTING and not secure.formed:
            selected = [sid for sid, st in core.sessions.items() if st is SessionState.SELECTED]
            devices = {sid: device for device, sid in run.seats.get(run.seat_key, {}).items()}  # attested key hashes
            if not secure.form_groups(selected, now, core.deadlines, devices):
                log.info(
                    "task %s round %d: %d devices, no SecAgg group of %d: %s",
                    run.record.name,
                    core.number,
                    len(selected),
                    secure.settings.min_group_size,
                    secure.ddp_error or "too few",
                )
                for sid in selected:
                    core.abort(sid, now)
        for group in secure.tick(now):
            summed: list[str] = []
            if group.server.round is Round.COMPLETED:
                total, summed = secure.group_sum(group)
                if secure.ddp_params is not None:  # distributed DP: every device weighs 1, the noise is in
                    refused = ddp_rounds.sum_problem(total, run.plan.weight_names, secure.ddp_params, len(summed))
                else:
                    refused = check_group_sum(
                        total,
                        run.plan.weight_names if run.is_training else (),
                        members=len(summed),
                        max_examples=run.config.max_examples_per_report,
                        clip_norm=run.config.clip_update_norm,
                        tolerance=secure.codec.sum_error(len(summed)),
                    )
                if refused is not None:
                    log.warning(
                        "task %s round %d: the sum of SecAgg group %d is dropped: %s",
                        run.record.name,
                        core.number,
                        group.index,
                        refused,
                    )
                    secure.drop(group, refused)
                    summed = []
                elif core.confirm_group(summed, now):
                    assert run.accumulator is not None
                    run.accumulator = run.executor.accumulate(run.accumulator, total)
            else:
                log.info(
                    "task %s round %d: SecAgg group %d aborted: %s",
                    run.record.name,
                    core.number,
                    group.index,
                    group.server.abort_reason,
                )
            for sid in set(group.members) - set(summed):
                core.abort(sid, now)

    def _secagg_changed(self) -> None:
        if self.on_secagg_change is not None:
            self.on_secagg_change()

    def secagg_status(self, session_id: str, token: str) -> dict:
        """The device's view of its group; after the round closed, its group's final state."""
        session = self._authorize(session_id, token)
        try:
            with self._lock:
                run = session.run
                now = self.clock()
                pop = self._populations[run.record.population]
                self._advance(pop, now)
                if session.core is run.core and run.secure is not None:
                    state = run.secure.status(session_id)
                    state["deadline_in_s"] = round(max(0.0, session.core.deadline_of(session_id) - now), 3)
                    return _with_window(state, pop, run, now)
                for closed in run.closed:
                    if closed.core is session.core and closed.secure is not None:
                        state = closed.secure.status(session_id)
                        # a group still running when its round closed will never finish
                        return (
                            _with_window(state, pop, run, now)
                            if state["status"] in ("completed", "aborted")
                            else {"status": "closed"}
                        )
                return {"status": "closed"}
        finally:
            self._flush()

    def secagg_message(self, session_id: str, token: str, data: bytes) -> dict:
        session = self._authorize(session_id, token)
        try:
            with self._lock:
                run = session.run
                if run.secure is None or session.core is not run.core:
                    raise SessionClosed("this session's round is over")
                if session_id not in run.secure.by_session:
                    raise Conflict("this session is in no Secure Aggregation group (yet)", code="NOT_IN_GROUP")
                now = self.clock()
                try:
                    before = run.secure.version
                    run.secure.receive(session_id, data, now)
                    if run.secure.version != before:
                        self._secagg_changed()
                except (OutOfOrder, UnexpectedClient) as exc:
                    raise Conflict(
                        f"the group has moved past this message's round: {exc}", code="SECAGG_ROUND_CLOSED"
                    ) from None
                except SecAggError as exc:
                    raise BadRequest(
                        f"the Secure Aggregation message was refused: {exc}", code="SECAGG_REJECTED"
                    ) from None
                self._advance(self._populations[run.record.population], now)
                return {"status": "accepted"}
        finally:
            self._flush()

    def _close_round(self, pop: _Population, run: _TaskRun, core: RoundCore, phase: Phase, now: float) -> None:
        """Turn a finished round into a pending commit; the population opens no round until it
        is written (see ``_flush``)."""
        metrics = core.stats(now)
        metrics["duration_s"] = round(now - core.started_at, 4)
        if run.secure is not None:
            metrics["secagg"] = run.secure.stats()
        metrics["device_metrics"] = run.device_metrics.to_json()
        if run.dp is None:  # with DP, which reports were clipped is what adaptive clipping noises
            metrics["bounded_reports"] = dict(run.bounded)
        run.pace.observe(
            now - core.started_at,
            now - (core.selection_ended_at if core.selection_ended_at is not None else core.started_at),
        )
        pending = _PendingCommit(
            pop,
            run,
            core,
            phase,
            metrics,
            run.accumulator,
            run.secure,
            run.started_wall,
            self.wall_clock(),
            run.dp_round,
        )
        self._pending.append(pending)
        if not hasattr(self._closed_here, "commits"):
            self._closed_here.commits = []
        self._closed_here.commits.append(pending)
        run.closed.append(_ClosedRound(core, None, metrics, run.secure))
        run.accumulator = None
        run.dp_round = None
        run.core = None
        if run.secure is not None:
            run.secure = None
            self._secagg_changed()
        pop.current = None
        pop.committing = True

    def _flush(self, *, retry: bool = False) -> None:
        """Write pending commits, outside the service lock. One thread writes at a time; a thread
        that finds another writing leaves the work to it. A call that closed a round returns only
        once that round's commit was tried (by whichever thread): the round is on record, or was
        abandoned and its record waits for a retry; so the device whose report completed a round,
        or a test, learns its outcome. Calls that closed nothing never wait for a write. With
        ``retry`` (the ticker), records whose backoff is over are written again first."""
        while True:
            with self._lock:
                if not self._pending and not (retry and self._due_unwritten()):
                    break
            if not self._write_lock.acquire(blocking=False):
                break
            try:
                if retry:
                    with self._lock:
                        due = self._due_unwritten()
                    self._write_unwritten(due)
                while True:
                    with self._lock:
                        if not self._pending:
                            break
                        pending = self._pending.pop(0)
                        earlier = [u for u in self._unwritten if u.run is pending.run]
                    try:
                        self._write_unwritten(earlier)  # a task's records go on record in the order they ended
                        self._commit(pending)
                    finally:
                        pending.written.set()
            finally:
                self._write_lock.release()
        closed = getattr(self._closed_here, "commits", None)
        if closed:
            self._closed_here.commits = []
            for pending in closed:
                pending.written.wait()

    def _commit(self, p: _PendingCommit) -> None:
        run, phase, metrics, attempt = p.run, p.phase, p.metrics, p.run.attempt
        new_state = checkpoint = broadcast = None
        next_clip: float | None = None
        if phase is Phase.COMMITTED and p.core.reported < run.config.min_reports:
            # Refused at deploy; a task an older server stored may still have such a config.
            phase = Phase.ABANDONED
            metrics["error"] = (
                f"{p.core.reported} report(s), fewer than min_reports ({run.config.min_reports}): "
                "the round publishes nothing"
            )
        if phase is Phase.COMMITTED:
            try:
                assert p.accumulator is not None
                accumulator = p.accumulator
                if p.dp_round is not None:  # the noise, before the plan's server part sees the sum
                    accumulator, next_clip = p.dp_round.close(accumulator, run.plan.weight_names, self.dp_random())
                aggregate = run.executor.report(accumulator)
                new_state, update_metrics = run.executor.update(run.state, aggregate)
                new_state = {k: np.asarray(v, dtype=np.float32) for k, v in new_state.items()}
                _check_finite(new_state)
            except Exception as exc:  # a plan whose server part fails must not wedge the task
                log.exception(
                    "task %s: the plan's server part failed; round %d is abandoned", run.record.name, p.core.number
                )
                phase = Phase.ABANDONED
                metrics["error"] = f"{type(exc).__name__}: {exc}"[:300]
                new_state = None
            else:
                if run.dp is None:  # with DP, the plan's loss and accuracy are exact sums of devices' data: withheld
                    metrics.update(_finite_metrics(update_metrics))
                if run.is_training:
                    checkpoint = encode_checkpoint(new_state)
                    broadcast = encode_checkpoint(run.executor.prepare(new_state))
                else:
                    metrics["evaluated_checkpoint_id"] = run.broadcast_id

        ledger_after = None
        if phase is Phase.COMMITTED and run.dp is not None:
            dp_metrics, ledger_after = run.dp.round_metrics(p.dp_round.clip if p.dp_round is not None else None)
            metrics.update(dp_metrics)
            if next_clip is not None:
                metrics[dp_rounds.NEXT_CLIP_KEY] = next_clip

        def write(status: str, *resources: bytes | None) -> RoundRecord:
            return self.store.record_round(
                run.record.id, p.core.number, attempt, status, metrics, p.started_wall, p.ended_wall, *resources
            )

        # A selection nobody came to, after another: the record of the first grows (its end, its
        # count of timeouts) instead of a new one per timeout, and no attempt is used up, so an idle
        # population's history is one line per idle spell, not one per selection_timeout_s.
        idle = phase is Phase.ABANDONED and not metrics.get("selected") and "error" not in metrics
        extended = None
        if idle and run.idle_record is not None:
            first = run.idle_record
            grown = {
                **first.metrics,
                "idle_timeouts": int(first.metrics.get("idle_timeouts", 1)) + 1,
                "duration_s": round(float(first.metrics.get("duration_s", 0.0)) + float(metrics["duration_s"]), 4),
            }
            extended = self._write_quietly(self.store.extend_round, first.id, grown, p.ended_wall)
        record: RoundRecord | None = extended
        try:
            if extended is None:
                record = write(phase.value, checkpoint, broadcast)
        except (SQLAlchemyError, OSError) as exc:
            log.error(
                "task %s round %d: the database write failed (%s); the round is abandoned",
                run.record.name,
                p.core.number,
                exc,
            )
            was_commit = phase is Phase.COMMITTED
            phase = Phase.ABANDONED
            metrics["error"] = f"database write failed: {type(exc).__name__}"
            record = self._write_quietly(write, phase.value)
            if was_commit and record is not None and record.status == Phase.COMMITTED.value:
                # the failed write had gone through after all (the retry found it): the round committed
                phase = Phase.COMMITTED
                metrics.pop("error")
            elif record is None:
                with self._lock:
                    self._unwritten.append(
                        _UnwrittenRound(
                            run,
                            p.core,
                            attempt,
                            phase.value,
                            metrics,
                            p.started_wall,
                            p.ended_wall,
                            next_try_at=self.clock() + WRITE_RETRY_FIRST_S,
                        )
                    )
                log.error(
                    "task %s round %d attempt %d: its record is kept in memory and written again until on record",
                    run.record.name,
                    p.core.number,
                    attempt,
                )
        record_id = record.id if record is not None else None
        dp_after = None
        if phase is not Phase.COMMITTED:
            dp_rounds.strip(metrics)  # an abandoned round spends no privacy
        elif run.dp is not None and ledger_after is not None:
            dp_after = run.dp.after_commit(ledger_after, next_clip)
        completes = phase is Phase.COMMITTED and (
            (run.config.max_rounds is not None and run.committed_rounds + 1 >= run.config.max_rounds)
            or (dp_after is not None and not dp_after.allows_next())  # the budget would not take one more round
        )
        finished = [run] + [r for r in p.population.runs if r.evaluates is run] if completes else []
        for done in finished:
            self._write_quietly(self.store.set_task_status, done.record.id, "completed")
        with self._lock:
            p.outcome = phase
            for closed in run.closed:
                if closed.core is p.core:
                    closed.record_id = record_id
            del run.closed[:-CLOSED_ROUNDS_KEPT]
            live = {id(c.core) for c in run.closed}  # ids of live objects: no two are alike
            for sid, session in list(self._sessions.items()):
                if session.run is run and id(session.core) not in live:
                    del self._sessions[sid]
                    self._by_token.pop(session.token_hash, None)
            if phase is Phase.COMMITTED:
                if run.is_training and new_state is not None and broadcast is not None:
                    run.state = new_state
                    run.broadcast_id = _resource_id(broadcast)
                run.committed_rounds += 1
                run.dp = dp_after if dp_after is not None else run.dp
                run.round_number += 1
                run.attempt = 1
                log.info("task %s committed round %d: %s", run.record.name, p.core.number, _brief(metrics))
            elif extended is not None:
                log.info(
                    "task %s round %d attempt %d: nobody came again (%d selection timeouts in a row)",
                    run.record.name,
                    p.core.number,
                    extended.attempt,
                    extended.metrics["idle_timeouts"],
                )
            else:
                run.attempt += 1
                log.info(
                    "task %s abandoned round %d (attempt %d): %s",
                    run.record.name,
                    p.core.number,
                    run.attempt - 1,
                    _brief(metrics),
                )
            run.idle_record = (extended or record) if idle else None
            pop = p.population
            pop.runs = [r for r in pop.runs if r not in finished]
            pop.committing = False
            if pop.runs:
                self._open_next(pop, run if run in pop.runs else pop.runs[0], self.clock())
        if not pop.runs:
            self._activate(pop.name)

    def _due_unwritten(self) -> list[_UnwrittenRound]:
        """Records whose backoff is over (under the lock)."""
        if not self._unwritten:
            return []
        now = self.clock()
        return [u for u in self._unwritten if u.next_try_at <= now]

    def _write_unwritten(self, todo: list[_UnwrittenRound]) -> None:
        """Write again records that failed to be written (outside the lock; the caller holds the
        write lock). One still failing waits twice as long as last time before the next try."""
        for u in todo:
            with self._lock:
                assert u.core.ended_at is not None
                u.metrics.update(u.core.stats(u.core.ended_at))  # with the late reports counted so far
                metrics = dict(u.metrics)
            # Overwriting: the outcome in memory is what devices were told and the next round
            # started from, even if a commit write that "failed" had gone through after all.
            record = self._write_quietly(
                functools.partial(self.store.record_round, overwrite=True),
                u.run.record.id,
                u.core.number,
                u.attempt,
                u.status,
                metrics,
                u.started_wall,
                u.ended_wall,
            )
            with self._lock:
                if record is None:
                    u.tries += 1
                    u.next_try_at = self.clock() + min(WRITE_RETRY_MAX_S, WRITE_RETRY_FIRST_S * 2.0 ** (u.tries - 1))
                    continue
                self._unwritten.remove(u)
                for closed in u.run.closed:
                    if closed.core is u.core:
                        closed.record_id = record.id
                if u.core.late_reports:
                    self._note_late(u.run, u.core)  # late reports that came after the copy above
            log.info(
                "task %s round %d attempt %d is on record after %d tries",
                u.run.record.name,
                u.core.number,
                u.attempt,
                u.tries + 1,
            )

    def _write_quietly(self, write: Callable[..., _T], *args: object) -> _T | None:
        """A database write whose failure is logged, not raised (its caller has a fallback)."""
        try:
            return write(*args)
        except (SQLAlchemyError, OSError) as exc:
            log.error("a database write failed: %s", exc)
            return None

    def _note_late(self, run: _TaskRun, core: RoundCore) -> None:
        """A closed round's metrics updated with a late report, due to be written (under the lock)."""
        for closed in run.closed:
            if closed.core is core and closed.record_id is not None:
                assert core.ended_at is not None
                closed.metrics.update(core.stats(core.ended_at))
                self._late_due[closed.record_id] = closed.metrics  # copied once, when written
                return

    def write_unwritten(self) -> int:
        """Try every record still waiting for a retry now, whatever its backoff (a server that
        stops: what is not on record when the process ends is lost); how many are left unwritten."""
        with self._write_lock:
            with self._lock:
                todo = list(self._unwritten)
            self._write_unwritten(todo)
            with self._lock:
                left = len(self._unwritten)
        if left:
            log.error("%d round record(s) could not be written before the server stopped; they are lost", left)
        return left

    def write_late_metrics(self) -> None:
        """Write the metrics late reports changed since the last write (outside the lock); the
        ticker does every ``late_metrics_every_s``, a server that stops does once more."""
        with self._lock:
            due = {record_id: dict(metrics) for record_id, metrics in self._late_due.items()}
            self._late_due = {}
        for record_id, metrics in due.items():
            self._write_quietly(self.store.update_round_metrics, record_id, metrics)


def _validate_task(spec: TaskSpec, checkpoint: bytes, trained: Plan | None) -> Plan:
    """Everything a deploy checks before anything is stored; raises a 4xx ``ApiError``."""
    try:
        plan = load_plan(spec.plan)
    except PlanError as exc:
        raise InvalidPlan(f"task {spec.name!r}: the plan was refused: {exc}") from None
    if plan.kind not in ("train", "eval"):
        raise InvalidPlan(f"task {spec.name!r}: plans of kind {plan.kind!r} cannot be deployed")
    try:
        weights = decode_checkpoint(checkpoint)
    except CheckpointError as exc:
        raise InvalidCheckpoint(f"task {spec.name!r}: the initial checkpoint was refused: {exc}") from None
    executor = PlanExecutor(plan)
    try:
        executor.client_update_spec()
        _check_weights(executor, weights)
        if trained is not None and PlanExecutor(trained).weight_spec() != executor.weight_spec():
            raise InvalidPlan(f"task {spec.name!r}: its model's weights differ from those of the task it evaluates")
        executor.smoke_test(weights)
    except PlanError as exc:
        raise InvalidPlan(f"task {spec.name!r}: {exc}") from None
    config = spec.config
    if config.commit_threshold < config.min_reports:  # every kind publishes: a model, or metrics and totals
        raise BadRequest(
            f"task {spec.name!r}: a round could commit with {config.commit_threshold} device(s) "
            f"(goal_count {config.goal_count} x min_fraction {config.min_fraction}), fewer than min_reports "
            f"({config.min_reports}); what a round publishes (a model, an evaluation's loss and accuracy, an "
            "analytics total) would give back so few devices' own values. Raise goal_count, or lower min_reports knowingly",
            code="BAD_CONFIG",
        )
    if not (spec.weight > 0 and np.isfinite(spec.weight)):
        raise BadRequest(f"task {spec.name!r}: weight must be a positive number", code="BAD_CONFIG")
    dp_rounds.check_deploy(spec.name, plan, config)
    if plan.server.secure_sum:
        try:
            SecureSumCodec(plan, executor)
        except PlanError as exc:
            raise InvalidPlan(f"task {spec.name!r}: the plan's secure aggregation is not usable: {exc}") from None
        if plan.kind == "train" and config.clip_update_norm is None:
            raise BadRequest(
                f"task {spec.name!r}: a Secure Aggregation training task needs clip_update_norm: the server sees "
                "only each group's sum, and can bound one device's influence only through the norm its devices "
                "clip to; set clip_update_norm (the default is 10.0)",
                code="BAD_CONFIG",
            )
        if config.report_timeout_s <= 3 * config.secagg_round_timeout_s:
            raise BadRequest(
                f"report_timeout_s ({config.report_timeout_s}) must exceed three secagg_round_timeout_s "
                f"({config.secagg_round_timeout_s}): the key rounds, training and Unmasking all fit in it",
                code="BAD_CONFIG",
            )
    ddp_rounds.check_deploy(spec.name, plan, executor, config, SecureSettings().spare)
    return plan


def _check_release(
    spec: TaskSpec,
    plan: Plan,
    required: bool,
    trained: TaskSpec | None = None,
    *,
    trusted: frozenset[bytes] = frozenset(),
) -> dict[str, tuple[str, bytes]]:
    """The versioned plans by minor release, once the release report lets the task through (an
    evaluation's report also has to match ``trained``, the training task it measures). Its
    signature is checked against ``trusted`` unless the server neither requires reports nor
    trusts any signer (``--allow-untested-plans`` without ``--release-trust``)."""
    if spec.release_report is None:
        if spec.versioned_plans or required:
            raise ApiError(
                f"task {spec.name!r}: this server deploys only tasks whose release report covers every runtime they "
                "claim; run `fedfleet plan test` and deploy with `fedfleet deploy`"
                if required
                else f"task {spec.name!r}: versioned plans come with the release report that tested them",
                code="RELEASE_REPORT_REQUIRED",
                status=422,
            )
        return {}
    hashes = {release: _resource_id(data) for release, data in spec.versioned_plans.items()}
    try:
        trained_claimed = (trained.release_report or {}).get("claimed") if trained is not None else None
        claimed = check_release_report(
            spec.release_report,
            _resource_id(spec.plan),
            hashes,
            trusted_keys=trusted if trusted or required else None,
            evaluates_plan_sha256=_resource_id(trained.plan) if trained is not None else None,
            evaluates_runtimes=trained_claimed if isinstance(trained_claimed, list) else None,
        )
    except ReleaseGateError as exc:
        raise ApiError(f"task {spec.name!r}: {exc.message}", code=exc.code, status=422) from None
    executor = PlanExecutor(plan)
    versions = {}
    for release in claimed:
        try:
            vplan = load_plan(spec.versioned_plans[release], runtime_version=release)
            same = (vplan.kind, vplan.weight_names, vplan.metric_names) == (
                plan.kind,
                plan.weight_names,
                plan.metric_names,
            )
            if not same or PlanExecutor(vplan).weight_spec() != executor.weight_spec():
                raise PlanError("its model, weights or metrics differ from the unversioned plan's")
        except PlanError as exc:
            raise InvalidPlan(f"task {spec.name!r}: the plan for onnxruntime {release} was refused: {exc}") from None
        versions[minor_key(release)] = (release, spec.versioned_plans[release])
    return versions


def _resource_id(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_finite(state: dict[str, np.ndarray]) -> None:
    bad = [name for name, value in state.items() if not np.all(np.isfinite(value))]
    if bad:
        raise FloatingPointError(f"the new model has non-finite values in {bad}")


def _finite_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Only finite metrics are stored: a NaN or infinity would poison every later read."""
    return {k: float(v) for k, v in metrics.items() if np.isfinite(v)}


def _brief(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k not in ("device_metrics", "shapes")}


def _stats_shape(stats: object) -> str | None:
    if isinstance(stats, dict) and isinstance(stats.get("shape"), str):
        return stats["shape"]
    return None


def _stats_metrics(stats: object) -> dict[str, float]:
    """Advisory costs a device reported with its update (its training time), for the summaries."""
    if not isinstance(stats, dict):
        return {}
    value = stats.get("training_s")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value) and value >= 0:
        return {"training_s": float(value)}
    return {}


def _paced(pop: _Population, run: _TaskRun, now: float) -> tuple[float, float]:
    """The task's retry window stretched to the population checking in (``CheckinPace``)."""
    cfg = run.config
    round_s = run.pace.mean_reporting_s or cfg.report_timeout_s
    return pop.checkins.window(now, cfg.retry_window_s, cfg.selection_target, round_s)


def _small(pop: _Population, run: _TaskRun, now: float) -> bool:
    """Whether the population checks in too slowly of itself to fill ``run``'s rounds (``Rendezvous``)."""
    return pop.rendezvous.small(now, run.config.selection_target, run.config.selection_timeout_s)


def _told(pop: _Population, run: _TaskRun, now: float, opens_at: float) -> tuple[float, float]:
    """The rendezvous window of a device turned away while the next selection opens at ``opens_at``."""
    return pop.rendezvous.tell(now, opens_at, run.config.selection_target, run.config.selection_timeout_s)


def _participant_window(pop: _Population, run: _TaskRun, now: float) -> dict:
    """What a device whose update was taken is told: while pace steering spreads the population
    out, participants are spread too (told nothing, they would come back at their own cooldown
    and be turned away); otherwise nothing, and they keep their own pace."""
    window = _paced(pop, run, now)
    return {"retry_after_s": _window(window)} if window[1] > run.config.retry_window_s[1] else {}


def _with_window(state: dict, pop: _Population, run: _TaskRun, now: float) -> dict:
    """A Secure Aggregation state; a device its completed group summed gets its pace window."""
    if state.get("status") == "completed" and state.get("included"):
        state.update(_participant_window(pop, run, now))
    return state


def _window(window: tuple[float, float]) -> list[float]:
    """A retry window as answers carry it (``retry_after_s``)."""
    return [float(window[0]), float(window[1])]


def _rejected(window: tuple[float, float], reason: str) -> dict:
    return {"status": "rejected", "reason": reason, "retry_after_s": _window(window)}


def _check_name(name: str, what: str) -> None:
    """A name is safe in a URL path: a name of only dots would be the segment '.' or '..'."""
    if (
        not isinstance(name, str)
        or not (1 <= len(name) <= 128)
        or not set(name) <= NAME_ALPHABET
        or not name.strip(".")
    ):
        raise BadRequest(f"{what} name {str(name)[:130]!r} refused: {NAME_RULE}", code="BAD_NAME")


def _check_weights(executor: PlanExecutor, weights: dict[str, np.ndarray]) -> None:
    expected = {
        name: spec for name, spec in executor.client_update_spec().items() if name in executor.plan.weight_names
    }
    if not expected:
        expected = executor.weight_spec()
    if set(weights) != set(expected):
        raise InvalidCheckpoint(f"the checkpoint holds {sorted(weights)} but the plan's weights are {sorted(expected)}")
    for name, (shape, dtype) in expected.items():
        if tuple(weights[name].shape) != tuple(shape) or weights[name].dtype != np.dtype(dtype):
            raise InvalidCheckpoint(
                f"weight {name!r} is {weights[name].dtype}{list(weights[name].shape)}, the plan needs {np.dtype(dtype)}{list(shape)}"
            )
