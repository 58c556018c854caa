"""An app developer's mistakes with the runtime's calls, and the app's own code failing inside a
session: each is refused with ``InvalidSetting`` saying what is expected before anything is sent,
or ends the session as an error does (the server told, opstats keeping it), never blamed on the
server."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from device_runtime import (
    DeviceClass,
    EligibilityPolicies,
    FLRuntime,
    InvalidSetting,
    NoExamples,
    OpStatsStore,
    ProtocolError,
    RetryPolicy,
    RuntimeEnvironment,
    SecAggPolicy,
    encode_checkpoint,
    initial_weights,
)
from device_runtime.clock import SystemClock, VirtualClock
from device_runtime.conditions import DeviceState, StaticConditions, TrainingConstraints
from device_runtime.scheduling import ParticipationScheduler, RunOutcome, SchedulerSettings, WorkerQueue
from example_store import ExampleStoreError, InMemoryExampleStore, SQLiteExampleStore
from server_stub import RoundConfig
from tests.support import COLLECTION, deploy, digits_plan


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ({"opstats": "app.db"}, "opstats is an OpStatsStore"),
        ({"device_class": "big"}, "device_class is a DeviceClass"),
        ({"retry": 3}, "retry is a RetryPolicy"),
        ({"timeout_s": "10"}, "timeout_s is a finite number of seconds above 0"),
        ({"timeout_s": -1.0}, "timeout_s is a finite number"),
        ({"timeout_s": float("nan")}, "timeout_s is a finite number"),
        ({"cache_dir": 3}, "cache_dir is a folder's path"),
        ({"rng": 42}, r"rng is a random.Random \(random.Random\(seed\)\)"),
        ({"runtime_version": 1.17}, "runtime_version is a version string"),
        ({"environment": None}, "environment is a RuntimeEnvironment"),
        ({"timeout_s": 2**2000}, "timeout_s is a finite number"),  # an OverflowError
        ({"secagg_policy": {"min_group_size": 5}}, "secagg_policy is a SecAggPolicy"),
        ({"dp_policy": 1.0}, "dp_policy is a DPPolicy"),
        ({"attestor": "phone-key.pem"}, "attestor is this device's DeviceAttestor"),
        ({"trust_anchor": "trust.json"}, "trust_anchor is the authority's \\{key id: public key\\}"),
        ({"trust_anchor": {b"id": b"not a key"}}, "trust_anchor is not the authority's .* does not match"),
        ({"plan_cache": 5}, r"plan_cache is a PlanCache \(DirectoryPlanCache\(path\), MemoryPlanCache\(\)\)"),
        ({"plan_cache": "plans/"}, "plan_cache is a PlanCache"),
        ({"transport": 5}, r"transport is an httpx transport \(httpx.BaseTransport\) or None, not int 5"),
        ({"http_client": 5}, "http_client is an httpx.Client or None, not int 5"),
    ],
)
def test_settings_of_the_wrong_kind_are_refused_when_the_runtime_is_made(tmp_path, setting, match):
    """A path given as ``opstats`` was taken, and the session's events were lost when it ended (a
    warning in the log); a timeout of "10", a retry policy of 3 or a device class "big" failed in
    the middle of a session, or never."""
    with SQLiteExampleStore(tmp_path / "app.db") as store:
        with pytest.raises(InvalidSetting, match=match):
            FLRuntime("digits", "http://127.0.0.1:9", store, **setting)
        FLRuntime("digits", "http://127.0.0.1:9", store, device_class=DeviceClass("small", 512.0)).close()


def _digits_store(path, digits, n=40):
    store = SQLiteExampleStore(path)
    store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:n], digits.y_train[:n])))
    return store


def test_run_session_hooks_of_the_wrong_kind_are_refused_before_check_in(tmp_path, server, admin, digits):
    """``should_abort=True`` (a flag where a function goes) trained and then failed with a bare
    TypeError; an eligibility verdict of "yes" went to the server and came back a ProtocolError."""
    deploy(admin, goal_count=5)
    with _digits_store(tmp_path / "app.db", digits) as store, FLRuntime("digits", server.url, store) as runtime:
        with pytest.raises(InvalidSetting, match="should_abort is a function of no arguments or None, not True"):
            runtime.run_session(should_abort=True)
        with pytest.raises(InvalidSetting, match="before_report is a function"):
            runtime.run_session(before_report="later")
        with pytest.raises(InvalidSetting, match="eligibility is a verdict dict"):
            runtime.run_session(eligibility="yes")
    assert admin.status("digits")["current_round"]["selected"] == 0


def test_a_before_report_hook_that_raises_ends_the_session_as_an_error_the_server_told(tmp_path, server, admin, digits):
    """The app's ``before_report`` raised after training: the error reached the app, but the
    server was never told (it held the device's seat until the report window closed) and opstats
    kept the session as if it were still training to report ('-v[]')."""
    deploy(admin, goal_count=5)
    db = tmp_path / "app.db"

    def broken() -> None:
        raise RuntimeError("the app's hook failed")

    with _digits_store(db, digits) as store, OpStatsStore(db) as opstats:
        with FLRuntime("digits", server.url, store, opstats=opstats) as runtime:
            with pytest.raises(RuntimeError, match="the app's hook failed"):
                runtime.run_session(before_report=broken)
        assert opstats.shape_counts() == {"-v[]*": 1}
    current = admin.status("digits")["current_round"]
    assert current["aborted"] == 1 and current["reported"] == 0


def test_an_example_store_failing_at_eligibility_is_the_apps_error_not_the_servers(tmp_path, server, admin, digits):
    """A store the app had closed (or whose database was locked or damaged) failed the eligibility
    check as a ProtocolError saying the server sent a selector this runtime cannot use."""
    plan = digits_plan()
    admin.create_population("digits")
    config = RoundConfig(goal_count=5, min_reports=1)
    admin.deploy_task(
        "digits", "train", plan, encode_checkpoint(initial_weights(plan)), config, EligibilityPolicies(min_examples=5)
    )
    store = _digits_store(tmp_path / "app.db", digits)
    store.close()
    with FLRuntime("digits", server.url, store) as runtime:
        with pytest.raises(ExampleStoreError, match="is closed; open a new SQLiteExampleStore") as raised:
            runtime.run_session()
    assert not isinstance(raised.value, ProtocolError)


def test_a_plan_reading_a_collection_the_app_misspelt_says_which_it_meant(tmp_path, server, admin, digits):
    """The app added its examples to 'app:/digit' and the plan reads 'app:/digits': the session
    ended in NoExamples saying only that the selector matched nothing."""
    deploy(admin, goal_count=5)
    with SQLiteExampleStore(tmp_path / "app.db") as store, FLRuntime("digits", server.url, store) as runtime:
        store.add("app:/digit", ({"x": x, "y": y} for x, y in zip(digits.x_train[:8], digits.y_train[:8])))
        with pytest.raises(NoExamples, match=f"no collection '{COLLECTION}' \\(did you mean 'app:/digit'\\?"):
            runtime.run_session()


GOOD = DeviceState(idle=True, charging=True, battery_level=0.9, unmetered_network=True)
GOOD_NOW = StaticConditions(GOOD)


def test_constraints_settings_and_device_states_of_the_wrong_kind_are_refused():
    """``requires_unmetered_network="no"`` (a non-empty string, so true) was stored with the job and
    held; a negative ``poll_s`` had the watchdog spin for the whole session."""
    with pytest.raises(InvalidSetting, match="TrainingConstraints.requires_unmetered_network is True or False"):
        TrainingConstraints(requires_unmetered_network="no")  # type: ignore[arg-type]
    for bad in ({"poll_s": -1.0}, {"grace_s": float("inf")}, {"settle_s": "60"}, {"watchdog": "yes"}):
        with pytest.raises(InvalidSetting, match=f"SchedulerSettings.{next(iter(bad))} is"):
            SchedulerSettings(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("state", "match"),
    [
        (DeviceState(idle="no", charging=True, battery_level=0.9, unmetered_network=True), "DeviceState.idle is"),  # type: ignore[arg-type]
        (DeviceState(True, True, 90, True), "battery_level is a fraction from 0.0 to 1.0, not 90"),
        ({"idle": True}, "the device's conditions gave dict"),
    ],
)
def test_conditions_that_give_a_state_of_the_wrong_kind_are_named_at_the_jobs_first_run(state, match):
    """An app's ``current()`` that said idle="no" had the device train while the user used it."""
    scheduler = ParticipationScheduler(None, StaticConditions(state), clock=VirtualClock(0.0))  # type: ignore[arg-type]
    scheduler.schedule("digits")
    with pytest.raises(InvalidSetting, match=match):
        scheduler.queue.run_pending()


def test_an_on_run_callback_that_raises_is_logged_and_the_other_apps_jobs_still_run(caplog):
    """The app's ``on_run`` raised into the worker: the jobs due after the first were left for a
    minute (``idle_poll_s``), and ``run_pending`` raised to its caller."""
    queue = WorkerQueue(VirtualClock(0.0))
    for app in ("mail", "keyboard"):
        ParticipationScheduler(None, StaticConditions(GOOD), app=app, clock=queue.clock, queue=queue).schedule("digits")

    def broken(run: object) -> None:
        raise RuntimeError("the app's callback failed")

    queue.on_run = broken
    with caplog.at_level(logging.ERROR, logger="device_runtime.scheduling"):
        runs = queue.run_pending()
    assert sorted(run.app for run in runs) == ["keyboard", "mail"]
    assert all(run.outcome is RunOutcome.NO_RUNTIME for run in runs)
    assert caplog.text.count("the app's WorkerQueue.on_run failed") == 2


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda db: ParticipationScheduler(db, GOOD_NOW, settings={"poll_s": 1.0}), "settings is a SchedulerSettings"),
        (lambda db: ParticipationScheduler(db, GOOD_NOW, queue="worker"), "queue is the device's WorkerQueue"),
        (lambda db: ParticipationScheduler(db, GOOD_NOW, app=7), "app is a non-empty name"),
        (lambda db: ParticipationScheduler(db, GOOD_NOW, clock=1000.0), "clock is a Clock"),
        (lambda db: ParticipationScheduler(7, GOOD_NOW), "database is a file's path"),
        (lambda db: WorkerQueue(idle_poll_s=-1.0), "WorkerQueue.idle_poll_s is a finite number of seconds above 0"),
        (lambda db: WorkerQueue(history="10"), "WorkerQueue.history is a whole number"),
        (lambda db: OpStatsStore(None), "OpStatsStore's database is a file's path"),
        (lambda db: OpStatsStore(db, keep_sessions="10"), "keep_sessions is a whole number from 1 up"),
        (lambda db: DeviceClass("small", memory_mb="512"), "DeviceClass.memory_mb is a finite number of MB"),
        (lambda db: DeviceClass("small", max_training_s=-1.0), "DeviceClass.max_training_s is a finite number"),
        (lambda db: RetryPolicy(attempts=0), "RetryPolicy.attempts is a whole number from 1 up"),
    ],
)
def test_scheduler_queue_opstats_and_policies_refuse_settings_of_the_wrong_kind(tmp_path, make, match):
    """Each was taken and failed later, far from where it was given: settings as a dict at the
    first job run, a negative idle_poll_s as a worker polling without pause, memory_mb "512" at
    the first plan, RetryPolicy(attempts=0) as a session that never checked in."""
    with pytest.raises(InvalidSetting, match=match):
        make(tmp_path / "app.db")


