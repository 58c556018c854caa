"""The check-in benchmark runs as documented (``python -m benchmarks.server_checkin --quick``)
against a real server process: it once failed at its first deploy, unnoticed, when the server
began to require release reports. The default run measures each case for a quarter of a second
(``--duration``): the same server process, deploys and three loads, only shorter; the slow twin
runs ``--quick`` itself."""

from __future__ import annotations

import pytest

from tests.support import run_benchmark


def _check_cases_and_summary(lines: list[dict]) -> None:
    cases = {line["case"]: line for line in lines if "case" in line}
    assert set(cases) == {"health", "checkin_selected", "checkin_rejected"}
    assert all(case["errors"] == 0 and case["requests"] > 0 for case in cases.values())
    # the rates themselves are the benchmark's to judge (benchmarks/README, the docs' benchmark
    # page): on a shared machine they move with its load, so the test holds the summary's shape
    summary = lines[-1]
    target = summary["targets"]["checkins_per_s"]
    assert summary["summary"] is True and isinstance(target["met"], bool)
    assert target["value"] > 0 and target["goal"] == 500


def test_a_short_run_ends_in_a_summary_of_its_target():
    _check_cases_and_summary(run_benchmark("server_checkin", "--duration", "0.25"))


@pytest.mark.slow
def test_the_quick_run_ends_in_a_summary_of_its_target():
    _check_cases_and_summary(run_benchmark("server_checkin", "--quick"))


@pytest.mark.parametrize("duration", ["-1", "0", "nan", "inf", "abc"])
def test_a_duration_that_is_no_positive_number_of_seconds_is_refused_in_one_line(duration, monkeypatch, capsys):
    from benchmarks.server_checkin import main

    monkeypatch.setattr("sys.argv", ["server_checkin", "--duration", duration])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    assert "--duration takes" in capsys.readouterr().err
