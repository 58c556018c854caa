"""What a plan costs a device: floating-point operations per example, peak memory, and bytes.

A fleet's simulated compute time follows the plan the devices run (``FleetSimulator.cost``):
a session's time is its examples times the epochs times the plan's FLOPs per example over the
reference phone's FLOP rate, times the device class's ``speed``.

Why FLOPs and not a host timing: the work graph timed on this machine would make every run's
session times, and with them the rounds and the digest, depend on the machine and its load; a
count read from the graph is a function of the plan alone, so the same config and seed keep giving
the same digest. What the release tests measure (``fedfleet plan test``: peak memory over the
worker's baseline and the median time per step, ``emulator.toolchain.release``) stays what a
task's ``Budget`` is judged on; the fleet does not time anything.

What is counted (:func:`graph_flops`), per training step on one batch of ``batch_size``
examples, over every node of the work graph (forward, backward and the optimizer update):

- ``MatMul``, ``Gemm``: 2 x the multiply-adds (a Gemm's bias or ``C`` adds one per output);
- ``Conv``: 2 x output elements x (input channels per group x kernel elements), plus the bias;
  ``ConvTranspose``: 2 x input elements x (output channels per group x kernel elements);
- ``LSTM``, ``GRU``, ``RNN``: 2 x steps x batch x the elements of ``W`` and ``R`` (their gate
  matmuls); the toolchain's training plans unroll them into ``MatMul`` anyway;
- ``Einsum``: 2 x the product of every letter's size (one multiply-add per point of the
  contraction);
- other ops (elementwise, activations, reductions, softmax, pooling, normalization): one per
  element of their largest input or output; ops that only move or describe data (``Reshape``,
  ``Transpose``, ``Shape``, ``Gather``, ``Slice``, ``Concat``, ``Cast``, ...) count nothing;
- ``If``: its larger branch; ``Loop`` and ``Scan``: their body once (a loop's trip count is data).

Shapes come from ONNX shape inference with the example inputs' batch dimension set to the plan's
``batch_size``; where it leaves a shape open (exporters' graphs compute many from data), from one
run of the work graph on zeros in onnxruntime (shapes, not times: still a function of the plan).
A dimension neither gives (a sequence length the graph does not fix, say) counts as 1, and the
node is named in ``PlanCost.unresolved``: its count is a floor.

Peak memory (``PlanCost.memory_mb``) is the device runtime's own estimate of one step
(``device_runtime.memory.training_peak``: weights, optimizer state, the old and the new set, one
batch, the activations and gradients a step holds at once, onnxruntime's arena and session), the
one a device compares with its ``memory_mb`` when it loads the plan and refuses it above; at least
the plan's own ``metadata.memory_budget_mb``, which the runtime refuses on a device that gives less
(``FLRuntime._check_budget``). A device the plan does not fit is counted in the run's
``devices_short_of_memory`` and takes no part. (Before, an upper bound held every intermediate
tensor of a step at once: 5.7 GB for a ResNet-50 step measured at 2.4 GB.)

A device also refuses a plan whose one batch cannot fit its share of memory for examples (an
eighth of its memory, ``device_runtime.batching.examples_share``), counted as the device counts it
when it loads the plan: the batch size times ``PlanExecutor.example_bytes`` (``PlanCost.fed_batch_bytes``).
``PlanCost.fits`` says whether a device of some memory holds the plan, by both checks.

Parameters (``PlanCost.parameters``): the values training fits, counted as ``fedfleet plan
from-torch`` and ``from-onnx`` print them (their "N parameters"): the weights of a training plan
its metrics (the loss) read, as of an evaluation plan, less a ``BatchNormalization``'s running
mean and variance. The checkpoint's other values (``PlanCost.untrained_values``) are the
running statistics of ``BatchNormalization``, which a training step moves but no gradient does, and
the client optimizer's state (momentum, Adam's moments); a device downloads and keeps them all.

Bytes: the serialized plan, the checkpoint of its weights (what a device downloads each
session) and a plain client update (what it uploads), exactly as ``encode_checkpoint`` writes
them (a checkpoint's size does not depend on its values)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import shape_inference

from device_runtime.batching import EXAMPLES_MEMORY_FRACTION, examples_share
from device_runtime.checkpoint import encode_checkpoint
from device_runtime.executor import PlanExecutor
from device_runtime.memory import training_peak
from device_runtime.plan import Plan, serialize_plan

#: Ops that move, reinterpret or describe data and compute nothing.
DATA_MOVEMENT_OPS = frozenset(
    {
        "Identity",
        "Reshape",
        "Flatten",
        "Squeeze",
        "Unsqueeze",
        "Transpose",
        "Shape",
        "Size",
        "Constant",
        "ConstantOfShape",
        "Cast",
        "CastLike",
        "Gather",
        "GatherElements",
        "GatherND",
        "Slice",
        "Concat",
        "Split",
        "Expand",
        "Tile",
        "Pad",
        "SpaceToDepth",
        "DepthToSpace",
        "ScatterElements",
        "ScatterND",
        "Range",
        "OneHot",
        "NonZero",
        "EyeLike",
        "Dropout",
        "SplitToSequence",
        "SequenceAt",
        "SequenceConstruct",
    }
)
#: Recurrent ops and their number of gates.
RECURRENT_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
#: Ops counted by their multiply-adds.
HEAVY_OPS = frozenset({"MatMul", "MatMulInteger", "Gemm", "Conv", "ConvTranspose", *RECURRENT_GATES})

MB = float(1 << 20)


@dataclass(frozen=True)
class PlanCost:
    """One plan's cost on a device (see the module's docstring for what each figure counts)."""

    batch_size: int
    flops_per_batch: int
    flops_by_op: Mapping[str, int]
    #: Values training fits (the toolchain's "N parameters"); ``untrained_values``: the checkpoint's
    #: others (running statistics, the client optimizer's state).
    parameters: int
    state_bytes: int
    batch_bytes: int
    #: The most a step's activations and gradients take at once (``MemoryEstimate.working_bytes``).
    activation_bytes: int
    memory_mb: float
    plan_bytes: int
    checkpoint_bytes: int
    update_bytes: int
    #: One batch's bytes as a device counts them when it loads the plan (``FLRuntime._check_budget``):
    #: the batch size times ``PlanExecutor.example_bytes``.
    fed_batch_bytes: int
    unresolved: tuple[str, ...] = field(default=())
    untrained_values: int = 0

    @property
    def flops_per_example(self) -> float:
        """FLOPs of one example for one epoch: one step's FLOPs over the batch size."""
        return self.flops_per_batch / self.batch_size

    def compute_s_per_example(self, flops_per_s: float) -> float:
        """Seconds of one example for one epoch on a device of ``flops_per_s`` sustained FLOPs."""
        return self.flops_per_example / flops_per_s

    def fits(self, memory_mb: float) -> bool:
        """Whether a device of ``memory_mb`` holds the plan: its peak memory, and one batch within
        the device's share of its memory for examples (the device refuses the plan otherwise)."""
        return memory_mb >= self.memory_mb and self.fed_batch_bytes <= examples_share(memory_mb)

    @property
    def least_memory_mb(self) -> float:
        """The least ``memory_mb`` of a device that holds the plan (``fits``): its peak memory, or
        the memory of which one batch is the examples' share, whichever is more."""
        return max(self.memory_mb, self.fed_batch_bytes * EXAMPLES_MEMORY_FRACTION / MB)

    def summary(self) -> dict[str, Any]:
        """The figures a run's summary shows (JSON-ready)."""
        return {
            "flops_per_example": self.flops_per_example,
            "parameters": self.parameters,
            "untrained_values": self.untrained_values,
            "memory_mb": round(self.memory_mb, 3),
            "plan_bytes": self.plan_bytes,
            "checkpoint_bytes": self.checkpoint_bytes,
            "update_bytes": self.update_bytes,
        }


