"""Secure Aggregation inside FL rounds, over real HTTP (uvicorn on loopback).

Devices are driven at the protocol level so that each drops out at a chosen SecAgg round and
carries an update we know; the committed model must equal exactly what the survivors' quantized
updates give, and the server's database must hold none of them. Devices that run secure rounds
are attested and hold the authority's trust anchor, as the SDK's default policy requires."""

from __future__ import annotations

import time

import numpy as np
import onnxruntime
import pytest

from device_runtime import ProtocolError, encode_checkpoint
from device_runtime.protocol import ProtocolClient
from device_runtime.secure_client import SecureOutcome
from device_runtime.secure_sum import SecureSumCodec, config_from_json
from emulator import DeviceProfile, EmulatedDevice, RealTimeFleet, partition_by_shards
from secagg import Round, SecAggClient, parse_message
from secagg.messages import EncryptedShares
from server_stub import AdminError
from tests.support import (
    COLLECTION,
    attested_checkins,
    deploy,
    deploy_secure,
    digits_plan,
    run_secure_aggregations,
)

VERSION = onnxruntime.__version__
K = 5  # no sum of fewer than 5 devices; groups of k + 1 = 6, threshold 5: each survives one drop-out
GROUP = 6
DEVICES = 30


def _updates(codec: SecureSumCodec, count: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(10, 60))
        upd = {name: rng.uniform(-3.0, 3.0, codec.shapes[name]).astype(np.float32) for name in codec.names}
        upd["num_examples"] = np.array(n, dtype=np.float32)
        upd["count"] = np.array(n, dtype=np.float32)
        for name in ("loss_sum", "correct"):  # sums of non-negative values, as every honest device's
            upd[name] = np.abs(upd[name])
        out.append(upd)
    return out


