"""What a simulated device keeps small: its random streams and its example store, which is
filled only when first read."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime.conditions import TrainingConstraints
from device_runtime.scheduling import ParticipationScheduler, SchedulerSettings
from emulator.fleet.sim_device import WAKE_AFTER_CHANGE_S, LazyExampleStore, SimConditions, StreamRandom
from example_store import ExampleSelector, InMemoryExampleStore

seeds = st.integers(0, 2**64 - 1)


@given(seed=seeds, k=st.integers(1, 200), lo=st.floats(-1e6, 1e6), width=st.floats(0, 1e6))
def test_a_stream_repeats_from_its_seed_and_stays_in_range(seed, k, lo, width):
    a, b = StreamRandom(seed), StreamRandom(seed)
    xs = [a.random() for _ in range(20)]
    assert xs == [b.random() for _ in range(20)]
    assert all(0.0 <= x < 1.0 for x in xs)
    assert a.getrandbits(k) == b.getrandbits(k) < 2**k
    assert lo <= a.uniform(lo, lo + width) <= lo + width
    assert 0 <= a.randrange(k) < k
    assert a.expovariate(1.0) >= 0.0


@given(seed=seeds)
def test_neighbouring_seeds_give_unrelated_streams(seed):
    other = (seed + 1) % 2**64
    a, b = StreamRandom(seed), StreamRandom(other)
    assert [a.getrandbits(64) for _ in range(4)] != [b.getrandbits(64) for _ in range(4)]


def test_a_stream_is_uniform_enough_for_the_fault_model():
    rng = StreamRandom(7)
    xs = np.array([rng.random() for _ in range(20_000)])
    counts = np.histogram(xs, bins=10, range=(0.0, 1.0))[0]
    # chi-square with 9 degrees of freedom: 27.9 is its 0.1% tail
    assert ((counts - 2000) ** 2 / 2000).sum() < 27.9


@given(n=st.integers(1, 60), seed=st.integers(0, 2**32 - 1), limit=st.integers(1, 80))
def test_the_lazy_store_answers_as_the_store_filled_at_start(n, seed, limit):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = rng.integers(0, 10, size=n).astype(np.int64)
    loads = []

    def examples():
        loads.append(1)
        return x, y

    lazy = LazyExampleStore("app:/ex", examples, clock=lambda: 100.0)
    assert loads == []  # nothing is built before the store is read
    eager = InMemoryExampleStore(clock=lambda: 100.0)
    eager.add("app:/ex", ({"x": xi, "y": yi} for xi, yi in zip(x, y)))
    selector = ExampleSelector("app:/ex", limit=limit)
    assert lazy.count(selector) == eager.count(selector) == min(n, limit)
    got = [(e["x"].tobytes(), int(e["y"])) for e in lazy.query(selector)]
    want = [(e["x"].tobytes(), int(e["y"])) for e in eager.query(selector)]
    assert got == want
    assert lazy.collections() == ["app:/ex"] and loads == [1]


_POPULATION = None


def _specs():
    global _POPULATION
    if _POPULATION is None:
        from emulator.fleet import FleetConfig, generate_population

        _POPULATION = [s for s in generate_population(FleetConfig.default().replace(devices=60)) if s.takes_part]
    return _POPULATION


class _Device:
    """What ``SimConditions`` reads of its device: its spec, its drawn faults and its time."""

    def __init__(self, spec, now: float, broken: tuple[float, float], net_down: tuple[float, float]) -> None:
        from types import SimpleNamespace

        self.spec = spec
        self.sim = SimpleNamespace(
            epoch=0.0, horizon_s=86_400.0
        )  # unix time is the run's time: no rounding through an epoch
        self._now = now
        self.broken_from, self.broken_until = broken
        self.net_down_from, self.net_down_until = net_down
        self.clock = SimpleNamespace(now=lambda: self.sim.epoch + self._now)

    def now(self) -> float:
        return self._now


#: A fault's window as (start, length) from the job run's start, or none drawn.
_window = st.one_of(st.none(), st.tuples(st.floats(-7_200, 7_200), st.floats(60, 3_600)))


def _at(now: float, window: tuple[float, float] | None) -> tuple[float, float]:
    return (-1.0, -1.0) if window is None else (now + window[0], now + window[0] + window[1])


def _end_job(device: _Device, now: float) -> None:
    """What ``SimDevice._end_job`` does to the faults: those not yet under way end with the run."""
    if device.broken_from > now:
        device.broken_from = device.broken_until = -1.0
    if device.net_down_from > now:
        device.net_down_from = device.net_down_until = -1.0


def _waking_at_every_change(device: _Device, conditions: SimConditions, constraints, t: float) -> float:
    """Where a device that wakes at every change of its conditions after ``t`` first finds
    ``constraints`` held (as unix time, a hair after the change), or past the run's end."""
    for _ in range(10_000):
        nxt = conditions.next_change(device.sim.epoch + t)
        if nxt is None:
            return device.sim.epoch + device.sim.horizon_s + 1.0  # they never hold again
        t = device._now = nxt - device.sim.epoch
        if constraints.satisfied(conditions.current()):
            return device.sim.epoch + t + WAKE_AFTER_CHANGE_S
    raise AssertionError("more changes than a day holds")


