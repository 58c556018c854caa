"""An app whose participation scheduler runs its job is killed (SIGKILL, in a process of its own)
during the job's run, then started again on the same database: the job picks up, and a session
that took part before the kill is neither trained nor reported again."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from device_runtime import FLRuntime, OpStatsStore
from device_runtime.conditions import DeviceState, StaticConditions
from device_runtime.scheduling import ParticipationScheduler, RunOutcome, SchedulerSettings, _StoredJobs
from example_store import SQLiteExampleStore
from tests.support import COLLECTION, ROOT, deploy

GOOD = StaticConditions(DeviceState(True, True, 1.0, True))

KILLED_APP = """
import os, signal, sys
sys.path.insert(0, sys.argv[4])  # the checkout
from device_runtime import FLRuntime, OpStatsStore
from device_runtime.conditions import DeviceState, StaticConditions, TrainingInterval
from device_runtime import scheduling
from example_store import SQLiteExampleStore

folder, url, phase = sys.argv[1], sys.argv[2], sys.argv[3]
db = os.path.join(folder, "app.db")


def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


class Conditions(StaticConditions):  # read between training steps: the kill of phase 'training'
    reads = 0

    def current(self):
        self.reads += 1
        if phase == "training" and self.reads > 3:
            die()
        return self.state


if phase == "after-session":  # the session recorded in opstats, the job not yet rescheduled after it
    scheduling._StoredJobs.reschedule = scheduling._StoredJobs.remove = die
store, opstats = SQLiteExampleStore(db), OpStatsStore(db)
scheduler = scheduling.ParticipationScheduler(
    db, Conditions(DeviceState(True, True, 1.0, True)), settings=scheduling.SchedulerSettings(watchdog=False)
)
scheduler.register_runtime("digits", FLRuntime("digits", url, store, opstats=opstats))
scheduler.schedule("digits", interval=TrainingInterval(recurrent=sys.argv[5] == "recurrent", min_interval_s=3600))
scheduler.queue.run_pending()
"""


def _prepared(admin, db, digits) -> None:
    deploy(admin, goal_count=5)
    with SQLiteExampleStore(db) as store:
        store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:40], digits.y_train[:40])))


def _restarted(db, server, admin, *, took_part: bool, interval: str, schedules_again: bool = False) -> None:
    """The app started again on ``db``: its job picks up, and runs no session that took part twice.
    ``schedules_again``: the app schedules its population at each start, as the sample app does."""
    with SQLiteExampleStore(db) as store, OpStatsStore(db) as opstats:
        assert [s.shape for s in opstats.sessions()] == (["-v[]+^"] if took_part else [])
        with ParticipationScheduler(db, GOOD, settings=SchedulerSettings(watchdog=False)) as scheduler:
            if schedules_again:
                scheduler.schedule("digits")
            [job] = scheduler.jobs()
            assert job.running is not None  # the run the app was killed in
            scheduler.register_runtime("digits", FLRuntime("digits", server.url, store, opstats=opstats))
            [run] = scheduler.queue.run_pending()
            assert run.outcome is RunOutcome.COMPLETED
            assert (run.session is None) is took_part  # not trained again
            assert [s.shape for s in opstats.sessions()] == ["-v[]+^"]
            jobs = scheduler.jobs()
            if interval == "recurrent":  # due an interval after the session, not at once
                assert [j.running for j in jobs] == [None] and jobs[0].next_run_at >= run.started_at + 3600
            else:
                assert jobs == []
    assert admin.status("digits")["current_round"]["reported"] == 1


class _Stopped(BaseException):
    """The app's process ending at this point, in the process of the test."""


def _stops_after_writes(engine, writes: int | None = None) -> None:
    """Make the app's process end (``_Stopped``) at the statement after its first kept write, or
    after ``writes`` writes in one transaction, before they are kept."""
    from sqlalchemy import event

    wrote, kept = [], []

    @event.listens_for(engine, "commit")
    def committed(conn: object) -> None:
        kept.extend(wrote)

    @event.listens_for(engine, "before_cursor_execute")
    def next_statement(conn, cursor, statement, *args):
        if kept or len(wrote) == writes:
            raise _Stopped
        if statement.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE")):
            wrote.append(statement)


