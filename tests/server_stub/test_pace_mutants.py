"""Pace steering's finer points (paper, section 2.3): the reporting-time mean, the population
estimate before a whole wait has passed, the stretch at its edges, and the rendezvous' counts
(who answered it, what share came, when the next opening is planned, how wide its window is)."""

from __future__ import annotations

import math

from hypothesis import example, given
from hypothesis import strategies as st

from server_stub.pace import (
    FIRST_SHOW,
    MAX_GATHER,
    MIN_DEVICES_PER_SEAT,
    MIN_GATHER,
    RENDEZVOUS_MARGIN,
    RENDEZVOUS_SPREAD,
    SHOW_WEIGHT,
    CheckinPace,
    Rendezvous,
    RoundPace,
    rendezvous_window,
)

# --- RoundPace: the reporting part of a round is an exponentially weighted mean of its own --------


@given(
    rounds=st.lists(st.tuples(st.floats(0.0, 1e4), st.one_of(st.none(), st.floats(0.0, 1e4))), min_size=1, max_size=20),
    weight=st.floats(0.05, 1.0),
)
def test_the_reporting_mean_follows_only_the_rounds_that_reported_it(rounds, weight):
    pace, mean = RoundPace(weight=weight), None
    for duration, reporting in rounds:
        pace.observe(duration, reporting)
        if reporting is not None:
            mean = reporting if mean is None else mean + weight * (reporting - mean)
    if mean is None:
        assert pace.mean_reporting_s is None
    else:
        assert pace.mean_reporting_s is not None
        assert math.isclose(pace.mean_reporting_s, mean, rel_tol=1e-9, abs_tol=1e-6)
        reported = [r for _, r in rounds if r is not None]
        assert min(reported) - 1e-6 <= pace.mean_reporting_s <= max(reported) + 1e-6


# --- CheckinPace: the population estimate -------------------------------------------------------


def test_a_pace_that_saw_nothing_estimates_no_population():
    assert CheckinPace().population() == 0.0


@given(n=st.integers(1, 200), gap=st.floats(0.1, 10.0))
def test_before_any_device_was_told_a_wait_no_population_is_estimated(n, gap):
    # Little's law: devices cycling = rate * the mean wait they were told; none told, none cycling
    pace = CheckinPace()
    for i in range(n + 1):
        pace.observe_checkin(1000.0 + i * gap)
    assert pace.rate > 0.0
    assert pace.population() == 0.0


@given(
    start=st.floats(1e4, 1e6),
    wait=st.floats(1000.0, 1800.0),
    n=st.integers(1, 200),
    span=st.floats(0.0, 60.0),
)
def test_before_a_whole_wait_has_passed_the_population_is_no_more_than_the_check_ins_seen(start, wait, n, span):
    pace = CheckinPace()
    pace.observe_checkin(start)
    pace.window(start, (wait, wait), 1, 60.0)  # the mean wait told is now `wait`, much longer than `span`
    for i in range(1, n + 1):
        pace.observe_checkin(start + span * i / n)
    assert pace.population() <= (n + 1) * 1.02  # decay over at most 60 s of a 30-minute memory aside


def _crowd(rate: float = 10.0, span_s: float = 200.0, wait_s: float = 100.0) -> CheckinPace:
    """A pace that told its devices a mean wait of ``wait_s`` and then saw ``rate`` check-ins per
    second for ``span_s`` (> ``wait_s``): about ``rate * wait_s`` devices cycling."""
    pace = CheckinPace()
    pace.observe_checkin(0.0)
    pace.window(0.0, (wait_s, wait_s), 0, 1.0)  # no seats: not stretched, the wait told is wait_s
    for i in range(1, int(rate * span_s) + 1):
        pace.observe_checkin(i / rate)
    return pace


CROWD = _crowd()  # read only below: population() and stretch() do not change it


def test_the_crowd_is_about_its_rate_times_its_wait():
    assert 900.0 <= CROWD.population() <= 1100.0


@given(base_wait=st.floats(0.05, 1e4), seats=st.integers(1, 200), round_s=st.floats(0.05, 1e4))
@example(base_wait=10.0, seats=1, round_s=10.0)  # one seat
@example(base_wait=10.0, seats=1, round_s=0.5)  # rounds reporting within a second
@example(base_wait=0.5, seats=2, round_s=60.0)  # a window shorter than a second
def test_a_crowd_is_told_the_wait_that_brings_it_back_at_the_rate_its_rounds_need(base_wait, seats, round_s):
    population = CROWD.population()
    k = CROWD.stretch(base_wait, seats, round_s)
    needed = CROWD.margin * seats / round_s
    assert k >= 1.0
    if population < MIN_DEVICES_PER_SEAT * seats:
        assert k == 1.0
    elif base_wait < population / needed < CROWD.max_wait_s:
        assert math.isclose(population / (base_wait * k), needed, rel_tol=1e-9)
    else:
        assert math.isclose(base_wait * k, max(base_wait, min(CROWD.max_wait_s, population / needed)), rel_tol=1e-9)


