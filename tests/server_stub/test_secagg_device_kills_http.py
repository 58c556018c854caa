"""Devices killed at every phase of a Secure Aggregation round, over real HTTP (uvicorn on loopback,
the server's SQLite file, attested devices, real crypto).

A device is killed once its check-in was accepted, once the server took one of its messages, or
once it holds a round's request (``tests.support.SECAGG_KILL_POINTS``): in a process of its own,
killed with SIGKILL (``KilledApp``), or in this process by a transport that goes dead
(``KillSwitch``: the server hears nothing more from it, as from a killed one). Whatever the phases and the devices: the group commits
when enough of it survives (its threshold, t = 5 of 6 here), summing exactly the devices whose
masked input was in, or aborts with the round it stopped in; the server answers no 5xx; a killed
app's opstats hold its session as it stood when its masked input left (a participation, for its
eligibility policies); and the killed devices, started again on their own files, advertise fresh
keys and take part in the next round."""

from __future__ import annotations

import hashlib
import signal
import time

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from device_runtime import FLRuntime, Outcome, RetryPolicy, ServerUnreachable
from tests.support import (
    AFTER_MASKED_INPUT,
    SECAGG_KILL_POINTS,
    KilledApp,
    KillSwitch,
    deploy_secure,
    in_threads,
)

GROUP = 6  # one group of k + 1 = 6, threshold 5: it survives one device killed, not two
#: A killed device holds each key round after it, and Unmasking, for a round timeout (2 s, not the
#: helper's 10 s) and the masked inputs until their deadline (the report window, 10 s, less three
#: round timeouts): short tests, in which live devices on loopback still answer well within time
ROUND = {"goal_count": GROUP, "secagg_round_timeout_s": 2.0, "report_timeout_s": 10.0}
THRESHOLD = 5


def _sessions(runtimes: list[FLRuntime]) -> list:
    """One session of every runtime at once: its result, or the exception it raised."""

    def session(i: int):
        try:
            return runtimes[i].run_session()
        except Exception as exc:  # a device killed in this process ends in ServerUnreachable
            return exc

    return in_threads(len(runtimes), session, 120)


def _files_are_whole(folder) -> bool:
    """Every file of a plan cache is a whole plan, named by its SHA-256 (no partial copy left)."""
    plans = [f for f in folder.rglob("*") if f.is_file()]
    return bool(plans) and all(hashlib.sha256(f.read_bytes()).hexdigest() == f.name for f in plans)


def test_a_device_killed_once_its_masked_input_left_is_summed_knows_it_took_part_and_joins_the_next_round(
    attested_server, attested_admin, authority, attested_runtimes, population, digits, tmp_path
):
    server, admin = attested_server, attested_admin
    deploy_secure(admin, population, **ROUND)
    reported: list[str] = []  # the sessions the server counts as reported, as it tells a fleet simulation
    server.service.on_reported = reported.extend
    switches = [KillSwitch() for _ in range(GROUP - 1)]
    others = attested_runtimes(server.url, population, GROUP - 1, transport=lambda i: switches[i])
    app = KilledApp(tmp_path / "killed", digits, authority, server.url, population)
    killed = app.start("sent:MaskedInput")
    survivors = others.run()
    assert killed.wait(120) == -signal.SIGKILL
    assert [r.outcome for r in survivors] == [Outcome.COMPLETED] * (GROUP - 1)
    [first] = admin.rounds(population)
    assert first["status"] == "committed"
    assert first["metrics"]["secagg"]["summed_devices"] == GROUP  # its peers' shares recovered its input

    # started again on its files: the session it was killed in is on record as a participation
    statuses, advertised = app.seen()
    with app.restarted(transport=KillSwitch()) as restarted:
        opstats = restarted.opstats
        assert opstats is not None
        [session] = opstats.sessions(population)
        assert session.shape == "-v[]+"
        assert opstats.last_participation(population) == session
        # counted as reported with the survivors, as the round's metrics count it: it contributed
        assert len(set(reported)) == len(reported) == GROUP == first["metrics"]["reported"]
        server.service.on_reported = None
        assert _files_are_whole(app.folder / "cache")
        # the next round: the restarted app with fresh keys, its group exact and whole
        results = _sessions([restarted, *others.runtimes])
        assert [getattr(r, "outcome", r) for r in results] == [Outcome.COMPLETED] * GROUP
        fresh = restarted.client.http._transport
        assert isinstance(fresh, KillSwitch) and len(fresh.advertised) == 2
        assert not set(fresh.advertised) & set(advertised)
        assert [s.shape for s in opstats.sessions(population)] == ["-v[]+", "-v[]+^"]
    assert [r["status"] for r in admin.rounds(population)] == ["committed", "committed"]
    assert admin.rounds(population)[1]["metrics"]["secagg"]["summed_devices"] == GROUP
    for answered in (statuses, fresh.statuses, *(s.statuses for s in switches)):
        assert answered and max(answered) < 500


def _lose_the_answer() -> None:
    raise httpx.ReadError("the connection dropped before the answer came")


