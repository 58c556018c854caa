"""A fleet on its real onnxruntime releases (``[fleet] real_runtimes = true``): the plan is versioned
and release-tested for every release of the fleet, deployed through the server's release gate,
and each device trains the plan served for its minor release in that release's worker process.

A small fleet (as in ``test_simulator``) with half its devices on onnxruntime 1.17.3 and half on
1.31.1, both cached under ``~/.cache/fedfleet/runtimes`` (a cold cache installs them first)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from emulator.fleet import FleetConfig, FleetConfigError, FleetRun, device_examples, fleet_dataset, generate_population
from emulator.fleet.events import SimulationError
from emulator.fleet.simulator import FleetSimulator
from emulator.releases.workers import ReleasePlans
from emulator.toolchain.versioning import plan_sha256, versioned_plan

#: The module's fleets are built once per run: its tests go to one pytest-xdist worker, and its fixtures
#: are session-scoped, so that no test run between two of them makes the worker build them again.
pytestmark = pytest.mark.xdist_group("test_real_runtimes")

OLD, NEW = "1.17.3", "1.31.1"
SMALL = {"devices": 80, "hours": 2.0, "start_utc_hour": 6.0}


def real_config(seed: int = 1, releases: tuple[tuple[str, float], ...] = ((OLD, 0.5), (NEW, 0.5))) -> FleetConfig:
    data = FleetConfig.default().model_dump()
    data["fleet"].update(SMALL, seed=seed, real_runtimes=True)
    data["task"].update({"goal_count": 8, "retry_min_s": 60.0, "retry_max_s": 300.0, "selection_timeout_s": 300.0})
    data["runtime_versions"] = [{"version": v, "share": s} for v, s in releases]
    return FleetConfig.from_dict(data)


def _simulator(config: FleetConfig, workdir) -> FleetSimulator:
    data = fleet_dataset(config)
    return FleetSimulator(
        config,
        generate_population(config),
        lambda spec: device_examples(config, spec),
        (data.x_test, data.y_test),
        workdir=workdir,
    )


@pytest.fixture(scope="session")
def fleet(tmp_path_factory) -> tuple[FleetSimulator, FleetRun]:
    sim = _simulator(real_config(), tmp_path_factory.mktemp("real-runtimes"))
    return sim, sim.run()


def _served(sim: FleetSimulator) -> dict[str, set[str]]:
    assert isinstance(sim.loaded_plans, ReleasePlans)
    served: dict[str, set[str]] = {}
    for (plan_id, version), executor in sim.loaded_plans.executors().items():
        assert executor.worker.reported_version == version  # trained on that very release
        served.setdefault(version, set()).add(plan_id)
    return served


@pytest.mark.timeout(1800)  # a cold cache installs both releases first
def test_devices_of_both_releases_report_in_committed_rounds(fleet):
    _sim, run = fleet
    committed = {r.round_id.rsplit("/", 1)[0] for r in run.rounds if r.committed}
    assert len(committed) >= 2
    uploads = [s for s in run.sessions if s.shape.endswith("^") and s.round_id in committed]
    by_release = Counter(s.runtime_version for s in uploads)
    assert set(by_release) == {OLD, NEW}
    assert min(by_release.values()) >= 3
    specs = {s.device_id: s for s in generate_population(run.config)}
    assert all(s.runtime_version == specs[s.device_id].runtime_version for s in run.sessions)
    assert [r for r in run.rounds if r.committed][-1].accuracy > 0.5  # the releases' updates add up to a model


@pytest.mark.timeout(1800)
def test_each_releases_devices_are_served_and_train_their_own_versioned_plan(fleet):
    sim, _run = fleet
    want = {v: plan_sha256(versioned_plan(sim.plan, v)) for v in (OLD, NEW)}  # derived here, independently
    assert want[OLD] != want[NEW]
    assert _served(sim) == {v: {plan_id} for v, plan_id in want.items()}
    task = sim.store.tasks(sim.population)[0]
    assert task.config["versions"] == {"1.17": want[OLD], "1.31": want[NEW]}
    assert task.config["release"]["claimed"] == [OLD, NEW]
    report = sim.released.report
    assert report["passed"] and {r: e["plan_sha256"] for r, e in report["results"].items()} == want


@pytest.mark.timeout(1800)
def test_the_same_seed_gives_the_same_digest_on_real_releases(fleet, tmp_path):
    _sim, run = fleet
    again = _simulator(real_config(), tmp_path).run()
    assert again.digest == run.digest
    strip = lambda r: [dataclasses.replace(s, session_id="") for s in r.sessions]  # noqa: E731 - server ids are secrets
    assert strip(again) == strip(run)


@pytest.mark.timeout(1800)
def test_a_sharded_run_on_real_releases_equals_the_single_process_run_and_tests_the_releases_once(fleet, monkeypatch):
    from emulator.fleet import simulator
    from emulator.fleet.ray_backend import simulate_sharded

    tested = []
    real = simulator.release_tested_plans
    monkeypatch.setattr(simulator, "release_tested_plans", lambda *a, **k: tested.append(a[3]) or real(*a, **k))
    _sim, run = fleet
    assert simulate_sharded(real_config(), shards=2, ray=False).digest == run.digest
    assert len(tested) == 1  # by the driver, which serves the plans; the shards' devices only train


def test_two_patches_of_one_minor_release_are_refused_with_real_runtimes():
    with pytest.raises(FleetConfigError, match="one patch per minor release"):
        real_config(releases=(("1.31.1", 0.5), ("1.31.0", 0.5)))
    data = real_config().model_dump()
    data["fleet"]["real_runtimes"] = False
    data["runtime_versions"] = [{"version": "1.31.1", "share": 0.5}, {"version": "1.31.0", "share": 0.5}]
    FleetConfig.from_dict(data)  # without real runtimes every device trains the one plan: allowed


def test_a_release_no_plan_can_be_written_for_stops_the_run_before_it_starts(tmp_path):
    config = real_config(releases=(("1.14.0", 0.5), (NEW, 0.5)))
    with pytest.raises(SimulationError, match=r"no plan for onnxruntime 1\.14\.0.*remove it from runtime_versions"):
        _simulator(config, tmp_path)
    assert not list(tmp_path.glob("server.db*"))  # refused before a server was made
