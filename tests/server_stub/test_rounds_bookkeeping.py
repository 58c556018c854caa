"""RoundCore's bookkeeping under any schedule of check-ins, reports, aborts, Secure Aggregation
groups and time: every verdict, every count in ``stats``, the deadlines a device is told, when the
round closed and why, and what ``next_event_at`` promises. Times are multiples of 1/4 s and
timeouts of 1/2 s, so deadlines are exact and schedules land on them exactly."""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server_stub.rounds import Phase, ReportVerdict, RoundConfig, RoundCore, SessionState

OPEN = (Phase.SELECTING, Phase.REPORTING)
quarters = st.integers(0, 16).map(lambda q: q / 4)

#: A report's or an abort's ``who`` below 10 picks one of the devices that checked in (so most
#: come from a device the round knows), 10 is a device that never did.
events = st.lists(
    st.one_of(
        st.tuples(st.just("checkin"), st.integers(0, 9)),
        st.tuples(st.just("report"), st.integers(0, 10), st.none() | st.sampled_from([-0.25, 0.0, 0.25])),
        st.tuples(st.just("abort"), st.integers(0, 10)),
        st.tuples(st.just("group"), st.frozensets(st.integers(0, 10), max_size=4)),
        st.tuples(st.just("wait"), quarters),
        st.tuples(st.just("shape"), st.sampled_from([None, "", "-v[]+^", "-v[!"])),
    ),
    min_size=8,
    max_size=50,
)


def device(core: RoundCore, who: int) -> str:
    known = list(core.sessions)
    return known[who % len(known)] if known and who < 10 else "never-checked-in"


def states(core: RoundCore) -> Counter:
    return Counter(core.sessions.values())


def advanced(core: RoundCore, now: float) -> RoundCore:
    """What the round would be after the ticker ran at ``now`` (the original is left alone)."""
    twin = copy.deepcopy(core)
    twin.advance(now)
    return twin


