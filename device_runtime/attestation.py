"""Device attestation without a user identity: the certificate format, the device side, and the errors.

A device holds an Ed25519 key pair whose public half an attestation authority certified (a
``DeviceCertificate``: key, a non-identifying device class, a validity window). To check in, the
device signs a fresh server nonce bound to the population and its runtime version, so the server
learns "a certified device of class X" and nothing about who uses it. The certificate and the
attestation are encoded canonically (fixed layout, length prefixes, a domain-separation tag per
signature) so one signed payload can never be reinterpreted as another.

The server-side checks live in ``server_stub.attestation``; the emulated authority in
``emulator.devices.attestation_authority``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import os
import re
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from example_store.keystore import sync_folder
from secagg.crypto import ed25519_valid

ATTESTATION_VERSION = 1
"""Version of the attestation JSON and of both canonical encodings; bump it on any layout change."""

CERTIFICATE_MAGIC = b"FFDC\x01"
CERTIFICATE_SIGNING_DOMAIN = b"fedfleet.device-certificate.v1\x00"
ATTESTATION_SIGNING_DOMAIN = b"fedfleet.device-attestation.v1\x00"

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
KEY_ID_BYTES = 32
MIN_NONCE_BYTES = 16
MAX_NONCE_BYTES = 64
MAX_DEVICE_CLASS_CHARS = 64
DEVICE_CLASS_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""A device class is a model/category label (``emulated-pixel``), never a serial number or a name:
the charset is restricted so free-form identifying text does not fit comfortably."""

_KEYSTORE_FORMAT = "fedfleet-device-keystore"
_FIXED = struct.Struct(">32s32sddB")  # device key, authority key id, issued_at, expires_at, class length


# --------------------------------------------------------------------------------------------- errors


class AttestationError(Exception):
    """Base of every attestation failure; ``code`` is a stable string the HTTP layer returns as is."""

    code: ClassVar[str] = "ATTESTATION_FAILED"
    http_status: ClassVar[int] = 401
    """Suggested HTTP status: 400 for malformed input, 401 for a refused proof, 429 for the rate limit."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_json(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message}}


class MalformedAttestation(AttestationError):
    """The attestation (or certificate, nonce, keystore) does not parse; nothing was verified."""

    code, http_status = "MALFORMED", 400


class UnknownAuthority(AttestationError):
    """The certificate names an authority this server does not trust."""

    code = "UNKNOWN_AUTHORITY"


class BadCertificateSignature(AttestationError):
    """The certificate was not signed by the authority it names (forged or tampered)."""

    code = "BAD_CERTIFICATE_SIGNATURE"


class CertificateExpired(AttestationError):
    code = "CERTIFICATE_EXPIRED"


class CertificateNotYetValid(AttestationError):
    code = "CERTIFICATE_NOT_YET_VALID"


class BadSignature(AttestationError):
    """The device's signature does not cover this nonce, population, runtime version and certificate."""

    code = "BAD_SIGNATURE"


class UnknownNonce(AttestationError):
    """The nonce was never issued by this server, or it expired, or it was evicted; get a new one."""

    code = "UNKNOWN_NONCE"


class ReplayedNonce(AttestationError):
    """The nonce was already used by an accepted attestation; every check-in needs a fresh one."""

    code = "REPLAYED_NONCE"


class RateLimited(AttestationError):
    """This device checked in too often; ``retry_after_s`` says when its next check-in can pass."""

    code, http_status = "RATE_LIMITED", 429

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


ATTESTATION_ERROR_CODES: tuple[str, ...] = tuple(
    cls.code
    for cls in (
        MalformedAttestation,
        UnknownAuthority,
        BadCertificateSignature,
        CertificateExpired,
        CertificateNotYetValid,
        BadSignature,
        UnknownNonce,
        ReplayedNonce,
        RateLimited,
    )
)


# ------------------------------------------------------------------------------------------- encoding


def b64encode(data: bytes) -> str:
    """Standard, padded base64 as text: the only form this module emits."""
    return base64.b64encode(data).decode("ascii")


def b64decode_strict(
    value: Any, what: str, *, length: int | None = None, min_len: int = 0, max_len: int | None = None
) -> bytes:
    """Decode canonical base64 or raise MALFORMED: no stray characters, no alternative spellings."""
    if not isinstance(value, str):
        raise MalformedAttestation(f"{what} must be a base64 string, got {type(value).__name__}")
    if len(value) > 4 * ((max_len or length or 4096) + 2) // 3 + 4:
        raise MalformedAttestation(f"{what} is too long")
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error, ValueError) as exc:
        raise MalformedAttestation(f"{what} is not valid base64") from exc
    if b64encode(raw) != value:
        raise MalformedAttestation(f"{what} is not canonical base64")
    if length is not None and len(raw) != length:
        raise MalformedAttestation(f"{what} must be {length} bytes, got {len(raw)}")
    if len(raw) < min_len or (max_len is not None and len(raw) > max_len):
        raise MalformedAttestation(f"{what} must be {min_len}-{max_len} bytes, got {len(raw)}")
    return raw


