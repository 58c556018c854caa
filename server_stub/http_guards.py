"""The HTTP server's guards against slow, crowding and oversized clients, under uvicorn.

uvicorn (0.54, over h11) bounds none of these by itself:
- it arms no timer before a connection's first answer, so a socket that sends its request head a
  byte at a time, or nothing at all, keeps its file descriptor for ever (300 such sockets against
  a server allowed 256 descriptors kept ``/v1/health`` unanswered for more than 30 s);
- it waits for a request body as long as the client takes to send it;
- its ``limit_concurrency`` counts only connections whose head is in, so it stops neither;
- a head larger than h11's buffer is answered 400 and the socket closed with the client's data
  unread, which the client sees as a reset instead of the answer; and a head that arrives in one
  read is not bounded at all.

Here ``GuardedServer`` (uvicorn's server on a listener that admits connections, with
``GuardedH11Protocol``: uvicorn's h11 protocol with timers) and ``SlowBodyGuard`` (ASGI
middleware) add, set by ``HttpLimits``:
- a request head must be in within ``header_timeout_s`` of the connection opening or of the
  previous answer; else 408 ``HEADER_TIMEOUT`` and the connection is closed;
- a request body may keep the app waiting ``body_timeout_s`` in all, plus one second per
  ``MIN_BODY_BYTES_PER_S`` bytes it brought, and at most ``body_timeout_s`` between two of its
  pieces: a slow but steady upload goes on, a stalled or trickling one is answered 408
  ``BODY_TIMEOUT``, however much it sent before it stalled (a body that sent 10 MB at once could
  then stall for near three hours on the second per KiB it had earned). What is left of a body the app answered without
  reading it (a refused report, say) is read and dropped for at most ``body_timeout_s``;
- at most ``max_connections`` connections are open: one more takes the place of the connection
  idle longest (waiting for a head, or draining an answered body), else of the one whose request
  body has come slowest since its head came in, once it has arrived for ``BODY_GRACE_S`` (answered
  408 ``BODY_TIMEOUT``), or, when every one is busy with a request whose body is in or new, is
  answered 503 ``SERVER_BUSY`` and closed. Without the second, 4096 check-ins that sent their heads
  and no body held every connection for ``body_timeout_s``; now an attacker keeps its connections
  only by opening them anew every ``BODY_GRACE_S`` or by sending each body faster than the honest
  uploads arriving, and a cap per address would refuse the devices behind one NAT. The cap is kept
  where connections are accepted: asyncio accepts a whole burst before any protocol runs, so a
  cap kept by the protocols let 300 sockets at once exhaust 256 descriptors. A connection counts
  from its accept, and room is made only for one waiting to be accepted. By default it keeps
  descriptors to spare under the process's limit, so ``accept`` never fails for want of one;
- a head larger than ``max_header_bytes`` is answered 431 ``HEADERS_TOO_LARGE``;
- an answer the client stops reading (the socket's buffers full, so that asyncio pauses the
  writes) holds up the app's request: after ``body_timeout_s`` in which the socket took no more
  of it the connection is closed, and meanwhile it counts as idle for the cap. Without it, eight
  sockets that each pipelined 200 requests for the 53 KB OpenAPI document and read nothing held a
  server allowed eight connections at 503 ``SERVER_BUSY`` for as long as they stayed open.
A refused request closes lingeringly: the server half-closes, reads and drops what the client
still sends for ``LINGER_S``, then closes, so that the client reads the answer, not a reset.
``AnsweredErrorGuard`` keeps uvicorn from logging again an error the app answered 500 and logged."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import http
import itertools
import json
import logging
import math
import select
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import (
    ApiError,
    BodyTimeout,
    ClientCertificateRequired,
    HeadersTooLarge,
    HeaderTimeout,
    MalformedRequest,
    ServerBusy,
    VersionNotSupported,
)

log = logging.getLogger(__name__)

#: The rate a request body must keep up, beyond ``body_timeout_s``, for the app to go on waiting.
MIN_BODY_BYTES_PER_S = 1024
#: Seconds a refused connection reads and drops what its client still sends before it closes.
LINGER_S = 2.0
#: Descriptors the default connection cap leaves to the database, logs and the process itself.
RESERVED_FDS = 64
#: The default cap never exceeds this, however many descriptors the process may open.
MAX_DEFAULT_CONNECTIONS = 4096
#: Connections closed to make room but not closed yet (asyncio closes a socket on its loop's next
#: turn) beyond which the listener waits for that turn before it accepts more.
EVICTIONS_IN_FLIGHT = 16
#: Seconds a request body arrives before a new connection, at the cap, may take its place if it
#: is the slowest.
BODY_GRACE_S = 1.0
#: Connections ranked for closing in one pass over them all, and how soon a pass that found none
#: is made again (at once when a connection opened or became idle since).
VICTIMS_AT_ONCE = 64
RANK_AGAIN_S = 0.05
#: Seconds between two warnings that new connections are refused.
BUSY_WARNING_EVERY_S = 10.0
#: Orders connections that became idle at the same clock reading: the first gives way first.
_idle_order = itertools.count()


def default_max_connections() -> int:
    """The connection cap under the process's descriptor limit, ``RESERVED_FDS`` kept aside."""
    try:
        import resource
    except ImportError:  # not POSIX
        return 1000
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_DEFAULT_CONNECTIONS
    return max(1, min(MAX_DEFAULT_CONNECTIONS, soft - RESERVED_FDS))


