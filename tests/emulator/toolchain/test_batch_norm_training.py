"""BatchNormalization in a training step keeps torch's semantics: it normalizes with the biased batch
variance and updates the running variance with the unbiased one (var * n/(n-1), n the elements per
channel), both running statistics with torch's momentum (ONNX's ``momentum`` is 1 - torch's).

The reference is numpy written from torch's documentation of ``nn.BatchNorm2d``."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from device_runtime import PlanExecutor
from emulator.toolchain import SGD, initial_weights_from_onnx, training_plan_from_onnx, vjp_model
from emulator.toolchain.autodiff import constant_values, needed_for, tensor_infos
from emulator.toolchain.emitter import Emitter
from emulator.toolchain.gradients import batch_norms
from example_store import ExampleSelector
from tests.emulator.toolchain.gradcheck import single_op_model, training_forward_model, vjp_error
from tests.emulator.toolchain.models import F, model

MOMENTUM = 0.9  # ONNX's: torch's momentum=0.1 exports as 0.9


def _bn_model(channels: int, side: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    inits = {
        "scale": rng.uniform(0.5, 1.5, channels).astype(np.float32),
        "bias": rng.normal(0, 0.1, channels).astype(np.float32),
        "running_mean": rng.normal(0, 0.5, channels).astype(np.float32),
        "running_var": rng.uniform(0.5, 1.5, channels).astype(np.float32),
        "fc": rng.standard_normal((channels * side * side, 2)).astype(np.float32),
    }
    nodes = [
        helper.make_node(
            "BatchNormalization",
            ["x", "scale", "bias", "running_mean", "running_var"],
            ["bn"],
            epsilon=1e-5,
            momentum=MOMENTUM,
        ),
        helper.make_node("Flatten", ["bn"], ["flat"]),
        helper.make_node("MatMul", ["flat", "fc"], ["y"]),
    ]
    return model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", channels, side, side])],
        [helper.make_tensor_value_info("y", F, ["N", 2])],
        inits,
    )


def _torch_running_stats(x: np.ndarray, mean: np.ndarray, var: np.ndarray, torch_momentum: float):
    """torch.nn.BatchNorm2d.train(): running = (1 - m) * running + m * batch statistic, the variance
    unbiased (torch.var(unbiased=True) over N, H, W)."""
    x64 = x.astype(np.float64)
    batch_mean = x64.mean(axis=(0, 2, 3))
    batch_var = x64.var(axis=(0, 2, 3), ddof=1)
    return (
        (1 - torch_momentum) * mean + torch_momentum * batch_mean,
        (1 - torch_momentum) * var + torch_momentum * batch_var,
    )


def _torch_forward(x: np.ndarray, scale, bias, fc) -> np.ndarray:
    """The layer's output in training mode: normalized with the biased batch variance."""
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=(0, 2, 3), keepdims=True)
    var = x64.var(axis=(0, 2, 3), keepdims=True)
    c = (1, -1, 1, 1)
    bn = (x64 - mean) / np.sqrt(var + 1e-5) * scale.reshape(c) + bias.reshape(c)
    return bn.reshape(len(x), -1) @ fc


def _one_step(source, x, y):
    plan = training_plan_from_onnx(
        source,
        label="y",
        loss="mse",
        optimizer=SGD(1e-3),
        batch_size=len(x),
        example_selector=ExampleSelector("app:/bn"),
    )
    start = initial_weights_from_onnx(source, plan)
    executor = PlanExecutor(plan)
    result = executor.run_device(start, lambda: [{"x": x, "y": y}])
    return plan, start, result, executor.final_weights(start, result)


