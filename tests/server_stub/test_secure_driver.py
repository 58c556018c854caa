"""The Master Aggregator's part of a Secure Aggregation round (``secure_driver.advance_secure``):
groups that finish in the same tick, against the real service, its SQLite store and real SecAgg
clients, on a clock the test moves."""

from __future__ import annotations

import base64

import numpy as np
import onnxruntime
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from device_runtime import decode_checkpoint, encode_checkpoint, initial_weights
from device_runtime.plan import serialize_plan
from device_runtime.secure_sum import SecureSumCodec, config_from_json
from device_runtime.wire import CheckinAccepted
from secagg import SecAggClient, parse_message
from secagg.messages import (
    AdvertiseKeys,
    ConsistencySignature,
    EncryptedShares,
    MaskedInput,
    ShareCheck,
    UnmaskResponse,
)
from server_stub.errors import ApiError
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
        plan = self.plan = digits_plan("softmax", secure_aggregation=True)
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
        self.start = initial_weights(plan, seed=0)
        self.service.deploy_task("pop", "train", serialize_plan(plan), encode_checkpoint(self.start), config)
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
        self.answer()

    def answer(self) -> None:
        """Every device answers what its group sent it since (``run``)."""
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


#: the messages a device sends, in the order of the rounds it sends them in (ConsistencyCheck on)
SENT = {
    "AdvertiseKeys": lambda tag: AdvertiseKeys(tag, bytes(range(1, 33)), bytes(range(2, 34))),
    "ShareKeys": EncryptedShares,
    "ShareCheck": ShareCheck,
    "MaskedInputCollection": lambda tag: MaskedInput(tag, bytes(8)),
    "ConsistencyCheck": lambda tag: ConsistencySignature(tag, bytes(64)),
    "Unmasking": UnmaskResponse,
}
ROUNDS = list(SENT)
#: what the meddler sends before its answer (or instead of it): a stand-in message of any round's
#: kind, its answer again, or the answer of a peer of its group or of a device of the other group
MEDDLES = [*ROUNDS, "replay", "peer", "other group"]


class Meddled(Devices):
    """``Devices`` in which the last of group 0 to answer sends ``meddle`` in protocol round
    ``at``, then its answer (``answers``) or nothing more; every answer it gets is kept."""

    def __init__(self, tmp_path, at: str, meddle: str, answers: bool) -> None:
        super().__init__(tmp_path)
        self.meddler = max(self.groups[0])
        self.at, self.meddle, self.answers = at, meddle, answers
        self.last: dict[int, bytes] = {}  # each device's last answer
        self.answered: list[tuple[int, str]] = []  # (status, code) of each of its messages from round ``at`` on
        self.meddled = self.silent = False

    def send(self, i: int, data: bytes) -> None:
        if i != self.meddler:
            super().send(i, data)
            self.last[i] = data
            return
        if self.silent:
            return
        if self.status(i)["round"] == self.at and not self.meddled:  # the meddling, then its answer
            self.meddled = True
            self.tell(self.meddling(data))
            self.silent = not self.answers
            if self.silent:
                return
        self.tell(data)

    def meddling(self, answer: bytes) -> bytes:
        if self.meddle == "replay":
            return answer
        if self.meddle == "peer":  # a peer of its group answered this round before it
            return self.last[next(i for i in self.groups[0] if i != self.meddler)]
        if self.meddle == "other group":  # this round's message for the other group's session
            tag = config_from_json(self.status(self.groups[1][0])["config"]).session_tag
            return SENT[self.at](tag).to_bytes()
        return SENT[self.meddle](parse_message(answer).session_tag).to_bytes()

    def tell(self, data: bytes) -> None:
        s = self.sessions[self.meddler]
        try:
            self.service.secagg_message(s.session_id, s.token, data)
            answer = (200, "accepted")
        except ApiError as exc:
            answer = (exc.status, exc.code)
        if self.meddled:
            self.answered.append(answer)

    def settle(self) -> None:
        """Run the devices, moving the clock a second at a time while they wait, until the round is on record."""
        self.run()
        while not self.service.rounds("pop") and self.now < 90.0:
            self.now += 1.0
            self.service.tick()
            self.answer()


def expected_answer(at: str, meddle: str) -> tuple[int, str]:
    """What the meddler is told: a message of a round its group has moved past is late (409); any
    other it sends before its answer is refused (400), its own answer again is taken again."""
    if meddle == "replay":
        return 200, "accepted"
    if meddle in ROUNDS and ROUNDS.index(meddle) < ROUNDS.index(at):
        return 409, "SECAGG_ROUND_CLOSED"
    return 400, "SECAGG_REJECTED"


meddles = dict(at=st.sampled_from(ROUNDS), meddle=st.sampled_from(MEDDLES), answers=st.booleans())


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**meddles)
@example(at="ShareKeys", meddle="Unmasking", answers=True)  # an unmasking response before any masked input
@example(at="Unmasking", meddle="MaskedInputCollection", answers=True)  # a masked input after its round
@example(at="MaskedInputCollection", meddle="other group", answers=False)
def test_a_meddling_device_is_told_why_and_every_honest_device_is_summed_exactly(tmp_path_factory, at, meddle, answers):
    _one_meddling_device(tmp_path_factory, at, meddle, answers)


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**meddles)
def test_a_meddling_device_is_told_why_and_every_honest_device_is_summed_exactly_long_run(
    tmp_path_factory, at, meddle, answers
):
    _one_meddling_device(tmp_path_factory, at, meddle, answers)


def _one_meddling_device(tmp_path_factory, at: str, meddle: str, answers: bool) -> None:
    """One device of group 0, once its group is in round ``at``, sends one well-formed message that
    is not its answer (a stand-in of any round's kind, a peer's answer, another group's), or its
    answer twice, then its answer or nothing more. It is told a stable 4xx that says whether its
    group moved past that message, never a 5xx; every honest device is summed, and the round
    commits exactly the sum of the devices its groups say they summed."""
    d = Meddled(tmp_path_factory.mktemp("meddled"), at, meddle, answers)
    d.settle()
    told = expected_answer(at, meddle)
    assert d.answered[0] == told and all(s == 200 or 400 <= s < 500 for s, _ in d.answered), (at, meddle, d.answered)
    record = d.service.rounds("pop")[0]
    states = [d.status(i) for i in range(DEVICES)]
    included = [i for i, s in enumerate(states) if s["status"] == "completed" and s["included"]]
    honest = [i for g in d.groups.values() for i in g if i != d.meddler]
    # a group of four goes on with three: every honest device is summed, and the round commits
    assert set(honest) <= set(included), states
    assert record["status"] == "committed" and record["metrics"]["reported"] == len(included)
    # the meddler answers last in its group: refused (400), it is not waited for, and its group's
    # round closes without it; its masked input is summed when it was in before
    masked = ROUNDS.index(at) - ROUNDS.index("MaskedInputCollection")  # > 0: its masked input was in
    if meddle == "replay":  # its answer, sent twice: then it answers the rest, or stops there
        summed = answers or masked >= 0
    else:
        summed = masked > 0 or (answers and told[0] != 400)
    assert (d.meddler in included) == summed, (at, meddle, answers, d.answered)
    body, number, _ = d.service.current_model("pop")
    assert number == 1
    model = decode_checkpoint(body)
    codec = SecureSumCodec(d.plan)
    total = codec.decode_sum(np.sum([d.vectors[i].astype(np.int64) for i in included], axis=0), len(included))
    for name in d.plan.weight_names:
        np.testing.assert_allclose(
            model[name], d.start[name] + total[name] / total["num_examples"], rtol=1e-5, atol=1e-6
        )
