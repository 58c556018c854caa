"""Operator authentication end to end over HTTP, and the server command.

Every operator operation of the OpenAPI document refuses a request without the admin key (401
ADMIN_KEY_REQUIRED) or with any other credential (401 BAD_ADMIN_KEY), and changes nothing;
device operations need no admin key, and the admin key is no session token. A session token
reads only its own session's plan and checkpoint, and stops working once its session is gone."""

from __future__ import annotations

import argparse
import io
import os
import queue
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from device_runtime import PlanExecutor, encode_checkpoint, initial_weights
from emulator import AttestationAuthority
from server_stub import AdminClient, AdminKeyError, AdminKeys, RoundConfig, ServerThread, free_port, task_body
from server_stub.admin_auth import ADMIN_KEYS_ENV, MIN_KEY_CHARS
from server_stub.cli import add_server_arguments, listen_url, run_server
from tests.support import deploy, digits_plan, server_command_exit

REPO = Path(__file__).resolve().parents[2]
KEY = "operator-key-" + "k" * 32


def _code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


@pytest.fixture
def fleet(tmp_path):
    """A server with the population 'digits' (a softmax task) and 'other' (an MLP task)."""
    with ServerThread(tmp_path / "server.db", admin_key=KEY) as server, server.admin() as admin:
        deploy(admin, "digits", goal_count=1, min_fraction=1.0, over_selection=1.0)
        deploy(admin, "other", plan=digits_plan("mlp"))
        yield server, admin


def _operator_requests(document: dict) -> list[tuple[str, str, dict | None]]:
    """One well-formed request for every operator-only operation of the document."""
    plan = digits_plan()
    checkpoint = encode_checkpoint(initial_weights(plan, seed=0))
    bodies = {
        "/v1/populations": {"name": "new-population"},
        "/v1/populations/{population}/tasks": task_body("new-task", plan, checkpoint, RoundConfig(min_reports=1)),
        "/v1/populations/{population}/task-groups": {
            "tasks": [task_body("new-group-task", plan, checkpoint, RoundConfig(min_reports=1))]
        },
        "/v1/populations/{population}/tasks/{task}/stop": None,
    }
    requests = []
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if operation.get("security") == [{"adminKey": []}]:
                body = bodies[path] if method == "post" else None
                requests.append(
                    (method.upper(), path.replace("{population}", "digits").replace("{task}", "new-task"), body)
                )
    return requests


def test_every_operator_operation_refuses_a_missing_or_wrong_key(fleet):
    server, admin = fleet
    with httpx.Client(base_url=server.url, timeout=10) as http:
        session = http.post("/v1/populations/digits/checkin", json={"runtime_version": "1.31.1"}).json()
        requests = _operator_requests(http.get("/openapi.json").json())
        assert {(m, p) for m, p, _ in requests} == {
            ("GET", "/v1/populations"),
            ("POST", "/v1/populations"),
            ("GET", "/v1/populations/digits"),
            ("POST", "/v1/populations/digits/tasks"),
            ("POST", "/v1/populations/digits/task-groups"),
            ("POST", "/v1/populations/digits/tasks/new-task/stop"),
            ("GET", "/v1/populations/digits/rounds"),
            ("GET", "/v1/populations/digits/model"),
        }
        missing = [
            {},
            {"Authorization": "Bearer"},
            {"Authorization": f"Basic {KEY}"},
            {"Authorization": KEY},
            {"Authorization": "Bearer " + "k" * 600},
        ]
        wrong = [
            {"Authorization": "Bearer " + "x" * len(KEY)},
            {"Authorization": f"Bearer {KEY[:-1]}"},
            {"Authorization": f"Bearer {KEY}x"},
            {"Authorization": f"Bearer {session['token']}"},
        ]
        for method, path, body in requests:
            for headers, code in [(h, "ADMIN_KEY_REQUIRED") for h in missing] + [(h, "BAD_ADMIN_KEY") for h in wrong]:
                r = http.request(method, path, json=body, headers=headers)
                assert r.status_code == 401 and _code(r) == code, (method, path, headers, r.text)
            r = http.request(method, path, json=body, headers={"Authorization": f"bearer {KEY}"})
            assert r.status_code < 300, (method, path, r.text)  # the scheme is case-insensitive
    # The refused requests changed nothing; the accepted ones did.
    assert sorted(admin.populations()) == ["digits", "new-population", "other"]
    assert [t["name"] for t in admin.status("digits")["tasks"]] == ["train", "new-task", "new-group-task"]
    assert admin.status("digits")["tasks"][1]["status"] == "stopped"


