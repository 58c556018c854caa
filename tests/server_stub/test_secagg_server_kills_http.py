"""The server killed (SIGKILL) in the middle of a Secure Aggregation round and started again on its
SQLite file, with attested devices over real HTTP.

The server is ``python -m server_stub`` in a process of its own; it is killed once the first device
reaches a phase of the round (``tests.support.SECAGG_KILL_POINTS``), and started again on the same
port and database while the devices retry. Whatever the phase: every device's session ends with
the server's word that its session is gone (``BAD_SESSION_TOKEN``: the round was lost with the
process), never another exception; nothing of the lost round is on record (no update counted in
a model, nothing counted twice); no answer is a 5xx; and the restarted server runs the next round
and commits it with every device."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from device_runtime import Outcome
from server_stub import AdminClient
from server_stub.serve import free_port
from tests.support import ROOT, SECAGG_KILL_POINTS, KillSwitch, deploy_secure, in_threads

GROUP = 6
ADMIN_KEY = "secagg-crash-test-admin-key-0123456789abcdef"


class ThroughRestart(KillSwitch):
    """A device's transport whose requests wait while the server is down (``up`` cleared): the
    device meets the restarted server, whatever the time the restart takes on a loaded machine,
    instead of giving up on a dead one (``ServerUnreachable``). A request in flight at the kill
    fails and the device sends it again, as after any connection error."""

    def __init__(self, point: str | None, up: threading.Event) -> None:
        super().__init__(point, dies=False)
        self.up = up

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert self.up.wait(120)
        return super().handle_request(request)


class ServerProcess:
    """``python -m server_stub`` on one port and database, attested devices only; ``kill`` is a SIGKILL."""

    def __init__(self, folder: Path, authority) -> None:
        self.folder, self.port = folder, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        authority.save_trust_anchor(folder / "trust.json")
        (folder / "admin.key").write_text(ADMIN_KEY + "\n")
        (folder / "admin.key").chmod(0o600)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        log = (self.folder / "server.log").open("a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server_stub", "--db", str(self.folder / "server.db"), "--port", str(self.port)]
            + [
                "--admin-key-file",
                str(self.folder / "admin.key"),
                "--attestation-trust",
                str(self.folder / "trust.json"),
            ]
            + ["--rate-burst", "40", "--allow-untested-plans", "--log-level", "warning"],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=1) as http:
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, (self.folder / "server.log").read_text()[-2000:]
                try:
                    if http.get(self.url + "/v1/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        raise AssertionError(f"the server did not start on {self.url}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(30) == -signal.SIGKILL

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


@pytest.fixture
def server_process(tmp_path, authority):
    server = ServerProcess(tmp_path, authority)
    server.start()
    yield server
    server.stop()


def _killed_at(point: str, server: ServerProcess, attested_runtimes) -> None:
    with AdminClient(server.url, admin_key=ADMIN_KEY) as admin:
        deploy_secure(admin, "digits", goal_count=GROUP)
        up = threading.Event()
        up.set()
        # device 0 tells the test when it reaches ``point``; none of them dies
        switches = [ThroughRestart(point if i == 0 else None, up) for i in range(GROUP)]
        fleet = attested_runtimes(server.url, "digits", GROUP, transport=lambda i: switches[i])

        def session(i: int):
            try:
                return fleet.runtimes[i].run_session()
            except Exception as exc:  # noqa: BLE001 - what a device raised is the test's to judge
                return exc

        ended: list = []
        devices = threading.Thread(target=lambda: ended.extend(in_threads(GROUP, session, 120)))
        devices.start()
        assert switches[0].reached.wait(120), f"no device reached {point}"
        up.clear()
        server.kill()
        server.start()
        up.set()
        devices.join(150)
        codes = [(r.outcome, r.rejection_code) if hasattr(r, "outcome") else repr(r) for r in ended]
        assert codes == [(Outcome.REPORT_REJECTED, "BAD_SESSION_TOKEN")] * GROUP
        assert admin.rounds("digits") == []  # the lost round left nothing on record
        assert admin.model("digits")[1] == 0  # and nothing of it reached the model
        for opstats in fleet.opstats:
            [lost] = opstats.sessions("digits")
            assert lost.shape.endswith("#") and lost.events[-1].detail["code"] == "BAD_SESSION_TOKEN"

        # the restarted server runs the next round and commits it with every device, once
        results = fleet.run()
        assert [getattr(r, "shape", r) for r in results] == ["-v[]+^"] * GROUP
        [record] = admin.rounds("digits")
        assert (record["round"], record["status"]) == (1, "committed")
        assert record["metrics"]["secagg"]["summed_devices"] == GROUP
        assert admin.model("digits")[1] == 1
        assert max(max(s.statuses) for s in switches) < 500


def test_a_server_killed_once_the_masked_inputs_are_in_loses_the_round_and_commits_the_next(
    server_process, attested_runtimes
):
    _killed_at("sent:MaskedInput", server_process, attested_runtimes)


@pytest.mark.slow
# once the groups are formed: a server killed while its selection waits meets devices that check in
# again to its next round, which a restart does not change
@pytest.mark.parametrize("point", [p for p in SECAGG_KILL_POINTS if p != "checked_in"])
def test_a_server_killed_at_any_secagg_phase_loses_the_round_and_commits_the_next(
    server_process, attested_runtimes, point
):
    _killed_at(point, server_process, attested_runtimes)
