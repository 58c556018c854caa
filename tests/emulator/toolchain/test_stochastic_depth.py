"""Stochastic depth (torchvision's ``StochasticDepth``, timm's ``DropPath``) as both torch exporters
write its training form: a residual branch kept per example with probability ``keep`` and scaled by
``1/keep``, from ``RandomUniformLike``, ``Less``, a cast and a division. torchvision's EfficientNet,
ConvNeXt, Swin and MaxViT have it on by default. The graphs here are the exporters' own (read off
``torch.onnx.export`` of ``x + StochasticDepth(p, "row")(x @ W)`` by torch 2.13). transformers'
``drop_path`` (Swin, SegFormer, ConvNeXt, BEiT) is drawn as ``Floor(Add(RandomUniformLike, keep))``
multiplying the branch divided by ``keep`` (read off the dynamo export of its Swin)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from emulator.toolchain import SGD, training_plan_from_onnx
from emulator.toolchain.onnx_import import inference_form, stochastic_depth_as_dropout
from example_store import ExampleSelector

F, KEEP = 3, 0.75
W = np.array([[1.0, -2.0, 0.5], [0.25, 1.5, -1.0], [2.0, 0.0, 1.0]], dtype=np.float32)


def _model(exporter: str, divided: bool = True, blocks: int = 1) -> onnx.ModelProto:
    """``logits = x + (x @ W) * mask`` (``blocks`` times over), the mask one value per example as
    ``exporter`` writes it."""
    keep = numpy_helper.from_array(np.array(KEEP, dtype=np.float32))
    nodes = [
        helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.array([1], dtype=np.int64))),
        helper.make_node("Constant", [], ["keep"], value=keep),
        helper.make_node("Constant", [], ["keep_again"], value=keep),
    ]
    x = "x"
    for k in range(blocks):
        out = "logits" if k == blocks - 1 else f"x{k}"
        nodes += [
            helper.make_node("MatMul", [x, "W"], [f"h{k}"]),
            helper.make_node("Shape", [x], [f"shape{k}"], start=0, end=1),
            helper.make_node("Concat", [f"shape{k}", "one"], [f"mask_shape{k}"], axis=0),
            helper.make_node("ConstantOfShape", [f"mask_shape{k}"], [f"zeros{k}"]),
        ]
        if exporter == "transformers":  # drop_path: floor(keep + u) multiplies the branch divided by keep
            nodes += [
                helper.make_node("RandomUniformLike", [f"zeros{k}"], [f"u{k}"], dtype=TensorProto.FLOAT),
                helper.make_node("Add", [f"u{k}", "keep"], [f"keep_u{k}"]),
                helper.make_node("Floor", [f"keep_u{k}"], [f"mask01_{k}"]),
                helper.make_node("Div", [f"h{k}", "keep_again"], [f"hk{k}"]),
                helper.make_node("Mul", [f"hk{k}", f"mask01_{k}"], [f"branch{k}"]),
                helper.make_node("Add", [x, f"branch{k}"], [out]),
            ]
            x = out
            continue
        if exporter == "classic":
            nodes += [
                helper.make_node("RandomUniformLike", [f"zeros{k}"], [f"u{k}"]),
                helper.make_node("Less", [f"u{k}", "keep"], [f"kept{k}"]),
                helper.make_node("Cast", [f"kept{k}"], [f"mask01_{k}"], to=TensorProto.FLOAT),
            ]
        else:  # dynamo: the draw from a cast of the shape's tensor, the constants cast like what they meet
            nodes += [
                helper.make_node("Cast", [f"zeros{k}"], [f"zeros_f{k}"], to=TensorProto.FLOAT),
                helper.make_node("RandomUniformLike", [f"zeros_f{k}"], [f"u{k}"]),
                helper.make_node("CastLike", ["keep", f"u{k}"], [f"keep_like{k}"]),
                helper.make_node("Less", [f"u{k}", f"keep_like{k}"], [f"kept{k}"]),
                helper.make_node("CastLike", [f"kept{k}", f"h{k}"], [f"mask01_{k}"]),
            ]
        if divided:
            nodes.append(helper.make_node("Div", [f"mask01_{k}", "keep_again"], [f"mask{k}"]))
        nodes += [
            helper.make_node("Mul", [f"h{k}", f"mask{k}" if divided else f"mask01_{k}"], [f"branch{k}"]),
            helper.make_node("Add", [x, f"branch{k}"], [out]),
        ]
        x = out
    graph = helper.make_graph(
        nodes,
        "stochastic_depth",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", F])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", F])],
        initializer=[numpy_helper.from_array(W, "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """Without onnxruntime's graph rewrites, which remove a Dropout whose mask nothing reads even
    when it is active (a training plan reads it: ``training.masks_read``)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"x": x})[0]


