"""Scheduling participation under device conditions (paper, section 3; Android's federated
compute scheduling).

Jobs live in APScheduler's persistent SQLAlchemy job store inside the app's SQLite database, so
they survive an app restart (an emulated device keeps them in memory, to the same microsecond).
Due times are computed from the runtime's Clock rather than the wall clock, so the same code runs
a real app and a device emulated in virtual time. All apps of one
device share one WorkerQueue: never two training sessions at once, populations served in a fair
(least recently run first) order. A job that saw its constraints unmet checks in again only once
they have held for a quiet period (``SchedulerSettings.settle_s``): conditions that flap do not
take a seat at each return."""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
import pickle
import random
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

try:  # POSIX advisory locks: a lock is released when its process ends, however it ends
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

from apscheduler.job import Job
from apscheduler.jobstores.base import JobLookupError
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.triggers.date import DateTrigger
from apscheduler.util import datetime_to_utc_timestamp
from sqlalchemy import and_, select
from sqlalchemy.exc import SQLAlchemyError

from example_store.spelling import closest
from example_store.sqlite_engine import sqlite_engine, write_locked

from .clock import Clock, SystemClock, check_clock
from .conditions import DeviceConditions, TrainingConstraints, TrainingInterval
from .errors import InvalidSetting, RuntimeSdkError, SessionRejected, check_count, check_number, check_path
from .executor import stoppable_run_options
from .opstats import AppDatabaseError, SessionSummary, app_database_errors, took_part
from .runtime import FLRuntime, Outcome, SessionResult

log = logging.getLogger(__name__)

JOB_TABLE = "fl_participation_jobs"
#: A change of the wall clock against the monotonic one past this is the clock being set: the due
#: times of a running app's jobs move with it (see ``WorkerQueue.follow_clock``).
CLOCK_JUMP_S = 1.0
#: How often a worker looks again while another process of its app runs one of the app's jobs.
OTHER_PROCESS_POLL_S = 1.0


class RunOutcome(enum.Enum):
    """What one run of a scheduled job did (``JobRun.outcome``): a session ``COMPLETED``,
    ``REPORT_REJECTED`` or ``INTERRUPTED`` (as ``Outcome``); ``NOT_SELECTED`` (the server turned
    the device away: the job comes back in its retry window); ``CONSTRAINTS_UNMET`` (not idle,
    charging or on Wi-Fi: ``JobRun.detail`` names which); ``NO_RUNTIME`` (no ``register_runtime``
    for the population at this app start); ``ERROR`` (``JobRun.detail`` says which error)."""

    COMPLETED = "completed"
    REPORT_REJECTED = "report_rejected"
    INTERRUPTED = "interrupted"
    NOT_SELECTED = "not_selected"
    CONSTRAINTS_UNMET = "constraints_unmet"
    NO_RUNTIME = "no_runtime"
    ERROR = "error"


@dataclass(frozen=True)
class JobRun:
    """What one due job did, and when it runs next (None: the job is done)."""

    app: str
    population: str
    outcome: RunOutcome
    started_at: float
    ended_at: float
    next_run_at: float | None
    detail: str = ""
    session: SessionResult | None = None


#: ``ScheduledJob.settle``: the job saw its constraints unmet since it last checked in; its next
#: run that finds them holding starts a quiet period (``SchedulerSettings.settle_s``) instead.
UNSETTLED = "unmet"
#: ``ScheduledJob.settle``: the job's next run ends a quiet period over which its constraints held.
SETTLING = "settling"


@dataclass(frozen=True)
class ScheduledJob:
    """A population's participation as the scheduler keeps it (``schedule``'s result, and
    ``jobs()``): when it next runs (None: a one-time job that is done), under which constraints
    and how often."""

    population: str
    next_run_at: float | None
    constraints: TrainingConstraints
    interval: TrainingInterval
    #: "" (the job checks in when its constraints hold), ``UNSETTLED`` or ``SETTLING``.
    settle: str = ""
    #: When a session of the job started that the job was not rescheduled after: the app was
    #: stopped (killed) during that run. Kept by stored jobs only (see ``ParticipationScheduler``).
    running: float | None = None


@dataclass(frozen=True)
class SchedulerSettings:
    """Timing of the checks. The abort bound is ``poll_s + grace_s`` plus one training step.

    ``watchdog``: a thread polls the conditions while a session runs, and can stop a training
    step in flight. Where one driver owns a virtual clock (a simulation) there is no other thread
    to poll: the conditions are checked between steps and between protocol phases only."""

    poll_s: float = 0.25
    grace_s: float = 1.0
    recheck_s: float = 300.0
    jitter: float = 0.2
    watchdog: bool = True
    #: The least a job waits after its check-in was turned away, whatever window the server named:
    #: a server that named (0, 0) had the device check in again at once, for ever.
    min_retry_s: float = 1.0
    #: How long a job's constraints must hold again, once it saw them unmet (at a run, or a session
    #: that stopped because they did), before it checks in: conditions that flap (a loose charger,
    #: the screen on and off) took a seat at each return and dropped it at the next change. They
    #: are looked at when they come back and ``settle_s`` later (and in between where the conditions
    #: tell when they next stop holding, ``first_unsatisfied``); 0 checks in as soon as they hold.
    settle_s: float = 60.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if name == "watchdog":
                if not isinstance(value, bool):
                    raise InvalidSetting(f"SchedulerSettings.watchdog is True or False, not {value!r:.100}")
            else:  # a negative poll_s had the watchdog spin on a core for the whole session
                check_number(f"SchedulerSettings.{name}", value, unit="a fraction" if name == "jitter" else "seconds")


