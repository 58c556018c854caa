"""The discrete-event loop and its fibers: events in (time, order, scheduling) order, virtual
sleeps that interleave fibers deterministically, kills that land where a fiber waits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.fleet.events import AppKilled, EventLoop, Fibers, SimulationError, SimulationOver

_events = st.lists(st.tuples(st.floats(0.0, 100.0, allow_nan=False), st.integers(-2, 2)), min_size=1, max_size=60)


@given(_events)
def test_events_run_in_time_then_order_then_scheduling_order(events):
    loop = EventLoop()
    ran: list[tuple[float, int, int]] = []
    for seq, (at, order) in enumerate(events):
        loop.call_at(at, lambda a=at, o=order, s=seq: ran.append((a, o, s)), order=order)
    loop.run_until(100.0)
    assert ran == sorted((at, order, seq) for seq, (at, order) in enumerate(events))
    assert loop.now == 100.0


@given(_events, st.floats(0.0, 100.0, allow_nan=False))
def test_run_until_stops_at_its_end_and_cancelled_timers_never_run(events, end):
    loop = EventLoop()
    ran = []
    timers = [loop.call_at(at, ran.append, (at, i), order=order) for i, (at, order) in enumerate(events)]
    for timer in timers[::2]:
        timer.cancel()
    loop.run_until(end)
    assert sorted(ran) == sorted((at, i) for i, (at, _) in enumerate(events) if at <= end and i % 2 == 1)


@settings(max_examples=50)
@given(st.lists(st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=5), min_size=1, max_size=6))
def test_fibers_wake_at_their_virtual_times_and_repeat_exactly(plans):
    def trace() -> list[tuple[float, int]]:
        loop = EventLoop()
        fibers = Fibers(loop)
        seen: list[tuple[float, int]] = []

        def body(i: int, sleeps: list[float]) -> None:
            expected = loop.now
            for s in sleeps:
                fibers.sleep(s)
                expected += s
                assert loop.now == pytest.approx(expected)
                seen.append((loop.now, i))

        for i, sleeps in enumerate(plans):
            fibers.spawn(lambda i=i, s=sleeps: body(i, s), at=0.0)
        loop.run_until(1000.0)
        return seen

    first = trace()
    assert first == trace()
    assert [t for t, _ in first] == sorted(t for t, _ in first)
    assert len(first) == sum(len(p) for p in plans)


def test_sleep_outside_a_fiber_is_refused():
    fibers = Fibers(EventLoop())
    with pytest.raises(SimulationError, match="outside a fiber"):
        fibers.sleep(1.0)


def test_a_kill_is_raised_where_the_fiber_waits_and_its_wake_never_comes():
    loop = EventLoop()
    fibers = Fibers(loop)
    log = []

    def body() -> None:
        try:
            fibers.sleep(50.0)
            log.append("woke")
        except AppKilled:
            log.append(("killed", loop.now))

    fiber = fibers.spawn(body, at=0.0)
    loop.call_at(10.0, fiber.kill, AppKilled())
    loop.run_until(100.0)
    assert log == [("killed", 10.0)]
    assert fiber.dead


def test_closing_ends_every_waiting_fiber_and_a_later_sleep_ends_too():
    loop = EventLoop()
    fibers = Fibers(loop)
    ended = []

    def body() -> None:
        try:
            fibers.sleep(1e9)
        except SimulationOver:
            ended.append(loop.now)
            fibers.sleep(1.0)  # cleanup that would wait again is ended as well
            ended.append("not reached")

    spawned = [fibers.spawn(body, at=float(i)) for i in range(3)]
    loop.run_until(5.0)
    fibers.close()
    assert ended == [5.0, 5.0, 5.0]
    assert all(f.dead for f in spawned)
