"""The FL protocol's messages, declared once: every JSON request and answer body that devices and
operators exchange with the server.

The server (``server_stub.app``) declares its request bodies and ``response_model`` with these
types, so its OpenAPI document names each answer's schema, and its service builds the answers to
devices as these models (``CheckinAccepted``, ``ReportAnswer``, ...); the clients (``ProtocolClient``,
``AdminClient``) parse answers with ``model_validate_json``, so a malformed or hostile answer is
refused field by field before a value reaches a path, a header or a clock.

Unknown fields: requests are ``extra="forbid"`` (a typo in a device's or an operator's body is a 400,
never silently dropped); answers are ``extra="ignore"`` (a newer server may add fields, and an older
device keeps working without reading them). Numbers are finite, and strict in what a device reads
(no ``true`` for 1, no ``"3"``); the operators' answers are lax, as the server checks its own dicts
against them in Python (FastAPI's ``response_model``), where strict nested models would refuse a
dict. The one device answer the service sends as a dict is the Secure Aggregation state
(``SecAggState``): the long poll sends it as the round built it, so that a test can bend it as a
malicious server would, and a test checks an honest round's states against the model. Binary bodies (plans, checkpoints, updates, Secure Aggregation messages) are not declared
here: they travel as ``application/octet-stream``."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Strict,
    TypeAdapter,
    field_validator,
    model_validator,
)

from .eligibility import EligibilityPolicies

#: The longest wait a server can ask for (a week): a longer one is cut to it.
MAX_RETRY_WINDOW_S = 7 * 86_400.0
#: Ids a device uses as file names of its plan cache and path segments of later requests.
RESOURCE_ID_PATTERN = r"^[0-9a-f]{64}$"
SESSION_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
#: The token goes into an ``Authorization`` header: printable ASCII, no spaces or line breaks.
TOKEN_PATTERN = r"^[\x21-\x7e]{1,512}$"
#: What ``version_tuple`` reads: up to three dot-separated numbers, then anything (e.g. '+cpu').
VERSION_PATTERN = r"^\s*[0-9]"
AGGREGATIONS = ("simple", "secure_sum")

#: Names travel in URLs, headers and logs: ASCII letters, digits, '-', '_' and '.', but not only
#: dots: '.' and '..' are path segments ('%2E%2E' in a URL names the parent of where it stands).
NAME_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"
NAME_RULE = "names are 1-128 ASCII letters, digits, '-', '_' or '.', and not only dots ('.' and '..' are path segments)"


def is_name(name: object) -> bool:
    """Whether ``name`` keeps ``NAME_RULE`` (what the server's ``Name`` accepts), for checks outside a model: the
    server's of a deploy's tasks, the toolchain's, whose bundles keep each task in a folder of its
    name, and a device's of the population it checks in to (a path segment of its requests)."""
    return isinstance(name, str) and re.fullmatch(NAME_PATTERN, name) is not None and bool(name.strip("."))


Count = Annotated[int, Strict(), Field(ge=0)]
Seconds = Annotated[float, Strict(), Field(ge=0.0)]
ResourceId = Annotated[
    str, Strict(), Field(pattern=RESOURCE_ID_PATTERN, description="the SHA-256 of the resource, hex")
]


def sane_window(value: object) -> tuple[float, float] | None:
    """A ``retry_after_s`` window as a device takes it: two finite, ordered, non-negative numbers
    (the first two of a longer list), each cut to a week; anything else is no window (None), so
    that a broken or hostile server can neither crash a device nor keep it away for ever."""
    if not isinstance(value, (list, tuple)) or len(value) < 2:
        return None
    try:
        lo, hi = float(value[0]), float(value[1])
    except (TypeError, ValueError, OverflowError):
        return None
    if not (0.0 <= lo <= hi and math.isfinite(hi)):
        return None
    return (min(lo, MAX_RETRY_WINDOW_S), min(hi, MAX_RETRY_WINDOW_S))


#: ``(min, max)`` seconds before the device checks in again. Read leniently on purpose: a window
#: out of shape is no window (the device's default), not a refused answer (see ``sane_window``).
RetryWindow = Annotated[
    tuple[float, float] | None,
    BeforeValidator(sane_window),
    Field(description="(min, max) seconds before the device checks in again, 0 <= min <= max"),
]


class Request(BaseModel):
    """A request body: unknown fields are refused, numbers finite."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class Answer(BaseModel):
    """An answer body: unknown fields from a newer server are ignored, numbers finite."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, frozen=True)


# ----------------------------------------------------------------------------- errors
class ErrorDetail(Request):
    code: str
    message: str


class ErrorBody(Request):
    """Every 4xx and 5xx answer: ``{"error": {"code", "message"}}`` with a stable code."""

    error: ErrorDetail


# ----------------------------------------------------------------------------- device requests
class EligibilityVerdict(Request):
    """The device's own verdict on the active task's policies (its data never leaves it)."""

    task: Annotated[str, Strict(), Field(max_length=128)]
    eligible: Annotated[bool, Strict()]
    failed: Annotated[list[Annotated[str, Strict(), Field(max_length=64)]], Field(max_length=16)] = []


class Checkin(Request):
    runtime_version: Annotated[
        str,
        Strict(),
        Field(
            min_length=1,
            max_length=32,
            pattern=VERSION_PATTERN,
            description="e.g. '1.31.1'; a tag after the numbers is ignored",
        ),
    ]
    eligibility: EligibilityVerdict | None = None
    attestation: dict[str, Any] | None = Field(
        None, description="a signed attestation (see POST /v1/attestation/nonce)"
    )

    @field_validator("eligibility", mode="before")
    @classmethod
    def _no_verdict(cls, value: object) -> object:
        return None if value == {} else value  # devices send {} for a task without policies


class Abort(Request):
    reason: Annotated[str, Strict(), Field(max_length=1000)] = "unspecified"
    stats: dict[str, Any] | None = Field(None, description="advisory session statistics (shape, training_s)")


# ----------------------------------------------------------------------------- device answers
class Health(Answer):
    status: Literal["ok"]


class AttestationChallenge(Answer):
    nonce: Annotated[
        str, Strict(), Field(max_length=256, description="base64; sign it into the next check-in's attestation")
    ]
    expires_at: Annotated[float, Strict(), Field(description="unix seconds")] | None = None


class EligibilityInfo(Answer):
    """What a device needs to judge the active task's policies before it checks in; ``task`` is
    null when the population has no task (or does not exist: devices cannot probe names)."""

    task: Annotated[str, Strict(), Field(min_length=1, max_length=128)] | None
    round: Count | None = None
    policies: EligibilityPolicies | None = None
    selector: dict[str, Any] | None = Field(None, description="the plan's example selector (ExampleSelector.to_dict)")


class CheckinAccepted(Answer):
    """A selected device's session: every field checked, as a hostile server could send anything."""

    status: Literal["accepted"] = "accepted"
    session_id: Annotated[str, Strict(), Field(pattern=SESSION_ID_PATTERN)]
    token: Annotated[str, Strict(), Field(pattern=TOKEN_PATTERN, description="the session's bearer token")]
    task: Annotated[str, Strict(), Field(min_length=1, max_length=128)]
    round: Count
    plan_id: ResourceId
    checkpoint_id: ResourceId
    aggregation: Literal["simple", "secure_sum"]
    report_deadline_s: Seconds
    max_report_bytes: Annotated[int, Strict(), Field(gt=0)] | None = None
    #: H(seed) of the round's Secure Aggregation groups, shown before selection ends.
    secagg_commitment: Annotated[str, Strict(), Field(max_length=256)] | None = None
    # The round's bounds on one device's influence; under Secure Aggregation the device applies
    # them to its own update before masking it (the server sees only its group's sum).
    max_examples_per_report: Annotated[int, Strict(), Field(gt=0)] | None = None
    clip_update_norm: Annotated[float, Strict(), Field(gt=0.0)] | None = None

    @model_validator(mode="after")
    def _bounds_under_secure_sum(self) -> CheckinAccepted:
        """Under Secure Aggregation nobody but the device can apply the round's bounds: it must know them."""
        if self.aggregation == "secure_sum":
            if self.max_examples_per_report is None:
                raise ValueError("a secure_sum session needs max_examples_per_report")
            if "clip_update_norm" not in self.model_fields_set:
                raise ValueError("a secure_sum session needs clip_update_norm (a number or null)")
        return self


class CheckinRejected(Answer):
    """Turned away (pace steering, no task, a version the plan does not claim, ineligible)."""

    status: Literal["rejected"]
    reason: Annotated[str, Field(max_length=256)] = "unspecified"
    retry_after_s: RetryWindow = None


CheckinAnswer = Annotated[CheckinAccepted | CheckinRejected, Discriminator("status")]
CHECKIN_ANSWER: TypeAdapter[CheckinAccepted | CheckinRejected] = TypeAdapter(CheckinAnswer)


class ReportAnswer(Answer):
    """A taken report; ``round_status`` is what became of the round as the answer left."""

    status: Literal["accepted"] = "accepted"
    round: Count | None = None
    round_status: Literal["open", "committed", "abandoned"] | None = None
    retry_after_s: RetryWindow = None


class AbortAnswer(Answer):
    status: Literal["aborted", "ignored"]


class SecAggAccepted(Answer):
    status: Literal["accepted"]


class DDPRoundParams(Answer):
    """A distributed-DP round's parameters (``device_runtime.ddp.DDPParams``, field for field) and
    its public rotation seed, sent with each group's Secure Aggregation configuration. The device
    recomputes what follows from them (the sensitivity, the modulus's wrap bound) and checks them
    against its own floor (``device_runtime.dp_policy``) before it advertises a key."""

    dim: Annotated[int, Strict(), Field(ge=1, le=1 << 31)]
    clip: Annotated[float, Strict(), Field(gt=0.0)]
    noise_multiplier: Annotated[float, Strict(), Field(ge=0.0)]
    gamma: Annotated[float, Strict(), Field(gt=0.0)]
    local_variance: Annotated[float, Strict(), Field(ge=0.0)]
    bitwidth: Annotated[int, Strict(), Field(ge=1, le=62)]
    min_devices: Annotated[int, Strict(), Field(ge=1)]
    max_devices: Annotated[int, Strict(), Field(ge=1)]
    mechanism: Literal["gaussian", "skellam"]
    beta: Annotated[float, Strict(), Field(gt=0.0, lt=1.0)]
    wrap_probability: Annotated[float, Strict(), Field(gt=0.0, lt=1.0)]
    rotation_seed: Annotated[int, Strict(), Field(ge=0, lt=1 << 64, description="of the randomized Hadamard rotation")]


class SecAggAssignment(Answer):
    """How the server split a round's devices into Secure Aggregation groups, revealed when
    selection ends: the seed whose hash it showed before (base64), every member's key (base64), the
    least group size and the spare seats it split by, and the index of this device's group. The
    device recomputes its group from them (``secagg.assign_groups``). Integers are strict: a
    hostile ``Infinity`` or ``1e400`` (JSON the device parses) raised ``OverflowError`` out of the
    device's session where it was turned into a count."""

    seed: Annotated[str, Strict()]
    members: list[Annotated[str, Strict()]]
    min_group_size: Annotated[int, Strict(), Field(ge=1)]
    group: Count
    spare: Count = 0


class SecAggState(Answer):
    """A session's Secure Aggregation state: ``waiting`` (groups not formed; ``commitment`` is
    H(seed)), ``excluded``, ``closed``, ``active`` (its group's round and the server's latest
    message for it), ``completed`` (``included``: whether its input was summed) or ``aborted``."""

    status: Literal["waiting", "excluded", "closed", "active", "completed", "aborted"]
    commitment: str | None = None
    group: Count | None = None
    client_id: Count | None = None
    config: dict[str, Any] | None = None
    round: str | None = None
    seq: Count | None = None
    message: str | None = Field(None, description="the server's latest Secure Aggregation message, base64")
    assignment: SecAggAssignment | None = None
    group_size: Count | None = None
    included: bool | None = None
    reason: str | None = None
    deadline_in_s: float | None = None
    retry_after_s: RetryWindow = None
    ddp: DDPRoundParams | None = Field(None, description="with the configuration, in a distributed-DP round")


# ----------------------------------------------------------------------------- operator answers
class PopulationList(Answer):
    populations: list[str]


class PopulationCreated(Answer):
    name: str
    created: bool


class TaskState(Answer):
    """``active`` (its rounds run), ``queued`` behind the running tasks it waits for, ``completed``,
    ``stopped`` (an operator stopped it before it completed), ``refused`` (stored by an older server
    with a config this one refuses, not run: ``reason`` says which field and what to do) or
    ``retired`` (a refused task an operator retired)."""

    name: str
    status: str
    queued_behind: list[str] | None = None
    reason: str | None = None


class TaskStopped(Answer):
    """What stopping a task did: ``stopped`` names it and the evaluation tasks of its deploy that
    evaluate it (stopped with it); ``abandoned_round`` the number of the round of one of them that
    was open, closed without committing (None when none was open); ``committed_rounds`` its rounds
    on record, the last one's model its final one; ``running`` the population's tasks that run now
    (the rest of its deploy, or the next deploy)."""

    population: str
    task: str
    status: Literal["stopped"]
    stopped: list[str]
    abandoned_round: int | None = None
    committed_rounds: int
    running: list[str]


class ActiveTask(Answer):
    name: str
    kind: str
    round: int
    committed_rounds: int
    checkpoint_id: str
    runtimes: list[str] | None = Field(None, description="the releases its release report covers")


class RoundProgress(Answer):
    """The open round's outcome counts; ``dropped`` is aborted plus silent past their deadline."""

    selected: int
    reported: int
    rejected_late: int
    aborted: int
    dropped: int
    shapes: dict[str, int]


class PopulationStatus(Answer):
    population: str
    strategy: str | None
    active_task: str | None
    active_tasks: list[ActiveTask]
    tasks: list[TaskState]
    round: int | None = None
    committed_rounds: int | None = None
    phase: str | None = None
    current_round: RoundProgress | None = None
    checkpoint_id: str | None = None
    #: why no round is open though tasks are active: the database refused the last round's record
    waiting: str | None = None


class DeployedTask(Answer):
    task: str
    population: str
    plan_id: str
    checkpoint_id: str
    status: str
    queued_behind: list[str] | None = None
    reason: str | None = None
    #: True when this deploy was stored before, as it is (sent again after its answer was lost)
    already_deployed: bool | None = None


class DeployedGroup(Answer):
    strategy: str
    tasks: list[DeployedTask]


class RoundSummary(Answer):
    """One finished round on record (a retried one has ``attempt`` > 1)."""

    round: int
    attempt: int
    status: str
    checkpoint_id: str | None
    metrics: dict[str, Any]
    started_at: float
    ended_at: float | None
    task: str


class RoundList(Answer):
    rounds: list[RoundSummary]
