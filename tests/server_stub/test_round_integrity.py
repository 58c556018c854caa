"""The server's round bookkeeping against what a long run, a hostile device and a locked database
do to it: seats belong to one round however many rounds came before, device metrics mean what they
say, every task that publishes needs ``min_reports`` devices, and a round whose record cannot be
written is neither lost nor reported as committed. Driven through FLService on a fake clock, over
real SQLite files."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import math
import sqlite3
import tempfile
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy.exc import OperationalError

from device_runtime import build_eval_plan, decode_checkpoint, encode_checkpoint, initial_weights, serialize_plan
from device_runtime.eligibility import EligibilityPolicies
from device_runtime.plan import installed_runtime_version
from device_runtime.wire import CheckinAccepted, CheckinRejected
from emulator import AttestationAuthority
from server_stub import (
    ApiError,
    AttestationVerifier,
    FLService,
    NonceRegistry,
    RateLimiter,
    RoundConfig,
    ServerStore,
    TaskSpec,
)
from server_stub.commit import WRITE_RETRY_FIRST_S
from server_stub.metrics import MetricsOutOfRange, cap_metric_weight, check_metric_sums, hold_loss
from server_stub.persistence import NewTask
from tests.server_stub import test_defects
from tests.server_stub.test_defects import CONFIG, POP, Server, update_of
from tests.support import digits_plan

#: test_defects' server fixture, shared by this module's HTTP tests
server = test_defects.server
WALL = 1.7e9
#: An empty round is abandoned one second after it opened.
EMPTY_ROUNDS = RoundConfig(
    goal_count=5, over_selection=1.0, min_fraction=1.0, selection_timeout_s=1.0, report_timeout_s=60.0
)
#: Rounds the address-reuse test may run before it gives up building its condition (the tester saw
#: a round take a freed round's address after 58 to 82 empty rounds), and how many rounds after
#: its seat the device takes a seat again when no round has taken that seat's round's address.
MAX_EMPTY_ROUNDS, RESEAT_AFTER = 3000, 12


# 4: seats --------------------------------------------------------------------------------------


def test_an_attested_device_gets_a_seat_in_a_round_whose_object_took_a_freed_rounds_address(tmp_path):
    """The seats of attested devices were keyed by ``id()`` of the round's object: once a run of
    empty rounds freed that object and a new round's object took its address, the device that had
    a seat in the old round was turned away from the new one (ALREADY_SELECTED). The device takes
    a seat, rounds go by empty, and it takes another seat every few rounds, until a round's object
    has the address of a freed round it had its last seat in; then it checks in to that round."""
    authority = AttestationAuthority.generate()
    verifier = AttestationVerifier(
        authority.trust_anchor(), NonceRegistry(ttl_s=1e9), RateLimiter(burst=1e6, rate_per_s=1e6)
    )
    clock = [0.0]
    store = ServerStore(tmp_path / "s.db")
    service = FLService(store, clock=lambda: clock[0], wall_clock=lambda: WALL + clock[0], verifier=verifier)
    plan = digits_plan()
    service.create_population(POP)
    service.deploy_task(
        POP, "train", serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), EMPTY_ROUNDS
    )
    device = authority.new_device_attestor("emulated-pixel", WALL - 10, 1e9)
    runtime = installed_runtime_version()

    def checkin() -> CheckinAccepted | CheckinRejected:
        nonce = base64.b64decode(service.attestation_challenge().nonce)
        return service.checkin(POP, runtime, attestation=device.attest(nonce, POP, runtime))

    def open_round() -> tuple[int, weakref.ref]:
        """The open round object's address, and a reference that does not keep it alive. A lone
        device is a small population: its next selection is deferred while devices gather, so
        time passes until it opens."""
        for _ in range(100):
            if service._populations[POP].current is not None:
                break
            clock[0] += 1.0
            service.tick()
        core = service._populations[POP].current.core
        return id(core), weakref.ref(core)

    seat: tuple[int, weakref.ref] | None = None
    seated_at = 0  # the round number of the seat, once there is one
    for number in range(MAX_EMPTY_ROUNDS):
        address, this_round = open_round()
        if seat is not None and seat[1]() is None and address == seat[0]:
            break  # the round of the device's last seat is gone, and this round took its address
        if seat is None or number - seated_at >= RESEAT_AFTER:
            assert checkin().status == "accepted"
            seat, seated_at = (address, this_round), number
        clock[0] += 1.0
        service.tick()  # the open round is abandoned (one device at most) and the next one opens
    else:
        pytest.fail(
            f"no round took a freed seat's round's address in {MAX_EMPTY_ROUNDS} rounds; the condition was not built"
        )
    answer = checkin()
    assert answer.status == "accepted", answer
    store.close()


# 5: device metrics -------------------------------------------------------------------------------

float32s = st.floats(width=32, allow_nan=False, allow_infinity=False)
metric_values = st.sampled_from([-4e27, -5.0, -1e-30, 0.0, 1e-30, 0.5, 1.0, 3.0, 10.0, 1e9, 4e27, 3.4e38]) | float32s


@st.composite
def metric_sums(draw) -> dict[str, np.ndarray]:
    """Any finite float32 metric sums, sometimes without ``count`` or ``correct``."""
    names = ["loss_sum", "num_examples"] + [n for n in ("correct", "count") if draw(st.booleans())]
    return {name: np.array(draw(metric_values), dtype=np.float32) for name in names}


def f64(update: dict, name: str) -> float:
    return float(np.asarray(update[name], dtype=np.float64))


@settings(max_examples=300, deadline=None)
@given(update=metric_sums(), max_count=st.integers(1, 10**6))
def test_metric_sums_are_refused_exactly_when_out_of_their_meaning_and_capped_to_max_examples_keeping_their_means(
    update, max_count
):
    counted = f64(update, "count" if "count" in update else "num_examples")
    honest = (
        all(f64(update, n) >= 0 for n in ("loss_sum", "correct", "count") if n in update)
        and ("correct" not in update or f64(update, "correct") <= counted)
        and not (counted == 0 and f64(update, "loss_sum") > 0)
    )
    try:
        check_metric_sums(update)
    except MetricsOutOfRange:
        assert not honest
        return
    assert honest
    capped, was_capped = cap_metric_weight(update, max_count)
    assert set(capped) == set(update) and all(v.dtype == np.float32 for v in capped.values())
    assert capped["num_examples"] == update["num_examples"]  # bound_update's to cap
    if "count" not in update:
        assert not was_capped and all(np.array_equal(capped[n], update[n]) for n in update)
        return
    count = f64(update, "count")
    assert was_capped == (count > max_count)
    assert 0 <= f64(capped, "count") <= max_count and f64(capped, "loss_sum") >= 0
    if "correct" in update:
        assert 0 <= f64(capped, "correct") <= f64(capped, "count")
    if was_capped:  # the device's mean loss and accuracy are kept, with the weight of max_count
        for name in ("loss_sum", "correct"):
            if name in update:
                kept = f64(capped, name) / max_count
                assert kept == pytest.approx(f64(update, name) / count, rel=1e-6, abs=1e-30 + 1e-6 * kept)


def published(service: FLService, prefix: str) -> tuple[dict, dict]:
    """The last round's published metrics and its device metrics."""
    metrics = service.rounds(POP)[-1]["metrics"]
    return metrics, metrics["device_metrics"]


