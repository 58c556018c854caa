"""Pace steering at its edges: a round that is already overdue, and the cap."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from server_stub.pace import RoundPace

# Whole seconds: the window arithmetic is exact, so equalities can be asserted exactly.
seconds = st.integers(0, 10_000).map(float)


@given(mean=seconds, started=seconds, late_by=seconds, lo=seconds, spread=seconds, cap=seconds)
def test_when_the_next_round_is_already_due_the_base_window_is_used(mean, started, late_by, lo, spread, cap):
    pace = RoundPace()
    pace.observe(mean)
    now = started + mean + late_by
    assert pace.retry_window(now, started, (lo, lo + spread), cap) == (lo, lo + spread)


@given(
    mean=seconds, started=seconds, early_by=st.integers(1, 10_000).map(float), lo=seconds, spread=seconds, cap=seconds
)
def test_the_window_is_shifted_by_the_time_to_the_next_round_up_to_the_cap(mean, started, early_by, lo, spread, cap):
    pace = RoundPace()
    pace.observe(mean)
    now = started + mean - early_by
    wait = min(early_by, cap)
    assert pace.retry_window(now, started, (lo, lo + spread), cap) == (lo + wait, lo + spread + wait)
