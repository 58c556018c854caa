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

import threading

import pytest

from device_runtime import Outcome
from server_stub import AdminClient
from tests.support import (
    DDP,
    PROCESS_ADMIN_KEY,
    SECAGG_KILL_POINTS,
    ServerProcess,
    ThroughRestart,
    check_ddp_accounting,
    deploy_secure,
    sessions_in_background,
)

GROUP = 6


@pytest.fixture
def server_process(tmp_path, authority):
    server = ServerProcess(tmp_path, authority)
    server.start()
    yield server
    server.stop()


def _killed_at(point: str, server: ServerProcess, attested_runtimes, **config) -> list[dict]:
    """The server killed once device 0 reaches ``point``, and started again; the rounds on record
    at the end. ``config``: the task's round, over ``deploy_secure``'s."""
    with AdminClient(server.url, admin_key=PROCESS_ADMIN_KEY) as admin:
        deploy_secure(admin, "digits", goal_count=GROUP, **config)
        up = threading.Event()
        up.set()
        # device 0 tells the test when it reaches ``point``; none of them dies
        switches = [ThroughRestart(point if i == 0 else None, up) for i in range(GROUP)]
        fleet = attested_runtimes(server.url, "digits", GROUP, transport=lambda i: switches[i])

        devices, ended = sessions_in_background(fleet, GROUP)
        assert switches[0].reached.wait(120), f"no device reached {point}"
        up.clear()  # held before the kill: a request to a dead server would fail, not wait
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
        return [record]


def test_a_server_killed_once_the_masked_inputs_are_in_loses_the_round_and_commits_the_next(
    server_process, attested_runtimes
):
    _killed_at("sent:MaskedInput", server_process, attested_runtimes)


@pytest.mark.slow
# once the groups are formed (a server killed while its selection waits: test_server_kills_http.py)
@pytest.mark.parametrize("point", [p for p in SECAGG_KILL_POINTS if p != "checked_in"])
def test_a_server_killed_at_any_secagg_phase_loses_the_round_and_commits_the_next(
    server_process, attested_runtimes, point
):
    _killed_at(point, server_process, attested_runtimes)


@pytest.mark.slow
def test_a_server_killed_once_the_masked_inputs_of_a_distributed_dp_round_are_in_spends_no_privacy_for_it(
    server_process, attested_runtimes
):
    """The noisy inputs of the lost round reach no model, and no privacy is counted for them: the
    next round, the first on record, accounts for one round (its own default twin: a kill in the
    commit of a distributed-DP round, test_server_kills_http.py)."""
    rounds = _killed_at("sent:MaskedInput", server_process, attested_runtimes, dp=DDP)
    check_ddp_accounting(rounds, DDP)
