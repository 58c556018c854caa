"""The minimal FL server: populations, tasks, selection, rounds, aggregation, persistence.

``__all__`` holds what the package's users call: an operator who runs a server and talks to it
(``ServerThread``, ``create_app``, ``FLService`` over a ``ServerStore``, ``AdminClient`` and its
errors, ``RoundConfig``, ``DPConfig``, task groups' ``Strategy``, admin keys, the attestation
verifier and its trust anchor, the HTTP limits). The round core, pace steering, task choice,
Secure Aggregation driving, metric summaries, the release gate and the other parts the server is
made of are imported from their modules (``server_stub.rounds``, ``server_stub.release_gate``, ...)
by the tests and by the emulator."""

from .admin_auth import AdminKeyError, AdminKeys
from .admin_client import AdminClient, AdminError, ServerUnreachable, task_body
from .app import create_app, create_app_from_path
from .attestation import AttestationVerifier, NonceRegistry, RateLimiter
from .dp_config import DPConfig
from .errors import ApiError
from .http_guards import HttpLimits
from .persistence import RoundRecord, ServerStore, TaskRecord
from .rounds import RoundConfig
from .serve import ServerThread, free_port
from .service import FLService, TaskSpec
from .task_choice import Strategy
from .trust_anchor import TrustAnchorError, read_trust_anchor

__all__ = [
    # running a server
    "ServerThread",
    "free_port",
    "create_app",
    "create_app_from_path",
    "FLService",
    "ServerStore",
    "HttpLimits",
    "AdminKeys",
    "AdminKeyError",
    # attested devices only
    "AttestationVerifier",
    "NonceRegistry",
    "RateLimiter",
    "read_trust_anchor",
    "TrustAnchorError",
    # operating it: tasks and their rounds
    "AdminClient",
    "AdminError",
    "ServerUnreachable",
    "ApiError",
    "task_body",
    "RoundConfig",
    "DPConfig",
    "TaskSpec",
    "Strategy",
    "TaskRecord",
    "RoundRecord",
]
