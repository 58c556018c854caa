"""A ``Loop`` whose trip count is known when the plan is made, unrolled into copies of its body.

No gradient rule differentiates a subgraph, and exporters write some recurrences as a ``Loop``:
tf2onnx writes Keras's SimpleRNN, GRU(reset_after=False), masked LSTM and GRU
(``Embedding(mask_zero=True)``, ``Masking``) and Keras 3's GRU as a TensorFlow ``while`` loop, whose
condition compares a counter it carries to the sequence length it also carries (both constants
when the sequence axis is fixed, ``Input(shape=(20,))``); torch's classic exporter writes a scripted
``for t in range(x.size(1))`` as a Loop of trip count ``x.size(1)``. :func:`unroll_loops` runs each
Loop's control, what its condition is computed from, when the plan is made, and writes the Loop as
that many copies of its body: every carried value the control needs is a constant in each copy (the
counter's ``Gather`` of a time step becomes a ``Slice``, and the steps' Slices one ``Split``), the
others flow from one copy to the next, and each scan output is the copies' values stacked along a
new axis 0, as ``Loop`` stacks them. The rules then differentiate the copies as any other ops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from .emitter import DEFAULT_DOMAINS, UnsupportedOpError, node_reads, own_names, subgraphs
from .old_opsets import namer

#: The most copies of a body a Loop is unrolled into.
MAX_UNROLLED = 1000
#: What the unknown dimensions of a shape a trip count is folded from are set to, in two runs: a
#: trip count that differs between them depends on a dimension known only at run time.
_SENTINELS = (7, 11)
_FIX = (
    "export the recurrence over a fixed sequence length (a Keras Input(shape=(length, ...)), torch's example "
    "at the length it trains on), with the batch axis alone dynamic, or as an ONNX LSTM or GRU op"
)


def _refuse(node: onnx.NodeProto, why: str) -> UnsupportedOpError:
    return UnsupportedOpError(node.op_type, node.name or node.output[0], f"{why}; {_FIX}")


def _defined(graph: onnx.GraphProto) -> set[str]:
    """Every name ``graph`` and its subgraphs define."""
    names = own_names(graph)
    for node in graph.node:
        for g in subgraphs(node):
            names |= _defined(g)
    return names


def _cone(
    nodes: Sequence[onnx.NodeProto], targets: Iterable[str], shapes: bool = False
) -> tuple[list[onnx.NodeProto], set[str]]:
    """The nodes (in order) ``targets`` are computed from, and every name they read or are; with
    ``shapes``, not what a ``Shape`` or ``Size`` reads the shape of."""
    needed = set(targets)
    kept = []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            kept.append(node)
            if not (shapes and node.op_type in ("Shape", "Size")):
                needed |= node_reads(node)
    return kept[::-1], needed


def _program(
    nodes: Sequence[onnx.NodeProto],
    values: Mapping[str, np.ndarray],
    outputs: Sequence[str],
    opsets: Sequence[onnx.OperatorSetIdProto],
    fed: Sequence[str] = (),
) -> Callable[[Mapping[str, np.ndarray]], list[Any]]:
    """``outputs`` of ``nodes`` as a function of the ``fed`` names' values, ``values`` holding what
    else they read, by onnx's reference evaluator."""
    graph = helper.make_graph(
        list(nodes),
        "control",
        [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in fed],
        [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in values.items()],
    )
    evaluator = ReferenceEvaluator(helper.make_model(graph, opset_imports=opsets))
    return lambda feeds: list(evaluator.run(None, dict(feeds)))


