"""``python -m tests.dying_server POINT ARGS...``: the FL server (``python -m server_stub ARGS...``)
that kills itself (SIGKILL) at ``POINT`` of the first commit of a round it writes, so that a test
meets exactly that state of the database after a restart. The database is real (SQLite, as the
server writes it); only the moment of the kill is chosen:

- ``model_written``: the round's new model is written in the commit's transaction, not committed;
- ``record_written``: its round record is too, the transaction not committed yet;
- ``committed``: the transaction is committed, and nothing of it is applied in memory or told to a device.

``killed_at_statement`` is the same for any of the store's writes (a deploy, a retention pass), in a
process that runs only them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine

from server_stub.cli import main
from server_stub.persistence import ServerStore

KILL_POINTS = ("model_written", "record_written", "committed")
#: after this statement of a commit's transaction, for the kill points inside it
_STATEMENTS = {"model_written": "INSERT INTO resources", "record_written": "INSERT INTO rounds"}


def _die() -> None:
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str) -> None:
    """Make this process kill itself at ``point`` of the first round commit it writes."""
    if point not in KILL_POINTS:
        raise SystemExit(f"tests.dying_server: {point!r} is none of {KILL_POINTS}")
    committing = threading.local()
    write = ServerStore.record_round

    def record_round(self: ServerStore, task_id: int, number: int, attempt: int, status: str, *args: Any, **kw: Any):
        if status != "committed":
            return write(self, task_id, number, attempt, status, *args, **kw)
        committing.on = True
        try:
            written = write(self, task_id, number, attempt, status, *args, **kw)
        finally:
            committing.on = False
        if point == "committed":
            _die()
        return written

    @event.listens_for(Engine, "after_cursor_execute")
    def after_statement(conn, cursor, statement: str, *args: Any) -> None:  # noqa: ANN001 - SQLAlchemy's
        if getattr(committing, "on", False) and statement.startswith(_STATEMENTS.get(point, "\0")):
            _die()

    ServerStore.record_round = record_round  # type: ignore[method-assign]


def killed_at_statement(db: str | os.PathLike, statement: str, code: str) -> subprocess.CompletedProcess:
    """Run ``code`` (Python, with ``store``, a ``ServerStore`` on ``db``) in a process of its own that
    kills itself (SIGKILL) right after the first SQL statement that starts with ``statement`` (in
    its transaction, before that commits); its exit status is -9 when it did."""
    script = textwrap.dedent(
        f"""
        import os, signal
        from sqlalchemy import event
        from sqlalchemy.engine import Engine
        from server_stub.persistence import ServerStore

        @event.listens_for(Engine, "after_cursor_execute")
        def die(conn, cursor, statement, *args):
            if statement.startswith({statement!r}):
                os.kill(os.getpid(), signal.SIGKILL)

        store = ServerStore({os.fspath(db)!r})
        """
    )
    return subprocess.run(
        [sys.executable, "-c", script + textwrap.dedent(code)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=60,
    )


if __name__ == "__main__":
    install(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
