"""How the suite itself runs."""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def test_property_tests_run_without_a_deadline_or_the_too_slow_check():
    """A loaded machine must not fail a property (tests/conftest.py's ``suite`` profile)."""
    assert settings().deadline is None
    assert HealthCheck.too_slow in settings().suppress_health_check
