"""``fedfleet server backup`` and ``restore`` as an operator runs them: a backup taken while a real
server commits rounds holds a consistent snapshot a server starts on, and every mistake (a missing
or foreign file, the database itself as the backup, an existing file, a folder that cannot be
written, a database a server holds) is refused in one line with exit status 2."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from device_runtime import PlanExecutor, encode_checkpoint, initial_weights
from emulator.cli import commands as cli
from server_stub import RoundConfig, ServerStore, ServerThread
from server_stub.persistence import DatabaseInUse
from tests.support import digits_plan

REPO = Path(__file__).resolve().parents[2]
ONE_DEVICE = dict(goal_count=1, over_selection=1.0, min_reports=1, selection_timeout_s=60, report_timeout_s=60)


def _update(plan) -> bytes:
    spec = PlanExecutor(plan).client_update_spec()
    update = {name: np.full(shape, 0.01, dtype=dtype) for name, (shape, dtype) in spec.items()}
    update["num_examples"] = np.array(4, dtype=update["num_examples"].dtype)
    return encode_checkpoint(update)


def _reporting(url: str, update: bytes, stop: threading.Event, reported: list[int]) -> None:
    """One device after another checks in and reports, until ``stop``; each accepted report's round
    number goes to ``reported``."""
    with httpx.Client(base_url=url, timeout=10) as http:
        while not stop.is_set():
            answer = http.post("/v1/populations/digits/checkin", json={"runtime_version": "1.31.1"}).json()
            if answer["status"] != "accepted":
                time.sleep(0.01)
                continue
            r = http.post(
                f"/v1/sessions/{answer['session_id']}/report",
                content=update,
                headers={"Authorization": f"Bearer {answer['token']}"},
            )
            assert r.status_code == 200, r.text
            reported.append(answer["round"])


def _command(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["server", *args])
    said = capsys.readouterr()
    return code, said.out, said.err


def _refused(capsys, *args: str) -> str:
    code, out, err = _command(capsys, *args)
    assert code == 2 and not out, (code, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"fedfleet server {args[0]}: "), err
    return err


def _committed(admin) -> list[int]:
    return [r["round"] for r in admin.rounds("digits") if r["status"] == "committed"]


@pytest.mark.timeout(120)
def test_a_backup_taken_while_the_server_commits_rounds_starts_a_server_with_its_rounds(tmp_path, capsys):
    db, out = tmp_path / "fl.db", tmp_path / "fl-backup.db"
    plan = digits_plan()
    with ServerThread(db) as server, server.admin() as admin:
        admin.create_population("digits")
        admin.deploy_task(
            "digits", "train", plan, encode_checkpoint(initial_weights(plan, seed=0)), RoundConfig(**ONE_DEVICE)
        )
        stop, reported = threading.Event(), []
        devices = threading.Thread(target=_reporting, args=(server.url, _update(plan), stop, reported), daemon=True)
        devices.start()
        try:
            deadline = time.monotonic() + 60
            while len(_committed(admin)) < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            before = _committed(admin)
            code, said, err = _command(capsys, "backup", "--db", str(db), "--out", str(out))
            after = _committed(admin)
            while len(_committed(admin)) < len(after) + 2 and time.monotonic() < deadline:
                time.sleep(0.02)  # the server went on committing rounds during and after the backup
        finally:
            stop.set()
            devices.join(30)
        assert code == 0, err
        served = admin.rounds("digits")
    assert len(before) >= 3 and len(served) >= len(after) + 2
    assert said.startswith(f"backed up {db} to {out}: 1 population(s), 1 task(s), ") and "integrity check ok" in said
    assert not Path(f"{out}-wal").exists()  # one self-contained file
    with sqlite3.connect(out) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    conn.close()

    with ServerThread(out) as restarted, restarted.admin() as admin:
        kept = admin.rounds("digits")
        status = admin.status("digits")
    # a snapshot: every round committed before it began, then none but a prefix of what followed
    assert before == [r["round"] for r in kept][: len(before)]
    assert len(kept) <= len(after) and kept == served[: len(kept)]
    assert f" {len(kept)} round record(s)" in said
    assert (status["round"], status["committed_rounds"]) == (len(kept) + 1, len(kept))


def test_backup_mistakes_are_refused_in_one_line(tmp_path, capsys):
    db, out = tmp_path / "fl.db", tmp_path / "fl-backup.db"
    ServerStore(db).close()
    assert "does not exist" in _refused(capsys, "backup", "--db", str(tmp_path / "nope.db"), "--out", str(out))
    text = tmp_path / "notes.txt"
    text.write_text("not a database\n" * 100)
    assert "is not a server database" in _refused(capsys, "backup", "--db", str(text), "--out", str(out))
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    err = _refused(capsys, "backup", "--db", str(other), "--out", str(out))
    assert "is not a server database (it has no table populations" in err
    assert "the database itself" in _refused(capsys, "backup", "--db", str(db), "--out", f"{tmp_path}/./fl.db")
    assert "does not exist" in _refused(capsys, "backup", "--db", str(db), "--out", str(tmp_path / "no" / "b.db"))
    assert "is a folder" in _refused(capsys, "backup", "--db", str(db), "--out", str(tmp_path))
    assert not out.exists() and not list(tmp_path.glob("*.part"))

    assert _command(capsys, "backup", "--db", str(db), "--out", str(out))[0] == 0
    out.write_bytes(b"an earlier backup")
    assert "--force" in _refused(capsys, "backup", "--db", str(db), "--out", str(out))
    assert out.read_bytes() == b"an earlier backup"
    assert _command(capsys, "backup", "--db", str(db), "--out", str(out), "--force")[0] == 0
    assert out.read_bytes()[:16] == b"SQLite format 3\x00"
    held = ServerStore(out, hold=True)  # a server runs on it: --force does not pull it from under it
    try:
        err = _refused(capsys, "backup", "--db", str(db), "--out", str(out), "--force")
        assert f"in use by another server (pid {os.getpid()}" in err
    finally:
        held.close()


def test_restore_is_refused_while_a_server_holds_the_database_and_then_puts_the_backup_in_place(tmp_path, capsys):
    db, backup = tmp_path / "fl.db", tmp_path / "fl-backup.db"
    plan = digits_plan()
    with ServerThread(db) as server, server.admin() as admin:
        admin.create_population("digits")
        admin.deploy_task(
            "digits", "train", plan, encode_checkpoint(initial_weights(plan, seed=0)), RoundConfig(**ONE_DEVICE)
        )
    assert _command(capsys, "backup", "--db", str(db), "--out", str(backup))[0] == 0
    with ServerThread(db) as server, server.admin() as admin:
        admin.create_population("later")  # what the backup does not have
    running = ServerStore(db, hold=True)  # as fedfleet server holds it
    try:
        err = _refused(capsys, "restore", "--backup", str(backup), "--db", str(db))
        assert "in use by another server" in err and "stop it before restoring" in err
    finally:
        running.close()
    Path(f"{db}-wal").write_bytes(b"\x37\x7f\x06\x82" + bytes(60))  # a journal left by the replaced file
    code, said, err = _command(capsys, "restore", "--backup", str(backup), "--db", str(db))
    assert code == 0, err
    assert said.startswith(f"restored {db} from {backup}: 1 population(s), 1 task(s)")
    assert not Path(f"{db}-wal").exists()
    with ServerThread(db) as server, server.admin() as admin:
        assert admin.populations() == ["digits"] and admin.status("digits")["active_task"] == "train"
    assert "the database itself" in _refused(capsys, "restore", "--backup", str(db), "--db", str(db))
    err = _refused(capsys, "restore", "--backup", str(tmp_path / "nope.db"), "--db", str(db))
    assert "--backup" in err and "does not exist" in err
    new = tmp_path / "new.db"  # a file that is no backup, onto a database not there yet: nothing made
    assert "is not a server database" in _refused(capsys, "restore", "--backup", __file__, "--db", str(new))
    assert not list(tmp_path.glob("new.db*"))


def _own_mounts() -> bool:
    try:
        return subprocess.run(["unshare", "-Urm", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow  # a process of its own in a mount namespace; the light twin: the missing folder above
@pytest.mark.skipif(not _own_mounts(), reason="needs unshare -Urm (user and mount namespaces)")
def test_a_backup_into_a_folder_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    """A folder on a read-only file system (a bind mount remounted read-only refuses root too)."""
    db, folder = tmp_path / "fl.db", tmp_path / "backups"
    ServerStore(db).close()
    folder.mkdir()
    script = (
        f'mount --bind "{folder}" "{folder}" && mount -o remount,bind,ro "{folder}" && '
        f'exec "{sys.executable}" -m server_stub backup --db "{db}" --out "{folder}/fl-backup.db"'
    )
    done = subprocess.run(["unshare", "-Urm", "sh", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "read-only" in done.stderr, done.stderr
    assert done.stderr.startswith("fedfleet server backup: cannot write in "), done.stderr
    assert not list(folder.iterdir())


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["bakup"], "fedfleet server: bakup is not a command (did you mean backup?): fedfleet server backup|restore"),
        (["backup", "--db", "fl.db"], "fedfleet server backup: the following arguments are required: --out"),
        (
            ["backup", "--bd", "fl.db", "--out", "b.db"],
            "fedfleet server backup: unrecognized arguments: --bd (did you mean --db?)",
        ),
        (
            ["--out", "b.db"],
            "fedfleet server: unrecognized arguments: --out (--out is an option of fedfleet server backup",
        ),
        (["--port", "99999"], "fedfleet server: argument --port: 99999 is not a port"),
        (
            ["--db", "fl.db", "backup", "--out", "b.db"],
            "fedfleet server backup: the following arguments are required: --db (--db came before backup: put it "
            "after backup); see fedfleet server backup --help",
        ),
        (
            ["--db=fl.db", "retire", "--population", "p", "--task", "t"],
            "fedfleet server retire: the following arguments are required: --db (--db came before retire: put it "
            "after retire)",
        ),
    ],
)
def test_a_server_command_mistake_is_one_line(argv, said, capsys):
    """``fedfleet server`` runs without a command and has commands: a mistaken one is named as a
    command, the value of an option it does not take is not mistaken for one."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["server", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and said in err, err


