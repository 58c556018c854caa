"""The FL server's one entry point between the HTTP shell and the pure round core: populations,
tasks, sessions, aggregation of reports as they arrive, and committing rounds to the database.
``FLService`` holds the lock, the store and the in-memory state (``service_state``) and delegates:
deploy checks to ``deploy``, loading tasks and opening their rounds to ``task_runs``, check-in
answers to ``admission``, report checks to ``reports``, Secure Aggregation to ``secure_driver``, and
closing, committing and late metrics to ``commit``.

Concurrency rules, each from a failure seen under load:
- the service lock guards memory only; no database write happens while it is held, so a slow or
  locked database never freezes check-ins and reports;
- a finished round becomes a pending commit, written outside the lock; only once the write
  succeeded does the new model replace the old one in memory, and a round whose record cannot be
  written is kept and written again until it is on record (``commit``);
- one population runs one round at a time; with several tasks, a strategy picks the next one;
- the clock is read once the lock is held: a check-in that waited while another request closed a
  round and opened its retry is seated in the retry at a time after it opened (read before, its
  report window was short by the wait and its selection dated in the attempt before)."""

from __future__ import annotations

import hmac
import logging
import math
import random
import secrets
import threading
import time
from collections.abc import Callable

import numpy as np
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from device_runtime.attestation import AttestationError, PeerCertificateVerifier, RateLimited
from device_runtime.eligibility import EligibilityPolicies
from device_runtime.versions import version_tuple
from device_runtime.wire import (
    AbortAnswer,
    AttestationChallenge,
    CheckinAccepted,
    CheckinRejected,
    EligibilityInfo,
    ReportAnswer,
    SecAggAccepted,
    TaskStopped,
)

from . import admission, dp_rounds, secure_driver
from .attestation import AttestationVerifier
from .commit import LATE_METRICS_EVERY_S, CommitPipeline
from .deploy import TaskSpec, check_name, new_tasks, stored_before, task_exists
from .errors import (
    ApiError,
    BadRequest,
    Conflict,
    DuplicateReport,
    NotFound,
    ReportLate,
    SessionClosed,
    TooManyRequests,
    Unauthorized,
    did_you_mean,
    quoted,
)
from .pace import MAX_DEFERRALS
from .persistence import PrunedRounds, ServerStore, TaskRecord, store_advice
from .reports import check_report, stats_shape, take_report
from .retention import RESOURCE_GRACE_S, RETENTION_BATCH, RETENTION_EVERY_S, Retention
from .rounds import Phase, ReportVerdict, RoundConfig
from .secagg_limits import SECAGG_SLACK_BYTES, secagg_upload_limit
from .service_state import (
    NO_SESSION,
    Population,
    Session,
    SessionTable,
    TaskRun,
    hash_token,
    population_status,
    task_states,
    urlsafe,
)
from .task_choice import Strategy, choose_task
from .task_runs import load_group, open_round

__all__ = ["LATE_METRICS_EVERY_S", "FLService", "TaskSpec"]

log = logging.getLogger(__name__)

#: How often a database deleted or replaced under the server is said again in the log.
DATABASE_GONE_LOG_EVERY_S = 60.0

#: Resources kept in memory after they were read (the active tasks' plans and checkpoints).
RECENT_RESOURCES = 8

#: How many of a population's tasks a refused task name lists (the rest are counted).
LISTED_TASKS = 5