@dataclass(frozen=True)
class HttpLimits:
    """What the server allows one client (see the module docstring); ``max_connections=None``
    is ``default_max_connections()``."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int | None = None
    max_header_bytes: int = 16 * 1024

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{_option(name)} must be a positive number of seconds, not {value!r}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"{_option('max_connections')} must be at least 1, not {self.max_connections}")
        if self.max_header_bytes < 1024:
            raise ValueError(
                f"{_option('max_header_bytes')} must be at least 1024 (the device's own headers take about 600), "
                f"not {self.max_header_bytes}"
            )

    @property
    def connections(self) -> int:
        return self.max_connections if self.max_connections is not None else default_max_connections()


def _option(name: str) -> str:
    return f"{name} (--{name.replace('_', '-')})"


#: uvicorn's pause, at most, for the connections asked to close when the server stops.
SHUTDOWN_PAUSE_S = 0.1


class GuardedServer(uvicorn.Server):
    """uvicorn's server for ``app`` within ``limits``, on a listener of its own that keeps the
    connection cap; ``options`` are uvicorn's (host, port, log level...). Its log records go to
    the process's own logging (no ``log_config`` of uvicorn's unless given): uvicorn's default
    applies ``logging.config.dictConfig``, which closes every handler the process has, an app's
    that embeds a ``ServerThread`` included."""

    def __init__(
        self, app: Any, limits: HttpLimits = HttpLimits(), *, tls: ssl.SSLContext | None = None, **options: Any
    ) -> None:
        """``tls``: serve HTTPS with this context (``serve.server_tls_context``); one that asks for
        client certificates (``CERT_OPTIONAL``) has every connection that gave none answered 401
        ``CLIENT_CERTIFICATE_REQUIRED`` and closed, so that the client reads why."""
        options.setdefault("log_config", None)
        self.admission = _Admission(limits.connections)
        self.tls, self.limits = tls, limits
        protocol = type(
            "GuardedH11Protocol",
            (GuardedH11Protocol,),
            {
                "limits": limits,
                "admission": self.admission,
                "client_certificates": tls is not None and tls.verify_mode != ssl.CERT_NONE,
            },
        )
        if tls is not None:
            options["ssl_context_factory"] = lambda _config, _default: tls
        super().__init__(
            uvicorn.Config(
                AnsweredErrorGuard(SlowBodyGuard(app, limits.body_timeout_s)),
                http=protocol,
                h11_max_incomplete_event_size=limits.max_header_bytes,
                **options,
            )
        )
        self._listener: _Listener | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._woken: asyncio.Event | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup, its TLS handshakes bounded by ``header_timeout_s``: uvicorn leaves
        asyncio's 60 s, and a connection counts against the cap from its accept but reaches no
        protocol (none it could close to make room) until its handshake is done, so four sockets
        that sent nothing kept a server allowed four connections from answering anyone for a minute."""
        loop = asyncio.get_running_loop()
        if self.tls is None:
            await super().startup(sockets)
            return
        create = loop.create_server

        async def bounded(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("ssl_handshake_timeout", self.limits.header_timeout_s)
            return await create(*args, **kwargs)

        try:
            loop.create_server = bounded  # type: ignore[method-assign]
        except AttributeError:  # a loop whose methods are fixed (uvloop's): asyncio's 60 s stay
            await super().startup(sockets)
            return
        try:
            await super().startup(sockets)
        finally:
            del loop.create_server

    async def main_loop(self) -> None:
        """uvicorn's loop of ticks every 0.1 s, which ``exit_soon`` also wakes: a server stopped
        from another thread (``ServerThread.stop``, every test's) no longer waits for the next tick."""
        self._woken, self._loop = asyncio.Event(), asyncio.get_running_loop()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000  # uvicorn's own wrap, a day of ticks
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._woken.wait(), 0.1)
            should_exit = await self.on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, whose fixed 0.1 s pause after asking the open connections to close
        ends as soon as they have: an idle one closes at once, so nearly every stop (each test's
        server) paused for nothing. A connection still busy is waited for as uvicorn waits."""
        logging.getLogger("uvicorn.error").info("Shutting down")
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        paused = time.monotonic() + SHUTDOWN_PAUSE_S
        while self.server_state.connections and time.monotonic() < paused:
            await asyncio.sleep(SHUTDOWN_PAUSE_S / 20)
        try:
            await asyncio.wait_for(self._wait_tasks_to_complete(), timeout=self.config.timeout_graceful_shutdown)
        except TimeoutError:
            for task in self.server_state.tasks:
                task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        if not self.force_exit:
            await self.lifespan.shutdown()

    def exit_soon(self) -> None:
        """Ask the serving thread to shut down now (safe from any thread)."""
        self.should_exit = True
        if self._loop is not None and self._woken is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to wake
                self._loop.call_soon_threadsafe(self._woken.set)

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        if sockets is not None:
            raise ValueError("a GuardedServer listens on its own socket (it keeps the connection cap there)")
        self.listen()
        assert self._listener is not None
        await super().serve([self._listener])

    def listen(self) -> int:
        """Bind the listener now (once) and return its port: with port 0 the system picks a free
        one, and nothing else can take it between the pick and the serving."""
        if self._listener is None:
            self._listener = self._bound()
        return int(self._listener.getsockname()[1])

    def close_listener(self) -> None:
        """Release a listener bound by ``listen`` when the server will not serve after all."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _bound(self) -> _Listener:
        host, port = self.config.host, self.config.port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named, as getaddrinfo names it for uvicorn's own listener: asyncio sets
        # TCP_NODELAY only on sockets whose proto says TCP
        listener = _Listener(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        listener.admission = self.admission
        listener.plain = self.tls is None
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
        except OSError:
            listener.close()
            raise
        return listener


class _Admission:
    """The connection cap: the sockets accepted and not closed yet, and the protocols that may
    give way to a new one."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.protocols: set[GuardedH11Protocol] = set()
        self._accepted: list[socket.socket] = []
        self._warned_at = -math.inf
        self._victims: list[tuple[GuardedH11Protocol, tuple]] = []  # the next to close last, with its state
        self._ranked_at = -math.inf  # when a ranking last found none

    def open_sockets(self) -> int:
        if len(self._accepted) >= self.cap:  # counted again only near the cap: amortized O(1)
            self._accepted = [s for s in self._accepted if s.fileno() != -1]
        return len(self._accepted)

    def make_room(self, waiting: Callable[[], bool]) -> str:
        """Before the next accept: ``"yes"`` when there is room (made, at the cap, by closing the
        connection idle longest), ``"later"`` when connections closing or accepted but not yet
        set up must be waited for (asyncio's next turn) or no connection ``waiting`` to be
        accepted, ``"no"`` when every one is busy. asyncio calls ``accept`` until it finds none
        waiting: room made for that call closed a connection for nothing, and a cap of 256
        filled by 256 stalled check-ins held 255, the last place free for anyone."""
        open_now = self.open_sockets()
        if open_now < self.cap:
            return "yes"
        if open_now >= self.cap + EVICTIONS_IN_FLIGHT:
            return "later"
        closing = sum(1 for p in self.protocols if p.transport.is_closing())
        if open_now - closing < self.cap:
            return "yes"
        if not waiting():
            return "later"
        victim = self._victim()
        if victim is not None:
            if victim.waits_since is not None:
                log.debug("connection cap %d reached: closing %s, idle longest", self.cap, victim.client)
                victim.transport.abort()
            else:
                log.debug("connection cap %d reached: closing %s, its body the slowest", self.cap, victim.client)
                victim.give_way()
            return "yes"
        if open_now > len(self.protocols):
            return "later"
        now = time.monotonic()
        if now - self._warned_at >= BUSY_WARNING_EVERY_S:
            self._warned_at = now
            log.warning("all %d connections are busy with requests: new ones are refused (503)", self.cap)
        return "no"

    def _victim(self) -> GuardedH11Protocol | None:
        """The connection to close for a new one: idle longest, else the slowest body (see the
        module docstring). They are ranked ``VICTIMS_AT_ONCE`` at a time, a pass over every
        connection, and each is taken only if it is still as it was ranked: a pass over 4096
        connections takes up to 15 ms, too much for every accept of a flood of new ones."""
        while self._victims:
            protocol, state = self._victims.pop()
            if protocol in self.protocols and not protocol.transport.is_closing() and protocol.state() == state:
                return protocol
        now = time.monotonic()
        if now - self._ranked_at < RANK_AGAIN_S:
            return None  # none were found a moment ago, and none has become idle since
        ranked = [(rank, p) for p in self.protocols if not p.transport.is_closing() and (rank := p.rank()) is not None]
        best = heapq.nsmallest(VICTIMS_AT_ONCE, ranked, key=lambda pair: pair[0])
        self._victims = [(p, p.state()) for _, p in reversed(best)]
        self._ranked_at = -math.inf if self._victims else now
        return self._victim() if self._victims else None

    def changed(self) -> None:
        """A connection may have become one to close: the next ranking need not wait."""
        self._ranked_at = -math.inf

    def admitted(self, conn: socket.socket) -> None:
        self._accepted.append(conn)


class _Listener(socket.socket):
    """A listening socket whose ``accept`` (what asyncio calls for every connection, a burst at a
    time, before any of them reaches a protocol) keeps the connection cap."""

    admission: _Admission
    #: Whether connections speak plain HTTP: over TLS the busy answer is not written in the clear
    #: (a client would read it as a server that speaks no TLS), the connection is closed alone.
    plain: bool = True

    def accept(self) -> tuple[socket.socket, Any]:
        room = self.admission.make_room(self._waiting)
        if room == "later":
            raise BlockingIOError  # asyncio tries again on its next turn
        conn, address = super().accept()
        # An answer's head and body go out in two writes: with Nagle's algorithm the body waits for
        # the client's delayed ACK, 40 ms a request.
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if room == "no":
            try:
                conn.setblocking(False)
                if self.plain:
                    conn.send(answer_bytes(ServerBusy("the server is busy; try again shortly")))
            except OSError:
                pass
            conn.close()
            raise ConnectionAbortedError  # asyncio skips it
        self.admission.admitted(conn)
        return conn, address

    def _waiting(self) -> bool:
        """Whether a connection waits to be accepted (the listener reads as ready)."""
        if not hasattr(select, "poll"):  # Windows
            return bool(select.select([self], [], [], 0)[0])
        poll = select.poll()
        poll.register(self, select.POLLIN)
        return bool(poll.poll(0))


def answer_bytes(error: ApiError) -> bytes:
    """A whole HTTP/1.1 answer carrying ``error`` as the app would, for a connection no route
    has seen; it closes the connection."""
    body = json.dumps(error.to_json(), separators=(",", ":")).encode()
    head = [
        f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if isinstance(error, ServerBusy):
        head.append("retry-after: 1")
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


def _head_bytes(request: h11.Request) -> int:
    """The size of a request head as sent (request line, headers, line ends)."""
    return (
        len(request.method)
        + len(request.target)
        + 12
        + sum(len(name) + len(value) + 4 for name, value in request.headers)
    )


class _HeadLimitedConnection(h11.Connection):
    """h11's server side that also refuses a complete head over the limit (h11 bounds only an
    incomplete one) and a request of another major HTTP version than 1 (h11 takes any digit.digit,
    and uvicorn answered 'GET / HTTP/9.9' 200 in HTTP/1.1), and keeps the refusal, so that the
    answer can say why. A later 1.x is read as 1.1, as RFC 9112 section 2.6 asks."""

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.refusal: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.refusal = exc
            raise
        if isinstance(event, h11.Request) and _head_bytes(event) > self.max_head_bytes:
            self.refusal = h11.RemoteProtocolError("request head too large", error_status_hint=431)
            raise self.refusal
        if isinstance(event, h11.Request) and not event.http_version.startswith(b"1."):
            version = event.http_version.decode("ascii", "replace")
            self.refusal = h11.RemoteProtocolError(f"HTTP/{version} is not spoken here", error_status_hint=505)
            raise self.refusal
        return event


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a timer for whatever the connection waits on from its client
    (a request head; the rest of an answered body), lingering refusals, and its place among the
    connections the cap may close (``idle_since``). ``GuardedServer`` makes a subclass carrying
    its limits and admission."""

    limits: ClassVar[HttpLimits] = HttpLimits()
    admission: ClassVar[_Admission]
    #: Whether the server's TLS asks for client certificates: a connection that gave none is refused.
    client_certificates: ClassVar[bool] = False
    conn: _HeadLimitedConnection  # uvicorn's h11.Connection, replaced in __init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _HeadLimitedConnection(self.limits.max_header_bytes)
        #: since when the connection waits on its client with no request in the app (None: it does not)
        self.idle_since: float | None = None
        self.idle_order = 0
        self._timer: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None  # "head", "drain" or "linger"
        #: since when the app waits for the request body (None: it does not), and its bytes since
        self.body_since: float | None = None
        self.body_bytes = 0
        #: since when the client reads nothing of what the server writes (None: writes go through)
        self.stalled_since: float | None = None
        self._stall_order = 0
        self._stall_timer: asyncio.TimerHandle | None = None

    # ----------------------------------------------------------------- uvicorn's hooks
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.admission.protocols.add(self)
        self.admission.changed()
        if self.client_certificates and not transport.get_extra_info("peercert"):
            # asked for, not required in the handshake: a handshake that fails ends with the
            # connection closed and nothing said, which the client reads as a server gone
            transport.write(
                answer_bytes(
                    ClientCertificateRequired(
                        "this server admits only clients with a certificate from its operator's authority "
                        "(fedfleet server --tls-client-ca), and this connection gave none"
                    )
                )
            )
            self._linger()
            return
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self._unstall()
        self.idle_since = None
        self.admission.protocols.discard(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._waiting_for == "linger":
            return  # dropped: the connection was answered and is closing
        if self.body_since is not None:
            self.body_bytes += len(data)
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def send_400_response(self, msg: str) -> None:
        """h11 refused what the client sent (uvicorn has logged it): 431 for a head over the
        limit, 505 for a version other than HTTP/1.x, else 400, closed lingeringly."""
        refusal = self.conn.refusal
        if refusal is not None and refusal.error_status_hint == 431:
            error: ApiError = HeadersTooLarge(
                f"the request head is larger than {self.limits.max_header_bytes} bytes; send shorter headers"
            )
        elif refusal is not None and refusal.error_status_hint == 505:
            error = VersionNotSupported(f"{refusal}: send HTTP/1.1")
        else:
            error = MalformedRequest(f"not a valid HTTP/1.1 request: {refusal or msg}")
        self.transport.write(answer_bytes(error))
        self._linger()

    def pause_writing(self) -> None:
        """The client reads less than the server writes: the transport's buffer is full. It
        must read some within ``body_timeout_s``, and meanwhile it waits on its client."""
        super().pause_writing()
        if self._stall_timer is None and not self.transport.is_closing():
            self.stalled_since, self._stall_order = self.loop.time(), next(_idle_order)
            self.admission.changed()
            self._stall_timer = self.loop.call_later(self.limits.body_timeout_s, self._read_nothing)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unstall()

    @property
    def waits_since(self) -> tuple[float, int] | None:
        """Since when (and in which order) the connection waits on its client, head, body or
        reading its answer; None while the app has a request whose answer goes through."""
        waits = [
            (t, o)
            for t, o in ((self.idle_since, self.idle_order), (self.stalled_since, self._stall_order))
            if t is not None
        ]
        return min(waits) if waits else None

    def rank(self) -> tuple | None:
        """Where the connection stands among those that may close for a new one at the cap, the
        first first: idle ones by how long they waited, then bodies arriving by their speed; None
        when it may not."""
        waits = self.waits_since
        if waits is not None:
            return (0, *waits)
        rate = self.body_rate()
        if rate is not None:
            return (1, rate, self.body_since)
        return None

    def state(self) -> tuple:
        """What the connection waits for, and since when: while it stays, so does its rank."""
        return (self.waits_since, self.body_since)

    def body_rate(self) -> float | None:
        """The bytes a second the request body arriving has come at since its head came in, once it
        has arrived for ``BODY_GRACE_S``; else None. At the cap, the slowest gives way."""
        if self.body_since is None or (elapsed := self.loop.time() - self.body_since) <= BODY_GRACE_S:
            return None
        return self.body_bytes / elapsed

    def give_way(self) -> None:
        """Close the connection for a new one at the cap, its body the slowest: 408 ``BODY_TIMEOUT``,
        and the app's request ends as one whose client went away."""
        self.transport.write(
            answer_bytes(BodyTimeout("the request body was the slowest to arrive while every connection was busy"))
        )
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # what the app sends goes nowhere
            self.cycle.message_event.set()
        self._close()

    def shutdown(self) -> None:
        if self._waiting_for == "linger":
            self._close()
        else:
            super().shutdown()

    # ----------------------------------------------------------------- the guards
    def _watch(self) -> None:
        """Arm the timer the connection's state calls for: a request head to come, or the rest
        of a body already answered to be drained; none while the app has the request."""
        if self._waiting_for == "linger" or self.transport is None or self.transport.is_closing():
            return
        theirs, ours = self.conn.their_state, self.conn.our_state
        if theirs is h11.IDLE:
            waiting_for, timeout = "head", self.limits.header_timeout_s
        elif theirs is h11.SEND_BODY and ours in (h11.DONE, h11.MUST_CLOSE):
            waiting_for, timeout = "drain", self.limits.body_timeout_s
        else:
            waiting_for, timeout = None, 0.0
        awaits_body = theirs is h11.SEND_BODY and ours is h11.SEND_RESPONSE
        if not awaits_body:
            self.body_since = None
        elif self.body_since is None:
            self.body_since, self.body_bytes = self.loop.time(), 0
        if waiting_for == self._waiting_for:
            return
        self._cancel_timer()
        self._waiting_for = waiting_for
        self.idle_since, self.idle_order = (self.loop.time() if waiting_for else None), next(_idle_order)
        if waiting_for:
            self.admission.changed()
        if waiting_for:
            self._timer = self.loop.call_later(timeout, self._timed_out)

    def _timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self._waiting_for == "head" and self.conn.trailing_data[0]:  # a head was begun, not finished
            log.debug("%s: no request head within %g s; closing", self.client, self.limits.header_timeout_s)
            self.transport.write(
                answer_bytes(
                    HeaderTimeout(f"the request head did not arrive within {self.limits.header_timeout_s:g} s")
                )
            )
        self._close()

    def _linger(self) -> None:
        """Half-close after an answer to a request that may still be arriving: what the client
        sends is read and dropped for ``LINGER_S`` (a close with its data unread would reach it as a
        reset, and the answer with it), then the connection closes."""
        self._cancel_timer()
        self._unset_keepalive_if_required()
        self._waiting_for, self.idle_since = "linger", None
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's request is over: what it sends goes nowhere
            self.cycle.message_event.set()
        self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._timer = self.loop.call_later(LINGER_S, self._close)

    def _close(self) -> None:
        """Close once what was written is sent, or in ``LINGER_S`` all the same (a client that
        does not read must not keep the connection)."""
        self._cancel_timer()
        self.idle_since = self.body_since = None
        if not self.transport.is_closing():
            self.transport.close()
            self.loop.call_later(LINGER_S, self.transport.abort)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _read_nothing(self) -> None:
        """The client read nothing of its answer for ``body_timeout_s``: no answer reaches it, so
        the connection closes at once (a close would wait for the buffer to drain) and the app's
        request ends as one whose client went away."""
        self._stall_timer = None
        log.debug("%s: read nothing of its answer for %g s; closing", self.client, self.limits.body_timeout_s)
        self._cancel_timer()
        self.idle_since = None
        self.transport.abort()

    def _unstall(self) -> None:
        self.stalled_since = None
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None


class SlowBodyGuard:
    """ASGI middleware: the app waits for a request body ``timeout_s`` in all, plus a second per
    ``min_bytes_per_s`` bytes received, and at most ``timeout_s`` for any one piece of it; past
    that, its read raises ``BodyTimeout`` (the app answers 408) and the answer closes the
    connection. Only waiting counts: a body the app reads late, already buffered, costs nothing."""

    def __init__(self, app: Any, timeout_s: float, min_bytes_per_s: float = MIN_BODY_BYTES_PER_S) -> None:
        self.app = app
        self.timeout_s = timeout_s
        self.min_bytes_per_s = min_bytes_per_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        allowance = self.timeout_s
        complete = timed_out = False

        async def guarded_receive() -> dict:
            nonlocal allowance, complete, timed_out
            if complete:
                return await receive()
            started = loop.time()
            try:
                async with asyncio.timeout(min(allowance, self.timeout_s)):
                    message = await receive()
            except TimeoutError:
                timed_out = complete = True
                raise BodyTimeout(
                    f"the request body stopped arriving (allowed: {self.timeout_s:g} s for each piece, "
                    f"{self.timeout_s:g} s of waiting in all plus 1 s per {self.min_bytes_per_s:g} bytes received)"
                ) from None
            finally:
                allowance -= loop.time() - started
            if message["type"] == "http.request":
                allowance += len(message.get("body", b"")) / self.min_bytes_per_s
                complete = not message.get("more_body", False)
            else:
                complete = True
            return message

        async def guarded_send(message: dict) -> None:
            if timed_out and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, guarded_receive, guarded_send)


class AnsweredErrorGuard:
    """ASGI middleware: an ``Exception`` the app raises after a whole 500 answer went out ends the
    request here. Starlette answers an unhandled exception 500 through the app's own handler (which
    logs it with the method and path) and then raises it again, which uvicorn would log a second
    time. Anything else goes on to uvicorn: an exception raised before a whole answer was sent or
    after one that was not a 500 (a failure nobody logged yet), and what is not an ``Exception``
    (a cancellation, an interrupt)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        answered = False

        async def watched_send(message: dict) -> None:
            nonlocal status, answered
            await send(message)
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True

        try:
            await self.app(scope, receive, watched_send)
        except Exception:
            if not (answered and status == 500):
                raise


__all__ = [
    "AnsweredErrorGuard",
    "GuardedH11Protocol",
    "GuardedServer",
    "HttpLimits",
    "SlowBodyGuard",
    "default_max_connections",
]