HONEST_COUNT, HONEST = 10.0, dict(correct=5.0, loss_sum=10.0)  # accuracy 0.5, loss 1.0
BOUNDED = RoundConfig(
    goal_count=5,
    over_selection=1.2,
    min_fraction=1.0,
    selection_timeout_s=60.0,
    report_timeout_s=60.0,
    max_examples_per_report=10,
)


#: Hostile devices the published-metrics property draws in the default run (40 took 3.4 CPU-s), and in its slow twin.
HOSTILE_EXAMPLES = 15
SLOW_HOSTILE_EXAMPLES = 200
HOSTILE = metric_sums().filter(lambda u: "count" in u)


@settings(max_examples=HOSTILE_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["train", "eval"]), hostile=HOSTILE)
def test_one_device_cannot_push_a_rounds_published_loss_or_accuracy_out_of_range(kind, hostile):
    _one_hostile_device_among_honest_ones(kind, hostile)


@pytest.mark.slow
@settings(max_examples=SLOW_HOSTILE_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["train", "eval"]), hostile=HOSTILE)
def test_one_device_cannot_push_a_rounds_published_loss_or_accuracy_out_of_range_long_run(kind, hostile):
    _one_hostile_device_among_honest_ones(kind, hostile)


def _one_hostile_device_among_honest_ones(kind: str, hostile: dict) -> None:
    """Four or five honest devices (accuracy 0.5, loss 1.0, 10 examples each) and one that sends
    any metric sums: the round publishes an accuracy in [0, 1], within the one device's bounded
    weight of the honest 0.5 (max_examples_per_report 10 against the others' 40: [0.4, 0.6]),
    and a finite loss >= 0; no device's own accuracy or loss is out of range either."""
    with tempfile.TemporaryDirectory() as folder:
        server = Server(Path(folder) / "s.db")
        try:
            train = digits_plan()
            plan, _ = server.deploy(plan=train if kind == "train" else build_eval_plan(train), config=BOUNDED)
            attacker, *honest = server.checkin(6)
            forged = update_of(plan, HONEST_COUNT)
            forged.update(hostile)
            with contextlib.suppress(ApiError):  # refused (INVALID_METRICS, INVALID_UPDATE): the round does without it
                server.report(attacker, forged)
            for session in honest:
                with contextlib.suppress(ApiError):  # the round may have committed already (REPORT_LATE)
                    server.report(session, update_of(plan, HONEST_COUNT, **HONEST))
            assert server.statuses() == ["committed"]
            metrics, devices = published(server.service, kind)
            assert 0.4 - 1e-6 <= metrics[f"{kind}_accuracy"] <= 0.6 + 1e-6, metrics
            assert 0.0 <= metrics[f"{kind}_loss"] < math.inf
            assert 0.0 <= devices["accuracy"]["min"] and devices["accuracy"]["max"] <= 1.0
            assert devices["loss"]["min"] >= 0.0
        finally:
            for store in server.stores:
                store.close()


