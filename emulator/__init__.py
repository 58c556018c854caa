"""Emulated devices and fleets, datasets, the demo, and environments of real onnxruntime releases."""

from .datasets import Dataset, load_digits_dataset, partition_by_shards
from .demo import DemoConfig, DemoConfigError, run_demo
from .devices import AttestationAuthority, DeviceProfile, EmulatedDevice, InProcessTransport, RealTimeFleet
from .releases import (
    ReleasePlans,
    RuntimeEnv,
    RuntimeEnvError,
    RuntimeWorker,
    WorkerError,
    WorkerExecutor,
    WorkerPool,
    assign_releases,
    available_releases,
)

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
