"""An app's lifecycle around the SDK, as a new app developer meets it: stopping the app while a
session trains, arguments of the wrong type, objects used after they were closed, an app database
that is not one, and a stored job that can no longer be read."""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import tempfile
import threading
import time

import httpx
import numpy as np
import onnxruntime
import pytest

from device_runtime import FLRuntime, InvalidSetting, OpStatsStore, Outcome, SessionInProgress, stoppable_run_options
from device_runtime.clock import SystemClock, VirtualClock
from device_runtime.conditions import DeviceState, StaticConditions, TrainingConstraints, TrainingInterval
from device_runtime.opstats import AppDatabaseError
from device_runtime.plan_builder import build_mlp_plan
from device_runtime.scheduling import (
    ParticipationScheduler,
    RunOutcome,
    ScheduledJob,
    SchedulerSettings,
    WorkerQueue,
)
from example_store import ExampleSelector, ExampleStoreError, FileKeyStore, InMemoryExampleStore, SQLiteExampleStore
from tests.support import COLLECTION, TrainingSeen, deploy, digits_plan

GOOD = DeviceState(idle=True, charging=True, battery_level=0.9, unmetered_network=True)


def test_stopping_the_app_interrupts_the_session_it_is_training(tmp_path, server, admin, digits):
    """``WorkerQueue.stop`` while a session trains (an app being closed): the session stops as when
    its conditions stop holding, the server is told and takes no update, opstats keep an
    interrupted session, and the job stays for the next app start. The worker let the session
    train on (for ever here) past its timeout, with the app's database closed under it."""
    deploy(admin, plan=digits_plan(epochs=100_000), goal_count=5)
    db = tmp_path / "app.db"
    store = SQLiteExampleStore(db)
    store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:64], digits.y_train[:64])))
    opstats = OpStatsStore(db)
    conditions = TrainingSeen(GOOD)
    scheduler = ParticipationScheduler(db, conditions)
    scheduler.register_runtime("digits", FLRuntime("digits", server.url, store, opstats=opstats))
    scheduler.schedule("digits", TrainingConstraints(), TrainingInterval(recurrent=True, min_interval_s=3600))
    scheduler.queue.start()
    assert conditions.training.wait(60)
    scheduler.queue.stop(timeout=60)
    [run] = scheduler.queue.history
    assert run.outcome is RunOutcome.INTERRUPTED and run.next_run_at is not None
    current = admin.status("digits")["current_round"]
    assert current["aborted"] == 1 and current["reported"] == 0
    assert opstats.shape_counts() == {"-v[!": 1}
    scheduler.close()
    restarted = ParticipationScheduler(db, conditions)
    assert [job.population for job in restarted.jobs()] == ["digits"]
    restarted.close()
    opstats.close()
    store.close()


@pytest.mark.parametrize("closer", ["another thread", "the session's own hook"])
def test_closing_a_runtime_while_its_session_trains_interrupts_it_the_server_told(
    tmp_path, server, admin, digits, closer
):
    """An app that closes its runtime (shutting down) while a session trains on another thread:
    the session stops at its next step as by ``should_abort``, the server is told and takes no
    update, opstats keep it interrupted, and ``close`` returns once it has ended. The session
    trained on with its HTTP client and plan cache closed under it, and failed at its report in
    httpx's RuntimeError, the server not told."""
    deploy(admin, plan=digits_plan(epochs=100_000), goal_count=5)
    store = InMemoryExampleStore()
    store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:64], digits.y_train[:64])))
    opstats = OpStatsStore(tmp_path / "app.db")
    runtime = FLRuntime("digits", server.url, store, opstats=opstats)  # a plan cache of its own
    steps = 0
    training = threading.Event()

    def step() -> bool:
        nonlocal steps
        steps += 1
        if steps == 20:
            training.set()
            if closer == "the session's own hook":
                runtime.close()
        return False

    ended: list = []
    session = threading.Thread(target=lambda: ended.append(runtime.run_session(should_abort=step)), daemon=True)
    session.start()
    assert training.wait(60)
    runtime.close()
    assert not session.is_alive() or closer != "another thread"  # close returned once the session had ended
    session.join(60)
    [result] = ended
    assert result.outcome is Outcome.INTERRUPTED and result.shape == "-v[!"
    current = admin.status("digits")["current_round"]
    assert current["aborted"] == 1 and current["reported"] == 0
    assert opstats.shape_counts() == {"-v[!": 1}
    assert runtime.cache_dir is not None and not runtime.cache_dir.exists()
    with pytest.raises(InvalidSetting, match="closed"):
        runtime.run_session()
    opstats.close()


