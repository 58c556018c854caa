"""The quiet period after a job's constraints stopped holding (``SchedulerSettings.settle_s``):
conditions that flap (a loose charger, the screen going on and off) had a job check in at each
return, take a seat and drop it at the next change. A job that saw its constraints unmet checks in
only once they have held again for ``settle_s``: looked at when they return and ``settle_s``
later, and throughout for conditions that tell when they next stop holding. Checked on virtual
time against flapping conditions, with no runtime registered: each run that would check in ends
``NO_RUNTIME`` instead."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from device_runtime.clock import VirtualClock
from device_runtime.conditions import DeviceState, StaticConditions, TrainingConstraints, TrainingInterval
from device_runtime.scheduling import ParticipationScheduler, RunOutcome, SchedulerSettings, WorkerQueue

GOOD = DeviceState(idle=True, charging=True, battery_level=0.9, unmetered_network=True)
UNPLUGGED = DeviceState(idle=True, charging=False, battery_level=0.9, unmetered_network=True)
T0 = VirtualClock().now()


class Flapping:
    """Charging but in ``dips`` ([start, end) pairs of seconds from ``T0``); tells when it changes."""

    def __init__(self, clock: VirtualClock, dips: list[tuple[float, float]]) -> None:
        self.clock, self.dips = clock, [(T0 + a, T0 + b) for a, b in dips]

    def unplugged_at(self, t: float) -> bool:
        return any(a <= t < b for a, b in self.dips)

    def current(self) -> DeviceState:
        return UNPLUGGED if self.unplugged_at(self.clock.now()) else GOOD

    def next_change(self, now: float) -> float | None:
        return min((t for dip in self.dips for t in dip if t > now), default=None)


class ForeseenFlapping(Flapping):
    """The same, able to tell when the constraints next stop holding (a replayed trace)."""

    def first_unsatisfied(self, constraints: TrainingConstraints, now: float) -> float | None:
        return min((a for a, _ in self.dips if a > now), default=None)


def _attempts(conditions: Flapping, clock: VirtualClock, settle_s: float, until: float) -> list:
    queue = WorkerQueue(clock, history=0)
    settings = SchedulerSettings(recheck_s=60.0, jitter=0.0, watchdog=False, settle_s=settle_s)
    scheduler = ParticipationScheduler(None, conditions, clock=clock, queue=queue, settings=settings)
    scheduler.schedule("digits", TrainingConstraints(), TrainingInterval(), start_at=T0 + 10.0)
    return queue.run_until(T0 + until)


def test_a_job_that_saw_its_constraints_unmet_checks_in_only_after_the_quiet_period():
    """Due at 10 s, unplugged from 5 to 20 s: it checked in at 20 s, the moment the charger
    came back; it looks then, and checks in 60 s later, the charger still in."""
    clock = VirtualClock()
    runs = _attempts(Flapping(clock, [(5.0, 20.0)]), clock, 60.0, 100.0)
    assert [(r.outcome, r.started_at - T0) for r in runs] == [
        (RunOutcome.CONSTRAINTS_UNMET, 10.0),
        (RunOutcome.CONSTRAINTS_UNMET, 20.0),  # settling
        (RunOutcome.NO_RUNTIME, 80.0),
    ]
    assert runs[1].detail.startswith("settling")
    clock = VirtualClock()  # without the quiet period: at once
    runs = _attempts(Flapping(clock, [(5.0, 20.0)]), clock, 0.0, 100.0)
    assert [(r.outcome, r.started_at - T0) for r in runs][:2] == [
        (RunOutcome.CONSTRAINTS_UNMET, 10.0),
        (RunOutcome.NO_RUNTIME, 20.0),
    ]


def test_a_look_that_finds_them_unmet_at_the_end_of_the_quiet_period_starts_it_again():
    clock = VirtualClock()
    runs = _attempts(Flapping(clock, [(5.0, 20.0), (75.0, 90.0)]), clock, 60.0, 200.0)
    assert [(r.outcome, r.started_at - T0) for r in runs] == [
        (RunOutcome.CONSTRAINTS_UNMET, 10.0),
        (RunOutcome.CONSTRAINTS_UNMET, 20.0),  # settling
        (RunOutcome.CONSTRAINTS_UNMET, 80.0),  # unplugged again
        (RunOutcome.CONSTRAINTS_UNMET, 90.0),  # settling
        (RunOutcome.NO_RUNTIME, 150.0),
    ]


#: Whole seconds: a change between two microseconds woke a job a hair before it, for ever, as it
#: would in any run of the scheduler on such conditions (a simulation's wake a hair after a change).
dips = st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 120)).map(lambda d: (d[0], d[0] + d[1])), max_size=12)


@given(dips=dips, settle_s=st.sampled_from([10.0, 60.0, 300.0]))
def test_after_its_constraints_failed_a_job_checks_in_only_once_they_held_for_the_quiet_period(dips, settle_s):
    """With conditions that tell when they next stop holding, every check-in after a look that
    found them unmet comes after ``settle_s`` of them holding without a break; with conditions
    that only tell their changes, they held at its start and at the check-in."""
    for kind in (ForeseenFlapping, Flapping):
        clock = VirtualClock()
        conditions = kind(clock, dips)
        saw_unmet = False
        for run in _attempts(conditions, clock, settle_s, 3000.0):
            if run.outcome is RunOutcome.CONSTRAINTS_UNMET and not run.detail.startswith("settling"):
                saw_unmet = True
            if run.outcome is RunOutcome.NO_RUNTIME and saw_unmet:  # its first check-in since
                t = run.started_at
                assert not conditions.unplugged_at(t) and not conditions.unplugged_at(t - settle_s)
                if kind is ForeseenFlapping:
                    assert not any(a < t and b > t - settle_s for a, b in conditions.dips)
                saw_unmet = False


def test_a_restarted_app_keeps_the_quiet_period(tmp_path):
    """Where the job stands is in the app's job store: an app restarted after its job saw the
    constraints unmet does not check in the moment they hold."""
    clock = VirtualClock()
    conditions = StaticConditions(UNPLUGGED)
    settings = SchedulerSettings(recheck_s=60.0, jitter=0.0, settle_s=60.0)
    scheduler = ParticipationScheduler(tmp_path / "app.db", conditions, clock=clock, settings=settings)
    scheduler.schedule("digits")
    assert [r.outcome for r in scheduler.queue.run_pending()] == [RunOutcome.CONSTRAINTS_UNMET]
    scheduler.close()
    conditions.state = GOOD
    clock.advance(60.0)
    restarted = ParticipationScheduler(tmp_path / "app.db", conditions, clock=clock, settings=settings)
    [run] = restarted.queue.run_pending()
    assert run.outcome is RunOutcome.CONSTRAINTS_UNMET and run.detail.startswith("settling")
    clock.advance(60.0)
    assert [r.outcome for r in restarted.queue.run_pending()] == [RunOutcome.NO_RUNTIME]
    restarted.close()
