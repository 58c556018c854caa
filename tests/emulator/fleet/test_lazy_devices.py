"""Idle devices are cheap: a device's SDK (example store, runtime, scheduler) and its fiber are
built when its participation job first wakes, from its seed, and released when a job run ends
until the next one (only what the SDK carries between runs is kept); the run is the same, bit
for bit, as the run whose devices are all built at the start and kept built."""

from __future__ import annotations

import dataclasses
import gc
import tracemalloc
import weakref

import pytest

from device_runtime.eligibility import EligibilityPolicies
from emulator.fleet import FleetConfig, FleetRun, device_examples, fleet_dataset, generate_population
from emulator.fleet.simulator import FleetSimulator
from server_stub.service import TaskSpec
from tests.emulator.fleet.test_simulator import small_config

#: What one device that takes part may hold once the fleet has started and before it first wakes:
#: its spec (about 1.3 kB, most of it its availability's arrays) and its place on the loop (about
#: 0.7 kB). Built at the start, with its SDK, it held about 11 kB.
IDLE_DEVICE_BYTES = 3_000


def _run(config: FleetConfig, tmp_path, name: str) -> tuple[FleetRun, FleetSimulator]:
    specs = generate_population(config)
    data = fleet_dataset(config)
    sim = FleetSimulator(
        config, specs, lambda spec: device_examples(config, spec), (data.x_test, data.y_test), workdir=tmp_path / name
    )
    return sim.run(), sim


def _same_run(a: FleetRun, b: FleetRun) -> None:
    assert a.digest == b.digest
    assert [(r.round_id, r.committed, r.selected, r.accepted, r.dropped) for r in a.rounds] == [
        (r.round_id, r.committed, r.selected, r.accepted, r.dropped) for r in b.rounds
    ]
    assert a.sessions == b.sessions
    assert a.timeline == b.timeline


def _faulty(seed: int, **task: object) -> FleetConfig:
    data = small_config(seed=seed, **task).model_dump()
    data["faults"].update(app_killed_per_h=3.0, conditions_change_per_h=3.0, network_lost_per_h=2.0)
    return FleetConfig.from_dict(data)


def test_devices_built_when_they_first_wake_and_released_after_each_job_give_the_run_of_devices_kept_built(
    tmp_path, monkeypatch
):
    """With faults striking mid-session (apps killed, conditions breaking, the network lost), a
    fleet whose devices are built on their first wake-up and released after every job run gives
    the digest, rounds, sessions and timeline of the fleet built whole at the start and kept
    built; some of its devices were never built, and most that woke are released at the end."""
    from emulator.fleet import sim_device

    config = _faulty(5)
    lazy, lazy_sim = _run(config, tmp_path, "lazy")
    monkeypatch.setattr(sim_device, "MATERIALIZE_LAZILY", False)
    monkeypatch.setattr(sim_device, "RELEASE_AFTER_JOBS", False)
    eager, eager_sim = _run(config, tmp_path, "eager")
    _same_run(lazy, eager)
    assert any(r.committed for r in lazy.rounds)
    assert all(d.materialized for d in eager_sim.devices)
    woken = sum(d.woken for d in lazy_sim.devices)
    assert 0 < woken < len(lazy_sim.devices)  # devices whose conditions never held in the run were never built
    assert sum(d.materialized for d in lazy_sim.devices) < woken / 2  # the rest are released between job runs


def test_releasing_devices_between_job_runs_changes_nothing_for_a_task_with_eligibility_and_rounds_that_repeat(
    tmp_path, monkeypatch
):
    """Released or kept, with devices that take part again and again (short retry windows) in a
    task whose eligibility reads the device's store and its last participations: their random
    streams, scheduled jobs, opstats and downloaded plans carry over."""
    from emulator.fleet import sim_device, simulator

    eligibility = EligibilityPolicies(min_examples=5, min_separation_rounds=2)
    monkeypatch.setattr(simulator, "TaskSpec", _deployed_with(eligibility))
    config = _faulty(7, retry_min_s=30.0, retry_max_s=120.0)
    released, _ = _run(config, tmp_path, "released")
    monkeypatch.setattr(sim_device, "RELEASE_AFTER_JOBS", False)
    kept, kept_sim = _run(config, tmp_path, "kept")
    _same_run(released, kept)
    completed = [r.device_id for r in kept.sessions if r.outcome == "completed"]
    assert len(completed) > len(set(completed))  # some devices completed more than one session


