"""One simulated device: the SDK's own scheduler, worker queue and runtime, an in-memory example
store with the device's examples, on the simulation's virtual clock.

What the device runs is the code a phone runs: ``ParticipationScheduler`` decides when the
participation job is due and whether its constraints hold, ``FLRuntime`` checks in, downloads
(through its plan cache), trains with onnxruntime, reports or aborts, and records its events.
What the simulation adds is only the world around it:

- conditions: the device's availability (modelled or replayed), with faults laid over it;
- time: training batches and network transfers cost virtual time (``WorkMeter``,
  ``SimTransport``), the scheduler's waits are virtual sleeps, and the device is woken only when
  its next job is due, which for unmet constraints is when its conditions next change;
- faults, drawn per job run from the device's hazards: the app killed (its fiber is killed where
  it waits, nothing more is sent), the network lost for a while, the conditions breaking (the
  runtime's own abort path runs), and stragglers whose report is held back;
- for a secure task, the device's attested key (``secure_fleet``); its Secure Aggregation waits
  for its group by polling every ``SECAGG_POLL_S`` of virtual time, never in a held request."""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from device_runtime import FLRuntime, RetryPolicy, RuntimeEnvironment, TrainingInterrupted, training_limit
from device_runtime.conditions import DeviceState, TrainingConstraints, TrainingInterval
from device_runtime.opstats import Event, SessionSummary, shape_of
from device_runtime.plan import Plan
from device_runtime.plan_cache import MemoryPlanCache
from device_runtime.runtime import DeviceClass
from device_runtime.scheduling import (
    JobRun,
    ParticipationScheduler,
    RunOutcome,
    SchedulerSettings,
    WorkerQueue,
    to_microsecond,
)
from example_store import InMemoryExampleStore

from .events import AppKilled, Fiber, SimulationError, Timer
from .secure_fleet import SECAGG_POLL_S
from .sim_transport import LeanClient, SimTransport, checkin_answer
from .tables import UNFINISHED, SessionRow
from .world import DeviceWorld

#: How long a lost network or a broken condition (faults the availability model does not draw)
#: lasts before the device is back to what its availability says.
FAULT_OUTAGE_S = 900.0
#: Faults are drawn over this much session time from the start of each job run.
FAULT_HORIZON_S = 4 * 3600.0
#: After the app was killed it starts again when the device's conditions next change, or after this.
RESTART_AFTER_S = 900.0
#: How often a recurrent participation job may run after a completed session.
MIN_INTERVAL_S = 3600.0
#: What a device's participation job needs: the paper's idle, charging and unmetered network.
CONSTRAINTS = TrainingConstraints()
#: The least virtual time between two job runs of one device.
MIN_JOB_GAP_S = 1.0
#: The SDK's own retry of a failed request, in virtual time.
DEVICE_RETRY = RetryPolicy(attempts=3, base_delay_s=1.0, max_delay_s=10.0)
#: Every device's scheduler settings: one frozen value, checked once instead of at each build.
SCHEDULER_SETTINGS = SchedulerSettings(watchdog=False)


@functools.lru_cache(maxsize=256)
def _device_class(name: str, memory_mb: float, max_training_s: float) -> DeviceClass:
    """The frozen ``DeviceClass`` of a device class's name, memory and training limit: a fleet's
    devices share a handful, built and checked once each instead of at each device build."""
    return DeviceClass(name, memory_mb=memory_mb, max_training_s=max_training_s)


#: How many changes of its conditions a device looks ahead for the next moment its constraints
#: hold; past them it wakes there and looks again.
MAX_CHANGES_SCANNED = 10_000
#: A job woken for a change of conditions wakes this long after it: its due time is kept to the
#: microsecond and goes through the run's epoch, which could land it a hair before the change.
WAKE_AFTER_CHANGE_S = 1e-3
#: A training device runs ahead of the loop (see ``SimDevice.trained``); False sleeps on the
#: loop after every batch, which gives the same run, more slowly (a test holds them equal).
RUN_AHEAD = True
#: A device's SDK (runtime, scheduler, example store, fiber) is built when its participation job
#: first wakes, not at the start: until then an idle device is its spec, a few numbers and its
#: wake-up on the loop (see ``SimDevice``). False builds every device at the start, which gives
#: the same run with more memory (a test holds them equal).
MATERIALIZE_LAZILY = True
#: A device whose job run has ended is released until its next one: its SDK and fiber are dropped
#: and only what they carry from one job run to the next is kept (``Carried``, about 2.8 kB
#: with its opstats); its next wake-up builds it again from its seed with that state, so it runs as a device
#: kept built would, event for event. False keeps every device built once it has woken (the same
#: run, with about 46 kB per device that has woken; a test holds them equal).
RELEASE_AFTER_JOBS = True
#: A device whose next job run is due within this many seconds stays built and sleeps (a device
#: turned away is told to come back within seconds while rounds fill at once): building its SDK
#: again would cost more than it frees.
KEEP_BUILT_S = 60.0


