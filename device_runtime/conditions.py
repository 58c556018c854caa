"""Device conditions and the app's training constraints (Android's TrainingConstraints)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .errors import InvalidSetting

BATTERY_LOW_FRACTION = 0.15


@dataclass(frozen=True)
class DeviceState:
    """The device as the app's ``DeviceConditions.current()`` sees it now: ``idle`` (the screen
    off, no user activity), ``charging``, ``battery_level`` (a fraction from 0.0 to 1.0),
    ``unmetered_network`` (Wi-Fi rather than mobile data) and ``network_available``."""

    idle: bool
    charging: bool
    battery_level: float
    unmetered_network: bool
    network_available: bool = True


def check_state(state: object) -> DeviceState:
    """``state`` if it is a ``DeviceState`` an app's conditions may give, else ``InvalidSetting``
    saying what is wrong with it: a flag of "no" (true, being a non-empty string) had a device
    train on a metered network."""
    if not isinstance(state, DeviceState):
        raise InvalidSetting(
            f"the device's conditions gave {type(state).__name__} {state!r:.100}, not a DeviceState: current() "
            f"returns DeviceState(idle=..., charging=..., battery_level=..., unmetered_network=...)"
        )
    for name in ("idle", "charging", "unmetered_network", "network_available"):
        if not isinstance(getattr(state, name), (bool, np.bool_)):  # a sensor's numpy flag is one
            raise InvalidSetting(f"DeviceState.{name} is True or False, not {getattr(state, name)!r:.100}")
    level = state.battery_level
    if isinstance(level, (bool, np.bool_)) or not isinstance(level, numbers.Real) or not 0.0 <= level <= 1.0:
        raise InvalidSetting(f"DeviceState.battery_level is a fraction from 0.0 to 1.0, not {level!r:.100}")
    return state


class DeviceConditions(Protocol):
    """Where the runtime reads the device's state: the emulator's device, or the app."""

    def current(self) -> DeviceState: ...


@dataclass(frozen=True)
class TrainingConstraints:
    """What must hold for the runtime to train; the defaults are the paper's: idle, charging,
    unmetered network. ``requires_battery_not_low`` is the alternative to charging."""

    requires_idle: bool = True
    requires_charging: bool = True
    requires_battery_not_low: bool = False
    requires_unmetered_network: bool = True

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, bool):  # "no" or 0.5 held as true, and the job stored them so
                raise InvalidSetting(f"TrainingConstraints.{name} is True or False, not {value!r:.100}")

    def unmet(self, state: DeviceState) -> list[str]:
        """Names of the constraints that do not hold now (empty: training may run). Raises
        ``InvalidSetting`` for a state that is not a ``DeviceState`` of bools and a battery level
        from 0 to 1 (the app's ``current()`` is read here once a run, so a wrong one is named at
        the job's first run; between training steps ``satisfied`` trusts it)."""
        check_state(state)
        out = []
        if not state.network_available:
            out.append("network")
        if self.requires_idle and not state.idle:
            out.append("idle")
        if self.requires_charging and not state.charging:
            out.append("charging")
        if self.requires_battery_not_low and not state.charging and state.battery_level < BATTERY_LOW_FRACTION:
            out.append("battery_not_low")
        if self.requires_unmetered_network and not state.unmetered_network:
            out.append("unmetered_network")
        return out

    def satisfied(self, state: DeviceState) -> bool:
        """Whether nothing is ``unmet`` (asked between every two training steps, so without the list)."""
        return bool(
            state.network_available
            and (state.idle or not self.requires_idle)
            and (state.charging or not self.requires_charging)
            and (state.charging or not self.requires_battery_not_low or state.battery_level >= BATTERY_LOW_FRACTION)
            and (state.unmetered_network or not self.requires_unmetered_network)
        )


@dataclass(frozen=True)
class TrainingInterval:
    """One-time participation, or recurrent with at least ``min_interval_s`` between sessions."""

    recurrent: bool = False
    min_interval_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.min_interval_s, bool) or not isinstance(self.min_interval_s, (int, float)):
            raise InvalidSetting(f"min_interval_s is a number of seconds, not {self.min_interval_s!r}")
        if not (0 <= self.min_interval_s < math.inf):
            raise InvalidSetting(f"min_interval_s must be finite and not negative, not {self.min_interval_s!r}")
        if self.recurrent and self.min_interval_s <= 0:
            raise InvalidSetting("a recurrent interval needs min_interval_s > 0")


@dataclass
class StaticConditions:
    """Conditions an app or a test sets by hand."""

    state: DeviceState

    def current(self) -> DeviceState:
        return self.state
