"""The whole loop on real parts: a uvicorn server on loopback, 24 device runtimes with their own
SQLite example stores, several rounds over HTTP, and a model that gets better."""

from __future__ import annotations

import time

import numpy as np

from device_runtime import PlanExecutor, build_eval_plan, encode_checkpoint, initial_weights
from emulator import DeviceProfile, EmulatedDevice, RealTimeFleet, partition_by_shards
from server_stub import AdminClient, RoundConfig, ServerThread
from tests.support import COLLECTION, digits_plan


def _accuracy(plan, weights, data) -> float:
    evaluator = PlanExecutor(build_eval_plan(plan))
    return evaluator.evaluate(weights, [{"x": data.x_test, "y": data.y_test}])["eval_accuracy"]


def _wait_for_commits(admin: AdminClient, count: int, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rounds = admin.rounds("digits")
        if sum(r["status"] == "committed" for r in rounds) >= count:
            return rounds
        time.sleep(0.1)
    raise AssertionError(f"fewer than {count} rounds committed in {timeout}s: {admin.rounds('digits')}")


def test_fleet_trains_over_http_and_server_resumes_after_restart(tmp_path, digits):
    plan = digits_plan("mlp", epochs=3, learning_rate=0.3)
    weights0 = initial_weights(plan, seed=0)
    # A round short of its goal (a device dropped or late) waits out its report window, about one
    # round in three: 2 s, in which the devices that report do so within a few tenths of a second
    # even on a loaded machine; a late device reports half a second past it.
    config = RoundConfig(
        goal_count=8, report_timeout_s=2, selection_timeout_s=20, retry_window_s=(0.1, 0.5), max_rounds=12
    )
    parts = partition_by_shards(digits.y_train, 24, seed=1)
    db = tmp_path / "server.db"

    server = ServerThread(db).start()
    admin = server.admin()
    admin.create_population("digits")
    admin.deploy_task("digits", "train", plan, encode_checkpoint(weights0), config)
    profile = DeviceProfile(dropout_prob=0.1, late_prob=0.1, late_delay_s=2.5, cooldown_s=(0.05, 0.3))
    devices = []
    for i, idx in enumerate(parts):
        device = EmulatedDevice(
            f"d{i}", tmp_path / f"d{i}", server.url, "digits", profile=profile, collection_uri=COLLECTION, seed=i
        )
        device.add_examples(digits.x_train[idx], digits.y_train[idx])
        devices.append(device)
    fleet = RealTimeFleet(devices)
    fleet.start()
    try:
        rounds = _wait_for_commits(admin, 10, timeout=120)  # of 12: the task is still running at the restart
    finally:
        fleet.stop()
        admin.close()
        server.stop()

    committed = [r for r in rounds if r["status"] == "committed"]
    assert [r["round"] for r in committed] == list(range(1, len(committed) + 1))
    for r in committed:
        assert r["metrics"]["reported"] >= config.commit_threshold
        assert r["metrics"]["selected"] <= config.selection_target
    outcomes = fleet.outcomes()
    assert outcomes["completed"] >= 6 * config.commit_threshold
    assert outcomes["interrupted"] > 0
    assert any(shape == "-v[]+^" for shape in fleet.shapes())

    # After a restart the server continues from the last committed round with its model.
    with ServerThread(db) as restarted, restarted.admin() as admin2:
        status = admin2.status("digits")
        last = max(r["round"] for r in admin2.rounds("digits") if r["status"] == "committed")
        assert status["round"] == last + 1
        model, number = admin2.model("digits")
        assert number == last
    assert set(model) == set(weights0)
    final = _accuracy(plan, model, digits)
    initial = _accuracy(plan, weights0, digits)
    assert final > initial + 0.3, (initial, final)
    assert not np.allclose(model[plan.weight_names[0]], weights0[plan.weight_names[0]])
