"""Eligibility policies, evaluated on the device against its own data and history (nothing about
either leaves the device: only the verdict travels with the check-in)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Annotated, TypedDict

from pydantic import ConfigDict, Field, Strict, TypeAdapter
from pydantic.dataclasses import dataclass as pydantic_dataclass

_SCHEMA = ConfigDict(extra="forbid", allow_inf_nan=False)
_Count = Annotated[int, Strict(), Field(ge=0, le=1_000_000_000)]
_Seconds = Annotated[float, Strict(), Field(ge=0.0, le=10 * 365 * 86400.0)]


@pydantic_dataclass(frozen=True, config=_SCHEMA)
class EligibilityPolicies:
    """A task's policies. ``min_examples``: data availability for the plan's selector;
    ``min_separation_rounds`` / ``min_separation_s``: not the same task more often than every K
    rounds or seconds; ``sampling_period_s``: at most once per period (sampling without
    replacement within it). Declared once as a schema: the server validates deploys with it and
    publishes it in its OpenAPI document."""

    min_examples: _Count = 0
    min_separation_rounds: _Count = 0
    min_separation_s: _Seconds = 0.0
    sampling_period_s: _Seconds = 0.0

    @property
    def empty(self) -> bool:
        return not any(getattr(self, name) for name in _POLICY_FIELDS)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> EligibilityPolicies:
        """Raises ``ValueError`` (a pydantic ``ValidationError``) naming each bad field."""
        return _POLICIES.validate_python(data)


_POLICIES: TypeAdapter[EligibilityPolicies] = TypeAdapter(EligibilityPolicies)
#: The policies' field names (``fields()`` on every check-in cost as much as the check itself).
_POLICY_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(EligibilityPolicies))


@dataclass(frozen=True)
class Participation:
    """The device's last accepted contribution to a task (from its opstats)."""

    round: int
    at: float


class VerdictJSON(TypedDict):
    """A verdict as the check-in carries it (``evaluate_eligibility``, ``run_session(eligibility=...)``)."""

    task: str
    eligible: bool
    failed: list[str]


@dataclass(frozen=True)
class EligibilityVerdict:
    task: str
    eligible: bool
    failed: tuple[str, ...] = field(default=())

    def to_json(self) -> VerdictJSON:
        return {"task": self.task, "eligible": self.eligible, "failed": list(self.failed)}


def evaluate(
    task: str,
    policies: EligibilityPolicies,
    *,
    examples_available: int,
    last: Participation | None,
    current_round: int,
    now: float,
) -> EligibilityVerdict:
    failed = []
    if examples_available < policies.min_examples:
        failed.append("min_examples")
    if last is not None:
        if policies.min_separation_rounds and current_round - last.round < policies.min_separation_rounds:
            failed.append("min_separation_rounds")
        if policies.min_separation_s and now - last.at < policies.min_separation_s:
            failed.append("min_separation_s")
        if policies.sampling_period_s and (
            # a participation after now: the clock was set back past it, and the period it is in
            # now says nothing (a user who set it back a day took part twice in one day)
            last.at > now or int(now // policies.sampling_period_s) == int(last.at // policies.sampling_period_s)
        ):
            failed.append("sampling_period_s")
    return EligibilityVerdict(task, not failed, tuple(failed))
