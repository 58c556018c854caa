"""An app whose disk fills while a session runs (a process whose file size limit is reached,
RLIMIT_FSIZE, in a process of its own, against a real server in the test's): the session is kept
before its update leaves, so that an app killed after would not report it again; when it cannot be
kept, nothing is sent, the server is told, and the app gets a typed error saying to free space."""

from __future__ import annotations

import subprocess
import sys

from example_store import SQLiteExampleStore
from tests.support import COLLECTION, ROOT, deploy

FULL_BEFORE_THE_UPLOAD = """
import os, resource, sys
sys.path.insert(0, sys.argv[3])  # the checkout
from device_runtime import FLRuntime, OpStatsStore
from device_runtime.opstats import AppDatabaseError
from example_store import SQLiteExampleStore

folder, url = sys.argv[1], sys.argv[2]
db = os.path.join(folder, "app.db")
store, opstats = SQLiteExampleStore(db), OpStatsStore(db)
runtime = FLRuntime("digits", url, store, opstats=opstats, cache_dir=os.path.join(folder, "cache"))


def disk_full():  # trained, the update about to leave: no file may grow now
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))


try:
    result = runtime.run_session(before_report=disk_full)
    print(f"session {result.outcome.value} {result.shape}")
except AppDatabaseError as exc:
    print(f"AppDatabaseError: {exc}")
"""


def test_a_disk_full_before_the_upload_sends_nothing_and_tells_the_server(tmp_path, server, admin, digits):
    deploy(admin, goal_count=5)
    with SQLiteExampleStore(tmp_path / "app.db") as store:
        store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:40], digits.y_train[:40])))
    script = tmp_path / "app.py"
    script.write_text(FULL_BEFORE_THE_UPLOAD)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), server.url, str(ROOT)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    said = done.stdout.strip().splitlines()[-1]
    assert said.startswith("AppDatabaseError:") and "free space and retry" in said, said
    round_ = admin.status("digits")["current_round"]
    # the server was told: the device's seat is free at once, not held until the report window closes
    assert (round_["reported"], round_["aborted"]) == (0, 1)
