"""Device side of attestation: the certificate's strict encodings, the attestor, and its keystore."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime.attestation import (
    ATTESTATION_ERROR_CODES,
    AttestationError,
    DeviceAttestor,
    DeviceCertificate,
    MalformedAttestation,
    ParsedAttestation,
    RateLimited,
    attestation_payload,
    authority_key_id,
    b64encode,
    decode_nonce,
    device_key_hash,
    generate_device_key,
    raw_public_key,
)
from emulator.devices.attestation_authority import AttestationAuthority

NOW = 1_700_000_000.0
AUTHORITY = AttestationAuthority.generate()


def seeded(seed: int):
    """A deterministic ``random_bytes`` for reproducible keys."""
    import random

    rng = random.Random(seed)
    return lambda n: rng.randbytes(n)


def test_error_codes_are_stable_strings():
    assert ATTESTATION_ERROR_CODES == (
        "MALFORMED",
        "UNKNOWN_AUTHORITY",
        "BAD_CERTIFICATE_SIGNATURE",
        "CERTIFICATE_EXPIRED",
        "CERTIFICATE_NOT_YET_VALID",
        "BAD_SIGNATURE",
        "UNKNOWN_NONCE",
        "REPLAYED_NONCE",
        "RATE_LIMITED",
    )
    err = RateLimited("slow down", retry_after_s=3.0)
    assert isinstance(err, AttestationError) and err.http_status == 429 and err.retry_after_s == 3.0
    assert err.to_json() == {"error": {"code": "RATE_LIMITED", "message": "slow down"}}
    assert MalformedAttestation("x").http_status == 400


def test_issued_certificate_round_trips_and_verifies():
    device = AUTHORITY.new_device_attestor("emulated-pixel", NOW, 3600.0)
    cert = device.certificate
    assert cert.authority_key_id == AUTHORITY.key_id
    assert cert.issued_at == NOW and cert.expires_at == NOW + 3600.0
    assert DeviceCertificate.from_bytes(cert.to_bytes()) == cert
    assert DeviceCertificate.from_dict(json.loads(json.dumps(cert.to_dict()))) == cert
    # the authority really signed the canonical payload
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    Ed25519PublicKey.from_public_bytes(AUTHORITY.public_key_bytes()).verify(cert.signature, cert.signed_payload())
    assert cert.is_valid_at(NOW) and not cert.is_valid_at(NOW + 3600.0) and not cert.is_valid_at(NOW - 1)
    assert cert.device_key_hash() == device_key_hash(device.public_key_bytes)


@given(
    key=st.binary(min_size=32, max_size=32),
    device_class=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", fullmatch=True),
    issued=st.floats(allow_nan=False, allow_infinity=False, min_value=-1e12, max_value=1e12),
    span=st.floats(min_value=1e-3, max_value=1e9),
    key_id=st.binary(min_size=32, max_size=32),
    sig=st.binary(min_size=64, max_size=64),
)
def test_certificate_encodings_round_trip(key, device_class, issued, span, key_id, sig):
    cert = DeviceCertificate(key, device_class, issued, issued + span, key_id, sig)
    assert DeviceCertificate.from_bytes(cert.to_bytes()) == cert
    assert DeviceCertificate.from_dict(json.loads(json.dumps(cert.to_dict()))) == cert


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_certificate_from_garbage_bytes_is_malformed(data):
    try:
        cert = DeviceCertificate.from_bytes(data)
    except AttestationError as exc:
        assert exc.code == "MALFORMED"
    else:  # only a canonical encoding parses
        assert cert.to_bytes() == data


@settings(max_examples=200)
@given(st.integers(min_value=0, max_value=200), st.integers(min_value=0, max_value=255))
def test_certificate_flipped_or_truncated_bytes(pos, byte):
    data = AUTHORITY.new_device_attestor("emulated-pixel", NOW, 60.0).certificate.to_bytes()
    pos %= len(data)
    for candidate in (data[:pos], data + bytes([byte]), data[:pos] + bytes([byte]) + data[pos + 1 :]):
        try:
            parsed = DeviceCertificate.from_bytes(candidate)
        except MalformedAttestation:
            continue
        assert parsed.to_bytes() == candidate  # parsed means canonical; the signature check is the server's


@pytest.mark.parametrize(
    "field,value",
    [
        ("device_class", "a name with spaces"),
        ("device_class", ""),
        ("device_class", "x" * 65),
        ("issued_at", float("nan")),
        ("expires_at", float("inf")),
        ("expires_at", NOW - 1),
        ("issued_at", True),
        ("device_public_key", b"short"),
        ("signature", "not bytes"),
    ],
)
def test_certificate_rejects_bad_fields(field, value):
    cert = AUTHORITY.new_device_attestor("emulated-pixel", NOW, 60.0).certificate
    fields = {
        name: getattr(cert, name)
        for name in ("device_public_key", "device_class", "issued_at", "expires_at", "authority_key_id", "signature")
    }
    fields[field] = value
    with pytest.raises(MalformedAttestation):
        DeviceCertificate(**fields)


def test_certificate_from_dict_is_strict():
    good = AUTHORITY.new_device_attestor("emulated-pixel", NOW, 60.0).certificate.to_dict()
    for mutate in (
        lambda d: d.pop("signature"),
        lambda d: d.__setitem__("extra", 1),
        lambda d: d.__setitem__("version", 2),
        lambda d: d.__setitem__("version", True),
        lambda d: d.__setitem__("device_public_key", d["device_public_key"].rstrip("=")),  # unpadded
        lambda d: d.__setitem__("device_public_key", " " + d["device_public_key"]),
        lambda d: d.__setitem__("authority_key_id", d["authority_key_id"].replace("+", "-").replace("/", "_") + "!"),
        lambda d: d.__setitem__("issued_at", "1700000000"),
        lambda d: d.__setitem__("device_class", 7),
    ):
        d = dict(good)
        mutate(d)
        with pytest.raises(MalformedAttestation):
            DeviceCertificate.from_dict(d)
    with pytest.raises(MalformedAttestation):
        DeviceCertificate.from_dict([good])


def test_attest_produces_a_json_safe_nonce_bound_signature():
    device = AUTHORITY.new_device_attestor("emulated-pixel", NOW, 60.0, random_bytes=seeded(1))
    nonce = bytes(range(32))
    att = device.attest(nonce, "digits/train", "1.4.0")
    assert set(att) == {"version", "certificate", "nonce", "signature"}
    assert json.loads(json.dumps(att)) == att
    parsed = ParsedAttestation.from_dict(att)
    assert parsed.nonce == nonce and parsed.certificate == device.certificate
    payload = attestation_payload(nonce, "digits/train", "1.4.0", device.certificate.fingerprint())
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    Ed25519PublicKey.from_public_bytes(device.public_key_bytes).verify(parsed.signature, payload)
    assert decode_nonce(att["nonce"]) == nonce


def test_payload_encoding_is_unambiguous():
    fp = bytes(32)
    # moving bytes between fields changes the payload: lengths are prefixed
    assert attestation_payload(b"n" * 16, "ab", "c", fp) != attestation_payload(b"n" * 16, "a", "bc", fp)
    assert attestation_payload(b"n" * 17, "a", "b", fp) != attestation_payload(b"n" * 16, "na", "b", fp)


def test_attest_refuses_a_nonce_of_the_wrong_size():
    device = AUTHORITY.new_device_attestor("emulated-pixel", NOW, 60.0)
    for bad in (b"", b"x" * 15, b"x" * 65):
        with pytest.raises(ValueError):
            device.attest(bad, "p", "1.0")


def test_attestor_refuses_a_certificate_for_another_key():
    cert = AUTHORITY.new_device_attestor("emulated-pixel", NOW, 60.0).certificate
    with pytest.raises(ValueError):
        DeviceAttestor(generate_device_key(), cert)


def test_seeded_provisioning_is_reproducible():
    a = AUTHORITY.new_device_attestor("emulated-pixel", NOW, 60.0, random_bytes=seeded(7))
    b = AUTHORITY.new_device_attestor("emulated-pixel", NOW, 60.0, random_bytes=seeded(7))
    assert a.public_key_bytes == b.public_key_bytes


def test_save_and_load_the_keystore(tmp_path):
    device = AUTHORITY.new_device_attestor("emulated-pixel", NOW, 60.0)
    path = tmp_path / "device.key"
    device.save(path)
    if os.name == "posix":
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = DeviceAttestor.load(path)
    assert loaded.certificate == device.certificate
    assert loaded.public_key_bytes == device.public_key_bytes
    nonce = os.urandom(32)
    assert ParsedAttestation.from_dict(loaded.attest(nonce, "p", "1.0")).nonce == nonce
    # overwriting keeps 0600 and leaves no temporary file behind
    renewed = loaded.with_certificate(AUTHORITY.issue(loaded.public_key_bytes, "emulated-pixel", NOW + 30, 60.0))
    renewed.save(path)
    assert DeviceAttestor.load(path).certificate.issued_at == NOW + 30
    assert [p.name for p in tmp_path.iterdir()] == ["device.key"]
    if os.name == "posix":
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\xff\xfe",
        b"[]",
        b"{}",
        b'{"format": "other"}',
        b'{"format": "fedfleet-device-keystore", "version": 1, "private_key": "AA==", "certificate": {}}',
    ],
)
def test_loading_garbage_keystore_is_malformed(tmp_path, content):
    path = tmp_path / "device.key"
    path.write_bytes(content)
    with pytest.raises(MalformedAttestation):
        DeviceAttestor.load(path)


def test_loading_a_keystore_whose_key_does_not_match_is_malformed(tmp_path):
    device = AUTHORITY.new_device_attestor("emulated-pixel", NOW, 60.0)
    path = tmp_path / "device.key"
    device.save(path)
    d = json.loads(path.read_text())
    d["certificate"] = AUTHORITY.new_device_attestor("emulated-pixel", NOW, 60.0).certificate.to_dict()
    path.write_text(json.dumps(d))
    with pytest.raises(MalformedAttestation):
        DeviceAttestor.load(path)


def test_authority_issue_validates_and_persists(tmp_path):
    with pytest.raises(ValueError):
        AUTHORITY.issue(b"short", "emulated-pixel", NOW, 60.0)
    with pytest.raises(ValueError):
        AUTHORITY.issue(raw_public_key(generate_device_key()), "Alice's phone", NOW, 60.0)
    with pytest.raises(ValueError):
        AUTHORITY.issue(raw_public_key(generate_device_key()), "emulated-pixel", NOW, 0.0)
    path = tmp_path / "authority.key"
    AUTHORITY.save(path)
    if os.name == "posix":
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = AttestationAuthority.load(path)
    assert again.key_id == AUTHORITY.key_id and again.trust_anchor() == AUTHORITY.trust_anchor()
    assert AttestationAuthority.generate(seeded(3)).key_id == AttestationAuthority.generate(seeded(3)).key_id
    # the base64 form an operator configures is the raw 32-byte Ed25519 key that verifies the
    # authority's certificates and whose hash is the key id certificates name
    configured = base64.b64decode(b64encode(AUTHORITY.public_key_bytes()), validate=True)
    assert len(configured) == 32 and configured == AUTHORITY.public_key_bytes()
    assert authority_key_id(configured) == AUTHORITY.key_id
    assert AUTHORITY.trust_anchor() == {AUTHORITY.key_id: configured}
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    cert = AUTHORITY.new_device_attestor("emulated-pixel", NOW, 60.0).certificate
    Ed25519PublicKey.from_public_bytes(configured).verify(cert.signature, cert.signed_payload())


def test_a_save_killed_before_its_rename_leaves_no_private_key_behind(tmp_path):
    """A process killed between writing its copy and renaming it left ``.device.key.PID.tmp``,
    holding a private key, for ever; the next save or load removes it (a live writer's is kept)."""
    device = AUTHORITY.new_device_attestor("emulated-pixel", NOW, 60.0)
    path = tmp_path / "device.key"
    device.save(path)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a process id that is no longer alive, as a killed writer's
    dead = tmp_path / f".device.key.{child.pid}.tmp"
    live = tmp_path / f".device.key.{os.getppid()}.tmp"  # a writer still running
    for copy in (dead, live):
        copy.write_bytes(b"a private key")
    assert DeviceAttestor.load(path).public_key_bytes == device.public_key_bytes
    assert not dead.exists() and live.exists()
    dead.write_bytes(b"a private key")
    device.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["device.key", live.name])


