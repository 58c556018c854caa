"""Models below opset 13 train as they computed: torch's classic exporter at opsets 9-12 (the files
in ``exported/old_opsets/``, made by ``benchmarks/old_opset_fixtures.py``, with torch's own step
beside them) and the ONNX Model Zoo's older files at opsets 6-12 (``old_models``: CNTK's MNIST-8,
SqueezeNet, MXNet's ResNet and the ops Caffe2's files write with attributes).

A torch export's step is held to torch autograd's; a hand-built model's to the step of the same
network written at opset 17 by hand, and its loss to onnxruntime's on the original file at its
own opset. Nothing here imports torch."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from device_runtime import PlanExecutor
from device_runtime.executor import make_session
from device_runtime.plan import PlanError
from emulator.toolchain import SGD, evaluation_plan_from_onnx, initial_weights_from_onnx, training_plan_from_onnx
from emulator.toolchain.tasks import Task, onnx_import
from example_store import ExampleSelector
from tests.emulator.toolchain import old_models

FIXTURES = Path(__file__).with_name("exported") / "old_opsets"
LR = 1.0
#: The step's error relative to the largest change torch made to the tensor, at least a thousandth
#: of the largest change it made to any tensor (a bias before a BatchNorm barely moves).
TOLERANCE = 2e-4


def task_for(path: Path, opset: int = 21) -> Task:
    """The task ``fedfleet plan from-onnx MODEL --label y --lr 1 --batch-size 4`` builds (opset 21)."""
    return Task(
        name=path.name.replace(".", "_"),
        model=path,
        proxy=lambda: None,  # type: ignore[arg-type, return-value]
        hyperparameters={"lr": LR},
        label="y",
        batch_size=4,
        selector=ExampleSelector("app:/old"),
        opset=opset,
    )


def step(plan, before: dict[str, np.ndarray], examples: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
    """One step of ``plan``'s work graph in onnxruntime: the batch's mean loss and every weight after it."""
    feeds = {**before, **{graph_input: examples[name] for graph_input, name in plan.device.inputs.items()}}
    session = make_session(plan.work)
    values = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    return float(values["loss_sum"] / values["count"]), {
        w: values[out] for w, out in zip(plan.weight_names, plan.weight_outputs)
    }


def worst_difference(
    ours: dict[str, np.ndarray], reference: dict[str, np.ndarray], before: dict[str, np.ndarray]
) -> tuple[str, float]:
    """The tensor whose new value is farthest from the reference's, relative to the reference's change."""
    changes = {n: float(np.abs(reference[n].astype(np.float64) - before[n]).max()) for n in reference}
    floor = 1e-3 * max(changes.values())
    differences = {
        n: float(np.abs(ours[n].astype(np.float64) - reference[n]).max()) / max(changes[n], floor, 1e-30)
        for n in reference
    }
    worst = max(differences, key=differences.__getitem__)
    return worst, differences[worst]


@cache
def reference(module: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / f"{module}.npz"))


def examples_of(module: str) -> dict[str, np.ndarray]:
    data = reference(module)
    return {"x": data["x"], "y": data["y"]}


@pytest.mark.parametrize(
    "name",
    [
        "cnn.opset9.preserve",
        "cnn.opset12.preserve",
        "resblock.opset9.preserve",
        "resblock.opset11.preserve",
        "lstm.opset9.preserve",
        "mlp.opset10.preserve",
        "viewcnn.opset9.preserve.static",
    ],
)
def test_a_classic_export_below_opset_13_takes_torchs_step_for_every_parameter_and_statistic(name):
    """As ``fedfleet plan from-onnx`` builds it (opset 21): BatchNorm's five training outputs of
    opsets 9-12, Dropout's ratio attribute, the LSTM and ``log_softmax`` of torch's classic exporter
    at those opsets; the loss and every parameter and running statistic as torch's float64 step."""
    module = name.split(".")[0]
    task = task_for(FIXTURES / f"{name}.onnx")
    plan = onnx_import(task._model_source(), task).plan
    before = task.weights(plan)
    loss, after = step(plan, before, examples_of(module))
    data = reference(module)
    assert loss == pytest.approx(float(data["loss"]), rel=1e-5)
    torch_after = {n.removeprefix("after/"): v for n, v in data.items() if n.startswith("after/")}
    assert set(after) == set(torch_after)
    worst, difference = worst_difference(after, torch_after, before)
    assert difference <= TOLERANCE, f"{worst}: {difference:.3g} of torch's change"


