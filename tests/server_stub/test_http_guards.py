"""Slow, crowding, oversized and vanishing clients against a real uvicorn server on loopback, spoken
to over raw sockets (an HTTP client library would not misbehave this way): each is cut off or
answered, and the server keeps answering everyone else."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import resource
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from server_stub import AdminKeys, FLService, HttpLimits, ServerStore, ServerThread, free_port
from server_stub.app import create_app
from server_stub.cli import add_server_arguments, run_server
from server_stub.http_guards import BODY_GRACE_S, GuardedServer

REPO = Path(__file__).resolve().parents[2]
#: How long a test waits for the server to act before it calls the server stuck (never reached
#: when the guards work: their timeouts here are a second or two).
HANG_S = 15.0


@pytest.fixture
def guarded(tmp_path):
    limits = HttpLimits(header_timeout_s=1.0, body_timeout_s=1.0, max_connections=8)
    with ServerThread(tmp_path / "server.db", http_limits=limits) as server:
        yield server


def _connect(server: ServerThread) -> socket.socket:
    sock = socket.create_connection((server.host, server.port))
    sock.settimeout(HANG_S)
    return sock


def _until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(
            f"the server still held the connection after {HANG_S} s (got {received[:100]!r})"
        ) from None
    finally:
        sock.close()
    return received


def _answer(raw: bytes) -> tuple[int, str]:
    """Status and error code of a raw HTTP answer."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]["code"]


def _head(method: str, path: str, *headers: str) -> bytes:
    return "\r\n".join([f"{method} {path} HTTP/1.1", "Host: fl", *headers, "", ""]).encode()


def test_a_request_head_that_does_not_arrive_in_time_is_cut_off(guarded):
    silent = _connect(guarded)
    partial = _connect(guarded)
    partial.sendall(b"GET /v1/health HTTP/1.1\r\nHost: fl\r\n")
    assert _until_closed(silent) == b""
    assert _answer(_until_closed(partial)) == (408, "HEADER_TIMEOUT")
    trickling = _connect(guarded)
    trickling.sendall(b"GET /v1/health HTTP/1.1\r\nX-Slow: ")
    for _ in range(int(HANG_S / 0.1)):  # a byte keeps coming, the head never ends: cut off all the same
        if select.select([trickling], [], [], 0.1)[0]:
            break  # answered (or closed)
        try:
            trickling.send(b"a")
        except OSError:
            break
    else:
        raise AssertionError(f"a head trickling in for {HANG_S} s was not cut off")
    _until_closed(trickling)
    assert httpx.get(f"{guarded.url}/v1/health", timeout=HANG_S).json() == {"status": "ok"}


def test_a_request_body_that_stops_arriving_is_answered_408_and_cut_off(guarded):
    stalled = _connect(guarded)
    stalled.sendall(
        _head("POST", "/v1/populations/digits/checkin", "Content-Type: application/json", "Content-Length: 1000")
        + b'{"runtime_version"'
    )
    assert _answer(_until_closed(stalled)) == (408, "BODY_TIMEOUT")
    # A body the app answered without reading it (a refusal) is not drained for ever either.
    unread = _connect(guarded)
    unread.sendall(
        _head("POST", "/v1/sessions/none/report", "Authorization: Bearer x", "Content-Length: 100000") + b"x" * 10
    )
    assert _answer(_until_closed(unread)) == (401, "BAD_SESSION_TOKEN")


def test_a_request_body_that_stalls_after_a_burst_is_cut_off_however_much_it_sent(guarded):
    """Each KiB a body brings earns it a second more: a body that sent 60 KB at once could then
    stall for a minute (10 MB: near three hours), holding its connection and what it sent. No
    piece of a body is awaited longer than ``body_timeout_s``."""
    burst = _connect(guarded)
    burst.sendall(
        _head("POST", "/v1/populations/digits/checkin", "Content-Type: application/json", "Content-Length: 64000")
        + b" " * 60_000
    )
    assert _answer(_until_closed(burst)) == (408, "BODY_TIMEOUT")


