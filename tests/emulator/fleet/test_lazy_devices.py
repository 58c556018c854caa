"""Idle devices are cheap: a device's SDK (example store, runtime, scheduler) and its fiber are
built when its participation job first wakes, from its seed, and the run is the same, bit for
bit, as the run whose devices are all built at the start."""

from __future__ import annotations

import gc
import tracemalloc

from emulator.fleet import FleetConfig, FleetRun, device_examples, fleet_dataset, generate_population
from emulator.fleet.simulator import FleetSimulator
from tests.emulator.fleet.test_simulator import small_config

#: What one device that takes part may hold once the fleet has started and before it first wakes:
#: its spec (about 1.3 kB, most of it its availability's arrays) and its place on the loop (about
#: 0.7 kB). Built at the start, with its SDK, it held about 11 kB.
IDLE_DEVICE_BYTES = 3_000


def _run(config: FleetConfig, tmp_path, name: str) -> tuple[FleetRun, FleetSimulator]:
    specs = generate_population(config)
    data = fleet_dataset(config)
    sim = FleetSimulator(config, specs, lambda spec: device_examples(config, spec), (data.x_test, data.y_test),
                         workdir=tmp_path / name)
    return sim.run(), sim


def test_devices_built_when_they_first_wake_give_the_run_of_devices_built_at_the_start(tmp_path, monkeypatch):
    """With faults striking mid-session (apps killed, conditions breaking, the network lost), a
    fleet whose devices are built on their first wake-up gives the digest, rounds, sessions and
    timeline of the fleet built whole at the start; and some of its devices were never built."""
    from emulator.fleet import sim_device

    data = small_config(seed=5).model_dump()
    data["faults"].update(app_killed_per_h=3.0, conditions_change_per_h=3.0, network_lost_per_h=2.0)
    config = FleetConfig.from_dict(data)
    lazy, lazy_sim = _run(config, tmp_path, "lazy")
    monkeypatch.setattr(sim_device, "MATERIALIZE_LAZILY", False)
    eager, eager_sim = _run(config, tmp_path, "eager")
    assert lazy.digest == eager.digest
    assert [(r.round_id, r.committed, r.selected, r.accepted, r.dropped) for r in lazy.rounds] == [
        (r.round_id, r.committed, r.selected, r.accepted, r.dropped) for r in eager.rounds]
    assert lazy.sessions == eager.sessions
    assert lazy.timeline == eager.timeline
    assert any(r.committed for r in lazy.rounds)
    assert all(d.materialized for d in eager_sim.devices)
    built = sum(d.materialized for d in lazy_sim.devices)
    assert 0 < built < len(lazy_sim.devices)  # devices whose conditions never held in the run were never built


def test_an_idle_device_of_a_20k_fleet_costs_a_few_kilobytes(tmp_path):
    """Measured with tracemalloc over building the population and starting the fleet (before any
    event runs): per device that takes part, its spec and its idle state stay under
    ``IDLE_DEVICE_BYTES``."""
    config = FleetConfig.default().replace(devices=20_000, hours=24.0)
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
    assert started > 15_000
    per_device = (specs_bytes + started_bytes) / started
    assert per_device < IDLE_DEVICE_BYTES, f"{per_device:.0f} B per idle device (spec {specs_bytes / started:.0f} B)"
    assert not any(d.materialized for d in sim.devices)