@settings(max_examples=100, deadline=None)
@given(update=metric_sums(), max_loss=st.floats(1e-3, 1e6))
def test_a_held_loss_is_at_most_max_loss_times_its_count_and_only_a_loss_above_it_moves(update, max_loss):
    counted = f64(update, "count" if "count" in update else "num_examples")
    held, was_held = hold_loss(update, max_loss)
    assert set(held) == set(update) and held["loss_sum"].dtype == update["loss_sum"].dtype
    assert all(np.array_equal(held[n], update[n]) for n in update if n != "loss_sum")
    most = max_loss * max(counted, 0.0)
    assert was_held == (f64(update, "loss_sum") > most)
    if was_held:  # at most the bound, to float32's rounding of it
        assert f64(held, "loss_sum") == pytest.approx(most, rel=1e-6)
    else:
        assert np.array_equal(held["loss_sum"], update["loss_sum"])
    assert hold_loss(update, None) == (dict(update), False)


@pytest.mark.parametrize(("max_loss", "most"), [(None, 1e36), (4.0, 1.6)], ids=["no-bound", "max_loss-4"])
def test_one_device_moves_a_rounds_published_loss_by_at_most_its_share_of_max_loss(server, max_loss, most):
    """Four honest devices at loss 1.0 and one that sends ``loss_sum`` 3.4e38 (float32's largest)
    over its 10 examples, every other value honest. Without ``max_loss`` the round published a
    ``train_loss`` of 6.8e36; with ``max_loss`` 4 that device's mean loss counts as 4, and the
    round's loss is (4 x 10 + 4 x 10) / 50 = 1.6."""
    plan, _ = server.deploy(config=dataclasses.replace(BOUNDED, max_loss=max_loss))
    attacker, *honest = server.checkin(6)
    server.report(attacker, update_of(plan, HONEST_COUNT, correct=5.0, loss_sum=3.4e38))
    for session in honest[:4]:
        server.report(session, update_of(plan, HONEST_COUNT, **HONEST))
    assert server.statuses() == ["committed"]
    metrics, devices = published(server.service, "train")
    if max_loss is None:
        assert metrics["train_loss"] > most  # the measured attack: 6.8e36
    else:
        assert metrics["train_loss"] == pytest.approx(most, rel=1e-6)
        assert devices["loss"]["max"] <= max_loss * (1 + 1e-6)


