"""Rewrites of a generated work graph that compute the same values in fewer of onnxruntime's cycles.

The gradient rules and the rewritten forward are written for clarity, one op at a time; what they
emit is then adjusted here where onnxruntime's kernels are known to take a slow path on it:

* a one-element constant of lower rank broadcast against a tensor whose last axis is 1 (the
  per-row statistics of a normalization, ``[N, S, 1]``; a pooled feature map, ``[N, C, 1, 1]``)
  runs through onnxruntime's general broadcast one element at a time: 15-40x slower than the same
  constant at the tensor's rank (30 us against 1.5 us for ``[32, 65, 1]`` times a scalar, measured
  with onnxruntime 1.32 on one thread). Such constants are given the rank of the op's output;
* a tensor repeated over a short run of trailing axes (a batch norm's per-channel ``[1, C, 1, 1]``
  statistics against ``[N, C, H, W]`` activations of 2x2 to 8x8 positions) makes onnxruntime's
  broadcast loop take a few elements at a time: 84 us for ``[32, 256, 2, 2]`` times ``[1, 256, 1, 1]``,
  12 us when the factor is first expanded to ``[1, 256, 2, 2]`` (which repeats over the leading axis
  only); 51 against 18 us at 4x4, 43 against 30 at 8x8, and slower from 16x16 up (measured as above,
  AVX-512). Such operands are expanded over that run (:data:`SHORT_BROADCAST_MAX`) before the op.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

#: Elementwise ops whose inputs broadcast against each other (numpy rules), all of them data.
BROADCASTING = frozenset(
    {
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Pow",
        "Max",
        "Min",
        "Sum",
        "Mean",
        "Where",
        "Equal",
        "Greater",
        "GreaterOrEqual",
        "Less",
        "LessOrEqual",
    }
)


def rank_matched_constants(
    nodes: Sequence[onnx.NodeProto], initializers: Sequence[onnx.TensorProto], ranks: dict[str, int]
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """``nodes`` and ``initializers`` with every one-element initializer that a broadcasting op reads
    at a lower rank than its output's (``ranks``: the known ranks of the tensors) replaced by a copy
    of that rank (new initializers are appended; the old stay for their other readers)."""
    values = {i.name: i for i in initializers if int(np.prod(i.dims, dtype=np.int64)) == 1}

    def key_for(name: str, output: str) -> tuple[str, int] | None:
        tensor, rank = values.get(name), ranks.get(output)
        return None if tensor is None or rank is None or len(tensor.dims) >= rank else (name, rank)

    def make(key: tuple[str, int], fresh: Callable[[str], str], extra: list, out: list) -> str:
        name, rank = key
        new = fresh(f"{name}_r{rank}")
        extra.append(numpy_helper.from_array(numpy_helper.to_array(values[name]).reshape([1] * rank), new))
        return new

    return _operands_replaced(nodes, initializers, BROADCASTING, key_for, make)


def _operands_replaced(
    nodes: Sequence[onnx.NodeProto],
    initializers: Sequence[onnx.TensorProto],
    ops: frozenset[str],
    key_for: Callable[[str, str], Hashable | None],
    make: Callable[[Any, Callable[[str], str], list[onnx.TensorProto], list[onnx.NodeProto]], str],
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The loop both rewrites share: every input of a node of ``ops`` for which ``key_for(input,
    the node's output)`` gives a key reads instead the tensor ``make(key, fresh, extra, out)`` made,
    once per key (``fresh`` gives a name no tensor has; ``make`` appends the initializers and nodes
    it needs to ``extra`` and ``out``). New initializers are appended; the old stay for their other
    readers."""
    taken = {i.name for i in initializers} | {t for n in nodes for t in [*n.input, *n.output]}
    made: dict[Hashable, str] = {}
    extra: list[onnx.TensorProto] = []
    out: list[onnx.NodeProto] = []

    def fresh(name: str) -> str:
        while name in taken:
            name += "_"
        taken.add(name)
        return name

    for node in nodes:
        if node.domain not in ("", "ai.onnx") or node.op_type not in ops or not node.output:
            out.append(node)
            continue
        changed = None
        for k, name in enumerate(node.input):
            key = key_for(name, node.output[0])
            if key is None:
                continue
            if key not in made:
                made[key] = make(key, fresh, extra, out)
            if changed is None:
                changed = onnx.NodeProto()
                changed.CopyFrom(node)
            changed.input[k] = made[key]
        out.append(changed if changed is not None else node)
    return out, [*initializers, *extra]


