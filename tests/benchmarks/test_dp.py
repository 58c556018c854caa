"""The dp benchmark runs as documented (``python -m benchmarks.dp --quick``): its device encoding and
the Secure Aggregation group it is compared with run for both sizes, and the decoded sums are right.
The default run takes smaller vectors (``--dims``: 1e4 and 1e5 parameters instead of 1e5 and 1e6);
its slow twin runs ``--quick`` as documented. The timings are the benchmark's to judge
(docs/benchmarks/dp.md), not this test's."""

from __future__ import annotations

import pytest

from tests.support import run_benchmark


def _check_cases_and_summary(lines: list[dict], dims: tuple[int, ...]) -> None:
    names = {f"dim_{dim}" for dim in dims}
    cases = {line["case"]: line for line in lines if "case" in line}
    assert set(cases) == names
    for case in cases.values():
        assert case["correct"] is True
        # encode's own stages, the three that make it up summed beside it
        stages = case["stages_s"]
        assert set(stages) == {"clip", "signs", "rotate", "round", "rotate_and_round", "normals", "noise_and_mod"}
        parts = stages["clip"] + stages["rotate_and_round"] + stages["noise_and_mod"]
        assert case["stages_sum_s"] == pytest.approx(parts)
        assert case["encode_s"] > 0 and case["client_masked_input_s"] > 0 and case["server_decode_s"] > 0
        # a device runs the compiled encoding (the install built it); its numpy path is timed beside it
        assert case["encoder"] == "compiled" and case["numpy_encode_s"] > 0
        assert set(case["compiled_parts_s"]) == {"transform", "uniforms", "normals"}
        assert case["group"] == 6 and case["bitwidth"] == 32
    summary = lines[-1]
    assert summary["summary"] is True and summary["all_correct"] is True
    for name in names:
        target = summary["targets"][f"{name}_encode_over_masking"]
        assert target["goal"] == 1.0 and isinstance(target["met"], bool) and target["value"] > 0
    assert set(summary["server_decode_over_unmasking"]) == names
    assert summary["encoder"] == ["compiled"]


def test_a_quick_run_of_smaller_vectors_ends_in_a_summary_of_its_targets():
    _check_cases_and_summary(run_benchmark("dp", "--quick", "--dims", "10000,100000"), (10_000, 100_000))


@pytest.mark.slow
def test_the_quick_run_ends_in_a_summary_of_its_targets():
    _check_cases_and_summary(run_benchmark("dp", "--quick"), (100_000, 1_000_000))