def authority_key_id(authority_public_key: bytes) -> bytes:
    """The id a certificate uses to name its authority: SHA-256 of a domain tag and the raw public key."""
    return hashlib.sha256(b"fedfleet.authority-key-id.v1\x00" + bytes(authority_public_key)).digest()


def device_key_hash(device_public_key: bytes) -> bytes:
    """A pseudonym for a device key (the rate-limit key): stable across certificate renewals."""
    return hashlib.sha256(b"fedfleet.device-key-hash.v1\x00" + bytes(device_public_key)).digest()


def _time(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedAttestation(f"{what} must be a number of unix seconds, got {type(value).__name__}")
    try:
        out = float(value)
    except OverflowError as exc:
        raise MalformedAttestation(f"{what} is out of range") from exc
    if not math.isfinite(out):
        raise MalformedAttestation(f"{what} must be finite")
    return out


def _utf8(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise MalformedAttestation(f"{what} must be a string, got {type(value).__name__}")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise MalformedAttestation(f"{what} is not valid unicode") from exc


def _exact_keys(d: Any, keys: frozenset[str], what: str) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise MalformedAttestation(f"{what} must be a JSON object, got {type(d).__name__}")
    present = set(d.keys())
    if present != keys:
        missing, extra = sorted(keys - present), sorted(map(str, present - keys))
        raise MalformedAttestation(f"{what} fields: missing {missing}, unexpected {extra}")
    return d


def _version(value: Any, what: str) -> None:
    if isinstance(value, bool) or value != ATTESTATION_VERSION or not isinstance(value, int):
        raise MalformedAttestation(f"{what} version must be {ATTESTATION_VERSION}, got {value!r:.40}")


# ---------------------------------------------------------------------------------------- certificate


@dataclass(frozen=True)
class DeviceCertificate:
    """An authority's statement "this Ed25519 key belongs to a genuine device of this class, in this window".

    Constructing one validates every field (MALFORMED otherwise), so a parsed certificate is
    well-formed; whether its signature holds is the verifier's job.
    """

    device_public_key: bytes
    device_class: str
    issued_at: float
    expires_at: float
    authority_key_id: bytes
    signature: bytes

    _FIELDS: ClassVar[frozenset[str]] = frozenset(
        {"version", "device_public_key", "device_class", "issued_at", "expires_at", "authority_key_id", "signature"}
    )

    def __post_init__(self) -> None:
        for name, size in (
            ("device_public_key", PUBLIC_KEY_BYTES),
            ("authority_key_id", KEY_ID_BYTES),
            ("signature", SIGNATURE_BYTES),
        ):
            value = getattr(self, name)
            if not isinstance(value, (bytes, bytearray)) or len(value) != size:
                raise MalformedAttestation(f"certificate {name} must be {size} bytes")
            object.__setattr__(self, name, bytes(value))
        if not isinstance(self.device_class, str) or not DEVICE_CLASS_PATTERN.fullmatch(self.device_class):
            raise MalformedAttestation(
                f"certificate device_class must match {DEVICE_CLASS_PATTERN.pattern}, got {self.device_class!r:.80}"
            )
        issued, expires = _time(self.issued_at, "issued_at"), _time(self.expires_at, "expires_at")
        if not expires > issued:
            raise MalformedAttestation("certificate expires_at must be after issued_at")
        object.__setattr__(self, "issued_at", issued)
        object.__setattr__(self, "expires_at", expires)

    # The signed part is the binary encoding without the signature, behind a domain tag.
    @staticmethod
    def encode_unsigned(
        device_public_key: bytes, device_class: str, issued_at: float, expires_at: float, authority_key_id: bytes
    ) -> bytes:
        cls_bytes = device_class.encode("ascii")
        return (
            CERTIFICATE_MAGIC
            + _FIXED.pack(
                bytes(device_public_key), bytes(authority_key_id), float(issued_at), float(expires_at), len(cls_bytes)
            )
            + cls_bytes
        )

    @staticmethod
    def signing_payload(
        device_public_key: bytes, device_class: str, issued_at: float, expires_at: float, authority_key_id: bytes
    ) -> bytes:
        """What the authority signs (domain-separated so no other signature in the system matches it)."""
        return CERTIFICATE_SIGNING_DOMAIN + DeviceCertificate.encode_unsigned(
            device_public_key, device_class, issued_at, expires_at, authority_key_id
        )

    def signed_payload(self) -> bytes:
        return self.signing_payload(
            self.device_public_key, self.device_class, self.issued_at, self.expires_at, self.authority_key_id
        )

    def to_bytes(self) -> bytes:
        """Canonical binary form: magic, key, key id, times (f64 BE), class (u8 length), signature."""
        return (
            self.encode_unsigned(
                self.device_public_key, self.device_class, self.issued_at, self.expires_at, self.authority_key_id
            )
            + self.signature
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> DeviceCertificate:
        """Strict inverse of ``to_bytes``: any other input raises MALFORMED."""
        if not isinstance(data, (bytes, bytearray)):
            raise MalformedAttestation("certificate must be bytes")
        data = bytes(data)
        head = len(CERTIFICATE_MAGIC) + _FIXED.size
        if len(data) < head or not data.startswith(CERTIFICATE_MAGIC):
            raise MalformedAttestation("not a device certificate (bad magic or too short)")
        key, key_id, issued, expires, n = _FIXED.unpack_from(data, len(CERTIFICATE_MAGIC))
        if len(data) != head + n + SIGNATURE_BYTES:
            raise MalformedAttestation("device certificate has the wrong length")
        try:
            device_class = data[head : head + n].decode("ascii")
        except UnicodeDecodeError as exc:
            raise MalformedAttestation("certificate device_class is not ascii") from exc
        cert = cls(key, device_class, issued, expires, key_id, data[head + n :])
        if cert.to_bytes() != data:  # one certificate, one encoding
            raise MalformedAttestation("device certificate is not canonically encoded")
        return cert

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form carried in a check-in body (bytes as standard base64)."""
        return {
            "version": ATTESTATION_VERSION,
            "device_public_key": b64encode(self.device_public_key),
            "device_class": self.device_class,
            "issued_at": self.issued_at,
            "expires_at": self.expires_at,
            "authority_key_id": b64encode(self.authority_key_id),
            "signature": b64encode(self.signature),
        }

    @classmethod
    def from_dict(cls, d: Any) -> DeviceCertificate:
        """Strict inverse of ``to_dict``: exact field set, exact types, canonical base64, else MALFORMED."""
        d = _exact_keys(d, cls._FIELDS, "certificate")
        _version(d["version"], "certificate")
        return cls(
            device_public_key=b64decode_strict(d["device_public_key"], "device_public_key", length=PUBLIC_KEY_BYTES),
            device_class=d["device_class"],
            issued_at=_time(d["issued_at"], "issued_at"),
            expires_at=_time(d["expires_at"], "expires_at"),
            authority_key_id=b64decode_strict(d["authority_key_id"], "authority_key_id", length=KEY_ID_BYTES),
            signature=b64decode_strict(d["signature"], "certificate signature", length=SIGNATURE_BYTES),
        )

    def fingerprint(self) -> bytes:
        """SHA-256 of the canonical bytes: what an attestation binds to, so a swapped certificate fails."""
        return hashlib.sha256(self.to_bytes()).digest()

    def device_key_hash(self) -> bytes:
        return device_key_hash(self.device_public_key)

    def is_valid_at(self, now: float) -> bool:
        return self.issued_at <= now < self.expires_at


# ---------------------------------------------------------------------------------------- attestation


def attestation_payload(nonce: bytes, population: str, runtime_version: str, certificate_fingerprint: bytes) -> bytes:
    """What the device signs: domain tag, then length-prefixed nonce, population, runtime version, and the
    certificate's fingerprint, so the signature is good for exactly one check-in of one certificate."""
    pop, rv = _utf8(population, "population"), _utf8(runtime_version, "runtime_version")
    out = [ATTESTATION_SIGNING_DOMAIN]
    for part in (bytes(nonce), pop, rv):
        out.append(struct.pack(">I", len(part)))
        out.append(part)
    out.append(bytes(certificate_fingerprint))
    return b"".join(out)


@dataclass(frozen=True)
class ParsedAttestation:
    """A structurally valid attestation, not yet verified."""

    certificate: DeviceCertificate
    nonce: bytes
    signature: bytes

    _FIELDS: ClassVar[frozenset[str]] = frozenset({"version", "certificate", "nonce", "signature"})

    @classmethod
    def from_dict(cls, d: Any) -> ParsedAttestation:
        """Parse the JSON attestation strictly; any deviation raises MALFORMED, never another exception."""
        d = _exact_keys(d, cls._FIELDS, "attestation")
        _version(d["version"], "attestation")
        return cls(
            certificate=DeviceCertificate.from_dict(d["certificate"]),
            nonce=b64decode_strict(d["nonce"], "nonce", min_len=MIN_NONCE_BYTES, max_len=MAX_NONCE_BYTES),
            signature=b64decode_strict(d["signature"], "signature", length=SIGNATURE_BYTES),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": ATTESTATION_VERSION,
            "certificate": self.certificate.to_dict(),
            "nonce": b64encode(self.nonce),
            "signature": b64encode(self.signature),
        }


def decode_nonce(value: Any) -> bytes:
    """The nonce bytes from a server challenge's ``"nonce"`` field (base64), MALFORMED if it is not one."""
    return b64decode_strict(value, "nonce", min_len=MIN_NONCE_BYTES, max_len=MAX_NONCE_BYTES)


def generate_device_key(random_bytes: Callable[[int], bytes] = os.urandom) -> Ed25519PrivateKey:
    """A fresh device key; ``random_bytes`` is injectable so an emulated fleet can be reproducible."""
    seed = random_bytes(32)
    if len(seed) != 32:
        raise ValueError("random_bytes(32) must return 32 bytes")
    return Ed25519PrivateKey.from_private_bytes(seed)


def raw_public_key(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(Encoding.Raw, PublicFormat.Raw)


class DeviceAttestor:
    """The device's side: its private key (never leaves the device) and its certificate.

    ``attest`` answers a server nonce; the result is JSON-safe and goes into the check-in body.
    """

    def __init__(self, private_key: Ed25519PrivateKey, certificate: DeviceCertificate) -> None:
        if raw_public_key(private_key) != certificate.device_public_key:
            raise ValueError("the certificate does not certify this private key")
        self._key = private_key
        self._certificate = certificate

    @property
    def certificate(self) -> DeviceCertificate:
        return self._certificate

    @property
    def public_key_bytes(self) -> bytes:
        return self._certificate.device_public_key

    @property
    def device_class(self) -> str:
        return self._certificate.device_class

    def secagg_signer(self) -> AttestedSigner:
        """This device's key as a Secure Aggregation signer: its peers check the certificate
        and the key signs the device's advertised keys and protocol messages."""
        return AttestedSigner(self._key, self._certificate)

    def with_certificate(self, certificate: DeviceCertificate) -> DeviceAttestor:
        """Same key, renewed certificate (the rate-limit pseudonym stays the same)."""
        return DeviceAttestor(self._key, certificate)

    def attest(self, nonce: bytes, population: str, runtime_version: str) -> dict[str, Any]:
        """Sign the server's nonce bound to this check-in's population and runtime version."""
        nonce = bytes(nonce)
        if not MIN_NONCE_BYTES <= len(nonce) <= MAX_NONCE_BYTES:
            raise ValueError(f"nonce must be {MIN_NONCE_BYTES}-{MAX_NONCE_BYTES} bytes")
        payload = attestation_payload(nonce, population, runtime_version, self._certificate.fingerprint())
        return ParsedAttestation(self._certificate, nonce, self._key.sign(payload)).to_dict()

    # -- keystore ------------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write key and certificate as JSON, mode 0600, atomically: a crash or a power cut leaves the
        old file or the new (the copy is synced, then renamed over the file, then the folder synced).
        The copies that writers killed before their rename left beside the file, each holding a
        private key, are removed first (``remove_partial_copies``)."""
        path = Path(path)
        body = json.dumps(
            {
                "format": _KEYSTORE_FORMAT,
                "version": ATTESTATION_VERSION,
                "private_key": b64encode(self._key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())),
                "certificate": self._certificate.to_dict(),
            }
        ).encode("utf-8")
        with _SAVING:  # this process's copy is its own save's until renamed: no load or save removes it
            _remove_partial_copies(path)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
            try:
                if hasattr(os, "fchmod"):
                    os.fchmod(fd, 0o600)  # O_CREAT's mode only applies to a new file
                with os.fdopen(fd, "wb") as f:
                    f.write(body)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                raise
        sync_folder(path.parent)  # the rename itself on disk: else a power cut may bring the old key back

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DeviceAttestor:
        """Read a keystore written by ``save``; MALFORMED if it is not one (OSError if it cannot be read).
        Copies a killed ``save`` left beside it are removed (``remove_partial_copies``): an app that
        saves its key once and loads it at every start would otherwise keep them for ever."""
        raw = Path(path).read_bytes()
        remove_partial_copies(path)
        try:
            d = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise MalformedAttestation(f"{path} is not a device keystore") from exc
        d = _exact_keys(d, frozenset({"format", "version", "private_key", "certificate"}), "keystore")
        if d["format"] != _KEYSTORE_FORMAT:
            raise MalformedAttestation(f"{path} is not a device keystore")
        _version(d["version"], "keystore")
        key = Ed25519PrivateKey.from_private_bytes(b64decode_strict(d["private_key"], "private_key", length=32))
        certificate = DeviceCertificate.from_dict(d["certificate"])
        try:
            return cls(key, certificate)
        except ValueError as exc:
            raise MalformedAttestation(f"{path}: {exc}") from exc


def remove_partial_copies(path: str | os.PathLike[str]) -> list[str]:
    """Remove the copies of the keystore ``path`` that ``DeviceAttestor.save`` calls killed before
    their rename left beside it (``.NAME.PID.tmp``, each holding a private key, perhaps one the
    device never used), and return their names. A copy whose writer still runs (its process id is
    alive, this process's excepted: a save of its own is not running now) is left alone. A folder
    that cannot be listed or written is passed: nothing can be removed there. A save of this
    process's own running in another thread is waited for, and its copy is not one to remove."""
    with _SAVING:
        return _remove_partial_copies(path)


#: Held by ``DeviceAttestor.save`` from its copy's creation to its rename, and by a removal of
#: copies: a copy bearing this process's id is then never a save's in flight (another thread's).
_SAVING = threading.Lock()


def _remove_partial_copies(path: str | os.PathLike[str]) -> list[str]:
    """``remove_partial_copies``, with ``_SAVING`` held."""
    path = Path(path)
    partial = re.compile(rf"\.{re.escape(path.name)}\.([0-9]+)\.tmp")
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return []
    removed = []
    for entry in entries:
        match = partial.fullmatch(entry.name)
        if match is None or _writer_alive(int(match.group(1))):
            continue
        try:
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(entry.name)
    return removed


def _writer_alive(pid: int) -> bool:
    """Whether process ``pid`` (a copy's writer, not this process) is alive; where that cannot be
    told (no ``os.kill`` probe), it is taken as alive and its copy kept."""
    if pid == os.getpid():
        return False
    if os.name != "posix":  # pragma: no cover - os.kill(pid, 0) kills on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OverflowError:  # no process has so large an id
        return False
    return True


# ------------------------------------------------------------------------------ Secure Aggregation


class AttestedSigner:
    """A ``secagg.Signer`` backed by the attested device key; the credential is the certificate.
    Secure Aggregation signs only payloads behind its own domain tag (``secagg.crypto.sign``),
    so these signatures can never pass for a check-in attestation."""

    __slots__ = ("_key", "public_key", "credential")

    def __init__(self, private_key: Ed25519PrivateKey, certificate: DeviceCertificate) -> None:
        self._key = private_key
        self.public_key = certificate.device_public_key
        self.credential = certificate.to_bytes()

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)


class PeerCertificateVerifier:
    """A ``secagg.PeerVerifier``: is this peer key certified by an authority of the trust anchor
    (``{key_id: public_key}``, as ``AttestationAuthority.trust_anchor()`` gives it) and valid now?

    Every device checks its peers itself, so a server can add members of its own to a group only
    with certified devices, whose number attestation and its rate limits bound."""

    def __init__(
        self, trust_anchor: Mapping[bytes, bytes], clock: Callable[[], float], *, clock_skew_s: float = 300.0
    ) -> None:
        self._authorities: dict[bytes, bytes] = {}
        for key_id, public in trust_anchor.items():
            if authority_key_id(bytes(public)) != bytes(key_id):
                raise ValueError("a trust anchor key id does not match its public key")
            Ed25519PublicKey.from_public_bytes(bytes(public))  # a key that is not one is refused here
            self._authorities[bytes(key_id)] = bytes(public)
        if not self._authorities:
            raise ValueError("the trust anchor names no authority")
        self._clock = clock
        self._skew = clock_skew_s

    def __call__(self, public_key: bytes, credential: bytes) -> bool:
        try:
            cert = DeviceCertificate.from_bytes(credential)
        except AttestationError:
            return False
        authority = self._authorities.get(cert.authority_key_id)
        if authority is None or cert.device_public_key != bytes(public_key):
            return False
        if not ed25519_valid(authority, bytes(cert.signature), cert.signed_payload()):
            return False
        now = self._clock()
        return cert.issued_at - self._skew <= now < cert.expires_at + self._skew
