"""The discrete-event loop of a fleet simulation: one virtual clock, and fibers that run each
device's unchanged blocking SDK code.

Why fibers (greenlets) rather than a session state machine: the SDK's code that a phone runs
(scheduler, runtime, protocol client over httpx) blocks on I/O and waits. A fiber runs that code
as it is; whenever the device spends virtual time (a network transfer, a training batch, a wait
for its next job) the fiber sleeps on the virtual clock and switches back to the loop, which
resumes the fiber whose event comes next. No thread per device, no real sleeping, one code path
for a phone and for the simulation.

Determinism: events run in the order (time, order, key, sequence number). The key names whose
event it is: each fiber has its own (its device's), and an event inherits the key of the event
that scheduled it, so a device's timers carry its key. The sequence number (the order in which
events were scheduled) only breaks ties within one key. Ties between devices are therefore broken
by who they are, never by how the loop happened to interleave them, which is what lets a fleet
split over several loops (``ray_backend``) repeat the order of one loop exactly. A run whose
inputs are seeded repeats event for event: nothing here reads the wall clock or runs two fibers
at once."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

import greenlet


class SimulationError(RuntimeError):
    """A fiber or an event callback misused the loop (e.g. slept outside a fiber)."""


class Timer:
    """A scheduled call; ``cancel()`` keeps it from running."""

    __slots__ = ("at", "order", "key", "seq", "callback", "args", "cancelled")

    def __init__(
        self, at: float, order: int, seq: int, callback: Callable[..., Any], args: tuple = (), key: int = 0
    ) -> None:
        self.at, self.order, self.key, self.seq = at, order, key, seq
        self.callback, self.args = callback, args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    """Virtual time in seconds since the run's start. ``order`` breaks ties between events at
    the same instant (lower first), then ``key`` (whose event it is; by default the key of the
    event being run, 0 outside one); equal ties run in scheduling order. ``order`` and ``key``
    read those of the event being run."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)
        self.order = 0
        self.key = 0
        self._heap: list[tuple[float, int, int, int, Timer]] = []
        self._seq = itertools.count()
        self.events_run = 0

    def call_at(
        self, at: float, callback: Callable[..., Any], *args: Any, order: int = 0, key: int | None = None
    ) -> Timer:
        if at < self.now:
            at = self.now  # a late timer runs now, never in the past
        seq = next(self._seq)
        key = self.key if key is None else key
        timer = Timer(float(at), order, seq, callback, args, key)
        heapq.heappush(self._heap, (timer.at, order, key, seq, timer))  # tuples compare in C
        return timer

    def call_after(
        self, delay: float, callback: Callable[..., Any], *args: Any, order: int = 0, key: int | None = None
    ) -> Timer:
        return self.call_at(self.now + max(0.0, delay), callback, *args, order=order, key=key)

    def next_time(self) -> float | None:
        while self._heap and self._heap[0][4].cancelled:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def peek(self) -> tuple[float, int, int, int] | None:
        """The (time, order, key, sequence) of the next event, or None."""
        self.next_time()
        return self._heap[0][:4] if self._heap else None

    def run_next(self) -> None:
        """Run the next event, whatever its time."""
        if self.next_time() is None:
            return
        timer = heapq.heappop(self._heap)[4]
        self.now, self.order, self.key = timer.at, timer.order, timer.key
        self.events_run += 1
        timer.callback(*timer.args)

    def run_until(self, end: float) -> None:
        """Run every event due at or before ``end``; the clock then reads ``end``."""
        heap = self._heap
        while heap:
            if heap[0][0] > end:
                break
            timer = heapq.heappop(heap)[4]
            if timer.cancelled:
                continue
            self.now, self.order, self.key = timer.at, timer.order, timer.key
            self.events_run += 1
            timer.callback(*timer.args)
        self.now = max(self.now, end)


class SimulationOver(BaseException):
    """Thrown into every fiber still waiting when the run ends, so each unwinds at once."""


class AppKilled(BaseException):
    """Thrown into a device's fiber when the OS kills its app: nothing of the app runs on (a
    BaseException, so the SDK's error handling does not take it for an error it can report)."""


