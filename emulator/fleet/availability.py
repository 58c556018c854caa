"""When each device is idle, charging and on an unmetered network, over the whole run.

A device's conditions are precomputed once as a step function: sorted change times (an
``array('d')``) and the flags that hold from each until the next, plus the battery level at
each change and its rate until the next. ``state_at`` and ``next_change`` are then one bisection
each, so a simulator can wake a device exactly when its conditions change instead of polling it.
A day of 100,000 devices (about 15 changes each) is drawn in about 5 s of one core and holds
about 140 MB with the rest of the population.

The model (parameters and their sources in :mod:`emulator.fleet.config`), in local time:
- a night window most nights near the device's habitual bedtime: charging and idle, and on
  Wi-Fi if the device has it at home (from a few hours before the night to a bit after it);
- daytime top-up charges (a Poisson process), some on Wi-Fi, some left idle;
- screen-on interruptions (a Poisson process while the phone would be idle) that end idleness;
- the battery, rising while charging and draining otherwise.
Change times also include the moments the battery crosses the SDK's low-battery threshold,
because ``battery_not_low`` is a training constraint an app may choose.
"""

from __future__ import annotations

import math
import random
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from device_runtime.conditions import BATTERY_LOW_FRACTION, DeviceState

from .config import AvailabilitySection

IDLE = 1
CHARGING = 2
UNMETERED = 4
#: The battery is below the SDK's low threshold (``battery_not_low`` fails).
BATTERY_LOW = 8
#: The paper's (and the SDK's default) training constraints: idle, charging, unmetered.
AVAILABLE = IDLE | CHARGING | UNMETERED

_HOUR = 3600.0
_SCREEN_ON = 0  # the model's internal count of screen-on spans; masks IDLE
_JUST_LOW = math.nextafter(BATTERY_LOW_FRACTION, 0.0)


class DeviceAvailability(Protocol):
    """What the simulator asks of a device's conditions, whether modelled or replayed."""

    def state_at(self, t: float) -> DeviceState: ...

    def next_change(self, t: float) -> float | None: ...


class Availability:
    """A device's conditions as a step function over simulated seconds since the run's start.

    ``times[0]`` is 0.0; segment ``i`` holds ``flags[i]`` on ``[times[i], times[i+1])`` and the
    last segment holds forever. Before 0 the first segment holds. The battery is linear within a
    segment: ``battery[i] + rate[i] * (t - times[i])``, clamped to [floor, 1] and to the side of
    the low threshold that the segment's ``BATTERY_LOW`` bit says."""

    __slots__ = ("times", "flags", "battery", "rate", "floor")

    def __init__(self, times: array, flags: bytes, battery: array, rate: array, floor: float = 0.0) -> None:
        if not (len(times) == len(flags) == len(battery) == len(rate)) or len(times) == 0:
            raise ValueError("times, flags, battery and rate must be non-empty and of one length")
        self.times = times
        self.flags = flags
        self.battery = battery
        self.rate = rate
        self.floor = floor

    def _segment(self, t: float) -> int:
        i = bisect_right(self.times, t) - 1
        return i if i > 0 else 0

    def _level(self, i: int, t: float) -> float:
        dt = t - self.times[i]
        level = self.battery[i] + self.rate[i] * dt if dt > 0.0 else self.battery[i]
        level = 1.0 if level > 1.0 else (self.floor if level < self.floor else level)
        # The segment's BATTERY_LOW bit is the truth; rounding must not contradict it.
        if self.flags[i] & BATTERY_LOW:
            return level if level < BATTERY_LOW_FRACTION else _JUST_LOW
        return level if level >= BATTERY_LOW_FRACTION else BATTERY_LOW_FRACTION

    def flags_at(self, t: float) -> int:
        """Bitmask of ``IDLE | CHARGING | UNMETERED | BATTERY_LOW`` at ``t``: the cheapest query."""
        return self.flags[self._segment(t)]

    def available_at(self, t: float) -> bool:
        """Idle, charging and unmetered at ``t``: the paper's training constraints (sec. 3)."""
        return self.flags[self._segment(t)] & AVAILABLE == AVAILABLE

    def battery_at(self, t: float) -> float:
        return self._level(self._segment(t), t)

    def state_at(self, t: float) -> DeviceState:
        i = self._segment(t)
        f = self.flags[i]
        return DeviceState(
            idle=bool(f & IDLE),
            charging=bool(f & CHARGING),
            battery_level=self._level(i, t),
            unmetered_network=bool(f & UNMETERED),
        )

    def next_change(self, t: float) -> float | None:
        """The first change time strictly after ``t``, or ``None`` if nothing changes again."""
        i = bisect_right(self.times, t)
        if i == 0:  # before the run the first segment holds; times[0] is no change
            i = 1
        return self.times[i] if i < len(self.times) else None

    def intervals(self, mask: int = AVAILABLE, *, until: float = math.inf) -> tuple[np.ndarray, np.ndarray]:
        """Start and end times of the maximal spans in which every flag of ``mask`` holds,
        cut at ``until`` (the last span of a step function never ends)."""
        starts: list[float] = []
        ends: list[float] = []
        inside = False
        times, flags = self.times, self.flags
        for i in range(len(times)):
            t = times[i]
            if t >= until:
                break
            holds = flags[i] & mask == mask
            if holds and not inside:
                starts.append(t)
                inside = True
            elif not holds and inside:
                ends.append(t)
                inside = False
        if inside:
            ends.append(until)
        return np.asarray(starts, dtype=np.float64), np.asarray(ends, dtype=np.float64)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Availability):
            return NotImplemented
        return (
            self.times == other.times
            and self.flags == other.flags
            and self.battery == other.battery
            and self.rate == other.rate
            and self.floor == other.floor
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.times)} segments)"


