"""Versioned plans: one plan per claimed onnxruntime release, derived from the unversioned plan by
graph transformations between opsets (paper, section 7.3: "versioned FL plans").

``onnx.version_converter`` cannot lower basic ops below opset 14-15 (DESIGN.md), so each graph is
rewritten here, node by node, directly at the target opset:

* where an op's signature moved between an attribute and an input, the value is moved across
  (``Reduce*`` ``axes``: input from 13 for ReduceSum, from 18 for the others; ``Squeeze`` /
  ``Unsqueeze`` ``axes`` from 13; ``Split`` ``split`` from 13 and ``num_outputs`` from 18). Going
  down, the input must be a constant of the graph: a computed ``axes`` has no attribute form;
* ``Softmax`` / ``LogSoftmax`` / ``Hardmax`` below 13 flatten the input to 2-D at ``axis``; the
  rewrite keeps the 13+ meaning (one axis) by moving that axis last around the op;
* ops newer than the target are decomposed into older ones (``LayerNormalization`` below 17,
  ``Gelu`` below 20);
* a node of an element type the release's kernel for the op does not take (``Trilu`` on ``bool``
  below onnxruntime 1.19: :data:`~emulator.releases.missing_kernels.MISSING_TYPE_KERNELS`) is
  computed in a type it takes, cast to it and back (exact: ``bool`` and ``int32`` into ``int64``),
  whether or not the opset changes;
* any other op whose definition differs between the two opsets is kept only when the node fits
  the older definition (its attributes, inputs, outputs and input types), once the attributes the
  older one lacks are dropped where they hold the newer one's default (``Cast``'s ``saturate=1``,
  ``AveragePool``'s ``dilations`` of ones, ``Resize``'s ``antialias=0``); otherwise, and for ops
  with no rewrite (``Attention`` below 23, say), :class:`VersioningError` names the op, the node
  and the version.
* where a version gave an existing attribute new values or another meaning, the node is written in
  the older values that mean the same (``GridSample``-20's ``linear``/``cubic`` as -16's
  ``bilinear``/``bicubic`` on 4-D inputs, ``DFT``-20's ``axis`` input as -17's attribute,
  ``RoiAlign``'s ``output_half_pixel`` below 16, a ``ceil_mode`` pool of opset 22 whose extra
  last window starts in the right padding, which 22 drops, as ``ceil_mode=0``) or refused naming the value
  (:data:`_VALUES_SINCE`, ``RoiAlign``'s half-pixel default below 16, ``GroupNormalization``-21's
  per-channel scale, floating-point ``Mod`` with ``fmod=0`` below 28).

A rewrite that changes a value is a bug the release tests catch: they run the versioned work graph
on the real release and compare its outputs with the unversioned plan's reference run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from device_runtime.plan import (
    GRAPH_FIELDS,
    Plan,
    PlanError,
    ir_version_for_opset,
    max_ir_version_for_runtime,
    max_opset_for_runtime,
    serialize_plan,
)
from device_runtime.versions import version_tuple

from ..releases.missing_kernels import MISSING_KERNELS, MISSING_TYPE_KERNELS

__all__ = [
    "MIN_TARGET_OPSET",
    "VersioningError",
    "convert_model",
    "plan_sha256",
    "release_range",
    "versioned_plan",
]

#: Below 11 ops take their optional values as attributes in ways not rewritten here (Clip, Pad).
MIN_TARGET_OPSET = 11

#: Ops whose ``axes`` moved from an attribute to an input, and the opset where it happened.
_AXES_INPUT_SINCE = {
    "ReduceSum": 13,
    "ReduceMean": 18,
    "ReduceMax": 18,
    "ReduceMin": 18,
    "ReduceProd": 18,
    "ReduceL1": 18,
    "ReduceL2": 18,
    "ReduceLogSum": 18,
    "ReduceLogSumExp": 18,
    "ReduceSumSquare": 18,
    "Squeeze": 13,
    "Unsqueeze": 13,
}
_SOFTMAX_FAMILY = ("Softmax", "LogSoftmax", "Hardmax")


class VersioningError(PlanError):
    """A graph cannot be expressed at the target opset; the message names the op, node and version."""


def plan_sha256(plan: Plan | bytes) -> str:
    """The id a plan has everywhere: the sha256 of its serialized bytes (the server's resource id)."""
    data = plan if isinstance(plan, bytes) else serialize_plan(plan)
    return hashlib.sha256(data).hexdigest()


def release_range(runtime_version: str) -> tuple[str, str]:
    """The runtime versions a plan versioned for ``runtime_version`` claims: its minor release."""
    major, minor, _ = version_tuple(runtime_version)
    return f"{major}.{minor}.0", f"{major}.{minor}.9999"


# ----------------------------------------------------------------------------- conversion


@dataclass
class _Context:
    source: int
    target: int
    types: dict[str, tuple[int, int | None, tuple]]  # name -> (elem type, rank, dims)
    constants: dict[str, np.ndarray]
    missing_types: Mapping[str, Collection[str]] = field(default_factory=dict)  # op -> types without a kernel
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    used: set[str] = field(default_factory=set)
    counter: int = 0

    def fresh(self, hint: str) -> str:
        while True:
            self.counter += 1
            name = f"{hint}__v{self.target}_{self.counter}"
            if name not in self.used:
                self.used.add(name)
                return name

    def const(self, value: np.ndarray, hint: str) -> str:
        name = self.fresh(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        self.constants[name] = np.asarray(value)
        return name

    def rank(self, name: str) -> int | None:
        return self.types.get(name, (0, None, ()))[1]

    def elem(self, name: str) -> int:
        return self.types.get(name, (TensorProto.FLOAT, None, ()))[0] or TensorProto.FLOAT


def _refuse(node: onnx.NodeProto, ctx: _Context, why: str, needed: int | None = None) -> VersioningError:
    label = f" {node.name!r}" if node.name else ""
    return VersioningError(
        f"op {node.op_type} (node{label}) cannot be expressed at opset {ctx.target}: {why}; "
        f"claim only runtimes that run opset {needed or _needed(node, ctx)} or build the plan without this op"
    )


def _needed(node: onnx.NodeProto, ctx: _Context) -> int:
    try:
        return onnx.defs.get_schema(node.op_type, ctx.source, "").since_version
    except Exception:  # noqa: BLE001 - unknown op: the plan's own opset is what it needs
        return ctx.source


def _schema(op: str, opset: int):
    try:
        return onnx.defs.get_schema(op, opset, "")
    except Exception:  # noqa: BLE001 - onnx raises SchemaError for ops newer than opset
        return None


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _node(op: str, inputs: Sequence[str], outputs: Sequence[str], name: str, **attrs) -> onnx.NodeProto:
    return helper.make_node(op, list(inputs), list(outputs), name=name, **attrs)


def _copy(
    node: onnx.NodeProto, *, inputs: Sequence[str] | None = None, drop: Sequence[str] = (), **attrs
) -> onnx.NodeProto:
    """The node with other inputs, some attributes dropped and others set."""
    new = onnx.NodeProto()
    new.CopyFrom(node)
    if inputs is not None:
        del new.input[:]
        new.input.extend(inputs)
    kept = [a for a in new.attribute if a.name not in drop and a.name not in attrs]
    del new.attribute[:]
    new.attribute.extend(kept)
    for key, value in attrs.items():
        new.attribute.append(helper.make_attribute(key, value))
    return new


def _constant_input(node: onnx.NodeProto, index: int, ctx: _Context, what: str) -> np.ndarray | None:
    if len(node.input) <= index or not node.input[index]:
        return None
    name = node.input[index]
    if name not in ctx.constants:
        raise _refuse(node, ctx, f"its {what} input {name!r} is computed, and below that opset it must be an attribute")
    return ctx.constants[name]


def _axes_rule(node: onnx.NodeProto, ctx: _Context, since: int) -> list[onnx.NodeProto]:
    if ctx.target >= since or ctx.source < since:
        return [node]
    axes = _constant_input(node, 1, ctx, "axes")  # input -> attribute
    noop = _attr(node, "noop_with_empty_axes", 0)
    if noop and (axes is None or not axes.size):
        raise _refuse(node, ctx, "noop_with_empty_axes=1 with no axes has no form there")
    extra = {"axes": [int(a) for a in axes.reshape(-1)]} if axes is not None and axes.size else {}
    return [_copy(node, inputs=node.input[:1], drop=("noop_with_empty_axes",), **extra)]


def _split_rule(node: onnx.NodeProto, ctx: _Context) -> list[onnx.NodeProto]:
    new = node
    if ctx.source >= 18 > ctx.target and _attr(node, "num_outputs") is not None:
        sizes = _even_split(node, ctx)
        new = _copy(node, drop=("num_outputs",))
        if sizes is not None:
            new = _copy(new, inputs=[node.input[0], ctx.const(np.array(sizes, dtype=np.int64), "split")])
    if ctx.source >= 13 > ctx.target:
        split = _constant_input(new, 1, ctx, "split")
        extra: dict[str, Any] = {"split": [int(s) for s in split.reshape(-1)]} if split is not None else {}
        new = _copy(new, inputs=new.input[:1], **extra)
    return [new]


def _even_split(node: onnx.NodeProto, ctx: _Context) -> list[int] | None:
    """Explicit sizes for a ``num_outputs`` split whose last part is smaller (older opsets split
    only evenly without sizes); None when the parts are even or the dimension is unknown."""
    _, rank, dims = ctx.types.get(node.input[0], (0, None, ()))
    axis = int(_attr(node, "axis", 0))
    count = int(_attr(node, "num_outputs"))
    if rank is None or not dims:
        return None
    dim = dims[axis % rank]
    if not isinstance(dim, int) or dim % count == 0:
        return None
    chunk = math.ceil(dim / count)
    return [min(chunk, dim - i * chunk) for i in range(count)]


def _softmax_rule(node: onnx.NodeProto, ctx: _Context) -> list[onnx.NodeProto]:
    """Below 13 the op flattens its input to 2-D at ``axis``; over the last axis that is the 13+
    meaning, so the axis is made the last one (by a transpose around the op when it is not)."""
    if ctx.target >= 13 or ctx.source < 13:
        return [node]
    rank = ctx.rank(node.input[0])
    axis = int(_attr(node, "axis", -1))
    if axis == -1 or (rank is not None and axis % rank == rank - 1):
        return [_copy(node, axis=-1 if rank is None else rank - 1)]
    if rank is None:
        raise _refuse(node, ctx, f"axis {axis} is not the last one and the input's rank is unknown")
    axis %= rank
    perm = [d for d in range(rank) if d != axis] + [axis]
    inverse = [perm.index(d) for d in range(rank)]
    moved, result = ctx.fresh("moved"), ctx.fresh("result")
    return [
        _node("Transpose", [node.input[0]], [moved], ctx.fresh("transpose"), perm=perm),
        _node(node.op_type, [moved], [result], node.name or ctx.fresh(node.op_type), axis=rank - 1),
        _node("Transpose", [result], [node.output[0]], ctx.fresh("transpose"), perm=inverse),
    ]


def _reduce(op: str, x: str, axes: Sequence[int], out: str, ctx: _Context) -> onnx.NodeProto:
    """A keepdims reduction written in the form the target opset takes."""
    if ctx.target >= _AXES_INPUT_SINCE[op]:
        return _node(op, [x, ctx.const(np.array(axes, dtype=np.int64), "axes")], [out], ctx.fresh(op), keepdims=1)
    return _node(op, [x], [out], ctx.fresh(op), axes=list(axes), keepdims=1)


def _scalar(value: float, like: str, ctx: _Context, hint: str) -> str:
    dtype = helper.tensor_dtype_to_np_dtype(ctx.elem(like))
    return ctx.const(np.array(value, dtype=dtype), hint)


def _layer_norm_rule(node: onnx.NodeProto, ctx: _Context) -> list[onnx.NodeProto]:
    if ctx.target >= 17:
        return [node]
    x = node.input[0]
    axis = int(_attr(node, "axis", -1))
    rank = ctx.rank(x)
    if axis == -1:
        axes = [-1]
    elif rank is None:
        raise _refuse(node, ctx, f"axis {axis} needs the input's rank, which is unknown")
    else:
        axes = list(range(axis % rank, rank))
    eps = float(_attr(node, "epsilon", 1e-5))
    f = ctx.fresh
    mean, centered, squared, var, shifted, std, inv, normed = (
        f(n) for n in ("mean", "centered", "sq", "var", "shifted", "std", "inv", "normed")
    )
    outputs = list(node.output) + [""] * (3 - len(node.output))
    has_bias = len(node.input) > 2 and bool(node.input[2])
    scaled = f("scaled") if has_bias else outputs[0]
    nodes = [
        _reduce("ReduceMean", x, axes, mean, ctx),
        _node("Sub", [x, mean], [centered], f("sub")),
        _node("Mul", [centered, centered], [squared], f("mul")),
        _reduce("ReduceMean", squared, axes, var, ctx),
        _node("Add", [var, _scalar(eps, x, ctx, "epsilon")], [shifted], f("add")),
        _node("Sqrt", [shifted], [std], f("sqrt")),
        _node("Reciprocal", [std], [inv], f("reciprocal")),
        _node("Mul", [centered, inv], [normed], f("mul")),
        _node("Mul", [normed, node.input[1]], [scaled], f("mul")),
    ]
    if has_bias:
        nodes.append(_node("Add", [scaled, node.input[2]], [outputs[0]], f("add")))
    if outputs[1]:
        nodes.append(_node("Identity", [mean], [outputs[1]], f("identity")))
    if outputs[2]:
        nodes.append(_node("Identity", [inv], [outputs[2]], f("identity")))
    return nodes


def _gelu_rule(node: onnx.NodeProto, ctx: _Context) -> list[onnx.NodeProto]:
    if ctx.target >= 20:
        return [node]
    x, f = node.input[0], ctx.fresh
    nodes: list[onnx.NodeProto] = []
    if _attr(node, "approximate", b"none") in (b"tanh", "tanh"):
        cube, inner, scaled, t = f("cube"), f("inner"), f("scaled"), f("tanh")
        nodes += [
            _node("Mul", [x, x], [sq := f("sq")], f("mul")),
            _node("Mul", [sq, x], [cube], f("mul")),
            _node("Mul", [cube, _scalar(0.044715, x, ctx, "c")], [c3 := f("c3")], f("mul")),
            _node("Add", [x, c3], [inner], f("add")),
            _node("Mul", [inner, _scalar(math.sqrt(2.0 / math.pi), x, ctx, "k")], [scaled], f("mul")),
            _node("Tanh", [scaled], [t], f("tanh")),
        ]
        core = t
    else:
        nodes += [
            _node("Mul", [x, _scalar(1.0 / math.sqrt(2.0), x, ctx, "k")], [scaled := f("scaled")], f("mul")),
            _node("Erf", [scaled], [erf := f("erf")], f("erf")),
        ]
        core = erf
    nodes += [
        _node("Add", [core, _scalar(1.0, x, ctx, "one")], [plus := f("plus")], f("add")),
        _node("Mul", [x, plus], [prod := f("prod")], f("mul")),
        _node("Mul", [prod, _scalar(0.5, x, ctx, "half")], [node.output[0]], f("mul")),
    ]
    return nodes


def _axes_rule_since(since: int) -> Callable[[onnx.NodeProto, _Context], list[onnx.NodeProto]]:
    return lambda node, ctx: _axes_rule(node, ctx, since)


_RULES: dict[str, Callable[[onnx.NodeProto, _Context], list[onnx.NodeProto]]] = {
    **{op: _axes_rule_since(since) for op, since in _AXES_INPUT_SINCE.items()},
    "Split": _split_rule,
    **{op: _softmax_rule for op in _SOFTMAX_FAMILY},
    "LayerNormalization": _layer_norm_rule,
    "Gelu": _gelu_rule,
}


#: The type a node of these ops is computed in where the release's kernel lacks the node's own
#: (both casts exact for the types recorded missing: bool and int32).
_TYPE_CARRIERS = {"Trilu": TensorProto.INT64}


def _type_rule(node: onnx.NodeProto, ctx: _Context) -> list[onnx.NodeProto]:
    """The node computed in its op's carrier type when the release has no kernel for its own."""
    missing = ctx.missing_types.get(node.op_type, ())
    carrier = _TYPE_CARRIERS.get(node.op_type)
    elem = ctx.types.get(node.input[0], (0, None, ()))[0] if node.input and node.input[0] else 0
    if carrier is None or not elem or TensorProto.DataType.Name(elem) not in missing:
        return [node]
    wide, result = ctx.fresh(f"{node.input[0]}_{TensorProto.DataType.Name(carrier).lower()}"), ctx.fresh("result")
    computed = _copy(node, inputs=[wide, *node.input[1:]])
    del computed.output[:]
    computed.output.append(result)
    return [
        _node("Cast", [node.input[0]], [wide], ctx.fresh("cast"), to=carrier),
        computed,
        _node("Cast", [result], [node.output[0]], ctx.fresh("cast"), to=elem),
    ]


#: Attribute values a version added to an attribute its predecessors already had: below that opset
#: the value means nothing (and a release's kernel for the older version may refuse it or compute
#: otherwise), so a node holding one is refused.
_VALUES_SINCE: dict[tuple[str, str], dict[str, int]] = {
    ("Resize", "coordinate_transformation_mode"): {"half_pixel_symmetric": 19},
    ("Pad", "mode"): {"wrap": 19},
    ("ScatterND", "reduction"): {"max": 18, "min": 18},
    ("ScatterElements", "reduction"): {"max": 18, "min": 18},
}

_FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)

#: GridSample's mode names before opset 20 (4-D inputs only there).
_GRID_SAMPLE_MODES_BEFORE_20 = {"linear": "bilinear", "cubic": "bicubic", "nearest": "nearest"}


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _older_values(node: onnx.NodeProto, ctx: _Context, older) -> onnx.NodeProto:
    """The node in the values the older version ``older`` gives its attributes the same meaning
    with, where a newer version renamed a value or changed what one means; refused where the
    older version has no value that means the same."""
    for a in node.attribute:
        since = _VALUES_SINCE.get((node.op_type, a.name), {}).get(_text(helper.get_attribute_value(a)))
        if since is not None and ctx.target < since <= ctx.source:
            value = _text(helper.get_attribute_value(a))
            raise _refuse(node, ctx, f"{a.name}={value!r} exists only from opset {since} on", since)
    if node.op_type == "GridSample" and older.since_version < 20 <= ctx.source:
        mode = _text(_attr(node, "mode", "linear"))
        rank = ctx.rank(node.input[0])
        if rank != 4:
            shown = "unknown" if rank is None else str(rank)
            raise _refuse(node, ctx, f"before opset 20 it samples 4-D inputs only, and its input's rank is {shown}", 20)
        if mode not in _GRID_SAMPLE_MODES_BEFORE_20:
            raise _refuse(node, ctx, f"mode={mode!r} has no form there", 20)
        return _copy(node, mode=_GRID_SAMPLE_MODES_BEFORE_20[mode])
    if node.op_type == "RoiAlign" and older.since_version < 16 <= ctx.source:
        mode = _text(_attr(node, "coordinate_transformation_mode", "half_pixel"))
        if mode != "output_half_pixel":
            raise _refuse(
                node,
                ctx,
                f"coordinate_transformation_mode={mode!r} (the default from opset 16) shifts the input coordinates "
                "by half a pixel, which no version before 16 does",
                16,
            )
        return _copy(node, drop=("coordinate_transformation_mode",))
    if node.op_type == "DFT" and older.since_version < 20 <= ctx.source:
        return _dft_axis_attribute(node, ctx)
    if (
        node.op_type in ("AveragePool", "MaxPool")
        and older.since_version < 22 <= ctx.source
        and _attr(node, "ceil_mode", 0)
    ):
        return _ceil_windows_before_22(node, ctx)
    if node.op_type == "Mod" and older.since_version < 28 <= ctx.source and not _attr(node, "fmod", 0):
        if ctx.types.get(node.input[0], (0, None, ()))[0] in _FLOAT_TYPES:
            raise _refuse(
                node, ctx, "fmod=0 on floating-point inputs (floored, from opset 28) does not exist there", 28
            )
    if node.op_type == "GroupNormalization" and older.since_version < 21 <= ctx.source:
        raise _refuse(node, ctx, "before opset 21 its scale and bias are per group, from 21 per channel", 21)
    return node


def _ceil_windows_before_22(node: onnx.NodeProto, ctx: _Context) -> onnx.NodeProto:
    """A ``ceil_mode`` pool of opset 22, which drops a last window that would start in the right
    padding, for versions that keep it: where every such extra window is dropped the pool is the
    ``ceil_mode=0`` one; where none is, it is the same; otherwise, or with spatial sizes unknown,
    refused."""
    auto_pad = _text(_attr(node, "auto_pad", "NOTSET"))
    if auto_pad not in ("NOTSET", "VALID"):
        return node
    kernel = [int(k) for k in _attr(node, "kernel_shape", [])]
    n = len(kernel)
    _, rank, dims = ctx.types.get(node.input[0], (0, None, ()))
    spatial = list(dims[2:]) if rank else []
    if len(spatial) != n or not all(isinstance(d, int) and d > 0 for d in spatial):
        raise _refuse(
            node,
            ctx,
            "ceil_mode=1 over spatial sizes that are unknown: from opset 22 a last window that would start in the "
            "right padding is dropped, which older versions keep",
            22,
        )
    strides = [int(v) for v in _attr(node, "strides", [1] * n)]
    dilations = [int(v) for v in _attr(node, "dilations", [1] * n)]
    pads = [int(v) for v in _attr(node, "pads", [0] * 2 * n)] if auto_pad == "NOTSET" else [0] * 2 * n
    dropped = []
    for i in range(n):
        span = spatial[i] + pads[i] + pads[i + n] - ((kernel[i] - 1) * dilations[i] + 1)
        if span >= 0 and span % strides[i]:  # ceil_mode adds a window here
            dropped.append((span // strides[i] + 1) * strides[i] >= pads[i] + spatial[i])
    if dropped and all(dropped):
        return _copy(node, ceil_mode=0)
    if any(dropped):
        raise _refuse(
            node,
            ctx,
            "ceil_mode=1 adds a last window that opset 22 drops (it starts in the right padding) along some "
            "spatial axes only",
            22,
        )
    return node


def _dft_axis_attribute(node: onnx.NodeProto, ctx: _Context) -> onnx.NodeProto:
    """DFT's ``axis`` input (opset 20, default -2) as the attribute of opsets 17-19 (default 1)."""
    given = _constant_input(node, 2, ctx, "axis")
    axis = -2 if given is None else int(given.reshape(-1)[0])
    rank = ctx.rank(node.input[0])
    if axis < 0:
        if rank is None:
            raise _refuse(node, ctx, f"axis {axis} needs the input's rank, which is unknown", 20)
        axis += rank
    inputs = list(node.input[:2])
    while inputs and not inputs[-1]:
        inputs.pop()
    return _copy(node, inputs=inputs, axis=axis)


def _without_default_attributes(node: onnx.NodeProto, newer, older) -> onnx.NodeProto:
    """The node without the attributes the older version lacks that it sets to what the newer
    version does by default (``Cast``'s ``saturate=1``, ``Resize``'s ``antialias=0``,
    ``AveragePool``'s ``dilations`` of ones): exporters write them out, and the older version
    computes the same without them."""
    dropped = []
    for a in node.attribute:
        if a.name in older.attributes or a.name not in newer.attributes:
            continue
        value = helper.get_attribute_value(a)
        default = newer.attributes[a.name].default_value
        if default.name and helper.get_attribute_value(default) == value:
            dropped.append(a.name)
        elif a.name == "dilations" and list(value) and all(d == 1 for d in value):
            dropped.append(a.name)
    return _copy(node, drop=dropped) if dropped else node


def _type_string(elem: int) -> str:
    return f"tensor({TensorProto.DataType.Name(elem).lower()})"


def _fits(node: onnx.NodeProto, schema, ctx: _Context) -> str | None:
    """Why the node does not fit the older definition ``schema``, or None when it does."""
    unknown = sorted(a.name for a in node.attribute if a.name not in schema.attributes)
    if unknown:
        return f"attribute(s) {unknown} do not exist there"
    formal = list(schema.inputs)
    variadic = bool(formal) and formal[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic
    if not variadic and len([i for i in node.input]) > len(formal):
        return f"it takes {len(node.input)} inputs, that version at most {len(formal)}"
    if len(node.output) > len(schema.outputs) and not (
        schema.outputs and schema.outputs[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic
    ):
        return f"it has {len(node.output)} outputs, that version at most {len(schema.outputs)}"
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    for i, name in enumerate(node.input):
        if not name or name not in ctx.types or not formal:
            continue
        param = formal[min(i, len(formal) - 1)].type_str
        kinds = allowed.get(param, {param})
        have = _type_string(ctx.types[name][0])
        if ctx.types[name][0] and have not in kinds:
            return f"input {name!r} is {have}, which that version does not take"
    outputs = list(schema.outputs)
    for i, name in enumerate(node.output):
        if not name or name not in ctx.types or not outputs or not ctx.types[name][0]:
            continue
        param = outputs[min(i, len(outputs) - 1)].type_str
        have = _type_string(ctx.types[name][0])
        if have not in allowed.get(param, {param}):
            return f"output {name!r} is {have}, which that version does not make"
    return None


def _convert_node(node: onnx.NodeProto, ctx: _Context) -> list[onnx.NodeProto]:
    if node.domain not in ("", "ai.onnx"):
        raise _refuse(node, ctx, f"domain {node.domain!r} is not standard ONNX")
    node = _convert_subgraphs(node, ctx)
    if ctx.target == ctx.source:
        return _type_rule(node, ctx)
    rule = _RULES.get(node.op_type)
    if rule is not None:
        converted = rule(node, ctx)
        for new in converted:  # what a rule emits must itself exist at the target
            if new is not node and _schema(new.op_type, ctx.target) is None:
                raise _refuse(node, ctx, f"its rewrite needs {new.op_type}, which does not exist there")
        if converted != [node]:
            return converted
    source, target = _schema(node.op_type, ctx.source), _schema(node.op_type, ctx.target)
    if target is None:
        raise _refuse(node, ctx, "the op does not exist there and has no rewrite into older ops")
    if source is not None and source.since_version != target.since_version:
        node = _older_values(node, ctx, target)
        node = _without_default_attributes(node, source, target)
        why = _fits(node, target, ctx)
        if why is not None:
            raise _refuse(node, ctx, why)
    return _type_rule(node, ctx)


def _convert_subgraphs(node: onnx.NodeProto, ctx: _Context) -> onnx.NodeProto:
    if not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return node
    new = onnx.NodeProto()
    new.CopyFrom(node)
    for a in new.attribute:
        graphs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
        for g in graphs:
            nodes = [out for n in g.node for out in _convert_node(n, ctx)]
            del g.node[:]
            g.node.extend(nodes)
    return new


def _known_types(model: onnx.ModelProto) -> dict[str, tuple[int, int | None, tuple]]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - without inference the rules that need ranks refuse by name
        inferred = model
    types: dict[str, tuple[int, int | None, tuple]] = {}
    g = inferred.graph
    for v in [*g.input, *g.value_info, *g.output]:
        tt = v.type.tensor_type
        rank = len(tt.shape.dim) if tt.HasField("shape") else None
        dims = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in tt.shape.dim) if rank else ()
        types[v.name] = (tt.elem_type, rank, dims)
    for init in g.initializer:
        types[init.name] = (init.data_type, len(init.dims), tuple(init.dims))
    return types


def _graph_constants(graph: onnx.GraphProto, opset: int) -> dict[str, np.ndarray]:
    """Initializers, Constant nodes and what is computed from Constant nodes alone (the dynamo
    exporter's unoptimized graphs build a reduction's axes with Reshape of Constants)."""
    from .autodiff import constant_values

    return constant_values(graph, opset)


def _default_opset(model: onnx.ModelProto) -> int:
    versions = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    others = [o.domain for o in model.opset_import if o.domain not in ("", "ai.onnx")]
    if others:
        raise VersioningError(f"the model imports operator domain(s) {others}; plans may use only standard ONNX ops")
    if not versions:
        raise VersioningError("the model imports no default-domain opset")
    return versions[0]


def convert_model(
    model_bytes: bytes,
    target_opset: int,
    *,
    ir_version: int | None = None,
    missing_types: Mapping[str, Collection[str]] | None = None,
) -> bytes:
    """The model rewritten at ``target_opset`` (a model already at or below it keeps its opset),
    with ``ir_version`` (default: the lowest IR version that carries the resulting opset).
    ``missing_types`` (op -> ``TensorProto`` type names, a release's
    :data:`~emulator.releases.missing_kernels.MISSING_TYPE_KERNELS`) has nodes of those ops and
    types computed in a type the release takes."""
    if target_opset < MIN_TARGET_OPSET:
        raise VersioningError(f"opset {target_opset} is below the lowest supported target ({MIN_TARGET_OPSET})")
    model = onnx.ModelProto.FromString(model_bytes)
    source = _default_opset(model)
    target = min(source, target_opset)
    missing = {op: set(types) for op, types in (missing_types or {}).items() if types}
    if target < source or {n.op_type for n in _all_nodes(model.graph)} & set(missing):
        ctx = _Context(source, target, _known_types(model), _graph_constants(model.graph, source), missing)
        ctx.used = {n for node in model.graph.node for n in (*node.input, *node.output)}
        ctx.used |= {i.name for i in model.graph.initializer} | {i.name for i in model.graph.input}
        nodes = [out for node in model.graph.node for out in _convert_node(node, ctx)]
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        model.graph.initializer.extend(ctx.initializers)
        del model.graph.value_info[:]  # inferred at the source opset; the checker re-infers
        for o in model.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = target
    model.ir_version = ir_version if ir_version is not None else ir_version_for_opset(target)
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as exc:  # noqa: BLE001 - onnx raises ValidationError, InferenceError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise VersioningError(
            f"the graph {model.graph.name!r} rewritten at opset {target} is not valid ONNX: {first}"
        ) from None
    return model.SerializeToString()


def _kernel_ceiling(models: Sequence[onnx.ModelProto], runtime_version: str, target: int) -> int:
    """The highest opset <= ``target`` at which every op of ``models`` has a kernel in the release."""
    missing = MISSING_KERNELS.get(version_tuple(runtime_version)[:2], {})
    ops = {n.op_type for m in models for n in _all_nodes(m.graph)}
    while True:
        lower = target
        for op in ops & set(missing):
            schema = _schema(op, target)
            if schema is not None and schema.since_version >= missing[op]:
                lower = min(lower, schema.since_version - 1)
        if lower == target:
            return target
        target = lower


def _all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for a in node.attribute:
            for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs:
                yield from _all_nodes(g)


def versioned_plan(plan: Plan, runtime_version: str, *, opset: int | None = None) -> Plan:
    """The plan for onnxruntime ``runtime_version`` (its minor release): every graph at the highest
    opset that release runs with a kernel for each of its ops (or at ``opset``), at the IR version
    it loads, claiming only that release."""
    max_opset = max_opset_for_runtime(runtime_version)
    if opset is None:
        models = [onnx.ModelProto.FromString(g) for g in plan.graphs().values()]
        target = _kernel_ceiling(models, runtime_version, min(plan.metadata.opset, max_opset))
    else:
        target = opset
    if target > max_opset:
        raise VersioningError(f"onnxruntime {runtime_version} runs at most opset {max_opset}, not {target}")
    ir = min(ir_version_for_opset(target), max_ir_version_for_runtime(runtime_version))
    missing_types = MISSING_TYPE_KERNELS.get(version_tuple(runtime_version)[:2], {})
    graphs = plan.graphs()
    converted: dict[str, bytes] = {}
    for name in GRAPH_FIELDS:
        try:
            converted[name] = convert_model(graphs[name], target, ir_version=ir, missing_types=missing_types)
        except VersioningError as exc:
            raise VersioningError(
                f"plan {plan.name!r}, graph {name!r}, for onnxruntime {runtime_version}: {exc}"
            ) from None
    low, high = release_range(runtime_version)
    return dataclasses.replace(
        plan,
        work=converted["work"],
        server=dataclasses.replace(
            plan.server, **cast(dict[str, Any], {name: converted[name] for name in GRAPH_FIELDS if name != "work"})
        ),
        metadata=dataclasses.replace(
            plan.metadata, opset=target, ir_version=ir, min_runtime_version=low, max_runtime_version=high
        ),
    )
