"""An ``If`` whose condition is known when the plan is made is replaced by its branch, and a ``Scan``
over a static length is unrolled, before differentiation.

Hand-built models (``onnx.helper``): an ``If`` choosing between ``tanh(x @ W)`` and
``sigmoid(x @ W) * 2`` on a constant condition or one computed from the input's static shape (as
torch's scripted conditionals and tf2onnx's ``tf.cond`` are), and a ``Scan`` recurrence
``h = tanh(x_t @ W + h @ U)`` scanning a sequence axis forwards or backwards, its steps stacked
along either axis in either direction. The rewritten graph computes what onnxruntime's ``If`` and
``Scan`` compute, and its generated gradient matches finite differences; an ``If`` on the data, a
``Scan`` over the batch axis and opset 8's ``Scan`` are refused in one line naming them.
"""

from __future__ import annotations

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


def vi(name: str, elem: int, shape=None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, inits, float_type: int, opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "model",
        inputs,
        [vi("y", float_type, ["N", 2])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def branching(condition: str = "const", float_type: int = F64) -> onnx.ModelProto:
    """``y = If(c, tanh(x @ W), sigmoid(x @ W) * 2) @ V`` with ``x`` of shape [N, F], the first
    branch reading the weight ``W`` from the outer scope, the second ``x @ W``.

    ``condition``: ``const`` (an initializer, false: the else branch), ``shape`` (x's static
    feature count equals F: the then branch), ``batch`` (x's batch exceeds 2: known at run time
    only) or ``data`` (x sums to more than 0)."""
    rng = np.random.default_rng(0)
    floats = helper.tensor_dtype_to_np_dtype(float_type)
    inits = {
        "W": rng.standard_normal((F, H)).astype(floats),
        "V": rng.standard_normal((H, 2)).astype(floats),
        "c": np.array(False),
        "at": np.array([1], dtype=np.int64),
        "at0": np.array([0], dtype=np.int64),
        "features": np.array([F], dtype=np.int64),
        "two": np.array([2], dtype=np.int64),
        "nothing": np.array(0.0, dtype=floats),
    }
    then = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw_then"]), helper.make_node("Tanh", ["xw_then"], ["h_then"])],
        "then",
        [],
        [vi("h_then", float_type, None)],
    )
    otherwise = helper.make_graph(  # reads x @ W computed outside it
        [
            helper.make_node("Sigmoid", ["xw"], ["s_else"]),
            helper.make_node("Mul", ["s_else", "scale"], ["h_else"]),
        ],
        "else",
        [],
        [vi("h_else", float_type, None)],
        [numpy_helper.from_array(np.array(2.0, dtype=floats), "scale")],
    )
    nodes = [helper.make_node("Shape", ["x"], ["x_shape"]), helper.make_node("MatMul", ["x", "W"], ["xw"])]
    if condition == "shape":
        nodes += [
            helper.make_node("Gather", ["x_shape", "at"], ["dim"], axis=0),
            helper.make_node("Equal", ["dim", "features"], ["c_vec"]),
            helper.make_node("Squeeze", ["c_vec", "at0"], ["c_now"]),
        ]
    elif condition == "batch":
        nodes += [
            helper.make_node("Gather", ["x_shape", "at0"], ["dim"], axis=0),
            helper.make_node("Greater", ["dim", "two"], ["c_vec"]),
            helper.make_node("Squeeze", ["c_vec", "at0"], ["c_now"]),
        ]
    elif condition == "data":
        nodes += [
            helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
            helper.make_node("Greater", ["total", "nothing"], ["c_now"]),
        ]
    cond = "c" if condition == "const" else "c_now"
    nodes += [
        helper.make_node("If", [cond], ["h"], name="choose", then_branch=then, else_branch=otherwise),
        helper.make_node("MatMul", ["h", "V"], ["y"]),
    ]
    return _model(nodes, [vi("x", float_type, ["N", F])], inits, float_type)


def scanning(
    axis: int = 1,
    reverse: int = 0,
    out_axis: int = 0,
    out_reverse: int = 0,
    float_type: int = F64,
    opset: int = 17,
) -> onnx.ModelProto:
    """``y = concat(last h, h at output step 0) @ V`` with ``x`` of shape [N, T, F] (``axis`` 1) or
    [T, N, F] (``axis`` 0, x transposed first), ``h`` scanned over the T axis (backwards with
    ``reverse``), every step's ``h`` stacked along ``out_axis`` of [N, H] (in reverse order with
    ``out_reverse``), the initial ``h`` of the batch's size. ``axis`` "batch" scans x's batch axis."""
    rng = np.random.default_rng(0)
    floats = helper.tensor_dtype_to_np_dtype(float_type)
    inits = {
        "W": rng.standard_normal((F, H)).astype(floats),
        "U": (rng.standard_normal((H, H)) * 0.5).astype(floats),
        "V": rng.standard_normal((2 * H, 2)).astype(floats),
        "h0": np.zeros((1, H), dtype=floats),
        "zero64": np.array([0], dtype=np.int64),
        "one64": np.array([1], dtype=np.int64),
        "h_dim": np.array([H], dtype=np.int64),
    }
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["x_t", "W"], ["xw"]),
            helper.make_node("MatMul", ["h_in", "U"], ["hu"]),
            helper.make_node("Add", ["xw", "hu"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["h_out"]),
            helper.make_node("Mul", ["h_out", "half"], ["h_step"]),
        ],
        "body",
        [vi("h_in", float_type, None), vi("x_t", float_type, None)],
        [vi("h_out", float_type, None), vi("h_step", float_type, None)],
        [numpy_helper.from_array(np.array(0.5, dtype=floats), "half")],
    )
    scan_axis = 1 if axis == 1 else 0
    sequence = "x" if axis != 0 else "xt"
    attrs = {"body": body, "num_scan_inputs": 1}
    if scan_axis:
        attrs["scan_input_axes"] = [scan_axis]
    if reverse:
        attrs["scan_input_directions"] = [1]
    if out_axis:
        attrs["scan_output_axes"] = [out_axis]
    if out_reverse:
        attrs["scan_output_directions"] = [1]
    if opset < 9:  # opset 8's Scan: sequence lengths first, every input of a batch axis of its own
        inputs = ["", "h0_n", sequence]
    else:
        inputs = ["h0_n", sequence]
    step_axis = out_axis % 3  # of the stacked [T, N, H], [N, T, H] or [N, H, T]
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Slice", ["x_shape", "zero64", "one64", "zero64"], ["batch_dim"]),
        helper.make_node("Concat", ["batch_dim", "h_dim"], ["nh"], axis=0),
        helper.make_node("Expand", ["h0", "nh"], ["h0_n"]),
        helper.make_node("Scan", inputs, ["h_last", "hs"], name="recur", **attrs),
        helper.make_node("Gather", ["hs", "zero64"], ["h_first_kept"], axis=step_axis),
        helper.make_node("Squeeze", ["h_first_kept", "axis_kept"], ["h_first"]),
        helper.make_node("Concat", ["h_last", "h_first"], ["features"], axis=1),
        helper.make_node("MatMul", ["features", "V"], ["y"]),
    ]
    inits["axis_kept"] = np.array([step_axis], dtype=np.int64)
    return _model(nodes, [vi("x", float_type, ["N", T, F])], inits, float_type, opset)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return make_session(model.SerializeToString()).run(["y"], {"x": x})[0]


