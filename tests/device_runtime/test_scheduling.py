"""Scheduling under conditions against a real server: persistence across app restarts, stopping
within the bound when conditions change, one session at a time across apps, a virtual day."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time

import numpy as np
import pytest

from device_runtime import (
    FLRuntime,
    PlanExecutor,
    RetryPolicy,
    RuntimeEnvironment,
    TrainingInterrupted,
    build_mlp_plan,
    initial_weights,
)
from device_runtime.clock import VirtualClock
from device_runtime.conditions import DeviceState, StaticConditions, TrainingConstraints, TrainingInterval
from device_runtime.executor import stoppable_run_options
from device_runtime.runtime import DEFAULT_RETRY_WINDOW_S
from device_runtime.scheduling import UNSETTLED, ParticipationScheduler, RunOutcome, SchedulerSettings, WorkerQueue
from emulator.devices.conditions import DiurnalConditions
from example_store import ExampleSelector, SQLiteExampleStore
from tests.support import COLLECTION, deploy, digits_plan

GOOD = DeviceState(idle=True, charging=True, battery_level=0.9, unmetered_network=True)
BUSY = DeviceState(idle=False, charging=True, battery_level=0.9, unmetered_network=True)
FAST = RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.02)


def _store(path, digits, n=64):
    store = SQLiteExampleStore(path)
    store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:n], digits.y_train[:n])))
    return store


def test_the_app_database_the_scheduler_makes_is_its_owners_only(tmp_path):
    old = os.umask(0o022)  # the usual umask, under which SQLite made the file 0644
    try:
        scheduler = ParticipationScheduler(tmp_path / "app.db", StaticConditions(GOOD), clock=VirtualClock())
        scheduler.schedule("keyboard")  # a job written: the log and its index made too
        made = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
        scheduler.close()
    finally:
        os.umask(old)
    assert made == dict.fromkeys(made, 0o600) and "app.db" in made


def test_jobs_survive_an_app_restart(tmp_path):
    db = tmp_path / "app.db"
    conditions = StaticConditions(GOOD)
    clock = VirtualClock()
    first = ParticipationScheduler(db, conditions, clock=clock)
    first.schedule(
        "keyboard",
        TrainingConstraints(requires_charging=False, requires_battery_not_low=True),
        TrainingInterval(True, 3600),
    )
    first.schedule("photos", start_at=clock.now() + 60)
    first.cancel("nothing-there")
    before = sorted(first.jobs(), key=lambda j: j.population)
    first.close()

    second = ParticipationScheduler(db, conditions, clock=clock)
    after = sorted(second.jobs(), key=lambda j: j.population)
    assert after == before
    assert after[0].constraints.requires_battery_not_low and after[0].interval.min_interval_s == 3600
    assert second.cancel("photos")
    assert [j.population for j in second.jobs()] == ["keyboard"]
    second.close()


def test_unmet_constraints_mean_no_session_and_a_later_recheck(tmp_path, server, admin, digits):
    deploy(admin, goal_count=5)
    clock = VirtualClock()
    conditions = StaticConditions(BUSY)
    scheduler = ParticipationScheduler(
        tmp_path / "app.db", conditions, clock=clock, settings=SchedulerSettings(recheck_s=600)
    )
    runtime = FLRuntime("digits", server.url, _store(tmp_path / "ex.db", digits), retry=FAST)
    scheduler.register_runtime("digits", runtime)
    scheduler.schedule("digits")
    [run] = scheduler.queue.run_pending()
    assert run.outcome is RunOutcome.CONSTRAINTS_UNMET and run.detail == "idle"
    assert 600 <= run.next_run_at - clock.now() <= 600 * 1.2
    assert admin.status("digits")["current_round"]["selected"] == 0
    conditions.state = GOOD
    assert scheduler.queue.run_until(clock.now() + 800)[-1].outcome is RunOutcome.COMPLETED
    assert scheduler.jobs() == []  # one-time participation is done


def test_an_error_a_later_session_may_not_meet_is_retried_in_the_servers_window_and_one_to_fix_at_the_recheck(
    tmp_path, server, admin, digits
):
    """``retryable`` says which: the server down (``ServerUnreachable``) comes back inside the retry
    window (the default one, before any server named one), an empty store (``NoExamples``, which
    fails the same way until the app adds examples) waits ``recheck_s``."""
    deploy(admin, "empty", goal_count=5)
    clock = VirtualClock()
    settings = SchedulerSettings(recheck_s=3600, settle_s=0)
    scheduler = ParticipationScheduler(tmp_path / "app.db", StaticConditions(GOOD), clock=clock, settings=settings)
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{closed.getsockname()[1]}"
    scheduler.register_runtime("digits", FLRuntime("digits", down, _store(tmp_path / "a.db", digits), retry=FAST))
    scheduler.register_runtime(
        "empty", FLRuntime("empty", server.url, SQLiteExampleStore(tmp_path / "b.db"), retry=FAST)
    )
    scheduler.schedule("digits")
    scheduler.schedule("empty")
    runs = {run.population: run for run in scheduler.queue.run_pending()}
    assert {p: r.outcome for p, r in runs.items()} == {"digits": RunOutcome.ERROR, "empty": RunOutcome.ERROR}
    assert runs["digits"].detail.startswith("ServerUnreachable") and runs["empty"].detail.startswith("NoExamples")
    low, high = DEFAULT_RETRY_WINDOW_S
    assert low <= runs["digits"].next_run_at - runs["digits"].ended_at <= high
    assert 3600 <= runs["empty"].next_run_at - runs["empty"].ended_at <= 3600 * 1.2
    scheduler.close()


class _TurnsBusyOnRead(SQLiteExampleStore):
    """The app's store, whose device turns busy as the session starts reading its examples."""

    def __init__(self, path, conditions: StaticConditions) -> None:
        super().__init__(path)
        self.conditions = conditions

    def query_batches(self, selector, batch_size):
        self.conditions.state = BUSY
        return super().query_batches(selector, batch_size)


