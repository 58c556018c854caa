"""The Master Aggregator's part of a Secure Aggregation round (``secure_driver.advance_secure``):
groups that finish in the same tick, against the real service, its SQLite store and real SecAgg
clients, on a clock the test moves."""

from __future__ import annotations

import base64

import onnxruntime
import pytest

from device_runtime import encode_checkpoint, initial_weights
from device_runtime.plan import serialize_plan
from device_runtime.secure_sum import SecureSumCodec, config_from_json
from device_runtime.wire import CheckinAccepted
from secagg import SecAggClient
from server_stub.persistence import ServerStore
from server_stub.rounds import RoundConfig
from server_stub.secure_rounds import ROUND_ABANDONED
from server_stub.service import FLService
from tests.server_stub.test_secure_rounds_http import _updates
from tests.support import digits_plan

VERSION = onnxruntime.__version__
DEVICES = 8  # two groups of four, at least three summed in each


class Devices:
    """A service with one secure task and ``DEVICES`` devices selected for its round, each a real
    SecAgg client of its group that answers its group's messages unless ``silent_in`` says so."""

    def __init__(self, tmp_path) -> None:
        self.now = 0.0
        self.service = FLService(ServerStore(tmp_path / "server.db"), clock=lambda: self.now)
        self.reported: list[str] = []
        self.service.on_reported = self.reported.extend
        self.service.create_population("pop")
        plan = digits_plan("softmax", secure_aggregation=True)
        config = RoundConfig(
            goal_count=DEVICES,
            over_selection=1.0,
            min_fraction=0.8,  # commits at 7 reports: one group of four alone is abandoned
            selection_timeout_s=60.0,
            report_timeout_s=60.0,
            secagg_min_group_size=3,
            secagg_target_group_size=4,
            secagg_round_timeout_s=5.0,
            min_reports=1,
        )
        self.service.deploy_task(
            "pop", "train", serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), config
        )
        self.sessions = [self.service.checkin("pop", VERSION) for _ in range(DEVICES)]
        assert all(isinstance(s, CheckinAccepted) for s in self.sessions)
        codec = SecureSumCodec(plan)
        self.vectors = [codec.encode(u) for u in _updates(codec, DEVICES, seed=3)]
        states = [self.status(i) for i in range(DEVICES)]
        self.groups: dict[int, list[int]] = {}
        for i, state in enumerate(states):
            self.groups.setdefault(state["group"], []).append(i)
        assert sorted(map(len, self.groups.values())) == [4, 4]
        self.clients = [
            SecAggClient(state["client_id"], config_from_json(state["config"]), self.vectors[i])
            for i, state in enumerate(states)
        ]
        self.seen = [0] * DEVICES
        self.silent_in: dict[int, str] = {}  # device -> the protocol round it does not answer

    def status(self, i: int) -> dict:
        s = self.sessions[i]
        return self.service.secagg_status(s.session_id, s.token)

    def send(self, i: int, data: bytes) -> None:
        s = self.sessions[i]
        self.service.secagg_message(s.session_id, s.token, data)

    def run(self) -> None:
        """Every device answers what its group sent it until none has anything more to answer."""
        for i, client in enumerate(self.clients):
            self.send(i, client.start())
        moved = True
        while moved:
            moved = False
            for i, client in enumerate(self.clients):
                state = self.status(i)
                if state["status"] != "active" or state["seq"] == self.seen[i] or not state["message"]:
                    continue
                if self.silent_in.get(i) == state["round"]:
                    continue
                self.seen[i] = state["seq"]
                moved = True
                reply = client.handle(base64.b64decode(state["message"]))
                if reply is not None:
                    self.send(i, reply)


@pytest.mark.parametrize("closes_at", ["masked-inputs-deadline", "devices-deadline", "hours-later"])
def test_a_group_that_completed_in_time_counts_however_late_the_tick_that_finds_it(tmp_path, closes_at):
    """Group 0 never sends its masked inputs: it aborts at their deadline, and its aborts leave the
    round short of its threshold. Group 1 sums all four of its masked inputs and waits in Unmasking
    for one silent device, until its Unmasking round is due (5 s after the masked inputs' deadline,
    10 s before the devices'). Whenever the tick that finds both comes (at once, or only after the
    devices' deadlines passed: a busy or paused server), group 1 ended before the round closed: its
    devices count as reported before group 0's aborts close the round. The round is abandoned all
    the same, so group 1's sum went unused: its statistics count no completed group, and say why."""
    d = Devices(tmp_path)
    aborting, completing = d.groups[0], d.groups[1]
    d.silent_in = {i: "MaskedInputCollection" for i in aborting} | {completing[0]: "Unmasking"}
    d.run()
    assert {d.status(i)["round"] for i in aborting} == {"MaskedInputCollection"}
    assert {d.status(i)["round"] for i in completing} == {"Unmasking"}
    assert d.reported == []

    # the masked inputs' deadline is 60 s after selection, the devices' 15 s later (three round timeouts)
    d.now = {"masked-inputs-deadline": 61.0, "devices-deadline": 76.0}.get(closes_at, 7200.0)
    d.service.tick()

    (record,) = d.service.rounds("pop")
    metrics = record["metrics"]
    assert record["status"] == "abandoned"
    secagg = metrics["secagg"]
    assert secagg["groups"] == 2 and secagg["aborted"] == 1
    assert secagg["aborted_in"] == {"MaskedInputCollection": 1}
    assert sorted(d.reported) == sorted(d.sessions[i].session_id for i in completing)
    assert {d.status(i)["status"] for i in completing} == {"completed"}
    # the round was abandoned: no group's sum was used, and the one counted says so
    assert secagg["completed"] == 0 and secagg["dropped"] == [{"group": 1, "reason": ROUND_ABANDONED}]
    # what the round counts as reported is what its completed groups summed
    assert metrics["reported"] == secagg["summed_devices"] == len(d.reported) == 4


def test_a_committed_rounds_groups_count_as_completed(tmp_path):
    """Both groups sum all their masked inputs, the second one completing the round: both sums are used."""
    d = Devices(tmp_path)
    d.run()
    (record,) = d.service.rounds("pop")
    assert record["status"] == "committed"
    secagg = record["metrics"]["secagg"]
    assert secagg["completed"] == 2 and secagg["dropped"] == [] and secagg["summed_devices"] == DEVICES
