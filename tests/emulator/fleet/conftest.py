"""Fleet runs that several test modules read: each is simulated once per pytest-xdist worker, so
the modules that share one put their tests in one ``xdist_group`` (one worker builds it)."""

from __future__ import annotations

import pytest

from emulator.fleet import FleetConfig, FleetRun, simulate


@pytest.fixture(scope="session")
def goal8_fleet() -> FleetRun:
    """A real fleet small enough for the default run, 300 devices for two hours with rounds of a
    goal of 8 (seed 5): a few rounds commit, most are abandoned. The report's and compare's tests
    read it, in one xdist_group (``fleet_reports``)."""
    config = FleetConfig.from_dict({"fleet": {"devices": 300, "hours": 2.0, "seed": 5}, "task": {"goal_count": 8}})
    return simulate(config, progress=False)