def _closed_in_first_step(runtime: FLRuntime, run_options: onnxruntime.RunOptions | None) -> tuple:
    """The session's result and the seconds ``close`` took, called from this thread while the
    session's first training step runs on another."""
    training = threading.Event()

    def first_step() -> bool:  # asked before every step: the first starts right after
        training.set()
        return False

    ended: list = []
    session = threading.Thread(
        target=lambda: ended.append(runtime.run_session(should_abort=first_step, run_options=run_options)),
        daemon=True,
    )
    session.start()
    assert training.wait(60)
    time.sleep(0.1)  # well inside the first step
    started = time.monotonic()
    runtime.close()
    closing_s = time.monotonic() - started
    session.join(60)
    [result] = ended
    return result, closing_s


def test_closing_a_runtime_stops_a_training_step_in_flight(tmp_path, server, admin, digits):
    """``close`` while one long training step runs (a large batch here; a big model on a slow
    device): the step is stopped by force through the session's run options (the runtime's own,
    then the app's), ``close`` returns at once, the session ends interrupted with the server told
    and no update taken, and the app's run options run again after. The step ran to its end
    (seconds here) before ``close`` returned."""
    batch = 32768  # one step of 3-5 s on one core: a close that waited for it would take seconds
    plan = build_mlp_plan(64, (1024, 1024), 10, batch_size=batch, epochs=1000, selector=ExampleSelector(COLLECTION))
    deploy(admin, plan=plan, goal_count=5)
    store = InMemoryExampleStore()
    rows = np.arange(batch) % len(digits.x_train)
    store.add(COLLECTION, ({"x": digits.x_train[i], "y": digits.y_train[i]} for i in rows))
    opstats = OpStatsStore(tmp_path / "app.db")
    for run_options in (None, stoppable_run_options()):
        runtime = FLRuntime("digits", server.url, store, opstats=opstats)
        result, closing_s = _closed_in_first_step(runtime, run_options)
        assert closing_s < 1.5  # a close on a loaded machine takes tenths of a second (the abort's request)
        assert result.outcome is Outcome.INTERRUPTED and result.shape == "-v[!"
        [stopped] = [e for e in result.events if e.kind == "interrupted"]
        assert stopped.detail["reason"] == "interrupted"
        assert run_options is None or not run_options.terminate  # the app's run again
    current = admin.status("digits")["current_round"]
    assert current["aborted"] == 2 and current["reported"] == 0
    assert opstats.shape_counts() == {"-v[!": 2}
    opstats.close()


def test_wrong_arguments_are_refused_before_anything_is_stored(tmp_path):
    """Constraints and interval swapped were stored, and the job could not be read back: every
    ``jobs()`` and every run of the worker raised a TypeError, after a restart too."""
    db = tmp_path / "app.db"
    scheduler = ParticipationScheduler(db, StaticConditions(GOOD))
    with pytest.raises(InvalidSetting, match="TrainingConstraints and a TrainingInterval"):
        scheduler.schedule("digits", TrainingInterval(True, 3600), TrainingConstraints())
    with pytest.raises(InvalidSetting, match="population"):
        scheduler.schedule(42)
    with pytest.raises(InvalidSetting, match="start_at"):
        scheduler.schedule("digits", start_at="now")
    with pytest.raises(InvalidSetting, match="FLRuntime"):
        scheduler.register_runtime("digits", SQLiteExampleStore(tmp_path / "ex.db"))
    with pytest.raises(InvalidSetting, match="min_interval_s"):
        TrainingInterval(True, "3600")
    with pytest.raises(InvalidSetting, match="current"):
        ParticipationScheduler(db, GOOD)
    assert scheduler.jobs() == [] and scheduler.queue.run_pending() == []
    scheduler.close()
    restarted = ParticipationScheduler(db, StaticConditions(GOOD))
    assert restarted.jobs() == []
    restarted.close()