STATUS_IDLE = "idle"
STATUS_CHECKING_IN = "checking_in"
STATUS_PARTICIPATING = "participating"


class DeviceClock:
    """The device's Clock: unix seconds on the device's virtual time; sleeping suspends the
    device's fiber (the ``wake`` event of a real scheduler loop is never needed: one driver)."""

    def __init__(self, device: SimDevice) -> None:
        self._device = device
        self._epoch = device.sim.epoch

    def now(self) -> float:
        return self._epoch + self._device.now()

    def sleep(self, seconds: float, wake: Any = None) -> bool:
        self._device.wait(seconds)
        return False

    def wait(self, seconds: float) -> None:
        self._device.wait(seconds)


class MemoryOpStats:
    """The device's opstats kept in memory: the last session's events (which the simulator turns
    into a row) and the last completed participation per task (for eligibility policies)."""

    def __init__(self) -> None:
        self.last_events: list[Event] = []
        self.last_task: str | None = None
        self._completed: dict[tuple[str, str | None], SessionSummary] = {}
        self._tokens: dict[tuple[str, str, str], str] = {}
        self.sessions_recorded = 0

    def record_session(self, session_id: str, population: str, task: str | None, events: list[Event]) -> None:
        self.last_events = list(events)
        self.last_task = task
        self.sessions_recorded += 1
        shape = shape_of(events)
        if events and shape.endswith("^"):
            # its first event only: what eligibility reads (the round it was told at check-in);
            # a device keeps this between job runs, also while released
            summary = SessionSummary(session_id, population, task, events[0].at, shape, [events[0]])
            self._completed[(population, task)] = summary
            self._completed[(population, None)] = summary

    def last_participation(self, population: str, task: str | None = None) -> SessionSummary | None:
        return self._completed.get((population, task))

    def resumption_token(self, population: str, task: str, collection_uri: str) -> str | None:
        return self._tokens.get((population, task, collection_uri))

    def save_resumption_token(
        self, population: str, task: str, collection_uri: str, token: str, at: float | None = None
    ) -> None:
        self._tokens[(population, task, collection_uri)] = token

    def forget_resumption_token(self, population: str, task: str, collection_uri: str) -> None:
        self._tokens.pop((population, task, collection_uri), None)


class SimConditions:
    """The device's DeviceConditions: its availability at the virtual now, with the fault that
    is in effect laid over it. ``next_change``, ``next_satisfied`` and ``first_satisfied`` let the
    scheduler sleep until it matters."""

    def __init__(self, device: SimDevice) -> None:
        self._device = device

    def state_at(self, t: float) -> DeviceState:
        d = self._device
        return self._state(t, d.broken_from, d.broken_until, d.net_down_from, d.net_down_until)

    def _state(
        self, t: float, broken_from: float, broken_until: float, down_from: float, down_until: float
    ) -> DeviceState:
        """The availability at ``t`` with the given faults laid over it (plain floats: every
        training step asks for the current state)."""
        state = self._device.spec.availability.state_at(t)
        if broken_from <= t < broken_until:
            state = DeviceState(
                False, state.charging, state.battery_level, state.unmetered_network, state.network_available
            )
        if down_from <= t < down_until:
            state = DeviceState(state.idle, state.charging, state.battery_level, state.unmetered_network, False)
        return state

    def current(self) -> DeviceState:
        return self.state_at(self._device.now())

    def next_change(self, now_unix: float) -> float | None:
        d = self._device
        t = self._since(now_unix)
        nxt = self._change_after(t, (d.broken_from, d.broken_until), (d.net_down_from, d.net_down_until))
        return None if nxt is None else d.sim.epoch + nxt

    def next_satisfied(self, constraints: TrainingConstraints, now_unix: float) -> float:
        """The first change after ``now_unix`` at which ``constraints`` hold, or a moment past the
        run's end if they never hold again in it (the device has nothing left to do).

        Asked by the scheduler when a job run found them unmet: the faults drawn for that run
        that are not under way yet end with it (``_end_job``), so only those under way count,
        and the device wakes when it would have after waking at every change in between."""
        t = self._since(now_unix)
        return self._waking(self._scan(constraints, t, self._under_way(t), holding=True))

    def first_satisfied(self, constraints: TrainingConstraints, at_unix: float, now_unix: float) -> float:
        """The first moment at or after ``at_unix`` at which ``constraints`` hold, as the device
        knows its future at ``now_unix`` (a job run rescheduling itself: as in ``next_satisfied``,
        only the faults under way then count), or a moment past the run's end if they never hold
        again in it.

        The scheduler sleeps until then instead of running the job at ``at_unix`` to find them
        unmet, as JobScheduler starts a job only once its constraints hold."""
        faults = self._under_way(self._since(now_unix))
        at = at_unix - self._device.sim.epoch
        if constraints.satisfied(self._state(at, *faults[0], *faults[1])):
            return at_unix
        return self._waking(self._scan(constraints, at, faults, holding=True))

    def first_unsatisfied(self, constraints: TrainingConstraints, now_unix: float) -> float | None:
        """The first change after ``now_unix`` at which ``constraints`` stop holding, with the
        faults the device has now; None if they hold from then on."""
        t = self._scan(constraints, self._since(now_unix), self._under_way(math.inf), holding=False)
        return None if t is None else self._device.sim.epoch + t

    def _scan(
        self,
        constraints: TrainingConstraints,
        t: float,
        faults: tuple[tuple[float, float], tuple[float, float]],
        *,
        holding: bool,
    ) -> float | None:
        """The first change after ``t`` (the run's time) at which ``constraints`` hold, or with
        ``holding`` False stop holding, under ``faults``; None if none comes. Past
        ``MAX_CHANGES_SCANNED`` changes, the last one looked at (the job looks again from there)."""
        for _ in range(MAX_CHANGES_SCANNED):
            nxt = self._change_after(t, *faults)
            if nxt is None:
                return None
            t = nxt
            if constraints.satisfied(self._state(t, *faults[0], *faults[1])) == holding:
                return t
        return t

    def _waking(self, t: float | None) -> float:
        """When a job waits for the change at ``t`` wakes (unix time): a hair after it, or past the
        run's end if none comes (the device has nothing left to do)."""
        d = self._device
        if t is None:
            return d.sim.epoch + d.sim.horizon_s + 1.0
        return d.sim.epoch + t + WAKE_AFTER_CHANGE_S  # (summed in this order: due times round to it)

    def _under_way(self, t: float) -> tuple[tuple[float, float], tuple[float, float]]:
        """The device's faults (broken conditions, network down) that have begun by ``t``."""
        d = self._device
        broken = (d.broken_from, d.broken_until) if d.broken_from <= t else (-1.0, -1.0)
        net_down = (d.net_down_from, d.net_down_until) if d.net_down_from <= t else (-1.0, -1.0)
        return broken, net_down

    def _since(self, now_unix: float) -> float:
        d = self._device
        # the device's clock reads epoch + the device's time; going back through the epoch could
        # land a hair before a change time and wake the device again at the same instant
        return d.now() if abs(now_unix - (d.sim.epoch + d.now())) < 1e-3 else now_unix - d.sim.epoch

    def _change_after(self, t: float, broken: tuple[float, float], net_down: tuple[float, float]) -> float | None:
        times = [x for x in (*broken, *net_down) if x > t]
        nxt = self._device.spec.availability.next_change(t)
        if nxt is not None:
            times.append(nxt)
        return min(times) if times else None


