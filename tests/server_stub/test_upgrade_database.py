"""An upgrade of the server's database as an operator makes it: the server says in its log that it
upgraded the file, from which layout to which; ``fedfleet server backup`` of a database of
an earlier layout copies it as it is (neither the database nor its copy is upgraded, so restoring
the copy goes back to the release that wrote it), and ``restore`` refuses, in one line and before
it replaces anything, a backup of a layout later than this server's, which this server would then
refuse to start on."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

from emulator.cli import commands as cli
from server_stub import ServerStore
from server_stub.persistence import SCHEMA_VERSION
from tests.server_stub.test_server_database import LAYOUT_1 as LAYOUT_1_TABLES

#: Layout 1 as a server of that layout made it (``test_server_database.LAYOUT_1``), with a
#: population, a task and a committed round.
LAYOUT_1 = (
    LAYOUT_1_TABLES
    + """
INSERT INTO populations VALUES (1, 'digits', 1.0);
INSERT INTO resources VALUES ('p', 'plan', x'00', 1.0);
INSERT INTO tasks VALUES (1, 1, 'train', 'p', 'p', '{}', 'active', 1.0);
INSERT INTO rounds VALUES (1, 1, 1, 1, 'committed', 'p', '{}', 1.0, 2.0);
"""
)


def _server(capsys, *args: str) -> tuple[int, str]:
    code = cli.main(["server", *args])
    return code, capsys.readouterr().err


def _tables(db: Path) -> tuple[int, list[str]]:
    with sqlite3.connect(db) as conn:
        names = sorted(r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'index')"))
        return conn.execute("SELECT version FROM schema").fetchone()[0], names


def test_a_backup_of_an_earlier_layout_is_that_layout_and_leaves_the_database_in_it(tmp_path, capsys):
    """Back the database up, then start the new server: the steps the operator's page gives. The
    backup is the file as the earlier release wrote it, which that release starts on again."""
    db, out = tmp_path / "fl.db", tmp_path / "fl-backup.db"
    with sqlite3.connect(db) as conn:
        conn.executescript(LAYOUT_1)
    before = _tables(db)
    assert before[0] == 1
    assert _server(capsys, "backup", "--db", str(db), "--out", str(out))[0] == 0
    assert _tables(db) == before and _tables(out) == before


def test_a_backup_of_a_newer_layout_is_refused_by_restore_in_one_line_and_replaces_nothing(tmp_path, capsys):
    db, newer, out = tmp_path / "fl.db", tmp_path / "newer.db", tmp_path / "newer-backup.db"
    ServerStore(newer).close()
    assert _server(capsys, "backup", "--db", str(newer), "--out", str(out))[0] == 0
    with sqlite3.connect(out) as conn:  # as a server of the next layout stamps its database
        conn.execute("UPDATE schema SET version = ?", (SCHEMA_VERSION + 1,))
    with sqlite3.connect(db) as conn:
        conn.executescript(LAYOUT_1)
    kept = db.read_bytes()
    code, err = _server(capsys, "restore", "--backup", str(out), "--db", str(db))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"has layout {SCHEMA_VERSION + 1}, written by a newer server" in err and "Traceback" not in err
    assert db.read_bytes() == kept and not list(tmp_path.glob("*.part")) and not (tmp_path / "fl.db.lock").exists()
    # a backup of this layout is put in place
    assert _server(capsys, "restore", "--backup", str(newer), "--db", str(db))[0] == 0
    assert _tables(db)[0] == SCHEMA_VERSION


def test_a_restored_backup_of_an_earlier_layout_says_the_next_start_upgrades_it(tmp_path, capsys):
    """Restore said only that a server started on it goes on from its rounds, not that the start
    upgrades the file, after which the release that wrote it refuses it."""
    old, db = tmp_path / "old.db", tmp_path / "fl.db"
    with sqlite3.connect(old) as conn:
        conn.executescript(LAYOUT_1)
    ServerStore(db).close()
    assert cli.main(["server", "restore", "--backup", str(old), "--db", str(db)]) == 0
    said = capsys.readouterr().out
    assert f"upgrading it first from layout 1 to layout {SCHEMA_VERSION}, which older servers refuse" in said, said
    assert _tables(db)[0] == 1  # upgraded at the start, not by the restore
    ServerStore(old).close()  # this layout's backup: nothing to say
    assert cli.main(["server", "restore", "--backup", str(old), "--db", str(db)]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"restored {db}") and "upgrading" not in said


def test_a_server_says_once_in_its_log_that_it_upgraded_its_database_and_from_which_layout(tmp_path, caplog):
    db = tmp_path / "fl.db"
    with sqlite3.connect(db) as conn:
        conn.executescript(LAYOUT_1)
    caplog.set_level(logging.INFO, logger="server_stub.persistence")
    for _ in range(2):  # the second start finds its own layout: nothing to say
        ServerStore(db, hold=True).close()
    said = [r.getMessage() for r in caplog.records if r.name == "server_stub.persistence"]
    assert said == [
        f"upgraded the database {db} from layout 1 to layout {SCHEMA_VERSION}, every row kept; to go back to the "
        "release that wrote it, restore a backup taken before this start"
    ], said
    caplog.clear()
    with sqlite3.connect(db) as conn:
        conn.execute("DROP TABLE schema")  # as every server wrote it before the layout was recorded
    ServerStore(db).close()
    assert [r.getMessage() for r in caplog.records if r.name == "server_stub.persistence"] == [
        f"upgraded the database {db} from layout 1 (not recorded) to layout {SCHEMA_VERSION}, every row kept; to go "
        "back to the release that wrote it, restore a backup taken before this start"
    ]
    caplog.clear()
    ServerStore(tmp_path / "new.db").close()  # a new database is made, not upgraded
    assert not [r for r in caplog.records if r.name == "server_stub.persistence"]