def test_closed_objects_say_so(tmp_path):
    scheduler = ParticipationScheduler(tmp_path / "app.db", StaticConditions(GOOD))
    scheduler.close()
    scheduler.close()  # idempotent
    with pytest.raises(AppDatabaseError, match="closed"):
        scheduler.schedule("digits")
    with pytest.raises(AppDatabaseError, match="closed"):
        scheduler.jobs()
    opstats = OpStatsStore(tmp_path / "app.db")
    opstats.close()
    with pytest.raises(AppDatabaseError, match="closed; open a new OpStatsStore"):
        opstats.sessions()  # it opened the database again, silently
    with SQLiteExampleStore(tmp_path / "ex.db") as store:
        pass
    with pytest.raises(ExampleStoreError, match="closed"), store:  # a closed store reused in a with
        pass
    memory = InMemoryExampleStore()
    memory.close()
    with pytest.raises(ExampleStoreError, match="closed"), memory:
        pass


@pytest.mark.parametrize("what", ["not sqlite", "no folder"])
def test_an_app_database_that_cannot_be_opened_is_a_typed_error_naming_it(tmp_path, what):
    db = tmp_path / "app.db"
    if what == "not sqlite":
        db.write_bytes(b"this is the app's settings, not a database\n" * 50)
    else:
        db = tmp_path / "missing" / "app.db"
    with pytest.raises(AppDatabaseError, match=f"could not open the opstats log in the app's database {db}"):
        OpStatsStore(db)
    with pytest.raises(AppDatabaseError, match=f"could not open the scheduled jobs in the app's database {db}"):
        ParticipationScheduler(db, StaticConditions(GOOD))


def test_a_stored_job_that_cannot_be_read_is_passed_over_and_said_once_not_in_a_loop(tmp_path, caplog):
    """A job an earlier version stored with its constraints and interval swapped fails every time
    it is read: the worker tried it again at once, for ever (a loop logging a traceback per turn),
    then failed every poll, which ran no other job of any app. It is passed over, said once in the
    log, and its due time wakes no one. Scheduling it again replaces it."""
    clock = VirtualClock()
    queue = WorkerQueue(clock, idle_poll_s=60.0)
    scheduler = ParticipationScheduler(tmp_path / "app.db", StaticConditions(GOOD), clock=clock, queue=queue)
    unreadable = ScheduledJob("digits", clock.now(), TrainingInterval(True, 60), TrainingConstraints())
    scheduler._jobs.put(unreadable)
    with caplog.at_level(logging.WARNING, logger="device_runtime.scheduling"):
        assert queue.next_wakeup() is None
        assert queue.run_until(clock.now() + 600) == []
    said = [r for r in caplog.records if r.name == "device_runtime.scheduling"]
    assert [r.levelno for r in said] == [logging.WARNING] and "'digits'" in said[0].getMessage(), said
    scheduler.schedule("digits", TrainingConstraints(), TrainingInterval(True, 60))
    assert [job.interval for job in scheduler.jobs()] == [TrainingInterval(True, 60)]
    scheduler.close()


class SetClock(SystemClock):
    """The system's clock, which the test sets as a user does in the phone's settings."""

    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> float:
        return super().now() + self.offset


class SetWhileRead(StaticConditions):
    """Conditions that do not hold, read while the user sets the clock a day back."""

    def __init__(self, clock: SetClock) -> None:
        super().__init__(DeviceState(idle=False, charging=True, battery_level=0.9, unmetered_network=True))
        self.clock = clock

    def current(self) -> DeviceState:
        self.clock.offset -= 86_400
        return self.state


