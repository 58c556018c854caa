"""A fleet run that goes wrong says why: each session's row carries the code that ended it (the
server's code of a refused report or its reason for a rejected check-in, the device's typed error,
the reason an interruption gives), the summary counts them by code and says each cause in a
sentence with the option to change (``failure_notes``), and the report and the command's stderr
say the same. Each run here is a real fleet of 60 devices for a simulated hour (about a second)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from device_runtime.eligibility import EligibilityPolicies
from emulator.cli.commands import main
from emulator.fleet import FleetConfig, FleetRun, simulate
from emulator.fleet.report import render_html
from emulator.fleet.summary import PACING, completion_note, ended_by, failure_notes
from emulator.fleet.tables import RoundRow, SessionRow
from server_stub.service import TaskSpec


def _config(*, fleet: dict | None = None, task: dict | None = None, **sections: object) -> FleetConfig:
    data = FleetConfig.default().model_dump()
    data["fleet"].update({"devices": 60, "hours": 1.0, "start_utc_hour": 6.0, "seed": 1, **(fleet or {})})
    data["task"].update(
        {"goal_count": 6, "retry_min_s": 60.0, "retry_max_s": 300.0, "selection_timeout_s": 300.0, **(task or {})}
    )
    data.update(sections)
    return FleetConfig.from_dict(data)


def _codes(run: FleetRun, outcome: str) -> set[str]:
    return {s.code for s in run.sessions if s.outcome == outcome}


def _note(summary: dict, word: str) -> str:
    found = [n for n in summary["failure_notes"] if word in n]
    assert len(found) == 1, summary["failure_notes"]
    return found[0]


@pytest.fixture(scope="module")
def diverged() -> FleetRun:
    """A learning rate of 1e9: some sessions train to NaN, and their updates are refused."""
    return simulate(_config(fleet={"devices": 40}, task={"learning_rate": 1e9}), progress=False)


def test_a_diverging_learning_rate_is_named_as_invalid_update_in_the_rows_summary_and_report(diverged, tmp_path):
    invalid = [s for s in diverged.sessions if s.code == "INVALID_UPDATE"]
    assert invalid and all(s.outcome == "report_rejected" for s in invalid)
    summary = diverged.summary()
    assert summary["reports_refused"]["INVALID_UPDATE"] == len(invalid)
    note = _note(summary, "INVALID_UPDATE")
    assert note.startswith(f"{len(invalid)} session") and "--sweep learning_rate=1e6" in note
    page = render_html(summary, [], diverged)
    assert "Why sessions failed" in page and "refused as INVALID_UPDATE" in page
    # the table keeps the code of each session, and reads back whole
    diverged.write_tables(tmp_path)
    assert SessionRow.from_csv(tmp_path / "sessions.csv") == diverged.sessions
    header = (tmp_path / "sessions.csv").read_text(encoding="utf-8").splitlines()[0]
    assert header.endswith(",summed,code")


def _round_note(refused: dict[str, int]) -> str:
    """The completion note of one abandoned round of 8 seated devices, 6 of whose reports the
    server refused by ``refused``'s codes after training, 2 summed."""
    lost = RoundRow("t/1/1", "t", 0.0, 200.0, False, 8, 8, 2, 0, 200.0, math.nan, math.nan, outcome="abandoned")
    summary = {"shapes": {"-v[]+#": 6, "-v[]+^": 2}, "sessions_accepted": 8, "errors": {}, "reports_refused": refused}
    return completion_note(summary, [lost], _config().task)


def test_a_refused_report_never_counts_as_late_unless_the_server_said_so():
    """Before the codes, every report refused after training (shape ``-v[]+#``) was said to have
    come late: a round lost to updates the server refused as INVALID_UPDATE was told to lengthen
    its report window."""
    note = _round_note({"INVALID_UPDATE": 6})
    assert "window closed" not in note and "the server refused 6 reports as INVALID_UPDATE" in note
    late = _round_note({"REPORT_LATE": 6})
    assert "6 of the 8 sessions that trained reported after their round's window closed" in late


