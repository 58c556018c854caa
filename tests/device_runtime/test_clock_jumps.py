"""A session on the system's clock while the user sets it (a day back, a year ahead): its time
budget and deadlines are measured in elapsed time, never on the wall clock, which a jump ahead
ended at once and a jump back let run for a day. An app that passes its ``SystemClock``'s ``now``
(as ``examples/digits_app.py`` does) is on the system's clock too: its sessions had no deadline
and no watchdog on training, which only ``time.time`` itself was given."""

from __future__ import annotations

import dataclasses
import time

import pytest

from device_runtime import FLRuntime, Outcome, RetryPolicy, RuntimeEnvironment
from device_runtime.clock import SystemClock, VirtualClock, elapsed_clock, is_system_time
from example_store import InMemoryExampleStore
from tests.support import COLLECTION, deploy, digits_plan

FAST_RETRY = RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05)


class SetClock(SystemClock):
    """The system's clock, which the test sets as a user does in the phone's settings."""

    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> float:
        return super().now() + self.offset


def _budgeted(seconds: float):
    plan = digits_plan()
    return dataclasses.replace(plan, metadata=dataclasses.replace(plan.metadata, time_budget_s=seconds))


@pytest.fixture
def store(digits):
    store = InMemoryExampleStore()
    store.add(COLLECTION, [{"x": x, "y": y} for x, y in zip(digits.x_train[:40], digits.y_train[:40])])
    return store


def test_the_clocks_an_app_passes_for_the_systems_are_read_as_the_systems():
    assert is_system_time(time.time) and is_system_time(SystemClock().now) and is_system_time(SetClock().now)
    assert not is_system_time(VirtualClock().now)
    assert elapsed_clock(SetClock().now) is time.monotonic and elapsed_clock(time.time) is time.monotonic


@pytest.mark.parametrize("jump_s", [365 * 86_400.0, -86_400.0])
def test_a_clock_set_during_training_leaves_the_time_budget_to_elapsed_time(server, admin, store, jump_s):
    """A year ahead ended the session 'over time budget' after its first step; a day back it was
    not measured at all. The clock is set at every step, as a time sync's steps would."""
    deploy(admin, plan=_budgeted(600.0), goal_count=5)
    clock = SetClock()

    def set_clock() -> bool:
        clock.offset += jump_s
        return False

    runtime = FLRuntime("digits", server.url, store, retry=FAST_RETRY, environment=RuntimeEnvironment(clock=clock.now))
    with runtime:
        result = runtime.run_session(should_abort=set_clock)
    assert result.outcome is Outcome.COMPLETED and result.shape == "-v[]+^"


def test_a_clock_set_back_during_training_does_not_stretch_the_time_budget(server, admin, store):
    """Set a day back at every step, a plan of 0.3 s ran on (its budget read on the wall clock
    never passed), until the end of its training."""
    deploy(admin, plan=_budgeted(0.3), goal_count=5)
    clock = SetClock()

    def slow_steps_while_set_back() -> bool:
        clock.offset -= 86_400.0
        time.sleep(0.15)  # 10 steps (40 examples in batches of 8, 2 epochs): 1.5 s
        return False

    runtime = FLRuntime("digits", server.url, store, retry=FAST_RETRY, environment=RuntimeEnvironment(clock=clock.now))
    with runtime:
        result = runtime.run_session(should_abort=slow_steps_while_set_back)
    assert result.outcome is Outcome.INTERRUPTED and result.shape == "-v[!"
    assert result.events[-1].detail["reason"] == "over time budget (0.3 s)"


def test_a_session_on_an_apps_system_clock_has_a_deadline(server, admin, store):
    """The session's requests end with its report window on the app's ``SystemClock`` as on
    ``time.time``: a server that takes its time past it gets no more of the device's."""
    deploy(admin, goal_count=5)
    runtime = FLRuntime(
        "digits", server.url, store, retry=FAST_RETRY, environment=RuntimeEnvironment(clock=SetClock().now)
    )
    seen: list[float | None] = []
    with runtime:
        result = runtime.run_session(should_abort=lambda: seen.append(runtime.client.ends_at) or False)
    assert result.outcome is Outcome.COMPLETED
    assert seen and None not in seen
