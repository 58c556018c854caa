"""Every route of the server over raw HTTP/1.1, against a real uvicorn server on a loopback port,
framed and encoded as a hostile client likes: a body with its length, chunked in pieces of any size,
cut short (the client then half-closes), with Expect: 100-continue; any content type and content
encoding (gzip and deflate bombs among the bodies: the server decodes no body, so a bomb is bytes
like any other); JSON with huge numbers, NaN, deep nesting, duplicate keys, lone surrogates, a byte
order mark or UTF-16; ids with unicode, '..' and percent-encoded slashes.

``test_openapi_fuzz`` draws what the OpenAPI document describes, through httpx, which frames every
body itself and sends no transport header a test gives it; this test draws what it leaves out.
Whatever is sent, the first answer is complete and is a success or a 4xx carrying
``{"error": {"code", "message"}}``, never a 5xx and never a hang; a request cut short may also be
closed unanswered (its client is gone). The server answers its health check after every example.
"""

from __future__ import annotations

import base64
import functools
import gzip
import json
import re
import socket
import urllib.parse
import zlib
from dataclasses import dataclass

import h11
import httpx
import numpy as np
import pytest
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from device_runtime import PlanExecutor, encode_checkpoint, initial_weights, serialize_plan
from server_stub import AdminKeys, FLService, HttpLimits, ServerStore, ServerThread, create_app
from tests.support import deploy

EXAMPLES = 60
SLOW_EXAMPLES = 2000
#: Seconds an answer may take: no route here waits (no Secure Aggregation session long-polls).
TIMEOUT_S = 10.0
ERROR_CODE = re.compile(r"[A-Z][A-Z0-9_]*")
SESSIONS = 6

ROUTES = sorted(
    (route.path, method)
    for route in create_app(FLService(ServerStore("sqlite://")), admin_keys=AdminKeys.generate()[0]).routes
    if isinstance(route, APIRoute)
    for method in route.methods - {"HEAD"}
)


@dataclass
class Target:
    host: str
    port: int
    admin_key: str
    sessions: list[tuple[str, str]]
    resources: list[str]
    bodies: dict[str, bytes]  # a valid body per kind of route


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    limits = HttpLimits(header_timeout_s=5.0, body_timeout_s=5.0)
    with ServerThread(tmp_path_factory.mktemp("framing") / "server.db", http_limits=limits) as server:
        with server.admin() as admin:
            stable = dict(goal_count=1000, over_selection=1.0, selection_timeout_s=3600.0, report_timeout_s=3600.0)
            plan, weights = deploy(admin, **stable)
            admin.create_population("idle")
        with httpx.Client(base_url=server.url, timeout=30.0) as http:
            answers = [
                http.post("/v1/populations/digits/checkin", json={"runtime_version": "1.31.1"}).json()
                for _ in range(SESSIONS)
            ]
        assert all(a["status"] == "accepted" for a in answers), answers
        spec = PlanExecutor(plan).client_update_spec()
        update = {name: np.zeros(shape, dtype) for name, (shape, dtype) in spec.items()}
        deploy_body = {
            "name": "again",
            "plan": base64.b64encode(serialize_plan(plan)).decode(),
            "checkpoint": base64.b64encode(encode_checkpoint(initial_weights(plan, seed=1))).decode(),
            "config": {"goal_count": 5},
        }
        yield Target(
            host=server.host,
            port=server.port,
            admin_key=server.admin_key,
            sessions=[(a["session_id"], a["token"]) for a in answers],
            resources=sorted({a["plan_id"] for a in answers} | {a["checkpoint_id"] for a in answers}),
            bodies={
                "checkin": json.dumps({"runtime_version": "1.31.1", "eligibility": {}}).encode(),
                "abort": json.dumps({"reason": "x", "stats": {"shape": "-v["}}).encode(),
                "report": encode_checkpoint(update),
                "populations": json.dumps({"name": "fuzzed"}).encode(),
                "tasks": json.dumps(deploy_body).encode(),
                "task-groups": json.dumps({"tasks": [deploy_body]}).encode(),
            },
        )
        _health(server.host, server.port)


