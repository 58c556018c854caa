"""The minimal FL server: populations, tasks, selection, rounds, aggregation, persistence."""

from .admin_client import AdminClient, AdminError
from .app import create_app, create_app_from_path
from .attestation import AttestationVerifier, NonceRegistry, RateLimiter, VerifiedDevice
from .errors import ApiError
from .persistence import RoundRecord, ServerStore, TaskRecord, resource_id
from .rounds import Phase, ReportVerdict, RoundConfig, RoundCore, SessionState
from .secure_rounds import SecureGroup, SecureRound, SecureSettings
from .serve import ServerThread, free_port
from .service import FLService

__all__ = [
    "SecureGroup",
    "SecureRound",
    "SecureSettings",
    "AdminClient",
    "AdminError",
    "ApiError",
    "AttestationVerifier",
    "FLService",
    "NonceRegistry",
    "Phase",
    "RateLimiter",
    "ReportVerdict",
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
]
