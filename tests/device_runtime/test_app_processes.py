"""Processes of one app on its database (the app and its background service, say).

- Opening a new database at the same moment: each opens its sealed example store, opstats log and
  scheduled jobs, where the first to create a table made the others fail ('table collections
  already exists').
- Running the app's jobs: a due job runs in one process at a time (the app database's run lock), so
  a device takes part once, where each process ran it and the device reported twice in one round."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from device_runtime import FLRuntime, OpStatsStore
from device_runtime.conditions import DeviceState, StaticConditions, TrainingConstraints, TrainingInterval
from device_runtime.scheduling import ParticipationScheduler, RunOutcome, SchedulerSettings, WorkerQueue
from example_store import SQLiteExampleStore
from tests.support import COLLECTION, ROOT, TrainingSeen, deploy, digits_plan

GOOD = DeviceState(idle=True, charging=True, battery_level=1.0, unmetered_network=True)

OPENER = """
import os, sys, time
sys.path.insert(0, sys.argv[4])  # the checkout
from device_runtime import OpStatsStore
from device_runtime.conditions import DeviceState, StaticConditions
from device_runtime.scheduling import ParticipationScheduler
from example_store import FileKeyStore, SQLiteExampleStore

folder, me, sealed = sys.argv[1], sys.argv[2], sys.argv[3] == "sealed"
db = os.path.join(folder, "app.db")
open(os.path.join(folder, f"ready-{me}"), "w").close()
while not os.path.exists(os.path.join(folder, "go")):
    time.sleep(0.0005)
try:
    SQLiteExampleStore(db, key_store=FileKeyStore(os.path.join(folder, "keys.json")) if sealed else None).close()
    OpStatsStore(db).close()
    ParticipationScheduler(db, StaticConditions(DeviceState(True, True, 1.0, True))).close()
    print("opened")
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
"""
PROCESSES = 2


@pytest.mark.parametrize("mode", ["sealed", pytest.param("plain", marks=pytest.mark.slow)])
def test_processes_opening_a_new_app_database_at_once_all_open_it(tmp_path, mode):
    script = tmp_path / "opener.py"
    script.write_text(OPENER)
    openers = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path), str(i), mode, str(ROOT)], stdout=subprocess.PIPE, text=True
        )
        for i in range(PROCESSES)
    ]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready-{i}").exists() for i in range(PROCESSES)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in openers)
        time.sleep(0.01)
    (tmp_path / "go").touch()
    said = [p.communicate(timeout=120)[0].strip() for p in openers]
    assert said == ["opened"] * PROCESSES

    from example_store import FileKeyStore, SQLiteExampleStore

    key_store = FileKeyStore(tmp_path / "keys.json") if mode == "sealed" else None
    with SQLiteExampleStore(tmp_path / "app.db", key_store=key_store) as store:
        assert store.sealed == (mode == "sealed")


def _app(db, url: str, conditions) -> tuple[ParticipationScheduler, OpStatsStore]:
    """One process's view of the app: its scheduler (with a worker of its own) and runtime on ``db``."""
    opstats = OpStatsStore(db)
    scheduler = ParticipationScheduler(db, conditions, queue=WorkerQueue(), settings=SchedulerSettings(settle_s=0))
    scheduler.register_runtime("digits", FLRuntime("digits", url, SQLiteExampleStore(db), opstats=opstats))
    return scheduler, opstats


def test_a_job_another_process_of_the_app_runs_is_left_to_it(tmp_path, server, admin, digits):
    """Two workers on one app database (as two processes of the app have): while one runs the due
    job's session, the other's ``run_pending`` leaves the job alone; it checked in too, and the
    device took part twice in one round."""
    deploy(admin, plan=digits_plan(epochs=100_000), goal_count=5)
    db = tmp_path / "app.db"
    store = SQLiteExampleStore(db)
    store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:64], digits.y_train[:64])))
    seen = TrainingSeen(GOOD)
    first, first_log = _app(db, server.url, seen)
    second, second_log = _app(db, server.url, StaticConditions(GOOD))
    first.schedule("digits", TrainingConstraints(), TrainingInterval(recurrent=False))
    first.queue.start()
    assert seen.training.wait(60)
    assert second.queue.run_pending() == [] and [job.population for job in second.jobs()] == ["digits"]
    first.queue.stop(timeout=60)  # its session interrupted, the job rescheduled by the process that ran it
    [run] = first.queue.history
    assert run.outcome is RunOutcome.INTERRUPTED
    current = admin.status("digits")["current_round"]
    assert current["selected"] == 1 and current["aborted"] == 1
    for scheduler in (first, second):
        scheduler.close()
    first_log.close(), second_log.close(), store.close()


APP = """
import sys, time
sys.path.insert(0, sys.argv[3])  # the checkout
from device_runtime import FLRuntime, OpStatsStore
from device_runtime.conditions import DeviceState, StaticConditions, TrainingConstraints, TrainingInterval
from device_runtime.scheduling import ParticipationScheduler, SchedulerSettings
from example_store import SQLiteExampleStore

db, url = sys.argv[1], sys.argv[2]
opstats = OpStatsStore(db)
scheduler = ParticipationScheduler(
    db, StaticConditions(DeviceState(True, True, 1.0, True)), settings=SchedulerSettings(settle_s=0)
)
scheduler.register_runtime("digits", FLRuntime("digits", url, SQLiteExampleStore(db), opstats=opstats))
scheduler.schedule("digits", TrainingConstraints(), TrainingInterval(recurrent=False), start_at=float(sys.argv[4]))
while time.time() < float(sys.argv[4]):
    time.sleep(0.005)
print([run.outcome.value for run in scheduler.queue.run_pending()])
"""


@pytest.mark.slow
def test_two_processes_of_an_app_run_a_due_job_once(tmp_path, server, admin, digits):
    """The same two processes as above, both alive at the job's due time, with a session that
    completes: the device reports once, and the opstats log keeps one session."""
    deploy(admin, plan=digits_plan(epochs=400), goal_count=5)
    db = tmp_path / "app.db"
    with SQLiteExampleStore(db) as store:
        store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:64], digits.y_train[:64])))
    script = tmp_path / "app.py"
    script.write_text(APP)
    at = str(time.time() + 8)  # after both have started
    apps = [
        subprocess.Popen(
            [sys.executable, str(script), str(db), server.url, str(ROOT), at], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    said = sorted(p.communicate(timeout=120)[0].strip() for p in apps)
    assert said == ["['completed']", "[]"]
    current = admin.status("digits")["current_round"]
    assert current["selected"] == 1 and current["reported"] == 1
    with OpStatsStore(db) as opstats:
        assert opstats.shape_counts() == {"-v[]+^": 1}