def test_a_load_while_another_thread_saves_leaves_that_save_its_copy(tmp_path, monkeypatch):
    """A copy bearing this process's id is taken as a killed earlier process's; a load in one thread
    while another's save wrote its copy removed it, and that save's rename failed (FileNotFoundError).
    The load now waits for the save, and both end well."""
    device = AUTHORITY.new_device_attestor("emulated-pixel", NOW, 60.0)
    path = tmp_path / "device.key"
    device.save(path)
    loaded: list[bytes] = []
    loader = threading.Thread(target=lambda: loaded.append(DeviceAttestor.load(path).public_key_bytes))
    real_fsync = os.fsync

    def fsync(fd):  # the save's copy is written: a load runs meanwhile, in another thread
        if stat.S_ISREG(os.fstat(fd).st_mode) and not loader.is_alive() and not loaded:
            loader.start()
            loader.join(0.2)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    device.save(path)
    loader.join(5.0)
    assert loaded == [device.public_key_bytes]
    assert [p.name for p in tmp_path.iterdir()] == ["device.key"]


def test_save_syncs_the_folder_after_its_rename(tmp_path, monkeypatch):
    """The rename is on disk before ``save`` returns: the folder is synced after it."""
    device = AUTHORITY.new_device_attestor("emulated-pixel", NOW, 60.0)
    path = tmp_path / "device.key"
    synced: list[bool] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode) and path.exists())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    device.save(path)
    assert synced[-1] is True
