"""Evaluation plans for any model: the exported forward pass (running statistics, no dropout), the
loss's sums averaged by the server, the model left as it is; paired with a training task's weights."""

from __future__ import annotations

import numpy as np
import pytest

from device_runtime import PlanExecutor, load_plan, serialize_plan
from emulator.toolchain import Adam, evaluation_plan_from_onnx, initial_weights_from_onnx, training_plan_from_onnx
from example_store import ExampleSelector
from tests.emulator.toolchain.models import cnn

SELECTOR = ExampleSelector("app:/digits")


def _reference_logits(source, x, w):
    """The exported CNN in inference mode, in numpy (running statistics, dropout off)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(source.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["logits"], {"x": x})[0]


def test_evaluation_plan_reports_the_inference_models_loss_and_accuracy(digits):
    source = cnn(seed=1, dropout=0.5)
    x, y = digits.x_test.reshape(-1, 1, 8, 8).astype(np.float32), digits.y_test
    plan = load_plan(
        serialize_plan(
            evaluation_plan_from_onnx(source, label="y", loss="cross_entropy", batch_size=32, example_selector=SELECTOR)
        )
    )
    assert plan.kind == "eval" and {"bn_mean", "bn_var", "conv1_w"} <= set(plan.weight_names)
    weights = initial_weights_from_onnx(source, plan)
    executor = PlanExecutor(plan)
    result = executor.run_device(
        weights, lambda: [{"x": x[i : i + 32], "y": y[i : i + 32]} for i in range(0, len(y), 32)]
    )
    logits = _reference_logits(source, x, weights).astype(np.float64)
    logp = logits - logits.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    assert result.metrics["loss"] == pytest.approx(-logp[np.arange(len(y)), y].mean(), rel=1e-5)
    assert result.metrics["accuracy"] == pytest.approx(float(np.mean(logits.argmax(1) == y)))
    acc = executor.accumulate(executor.zero(), result.update)
    state, metrics = executor.update(weights, executor.report(acc))
    assert metrics["eval_loss"] == pytest.approx(result.metrics["loss"], rel=1e-5)
    assert all(np.array_equal(state[w], weights[w]) for w in plan.weight_names)


def test_an_evaluation_plan_takes_its_training_plans_weights():
    source = cnn(seed=2)
    train = training_plan_from_onnx(
        source, label="y", loss="cross_entropy", optimizer=Adam(0.01), batch_size=8, example_selector=SELECTOR
    )
    evaluation = evaluation_plan_from_onnx(
        source, label="y", loss="cross_entropy", batch_size=8, training_plan=train, example_selector=SELECTOR
    )
    assert PlanExecutor(evaluation).weight_spec() == PlanExecutor(train).weight_spec()
    PlanExecutor(evaluation).smoke_test(initial_weights_from_onnx(source, train))


def _as_exported_in_train_mode(source):
    """The CNN as a train-mode export writes it (what keeps BatchNorm and Dropout at all): Dropout
    reads training_mode=True, BatchNorm has training_mode=1 and its running statistics as outputs."""
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(source)
    m.graph.initializer.append(numpy_helper.from_array(np.array(True), "training"))
    for node in m.graph.node:
        if node.op_type == "Dropout":
            node.input.append("training")
        if node.op_type == "BatchNormalization":
            node.attribute.append(helper.make_attribute("training_mode", 1))
            node.output.extend(["bn_mean_out", "bn_var_out"])
    onnx.checker.check_model(m)
    return m


def test_a_train_mode_export_is_evaluated_as_the_inference_model(digits):
    source = cnn(seed=1, dropout=0.5)
    x, y = digits.x_test[:96].reshape(-1, 1, 8, 8).astype(np.float32), digits.y_test[:96]

    def metrics(model):
        plan = evaluation_plan_from_onnx(
            model, label="y", loss="cross_entropy", batch_size=32, example_selector=SELECTOR
        )
        executor = PlanExecutor(plan)
        weights = initial_weights_from_onnx(model, plan)
        return executor.run_device(
            weights, lambda: [{"x": x[i : i + 32], "y": y[i : i + 32]} for i in range(0, 96, 32)]
        ).metrics

    # no masks, no batch statistics
    assert metrics(_as_exported_in_train_mode(source)) == pytest.approx(metrics(source), rel=1e-6)
