"""The model engineer's toolchain: any ONNX inference model to a training plan whose backward pass
is generated in standard ONNX ops (reverse-mode autodiff, one gradient rule per op), evaluation and
federated analytics plans, client and server optimizers."""

from .analytics import analytics_plan
from .autodiff import UnsupportedOpError, vjp_model
from .bundle import BuiltTask, build_bundle, deploy_bundle, read_bundle, release_test_bundle
from .evaluation import evaluation_plan_from_onnx
from .gradients import OP_COVERAGE, coverage_markdown
from .losses import BUILTIN_LOSSES
from .model_bundle import ModelBundle, bundle_from_onnx
from .optimizers import SGD, Adam, Momentum
from .release import (
    budget_checks,
    compare_outputs,
    max_abs_difference,
    release_table,
    release_test,
    report_passed,
    write_report,
)
from .release_signing import SigningKeyError, generate_signing_key, load_signing_key, sign_report
from .server_optimizers import FedAdam, FedAvg, FedAvgM, FedYogi
from .tasks import (
    Budget,
    Predicate,
    ProxyData,
    Task,
    TaskError,
    TaskGroup,
    Tolerance,
    Trial,
    accuracy_after_rounds,
    evaluation_of,
    load_tasks,
    loss_after_rounds,
    loss_decreases,
    loss_is_finite,
    predicate,
)
from .torch_export import TorchInput, export_torch, from_torch
from .training import OnnxTrainingPlan, initial_weights_from_onnx, onnx_training_plan, training_plan_from_onnx
from .versioning import VersioningError, convert_model, plan_sha256, versioned_plan

__all__ = [
    "BUILTIN_LOSSES",
    "OP_COVERAGE",
    "SGD",
    "Adam",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedYogi",
    "Momentum",
    "UnsupportedOpError",
    "analytics_plan",
    "coverage_markdown",
    "evaluation_plan_from_onnx",
    "initial_weights_from_onnx",
    "training_plan_from_onnx",
    "onnx_training_plan",
    "OnnxTrainingPlan",
    "vjp_model",
    # tasks, versioned plans, release tests and bundles
    "Budget",
    "BuiltTask",
    "ModelBundle",
    "Predicate",
    "ProxyData",
    "Task",
    "TaskError",
    "TaskGroup",
    "Tolerance",
    "Trial",
    "VersioningError",
    "accuracy_after_rounds",
    "budget_checks",
    "build_bundle",
    "bundle_from_onnx",
    "compare_outputs",
    "convert_model",
    "deploy_bundle",
    "evaluation_of",
    "load_tasks",
    "loss_after_rounds",
    "loss_decreases",
    "loss_is_finite",
    "max_abs_difference",
    "plan_sha256",
    "predicate",
    "read_bundle",
    "release_table",
    "release_test",
    "release_test_bundle",
    "report_passed",
    "versioned_plan",
    "write_report",
    # from an exported model or a PyTorch module to a bundle (torch only when exporting)
    "TorchInput",
    "export_torch",
    "from_torch",
    # signing release reports
    "SigningKeyError",
    "generate_signing_key",
    "load_signing_key",
    "sign_report",
]
