"""The round state machine of the paper's section 2.2 (selection, configuration, reporting) as a
pure core: it takes the current time and session ids and returns verdicts; it does no I/O."""

from __future__ import annotations

import enum
import math
from collections import Counter
from dataclasses import dataclass as plain_dataclass
from dataclasses import field
from typing import Annotated, Any

from pydantic import ConfigDict, Field, Strict, TypeAdapter
from pydantic.dataclasses import dataclass

from .dp_config import DPConfig

#: Upper bound of every timeout and window: a week, so that deadlines stay ordinary numbers.
MAX_TIMEOUT_S = 7 * 86400.0


#: Strict numbers: no bools, no numeric strings, no NaN or infinity, no unknown fields.
SCHEMA_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]


@dataclass(frozen=True, config=SCHEMA_CONFIG)
class RoundConfig:
    """How one task's rounds are run.

    A round selects ``ceil(goal_count * over_selection)`` devices, commits as soon as
    ``goal_count`` of them have reported, and otherwise, once every selected device has reported,
    aborted or passed its deadline, commits if at least ``ceil(goal_count * min_fraction)`` reported
    and is abandoned if not.

    One device's influence is bounded: a report counts for at most ``max_examples_per_report``
    examples (its update, and its loss and accuracy sums, are scaled down to that weight), and the
    norm of its mean update is clipped to ``clip_update_norm``, and with ``max_loss`` its mean loss
    (``loss_sum`` over its count) counts as at most that (``metrics.hold_loss``); under Secure Aggregation each device
    applies both to its own update and the server checks each group's sum against them, so a secure
    training task needs ``clip_update_norm`` (refused at deploy otherwise). Every task publishes
    something (a training task a model, an evaluation its loss and accuracy, an analytics task its
    totals), so its commit threshold must be at least ``min_reports`` devices (refused at deploy
    otherwise, and a round with fewer is abandoned by the service): a round of one device would give
    that device's own update or values back to anyone who reads what it published.

    Under Secure Aggregation a round's devices are split into groups of ``secagg_target_group_size``
    when it has them (taken as at least ``secagg_min_group_size`` + 1; else fewer, larger ones, and
    one group of them all when it has fewer than twice that, down to ``secagg_min_group_size``
    devices, below which no group forms), one
    Aggregator each (paper, section 6: the protocol's costs grow quadratically with a group, which
    limits one to hundreds of devices). A group releases its sum only when more than two thirds of
    its devices, and at least ``secagg_min_group_size``, send their masked inputs in time: a group of
    k + 1 is lost to two slow devices, where one of a hundred rides out the stragglers and drop-outs
    the round's over-selection is there for.
    """

    goal_count: Annotated[Int, Field(ge=1, le=1_000_000)] = 10
    over_selection: Annotated[Float, Field(ge=1.0, le=100.0)] = 1.3
    min_fraction: Annotated[Float, Field(gt=0.0, le=1.0)] = 0.8
    selection_timeout_s: Annotated[Float, Field(gt=0.0, le=MAX_TIMEOUT_S)] = 30.0
    report_timeout_s: Annotated[Float, Field(gt=0.0, le=MAX_TIMEOUT_S)] = 60.0
    retry_window_s: tuple[
        Annotated[Float, Field(ge=0.0, le=MAX_TIMEOUT_S)], Annotated[Float, Field(ge=0.0, le=MAX_TIMEOUT_S)]
    ] = (5.0, 15.0)
    max_rounds: Annotated[Int, Field(ge=1)] | None = None
    secagg_min_group_size: Annotated[Int, Field(ge=2, le=100_000)] = 5
    secagg_target_group_size: Annotated[Int, Field(ge=2, le=100_000)] = 100
    secagg_round_timeout_s: Annotated[Float, Field(gt=0.0, le=MAX_TIMEOUT_S)] = 5.0
    secagg_consistency_check: Annotated[bool, Strict()] = True  # the devices' floor requires it by default
    min_reports: Annotated[Int, Field(ge=1, le=1_000_000)] = 5
    max_examples_per_report: Annotated[Int, Field(ge=1)] = 1000
    clip_update_norm: Annotated[Float, Field(gt=0.0)] | None = 10.0
    max_loss: Annotated[Float, Field(gt=0.0, le=1e30)] | None = None
    dp: DPConfig | None = None

    def __post_init__(self) -> None:
        lo, hi = self.retry_window_s
        if not lo <= hi:
            raise ValueError("retry_window_s must be (min, max) with 0 <= min <= max")

    @property
    def selection_target(self) -> int:
        return math.ceil(self.goal_count * self.over_selection - 1e-9)

    @property
    def commit_threshold(self) -> int:
        """Reports a round needs to commit once it can no longer reach ``goal_count``."""
        return max(1, math.ceil(self.goal_count * self.min_fraction - 1e-9))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = _ROUND_CONFIG.dump_python(self, mode="json")
        return out

    def changes(self) -> dict[str, Any]:
        """The fields set away from their defaults, as a deploy sends them: a server of an earlier
        release, which refuses a field added since as unknown, then takes every task that leaves
        the new fields at their defaults (the server fills in the rest)."""
        out: dict[str, Any] = _ROUND_CONFIG.dump_python(self, mode="json", exclude_defaults=True)
        return out

    @classmethod
    def from_dict(cls, data: object) -> RoundConfig:
        """Raises ``ValueError`` (a pydantic ``ValidationError``) naming each bad field."""
        return _ROUND_CONFIG.validate_python(data)