def test_conditions_turning_false_stop_training_and_unsettle_the_job(tmp_path, server, admin, digits):
    plan = digits_plan("mlp", epochs=100_000)  # would train for a very long time
    deploy(admin, plan=plan, goal_count=5)
    conditions = StaticConditions(GOOD)
    settings = SchedulerSettings(poll_s=0.05, grace_s=0.5)
    scheduler = ParticipationScheduler(tmp_path / "app.db", conditions, settings=settings)
    store = _TurnsBusyOnRead(tmp_path / "ex.db", conditions)
    store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:64], digits.y_train[:64])))
    scheduler.register_runtime("digits", FLRuntime("digits", server.url, store, retry=FAST))
    scheduler.schedule("digits")
    [run] = scheduler.queue.run_pending()
    assert run.outcome is RunOutcome.INTERRUPTED
    assert run.session.shape == "-v[!"  # training started, then was stopped
    [stopped] = [e for e in run.session.events if e.kind == "interrupted"]
    assert stopped.detail["reason"] == "interrupted"  # by the conditions, not a time or memory budget
    # the conditions stopping to hold is what stopped it: the job waits for them to settle again
    [job] = scheduler.jobs()
    assert job.settle == UNSETTLED
    current = admin.status("digits")["current_round"]
    assert current["aborted"] == 1 and current["reported"] == 0
    assert admin.rounds("digits") == []  # no partial update was taken
    assert run.next_run_at is not None  # it will try again later


def test_forced_stop_ends_a_running_step(digits):
    plan = build_mlp_plan(784, (2048, 2048), 10, batch_size=2048, epochs=1000, selector=ExampleSelector(COLLECTION))
    executor = PlanExecutor(plan)
    rng = np.random.default_rng(0)
    batch = {"x": rng.random((2048, 784), dtype=np.float32), "y": rng.integers(0, 10, 2048)}
    options = stoppable_run_options()  # what the scheduler and runtime make
    threading.Timer(0.3, lambda: setattr(options, "terminate", True)).start()
    with pytest.raises(TrainingInterrupted, match="by force"):  # the step in flight, not between steps
        executor.run_device(
            initial_weights(plan), lambda: iter([batch]), should_abort=lambda: False, run_options=options
        )


