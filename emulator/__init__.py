"""Emulated devices and fleets, datasets, and the demo."""

from .attestation_authority import AttestationAuthority
from .datasets import Dataset, load_digits_dataset, partition_by_shards
from .demo import DemoConfig, run_demo
from .device import DeviceProfile, EmulatedDevice, Fleet

__all__ = [
    "AttestationAuthority",
    "Dataset",
    "DemoConfig",
    "DeviceProfile",
    "EmulatedDevice",
    "Fleet",
    "load_digits_dataset",
    "partition_by_shards",
    "run_demo",
]
