"""An opstats log holding events another version of the SDK wrote (a kind this one does not know, a
detail that is not a JSON object: a newer release's, then an older release run over the app's
database) is read from its other events, said once in the log, and left as it is: it was a KeyError
(an AttributeError for the detail) out of every session's check of the app's last participation, and
then a refusal that stopped every session of the population until the log's pruning dropped it."""

from __future__ import annotations

import logging
import sqlite3

import pytest

from device_runtime import Event, OpStatsStore

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
def test_events_another_version_wrote_are_passed_over_said_once_and_kept(tmp_path, caplog, kind, detail, said):
    db = tmp_path / "app.db"
    with OpStatsStore(db) as opstats:
        opstats.record_session("s-1", "digits", "train", [Event(k, 1.7e9 + i) for i, k in enumerate(KINDS)])
    with sqlite3.connect(db) as conn:  # later sessions, as the other version keeps them
        conn.executemany(
            "INSERT INTO fl_opstats_events (session_id, population, task, kind, at, detail) VALUES (?, ?, ?, ?, ?, ?)",
            [
                ("s-2", "digits", "train", "checkin", 1.7e9 + 60, "{}"),
                ("s-2", "digits", "train", kind, 1.7e9 + 61, detail),
                ("s-3", "digits", "train", kind, 1.7e9 + 62, detail),  # nothing this version reads
            ],
        )
    kept = _rows(db)
    with caplog.at_level(logging.WARNING, logger="device_runtime.opstats"), OpStatsStore(db) as opstats:
        sessions = opstats.sessions()
        assert [(s.session_id, s.shape) for s in sessions] == [("s-1", "-v[]+^"), ("s-2", "-")]
        assert opstats.last_participation("digits").session_id == "s-1"
        assert opstats.shape_counts() == {"-v[]+^": 1, "-": 1}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"session 's-2' has {said}" in warnings[0], warnings
    assert "another fedfleet version" in warnings[0] and str(db) in warnings[0]
    assert _rows(db) == kept
