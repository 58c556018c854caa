"""The demo, small: a real server, a real fleet, its table and its closing JSON line."""

from __future__ import annotations

import io
import json

import pytest

from emulator import DemoConfig, run_demo
from emulator.cli.commands import main

#: Each small demo takes under 10 s. Its loop stops at the task's last round or at this limit;
#: a server that never completes the task (max_rounds ignored) then fails the rounds count
#: within a minute instead of running rounds for the demo's default ten minutes.
TIME_LIMIT_S = 40.0


@pytest.mark.timeout(TIME_LIMIT_S + 30)
def test_small_demo_prints_table_and_json_summary(tmp_path):
    out = io.StringIO()
    config = DemoConfig(
        devices=30, rounds=2, goal_count=8, report_timeout_s=1.5, workdir=str(tmp_path), time_limit_s=TIME_LIMIT_S
    )
    summary = run_demo(config, out=out)
    lines = out.getvalue().strip().splitlines()
    assert json.loads(lines[-1]) == json.loads(json.dumps(summary))
    assert summary["rounds_committed"] == 2
    assert summary["elapsed_s"] < TIME_LIMIT_S  # it ended because the task completed
    assert summary["final_test_accuracy"] > summary["initial_test_accuracy"]
    assert any(line.split()[:2] == ["1", "committed"] for line in lines)
    assert summary["session_outcomes"]["completed"] >= 2 * 7
    assert list(tmp_path.iterdir()) == []  # the demo cleans up its temporary folder


@pytest.mark.timeout(TIME_LIMIT_S + 30)
def test_cli_demo_exit_code(tmp_path, capsys):
    code = main(["demo", "--devices", "20", "--rounds", "1", "--goal", "7", "--time-limit", str(TIME_LIMIT_S)])
    assert code == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["rounds_committed"] == 1


@pytest.mark.timeout(TIME_LIMIT_S + 30)
def test_small_demo_with_secure_aggregation(tmp_path):
    out = io.StringIO()
    config = DemoConfig(
        devices=30,
        rounds=2,
        goal_count=10,
        late_prob=0.0,
        dropout_prob=0.05,
        secure=True,
        workdir=str(tmp_path),
        time_limit_s=TIME_LIMIT_S,
    )
    summary = run_demo(config, out=out)
    assert "Secure Aggregation: attested groups" in out.getvalue()  # the SDK's default policy, with the trust anchor
    assert summary["rounds_committed"] == 2
    assert summary["elapsed_s"] < TIME_LIMIT_S
    assert summary["final_test_accuracy"] > summary["initial_test_accuracy"]
    assert summary["session_outcomes"]["completed"] >= 2 * 8


@pytest.mark.parametrize(
    "args, says",
    [
        (["--devices", "800"], "fedfleet simulate --devices 800"),  # more than the digits can be dealt to
        (["--devices", "0"], "fedfleet demo: --devices must be at least 1 (got 0)\n"),
        (["--rounds", "0"], "fedfleet demo: --rounds must be at least 1 (got 0)\n"),
        (["--goal", "500"], "fedfleet demo: --goal must be between 1 and the number of devices (100)"),
        (["--goal", "5"], "--goal 5 lets a round commit with fewer than 5 devices"),
        (["--dropout", "2"], "fedfleet demo: --dropout is a chance between 0 and 1 (got 2.0)\n"),
        (["--late", "nan"], "fedfleet demo: --late is a chance between 0 and 1 (got nan)\n"),
        (["--epochs", "0"], "fedfleet demo: --epochs must be at least 1 (got 0)\n"),
        (["--time-limit", "-5"], "fedfleet demo: --time-limit must be positive seconds (got -5.0)\n"),
        (["--secure", "--secagg-group", "1"], "fedfleet demo: --secagg-group must be at least 2"),
    ],
)
def test_a_demo_setting_out_of_range_is_refused_in_one_line_with_what_to_use(args, says, capsys):
    assert main(["demo", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedfleet demo: ") and err.count("\n") == 1 and says in err, err


def test_a_demo_config_out_of_range_is_said_by_its_field_to_a_python_caller():
    with pytest.raises(ValueError, match=r"^goal_count must be between 1 and the number of devices \(4\)") as refused:
        DemoConfig(devices=4, goal_count=5)
    assert (refused.value.field, refused.value.says.endswith("(got 5)")) == ("goal_count", True)
