"""Pace steering in the service: a crowd checking in far faster than its rounds need is told to
wait longer than the task's retry window, participants as well as those turned away; a trickle
keeps the task's window, and its participants come back at their own pace."""

from __future__ import annotations

from device_runtime import encode_checkpoint, initial_weights
from device_runtime.plan import serialize_plan
from device_runtime.wire import CheckinAccepted, CheckinRejected, ReportAnswer
from server_stub.persistence import ServerStore
from server_stub.rounds import RoundConfig
from server_stub.service import FLService
from tests.server_stub.test_defects import update_of
from tests.support import digits_plan

BASE = (10.0, 30.0)


def _rejections(
    tmp_path, gap_s: float, checkins: int, *, reports: list[ReportAnswer] | None = None
) -> list[tuple[float, float]]:
    """Windows handed to check-ins ``gap_s`` apart; rounds take two devices that never report,
    so each lasts its report time-out (60 s) and needs 2 * 1.5 / 60 check-ins per second.
    ``reports``, if given, receives the answers of two devices that then check in and report."""
    now = [0.0]
    tmp_path.mkdir(parents=True, exist_ok=True)
    store = ServerStore(tmp_path / "server.db")
    service = FLService(store, clock=lambda: now[0])
    service.create_population("pop")
    plan = digits_plan()
    config = RoundConfig(
        goal_count=2,
        over_selection=1.0,
        selection_timeout_s=600.0,
        report_timeout_s=60.0,
        retry_window_s=BASE,
        min_reports=1,
    )
    service.deploy_task("pop", "train", serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), config)
    windows = []
    try:
        for _ in range(checkins):
            answer = service.checkin("pop", "1.31.1")
            if isinstance(answer, CheckinRejected):
                assert answer.reason == "ROUND_FULL" and answer.retry_after_s is not None
                windows.append(answer.retry_after_s)
            now[0] += gap_s
        if reports is not None:
            sessions: list[CheckinAccepted] = []  # two devices of one round, once the round under way times out
            while len(sessions) < 2:
                answer = service.checkin("pop", "1.31.1")
                if isinstance(answer, CheckinAccepted):
                    sessions.append(answer)
                else:
                    sessions, now[0] = [], now[0] + 61.0
            reports.extend(service.report(a.session_id, a.token, encode_checkpoint(update_of(plan))) for a in sessions)
    finally:
        store.close()
    return windows


def test_a_crowd_is_spread_over_a_longer_wait_and_a_trickle_keeps_the_tasks_window(tmp_path):
    crowd = _rejections(tmp_path / "crowd", gap_s=0.05, checkins=4000)  # 400 times what rounds need
    trickle = _rejections(tmp_path / "trickle", gap_s=30.0, checkins=100)  # two thirds of it
    width = BASE[1] - BASE[0]
    # the trickle's windows are the task's own, shifted to the next round at most
    assert trickle and all(abs((hi - lo) - width) < 1e-6 and lo >= BASE[0] for lo, hi in trickle)
    assert all(hi - lo >= width - 1e-6 and lo >= BASE[0] for lo, hi in crowd)
    lo, hi = crowd[-1]
    assert hi - lo > 10 * width  # spread over a wait many times the task's own


def test_participants_of_a_crowd_are_told_its_wait_and_those_of_a_trickle_nothing(tmp_path):
    crowd: list[ReportAnswer] = []
    trickle: list[ReportAnswer] = []
    crowd_windows = _rejections(tmp_path / "crowd", gap_s=0.05, checkins=4000, reports=crowd)
    _rejections(tmp_path / "trickle", gap_s=30.0, checkins=100, reports=trickle)
    assert [a.status for a in crowd + trickle] == ["accepted"] * 4
    assert all("retry_after_s" not in a.model_fields_set for a in trickle)  # they come back at their own cooldown
    for answer in crowd:
        assert answer.retry_after_s is not None
        lo, hi = answer.retry_after_s
        assert hi - lo > 10 * (BASE[1] - BASE[0]) and lo >= crowd_windows[-1][0] * 0.5
