"""The tables a fleet simulation records: one row per device session, per round, per sample of
the timeline (their types and CSV format are :mod:`.rows`'), and the run that holds them.

They are the interface between the simulator (which fills them) and the report (which reads
them), and they are what a run leaves on disk.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# the rows and their CSV format live in the leaf module .rows; re-exported here, where the
# simulator, the report and users have always imported them
from .rows import (
    UNFINISHED,
    CsvTable,
    FleetTableError,
    RoundRow,
    SessionRow,
    TimelineRow,
    one_row_per_seat,
    unfinished_rounds,
    with_attempts,
    with_round_bytes,
)
from .summary import summarize

if TYPE_CHECKING:  # the config module is the population model's; the tables only carry it
    from .config import FleetConfig

__all__ = [
    "ROUNDS_CSV",
    "SESSIONS_CSV",
    "TIMELINE_CSV",
    "UNFINISHED",
    "CsvTable",
    "FleetRun",
    "FleetTableError",
    "RoundRow",
    "SessionRow",
    "TimelineRow",
    "one_row_per_seat",
    "unfinished_rounds",
    "with_attempts",
    "with_round_bytes",
]


SESSIONS_CSV = "sessions.csv"
ROUNDS_CSV = "rounds.csv"
TIMELINE_CSV = "timeline.csv"


@dataclass
class FleetRun:
    """Everything a simulation produced.

    ``digest`` is the hex SHA-256 over the round history and every committed model's bytes, in
    order: two runs with the same config and seed have the same digest. ``wall_s`` is the wall
    time the run took. ``simulated_s`` is the simulated span; when left out it is the config's
    horizon, or without a config the latest time any table mentions. ``errors`` counts, by kind,
    the sessions that ended in an error (a device that lost its network mid-request ends in
    ``ServerUnreachable``, say). ``devices_short_of_memory``: devices above the fleet's memory
    floor whose memory cannot hold the plan, so they took no part (None when not recorded);
    ``plan_cost``: what the plan costs a device (``FleetSimulator.plan_summary``).
    """

    sessions: list[SessionRow]
    rounds: list[RoundRow]
    timeline: list[TimelineRow]
    digest: str
    config: FleetConfig | None = None
    wall_s: float = 0.0
    simulated_s: float | None = None
    errors: dict[str, int] = field(default_factory=dict)
    #: What the simulator measured beyond the tables (the summary's ``client_accuracy_percentiles``,
    #: ``task_file``, ``tasks``, ``data``, ``data_clients``, ``devices_per_client``, ``chance_accuracy``).
    extra: dict[str, Any] = field(default_factory=dict)
    devices_short_of_memory: int | None = None
    plan_cost: dict[str, Any] | None = None

    @property
    def span_s(self) -> float:
        """Simulated seconds the run covered."""
        if self.simulated_s is not None:
            return float(self.simulated_s)
        if self.config is not None:
            return float(self.config.horizon_s)
        ends = [r.end_s for r in self.sessions] + [r.end_s for r in self.rounds] + [r.t_s for r in self.timeline]
        finite = [t for t in ends if math.isfinite(t)]
        return max(finite, default=0.0)

    def write_tables(self, out_dir: str | os.PathLike) -> None:
        """``sessions.csv``, ``rounds.csv`` and ``timeline.csv`` in ``out_dir`` (created if missing)."""
        os.makedirs(out_dir, exist_ok=True)
        SessionRow.to_csv(self.sessions, os.path.join(out_dir, SESSIONS_CSV))
        RoundRow.to_csv(self.rounds, os.path.join(out_dir, ROUNDS_CSV))
        TimelineRow.to_csv(self.timeline, os.path.join(out_dir, TIMELINE_CSV))

    def summary(self) -> dict[str, Any]:
        """The run's headline figures (see :func:`emulator.fleet.summary.summarize`)."""
        return summarize(self)
