"""Emulated devices on real time: conditions, attested keys, the SDK over HTTP or in process, and the real-time fleet."""

from .attestation_authority import AttestationAuthority
from .conditions import DiurnalConditions
from .device import DeviceProfile, EmulatedDevice, RealTimeFleet
from .inprocess import InProcessTransport

__all__ = [
    "AttestationAuthority",
    "DeviceProfile",
    "DiurnalConditions",
    "EmulatedDevice",
    "InProcessTransport",
    "RealTimeFleet",
]