class _FailingConditions(StaticConditions):
    """The app's conditions, whose service dies once the session trains."""

    def __init__(self) -> None:
        super().__init__(GOOD)
        self.reads = 0

    def current(self) -> DeviceState:
        self.reads += 1
        if self.reads > 2:
            raise OSError("the battery service died")
        return self.state


def test_conditions_that_raise_while_the_watchdog_reads_them_end_the_session_in_their_error(
    tmp_path, server, admin, digits, monkeypatch
):
    """The watchdog thread died of the app's exception ("Exception in thread fl-watchdog"), after
    which nothing would stop a step in flight when the conditions changed."""
    deploy(admin, plan=digits_plan(epochs=100_000), goal_count=5)
    died: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    db = tmp_path / "app.db"
    with _digits_store(db, digits) as store, OpStatsStore(db) as opstats:
        settings = SchedulerSettings(poll_s=0.01, grace_s=0.05)
        with ParticipationScheduler(db, _FailingConditions(), settings=settings) as scheduler:
            scheduler.register_runtime("digits", FLRuntime("digits", server.url, store, opstats=opstats))
            scheduler.schedule("digits")
            [run] = scheduler.queue.run_pending()
        assert run.outcome is RunOutcome.ERROR and run.detail == "OSError: the battery service died"
        assert [s.shape[-1] for s in opstats.sessions()] in (["*"], ["!"])  # its error, or stopped by force
    assert died == []
    assert admin.status("digits")["current_round"]["aborted"] == 1


