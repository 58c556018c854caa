"""A trained checkpoint back into a from-onnx bundle's ONNX model: onnxruntime runs the exported
model to the outputs the plan's forward pass computes from the same weights, every split copy with
its own trained value, frozen and untrained initializers as they were."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from device_runtime import PlanExecutor, decode_checkpoint, load_plan
from emulator.toolchain.model_bundle import bundle_from_onnx
from emulator.toolchain.tasks import TaskError
from emulator.toolchain.trained_model import trained_onnx, write_trained_onnx


def mlp_with_a_merged_bias() -> bytes:
    """An MLP over 8x8 digits as torch's classic exporter writes one whose two zero biases it
    merged: the second layer reads the first's through an ``Identity``; a one-element ``scale``
    that does not train by default."""
    rng = np.random.default_rng(0)

    def init(name: str, value) -> onnx.TensorProto:
        return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)

    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "zeros"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("Mul", ["h2", "scale"], ["h3"]),
        helper.make_node("Identity", ["zeros"], ["b2"]),
        helper.make_node("MatMul", ["h3", "w2"], ["h4"]),
        helper.make_node("Add", ["h4", "b2"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        initializer=[
            init("w1", 0.1 * rng.standard_normal((64, 10))),
            init("zeros", np.zeros(10)),
            init("scale", [1.0]),
            init("w2", 0.1 * rng.standard_normal((10, 10))),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return model.SerializeToString()


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """A from-onnx bundle of the MLP trained with momentum (its checkpoint carries the optimizer's state)."""
    folder = tmp_path_factory.mktemp("trained")
    (folder / "mlp.onnx").write_bytes(mlp_with_a_merged_bias())
    bundle_from_onnx(folder / "mlp.onnx", folder / "bundle", label="y", optimizer="momentum", runtimes=["1.31.1"])
    return folder / "bundle"


def trained(bundle: Path, digits, steps: int = 2) -> dict[str, np.ndarray]:
    """The bundle's initial model after ``steps`` passes of its plan over some digits."""
    plan = load_plan((bundle / "mlp" / "plan.fedplan").read_bytes())
    weights = decode_checkpoint((bundle / "mlp" / "initial.ckpt").read_bytes())
    executor = PlanExecutor(plan)
    batches = [{"x": digits.x_train[i : i + 32], "y": digits.y_train[i : i + 32]} for i in range(0, 256, 32)]
    for _ in range(steps):
        weights = executor.final_weights(weights, executor.run_device(weights, lambda: iter(batches)))
    return weights


def test_onnxruntime_runs_the_exported_model_to_the_plans_evaluation_of_the_same_weights(bundle, digits, tmp_path):
    weights = trained(bundle, digits)
    assert not np.allclose(weights["zeros"], weights["b2"])  # the merged pair trained apart
    made = write_trained_onnx(bundle, weights, tmp_path / "trained.onnx")
    assert made.task == "mlp" and made.split == {"b2": "zeros"}
    assert sorted(made.trained) == ["b2", "w1", "w2", "zeros"] and made.unchanged == 1

    model = onnx.load(str(tmp_path / "trained.onnx"))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for name in made.trained:
        np.testing.assert_array_equal(inits[name], weights[name])
    assert inits["scale"].tolist() == [1.0]  # untrained: as the model had it
    assert [o.name for o in model.graph.output] == ["logits"] and [i.name for i in model.graph.input] == ["x"]

    x, y = digits.x_test, digits.y_test
    (logits,) = ort.InferenceSession(str(tmp_path / "trained.onnx")).run(["logits"], {"x": x})
    shifted = logits - logits.max(axis=1, keepdims=True)
    loss = float(np.mean(np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(len(y)), y]))
    plan = load_plan((bundle / "mlp" / "plan.fedplan").read_bytes())
    evaluated = PlanExecutor(plan).evaluate(
        weights, [{"x": x[i : i + 64], "y": y[i : i + 64]} for i in range(0, len(y), 64)]
    )
    assert float(np.mean(logits.argmax(axis=1) == y)) == pytest.approx(evaluated["eval_accuracy"], abs=1e-12)
    assert loss == pytest.approx(evaluated["eval_loss"], rel=1e-5)
    initial = decode_checkpoint((bundle / "mlp" / "initial.ckpt").read_bytes())
    assert evaluated["eval_loss"] < PlanExecutor(plan).evaluate(initial, [{"x": x, "y": y}])["eval_loss"]


def test_a_checkpoint_of_another_model_is_refused_naming_what_it_lacks(bundle, digits):
    weights = trained(bundle, digits, steps=1)
    with pytest.raises(TaskError, match=r"does not fit task mlp of .*: it lacks w2; give the bundle"):
        trained_onnx(bundle, {k: v for k, v in weights.items() if k != "w2"})
    weights["w1"] = weights["w1"][:3]
    with pytest.raises(TaskError, match=r"it has w1 \(3, 10\) of another shape"):
        trained_onnx(bundle, weights)


def test_a_bundle_without_its_model_says_which_bundles_keep_one(tmp_path):
    with pytest.raises(TaskError, match="has no model.onnx: --onnx takes a bundle folder `plan from-onnx`"):
        trained_onnx(tmp_path, {})
