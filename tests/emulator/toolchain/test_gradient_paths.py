"""Gradients only where they flow: integer, boolean and shape paths, and float paths no trainable
weight reaches, need no gradient rule; an op without one on a differentiable path is still refused.

The models carry the ops real exporters put beside the trainable path (BERT's int64 token-type
buffer through ``GatherElements``, the dynamo exporter's boolean mask through ``GatherND``,
torchvision's int64 shape arithmetic with ``Mod``, ``CastLike`` from int64 to float); one SGD step
with lr=1 of the generated plan is the loss's gradient, checked against central finite differences
of the inference model run in onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from device_runtime import PlanExecutor
from device_runtime.executor import make_session
from emulator.toolchain import (
    SGD,
    UnsupportedOpError,
    evaluation_plan_from_onnx,
    initial_weights_from_onnx,
    training_plan_from_onnx,
    vjp_model,
)
from example_store import ExampleSelector
from tests.emulator.toolchain.gradcheck import vjp_error
from tests.emulator.toolchain.models import F, glorot, model

SELECTOR = ExampleSelector("app:/paths")
I64 = TensorProto.INT64


def _beside_the_trainable_path(seed: int = 0) -> onnx.ModelProto:
    """x -> fmod (no weight before it) -> MatMul w1 + b1 (+ a token-type term gathered from an int64
    buffer and CastLike'd to the activations) -> Reshape to its own shape taken through Mod -> Tanh,
    halved where a boolean mask gathered with GatherND is off -> MatMul w2."""
    rng = np.random.default_rng(seed)
    inits = {
        "w1": glorot(rng, 4, 3),
        "b1": rng.standard_normal(3).astype(np.float32),
        "w2": glorot(rng, 3, 2),
        "three": np.array(3.0, np.float32),
        "half": np.array(0.5, np.float32),
        "token_types": np.array([[0, 1, 2, 1]], np.int64),
        "positions": np.array([[3, 1, 0]], np.int64),
        "big": np.array([1000, 1000], np.int64),
        "mask_table": np.array([[True, False, True], [False, True, True]]),
        "mask_row": np.array([[1]], np.int64),
    }
    nodes = [
        helper.make_node("Mod", ["x", "three"], ["x_mod"], name="input_fmod", fmod=1),  # float, no weight reaches it
        helper.make_node("MatMul", ["x_mod", "w1"], ["h"], name="dense1"),
        helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),
        helper.make_node("GatherElements", ["token_types", "positions"], ["tt"], name="token_type_gather", axis=1),
        helper.make_node("CastLike", ["tt", "hb"], ["tt_float"], name="token_type_cast"),
        helper.make_node("Add", ["hb", "tt_float"], ["h2"], name="add_token_type"),
        helper.make_node("Shape", ["h2"], ["h2_shape"], name="shape"),
        helper.make_node("Mod", ["h2_shape", "big"], ["h2_shape_mod"], name="shape_mod"),
        helper.make_node("Reshape", ["h2", "h2_shape_mod"], ["h3"], name="reshape"),
        helper.make_node("Tanh", ["h3"], ["t"], name="tanh"),
        helper.make_node("GatherND", ["mask_table", "mask_row"], ["mask"], name="mask_gather"),
        helper.make_node("Mul", ["t", "half"], ["t_half"], name="halve"),
        helper.make_node("Where", ["mask", "t", "t_half"], ["masked"], name="apply_mask"),
        helper.make_node("MatMul", ["masked", "w2"], ["y"], name="dense2"),
    ]
    return model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 4])],
        [helper.make_tensor_value_info("y", F, ["N", 2])],
        inits,
        opset=17,
    )


def _mse(source: onnx.ModelProto, weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    """The mean squared error of ``source`` with ``weights`` in place of its initializers."""
    m = onnx.ModelProto()
    m.CopyFrom(source)
    for init in m.graph.initializer:
        if init.name in weights:
            init.CopyFrom(numpy_helper.from_array(weights[init.name].astype(np.float32), init.name))
    (pred,) = make_session(m.SerializeToString()).run(["y"], {"x": x})
    return float(np.mean((pred.astype(np.float64) - y) ** 2))


def test_ops_on_integer_boolean_shape_and_weightless_paths_need_no_rule_and_the_step_is_the_gradient():
    source = _beside_the_trainable_path()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    y = rng.standard_normal((5, 2)).astype(np.float32)
    plan = training_plan_from_onnx(
        source, label="y", loss="mse", optimizer=SGD(1.0), batch_size=5, example_selector=SELECTOR
    )
    assert set(plan.weight_names) == {"w1", "b1", "w2"}
    weights = initial_weights_from_onnx(source, plan)
    executor = PlanExecutor(plan)
    result = executor.run_device(weights, lambda: [{"x": x, "y": y}])
    new = executor.final_weights(weights, result)
    step = {w: (weights[w] - new[w]).astype(np.float64) for w in plan.weight_names}
    assert all(np.abs(g).max() > 1e-3 for g in step.values())
    eps = 1e-2
    for k in range(3):  # directional derivatives along random directions
        v = {w: rng.standard_normal(weights[w].shape) for w in plan.weight_names}
        plus = {w: weights[w] + eps * v[w] for w in plan.weight_names}
        minus = {w: weights[w] - eps * v[w] for w in plan.weight_names}
        numeric = (_mse(source, plus, x, y) - _mse(source, minus, x, y)) / (2 * eps)
        analytic = sum(float(np.sum(step[w] * v[w])) for w in plan.weight_names)
        assert abs(numeric - analytic) <= 2e-3 * max(1.0, abs(numeric)), (k, numeric, analytic)
    evaluation = evaluation_plan_from_onnx(
        source, label="y", loss="mse", batch_size=5, example_selector=SELECTOR, training_plan=plan
    )
    metrics = PlanExecutor(evaluation).run_device(weights, lambda: [{"x": x, "y": y}]).metrics
    assert metrics["loss"] == pytest.approx(_mse(source, {}, x, y), rel=1e-5)


def test_a_castlike_whose_target_type_is_on_the_differentiable_path_takes_no_gradient():
    # CastLike(int64 buffer, like=h): h is differentiated, but the cast's value does not depend on it
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("CastLike", ["ids", "h"], ["ids_float"], name="ids_like_h"),
        helper.make_node("Mul", ["h", "ids_float"], ["y"]),
    ]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, [3, 4]), helper.make_tensor_value_info("w", F, [4, 2])],
        [helper.make_tensor_value_info("y", F, [3, 2])],
        {"ids": np.array([[1, 2], [3, 0], [2, 2]], np.int64)},
    )
    rng = np.random.default_rng(0)
    values = {"x": rng.standard_normal((3, 4)).astype(np.float32), "w": rng.standard_normal((4, 2)).astype(np.float32)}
    assert vjp_error(m, values, ["x", "w"], eps=1e-2) < 3e-3


def test_an_op_without_a_rule_on_the_differentiable_path_is_still_refused_by_op_and_node():
    # an op with no rule (Hardmax) on a trainable table; the table read by GatherElements trains (test below)
    inits = {"table": np.ones((4, 3), np.float32)}
    nodes = [
        helper.make_node("Hardmax", ["table"], ["picked"], name="pick_weights", axis=1),
        helper.make_node("MatMul", ["x", "picked"], ["y"], name="dense"),
    ]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 4])],
        [helper.make_tensor_value_info("y", F, ["N", 3])],
        inits,
    )
    with pytest.raises(UnsupportedOpError, match="'Hardmax' \\(node 'pick_weights'\\) has no gradient rule") as info:
        training_plan_from_onnx(m, label="y", loss="mse", optimizer=SGD(0.1), batch_size=4, example_selector=SELECTOR)
    assert (info.value.op_type, info.value.node_name) == ("Hardmax", "pick_weights")
    with pytest.raises(UnsupportedOpError, match="'Hardmax' \\(node 'pick_weights'\\)"):
        vjp_model(m, outputs=["y"], wrt=["table"])


def test_a_table_gathered_on_the_differentiable_path_trains_by_its_rule():
    """GatherElements of a trainable table (torch.gather of a bias table) is differentiated: one SGD step
    with lr=1 is the gradient, against central differences of the model in onnxruntime."""
    rng = np.random.default_rng(2)
    inits = {"table": rng.standard_normal((4, 3)).astype(np.float32), "picks": np.array([[0, 2, 1, 1]] * 4, np.int64)}
    nodes = [
        helper.make_node("GatherElements", ["table", "picks"], ["picked"], name="gather_weights", axis=1),
        helper.make_node("MatMul", ["x", "picked"], ["y"], name="dense"),
    ]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 4])],
        [helper.make_tensor_value_info("y", F, ["N", 4])],
        inits,
    )
    x = rng.standard_normal((5, 4)).astype(np.float32)
    y = rng.standard_normal((5, 4)).astype(np.float32)
    plan = training_plan_from_onnx(
        m, label="y", loss="mse", optimizer=SGD(1.0), batch_size=5, example_selector=SELECTOR
    )
    start = initial_weights_from_onnx(m, plan)
    result = PlanExecutor(plan).run_device(start, lambda: [{"x": x, "y": y}])
    step = start["table"] - PlanExecutor(plan).final_weights(start, result)["table"]
    eps, numeric = 1e-3, np.zeros_like(start["table"])
    for i in np.ndindex(*start["table"].shape):
        plus, minus = dict(start), dict(start)
        plus["table"] = start["table"].copy()
        minus["table"] = start["table"].copy()
        plus["table"][i] += eps
        minus["table"][i] -= eps
        numeric[i] = (_mse(m, plus, x, y) - _mse(m, minus, x, y)) / (2 * eps)
    assert np.allclose(step, numeric, atol=2e-3)


def test_a_frozen_weight_takes_its_ops_off_the_differentiable_path():
    # the table is a constant when only the dense weight trains: GatherElements then needs no rule
    inits = {
        "table": np.ones((4, 3), np.float32),
        "picks": np.array([[0, 2, 1]] * 4, np.int64),
        "w": np.full((3, 2), 0.5, np.float32),
    }
    nodes = [
        helper.make_node("GatherElements", ["table", "picks"], ["picked"], name="gather_weights", axis=1),
        helper.make_node("MatMul", ["x", "picked"], ["h"]),
        helper.make_node("MatMul", ["h", "w"], ["y"]),
    ]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 4])],
        [helper.make_tensor_value_info("y", F, ["N", 2])],
        inits,
    )
    plan = training_plan_from_onnx(
        m, label="y", loss="mse", optimizer=SGD(0.1), batch_size=4, trainable=["w"], example_selector=SELECTOR
    )
    assert plan.weight_names == ("w",)
    PlanExecutor(plan).smoke_test(initial_weights_from_onnx(m, plan))
