"""The app's database on a full disk (a process whose file size limit is reached, RLIMIT_FSIZE, in
a process of its own): a write fails whole, with a typed error that says to free space (where it
said to move the file aside or delete it, the app's data with it), and the store opens again
with what was committed. The example store, the key store, opstats, the scheduler's jobs, and a
session whose disk fills just before its update leaves (then sent nothing, the server told)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT, deploy

FULL_DISK_APP = """
import json, os, resource, sys
sys.path.insert(0, sys.argv[2])  # the checkout
import numpy as np
from device_runtime import FLRuntime, OpStatsStore
from device_runtime.conditions import DeviceState, StaticConditions
from device_runtime.opstats import AppDatabaseError, Event
from device_runtime.scheduling import ParticipationScheduler, SchedulerSettings
from example_store import ExampleSelector, ExampleStoreError, FileKeyStore, RetentionPolicy, SQLiteExampleStore

folder = sys.argv[1]
db = os.path.join(folder, "app.db")
store = SQLiteExampleStore(db, key_store=FileKeyStore(os.path.join(folder, "keys.json")))
store.add("app:/digits", [{"x": np.zeros(64, np.float32), "y": np.int64(1)}] * 10)
now = [1.8e9]  # the clock of a store whose examples age while the disk is full
aging = SQLiteExampleStore(db, key_store=FileKeyStore(os.path.join(folder, "keys.json")), clock=lambda: now[0])
aging.set_retention("app:/recent", RetentionPolicy(ttl_seconds=1000))
aging.add("app:/recent", [{"x": np.zeros(4, np.float32)}] * 30, timestamps=[now[0] - 500] * 30)
aging.add("app:/recent", [{"x": np.ones(4, np.float32)}] * 20, timestamps=[now[0]] * 20)
opstats = OpStatsStore(db)
scheduler = ParticipationScheduler(db, StaticConditions(DeviceState(True, True, 1.0, True)), settings=SchedulerSettings(watchdog=False))
scheduler.schedule("digits")
errors = {}
runtime = FLRuntime("digits", sys.argv[3], store, opstats=opstats, cache_dir=os.path.join(folder, "cache"))


def disk_full():  # trained, the update about to leave: no file may grow now
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))


try:
    runtime.run_session(before_report=disk_full)
except AppDatabaseError as exc:  # the session could not be kept before its upload
    errors["upload"] = str(exc)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
used = sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))
resource.setrlimit(resource.RLIMIT_FSIZE, (used + 100_000, used + 100_000))  # a disk with 100 kB left
try:
    store.add("app:/digits", [{"x": np.ones(64, np.float32), "y": np.int64(2)}] * 2000)
except ExampleStoreError as exc:
    errors["add"] = str(exc)
try:
    for i in range(100):
        opstats.record_session(f"session-{i}", "digits", "train", [Event("checkin", 1.0, {"note": "x" * 10_000})])
except AppDatabaseError as exc:
    errors["opstats"] = str(exc)
errors["count"] = store.count(ExampleSelector("app:/digits"))
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # no file may grow now: the disk is full
now[0] += 600  # the older 30 are past their TTL, and SQLite has no room to delete them
try:
    errors["recent"] = [aging.count(ExampleSelector("app:/recent")), aging.stats("app:/recent").count] + [
        int(b["x"].sum()) for b in aging.query_batches(ExampleSelector("app:/recent"), 100)
    ]
except ExampleStoreError as exc:
    errors["recent"] = str(exc)
for name, call in [
    ("schedule", lambda: scheduler.schedule("other")),
    ("cancel", lambda: scheduler.cancel("digits")),
    ("job run", scheduler.queue.run_pending),  # the job's run is kept as it ends
    ("new key", lambda: FileKeyStore(os.path.join(folder, "other-keys.json")).get_or_create_key("example_store")),
]:
    try:
        call()
    except ExampleStoreError as exc:  # a KeyStoreError
        errors[name] = str(exc)
    except AppDatabaseError as exc:
        errors[name] = str(exc)
print(json.dumps(errors))
"""


def test_a_full_disk_fails_a_write_whole_and_says_to_free_space(tmp_path, server, admin):
    deploy(admin, goal_count=5)
    script = tmp_path / "app.py"
    script.write_text(FULL_DISK_APP)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(ROOT), server.url], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert "free space and retry" in seen["add"] and "delete" not in seen["add"]
    assert "free space and retry" in seen["opstats"] and str(tmp_path / "app.db") in seen["opstats"]
    assert seen["count"] == 10
    # the session's update was not sent, and the server was told: it held the device's seat until
    # the report window closed
    assert "free space and retry" in seen["upload"]
    assert {k: admin.status("digits")["current_round"][k] for k in ("reported", "aborted")} == {
        "reported": 0,
        "aborted": 1,
    }
    # the scheduler's job store raised SQLAlchemy's OperationalError, and a key store that could not
    # write a new key asked whether its directory existed
    # read on a full disk without the examples past their TTL, where the failed delete of those made
    # the collection unreadable (a session's training included) until space was freed
    assert seen["recent"] == [20, 20, 20 * 4], seen["recent"]
    for name in ("schedule", "cancel", "job run", "new key"):
        assert "free space and retry" in seen[name], (name, seen)

    from device_runtime import OpStatsStore
    from example_store import ExampleSelector, FileKeyStore, SQLiteExampleStore

    with SQLiteExampleStore(tmp_path / "app.db", key_store=FileKeyStore(tmp_path / "keys.json")) as store:
        assert [int(b["y"][0]) for b in store.query_batches(ExampleSelector("app:/digits"), 10)] == [1]
    with OpStatsStore(tmp_path / "app.db") as opstats:
        assert {len(s.events) for s in opstats.sessions()} <= {1}  # whole sessions or none
    from device_runtime.conditions import DeviceState, StaticConditions
    from device_runtime.scheduling import ParticipationScheduler

    with ParticipationScheduler(tmp_path / "app.db", StaticConditions(DeviceState(True, True, 1.0, True))) as jobs:
        assert [job.population for job in jobs.jobs()] == ["digits"]  # as it was before the disk filled
