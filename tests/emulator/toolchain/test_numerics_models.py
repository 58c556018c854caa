"""Models of other number types than float32 weights: float16, bfloat16 and float64 weights and
quantized models are refused in one line that says what to export; integer and other float inputs
train as the model types them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from device_runtime import PlanExecutor
from emulator.cli.commands import main
from emulator.toolchain import SGD, initial_weights_from_onnx, training_plan_from_onnx
from example_store import ExampleSelector
from tests.emulator.toolchain.models import mlp

SELECTOR = ExampleSelector("app:/numbers")


def _plan(model: onnx.ModelProto, **options):
    return training_plan_from_onnx(
        model,
        label="y",
        loss="cross_entropy",
        optimizer=SGD(0.1),
        batch_size=4,
        epochs=1,
        example_selector=SELECTOR,
        **options,
    )


def _of_type(model: onnx.ModelProto, elem_type: int) -> onnx.ModelProto:
    """``model`` with its weights, input and output of ``elem_type`` (a ``model.half()`` export's)."""
    for init in model.graph.initializer:
        values = numpy_helper.to_array(init).astype(np.float32)
        init.CopyFrom(helper.make_tensor(init.name, elem_type, values.shape, values.ravel().tolist()))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.elem_type = elem_type
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize(
    "elem_type, says",
    [(TensorProto.FLOAT16, "float16"), (TensorProto.BFLOAT16, "bfloat16"), (TensorProto.DOUBLE, "float64")],
)
def test_a_model_whose_weights_are_another_float_type_is_refused_naming_it_and_the_float32_export(elem_type, says):
    with pytest.raises(ValueError, match=rf"weights are {says} \(w0, b0, w1, b1\).*model\.float\(\)") as refused:
        _plan(_of_type(mlp(4, 5, 3), elem_type))
    assert "\n" not in str(refused.value)


def _quantized(*, weight: str, input_rounded: bool = False, masked: bool = False) -> onnx.ModelProto:
    """x [N, 4] -> MatMul(w1) -> Relu -> MatMul(w2) -> logits [N, 3], where ``weight`` says what
    the first layer's weight is: ``int8`` (a DequantizeLinear of int8 values, QDQ's weights),
    ``fake`` (a float32 weight through QuantizeLinear and DequantizeLinear, a QAT export) or
    ``float``; ``input_rounded`` rounds the features to uint8 and back before the first layer,
    ``masked`` first multiplies them by an int64 mask cast to float."""
    rng = np.random.default_rng(0)
    w1 = rng.normal(size=(4, 5)).astype(np.float32)
    inits = {
        "w2": rng.normal(size=(5, 3)).astype(np.float32),
        "scale": np.array(0.01, np.float32),
        "zero": np.array(0, np.int8),
        "x_scale": np.array(0.05, np.float32),
        "x_zero": np.array(128, np.uint8),
    }
    nodes = []
    x = "x"
    if masked:
        inits["mask"] = np.array([1, 0, 1, 1], np.int64)
        nodes += [
            helper.make_node("Cast", ["mask"], ["mask_f"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["x", "mask_f"], ["x_m"]),
        ]
        x = "x_m"
    if input_rounded:
        nodes += [
            helper.make_node("QuantizeLinear", [x, "x_scale", "x_zero"], ["x_q"], name="x_q"),
            helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_d"], name="x_d"),
        ]
        x = "x_d"
    if weight == "int8":
        inits["w1_q"] = np.round(w1 / 0.01).astype(np.int8)
        nodes.append(helper.make_node("DequantizeLinear", ["w1_q", "scale", "zero"], ["w1"], name="w1_dequantized"))
    elif weight == "fake":
        inits["w1_float"] = w1
        nodes += [
            helper.make_node("QuantizeLinear", ["w1_float", "scale", "zero"], ["w1_q"], name="w1_rounded"),
            helper.make_node("DequantizeLinear", ["w1_q", "scale", "zero"], ["w1"], name="w1_dequantized"),
        ]
    else:
        inits["w1"] = w1
    nodes += [
        helper.make_node("MatMul", [x, "w1"], ["h"]),
        helper.make_node("Relu", ["h"], ["a"]),
        helper.make_node("MatMul", ["a", "w2"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "quantized",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize(
    "weight, says",
    [
        ("int8", "DequantizeLinear node 'w1_dequantized' reads the weight 'w1_q'"),
        ("fake", "QuantizeLinear node 'w1_rounded' reads the weight 'w1_float'"),
    ],
)
def test_a_quantized_model_is_refused_naming_the_node_that_rounds_a_weight_unless_told_what_trains(weight, says):
    """Its head alone would train without a word (int8 weights), or nothing would with a message
    about ArgMax (a QAT export's fake-quantized float weights)."""
    with pytest.raises(ValueError, match=rf"the model is quantized: its {says}.*export the float model") as refused:
        _plan(_quantized(weight=weight))
    assert "\n" not in str(refused.value)
    assert _plan(_quantized(weight=weight), trainable=["w2"]).weight_names == ("w2",)


@pytest.mark.parametrize("masked", [False, True])
def test_a_model_that_rounds_its_features_alone_trains_every_weight(masked):
    """Masked by an int64 constant first, the features were taken for a weight the rounding reads."""
    plan = _plan(_quantized(weight="float", input_rounded=True, masked=masked))
    assert sorted(plan.weight_names) == ["w1", "w2"]


def test_from_onnx_refuses_a_quantized_model_in_one_line(tmp_path, capsys):
    path = tmp_path / "quantized.onnx"
    onnx.save(_quantized(weight="int8"), str(path))
    assert main(["plan", "from-onnx", str(path), "--label", "y", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "the model is quantized" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "feature_type",
    [TensorProto.UINT8, TensorProto.INT8, TensorProto.FLOAT16, TensorProto.DOUBLE],
    ids=["uint8", "int8", "float16", "float64"],
)
def test_a_feature_the_model_casts_to_float_trains_as_the_float_values_would(feature_type):
    """A uint8 image, an int8 feature, float16 or float64 features: the plan feeds them as the model
    types them, and the step is the one float32 features of the same values take."""
    plain = mlp(4, 5, 3)
    cast = mlp(4, 5, 3)
    cast.graph.input[0].type.tensor_type.elem_type = feature_type
    cast.graph.node.insert(0, helper.make_node("Cast", ["x"], ["x_float"], to=TensorProto.FLOAT))
    cast.graph.node[1].input[0] = "x_float"
    onnx.checker.check_model(cast)
    x = np.arange(-12, 12, dtype=np.float32).reshape(6, 4) * 5 + (0 if feature_type == TensorProto.INT8 else 60)
    y = np.arange(6) % 3
    updates = []
    for model, features in ((plain, x), (cast, x.astype(helper.tensor_dtype_to_np_dtype(feature_type)))):
        plan = _plan(model)
        executor = PlanExecutor(plan)
        result = executor.run_device(
            initial_weights_from_onnx(model, plan),
            lambda f=features: [{"x": f[:4], "y": y[:4]}, {"x": f[4:], "y": y[4:]}],
        )
        updates.append(result.update)
    for name in updates[0]:
        np.testing.assert_allclose(updates[1][name], updates[0][name], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize(
    "prediction_type, tolerance",
    [(TensorProto.DOUBLE, 1e-6), (TensorProto.FLOAT16, 2e-3)],
    ids=["float64", "float16"],
)
def test_a_float32_model_whose_prediction_is_cast_to_another_float_trains_and_evaluates_as_float32(
    prediction_type, tolerance, loss
):
    """The loss read through a Cast to float32: computed in the prediction's type, it gave metrics
    that onnxruntime refused to load as the plan's float32 outputs (a work graph that did not load)."""
    from emulator.toolchain import evaluation_plan_from_onnx

    plain = mlp(4, 5, 3)
    cast = mlp(4, 5, 3)
    cast.graph.node.append(helper.make_node("Cast", ["logits"], ["prediction"], to=prediction_type))
    cast.graph.output[0].name = "prediction"
    cast.graph.output[0].type.tensor_type.elem_type = prediction_type
    onnx.checker.check_model(cast)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    y = np.arange(8) % 3 if loss == "cross_entropy" else rng.normal(size=(8, 3)).astype(np.float32)
    results = []
    for model in (plain, cast):
        plan = training_plan_from_onnx(
            model, label="y", loss=loss, optimizer=SGD(0.1), batch_size=4, epochs=1, example_selector=SELECTOR
        )
        weights = initial_weights_from_onnx(model, plan)
        trained = PlanExecutor(plan).run_device(weights, lambda: [{"x": x[:4], "y": y[:4]}, {"x": x[4:], "y": y[4:]}])
        evaluation = evaluation_plan_from_onnx(
            model, label="y", loss=loss, batch_size=8, example_selector=SELECTOR, training_plan=plan
        )
        results.append((trained.update, PlanExecutor(evaluation).evaluate(weights, [{"x": x, "y": y}])))
    (want, want_eval), (got, got_eval) = results
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=tolerance, atol=tolerance)
    assert got_eval == pytest.approx(want_eval, rel=tolerance, abs=tolerance)


def test_a_softmax_cast_to_float64_trains_as_the_softmax_and_is_refused_as_binary_labels():
    """A last Cast after a Softmax was read through a second Cast to float32, past which the loss
    saw no Softmax: cross_entropy took the probabilities for logits (a loss of 1.23 where the model's
    is 1.76), and binary_cross_entropy trained the Softmax's columns as independent labels."""
    plain = mlp(4, 5, 3, softmax=True)
    cast = mlp(4, 5, 3, softmax=True)
    cast.graph.node.append(helper.make_node("Cast", ["probs"], ["prediction"], to=TensorProto.DOUBLE))
    cast.graph.output[0].name = "prediction"
    cast.graph.output[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 4)).astype(np.float32), np.arange(8) % 3
    results = []
    for model in (plain, cast):
        plan = training_plan_from_onnx(
            model, label="y", loss="cross_entropy", optimizer=SGD(0.1), batch_size=8, example_selector=SELECTOR
        )
        results.append(
            PlanExecutor(plan).run_device(initial_weights_from_onnx(model, plan), lambda: [{"x": x, "y": y}])
        )
    assert results[1].metrics["loss"] == pytest.approx(results[0].metrics["loss"], rel=1e-6)
    for name in ("w0", "w1"):
        np.testing.assert_allclose(results[1].update[name], results[0].update[name], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="binary_cross_entropy reads every column .* but it is a Softmax"):
        training_plan_from_onnx(
            cast, label="y", loss="binary_cross_entropy", optimizer=SGD(0.1), batch_size=8, example_selector=SELECTOR
        )
