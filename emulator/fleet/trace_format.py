"""Reading availability traces: the CSV format that :mod:`emulator.fleet.traces` documents, parsed
into each device's replayed conditions.

A leaf module of the fleet package (it imports only the availability model and the config):
populations read traces through it, and :mod:`.traces` writes them from a population, so neither
imports the other back.
"""

from __future__ import annotations

import csv
import re
from array import array
from pathlib import Path
from typing import TextIO

from .availability import CHARGING, IDLE, UNMETERED, Availability, BatteryRates, build_availability
from .config import Battery

HEADER = ("device", "start", "end", "state")
_NAMES = {"idle": IDLE, "charging": CHARGING, "unmetered": UNMETERED}
_DEVICE = re.compile(r"^d(\d{6,})$")


class TraceError(ValueError):
    """A trace file that does not follow the documented format; the message says where."""


class TraceAvailability(Availability):
    """A device's conditions replayed from a trace, with the same interface as the model's."""

    __slots__ = ()

    @classmethod
    def from_spans(cls, spans: list[tuple[float, float, int]], *, battery: Battery = Battery()) -> TraceAvailability:
        """``spans`` are ``(start, end, flags)``, sorted and not overlapping."""
        segments: list[tuple[float, int]] = [(0.0, 0)]
        for start, end, flags in spans:
            segments.append((start, flags))
            segments.append((end, 0))
        merged: list[tuple[float, int]] = []
        for t, f in segments:
            if merged and merged[-1][0] == t:
                merged.pop()
            if not merged or merged[-1][1] != f:
                merged.append((t, f))
        rates = BatteryRates(
            battery.charge_per_hour, battery.idle_drain_per_hour, battery.active_drain_per_hour, battery.floor
        )
        base = build_availability(
            merged, battery_start=(battery.start_min + battery.start_max) / 2, battery_config=rates
        )
        return cls(base.times, base.flags, base.battery, base.rate, base.floor)


def never_available() -> Availability:
    """A device that a trace does not mention: nothing ever holds."""
    return Availability(array("d", [0.0]), bytes([0]), array("d", [0.5]), array("d", [0.0]), 0.0)


def format_state(flags: int) -> str:
    names = [name for name, bit in _NAMES.items() if flags & bit]
    return "+".join(names) if names else "none"


def parse_state(text: str) -> int:
    text = text.strip()
    if text == "none":
        return 0
    flags = 0
    for part in text.split("+"):
        bit = _NAMES.get(part.strip())
        if bit is None:
            raise ValueError(f"unknown condition {part!r}; use idle, charging, unmetered joined by '+', or none")
        flags |= bit
    return flags


def load_traces(
    path: str | Path, *, devices: int | None = None, battery: Battery = Battery()
) -> dict[str, TraceAvailability]:
    """Read a trace file into each device's availability. With ``devices``, a row naming a device
    outside a fleet of that size is an error (the trace was made for a bigger fleet)."""
    path = Path(path)
    try:
        handle = path.open(newline="", encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(
            f"no availability trace at {path}; fix availability.trace or write one with write_traces"
        ) from None
    except OSError as exc:  # a folder, a file without read permission
        raise TraceError(
            f"cannot read the availability trace {path} ({exc.strerror or exc}); fix availability.trace"
        ) from None
    try:
        with handle:
            return _read_traces(path, handle, devices=devices, battery=battery)
    except UnicodeDecodeError as exc:
        raise TraceError(
            f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); a trace is a CSV file"
        ) from None


def _read_traces(path: Path, handle: TextIO, *, devices: int | None, battery: Battery) -> dict[str, TraceAvailability]:
    """``load_traces`` past opening the file: its rows checked line by line, then each device's spans."""
    spans: dict[str, list[tuple[float, float, int]]] = {}
    reader = csv.reader(handle)
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header) != HEADER:
        raise TraceError(f"{path}: the first line must be the header {','.join(HEADER)}; got {header}")
    for line, row in enumerate(reader, start=2):
        if not row:
            continue
        if len(row) != 4:
            raise TraceError(f"{path}:{line}: expected 4 columns {','.join(HEADER)}; got {len(row)}")
        device, start_text, end_text, state = row
        match = _DEVICE.match(device)
        if match is None:
            raise TraceError(f"{path}:{line}: device {device!r} is not an id such as d000042")
        if devices is not None and int(match.group(1)) >= devices:
            raise TraceError(
                f"{path}:{line}: device {device} is outside a fleet of {devices} devices; raise fleet.devices"
            )
        try:
            start, end = float(start_text), float(end_text)
            flags = parse_state(state)
        except ValueError as exc:
            raise TraceError(f"{path}:{line}: {exc}") from None
        if not (0.0 <= start < end < float("inf")):
            raise TraceError(f"{path}:{line}: need 0 <= start < end (finite seconds); got {start_text}, {end_text}")
        spans.setdefault(device, []).append((start, end, flags))
    out: dict[str, TraceAvailability] = {}
    for device, rows in spans.items():
        rows.sort()
        for (_, e0, _), (s1, _, _) in zip(rows, rows[1:]):
            if s1 < e0:
                raise TraceError(f"{path}: device {device} has overlapping spans at {s1} (before {e0}); merge them")
        out[device] = TraceAvailability.from_spans(rows, battery=battery)
    return out