def test_a_window_of_no_wait_is_never_stretched():
    pace = _crowd()
    assert pace.stretch(0.0, 1, 60.0) == 1.0
    assert pace.window(300.0, (0.0, 0.0), 1, 60.0) == (0.0, 0.0)


def test_a_population_of_exactly_the_least_devices_per_seat_is_stretched():
    # "below this many devices per seat the population is not stretched": at exactly as many, it is.
    # The state is set directly: a rate of 4/s over a told wait of 10 s is 40 devices, exactly.
    pace = CheckinPace(_weight=400.0, _seen_for=100.0, _first=0.0, _last=1000.0, mean_wait_s=10.0)
    seats = 10
    assert pace.population() == MIN_DEVICES_PER_SEAT * seats
    # needed = 1.5 * 10 / 150 = 0.1 check-ins a second: 40 devices come back at that rate after 400 s
    assert math.isclose(pace.stretch(10.0, seats, 150.0), 40.0)


# --- Rendezvous: who answered it, and what share came ---------------------------------------------

SEL = 60.0
SEATS = 10


def _told(n: int, opens_at: float = 100.0) -> tuple[Rendezvous, float]:
    """A rendezvous ``n`` devices were told at time 0 to come to at ``opens_at``, which has now
    opened; and the end of the latest window told."""
    r = Rendezvous()
    end = max(r.tell(0.0, opens_at, SEATS, SEL)[1] for _ in range(n))
    r.plan(opens_at, SEATS, SEL)  # the opening came: those told go to the last rendezvous
    return r, end


def _natural(r: Rendezvous) -> float:
    """The (decayed) count of check-ins the rendezvous took to have come of themselves."""
    return r.natural._weight


def test_check_ins_from_the_opening_to_the_windows_end_answer_it_up_to_as_many_as_were_told():
    r, end = _told(3)
    assert end == 100.0 + RENDEZVOUS_SPREAD * SEL
    for t in (100.0, 115.0, end):  # at the opening, inside, and at the very end of the window
        r.observe_checkin(t)
        assert _natural(r) == 0.0  # an answer, not a check-in that came of itself
    r.observe_checkin(end)  # one more than were told: it came of itself
    assert _natural(r) > 0.0


def test_a_check_in_after_the_windows_end_came_of_itself():
    r, end = _told(3)
    r.observe_checkin(end + 1.0)
    assert _natural(r) > 0.0


def test_a_check_in_after_the_windows_told_for_a_later_rendezvous_came_of_itself():
    # a clock starting at 0 and a one-second selection window: the second rendezvous' window
    # ends at 0.6 s, and what comes after it was not told to come
    r = Rendezvous()
    r.tell(0.0, 0.0, SEATS, 1.0)
    r.plan(0.0, SEATS, 1.0)
    _, end = r.tell(0.0, 0.1, SEATS, 1.0)
    r.tell(0.0, 0.1, SEATS, 1.0)
    assert math.isclose(end, 0.6)
    r.plan(0.1, SEATS, 1.0)
    r.observe_checkin(0.1)
    assert _natural(r) == 0.0
    r.observe_checkin(0.8)
    assert _natural(r) > 0.0


@given(n=st.integers(1, 30), share=st.floats(0.0, 1.0), extra=st.integers(0, 5))
@example(n=1, share=1.0, extra=0)
@example(n=1, share=0.0, extra=0)
def test_the_share_of_those_told_who_came_moves_the_show_up_estimate(n, share, extra):
    r, end = _told(n)
    came = round(share * n)
    for i in range(came + extra):  # those beyond the told came of themselves and are not counted
        r.observe_checkin(100.0 + (end - 100.0) * i / max(1, came + extra))
    r.tell(end, 300.0, SEATS, SEL)  # a device told of the next opening ...
    r.plan(300.0, SEATS, SEL)  # ... which closes the measurement of the last one
    answered = min(n, came + extra)
    assert math.isclose(r.show, FIRST_SHOW + SHOW_WEIGHT * (answered / n - FIRST_SHOW), rel_tol=1e-12)


@given(k=st.integers(1, 50), m=st.integers(1, 50))
def test_the_devices_expected_are_those_told_to_the_coming_opening_times_the_show_up(k, m):
    r = Rendezvous()
    for _ in range(k):
        r.tell(0.0, 100.0, SEATS, SEL)
    assert math.isclose(r.expected(), k * FIRST_SHOW)
    for _ in range(m):  # told of another opening: only these count for it
        r.tell(1.0, 200.0, SEATS, SEL)
    assert math.isclose(r.expected(), m * FIRST_SHOW)
    r.plan(200.0, SEATS, SEL)  # it opened: none told yet of the next
    assert r.told == 0 and r.expected() == 0.0


# --- Rendezvous: whether a population is small ------------------------------------------------


@given(first=st.integers(1000, 10**6), sel=st.integers(2, 3600))
def test_a_population_watched_for_less_than_a_selection_window_is_not_small(first, sel):
    r = Rendezvous()
    r.observe_checkin(float(first))
    assert not r.small(first + sel / 2, 100, float(sel))


