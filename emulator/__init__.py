"""Emulated devices and fleets, datasets, the demo, and environments of real onnxruntime releases."""

from .attestation_authority import AttestationAuthority
from .datasets import Dataset, load_digits_dataset, partition_by_shards
from .demo import DemoConfig, DemoConfigError, run_demo
from .device import DeviceProfile, EmulatedDevice, Fleet
from .inprocess import InProcessTransport
from .runtime_envs import RuntimeEnv, RuntimeEnvError, available_releases
from .runtime_worker import ReleasePlans, RuntimeWorker, WorkerError, WorkerExecutor, WorkerPool, assign_releases

__all__ = [
    "AttestationAuthority",
    "Dataset",
    "DemoConfig",
    "DemoConfigError",
    "DeviceProfile",
    "EmulatedDevice",
    "Fleet",
    "InProcessTransport",
    "ReleasePlans",
    "RuntimeEnv",
    "RuntimeEnvError",
    "RuntimeWorker",
    "WorkerError",
    "WorkerExecutor",
    "WorkerPool",
    "assign_releases",
    "available_releases",
    "load_digits_dataset",
    "partition_by_shards",
    "run_demo",
]