def test_a_runtime_registered_under_another_population_or_a_misspelt_job_is_named(tmp_path):
    """A runtime registered under a name not its population's had one population's job train
    another's plans; a job scheduled for 'digit' beside the runtime of 'digits' said only 'no
    runtime registered for it' at each run, every recheck_s, for ever."""
    scheduler = ParticipationScheduler(None, GOOD_NOW, clock=VirtualClock(0.0))
    with InMemoryExampleStore() as store, FLRuntime("digits", "http://127.0.0.1:9", store) as runtime:
        with pytest.raises(
            InvalidSetting, match="register_runtime\\('digit', ...\\) was given the runtime of population"
        ):
            scheduler.register_runtime("digit", runtime)
        scheduler.register_runtime("digits", runtime)
        scheduler.schedule("digit")
        [run] = scheduler.queue.run_pending()
    assert run.outcome is RunOutcome.NO_RUNTIME
    assert run.detail == "no runtime registered for it (runtimes are registered for ['digits']: did you mean 'digits'?)"


def test_a_scheduler_given_a_queue_alone_follows_the_queues_clock():
    """``ParticipationScheduler(queue=q)`` read due times on the system clock while ``q`` ran on
    a VirtualClock at 0: its jobs, due some 1.7e9 s ahead, never ran under ``run_until``."""
    queue = WorkerQueue(VirtualClock(0.0))
    scheduler = ParticipationScheduler(None, GOOD_NOW, queue=queue)
    assert scheduler.clock is queue.clock
    assert scheduler.schedule("digits").next_run_at == 0.0
    assert [run.outcome for run in queue.run_until(10.0)] == [RunOutcome.NO_RUNTIME]
    with pytest.raises(InvalidSetting, match="is not the clock of the queue .* pass clock=queue.clock"):
        ParticipationScheduler(None, GOOD_NOW, clock=VirtualClock(0.0), queue=queue)
    ParticipationScheduler(None, GOOD_NOW, clock=SystemClock(), queue=WorkerQueue(SystemClock())).close()


