"""The server's attestation core: each rejection, nonce and rate-limit semantics, memory bounds, junk input."""

from __future__ import annotations

import copy
import itertools
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from device_runtime.attestation import (
    AttestationError,
    DeviceCertificate,
    b64encode,
    device_key_hash,
)
from emulator.devices.attestation_authority import AttestationAuthority
from server_stub.attestation import AttestationVerifier, NonceRegistry, RateLimiter, VerifiedDevice

NOW = 1_700_000_000.0
POP, RV = "digits/train", "1.4.0"
AUTHORITY = AttestationAuthority.generate()
ROGUE = AttestationAuthority.generate()


class World:
    """A trusted authority, a verifier, and helpers to provision devices and fetch nonces."""

    def __init__(self, *, ttl_s: float = 60.0, burst: float = 100.0, rate_per_s: float = 1.0, **nonce_kw) -> None:
        self.nonces = NonceRegistry(ttl_s, **nonce_kw)
        self.limiter = RateLimiter(burst, rate_per_s)
        self.verifier = AttestationVerifier([AUTHORITY.public_key_bytes()], self.nonces, self.limiter)

    def device(self, valid_for_s: float = 3600.0, issued: float = NOW - 10, authority=AUTHORITY):
        return authority.new_device_attestor("emulated-pixel", issued, valid_for_s)

    def verify(self, att, now: float = NOW, population: str = POP, runtime_version: str = RV) -> VerifiedDevice:
        return self.verifier.verify(json.loads(json.dumps(att)), population, runtime_version, now)


def code_of(fn) -> str:
    with pytest.raises(AttestationError) as info:
        fn()
    return info.value.code


@pytest.fixture
def world() -> World:
    return World()


def test_a_genuine_device_passes(world):
    device = world.device()
    verified = world.verify(device.attest(world.nonces.issue(NOW), POP, RV))
    assert verified.device_class == "emulated-pixel"
    assert verified.device_key_hash == device_key_hash(device.public_key_bytes)
    assert verified.authority_key_id == AUTHORITY.key_id
    assert verified.certificate_expires_at == device.certificate.expires_at
    # a renewed certificate keeps the same pseudonym
    renewed = device.with_certificate(AUTHORITY.issue(device.public_key_bytes, "emulated-pixel", NOW, 60.0))
    assert world.verify(renewed.attest(world.nonces.issue(NOW), POP, RV)).device_key_hash == verified.device_key_hash


def test_trusted_authorities_as_a_mapping():
    verifier = AttestationVerifier(AUTHORITY.trust_anchor(), NonceRegistry(), RateLimiter())
    nonce = verifier.nonces.issue(NOW)
    verifier.verify(World().device().attest(nonce, POP, RV), POP, RV, NOW)
    with pytest.raises(ValueError):
        AttestationVerifier({ROGUE.key_id: AUTHORITY.public_key_bytes()}, NonceRegistry(), RateLimiter())


def test_a_certificate_from_an_untrusted_authority_is_refused(world):
    device = world.device(authority=ROGUE)
    nonce = world.nonces.issue(NOW)
    assert code_of(lambda: world.verify(device.attest(nonce, POP, RV))) == "UNKNOWN_AUTHORITY"
    assert world.nonces.outstanding == 1  # not burned


def test_a_certificate_forged_in_the_trusted_authoritys_name_is_refused(world):
    device = world.device(authority=ROGUE)
    cert = device.certificate
    payload = DeviceCertificate.signing_payload(
        cert.device_public_key, cert.device_class, cert.issued_at, cert.expires_at, AUTHORITY.key_id
    )
    forged = DeviceCertificate(
        cert.device_public_key,
        cert.device_class,
        cert.issued_at,
        cert.expires_at,
        AUTHORITY.key_id,
        ROGUE._key.sign(payload),
    )
    att = device.with_certificate(forged).attest(world.nonces.issue(NOW), POP, RV)
    assert code_of(lambda: world.verify(att)) == "BAD_CERTIFICATE_SIGNATURE"


@pytest.mark.parametrize(
    "field,value",
    [
        ("device_class", "emulated-flagship"),
        ("expires_at", NOW + 10 * 365 * 86400.0),
        ("issued_at", NOW - 20.0),
    ],
)
def test_a_tampered_certificate_field_is_refused(world, field, value):
    device = world.device()
    att = device.attest(world.nonces.issue(NOW), POP, RV)
    att["certificate"][field] = value
    assert code_of(lambda: world.verify(att)) == "BAD_CERTIFICATE_SIGNATURE"


