"""Emulated device conditions that change over (virtual) time: a phone is idle, charging and on
Wi-Fi mostly at night in its own time zone (the paper's diurnal pattern, Fig. 5)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from device_runtime.clock import Clock
from device_runtime.conditions import DeviceState

DAY_S = 86_400.0


@dataclass
class DiurnalConditions:
    """Charging, idle and on an unmetered network between ``night_start_h`` and ``night_end_h``
    local time (device-specific, jittered by up to an hour); otherwise in use on a battery that
    drains. ``utc_offset_h`` places the device in its time zone."""

    clock: Clock
    utc_offset_h: float = 0.0
    night_start_h: float = 23.0
    night_end_h: float = 6.0
    seed: int = 0

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self._start = (self.night_start_h + rng.uniform(-1, 1)) % 24
        self._end = (self.night_end_h + rng.uniform(-1, 1)) % 24

    def local_hour(self) -> float:
        return ((self.clock.now() + self.utc_offset_h * 3600.0) % DAY_S) / 3600.0

    def at_night(self) -> bool:
        h = self.local_hour()
        if self._start <= self._end:
            return self._start <= h < self._end
        return h >= self._start or h < self._end

    def current(self) -> DeviceState:
        night = self.at_night()
        hours_awake = (self.local_hour() - self._end) % 24
        battery = 1.0 if night else max(0.05, 1.0 - 0.05 * hours_awake)
        return DeviceState(idle=night, charging=night, battery_level=battery, unmetered_network=night)
