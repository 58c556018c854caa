"""The rewrites of generated work graphs compute the same values in the shapes onnxruntime runs fast."""

from __future__ import annotations

import numpy as np
import onnx
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from device_runtime.executor import make_session
from emulator.toolchain import SGD, training_plan_from_onnx
from emulator.toolchain.peephole import (
    ARITHMETIC,
    BROADCASTING,
    SHORT_BROADCAST_MAX,
    inferred_ranks,
    inferred_shapes,
    rank_matched_constants,
    short_broadcasts_expanded,
)
from example_store import ExampleSelector
from tests.emulator.toolchain.models import F, cnn, glorot, model


def _one_element_constants_below_their_ops_rank(work: onnx.ModelProto) -> list[str]:
    """Nodes of ``work`` that broadcast a one-element initializer of lower rank than their output."""
    ranks = inferred_ranks(work)
    small = {i.name: len(i.dims) for i in work.graph.initializer if int(np.prod(i.dims, dtype=np.int64)) == 1}
    return [
        n.name
        for n in work.graph.node
        if n.op_type in BROADCASTING
        and n.output[0] in ranks
        and any(small.get(i, ranks[n.output[0]]) < ranks[n.output[0]] for i in n.input)
    ]


def _layer_norm_classifier(seed: int = 0) -> onnx.ModelProto:
    """[N, 6, 8] -> LayerNormalization -> mean over the sequence -> Gemm: the per-row statistics of the
    normalization and their gradients are [N, 6, 1] tensors scaled by constants."""
    rng = np.random.default_rng(seed)
    w = {
        "ln_s": rng.uniform(0.5, 1.5, 8).astype(np.float32),
        "ln_b": rng.normal(0, 0.1, 8).astype(np.float32),
        "fc_w": glorot(rng, 8, 3),
        "fc_b": np.zeros(3, np.float32),
        "axes": np.array([1], np.int64),
    }
    n = helper.make_node
    nodes = [
        n("LayerNormalization", ["x", "ln_s", "ln_b"], ["ln"], axis=-1, epsilon=1e-5),
        n("ReduceMean", ["ln", "axes"], ["pooled"], keepdims=0),
        n("Gemm", ["pooled", "fc_w", "fc_b"], ["logits"]),
    ]
    return model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 6, 8])],
        [helper.make_tensor_value_info("logits", F, ["N", 3])],
        w,
        opset=18,
        name="ln",
    )


def test_a_work_graph_broadcasts_no_one_element_constant_below_the_rank_of_its_op():
    """onnxruntime broadcasts a scalar over a tensor whose last axis is 1 element by element (15-40x
    slower than a constant of the tensor's rank): a layer norm's step scales its [N, S, 1]
    statistics only by constants of rank 3."""
    plan = training_plan_from_onnx(
        _layer_norm_classifier(),
        label="y",
        loss="cross_entropy",
        optimizer=SGD(0.1),
        batch_size=4,
        example_selector=ExampleSelector("app:/ln"),
    )
    work = onnx.ModelProto.FromString(plan.work)
    assert _one_element_constants_below_their_ops_rank(work) == []


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    const_rank=st.integers(0, 3),
    op=st.sampled_from(["Add", "Sub", "Mul", "Div", "Max", "Pow", "Where", "Greater"]),
    first=st.booleans(),
    value=st.floats(0.5, 2.0),
)
def test_rank_matched_constants_compute_the_same_values(shape, const_rank, op, first, value):
    """Whatever the op, the operand order and the ranks, the rewritten graph's output is the
    original's, bit for bit, and no one-element constant is read below the op's rank."""
    const = np.full([1] * const_rank, value, np.float32)
    inputs = ["x", "k"] if first else ["k", "x"]
    if op == "Where":
        nodes = [helper.make_node("Greater", ["x", "zero"], ["c"]), helper.make_node("Where", ["c", *inputs], ["y"])]
    else:
        nodes = [helper.make_node(op, inputs, ["y"])]
    inits = [numpy_helper.from_array(const, "k"), numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", F, shape)],
        [
            helper.make_tensor_value_info(
                "y", TensorProto.BOOL if op == "Greater" else F, list(np.broadcast_shapes(shape, const.shape))
            )
        ],
        initializer=inits,
    )
    original = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    new_nodes, new_inits = rank_matched_constants(
        original.graph.node, original.graph.initializer, inferred_ranks(original)
    )
    rewritten = helper.make_model(
        helper.make_graph(new_nodes, "g", list(graph.input), list(graph.output), initializer=new_inits),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,
    )
    onnx.checker.check_model(rewritten)
    x = np.random.default_rng(len(shape)).uniform(0.1, 3.0, shape).astype(np.float32)
    (before,) = make_session(original.SerializeToString()).run(None, {"x": x})
    (after,) = make_session(rewritten.SerializeToString()).run(None, {"x": x})
    assert before.shape == after.shape and before.dtype == after.dtype
    np.testing.assert_array_equal(before, after)
    assert _one_element_constants_below_their_ops_rank(rewritten) == []


