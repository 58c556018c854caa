"""A ``Loop`` whose trip count is known when the plan is made is unrolled before differentiation.

Hand-built Loops (``onnx.helper``): a recurrence ``h = tanh(x[t] @ W + h @ U)`` over a sequence of
fixed length, its trip count given as a constant or folded from the input's static shape, its
condition always true or comparing a counter it carries to a bound (as tf2onnx writes a Keras
recurrence), with every step's ``h`` as a scan output. The unrolled graph computes what
onnxruntime's Loop computes, and its generated gradient matches finite differences; a Loop whose
trip count depends on the batch, whose condition depends on the data, or that runs too long is
refused in one line naming it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from device_runtime.executor import make_session
from emulator.toolchain import SGD
from emulator.toolchain.emitter import UnsupportedOpError
from emulator.toolchain.loops import unroll_control_flow
from emulator.toolchain.training import onnx_training_plan
from example_store import ExampleSelector
from tests.emulator.toolchain.gradcheck import vjp_error

T, N, F, H = 4, 3, 2, 3
F64, F32 = TensorProto.DOUBLE, TensorProto.FLOAT
SELECTOR = ExampleSelector("app:/sequences")


def recurrence(trip_count: str = "const", condition: str = "true", float_type: int = F64) -> onnx.ModelProto:
    """``y = concat(last h, mean over steps of h) @ V`` with ``x`` of shape [N, T, F] (batch dynamic).

    ``trip_count``: ``const`` (an initializer T), ``shape`` (folded from x's static T), ``batch``
    (x's batch: known only at run time), ``none`` (the condition alone stops it). ``condition``:
    ``true``, ``counter`` (a carried counter < a carried bound, tf2onnx's form) or ``data``. In float64
    (for finite differences) unless ``float_type`` says float32 (what a plan trains)."""
    rng = np.random.default_rng(0)
    floats = helper.tensor_dtype_to_np_dtype(float_type)
    inits: dict[str, np.ndarray] = {
        "W": rng.standard_normal((F, H)).astype(floats),
        "U": (rng.standard_normal((H, H)) * 0.5).astype(floats),
        "V": rng.standard_normal((2 * H, 2)).astype(floats),
        "h0": np.zeros((1, H), dtype=floats),
        "T": np.array(T, dtype=np.int64),
        "zero": np.array(0, dtype=np.int32),
        "bound": np.array(T, dtype=np.int32),
        "one64": np.array([1], dtype=np.int64),
        "two64": np.array([2], dtype=np.int64),
        "zero64": np.array([0], dtype=np.int64),
        "yes": np.array(True),
    }
    body_nodes = [
        helper.make_node("Gather", ["xt", "i"], ["x_i"], axis=0, name="read_step"),
        helper.make_node("MatMul", ["x_i", "W"], ["xw"]),
        helper.make_node("MatMul", ["h_in", "U"], ["hu"]),
        helper.make_node("Add", ["xw", "hu"], ["pre"]),
        helper.make_node("Tanh", ["pre"], ["h_out"]),
        helper.make_node("Identity", ["h_out"], ["h_scan"]),
        helper.make_node("Add", ["c_in", "one32"], ["c_out"]),
        helper.make_node("Identity", ["b_in"], ["b_out"]),
    ]
    if condition == "true":
        body_nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"]))
    elif condition == "counter":
        body_nodes.append(helper.make_node("Less", ["c_out", "b_in"], ["cond_out"]))
    else:
        body_nodes += [
            helper.make_node("ReduceSum", ["h_out"], ["total"], keepdims=0),
            helper.make_node("Less", ["total", "limit"], ["cond_out"]),
        ]
    scalar = [] if condition != "data" else [numpy_helper.from_array(np.array(100.0, dtype=floats), "limit")]

    def vi(name, elem, shape=None):
        return helper.make_tensor_value_info(name, elem, shape)

    body = helper.make_graph(
        body_nodes,
        "body",
        [
            vi("i", TensorProto.INT64, []),
            vi("cond_in", TensorProto.BOOL, []),
            vi("h_in", float_type, None),
            vi("c_in", TensorProto.INT32, []),
            vi("b_in", TensorProto.INT32, []),
        ],
        [
            vi("cond_out", TensorProto.BOOL, []),
            vi("h_out", float_type, None),
            vi("c_out", TensorProto.INT32, []),
            vi("b_out", TensorProto.INT32, []),
            vi("h_scan", float_type, None),
        ],
        [numpy_helper.from_array(np.array(1, dtype=np.int32), "one32"), *scalar],
    )
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
        helper.make_node("Shape", ["x"], ["x_shape"]),
    ]
    if trip_count == "shape":
        nodes.append(helper.make_node("Slice", ["x_shape", "one64", "two64", "zero64"], ["M"]))
        nodes.append(helper.make_node("Squeeze", ["M", "zero64"], ["M_scalar"]))
        m = "M_scalar"
    elif trip_count == "batch":
        nodes.append(helper.make_node("Gather", ["x_shape", "zero"], ["M_scalar"], axis=0))
        m = "M_scalar"
    else:
        m = {"const": "T", "none": ""}[trip_count]
    nodes += [
        helper.make_node("Loop", [m, "yes", "h0", "zero", "bound"], ["h_last", "c_last", "b_last", "hs"], body=body),
        helper.make_node("ReduceMean", ["hs"], ["h_mean"], axes=[0], keepdims=0),
        helper.make_node("Expand", ["h_last", "x_shape_nh"], ["h_last_n"]),
        helper.make_node("Concat", ["h_last_n", "h_mean"], ["features"], axis=1),
        helper.make_node("MatMul", ["features", "V"], ["y"]),
    ]
    nodes.insert(2, helper.make_node("Concat", ["batch_dim", "h_dim"], ["x_shape_nh"], axis=0))
    nodes.insert(2, helper.make_node("Slice", ["x_shape", "zero64", "one64", "zero64"], ["batch_dim"]))
    inits["h_dim"] = np.array([H], dtype=np.int64)
    graph = helper.make_graph(
        nodes,
        "recurrence",
        [vi("x", float_type, ["N", T, F])],
        [vi("y", float_type, ["N", 2])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return make_session(model.SerializeToString()).run(["y"], {"x": x})[0]


@pytest.mark.parametrize(
    "trip_count, condition", [("const", "true"), ("shape", "true"), ("none", "counter"), ("const", "counter")]
)
def test_an_unrolled_loop_computes_what_the_loop_computes_and_its_gradient_matches_finite_differences(
    trip_count, condition
):
    model = recurrence(trip_count, condition)
    x = np.random.default_rng(1).standard_normal((N, T, F))
    expected = _run(model, x)
    unrolled = onnx.ModelProto()
    unrolled.CopyFrom(model)
    assert unroll_control_flow(unrolled, "y") == ["h_last"]
    assert not any(n.op_type == "Loop" for n in unrolled.graph.node)
    np.testing.assert_allclose(_run(unrolled, x), expected, rtol=1e-12)
    # the weights as graph inputs, to be differentiated
    weights = {i.name: numpy_helper.to_array(i) for i in unrolled.graph.initializer if i.name in ("W", "U", "V")}
    inputs = [i for i in unrolled.graph.initializer if i.name not in weights]
    del unrolled.graph.initializer[:]
    unrolled.graph.initializer.extend(inputs)
    unrolled.graph.input.extend(helper.make_tensor_value_info(k, F64, list(v.shape)) for k, v in weights.items())
    unrolled = onnx.shape_inference.infer_shapes(unrolled)
    assert vjp_error(unrolled, {"x": x, **weights}, ["x", *weights]) < 1e-6


@pytest.mark.parametrize(
    "trip_count, condition, why",
    [
        (
            "batch",
            "true",
            "its trip count 'M_scalar' is not known when the plan is made: it depends on a dimension known",
        ),
        (
            "const",
            "data",
            "its condition depends on 'xt', which is not known when the plan is made: it is computed from the model's input data",
        ),
    ],
)
def test_a_loop_of_a_trip_count_unknown_when_the_plan_is_made_is_refused_in_one_line(trip_count, condition, why):
    with pytest.raises(UnsupportedOpError) as refused:
        unroll_control_flow(recurrence(trip_count, condition), "y")
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("op 'Loop' (node 'h_last') ") and why in message and "fixed sequence length" in message


def test_the_loop_torch_writes_for_an_embedding_bag_is_refused_saying_how_to_export_the_bags():
    """nn.EmbeddingBag through the dynamo exporter (``data/make_embedding_bag.py``): a Loop over the
    bags, as many as the batch; the refusal names the module and the export that trains it."""
    model = onnx.load(str(Path(__file__).with_name("data") / "embedding_bag.onnx"))
    with pytest.raises(UnsupportedOpError) as refused:
        onnx_training_plan(
            model, label="y", loss="cross_entropy", optimizer=SGD(0.1), batch_size=N, example_selector=SELECTOR
        )
    message = str(refused.value)
    assert len(message.splitlines()) == 1 and "not known when the plan is made" in message
    assert "nn.EmbeddingBag" in message and "plan from-torch" in message and "fixed sequence length" not in message


def test_a_loop_longer_than_the_limit_is_refused():
    with pytest.raises(UnsupportedOpError, match=f"it runs more than {T - 1} iterations"):
        unroll_control_flow(recurrence(), "y", limit=T - 1)


def test_a_plan_of_a_model_with_a_loop_trains_its_unrolled_copies():
    """``onnx_training_plan`` unrolls the Loop (no Loop in the work graph) and trains the weights its body reads."""
    made = onnx_training_plan(
        recurrence("none", "counter", F32),
        label="target",
        loss="mse",
        optimizer=SGD(0.1),
        batch_size=N,
        example_selector=SELECTOR,
    )
    work = onnx.load_from_string(made.plan.work)
    assert not any(n.op_type == "Loop" for n in work.graph.node)
    assert {"W", "U", "V"} <= set(made.plan.weight_names)


def test_two_loops_unroll_into_copies_of_distinct_names():
    """Two Loops of one body (a bidirectional layer's two directions) are unrolled under names of their own."""
    model = recurrence()
    loop = next(n for n in model.graph.node if n.op_type == "Loop")
    second = onnx.NodeProto()
    second.CopyFrom(loop)
    loop.name, second.name = "forward", "backward"
    second.output[:] = [f"{o}_second" for o in loop.output]
    model.graph.node.insert(list(model.graph.node).index(loop) + 1, second)
    mean = next(n for n in model.graph.node if n.op_type == "ReduceMean")
    mean.input[0] = "hs_second"
    x = np.random.default_rng(2).standard_normal((N, T, F))
    expected = _run(model, x)
    assert unroll_control_flow(model, "y") == ["forward", "backward"]
    np.testing.assert_allclose(_run(model, x), expected, rtol=1e-12)


def test_loops_nested_past_the_node_budget_are_refused_before_they_are_unrolled(monkeypatch):
    """Nested loops multiply their copies: a 1,000-step Loop in a 1,000-step Loop ran for minutes
    towards a million nodes. Here 12 steps of 12 against a budget of 100 nodes."""
    from emulator.toolchain import loops

    def body(prefix: str, inner: onnx.NodeProto | None) -> onnx.GraphProto:
        step = inner or helper.make_node("Mul", [f"{prefix}s_in", "w"], [f"{prefix}s_out"])
        value = helper.make_tensor_value_info
        return helper.make_graph(
            [helper.make_node("Identity", [f"{prefix}c_in"], [f"{prefix}c_out"]), step],
            prefix,
            [value(f"{prefix}i", TensorProto.INT64, []), value(f"{prefix}c_in", TensorProto.BOOL, [])]
            + [value(f"{prefix}s_in", TensorProto.FLOAT, ["N", 4])],
            [value(f"{prefix}c_out", TensorProto.BOOL, []), value(f"{prefix}s_out", TensorProto.FLOAT, ["N", 4])],
        )

    inner = helper.make_node("Loop", ["M", "T", "o_s_in"], ["o_s_out"], body=body("n_", None))
    graph = helper.make_graph(
        [helper.make_node("Loop", ["M", "T", "x"], ["y"], body=body("o_", inner))],
        "nested",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(np.array(12, np.int64), "M"), numpy_helper.from_array(np.array(True), "T")]
        + [numpy_helper.from_array(np.ones(4, np.float32), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert len(unroll_control_flow(onnx.ModelProto.FromString(model.SerializeToString()), "y")) == 13  # 1 + 12 inner
    monkeypatch.setattr(loops, "MAX_UNROLLED_NODES", 100)
    with pytest.raises(
        UnsupportedOpError, match="12 copies of a body of 2 nodes would take the unrolled graph past 100"
    ):
        unroll_control_flow(model, "y")