@pytest.mark.parametrize(
    "sums",
    [
        dict(loss_sum=-4e27),  # train_loss -4e27 in the tester's round
        dict(correct=4e27),  # train_accuracy 4e27
        dict(correct=11.0),  # one more right answer than examples counted
        dict(count=-10.0, correct=-5.0, loss_sum=-10.0),
        dict(count=0.0, correct=0.0, loss_sum=5.0),  # a loss over nothing
    ],
)
def test_a_report_whose_metric_sums_no_honest_device_computes_is_refused_and_not_summed(server, sums):
    plan, start = server.deploy()
    session, *_ = server.checkin(5)
    forged = update_of(plan, HONEST_COUNT, **{plan.weight_names[0]: 1.0}, **sums)
    with pytest.raises(ApiError) as refused:
        server.report(session, forged)
    assert (refused.value.status, refused.value.code) == (422, "INVALID_METRICS")
    assert "correct" in refused.value.message or "loss_sum" in refused.value.message or "count" in refused.value.message
    # its update was not taken: the round still waits for five reports
    assert server.service.population_status(POP)["current_round"]["reported"] == 0


# 6: min_reports for every task -------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        RoundConfig(goal_count=1),  # the tester's goal-1 evaluation round
        RoundConfig(goal_count=4, over_selection=1.5, min_fraction=1.0),
        RoundConfig(goal_count=10, min_fraction=0.4),  # commits with ceil(10 * 0.4) = 4 reports
    ],
)
def test_an_evaluation_task_whose_rounds_could_publish_fewer_than_min_reports_devices_metrics_is_refused(
    server, config
):
    train = digits_plan()
    server.service.create_population(POP)
    checkpoint = encode_checkpoint(initial_weights(train, seed=0))
    specs = [
        TaskSpec("train", serialize_plan(train), checkpoint, CONFIG),
        TaskSpec("eval", serialize_plan(build_eval_plan(train)), None, config, evaluates="train"),
    ]
    with pytest.raises(ApiError) as refused:
        server.service.deploy_tasks(POP, specs)
    assert refused.value.code == "BAD_CONFIG" and "'eval'" in refused.value.message
    alone = TaskSpec(
        "eval", serialize_plan(build_eval_plan(train)), checkpoint, config
    )  # an evaluation of a fixed model
    with pytest.raises(ApiError) as refused:
        server.service.deploy_tasks(POP, [alone])
    assert refused.value.code == "BAD_CONFIG"
    assert server.store.tasks(POP) == []