def test_two_apps_share_one_worker_and_never_train_at_once(tmp_path, server, admin, digits):
    deploy(admin, "keyboard", goal_count=50)
    deploy(admin, "photos", goal_count=50)
    queue = WorkerQueue()
    conditions = StaticConditions(GOOD)
    apps = []
    for name in ("keyboard", "photos"):
        sched = ParticipationScheduler(tmp_path / f"{name}.db", conditions, app=name, queue=queue)
        sched.register_runtime(
            name, FLRuntime(name, server.url, _store(tmp_path / f"{name}-ex.db", digits), retry=FAST)
        )
        sched.schedule(name, interval=TrainingInterval(recurrent=True, min_interval_s=0.05))
        apps.append(sched)
    active = []
    overlap = []
    queue.on_run = active.append
    queue.start()
    deadline = time.monotonic() + 20
    while len([r for r in active if r.outcome is RunOutcome.COMPLETED]) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    queue.stop()
    runs = [r for r in queue.history if r.session is not None]
    assert len(runs) >= 6
    spans = sorted((r.started_at, r.ended_at) for r in runs)
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        if b0 < a1:
            overlap.append(((a0, a1), (b0, b1)))
    assert overlap == []
    order = [r.population for r in runs]
    assert {"keyboard", "photos"} <= set(order[:2])  # fair: both served before either twice
    for sched in apps:
        sched.close()


def test_a_virtual_day_of_scheduling_runs_in_seconds(tmp_path, server, admin, digits):
    deploy(admin, goal_count=1000, retry_window_s=(1800, 3600))
    clock = VirtualClock(start=1_767_225_600.0)  # midnight UTC
    conditions = DiurnalConditions(clock, utc_offset_h=0, night_start_h=1, night_end_h=6, seed=4)
    scheduler = ParticipationScheduler(
        tmp_path / "app.db", conditions, clock=clock, settings=SchedulerSettings(recheck_s=1200)
    )
    scheduler.register_runtime(
        "digits",
        FLRuntime(
            "digits",
            server.url,
            _store(tmp_path / "ex.db", digits),
            retry=FAST,
            environment=RuntimeEnvironment(clock=clock.now),
        ),
    )
    scheduler.schedule("digits", interval=TrainingInterval(recurrent=True, min_interval_s=3 * 3600))
    runs = scheduler.queue.run_until(clock.now() + 86_400)
    sessions = [r for r in runs if r.session is not None]
    assert 1 <= len(sessions) <= 3  # every 3 hours within a ~5 hour night
    for run in runs:
        hour = (run.started_at % 86_400) / 3600
        if run.outcome is RunOutcome.COMPLETED:
            assert conditions._start <= hour < conditions._end or conditions._start > conditions._end
        if run.outcome is RunOutcome.CONSTRAINTS_UNMET:
            assert run.detail
    assert sum(r.outcome is RunOutcome.CONSTRAINTS_UNMET for r in runs) > 20
    assert clock.now() == pytest.approx(1_767_225_600.0 + 86_400)


def test_closing_the_scheduler_while_its_job_runs_keeps_the_run_lock_until_the_job_ends(tmp_path):
    """``close`` during a job's run closed the run lock's descriptor under it: another process of
    the app (here a second scheduler on the database, with a descriptor of its own) ran the job
    beside it, and the job's end unlocked a closed descriptor (OSError)."""
    db, clock = tmp_path / "app.db", VirtualClock()
    app = ParticipationScheduler(db, StaticConditions(GOOD), clock=clock)
    other = ParticipationScheduler(db, StaticConditions(GOOD), clock=clock)
    app.schedule("keyboard")
    try:
        with app.claim("keyboard") as claim:
            assert claim == "run"
            app.close()  # from another thread of the app, as its job runs
            with other.claim("keyboard") as elsewhere:
                assert elsewhere == "busy"
        with other.claim("keyboard") as elsewhere:
            assert elsewhere == "run"
    finally:
        other.close()
