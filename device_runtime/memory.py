"""What one training step of a plan takes in memory: one estimate, for the device and the fleet.

A device refuses a plan whose estimate exceeds its ``DeviceClass.memory_mb`` when it loads it,
before it downloads the checkpoint (``FLRuntime._check_budget``); the fleet emulator's
``PlanCost.memory_mb`` is this estimate, so a simulated fleet seats exactly the devices that would
run the plan. The estimate is a function of the plan's bytes alone (its work graph at its
``batch_size``), the same on every machine.

What a step holds (``MemoryEstimate``), over the process's own memory before the plan came:

- ``weights_bytes``: the values the checkpoint carries, which the step reads and writes back: the
  weights, and the client optimizer's state (momentum, Adam's moments) and batch normalization's
  running statistics where the plan keeps them there; ``optimizer_bytes``: any other state the step
  reads (an input neither an example nor in the checkpoint);
- ``updated_bytes``: the step's outputs, the new weights and state among them: the executor holds
  the old set and the new one while it feeds the new set back;
- ``batch_bytes``: one batch of examples as the work graph is fed it;
- ``working_bytes``: the most the step's intermediate values take at once, walking the work graph's
  nodes in order and letting each value go after its last reader: the activations the forward pass
  keeps for the backward pass, the gradients, and the temporaries of each node (a Loop's, If's or
  Scan's body is counted at its node, whole);
- ``constant_bytes``: the work graph's own constants (initializers), which the session holds;
- ``overhead_bytes``: what onnxruntime adds (``ARENA_FACTOR`` and ``SESSION_BYTES``): its CPU
  arena keeps the buffers of a first run, which it sizes node by node, beside the block its memory
  plan allocates from the second run on, and a session holds its graph, its kernels and its
  optimized copy of the model.

A dimension neither the graph nor the batch size fixes (a sequence length left open) counts as 1:
the estimate is then a floor, and ``MemoryEstimate.open_dims`` says so.

Calibrated against the resident memory (RSS, ``/proc/self/statm``: onnxruntime's arena is native
memory that ``tracemalloc`` never sees and ``ru_maxrss`` reports only as the process's lifetime
peak) of steps on onnxruntime 1.32 with one thread, as ``fedfleet plan test`` measures it, on
2026-11-28; the figures are in ``docs/howto/big-models.md`` (How much memory a plan takes)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .plan import Plan, _known_shapes, _pinned, _without_weights
from .shape_fold import fold_shape_values

MB = float(1 << 20)
#: onnxruntime's intermediate values cost about this many times what they take at the peak of a
#: step: the arena keeps the first run's buffers, sized node by node, beside the memory plan's
#: block (measured 1.3 to 2.1 times, see the module's docstring).
ARENA_FACTOR = 2.2
#: What one more onnxruntime session holds beyond its values (its graph, kernels, the optimized
#: model): measured 0.8 to 1.5 MB with the example plans' values. onnxruntime's own start in a
#: process (about 7 MB, at its first session) is the runtime's, paid once whatever the plan.
SESSION_BYTES = 768 << 10
#: How many times values computed from shapes are folded and shapes inferred again.
_FOLD_ROUNDS = 3


@dataclass(frozen=True)
class MemoryEstimate:
    """The memory one training (or evaluation) step of a plan takes (see the module's docstring)."""

    batch_size: int
    weights_bytes: int
    optimizer_bytes: int
    updated_bytes: int
    batch_bytes: int
    working_bytes: int
    constant_bytes: int
    overhead_bytes: int
    #: Values whose shape had a dimension the graph leaves open (counted as 1): the estimate is a floor.
    open_dims: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.optimizer_bytes
            + self.updated_bytes
            + self.batch_bytes
            + self.working_bytes
            + self.constant_bytes
            + self.overhead_bytes
        )

    @property
    def peak_mb(self) -> float:
        """The estimated peak, in MB (MiB, as ``DeviceClass.memory_mb`` counts them)."""
        return self.total_bytes / MB

    def parts_mb(self) -> dict[str, float]:
        """Each part in MB, rounded to a tenth (for messages and reports)."""
        return {
            "weights": round(self.weights_bytes / MB, 1),
            "optimizer_state": round(self.optimizer_bytes / MB, 1),
            "updated": round(self.updated_bytes / MB, 1),
            "batch": round(self.batch_bytes / MB, 1),
            "activations_and_gradients": round(self.working_bytes / MB, 1),
            "constants": round(self.constant_bytes / MB, 1),
            "onnxruntime": round(self.overhead_bytes / MB, 1),
        }

    def describe(self) -> str:
        """One line: the peak and its largest parts."""
        parts = sorted(self.parts_mb().items(), key=lambda kv: -kv[1])[:3]
        said = ", ".join(f"{name.replace('_', ' ')} {mb:,.1f}" for name, mb in parts)
        return f"{self.peak_mb:,.1f} MB at a batch of {self.batch_size:,} ({said} MB)"


#: Estimates by the work graph's digest, batch size and fed inputs: a fleet's devices each load the
#: same plan's bytes, and inference takes milliseconds a graph. The oldest is forgotten first.
_BY_CONTENT: dict[tuple, MemoryEstimate] = {}
MAX_REMEMBERED = 256


