"""What a stranger learns or costs the server through the device endpoints: uploads are authorized
and bounded before their bodies are read, session ids and population names cannot be probed, an
aborted session's token opens nothing more, and an admin key file others can read is warned of."""

from __future__ import annotations

import json
import logging
import select
import socket

import httpx
import numpy as np
import onnxruntime
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg import Round, SecAggClient, SecAggConfig, SecAggError, SecAggServer
from server_stub import AdminKeys
from server_stub.secagg_limits import largest_client_message, secagg_upload_limit
from tests.support import deploy, digits_plan

VERSION = onnxruntime.__version__
HANG_S = 15.0
#: What the tester sent: 60 MB, declared and never sent.
HUGE = 60_000_000


def _checkin(http: httpx.Client, population: str = "digits") -> dict:
    answer = http.post(f"/v1/populations/{population}/checkin", json={"runtime_version": VERSION}).json()
    assert answer["status"] == "accepted", answer
    return answer


def _upload_head(server, path: str, token: str, length: int = HUGE) -> tuple[int, str]:
    """Declare a body of ``length`` bytes, send none of it, and read the answer: the status and
    error code the server gives before reading a byte."""
    with socket.create_connection((server.host, server.port)) as sock:
        sock.settimeout(HANG_S)
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: fl\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {length}\r\n\r\n".encode()
        )
        received = b""
        try:
            while b"\r\n\r\n" not in received or len(received.partition(b"\r\n\r\n")[2]) < _length(received):
                chunk = sock.recv(65536)
                assert chunk, f"the server closed {path} without an answer"
                received += chunk
        except TimeoutError:
            raise AssertionError(f"no answer to {path} within {HANG_S} s: the server waits for the body") from None
    head, _, body = received.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]["code"]


def _length(raw: bytes) -> int:
    for line in raw.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_an_upload_is_authorized_and_bounded_before_its_body_is_read(server, admin):
    deploy(admin, goal_count=3, over_selection=1.0, report_timeout_s=60, selection_timeout_s=60)
    with httpx.Client(base_url=server.url, timeout=HANG_S) as http:
        mine, theirs = _checkin(http), _checkin(http)
    sid, token = mine["session_id"], mine["token"]
    for endpoint in ("secagg", "report"):
        assert _upload_head(server, f"/v1/sessions/{sid}/{endpoint}", theirs["token"]) == (401, "BAD_SESSION_TOKEN")
        assert _upload_head(server, f"/v1/sessions/no-such-session/{endpoint}", "x") == (401, "BAD_SESSION_TOKEN")
        assert _upload_head(server, f"/v1/sessions/{sid}/{endpoint}", token) == (413, "BODY_TOO_LARGE")


def test_secure_aggregation_calls_for_a_task_without_it_say_so_while_its_round_is_open(server, admin):
    """A plain task's session is in no group: its poll answered {"status": "closed"} and its message
    SESSION_CLOSED ("this session's round is over") while the round it reports to was open."""
    deploy(admin, goal_count=3, over_selection=1.0, report_timeout_s=60, selection_timeout_s=60)
    with httpx.Client(base_url=server.url, timeout=HANG_S) as http:
        mine = _checkin(http)
        path, auth = f"/v1/sessions/{mine['session_id']}/secagg", {"Authorization": f"Bearer {mine['token']}"}
        for answer in (http.get(path, headers=auth), http.post(path, content=b"\x01", headers=auth)):
            assert answer.status_code == 409, answer.text
            assert answer.json()["error"]["code"] == "NOT_IN_GROUP", answer.text
            assert "does not run Secure Aggregation" in answer.json()["error"]["message"]


