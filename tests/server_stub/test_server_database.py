"""The server's database as an operator meets it: one server per database file, a database of a
layout this server does not know refused in one line, one from before the layout was recorded
opened as it is, a database file deleted or replaced under a running server said in its health
check and log, a server listening beyond loopback in plain HTTP said so, and the log lines an
operator reads."""

from __future__ import annotations

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

from device_runtime import encode_checkpoint, initial_weights, serialize_plan
from server_stub import AdminError, FLService, RoundConfig, ServerStore, ServerThread
from server_stub.persistence import SCHEMA_VERSION, DatabaseInUse, NewTask, StoreLayoutError
from tests.server_stub.test_operators import KEY, REPO, _key_file, _Server
from tests.server_stub.test_round_history import ONE_DEVICE, _one_round, _service, _update
from tests.server_stub.test_round_integrity import QuickToGiveUp, moving_updates
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


def test_a_database_of_a_server_before_the_rounds_indexes_opens_gets_them_and_pages_through_them(tmp_path):
    """A file an older server wrote (its rounds table without indexes) keeps its rounds, is given
    the indexes when it opens, and a page of ``GET /rounds`` and the check before a round's write
    read them instead of scanning every round (SQLite's plan names the index)."""
    db = tmp_path / "fl.db"
    store = ServerStore(db)
    store.create_population("digits")
    plan = digits_plan()
    ckpt = encode_checkpoint(initial_weights(plan, seed=0))
    (task,) = store.add_tasks("digits", [NewTask("train", serialize_plan(plan), ckpt, {"round": {}})])
    for n in range(1, 6):
        store.record_round(task.id, n, 1, "abandoned", {"selected": 0}, float(n), float(n) + 0.5)
    store.close()
    with sqlite3.connect(db) as conn:  # as the server wrote it before the indexes
        names = conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'rounds'").fetchall()
        assert len(names) == 2
        for (name,) in names:
            conn.execute(f"DROP INDEX {name}")
        assert _scans_rounds(conn)
    store = ServerStore(db)
    try:
        page, more = store.round_page([task.id], last=2, before=store.rounds(task.id)[-1].id)
        assert [r.number for r in page] == [3, 4] and more
        assert store.schema_version() == SCHEMA_VERSION
    finally:
        store.close()
    with sqlite3.connect(db) as conn:
        assert not _scans_rounds(conn)


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
    plan, start = server.deploy()
    updates, _ = moving_updates(plan, start, seed=3)
    sessions = server.checkin(5)
    for session, update in zip(sessions[:4], updates[:4]):
        server.report(session, update)
    holder = sqlite3.connect(server.path, timeout=0.1, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with caplog.at_level(logging.ERROR, logger="server_stub.commit"):
            assert server.report(sessions[4], updates[4]).round_status == "abandoned"
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    failures = [r.getMessage() for r in caplog.records if "database write failed" in r.getMessage()]
    assert failures
    for line in failures:
        assert "\n" not in line and "sqlalche.me" not in line, line
        assert "database is locked; another process holds it locked: retry later" in line, line


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
