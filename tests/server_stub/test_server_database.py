"""The server's database as an operator meets it: one server per database file, a database of a
layout this server does not know refused in one line, one from before the layout was recorded
opened as it is, a database file deleted or replaced under a running server said in its health
check and log, a server listening beyond loopback in plain HTTP said so, and the log lines an
operator reads."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from device_runtime import encode_checkpoint, initial_weights, serialize_plan
from server_stub import AdminError, FLService, RoundConfig, ServerStore, ServerThread, persistence
from server_stub.deploy import TaskSpec
from server_stub.persistence import (
    SCHEMA_VERSION,
    DatabaseInUse,
    NewTask,
    StoreLayoutError,
    resource_id,
    store_advice,
)
from server_stub.release_gate import REPORT_FORMAT
from tests.dying_server import killed_at_statement
from tests.server_stub.test_operators import KEY, REPO, _key_file, _Server
from tests.server_stub.test_round_history import ONE_DEVICE, _one_round, _service, _update
from tests.server_stub.test_round_integrity import QuickToGiveUp
from tests.support import admin_key_file, digits_plan, server_command_exit


def _refused(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("fedfleet server: ")
    for word in words:
        assert word in err, err


@pytest.mark.timeout(60)
def test_a_second_server_on_one_database_is_refused_and_the_first_ones_kill_frees_it(tmp_path, capsys):
    """Two processes: the second would run the first's rounds again beside it. The lock goes with
    the process however it ends (SIGKILL here), so a restart after a crash is not refused. The
    first, bound beyond loopback, also says that it speaks plain HTTP there (one process fewer)."""
    db, keys = tmp_path / "fl.db", _key_file(tmp_path)
    # bound beyond loopback: it says in its first line that it speaks plain HTTP there
    first = _Server("--db", str(db), "--host", "0.0.0.0", "--port", "0", "--admin-key-file", str(keys))
    try:
        first.banner()
        done = subprocess.run(
            [sys.executable, "-m", "server_stub", "--db", str(db), "--port", "0", "--admin-key-file", str(keys)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
        _refused(done.returncode, done.stderr, "in use by another server", f"pid {first.proc.pid}", "fl.db.lock")
        assert "listening" not in done.stdout
        # the same in this process, through the command's main
        _refused(
            server_command_exit(["--db", str(db), "--port", "0", "--admin-key-file", str(keys)]),
            capsys.readouterr().err,
        )
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(timeout=10)
        warned = first.proc.stderr.read() if first.proc.stderr else ""
    finally:
        first.stop()
    assert "warning: listening on 0.0.0.0 in plain HTTP" in warned and "TLS proxy" in warned, warned
    store = ServerStore(db)
    try:
        store.hold()  # free again
        again = ServerStore(db)
        with pytest.raises(DatabaseInUse):
            again.hold()
        again.close()
    finally:
        store.close()
    reopened = ServerStore(db)  # closing released it
    reopened.hold()
    reopened.close()


def test_the_server_refuses_in_one_line_a_database_written_by_a_newer_server(tmp_path, capsys):
    db = tmp_path / "fl.db"
    ServerStore(db).close()
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE schema SET version = ?", (SCHEMA_VERSION + 1,))
    with pytest.raises(StoreLayoutError):
        ServerStore(db)
    code = server_command_exit(["--db", str(db), "--port", "0", "--admin-key-file", str(_key_file(tmp_path))])
    _refused(code, capsys.readouterr().err, f"layout {SCHEMA_VERSION + 1}", "newer server")


def test_the_server_refuses_in_one_line_tables_of_its_names_it_cannot_read(tmp_path, capsys):
    db = tmp_path / "fl.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE rounds (id INTEGER PRIMARY KEY, task_id INTEGER)")
    code = server_command_exit(["--db", str(db), "--port", "0", "--admin-key-file", str(_key_file(tmp_path))])
    _refused(code, capsys.readouterr().err, "table rounds has no column number")


def test_a_database_from_before_the_layout_was_recorded_opens_with_its_rounds_and_is_stamped(tmp_path):
    db = tmp_path / "fl.db"
    store = ServerStore(db)
    store.create_population("digits")
    store.close()
    with sqlite3.connect(db) as conn:
        conn.execute("DROP TABLE schema")  # as every server wrote it before the layout was recorded
    store = ServerStore(db)
    try:
        assert store.population_names() == ["digits"] and store.schema_version() == SCHEMA_VERSION
    finally:
        store.close()


#: The tables of layout 1, as a server of that layout made them (before the rounds' indexes, and
#: before ``pruned_rounds``), and its stamp.
LAYOUT_1 = """
CREATE TABLE schema (id INTEGER NOT NULL, version INTEGER NOT NULL, PRIMARY KEY (id));
CREATE TABLE populations (id INTEGER NOT NULL, name VARCHAR(128) NOT NULL, created_at FLOAT NOT NULL,
    PRIMARY KEY (id), UNIQUE (name));
