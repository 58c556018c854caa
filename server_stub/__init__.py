"""The minimal FL server: populations, tasks, selection, rounds, aggregation, persistence."""

from .admin_auth import ADMIN_KEYS_ENV, AdminKeyError, AdminKeys
from .admin_client import AdminClient, AdminError, ServerUnreachable, task_body
from .app import create_app, create_app_from_path
from .attestation import AttestationVerifier, NonceRegistry, RateLimiter, VerifiedDevice
from .dp_config import DPConfig
from .errors import ApiError
from .http_guards import HttpLimits
from .influence import Bounded, bound_update
from .metrics import MetricSummary, RoundMetrics, device_metrics, rounds_frame
from .persistence import RoundRecord, ServerStore, TaskRecord, resource_id
from .release_gate import REPORT_FORMAT, ReleaseGateError, check_release_report
from .release_trust import ReleaseTrustError, read_release_trust
from .rounds import Phase, ReportVerdict, RoundConfig, RoundCore, SessionState
from .secure_rounds import SecureGroup, SecureRound, SecureSettings
from .serve import ServerThread, free_port
from .service import FLService, TaskSpec
from .task_choice import Strategy, choose_task
from .trust_anchor import TrustAnchorError, read_trust_anchor, write_trust_anchor

__all__ = [
    "ADMIN_KEYS_ENV",
    "AdminKeyError",
    "AdminKeys",
    "Bounded",
    "MetricSummary",
    "RoundMetrics",
    "Strategy",
    "TaskSpec",
    "TrustAnchorError",
    "bound_update",
    "choose_task",
    "device_metrics",
    "read_trust_anchor",
    "rounds_frame",
    "task_body",
    "write_trust_anchor",
    "SecureGroup",
    "SecureRound",
    "SecureSettings",
    "AdminClient",
    "AdminError",
    "ServerUnreachable",
    "ApiError",
    "AttestationVerifier",
    "FLService",
    "HttpLimits",
    "NonceRegistry",
    "Phase",
    "RateLimiter",
    "ReportVerdict",
    "DPConfig",
    "RoundConfig",
    "RoundCore",
    "RoundRecord",
    "ServerStore",
    "ServerThread",
    "SessionState",
    "TaskRecord",
    "VerifiedDevice",
    "create_app",
    "create_app_from_path",
    "free_port",
    "resource_id",
    "REPORT_FORMAT",
    "ReleaseGateError",
    "check_release_report",
    "ReleaseTrustError",
    "read_release_trust",
]
