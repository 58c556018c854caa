"""The device side of the FL protocol over HTTP: check-in, resources, report, abort.

Connection errors and 5xx answers are retried with exponential backoff and full jitter; 4xx
answers are final and raised as ProtocolError with the server's stable error code."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import ipaddress
import json
import os
import random
import re
import socket
import ssl
import threading
import time
import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import certifi
import httpcore
import httpx
from pydantic import TypeAdapter, ValidationError
from pydantic_core import from_json

from .attestation import AttestationError, decode_nonce
from .eligibility import VerdictJSON
from .errors import (
    CorruptResource,
    InvalidSetting,
    OverBudget,
    ProtocolError,
    ServerUnreachable,
    check_count,
    check_number,
)
from .wire import (
    AGGREGATIONS,
    CHECKIN_ANSWER,
    MAX_RETRY_WINDOW_S,
    AttestationChallenge,
    CheckinAccepted,
    CheckinRejected,
    EligibilityInfo,
    ReportAnswer,
    sane_window,
)

__all__ = [
    "AGGREGATIONS",
    "REFUSED_CERTIFICATE",
    "ClientTLS",
    "MAX_RETRY_WINDOW_S",
    "STATS_HEADER",
    "TOKEN_HEADER",
    "CheckinAccepted",
    "CheckinRejected",
    "ProtocolClient",
    "RetryPolicy",
    "answer_bound",
    "closed_unsaid",
    "retry_window",
    "shared_tls_context",
    "token_headers",
]

#: The header a report carries its session statistics in (shape so far, training time).
STATS_HEADER = "X-FL-Session-Stats"
#: The server's refusal of a second report of one session: to a retried report, its first was taken.
DUPLICATE_REPORT = "DUPLICATE_REPORT"


def shared_tls_context() -> ssl.SSLContext:
    """The default verifying TLS context, built once per process and shared by every client: the
    authorities of ``$SSL_CERT_FILE`` (a PEM file) or ``$SSL_CERT_DIR`` (a hashed folder) when
    either is set, as httpx, Python and the operators' client read them, else certifi's bundle.
    A server whose certificate comes from the operator's own authority was unreachable from every
    device (certifi's bundle alone) while ``fedfleet status`` reached it."""
    cafile, capath = os.environ.get("SSL_CERT_FILE") or None, os.environ.get("SSL_CERT_DIR") or None
    return _tls_context(cafile, capath)


@functools.lru_cache(maxsize=4)
def _tls_context(cafile: str | None, capath: str | None) -> ssl.SSLContext:
    if cafile is None and capath is None:
        return ssl.create_default_context(cafile=certifi.where())
    try:
        return ssl.create_default_context(cafile=cafile, capath=capath)
    except (OSError, ssl.SSLError) as exc:
        named = " and ".join(f"{k}={v}" for k, v in (("SSL_CERT_FILE", cafile), ("SSL_CERT_DIR", capath)) if v)
        raise InvalidSetting(f"the authorities of {named} could not be read: {exc}") from None


@dataclass(frozen=True)
class ClientTLS:
    """What a client's TLS holds beyond the default (``shared_tls_context``): ``cert_file`` and
    ``key_file``, its own certificate (PEM, the certificate first; the key in ``cert_file`` too when
    ``key_file`` is None) for a server that admits only clients with one (``fedfleet server
    --tls-client-ca``, mutual TLS), as httpx's ``cert=``; and ``ca_file``, the authorities (PEM) that
    issue the server's certificate, trusted in place of ``$SSL_CERT_FILE`` or certifi's bundle."""

    cert_file: str | os.PathLike | None = None
    key_file: str | os.PathLike | None = None
    ca_file: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "ca_file"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise InvalidSetting(f"ClientTLS.{name} is a file's path (a str or a pathlib.Path), not {value!r:.100}")
        if self.key_file is not None and self.cert_file is None:
            raise InvalidSetting("ClientTLS.key_file is the key of cert_file: give cert_file too")

    def context(self) -> ssl.SSLContext:
        """A verifying context with these settings; ``InvalidSetting`` naming the file it cannot use."""
        if self.ca_file is None:
            env = os.environ.get("SSL_CERT_FILE") or None, os.environ.get("SSL_CERT_DIR") or None
            cafile, capath = env if any(env) else (certifi.where(), None)
        else:
            cafile, capath = os.fspath(self.ca_file), None
        try:
            context = ssl.create_default_context(cafile=cafile, capath=capath)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidSetting(f"the authorities of {cafile or capath} could not be read: {exc}") from None
        if self.cert_file is not None:
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except (OSError, ssl.SSLError) as exc:
                files = " and ".join(os.fspath(f) for f in (self.cert_file, self.key_file) if f is not None)
                said = "the key is not the certificate's" if "KEY_VALUES_MISMATCH" in str(exc) else str(exc)
                raise InvalidSetting(
                    f"the client certificate {files} could not be used ({said}); give the PEM certificate this "
                    "client was issued and its unencrypted key"
                ) from None
        return context


SERVER_URL_RULE = (
    "it needs http:// or https:// and a host, then an optional port (1-65535) and path, "
    "and no query, fragment, spaces or control characters"
)


def redacted_url(url: str) -> str:
    """``url`` as a message or log line may show it: the password of its userinfo
    (``https://user:secret@host/``) replaced by ``***``, or a user name given alone (a token,
    ``https://TOKEN@host/``) by ``***``, the rest as given. Every message that
    names a server URL prints it through here: the URL of a server behind basic auth is what
    operators paste into scripts and devices' settings, and its password went into error
    messages, logs and bug reports."""
    scheme, sep, rest = url.partition("://")
    if not sep:  # a bare ``user:secret@host:port`` (refused as no URL, and named in the refusal)
        scheme, rest = "", url
    # the userinfo runs to the last '@', not to the first '/', '?' or '#': a password holding one as
    # typed (user:pa/ss@host) is cut there as a URL is read, and was shown whole in its refusal (a
    # server URL with an '@' past its host is refused: ``_checked_url``)
    userinfo, at, _ = rest.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    if not at:
        return url
    if not colon:  # a token given as the user name alone (https://TOKEN@host/), as basic auth sends it
        return f"{scheme}{sep}***@{rest[len(userinfo) + 1 :]}"
    return f"{scheme}{sep}{user}:***@{rest[len(userinfo) + 1 :]}"


#: The header a request carries its bearer token in (a session's token, an operator's admin key)
#: when the server URL's own credentials take ``Authorization`` (``https://user:secret@host/``, as
#: a gateway in front of the server asks for): one request cannot send both in that header.
TOKEN_HEADER = "X-FL-Token"


def token_headers(token: str, url_auth: httpx.Auth | None) -> dict[str, str]:
    """The header that carries ``token``: ``Authorization: Bearer``, or ``TOKEN_HEADER`` where the
    URL's credentials (``url_auth``, from :func:`url_credentials`) take ``Authorization``."""
    return {"Authorization": f"Bearer {token}"} if url_auth is None else {TOKEN_HEADER: token}


def url_credentials(url: str) -> tuple[str, httpx.BasicAuth | None]:
    """``url`` without its userinfo, and the basic auth the userinfo gave (what httpx sends for
    it), or None: requests go to the URL without it, so that httpx's log of each request
    (``HTTP Request: GET URL``) does not carry the password."""
    parsed = httpx.URL(url)
    if not (parsed.username or parsed.password):
        return url, None
    return str(parsed.copy_with(userinfo=b"")), httpx.BasicAuth(parsed.username, parsed.password)


def checked_server_url(url: object) -> str:
    """``url`` without its trailing '/', once it names a server a client can send requests to
    (``SERVER_URL_RULE``); else ``InvalidSetting`` saying so, with the URL to give for a bare
    ``host:port``. The device's runtime and the operators' client both check theirs here: without
    the check, '127.0.0.1:8000' failed only at the first request (after every retry, on a device)
    as "unsupported protocol"."""
    if not isinstance(url, str):
        raise InvalidSetting(f"a server URL is a string, not {type(url).__name__}")
    return _checked_url(url)


@functools.lru_cache(maxsize=256)
def _checked_url(url: str) -> str:
    """The check of ``checked_server_url``, once per URL: a simulated fleet makes a runtime for
    each of its devices' job runs, all with one URL, and httpx parses a URL in about 20 us."""
    try:
        parsed = httpx.URL(url)
        fits = (
            parsed.scheme in ("http", "https")
            and bool(parsed.host)
            and (parsed.port is None or 0 < parsed.port < 65536)
            and not parsed.query
            and not parsed.fragment
            and not url.endswith(("?", "#"))
            and not any(c.isspace() or not c.isprintable() for c in url)
            and "@" not in parsed.path  # the rest of a password holding '/' (user:12/34@host), read as a path
        )
    except (httpx.InvalidURL, TypeError):
        fits = False
    if not fits:
        scheme = url.split("://", 1)[0].lower() if "://" in url else None
        bare = redacted_url(url).split("://", 1)[-1]
        example = f", e.g. http://{bare or '127.0.0.1:8000'}" if scheme is None and bare.isprintable() else ""
        if "@" in url and not example:
            example += "; a password holding / ? # or @ is written percent-encoded (%2F %3F %23 %40)"
        raise InvalidSetting(f"{redacted_url(url)[:200]!r} is not a server URL: {SERVER_URL_RULE}{example}")
    return url.rstrip("/")


#: The most a device reads of one answer, decoded: a plan or checkpoint (``/v1/resources/``), and
#: any other (JSON; the largest, a Secure Aggregation state of a 100,000-device group, is some
#: megabytes). httpx reads a whole answer into memory, so a hostile server's endless or
#: gzip-bombed answer ran a device out of memory.
MAX_RESOURCE_BYTES = 1 << 30
MAX_ANSWER_BYTES = 64 << 20


#: The pace an answer must keep up after the request's timeout: a server that sends a byte now
#: and then, each within httpx's per-read timeout, held a device's session (and its job) for ever.
MIN_ANSWER_BYTES_PER_S = 1024


class _BoundedAnswer(httpx.SyncByteStream):
    """An answer's body decoded (gzip and deflate, which httpx asks for) and cut off with a
    ``ProtocolError`` past ``limit`` bytes, or once it has taken longer than ``timeout_s`` plus a
    second per ``MIN_ANSWER_BYTES_PER_S`` bytes received, so that no more than ``limit`` is ever
    held and no answer is awaited for ever."""

    def __init__(
        self,
        raw: Any,
        limit: int,
        encoding: str,
        what: str,
        clock: Callable[[], float],
        timeout_s: float,
        device_bound: str | None = None,
    ) -> None:
        self.raw, self.limit, self.encoding, self.what = raw, limit, encoding, what
        self.device_bound = device_bound  # why this device reads less than the protocol's bound (OverBudget)
        self.clock, self.timeout_s = clock, timeout_s
        deadline: _Deadline | None = getattr(_this_request, "deadline", None)
        self.ends_at = None if deadline is None else deadline.ends_at  # the session's end, on any transport

    def __iter__(self) -> Any:
        decoder = zlib.decompressobj(wbits=47) if self.encoding in ("gzip", "deflate") else None  # 47: gzip or zlib
        started = self.clock()
        total = received = 0
        for chunk in self.raw:
            received += len(chunk)
            if self.clock() - started > self.timeout_s + received / MIN_ANSWER_BYTES_PER_S:
                raise ProtocolError(
                    f"{self.what} came slower than {MIN_ANSWER_BYTES_PER_S} bytes/s after {self.timeout_s:g} s; "
                    "it was dropped"
                )
            if self.ends_at is not None and self.clock() > self.ends_at:
                raise ProtocolError(f"{self.what} was still coming at the session's deadline; it was dropped")
            pending = chunk
            while pending:
                if decoder is None:
                    out, pending = pending, b""
                else:
                    try:
                        out = decoder.decompress(pending, self.limit - total + 1)
                    except zlib.error as exc:
                        raise ProtocolError(f"{self.what} is not valid {self.encoding} ({exc})") from None
                    pending = decoder.unconsumed_tail
                total += len(out)
                if total > self.limit:
                    if self.device_bound is not None:
                        raise OverBudget(f"{self.what} is larger than {self.limit} bytes: {self.device_bound}")
                    raise ProtocolError(f"{self.what} is larger than {self.limit} bytes, the most a device reads")
                yield out

    def close(self) -> None:
        self.raw.close()


class _Deadline:
    """When one request must be done with its socket: ``timeout_s`` after it started plus a second
    per ``MIN_ANSWER_BYTES_PER_S`` bytes it moved either way, and never past ``ends_at`` (the
    session's end, a reading of ``clock``). httpx's timeouts bound each read and write alone: a
    server that sent its status line and headers a byte at a time, each within the read timeout,
    held a device for ever, before any body (which ``_BoundedAnswer`` paces) began."""

    def __init__(self, clock: Callable[[], float], timeout_s: float, ends_at: float | None) -> None:
        self.clock, self.timeout_s, self.ends_at = clock, timeout_s, ends_at
        self.started = clock()
        self.moved = 0
        self.interrupted = False  # by ``ProtocolClient.interrupt``: no wait of it starts again

    def left(self, credit: int = 0) -> float:
        """Seconds left, counting ``credit`` bytes about to be moved."""
        end = self.started + self.timeout_s + (self.moved + credit) / MIN_ANSWER_BYTES_PER_S
        if self.ends_at is not None:
            end = min(end, self.ends_at)
        return end - self.clock()


#: The deadline of the request this thread is sending (httpx's sync client does a request's I/O
#: in the thread that asked for it), read by the sockets of ``_DeadlineBackend``.
_this_request = threading.local()


def _waited(call: Callable[[float | None], Any], timeout: float | None, late: type[Exception], credit: int = 0) -> Any:
    """``call(timeout)`` with ``timeout`` cut to what is left of this thread's request deadline
    (counting ``credit`` bytes about to be moved); ``late``, saying so, once none is left."""
    deadline: _Deadline | None = getattr(_this_request, "deadline", None)
    if deadline is None:
        return call(timeout)
    if deadline.interrupted:
        raise late(INTERRUPTED)
    left = deadline.left(credit)
    if left > 0:
        try:
            return call(left if timeout is None else min(timeout, left))
        except late:
            if timeout is not None and timeout <= left:
                raise  # httpx's own timeout, not the deadline
    if deadline.ends_at is not None and deadline.ends_at <= deadline.clock():
        raise late("the session's deadline came before the server's answer; the request was dropped")
    raise late(
        f"the server took longer than {deadline.timeout_s:g} s and a second per {MIN_ANSWER_BYTES_PER_S} bytes "
        "to answer; the request was dropped"
    )


#: Why a request ``ProtocolClient.interrupt`` cut short failed.
INTERRUPTED = "the request was interrupted: its runtime is closing"


class _DeadlineStream(httpcore.NetworkStream):
    """A socket whose every wait is cut to the request's deadline (``_waited``), known to its
    backend until it is dropped, so that ``shut`` can end a wait on it from another thread."""

    #: Writes go out in pieces of this size, each waiting no longer than the deadline allows: one
    #: ``send`` loop over a whole upload waited a full timeout per byte a slow reader took.
    PIECE = 1 << 16

    def __init__(self, inner: httpcore.NetworkStream, backend: _DeadlineBackend) -> None:
        self.inner, self.backend = inner, backend
        backend.streams.add(self)

    def shut(self) -> None:
        """Shut the socket both ways: a read or write another thread waits in returns at once (a
        socket's ``close`` does not wake a thread waiting on it)."""
        sock = self.inner.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _count(self, n: int) -> None:
        deadline: _Deadline | None = getattr(_this_request, "deadline", None)
        if deadline is not None:
            deadline.moved += n

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data = _waited(lambda t: self.inner.read(max_bytes, t), timeout, httpcore.ReadTimeout)
        self._count(len(data))
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        for start in range(0, len(buffer), self.PIECE):
            piece = buffer[start : start + self.PIECE]
            _waited(functools.partial(self.inner.write, piece), timeout, httpcore.WriteTimeout, len(piece))
            self._count(len(piece))

    def close(self) -> None:
        self.inner.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        tls = _waited(lambda t: self.inner.start_tls(ssl_context, server_hostname, t), timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(tls, self.backend)

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


def _getaddrinfo(host: str, port: int) -> list[Any]:
    """The system's resolver, looked up at each call (a test stands in for one that never answers)."""
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


def _addresses(host: str, port: int, timeout: float | None) -> list[str]:
    """``host``'s addresses, in the resolver's order, found within ``timeout``. ``getaddrinfo``
    takes no timeout and httpx's bound none of it: a resolver that never answered held a device's
    session past its deadline. The lookup runs in a thread of its own, left to finish alone when
    the time is up (a resolver call cannot be stopped)."""
    try:
        ipaddress.ip_address(host)
        return [host]
    except ValueError:
        pass
    found: list[Any] = []
    failed: list[OSError] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            found.extend(_getaddrinfo(host, port))
        except OSError as exc:
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=lookup, name=f"resolve {host[:60]}", daemon=True).start()
    if not done.wait(timeout):
        raise httpcore.ConnectTimeout(
            f"resolving {host!r} took longer than the {timeout:.2g} s the request had; the request was dropped"
        )
    if failed:
        raise httpcore.ConnectError(f"{host!r} could not be resolved: {failed[0]}")
    return list(dict.fromkeys(str(info[4][0]) for info in found))


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's sockets (``SyncBackend``), each a ``_DeadlineStream``, reached through a
    name lookup that the request's deadline bounds too (``_addresses``)."""

    def __init__(self) -> None:
        self.inner = httpcore.SyncBackend()
        self.streams: weakref.WeakSet[_DeadlineStream] = weakref.WeakSet()

    def shut(self) -> None:
        """End every wait on this backend's sockets now (``_DeadlineStream.shut``)."""
        for stream in list(self.streams):
            stream.shut()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.NetworkStream:
        deadline: _Deadline | None = getattr(_this_request, "deadline", None)
        left = None if deadline is None else max(0.0, deadline.left())
        addresses = _addresses(host, port, timeout if left is None else left if timeout is None else min(timeout, left))
        error: Exception | None = None

        def reach(address: str, t: float | None) -> httpcore.NetworkStream:
            return self.inner.connect_tcp(address, port, t, local_address, socket_options)

        for address in addresses:  # each in turn, as socket.create_connection tries them
            try:
                return _DeadlineStream(
                    _waited(functools.partial(reach, address), timeout, httpcore.ConnectTimeout), self
                )
            except httpcore.ConnectError as exc:
                error = exc
        raise error or httpcore.ConnectError(f"{host!r} resolved to no address")

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.NetworkStream:
        connect = self.inner.connect_unix_socket
        return _DeadlineStream(
            _waited(lambda t: connect(path, t, socket_options), timeout, httpcore.ConnectTimeout), self
        )

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


class _DeadlineTransport(httpx.HTTPTransport):
    """httpx's HTTP transport over ``_DeadlineBackend``'s sockets (httpx passes no backend through
    its own constructor; the pool it builds is replaced by the same one over these sockets)."""

    def __init__(self, ssl_context: ssl.SSLContext) -> None:
        super().__init__(verify=ssl_context)
        self.backend = _DeadlineBackend()
        self._pool = httpcore.ConnectionPool(
            ssl_context=ssl_context,
            max_connections=100,  # httpx's default limits
            max_keepalive_connections=20,
            keepalive_expiry=5.0,
            network_backend=self.backend,
        )


def answer_bound(clock: Callable[[], float], timeout_s: float) -> Callable[[httpx.Response], None]:
    """httpx's response hook, run once the head is in: the body is read through ``_BoundedAnswer``
    (httpx decodes nothing more), and an answer that declares itself too large is refused unread."""

    def bound(response: httpx.Response) -> None:
        path = response.request.url.path
        # a server behind a proxy at a path prefix (``https://host/fl/``) is asked for ``/fl/v1/resources/``:
        # its plans and checkpoints were held to the 64 MiB of any other answer; a task's model
        # (``/v1/populations/P/model``, which operators read) is a checkpoint as large as a device's
        models = "/v1/resources/" in path or ("/v1/populations/" in path and path.endswith("/model"))
        limit = MAX_RESOURCE_BYTES if models else MAX_ANSWER_BYTES
        device_limit, device_bound = getattr(_this_request, "resource_bound", None) or (limit, None)
        if device_limit < limit:
            limit = device_limit
        else:
            device_bound = None
        what = f"the server's answer to {response.request.method} {path[:100]}"
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("identity", "gzip", "deflate"):
            raise ProtocolError(f"{what} is encoded as {encoding[:40]!r}, which the device did not ask for")
        declared = response.headers.get("content-length", "")
        if encoding == "identity" and declared.isdigit() and int(declared) > limit:
            if device_bound is not None:
                raise OverBudget(f"{what} is {declared} bytes: {device_bound}; it was not read")
            raise ProtocolError(f"{what} is {declared} bytes, more than the {limit} a device reads")
        response.stream = _BoundedAnswer(response.stream, limit, encoding, what, clock, timeout_s, device_bound)
        response.headers.pop("content-encoding", None)

    return bound


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0

    def __post_init__(self) -> None:
        check_count("RetryPolicy.attempts", self.attempts, least=1)  # 0 made no request at all
        check_number("RetryPolicy.base_delay_s", self.base_delay_s)
        check_number("RetryPolicy.max_delay_s", self.max_delay_s)

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Full jitter: uniform in [0, min(max, base * 2**attempt)]."""
        return rng.uniform(0.0, min(self.max_delay_s, self.base_delay_s * (2**attempt)))


def _error_code(response: httpx.Response) -> str | None:
    """The stable code of an error answer, when it is one: what the server says goes into the
    app's logs and opstats (a hostile server's code was any JSON value)."""
    try:
        code = _json(response)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) and re.fullmatch(r"[\x21-\x7e]{1,64}", code) else None


def _answer(response: httpx.Response, model: Any, what: str) -> Any:
    """The answer of a success parsed by its wire model (``model`` a model class or a ``TypeAdapter``):
    a broken or hostile server's answer is a ``ProtocolError`` naming the field, never a value that
    reaches a path, a header or a clock."""
    if not 200 <= response.status_code < 300:
        raise ProtocolError(
            f"the server's {what} came with HTTP {response.status_code}, not a success", status=response.status_code
        )
    try:
        return (
            model.validate_json(response.content)
            if isinstance(model, TypeAdapter)
            else model.model_validate_json(response.content)
        )
    except ValidationError as exc:
        raise ProtocolError(f"the server's {what} is malformed: {_first_error(exc)}") from None


def foreign_answer(response: httpx.Response) -> str:
    """One line on an error answer that is not the FL server's (whose body is its JSON error): a
    proxy's or gateway's page in front of it (nginx's ``413 Request Entity Too Large``, ``502 Bad
    Gateway``), or another server at the URL. Such a page was shown as its first 200 characters of
    HTML, or as "server error 502" alone, and a proxy at a path prefix the URL left out looked
    like a server without the route."""
    kind = response.headers.get("content-type", "").split(";")[0].strip()[:60] or "no content type"
    text = response.content[:4096].decode("utf-8", "replace")
    title = re.search(r"<title[^>]*>(.*?)</title>", text, re.IGNORECASE | re.DOTALL)
    said = title.group(1) if title else next((line for line in text.splitlines() if line.strip()), "")
    said = " ".join("".join(c if c.isprintable() else " " for c in said).split())[:100]
    return (
        f"HTTP {response.status_code} came from something other than the FL server ({kind}"
        + (f": {said!r}" if said else "")
        + f"): a proxy or gateway in front of it, or another server at this URL{_FOREIGN_HINTS.get(response.status_code, '')}"
    )


#: What a proxy's error page most likely means, by its status.
_FOREIGN_HINTS = {
    404: " (is the URL's path the proxy's prefix for the server, e.g. https://host/fl?)",
    405: " (is the URL's path the proxy's prefix for the server, e.g. https://host/fl?)",
    413: " (the proxy's limit on request bodies is below the upload's size: nginx's client_max_body_size)",
    502: " (is the server behind it down or restarting?)",
    503: " (is the server behind it down or restarting?)",
    504: " (the server behind it answered slower than the proxy waits: its proxy_read_timeout)",
}


def _json(response: httpx.Response) -> Any:
    """An answer's body as JSON; ``ValueError`` when it is not JSON, not UTF-8, or nested deeper than
    pydantic-core's parser goes. httpx's ``Response.json`` is ``json.loads``, which recurses once per
    bracket: a hostile server's 200 KB of ``[`` raised ``RecursionError``, past every ``except
    ValueError`` of the client, out of the runtime as an error that is not the SDK's."""
    return from_json(response.content)