def test_late_reports_are_told_with_the_report_window_the_server_ran_not_the_fleets_default():
    """A task file's own RoundConfig holds where the fleet config sets no window: the digits task's
    60 s, which the note named as the fleet's default 180 s, so that a user lengthening the window
    was told it already was three times what it was."""
    task_file = Path(__file__).resolve().parents[3] / "examples" / "tasks" / "digits_task.py"
    config = FleetConfig.from_dict(
        {"fleet": {"devices": 200, "hours": 1.0}, "task": {"file": str(task_file)}, "data": {"format": "digits"}}
    )
    summary = simulate(config, progress=False).summary()
    note = _note(summary, "REPORT_LATE")
    assert "(task.report_timeout_s = 60 s from check-in)" in note, note


def test_devices_whose_runtime_the_plan_does_not_serve_are_named_with_their_release():
    versions = [{"version": "1.10.0", "share": 0.5}, {"version": "1.20.0", "share": 0.5}]
    run = simulate(_config(fleet={"hours": 0.5}, runtime_versions=versions), progress=False)
    refused = [s for s in run.sessions if s.code == "RUNTIME_VERSION_UNSUPPORTED"]
    assert refused and {s.runtime_version for s in refused} == {"1.10.0"}
    assert all(s.outcome == "rejected" for s in refused)
    summary = run.summary()
    assert summary["checkins_rejected_by"]["RUNTIME_VERSION_UNSUPPORTED"] == len(refused)
    note = _note(summary, "RUNTIME_VERSION_UNSUPPORTED")
    assert "onnxruntime 1.10.0" in note and f"{len(refused)} times" in note and "Task.opset" in note


def test_a_plan_too_big_for_a_device_class_names_the_class_and_overbudget():
    classes = [
        {"name": "tiny", "share": 0.5, "speed": 1.0, "memory_mb": 1},
        {"name": "mid", "share": 0.5, "speed": 1.0, "memory_mb": 4096},
    ]
    run = simulate(
        _config(fleet={"min_memory_mb": 0, "hours": 0.25}, task={"hidden": [256]}, device_classes=classes),
        progress=False,
    )
    over = [s for s in run.sessions if s.code == "OverBudget"]
    assert over and {s.device_class for s in over} == {"tiny"} and all(s.outcome == "error" for s in over)
    summary = run.summary()
    assert summary["errors"]["OverBudget"] == len(over)
    note = _note(summary, "OverBudget")
    assert "tiny devices" in note and "task.batch_size" in note
    assert f"{len(over)} sessions ended in OverBudget" in summary["round_completion_note"]


def test_ineligible_devices_are_named_with_the_policy_they_fail(monkeypatch):
    from emulator.fleet import simulator

    eligibility = EligibilityPolicies(min_examples=60)
    monkeypatch.setattr(simulator, "TaskSpec", _deployed_with(eligibility))
    run = simulate(_config(fleet={"devices": 30, "hours": 0.5}), progress=False)
    assert "INELIGIBLE:min_examples" in _codes(run, "rejected")
    summary = run.summary()
    note = _note(summary, "ineligible")
    assert "INELIGIBLE:min_examples" in note and "[data] examples_min" in note
    assert "as INELIGIBLE:min_examples" in summary["round_completion_note"]


def test_sessions_stopped_at_the_training_limit_say_so_with_the_limit():
    run = simulate(
        _config(fleet={"hours": 0.5}, task={"compute_s_per_example": 20.0, "report_timeout_s": 1000.0}), progress=False
    )
    limit = "over the device's training time (1000.0 s, max_training_s)"
    stopped = [s for s in run.sessions if s.code == limit]
    assert stopped and all(s.outcome == "interrupted" and s.shape == "-v[!" for s in stopped)
    summary = run.summary()
    assert summary["sessions_interrupted"][limit] == len(stopped)
    note = _note(summary, "time limit")
    assert limit in note and "task.compute_s_per_example" in note


def test_a_few_slow_devices_at_their_time_limit_are_the_fleets_ordinary_life_not_a_failure():
    """A default 2,000-device run printed "2 sessions trained past their time limit" of its thousands."""
    limit = "over the device's training time (600.0 s, max_training_s)"
    done = [_row("", "completed", shape="-v[]+^") for _ in range(40)]

    def notes(stopped: int) -> list[str]:
        class Run:
            sessions = [*done, *(_row(limit, "interrupted", shape="-v[!") for _ in range(stopped))]
            config = _config()
            extra: dict = {}
            devices_short_of_memory = 0
            rounds: list = []

        return failure_notes(Run())  # type: ignore[arg-type]

    assert notes(1) == []  # 1 of 41 accepted
    assert len(notes(3)) == 1 and notes(3)[0].startswith("3 sessions trained past their time limit")


