"""Pace steering of an idle population (paper, sec. 2.3: devices connect "as frequently as needed
to run all scheduled FL tasks, but not more"): a population with no task, or whose tasks all
completed, asks its devices back the less often the longer it has been idle, up to an hour, and a
task deployed into it is taken at the first check-in that comes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from device_runtime import encode_checkpoint, initial_weights
from device_runtime.plan import serialize_plan
from device_runtime.wire import CheckinAccepted, CheckinRejected
from server_stub.admission import IDLE_RETRY_MAX_S, IDLE_RETRY_WINDOW_S, idle_window
from server_stub.persistence import ServerStore
from server_stub.rounds import RoundConfig
from server_stub.service import FLService
from tests.server_stub.test_defects import update_of
from tests.support import digits_plan

HOUR = 3600.0
DAY = 24 * HOUR


@given(st.floats(0.0, 1e7), st.floats(0.0, 1e7))
def test_the_idle_window_grows_with_the_time_idle_between_its_first_and_its_longest(a, b):
    early, late = idle_window(min(a, b)), idle_window(max(a, b))
    for lo, hi in (early, late):
        assert IDLE_RETRY_WINDOW_S[0] <= lo <= hi <= IDLE_RETRY_MAX_S
    assert early[0] <= late[0] and early[1] <= late[1]


def _service(tmp_path, now: list[float]) -> tuple[ServerStore, FLService]:
    store = ServerStore(tmp_path / "server.db")
    return store, FLService(store, clock=lambda: now[0])


def _deploy(service: FLService, name: str) -> None:
    plan = digits_plan()
    config = RoundConfig(goal_count=1, over_selection=1.0, min_reports=1, max_rounds=1, selection_timeout_s=DAY)
    service.deploy_task("pop", name, serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), config)


def _window(service: FLService, population: str = "pop") -> tuple[float, float]:
    answer = service.checkin(population, "1.31.1")
    assert isinstance(answer, CheckinRejected) and answer.reason == "NO_TASK" and answer.retry_after_s is not None
    return answer.retry_after_s


def test_a_population_whose_task_completed_asks_its_devices_back_less_often_and_takes_a_new_task_at_once(tmp_path):
    now = [0.0]
    store, service = _service(tmp_path, now)
    try:
        service.create_population("pop")
        _deploy(service, "first")
        now[0] = 10 * HOUR  # the task ran long: its population was not idle meanwhile
        seat = service.checkin("pop", "1.31.1")
        assert isinstance(seat, CheckinAccepted)
        assert service.report(
            seat.session_id, seat.token, encode_checkpoint(update_of(digits_plan()))
        ).round_status == ("committed")
        assert service.task_states("pop") == {"first": {"status": "completed"}}
        assert _window(service) == IDLE_RETRY_WINDOW_S  # idle from the commit on, not from the start
        now[0] += HOUR
        hour = _window(service)
        assert hour[1] >= 4 * IDLE_RETRY_WINDOW_S[1]  # a quarter of an hour, not three minutes
        now[0] += 100 * HOUR
        assert _window(service)[1] == IDLE_RETRY_MAX_S  # a deploy is learnt of within the hour
        _deploy(service, "second")
        assert isinstance(service.checkin("pop", "1.31.1"), CheckinAccepted)
    finally:
        store.close()


def test_a_population_without_a_task_is_answered_as_one_that_does_not_exist_however_long_idle(tmp_path):
    now = [0.0]
    store, service = _service(tmp_path, now)
    try:
        service.create_population("pop")
        assert _window(service) == _window(service, "nobody") == IDLE_RETRY_WINDOW_S
        now[0] = 100 * HOUR
        assert _window(service) == _window(service, "nobody") == (IDLE_RETRY_MAX_S / 3, IDLE_RETRY_MAX_S)
    finally:
        store.close()
