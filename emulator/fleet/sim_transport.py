"""The simulated network: each device's httpx transport into the server's ASGI app, with no
socket, charging the device virtual time for the bytes it really moves.

A request leaves the device, spends ``latency + request bytes / uplink`` in flight (virtual
time, during which other devices run), reaches the server at that virtual instant, and its
answer spends ``latency + response bytes / downlink`` coming back. While the device's network
is down a request fails as a connection error, and an answer that would arrive while it is down
is lost (the server did act on the request), which is what the SDK's retry and abort paths are
for."""

from __future__ import annotations

import asyncio
import json as _json
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import greenlet
import httpx

#: Bytes of HTTP framing (request line or status line and headers) beyond what httpx counts.
FRAMING_BYTES = 64

#: A JSON body as httpx encodes it (``json.dumps`` with these options), with one encoder for all.
_encode_json = _json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode

#: The server's address as the in-process app sees it.
SERVER_ADDRESS = ("fl.sim", 80)
#: What the simulated network carries back: status, raw headers, body.
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]


@dataclass(frozen=True, slots=True)
class WireRequest:
    """A request as it crosses the simulated network: ``target`` is the path with its query,
    ``headers`` the raw header lines an ``httpx.Client`` would send (its defaults, ``Host`` and
    the content headers included), so the server and the network model see the same bytes."""

    method: str
    target: str
    headers: list[tuple[bytes, bytes]]
    body: bytes

    @classmethod
    def from_httpx(cls, request: httpx.Request) -> WireRequest:
        url = request.url
        target = url.raw_path.decode("ascii")
        return cls(request.method, target, list(request.headers.raw), request.read())

    @property
    def raw_path(self) -> str:
        return self.target.partition("?")[0]

    @property
    def path(self) -> str:
        return urllib.parse.unquote(self.raw_path)

    @property
    def query(self) -> str:
        return self.target.partition("?")[2]

    def size(self) -> int:
        """Bytes on the wire, framing included."""
        return wire_size(self.headers, self.body)


def wire_size(headers: list[tuple[bytes, bytes]], body: bytes) -> int:
    """Bytes a request or an answer takes on the wire, framing included."""
    return len(body) + FRAMING_BYTES + sum(len(k) + len(v) for k, v in headers)


def wire_request(
    method: str,
    url: str,
    *,
    content: bytes | None = None,
    json: Any = None,
    params: dict[str, str] | None = None,
    headers: list[tuple[str, str]],
) -> WireRequest:
    """The request ``httpx.Request(method, url, content=, json=, params=, headers=)`` would
    make, byte for byte, without building one (in a simulation that cost as much as the server's
    routing): ``Host`` first, ``Content-Length: 0`` for an empty POST, the given headers, then the
    content headers the body implies."""
    _, netloc, path, query, _ = urllib.parse.urlsplit(url)
    if params:
        query = urllib.parse.urlencode(params)
    target = (path or "/") + (f"?{query}" if query else "")
    given = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    names = {k.lower() for k, _ in given}
    if content is not None:
        body, implied = content, [(b"Content-Length", str(len(content)).encode())] if content else []
    elif json is not None:
        body = _encode_json(json).encode("utf-8")
        implied = [(b"Content-Length", str(len(body)).encode()), (b"Content-Type", b"application/json")]
    else:
        body, implied = b"", []
    auto = [(b"Host", netloc.encode("ascii"))]
    if (
        not implied
        and method in ("POST", "PUT", "PATCH")
        and b"content-length" not in names
        and b"transfer-encoding" not in names
    ):
        auto.append((b"Content-Length", b"0"))
    out = auto + given + [(k, v) for k, v in implied if k.lower() not in names]
    return WireRequest(method, target, out, body)


