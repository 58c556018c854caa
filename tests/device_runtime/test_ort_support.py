"""The onnxruntime support record (device_runtime/ort_support.json) against the code that reads it
and against real onnxruntime releases: the installed one here, two more installed in their own envs
in the slow test."""

from __future__ import annotations

import datetime as dt

import onnxruntime
import pytest
from hypothesis import given
from hypothesis import strategies as st

from device_runtime import PlanError, max_ir_version_for_runtime, max_opset_for_runtime, min_runtime_for_opset
from device_runtime.plan import _ort_support_rows, load_ort_support_record
from device_runtime.versions import version_tuple
from emulator.releases.envs import FIRST_MINOR, KNOWN_RELEASES, LAST_MINOR
from emulator.releases.support import InstalledRuntime, check, measure

RECORD = load_ort_support_record()
BY_MINOR = {row["minor"]: row for row in RECORD}
OLDEST, NEWEST = min(BY_MINOR), max(BY_MINOR)


def test_record_is_one_measured_row_per_minor_the_envs_know():
    assert sorted(BY_MINOR) == list(range(FIRST_MINOR, LAST_MINOR + 1)) and len(RECORD) == len(BY_MINOR)
    assert [version_tuple(r)[1] for r in KNOWN_RELEASES] == sorted(BY_MINOR)
    assert {row["release"] for row in RECORD} == set(KNOWN_RELEASES)
    for row in RECORD:
        assert set(row) == {"release", "minor", "max_opset", "max_ir", "measured_on"}
        assert version_tuple(row["release"])[:2] == (1, row["minor"])
        dt.date.fromisoformat(row["measured_on"])  # a measurement, not an assumption


def test_functions_agree_with_the_record():
    for row in RECORD:
        for version in (row["release"], f"1.{row['minor']}.0", f"1.{row['minor']}.99rc1"):
            assert max_opset_for_runtime(version) == row["max_opset"], version
            assert max_ir_version_for_runtime(version) == row["max_ir"], version


@given(st.integers(0, 40), st.integers(0, 40))
def test_newer_releases_never_support_less(a, b):
    older, newer = sorted((a, b))
    if older < OLDEST:
        with pytest.raises(PlanError, match="older than"):
            max_opset_for_runtime(f"1.{older}.0")
        return
    assert max_opset_for_runtime(f"1.{older}.0") <= max_opset_for_runtime(f"1.{newer}.0")
    assert max_ir_version_for_runtime(f"1.{older}.0") <= max_ir_version_for_runtime(f"1.{newer}.0")


def test_record_itself_is_monotone():
    rows = sorted(RECORD, key=lambda r: r["minor"])
    for before, after in zip(rows, rows[1:]):
        assert before["max_opset"] <= after["max_opset"] and before["max_ir"] <= after["max_ir"], after


def test_releases_past_the_record_get_the_newest_row():
    newest = BY_MINOR[NEWEST]
    for version in (f"1.{NEWEST + 1}.0", "1.99.0", "2.0.0"):
        assert max_opset_for_runtime(version) == newest["max_opset"]
        assert max_ir_version_for_runtime(version) == newest["max_ir"]


def test_min_runtime_for_opset_is_the_oldest_release_that_runs_it():
    for opset in range(7, BY_MINOR[NEWEST]["max_opset"] + 1):
        minor = version_tuple(min_runtime_for_opset(opset))[1]
        assert BY_MINOR[minor]["max_opset"] >= opset
        assert minor == OLDEST or BY_MINOR[minor - 1]["max_opset"] < opset
    with pytest.raises(PlanError, match="no known onnxruntime release"):
        min_runtime_for_opset(BY_MINOR[NEWEST]["max_opset"] + 1)


def test_a_gap_in_the_record_takes_the_older_neighbour_and_a_regression_is_refused():
    rows = [
        {"minor": 15, "max_opset": 19, "max_ir": 9},
        {"minor": 18, "max_opset": 21, "max_ir": 10},
        {"minor": 17, "max_opset": 19, "max_ir": 9},
    ]
    assert _ort_support_rows(rows) == ((15, 17, 19, 9), (18, 18, 21, 10))
    with pytest.raises(ValueError, match="supports less"):
        _ort_support_rows([*rows, {"minor": 19, "max_opset": 20, "max_ir": 10}])
    with pytest.raises(ValueError, match="one row per"):
        _ort_support_rows([*rows, {"minor": 18, "max_opset": 21, "max_ir": 10}])


def test_installed_runtime_runs_its_recorded_max_and_refuses_one_more():
    minor = version_tuple(onnxruntime.__version__)[1]
    assert minor in BY_MINOR, (
        f"onnxruntime {onnxruntime.__version__} is not in the record: "
        f"run python -m emulator.releases.support --releases {onnxruntime.__version__}"
    )
    row, runtime = BY_MINOR[minor], InstalledRuntime()
    assert check(runtime, opset=row["max_opset"], ir_version=row["max_ir"]) is None
    assert "opset" in check(runtime, opset=row["max_opset"] + 1, ir_version=row["max_ir"]).lower()
    assert "ir version" in check(runtime, opset=13, ir_version=row["max_ir"] + 1).lower()
    assert measure(runtime) == {
        "version": onnxruntime.__version__,
        "max_opset": row["max_opset"],
        "max_ir": row["max_ir"],
    }


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("minor", [15, 20])
def test_real_release_measures_as_recorded(minor):
    from emulator.releases.envs import RuntimeEnv

    row = BY_MINOR[minor]
    env = RuntimeEnv.for_release(row["release"])  # the shared cache: installed once, reused after
    assert measure(env) == {"version": row["release"], "max_opset": row["max_opset"], "max_ir": row["max_ir"]}