@settings(max_examples=200, deadline=None)
@given(
    goal=st.integers(1, 6),
    over=st.sampled_from([1.0, 1.5, 2.0]),
    min_fraction=st.sampled_from([0.5, 0.75, 1.0]),
    selection_timeout=st.sampled_from([1.0, 2.5, 6.0]),
    report_timeout=st.sampled_from([0.5, 2.0, 4.0]),
    started=st.sampled_from([0.0, 0.5, 100.25]),
    secure=st.booleans(),
    script=events,
)
def test_verdicts_counts_deadlines_and_closing_follow_the_rules_for_any_schedule(
    goal, over, min_fraction, selection_timeout, report_timeout, started, secure, script
):
    cfg = RoundConfig(
        goal_count=goal,
        over_selection=over,
        min_fraction=min_fraction,
        selection_timeout_s=selection_timeout,
        report_timeout_s=report_timeout,
    )
    core = RoundCore(7, cfg, started, deadlines_from_selection_end=secure)
    now = started
    checked_in_at: dict[str, float] = {}
    promised: dict[str, float] = {}  # deadline_of while selecting, the latest it can be
    shapes: Counter = Counter()
    rejected_late = 0  # reports refused as late (a device in a summed SecAgg group may then count as reported)
    for event in script:
        kind = event[0]
        phase_before, ended_before, selection_ended_before = core.phase, core.ended_at, core.selection_ended_at
        ticked = True  # whether the operation runs the ticker at ``now``
        if kind == "wait":
            now += event[1]
            assert core.advance(now) is core.phase
        elif kind == "checkin":
            sid = f"s{event[1]}"
            if sid in core.sessions:
                continue
            selecting = advanced(core, now).phase is Phase.SELECTING
            assert core.try_select(sid, now) is selecting
            assert (sid in core.sessions) is selecting
            if selecting:
                checked_in_at[sid] = now
            # the ticker ran before the device took its seat; the seat that fills selection
            # ends it without another tick, which notices a round that can no longer commit
            ticked = core.phase is Phase.SELECTING
        elif kind == "report":
            sid = device(core, event[1])
            state = core.sessions.get(sid)
            if event[2] is not None and sid in core.deadlines:
                now = max(now, core.deadlines[sid] + event[2])
            was_open, deadline = core.open, core.deadlines.get(sid)
            verdict = core.report(sid, now)
            if state is None:
                assert verdict is ReportVerdict.UNKNOWN
            elif state is SessionState.REPORTED:
                assert verdict is ReportVerdict.DUPLICATE
            elif state is SessionState.ABORTED:
                assert verdict is ReportVerdict.CLOSED
            elif state is SessionState.LATE:
                assert verdict is ReportVerdict.LATE
            elif was_open and now <= deadline:
                assert verdict is ReportVerdict.ACCEPT
                assert core.open
                core.confirm_report(sid, now)
                assert core.sessions[sid] is SessionState.REPORTED
            else:
                assert verdict is ReportVerdict.LATE
                assert core.sessions[sid] is SessionState.LATE
                rejected_late += 1
            ticked = verdict is ReportVerdict.ACCEPT or (
                verdict is ReportVerdict.LATE and state is SessionState.SELECTED and was_open
            )
        elif kind == "abort":
            sid = device(core, event[1])
            state = core.sessions.get(sid)
            assert core.abort(sid, now) is (state is SessionState.SELECTED)
            assert core.sessions.get(sid) is (SessionState.ABORTED if state is SessionState.SELECTED else state)
            ticked = state is SessionState.SELECTED
        elif kind == "group":
            group = [f"s{i}" for i in sorted(event[1])]
            before = dict(core.sessions)
            open_now = advanced(core, now).open
            assert core.confirm_group(group, now) is open_now
            if open_now:
                assert set(core.sessions) == set(before)
                for sid in group:
                    if sid in before:
                        assert core.sessions[sid] is SessionState.REPORTED
            else:
                assert core.sessions == before
        else:
            core.note_shape(event[1])
            if event[1]:
                shapes[event[1]] += 1
            ticked = False

        # -- what stats counts: each session once by its state, and the late reports refused --
        counts = states(core)
        silent = sum(1 for sid, s in core.sessions.items() if s is SessionState.SELECTED and core.deadlines[sid] < now)
        assert core.stats(now) == {
            "selected": len(core.sessions),
            "reported": counts[SessionState.REPORTED],
            "rejected_late": rejected_late,
            "aborted": counts[SessionState.ABORTED],
            "dropped": counts[SessionState.ABORTED] + silent,
            "shapes": dict(shapes),
        }
        assert core.reported == counts[SessionState.REPORTED]

        # -- when and how it closed --------------------------------------------------------------
        if phase_before not in OPEN:
            assert (core.phase, core.ended_at, core.selection_ended_at) == (
                phase_before,
                ended_before,
                selection_ended_before,
            )
        elif not core.open:
            assert core.ended_at == now
            assert (core.phase is Phase.COMMITTED) == (core.reported >= cfg.commit_threshold)
        else:
            assert core.ended_at is None
        if (
            phase_before is Phase.SELECTING
            and core.phase is not Phase.SELECTING
            and core.selection_ended_at is not None
        ):
            assert core.selection_ended_at == now
        if core.phase is Phase.SELECTING:
            assert core.selection_ended_at is None
        if core.phase is Phase.REPORTING:
            assert core.selection_ended_at is not None
        if core.open and ticked:
            assert core.reported < cfg.goal_count
            outstanding = [
                sid for sid, s in core.sessions.items() if s is SessionState.SELECTED and core.deadlines[sid] >= now
            ]
            if core.phase is Phase.SELECTING:
                assert now - started < cfg.selection_timeout_s
            else:
                assert outstanding and core.reported + len(outstanding) >= cfg.commit_threshold

        # -- the deadline each device is held to -----------------------------------------------
        for sid, at in checked_in_at.items():
            if core.phase is Phase.SELECTING and secure:
                assert core.deadline_of(sid) == started + cfg.selection_timeout_s + cfg.report_timeout_s
                promised[sid] = core.deadline_of(sid)
            else:
                assert core.deadline_of(sid) == core.deadlines[sid]
            if not secure:
                assert core.deadlines[sid] == at + cfg.report_timeout_s
            elif sid in promised and core.selection_ended_at is not None:
                # the promise holds when the ticker ran by the selection timeout (the service's
                # timer runs it at next_event_at); a later tick counts the deadline from itself
                if core.selection_ended_at <= started + cfg.selection_timeout_s:
                    assert core.deadlines[sid] <= promised[sid]
        if secure and core.selection_ended_at is not None and phase_before is Phase.SELECTING:
            for sid, s in core.sessions.items():
                if s is SessionState.SELECTED:
                    assert core.deadlines[sid] == core.selection_ended_at + cfg.report_timeout_s

        # -- next_event_at: nothing happens before it, something after it ----------------------
        nxt = core.next_event_at()
        if not core.open:
            assert nxt is None
        elif core.phase is Phase.SELECTING:
            assert nxt == started + cfg.selection_timeout_s
            assert advanced(core, nxt).phase is not Phase.SELECTING
        else:  # the earliest deadline of a device still working (one always is, between calls)
            assert nxt == min(core.deadlines[sid] for sid, s in core.sessions.items() if s is SessionState.SELECTED)
        if core.phase is Phase.REPORTING and ticked and nxt >= now:
            if nxt - 0.25 >= now:
                assert advanced(core, nxt - 0.25).phase is core.phase
            later = nxt + 0.25
            assert advanced(core, later).stats(later)["dropped"] > core.stats(now)["dropped"]