class AsgiCaller:
    """Calls an ASGI app synchronously from the simulation's thread, one request at a time.

    The app's event loop runs in a greenlet of its own and never stops between requests: a
    device's call switches to it with the request, and it switches back with the answer. Run
    per request instead (``run_until_complete``), each request would be a new root task, and the
    app's thread pool (anyio's, which the service's calls go through as under uvicorn) would
    start and stop a worker thread for every request."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._loop = asyncio.new_event_loop()
        self._server = greenlet.greenlet(self._serve)
        self._caller: greenlet.greenlet | None = None

    def _serve(self, request: WireRequest | None) -> None:
        self._loop.run_until_complete(self._main(request))

    async def _main(self, request: WireRequest | None) -> None:
        while request is not None:
            try:
                result: Any = await self._handle(request)
            except Exception as exc:  # handed to the caller, raised there
                result = exc
            caller, self._caller = self._caller, None
            if caller is None:  # closed while the request was served (a Ctrl-C in the loop)
                return
            request = caller.switch(result)

    def call(self, request: WireRequest) -> Answer:
        if self._server.dead:
            raise RuntimeError("the simulated server has been shut down")
        self._caller = greenlet.getcurrent()
        result = self._server.switch(request)
        if isinstance(result, Exception):
            raise result
        return result

    async def _handle(self, request: WireRequest) -> Answer:
        body = request.body
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "headers": [(k.lower(), v) for k, v in request.headers],
            "scheme": "http",
            "path": request.path,
            "raw_path": request.raw_path.encode("ascii"),
            "query_string": request.query.encode("ascii"),
            "server": SERVER_ADDRESS,
            "client": ("127.0.0.1", 123),
            "root_path": "",
        }
        sent = False
        status = 500
        headers: list[tuple[bytes, bytes]] = []
        parts: list[bytes] = []

        async def receive() -> dict:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict) -> None:
            nonlocal status, headers
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))

        await self.app(scope, receive, send)
        return status, headers, b"".join(parts)

    def close(self) -> None:
        """Stop the app's loop (and its thread pool); call from the thread that made the caller."""
        if self._server and not self._server.dead:
            self._caller = greenlet.getcurrent()
            self._server.switch(None)
        if not self._loop.is_closed():
            self._end_interrupted_request()
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
            self._loop.close()

    def _end_interrupted_request(self) -> None:
        """After a Ctrl-C that landed in the app's loop (its ``KeyboardInterrupt`` left the loop
        mid-request and ended the server's greenlet), the request's tasks are cancelled and run to
        their end, so none is destroyed pending, nor its coroutine closed or never started, when
        the process exits; and the interrupt a task kept as its exception is not logged as never
        retrieved: the command says it was interrupted, in one line."""
        loop = self._loop
        pending = asyncio.all_tasks(loop)
        if not pending:
            return
        loop.set_exception_handler(_quiet_interrupt)
        self._caller = None  # the device that sent the request is gone
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


