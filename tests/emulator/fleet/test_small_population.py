"""A small population's rounds fill (paper, section 2.3: "in the case of small device populations,
pace steering is used to ensure that a sufficient number of devices connect to the server
simultaneously"). Its devices check in of themselves an hour apart, a few dozen in a selection
window of 5 minutes: without a rendezvous every round after the fleet's first burst timed out
with too few devices and was abandoned (2,000 devices: 3 of 70 rounds in 6 hours)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from emulator.fleet import FleetConfig, simulate
from emulator.fleet.tables import UNFINISHED, RoundRow
from server_stub.rounds import RoundConfig


def _seats(config: FleetConfig) -> int:
    return RoundConfig(goal_count=config.task.goal_count, over_selection=config.task.over_selection).selection_target


def test_a_small_fleets_rounds_fill_their_seats():
    """The lighter twin: 250 devices with rounds of 11 seats (goal 8) for 3 hours, 10-20 s of wall
    time. Its rounds are too small to commit as reliably as rounds of 100 (two drop-outs or late
    reports too many abandon one), so what is held is what pace steering decides: rounds gather
    their seats (before: 4 of 33)."""
    config = FleetConfig.default().replace(devices=250, hours=3.0, goal=8)
    run = simulate(config, progress=False)
    seats = _seats(config)
    full = sum(1 for r in run.rounds if r.selected >= seats)
    assert len(run.rounds) >= 10
    assert full >= 0.75 * len(run.rounds), [(r.round_id, r.selected) for r in run.rounds]


def test_a_small_fleet_of_short_selection_windows_waits_for_its_devices_instead_of_opening_short():
    """The glyphs fleet (rounds of 10 seats, a 30 s selection window) at 600 devices for 2 hours, a
    few seconds of wall time. A device that took part comes back about an hour later, so after the
    first rounds few are left to check in; a selection opened on them is abandoned and spends their
    participation for nothing. With a selection opened after at most 3 deferrals, 19 of 44 rounds
    committed; waiting up to 10 deferrals, 24 of 30."""
    root = Path(__file__).resolve().parents[3]
    config = FleetConfig.load(root / "examples" / "fleets" / "glyphs.toml").replace(devices=600, hours=2.0)
    summary = simulate(config, progress=False).summary()
    assert summary["rounds_committed"] >= 15
    assert summary["round_completion_rate"] >= 0.7, summary["round_completion_note"]


@pytest.mark.slow
def test_two_thousand_devices_commit_nine_in_ten_rounds_with_the_default_task():
    """2,000 devices, the default task (goal 100, 130 seats), 3 simulated hours (before: 3 of
    the first 37 rounds committed)."""
    config = FleetConfig.default().replace(devices=2000, hours=3.0)
    run = simulate(config, progress=False)
    summary = run.summary()
    assert summary["rounds"] >= 8
    assert summary["round_completion_rate"] >= 0.9, summary["round_completion_note"]
    assert summary["cannot_fill"] is None


def _round(n: int, committed: bool, selected: int) -> RoundRow:
    return RoundRow(
        round_id=f"train/{n}/1",
        task="train",
        start_s=300.0 * n,
        end_s=300.0 * n + 300.0,
        committed=committed,
        selected=selected,
        reported=selected,
        accepted=selected if committed else 0,
        dropped=0,
        duration_s=300.0,
        accuracy=float("nan"),
        loss=float("nan"),
    )


def test_the_completion_rate_names_rounds_short_of_check_ins_and_the_options_to_change():
    from emulator.fleet.report import completion_note

    config = FleetConfig.default()
    rounds = [_round(1, True, 130), _round(2, False, 40), _round(3, False, 60), _round(4, False, 120)]
    summary = {"cannot_fill": None, "shapes": {"-v[]+^": 90, "-v[]+#": 40}}
    note = completion_note(summary, rounds, config.task)
    assert note.startswith(
        "3 of 4 rounds were abandoned: 2 closed their selection window (task.selection_timeout_s = 300 s)"
    )
    assert "fewer than the 80 devices a commit needs, for lack of check-ins" in note and "--devices" in note
    assert "a longer window (--sweep selection_timeout_s=1200, or [task] selection_timeout_s in a fleet config)" in note
    assert (
        "1 had too few reports in time (it selected 120 devices: 0 reported in time, 120 late, 0 dropped out): "
        "40 of the 130 sessions that trained reported after" in note
    )
    assert "task.report_timeout_s = 180 s" in note
    assert (
        completion_note(summary, [_round(1, True, 130), _round(2, True, 130)], config.task) == "all 2 rounds committed"
    )
    assert completion_note(summary, [], config.task) is None
    cut = dataclasses.replace(_round(1, False, 130), reported=91, outcome=UNFINISHED)  # a million devices' 3 minutes
    assert completion_note({**summary, "simulated_s": 180.0}, [cut], config.task) == (
        "the run ended at 0.05 simulated hours with its first round still open, 130 devices selected and 91 "
        "reported (task.report_timeout_s = 180 s from check-in); simulate more --hours"
    )
    assert completion_note(
        {"cannot_fill": "no round can fill: ..."}, [dataclasses.replace(cut, selected=1, reported=0)], None
    ) == ("the run ended with its first round still open, 1 device selected and 0 reported: no round can fill: ...")
    # sessions selected into a round that was abandoned before they trained (-v#) are not late reports
    untrained = {**summary, "shapes": {**summary["shapes"], "-v#": 500}}
    assert "40 of the 130 sessions that trained reported after" in completion_note(untrained, rounds, config.task)


def test_rounds_short_of_reports_are_told_with_their_own_devices_which_add_up_to_those_selected():
    """A round that filled its seats and was abandoned is told by what became of its own devices
    (reported in time, late, dropped out, still at work when it closed: together its selected), not
    by the run's totals, which the committed rounds swell: 1,000 devices' three secure hours lost
    their first round with 62 of 92 in time while 319 of the run's 482 sessions reported in time."""
    from emulator.fleet.report import completion_note

    config = FleetConfig.default()
    first = dataclasses.replace(_round(1, False, 92), reported=62, accepted=62, dropped=30)
    late = dataclasses.replace(_round(3, False, 130), reported=90, accepted=70, dropped=25)  # 15 still at work
    rounds = [first, _round(2, True, 130), late, _round(4, True, 130)]
    summary = {"cannot_fill": None, "shapes": {"-v[]+^": 319, "-v[]+#": 76}, "sessions_accepted": 482}
    note = completion_note(summary, rounds, config.task)
    assert note.startswith("2 of 4 rounds were abandoned: 2 had too few reports in time (each needs 80; ")
    assert (
        "they selected 222 devices: 132 reported in time, 20 late, 55 dropped out, 15 still at work when the round "
        "closed" in note
    )
    assert "482" not in note and "319" not in note
    assert "it selected 92 devices: 62 reported in time, 0 late, 30 dropped out)" in completion_note(
        summary, rounds[:2], config.task
    )
    # past a quarter of the trained sessions late, the same counts lead the late reports' clause
    many_late = {**summary, "shapes": {"-v[]+^": 90, "-v[]+#": 40}}
    assert "2 had too few reports in time (they selected 222 devices: 132 reported in time, 20 late" in (
        completion_note(many_late, rounds, config.task)
    )
    # a secure round explained by its lost group is not among them
    secure = {
        "train/1/1": {"groups": 1, "completed": 0, "aborted": 1, "aborted_in": {"MaskedInputCollection": 1}},
        "train/3/1": {"groups": 1, "completed": 1, "aborted": 0, "aborted_in": {}},
    }
    note = completion_note(summary, rounds, config.task, secure)
    assert "1 lost 1 of their 1 Secure Aggregation groups" in note
    assert (
        "1 had too few reports in time (each needs 80; it selected 130 devices: 70 reported in time, 20 late, 25 "
        "dropped out or sent their masked input too late for their group, 15 still at work" in note
    )
