"""The server's attestation checks as a pure core: nonces, a per-device rate limit, and the verifier.

No I/O and no clock reads: every call takes ``now`` (unix seconds) and randomness is injectable, so
the HTTP layer, the emulator's virtual time and the tests all drive the same code. Memory is bounded
everywhere: forgetting an entry early only ever makes the server stricter (an evicted nonce is
refused as unknown), except the rate limiter, where evicting an idle bucket forgets nothing (an
idle bucket is full again) and evicting beyond the cap forgives the least recently seen device.
"""

from __future__ import annotations

import heapq
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from device_runtime.attestation import (
    MAX_NONCE_BYTES,
    MIN_NONCE_BYTES,
    PUBLIC_KEY_BYTES,
    BadCertificateSignature,
    BadSignature,
    CertificateExpired,
    CertificateNotYetValid,
    MalformedAttestation,
    ParsedAttestation,
    RateLimited,
    ReplayedNonce,
    UnknownAuthority,
    UnknownNonce,
    attestation_payload,
    authority_key_id,
    b64encode,
)

RandomBytes = Callable[[int], bytes]


class NonceRegistry:
    """Single-use server nonces with a time to live, so an attestation cannot be recorded and replayed.

    Outstanding nonces are capped (``max_outstanding``): beyond it the oldest is evicted (it will be
    refused as unknown), so a flood of nonce requests costs bounded memory. Consumed nonces are
    remembered until they would have expired (capped by ``max_remembered``) only to answer
    REPLAYED_NONCE instead of UNKNOWN_NONCE; both refuse.
    """

    def __init__(
        self,
        ttl_s: float = 120.0,
        *,
        nonce_bytes: int = 32,
        max_outstanding: int = 100_000,
        max_remembered: int = 100_000,
        random_bytes: RandomBytes = os.urandom,
    ) -> None:
        if not ttl_s > 0:
            raise ValueError("ttl_s must be positive")
        if not MIN_NONCE_BYTES <= nonce_bytes <= MAX_NONCE_BYTES:
            raise ValueError(f"nonce_bytes must be {MIN_NONCE_BYTES}-{MAX_NONCE_BYTES}")
        if max_outstanding < 1 or max_remembered < 0:
            raise ValueError("max_outstanding must be >= 1 and max_remembered >= 0")
        self.ttl_s = float(ttl_s)
        self.nonce_bytes = nonce_bytes
        self.max_outstanding = max_outstanding
        self.max_remembered = max_remembered
        self._random_bytes = random_bytes
        self._outstanding: OrderedDict[bytes, float] = OrderedDict()  # nonce -> expires_at, issue order
        # nonce -> original expires_at, and a heap of (expires_at, nonce): nonces are used up in
        # any order, so only a heap keeps the first to expire at hand
        self._consumed: dict[bytes, float] = {}
        self._consumed_expiry: list[tuple[float, bytes]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Entries held (outstanding + remembered as consumed): what the memory bound is about."""
        return len(self._outstanding) + len(self._consumed)

    @property
    def outstanding(self) -> int:
        return len(self._outstanding)

    def issue(self, now: float) -> bytes:
        """A fresh random nonce, valid until ``now + ttl_s``."""
        with self._lock:
            self._purge(now)
            while True:
                nonce = self._random_bytes(self.nonce_bytes)
                if len(nonce) != self.nonce_bytes:
                    raise ValueError(f"random_bytes returned {len(nonce)} bytes, wanted {self.nonce_bytes}")
                if nonce not in self._outstanding and nonce not in self._consumed:
                    break
            self._outstanding[nonce] = now + self.ttl_s
            while len(self._outstanding) > self.max_outstanding:
                self._outstanding.popitem(last=False)
            return nonce

    def challenge(self, now: float) -> dict[str, Any]:
        """``issue`` as the JSON a server hands a device: ``{"nonce": base64, "expires_at": unix seconds}``."""
        nonce = self.issue(now)
        return {"nonce": b64encode(nonce), "expires_at": now + self.ttl_s}

    def consume(self, nonce: bytes, now: float) -> None:
        """Use ``nonce`` up: UNKNOWN_NONCE if never issued, expired or evicted; REPLAYED_NONCE if used."""
        with self._lock:
            expires_at = self._outstanding.pop(nonce, None)
            if expires_at is None:
                self._purge(now)
                if nonce in self._consumed:
                    raise ReplayedNonce("this nonce was already used; request a fresh one for every check-in")
                raise UnknownNonce("unknown or expired nonce; request a fresh one")
            if now >= expires_at:
                self._purge(now)
                raise UnknownNonce("the nonce expired; request a fresh one")
            if self.max_remembered:
                self._consumed[nonce] = expires_at
                heapq.heappush(self._consumed_expiry, (expires_at, nonce))
                while len(self._consumed) > self.max_remembered:
                    del self._consumed[heapq.heappop(self._consumed_expiry)[1]]
            self._purge(now)

    def _purge(self, now: float) -> None:
        # Outstanding nonces are in issue order and share one ttl, so the expired ones sit at the
        # front (unless ``now`` went backwards; then the caps still bound memory and ``consume``
        # re-checks expiry); consumed ones come off their heap.
        outstanding = self._outstanding
        while outstanding:
            nonce, expires_at = next(iter(outstanding.items()))
            if expires_at > now:
                break
            del outstanding[nonce]
        expiry = self._consumed_expiry
        while expiry and expiry[0][0] <= now:
            del self._consumed[heapq.heappop(expiry)[1]]


class RateLimiter:
    """A token bucket per device: ``burst`` check-ins at once, then one per ``1 / rate_per_s`` seconds.

    Buckets idle long enough to be full again are dropped (nothing is forgotten); beyond ``max_keys``
    the least recently seen device is dropped (it gets a full bucket back), bounding memory.
    """

    def __init__(self, burst: float = 5.0, rate_per_s: float = 1.0 / 60.0, *, max_keys: int = 100_000) -> None:
        if not burst >= 1 or not rate_per_s > 0 or max_keys < 1:
            raise ValueError("burst must be >= 1, rate_per_s > 0, max_keys >= 1")
        self.burst = float(burst)
        self.rate_per_s = float(rate_per_s)
        self.max_keys = max_keys
        self._buckets: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # key -> (tokens, at), LRU order
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._buckets)

    @property
    def refill_s(self) -> float:
        """How long an empty bucket takes to be full; a bucket idle this long is dropped."""
        return self.burst / self.rate_per_s

    def check(self, key: bytes, now: float) -> None:
        """Take one token for ``key`` or raise RATE_LIMITED with the time until one is available."""
        with self._lock:
            self._evict_idle(now)
            tokens, at = self._buckets.pop(key, (self.burst, now))
            tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate_per_s)
            at = max(at, now)  # a clock stepping back neither refills nor drains
            if tokens < 1.0:
                self._buckets[key] = (tokens, at)
                wait = (1.0 - tokens) / self.rate_per_s
                raise RateLimited(f"this device checked in too often; retry in {wait:.0f} s", retry_after_s=wait)
            self._buckets[key] = (tokens - 1.0, at)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)

    def _evict_idle(self, now: float) -> None:
        # LRU order: the front was touched longest ago; stop at the first bucket not yet full again.
        while self._buckets:
            key, (_, at) = next(iter(self._buckets.items()))
            if now - at < self.refill_s:
                break
            del self._buckets[key]


@dataclass(frozen=True)
class VerifiedDevice:
    """What the server learns from an accepted attestation: a pseudonym and a device class, no identity."""

    device_key_hash: bytes
    """SHA-256 of the device key: the rate-limit key; do not log it next to anything identifying."""
    device_class: str
    authority_key_id: bytes
    certificate_expires_at: float


class AttestationVerifier:
    """Checks an attestation in the order that keeps it cheap and unabusable; see ``verify``."""

    def __init__(
        self,
        trusted_authorities: Mapping[bytes, bytes] | Iterable[bytes],
        nonces: NonceRegistry,
        limiter: RateLimiter,
        *,
        clock_skew_s: float = 0.0,
    ) -> None:
        """``trusted_authorities``: raw Ed25519 public keys, or ``{key_id: public_key}`` (key ids checked)."""
        self._authorities: dict[bytes, Ed25519PublicKey] = {}
        #: ``{key_id: public_key}`` of the trusted authorities, as devices hold it
        self.trust_anchor: dict[bytes, bytes] = {}
        items = (
            trusted_authorities.items()
            if isinstance(trusted_authorities, Mapping)
            else ((None, pk) for pk in trusted_authorities)
        )
        for key_id, public in items:
            public = bytes(public)
            if len(public) != PUBLIC_KEY_BYTES:
                raise ValueError("authority public keys must be 32 raw bytes")
            expected = authority_key_id(public)
            if key_id is not None and bytes(key_id) != expected:
                raise ValueError("an authority key id does not match its public key")
            self._authorities[expected] = Ed25519PublicKey.from_public_bytes(public)
            self.trust_anchor[expected] = public
        if clock_skew_s < 0:
            raise ValueError("clock_skew_s must be >= 0")
        self.nonces = nonces
        self.limiter = limiter
        self.clock_skew_s = float(clock_skew_s)

    def verify(self, attestation: Any, population: Any, runtime_version: Any, now: float) -> VerifiedDevice:
        """Accept a genuine device's attestation for this check-in or raise ``AttestationError``.

        Order: format, known authority, certificate signature, validity window, device signature over
        nonce|population|runtime version|certificate, then the nonce is consumed (only now, so a forged
        attestation cannot burn a nonce someone else holds), then the per-device rate limit.
        """
        parsed = ParsedAttestation.from_dict(attestation)
        for what, value in (("population", population), ("runtime_version", runtime_version)):
            if not isinstance(value, str):
                raise MalformedAttestation(f"{what} must be a string")
        payload = attestation_payload(parsed.nonce, population, runtime_version, parsed.certificate.fingerprint())
        cert = parsed.certificate

        authority = self._authorities.get(cert.authority_key_id)
        if authority is None:
            raise UnknownAuthority("the certificate's authority is not trusted by this server")
        try:
            authority.verify(cert.signature, cert.signed_payload())
        except InvalidSignature:
            raise BadCertificateSignature("the certificate's signature does not verify against its authority") from None

        if now < cert.issued_at - self.clock_skew_s:
            raise CertificateNotYetValid(f"the certificate is valid from {cert.issued_at:.0f}, now is {now:.0f}")
        if now >= cert.expires_at + self.clock_skew_s:
            raise CertificateExpired(f"the certificate expired at {cert.expires_at:.0f}, now is {now:.0f}")

        try:
            Ed25519PublicKey.from_public_bytes(cert.device_public_key).verify(parsed.signature, payload)
        except (InvalidSignature, ValueError):
            raise BadSignature(
                "the device signature does not cover this nonce, population, runtime version and certificate"
            ) from None

        self.nonces.consume(parsed.nonce, now)
        key_hash = cert.device_key_hash()
        self.limiter.check(key_hash, now)
        return VerifiedDevice(key_hash, cert.device_class, cert.authority_key_id, cert.expires_at)
