"""A request the app fails on is answered 500 ``INTERNAL`` and logged once, with its traceback,
by the app (naming the method and path), not a second time by uvicorn."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from server_stub import ServerThread
from server_stub.http_guards import AnsweredErrorGuard
from server_stub.service import FLService


def test_an_internal_error_is_answered_500_and_logged_once(tmp_path, monkeypatch, caplog):
    def broken(self: FLService) -> list[str]:
        raise RuntimeError("a bug in the service")

    monkeypatch.setattr(FLService, "populations", broken)
    caplog.set_level(logging.ERROR)
    with ServerThread(tmp_path / "server.db") as server:
        answer = httpx.get(
            f"{server.url}/v1/populations", headers={"Authorization": f"Bearer {server.admin_key}"}, timeout=10
        )
        assert answer.status_code == 500
        assert answer.json()["error"]["code"] == "INTERNAL"
        # the next request on the server is answered as usual
        assert httpx.get(f"{server.url}/v1/health", timeout=10).status_code == 200
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == ["internal error on GET /v1/populations"]
    assert errors[0].exc_info is not None and isinstance(errors[0].exc_info[1], RuntimeError)


@pytest.mark.parametrize(
    ("answer", "raised"),
    [(None, RuntimeError), (500, KeyboardInterrupt), (500, asyncio.CancelledError), (200, RuntimeError)],
)
def test_an_error_nobody_answered_500_still_reaches_the_server(answer, raised):
    """Raised before any answer, after a whole answer that was not a 500, or not an Exception."""

    async def app(scope, receive, send):
        if answer is not None:
            await send({"type": "http.response.start", "status": answer, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
        raise raised("raised")

    async def send(message):
        pass

    with pytest.raises(raised):
        asyncio.run(AnsweredErrorGuard(app)({"type": "http"}, None, send))


def test_an_error_answered_500_ends_at_the_guard():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
        raise RuntimeError("answered")

    async def send(message):
        pass

    asyncio.run(AnsweredErrorGuard(app)({"type": "http"}, None, send))
