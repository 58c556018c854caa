"""Control flow known when the plan is made, written as the ops it runs before differentiation.

No gradient rule differentiates a subgraph, and exporters write some recurrences as a ``Loop``:
tf2onnx writes Keras's SimpleRNN, GRU(reset_after=False), masked LSTM and GRU
(``Embedding(mask_zero=True)``, ``Masking``) and Keras 3's GRU as a TensorFlow ``while`` loop, whose
condition compares a counter it carries to the sequence length it also carries (both constants
when the sequence axis is fixed, ``Input(shape=(20,))``); torch's classic exporter writes a scripted
``for t in range(x.size(1))`` as a Loop of trip count ``x.size(1)``. :func:`unroll_control_flow` runs
each Loop's control, what its condition is computed from, when the plan is made, and writes the Loop
as that many copies of its body: every carried value the control needs is a constant in each copy
(the counter's ``Gather`` of a time step becomes a ``Slice``, and the steps' Slices one ``Split``),
the others flow from one copy to the next, and each scan output is the copies' values stacked along
a new axis 0, as ``Loop`` stacks them.

A ``Scan`` (opset 9 and later) over a sequence axis of static length is written the same way, a
copy of its body per position: each copy reads its position of every scan input (a ``Slice`` along
its ``scan_input_axes``, from the end with ``scan_input_directions``), the states flow from one copy
to the next, and each scan output is the copies' values stacked along its ``scan_output_axes`` (in
reverse order with ``scan_output_directions``). An ``If`` whose condition is known when the plan is
made (a constant, or computed from constants and static shapes: torch's scripted conditionals on
``x.size(1)``, tf2onnx's ``tf.cond`` on a static shape) is replaced by the nodes of the branch it
takes. What a copy brings into the main graph (an ``If`` on a Loop's iteration number, a ``Loop``
in a branch) is rewritten in turn. The rules then differentiate the copies as any other ops.

A value is known when the plan is made when it is computed from constants and the static dimensions
of shapes alone: it is computed with the unknown dimensions (the batch, a sequence length of None)
set to two values, which must give the same result, and no element of it may be computed from such a
dimension (:func:`_unknown_dims`: ``x.size(1) == 3`` is known, ``x.size(0) > 2`` is not).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cached_property
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from .emitter import DEFAULT_DOMAINS, UnsupportedOpError, attr, default_opset, namer, node_reads, own_names, subgraphs

#: The most copies of a body a Loop is unrolled into.
MAX_UNROLLED = 1000
#: The most nodes the main graph may hold once unrolled: loops nested in loops multiply their
#: copies (a 1,000-step Loop in a 1,000-step Loop ran for minutes towards a million nodes).
MAX_UNROLLED_NODES = 200_000
#: What the unknown dimensions of a shape a trip count is folded from are set to, in two runs: a
#: trip count that differs between them depends on a dimension known only at run time.
_SENTINELS = (7, 11)
_FIX = (
    "export the recurrence over a fixed sequence length (a Keras Input(shape=(length, ...)), torch's example "
    "at the length it trains on), with the batch axis alone dynamic, or as an ONNX LSTM or GRU op"
)


#: torch's nn.EmbeddingBag, which both exporters write as a Loop over its bags (the batch)
_BAGS_FIX = (
    "torch's nn.EmbeddingBag exports as this Loop over its bags: `fedfleet plan from-torch` exports bags of one "
    "length (a 2-D input, no offsets) as a lookup and a reduction, or write them as nn.Embedding and "
    ".sum(1), .mean(1) or .amax(1)"
)


def _refuse(node: onnx.NodeProto, why: str) -> UnsupportedOpError:
    """A refusal naming ``node`` and ``why``, with the way round it: the dynamo exporter's Loop for
    ``aten.embedding_bag`` (its FX node in the node's metadata) has its own."""
    origin = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.fx_node"), "")
    fix = _BAGS_FIX if "torch.ops.aten.embedding_bag" in origin else _FIX
    return UnsupportedOpError(node.op_type, node.name or node.output[0], f"{why}; {fix}")


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

    def __init__(self, model: Callable[[], onnx.ModelProto], producers: Mapping[str, onnx.NodeProto]) -> None:
        self.model = model  # the model as it is now
        graph = model().graph
        self.opsets = list(model().opset_import)
        self.producers = producers  # tensor -> the node computing it
        self._initializers = {i.name: i for i in graph.initializer}
        self._constants: dict[str, np.ndarray] = {}
        self.inputs = {i.name for i in graph.input} - set(self._initializers)

    def made(self, name: str, value: np.ndarray) -> None:
        """An initializer ``name`` of ``value`` added to the graph."""
        self._constants[name] = value

    def constant(self, name: str) -> np.ndarray | None:
        """The value of the initializer ``name``, None if there is none (read when first asked for:
        an If in each of a thousand copies folds its condition without reading every weight)."""
        if name not in self._constants and name in self._initializers:
            self._constants[name] = numpy_helper.to_array(self._initializers[name])
        return self._constants.get(name)

    @cached_property
    def shapes(self) -> dict[str, list[int | None]]:
        """Each tensor's inferred dimensions, None where not static (inferred when first needed,
        again after the graph changed)."""
        inferred = onnx.shape_inference.infer_shapes(self.model())
        shapes = {}
        for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
            t = v.type.tensor_type
            if t.HasField("shape"):
                shapes[v.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        return shapes

    def _cone(self, name: str) -> tuple[list[onnx.NodeProto], set[str]]:
        """:func:`_cone` of ``name`` with ``shapes``, followed from node to node through the
        producers (a thousand copies of a body each fold a condition without reading the graph)."""
        nodes: list[onnx.NodeProto] = []
        read, seen = {name}, set()
        stack: list[tuple[str, bool]] = [(name, False)]
        while stack:  # depth first, each node after the nodes it reads
            tensor, ready = stack.pop()
            node = self.producers.get(tensor)
            if node is None or id(node) in seen and not ready:
                continue
            if ready:
                nodes.append(node)
                continue
            seen.add(id(node))
            stack.append((tensor, True))
            inputs = set() if node.op_type in ("Shape", "Size") else node_reads(node)
            read |= inputs
            stack.extend((i, False) for i in sorted(inputs))
        return nodes, read

    def value(self, name: str) -> tuple[np.ndarray | None, str]:
        """``name``'s value, or None and why not: it depends on the data, or on a dimension known
        only at run time (the batch, a sequence length of None)."""
        if (known := self.constant(name)) is not None:
            return known, ""
        nodes, read = self._cone(name)
        if not nodes:
            return None, "it is an input of the model"
        results, masks = [], {}
        for sentinel in _SENTINELS:
            program, values = [], {n: v for n in read if (v := self.constant(n)) is not None}
            for node in nodes:
                if node.op_type in ("Shape", "Size"):
                    dims = self.shapes.get(node.input[0])
                    if dims is None:
                        return None, f"the shape of {node.input[0]!r} is not known when the plan is made"
                    unknown = np.array([d is None for d in dims])
                    shape = np.array([sentinel if d is None else d for d in dims], dtype=np.int64)
                    if node.op_type == "Size":
                        shape, unknown = np.array(np.prod(shape), dtype=np.int64), np.array(unknown.any())
                    else:
                        attrs = {a.name: a.i for a in node.attribute}
                        cut = slice(attrs.get("start", 0), attrs.get("end", len(shape)))
                        shape, unknown = shape[cut], unknown[cut]
                    values[node.output[0]] = shape
                    masks[node.output[0]] = unknown
                elif set(node.input) & self.inputs or node.op_type.startswith("Random"):
                    return None, "it is computed from the model's input data"
                else:
                    program.append(node)
            made = list(dict.fromkeys(o for n in program for o in n.output if o))
            values.update(zip(made, _program(program, values, made, self.opsets)({})))
            results.append(values[name])
        if (
            not np.array_equal(results[0], results[1])
            or _unknown_dims(nodes, values, masks).get(name, np.zeros(())).any()
        ):
            return None, "it depends on a dimension known only at run time (the batch, or a sequence length of None)"
        return results[0], ""


#: Ops whose output elements are input elements, each depending on what it was copied from.
_MOVES = frozenset({"Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape", "Flatten"})


def _unknown_dims(
    nodes: Sequence[onnx.NodeProto], values: Mapping[str, np.ndarray], masks: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Per element of each tensor ``nodes`` compute (their ``values`` given), whether it depends on
    a dimension known only at run time, from the ``masks`` of the shapes they read (updated in
    place): an element a ``Gather``, ``Slice`` or ``Concat`` of shapes picks depends only on the
    dimension it is (``x.size(1)`` is known with the batch unknown); any other op's outputs depend
    on every element of its inputs."""
    for node in nodes:
        ins = [masks.get(i, np.zeros(np.shape(values.get(i, 0)), dtype=bool)) for i in node.input]
        if node.output[0] in masks or not any(m.any() for m in ins):
            continue
        outs = [o for o in node.output if o]
        op, axis = node.op_type, int(attr(node, "axis", 0))
        if op in _MOVES:
            masks[outs[0]] = np.reshape(ins[0], np.shape(values[outs[0]]))
        elif op == "Gather" and not ins[1].any():
            masks[outs[0]] = np.take(ins[0], values[node.input[1]], axis=axis)
        elif op == "Slice" and not any(m.any() for m in ins[1:]):
            starts, ends, *rest = (values[i] for i in node.input[1:])
            axes = rest[0] if rest else range(len(starts))
            steps = rest[1] if len(rest) > 1 else [1] * len(starts)
            cut = [slice(None)] * ins[0].ndim
            for a, b, e, k in zip(axes, starts, ends, steps):
                cut[int(a)] = slice(int(b), int(e), int(k))
            masks[outs[0]] = ins[0][tuple(cut)]
        elif op == "Concat":
            masks[outs[0]] = np.concatenate(
                [np.broadcast_to(m, np.shape(values[i])) for m, i in zip(ins, node.input)], axis
            )
        else:
            masks.update({o: np.ones(np.shape(values[o]), dtype=bool) for o in outs})
    return masks


def unroll_control_flow(model: onnx.ModelProto, prediction: str, limit: int = MAX_UNROLLED) -> list[str]:
    """Each ``Loop``, ``Scan`` and ``If`` of the main graph the ``prediction`` is computed from,
    unrolled or chosen in place (see the module's docstring), those its copies bring into the main
    graph too; returns their names. A Loop or Scan whose length is not known when the plan is made
    (it depends on the input data, or on the batch or a sequence length of None), a Loop whose
    condition depends on the data, or one that would take more than ``limit`` copies is refused in
    one line naming it, why, and what to export instead. An ``If`` whose condition is not known when
    the plan is made stays: the gradient refuses it where one must cross it."""
    state = _Unrolling(model, limit)
    needed = _cone(state.nodes, [prediction])[1]
    done: list[str] = []
    at = 0
    while at < len(state.nodes):
        node = state.nodes[at]
        if node.op_type not in _REWRITES or node.domain not in DEFAULT_DOMAINS or not set(node.output) & needed:
            at += 1
            continue
        copies = _REWRITES[node.op_type](state, node)
        if copies is None:  # an If left in place
            at += 1
            continue
        state.replace(at, copies)
        for copy in copies:  # what the Loop's outputs are computed from (each copy computes what is read)
            needed |= node_reads(copy)
        done.append(node.name or node.output[0])
    state.written()
    return done


class _Unrolling:
    """The main graph's nodes as one :func:`unroll_control_flow` rewrites them, and what it knows of them."""

    def __init__(self, model: onnx.ModelProto, limit: int) -> None:
        self.model, self.limit = model, limit
        self._written = True
        self.nodes = list(model.graph.node)
        self.producers = {o: n for n in self.nodes for o in n.output if o}
        self.read = set().union(*(node_reads(n) for n in self.nodes)) | {o.name for o in model.graph.output}
        self.outer = _Outer(self.written, self.producers)
        self.copies = _Copies(model.graph, self.outer)

    def make_room(self, node: onnx.NodeProto, steps: int, body: onnx.GraphProto) -> None:
        """Refuse ``node`` when ``steps`` copies of ``body`` would take the graph past :data:`MAX_UNROLLED_NODES`."""
        size = _size(body)
        if len(self.nodes) + steps * size > MAX_UNROLLED_NODES:
            raise _refuse(
                node,
                f"its {steps} copies of a body of {size} nodes would take the unrolled graph past "
                f"{MAX_UNROLLED_NODES:,} nodes (it holds {len(self.nodes):,}); loops nested in loops multiply their copies",
            )

    def replace(self, at: int, copies: list[onnx.NodeProto]) -> None:
        """The node at ``at`` replaced by ``copies``."""
        self.nodes[at : at + 1] = copies
        for copy in copies:
            self.producers.update((o, copy) for o in copy.output if o)
            self.read |= node_reads(copy)
        self._written = False
        self.outer.__dict__.pop("shapes", None)

    def written(self) -> onnx.ModelProto:
        """The model, its graph holding the nodes as they are now (to infer their shapes)."""
        if not self._written:
            del self.model.graph.node[:]
            self.model.graph.node.extend(self.nodes)
            self._written = True
        return self.model


def _size(graph: onnx.GraphProto) -> int:
    """``graph``'s nodes, those of the subgraphs inside them included."""
    return sum(1 + sum(_size(g) for g in subgraphs(n)) for n in graph.node)


def _wanted(
    body_nodes: Sequence[onnx.NodeProto],
    steps: int,
    carried_in: Sequence[str],
    carried_out: Sequence[str],
    last: set[int],
    scans: Sequence[str],
    fixed: Iterable[int] = (),
) -> list[set[str]]:
    """The body outputs each of ``steps`` copies must compute, backwards from the carried values
    ``last`` whose final value is read and the ``scans`` each copy adds to; the ``fixed`` carried
    values are constants of each copy."""
    wanted: list[set[str]] = [set() for _ in range(steps)]
    skip = set(fixed)
    carried = set(last) - skip
    for t in reversed(range(steps)):
        targets = [carried_out[k] for k in sorted(carried)] + list(scans)
        wanted[t] = set(targets)
        read = _cone(body_nodes, targets)[1]
        carried = {k for k, name in enumerate(carried_in) if k not in skip and name in read}
    return wanted


class _Copies:
    """Writes copies of subgraphs' nodes into ``graph`` under fresh names (those of the node
    :meth:`of`), telling ``outer`` of the constants it adds."""

    def __init__(self, graph: onnx.GraphProto, outer: _Outer) -> None:
        self.graph, self.outer = graph, outer
        self.fresh = namer(graph)
        for n in graph.node:  # node names, and the names other subgraphs define, are taken too
            if n.name:
                self.fresh(n.name)
            for g in subgraphs(n):
                for name in _defined(g):
                    self.fresh(name)
        self.base = ""
        self.known: dict[str, np.ndarray] = {}  # constant made -> its value
        self._by_value: dict[tuple[str, tuple[int, ...], bytes], str] = {}

    def of(self, node: onnx.NodeProto) -> _Copies:
        """These copies, their names hinted by ``node``'s."""
        self.base = (node.name or node.output[0]).replace("/", "_")
        return self

    def constant(self, value: np.ndarray, hint: str) -> str:
        """An initializer holding ``value`` (one per value)."""
        value = np.asarray(value)
        key = (value.dtype.str, value.shape, value.tobytes())
        if key not in self._by_value:
            self._by_value[key] = self.fresh(hint)
            self.graph.initializer.append(numpy_helper.from_array(value, self._by_value[key]))
            self.known[self._by_value[key]] = value
            self.outer.made(self._by_value[key], value)
        return self._by_value[key]

    def step(self, source: str, at: int, axis: int, output: str, name: str = "") -> list[onnx.NodeProto]:
        """``source``'s position ``at`` along ``axis`` into ``output``, as a ``Slice`` and ``Squeeze``:
        the Slices of every step cut the sequence into consecutive pieces, which become one
        ``Split`` (one Concat of the steps' gradients, where each Gather's would scatter into zeros
        of the whole sequence)."""
        piece = self.fresh(f"{output}_piece")
        bounds = [
            self.constant(np.array([v], dtype=np.int64), f"{self.base}_{hint}")
            for v, hint in ((at, "start"), (at + 1, "end"), (axis, "axis"))
        ]
        return [
            helper.make_node("Slice", [source, *bounds], [piece], name=self.fresh(f"{name}_slice") if name else ""),
            helper.make_node("Squeeze", [piece, bounds[2]], [output], name=name),
        ]

    def _step_read(self, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        """A ``Gather`` of one position a copy fixes (the time step a counter reads) as the
        :meth:`step` it is."""
        index = self.known.get(node.input[1]) if node.op_type == "Gather" and len(node.input) == 2 else None
        if index is None or index.ndim != 0 or int(index) < 0:
            return None
        axis = int(next((a.i for a in node.attribute if a.name == "axis"), 0))
        return self.step(node.input[0], int(index), axis, node.output[0], node.name)

    def copy(
        self,
        body: onnx.GraphProto,
        targets: Iterable[str],
        names: Callable[[set[str]], dict[str, str]],
        suffix: str,
    ) -> tuple[list[onnx.NodeProto], dict[str, str]]:
        """The nodes of ``body`` that compute ``targets``, copied, and the renaming they were copied
        under: ``names`` gives the names its inputs are read as (from what the copies read), its
        initializers are constants, every tensor it computes a fresh name ending in ``suffix``."""
        copied, read = _cone(list(body.node), targets)
        renamed = {
            i.name: self.constant(numpy_helper.to_array(i), f"{self.base}_{i.name}")
            for i in body.initializer
            if i.name in read
        }
        renamed.update(names(read))
        out: list[onnx.NodeProto] = []
        for sub in copied:
            for o in sub.output:
                if o:
                    renamed[o] = self.fresh(f"{o}{suffix}")
            copy = _renamed(sub, renamed, self.fresh(f"{sub.name}{suffix}") if sub.name else "")
            out.extend(self._step_read(copy) or [copy])
        return out, renamed

    def stack(self, values: Sequence[str], axis: int, output: str, name: str) -> list[onnx.NodeProto]:
        """``values`` stacked along a new axis ``axis`` into ``output`` (``Unsqueeze``, ``Concat``;
        plans are of opset 13 or later)."""
        axes = self.constant(np.array([axis], dtype=np.int64), f"{self.base}_scan_axis")
        out, rows = [], []
        for value in values:
            rows.append(self.fresh(f"{value}_row"))
            out.append(helper.make_node("Unsqueeze", [value, axes], [rows[-1]]))
        out.append(helper.make_node("Concat", rows, [output], axis=axis, name=self.fresh(name)))
        return out


def _unrolled(state: _Unrolling, loop: onnx.NodeProto) -> list[onnx.NodeProto]:
    """The nodes that compute ``loop``'s outputs without it."""
    model, outer, limit = state.model, state.outer, state.limit
    body = attr(loop, "body")
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
        value, why = outer.value(name)
        if value is None:
            raise _refuse(loop, f"its condition depends on {name!r}, which is not known when the plan is made: {why}")
        fixed[name] = value
    states: dict[int, np.ndarray] = {}
    for k in sorted(control):
        value, why = outer.value(carried_init[k])
        if value is None:
            raise _refuse(
                loop,
                f"its condition depends on the loop-carried value {carried_in[k]!r}, whose initial value "
                f"{carried_init[k]!r} is not known when the plan is made: {why}",
            )
        states[k] = value

    trips: int | None = None
    if inputs[0]:
        value, why = outer.value(inputs[0])
        if value is None:
            raise _refuse(loop, f"its trip count {inputs[0]!r} is not known when the plan is made: {why}")
        trips = int(value)
    cond = True
    if inputs[1]:
        value, why = outer.value(inputs[1])
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
            raise _refuse(loop, _too_long(limit))
        step = len(per_step)
        per_step.append(dict(states))
        feeds = {iter_in: np.array(step, dtype=np.int64), cond_in: np.array(cond)}
        outs = run({**feeds, **{carried_in[k]: v for k, v in states.items()}})
        cond = bool(outs[0])
        states = dict(zip(sorted(control), outs[1:]))
    if not per_step:
        raise _refuse(loop, "it runs no iteration when the plan is made")
    state.make_room(loop, len(per_step), body)

    read_after = state.read
    loop_carried_outs, loop_scans = list(loop.output[:n_carried]), list(loop.output[n_carried:])
    wanted_scans = [j for j, o in enumerate(loop_scans) if o in read_after]
    wanted = _wanted(
        body_nodes,
        len(per_step),
        carried_in,
        carried_out,
        {k for k, o in enumerate(loop_carried_outs) if o in read_after},
        [scan_out[j] for j in wanted_scans],
        control,
    )

    copies = state.copies.of(loop)
    out: list[onnx.NodeProto] = []
    carried = list(carried_init)
    scans: list[list[str]] = [[] for _ in scan_out]
    for t, fixed_states in enumerate(per_step):

        def names(
            read: set[str], t: int = t, fixed_states: dict[int, np.ndarray] = fixed_states, carried: list[str] = carried
        ) -> dict[str, str]:
            given = {}
            if iter_in in read:
                given[iter_in] = copies.constant(np.array(t, dtype=np.int64), f"{copies.base}_iteration_{t}")
            if cond_in in read:  # true: the copy runs
                given[cond_in] = copies.constant(np.array(True), f"{copies.base}_condition")
            for k, name in enumerate(carried_in):
                if name in read:
                    given[name] = copies.constant(fixed_states[k], f"{name}_{t}") if k in fixed_states else carried[k]
            return given

        nodes, renamed = copies.copy(body, wanted[t], names, f"_{t}")
        out.extend(nodes)
        carried = [
            renamed.get(carried_out[k], carried_out[k]) if k not in fixed_states else "" for k in range(n_carried)
        ]
        for j in wanted_scans:
            scans[j].append(renamed.get(scan_out[j], scan_out[j]))
    for k, name in enumerate(loop_carried_outs):  # a counter's last value is known; a state is the last copy's
        if name in read_after and k in control:
            out.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(states[k]))))
        elif name in read_after:
            out.append(helper.make_node("Identity", [carried[k]], [name]))
    for j in wanted_scans:
        out.extend(copies.stack(scans[j], 0, loop_scans[j], f"{loop.name}_scan_{j}"))
    return out


def _too_long(limit: int) -> str:
    return f"it runs more than {limit} iterations, which would unroll into as many copies of its body"


def _scanned(state: _Unrolling, scan: onnx.NodeProto) -> list[onnx.NodeProto]:
    """The nodes that compute ``scan``'s outputs without it: a copy of its body per position of
    the scanned axes, each reading its position of the scan inputs (a ``Slice``), the states
    flowing from one copy to the next, each scan output the copies' values stacked."""
    if (default_opset(state.model) or 1) < 9:
        raise _refuse(
            scan,
            "opset 8's Scan (a batch axis first, and sequence lengths) is not unrolled; export at opset 9 or later",
        )
    body = attr(scan, "body")
    n_scans = int(attr(scan, "num_scan_inputs"))
    n_states = len(scan.input) - n_scans
    states_init, sequences = list(scan.input[:n_states]), list(scan.input[n_states:])
    state_in, element_in = [i.name for i in body.input[:n_states]], [i.name for i in body.input[n_states:]]
    state_out = [o.name for o in body.output[:n_states]]
    element_out = [o.name for o in body.output[n_states:]]
    in_axes = list(attr(scan, "scan_input_axes", [0] * n_scans))
    in_reverse = list(attr(scan, "scan_input_directions", [0] * n_scans))
    out_axes = list(attr(scan, "scan_output_axes", [0] * len(element_out)))
    out_reverse = list(attr(scan, "scan_output_directions", [0] * len(element_out)))

    outer, limit = state.outer, state.limit
    length: int | None = None
    for sequence, axis in zip(sequences, in_axes):
        dims = outer.shapes.get(sequence)
        if dims is None or not -len(dims) <= axis < len(dims):
            raise _refuse(scan, f"the shape of its scan input {sequence!r} is not known when the plan is made")
        dim = dims[axis]
        if dim is None:
            raise _refuse(
                scan,
                f"its sequence length, axis {axis} of {sequence!r}, is known only at run time "
                "(the batch, or a sequence length of None)",
            )
        if length is not None and dim != length:
            raise _refuse(scan, f"its scan inputs are of different lengths ({length}, {dim})")
        length = dim
    if not length:
        raise _refuse(scan, "it runs no iteration when the plan is made")
    if length > limit:
        raise _refuse(scan, _too_long(limit))
    state.make_room(scan, length, body)

    read_after = state.read
    scan_outputs = list(scan.output[n_states:])
    wanted_scans = [j for j, o in enumerate(scan_outputs) if o in read_after]
    wanted = _wanted(
        list(body.node),
        length,
        state_in,
        state_out,
        {k for k, o in enumerate(scan.output[:n_states]) if o in read_after},
        [element_out[j] for j in wanted_scans],
    )
    copies = state.copies.of(scan)
    out: list[onnx.NodeProto] = []
    states = states_init
    scans: list[list[str]] = [[] for _ in element_out]
    for t in range(length):

        def names(read: set[str], t: int = t, states: list[str] = states) -> dict[str, str]:
            given = {name: states[k] for k, name in enumerate(state_in) if name in read}
            for j, name in enumerate(element_in):
                if name in read:
                    given[name] = copies.fresh(f"{name}_{t}")
                    at = length - 1 - t if in_reverse[j] else t
                    out.extend(copies.step(sequences[j], at, in_axes[j], given[name]))
            return given

        nodes, renamed = copies.copy(body, wanted[t], names, f"_{t}")
        out.extend(nodes)
        states = [renamed.get(name, name) for name in state_out]
        for j in wanted_scans:
            scans[j].append(renamed.get(element_out[j], element_out[j]))
    for k, name in enumerate(scan.output[:n_states]):
        if name in read_after:
            out.append(helper.make_node("Identity", [states[k]], [name]))
    for j in wanted_scans:
        rows = scans[j][::-1] if out_reverse[j] else scans[j]
        out.extend(copies.stack(rows, out_axes[j], scan_outputs[j], f"{scan.name}_scan_{j}"))
    return out


def _chosen(state: _Unrolling, branch: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """The nodes of the branch ``branch`` takes, when its condition is known when the plan is made
    (a constant, or computed from constants and static shapes); None when it is not."""
    value, _ = state.outer.value(branch.input[0])
    if value is None:
        return None
    chosen = attr(branch, "then_branch" if bool(np.reshape(value, -1)[0]) else "else_branch")
    copies = state.copies.of(branch)
    results = [o.name for o in chosen.output]
    out, renamed = copies.copy(chosen, results, lambda read: {}, "")
    for name, result in zip(branch.output, results):
        if name in state.read:
            out.append(helper.make_node("Identity", [renamed.get(result, result)], [name]))
    return out


_REWRITES: dict[str, Callable[[_Unrolling, onnx.NodeProto], list[onnx.NodeProto] | None]] = {
    "Loop": _unrolled,
    "Scan": _scanned,
    "If": _chosen,
}


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