@dataclass
class _JobStats:
    """What the current job run cost, for its session row."""

    started: float = 0.0
    compute_s: float = 0.0
    #: When the session's training began (the device's instant of its first batch), None between
    #: trainings, and the examples it has trained since.
    training_from: float | None = None
    trained: int = 0
    #: The selector the session trains on and the examples it matches (``_examples_left``): the
    #: device's store is filled once, without a TTL, so the count holds for the job run.
    counted: tuple[Any, int] | None = None
    #: The plan the session trains and its ``training_limit`` (a batch reads it at each step).
    limited: tuple[Plan, float, str] | None = None
    session_id: str = ""
    task: str = ""
    round: str = ""


@dataclass(slots=True)
class Carried:
    """What a released device's SDK carries from one job run to the next, and nothing else: its
    three random streams, its scheduled job and when it last ran, its opstats (last completed
    participation, resumption tokens), the server's last retry window, the plans it has
    downloaded, and its example store's token key (a token issued before must still verify)."""

    rng: int
    runtime_rng: int
    scheduler_rng: int
    jobs: dict
    last_run: dict
    opstats: MemoryOpStats
    retry_window: tuple[float, float] | None
    verdict_needed: bool
    plan_ids: set
    tokens: Any


_Random = random.Random


class StreamRandom:
    """A seeded random stream of 8 bytes of state (splitmix64), with ``random.Random``'s methods.

    A fleet's device holds three streams (its faults, its runtime, its scheduler); as
    ``random.Random`` each carries the Mersenne Twister's 2.5 kB of state, 750 MB for 100,000
    devices. The methods the SDK and the population model call are ``random.Random``'s own
    (``uniform``, ``expovariate``, ``randrange``, ...), built on ``random`` and ``getrandbits``."""

    __slots__ = ("_state",)
    _MASK = (1 << 64) - 1

    def __init__(self, seed: int) -> None:
        self._state = seed & self._MASK

    def _next64(self) -> int:
        self._state = z = (self._state + 0x9E3779B97F4A7C15) & self._MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self._MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self._MASK
        return z ^ (z >> 31)

    def random(self) -> float:
        return (self._next64() >> 11) * (1.0 / 9007199254740992.0)

    def getrandbits(self, k: int) -> int:
        if k < 0:
            raise ValueError("number of bits must be non-negative")
        bits, have = 0, 0
        while have < k:
            bits = (bits << 64) | self._next64()
            have += 64
        return bits >> (have - k)

    uniform = _Random.uniform
    expovariate = _Random.expovariate
    randrange = _Random.randrange
    randint = _Random.randint
    choice = _Random.choice
    shuffle = _Random.shuffle
    normalvariate = _Random.normalvariate
    _randbelow = _Random._randbelow_with_getrandbits  # type: ignore[attr-defined]