class _Outer:
    """Values of a graph's tensors computed from constants and static shapes alone."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        graph = model.graph
        self.constants = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
        self.inputs = {i.name for i in graph.input} - set(self.constants)
        inferred = onnx.shape_inference.infer_shapes(model)
        self.shapes: dict[str, list[int | None]] = {}
        for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
            t = v.type.tensor_type
            if t.HasField("shape"):
                self.shapes[v.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]

    def value(self, name: str, before: Sequence[onnx.NodeProto]) -> tuple[np.ndarray | None, str]:
        """``name``'s value from the nodes ``before`` it, or None and why not: it depends on the
        data, or on a dimension known only at run time (the batch, a sequence length of None)."""
        if name in self.constants:
            return self.constants[name], ""
        nodes, read = _cone(before, [name], shapes=True)
        if name not in {o for n in nodes for o in n.output}:
            return None, "it is an input of the model"
        results = []
        for sentinel in _SENTINELS:
            program, values = [], {n: self.constants[n] for n in read if n in self.constants}
            for node in nodes:
                if node.op_type in ("Shape", "Size"):
                    dims = self.shapes.get(node.input[0])
                    if dims is None:
                        return None, f"the shape of {node.input[0]!r} is not known when the plan is made"
                    shape = np.array([sentinel if d is None else d for d in dims], dtype=np.int64)
                    if node.op_type == "Size":
                        shape = np.array(np.prod(shape), dtype=np.int64)
                    else:
                        attrs = {a.name: a.i for a in node.attribute}
                        shape = shape[attrs.get("start", 0) : attrs.get("end", len(shape))]
                    values[node.output[0]] = shape
                elif set(node.input) & self.inputs or node.op_type.startswith("Random"):
                    return None, "it is computed from the model's input data"
                else:
                    program.append(node)
            if name in values:
                results.append(values[name])
            else:
                results.append(_program(program, values, [name], self.model.opset_import)({})[0])
        if not np.array_equal(results[0], results[1]):
            return None, "it depends on a dimension known only at run time (the batch, or a sequence length of None)"
        return results[0], ""


def unroll_loops(model: onnx.ModelProto, prediction: str, limit: int = MAX_UNROLLED) -> list[str]:
    """Each ``Loop`` of the main graph the ``prediction`` is computed from, unrolled in place (see the
    module's docstring); returns their names. One whose trip count is not known when the plan is made
    (it depends on the input data, or on the batch or a sequence length of None), whose condition
    depends on the data, or that would take more than ``limit`` copies is refused in one line
    naming the Loop, why, and what to export instead."""
    done: list[str] = []
    while True:
        graph = model.graph
        nodes = list(graph.node)
        needed = _cone(nodes, [prediction])[1]
        at = next(
            (
                k
                for k, n in enumerate(nodes)
                if n.op_type == "Loop" and n.domain in DEFAULT_DOMAINS and set(n.output) & needed
            ),
            None,
        )
        if at is None:
            return done
        loop = nodes[at]
        copies = _unrolled(model, loop, nodes[:at], nodes[at + 1 :], limit)
        del graph.node[:]
        graph.node.extend([*nodes[:at], *copies, *nodes[at + 1 :]])
        done.append(loop.name or loop.output[0])


def _unrolled(
    model: onnx.ModelProto,
    loop: onnx.NodeProto,
    before: Sequence[onnx.NodeProto],
    after: Sequence[onnx.NodeProto],
    limit: int,
) -> list[onnx.NodeProto]:
    """The nodes that compute ``loop``'s outputs without it."""
    graph = model.graph
    body = next(a.g for a in loop.attribute if a.name == "body")
    outer = _Outer(model)
    inputs = [*loop.input, *[""] * (2 - len(loop.input))]
    carried_init = inputs[2:]
    n_carried = len(carried_init)
    iter_in, cond_in, *carried_in = [i.name for i in body.input]
    cond_out, *rest = [o.name for o in body.output]
    carried_out, scan_out = rest[:n_carried], rest[n_carried:]
    body_nodes = list(body.node)
    body_consts = {i.name: numpy_helper.to_array(i) for i in body.initializer}

    # The control: the carried values the condition is computed from, closed over their updates.
    control: set[int] = set()
    targets = [cond_out]
    while True:
        read = _cone(body_nodes, targets)[1]
        more = {k for k, name in enumerate(carried_in) if name in read} - control
        if not more:
            break
        control |= more
        targets = [cond_out, *(carried_out[k] for k in sorted(control))]
    control_nodes, read = _cone(body_nodes, targets)
    made = {o for n in control_nodes for o in n.output} | set(body_consts) | {iter_in, cond_in, *carried_in}
    fixed: dict[str, np.ndarray] = {}
    for name in sorted(read - made):  # outer-scope names the control reads
        value, why = outer.value(name, before)
        if value is None:
            raise _refuse(loop, f"its condition depends on {name!r}, which is not known when the plan is made: {why}")
        fixed[name] = value
    states: dict[int, np.ndarray] = {}
    for k in sorted(control):
        value, why = outer.value(carried_init[k], before)
        if value is None:
            raise _refuse(
                loop,
                f"its condition depends on the loop-carried value {carried_in[k]!r}, whose initial value "
                f"{carried_init[k]!r} is not known when the plan is made: {why}",
            )
        states[k] = value

    trips: int | None = None
    if inputs[0]:
        value, why = outer.value(inputs[0], before)
        if value is None:
            raise _refuse(loop, f"its trip count {inputs[0]!r} is not known when the plan is made: {why}")
        trips = int(value)
    cond = True
    if inputs[1]:
        value, why = outer.value(inputs[1], before)
        if value is None:
            raise _refuse(loop, f"its condition {inputs[1]!r} is not known when the plan is made: {why}")
        cond = bool(value)

    # Run the control to find the trip count and, per iteration, the carried values it fixes.
    per_step: list[dict[int, np.ndarray]] = []
    fed = [iter_in, cond_in, *(carried_in[k] for k in sorted(control))]
    outputs = [cond_out, *(carried_out[k] for k in sorted(control))]
    run = _program(control_nodes, {**fixed, **body_consts}, outputs, model.opset_import, fed)
    while cond and (trips is None or len(per_step) < trips):
        if len(per_step) >= limit:
            raise _refuse(
                loop, f"it runs more than {limit} iterations, which would unroll into as many copies of its body"
            )
        step = len(per_step)
        per_step.append(dict(states))
        feeds = {iter_in: np.array(step, dtype=np.int64), cond_in: np.array(cond)}
        outs = run({**feeds, **{carried_in[k]: v for k, v in states.items()}})
        cond = bool(outs[0])
        states = dict(zip(sorted(control), outs[1:]))
    if not per_step:
        raise _refuse(loop, "it runs no iteration when the plan is made")

    # Which body outputs each copy must compute: backwards from the Loop's outputs that are read.
    read_after = set().union(*(node_reads(n) for n in after)) | {o.name for o in graph.output}
    loop_carried_outs, loop_scans = list(loop.output[:n_carried]), list(loop.output[n_carried:])
    wanted: list[set[str]] = [set() for _ in per_step]
    wanted_carried = {k for k in range(n_carried) if k not in control and loop_carried_outs[k] in read_after}
    wanted_scans = [j for j, o in enumerate(loop_scans) if o in read_after]
    for t in reversed(range(len(per_step))):
        targets = [carried_out[k] for k in sorted(wanted_carried)] + [scan_out[j] for j in wanted_scans]
        wanted[t] = set(targets)
        read = _cone(body_nodes, targets)[1]
        wanted_carried = {k for k in range(n_carried) if k not in control and carried_in[k] in read}

    fresh = namer(graph)
    for node in graph.node:  # node names, and the names other subgraphs define, are taken too
        if node.name:
            fresh(node.name)
        for g in subgraphs(node):
            for name in _defined(g):
                fresh(name)
    base = (loop.name or loop.output[0]).replace("/", "_")
    known: dict[str, np.ndarray] = {}  # constant made -> its value
    by_value: dict[tuple[str, tuple[int, ...], bytes], str] = {}

    def constant(value: np.ndarray, hint: str) -> str:
        """An initializer holding ``value`` (one per value)."""
        value = np.asarray(value)
        key = (value.dtype.str, value.shape, value.tobytes())
        if key not in by_value:
            by_value[key] = fresh(hint)
            graph.initializer.append(numpy_helper.from_array(value, by_value[key]))
            known[by_value[key]] = value
        return by_value[key]

    def step_read(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        """A ``Gather`` of one position a copy fixes (the time step a counter reads) as the ``Slice``
        and ``Squeeze`` it is: the Slices of every step cut the sequence into consecutive pieces, which
        become one ``Split`` (one Concat of the steps' gradients, where each Gather's would scatter
        into zeros of the whole sequence)."""
        index = known.get(node.input[1]) if node.op_type == "Gather" and len(node.input) == 2 else None
        if index is None or index.ndim != 0 or int(index) < 0:
            return None
        axis, at = int(next((a.i for a in node.attribute if a.name == "axis"), 0)), int(index)
        piece = fresh(f"{node.output[0]}_piece")
        bounds = [
            constant(np.array([v], dtype=np.int64), f"{base}_{hint}")
            for v, hint in ((at, "start"), (at + 1, "end"), (axis, "axis"))
        ]
        return [
            helper.make_node(
                "Slice", [node.input[0], *bounds], [piece], name=fresh(f"{node.name}_slice") if node.name else ""
            ),
            helper.make_node("Squeeze", [piece, bounds[2]], list(node.output), name=node.name),
        ]

    out: list[onnx.NodeProto] = []
    carried = list(carried_init)
    scans: list[list[str]] = [[] for _ in scan_out]
    for t, fixed_states in enumerate(per_step):
        copied, read = _cone(body_nodes, wanted[t])
        names = {name: constant(value, f"{base}_{name}") for name, value in body_consts.items() if name in read}
        if iter_in in read:
            names[iter_in] = constant(np.array(t, dtype=np.int64), f"{base}_iteration_{t}")
        if cond_in in read:  # true: the copy runs
            names[cond_in] = constant(np.array(True), f"{base}_condition")
        for k, name in enumerate(carried_in):
            if name in read:
                names[name] = constant(fixed_states[k], f"{name}_{t}") if k in fixed_states else carried[k]
        for sub in copied:
            for o in sub.output:
                names[o] = fresh(f"{o}_{t}")
            copy = _renamed(sub, names, fresh(f"{sub.name}_{t}") if sub.name else "")
            out.extend(step_read(copy) or [copy])
        carried = [names.get(carried_out[k], carried_out[k]) if k not in fixed_states else "" for k in range(n_carried)]
        for j in wanted_scans:
            scans[j].append(names.get(scan_out[j], scan_out[j]))
    for k, name in enumerate(loop_carried_outs):  # a counter's last value is known; a state is the last copy's
        if name in read_after and k in control:
            out.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(states[k]))))
        elif name in read_after:
            out.append(helper.make_node("Identity", [carried[k]], [name]))
    axes = constant(np.array([0], dtype=np.int64), f"{base}_scan_axis")  # plans are of opset 13 or later
    for j in wanted_scans:
        rows = []
        for step_value in scans[j]:
            rows.append(fresh(f"{step_value}_row"))
            out.append(helper.make_node("Unsqueeze", [step_value, axes], [rows[-1]]))
        out.append(helper.make_node("Concat", rows, [loop_scans[j]], axis=0, name=fresh(f"{loop.name}_scan_{j}")))
    return out


def _renamed(node: onnx.NodeProto, names: dict[str, str], name: str) -> onnx.NodeProto:
    """A copy of ``node`` reading and writing ``names``' renaming (its subgraphs' outer-scope names too)."""
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.name = name
    copy.input[:] = [names.get(i, i) if i else i for i in node.input]
    copy.output[:] = [names.get(o, o) for o in node.output]
    for g in subgraphs(copy):
        _rename_outer(g, names)
    return copy


def _rename_outer(graph: onnx.GraphProto, names: dict[str, str]) -> None:
    """``graph``'s reads of names it does not define renamed, in place, down its own subgraphs."""
    own = own_names(graph)
    outer = {k: v for k, v in names.items() if k not in own}
    for node in graph.node:
        node.input[:] = [outer.get(i, i) if i else i for i in node.input]
        for g in subgraphs(node):
            _rename_outer(g, outer)
    for o in graph.output:
        if o.name in outer:
            o.name = outer[o.name]