def run_participation(
    population: str,
    constraints: dict,
    interval: dict,
    scheduler: ParticipationScheduler | None = None,
    settle: str = "",
    running: float | None = None,
) -> JobRun:
    """The function every stored job names: one participation attempt, run by the app's scheduler
    (which reads the job's constraints and interval from the store)."""
    if scheduler is None:
        raise RuntimeError("participation jobs run through a ParticipationScheduler")
    return scheduler.run_job(population)


class _StoreHost:
    """What APScheduler's job store expects of its scheduler: a time zone."""

    timezone = UTC


def _to_dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def to_microsecond(ts: float) -> float:
    """``ts`` as a stored job keeps it: to the microsecond, rounded half to even (what
    ``_to_dt(ts).timestamp()`` gives, without the datetime)."""
    frac, whole = math.modf(ts)
    return (int(whole) * 1_000_000 + round(frac * 1e6)) / 1_000_000


@contextlib.contextmanager
def _job_errors(database: str | os.PathLike, action: str) -> Iterator[None]:
    """``app_database_errors``, and a stored job this version cannot read as one line saying what to
    do: another version's job was a TypeError out of the scheduler, or deleted unsaid."""
    with app_database_errors(database, action):
        try:
            yield
        except _UnreadableJob as exc:
            raise AppDatabaseError(
                f"could not {action} in the app's database {os.fspath(database)}: the job of {exc.job_id!r} was stored "
                f"by another fedfleet version, which this one cannot read ({exc.reason}); run that version, or "
                f"schedule (or cancel) {exc.job_id!r} with this one to replace it; it is left as it is"
            ) from None


class _UnreadableJob(Exception):
    """A stored job this version cannot read back (``_JobStore``): its id, and why."""

    def __init__(self, job_id: str, reason: str) -> None:
        super().__init__(job_id, reason)
        self.job_id, self.reason = job_id, reason


class _JobStore(SQLAlchemyJobStore):
    """APScheduler's SQLAlchemy job store, where a job that cannot be read back (one another
    fedfleet version stored) is refused as the jobs are listed, not deleted: APScheduler's own
    removed it with a logged traceback, and an app that ran an earlier version over a newer one's
    database lost the schedule without a word. The worker's look for due jobs passes over it
    (``_StoredJobs.runnable``), left where it is, so that the app's other jobs still run."""

    def _get_jobs(self, *conditions: Any) -> list[Job]:
        jobs, unreadable = self.read_jobs(*conditions)
        if unreadable:
            raise unreadable[0]
        return jobs

    def read_jobs(self, *conditions: Any) -> tuple[list[Job], list[_UnreadableJob]]:
        query = select(self.jobs_t.c.id, self.jobs_t.c.job_state).order_by(self.jobs_t.c.next_run_time)
        if conditions:
            query = query.where(and_(*conditions))
        jobs, unreadable = [], []
        with self.engine.begin() as conn:
            for job_id, state in conn.execute(query):
                try:
                    jobs.append(self._reconstitute_job(state))
                except Exception as exc:
                    unreadable.append(_UnreadableJob(job_id, f"{type(exc).__name__}: {exc}"))
        return jobs, unreadable


