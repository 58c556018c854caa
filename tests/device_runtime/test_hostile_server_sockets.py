"""A hostile server on a real loopback socket cannot hold a device past its deadlines.

httpx bounds each read and write alone, so a server that sends its answer a byte at a time, each
byte within the read timeout, held a device for as long as it liked: the head (status line and
headers) before any body, or a body that keeps the body's pace bound for hours. Here each request
ends ``timeout_s`` after it began plus a second per ``MIN_ANSWER_BYTES_PER_S`` bytes moved, and no
request of a session outlives the session's report window; the device leaves nothing behind."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from collections.abc import Callable

import pytest

from device_runtime import FLRuntime, InvalidSetting, Outcome, ProtocolError, RetryPolicy, ServerUnreachable
from device_runtime.protocol import ProtocolClient
from example_store import InMemoryExampleStore

REJECTED = json.dumps({"status": "rejected", "reason": "ROUND_FULL", "retry_after_s": [1, 2]}).encode()


def _answer(body: bytes, status: str = "200 OK") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    return head.encode() + body


class DribblingServer:
    """A loopback HTTP/1.1 server whose ``answer(path)`` gives, per request, the bytes to send and
    the pause before each ``piece`` of them (None: all at once; with ``head_only`` the body goes at
    once after a slow head); it counts what it sent. One request per connection."""

    def __init__(
        self, answer: Callable[[str], tuple[bytes, float | None]], piece: int = 1, head_only: bool = False
    ) -> None:
        self.answer, self.piece, self.head_only = answer, piece, head_only
        self.sent: list[int] = []  # bytes sent per connection
        self.paths: list[str] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.stopping = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                data = conn.recv(65536)
                if not data:
                    return
                head += data
            lines = head.split(b"\r\n")
            length = next((int(x.split(b":")[1]) for x in lines if x.lower().startswith(b"content-length:")), 0)
            rest = len(head.split(b"\r\n\r\n", 1)[1])
            while rest < length:  # the request's body, read whole
                data = conn.recv(65536)
                if not data:
                    return
                rest += len(data)
            path = lines[0].split()[1].decode()
            self.paths.append(path)
            body, pause = self.answer(path)
            index = len(self.sent)
            self.sent.append(0)
            head_end = body.find(b"\r\n\r\n")
            slow = 0 if pause is None else head_end + 4 if self.head_only and head_end >= 0 else len(body)
            for i in range(0, len(body), self.piece):
                piece = body[i : i + self.piece] if i < slow else body[i:]
                if self.stopping.is_set():
                    return
                if i < slow:
                    time.sleep(pause or 0.0)
                try:
                    conn.sendall(piece)
                except OSError:  # the device hung up
                    return
                self.sent[index] += len(piece)
                if i >= slow:
                    return

    def close(self) -> None:
        self.stopping.set()
        self.listener.close()


@pytest.fixture
def dribbling():
    servers: list[DribblingServer] = []

    def make(answer, piece: int = 1, head_only: bool = False) -> DribblingServer:
        servers.append(DribblingServer(answer, piece, head_only))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


@pytest.mark.parametrize("head", ["slow", "endless"])
def test_an_answer_whose_head_dribbles_in_is_dropped_at_the_requests_deadline(dribbling, head):
    """A byte of the head every 20 ms, well within the 0.3 s read timeout: the whole head (142
    bytes, then the body at once) would take 3 s, and an endless header line for ever. The device gives each
    attempt 0.3 s (and a second per KiB moved) and then says the server did not answer."""
    whole = _answer(REJECTED)
    endless = whole.split(b"\r\n\r\n")[0] + b"\r\nX-Pad: " + b"a" * 10**6
    server = dribbling(lambda path: (whole if head == "slow" else endless, 0.02), head_only=True)
    client = ProtocolClient(server.url, timeout_s=0.3, retry=RetryPolicy(attempts=2, base_delay_s=0.0))
    with pytest.raises(ServerUnreachable, match="took longer than 0.3 s and a second per 1024 bytes"):
        client.checkin("p", "1.31.1")
    client.close()
    assert len(server.sent) == 2 and all(sent < len(whole) for sent in server.sent)


def test_an_answer_at_once_is_read_as_before(dribbling):
    """The deadline does not touch an answer that comes: the same client reads it whole."""
    server = dribbling(lambda path: (_answer(REJECTED), None))
    client = ProtocolClient(server.url, timeout_s=0.3, retry=RetryPolicy(attempts=1))
    assert client.checkin("p", "1.31.1").retry_after_s == (1.0, 2.0)
    assert client.checkin("p", "1.31.1").status == "rejected"  # and again, on a new connection
    client.close()


def _accepted(plan_id: str, report_deadline_s: float = 0.5) -> bytes:
    return json.dumps(
        {
            "status": "accepted",
            "session_id": "s1",
            "token": "t0k3n",
            "task": "train",
            "round": 1,
            "plan_id": plan_id,
            "checkpoint_id": "b" * 64,
            "aggregation": "simple",
            "report_deadline_s": report_deadline_s,
        }
    ).encode()


def test_a_plan_that_keeps_the_pace_but_outlasts_the_report_window_ends_the_session(dribbling, tmp_path):
    """A 60 KB plan at 2 KB a second keeps the body's pace bound (1 KB/s) and would take 30 s; the
    session's report window is 0.5 s (and one request's timeout, 0.5 s). The session ends in a
    ProtocolError naming the deadline, the server hears the abort, and no plan is left on disk."""
    plan = b"\0" * 60_000
    plan_id = hashlib.sha256(plan + b"other").hexdigest()  # never read whole: its id need not match

    def answer(path: str) -> tuple[bytes, float | None]:
        if path.endswith("/checkin"):
            return _answer(_accepted(plan_id)), None
        if path.startswith("/v1/resources/"):
            return _answer(plan), 0.05  # 100 bytes every 50 ms
        return _answer(b'{"status": "aborted"}'), None

    server = dribbling(answer, piece=100)
    store = InMemoryExampleStore()
    store.add("app:/digits", [{"x": [0.0] * 64, "y": 1}])
    runtime = FLRuntime(
        "p",
        server.url,
        store,
        timeout_s=0.5,
        retry=RetryPolicy(attempts=3, base_delay_s=0.0),
        cache_dir=tmp_path / "cache",
    )
    with runtime, pytest.raises(ProtocolError, match=r"the session's deadline passed before GET /v1/resources/"):
        runtime.run_session()
    assert server.paths[-1] == "/v1/sessions/s1/abort"
    assert max(server.sent) < len(plan) and not list((tmp_path / "cache").glob("*"))
    assert runtime.client.ends_at is None  # the next session starts with a window of its own


def test_a_name_that_never_resolves_is_dropped_at_the_requests_deadline(monkeypatch):
    """``getaddrinfo`` takes no timeout: a resolver that never answered held the device for ever."""
    from device_runtime import protocol

    release = threading.Event()
    asked: list[str] = []

    def hanging_resolver(host: str, port: int) -> list:
        asked.append(host)
        release.wait(60)
        return []

    monkeypatch.setattr(protocol, "_getaddrinfo", hanging_resolver)
    client = ProtocolClient("http://fl.example:8443", timeout_s=0.3, retry=RetryPolicy(attempts=2, base_delay_s=0.0))
    try:
        with pytest.raises(
            ServerUnreachable, match="resolving 'fl.example' took longer than the 0.3 s the request had"
        ):
            client.checkin("pop", "1.0")
    finally:
        release.set()
        client.close()
    assert asked == ["fl.example", "fl.example"]  # each attempt looked the name up again


def test_a_name_is_resolved_and_its_address_reached(dribbling):
    """The real resolver, bounded: ``localhost`` reaches the loopback server."""
    server = dribbling(lambda path: (_answer(REJECTED), None))
    client = ProtocolClient(server.url.replace("127.0.0.1", "localhost"), timeout_s=5, retry=RetryPolicy(attempts=1))
    try:
        assert client.checkin("pop", "1.0").reason == "ROUND_FULL"
    finally:
        client.close()
    assert server.paths == ["/v1/populations/pop/checkin"]


@pytest.mark.parametrize("held", ["the check-in", "the plan's download", "the download and the abort"])
def test_closing_a_runtime_cuts_short_a_request_the_server_holds(dribbling, tmp_path, held):
    """An app that closes its runtime while the server holds a request of its session (no byte of
    an answer): ``close`` waited for the request's timeout and every retry, the session going on
    under it. Now the request is cut short at once: a session the server accepted ends
    interrupted (``-!``), the server told through its abort, and one still checking in raises
    ``InvalidSetting`` saying the runtime was closed. A server that holds the abort too keeps
    ``close`` for ``timeout_s`` at most, and the session ends right after, its abort cut short."""
    plan_id = "a" * 64
    waiting, release = threading.Event(), threading.Event()
    holds = {"the check-in": ("/checkin",), "the plan's download": ("/v1/resources/",)}.get(
        held, ("/v1/resources/", "/abort")
    )

    def answer(path: str) -> tuple[bytes, float | None]:
        if any(part in path for part in holds):
            waiting.set()
            release.wait(30)
            return b"", None
        if path.endswith("/checkin"):
            return _answer(_accepted(plan_id, report_deadline_s=60.0)), None
        return _answer(b'{"status": "aborted"}'), None

    server = dribbling(answer)
    store = InMemoryExampleStore()
    store.add("app:/digits", [{"x": [0.0] * 64, "y": 1}])
    timeout_s = 1.0 if held == "the download and the abort" else 3.0
    runtime = FLRuntime(
        "p", server.url, store, timeout_s=timeout_s, retry=RetryPolicy(attempts=3), cache_dir=tmp_path / "cache"
    )
    ended: list = []

    def run() -> None:
        try:
            ended.append(runtime.run_session())
        except InvalidSetting as exc:
            ended.append(exc)

    session = threading.Thread(target=run, daemon=True)
    try:
        session.start()
        assert waiting.wait(30)
        started = time.monotonic()
        runtime.close()
        took = time.monotonic() - started
        session.join(1.0)
        assert not session.is_alive()
    finally:
        release.set()
    [result] = ended
    if held == "the check-in":
        assert isinstance(result, InvalidSetting) and "was closed while it checked in" in str(result)
        assert took < 1.0 and server.paths == ["/v1/populations/p/checkin"]
        return
    assert result.outcome is Outcome.INTERRUPTED and result.shape == "-!"
    assert server.paths[-1] == "/v1/sessions/s1/abort"
    if held == "the plan's download":
        assert took < 1.0
    else:  # the abort held: close gave it the runtime's timeout_s, then cut it short too
        assert timeout_s - 0.1 < took < timeout_s + 0.5
    assert not list((tmp_path / "cache").glob("*"))