def test_someone_elses_certificate_with_my_key_is_refused(world):
    victim, attacker = world.device(), world.device(authority=ROGUE)
    # the attacker puts its own key into the victim's certificate and signs with its own key
    stolen = dict(victim.certificate.__dict__)
    stolen["device_public_key"] = attacker.public_key_bytes
    cert = DeviceCertificate(**stolen)
    from device_runtime.attestation import DeviceAttestor

    att = DeviceAttestor(attacker._key, cert).attest(world.nonces.issue(NOW), POP, RV)
    assert code_of(lambda: world.verify(att)) == "BAD_CERTIFICATE_SIGNATURE"


def test_swapping_in_another_devices_certificate_breaks_the_signature(world):
    a, b = world.device(), world.device()
    att = a.attest(world.nonces.issue(NOW), POP, RV)
    att["certificate"] = b.certificate.to_dict()
    assert code_of(lambda: world.verify(att)) == "BAD_SIGNATURE"


def test_expired_and_not_yet_valid_certificates(world):
    device = world.device(valid_for_s=100.0, issued=NOW)

    def at(now: float) -> VerifiedDevice:
        return world.verify(device.attest(world.nonces.issue(now), POP, RV), now=now)

    assert code_of(lambda: at(NOW + 100.0)) == "CERTIFICATE_EXPIRED"
    assert code_of(lambda: at(NOW - 0.5)) == "CERTIFICATE_NOT_YET_VALID"
    at(NOW)  # the window is [issued_at, expires_at)
    at(NOW + 99.9)


def test_clock_skew_allowance():
    w = World()
    w.verifier = AttestationVerifier([AUTHORITY.public_key_bytes()], w.nonces, w.limiter, clock_skew_s=5.0)
    device = w.device(valid_for_s=100.0, issued=NOW)
    w.verify(device.attest(w.nonces.issue(NOW - 4), POP, RV), now=NOW - 4)
    w.verify(device.attest(w.nonces.issue(NOW + 104), POP, RV), now=NOW + 104)
    assert (
        code_of(lambda: w.verify(device.attest(w.nonces.issue(NOW + 105), POP, RV), now=NOW + 105))
        == "CERTIFICATE_EXPIRED"
    )


@pytest.mark.parametrize("what", ["nonce", "population", "runtime_version"])
def test_a_signature_over_another_check_in_is_refused_without_burning_the_nonce(world, what):
    device = world.device()
    nonce, other = world.nonces.issue(NOW), world.nonces.issue(NOW)
    if what == "nonce":
        att = device.attest(nonce, POP, RV)
        att["nonce"] = b64encode(other)
        check = lambda: world.verify(att)  # noqa: E731
    elif what == "population":
        att = device.attest(other, "another/population", RV)
        check = lambda: world.verify(att)  # noqa: E731
    else:
        att = device.attest(other, POP, "1.3.9")
        check = lambda: world.verify(att)  # noqa: E731
    assert code_of(check) == "BAD_SIGNATURE"
    world.verify(device.attest(other, POP, RV))  # ``other`` was still good


def test_a_forgery_cannot_burn_someone_elses_nonce(world):
    victim, attacker = world.device(), world.device(authority=ROGUE)
    nonce = world.nonces.issue(NOW)
    stolen = victim.attest(nonce, POP, RV)
    forged = attacker.attest(nonce, POP, RV)
    forged["certificate"] = stolen["certificate"]
    assert code_of(lambda: world.verify(forged)) == "BAD_SIGNATURE"
    world.verify(stolen)


def test_unknown_expired_and_replayed_nonces(world):
    device = world.device()
    assert code_of(lambda: world.verify(device.attest(bytes(32), POP, RV))) == "UNKNOWN_NONCE"
    late = device.attest(world.nonces.issue(NOW), POP, RV)
    assert code_of(lambda: world.verify(late, now=NOW + 60.0)) == "UNKNOWN_NONCE"
    att = device.attest(world.nonces.issue(NOW), POP, RV)
    world.verify(att)
    assert code_of(lambda: world.verify(att, now=NOW + 1)) == "REPLAYED_NONCE"