def test_a_store_asked_for_with_a_collection_that_is_not_a_string_is_refused_saying_what_to_give():
    """``store_for(5)`` failed with "'int' object has no attribute 'startswith'"."""
    with InMemoryExampleStore() as store, FLRuntime("digits", "http://127.0.0.1:9", store) as runtime:
        with pytest.raises(InvalidSetting, match="store_for takes a collection URI such as 'app:/digits' .* not int 5"):
            runtime.store_for(5)  # type: ignore[arg-type]
        assert runtime.store_for(COLLECTION) is store


def test_a_store_registered_under_a_uri_serves_the_uris_under_it_not_those_that_begin_alike():
    """``{"app:/digits": store}`` served a plan reading ``app:/digits_heldout`` (the held-out
    collection the shipped evaluation task names): registration matched the first letters."""
    with InMemoryExampleStore() as digits, InMemoryExampleStore() as every:
        stores = {"app:/digits": digits, "app:/": every}
        with FLRuntime("digits", "http://127.0.0.1:9", stores) as runtime:
            for uri in ("app:/digits", "app:/digits/recent", "app:/digits?since=0", "app:/digits#a"):
                assert runtime.store_for(uri) is digits, uri
            for uri in ("app:/digits_heldout", "app:/digitsx", "app:/other"):
                assert runtime.store_for(uri) is every, uri
        with FLRuntime("digits", "http://127.0.0.1:9", {"app:/digits": digits}) as runtime:
            with pytest.raises(NoExamples, match="no example store is registered for collection 'app:/digits_heldout'"):
                runtime.store_for("app:/digits_heldout")
        for scheme in ("app:", "app"):
            with FLRuntime("digits", "http://127.0.0.1:9", {scheme: every}) as runtime:
                assert runtime.store_for("app:/anything") is every
                with pytest.raises(NoExamples):
                    runtime.store_for("apps:/anything")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: WorkerQueue(time.time), "WorkerQueue's clock is a Clock \\(SystemClock\\(\\), VirtualClock\\(t\\)\\)"),
        (lambda: WorkerQueue().run_until(60.0), "run_until drives virtual time: it needs a queue on a VirtualClock"),
        (lambda: WorkerQueue(VirtualClock(0.0)).run_until("60"), "run_until's end is a finite number"),
        (lambda: VirtualClock("2026-01-01"), "VirtualClock's start is a finite number of unix seconds"),
        (lambda: VirtualClock().advance(float("nan")), "VirtualClock.advance's seconds .* is a finite number"),
        (lambda: VirtualClock().advance_to(None), "VirtualClock.advance_to's time is a finite number"),
        (lambda: VirtualClock().sleep("5"), "VirtualClock.sleep's seconds is a finite number of seconds"),
        (lambda: VirtualClock().sleep(float("nan")), "VirtualClock.sleep's seconds is a finite number"),
        (lambda: SystemClock().sleep("5"), "SystemClock.sleep's seconds is a finite number of seconds"),
        (lambda: SystemClock().sleep(None, threading.Event()), "SystemClock.sleep's seconds is a finite number"),
        (
            lambda: ParticipationScheduler(None, GOOD_NOW, clock=VirtualClock(0.0)).schedule(
                "digits", start_at=2**2000
            ),
            "start_at is a finite number of seconds on the scheduler's clock",
        ),
        (lambda: RuntimeEnvironment(clock=SystemClock()), "RuntimeEnvironment's clock is a function \\(time.time"),
        (lambda: RuntimeEnvironment(sleep=None), "RuntimeEnvironment's sleep is a function"),
        (lambda: RuntimeEnvironment(secagg_poll_s="1"), "RuntimeEnvironment's secagg_poll_s is a finite number"),
        (lambda: RuntimeEnvironment(work_meter=object()), "work_meter object needs trained"),
        (lambda: SecAggPolicy(min_group_size="5"), "SecAggPolicy.min_group_size is a whole number from 2 up"),
        (lambda: SecAggPolicy(min_group_size=1), "SecAggPolicy.min_group_size is a whole number from 2 up"),
        (lambda: SecAggPolicy(eta=2.5), "SecAggPolicy.eta is a whole number from 1 up"),
        (lambda: SecAggPolicy(dropout_rate=float("nan")), "SecAggPolicy.dropout_rate is a fraction from 0 up to"),
        (lambda: SecAggPolicy(require_attested_cohort="no"), "SecAggPolicy.require_attested_cohort is True or False"),
    ],
)
def test_clocks_environments_and_secagg_policies_refuse_values_of_the_wrong_kind(make, match):
    """Each failed with a bare TypeError, ValueError or OverflowError, or later: ``time.time`` as
    a queue's clock at the first job ("no attribute 'now'"), ``SystemClock()`` as an environment's
    clock at the first session, a NaN advance as a virtual clock stuck at NaN, a policy's flag of
    "no" held as true."""
    with pytest.raises(InvalidSetting, match=match):
        make()