_CONSTRAINTS = st.builds(TrainingConstraints, st.booleans(), st.booleans(), st.booleans(), st.booleans())


@settings(max_examples=300)
@given(
    which=st.integers(0, 10_000), now=st.floats(0, 86_400), broken=_window, net_down=_window, constraints=_CONSTRAINTS
)
def test_the_next_moment_constraints_hold_is_where_waking_at_every_change_gets(
    which, now, broken, net_down, constraints
):
    """``next_satisfied``, asked during a job run that found the constraints unmet, names the
    moment a device waking at every change of its conditions would first find them held, or a
    moment past the run's end if they never hold again: the run's faults not yet under way end
    with it (``_end_job``), so those do not count."""
    spec = _specs()[which % len(_specs())]
    device = _Device(spec, now, _at(now, broken), _at(now, net_down))
    conditions = SimConditions(device)
    assert device.clock.now() == device.sim.epoch + now
    got = conditions.next_satisfied(constraints, device.clock.now())
    _end_job(device, now)
    assert got == _waking_at_every_change(device, conditions, constraints, now)


@settings(max_examples=300)
@given(
    which=st.integers(0, 10_000),
    now=st.floats(0, 86_400),
    later=st.floats(0, 30_000),
    broken=_window,
    net_down=_window,
    constraints=_CONSTRAINTS,
)
def test_a_job_due_later_wakes_when_its_constraints_first_hold_from_then_on(
    which, now, later, broken, net_down, constraints
):
    """``first_satisfied``, asked by a job run rescheduling itself ``later`` seconds on, names
    that moment if the constraints hold then, and otherwise where a device that woke then and
    at every change after it would first find them held (or past the run's end): the job never
    wakes to find its constraints unmet."""
    spec = _specs()[which % len(_specs())]
    device = _Device(spec, now, _at(now, broken), _at(now, net_down))
    conditions = SimConditions(device)
    at = device.sim.epoch + now + later
    got = conditions.first_satisfied(constraints, at, device.clock.now())
    _end_job(device, now)
    device._now = now + later
    if constraints.satisfied(conditions.current()):
        assert got == at
    else:
        assert got == _waking_at_every_change(device, conditions, constraints, now + later)


@settings(max_examples=200)
@given(
    which=st.integers(0, 10_000),
    now=st.floats(0, 86_400),
    broken=_window,
    net_down=_window,
    constraints=_CONSTRAINTS,
    epoch=st.sampled_from([0.0, 1_767_225_600.0]),
    steps=st.lists(st.one_of(st.floats(0.0, 2.0), st.floats(0.0, 1_800.0)), max_size=60),
)
def test_the_per_step_check_gives_what_reading_the_conditions_every_step_gives(
    which, now, broken, net_down, constraints, epoch, steps
):
    """A session's per-step check reads conditions that know their future once, then only when
    the device's clock (unix time through the run's epoch, where sums round) reaches the moment
    they stop holding (``first_unsatisfied``): at every step it says what reading them says."""
    spec = _specs()[which % len(_specs())]
    device = _Device(spec, now, _at(now, broken), _at(now, net_down))
    device.sim.epoch = epoch
    conditions = SimConditions(device)
    scheduler = ParticipationScheduler(None, conditions, clock=device.clock, settings=SchedulerSettings(watchdog=False))
    check = scheduler._unmet_check(constraints)
    for step in [0.0, *steps]:
        device._now += step
        assert check() is (not constraints.satisfied(conditions.current()))
