"""Pace steering for a population (paper, section 2.3): rejected devices are told to come back
after a wait that brings the population's check-ins to about the rate its rounds need."""

from __future__ import annotations

import heapq
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from server_stub.pace import CheckinPace

BASE = (600.0, 1800.0)
SEATS = 130
ROUND_S = 200.0


def _fed(gaps: list[float], *, base: tuple[float, float] = BASE) -> tuple[CheckinPace, tuple[float, float]]:
    """A pace that saw one check-in after each gap, each one rejected."""
    pace, t, window = CheckinPace(), 0.0, base
    for gap in gaps:
        t += gap
        pace.observe_checkin(t)
        window = pace.window(t, base, SEATS, ROUND_S)
    return pace, window


gaps = st.lists(st.floats(0.0, 60.0), min_size=1, max_size=300)


@given(gaps=gaps, lo=st.floats(0.0, 1e4), spread=st.floats(0.0, 1e4))
def test_the_window_is_the_tasks_own_stretched_never_shrunk(gaps, lo, spread):
    base = (lo, lo + spread)
    pace, (a, b) = _fed(gaps, base=base)
    assert a >= lo - 1e-9 and b >= lo + spread - 1e-9
    if lo >= 1.0:
        k = a / lo  # the same shape, only longer
        assert abs(b - (lo + spread) * k) <= 1e-9 * b
    mean = lo + spread / 2
    assert (a + b) / 2 <= max(mean, pace.max_wait_s) * (1 + 1e-9)


@given(gaps=st.lists(st.floats(2 * ROUND_S / SEATS, 600.0), min_size=1, max_size=200))
def test_check_ins_no_faster_than_the_rounds_need_keep_the_tasks_window(gaps):
    # each check-in comes at least as far apart as 1/needed = ROUND_S / (margin * SEATS)
    _, window = _fed(gaps)
    assert window == BASE


@given(gaps=gaps, extra=st.integers(1, 50))
def test_more_check_ins_never_shorten_the_wait(gaps, extra):
    pace, _ = _fed(gaps)
    busier, _ = _fed(gaps)
    now = sum(gaps)
    for _ in range(extra):
        busier.observe_checkin(now)
    base_wait = sum(BASE) / 2
    assert busier.stretch(base_wait, SEATS, ROUND_S) >= pace.stretch(base_wait, SEATS, ROUND_S)


def test_without_rounds_to_fill_or_history_the_window_is_the_tasks_own():
    pace = CheckinPace()
    assert pace.stretch(1200.0, SEATS, ROUND_S) == 1.0  # nothing told yet
    pace.observe_checkin(0.0)
    pace.window(0.0, BASE, SEATS, ROUND_S)
    for _ in range(10_000):
        pace.observe_checkin(10.0)
    assert pace.stretch(1200.0, 0, ROUND_S) == 1.0
    assert pace.stretch(1200.0, SEATS, 0.0) == 1.0


def _closed_loop(devices: int, seed: int, hours: float = 12.0) -> tuple[float, float]:
    """Devices that are always available check in; a round takes SEATS of them, then reports
    for ROUND_S; the others are rejected with the paced window. Returns the check-in rate and
    the accepted rate over the last third of the run."""
    rng = random.Random(seed)
    pace = CheckinPace()
    queue = [(rng.uniform(0.0, 600.0), i) for i in range(devices)]
    heapq.heapify(queue)
    end, tail = hours * 3600.0, hours * 3600.0 * 2 / 3
    filled, reporting_until, checkins, accepted = 0, -1.0, 0, 0
    while queue:
        t, i = heapq.heappop(queue)
        if t > end:
            break
        pace.observe_checkin(t)
        checkins += t > tail
        if t < reporting_until:
            a, b = pace.window(t, BASE, SEATS, ROUND_S)
            heapq.heappush(queue, (t + rng.uniform(a, b), i))
            continue
        filled += 1
        accepted += t > tail
        if filled == SEATS:
            filled, reporting_until = 0, t + ROUND_S
        heapq.heappush(queue, (t + 3600.0, i))  # a device takes part at most once an hour
    span = end - tail
    return checkins / span, accepted / span


@settings(max_examples=3, deadline=None)
@given(devices=st.integers(20_000, 40_000), seed=st.integers(0, 2**16))
def test_a_large_population_checks_in_at_about_the_rate_its_rounds_need(devices, seed):
    pace = CheckinPace()
    needed = pace.margin * SEATS / ROUND_S
    flat_rate = devices / (sum(BASE) / 2)  # what the task's own window alone would bring
    rate, accepted = _closed_loop(devices, seed)
    assert rate < 2 * needed < flat_rate / 4
    # and the rounds still fill: most of what a round can take is taken
    assert accepted > 0.5 * SEATS / ROUND_S


@settings(max_examples=30, deadline=None)
@given(per_seat=st.floats(0.1, 3.9), rate=st.floats(0.01, 100.0))
def test_a_population_the_rounds_need_most_of_keeps_the_tasks_window(per_seat, rate):
    # Stretching a population only a few times the seats would let participants, who come
    # straight back, crowd out the rejected devices round after round.
    pace = CheckinPace()
    mean_wait = per_seat * SEATS / rate
    t = 0.0
    pace.observe_checkin(t)
    pace.window(t, (mean_wait, mean_wait), SEATS, ROUND_S)
    while t < 3 * pace.memory_s:
        t += 1.0 / rate
        pace.observe_checkin(t)
    assert pace.population() < 4.0 * SEATS
    assert pace.stretch(mean_wait, SEATS, 1e6) == 1.0  # rounds this long would otherwise stretch it
