"""A device's attested key as its Secure Aggregation identity, and the check of its peers'."""

from __future__ import annotations

import time

import pytest
from cryptography.exceptions import InvalidSignature

from device_runtime.attestation import PeerCertificateVerifier, attestation_payload
from emulator import AttestationAuthority
from secagg import crypto


@pytest.fixture(scope="module")
def authority():
    return AttestationAuthority.generate()


def test_a_certified_peer_passes_and_every_forgery_fails(authority):
    now = time.time()
    verify = PeerCertificateVerifier(authority.trust_anchor(), lambda: now)
    device = authority.new_device_attestor("emulated-phone", now).secagg_signer()
    other = authority.new_device_attestor("emulated-phone", now).secagg_signer()
    stranger = AttestationAuthority.generate().new_device_attestor("emulated-phone", now).secagg_signer()
    assert verify(device.public_key, device.credential)
    assert not verify(other.public_key, device.credential)  # a certificate for another key
    assert not verify(stranger.public_key, stranger.credential)  # an authority nobody trusts
    assert not verify(device.public_key, b"")  # no certificate at all
    tampered = bytearray(device.credential)
    tampered[-1] ^= 1
    assert not verify(device.public_key, bytes(tampered))
    expired = authority.new_device_attestor("emulated-phone", now - 10_000, valid_for_s=100).secagg_signer()
    assert not verify(expired.public_key, expired.credential)


def test_a_trust_anchor_must_name_an_authority_with_a_matching_key_id(authority):
    with pytest.raises(ValueError):
        PeerCertificateVerifier({}, time.time)
    key_id, public = next(iter(authority.trust_anchor().items()))
    with pytest.raises(ValueError):
        PeerCertificateVerifier({bytes(32): public}, time.time)


def test_secagg_signatures_cannot_pass_for_an_attestation(authority):
    """One device key signs both: Secure Aggregation signs only behind its own domain tag."""
    attestor = authority.new_device_attestor("emulated-phone", time.time())
    signer = attestor.secagg_signer()
    payload = attestation_payload(b"n" * 16, "digits", "1.20.0", attestor.certificate.fingerprint())
    signature = crypto.sign(signer, payload)
    assert crypto.verify_signature(signer.public_key, signature, payload)
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    with pytest.raises(InvalidSignature):
        Ed25519PublicKey.from_public_bytes(signer.public_key).verify(signature, payload)