# ----------------------------------------------------------------------------- what is sent
@functools.cache
def bombs() -> tuple[bytes, bytes]:
    """Bytes that decode to far more: a gzip and a zlib stream of 64 MiB of zeros or brackets, made
    on first use (about 1.3 s of CPU), not by each pytest worker as it collects the module."""
    return gzip.compress(b"\0" * (64 << 20), compresslevel=9), zlib.compress(b"[" * (64 << 20), 9)


JSON_EDGES = [
    b'{"runtime_version":"1.31.1","attestation":{"x":' + b"9" * 5000 + b"}}",
    b'{"runtime_version":"1.31.1","attestation":{"x":1e999999}}',
    b'{"runtime_version":"1.31.1","attestation":{"x":NaN,"y":-Infinity}}',
    b'{"runtime_version":"1.31.1","runtime_version":"0.1"}',
    b'{"name":"a","name":"b"}',
    b'{"reason":"\\ud800","stats":{"shape":"\\udfff"}}',
    b'\xef\xbb\xbf{"runtime_version":"1.31.1"}',
    '{"runtime_version":"1.31.1"}'.encode("utf-16"),
    b'{"a":' * 3000 + b"1" + b"}" * 3000,
    b"[" * 20000,
    b'{"name":"t","plan":"' + b"A" * 4000 + b'","weight":1e309}',
    b'{"tasks":[' + b"{}," * 2000 + b"{}]}",
    b"null",
    b"",
    b"\x00\xff" * 50,
]
CONTENT_TYPES = [
    None,
    "application/json",
    "application/octet-stream",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=utf-16",
    "\x7f\x80",
]
CONTENT_ENCODINGS = [None, "gzip", "deflate", "br", "identity", "gzip, gzip", "x-unknown"]
FRAMINGS = ["length", "chunked", "cut", "chunked-cut", "expect"]
IDS = st.one_of(
    st.sampled_from(["..", ".", "%2e%2e", "..%2F..%2Fetc%2Fpasswd", "%00", "%FF%FE", "a" * 3000, "digits"]),
    st.text(min_size=1, max_size=20).map(lambda t: urllib.parse.quote(t, safe="")),
)


@st.composite
def requests(draw, target: Target) -> tuple[bytes, bool]:
    """A request's bytes, and whether it was cut short (its client half-closes after it)."""
    path, method = draw(st.sampled_from(ROUTES), label="route")
    values = {
        "population": draw(st.one_of(st.sampled_from(["digits", "idle"]), IDS), label="population"),
        "sid": draw(st.one_of(st.sampled_from([sid for sid, _ in target.sessions]), IDS), label="sid"),
        "rid": draw(st.one_of(st.sampled_from(target.resources), IDS), label="rid"),
        "task": draw(st.one_of(st.sampled_from(["train", "again"]), IDS), label="task"),
    }
    url = re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], path)
    query = draw(
        st.sampled_from(
            ["", "?after=1&wait=0.05", "?after=-2", "?wait=nan", "?task=train", "?task=%FF&task=x", "?&&=&"]
        ),
        label="query",
    )
    credential = draw(st.sampled_from(["admin", "session", "none", "junk", "long"]), label="credential")
    headers = [("Host", f"{target.host}:{target.port}")]
    if credential == "admin":
        headers.append(("Authorization", f"Bearer {target.admin_key}"))
    elif credential == "session":
        own = dict(target.sessions).get(values["sid"], target.sessions[0][1])
        headers.append(("Authorization", f"Bearer {own}"))
    elif credential == "junk":
        headers.append(("Authorization", "Bearer \x80\xff not a token"))
    elif credential == "long":
        headers.append(("Authorization", "Bearer " + "k" * 4000))
    kind = path.rsplit("/", 1)[-1]
    body = draw(
        st.one_of(
            st.just(target.bodies.get(kind, b"{}")),
            st.just(gzip.compress(target.bodies.get(kind, b"{}"))),
            st.sampled_from(bombs()),
            st.sampled_from(JSON_EDGES),
            st.binary(max_size=300),
        ),
        label="body",
    )
    if method == "GET" and draw(st.booleans(), label="GET without a body?"):
        body = b""
    content_type = draw(st.sampled_from(CONTENT_TYPES), label="content type")
    if content_type is not None:
        headers.append(("Content-Type", content_type))
    encoding = draw(st.sampled_from(CONTENT_ENCODINGS), label="content encoding")
    if encoding is not None:
        headers.append(("Content-Encoding", encoding))
    if draw(st.booleans(), label="stats header?"):
        headers.append(("X-FL-Session-Stats", draw(st.sampled_from(['{"shape":"-v["}', "[" * 2000, "\x80", "1e999"]))))
    framing = draw(st.sampled_from(FRAMINGS), label="framing")
    cut = framing in ("cut", "chunked-cut")
    if framing in ("chunked", "chunked-cut"):
        headers.append(("Transfer-Encoding", "chunked"))
        sizes = draw(st.lists(st.integers(1, 70_000), max_size=6), label="chunk sizes")
        pieces, at = [], 0
        for size in [*sizes, len(body)]:
            piece = body[at : at + size]
            at += len(piece)
            if piece:
                pieces.append(b"%x\r\n%s\r\n" % (len(piece), piece))
        payload = b"".join(pieces) + (b"" if cut else b"0\r\n\r\n")
    else:
        declared = len(body) + (draw(st.integers(1, 10**6), label="missing bytes") if cut else 0)
        headers.append(("Content-Length", str(declared)))
        if framing == "expect":
            headers.append(("Expect", "100-continue"))
        payload = body
    head = f"{method} {url}{query} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    return head.encode("latin-1", "replace") + payload, cut


