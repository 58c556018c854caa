"""The default fleet reproduces the paper's profile (Bonawitz et al. 2019, sec. 2.3, 9, Table 1,
Fig. 5-6) within the stated bounds, on a small fleet: 400 devices of the default population for a
day, with the round goal scaled to the fleet (10 instead of 100, the same 130% over-selection,
and a selection window long enough for a small fleet's trough).

On session shapes: every selected device that neither dropped out nor reported before its round
closed ends ``#``, so ``^ + # + drop-out`` covers the sessions; a round that always made its goal
would accept ``goal / selected`` (77%) of them and leave ``#`` at 23% minus the drop-out. The
default reporting window closes some rounds on it, short of the goal, which is what brings the
shares to Table 1's 75/22 with the paper's 6-10% drop-out."""

from __future__ import annotations

import statistics

import pytest

from emulator.fleet import FleetConfig, simulate
from emulator.fleet.report import is_dropout

#: The module's fleets are built once per run: its tests go to one pytest-xdist worker, and its fixtures
#: are session-scoped, so that no test run between two of them makes the worker build them again.
pytestmark = pytest.mark.xdist_group("test_fidelity")

GOAL = 10


def _day(seed: int):
    data = FleetConfig.default().replace(devices=400, hours=24.0, seed=seed).model_dump()
    data["task"].update(goal_count=GOAL, selection_timeout_s=600.0)
    return simulate(FleetConfig.from_dict(data), progress=False)


@pytest.fixture(scope="session")
def day():
    return _day(0)


def _share(summary: dict, predicate) -> float:
    return sum(v for k, v in summary["shape_shares"].items() if predicate(k))


def _dropout_rate(*runs) -> float:
    accepted = [s for run in runs for s in run.sessions if s.accepted]
    return sum(1 for s in accepted if is_dropout(s)) / len(accepted)


def test_dropout_is_six_to_ten_percent_of_a_day(day):
    """The same bound on the one day the other tests read (seed 0: 6.45%, the same every run); the
    slow twin below pools three days, as a single day's rate moves by about a point from seed to
    seed (each day of 400 devices costs about 35 s of CPU)."""
    assert 0.06 <= _dropout_rate(day) <= 0.10


@pytest.mark.slow
def test_dropout_is_six_to_ten_percent(day):
    """A fleet this small has a few hundred sessions: its rate moves by about a point from seed
    to seed (5.9% to 8.2% over seeds 0-7), so the bound holds for three days pooled."""
    assert 0.06 <= _dropout_rate(day, _day(1), _day(2)) <= 0.10


def test_dropout_is_higher_by_day_than_at_night_local_time(day):
    """Appendix A (Fig. 7): "the drop out rate is higher during the day time compared to the night
    time", as a phone in use leaves its conditions. Seed 0: 6.5% of the sessions starting between
    0:00 and 6:00 on the device's clock, 8.1% between 6:00 and 18:00 (seed 1: 7.3% and 9.1%)."""

    def rate(lo: float, hi: float) -> float:
        ended = [s for s in day.sessions if s.accepted and s.outcome != "unfinished" and lo <= s.local_hour < hi]
        return sum(1 for s in ended if is_dropout(s)) / len(ended)

    assert rate(6.0, 18.0) > rate(0.0, 6.0)


def test_session_shapes_are_within_five_points_of_table_1(day):
    summary = day.summary()
    assert abs(_share(summary, lambda s: s == "-v[]+^") - 0.75) <= 0.05
    assert abs(_share(summary, lambda s: s == "-v[]+#") - 0.22) <= 0.05
    assert abs(_share(summary, lambda s: s.endswith("!")) - 0.02) <= 0.05


def test_some_rounds_close_on_their_window_short_of_the_goal(day):
    summary = day.summary()
    completed = _share(summary, lambda s: s.endswith("^"))
    committed = [r for r in day.rounds if r.committed]
    selected = statistics.mean(r.selected for r in committed)
    assert any(r.accepted < GOAL for r in committed)
    # so fewer sessions are accepted than a round's goal over its selection (1/1.3)
    assert completed < GOAL / selected


def test_available_devices_swing_three_to_five_times_over_the_day(day):
    assert 3.0 <= day.summary()["availability_swing"] <= 5.0


def test_rounds_commit_at_the_papers_over_selection(day):
    committed = [r for r in day.rounds if r.committed]
    assert len(committed) >= 0.85 * len(day.rounds)
    full = sum(1 for r in committed if r.selected == 13)  # ceil(10 * 130%)
    assert full >= 0.75 * len(committed)
    assert all(r.accepted >= 8 for r in committed)  # min_fraction 0.8 of the goal
