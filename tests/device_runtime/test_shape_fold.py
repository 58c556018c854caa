"""The values a graph computes from its tensors' shapes, as the device computes them before a step
(``shape_fold``), are those onnxruntime computes when the step runs: a value computed wrong would
refuse an honest plan (too large) or pass a hostile one (too small). Checked on random chains of
the operators it computes, over inputs of random shapes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from hypothesis import given, note
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from device_runtime.shape_fold import MAX_FOLDED, fold_shape_values, slice_indices

OPSET = 17


@st.composite
def chains(draw):
    """(nodes, initializers, name of the last value, dims of x) for a chain of computed values."""
    dims = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=4)))
    nodes = [helper.make_node("Shape", ["x"], ["v0"]), helper.make_node("Size", ["x"], ["s0"])]
    values = {"v0": len(dims), "s0": None}  # name -> length (None: a scalar)
    inits = []
    for i in range(draw(st.integers(1, 8))):
        out, vectors = f"v{i + 1}", [n for n, size in values.items() if size is not None]
        op = draw(st.sampled_from(["Gather", "Slice", "Concat", "Arith", "Unsqueeze", "Cast", "Extreme"]))
        name = draw(st.sampled_from(vectors))
        if op == "Gather" and values[name] == 0:
            continue
        if op == "Gather":
            index = draw(st.integers(-values[name], values[name] - 1))
            scalar = draw(st.booleans())
            inits.append(numpy_helper.from_array(np.array(index if scalar else [index], np.int64), f"k{i}"))
            nodes.append(helper.make_node("Gather", [name, f"k{i}"], [out]))
            values[out] = None if scalar else 1
        elif op == "Slice":
            start, end = draw(st.integers(-12, 12)), draw(st.integers(-12, 12))
            step = draw(st.sampled_from([1, 2, -1, -2]))
            for suffix, v in (("start", start), ("end", end), ("step", step)):
                inits.append(numpy_helper.from_array(np.array([v], np.int64), f"k{i}_{suffix}"))
            nodes.append(helper.make_node("Slice", [name, f"k{i}_start", f"k{i}_end", "", f"k{i}_step"], [out]))
            values[out] = len(slice_indices(values[name], start, end, step))
        elif op == "Concat":
            other = draw(st.sampled_from(vectors))
            if values[name] + values[other] > MAX_FOLDED:
                continue
            nodes.append(helper.make_node("Concat", [name, other], [out], axis=0))
            values[out] = values[name] + values[other]
        elif op == "Arith":
            kind = draw(st.sampled_from(["Add", "Sub", "Mul", "Div"]))
            constant = draw(st.integers(-(10**6), 10**6).filter(lambda c: c != 0))
            inits.append(numpy_helper.from_array(np.array([constant], np.int64), f"k{i}"))
            nodes.append(helper.make_node(kind, [name, f"k{i}"], [out]))
            values[out] = values[name]
        elif op == "Extreme":
            other = draw(st.sampled_from([n for n in vectors if values[n] in (1, values[name])]))
            nodes.append(helper.make_node(draw(st.sampled_from(["Max", "Min"])), [name, other], [out]))
            values[out] = values[name]
        elif op == "Unsqueeze":  # a scalar made a vector of one
            scalars = [n for n, size in values.items() if size is None]
            inits.append(numpy_helper.from_array(np.array([0], np.int64), f"k{i}"))
            nodes.append(helper.make_node("Unsqueeze", [draw(st.sampled_from(scalars)), f"k{i}"], [out]))
            values[out] = 1
        else:
            nodes.append(helper.make_node("Cast", [name], [out], to=TensorProto.INT32))
            nodes.append(helper.make_node("Cast", [out], [f"{out}_64"], to=TensorProto.INT64))
            out = f"{out}_64"
            values[out] = values[name]
    last = next(reversed(values))
    return nodes, inits, last, dims


def test_slices_take_what_onnx_takes_not_what_python_takes():
    assert slice_indices(2, -3, -3, -1) == [0] and slice_indices(2, 0, 10, 1) == [0, 1]
    assert slice_indices(3, 10, -10, -1) == [2, 1, 0] and slice_indices(0, 0, 5, -1) == []


@given(chains())
def test_values_computed_from_shapes_are_those_onnxruntime_computes(chain):
    nodes, inits, last, dims = chain
    note(f"x of {dims}: " + "; ".join(f"{n.output[0]} = {n.op_type}({', '.join(n.input)})" for n in nodes))
    note(", ".join(f"{t.name} = {numpy_helper.to_array(t).tolist()}" for t in inits))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"] + [f"d{i}" for i in range(len(dims) - 1)])
    y = helper.make_tensor_value_info(last, TensorProto.INT64, None)
    graph = helper.make_graph(nodes, "shapes", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        [last], {"x": np.zeros(dims, np.float32)}
    )[0]
    folded_model, folded = fold_shape_values(onnx.ModelProto.FromString(model.SerializeToString()), {"x": dims})
    values = {t.name: numpy_helper.to_array(t) for t in folded_model.graph.initializer}
    if last not in values:  # only where an operand was empty (see shape_fold._arithmetic)
        assert any(numpy_helper.to_array(t).size == 0 for t in folded_model.graph.initializer)
        return
    assert folded > 0
    np.testing.assert_array_equal(values[last], expected)
    assert values[last].dtype == expected.dtype


def test_a_value_computed_from_the_examples_data_stays_unknown():
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["peak"], keepdims=0),
        helper.make_node("Cast", ["peak"], ["n"], to=TensorProto.INT64),
        helper.make_node("Shape", ["x"], ["dims"]),
        helper.make_node("Mul", ["dims", "n"], ["out"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph(nodes, "data", [x], [helper.make_tensor_value_info("out", TensorProto.INT64, None)])
    model, folded = fold_shape_values(helper.make_model(graph), {"x": (2, 3)})
    assert folded == 1 and [t.name for t in model.graph.initializer] == ["dims"]
