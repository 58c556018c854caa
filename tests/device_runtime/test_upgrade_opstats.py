"""An opstats log holding events another version of the SDK wrote (a kind this one does not know, a
detail that is not a JSON object: a newer release's, then an older release run over the app's
database) is refused in one line, an ``AppDatabaseError`` naming the session and the kind, and left
as it is: it was a KeyError (an AttributeError for the detail) out of every session's check of the
app's last participation."""

from __future__ import annotations

import sqlite3

import pytest

from device_runtime import Event, OpStatsStore
from device_runtime.opstats import AppDatabaseError

KINDS = ("checkin", "plan_downloaded", "training_started", "training_completed", "upload_started", "upload_completed")


def _rows(db) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT * FROM fl_opstats_events ORDER BY id").fetchall()


@pytest.mark.parametrize(
    ("kind", "detail", "said"),
    [
        ("upload_held", "{}", "an event of kind 'upload_held'"),
        ("upload_completed", "[1]", "an event 'upload_completed' of detail '[1]'"),
    ],
)
def test_events_another_version_wrote_are_refused_in_one_line_and_kept(tmp_path, kind, detail, said):
    db = tmp_path / "app.db"
    with OpStatsStore(db) as opstats:
        opstats.record_session("s-1", "digits", "train", [Event(k, 1.7e9 + i) for i, k in enumerate(KINDS)])
    with sqlite3.connect(db) as conn:  # a later session, as the other version keeps it
        conn.executemany(
            "INSERT INTO fl_opstats_events (session_id, population, task, kind, at, detail) VALUES (?, ?, ?, ?, ?, ?)",
            [
                ("s-2", "digits", "train", "checkin", 1.7e9 + 60, "{}"),
                ("s-2", "digits", "train", kind, 1.7e9 + 61, detail),
            ],
        )
    kept = _rows(db)
    with OpStatsStore(db) as opstats:
        for read in (opstats.sessions, lambda: opstats.last_participation("digits"), opstats.shape_counts):
            with pytest.raises(AppDatabaseError) as refused:
                read()
            message = str(refused.value)
            assert f"session 's-2' has {said}" in message and "another fedfleet version" in message, message
            assert "\n" not in message and str(db) in message
    assert _rows(db) == kept