@pytest.mark.slow
def test_dp_noise_that_leaves_the_model_at_chance_says_so_with_the_noise_and_the_options():
    config = _config(fleet={"hours": 0.5}, dp={"mode": "central", "noise_multiplier": 20.0})
    run = simulate(config, progress=False)
    summary = run.summary()
    chance = summary["chance_accuracy"]
    assert 0.09 < chance < 0.12  # the digits' test set: ten classes, nearly even
    assert summary["accuracy"] is not None and summary["accuracy"] <= chance + 0.05
    note = _note(summary, "at chance")
    assert "noise multiplier 20" in note and "--noise-multiplier" in note and "--goal" in note
    # a model clearly above chance (here: were chance a tenth as high) is not said to be at it
    above = dataclasses.replace(run, extra={**run.extra, "chance_accuracy": chance / 10})
    assert not [n for n in above.summary()["failure_notes"] if "at chance" in n]


@pytest.mark.slow
def test_masked_inputs_their_secure_groups_never_summed_are_counted_by_code():
    run = simulate(_config(fleet={"devices": 40, "hours": 0.5}, task={"secure": True}), progress=False)
    summary = run.summary()
    lost = {c: n for c, n in summary["reports_refused"].items() if c.startswith("SECAGG_")}
    assert lost and sum(lost.values()) == sum(1 for s in run.sessions if s.code in lost)
    assert f"{sum(lost.values())} masked inputs were never summed" in _note(summary, "masked input")