@given(first=st.integers(0, 10**6), sel=st.integers(1, 3600))
def test_a_trickle_watched_for_exactly_a_selection_window_is_small(first, sel):
    r = Rendezvous()
    r.observe_checkin(float(first))  # one check-in in a whole window, for ten seats
    assert r.small(float(first + sel), SEATS, float(sel))


@given(first=st.integers(0, 10**6), sel=st.integers(1, 3600))
def test_a_server_that_saw_no_check_in_does_not_call_its_population_small(first, sel):
    r = Rendezvous()
    assert not r.small(float(first), SEATS, float(sel))
    assert not r.small(float(first + 2 * sel), SEATS, float(sel))


@given(
    start=st.floats(0.0, 1e6),
    sel=st.floats(10.0, 3600.0),
    lag=st.floats(0.01, 5.0),
    n=st.integers(1, SEATS // 2),
)
def test_a_trickle_watched_from_its_selections_opening_is_small_when_that_selection_closes(start, sel, lag, n):
    """The first round opens at ``start`` and its first device comes a moment later: when its
    selection window closes short, the server has watched one whole window of check-ins (it used
    to count from the first check-in, was short by that moment, and opened the next round at once
    on the same trickle)."""
    r = Rendezvous()
    r.watch(start)
    for k in range(n):  # half the seats, evenly from a device's latency on
        r.observe_checkin(start + lag + (sel - lag) * k / n)
    assert r.small(start + sel, SEATS, sel)
    r.watch(start + sel)  # the next opening does not restart the watch
    assert r.small(start + sel, SEATS, sel)


def test_check_ins_of_exactly_the_margin_times_the_seats_are_not_small():
    # the state is set directly: 0.25 check-ins a second bring 25 = 1.25 * 20 in 100 s
    natural = CheckinPace(memory_s=600.0, _weight=25.0, _seen_for=100.0, _first=0.0, _last=1000.0)
    r = Rendezvous(natural=natural)
    assert r.natural_arrivals(100.0) == RENDEZVOUS_MARGIN * 20
    assert not r.small(1000.0, 20, 100.0)


# --- Rendezvous: when the next selection opens ---------------------------------------------------


def test_a_selection_whose_seats_are_just_expected_opens_at_once():
    r = Rendezvous(show=0.5)
    for _ in range(40):
        r.tell(0.0, 100.0, 16, SEL)
    assert r.expected() == RENDEZVOUS_MARGIN * 16  # 20 expected, exactly the margin
    assert r.plan(100.0, 16, SEL) == 100.0


@given(gap=st.floats(5.0, 20.0), told=st.integers(0, 20), seats=st.integers(20, 60), show=st.floats(0.3, 1.0))
@example(gap=10.0, told=0, seats=40, show=0.8)
def test_a_deferred_opening_waits_as_long_as_the_missing_devices_take_to_come(gap, told, seats, show):
    r = Rendezvous(show=show)
    t = 0.0
    while t <= 600.0:  # check-ins of themselves, one per `gap` seconds
        r.observe_checkin(t)
        t += gap
    for _ in range(told):
        r.tell(t, t + 100.0, seats, SEL * 5)
    expected = r.expected()
    opens_at = r.plan(t, seats, SEL * 5)
    rate = r.natural.rate
    missing = RENDEZVOUS_MARGIN * seats - expected - rate * SEL * 5
    wait = opens_at - t
    if missing <= 0.0:
        assert wait == 0.0
        return
    # the natural check-ins in the wait, told to come, show up at `show`: they make up the missing,
    # in no less and no more than the gathering's bounds
    lo, hi = MIN_GATHER * SEL * 5, MAX_GATHER * SEL * 5
    assert math.isclose(wait, min(hi, max(lo, missing / (rate * show))), rel_tol=1e-9)


# --- rendezvous_window: its width -------------------------------------------------------------


@given(seats=st.integers(1, 1000), share=st.floats(0.0, 3.0), selection_s=st.floats(1.0, 3600.0))
@example(seats=1, share=2.0, selection_s=60.0)
@example(seats=1, share=1.5, selection_s=60.0)
def test_the_window_is_half_the_selection_for_the_seats_and_widens_to_all_of_it_for_twice_as_many(
    seats, share, selection_s
):
    lo, hi = rendezvous_window(0.0, 100.0, share * seats, seats, selection_s)
    width = (hi - lo) / selection_s
    assert math.isclose(width, RENDEZVOUS_SPREAD * min(2.0, max(1.0, share)), rel_tol=1e-9)


@given(expected=st.floats(0.0, 1e5), selection_s=st.floats(1.0, 3600.0))
def test_a_selection_of_no_seats_is_told_half_its_window(expected, selection_s):
    lo, hi = rendezvous_window(0.0, 100.0, expected, 0, selection_s)
    assert lo == 100.0 and math.isclose(hi - lo, RENDEZVOUS_SPREAD * selection_s)
