"""The device runtime (SDK): plans and their execution, checkpoints, and the FL runtime an app embeds.

``__all__`` holds what the package's users call: an app that embeds the runtime (``FLRuntime``,
its settings and environment, the participation scheduler and its conditions, the results and
the errors it catches) and a task author who builds plans and checkpoints. What only another
package of this project uses (the attestation verifier's errors, the protocol client, the Secure
Aggregation client, example reading) is imported from its module, e.g.
``device_runtime.attestation``."""

from . import wire
from .attestation import DeviceAttestor
from .checkpoint import CheckpointError, decode_checkpoint, encode_checkpoint
from .clock import Clock, SystemClock, VirtualClock
from .conditions import (
    DeviceConditions,
    DeviceState,
    StaticConditions,
    TrainingConstraints,
    TrainingInterval,
)
from .dp_policy import DEFAULT_DP_POLICY, DPPolicy
from .eligibility import EligibilityPolicies, VerdictJSON
from .environment import DEVICE_ENVIRONMENT, RuntimeEnvironment, WorkMeter
from .errors import (
    CacheUnavailable,
    CorruptResource,
    InvalidSetting,
    NoExamples,
    OverBudget,
    ProtocolError,
    RuntimeSdkError,
    ServerUnreachable,
    SessionInProgress,
    SessionRejected,
)
from .executor import PlanExecutor, TrainingInterrupted, stoppable_run_options
from .opstats import AppDatabaseError, Event, OpStatsStore, SessionSummary, shape_of
from .plan import (
    PLAN_FORMAT_VERSION,
    DeviceConfig,
    Plan,
    PlanError,
    PlanMetadata,
    ServerPart,
    load_plan,
    max_ir_version_for_runtime,
    max_opset_for_runtime,
    min_runtime_for_opset,
    serialize_plan,
)
from .plan_builder import (
    build_eval_plan,
    build_mlp_plan,
    build_softmax_regression_plan,
    initial_weights,
)
from .protocol import ClientTLS, RetryPolicy
from .runtime import DeviceClass, FLRuntime, Outcome, SessionResult, training_limit
from .scheduling import (
    JobRun,
    ParticipationScheduler,
    RunOutcome,
    ScheduledJob,
    SchedulerSettings,
    WorkerQueue,
)
from .secagg_policy import DEFAULT_SECAGG_POLICY, SecAggPolicy
from .versions import version_tuple

__all__ = [
    # the app: the runtime, where it runs, and what it reports
    "FLRuntime",
    "RuntimeEnvironment",
    "DEVICE_ENVIRONMENT",
    "WorkMeter",
    "RetryPolicy",
    "ClientTLS",
    "DeviceClass",
    "SecAggPolicy",
    "DEFAULT_SECAGG_POLICY",
    "DPPolicy",
    "DEFAULT_DP_POLICY",
    "DeviceAttestor",
    "OpStatsStore",
    "Outcome",
    "SessionResult",
    "training_limit",
    "SessionSummary",
    "Event",
    "shape_of",
    # the app: when the runtime runs
    "ParticipationScheduler",
    "WorkerQueue",
    "SchedulerSettings",
    "ScheduledJob",
    "JobRun",
    "RunOutcome",
    "TrainingConstraints",
    "TrainingInterval",
    "DeviceConditions",
    "DeviceState",
    "StaticConditions",
    "Clock",
    "SystemClock",
    "VirtualClock",
    "EligibilityPolicies",
    "VerdictJSON",
    # the errors an app catches
    "RuntimeSdkError",
    "InvalidSetting",
    "SessionInProgress",
    "SessionRejected",
    "ServerUnreachable",
    "ProtocolError",
    "NoExamples",
    "OverBudget",
    "CacheUnavailable",
    "AppDatabaseError",
    "CorruptResource",
    "TrainingInterrupted",
    # the task author: plans, checkpoints, running a plan
    "Plan",
    "PlanMetadata",
    "DeviceConfig",
    "ServerPart",
    "PlanError",
    "PLAN_FORMAT_VERSION",
    "load_plan",
    "serialize_plan",
    "build_mlp_plan",
    "build_softmax_regression_plan",
    "build_eval_plan",
    "initial_weights",
    "encode_checkpoint",
    "decode_checkpoint",
    "CheckpointError",
    "PlanExecutor",
    "stoppable_run_options",
    "min_runtime_for_opset",
    "max_opset_for_runtime",
    "max_ir_version_for_runtime",
    "version_tuple",
    # the protocol's messages (every JSON body, declared once)
    "wire",
]