def _answer(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the answer on ``sock``."""
    received = b""
    while b"\r\n\r\n" not in received or len(received.partition(b"\r\n\r\n")[2]) < _length(received):
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection without an answer"
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def test_a_sessions_newer_upload_drops_the_one_still_arriving(server, admin):
    """Every upload of a session's token was read in full and held: one selected device that
    opened 800 uploads of its report, all of each body but its last byte, held 800 bodies (70 MB
    of the server's memory for a 68 KB update) and as many connections, each for 30 s plus a second
    per KiB it had sent. Now a newer upload of the session drops the one still arriving, 409
    ``UPLOAD_SUPERSEDED``: a session holds one body, and the last one sent is taken."""
    from device_runtime import PlanExecutor, encode_checkpoint

    plan, _ = deploy(admin, goal_count=3, over_selection=1.0, report_timeout_s=60, selection_timeout_s=60)
    with httpx.Client(base_url=server.url, timeout=HANG_S) as http:
        mine = _checkin(http)
    spec = PlanExecutor(plan).client_update_spec()
    update = encode_checkpoint({name: np.zeros(shape, dtype) for name, (shape, dtype) in spec.items()})
    head = (
        f"POST /v1/sessions/{mine['session_id']}/report HTTP/1.1\r\nHost: fl\r\n"
        f"Authorization: Bearer {mine['token']}\r\nContent-Length: {len(update)}\r\n\r\n"
    ).encode()
    uploads = [socket.create_connection((server.host, server.port)) for _ in range(5)]
    try:
        for sock in uploads:
            sock.settimeout(HANG_S)
            sock.sendall(head + update[:-1])
        # whichever the server saw last is the newest: the others are answered without their last byte
        answered: dict[socket.socket, tuple[int, dict]] = {}
        while len(answered) < len(uploads) - 1:
            ready, _, _ = select.select([s for s in uploads if s not in answered], [], [], HANG_S)
            assert ready, f"{len(answered)} of {len(uploads) - 1} older uploads answered within {HANG_S} s"
            for sock in ready:
                answered[sock] = _answer(sock)
        assert {(status, body["error"]["code"]) for status, body in answered.values()} == {(409, "UPLOAD_SUPERSEDED")}
        [newest] = [sock for sock in uploads if sock not in answered]
        newest.sendall(update[-1:])
        status, body = _answer(newest)
        assert status == 200 and body["status"] == "accepted", body
    finally:
        for sock in uploads:
            sock.close()
    assert admin.status("digits")["current_round"]["reported"] == 1


def test_a_secagg_message_is_bounded_by_what_its_group_can_need(server, admin):
    plan = digits_plan("softmax", secure_aggregation=True)
    deploy(
        admin,
        plan=plan,
        goal_count=5,
        over_selection=1.0,
        selection_timeout_s=60,
        report_timeout_s=60,
        secagg_min_group_size=5,
        secagg_round_timeout_s=5.0,
    )
    with httpx.Client(base_url=server.url, timeout=HANG_S) as http:
        sessions = [_checkin(http) for _ in range(5)]  # the round is full: one group of 5 forms
        auth = {"Authorization": f"Bearer {sessions[0]['token']}"}
        state = http.get(f"/v1/sessions/{sessions[0]['session_id']}/secagg", headers=auth).json()
    assert state["status"] == "active" and state["group_size"] == 5
    config = state["config"]
    limit = secagg_upload_limit(5, config["vector_length"], config["modulus"])
    assert limit >= config["vector_length"] * 4  # room for the masked input
    path = f"/v1/sessions/{sessions[0]['session_id']}/secagg"
    assert _upload_head(server, path, sessions[0]["token"], limit + 1) == (413, "BODY_TOO_LARGE")


def test_a_sessions_newer_long_poll_drops_the_one_waiting(server, admin):
    """A session's long polls of its Secure Aggregation state were each held up to 10 s, any
    number of them: one device held a connection per poll. Now a newer poll of the session drops
    the one waiting, 409 ``POLL_SUPERSEDED`` (a device polls one at a time), and the newest is
    answered when the state moves on."""
    deploy(
        admin,
        plan=digits_plan("softmax", secure_aggregation=True),
        goal_count=3,
        over_selection=1.0,
        selection_timeout_s=60,
        report_timeout_s=60,
        secagg_min_group_size=3,
    )
    with httpx.Client(base_url=server.url, timeout=HANG_S) as http:
        mine = _checkin(http)
        head = (
            f"GET /v1/sessions/{mine['session_id']}/secagg?after=-1&wait=10 HTTP/1.1\r\nHost: fl\r\n"
            f"Authorization: Bearer {mine['token']}\r\n\r\n"
        ).encode()
        polls = [socket.create_connection((server.host, server.port)) for _ in range(5)]
        try:
            for sock in polls:
                sock.settimeout(HANG_S)
                sock.sendall(head)
            # whichever the server held last is the newest: the others are answered at once
            answered: dict[socket.socket, tuple[int, dict]] = {}
            while len(answered) < len(polls) - 1:
                ready, _, _ = select.select([s for s in polls if s not in answered], [], [], HANG_S)
                assert ready, f"{len(answered)} of {len(polls) - 1} older polls answered within {HANG_S} s"
                for sock in ready:
                    answered[sock] = _answer(sock)
            codes = {(status, body["error"]["code"]) for status, body in answered.values()}
            assert codes == {(409, "POLL_SUPERSEDED")}
            [newest] = [sock for sock in polls if sock not in answered]
            _checkin(http), _checkin(http)  # the round is full: the group forms, the state moves on
            status, body = _answer(newest)
            assert status == 200 and body["status"] == "active", body
        finally:
            for sock in polls:
                sock.close()


def _run_recording_sizes(
    config: SecAggConfig, inputs: dict[int, np.ndarray], drops: dict[Round, set[int]]
) -> list[int]:
    """One SecAgg instance (as ``secagg.run_protocol``), returning every client message's size."""
    server = SecAggServer(config, inputs.keys())
    clients = {u: SecAggClient(u, config, x) for u, x in inputs.items()}
    sizes: list[int] = []
    gone: set[int] = set()
    outbox: dict[int, bytes | None] = {u: c.start() for u, c in clients.items()}
    while not server.round.terminal:
        gone |= drops.get(server.round, set())
        for u, data in outbox.items():
            if data is not None and u not in gone:
                sizes.append(len(data))
                try:
                    server.receive(u, data)
                except SecAggError:
                    pass
        incoming = server.close_round()
        outbox = {u: clients[u].handle(data) for u, data in incoming.items() if u not in gone}
    return sizes


@settings(max_examples=25, deadline=None)
@given(n=st.integers(3, 8), vector_length=st.integers(1, 300), bitwidth=st.integers(1, 24), data=st.data())
def test_no_message_of_an_honest_device_exceeds_its_groups_bound(n, vector_length, bitwidth, data):
    config = SecAggConfig.for_cohort(n, vector_length, bitwidth=bitwidth, consistency_check=True)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    inputs = {u: rng.integers(0, 2**bitwidth, vector_length, dtype=np.uint64) for u in range(1, n + 1)}
    dropped = data.draw(st.sets(st.integers(1, n), max_size=max(0, n - config.threshold)), label="dropped")
    at = data.draw(st.sampled_from([Round.SHARE_KEYS, Round.MASKED_INPUT_COLLECTION, Round.UNMASKING]), label="at")
    sizes = _run_recording_sizes(config, inputs, {at: dropped})
    assert sizes and max(sizes) <= largest_client_message(n, vector_length, config.modulus)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    endpoint=st.sampled_from([("POST", "report"), ("POST", "abort"), ("GET", "secagg"), ("POST", "secagg")]),
    known=st.booleans(),
    other_id=st.from_regex(r"[A-Za-z0-9_-]{1,40}", fullmatch=True),
    token=st.one_of(st.from_regex(r"[!-~]{1,60}", fullmatch=True), st.just("other session's")),
)
def test_an_unknown_session_and_a_wrong_token_get_the_same_answer(probed, endpoint, known, other_id, token):
    server, mine, theirs = probed
    sid = mine["session_id"] if known else other_id
    if token == "other session's":
        token = theirs["token"]
    if sid == mine["session_id"] and token == mine["token"]:
        return
    method, name = endpoint
    body = {"json": {"reason": "probe"}} if name == "abort" else {"content": b"x"} if method == "POST" else {}
    r = httpx.request(
        method,
        f"{server.url}/v1/sessions/{sid}/{name}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=HANG_S,
        **body,
    )
    assert (r.status_code, r.json()["error"]["code"]) == (401, "BAD_SESSION_TOKEN"), (sid, token, r.text)


@pytest.fixture
def probed(server, admin):
    deploy(admin, goal_count=3, over_selection=1.0, report_timeout_s=600, selection_timeout_s=600)
    with httpx.Client(base_url=server.url, timeout=HANG_S) as http:
        return server, _checkin(http), _checkin(http)


def test_an_unknown_population_is_answered_as_one_with_no_task(server, admin):
    admin.create_population("idle")
    deploy(admin)
    with httpx.Client(base_url=server.url, timeout=HANG_S) as http:
        idle_info = http.get("/v1/populations/idle/eligibility")
        idle_checkin = http.post("/v1/populations/idle/checkin", json={"runtime_version": VERSION})
        assert idle_info.json() == {"task": None}
        assert idle_checkin.json()["reason"] == "NO_TASK"
        for name in ("nope", "digits2", "a" * 128):
            info = http.get(f"/v1/populations/{name}/eligibility")
            assert (info.status_code, info.json()) == (idle_info.status_code, idle_info.json())
            answer = http.post(f"/v1/populations/{name}/checkin", json={"runtime_version": VERSION})
            assert (answer.status_code, answer.json()) == (idle_checkin.status_code, idle_checkin.json())
        assert http.get("/v1/populations/digits/eligibility").json()["task"] == "train"
    # Operators still see what exists.
    r = admin.http.get("/v1/populations/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "UNKNOWN_POPULATION"
    assert sorted(admin.populations()) == ["digits", "idle"]


def test_an_aborted_sessions_token_opens_nothing_more_and_the_abort_is_counted(server, admin):
    deploy(admin, goal_count=3, over_selection=1.0, report_timeout_s=600, selection_timeout_s=600)
    with httpx.Client(base_url=server.url, timeout=HANG_S) as http:
        mine, other = _checkin(http), _checkin(http)
        auth = {"Authorization": f"Bearer {mine['token']}"}
        sid = mine["session_id"]
        assert http.get(f"/v1/resources/{mine['plan_id']}", headers=auth).status_code == 200
        r = http.post(f"/v1/sessions/{sid}/abort", json={"reason": "battery", "stats": {"shape": "-v[!"}}, headers=auth)
        assert r.json() == {"status": "aborted"}
        for rid in (mine["plan_id"], mine["checkpoint_id"]):
            r = http.get(f"/v1/resources/{rid}", headers=auth)
            assert r.status_code == 401 and r.json()["error"]["code"] == "BAD_SESSION_TOKEN", (rid, r.status_code)
        for method, path in (("POST", "report"), ("GET", "secagg"), ("POST", "secagg")):
            r = http.request(
                method, f"/v1/sessions/{sid}/{path}", headers=auth, content=b"x" if method == "POST" else None
            )
            assert r.status_code == 409 and r.json()["error"]["code"] == "SESSION_CLOSED", (path, r.text)
        assert http.post(f"/v1/sessions/{sid}/abort", json={"reason": "again"}, headers=auth).json() == {
            "status": "ignored"
        }
        # The other session is untouched.
        assert (
            http.get(
                f"/v1/resources/{other['plan_id']}", headers={"Authorization": f"Bearer {other['token']}"}
            ).status_code
            == 200
        )
    current = admin.status("digits")["current_round"]
    assert current["aborted"] == 1 and current["shapes"] == {"-v[!": 1}


@pytest.mark.parametrize("mode, warned", [(0o600, False), (0o400, False), (0o640, True), (0o644, True), (0o606, True)])
def test_an_admin_key_file_other_users_can_open_is_used_with_a_warning(tmp_path, caplog, mode, warned):
    path = tmp_path / "admin.keys"
    path.write_text("k" * 32 + "\n", encoding="utf-8")
    path.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="server_stub.admin_auth"):
        keys = AdminKeys.from_file(path)
    assert keys.verify("k" * 32)
    messages = [r.getMessage() for r in caplog.records if r.name == "server_stub.admin_auth"]
    if warned:
        assert len(messages) == 1 and str(path) in messages[0] and f"chmod 600 {path}" in messages[0], messages
    else:
        assert messages == []