CREATE TABLE resources (id VARCHAR(64) NOT NULL, kind VARCHAR(16) NOT NULL, data BLOB NOT NULL,
    created_at FLOAT NOT NULL, PRIMARY KEY (id));
CREATE TABLE tasks (id INTEGER NOT NULL, population_id INTEGER NOT NULL, name VARCHAR(128) NOT NULL,
    plan_id VARCHAR(64) NOT NULL, initial_checkpoint_id VARCHAR(64) NOT NULL, config TEXT NOT NULL,
    status VARCHAR(16) NOT NULL, created_at FLOAT NOT NULL, PRIMARY KEY (id), UNIQUE (population_id, name),
    FOREIGN KEY(population_id) REFERENCES populations (id), FOREIGN KEY(plan_id) REFERENCES resources (id),
    FOREIGN KEY(initial_checkpoint_id) REFERENCES resources (id));
CREATE TABLE rounds (id INTEGER NOT NULL, task_id INTEGER NOT NULL, number INTEGER NOT NULL,
    attempt INTEGER NOT NULL, status VARCHAR(16) NOT NULL, checkpoint_id VARCHAR(64), metrics TEXT NOT NULL,
    started_at FLOAT NOT NULL, ended_at FLOAT NOT NULL, PRIMARY KEY (id), FOREIGN KEY(task_id) REFERENCES tasks (id),
    FOREIGN KEY(checkpoint_id) REFERENCES resources (id));
INSERT INTO schema VALUES (1, 1);
"""


def _layout_1(db: Path) -> list[bytes]:
    """A database of layout 1 with a task and its rounds 1-3 committed (and an abandoned attempt
    of round 2), written as a server of that layout wrote it; the task's models, initial first."""
    plan = digits_plan()
    models = [encode_checkpoint(initial_weights(plan, seed=seed)) for seed in range(4)]
    config = '{"round": {"goal_count": 1, "over_selection": 1.0, "min_reports": 1}, "eligibility": {}}'
    with sqlite3.connect(db) as conn:
        conn.executescript(LAYOUT_1)
        conn.execute("INSERT INTO populations VALUES (1, 'digits', 1.0)")
        for data, kind in [(serialize_plan(plan), "plan"), *((m, "checkpoint") for m in models)]:
            conn.execute("INSERT INTO resources VALUES (?, ?, ?, 1.0)", (hashlib.sha256(data).hexdigest(), kind, data))
        ids = [hashlib.sha256(m).hexdigest() for m in models]
        plan_id = hashlib.sha256(serialize_plan(plan)).hexdigest()
        conn.execute("INSERT INTO tasks VALUES (1, 1, 'train', ?, ?, ?, 'active', 1.0)", (plan_id, ids[0], config))
        for rid, (number, attempt, status, model) in enumerate(
            [
                (1, 1, "committed", ids[1]),
                (2, 1, "abandoned", None),
                (2, 2, "committed", ids[2]),
                (3, 1, "committed", ids[3]),
            ],
            start=1,
        ):
            conn.execute(
                "INSERT INTO rounds VALUES (?, 1, ?, ?, ?, ?, '{\"selected\": 1}', ?, ?)",
                (rid, number, attempt, status, model, float(rid), rid + 0.5),
            )
        assert _scans_rounds(conn)
    return models


