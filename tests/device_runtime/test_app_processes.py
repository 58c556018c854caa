"""Processes of one app opening its new database at the same moment (the app and its background
service, say): each opens its sealed example store, opstats log and scheduled jobs, where the
first to create a table made the others fail ('table collections already exists')."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.support import ROOT

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
