"""The device runtime (SDK): plans and their execution, checkpoints, and the FL runtime an app embeds."""

from .checkpoint import CheckpointError, decode_checkpoint, encode_checkpoint
from .errors import (
    CorruptResource,
    NoExamples,
    OverBudget,
    ProtocolError,
    RuntimeSdkError,
    ServerUnreachable,
    SessionRejected,
)
from .executor import DeviceResult, PlanExecutor, TrainingInterrupted, make_session
from .plan import (
    PLAN_FORMAT_VERSION,
    DeviceConfig,
    Plan,
    PlanError,
    PlanMetadata,
    ServerPart,
    UpdateMismatchError,
    load_plan,
    max_ir_version_for_runtime,
    max_opset_for_runtime,
    min_runtime_for_opset,
    serialize_plan,
)
from .plan_builder import build_eval_plan, build_mlp_plan, build_softmax_regression_plan, initial_weights
from .protocol import CheckinAccepted, ProtocolClient, RetryPolicy
from .opstats import Event, OpStatsStore, SessionSummary, shape_of
from .runtime import DeviceClass, FLRuntime, Outcome, SessionResult
from .versions import version_tuple

__all__ = [
    "PLAN_FORMAT_VERSION",
    "CheckinAccepted",
    "CheckpointError",
    "CorruptResource",
    "DeviceClass",
    "DeviceConfig",
    "DeviceResult",
    "Event",
    "FLRuntime",
    "NoExamples",
    "OpStatsStore",
    "OverBudget",
    "Outcome",
    "Plan",
    "PlanError",
    "PlanExecutor",
    "PlanMetadata",
    "ProtocolClient",
    "ProtocolError",
    "RetryPolicy",
    "RuntimeSdkError",
    "ServerPart",
    "ServerUnreachable",
    "SessionRejected",
    "SessionResult",
    "SessionSummary",
    "TrainingInterrupted",
    "UpdateMismatchError",
    "build_eval_plan",
    "build_mlp_plan",
    "build_softmax_regression_plan",
    "decode_checkpoint",
    "encode_checkpoint",
    "initial_weights",
    "load_plan",
    "make_session",
    "max_ir_version_for_runtime",
    "max_opset_for_runtime",
    "min_runtime_for_opset",
    "serialize_plan",
    "shape_of",
    "version_tuple",
]