def test_the_connection_cap_makes_room_by_closing_the_longest_idle(tmp_path):
    limits = HttpLimits(header_timeout_s=60.0, max_connections=8)  # the timeout plays no part here
    with ServerThread(tmp_path / "server.db", http_limits=limits) as server:
        crowd = []
        for _ in range(20):
            sock = _connect(server)
            sock.sendall(b"GET /v1/hea")
            crowd.append(sock)
        # The server holds 8 of them, yet a new client is answered: the longest idle gives way.
        assert httpx.get(f"{server.url}/v1/health", timeout=HANG_S).json() == {"status": "ok"}
        for sock in crowd[:12]:
            _until_closed(sock)
        for sock in crowd[12:]:
            sock.close()


def _ask_health(sock: socket.socket) -> int:
    """The status of ``GET /v1/health`` asked on a kept-alive connection (0: the server had closed it)."""
    try:
        sock.sendall(_head("GET", "/v1/health"))
        received = b""
        while b"\r\n\r\n" not in received or not received.endswith(b"}"):
            if not (chunk := sock.recv(65536)):
                return 0
            received += chunk
    except (BrokenPipeError, ConnectionResetError):
        return 0
    return int(received.split(b" ", 2)[1])


def test_the_connection_cap_closes_a_connection_only_for_one_that_waits(tmp_path):
    """asyncio calls ``accept`` until none is waiting, and the cap made room before each call:
    the call that found none had closed the longest idle all the same, so a cap of 256 filled by
    256 stalled check-ins held 255 (the last place free for everyone else), and an idle device
    lost its kept-alive connection whenever the last place was taken."""
    limits = HttpLimits(header_timeout_s=60.0, max_connections=8)  # the timeout plays no part here
    with ServerThread(tmp_path / "server.db", http_limits=limits) as server:
        devices = []
        for _ in range(8):  # one at a time, each answered once and then idle: the cap is just full
            sock = _connect(server)
            assert _ask_health(sock) == 200
            devices.append(sock)
        try:
            assert [_ask_health(sock) for sock in devices] == [200] * 8
        finally:
            for sock in devices:
                sock.close()


def test_slow_bodies_at_the_connection_cap_give_way_to_honest_clients(tmp_path):
    """Every connection held by a check-in whose body does not come (each for up to
    ``body_timeout_s``) answered everyone else 503 SERVER_BUSY (a cap per address would refuse the
    devices behind one NAT). Now, at the cap, the body that has come slowest gives way to a new
    connection, answered 408 ``BODY_TIMEOUT``."""
    limits = HttpLimits(body_timeout_s=60.0, max_connections=8)  # the timeout plays no part here
    with ServerThread(tmp_path / "server.db", http_limits=limits) as server:
        with httpx.Client(base_url=server.url, timeout=HANG_S) as admin:
            headers = {"Authorization": f"Bearer {server.admin_key}"}
            assert admin.post("/v1/populations", json={"name": "digits"}, headers=headers).status_code == 201
        slow = []
        for _ in range(8):
            sock = _connect(server)
            sock.sendall(_head("POST", "/v1/populations/digits/checkin", "Content-Length: 1000") + b"{")
            slow.append(sock)
        time.sleep(BODY_GRACE_S + 0.5)  # every slow body has arrived for longer than its grace
        for _ in range(8):  # new clients, each on a connection of its own, get their answers
            with httpx.Client(base_url=server.url, timeout=HANG_S) as device:
                answer = device.post("/v1/populations/digits/checkin", json={"runtime_version": "1.0.0"})
                assert answer.status_code == 200, answer.text
        closed, _, _ = select.select(slow, [], [], HANG_S)
        assert closed, "no slow body gave way"
        for sock in slow:
            if sock in closed:
                assert _answer(_until_closed(sock)) == (408, "BODY_TIMEOUT")
            sock.close()


