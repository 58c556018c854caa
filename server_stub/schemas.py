"""The operators' request bodies of the HTTP API (the devices' are in ``device_runtime.wire``,
imported here), declared once: validation, error messages and the OpenAPI
document all come from these types. Numbers are strict and finite, strings and lists bounded,
unknown fields refused; JSON nesting is bounded by the parser (pydantic-core refuses deep input
with an error instead of recursing)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict
from pydantic_core import PydanticCustomError

from device_runtime.eligibility import EligibilityPolicies
from device_runtime.wire import (
    NAME_PATTERN,
    NAME_RULE,
    VERSION_PATTERN,
    Abort,
    Checkin,
    EligibilityVerdict,
    ErrorBody,
    ErrorDetail,
    is_name,
)

from .release_gate import MAX_REPORT_BYTES
from .rounds import RoundConfig
from .task_choice import Strategy

#: ``GET /v1/populations/{p}/rounds``: the rounds one answer holds when ``last`` is not given, and
#: at most (a round's record is about 2 KB: an answer stays under 2 MB); older ones by ``before``.
ROUNDS_PAGE = 100
MAX_ROUNDS_PAGE = 1000
#: The largest ``before`` (a round's record id): SQLite's integers are 64-bit.
MAX_ROUND_ID = 2**63 - 1


def _not_a_path_segment(name: str) -> str:
    """The pattern's engine has no look-ahead, so 'not only dots' is checked here, with the
    pattern's error type (the API answers both with BAD_NAME)."""
    if not name.strip("."):
        raise PydanticCustomError("string_pattern_mismatch", NAME_RULE)
    return name


Name = Annotated[str, Strict(), Field(pattern=NAME_PATTERN, description=NAME_RULE), AfterValidator(_not_a_path_segment)]


#: Exactly what ``base64.b64decode(..., validate=True)`` accepts (a linear-time match, ~0.1 s for 60 MB).
BASE64_PATTERN = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
Base64 = Annotated[str, Strict(), Field(pattern=BASE64_PATTERN, description="standard base64 (RFC 4648) with padding")]
#: An onnxruntime release a task claims, as pip names it.
Release = Annotated[str, Strict(), Field(pattern=r"^[0-9]{1,4}\.[0-9]{1,4}\.[0-9]{1,6}$", description="e.g. '1.17.3'")]


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class CreatePopulation(_Schema):
    name: Name


class TaskDeploy(_Schema):
    """One task. An evaluation task that ``evaluates`` a training task of the same deploy is sent
    that task's current model each round and needs no checkpoint of its own."""

    name: Name
    plan: Base64 = Field(description="the serialized plan (serialize_plan), base64")
    checkpoint: Base64 | None = Field(None, description="the initial checkpoint (encode_checkpoint), base64")
    config: RoundConfig = Field(default_factory=RoundConfig)
    eligibility: EligibilityPolicies = Field(default_factory=EligibilityPolicies)
    weight: Annotated[float, Strict(), Field(gt=0.0, le=1e6)] = 1.0
    evaluates: Name | None = None
    versioned_plans: Annotated[dict[Release, Base64], Field(max_length=64)] = Field(
        default_factory=dict, description="one plan per claimed onnxruntime release (e.g. '1.17.3'), base64"
    )
    release_report: dict[str, Any] | None = Field(
        None,
        description="the release report `fedfleet plan test --signing-key` wrote and signed, covering every "
        f"claimed release; at most {MAX_REPORT_BYTES} bytes as compact JSON (else 422 RELEASE_REPORT_TOO_LARGE)",
    )


class GroupDeploy(_Schema):
    """Tasks that share a population's rounds; ``strategy`` picks the task of each round."""

    strategy: Strategy = Strategy.ALTERNATE
    tasks: Annotated[list[TaskDeploy], Field(min_length=1, max_length=16)]


__all__ = [
    "NAME_PATTERN",
    "NAME_RULE",
    "VERSION_PATTERN",
    "Abort",
    "Checkin",
    "CreatePopulation",
    "EligibilityVerdict",
    "ErrorBody",
    "ErrorDetail",
    "GroupDeploy",
    "Name",
    "REQUEST_SCHEMAS",
    "TaskDeploy",
    "is_name",
]

REQUEST_SCHEMAS: tuple[type[BaseModel], ...] = (CreatePopulation, TaskDeploy, GroupDeploy, Checkin, Abort, ErrorBody)
