"""Opstats: every phase of a session in the app's database, and shapes on both sides."""

from __future__ import annotations

import os
import stat

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from device_runtime import DeviceClass, FLRuntime, OpStatsStore, Outcome, OverBudget, RetryPolicy
from device_runtime.opstats import MAY_BE_HELD, READ_TO, Event
from example_store import SQLiteExampleStore
from tests.support import COLLECTION, deploy, digits_plan

FAST = RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.02)


def _runtime(tmp_path, server, digits, **kwargs):
    store = SQLiteExampleStore(tmp_path / "app.db")
    store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:30], digits.y_train[:30])))
    return FLRuntime("digits", server.url, store, retry=FAST, **kwargs)


def test_sessions_are_logged_with_costs_and_shapes_reach_the_server(tmp_path, server, admin, digits):
    deploy(admin, goal_count=2, over_selection=1.5, min_fraction=1.0)
    opstats = OpStatsStore(tmp_path / "app.db")
    runtime = _runtime(tmp_path, server, digits, opstats=opstats)
    assert runtime.run_session(should_abort=lambda: True).outcome is Outcome.INTERRUPTED
    assert runtime.run_session().outcome is Outcome.COMPLETED
    assert runtime.run_session().outcome is Outcome.COMPLETED

    sessions = opstats.sessions("digits")
    assert [s.shape for s in sessions] == ["-v[!", "-v[]+^", "-v[]+^"]
    last = sessions[-1].events
    assert [e.kind for e in last] == SHAPES["-v[]+^"]
    assert last[3].detail["examples"] == 30
    assert last[4].detail["bytes"] > 0
    assert last[-1].detail["bytes_sent"] > last[4].detail["bytes"] - 1
    assert last[-1].detail["bytes_received"] > 0
    assert last[-1].detail["peak_memory_mb"] > 10
    assert last[-1].detail["runtime_version"] == runtime.runtime_version
    assert opstats.shape_counts("digits") == {"-v[]+^": 2, "-v[!": 1}
    assert opstats.last_participation("digits").session_id == sessions[-1].session_id

    [round1] = admin.rounds("digits")
    assert round1["metrics"]["shapes"] == {"-v[]+^": 2, "-v[!": 1}


def test_a_plan_over_the_device_budget_is_refused(tmp_path, server, admin, digits):
    plan = digits_plan(memory_budget_mb=4096)
    deploy(admin, plan=plan, goal_count=5)
    runtime = _runtime(tmp_path, server, digits, device_class=DeviceClass("low-end", memory_mb=1024))
    try:
        runtime.run_session()
    except OverBudget as exc:
        assert "4096" in str(exc) and "low-end" in str(exc)
    else:
        raise AssertionError("the plan should have been refused")
    assert admin.status("digits")["current_round"]["aborted"] == 1


def test_a_plan_that_runs_over_its_time_budget_is_stopped(tmp_path, server, admin, digits):
    plan = digits_plan(epochs=100_000, time_budget_s=0.3)
    deploy(admin, plan=plan, goal_count=5)
    opstats = OpStatsStore(tmp_path / "ops.db")
    result = _runtime(tmp_path, server, digits, opstats=opstats).run_session()
    assert result.outcome is Outcome.INTERRUPTED
    assert "time budget" in result.events[-1].detail["reason"]
    assert opstats.shape_counts() == {"-v[!": 1}


KILLED_AFTER_REPORT = """
import os, signal, sys
import httpx
from device_runtime import FLRuntime, OpStatsStore
from example_store import SQLiteExampleStore


class KilledOnceReported(httpx.HTTPTransport):
    def handle_request(self, request):
        response = super().handle_request(request)
        if request.url.path.endswith("/report"):
            os.kill(os.getpid(), signal.SIGKILL)  # the app dies as the server's answer arrives
        return response


db, url = sys.argv[1], sys.argv[2]
FLRuntime("digits", url, SQLiteExampleStore(db), opstats=OpStatsStore(db), transport=KilledOnceReported()).run_session()
"""


def test_an_app_killed_after_sending_its_update_knows_it_took_part(tmp_path, server, admin, digits):
    """The events up to the upload are on record before the update leaves: a device killed while
    the server takes its report (kill -9, in a process of its own) finds the session, shape
    ``-v[]+``, as its last participation, so that its eligibility policies (once per period, a
    minimum separation) hold after the restart."""
    import signal
    import subprocess
    import sys

    deploy(admin, goal_count=2, over_selection=1.0, min_fraction=1.0)
    _runtime(tmp_path, server, digits).close()  # the examples, in the app's database
    script = tmp_path / "app.py"
    script.write_text(KILLED_AFTER_REPORT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "app.db"), server.url], timeout=120)
    assert done.returncode == -signal.SIGKILL
    assert admin.status("digits")["current_round"]["reported"] == 1  # the server took it
    opstats = OpStatsStore(tmp_path / "app.db")
    [session] = opstats.sessions("digits")
    assert session.shape == "-v[]+"
    assert opstats.last_participation("digits") == session