def test_a_request_head_over_the_limit_is_answered_431(guarded):
    huge = _connect(guarded)  # 100 KB in one piece: h11 alone would parse it whole
    huge.sendall(_head("GET", "/v1/health", "Authorization: Bearer " + "a" * 100_000))
    assert _answer(_until_closed(huge)) == (431, "HEADERS_TOO_LARGE")
    piecemeal = _connect(guarded)  # over the limit before it is complete
    piecemeal.sendall(_head("GET", "/v1/health")[:-2])
    for _ in range(4):
        piecemeal.sendall(b"X-Padding: " + b"p" * 5000 + b"\r\n")
    assert _answer(_until_closed(piecemeal)) == (431, "HEADERS_TOO_LARGE")
    with httpx.Client(base_url=guarded.url, timeout=HANG_S) as http:  # an answer, not a reset, for a real client too
        r = http.get("/v1/health", headers={"Authorization": "Bearer " + "a" * 20_000})
        assert r.status_code == 431 and r.json()["error"]["code"] == "HEADERS_TOO_LARGE"
        assert http.get("/v1/health").status_code == 200


#: 200 pipelined requests for the 53 KB OpenAPI document: 10 MB of answers, more than loopback's buffers hold
_UNREAD = _head("GET", "/openapi.json") * 200


def _not_reading(server: ServerThread) -> socket.socket:
    """A client that asks for far more than the socket buffers hold and reads none of it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window it offers
    sock.settimeout(HANG_S)
    sock.connect((server.host, server.port))
    sock.sendall(_UNREAD)
    return sock


def test_a_client_that_reads_nothing_of_its_answer_is_cut_off(guarded):
    """Writes to a client that reads nothing wait for it: the app's request was held for as long
    as the socket stayed open, and such sockets at the cap held the server at 503 SERVER_BUSY."""
    records = _Records()
    logging.getLogger("uvicorn.error").addHandler(records)
    try:
        stalled = _not_reading(guarded)
        time.sleep(2.5)  # the guard's 1 s with nothing read, and time to spare on a loaded machine
        received = _until_closed(stalled)  # reading now: it ends, where an open connection sent all 10 MB and waited
        assert len(received) < len(_UNREAD) // len(_head("GET", "/openapi.json")) * 53_000
    finally:
        logging.getLogger("uvicorn.error").removeHandler(records)
    assert not [r for r in records.records if r.levelno >= logging.ERROR]
    assert httpx.get(f"{guarded.url}/v1/health", timeout=HANG_S).json() == {"status": "ok"}


def test_clients_that_read_nothing_of_their_answers_give_way_at_the_connection_cap(tmp_path):
    limits = HttpLimits(body_timeout_s=60.0, max_connections=8)  # the timeout plays no part here
    with ServerThread(tmp_path / "server.db", http_limits=limits) as server:
        crowd = [_not_reading(server) for _ in range(8)]
        # Each holds a request the app cannot finish until it reads; a new client is answered all the
        # same, once they stall (503 SERVER_BUSY while the server is still writing to them).
        deadline = time.monotonic() + HANG_S
        while (status := httpx.get(f"{server.url}/v1/health", timeout=HANG_S).status_code) == 503:
            assert time.monotonic() < deadline, "clients that read nothing kept the server busy"
            time.sleep(0.1)
        assert status == 200
        for sock in crowd:
            sock.close()


@pytest.mark.parametrize("version", ["9.9", "2.0", "0.9", "3.1"])
def test_a_request_of_another_major_http_version_is_answered_505(guarded, version):
    """h11 takes any digit.digit, and uvicorn answered 'GET /v1/health HTTP/9.9' 200."""
    other = _connect(guarded)
    other.sendall(_head("GET", "/v1/health").replace(b"HTTP/1.1", f"HTTP/{version}".encode(), 1))
    raw = _until_closed(other)
    assert raw.startswith(b"HTTP/1.1 505 ") and _answer(raw) == (505, "HTTP_VERSION_NOT_SUPPORTED")
    assert f"HTTP/{version}".encode() in raw


@pytest.mark.parametrize("version", ["1.0", "1.1", "1.2"])
def test_a_request_of_http_1_is_answered_whatever_its_minor_version(guarded, version):
    """RFC 9112 section 2.6: a later minor version is read as the highest this server speaks."""
    one = _connect(guarded)
    one.sendall(_head("GET", "/v1/health", "Connection: close").replace(b"HTTP/1.1", f"HTTP/{version}".encode(), 1))
    raw = _until_closed(one)
    assert raw.split(b" ", 2)[1] == b"200" and raw.endswith(b'{"status":"ok"}')


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_client_that_disconnects_mid_body_is_one_debug_line_not_an_error(guarded):
    records = _Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "server_stub")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(records)
    logging.getLogger("server_stub").setLevel(logging.DEBUG)
    try:
        for path in ("/v1/populations/digits/checkin", "/v1/attestation/nonce"):
            gone = _connect(guarded)
            gone.sendall(_head("POST", path, "Content-Type: application/json", "Content-Length: 1000") + b"x" * 100)
            gone.close()
        deadline = time.monotonic() + HANG_S
        while (
            time.monotonic() < deadline
            and sum("disconnected" in r.getMessage() or r.levelno >= logging.ERROR for r in records.records) < 2
        ):
            time.sleep(0.02)
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(records)
            logger.setLevel(level)
    errors = [r.getMessage() for r in records.records if r.levelno >= logging.WARNING]
    assert errors == [], errors
    lines = [r for r in records.records if "disconnected" in r.getMessage()]
    assert len(lines) == 2 and all(r.levelno == logging.DEBUG and r.exc_info is None for r in lines)


@contextlib.contextmanager
def _command(
    tmp_path: Path, *options: str, preexec_fn: Callable[[], None] | None = None
) -> Iterator[tuple[int, list[str]]]:
    """``python -m server_stub`` (``fedfleet server``) on a free port, once it answers health:
    its port, and its output when it has stopped (in the list, then)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server_stub",
            "--db",
            str(tmp_path / "s.db"),
            "--port",
            str(port),
            "--log-level",
            "warning",
            *options,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec_fn,
    )
    output: list[str] = []
    try:
        deadline = time.monotonic() + 60
        with httpx.Client(timeout=1) as http:  # one client for every poll: each new one costs ~60 ms of CPU
            while True:
                try:
                    http.get(f"http://127.0.0.1:{port}/v1/health")
                    break
                except httpx.TransportError:
                    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                    time.sleep(0.1)
        yield port, output
    finally:
        proc.terminate()
        output.extend(proc.communicate(timeout=30))