def test_the_options_of_running_the_server_given_before_another_command_are_refused(tmp_path, capsys):
    """``fedfleet server --keep-rounds 3 backup ...`` parses ``--keep-rounds`` as the server's option:
    backup would go on without it, as if it had been read."""
    db = tmp_path / "fl.db"
    ServerStore(str(db)).close()
    argv = ["--keep-rounds", "3", "--port", "0", "backup", "--db", str(db), "--out", str(tmp_path / "b.db")]
    code, out, err = _command(capsys, *argv)
    assert code == 2 and not out, (code, out, err)
    assert err.strip() == (
        "fedfleet server backup: --port and --keep-rounds are options of running the server, which backup does not "
        "do; leave them out"
    ), err
    assert not (tmp_path / "b.db").exists()
    code, out, err = _command(capsys, "backup", "--db", str(db), "--out", str(tmp_path / "b.db"))
    assert code == 0, err


def test_a_file_sqlite_keeps_beside_a_database_is_refused_as_a_backup_or_a_restore(tmp_path, capsys):
    """``--out fl.db-wal --force`` replaced a running server's write-ahead log with the backup (its
    latest writes lost, the database unreadable after); a copy at ``fl.db-wal`` with no server
    running would be applied to ``fl.db`` at its next start."""
    db, backup = tmp_path / "fl.db", tmp_path / "fl-backup.db"
    ServerStore(db).close()
    assert _command(capsys, "backup", "--db", str(db), "--out", str(backup))[0] == 0
    for suffix in ("-wal", "-shm", "-journal", ".lock"):
        beside = f"{db}{suffix}"
        Path(beside).write_bytes(b"kept")
        err = _refused(capsys, "backup", "--db", str(backup), "--out", beside, "--force")
        assert f"--out {beside} is the " in err and f"of the database {db}" in err, err
        assert "--db" in _refused(capsys, "restore", "--backup", str(backup), "--db", beside)
        assert Path(beside).read_bytes() == b"kept"
        Path(beside).unlink()
        _refused(capsys, "backup", "--db", str(backup), "--out", beside)  # (one not there yet alike)
        assert not Path(beside).exists()
    assert not list(tmp_path.glob(".*.part"))


