"""onnxruntime releases: an environment per release, worker processes that train on it, the measured support record, the kernel probe.

The support record and the kernel probe run as commands (``python -m emulator.releases.support``,
``python -m emulator.releases.kernel_probe``), so they are not imported here."""

from .envs import RuntimeEnv, RuntimeEnvError, available_releases
from .workers import ReleasePlans, RuntimeWorker, WorkerError, WorkerExecutor, WorkerPool, assign_releases

__all__ = [
    "ReleasePlans",
    "RuntimeEnv",
    "RuntimeEnvError",
    "RuntimeWorker",
    "WorkerError",
    "WorkerExecutor",
    "WorkerPool",
    "assign_releases",
    "available_releases",
]
