"""A regression model (mean squared error, no accuracy) through the toolchain: the executor's
``evaluate`` reports its loss without assuming a ``correct`` metric, and its training and
evaluation tasks pass release tests whose predicates read losses, on a real release."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from device_runtime import PlanExecutor
from emulator.releases.envs import KNOWN_RELEASES
from emulator.releases.workers import WorkerPool
from emulator.toolchain import evaluation_plan_from_onnx, initial_weights_from_onnx, release_test
from emulator.toolchain.tasks import ProxyData, Task, evaluation_of, loss_after_rounds
from example_store import ExampleSelector

FEATURES = 6
SELECTOR = ExampleSelector("app:/readings")


def linear_model() -> bytes:
    """pred = x @ W + b, all zeros: an exporter's linear regressor before training."""
    inits = [
        numpy_helper.from_array(np.zeros((FEATURES, 1), np.float32), "W"),
        numpy_helper.from_array(np.zeros(1, np.float32), "b"),
    ]
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["pred"])],
        "regressor",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", FEATURES])],
        [helper.make_tensor_value_info("pred", TensorProto.FLOAT, ["N", 1])],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def readings(n: int = 480, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    y = (x @ rng.standard_normal((FEATURES, 1)) + 0.5 + 0.05 * rng.standard_normal((n, 1))).astype(np.float32)
    return {"x": x, "y": y}


def test_evaluate_reports_a_regression_plans_loss_and_no_accuracy():
    model, data = linear_model(), readings()
    plan = evaluation_plan_from_onnx(model, label="y", loss="mse", batch_size=64, example_selector=SELECTOR)
    assert "correct" not in plan.metric_names
    weights = initial_weights_from_onnx(model, plan)
    weights["b"] = np.array([0.25], np.float32)
    batches = [{k: v[i : i + 64] for k, v in data.items()} for i in range(0, len(data["y"]), 64)]
    measured = PlanExecutor(plan).evaluate(weights, batches)
    assert measured["eval_loss"] == pytest.approx(float(np.mean((0.25 - data["y"]) ** 2)), rel=1e-5)
    assert measured["num_examples"] == len(data["y"]) and "eval_accuracy" not in measured


@pytest.mark.timeout(1800)  # a cold cache installs the release first
def test_a_regression_task_and_its_evaluation_pass_release_tests_on_their_losses():
    task = Task(
        name="regressor",
        model=linear_model(),
        proxy=ProxyData.split(readings(), devices=3),
        loss="mse",
        label="y",
        hyperparameters={"lr": 0.1},
        selector=SELECTOR,
        batch_size=16,
        runtimes=(KNOWN_RELEASES[-1],),
        predicates=(loss_after_rounds(rounds=3, at_most=0.2),),
    )
    evaluation = evaluation_of(task, predicates=(loss_after_rounds(rounds=3, at_most=0.2),))
    with WorkerPool() as pool:
        trained, evaluated = (release_test(t, pool=pool) for t in (task, evaluation))
    assert trained["passed"] and evaluated["passed"], (trained["results"], evaluated["results"])
    losses = evaluated["results"][KNOWN_RELEASES[-1]]["trial"]["loss_by_round"]
    assert losses == pytest.approx(
        trained["reference"]["trial"]["loss_by_round"], rel=1e-4
    )  # the same models, measured
    assert losses[0] > 1 > 0.2 >= losses[3]
    assert evaluated["results"][KNOWN_RELEASES[-1]]["trial"]["accuracy_by_round"] == [None] * 4  # no accuracy to report