def test_the_server_command_takes_its_limits_and_prints_them(tmp_path):
    with _command(
        tmp_path,
        "--header-timeout-s",
        "7",
        "--body-timeout-s",
        "9",
        "--max-connections",
        "50",
        "--max-header-bytes",
        "2048",
    ) as (port, output):
        r = httpx.get(f"http://127.0.0.1:{port}/v1/health", headers={"X-Padding": "p" * 4000}, timeout=HANG_S)
        assert r.status_code == 431 and r.json()["error"]["code"] == "HEADERS_TOO_LARGE"
    assert "head within 7 s, body within 9 s (+1 s per KiB), 50 connections, headers up to 2048 bytes" in output[0]


@pytest.mark.parametrize(
    "option, value",
    [
        ("--header-timeout-s", "0"),
        ("--body-timeout-s", "nan"),
        ("--max-connections", "0"),
        ("--max-header-bytes", "10"),
    ],
)
def test_the_server_command_refuses_limits_that_cannot_work(tmp_path, capsys, option, value):
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    args = parser.parse_args(["--db", str(tmp_path / "s.db"), "--port", str(free_port()), option, value])
    assert run_server(args, out=io.StringIO()) == 2
    assert capsys.readouterr().err.startswith(f"fedfleet server: {option[2:].replace('-', '_')} ({option})")


