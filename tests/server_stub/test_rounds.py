"""The round state machine, driven by random schedules of check-ins, reports, aborts and time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server_stub.rounds import Phase, ReportVerdict, RoundConfig, RoundCore, SessionState
from server_stub.secure_rounds import SecureSettings


def test_commits_as_soon_as_goal_reports():
    cfg = RoundConfig(goal_count=3, over_selection=1.3, report_timeout_s=10)
    core = RoundCore(1, cfg, started_at=0.0)
    for i in range(cfg.selection_target):
        assert core.try_select(f"s{i}", 0.1)
    assert cfg.selection_target == 4
    assert core.phase is Phase.REPORTING
    assert not core.try_select("extra", 0.2)
    for i in range(3):
        assert core.report(f"s{i}", 1.0) is ReportVerdict.ACCEPT
        core.confirm_report(f"s{i}", 1.0)
    assert core.phase is Phase.COMMITTED
    assert core.report("s3", 1.5) is ReportVerdict.LATE
    assert core.report("s0", 1.5) is ReportVerdict.DUPLICATE
    assert core.report("nobody", 1.5) is ReportVerdict.UNKNOWN


def test_late_report_is_refused_and_round_commits_with_min_fraction():
    cfg = RoundConfig(goal_count=4, min_fraction=0.5, report_timeout_s=5)
    core = RoundCore(1, cfg, 0.0)
    for i in range(cfg.selection_target):
        core.try_select(f"s{i}", 0.0)
    for i in range(2):
        core.report(f"s{i}", 1.0)
        core.confirm_report(f"s{i}", 1.0)
    assert core.phase is Phase.REPORTING
    assert core.report("s2", 6.0) is ReportVerdict.LATE
    core.advance(6.0)
    assert core.phase is Phase.COMMITTED
    stats = core.stats(6.0)
    assert stats["selected"] == 6  # ceil(4 * 1.3)
    assert stats["reported"] == 2 and stats["rejected_late"] == 1 and stats["dropped"] == 3


def test_abandoned_when_too_few_can_still_report():
    cfg = RoundConfig(goal_count=2, min_fraction=1.0, report_timeout_s=5)
    core = RoundCore(1, cfg, 0.0)
    for i in range(cfg.selection_target):
        core.try_select(f"s{i}", 0.0)
    assert core.abort("s0", 1.0)
    assert core.phase is Phase.REPORTING
    assert core.abort("s1", 1.0)
    assert core.phase is Phase.ABANDONED
    assert core.report("s2", 1.1) is ReportVerdict.LATE


def test_selection_timeout_with_too_few_devices_abandons():
    cfg = RoundConfig(goal_count=10, min_fraction=0.8, selection_timeout_s=3)
    core = RoundCore(1, cfg, 0.0)
    for i in range(5):
        core.try_select(f"s{i}", 1.0)
    assert core.advance(3.5) is Phase.ABANDONED


def test_config_validation_and_round_trip():
    cfg = RoundConfig(goal_count=5, retry_window_s=(1, 2), max_rounds=3)
    assert RoundConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError):
        RoundConfig(goal_count=0)
    with pytest.raises(ValueError):
        RoundConfig.from_dict({"goal_count": "ten"})
    with pytest.raises(ValueError):
        RoundConfig.from_dict({"bogus": 1})
    with pytest.raises(ValueError):
        RoundConfig(over_selection=0.9)


#: A report is sent at its device's deadline plus an offset (or, with None, at the current time):
#: the exact boundary and a hair either side of it are where a wrong comparison hides.
NEAR_DEADLINE = st.floats(-3.0, 3.0) | st.sampled_from([None, -1e-6, 0.0, 1e-6])

#: (kind, who, argument, ticked). A report's ``who`` below 12 picks one of the devices that
#: checked in (so most reports come from a selected device), 12 is a device that never did;
#: ``ticked``: the server's ticker ran at the report's time before the report arrived.
events = st.lists(
    st.one_of(
        st.tuples(st.just("checkin"), st.integers(0, 15), st.none(), st.just(False)),
        st.tuples(st.just("report"), st.integers(0, 12), NEAR_DEADLINE, st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 15), st.none(), st.just(False)),
        st.tuples(st.just("wait"), st.just(0), st.floats(0, 4), st.just(False)),
    ),
    min_size=20,
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    goal=st.integers(1, 8),
    over=st.sampled_from([1.0, 1.3, 2.0]),
    min_fraction=st.sampled_from([0.5, 0.8, 1.0]),
    selection_timeout=st.sampled_from([3.0, 20.0]),
    report_timeout=st.sampled_from([2.0, 6.0]),
    secure=st.booleans(),
    script=events,
)
def test_round_invariants_and_a_report_is_late_exactly_when_past_its_deadline(
    goal, over, min_fraction, selection_timeout, report_timeout, secure, script
):
    """Devices check in at different times, so one device's deadline passes while others (or
    selection) keep the round open; a report then is LATE exactly when ``now`` is past the
    device's own deadline, whatever else is going on in the round."""
    cfg = RoundConfig(
        goal_count=goal,
        over_selection=over,
        min_fraction=min_fraction,
        selection_timeout_s=selection_timeout,
        report_timeout_s=report_timeout,
    )
    core = RoundCore(1, cfg, 0.0, deadlines_from_selection_end=secure)
    now = 0.0
    accepted: set[str] = set()
    for kind, who, arg, ticked in script:
        sid = f"s{who}"
        if kind == "report":
            checked_in = list(core.sessions)
            sid = checked_in[who % len(checked_in)] if checked_in and who < 12 else "never-checked-in"
            if arg is not None and sid in core.deadlines:
                now = max(now, core.deadlines[sid] + arg)
            if ticked:
                core.advance(now)
        was_open = core.open
        if kind == "wait":
            now += arg
            core.advance(now)
        elif kind == "checkin":
            if sid in core.sessions:
                continue
            ok = core.try_select(sid, now)
            assert ok == (was_open and core.sessions.get(sid) is SessionState.SELECTED)
        elif kind == "report":
            state = core.sessions.get(sid)
            deadline = core.deadlines.get(sid)
            verdict = core.report(sid, now)
            if state is SessionState.SELECTED:
                if was_open:
                    assert verdict in (ReportVerdict.ACCEPT, ReportVerdict.LATE)
                    assert (verdict is ReportVerdict.LATE) == (now > deadline), (now, deadline, verdict)
                else:
                    assert verdict is ReportVerdict.LATE
            if verdict is ReportVerdict.ACCEPT:
                assert core.open and sid not in accepted
                assert now <= core.deadlines[sid]
                accepted.add(sid)
                core.confirm_report(sid, now)
            elif sid in accepted:
                assert verdict is ReportVerdict.DUPLICATE
            elif state is None:
                assert verdict is ReportVerdict.UNKNOWN
        else:
            core.abort(sid, now)
        assert len(core.sessions) <= cfg.selection_target
        assert core.reported == len(accepted) <= cfg.goal_count
        if core.phase is Phase.COMMITTED:
            assert core.reported >= cfg.commit_threshold
        if core.phase is Phase.ABANDONED:
            assert core.reported < cfg.goal_count
        if core.reported >= cfg.goal_count:
            assert core.phase is Phase.COMMITTED
    # Time alone always closes a round eventually. With deadlines counted from selection's end,
    # the advance that ends selection sets them, so a second one is needed to pass them.
    now += cfg.selection_timeout_s + cfg.report_timeout_s + 1
    core.advance(now)
    if secure:
        core.advance(now + cfg.report_timeout_s + 1)
    assert not core.open


