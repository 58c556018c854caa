"""The deploy-time smoke test: a plan whose graphs load but do not run on onnxruntime is refused
with a PlanError naming the graph; a good plan and its evaluation twin pass."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from device_runtime import Plan, PlanError, build_eval_plan, initial_weights, load_plan, serialize_plan
from device_runtime.executor import PlanExecutor
from tests.support import digits_plan


def unrunnable(model_bytes: bytes, output: str | None = None) -> bytes:
    """The model with ``output`` (default: its first) passed through ``Add(output, ConstantOfShape(s))``
    where ``s = [-1 - |sum(output)|]``: the ONNX checker accepts it, onnxruntime does not run it
    (at session creation when ``output`` is a constant, at run time otherwise)."""
    model = onnx.ModelProto.FromString(model_bytes)
    graph = model.graph
    out = output or graph.output[0].name
    ok = f"{out}__ok"
    elem = next(o.type.tensor_type.elem_type for o in graph.output if o.name == out)
    zero = np.zeros(1, dtype=helper.tensor_dtype_to_np_dtype(elem))
    for node in graph.node:
        node.output[:] = [ok if o == out else o for o in node.output]
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([-1], dtype=np.int64), "__minus_one"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "__one_dim"),
        ]
    )
    graph.node.extend(
        [
            helper.make_node("ReduceSum", [ok], ["__sum"], keepdims=1),
            helper.make_node("Reshape", ["__sum", "__one_dim"], ["__sum1"]),
            helper.make_node("Cast", ["__sum1"], ["__isum"], to=TensorProto.INT64),
            helper.make_node("Abs", ["__isum"], ["__abs"]),
            helper.make_node("Sub", ["__minus_one", "__abs"], ["__bad_shape"]),
            helper.make_node("ConstantOfShape", ["__bad_shape"], ["__bad"], value=numpy_helper.from_array(zero)),
            helper.make_node("Add", [ok, "__bad"], [out]),
        ]
    )
    onnx.checker.check_model(model)
    return model.SerializeToString()


def with_graph(plan: Plan, which: str, model_bytes: bytes) -> Plan:
    """``plan`` with one graph replaced (the Plan and its ServerPart are frozen)."""
    if which == "work":
        return dataclasses.replace(plan, work=model_bytes)
    return dataclasses.replace(plan, server=dataclasses.replace(plan.server, **{which: model_bytes}))


def broken_zero_plan(plan: Plan | None = None) -> Plan:
    plan = plan or digits_plan()
    return with_graph(plan, "zero", unrunnable(plan.server.zero))


@pytest.mark.parametrize("kind", ["softmax", "mlp"])
def test_a_good_plan_and_its_eval_twin_pass(kind):
    plan = digits_plan(kind)
    weights = initial_weights(plan, seed=0)
    for p in (plan, build_eval_plan(plan)):
        PlanExecutor(p).smoke_test(weights)
        PlanExecutor(load_plan(serialize_plan(p))).smoke_test(weights)


@pytest.mark.parametrize("which", ["zero", "accumulate", "merge", "report", "update", "prepare", "work"])
@pytest.mark.parametrize("kind", ["train", "eval"])
def test_a_plan_that_loads_but_does_not_run_is_refused_naming_the_graph(which, kind):
    plan = digits_plan()
    plan = plan if kind == "train" else build_eval_plan(plan)
    broken = with_graph(plan, which, unrunnable(plan.graphs()[which]))
    broken = load_plan(serialize_plan(broken))  # it loads: only running it shows the defect
    with pytest.raises(PlanError, match=rf"graph '{which}' does not run on onnxruntime: .*ConstantOfShape"):
        PlanExecutor(broken).smoke_test(initial_weights(plan, seed=0))


def _identity_graph(name: str, inputs: dict[str, list], outputs: dict[str, tuple[str, list]], opset: int) -> bytes:
    """A graph whose outputs are Identity of inputs: ``outputs`` maps name -> (input, declared shape)."""
    nodes = [helper.make_node("Identity", [src], [dst]) for dst, (src, _) in outputs.items()]
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, (_, s) in outputs.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(model)
    return model.SerializeToString()


def test_an_update_graph_that_drops_a_weight_is_refused():
    plan = digits_plan()
    opset = plan.metadata.opset
    # returns w0 only: b0 is silently missing from every new model
    update = _identity_graph("update", {"state/w0": [64, 10], "state/b0": [10]}, {"w0": ("state/w0", [64, 10])}, opset)
    broken = with_graph(plan, "update", update)
    with pytest.raises(PlanError, match=r"graph 'update' returns \['w0'\]: missing \['b0'\]"):
        PlanExecutor(broken).smoke_test(initial_weights(plan, seed=0))


def test_a_zero_graph_whose_outputs_break_the_accumulator_spec_is_refused():
    plan = digits_plan()
    # the same names and dtypes as the plan's zero, but b0 is declared and made [1, 10], not [10]
    good = PlanExecutor(plan).zero()
    arrays = {n: np.zeros((1, 10) if n == "b0" else v.shape, dtype=v.dtype) for n, v in good.items()}
    graph = helper.make_graph(
        [helper.make_node("Identity", [f"{n}__c"], [n]) for n in arrays],
        "zero",
        [],
        [
            helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
            for n, a in arrays.items()
        ],
        initializer=[numpy_helper.from_array(a, f"{n}__c") for n, a in arrays.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", plan.metadata.opset)], ir_version=8)
    broken = with_graph(plan, "zero", model.SerializeToString())
    dtype = good["b0"].dtype
    with pytest.raises(
        PlanError, match=rf"graph 'zero' returns 'b0' as {dtype}\[1, 10\], the plan promises {dtype}\[10\]"
    ):
        PlanExecutor(broken).smoke_test(initial_weights(plan, seed=0))


def test_weights_that_do_not_fit_the_plan_are_refused():
    plan = digits_plan()
    weights = initial_weights(plan, seed=0)
    with pytest.raises(PlanError, match="missing"):
        PlanExecutor(plan).smoke_test({"w0": weights["w0"]})
