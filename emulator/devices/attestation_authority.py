"""An emulated attestation authority: the party that vouches "this key lives in a genuine device".

On real phones that role belongs to the platform vendor's key attestation; here an Ed25519 key pair
certifies emulated devices, and the FL server trusts its public key. Certificates carry only a
device class, never a user or a serial number.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from device_runtime.attestation import (
    DEVICE_CLASS_PATTERN,
    PUBLIC_KEY_BYTES,
    DeviceAttestor,
    DeviceCertificate,
    MalformedAttestation,
    authority_key_id,
    b64decode_strict,
    b64encode,
    generate_device_key,
    raw_public_key,
)
from server_stub.trust_anchor import write_trust_anchor

DEFAULT_VALIDITY_S = 365 * 24 * 3600.0
"""Certificates last a year by default, like a device attestation certificate chain would."""


class AttestationAuthority:
    """Holds the authority's key; issues device certificates."""

    def __init__(self, private_key: Ed25519PrivateKey | None = None) -> None:
        self._key = private_key if private_key is not None else Ed25519PrivateKey.generate()
        self._public = raw_public_key(self._key)
        self._key_id = authority_key_id(self._public)

    @classmethod
    def generate(cls, random_bytes: Callable[[int], bytes] = os.urandom) -> AttestationAuthority:
        """A new authority; pass ``random_bytes`` (e.g. a seeded generator) for a reproducible emulation."""
        return cls(generate_device_key(random_bytes))

    def public_key_bytes(self) -> bytes:
        """The raw 32-byte public key the server is configured to trust."""
        return self._public

    @property
    def key_id(self) -> bytes:
        return self._key_id

    def save_trust_anchor(self, path: str | os.PathLike[str]) -> None:
        """Write the public trust anchor a server loads with ``--attestation-trust``."""
        write_trust_anchor(path, self.trust_anchor())

    def trust_anchor(self) -> dict[bytes, bytes]:
        """``{key_id: public_key}``, the shape ``AttestationVerifier`` takes for its trusted authorities."""
        return {self._key_id: self._public}

    def issue(
        self, device_public_key: bytes, device_class: str, now: float, valid_for_s: float = DEFAULT_VALIDITY_S
    ) -> DeviceCertificate:
        """Certify ``device_public_key`` as a device of ``device_class`` from ``now`` for ``valid_for_s``."""
        if not isinstance(device_public_key, (bytes, bytearray)) or len(device_public_key) != PUBLIC_KEY_BYTES:
            raise ValueError(f"device_public_key must be {PUBLIC_KEY_BYTES} raw bytes")
        if not isinstance(device_class, str) or not DEVICE_CLASS_PATTERN.fullmatch(device_class):
            raise ValueError(f"device_class must match {DEVICE_CLASS_PATTERN.pattern} (a model, never an identity)")
        if not valid_for_s > 0:
            raise ValueError("valid_for_s must be positive")
        issued_at, expires_at = float(now), float(now) + float(valid_for_s)
        payload = DeviceCertificate.signing_payload(
            bytes(device_public_key), device_class, issued_at, expires_at, self._key_id
        )
        return DeviceCertificate(
            device_public_key=bytes(device_public_key),
            device_class=device_class,
            issued_at=issued_at,
            expires_at=expires_at,
            authority_key_id=self._key_id,
            signature=self._key.sign(payload),
        )

    def new_device_attestor(
        self,
        device_class: str,
        now: float,
        valid_for_s: float = DEFAULT_VALIDITY_S,
        *,
        device_key: Ed25519PrivateKey | None = None,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> DeviceAttestor:
        """Provision an emulated device: a new key pair (or ``device_key``) and its certificate."""
        key = device_key if device_key is not None else generate_device_key(random_bytes)
        return DeviceAttestor(key, self.issue(raw_public_key(key), device_class, now, valid_for_s))

    # -- optional persistence, so an emulated fleet keeps trusting the same authority across runs -----

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the authority's private key (JSON, mode 0600)."""
        body = json.dumps(
            {
                "format": "fedfleet-attestation-authority",
                "private_key": b64encode(self._key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())),
            }
        ).encode("utf-8")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(body)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> AttestationAuthority:
        try:
            d = json.loads(Path(path).read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise MalformedAttestation(f"{path} is not an authority key file") from exc
        if not isinstance(d, dict) or d.get("format") != "fedfleet-attestation-authority":
            raise MalformedAttestation(f"{path} is not an authority key file")
        raw = b64decode_strict(d.get("private_key"), "private_key", length=32)
        return cls(Ed25519PrivateKey.from_private_bytes(raw))
