"""The model engineer's commands end to end: ``fedfleet plan build``, ``plan keygen``, ``plan test``
on real releases (signing its reports), ``plan from-onnx`` and ``fedfleet deploy`` to a server that
requires release reports signed by a key it trusts, including an evaluation task that devices on
old releases then run."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from device_runtime import FLRuntime, Outcome, PlanExecutor, RuntimeEnvironment
from device_runtime.plan import load_plan
from emulator.cli.commands import main
from emulator.releases.workers import ReleasePlans, WorkerPool
from emulator.toolchain.bundle import read_bundle
from emulator.toolchain.release_signing import load_signing_key, public_key_path, sign_report
from emulator.toolchain.versioning import plan_sha256
from example_store import SQLiteExampleStore
from server_stub import AdminError, RoundConfig, ServerThread
from server_stub.admin_client import task_body
from server_stub.release_trust import read_release_trust

TASK_FILE = Path(__file__).resolve().parents[3] / "examples" / "tasks" / "digits_task.py"
ADMIN_KEY = "operator-key-for-the-cli-test-0123456789"


@pytest.fixture
def tester_key(tmp_path) -> Path:
    """A tester's signing key made with `fedfleet plan keygen`; a server trusts its KEY.pub."""
    (tmp_path / "keys").mkdir()  # keygen makes no folder, as `fedfleet authority` makes none
    key = tmp_path / "keys" / "tester.key"
    assert main(["plan", "keygen", "--key", str(key), "--label", "cli-test"]) == 0
    return key


def logistic_regression(path: Path) -> Path:
    """An inference model made with onnx's helpers: logits = x @ W + b, probabilities by Softmax."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array((0.01 * rng.standard_normal((64, 10))).astype(np.float32), "W"),
        numpy_helper.from_array(np.zeros(10, dtype=np.float32), "b"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "W", "b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "digits_lr",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10]),
            helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", 10]),
        ],
        initializer=inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


@pytest.mark.timeout(1800)  # a cold cache installs the releases first
def test_build_test_and_deploy_to_a_server_that_requires_reports(tmp_path, capsys, monkeypatch, tester_key):
    out = tmp_path / "digits"
    assert main(["plan", "build", str(TASK_FILE), "-o", str(out), "--runtimes", "1.15.1", "1.31.1"]) == 0
    manifest = json.loads((out / "digits_mlp" / "manifest.json").read_text())
    assert sorted(manifest["versions"]) == ["1.15.1", "1.31.1"]
    for release, entry in manifest["versions"].items():
        data = (out / "digits_mlp" / entry["file"]).read_bytes()
        assert plan_sha256(data) == entry["sha256"] and load_plan(data, runtime_version=release)
    trusted = read_release_trust(public_key_path(tester_key))  # the file an operator passes to --release-trust
    with ServerThread(tmp_path / "server.db", admin_key=ADMIN_KEY, release_trust=trusted) as server:
        server.service.require_release_reports = True
        monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", ADMIN_KEY)
        deploy = ["deploy", str(out), "--server", server.url, "--population", "digits"]
        assert main(deploy) == 2  # not tested yet: no report to send
        assert "no release report" in capsys.readouterr().err
        assert main(["plan", "test", str(out)]) == 0  # unsigned: nobody vouches for it
        printed = capsys.readouterr().out
        assert "will not be signed" in printed
        assert printed.endswith(
            f"next: sign the reports (fedfleet plan test {out} --signing-key KEY), then fedfleet deploy {out} "
            "--server URL --population P\n"
        )
        assert main(deploy) == 1
        assert "RELEASE_REPORT_UNSIGNED" in capsys.readouterr().err
        with server.admin() as admin:
            assert admin.populations() == []  # a refused deploy leaves no population behind
        assert main(["plan", "test", str(out), "--signing-key", str(tester_key)]) == 0
        printed = capsys.readouterr().out
        assert all(
            h in printed for h in ("release", "passed", "max abs diff", "ms/step", "peak MB")
        )  # the table's header
        rows = {line.split()[0]: line.split()[1:] for line in printed.splitlines() if line.startswith("  1.")}
        assert rows["1.15.1"][0] == rows["1.31.1"][0] == "yes" and "digits_mlp: passed" in printed
        assert float(rows["1.15.1"][1]) <= 1e-5 and float(rows["1.15.1"][2]) > 0 and float(rows["1.15.1"][3]) >= 0
        assert printed.endswith(f"next: fedfleet deploy {out} --server URL --population P\n")
        assert main(deploy) == 0
        assert capsys.readouterr().out.endswith(
            f"next: fedfleet status --server {server.url} --population digits (its tasks and open round)\n"
        )
        assert main(deploy) == 0  # sent again, as after a lost answer: the task it made, stored once
        assert "digits_mlp (plan " in (again := capsys.readouterr().out) and "already deployed as it is" in again
        with server.admin() as admin:
            status = admin.status("digits")
            admin.stop_task("digits", "digits_mlp")
        assert main(deploy) == 1  # the same bundle again to start it again: said in one line, not "deployed"
        said = capsys.readouterr()
        assert said.out == "" and len(said.err.splitlines()) == 1
        assert "digits_mlp is stopped: a task does not run again" in said.err and "under a new name" in said.err
    assert [t["name"] for t in status["tasks"]] == ["digits_mlp"]
    assert status["active_tasks"][0]["runtimes"] == ["1.15.1", "1.31.1"]


def test_build_refuses_a_claimed_release_the_plan_has_no_form_for(tmp_path, capsys):
    task_file = tmp_path / "rms_task.py"
    task_file.write_text(f"""
