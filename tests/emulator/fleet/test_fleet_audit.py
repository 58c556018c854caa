"""The one-shot privacy audit in the fleet, end to end: canary devices take part through the real
protocol against the real server's central DP rounds, and the estimate from the final model stays
below the accountant's epsilon with noise and exceeds it without (the audit can fail).

The noisy run's multiplier is 3, not 1: the digits MLP has 2,410 parameters and a 6-hour run of 40
devices commits 9 rounds, where the accountant's epsilon at z = 1 (about 17, for a device in every
round) is above what an unnoised run can show through cosines in so few dimensions (about 12). At
z = 3 the accountant says about 4.4, and the run without noise must beat that."""

from __future__ import annotations

import pytest

from emulator.fleet import FleetConfig, simulate

#: The module's shared fixture is built once per run: its tests go to one pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("fleet_audit")


def _audited(noise_multiplier: float) -> dict:
    config = FleetConfig.from_dict(
        {
            "fleet": {"devices": 40, "hours": 6.0, "start_utc_hour": 6.0, "seed": 3},
            "task": {"goal_count": 10, "compute_s_per_example": 0.2, "retry_min_s": 60.0, "retry_max_s": 300.0},
            "dp": {"mode": "central", "noise_multiplier": noise_multiplier, "clip": 1.0, "audit_canaries": 20},
        }
    )
    return simulate(config, progress=False).summary()


@pytest.fixture(scope="session")
def noisy() -> dict:
    return _audited(3.0)


def test_with_noise_the_fleets_audit_stays_below_the_accountants_epsilon(noisy):
    assert noisy["dp_rounds"] >= 5 and noisy["audit_reports"] >= 20
    assert noisy["epsilon"] is not None and 0 <= noisy["audit_epsilon"] < noisy["epsilon"], noisy


def test_with_the_noise_off_the_fleets_audit_exceeds_the_noisy_runs_accountant(noisy):
    off = _audited(0.0)
    assert off["epsilon"] is None and off["noise_multiplier"] == 0.0  # unbounded: no noise
    assert off["audit_epsilon"] > noisy["epsilon"], (off["audit_epsilon"], noisy["epsilon"])
