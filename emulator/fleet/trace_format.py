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
    path: str | Path, *, devices: int | None = None, battery: Battery = Battery(), horizon_s: float | None = None
) -> dict[str, TraceAvailability]:
    """Read a trace file into each device's availability. With ``devices``, a row naming a device
    outside a fleet of that size is an error (the trace was made for a bigger fleet); with
    ``horizon_s``, so is a trace every span of which starts after the run (Unix times, say, where
    the format counts seconds from the run's start). A spreadsheet's byte order mark is read past."""
    path = Path(path)
    try:
        handle = path.open(newline="", encoding="utf-8-sig")
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
            return _read_traces(path, handle, devices=devices, battery=battery, horizon_s=horizon_s)
    except UnicodeDecodeError as exc:
        raise TraceError(
            f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); a trace is a CSV file"
        ) from None


def _seconds(text: str, where: str, column: str) -> float:
    """A start or end column's seconds; a date and time (what a log records) is told to be made one."""
    try:
        return float(text)
    except ValueError:
        if re.search(r"\d[-/]\d", text) and ":" in text:
            raise TraceError(
                f"{where}: {column} {text.strip()!r} is a date and time; a trace's times are seconds since the run's "
                "start (subtract the run's first instant, time zones included, and write the difference in seconds)"
            ) from None
        raise TraceError(f"{where}: {column} {text.strip()!r} is not a number of seconds") from None


def _read_traces(
    path: Path, handle: TextIO, *, devices: int | None, battery: Battery, horizon_s: float | None = None
) -> dict[str, TraceAvailability]:
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
        start, end = _seconds(start_text, f"{path}:{line}", "start"), _seconds(end_text, f"{path}:{line}", "end")
        try:
            flags = parse_state(state)
        except ValueError as exc:
            raise TraceError(f"{path}:{line}: {exc}") from None
        if not (0.0 <= start < end < float("inf")):
            raise TraceError(f"{path}:{line}: need 0 <= start < end (finite seconds); got {start_text}, {end_text}")
        spans.setdefault(device, []).append((start, end, flags))
    first = min((rows[0][0] for rows in spans.values()), default=None)
    if horizon_s is not None and first is not None and first >= horizon_s:
        raise TraceError(
            f"{path}: every span starts after the run's {horizon_s / 3600:g} hours (the first at {first:.15g} s, "
            f"{first / 86400:,.0f} days in); a trace's times are seconds since the run's start: Unix times need the "
            "run's first instant subtracted"
        )
    out: dict[str, TraceAvailability] = {}
    for device, rows in spans.items():
        rows.sort()
        for (_, e0, _), (s1, _, _) in zip(rows, rows[1:]):
            if s1 < e0:
                raise TraceError(f"{path}: device {device} has overlapping spans at {s1} (before {e0}); merge them")
        out[device] = TraceAvailability.from_spans(rows, battery=battery)
    return out
