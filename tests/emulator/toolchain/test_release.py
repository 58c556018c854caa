"""Release tests on real onnxruntime releases, each in its own cached env: a task passes on the
oldest, a middle and the newest release with its versioned plans; a plan a release cannot run, a
plan that computes something else, and a plan with no form for a release each fail, by name."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import helper, numpy_helper

from device_runtime import build_mlp_plan
from device_runtime.plan import Plan, ir_version_for_opset
from emulator.releases.envs import KNOWN_RELEASES
from emulator.releases.workers import WorkerPool
from emulator.toolchain import FedAvgM
from emulator.toolchain.release import (
    ReleaseTestError,
    budget_checks,
    compare_outputs,
    release_table,
    release_test,
    report_passed,
)
from emulator.toolchain.tasks import (
    Budget,
    Task,
    TaskError,
    Tolerance,
    accuracy_after_rounds,
    evaluation_of,
    load_tasks,
)
from emulator.toolchain.versioning import plan_sha256, versioned_plan
from server_stub.release_gate import ReleaseGateError, check_release_report

#: The module's pool of release workers is started once per run: its tests go to one pytest-xdist worker, which
#: keeps the module-scoped fixture for all of them instead of each worker starting its own.
pytestmark = pytest.mark.xdist_group("test_release")

TASK_FILE = Path(__file__).resolve().parents[3] / "examples" / "tasks" / "digits_task.py"
OLDEST, MIDDLE, NEWEST = KNOWN_RELEASES[0], KNOWN_RELEASES[len(KNOWN_RELEASES) // 2], KNOWN_RELEASES[-1]


@pytest.fixture(scope="module")
def pool():
    with WorkerPool() as workers:
        yield workers


@pytest.fixture(scope="module")
def task() -> Task:
    return load_tasks(TASK_FILE)[0]


@given(shape=st.lists(st.integers(1, 4), max_size=3), scale=st.floats(0, 1e-3), data=st.data())
def test_outputs_pass_exactly_when_within_tolerance(shape, scale, data):
    rng = np.random.default_rng(len(shape))
    want = {"w": rng.standard_normal(shape), "loss_sum": np.array(3.0)}
    noise = data.draw(st.floats(-1, 1)) * scale
    got = {"w": want["w"] + noise, "loss_sum": want["loss_sum"]}
    tolerance = Tolerance(rtol=0.0, atol=1e-4)
    check = compare_outputs(want, got, tolerance)
    assert check.passed == bool(np.all(np.abs(got["w"] - want["w"]) <= 1e-4))
    if not check.passed:
        assert "'w'" in check.detail
    assert not compare_outputs(want, {"w": want["w"]}, tolerance).passed  # a missing output fails


def test_budget_checks_compare_each_measured_cost_with_its_limit():
    checks = {
        c.name: c.passed
        for c in budget_checks(Budget(memory_mb=10, step_ms=2, session_s=0.1), 12.0, [0.001, 0.003, 0.001], 50)
    }
    assert checks == {"budget.memory_mb": False, "budget.step_ms": True, "budget.session_s": True}
    assert not budget_checks(Budget(session_s=0.01), 0.0, [0.001], 50)[0].passed  # 50 steps of 1 ms is 50 ms
    assert budget_checks(Budget(), 1e9, [9.9], 10**6) == []


@pytest.mark.timeout(1800)  # a cold cache installs the three releases first
def test_the_task_passes_on_the_oldest_a_middle_and_the_newest_release(task, pool):
    plan = task.build_plan()
    report = release_test(task, pool=pool, plan=plan, runtimes=[OLDEST, MIDDLE, NEWEST])
    assert report["passed"] and report_passed(report)
    assert report["plan_sha256"] == plan_sha256(plan)
    for release in (OLDEST, MIDDLE, NEWEST):
        result = report["results"][release]
        assert result["plan_sha256"] == plan_sha256(versioned_plan(plan, release))  # bound to what was tested
        assert {c["name"] for c in result["checks"]} >= {"loads", "equivalence", *(p.name for p in task.predicates)}
        assert result["trial"]["runtime"] == release
        assert result["measured"]["median_step_ms"] > 0 and result["measured"]["peak_memory_mb"] >= 0
    assert report["results"][OLDEST]["opset"] == 18  # 1.15 lacks opset-19 kernels of ops this plan uses
    hashes = {r: report["results"][r]["plan_sha256"] for r in report["claimed"]}
    assert check_release_report(report, plan_sha256(plan), hashes) == [OLDEST, MIDDLE, NEWEST]


@pytest.mark.timeout(1800)
def test_a_plan_one_release_cannot_run_fails_there_and_the_gate_names_it(task, pool):
    plan = task.build_plan()
    forced = {OLDEST: versioned_plan(plan, OLDEST, opset=19)}  # Equal-19 has no kernel in 1.15
    report = release_test(task, pool=pool, plan=plan, versioned=forced, runtimes=[OLDEST, NEWEST])
    assert not report["passed"] and report["results"][NEWEST]["passed"]
    (check,) = report["results"][OLDEST]["checks"]
    assert check["name"] == "loads" and not check["passed"] and "Equal" in check["detail"]
    hashes = {r: report["results"][r]["plan_sha256"] for r in report["claimed"]}
    with pytest.raises(ReleaseGateError) as refused:
        check_release_report(report, plan_sha256(plan), hashes)
    assert (refused.value.runtime, refused.value.check) == (OLDEST, "loads")


@pytest.mark.timeout(1800)
def test_a_versioned_plan_that_computes_something_else_fails_equivalence(task, pool):
    plan = task.build_plan()
    other = dataclasses.replace(task, hyperparameters={"lr": 0.25}).build_plan()  # another step size
    report = release_test(
        task, pool=pool, plan=plan, versioned={MIDDLE: versioned_plan(other, MIDDLE)}, runtimes=[MIDDLE]
    )
    equivalence = next(c for c in report["results"][MIDDLE]["checks"] if c["name"] == "equivalence")
    assert not equivalence["passed"] and "differs" in equivalence["detail"] and not report["passed"]


def _with_rms_norm(hp) -> object:
    """The digits MLP with an RMSNormalization (opset 23, no older form) in its work graph."""
    plan = build_mlp_plan(
        64,
        (32,),
        10,
        learning_rate=hp["lr"],
        batch_size=16,
        epochs=2,
        opset=23,
        selector=load_tasks(TASK_FILE)[0].selector,
    )
    work = onnx.ModelProto.FromString(plan.work)
    work.graph.initializer.append(numpy_helper.from_array(np.ones(64, dtype=np.float32), "rms_scale"))
    work.graph.node.append(helper.make_node("RMSNormalization", ["x", "rms_scale"], ["x_normed"], name="rms"))
    work.ir_version = ir_version_for_opset(23)
    return dataclasses.replace(plan, work=work.SerializeToString())


@pytest.mark.timeout(1800)
def test_a_plan_with_no_form_for_a_claimed_release_fails_naming_the_op_and_version(task, pool):
    rms_task = dataclasses.replace(task, model=_with_rms_norm, runtimes=(MIDDLE, NEWEST))
    report = release_test(rms_task, pool=pool, runtimes=[KNOWN_RELEASES[2], NEWEST])
    (check,) = report["results"][KNOWN_RELEASES[2]]["checks"]
    assert check["name"] == "versioned_plan" and not check["passed"]
    assert (
        "RMSNormalization" in check["detail"] and "opset 20" in check["detail"] and KNOWN_RELEASES[2] in check["detail"]
    )
    assert report["results"][NEWEST]["passed"], report["results"][NEWEST]["checks"]


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(
    "task_file", [TASK_FILE, TASK_FILE.with_name("digits_cnn_task.py")], ids=["mlp", "cnn_from_onnx"]
)
def test_the_task_passes_on_every_known_release(task_file, pool):
    (swept,) = load_tasks(task_file)
    report = release_test(swept, pool=pool, runtimes=list(KNOWN_RELEASES))
    failed = {r: [c for c in e["checks"] if not c["passed"]] for r, e in report["results"].items() if not e["passed"]}
    assert report["passed"], failed
    print(release_table(report))  # the README's figures (`-s` shows them)
    for release, entry in report["results"].items():
        print(
            release,
            entry["opset"],
            entry["ir_version"],
            entry["trial"]["loss_by_epoch"],
            entry["trial"]["accuracy_by_round"][-1],
        )


@pytest.mark.slow
@pytest.mark.timeout(1800)  # installs onnxruntime 1.24.1's env on first use
def test_an_earlier_patch_is_tested_on_its_own_wheel_with_its_minors_plan_and_the_gate_takes_it(task, pool):
    plan = task.build_plan()
    report = release_test(task, pool=pool, plan=plan, runtimes=["1.24.1"])
    result = report["results"]["1.24.1"]
    assert report["passed"] and result["trial"]["runtime"] == "1.24.1"  # run by the 1.24.1 wheel itself
    assert result["measured_as"] == "1.24.4"
    assert result["plan_sha256"] == plan_sha256(versioned_plan(plan, "1.24.4"))
    assert check_release_report(report, plan_sha256(plan), {"1.24.1": result["plan_sha256"]}) == ["1.24.1"]
    assert release_table(report).splitlines()[-1] == (
        "1.24.1: an earlier patch, versioned as 1.24.4 (its minor's measured release)"
    )


@pytest.mark.timeout(1800)
def test_simulated_rounds_carry_the_server_optimizers_state(pool):
    (cnn,) = load_tasks(TASK_FILE.with_name("digits_cnn_task.py"))
    plain = release_test(cnn, pool=pool, runtimes=[NEWEST])
    momentum = release_test(
        dataclasses.replace(cnn, server_optimizer=FedAvgM(lr=1.0, momentum=0.9)), pool=pool, runtimes=[NEWEST]
    )
    assert momentum["results"][NEWEST]["checks"][1]["passed"]  # equivalence with its own reference
    same_first_round = (
        momentum["reference"]["trial"]["accuracy_by_round"][:2] == plain["reference"]["trial"]["accuracy_by_round"][:2]
    )
    later = (
        momentum["reference"]["trial"]["accuracy_by_round"][2:] != plain["reference"]["trial"]["accuracy_by_round"][2:]
    )
    assert same_first_round and later  # momentum starts at zero, then changes the steps


@pytest.mark.timeout(1800)
def test_an_evaluation_task_passes_on_real_releases_bound_to_its_training_plan(pool):
    train, evaluation = load_tasks(TASK_FILE.with_name("digits_eval_task.py"))
    report = release_test(evaluation, pool=pool, runtimes=[OLDEST, NEWEST])
    assert report["passed"] and report["kind"] == "eval"
    assert report["evaluates"] == {"task": train.name, "plan_sha256": plan_sha256(train.build_plan())}
    reference = report["reference"]["trial"]["accuracy_by_round"]
    assert reference[-1] >= 0.8 > reference[0]  # it measured models that improved round by round
    for release in (OLDEST, NEWEST):
        result = report["results"][release]
        assert [c["name"] for c in result["checks"]][:3] == [
            "loads",
            "equivalence",
            "accuracy_after_4_rounds_at_least_0.8",
        ]
        assert result["trial"]["accuracy_by_round"] == pytest.approx(reference, abs=1e-6)  # computed on that release
        assert result["trial"]["loss_by_epoch"] == []  # an evaluation does not train
    hashes = {r: report["results"][r]["plan_sha256"] for r in report["claimed"]}
    trained_sha = plan_sha256(train.build_plan())
    assert check_release_report(
        report, report["plan_sha256"], hashes, evaluates_plan_sha256=trained_sha, evaluates_runtimes=[OLDEST, NEWEST]
    ) == [OLDEST, NEWEST]


@pytest.mark.timeout(1800)
def test_an_evaluation_whose_predicate_fails_is_refused_naming_it(task, pool):
    demanding = evaluation_of(task, predicates=(accuracy_after_rounds(rounds=2, at_least=0.95),))
    report = release_test(demanding, pool=pool, runtimes=[MIDDLE])
    failed = [c for c in report["results"][MIDDLE]["checks"] if not c["passed"]]
    assert [c["name"] for c in failed] == ["accuracy_after_2_rounds_at_least_0.95"] and not report["passed"]
    hashes = {MIDDLE: report["results"][MIDDLE]["plan_sha256"]}
    with pytest.raises(ReleaseGateError) as refused:
        check_release_report(report, report["plan_sha256"], hashes)
    assert refused.value.check == "accuracy_after_2_rounds_at_least_0.95"


def test_the_release_table_has_a_row_per_release_and_names_the_first_failed_check():
    def entry(runtime, passed, diff, step, peak, failed=None):
        checks = [{"name": "loads", "passed": True, "detail": ""}]
        if failed:
            checks.append({"name": failed, "passed": False, "detail": "accuracy 0.7 after 4 rounds (needs >= 0.8)"})
        measured = {"max_abs_diff": diff, "median_step_ms": step, "peak_memory_mb": peak}
        return {"runtime": runtime, "passed": passed, "checks": checks, "measured": measured}

    report = {
        "reference": entry("1.31.1", True, None, 0.0201, 10.31),
        "results": {
            OLDEST: entry(OLDEST, True, 0.0, 0.0234, 6.44),
            NEWEST: entry(NEWEST, False, 2.5e-7, 0.021, 10.6, failed="accuracy_after_4_rounds"),
        },
    }
    lines = release_table(report).splitlines()
    assert lines[0].split() == ["release", "passed", "max", "abs", "diff", "ms/step", "peak", "MB"]
    assert [line.split() for line in lines[1:4]] == [
        ["reference", "1.31.1", "yes", "-", "0.020", "10.3"],
        [OLDEST, "yes", "0", "0.023", "6.4"],
        [NEWEST, "FAILED", "2.5e-07", "0.021", "10.6"],
    ]
    assert lines[4] == f"{NEWEST}: accuracy_after_4_rounds: accuracy 0.7 after 4 rounds (needs >= 0.8)"
    assert len({len(line) for line in lines[:4]}) == 1  # aligned columns
    report["results"]["1.24.1"] = {**entry("1.24.1", True, 0.0, 0.02, 9.6), "measured_as": "1.24.4"}
    assert release_table(report).splitlines()[-1] == (
        "1.24.1: an earlier patch, versioned as 1.24.4 (its minor's measured release)"
    )


def _reshaping_to(plan: Plan, shape: list[int]) -> Plan:
    """``plan`` whose work graph also reshapes its input ``x`` to ``shape`` (an output of its own,
    computed at every run): a graph onnxruntime loads and refuses only when it runs."""
    work = onnx.ModelProto.FromString(plan.work)
    work.graph.initializer.append(numpy_helper.from_array(np.array(shape, np.int64), "odd_shape"))
    work.graph.node.append(helper.make_node("Reshape", ["x", "odd_shape"], ["x_reshaped"], name="odd"))
    work.graph.output.append(helper.make_tensor_value_info("x_reshaped", onnx.TensorProto.FLOAT, None))
    return dataclasses.replace(plan, work=work.SerializeToString())


@pytest.mark.timeout(1800)
def test_a_release_that_fails_once_it_runs_is_failed_at_the_step_that_failed(task, pool):
    plan = task.build_plan()
    broken = {MIDDLE: _reshaping_to(versioned_plan(plan, MIDDLE), [7, -1])}  # a batch of 16 x 64 is no 7 x n
    report = release_test(task, pool=pool, plan=plan, versioned=broken, runtimes=[MIDDLE])
    checks = report["results"][MIDDLE]["checks"]
    assert [(c["name"], c["passed"]) for c in checks] == [("loads", True), ("equivalence", False)]
    assert "Reshape node. Name:'odd'" in checks[1]["detail"]
    with pytest.raises(ReleaseGateError) as refused:
        check_release_report(report, plan_sha256(plan), {MIDDLE: report["results"][MIDDLE]["plan_sha256"]})
    assert (refused.value.runtime, refused.value.check) == (MIDDLE, "equivalence")


@pytest.mark.timeout(1800)
def test_a_worker_that_crashes_while_training_fails_its_release_only_and_is_replaced(task, pool):
    crashing = pool.worker(NEWEST)
    train = crashing.train

    def crash_then_train(*args, **kwargs):  # onnxruntime dies as the local epochs begin
        os.kill(crashing._proc.pid, signal.SIGSEGV)
        crashing._proc.wait()  # dead before the request, not racing it: one message either way
        return train(*args, **kwargs)

    crashing.train = crash_then_train  # type: ignore[method-assign]
    report = release_test(task, pool=pool, runtimes=[NEWEST, OLDEST])
    checks = report["results"][NEWEST]["checks"]
    assert [(c["name"], c["passed"]) for c in checks] == [("loads", True), ("equivalence", True), ("runs", False)]
    assert "worker crashed (SIGSEGV) inside onnxruntime or numpy" in checks[2]["detail"]
    assert report["results"][OLDEST]["passed"] and not report["passed"]
    again = release_test(task, pool=pool, runtimes=[NEWEST])  # the release's next test gets a new worker
    assert again["passed"] and pool.worker(NEWEST) is not crashing


def test_a_plan_that_fails_on_the_reference_is_refused_before_any_release(task, tmp_path):
    broken = _reshaping_to(task.build_plan(), [7, -1])
    with WorkerPool(cache=tmp_path, create=False) as untouched:  # no release is reached: no env is needed
        with pytest.raises(ReleaseTestError) as refused:
            release_test(task, pool=untouched, plan=broken, runtimes=[OLDEST])
    message = str(refused.value)
    assert "the unversioned plan does not run on the reference, this interpreter's onnxruntime" in message
    assert "Reshape node. Name:'odd'" in message and "fix the plan and build it again" in message


def test_an_env_that_cannot_be_made_stops_the_release_tests_instead_of_failing_the_release(task, tmp_path):
    with WorkerPool(cache=tmp_path, base_python=tmp_path / "no-python") as cannot_install:
        with pytest.raises(ReleaseTestError) as stopped:  # not a failed release: nothing the release did
            release_test(task, pool=cannot_install, runtimes=[OLDEST])
    assert "\n" not in str(stopped.value) and f"cannot make the env of onnxruntime {OLDEST}" in str(stopped.value)
    assert isinstance(stopped.value, TaskError)  # said in one line by `plan test` and by a fleet


def test_an_equivalence_failure_says_which_setting_loosens_it():
    """ResNet-50's step on onnxruntime 1.15.1 differs from the reference by 8.7e-4: the failure
    names the task's setting that decides whether that is acceptable."""
    check = compare_outputs({"w": np.zeros(3, np.float32)}, {"w": np.full(3, 1e-3, np.float32)}, Tolerance())
    assert not check.passed
    assert "differs by up to 0.001" in check.detail and "tolerance=Tolerance(rtol=..., atol=...)" in check.detail
