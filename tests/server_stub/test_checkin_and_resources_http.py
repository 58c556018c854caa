"""Device endpoints over real HTTP, as the README describes them: a check-in outside the plan's
runtime versions is turned away with RUNTIME_VERSION_UNSUPPORTED, and resources are immutable,
content-addressed and cacheable (ETag, Cache-Control, 304 on If-None-Match)."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import httpx

from device_runtime import encode_checkpoint, initial_weights
from server_stub import RoundConfig
from tests.support import digits_plan

#: (plan's min, plan's max, device's version, admitted): the bounds are inclusive.
VERSION_CASES = [
    ("99.0.0", None, "1.31.1", False),
    ("1.15.0", "1.20.0", "1.31.1", False),
    ("1.15.0", None, "1.14.9", False),
    ("1.15.0", "1.31.1", "1.31.2", False),
    ("1.15.0", None, "1.15.0", True),
    ("1.15.0", "1.31.1", "1.31.1", True),
    ("1.15.0", None, "2.0.0", True),
]


def _checkin(http: httpx.Client, population: str, version: str = "1.31.1") -> dict:
    r = http.post(f"/v1/populations/{population}/checkin", json={"runtime_version": version})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_device_outside_the_plans_runtime_versions_is_turned_away(server, admin):
    plan = digits_plan()
    checkpoint = encode_checkpoint(initial_weights(plan, seed=0))
    config = RoundConfig(goal_count=20, min_reports=1, selection_timeout_s=60)
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for i, (low, high, version, admitted) in enumerate(VERSION_CASES):
            population = f"versions-{i}"
            bounded = replace(plan, metadata=replace(plan.metadata, min_runtime_version=low, max_runtime_version=high))
            admin.create_population(population)
            admin.deploy_task(population, "train", bounded, checkpoint, config)
            answer = _checkin(http, population, version)
            case = f"plan {low}..{high}, device {version}: {answer}"
            if admitted:
                assert answer["status"] == "accepted", case
            else:
                assert answer["status"] == "rejected" and answer["reason"] == "RUNTIME_VERSION_UNSUPPORTED", case
                lo, hi = answer["retry_after_s"]
                # nothing changes for it until another task is deployed: it is not asked back within minutes
                assert 1800 <= lo <= hi <= 3600, case
    # A turned-away device holds no seat: only the admitted ones were selected.
    for i, (_, _, _, admitted) in enumerate(VERSION_CASES):
        assert admin.status(f"versions-{i}")["current_round"]["selected"] == int(admitted)


def test_resources_are_cacheable_by_etag(server, admin):
    plan = digits_plan()
    admin.create_population("digits")
    admin.deploy_task(
        "digits",
        "train",
        plan,
        encode_checkpoint(initial_weights(plan, seed=0)),
        RoundConfig(goal_count=5, min_reports=1),
    )
    with httpx.Client(base_url=server.url, timeout=10) as http:
        session = _checkin(http, "digits")
        auth = {"Authorization": f"Bearer {session['token']}"}
        for rid in (session["plan_id"], session["checkpoint_id"]):
            url = f"/v1/resources/{rid}"
            r = http.get(url, headers=auth)
            assert r.status_code == 200
            assert hashlib.sha256(r.content).hexdigest() == rid  # content-addressed
            etag = r.headers["ETag"]
            assert etag == f'"{rid}"'
            cache = r.headers["Cache-Control"]
            assert "max-age" in cache and "immutable" in cache

            cached = http.get(url, headers={**auth, "If-None-Match": etag})
            assert cached.status_code == 304 and cached.content == b""
            assert cached.headers["ETag"] == etag and "Cache-Control" in cached.headers

            for header in (f'"{"0" * 64}", W/{etag}', "*"):  # a list with a weak tag, and any tag
                assert http.get(url, headers={**auth, "If-None-Match": header}).status_code == 304
            other = http.get(url, headers={**auth, "If-None-Match": '"' + "0" * 64 + '"'})
            assert other.status_code == 200 and other.content == r.content

            # A cached copy is no credential: without the session token there is no 304.
            r = http.get(url, headers={"If-None-Match": etag})
            assert r.status_code == 401 and r.json()["error"]["code"] == "MISSING_TOKEN"
