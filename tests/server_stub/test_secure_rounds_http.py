"""Secure Aggregation inside FL rounds, over real HTTP (uvicorn on loopback).

Devices are driven at the protocol level so that each drops out at a chosen SecAgg round and
carries an update we know; the committed model must equal exactly what the survivors' quantized
updates give, and the server's database must hold none of them."""

from __future__ import annotations

import threading
import time

import numpy as np
import onnxruntime
import pytest

from device_runtime import (
    ProtocolClient,
    ProtocolError,
    SecureOutcome,
    SecureSumCodec,
    encode_checkpoint,
    run_secure_aggregation,
)
from emulator import DeviceProfile, EmulatedDevice, Fleet, partition_by_shards
from secagg import Round
from server_stub import AdminError
from tests.support import COLLECTION, deploy, digits_plan

VERSION = onnxruntime.__version__
GROUP = 6  # complete-graph threshold for 6 clients is 5: each group survives one drop-out
DEVICES = 30


def _updates(codec: SecureSumCodec, count: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(10, 60))
        upd = {name: rng.uniform(-3.0, 3.0, codec.shapes[name]).astype(np.float32) for name in codec.names}
        upd["num_examples"] = np.array(n, dtype=np.float32)
        upd["count"] = np.array(n, dtype=np.float32)
        out.append(upd)
    return out


def test_secure_round_is_exact_under_dropouts_at_every_secagg_round(server, admin):
    plan = digits_plan("softmax", secure_aggregation=True)
    _, w0 = deploy(
        admin, plan=plan, goal_count=DEVICES, over_selection=1.0, min_fraction=0.5, selection_timeout_s=60,
        report_timeout_s=5.0, secagg_min_group_size=GROUP, secagg_round_timeout_s=1.0,
    )
    codec = SecureSumCodec(plan)
    updates = _updates(codec, DEVICES, seed=1)
    vectors = [codec.encode(u) for u in updates]
    # Sessions are grouped in check-in order: device i is client i % 6 + 1 of group i // 6.
    drop_at = {
        0: Round.ADVERTISE_KEYS,  # group 0: left out of the sum
        6: Round.SHARE_KEYS,  # group 1: left out
        12: Round.MASKED_INPUT_COLLECTION,  # group 2: drops before masking, left out
        18: Round.UNMASKING,  # group 3: drops after masking, recovered through its shares
        24: Round.SHARE_KEYS,  # group 4: two drop, 4 < t = 5 survive, the group aborts
        25: Round.SHARE_KEYS,
    }
    clients = [ProtocolClient(server.url) for _ in range(DEVICES)]
    sessions = [c.checkin("digits", VERSION) for c in clients]
    assert all(hasattr(s, "session_id") for s in sessions)
    outcomes: dict[int, SecureOutcome] = {}

    def device(i: int) -> None:
        entered: list[str] = []
        outcomes[i] = run_secure_aggregation(
            clients[i], sessions[i], vectors[i], deadline=time.monotonic() + 60,
            on_round=entered.append,
            should_abort=lambda: i in drop_at and bool(entered) and entered[-1] == drop_at[i].value,
        ).outcome

    threads = [threading.Thread(target=device, args=(i,)) for i in range(DEVICES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    for c in clients:
        c.close()

    for i in (0, 6, 12, 18, 24, 25):
        assert outcomes[i] is SecureOutcome.INTERRUPTED
    assert {outcomes[i] for i in range(26, 30)} == {SecureOutcome.ABORTED}
    included = [i for i in range(24) if i not in (0, 6, 12)]
    assert all(outcomes[i] is SecureOutcome.INCLUDED for i in included if i != 18)

    (record,) = admin.rounds("digits")
    assert record["status"] == "committed"
    assert record["metrics"]["reported"] == len(included) == 21
    assert record["metrics"]["secagg"] == {"groups": 5, "completed": 4, "aborted": 1, "summed_devices": 21}

    model, round_number = admin.model("digits")
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


def test_secure_task_refuses_plain_reports_and_bad_messages(server, admin):
    plan = digits_plan("softmax", secure_aggregation=True)
    deploy(admin, plan=plan, goal_count=5, over_selection=1.0, selection_timeout_s=60, report_timeout_s=60,
           secagg_min_group_size=5, secagg_round_timeout_s=5.0)
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


def test_fewer_devices_than_a_group_abandon_the_round_at_once(server, admin):
    plan = digits_plan("softmax", secure_aggregation=True)
    deploy(admin, plan=plan, goal_count=3, over_selection=1.0, min_fraction=1.0, selection_timeout_s=60,
           report_timeout_s=60, secagg_min_group_size=4)
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


def test_emulated_fleet_trains_through_secure_aggregation_with_late_dropouts(tmp_path, server, admin, digits):
    plan = digits_plan("mlp", secure_aggregation=True, epochs=2, learning_rate=0.3)
    _, w0 = deploy(
        admin, plan=plan, goal_count=10, report_timeout_s=15, retry_window_s=(0.1, 0.5), max_rounds=2,
        secagg_min_group_size=5, secagg_round_timeout_s=1.0,
    )
    profile = DeviceProfile(dropout_prob=0.05, late_dropout_prob=0.2, late_dropout_within_s=0.3, cooldown_s=(0.05, 0.2))
    devices = []
    for i, idx in enumerate(partition_by_shards(digits.y_train, 24, seed=0)):
        device = EmulatedDevice(f"d{i}", tmp_path / f"d{i}", server.url, "digits", profile=profile,
                                collection_uri=COLLECTION, seed=i)
        device.add_examples(digits.x_train[idx], digits.y_train[idx])
        devices.append(device)
    fleet = Fleet(devices)
    fleet.start()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if sum(r["status"] == "committed" for r in admin.rounds("digits")) >= 2:
                break
            time.sleep(0.2)
    finally:
        fleet.stop()
    committed = [r for r in admin.rounds("digits") if r["status"] == "committed"]
    assert len(committed) == 2
    for r in committed:
        assert r["metrics"]["secagg"]["completed"] >= 2
        assert r["metrics"]["reported"] >= 10
    model, _ = admin.model("digits")
    assert any(not np.allclose(model[k], w0[k]) for k in plan.weight_names)
    assert fleet.outcomes()["completed"] >= 20


def test_secure_task_needs_a_report_window_that_fits_its_rounds(server, admin):
    with pytest.raises(AdminError) as refused:
        deploy(admin, plan=digits_plan("softmax", secure_aggregation=True), report_timeout_s=10, secagg_round_timeout_s=5)
    assert refused.value.code == "BAD_CONFIG" and refused.value.status == 400
    # A refused deploy leaves nothing behind: no task stored, none active.
    status = admin.status("digits")
    assert status["tasks"] == [] and status["active_tasks"] == [] and status["active_task"] is None
    assert admin.rounds("digits") == []
