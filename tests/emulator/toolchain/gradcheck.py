"""Checks a model's generated vector-Jacobian product against central finite differences."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper

from device_runtime.executor import make_session
from emulator.toolchain import vjp_model
from emulator.toolchain.autodiff import Emitter, constant_values, tensor_infos
from emulator.toolchain.forward import training_forward


def single_op_model(
    op_type: str,
    inputs: Mapping[str, np.ndarray],
    constants: Mapping[str, np.ndarray] | None = None,
    *,
    outputs: Sequence[str] = ("y",),
    opset: int = 17,
    **attrs,
) -> onnx.ModelProto:
    """One node over graph inputs (the differentiated ones) and constant initializers (``""`` keeps an
    optional input empty)."""
    constants = dict(constants or {})
    order = list(attrs.pop("order", [*inputs, *constants]))
    node = helper.make_node(op_type, order, list(outputs), name=f"the_{op_type}", **attrs)
    graph_inputs = [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
        for k, v in inputs.items()
    ]
    inits = [onnx.numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items() if k]
    graph = helper.make_graph(
        [node], "one_op", graph_inputs, [helper.make_tensor_value_info(o, 0, None) for o in outputs], initializer=inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    for out in model.graph.output:  # an op onnx cannot infer (GroupNormalization): typed and shaped as its first input
        if out.type.tensor_type.elem_type == 0:
            out.type.CopyFrom(graph_inputs[0].type)
    return model


def training_forward_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its nodes rewritten as a training plan runs them (:func:`training_forward`),
    shapes inferred: the rewritten forward is then differentiated node by node like any model."""
    g = model.graph
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    taken = (
        {t for n in g.node for t in [*n.input, *n.output]} | {i.name for i in g.input} | {i.name for i in g.initializer}
    )
    e = Emitter(opset, tensor_infos(model), constant_values(g), taken)
    nodes = training_forward(e, list(g.node), {i.name for i in g.initializer}).nodes
    for node in nodes:  # apart from the names the differentiating emitter gives its nodes
        node.name = f"forward/{node.name}"
    graph = helper.make_graph(
        nodes, g.name, list(g.input), list(g.output), initializer=[*g.initializer, *e.initializers]
    )
    out = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    return onnx.shape_inference.infer_shapes(out, strict_mode=True)


def vjp_error(
    model: onnx.ModelProto,
    values: Mapping[str, np.ndarray],
    wrt: Sequence[str],
    *,
    outputs: Sequence[str] | None = None,
    seed: int = 0,
    eps: float = 1e-6,
    directions: int = 2,
) -> float:
    """Largest relative gap between <grad, v> and the central difference of <seed, f> along random
    directions v (one pair of forward runs per direction)."""
    outputs = list(outputs or [o.name for o in model.graph.output])
    rng = np.random.default_rng(seed)
    forward = make_session(model.SerializeToString())
    base = dict(zip(outputs, forward.run(outputs, dict(values))))
    seeds = {o: np.asarray(rng.standard_normal(np.shape(base[o])), dtype=base[o].dtype) for o in outputs}
    grad_model = vjp_model(model, outputs=outputs, wrt=wrt)
    feeds = dict(values)
    feeds.update({f"seed/{o}": s for o, s in seeds.items()})
    grads = dict(zip(wrt, make_session(grad_model.SerializeToString()).run([f"grad/{w}" for w in wrt], feeds)))
    worst = 0.0
    for _ in range(directions):
        v = {w: np.asarray(rng.standard_normal(np.shape(values[w])), dtype=values[w].dtype) for w in wrt}
        plus = dict(values)
        minus = dict(values)
        for w in wrt:
            plus[w] = np.asarray(values[w] + eps * v[w], dtype=values[w].dtype)
            minus[w] = np.asarray(values[w] - eps * v[w], dtype=values[w].dtype)
        fp = forward.run(outputs, plus)
        fm = forward.run(outputs, minus)
        numeric = sum(float(np.sum(seeds[o] * (a - b))) for o, a, b in zip(outputs, fp, fm)) / (2 * eps)
        analytic = sum(float(np.sum(grads[w] * v[w])) for w in wrt)
        worst = max(worst, abs(numeric - analytic) / max(1.0, abs(numeric), abs(analytic)))
    return worst