def test_a_stored_evaluation_task_below_min_reports_publishes_nothing_from_one_device(server):
    """A task stored before the deploy check covered evaluations (goal 1, min_reports 5) is still
    held to min_reports when its round would commit: abandoned, with the reason, and no metric."""
    train = digits_plan()
    plan = build_eval_plan(train)
    config = {"round": RoundConfig(goal_count=1).to_dict(), "eligibility": EligibilityPolicies().to_dict()}
    server.store.create_population(POP)
    server.store.add_tasks(
        POP, [NewTask("eval", serialize_plan(plan), encode_checkpoint(initial_weights(train, seed=0)), config)]
    )
    server.service = server.restart()
    (session,) = server.checkin(1)
    answer = server.report(session, update_of(plan, HONEST_COUNT, **HONEST))
    assert answer.round_status == "abandoned"
    (record,) = server.service.rounds(POP)
    assert record["status"] == "abandoned" and "min_reports" in record["metrics"]["error"]
    assert not {"eval_loss", "eval_accuracy"} & set(record["metrics"]), record["metrics"]


# 10: a round whose record cannot be written ------------------------------------------------------


class QuickToGiveUp(Server):
    """A server whose database writes wait 0.2 s for another process's lock before failing."""

    def restart(self) -> FLService:
        store = ServerStore(self.path, busy_timeout_s=0.2)
        self.stores.append(store)
        return FLService(store, clock=lambda: self.now, wall_clock=lambda: WALL + self.now)

    def four_of_five_reported(self, seed: int) -> tuple:
        """A task deployed, five devices seated and four of them reported: the plan, its start,
        the five updates, their mean delta, and the fifth session (whose report closes the round)."""
        plan, start = self.deploy()
        updates, mean = moving_updates(plan, start, seed=seed)
        sessions = self.checkin(5)
        for session, update in zip(sessions[:4], updates[:4]):
            assert self.report(session, update).round_status == "open"
        return plan, start, updates, mean, sessions[4]

    @contextlib.contextmanager
    def locked_by_another_process(self) -> Iterator[None]:
        """The database's write lock held by another process past the busy timeout."""
        holder = sqlite3.connect(self.path, timeout=0.1, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            holder.execute("ROLLBACK")
            holder.close()


def moving_updates(plan, start: dict, seed: int) -> tuple[list[dict], dict]:
    """Five updates that move the model, and their example-weighted mean delta (in float64)."""
    rng = np.random.default_rng(seed)
    updates = []
    for i in range(5):
        n = 10.0 + i
        updates.append(update_of(plan, n, **{w: rng.normal(0.0, 0.01, start[w].shape) * n for w in plan.weight_names}))
    total = sum(float(u["num_examples"]) for u in updates)
    return updates, {w: sum(u[w].astype(np.float64) for u in updates) / total for w in plan.weight_names}


def test_a_round_whose_commit_and_fallback_writes_both_fail_is_told_abandoned_and_recorded_once_the_database_frees(
    tmp_path,
):
    server = QuickToGiveUp(tmp_path / "s.db")
    plan, start, updates, mean, last = server.four_of_five_reported(seed=3)
    with server.locked_by_another_process():
        answer = server.report(last, updates[4])  # the commit's write and the fallback's both fail
        assert answer.status == "accepted" and answer.round_status == "abandoned", answer
        server.now += WRITE_RETRY_FIRST_S
        server.service.tick()  # still locked: the record stays in memory for a later try
    assert server.statuses() == []
    server.now += 2 * WRITE_RETRY_FIRST_S
    server.service.tick()  # the backoff is over and the database free: the record is written
    records = server.service.rounds(POP)
    assert [(r["round"], r["attempt"], r["status"]) for r in records] == [(1, 1, "abandoned")]
    assert records[0]["metrics"]["error"] == "database write failed: OperationalError"
    assert records[0]["metrics"]["reported"] == 5
    server.service.tick()
    assert len(server.service.rounds(POP)) == 1  # written once

    # The abandoned round was not applied: the next attempt commits one mean update, once.
    server.run_round(updates)
    assert [(r["round"], r["attempt"], r["status"]) for r in server.service.rounds(POP)] == [
        (1, 1, "abandoned"),
        (1, 2, "committed"),
    ]
    model = server.model()
    for w in plan.weight_names:
        np.testing.assert_allclose(model[w], start[w] + mean[w], rtol=1e-5, atol=1e-6)
    for store in server.stores:
        store.close()


def test_no_round_opens_while_the_database_refuses_the_record_of_the_last_one(tmp_path):
    """A round whose record the database refused (full, locked) was followed at once by the next
    attempt: its devices trained and reported for a commit the database refused too, each attempt's
    updates discarded and its record piled up in memory, for as long as the disk stayed full. Now
    check-ins are turned away (``ROUND_FULL``, a retry window) until that record is on record, and
    the status says why no round is open."""
    server = QuickToGiveUp(tmp_path / "s.db")
    _, _, updates, _, last = server.four_of_five_reported(seed=6)
    with server.locked_by_another_process():
        assert server.report(last, updates[4]).round_status == "abandoned"
        for _ in range(2):  # still refused at its retry: still no round
            answer = server.service.checkin(POP, installed_runtime_version())
            assert isinstance(answer, CheckinRejected) and answer.reason == "ROUND_FULL", answer
            assert answer.retry_after_s[0] > 0
            server.now += WRITE_RETRY_FIRST_S
            server.service.tick()
        status = server.service.population_status(POP)
        assert status["active_task"] is None and "the database refused the record" in status["waiting"], status
    server.now += 4 * WRITE_RETRY_FIRST_S
    server.service.tick()  # the record is on record: the next attempt opens
    assert "waiting" not in server.service.population_status(POP)
    server.run_round(updates)
    assert [(r["round"], r["attempt"], r["status"]) for r in server.service.rounds(POP)] == [
        (1, 1, "abandoned"),
        (1, 2, "committed"),
    ]
    for store in server.stores:
        store.close()


def test_a_record_waiting_for_its_retry_is_written_when_the_server_stops(tmp_path):
    server = QuickToGiveUp(tmp_path / "s.db")
    _, _, updates, _, last = server.four_of_five_reported(seed=4)
    with server.locked_by_another_process():
        assert server.report(last, updates[4]).round_status == "abandoned"
    assert server.statuses() == []
    assert server.service.write_unwritten() == 0  # its backoff is not over: written all the same
    assert [(r["round"], r["attempt"], r["status"]) for r in server.service.rounds(POP)] == [(1, 1, "abandoned")]
    for store in server.stores:
        store.close()


class RaiseAfterFirstWrite:
    """Wraps ServerStore.record_round: the first call writes the round, then raises as if it had
    not (an error reported after the transaction committed); every other call goes through."""

    def __init__(self, store: ServerStore) -> None:
        self.record_round = store.record_round
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        record = self.record_round(*args, **kwargs)
        if self.calls == 1:
            raise OperationalError("COMMIT", {}, Exception("disk I/O error"))
        return record


def test_a_commit_whose_write_failed_after_it_went_through_is_on_record_once_and_applied_once(server, monkeypatch):
    plan, start = server.deploy()
    updates, mean = moving_updates(plan, start, seed=5)
    monkeypatch.setattr(server.store, "record_round", RaiseAfterFirstWrite(server.store))
    sessions = server.checkin(5)
    for session, update in zip(sessions[:4], updates[:4]):
        server.report(session, update)
    assert server.report(sessions[4], updates[4]).round_status == "committed"
    assert [(r["round"], r["attempt"], r["status"]) for r in server.service.rounds(POP)] == [(1, 1, "committed")]
    assert server.service.population_status(POP)["round"] == 2
    model = server.model()
    for w in plan.weight_names:
        np.testing.assert_allclose(model[w], start[w] + mean[w], rtol=1e-5, atol=1e-6)


class ScheduledFaults:
    """Wraps ServerStore.record_round: call i fails as ``schedule[i]`` says (None: it goes
    through; "before": it raises having written nothing, as with the database locked; "after": it
    writes, then raises as if it had not); calls past the schedule go through."""

    def __init__(self, store: ServerStore, schedule: list[str | None]) -> None:
        self.record_round = store.record_round
        self.schedule = schedule
        self.calls = 0

    def __call__(self, *args, **kwargs):
        fault = self.schedule[self.calls] if self.calls < len(self.schedule) else None
        self.calls += 1
        if fault == "before":
            raise OperationalError("INSERT INTO rounds ...", {}, Exception("database is locked"))
        record = self.record_round(*args, **kwargs)
        if fault == "after":
            raise OperationalError("COMMIT", {}, Exception("disk I/O error"))
        return record


#: Five devices commit a round; an open round waits for them far longer than the test's ticks run.
PATIENT = RoundConfig(goal_count=5, over_selection=1.0, min_fraction=1.0, selection_timeout_s=1e5, report_timeout_s=1e5)


#: Fault schedules the round-records property draws in the default run (25 took 4.8 CPU-s), and in its slow twin.
SCHEDULE_EXAMPLES = 10
SLOW_SCHEDULE_EXAMPLES = 150
SCHEDULES = st.lists(st.sampled_from([None, "before", "after"]), max_size=8)


@settings(max_examples=SCHEDULE_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=SCHEDULES)
@example(schedule=["before"] * 4)  # round 1's abandoned record is written after its second attempt's
@example(schedule=["after", None, "before", "after", "before"])  # both kinds of fault, in the default run too
def test_whatever_writes_fail_each_round_is_on_record_once_as_its_closing_device_was_told_and_applied_once(schedule):
    _rounds_on_record_under_write_faults(schedule)


@pytest.mark.slow
@settings(max_examples=SLOW_SCHEDULE_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=SCHEDULES)
def test_whatever_writes_fail_each_round_is_on_record_once_as_its_closing_device_was_told_and_applied_once_long_run(
    schedule,
):
    _rounds_on_record_under_write_faults(schedule)


def _rounds_on_record_under_write_faults(schedule: list[str | None]) -> None:
    """Three rounds of five reports while the round writes fail in any pattern (before or after
    writing), then the ticker runs on: every round is on record exactly once, with the outcome
    the device whose report closed it was told, and the model moved once per committed round, in
    memory and for a server restarted on the database."""
    with tempfile.TemporaryDirectory() as folder:
        server = Server(Path(folder) / "s.db")
        try:
            plan, start = server.deploy(config=PATIENT)
            updates, mean = moving_updates(plan, start, seed=1)
            server.store.record_round = ScheduledFaults(server.store, schedule)
            told = []
            for _ in range(3):
                server.now += 100.0  # past any backoff
                server.service.tick()
                while "waiting" in server.service.population_status(POP):  # a record the database refused
                    server.now += 100.0  # no round opens until it is on record
                    server.service.tick()
                answers = [server.report(s, u) for s, u in zip(server.checkin(5), updates)]
                assert [a.round_status for a in answers[:4]] == ["open"] * 4
                told.append((answers[4].round, answers[4].round_status))
            for _ in range(10):  # the faults run out, the records still in memory are written
                server.now += 100.0
                server.service.tick()
            records = server.service.rounds(POP)
            assert [(r["round"], r["status"]) for r in records] == told, (records, told)
            assert len({(r["round"], r["attempt"]) for r in records}) == 3
            committed = sum(status == "committed" for _, status in told)
            for service in (server.service, server.restart()):
                assert service.population_status(POP)["round"] == committed + 1
                model = decode_checkpoint(service.current_model(POP)[0])
                for w in plan.weight_names:
                    np.testing.assert_allclose(model[w], start[w] + committed * mean[w], rtol=1e-5, atol=1e-6)
        finally:
            for store in server.stores:
                store.close()


def test_recording_a_round_again_returns_the_record_already_there(tmp_path):
    store = ServerStore(tmp_path / "s.db")
    plan = digits_plan()
    store.create_population(POP)
    (task,) = store.add_tasks(
        POP, [NewTask("train", serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), {})]
    )
    first = store.record_round(task.id, 1, 1, "committed", {"reported": 5}, 1.0, 2.0)
    again = store.record_round(task.id, 1, 1, "abandoned", {"error": "x"}, 3.0, 4.0)
    assert again == first
    assert store.record_round(task.id, 1, 2, "abandoned", {}, 3.0, 4.0).id != first.id
    assert [(r.number, r.attempt, r.status) for r in store.rounds(task.id)] == [
        (1, 1, "committed"),
        (1, 2, "abandoned"),
    ]
    # a round the server abandoned in memory although its commit went through is made to say so
    overwritten = store.record_round(task.id, 1, 1, "abandoned", {"error": "x"}, 3.0, 4.0, overwrite=True)
    assert (overwritten.id, overwritten.status, overwritten.checkpoint_id) == (first.id, "abandoned", None)
    assert store.rounds(task.id)[0] == overwritten
    store.close()


