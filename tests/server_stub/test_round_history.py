"""What an operator reads back of a population's rounds: a task nobody checks in to leaves one
record per idle spell (not one abandoned round per selection timeout), and the rounds of tasks
that take turns are listed oldest first."""

from __future__ import annotations

import logging

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime import PlanExecutor, encode_checkpoint, initial_weights
from device_runtime.clock import VirtualClock
from device_runtime.plan import serialize_plan
from device_runtime.wire import CheckinAccepted
from server_stub import FLService, RoundConfig, ServerStore
from server_stub.service import TaskSpec
from server_stub.task_choice import Strategy
from tests.support import digits_plan

ONE_DEVICE = dict(goal_count=1, over_selection=1.0, min_reports=1, selection_timeout_s=10, report_timeout_s=10)


def _service(path) -> tuple[FLService, VirtualClock]:
    clock = VirtualClock()
    return FLService(ServerStore(path), clock=clock.now, wall_clock=clock.now), clock


def _update(plan) -> bytes:
    spec = PlanExecutor(plan).client_update_spec()
    update = {name: np.full(shape, 0.01, dtype=dtype) for name, (shape, dtype) in spec.items()}
    update["num_examples"] = np.array(4, dtype=update["num_examples"].dtype)
    return encode_checkpoint(update)


def _checked_in(service: FLService, clock: VirtualClock) -> CheckinAccepted:
    """One device's accepted check-in (waiting out a deferred opening)."""
    for _ in range(100):
        answer = service.checkin("p", "1.31.1")
        if isinstance(answer, CheckinAccepted):
            return answer
        clock.advance(5.0)
        service.tick()
    raise AssertionError("no check-in was accepted")


def _one_round(service: FLService, clock: VirtualClock, update: bytes) -> str:
    """One device checks in (waiting out a deferred opening) and reports; the task it served."""
    answer = _checked_in(service, clock)
    service.report(answer.session_id, answer.token, update)
    return answer.task


@settings(max_examples=8, deadline=None)
@given(idle_timeouts=st.integers(2, 40))
def test_an_idle_task_stores_one_round_per_idle_spell_not_one_per_selection_timeout(tmp_path_factory, idle_timeouts):
    service, clock = _service(tmp_path_factory.mktemp("idle") / "server.db")
    plan = digits_plan()
    service.create_population("p")
    service.deploy_task(
        "p", "t", serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), RoundConfig(**ONE_DEVICE)
    )
    for _ in range(idle_timeouts * 4):  # nobody checks in for idle_timeouts selection windows
        clock.advance(2.5)
        service.tick()
    idle = service.rounds("p")
    assert len(idle) == 1, [(r["round"], r["attempt"]) for r in idle]
    spell = idle[0]
    assert (spell["round"], spell["attempt"], spell["status"], spell["metrics"]["selected"]) == (1, 1, "abandoned", 0)
    assert spell["metrics"].get("idle_timeouts", 1) >= 2 and spell["ended_at"] > spell["started_at"] + 10
    _one_round(service, clock, _update(plan))
    history = service.rounds("p")
    assert [(r["round"], r["attempt"], r["status"]) for r in history] == [(1, 1, "abandoned"), (1, 2, "committed")]


def test_an_idle_spell_is_logged_as_it_doubles_not_once_a_selection_timeout(tmp_path, caplog):
    service, clock = _service(tmp_path / "server.db")
    plan = digits_plan()
    service.create_population("p")
    service.deploy_task(
        "p", "t", serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), RoundConfig(**ONE_DEVICE)
    )
    with caplog.at_level(logging.INFO, logger="server_stub.commit"):
        for _ in range(40 * 4):  # nobody checks in for 40 selection windows
            clock.advance(2.5)
            service.tick()
    (spell,) = service.rounds("p")
    timeouts = spell["metrics"]["idle_timeouts"]
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO and "nobody came" in r.getMessage()]
    assert timeouts >= 32 and len(said) == timeouts.bit_length() - 1, said  # at 2, 4, 8, 16, 32 timeouts
    assert said[-1].endswith("(32 selection timeouts in a row)")


def test_rounds_of_tasks_that_take_turns_are_listed_oldest_first(tmp_path):
    service, clock = _service(tmp_path / "server.db")
    plan = digits_plan()
    plan_bytes, checkpoint = serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0))
    service.create_population("p")
    service.deploy_tasks(
        "p",
        [
            TaskSpec("a", plan_bytes, checkpoint, RoundConfig(**ONE_DEVICE)),
            TaskSpec("b", plan_bytes, checkpoint, RoundConfig(**ONE_DEVICE)),
        ],
        Strategy.ALTERNATE,
    )
    update = _update(plan)
    served = []
    for _ in range(4):
        served.append(_one_round(service, clock, update))
        clock.advance(1.0)
    rounds = service.rounds("p")
    assert served == ["a", "b", "a", "b"]
    assert [r["task"] for r in rounds] == served
    assert [r["started_at"] for r in rounds] == sorted(r["started_at"] for r in rounds)
    assert [r["task"] for r in service.rounds("p", "a")] == ["a", "a"]