def count_available(
    availabilities: Iterable[Availability], times: Sequence[float] | np.ndarray, *, mask: int = AVAILABLE
) -> np.ndarray:
    """How many devices are available at each of ``times``: one sort of all spans, then two
    binary searches per sample, so a day of 100,000 devices is counted in well under a second."""
    starts, ends = [], []
    for availability in availabilities:
        s, e = availability.intervals(mask)
        starts.append(s)
        ends.append(e)
    if not starts:
        return np.zeros(len(times), dtype=np.int64)
    s = np.sort(np.concatenate(starts))
    e = np.sort(np.concatenate(ends))
    t = np.asarray(times, dtype=np.float64)
    return (np.searchsorted(s, t, side="right") - np.searchsorted(e, t, side="right")).astype(np.int64)


class BatteryRates:
    """Battery rates per second by flags (charging beats idle beats active), and the floor."""

    __slots__ = ("charge", "idle", "active", "floor")

    def __init__(
        self, charge_per_hour: float, idle_drain_per_hour: float, active_drain_per_hour: float, floor: float
    ) -> None:
        self.charge = charge_per_hour / _HOUR
        self.idle = -idle_drain_per_hour / _HOUR
        self.active = -active_drain_per_hour / _HOUR
        self.floor = floor

    def rate(self, flags: int) -> float:
        if flags & CHARGING:
            return self.charge
        return self.idle if flags & IDLE else self.active


def build_availability(
    segments: Sequence[tuple[float, int]], *, battery_start: float, battery_config: BatteryRates
) -> Availability:
    """A step function from ``(time, flags)`` changes (sorted, the first at or before 0), with the
    battery integrated over it and its low-threshold crossings added as change points."""
    rates = battery_config
    times = array("d")
    flags = bytearray()
    battery = array("d")
    rate = array("d")
    level = battery_start
    n = len(segments)
    for k in range(n):
        t0, f = segments[k]
        t0 = max(t0, 0.0)
        t1 = segments[k + 1][0] if k + 1 < n else math.inf
        r = rates.rate(f)
        low = level < BATTERY_LOW_FRACTION or (level == BATTERY_LOW_FRACTION and r < 0.0)
        times.append(t0)
        flags.append(f | (BATTERY_LOW if low else 0))
        battery.append(level)
        rate.append(r)
        # A crossing of the low-battery threshold inside the segment is a change of state (the
        # last segment runs forever, so its crossing may lie past the horizon).
        if r != 0.0 and (low if r > 0.0 else not low and rates.floor < BATTERY_LOW_FRACTION):
            tc = t0 + (BATTERY_LOW_FRACTION - level) / r
            if t0 < tc < t1:
                times.append(tc)
                flags.append(f | (0 if r > 0.0 else BATTERY_LOW))
                battery.append(BATTERY_LOW_FRACTION)
                rate.append(r)
        if k + 1 < n:
            level = min(1.0, max(rates.floor, level + r * (t1 - t0)))
    return Availability(times, bytes(flags), battery, rate, rates.floor)


