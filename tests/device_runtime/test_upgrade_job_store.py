"""The scheduled jobs of an app's database that another version of the SDK stored (a newer release's,
then an older release run over it) are refused in one line and left as they are: a job with a
constraint this version does not know was a TypeError out of ``jobs()`` and the worker's pass, and
one whose APScheduler state is of a later version was deleted without a word as the jobs were
listed. Scheduling the population again replaces such a job, and cancelling it removes it."""

from __future__ import annotations

import logging
import pickle
import sqlite3

import pytest

from device_runtime.clock import VirtualClock
from device_runtime.conditions import DeviceState, StaticConditions, TrainingConstraints, TrainingInterval
from device_runtime.opstats import AppDatabaseError
from device_runtime.scheduling import JOB_TABLE, ParticipationScheduler, WorkerQueue

GOOD = DeviceState(idle=True, charging=True, battery_level=0.9, unmetered_network=True)
START = 1.0e9


def _rows(db) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(f"SELECT id, next_run_time, job_state FROM {JOB_TABLE} ORDER BY id").fetchall()


def _stored_by_a_newer_version(db) -> None:
    """The app's jobs of populations 'digits' and 'text' as a later version stores them: 'digits'
    with a constraint this one does not have, 'text' in APScheduler's next job state."""
    clock = VirtualClock(START)
    scheduler = ParticipationScheduler(db, StaticConditions(GOOD), clock=clock)
    for population in ("digits", "text"):
        scheduler.schedule(population, TrainingConstraints(), TrainingInterval(recurrent=True, min_interval_s=60.0))
    scheduler.close()
    with sqlite3.connect(db) as conn:
        for population, change in (("digits", "constraint"), ("text", "state")):
            (blob,) = conn.execute(f"SELECT job_state FROM {JOB_TABLE} WHERE id = ?", (population,)).fetchone()
            state = pickle.loads(blob)
            if change == "constraint":
                state["kwargs"]["constraints"]["requires_storage_not_low"] = True
            else:
                state["version"] = 2
            conn.execute(f"UPDATE {JOB_TABLE} SET job_state = ? WHERE id = ?", (pickle.dumps(state), population))


def test_jobs_another_version_stored_are_refused_in_one_line_and_kept_until_scheduled_again(tmp_path):
    db = tmp_path / "app.db"
    _stored_by_a_newer_version(db)
    kept = _rows(db)
    scheduler = ParticipationScheduler(db, StaticConditions(GOOD), clock=VirtualClock(START + 3600))
    try:
        for read in (scheduler.jobs, lambda: scheduler.run_job("digits")):
            with pytest.raises(AppDatabaseError) as refused:
                read()
            said = str(refused.value)
            assert "stored by another fedfleet version" in said and "\n" not in said, said
            assert "schedule (or cancel)" in said and str(db) in said
        assert scheduler.due(START + 3600) == [] and scheduler.next_run_at() is None  # passed over, not run
        assert _rows(db) == kept  # nothing deleted, nothing rewritten
        # the app schedules its populations again at its start: each is replaced by this version's job
        scheduler.schedule("digits", TrainingConstraints(requires_charging=False))
        assert scheduler.cancel("text")
        [job] = scheduler.jobs()
        assert job.population == "digits" and not job.constraints.requires_charging
    finally:
        scheduler.close()


@pytest.mark.parametrize("change", ["constraint", "state"])
def test_a_job_another_version_stored_is_passed_over_by_the_worker_and_the_apps_other_jobs_run(
    tmp_path, caplog, change
):
    """A population only a later version of the app schedules ('text'), after the app went back to
    this version: its job failed every pass of the worker ('could not read the due jobs'), and the
    app's own 'digits' never ran again."""
    db = tmp_path / "app.db"
    _stored_by_a_newer_version(db)
    clock = VirtualClock(START + 3600)
    scheduler = ParticipationScheduler(db, StaticConditions(GOOD), clock=clock)
    try:
        other = "digits" if change == "constraint" else "text"  # the one this version cannot read
        own = "text" if other == "digits" else "digits"
        scheduler.schedule(own, TrainingConstraints(), TrainingInterval(recurrent=True, min_interval_s=60.0))
        queue = WorkerQueue(clock)
        queue.add(scheduler)
        with caplog.at_level(logging.WARNING, logger="device_runtime.scheduling"):
            runs = queue.run_until(START + 3600 + 600)
        assert runs and {run.population for run in runs} == {own}
        said = [r.getMessage() for r in caplog.records if "stored by another fedfleet version" in r.getMessage()]
        assert len(said) == 1 and repr(other) in said[0], said  # once, not at every pass
        assert [row[0] for row in _rows(db)] == ["digits", "text"]  # left as it is
    finally:
        scheduler.close()