def _first_error(exc: ValidationError) -> str:
    """The first refusal, naming the field, without echoing the (possibly hostile) value."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    if not errors:
        return "not what the protocol declares"
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"not JSON ({first['msg']})"
    where = ".".join(str(part) for part in first["loc"])
    return (f"{where}: {first['msg']}" if where else str(first["msg"]))[:200]


class ProtocolClient:
    """One device's connection to one FL server."""

    def __init__(
        self,
        server_url: str,
        *,
        timeout_s: float = 10.0,
        retry: RetryPolicy = RetryPolicy(),
        rng: random.Random | None = None,
        sleep: Callable[[float], None] = time.sleep,
        client: httpx.Client | None = None,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        tls: ClientTLS | None = None,
    ) -> None:
        """``transport``: how requests travel (httpx's, e.g. an in-process one in a simulation);
        by default real HTTP. ``client``: an httpx client to share between devices instead (its
        answers are read as it reads them: the bounds of ``MAX_ANSWER_BYTES``,
        ``MAX_RESOURCE_BYTES`` and ``MIN_ANSWER_BYTES_PER_S`` hold on the client made here, timed
        by ``clock``). ``tls``: a client certificate, or the server's authority (``ClientTLS``)."""
        self.server_url = checked_server_url(server_url)
        self._base_url, self._auth = url_credentials(self.server_url)
        self.retry = retry
        self.rng = rng or random.Random()
        self.sleep = sleep
        self._owns_client = client is None
        tls_context = tls.context() if tls is not None else shared_tls_context()
        #: Whether this client gives a certificate: a server that refuses it closes the connection unsaid.
        self.gives_certificate = tls is not None and tls.cert_file is not None
        own = _DeadlineTransport(tls_context) if client is None and transport is None else None
        #: The sockets ``interrupt`` shuts: those of the transport made here (not an app's or a simulation's).
        self._backend = own.backend if own is not None else None
        # One TLS context for every device of the process: building one loads the CA bundle
        # (about 18 ms and 0.8 MB each), which a fleet of emulated devices paid per device.
        self.http = client or httpx.Client(
            timeout=httpx.Timeout(timeout_s),
            transport=transport if transport is not None else own,
            # the environment's proxies ($HTTPS_PROXY...) are not followed: httpx mounts them only
            # for a client without a transport, and this one has its own sockets (``_DeadlineTransport``)
            verify=tls_context,
            # what ``_BoundedAnswer`` decodes, and no more (httpx asks for br and zstd too once their
            # packages are installed, and the device would then refuse an honest server's answer)
            headers={"Accept-Encoding": "gzip, deflate"},
            event_hooks={"response": [answer_bound(clock, timeout_s)]},
        )
        self.clock, self.timeout_s = clock, timeout_s
        #: A reading of ``clock`` past which no request of this client starts or goes on (the
        #: session's end, set by the runtime); None: each request is bounded alone (``_Deadline``).
        self.ends_at: float | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self._interrupts = 0  # how many times ``interrupt`` was called
        self._wake = threading.Event()  # set by the next ``interrupt``: ends a retry's wait
        self._in_flight: set[_Deadline] = set()
        self._refusing = False

    def interrupt(self, *, for_good: bool = False) -> None:
        """Cut short, from any thread, the requests this client has in flight: their sockets are
        shut (on the transport made here; an app's ``client`` or ``transport`` goes on until its
        own timeout), a wait between retries ends, and each raises ``ProtocolError`` saying so
        instead of trying again. Requests sent after it run as before; with ``for_good`` none is
        sent any more. A runtime's ``close`` calls it."""
        self._refusing = self._refusing or for_good
        self._interrupts += 1
        wake, self._wake = self._wake, threading.Event()
        wake.set()
        for deadline in list(self._in_flight):
            deadline.interrupted = True
        if self._backend is not None:
            self._backend.shut()

    def close(self) -> None:
        if self._owns_client:
            self.http.close()

    def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Callable[[], Any] | None = None,
        retried: list[bool] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """``json_body``: builds the JSON body afresh for each attempt (a signed nonce must not
        be sent twice: the server refuses a replay). ``retried``: set to ``[True]`` once a second
        attempt is sent (an earlier one may have reached the server, its answer lost)."""
        url = self._base_url + path
        if self._auth is not None:
            kwargs.setdefault("auth", self._auth)
        last_error: Exception | None = None
        generation, wake = self._interrupts, self._wake
        for attempt in range(self.retry.attempts):
            if attempt:
                delay = self.retry.delay(attempt, self.rng)
                if self.sleep is time.sleep:  # the system's time: ``interrupt`` ends the wait
                    wake.wait(delay)
                else:
                    self.sleep(delay)
                if retried is not None:
                    retried[:] = [True]
            if self._refusing or self._interrupts != generation:
                raise ProtocolError(f"{method} {path[:100]}: {INTERRUPTED}")
            if self.ends_at is not None and self.clock() >= self.ends_at:
                raise ProtocolError(
                    f"the session's deadline passed before {method} {path[:100]} could be sent"
                    + (f" (the last attempt: {last_error})" if last_error is not None else "")
                )
            try:
                if json_body is not None:
                    kwargs["json"] = json_body()
                deadline = _this_request.deadline = _Deadline(self.clock, self.timeout_s, self.ends_at)
                self._in_flight.add(deadline)
                deadline.interrupted = self._interrupts != generation  # interrupted as it was made
                response = self.http.request(method, url, **kwargs)
            except httpx.TransportError as exc:
                if self._interrupts != generation:
                    raise ProtocolError(f"{method} {path[:100]}: {INTERRUPTED}") from None
                refusal = tls_refusal(exc)
                if refusal is not None:  # the app's configuration or the server's: no retry changes it
                    raise ServerUnreachable(
                        f"the FL server at {redacted_url(self.server_url)} could not be reached over TLS: {refusal} ({exc})",
                        retryable=False,
                    ) from None
                last_error = exc
                continue
            finally:
                self._in_flight.discard(_this_request.deadline)
                _this_request.deadline = None
            body = kwargs.get("content") or b""
            self.bytes_sent += len(body) if isinstance(body, (bytes, bytearray)) else 0
            self.bytes_received += len(response.content)
            if response.status_code >= 500:
                said = f"server error {response.status_code}"
                if _error_code(response) is None:  # a proxy's page (502 Bad Gateway, 504 Gateway Time-out)
                    said = foreign_answer(response)
                last_error = ProtocolError(said, status=response.status_code)
                continue
            return response
        hint = ""
        if self.gives_certificate and self.server_url.startswith("https://") and closed_unsaid(last_error):
            hint = f"; {REFUSED_CERTIFICATE}"
        raise ServerUnreachable(
            f"the FL server at {redacted_url(self.server_url)} did not answer {method} {path} after {self.retry.attempts} attempts: {last_error}{hint}"
        )

    @staticmethod
    def _raise_for_error(response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        code = _error_code(response)
        try:
            message = _json(response)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            said = foreign_answer(response)  # bounded: a title of at most 100 characters
            if response.status_code == 413:
                # a proxy's limit on bodies, below the upload's size: the server never saw it, and
                # the same upload is refused again until the proxy changes. Taken as the server's
                # refusal, a report ended REPORT_REJECTED with no code and nothing said why.
                raise ServerUnreachable(
                    f"{response.request.method} {response.request.url.path[:100]} did not reach the FL server: {said}",
                    retryable=False,
                ) from None
            raise ProtocolError(said, status=response.status_code, code=code) from None
        message = "".join(c if c.isprintable() else " " for c in str(message)[:200])
        if code == "MISSING_TOKEN" and TOKEN_HEADER in response.request.headers:
            # the server read only ``Authorization`` (the URL's basic auth): it asked for a bearer
            # token there, which this device cannot send beside the URL's credentials
            message = (
                f"the server did not read the session token sent in {TOKEN_HEADER} beside the URL's credentials: "
                f"a server of a release before {TOKEN_HEADER} (upgrade it) or a gateway that drops the header"
            )
        if code == "CLIENT_CERTIFICATE_REQUIRED":  # what this client's settings lack
            message += "; give this client its certificate: FLRuntime(..., tls=ClientTLS(cert_file, key_file))"
        raise ProtocolError(f"{message} (HTTP {response.status_code}, {code})", status=response.status_code, code=code)

    def attestation_nonce(self) -> bytes:
        """A fresh challenge from the server, to be signed into this check-in's attestation."""
        response = self._request("POST", "/v1/attestation/nonce", json={})
        self._raise_for_error(response)
        try:
            return decode_nonce(_answer(response, AttestationChallenge, "attestation challenge").nonce)
        except (AttestationError, ValueError) as exc:
            raise ProtocolError(f"the server's attestation challenge is malformed: {exc}") from None

    def checkin(
        self,
        population: str,
        runtime_version: str,
        eligibility: VerdictJSON | None = None,
        attestation: dict | Callable[[], dict] | None = None,
    ) -> CheckinAccepted | CheckinRejected:
        """Returns the session (``CheckinAccepted``), or ``CheckinRejected`` with ``reason`` and
        ``retry_after_s`` (None when the server named no sane window).
        ``attestation`` may be a function that attests a fresh nonce: it is called for every
        attempt, so a retried check-in never replays a nonce the server has already consumed."""

        def body() -> dict:
            data: dict = {"runtime_version": runtime_version, "eligibility": eligibility or {}}
            if attestation is not None:
                data["attestation"] = attestation() if callable(attestation) else attestation
            return data

        response = self._request("POST", f"/v1/populations/{population}/checkin", json_body=body)
        self._raise_for_error(response)
        return _answer(response, CHECKIN_ANSWER, "check-in answer")

    def eligibility_info(self, population: str) -> EligibilityInfo:
        response = self._request("GET", f"/v1/populations/{population}/eligibility")
        self._raise_for_error(response)
        return _answer(response, EligibilityInfo, "eligibility answer")

    def fetch_resource(self, resource_id: str, token: str, bound: tuple[int, str] | None = None) -> bytes:
        """Download a content-addressed resource of the session whose bearer ``token`` is given
        and check that it is what its id names. ``bound``: the most this device holds of it, when
        less than ``MAX_RESOURCE_BYTES``, and why; past it the download stops in ``OverBudget``
        saying so (on the client made here; one given as ``client`` reads it whole)."""
        _this_request.resource_bound = bound
        try:
            response = self._request("GET", f"/v1/resources/{resource_id}", headers=token_headers(token, self._auth))
        finally:
            _this_request.resource_bound = None
        self._raise_for_error(response)
        if not 200 <= response.status_code < 300:  # a redirect (never followed): no bytes of the resource came
            raise ProtocolError(
                f"the server's answer to the download of {resource_id} came with HTTP {response.status_code}, "
                "not a success",
                status=response.status_code,
            )
        data = response.content
        if hashlib.sha256(data).hexdigest() != resource_id:
            raise CorruptResource(
                f"resource {resource_id} arrived corrupted (its SHA-256 does not match); it was discarded"
            )
        return data

    def report(self, session: CheckinAccepted, update: bytes, stats: dict | None = None) -> ReportAnswer:
        headers = {**token_headers(session.token, self._auth), "Content-Type": "application/octet-stream"}
        if stats:
            headers[STATS_HEADER] = json.dumps(stats, separators=(",", ":"))
        retried: list[bool] = []
        response = self._request(
            "POST", f"/v1/sessions/{session.session_id}/report", content=update, headers=headers, retried=retried
        )
        if retried and response.status_code == 409 and _error_code(response) == DUPLICATE_REPORT:
            # an earlier attempt was taken and its answer lost (only this device holds the session's
            # token): the update is the server's, once. Read as a refusal, the session was kept as
            # rejected ('#'), not counted as taking part, and its examples trained and sent again.
            return ReportAnswer()
        self._raise_for_error(response)
        if not 200 <= response.status_code < 300:
            raise ProtocolError(
                f"the server answered the report with HTTP {response.status_code}, not a success",
                status=response.status_code,
            )
        try:  # the report was taken (2xx); what the answer adds is advice, and a broken one is none
            return _answer(response, ReportAnswer, "answer to the report")
        except ProtocolError:
            return ReportAnswer()

    def secagg_poll(self, session: CheckinAccepted, *, after: int | None = None, wait_s: float = 0.0) -> dict:
        """This session's Secure Aggregation state and the server's latest message for it. With
        ``after`` (the last message seq seen) the server holds the answer up to ``wait_s`` seconds
        until there is something new."""
        params = {} if after is None else {"after": str(after), "wait": f"{max(0.0, wait_s):.3f}"}
        response = self._request(
            "GET",
            f"/v1/sessions/{session.session_id}/secagg",
            params=params,
            headers=token_headers(session.token, self._auth),
        )
        self._raise_for_error(response)
        # Read as a JSON object only: the Secure Aggregation client reads it as ``wire.SecAggState``
        # and refuses a state out of shape as a refusal of the round (``SecureOutcome``), not an error.
        try:
            data = _json(response)
        except ValueError:  # not JSON, or not UTF-8
            raise ProtocolError(
                f"the server's Secure Aggregation state is not JSON: {response.content[:80]!r}"
            ) from None
        if not isinstance(data, dict):
            raise ProtocolError(f"the server's Secure Aggregation state is not a JSON object: {str(data)[:80]!r}")
        return data

    def secagg_send(self, session: CheckinAccepted, message: bytes) -> None:
        response = self._request(
            "POST",
            f"/v1/sessions/{session.session_id}/secagg",
            content=message,
            headers={**token_headers(session.token, self._auth), "Content-Type": "application/octet-stream"},
        )
        self._raise_for_error(response)

    def abort(self, session: CheckinAccepted, reason: str, stats: dict | None = None) -> None:
        response = self._request(
            "POST",
            f"/v1/sessions/{session.session_id}/abort",
            json={"reason": reason, "stats": stats or {}},
            headers=token_headers(session.token, self._auth),
        )
        self._raise_for_error(response)


#: Where a client is given an authority to trust: an app's runtime, an operator's command.
_GIVE_AUTHORITY = "(an app: FLRuntime(..., tls=ClientTLS(ca_file=...)); a command: $SSL_CERT_FILE)"

#: What a certificate refused by OpenSSL's verify code (``X509_V_ERR_*``) means for the operator.
#: Every refusal was once one sentence, "self-signed, expired or for another name", and which of the
#: three was left to the reader of OpenSSL's own words in the parenthesis.
_CERTIFICATE_REFUSALS = {
    9: "its certificate is not valid yet (is this machine's clock behind?)",
    10: "its certificate has expired: renew the server's certificate (or is this machine's clock ahead?)",
    18: f"its certificate is self-signed: give this client the authority that signed it {_GIVE_AUTHORITY}",
    19: f"its certificate was issued by an authority not trusted here: give this client that authority {_GIVE_AUTHORITY}",
    20: f"its certificate was issued by an authority not trusted here: give this client that authority {_GIVE_AUTHORITY}",
    62: "its certificate is for another name than the URL's host: "
    "give the URL with a name the certificate holds, or the server a certificate for this one",
}


#: What a server that closes a connection unsaid, right after its TLS handshake, most likely did
#: to a client that gave a certificate: a server asking for one ends the handshake so on one it
#: refuses (another authority's, expired), and the client reads nothing but the closed connection.
REFUSED_CERTIFICATE = (
    "a server that admits only clients with a certificate (mutual TLS) closes the connection so on one it refuses: "
    "is this client's certificate valid now, and issued by an authority the server names (fedfleet server "
    "--tls-client-ca)?"
)


def closed_unsaid(error: BaseException | None) -> bool:
    """Whether ``error`` is a connection the server closed with no answer, or in its TLS handshake."""
    seen = error
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, (httpx.RemoteProtocolError, httpcore.RemoteProtocolError, ssl.SSLEOFError)):
            return True
        if isinstance(seen, (ConnectionResetError, BrokenPipeError)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


#: ``tls_refusal``'s answer for a server that answered a TLS hello in plain HTTP.
NO_TLS = "it does not speak TLS on this port: is its URL http://, not https://?"


def tls_refusal(exc: BaseException) -> str | None:
    """What a failed TLS handshake says about the server's URL or certificate, or None when the
    failure was not one. It ended as any lost connection did, after every retry, in "did not answer"."""
    seen: BaseException | None = exc
    for _ in range(8):  # httpx's error, httpcore's, then ssl's
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLCertVerificationError):
            return _CERTIFICATE_REFUSALS.get(
                seen.verify_code,
                "its certificate is not trusted here; give the server a certificate a trusted "
                "authority issued for this name",
            )
        if isinstance(seen, ssl.SSLError) and seen.reason == "WRONG_VERSION_NUMBER":
            return NO_TLS
        seen = seen.__cause__ or seen.__context__
    return None


def retry_window(answer: object) -> tuple[float, float] | None:
    """The ``retry_after_s`` window an answer (a wire model or a JSON object) names, cut to a week;
    None when it names none or a malformed one (a server is not trusted to; see ``wire.sane_window``)."""
    if isinstance(answer, dict):
        return sane_window(answer.get("retry_after_s"))
    return getattr(answer, "retry_after_s", None)
