"""A central-DP digits task end to end on real parts: a uvicorn server on loopback, device
runtimes training on their own example stores, a restart of the server on the same SQLite file
in the middle, and the task stopping at its privacy budget. Every round's epsilon is checked
against ``dp_accounting`` computed here, independently of the server's ledger."""

from __future__ import annotations

import functools
import time

import dp_accounting
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from device_runtime import encode_checkpoint, initial_weights
from emulator import DeviceProfile, EmulatedDevice, RealTimeFleet, partition_by_shards
from server_stub import AdminClient, DPConfig, RoundConfig, ServerThread
from tests.support import COLLECTION, digits_plan

Z, DELTA, MAX_EPSILON = 1.0, 1e-5, 13.0


def _budget_rounds() -> int:
    """The rounds at Z whose epsilon stays within MAX_EPSILON, by dp_accounting's PLD."""
    k = 0
    while _pld_epsilon(k + 1) <= MAX_EPSILON:
        k += 1
    return k


@functools.cache
def _one_round() -> pld_lib.PrivacyLossDistribution:
    return pld_lib.from_gaussian_mechanism(standard_deviation=Z, value_discretization_interval=1e-4)


@functools.cache
def _pld_epsilon(k: int) -> float:
    """Epsilon after k rounds, each one Gaussian mechanism of std Z over sensitivity 1, composed
    as privacy loss distributions."""
    return float(_one_round().self_compose(k).get_epsilon_for_delta(DELTA))


def _fleet(tmp_path, url: str, digits, n: int = 10) -> RealTimeFleet:
    parts = partition_by_shards(digits.y_train, n, seed=1)
    devices = []
    for i, idx in enumerate(parts):
        device = EmulatedDevice(
            f"d{i}",
            tmp_path / f"d{i}",
            url,
            "digits",
            profile=DeviceProfile(cooldown_s=(0.05, 0.3)),
            collection_uri=COLLECTION,
            seed=i,
        )
        device.add_examples(digits.x_train[idx], digits.y_train[idx])
        devices.append(device)
    return RealTimeFleet(devices)


def _wait(admin: AdminClient, done, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rounds = admin.rounds("digits")
        if done(rounds):
            return rounds
        time.sleep(0.1)
    raise AssertionError(f"timed out: {admin.rounds('digits')}")


def _committed(rounds: list[dict]) -> list[dict]:
    return [r for r in rounds if r["status"] == "committed"]


def test_a_central_dp_task_reports_epsilon_survives_a_restart_and_stops_at_its_budget(tmp_path, digits) -> None:
    budget = _budget_rounds()
    assert budget == 6  # the setting this test was written for: a restart after 2 rounds leaves some to run
    plan = digits_plan("softmax")
    config = RoundConfig(
        goal_count=4,
        min_reports=3,
        report_timeout_s=5,
        selection_timeout_s=20,
        retry_window_s=(0.1, 0.5),
        dp=DPConfig(mode="central", noise_multiplier=Z, clip=0.5, delta=DELTA, max_epsilon=MAX_EPSILON),
    )
    db = tmp_path / "server.db"
    with ServerThread(db) as server, server.admin() as admin:
        admin.create_population("digits")
        admin.deploy_task("digits", "train", plan, encode_checkpoint(initial_weights(plan, seed=0)), config)
        fleet = _fleet(tmp_path, server.url, digits)
        fleet.start()
        try:
            before = _committed(_wait(admin, lambda rs: len(_committed(rs)) >= 2, timeout=120))
        finally:
            fleet.stop()
        before = _committed(admin.rounds("digits"))  # what is on record as the server stops

    with ServerThread(db) as server, server.admin() as admin:
        # a restarted server reports the same epsilon for the rounds on record ...
        again = _committed(admin.rounds("digits"))
        assert [r["metrics"]["epsilon"] for r in again] == [r["metrics"]["epsilon"] for r in before]
        fleet = _fleet(tmp_path / "again", server.url, digits)
        fleet.start()
        try:
            _wait(
                admin,
                lambda rs: admin.status("digits")["tasks"][0]["status"] == "completed",
                timeout=180,
            )
        finally:
            fleet.stop()
        rounds = _committed(admin.rounds("digits"))
        status = admin.status("digits")
        frame = admin.rounds_frame("digits")

    # ... and its ledger goes on from them: one entry per committed round, across the restart
    assert [r["metrics"]["dp_rounds"] for r in rounds] == list(range(1, budget + 1))
    assert len(before) < budget
    for k, record in enumerate(rounds, start=1):
        m = record["metrics"]
        assert abs(m["epsilon"] - _pld_epsilon(k)) < 1e-4 * _pld_epsilon(k)
        exact = dp_accounting.get_epsilon_gaussian(Z / k**0.5, DELTA)  # k Gaussians compose to one at Z/sqrt(k)
        assert abs(m["epsilon"] - exact) < 1e-9 * exact
        assert (m["delta"], m["noise_multiplier"], m["dp_mode"], m["dp_clip"]) == (DELTA, Z, "central", 0.5)
        assert "update_norm" not in m["device_metrics"]
    # the task completed at its budget: one more round would have passed max_epsilon
    assert rounds[-1]["metrics"]["epsilon"] <= MAX_EPSILON < _pld_epsilon(budget + 1)
    assert status["tasks"][0]["status"] == "completed" and status["active_task"] is None
    assert list(frame.loc[frame["status"] == "committed", "dp_rounds"]) == list(range(1, budget + 1))