import dataclasses, runpy
import numpy as np, onnx
from onnx import helper, numpy_helper
from device_runtime import build_mlp_plan
base = runpy.run_path({str(TASK_FILE)!r})["task"]

def model(hp):
    plan = build_mlp_plan(64, (8,), 10, opset=23, selector=base.selector)
    work = onnx.ModelProto.FromString(plan.work)
    work.graph.initializer.append(numpy_helper.from_array(np.ones(64, dtype=np.float32), "scale"))
    work.graph.node.append(helper.make_node("RMSNormalization", ["x", "scale"], ["normed"], name="rms"))
    return dataclasses.replace(plan, work=work.SerializeToString())

task = dataclasses.replace(base, name="rms", model=model, runtimes=("1.17.3", "1.31.1"))
""")
    assert main(["plan", "build", str(task_file), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "RMSNormalization" in err and "node 'rms'" in err and "opset 20" in err and "1.17.3" in err


@pytest.mark.timeout(1800)
def test_from_onnx_makes_a_plan_that_trains(tmp_path, capsys, digits):
    model = logistic_regression(tmp_path / "digits_lr.onnx")
    plan_path = tmp_path / "digits_lr.fedplan"
    args = [
        "plan",
        "from-onnx",
        str(model),
        "--label",
        "y",
        "--loss",
        "cross_entropy",
        "--optimizer",
        "sgd",
        "--lr",
        "0.5",
        "--batch-size",
        "16",
        "--collection",
        "app:/digits",
        "--output",
        "logits",  # its other output is the probabilities
        "-o",
        str(plan_path),
    ]
    assert main(args) == 0
    assert "wrote" in capsys.readouterr().out
    plan = load_plan(plan_path.read_bytes())
    executor = PlanExecutor(plan)
    from emulator.toolchain import initial_weights_from_onnx

    weights = initial_weights_from_onnx(model, plan)
    data = [{"x": digits.x_train[:320], "y": digits.y_train[:320]}]
    first = executor.run_device(weights, executor.batches_from_examples(lambda: data))
    trained = executor.final_weights(weights, first)
    second = executor.run_device(trained, executor.batches_from_examples(lambda: data))
    assert second.metrics["loss"] < first.metrics["loss"]


def test_plan_build_of_a_task_over_a_model_with_several_outputs_says_which_the_loss_reads_or_refuses(tmp_path, capsys):
    """A task file's Task with no output=: (logits, features) is refused in one line listing them;
    of (aux_loss, logits) the logits are built, said in a line."""
    data = Path(__file__).resolve().parents[1] / "toolchain" / "data"
    task_file = tmp_path / "task.py"
    for model in ("two_heads", "aux_first"):
        task_file.write_text(
            "from emulator.toolchain.tasks import ProxyData, Task\n"
            f"task = Task(name='heads', model={str(data / f'{model}.onnx')!r}, proxy=lambda: ProxyData((), {{}}))\n"
        )
        code = main(["plan", "build", str(task_file), "-o", str(tmp_path / model), "--runtimes", "1.31.1"])
        printed = capsys.readouterr()
        if model == "two_heads":
            assert (code, printed.out) == (2, "")
            assert printed.err == (
                "fedfleet plan build: task 'heads': the model has 2 outputs (logits float32 [N, 3], features float32 "
                "[N, 16]); set output= in the Task to the name of the one the loss reads\n"
            )
            assert not (tmp_path / model / "heads").exists()
        else:
            assert (code, printed.err) == (0, "")
            assert printed.out.splitlines()[0] == (
                "heads: the model has 2 outputs (aux_loss float32 [], logits float32 [N, 3]): the loss reads "
                "'logits', the only float one with a batch axis and a class axis (output= in the Task picks another)"
            )


@pytest.mark.timeout(1800)
def test_a_task_from_an_onnx_file_passes_release_tests_on_real_releases(tmp_path, capsys):
    model = logistic_regression(tmp_path / "digits_lr.onnx")
    task_file = tmp_path / "onnx_task.py"
    task_file.write_text(f"""