class LazyExampleStore(InMemoryExampleStore):
    """The device's examples, put into its store when the store is first read. Most devices of a
    large fleet never train in a day (rounds need a few thousand of them), and a filled store
    costs about 18 kB per device; the examples get the timestamp they would have had at start,
    and go in a column at a time (``add_columns``: a dict built for each example was most of
    what filling a store cost).

    ``examples()`` gives collection URI -> feature -> array (one entry per example along the first
    axis), or ``(x, y)`` for ``collection_uri`` alone."""

    def __init__(
        self,
        collection_uri: str,
        examples: Callable[[], Any],
        clock: Callable[[], float],
        stocked_at: float | None = None,
    ) -> None:
        """``stocked_at``: the examples' timestamp (unix seconds; ``clock()`` now when None): a
        device built after the start stamps them as at the start."""
        self._pending: tuple[str, Callable[[], tuple[np.ndarray, np.ndarray]], float] | None = None
        super().__init__(clock=clock)
        self._pending = (collection_uri, examples, clock() if stocked_at is None else stocked_at)

    @property
    def _collections(self) -> dict:
        pending, self._pending = self._pending, None
        if pending is not None:
            uri, examples, at = pending
            given = examples()
            collections = {uri: {"x": given[0], "y": given[1]}} if isinstance(given, tuple) else given
            for collection, features in collections.items():
                self.add_columns(collection, features, timestamp=at)
        return self.__dict__["_collections"]

    @_collections.setter
    def _collections(self, value: dict) -> None:
        self.__dict__["_collections"] = value