def test_device_operations_need_no_admin_key_and_the_admin_key_is_no_session_token(fleet):
    server, _ = fleet
    with httpx.Client(base_url=server.url, timeout=10) as http:
        assert http.get("/v1/health").status_code == 200
        assert http.get("/v1/populations/digits/eligibility").json()["task"] == "train"
        session = http.post("/v1/populations/digits/checkin", json={"runtime_version": "1.31.1"}).json()
        assert session["status"] == "accepted"
        as_admin = {"Authorization": f"Bearer {KEY}"}
        sid = session["session_id"]
        for method, path, body in [
            ("POST", f"/v1/sessions/{sid}/report", {"content": b"x"}),
            ("POST", f"/v1/sessions/{sid}/abort", {"json": {"reason": "x"}}),
            ("GET", f"/v1/sessions/{sid}/secagg", {}),
            ("POST", f"/v1/sessions/{sid}/secagg", {"content": b"x"}),
        ]:
            r = http.request(method, path, headers=as_admin, **body)
            assert r.status_code == 401 and _code(r) == "BAD_SESSION_TOKEN", (method, path, r.text)
        # The session is untouched by those attempts: its own token still aborts it.
        r = http.post(
            f"/v1/sessions/{sid}/abort",
            json={"reason": "done"},
            headers={"Authorization": f"Bearer {session['token']}"},
        )
        assert r.json() == {"status": "aborted"}


def _update(plan, scale: float) -> bytes:
    spec = PlanExecutor(plan).client_update_spec()
    update = {name: np.full(shape, scale, dtype=dtype) for name, (shape, dtype) in spec.items()}
    update["num_examples"] = np.array(4, dtype=update["num_examples"].dtype)
    return encode_checkpoint(update)


def test_a_session_token_reads_only_its_own_sessions_resources(fleet):
    server, admin = fleet
    plan = digits_plan()
    with httpx.Client(base_url=server.url, timeout=10) as http:
        mine = http.post("/v1/populations/digits/checkin", json={"runtime_version": "1.31.1"}).json()
        theirs = http.post("/v1/populations/other/checkin", json={"runtime_version": "1.31.1"}).json()
        assert mine["plan_id"] != theirs["plan_id"] and mine["checkpoint_id"] != theirs["checkpoint_id"]
        token = {"Authorization": f"Bearer {mine['token']}"}
        for rid in (mine["plan_id"], mine["checkpoint_id"]):
            r = http.get(f"/v1/resources/{rid}", headers=token)
            assert r.status_code == 200
            assert r.content == admin.http.get(f"/v1/resources/{rid}").content
        for rid in (theirs["plan_id"], theirs["checkpoint_id"], "0" * 64, "not-an-id"):
            r = http.get(f"/v1/resources/{rid}", headers=token)
            assert r.status_code == 404 and _code(r) == "UNKNOWN_RESOURCE", (rid, r.text)
            assert admin.http.get(f"/v1/resources/{rid}").status_code == (200 if rid in theirs.values() else 404)
        r = http.get(f"/v1/resources/{mine['plan_id']}")
        assert r.status_code == 401 and _code(r) == "MISSING_TOKEN"
        r = http.get(f"/v1/resources/{mine['plan_id']}", headers={"Authorization": "Bearer " + "u" * 43})
        assert r.status_code == 401 and _code(r) == "BAD_SESSION_TOKEN"

        # Rounds of one device each: once its round is five rounds old, the session is gone and
        # its token reads nothing, not even the plan it once could.
        assert (
            http.post(
                f"/v1/sessions/{mine['session_id']}/report", content=_update(plan, 0.01), headers=token
            ).status_code
            == 200
        )
        later = []
        for n in range(2, 7):
            s = http.post("/v1/populations/digits/checkin", json={"runtime_version": "1.31.1"}).json()
            assert s["round"] == n, s
            later.append(s)
            auth = {"Authorization": f"Bearer {s['token']}"}
            assert (
                http.post(
                    f"/v1/sessions/{s['session_id']}/report", content=_update(plan, 0.01 * n), headers=auth
                ).status_code
                == 200
            )
        r = http.get(f"/v1/resources/{mine['plan_id']}", headers=token)
        assert r.status_code == 401 and _code(r) == "BAD_SESSION_TOKEN", r.text
        # A newer session does not read an older round's checkpoint.
        r = http.get(
            f"/v1/resources/{mine['checkpoint_id']}", headers={"Authorization": f"Bearer {later[-1]['token']}"}
        )
        assert r.status_code == 404 and _code(r) == "UNKNOWN_RESOURCE"
    assert [r["status"] for r in admin.rounds("digits")] == ["committed"] * 6