import dataclasses, runpy
from emulator.toolchain.tasks import Budget
base = runpy.run_path({str(TASK_FILE)!r})["task"]
task = dataclasses.replace(
    base, name="digits_lr", model={str(model)!r}, output="logits", hyperparameters={{"lr": 0.5}}, budget=Budget()
)
""")
    assert main(["plan", "test", str(task_file), "-o", str(tmp_path / "out"), "--runtimes", "1.15.1", "1.31.1"]) == 0, (
        capsys.readouterr()
    )
    report = json.loads((tmp_path / "out" / "digits_lr" / "release_report.json").read_text())
    assert report["passed"] and sorted(report["results"]) == ["1.15.1", "1.31.1"]


@pytest.mark.timeout(1800)
def test_a_task_group_is_tested_per_variant_and_deployed_only_if_all_pass(tmp_path, capsys, monkeypatch, tester_key):
    out = tmp_path / "sweep"
    sweep = TASK_FILE.with_name("digits_lr_sweep.py")
    monkeypatch.setenv("FEDFLEET_SIGNING_KEY", str(tester_key))  # the key from the environment instead of --signing-key
    assert main(["plan", "test", str(sweep), "-o", str(out), "--runtimes", "1.31.1"]) == 1  # one variant fails
    reports = {p.parent.name: json.loads(p.read_text()) for p in out.glob("*/release_report.json")}
    assert {name: r["passed"] for name, r in reports.items()} == {
        "digits_mlp-lr0.1": False,
        "digits_mlp-lr0.2": True,
        "digits_mlp-lr0.3": True,
    }  # too slow to reach 0.8
    assert all("signature" in r for r in reports.values())  # failed or passed, each says who ran it
    with ServerThread(
        tmp_path / "server.db", admin_key=ADMIN_KEY, release_trust=read_release_trust(public_key_path(tester_key))
    ) as server:
        server.service.require_release_reports = True
        monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", ADMIN_KEY)
        capsys.readouterr()
        assert main(["deploy", str(out), "--server", server.url, "--population", "sweep"]) == 1
        err = capsys.readouterr().err
        assert "RELEASE_TEST_FAILED" in err and "accuracy_after_4_rounds" in err and "digits_mlp-lr0.1" in err
        with server.admin() as admin:
            assert admin.populations() == []  # nothing of the group was stored, not even its population


@pytest.mark.timeout(1800)
def test_an_evaluation_task_is_tested_deployed_to_a_gated_server_and_evaluated_by_devices(
    tmp_path, capsys, monkeypatch, digits, tester_key
):
    task_file = tmp_path / "eval_task.py"
    task_file.write_text(f"""
import dataclasses, runpy
from emulator.toolchain.tasks import accuracy_after_rounds, evaluation_of
from example_store import ExampleSelector
from server_stub import RoundConfig
base = runpy.run_path({str(TASK_FILE)!r})["task"]
task = dataclasses.replace(base, rounds=RoundConfig(goal_count=2, over_selection=1.0, min_fraction=1.0, min_reports=1))
evaluation = evaluation_of(task, selector=ExampleSelector("app:/digits_heldout"), batch_size=32,
                           predicates=(accuracy_after_rounds(rounds=2, at_least=0.5),))
