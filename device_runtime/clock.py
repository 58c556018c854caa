"""One clock under scheduling, conditions and opstats, so the emulator can run a device's day in
virtual time while an app on a real device uses the system clock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from .errors import InvalidSetting, check_number


class Clock(Protocol):
    """Where scheduling, conditions and opstats read the time: ``SystemClock`` on a device,
    ``VirtualClock`` in a simulation, or the app's own object with these two methods."""

    def now(self) -> float:
        """Unix seconds."""

    def sleep(self, seconds: float, wake: threading.Event | None = None) -> bool:
        """Wait ``seconds`` or until ``wake`` is set; True if woken."""


class SystemClock:
    """The device's own time: ``now`` is ``time.time()``, and ``sleep`` waits in real time."""

    def __repr__(self) -> str:
        return "SystemClock()"

    def now(self) -> float:
        return time.time()

    def wall_offset(self) -> float:
        """How far ``now`` is ahead of the monotonic clock: it changes when the wall clock is set
        (by the user, or a time sync's step), which ``WorkerQueue`` follows."""
        return self.now() - time.monotonic()

    def sleep(self, seconds: float, wake: threading.Event | None = None) -> bool:
        seconds = check_number("SystemClock.sleep's seconds", seconds, signed=True)  # "5" failed with a TypeError
        if wake is None:
            time.sleep(max(0.0, seconds))
            return False
        return wake.wait(max(0.0, seconds))


def is_system_time(clock: Callable[[], float]) -> bool:
    """Whether ``clock`` reads the system's time: ``time.time``, ``time.monotonic``, or the
    ``now`` of a ``SystemClock`` (what an app passes as ``RuntimeEnvironment(clock=...)``). A
    runtime on it bounds its sessions in real time (deadlines, a watchdog on training); on any
    other (a simulation's virtual time) it leaves that to the simulation."""
    return clock in (time.time, time.monotonic) or isinstance(getattr(clock, "__self__", None), SystemClock)


def elapsed_clock(clock: Callable[[], float]) -> Callable[[], float]:
    """What durations and deadlines measured against ``clock`` are read on: the monotonic clock
    when ``clock`` is the system's (the wall clock jumps when the user or a time sync sets it: a
    day ahead ended every time budget at once, a day back let one run a day longer), else
    ``clock`` itself (a virtual clock only moves forward)."""
    return time.monotonic if is_system_time(clock) else clock


def check_clock(name: str, clock: object) -> None:
    """``InvalidSetting`` unless ``clock`` is a ``Clock``: ``time.time``, which
    ``RuntimeEnvironment(clock=...)`` takes, failed at the first job with no attribute 'now'."""
    if not callable(getattr(clock, "now", None)):
        raise InvalidSetting(
            f"{name} is a Clock (SystemClock(), VirtualClock(t)) or None, not {type(clock).__name__} {clock!r:.100}"
        )


class VirtualClock:
    """Time moves only when the driver says so; ``sleep`` advances it at once (single driver)."""

    def __init__(self, start: float = 1_767_225_600.0) -> None:  # 2026-01-01T00:00:00Z
        self._now = check_number("VirtualClock's start", start, signed=True, unit="unix seconds")
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"VirtualClock({self.now()!r})"

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        seconds = check_number("VirtualClock.advance's seconds (virtual time only moves forward)", seconds)
        with self._lock:
            self._now += seconds
            return self._now

    def advance_to(self, when: float) -> float:
        when = check_number("VirtualClock.advance_to's time", when, signed=True, unit="unix seconds")
        with self._lock:
            self._now = max(self._now, when)
            return self._now

    def sleep(self, seconds: float, wake: threading.Event | None = None) -> bool:
        seconds = check_number("VirtualClock.sleep's seconds", seconds, signed=True)  # "5" failed with a TypeError
        if wake is not None and wake.is_set():
            return True
        self.advance(max(0.0, seconds))
        return False