def _check_rewritten(model: onnx.ModelProto, x: np.ndarray, done: list[str], weights: tuple[str, ...]) -> None:
    """``model`` rewritten computes what it computed, with no subgraph left, and its gradient with
    respect to ``x`` and ``weights`` matches finite differences."""
    expected = _run(model, x)
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    assert unroll_control_flow(rewritten, "y") == done
    assert not any(n.op_type in ("If", "Scan", "Loop") for n in rewritten.graph.node)
    np.testing.assert_allclose(_run(rewritten, x), expected, rtol=1e-12)
    values = {i.name: numpy_helper.to_array(i) for i in rewritten.graph.initializer if i.name in weights}
    kept = [i for i in rewritten.graph.initializer if i.name not in values]
    del rewritten.graph.initializer[:]
    rewritten.graph.initializer.extend(kept)
    rewritten.graph.input.extend(vi(k, F64, list(v.shape)) for k, v in values.items())
    rewritten = onnx.shape_inference.infer_shapes(rewritten)
    assert vjp_error(rewritten, {"x": x, **values}, ["x", *values]) < 1e-6


@pytest.mark.parametrize("condition", ["const", "shape"])
def test_an_if_of_a_condition_known_when_the_plan_is_made_is_its_branch(condition):
    _check_rewritten(branching(condition), np.random.default_rng(1).standard_normal((N, F)), ["choose"], ("W", "V"))


@pytest.mark.parametrize(
    "axis, reverse, out_axis, out_reverse",
    [(0, 0, 0, 0), (1, 1, 0, 0), (1, 0, 1, 1), (1, 1, -1, 0)],
)
def test_an_unrolled_scan_computes_what_the_scan_computes_and_its_gradient_matches_finite_differences(
    axis, reverse, out_axis, out_reverse
):
    x = np.random.default_rng(1).standard_normal((N, T, F))
    _check_rewritten(scanning(axis, reverse, out_axis, out_reverse), x, ["recur"], ("W", "U", "V"))


