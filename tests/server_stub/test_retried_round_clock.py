"""A check-in that waits for the service while a retried round opens is seated in that round at the
time it gets in, not at the time it arrived: its report window starts when it was selected, and
nothing of it is dated in the attempt before."""

from __future__ import annotations

import threading

from device_runtime import encode_checkpoint, initial_weights
from device_runtime.plan import serialize_plan
from device_runtime.wire import CheckinAccepted
from server_stub.persistence import ServerStore
from server_stub.rounds import RoundConfig
from server_stub.service import FLService
from tests.server_stub.test_defects import update_of
from tests.support import digits_plan


def test_a_checkin_that_waited_while_a_retried_round_opened_gets_that_rounds_whole_report_window(tmp_path):
    now = [0.0]
    store = ServerStore(tmp_path / "server.db")
    service = FLService(store, clock=lambda: now[0])
    plan = digits_plan()
    config = RoundConfig(
        goal_count=2,
        over_selection=1.0,
        min_reports=1,
        min_fraction=0.5,
        selection_timeout_s=10.0,
        report_timeout_s=60.0,
    )
    answers: list[object] = []
    try:
        service.create_population("pop")
        service.deploy_task("pop", "t", serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), config)
        now[0] = 9.0  # the first attempt is selecting; a device checks in as another request holds the service
        with service._lock:
            device = threading.Thread(target=lambda: answers.append(service.checkin("pop", "1.31.1")))
            device.start()
            device.join(0.5)  # it has read the clock and waits for the lock
            assert device.is_alive()
            now[0] = 10.0  # meanwhile the first attempt times out, nobody came, and the retry opens
            service.tick()
        device.join(5.0)
        (seat,) = answers
        assert isinstance(seat, CheckinAccepted) and seat.round == 1
        assert service.population_status("pop")["current_round"]["selected"] == 1  # in the retried round
        now[0] = 10.0 + 60.0  # the last moment of the window the device was given as it was selected
        answer = service.report(seat.session_id, seat.token, encode_checkpoint(update_of(plan)))
        assert answer.status == "accepted"
    finally:
        store.close()
