"""The rows a fleet simulation records (one per device session, per round, per sample of the
timeline) and their CSV format.

CSV is the format because a user opens it in anything; each table writes its columns in
declaration order and every float as its shortest exact decimal (``repr``), so writing a table and
reading it back gives the same values, and the same run writes the same bytes.

A leaf module: :mod:`.summary` computes a run's figures from these rows and :mod:`.tables` holds
the run (whose ``summary()`` is those figures), so neither has to import the other back.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import typing
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self


class FleetTableError(ValueError):
    """A table file that is not what the fleet simulator writes (wrong columns or values)."""


def _format(value: Any, kind: type, column: str) -> str:
    # Converted first so numpy scalars write the same text as Python's (repr(np.float64) differs).
    if kind is bool:
        if value not in (True, False):
            raise FleetTableError(f"column {column!r} holds a bool, got {value!r}")
        return "true" if value else "false"
    if kind is int:
        return str(int(value))
    if kind is float:
        return repr(float(value))
    return str(value)


def _parse(text: str, kind: type, column: str, where: str) -> Any:
    try:
        if kind is bool:
            if text not in ("true", "false"):
                raise ValueError(text)
            return text == "true"
        if kind is int:
            return int(text)
        if kind is float:
            value = float(text)
            return math.nan if value != value else value  # the one NaN: rows read back compare equal
    except ValueError:
        raise FleetTableError(f"{where}: column {column!r} holds a {kind.__name__}, got {text!r}") from None
    return text


class CsvTable:
    """CSV reading and writing for a row dataclass, driven by its field annotations.

    Columns may be ``str``, ``int``, ``float`` (NaN and infinities allowed) or ``bool``.
    """

    _columns: ClassVar[tuple[tuple[str, type], ...]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._columns = ()  # filled on first use: the dataclass decorator runs after this hook

    @classmethod
    def columns(cls) -> tuple[tuple[str, type], ...]:
        """(name, type) of every column, in order."""
        if not cls._columns:
            hints = typing.get_type_hints(cls)
            cls._columns = tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))  # type: ignore[arg-type]
        return cls._columns

    @classmethod
    def to_csv(cls, rows: Iterable[Self], path: str | os.PathLike) -> None:
        """Write ``rows`` to ``path``: a header line, then one line per row (RFC 4180: CRLF line
        ends, so a cell holding a lone ``\\r`` is quoted and reads back whole)."""
        columns = cls.columns()
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, lineterminator="\r\n")
            writer.writerow([name for name, _ in columns])
            for row in rows:
                if not isinstance(row, cls):
                    raise FleetTableError(f"{cls.__name__}.to_csv got a {type(row).__name__}; pass {cls.__name__} rows")
                writer.writerow([_format(getattr(row, name), kind, name) for name, kind in columns])

    @classmethod
    def from_csv(cls, path: str | os.PathLike) -> list[Self]:
        """Read a table written by :meth:`to_csv`."""
        columns = cls.columns()
        expected = [name for name, _ in columns]
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            fields = dataclasses.fields(cls)  # type: ignore[arg-type]
            defaults = {fd.name for fd in fields if fd.default is not dataclasses.MISSING}
            older = header is not None and 0 < len(header) < len(expected) and header == expected[: len(header)]
            if header is not None and older and set(expected[len(header) :]) <= defaults:
                columns = columns[: len(header)]  # a table written before its last columns were added
            elif header != expected:
                raise FleetTableError(
                    f"{os.fspath(path)} is not a {cls.__name__} table: expected the columns {expected}, "
                    f"found {header}; write it with {cls.__name__}.to_csv"
                )
            rows = []
            for line_no, values in enumerate(reader, start=2):
                where = f"{os.fspath(path)} line {line_no}"
                if len(values) != len(columns):
                    raise FleetTableError(f"{where} has {len(values)} values, the table has {len(columns)} columns")
                parsed = {name: _parse(text, kind, name, where) for (name, kind), text in zip(columns, values)}
                rows.append(cls(**parsed))
            return rows


#: The outcome of a session the run's end cut: the device was seated and its report not yet
#: answered when the simulation stopped (its row ends at the horizon).
UNFINISHED = "unfinished"


@dataclass(frozen=True)
class SessionRow(CsvTable):
    """One check-in and what followed it, as the device saw it (paper, Table 1).

    A rejected check-in is a session too (shape ``-``, empty ``session_id`` and ``round_id``), so
    the table also counts how often devices came back. Times are simulated seconds since the run
    started; ``local_hour`` is the device's local hour of day at ``start_s``. ``round_id`` is the
    round as the device was told it (``task/number``); ``attempt`` is the attempt of that round
    that seated the device, as the server recorded it (the device is not told: a round abandoned
    is tried again under its number), so ``round_attempt`` names the row of ``rounds.csv``. It is 0
    where no round seated the device (a rejected check-in, a check-in whose answer never arrived)
    and in a table written before the column. ``outcome`` is the participation job's
    (``completed``, ``report_rejected``, ``interrupted``, ``error``; ``rejected`` for a rejected
    check-in), ``app_killed`` for a session the OS ended, or ``unfinished`` (``UNFINISHED``) for
    one the run's end cut. ``summed``: the server counted the session's report in its round (a
    plain report taken in time, or a masked input its Secure Aggregation group summed), as
    ``RoundRow.accepted`` counts it; under Secure Aggregation a device interrupted or killed after
    its masked input went in (shape ``-v[]+!`` or ``-v[]+``) is summed all the same, its masks
    recovered from its peers' shares. False in a table written before the column.
    ``code``: why the session ended as it did, in the words of whoever ended it: for a refused
    report (shape ending ``#``, outcome ``report_rejected``) the server's error code
    (``INVALID_UPDATE``, ``ROUND_CLOSED``, ...; the device's own refusal of an update that is not
    valid, trained to NaN, is ``INVALID_UPDATE`` as the server's would be); for a rejected check-in
    the server's reason (``RUNTIME_VERSION_UNSUPPORTED``, ``INELIGIBLE:POLICY``, its pace
    steering's ``ROUND_FULL`` or ``ROUND_NOT_OPEN`` ...); for an ``error`` the device's typed error (``PlanError``,
    ``NoExamples``, ``OverBudget``, ``ServerUnreachable`` ...); for an ``interrupted`` session the
    reason it was stopped (``over the device's training time (600.0 s, max_training_s)``, or
    ``interrupted`` when its conditions stopped holding). Empty for a completed, killed or
    unfinished session, and in a table written before the column.

    One row per seat: a device that checked in again while the server still held its seat (its app
    killed, say) got that same session back (one of the round's ``selected``), and its row
    covers both check-ins (``one_row_per_seat``): it starts at the first, ends with the last's
    outcome, its shape is both check-ins' events in order (``-v[`` then ``-v[]+^`` is
    ``-v[-v[]+^``), and its bytes and times add up.
    """

    device_id: str
    session_id: str
    task: str
    round_id: str
    start_s: float
    end_s: float
    shape: str
    outcome: str
    bytes_down: int
    bytes_up: int
    examples: int
    compute_s: float
    network_s: float
    runtime_version: str
    device_class: str
    local_hour: float
    attempt: int = 0
    summed: bool = False
    code: str = ""

    @property
    def accepted(self) -> bool:
        """The server selected the device for a round (the check-in was not rejected)."""
        return self.session_id != ""

    @property
    def round_attempt(self) -> str:
        """The round attempt that seated the device, as ``RoundRow.round_id`` names it
        (``task/number/attempt``); empty when none did (``attempt`` is 0)."""
        return f"{self.round_id}/{self.attempt}" if self.attempt and self.round_id else ""


@dataclass(frozen=True)
class RoundRow(CsvTable):
    """One round attempt as the server ran and recorded it (``round_id`` is ``task/number/attempt``).

    ``selected`` devices were accepted at check-in (as many as the session rows that name the
    attempt, ``SessionRow.round_attempt``); ``reported`` sent a report (in time or not);
    ``accepted`` reports came in time and were summed (in a round that was abandoned too, short of
    its threshold, though it published nothing of them); ``dropped`` selected devices never
    reported (interrupted, killed, lost their network). These are the server's counts, so
    ``reported + dropped`` may fall short of ``selected``: a device still at work when the round
    closed (it reached its goal, or was abandoned) is in neither until its report comes, and a
    report that comes after the server has let the round's sessions go (its last 4 rounds are
    kept) is refused as an unknown session and counted in no round, while the device's session
    row shows it refused (shape ending ``#``). Under Secure Aggregation a device of a group that
    aborted is counted as dropped: its masked input was never summed, though its session row may
    show a report sent and refused; a device of a group that completed is counted as reported
    (``accepted``) when its masked input was summed, an interruption during the rounds after it
    (ConsistencyCheck, Unmasking) included, and its session row is ``summed``. ``accuracy`` and ``loss`` are NaN when the round measured
    neither. ``bytes_down`` and ``bytes_up`` are what the sessions the attempt seated sent and
    received (see :func:`with_round_bytes`); a rejected check-in's bytes belong to no round.
    ``epsilon``: the task's epsilon after the round (its accountant's, published by a DP task's
    committed rounds), NaN without DP or for a round that added nothing to it; inf without noise.
    ``outcome``: ``committed``, ``abandoned``, or ``unfinished`` (``UNFINISHED``) for the attempt
    still open when the run ended, which the server has no record of: its row (see
    :func:`unfinished_rounds`) counts its sessions as the session rows show them, starts at its
    first seated check-in and ends at the horizon, and it is neither committed nor abandoned.
    Empty in a table written before the column, whose rounds are all ``committed`` or not.
    """

    round_id: str
    task: str
    start_s: float
    end_s: float
    committed: bool
    selected: int
    reported: int
    accepted: int
    dropped: int
    duration_s: float
    accuracy: float
    loss: float
    bytes_down: int = 0
    bytes_up: int = 0
    epsilon: float = math.nan
    outcome: str = ""

    @property
    def unfinished(self) -> bool:
        """The attempt was still open when the run ended (neither committed nor abandoned)."""
        return self.outcome == UNFINISHED

    @property
    def abandoned(self) -> bool:
        """The server closed the attempt without committing it."""
        return not self.committed and not self.unfinished


def _reported(s: SessionRow) -> bool:
    """Whether the session's report reached its round: sent (``^`` in time, ``#`` refused) or summed."""
    return s.summed or s.shape.endswith(("^", "#"))


def unfinished_rounds(rounds: list[RoundRow], sessions: list[SessionRow], horizon_s: float) -> list[RoundRow]:
    """A row of outcome ``unfinished`` for each round attempt that seated sessions (their
    ``round_attempt``) but is not among ``rounds`` (the server's records of finished attempts):
    the attempt still open when the run ended. Its counts are its sessions': ``selected`` all of
    them, ``reported`` those that reported (``^`` in time or ``summed``, ``#`` refused), ``accepted``
    the ``^`` and ``summed``,
    ``dropped`` those that ended without a report; it starts at its first seated check-in (the
    server opened it at or before) and ends at ``horizon_s``. In the order the attempts first seated."""
    known = {r.round_id for r in rounds}
    seated: dict[str, list[SessionRow]] = {}
    for s in sessions:
        if s.attempt and s.accepted and s.round_attempt not in known:
            seated.setdefault(s.round_attempt, []).append(s)
    out = []
    for round_id, group in seated.items():
        start = min(s.start_s for s in group)
        reported = [s for s in group if _reported(s)]
        out.append(
            RoundRow(
                round_id=round_id,
                task=group[0].task,
                start_s=start,
                end_s=horizon_s,
                committed=False,
                selected=len(group),
                reported=len(reported),
                accepted=sum(1 for s in reported if s.summed or s.shape.endswith("^")),
                dropped=sum(1 for s in group if s.outcome != UNFINISHED and not _reported(s)),
                duration_s=horizon_s - start,
                accuracy=math.nan,
                loss=math.nan,
                outcome=UNFINISHED,
            )
        )
    return sorted(out, key=lambda r: r.start_s)


def with_attempts(
    sessions: list[SessionRow], seated: Mapping[str, int], summed: Collection[str] = ()
) -> list[SessionRow]:
    """``sessions`` with each accepted one's ``attempt`` from ``seated`` (the attempt that seated
    each session, by session id, as the server recorded it; a session it does not name keeps its
    own), and ``summed`` set on the sessions whose reports the server counted (``summed``: their ids)."""
    summed = set(summed)
    return [
        dataclasses.replace(s, attempt=seated[s.session_id], summed=s.summed or s.session_id in summed)
        if s.session_id in seated
        else s
        for s in sessions
    ]


def one_row_per_seat(sessions: list[SessionRow]) -> list[SessionRow]:
    """``sessions`` with the rows of one seat made one (see ``SessionRow``): a device killed and
    checked in again while the server held its seat has one row per check-in under the same session
    id. The merged row stands where the seat's last row stood (the rows are in the order they ended)."""
    rows: dict[str, list[SessionRow]] = {}
    for s in sessions:
        if s.session_id:
            rows.setdefault(s.session_id, []).append(s)
    if all(len(group) == 1 for group in rows.values()):
        return sessions
    out = []
    for s in sessions:
        group = rows.get(s.session_id) if s.session_id else None
        if group is None or len(group) == 1:
            out.append(s)
        elif s is group[-1]:
            first = group[0]
            out.append(
                dataclasses.replace(
                    s,
                    start_s=first.start_s,
                    shape="".join(r.shape for r in group),
                    bytes_down=sum(r.bytes_down for r in group),
                    bytes_up=sum(r.bytes_up for r in group),
                    examples=sum(r.examples for r in group),
                    compute_s=round(sum(r.compute_s for r in group), 6),
                    network_s=round(sum(r.network_s for r in group), 6),
                    local_hour=first.local_hour,
                    summed=any(r.summed for r in group),
                )
            )
    return out


def with_round_bytes(rounds: list[RoundRow], sessions: list[SessionRow]) -> list[RoundRow]:
    """``rounds`` with ``bytes_down`` and ``bytes_up`` summed from the sessions each round attempt
    seated (``SessionRow.round_attempt``). A session that names no attempt (a rejected check-in)
    belongs to no round."""
    index = {r.round_id: i for i, r in enumerate(rounds)}
    down = [0] * len(rounds)
    up = [0] * len(rounds)
    for s in sessions:
        i = index.get(s.round_attempt) if s.attempt else None
        if i is not None:
            down[i] += s.bytes_down
            up[i] += s.bytes_up
    return [dataclasses.replace(r, bytes_down=d, bytes_up=u) for r, d, u in zip(rounds, down, up)]


@dataclass(frozen=True)
class TimelineRow(CsvTable):
    """The fleet at one instant (sampled every few simulated minutes; paper, Fig. 5-6).

    ``available``: devices whose training conditions hold; ``checking_in``: devices with a
    check-in in flight or waiting to retry after a rejection; ``participating``: devices seated
    in a round and not done with their session, a late one whose round has closed included;
    ``active_sessions``: sessions open on the server; ``resting``: available devices that
    will not check in yet, waiting out their participation job's interval after a session that
    ended within it (the simulator's ``MIN_INTERVAL_S``; 0 in a table written before the column).
    """

    t_s: float
    available: int
    checking_in: int
    participating: int
    active_sessions: int
    resting: int = 0
