"""The fleet past one process: devices over shards with the server in one process, equal to the
single-process run bit for bit; independent runs fanned out, equal to the same runs alone.

The shards' exchange is checked in this process first (shards as plain objects, any number of
them), then on a real local Ray cluster of two workers."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from emulator.cli.commands import main
from emulator.fleet import FleetConfig, FleetConfigError, FleetRun, SimulationError, simulate
from emulator.fleet.events import EventLoop
from emulator.fleet.ray_backend import parse_sweep, run_many, simulate_sharded, sweep_configs

from .test_simulator import small_config

#: Ray, an optional extra, is imported by the cluster fixture, not as each pytest worker collects the
#: module (about 1 s of CPU); in CI its absence is a failure, not a skip.
HAS_RAY = importlib.util.find_spec("ray") is not None
if not HAS_RAY and os.environ.get("CI"):
    raise ImportError("Ray is not installed: pip install -e '.[ray]'")

needs_ray = pytest.mark.skipif(not HAS_RAY, reason="Ray is not installed: pip install -e '.[ray]'")


def tiny_config(seed: int = 1, **task: object) -> FleetConfig:
    data = small_config(seed, **task).model_dump(mode="json")
    data["fleet"].update(devices=30, hours=0.5)
    return FleetConfig.from_dict(data)


def same_run(a: FleetRun, b: FleetRun) -> None:
    """Equal in everything the run decides (the server's session ids are random bearer material)."""
    assert a.digest == b.digest
    assert a.rounds == b.rounds
    assert a.timeline == b.timeline
    strip = lambda run: [dataclasses.replace(s, session_id="x" if s.session_id else "") for s in run.sessions]  # noqa: E731
    assert strip(a) == strip(b)


_keyed = st.lists(
    st.tuples(st.sampled_from([0.0, 1.0, 2.5]), st.integers(-2, 2), st.integers(0, 5)), min_size=1, max_size=40
)


@given(_keyed, st.randoms(use_true_random=False))
def test_ties_between_keys_do_not_depend_on_how_the_loop_interleaved_them(events, rnd):
    """What lets shards repeat one loop's order: events of different keys (devices) at one
    (time, order) run by key; only one key's own events keep their scheduling order."""

    def ran(schedule: list[int]) -> list[int]:
        loop, out = EventLoop(), []
        for i in schedule:
            at, order, key = events[i]
            loop.call_at(at, out.append, i, order=order, key=key)
        loop.run_until(10.0)
        return out

    # another interleaving: shuffle the keys' streams together, each key's own events in order
    streams = {k: [i for i, e in enumerate(events) if e[2] == k] for k in {e[2] for e in events}}
    other: list[int] = []
    while streams:
        k = rnd.choice(sorted(streams))
        other.append(streams[k].pop(0))
        if not streams[k]:
            del streams[k]
    assert ran(list(range(len(events)))) == ran(other)


def hour_config(seed: int = 1) -> FleetConfig:
    """The small fleet for one simulated hour: four rounds commit, about 260 requests cross to the server."""
    data = small_config(seed).model_dump(mode="json")
    data["fleet"].update(hours=1.0)
    return FleetConfig.from_dict(data)


@pytest.fixture(scope="session")
def one_process() -> FleetRun:
    run = simulate(small_config(seed=1), progress=False)
    assert sum(r.committed for r in run.rounds) >= 3  # a run where the server's order matters
    return run


def test_one_or_an_uneven_number_of_shards_gives_the_single_process_run():
    """A lighter twin of the slow test below: one shard, and three shards that split the 80
    devices unevenly, of an hour of the small fleet (two shards: the command's and Ray's tests)."""
    config = hour_config(seed=1)
    alone = simulate(config, progress=False)
    assert sum(r.committed for r in alone.rounds) >= 3  # a run where the server's order matters
    for shards in (1, 3):
        stats: dict = {}
        run = simulate_sharded(config, shards=shards, ray=False, stats=stats)
        same_run(run, alone)
        assert stats["shards"] == shards and stats["requests"] > 100


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shards=st.integers(1, 4))
def test_any_number_of_shards_gives_the_single_process_run(one_process, shards):
    stats: dict = {}
    run = simulate_sharded(small_config(seed=1), shards=shards, ray=False, stats=stats)
    same_run(run, one_process)
    assert stats["shards"] == shards and stats["requests"] > 100