#: Elementwise arithmetic whose operands :func:`short_broadcasts_expanded` may expand (its output is
#: the broadcast of its inputs, whatever each holds).
ARITHMETIC = frozenset({"Add", "Sub", "Mul", "Div", "Sum", "Max", "Min", "Mean"})

#: The most elements a run of trailing axes may hold for an operand repeated over it to be expanded
#: first: at 8x8 positions the op still took 30 against 43 us, at 16x16 85 against 79.
SHORT_BROADCAST_MAX = 16


def short_broadcasts_expanded(
    nodes: Sequence[onnx.NodeProto], initializers: Sequence[onnx.TensorProto], shapes: dict[str, list[int | None]]
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """``nodes`` and ``initializers`` with every operand of an elementwise op (:data:`ARITHMETIC`)
    that is repeated over the output's last axes, 2 to :data:`SHORT_BROADCAST_MAX` elements of them,
    and also over some earlier axis (the batch: an operand of the output's size gains nothing)
    first expanded over those last axes by an ``Expand`` (``shapes``: the known shapes of the
    tensors, None for a dimension that is not a number). The values are the same, bit for bit."""

    def key_for(name: str, output: str) -> tuple[str, tuple[int, ...]] | None:
        shape = shapes.get(output)
        target = None if shape is None else _short_broadcast_target(shapes.get(name), shape)
        return None if target is None else (name, target)

    def make(key: tuple[str, tuple[int, ...]], fresh: Callable[[str], str], extra: list, out: list) -> str:
        name, target = key
        dims = fresh(f"{name}_spread_shape")
        extra.append(numpy_helper.from_array(np.array(target, np.int64), dims))
        spread = fresh(f"{name}_spread")
        out.append(onnx.helper.make_node("Expand", [name, dims], [spread], name=fresh(f"{spread}_node")))
        return spread

    return _operands_replaced(nodes, initializers, ARITHMETIC, key_for, make)


def _short_broadcast_target(operand: list[int | None] | None, output: list[int | None]) -> tuple[int, ...] | None:
    """The shape to expand ``operand`` to before an op of ``output``'s shape (see
    :func:`short_broadcasts_expanded`), or None to leave it."""
    if operand is None or len(operand) > len(output):
        return None
    aligned = [1] * (len(output) - len(operand)) + list(operand)
    first = len(aligned)
    while first > 0 and aligned[first - 1] == 1:
        first -= 1
    run = [d for d in output[first:] if isinstance(d, int)]
    kept = [d for d in aligned[:first] if isinstance(d, int)]
    if not run or len(run) < len(output) - first or len(kept) < first:
        return None
    elements = int(np.prod(run, dtype=np.int64))
    if not 1 < elements <= SHORT_BROADCAST_MAX or all(d == 1 for d in kept):
        return None
    if not any(a == 1 and o != 1 for a, o in zip(kept, output[:first])):
        return None
    return (*kept, *run)


def inferred_shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """The shape of every tensor of ``model`` that onnx's shape inference types (None for a
    dimension it does not know as a number; no tensor when inference fails)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - the rewrites are optimizations: without shapes they do nothing
        return {}
    g = inferred.graph
    shapes: dict[str, list[int | None]] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        tt = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and tt.HasField("shape"):
            shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
    for init in g.initializer:
        shapes[init.name] = [int(d) for d in init.dims]
    return shapes


def inferred_ranks(model: onnx.ModelProto) -> dict[str, int]:
    """The rank of every tensor of ``model`` that onnx's shape inference types (none when it fails)."""
    return {name: len(shape) for name, shape in inferred_shapes(model).items()}
