"""The remembered Ed25519 check answers as the uncached one: a valid signature remembered never
vouches for another key, message or signature."""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg.crypto import ed25519_valid


def _uncached(public: bytes, signature: bytes, message: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
        return True
    except (InvalidSignature, ValueError):
        return False


@settings(max_examples=60, deadline=None)
@given(
    seed=st.binary(min_size=32, max_size=32),
    message=st.binary(max_size=200),
    flip=st.integers(min_value=0, max_value=10_000),
    which=st.sampled_from(["public", "signature", "message"]),
)
def test_a_remembered_valid_signature_vouches_for_nothing_else(seed, message, flip, which):
    key = Ed25519PrivateKey.from_private_bytes(seed)
    public = key.public_key().public_bytes_raw()
    signature = key.sign(message)
    assert ed25519_valid(public, signature, message) and ed25519_valid(public, signature, message)  # remembered
    parts = {"public": public, "signature": signature, "message": message or b"\x00"}
    changed = bytearray(parts[which])
    changed[flip % len(changed)] ^= 1 << (flip % 8)
    parts[which] = bytes(changed)
    args = (parts["public"], parts["signature"], parts["message"])
    assert ed25519_valid(*args) == _uncached(*args)
    assert not ed25519_valid(*args)
