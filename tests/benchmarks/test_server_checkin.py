"""The check-in benchmark runs as documented (``python -m benchmarks.server_checkin --quick``)
against a real server process: it once failed at its first deploy, unnoticed, when the server
began to require release reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_run_ends_in_a_summary_with_its_target_met():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.server_checkin", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    cases = {line["case"]: line for line in lines if "case" in line}
    assert set(cases) == {"health", "checkin_selected", "checkin_rejected"}
    assert all(case["errors"] == 0 and case["requests"] > 0 for case in cases.values())
    summary = lines[-1]
    assert summary["summary"] is True and summary["targets"]["checkins_per_s"]["met"] is True