SHAPES = {  # a session's events by its shape (what a hostile or a busy server leaves a device with)
    "-v[]+^": [
        "checkin",
        "plan_downloaded",
        "training_started",
        "training_completed",
        "upload_started",
        "upload_completed",
    ],
    "-v[]+": ["checkin", "plan_downloaded", "training_started", "training_completed", "upload_started"],
    "-v[!": ["checkin", "plan_downloaded", "training_started", "interrupted"],
    "-*": ["checkin", "error"],
    "-v[]+*": ["checkin", "plan_downloaded", "training_started", "training_completed", "upload_started", "error"],
    "-v[]+* held": ["checkin", "plan_downloaded", "training_started", "training_completed", "upload_started", "error"],
}


def took_part(name: str) -> bool:
    """Whether a session of ``SHAPES[name]`` took part: its update taken, its upload the last thing
    it did (the app killed), or its report failed once it may have reached the server ("held")."""
    return name.endswith(("^", "+", "held"))


@pytest.fixture(scope="module")
def one_log(tmp_path_factory):
    """One database for every example (opening one per example was most of the test's time),
    emptied before each."""
    opstats = OpStatsStore(tmp_path_factory.mktemp("opstats") / "app.db")
    yield opstats
    opstats.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sessions=st.lists(
        st.tuples(
            st.sampled_from(["digits", "words"]),
            st.sampled_from(["a", "b"]),
            st.sampled_from(sorted(SHAPES)),
            st.floats(0, 60),
        ),
        max_size=16,
    ),
    keep_sessions=st.integers(1, 4),
)
def test_the_log_keeps_recent_sessions_up_to_its_bounds_and_every_tasks_last_participation(
    one_log, sessions, keep_sessions
):
    """Whatever sessions come, the log holds the newest ``keep_sessions`` that ended within
    ``keep_s`` of the last one recorded, and besides them only each population and task's newest
    participation, so that eligibility reads what it would read from an unbounded log."""
    from device_runtime.opstats import events_table

    opstats = one_log
    with opstats.engine.begin() as conn:
        conn.execute(events_table.delete())
    opstats.keep_s, opstats.keep_sessions = keep_s, keep_sessions = 100.0, keep_sessions
    now, recorded = 1000.0, []
    for i, (population, task, shape, gap) in enumerate(sessions):
        now += gap
        events = [Event(kind, now + j * 0.001) for j, kind in enumerate(SHAPES[shape])]
        if shape.endswith("held"):
            events[-1].detail[MAY_BE_HELD] = True
        opstats.record_session(f"s{i}", population, task, events)
        recorded.append((f"s{i}", population, task, shape, events[-1].at))
    kept = {s.session_id for s in opstats.sessions()}
    end = recorded[-1][4] if recorded else now
    recent = [r[0] for r in recorded if r[4] >= end - keep_s][-keep_sessions:]
    last = {}
    for sid, population, task, shape, _ in recorded:
        if took_part(shape):
            last[(population, task)] = sid
    assert kept == set(recent) | set(last.values())
    for (population, task), sid in last.items():
        assert opstats.last_participation(population, task).session_id == sid


def test_a_report_that_may_have_reached_the_server_moves_the_reading_on(tmp_path):
    """A session whose report failed once it may have reached the server (its answer lost, then
    the server unreachable) keeps where it stopped reading: the next session reads on from there,
    as after an app killed during the upload, and does not train on and send the same examples
    again. One whose report never left reads from the token saved before it."""
    with OpStatsStore(tmp_path / "app.db") as opstats:
        opstats.save_resumption_token("p", "t", "app:/c", "saved", at=10.0)
        kinds = ["checkin", "plan_downloaded", "training_started", "training_completed", "upload_started", "error"]

        def failed_report(sid: str, at: float, held: bool) -> None:
            events = [Event(kind, at + i) for i, kind in enumerate(kinds)]
            events[4].detail[READ_TO] = ["app:/c", f"after-{sid}"]
            if held:
                events[-1].detail.update({MAY_BE_HELD: True, READ_TO: ["app:/c", f"after-{sid}"]})
            opstats.record_session(sid, "p", "t", events)

        failed_report("never-sent", 20.0, held=False)
        assert opstats.resumption_token("p", "t", "app:/c") == "saved"
        assert opstats.last_participation("p", "t") is None
        failed_report("answer-lost", 40.0, held=True)
        assert opstats.resumption_token("p", "t", "app:/c") == "after-answer-lost"
        assert opstats.last_participation("p", "t").session_id == "answer-lost"