def plan_cost(plan: Plan) -> PlanCost:
    """The cost of ``plan`` (a training or an evaluation plan): a function of its bytes alone."""
    batch = plan.device.batch_size
    model = onnx.ModelProto.FromString(plan.work)
    examples = set(plan.device.inputs)
    shapes, dtypes = _inferred(model, examples, batch)
    flops, unresolved = graph_flops(model.graph, shapes)
    if unresolved:  # inference left some shapes open: read them off one step on zeros
        shapes.update(_run_shapes(plan.work, examples, batch, shapes))
        flops, unresolved = graph_flops(model.graph, shapes)
    graph = model.graph
    inputs = {v.name for v in graph.input}
    state = sum(_nbytes(shapes.get(n), dtypes.get(n)) for n in inputs - examples)
    batch_bytes = sum(_nbytes(shapes.get(n), dtypes.get(n)) for n in inputs & examples)
    estimate = training_peak(plan)
    activations = estimate.working_bytes
    memory_mb = estimate.peak_mb
    if plan.metadata.memory_budget_mb is not None:
        memory_mb = max(memory_mb, float(plan.metadata.memory_budget_mb))
    executor = PlanExecutor(plan)  # reads the graphs' declared inputs; makes no session
    weights = {n: np.zeros(s, d) for n, (s, d) in executor.weight_spec().items()}
    update = {n: np.zeros(s, d) for n, (s, d) in executor.client_update_spec().items()}
    trained = trained_weights(plan, model)
    return PlanCost(
        batch_size=batch,
        flops_per_batch=sum(flops.values()),
        flops_by_op=dict(sorted(flops.items())),
        parameters=int(sum(w.size for n, w in weights.items() if n in trained)),
        untrained_values=int(sum(w.size for n, w in weights.items() if n not in trained)),
        state_bytes=state,
        batch_bytes=batch_bytes,
        activation_bytes=activations,
        memory_mb=memory_mb,
        plan_bytes=len(serialize_plan(plan)),
        checkpoint_bytes=len(encode_checkpoint(weights)),
        update_bytes=len(encode_checkpoint(update)),
        fed_batch_bytes=batch * executor.example_bytes(),
        unresolved=tuple(unresolved),
    )


