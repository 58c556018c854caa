"""``fedfleet server`` (a process of its own, real uvicorn and SQLite) whose disk fills up while
devices (the SDK's ``FLRuntime`` over HTTP) take part, then frees again: the file size limit of the
process (RLIMIT_FSIZE, set and lifted by a signal the test sends) stands for a full disk, whose
writes fail alike. No device or operator is answered a 5xx other than 503 ``DATABASE_UNAVAILABLE``,
the round the disk refused is abandoned and on record once there is space, no round opens while
its record waits (its devices would train for nothing), and the next one commits each report once.
The same in one process on a fake clock, without a server process:
``test_round_integrity.test_no_round_opens_while_the_database_refuses_the_record_of_the_last_one``."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from device_runtime import FLRuntime, Outcome, SessionRejected
from example_store import InMemoryExampleStore
from server_stub import AdminClient
from server_stub.serve import free_port
from tests.support import COLLECTION, PROCESS_ADMIN_KEY, ROOT, KillSwitch, admin_key_file, deploy

#: ``python -m server_stub`` whose disk is full from SIGUSR1 (no file may grow) until SIGUSR2.
FILLING_SERVER = """
import resource, signal, sys
from server_stub.cli import main

def full(*_):
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))

def freed(*_):
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

signal.signal(signal.SIGUSR1, full)
signal.signal(signal.SIGUSR2, freed)
sys.exit(main(sys.argv[1:]))
"""
DEVICES = 2


def _wait(condition, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (done := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return done


@pytest.mark.slow  # a server process and a dozen sessions; the same in one process: see the module's doc
def test_a_server_whose_disk_fills_up_opens_no_round_until_there_is_space_and_loses_nothing(tmp_path):
    admin_key_file(tmp_path / "admin.key", PROCESS_ADMIN_KEY)
    url = f"http://127.0.0.1:{(port := free_port())}"
    server = subprocess.Popen(
        [sys.executable, "-c", FILLING_SERVER, "--db", str(tmp_path / "fl.db"), "--port", str(port)]
        + ["--admin-key-file", str(tmp_path / "admin.key"), "--allow-untested-plans", "--log-level", "info"],
        cwd=ROOT,
        stdout=subprocess.PIPE,  # a log file would be refused as the database is
        stderr=subprocess.STDOUT,
        text=True,
    )
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(server.stdout or ()), daemon=True)
    reader.start()
    try:
        _wait(lambda: _healthy(url, server), "the server did not start")
        switches = [KillSwitch() for _ in range(DEVICES)]  # never acts: records each answer's status
        rng = np.random.default_rng(0)
        devices = []
        for i in range(DEVICES):
            store = InMemoryExampleStore()
            store.add(COLLECTION, [{"x": rng.random(64).astype(np.float32), "y": np.int64(i)} for _ in range(12)])
            devices.append(FLRuntime("digits", url, store, transport=switches[i]))

        def sessions() -> list:
            ended: list = [None] * DEVICES

            def run(i: int) -> None:
                try:
                    ended[i] = devices[i].run_session()
                except SessionRejected as exc:
                    ended[i] = exc.reason

            threads = [threading.Thread(target=run, args=(i,)) for i in range(DEVICES)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            return [r.outcome if hasattr(r, "outcome") else r for r in ended]

        with AdminClient(url, admin_key=PROCESS_ADMIN_KEY) as admin:
            deploy(admin, goal_count=DEVICES, over_selection=1.0, retry_window_s=(0.1, 0.2))
            assert sessions() == [Outcome.COMPLETED] * DEVICES
            model_1 = admin.model("digits")

            server.send_signal(signal.SIGUSR1)  # the disk is full: an operator's write is a 503
            refused = _wait(
                lambda: (a := admin.http.post("/v1/populations", json={"name": "other"})).status_code != 201 and a,
                "the full disk never refused a write",
            )
            assert (refused.status_code, refused.json()["error"]["code"]) == (503, "DATABASE_UNAVAILABLE")
            # the round open then takes its reports; its commit is refused, and so is its record
            assert sessions() == [Outcome.COMPLETED] * DEVICES
            for _ in range(2):  # no round opens while that record waits
                assert sessions() == ["ROUND_FULL"] * DEVICES
            assert "the database refused the record of its last round" in admin.status("digits")["waiting"]
            assert admin.model("digits")[1] == 1

            server.send_signal(signal.SIGUSR2)  # space again: the record is written, the round opens
            _wait(lambda: admin.rounds("digits")[-1]["status"] == "abandoned", "the record was never written")
            assert "waiting" not in admin.status("digits")
            assert sessions() == [Outcome.COMPLETED] * DEVICES
            rounds = admin.rounds("digits")
            assert [(r["round"], r["attempt"], r["status"]) for r in rounds] == [
                (1, 1, "committed"),
                (2, 1, "abandoned"),
                (2, 2, "committed"),
            ]
            assert rounds[1]["metrics"]["error"] == "database write failed: OperationalError"
            assert [r["metrics"]["reported"] for r in rounds] == [DEVICES] * 3  # each report once
            model_2, number = admin.model("digits")
            assert number == 2 and any(not np.array_equal(model_2[k], model_1[0][k]) for k in model_2)
        for switch in switches:
            assert max(switch.statuses) < 500, switch.statuses
    finally:
        server.terminate()
        server.wait(30)
        reader.join(10)
    said = "".join(log)
    assert "Traceback" not in said and "Logging error" not in said, said[-3000:]
    assert "population digits: its next round opens once the database takes writes again" in said, said[-3000:]


def _healthy(url: str, server: subprocess.Popen) -> bool:
    assert server.poll() is None, "the server ended"
    try:
        return httpx.get(url + "/v1/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False