EXPORTERS = ["classic", "dynamo", "transformers"]


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_stochastic_depth_becomes_a_dropout_of_ones_that_keeps_whole_rows_at_its_rate(exporter):
    """Rewritten, the draw is one ``Dropout`` of ratio ``1 - keep``: in training each example's branch
    is kept whole and scaled by ``1/keep`` or dropped whole, about ``keep`` of 4,000 kept (4.5
    standard deviations allowed), as torch's training step computes it."""
    model = _model(exporter)
    assert stochastic_depth_as_dropout(model) == 1
    onnx.checker.check_model(model, full_check=True)
    ops = [n.op_type for n in model.graph.node]
    assert "RandomUniformLike" not in ops and "Less" not in ops and ops.count("Dropout") == 1
    (dropout,) = (n for n in model.graph.node if n.op_type == "Dropout")
    ratio = next(i for i in model.graph.initializer if i.name == dropout.input[1])
    assert float(numpy_helper.to_array(ratio)) == pytest.approx(1 - KEEP)
    x = np.random.default_rng(0).standard_normal((4000, F)).astype(np.float32)
    branch, h = _run(model, x) - x, x @ W
    kept = np.isclose(branch, h / KEEP, rtol=1e-5, atol=1e-5).all(axis=1)
    dropped = (branch == 0).all(axis=1)
    assert np.all(kept | dropped)
    assert abs(kept.mean() - KEEP) < 4.5 * np.sqrt(KEEP * (1 - KEEP) / len(x))


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_an_evaluation_of_a_model_with_stochastic_depth_keeps_every_branch_unscaled(exporter):
    """In its inference form (evaluation plans, ``plan from-torch``'s file) the branch is the identity,
    as torch's ``eval()`` computes it: the same output every run, not a random one; every block's."""
    model = _model(exporter, blocks=3)
    inference_form(model)
    onnx.checker.check_model(model, full_check=True)
    assert not {"RandomUniformLike", "Less"} & {n.op_type for n in model.graph.node}
    x = np.random.default_rng(1).standard_normal((64, F)).astype(np.float32)
    expected = x
    for _ in range(3):
        expected = expected + expected @ W
    np.testing.assert_allclose(_run(model, x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_training_plan_draws_stochastic_depth_from_its_seeded_dropout(exporter):
    """A plan's masks are seeded (a device's session is reproducible): the stochastic depth is one of
    its Dropouts, with a seed, whose mask is read, and nothing unseeded is drawn."""
    plan = training_plan_from_onnx(
        _model(exporter),
        label="y",
        loss="cross_entropy",
        optimizer=SGD(0.1),
        batch_size=4,
        example_selector=ExampleSelector("app:/m"),
    )
    work = onnx.ModelProto.FromString(plan.work)
    dropouts = [n for n in work.graph.node if n.op_type == "Dropout"]
    assert not [n for n in work.graph.node if n.op_type.startswith("Random")]
    assert len(dropouts) == 1 and any(a.name == "seed" for a in dropouts[0].attribute)
    # onnxruntime removes a Dropout whose mask nothing reads, in training too
    assert dropouts[0].output[1] in {i for n in work.graph.node for i in n.input}


def test_the_form_without_the_division_is_left_as_it_is():
    """``scale_by_keep=False`` (timm's option) keeps the branch unscaled in training and whole in
    evaluation, which no Dropout computes: that graph is not rewritten."""
    model = _model("classic", divided=False)
    assert stochastic_depth_as_dropout(model) == 0
    assert "RandomUniformLike" in {n.op_type for n in model.graph.node}