_ROUND_CONFIG: TypeAdapter[RoundConfig] = TypeAdapter(RoundConfig)


class Phase(enum.Enum):
    SELECTING = "selecting"
    REPORTING = "reporting"
    COMMITTED = "committed"
    ABANDONED = "abandoned"


class SessionState(enum.Enum):
    SELECTED = "selected"
    REPORTED = "reported"
    ABORTED = "aborted"
    LATE = "late"


class ReportVerdict(enum.Enum):
    ACCEPT = "accept"
    LATE = "late"
    DUPLICATE = "duplicate"
    CLOSED = "closed"
    UNKNOWN = "unknown"


@plain_dataclass
class RoundCore:
    """One round of one task. ``now`` is any monotonic clock reading in seconds."""

    number: int
    config: RoundConfig
    started_at: float
    phase: Phase = Phase.SELECTING
    sessions: dict[str, SessionState] = field(default_factory=dict)
    deadlines: dict[str, float] = field(default_factory=dict)
    selection_ended_at: float | None = None
    ended_at: float | None = None
    late_reports: int = 0
    shapes: Counter[str] = field(default_factory=Counter)
    # Secure Aggregation: devices start work only once their group forms, at selection's end, and
    # report (their masked inputs) within ``report_timeout_s`` of it; the protocol's rounds after
    # the masked inputs (ConsistencyCheck, Unmasking) may take ``finalization_s`` more.
    deadlines_from_selection_end: bool = False
    finalization_s: float = 0.0
    # Kept in step with ``sessions`` (a round of a few hundred devices is asked on every message):
    # the sessions in each state, and what the last scan for expired deadlines found (below).
    _counts: Counter[SessionState] = field(default_factory=Counter, repr=False, compare=False)
    _expired: list[str] = field(default_factory=list, repr=False, compare=False)
    _deadline_floor: float = field(default=-math.inf, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._counts = Counter(self.sessions.values())

    @property
    def open(self) -> bool:
        return self.phase in (Phase.SELECTING, Phase.REPORTING)

    def count(self, state: SessionState) -> int:
        return self._counts[state]

    def _set(self, session_id: str, state: SessionState) -> None:
        old = self.sessions.get(session_id)
        if old is not None:
            self._counts[old] -= 1
        self.sessions[session_id] = state
        self._counts[state] += 1

    def _outstanding(self, now: float) -> int:
        """Selected sessions whose deadline has not passed.

        Deadlines only grow (each is set from a later ``now``, or moved later at selection's
        end), so the least unexpired deadline found by a scan bounds every deadline of a session
        that was unexpired then or selected since: until ``now`` passes it, only sessions the
        scan found expired can be, and only those still selected count."""
        selected = self._counts[SessionState.SELECTED]
        if now > self._deadline_floor:
            live = [(self.deadlines[sid], sid) for sid, st in self.sessions.items() if st is SessionState.SELECTED]
            self._expired = [sid for d, sid in live if d < now]
            self._deadline_floor = min((d for d, _ in live if d >= now), default=math.inf)
        return selected - sum(1 for sid in self._expired if self.sessions[sid] is SessionState.SELECTED)

    @property
    def reported(self) -> int:
        return self.count(SessionState.REPORTED)

    def try_select(self, session_id: str, now: float) -> bool:
        """Admit a checking-in device if the round is still selecting and has room."""
        self.advance(now)
        if self.phase is not Phase.SELECTING:
            return False
        self._set(session_id, SessionState.SELECTED)
        self.deadlines[session_id] = now + self.config.report_timeout_s
        if len(self.sessions) >= self.config.selection_target:
            self._end_selection(now)
            self.advance(now)  # a full round whose aborts leave it short is abandoned at once
        return True

    def report(self, session_id: str, now: float) -> ReportVerdict:
        """Decide whether a report is taken; only ACCEPT means the update is aggregated."""
        state = self.sessions.get(session_id)
        if state is None:
            return ReportVerdict.UNKNOWN
        if state is SessionState.REPORTED:
            return ReportVerdict.DUPLICATE
        if state in (SessionState.ABORTED, SessionState.LATE):
            return ReportVerdict.LATE if state is SessionState.LATE else ReportVerdict.CLOSED
        if now > self.deadlines[session_id]:
            self._set(session_id, SessionState.LATE)
            self.late_reports += 1
            self.advance(now)
            return ReportVerdict.LATE
        if not self.open:
            self._set(session_id, SessionState.LATE)
            self.late_reports += 1
            return ReportVerdict.LATE
        return ReportVerdict.ACCEPT

    def confirm_report(self, session_id: str, now: float) -> None:
        """Record an accepted report once its update has been aggregated."""
        self._set(session_id, SessionState.REPORTED)
        self.advance(now)

    def confirm_group(self, session_ids: list[str], now: float) -> bool:
        """Record a Secure Aggregation group's devices as reported, all at once (their updates
        arrive only as the group's sum). False, and nothing recorded, once the round is closed."""
        self.advance(now)
        if not self.open:
            return False
        for sid in session_ids:
            if sid in self.sessions:
                self._set(sid, SessionState.REPORTED)
        self.advance(now)
        return True

    def abort(self, session_id: str, now: float) -> bool:
        if self.sessions.get(session_id) is not SessionState.SELECTED:
            return False
        self._set(session_id, SessionState.ABORTED)
        self.advance(now)
        return True

    def advance(self, now: float) -> Phase:
        """Move the round forward in time: close selection, commit, or abandon."""
        if not self.open:
            return self.phase
        cfg = self.config
        if self.phase is Phase.SELECTING and now - self.started_at >= cfg.selection_timeout_s:
            if self.count(SessionState.SELECTED) + self.reported < cfg.commit_threshold:
                return self._finish(Phase.ABANDONED, now)
            self._end_selection(now)
        if self.reported >= cfg.goal_count:
            return self._finish(Phase.COMMITTED, now)
        if self.phase is Phase.REPORTING:
            outstanding = self._outstanding(now)
            if not outstanding:
                final = Phase.COMMITTED if self.reported >= cfg.commit_threshold else Phase.ABANDONED
                return self._finish(final, now)
            if self.reported + outstanding < cfg.commit_threshold:
                return self._finish(Phase.ABANDONED, now)
        return self.phase

    def stop(self, now: float) -> bool:
        """Close the round now, whatever it holds, without committing it (its task was stopped):
        abandoned; False when it was closed already."""
        if not self.open:
            return False
        self._finish(Phase.ABANDONED, now)
        return True

    def next_event_at(self) -> float | None:
        """When ``advance`` could next change something without any message arriving."""
        if not self.open:
            return None
        if self.phase is Phase.SELECTING:
            return self.started_at + self.config.selection_timeout_s
        pending = [self.deadlines[s] for s, st in self.sessions.items() if st is SessionState.SELECTED]
        return min(pending) if pending else None

    def stats(self, now: float) -> dict[str, Any]:
        """Outcome counts; ``dropped`` is aborted plus silent past their deadline."""
        aborted = self.count(SessionState.ABORTED)
        silent = sum(1 for s, st in self.sessions.items() if st is SessionState.SELECTED and self.deadlines[s] < now)
        return {
            "selected": len(self.sessions),
            "reported": self.reported,
            "rejected_late": self.late_reports,
            "aborted": aborted,
            "dropped": aborted + silent,
            "shapes": dict(self.shapes.most_common()),
        }

    def note_shape(self, shape: str | None) -> None:
        """Count a session shape the device reported (its statistics carry no identity)."""
        if shape:
            self.shapes[shape] += 1

    def _end_selection(self, now: float) -> None:
        if self.phase is Phase.SELECTING:
            self.phase = Phase.REPORTING
            self.selection_ended_at = now
            if self.deadlines_from_selection_end:
                for sid, state in self.sessions.items():
                    if state is SessionState.SELECTED:
                        self.deadlines[sid] = now + self.config.report_timeout_s + self.finalization_s

    def deadline_of(self, session_id: str) -> float:
        """The session's report deadline; while selecting, the latest it can be."""
        if self.phase is Phase.SELECTING and self.deadlines_from_selection_end:
            return (
                self.started_at + self.config.selection_timeout_s + self.config.report_timeout_s + self.finalization_s
            )
        return self.deadlines[session_id]

    def _finish(self, phase: Phase, now: float) -> Phase:
        self.phase = phase
        self.ended_at = now
        return phase