def trained_weights(plan: Plan, model: onnx.ModelProto) -> set[str]:
    """The plan's weights that training fits (see the module's docstring): those its metrics read
    (a training plan's loss reads every weight it trains; a step's update of running statistics
    and of the optimizer's state reaches no metric, and an evaluation plan reads no optimizer
    state), less the running mean and variance a ``BatchNormalization`` reads."""
    graph = model.graph
    statistics = {
        n.input[i] for n in graph.node if n.op_type == "BatchNormalization" for i in (3, 4) if i < len(n.input)
    }
    producer = {o: node for node in graph.node for o in node.output if o}
    seen: set[str] = set()
    todo = list(plan.metric_names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is not None:
            todo += [i for i in node.input if i]
            for a in node.attribute:
                for g in (*([a.g] if a.HasField("g") else []), *a.graphs):
                    todo += _read(g)
    return set(plan.weight_names) & seen - statistics


def _read(graph: onnx.GraphProto) -> set[str]:
    """Every name a graph's nodes read, its subgraphs' included (an outer scope's values among them)."""
    return {i for g in _graphs(graph) for node in g.node for i in node.input if i}


# ----------------------------------------------------------------------------- counting


Shape = tuple[int | None, ...]


def _inferred(model: onnx.ModelProto, examples: set[str], batch: int) -> tuple[dict[str, Shape], dict[str, int]]:
    """Every value's shape (None for a dimension inference left symbolic) and element type, with
    the example inputs' first dimension set to ``batch``."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name in examples and len(dims) and not dims[0].HasField("dim_value"):
            dims[0].Clear()
            dims[0].dim_value = batch
    try:
        model = shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001 - inference refused the graph: count what the declared shapes give
        pass
    shapes: dict[str, Shape] = {}
    dtypes: dict[str, int] = {}
    for graph in _graphs(model.graph):
        for value in (*graph.input, *graph.value_info, *graph.output):
            tt = value.type.tensor_type
            if value.type.HasField("tensor_type") and tt.HasField("shape"):
                shapes[value.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
                dtypes[value.name] = tt.elem_type
        for init in graph.initializer:
            shapes[init.name] = tuple(init.dims)
            dtypes[init.name] = init.data_type
        for node in graph.node:
            if node.op_type == "Constant" and node.output:
                for a in node.attribute:
                    if a.name == "value" and a.HasField("t"):
                        shapes[node.output[0]] = tuple(a.t.dims)
                        dtypes[node.output[0]] = a.t.data_type
    return shapes, dtypes


def _run_shapes(work: bytes, examples: set[str], batch: int, known: Mapping[str, Shape]) -> dict[str, Shape]:
    """The shapes of the main graph's values that inference left open, from one run of the work
    graph in onnxruntime on zeros (a batch of ``batch`` examples, weights of zero): shapes do not
    depend on the clock, so the count stays a function of the plan. An input dimension the graph
    leaves symbolic beyond the batch is 1. Nothing if the run fails."""
    from device_runtime.executor import make_session

    model = onnx.ModelProto.FromString(work)
    graph = model.graph
    declared = {v.name for v in (*graph.input, *graph.output)}
    wanted = [
        o
        for node in graph.node
        for o in node.output
        if o and o not in declared and (known.get(o) is None or None in known[o])
    ]
    if not wanted:
        return {}
    graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in wanted)
    feeds = {}
    for value in graph.input:
        tt = value.type.tensor_type
        dims = [
            d.dim_value if d.HasField("dim_value") else (batch if i == 0 and value.name in examples else 1)
            for i, d in enumerate(tt.shape.dim)
        ]
        feeds[value.name] = np.zeros(dims, onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
    try:
        session = make_session(model.SerializeToString())
        values = session.run(wanted, feeds)
    except Exception:  # noqa: BLE001 - the count falls back to what inference gave
        return {}
    return {name: tuple(int(d) for d in np.shape(v)) for name, v in zip(wanted, values)}


def _graphs(graph: onnx.GraphProto):
    yield graph
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("g"):
                yield from _graphs(a.g)
            for g in a.graphs:
                yield from _graphs(g)


def graph_flops(graph: onnx.GraphProto, shapes: Mapping[str, Shape]) -> tuple[Counter[str], list[str]]:
    """FLOPs of one run of ``graph`` by op type, and the nodes whose shapes were not all known
    (counted with their unknown dimensions as 1). ``shapes`` maps value names to their shapes."""
    flops: Counter[str] = Counter()
    unresolved: list[str] = []
    for node in graph.node:
        op = node.op_type
        if op == "If":
            branches = [graph_flops(a.g, shapes) for a in node.attribute if a.HasField("g")]
            if branches:
                count, missing = max(branches, key=lambda b: sum(b[0].values()))
                flops.update(count)
                unresolved.extend(missing)
            continue
        if op in ("Loop", "Scan"):
            for a in node.attribute:
                if a.HasField("g"):
                    count, missing = graph_flops(a.g, shapes)
                    flops.update(count)
                    unresolved.extend(missing)
            continue
        if op in DATA_MOVEMENT_OPS:
            continue
        ins = [shapes.get(n) if n else () for n in node.input]
        outs = [shapes.get(n) for n in node.output if n]
        # what the count reads: a heavy op's data, weight and output (its bias is its output's size)
        read = (ins[:3] if op in RECURRENT_GATES else ins[:2] + outs[:1]) if op in HEAVY_OPS else (*ins, *outs)
        if not all(s is not None and None not in s for s in read):
            unresolved.append(f"{op}:{node.name or (node.output[0] if node.output else '?')}")
        ins_ = [_dims(s) for s in ins]
        outs_ = [_dims(s) for s in outs]
        flops[op] += _node_flops(node, ins_, outs_)
    return flops, unresolved


def _dims(shape: Shape | None) -> tuple[int, ...]:
    return tuple(1 if d is None else int(d) for d in (shape or ()))


def _size(dims: tuple[int, ...]) -> int:
    return math.prod(dims)


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _node_flops(node: onnx.NodeProto, ins: list[tuple[int, ...]], outs: list[tuple[int, ...]]) -> int:
    op = node.op_type
    out = outs[0] if outs else ()
    if op == "MatMul" or op == "MatMulInteger":
        a = ins[0]
        k = a[-1] if a else 1
        return 2 * _size(out) * k
    if op == "Gemm":
        a = ins[0]
        k = (a[0] if _attr(node, "transA", 0) else a[-1]) if a else 1
        bias = _size(out) if len(ins) > 2 and node.input[2] else 0
        return 2 * _size(out) * k + bias
    if op == "Conv":
        w = ins[1] if len(ins) > 1 else ()
        bias = _size(out) if len(ins) > 2 and node.input[2] else 0
        return 2 * _size(out) * _size(w[1:]) + bias
    if op == "ConvTranspose":
        w = ins[1] if len(ins) > 1 else ()
        bias = _size(out) if len(ins) > 2 and node.input[2] else 0
        return 2 * _size(ins[0]) * _size(w[1:]) + bias
    if op in RECURRENT_GATES:
        x = ins[0]
        steps, batch = (x[1], x[0]) if _attr(node, "layout", 0) else (x[0], x[1] if len(x) > 1 else 1)
        return 2 * steps * batch * (_size(ins[1]) + _size(ins[2]))
    if op == "Einsum":
        return _einsum_flops(_attr(node, "equation", b""), ins, out)
    return max([_size(s) for s in (*ins, *outs)] or [0])


def _einsum_flops(equation: str | bytes, ins: list[tuple[int, ...]], out: tuple[int, ...]) -> int:
    """2 x the product of every letter's size; with an ellipsis, the output times the summed letters."""
    eq = equation.decode() if isinstance(equation, bytes) else equation
    eq = eq.replace(" ", "")
    lhs = eq.split("->")[0]
    sizes: dict[str, int] = {}
    ellipsis = 1
    for term, dims in zip(lhs.split(","), ins):
        if "..." in term:
            head, tail = term.split("...")
            extra = len(dims) - len(head) - len(tail)
            ellipsis = max(ellipsis, _size(dims[len(head) : len(head) + extra]))
            letters = list(head) + [None] * extra + list(tail)
        else:
            letters = list(term)
        for letter, d in zip(letters, dims):
            if letter is not None:
                sizes[letter] = max(sizes.get(letter, 1), d)
    return 2 * ellipsis * math.prod(sizes.values())


def _nbytes(shape: Shape | None, elem_type: int | None) -> int:
    if shape is None or elem_type is None:
        return 0
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize
    except (KeyError, TypeError, ValueError):
        itemsize = 4
    return _size(_dims(shape)) * itemsize