def test_a_database_of_layout_1_is_upgraded_in_place_and_goes_on_from_its_last_round(tmp_path):
    """The rounds' indexes and the tables of pruned and removed rounds and of the sessions of committed
    rounds are added, the stamp says layout 4 and every row is as it was: a server started on it
    goes on with round 4 from round 3's model, and a page of ``GET /rounds`` reads the index
    instead of scanning every round."""
    db = tmp_path / "fl.db"
    models = _layout_1(db)
    with sqlite3.connect(db) as conn:
        rows = {t: conn.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in ("populations", "tasks", "rounds")}
    store = ServerStore(db)
    try:
        assert store.schema_version() == SCHEMA_VERSION == 4
        service = FLService(store)
        [task] = service.population_status("digits")["active_tasks"]
        assert (task["round"], task["committed_rounds"]) == (4, 3)
        assert service.current_model("digits")[:2] == (models[3], 3)
        page, more = store.round_page([1], last=2)
        assert [(r.number, r.attempt) for r in page] == [(2, 2), (3, 1)] and more
    finally:
        store.close()
    with sqlite3.connect(db) as conn:
        assert not _scans_rounds(conn)
        # deleting a model (retention, fedfleet prune) looks its rounds up (the foreign key's check) by index
        plan = " ".join(
            str(r[-1]) for r in conn.execute("EXPLAIN QUERY PLAN SELECT 1 FROM rounds WHERE checkpoint_id = 'x'")
        )
        assert "USING COVERING INDEX rounds_by_checkpoint" in plan, plan
        assert conn.execute("SELECT count(*) FROM pruned_rounds").fetchone() == (0,)
        for table, before in rows.items():
            assert conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall() == before


def test_an_upgrade_that_fails_leaves_the_database_as_it_was(tmp_path, monkeypatch):
    """A migration that fails half way (here after its first step) changes nothing: the upgrade is
    one transaction, and the next start upgrades the file whole."""
    db = tmp_path / "fl.db"
    _layout_1(db)

    def half(conn) -> None:
        persistence.pruned_rounds.create(conn)
        raise OSError(28, "No space left on device")

    monkeypatch.setitem(persistence.MIGRATIONS, 1, half)
    with pytest.raises(OSError):
        ServerStore(db)
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT version FROM schema").fetchone() == (1,)
        assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'pruned_rounds'").fetchone() is None
    monkeypatch.undo()
    store = ServerStore(db)
    try:
        assert store.schema_version() == SCHEMA_VERSION == 4 and len(store.rounds(1)) == 4
    finally:
        store.close()


def test_a_database_another_server_runs_on_is_refused_before_it_is_upgraded(tmp_path, capsys):
    """A newer server started on the file an older one serves is refused as a second server is,
    and leaves the file in the layout the running server knows."""
    db = tmp_path / "fl.db"
    _layout_1(db)
    lock = os.open(f"{db}.lock", os.O_RDWR | os.O_CREAT, 0o644)  # the running server's hold
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(lock, b"4242\n")
        code = server_command_exit(["--db", str(db), "--port", "0", "--admin-key-file", str(_key_file(tmp_path))])
        _refused(code, capsys.readouterr().err, "in use by another server (pid 4242")
    finally:
        os.close(lock)
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT version FROM schema").fetchone() == (1,)
        assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'pruned_rounds'").fetchone() is None


