"""The server killed (SIGKILL) while it commits a round, or while a round's selection waits, and
started again on its SQLite file, with attested devices over real HTTP.

A commit writes the round's new model and its record in one transaction; the server is killed at a
chosen point of it (``tests.dying_server``: the model written, the record written, the transaction
committed). After the restart the round is on record with its model, which the restarted server
serves and the next round starts from, or nothing of it is: never a record without its model, a
model without its record, a report counted twice, or, for a distributed-DP task, privacy spent on
record for a round whose noisy sum is in no model."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from device_runtime import Outcome
from server_stub import AdminClient
from tests.dying_server import KILL_POINTS
from tests.support import (
    DDP,
    PROCESS_ADMIN_KEY,
    ServerProcess,
    ThroughRestart,
    check_ddp_accounting,
    deploy,
    deploy_secure,
    sessions_in_background,
)

PLAIN = 3  # devices of a plain round
GROUP = 6  # devices of a secure round: one group


@pytest.fixture
def server_process(tmp_path, authority):
    server = ServerProcess(tmp_path, authority)
    yield server
    server.stop()


def _restart(server: ServerProcess, up: threading.Event, kill: Callable[[], None]) -> None:
    """The server down (``kill``), devices' requests held, the server started again, devices let
    through. Held after the kill: a server that kills itself (``died``) does so on a device's request."""
    kill()
    up.clear()
    server.start()
    up.set()


def _outcomes(ended: list) -> list:
    return sorted(
        (r.outcome.value, r.rejection_code or "") if hasattr(r, "outcome") else ("raised", repr(r)) for r in ended
    )


def _flat(model: dict) -> np.ndarray:
    return np.concatenate([np.asarray(model[k], np.float64).reshape(-1) for k in sorted(model)])


def _killed_in_commit(point: str, server: ServerProcess, attested_runtimes, *, secure: bool) -> list[dict]:
    """A round of ``PLAIN`` devices (a secure one: ``GROUP``) whose commit the server dies in at
    ``point``; checks what the restarted server has on record and serves, runs one more round,
    and returns the rounds on record."""
    server.start(dies_in_commit=point)
    count = GROUP if secure else PLAIN
    with AdminClient(server.url, admin_key=PROCESS_ADMIN_KEY) as admin:
        if secure:
            _, w0 = deploy_secure(admin, "digits", goal_count=count, dp=DDP)
        else:
            _, w0 = deploy(admin, "digits", goal_count=count, over_selection=1.0)
        up = threading.Event()
        up.set()
        switches = [ThroughRestart(None, up) for _ in range(count)]
        fleet = attested_runtimes(server.url, "digits", count, transport=lambda i: switches[i])
        devices, ended = sessions_in_background(fleet, count)
        _restart(server, up, server.died)
        devices.join(150)
        assert len(ended) == count and all(hasattr(r, "outcome") for r in ended), ended
        committed = point == "committed"
        on_record = admin.rounds("digits")
        model, number = admin.model("digits")
        if committed:
            [record] = on_record
            assert (record["round"], record["status"], number) == (1, "committed", 1)
            assert record["metrics"]["reported"] == count  # the report re-sent after the restart is not counted again
            assert _flat(admin.checkpoint(record["checkpoint_id"])) == pytest.approx(_flat(model), abs=0)
            assert not np.array_equal(_flat(model), _flat(w0))
        else:  # the transaction never committed: neither the round nor its model is on record
            assert (on_record, number) == ([], 0)
            assert np.array_equal(_flat(model), _flat(w0))
        # what devices of the next round download is the model on record
        sent = admin.checkpoint(admin.status("digits")["checkpoint_id"])
        assert np.array_equal(_flat(sent), _flat(model))
        # the device whose report (or Secure Aggregation message) closed the round met the restarted
        # server, which no longer knows its session; so did any other whose answer was still on its
        # way when the server died (on a loaded machine all of a round's answers can still be in
        # flight at the kill)
        outcomes = _outcomes(ended)
        lost = [o for o in outcomes if o[0] != Outcome.COMPLETED.value]
        if committed:
            # the round on record names the sessions it holds: each is told its update is in it, and
            # keeps its session as taking part (told its session was unknown, it kept it as refused,
            # and trained and sent its examples again in the next round)
            assert lost == [], outcomes
            assert all(opstats.last_participation("digits") is not None for opstats in fleet.opstats)
        else:  # its update is in no model: each is told its session is unknown
            assert set(lost) == {(Outcome.REPORT_REJECTED.value, "BAD_SESSION_TOKEN")}, outcomes
        assert max(max(s.statuses, default=0) for s in switches) < 500

        # the next round commits once, and counts each of its devices once
        results = fleet.run()
        assert all(getattr(r, "outcome", r) is Outcome.COMPLETED for r in results), results
        rounds = admin.rounds("digits")
        assert [(r["round"], r["status"]) for r in rounds] == [(n, "committed") for n in range(1, 2 + committed)]
        assert admin.model("digits")[1] == 1 + committed
        assert rounds[-1]["metrics"]["reported"] == count
        return rounds


