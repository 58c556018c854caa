"""What a simulation on virtual time needs of the SDK, against a real server: an in-memory job
store, jobs woken when conditions change rather than re-checked (without the quiet period after
their return, ``SchedulerSettings.settle_s``, which ``test_settling`` checks), a work meter that hears every
trained batch, plan caches that download each plan once per device, and no wall-clock reads
in a session's events."""

from __future__ import annotations

import hashlib
import os
import random

import httpx
import pytest

from device_runtime import (
    FLRuntime,
    InvalidSetting,
    Outcome,
    RetryPolicy,
    RuntimeEnvironment,
    TrainingInterrupted,
    training_limit,
)
from device_runtime.checkpoint import encode_checkpoint
from device_runtime.clock import VirtualClock
from device_runtime.conditions import DeviceState, TrainingConstraints, TrainingInterval
from device_runtime.eligibility import EligibilityPolicies
from device_runtime.plan import Plan
from device_runtime.plan_cache import DirectoryPlanCache, LoadedPlans, MemoryPlanCache
from device_runtime.scheduling import ParticipationScheduler, RunOutcome, SchedulerSettings, WorkerQueue
from example_store import InMemoryExampleStore
from server_stub import RoundConfig
from tests.support import COLLECTION, deploy

GOOD = DeviceState(idle=True, charging=True, battery_level=0.9, unmetered_network=True)
BUSY = DeviceState(idle=False, charging=True, battery_level=0.9, unmetered_network=True)
FAST = RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.02)


class ChangingConditions:
    """Busy until ``free_at`` (unix seconds on ``clock``), then good; tells when it changes."""

    def __init__(self, clock: VirtualClock, free_at: float) -> None:
        self.clock, self.free_at = clock, free_at
        self.asked = 0

    def current(self) -> DeviceState:
        return GOOD if self.clock.now() >= self.free_at else BUSY

    def next_change(self, now: float) -> float | None:
        self.asked += 1
        return self.free_at if now < self.free_at else None


class CountingMeter:
    def __init__(self) -> None:
        self.batches: list[int] = []
        self.settles: list[int] = []

    def trained(self, plan: Plan, examples: int) -> None:
        self.batches.append(examples)

    def settle(self) -> None:
        self.settles.append(len(self.batches))


def _store(digits, n: int, clock: VirtualClock) -> InMemoryExampleStore:
    store = InMemoryExampleStore(clock=clock.now)
    store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:n], digits.y_train[:n])))
    return store


def _metered_runtime(server, digits, clock: VirtualClock, meter: CountingMeter) -> FLRuntime:
    """A device of 37 examples on ``clock`` whose trained batches ``meter`` hears."""
    return FLRuntime(
        "digits",
        server.url,
        _store(digits, 37, clock),
        retry=FAST,
        plan_cache=MemoryPlanCache(),
        environment=RuntimeEnvironment(clock=clock.now, work_meter=meter),
    )