def test_a_database_locked_by_another_process_is_refused_when_it_opens_not_at_its_first_write(tmp_path):
    """A server opens its database in a transaction that takes the write lock: one held by another
    process past the busy timeout fails there, saying to retry, rather than at the first round."""
    db = tmp_path / "fl.db"
    ServerStore(db).close()
    holder = sqlite3.connect(db, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(OperationalError) as refused:
            ServerStore(db, busy_timeout_s=0.1)
        assert "another process holds it locked: retry later" in store_advice(refused.value)
    finally:
        holder.close()
    ServerStore(db, busy_timeout_s=0.1).close()


def test_a_file_that_is_not_sqlite_is_refused_in_one_line_and_left_as_it_is(tmp_path, capsys):
    db = tmp_path / "fl.db"
    db.write_bytes(b"these are an operator's notes, not a database" * 100)
    code = server_command_exit(["--db", str(db), "--port", "0", "--admin-key-file", str(_key_file(tmp_path))])
    _refused(code, capsys.readouterr().err, "not an SQLite database")
    assert db.read_bytes() == b"these are an operator's notes, not a database" * 100


def _two_tasks() -> list[NewTask]:
    plan = digits_plan()
    return [
        NewTask(name, serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=i)), {"round": {}})
        for i, name in enumerate(["a", "b"])
    ]