def test_jobs_keep_their_delays_when_the_user_sets_the_clock(tmp_path):
    """A clock set a day back made a job due in an hour wait a day and an hour; set a year ahead,
    every job ran at once. Due times now move with the clock, but a job rescheduled on the new
    clock, and one scheduled after the change."""
    clock = SetClock()
    settings = SchedulerSettings(recheck_s=600.0)
    scheduler = ParticipationScheduler(tmp_path / "app.db", SetWhileRead(clock), clock=clock, settings=settings)

    def due_in() -> dict[str, float]:
        return {job.population: job.next_run_at - clock.now() for job in scheduler.jobs()}  # type: ignore[operator]

    scheduler.schedule("digits", start_at=clock.now() + 3600)
    for offset in (-86_400.0, 365 * 86_400.0):
        clock.offset = offset
        assert scheduler.queue.run_pending() == []
        assert 3500 < due_in()["digits"] <= 3600
    scheduler.schedule("photos", start_at=clock.now())  # due now: set back a day while it runs
    [run] = scheduler.queue.run_pending()
    assert run.outcome is RunOutcome.CONSTRAINTS_UNMET
    assert 600 <= due_in()["photos"] <= 600 * (1 + settings.jitter)  # rescheduled on the new clock
    assert 3500 < due_in()["digits"] <= 3600
    scheduler.close()


@pytest.mark.slow
def test_the_job_store_waits_for_a_lock_another_process_holds_as_the_example_store_does(tmp_path):
    """An add of the app's (another process) holds the database's write lock for 6 s: the job
    store waits for it as the example store and opstats do (30 s), where it gave up after 5 s, and
    a session's job was not rescheduled (it ran again at the worker's next poll)."""
    db = tmp_path / "app.db"
    scheduler = ParticipationScheduler(db, StaticConditions(GOOD))
    holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    release = threading.Timer(6.0, holder.rollback)
    release.start()
    try:
        scheduler.schedule("digits")
    finally:
        release.join()
        holder.close()
    assert [job.population for job in scheduler.jobs()] == ["digits"]
    scheduler.close()


def test_two_runtimes_of_one_population_over_one_store_take_part_once_at_a_time(tmp_path, server, admin, digits):
    """A second call on a runtime whose session runs (from another thread) is refused at once
    (``SessionInProgress``): it waited, checked in as the first ended and could join its round.
    An app that builds a runtime per screen: two runtimes of one population over one store, the
    second's ``run_session`` called while the first's session trains. Both checked in and took
    part in one round, the server counting the device twice; the second is now refused at once
    (``SessionInProgress``, nothing sent), and so is one over the same SQLite file opened again
    through a link. A runtime of another population over that store, and one of the same
    population over another store (a simulated fleet's devices), take part as before."""
    deploy(admin, goal_count=5)
    deploy(admin, "other", goal_count=5)
    path = tmp_path / "app.db"
    store = SQLiteExampleStore(path)
    store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:32], digits.y_train[:32])))
    (tmp_path / "link.db").symlink_to(path)
    elsewhere = InMemoryExampleStore()
    elsewhere.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:32], digits.y_train[:32])))
    first = FLRuntime("digits", server.url, store)
    training, go = threading.Event(), threading.Event()

    def hold() -> bool:
        training.set()
        return not go.wait(60)

    ended: list = []
    session = threading.Thread(target=lambda: ended.append(first.run_session(should_abort=hold)), daemon=True)
    session.start()
    assert training.wait(60)
    try:
        again: list = []

        def second_call() -> None:
            try:
                first.run_session()
            except SessionInProgress as exc:
                again.append(exc)

        # the same runtime called again from another thread: it waited and checked in as the first ended
        caller = threading.Thread(target=second_call, daemon=True)
        caller.start()
        caller.join(10)
        assert not caller.is_alive() and len(again) == 1
        assert "this FLRuntime of population 'digits' is running a session" in str(again[0])
        linked = SQLiteExampleStore(tmp_path / "link.db")
        for screen_store in (store, linked, {"app:/": linked}):
            with FLRuntime("digits", server.url, screen_store) as second:
                with pytest.raises(SessionInProgress, match="another FLRuntime of population 'digits'.*app.db"):
                    second.run_session()
        with FLRuntime("other", server.url, store) as other, FLRuntime("digits", server.url, elsewhere) as own:
            assert other.run_session(should_abort=lambda: True).shape == "-v[!"
            assert own.run_session(should_abort=lambda: True).shape == "-v[!"
        linked.close()
    finally:
        go.set()
        session.join(60)
    [result] = ended
    assert result.outcome is Outcome.COMPLETED
    current = admin.status("digits")["current_round"]
    assert current["reported"] == 1 and current["aborted"] == 1  # the first's report, the own store's abort
    with first:
        assert first.run_session(should_abort=lambda: True).shape == "-v[!"  # the claim ended with the session
    store.close()


