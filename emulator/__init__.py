"""Emulated devices and fleets, datasets, the demo, and environments of real onnxruntime releases.

The fleet simulation is ``emulator.fleet``, the model engineer's toolchain ``emulator.toolchain``;
the release worker processes the simulation and the release tests run are ``emulator.releases``'s."""

from .datasets import Dataset, load_digits_dataset, partition_by_shards
from .demo import DemoConfig, DemoConfigError, run_demo
from .devices import AttestationAuthority, DeviceProfile, EmulatedDevice, InProcessTransport, RealTimeFleet
from .releases import RuntimeEnv, RuntimeEnvError, available_releases

__all__ = [
    "AttestationAuthority",
    "Dataset",
    "DemoConfig",
    "DemoConfigError",
    "DeviceProfile",
    "EmulatedDevice",
    "RealTimeFleet",
    "InProcessTransport",
    "RuntimeEnv",
    "RuntimeEnvError",
    "available_releases",
    "load_digits_dataset",
    "partition_by_shards",
    "run_demo",
]
