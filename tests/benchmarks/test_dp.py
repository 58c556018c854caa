"""The dp benchmark runs as documented (``python -m benchmarks.dp --quick``): its device encoding and
the Secure Aggregation group it is compared with run for both sizes, and the decoded sums are right.
The timings are the benchmark's to judge (docs/benchmarks/dp.md), not this test's."""

from __future__ import annotations

import pytest

from tests.support import run_benchmark


def test_the_quick_run_ends_in_a_summary_of_its_targets():
    lines = run_benchmark("dp", "--quick")
    cases = {line["case"]: line for line in lines if "case" in line}
    assert set(cases) == {"dim_100000", "dim_1000000"}
    for case in cases.values():
        assert case["correct"] is True
        # encode's own stages, the three that make it up summed beside it
        stages = case["stages_s"]
        assert set(stages) == {"clip", "signs", "rotate", "round", "rotate_and_round", "normals", "noise_and_mod"}
        parts = stages["clip"] + stages["rotate_and_round"] + stages["noise_and_mod"]
        assert case["stages_sum_s"] == pytest.approx(parts)
        assert case["encode_s"] > 0 and case["client_masked_input_s"] > 0 and case["server_decode_s"] > 0
        assert case["group"] == 6 and case["bitwidth"] == 32
    summary = lines[-1]
    assert summary["summary"] is True and summary["all_correct"] is True
    for name in ("dim_100000_encode_over_masking", "dim_1000000_encode_over_masking"):
        target = summary["targets"][name]
        assert target["goal"] == 1.0 and isinstance(target["met"], bool) and target["value"] > 0
    assert set(summary["server_decode_over_unmasking"]) == {"dim_100000", "dim_1000000"}
