"""Rewrites of a generated work graph that compute the same values in fewer of onnxruntime's cycles.

The gradient rules and the rewritten forward are written for clarity, one op at a time; what they
emit is then adjusted here where onnxruntime's kernels are known to take a slow path on it:

* a one-element constant of lower rank broadcast against a tensor whose last axis is 1 (the
  per-row statistics of a normalization, ``[N, S, 1]``; a pooled feature map, ``[N, C, 1, 1]``)
  runs through onnxruntime's general broadcast one element at a time: 15-40x slower than the same
  constant at the tensor's rank (30 us against 1.5 us for ``[32, 65, 1]`` times a scalar, measured
  with onnxruntime 1.32 on one thread). Such constants are given the rank of the op's output.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    taken = {i.name for i in initializers} | {t for n in nodes for t in [*n.input, *n.output]}
    made: dict[tuple[str, int], str] = {}
    extra: list[onnx.TensorProto] = []
    out: list[onnx.NodeProto] = []
    for node in nodes:
        rank = ranks.get(node.output[0]) if node.output else None
        if node.domain not in ("", "ai.onnx") or node.op_type not in BROADCASTING or rank is None:
            out.append(node)
            continue
        changed = None
        for k, name in enumerate(node.input):
            tensor = values.get(name)
            if tensor is None or len(tensor.dims) >= rank:
                continue
            key = (name, rank)
            if key not in made:
                new = f"{name}_r{rank}"
                while new in taken:
                    new += "_"
                taken.add(new)
                extra.append(numpy_helper.from_array(numpy_helper.to_array(tensor).reshape([1] * rank), new))
                made[key] = new
            if changed is None:
                changed = onnx.NodeProto()
                changed.CopyFrom(node)
            changed.input[k] = made[key]
        out.append(changed if changed is not None else node)
    return out, [*initializers, *extra]


def inferred_ranks(model: onnx.ModelProto) -> dict[str, int]:
    """The rank of every tensor of ``model`` that onnx's shape inference types (none when it fails)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - the rewrite is an optimization: without ranks it does nothing
        return {}
    g = inferred.graph
    ranks = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        tt = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and tt.HasField("shape"):
            ranks[vi.name] = len(tt.shape.dim)
    for init in g.initializer:
        ranks[init.name] = len(init.dims)
    return ranks
