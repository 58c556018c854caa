"""The availability model: exact change times, the paper's diurnal swing, and a sane battery."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime.conditions import BATTERY_LOW_FRACTION, TrainingConstraints
from emulator.fleet import AVAILABLE, FleetConfig, count_available, generate_population

DAY_S = 86_400.0
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def devices():
    return generate_population(FleetConfig.default().replace(devices=400, hours=36.0, seed=2))


def _observable(state):
    # What a training constraint can see: the three flags and whether the battery is low.
    return (state.idle, state.charging, state.unmetered_network, state.battery_level < BATTERY_LOW_FRACTION)


@settings(max_examples=300, deadline=None)
@given(index=st.integers(0, 399), t=st.floats(-3600.0, 40 * 3600.0), frac=st.floats(0.0, 1.0))
def test_next_change_agrees_with_state_at(devices, index, t, frac):
    availability = devices[index].availability
    state = _observable(availability.state_at(t))
    change = availability.next_change(t)
    if change is None:
        for later in (t + 1.0, t + DAY_S, t + 10 * DAY_S):
            assert _observable(availability.state_at(later)) == state
        return
    assert change > t
    # Nothing changes before the announced time...
    inside = t + frac * (change - t)
    for probe in (inside, math.nextafter(change, -math.inf)):
        if t <= probe < change:
            assert _observable(availability.state_at(probe)) == state
    # ... and something does at it.
    assert _observable(availability.state_at(change)) != state


def test_change_times_are_sorted_start_at_zero_and_each_changes_something(devices):
    for spec in devices:
        a = spec.availability
        times = np.asarray(a.times)
        assert times[0] == 0.0 and np.all(np.diff(times) > 0)
        assert all(a.flags[i] != a.flags[i - 1] for i in range(1, len(times)))
        # Past the horizon only the battery may still cross its threshold.
        assert all(
            a.flags[i] & AVAILABLE == a.flags[i - 1] & AVAILABLE
            for i in range(1, len(times))
            if times[i] >= 36 * 3600.0
        )


def test_the_battery_stays_in_range_and_charges_while_charging(devices):
    for spec in devices[:100]:
        a = spec.availability
        for t in np.linspace(0, 36 * 3600.0, 200):
            state = a.state_at(t)
            assert 0.0 < state.battery_level <= 1.0
            if state.charging and state.battery_level < 1.0:
                assert a.state_at(t + 60.0).battery_level >= state.battery_level or a.next_change(t) <= t + 60.0


def test_available_means_the_sdk_constraints_hold(devices):
    constraints = TrainingConstraints()
    for spec in devices[:50]:
        a = spec.availability
        for t in np.linspace(0, 36 * 3600.0, 100):
            assert a.available_at(t) == constraints.satisfied(a.state_at(t)) == (a.flags_at(t) & AVAILABLE == AVAILABLE)


def test_count_available_equals_asking_each_device(devices):
    times = np.linspace(0, 36 * 3600.0, 37)
    counted = count_available([d.availability for d in devices], times)
    brute = [sum(d.availability.available_at(t) for d in devices) for t in times]
    assert counted.tolist() == brute


def test_available_devices_swing_three_to_five_times_over_a_day():
    # Paper sec. 9: a 4x difference between low and high over 24 hours (US-centric population).
    config = FleetConfig.default().replace(devices=5000, seed=4)
    devices = [d for d in generate_population(config) if d.takes_part]
    counts = count_available([d.availability for d in devices], np.arange(0.0, DAY_S, 300.0))
    swing = counts.max() / counts.min()
    assert 3.0 <= swing <= 5.0, swing
    assert counts.max() < len(devices)  # never everyone at once


def test_devices_are_available_at_night_in_their_own_time_zone():
    data = FleetConfig.default().model_dump()
    data["availability"]["time_zones"] = [{"utc_offset_h": 9.0, "share": 1.0}]
    config = FleetConfig.from_dict(data).replace(devices=2000)
    devices = generate_population(config)
    local = (np.arange(0.0, DAY_S, 600.0) / 3600.0 + 9.0) % 24.0
    counts = count_available([d.availability for d in devices], np.arange(0.0, DAY_S, 600.0))
    night = counts[(local >= 1) & (local < 5)].mean()
    afternoon = counts[(local >= 12) & (local < 17)].mean()
    assert night > 3 * afternoon > 0


def test_screen_on_interruptions_break_the_night():
    data = FleetConfig.default().model_dump()
    data["availability"]["screen_on"]["per_hour"] = 0.0
    quiet = FleetConfig.from_dict(data).replace(devices=300)
    busy = FleetConfig.default().replace(devices=300)
    spans = lambda config: sum(len(d.availability.intervals()[0]) for d in generate_population(config))  # noqa: E731
    assert spans(busy) > 1.3 * spans(quiet)


def test_a_worldwide_fleet_swings_less_than_a_single_region():
    config = FleetConfig.load(ROOT / "examples" / "fleets" / "global.toml").replace(devices=5000)
    assert config.availability.night == FleetConfig.default().availability.night
    devices = [d for d in generate_population(config) if d.takes_part]
    counts = count_available([d.availability for d in devices], np.arange(0.0, DAY_S, 300.0))
    assert 1.2 <= counts.max() / counts.min() <= 2.5