@pytest.mark.parametrize("schedules_again", [False, True])
def test_an_app_stopped_after_its_session_took_part_does_not_train_or_report_again(
    tmp_path, server, admin, digits, monkeypatch, schedules_again
):
    """Stopped between the session's record in opstats and the job's rescheduling, the app found
    its job still due at its old time on restart: the session trained and reported again at once,
    a one-time job's too. An app that schedules its population at each start (the sample app)
    replaced the job, and with it the mark of the run it was stopped in: trained and reported
    again too. (The lighter twin of the SIGKILL tests below.)"""
    db = tmp_path / "app.db"
    _prepared(admin, db, digits)

    def stop(*args: object, **kwargs: object) -> None:
        raise _Stopped

    with monkeypatch.context() as patched:
        patched.setattr(_StoredJobs, "reschedule", stop)
        patched.setattr(_StoredJobs, "remove", stop)
        with SQLiteExampleStore(db) as store, OpStatsStore(db) as opstats:
            app = ParticipationScheduler(db, GOOD, settings=SchedulerSettings(watchdog=False))
            app.register_runtime("digits", FLRuntime("digits", server.url, store, opstats=opstats))
            app.schedule("digits")
            with pytest.raises(_Stopped):
                app.queue.run_pending()
            app.close()
    _restarted(db, server, admin, took_part=True, interval="once", schedules_again=schedules_again)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("phase", "interval"), [("after-session", "once"), ("after-session", "recurrent"), ("training", "once")]
)
def test_an_app_killed_during_its_jobs_run_picks_up_without_taking_part_twice(
    tmp_path, server, admin, digits, phase, interval
):
    db = tmp_path / "app.db"
    _prepared(admin, db, digits)
    script = tmp_path / "app.py"
    script.write_text(KILLED_APP)
    args = [sys.executable, str(script), str(tmp_path), server.url, phase, str(ROOT), interval]
    done = subprocess.run(args, timeout=120, capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    _restarted(db, server, admin, took_part=phase == "after-session", interval=interval)


def test_an_app_stopped_while_it_reschedules_a_job_keeps_the_old_job_or_the_new(tmp_path):
    """``schedule`` of a population already scheduled (a new interval, say) replaced its job in two
    transactions, removing it then adding the new one: an app stopped between them found no job at
    its next start, and never took part again."""
    from device_runtime.conditions import TrainingInterval

    db = tmp_path / "app.db"
    app = ParticipationScheduler(db, GOOD, settings=SchedulerSettings(watchdog=False))
    app.schedule("digits", interval=TrainingInterval(recurrent=True, min_interval_s=3600))
    _stops_after_writes(app._jobs._store.engine)  # type: ignore[union-attr]  # a stored scheduler's
    with pytest.raises(_Stopped):
        app.schedule("digits", interval=TrainingInterval(recurrent=True, min_interval_s=7200))
    app.close()
    with ParticipationScheduler(db, GOOD) as restarted:
        jobs = restarted.jobs()
        assert len(jobs) == 1 and jobs[0].interval.min_interval_s in (3600, 7200)


def test_an_app_stopped_while_it_moves_its_jobs_with_the_clock_moves_all_or_none(tmp_path):
    """The wall clock set while the app runs moves every job's due time (``follow_clock``): moved
    job by job, an app stopped partway kept some jobs on the old clock and the others on the new
    one, a day apart, which its next start could not tell."""
    db = tmp_path / "app.db"
    app = ParticipationScheduler(db, GOOD, settings=SchedulerSettings(watchdog=False))
    for population in ("digits", "text", "speech"):
        app.schedule(population, start_at=2.0e9)
    _stops_after_writes(app._jobs._store.engine, writes=2)  # type: ignore[union-attr]  # a stored scheduler's
    with pytest.raises(_Stopped):
        app.shift_jobs(86_400.0)
    app.close()
    with ParticipationScheduler(db, GOOD) as restarted:
        assert len({job.next_run_at for job in restarted.jobs()}) == 1


RESCHEDULING_APP = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])  # the checkout
from sqlalchemy import event
from device_runtime.conditions import DeviceState, StaticConditions, TrainingInterval
from device_runtime.scheduling import ParticipationScheduler

app = ParticipationScheduler(os.path.join(sys.argv[1], "app.db"), StaticConditions(DeviceState(True, True, 1.0, True)))
app.schedule("digits", interval=TrainingInterval(recurrent=True, min_interval_s=3600))
wrote, kept = [], []
event.listen(app._jobs._store.engine, "commit", lambda conn: kept.extend(wrote))


@event.listens_for(app._jobs._store.engine, "before_cursor_execute")
def next_statement(conn, cursor, statement, *args):  # killed once a write of the new schedule is kept
    if kept:
        os.kill(os.getpid(), signal.SIGKILL)
    if statement.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE")):
        wrote.append(statement)


app.schedule("digits", interval=TrainingInterval(recurrent=True, min_interval_s=7200))
"""


@pytest.mark.slow
def test_an_app_killed_while_it_reschedules_a_job_keeps_the_old_job_or_the_new(tmp_path):
    script = tmp_path / "app.py"
    script.write_text(RESCHEDULING_APP)
    done = subprocess.run([sys.executable, str(script), str(tmp_path), str(ROOT)], timeout=120, capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    with ParticipationScheduler(tmp_path / "app.db", GOOD) as restarted:
        jobs = restarted.jobs()
        assert len(jobs) == 1 and jobs[0].interval.min_interval_s in (3600, 7200)