def test_a_device_killed_while_its_request_is_at_the_server_dies_as_in_one_process():
    """App kills every second or so: some land while the device's request waits for its
    answer, which cuts the shard's window at the kill; the run still equals one process's."""
    data = tiny_config(seed=3).model_dump(mode="json")
    data["fleet"].update(devices=40, hours=1.0)
    data["faults"]["app_killed_per_h"] = 3600.0
    config = FleetConfig.from_dict(data)
    stats: dict = {}
    sharded = simulate_sharded(config, shards=3, ray=False, stats=stats)
    alone = simulate(config, progress=False)
    same_run(sharded, alone)
    assert stats["held"] > 0
    assert sum(s.outcome == "app_killed" for s in alone.sessions) > 20


def test_a_sharded_run_into_a_folder_that_holds_an_earlier_run_starts_from_a_fresh_server(tmp_path):
    """As one process's run does: the earlier run's server database in OUT/server is not the new
    run's (its task was already deployed there, and the server refused the fleet's task)."""
    config = tiny_config(seed=2)
    first = simulate(config, out_dir=tmp_path, progress=False)
    again = simulate_sharded(config, shards=2, ray=False, out_dir=tmp_path)
    same_run(again, first)
    same_run(simulate_sharded(config, shards=2, ray=False, out_dir=tmp_path), first)


def test_a_shard_count_below_one_is_refused():
    with pytest.raises(SimulationError, match="shards must be at least 1"):
        simulate_sharded(tiny_config(), shards=0, ray=False)


def test_more_shards_than_devices_are_refused_before_the_run(capsys):
    """--shards 100000 for 50 devices ran on for hours, every empty shard costing each exchange
    window (200 shards: 30 times the single-process run)."""
    config = tiny_config()
    devices = config.fleet.devices
    with pytest.raises(SimulationError, match=rf"shards: {devices + 1} for a fleet of {devices} devices"):
        simulate_sharded(config, shards=devices + 1, ray=False)
    assert (
        main(["simulate", "--devices", "50", "--hours", "0.1", "--goal", "8", "--shards", "51", "--no-progress"]) == 2
    )
    assert capsys.readouterr().err == (
        "fedfleet simulate: --shards 51: more shards than the fleet's 50 devices; use at most 50 (a shard per core "
        "or Ray worker is what speeds a run up)\n"
    )


def test_a_sweep_is_the_grid_of_its_values_and_refuses_unknown_keys_by_name():
    grid = parse_sweep(["goal_count=6,8", "fleet.devices=20,30,40"])
    assert grid == {"task.goal_count": [6, 8], "fleet.devices": [20, 30, 40]}
    runs = sweep_configs(tiny_config(), seeds=[1, 2], grid=grid)
    assert len(runs) == 2 * 2 * 3
    assert {(c.fleet.seed, c.task.goal_count, c.fleet.devices) for _, c in runs} == {
        (s, g, d) for s in (1, 2) for g in (6, 8) for d in (20, 30, 40)
    }
    assert all(p["fleet.seed"] == c.fleet.seed and p["task.goal_count"] == c.task.goal_count for p, c in runs)
    with pytest.raises(FleetConfigError, match="goal_cont"):
        sweep_configs(tiny_config(), grid=parse_sweep(["goal_cont=6"]))
    with pytest.raises(FleetConfigError, match="KEY=V1,V2"):
        parse_sweep(["goal_count"])
    with pytest.raises(FleetConfigError, match="goal_count"):
        sweep_configs(tiny_config(), grid=parse_sweep(["goal_count=-3"]))


def test_a_sweep_value_is_read_as_json_so_a_list_of_several_sizes_is_one_value():
    """`--sweep hidden=[64,32]` was split at every comma, into the texts "[64" and "32]"."""
    grid = parse_sweep(["hidden=[64,32],[128]", "lr=0.1, 0.2", "optimizer=adam,sgd", 'x={"a":1,"b":2},3'])
    assert grid == {
        "task.hidden": [[64, 32], [128]],
        "task.lr": [0.1, 0.2],
        "task.optimizer": ["adam", "sgd"],
        "task.x": [{"a": 1, "b": 2}, 3],
    }
    with pytest.raises(FleetConfigError, match="a value is empty"):
        parse_sweep(["goal_count=6,"])


