"""The inference graph rewritten for a training step, before it is differentiated.

Exporters write models for inference; a training step computes some ops differently:

* ``BatchNormalization`` normalizes with the batch's statistics (mean and population variance
  over the batch and spatial axes); its running mean and variance, when they are initializers,
  become state that the step updates with the op's momentum (the ONNX training-mode formula)
  and that the server averages like a weight. The running variance takes the unbiased batch
  variance (times n/(n-1), n the elements per channel), as torch's and TensorFlow's do (a model
  paddle2onnx or jax2onnx exported: the population variance, as Paddle's and Flax's do);
* ``Dropout`` is active (training_mode=True) and returns its mask, which its gradient needs (one
  of ratio 0 is the identity);
* ``MaxPool`` also returns its Indices, where its gradient goes, unless its windows tile the input
  or overlap with strides that divide it (then the gradient finds each window's first maximum
  itself: onnxruntime's MaxPool with Indices is ten times slower than without, measured on a 28x28
  CNN and on ResNet-18's first pool);
* a depthwise or dense ``Conv`` with few output positions (:data:`DEPTHWISE_TAPS_MAX_POSITIONS`,
  :data:`DENSE_TAPS_MAX_POSITIONS`) becomes a sum over its kernel offsets with the channels last
  (:func:`conv_taps`): onnxruntime's Conv and ConvTranspose work one example (and group) at a
  time, a fixed ~0.25 us per example and channel of a depthwise Conv and a matrix-vector product
  per example of a dense one on a small image: most of a MobileNet or ResNet step on 32x32 inputs;
* ``Slice`` nodes that cut one tensor into consecutive pieces become one ``Split``
  (:func:`slices_as_split`), whose gradient is one ``Concat`` instead of a padded copy per piece;
* ``LayerNormalization``, ``InstanceNormalization``, ``GroupNormalization``, ``LRN``, ``GRU``,
  ``LSTM`` and ``RNN`` are written out in elementary ops whose gradients are known (:func:`decompose`; the same
  values, so the finite-difference checks of the ops run through it too). The recurrent ops are unrolled over their (static) sequence length: one
  product of the whole input sequence with the input weights, then per step a product with the
  recurrent weights and the gate arithmetic. An LSTM's steps are differentiated as a whole
  (:func:`_lstm_steps`).

Evaluation plans keep the original ops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn, ParamSpec

import numpy as np
import onnx
from onnx import TensorProto, helper

from .emitter import DEFAULT_DOMAINS, Dim, Emitter, UnsupportedOpError, attr
from .gradients import _count, conv_geometry, pool_windows, slice_span, tiling_pool

P = ParamSpec("P")


@dataclass
class TrainingForward:
    nodes: list[onnx.NodeProto]
    # running statistic (an initializer) -> the tensor holding its value after this step
    state_updates: dict[str, str] = field(default_factory=dict)


def training_forward(
    e: Emitter,
    nodes: Sequence[onnx.NodeProto],
    initializers: set[str],
    dropout_seed: int | None = 0,
    *,
    unbiased_running_variance: bool = True,
) -> TrainingForward:
    """Rewrite ``nodes`` for training (see the module docstring); new tensors come from ``e``.

    Each active ``Dropout`` without a seed of its own gets ``dropout_seed`` plus its position, so
    that a device's session is reproducible (onnxruntime draws a new mask every step from the
    seeded generator); ``None`` leaves the masks to onnxruntime's own randomness. Without
    ``unbiased_running_variance`` a ``BatchNormalization``'s running variance takes the batch's
    population variance, as Paddle's and Flax's do."""
    out = TrainingForward([])
    dropouts = 0
    nodes = slices_as_split(e, sequences_as_slices(e, nodes))
    _note_zeros(e, nodes)
    read = _read_tensors(nodes)
    for node in nodes:
        if node.domain not in DEFAULT_DOMAINS:
            out.nodes.append(node)
            continue
        if node.op_type == "BatchNormalization":
            out.nodes += _emitted(e, _batch_norm, e, node, initializers, out.state_updates, unbiased_running_variance)
        elif node.op_type in DECOMPOSED:
            out.nodes += decompose(e, [node])
        elif node.op_type == "Dropout" and _drops_nothing(e, node, read):
            out.nodes.append(helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name))
            dropouts += 1
        elif node.op_type == "Dropout":
            out.nodes.append(_dropout(e, node, None if dropout_seed is None else dropout_seed + dropouts))
            dropouts += 1
        elif node.op_type == "Conv" and (taps := conv_taps(e, node)) is not None:
            out.nodes += _emitted(e, _conv_as_taps, e, node, taps)
        elif (
            node.op_type == "MaxPool"
            and (len(node.output) < 2 or not node.output[1])
            and tiling_pool(e, node) is None
            and pool_windows(e, node) is None
        ):
            rewritten = onnx.NodeProto()
            rewritten.CopyFrom(node)
            del rewritten.output[:]
            rewritten.output.extend([node.output[0], e.fresh(f"{node.output[0]}_indices")])
            out.nodes.append(rewritten)
        else:
            out.nodes.append(node)
    return out


def decompose(e: Emitter, nodes: Sequence[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` with each op of :data:`DECOMPOSED` (the normalizations, ``GRU``, ``LSTM`` and ``RNN``) written
    out in elementary ops computing the same values (others unchanged)."""
    out: list[onnx.NodeProto] = []
    nodes = slices_as_split(e, sequences_as_slices(e, nodes))
    _note_zeros(e, nodes)
    for node in nodes:
        emit = DECOMPOSED.get(node.op_type) if node.domain in DEFAULT_DOMAINS else None
        if emit is None or (node.op_type == "LayerNormalization" and any(node.output[1:])):
            out.append(node)
        else:
            out += _emitted(e, emit, e, node)
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
        if source is None or bounds is None or position is None or not -len(bounds) <= int(position) < len(bounds):
            out.append(node)
            continue
        start, end = bounds[int(position)]
        axis = int(attr(source, "axis", 0))
        squeeze = (len(source.input) < 2 or not source.input[1]) and not int(attr(source, "keepdims", 1))
        sliced = e.fresh(f"{node.output[0]}_slice") if squeeze else node.output[0]
        out.append(
            helper.make_node(
                "Slice", [source.input[0], e.ints([start]), e.ints([end]), e.ints([axis])], [sliced], name=node.name
            )
        )
        if squeeze:
            out.append(
                helper.make_node(
                    "Squeeze", [sliced, e.ints([axis])], [node.output[0]], name=e.fresh(f"{node.name}_squeeze")
                )
            )
    return out


