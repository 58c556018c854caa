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


@pytest.fixture
def counted_store_counts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each time a device's example store counted what a selector matches."""
    calls: list[int] = []
    count = sim_device.LazyExampleStore.count

    def counting(self: sim_device.LazyExampleStore, selector: object) -> int:
        calls.append(1)
        return count(self, selector)  # type: ignore[arg-type]

    monkeypatch.setattr(sim_device.LazyExampleStore, "count", counting)
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
    summary = run.summary()
    note = summary["round_completion_note"]
    stopped_n = len([s for s in trained if s.shape == "-v[!"])
    assert f"; {stopped_n} of the run's {summary['sessions_accepted']} accepted sessions were interrupted while" in note
    assert "the devices' max_training_s" in note


def test_a_session_that_ends_in_time_is_trained_to_its_end_and_the_same_seed_repeats_it(
    counted_batches, counted_store_counts
):
    """Ten epochs of the digits MLP at the default pace (about 400 s a session, more on slower
    devices) in a 15-minute report window, which is then the devices' max_training_s: none is
    stopped, every epoch is charged, and a run twice gives one digest. A device counts the
    examples its session has left from one count of its store per job run, not one per batch."""
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
    trained = _trained(run)
    assert len(counted_batches) > 10 * len(trained)  # ten epochs of a batch or more each
    # the runtime counts twice as a session starts, the device once as its training starts
    assert len(counted_store_counts) <= 3 * len(trained)
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


@pytest.mark.parametrize(
    ("time_budget_s", "says"),
    [
        # stopped before the 60 s report window closes: the session is 30 s long, and reports nothing
        (30.0, "longer than the plan's time budget of 30 s: most sessions will be stopped at the plan's time budget"),
        # stopped after it, at the plan's budget and not at the devices' 600 s
        (
            120.0,
            "longer than the 60 s report window (task.report_timeout_s): most sessions will be stopped at the plan's",
        ),
        # no budget: stopped at the devices' max_training_s
        (None, "most sessions will be stopped at the devices' 600 s of training"),
    ],
)
def test_the_warning_before_the_run_counts_a_session_as_long_as_the_device_trains_before_it_is_stopped(
    tmp_path, time_budget_s, says
):
    """A billion epochs would train for years; the devices stop at the plan's time budget (or their
    max_training_s), and the warning before the run says where, not that sessions outlast the window
    by years of training."""
    from emulator.fleet.simulator import notify_before_run
    from emulator.fleet.workload import load_workload

    config = absurd_fleet(tmp_path, time_budget_s=time_budget_s, compute_s_per_example=0.001)
    said: list[str] = []
    notify_before_run(config, load_workload(config), generate_population(config), said.append)
    slow = [m for m in said if m.startswith("a session's training takes about ")]
    assert len(slow) == 1 and says in slow[0] and "report nothing" in slow[0]
    assert ("time_budget_s in its task file" in slow[0]) == (time_budget_s is not None)
    assert ("lengthen task.report_timeout_s" in slow[0]) == (time_budget_s is None)


def test_a_session_stopped_after_it_ends_within_the_window_is_not_said_to_come_late():
    from emulator.fleet.config import TaskSection
    from emulator.fleet.summary import slow_sessions

    task = TaskSection()
    # training to its end would take 1,000 s; the plan's budget of 50 s stops it within the window: nothing reported
    said = slow_sessions(1000.0, 500, 2, 1.0, task, 60.0, 50.0, True)
    assert said is not None and "report window" not in said and "stopped at the plan's time budget of 50 s" in said
    # a session that ends within its budget and the window: nothing to say
    assert slow_sessions(40.0, 20, 2, 1.0, task, 60.0, 50.0, True) is None
    # a budget longer than the window, training ended before it: the report comes late
    late = slow_sessions(100.0, 50, 2, 1.0, task, 60.0, 120.0, True)
    assert late is not None and "most reports will come late" in late and "lengthen task.report_timeout_s" in late
