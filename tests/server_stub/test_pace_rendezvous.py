"""Pace steering for a small population (paper, section 2.3): the devices turned away are told to
come back as the next selection opens, and it opens only once enough of them are expected."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from server_stub.pace import (
    MAX_DEFERRALS,
    MAX_GATHER,
    MIN_GATHER,
    RENDEZVOUS_MARGIN,
    RENDEZVOUS_SPREAD,
    Rendezvous,
    gather_s,
    rendezvous_window,
)

times = st.floats(0.0, 1e6)
seats = st.integers(1, 1000)
selection = st.floats(1.0, 3600.0)


@given(now=times, ahead=st.floats(0.0, 1e5), expected=st.floats(0.0, 1e5), seats=seats, selection_s=selection)
def test_a_device_told_of_an_opening_arrives_within_that_selection_window(now, ahead, expected, seats, selection_s):
    lo, hi = rendezvous_window(now, now + ahead, expected, seats, selection_s)
    assert abs(lo - ahead) <= 1e-9 * max(1.0, ahead)  # not before the opening: it would be turned away again
    assert RENDEZVOUS_SPREAD * selection_s * (1 - 1e-9) <= hi - lo <= selection_s * (1 + 1e-9)


@given(now=times, late=st.floats(0.0, 1e5), expected=st.floats(0.0, 1e5), seats=seats, selection_s=selection)
def test_an_opening_already_past_is_told_as_now(now, late, expected, seats, selection_s):
    lo, hi = rendezvous_window(now, now - late, expected, seats, selection_s)
    assert lo == 0.0 and 0.0 < hi <= selection_s * (1 + 1e-9)


@given(expected=st.floats(0.0, 1e5), more=st.floats(0.0, 1e5), seats=seats, selection_s=selection)
def test_more_devices_expected_never_narrow_the_window(expected, more, seats, selection_s):
    narrow = rendezvous_window(0.0, 100.0, expected, seats, selection_s)
    wide = rendezvous_window(0.0, 100.0, expected + more, seats, selection_s)
    assert wide[0] == narrow[0] and wide[1] >= narrow[1]


@given(missing=st.floats(0.0, 1e6), rate=st.floats(0.0, 100.0), selection_s=selection)
def test_gathering_takes_the_time_the_missing_devices_need_within_bounds(missing, rate, selection_s):
    wait = gather_s(missing, rate, selection_s)
    assert MIN_GATHER * selection_s <= wait <= MAX_GATHER * selection_s
    if rate > 0 and MIN_GATHER * selection_s < missing / rate < MAX_GATHER * selection_s:
        assert abs(wait * rate - missing) <= 1e-6 * max(1.0, missing)


def _trickle(rate: float, span_s: float, seed: int) -> Rendezvous:
    """A rendezvous that saw check-ins of themselves at ``rate`` per second for ``span_s``."""
    rng, r, t = random.Random(seed), Rendezvous(), 0.0
    while True:
        t += rng.expovariate(rate)
        if t > span_s:
            return r
        r.observe_checkin(t)


@settings(deadline=None)  # up to 18,000 check-ins an example: its time follows the machine's load
@given(rate=st.floats(0.01, 5.0), seats=st.integers(10, 300), seed=st.integers(0, 2**16))
def test_a_selection_opens_at_once_only_when_its_seats_are_expected(rate, seats, seed):
    r = _trickle(rate, 3600.0, seed)
    selection_s = 300.0
    small = r.small(3600.0, seats, selection_s)  # the rate as of now
    expected = r.natural_arrivals(selection_s)
    opens_at = r.plan(3600.0, seats, selection_s)
    if expected >= RENDEZVOUS_MARGIN * seats:
        assert opens_at == 3600.0 and not small
    else:
        assert small
        assert 3600.0 + MIN_GATHER * selection_s <= opens_at <= 3600.0 + MAX_GATHER * selection_s


@settings(deadline=None)
@given(rate=st.floats(0.02, 0.3), seed=st.integers(0, 2**16))
def test_a_trickle_told_to_gather_fills_the_selection_it_was_aimed_at(rate, seed):
    """A population whose check-ins of themselves bring a fraction of a round's seats in its
    selection window: everyone turned away while it gathers is told the opening, and those who
    come (all of them here) arrive inside its selection window, enough to fill its seats."""
    seats_, selection_s = 130, 300.0
    rng = random.Random(seed)
    r = _trickle(rate, 1800.0, seed)
    now = 1800.0
    opens_at = r.plan(now, seats_, selection_s)
    assert opens_at > now
    arrivals = []
    while True:
        plan_again = False
        t = now
        while True:
            t += rng.expovariate(rate)
            if t >= opens_at:
                break
            r.observe_checkin(t)
            lo, hi = r.tell(t, opens_at, seats_, selection_s)
            arrivals.append(t + rng.uniform(lo, hi))
        decided = r.plan(opens_at, seats_, selection_s)
        if decided == opens_at:
            break
        # postponed: those told come back, are turned away again and told the next opening
        now, plan_again = opens_at, True
        returning = sorted(a for a in arrivals if a >= now)
        arrivals = []
        for a in returning:
            r.observe_checkin(a)
            if a >= decided:  # the next selection is open already: it takes part
                arrivals.append(a)
                continue
            lo, hi = r.tell(a, decided, seats_, selection_s)
            arrivals.append(a + rng.uniform(lo, hi))
        opens_at = decided
        assert plan_again
    inside = sum(opens_at <= a <= opens_at + selection_s for a in arrivals)
    assert inside == len(arrivals)
    assert inside + rate * selection_s >= seats_  # with those of themselves, as the plan expected


def test_a_population_that_never_gathers_its_seats_still_opens_rounds(tmp_path):
    """Eight devices that come back when they are told, for rounds of 13 seats: the selection is
    put off while devices gather, at most MAX_DEFERRALS times in a row, then opens with those who
    came (it used to be put off for ever, and such a fleet never trained)."""
    from device_runtime import encode_checkpoint, initial_weights, serialize_plan
    from device_runtime.plan import installed_runtime_version
    from device_runtime.wire import CheckinRejected
    from server_stub import FLService, RoundConfig, ServerStore
    from tests.support import digits_plan

    clock = [0.0]
    store = ServerStore(tmp_path / "s.db")
    service = FLService(store, clock=lambda: clock[0], wall_clock=lambda: 1.7e9 + clock[0])
    plan = digits_plan()
    config = RoundConfig(
        goal_count=10, over_selection=1.3, min_fraction=0.8, selection_timeout_s=60.0, report_timeout_s=60.0
    )
    service.create_population("p")
    service.deploy_task("p", "train", serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), config)
    rng = random.Random(0)
    due = [rng.uniform(0.0, 600.0) for _ in range(8)]  # each device's next check-in
    opened, deferred = set(), 0
    while clock[0] < 3 * 3600.0:
        for k, at in enumerate(due):
            if at > clock[0]:
                continue
            answer = service.checkin("p", installed_runtime_version())
            rejected = isinstance(answer, CheckinRejected)
            deferred += rejected and answer.reason == "ROUND_NOT_OPEN"
            lo, hi = (rejected and answer.retry_after_s) or (600.0, 900.0)
            due[k] = clock[0] + rng.uniform(lo, hi)
        current = service._populations["p"].current
        if current is not None and current.core is not None:
            opened.add(current.core.started_at)
        clock[0] += 1.0
        service.tick()
    longest_s = (MAX_DEFERRALS + 1) * MAX_GATHER * config.selection_timeout_s + config.selection_timeout_s
    assert deferred > 0  # it is a small population: selections were put off
    assert len(opened) >= 3 * 3600.0 / (longest_s + config.report_timeout_s)
    store.close()


def test_a_first_selection_that_closed_short_is_not_followed_at_once_by_another(tmp_path):
    """The server opens its first selection at 0 and its first device comes a second later: a
    trickle of five for 13 seats, the round times out short and the next selection waits for
    devices to gather (the devices turned away are told ROUND_NOT_OPEN), where it opened at once on
    the same trickle because the second before the first check-in was not counted as watched."""
    from device_runtime import encode_checkpoint, initial_weights, serialize_plan
    from device_runtime.plan import installed_runtime_version
    from device_runtime.wire import CheckinAccepted, CheckinRejected
    from server_stub import FLService, RoundConfig, ServerStore
    from tests.support import digits_plan

    clock = [0.0]
    store = ServerStore(tmp_path / "s.db")
    service = FLService(store, clock=lambda: clock[0], wall_clock=lambda: 1.7e9 + clock[0])
    plan = digits_plan()
    config = RoundConfig(goal_count=10, selection_timeout_s=60.0, report_timeout_s=60.0)
    service.create_population("p")
    service.deploy_task("p", "train", serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), config)
    version = installed_runtime_version()
    for at in (1.0, 12.0, 24.0, 36.0, 48.0):  # seated, then silent: the round closes at its selection's end
        clock[0] = at
        assert isinstance(service.checkin("p", version), CheckinAccepted)
    clock[0] = 60.0
    service.tick()
    answer = service.checkin("p", version)
    store.close()
    assert isinstance(answer, CheckinRejected) and answer.reason == "ROUND_NOT_OPEN", answer
