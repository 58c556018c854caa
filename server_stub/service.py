"""The FL server's logic between the HTTP shell and the pure round core: populations, tasks,
sessions, aggregation of reports as they arrive, and committing rounds to the database."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from device_runtime.attestation import AttestationError, RateLimited
from device_runtime.checkpoint import CheckpointError, decode_checkpoint, encode_checkpoint
from device_runtime.eligibility import EligibilityPolicies
from device_runtime.executor import PlanExecutor
from device_runtime.plan import Plan, PlanError, load_plan
from device_runtime.secure_sum import SecureSumCodec
from device_runtime.versions import version_tuple
from secagg import OutOfOrder, Round, SecAggError, UnexpectedClient

from .attestation import AttestationVerifier
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
from .pace import RoundPace
from .persistence import ServerStore, TaskRecord
from .rounds import Phase, ReportVerdict, RoundConfig, RoundCore, SessionState
from .secure_rounds import SecureRound, SecureSettings

log = logging.getLogger(__name__)

#: How many closed rounds per task keep their session table, so a late report is told it was late.
CLOSED_ROUNDS_KEPT = 4
#: Header and framing allowance on top of the tensors a report must carry.
REPORT_SLACK_BYTES = 64 * 1024
#: Retry window for devices of a population that has nothing to train.
IDLE_RETRY_WINDOW_S = (60.0, 180.0)


def _hash_token(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass
class _Session:
    session_id: str
    token_hash: bytes
    run: "_TaskRun"
    core: RoundCore


@dataclass
class _ClosedRound:
    core: RoundCore
    record_id: int
    metrics: dict
    secure: SecureRound | None = None


@dataclass
class _TaskRun:
    """What the server holds in memory for the task being trained in a population."""

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
    codec: SecureSumCodec | None = None
    secure: SecureRound | None = None
    core: RoundCore | None = None
    pace: RoundPace = field(default_factory=RoundPace)
    started_wall: float = 0.0
    accumulator: dict[str, np.ndarray] | None = None
    closed: list[_ClosedRound] = field(default_factory=list)


class FLService:
    """Thread-safe; every public method takes the lock for as short a time as it can."""

    def __init__(
        self,
        store: ServerStore,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        verifier: AttestationVerifier | None = None,
    ) -> None:
        self.store = store
        self.verifier = verifier
        self.clock = clock
        self.wall_clock = wall_clock
        self._lock = threading.RLock()
        # Called (from any thread) when some device's Secure Aggregation state may have changed:
        # the HTTP layer wakes its long polls with it.
        self.on_secagg_change: Callable[[], None] | None = None
        self._runs: dict[str, _TaskRun | None] = {}
        self._sessions: dict[str, _Session] = {}
        for name in store.population_names():
            self._runs[name] = self._load_run(name)

    # ----------------------------------------------------------------- admin
    def create_population(self, name: str) -> bool:
        _check_name(name, "population")
        with self._lock:
            created = self.store.create_population(name)
            self._runs.setdefault(name, None)
            return created

    def deploy_task(
        self,
        population: str,
        name: str,
        plan_bytes: bytes,
        checkpoint_bytes: bytes,
        config: RoundConfig,
        eligibility: EligibilityPolicies = EligibilityPolicies(),
    ) -> TaskRecord:
        """Validate and store a task; it starts training once no earlier task is active."""
        _check_name(name, "task")
        try:
            plan = load_plan(plan_bytes)
        except PlanError as exc:
            raise InvalidPlan(f"the plan was refused: {exc}") from None
        if plan.kind != "train":
            raise InvalidPlan(f"only training plans can be deployed as tasks; this plan is of kind {plan.kind!r}")
        try:
            weights = decode_checkpoint(checkpoint_bytes)
        except CheckpointError as exc:
            raise InvalidCheckpoint(f"the initial checkpoint was refused: {exc}") from None
        executor = PlanExecutor(plan)
        _check_weights(executor, weights)
        if plan.server.secure_sum:
            try:
                SecureSumCodec(plan, executor)
            except PlanError as exc:
                raise InvalidPlan(f"the plan's secure aggregation is not usable: {exc}") from None
            if config.report_timeout_s <= 3 * config.secagg_round_timeout_s:
                raise BadRequest(
                    f"report_timeout_s ({config.report_timeout_s}) must exceed three secagg_round_timeout_s "
                    f"({config.secagg_round_timeout_s}): the key rounds, training and Unmasking all fit in it",
                    code="BAD_CONFIG",
                )
        with self._lock:
            if self.store.population_id(population) is None:
                raise NotFound(f"population {population!r} does not exist; create it first", code="UNKNOWN_POPULATION")
            if any(t.name == name for t in self.store.tasks(population)):
                raise Conflict(f"population {population!r} already has a task named {name!r}", code="TASK_EXISTS")
            plan_id = self.store.put_resource(plan_bytes, "plan")
            ckpt_id = self.store.put_resource(checkpoint_bytes, "checkpoint")
            stored = {"round": config.to_dict(), "eligibility": eligibility.to_dict()}
            record = self.store.add_task(population, name, plan_id, ckpt_id, stored)
            if self._runs.get(population) is None:
                self._runs[population] = self._load_run(population)
            return record

    # ----------------------------------------------------------------- device protocol
    def eligibility_info(self, population: str) -> dict:
        """What a device needs to evaluate the active task's policies before it checks in."""
        with self._lock:
            if population not in self._runs:
                raise NotFound(f"population {population!r} does not exist", code="UNKNOWN_POPULATION")
            run = self._runs[population]
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
        if self.verifier is not None:
            if attestation is None:
                raise Unauthorized("this server only admits attested devices; send an attestation", code="ATTESTATION_REQUIRED")
            try:
                self.verifier.verify(attestation, population, runtime_version, self.wall_clock())
            except RateLimited as exc:
                raise TooManyRequests(exc.message, code=exc.code, retry_after_s=exc.retry_after_s) from None
            except AttestationError as exc:
                raise ApiError(exc.message, code=exc.code, status=exc.http_status) from None
        now = self.clock()
        with self._lock:
            if population not in self._runs:
                raise NotFound(f"population {population!r} does not exist", code="UNKNOWN_POPULATION")
            run = self._runs[population]
            if run is None:
                return _rejected(IDLE_RETRY_WINDOW_S, "NO_TASK")
            self._advance(run, now)
            run = self._runs[population]
            if run is None:
                return _rejected(IDLE_RETRY_WINDOW_S, "NO_TASK")
            meta = run.plan.metadata
            try:
                device_version = version_tuple(runtime_version)
            except ValueError:
                raise BadRequest(f"runtime_version {runtime_version!r} is not a version like '1.31.1'", code="BAD_RUNTIME_VERSION") from None
            if device_version < version_tuple(meta.min_runtime_version) or (
                meta.max_runtime_version is not None and device_version > version_tuple(meta.max_runtime_version)
            ):
                return _rejected(IDLE_RETRY_WINDOW_S, "RUNTIME_VERSION_UNSUPPORTED")
            if not run.eligibility.empty:
                if not eligibility or eligibility.get("task") != run.record.name:
                    return _rejected(run.config.retry_window_s, "ELIGIBILITY_REQUIRED")
                if not eligibility.get("eligible"):
                    failed = ",".join(str(f) for f in eligibility.get("failed", []))[:200]
                    return _rejected(IDLE_RETRY_WINDOW_S, f"INELIGIBLE:{failed}" if failed else "INELIGIBLE")
            session_id = secrets.token_urlsafe(16)
            if run.core is None or not run.core.try_select(session_id, now):
                started = run.core.started_at if run.core is not None else now
                cap = run.config.selection_timeout_s + run.config.report_timeout_s
                return _rejected(run.pace.retry_window(now, started, run.config.retry_window_s, cap), "ROUND_FULL")
            token = secrets.token_urlsafe(32)
            self._sessions[session_id] = _Session(session_id, _hash_token(token), run, run.core)
            return {
                "status": "accepted",
                "session_id": session_id,
                "token": token,
                "task": run.record.name,
                "round": run.round_number,
                "plan_id": run.record.plan_id,
                "checkpoint_id": run.broadcast_id,
                "aggregation": "secure_sum" if run.plan.server.secure_sum else "simple",
                "report_deadline_s": run.config.report_timeout_s,
                "max_report_bytes": run.report_limit,
            }

    def report_limit(self, session_id: str) -> int:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise NotFound("unknown session; check in again", code="UNKNOWN_SESSION")
            return session.run.report_limit

    def report(self, session_id: str, token: str, body: bytes, shape: str | None = None) -> dict:
        """Aggregate one device's update; nothing of it is kept apart from the running sum."""
        session = self._authorize(session_id, token)
        run = session.run
        if run.codec is not None:
            raise Conflict("this task aggregates with Secure Aggregation; use the session's secagg endpoint", code="SECURE_AGGREGATION_REQUIRED")
        try:
            update = decode_checkpoint(body, max_bytes=run.report_limit)
        except CheckpointError as exc:
            raise InvalidUpdate(f"the report is not a valid checkpoint: {exc}", code="MALFORMED_UPDATE") from None
        try:
            run.executor.validate_update(update)
        except PlanError as exc:
            raise InvalidUpdate(f"the report does not match the plan: {exc}") from None
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
            run.accumulator = run.executor.accumulate(run.accumulator, update)
            session.core.note_shape(shape and shape + "^")
            session.core.confirm_report(session_id, now)
            self._advance(run, now)
            return {"status": "accepted", "round": session.core.number}

    def abort(self, session_id: str, token: str, reason: str, shape: str | None = None) -> dict:
        session = self._authorize(session_id, token)
        with self._lock:
            now = self.clock()
            aborted = session.core.abort(session_id, now)
            if aborted:
                session.core.note_shape(shape)
            if session.core is session.run.core and session.run.secure is not None:
                session.run.secure.leave(session_id, now)
            log.debug("session %s aborted (%s)", session_id, reason)
            self._advance(session.run, now)
            return {"status": "aborted" if aborted else "ignored"}

    def tick(self) -> None:
        """Let time-based transitions happen even when no device is talking to the server."""
        now = self.clock()
        with self._lock:
            for run in list(self._runs.values()):
                if run is not None:
                    self._advance(run, now)

    # ----------------------------------------------------------------- queries
    def resource(self, rid: str) -> bytes:
        if len(rid) != 64 or any(c not in "0123456789abcdef" for c in rid):
            raise NotFound(f"no resource with id {rid!r}", code="UNKNOWN_RESOURCE")
        data = self.store.get_resource(rid)
        if data is None:
            raise NotFound(f"no resource with id {rid!r}", code="UNKNOWN_RESOURCE")
        return data

    def rounds(self, population: str) -> list[dict]:
        if self.store.population_id(population) is None:
            raise NotFound(f"population {population!r} does not exist", code="UNKNOWN_POPULATION")
        out = []
        for task in self.store.tasks(population):
            for record in self.store.rounds(task.id):
                item = record.to_json()
                item["task"] = task.name
                out.append(item)
        return out

    def population_status(self, population: str) -> dict:
        with self._lock:
            if population not in self._runs:
                raise NotFound(f"population {population!r} does not exist", code="UNKNOWN_POPULATION")
            run = self._runs[population]
            tasks = [{"name": t.name, "status": t.status} for t in self.store.tasks(population)]
            if run is None:
                return {"population": population, "active_task": None, "tasks": tasks}
            return {
                "population": population,
                "active_task": run.record.name,
                "round": run.round_number,
                "committed_rounds": run.committed_rounds,
                "phase": run.core.phase.value if run.core else None,
                "current_round": run.core.stats(self.clock()) if run.core else None,
                "checkpoint_id": run.broadcast_id,
                "tasks": tasks,
            }

    def current_model(self, population: str) -> tuple[bytes, int, str]:
        """The newest global model of the population's latest task: bytes, round, task name."""
        if self.store.population_id(population) is None:
            raise NotFound(f"population {population!r} does not exist", code="UNKNOWN_POPULATION")
        tasks = self.store.tasks(population)
        if not tasks:
            raise NotFound(f"population {population!r} has no task yet", code="NO_TASK")
        with self._lock:
            run = self._runs.get(population)
        task = run.record if run is not None else tasks[-1]
        last = self.store.last_committed_round(task.id)
        rid = last.checkpoint_id if last is not None and last.checkpoint_id else task.initial_checkpoint_id
        return self.resource(rid), (last.number if last else 0), task.name

    # ----------------------------------------------------------------- internals
    def _authorize(self, session_id: str, token: str) -> _Session:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise NotFound("unknown session; the device must check in again", code="UNKNOWN_SESSION")
        if not token or not hmac.compare_digest(_hash_token(token), session.token_hash):
            raise Unauthorized("the bearer token does not belong to this session", code="BAD_SESSION_TOKEN")
        return session

    def _load_run(self, population: str) -> _TaskRun | None:
        """Build the in-memory state of the first active task, continuing after its last committed round."""
        for task in self.store.tasks(population):
            if task.status != "active":
                continue
            plan = load_plan(self.store.get_resource(task.plan_id))
            executor = PlanExecutor(plan)
            config = RoundConfig.from_dict(task.config["round"])
            eligibility = EligibilityPolicies.from_dict(task.config["eligibility"])
            history = self.store.rounds(task.id)
            committed = [r for r in history if r.status == "committed"]
            last = committed[-1] if committed else None
            ckpt = self.store.get_resource(last.checkpoint_id if last else task.initial_checkpoint_id)
            state = {k: np.array(v) for k, v in decode_checkpoint(ckpt).items()}
            number = (last.number + 1) if last else 1
            attempt = 1 + sum(1 for r in history if r.number == number)
            if config.max_rounds is not None and len(committed) >= config.max_rounds:
                self.store.set_task_status(task.id, "completed")
                continue
            spec = executor.client_update_spec()
            limit = REPORT_SLACK_BYTES + sum(int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in spec.values())
            run = _TaskRun(
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
                codec=SecureSumCodec(plan, executor) if plan.server.secure_sum else None,
            )
            self._start_round(run, self.clock())
            return run
        return None

    def _start_round(self, run: _TaskRun, now: float) -> None:
        run.core = RoundCore(run.round_number, run.config, now, deadlines_from_selection_end=run.codec is not None)
        if run.codec is not None:
            cfg = run.config
            settings = SecureSettings(cfg.secagg_min_group_size, cfg.secagg_round_timeout_s)
            run.secure = SecureRound(run.codec, settings, f"{run.record.name}/{run.round_number}/{run.attempt}")
        run.accumulator = run.executor.zero()
        run.started_wall = self.wall_clock()

    def _advance(self, run: _TaskRun, now: float) -> None:
        core = run.core
        if core is None:
            return
        if run.secure is not None and core.open:
            before = run.secure.version
            self._advance_secure(run, core, run.secure, now)
            if run.secure.version != before:
                self._secagg_changed()
        phase = core.advance(now)
        if core.open:
            return
        self._finish_round(run, core, phase, now)

    def _advance_secure(self, run: _TaskRun, core: RoundCore, secure: SecureRound, now: float) -> None:
        """Form the groups once selection is over; add each finished group's sum (the Master
        Aggregator), count its summed devices as reported and the rest of the group as dropped,
        so that the round need not wait for their deadlines."""
        core.advance(now)
        if core.phase is Phase.REPORTING and not secure.formed:
            selected = [sid for sid, st in core.sessions.items() if st is SessionState.SELECTED]
            if not secure.form_groups(selected, now, core.deadlines):
                log.info("task %s round %d: %d devices, fewer than a SecAgg group of %d", run.record.name,
                         core.number, len(selected), secure.settings.min_group_size)
                for sid in selected:
                    core.abort(sid, now)
        for group in secure.tick(now):
            summed: list[str] = []
            if group.server.round is Round.COMPLETED:
                total, summed = secure.group_sum(group)
                if core.confirm_group(summed, now):
                    assert run.accumulator is not None
                    run.accumulator = run.executor.accumulate(run.accumulator, total)
            else:
                log.info("task %s round %d: SecAgg group %d aborted: %s", run.record.name, core.number,
                         group.index, group.server.abort_reason)
            for sid in set(group.members) - set(summed):
                core.abort(sid, now)

    def _secagg_changed(self) -> None:
        if self.on_secagg_change is not None:
            self.on_secagg_change()

    def secagg_status(self, session_id: str, token: str) -> dict:
        """The device's view of its group; after the round closed, its group's final state."""
        session = self._authorize(session_id, token)
        with self._lock:
            run = session.run
            self._advance(run, self.clock())
            if session.core is run.core and run.secure is not None:
                now = self.clock()
                state = run.secure.status(session_id)
                state["deadline_in_s"] = round(max(0.0, session.core.deadline_of(session_id) - now), 3)
                return state
            for closed in run.closed:
                if closed.core is session.core and closed.secure is not None:
                    state = closed.secure.status(session_id)
                    # a group still running when its round closed will never finish
                    return state if state["status"] in ("completed", "aborted") else {"status": "closed"}
            return {"status": "closed"}

    def secagg_message(self, session_id: str, token: str, data: bytes) -> dict:
        session = self._authorize(session_id, token)
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
                raise Conflict(f"the group has moved past this message's round: {exc}", code="SECAGG_ROUND_CLOSED") from None
            except SecAggError as exc:
                raise BadRequest(f"the Secure Aggregation message was refused: {exc}", code="SECAGG_REJECTED") from None
            self._advance(run, now)
            return {"status": "accepted"}

    def _finish_round(self, run: _TaskRun, core: RoundCore, phase: Phase, now: float) -> None:
        metrics = core.stats(now)
        metrics["duration_s"] = round(now - core.started_at, 4)
        if run.secure is not None:
            metrics["secagg"] = run.secure.stats()
        run.pace.observe(now - core.started_at)
        checkpoint = None
        if phase is Phase.COMMITTED:
            try:
                aggregate = run.executor.report(run.accumulator)
                new_state, update_metrics = run.executor.update(run.state, aggregate)
                _check_finite(new_state)
            except Exception as exc:  # a plan whose server part fails must not wedge the task
                log.exception("task %s: the plan's server part failed; round %d is abandoned", run.record.name, core.number)
                phase = Phase.ABANDONED
                metrics["error"] = f"{type(exc).__name__}: {exc}"[:300]
            else:
                metrics.update({k: float(v) for k, v in update_metrics.items()})
                run.state = {k: np.array(v) for k, v in new_state.items()}
                checkpoint = encode_checkpoint(run.state)
        record = self.store.record_round(
            run.record.id, core.number, run.attempt, phase.value, metrics, run.started_wall, self.wall_clock(), checkpoint
        )
        run.accumulator = None
        run.closed.append(_ClosedRound(core, record.id, metrics, run.secure))
        if run.secure is not None:
            run.secure = None
            self._secagg_changed()
        del run.closed[:-CLOSED_ROUNDS_KEPT]
        live = {id(c.core) for c in run.closed}
        self._sessions = {sid: s for sid, s in self._sessions.items() if s.run is not run or s.core is run.core or id(s.core) in live}
        if phase is Phase.COMMITTED:
            run.committed_rounds += 1
            run.round_number += 1
            run.attempt = 1
            run.broadcast_id = self.store.put_resource(encode_checkpoint(run.executor.prepare(run.state)), "checkpoint")
            log.info("task %s committed round %d: %s", run.record.name, core.number, metrics)
        else:
            run.attempt += 1
            log.info("task %s abandoned round %d (attempt %d): %s", run.record.name, core.number, run.attempt - 1, metrics)
        if run.config.max_rounds is not None and run.committed_rounds >= run.config.max_rounds:
            self.store.set_task_status(run.record.id, "completed")
            run.core = None
            self._runs[run.record.population] = self._load_run(run.record.population)
            return
        self._start_round(run, now)

    def _note_late(self, run: _TaskRun, core: RoundCore) -> None:
        for closed in run.closed:
            if closed.core is core:
                assert core.ended_at is not None
                closed.metrics.update(core.stats(core.ended_at))
                self.store.update_round_metrics(closed.record_id, closed.metrics)


