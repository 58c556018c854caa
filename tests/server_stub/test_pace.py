"""Pace steering windows."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from server_stub.pace import RoundPace


def test_without_history_the_base_window_is_used():
    assert RoundPace().retry_window(10.0, 9.0, (1.0, 3.0), cap_s=60) == (1.0, 3.0)


def test_window_starts_when_the_next_round_is_expected():
    pace = RoundPace()
    pace.observe(10.0)
    assert pace.retry_window(now=4.0, round_started_at=0.0, base=(1.0, 3.0), cap_s=60) == (7.0, 9.0)
    pace.observe(20.0)
    assert pace.mean_duration_s == 13.0


@given(
    durations=st.lists(st.floats(0, 1e4), min_size=1, max_size=20),
    now=st.floats(0, 1e5),
    started=st.floats(0, 1e5),
    lo=st.floats(0, 100),
    spread=st.floats(0, 100),
    cap=st.floats(0, 1e3),
)
def test_window_is_the_base_spread_shifted_by_at_most_the_cap(durations, now, started, lo, spread, cap):
    pace = RoundPace()
    for d in durations:
        pace.observe(d)
    a, b = pace.retry_window(now, started, (lo, lo + spread), cap)
    assert lo - 1e-9 <= a <= lo + cap + 1e-9
    assert abs((b - a) - spread) < 1e-6 * max(1.0, b)