@pytest.mark.parametrize("name", ["viewcnn.opset9.preserve.static", "viewcnn.opset11.eval.static"])
def test_an_export_without_a_dynamic_batch_axis_takes_a_short_last_batch(name):
    """Exported without ``dynamic_axes``, ``x.view(x.size(0), -1)`` reshapes to the traced batch of
    four (a Constant, or Constant nodes concatenated): the plan takes a batch of three, with torch's
    loss for those three (train mode), or the file's own for them (eval mode)."""
    path = FIXTURES / f"{name}.onnx"
    task = task_for(path)
    plan = onnx_import(task._model_source(), task).plan
    examples = examples_of("viewcnn")
    loss, _ = step(plan, task.weights(plan), {k: v[:3] for k, v in examples.items()})
    if "preserve" in name:
        expected = float(reference("viewcnn")["loss3"])
    else:
        probabilities = make_session(path.read_bytes()).run(None, {"x": examples["x"]})[0][:3]
        expected = float(-np.log(probabilities[np.arange(3), examples["y"][:3]].astype(np.float64)).mean())
    assert loss == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("module, opset", [("cnn", 10), ("lstm", 12)])
def test_an_eval_mode_classic_export_below_opset_13_trains_as_its_opset_17_export(module, opset):
    """BatchNorm folded into the convolutions (torch's default): the plan trains what the file
    computes, as the same module exported at opset 17 does (its folded weights by position)."""
    examples = examples_of(module)
    steps = []
    for version in (opset, 17):
        path = FIXTURES / f"{module}.opset{version}.eval.onnx"
        plan = training_plan_from_onnx(
            path,
            label="y",
            loss="cross_entropy",
            optimizer=SGD(LR),
            batch_size=4,
            example_selector=ExampleSelector("app:/old"),
        )
        before = initial_weights_from_onnx(path, plan)
        steps.append((before, *step(plan, before, examples)))
    (old_before, old_loss, old_after), (before, loss, after) = steps
    assert old_loss == pytest.approx(loss, rel=1e-6)
    assert len(old_after) == len(after)
    renamed = dict(zip(after, old_after.values()))
    assert all(np.array_equal(a, b) for a, b in zip(old_before.values(), before.values()))
    worst, difference = worst_difference(renamed, after, before)
    assert difference <= TOLERANCE, worst


