"""The autodiff engine: gradients along several paths add up, tensors off the loss's path get
none, ops without a rule are refused by name, and the documented op table is the code's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import NodeProto, helper, numpy_helper

from emulator.toolchain import OP_COVERAGE, UnsupportedOpError, vjp_model
from emulator.toolchain.autodiff import TensorInfo, constant_values, refine_infos
from emulator.toolchain.gradients import coverage_document
from tests.emulator.toolchain.gradcheck import vjp_error
from tests.emulator.toolchain.models import F, model


def _int_constant(name: str, values: object) -> NodeProto:
    """A Constant node holding ``values`` as int64."""
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64)))


def test_gradients_along_several_paths_add_up_and_unused_inputs_get_zeros():
    # y = tanh(x @ w) * (x @ w) + x @ w: three paths from w to y; u reaches no output
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("Mul", ["t", "h"], ["p"]),
        helper.make_node("Add", ["p", "h"], ["y"]),
        helper.make_node("Neg", ["u"], ["unused"]),
    ]
    m = model(
        nodes,
        [
            helper.make_tensor_value_info("x", F, [3, 4]),
            helper.make_tensor_value_info("w", F, [4, 2]),
            helper.make_tensor_value_info("u", F, [2]),
        ],
        [helper.make_tensor_value_info("y", F, [3, 2])],
        {},
    )
    rng = np.random.default_rng(0)
    values = {
        "x": rng.standard_normal((3, 4)).astype(np.float32),
        "w": rng.standard_normal((4, 2)).astype(np.float32),
        "u": np.ones(2, np.float32),
    }
    assert vjp_error(m, values, ["x", "w"], eps=1e-2) < 3e-3
    grad_model = vjp_model(m, outputs=["y"], wrt=["u"])
    from device_runtime.executor import make_session

    (du,) = make_session(grad_model.SerializeToString()).run(
        ["grad/u"], {**values, "seed/y": np.ones((3, 2), np.float32)}
    )
    assert np.array_equal(du, np.zeros(2, np.float32))


def test_a_node_without_a_rule_on_the_way_is_refused_by_op_and_name():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Hardmax", ["h"], ["y"], name="pick")]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, [3, 4]), helper.make_tensor_value_info("w", F, [4, 2])],
        [helper.make_tensor_value_info("y", F, [3, 2])],
        {},
    )
    with pytest.raises(UnsupportedOpError, match="'Hardmax' \\(node 'pick'\\) has no gradient rule"):
        vjp_model(m, outputs=["y"], wrt=["w"])


def test_a_branch_that_reads_a_weight_from_inside_is_refused_by_op_and_name():
    """An ``If`` whose branches read ``w`` from the outer scope (no input of the node names it) is on
    the gradient's way: no rule differentiates a subgraph."""
    branch = helper.make_graph(
        [helper.make_node("Neg", ["w"], ["flipped"])], "branch", [], [helper.make_tensor_value_info("flipped", F, None)]
    )
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("If", ["c"], ["shift"], name="branch_on_c", then_branch=branch, else_branch=branch),
        helper.make_node("Add", ["h", "shift"], ["y"]),
    ]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, [2, 2]), helper.make_tensor_value_info("w", F, [2, 2])],
        [helper.make_tensor_value_info("y", F, [2, 2])],
        {"c": np.array(True)},
    )
    with pytest.raises(UnsupportedOpError, match="'If' \\(node 'branch_on_c'\\) runs a subgraph"):
        vjp_model(m, outputs=["y"], wrt=["w"])


def test_the_documented_op_table_is_the_codes():
    doc = Path(__file__).parents[3] / "emulator" / "toolchain" / "OP_COVERAGE.md"
    assert doc.read_text(encoding="utf-8") == coverage_document(), "regenerate: python -m emulator.toolchain.gradients"
    for op in (
        "Conv",
        "MaxPool",
        "AveragePool",
        "GlobalAveragePool",
        "BatchNormalization",
        "Flatten",
        "LayerNormalization",
        "MatMul",
        "Softmax",
        "Transpose",
        "Reshape",
        "Concat",
        "Slice",
        "Gather",
        "Dropout",
        "Gemm",
        "Relu",
    ):
        assert op in OP_COVERAGE