class _StoredJobs:
    """The app's jobs in APScheduler's SQLAlchemy job store, inside its SQLite database."""

    def __init__(self, database: str | os.PathLike, app: str) -> None:
        # the app database's engine (WAL, and a writer waits 30 s for another process's lock as
        # the example store and opstats do): with its own, a job was not rescheduled after a
        # session when an add of the app held the lock past 5 s, and ran again at the next poll
        self._store = _JobStore(engine=sqlite_engine(database, private=True), tablename=JOB_TABLE)
        try:
            with app_database_errors(database, "open the scheduled jobs"):
                with write_locked(self._store.engine) as conn:  # not raced by another process's first open
                    self._store.jobs_t.create(conn, checkfirst=True)
                self._store.start(_StoreHost(), app)
        except BaseException:
            self._store.engine.dispose()
            raise
        self._app = app
        self._database = database
        self._passed_over: set[str] = set()  # the jobs ``_runnable`` said it cannot read
        self._run_lock = _open_run_lock(database)
        self._run_lock_guard = threading.Lock()
        self._run_lock_held = False  # by a job of this process: ``close`` leaves the lock to its end

    def _db(self, action: str) -> contextlib.AbstractContextManager[None]:
        """SQLite's errors while ``action`` as an ``AppDatabaseError`` that says what to do (a full
        disk: free space and retry), as opstats' are: APScheduler's job store let SQLAlchemy's
        ``OperationalError`` reach the app from ``schedule``, ``cancel`` and a job's run."""
        return _job_errors(self._database, action)

    def close(self) -> None:
        self._store.shutdown()
        with self._run_lock_guard:
            if self._run_lock is not None and not self._run_lock_held:
                os.close(self._run_lock)
            self._run_lock = None  # a job that holds it closes it as it ends (``run_lock``)

    @contextlib.contextmanager
    def run_lock(self) -> Iterator[bool]:
        """Whether this process holds the app's run lock (``flock`` on a file beside its database,
        freed when its holder's process ends however it ends), held until the block ends; False
        while another process of the app runs one of its jobs. Two processes of one app (the app
        and its background service) each ran a due job: the device took part twice in one round."""
        with self._run_lock_guard:
            fd = self._run_lock
            if fd is not None and fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    fd = -1
                else:
                    self._run_lock_held = True
        if fd is None or fcntl is None:
            yield True
            return
        if fd == -1:
            yield False
            return
        try:
            yield True
        finally:
            # a ``close`` meanwhile left the descriptor to this job: closing it under the job had
            # let another process of the app run the job beside it, and unlocked a closed descriptor
            with self._run_lock_guard:
                self._run_lock_held = False
                if self._run_lock is None:
                    os.close(fd)
                else:
                    fcntl.flock(fd, fcntl.LOCK_UN)

    def put(self, job: ScheduledJob) -> None:
        """Store ``job``, replacing the population's earlier one."""
        with self._db("store a scheduled job"):
            assert job.next_run_at is not None
            at = _to_dt(job.next_run_at)
            stored = Job(
                _StoreHost(),
                id=job.population,
                func=f"{__name__}:run_participation",
                args=(job.population,),
                # flat frozen dataclasses: their fields as a plain dict (what asdict gives, without its deep copy)
                kwargs={
                    "constraints": dict(vars(job.constraints)),
                    "interval": dict(vars(job.interval)),
                    "settle": job.settle,
                    **({} if job.running is None else {"running": job.running}),
                },
                trigger=DateTrigger(at, timezone=UTC),
                executor="default",
                name=f"{self._app}:{job.population}",
                misfire_grace_time=None,
                coalesce=True,
                max_instances=1,
                next_run_time=at,
            )
            # replaced in one statement: removed and added again in two transactions, an app killed
            # between them lost the job it was rescheduling
            try:
                self._store.update_job(stored)
            except JobLookupError:
                self._store.add_job(stored)

    def get(self, population: str) -> ScheduledJob | None:
        with self._db("read a scheduled job"):
            stored = self._lookup(population)
            return None if stored is None else self._view(stored)

    def remove(self, population: str) -> bool:
        with self._db("remove a scheduled job"):
            try:
                self._store.remove_job(population)  # without reading it: one another version stored goes too
            except JobLookupError:
                return False
            return True

    def reschedule(self, population: str, at: float, settle: str | None = None, *, ran: bool = False) -> None:
        """``ran``: after the job's session, whose ``running`` mark it drops."""
        with self._db("reschedule a job"):
            stored = self._lookup(population)
            if stored is not None:  # not cancelled meanwhile
                if settle is not None or ran:
                    kwargs = {k: v for k, v in stored.kwargs.items() if not (ran and k == "running")}
                    stored._modify(
                        next_run_time=_to_dt(at), kwargs=kwargs if settle is None else {**kwargs, "settle": settle}
                    )
                else:
                    stored._modify(next_run_time=_to_dt(at))
                self._store.update_job(stored)

    def mark_running(self, population: str, at: float) -> None:
        """Before the job's session: a session started at ``at``, until the job is rescheduled
        after it (``ran``), so that an app killed in between knows the run it was stopped in."""
        with self._db("mark a job's run"):
            stored = self._lookup(population)
            if stored is not None:
                stored._modify(kwargs={**stored.kwargs, "running": at})
                self._store.update_job(stored)

    def running_mark(self, population: str) -> float | None:
        """The job's ``running`` mark, read from a job whose other fields may not be (one an earlier
        version stored differently, which scheduling again replaces)."""
        with self._db("read a scheduled job"):
            try:
                stored = self._lookup(population)
            except _UnreadableJob:
                return None  # another version's job, which scheduling again replaces
            running = None if stored is None else stored.kwargs.get("running")
            return float(running) if isinstance(running, (int, float)) else None

    def shift(self, seconds: float, skip: str | None) -> None:
        """Move every job's due time by ``seconds`` (but ``skip``'s) in one transaction: job by job,
        an app killed partway kept some jobs on the old clock and the others on the new one."""
        store = self._store
        with self._db("move the due times of the jobs"):
            # another version's jobs stay as they are (``_runnable``): refused, they stopped every pass
            jobs = [j for j in store.read_jobs()[0] if j.next_run_time is not None and j.id != skip]
            with store.engine.begin() as conn:
                for job in jobs:
                    job._modify(next_run_time=_to_dt(job.next_run_time.timestamp() + seconds))
                    conn.execute(  # what the store's update_job writes, in this transaction
                        store.jobs_t.update()
                        .values(
                            next_run_time=datetime_to_utc_timestamp(job.next_run_time),
                            job_state=pickle.dumps(job.__getstate__(), store.pickle_protocol),
                        )
                        .where(store.jobs_t.c.id == job.id)
                    )

    def due(self, now: float) -> list[tuple[float, str]]:
        with self._db("read the due jobs"):
            due = self._store.jobs_t.c.next_run_time <= datetime_to_utc_timestamp(_to_dt(now))
            return [(j.next_run_time.timestamp(), j.id) for j in self._runnable(due)]

    def next_run_at(self) -> float | None:
        with self._db("read the next due time"):  # of a job that runs: another version's would wake the worker at once
            times = [j.next_run_time for j in self._runnable(self._store.jobs_t.c.next_run_time.isnot(None))]
            return min(times).timestamp() if times else None

    def _runnable(self, condition: Any) -> list[Job]:
        """The jobs of ``condition`` this version can read and run, saying once in the log which it
        cannot (another version's, left as they are): one such job (of a population only a later
        version of the app schedules) failed every pass of the worker, and no job of any app ran."""
        jobs, unreadable = self._store.read_jobs(condition)
        runnable = []
        for job in jobs:
            try:
                self._view(job)
                runnable.append(job)
            except _UnreadableJob as exc:
                unreadable.append(exc)
        for bad in unreadable:
            if bad.job_id not in self._passed_over:
                self._passed_over.add(bad.job_id)
                log.warning(
                    "the job of %r in the app's database %s was stored by another fedfleet version, which this one "
                    "cannot read (%s); it is left as it is and does not run: schedule (or cancel) %r to replace it",
                    bad.job_id,
                    os.fspath(self._database),
                    bad.reason,
                    bad.job_id,
                )
        return runnable

    def all(self) -> list[ScheduledJob]:
        with self._db("read the scheduled jobs"):
            return [self._view(j) for j in self._store.get_all_jobs()]

    def _lookup(self, population: str) -> Job | None:
        try:
            return self._store.lookup_job(population)
        except SQLAlchemyError:
            raise
        except Exception as exc:  # unpickled: APScheduler's own checks, a class or field another version has
            raise _UnreadableJob(population, f"{type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _view(job: Job) -> ScheduledJob:
        try:
            return ScheduledJob(
                job.id,
                job.next_run_time.timestamp() if job.next_run_time else None,
                TrainingConstraints(**job.kwargs["constraints"]),
                TrainingInterval(**job.kwargs["interval"]),
                job.kwargs.get("settle", ""),  # a job stored before quiet periods has none
                job.kwargs.get("running"),
            )
        except (TypeError, KeyError, ValueError, AttributeError) as exc:  # a field another version has, or lacks
            raise _UnreadableJob(job.id, f"{type(exc).__name__}: {exc}") from exc


class _MemoryJobs:
    """The app's jobs in memory, kept to the microsecond as the stored ones are, so a device runs
    the same with either."""

    def __init__(self) -> None:
        self._jobs: dict[str, ScheduledJob] = {}

    def close(self) -> None:
        self._jobs.clear()

    def put(self, job: ScheduledJob) -> None:
        assert job.next_run_at is not None
        self._jobs[job.population] = ScheduledJob(
            job.population, to_microsecond(job.next_run_at), job.constraints, job.interval, job.settle
        )

    def get(self, population: str) -> ScheduledJob | None:
        return self._jobs.get(population)

    def remove(self, population: str) -> bool:
        return self._jobs.pop(population, None) is not None

    def reschedule(self, population: str, at: float, settle: str | None = None, *, ran: bool = False) -> None:
        job = self._jobs.get(population)
        if job is not None:
            self._jobs[population] = ScheduledJob(
                population, to_microsecond(at), job.constraints, job.interval, job.settle if settle is None else settle
            )

    def mark_running(self, population: str, at: float) -> None:
        """Nothing: jobs in memory do not outlive the app that would be killed during their run."""

    def running_mark(self, population: str) -> float | None:
        return None

    def shift(self, seconds: float, skip: str | None) -> None:
        for job in list(self._jobs.values()):
            if job.next_run_at is not None and job.population != skip:
                self.reschedule(job.population, job.next_run_at + seconds)

    @contextlib.contextmanager
    def run_lock(self) -> Iterator[bool]:
        yield True  # jobs in memory belong to this process alone

    def due(self, now: float) -> list[tuple[float, str]]:
        now = to_microsecond(now)
        return sorted(
            (j.next_run_at, j.population)
            for j in self._jobs.values()
            if j.next_run_at is not None and j.next_run_at <= now
        )

    def next_run_at(self) -> float | None:
        return min((j.next_run_at for j in self._jobs.values()), default=None)  # type: ignore[type-var]

    def all(self) -> list[ScheduledJob]:
        return sorted(self._jobs.values(), key=lambda j: (j.next_run_at, j.population))


def _both_system(one: Clock, other: Clock) -> bool:
    """Whether two clocks both read the system's time (two ``SystemClock()`` read the same)."""
    return type(one) is SystemClock and type(other) is SystemClock


class ParticipationScheduler:
    """One per app: the populations it takes part in, their constraints and intervals.

    ``database``: the app's SQLite file, where jobs survive a restart; None keeps them in memory
    (an emulated device in a simulation, where a job store's five transactions per run were most
    of the scheduler's cost). The app's processes on one ``database`` (the app and its background
    service) run its jobs one at a time: a job's run holds a lock on a file beside it
    (``app.db.run.lock``, freed when its process ends, however it ends), and a worker that finds it
    held leaves the due job and looks again a second later (``claim``). ``clock``: its ``queue``'s when left out (the system's without a
    queue); one that is not the queue's is refused, as the queue's worker reads due times on its
    own. Conditions that can tell when they next change
    (``next_change(now) -> float | None``, times on the scheduler's clock) wake a job
    whose constraints are unmet at that moment, as Android's JobScheduler does, instead of
    re-checking every ``recheck_s``. Conditions that know their future (a simulation, a replayed
    trace) may also tell when given constraints next hold (``next_satisfied(constraints, now) ->
    float | None``): the job then sleeps until that moment, past every change that leaves them
    unmet, as JobScheduler runs a job only once all its constraints hold. Conditions that can
    tell it from a later moment on (``first_satisfied(constraints, at, now) -> float | None``)
    also let a job that reschedules itself sleep past its due time until they hold, instead of
    waking when due to find them unmet; and those that tell when they next stop holding
    (``first_unsatisfied(constraints, now) -> float | None``) spare a session run without a
    watchdog reading them between every two training steps until then."""

    def __init__(
        self,
        database: str | os.PathLike | None,
        conditions: DeviceConditions,
        *,
        app: str = "app",
        clock: Clock | None = None,
        queue: WorkerQueue | None = None,
        settings: SchedulerSettings = SchedulerSettings(),
        rng: random.Random | None = None,
    ) -> None:
        if database is not None:
            check_path("database", database)
        if not isinstance(app, str) or not app:
            raise InvalidSetting(f"app is a non-empty name such as 'mail', not {app!r:.100}")
        if clock is not None:
            check_clock("clock", clock)
        if queue is not None and not isinstance(queue, WorkerQueue):
            raise InvalidSetting(f"queue is the device's WorkerQueue or None, not {type(queue).__name__}")
        if not isinstance(settings, SchedulerSettings):
            raise InvalidSetting(f"settings is a SchedulerSettings, not {type(settings).__name__} {settings!r:.100}")
        if not callable(getattr(conditions, "current", None)):
            raise InvalidSetting(
                f"conditions must have a current() method giving the device's DeviceState (StaticConditions, or "
                f"the app's own), got {type(conditions).__name__}"
            )
        self.app = app
        self.database = database
        self.conditions = conditions
        if clock is None:  # the queue's: due times read on the system clock would never come on a VirtualClock
            clock = queue.clock if queue is not None else SystemClock()
        elif queue is not None and clock is not queue.clock and not _both_system(clock, queue.clock):
            raise InvalidSetting(
                f"clock {clock!r:.100} is not the clock of the queue {queue.clock!r:.100}: its worker reads due "
                f"times on its own clock; pass clock=queue.clock, or leave clock out to follow the queue's"
            )
        self.clock = clock
        self.settings = settings
        self.rng = rng or random.Random()
        self._runtimes: dict[str, FLRuntime] = {}
        self._jobs: _MemoryJobs | _StoredJobs = _MemoryJobs() if database is None else _StoredJobs(database, app)
        self._lock = threading.RLock()
        self.queue = queue or WorkerQueue(self.clock)
        self.queue.add(self)
        self._closed = False

    def close(self) -> None:
        """Leaves the worker queue and closes the job store (the jobs stay in the database for
        the next app start); idempotent. Stop the queue first: a session in progress is then
        interrupted (``WorkerQueue.stop``)."""
        if self._closed:
            return
        self._closed = True
        self.queue.remove(self)
        self._jobs.close()

    def __repr__(self) -> str:
        where = "in memory" if self.database is None else repr(os.fspath(self.database))
        return (
            f"ParticipationScheduler(app={self.app!r}, {where}, runtimes={sorted(self._runtimes)!r}"
            f"{', closed' if self._closed else ''})"
        )

    def __enter__(self) -> ParticipationScheduler:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise AppDatabaseError(f"the participation scheduler of app {self.app!r} is closed; make a new one")

    # ----------------------------------------------------------------- app API
    def register_runtime(self, population: str, runtime: FLRuntime) -> None:
        """Called at every app start: which runtime serves a population's stored job."""
        self._check_open()
        _check_population(population)
        if not isinstance(runtime, FLRuntime):
            raise InvalidSetting(f"register_runtime takes an FLRuntime, got {type(runtime).__name__}")
        if runtime.population != population:  # the job of one population would train another's plans
            raise InvalidSetting(
                f"register_runtime({population!r}, ...) was given the runtime of population {runtime.population!r}; "
                f"register each runtime under its own population: register_runtime(runtime.population, runtime)"
            )
        self._runtimes[population] = runtime

    def schedule(
        self,
        population: str,
        constraints: TrainingConstraints = TrainingConstraints(),
        interval: TrainingInterval = TrainingInterval(),
        *,
        start_at: float | None = None,
    ) -> ScheduledJob:
        """Take part in ``population``; replaces an earlier schedule of the same population (but
        not the mark of a run the app was killed in: see ``run_job``). The
        first run is at ``start_at`` (now by default), or once the constraints hold after it when
        the conditions can tell (``first_satisfied``). Arguments of the wrong type are refused
        with ``InvalidSetting`` before anything is stored (a job that cannot be read back would
        fail every run of the app's worker)."""
        self._check_open()
        self.queue.follow_clock()  # the jobs stored so far first, if the clock was set since
        _check_population(population)
        if not isinstance(constraints, TrainingConstraints) or not isinstance(interval, TrainingInterval):
            raise InvalidSetting(
                f"schedule(population, constraints, interval) takes a TrainingConstraints and a TrainingInterval, "
                f"got {type(constraints).__name__} and {type(interval).__name__}"
            )
        if start_at is not None:  # 2**2000 failed with an OverflowError
            check_number("start_at", start_at, signed=True, unit="seconds on the scheduler's clock (or None)")
        now = self.clock.now()
        first = self._when_constraints_hold(now, now if start_at is None else start_at, constraints)
        with self._lock:
            # the mark of a run the app was killed in stays with the new schedule: replaced, it left
            # an app that schedules at each start (the sample app) to train and report again a
            # session that took part before the kill
            running = self._jobs.running_mark(population)
            self._jobs.put(ScheduledJob(population, first, constraints, interval, running=running))
            job = self._jobs.get(population)
        self.queue.wake()
        assert job is not None
        return job

    def cancel(self, population: str) -> bool:
        self._check_open()
        with self._lock:
            return self._jobs.remove(population)

    def shift_jobs(self, seconds: float, *, skip: str | None = None) -> None:
        """Move every job's due time by ``seconds`` (but ``skip``'s): the wall clock was set."""
        with self._lock:
            self._jobs.shift(seconds, skip)

    def jobs(self) -> list[ScheduledJob]:
        self._check_open()
        with self._lock:
            return self._jobs.all()

    # ----------------------------------------------------------------- driven by the WorkerQueue
    @contextlib.contextmanager
    def claim(self, population: str) -> Iterator[str]:
        """The right to run ``population``'s job now, across the app's processes: "run", held until
        the block ends; "busy" while another process of the app runs one of its jobs; "done" when
        the job is no longer due (another process ran it while this one looked). Only this job is
        read: reading every due job at each claim made a worker's pass over n due jobs read n²/2
        of them (2,000 jobs took a minute, most of it unpickling jobs it did not run)."""
        with self._jobs.run_lock() as held:
            if not held:
                yield "busy"
                return
            now = to_microsecond(self.clock.now())  # as ``due`` compares, to the microsecond
            with self._lock:
                job = self._jobs.get(population)
            yield "run" if job is not None and job.next_run_at is not None and job.next_run_at <= now else "done"

    def due(self, now: float) -> list[tuple[float, str]]:
        with self._lock:
            return self._jobs.due(now)

    def next_run_at(self) -> float | None:
        with self._lock:
            return self._jobs.next_run_at()

    def run_job(self, population: str) -> JobRun:
        """One attempt: check the constraints, run a session under a watchdog, reschedule."""
        started = self.clock.now()
        with self._lock:
            job = self._jobs.get(population)
        if job is None:
            return JobRun(self.app, population, RunOutcome.ERROR, started, started, None, "job was cancelled")
        constraints, interval = job.constraints, job.interval
        runtime = self._runtimes.get(population)
        if job.running is not None and runtime is not None:
            took_part = _took_part_since(runtime, job.running)
            if took_part is not None:
                return self._ran_before_a_stop(job, started, took_part)
        unmet = constraints.unmet(self.conditions.current())
        if not unmet and job.settle == UNSETTLED and self.settings.settle_s > 0:
            return self._settle(job, started)
        settle = UNSETTLED if unmet else ""
        session: SessionResult | None = None
        detail = ""
        server_delay = 0.0  # a delay drawn in the server's retry window, taken as it is
        if unmet:
            outcome, delay, detail = RunOutcome.CONSTRAINTS_UNMET, self.settings.recheck_s, ",".join(unmet)
        elif runtime is None:
            meant = closest(population, self._runtimes)  # the population scheduled misspelt
            hint = f" (runtimes are registered for {sorted(self._runtimes)}: did you mean {meant!r}?)" if meant else ""
            outcome, delay, detail = (
                RunOutcome.NO_RUNTIME,
                self.settings.recheck_s,
                f"no runtime registered for it{hint}",
            )
        else:
            broke: list[bool] = []  # the session stopped because the constraints stopped holding
            with self._lock:
                self._jobs.mark_running(population, started)
            try:
                session = self._run_watched(runtime, constraints, broke)
            except SessionRejected as rejected:
                outcome, delay, detail = RunOutcome.NOT_SELECTED, 0.0, rejected.reason
                server_delay = max(runtime.next_retry_delay(), self.settings.min_retry_s)
            except Exception as exc:  # an error ends the session, never the job: it is rescheduled
                if not isinstance(exc, RuntimeSdkError):
                    log.warning("the %s session failed unexpectedly", population, exc_info=True)
                outcome, delay, detail = RunOutcome.ERROR, self.settings.recheck_s, f"{type(exc).__name__}: {exc}"
                if isinstance(exc, RuntimeSdkError) and exc.retryable:
                    # the same call may succeed later with nothing changed (the server down or busy,
                    # a round closed mid-session): back inside the server's retry window, as a
                    # turned-away check-in; an error that needs a fix waits the recheck
                    delay, server_delay = 0.0, max(runtime.next_retry_delay(), self.settings.min_retry_s)
            else:
                outcome = RunOutcome(session.outcome.value)
                if outcome is RunOutcome.INTERRUPTED:
                    delay = self.settings.recheck_s
                    settle = UNSETTLED if broke else ""
                else:
                    delay = interval.min_interval_s if interval.recurrent else self.settings.recheck_s
                    if interval.recurrent and session.retry_after_s is not None:
                        # the server's pace steering: never sooner than the app's own interval
                        server_delay = runtime.next_retry_delay()
        ended = self.clock.now()
        done = session is not None and session.outcome is Outcome.COMPLETED and not interval.recurrent
        # The scheduler jitters its own delays; a delay drawn in the server's retry window is
        # already spread as the server wants it (pace steering aims a window at the next round's
        # selection: stretched by a fifth, the devices it gathers would miss it), and is kept.
        next_at = (
            None if done else ended + max(delay * (1.0 + self.rng.uniform(0.0, self.settings.jitter)), server_delay)
        )
        if next_at is not None:
            if unmet:
                next_at = self._when_conditions_change(ended, next_at, constraints)
            else:
                next_at = self._when_constraints_hold(ended, next_at, constraints)
        with self._lock:
            if next_at is None:
                self._jobs.remove(population)
            else:
                self._jobs.reschedule(population, next_at, settle, ran=True)  # unless cancelled meanwhile
        return JobRun(self.app, population, outcome, started, ended, next_at, detail, session)

    def _ran_before_a_stop(self, job: ScheduledJob, now: float, took_part: SessionSummary) -> JobRun:
        """The app was stopped after the session of the job's last run took part (its update sent)
        and before the job was rescheduled: that run is finished as a completed one, the job done
        or due an interval after the session, instead of training and reporting again at once."""
        interval = job.interval
        next_at = None
        if interval.recurrent:
            delay = interval.min_interval_s * (1.0 + self.rng.uniform(0.0, self.settings.jitter))
            next_at = self._when_constraints_hold(now, max(now, took_part.started_at + delay), job.constraints)
        with self._lock:
            if next_at is None:
                self._jobs.remove(job.population)
            else:
                self._jobs.reschedule(job.population, next_at, "", ran=True)
        detail = (
            f"the app was stopped after this job's session of {took_part.started_at:.0f} took part "
            f"({took_part.shape}): not run again"
        )
        return JobRun(self.app, job.population, RunOutcome.COMPLETED, now, now, next_at, detail)

    def _settle(self, job: ScheduledJob, now: float) -> JobRun:
        """The constraints hold again after the job saw them unmet: no check-in yet, a quiet
        period of ``settle_s`` first, at whose end the job checks in if they still hold. Where the
        conditions tell when they next stop holding (``first_unsatisfied``) before its end, the job
        wakes then instead, to find them unmet and wait for their return again."""
        end = now + self.settings.settle_s
        first_unsatisfied = getattr(self.conditions, "first_unsatisfied", None)
        stop = first_unsatisfied(job.constraints, now) if first_unsatisfied is not None else None
        if stop is not None and float(stop) < end:
            # a hair after they stop (due times are kept to the microsecond): the look finds them so
            next_at, settle = max(now, float(stop) + 1e-6), UNSETTLED
        else:
            next_at, settle = end, SETTLING
        with self._lock:
            self._jobs.reschedule(job.population, next_at, settle)
        detail = f"settling: the constraints hold again; checking in after {self.settings.settle_s:g} s of them"
        return JobRun(self.app, job.population, RunOutcome.CONSTRAINTS_UNMET, now, now, next_at, detail)

    def _when_conditions_change(self, now: float, fallback: float, constraints: TrainingConstraints) -> float:
        """The next moment ``constraints`` hold, or else the next moment the device's conditions
        change, as far as the conditions can tell; ``fallback`` when they cannot."""
        next_satisfied = getattr(self.conditions, "next_satisfied", None)
        if next_satisfied is not None:
            when = next_satisfied(constraints, now)
        else:
            next_change = getattr(self.conditions, "next_change", None)
            if next_change is None:
                return fallback
            when = next_change(now)
        return fallback if when is None else max(now, float(when))

    def _when_constraints_hold(self, now: float, at: float, constraints: TrainingConstraints) -> float:
        """The first moment from ``at`` on at which ``constraints`` hold, for conditions that know
        their future (``first_satisfied``); ``at`` itself for those that do not, or when the
        constraints never hold again (the job then runs at ``at`` and finds them unmet)."""
        first_satisfied = getattr(self.conditions, "first_satisfied", None)
        if first_satisfied is None:
            return at
        when = first_satisfied(constraints, at, now)
        return at if when is None else max(at, float(when))

    def _broken(self, constraints: TrainingConstraints, broke: list[bool] | None) -> Callable[[], bool]:
        """Whether ``constraints`` no longer hold, read now; noted in ``broke`` when they do not."""
        conditions = self.conditions

        def unmet() -> bool:
            if constraints.satisfied(conditions.current()):
                return False
            if broke is not None:
                broke.append(True)
            return True

        return unmet

    def _unmet_check(self, constraints: TrainingConstraints, broke: list[bool] | None = None) -> Callable[[], bool]:
        """The per-step check of a session run without a watchdog: whether ``constraints`` no
        longer hold. Conditions that know their future (``first_unsatisfied(constraints, now) ->
        float | None``, the first moment after ``now`` at which they stop holding) are read once
        and then only when the clock reaches that moment, where the check reads them again (it
        gives what reading them at every step gives: before that moment they hold)."""
        conditions = self.conditions
        unmet = self._broken(constraints, broke)
        first_unsatisfied = getattr(conditions, "first_unsatisfied", None)
        if first_unsatisfied is None:
            return unmet
        clock = self.clock
        holds_before = -math.inf  # the conditions hold while the clock reads less than this

        def check() -> bool:
            nonlocal holds_before
            now = clock.now()
            if now < holds_before:
                return False
            if unmet():
                return True
            stop = first_unsatisfied(constraints, now)
            holds_before = math.inf if stop is None else float(stop)
            return False

        return check

    def _run_watched(self, runtime: FLRuntime, constraints: TrainingConstraints, broke: list[bool]) -> SessionResult:
        """Run a session while a watchdog polls the conditions: when they stop holding it asks the
        session to stop (checked between steps) and, after the grace period, ends the running
        step by force through onnxruntime's terminate flag. ``broke`` is appended to when the
        constraints were found not to hold."""
        stopping = self.queue.stopping
        if not self.settings.watchdog:
            unmet = self._unmet_check(constraints, broke)
            return runtime.run_session(should_abort=lambda: stopping.is_set() or unmet())
        stop = threading.Event()
        done = threading.Event()
        run_options = stoppable_run_options()

        unmet = self._broken(constraints, broke)
        failed: list[Exception] = []  # the app's conditions raised in the watchdog

        def watchdog() -> None:
            while not done.wait(self.settings.poll_s):
                try:
                    ending = stopping.is_set() or unmet()
                except Exception as exc:  # the session ends in the app's error, as without a watchdog
                    failed.append(exc)
                    ending = True
                if ending:
                    stop.set()
                    if not done.wait(self.settings.grace_s):
                        run_options.terminate = True
                    return

        def should_abort() -> bool:
            if failed:
                raise failed[0]
            return stop.is_set() or stopping.is_set() or unmet()

        thread = threading.Thread(target=watchdog, name="fl-watchdog", daemon=True)
        thread.start()
        try:
            session = runtime.run_session(should_abort=should_abort, run_options=run_options)
        finally:
            done.set()
            thread.join()
        if failed and session.outcome is Outcome.INTERRUPTED:  # its step stopped by force: the app's error
            raise failed[0]
        return session


def _took_part_since(runtime: FLRuntime, since: float) -> SessionSummary | None:
    """The newest session of ``runtime``'s population since ``since`` that took part (its update
    sent, ``^`` or ``+``, or perhaps taken before its answer was lost: ``opstats.took_part``), as
    its opstats log keeps them; None without one."""
    sessions = getattr(runtime.opstats, "sessions", None)
    if sessions is None:  # no log (or the emulator's): nothing to tell, the run is run again
        return None
    took = [s for s in sessions(runtime.population, since=since) if took_part(s.events[-1])]
    return took[-1] if took else None


def _open_run_lock(database: str | os.PathLike) -> int | None:
    """The descriptor of the app's run lock file, beside the database its path leads to (a
    symbolic link's target's); None where it cannot be made (a read-only folder: no lock, as before)."""
    if fcntl is None or str(database) == ":memory:":
        return None
    try:
        return os.open(os.path.realpath(database) + ".run.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None


def _check_population(population: object) -> None:
    if not isinstance(population, str) or not population:
        raise InvalidSetting(f"a population is a non-empty string such as 'digits', not {population!r}")


class WorkerQueue:
    """The device's single training worker, shared by all its apps' schedulers."""

    #: Past job runs a queue keeps by default: an app's worker runs for months, and it kept every
    #: run with its session's events (one every ``min_retry_s`` under a server that turns it away).
    HISTORY = 1000

    def __init__(self, clock: Clock | None = None, *, idle_poll_s: float = 60.0, history: int | None = HISTORY) -> None:
        """``history``: how many past job runs ``history`` keeps, the last ones (``HISTORY`` by
        default, all with None; a simulated device that runs for days keeps none)."""
        if clock is not None:  # time.time (RuntimeEnvironment's kind of clock) failed at the first run
            check_clock("WorkerQueue's clock", clock)
        self.clock = clock or SystemClock()
        # a negative one had the worker poll without pause whenever no job was due
        self.idle_poll_s = check_number("WorkerQueue.idle_poll_s", idle_poll_s, positive=True)
        if history is not None:
            check_count("WorkerQueue.history", history)
        self._schedulers: list[ParticipationScheduler] = []
        self._last_run: dict[tuple[str, str], float] = {}
        self._worker = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        #: Set by ``stop``: a session in progress is interrupted as when its conditions stop holding.
        self.stopping = self._stop
        self._thread: threading.Thread | None = None
        self.history: deque[JobRun] = deque(maxlen=history)
        #: The app's callback, given each job run as it ends (in the worker's thread); one that
        #: raises is logged, and the jobs due after it still run.
        self.on_run: Callable[[JobRun], None] | None = None
        self._read_offset: Callable[[], float] | None = getattr(self.clock, "wall_offset", None)
        self._offset: float | None = None
        self._offset_lock = threading.Lock()
        #: Whether the last ``run_pending`` left a due job to another process of its app.
        self._busy_elsewhere = False

    def __repr__(self) -> str:
        apps = sorted({s.app for s in list(self._schedulers)})
        state = "running" if self._thread is not None else "stopped"
        return f"WorkerQueue({self.clock!r}, apps={apps!r}, {state}, {len(self.history)} runs in history)"

    def follow_clock(self, skip: tuple[ParticipationScheduler, str] | None = None) -> float:
        """On a clock that tells its ``wall_offset`` (``SystemClock``): when the wall clock was
        set since the last call (a user who moves it back a day, or a year ahead), move every
        job's due time by as much, so that jobs keep their delays in elapsed time as Android's
        JobScheduler does, instead of waiting a day longer or all running at once. ``skip``: a
        job rescheduled on the new clock already. Returns the jump followed (0.0: none). A jump
        while the app was not running is not seen."""
        if self._read_offset is None:
            return 0.0
        with self._offset_lock:
            before, self._offset = self._offset, self._read_offset()
            if before is None or abs(self._offset - before) <= CLOCK_JUMP_S:
                return 0.0
            jump = self._offset - before
            log.info("the wall clock was set %+.0f s: the due times of the jobs move with it", jump)
            for scheduler in list(self._schedulers):
                scheduler.shift_jobs(jump, skip=skip[1] if skip is not None and skip[0] is scheduler else None)
            return jump

    def add(self, scheduler: ParticipationScheduler) -> None:
        self._schedulers.append(scheduler)
        self.wake()

    def remove(self, scheduler: ParticipationScheduler) -> None:
        if scheduler in self._schedulers:
            self._schedulers.remove(scheduler)

    def wake(self) -> None:
        self._wake.set()

    def next_wakeup(self) -> float | None:
        times = [t for t in (s.next_run_at() for s in list(self._schedulers)) if t is not None]
        return min(times) if times else None

    def run_pending(self) -> list[JobRun]:
        """Run every job due now, one at a time, least recently run population first."""
        runs = []
        with self._worker:
            self.follow_clock()
            now = self.clock.now()
            due = [(s, when, pop) for s in list(self._schedulers) for when, pop in s.due(now)]
            due.sort(key=lambda item: (self._last_run.get((item[0].app, item[2]), float("-inf")), item[1]))
            self._busy_elsewhere = False
            for scheduler, _, population in due:
                if self._stop.is_set():  # the app is stopping: no new session
                    break
                with scheduler.claim(population) as claim:  # not while another process of the app runs a job
                    self._busy_elsewhere |= claim == "busy"
                    if claim != "run":
                        continue
                    run = scheduler.run_job(population)
                self.follow_clock(skip=(scheduler, population))  # a clock set while it ran
                self._last_run[(scheduler.app, population)] = run.ended_at
                self.history.append(run)
                if self.on_run is not None:
                    try:
                        self.on_run(run)
                    except Exception:  # the app's callback: the jobs due after this one still run now
                        log.exception(
                            "the app's WorkerQueue.on_run failed on the %s run; the worker goes on", population
                        )
                runs.append(run)
        return runs

    def run_until(self, end: float) -> list[JobRun]:
        """Drive a VirtualClock: jump from one due time to the next until ``end``."""
        advance_to = getattr(self.clock, "advance_to", None)
        if advance_to is None:
            raise InvalidSetting(
                "run_until drives virtual time: it needs a queue on a VirtualClock (WorkerQueue(VirtualClock())); "
                "on the system's clock, run the worker with start()"
            )
        end = check_number("run_until's end", end, signed=True, unit="seconds on the queue's clock")
        runs: list[JobRun] = []
        while True:
            nxt = self.next_wakeup()
            if nxt is None or nxt > end:
                advance_to(end)
                return runs
            advance_to(nxt)
            runs.extend(self.run_pending())

    def start(self) -> None:
        """Run jobs in a background thread in real time."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="fl-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the worker: a session in progress is interrupted (the server is told, nothing is
        sent, its job rescheduled) within ``SchedulerSettings.poll_s + grace_s`` and one step,
        and no other starts. Waits up to ``timeout`` for that."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.run_pending()
                nxt = self.next_wakeup()
            except Exception:  # one failing job (or job store) must not stop the device's worker
                log.exception("participation job failed; the worker tries again in %s s", self.idle_poll_s)
                nxt = None  # not at once: a job that fails as it is read would fail in a loop
            wait = self.idle_poll_s if nxt is None else max(0.0, min(self.idle_poll_s, nxt - self.clock.now()))
            if self._busy_elsewhere:  # its due job is another process's for now: look again in a while
                wait = max(wait, min(self.idle_poll_s, OTHER_PROCESS_POLL_S))
            self.clock.sleep(wait, self._wake)