@given(
    started=st.sampled_from([0.5, 10.0, 1000.25]),
    selection_timeout=st.sampled_from([1.0, 3.0, 30.0]),
    selected=st.integers(1, 3),
)
def test_selection_closes_exactly_when_its_timeout_has_passed_since_the_round_started(
    started, selection_timeout, selected
):
    core = RoundCore(1, RoundConfig(goal_count=4, min_fraction=0.25, selection_timeout_s=selection_timeout), started)
    for i in range(selected):
        assert core.try_select(f"s{i}", started)
    assert core.advance(started + selection_timeout - 0.25) is Phase.SELECTING
    assert core.advance(started + selection_timeout) is Phase.REPORTING
    assert core.selection_ended_at == started + selection_timeout
    assert core.ended_at is None


@given(
    goal=st.integers(2, 8),
    min_fraction=st.sampled_from([0.25, 0.5, 0.75, 1.0]),
    data=st.data(),
)
def test_selection_abandons_exactly_when_fewer_than_the_commit_threshold_can_still_report(goal, min_fraction, data):
    """Counted at selection's end: devices still working plus those that already reported."""
    cfg = RoundConfig(
        goal_count=goal, over_selection=2.0, min_fraction=min_fraction, selection_timeout_s=5.0, report_timeout_s=60.0
    )
    selected = data.draw(st.integers(0, goal - 1), label="selected")
    reported = data.draw(st.integers(0, selected), label="reported during selection")
    core = RoundCore(1, cfg, 0.0)
    for i in range(selected):
        assert core.try_select(f"s{i}", 1.0)
    for i in range(reported):
        assert core.report(f"s{i}", 2.0) is ReportVerdict.ACCEPT
        core.confirm_report(f"s{i}", 2.0)
    assert core.phase is Phase.SELECTING
    phase = core.advance(5.0)
    if selected < cfg.commit_threshold:
        assert phase is Phase.ABANDONED
    else:  # and with nobody left to wait for, it commits at once
        assert phase is (Phase.REPORTING if reported < selected else Phase.COMMITTED)
    assert core.ended_at == (None if phase is Phase.REPORTING else 5.0)


@given(report_timeout=st.sampled_from([0.5, 2.0, 60.0]), secure=st.booleans())
def test_a_device_may_report_at_its_deadline_even_after_the_ticker_ran_at_that_instant(report_timeout, secure):
    cfg = RoundConfig(goal_count=2, over_selection=1.0, min_fraction=1.0, report_timeout_s=report_timeout)
    core = RoundCore(1, cfg, 0.0, deadlines_from_selection_end=secure)
    assert core.try_select("a", 0.0) and core.try_select("b", 0.0)
    assert core.phase is Phase.REPORTING
    deadline = core.deadline_of("a")
    assert core.advance(deadline) is Phase.REPORTING
    for sid in ("a", "b"):
        assert core.report(sid, deadline) is ReportVerdict.ACCEPT
        core.confirm_report(sid, deadline)
    assert core.phase is Phase.COMMITTED and core.ended_at == deadline


def test_every_refused_report_is_counted_before_and_after_the_round_closed():
    core = RoundCore(1, RoundConfig(goal_count=2, over_selection=2.0, report_timeout_s=2.0), 0.0)
    core.try_select("a", 0.0)
    for sid in ("b", "c", "d"):
        core.try_select(sid, 1.0)
    assert core.report("a", 2.5) is ReportVerdict.LATE  # past its own deadline
    for sid in ("b", "c"):
        assert core.report(sid, 2.5) is ReportVerdict.ACCEPT
        core.confirm_report(sid, 2.5)
    assert core.phase is Phase.COMMITTED
    assert core.report("d", 2.75) is ReportVerdict.LATE  # in time, but the round is over
    assert core.sessions["d"] is SessionState.LATE
    assert core.stats(2.75)["rejected_late"] == 2


