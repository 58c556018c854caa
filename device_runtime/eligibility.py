"""Eligibility policies, evaluated on the device against its own data and history (nothing about
either leaves the device: only the verdict travels with the check-in)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class EligibilityPolicies:
    """A task's policies. ``min_examples``: data availability for the plan's selector;
    ``min_separation_rounds`` / ``min_separation_s``: not the same task more often than every K
    rounds or seconds; ``sampling_period_s``: at most once per period (sampling without
    replacement within it)."""

    min_examples: int = 0
    min_separation_rounds: int = 0
    min_separation_s: float = 0.0
    sampling_period_s: float = 0.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"eligibility policy {name} must be a non-negative number")

    @property
    def empty(self) -> bool:
        return not any(asdict(self).values())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "EligibilityPolicies":
        if not isinstance(data, dict):
            raise ValueError("eligibility policies must be a JSON object")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown eligibility policies: {sorted(unknown)}")
        return cls(**data)


@dataclass(frozen=True)
class Participation:
    """The device's last accepted contribution to a task (from its opstats)."""

    round: int
    at: float


@dataclass(frozen=True)
class EligibilityVerdict:
    task: str
    eligible: bool
    failed: tuple[str, ...] = field(default=())

    def to_json(self) -> dict:
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
        if policies.sampling_period_s and int(now // policies.sampling_period_s) == int(last.at // policies.sampling_period_s):
            failed.append("sampling_period_s")
    return EligibilityVerdict(task, not failed, tuple(failed))
