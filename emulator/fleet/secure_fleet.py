"""What a secure task adds to a simulated fleet: an attestation authority that certifies every
device, the server's verifier of those certificates, and how a device waits for its group.

Secure Aggregation under the devices' default floor needs an attested cohort (see
``device_runtime.secagg_policy``): each device holds a key the authority certified and checks
that its peers do too. In a simulation every key comes from the fleet's seed, so the groups
(which follow from the attested keys and the server's seed) and every round repeat run for run;
certificates are issued at the simulation's start, on its virtual calendar."""

from __future__ import annotations

import random
from typing import Any

from device_runtime.attestation import DeviceAttestor
from server_stub.attestation import AttestationVerifier, NonceRegistry, RateLimiter

from ..devices.attestation_authority import AttestationAuthority

#: How often a device polls its Secure Aggregation mailbox, in virtual seconds. The server does
#: not hold a simulated device's poll (it cannot wait in a time it does not share); one second is
#: the simulated server's tick, when a group's round can time out and move on. While it waits
#: for its group's other masked inputs the device waits longer between polls that bring nothing
#: new, up to ``device_runtime.secure_client.IDLE_POLL_MAX_S``.
SECAGG_POLL_S = 1.0


class FleetAttestation:
    """The fleet's attestation authority, from the fleet's seed."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.authority = AttestationAuthority.generate(random_bytes=random.Random(seed ^ 0xA7735).randbytes)
        self.trust_anchor = self.authority.trust_anchor()

    def verifier(self) -> AttestationVerifier:
        """The server's check of device attestations, with the production defaults for nonces and
        for the per-device rate of check-ins (devices come back minutes apart)."""
        nonces = NonceRegistry(random_bytes=random.Random(self.seed ^ 0x40CE).randbytes)
        return AttestationVerifier(self.trust_anchor, nonces, RateLimiter())

    def attestor(self, spec: Any, now: float) -> DeviceAttestor:
        """The device's certified key, drawn from its own seed: devices of any shard get the same."""
        return self.authority.new_device_attestor(
            spec.device_class, now, random_bytes=random.Random(spec.seed ^ 0xA77E57).randbytes
        )


__all__ = ["FleetAttestation", "SECAGG_POLL_S"]
