"""Key agreement, key derivation and authenticated encryption for the share pairs.

X25519 for both key pairs (c: encryption of shares, s: pairwise mask seeds), HKDF-SHA256
(RFC 5869, computed with the stdlib's one-shot HMAC because it is ~3x cheaper per call than
building a ``cryptography`` HKDF object and ShareKeys needs n(n-1) derivations), AES-256-GCM
for the share pairs. Every derived key is bound to the session id and to the ordered pair of
client ids, so a ciphertext replayed into another session or readdressed does not decrypt.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import struct
from collections.abc import Callable

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .identity import Signer

KEY_BYTES = 32
SIG_BYTES = 64
GCM_TAG = 16
_NONCE = bytes(12)  # every AES-GCM key is used for exactly one message (direction-bound key)
_PAIR = struct.Struct("<II")


def hkdf_sha256(ikm: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """RFC 5869 HKDF-SHA256 (extract then expand)."""
    prk = hmac.digest(salt or bytes(32), ikm, "sha256")
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.digest(prk, block + info + bytes([counter]), "sha256")
        out += block
        counter += 1
    return out[:length]


class KeyPair:
    """An X25519 key pair built from injectable randomness."""

    __slots__ = ("private", "public_bytes")

    def __init__(self, random_bytes: Callable[[int], bytes]) -> None:
        self.private = X25519PrivateKey.from_private_bytes(random_bytes(KEY_BYTES))
        self.public_bytes = self.private.public_key().public_bytes_raw()

    @property
    def private_bytes(self) -> bytes:
        return self.private.private_bytes_raw()


def load_private(raw: bytes) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(raw)


def load_public(raw: bytes) -> X25519PublicKey:
    return X25519PublicKey.from_public_bytes(raw)


def agree(private: X25519PrivateKey, public: X25519PublicKey) -> bytes:
    """X25519; raises ValueError for low-order public keys (all-zero shared secret)."""
    return private.exchange(public)


# Any fixed scalar works: a low-order point gives the all-zero secret whatever the scalar.
_PROBE = X25519PrivateKey.from_private_bytes(hashlib.sha256(b"secagg/probe").digest())


def usable_public_key(raw: bytes) -> bool:
    """False for a key that is not 32 bytes or of low order (its agreements would be all-zero,
    known to everyone): refused at AdvertiseKeys so that no peer ever uses it."""
    if len(raw) != KEY_BYTES:
        return False
    try:
        _PROBE.exchange(X25519PublicKey.from_public_bytes(raw))
    except ValueError:
        return False
    return True


_P = 2**255 - 19
#: The y coordinates of the eight Ed25519 points of small order (orders 1, 2, 4 and 8): the
#: identity (1), its negative (p - 1), the two points of order 4 (0) and the four of order 8.
_ORDER_8_Y = 2707385501144840649318225287225658788936804267575313519463743609750303402022
_SMALL_ORDER_Y = frozenset({0, 1, _P - 1, _ORDER_8_Y, _P - _ORDER_8_Y})


def usable_signing_key(raw: bytes) -> bool:
    """False for a key that is not 32 bytes or encodes an Ed25519 point of small order, whatever
    its sign bit and however it is encoded (y at or above p). Verification (OpenSSL's, as RFC 8032
    asks) does not refuse such a key, and signatures under it need no secret: with the identity as
    the key, the signature (R = the identity, S = 0) verifies every message, and under the others
    one in two to eight messages. Refused at AdvertiseKeys, so that what a client signs binds it."""
    if len(raw) != KEY_BYTES:
        return False
    y = int.from_bytes(raw, "little") & ((1 << 255) - 1)
    return y % _P not in _SMALL_ORDER_Y


def share_key(shared: bytes, session_id: bytes, sender: int, receiver: int) -> bytes:
    """AES-GCM key for the share pair sent from ``sender`` to ``receiver`` (one per direction)."""
    return hkdf_sha256(shared, session_id, b"secagg/share" + _PAIR.pack(sender, receiver))


def mask_seed(shared: bytes, session_id: bytes, a: int, b: int) -> bytes:
    """Seed of the pairwise mask between ``a`` and ``b`` (symmetric in a, b)."""
    lo, hi = (a, b) if a < b else (b, a)
    return hkdf_sha256(shared, session_id, b"secagg/mask" + _PAIR.pack(lo, hi))


def share_ad(session_id: bytes, sender: int, receiver: int) -> bytes:
    return session_id + _PAIR.pack(sender, receiver)


def encrypt_share(key: bytes, plaintext: bytes, ad: bytes) -> bytes:
    return AESGCM(key).encrypt(_NONCE, plaintext, ad)


def decrypt_share(key: bytes, ciphertext: bytes, ad: bytes) -> bytes | None:
    """Plaintext, or None if the ciphertext does not authenticate."""
    try:
        return AESGCM(key).decrypt(_NONCE, ciphertext, ad)
    except InvalidTag:
        return None


class SigningKey:
    """An Ed25519 key made for one instance: the default ``Signer`` when the client has no
    attested device key (its signatures then bind messages to the sender, not to a device)."""

    __slots__ = ("private", "public_bytes", "public_key", "credential")

    def __init__(self, random_bytes: Callable[[int], bytes]) -> None:
        self.private = Ed25519PrivateKey.from_private_bytes(random_bytes(KEY_BYTES))
        self.public_bytes = self.public_key = self.private.public_key().public_bytes_raw()
        self.credential = b""

    def sign(self, data: bytes) -> bytes:
        return self.private.sign(data)


#: Prefix of everything a Secure Aggregation signer signs: the same key (a device's attested key)
#: also signs check-in attestations, whose payloads start with another domain tag, so neither
#: kind of signature can ever be taken for the other.
SIGNING_DOMAIN = b"fedfleet.secagg.v2\x00"


def sign(signer: Signer, data: bytes) -> bytes:
    """``signer``'s signature over ``data`` in the Secure Aggregation domain."""
    return signer.sign(SIGNING_DOMAIN + data)


def verify_signature(public: bytes, signature: bytes, data: bytes) -> bool:
    """Whether ``signature`` is ``public``'s signature over ``data`` (made with ``sign``)."""
    if len(public) != KEY_BYTES or len(signature) != SIG_BYTES:
        return False
    return ed25519_valid(bytes(public), bytes(signature), SIGNING_DOMAIN + bytes(data))


@functools.lru_cache(maxsize=8192)
def ed25519_valid(public: bytes, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` is ``public``'s Ed25519 signature over ``message``. The answer is a
    pure function of the three byte strings, so the last few thousand are kept: every member of a
    group checks the same peers' signatures and certificates, and a simulated fleet, whose
    devices share a process, checked each of them once per member (99 times in a group of 100:
    a third of a secure fleet's CPU)."""
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
        return True
    except (InvalidSignature, ValueError):
        return False


def sha256(*parts: bytes) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(struct.pack("<I", len(part)))
        h.update(part)
    return h.digest()