def test_a_second_device_cannot_use_a_nonce_the_first_consumed(world):
    first, second = world.device(), world.device()
    nonce = world.nonces.issue(NOW)
    world.verify(first.attest(nonce, POP, RV))
    assert code_of(lambda: world.verify(second.attest(nonce, POP, RV))) == "REPLAYED_NONCE"


def test_rate_limit_then_recovery():
    w = World(burst=2, rate_per_s=0.1)
    device, other = w.device(), w.device()
    w.verify(device.attest(w.nonces.issue(NOW), POP, RV))
    w.verify(device.attest(w.nonces.issue(NOW), POP, RV))
    with pytest.raises(AttestationError) as info:
        w.verify(device.attest(w.nonces.issue(NOW), POP, RV))
    assert info.value.code == "RATE_LIMITED" and info.value.retry_after_s == pytest.approx(10.0)
    w.verify(other.attest(w.nonces.issue(NOW), POP, RV))  # per device
    assert code_of(lambda: w.verify(device.attest(w.nonces.issue(NOW + 9), POP, RV), now=NOW + 9)) == "RATE_LIMITED"
    w.verify(device.attest(w.nonces.issue(NOW + 10), POP, RV), now=NOW + 10)


# ------------------------------------------------------------------------------------ nonce registry


def counter_bytes():
    c = itertools.count()
    return lambda n: next(c).to_bytes(n, "big")


def test_nonce_challenge_json():
    reg = NonceRegistry(30.0, nonce_bytes=16)
    challenge = reg.challenge(NOW)
    assert set(challenge) == {"nonce", "expires_at"} and challenge["expires_at"] == NOW + 30.0
    from device_runtime.attestation import decode_nonce

    reg.consume(decode_nonce(challenge["nonce"]), NOW + 29.9)


def test_nonce_registry_memory_is_bounded():
    reg = NonceRegistry(60.0, max_outstanding=10, max_remembered=5, random_bytes=counter_bytes())
    issued = [reg.issue(NOW) for _ in range(100)]
    assert reg.outstanding == 10
    assert code_of(lambda: reg.consume(issued[0], NOW)) == "UNKNOWN_NONCE"  # evicted: refused, not accepted
    for nonce in issued[-10:]:
        reg.consume(nonce, NOW)
    assert len(reg) <= 15 and reg.outstanding == 0
    assert code_of(lambda: reg.consume(issued[-1], NOW)) == "REPLAYED_NONCE"
    assert code_of(lambda: reg.consume(issued[-10], NOW)) == "UNKNOWN_NONCE"  # forgotten, still refused
    # expiry frees everything
    for _ in range(10):
        reg.issue(NOW)
    reg.issue(NOW + 61)
    assert len(reg) == 1


def test_nonce_registry_retries_a_colliding_random_draw():
    draws = iter([b"a" * 16, b"a" * 16, b"b" * 16])
    reg = NonceRegistry(nonce_bytes=16, random_bytes=lambda n: next(draws))
    assert {reg.issue(NOW), reg.issue(NOW)} == {b"a" * 16, b"b" * 16}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["issue", "consume", "wait"]), st.integers(0, 30)), max_size=60))
def test_nonce_registry_matches_a_model(ops):
    """Without eviction: a nonce is accepted once, iff issued and consumed before its ttl; memory stays bounded."""
    ttl = 10.0
    reg = NonceRegistry(ttl, max_outstanding=1000, random_bytes=counter_bytes())
    now, issued, used = NOW, [], set()
    for op, arg in ops:
        if op == "wait":
            now += arg
        elif op == "issue":
            issued.append((reg.issue(now), now))
        elif issued:
            nonce, at = issued[arg % len(issued)]
            ok = nonce not in used and now < at + ttl
            try:
                reg.consume(nonce, now)
            except AttestationError as exc:
                assert not ok
                assert exc.code == ("REPLAYED_NONCE" if nonce in used and now < at + ttl else "UNKNOWN_NONCE")
            else:
                assert ok
                used.add(nonce)
        if op != "wait":  # every call purges what expired, so only live nonces are held
            assert len(reg) <= sum(1 for _, at in issued if now < at + ttl)


# -------------------------------------------------------------------------------------- rate limiter


def test_rate_limiter_memory_is_bounded():
    lim = RateLimiter(burst=3, rate_per_s=1.0, max_keys=5)
    for i in range(100):
        lim.check(i.to_bytes(4, "big"), NOW)
    assert len(lim) == 5
    lim.check(b"late", NOW + lim.refill_s)  # every earlier bucket is full again: dropped
    assert len(lim) == 1


