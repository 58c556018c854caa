"""Device endpoints served by direct routes answer what FastAPI's own routes answer, byte for
byte: the same flow of check-ins, downloads, reports and aborts gives the same statuses, headers
and bodies with and without them, and so does any malformed or hostile request."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from device_runtime import encode_checkpoint, initial_weights
from device_runtime.plan import serialize_plan
from server_stub import AdminKeys, FLService, RoundConfig, ServerStore, create_app
from server_stub.direct_routes import DirectRoute
from tests.server_stub.test_defects import update_of
from tests.support import digits_plan

DEVICE_PATHS = {
    "/v1/populations/{population}/checkin",
    "/v1/attestation/nonce",
    "/v1/populations/{population}/eligibility",
    "/v1/resources/{rid}",
    "/v1/sessions/{sid}/report",
    "/v1/sessions/{sid}/abort",
    "/v1/sessions/{sid}/secagg",
}


class Client:
    """Requests into the app in process (httpx's ASGI transport, no lifespan: no ticker)."""

    def __init__(self, app) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fl.test")

    def request(self, method: str, path: str, **kw) -> httpx.Response:
        return self.loop.run_until_complete(self.http.request(method, path, **kw))

    def get(self, path: str, **kw) -> httpx.Response:
        return self.request("GET", path, **kw)

    def close(self) -> None:
        self.loop.run_until_complete(self.http.aclose())
        self.loop.close()


def _server(tmp_path, name: str, direct: bool):
    now = [1000.0]
    (tmp_path / name).mkdir(parents=True, exist_ok=True)
    store = ServerStore(tmp_path / name / "server.db")
    service = FLService(store, rng=random.Random(7), clock=lambda: now[0])
    service.create_population("pop")
    plan = digits_plan()
    config = RoundConfig(
        goal_count=2,
        over_selection=1.5,
        selection_timeout_s=600.0,
        report_timeout_s=60.0,
        retry_window_s=(10.5, 30.25),
        min_reports=2,
    )
    service.deploy_task("pop", "train", serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), config)
    keys, _ = AdminKeys.generate()
    app = create_app(service, admin_keys=keys)
    if not direct:
        app.router.routes[:] = [r for r in app.router.routes if not isinstance(r, DirectRoute)]
    return store, Client(app), now, plan


def _flow(client: Client, now: list[float], plan) -> list[tuple[int, list, bytes]]:
    """A round's worth of device traffic; returns every answer as (status, headers, body)."""
    out = []

    def send(method: str, path: str, **kw):
        r = client.request(method, path, **kw)
        out.append((r.status_code, sorted(r.headers.items()), r.content))
        return r

    send("GET", "/v1/populations/pop/eligibility")
    sessions = [
        send("POST", "/v1/populations/pop/checkin", json={"runtime_version": "1.31.1"}).json() for _ in range(4)
    ]
    accepted = [s for s in sessions if s["status"] == "accepted"]
    assert len(accepted) == 3 and sessions[3]["status"] == "rejected"
    auth = [{"Authorization": f"Bearer {s['token']}"} for s in accepted]
    send("GET", f"/v1/resources/{accepted[0]['plan_id']}", headers=auth[0])
    send(
        "GET",
        f"/v1/resources/{accepted[0]['checkpoint_id']}",
        headers={**auth[0], "If-None-Match": f'"{accepted[0]["checkpoint_id"]}"'},
    )
    send("GET", f"/v1/resources/{accepted[0]['checkpoint_id']}", headers={"Authorization": "Bearer nope"})
    update = encode_checkpoint(update_of(plan))
    now[0] += 5.0
    send("POST", f"/v1/sessions/{accepted[0]['session_id']}/report", content=update, headers=auth[0])
    send("POST", f"/v1/sessions/{accepted[0]['session_id']}/report", content=update, headers=auth[0])  # duplicate
    send(
        "POST",
        f"/v1/sessions/{accepted[2]['session_id']}/abort",
        json={"reason": "app killed", "stats": {}},
        headers=auth[2],
    )
    send("POST", f"/v1/sessions/{accepted[1]['session_id']}/report", content=b"not a checkpoint", headers=auth[1])
    send("POST", f"/v1/sessions/{accepted[1]['session_id']}/report", content=update, headers=auth[1])
    send("POST", f"/v1/sessions/{accepted[1]['session_id']}/secagg", content=b"x", headers=auth[1])
    send("POST", "/v1/attestation/nonce", json={})
    send("HEAD", f"/v1/resources/{accepted[0]['plan_id']}", headers=auth[0])
    send("DELETE", f"/v1/sessions/{accepted[0]['session_id']}/report")
    # the random parts (session ids and tokens) are replaced by their order of appearance
    secrets = [s[k] for s in accepted for k in ("session_id", "token")]
    return [
        (status, [(k, v) for k, v in headers if k != "content-length"], _mask(body, secrets))
        for status, headers, body in out
    ]


