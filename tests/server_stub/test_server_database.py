"""The server's database as an operator meets it: one server per database file, a database of a
layout this server does not know refused in one line, one from before the layout was recorded
opened as it is, and a server listening beyond loopback in plain HTTP said so."""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from server_stub import ServerStore
from server_stub.persistence import SCHEMA_VERSION, DatabaseInUse, StoreLayoutError
from tests.server_stub.test_operators import REPO, _key_file, _Server
from tests.server_stub.test_round_integrity import QuickToGiveUp, moving_updates
from tests.support import server_command_exit


def _refused(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("fedfleet server: ")
    for word in words:
        assert word in err, err


@pytest.mark.timeout(60)
def test_a_second_server_on_one_database_is_refused_and_the_first_ones_kill_frees_it(tmp_path, capsys):
    """Two processes: the second would run the first's rounds again beside it. The lock goes with
    the process however it ends (SIGKILL here), so a restart after a crash is not refused."""
    db, keys = tmp_path / "fl.db", _key_file(tmp_path)
    first = _Server("--db", str(db), "--port", "0", "--admin-key-file", str(keys))
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
    finally:
        first.stop()
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


@pytest.mark.timeout(60)
def test_a_server_listening_beyond_loopback_warns_that_it_speaks_plain_http(tmp_path):
    server = _Server(
        "--db",
        str(tmp_path / "fl.db"),
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--admin-key-file",
        str(_key_file(tmp_path)),
    )
    try:
        server.banner()
    finally:
        server.proc.terminate()
        server.proc.wait(timeout=10)
        err = server.proc.stderr.read() if server.proc.stderr else ""
        server.stop()
    assert "warning: listening on 0.0.0.0 in plain HTTP" in err and "TLS proxy" in err, err


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