# ----------------------------------------------------------------------------- admin keys
def test_admin_keys_from_file_skip_comments_and_blank_lines(tmp_path):
    path = tmp_path / "keys"
    second = "second-key-" + "s" * 20
    path.write_text(
        f"# operators of the fleet\n\n  {KEY}  \n   # {second[:-1]} retired\n\t\n{second}\n", encoding="utf-8"
    )
    keys = AdminKeys.from_file(path)
    assert len(keys) == 2
    assert keys.verify(KEY) and keys.verify(second)
    assert not keys.verify(second[:-1]) and not keys.verify("# operators of the fleet") and not keys.verify("")
    assert not keys.verify(None)


@pytest.mark.parametrize(
    "text, message",
    [
        ("short\n", f"{MIN_KEY_CHARS}-"),
        (f"{KEY}\n{'x' * (MIN_KEY_CHARS - 1)}\n", f"{MIN_KEY_CHARS}-"),
        ("two words-" + "w" * 20 + "\n", "without spaces"),
        ("# only a comment\n\n", "no admin key"),
        ("", "no admin key"),
    ],
)
def test_admin_key_files_that_cannot_be_used_are_refused(tmp_path, text, message):
    path = tmp_path / "keys"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(AdminKeyError, match=message):
        AdminKeys.from_file(path)


def test_unreadable_admin_key_files_are_refused(tmp_path):
    with pytest.raises(AdminKeyError, match="cannot read"):
        AdminKeys.from_file(tmp_path / "missing")
    (tmp_path / "latin1").write_bytes(b"\xff" * 20)
    with pytest.raises(AdminKeyError, match="cannot read"):
        AdminKeys.from_file(tmp_path / "latin1")


def test_admin_keys_from_env():
    second = "second-key-" + "s" * 20
    assert AdminKeys.from_env({}) is None
    keys = AdminKeys.from_env({ADMIN_KEYS_ENV: f" {KEY}, {second}\n"})
    assert keys is not None and len(keys) == 2 and keys.verify(KEY) and keys.verify(second)
    with pytest.raises(AdminKeyError):
        AdminKeys.from_env({ADMIN_KEYS_ENV: ""})
    with pytest.raises(AdminKeyError):
        AdminKeys.from_env({ADMIN_KEYS_ENV: f"{KEY},short"})


def test_every_operator_client_shares_the_processs_one_tls_context():
    """Building a TLS context loads the CA bundle (about 60 ms of CPU): a process that opens many
    operator clients (a test suite, a notebook, the CLI) builds it once, as its devices do."""
    a, b = AdminClient("http://127.0.0.1:1", admin_key=KEY), AdminClient("https://127.0.0.1:1", admin_key=KEY)
    try:
        context = a.http._transport._pool._ssl_context
        assert context is b.http._transport._pool._ssl_context
        assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname  # still verifying
    finally:
        a.close()
        b.close()


