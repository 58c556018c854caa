"""`fedfleet simulate`: the summary is stdout's last line and equals summary.json; bad configs
are refused with a message that names the problem."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from emulator.cli.commands import main
from emulator.fleet import RoundRow
from emulator.toolchain.bundle import build_bundle
from tests.support import read_only_folder

DIGITS_TASK = Path(__file__).resolve().parents[3] / "examples" / "tasks" / "digits_task.py"


def test_simulate_prints_the_summary_last_and_writes_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        "[fleet]\ndevices = 40\nhours = 2.0\nstart_utc_hour = 6.0\n\n[task]\ngoal_count = 8\n", encoding="utf-8"
    )
    code = main(["simulate", str(fleet), "--hours", "0.5", "--seed", "4", "--out", str(out), "--no-progress"])
    assert code == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    on_disk = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert summary["digest"] == on_disk["digest"]
    assert len(summary["digest"]) == 64
    assert summary["devices"] == 40 and summary["seed"] == 4 and summary["simulated_s"] == 1800.0
    for key in ("dropout_rate", "availability_swing", "shapes"):
        assert key in summary
    for name in ("sessions.csv", "rounds.csv", "timeline.csv"):
        assert (out / name).stat().st_size > 0
    # the folder records what it ran, the file with the options applied, and the releases it ran on
    assert set(on_disk["versions"]) == {"fedfleet", "onnxruntime", "numpy", "python"}
    recorded = (out / "config.toml").read_text(encoding="utf-8")
    assert "devices = 40" in recorded and "hours = 0.5" in recorded and "seed = 4" in recorded
    assert main(["simulate", str(out / "config.toml"), "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["digest"] == summary["digest"]


def test_a_config_with_an_unknown_field_is_refused_by_name(tmp_path, capsys):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text("[fleet]\ndevicez = 40\n", encoding="utf-8")
    assert main(["simulate", str(fleet), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "fleet.devicez: [fleet] has no key 'devicez' (did you mean devices?)" in err


def test_a_secure_aggregation_task_commits_rounds_of_attested_groups(tmp_path, capsys):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        "[fleet]\ndevices = 60\nhours = 1.0\nstart_utc_hour = 6.0\n\n[task]\nsecure = true\ngoal_count = 10\n"
        "secagg_group_size = 5\ncompute_s_per_example = 0.2\nretry_min_s = 60.0\nretry_max_s = 300.0\n",
        encoding="utf-8",
    )
    assert main(["simulate", str(fleet), "--seed", "3", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["rounds_committed"] >= 1


def test_a_goal_the_server_refuses_exits_with_its_reason(capsys):
    assert main(["simulate", "--devices", "20", "--hours", "0.1", "--goal", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "could commit with 4 report(s)" in err and "min_reports" in err and "Traceback" not in err


def test_a_run_the_server_refuses_leaves_nothing_in_its_out_folder(tmp_path, capsys):
    refused = ["simulate", "--devices", "20", "--hours", "0.1", "--goal", "8", "--no-progress"]
    refused += ["--dp", "central", "--max-epsilon", "0.01", "--out"]  # a budget one round would spend
    assert main([*refused, str(tmp_path / "new")]) == 2
    assert "refuses the fleet's [task]" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # the folder the run made, with its server's database, is gone
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "notes.txt").write_text("keep me")
    assert main([*refused, str(earlier)]) == 2
    assert [p.name for p in earlier.iterdir()] == ["notes.txt"]  # a folder that was there stays, less the run's


def test_a_fleet_too_small_for_its_goal_says_so(tmp_path, capsys):
    assert main(["simulate", "--devices", "40", "--hours", "0.5", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["rounds_committed"] == 0
    assert (
        "no round can fill: each selects 130 devices (task.goal_count 100 x task.over_selection 1.3) and needs 80 of"
        in captured.err
    )
    assert "--goal" in captured.err


def test_an_out_that_is_a_file_or_cannot_be_made_is_refused_before_the_run(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("keep me")
    assert main(["simulate", "--devices", "20", "--hours", "0.1", "--out", str(taken), "--no-progress"]) == 2
    assert "is a file" in capsys.readouterr().err and taken.read_text() == "keep me"
    assert main(["simulate", "--devices", "20", "--hours", "0.1", "--out", str(taken / "under"), "--no-progress"]) == 2
    assert "cannot write the run to --out" in capsys.readouterr().err


def test_an_out_folder_that_exists_but_refuses_files_is_refused_in_one_line_before_the_run(tmp_path, capsys):
    """An --out folder on a read-only file system (here an immutable folder: root writes past modes)
    ended in a traceback from the run's server folder; it is one line before the run, as a folder that
    cannot be made is."""
    with read_only_folder(tmp_path / "locked") as locked:
        assert main(["simulate", "--devices", "20", "--hours", "0.1", "--out", str(locked), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"cannot write the run to --out {locked} (" in err and "that can be created and written" in err
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("fedfleet simulate: cannot write")
    assert list(locked.iterdir()) == []


def test_an_out_that_is_a_bundle_or_its_task_folder_is_refused_before_the_run(tmp_path, capsys):
    """The run's tables and report would land among the plans `plan test` and `deploy` read."""
    bundle = tmp_path / "digits"
    build_bundle(DIGITS_TASK, bundle, runtimes=["1.31.1"])
    before = sorted(p.relative_to(bundle) for p in bundle.rglob("*"))
    for out, says in [
        (bundle, f"--out {bundle} is a bundle folder (`fedfleet plan build` wrote it); give another folder"),
        (bundle / "digits_mlp", f"--out {bundle / 'digits_mlp'} is one task's folder of the bundle {bundle}; give"),
    ]:
        run = ["simulate", "--devices", "20", "--hours", "0.1", "--task", str(bundle), "--out", str(out)]
        assert main([*run, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
    assert sorted(p.relative_to(bundle) for p in bundle.rglob("*")) == before


def test_a_malformed_trace_is_refused_naming_its_file_and_line(tmp_path, capsys):
    trace = tmp_path / "day.csv"
    trace.write_text("device,start,end,state\nd000001,0,soon,idle+charging+unmetered\n")
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(f'[fleet]\ndevices = 20\nhours = 0.2\n[availability]\ntrace = "{trace}"\n')
    for extra in ([], ["--seeds", "0,1"]):
        assert main(["simulate", str(fleet), "--no-progress", *extra]) == 2
        err = capsys.readouterr().err
        assert f"{trace}:2" in err and "Traceback" not in err


def test_a_run_refused_while_it_is_set_up_says_one_line_and_draws_no_progress_bar(tmp_path, capsys):
    trace = tmp_path / "day.csv"
    trace.write_text("device,start,end,state\nd000001,0,soon,idle\n")
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(f'[fleet]\ndevices = 4\nhours = 0.1\n[availability]\ntrace = "{trace}"\n')
    assert main(["simulate", str(fleet)]) == 2  # the progress bar on, as a user runs it
    assert capsys.readouterr().err.splitlines() == [
        f"fedfleet simulate: {trace}:2: end 'soon' is not a number of seconds"
    ]
    trace.write_text("device,start,end,state\n")  # no device ever available, and a goal the server refuses
    fleet.write_text(fleet.read_text() + "[task]\ngoal_count = 5\n")
    for sharded in ([], ["--shards", "2"]):
        assert main(["simulate", str(fleet), *sharded]) == 2
        (line,) = capsys.readouterr().err.splitlines()  # not first a notice that no round can fill
        assert "could commit with 4 report(s)" in line and "(RoundConfig.min_reports)" in line


def test_no_shards_is_refused(capsys):
    assert main(["simulate", "--devices", "20", "--hours", "0.1", "--shards", "0", "--no-progress"]) == 2
    assert "at least 1 shard" in capsys.readouterr().err


def test_ctrl_c_ends_the_run_with_a_line_and_exit_code_130(tmp_path, capsys, monkeypatch):
    from emulator.fleet.simulator import FleetSimulator

    real = FleetSimulator._sample

    def sample_then_interrupt(self):
        real(self)
        if self.loop.now >= 600.0:
            raise KeyboardInterrupt

    monkeypatch.setattr(FleetSimulator, "_sample", sample_then_interrupt)
    out = tmp_path / "run"
    assert main(["simulate", "--devices", "40", "--hours", "1", "--out", str(out), "--no-progress"]) == 130
    captured = capsys.readouterr()
    assert "interrupted" in captured.err and "Traceback" not in captured.err and captured.out == ""
    assert not (out / "summary.json").exists() and not (out / "report.html").exists()


def test_sigterm_ends_the_run_as_ctrl_c_does_with_a_line_and_exit_code_143(tmp_path, capsys, monkeypatch):
    """A batch scheduler's stop (SIGTERM) mid-run unwinds as Ctrl-C does: one line, exit code 143,
    no traceback, the server's database closed (it killed the process where it stood, before)."""
    import signal

    from emulator.fleet.simulator import FleetSimulator

    class Killed(Exception):
        pass

    def killed(signum, frame):  # what the test sees if the command leaves SIGTERM to its caller
        raise Killed

    real = FleetSimulator._sample

    def sample_then_terminate(self):
        real(self)
        if self.loop.now >= 600.0:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(FleetSimulator, "_sample", sample_then_terminate)
    before = signal.signal(signal.SIGTERM, killed)
    try:
        out = tmp_path / "run"
        assert main(["simulate", "--devices", "40", "--hours", "1", "--out", str(out), "--no-progress"]) == 143
        assert signal.getsignal(signal.SIGTERM) is killed  # the caller's handler is back
    finally:
        signal.signal(signal.SIGTERM, before)
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines()[-1] == (
        f"fedfleet simulate: terminated (SIGTERM), no tables or report written; {out} holds only the server's "
        "database of the rounds so far"
    )
    assert "Traceback" not in captured.err and captured.out == ""
    assert sorted(p.name for p in out.iterdir()) == ["server"]


def test_a_run_into_an_earlier_runs_folder_replaces_its_files_so_a_stopped_run_leaves_none_of_them(
    tmp_path, capsys, monkeypatch
):
    """A second run into the same --out, stopped mid-run, left the first run's summary.json, tables
    and plots (its privacy.png too) beside its own server database, and the line said the run had
    been stopped "while its report was drawn", its tables and summary.json there for compare."""
    from emulator.fleet.simulator import FleetSimulator

    out = tmp_path / "run"
    out.mkdir()
    earlier = ("summary.json", "rounds.csv", "sessions.csv", "timeline.csv", "report.html", "privacy.png")
    for name in (*earlier, "notes.txt"):
        (out / name).write_text("the earlier run's")
    real = FleetSimulator._sample

    def sample_then_interrupt(self):
        real(self)
        if self.loop.now >= 600.0:
            raise KeyboardInterrupt

    monkeypatch.setattr(FleetSimulator, "_sample", sample_then_interrupt)
    assert main(["simulate", "--devices", "40", "--hours", "1", "--out", str(out), "--no-progress"]) == 130
    said = capsys.readouterr().err.strip().splitlines()
    assert said[-1] == (
        f"fedfleet simulate: interrupted, no tables or report written; {out} holds only the server's database of "
        "the rounds so far"
    )
    assert (
        f"fedfleet simulate: {out} held an earlier run's tables, summary.json and report: this run starts over and "
        "replaces them (a run does not resume)"
    ) in said
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "server"]  # what no run writes stays


def test_a_run_started_again_after_one_was_killed_says_it_starts_over(tmp_path, capsys, monkeypatch):
    """A run killed mid-run (SIGKILL, a power cut) leaves its server database in --out; the same
    command again replaced it and started over, without a word: whether it resumed, refused or
    replaced was the user's guess."""
    from emulator.fleet.simulator import FleetSimulator

    out = tmp_path / "run"
    real = FleetSimulator._sample

    def sample_then_interrupt(self):  # at its first sample: the server took the tasks, rounds are to come
        real(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(FleetSimulator, "_sample", sample_then_interrupt)
    command = ["simulate", "--devices", "40", "--hours", "1", "--out", str(out), "--no-progress"]
    assert main(command) == 130  # what a killed run leaves: its server's database, nothing else
    assert "starts over" not in capsys.readouterr().err
    assert sorted(p.name for p in (out / "server").iterdir() if p.name == "server.db") == ["server.db"]
    assert main(command) == 130
    assert (
        f"fedfleet simulate: {out} held the server database of an earlier run stopped before its end: this run "
        "starts over and replaces them (a run does not resume)"
    ) in capsys.readouterr().err.splitlines()


def test_a_run_stopped_while_its_report_is_drawn_keeps_its_tables_and_summary_for_compare(
    tmp_path, capsys, monkeypatch
):
    """Ctrl-C after the run, while its plots are drawn (the longest part of writing it): the
    folder holds the tables and summary.json, which compare reads, and the line says so (it said
    that no tables were written, and the folder had no summary.json)."""
    from emulator.fleet import report

    def interrupted(run, summary):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "report_figures", interrupted)
    out = tmp_path / "run"
    assert main(["simulate", "--devices", "40", "--hours", "0.5", "--out", str(out), "--no-progress"]) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"fedfleet simulate: interrupted, while its report was drawn: {out} holds the run's tables and summary.json "
        "(which fedfleet compare reads), not its plots or report.html"
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["devices"] == 40 and len(summary["digest"]) == 64
    assert (out / "rounds.csv").exists() and not (out / "report.html").exists()


def test_reports_that_all_come_too_late_are_named_as_the_reason(tmp_path, capsys):
    fleet = tmp_path / "late.toml"
    fleet.write_text("[task]\ngoal_count = 10\nreport_timeout_s = 1e-6\nselection_timeout_s = 600.0\n")
    assert main(["simulate", str(fleet), "--devices", "400", "--hours", "2", "--seed", "1", "--no-progress"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["rounds_committed"] == 0 and summary["available_peak"] >= 10
    assert "reported after their round's window closed" in captured.err and "report_timeout_s = 1e-06 s" in captured.err


def test_a_fleet_that_cannot_fill_a_round_says_so_before_the_run_and_in_its_summary(tmp_path, capsys):
    from emulator.fleet import FleetConfig, simulate

    config = FleetConfig.default().replace(devices=40, hours=0.5, goal=20)
    said: list[str] = []
    run = simulate(config, progress=lambda *_: said.append("progress"), notice=said.append)
    first = said[0]  # before the first progress report
    peak = max(r.available for r in run.timeline)
    assert peak < 26
    expected = (
        f"no round can fill: each selects 26 devices (task.goal_count 20 x task.over_selection 1.3) and needs 16 of "
        f"their reports to commit (task.goal_count x task.min_fraction 0.8), and at most {peak} of the 40 devices are "
        "available at once"
    )
    assert first.startswith(expected) and "--devices" in first and "--goal" in first
    summary = run.summary()
    assert summary["cannot_fill"] == first and first in summary["round_completion_note"]
    # the command line says it before the run and again with the summary
    assert main(["simulate", "--devices", "40", "--hours", "0.5", "--goal", "20", "--no-progress"]) == 0
    assert capsys.readouterr().err.count(expected) == 2


def test_a_fleet_none_of_whose_devices_is_ever_available_is_pointed_at_its_availability(tmp_path, capsys):
    """No night on the charger and no daytime charge: no device is ever available, whatever the
    fleet's size, so the line names the availability settings instead of only asking for more
    --devices (which it said alone)."""
    fleet = tmp_path / "never.toml"
    fleet.write_text(
        "[fleet]\ndevices = 30\nhours = 0.25\n\n[availability.night]\nprobability = 0.0\n\n"
        "[availability.day]\nsessions_per_day = 0.0\n\n[task]\ngoal_count = 8\n",
        encoding="utf-8",
    )
    assert main(["simulate", str(fleet), "--no-progress"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["available_peak"] == 0 and summary["rounds_committed"] == 0
    said = summary["cannot_fill"]
    assert said.startswith(
        "no round can fill: each selects 11 devices and needs 7 of their reports to commit, and none of the 30"
    )
    assert "[availability]" in said and "start_utc_hour" in said and said in captured.err


def test_every_figure_of_the_reports_a_commit_needs_is_the_servers_own_threshold():
    """A round of goal 8 commits with 7 reports (min_fraction 0.8): the cannot-fill line, the
    summary and the report's completion sentence all say 7, as ``RoundConfig.commit_threshold``
    decides, where the line said each round "needs 8 reports"."""
    from emulator.fleet import FleetConfig
    from emulator.fleet.report import explain_rates
    from emulator.fleet.summary import cannot_fill
    from emulator.fleet.workload import task_round_config

    for fraction, needed in ((0.8, 7), (0.5, 4), (1.0, 8)):
        task = FleetConfig.default().replace(goal=8).task.model_copy(update={"min_fraction": fraction})
        assert task_round_config(task).commit_threshold == needed
        for said in (cannot_fill(30, 5, task), cannot_fill(30, 0, task), cannot_fill(30, 5, task_round_config(task))):
            assert said is not None and f"needs {needed} of their reports to commit" in said
    summary = {"round_goal": 8, "round_reports_to_commit": 7}
    rounds = [RoundRow("t/1/1", "t", 0.0, 60.0, True, 10, 8, 8, 0, 60.0, 0.5, 1.0)]
    said = explain_rates(summary, rounds)["round_completion_rate"]
    assert "report in time (8 (task.goal_count), or 7 once no more can come" in said


def test_a_fleet_too_small_for_the_smallest_goal_the_server_takes_is_offered_no_goal_it_refuses():
    """At most 3 devices available at once: a goal of 2 would seat them, but the server refuses any
    goal below 6 (its rounds could commit with fewer than min_reports 5 reports), so the line offers
    devices alone, where it offered "a --goal of at most 2", which the next run had refused."""
    from emulator.fleet import FleetConfig
    from emulator.fleet.summary import cannot_fill
    from emulator.fleet.workload import smallest_goal, task_round_config

    task = FleetConfig.default().replace(goal=20).task
    assert smallest_goal(task_round_config(task)) == 6
    said = cannot_fill(10, 3, task)
    assert said is not None and "of at most" not in said and "--devices" in said
    assert "no smaller --goal would do: the server refuses a goal below 6" in said
    offered = cannot_fill(100, 9, task)  # 9 devices seat a goal of 6: offered
    assert offered is not None and offered.endswith("or a --goal (task.goal_count) of at most 6")


def test_a_goal_the_server_would_refuse_is_told_before_the_run_with_the_smallest_it_takes(tmp_path, capsys):
    """The server refuses a round that could commit with fewer than min_reports reports; the fleet
    said so in the server's words ("lower min_reports knowingly"), which no [task] key or option
    sets. Now the line names --goal and the smallest goal the server takes."""
    out = tmp_path / "run"
    assert (
        main(["simulate", "--devices", "10", "--hours", "0.1", "--goal", "5", "--out", str(out), "--no-progress"]) == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "min_reports knowingly" not in err
    assert "a round of task.goal_count 5 could commit with 4 report(s)" in err
    assert "use a --goal of at least 6 (task.goal_count)" in err and not out.exists()


def test_a_fleet_that_can_fill_its_rounds_says_nothing_of_it(tmp_path):
    from emulator.fleet import FleetConfig, simulate

    said: list[str] = []
    run = simulate(FleetConfig.default().replace(devices=60, hours=0.25, goal=8), progress=False, notice=said.append)
    assert said == [] and run.summary()["cannot_fill"] is None


def test_a_fleet_whose_sessions_outlast_the_report_window_says_so_before_the_run(tmp_path, capsys):
    """The median device's training, estimated from the plan's cost and the devices' examples and
    speeds before the run, against the report window: the run then bears it out (late reports)."""
    from emulator.fleet import FleetConfig, simulate

    fleet = tmp_path / "slow.toml"
    # about 40 examples x 2 epochs x 3 s: longer than the window, within the devices' 600 s
    fleet.write_text("[task]\ngoal_count = 8\ncompute_s_per_example = 3.0\nreport_timeout_s = 60.0\n")
    config = FleetConfig.load(fleet).replace(devices=200, hours=2)
    said: list[str] = []
    run = simulate(config, progress=False, notice=said.append)
    slow = [m for m in said if m.startswith("a session's training takes about ")]
    assert len(slow) == 1 and "x 3 s per example, task.compute_s_per_example = 3)" in slow[0]
    assert "longer than the 60 s report window (task.report_timeout_s): most reports will come late" in slow[0]
    assert "lower task.compute_s_per_example (it overrides the plan's cost)" in slow[0]
    assert "reference_flops_per_s" not in slow[0]  # the explicit cost overrides it: no use naming it
    shapes = run.summary()["shapes"]
    trained = {shape: n for shape, n in shapes.items() if shape.startswith("-v[]+")}
    assert sum(n for shape, n in trained.items() if shape.endswith("#")) > sum(trained.values()) / 2
    # the command line says it on stderr, before the summary
    assert main(["simulate", str(fleet), "--devices", "200", "--hours", "2", "--no-progress"]) == 0
    assert "fedfleet simulate: a session's training takes about" in capsys.readouterr().err


def test_sessions_past_the_devices_max_training_s_are_said_to_be_stopped_and_the_run_bears_it_out(tmp_path):
    from emulator.fleet import FleetConfig, simulate

    fleet = tmp_path / "slower.toml"
    fleet.write_text("[task]\ngoal_count = 8\ncompute_s_per_example = 30.0\nreport_timeout_s = 60.0\n")
    said: list[str] = []
    run = simulate(FleetConfig.load(fleet).replace(devices=60, hours=1), progress=False, notice=said.append)
    slow = [m for m in said if m.startswith("a session's training takes about ")]
    assert len(slow) == 1 and "most sessions will be stopped at the devices' 600 s of training" in slow[0]
    trained = [s for s in run.sessions if s.compute_s > 0]
    assert trained and not [s for s in trained if s.shape.startswith("-v[]")]
    assert abs(max(s.compute_s for s in trained) - 600.0) < 1e-6


def test_sessions_priced_by_the_plans_flops_are_told_the_rate_that_gives_a_phones_pace():
    from emulator.fleet.config import TaskSection
    from emulator.fleet.summary import slow_sessions

    task = TaskSection()
    assert slow_sessions(170.0, 40, 2, 2.0, task, 180.0) is None
    said = slow_sessions(622.0, 37, 1, 14.4, task, 60.0)
    assert said is not None and said.startswith("a session's training takes about 622 s on the median device")
    assert f"task.reference_flops_per_s = {task.reference_flops_per_s:.3g}" in said
    assert "set task.reference_flops_per_s = 1e9" in said and "lengthen task.report_timeout_s" in said
    # where a newcomer who ran `simulate --task DIR --data SPEC` sets them: no config file in sight
    assert said.endswith("(each a fleet config's [task] key, or --sweep KEY=VALUE for one run)")


def test_a_fleet_no_device_class_of_which_holds_the_plan_is_refused_in_one_line(tmp_path, capsys):
    """The refusal alone: it came after a notice that the run's sessions would outlast the report
    window, a run that was never going to start."""
    fleet = tmp_path / "tiny.toml"
    fleet.write_text(
        "[fleet]\ndevices = 20\nhours = 0.5\nmin_memory_mb = 0\n\n[task]\nhidden = [2048, 2048]\ngoal_count = 8\n\n"
        '[[device_classes]]\nname = "tiny"\nshare = 1.0\nspeed = 1.0\nmemory_mb = 1\n',
        encoding="utf-8",
    )
    assert main(["simulate", str(fleet), "--no-progress", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedfleet simulate: no device class can hold the plan: it needs ") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # two reports drawn (3-4 s); the default run has its twins: the first test and test_report's redraw
def test_a_run_folder_reruns_from_its_config_to_the_same_digest_and_redraws_its_report(tmp_path, capsys):
    """A run folder held no record of the config it ran nor of the releases that made its digest, and
    a run stopped while its plots were drawn had no way to get them: the folder now holds config.toml
    (the file with the command line's options applied), which simulate takes as it is to the same
    digest, summary.json names the versions, and fedfleet report draws the plots and page again."""
    fleet = tmp_path / "fleet.toml"
    fleet.write_text("[fleet]\ndevices = 30\nhours = 1.0\nstart_utc_hour = 6.0\n", encoding="utf-8")
    out = tmp_path / "run"
    run = ["simulate", str(fleet), "--hours", "0.25", "--seed", "4", "--goal", "6", "--no-progress"]
    assert main([*run, "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary["versions"]) == {"fedfleet", "onnxruntime", "numpy", "python"}
    assert json.loads((out / "summary.json").read_text())["versions"] == summary["versions"]
    recorded = (out / "config.toml").read_text(encoding="utf-8")
    assert "hours = 0.25" in recorded and "seed = 4" in recorded and "goal_count = 6" in recorded
    assert "start_utc_hour = 6.0" in recorded  # the file's, beside the options'

    assert main(["simulate", str(out / "config.toml"), "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["digest"] == summary["digest"]

    page = (out / "report.html").read_bytes()
    plots = {p.name: p.read_bytes() for p in out.glob("*.png")}
    for drawn in (out / "report.html", *(out / name for name in plots)):  # stopped while the plots were drawn
        drawn.unlink()
    assert main(["report", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out / "report.html")
    assert (out / "report.html").read_bytes() == page  # the same page, from the tables, summary and config
    assert {p.name: p.read_bytes() for p in out.glob("*.png")} == plots


def test_report_refuses_a_folder_that_is_not_a_run_in_one_line(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    for name in ("run-0-seed=0", "run-1-seed=1"):
        for table in ("summary.json", "rounds.csv", "sessions.csv", "timeline.csv"):
            (sweep / name).mkdir(parents=True, exist_ok=True)
            (sweep / name / table).write_text("")
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "empty").mkdir()
    for given, says in [
        (
            "missing",
            "missing is not a fleet run: no such folder; give a run folder (what fedfleet simulate --out wrote)",
        ),
        ("notes.txt", "notes.txt is not a fleet run: it is a file, not a folder; give a run folder"),
        ("empty", "empty is not a fleet run: it has no summary.json, rounds.csv, sessions.csv or timeline.csv; give"),
        ("sweep", "or timeline.csv; it holds 2 runs (run-0-seed=0, run-1-seed=1): name each, as "),
        ("sweep/run-0-seed=0", "is not a run's summary (not JSON"),
    ]:
        assert main(["report", str(tmp_path / given)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("fedfleet report: ") and says in err, err
    assert main(["report", str(sweep / "run-0-seed=0"), "--out", str(tmp_path / "page.png")]) == 2
    assert "name a .html file" in capsys.readouterr().err


def test_a_config_toml_of_the_users_own_in_out_is_not_replaced_by_the_runs(tmp_path, capsys):
    out = tmp_path / "study"
    out.mkdir()
    (out / "config.toml").write_text("# my fleet, with notes\n[fleet]\ndevices = 20\n")
    assert main(["simulate", "--devices", "20", "--hours", "0.1", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {out} holds config.toml, where the run records the config it ran" in err
    assert (out / "config.toml").read_text() == "# my fleet, with notes\n[fleet]\ndevices = 20\n"
    assert sorted(p.name for p in out.iterdir()) == ["config.toml"]