def _answer_lost_at(point: str, server, admin, runtimes, population: str) -> None:
    """Whatever message's answer a device loses, it sends the message again, its group takes it
    again, and the device's update is in the committed round with its peers'."""
    deploy_secure(admin, population, **ROUND)
    # device 0's connection drops once, at ``point``, after the server took its request: its protocol
    # client sends the request again, as after any connection error
    switches = [KillSwitch(point if i == 0 else None, _lose_the_answer, dies=False) for i in range(GROUP)]
    fleet = runtimes(server.url, population, GROUP, transport=lambda i: switches[i])
    results = fleet.run()
    assert [getattr(r, "shape", r) for r in results] == ["-v[]+^"] * GROUP
    assert switches[0].reached.is_set()  # the answer was lost
    [record] = admin.rounds(population)
    assert record["status"] == "committed" and record["metrics"]["secagg"]["summed_devices"] == GROUP
    assert max(max(s.statuses) for s in switches) < 500


def test_a_device_that_loses_the_answer_to_its_masked_input_sends_it_again_and_is_summed(
    attested_server, attested_admin, attested_runtimes, population
):
    _answer_lost_at("sent:MaskedInput", attested_server, attested_admin, attested_runtimes, population)


@pytest.mark.slow
@pytest.mark.parametrize("point", [p for p in SECAGG_KILL_POINTS if p.startswith("sent:")])
def test_a_device_that_loses_the_answer_to_any_of_its_messages_sends_it_again_and_is_summed(
    attested_server, attested_admin, attested_runtimes, population, point
):
    _answer_lost_at(point, attested_server, attested_admin, attested_runtimes, population)


def _devices_killed(plan: dict[int, str], server, admin, runtimes, authority, population: str) -> None:
    """The devices of one group that ``plan`` names (device -> kill point) are killed there: the group
    commits the devices whose masked input was in when at least t of them survive to Unmasking, else
    aborts naming the round; the killed devices, started again on their own files, advertise fresh
    keys and take part in the next round, which commits with all of them."""
    deploy_secure(admin, population, **ROUND)
    switches = [KillSwitch(plan.get(i)) for i in range(GROUP)]
    # a killed device's runtime tries once, and finds no connection: it ends and tells nobody
    fleet = runtimes(server.url, population, GROUP, transport=lambda i: switches[i], retry=RetryPolicy(attempts=1))
    results = _sessions(fleet.runtimes)
    survivors = [i for i in range(GROUP) if i not in plan]
    assert all(isinstance(results[i], ServerUnreachable) for i in plan)
    [record] = admin.rounds(population)
    secagg = record["metrics"]["secagg"]
    if GROUP - len(plan) >= THRESHOLD:
        assert record["status"] == "committed" and secagg["completed"] == 1
        assert secagg["summed_devices"] == GROUP - sum(p not in AFTER_MASKED_INPUT for p in plan.values())
        assert [results[i].outcome for i in survivors] == [Outcome.COMPLETED] * len(survivors)
    else:
        assert record["status"] == "abandoned" and secagg["aborted"] == 1
        [(stopped_in, groups)] = secagg["aborted_in"].items()
        assert groups == 1
        for i in survivors:
            assert results[i].rejection_code == "SECAGG_ABORTED"
            [session] = fleet.opstats[i].sessions(population)
            assert f"{stopped_in}: only" in session.events[-1].detail["detail"]  # why, in the device's opstats

    fresh = {i: KillSwitch() for i in plan}
    again = [
        FLRuntime(
            population,
            server.url,
            fleet.stores[i],
            opstats=fleet.opstats[i],
            cache_dir=fleet.runtimes[i].cache_dir,
            attestor=fleet.runtimes[i].attestor,
            trust_anchor=authority.trust_anchor(),
            transport=fresh[i],
        )
        if i in plan
        else fleet.runtimes[i]
        for i in range(GROUP)
    ]
    try:
        results = _sessions(again)
    finally:
        for i in plan:
            again[i].close()
    assert [getattr(r, "shape", r) for r in results] == ["-v[]+^"] * GROUP
    record = admin.rounds(population)[-1]
    assert record["status"] == "committed" and record["metrics"]["secagg"]["summed_devices"] == GROUP
    for i in plan:
        assert len(fresh[i].advertised) == 2 and not set(fresh[i].advertised) & set(switches[i].advertised)
    assert max(max(s.statuses) for s in (*switches, *fresh.values())) < 500


def test_two_devices_killed_before_unmasking_abort_their_group_naming_the_round_and_rejoin_the_next(
    attested_server, attested_admin, attested_runtimes, authority, population
):
    # one killed once its shares are in, one as it is asked to unmask: 4 of 6 answer, t is 5
    plan = {0: "sent:EncryptedShares", 1: "received:Unmasking"}
    _devices_killed(plan, attested_server, attested_admin, attested_runtimes, authority, population)


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.dictionaries(st.integers(0, GROUP - 1), st.sampled_from(SECAGG_KILL_POINTS), max_size=2))
@example(plan={0: "checked_in"})  # its group is formed with it: it never advertises a key
@example(plan={0: "checked_in", 1: "sent:MaskedInput"})  # 4 sign at ConsistencyCheck, t is 5
def test_devices_killed_at_any_phases_leave_their_group_exact_or_aborted_and_rejoin_the_next_round(
    attested_server, attested_admin, attested_runtimes, authority, population, plan
):
    population = f"{population[:100]}-{time.monotonic_ns()}"  # a population per example
    _devices_killed(plan, attested_server, attested_admin, attested_runtimes, authority, population)