@pytest.mark.parametrize("size", [500, *(pytest.param(n, marks=pytest.mark.slow) for n in (2_000, 20_000))])
def test_an_idle_device_of_a_large_fleet_costs_a_few_kilobytes(tmp_path, size):
    """Measured with tracemalloc over building the population and starting the fleet (before any
    event runs): per device that takes part, its spec and its idle state stay under
    ``IDLE_DEVICE_BYTES``. The cost per device does not depend on the fleet's size (500, 2,000 and
    20,000 devices measure about 2.1 kB each), so the default run takes the smallest fleet."""
    config = FleetConfig.default().replace(devices=size, hours=24.0)
    sim = None
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        specs = generate_population(config)
        specs_bytes = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        sim = FleetSimulator(config, specs, workdir=tmp_path)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        sim.start_devices()
        gc.collect()
        started_bytes = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        if sim is not None:
            sim.fibers.close()
            sim.close()
    started = len(sim.devices)
    assert started > 0.75 * size
    per_device = (specs_bytes + started_bytes) / started
    assert per_device < IDLE_DEVICE_BYTES, f"{per_device:.0f} B per idle device (spec {specs_bytes / started:.0f} B)"
    assert not any(d.materialized for d in sim.devices)


def test_a_released_devices_sdk_is_freed_at_once_without_the_collector(tmp_path, monkeypatch):
    """A run defers full collections (``heap``), so an SDK dropped with a reference cycle in it
    would stay in memory until the run ends: each released device's runtime and scheduler are
    freed by their reference counts alone (a few that died in an exception, whose traceback
    holds their frames, wait for the collector)."""
    from emulator.fleet import sim_device

    dropped: list[weakref.ref] = []
    release = sim_device.SimDevice._release

    def watched(device: sim_device.SimDevice, until: float) -> None:
        dropped.extend((weakref.ref(device.runtime), weakref.ref(device.scheduler), weakref.ref(device.store)))
        release(device, until)

    monkeypatch.setattr(sim_device.SimDevice, "_release", watched)
    config = FleetConfig.default().replace(devices=300, hours=3.0, seed=3)
    enabled = gc.isenabled()
    gc.disable()
    try:
        _run(config, tmp_path, "freed")
        alive = sum(ref() is not None for ref in dropped)
    finally:
        if enabled:
            gc.enable()
    assert len(dropped) > 300
    assert alive < 0.05 * len(dropped), f"{alive} of {len(dropped)} dropped SDK objects are still alive"


def test_a_fleet_is_told_its_memory_before_the_run_and_refused_past_the_machines():
    from emulator.fleet.simulator import fleet_memory_line

    assert fleet_memory_line(10_000, 16 * 10**9) is None  # a fleet of the default size: nothing to say
    assert fleet_memory_line(1_000_000, 16 * 10**9) == (
        "1,000,000 devices take about 2.79 GB of memory and minutes to set up before the run starts (about 2.6 kB "
        "a device, and 2.8 kB more for each that has taken part)"
    )
    assert fleet_memory_line(10_000_000, 16 * 10**9) == (
        "a fleet of 10,000,000 devices needs about 26.2 GB of memory before its first round (about 2.6 kB a device), "
        "more than this machine's 16 GB; simulate at most about 6,081,000 --devices here"
    )
    assert fleet_memory_line(10_000_000, None).startswith("10,000,000 devices take about 26.2 GB")  # memory unknown


def _deployed_with(eligibility: EligibilityPolicies):
    """The simulator's ``TaskSpec``, every task it deploys given ``eligibility`` (whatever the
    workload's own tasks say: the simulator passes theirs)."""

    def spec(*args, **kwargs) -> TaskSpec:
        return dataclasses.replace(TaskSpec(*args, **kwargs), eligibility=eligibility)

    return spec
