"""The fleet-day benchmark runs as documented, on a small fleet: its baselines on either side of
the simulation, in processes of their own, and a summary whose ratio is to their mean."""

from __future__ import annotations

import pytest

from tests.support import run_benchmark


@pytest.mark.timeout(300)
def test_a_small_run_brackets_the_simulation_with_two_baselines():
    # 40 devices for a quarter of an hour complete 5 sessions (the same every run: the simulation is
    # seeded); a baseline of 10 devices completes some in its half second: its devices start their
    # first sessions within it, and a stop lets a session under way finish (only a late report's
    # wait is cut short)
    lines = run_benchmark(
        "fleet_day", "--devices", "40", "--hours", "0.25", "--baseline-s", "0.5", "--baseline-devices", "10"
    )
    assert [line.get("case") for line in lines[:3]] == [
        "baseline_realtime_fleet",
        "simulation",
        "baseline_realtime_fleet",
    ]
    before, sim, after, summary = lines
    assert (before["when"], after["when"]) == ("before", "after")
    rates = [before["completed_sessions_per_wall_s"], after["completed_sessions_per_wall_s"]]
    assert all(r > 0 for r in rates) and sim["sessions_completed"] > 0
    assert summary["summary"] is True
    assert summary["baseline_completed_sessions_per_wall_s_before_after"] == rates
    mean_ratio = sim["completed_sessions_per_wall_s"] / (sum(rates) / 2)
    assert summary["targets"]["completed_sessions_per_wall_s_vs_realtime_fleet"]["value"] == pytest.approx(
        mean_ratio, abs=0.01
    )
    assert summary["targets"]["day_wall_s"]["met"] is None  # only a full day of 10,000 devices is judged