class Fiber:
    """One device's thread of control on the loop."""

    def __init__(self, fibers: Fibers, run: Callable[[], None], name: str, key: int = 0) -> None:
        self.fibers = fibers
        self.name = name
        self.key = key
        self._glet = greenlet.greenlet(run, parent=fibers.hub)
        self._wake: Timer | None = None

    @property
    def dead(self) -> bool:
        return self._glet.dead

    def _resume(self) -> None:
        self._wake = None
        self.fibers.current = self
        try:
            self._glet.switch()
        finally:
            self.fibers.current = None

    @property
    def wakes_at(self) -> float | None:
        """When the fiber's sleep ends (None while it runs, waits on ``suspend``, or is dead)."""
        return None if self._wake is None or self._wake.cancelled else self._wake.at

    def send(self, value: Any) -> None:
        """Resume a fiber waiting in ``Fibers.suspend`` (from outside any fiber); ``suspend``
        returns ``value``. It runs until it sleeps, suspends again or ends."""
        self.fibers.current = self
        try:
            self._glet.switch(value)
        finally:
            self.fibers.current = None

    def start_at(self, at: float, order: int = 1) -> None:
        self._wake = self.fibers.loop.call_at(at, self._resume, order=order, key=self.key)

    def kill(self, exc: BaseException) -> None:
        """Raise ``exc`` in the fiber where it sleeps (from an event callback, not a fiber)."""
        if self._glet.dead:
            return
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        if not self._glet:  # never started: it just never runs
            self._glet = greenlet.greenlet(lambda: None, parent=self.fibers.hub)
            return
        self.fibers.current = self
        try:
            self._glet.throw(exc)
        finally:
            self.fibers.current = None


class Fibers:
    """Runs fibers on an EventLoop; ``sleep`` is how a fiber spends virtual time."""

    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop
        self.hub = greenlet.getcurrent()
        self.current: Fiber | None = None
        self.closed = False
        self._fibers: dict[int, Fiber] = {}  # by id: a device released between job runs forgets its fiber
        self._keys = itertools.count(1)

    def spawn(
        self, run: Callable[[], None], *, at: float, name: str = "fiber", order: int = 1, key: int | None = None
    ) -> Fiber:
        """``key``: the fiber's tie-breaking key (see the module's docstring); by default fibers
        are keyed in the order they are spawned, from 1 (0 is the loop's own events')."""
        fiber = Fiber(self, run, name, next(self._keys) if key is None else key)
        fiber.start_at(at, order)
        self._fibers[id(fiber)] = fiber
        return fiber

    def key_for(self, name: str) -> int:
        """The key the next fiber spawned would get (and that fiber then gets ``key=`` it): a
        device whose fiber is spawned later, on its first wake-up, is keyed as at the start."""
        return next(self._keys)

    def spawn_now(self, run: Callable[[], None], *, name: str, key: int) -> Fiber:
        """Spawn a fiber and run it at once, within the event being run (from an event callback,
        not a fiber): it runs as a fiber spawned earlier to wake at this event would."""
        fiber = Fiber(self, run, name, key)
        self._fibers[id(fiber)] = fiber
        fiber._resume()
        return fiber

    def forget(self, fiber: Fiber) -> None:
        """Drop a fiber that is ending (``close`` has nothing left to end in it)."""
        self._fibers.pop(id(fiber), None)

    def close(self) -> None:
        """End every fiber where it waits; a fiber that tries to sleep again is ended as well."""
        self.closed = True
        for fiber in list(self._fibers.values()):
            try:
                fiber.kill(SimulationOver())
            except SimulationOver:
                pass
        self._fibers.clear()

    def suspend(self) -> Any:
        """Suspend the calling fiber with no wake-up of its own, until ``Fiber.send`` resumes it
        (whatever it sends is returned): how a fiber waits for something outside its loop."""
        if self.closed:
            raise SimulationOver()
        if self.current is None or greenlet.getcurrent() is self.hub:
            raise SimulationError("suspend() was called outside a fiber; only device code running on the loop may wait")
        return self.hub.switch()

    def sleep(self, seconds: float, order: int = 1) -> None:
        """Suspend the calling fiber for ``seconds`` of virtual time."""
        self.sleep_until(self.loop.now + max(0.0, seconds), order)

    def sleep_until(self, at: float, order: int = 1) -> None:
        """Suspend the calling fiber until the virtual instant ``at`` (now, if that has passed)."""
        if self.closed:
            raise SimulationOver()
        fiber = self.current
        if fiber is None or greenlet.getcurrent() is self.hub:
            raise SimulationError("sleep() was called outside a fiber; only device code running on the loop may sleep")
        fiber._wake = self.loop.call_at(at, fiber._resume, order=order, key=fiber.key)
        self.hub.switch()