def test_active_dropout_passes_the_gradient_of_kept_entries_scaled_and_drops_the_rest():
    from device_runtime.executor import make_session

    ratio = 0.3
    nodes = [helper.make_node("Dropout", ["x", "ratio", "training"], ["y", "mask"])]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, [200, 50])],
        [helper.make_tensor_value_info("y", F, [200, 50])],
        {"ratio": np.array(ratio, np.float32), "training": np.array(True)},
    )
    seed = np.random.default_rng(1).uniform(1, 2, (200, 50)).astype(np.float32)
    (grad,) = make_session(vjp_model(m, outputs=["y"], wrt=["x"]).SerializeToString()).run(
        ["grad/x"], {"x": np.ones((200, 50), np.float32), "seed/y": seed}
    )
    kept = grad != 0
    np.testing.assert_allclose(grad[kept], seed[kept] / (1 - ratio), rtol=1e-6)
    assert abs((~kept).mean() - ratio) < 0.03  # 10,000 draws: the dropped share is the ratio


def test_axes_computed_from_constants_alone_are_constants_for_the_rules():
    """The dynamo exporter's unoptimized graphs (optimize=False) build a ReduceMean's axes and a Slice's
    starts with Reshape and Concat of Constant nodes; the rules read them folded."""
    const = _int_constant
    nodes = [
        const("raw_axes", [[-1, -2]]),
        const("flat", [-1]),
        helper.make_node("Reshape", ["raw_axes", "flat"], ["axes"]),
        const("zero", [0]),
        const("one", [1]),
        helper.make_node("Concat", ["zero", "one"], ["starts"], axis=0),
        const("big", [9, 9]),
        const("slice_axes", [2, 3]),
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("Slice", ["h", "starts", "big", "slice_axes"], ["s"]),
        helper.make_node("ReduceMean", ["s", "axes"], ["y"], keepdims=1),
    ]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, [2, 3, 4, 5]), helper.make_tensor_value_info("w", F, [1, 3, 1, 1])],
        [helper.make_tensor_value_info("y", F, [2, 3, 1, 1])],
        {},
        opset=18,
    )
    rng = np.random.default_rng(0)
    values = {
        "x": rng.standard_normal((2, 3, 4, 5)).astype(np.float32),
        "w": rng.standard_normal((1, 3, 1, 1)).astype(np.float32),
    }
    assert vjp_error(m, values, ["x", "w"], eps=1e-2) < 3e-3


def test_values_computed_from_float_initializers_are_not_folded_into_constants():
    """A float initializer may be a trained weight: what is computed from it changes as it trains."""
    nodes = [
        helper.make_node("Constant", [], ["two"], value=numpy_helper.from_array(np.array(2.0, np.float32))),
        helper.make_node("Mul", ["two", "two"], ["four"]),
        helper.make_node("Mul", ["w", "two"], ["w2"]),
    ]
    m = model(nodes, [], [helper.make_tensor_value_info("w2", F, [2])], {"w": np.ones(2, np.float32)})
    values = constant_values(m.graph, 17)
    assert float(values["four"]) == 4.0 and "w2" not in values


