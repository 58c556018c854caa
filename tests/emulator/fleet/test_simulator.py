"""The fleet simulation: real devices (the SDK's scheduler and runtime, onnxruntime training on
each device's own examples) against the real server's ASGI app on one virtual clock.

A small fleet runs at a US night for two simulated hours with rounds of a goal of 8, so that
rounds commit within seconds of wall time."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import threading
from collections import Counter

import numpy as np
import pytest

from emulator.fleet import (
    FleetConfig,
    FleetRun,
    device_examples,
    fleet_dataset,
    generate_population,
    simulate,
    simulator,
)
from emulator.fleet.population import DeviceFaults
from emulator.fleet.ray_backend import simulate_sharded
from emulator.fleet.simulator import FleetSimulator
from emulator.fleet.summary import time_to_target_accuracy_s

#: The module's fleets are built once per run: its tests go to one pytest-xdist worker, and its fixtures
#: are session-scoped, so that no test run between two of them makes the worker build them again.
pytestmark = pytest.mark.xdist_group("test_simulator")

SMALL = {"devices": 80, "hours": 2.0, "start_utc_hour": 6.0}


def small_config(seed: int = 1, **task: object) -> FleetConfig:
    data = FleetConfig.default().model_dump()
    data["fleet"].update(SMALL, seed=seed)
    data["task"].update(
        {"goal_count": 8, "retry_min_s": 60.0, "retry_max_s": 300.0, "selection_timeout_s": 300.0, **task}
    )
    return FleetConfig.from_dict(data)


@pytest.fixture(scope="session")
def runs() -> dict[str, FleetRun]:
    return {
        "a": simulate(small_config(seed=1), progress=False),
        "b": simulate(small_config(seed=1), progress=False),
        "other": simulate(small_config(seed=2), progress=False),
    }


def test_the_same_seed_gives_the_same_run(runs):
    a, b = runs["a"], runs["b"]
    assert a.digest == b.digest
    assert a.rounds == b.rounds or all(
        (x.round_id, x.committed, x.selected, x.accepted) == (y.round_id, y.committed, y.selected, y.accepted)
        and (x.accuracy == y.accuracy or (math.isnan(x.accuracy) and math.isnan(y.accuracy)))
        for x, y in zip(a.rounds, b.rounds, strict=True)
    )
    assert a.sessions == b.sessions  # session ids too: the simulated server draws them from the seed
    assert a.timeline == b.timeline


def test_another_seed_gives_another_run(runs):
    assert runs["other"].digest != runs["a"].digest
    assert runs["other"].sessions != runs["a"].sessions


def test_past_measured_rounds_a_sample_of_the_models_is_measured_and_the_summary_stays(runs, monkeypatch):
    """A run of more committed rounds than ``MEASURED_ROUNDS`` measures each model until one
    reaches the target, then a sample and the last: the time to the target, the last accuracy and
    the digest are those of the run that measured every model."""
    full = runs["a"]
    committed = [r for r in full.rounds if r.committed]
    target = sorted(r.accuracy for r in committed)[len(committed) // 2]  # reached part-way through
    monkeypatch.setattr(simulator, "MEASURED_ROUNDS", 2)
    sampled = simulate(small_config(seed=1, target_accuracy=target), progress=False)
    assert sampled.digest == full.digest
    measured = 0
    for x, y in zip(full.rounds, sampled.rounds, strict=True):
        assert (x.round_id, x.committed, x.accepted) == (y.round_id, y.committed, y.accepted)
        if math.isfinite(y.accuracy):
            measured += 1
            assert (y.accuracy, y.loss) == (x.accuracy, x.loss)
    assert 2 <= measured < len(committed)
    summary = sampled.summary()
    assert summary["time_to_target_accuracy_s"] == time_to_target_accuracy_s(full.rounds, target) is not None
    assert summary["accuracy"] == full.summary()["accuracy"]


def test_rounds_commit_and_the_model_learns(runs):
    run = runs["a"]
    committed = [r for r in run.rounds if r.committed]
    assert len(committed) >= 3
    # ten digit classes: a model that learned nothing is right one time in ten
    assert committed[-1].accuracy > 0.5
    for r in committed:
        assert r.accepted >= math.ceil(8 * 0.8)
        assert r.selected <= math.ceil(8 * 1.3)


def test_every_upload_the_devices_saw_accepted_is_in_the_servers_rounds(runs):
    """The device side (opstats shapes) and the server side (round records) count the same
    reports: every `^` session is an accepted report of its round and vice versa."""
    run = runs["a"]
    numbers = {r.round_id.rsplit("/", 1)[0] for r in run.rounds}
    last = max(numbers, key=lambda n: int(n.split("/")[1]))
    accepted_by_round = Counter()
    for r in run.rounds:
        accepted_by_round[r.round_id.rsplit("/", 1)[0]] += r.accepted
    uploads = Counter(s.round_id for s in run.sessions if s.shape.endswith("^"))
    closed = numbers - {last}
    assert closed
    assert {n: uploads[n] for n in closed} == {n: accepted_by_round[n] for n in closed}


def test_each_round_attempt_seated_the_sessions_that_name_it_as_the_server_counted_them(runs):
    """The sessions each attempt seated, read from the devices' rows (``round_attempt``, the attempt
    the server seated each session in), are as many as the server's record of the attempt selected,
    its uploads as many as it accepted, and its bytes are theirs."""
    for run in (runs["a"], runs["other"]):
        seated = Counter(s.round_attempt for s in run.sessions if s.accepted)
        uploads = Counter(s.round_attempt for s in run.sessions if s.shape.endswith("^"))
        assert "" not in seated  # every accepted session names its attempt
        assert {r.round_id: seated[r.round_id] for r in run.rounds} == {r.round_id: r.selected for r in run.rounds}
        assert {r.round_id: uploads[r.round_id] for r in run.rounds} == {r.round_id: r.accepted for r in run.rounds}
        down = Counter()
        for s in run.sessions:
            down[s.round_attempt] += s.bytes_down
        assert all(r.bytes_down == down[r.round_id] for r in run.rounds)
        assert sum(1 for r in run.rounds if r.round_id.endswith("/1")) < len(run.rounds)  # retried attempts too


def test_a_session_the_runs_end_cuts_has_its_row_and_is_no_drop_out():
    """Devices still training at the horizon were selected by the server: their sessions are rows
    (``unfinished``, ending at the horizon), so the sessions accepted are as many as the rounds
    selected, and they count neither as drop-outs nor among the shapes of sessions that ended. A
    sharded run writes the same rows in the same order."""
    config = small_config(seed=3, compute_s_per_example=2.0, report_timeout_s=1800.0)
    config = config.model_copy(update={"fleet": config.fleet.model_copy(update={"hours": 0.25})})
    run = simulate(config, progress=False)
    assert simulate_sharded(config, shards=3, ray=False, progress=False).sessions == run.sessions
    cut = [s for s in run.sessions if s.outcome == "unfinished"]
    assert cut and all(s.end_s == run.simulated_s and s.attempt >= 1 for s in cut)
    summary = run.summary()
    assert summary["sessions_accepted"] == sum(r.selected for r in run.rounds)  # the open round's too
    assert summary["sessions_unfinished"] == len(cut)
    ended = [s for s in run.sessions if s.accepted and s.outcome != "unfinished"]
    assert sum(summary["shapes"].values()) == len(ended)
    drop_outs = sum(1 for s in ended if not s.shape.endswith(("^", "#")))
    assert summary["dropout_rate"] == (drop_outs / len(ended) if ended else None)


def test_a_round_the_runs_end_cuts_is_a_row_of_outcome_unfinished_neither_committed_nor_abandoned(tmp_path):
    """A round still open at the horizon is on no server record, yet its seated sessions are
    accepted ones: it is a row of rounds.csv (outcome unfinished, from its first seated check-in to
    the horizon, its counts its sessions'), counted in rounds_unfinished and in neither the
    committed nor the abandoned rounds nor the completion rate, and the report says so. A
    sharded run writes the same rows."""
    from emulator.fleet.report import explain_rates
    from emulator.fleet.tables import ROUNDS_CSV, RoundRow

    config = FleetConfig.default().replace(devices=100, hours=0.1, goal=10)
    run = simulate(config, progress=False)
    still = [r for r in run.rounds if r.outcome == "unfinished"]
    assert len(still) == 1 and still[0] is run.rounds[-1]
    cut = still[0]
    seated = [s for s in run.sessions if s.accepted and s.round_attempt == cut.round_id]
    assert cut.selected == len(seated) > 0 and not cut.committed and not cut.abandoned
    assert cut.end_s == run.simulated_s and cut.start_s == min(s.start_s for s in seated)
    assert cut.accepted == sum(1 for s in seated if s.shape.endswith("^"))
    closed = run.rounds[:-1]
    assert all(r.outcome in ("committed", "abandoned") and r.committed == (r.outcome == "committed") for r in closed)
    summary = run.summary()
    assert summary["sessions_accepted"] == sum(r.selected for r in run.rounds)
    assert summary["rounds"] == len(run.rounds) and summary["rounds_unfinished"] == 1
    assert summary["rounds_committed"] + summary["rounds_abandoned"] == len(closed)
    assert summary["round_completion_rate"] == summary["rounds_committed"] / len(closed)
    said = explain_rates(summary, run.rounds)["round_completion_rate"]
    assert f"{cut.round_id} (open " in said and "outcome unfinished in rounds.csv" in said
    run.write_tables(tmp_path)
    assert RoundRow.from_csv(tmp_path / ROUNDS_CSV)[-1].outcome == "unfinished"
    assert simulate_sharded(config, shards=2, ray=False, progress=False).rounds == run.rounds


def test_sessions_cost_virtual_time_from_the_work_and_bytes_they_really_had(runs):
    run = runs["a"]
    config = run.config
    specs = {s.device_id: s for s in generate_population(config)}
    cost = run.plan_cost
    per_example = cost["flops_per_example"] / config.task.reference_flops_per_s * config.task.epochs
    completed = [s for s in run.sessions if s.shape.endswith("^")]
    assert completed
    for s in completed:
        spec = specs[s.device_id]
        assert s.compute_s == pytest.approx(s.examples * per_example * spec.speed, rel=1e-6)
        assert s.examples == len(device_examples(config, spec)[1])
        wire = 8.0 * s.bytes_up / spec.network.up_bps + 8.0 * s.bytes_down / spec.network.down_bps
        assert s.network_s >= wire
        assert s.end_s - s.start_s >= s.compute_s + s.network_s - 1e-5  # the table keeps microseconds
        assert s.bytes_up > cost["update_bytes"] and s.bytes_down > cost["checkpoint_bytes"]


def test_the_timeline_samples_the_whole_run(runs):
    run = runs["a"]
    times = [row.t_s for row in run.timeline]
    assert times == [300.0 * i for i in range(len(times))]
    assert times[-1] == SMALL["hours"] * 3600.0
    assert all(0 <= row.available <= SMALL["devices"] for row in run.timeline)
    assert max(row.participating for row in run.timeline) > 0


class _AvailableUntil:
    """Idle, charging and unmetered from 0 until ``end``, never again."""

    def __init__(self, end: float) -> None:
        self.end = end

    def state_at(self, t: float):
        from device_runtime.conditions import DeviceState

        on = t < self.end
        return DeviceState(idle=on, charging=on, battery_level=0.9, unmetered_network=on)

    def next_change(self, t: float) -> float | None:
        return self.end if t < self.end else None


def _run_available_until(tmp_path, config: FleetConfig, end: float, devices: int) -> FleetRun:
    """The first ``devices`` of ``config``'s population, all taking part, without faults, each
    available from the start until ``end`` and never again."""
    no_faults = DeviceFaults(0.0, 0.0, 0.0, 0.0, 0.0)
    specs = [
        dataclasses.replace(s, availability=_AvailableUntil(end), faults=no_faults, takes_part=True)
        for s in generate_population(config)[:devices]
    ]
    data = fleet_dataset(config)
    sim = FleetSimulator(
        config, specs, lambda spec: device_examples(config, spec), (data.x_test, data.y_test), workdir=tmp_path
    )
    return sim.run()


def test_conditions_that_stop_holding_mid_training_interrupt_through_the_runtimes_abort(tmp_path):
    """Every device stops being available while it trains (compute costs 5 s per example):
    each session ends `-v[!` and the server counts it as an abort, not a silent drop-out."""
    run = _run_available_until(tmp_path, small_config(seed=3, compute_s_per_example=5.0, max_rounds=1), 200.0, 12)
    sessions = [s for s in run.sessions if s.accepted]
    assert sessions
    assert {s.shape for s in sessions} == {"-v[!"}
    assert all(s.outcome == "interrupted" and s.end_s >= 200.0 for s in sessions)
    first = run.rounds[0]
    assert not first.committed and first.dropped == first.selected == len(
        [s for s in sessions if s.round_id == f"{first.task}/1"]
    )


def test_devices_turned_away_wait_only_while_they_could_train(tmp_path):
    """A device told to come back later counts as checking in (waiting) until it does, or until
    its conditions stop holding: every device here stops being available at 1,000 s, and none
    is waiting after that, though their jobs sleep on (past the run's end)."""
    run = _run_available_until(
        tmp_path, small_config(seed=4, goal_count=8, retry_min_s=600.0, retry_max_s=900.0), 1000.0, 30
    )
    assert sum(1 for s in run.sessions if s.outcome == "rejected") > 0
    assert max(row.checking_in for row in run.timeline if row.t_s < 1000.0) > 0
    assert all(row.checking_in == 0 and row.available == 0 for row in run.timeline if row.t_s >= 1000.0)


def test_numbers_of_the_run_are_plain_and_finite(runs):
    run = runs["a"]
    for s in run.sessions:
        assert np.isfinite([s.start_s, s.end_s, s.compute_s, s.network_s, s.local_hour]).all()
        assert s.end_s >= s.start_s


def test_the_same_fleet_runs_over_real_loopback_http_without_a_socket_or_thread_per_device():
    """`http=True`: the devices' requests go to uvicorn on loopback through one small connection
    pool, from the loop's thread; rounds still commit and every device error is a counted row."""
    fds0, threads0 = len(os.listdir("/proc/self/fd")), threading.active_count()
    seen = {"fds": 0, "threads": 0}

    def sample(t_s: float, rounds: int, active: int) -> None:
        seen["fds"] = max(seen["fds"], len(os.listdir("/proc/self/fd")))
        seen["threads"] = max(seen["threads"], threading.active_count())

    config = small_config(seed=5)
    run = simulate(config, progress=sample, http=True)
    assert any(r.committed for r in run.rounds)
    assert sum(1 for s in run.sessions if s.shape.endswith("^")) >= 8
    assert seen["fds"] - fds0 < 20 < config.fleet.devices
    assert seen["threads"] - threads0 <= 8
    assert all(s.outcome != "error" or s.shape.endswith("*") for s in run.sessions)


@pytest.mark.parametrize("how", ["in process", "http", "shards"])
def test_an_interrupted_run_leaves_no_thread_socket_or_database_open(tmp_path, how):
    """Ctrl-C mid-run (here: from the progress callback, an hour in) ends the run at once, and the
    app's loop, its thread pool, the uvicorn server and the SQLite store are all closed."""
    fds0, threads0 = len(os.listdir("/proc/self/fd")), threading.active_count()

    def interrupt(t_s: float, rounds: int, active: int) -> None:
        if t_s >= 3600.0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        if how == "shards":
            simulate_sharded(small_config(seed=5), shards=2, ray=False, out_dir=tmp_path, progress=interrupt)
        else:
            simulate(small_config(seed=5), out_dir=tmp_path, progress=interrupt, http=how == "http")
    assert threading.active_count() == threads0
    assert len(os.listdir("/proc/self/fd")) <= fds0
    assert not (tmp_path / "summary.json").exists()


def test_another_process_with_another_hash_seed_gives_the_same_digest(runs, tmp_path):
    """Nothing in the run depends on the process: not set order (string hashing), not ids, not the
    time zone, the locale, the threads numpy's libraries may take, nor the working directory."""
    code = (
        "from tests.emulator.fleet.test_simulator import small_config\n"
        "from emulator.fleet import simulate\n"
        "print(simulate(small_config(seed=1), progress=False).digest)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {
        **os.environ,
        "PYTHONHASHSEED": "12345",
        "PYTHONPATH": root,
        "TZ": "Asia/Kolkata",
        "LANG": "C",
        "LC_ALL": "C",
        "OMP_NUM_THREADS": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == runs["a"].digest


def _run_with_loop(config: FleetConfig, tmp_path, name: str) -> tuple[FleetRun, int]:
    specs = generate_population(config)
    data = fleet_dataset(config)
    sim = FleetSimulator(
        config, specs, lambda spec: device_examples(config, spec), (data.x_test, data.y_test), workdir=tmp_path / name
    )
    return sim.run(), sim.loop.events_run


def test_devices_training_ahead_of_the_loop_give_the_run_of_a_sleep_per_batch(tmp_path, monkeypatch):
    """A training device keeps its own time instead of sleeping on the loop after each batch.
    With slow training and frequent faults (apps killed, conditions breaking and the network
    lost mid-training), the run is the same, bit for bit, as
    the run where every batch sleeps on the loop, with far fewer events."""
    from emulator.fleet import sim_device

    data = small_config(seed=4, compute_s_per_example=6.0).model_dump()
    data["fleet"]["hours"] = 1.5
    data["faults"].update(app_killed_per_h=4.0, conditions_change_per_h=4.0, network_lost_per_h=3.0)
    config = FleetConfig.from_dict(data)
    ahead, ahead_events = _run_with_loop(config, tmp_path, "ahead")
    monkeypatch.setattr(sim_device, "RUN_AHEAD", False)
    slept, slept_events = _run_with_loop(config, tmp_path, "slept")
    assert ahead.digest == slept.digest
    assert [(r.round_id, r.committed, r.selected, r.accepted, r.dropped) for r in ahead.rounds] == [
        (r.round_id, r.committed, r.selected, r.accepted, r.dropped) for r in slept.rounds
    ]
    assert ahead.sessions == slept.sessions
    assert ahead.timeline == slept.timeline
    # the faults did strike mid-training
    shapes = Counter((s.shape, s.outcome) for s in ahead.sessions)
    assert shapes[("-v[", "app_killed")] > 0 and shapes[("-v[!", "interrupted")] > 0
    assert ahead_events < slept_events


def test_the_timeline_counts_the_available_devices_waiting_out_their_interval(runs):
    """``resting``: at each sample, the devices available then whose session (completed, or its
    report refused) ended within the participation interval before: they do not check in yet."""
    run = runs["a"]
    specs = {s.device_id: s for s in generate_population(run.config)}
    waited = [s for s in run.sessions if s.accepted and s.outcome in ("completed", "report_rejected")]
    for row in run.timeline:
        recent = {s.device_id for s in waited if row.t_s - simulator.MIN_INTERVAL_S < s.end_s <= row.t_s}
        state = [specs[d].availability.state_at(row.t_s) for d in recent]
        assert (
            row.resting == sum(1 for st in state if st.idle and st.charging and st.unmetered_network) <= row.available
        )
    assert max(row.resting for row in run.timeline) > 0


def test_participating_counts_the_devices_still_training_for_a_round_that_has_closed(runs):
    """``participating``: the devices seated in a round and not done with their session, a late
    one whose round has closed included (its report will be refused), so the count can stand
    above ``active_sessions`` (the round open now) and above 0 between rounds."""
    run = runs["a"]
    ended = {r.round_id: r.end_s for r in run.rounds}
    seated = [s for s in run.sessions if s.accepted]
    late_between_rounds = 0
    for row in run.timeline:
        t = row.t_s
        open_ = [s for s in seated if s.start_s <= t < s.end_s]
        # a session's row starts at its check-in, the device is participating from the answer
        checked_in = [s for s in open_ if s.start_s <= t - 60.0]
        assert len(checked_in) <= row.participating <= len(open_)
        late = [s for s in open_ if ended.get(s.round_attempt, math.inf) <= t]
        assert all(s.outcome != "completed" for s in late)
        if row.active_sessions == 0 and row.participating > 0:
            assert len(late) == row.participating
            late_between_rounds += 1
    assert late_between_rounds > 0


def test_the_progress_bar_ends_at_the_rounds_committed_after_its_task_completed():
    """A task of 2 rounds completes mid-run: its rounds left the population's open-round status,
    and the bar ended at 0 rounds committed where the summary said 2."""
    seen: list[int] = []
    run = simulate(small_config(seed=1, max_rounds=2), progress=lambda t_s, rounds, active: seen.append(rounds))
    assert run.summary()["rounds_committed"] == 2
    assert seen[-1] == 2 and max(seen) == 2