def _short_broadcasts(work: onnx.ModelProto) -> list[str]:
    """Nodes of ``work`` whose output repeats an operand over a run of 2 to SHORT_BROADCAST_MAX
    trailing elements and over an earlier axis besides (onnxruntime's slow broadcast)."""
    shapes = inferred_shapes(work)
    found = []
    for n in work.graph.node:
        out = shapes.get(n.output[0]) if n.op_type in ARITHMETIC else None
        for name in n.input if out is not None else []:
            operand = shapes.get(name)
            if operand is None or len(operand) > len(out):
                continue
            aligned = [1] * (len(out) - len(operand)) + operand
            first = len(aligned)
            while first > 0 and aligned[first - 1] == 1:
                first -= 1
            run = out[first:]
            if (
                run
                and all(isinstance(d, int) for d in run)
                and 1 < int(np.prod(run)) <= SHORT_BROADCAST_MAX
                and any(a != 1 for a in aligned[:first])
                and any(a == 1 and o != 1 for a, o in zip(aligned[:first], out[:first]))
            ):
                found.append(n.name or n.output[0])
    return found


def test_a_work_graph_expands_per_channel_factors_over_few_positions_and_sums_kernel_offsets_without_runtime_axes():
    """A batch norm over 4x4 positions: its per-channel [1, C, 1, 1] statistics and factors meet the
    [N, C, 4, 4] activations expanded to [1, C, 4, 4] (onnxruntime broadcasts a run of 16 elements
    3-7x slower). Its Convs run as sums over their kernel offsets, whose terms' gradients are the
    sum's own: no reduction over axes found at run time (NonZero) is left in the graph."""
    source = cnn(seed=4, side=4)
    plan = training_plan_from_onnx(
        source,
        label="y",
        loss="cross_entropy",
        optimizer=SGD(0.1),
        batch_size=4,
        example_selector=ExampleSelector("app:/bn"),
    )
    work = onnx.ModelProto.FromString(plan.work)
    ops = [n.op_type for n in work.graph.node]
    assert "Expand" in ops and "NonZero" not in ops
    assert _short_broadcasts(work) == []
    assert _short_broadcasts_of_a_batch_norm_by_hand(), "the check finds what it looks for"


def _short_broadcasts_of_a_batch_norm_by_hand() -> list[str]:
    """What :func:`_short_broadcasts` finds in a batch norm's centring before the rewrite:
    [N, C, 4, 4] minus [1, C, 1, 1]."""
    graph = helper.make_graph(
        [helper.make_node("Sub", ["x", "mean"], ["y"])],
        "g",
        [
            helper.make_tensor_value_info("x", F, ["N", 4, 4, 4]),
            helper.make_tensor_value_info("mean", F, [1, 4, 1, 1]),
        ],
        [helper.make_tensor_value_info("y", F, ["N", 4, 4, 4])],
    )
    return _short_broadcasts(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=2, max_size=4),
    keep=st.lists(st.booleans(), min_size=4, max_size=4),
    op=st.sampled_from(sorted(ARITHMETIC)),
    first=st.booleans(),
    drop_rank=st.booleans(),
)
def test_short_broadcasts_expanded_compute_the_same_values(shape, keep, op, first, drop_rank):
    """Whatever the shapes (an operand keeping some of the output's axes and broadcast over the
    others), the op and the operand order, the rewritten graph computes the original's values bit
    for bit, and no op is left repeating an operand over a short trailing run."""
    operand = [d if k else 1 for d, k in zip(shape, keep)]
    if drop_rank:
        while len(operand) > 1 and operand[0] == 1:
            operand = operand[1:]
    inputs = ["x", "v"] if first else ["v", "x"]
    graph = helper.make_graph(
        [helper.make_node(op, inputs, ["y"])],
        "g",
        [helper.make_tensor_value_info("x", F, shape), helper.make_tensor_value_info("v", F, operand)],
        [helper.make_tensor_value_info("y", F, shape)],
    )
    original = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    nodes, inits = short_broadcasts_expanded(original.graph.node, original.graph.initializer, inferred_shapes(original))
    rewritten = helper.make_model(
        helper.make_graph(nodes, "g", list(graph.input), list(graph.output), initializer=inits),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,
    )
    onnx.checker.check_model(rewritten)
    rng = np.random.default_rng(len(shape))
    values = {
        "x": rng.uniform(0.5, 2.0, shape).astype(np.float32),
        "v": rng.uniform(0.5, 2.0, operand).astype(np.float32),
    }
    (before,) = make_session(original.SerializeToString()).run(None, values)
    (after,) = make_session(rewritten.SerializeToString()).run(None, values)
    np.testing.assert_array_equal(before, after)
    assert _short_broadcasts(rewritten) == []