def _zoo_examples(model: onnx.ModelProto, classes: int = 10, n: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    (x,) = [i for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    shape = [n, *(d.dim_value for d in x.type.tensor_type.shape.dim[1:])]
    return {x.name: rng.standard_normal(shape).astype(np.float32) * 2, "y": rng.integers(0, classes, n)}


def _plan_step(model: onnx.ModelProto, examples: dict[str, np.ndarray], opset: int | None):
    plan = training_plan_from_onnx(
        model,
        label="y",
        loss="cross_entropy",
        optimizer=SGD(LR),
        batch_size=4,
        example_selector=ExampleSelector("app:/zoo"),
        opset=opset,
    )
    before = initial_weights_from_onnx(model, plan)
    return (before, *step(plan, before, examples))


def _original_loss(model: onnx.ModelProto, examples: dict[str, np.ndarray]) -> float:
    """The mean cross-entropy of the original file's output, run by onnxruntime at its own opset one
    example at a time (its batch is fixed at one); of the probabilities where it ends in Softmax."""
    session = make_session(model.SerializeToString())
    (name,) = [i.name for i in session.get_inputs() if i.name in examples]
    out = np.concatenate([session.run(None, {name: examples[name][k : k + 1]})[0] for k in range(len(examples["y"]))])
    out = out.reshape(len(out), -1).astype(np.float64)
    logp = np.log(out) if model.graph.node[-1].op_type == "Softmax" else out - np.log(np.exp(out).sum(1, keepdims=True))
    return float(-logp[np.arange(len(out)), examples["y"]].mean())


ZOO = [
    pytest.param(old_models.mnist8_like, 8, 21, id="mnist8-opset8"),
    pytest.param(old_models.mnist8_like, 7, None, id="mnist8-opset7-as-13"),
    pytest.param(old_models.squeezenet_like, 7, 21, id="squeezenet-opset7"),
    pytest.param(old_models.squeezenet_like, 9, 16, id="squeezenet-opset9-as-16"),
    pytest.param(old_models.mxnet_resnet_like, 7, 21, id="mxnet_resnet-opset7"),
    pytest.param(old_models.mxnet_resnet_like, 6, None, id="mxnet_resnet-opset6-as-13"),
    pytest.param(old_models.caffe2_misc, 7, 21, id="caffe2_ops-opset7"),
    pytest.param(old_models.caffenet_like, 7, 21, id="caffenet-opset7"),
    pytest.param(old_models.caffe2_misc, 10, None, id="caffe2_ops-opset10-as-13"),
]


@pytest.mark.parametrize("build, opset, target", ZOO)
def test_a_model_zoo_file_below_opset_13_trains_as_the_same_network_written_at_opset_17(build, opset, target):
    """The file's loss is what onnxruntime computes from it at its own opset (a batch of one at a
    time where it was exported so: MNIST-8's Reshape to [1, 32] takes the batch of four), and its
    step is the by-hand opset-17 network's: Conv's SAME_UPPER, BatchNormalization's spatial,
    Dropout's ratio, Gemm's broadcast, Upsample's scales and the attributes that became inputs,
    Softmax's flattening and the [N, 10, 1, 1] prediction read as [N, 10], CaffeNet's LRN."""
    model = build(opset)
    examples = _zoo_examples(model)
    old_before, old_loss, old_after = _plan_step(model, examples, target)
    before, loss, after = _plan_step(build(modern=True), examples, 17)
    assert old_loss == pytest.approx(loss, rel=1e-6)
    if not any(n.op_type in ("BatchNormalization", "Dropout") for n in model.graph.node):
        assert old_loss == pytest.approx(_original_loss(model, examples), rel=1e-5)
    assert set(old_after) == set(after)
    worst, difference = worst_difference(old_after, after, before)
    assert difference <= TOLERANCE, worst


@pytest.mark.parametrize("build, opset", [(old_models.mnist8_like, 8), (old_models.squeezenet_like, 7)])
def test_a_model_zoo_file_trains_and_evaluates_over_batches_of_any_size(build, opset):
    """A device's batches of three and a short last one through the training and evaluation plans of
    MNIST-8 (exported at a batch of one) and SqueezeNet ([N, 10, 1, 1] probabilities); the
    evaluation's loss is onnxruntime's of the file."""
    model = build(opset)
    examples = _zoo_examples(model, n=7)
    (name,) = [k for k in examples if k != "y"]
    train = training_plan_from_onnx(
        model,
        label="y",
        loss="cross_entropy",
        optimizer=SGD(0.01),
        batch_size=3,
        example_selector=ExampleSelector("app:/zoo"),
        opset=21,
    )
    evaluation = evaluation_plan_from_onnx(
        model,
        label="y",
        loss="cross_entropy",
        batch_size=3,
        example_selector=ExampleSelector("app:/zoo"),
        training_plan=train,
    )
    weights = initial_weights_from_onnx(model, train)
    batches = lambda: [{name: examples[name][i : i + 3], "y": examples["y"][i : i + 3]} for i in range(0, 7, 3)]  # noqa: E731
    trained = PlanExecutor(train).run_device(weights, batches)
    assert trained.metrics["count"] == 7
    result = PlanExecutor(evaluation).run_device(weights, batches)
    assert result.metrics["loss"] == pytest.approx(_original_loss(model, examples), rel=1e-5)


def test_scores_of_shape_n_classes_1_1_are_the_cross_entropys_classes():
    """SqueezeNet's pooled scores without the Softmax: the loss reads [N, 10, 1, 1] as [N, 10], as
    the file's scores per example are (ratio 0: no dropout to draw)."""
    model = old_models.squeezenet_like(7, ratio=0.0, softmax=False)
    examples = _zoo_examples(model)
    _, loss, _ = _plan_step(model, examples, 21)
    assert loss == pytest.approx(_original_loss(model, examples), rel=1e-5)


@pytest.mark.parametrize("opset, mode", [(8, "linear"), (9, "linear"), (10, "linear"), (9, "nearest")])
def test_upsample_and_opset_10s_resize_keep_their_asymmetric_coordinates(opset, mode):
    """onnx's converter writes opset 11's Resize with its half-pixel default, which moves every pixel
    of a linear Upsample: the plan computes what the file computed, at a scale of 1.5 too, and
    trains as the opset-17 Resize told to map coordinates asymmetrically."""
    model = old_models.upsampling(opset, mode=mode, scale=1.5)
    examples = _zoo_examples(model)
    _, old_loss, old_after = _plan_step(model, examples, 21)
    assert old_loss == pytest.approx(_original_loss(model, examples), rel=1e-5)
    before, loss, after = _plan_step(old_models.upsampling(mode=mode, scale=1.5, modern=True), examples, 17)
    assert old_loss == pytest.approx(loss, rel=1e-6)
    worst, difference = worst_difference(old_after, after, before)
    assert difference <= TOLERANCE, worst


def test_a_batch_norm_whose_statistics_other_nodes_read_is_refused_in_one_line():
    model = old_models.mxnet_resnet_like(9)
    bn = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    bn.output.extend(["batchnorm0_mean", "batchnorm0_var"])
    model.graph.output.append(helper.make_tensor_value_info("batchnorm0_mean", onnx.TensorProto.FLOAT, [8]))
    with pytest.raises(PlanError) as refused:
        _plan_step(model, _zoo_examples(model), 21)
    message = str(refused.value)
    assert "\n" not in message
    assert "BatchNormalization, opset 9" in message and "batchnorm0_mean" in message and "opset 14" in message


def test_a_reshape_to_a_constant_other_batch_is_refused_naming_the_node():
    """A Reshape that folds the batch of one into another axis cannot take a batch of four."""
    model = old_models.mnist8_like(8)
    shape = next(i for i in model.graph.initializer if i.name == "Pooling160_Output_0_reshape0_shape")
    shape.CopyFrom(numpy_helper.from_array(np.array([32], np.int64), shape.name))
    reshape = next(n for n in model.graph.node if n.output[0] == "Pooling160_Output_0_reshape0")
    reshape.name = "flatten_features"
    model.graph.node.insert(
        list(model.graph.node).index(reshape) + 1,
        helper.make_node("Unsqueeze", ["Pooling160_Output_0_reshape0"], ["features_2d"], axes=[0]),
    )
    next(n for n in model.graph.node if n.op_type == "MatMul").input[0] = "features_2d"
    with pytest.raises(PlanError, match=r"node 'flatten_features' \(Reshape\) .* \[32\], .* dynamic batch axis"):
        _plan_step(model, _zoo_examples(model), 21)


def test_the_experimental_ops_later_opsets_dropped_train_as_the_ops_they_compute():
    """ImageScaler (tiny YOLOv2's input scaling), ScaledTanh and Affine: onnx's converter has no
    schema to raise them from; the plan writes them out and computes what onnxruntime computes of
    the file."""
    model = old_models.experimental_ops(8)
    examples = _zoo_examples(model)
    _, old_loss, old_after = _plan_step(model, examples, 21)
    assert old_loss == pytest.approx(_original_loss(model, examples), rel=1e-5)
    before, loss, after = _plan_step(old_models.experimental_ops(modern=True), examples, 17)
    worst, difference = worst_difference(old_after, after, before)
    assert difference <= TOLERANCE, worst


def test_is_test_0_and_a_per_channel_spatial_0_which_the_converter_refuses_change_nothing_trained():
    """Opset 6's BatchNormalization with is_test=0, and CNTK's BatchNormalization with spatial=0
    after a dense layer ([N, C]: one scale per channel either way), train as with 1."""
    model = old_models.mxnet_resnet_like(6)
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            node.attribute.append(helper.make_attribute("is_test", 0))
    examples = _zoo_examples(model)
    _, old_loss, old_after = _plan_step(model, examples, 21)
    before, loss, after = _plan_step(old_models.mxnet_resnet_like(modern=True), examples, 17)
    assert old_loss == pytest.approx(loss, rel=1e-6)
    assert worst_difference(old_after, after, before)[1] <= TOLERANCE
    examples = _zoo_examples(old_models.dense_batch_norm(1))
    (before, *spatial_0), (_, *spatial_1) = [
        _plan_step(old_models.dense_batch_norm(spatial), examples, 21) for spatial in (0, 1)
    ]
    assert spatial_0[0] == spatial_1[0]
    assert worst_difference(spatial_0[1], spatial_1[1], before)[1] == 0


def test_a_node_the_converter_cannot_raise_is_refused_by_name_op_and_opset():
    """One line naming the node, its op and the opsets: a per-activation BatchNormalization
    (spatial=0 with a scale per channel and position), and an op later opsets dropped."""
    model = old_models.mxnet_resnet_like(7)
    bn = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    bn.name = "batchnorm0"
    next(a for a in bn.attribute if a.name == "spatial").i = 0
    for name in bn.input[1:]:
        tensor = next(i for i in model.graph.initializer if i.name == name)
        tensor.CopyFrom(numpy_helper.from_array(np.ones((8, 8, 8), np.float32), name))
        next(i for i in model.graph.input if i.name == name).CopyFrom(
            helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [8, 8, 8])
        )
    with pytest.raises(PlanError) as refused:
        _plan_step(model, _zoo_examples(model), 21)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("node 'batchnorm0' (BatchNormalization, opset 7) cannot be raised to opset 21")
    assert "spatial must have value 1" in message and "export the model again at opset 13 or later" in message
    model = old_models.experimental_ops(8, crop=True)
    with pytest.raises(PlanError) as refused:
        _plan_step(model, _zoo_examples(model), 21)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("node 'crop1' (Crop, opset 8) is an experimental op that later opsets dropped")
    assert "export the model again at opset 13 or later" in message


def test_the_cli_takes_an_opset_9_export_and_refuses_in_one_line(tmp_path, capsys):
    from emulator.cli.commands import main

    out = tmp_path / "cnn.fedplan"
    args = ["plan", "from-onnx", str(FIXTURES / "cnn.opset9.preserve.onnx"), "--label", "y", "-o", str(out)]
    assert main(args) == 0
    assert out.exists()
    model = old_models.mxnet_resnet_like(9)
    next(n for n in model.graph.node if n.op_type == "BatchNormalization").output.append("saved")
    model.graph.output.append(helper.make_tensor_value_info("saved", onnx.TensorProto.FLOAT, [8]))
    onnx.save(model, str(tmp_path / "reads_statistics.onnx"))
    capsys.readouterr()
    assert main([*args[:2], str(tmp_path / "reads_statistics.onnx"), *args[3:]]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "(BatchNormalization, opset 9)" in err
