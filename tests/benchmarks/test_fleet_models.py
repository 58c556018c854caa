"""The fleet-models benchmark runs as documented, on small fleets: each task in a process of its own,
its completed sessions replayed alone for the floor, and a summary whose targets are the ratios."""

from __future__ import annotations

import pytest

from tests.support import run_benchmark


@pytest.mark.timeout(300)
def test_a_small_run_replays_each_tasks_completed_sessions_and_judges_the_ratios():
    lines = run_benchmark("fleet_models", "--devices", "150", "--hours", "0.5", "--sample", "5")
    *tasks, summary = lines
    assert [t["case"] for t in tasks] == ["glyphs", "shakespeare"]
    for t in tasks:
        assert t["sessions_completed"] > 0 and t["replayed"] == min(5, t["sessions_completed"])
        assert t["examples_mismatched"] == 0  # the replay trained what the fleet's sessions trained
        assert t["ratio_to_floor"] == pytest.approx(
            t["fleet_cpu_ms_per_completed_session"] / t["floor_cpu_ms_per_session"], abs=0.01
        )
        target = summary["targets"][f"{t['case']}_cpu_per_completed_session_over_floor"]
        assert target == {
            "value": t["ratio_to_floor"],
            "goal": 1.25,
            "met": None,
        }  # only a day of 10,000 devices is judged
    assert summary["summary"] is True and summary["quick"] is False