class SimDevice:
    """One device of the fleet (``spec`` is its ``DeviceSpec``); ``examples`` gives its examples
    (called when the device first reads its store; ``sim``'s examples of ``spec`` when None).

    An idle device is cheap: until its participation job first wakes it holds its spec, its
    faults and status as plain fields, and one timer on the loop (``start``). Its SDK (example
    store, ``FLRuntime``, scheduler, worker queue, transport) and its fiber are built then
    (``_materialize``), from its seed and the moment it started, so a device built late runs as
    one built at the start, event for event (``MATERIALIZE_LAZILY``)."""

    __slots__ = (
        "sim",
        "spec",
        "key",
        "status",
        "killed",
        "net_down_from",
        "net_down_until",
        "broken_from",
        "broken_until",
        "late_s",
        "ahead",
        "fiber",
        "_kill_timer",
        "_idle_timer",
        "_job",
        "_examples",
        "_started_at",
        "_start_at",
        "_wake",
        "_carried",
        "rng",
        "clock",
        "conditions",
        "opstats",
        "store",
        "transport",
        "runtime",
        "queue",
        "scheduler",
    )

    def __init__(
        self,
        sim: DeviceWorld,
        spec: Any,
        examples: Any = None,
    ) -> None:
        self.sim = sim
        self.spec = spec
        self.key = 0  # the device's tie-breaking key on the loop (its fiber's), given at start
        self.status = STATUS_IDLE
        self.killed = False
        self.net_down_from = self.net_down_until = -1.0
        self.broken_from = self.broken_until = -1.0
        self.late_s = 0.0
        self.ahead: float | None = None  # the device's own time while it trains ahead of the loop
        self.fiber: Fiber | None = None
        self._kill_timer: Timer | None = None
        self._idle_timer: Timer | None = None  # a device turned away stops waiting when it could no longer train
        self._wake: Timer | None = None  # the next wake-up of a device not built yet, or released
        self._carried: Carried | None = None  # what a released device's SDK carries to its next job run
        self._examples = examples
        self._started_at = sim.loop.now  # when it started: its examples' timestamp
        self._start_at = 0.0
        self.conditions = SimConditions(self)

    @property
    def materialized(self) -> bool:
        """The device's SDK is built (its participation job has woken, or it was built eagerly)."""
        return self.fiber is not None

    @property
    def woken(self) -> bool:
        """The device has been built at least once: it is built now, or released between job runs."""
        return self.fiber is not None or self._carried is not None

    def _build(self, carried: Carried | None = None) -> None:
        """The device's SDK, from its seed alone: the same whenever it is built; ``carried``: the
        state a released device's SDK had at the end of its last job run, restored into it."""
        sim, spec = self.sim, self.spec
        self.rng = StreamRandom(spec.seed)
        self._job = _JobStats()
        self.clock = DeviceClock(self)
        self.opstats = MemoryOpStats() if carried is None else carried.opstats
        examples = self._examples
        if examples is None:
            examples = functools.partial(sim.examples, spec)
        self.store = LazyExampleStore(
            sim.collection_uri,
            examples if callable(examples) else (lambda: examples),
            self.clock.now,
            stocked_at=sim.epoch + self._started_at,
        )
        self.transport = SimTransport(
            sim.caller, self, spec.network, on_answer=self._on_answer, hold_report=self._hold_report
        )
        seeds = StreamRandom(spec.seed ^ 0x5EED)
        attestation = sim.attestation  # a secure task: an attested device that accepts attested peers only
        self.runtime = FLRuntime(
            sim.population,
            sim.server_url,
            self.store,
            runtime_version=spec.runtime_version,
            retry=DEVICE_RETRY,
            rng=StreamRandom(seeds.getrandbits(64)),  # type: ignore[arg-type]  # random.Random's methods
            opstats=self.opstats,  # type: ignore[arg-type]  # the in-memory twin of OpStatsStore
            device_class=_device_class(spec.device_class, float(spec.memory_mb), sim.max_training_s),
            http_client=LeanClient(self.transport),  # type: ignore[arg-type]  # request() and close() of httpx.Client
            plan_cache=MemoryPlanCache(sim.plan_bytes),
            attestor=attestation.attestor(spec, sim.epoch) if attestation is not None else None,
            trust_anchor=attestation.trust_anchor if attestation is not None else None,
            environment=RuntimeEnvironment(
                clock=self.clock.now,
                sleep=self.clock.wait,
                work_meter=self,
                memory_probe=_no_memory,
                loaded_plans=sim.loaded_plans,
                secagg_poll_s=SECAGG_POLL_S,
                report_update=sim.canary_report(canary) if (canary := getattr(spec, "canary", -1)) >= 0 else None,
            ),
        )
        self.queue = WorkerQueue(self.clock, history=0)
        self.scheduler = ParticipationScheduler(
            None,
            self.conditions,
            app="sim",
            clock=self.clock,
            queue=self.queue,
            settings=SCHEDULER_SETTINGS,
            rng=StreamRandom(seeds.getrandbits(64)),  # type: ignore[arg-type]
        )
        self.scheduler.register_runtime(sim.population, self.runtime)
        if carried is not None:
            self._restore(carried)
            return
        self.scheduler.schedule(
            sim.population,
            CONSTRAINTS,
            TrainingInterval(recurrent=True, min_interval_s=MIN_INTERVAL_S),
            start_at=sim.epoch + self._start_at,
        )

    def _carry(self) -> Carried:
        """What the SDK carries to the next job run (see ``Carried``): the fields of the device's
        SDK objects that a job run changes; everything else is rebuilt from the seed as it was."""
        runtime, opstats = self.runtime, self.opstats
        opstats.last_events = []  # read only by the job run that recorded them
        return Carried(
            rng=self.rng._state,
            runtime_rng=runtime.rng._state,  # type: ignore[attr-defined]  # a StreamRandom (see _build)
            scheduler_rng=self.scheduler.rng._state,  # type: ignore[attr-defined]
            jobs=self.scheduler._jobs._jobs,  # type: ignore[union-attr]  # in memory: database None
            last_run=self.queue._last_run,
            opstats=opstats,
            retry_window=runtime.last_retry_window,
            verdict_needed=runtime._verdict_needed,
            plan_ids=runtime.plan_cache._ids,  # type: ignore[attr-defined]  # a MemoryPlanCache
            tokens=self.store._tokens,
        )

    def _restore(self, carried: Carried) -> None:
        runtime = self.runtime
        self.rng._state = carried.rng
        runtime.rng._state = carried.runtime_rng  # type: ignore[attr-defined]
        self.scheduler.rng._state = carried.scheduler_rng  # type: ignore[attr-defined]
        self.scheduler._jobs._jobs = carried.jobs  # type: ignore[union-attr]
        self.queue._last_run = carried.last_run
        runtime.last_retry_window = carried.retry_window
        runtime._verdict_needed = carried.verdict_needed
        runtime.plan_cache._ids = carried.plan_ids  # type: ignore[attr-defined]
        self.store._tokens = carried.tokens

    # ----------------------------------------------------------------- the world around the SDK
    def network_up(self, t: float) -> bool:
        return not (self.net_down_from <= t < self.net_down_until)

    def now(self) -> float:
        ahead = self.ahead
        return self.sim.loop.now if ahead is None else ahead

    def sleep(self, seconds: float) -> None:
        if self.killed:
            raise AppKilled()
        self.wait(seconds)

    def wait(self, seconds: float) -> None:
        """Spend ``seconds`` of the device's time (from where its training got to, if ahead)."""
        self._sleep_until(self.now() + max(0.0, seconds))

    def _sleep_until(self, until: float) -> None:
        """Catch the loop up with the device: sleep on it until the device's instant ``until``."""
        self.ahead = None
        self.sim.fibers.sleep_until(until)

    def trained(self, plan: Plan, examples: int) -> None:
        """``WorkMeter``: a batch costs the device its compute time in virtual time: the plan's
        seconds per example on the reference phone (``FleetSimulator.seconds_per_example``) times
        the examples and the device's speed.

        Training touches nothing outside the device: no request, no shared state, and its
        conditions are a function of its own time. So the batch's time is not slept on the loop
        (a switch to it per batch, with every other device's events run in between, cost as much
        as training itself); the device runs ahead on a clock of its own (``ahead``), which its
        clock, conditions and network read, until the training ends (``settle``) or its next
        batch would reach one of its own events (its app killed) or the run's end, where it
        sleeps as it would have. Its instants are the same sums either way, so the run is the
        same, bit for bit.

        A device stops training by force once it has trained for the plan's time budget, or its
        class's ``max_training_s`` when the plan declares none (``FLRuntime``'s watchdog, on the
        system's clock): here in virtual time, at that instant exactly, and the session ends
        interrupted (``TrainingInterrupted``). A session that cannot end in time (its epochs over
        the examples it reads take longer, ``_examples_left``) is not trained for real to its end:
        its clock moves at once to where it stops, or to the first moment its conditions stop
        holding before that (where the runtime's next check interrupts it, as it would have at the
        end of the batch running then), so a plan of 10^9 epochs costs a batch, not the epochs."""
        job = self._job
        per_example = self.sim.seconds_per_example(plan) * self.spec.speed
        if self.killed:
            job.compute_s += examples * per_example
            raise AppKilled()
        now = self.now()
        if job.training_from is None:
            job.training_from = now
        job.trained += examples
        until = now + examples * per_example
        limited = job.limited
        if limited is None or limited[0] is not plan:
            limited = job.limited = (plan, *training_limit(plan, self.sim.max_training_s))
        _, limit, reason = limited
        stop_at = job.training_from + limit
        left = self._examples_left(plan)
        if left is not None and until + left * per_example > stop_at and until < stop_at:
            broken = self.conditions.first_unsatisfied(CONSTRAINTS, self.sim.epoch + until)
            jump = stop_at if broken is None else min(stop_at, broken - self.sim.epoch)
            if self._kill_timer is not None:  # killed on the way: it trained until then
                jump = min(jump, self._kill_timer.at)
            until = max(until, min(jump, self.sim.horizon_s))
        stopped = until >= stop_at
        if stopped:
            until = stop_at
        job.compute_s += until - now
        kill = self._kill_timer
        if RUN_AHEAD and until <= self.sim.horizon_s and (kill is None or until < kill.at):
            self.ahead = until
        else:
            self._sleep_until(until)
        if stopped:
            raise TrainingInterrupted(f"training was stopped by force after {limit:g} s", reason=reason)

    def _examples_left(self, plan: Plan) -> int | None:
        """The examples the session still trains on if it runs to its end: its epochs over the
        examples its selector matches, less those trained; None for a plan that resumes where its
        last session stopped (it may read fewer)."""
        if plan.device.resume:
            return None
        job, selector = self._job, plan.device.selector
        counted = job.counted
        if counted is not None and counted[0] is selector:
            per_epoch = counted[1]
        else:
            try:
                per_epoch = self.store.count(selector)
            except Exception:  # noqa: BLE001 - the runtime reads the store itself and says what is wrong
                return None
            job.counted = (selector, per_epoch)
        return max(0, plan.device.epochs * per_epoch - job.trained)

    def settle(self) -> None:
        """``WorkMeter``: training ended; a device ahead of the loop sleeps until its own time,
        the instant its last batch's sleep would have woken it."""
        self._job.training_from, self._job.trained = None, 0
        if self.ahead is not None:
            self.wait(0.0)

    def _hold_report(self) -> float:
        held, self.late_s = self.late_s, 0.0
        return held

    def _on_answer(self, path: str, status: int, content: bytes) -> None:
        if status == 200 and path.endswith("/checkin"):
            answer = checkin_answer(content)
            if answer is not None:
                self._job.session_id = str(answer.get("session_id", ""))
                self._job.task = str(answer.get("task", ""))
                self._job.round = f"{self._job.task}/{answer.get('round', '')}"
                self.sim.set_status(self, STATUS_PARTICIPATING)

    # ----------------------------------------------------------------- the fiber
    def start(self, at: float) -> None:
        """Schedule the participation job to start at ``at`` (or once its constraints hold after
        it): the device's fiber first runs then. Lazily (``MATERIALIZE_LAZILY``) only a timer is
        set for that moment, which the scheduler would compute (the device has no faults before
        its first job run), and the device is built when it fires."""
        sim = self.sim
        self.key = sim.fibers.key_for(self.spec.device_id)
        self._started_at = sim.loop.now
        self._start_at = at
        if MATERIALIZE_LAZILY:
            start_at = sim.epoch + at
            when = self.conditions.first_satisfied(CONSTRAINTS, start_at, sim.epoch + sim.loop.now)
            first = to_microsecond(max(start_at, when))  # ParticipationScheduler.schedule's first run
            self._wake = sim.loop.call_at(first - sim.epoch, self._materialize, order=1, key=self.key)
            return
        self._build()
        due = self.queue.next_wakeup()
        assert due is not None
        self.fiber = sim.fibers.spawn(self._main, at=due - sim.epoch, name=self.spec.device_id, key=self.key)

    def _materialize(self) -> None:
        """The first wake-up of a device not built yet: build it and run its fiber now, as the
        fiber built at the start would have run at this event."""
        self._wake = None
        self._build()
        first = self.queue.next_wakeup()
        if (
            first is None or max(first - self.sim.epoch, self._started_at) != self.sim.loop.now
        ):  # (a timer is never set in the past)
            raise SimulationError(
                f"device {self.spec.device_id} was built at {self.sim.loop.now!r} s but its job is due at {first!r}: "
                "the first wake-up set at its start no longer matches its scheduler's; set sim_device.MATERIALIZE_LAZILY = False"
            )
        self._run_fiber(self._main)

    def _release(self, until: float) -> None:
        """Between job runs (called by the fiber, which then ends): keep what the SDK carries
        and drop the SDK; a timer at ``until``, where the fiber would have slept to, builds it
        again. It is keyed and ordered as that sleep's wake-up, so the loop runs the same."""
        sim = self.sim
        self._carried = self._carry()
        # the scheduler and its queue hold each other: with that cycle broken, the dropped SDK is
        # freed as its last reference goes (the run defers full collections, see ``heap``, so a
        # cycle of long-lived objects would stay until the run ends: 46 kB per job run)
        self.queue.remove(self.scheduler)
        for name in ("rng", "clock", "opstats", "store", "transport", "runtime", "queue", "scheduler"):
            delattr(self, name)
        self.fiber = None
        if sim.fibers.current is not None:
            sim.fibers.forget(sim.fibers.current)
        self._wake = sim.loop.call_at(until, self._rebuild, order=1, key=self.key)

    def _rebuild(self) -> None:
        """A released device's wake-up: its SDK built again with what it carried, and its fiber
        run now, as its fiber kept alive would have woken at this event."""
        carried, self._carried, self._wake = self._carried, None, None
        assert carried is not None
        self._build(carried)
        self._run_fiber(functools.partial(self._main, woken=True))

    def _run_fiber(self, main: Callable[[], None]) -> None:
        """Spawn the device's fiber and run it now, until it first waits: ``fiber`` is it then,
        unless it has already released the device."""
        fiber = self.sim.fibers.spawn_now(main, name=self.spec.device_id, key=self.key)
        if self._carried is None:
            self.fiber = fiber

    def _main(self, woken: bool = False) -> None:
        """The device's job runs, one after another; ``woken``: the fiber of a released device,
        built at its wake-up, whose first job run is due now."""
        sim = self.sim
        last_job_at = -1.0
        while True:
            if woken:
                woken = False
            else:
                due = self.queue.next_wakeup()
                if due is None:
                    return
                wait = due - self.clock.now()
                if sim.loop.now == last_job_at:  # never two job runs at one instant: time must move
                    wait = max(wait, MIN_JOB_GAP_S)
                if wait > 0:
                    if RELEASE_AFTER_JOBS and self.ahead is None and wait > KEEP_BUILT_S:
                        self._release(sim.loop.now + wait)
                        return
                    sim.fibers.sleep(wait)
            last_job_at = sim.loop.now
            if sim.loop.now >= sim.horizon_s:
                return
            self._begin_job()
            try:
                runs = self.queue.run_pending()
            except AppKilled:
                self._record_killed()
                self._end_job(None)
                restart = self.conditions.next_change(self.clock.now()) or (self.clock.now() + RESTART_AFTER_S)
                self.scheduler.schedule(
                    sim.population,
                    CONSTRAINTS,
                    TrainingInterval(recurrent=True, min_interval_s=MIN_INTERVAL_S),
                    start_at=max(restart, self.clock.now() + 1.0),
                )
                continue
            except Exception as exc:  # an error outside the SDK's own handling: counted, the device lives on
                sim.count_error(type(exc).__name__)
                self._record_row(
                    JobRun(
                        "sim",
                        sim.population,
                        RunOutcome.ERROR,
                        self._job.started,
                        self.clock.now(),
                        None,
                        f"{type(exc).__name__}: {exc}",
                    ),
                    error=True,
                )
                self._end_job(None)
                self.scheduler.schedule(
                    sim.population,
                    CONSTRAINTS,
                    TrainingInterval(recurrent=True, min_interval_s=MIN_INTERVAL_S),
                    start_at=self.clock.now() + RESTART_AFTER_S,
                )
                continue
            last = None
            for run in runs:
                self._record_row(run)
                last = run
            self._end_job(last)

    def _begin_job(self) -> None:
        sim, now = self.sim, self.sim.loop.now
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._job = _JobStats(started=now)
        self.transport.meter.reset()
        self.opstats.last_events = []
        self.killed = False
        sim.set_status(self, STATUS_CHECKING_IN)
        fault = self.spec.faults.first_fault(self.rng, FAULT_HORIZON_S)
        self.late_s = self.spec.faults.late_delay(self.rng)
        if fault is not None:
            kind, after = fault
            at = now + after
            if kind == "app_killed":
                self._kill_timer = sim.loop.call_at(at, self._kill, order=2)
            elif kind == "network_lost":
                self.net_down_from, self.net_down_until = at, at + FAULT_OUTAGE_S
            else:
                self.broken_from, self.broken_until = at, at + FAULT_OUTAGE_S

    def _end_job(self, last: JobRun | None) -> None:
        if self._kill_timer is not None:
            self._kill_timer.cancel()
            self._kill_timer = None
        now = self.sim.loop.now
        # a fault drawn for this job run ends with it, unless it is already under way
        if self.net_down_from > now:
            self.net_down_from = self.net_down_until = -1.0
        if self.broken_from > now:
            self.broken_from = self.broken_until = -1.0
        self.late_s = 0.0
        waiting = last is not None and last.outcome is RunOutcome.NOT_SELECTED
        self.sim.set_status(self, STATUS_CHECKING_IN if waiting else STATUS_IDLE)
        if waiting:
            # it waits to check in again only while it could train: its job sleeps on past its
            # retry until the constraints hold, and it is idle from when they stop holding
            stop = self.conditions.first_unsatisfied(CONSTRAINTS, self.clock.now())
            due = self.queue.next_wakeup()
            if stop is not None and (due is None or stop < due):
                self._idle_timer = self.sim.loop.call_at(stop - self.sim.epoch, self._stop_waiting, order=2)

    def _stop_waiting(self) -> None:
        self._idle_timer = None
        self.sim.set_status(self, STATUS_IDLE)

    def _kill(self) -> None:
        self._kill_timer = None
        if self.fiber is None or self.fiber.dead:
            return
        self.killed = True
        self.fiber.kill(AppKilled())

    # ----------------------------------------------------------------- rows
    def _row(self, start: float, end: float, shape: str, outcome: str, examples: int, code: str = "") -> SessionRow:
        job, meter, spec = self._job, self.transport.meter, self.spec
        return SessionRow(
            device_id=spec.device_id,
            session_id=job.session_id,
            task=job.task,
            round_id=job.round,
            start_s=round(start, 6),
            end_s=round(end, 6),
            shape=shape,
            outcome=outcome,
            bytes_down=meter.bytes_down,
            bytes_up=meter.bytes_up,
            examples=examples,
            compute_s=round(job.compute_s, 6),
            network_s=round(meter.network_s, 6),
            runtime_version=spec.runtime_version,
            device_class=spec.device_class,
            local_hour=round(spec.local_hour(start), 6),
            code=code,
        )

    def _record_row(self, run: JobRun, *, error: bool = False) -> None:
        sim = self.sim
        if run.outcome in (RunOutcome.CONSTRAINTS_UNMET, RunOutcome.NO_RUNTIME):
            return
        start, end = run.started_at - sim.epoch, run.ended_at - sim.epoch
        if run.outcome is RunOutcome.NOT_SELECTED:
            sim.add_session(self._row(start, end, "-", "rejected", 0, run.detail))
            return
        events = self.opstats.last_events
        shape = shape_of(events) if events else "*"
        examples = run.session.num_examples if run.session is not None else 0
        outcome = run.outcome.value
        code = _why_ended(events)
        if run.outcome is RunOutcome.ERROR:
            code = run.detail.split(":", 1)[0] or "error"
            sim.count_error(code)
        sim.add_session(self._row(start, end, shape, outcome, examples, code))

    def record_unfinished(self, at: float) -> None:
        """The run ends at ``at`` while the device is in a session (seated, its report not yet
        answered): its row is cut there, outcome ``unfinished`` (the round that seated it counts
        it among its selected devices, so the session table must hold it too)."""
        if self.status != STATUS_PARTICIPATING or not self.materialized:
            return
        events = [e for e in self.opstats.last_events if e.kind != "error"]
        shape = shape_of(events) if events else "-"
        self.sim.add_session(self._row(self._job.started, at, shape, UNFINISHED, 0))

    def _record_killed(self) -> None:
        """The app died mid-run: its last session is cut where it stood (the SDK's dying error
        record is dropped: a killed app records nothing)."""
        events = [e for e in self.opstats.last_events if e.kind != "error"]
        now = self.sim.loop.now
        if not events and not self._job.session_id:
            return
        shape = shape_of(events) if events else "-"
        self.sim.add_session(self._row(self._job.started, now, shape, "app_killed", 0))


def _why_ended(events: list[Event]) -> str:
    """The ``SessionRow.code`` of a session that ended with ``events``: what its last event names
    (the server's code of a refused report, the reason an interruption gives, the error's type)."""
    if not events:
        return ""
    last = events[-1]
    key = {"upload_rejected": "code", "interrupted": "reason", "error": "error"}.get(last.kind)
    return str(last.detail.get(key) or "") if key else ""


def _no_memory() -> float:
    """Memory is modelled by the device class (the plan's budget check), not measured: the
    simulation's process holds thousands of devices."""
    return 0.0