@settings(max_examples=150, deadline=None)
@given(
    burst=st.integers(1, 5),
    period=st.sampled_from([1.0, 2.5, 10.0]),
    gaps=st.lists(st.floats(min_value=0.0, max_value=20.0), min_size=1, max_size=80),
)
def test_rate_limiter_never_admits_more_than_the_bucket(burst, period, gaps):
    lim = RateLimiter(burst=burst, rate_per_s=1.0 / period, max_keys=10)
    now, admitted = NOW, []
    for gap in gaps:
        now += gap
        try:
            lim.check(b"k", now)
        except AttestationError as exc:
            assert exc.code == "RATE_LIMITED" and 0 < exc.retry_after_s <= period + 1e-9
        else:
            admitted.append(now)
    for i, j in itertools.combinations(range(len(admitted)), 2):
        assert j - i + 1 <= burst + (admitted[j] - admitted[i]) / period + 1e-6


# ---------------------------------------------------------------------------------- malformed input

json_junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
GOOD = World().device().attest(bytes(32), POP, RV)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(json_junk)
def test_random_junk_is_always_malformed(junk):
    assert code_of(lambda: World().verifier.verify(junk, POP, RV, NOW)) == "MALFORMED"


def _paths(d, prefix=()):
    for k, v in d.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from _paths(v, prefix + (k,))


PATHS = list(_paths(GOOD))
TYPES = {
    ("version",): int,
    ("certificate",): dict,
    ("certificate", "version"): int,
    ("certificate", "issued_at"): float,
    ("certificate", "expires_at"): float,
}


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PATHS), json_junk, st.sampled_from(["replace", "delete", "extra"]))
def test_a_mangled_attestation_raises_only_attestation_errors(path, junk, how):
    att = copy.deepcopy(GOOD)
    parent = att
    for key in path[:-1]:
        parent = parent[key]
    if how == "delete":
        del parent[path[-1]]
    elif how == "extra":
        parent[path[-1] + "_x"] = junk
    else:
        parent[path[-1]] = junk
    with pytest.raises(AttestationError) as info:
        World().verifier.verify(att, POP, RV, NOW)
    expected = TYPES.get(path, str)
    wrong_type = isinstance(junk, bool) or (
        not isinstance(junk, (int, float)) or junk != junk if expected is float else not isinstance(junk, expected)
    )
    if how != "replace" or wrong_type:
        assert info.value.code == "MALFORMED"


@pytest.mark.parametrize(
    "field",
    ["nonce", "signature", "certificate.signature", "certificate.device_public_key", "certificate.authority_key_id"],
)
@pytest.mark.parametrize("bad", ["", "!!!!", "AAAA=", "A" * 10_000, "ÄÄÄÄ", "AA==\n", "AAA"])
def test_bad_base64_is_malformed(field, bad):
    att = copy.deepcopy(GOOD)
    target = att["certificate"] if field.startswith("certificate.") else att
    target[field.split(".")[-1]] = bad
    assert code_of(lambda: World().verifier.verify(att, POP, RV, NOW)) == "MALFORMED"


def test_a_short_nonce_or_non_string_population_is_malformed():
    att = copy.deepcopy(GOOD)
    att["nonce"] = b64encode(b"x" * 8)
    assert code_of(lambda: World().verifier.verify(att, POP, RV, NOW)) == "MALFORMED"
    assert code_of(lambda: World().verifier.verify(GOOD, None, RV, NOW)) == "MALFORMED"
    assert code_of(lambda: World().verifier.verify(GOOD, POP, "\ud800", NOW)) == "MALFORMED"


def test_random_bit_flips_in_a_genuine_attestation_are_refused():
    world = World()
    device = world.device()
    rng = random.Random(0)
    for _ in range(200):
        att = device.attest(world.nonces.issue(NOW), POP, RV)
        blob = bytearray(json.dumps(att).encode())
        i = rng.randrange(len(blob))
        blob[i] ^= 1 << rng.randrange(7)
        try:
            mangled = json.loads(blob.decode("utf-8"))
        except ValueError:
            continue
        if mangled == att:
            continue
        with pytest.raises(AttestationError):
            world.verify(mangled)