def slices_as_split(e: Emitter, nodes: Sequence[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` with the ``Slice`` nodes that cut one tensor into consecutive pieces along one
    axis (constant bounds, step 1, every element in exactly one piece) written as one ``Split``,
    where the first of them was: the gradient of a Split is one Concat, where each Slice's pads its
    piece back to the whole tensor and the pieces are summed. torch's exporter cuts an LSTM's
    weights and biases so, to reorder the gates."""
    groups: dict[tuple[str, int], list[tuple[int, int, int]]] = {}  # (x, axis) -> (start, end, position)
    for k, node in enumerate(nodes):
        piece = _slice_piece(e, node)
        if piece is not None:
            axis, start, end = piece
            groups.setdefault((node.input[0], axis), []).append((start, end, k))
    replaced: dict[int, onnx.NodeProto | None] = {}  # a Slice's position -> the Split in its place (None: removed)
    for (x, axis), pieces in groups.items():
        pieces.sort(key=lambda p: p[0])
        dim = e.shape(x)[axis]  # type: ignore[index]  # static: _slice_piece checked it
        bounds = [0, *[end for _, end, _ in pieces]]
        if len(pieces) < 2 or bounds[-1] != dim or any(p[0] != b for p, b in zip(pieces, bounds)):
            continue
        first = min(k for _, _, k in pieces)
        sizes = [end - start for start, end, _ in pieces]
        outs = [nodes[k].output[0] for _, _, k in pieces]
        name = nodes[first].name
        if e.opset >= 13:
            split = helper.make_node("Split", [x, e.ints(sizes)], outs, name=name, axis=axis)
        else:
            split = helper.make_node("Split", [x], outs, name=name, axis=axis, split=sizes)
        for _, _, k in pieces:
            replaced[k] = split if k == first else None
    if not replaced:
        return list(nodes)
    out = []
    for k, node in enumerate(nodes):
        if k not in replaced:
            out.append(node)
        elif (rewritten := replaced[k]) is not None:
            out.append(rewritten)
    return out


def _slice_piece(e: Emitter, node: onnx.NodeProto) -> tuple[int, int, int] | None:
    """(axis, start, end) of a ``Slice`` of one static axis with constant bounds and step 1, else None."""
    if node.op_type != "Slice" or node.domain not in DEFAULT_DOMAINS or len(node.input) < 4:
        return None
    values = []
    for name in node.input[1:]:
        v = e.value(name)
        if v is None or np.size(v) != 1:
            return None
        values.append(int(np.reshape(v, -1)[0]))
    shape = e.shape(node.input[0])
    start, end, axis = values[:3]
    if (len(values) > 3 and values[3] != 1) or shape is None or not -len(shape) <= axis < len(shape):
        return None
    axis %= len(shape)
    dim = shape[axis]
    if not isinstance(dim, int):
        return None
    first, count, _ = slice_span(start, end, 1, dim)
    return (axis, first, first + count) if count > 0 else None


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


def _emitted(e: Emitter, emit: Callable[P, object], *args: P.args, **kwargs: P.kwargs) -> list[onnx.NodeProto]:
    """The nodes ``emit(*args, **kwargs)`` writes through ``e``, apart from those ``e`` holds already.
    The arguments are passed, not closed over: a closure over a loop's node would read whichever
    node the loop holds when it runs."""
    saved, e.nodes = e.nodes, []
    try:
        emit(*args, **kwargs)
        return e.nodes
    finally:
        e.nodes = saved


@dataclass(frozen=True)
class ConvTaps:
    """A Conv to run as a sum over its kernel offsets, channels last: ``depthwise`` (one input
    channel per group, ``c_out / c_in`` outputs each) or dense (one group)."""

    depthwise: bool
    c_in: int
    c_out: int
    kernel: list[int]
    strides: list[int]
    pads: list[int]
    dilations: list[int]
    dims: list[int]
    out_dims: list[int]


#: A depthwise Conv with at most this many output positions per channel runs as taps. onnxruntime's
#: grouped Conv (and ConvTranspose) loops over every example and channel with a small im2col and
#: Gemm each, ~0.25 us a pair whatever the size: MobileNetV2's 960-channel 1x1 layers took 7 ms
#: forward and 9 ms for dx at batch 32; as taps 0.13 ms. From 8x8 outputs up its own Conv wins
#: (measured on MobileNetV2's layers, onnxruntime 1.32, one thread: 16x16 32 channels 2.0 ms against
#: 7.0, 4x4 192 channels 1.9 against 1.0 forward).
DEPTHWISE_TAPS_MAX_POSITIONS = 16
#: Likewise for a dense Conv (one group): onnxruntime multiplies the weight with one example's
#: columns at a time, a matrix-vector product when the image is small, whereas the taps make one
#: Gemm per kernel offset over every example and position. Forward and backward at batch 32 on
#: ResNet-18's layers: 512 channels 3x3 on 1x1 6.6 ms against 25, 256 on 2x2 12.6 against 26, 128 on
#: 4x4 9.1 against 10.7; 64 on 8x8 15.3 against 12.9 (its own Conv wins from there on).
DENSE_TAPS_MAX_POSITIONS = 16


def conv_taps(e: Emitter, node: onnx.NodeProto) -> ConvTaps | None:
    """The layout of a depthwise (``group`` = input channels > 1) or dense Conv of static shapes
    small enough to run as taps (:data:`DEPTHWISE_TAPS_MAX_POSITIONS`,
    :data:`DENSE_TAPS_MAX_POSITIONS`), else None."""
    group = int(attr(node, "group", 1))
    xshape, wshape, yshape = e.shape(node.input[0]), e.shape(node.input[1]), e.shape(node.output[0])
    if (
        xshape is None
        or wshape is None
        or yshape is None
        or len(xshape) < 3
        or not all(isinstance(d, int) for d in [*xshape[1:], *wshape, *yshape[1:]])
    ):
        return None
    if e.elem_type(node.input[0]) not in (TensorProto.FLOAT, TensorProto.DOUBLE):
        return None
    depthwise = group > 1 and xshape[1] == group and wshape[1] == 1
    if not depthwise and group != 1:
        return None
    out_dims = [_known(d) for d in yshape[2:]]
    if int(np.prod(out_dims)) > (DEPTHWISE_TAPS_MAX_POSITIONS if depthwise else DENSE_TAPS_MAX_POSITIONS):
        return None
    kernel = [_known(d) for d in wshape[2:]]
    strides, pads, dil, dims = conv_geometry(e, node, node.input[0], kernel)
    return ConvTaps(depthwise, _known(xshape[1]), _known(wshape[0]), kernel, strides, pads, dil, dims, out_dims)


def _known(d: Dim) -> int:
    """A dimension the caller checked is static."""
    assert isinstance(d, int)
    return d


def _conv_as_taps(e: Emitter, node: onnx.NodeProto, g: ConvTaps) -> None:
    """The Conv as a sum over kernel offsets of (the input window at that offset) times (that
    offset's weights), with the channels last: [spatial..., N, C]. A depthwise Conv multiplies each
    window by the offset's weight per channel; a dense one multiplies it, as a matrix of all
    examples' and positions' rows, by the offset's [Cin, Cout] weight: one Gemm. Every op runs over
    contiguous rows, the Slices pick whole rows, and the gradient (Slice -> Pad, Mul or MatMul, a
    sum over leading axes) is as cheap. Strides become a reshape of each padded axis into
    (blocks, stride), so that every window is a stride-1 Slice. Offsets whose window lies in the
    padding only add zeros and are left out."""
    x, w = node.input[0], node.input[1]
    nd = len(g.kernel)
    if g.depthwise and g.c_out > g.c_in:  # output channel c*m + j reads input channel c
        m = g.c_out // g.c_in
        x = e.op("Reshape", [x, e.ints([0, g.c_in, 1, *g.dims])])
        x = e.op("Reshape", [e.op("Expand", [x, e.ints([1, g.c_in, m, *[1] * nd])]), e.ints([0, g.c_out, *g.dims])])
    channels = g.c_out if g.depthwise else g.c_in  # of the windows
    xt = e.op("Transpose", [x], perm=[*range(2, 2 + nd), 0, 1])  # [spatial..., N, C]
    lengths = []
    pad_end = []
    for a in range(nd):
        need = (g.kernel[a] - 1) * g.dilations[a] + g.strides[a] * (g.out_dims[a] - 1) + 1
        length = max(need, g.dims[a] + g.pads[a])
        length = -(-length // g.strides[a]) * g.strides[a]
        lengths.append(length)
        pad_end.append(length - g.dims[a] - g.pads[a])  # >= 0: zeros past the input, as far as the windows read
    if any(g.pads[:nd]) or any(pad_end):
        xt = e.op("Pad", [xt, e.ints([*g.pads[:nd], 0, 0, *pad_end, 0, 0])])
    phased = any(s > 1 for s in g.strides)
    if phased:  # axis a -> (blocks, stride): the window at offset i is blocks [i // s, +out) of phase i % s
        split_axes = [d for a in range(nd) for d in (lengths[a] // g.strides[a], g.strides[a])]
        xt = e.op("Reshape", [xt, e.ints([*split_axes, -1, channels])])
    taps = int(np.prod(g.kernel))
    if g.depthwise:
        wt = e.op("Transpose", [e.op("Reshape", [w, e.ints([g.c_out, taps])])], perm=[1, 0])  # [taps, Cout]
        weights: list[str] | dict[int, str] = split(e, wt, [1] * taps, 0, "tap_w") if taps > 1 else [wt]
    windows = []
    for k, offset in enumerate(np.ndindex(*g.kernel)):
        starts, ends, axes = [], [], []
        real = True
        for a, i in enumerate(offset):
            first = i * g.dilations[a]
            positions = range(first, first + g.strides[a] * g.out_dims[a], g.strides[a])
            real = real and any(g.pads[a] <= p < g.pads[a] + g.dims[a] for p in positions)
            if phased:
                block, phase = divmod(first, g.strides[a])
                starts += [block, phase]
                ends += [block + g.out_dims[a], phase + 1]
                axes += [2 * a, 2 * a + 1]
            else:
                starts.append(first)
                ends.append(first + g.out_dims[a])
                axes.append(a)
        whole = not phased and starts == [0] * nd and ends == lengths
        windows.append((k, starts, ends, axes, real, whole))
    if any(window[4] for window in windows):
        windows = [window for window in windows if window[4]]
    if not g.depthwise:
        weights = _dense_tap_weights(e, w, g, taps, [window[0] for window in windows])
    products = []
    for k, starts, ends, axes, _, whole in windows:
        window = xt if whole else e.op("Slice", [xt, e.ints(starts), e.ints(ends), e.ints(axes)])
        if g.depthwise:
            products.append(e.op("Mul", [window, weights[k]]))
        else:  # [rows, Cin] x [Cout, Cin]^T
            products.append(e.op("Gemm", [e.op("Reshape", [window, e.ints([-1, g.c_in])]), weights[k]], transB=1))
    total = products[0] if len(products) == 1 else e.op("Sum", products)
    if len(products) > 1:  # all [rows, Cout], which inference cannot tell: rows = N * positions
        e.same_shape.update({t: products[0] for t in [*products, total]})
    if len(node.input) > 2 and node.input[2]:
        total = e.op("Add", [total, node.input[2]])
    total = e.op("Reshape", [total, e.ints([*g.out_dims, -1, g.c_out])])
    e.op("Transpose", [total], perm=[nd, nd + 1, *range(nd)], out=node.output[0])


def _dense_tap_weights(e: Emitter, w: str, g: ConvTaps, taps: int, used: list[int]) -> dict[int, str]:
    """Offset -> its [Cout, Cin] weights, for the offsets ``used``. The weight [Cout, Cin, k...] as
    [Cout*Cin, taps] is transposed as a matrix (a 4-D transpose moving the kernel axes to the front
    goes element by element: 23 ms for ResNet-18's 512x512x3x3), or, when only some offsets reach the
    input (a 3x3 Conv on a 1x1 image: the centre), their rows of the identity times it transposed, one
    Gemm: 0.26 ms for the centre of a 512x512x3x3 kernel, against 0.83 for the kernel times the
    identity's column (onnxruntime 1.32, AVX-512), whose product MLAS works a row of 9 at a time."""
    flat = e.op("Reshape", [w, e.ints([g.c_out * g.c_in, taps])])
    if taps == 1:
        return {0: e.op("Reshape", [flat, e.ints([g.c_out, g.c_in])])}
    if len(used) < taps:
        dtype = helper.tensor_dtype_to_np_dtype(e.elem_type(w))
        picked = e.op("Gemm", [e.const(np.eye(taps, dtype=dtype)[used], "tap_pick"), flat], transB=1)
        if len(used) == 1:
            return {used[0]: e.op("Reshape", [picked, e.ints([g.c_out, g.c_in])])}
        rows = e.op("Reshape", [picked, e.ints([len(used), g.c_out, g.c_in])])
    else:
        rows = e.op("Reshape", [e.op("Transpose", [flat], perm=[1, 0]), e.ints([len(used), g.c_out, g.c_in])])
    return {
        k: e.op("Squeeze", [part, e.ints([0])]) for k, part in zip(used, split(e, rows, [1] * len(used), 0, "tap_w"))
    }


def _drops_nothing(e: Emitter, node: onnx.NodeProto, read: set[str]) -> bool:
    """A Dropout of constant ratio 0 whose mask nobody reads: the identity, in training as well (as
    torch's dropout with p=0 returns its input). transformers' configs export it so (ViT's hidden and
    attention dropout default to 0), and a training-mode export names the mask output even though
    nothing reads it; active, it drew a random mask and multiplied by it both ways."""
    if len(node.output) > 1 and node.output[1] in read or len(node.input) < 2 or not node.input[1]:
        return False
    ratio = e.value(node.input[1])
    return ratio is not None and ratio.size == 1 and float(ratio.reshape(())) == 0.0


def _read_tensors(nodes: Sequence[onnx.NodeProto]) -> set[str]:
    """Every tensor a node of ``nodes`` reads, in its subgraphs too."""
    read: set[str] = set()
    for node in nodes:
        read.update(i for i in node.input if i)
        for a in node.attribute:
            for g in (
                [a.g]
                if a.type == onnx.AttributeProto.GRAPH
                else a.graphs
                if a.type == onnx.AttributeProto.GRAPHS
                else []
            ):
                read |= _read_tensors(g.node)
    return read


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


def _batch_norm(
    e: Emitter, node: onnx.NodeProto, initializers: set[str], updates: dict[str, str], unbiased: bool = True
) -> None:
    x, scale, bias, mean_in, var_in = node.input[:5]
    eps = float(attr(node, "epsilon", 1e-5))
    momentum = float(attr(node, "momentum", 0.9))
    rank, cshape = _channel_shape(e, x)
    axes = [0, *range(2, rank)]
    mean = e.reduce("ReduceMean", x, axes, keepdims=True, hint="bn_mean")
    centred = e.op("Sub", [x, mean], hint="bn_centred")
    # ReduceMean of the square (its gradient one product, 2*centred*dvar/n); not ReduceSumSquare,
    # whose sum onnxruntime rounds 7x worse over MobileNetV2's 8192 values per channel
    var = e.reduce("ReduceMean", e.op("Mul", [centred, centred]), axes, keepdims=True, hint="bn_var")
    inv = e.op("Reciprocal", [e.op("Sqrt", [e.op("Add", [var, e.scalar(eps, x)])])])
    gain = e.op("Mul", [inv, e.op("Reshape", [scale, e.ints(cshape)])])
    e.op("Add", [e.op("Mul", [centred, gain]), e.op("Reshape", [bias, e.ints(cshape)])], out=node.output[0])
    if var_in in initializers and unbiased:
        var = _unbiased(e, x, mean, var, axes)
    for stat, batch in ((mean_in, mean), (var_in, var)):
        if stat in initializers:
            flat = e.op("Reshape", [batch, e.ints([-1])])
            kept = e.op("Mul", [stat, e.scalar(momentum, x)])
            updates[stat] = e.op("Add", [kept, e.op("Mul", [flat, e.scalar(1.0 - momentum, x)])], hint=f"{stat}_next")


def _unbiased(e: Emitter, x: str, mean: str, var: str, axes: list[int]) -> str:
    """The batch variance ``var`` times n/(n-1), n the elements per channel (read at run time: the
    batch is dynamic), as torch updates the running variance; n = 1 keeps the (zero) variance
    where torch refuses the batch, so that a device's one-example last batch cannot make it infinite.
    The factor is computed once per graph for the batch norms of the same n (:func:`.gradients._count`)."""
    n = _count(e, x, mean, axes)
    key = ("unbiased", n)
    if key not in e.shared:
        less_one = e.op("Max", [e.op("Sub", [n, e.scalar(1.0, x)]), e.scalar(1.0, x)])
        e.shared[key] = e.op("Div", [n, less_one], hint="bn_unbiased")
    return e.op("Mul", [var, e.shared[key]], hint="bn_var_unbiased")


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
        normed = e.op(
            "Add",
            [
                e.op("Mul", [normed, e.op("Reshape", [scale, e.ints(per_group)])]),
                e.op("Reshape", [bias, e.ints(per_group)]),
            ],
        )
        e.op("Reshape", [normed, e.shape_of(x)], out=node.output[0])
        return
    back = e.op("Reshape", [normed, e.shape_of(x)])
    scaled = e.op("Mul", [back, e.op("Reshape", [scale, e.ints(cshape)])])
    e.op("Add", [scaled, e.op("Reshape", [bias, e.ints(cshape)])], out=node.output[0])


def _lrn(e: Emitter, node: onnx.NodeProto) -> None:
    """Local response normalization (AlexNet's, GoogLeNet's): x / (bias + alpha/size * s)^beta, s the
    sum of x^2 over the ``size`` channels around each one (floor((size-1)/2) before, the rest after,
    zeros past the ends). The sum is one Conv of ones over the channels, the input viewed as
    [N, 1, C, positions]."""
    x = node.input[0]
    shape = e.shape(x)
    if shape is None or len(shape) < 3 or not isinstance(shape[1], int):
        raise UnsupportedOpError(node.op_type, node.name, "needs an input [N, C, ...] with a known number of channels")
    size = int(attr(node, "size"))
    alpha, beta, bias = (
        float(attr(node, "alpha", 1e-4)),
        float(attr(node, "beta", 0.75)),
        float(attr(node, "bias", 1.0)),
    )
    before = (size - 1) // 2
    ones = e.const(np.ones((1, 1, size, 1), dtype=helper.tensor_dtype_to_np_dtype(e.elem_type(x))), "lrn_window")
    squares = e.op("Reshape", [e.op("Mul", [x, x]), e.ints([0, 1, shape[1], -1])], hint="lrn_squares")
    sums = e.op(
        "Conv", [squares, ones], kernel_shape=[size, 1], pads=[before, 0, size - 1 - before, 0], hint="lrn_sums"
    )
    scaled = e.op(
        "Add", [e.op("Mul", [e.op("Reshape", [sums, e.shape_of(x)]), e.scalar(alpha / size, x)]), e.scalar(bias, x)]
    )
    e.op("Div", [x, e.op("Pow", [scaled, e.scalar(beta, x)])], out=node.output[0])


@dataclass(frozen=True)
class _Recurrent:
    """What unrolling a GRU/LSTM needs to know of it."""

    seq: int
    hidden: int
    directions: tuple[str, ...]  # ("forward",), ("reverse",) or both


def _default_activations(node: onnx.NodeProto, gates: int, direction: str) -> bool:
    """Whether the node's activations are the defaults: none given, or the defaults spelt out per
    direction (tf2onnx writes ``["Sigmoid", "Tanh", "Tanh"]`` on every LSTM it converts)."""
    given = attr(node, "activations")
    if given is None:
        return True
    names = [a.decode() if isinstance(a, bytes) else str(a) for a in given]
    if gates == 1:  # an RNN's one activation per direction: torch's nonlinearity, tanh or relu
        return {a.lower() for a in names} <= {"tanh", "relu"} and len(names) == len(_directions(direction))
    defaults = ["sigmoid", "tanh", "tanh"] if gates == 4 else ["sigmoid", "tanh"]
    return [a.lower() for a in names] == defaults * (2 if direction == "bidirectional" else 1)


def _directions(direction: str) -> tuple[str, ...]:
    return {"forward": ("forward",), "reverse": ("reverse",), "bidirectional": ("forward", "reverse")}[direction]


def _recurrent_checks(e: Emitter, node: onnx.NodeProto, gates: int) -> _Recurrent:
    """How to unroll a GRU/LSTM with the default activations, either direction or both, in layout 0
    (torch's exporters write batch_first with Transpose nodes around it; onnxruntime runs no other)."""

    def refuse(why: str) -> NoReturn:
        raise UnsupportedOpError(node.op_type, node.name, why)

    direction = attr(node, "direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    if int(attr(node, "layout", 0)) != 0:
        refuse(
            "is unrolled with layout=0 only (sequence first, as torch's exporters write it; onnxruntime runs no other)"
        )
    if attr(node, "clip") is not None or not _default_activations(node, gates, direction):
        refuse(
            "is unrolled without clip and with tanh or relu activations only (torch's nonlinearity)"
            if gates == 1
            else "is unrolled without clip and with the default activations only (sigmoid gates, tanh: the defaults "
            "of torch's and Keras's layers)"
        )
    if len(node.input) > 4 and node.input[4]:
        refuse("is unrolled without sequence_lens only (every sequence has the full length; pad instead of packing)")
    if node.op_type == "LSTM" and ((len(node.input) > 7 and node.input[7]) or int(attr(node, "input_forget", 0))):
        refuse("is unrolled without peepholes or input_forget only")
    shape = e.shape(node.input[0])
    if shape is None or len(shape) != 3 or not isinstance(shape[0], int):
        refuse(
            "needs an input of static sequence length to be unrolled: export with the sequence length fixed and the "
            "batch axis alone dynamic (tf2onnx's input_signature=(tf.TensorSpec((None, LENGTH), ...),), torch's "
            "dynamic axes on the batch only)"
        )
    hidden = attr(node, "hidden_size")
    if hidden is None:
        wshape = e.shape(node.input[1])
        hidden = wshape[1] // gates if wshape is not None and isinstance(wshape[1], int) else None
    if hidden is None:
        refuse("needs hidden_size")
    return _Recurrent(int(shape[0]), int(hidden), _directions(direction))


def split(e: Emitter, x: str, sizes: Sequence[int], axis: int, hint: str = "part") -> list[str]:
    """``x`` cut along ``axis`` into pieces of ``sizes``: one Split, whose gradient is one Concat.
    A Slice per piece would take a Pad of x's whole size per piece in the backward pass (and as
    many Adds): an LSTM unrolled over 16 steps spent a third of its step padding its step inputs
    back to the whole sequence."""
    outs = [e.fresh(hint) for _ in sizes]
    if e.opset >= 13:
        return e.op_multi("Split", [x, e.ints(list(sizes))], outs, axis=axis)
    return e.op_multi("Split", [x], outs, axis=axis, split=list(sizes))


def _cols(e: Emitter, t: str, start: int, end: int) -> str:
    return e.op("Slice", [t, e.ints([start]), e.ints([end]), e.ints([-1])])


def _direction(e: Emitter, rec: _Recurrent, t: str, d: int, keep: bool = False) -> str:
    """Direction ``d``'s slice of a weight, bias or state stacked over the directions (axis 0),
    without that axis unless ``keep``."""
    if len(rec.directions) == 1:  # the whole tensor: no Slice (nor its gradient's Pad)
        return t if keep else e.op("Squeeze", [t, e.ints([0])])
    part = e.op("Slice", [t, e.ints([d]), e.ints([d + 1]), e.ints([0])])
    return part if keep else e.op("Squeeze", [part, e.ints([0])])


def _recurrent_setup(
    e: Emitter, node: onnx.NodeProto, rec: _Recurrent, gates: int, d: int
) -> tuple[str, str, str | None]:
    """For direction ``d``: (the input sequence [seq, batch, in] times the input weights plus the
    input bias [seq, batch, gates*H], the recurrent weights transposed [H, gates*H], the recurrent
    bias or None)."""
    x, w, r = node.input[:3]
    hidden = rec.hidden
    xw = e.op("MatMul", [x, e.op("Transpose", [_direction(e, rec, w, d)], perm=[1, 0])])
    rt = e.op("Transpose", [_direction(e, rec, r, d)], perm=[1, 0])
    rb = None
    if len(node.input) > 3 and node.input[3]:
        b = _direction(e, rec, node.input[3], d)
        xw = e.op("Add", [xw, _cols(e, b, 0, gates * hidden)])
        rb = _cols(e, b, gates * hidden, 2 * gates * hidden)
    return xw, rt, rb


def _initial(e: Emitter, node: onnx.NodeProto, rec: _Recurrent, index: int, d: int) -> str:
    """Direction ``d``'s initial state [1, batch, H]: the node's input (stacked over the directions) or zeros."""
    if len(node.input) > index and node.input[index]:
        state = _direction(e, rec, node.input[index], d, keep=True)
        if node.input[index] in e.zeros:
            e.zeros.add(state)
        return state
    x = node.input[0]
    batch = e.op("Slice", [e.op("Shape", [x]), e.ints([1]), e.ints([2])])
    dtype = helper.tensor_dtype_to_np_dtype(e.elem_type(x))
    zeros = e.op(
        "ConstantOfShape",
        [e.op("Concat", [e.ints([1]), batch, e.ints([rec.hidden])], axis=0)],
        value=onnx.numpy_helper.from_array(np.zeros(1, dtype=dtype)),
    )
    e.zeros.add(zeros)
    return zeros


def _note_zeros(e: Emitter, nodes: Sequence[onnx.NodeProto]) -> None:
    """Record in ``e.zeros`` the outputs of ``ConstantOfShape`` nodes of value 0 (torch's exporters
    start an LSTM from such states)."""
    for node in nodes:
        if node.op_type == "ConstantOfShape" and node.domain in DEFAULT_DOMAINS:
            value = attr(node, "value")
            if value is None or not np.any(onnx.numpy_helper.to_array(value)):
                e.zeros.add(node.output[0])


def _step_inputs(e: Emitter, xw: str, seq: int) -> list[str]:
    """Each step's rows of ``xw`` [seq, batch, ...] as [1, batch, ...], cut by one Split (whose
    gradient is one Concat, where a Slice per step would pad its gradient back to the whole
    sequence). The steps keep the leading axis of one, the states too, so that no step squeezes or
    unsqueezes anything (a quarter of an unrolled LSTM's nodes were those and their gradients)."""
    return [xw] if seq == 1 else split(e, xw, [1] * seq, 0, "step")


def _steps(rec: _Recurrent, direction: str) -> list[int]:
    return list(range(rec.seq)) if direction == "forward" else list(reversed(range(rec.seq)))


def _recurrent_outputs(
    e: Emitter, node: onnx.NodeProto, rec: _Recurrent, seqs: list[str], finals: list[list[str]]
) -> None:
    """Y [seq, directions, batch, H] from each direction's states [seq, batch, H] ``seqs``, and the
    final states [directions, batch, H] from ``finals`` (per output, per direction)."""
    outs = list(node.output) + [""] * (3 - len(node.output))
    if outs[0]:
        if len(seqs) == 1:
            e.op("Unsqueeze", [seqs[0], e.ints([1])], out=outs[0])
        else:
            e.op("Concat", [e.unsqueeze(y, [1]) for y in seqs], axis=1, out=outs[0])
    for out, per_direction in zip(outs[1:], finals):
        if out:
            if len(per_direction) == 1:
                e.op("Identity", per_direction, out=out)
            else:
                e.op("Concat", per_direction, axis=0, out=out)


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
        states, inputs = {}, _step_inputs(e, xw, rec.seq)
        for t in _steps(rec, direction):
            xt = inputs[t]
            hzr = e.op("MatMul", [h, r_zr])
            if rb_zr is not None:
                hzr = e.op("Add", [hzr, rb_zr])
            x_zr, x_h = split(e, xt, [2 * hdim, hdim], -1, "gru_x")
            zr = e.op("Sigmoid", [e.op("Add", [x_zr, hzr])])
            z, r = split(e, zr, [hdim, hdim], -1, "gru_gate")
            if before_reset:
                hh = e.op("MatMul", [h, r_h])
                if rb_h is not None:
                    hh = e.op("Add", [hh, rb_h])
                inner = e.op("Mul", [r, hh])
            else:
                inner = e.op("MatMul", [e.op("Mul", [r, h]), r_h])
                if rb_h is not None:
                    inner = e.op("Add", [inner, rb_h])
            n = e.op("Tanh", [e.op("Add", [x_h, inner])])
            h = e.op("Add", [n, e.op("Mul", [z, e.op("Sub", [h, n])])], hint="gru_h")  # (1-z)*n + z*h
            states[t] = h
        hs.append(_stacked(e, [states[t] for t in range(rec.seq)]))
        finals.append(h)
    _recurrent_outputs(e, node, rec, hs, [finals])


def _rnn(e: Emitter, node: onnx.NodeProto) -> None:
    """An RNN (torch's ``nn.RNN`` through the classic exporter): h = f(x W^T + h R^T + Wb + Rb) per
    step, f each direction's activation (tanh, or relu: torch's ``nonlinearity``)."""
    rec = _recurrent_checks(e, node, 1)
    given = attr(node, "activations")
    names = [a.decode() if isinstance(a, bytes) else str(a) for a in given] if given else ["Tanh"] * 2
    hs, finals = [], []
    for d, direction in enumerate(rec.directions):
        activation = {"tanh": "Tanh", "relu": "Relu"}[names[d].lower()]
        xw, rt, rb = _recurrent_setup(e, node, rec, 1, d)
        if rb is not None:  # both biases are added at every step: once, to every step's input
            xw = e.op("Add", [xw, rb])
        h = _initial(e, node, rec, 5, d)
        from_zero = h in e.zeros
        states, inputs = {}, _step_inputs(e, xw, rec.seq)
        for t in _steps(rec, direction):
            pre = inputs[t] if from_zero else e.op("Add", [inputs[t], e.op("MatMul", [h, rt])])
            h = states[t] = e.op(activation, [pre], hint="rnn_h")
            from_zero = False
        hs.append(_stacked(e, [states[t] for t in range(rec.seq)]))
        finals.append(h)
    _recurrent_outputs(e, node, rec, hs, [finals])


def _lstm(e: Emitter, node: onnx.NodeProto) -> None:
    rec = _recurrent_checks(e, node, 4)
    hdim = rec.hidden
    rows = e.op("Flatten", [node.input[0]], axis=2)  # [seq*batch, in]
    ys, final_h, final_c = [], [], []
    for d, direction in enumerate(rec.directions):
        # the inputs' products and both biases (added before the gates alike) as one Gemm: [seq*batch, 4H]
        bias = []
        if len(node.input) > 3 and node.input[3]:
            b_in, b_rec = split(e, _direction(e, rec, node.input[3], d), [4 * hdim, 4 * hdim], 0, "lstm_bias")
            bias = [e.op("Add", [b_in, b_rec])]
        xw = e.op("Gemm", [rows, _direction(e, rec, node.input[1], d), *bias], transB=1)
        h0, c0 = _initial(e, node, rec, 5, d), _initial(e, node, rec, 6, d)
        y, h, c = _lstm_steps(e, rec, direction, xw, _direction(e, rec, node.input[2], d), h0, c0)
        ys.append(y)
        final_h.append(h)
        final_c.append(c)
    _recurrent_outputs(e, node, rec, ys, [final_h, final_c])


def _equal_parts(e: Emitter, x: str, n: int, hint: str) -> list[str]:
    """``x`` cut along axis 0 into ``n`` equal parts (whose size may be known at run time only)."""
    if n == 1:
        return [x]
    outs = [e.fresh(hint) for _ in range(n)]
    if e.opset >= 18:
        return e.op_multi("Split", [x], outs, axis=0, num_outputs=n)
    return e.op_multi("Split", [x], outs, axis=0)


def _stacked(e: Emitter, parts: Sequence[str]) -> str:
    return parts[0] if len(parts) == 1 else e.op("Concat", list(parts), axis=0)


def _lstm_factors(
    e: Emitter, sig: str, i: str, o: str, cand: str, tanh_c: str, h: str, i_cand: str, f_c: str
) -> tuple[str, str]:
    """What one LSTM step's gradient multiplies by, from its forward values (the sigmoid gates
    ``sig`` = (i, o, f), the candidate, tanh(c) and the products the step computed: h = o * tanh(c),
    i * cand, f * c before): the gates' derivatives times what each gate meets, [batch, 4H], which the
    gates' gradient is (dc, dh, dc, dc) times (i * cand * (1 - i), h * (1 - o), f * c * (1 - f),
    i - i * cand * cand); and o - h * tanh(c) = o * (1 - tanh(c)^2), which dc gains dh times."""
    iof = e.op("Mul", [e.op("Concat", [i_cand, h, f_c], axis=-1), e.op("Sub", [e.scalar(1.0, sig), sig])])
    c = e.op("Sub", [i, e.op("Mul", [i_cand, cand])])
    return e.op("Concat", [iof, c], axis=-1), e.op("Sub", [o, e.op("Mul", [h, tanh_c])])


def _lstm_steps(e: Emitter, rec: _Recurrent, direction: str, xw: str, r: str, h0: str, c0: str) -> tuple[str, str, str]:
    """One direction of an LSTM over ``xw`` [seq*batch, 4H] (the inputs' products and both biases)
    with the recurrent weights ``r`` [4H, H], from the states ``h0``, ``c0`` [1, batch, H]: (Y
    [seq, batch, H], final h, final c [1, batch, H]).

    The steps work on [batch, ...] matrices, so that each step's gate product and its input are one
    Gemm. Their gradient is emitted as a whole (:class:`~.emitter.Composite`), step by step: dh = dY
    + the next step's gates' gradient times R as one Gemm, dc = dh * o * (1 - tanh(c)^2) + the next
    step's dc * f, the gates' gradient (dc, dh, dc, dc) times the factors of :func:`_lstm_factors`;
    the recurrent weights' gradient is one Gemm over all steps' rows, and the inputs' gradient is the
    steps' gates' gradients stacked: 24 nodes a step forward and backward, where the rules of the
    unrolled nodes one by one took 35, more of them passes over whole [batch, H] tensors. The factors are computed in each
    step's backward, not once over all steps stacked: stacking the forward's values and splitting
    the factors are passes of their own over operands too large for the core's cache (the
    benchmark's LSTM step 4.8 ms that way, 4.6 step by step). From zero initial states (torch's
    exporters pass zeros) the first step has no recurrent product."""
    hdim, n = rec.hidden, rec.seq
    start = len(e.nodes)
    xs = _equal_parts(e, xw, n, "lstm_x")
    h = e.op("Reshape", [h0, e.ints([-1, hdim])])
    c = e.op("Reshape", [c0, e.ints([-1, hdim])])
    # per time step: the states before it and the forward values its gradient reads
    h_prev: dict[int, str] = {}
    saved: dict[int, tuple[str, ...]] = {}  # the arguments of _lstm_factors
    forget: dict[int, str] = {}
    from_zero_h, from_zero_c = h0 in e.zeros, c0 in e.zeros
    for t in _steps(rec, direction):
        h_prev[t] = h
        g = xs[t] if from_zero_h else e.op("Gemm", [h, r, xs[t]], transB=1, hint="lstm_pre")
        g_iof, g_c = split(e, g, [3 * hdim, hdim], -1, "lstm_pre")  # gate order i, o, f, c
        sig = e.op("Sigmoid", [g_iof])
        i, o, forget[t] = split(e, sig, [hdim, hdim, hdim], -1, "lstm_gate")
        cand = e.op("Tanh", [g_c])
        kept = e.op("Mul", [i, cand])
        f_c = c if from_zero_c else e.op("Mul", [forget[t], c])  # zero before the first step from zero
        c = kept if from_zero_c else e.op("Add", [f_c, kept], hint="lstm_c")
        from_zero_h = from_zero_c = False
        tanh_c = e.op("Tanh", [c])
        h = e.op("Mul", [o, tanh_c], hint="lstm_h")
        saved[t] = (sig, i, o, cand, tanh_c, h, kept, f_c)
    order = _steps(rec, direction)
    after = {order[k]: (h_prev[order[k + 1]] if k + 1 < n else h) for k in range(n)}  # h after step t
    y = e.op("Reshape", [_stacked(e, [after[t] for t in range(n)]), e.ints([n, -1, hdim])], hint="lstm_y")
    final_h, final_c = e.unsqueeze(h, [0]), e.unsqueeze(c, [0])

    def gradient(dys: list[str | None], wants: list[bool]) -> list[str | None]:
        dy, dh_final, dc_final = dys
        dy_steps = _equal_parts(e, e.op("Reshape", [dy, e.ints([-1, hdim])]), n, "lstm_dy") if dy else None
        dh_last = e.op("Reshape", [dh_final, e.ints([-1, hdim])]) if dh_final else None
        carry = e.op("Reshape", [dc_final, e.ints([-1, hdim])]) if dc_final else None
        dgates: dict[int, str] = {}
        later: str | None = None  # the gates' gradient of the step processed after this one
        for t in reversed(order):
            if later is not None:
                dh = e.op("Gemm", [later, r, *([dy_steps[t]] if dy_steps else [])], hint="lstm_dh")
            else:
                given = [g for g in ([dy_steps[t]] if dy_steps else []) + [dh_last] if g]
                dh = given[0] if len(given) == 1 else e.op("Add", given) if given else e.zeros_like(h)
            factors, through_h = _lstm_factors(e, *saved[t])
            dc = e.op("Mul", [dh, through_h])
            if carry is not None:
                dc = e.op("Add", [dc, carry], hint="lstm_dc")
            dgates[t] = later = e.op("Mul", [e.op("Concat", [dc, dh, dc, dc], axis=-1), factors])
            carry = e.op("Mul", [dc, forget[t]]) if t != order[0] or wants[3] else None
        stacked = _stacked(e, [dgates[t] for t in range(n)])  # [seq*batch, 4H]
        d_r = e.op("Gemm", [stacked, _stacked(e, [h_prev[t] for t in range(n)])], transA=1) if wants[1] else None
        d_h0 = None
        if wants[2] and later is not None:
            d_h0 = e.op("Reshape", [e.op("Gemm", [later, r]), e.ints([1, -1, hdim])])
        d_c0 = e.op("Reshape", [carry, e.ints([1, -1, hdim])]) if wants[3] and carry else None
        return [stacked if wants[0] else None, d_r, d_h0, d_c0]

    read = [*h_prev.values(), *forget.values(), *(v for values in saved.values() for v in values)]
    e.composite(start, [xw, r, h0, c0], [y, final_h, final_c], gradient, read)
    return y, final_h, final_c


DECOMPOSED = {
    "LayerNormalization": _layer_norm,
    "GRU": _gru,
    "LSTM": _lstm,
    "RNN": _rnn,
    "InstanceNormalization": _instance_norm,
    "GroupNormalization": _group_norm,
    "LRN": _lrn,
}


def is_float(elem_type: int) -> bool:
    return elem_type in (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)