def test_after_a_restart_the_next_attempt_follows_the_last_one_on_record_even_past_a_gap(server):
    """A record a stopped server never wrote leaves a gap in a round's attempts (1 and 3 on
    record). The next attempt is 4, not 3 (the count plus one): a round already on record under
    (round, attempt) is not written again, so the commit would have been lost as a duplicate."""
    plan, start = server.deploy()
    (task,) = server.store.tasks(POP)
    for attempt in (1, 3):
        server.store.record_round(task.id, 1, attempt, "abandoned", {"reported": 0}, WALL, WALL)
    server.service = server.restart()
    updates, mean = moving_updates(plan, start, seed=9)
    server.run_round(updates)
    assert [(r["round"], r["attempt"], r["status"]) for r in server.service.rounds(POP)] == [
        (1, 1, "abandoned"),
        (1, 3, "abandoned"),
        (1, 4, "committed"),
    ]
    restarted = server.restart()
    assert restarted.population_status(POP)["round"] == 2
    model = decode_checkpoint(restarted.current_model(POP)[0])
    for w in plan.weight_names:
        np.testing.assert_allclose(model[w], start[w] + mean[w], rtol=1e-5, atol=1e-6)


# 11: a device's answer and another device's commit --------------------------------------------


def test_a_report_that_closed_nothing_is_answered_without_writing_the_commit_another_report_closed(server):
    """Device A's report is accepted; before A's call reaches its write step, device B's report
    closes the round. A is answered without writing B's commit, which B's own call writes: A's
    answer never waits for a commit (nor is lost with a server killed while writing one)."""
    plan, _ = server.deploy(config=RoundConfig(goal_count=2, over_selection=1.0, min_fraction=1.0, min_reports=2))
    a, b = server.checkin(2)
    commits = server.service._commits
    flush = commits.flush
    a_waits, b_closed, a_done = threading.Event(), threading.Event(), threading.Event()
    writers: list[str] = []

    def ordered_flush(**kw) -> None:
        name = threading.current_thread().name
        if name == "A":
            a_waits.set()
            assert b_closed.wait(30)
            flush(**kw)
            a_done.set()
        elif name == "B" and getattr(commits._closed_here, "commits", None):
            b_closed.set()
            a_done.wait(30)
            flush(**kw)
        else:
            flush(**kw)

    record_round = server.store.record_round

    def noted_record_round(*args, **kw):
        writers.append(threading.current_thread().name)
        return record_round(*args, **kw)

    commits.flush = ordered_flush
    server.store.record_round = noted_record_round
    answers: dict[str, object] = {}

    def send(name: str, session: CheckinAccepted) -> threading.Thread:
        thread = threading.Thread(
            target=lambda: answers.__setitem__(name, server.report(session, update_of(plan))), name=name, daemon=True
        )
        thread.start()
        return thread

    device_a = send("A", a)
    assert a_waits.wait(30)  # A's report is in the round
    device_b = send("B", b)
    device_a.join(30)
    device_b.join(30)
    assert (answers["A"].round_status, answers["B"].round_status) == ("open", "committed")
    assert writers == ["B"]
    assert server.statuses() == ["committed"]
