"""Emulated devices and fleets, datasets, the demo, and environments of real onnxruntime releases."""

from .datasets import Dataset, load_digits_dataset, partition_by_shards
from .demo import DemoConfig, DemoConfigError, run_demo
from .devices.attestation_authority import AttestationAuthority
from .devices.device import DeviceProfile, EmulatedDevice, RealTimeFleet
from .devices.inprocess import InProcessTransport
from .releases.envs import RuntimeEnv, RuntimeEnvError, available_releases
from .releases.workers import ReleasePlans, RuntimeWorker, WorkerError, WorkerExecutor, WorkerPool, assign_releases

__all__ = [
    "AttestationAuthority",
    "Dataset",
    "DemoConfig",
    "DemoConfigError",
    "DeviceProfile",
    "EmulatedDevice",
    "RealTimeFleet",
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
