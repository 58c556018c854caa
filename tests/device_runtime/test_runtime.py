"""The SDK's runtime against a real server, and against a real but faulty HTTP peer in front of it
(5xx bursts, corrupted downloads) to check retries and refusals."""

from __future__ import annotations

import random
import threading

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from device_runtime import CorruptResource, FLRuntime, Outcome, RetryPolicy, ServerUnreachable, SessionRejected
from example_store import SQLiteExampleStore
from server_stub import free_port
from tests.support import COLLECTION, deploy

FAST_RETRY = RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05)


class FaultyProxy:
    """Forwards to the FL server, failing the first ``fail_first`` requests with 503 and, if asked,
    flipping a byte in every downloaded resource."""

    def __init__(self, upstream: str, *, fail_first: int = 0, corrupt_resources: bool = False) -> None:
        self.upstream = upstream
        self.fail_first = fail_first
        self.corrupt = corrupt_resources
        self.seen = 0
        self.http = httpx.Client(base_url=upstream, timeout=10)

        async def forward(request: Request) -> Response:
            self.seen += 1
            if self.seen <= self.fail_first:
                return Response(b'{"error":{"code":"UNAVAILABLE","message":"try later"}}', status_code=503)
            body = await request.body()
            headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
            upstream = self.http.request(request.method, request.url.path, content=body, headers=headers)
            content = upstream.content
            if self.corrupt and request.url.path.startswith("/v1/resources/") and content:
                content = bytes([content[0] ^ 1]) + content[1:]
            return Response(content, status_code=upstream.status_code, media_type=upstream.headers.get("content-type"))

        app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            threading.Event().wait(0.01)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.http.close()


@pytest.fixture
def store(tmp_path, digits):
    with SQLiteExampleStore(tmp_path / "app.db") as s:
        s.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:40], digits.y_train[:40])))
        yield s


def test_session_completes_and_plan_is_cached(server, admin, store, tmp_path):
    deploy(admin, goal_count=5)
    runtime = FLRuntime("digits", server.url, store, cache_dir=tmp_path / "cache", retry=FAST_RETRY)
    first = runtime.run_session()
    assert first.outcome is Outcome.COMPLETED and first.shape == "-v[]+^"
    assert first.num_examples == 40 and first.round == 1
    assert list((tmp_path / "cache" / "plans").iterdir())
    first_bytes = runtime.client.bytes_received
    second = runtime.run_session()
    assert second.outcome is Outcome.COMPLETED
    second_bytes = runtime.client.bytes_received - first_bytes
    plan_bytes = sum(p.stat().st_size for p in (tmp_path / "cache" / "plans").iterdir())
    assert second_bytes < first_bytes - plan_bytes + 1024  # the plan came from the cache


def test_rejection_carries_the_retry_window(server, admin, store, tmp_path):
    deploy(admin, goal_count=1, over_selection=1.0, retry_window_s=(7, 9))
    FLRuntime("digits", server.url, store, retry=FAST_RETRY).client.checkin("digits", "1.31.1")
    runtime = FLRuntime("digits", server.url, store, retry=FAST_RETRY, rng=random.Random(3))
    with pytest.raises(SessionRejected) as rejected:
        runtime.run_session()
    assert rejected.value.retry_after_s == (7.0, 9.0)
    assert all(7.0 <= runtime.next_retry_delay() <= 9.0 for _ in range(20))


def test_unreachable_server_raises_after_retries(store):
    slept = []
    runtime = FLRuntime("digits", f"http://127.0.0.1:{free_port()}", store, retry=FAST_RETRY, timeout_s=1)
    runtime.client.sleep = slept.append
    with pytest.raises(ServerUnreachable):
        runtime.run_session()
    assert len(slept) == FAST_RETRY.attempts - 1
    assert all(0 <= s <= FAST_RETRY.max_delay_s for s in slept)


def test_5xx_bursts_are_retried(server, admin, store):
    deploy(admin, goal_count=5)
    with FaultyProxy(server.url, fail_first=2) as url:
        result = FLRuntime("digits", url, store, retry=FAST_RETRY).run_session()
    assert result.outcome is Outcome.COMPLETED


def test_corrupted_download_is_refused_and_session_aborted(server, admin, store):
    deploy(admin, goal_count=5)
    with FaultyProxy(server.url, corrupt_resources=True) as url:
        runtime = FLRuntime("digits", url, store, retry=FAST_RETRY)
        with pytest.raises(CorruptResource):
            runtime.run_session()
    status = admin.status("digits")
    assert status["round"] == 1


def test_interrupted_session_sends_no_update(server, admin, store):
    deploy(admin, goal_count=1, over_selection=2.0, min_fraction=1.0)
    runtime = FLRuntime("digits", server.url, store, retry=FAST_RETRY)
    result = runtime.run_session(should_abort=lambda: True)
    assert result.outcome is Outcome.INTERRUPTED and result.shape == "-v[!"
    assert admin.rounds("digits") == []
    ok = FLRuntime("digits", server.url, store, retry=FAST_RETRY).run_session()
    assert ok.outcome is Outcome.COMPLETED
    rounds = admin.rounds("digits")
    assert rounds[0]["status"] == "committed" and rounds[0]["metrics"]["aborted"] == 1
