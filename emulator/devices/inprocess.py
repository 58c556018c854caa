"""An in-process transport: the SDK's blocking protocol client talks to the server's ASGI app
without sockets, so emulated devices run the exact request/response code of a phone while a fleet
costs no file descriptor, port or TLS context per device.

httpx's own ``ASGITransport`` is asynchronous; the SDK's client is synchronous. This transport owns
one event loop in one thread and hands each request to it, so any number of device threads (or a
simulator's single thread) can share it."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx


class InProcessTransport(httpx.BaseTransport):
    """``httpx.Client(transport=InProcessTransport(app))``, or ``FLRuntime(..., transport=...)``.

    The app's lifespan is not run: whoever owns the server drives its time (``FLService.tick``),
    which is what a simulation on a virtual clock wants."""

    def __init__(self, app: Any, *, timeout_s: float = 60.0) -> None:
        self._inner = httpx.ASGITransport(app=app)
        self._timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="inprocess-asgi", daemon=True)
        self._thread.start()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        forwarded = httpx.Request(request.method, request.url, headers=request.headers, content=body)

        async def call() -> tuple[int, httpx.Headers, bytes]:
            response = await self._inner.handle_async_request(forwarded)
            content = await response.aread()
            await response.aclose()
            return response.status_code, response.headers, content

        future = asyncio.run_coroutine_threadsafe(call(), self._loop)
        try:
            status, headers, content = future.result(self._timeout_s)
        except TimeoutError:
            future.cancel()
            raise httpx.ReadTimeout("the in-process server did not answer in time", request=request) from None
        headers = httpx.Headers([(k, v) for k, v in headers.multi_items() if k.lower() != "content-encoding"])
        return httpx.Response(status, headers=headers, content=content, request=request)

    def close(self) -> None:
        """Nothing: many clients share one transport, and httpx closes a client's transport
        with the client. ``shutdown`` stops it."""

    def shutdown(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self._loop.is_closed() and not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> InProcessTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