def test_the_copy_a_killed_backup_left_goes_with_the_next_one_and_one_being_written_stays(tmp_path, capsys):
    """A backup killed (SIGKILL, a power cut) leaves its ``.NAME.XXXX.part`` copy: the next backup to
    that name removes it, not the copy another backup is writing now (it holds it locked)."""
    fcntl = pytest.importorskip("fcntl")
    db, out = tmp_path / "fl.db", tmp_path / "fl-backup.db"
    ServerStore(db).close()
    dead = tmp_path / ".fl-backup.db.k1ll3d.part"
    dead.write_bytes(b"x" * 4096)
    Path(f"{dead}-journal").write_bytes(b"j")
    live = tmp_path / ".fl-backup.db.wr1t1n.part"
    held = os.open(live, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert _command(capsys, "backup", "--db", str(db), "--out", str(out))[0] == 0
        assert not dead.exists() and not Path(f"{dead}-journal").exists()
        assert live.exists()
    finally:
        os.close(held)
    other = tmp_path / ".other.db.k1ll3d.part"  # a leftover of another name is not this backup's
    other.write_bytes(b"y")
    assert _command(capsys, "backup", "--db", str(db), "--out", str(out), "--force")[0] == 0
    assert other.exists() and not live.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["fl.db", "fl-backup.db", other.name])