def _no_task(population: str, task: str, records: list[TaskRecord]) -> NotFound:
    """A task name the population does not have, refused with the one of its tasks closest to it
    (``trian``: ``train``) and the tasks it has, sorted (the first ``LISTED_TASKS`` and a count)."""
    names = sorted({r.name for r in records})
    listed = ", ".join(names[:LISTED_TASKS]) + (
        f" and {len(names) - LISTED_TASKS} more" if len(names) > LISTED_TASKS else ""
    )
    has = f"it has {listed}" if names else "it has no task yet"
    return NotFound(
        f"population {quoted(population)} has no task {quoted(task)}{did_you_mean(task, names)}; {has}",
        code="UNKNOWN_TASK",
    )


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
        retention: Retention | None = None,
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
        seeded by default; a seeded one only where a run must repeat, never in a deployment).
        ``retention``: how much of each task's round history ``tick`` keeps (every record by
        default; ``apply_retention``)."""
        self.store = store
        self.retention = retention or Retention()
        self._retained_at = -math.inf
        self.require_release_reports = require_release_reports
        self.release_trust = frozenset(release_trust)
        self.verifier = verifier
        # the check every member of a Secure Aggregation group makes of its peers' keys, made first
        # by the server at AdvertiseKeys (``SecureRound``)
        self._certifies = (
            PeerCertificateVerifier(verifier.trust_anchor, lambda: self.wall_clock())
            if verifier is not None and verifier.trust_anchor
            else None
        )
        self.clock = clock
        self.wall_clock = wall_clock
        self.rng = rng or random.Random()
        self.secagg_random_bytes = secagg_random_bytes
        self.token_bytes = token_bytes
        self.late_metrics_every_s = late_metrics_every_s
        self.dp_random = dp_random
        self._lock = threading.RLock()
        # Called (from any thread) when some device's Secure Aggregation state may have changed:
        # the HTTP layer wakes its long polls with it.
        self.on_secagg_change: Callable[[], None] | None = None
        # Called (under the lock) with each session a round seats: its id, the task, the round's
        # number and attempt, the round record that counts it among its selected devices. A device
        # is told the round's number only; a fleet simulation credits the session to its attempt.
        self.on_seated: Callable[[str, str, int, int], None] | None = None
        # Called (under the lock) with the sessions a round has just counted as reported: a plain
        # report taken in time, or the masked inputs a Secure Aggregation group summed (a device
        # interrupted after its masked input went in included: its peers' shares recover its masks).
        # A fleet simulation marks their session rows with it, whatever the device saw.
        self.on_reported: Callable[[list[str]], None] | None = None
        self._populations: dict[str, Population] = {}
        self._started_at = clock()  # what a population without a task since the start is idle since
        self._sessions = SessionTable()
        self._commits = CommitPipeline(
            store,
            clock=clock,
            lock=self._lock,
            sessions=self._sessions,
            noise=lambda: self.dp_random(),  # read at each commit: a test may swap the source
            reopen=lambda pop, run: self._open_next(pop, run, self.clock()),
            activate=lambda population: self._activate(population),
        )
        self._late_written_at = -math.inf
        #: Why the database can no longer keep what the server writes (``_check_database``), or None.
        self.database_problem: str | None = None
        self._database_problem_logged_at = -math.inf
        # The last resources read: every selected device downloads the same plan and checkpoint,
        # and resources are content-addressed, so a copy can never go stale.
        self._recent: dict[str, bytes] = {}
        for name in store.population_names():
            self._populations[name] = Population(name)
            self._activate(name)

    # ----------------------------------------------------------------- admin
    def create_population(self, name: str) -> bool:
        check_name(name, "population")
        created = self.store.create_population(name)
        with self._lock:
            self._populations.setdefault(name, Population(name))
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
        refused now, with nothing stored, instead of failing rounds later (``deploy``)."""
        return self.deploy(population, specs, strategy)[0]

    def deploy(
        self, population: str, specs: list[TaskSpec], strategy: Strategy = Strategy.ALTERNATE
    ) -> tuple[list[TaskRecord], bool]:
        """``deploy_tasks``, and whether it stored them: a deploy already stored as it is (sent
        again after its answer was lost) gets the tasks it made, stored once."""
        stored = new_tasks(
            self.store,
            population,
            specs,
            strategy,
            require_release_reports=self.require_release_reports,
            release_trust=self.release_trust,
        )
        if (before := stored_before(self.store, population, stored)) is not None:
            return before, False
        try:
            records = self.store.add_tasks(population, stored)
        except IntegrityError:  # the same names stored meanwhile
            if (before := stored_before(self.store, population, stored)) is not None:
                return before, False
            raise task_exists(population, [s.name for s in specs]) from None
        self._activate(population)
        return records, True

    def stop_task(self, population: str, task: str) -> TaskStopped:
        """Stop the population's task ``task``, active or queued, for good: its open round is
        closed at once without committing (abandoned, ``error`` saying so: its devices get the
        answers of a closed round), it is marked ``stopped`` in one transaction before the answer
        leaves, and what it has on record (rounds, models, privacy ledger) stays, its last
        committed model its final one. The evaluation tasks of its deploy that evaluate it stop
        with it; the other tasks of its deploy go on, and once none is left the next deploy starts.
        ``TASK_STOPPED`` when it is stopped already, ``TASK_NOT_RUNNING`` when it completed, was
        retired or is refused."""
        if self.store.population_id(population) is None:
            raise NotFound(f"population {quoted(population)} does not exist", code="UNKNOWN_POPULATION")
        abandoned: int | None = None
        secure = False
        with self._commits.writing():  # no round's commit is written (nor a task completed) meanwhile
            records = self.store.tasks(population)
            record = next((r for r in records if r.name == task), None)
            if record is None:
                raise _no_task(population, task, records)
            with self._lock:
                pop = self._population(population)
                state = task_states(pop, records)[task]
            said = f"task {quoted(task)} of population {quoted(population)}"
            if state["status"] == "stopped":
                raise Conflict(f"{said} is stopped already", code="TASK_STOPPED")
            if state["status"] not in ("active", "queued"):
                why = {
                    "completed": "it ran its max_rounds (or spent its privacy budget)",
                    "retired": "an operator retired it",
                    "refused": "this server refuses its stored config or plan and does not run it; "
                    f"fedfleet server retire --db DB --population {population} --task {task} retires it",
                }.get(state["status"], "it does not run")
                raise Conflict(
                    f"{said} is {state['status']}, not running: {why}; only an active or queued task is stopped",
                    code="TASK_NOT_RUNNING",
                )
            stopping = [record] + [
                r
                for r in records
                if r.status == "active"
                and r.name not in pop.refused
                and r.config.get("group", {}).get("evaluates") == task
            ]
            self.store.set_tasks_status([r.id for r in stopping], "stopped")  # on record before anything else
            names = [r.name for r in stopping]
            with self._lock:
                now = self.clock()
                self._advance(pop, now)  # a round its deadlines closed already ends as they say
                runs = [r for r in pop.runs if r.record.name in names]
                run = pop.current
                if run is not None and run in runs and run.core is not None and run.core.stop(now):
                    abandoned = run.round_number
                    secure = run.secure is not None
                    self._commits.close(
                        pop, run, run.core, Phase.ABANDONED, now, self.wall_clock(), error="its task was stopped"
                    )
                pop.runs = [r for r in pop.runs if r not in runs]
                if pop.current in runs:
                    pop.current = None
                idle = not pop.runs and not pop.committing
                if idle:
                    pop.opens_at, pop.deferrals = None, 0
        if secure:
            self._secagg_changed()  # its groups' state is final: their long polls answer now
        if idle:  # else the rest of its deploy goes on, or the commit of the round closed here loads the next
            self._activate(population)
        with self._lock:
            running = [r.record.name for r in pop.runs]
        committed = sum(r.status == "committed" for r in self.store.rounds(record.id))
        committed += self.store.pruned_counts(record.id)[1]
        log.info(
            "population %s: task %s stopped by an operator%s; %d committed round(s) on record",
            population,
            " and ".join(names),
            f" (its round {abandoned} abandoned)" if abandoned is not None else "",
            committed,
        )
        return TaskStopped(
            population=population,
            task=task,
            status="stopped",
            stopped=names,
            abandoned_round=abandoned,
            committed_rounds=committed,
            running=running,
        )

    # ----------------------------------------------------------------- device protocol
    def eligibility_info(self, population: str) -> EligibilityInfo:
        """What a device needs to evaluate the active task's policies before it checks in. A
        population that does not exist is answered as one with no task: devices cannot probe
        which names exist (operators list them with ``populations``)."""
        with self._lock:
            pop = self._populations.get(population)
            run = None if pop is None else pop.current or (pop.runs[0] if pop.runs else None)
            if run is None:
                return EligibilityInfo(task=None)
            return EligibilityInfo(
                task=run.record.name,
                round=run.round_number,
                policies=run.eligibility,
                selector=run.plan.device.selector.to_dict(),
            )

    def attestation_challenge(self) -> AttestationChallenge:
        if self.verifier is None:
            raise NotFound("this server does not ask for attestation", code="ATTESTATION_DISABLED")
        return AttestationChallenge.model_validate(self.verifier.nonces.challenge(self.wall_clock()))

    def checkin(
        self, population: str, runtime_version: str, eligibility: dict | None = None, attestation: object = None
    ) -> CheckinAccepted | CheckinRejected:
        """Admit the device to the open round, or tell it when to come back (``admission``)."""
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
            with self._lock:
                now = self.clock()  # once in: a round that opened while it waited is dated after it
                pop = self._populations.get(population)
                if pop is None:  # as a population with no task (see eligibility_info)
                    return admission.no_open_round(None, now, self._started_at)
                self._advance(pop, now)
                pop.checkins.observe_checkin(now)
                pop.rendezvous.observe_checkin(now)
                run = pop.current
                if run is None:
                    return admission.no_open_round(pop, now, self._idle_since(pop))
                plan_id = admission.plan_for(run, device_version, eligibility)
                if isinstance(plan_id, CheckinRejected):
                    return plan_id
                session_id = admission.seat(
                    pop, run, device, now, self._sessions, lambda: urlsafe(self.token_bytes(16))
                )
                if isinstance(session_id, CheckinRejected):
                    return session_id
                assert run.core is not None
                token = urlsafe(self.token_bytes(32))
                self._sessions.add(Session(session_id, hash_token(token), run, run.core, (plan_id, run.broadcast_id)))
                if self.on_seated is not None:
                    self.on_seated(session_id, run.record.name, run.round_number, run.attempt)
                return admission.accepted(run, session_id, token, plan_id)
        finally:
            self._commits.flush()

    def report_limit(self, session_id: str, token: str) -> int:
        """The largest report body the session may send, once its token is checked: asked before
        the body is read, so that a stranger's upload is refused unread."""
        return self._authorize_report(session_id, token).run.report_limit

    def secagg_limit(self, session_id: str, token: str) -> int:
        """The largest Secure Aggregation message the session may send, once its token is checked:
        the largest its group can need (``secagg_limits``); a session in no group of the open round
        has nothing to send, and gets room for a refusal only."""
        session = self._authorize_or_summed(session_id, token)
        if not isinstance(session, Session):
            return SECAGG_SLACK_BYTES  # its last message again (see ``secagg_message``)
        with self._lock:
            run = session.run
            group = (
                run.secure.by_session.get(session_id) if run.secure is not None and session.core is run.core else None
            )
            if group is None:
                return SECAGG_SLACK_BYTES
            config = group.server.config
            return secagg_upload_limit(len(group.members), config.vector_length, config.modulus)

    def report(self, session_id: str, token: str, body: bytes | memoryview, stats: dict | None = None) -> ReportAnswer:
        """Aggregate one device's update; nothing of it is kept apart from the running sum. The
        answer's ``round_status`` says what became of the round as the answer leaves: ``open``
        (it goes on), or, for the report that closed it, ``committed`` (on record with the new
        model) or ``abandoned`` (the update is discarded with the round, e.g. because the
        commit could not be written: a plain "accepted" would have claimed a commit). ``body``: the
        update's bytes, or a view of them (the HTTP app's spool file, mapped: ``reports.BodySpool``)."""
        session = self._authorize_report(session_id, token)
        run = session.run
        checked = check_report(run, body, stats, self.clock() - session.core.started_at)
        shape = checked.shape
        try:
            with self._lock:
                now = self.clock()
                verdict = session.core.report(session_id, now)
                if verdict is ReportVerdict.DUPLICATE:
                    raise DuplicateReport("this session has already reported")
                if verdict is ReportVerdict.LATE:
                    session.core.note_shape(shape and shape + "#")
                    self._commits.note_late(run, session.core)
                    raise ReportLate("the reporting window of this session has closed; the update was discarded")
                if verdict is not ReportVerdict.ACCEPT:
                    raise SessionClosed("this session was aborted or is no longer part of a round")
                take_report(run, checked)
                session.core.note_shape(shape and shape + "^")
                session.core.confirm_report(session_id, now)
                if self.on_reported is not None:
                    self.on_reported([session_id])
                pop = self._populations[run.record.population]
                self._advance(pop, now)
                number = session.core.number
                window = admission.participant_window(pop, run, now)
                closing = self._commits.closing(session.core)  # this report closed it
        finally:
            self._commits.flush()
        round_status = "open"
        if closing is not None:  # its commit has been tried: flush waits for the rounds this call closed
            with self._lock:
                if closing.outcome is not None:
                    round_status = closing.outcome.value
        return ReportAnswer(status="accepted", round=number, round_status=round_status, **window)  # type: ignore[arg-type]

    def abort(self, session_id: str, token: str, reason: str, stats: dict | None = None) -> AbortAnswer:
        """The device stopped: its session is closed and its token revoked (it downloads nothing
        more); its bookkeeping (shape, drop-out) stays with the round. A repeated abort is ignored."""
        session = self._authorize(session_id, token, revoked_ok=True)
        shape = stats_shape(stats)
        try:
            with self._lock:
                if session.revoked:
                    return AbortAnswer(status="ignored")
                session.revoked = True
                now = self.clock()
                aborted = session.core.abort(session_id, now)
                if aborted:
                    session.core.note_shape(shape)
                if session.core is session.run.core and session.run.secure is not None:
                    session.run.secure.leave(session_id, now)
                log.debug("session %s aborted (%s)", session_id, reason)
                self._advance(self._populations[session.run.record.population], now)
                return AbortAnswer(status="aborted" if aborted else "ignored")
        finally:
            self._commits.flush()

    def tick(self) -> None:
        """Let time-based transitions happen even when no device is talking to the server."""
        now = self.clock()
        self._check_database(now)
        with self._lock:
            now = self.clock()
            for pop in list(self._populations.values()):
                self._advance(pop, now)
        self._commits.flush(retry=True)
        if now - self._late_written_at >= self.late_metrics_every_s:
            self._late_written_at = now
            self.write_late_metrics()
        if not self.retention.keeps_everything and now - self._retained_at >= RETENTION_EVERY_S:
            self._retained_at = now
            self.apply_retention()

    def apply_retention(self) -> PrunedRounds:
        """Remove the round records ``retention`` no longer keeps, and the models nothing names any
        more, a batch of ``RETENTION_BATCH`` records per transaction, while no commit is written
        (each batch holds the commits' write turn): what a running task serves, what its open
        sessions may download and its idle record (which grows) are never removed. A database
        that refuses the write is logged in one line, and tried again at the next pass."""
        total = PrunedRounds()
        while True:
            with self._commits.writing():
                live = self._live_resources()
                with self._lock:
                    keep_ids = {r.idle_record.id for p in self._populations.values() for r in p.runs if r.idle_record}
                wall_now = self.wall_clock()
                try:
                    done = self.store.prune_rounds(
                        keep_rounds=self.retention.keep_rounds,
                        ended_before=self.retention.ended_before(wall_now),
                        limit=RETENTION_BATCH,
                        keep_ids=keep_ids,
                        keep_resources=live,
                        resources_before=wall_now - RESOURCE_GRACE_S,
                        private=dp_rounds.spends_privacy,
                        removed_at=wall_now,
                    )
                except (SQLAlchemyError, OSError) as exc:
                    log.error(
                        "retention: the database refused to remove old rounds (%s); tried again in %g s",
                        store_advice(exc),
                        RETENTION_EVERY_S,
                    )
                    break
            total += done
            if done.rounds < RETENTION_BATCH:
                break
        if total.rounds:  # and what was sent of models no longer current, once a pass (it reads every checkpoint)
            with self._commits.writing():
                live = self._live_resources()
                try:
                    count, size = self.store.drop_unnamed_checkpoints(self.wall_clock() - RESOURCE_GRACE_S, live)
                except (SQLAlchemyError, OSError) as exc:
                    log.error("retention: the database refused to remove old checkpoints (%s)", store_advice(exc))
                else:
                    total += PrunedRounds(checkpoints=count, bytes=size)
        if total.rounds:
            log.info(
                "retention: removed %d round record(s) (%d committed) and %d checkpoint(s), plan(s) and release report(s) "
                "nothing names any more, %d bytes",
                total.rounds,
                total.committed,
                total.checkpoints,
                total.bytes,
            )
        return total

    def _check_database(self, now: float) -> None:
        """Whether the database file is still the one the server writes: one deleted or replaced
        under it is logged at once and every ``DATABASE_GONE_LOG_EVERY_S``, and the health check
        answers 503 ``DATABASE_GONE`` until the server is restarted on a database at its path."""
        problem = self.store.gone()
        if problem is not None and (
            self.database_problem is None or now - self._database_problem_logged_at >= DATABASE_GONE_LOG_EVERY_S
        ):
            log.error("%s", problem)
            self._database_problem_logged_at = now
        if problem is not None:
            self.database_problem = problem

    def secagg_status(self, session_id: str, token: str) -> dict:
        """The device's view of its group; after the round closed, its group's final state. A
        session this server no longer knows whose input its task's last committed round holds
        (``_authorize_or_summed``) is told so, as its group's final state said."""
        session = self._authorize_or_summed(session_id, token)
        if not isinstance(session, Session):
            return {"status": "completed", "included": True}
        try:
            with self._lock:
                run = session.run
                now = self.clock()
                pop = self._populations[run.record.population]
                self._advance(pop, now)
                return secure_driver.status(session, pop, run, now)
        finally:
            self._commits.flush()

    def secagg_message(self, session_id: str, token: str, data: bytes) -> SecAggAccepted:
        """A session this server no longer knows whose input its task's last committed round
        holds (``_authorize_or_summed``) sends again the message whose answer it lost when the server
        was killed writing that commit (the message that completed its group): it was taken
        then, and is again, unread."""
        session = self._authorize_or_summed(session_id, token)
        if not isinstance(session, Session):
            return SecAggAccepted(status="accepted")
        try:
            with self._lock:
                now = self.clock()
                secure = session.run.secure
                before = secure.version if secure is not None else 0
                try:  # a refused message may close its group's round too (``SecureGroup.receive``)
                    secure_driver.receive(session, data, now)
                finally:
                    if secure is not None and secure.version != before:
                        self._secagg_changed()
                    self._advance(self._populations[session.run.record.population], now)
                return SecAggAccepted(status="accepted")
        finally:
            self._commits.flush()

    # ----------------------------------------------------------------- queries
    def resource(self, rid: str, token: str | None = None, *, admin: bool = False) -> bytes:
        """A plan or checkpoint by id: an operator may read any; a device only those of the
        session its bearer token belongs to."""
        if len(rid) != 64 or any(c not in "0123456789abcdef" for c in rid):
            raise NotFound(f"no resource with id {quoted(rid)}", code="UNKNOWN_RESOURCE")
        if not admin:
            with self._lock:
                session = self._sessions.by_token.get(hash_token(token)) if token else None
            if session is None or session.revoked:
                raise Unauthorized(
                    "send the token of an open session (or an admin key) as 'Authorization: Bearer <token>' (or X-FL-Token behind a gateway that takes Authorization)",
                    code="MISSING_TOKEN" if not token else "BAD_SESSION_TOKEN",
                )
            if rid not in session.resources:
                raise NotFound(f"no resource with id {quoted(rid)} for this session", code="UNKNOWN_RESOURCE")
        data = self._recent.get(rid)
        if data is None:
            data = self.store.get_resource(rid)
            if data is None:
                raise NotFound(f"no resource with id {quoted(rid)}", code="UNKNOWN_RESOURCE")
            with self._lock:
                if len(self._recent) >= RECENT_RESOURCES:
                    self._recent.pop(next(iter(self._recent)))
                self._recent[rid] = data
        return data

    def rounds(
        self, population: str, task: str | None = None, last: int | None = None, *, published: bool = True
    ) -> list[dict]:
        """Finished rounds, oldest first across the tasks; ``last``: only the newest so many;
        ``published``: as ``round_page`` gives them (False: as on record, for the operator's own use,
        as the fleet simulation's tables, which measure the fleet, are)."""
        return self.round_page(population, task, last, published=published)[0]

    def round_page(
        self,
        population: str,
        task: str | None = None,
        last: int | None = None,
        before: int | None = None,
        *,
        published: bool = True,
    ) -> tuple[list[dict], int | None]:
        """Finished rounds in the order they ran across the tasks, oldest first: the newest ``last``
        (every one with None) of those before the round whose record id is ``before``; and the
        ``before`` that pages back to the older ones (the record id of this page's oldest round),
        None when no older one is on record. The rounds of a task with ``dp.counts="withheld"`` come
        without their counts (``dp_rounds.withhold_counts``) unless ``published`` is False."""
        self.write_late_metrics()
        if self.store.population_id(population) is None:
            raise NotFound(f"population {quoted(population)} does not exist", code="UNKNOWN_POPULATION")
        records = self.store.tasks(population)
        if task is not None and all(r.name != task for r in records):
            raise _no_task(population, task, records)
        names = {r.id: r.name for r in records if task is None or r.name == task}
        page = self.store.round_page(list(names), last, before)
        if page is None:
            raise NotFound(
                f"population {quoted(population)} has no round {before}{f' of task {quoted(task)}' if task else ''} to page back "
                "from: give the before of an earlier answer's Link header",
                code="UNKNOWN_ROUND",
            )
        found, more = page
        withheld = {r.id for r in records if published and dp_rounds.counts_withheld(r.config)}
        return [
            {**r.to_json(), "task": names[r.task_id]}
            | ({"metrics": dp_rounds.withhold_counts(r.metrics)} if r.task_id in withheld else {})
            for r in found
        ], (found[0].id if more else None)

    def population_status(self, population: str, *, published: bool = True) -> dict:
        """The population as an operator sees it: its tasks, the active ones and the open round
        (without its counts for a task with ``dp.counts="withheld"``, unless ``published`` is False:
        the fleet simulation's timeline, which measures the fleet, reads them)."""
        tasks = self.store.tasks(population)
        with self._lock:
            pop = self._population(population)
            status = population_status(pop, tasks, self.clock())
            run = pop.current
        if published and run is not None and dp_rounds.counts_withheld(run.record.config):
            status.pop("current_round", None)  # a DP task's counts tell who takes part: dp.counts "withheld"
        return status

    def task_states(self, population: str) -> dict[str, dict]:
        """Each task's state as an operator sees it: ``active`` (its rounds run), ``queued`` with
        ``queued_behind`` (the running tasks it waits for: a population runs one deploy at a time,
        and a task without ``max_rounds`` never ends), ``completed``, or ``refused`` with its
        ``reason`` (stored by an older server with a config or a plan this one refuses: not run),
        ``retired`` (a refused or stopped task an operator retired, ``task_runs.retire_refused``) or
        ``stopped`` (``stop_task``)."""
        tasks = self.store.tasks(population)
        with self._lock:
            return task_states(self._population(population), tasks)

    def refused_tasks(self) -> list[tuple[str, str]]:
        """Each task on record this server refuses to run, as ``population/task`` and the reason
        (its field, stored value and what to do): said once at start, and in its status."""
        with self._lock:
            return [
                (f"{pop.name}/{task}", reason)
                for pop in self._populations.values()
                for task, reason in pop.refused.items()
            ]

    def current_model(self, population: str, task: str | None = None) -> tuple[bytes, int, str]:
        """The newest global model of a task (by default the population's current training
        task, else its latest one; for an evaluation task, the task it evaluates): bytes, round,
        and the name of the task that trained it."""
        if self.store.population_id(population) is None:
            raise NotFound(f"population {quoted(population)} does not exist", code="UNKNOWN_POPULATION")
        tasks = self.store.tasks(population)
        if not tasks:
            raise NotFound(f"population {quoted(population)} has no task yet", code="NO_TASK")
        if task is not None:
            chosen = next((t for t in tasks if t.name == task), None)
            if chosen is None:
                raise _no_task(population, task, tasks)
            evaluated = chosen.config.get("group", {}).get("evaluates")
            # an evaluation task trains no model: the one it measures is its training task's (its
            # own record holds the initial checkpoint, which its round numbers would have labelled)
            chosen = next((t for t in tasks if t.name == evaluated), chosen)
        else:
            with self._lock:
                pop = self._populations.get(population)
                training = [r.record for r in pop.runs if r.is_training] if pop is not None else []
            chosen = training[0] if training else tasks[-1]
        last = self.store.last_committed_round(chosen.id)
        rid = last.checkpoint_id if last is not None and last.checkpoint_id else chosen.initial_checkpoint_id
        return self.resource(rid, admin=True), (last.number if last else 0), chosen.name

    def write_unwritten(self) -> int:
        """Try every record still waiting for a retry now, whatever its backoff (a server that
        stops: what is not on record when the process ends is lost); how many are left unwritten."""
        return self._commits.write_unwritten()

    def write_late_metrics(self) -> None:
        """Write the metrics late reports changed since the last write (outside the lock); the
        ticker does every ``late_metrics_every_s``, a server that stops does once more."""
        self._commits.write_late_metrics()

    # ----------------------------------------------------------------- internals
    def _live_resources(self) -> set[str]:
        """What the running tasks serve and what their sessions (of open rounds and of the last
        closed ones) may still download: no retention removes it."""
        with self._lock:
            live = {run.broadcast_id for pop in self._populations.values() for run in pop.runs}
            for session in self._sessions.by_id.values():
                live.update(session.resources)
        return live

    def _population(self, name: str) -> Population:
        pop = self._populations.get(name)
        if pop is None:
            raise NotFound(f"population {quoted(name)} does not exist", code="UNKNOWN_POPULATION")
        return pop

    def _idle_since(self, pop: Population) -> float:
        """Since when ``pop`` has had no task (the server's start if never since)."""
        return pop.idle_since if pop.idle_since is not None else self._started_at

    def _authorize(self, session_id: str, token: str, *, revoked_ok: bool = False) -> Session:
        """The session ``token`` opens. An unknown id and a wrong token get one answer, and the
        token is compared in constant time either way, so neither ids nor tokens can be probed.
        A session its device aborted answers ``SESSION_CLOSED`` (unless ``revoked_ok``)."""
        with self._lock:
            session = self._sessions.by_id.get(session_id)
        known = session.token_hash if session is not None else NO_SESSION
        if not hmac.compare_digest(hash_token(token or ""), known) or session is None or not token:
            raise Unauthorized(
                "no session has this id and token; the device must check in again", code="BAD_SESSION_TOKEN"
            )
        if session.revoked and not revoked_ok:
            raise SessionClosed("the device aborted this session; it must check in again")
        return session

    def _authorize_report(self, session_id: str, token: str) -> Session:
        """``_authorize`` for a report: a session this server no longer knows whose update its
        task's last committed round holds (``_authorize_or_summed``) is told its report was taken
        (``DUPLICATE_REPORT``, what a device that sends its report again hears), not that it is
        unknown."""
        session = self._authorize_or_summed(session_id, token)
        if not isinstance(session, Session):
            raise DuplicateReport(f"this session has already reported: its update is in round {session}, committed")
        return session

    def _authorize_or_summed(self, session_id: str, token: str) -> Session | int:
        """``_authorize``, or, for a session this server does not know, the committed round that
        holds its update when that is its task's last (``ServerStore.summed_session``): the server
        was killed once the round was on record and before the session's device heard so.
        ``Unauthorized`` otherwise, as ``_authorize`` raises it."""
        try:
            return self._authorize(session_id, token)
        except Unauthorized:
            if not token:
                raise
            try:
                number = self.store.summed_session(session_id, hash_token(token))
            except (SQLAlchemyError, OSError):  # the answer stays the one it was: the session is unknown
                number = None
            if number is None:
                raise
            return number

    def _activate(self, population: str) -> None:
        """Load the population's first group of active tasks if it has none running. The
        database is read (and written) outside the lock; the result is installed under it."""
        with self._lock:
            pop = self._populations.setdefault(population, Population(population))
            if pop.runs or pop.committing:
                return
        loaded, refused = load_group(self.store, population)
        with self._lock:
            pop.refused = refused
            if pop.runs or pop.committing:
                return
            if loaded is None:  # its tasks completed (or it has none): idle from now on
                if pop.idle_since is None:
                    pop.idle_since = self.clock()
                return
            pop.runs, pop.strategy, pop.turn = loaded
            pop.idle_since = None
            self._start_next(pop, self.clock())

    def _start_next(self, pop: Population, now: float) -> None:
        """Open the next round of the task the population's strategy picks."""
        if not pop.runs:
            pop.current = None
            return
        run = pop.runs[choose_task(pop.strategy, [r.weight for r in pop.runs], pop.turn, self.rng)]
        pop.turn += 1
        pop.rendezvous.watch(now)  # its check-ins are watched from the first selection's opening
        open_round(run, now, self.wall_clock(), self.secagg_random_bytes, self._certifies)
        pop.current = run

    def _open_next(self, pop: Population, run: TaskRun, now: float) -> None:
        """Open the next round now, or, in a small population, once enough devices are expected
        to come to its selection (``Rendezvous.plan``); the devices turned away meanwhile are told
        when it opens."""
        if pop.opens_at is None and not admission.small(pop, run, now):
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

    def _advance(self, pop: Population, now: float) -> None:
        """Let the population's time-based transitions happen (under the lock): a deferred
        selection opens, the open round's Secure Aggregation moves on, a finished round closes."""
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
            secure_driver.advance_secure(run, core, run.secure, now, self.on_reported)
            if run.secure.version != before:
                self._secagg_changed()
        phase = core.advance(now)
        if core.open:
            return
        secure = run.secure is not None
        self._commits.close(pop, run, core, phase, now, self.wall_clock())  # written by the next flush
        if secure:
            self._secagg_changed()  # its groups' state is final

    def _secagg_changed(self) -> None:
        if self.on_secagg_change is not None:
            self.on_secagg_change()
