"""Availability traces: recorded device conditions that a simulation replays instead of the model.

The format is CSV with a header and one row per span in which a device's conditions hold:

    device,start,end,state
    d000000,0.0,5400.25,idle+charging+unmetered
    d000000,5400.25,5580.0,charging+unmetered
    d000001,3600.0,30600.0,charging

- ``device``: the device id (``d`` and the six-digit index: ``d000042`` is device 42 of the
  fleet, whose other properties the fleet config still draws);
- ``start``, ``end``: simulated seconds since the run's start, ``0 <= start < end`` (not dates
  and times, nor Unix times: a trace every span of which starts after the run is refused);
- ``state``: the conditions that hold, ``+``-joined from ``idle``, ``charging``, ``unmetered``
  (in any order), or ``none``.

Rows of one device must not overlap; they may come in any order. Where a device has no row,
none of its conditions hold, and a device without rows is never available. The battery is not
recorded: the replay starts each device at the middle of the config's battery start range and
integrates the config's battery rates over the replayed states. ``write_traces`` writes the
model's spans in this format, so a trace it writes replays to the same conditions.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import cast

from .availability import AVAILABLE, Availability
from .config import FleetConfig
from .population import generate_population

# reading traces lives in the leaf module .trace_format (populations read them); re-exported here
from .trace_format import (
    HEADER,
    TraceAvailability,
    TraceError,
    format_state,
    load_traces,
    never_available,
    parse_state,
)

__all__ = [
    "HEADER",
    "TraceAvailability",
    "TraceError",
    "format_state",
    "load_traces",
    "never_available",
    "parse_state",
    "write_traces",
]


def write_traces(config: FleetConfig, path: str | Path) -> int:
    """Write the model's availability for every device of ``config`` over its run; returns the
    number of rows. Ignores ``availability.trace``: traces come from the model."""
    model = config.model_copy(update={"availability": config.availability.model_copy(update={"trace": None})})
    horizon = config.horizon_s
    rows = 0
    with Path(path).open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(HEADER)
        for spec in generate_population(model):
            availability = cast(Availability, spec.availability)  # the model's: traces are ignored here
            times, flags = availability.times, availability.flags
            n = len(times)
            i = 0
            while i < n:
                f = flags[i] & AVAILABLE
                j = i + 1
                while j < n and flags[j] & AVAILABLE == f:  # battery-only change points
                    j += 1
                end = times[j] if j < n else horizon
                if f and end > times[i]:
                    writer.writerow((spec.device_id, repr(times[i]), repr(end), format_state(f)))
                    rows += 1
                i = j
    return rows