def training_peak(plan: Plan) -> MemoryEstimate:
    """The estimated peak memory of one step of ``plan``'s work graph at its batch size."""
    device = plan.device
    key = (hashlib.sha256(plan.work).digest(), device.batch_size, tuple(sorted(device.inputs)))
    found = _BY_CONTENT.get(key)
    if found is not None:
        return found
    estimate = _estimate(plan)
    if len(_BY_CONTENT) >= MAX_REMEMBERED:
        _BY_CONTENT.pop(next(iter(_BY_CONTENT)), None)
    _BY_CONTENT[key] = estimate
    return estimate


def _estimate(plan: Plan) -> MemoryEstimate:
    import onnx

    device = plan.device
    full = onnx.ModelProto.FromString(plan.work)
    constant_bytes = sum(_dense_bytes(t.dims, t.data_type) for t in full.graph.initializer)
    model = _pinned(_without_weights(full), device)
    del full
    inferred = _inferred(model)
    for _ in range(_FOLD_ROUNDS):
        model, folded = fold_shape_values(model, _known_shapes(inferred))
        if not folded:
            break
        inferred = _inferred(model)
    graph = inferred.graph
    types = _types(inferred)
    open_dims: list[str] = []

    def nbytes(name: str) -> int:
        found = types.get(name)
        if found is None:
            return 0
        dims, elem = found
        if any(d is None for d in dims):
            open_dims.append(name)
        return _dense_bytes([1 if d is None else d for d in dims], elem)

    fed = set(device.inputs)
    weights = set(plan.weight_names)
    initialized = {t.name for t in graph.initializer}
    inputs = [v.name for v in graph.input if v.name not in initialized]
    batch_bytes = sum(nbytes(n) for n in inputs if n in fed)
    weights_bytes = sum(nbytes(n) for n in inputs if n in weights and n not in fed)
    optimizer_bytes = sum(nbytes(n) for n in inputs if n not in weights and n not in fed)
    outputs = [v.name for v in graph.output]
    updated_bytes = sum(nbytes(n) for n in dict.fromkeys(outputs))
    working = _working_peak(graph, set(outputs) | set(inputs) | initialized, nbytes)
    overhead = int((ARENA_FACTOR - 1) * working) + SESSION_BYTES
    return MemoryEstimate(
        batch_size=device.batch_size,
        weights_bytes=weights_bytes,
        optimizer_bytes=optimizer_bytes,
        updated_bytes=updated_bytes,
        batch_bytes=batch_bytes,
        working_bytes=working,
        constant_bytes=constant_bytes,
        overhead_bytes=overhead,
        open_dims=tuple(dict.fromkeys(open_dims)),
    )


def _working_peak(graph: Any, held: set[str], nbytes: Any) -> int:
    """The most bytes ``graph``'s intermediate values (not in ``held``: its inputs, outputs and
    constants, counted apart) take at once, node after node, each value let go after its last
    reader; a node's subgraphs count their own peak while it runs."""
    last_read: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for name in (*node.input, *_outer_reads(node)):
            if name:
                last_read[name] = i
    live: dict[str, int] = {}
    peak = 0
    for i, node in enumerate(graph.node):
        made = {o: nbytes(o) for o in node.output if o and o not in held}
        inner = sum(_working_peak(g, set(), nbytes) for g in _node_graphs(node))
        live.update(made)
        peak = max(peak, sum(live.values()) + inner)
        for name in [n for n in live if last_read.get(n, -1) <= i]:
            del live[name]
    return peak


def _node_graphs(node: Any) -> Iterator[Any]:
    for a in node.attribute:
        if a.HasField("g"):
            yield a.g
        yield from a.graphs


def _outer_reads(node: Any) -> set[str]:
    """The names a node's subgraphs read from the scope around them (they stay alive till it ends)."""
    names: set[str] = set()
    for g in _node_graphs(node):
        own = {v.name for v in g.input} | {t.name for t in g.initializer}
        for inner in g.node:
            own.update(o for o in inner.output if o)
        for inner in g.node:
            names.update(n for n in inner.input if n and n not in own)
            names.update(_outer_reads(inner) - own)
    return names


def _inferred(model: Any) -> Any:
    import onnx

    try:
        return onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - onnx's InferenceError and others: the declared shapes only
        return model


def _types(model: Any) -> dict[str, tuple[tuple[int | None, ...], int]]:
    """Every tensor value's dims (None where unknown) and element type, subgraphs' included."""
    out: dict[str, tuple[tuple[int | None, ...], int]] = {}
    todo = [model.graph]
    while todo:
        graph = todo.pop()
        for value in (*graph.input, *graph.value_info, *graph.output):
            tensor = value.type.tensor_type
            if value.type.HasField("tensor_type") and tensor.HasField("shape"):
                dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
                out[value.name] = (dims, tensor.elem_type)
        for t in graph.initializer:
            out[t.name] = (tuple(int(d) for d in t.dims), t.data_type)
        for node in graph.node:
            todo.extend(_node_graphs(node))
    return out


def _dense_bytes(dims: Any, elem_type: int) -> int:
    import onnx

    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize
    except (KeyError, TypeError, ValueError):
        itemsize = 4
    return math.prod(max(int(d), 0) for d in dims) * itemsize