def _mask(body: bytes, secrets: list[str]) -> bytes:
    for i, secret in enumerate(secrets):
        body = body.replace(secret.encode(), f"<secret {i}>".encode())
    return body


def test_every_device_endpoint_but_the_long_poll_is_served_directly(tmp_path):
    store, client, _, _ = _server(tmp_path, "a", direct=True)
    try:
        direct = {r.path for r in client.app.router.routes if isinstance(r, DirectRoute)}
        assert direct == DEVICE_PATHS  # the secagg long poll (GET, with query parameters) stays FastAPI's
        schema_paths = set(client.get("/openapi.json").json()["paths"])
        assert DEVICE_PATHS <= schema_paths  # the schema still documents them
    finally:
        client.close()
        store.close()


def test_a_round_of_device_traffic_gets_the_same_answers_with_and_without_direct_routes(tmp_path):
    answers = []
    for name, direct in (("direct", True), ("fastapi", False)):
        store, client, now, plan = _server(tmp_path, name, direct)
        try:
            answers.append(_flow(client, now, plan))
        finally:
            client.close()
            store.close()
    direct_answers, fastapi_answers = answers
    assert [a[0] for a in direct_answers] == [
        200,
        200,
        200,
        200,
        200,
        200,
        304,
        401,
        200,
        409,
        200,
        422,
        200,
        409,
        404,
        405,
        405,
    ]
    assert direct_answers == fastapi_answers


@pytest.fixture(scope="module")
def one_app(tmp_path_factory):
    store, client, _, _ = _server(tmp_path_factory.mktemp("fuzz"), "app", direct=True)
    yield client
    client.close()
    store.close()


_SEGMENT = st.one_of(
    st.sampled_from(["pop", "x", "0" * 64, "", "..", "%2F", "a" * 300]), st.text(min_size=1, max_size=12)
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    template=st.sampled_from(sorted(DEVICE_PATHS)),
    segment=_SEGMENT,
    method=st.sampled_from(["GET", "POST", "PUT", "HEAD"]),
    body=st.one_of(st.binary(max_size=64), st.just(b'{"runtime_version": 5}'), st.just(b"{}")),
    headers=st.dictionaries(
        st.sampled_from(["Authorization", "Content-Type", "Content-Length", "X-FL-Session-Stats"]),
        st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30),
        max_size=3,
    ),
)
def test_any_request_that_changes_nothing_gets_the_same_answer_either_way(
    one_app, template, segment, method, body, headers
):
    if template.endswith("/checkin") and segment == "pop":
        segment = "no-such-population"  # a check-in to the real population would change its state
    path = template.replace("{population}", segment).replace("{rid}", segment).replace("{sid}", segment)
    if not path.startswith("/") or "?" in path or "#" in path:
        return
    routes = one_app.app.router.routes
    both = list(routes)
    fastapi = [r for r in both if not isinstance(r, DirectRoute)]
    answers = []
    try:
        for table in (both, fastapi):
            routes[:] = table
            try:
                r = one_app.request(method, path, content=body, headers=headers)
            except Exception as exc:  # the test client refuses some header values before sending
                answers.append(type(exc))
                continue
            answers.append((r.status_code, sorted(r.headers.items()), r.content))
    finally:
        routes[:] = both
    assert answers[0] == answers[1]
    if isinstance(answers[0], tuple):
        assert answers[0][0] < 500