def _quiet_interrupt(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler once a Ctrl-C interrupted it: the interrupt a task kept is
    not reported again; anything else is, as the loop would."""
    if not isinstance(context.get("exception"), KeyboardInterrupt):
        loop.default_exception_handler(context)


class HttpCaller:
    """Sends each device's request over real HTTP to a server on ``base_url`` (loopback), through
    one small shared connection pool: a fleet costs a handful of sockets, not one per device,
    and no thread per device (requests go one at a time from the simulation's thread)."""

    def __init__(self, base_url: str, *, connections: int = 4, timeout_s: float = 60.0) -> None:
        self.base = httpx.URL(base_url)
        self.http = httpx.Client(
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        )

    def call(self, request: WireRequest) -> Answer:
        url = self.base.join(request.target)
        headers = [(k, v) for k, v in request.headers if k.lower() != b"host"]
        response = self.http.send(httpx.Request(request.method, url, headers=headers, content=request.body))
        content = response.read()
        # the body arrives decoded; its encoding headers no longer describe it
        raw = [
            (k, v)
            for k, v in response.headers.raw
            if k.lower() not in (b"content-encoding", b"transfer-encoding", b"content-length")
        ]
        return response.status_code, raw, content

    def close(self) -> None:
        self.http.close()


class Link(Protocol):
    """What the transport needs of its device: its network, its clock, and a way to wait."""

    def network_up(self, at: float) -> bool: ...

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class Network(Protocol):
    """A device's network: bits per second each way and one-way latency in seconds."""

    down_bps: float
    up_bps: float
    latency_s: float


@dataclass
class TransferMeter:
    """What one device moved and how long it spent moving it (reset per session)."""

    bytes_up: int = 0
    bytes_down: int = 0
    network_s: float = 0.0
    requests: int = 0
    failures: int = 0

    def reset(self) -> None:
        self.bytes_up = self.bytes_down = self.requests = self.failures = 0
        self.network_s = 0.0


class SimTransport(httpx.BaseTransport):
    """One device's transport. ``on_answer(path, status, body)`` lets the simulator see what the
    protocol saw (a check-in's session id, say) without touching the SDK; ``hold_report`` is
    extra virtual time a straggler spends before its report leaves."""

    def __init__(
        self,
        caller: AsgiCaller | HttpCaller,
        link: Link,
        network: Network,
        *,
        on_answer: Callable[[str, int, bytes], None] | None = None,
        hold_report: Callable[[], float] | None = None,
    ) -> None:
        self.caller = caller
        self.link = link
        self.network = network
        self.meter = TransferMeter()
        self.on_answer = on_answer
        self.hold_report = hold_report

    def _spend(self, seconds: float) -> None:
        self.meter.network_s += seconds
        self.link.sleep(seconds)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        try:
            status, headers, content = self.exchange(WireRequest.from_httpx(request))
        except _Lost as lost:
            raise lost.error(str(lost), request=request) from None
        return httpx.Response(status, headers=headers, content=content, request=request)

    def exchange(self, request: WireRequest) -> Answer:
        """Carry ``request`` to the server and its answer back, in the device's virtual time;
        a network that is down raises ``_Lost`` naming the httpx error a socket would give."""
        link, meter = self.link, self.meter
        meter.requests += 1
        path = request.path
        if self.hold_report is not None and request.method == "POST" and path.endswith("/report"):
            held = self.hold_report()
            if held > 0:
                link.sleep(held)
        if not link.network_up(link.now()):
            meter.failures += 1
            self._spend(self.network.latency_s)
            raise _Lost(httpx.ConnectError, "the device has no network")
        up = request.size()
        meter.bytes_up += up
        self._spend(self.network.latency_s + 8.0 * up / self.network.up_bps)
        if not link.network_up(link.now()):
            meter.failures += 1
            raise _Lost(httpx.WriteError, "the device lost its network while sending")
        status, headers, content = self.caller.call(request)
        down = wire_size(headers, content)
        self._spend(self.network.latency_s + 8.0 * down / self.network.down_bps)
        if not link.network_up(link.now()):
            meter.failures += 1
            raise _Lost(httpx.ReadError, "the device lost its network before the answer arrived")
        meter.bytes_down += down
        if self.on_answer is not None:
            self.on_answer(path, status, content)
        return status, headers, content


class _Lost(Exception):
    """A request the simulated network lost, and the httpx error class a socket would raise."""

    def __init__(self, error: type[httpx.TransportError], message: str) -> None:
        super().__init__(message)
        self.error = error


class LeanClient:
    """What ``ProtocolClient`` needs of an ``httpx.Client`` (``request`` and ``close``), handing
    each request straight to the device's transport.

    httpx's ``Client.send`` wraps the transport in cookies, auth, redirects and event hooks that
    a device's protocol client never uses; in a simulation that wrapping cost as much as the
    server's whole HTTP layer, and each ``httpx.Client`` holds a cookie jar, a connection-pool
    transport and default headers per device; building an ``httpx.Request`` and an
    ``httpx.Response`` for each exchange cost about as much again. The requests carry the bytes
    an ``httpx.Client`` would send (``wire_request``), so the server sees (and the network model
    charges) the same; a lost request raises the httpx error a socket would."""

    __slots__ = ("transport",)

    def __init__(self, transport: SimTransport) -> None:
        self.transport = transport

    def request(
        self,
        method: str,
        url: str,
        *,
        content: bytes | None = None,
        json: Any = None,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> LeanResponse:
        merged = DEFAULT_HEADERS if not headers else DEFAULT_HEADERS + list(headers.items())
        wire = wire_request(method, url, content=content, json=json, params=params, headers=merged)
        try:
            return LeanResponse(*self.transport.exchange(wire))
        except _Lost as lost:
            raise lost.error(str(lost), request=httpx.Request(method, url)) from None

    def close(self) -> None:
        """Nothing to release: the transport belongs to the device."""


class LeanResponse:
    """What ``ProtocolClient`` reads of an ``httpx.Response``: the status, the headers, the body
    as bytes, text and JSON."""

    __slots__ = ("status_code", "raw_headers", "content")

    def __init__(self, status_code: int, raw_headers: list[tuple[bytes, bytes]], content: bytes) -> None:
        self.status_code = status_code
        self.raw_headers = raw_headers
        self.content = content

    @property
    def headers(self) -> httpx.Headers:
        return httpx.Headers(self.raw_headers)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return _json.loads(self.content)

    def read(self) -> bytes:
        return self.content


#: The headers an ``httpx.Client`` adds to every request.
DEFAULT_HEADERS: list[tuple[str, str]] = [
    ("Accept", "*/*"),
    ("Accept-Encoding", "gzip, deflate"),
    ("Connection", "keep-alive"),
    ("User-Agent", f"python-httpx/{httpx.__version__}"),
]


def checkin_answer(content: bytes) -> dict | None:
    """The accepted check-in's fields, if ``content`` is one."""
    try:
        data = _json.loads(content)
    except ValueError:
        return None
    return data if isinstance(data, dict) and data.get("status") == "accepted" else None