# ----------------------------------------------------------------------------- the command
class _Server:
    """``python -m server_stub`` as a subprocess; its stdout is read by a thread, line by line."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop(ADMIN_KEYS_ENV, None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server_stub", *args],
            cwd=REPO,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def banner(self, timeout_s: float = 20.0) -> str:
        """What it printed up to the line naming its OpenAPI document."""
        deadline, seen = time.monotonic() + timeout_s, []
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            seen.append(line)
            if "OpenAPI:" in line:
                return "\n".join(seen)
        self.stop()
        raise AssertionError(
            f"the server printed no banner: {seen}; stderr: {self.proc.stderr.read() if self.proc.stderr else ''}"
        )

    def wait_healthy(self, url: str, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=1) as http:  # one client for every poll: each new one costs ~60 ms of CPU
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, f"the server exited with {self.proc.returncode}"
                try:
                    if http.get(f"{url}/v1/health").json() == {"status": "ok"}:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        raise AssertionError(f"{url} never answered /v1/health")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def _key_file(tmp_path: Path) -> Path:
    path = tmp_path / "admin.keys"
    path.write_text(f"# the operators' key\n\n{KEY}\n", encoding="utf-8")
    path.chmod(0o600)  # as an operator keeps it (a file others can read is warned of)
    return path


def test_the_command_serves_with_the_key_from_its_file(tmp_path):
    port, db = free_port(), tmp_path / "s.db"
    server = _Server("--db", str(db), "--port", str(port), "--admin-key-file", str(_key_file(tmp_path)))
    try:
        banner = server.banner()
        url = f"http://127.0.0.1:{port}"
        assert f"listening on {url}" in banner
        assert f"database:    {db}" in banner
        assert "attestation: off" in banner
        assert KEY not in banner  # a key from a file is never printed
        server.wait_healthy(url)
        r = httpx.post(f"{url}/v1/populations", json={"name": "digits"}, timeout=10)
        assert r.status_code == 401 and _code(r) == "ADMIN_KEY_REQUIRED"
        with AdminClient(url, admin_key=KEY, timeout_s=10) as admin:
            assert admin.create_population("digits") == {"name": "digits", "created": True}
            assert admin.populations() == ["digits"]
    finally:
        server.stop()
    assert db.exists()


def test_the_command_with_a_trust_anchor_admits_only_attested_devices(tmp_path):
    trust = tmp_path / "trust.json"
    AttestationAuthority.generate().save_trust_anchor(trust)
    port = free_port()
    server = _Server(
        "--db",
        str(tmp_path / "s.db"),
        "--port",
        str(port),
        "--admin-key-file",
        str(_key_file(tmp_path)),
        "--attestation-trust",
        str(trust),
    )
    try:
        banner = server.banner()
        assert "attestation: on" in banner and str(trust) in banner
        url = f"http://127.0.0.1:{port}"
        server.wait_healthy(url)
        with AdminClient(url, admin_key=KEY, timeout_s=10) as admin:
            admin.create_population("digits")
        r = httpx.post(f"{url}/v1/populations/digits/checkin", json={"runtime_version": "1.31.1"}, timeout=10)
        assert r.status_code == 401 and _code(r) == "ATTESTATION_REQUIRED"
        r = httpx.post(f"{url}/v1/attestation/nonce", timeout=10)
        assert r.status_code == 200 and r.json()["nonce"]
    finally:
        server.stop()


def _bad_trust_files(tmp_path: Path) -> dict[str, Path]:
    files = {
        "not json": "{",
        "not a trust anchor": '{"format": "something-else", "authorities": []}',
        "no authority": '{"format": "fedfleet-attestation-trust", "authorities": []}',
        "bad key": '{"format": "fedfleet-attestation-trust", "authorities": [{"key_id": "AA==", "public_key": "%%"}]}',
    }
    out = {}
    for name, text in files.items():
        out[name] = tmp_path / f"{name.replace(' ', '-')}.json"
        out[name].write_text(text, encoding="utf-8")
    return out


def _unusable(tmp_path: Path, problem: str) -> list[str]:
    """The server command's arguments with one unusable file or value."""
    keys = _key_file(tmp_path)
    args = ["--db", str(tmp_path / "s.db"), "--port", str(free_port()), "--admin-key-file", str(keys)]
    if problem == "short key":
        keys.write_text("short\n", encoding="utf-8")
    elif problem == "empty key file":
        keys.write_text("# nothing yet\n", encoding="utf-8")
    elif problem == "missing key file":
        keys.unlink()
    elif problem == "database in no folder":
        args[1] = str(tmp_path / "missing" / "s.db")
    elif problem == "database driver not installed":
        args[1] = "postgresql+pg8000://nohost/fl"  # a driver the project does not install
    elif problem == "port out of range":
        args[3] = "70000"
    elif problem == "host that is no address":
        args[3] = "0"  # the free port is looked for on the host
        args += ["--host", "999.1.1.1"]
    elif problem == "bad trust anchor":
        args += ["--attestation-trust", str(_bad_trust_files(tmp_path)["not json"])]
    elif problem == "key file that is a folder":
        args[5] = str(tmp_path)
    elif problem == "release trust that is a folder":
        args += ["--release-trust", str(tmp_path)]
    elif problem == "trust anchor that is a folder":
        args += ["--attestation-trust", str(tmp_path)]
    elif problem == "database that is a folder":
        args[1] = str(tmp_path)
    else:
        args += ["--attestation-trust", str(tmp_path / "nowhere.json")]
    return args