@given(
    checkins=st.lists(quarters, min_size=1, max_size=5),
    by_timeout=st.booleans(),
    report_timeout=st.sampled_from([0.5, 2.0, 4.0]),
)
def test_with_secure_aggregation_every_device_working_at_selection_end_gets_the_full_report_time(
    checkins, by_timeout, report_timeout
):
    """Devices start work only when their group forms, at selection's end: however early they
    checked in, their deadline is then counted afresh; a device that already left keeps its own."""
    target = len(checkins) + (1 if by_timeout else 0)
    cfg = RoundConfig(
        goal_count=target,
        over_selection=1.0,
        min_fraction=0.25,
        selection_timeout_s=5.0,
        report_timeout_s=report_timeout,
    )
    core = RoundCore(1, cfg, 0.0, deadlines_from_selection_end=True)
    now = 0.0
    for i, at in enumerate(sorted(checkins)):
        now = at
        assert core.try_select(f"s{i}", now)
    if len(checkins) > 1:
        assert core.abort("s0", now) or not core.open
        left_deadline = core.deadlines["s0"]
    if by_timeout:
        now = 5.0
        core.advance(now)
    assert core.selection_ended_at == now
    for sid, state in core.sessions.items():
        if state is SessionState.SELECTED:
            assert core.deadlines[sid] == now + report_timeout
    if len(checkins) > 1:
        assert core.deadlines["s0"] == left_deadline


def test_a_late_device_stays_late_and_is_counted_once():
    core = RoundCore(1, RoundConfig(goal_count=3, over_selection=1.0, report_timeout_s=2.0), 0.0)
    for sid in ("a", "b", "c"):
        core.try_select(sid, 0.0)
    assert core.report("a", 2.25) is ReportVerdict.LATE
    assert core.report("a", 2.5) is ReportVerdict.LATE
    assert core.stats(2.5)["rejected_late"] == 1


def test_devices_whose_deadline_passed_and_then_reported_late_no_longer_count_against_the_round():
    # a and b are past their deadline when the ticker runs; c and d still have time. Once a and b
    # report late they are neither outstanding nor silent, and c and d can still commit the round.
    core = RoundCore(1, RoundConfig(goal_count=2, over_selection=2.0, min_fraction=1.0, report_timeout_s=2.0), 0.0)
    core.try_select("a", 0.0)
    core.try_select("b", 0.0)
    core.try_select("c", 1.0)
    core.try_select("d", 1.0)
    assert core.advance(2.5) is Phase.REPORTING
    assert core.report("a", 2.5) is ReportVerdict.LATE and core.phase is Phase.REPORTING
    assert core.report("b", 2.75) is ReportVerdict.LATE and core.phase is Phase.REPORTING
    assert core.next_event_at() == 3.0
    for sid in ("c", "d"):
        assert core.report(sid, 2.75) is ReportVerdict.ACCEPT
        core.confirm_report(sid, 2.75)
    assert core.phase is Phase.COMMITTED and core.stats(2.75)["rejected_late"] == 2


def test_an_aborted_device_is_closed_and_cannot_abort_again():
    core = RoundCore(1, RoundConfig(goal_count=3, over_selection=2.0), 0.0)
    core.try_select("a", 0.0)
    assert core.abort("a", 1.0)
    assert not core.abort("a", 1.0)
    assert not core.abort("nobody", 1.0)
    assert core.report("a", 1.0) is ReportVerdict.CLOSED
    assert core.stats(1.0)["aborted"] == 1


@given(lo=st.integers(0, 100).map(float), spread=st.integers(0, 100).map(float))
def test_a_retry_window_may_be_a_single_instant_but_not_reversed(lo, spread):
    assert RoundConfig(retry_window_s=(lo, lo + spread)).retry_window_s == (lo, lo + spread)
    if spread:
        with pytest.raises(ValueError):
            RoundConfig(retry_window_s=(lo + spread, lo))


def test_a_config_dict_is_plain_json():
    """What the server stores and sends: lists, not tuples, and it survives a JSON round trip."""
    cfg = RoundConfig(retry_window_s=(1.0, 2.0), max_rounds=3, clip_update_norm=None)
    data = cfg.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["retry_window_s"] == [1.0, 2.0]
    assert RoundConfig.from_dict(data) == cfg