def test_secure_round_is_exact_under_dropouts_at_every_secagg_round(
    attested_server, attested_admin, authority, population
):
    server, admin = attested_server, attested_admin
    # A device that drops holds its group's round until the round's deadline: groups 0, 1 and 3 wait
    # out a round timeout (2 s here, not the helper's 10 s), and group 2 waits for its masked inputs
    # until the report window ends, which the test sat out: 7 s here, not the helper's 60 s (a deploy
    # wants more than three round timeouts). The live devices answer each round within a tenth of a
    # second even on a loaded machine, so groups 0 and 1 send their masked inputs some 4 s before it.
    plan, w0 = deploy_secure(
        admin,
        population,
        goal_count=DEVICES,
        min_fraction=0.5,
        secagg_min_group_size=K,
        secagg_round_timeout_s=2.0,
        report_timeout_s=7.0,
    )
    codec = SecureSumCodec(plan)
    updates = _updates(codec, DEVICES, seed=1)
    vectors = [codec.encode(u) for u in updates]
    devices = attested_checkins([ProtocolClient(server.url) for _ in range(DEVICES)], authority, population)
    # The groups follow from the seed the server revealed when selection ended: 5 groups of 6.
    states = [d.client.secagg_poll(d.session) for d in devices]
    groups: dict[int, list[int]] = {}
    for i, state in enumerate(states):
        assert state["status"] == "active" and state["config"]["consistency_check"] is True
        groups.setdefault(state["group"], []).append(i)
    assert sorted(len(g) for g in groups.values()) == [GROUP] * (DEVICES // GROUP)
    drop_at = {
        groups[0][0]: Round.ADVERTISE_KEYS,  # group 0: left out of the sum
        groups[1][0]: Round.SHARE_KEYS,  # group 1: left out
        groups[2][0]: Round.MASKED_INPUT_COLLECTION,  # group 2: drops before masking, left out
        groups[3][0]: Round.UNMASKING,  # group 3: drops after masking, recovered through its shares
        groups[4][0]: Round.SHARE_KEYS,  # group 4: two drop, 4 < t = 5 survive, the group aborts
        groups[4][1]: Round.SHARE_KEYS,
    }

    def hooks(i: int) -> dict:
        entered: list[str] = []
        return {
            "on_round": entered.append,
            "should_abort": lambda: i in drop_at and bool(entered) and entered[-1] == drop_at[i].value,
        }

    results = run_secure_aggregations(devices, vectors, authority, hooks=hooks)
    outcomes = {i: r.outcome for i, r in results.items()}

    for i in drop_at:
        assert outcomes[i] is SecureOutcome.INTERRUPTED
    assert {outcomes[i] for i in groups[4][2:]} == {SecureOutcome.ABORTED}
    included = sorted(i for g in range(4) for i in groups[g] if i not in drop_at or drop_at[i] is Round.UNMASKING)
    assert all(outcomes[i] is SecureOutcome.INCLUDED for i in included if i not in drop_at)

    (record,) = admin.rounds(population)
    assert record["status"] == "committed"
    assert record["metrics"]["reported"] == len(included) == 21
    assert record["metrics"]["secagg"] == {
        "groups": 5,
        "completed": 4,
        "aborted": 1,
        "aborted_in": {"ShareKeys": 1},
        "summed_devices": 21,
        "dropped": [],
    }

    model, round_number = admin.model(population)
    assert round_number == 1
    total = codec.decode_sum(np.sum([vectors[i].astype(np.int64) for i in included], axis=0), len(included))
    n = total["num_examples"]
    for name in plan.weight_names:
        np.testing.assert_allclose(model[name], w0[name] + total[name] / n, rtol=1e-5, atol=1e-6)
        plain = sum(updates[i][name].astype(np.float64) for i in included) / n
        np.testing.assert_allclose(model[name], w0[name] + plain, atol=1e-3)

    # Only masked inputs ever reached the server; none of them, nor any update, is on its disk.
    disk = b"".join(p.read_bytes() for p in server.db_path.parent.glob(server.db_path.name + "*"))
    for i in range(DEVICES):
        assert vectors[i][:64].tobytes() not in disk
        assert encode_checkpoint(updates[i]) not in disk


class GarbageDealer(ProtocolClient):
    """A device that sends share pairs nobody can open (and otherwise follows the protocol)."""

    def secagg_send(self, session, message: bytes):  # noqa: ANN001, ANN201 - ProtocolClient's own
        msg = parse_message(message)
        if isinstance(msg, EncryptedShares):
            shares = msg.shares.copy()
            shares["ct"] = [np.void(bytes(shares.dtype["ct"].itemsize)) for _ in range(len(shares))]
            message = EncryptedShares(msg.session_tag, shares, msg.digests).to_bytes()
        return super().secagg_send(session, message)


def test_a_device_dealing_garbage_shares_is_left_out_and_its_group_commits(
    attested_server, attested_admin, authority, population
):
    server, admin = attested_server, attested_admin
    plan, w0 = deploy_secure(admin, population, goal_count=K + 1, min_fraction=0.5, secagg_min_group_size=K)
    codec = SecureSumCodec(plan)
    updates = _updates(codec, K + 1, seed=2)
    vectors = [codec.encode(u) for u in updates]
    clients = [GarbageDealer(server.url)] + [ProtocolClient(server.url) for _ in range(K)]
    results = run_secure_aggregations(
        attested_checkins(clients, authority, population), vectors, authority, deadline_s=30
    )
    outcomes = {i: r.outcome for i, r in results.items()}
    assert outcomes == {0: SecureOutcome.EXCLUDED, **{i: SecureOutcome.INCLUDED for i in range(1, K + 1)}}
    (record,) = admin.rounds(population)
    assert record["status"] == "committed"
    assert record["metrics"]["secagg"] == {
        "groups": 1,
        "completed": 1,
        "aborted": 0,
        "aborted_in": {},
        "summed_devices": K,
        "dropped": [],
    }
    model, _ = admin.model(population)
    honest = range(1, K + 1)
    total = codec.decode_sum(np.sum([vectors[i].astype(np.int64) for i in honest], axis=0), K)
    for name in plan.weight_names:
        np.testing.assert_allclose(model[name], w0[name] + total[name] / total["num_examples"], rtol=1e-5, atol=1e-6)


def test_secure_task_refuses_plain_reports_and_bad_messages(server, admin):
    deploy_secure(admin, goal_count=5, min_fraction=0.8, report_timeout_s=60, secagg_round_timeout_s=5.0)
    client = ProtocolClient(server.url)
    session = client.checkin("digits", VERSION)
    assert session.aggregation == "secure_sum"
    with pytest.raises(ProtocolError, match="SECURE_AGGREGATION_REQUIRED"):
        client.report(session, encode_checkpoint({"w0": np.zeros((64, 10), np.float32)}))
    assert client.secagg_poll(session)["status"] == "waiting"
    with pytest.raises(ProtocolError, match="NOT_IN_GROUP"):
        client.secagg_send(session, b"\x00" * 16)
    others = [ProtocolClient(server.url) for _ in range(4)]
    for other in others:
        other.checkin("digits", VERSION)
    state = client.secagg_poll(session)
    assert state["status"] == "active" and state["round"] == Round.ADVERTISE_KEYS.value
    with pytest.raises(ProtocolError, match="SECAGG_REJECTED"):
        client.secagg_send(session, b"not a secagg message")
    for c in (client, *others):
        c.close()


def test_a_secagg_message_sent_again_is_taken_again_and_another_for_a_round_answered_is_refused(server, admin):
    """A device whose answer was lost sends its message again: it is taken again, even once the
    group has moved on (its keys are in). A device started again (new keys, same seat) that sends
    another message for a round its session answered is told so, not that its message is bad."""
    deploy_secure(admin, goal_count=5, min_fraction=0.8, report_timeout_s=60, secagg_round_timeout_s=5.0)
    clients = [ProtocolClient(server.url) for _ in range(5)]
    sessions = [c.checkin("digits", VERSION) for c in clients]
    states = [c.secagg_poll(s) for c, s in zip(clients, sessions)]
    assert {state["round"] for state in states} == {Round.ADVERTISE_KEYS.value}
    config = config_from_json(states[0]["config"])
    keys = [SecAggClient(state["client_id"], config, None).start() for state in states]
    clients[0].secagg_send(sessions[0], keys[0])
    clients[0].secagg_send(sessions[0], keys[0])
    restarted = SecAggClient(states[0]["client_id"], config, None).start()
    with pytest.raises(ProtocolError, match="SECAGG_ALREADY_ANSWERED") as refused:
        clients[0].secagg_send(sessions[0], restarted)
    assert refused.value.status == 409
    for client, session, message in zip(clients[1:], sessions[1:], keys[1:]):
        client.secagg_send(session, message)
    assert clients[0].secagg_poll(sessions[0])["round"] == Round.SHARE_KEYS.value
    clients[0].secagg_send(sessions[0], keys[0])  # the group has moved on: taken again all the same
    with pytest.raises(ProtocolError, match="SECAGG_ROUND_CLOSED"):
        clients[0].secagg_send(sessions[0], restarted)
    for c in clients:
        c.close()


def test_fewer_devices_than_a_group_abandon_the_round_at_once(server, admin):
    deploy_secure(
        admin, goal_count=3, min_fraction=1.0, report_timeout_s=60, secagg_min_group_size=4, secagg_round_timeout_s=5.0
    )
    clients = [ProtocolClient(server.url) for _ in range(3)]
    sessions = [c.checkin("digits", VERSION) for c in clients]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not admin.rounds("digits"):
        time.sleep(0.05)
    (record,) = admin.rounds("digits")
    assert record["status"] == "abandoned" and record["metrics"]["secagg"]["groups"] == 0
    assert clients[0].secagg_poll(sessions[0])["status"] == "closed"
    for c in clients:
        c.close()


def test_emulated_fleet_trains_through_attested_secure_aggregation_with_late_dropouts(
    tmp_path, attested_server, attested_admin, authority, digits, population
):
    """The demo's fleet: attested devices holding the trust anchor, under the SDK's default
    policy (an attested cohort, ConsistencyCheck, committed groups), over real HTTP."""
    server, admin = attested_server, attested_admin
    plan = digits_plan("mlp", secure_aggregation=True, epochs=2, learning_rate=0.3)
    _, w0 = deploy(
        admin,
        population,
        plan=plan,
        goal_count=10,
        report_timeout_s=15,
        retry_window_s=(0.1, 0.5),
        max_rounds=2,
        secagg_min_group_size=5,
        secagg_round_timeout_s=1.0,
    )
    profile = DeviceProfile(dropout_prob=0.05, late_dropout_prob=0.2, late_dropout_within_s=0.3, cooldown_s=(0.05, 0.2))
    devices = []
    for i, idx in enumerate(partition_by_shards(digits.y_train, 24, seed=0)):
        device = EmulatedDevice(
            f"d{i}",
            tmp_path / f"d{i}",
            server.url,
            population,
            profile=profile,
            collection_uri=COLLECTION,
            seed=i,
            attestor=authority.new_device_attestor("emulated-phone", time.time()),
            trust_anchor=authority.trust_anchor(),
        )
        device.add_examples(digits.x_train[idx], digits.y_train[idx])
        devices.append(device)
    fleet = RealTimeFleet(devices)
    fleet.start()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if sum(r["status"] == "committed" for r in admin.rounds(population)) >= 2:
                break
            time.sleep(0.2)
    finally:
        fleet.stop()
    committed = [r for r in admin.rounds(population) if r["status"] == "committed"]
    assert len(committed) == 2
    for r in committed:  # 10 to 13 selected devices: one or two groups of at least k + 1 = 6
        assert r["metrics"]["secagg"]["completed"] >= 1
        assert r["metrics"]["reported"] == r["metrics"]["secagg"]["summed_devices"] >= 8  # ceil(10 * min_fraction)
    model, _ = admin.model(population)
    assert any(not np.allclose(model[k], w0[k]) for k in plan.weight_names)
    assert fleet.outcomes()["completed"] >= 10  # (a device that drops after its masked input is summed, not completed)
    # the default policy let them in only as an attested cohort: every peer certified, each device once
    assert all(d.runtime.secagg_policy.require_attested_cohort and d.runtime.peer_verifier is not None for d in devices)


def test_secure_task_needs_a_report_window_that_fits_its_rounds(server, admin):
    with pytest.raises(AdminError) as refused:
        deploy(
            admin, plan=digits_plan("softmax", secure_aggregation=True), report_timeout_s=10, secagg_round_timeout_s=5
        )
    assert refused.value.code == "BAD_CONFIG" and refused.value.status == 400
    # A refused deploy leaves nothing behind: no task stored, none active.
    status = admin.status("digits")
    assert status["tasks"] == [] and status["active_tasks"] == [] and status["active_task"] is None
    assert admin.rounds("digits") == []