# the record written but not committed (a plain round), and committed (a distributed-DP one)
@pytest.mark.parametrize(("point", "secure"), [("record_written", False), ("committed", True)])
def test_a_server_killed_in_a_rounds_commit_has_all_of_it_on_record_or_none(
    server_process, attested_runtimes, point, secure
):
    rounds = _killed_in_commit(point, server_process, attested_runtimes, secure=secure)
    if secure:
        check_ddp_accounting(rounds, DDP)


@pytest.mark.slow
@pytest.mark.parametrize("secure", [False, True], ids=["plain", "distributed_dp"])
@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_server_killed_at_any_point_of_a_commit_has_all_of_it_on_record_or_none(
    server_process, attested_runtimes, point, secure
):
    rounds = _killed_in_commit(point, server_process, attested_runtimes, secure=secure)
    if secure:
        check_ddp_accounting(rounds, DDP)


# secure: devices that wait for selection's end; plain (-m slow): devices that train as soon as selected
@pytest.mark.parametrize("secure", [pytest.param(False, marks=pytest.mark.slow), True], ids=["plain", "secure"])
def test_a_server_killed_while_its_selection_waits_opens_the_round_again_and_counts_each_report_once(
    server_process, attested_runtimes, secure
):
    """Half the round's devices are checked in (each held once its check-in is accepted, before it
    downloads or trains anything) when the server is killed: each is told its session is gone,
    nothing is on record, and the restarted server's round commits the devices of its own round."""
    server_process.start()
    count = GROUP if secure else PLAIN
    waiting = count // 2 + 1  # not enough for the round
    with AdminClient(server_process.url, admin_key=PROCESS_ADMIN_KEY) as admin:
        if secure:
            deploy_secure(admin, "digits", goal_count=count)
        else:
            deploy(admin, "digits", goal_count=count, over_selection=1.0)
        up, killed = threading.Event(), threading.Event()
        up.set()
        switches = [ThroughRestart("checked_in", up) for _ in range(count)]
        for switch in switches:
            switch.then = lambda: killed.wait(120)
        fleet = attested_runtimes(server_process.url, "digits", count, transport=lambda i: switches[i])
        devices, ended = sessions_in_background(fleet, waiting)
        try:
            for switch in switches[:waiting]:
                assert switch.reached.wait(120), "a device's check-in was not accepted"
            status = admin.status("digits")
            assert (status["phase"], status["current_round"]["selected"]) == ("selecting", waiting)
            _restart(server_process, up, server_process.kill)
        finally:
            killed.set()
        devices.join(150)
        assert _outcomes(ended) == [(Outcome.REPORT_REJECTED.value, "BAD_SESSION_TOKEN")] * waiting
        for opstats in fleet.opstats[:waiting]:  # the app knows its session ended, having sent nothing
            [lost] = opstats.sessions("digits")
            assert lost.shape == "-#" and lost.events[-1].detail["code"] == "BAD_SESSION_TOKEN"
        assert admin.rounds("digits") == []
        assert admin.model("digits")[1] == 0

        for switch in switches:
            switch.point = None
        results = fleet.run()
        assert all(getattr(r, "outcome", r) is Outcome.COMPLETED for r in results), results
        [record] = admin.rounds("digits")
        assert (record["round"], record["status"], record["metrics"]["reported"]) == (1, "committed", count)
        if secure:
            assert record["metrics"]["secagg"]["summed_devices"] == count
        assert admin.model("digits")[1] == 1
        assert max(max(s.statuses) for s in switches) < 500