def _check_finite(state: dict[str, np.ndarray]) -> None:
    bad = [name for name, value in state.items() if not np.all(np.isfinite(value))]
    if bad:
        raise FloatingPointError(f"the new model has non-finite values in {bad}")


def _rejected(window: tuple[float, float], reason: str) -> dict:
    return {"status": "rejected", "reason": reason, "retry_after_s": [float(window[0]), float(window[1])]}


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not (1 <= len(name) <= 128) or not all(c.isalnum() or c in "-_." for c in name):
        raise BadRequest(f"{what} name must be 1-128 characters of letters, digits, '-', '_' or '.'", code="BAD_NAME")


def _check_weights(executor: PlanExecutor, weights: dict[str, np.ndarray]) -> None:
    expected = {name: spec for name, spec in executor.client_update_spec().items() if name in executor.plan.weight_names}
    if set(weights) != set(expected):
        raise InvalidCheckpoint(
            f"the checkpoint holds {sorted(weights)} but the plan's weights are {sorted(expected)}"
        )
    for name, (shape, dtype) in expected.items():
        if tuple(weights[name].shape) != tuple(shape) or weights[name].dtype != np.dtype(dtype):
            raise InvalidCheckpoint(
                f"weight {name!r} is {weights[name].dtype}{list(weights[name].shape)}, the plan needs {np.dtype(dtype)}{list(shape)}"
            )