def _refused_in_one_line(code: int, out: str, err: str) -> None:
    assert code == 2, (out, err)
    assert err.startswith(("fedfleet server: ", "python -m server_stub: ")) and len(err.splitlines()) == 1, err
    assert "Traceback" not in err and "listening" not in out


@pytest.mark.parametrize(
    "command", [["-m", "server_stub"], ["-m", "emulator.cli", "server"]], ids=["server_stub", "fedfleet server"]
)
def test_the_command_refuses_an_unusable_key_file_with_status_2(tmp_path, command):
    """The real process, by both of its names: its exit status and its one line."""
    args = _unusable(tmp_path, "short key")
    done = subprocess.run([sys.executable, *command, *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    _refused_in_one_line(done.returncode, done.stdout, done.stderr)


@pytest.mark.parametrize(
    "problem",
    [
        "short key",
        "empty key file",
        "missing key file",
        "bad trust anchor",
        "missing trust anchor",
        "database in no folder",
        "database driver not installed",
        "port out of range",
        "host that is no address",
        "key file that is a folder",
        "release trust that is a folder",
        "trust anchor that is a folder",
        "database that is a folder",
    ],
)
def test_the_command_refuses_unusable_files_with_status_2(tmp_path, capsys, problem):
    """Each problem through the command's own ``main`` (the process around it is the test above);
    a folder where a file goes is named as one."""
    code = server_command_exit(_unusable(tmp_path, problem))
    captured = capsys.readouterr()
    _refused_in_one_line(code, captured.out, captured.err)
    if problem.endswith("that is a folder"):
        assert "is a folder" in captured.err and "give the" in captured.err and "Errno" not in captured.err


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["--db", "sqlite://s.db"], "--db sqlite://s.db is not a database URL SQLAlchemy takes (Invalid SQLite URL"),
        (
            ["--host", "http://127.0.0.1"],
            "--host http://127.0.0.1 is not an address to listen on; give the address alone (--host 127.0.0.1) and the port with --port",
        ),
        (["--host", "localhost:8000"], "give the address alone (--host localhost) and the port with --port"),
    ],
)
def test_a_url_where_a_path_or_an_address_goes_is_said_in_one_line(tmp_path, capsys, monkeypatch, given, said):
    """A SQLite URL with two slashes (SQLAlchemy's error spans five lines, with advice about damaged
    files), a server URL given to ``--host`` (which was looked up as a host name)."""
    monkeypatch.chdir(tmp_path)
    code = server_command_exit(["--db", "s.db", "--port", "0", "--admin-key-file", str(_key_file(tmp_path)), *given])
    captured = capsys.readouterr()
    _refused_in_one_line(code, captured.out, captured.err)
    assert said in captured.err and "damaged" not in captured.err


def test_the_url_a_server_listens_at_puts_an_ipv6_address_in_brackets():
    assert listen_url("::1", 8000) == "http://[::1]:8000"
    assert listen_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"