def test_recording_a_session_does_as_much_work_with_a_full_log_as_with_an_empty_one(tmp_path):
    """Every app's log reaches its bound (1,000 sessions) and stays there, and each session is
    recorded twice (before its upload, and at its end). Choosing what to drop by reading every kept
    session into Python made a record cost 5 ms at first and 40 ms from then on; it is decided in
    SQLite, and the Python work of a record (its function calls, counted: a machine's speed does
    not change them) is the same whatever the log holds."""
    import cProfile
    import pstats

    kinds = SHAPES["-v[]+^"]
    with OpStatsStore(tmp_path / "app.db", keep_sessions=20) as opstats:

        def record(i: int) -> int:
            events = [Event(kind, 60.0 * i + j, {"round": i}) for j, kind in enumerate(kinds)]
            profile = cProfile.Profile()
            profile.runcall(opstats.record_session, f"s{i}", "digits", "a", events)
            return pstats.Stats(profile).total_calls

        for i in range(3):
            record(i)
        nearly_empty = record(3)
        for i in range(4, 50):
            record(i)
        full = record(50)
        assert len(opstats.sessions()) == 20
    assert full <= nearly_empty + 5, (nearly_empty, full)


def test_the_bounds_of_the_log_are_checked():
    for bad in ({"keep_s": 0.0}, {"keep_sessions": 0}, {"keep_s": float("nan")}):
        with pytest.raises(ValueError, match="(keep_s|keep_sessions) is a"):
            OpStatsStore(":memory:", **bad)


@settings(max_examples=40, deadline=None)
@given(
    saves=st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d", "e"]), st.floats(0, 60)), max_size=14),
    keep_sessions=st.integers(1, 4),
)
def test_resumption_tokens_are_bounded_as_the_log_is(tmp_path_factory, saves, keep_sessions):
    """A server that names a new task in every session added a token row each time, for the life of
    the app: the table keeps the newest ``keep_sessions`` saved within ``keep_s`` of the last save."""
    opstats = OpStatsStore(tmp_path_factory.mktemp("tokens") / "app.db", keep_s=100.0, keep_sessions=keep_sessions)
    now, newest = 1000.0, {}
    for task, gap in saves:
        now += gap
        opstats.save_resumption_token("p", task, "app:/c", f"{task}@{now}", at=now)
        newest[task] = now
    recent = sorted((at, task) for task, at in newest.items() if at >= now - 100.0)[::-1][:keep_sessions]
    for task, at in newest.items():
        expected = f"{task}@{at}" if (at, task) in recent else None
        assert opstats.resumption_token("p", task, "app:/c") == expected
    opstats.close()


def test_an_app_started_again_with_the_same_seed_keeps_its_earlier_sessions(tmp_path, server, admin, digits):
    """A session's id in the log was drawn from the runtime's random stream alone: an app that seeds
    it (``FLRuntime(rng=random.Random(seed))``, for runs that repeat) drew the same ids after each
    start, and its first session replaced the record of the last start's first one, a session
    that took part included (what its eligibility policies and scheduler read)."""
    import random

    deploy(admin, goal_count=5)
    opstats = OpStatsStore(tmp_path / "app.db")
    for _ in range(2):  # the app, then the app started again
        with _runtime(tmp_path, server, digits, opstats=opstats, rng=random.Random(7)) as runtime:
            assert runtime.run_session().outcome is Outcome.COMPLETED
    assert [s.shape for s in opstats.sessions("digits")] == ["-v[]+^", "-v[]+^"]
    opstats.close()


def test_the_log_is_synced_to_disk_at_each_commit(tmp_path):
    """The session kept before its update leaves tells a restarted app that the update may be the
    server's: at ``synchronous=NORMAL`` (the app database's default, crash-safe against a kill) a
    power cut could roll that commit back after the upload, and the session was trained and
    reported again. The log's commits are synced (FULL); the example store's stay NORMAL."""
    with OpStatsStore(tmp_path / "app.db") as opstats, SQLiteExampleStore(tmp_path / "app.db") as store:
        with opstats.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
        with store._engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL


def test_delete_all_leaves_no_session_nor_token_in_the_file_or_its_log(tmp_path):
    mark = "ZQXHISTORY"
    path = tmp_path / "app.db"
    opstats = OpStatsStore(path)
    for i in range(10):
        opstats.record_session(
            f"s{i}",
            "digits",
            "t",
            [Event("checkin", 100.0 + i, {"reason": f"{mark}{i}"}), Event("upload_completed", 101.0 + i)],
        )
    opstats.save_resumption_token("digits", "t", "app:/digits", f"{mark}-token", at=200.0)
    assert opstats.delete_all() == 20
    assert opstats.sessions() == [] and opstats.resumption_token("digits", "t", "app:/digits") is None
    on_disk = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name in ("app.db", "app.db-wal"))
    assert mark.encode() not in on_disk  # the app still running, its database open
    assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0
    opstats.record_session("later", "digits", "t", [Event("checkin", 300.0)])  # the log goes on
    assert [s.session_id for s in opstats.sessions()] == ["later"]
    opstats.close()


def test_a_log_in_memory_makes_no_file_of_that_name(tmp_path, monkeypatch):
    """``:memory:`` is no file: opening the log made an empty one of that name in the working folder."""
    monkeypatch.chdir(tmp_path)
    OpStatsStore(":memory:").close()
    assert list(tmp_path.iterdir()) == []
