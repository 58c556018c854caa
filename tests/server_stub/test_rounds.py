"""The round state machine, driven by random schedules of check-ins, reports, aborts and time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server_stub.rounds import Phase, ReportVerdict, RoundConfig, RoundCore, SessionState


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


events = st.lists(
    st.tuples(st.sampled_from(["checkin", "report", "abort", "wait"]), st.integers(0, 30), st.floats(0, 4)),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(
    goal=st.integers(1, 8),
    over=st.sampled_from([1.0, 1.3, 2.0]),
    min_fraction=st.sampled_from([0.5, 0.8, 1.0]),
    script=events,
)
def test_round_invariants(goal, over, min_fraction, script):
    cfg = RoundConfig(goal_count=goal, over_selection=over, min_fraction=min_fraction, selection_timeout_s=20, report_timeout_s=6)
    core = RoundCore(1, cfg, 0.0)
    now = 0.0
    accepted: set[str] = set()
    for kind, who, dt in script:
        sid = f"s{who}"
        was_open = core.open
        if kind == "wait":
            now += dt
            core.advance(now)
        elif kind == "checkin":
            if sid in core.sessions:
                continue
            ok = core.try_select(sid, now)
            assert ok == (was_open and core.sessions.get(sid) is SessionState.SELECTED)
        elif kind == "report":
            verdict = core.report(sid, now)
            if verdict is ReportVerdict.ACCEPT:
                assert core.open and sid not in accepted
                assert now <= core.deadlines[sid]
                accepted.add(sid)
                core.confirm_report(sid, now)
            elif sid in accepted:
                assert verdict is ReportVerdict.DUPLICATE
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
    # Time alone always closes a round eventually.
    core.advance(now + cfg.selection_timeout_s + cfg.report_timeout_s + 1)
    assert not core.open