# ----------------------------------------------------------------------------- what comes back
def _exchange(host: str, port: int, request: bytes, cut: bool) -> tuple[int, bytes] | None:
    """Send ``request`` and read the first final answer: (status, body); None when the server
    closed the connection without one."""
    client = h11.Connection(h11.CLIENT)
    with socket.create_connection((host, port), timeout=TIMEOUT_S) as sock:
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the whole body went: the answer is still there to read
        if cut:
            sock.shutdown(socket.SHUT_WR)
        client.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))  # h11's client state only
        client.send(h11.EndOfMessage())
        status, body = None, b""
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                try:
                    data = sock.recv(1 << 16)
                except TimeoutError:
                    raise AssertionError(f"no answer within {TIMEOUT_S} s") from None
                except ConnectionResetError:
                    raise AssertionError("the server reset the connection before its answer was read") from None
                client.receive_data(data)
                if not data and status is None:
                    return None
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                assert status is not None
                return status, body


def _health(host: str, port: int) -> None:
    answer = _exchange(host, port, f"GET /v1/health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode(), False)
    assert answer is not None and answer[0] == 200, answer


def _check(request: bytes, cut: bool, answer: tuple[int, bytes] | None) -> None:
    shown = f"{request[:300]!r} ({len(request)} bytes{', cut short' if cut else ''})"
    if answer is None:
        assert cut, f"{shown}: closed without an answer"
        return
    status, body = answer
    assert status < 500, f"{shown} -> {status} {body[:300]!r}"
    if status >= 400:
        error = json.loads(body)["error"]
        assert set(error) == {"code", "message"} and ERROR_CODE.fullmatch(error["code"]), f"{shown} -> {body!r}"


def _fuzz(target: Target, examples: int) -> None:
    @settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(sent=requests(target))
    def exchange(sent: tuple[bytes, bool]) -> None:
        request, cut = sent
        _check(request, cut, _exchange(target.host, target.port, request, cut))
        _health(target.host, target.port)

    exchange()


def test_any_framing_and_encoding_of_any_route_gets_a_4xx_with_a_code_never_a_5xx_or_a_hang(target):
    _fuzz(target, EXAMPLES)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_any_framing_and_encoding_of_any_route_gets_a_4xx_with_a_code_never_a_5xx_or_a_hang_long_run(target):
    _fuzz(target, SLOW_EXAMPLES)