def _own_mounts() -> bool:
    """Whether this machine lets a process mount file systems of its own (a user and mount
    namespace, no root needed): a read-only bind mount refuses writes to root too, and a tiny tmpfs
    fills up."""
    try:
        return subprocess.run(["unshare", "-Urm", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_is_said_as_one_and_what_to_do(tmp_path):
    """The operating system's ENOSPC (the lock file beside the database on a full disk; /dev/full
    gives the same error) is said as a full disk, not as a damaged or locked file."""
    with pytest.raises(OSError) as full, open("/dev/full", "wb") as device:
        device.write(b"x")
        device.flush()
    assert store_advice(full.value) == (
        "No space left on device; the disk is full: free space and retry (nothing of the failed write was kept)"
    )


@pytest.mark.slow  # a tmpfs of its own (unshare); the error it says: the test above
@pytest.mark.skipif(not _own_mounts(), reason="needs unshare -Urm (user and mount namespaces)")
def test_a_server_started_on_a_full_disk_says_so_in_one_line(tmp_path):
    """A database on a full file system (a 256 KiB tmpfs filled up), new or already there."""
    mount, keys = tmp_path / "disk", _key_file(tmp_path)
    mount.mkdir()
    db = mount / "fl.db"
    for existing in (False, True):
        script = (
            f'mount -t tmpfs -o size=256k tmpfs "{mount}" && '
            + (
                f'"{sys.executable}" -c "from server_stub import ServerStore; ServerStore(\'{db}\').close()" && '
                if existing
                else ""
            )
            + f'(dd if=/dev/zero of="{mount}/filler" bs=4k 2>/dev/null; true) && '
            f'exec "{sys.executable}" -m server_stub --db "{db}" --port 0 --admin-key-file "{keys}"'
        )
        done = subprocess.run(
            ["unshare", "-Urm", "sh", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        _refused(done.returncode, done.stderr, "the disk is full: free space and retry")


def _stopped_at_the_task_row(db: Path, how: str, deploy: str) -> None:
    """Run ``deploy`` (Python, with ``store``, a ``ServerStore`` on ``db`` with the population
    "digits") stopped once its first task's row is written: killed (SIGKILL, in a process of its
    own), or failed in this process (the write refused as on a full disk). Then the database holds
    no task and no resource."""
    store = ServerStore(db)
    store.create_population("digits")
    if how == "killed":
        store.close()
        done = killed_at_statement(db, "INSERT INTO tasks", deploy)
        assert done.returncode == -9, done.stderr
    else:

        def refuse(conn, cursor, statement, *args) -> None:
            if statement.startswith("INSERT INTO tasks"):
                raise OSError(28, "No space left on device")

        event.listen(store.engine, "after_cursor_execute", refuse)
        with pytest.raises(OSError):
            exec(deploy, {"store": store})
        store.close()
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM tasks").fetchone() == (0,)
        assert conn.execute("SELECT kind FROM resources").fetchall() == []


# killed (SIGKILL, a process of its own: -m slow), or failed in this process (the write refused)
@pytest.mark.parametrize("how", [pytest.param("killed", marks=pytest.mark.slow), "failed"])
def test_a_deploy_killed_or_failed_leaves_nothing_of_it_and_can_be_made_again(tmp_path, how):
    """A deploy of two tasks stores both with their plans and models in one transaction: stopped
    once the first task's row is written, the database has neither task, and no plan or model of
    them."""
    db = tmp_path / "fl.db"
    _stopped_at_the_task_row(
        db,
        how,
        "from tests.server_stub.test_server_database import _two_tasks\nstore.add_tasks('digits', _two_tasks())",
    )
    store = ServerStore(db)
    try:
        assert FLService(store).population_status("digits")["active_tasks"] == []
        assert [t.name for t in store.add_tasks("digits", _two_tasks())] == ["a", "b"]
    finally:
        store.close()


def _released_task() -> TaskSpec:
    """A task deployed with a versioned plan and its release report (unsigned: the server neither
    requires reports nor trusts a signer), which the deploy stores as resources its config names."""
    plan = digits_plan()
    data = serialize_plan(plan)

    def result(runtime: str) -> dict:
        return {
            "runtime": runtime,
            "plan_sha256": resource_id(data),
            "passed": True,
            "checks": [{"name": "loads", "passed": True, "detail": ""}],
        }

    report = {
        "format": REPORT_FORMAT,
        "task": "a",
        "plan_sha256": resource_id(data),
        "claimed": ["1.31.1"],
        "reference": result("host"),
        "results": {"1.31.1": result("1.31.1")},
    }
    checkpoint = encode_checkpoint(initial_weights(plan, seed=0))
    return TaskSpec("a", data, checkpoint, versioned_plans={"1.31.1": data}, release_report=report)


@pytest.mark.parametrize("how", [pytest.param("killed", marks=pytest.mark.slow), "failed"])
def test_a_deploy_with_a_release_killed_or_failed_leaves_no_resource_and_can_be_made_again(tmp_path, how):
    """A deploy's versioned plans and release report are stored in its task's transaction:
    stopped as the task's row is written, the database keeps no resource that nothing names (a
    restart would find them named by nothing, and nothing would remove them), and the same deploy
    made again stores the task with its release."""
    db = tmp_path / "fl.db"
    _stopped_at_the_task_row(
        db,
        how,
        "from server_stub import FLService\n"
        "from tests.server_stub.test_server_database import _released_task\n"
        "FLService(store).deploy('digits', [_released_task()])",
    )
    store = ServerStore(db)
    try:
        (task,), stored = FLService(store).deploy("digits", [_released_task()])
        assert stored and store.resource(task.config["release"]["report_id"])
        assert all(store.resource(rid) for rid in task.config["versions"].values())
    finally:
        store.close()


@pytest.mark.skipif(not _own_mounts(), reason="needs unshare -Urm (user and mount namespaces)")
@pytest.mark.timeout(60)
def test_a_read_only_database_is_refused_in_one_line_before_the_server_serves(tmp_path):
    """A database on a read-only file system (a bind mount remounted read-only): the server said it
    listened, then failed every deploy and round; it refuses to start, saying the file is read-only."""
    db = tmp_path / "fl.db"
    ServerStore(db).close()
    keys = _key_file(tmp_path)
    script = (
        f'mount --bind "{db}" "{db}" && mount -o remount,bind,ro "{db}" && '
        f'exec "{sys.executable}" -m server_stub --db "{db}" --port 0 --admin-key-file "{keys}"'
    )
    done = subprocess.run(["unshare", "-Urm", "sh", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=30)
    _refused(done.returncode, done.stderr, "read-only", str(db))
    assert "listening" not in done.stdout


def _scans_rounds(conn: sqlite3.Connection) -> bool:
    """Whether SQLite would read a page of a task's rounds, or look a round up by its number, by
    scanning the whole rounds table."""
    queries = (
        "SELECT id FROM rounds WHERE task_id IN (1) ORDER BY started_at DESC, task_id DESC, number DESC, "
        "attempt DESC, id DESC LIMIT 100",
        "SELECT id FROM rounds WHERE task_id = 1 AND number = 3 AND attempt = 1 ORDER BY id LIMIT 1",
    )
    plans = [" ".join(str(row[-1]) for row in conn.execute(f"EXPLAIN QUERY PLAN {q}")) for q in queries]
    return any("SCAN rounds" in plan and "USING" not in plan for plan in plans)


def test_a_loopback_server_gives_no_plain_http_warning():
    from server_stub.cli import _loopback

    assert all(map(_loopback, ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"]))
    assert not any(map(_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.org"]))


def test_the_lock_file_sits_beside_the_database(tmp_path):
    store = ServerStore(tmp_path / "fl.db")
    try:
        store.hold()
        assert Path(f"{tmp_path / 'fl.db'}.lock").read_text().strip() == str(os.getpid())
    finally:
        store.close()


def test_a_failed_database_write_is_logged_in_one_line_saying_what_to_do(tmp_path, caplog):
    """SQLAlchemy's error text runs over two lines (a link to its docs): a server's log line says
    SQLite's reason and what to do, once per line."""
    server = QuickToGiveUp(tmp_path / "s.db")
    _, _, updates, _, last = server.four_of_five_reported(seed=3)
    with server.locked_by_another_process(), caplog.at_level(logging.ERROR, logger="server_stub.commit"):
        assert server.report(last, updates[4]).round_status == "abandoned"
    failures = [r.getMessage() for r in caplog.records if "database write failed" in r.getMessage()]
    assert failures
    for line in failures:
        assert "\n" not in line and "sqlalche.me" not in line, line
        assert "database is locked; another process holds it locked: retry later" in line, line


def test_a_request_the_database_refuses_is_a_503_saying_to_retry_and_one_log_line(tmp_path, caplog):
    """A write the database refuses (here a lock another process holds past the busy timeout; a
    full disk is the same error) is not a server fault: 503 ``DATABASE_UNAVAILABLE``, nothing kept,
    and one log line with SQLite's reason and what to do, where it was a 500 ``INTERNAL`` and two
    tracebacks. The same request goes through once the database takes writes again."""
    db = tmp_path / "fl.db"
    with ServerThread(db, busy_timeout_s=0.1) as server:
        headers = {"Authorization": f"Bearer {server.admin_key}"}
        holder = sqlite3.connect(db, isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")
            with caplog.at_level(logging.ERROR):
                answer = httpx.post(f"{server.url}/v1/populations", json={"name": "p"}, headers=headers)
        finally:
            holder.close()
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "DATABASE_UNAVAILABLE", answer.text
        assert answer.headers["Retry-After"] == "30"  # for a client other than the SDK, which retries any 5xx
        [line] = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert line.exc_info is None and "\n" not in line.getMessage()
        assert "POST /v1/populations: the database refused it: database is locked; another process" in line.getMessage()
        again = httpx.post(f"{server.url}/v1/populations", json={"name": "p"}, headers=headers)
        assert (again.status_code, again.json()) == (201, {"name": "p", "created": True})


def test_the_log_names_each_rounds_population_and_why_a_round_was_abandoned(tmp_path, caplog):
    """Task names are a population's own: two populations' task ``t`` were one name in the log; and
    an abandoned round said its metrics but not that too few devices had reported."""
    service, clock = _service(tmp_path / "server.db")
    plan = digits_plan()
    service.create_population("p")
    service.deploy_task(
        "p", "t", serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), RoundConfig(**ONE_DEVICE)
    )
    with caplog.at_level(logging.INFO, logger="server_stub.commit"):
        for _ in range(8):  # nobody checks in: the selection times out
            clock.advance(2.5)
            service.tick()
        _one_round(service, clock, _update(plan))
    said = [r.getMessage() for r in caplog.records if r.name == "server_stub.commit"]
    assert any(m.startswith("task p/t abandoned round 1 (attempt 1): 0 report(s) of the 1 it needs") for m in said), (
        said
    )
    assert any(m.startswith("task p/t committed round 1:") for m in said), said


def test_the_banner_says_where_each_populations_tasks_go_on_from(tmp_path):
    """After a restart, an upgrade or a restored backup the operator reads which round and model
    the server continues with before any device comes."""
    from server_stub.cli import _rounds_lines

    service, clock = _service(tmp_path / "server.db")
    assert _rounds_lines(service) == ["no population yet"]
    plan = digits_plan()
    service.create_population("p")
    service.create_population("idle")
    service.deploy_task(
        "p", "t", serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), RoundConfig(**ONE_DEVICE)
    )
    _one_round(service, clock, _update(plan))
    service.store.close()
    again = FLService(ServerStore(tmp_path / "server.db"))
    try:
        model = again.population_status("p")["checkpoint_id"]
        assert _rounds_lines(again) == [f"p: t round 2 (1 committed, model {model[:12]})", "idle: no active task"]
    finally:
        again.store.close()


def _health_until(server: ServerThread, status: int) -> httpx.Response:
    """The health check's answer once it is ``status`` (the ticker looks at the file every tick)."""
    with httpx.Client(timeout=5) as http:
        for _ in range(400):
            answer = http.get(f"{server.url}/v1/health")
            if answer.status_code == status:
                return answer
            time.sleep(0.025)
    raise AssertionError(f"the health check never answered {status}: {answer.status_code} {answer.text}")


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_database_deleted_or_replaced_under_a_running_server_fails_its_health_check_and_is_logged(
    tmp_path, caplog, how
):
    """SQLite writes on into the file it opened: a server whose file was deleted said ok to every
    request and lost everything at its stop (and one whose file was replaced, by a restored backup
    say, wrote past it)."""
    db = tmp_path / "fl.db"
    with caplog.at_level(logging.ERROR, logger="server_stub.service"), ServerThread(db) as server:
        assert _health_until(server, 200).json() == {"status": "ok"}
        with server.admin() as admin:
            admin.create_population("digits")
        if how == "deleted":
            for path in tmp_path.glob("fl.db*"):
                path.unlink()
        else:
            copy = tmp_path / "copy.db"
            copy.write_bytes(db.read_bytes())
            copy.replace(db)
        answer = _health_until(server, 503)
        assert answer.json()["error"]["code"] == "DATABASE_GONE"
        assert (
            f"was {'deleted' if how == 'deleted' else 'replaced by another file'}" in answer.json()["error"]["message"]
        )
    said = [
        r.getMessage() for r in caplog.records if "was deleted" in r.getMessage() or "was replaced" in r.getMessage()
    ]
    assert len(said) == 1 and "put the database (or its latest backup) back" in said[0], said


@pytest.mark.timeout(60)
def test_sighup_reads_the_admin_key_file_again_without_a_restart(tmp_path):
    """Rotating a key: the new one added to the file and the old one removed, then SIGHUP; a file
    that cannot be used then keeps the keys in use, so a typo locks nobody out."""
    keys = _key_file(tmp_path)
    server = _Server("--db", str(tmp_path / "fl.db"), "--port", "0", "--admin-key-file", str(keys))
    new_key = "rotated-key-" + "n" * 32
    try:
        url = server.banner().splitlines()[0].rsplit(" ", 1)[1]

        def answers(key: str) -> int:
            return httpx.get(f"{url}/v1/populations", headers={"Authorization": f"Bearer {key}"}, timeout=5).status_code

        def after_hangup(key: str, status: int) -> None:
            server.proc.send_signal(signal.SIGHUP)
            for _ in range(400):
                if answers(key) == status:
                    return
                time.sleep(0.025)
            raise AssertionError(f"{key} never got {status}")

        assert answers(KEY) == 200 and answers(new_key) == 401
        keys.write_text(f"{new_key}\n", encoding="utf-8")
        after_hangup(new_key, 200)
        assert answers(KEY) == 401
        keys.write_text("", encoding="utf-8")  # a mistake: no key at all
        server.proc.send_signal(signal.SIGHUP)
        keys.write_text("short\n", encoding="utf-8")
        after_hangup(new_key, 200)  # still the keys in use
        assert server.proc.poll() is None
    finally:
        server.proc.terminate()
        server.proc.wait(timeout=10)
        err = server.proc.stderr.read() if server.proc.stderr else ""
        server.stop()
    assert "SIGHUP: 1 admin key(s) read again" in err and "SIGHUP: the admin keys in use are kept" in err, err
    assert KEY not in err and new_key not in err


@settings(max_examples=25, deadline=None)
@given(
    records=st.lists(
        st.tuples(st.integers(1, 4), st.integers(1, 3), st.sampled_from(["committed", "abandoned"])), max_size=12
    )
)
def test_the_last_committed_round_is_the_last_committed_one_of_the_history(tmp_path_factory, records):
    """Read by one query (the model an operator fetches), it is the round the whole history names,
    records written in any order (a record kept in memory is written after later rounds')."""
    store = ServerStore(tmp_path_factory.mktemp("last") / "fl.db")
    try:
        store.create_population("p")
        plan = digits_plan()
        (task,) = store.add_tasks(
            "p", [NewTask("t", serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), {})]
        )
        for number, attempt, status in records:
            store.record_round(task.id, number, attempt, status, {}, 0.0, 1.0)
        committed = [r for r in store.rounds(task.id) if r.status == "committed"]
        assert store.last_committed_round(task.id) == (committed[-1] if committed else None)
    finally:
        store.close()


def test_the_newest_rounds_are_read_alone_over_http_and_by_fedfleet_rounds(tmp_path, capsys):
    """A long run's history is 2 KB a round; an operator who wants the latest asks for them."""
    from emulator.cli import commands as cli

    plan = digits_plan()
    with ServerThread(tmp_path / "fl.db") as server, server.admin() as admin:
        service = server.service
        admin.create_population("p")
        admin.deploy_task("p", "t", plan, encode_checkpoint(initial_weights(plan, seed=0)), RoundConfig(**ONE_DEVICE))
        store, task_id = service.store, service.store.tasks("p")[0].id
        for number in range(1, 8):  # seven rounds on record, as a running server writes them
            store.record_round(task_id, number, 1, "abandoned", {"selected": 0}, float(number), number + 0.5)
        every = admin.rounds("p")
        assert [r["round"] for r in every] == list(range(1, 8))
        assert admin.rounds("p", last=3) == every[-3:] and admin.rounds("p", "t", last=100) == every
        with pytest.raises(AdminError) as refused:
            admin.rounds("p", last=0)
        assert refused.value.code == "BAD_QUERY"
        key = admin_key_file(tmp_path / "admin.key", server.admin_key)
        common = ["--server", server.url, "--population", "p", "--admin-key-file", str(key)]
        assert cli.main(["rounds", *common, "--last", "2"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [line.split()[1] for line in lines[1:-1]] == ["6", "7"] and "--before" in lines[-1], lines
        with pytest.raises(SystemExit) as exit_:
            cli.main(["rounds", *common, "--last", "0"])
        assert exit_.value.code == 2 and "give a number of rounds from 1 to 1000" in capsys.readouterr().err
