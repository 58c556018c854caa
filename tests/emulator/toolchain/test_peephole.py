"""The rewrites of generated work graphs compute the same values in the shapes onnxruntime runs fast."""

from __future__ import annotations

import numpy as np
import onnx
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from device_runtime.executor import make_session
from emulator.toolchain import SGD, training_plan_from_onnx
from emulator.toolchain.peephole import BROADCASTING, inferred_ranks, rank_matched_constants
from example_store import ExampleSelector
from tests.emulator.toolchain.models import F, glorot, model


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