def test_a_sweep_into_a_folder_of_an_earlier_sweeps_other_runs_is_refused_before_it_runs(tmp_path, capsys):
    """--seeds 0 into the folder of an earlier --seeds 0,1 left run-1-seed=1 there, which
    `fedfleet compare OUT` then set beside the new run-0 as if one sweep had made both."""
    out = tmp_path / "sweep"
    (out / "run-1-seed=1").mkdir(parents=True)
    (out / "run-1-seed=1" / "summary.json").write_text("{}")
    argv = ["simulate", "--devices", "20", "--hours", "0.1", "--goal", "8", "--seeds", "0", "--out", str(out)]
    assert main([*argv, "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        f"fedfleet simulate: --out {out} holds runs this sweep does not make (run-1-seed=1), which fedfleet compare "
        f"{out} would set beside its own; name a new folder, or remove them\n"
    )
    assert sorted(p.name for p in out.iterdir()) == ["run-1-seed=1"]


def test_a_sweep_runs_each_combination_once_and_names_a_bad_value_as_it_was_typed():
    """goal_count=10,10 ran the same fleet twice; a key in two --sweep options (or fleet.seed beside
    --seeds) kept the later values and dropped the others' runs unsaid; a refused value was named
    as a Python dict, "--sweep {'task.goal_count': 'a'} is invalid"."""
    with pytest.raises(
        FleetConfigError, match=r"^--sweep 'goal_count=10,10': 10 is given twice; name each value once$"
    ):
        parse_sweep(["goal_count=10,10"])
    with pytest.raises(FleetConfigError, match=r"task\.goal_count is swept twice; give its values in one --sweep"):
        parse_sweep(["goal_count=8", "task.goal_count=16"])
    with pytest.raises(FleetConfigError, match=r"--sweep fleet\.seed and --seeds both give the seeds"):
        sweep_configs(tiny_config(), seeds=[1, 2], grid=parse_sweep(["fleet.seed=3"]))
    with pytest.raises(FleetConfigError) as info:
        sweep_configs(tiny_config(), grid=parse_sweep(["goal_count=a"]))
    assert str(info.value).startswith('--sweep task.goal_count="a" is invalid: task.goal_count must be a whole number')
    assert [c.task.hidden for _, c in sweep_configs(tiny_config(), grid=parse_sweep(["hidden=[32],[64]"]))] == [
        [32],
        [64],
    ]
    with pytest.raises(FleetConfigError, match=r"\[32\] is given twice"):
        parse_sweep(["hidden=[32],[32]"])


def test_simulate_with_shards_prints_the_digest_of_the_single_process_run(tmp_path, capsys):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        "[fleet]\ndevices = 30\nhours = 0.5\nstart_utc_hour = 6.0\n\n[task]\ngoal_count = 6\n", encoding="utf-8"
    )
    assert main(["simulate", str(fleet), "--seed", "2", "--no-progress"]) == 0
    alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["simulate", str(fleet), "--seed", "2", "--shards", "2", "--no-progress"]) == 0
    sharded = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sharded["digest"] == alone["digest"]
    assert main(["simulate", str(fleet), "--shards", "2", "--http", "--no-progress"]) == 2
    assert "--http" in capsys.readouterr().err


