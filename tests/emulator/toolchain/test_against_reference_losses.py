"""The built-in losses against the definitions other systems train with: torch's
``BCEWithLogitsLoss`` / ``BCELoss`` (reduction ``mean``) and Keras' ``binary_crossentropy`` take the
mean over every label of the batch, so an example with k independent labels weighs the mean of its
k losses, as ``mse`` already weighs the mean of an example's outputs."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from device_runtime import PlanExecutor
from emulator.toolchain import SGD, initial_weights_from_onnx, training_plan_from_onnx
from example_store import ExampleSelector
from tests.emulator.toolchain.models import F, model

LR = 0.5


def _case():
    """Five examples of four features and three 0/1 labels, and a linear layer (seeded)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    y = rng.integers(0, 2, (5, 3)).astype(np.float32)
    w = (rng.standard_normal((4, 3)) * 0.5).astype(np.float32)
    b = (rng.standard_normal(3) * 0.1).astype(np.float32)
    return x, y, w, b


def _sigmoid_model(w, b, written_out: bool):
    """Gemm then a Sigmoid node (the loss reads its logits), or the same sigmoid written as
    1 / (1 + exp(-z)) (the loss reads the output as probabilities)."""
    head = (
        [
            helper.make_node("Neg", ["z"], ["nz"]),
            helper.make_node("Exp", ["nz"], ["e"]),
            helper.make_node("Add", ["e", "one"], ["d"]),
            helper.make_node("Reciprocal", ["d"], ["p"]),
        ]
        if written_out
        else [helper.make_node("Sigmoid", ["z"], ["p"])]
    )
    inits = {"w": w, "b": b, **({"one": np.array(1, np.float32)} if written_out else {})}
    return model(
        [helper.make_node("Gemm", ["x", "w", "b"], ["z"]), *head],
        [helper.make_tensor_value_info("x", F, ["N", 4])],
        [helper.make_tensor_value_info("p", F, ["N", 3])],
        inits,
    )


@pytest.mark.parametrize("written_out", [False, True], ids=["sigmoid_logits", "probabilities"])
def test_binary_cross_entropy_over_several_labels_is_torchs_mean_over_every_label(written_out):
    x, y, w, b = _case()
    source = _sigmoid_model(w, b, written_out)
    plan = training_plan_from_onnx(
        source,
        label="y",
        loss="binary_cross_entropy",
        optimizer=SGD(LR),
        batch_size=len(x),
        example_selector=ExampleSelector("app:/bce"),
    )
    weights = initial_weights_from_onnx(source, plan)
    executor = PlanExecutor(plan)
    result = executor.run_device(weights, lambda: [{"x": x, "y": y}])
    new = executor.final_weights(weights, result)
    grad_b = (weights["b"] - new["b"]) / LR
    grad_w = (weights["w"] - new["w"]) / LR

    # the reference written out: L = mean over all N*k labels of softplus(z) - z*y, dL/dz = (sigmoid(z) - y) / (N*k)
    z = x.astype(np.float64) @ w + b
    per_label = np.logaddexp(0.0, z) - z * y
    mean = per_label.mean()
    dz = (1 / (1 + np.exp(-z)) - y) / y.size
    np.testing.assert_allclose(grad_b, dz.sum(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grad_w, x.T.astype(np.float64) @ dz, rtol=1e-4, atol=1e-6)
    assert result.metrics["loss"] == pytest.approx(mean, rel=1e-5)
    assert result.metrics["loss_sum"] == pytest.approx(len(x) * mean, rel=1e-5)

    # recorded from torch 2.13 (float64) on the same arrays: BCEWithLogitsLoss()(x @ w + b, y), and
    # BCELoss()(sigmoid(x @ w + b), y), both of the default reduction "mean": loss, then b's gradient
    assert result.metrics["loss"] == pytest.approx(0.731128659127234, rel=1e-5)
    np.testing.assert_allclose(grad_b, [0.040071084709866284, -0.015778156659424093, 0.08224792413954168], atol=2e-6)
