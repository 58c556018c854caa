"""The minimal FL server: populations, tasks, selection, rounds, aggregation, persistence."""

from .admin_client import AdminClient, AdminError
from .app import create_app, create_app_from_path
from .errors import ApiError
from .persistence import RoundRecord, ServerStore, TaskRecord, resource_id
from .rounds import Phase, ReportVerdict, RoundConfig, RoundCore, SessionState
from .serve import ServerThread, free_port
from .service import FLService

__all__ = [
    "AdminClient",
    "AdminError",
    "ApiError",
    "FLService",
    "Phase",
    "ReportVerdict",
    "RoundConfig",
    "RoundCore",
    "RoundRecord",
    "ServerStore",
    "ServerThread",
    "SessionState",
    "TaskRecord",
    "create_app",
    "create_app_from_path",
    "free_port",
    "resource_id",
]
