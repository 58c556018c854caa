"""The inference graph rewritten for a training step, before it is differentiated.

Exporters write models for inference; a training step computes some ops differently:

* ``BatchNormalization`` normalizes with the batch's statistics (mean and population variance
  over the batch and spatial axes); its running mean and variance, when they are initializers,
  become state that the step updates with the op's momentum (the ONNX training-mode formula)
  and that the server averages like a weight. The running variance takes the unbiased batch
  variance (times n/(n-1), n the elements per channel), as torch's does;
* ``Dropout`` is active (training_mode=True) and returns its mask, which its gradient needs;
* ``MaxPool`` also returns its Indices, where its gradient goes, unless its windows tile the input
  (then the gradient finds each window's maximum itself: onnxruntime's MaxPool with Indices is
  ten times slower than without, measured on a 28x28 CNN);
* ``LayerNormalization``, ``InstanceNormalization``, ``GroupNormalization``, ``GRU`` and ``LSTM``
  are written out in elementary ops whose gradients are known (:func:`decompose`; the same
  values, so the finite-difference checks of the ops run through it too). The recurrent ops are unrolled over their (static) sequence length: one
  ``MatMul`` of the whole input sequence with the input weights, then per step a ``MatMul`` with
  the recurrent weights and the gate arithmetic.

Evaluation plans keep the original ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from .autodiff import DEFAULT_DOMAINS, Emitter, UnsupportedOpError, attr
from .gradients import tiling_pool


@dataclass
class TrainingForward:
    nodes: list[onnx.NodeProto]
    # running statistic (an initializer) -> the tensor holding its value after this step
    state_updates: dict[str, str] = field(default_factory=dict)


def training_forward(e: Emitter, nodes: Sequence[onnx.NodeProto], initializers: set[str],
                     dropout_seed: int | None = 0) -> TrainingForward:
    """Rewrite ``nodes`` for training (see the module docstring); new tensors come from ``e``.

    Each active ``Dropout`` without a seed of its own gets ``dropout_seed`` plus its position, so
    that a device's session is reproducible (onnxruntime draws a new mask every step from the
    seeded generator); ``None`` leaves the masks to onnxruntime's own randomness."""
    out = TrainingForward([])
    dropouts = 0
    for node in sequences_as_slices(e, nodes):
        if node.domain not in DEFAULT_DOMAINS:
            out.nodes.append(node)
            continue
        if node.op_type == "BatchNormalization":
            out.nodes += _emitted(e, lambda: _batch_norm(e, node, initializers, out.state_updates))
        elif node.op_type in DECOMPOSED:
            out.nodes += decompose(e, [node])
        elif node.op_type == "Dropout":
            out.nodes.append(_dropout(e, node, None if dropout_seed is None else dropout_seed + dropouts))
            dropouts += 1
        elif node.op_type == "MaxPool" and (len(node.output) < 2 or not node.output[1]) and tiling_pool(e, node) is None:
            rewritten = onnx.NodeProto()
            rewritten.CopyFrom(node)
            del rewritten.output[:]
            rewritten.output.extend([node.output[0], e.fresh(f"{node.output[0]}_indices")])
            out.nodes.append(rewritten)
        else:
            out.nodes.append(node)
    return out