@pytest.mark.parametrize(
    ("option", "value"), [("--rate-burst", "inf"), ("--rate-burst", "nan"), ("--nonce-ttl", "inf")]
)
def test_the_server_command_refuses_attestation_limits_that_are_no_numbers(tmp_path, capsys, option, value):
    # an infinite burst or a NaN would turn the check-in rate limit off without a word
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    argv = ["--db", str(tmp_path / "s.db"), "--port", str(free_port()), "--attestation-trust", str(tmp_path / "a.pem")]
    args = parser.parse_args([*argv, option, value])
    assert run_server(args, out=io.StringIO()) == 2
    assert capsys.readouterr().err.strip() == (
        "fedfleet server: --rate-burst must be a number >= 1, --rate-per-hour and --nonce-ttl positive numbers"
    )


def _few_descriptors() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


def test_the_server_command_with_256_descriptors_answers_health_while_300_slow_clients_crowd_it(tmp_path):
    """The tester's case, with the command's defaults: the cap stays under the descriptor limit
    and the crowd's longest idle give way, so ``accept`` never fails and health is answered."""
    crowd: list[socket.socket] = []
    with _command(tmp_path, preexec_fn=_few_descriptors) as (port, output):
        try:
            for _ in range(300):
                sock = socket.create_connection(("127.0.0.1", port))
                sock.sendall(b"GET /v1/health HTTP/1.1\r\n")
                crowd.append(sock)
            for _ in range(3):
                assert httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=HANG_S).json() == {"status": "ok"}
        finally:
            for sock in crowd:
                sock.close()
    assert "Traceback" not in output[1] and "out of system resource" not in output[1], output[1][-2000:]


def test_accepted_connections_send_without_waiting_for_the_clients_ack():
    """TCP_NODELAY on every accepted socket: an answer goes out as a head and a body, and with
    Nagle's algorithm the body waits for the client's delayed ACK (40 ms a request)."""
    from server_stub.http_guards import _Admission, _Listener

    listener = _Listener(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.admission = _Admission(4)
    with listener, socket.create_connection(_bound(listener)):
        conn, _ = listener.accept()
        with conn:
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1


def _bound(listener: socket.socket) -> tuple[str, int]:
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener.getsockname()


def test_a_port_the_system_picks_is_held_from_the_pick_until_the_server_is_done(tmp_path):
    """The port is bound when picked, not picked, released and bound again later: another server
    started between the two (tests run side by side) could take it."""
    store = ServerStore(tmp_path / "s.db")
    app = create_app(FLService(store), admin_keys=AdminKeys.generate()[0])
    server = GuardedServer(app, host="127.0.0.1", port=0)
    port = server.listen()
    assert port > 0 and server.listen() == port
    taker = socket.socket()
    with contextlib.closing(taker), pytest.raises(OSError):
        taker.bind(("127.0.0.1", port))
    server.close_listener()
    again = socket.socket()
    with contextlib.closing(again):
        again.bind(("127.0.0.1", port))
    store.close()


def test_a_request_in_flight_when_the_server_stops_is_answered_and_an_idle_connection_closed(tmp_path):
    """Stopping does not wait out a fixed pause for connections that are idle, but one whose request
    is under way (half its body in when the stop came) still gets its answer before the server goes."""
    server = ServerThread(tmp_path / "server.db").start()
    idle, busy = _connect(server), _connect(server)
    idle.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
    answered = b""
    while not answered.endswith(b'{"status":"ok"}'):
        answered += idle.recv(65536)
    assert answered.startswith(b"HTTP/1.1 200")
    body = b'{"runtime_version": "1.31.1"}'
    busy.sendall(
        b"POST /v1/populations/none/checkin HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:10])
    )
    stopping = threading.Thread(target=server.stop)
    stopping.start()
    assert _until_closed(idle) == b""  # closed by the stop, with nothing more said
    busy.sendall(body[10:])
    answer = _until_closed(busy)
    stopping.join(HANG_S)
    assert not stopping.is_alive()
    assert answer.startswith(b"HTTP/1.1 200") and b"NO_TASK" in answer, answer[:300]