def test_a_job_with_unmet_constraints_sleeps_until_its_conditions_change(server, admin, digits):
    deploy(admin, goal_count=5)
    clock = VirtualClock()
    conditions = ChangingConditions(clock, free_at=clock.now() + 5000.0)
    queue = WorkerQueue(clock, history=1)
    scheduler = ParticipationScheduler(
        None, conditions, clock=clock, queue=queue, settings=SchedulerSettings(recheck_s=60, watchdog=False, settle_s=0)
    )
    meter = CountingMeter()
    runtime = _metered_runtime(server, digits, clock, meter)
    scheduler.register_runtime("digits", runtime)
    scheduler.schedule("digits", TrainingConstraints(), TrainingInterval())
    runs = queue.run_until(clock.now() + 10_000.0)
    # one look at unmet constraints, then straight to the change: no re-check every 60 s
    assert [r.outcome for r in runs] == [RunOutcome.CONSTRAINTS_UNMET, RunOutcome.COMPLETED]
    assert runs[0].next_run_at == conditions.free_at
    assert len(queue.history) == 1 and queue.history[0] is runs[-1]
    plan = runtime._plans[next(iter(runtime._plans))]
    batch, epochs = plan.device.batch_size, plan.device.epochs
    assert sum(meter.batches) == 37 * epochs
    assert max(meter.batches) == batch and len(meter.batches) == epochs * -(-37 // batch)
    assert meter.settles == [len(meter.batches)]  # once, after the last batch
    session = runs[-1].session
    assert session is not None and all(abs(e.at - runs[-1].started_at) < 1e-6 for e in session.events)
    assert scheduler.jobs() == []  # in memory, and done


class FlickeringConditions:
    """Busy, with a change every 100 s (the screen going on and off, say) until ``free_at``."""

    def __init__(self, clock: VirtualClock, free_at: float) -> None:
        self.clock, self.free_at = clock, free_at

    def current(self) -> DeviceState:
        return GOOD if self.clock.now() >= self.free_at else BUSY

    def next_change(self, now: float) -> float | None:
        return min(now + 100.0, self.free_at) if now < self.free_at else None


class ForeseeingConditions(FlickeringConditions):
    """The same, and able to tell when given constraints next hold."""

    def next_satisfied(self, constraints: TrainingConstraints, now: float) -> float | None:
        return self.free_at if now < self.free_at else None


def test_conditions_that_know_when_constraints_hold_wake_the_job_only_then():
    """Without ``next_satisfied`` the job wakes at every change and finds its constraints unmet;
    with it, it sleeps from its first look straight to the moment they hold."""
    outcomes = {}
    for kind in (FlickeringConditions, ForeseeingConditions):
        clock = VirtualClock()
        conditions = kind(clock, free_at=clock.now() + 1000.0)
        queue = WorkerQueue(clock, history=0)
        settings = SchedulerSettings(recheck_s=60, watchdog=False, settle_s=0)
        scheduler = ParticipationScheduler(None, conditions, clock=clock, queue=queue, settings=settings)
        scheduler.schedule("digits", TrainingConstraints(), TrainingInterval())  # no runtime: NO_RUNTIME once they hold
        runs = queue.run_until(conditions.free_at + 1.0)
        assert runs[-1].outcome is RunOutcome.NO_RUNTIME and runs[-1].started_at == conditions.free_at
        outcomes[kind] = [r.outcome for r in runs]
    assert outcomes[FlickeringConditions] == [RunOutcome.CONSTRAINTS_UNMET] * 10 + [RunOutcome.NO_RUNTIME]
    assert outcomes[ForeseeingConditions] == [RunOutcome.CONSTRAINTS_UNMET, RunOutcome.NO_RUNTIME]


class BusyWindows:
    """Good except while busy in one of ``windows`` ([start, end) pairs); tells when it changes."""

    def __init__(self, clock: VirtualClock, windows: list[tuple[float, float]]) -> None:
        self.clock, self.windows = clock, windows

    def _busy_until(self, t: float) -> float | None:
        return next((end for start, end in self.windows if start <= t < end), None)

    def current(self) -> DeviceState:
        return BUSY if self._busy_until(self.clock.now()) is not None else GOOD

    def next_change(self, now: float) -> float | None:
        return min((t for w in self.windows for t in w if t > now), default=None)


class ForeseenBusyWindows(BusyWindows):
    """The same, able to tell from any moment on when the constraints hold."""

    def first_satisfied(self, constraints: TrainingConstraints, at: float, now: float) -> float | None:
        return self._busy_until(at) or at


def test_a_job_due_while_its_constraints_fail_sleeps_until_they_hold():
    """With ``first_satisfied``, a job whose run (its first, or the next after a run) falls due
    while its constraints fail sleeps until they hold, as JobScheduler would; without it, it
    wakes when due and finds them unmet."""
    outcomes = {}
    for kind in (BusyWindows, ForeseenBusyWindows):
        clock = VirtualClock()
        t0 = clock.now()
        conditions = kind(clock, [(t0 + 30.0, t0 + 500.0), (t0 + 530.0, t0 + 900.0)])
        queue = WorkerQueue(clock, history=0)
        scheduler = ParticipationScheduler(
            None,
            conditions,
            clock=clock,
            queue=queue,
            settings=SchedulerSettings(recheck_s=60, jitter=0.0, watchdog=False, settle_s=0),
        )
        first = scheduler.schedule("digits", TrainingConstraints(), TrainingInterval(), start_at=t0 + 100.0)
        assert first.next_run_at == (t0 + 500.0 if kind is ForeseenBusyWindows else t0 + 100.0)
        outcomes[kind] = [(r.outcome, r.started_at - t0) for r in queue.run_until(t0 + 1000.0)]
    unmet, no_runtime = RunOutcome.CONSTRAINTS_UNMET, RunOutcome.NO_RUNTIME
    # due at 100 (busy until 500); then every 60 s without a runtime: due at 560, busy until 900
    assert outcomes[BusyWindows][:4] == [(unmet, 100.0), (no_runtime, 500.0), (unmet, 560.0), (no_runtime, 900.0)]
    assert outcomes[ForeseenBusyWindows][:2] == [(no_runtime, 500.0), (no_runtime, 900.0)]
    assert unmet not in {o for o, _ in outcomes[ForeseenBusyWindows]}


def test_a_work_meter_without_settle_is_refused_when_the_runtime_is_made(digits):
    class OnlyTrained:
        def trained(self, plan: Plan, examples: int) -> None:
            pass

    clock = VirtualClock()
    with pytest.raises(InvalidSetting, match="settle"):
        FLRuntime(
            "digits",
            "http://fl.test",
            _store(digits, 5, clock),
            plan_cache=MemoryPlanCache(),
            environment=RuntimeEnvironment(work_meter=OnlyTrained()),
        )


class StoppingMeter(CountingMeter):
    """Stops training by force at its second batch, as a simulation does at the device's time limit."""

    def trained(self, plan: Plan, examples: int) -> None:
        super().trained(plan, examples)
        if len(self.batches) == 2:
            _, reason = training_limit(plan, 600.0)
            raise TrainingInterrupted("stopped by force", reason=reason)


def test_training_a_work_meter_stops_is_interrupted_for_the_reason_it_gives(server, admin, digits):
    """A simulation stops a device's training at its time limit in virtual time (where no watchdog
    runs): the session records why, as a device stopped by its watchdog does, and tells the server."""
    deploy(admin, goal_count=5)
    clock = VirtualClock()
    meter = StoppingMeter()
    runtime = _metered_runtime(server, digits, clock, meter)
    result = runtime.run_session()
    assert result.outcome is Outcome.INTERRUPTED and len(meter.batches) == 2 and meter.settles == [2]
    assert result.events[-1].kind == "interrupted"
    assert result.events[-1].detail["reason"] == "over the device's training time (600.0 s, max_training_s)"


def test_devices_sharing_loaded_plans_still_each_download_the_plan_once(server, admin, digits):
    deploy(admin, goal_count=5)
    shared_bytes: dict[str, bytes] = {}
    loaded = LoadedPlans()
    clock = VirtualClock()
    runtimes = [
        FLRuntime(
            "digits",
            server.url,
            _store(digits, 20, clock),
            retry=FAST,
            rng=random.Random(i),
            plan_cache=MemoryPlanCache(shared_bytes),
            environment=RuntimeEnvironment(clock=clock.now, loaded_plans=loaded),
        )
        for i in range(2)
    ]
    for runtime in runtimes:
        received = runtime.client.bytes_received
        runtime.run_session()
        first = runtime.client.bytes_received - received
        assert runtime.cache_dir is None
        [plan_id] = list(runtime._plans)
        assert len(shared_bytes[plan_id]) < first  # the plan came over the wire
    assert runtimes[0]._executors[plan_id] is runtimes[1]._executors[plan_id]  # one onnxruntime session
    assert MemoryPlanCache(shared_bytes).get(plan_id) is None  # a new device has not downloaded it


def test_plan_caches_keep_only_intact_plans(tmp_path):
    data = b"plan bytes"
    pid = hashlib.sha256(data).hexdigest()
    memory, directory = MemoryPlanCache(), DirectoryPlanCache(tmp_path)
    for cache in (memory, directory):
        assert cache.get(pid) is None
        cache.put(pid, data)
        assert cache.get(pid) == data
    (tmp_path / "plans" / pid).write_bytes(b"tampered")
    assert directory.get(pid) is None
    memory.put("0" * 64, data)  # bytes that are not what the id names are not kept
    assert memory.get("0" * 64) is None


def test_a_directory_plan_cache_keeps_the_plans_used_last_and_no_more(tmp_path):
    """Every plan a server sent stayed on disk: a hostile server's new plan per session filled the phone."""
    cache = DirectoryPlanCache(tmp_path, keep=3)
    plans = [f"plan {i}".encode() for i in range(6)]
    ids = [hashlib.sha256(p).hexdigest() for p in plans]
    for i, (pid, data) in enumerate(zip(ids, plans)):
        cache.put(pid, data)
        os.utime(tmp_path / "plans" / pid, ns=(i * 10**9, i * 10**9))  # written a second apart
        if i == 2:
            assert cache.get(ids[0]) == plans[0]  # a hit: used now, so kept past the next writes
            os.utime(tmp_path / "plans" / ids[0], ns=(10 * 10**9, 10 * 10**9))
    kept = sorted(p.name for p in (tmp_path / "plans").iterdir())
    assert kept == sorted([ids[0], ids[4], ids[5]])
    assert all(cache.get(pid) == data for pid, data in zip(ids, plans) if pid in kept)
    with pytest.raises(ValueError, match="at least 1 plan"):
        DirectoryPlanCache(tmp_path, keep=0)


class CountingTransport(httpx.HTTPTransport):
    """Real HTTP, remembering each request's method and path."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(f"{request.method} {request.url.path}")
        return super().handle_request(request)


def test_policies_are_fetched_only_while_the_task_has_some_or_the_server_asks(server, admin, digits):
    """Most check-ins are rejected; for a task without eligibility policies each costs one
    request, not two, a fresh runtime's first included. When a task with policies follows, the
    server's ELIGIBILITY_REQUIRED makes the device evaluate them and check in again within the
    same session, and it then asks for the policies before each check-in."""
    plan, weights = deploy(admin, goal_count=1, over_selection=1.0, max_rounds=1)
    admin.deploy_task(
        "digits",
        "with-policies",
        plan,
        encode_checkpoint(weights),
        RoundConfig(goal_count=1, over_selection=1.0, min_reports=1),
        EligibilityPolicies(min_examples=10),
    )
    clock = VirtualClock()
    transport = CountingTransport()
    runtime = FLRuntime(
        "digits",
        server.url,
        _store(digits, 20, clock),
        retry=FAST,
        transport=transport,
        environment=RuntimeEnvironment(clock=clock.now),
    )
    first = runtime.run_session()
    assert first.task == "train"
    assert transport.paths[0] == "POST /v1/populations/digits/checkin"
    assert not any("eligibility" in p for p in transport.paths)
    transport.paths.clear()
    second = runtime.run_session()  # "train" is complete: "with-policies" needs a verdict
    assert second.task == "with-policies" and second.outcome.value == "completed"
    assert transport.paths[:3] == [
        "POST /v1/populations/digits/checkin",
        "GET /v1/populations/digits/eligibility",
        "POST /v1/populations/digits/checkin",
    ]
    transport.paths.clear()
    runtime.run_session()  # the last policies seen were not empty: they are read first
    assert transport.paths[:2] == ["GET /v1/populations/digits/eligibility", "POST /v1/populations/digits/checkin"]


def test_a_directory_plan_cache_keeps_no_more_bytes_than_its_bound(tmp_path):
    """Eight plans of the 1 GiB a device downloads were 8 GiB of a phone: past ``max_bytes`` the
    plans used longest ago go too, and the one just written stays whatever its size."""
    cache = DirectoryPlanCache(tmp_path, keep=8, max_bytes=250)
    plans = [bytes([i]) * size for i, size in enumerate((100, 100, 100, 40, 300))]
    ids = [hashlib.sha256(p).hexdigest() for p in plans]
    kept_after = []
    for i, (pid, data) in enumerate(zip(ids, plans)):
        cache.put(pid, data)
        os.utime(tmp_path / "plans" / pid, ns=(i * 10**9, i * 10**9))
        kept_after.append({ids.index(p.name) for p in (tmp_path / "plans").iterdir()})
    assert kept_after == [{0}, {0, 1}, {1, 2}, {1, 2, 3}, {4}]