def test_shapes_sliced_with_starts_computed_by_mod_keep_their_rank_for_the_rules():
    """torchvision's multi-head attention (classic exporter) reshapes its projection with a shape
    sliced at starts computed through Mod, where onnx's data propagation stops; folded first, the
    reshaped tensor keeps its rank and the Gather after it is differentiated."""
    const = _int_constant
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),  # [2, 3, 6]
        helper.make_node("Shape", ["h"], ["shape"]),
        const("minus_one", [-1]),
        const("three", [3]),
        const("three_again", [3]),
        helper.make_node("Add", ["minus_one", "three"], ["two"]),
        helper.make_node("Mod", ["two", "three_again"], ["start"]),  # 2
        const("zero", [0]),
        helper.make_node("Slice", ["shape", "zero", "start"], ["lead"]),  # [2, 3]
        const("split", [2, 3]),
        helper.make_node("Concat", ["lead", "split"], ["new_shape"], axis=0),
        helper.make_node("Reshape", ["h", "new_shape"], ["r"]),  # [2, 3, 2, 3]
        helper.make_node("Transpose", ["r"], ["t"], perm=[2, 0, 1, 3]),
        const("first", 0),
        helper.make_node("Gather", ["t", "first"], ["y"], axis=0),
    ]  # [2, 3, 3]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, [2, 3, 4]), helper.make_tensor_value_info("w", F, [4, 6])],
        [helper.make_tensor_value_info("y", F, [2, 3, 3])],
        {},
        opset=17,
    )
    rng = np.random.default_rng(0)
    values = {
        "x": rng.standard_normal((2, 3, 4)).astype(np.float32),
        "w": rng.standard_normal((4, 6)).astype(np.float32),
    }
    assert vjp_error(m, values, ["x", "w"], eps=1e-2) < 3e-3


def test_slices_at_a_static_dimension_that_shape_reads_are_differentiated():
    """Llama's rotate_half as the classic exporter writes it: the last axis halved at x.shape[-1] // 2
    (Shape, Gather, Div, Unsqueeze) while the batch axis stays dynamic."""
    const = _int_constant
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),  # [N, 3, 8]
        helper.make_node("Shape", ["h"], ["shape"]),
        const("last", 2),
        helper.make_node("Gather", ["shape", "last"], ["size"]),
        const("two", 2),
        helper.make_node("Div", ["size", "two"], ["half"]),
        const("zero_axis", [0]),
        helper.make_node("Unsqueeze", ["half", "zero_axis"], ["half_1d"]),
        const("start", [0]),
        const("end", [2**63 - 1]),
        const("axis", [-1]),
        helper.make_node("Slice", ["h", "start", "half_1d", "axis"], ["x1"]),
        helper.make_node("Slice", ["h", "half_1d", "end", "axis"], ["x2"]),
        helper.make_node("Neg", ["x2"], ["minus_x2"]),
        helper.make_node("Concat", ["minus_x2", "x1"], ["y"], axis=-1),
    ]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 3, 4]), helper.make_tensor_value_info("w", F, [4, 8])],
        [helper.make_tensor_value_info("y", F, ["N", 3, 8])],
        {},
        opset=17,
    )
    rng = np.random.default_rng(0)
    values = {
        "x": rng.standard_normal((2, 3, 4)).astype(np.float32),
        "w": rng.standard_normal((4, 8)).astype(np.float32),
    }
    assert vjp_error(m, values, ["x", "w"], eps=1e-2) < 3e-3


def test_dimensions_lost_in_symbolic_shape_arithmetic_are_recovered_for_the_rules():
    """MobileViT (classic exporter) unfolds patches with Reshape to batch x channels rows, a product of
    symbolic sizes where onnx's data propagation gives up, so the static axes after it lose their
    sizes: inference with the batch set to two sizes tells the static axes from the batch's."""
    ints = _int_constant
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("Shape", ["h"], ["shape"]),  # h [N, 2, 4]
        ints("zero", 0),
        ints("one", 1),
        ints("axis0", [0]),
        ints("minus_one", [-1]),
        helper.make_node("Gather", ["shape", "zero"], ["n"]),
        helper.make_node("Gather", ["shape", "one"], ["c"]),
        helper.make_node("Mul", ["n", "c"], ["rows"]),
        helper.make_node("Unsqueeze", ["rows", "axis0"], ["rows_1d"]),
        helper.make_node("Concat", ["rows_1d", "minus_one"], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["h", "flat_shape"], ["flat"]),  # [2N, 4]
        ints("start", [1]),
        ints("end", [3]),
        ints("axis1", [1]),
        helper.make_node("Slice", ["flat", "start", "end", "axis1"], ["y"]),
    ]  # [2N, 2]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 2, 4]), helper.make_tensor_value_info("w", F, [1, 2, 1])],
        [helper.make_tensor_value_info("y", F, ["M", 2])],
        {},
        opset=17,
    )
    rng = np.random.default_rng(0)
    values = {
        "x": rng.standard_normal((3, 2, 4)).astype(np.float32),
        "w": rng.standard_normal((1, 2, 1)).astype(np.float32),
    }
    assert vjp_error(m, values, ["x", "w"], eps=1e-2) < 3e-3


