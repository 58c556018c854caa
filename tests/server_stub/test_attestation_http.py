"""Attestation over real HTTP: only certified devices check in; forged, expired and replayed
attestations and a device that checks in too often are turned away with their codes."""

from __future__ import annotations

import base64
import time

import httpx
import pytest

from device_runtime import FLRuntime, Outcome, ProtocolError, RetryPolicy
from emulator import AttestationAuthority
from example_store import SQLiteExampleStore
from server_stub import AttestationVerifier, NonceRegistry, RateLimiter, ServerThread
from tests.support import COLLECTION, deploy

FAST = RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.02)


@pytest.fixture
def authority():
    return AttestationAuthority.generate()


@pytest.fixture
def attested_server(tmp_path, authority):
    verifier = AttestationVerifier(
        authority.trust_anchor(), NonceRegistry(ttl_s=60), RateLimiter(burst=3, rate_per_s=0.5)
    )
    with ServerThread(tmp_path / "server.db", verifier=verifier) as srv, srv.admin() as admin:
        deploy(admin, goal_count=50)
        yield srv


def _store(tmp_path, digits):
    tmp_path.mkdir(parents=True, exist_ok=True)
    store = SQLiteExampleStore(tmp_path / "app.db")
    store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:20], digits.y_train[:20])))
    return store


def _checkin(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/populations/digits/checkin", json=body)


def _code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


def test_certified_device_trains_and_others_are_refused(tmp_path, attested_server, authority, digits):
    url = attested_server.url
    now = time.time()
    genuine = authority.new_device_attestor("emulated-pixel", now)
    runtime = FLRuntime("digits", url, _store(tmp_path, digits), retry=FAST, attestor=genuine)
    assert runtime.run_session().outcome is Outcome.COMPLETED

    # No attestation at all.
    with pytest.raises(ProtocolError) as err:
        FLRuntime("digits", url, _store(tmp_path / "x", digits), retry=FAST).run_session()
    assert err.value.status == 401 and err.value.code == "ATTESTATION_REQUIRED"

    def attest(attestor) -> dict:
        nonce = runtime.client.attestation_nonce()
        return {"runtime_version": "1.31.1", "attestation": attestor.attest(nonce, "digits", "1.31.1")}

    forged = AttestationAuthority.generate().new_device_attestor("emulated-pixel", now)
    r = _checkin(url, attest(forged))
    assert r.status_code == 401 and _code(r) == "UNKNOWN_AUTHORITY"

    expired = authority.new_device_attestor("emulated-pixel", now - 7200, valid_for_s=3600)
    r = _checkin(url, attest(expired))
    assert r.status_code == 401 and _code(r) == "CERTIFICATE_EXPIRED"

    other = authority.new_device_attestor("emulated-pixel", now)
    body = attest(other)
    assert _checkin(url, body).status_code == 200
    r = _checkin(url, body)  # the same attestation again
    assert r.status_code == 401 and _code(r) == "REPLAYED_NONCE"

    body = attest(other)
    body["runtime_version"] = "1.30.0"  # not what was signed
    r = _checkin(url, body)
    assert r.status_code == 401 and _code(r) == "BAD_SIGNATURE"

    r = _checkin(url, {"runtime_version": "1.31.1", "attestation": {"certificate": "junk"}})
    assert r.status_code == 400 and _code(r) == "MALFORMED"


def test_a_device_that_checks_in_too_often_is_rate_limited(tmp_path, attested_server, authority, digits):
    url = attested_server.url
    device = authority.new_device_attestor("emulated-pixel", time.time())
    client = FLRuntime("digits", url, _store(tmp_path, digits), retry=FAST, attestor=device).client
    statuses = []
    for _ in range(5):
        nonce = client.attestation_nonce()
        r = _checkin(url, {"runtime_version": "1.31.1", "attestation": device.attest(nonce, "digits", "1.31.1")})
        statuses.append(r.status_code)
    assert statuses[:3] == [200, 200, 200]
    assert statuses[3:] == [429, 429]
    assert int(r.headers["Retry-After"]) >= 1 and _code(r) == "RATE_LIMITED"


def test_an_attested_device_takes_one_seat_per_round(attested_server, authority):
    device = authority.new_device_attestor("emulated-pixel", time.time())
    other = authority.new_device_attestor("emulated-pixel", time.time())

    def checkin(attestor) -> dict:
        nonce = base64.b64decode(httpx.post(f"{attested_server.url}/v1/attestation/nonce").json()["nonce"])
        r = _checkin(
            attested_server.url,
            {"runtime_version": "1.31.1", "attestation": attestor.attest(nonce, "digits", "1.31.1")},
        )
        assert r.status_code == 200, r.text
        return r.json()

    first = checkin(device)
    assert first["status"] == "accepted"
    # The same device again (its answer was lost, say): the same seat under a new token, not a second seat.
    again = checkin(device)
    assert (
        again["status"] == "accepted"
        and again["session_id"] == first["session_id"]
        and again["token"] != first["token"]
    )
    old = httpx.post(
        f"{attested_server.url}/v1/sessions/{first['session_id']}/abort",
        json={},
        headers={"Authorization": f"Bearer {first['token']}"},
    )
    assert old.status_code == 401 and _code(old) == "BAD_SESSION_TOKEN"
    status = attested_server.admin().status("digits")
    assert status["current_round"]["selected"] == 1
    # Once its seat is closed (here: aborted), the device gets no other seat in this round.
    r = httpx.post(
        f"{attested_server.url}/v1/sessions/{again['session_id']}/abort",
        json={},
        headers={"Authorization": f"Bearer {again['token']}"},
    )
    assert r.status_code == 200
    third = checkin(device)
    assert third["status"] == "rejected" and third["reason"] == "ALREADY_SELECTED"
    assert checkin(other)["status"] == "accepted"
