"""The report-memory benchmark runs as documented (``python -m benchmarks.server_reports --quick``)
against real server processes: a small run (2 reports of 1 MB) in the slow set, since each case
starts a server and deploys; its arguments are refused in one line in the default set."""

from __future__ import annotations

import pytest

from tests.support import run_benchmark


@pytest.mark.slow
def test_a_small_run_ends_in_a_summary_of_its_target_with_the_same_model_both_ways():
    lines = run_benchmark("server_reports", "--reports", "2", "--update-mb", "1")
    cases = {line["case"]: line for line in lines if "case" in line}
    assert set(cases) == {"bound_one_update", "held_whole", "spooled"}
    assert all(cases[c]["peak_mb"] >= cases[c]["floor_mb"] > 0 for c in ("held_whole", "spooled"))
    summary = lines[-1]
    assert summary["summary"] is True and summary["models_equal"] is True
    target = summary["targets"]["peak_above_floor_vs_held_whole"]
    assert isinstance(target["met"], bool) and target["goal"] == 0.6


@pytest.mark.parametrize("option", [["--reports", "0"], ["--update-mb", "nan"], ["--update-mb", "-1"]])
def test_a_size_or_count_that_is_no_positive_number_is_refused_in_one_line(option, monkeypatch, capsys):
    from benchmarks.server_reports import main

    monkeypatch.setattr("sys.argv", ["server_reports", *option])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    assert "takes a positive number" in capsys.readouterr().err