def test_the_checkin_that_fills_a_round_abandons_it_at_once_when_aborts_left_it_short():
    cfg = RoundConfig(goal_count=2, over_selection=1.0, min_fraction=1.0, selection_timeout_s=60, report_timeout_s=60)
    core = RoundCore(1, cfg, 0.0)
    assert core.try_select("a", 1.0)
    assert core.abort("a", 2.0)
    assert core.try_select("b", 3.0)  # the last seat: selection ends, and two reports can no longer come
    assert core.phase is Phase.ABANDONED and core.ended_at == 3.0


def test_a_secure_rounds_masked_inputs_are_due_at_its_report_window_and_its_last_rounds_fit_after_it():
    """Under Secure Aggregation the report window (from selection's end) is the masked inputs'
    deadline; ConsistencyCheck and Unmasking, a round timeout each and one for the server's tick,
    come after it, before the sessions' deadlines close the round (they came out of the window, and
    a group that waited for its slowest device timed out in Unmasking as the round closed)."""
    cfg = RoundConfig(goal_count=5, over_selection=1.0, report_timeout_s=180.0, secagg_round_timeout_s=10.0)
    settings = SecureSettings.for_config(cfg)
    assert settings.finalization_s == 30.0 and settings.min_group_size == 5 and settings.spare == 95
    core = RoundCore(1, cfg, 0.0, deadlines_from_selection_end=True, finalization_s=settings.finalization_s)
    assert core.deadline_of("a") == cfg.selection_timeout_s + 180.0 + 30.0  # the latest, while selecting
    for i in range(5):
        assert core.try_select(f"s{i}", 4.0 * i)
    assert core.phase is Phase.REPORTING and set(core.deadlines.values()) == {16.0 + 180.0 + 30.0}
    without_check = SecureSettings.for_config(RoundConfig(secagg_consistency_check=False, secagg_round_timeout_s=4.0))
    assert without_check.finalization_s == 8.0


def test_groups_without_consistency_check_take_the_graph_devices_accept():
    """A task with ``secagg_consistency_check`` off and groups of 370 devices or more made them
    SecAgg+ groups, which every device refuses without ConsistencyCheck: no such group summed."""
    from device_runtime.secagg_policy import SecAggPolicy
    from secagg import SecAggConfig

    for check in (False, True):
        settings = SecureSettings.for_config(RoundConfig(secagg_consistency_check=check, secagg_target_group_size=400))
        config = SecAggConfig.for_cohort(  # as SecureRound makes each group's
            400,
            8,
            secagg_plus=settings.secagg_plus,
            consistency_check=settings.consistency_check,
            min_summed=settings.min_group_size,
            graph_commitment=bytes(32),
        )
        assert SecAggPolicy(require_consistency_check=check).violation(config, 400) is None
