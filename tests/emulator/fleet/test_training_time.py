"""A simulated device stops training where a real one is stopped by force: at the plan's time
budget, or its class's ``max_training_s`` when the plan declares none, in virtual time; and a
session that cannot end in time is not trained for real to its end."""

from __future__ import annotations

from pathlib import Path

import pytest

from emulator.fleet import FleetConfig, FleetRun, generate_population, sim_device, simulate

ABSURD_TASK = """
from device_runtime import build_mlp_plan
from emulator.datasets import load_digits_dataset
from emulator.toolchain.tasks import ProxyData, Task
from example_store import ExampleSelector
from server_stub import RoundConfig

SELECTOR = ExampleSelector("app:/digits")
EPOCHS = 10**9
TIME_BUDGET_S = None


def mlp(hp):
    return build_mlp_plan(
        64, (32,), 10, learning_rate=0.2, batch_size=16, epochs=EPOCHS, selector=SELECTOR, time_budget_s=TIME_BUDGET_S
    )


def proxy():
    d = load_digits_dataset(seed=0)
    return ProxyData.split({"x": d.x_train[:200], "y": d.y_train[:200]}, devices=2, seed=0)


task = Task(name="absurd", model=mlp, proxy=proxy, selector=SELECTOR, batch_size=16, epochs=EPOCHS,
            rounds=RoundConfig(goal_count=10, max_rounds=20))
"""

#: The devices' max_training_s in these fleets: 600 s (the report window, 60 s, is shorter).
MAX_TRAINING_S = 600.0


def absurd_fleet(tmp_path: Path, time_budget_s: float | None = None, **task: object) -> FleetConfig:
    (tmp_path / "absurd_task.py").write_text(
        ABSURD_TASK.replace("TIME_BUDGET_S = None", f"TIME_BUDGET_S = {time_budget_s}")
    )
    return FleetConfig.from_dict(
        {
            "fleet": {"devices": 40, "hours": 1.0, "seed": 3, "start_utc_hour": 6.0},
            "task": {"file": str(tmp_path / "absurd_task.py"), "goal_count": 10, **task},
        }
    )


@pytest.fixture
def counted_batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The batches the devices trained for real (each one ``WorkMeter.trained`` call)."""
    calls: list[int] = []
    trained = sim_device.SimDevice.trained

    def counting(self: sim_device.SimDevice, plan: object, examples: int) -> None:
        calls.append(examples)
        trained(self, plan, examples)  # type: ignore[arg-type]

    monkeypatch.setattr(sim_device.SimDevice, "trained", counting)
    return calls


def _trained(run: FleetRun) -> list:
    return [s for s in run.sessions if s.compute_s > 0]


def test_a_plan_of_a_billion_epochs_is_stopped_at_max_training_s_after_a_batch(tmp_path, counted_batches):
    # a thousandth of a second per example: 600 s would be 600,000 examples trained for real
    run = simulate(absurd_fleet(tmp_path, compute_s_per_example=0.001), progress=False)
    trained = _trained(run)
    assert trained and not [s for s in run.sessions if s.outcome == "completed"]
    assert all(s.compute_s <= MAX_TRAINING_S for s in trained)
    stopped = [s for s in trained if s.compute_s == pytest.approx(MAX_TRAINING_S)]
    assert stopped
    for s in stopped:  # stopped by force: interrupted after its training, recorded as such
        assert s.outcome == "interrupted" and s.shape == "-v[!" and s.examples == 0
        assert s.end_s - s.start_s >= MAX_TRAINING_S
    # the others were cut first: their conditions broke, their app was killed, or the run ended
    assert {s.outcome for s in trained} <= {"interrupted", "app_killed", "unfinished"}
    # a batch or two for real per session, not the 37,500 batches of 600 s
    assert len(counted_batches) <= 2 * len(trained)
    assert run.errors == {}
    # the report says why no round committed
    note = run.summary()["round_completion_note"]
    assert f"{len([s for s in trained if s.shape == '-v[!'])} of them interrupted while training" in note
    assert "the devices' max_training_s" in note


def test_a_session_that_ends_in_time_is_trained_to_its_end_and_the_same_seed_repeats_it():
    """Ten epochs of the digits MLP at the default pace (about 400 s a session, more on slower
    devices) in a 15-minute report window, which is then the devices' max_training_s: none is
    stopped, every epoch is charged, and a run twice gives one digest."""
    config = FleetConfig.from_dict(
        {
            "fleet": {"devices": 40, "hours": 1.0, "seed": 3, "start_utc_hour": 6.0},
            "task": {"goal_count": 8, "epochs": 10, "report_timeout_s": 900.0},
        }
    )
    run = simulate(config, progress=False)
    specs = {s.device_id: s for s in generate_population(config)}
    completed = [s for s in run.sessions if s.outcome == "completed"]
    assert completed and max(s.compute_s for s in completed) > MAX_TRAINING_S
    for s in completed:
        assert s.compute_s == pytest.approx(10 * s.examples * specs[s.device_id].speed, rel=1e-6)
    assert simulate(config, progress=False).digest == run.digest


def test_a_session_longer_than_max_training_s_at_the_default_pace_is_stopped_there(tmp_path):
    """A thousand epochs at one example a second: each session would train for about 10 hours."""
    config = FleetConfig.from_dict(
        {
            "fleet": {"devices": 40, "hours": 1.0, "seed": 3, "start_utc_hour": 6.0},
            "task": {"goal_count": 8, "epochs": 1000},
        }
    )
    run = simulate(config, progress=False)
    trained = _trained(run)
    assert trained and all(s.compute_s <= MAX_TRAINING_S for s in trained)
    assert not [s for s in run.sessions if s.outcome == "completed"]
    assert [s for s in trained if s.outcome == "interrupted" and s.compute_s == pytest.approx(MAX_TRAINING_S)]


def test_devices_stopped_at_their_training_time_give_one_digest_single_and_sharded(tmp_path):
    from emulator.fleet.ray_backend import simulate_sharded

    config = absurd_fleet(tmp_path, compute_s_per_example=0.001)
    run = simulate(config, progress=False)
    assert [s for s in run.sessions if s.compute_s == pytest.approx(MAX_TRAINING_S)]
    sharded = simulate_sharded(config, shards=2, ray=False)
    assert sharded.digest == run.digest
    assert sharded.sessions == run.sessions


def test_a_plan_that_declares_a_time_budget_is_stopped_at_it(tmp_path, counted_batches):
    run = simulate(absurd_fleet(tmp_path, time_budget_s=120.0, compute_s_per_example=0.001), progress=False)
    trained = _trained(run)
    assert trained and all(s.compute_s <= 120.0 for s in trained)
    stopped = [s for s in trained if s.compute_s == pytest.approx(120.0)]
    assert stopped and all(s.outcome == "interrupted" and s.shape == "-v[!" for s in stopped)
    assert len(counted_batches) <= 2 * len(trained)
