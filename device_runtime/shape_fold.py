"""The values a graph computes from its tensors' shapes, found before it runs.

A graph may size a tensor from another's shape: ``ConstantOfShape(Shape(x) * 10^5)`` makes a
tensor of 10^5 times the batch's every dim, which ONNX shape inference (without its data
propagation) cannot size, so the device's check of a plan's tensors counted it as one element.
With the shapes of the graph's inputs known (the batch's, the weights'), such values are small
integer vectors the device can compute itself: :func:`fold_shape_values` computes them and puts them
in the graph as constants, where shape inference reads them as it reads any constant.

ONNX's own data propagation (``infer_shapes(data_prop=True)``) would find them too, but it also
materializes what it propagates: a ``Range`` of 10^7 took it 8 s and 1.4 GB, in the check meant to
keep a plan from taking the device's memory. Here only a few operators are computed, and only
on vectors of at most ``MAX_FOLDED`` elements; a value computed by any other operator, or from the
examples' data, stays unknown (a tensor sized from it is counted at its known dims only)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

#: The most elements of a value computed here: shape vectors have a few.
MAX_FOLDED = 64
#: onnx.TensorProto's integer types: UINT8, INT8, UINT16, INT16, INT32, INT64, UINT32, UINT64.
_INTEGER_TYPES = frozenset({2, 3, 4, 5, 6, 7, 12, 13})
_INTEGERS = (np.int64, np.int32, np.int16, np.int8, np.uint64, np.uint32, np.uint16, np.uint8)


def fold_shape_values(model: Any, shapes: Mapping[str, tuple[int | None, ...]]) -> tuple[Any, int]:
    """``model`` with the values its top-level graph computes from known shapes (``shapes``: name
    to dims, None where unknown) as initializers, and the nodes that computed them removed.
    Returns the model (``model`` itself, changed in place) and how many values were folded."""
    from onnx import numpy_helper

    graph = model.graph
    known: dict[str, np.ndarray] = {}
    for tensor in graph.initializer:
        if tensor.data_type in _INTEGER_TYPES and _elements(tensor.dims) <= MAX_FOLDED:
            known[tensor.name] = numpy_helper.to_array(tensor)
    folded: list[Any] = []
    for node in graph.node:
        if node.domain not in ("", "ai.onnx") or len(node.output) != 1:
            continue
        compute = _OPS.get(node.op_type)
        if compute is None:
            continue
        try:
            value = compute(node, [known.get(name) if name else None for name in node.input], shapes)
        except (ValueError, TypeError, IndexError, KeyError, OverflowError, ZeroDivisionError):
            value = None
        if value is not None and value.size <= MAX_FOLDED:
            known[node.output[0]] = value
            folded.append(node)
    if folded:
        gone = {id(node) for node in folded}
        kept = [node for node in graph.node if id(node) not in gone]
        del graph.node[:]
        graph.node.extend(kept)
        graph.initializer.extend(numpy_helper.from_array(known[node.output[0]], node.output[0]) for node in folded)
        produced = {node.output[0] for node in folded}
        kept_info = [v for v in graph.value_info if v.name not in produced]
        del graph.value_info[:]
        graph.value_info.extend(kept_info)
    return model, len(folded)


def _elements(dims: Any) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _attribute(node: Any, name: str, default: Any = None) -> Any:
    import onnx

    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _integers(*values: np.ndarray | None) -> bool:
    return all(v is not None and v.dtype.type in _INTEGERS for v in values)


def _shape(node: Any, args: list, shapes: Mapping[str, tuple[int | None, ...]]) -> np.ndarray | None:
    dims = shapes.get(node.input[0])
    if dims is None or any(d is None for d in dims):
        return None
    rank = len(dims)
    start, end = _attribute(node, "start", 0), _attribute(node, "end", rank)
    return np.array(dims[slice(start, end)], dtype=np.int64)


def _size(node: Any, args: list, shapes: Mapping[str, tuple[int | None, ...]]) -> np.ndarray | None:
    dims = shapes.get(node.input[0])
    if dims is None or any(d is None for d in dims):
        return None
    return np.array(_elements(dims), dtype=np.int64)


def _constant(node: Any, args: list, shapes: Mapping[str, tuple[int | None, ...]]) -> np.ndarray | None:
    from onnx import numpy_helper

    for a in node.attribute:
        if a.name == "value" and a.t.data_type in _INTEGER_TYPES and _elements(a.t.dims) <= MAX_FOLDED:
            return numpy_helper.to_array(a.t)
        if a.name == "value_int":
            return np.array(a.i, dtype=np.int64)
        if a.name == "value_ints" and len(a.ints) <= MAX_FOLDED:
            return np.array(list(a.ints), dtype=np.int64)
    return None


def _identity(node: Any, args: list, shapes: Mapping[str, tuple[int | None, ...]]) -> np.ndarray | None:
    return args[0] if _integers(args[0]) else None


def _cast(node: Any, args: list, shapes: Mapping[str, tuple[int | None, ...]]) -> np.ndarray | None:
    to = _attribute(node, "to")
    if not _integers(args[0]) or to not in _INTEGER_TYPES:
        return None
    import onnx

    with np.errstate(over="ignore"):
        return args[0].astype(onnx.helper.tensor_dtype_to_np_dtype(to))


def _gather(node: Any, args: list, shapes: Mapping[str, tuple[int | None, ...]]) -> np.ndarray | None:
    data, indices = args[0], args[1]
    if not _integers(data, indices) or data.ndim == 0:
        return None
    axis = _attribute(node, "axis", 0)
    size = data.shape[axis]
    if np.any(indices < -size) or np.any(indices >= size):
        return None
    return np.take(data, np.where(indices < 0, indices + size, indices), axis=axis)


def _slice(node: Any, args: list, shapes: Mapping[str, tuple[int | None, ...]]) -> np.ndarray | None:
    data, starts, ends = args[0], args[1], args[2]
    axes = args[3] if len(args) > 3 else None
    steps = args[4] if len(args) > 4 else None
    if not _integers(data, starts, ends) or data.ndim != 1 or starts.size != 1 or ends.size != 1:
        return None
    if (len(args) > 3 and node.input[3] and (axes is None or axes.reshape(-1).tolist() not in ([0], [-1]))) or (
        len(args) > 4 and node.input[4] and (steps is None or steps.size != 1 or int(steps.reshape(-1)[0]) == 0)
    ):
        return None
    step = int(steps.reshape(-1)[0]) if steps is not None else 1
    return data[slice_indices(len(data), int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0]), step)]


def slice_indices(dim: int, start: int, end: int, step: int) -> list[int]:
    """The indices ONNX's Slice takes of an axis of ``dim``: negative starts and ends count from
    its end, then are clamped to [0, dim] (a positive step) or to [0, dim - 1] and [-1, dim - 1] (a
    negative one). Not Python's slice: ``[1, 1][-3:-3:-1]`` is empty, ONNX's is ``[1]``."""
    start, end = start + dim if start < 0 else start, end + dim if end < 0 else end
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
    else:
        start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return list(range(start, end, step)) if dim else []


def _concat(node: Any, args: list, shapes: Mapping[str, tuple[int | None, ...]]) -> np.ndarray | None:
    if not args or not _integers(*args):
        return None
    return np.concatenate(args, axis=_attribute(node, "axis", 0))


def _unsqueeze(node: Any, args: list, shapes: Mapping[str, tuple[int | None, ...]]) -> np.ndarray | None:
    axes = _attribute(node, "axes")
    if axes is None and len(args) > 1 and _integers(args[1]):
        axes = args[1].reshape(-1).tolist()
    if not _integers(args[0]) or axes is None:
        return None
    rank = args[0].ndim + len(axes)
    out = args[0]
    for axis in sorted(a + rank if a < 0 else a for a in axes):
        out = np.expand_dims(out, axis)
    return out


def _squeeze(node: Any, args: list, shapes: Mapping[str, tuple[int | None, ...]]) -> np.ndarray | None:
    axes = _attribute(node, "axes")
    if axes is None and len(args) > 1 and args[1] is not None and _integers(args[1]):
        axes = args[1].reshape(-1).tolist()
    if not _integers(args[0]):
        return None
    return np.squeeze(args[0], axis=None if axes is None else tuple(axes))


def _arithmetic(operation: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray | None]:
    def compute(node: Any, args: list, shapes: Mapping[str, tuple[int | None, ...]]) -> np.ndarray | None:
        if len(args) != 2 or not _integers(*args) or args[0].dtype != args[1].dtype or not args[0].size * args[1].size:
            return None  # an empty operand broadcasts in onnxruntime as in no rule numpy follows
        with np.errstate(over="ignore"):  # int64 wraps, as onnxruntime's does
            return np.asarray(operation(args[0], args[1])).astype(args[0].dtype)

    return compute


def _divided(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Integer division truncated toward zero, as onnxruntime's (C++'s) is."""
    if np.any(b == 0):
        raise ZeroDivisionError
    quotient = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -quotient, quotient)


def _extreme(operation: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray | None]:
    def compute(node: Any, args: list, shapes: Mapping[str, tuple[int | None, ...]]) -> np.ndarray | None:
        if not args or not _integers(*args) or len({a.dtype for a in args}) != 1 or not all(a.size for a in args):
            return None  # as above
        out = args[0]
        for other in args[1:]:
            out = operation(out, other)
        return out

    return compute


_OPS: dict[str, Callable[..., np.ndarray | None]] = {
    "Shape": _shape,
    "Size": _size,
    "Constant": _constant,
    "Identity": _identity,
    "Cast": _cast,
    "Gather": _gather,
    "Slice": _slice,
    "Concat": _concat,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Add": _arithmetic(np.add),
    "Sub": _arithmetic(np.subtract),
    "Mul": _arithmetic(np.multiply),
    "Div": _arithmetic(_divided),
    "Max": _extreme(np.maximum),
    "Min": _extreme(np.minimum),
}