def test_the_command_says_each_cause_on_stderr_and_the_summary_line_holds_the_counts(tmp_path, capsys):
    config = tmp_path / "fleet.toml"
    config.write_text(
        "[fleet]\nstart_utc_hour = 6.0\n[task]\nretry_min_s = 60.0\nretry_max_s = 300.0\n"
        '[[runtime_versions]]\nversion = "1.10.0"\nshare = 0.5\n[[runtime_versions]]\nversion = "1.20.0"\nshare = 0.5\n',
        encoding="utf-8",
    )
    args = ["simulate", str(config), "--devices", "60", "--hours", "0.5", "--goal", "6", "--seed", "1", "--no-progress"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    turned = summary["checkins_rejected_by"]["RUNTIME_VERSION_UNSUPPORTED"]
    assert f"fedfleet simulate: {summary['failure_notes'][-1]}" in err.splitlines()
    assert f"turned away {turned} times (RUNTIME_VERSION_UNSUPPORTED)" in err


def _row(code: str, outcome: str, **kw: object) -> SessionRow:
    base = dict(
        device_id="d1", session_id="s" if outcome != "rejected" else "", task="t", round_id="t/1",
        start_s=0.0, end_s=1.0, shape="-v[*" if outcome == "error" else "-", outcome=outcome, bytes_down=0,
        bytes_up=0, examples=0, compute_s=0.0, network_s=0.0, runtime_version="1.15.1", device_class="low",
        local_hour=0.0, code=code,
    )  # fmt: skip
    return SessionRow(**{**base, **kw})  # type: ignore[arg-type]


def test_a_plan_the_devices_cannot_load_or_feed_is_named_with_the_releases_and_classes():
    """A device's typed error is its cause; the fleet's network faults and pace steering are not."""

    class Run:
        sessions = [
            _row("PlanError", "error"),
            _row("PlanError", "error", device_id="d2", runtime_version="1.16.3"),
            _row("ServerUnreachable", "error"),
            *(_row(code, "rejected") for code in sorted(PACING)),
        ]
        config = None
        extra: dict = {}
        devices_short_of_memory = 0
        rounds: list = []

    notes = failure_notes(Run())  # type: ignore[arg-type]
    assert len(notes) == 1, notes
    assert notes[0].startswith("2 sessions failed on onnxruntime 1.15.1, 1.16.3 (low devices) with PlanError")


def test_a_report_so_late_that_the_server_forgot_its_session_is_counted_as_late():
    """The server keeps the sessions of its open rounds and of the last closed one: a report later
    than that is answered BAD_SESSION_TOKEN, which the notes gave as a refusal of its own ("refused by
    the server (BAD_SESSION_TOKEN)") beside the late ones, as if a device had sent a forged token."""

    class Run:
        sessions = [
            *(_row("REPORT_LATE", "report_rejected", shape="-v[]+#") for _ in range(3)),
            _row("BAD_SESSION_TOKEN", "report_rejected", shape="-v[]+#"),
            _row("", "completed", shape="-v[]+^"),
        ]
        config = _config()
        extra: dict = {}
        devices_short_of_memory = 0
        rounds: list = []

    notes = failure_notes(Run())  # type: ignore[arg-type]
    assert len(notes) == 1, notes
    assert notes[0].startswith("4 reports came after their round's window had closed"), notes
    assert "BAD_SESSION_TOKEN for 1, whose rounds had closed before the last one" in notes[0]
    note = _round_note({"REPORT_LATE": 4, "BAD_SESSION_TOKEN": 2})
    assert "6 of the 8 sessions that trained reported after their round's window closed" in note, note
    assert "BAD_SESSION_TOKEN" not in note


def test_secure_aggregation_outcomes_are_one_sentence_with_each_code_counted():
    """The light twin of the secure fleet's test (marked slow): its devices' outcomes from rows."""

    class Run:
        sessions = [
            *(_row("SECAGG_ABORTED", "report_rejected", shape="-v[]+#") for _ in range(3)),
            _row("SECAGG_TIMED_OUT", "report_rejected", shape="-v[]+#"),
        ]
        config = None
        extra: dict = {}
        devices_short_of_memory = 0
        rounds: list = []

    (note,) = failure_notes(Run())  # type: ignore[arg-type]
    assert note.startswith("4 masked inputs were never summed (SECAGG_ABORTED 3, SECAGG_TIMED_OUT 1)")


def test_a_dp_model_is_said_to_be_at_chance_only_when_it_is():
    """The light twin of the DP fleet's test (marked slow): the noise is named as the cause only
    when the last committed model is within ``AT_CHANCE`` of always answering the commonest class."""

    def notes(accuracy: float, dp: dict | None) -> list[str]:
        class Run:
            sessions: list = []
            config = None
            extra = {"dp": dp, "chance_accuracy": 0.103}
            devices_short_of_memory = 0
            rounds = [RoundRow("t/1/1", "t", 0.0, 1.0, True, 8, 8, 8, 0, 1.0, accuracy, 1.0)]

        return failure_notes(Run())  # type: ignore[arg-type]

    (note,) = notes(0.1, {"noise_multiplier": 20.0})
    assert note.startswith("the last committed model's accuracy 0.100 is at chance") and "noise multiplier 20" in note
    assert notes(0.7, {"noise_multiplier": 20.0}) == [] and notes(0.1, None) == []  # learned; or no DP to blame


def test_reports_late_to_rounds_that_cannot_fill_are_not_told_to_lengthen_the_window():
    """A round that cannot fill is abandoned, and its devices' reports come "late" to it: the
    ``cannot_fill`` sentence says why, and a longer report window would change nothing."""

    class Run:
        sessions = [_row("REPORT_LATE", "report_rejected", shape="-v[]+#") for _ in range(3)]
        config = None
        extra: dict = {}
        devices_short_of_memory = 0
        rounds: list = []

    assert "REPORT_LATE" in failure_notes(Run())[0]  # type: ignore[arg-type]
    assert failure_notes(Run(), unfillable=True) == []  # type: ignore[arg-type]


def test_a_table_written_before_the_code_column_reads_with_no_codes(tmp_path):
    rows = [_row("INVALID_UPDATE", "report_rejected", shape="-v[]+#")]
    SessionRow.to_csv(rows, tmp_path / "sessions.csv")
    lines = (tmp_path / "sessions.csv").read_text(encoding="utf-8").splitlines()
    older = "\r\n".join(line.rsplit(",", 1)[0] for line in lines) + "\r\n"
    (tmp_path / "sessions.csv").write_text(older, encoding="utf-8", newline="")
    (back,) = SessionRow.from_csv(tmp_path / "sessions.csv")
    assert back.code == "" and ended_by([back]) == {
        "reports_refused": {},
        "checkins_rejected_by": {},
        "sessions_interrupted": {},
    }


def _deployed_with(eligibility: EligibilityPolicies):
    """The simulator's ``TaskSpec``, every task it deploys given ``eligibility`` (whatever the
    workload's own tasks say: the simulator passes theirs)."""

    def spec(*args, **kwargs) -> TaskSpec:
        return dataclasses.replace(TaskSpec(*args, **kwargs), eligibility=eligibility)

    return spec
