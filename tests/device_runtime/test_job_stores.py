"""A scheduler keeps its jobs in the app's SQLite database, or in memory on an emulated device:
both must schedule alike, down to the microsecond a stored time is kept to, or a simulated
device would not run as the real one does."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime.clock import VirtualClock
from device_runtime.conditions import DeviceState, TrainingConstraints, TrainingInterval
from device_runtime.scheduling import ParticipationScheduler, _to_dt, to_microsecond

GOOD = DeviceState(idle=True, charging=True, battery_level=0.9, unmetered_network=True)


class _Fixed:
    def current(self) -> DeviceState:
        return GOOD


# times a device's clock reads: unix seconds of this century, with sub-microsecond parts
TIMES = st.floats(min_value=1.0e9, max_value=4.0e9, allow_nan=False, allow_infinity=False)


@given(TIMES)
@settings(max_examples=2000, deadline=None)
def test_memory_times_are_kept_to_the_microsecond_as_stored_ones(ts):
    assert to_microsecond(ts) == _to_dt(ts).timestamp()


def test_memory_times_round_half_to_even_as_datetime_does():
    for ts in (1_767_225_600.0000005, 1_767_225_600.0000015, 1_767_225_600.9999996, 1_767_225_600.25):
        assert to_microsecond(ts) == _to_dt(ts).timestamp()


POPULATIONS = st.sampled_from(["digits", "text", "speech"])
# jobs due at one instant (the database's order among them is its own: compared sorted)
AT = st.one_of(st.sampled_from([1.0e9 + 30.0, 1.0e9 + 90.0]), TIMES)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("schedule"), POPULATIONS, AT, st.booleans()),
        st.tuples(st.just("cancel"), POPULATIONS),
        st.tuples(st.just("due"), TIMES),
    ),
    max_size=25,
)


def _apply(scheduler: ParticipationScheduler, ops: list[tuple]) -> list[object]:
    seen: list[object] = []
    for op in ops:
        if op[0] == "schedule":
            _, population, at, charging = op
            constraints = TrainingConstraints(requires_charging=charging)
            seen.append(scheduler.schedule(population, constraints, TrainingInterval(min_interval_s=60.0), start_at=at))
        elif op[0] == "cancel":
            seen.append(scheduler.cancel(op[1]))
        else:
            seen.append(sorted(scheduler.due(op[1])))
        seen.append((scheduler.next_run_at(), sorted(scheduler.jobs(), key=lambda j: (j.next_run_at, j.population))))
    return seen


@given(OPS)
@settings(max_examples=60, deadline=None)
def test_memory_and_stored_jobs_schedule_alike(ops):
    clock = VirtualClock(1.0e9)
    with tempfile.TemporaryDirectory() as tmp:
        stored = ParticipationScheduler(Path(tmp) / "app.db", _Fixed(), clock=clock)
        memory = ParticipationScheduler(None, _Fixed(), clock=clock)
        try:
            assert _apply(memory, ops) == _apply(stored, ops)
        finally:
            stored.close()
            memory.close()


def test_a_job_keeps_its_constraints_and_is_due_at_its_microsecond(tmp_path):
    clock = VirtualClock(1.0e9)
    for database in (None, tmp_path / "app.db"):
        scheduler = ParticipationScheduler(database, _Fixed(), clock=clock)
        constraints = TrainingConstraints(requires_charging=False, requires_battery_not_low=True)
        scheduler.schedule("digits", constraints, TrainingInterval(min_interval_s=60.0), start_at=1.0e9 + 0.1234567)
        assert scheduler.next_run_at() == 1.0e9 + 0.123457
        assert scheduler.due(1.0e9 + 0.1234561) == []  # before the stored microsecond
        assert scheduler.due(1.0e9 + 0.1234566) == [(1.0e9 + 0.123457, "digits")]  # rounds to it
        [job] = scheduler.jobs()
        assert job.constraints == constraints
        scheduler.close()


def test_a_workers_pass_reads_the_due_jobs_once_however_many_there_are(tmp_path):
    """A pass over n due jobs reads the due jobs once, then each job it runs alone: it read every
    due job again at each job's claim, n²/2 jobs unpickled in all (an app of 2,000 populations
    took a minute per pass, 3 s now)."""
    from sqlalchemy import event

    from device_runtime.conditions import StaticConditions

    scheduler = ParticipationScheduler(tmp_path / "app.db", StaticConditions(GOOD))
    for i in range(30):
        scheduler.schedule(f"population-{i}")
    scans: list[str] = []

    @event.listens_for(scheduler._jobs._store.engine, "before_cursor_execute")
    def heard(conn, cursor, statement, *args):  # the real engine's statements, heard
        if "next_run_time <=" in statement:
            scans.append(statement)

    runs = scheduler.queue.run_pending()
    assert sorted(run.population for run in runs) == sorted(f"population-{i}" for i in range(30))
    assert len(scans) == 1
    scheduler.close()