def decompose(e: Emitter, nodes: Sequence[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` with each op of :data:`DECOMPOSED` (the normalizations, ``GRU`` and ``LSTM``) written
    out in elementary ops computing the same values (others unchanged)."""
    out: list[onnx.NodeProto] = []
    for node in sequences_as_slices(e, nodes):
        emit = DECOMPOSED.get(node.op_type) if node.domain in DEFAULT_DOMAINS else None
        if emit is None or (node.op_type == "LayerNormalization" and any(node.output[1:])):
            out.append(node)
        else:
            out += _emitted(e, lambda: emit(e, node))
    return out


def sequences_as_slices(e: Emitter, nodes: Sequence[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` with each ``SequenceAt`` of a ``SplitToSequence`` at a constant position written as the
    ``Slice`` (and ``Squeeze``) it reads: the dynamo exporter's unoptimized graphs split GPT-2's fused
    query, key and value so, and a gradient flows through tensors, not sequences. A sequence read
    otherwise is left as it is (and its reader refused on a differentiable path)."""
    splits = {n.output[0]: n for n in nodes if n.op_type == "SplitToSequence" and n.domain in DEFAULT_DOMAINS}
    if not splits:
        return list(nodes)
    out = []
    for node in nodes:
        source = splits.get(node.input[0]) if node.op_type == "SequenceAt" and node.domain in DEFAULT_DOMAINS else None
        bounds = _split_bounds(e, source) if source is not None else None
        position = e.value(node.input[1]) if source is not None else None
        if bounds is None or position is None or not -len(bounds) <= int(position) < len(bounds):
            out.append(node)
            continue
        start, end = bounds[int(position)]
        axis = int(attr(source, "axis", 0))
        squeeze = (len(source.input) < 2 or not source.input[1]) and not int(attr(source, "keepdims", 1))
        sliced = e.fresh(f"{node.output[0]}_slice") if squeeze else node.output[0]
        out.append(helper.make_node("Slice", [source.input[0], e.ints([start]), e.ints([end]), e.ints([axis])], [sliced],
                                    name=node.name))
        if squeeze:
            out.append(helper.make_node("Squeeze", [sliced, e.ints([axis])], [node.output[0]], name=e.fresh(f"{node.name}_squeeze")))
    return out


def _split_bounds(e: Emitter, node: onnx.NodeProto) -> list[tuple[int, int]] | None:
    """Each part's (start, end) along the axis of a SplitToSequence, or None when they are not static."""
    shape = e.shape(node.input[0])
    axis = int(attr(node, "axis", 0))
    dim = shape[axis] if shape is not None and -len(shape) <= axis < len(shape) else None
    split = e.value(node.input[1]) if len(node.input) > 1 and node.input[1] else None
    if len(node.input) > 1 and node.input[1] and split is None:
        return None
    if split is not None and np.ndim(split) == 1:
        sizes = [int(v) for v in split]
    elif not isinstance(dim, int):
        return None
    else:
        step = int(split) if split is not None else 1  # a scalar: chunks of that size, the last one shorter
        sizes = [min(step, dim - k) for k in range(0, dim, step)]
    ends = np.cumsum(sizes).tolist()
    return [(int(end - size), int(end)) for size, end in zip(sizes, ends)]


def _emitted(e: Emitter, emit) -> list[onnx.NodeProto]:
    saved, e.nodes = e.nodes, []
    try:
        emit()
        return e.nodes
    finally:
        e.nodes = saved


def _dropout(e: Emitter, node: onnx.NodeProto, seed: int | None) -> onnx.NodeProto:
    x = node.input[0]
    dtype = helper.tensor_dtype_to_np_dtype(e.elem_type(x))
    ratio = node.input[1] if len(node.input) > 1 and node.input[1] else e.const(np.array(0.5, dtype=dtype), "ratio")
    training = e.const(np.array(True), "training_mode")
    mask = node.output[1] if len(node.output) > 1 and node.output[1] else e.fresh(f"{node.output[0]}_mask")
    extra = [a for a in node.attribute if a.name == "seed"]
    if not extra and seed is not None:
        extra = [helper.make_attribute("seed", int(seed))]
    rewritten = helper.make_node("Dropout", [x, ratio, training], [node.output[0], mask], name=node.name)
    rewritten.attribute.extend(extra)
    return rewritten


def _channel_shape(e: Emitter, x: str) -> tuple[int, list[int]]:
    rank = e.rank(x)
    if rank is None or rank < 2:
        raise ValueError(f"normalization input {x!r} needs a known rank >= 2")
    return rank, [1, -1] + [1] * (rank - 2)


def _batch_norm(e: Emitter, node: onnx.NodeProto, initializers: set[str], updates: dict[str, str]) -> None:
    x, scale, bias, mean_in, var_in = node.input[:5]
    eps = float(attr(node, "epsilon", 1e-5))
    momentum = float(attr(node, "momentum", 0.9))
    rank, cshape = _channel_shape(e, x)
    axes = [0, *range(2, rank)]
    mean = e.reduce("ReduceMean", x, axes, keepdims=True, hint="bn_mean")
    centred = e.op("Sub", [x, mean], hint="bn_centred")
    var = e.reduce("ReduceMean", e.op("Mul", [centred, centred]), axes, keepdims=True, hint="bn_var")
    inv = e.op("Reciprocal", [e.op("Sqrt", [e.op("Add", [var, e.scalar(eps, x)])])])
    gain = e.op("Mul", [inv, e.op("Reshape", [scale, e.ints(cshape)])])
    e.op("Add", [e.op("Mul", [centred, gain]), e.op("Reshape", [bias, e.ints(cshape)])], out=node.output[0])
    if var_in in initializers:
        var = _unbiased(e, x, mean, var)
    for stat, batch in ((mean_in, mean), (var_in, var)):
        if stat in initializers:
            flat = e.op("Reshape", [batch, e.ints([-1])])
            kept = e.op("Mul", [stat, e.scalar(momentum, x)])
            updates[stat] = e.op("Add", [kept, e.op("Mul", [flat, e.scalar(1.0 - momentum, x)])], hint=f"{stat}_next")


def _unbiased(e: Emitter, x: str, mean: str, var: str) -> str:
    """The batch variance ``var`` times n/(n-1), n the elements per channel (read at run time: the
    batch is dynamic), as torch updates the running variance; n = 1 keeps the (zero) variance
    where torch refuses the batch, so that a device's one-example last batch cannot make it infinite."""
    elem = e.elem_type(x)
    n = e.op("Div", [e.op("Cast", [e.op("Size", [x])], to=elem), e.op("Cast", [e.op("Size", [mean])], to=elem)], hint="bn_n")
    less_one = e.op("Max", [e.op("Sub", [n, e.scalar(1.0, x)]), e.scalar(1.0, x)])
    return e.op("Mul", [var, e.op("Div", [n, less_one])], hint="bn_var_unbiased")


def _layer_norm(e: Emitter, node: onnx.NodeProto) -> None:
    x, scale = node.input[0], node.input[1]
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    rank = e.rank(x)
    if rank is None:
        raise ValueError(f"LayerNormalization {node.name!r} needs an input of known rank")
    axis = int(attr(node, "axis", -1))
    axis = axis + rank if axis < 0 else axis
    axes = list(range(axis, rank))
    eps = float(attr(node, "epsilon", 1e-5))
    mean = e.reduce("ReduceMean", x, axes, keepdims=True, hint="ln_mean")
    centred = e.op("Sub", [x, mean], hint="ln_centred")
    var = e.reduce("ReduceMean", e.op("Mul", [centred, centred]), axes, keepdims=True, hint="ln_var")
    normed = e.op("Div", [centred, e.op("Sqrt", [e.op("Add", [var, e.scalar(eps, x)])])])
    if bias is None:
        e.op("Mul", [normed, scale], out=node.output[0])
    else:
        e.op("Add", [e.op("Mul", [normed, scale]), bias], out=node.output[0])


def _normalized(e: Emitter, x: str, axes: list[int], eps: float, hint: str) -> str:
    """(x - mean) / sqrt(var + eps) over ``axes`` (the population variance)."""
    mean = e.reduce("ReduceMean", x, axes, keepdims=True, hint=f"{hint}_mean")
    centred = e.op("Sub", [x, mean], hint=f"{hint}_centred")
    var = e.reduce("ReduceMean", e.op("Mul", [centred, centred]), axes, keepdims=True, hint=f"{hint}_var")
    return e.op("Div", [centred, e.op("Sqrt", [e.op("Add", [var, e.scalar(eps, x)])])])


def _instance_norm(e: Emitter, node: onnx.NodeProto) -> None:
    x, scale, bias = node.input[:3]
    rank, cshape = _channel_shape(e, x)
    normed = _normalized(e, x, list(range(2, rank)), float(attr(node, "epsilon", 1e-5)), "in")
    scaled = e.op("Mul", [normed, e.op("Reshape", [scale, e.ints(cshape)])])
    e.op("Add", [scaled, e.op("Reshape", [bias, e.ints(cshape)])], out=node.output[0])


def _group_norm(e: Emitter, node: onnx.NodeProto) -> None:
    """Statistics over each group of channels and the spatial axes; the scale and bias are per group
    before opset 21 (the op's first, since deprecated, definition) and per channel from 21 on."""
    x, scale, bias = node.input[:3]
    rank, cshape = _channel_shape(e, x)
    groups = int(attr(node, "num_groups"))
    grouped = e.op("Reshape", [x, e.ints([0, groups, -1])])
    normed = _normalized(e, grouped, [2], float(attr(node, "epsilon", 1e-5)), "gn")
    if e.opset < 21:
        per_group = [1, groups, 1]
        normed = e.op("Add", [e.op("Mul", [normed, e.op("Reshape", [scale, e.ints(per_group)])]),
                              e.op("Reshape", [bias, e.ints(per_group)])])
        e.op("Reshape", [normed, e.shape_of(x)], out=node.output[0])
        return
    back = e.op("Reshape", [normed, e.shape_of(x)])
    scaled = e.op("Mul", [back, e.op("Reshape", [scale, e.ints(cshape)])])
    e.op("Add", [scaled, e.op("Reshape", [bias, e.ints(cshape)])], out=node.output[0])


@dataclass(frozen=True)
class _Recurrent:
    """What unrolling a GRU/LSTM needs to know of it."""

    seq: int
    hidden: int
    directions: tuple[str, ...]  # ("forward",), ("reverse",) or both


def _recurrent_checks(e: Emitter, node: onnx.NodeProto, gates: int) -> _Recurrent:
    """How to unroll a GRU/LSTM with the default activations, either direction or both, in layout 0
    (torch's exporters write batch_first with Transpose nodes around it; onnxruntime runs no other)."""
    def refuse(why: str) -> None:
        raise UnsupportedOpError(node.op_type, node.name, why)

    direction = attr(node, "direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    if int(attr(node, "layout", 0)) != 0:
        refuse("is unrolled with layout=0 only (sequence first, as torch's exporters write it; onnxruntime runs no other)")
    if attr(node, "clip") is not None or attr(node, "activations") is not None:
        refuse("is unrolled without clip and with the default activations only")
    if len(node.input) > 4 and node.input[4]:
        refuse("is unrolled without sequence_lens only (every sequence has the full length; pad instead of packing)")
    if node.op_type == "LSTM" and ((len(node.input) > 7 and node.input[7]) or int(attr(node, "input_forget", 0))):
        refuse("is unrolled without peepholes or input_forget only")
    shape = e.shape(node.input[0])
    if shape is None or len(shape) != 3 or not isinstance(shape[0], int):
        refuse("needs an input of static sequence length to be unrolled")
    hidden = attr(node, "hidden_size")
    if hidden is None:
        wshape = e.shape(node.input[1])
        hidden = wshape[1] // gates if wshape is not None and isinstance(wshape[1], int) else None
    if hidden is None:
        refuse("needs hidden_size")
    directions = {"forward": ("forward",), "reverse": ("reverse",), "bidirectional": ("forward", "reverse")}[direction]
    return _Recurrent(int(shape[0]), int(hidden), directions)


def _cols(e: Emitter, t: str, start: int, end: int) -> str:
    return e.op("Slice", [t, e.ints([start]), e.ints([end]), e.ints([-1])])


def _direction(e: Emitter, t: str, d: int) -> str:
    """Direction ``d``'s slice of a weight, bias or state stacked over the directions (axis 0)."""
    return e.op("Squeeze", [e.op("Slice", [t, e.ints([d]), e.ints([d + 1]), e.ints([0])]), e.ints([0])])


def _recurrent_setup(e: Emitter, node: onnx.NodeProto, rec: _Recurrent, gates: int, d: int) -> tuple[str, str, str | None]:
    """For direction ``d``: (the input sequence [seq, batch, in] times the input weights plus the
    input bias [seq, batch, gates*H], the recurrent weights transposed [H, gates*H], the recurrent
    bias or None)."""
    x, w, r = node.input[:3]
    hidden = rec.hidden
    xw = e.op("MatMul", [x, e.op("Transpose", [_direction(e, w, d)], perm=[1, 0])])
    rt = e.op("Transpose", [_direction(e, r, d)], perm=[1, 0])
    rb = None
    if len(node.input) > 3 and node.input[3]:
        b = _direction(e, node.input[3], d)
        xw = e.op("Add", [xw, _cols(e, b, 0, gates * hidden)])
        rb = _cols(e, b, gates * hidden, 2 * gates * hidden)
    return xw, rt, rb


def _initial(e: Emitter, node: onnx.NodeProto, rec: _Recurrent, index: int, d: int) -> str:
    """Direction ``d``'s initial state [batch, H]: the node's input (stacked over the directions) or zeros."""
    if len(node.input) > index and node.input[index]:
        return _direction(e, node.input[index], d)
    x = node.input[0]
    batch = e.op("Slice", [e.op("Shape", [x]), e.ints([1]), e.ints([2])])
    dtype = helper.tensor_dtype_to_np_dtype(e.elem_type(x))
    return e.op("ConstantOfShape", [e.op("Concat", [batch, e.ints([rec.hidden])], axis=0)],
                value=onnx.numpy_helper.from_array(np.zeros(1, dtype=dtype)))


def _step_input(e: Emitter, xw: str, t: int) -> str:
    return e.op("Squeeze", [e.op("Slice", [xw, e.ints([t]), e.ints([t + 1]), e.ints([0])]), e.ints([0])])


def _steps(rec: _Recurrent, direction: str) -> list[int]:
    return list(range(rec.seq)) if direction == "forward" else list(reversed(range(rec.seq)))


def _recurrent_outputs(e: Emitter, node: onnx.NodeProto, rec: _Recurrent, hs: list[dict[int, str]],
                       finals: list[list[str]]) -> None:
    """Y [seq, directions, batch, H] from each direction's states by time step ``hs``, and the final
    states [directions, batch, H] from ``finals`` (per output, per direction)."""
    outs = list(node.output) + [""] * (3 - len(node.output))
    if outs[0]:
        steps = [e.op("Concat", [e.unsqueeze(h[t], [0, 1]) for h in hs], axis=1) for t in range(rec.seq)]
        e.op("Concat", steps, axis=0, out=outs[0])
    for out, per_direction in zip(outs[1:], finals):
        if out:
            e.op("Concat", [e.unsqueeze(f, [0]) for f in per_direction], axis=0, out=out)


def _gru(e: Emitter, node: onnx.NodeProto) -> None:
    rec = _recurrent_checks(e, node, 3)
    hdim, before_reset = rec.hidden, int(attr(node, "linear_before_reset", 0))
    hs, finals = [], []
    for d, direction in enumerate(rec.directions):
        xw, rt, rb = _recurrent_setup(e, node, rec, 3, d)
        h = _initial(e, node, rec, 5, d)
        r_zr, r_h = _cols(e, rt, 0, 2 * hdim), _cols(e, rt, 2 * hdim, 3 * hdim)
        rb_zr = None if rb is None else _cols(e, rb, 0, 2 * hdim)
        rb_h = None if rb is None else _cols(e, rb, 2 * hdim, 3 * hdim)
        states = {}
        for t in _steps(rec, direction):
            xt = _step_input(e, xw, t)
            hzr = e.op("MatMul", [h, r_zr])
            if rb_zr is not None:
                hzr = e.op("Add", [hzr, rb_zr])
            zr = e.op("Sigmoid", [e.op("Add", [_cols(e, xt, 0, 2 * hdim), hzr])])
            z, r = _cols(e, zr, 0, hdim), _cols(e, zr, hdim, 2 * hdim)
            if before_reset:
                hh = e.op("MatMul", [h, r_h])
                if rb_h is not None:
                    hh = e.op("Add", [hh, rb_h])
                inner = e.op("Mul", [r, hh])
            else:
                inner = e.op("MatMul", [e.op("Mul", [r, h]), r_h])
                if rb_h is not None:
                    inner = e.op("Add", [inner, rb_h])
            n = e.op("Tanh", [e.op("Add", [_cols(e, xt, 2 * hdim, 3 * hdim), inner])])
            h = e.op("Add", [n, e.op("Mul", [z, e.op("Sub", [h, n])])], hint="gru_h")  # (1-z)*n + z*h
            states[t] = h
        hs.append(states)
        finals.append(h)
    _recurrent_outputs(e, node, rec, hs, [finals])


def _lstm(e: Emitter, node: onnx.NodeProto) -> None:
    rec = _recurrent_checks(e, node, 4)
    hdim = rec.hidden
    hs, final_h, final_c = [], [], []
    for d, direction in enumerate(rec.directions):
        xw, rt, rb = _recurrent_setup(e, node, rec, 4, d)
        if rb is not None:  # both biases are added before the gates: fold them into the input product
            xw = e.op("Add", [xw, rb])
        h, c = _initial(e, node, rec, 5, d), _initial(e, node, rec, 6, d)
        states = {}
        for t in _steps(rec, direction):
            g = e.op("Add", [_step_input(e, xw, t), e.op("MatMul", [h, rt])])
            iof = e.op("Sigmoid", [_cols(e, g, 0, 3 * hdim)])  # gate order i, o, f, c
            i, o, f = _cols(e, iof, 0, hdim), _cols(e, iof, hdim, 2 * hdim), _cols(e, iof, 2 * hdim, 3 * hdim)
            cand = e.op("Tanh", [_cols(e, g, 3 * hdim, 4 * hdim)])
            c = e.op("Add", [e.op("Mul", [f, c]), e.op("Mul", [i, cand])], hint="lstm_c")
            h = e.op("Mul", [o, e.op("Tanh", [c])], hint="lstm_h")
            states[t] = h
        hs.append(states)
        final_h.append(h)
        final_c.append(c)
    _recurrent_outputs(e, node, rec, hs, [final_h, final_c])


DECOMPOSED = {"LayerNormalization": _layer_norm, "GRU": _gru, "LSTM": _lstm, "InstanceNormalization": _instance_norm,
              "GroupNormalization": _group_norm}


def is_float(elem_type: int) -> bool:
    return elem_type in (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)