def test_the_steps_of_an_unrolled_scan_read_slices_of_the_sequence():
    """Each copy reads its step as a ``Slice`` (one ``Split`` once the plan's forward is written),
    never a ``Gather`` scattering its gradient into zeros of the whole sequence."""
    model = scanning(1, 1)
    unroll_control_flow(model, "y")
    slices = [n for n in model.graph.node if n.op_type == "Slice" and n.input[0] == "x"]
    assert len(slices) == T


def test_an_if_on_the_data_is_refused_in_one_line_naming_it():
    """Left in place by the rewrite (no gradient may cross it), it is refused where one must."""
    for condition in ("data", "batch"):
        model = branching(condition, F32)
        assert unroll_control_flow(model, "y") == []
        with pytest.raises(UnsupportedOpError) as refused:
            onnx_training_plan(
                model, label="target", loss="mse", optimizer=SGD(0.1), batch_size=N, example_selector=SELECTOR
            )
        message = str(refused.value)
        assert len(message.splitlines()) == 1
        assert message.startswith("op 'If' (node 'choose') runs a subgraph chosen at run time")
        assert "its condition is not known when the plan is made" in message and "Where" in message


def test_a_scan_over_the_batch_or_past_the_limit_is_refused_in_one_line():
    with pytest.raises(UnsupportedOpError) as refused:
        unroll_control_flow(scanning(axis="batch"), "y")  # type: ignore[arg-type]
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("op 'Scan' (node 'recur') its sequence length, axis 0 of 'x', is known only at run time")
    assert "fixed sequence length" in message
    with pytest.raises(UnsupportedOpError, match=f"it runs more than {T - 1} iterations"):
        unroll_control_flow(scanning(), "y", limit=T - 1)


def test_opset_8s_scan_is_refused_naming_it():
    with pytest.raises(UnsupportedOpError, match="op 'Scan' \\(node 'recur'\\) is opset 8's Scan"):
        onnx_training_plan(
            scanning(axis=0, float_type=F32, opset=8),
            label="target",
            loss="mse",
            optimizer=SGD(0.1),
            batch_size=N,
            example_selector=SELECTOR,
        )


@pytest.mark.parametrize("make", [lambda: branching("shape", F32), lambda: scanning(1, 1, 1, 0, F32)])
def test_a_plan_of_a_model_with_an_if_or_a_scan_trains_through_it(make):
    made = onnx_training_plan(
        make(), label="target", loss="mse", optimizer=SGD(0.1), batch_size=N, example_selector=SELECTOR
    )
    work = onnx.load_from_string(made.plan.work)
    assert not any(n.op_type in ("If", "Scan") for n in work.graph.node)
    assert {"W", "V"} <= set(made.plan.weight_names)


def test_an_if_on_a_loops_iteration_number_is_chosen_in_each_copy():
    """A scripted ``for t in range(T): h = tanh(x[t] @ W) if t == 0 else tanh(x[t] @ W + h @ U)``:
    the Loop's copies read constant iteration numbers, so each copy's If is its branch."""
    rng = np.random.default_rng(0)
    inits = {
        "W": rng.standard_normal((F, H)),
        "U": rng.standard_normal((H, H)) * 0.5,
        "V": rng.standard_normal((H, 2)),
        "h0": np.zeros((1, H)),
        "T": np.array(T, dtype=np.int64),
        "yes": np.array(True),
    }
    first = helper.make_graph([helper.make_node("Tanh", ["xw"], ["h_first"])], "first", [], [vi("h_first", F64, None)])
    later = helper.make_graph(
        [
            helper.make_node("MatMul", ["h_in", "U"], ["hu"]),
            helper.make_node("Add", ["xw", "hu"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["h_later"]),
        ],
        "later",
        [],
        [vi("h_later", F64, None)],
    )
    body = helper.make_graph(
        [
            helper.make_node("Gather", ["xt", "i"], ["x_i"], axis=0),
            helper.make_node("MatMul", ["x_i", "W"], ["xw"]),
            helper.make_node("Equal", ["i", "zero"], ["is_first"]),
            helper.make_node("If", ["is_first"], ["h_out"], name="step", then_branch=first, else_branch=later),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [vi("i", TensorProto.INT64, []), vi("cond_in", TensorProto.BOOL, []), vi("h_in", F64, None)],
        [vi("cond_out", TensorProto.BOOL, []), vi("h_out", F64, None)],
        [numpy_helper.from_array(np.array(0, dtype=np.int64), "zero")],
    )
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
        helper.make_node("Loop", ["T", "yes", "h0"], ["h_last"], name="steps", body=body),
        helper.make_node("MatMul", ["h_last", "V"], ["y"]),
    ]
    model = _model(nodes, [vi("x", F64, ["N", T, F])], inits, F64)
    x = np.random.default_rng(1).standard_normal((N, T, F))
    _check_rewritten(model, x, ["steps", *(f"step_{t}" for t in range(T))], ("W", "U", "V"))