@pytest.mark.timeout(60)  # a command that served instead would fail here, not hang the run
def test_a_port_in_use_is_refused_before_the_server_says_it_listens(tmp_path, capsys):
    """Through the command's own ``run_server``, its output to a buffer of the test's (the process
    around it is the key-file test above)."""
    import socket

    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    out = io.StringIO()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        args = ["--db", str(tmp_path / "s.db"), "--port", str(port), "--admin-key-file", str(_key_file(tmp_path))]
        code = run_server(parser.parse_args(args), out=out)
    err = capsys.readouterr().err
    assert code == 2 and out.getvalue() == ""
    assert err.startswith(f"fedfleet server: cannot listen on 127.0.0.1:{port}") and "Traceback" not in err


def test_a_file_that_is_not_json_given_as_the_trust_anchor_says_what_to_give(tmp_path, capsys):
    """An admin key file given to --attestation-trust: not the JSON parser's "Expecting value"."""
    keys = _key_file(tmp_path)
    code = server_command_exit(
        ["--db", str(tmp_path / "s.db"), "--admin-key-file", str(keys), "--attestation-trust", str(keys)]
    )
    captured = capsys.readouterr()
    _refused_in_one_line(code, captured.out, captured.err)
    assert (
        "is not a trust anchor file (it is not JSON); give the trust anchor `fedfleet authority --trust FILE` wrote"
        in captured.err
    )
    assert "Expecting" not in captured.err


@pytest.mark.parametrize("name", ["not a trust anchor", "no authority", "bad key"])
def test_unusable_trust_anchors_are_refused_before_the_server_starts(tmp_path, name):
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    path = _bad_trust_files(tmp_path)[name]
    args = parser.parse_args(
        ["--db", str(tmp_path / "s.db"), "--admin-key-file", str(_key_file(tmp_path)), "--attestation-trust", str(path)]
    )
    out = io.StringIO()
    assert run_server(args, out=out) == 2
    assert out.getvalue() == ""