def test_simulate_with_seeds_prints_one_line_per_run_then_their_digests(tmp_path, capsys):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        "[fleet]\ndevices = 20\nhours = 0.25\nstart_utc_hour = 6.0\n\n[task]\ngoal_count = 6\n", encoding="utf-8"
    )
    assert main(["simulate", str(fleet), "--seeds", "1,2", "--sweep", "goal_count=6,8", "--no-progress"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert len(lines) == 5
    *runs, last = lines
    assert (
        [r["params"] for r in runs]
        == last["params"]
        == [{"fleet.seed": s, "task.goal_count": g} for s in (1, 2) for g in (6, 8)]
    )
    assert [r["digest"] for r in runs] == last["digests"]
    assert last["digests"][0] != last["digests"][2]  # another seed, another run
    assert main(["simulate", str(fleet), "--sweep", "goal_count=40", "--no-progress"]) == 0
    err = capsys.readouterr().err  # a run of the sweep that cannot fill a round says so, naming the run
    assert "fedfleet simulate: task.goal_count=40: " in err and "no round can fill" in err
    for seeds in ("one,two", "", "-1", "1,1"):  # not numbers, none (not a single run), below 0, one twice
        assert main(["simulate", str(fleet), "--seeds", seeds, "--no-progress"]) == 2
        assert f"--seeds {seeds!r}: write whole numbers from 0" in capsys.readouterr().err
    assert main(["simulate", str(fleet), "--sweep", "nosuch=1", "--no-progress"]) == 2
    assert "nosuch" in capsys.readouterr().err


def test_a_sweep_run_the_server_refuses_is_named_and_leaves_no_folder(tmp_path, capsys):
    """The refusal said which run of the sweep it was (only the server's sentence), and left the
    refused run's half-made folder beside the finished ones, whose lines were never printed."""
    fleet = tmp_path / "fleet.toml"
    fleet.write_text("[fleet]\ndevices = 20\nhours = 0.1\nstart_utc_hour = 6.0\n", encoding="utf-8")
    out = tmp_path / "sweep"
    assert main(["simulate", str(fleet), "--sweep", "goal_count=8,4", "--out", str(out), "--no-progress"]) == 2
    captured = capsys.readouterr()
    (line,) = [json.loads(x) for x in captured.out.strip().splitlines()]
    assert line["params"] == {"task.goal_count": 8}
    assert "fedfleet simulate: task.goal_count=4: task 'fleet_mlp': a round of task.goal_count 4" in captured.err
    # each run's folder is named by its parameters, the label fedfleet compare gives it
    assert [p.name for p in out.iterdir()] == ["run-0-goal_count=8"]
    assert (out / "run-0-goal_count=8" / "summary.json").is_file()


# ------------------------------------------------------------------ on a real local Ray cluster
@pytest.fixture(scope="module")
def cluster():
    """A cluster of this test process's own: ``address="local"`` never joins a cluster that another
    run on the machine (another pytest worker, ``ray start``) left in /tmp/ray, where
    ``num_cpus`` would be refused. Its tests share one xdist worker (``xdist_group``), so a run
    starts one cluster."""
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]'")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


on_the_cluster = pytest.mark.xdist_group("ray")


@needs_ray
@on_the_cluster
def test_the_sharded_run_on_two_ray_workers_equals_the_single_process_run(cluster):
    """A lighter twin of the slow test below: a fleet of 30 for half an hour."""
    config = tiny_config(seed=1)
    stats: dict = {}
    run = simulate_sharded(config, shards=2, ray=True, stats=stats)
    alone = simulate(config, progress=False)
    same_run(run, alone)
    assert stats["windows"] > 1 and sum(r.committed for r in alone.rounds) >= 1


@pytest.mark.slow
@needs_ray
@on_the_cluster
def test_the_sharded_run_of_a_larger_fleet_on_two_ray_workers_equals_the_single_process_run(cluster, one_process):
    stats: dict = {}
    run = simulate_sharded(small_config(seed=1), shards=2, ray=True, stats=stats)
    same_run(run, one_process)
    assert stats["windows"] > 1


# slow: the Ray tasks' worker processes each import the simulator again; the lighter twins are the
# runs fanned out here (test_simulate_with_seeds_prints_one_line_per_run_then_their_digests) and the
# sharded run on this cluster above
@pytest.mark.slow
@needs_ray
@on_the_cluster
def test_runs_fanned_out_as_ray_tasks_equal_the_same_runs_here(cluster, tmp_path, capsys):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        "[fleet]\ndevices = 20\nhours = 0.25\nstart_utc_hour = 6.0\n\n[task]\ngoal_count = 6\n", encoding="utf-8"
    )
    configs = [FleetConfig.load(fleet).replace(seed=s) for s in (1, 2)]
    here = run_many(configs, ray=False)
    assert here[0]["digest"] != here[1]["digest"]
    # `--seeds ... --ray` is run_many(..., ray=True): the command's runs are the Ray tasks' runs
    assert main(["simulate", str(fleet), "--seeds", "1,2", "--ray", "--no-progress"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["backend"] == "ray" and last["digests"] == [s["digest"] for s in here]


def test_a_sharded_fleet_is_told_before_its_run_what_a_single_process_one_is(capsys):
    """--shards/--ray ran a fleet that could not fill a round (or whose sessions outlast the report
    window) without the line a single-process run prints before it starts."""
    config = FleetConfig.default().replace(devices=40, hours=0.25, goal=20)
    alone: list[str] = []
    simulate(config, progress=False, notice=alone.append)
    sharded: list[str] = []
    run = simulate_sharded(config, shards=2, ray=False, notice=sharded.append)
    assert sharded == alone and len(alone) == 1 and alone[0].startswith("no round can fill")
    assert run.summary()["cannot_fill"] == alone[0]
    assert (
        main(["simulate", "--devices", "40", "--hours", "0.25", "--goal", "20", "--shards", "2", "--no-progress"]) == 0
    )
    err = capsys.readouterr().err
    assert err.startswith("fedfleet simulate: no round can fill") and err.count("no round can fill") == 2


# slow: a Ray cluster of its own, started in a fresh process (ray.init's handlers are the process's)
@pytest.mark.slow
@needs_ray
def test_starting_ray_keeps_the_callers_sigterm_handler():
    """ray.init puts its core's crash handler in place of SIGTERM's: `fedfleet simulate --ray`
    stopped by SIGTERM dumped a native stack and exited 15, where a run in one process exits 143
    with one line."""
    import subprocess
    import sys

    code = (
        "import signal\n"
        "def mine(signum, frame): pass\n"
        "signal.signal(signal.SIGTERM, mine)\n"
        "from emulator.fleet.ray_backend import ensure_ray\n"
        "ray = ensure_ray('local', num_cpus=1, configure_logging=False)\n"
        "print(signal.getsignal(signal.SIGTERM) is mine)\n"
        "ray.shutdown()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True"
