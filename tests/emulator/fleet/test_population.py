"""The population: deterministic per-device streams, and shares that match the config."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from emulator.fleet import FleetConfig, generate_population


@pytest.fixture(scope="module")
def fleet():
    config = FleetConfig.default().replace(devices=10_000, seed=11)
    return config, generate_population(config)


def _fingerprint(spec):
    a = spec.availability
    return (
        spec.device_class,
        spec.runtime_version,
        spec.utc_offset_h,
        spec.network,
        spec.faults,
        tuple(a.times),
        a.flags,
    )


def test_the_same_seed_gives_the_same_population_and_another_seed_a_different_one():
    config = FleetConfig.default().replace(devices=300, seed=5)
    first, second = generate_population(config), generate_population(config)
    assert first == second
    assert [s.seed for s in first] == [s.seed for s in second]
    other = generate_population(config.replace(seed=6))
    differing = sum(_fingerprint(a) != _fingerprint(b) for a, b in zip(first, other))
    assert differing == len(first)  # every device's availability differs at least


def test_a_device_does_not_depend_on_the_fleet_size_or_on_which_devices_are_built():
    config = FleetConfig.default().replace(devices=200, seed=3)
    whole = generate_population(config)
    shard = generate_population(config, indices=range(150, 200))
    assert shard == whole[150:]
    assert generate_population(config.replace(devices=400))[:200] == whole
    assert len({s.device_id for s in whole}) == 200 and whole[42].device_id == "d000042"
    with pytest.raises(IndexError):
        generate_population(config, indices=[200])


def _assert_shares(observed: Counter, expected: dict, n: int) -> None:
    assert set(observed) <= set(expected)
    for key, p in expected.items():
        sd = math.sqrt(n * p * (1 - p))
        assert abs(observed[key] - n * p) <= 4.5 * sd + 1, (key, observed[key], n * p)


def test_classes_versions_networks_and_time_zones_match_their_shares(fleet):
    config, devices = fleet
    n = len(devices)
    _assert_shares(Counter(s.device_class for s in devices), {c.name: c.share for c in config.device_classes}, n)
    _assert_shares(
        Counter(s.runtime_version for s in devices), {v.version: v.share for v in config.runtime_versions}, n
    )
    _assert_shares(Counter(s.network.name for s in devices), {c.name: c.share for c in config.network_classes}, n)
    _assert_shares(
        Counter(s.utc_offset_h for s in devices), {z.utc_offset_h: z.share for z in config.availability.time_zones}, n
    )


def test_only_devices_with_enough_memory_take_part_and_their_class_sets_speed(fleet):
    config, devices = fleet
    classes = {c.name: c for c in config.device_classes}
    for spec in devices:
        cls = classes[spec.device_class]
        assert (spec.speed, spec.memory_mb) == (cls.speed, cls.memory_mb)
        assert spec.takes_part == (spec.memory_mb >= 2048)
    assert 0 < sum(not s.takes_part for s in devices) < len(devices)


def test_network_bandwidths_scatter_around_their_class(fleet):
    config, devices = fleet
    for cls in config.network_classes:
        downs = [s.network.down_bps for s in devices if s.network.name == cls.name]
        median = sorted(downs)[len(downs) // 2]
        assert median == pytest.approx(cls.down_mbps * 1e6, rel=0.05)
        assert all(s.network.latency_s == cls.latency_ms / 1000 for s in devices if s.network.name == cls.name)
    spec = devices[0]
    assert spec.network.download_s(1_000_000) == pytest.approx(2 * spec.network.latency_s + 8e6 / spec.network.down_bps)


def test_device_fault_rates_average_to_the_configured_hazards(fleet):
    config, devices = fleet
    mean_app_killed = sum(s.faults.app_killed_per_h for s in devices) / len(devices)
    assert mean_app_killed == pytest.approx(config.faults.app_killed_per_h, rel=0.03)
    assert len({s.faults.app_killed_per_h for s in devices}) > len(devices) // 2  # phones differ


def test_first_fault_strikes_at_the_hazard_rate_and_picks_kinds_by_their_share(fleet):
    spec = fleet[1][0]
    faults = spec.faults
    rng = random.Random(1)
    session_s = 1800.0
    draws = [faults.first_fault(rng, session_s) for _ in range(20_000)]
    struck = [d for d in draws if d is not None]
    p = 1 - faults.survival(session_s)
    assert abs(len(struck) - p * len(draws)) <= 4.5 * math.sqrt(len(draws) * p * (1 - p))
    assert all(0 <= after < session_s for _, after in struck)
    share = faults.app_killed_per_h / faults.total_per_h
    killed = sum(kind == "app_killed" for kind, _ in struck)
    assert abs(killed - share * len(struck)) <= 4.5 * math.sqrt(len(struck) * share * (1 - share))
    late = [faults.late_delay(rng) for _ in range(20_000)]
    q = faults.late_report_prob
    assert abs(sum(d > 0 for d in late) - q * len(late)) <= 4.5 * math.sqrt(len(late) * q * (1 - q))


def test_local_hour_follows_the_time_zone():
    config = FleetConfig.default().replace(devices=20)
    for spec in generate_population(config):
        assert spec.local_hour(0.0) == pytest.approx((config.fleet.start_utc_hour + spec.utc_offset_h) % 24)
        assert spec.local_hour(3 * 3600.0) == pytest.approx((spec.local_hour(0.0) + 3) % 24)


@pytest.mark.parametrize(
    "section, limits",
    [
        ("night", dict.fromkeys(("start_device_sd_h", "start_daily_sd_h", "duration_sd_h", "wifi_before_h"), 24.0)),
        ("day", {"sessions_per_day": 1440.0}),
        ("day", {"mean_duration_h": 24.0}),
        ("screen_on", {"per_hour": 60.0}),
    ],
)
def test_a_population_at_the_availability_models_limits_is_drawn(section, limits):
    """A spread or rate at its bound: a device's windows are drawn over the days they reach (a
    bedtime spread of 1e9 hours drew windows for minutes)."""
    config = FleetConfig.from_dict({"fleet": {"devices": 3, "hours": 2.0}, "availability": {section: limits}})
    assert [d.availability.state_at(3600.0) is not None for d in generate_population(config)] == [True] * 3