def test_an_unknown_task_filter_and_an_oversized_name_get_short_404s(server, admin):
    from tests.support import deploy

    deploy(admin)
    r = admin.http.get("/v1/populations/digits/rounds", params={"task": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "UNKNOWN_TASK"
    r = admin.http.get("/v1/populations/" + "x" * 10_000)
    assert r.status_code == 404 and len(r.json()["error"]["message"]) <= 500


def test_an_admin_key_the_http_layer_would_drop_is_refused_when_loaded():
    from server_stub import AdminKeyError, AdminKeys

    with pytest.raises(AdminKeyError):
        AdminKeys(["k" * 513])
    assert AdminKeys(["k" * 512]).verify("k" * 512)


@pytest.mark.parametrize("kind", ["plan", "checkpoint"])
@pytest.mark.timeout(60)
def test_a_stored_resource_changed_in_the_database_stops_the_server_in_one_line(tmp_path, capsys, kind):
    """A task's plan or model whose bytes no longer match their id (a storage fault, a hand
    edit) is never trained on: the server refuses to start, naming the database and what in it is
    damaged, instead of a traceback from the decoder (or, for a plan, a model built on other bytes)."""
    import sqlite3

    db = tmp_path / "s.db"
    with ServerThread(db) as server, server.admin() as admin:
        deploy(admin)
    with sqlite3.connect(db) as conn:
        rid, data = conn.execute(
            "SELECT id, data FROM resources WHERE kind = ? ORDER BY rowid LIMIT 1", (kind,)
        ).fetchone()
        conn.execute("UPDATE resources SET data = ? WHERE id = ?", (data[:-1] + bytes([data[-1] ^ 1]), rid))
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    out = io.StringIO()
    args = ["--db", str(db), "--port", "0", "--admin-key-file", str(_key_file(tmp_path)), "--allow-untested-plans"]
    code = run_server(parser.parse_args(args), out=out)
    err = capsys.readouterr().err
    assert code == 2 and out.getvalue() == ""
    assert (
        err
        == f"fedfleet server: the database {db} is damaged: its {kind} {rid} no longer matches its id (SHA-256); restore the database from a backup\n"
    )


@pytest.mark.timeout(60)  # a command that served instead would fail here, not hang the run
@pytest.mark.parametrize("given", [["--rate-burst", "50"], ["--nonce-ttl", "30", "--rate-per-hour", "nan"]])
def test_attestation_limits_without_a_trust_anchor_are_refused_not_ignored(tmp_path, capsys, given):
    """The check-in limits apply to attested devices only: a server started with them and no
    ``--attestation-trust`` would run without the limits its operator asked for, and say nothing."""
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    out = io.StringIO()
    args = parser.parse_args(["--db", str(tmp_path / "s.db"), "--admin-key-file", str(_key_file(tmp_path)), *given])
    assert run_server(args, out=out) == 2 and out.getvalue() == ""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--attestation-trust FILE" in err
    assert all(flag in err for flag in given if flag.startswith("--"))
    assert not (tmp_path / "s.db").exists()  # refused before anything was opened


def _slow_deploys(monkeypatch, seconds: float) -> None:
    """The server takes ``seconds`` to check each task of a deploy, as it does a large model's."""
    from server_stub import deploy as deploy_module

    checked = deploy_module.validate_task

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return checked(*args, **kwargs)

    monkeypatch.setattr(deploy_module, "validate_task", slow)


def test_a_deploy_waits_for_its_answer_as_long_as_the_server_takes_to_check_its_size(server, monkeypatch):
    """A server checks a deploy at some megabytes a second (a DistilBERT's in 100 s): the client
    waits its timeout plus a second per DEPLOY_CHECK_BYTES_PER_S, where its 30 s alone said the
    server did not answer while it went on and took the deploy. Scaled down here: 0.3 s of
    timeout, a checking that takes 0.6 s, and a pace that gives this deploy seconds more."""
    from server_stub import admin_client

    plan = digits_plan()
    checkpoint = encode_checkpoint(initial_weights(plan))
    _slow_deploys(monkeypatch, 0.6)
    monkeypatch.setattr(admin_client, "DEPLOY_CHECK_BYTES_PER_S", len(checkpoint) // 4, raising=False)
    with server.admin() as operator:  # only the deploy is timed short: a loaded machine may take 0.3 s for the rest
        operator.create_population("slow")
    with server.admin(timeout_s=0.3) as admin:
        assert admin.deploy_task("slow", "v1", plan, checkpoint, RoundConfig(min_reports=1))["status"] == "active"


def test_a_deploy_not_answered_in_time_says_it_may_have_been_taken(server, monkeypatch):
    from server_stub import ServerUnreachable, admin_client

    plan = digits_plan()
    _slow_deploys(monkeypatch, 0.6)
    monkeypatch.setattr(admin_client, "DEPLOY_CHECK_BYTES_PER_S", 1 << 40, raising=False)
    with server.admin() as operator:
        operator.create_population("slower")
    with server.admin(timeout_s=0.2) as admin:
        with pytest.raises(ServerUnreachable) as err:
            admin.deploy_task(
                "slower", "v1", plan, encode_checkpoint(initial_weights(plan)), RoundConfig(min_reports=1)
            )
    message = str(err.value)
    assert "did not answer the deploy within 0.2 s" in message and "fedfleet status" in message


def test_a_deploy_that_reaches_no_server_says_so_in_the_timeout_not_that_it_may_have_been_taken():
    """A server whose queue of connections is full (or a host that drops them) takes no deploy: the
    client waited the deploy's whole allowance (minutes for a large model) and then said the server
    might still be checking it."""
    from server_stub import ServerUnreachable

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        waiting = []
        for _ in range(4):  # fill the queue: the kernel drops the next connection's SYNs
            pending = socket.socket()
            pending.setblocking(False)
            pending.connect_ex(("127.0.0.1", port))
            waiting.append(pending)
        try:
            with AdminClient(f"http://127.0.0.1:{port}", admin_key="k" * 32, timeout_s=0.3) as admin:
                started = time.monotonic()
                with pytest.raises(ServerUnreachable) as err:
                    admin.deploy_task("p", "v1", digits_plan(), b"\0" * (4 << 20), RoundConfig(min_reports=1))
                took = time.monotonic() - started
        finally:
            for pending in waiting:
                pending.close()
    assert "no answer from the server" in str(err.value) and "may still be checking" not in str(err.value)
    assert took < 2.0  # the 0.3 s timeout, not 0.3 s + 5.6 MB of JSON at a second a MiB