@pytest.mark.slow  # a process of its own and a 40 MB copy; the light twin: the leftover removed above
@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM ends a Windows process at once")
def test_a_backup_ended_by_sigterm_or_ctrl_c_removes_its_copy_and_says_so_in_one_line(tmp_path):
    import signal

    db, out = tmp_path / "fl.db", tmp_path / "fl-backup.db"
    ServerStore(db).close()
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE pad (b BLOB)")
        conn.executemany("INSERT INTO pad VALUES (randomblob(1000000))", [()] * 40)
    conn.close()
    for sig in (signal.SIGTERM, signal.SIGINT):
        proc = subprocess.Popen(
            [sys.executable, "-m", "emulator.cli", "server", "backup", "--db", str(db), "--out", str(out)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".fl-backup.db.*.part")) and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        proc.send_signal(sig)
        said, err = proc.communicate(timeout=60)
        if proc.returncode == 0:  # (the copy was done before the signal came: nothing to see)
            out.unlink()
            continue
        assert proc.returncode == 130 and not said, (proc.returncode, err)
        assert err.strip().splitlines() == [
            "fedfleet server backup: interrupted; its copy under way is removed (fl-backup.db is only ever replaced "
            "by a checked copy): run it again".replace("fl-backup.db", str(out))
        ], err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["fl.db"]


def test_a_server_on_a_link_to_the_database_holds_the_database_itself(tmp_path, capsys):
    """A server started on ``link.db`` (a symbolic link to ``fl.db``) must keep ``restore --db fl.db``
    and a second server on ``fl.db`` off the file it writes: one lock, beside the file itself."""
    db, link = tmp_path / "fl.db", tmp_path / "link.db"
    ServerStore(str(db)).close()
    assert _command(capsys, "backup", "--db", str(db), "--out", str(tmp_path / "b.db"))[0] == 0
    link.symlink_to(db)
    running = ServerStore(str(link), hold=True)  # as fedfleet server --db link.db holds it
    try:
        assert "in use by another server" in _refused(
            capsys, "restore", "--backup", str(tmp_path / "b.db"), "--db", str(db)
        )
        with pytest.raises(DatabaseInUse):
            ServerStore(str(db), hold=True)
    finally:
        running.close()
    assert not Path(f"{link}.lock").exists()
    assert _command(capsys, "restore", "--backup", str(tmp_path / "b.db"), "--db", str(db))[0] == 0


def test_a_server_on_a_hard_link_to_the_database_keeps_others_off_the_file(tmp_path, capsys):
    """``other.db``, a hard link to ``fl.db``, is another name of one file with a lock file of its
    own: a server on either name keeps a second server on the other, and a restore onto it, off."""
    db, other = tmp_path / "fl.db", tmp_path / "other.db"
    ServerStore(str(db)).close()
    assert _command(capsys, "backup", "--db", str(db), "--out", str(tmp_path / "b.db"))[0] == 0
    os.link(db, other)
    for first, second in ((db, other), (other, db)):
        running = ServerStore(str(first), hold=True)  # as fedfleet server --db FIRST holds it
        try:
            with pytest.raises(DatabaseInUse, match="started on another of its 2 names"):
                ServerStore(str(second), hold=True)
            said = _refused(capsys, "restore", "--backup", str(tmp_path / "b.db"), "--db", str(second))
            assert "in use by another server" in said
        finally:
            running.close()
    ServerStore(str(other), hold=True).close()  # released with the server
    assert _command(capsys, "restore", "--backup", str(tmp_path / "b.db"), "--db", str(other))[0] == 0


def test_a_server_that_made_its_database_keeps_a_server_on_a_hard_link_to_it_off(tmp_path):
    """A server started on a database not made yet had no file to lock: until it restarted, a
    second server on a hard link made to the file meanwhile ran beside it."""
    db, other = tmp_path / "fl.db", tmp_path / "other.db"
    running = ServerStore(str(db), hold=True)  # as fedfleet server --db fl.db makes it
    try:
        os.link(db, other)
        with pytest.raises(DatabaseInUse, match="started on another of its 2 names"):
            ServerStore(str(other), hold=True)
    finally:
        running.close()
    ServerStore(str(other), hold=True).close()  # released with the server