@pytest.mark.parametrize(("batch", "side"), [(4, 3), (2, 1), (7, 2)])
def test_running_variance_takes_the_unbiased_batch_variance_as_torch_does(batch, side):
    rng = np.random.default_rng(batch * 10 + side)
    x = (rng.standard_normal((batch, 3, side, side)) * rng.uniform(0.5, 2.0, (1, 3, 1, 1)) + 0.3).astype(np.float32)
    y = rng.standard_normal((batch, 2)).astype(np.float32)
    source = _bn_model(3, side)
    plan, start, result, new = _one_step(source, x, y)
    assert {"running_mean", "running_var"} <= set(plan.weight_names)
    mean, var = _torch_running_stats(
        x, start["running_mean"].astype(np.float64), start["running_var"].astype(np.float64), 1 - MOMENTUM
    )
    np.testing.assert_allclose(new["running_mean"], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new["running_var"], var, rtol=1e-5, atol=1e-6)
    # the step's loss was computed with the biased variance (torch's normalization in training mode)
    pred = _torch_forward(x, start["scale"], start["bias"], start["fc"])
    assert result.metrics["loss"] == pytest.approx(float(np.mean((pred - y) ** 2)), rel=1e-4)


def test_batch_norms_of_the_same_positions_share_their_count_and_each_keeps_torchs_running_variance():
    """Two batch norms over activations of the same batch and size read one count of elements per
    channel and one n/(n-1) factor (computed once per graph), and each updates its running
    variance with its own unbiased batch variance."""
    rng = np.random.default_rng(5)
    c, side, batch = 3, 2, 5
    stats = {
        f"{k}{i}": rng.uniform(0.5, 1.5, c).astype(np.float32) for i in (1, 2) for k in ("scale", "bias", "mean", "var")
    }
    fc = rng.standard_normal((c * side * side, 2)).astype(np.float32)
    n = helper.make_node
    source = model(
        [
            n("BatchNormalization", ["x", "scale1", "bias1", "mean1", "var1"], ["h"], epsilon=1e-5, momentum=MOMENTUM),
            n("Relu", ["h"], ["r"]),
            n("BatchNormalization", ["r", "scale2", "bias2", "mean2", "var2"], ["b"], epsilon=1e-5, momentum=MOMENTUM),
            n("Flatten", ["b"], ["flat"]),
            n("MatMul", ["flat", "fc"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", F, ["N", c, side, side])],
        [helper.make_tensor_value_info("y", F, ["N", 2])],
        {**stats, "fc": fc},
    )
    x = (rng.standard_normal((batch, c, side, side)) + 0.4).astype(np.float32)
    plan, start, _, new = _one_step(source, x, rng.standard_normal((batch, 2)).astype(np.float32))
    work = [node.op_type for node in onnx.load_from_string(plan.work).graph.node]
    assert work.count("Size") == 2  # the first norm's input and mean: n, read by both and by both gradients
    assert work.count("Max") == 1
    r = np.maximum(_torch_forward(x, start["scale1"], start["bias1"], np.eye(c * side * side)), 0)
    for i, inp in ((1, x), (2, r.reshape(x.shape).astype(np.float32))):
        mean, var = _torch_running_stats(
            inp, start[f"mean{i}"].astype(np.float64), start[f"var{i}"].astype(np.float64), 1 - MOMENTUM
        )
        np.testing.assert_allclose(new[f"mean{i}"], mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(new[f"var{i}"], var, rtol=1e-5, atol=1e-6)


def test_one_value_per_channel_keeps_the_running_variance_finite():
    # torch refuses such a batch; a device's last batch can be one example of a 1x1 map
    x = np.array([[[[0.5]], [[-1.0]]]], np.float32)
    source = _bn_model(2, 1)
    _, start, _, new = _one_step(source, x, np.zeros((1, 2), np.float32))
    assert np.isfinite(new["running_var"]).all()
    np.testing.assert_allclose(new["running_var"], MOMENTUM * start["running_var"], rtol=1e-6)


@pytest.mark.parametrize(("shape", "seed"), [((4, 3, 5, 5), 0), ((2, 5, 3), 1), ((1, 2, 1, 1, 3), 2)])
def test_batch_norm_gradient_taken_at_once_agrees_with_finite_differences(shape, seed):
    """The rewritten normalization's gradient, taken at its output in closed form (the pattern is
    found: :func:`batch_norms`), against central differences in float64, for x, scale and bias."""
    rng = np.random.default_rng(seed)
    c = shape[1]
    inputs = {
        "x": rng.normal(0.3, 1.5, shape),
        "s": rng.uniform(0.5, 1.5, c),
        "b": rng.normal(0, 0.5, c),
    }
    stats = {"m": np.zeros(c), "v": np.ones(c)}
    forward = training_forward_model(single_op_model("BatchNormalization", inputs, stats, epsilon=1e-5, momentum=0.9))
    assert len(batch_norms(forward.graph.node, _emitter(forward), set())) == 1
    assert vjp_error(forward, inputs, ["x", "s", "b"], eps=1e-6) < 1e-7


def test_a_gain_that_varies_over_the_reduced_axes_is_left_to_the_rules():
    """The same ops with a scale along the normalized axis (a layer norm's, written by hand) are not
    a batch norm: the closed form assumes one gain per reduced slice. Its gradient still agrees."""
    n = helper.make_node
    nodes = [
        n("ReduceMean", ["x"], ["mean"], axes=[2]),
        n("Sub", ["x", "mean"], ["c"]),
        n("Mul", ["c", "c"], ["sq"]),
        n("ReduceMean", ["sq"], ["var"], axes=[2]),
        n("Add", ["var", "eps"], ["shifted"]),
        n("Sqrt", ["shifted"], ["root"]),
        n("Reciprocal", ["root"], ["inv"]),
        n("Mul", ["inv", "s"], ["gain"]),
        n("Mul", ["c", "gain"], ["scaled"]),
        n("Add", ["scaled", "b"], ["y"]),
    ]
    m = model(
        nodes,
        [
            helper.make_tensor_value_info("x", helper.TensorProto.DOUBLE, [2, 3, 4]),
            helper.make_tensor_value_info("s", helper.TensorProto.DOUBLE, [4]),
            helper.make_tensor_value_info("b", helper.TensorProto.DOUBLE, [4]),
        ],
        [helper.make_tensor_value_info("y", helper.TensorProto.DOUBLE, [2, 3, 4])],
        {"eps": np.array(1e-5)},
    )
    assert batch_norms(m.graph.node, _emitter(m), set()) == {}
    rng = np.random.default_rng(3)
    values = {"x": rng.normal(0.2, 1.0, (2, 3, 4)), "s": rng.uniform(0.5, 1.5, 4), "b": rng.normal(0, 0.5, 4)}
    assert vjp_error(m, values, ["x", "s", "b"], eps=1e-6) < 1e-7


def _emitter(m):
    return Emitter(17, tensor_infos(m), constant_values(m.graph), set())


def test_batch_norm_gradient_passes_over_the_activations_at_most_four_times():
    """The backward pass of a training-mode BatchNormalization makes at most four tensors of the
    activations' size (dy times the gain, dy times the centred input, the centred input times its
    per-channel factor, their sum with the mean's per-channel term): its gradient is taken at once."""
    shape = [4, 3, 5, 5]
    ones = {name: np.ones(3, np.float32) for name in ("s", "b", "m", "v")}
    source = model(
        [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], epsilon=1e-5)],
        [helper.make_tensor_value_info("x", F, shape)],
        [helper.make_tensor_value_info("y", F, shape)],
        ones,
    )
    forward = training_forward_model(source)
    grad = vjp_model(forward, outputs=["y"], wrt=["x", "s", "b"])
    infos = tensor_infos(grad)
    live = needed_for(grad.graph.node, [o.name for o in grad.graph.output])
    made = {o for n in forward.graph.node for o in n.output}
    full = [
        n.op_type
        for n in grad.graph.node
        if n.op_type != "Identity"
        and n.output[0] in live
        and n.output[0] not in made
        and infos[n.output[0]].shape == tuple(shape)
    ]
    assert len(full) <= 4, full
