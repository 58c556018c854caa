"""Closing and committing rounds: a finished round becomes a pending commit, the plan's server part
runs and the round is written outside the service's lock, and only once the write succeeded does
the new model replace the old one in memory. A failed write abandons the round: nothing is ever
applied twice. Should the abandoned round's record fail to be written too (the database locked past
its busy timeout), it is kept in memory and written again, with backoff, until it is on record: a
round is never lost while the server runs, and the device whose report closed it is told what
became of it. Late reports change closed rounds' metrics, written in batches (``write_late_metrics``).

``run_server_part`` is the pure step (the round's sum in, the new model and metrics out);
``CommitPipeline`` is the shell around the store, on the service's lock and clock."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from sqlalchemy.exc import SQLAlchemyError

from device_runtime.checkpoint import encode_checkpoint

from . import dp_rounds
from .persistence import RoundRecord, ServerStore, resource_id, store_advice
from .rounds import Phase, RoundCore, SessionState
from .service_state import ClosedRound, PendingCommit, Population, SessionTable, TaskRun, UnwrittenRound

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: How many closed rounds per task keep their session table, so a late report is told it was late.
CLOSED_ROUNDS_KEPT = 4
#: Seconds between writes of the metrics late reports change: stragglers trickle in for minutes
#: after their round closed, and each write serializes the round's whole metrics. A crash loses
#: at most this long of late-report counts; the round itself is on record already.
LATE_METRICS_EVERY_S = 30.0
#: Backoff, on the service's clock, between the writes of a round's record that failed: the
#: ticker tries again after this long, then after twice the last wait, up to WRITE_RETRY_MAX_S.
WRITE_RETRY_FIRST_S = 0.5
WRITE_RETRY_MAX_S = 60.0


def close_round(
    pop: Population, run: TaskRun, core: RoundCore, phase: Phase, now: float, wall_now: float, error: str | None = None
) -> PendingCommit:
    """Turn a finished round into a pending commit (under the lock): the round's state leaves
    ``run``, and the population opens no round until the commit is written. ``error``: why the
    round ended short of its outcome (its task was stopped), kept in its metrics."""
    metrics = core.stats(now)
    if error is not None:
        metrics["error"] = error
    metrics["duration_s"] = round(now - core.started_at, 4)
    if run.secure is not None:
        metrics["secagg"] = run.secure.stats(committed=phase is Phase.COMMITTED)
    metrics["device_metrics"] = run.device_metrics.to_json()
    if run.dp is None:  # with DP, which reports were clipped is what adaptive clipping noises
        metrics["bounded_reports"] = dict(run.bounded)
    run.pace.observe(
        now - core.started_at,
        now - (core.selection_ended_at if core.selection_ended_at is not None else core.started_at),
    )
    pending = PendingCommit(
        pop, run, core, phase, metrics, run.accumulator, run.secure, run.started_wall, wall_now, run.dp_round
    )
    run.closed.append(ClosedRound(core, None, metrics, run.secure))
    run.accumulator = None
    run.dp_round = None
    run.core = None
    run.secure = None
    pop.current = None
    pop.committing = True
    return pending


@dataclass
class ServerPart:
    """What the plan's server part made of a closed round: what it became and, for a committed
    training round, the new model and its checkpoints (stored, and as devices download it)."""

    phase: Phase
    new_state: dict[str, np.ndarray] | None = None
    checkpoint: bytes | None = None
    broadcast: bytes | None = None
    next_clip: float | None = None  # adaptive clipping: the next round's clip


def run_server_part(p: PendingCommit, noise: Callable[[], np.random.Generator]) -> ServerPart:
    """Run the plan's server part on the round's sum (central DP noise first, drawn from
    ``noise()``); ``p.metrics`` gets the plan's metrics, or the error that abandons the round. A
    plan whose server part fails must not wedge the task: its round is abandoned."""
    run, metrics = p.run, p.metrics
    if p.phase is not Phase.COMMITTED:
        return ServerPart(p.phase)
    if p.core.reported < run.config.min_reports:
        # Refused at deploy; a task an older server stored may still have such a config.
        metrics["error"] = (
            f"{p.core.reported} report(s), fewer than min_reports ({run.config.min_reports}): "
            "the round publishes nothing"
        )
        return ServerPart(Phase.ABANDONED)
    next_clip: float | None = None
    try:
        assert p.accumulator is not None
        accumulator = p.accumulator
        if p.dp_round is not None:  # the noise, before the plan's server part sees the sum
            accumulator, next_clip = p.dp_round.close(accumulator, run.plan.weight_names, noise())
        aggregate = run.executor.report(accumulator)
        new_state, update_metrics = run.executor.update(run.state, aggregate)
        new_state = {k: np.asarray(v, dtype=np.float32) for k, v in new_state.items()}
        _check_finite(new_state)
    except Exception as exc:
        log.exception("task %s: the plan's server part failed; round %d is abandoned", run.label, p.core.number)
        metrics["error"] = f"{type(exc).__name__}: {exc}"[:300]
        return ServerPart(Phase.ABANDONED)
    if run.dp is None:  # with DP, the plan's loss and accuracy are exact sums of devices' data: withheld
        metrics.update(_finite_metrics(update_metrics))
    if not run.is_training:
        metrics["evaluated_checkpoint_id"] = run.broadcast_id
        return ServerPart(Phase.COMMITTED, new_state, next_clip=next_clip)
    checkpoint = encode_checkpoint(new_state)
    broadcast = encode_checkpoint(run.executor.prepare(new_state))
    return ServerPart(Phase.COMMITTED, new_state, checkpoint, broadcast, next_clip)


def write_quietly(write: Callable[..., _T], *args: object) -> _T | None:
    """A database write whose failure is logged, not raised (its caller has a fallback)."""
    try:
        return write(*args)
    except (SQLAlchemyError, OSError) as exc:
        log.error("a database write failed: %s", store_advice(exc))
        return None


class _ClosedHere(threading.local):
    """The commits the current thread's call created; None in a thread that closed none (read at
    every device call's end, where a missing attribute's lookup raised and caught an error)."""

    commits: list[PendingCommit] | None = None


class CommitPipeline:
    """The closed rounds on their way to the store, and the records and late metrics still to
    write. It shares the service's ``lock`` (memory only: no write happens while it is held) and
    ``clock``; ``noise`` is the service's DP noise source, ``reopen`` opens a population's next
    round (under the lock) and ``activate`` loads its next deploy once its tasks are done."""

    def __init__(
        self,
        store: ServerStore,
        *,
        clock: Callable[[], float],
        lock: threading.RLock,
        sessions: SessionTable,
        noise: Callable[[], np.random.Generator],
        reopen: Callable[[Population, TaskRun], None],
        activate: Callable[[str], None],
    ) -> None:
        self.store = store
        self.clock = clock
        self._lock = lock
        self._sessions = sessions
        self._noise = noise
        self._reopen = reopen
        self._activate = activate
        self._write_lock = threading.Lock()
        self.pending: list[PendingCommit] = []
        self.unwritten: list[UnwrittenRound] = []  # closed rounds not yet on record, oldest first
        #: closed rounds' metrics changed by late reports, by round record id: written every
        #: ``late_metrics_every_s`` and on a read of the rounds, once per round however many came
        #: (with the task's label)
        self.late_due: dict[int, tuple[ClosedRound, str]] = {}
        self._closed_here = _ClosedHere()  # commits the current thread's call created

    def close(
        self,
        pop: Population,
        run: TaskRun,
        core: RoundCore,
        phase: Phase,
        now: float,
        wall_now: float,
        error: str | None = None,
    ) -> None:
        """``close_round``, queued for ``flush`` (under the lock); the calling thread's ``flush``
        waits for it."""
        pending = close_round(pop, run, core, phase, now, wall_now, error)
        self.pending.append(pending)
        if self._closed_here.commits is None:
            self._closed_here.commits = []
        self._closed_here.commits.append(pending)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the commits' write turn: no round's record is written, and no model replaces
        another in memory, until the block ends (what the service reads of its live models in it
        stays true). The commits queued meanwhile are written as it ends: their threads, which
        found the turn taken, wait for them, and would otherwise wait for the next tick."""
        with self._write_lock:
            yield
        self.flush(others=True)

    def closing(self, core: RoundCore) -> PendingCommit | None:
        """The pending commit of the round ``core`` ran, if it is still waiting (under the lock)."""
        return next((p for p in self.pending if p.core is core), None)

    def flush(self, *, retry: bool = False, others: bool = False) -> None:
        """Write pending commits, outside the service lock. One thread writes at a time; a thread
        that finds another writing leaves the work to it. A call that closed a round returns only
        once that round's commit was tried (by whichever thread): the round is on record, or was
        abandoned and its record waits for a retry; so the device whose report completed a round,
        or a test, learns its outcome. A call that closed nothing returns at once, writing nothing:
        a device's answer never waits for another device's commit, which the thread that closed it
        writes (it calls ``flush`` too). With ``retry`` (the ticker), records whose backoff is over
        are written again first; ``retry`` and ``others`` write what others closed."""
        if not (retry or others or self._closed_here.commits):
            return
        while True:
            with self._lock:
                if not self.pending and not (retry and self._due_unwritten()):
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
                        if not self.pending:
                            break
                        pending = self.pending.pop(0)
                        earlier = [u for u in self.unwritten if u.run is pending.run]
                    try:
                        self._write_unwritten(earlier)  # a task's records go on record in the order they ended
                        self._commit(pending)
                    finally:
                        pending.written.set()
            finally:
                self._write_lock.release()
        closed = self._closed_here.commits
        if closed:
            self._closed_here.commits = []
            for pending in closed:
                pending.written.wait()

    def _commit(self, p: PendingCommit) -> None:
        run, metrics, attempt = p.run, p.metrics, p.run.attempt
        part = run_server_part(p, self._noise)
        phase = part.phase
        if p.secure is not None and phase is not p.phase:  # its server part abandoned it: no sum was used
            metrics["secagg"] = p.secure.stats(committed=False)
        ledger_after = None
        if run.dp is not None and dp_rounds.spends_privacy(phase.value, metrics):
            # committed, or abandoned once the server had unmasked a group's noisy sum (distributed DP)
            dp_metrics, ledger_after = run.dp.round_metrics(p.dp_round.clip if p.dp_round is not None else None)
            metrics.update(dp_metrics)
            if part.next_clip is not None:
                metrics[dp_rounds.NEXT_CLIP_KEY] = part.next_clip

        summed = self._summed(p) if phase is Phase.COMMITTED else []

        def write(status: str, *resources: bytes | None) -> RoundRecord:
            return self.store.record_round(
                run.record.id,
                p.core.number,
                attempt,
                status,
                metrics,
                p.started_wall,
                p.ended_wall,
                *resources,
                summed=summed if status == Phase.COMMITTED.value else (),
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
            extended = write_quietly(self.store.extend_round, first.id, grown, p.ended_wall)
        record: RoundRecord | None = extended
        try:
            if extended is None:
                record = write(phase.value, part.checkpoint, part.broadcast)
        except (SQLAlchemyError, OSError) as exc:
            log.error(
                "task %s round %d: the database write failed (%s); the round is abandoned",
                run.label,
                p.core.number,
                store_advice(exc),
            )
            was_commit = phase is Phase.COMMITTED
            phase = Phase.ABANDONED
            metrics["error"] = f"database write failed: {type(exc).__name__}"
            if p.secure is not None:
                metrics["secagg"] = p.secure.stats(committed=False)
            record = write_quietly(write, phase.value)
            if was_commit and record is not None and record.status == Phase.COMMITTED.value:
                # the failed write had gone through after all (the retry found it): the round committed
                phase = Phase.COMMITTED
                metrics.pop("error")
                if p.secure is not None:
                    metrics["secagg"] = p.secure.stats()
            elif record is None:
                with self._lock:
                    self.unwritten.append(
                        UnwrittenRound(
                            run,
                            p.core,
                            attempt,
                            phase.value,
                            metrics,
                            p.started_wall,
                            p.ended_wall,
                            next_try_at=self.clock() + WRITE_RETRY_FIRST_S,
                            population=p.population,
                        )
                    )
                log.error(
                    "task %s round %d attempt %d: its record is kept in memory and written again until on record",
                    run.label,
                    p.core.number,
                    attempt,
                )
        record_id = record.id if record is not None else None
        record_key = (record.task_id, record.number, record.attempt) if record is not None else None
        dp_after = None
        if not dp_rounds.spends_privacy(phase.value, metrics):
            dp_rounds.strip(metrics)  # an abandoned round that released nothing spends no privacy
        elif run.dp is not None and ledger_after is not None:
            dp_after = run.dp.after_commit(ledger_after, part.next_clip if phase is Phase.COMMITTED else None)
        completes = (
            phase is Phase.COMMITTED
            and run.config.max_rounds is not None
            and run.committed_rounds + 1 >= run.config.max_rounds
        ) or (dp_after is not None and not dp_after.allows_next())  # the budget would not take one more round
        with self._lock:  # a task stopped meanwhile (``FLService.stop_task``) is stopped, not completed
            completes = completes and run in p.population.runs
        finished = [run] + [r for r in p.population.runs if r.evaluates is run] if completes else []
        for done in finished:
            write_quietly(self.store.set_task_status, done.record.id, "completed")
        with self._lock:
            p.outcome = phase
            for closed in run.closed:
                if closed.core is p.core:
                    closed.record_id, closed.record_key = record_id, record_key
            del run.closed[:-CLOSED_ROUNDS_KEPT]
            self._sessions.forget_closed(run)
            run.dp = dp_after if dp_after is not None else run.dp
            if phase is Phase.COMMITTED:
                if run.is_training and part.new_state is not None and part.broadcast is not None:
                    run.state = part.new_state
                    run.broadcast_id = resource_id(part.broadcast)
                run.committed_rounds += 1
                run.round_number += 1
                run.attempt = 1
                log.info("task %s committed round %d: %s", run.label, p.core.number, _brief(metrics))
            elif extended is not None:
                # an idle spell is said at info as it doubles (2, 4, 8, ... timeouts), not once a timeout
                timeouts = extended.metrics["idle_timeouts"]
                log.log(
                    logging.INFO if timeouts & (timeouts - 1) == 0 else logging.DEBUG,
                    "task %s round %d attempt %d: nobody came again (%d selection timeouts in a row)",
                    run.label,
                    p.core.number,
                    extended.attempt,
                    timeouts,
                )
            else:
                run.attempt += 1
                log.info(
                    "task %s abandoned round %d (attempt %d): %s: %s",
                    run.label,
                    p.core.number,
                    run.attempt - 1,
                    _why_abandoned(metrics, run.config.commit_threshold),
                    _brief(metrics),
                )
            run.idle_record = (extended or record) if idle else None
            pop = p.population
            pop.runs = [r for r in pop.runs if r not in finished]
            pop.committing = False
            if pop.runs and record is None:
                # the database refuses writes: no round opens (its devices would train for a commit
                # it refuses too) until this record is on record (``_write_unwritten``)
                pop.held = run if run in pop.runs else pop.runs[0]
                log.error("population %s: its next round opens once the database takes writes again", pop.name)
            elif pop.runs:
                self._reopen(pop, run if run in pop.runs else pop.runs[0])
        if not pop.runs:
            self._activate(pop.name)

    def _summed(self, p: PendingCommit) -> list[tuple[str, bytes]]:
        """The sessions (id, token hash) whose updates the committed round ``p`` holds, kept with
        its record: a device that asks after a restart is told its update is in it."""
        with self._lock:
            if p.secure is not None:
                ids = p.secure.summed_sessions()
            else:
                ids = [sid for sid, state in p.core.sessions.items() if state is SessionState.REPORTED]
            known = self._sessions.by_id
            return [(sid, known[sid].token_hash) for sid in ids if sid in known]

    def _due_unwritten(self) -> list[UnwrittenRound]:
        """Records whose backoff is over (under the lock)."""
        if not self.unwritten:
            return []
        now = self.clock()
        return [u for u in self.unwritten if u.next_try_at <= now]

    def _write_unwritten(self, todo: list[UnwrittenRound]) -> None:
        """Write again records that failed to be written (outside the lock; the caller holds the
        write lock). One still failing waits twice as long as last time before the next try."""
        for u in todo:
            with self._lock:
                assert u.core.ended_at is not None
                u.metrics.update(u.core.stats(u.core.ended_at))  # with the late reports counted so far
                metrics = dict(u.metrics)
            # Overwriting: the outcome in memory is what devices were told and the next round
            # started from, even if a commit write that "failed" had gone through after all.
            record = write_quietly(
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
                self.unwritten.remove(u)
                for closed in u.run.closed:
                    if closed.core is u.core:
                        closed.record_id, closed.record_key = record.id, (record.task_id, record.number, record.attempt)
                if u.core.late_reports:
                    self.note_late(u.run, u.core)  # late reports that came after the copy above
                pop = u.population
                held = pop.held if pop is not None else None
                if pop is not None and held is not None and not any(o.population is pop for o in self.unwritten):
                    pop.held = None
                    if pop.current is None and not pop.committing and pop.runs:
                        self._reopen(pop, held if held in pop.runs else pop.runs[0])
            log.info(
                "task %s round %d attempt %d is on record after %d tries",
                u.run.label,
                u.core.number,
                u.attempt,
                u.tries + 1,
            )

    def note_late(self, run: TaskRun, core: RoundCore) -> None:
        """A closed round's metrics updated with a late report, due to be written (under the lock)."""
        for closed in run.closed:
            if closed.core is core and closed.record_id is not None:
                assert core.ended_at is not None
                closed.metrics.update(core.stats(core.ended_at))
                self.late_due[closed.record_id] = (closed, run.label)  # its metrics copied once, when written
                return

    def write_unwritten(self) -> int:
        """Try every record still waiting for a retry now, whatever its backoff (a server that
        stops: what is not on record when the process ends is lost); how many are left unwritten."""
        with self._write_lock:
            with self._lock:
                todo = list(self.unwritten)
            self._write_unwritten(todo)
            with self._lock:
                left = len(self.unwritten)
        if left:
            log.error("%d round record(s) could not be written before the server stopped; they are lost", left)
        return left

    def write_late_metrics(self) -> None:
        """Write the metrics late reports changed since the last write (outside the lock); the
        ticker does every ``late_metrics_every_s``, a server that stops does once more."""
        with self._lock:
            due = {rid: (c, c.record_key, label, dict(c.metrics)) for rid, (c, label) in self.late_due.items()}
            self.late_due = {}
        for record_id, (closed, key, label, metrics) in due.items():
            written = write_quietly(self.store.update_round_metrics, record_id, metrics, key)
            if written is False and key is not None:  # logged once: its later late reports are not noted
                with self._lock:
                    if closed.record_id == record_id:
                        closed.record_id = None
                log.info(
                    "%s: the late reports of round %d (attempt %d), %s in all, are not recorded: retention removed "
                    "its record",
                    label,
                    key[1],
                    key[2],
                    metrics.get("rejected_late"),
                )


def _check_finite(state: dict[str, np.ndarray]) -> None:
    bad = [name for name, value in state.items() if not np.all(np.isfinite(value))]
    if bad:
        raise FloatingPointError(f"the new model has non-finite values in {bad}")


def _finite_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Only finite metrics are stored: a NaN or infinity would poison every later read."""
    return {k: float(v) for k, v in metrics.items() if np.isfinite(v)}


def _why_abandoned(metrics: dict, threshold: int) -> str:
    """Why a round was abandoned, as the log says it: its error, or too few reports."""
    if metrics.get("error"):
        return str(metrics["error"])
    return (
        f"{metrics.get('reported', 0)} report(s) of the {threshold} it needs "
        f"({metrics.get('selected', 0)} selected, {metrics.get('dropped', 0)} dropped) by its timeouts"
    )


def _brief(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k not in ("device_metrics", "shapes")}