tasks = [task, evaluation]
""")
    out, releases = tmp_path / "bundle", ["1.15.1", "1.31.1"]
    assert (
        main(
            ["plan", "test", str(task_file), "-o", str(out), "--runtimes", *releases, "--signing-key", str(tester_key)]
        )
        == 0
    ), capsys.readouterr()
    report = json.loads((out / "digits_mlp_eval" / "release_report.json").read_text())
    assert report["passed"] and report["kind"] == "eval" and sorted(report["results"]) == releases
    manifest = json.loads((out / "digits_mlp_eval" / "manifest.json").read_text())
    trusted = read_release_trust(public_key_path(tester_key))
    with (
        ServerThread(tmp_path / "server.db", admin_key=ADMIN_KEY, release_trust=trusted) as server,
        WorkerPool() as pool,
    ):
        server.service.require_release_reports = True
        train, evaluation = read_bundle(out)
        narrow = copy.deepcopy(evaluation.report())  # a passed report, but on fewer releases than the training task's
        narrow["claimed"], narrow["results"] = ["1.31.1"], {"1.31.1": narrow["results"]["1.31.1"]}
        narrow = sign_report(narrow, load_signing_key(tester_key))  # as the tester's run on one release would sign it
        config = RoundConfig.from_dict(train.manifest["round_config"])
        bodies = [
            task_body(
                train.task.name,
                train.plan,
                train.checkpoint,
                config,
                versioned_plans=train.versions,
                release_report=train.report(),
            ),
            task_body(
                evaluation.task.name,
                evaluation.plan,
                None,
                config,
                evaluates=train.task.name,
                versioned_plans={"1.31.1": evaluation.versions["1.31.1"]},
                release_report=narrow,
            ),
        ]
        with server.admin() as admin:
            admin.create_population("digits")
            with pytest.raises(AdminError) as refused:
                admin.deploy_tasks("digits", bodies)
        assert refused.value.code == "RELEASE_REPORT_INCOMPLETE" and "1.15.1" in str(refused.value)
        monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", ADMIN_KEY)
        assert main(["deploy", str(out), "--server", server.url, "--population", "digits"]) == 0, capsys.readouterr()
        plans, served, outcomes = ReleasePlans(pool), {}, []
        for round_number in range(2):  # a training round, then an evaluation round of its model
            for i, release in enumerate(releases):
                with SQLiteExampleStore(tmp_path / f"device{i}.db") as store:
                    if round_number == 0:
                        part = slice(100 * i, 100 * i + 100)
                        store.add(
                            "app:/digits",
                            ({"x": x, "y": y} for x, y in zip(digits.x_train[part], digits.y_train[part])),
                        )
                        store.add(
                            "app:/digits_heldout",
                            ({"x": x, "y": y} for x, y in zip(digits.x_test[:60], digits.y_test[:60])),
                        )
                    with FLRuntime(
                        "digits",
                        server.url,
                        store,
                        runtime_version=release,
                        cache_dir=tmp_path / f"cache{i}",
                        environment=RuntimeEnvironment(loaded_plans=plans),
                    ) as runtime:
                        result = runtime.run_session()
                        outcomes.append((release, result.outcome))
                        served.setdefault(release, set()).update(runtime._plans)
        with server.admin() as admin:
            rounds = {task: admin.rounds("digits", task) for task in ("digits_mlp", "digits_mlp_eval")}
    assert outcomes == [(r, Outcome.COMPLETED) for r in releases] * 2
    assert (
        [r["status"] for r in rounds["digits_mlp"]] == [r["status"] for r in rounds["digits_mlp_eval"]] == ["committed"]
    )
    evaluated = rounds["digits_mlp_eval"][0]["metrics"]
    assert 0 <= evaluated["eval_accuracy"] <= 1 and evaluated["eval_loss"] > 0
    assert evaluated["evaluated_checkpoint_id"] == rounds["digits_mlp"][0]["checkpoint_id"]  # the model just trained
    for release in releases:  # each device got the evaluation plan tested for its release
        assert manifest["versions"][release]["sha256"] in served[release]