def test_closing_a_runtime_its_own_hook_closed_lets_the_session_tell_the_server(tmp_path, server, admin, digits):
    """The session's hook closes the runtime and the app's shutdown closes it again while the
    session sends its abort: the second close cut that request short, and the server was not told."""
    deploy(admin, goal_count=5)
    store = InMemoryExampleStore()
    store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:32], digits.y_train[:32])))
    runtime = FLRuntime("digits", server.url, store)
    aborting, closing = threading.Event(), threading.Event()

    def on_request(request: httpx.Request) -> None:  # the runtime's own client, before it sends
        if request.url.path.endswith("/abort"):
            aborting.set()
            closing.wait(10)
            time.sleep(0.1)  # the app's close has run by now

    runtime.client.http.event_hooks["request"].append(on_request)

    def hook() -> bool:
        runtime.close()
        return False

    ended: list = []
    session = threading.Thread(target=lambda: ended.append(runtime.run_session(should_abort=hook)), daemon=True)
    session.start()
    assert aborting.wait(60)
    closing.set()
    runtime.close()
    session.join(60)
    assert ended[0].shape == "-v[!"
    assert admin.status("digits")["current_round"]["aborted"] == 1


def test_an_app_that_took_part_writes_only_the_files_the_tutorial_lists_and_each_its_owners_only(
    tmp_path, server, admin, digits, monkeypatch
):
    """What docs/tutorials/app-developer.md (Deleting what the app keeps) tells an app to remove
    when it is uninstalled is every file the SDK wrote: nothing in the temp folder but
    onnxruntime's own, nothing else in the app's folder; and no other user may read any of them."""
    deploy(admin)
    temp, app = tmp_path / "temp", tmp_path / "app"
    temp.mkdir()
    app.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    old = os.umask(0o022)
    try:
        store = SQLiteExampleStore(app / "app.db", key_store=FileKeyStore(app / "keystore.json"))
        store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:20], digits.y_train[:20])))
        opstats = OpStatsStore(app / "app.db")
        runtime = FLRuntime("digits", server.url, store, cache_dir=app / "fl-cache", opstats=opstats)
        scheduler = ParticipationScheduler(app / "app.db", StaticConditions(GOOD), clock=VirtualClock())
        scheduler.register_runtime("digits", runtime)
        scheduler.schedule("digits")
        assert scheduler.run_job("digits").outcome is RunOutcome.COMPLETED
        written = {p.relative_to(app).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in app.rglob("*")}
        scheduler.close()
        runtime.close()
        opstats.close()
        store.close()
    finally:
        os.umask(old)
    [plan] = [name for name in written if name.startswith("fl-cache/plans/")]
    listed = ("app.db", "app.db-wal", "app.db-shm", "app.db.run.lock", "keystore.json", "keystore.json.lock")
    assert set(written) == {*listed, "fl-cache", "fl-cache/plans", plan}
    assert {name: mode for name, mode in written.items() if mode & 0o077} == {}
    assert [p.name for p in temp.iterdir()] in ([], [".ses"])  # onnxruntime's, once per process
