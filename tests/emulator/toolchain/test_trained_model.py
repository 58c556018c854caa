"""A trained checkpoint back into a from-onnx bundle's ONNX model: onnxruntime runs the exported
model to the outputs the plan's forward pass computes from the same weights, every split copy with
its own trained value, frozen and untrained initializers as they were."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from device_runtime import PlanExecutor, decode_checkpoint, load_plan
from emulator.toolchain.evaluation import evaluation_plan_from_onnx
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


def test_a_bundle_whose_model_was_replaced_damaged_or_lost_its_data_is_refused_in_one_line(bundle, tmp_path):
    """A model.onnx whose w1 is (10, 64) where the plan's is (64, 10) had the trained w1 reshaped into
    it, a model that ran to other outputs; one that is not ONNX, or whose data file is gone, raised
    protobuf's DecodeError and onnx's ValidationError."""
    weights = decode_checkpoint((bundle / "mlp" / "initial.ckpt").read_bytes())
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    model = onnx.load(str(copy / "model.onnx"))
    (w1,) = [i for i in model.graph.initializer if i.name == "w1"]
    w1.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(w1).T), "w1"))
    onnx.save_model(model, str(copy / "model.onnx"))
    with pytest.raises(TaskError, match=r"model.onnx's initializer w1 is \(10, 64\), the trained one \(64, 10\)"):
        trained_onnx(copy, weights)
    onnx.save_model(model, str(copy / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    (copy / "model.onnx.data").unlink()
    with pytest.raises(TaskError, match=r"model.onnx does not read as an ONNX model \(Data of TensorProto"):
        trained_onnx(copy, weights)
    (copy / "model.onnx").write_bytes(b"not an ONNX model")
    with pytest.raises(TaskError, match=r"model.onnx does not read as an ONNX model \(Error parsing"):
        trained_onnx(copy, weights)
    with pytest.raises(TaskError, match="it has w1 of float64, where the plan trains another type"):
        trained_onnx(bundle, {**weights, "w1": weights["w1"].astype(np.float64)})


def test_a_train_mode_exports_batchnorm_and_dropout_run_as_its_evaluation_plan_evaluates(tmp_path, digits):
    """A model exported in train mode (BatchNormalization with training_mode=1 and its statistics as
    outputs, Dropout with training_mode=True): the trained ONNX model runs as the evaluation plan of
    the same weights does, with the running statistics the plan trained and no dropout, the same
    outputs on every run. (A training plan's forward pass normalizes by each batch's statistics.)"""
    rng = np.random.default_rng(0)
    w = 0.1 * rng.standard_normal((64, 16)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h0"]),
        helper.make_node(
            "BatchNormalization", ["h0", "gamma", "beta", "mean", "var"], ["h1", "mean_out", "var_out"], training_mode=1
        ),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("Dropout", ["h2", "ratio", "train"], ["h3"]),
        helper.make_node("MatMul", ["h3", "w2"], ["logits"]),
    ]
    values = {"w": w, "gamma": np.ones(16), "beta": np.zeros(16), "mean": np.zeros(16), "var": np.ones(16)}
    values.update({"ratio": np.asarray(0.3), "w2": 0.1 * rng.standard_normal((16, 10))})
    inits = [numpy_helper.from_array(np.asarray(v, dtype=np.float32), k) for k, v in values.items()]
    graph = helper.make_graph(
        nodes,
        "bn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        initializer=[*inits, numpy_helper.from_array(np.array(True), "train")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    (tmp_path / "mlp.onnx").write_bytes(model.SerializeToString())
    bundle_from_onnx(tmp_path / "mlp.onnx", tmp_path / "bundle", label="y", runtimes=["1.31.1"])
    weights = trained(tmp_path / "bundle", digits, steps=1)
    assert not np.allclose(weights["mean"], 0.0)  # the running statistics moved in training
    write_trained_onnx(tmp_path / "bundle", weights, tmp_path / "trained.onnx")

    x, y = digits.x_test, digits.y_test
    session = ort.InferenceSession(str(tmp_path / "trained.onnx"))
    (logits,), (again,) = session.run(["logits"], {"x": x}), session.run(["logits"], {"x": x})
    np.testing.assert_array_equal(logits, again)
    shifted = logits - logits.max(axis=1, keepdims=True)
    loss = float(np.mean(np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(len(y)), y]))
    plan = load_plan((tmp_path / "bundle" / "mlp" / "plan.fedplan").read_bytes())
    evaluation = evaluation_plan_from_onnx(
        tmp_path / "mlp.onnx", label="y", loss="cross_entropy", example_selector=None, batch_size=64, training_plan=plan
    )
    evaluated = PlanExecutor(evaluation).evaluate(
        weights, [{"x": x[i : i + 64], "y": y[i : i + 64]} for i in range(0, len(y), 64)]
    )
    assert float(np.mean(logits.argmax(axis=1) == y)) == pytest.approx(evaluated["eval_accuracy"], abs=1e-12)
    assert loss == pytest.approx(evaluated["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("family, exporter", [("gru_tied", "classic"), ("gpt_sdpa", "dynamo")])
def test_a_tied_embedding_and_output_layer_is_exported_as_the_one_weight_the_plan_trained(family, exporter, tmp_path):
    """A next-token model whose output layer is its embedding (``head.weight is wte.weight``), as
    torch's exporters wrote it (the dynamo exporter folds the output layer's transpose of the
    tied weight into a constant of its own): the plan trains the pair as one weight, and the
    exported model reads that trained weight in both places (onnxruntime's outputs give the
    evaluation plan's loss)."""
    from tests.emulator.toolchain.test_exported_models import reference, unpacked

    ref = reference(f"{family}.perturbed.npz")
    shutil.copy(unpacked(f"{family}.perturbed.{exporter}.onnx.gz"), tmp_path / "lm.onnx")
    bundle_from_onnx(tmp_path / "lm.onnx", tmp_path / "bundle", label="y", batch_size=4, lr=1.0, runtimes=["1.31.1"])
    plan = load_plan((tmp_path / "bundle" / "lm" / "plan.fedplan").read_bytes())
    initial = decode_checkpoint((tmp_path / "bundle" / "lm" / "initial.ckpt").read_bytes())
    tied = [name for name in plan.weight_names if initial[name].shape in ((200, 16), (16, 200))]
    assert len(tied) == 1, tied  # one weight stands for the embedding and the output layer

    rng = np.random.default_rng(1)
    tokens, y = ref.examples["tokens"], ref.examples["y"]
    batches = [{"tokens": rng.integers(0, 200, tokens.shape), "y": rng.integers(0, 200, y.shape)} for _ in range(4)]
    executor = PlanExecutor(plan)
    weights = executor.final_weights(initial, executor.run_device(initial, lambda: iter(batches)))
    assert not np.allclose(weights[tied[0]], initial[tied[0]])
    write_trained_onnx(tmp_path / "bundle", weights, tmp_path / "trained.onnx")

    (logits,) = ort.InferenceSession(str(tmp_path / "trained.onnx")).run(["logits"], {"tokens": tokens})
    logits, labels = logits.reshape(-1, 200), y.reshape(-1)
    shifted = logits - logits.max(axis=1, keepdims=True)
    loss = float(np.mean(np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(len(labels)), labels]))
    evaluation = evaluation_plan_from_onnx(
        tmp_path / "lm.onnx", label="y", loss="cross_entropy", example_selector=None, batch_size=4, training_plan=plan
    )
    evaluated = PlanExecutor(evaluation).evaluate(weights, [{"tokens": tokens, "y": y}])
    assert loss == pytest.approx(evaluated["eval_loss"], rel=1e-5)
    before = PlanExecutor(evaluation).evaluate(initial, [{"tokens": tokens, "y": y}])
    assert evaluated["eval_loss"] != pytest.approx(before["eval_loss"], rel=1e-3)  # the trained weights are what ran