def model_availability(
    config: AvailabilitySection, rng: random.Random, *, utc_offset_h: float, start_utc_hour: float, horizon_s: float
) -> Availability:
    """Draw one device's conditions for ``[0, horizon_s]`` from the diurnal model.

    All draws come from ``rng`` in a fixed order, so a device's conditions depend only on its
    own stream (and not on how many other devices there are)."""
    night, day, screen = config.night, config.day, config.screen_on
    local0 = start_utc_hour + utc_offset_h  # local hour at simulated time 0
    horizon_h = horizon_s / _HOUR
    habit = night.start_h + rng.gauss(0.0, night.start_device_sd_h) if night.start_device_sd_h else night.start_h
    home_wifi = rng.random() < night.home_wifi_share
    battery_start = rng.uniform(config.battery.start_min, config.battery.start_max)

    # Jitters are clipped at 3 standard deviations and day charges at 8 mean durations, so each
    # day's windows lie in a known band of hours and days that cannot reach the run are skipped.
    daily_sd = night.start_daily_sd_h
    night_d_lo = max(night.min_duration_h, night.duration_h - 3.0 * night.duration_sd_h)
    night_d_hi = max(night.min_duration_h, night.duration_h + 3.0 * night.duration_sd_h)
    day_d_max = 8.0 * day.mean_duration_h
    band_lo = min(habit - 3.0 * daily_sd - night.wifi_before_h, day.from_h)
    band_hi = max(habit + 3.0 * daily_sd + night_d_hi + night.wifi_after_h, day.to_h + day_d_max)
    end_h = local0 + horizon_h

    # Boundaries as (local hour, bit, +1/-1); counting lets windows overlap freely.
    events: list[tuple[float, int, int]] = []
    idle_spans: list[tuple[float, float]] = []
    first_day = math.floor((local0 - band_hi) / 24.0)
    last_day = math.ceil((end_h - band_lo) / 24.0)
    day_span = day.to_h - day.from_h
    day_rate = day.sessions_per_day / day_span if day_span > 0 else 0.0
    for k in range(first_day, last_day + 1):
        base = 24.0 * k
        if base + band_hi <= local0 or base + band_lo >= end_h:
            continue
        if rng.random() < night.probability:
            s = base + habit + (_clipped_gauss(rng, daily_sd) if daily_sd else 0.0)
            d = night.duration_h + (_clipped_gauss(rng, night.duration_sd_h) if night.duration_sd_h else 0.0)
            d = min(night_d_hi, max(night_d_lo, d))
            events.append((s, CHARGING, 1))
            events.append((s + d, CHARGING, -1))
            idle_spans.append((s, s + d))
            if home_wifi:
                events.append((s - night.wifi_before_h, UNMETERED, 1))
                events.append((s + d + night.wifi_after_h, UNMETERED, -1))
        if day_rate > 0.0:
            u = base + day.from_h + rng.expovariate(day_rate)
            while u < base + day.to_h:
                d = min(day_d_max, rng.expovariate(1.0 / day.mean_duration_h))
                events.append((u, CHARGING, 1))
                events.append((u + d, CHARGING, -1))
                if rng.random() < day.unmetered_prob:
                    events.append((u, UNMETERED, 1))
                    events.append((u + d, UNMETERED, -1))
                if rng.random() < day.idle_prob:
                    idle_spans.append((u, u + d))
                u += rng.expovariate(day_rate)
    # Screen-on interruptions while the phone would be idle end its idleness for a while (only
    # drawn for idle spans that reach into the run: outside it they change nothing).
    screen_rate = screen.per_hour
    screen_mean_h = screen.mean_minutes / 60.0
    for a, b in idle_spans:
        events.append((a, IDLE, 1))
        events.append((b, IDLE, -1))
        if screen_rate > 0.0 and b > local0 and a < end_h:
            u = a + rng.expovariate(screen_rate)
            while u < b:
                d = rng.expovariate(1.0 / screen_mean_h)
                events.append((u, _SCREEN_ON, 1))
                events.append((u + d, _SCREEN_ON, -1))
                u += d + rng.expovariate(screen_rate)

    segments = _sweep(events, local0, horizon_h)
    battery = config.battery
    rates = BatteryRates(
        battery.charge_per_hour, battery.idle_drain_per_hour, battery.active_drain_per_hour, battery.floor
    )
    return build_availability(segments, battery_start=battery_start, battery_config=rates)


def _clipped_gauss(rng: random.Random, sd: float) -> float:
    x = rng.gauss(0.0, sd)
    return x if -3.0 * sd <= x <= 3.0 * sd else math.copysign(3.0 * sd, x)


def _sweep(events: list[tuple[float, int, int]], local0: float, horizon_h: float) -> list[tuple[float, int]]:
    """Counted boundaries in local hours -> ``(simulated seconds, flags)`` at each change in
    ``[0, horizon)``; the first entry is the state at time 0."""
    events.sort()
    counts = [0] * 5  # indexed by _SCREEN_ON (0), IDLE, CHARGING, UNMETERED
    n = len(events)
    i = 0
    while i < n and events[i][0] <= local0:
        counts[events[i][1]] += events[i][2]
        i += 1
    current = _flags(counts)
    out = [(0.0, current)]
    end_h = local0 + horizon_h
    while i < n:
        t = events[i][0]
        if t >= end_h:
            break
        while i < n and events[i][0] == t:
            counts[events[i][1]] += events[i][2]
            i += 1
        f = _flags(counts)
        if f != current:
            out.append(((t - local0) * _HOUR, f))
            current = f
    return out


def _flags(counts: list[int]) -> int:
    return (
        (IDLE if counts[IDLE] > 0 and counts[_SCREEN_ON] == 0 else 0)
        | (CHARGING if counts[CHARGING] > 0 else 0)
        | (UNMETERED if counts[UNMETERED] > 0 else 0)
    )