def test_shapes_of_a_rewritten_graph_keep_the_dimensions_the_first_inference_fixed():
    """A training rewrite (batch-statistics BatchNorm, a convolution as a sum over kernel offsets)
    can leave inference knowing less of a tensor it kept: ShuffleNetV2's channel split read its
    channel count from such a shape, and its Slice had no size to pad back to."""
    infos = {"split": TensorInfo(F, ("N", 64, 1, 1)), "flat": TensorInfo(F, (3,)), "late": TensorInfo(F, ("unk__1", 8))}
    newer = {
        "split": TensorInfo(F, ("unk__57", "unk__65", 1, 1)),
        "flat": TensorInfo(F, None),
        "late": TensorInfo(F, ("N", 8)),
        "added": TensorInfo(F, (2, "N")),
    }
    refine_infos(infos, newer)
    assert {n: i.shape for n, i in infos.items()} == {
        "split": ("N", 64, 1, 1),
        "flat": (3,),
        "late": ("N", 8),
        "added": (2, "N"),
    }


def test_a_convolution_after_many_channel_splits_at_sizes_read_at_run_time_is_differentiated():
    """torchvision's ShuffleNetV2 (classic exporter) splits each unit's channels in two at a size read
    by ``Shape`` and divided (``num_channels // 2``, where onnx's data propagation gives up): each
    unit's sizes are known only once the one before it is folded, one round of inference each. Its
    last convolution, 16 units deep, had no spatial sizes left after 4 rounds; here 8 units deep."""
    ints = _int_constant
    nodes = [ints("one", 1), ints("two", 2), ints("axis0", [0]), ints("axis1", [1]), ints("start", [0])]
    x = "x"
    for k in range(8):
        nodes += [
            helper.make_node("Shape", [x], [f"s{k}"]),
            helper.make_node("Gather", [f"s{k}", "one"], [f"c{k}"]),
            helper.make_node("Div", [f"c{k}", "two"], [f"half{k}"]),
            helper.make_node("Unsqueeze", [f"half{k}", "axis0"], [f"half{k}_1d"]),
            helper.make_node("Unsqueeze", [f"c{k}", "axis0"], [f"c{k}_1d"]),
            helper.make_node("Slice", [x, "start", f"half{k}_1d", "axis1"], [f"kept{k}"]),
            helper.make_node("Slice", [x, f"half{k}_1d", f"c{k}_1d", "axis1"], [f"branch{k}"]),
            helper.make_node("Tanh", [f"branch{k}"], [f"act{k}"]),
            helper.make_node("Concat", [f"kept{k}", f"act{k}"], [f"x{k}"], axis=1),
        ]
        x = f"x{k}"
    nodes.append(helper.make_node("Conv", [x, "w"], ["y"], pads=[1, 1, 1, 1]))
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 4, 3, 3]), helper.make_tensor_value_info("w", F, [2, 4, 3, 3])],
        [helper.make_tensor_value_info("y", F, ["N", 2, 3, 3])],
        {},
        opset=17,
    )
    rng = np.random.default_rng(0)
    values = {
        "x": rng.standard_normal((2, 4, 3, 3)).astype(np.float32),
        "w": rng.standard_normal((2, 4, 3, 3)).astype(np.float32),
    }
    assert vjp_error(m, values, ["x", "w"], eps=1e-2) < 3e-3
