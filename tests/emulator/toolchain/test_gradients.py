"""Every gradient rule agrees with central finite differences, over random shapes and attributes.

Each case draws an op's inputs (shapes, broadcasting, axes, strides, paddings ...) and checks the
generated vector-Jacobian product against the finite difference along random directions. Ops
onnxruntime runs in float64 are checked in float64 (tight); convolutions and pools in float32."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from device_runtime.executor import make_session
from emulator.toolchain import OP_COVERAGE, UnsupportedOpError, vjp_model
from emulator.toolchain.autodiff import needed_for, tensor_infos
from emulator.toolchain.forward import DECOMPOSED, DENSE_TAPS_MAX_POSITIONS, DEPTHWISE_TAPS_MAX_POSITIONS
from emulator.toolchain.gradients import NO_GRADIENT, RULES
from tests.emulator.toolchain.gradcheck import single_op_model, training_forward_model, vjp_error

F64_TOL = 1e-6
F32_TOL = 3e-3
dims = st.integers(1, 4)


def _arr(draw, shape, dtype=np.float64, low=-2.0, high=2.0, away_from_zero=False):
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    a = rng.uniform(low, high, size=shape)
    if away_from_zero:  # keep kinks (Relu, Abs, Max ...) out of the finite differences' reach
        a = np.where(np.abs(a) < 0.1, a + np.sign(a + 1e-9) * 0.2, a)
    return a.astype(dtype)


def _distinct(draw, shape):
    """float32 values at least 0.1 apart: no ties, and no finite-difference step changes an argmax."""
    seed = draw(st.integers(0, 2**31))
    size = int(np.prod(shape))
    return (np.random.default_rng(seed).permutation(size).reshape(shape) * 0.1 - 0.05 * size).astype(np.float32)


def _shape(draw, rank=None):
    rank = draw(st.integers(1, 4)) if rank is None else rank
    return tuple(draw(dims) for _ in range(rank))


def _broadcast_partner(draw, shape):
    """A shape that broadcasts against ``shape``: a suffix of it with some dimensions set to 1."""
    k = draw(st.integers(0, len(shape)))
    suffix = shape[len(shape) - k :]
    return tuple(1 if draw(st.booleans()) else d for d in suffix)


# Each case: draw -> (op, inputs to differentiate, constant inputs, attributes, opset, dtype tolerance)
def case_binary(op):
    def draw_case(draw):
        shape = _shape(draw)
        other = _broadcast_partner(draw, shape)
        a, b = (shape, other) if draw(st.booleans()) else (other, shape)
        xa = _arr(draw, a, away_from_zero=True)
        xb = _arr(draw, b, away_from_zero=True)
        if op == "Pow":
            xa = np.asarray(np.abs(xa) + 0.5)
        if op in ("Max", "Min"):  # distinct values, so that the chosen input is unambiguous
            xb = np.asarray(xb + 0.05)
        return op, {"a": xa, "b": xb}, {}, {}, 17, F64_TOL

    return draw_case


def case_unary(op, positive=False, dtype=np.float64, **attrs):
    def draw_case(draw):
        x = _arr(draw, _shape(draw), dtype, away_from_zero=True)
        if positive:
            x = np.asarray(np.abs(x) + dtype(0.3))
        return op, {"x": x}, {}, dict(attrs), 17, F64_TOL if dtype == np.float64 else F32_TOL

    return draw_case


def case_square(draw):  # Mul of a tensor with itself: one gradient, 2*x*dy
    return "Mul", {"x": _arr(draw, _shape(draw))}, {}, {"order": ["x", "x"]}, 17, F64_TOL


def case_pow_constant(draw):
    x = np.asarray(np.abs(_arr(draw, _shape(draw))) + 0.5)
    p = draw(st.sampled_from([2.0, 3.0, 0.5, -1.0]))
    return "Pow", {"x": x}, {"p": np.array(p)}, {}, 17, F64_TOL


def case_clip(draw):  # both bounds, the lower or the upper one only (ReLU6 is Clip(x, 0, 6))
    x = _arr(draw, _shape(draw), away_from_zero=True)
    order = draw(st.sampled_from([["x", "lo", "hi"], ["x", "lo"], ["x", "", "hi"]]))
    constants = {k: v for k, v in (("lo", np.array(-1.0)), ("hi", np.array(1.05))) if k in order}
    if "" in order:
        constants[""] = None
    return "Clip", {"x": x}, constants, {"order": order}, 17, F64_TOL


def case_where(draw):
    shape = _shape(draw)
    cond = _arr(draw, _broadcast_partner(draw, shape)) > 0
    return (
        "Where",
        {"a": _arr(draw, shape), "b": _arr(draw, _broadcast_partner(draw, shape))},
        {"c": cond},
        {"order": ["c", "a", "b"]},
        17,
        F64_TOL,
    )


def case_sum(draw):
    shape = _shape(draw)
    return (
        "Sum",
        {"a": _arr(draw, shape), "b": _arr(draw, _broadcast_partner(draw, shape)), "c": _arr(draw, shape)},
        {},
        {},
        17,
        F64_TOL,
    )


def case_gemm(draw):
    m, k, n = draw(dims), draw(dims), draw(dims)
    ta, tb = draw(st.integers(0, 1)), draw(st.integers(0, 1))
    a = _arr(draw, (k, m) if ta else (m, k))
    b = _arr(draw, (n, k) if tb else (k, n))
    c = _arr(draw, draw(st.sampled_from([(n,), (m, n), (1, n), (m, 1)])))
    attrs = {
        "transA": ta,
        "transB": tb,
        "alpha": draw(st.sampled_from([1.0, 0.5])),
        "beta": draw(st.sampled_from([1.0, 2.0])),
    }
    return "Gemm", {"a": a, "b": b, "c": c}, {}, attrs, 17, F64_TOL


def case_matmul(draw):
    batch = _shape(draw, draw(st.integers(0, 2)))
    m, k, n = draw(dims), draw(dims), draw(dims)
    kind = draw(st.sampled_from(["batched", "shared_weight", "vector_right", "vector_left", "broadcast"]))
    if kind == "batched":
        a, b = (*batch, m, k), (*batch, k, n)
    elif kind == "shared_weight":
        a, b = (*batch, m, k), (k, n)
    elif kind == "vector_right":
        a, b = (*batch, m, k), (k,)
    elif kind == "vector_left":
        a, b = (k,), (*batch, k, n)
    else:
        a, b = (*batch, m, k), (1, k, n) if batch else (k, n)
    return "MatMul", {"a": _arr(draw, a), "b": _arr(draw, b)}, {}, {}, 17, F64_TOL


def case_softmax(op):
    def draw_case(draw):
        shape = _shape(draw)
        axis = draw(st.integers(-len(shape), len(shape) - 1))
        return op, {"x": _arr(draw, shape)}, {}, {"axis": axis}, 17, F64_TOL

    return draw_case


def case_reduce(op):
    def draw_case(draw):
        shape = _shape(draw)
        axes = sorted(draw(st.sets(st.integers(0, len(shape) - 1), min_size=0, max_size=len(shape))))
        axes = [a - len(shape) if draw(st.booleans()) else a for a in axes]
        keepdims = draw(st.integers(0, 1))
        opset = draw(st.sampled_from([13, 18]))
        x = _arr(draw, shape)
        if op in ("ReduceMax", "ReduceMin"):
            x = x + np.arange(x.size).reshape(shape) * 1e-2  # no ties
        if op == "ReduceL2":
            x = np.abs(x) + 0.3
        constants: dict = {}
        attrs: dict = {"keepdims": keepdims}
        if not axes:
            pass
        elif op == "ReduceSum" or opset >= 18:
            constants["axes"] = np.array(axes, dtype=np.int64)
        else:
            attrs["axes"] = axes
        return op, {"x": x}, constants, attrs, opset, F64_TOL

    return draw_case


def case_reshape(draw):
    shape = _shape(draw)
    target = [int(np.prod(shape))] if draw(st.booleans()) else [-1, shape[-1]]
    return "Reshape", {"x": _arr(draw, shape)}, {"shape": np.array(target, dtype=np.int64)}, {}, 17, F64_TOL


def case_flatten(draw):
    shape = _shape(draw, draw(st.integers(2, 4)))
    return "Flatten", {"x": _arr(draw, shape)}, {}, {"axis": draw(st.integers(0, len(shape)))}, 17, F64_TOL


def case_squeeze(op):  # axes given (negative too) or, for Squeeze, every axis of size 1
    def draw_case(draw):
        shape = _shape(draw)
        if op == "Squeeze":
            shape = (1, *shape, 1)
            axes = draw(st.sampled_from([[len(shape) - 1], [-1, 0], None]))
            return op, {"x": _arr(draw, shape)}, {} if axes is None else {"axes": np.array(axes)}, {}, 17, F64_TOL
        axes = draw(st.sampled_from([[0, len(shape) + 1], [-1], [1, -1]]))
        return op, {"x": _arr(draw, shape)}, {"axes": np.array(axes)}, {}, 17, F64_TOL

    return draw_case


def case_transpose(draw):
    shape = _shape(draw)
    perm = draw(st.permutations(list(range(len(shape)))))
    return "Transpose", {"x": _arr(draw, shape)}, {}, {"perm": list(perm)}, 17, F64_TOL


def case_concat(draw):
    shape = list(_shape(draw))
    axis = draw(st.integers(0, len(shape) - 1))
    parts = {}
    for name in ("a", "b", "c")[: draw(st.integers(1, 3))]:
        s = list(shape)
        s[axis] = draw(dims)
        parts[name] = _arr(draw, tuple(s))
    return "Concat", parts, {}, {"axis": axis - len(shape) if draw(st.booleans()) else axis}, 17, F64_TOL


def case_split(draw):
    shape = list(_shape(draw))
    axis = draw(st.integers(0, len(shape) - 1))
    sizes = [draw(dims), draw(dims)]
    shape[axis] = sum(sizes)
    return (
        "Split",
        {"x": _arr(draw, tuple(shape))},
        {"split": np.array(sizes, dtype=np.int64)},
        {"axis": axis, "outputs": ["y", "z"]},
        17,
        F64_TOL,
    )


def case_slice(draw):
    shape = _shape(draw)
    axis = draw(st.integers(0, len(shape) - 1))
    dim = shape[axis]
    start = draw(st.integers(-dim, dim - 1))
    end = draw(st.integers(-dim, dim + 2))
    s = start + dim if start < 0 else start
    e = min(end + dim if end < 0 else end, dim)
    if e <= s:
        end = dim  # a non-empty slice
    return (
        "Slice",
        {"x": _arr(draw, shape)},
        {"starts": np.array([start]), "ends": np.array([end]), "axes": np.array([axis])},
        {},
        17,
        F64_TOL,
    )


def case_gather(draw):
    shape = _shape(draw, draw(st.integers(1, 3)))
    axis = draw(st.integers(0, len(shape) - 1))
    size = shape[axis]
    idx_shape = _shape(draw, draw(st.integers(0, 2)))
    seed = draw(st.integers(0, 2**31))
    idx = np.random.default_rng(seed).integers(-size, size, size=idx_shape).astype(np.int64)
    attrs = {"axis": axis - len(shape) if draw(st.booleans()) else axis}
    return "Gather", {"x": _arr(draw, shape)}, {"i": idx}, attrs, draw(st.sampled_from([13, 17])), F64_TOL


def case_expand(draw):
    shape = _shape(draw)
    small = _broadcast_partner(draw, shape)
    return "Expand", {"x": _arr(draw, small)}, {"shape": np.array(shape, dtype=np.int64)}, {}, 17, F64_TOL


def case_cast(draw):  # float64 -> float32, or to its own type
    to = draw(st.sampled_from([1, 11]))
    return "Cast", {"x": _arr(draw, _shape(draw))}, {}, {"to": to}, 17, F32_TOL if to == 1 else F64_TOL


def case_cast_like(draw):
    """float64 -> float32, the target type given by the second input (which takes no gradient)."""
    return "CastLike", {"x": _arr(draw, _shape(draw))}, {"like": np.zeros(1, np.float32)}, {}, 17, F32_TOL


def _away_from(x, kinks, gap=0.2):
    """``x`` with every value within ``gap`` of a kink moved ``2*gap`` off it."""
    for k in kinks:
        near = np.abs(x - k) < gap
        x = np.where(near, x + np.where(x >= k, 2 * gap, -2 * gap), x)
    return x.astype(np.float32)


def case_hard_sigmoid(draw):
    alpha = draw(st.sampled_from([0.2, 1.0 / 6.0, 0.5]))
    beta = draw(st.sampled_from([0.5, 0.3]))
    x = _away_from(_arr(draw, _shape(draw), low=-6.0, high=6.0), [-beta / alpha, (1.0 - beta) / alpha])
    return "HardSigmoid", {"x": x}, {}, {"alpha": alpha, "beta": beta}, 17, F32_TOL


def case_hard_swish(draw):  # both flat parts and the quadratic ramp between -3 and 3
    return (
        "HardSwish",
        {"x": _away_from(_arr(draw, _shape(draw), low=-5.0, high=5.0), [-3.0, 3.0])},
        {},
        {},
        17,
        F32_TOL,
    )


def case_activation(op, kinks=lambda attrs: [0.0], opset=17, **choices):
    """A one-input activation in float32 (onnxruntime's kernels for most of them), its attributes drawn
    from ``choices`` and its inputs kept off its kinks."""

    def draw_case(draw):
        attrs = {k: draw(st.sampled_from(v)) for k, v in choices.items()}
        x = _away_from(_arr(draw, _shape(draw), low=-3.0, high=3.0), kinks(attrs))
        return op, {"x": x}, {}, attrs, opset, F32_TOL

    return draw_case


def case_inverse_trigonometric(op):
    """An inverse (or hyperbolic) trigonometric function in float32, inside its domain and off its edges:
    |x| < 0.8 for Asin, Acos and Atanh, x > 1.2 for Acosh."""

    def draw_case(draw):
        x = _arr(draw, _shape(draw), np.float32, low=-0.8, high=0.8)
        if op == "Acosh":
            x = np.abs(x) * 2 + np.float32(1.2)
        return op, {"x": x.astype(np.float32)}, {}, {}, 17, F32_TOL

    return draw_case


def case_topk(draw):
    """TopK's values (torch.topk; torch.sort as the dynamo exporter writes it, k the whole axis), of
    distinct inputs: no finite-difference step reorders them."""
    shape = _shape(draw)
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    k = draw(st.integers(1, shape[axis]))
    attrs = {"axis": axis, "largest": draw(st.integers(0, 1)), "outputs": ["y", "i"]}
    return "TopK", {"x": _distinct(draw, shape)}, {"k": np.array([k], np.int64)}, attrs, 17, F32_TOL


def case_prelu(draw):
    shape = _shape(draw, draw(st.integers(1, 4)))
    slope = _broadcast_partner(draw, shape)
    return (
        "PRelu",
        {"x": _away_from(_arr(draw, shape), [0.0]), "slope": _arr(draw, slope, np.float32)},
        {},
        {},
        17,
        F32_TOL,
    )


def case_tile(draw):
    shape = _shape(draw)
    repeats = [draw(st.integers(1, 3)) for _ in shape]
    return "Tile", {"x": _arr(draw, shape)}, {"repeats": np.array(repeats, dtype=np.int64)}, {}, 17, F64_TOL


def case_pad(draw):
    """Pad in each mode, over all axes (opset 13) or some of them, negative ones too (opset 18's axes input)."""
    mode = draw(st.sampled_from(["constant", "reflect", "edge", "wrap"]))
    shape = tuple(draw(st.integers(2, 4)) for _ in range(draw(st.integers(1, 4))))
    rank = len(shape)
    opset = draw(st.sampled_from([13, 18, 19])) if mode != "wrap" else 19
    axes = list(range(rank))
    if opset >= 18 and draw(st.booleans()):
        axes = sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1, max_size=rank)))
    low = -1 if mode == "constant" else 0
    pads = [draw(st.integers(low, shape[a] - 1)) for a in axes] + [draw(st.integers(low, shape[a] - 1)) for a in axes]
    constants = {"pads": np.array(pads, dtype=np.int64)}
    if len(axes) < rank:
        constants[""] = None
        constants["axes"] = np.array([a - rank if draw(st.booleans()) else a for a in axes], dtype=np.int64)
    order = ["x", "pads", *([""] if "axes" in constants else []), *(["axes"] if "axes" in constants else [])]
    constants.pop("", None)
    return "Pad", {"x": _arr(draw, shape)}, constants, {"mode": mode, "order": order}, opset, F64_TOL


def case_slice_strided(draw):
    """Slices with steps other than 1, negative ones too (Swin's x[:, 0::2], a reversal)."""
    shape = _shape(draw)
    axis = draw(st.integers(0, len(shape) - 1))
    dim = shape[axis]
    step = draw(st.sampled_from([2, 3, -1, -2]))
    start = draw(st.integers(-dim - 1, dim + 1))
    end = draw(st.integers(-dim - 2, dim + 1))
    if len(range(*slice(start, end, step).indices(dim))) == 0:
        start, end = (0, dim) if step > 0 else (dim - 1, -dim - 1)
    return (
        "Slice",
        {"x": _arr(draw, shape)},
        {"starts": np.array([start]), "ends": np.array([end]), "axes": np.array([axis]), "steps": np.array([step])},
        {},
        17,
        F64_TOL,
    )


def case_gather_elements(draw):
    shape = _shape(draw)
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    ishape = list(shape)
    ishape[axis] = draw(dims)
    seed = draw(st.integers(0, 2**31))
    size = shape[axis]
    idx = np.random.default_rng(seed).integers(-size, size, size=ishape).astype(np.int64)
    return "GatherElements", {"x": _arr(draw, shape, np.float32)}, {"i": idx}, {"axis": axis}, 17, F32_TOL


def case_gather_nd(draw):
    shape = _shape(draw, draw(st.integers(1, 3)))
    depth = draw(st.integers(1, len(shape)))
    lead = _shape(draw, draw(st.integers(1, 2)))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    idx = np.stack([rng.integers(0, shape[k], size=lead) for k in range(depth)], -1).astype(np.int64)
    return "GatherND", {"x": _arr(draw, shape, np.float32)}, {"i": idx}, {}, 17, F32_TOL


def case_scatter(op):
    def draw_case(draw):
        shape = _shape(draw, draw(st.integers(1, 3)))
        rng = np.random.default_rng(draw(st.integers(0, 2**31)))
        if op == "ScatterND":  # distinct rows, as an index_put of a slice writes them
            rows = rng.permutation(shape[0])[: draw(st.integers(1, shape[0]))]
            idx = rows.reshape(-1, 1).astype(np.int64)
            updates = _arr(draw, (len(rows), *shape[1:]), np.float32)
            attrs = {}
        else:
            axis = draw(st.integers(0, len(shape) - 1))
            ishape = list(shape)
            ishape[axis] = draw(st.integers(1, shape[axis]))
            idx = np.argsort(rng.random(shape), axis=axis).take(range(ishape[axis]), axis=axis).astype(np.int64)
            updates = _arr(draw, tuple(ishape), np.float32)
            attrs = {"axis": axis}
        reduction = draw(st.sampled_from(["none", "add"]))
        attrs.update(reduction=reduction, order=["x", "i", "u"])
        return op, {"x": _arr(draw, shape, np.float32), "u": updates}, {"i": idx}, attrs, 17, F32_TOL

    return draw_case


def case_cumsum(draw):
    shape = _shape(draw)
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    attrs = {"exclusive": draw(st.integers(0, 1)), "reverse": draw(st.integers(0, 1))}
    return "CumSum", {"x": _arr(draw, shape)}, {"axis": np.array(axis, dtype=np.int64)}, attrs, 17, F64_TOL


def case_reverse_sequence(draw):
    """tf2onnx's form of Keras's ``go_backwards=True`` (time first), and batch first."""
    time_axis = draw(st.integers(0, 1))
    steps, batch = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    shape = (steps, batch) if time_axis == 0 else (batch, steps)
    shape += tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=1)))
    lens = np.array([draw(st.integers(1, steps)) for _ in range(batch)], dtype=np.int64)
    attrs = {"time_axis": time_axis, "batch_axis": 1 - time_axis}
    return "ReverseSequence", {"x": _arr(draw, shape)}, {"lens": lens}, attrs, 17, F64_TOL


def case_trilu(draw):
    shape = _shape(draw, draw(st.integers(2, 3)))
    return (
        "Trilu",
        {"x": _arr(draw, shape, np.float32)},
        {"k": np.array(draw(st.integers(-2, 2)), dtype=np.int64)},
        {"upper": draw(st.integers(0, 1))},
        17,
        F32_TOL,
    )


def case_depth_space(op):
    def draw_case(draw):
        b = draw(st.integers(1, 3))
        n, c, h, w = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
        if op == "SpaceToDepth":
            return op, {"x": _arr(draw, (n, c, h * b, w * b), np.float32)}, {}, {"blocksize": b}, 17, F32_TOL
        mode = draw(st.sampled_from(["DCR", "CRD"]))
        return op, {"x": _arr(draw, (n, c * b * b, h, w), np.float32)}, {}, {"blocksize": b, "mode": mode}, 17, F32_TOL

    return draw_case


def case_conv_transpose(draw):
    """2-D (and 1-D) transposed convolutions: groups, strides, dilations, pads and output_padding."""
    nd = draw(st.sampled_from([1, 2]))
    group = draw(st.integers(1, 3))
    n, cin, cout_g = draw(st.integers(1, 2)), group * draw(st.integers(1, 2)), draw(st.integers(1, 2))
    kernel = [draw(st.integers(1, 3)) for _ in range(nd)]
    strides = [draw(st.integers(1, 3)) for _ in range(nd)]
    dil = [draw(st.integers(1, 2)) for _ in range(nd)]
    pads = [draw(st.integers(0, (k - 1) * d // 2)) for k, d in zip(kernel, dil) for _ in range(2)]
    pads = pads[0::2] + pads[1::2]  # begins, then ends: the output keeps at least the strides' span
    extra = [draw(st.integers(0, s - 1)) for s in strides]  # onnxruntime wants it below the stride
    spatial = tuple(draw(st.integers(1, 4)) for _ in range(nd))
    inputs = {"x": _arr(draw, (n, cin, *spatial), np.float32), "w": _arr(draw, (cin, cout_g, *kernel), np.float32)}
    if draw(st.booleans()):
        inputs["b"] = _arr(draw, (cout_g * group,), np.float32)
    attrs = {"strides": strides, "dilations": dil, "pads": pads, "group": group, "output_padding": extra}
    return "ConvTranspose", inputs, {}, attrs, 17, F32_TOL


def case_resize(draw):
    """Up- and downsampling in each mode and coordinate transformation, by scales or by sizes."""
    mode = draw(st.sampled_from(["nearest", "linear", "cubic"]))
    transform = draw(st.sampled_from(["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"]))
    n, c, h, w = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(2, 5)), draw(st.integers(2, 5))
    attrs = {"mode": mode, "coordinate_transformation_mode": transform}
    if mode == "nearest":
        attrs["nearest_mode"] = draw(st.sampled_from(["round_prefer_floor", "floor", "ceil"]))
    if mode == "cubic":
        attrs["cubic_coeff_a"] = draw(st.sampled_from([-0.75, -0.5]))
        attrs["exclude_outside"] = draw(st.integers(0, 1))
    x = _arr(draw, (n, c, h, w), np.float32)
    if draw(st.booleans()):
        scales = np.array(
            [1.0, 1.0, draw(st.sampled_from([2.0, 0.5, 1.5, 3.0])), draw(st.sampled_from([2.0, 1.0, 0.75]))], np.float32
        )
        return (
            "Resize",
            {"x": x},
            {"roi": np.zeros(0, np.float32), "scales": scales},
            attrs,
            draw(st.sampled_from([13, 19])),
            F32_TOL,
        )
    sizes = np.array([n, c, draw(st.integers(1, 7)), draw(st.integers(1, 7))], np.int64)
    attrs["order"] = ["x", "", "", "sizes"]
    return "Resize", {"x": x}, {"sizes": sizes}, attrs, draw(st.sampled_from([13, 19])), F32_TOL


def case_einsum(draw):
    """Attention's and a bilinear layer's equations, with an ellipsis, an implicit output and a letter
    summed in one operand alone."""
    equation, shapes = draw(
        st.sampled_from(
            [
                ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)]),
                ("bhqk,bkhd->bqhd", [(2, 2, 3, 5), (2, 5, 2, 4)]),
                ("...ij,jk->...ik", [(2, 3, 4), (4, 5)]),
                ("ij,jk", [(3, 4), (4, 2)]),
                ("bi,bj,kij->bk", [(2, 3), (2, 4), (5, 3, 4)]),
                ("ij->i", [(3, 4)]),
                ("bij,k->bk", [(2, 3, 4), (5,)]),
            ]
        )
    )
    inputs = {f"x{k}": _arr(draw, shape) for k, shape in enumerate(shapes)}
    return "Einsum", inputs, {}, {"equation": equation}, 17, F64_TOL


def case_instance_norm(draw):
    shape = (draw(st.integers(1, 2)), draw(dims), *_shape(draw, draw(st.integers(1, 2))))
    if int(np.prod(shape[2:])) < 2:
        shape = (*shape[:2], 3)
    c = shape[1]  # onnxruntime runs it in float32 only
    return (
        "InstanceNormalization",
        {
            "x": _arr(draw, shape, np.float32),
            "scale": _arr(draw, (c,), np.float32),
            "bias": _arr(draw, (c,), np.float32),
        },
        {},
        {"epsilon": 1e-2},
        17,
        F32_TOL,
    )


def case_lrn(draw):
    """Windows of 1, 3 and 5 channels (onnxruntime's kernel takes odd sizes only) over 1-6 channels,
    with alpha large enough that the normalization is far from the identity."""
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 6)), *_shape(draw, 2))  # onnxruntime: [N, C, H, W]
    attrs = {
        "size": draw(st.sampled_from([1, 3, 5])),
        "alpha": draw(st.sampled_from([0.5, 2.0])),
        "beta": draw(st.sampled_from([0.75, 0.5])),
        "bias": draw(st.sampled_from([1.0, 2.0])),
    }
    return "LRN", {"x": _arr(draw, shape, np.float32)}, {}, attrs, 17, F32_TOL  # onnxruntime: float32 only


def case_group_norm(draw):
    """Opset 18's per-group scale and bias and opset 21's per-channel ones."""
    groups = draw(st.integers(1, 3))
    c = groups * draw(st.integers(1, 2))
    shape = (draw(st.integers(1, 2)), c, *_shape(draw, draw(st.integers(1, 2))))
    opset = draw(st.sampled_from([18, 21]))
    affine = groups if opset < 21 else c
    return (
        "GroupNormalization",
        {
            "x": _arr(draw, shape, np.float32),
            "scale": _arr(draw, (affine,), np.float32),
            "bias": _arr(draw, (affine,), np.float32),
        },
        {},
        {"num_groups": groups, "epsilon": 1e-2},
        opset,
        F32_TOL,
    )


def case_conv(kind):
    """Dense, grouped (2 or 4 groups of several channels) and depthwise (one input channel per
    group, with a channel multiplier of 1 or 2) Convs, 1-D and 2-D, with strides, padding and
    dilation: each kind takes its own weight-gradient path."""

    def draw_case(draw):
        nd = draw(st.integers(1, 2))
        if kind == "dense":
            group, cin, cout = 1, draw(st.sampled_from([1, 2, 8])), draw(st.integers(1, 3))  # 8: one Gemm per offset
        elif kind == "grouped":
            group = draw(st.sampled_from([2, 4]))
            cin, cout = group * draw(st.integers(2, 3)), group * draw(st.integers(1, 2))
        else:
            group = cin = draw(st.integers(2, 5))
            cout = cin * draw(st.integers(1, 2))
        kernel = [draw(st.integers(1, 3)) for _ in range(nd)]
        stride = [draw(st.integers(1, 2)) for _ in range(nd)]
        dil = [draw(st.integers(1, 2)) for _ in range(nd)]
        pads = [draw(st.integers(0, 1)) for _ in range(2 * nd)]
        spatial = [draw(st.integers((k - 1) * d + 1, 7)) for k, d in zip(kernel, dil)]
        n = draw(st.integers(1, 2))
        inputs = {
            "x": _arr(draw, (n, cin, *spatial), np.float32),
            "w": _arr(draw, (cout, cin // group, *kernel), np.float32),
        }
        if draw(st.booleans()):
            inputs["b"] = _arr(draw, (cout,), np.float32)
        return "Conv", inputs, {}, {"strides": stride, "dilations": dil, "pads": pads, "group": group}, 17, F32_TOL

    return draw_case


def case_pool(op):
    def draw_case(draw):
        n, c = draw(st.integers(1, 2)), draw(st.integers(1, 3))
        k = [draw(st.integers(1, 3)), draw(st.integers(1, 3))]
        stride = [draw(st.integers(1, 3)), draw(st.integers(1, 3))]
        pads = [draw(st.integers(0, k[0] - 1)), draw(st.integers(0, k[1] - 1)), 0, 0]
        h, w = draw(st.integers(k[0], 7)), draw(st.integers(k[1], 7))
        x = _distinct(draw, (n, c, h, w))
        attrs = {"kernel_shape": k, "strides": stride, "pads": pads}
        if op == "MaxPool":
            attrs["outputs"] = ["y", "indices"]
        else:
            attrs["count_include_pad"] = draw(st.integers(0, 1))
        if draw(st.booleans()) and all(
            _last_window_starts_inside(n_, k_, s_, p_) for n_, k_, s_, p_ in zip((h, w), k, stride, pads[:2])
        ):
            attrs["ceil_mode"] = 1  # the last windows may run past the end padding
        return op, {"x": x}, {}, attrs, draw(st.sampled_from([16, 17])), F32_TOL

    return draw_case


def _last_window_starts_inside(n: int, k: int, stride: int, begin: int) -> bool:
    """With ceil_mode, onnxruntime (and torch) drop a last window that starts past the input and its
    begin padding, which onnx's shape inference still counts: such layouts are left out."""
    out = -(-(n + begin - k) // stride) + 1
    return (out - 1) * stride < n + begin


def case_tiling_maxpool(draw):
    """Windows that tile the input: the gradient finds each window's maximum without Indices."""
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    if draw(st.booleans()):
        kw = kh  # square windows take the SpaceToDepth path
    x = _distinct(
        draw,
        (draw(st.integers(1, 2)), draw(st.integers(1, 3)), kh * draw(st.integers(1, 3)), kw * draw(st.integers(1, 3))),
    )
    return (
        "MaxPool",
        {"x": x},
        {},
        {"kernel_shape": [kh, kw], "strides": [kh, kw]},
        draw(st.sampled_from([13, 17])),
        F32_TOL,
    )


def case_overlapping_maxpool(draw):
    """Windows that overlap (or leave no gap), strides dividing the input: the gradient compares
    each window with the output instead of reading Indices."""
    k = [draw(st.integers(1, 3)), draw(st.integers(1, 3))]
    stride = [draw(st.integers(1, k[0])), draw(st.integers(1, k[1]))]
    pads = [draw(st.integers(0, k[0] - 1)), draw(st.integers(0, k[1] - 1))]
    pads += [draw(st.integers(0, k[0] - 1)), draw(st.integers(0, k[1] - 1))]
    h, w = (s * draw(st.integers(-(-max(1, kk - p - q) // s), 4)) for s, kk, p, q in zip(stride, k, pads[:2], pads[2:]))
    x = _distinct(draw, (draw(st.integers(1, 2)), draw(st.integers(1, 3)), h, w))
    attrs = {"kernel_shape": k, "strides": stride, "pads": pads}
    return "MaxPool", {"x": x}, {}, attrs, draw(st.sampled_from([13, 17])), F32_TOL


def case_global_pool(op):
    def draw_case(draw):
        x = _distinct(draw, (draw(st.integers(1, 2)), draw(dims), draw(dims), draw(dims)))
        return op, {"x": x}, {}, {}, 17, F32_TOL

    return draw_case


def case_layer_norm(draw):
    shape = _shape(draw, draw(st.integers(2, 4)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    norm = shape[axis:] if axis >= 0 else shape[len(shape) + axis :]
    return (
        "LayerNormalization",
        {"x": _arr(draw, shape), "scale": _arr(draw, norm), "bias": _arr(draw, norm)},
        {},
        {"axis": axis, "epsilon": 1e-3},
        17,
        F64_TOL,
    )


#: the gates of each recurrent op's weights
_GATES = {"GRU": 3, "LSTM": 4, "RNN": 1}


def case_recurrent(op):
    """GRU / LSTM / RNN (written out and unrolled) against onnxruntime's own kernel, in float32: forward,
    reverse and bidirectional, initial states or none (an RNN's activation tanh or relu per direction)."""
    gates = _GATES[op]

    def draw_case(draw):
        seq, batch, features, hidden = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(dims), draw(dims)
        direction = draw(st.sampled_from(["forward", "reverse", "bidirectional"]))
        d = 2 if direction == "bidirectional" else 1
        inputs = {
            "x": _arr(draw, (seq, batch, features), np.float32, -1, 1),
            "w": _arr(draw, (d, gates * hidden, features), np.float32, -1, 1),
            "r": _arr(draw, (d, gates * hidden, hidden), np.float32, -1, 1),
        }
        order = ["x", "w", "r"]
        if draw(st.booleans()):
            inputs["b"] = _arr(draw, (d, 2 * gates * hidden), np.float32, -1, 1)
            order.append("b")
        states = ["h0"] if op in ("GRU", "RNN") else draw(st.sampled_from([[], ["h0"], ["h0", "c0"]]))
        if states and draw(st.booleans()):
            order += [""] * (5 - len(order))
            for name in states:
                inputs[name] = _arr(draw, (d, batch, hidden), np.float32, -1, 1)
                order.append(name)
        attrs = {
            "hidden_size": hidden,
            "order": order,
            "outputs": ["y", "y_h"] if op in ("GRU", "RNN") else ["y", "y_h", "y_c"],
            "direction": direction,
        }
        if op == "GRU":
            attrs["linear_before_reset"] = draw(st.integers(0, 1))
        if op == "RNN" and draw(st.booleans()):
            attrs["activations"] = [draw(st.sampled_from(["Tanh", "Relu"])) for _ in range(d)]
        return op, inputs, {}, attrs, 17, F32_TOL

    return draw_case


def case_dropout_inference(draw):
    return "Dropout", {"x": _arr(draw, _shape(draw))}, {}, {}, 17, F64_TOL


CASES = {
    **{op: case_binary(op) for op in ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min")},
    **{op: case_unary(op) for op in ("Identity", "Neg", "Relu", "Sigmoid", "Tanh", "Exp", "Abs")},
    # onnxruntime runs these in float32 only
    **{op: case_unary(op, dtype=np.float32) for op in ("Erf", "Softplus")},
    "LeakyRelu": case_unary("LeakyRelu", alpha=0.2),
    "Log": case_unary("Log", positive=True),
    "Sqrt": case_unary("Sqrt", positive=True),
    "Reciprocal": case_unary("Reciprocal", positive=True),
    "Pow(constant)": case_pow_constant,
    "Mul(square)": case_square,
    "Clip": case_clip,
    "Where": case_where,
    "Sum": case_sum,
    "Gemm": case_gemm,
    "MatMul": case_matmul,
    "Softmax": case_softmax("Softmax"),
    "LogSoftmax": case_softmax("LogSoftmax"),
    **{
        op: case_reduce(op)
        for op in (
            "ReduceSum",
            "ReduceMean",
            "ReduceMax",
            "ReduceMin",
            "ReduceSumSquare",
            "ReduceL2",
            "ReduceLogSumExp",
        )
    },
    "Reshape": case_reshape,
    "Flatten": case_flatten,
    "Squeeze": case_squeeze("Squeeze"),
    "Unsqueeze": case_squeeze("Unsqueeze"),
    "Transpose": case_transpose,
    "Concat": case_concat,
    "Split": case_split,
    "Slice": case_slice,
    "Gather": case_gather,
    "Expand": case_expand,
    "Cast": case_cast,
    "CastLike": case_cast_like,
    "HardSigmoid": case_hard_sigmoid,
    "HardSwish": case_hard_swish,
    "Dropout": case_dropout_inference,
    "Gelu": case_activation("Gelu", opset=20, approximate=["none", "tanh"]),
    "Mish": case_activation("Mish", opset=18),
    "Elu": case_activation("Elu", alpha=[1.0, 0.5]),
    "Selu": case_activation("Selu"),
    "Celu": case_activation("Celu", alpha=[1.0, 0.5]),
    "ThresholdedRelu": case_activation("ThresholdedRelu", lambda a: [a["alpha"]], alpha=[1.0, 0.3]),
    "Shrink": case_activation("Shrink", lambda a: [-a["lambd"], a["lambd"]], lambd=[0.5, 0.3], bias=[0.0, 0.3]),
    "Softsign": case_activation("Softsign"),
    "Sin": case_activation("Sin"),
    "Cos": case_activation("Cos"),
    "Tan": case_inverse_trigonometric("Tan"),
    "Sinh": case_activation("Sinh"),
    "Cosh": case_activation("Cosh"),
    **{op: case_inverse_trigonometric(op) for op in ("Asin", "Acos", "Atan", "Asinh", "Acosh", "Atanh")},
    "TopK": case_topk,
    "PRelu": case_prelu,
    "Tile": case_tile,
    "Pad": case_pad,
    "Slice(strided)": case_slice_strided,
    "GatherElements": case_gather_elements,
    "GatherND": case_gather_nd,
    "ScatterND": case_scatter("ScatterND"),
    "ScatterElements": case_scatter("ScatterElements"),
    "CumSum": case_cumsum,
    "ReverseSequence": case_reverse_sequence,
    "Trilu": case_trilu,
    "DepthToSpace": case_depth_space("DepthToSpace"),
    "SpaceToDepth": case_depth_space("SpaceToDepth"),
    "ConvTranspose": case_conv_transpose,
    "Resize": case_resize,
    "Einsum": case_einsum,
    "InstanceNormalization": case_instance_norm,
    "GroupNormalization": case_group_norm,
    "LRN": case_lrn,
    "LayerNormalization": case_layer_norm,
    "GRU": case_recurrent("GRU"),
    "LSTM": case_recurrent("LSTM"),
    "RNN": case_recurrent("RNN"),
    "Conv": case_conv("dense"),
    "Conv(grouped)": case_conv("grouped"),
    "Conv(depthwise)": case_conv("depthwise"),
    "MaxPool": case_pool("MaxPool"),
    "MaxPool(tiling)": case_tiling_maxpool,
    "MaxPool(overlapping)": case_overlapping_maxpool,
    "AveragePool": case_pool("AveragePool"),
    "GlobalAveragePool": case_global_pool("GlobalAveragePool"),
    "GlobalMaxPool": case_global_pool("GlobalMaxPool"),
}


def test_every_rule_has_a_finite_difference_case():
    covered = {name.split("(")[0] for name in CASES}
    assert set(RULES) | set(DECOMPOSED) <= covered, sorted(set(RULES) | set(DECOMPOSED) - covered)
    assert set(RULES) | NO_GRADIENT <= set(OP_COVERAGE)


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(data=st.data())
def test_gradient_matches_finite_differences(case, data):
    """Five drawn inputs per case in the default run; the slow twin below draws fifteen."""
    _gradient_matches_finite_differences(case, data)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(data=st.data())
def test_gradient_matches_finite_differences_on_fifteen_drawn_inputs(case, data):
    _gradient_matches_finite_differences(case, data)


def _gradient_matches_finite_differences(case: str, data: st.DataObject) -> None:
    op, inputs, constants, attrs, opset, tol = data.draw(st.composite(lambda draw: CASES[case](draw))())
    outputs = attrs.pop("outputs", ["y"])
    model = single_op_model(op, inputs, constants, outputs=outputs, opset=opset, **attrs)
    # float32: a step large enough for float32 rounding, small enough for the curvature of the
    # unrolled recurrences (their error shrinks as eps^2: a truncation error, not a wrong rule)
    eps = 1e-6 if tol == F64_TOL else (1e-3 if op in _GATES else 3e-3)
    error = vjp_error(
        model, inputs, list(inputs), outputs=[outputs[0]] if op in ("MaxPool", "TopK") else outputs, eps=eps
    )
    assert error < tol, (op, {k: v.shape for k, v in inputs.items()}, constants, attrs, error)


@pytest.mark.parametrize(
    "form, words",
    [
        ({"layout": 1}, "layout=0 only"),
        ({"order": ["x", "w", "r", "", "lens"]}, "without sequence_lens"),
        ({"clip": 1.0}, "without clip"),
        ({"activations": ["Sigmoid", "Relu", "Relu"]}, "default activations only"),
    ],
)
def test_recurrent_ops_in_forms_not_unrolled_are_refused_naming_the_attribute(form, words):
    rng = np.random.default_rng(0)
    inputs = {
        "x": rng.standard_normal((3, 2, 4)).astype(np.float32),
        "w": rng.standard_normal((1, 8, 4)).astype(np.float32),
        "r": rng.standard_normal((1, 8, 2)).astype(np.float32),
    }
    constants = {"lens": np.array([3, 2], np.int32)} if "order" in form else {}
    model = single_op_model("LSTM", inputs, constants, outputs=["y"], hidden_size=2, **form)
    with pytest.raises(UnsupportedOpError, match=f"'LSTM' \\(node 'the_LSTM'\\) is unrolled .*{words}"):
        vjp_model(model, outputs=["y"], wrt=["w"])


def test_a_recurrent_op_over_a_sequence_of_run_time_length_is_refused_saying_how_to_export_it():
    """tf2onnx writes ``unk__N`` for a Keras input's ``None`` length: an unrolled step per position needs the length."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["unk__1", "N", 4])
    inits = [
        numpy_helper.from_array(np.ones((1, 8, 4), np.float32), "w"),
        numpy_helper.from_array(np.ones((1, 8, 2), np.float32), "r"),
    ]
    node = helper.make_node("LSTM", ["x", "w", "r"], ["y"], name="the_LSTM", hidden_size=2)
    graph = helper.make_graph([node], "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(
        UnsupportedOpError, match=r"'LSTM' \(node 'the_LSTM'\) needs .*static sequence length.*TensorSpec"
    ):
        vjp_model(model, outputs=["y"], wrt=["w"])


@pytest.mark.parametrize("kind", ["slice_to_the_end", "gather_first", "gather_last_rows"])
def test_slices_and_gathers_along_an_axis_of_run_time_size_are_differentiated(kind):
    """The dynamo exporter's unoptimized graphs slice the batch axis whole (x[:, 0] becomes a Slice from
    0 to 2**63-1 of the batch axis, then a Gather) and leave sizes symbolic."""
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 4])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5, 3])
    if kind == "slice_to_the_end":
        inits = {"s": np.array([1]), "e": np.array([2**63 - 1]), "a": np.array([0])}
        last = helper.make_node("Slice", ["h", "s", "e", "a"], ["y"])
    else:
        inits = {"i": np.array(0) if kind == "gather_first" else np.array([-1, -2])}
        last = helper.make_node("Gather", ["h", "i"], ["y"], axis=0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), last],
        "g",
        [x, w],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(v.astype(np.int64), k) for k, v in inits.items()],
    )
    model = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    )
    rng = np.random.default_rng(0)
    values = {
        "x": rng.standard_normal((3, 5, 3)).astype(np.float32),
        "w": rng.standard_normal((3, 4)).astype(np.float32),
    }
    assert vjp_error(model, values, ["x", "w"], eps=1e-2) < F32_TOL


@pytest.mark.parametrize("kind", ["dense", "depthwise"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(data=st.data())
def test_small_conv_as_taps_computes_the_conv_and_its_gradient(kind, data):
    """A training plan runs a dense or depthwise Conv with few output positions as a sum over its
    kernel offsets (channels last); that rewrite computes the Conv's values, and differentiated
    node by node it matches finite differences, for 1-D and 2-D, strides, padding, dilation,
    offsets that read padding only, and a depthwise channel multiplier."""
    draw = data.draw
    nd = draw(st.integers(1, 2))
    channels = draw(st.integers(2, 5))
    c_out = channels * draw(st.integers(1, 2)) if kind == "depthwise" else draw(st.integers(1, 4))
    kernel = [draw(st.integers(1, 3)) for _ in range(nd)]
    stride = [draw(st.integers(1, 3)) for _ in range(nd)]
    dil = [draw(st.integers(1, 2)) for _ in range(nd)]
    pads = [draw(st.integers(0, 2)) for _ in range(2 * nd)]
    spatial = [
        draw(st.integers(max(1, (k - 1) * d + 1 - pads[a] - pads[nd + a]), 5))
        for a, (k, d) in enumerate(zip(kernel, dil))
    ]
    out = [
        (h + pads[a] + pads[nd + a] - (k - 1) * d - 1) // s + 1
        for a, (h, k, d, s) in enumerate(zip(spatial, kernel, dil, stride))
    ]
    assume(int(np.prod(out)) <= min(DEPTHWISE_TAPS_MAX_POSITIONS, DENSE_TAPS_MAX_POSITIONS))
    inputs = {
        "x": _arr(draw, (draw(st.integers(1, 3)), channels, *spatial), np.float32),
        "w": _arr(draw, (c_out, 1 if kind == "depthwise" else channels, *kernel), np.float32),
    }
    if draw(st.booleans()):
        inputs["b"] = _arr(draw, (c_out,), np.float32)
    model = single_op_model(
        "Conv", inputs, strides=stride, dilations=dil, pads=pads, group=channels if kind == "depthwise" else 1
    )
    taps = training_forward_model(model)
    assert "Conv" not in {n.op_type for n in taps.graph.node}
    want = make_session(model.SerializeToString()).run(None, inputs)[0]
    got = make_session(taps.SerializeToString()).run(None, inputs)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert vjp_error(taps, inputs, list(inputs), eps=3e-3) < F32_TOL


@pytest.mark.parametrize(
    ("size", "kernel", "stride", "pads"),
    [
        ((16, 16), [3, 3], [2, 2], [1, 1, 1, 1]),  # ResNet's first pool
        ((4, 6), [2, 2], [1, 1], [0, 0, 0, 0]),
        ((6, 4), [3, 2], [2, 1], [1, 0, 2, 1]),
        ((6,), [3], [3], [2, 1]),
    ],
)
def test_maxpool_without_indices_sends_dy_to_each_windows_first_maximum(size, kernel, stride, pads):
    """A MaxPool whose windows overlap trains without its Indices output: each window's values are
    compared with the output, and dy goes to the first maximum in the window's order, as the
    Indices say, on inputs with many ties (a ReLU's zeros, small integers)."""
    rng = np.random.default_rng(len(size) + sum(pads))
    x = np.maximum(rng.integers(-2, 3, (2, 3, *size)), 0).astype(np.float32)
    attrs = {"kernel_shape": kernel, "strides": stride, "pads": pads}
    plain = training_forward_model(single_op_model("MaxPool", {"x": x}, **attrs))
    assert [len(n.output) for n in plain.graph.node if n.op_type == "MaxPool"] == [1]
    indexed = single_op_model("MaxPool", {"x": x}, outputs=["y", "indices"], **attrs)
    seed = rng.standard_normal(make_session(plain.SerializeToString()).run(None, {"x": x})[0].shape).astype(np.float32)
    grads = [
        make_session(vjp_model(m, outputs=["y"], wrt=["x"]).SerializeToString()).run(
            ["grad/x"], {"x": x, "seed/y": seed}
        )
        for m in (plain, indexed)
    ]
    np.testing.assert_allclose(grads[0][0], grads[1][0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["dense", "depthwise"])
@pytest.mark.parametrize(("size", "stride"), [((4, 4), 1), ((2, 2), 1), ((4, 4), 2), ((6, 4), 2), ((3,), 1)])
def test_padded_conv_as_taps_gathers_its_input_gradient_from_one_padded_dy(kind, size, stride):
    """A padded Conv run as taps (ResNet-18's 3x3 layers on 4x4 and 2x2 images, with strides its
    first of each stage) takes its input gradient as, per input position, the terms of dy that
    reach it: dy padded once (the forward's own Pad is the graph's other one), not each offset's
    window gradient padded to the input's size; it matches finite differences."""
    nd = len(size)
    rng = np.random.default_rng(sum(size) * stride)
    channels = 3
    c_out = 2 * channels if kind == "depthwise" else 4
    inputs = {
        "x": rng.standard_normal((2, channels, *size)).astype(np.float32),
        "w": rng.standard_normal((c_out, 1 if kind == "depthwise" else channels, *[3] * nd)).astype(np.float32),
    }
    model = single_op_model(
        "Conv", inputs, strides=[stride] * nd, pads=[1] * (2 * nd), group=channels if kind == "depthwise" else 1
    )
    taps = training_forward_model(model)
    assert "Conv" not in {n.op_type for n in taps.graph.node}
    grads = vjp_model(taps, outputs=["y"], wrt=["x", "w"])
    assert [n.op_type for n in grads.graph.node].count("Pad") == 2
    assert vjp_error(taps, inputs, list(inputs), eps=3e-3) < F32_TOL


@pytest.mark.parametrize(("channels", "group"), [(96, 96), (128, 32)])
def test_grouped_conv_gradient_never_pairs_every_input_with_every_output_channel(channels, group):
    """The gradient of a grouped or depthwise Conv does the work of its groups only: no tensor of its
    graph is larger than the kernel's offsets times the largest of x, y and w, whereas pairing every
    input channel with every output channel (then masking) makes a [Cin, Cout, k, k] tensor, ``group``
    times the work."""
    rng = np.random.default_rng(0)
    inputs = {
        "x": rng.standard_normal((2, channels, 6, 6)).astype(np.float32),
        "w": rng.standard_normal((channels, channels // group, 3, 3)).astype(np.float32),
    }
    model = single_op_model("Conv", inputs, strides=[2, 2], pads=[1, 1, 1, 1], group=group)
    grad = vjp_model(model, outputs=["y"], wrt=["x", "w"])
    sizes = {
        name: int(np.prod(info.static_shape))
        for name, info in tensor_infos(grad).items()
        if info.static_shape is not None
    }
    bound = 9 * max(sizes["x"], sizes["y"], sizes["w"])
    assert max(sizes.values()) <= bound, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]


def _gradient_graph_size(op: str, seq: int) -> int:
    """The elements of every tensor the vector-Jacobian product of an unrolled ``op`` makes."""
    gates = 3 if op == "GRU" else 4
    rng = np.random.default_rng(0)
    inputs = {
        "x": rng.standard_normal((seq, 3, 4)).astype(np.float32),
        "w": rng.standard_normal((1, gates * 5, 4)).astype(np.float32),
        "r": rng.standard_normal((1, gates * 5, 5)).astype(np.float32),
    }
    model = single_op_model(op, inputs, hidden_size=5, outputs=["y", "y_h"])
    grad = vjp_model(model, outputs=["y", "y_h"], wrt=list(inputs))
    return sum(int(np.prod(info.static_shape)) for info in tensor_infos(grad).values() if info.static_shape is not None)


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_unrolled_recurrence_gradient_grows_linearly_with_the_sequence(op):
    """Four times the steps, at most about four times the tensors: each step's slice of the
    sequence gives its gradient back through one Concat, not a zero-padded copy of the whole
    sequence per step (which grew with the square of its length)."""
    assert _gradient_graph_size(op, 16) < 4.5 * _gradient_graph_size(op, 4)


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_a_weight_used_at_every_step_sums_its_gradient_in_one_gemm(op):
    """The recurrent weights' gradient is one Gemm over every step's rows stacked, however long the
    sequence: each step adds two matrix products (its forward one and its dh), not a third small
    Gemm for the weight added up with the others (16 Gemms of 32 rows ran at a third of the speed)."""

    def products(seq: int) -> int:
        gates = 3 if op == "GRU" else 4
        rng = np.random.default_rng(0)
        inputs = {
            "x": rng.standard_normal((seq, 3, 4)).astype(np.float32),
            "w": rng.standard_normal((1, gates * 5, 4)).astype(np.float32),
            "r": rng.standard_normal((1, gates * 5, 5)).astype(np.float32),
        }
        grad = vjp_model(single_op_model(op, inputs, hidden_size=5, outputs=["y"]), outputs=["y"], wrt=["r"])
        live = needed_for(grad.graph.node, ["grad/r"])
        return sum(1 for n in grad.graph.node if n.op_type in ("Gemm", "MatMul") and n.output[0] in live)

    assert products(16) - products(4) == (2 if op == "LSTM" else 2 * 2) * 12


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_unrolled_steps_read_no_shapes_with_a_dynamic_batch(op):
    """With a dynamic batch, the unrolled steps and their gradients read no tensor's shape at run
    time: the states keep the op's [1, batch, H] layout, and a Squeeze's or Unsqueeze's gradient is
    the inverse op on its constant axes, not a Reshape to the shape read from its input."""

    def shapes_read(seq: int) -> int:
        gates = 3 if op == "GRU" else 4
        rng = np.random.default_rng(0)
        weights = {
            "w": rng.standard_normal((1, gates * 5, 4)).astype(np.float32),
            "r": rng.standard_normal((1, gates * 5, 5)).astype(np.float32),
        }
        node = helper.make_node(op, ["x", "w", "r"], ["y", "y_h"], hidden_size=5)
        graph = helper.make_graph(
            [node],
            "rnn",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [seq, "N", 4])],
            [helper.make_tensor_value_info("y_h", TensorProto.FLOAT, [1, "N", 5])],
            initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        grad = vjp_model(model, outputs=["y_h"], wrt=["w", "r"])
        return sum(1 for n in grad.graph.node if n.op_type == "Shape")

    assert shapes_read(16) == shapes_read(4)


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_unrolled_gates_are_cut_by_one_split_whose_gradient_pads_nothing(op, direction):
    """Each step cuts its gates with one Split (gradient: one Concat), not a Slice per gate whose
    gradient pads it back to all gates' width: the gradient's Pads do not grow with the steps."""

    def pads(seq: int) -> int:
        gates, d = (3 if op == "GRU" else 4), (2 if direction == "bidirectional" else 1)
        rng = np.random.default_rng(0)
        inputs = {
            "x": rng.standard_normal((seq, 3, 4)).astype(np.float32),
            "w": rng.standard_normal((d, gates * 5, 4)).astype(np.float32),
            "r": rng.standard_normal((d, gates * 5, 5)).astype(np.float32),
            "b": rng.standard_normal((d, 2 * gates * 5)).astype(np.float32),
        }
        model = single_op_model(op, inputs, hidden_size=5, direction=direction, outputs=["y", "y_h"])
        grad = vjp_model(model, outputs=["y", "y_h"], wrt=list(inputs))
        return sum(1 for n in grad.graph.node if n.op_type == "Pad")

    assert pads(16) == pads(4)


@pytest.mark.parametrize("outputs", [["y"], ["y_h"], ["y_c"], ["y_h", "y_c"]])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("states", [False, True])
def test_an_lstm_read_by_some_of_its_outputs_is_differentiated_through_them_alone(outputs, direction, states):
    """The unrolled LSTM's steps are differentiated as a whole: whichever of Y, Y_h and Y_c a model
    reads (a classifier reads the last state alone), from zero or given initial states."""
    d = 2 if direction == "bidirectional" else 1
    rng = np.random.default_rng(len(outputs) + 3 * d)
    inputs = {
        "x": rng.uniform(-1, 1, (5, 2, 3)).astype(np.float32),
        "w": rng.uniform(-1, 1, (d, 16, 3)).astype(np.float32),
        "r": rng.uniform(-1, 1, (d, 16, 4)).astype(np.float32),
        "b": rng.uniform(-1, 1, (d, 32)).astype(np.float32),
    }
    order = ["x", "w", "r", "b"]
    if states:
        inputs |= {k: rng.uniform(-1, 1, (d, 2, 4)).astype(np.float32) for k in ("h0", "c0")}
        order += ["", "h0", "c0"]
    model = single_op_model(
        "LSTM", inputs, order=order, outputs=["y", "y_h", "y_c"], hidden_size=4, direction=direction
    )
    assert vjp_error(model, inputs, list(inputs), outputs=outputs, eps=1e-3) < F32_TOL


def test_two_stacked_lstms_are_each_differentiated_as_a_whole():
    """A two-layer LSTM (the second reads the first's Y, as torch's num_layers=2 exports it): each
    layer's steps are one group, the second's input gradient flows into the first's outputs."""
    rng = np.random.default_rng(7)
    inputs = {
        "x": rng.uniform(-1, 1, (4, 2, 3)).astype(np.float32),
        "w1": rng.uniform(-1, 1, (1, 16, 3)).astype(np.float32),
        "r1": rng.uniform(-1, 1, (1, 16, 4)).astype(np.float32),
        "w2": rng.uniform(-1, 1, (1, 12, 4)).astype(np.float32),
        "r2": rng.uniform(-1, 1, (1, 12, 3)).astype(np.float32),
    }
    nodes = [
        helper.make_node("LSTM", ["x", "w1", "r1"], ["y1"], hidden_size=4),
        helper.make_node("Squeeze", ["y1", "axis1"], ["x2"]),
        helper.make_node("LSTM", ["x2", "w2", "r2"], ["y", "y_h"], hidden_size=3),
    ]
    graph = helper.make_graph(
        nodes,
        "two_layers",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in inputs.items()],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("y", "y_h")],
        initializer=[numpy_helper.from_array(np.array([1], np.int64), "axis1")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    assert vjp_error(model, inputs, list(inputs), eps=1e-3) < F32_TOL


def test_an_unrolled_lstm_step_forward_and_backward_takes_a_bounded_number_of_nodes():
    """Each further step adds its forward (one Gemm, the gates' arithmetic) and its backward (one
    Gemm for dh, the gates' gradient from factors of its forward values): 24 nodes, where the rules
    of the unrolled nodes one by one took 35, more of them passes over whole [batch, H] tensors."""

    def nodes(seq: int) -> int:
        rng = np.random.default_rng(0)
        inputs = {
            "x": rng.standard_normal((seq, 3, 4)).astype(np.float32),
            "w": rng.standard_normal((1, 20, 4)).astype(np.float32),
            "r": rng.standard_normal((1, 20, 5)).astype(np.float32),
        }
        grad = vjp_model(single_op_model("LSTM", inputs, hidden_size=5, outputs=["y"]), outputs=["y"], wrt=list(inputs))
        return len(grad.graph.node)

    assert (nodes(16) - nodes(4)) / 12 <= 24


@pytest.mark.parametrize("pieces", [[(0, 2), (2, 6), (6, 8)], [(6, 2**31 - 1), (0, 2), (-6, -2)]])
def test_slices_cutting_a_weight_into_pieces_are_differentiated_as_one_split(pieces):
    """torch's exporter reorders an LSTM's gates by slicing its weights apart and concatenating the
    pieces: the Slices become one Split, whose gradient is one Concat, not a padded copy per piece."""
    inits = []
    nodes = []
    for k, (start, end) in enumerate(pieces):
        inits += [
            numpy_helper.from_array(np.array([v], np.int64), f"{name}{k}") for name, v in (("s", start), ("e", end))
        ]
        nodes.append(helper.make_node("Slice", ["w", f"s{k}", f"e{k}", "axis"], [f"piece{k}"]))
    inits.append(numpy_helper.from_array(np.array([0], np.int64), "axis"))
    nodes += [
        helper.make_node("Concat", [f"piece{k}" for k in reversed(range(len(pieces)))], ["reordered"], axis=0),
        helper.make_node("MatMul", ["x", "reordered"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    rng = np.random.default_rng(0)
    values = {"x": rng.standard_normal((3, 8)).astype(np.float32), "w": rng.standard_normal((8, 2)).astype(np.float32)}
    assert vjp_error(model, values, ["x", "w"], eps=1e-2) < F32_TOL
    ops = [n.op_type for n in vjp_model(model, outputs=["y"], wrt=["w"]).graph.node]
    assert "Pad" not in ops and "Slice" not in ops


def test_slices_overlapping_or_leaving_a_gap_stay_slices():
    """Only pieces that cover the tensor once each become a Split; others keep their Slices (and
    their padded gradients)."""
    for pieces in ([(0, 4), (2, 8)], [(0, 2), (4, 8)]):
        inits = [numpy_helper.from_array(np.array([0], np.int64), "axis")]
        nodes = []
        for k, (start, end) in enumerate(pieces):
            inits += [
                numpy_helper.from_array(np.array([v], np.int64), f"{n}{k}") for n, v in (("s", start), ("e", end))
            ]
            nodes.append(helper.make_node("Slice", ["w", f"s{k}", f"e{k}", "axis"], [f"p{k}"]))
            nodes.append(helper.make_node("ReduceSumSquare", [f"p{k}"], [f"y{k}"], keepdims=0))
        nodes.append(helper.make_node("Add", ["y0", "y1"], ["y"]))
        graph = helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 2])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
            initializer=inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        values = {"w": np.random.default_rng(1).standard_normal((8, 2)).astype(np.float32)}
        assert vjp_error(model, values, ["w"], eps=1e-2) < F32_TOL
        assert [n.op_type for n in vjp_model(model, outputs=["y"], wrt=["w"]).graph.node].count("Pad") == 2


def test_tile_by_repeats_read_at_run_time_is_differentiated():
    """A class token repeated over the batch (token.repeat(x.shape[0], 2, 1)): the repeats come from Shape."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], end=1),
        helper.make_node("Concat", ["shape", "rest"], ["repeats"], axis=0),
        helper.make_node("Tile", ["token", "repeats"], ["tiled"]),
        helper.make_node("Mul", ["tiled", "x"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 3]),
            helper.make_tensor_value_info("token", TensorProto.FLOAT, [1, 1, 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 3])],
        initializer=[numpy_helper.from_array(np.array([2, 1], np.int64), "rest")],
    )
    model = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    )
    rng = np.random.default_rng(0)
    values = {"x": rng.standard_normal((3, 2, 3)), "token": rng.standard_normal((1, 1, 3))}
    assert vjp_error(model, {k: v.astype(np.float32) for k, v in values.items()}, ["x", "token"], eps=1e-2) < F32_TOL


@pytest.mark.parametrize("split, keepdims", [([2, 3, 1], 1), (4, 1), (None, 0), (None, 1)])
def test_sequence_at_of_a_split_to_sequence_is_differentiated_as_its_slice(split, keepdims):
    """The dynamo exporter's unoptimized GPT-2 splits its fused query/key/value with SplitToSequence and
    reads the parts with SequenceAt (here at a negative position too)."""
    inits = [numpy_helper.from_array(np.array(p, np.int64), f"p{k}") for k, p in enumerate([0, -1, 1])]
    inputs = ["h"]
    if split is not None:
        inits.append(numpy_helper.from_array(np.array(split, np.int64), "split"))
        inputs.append("split")
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("SplitToSequence", inputs, ["parts"], axis=1, keepdims=keepdims),
        *[helper.make_node("SequenceAt", ["parts", f"p{k}"], [f"part{k}"]) for k in range(3)],
        helper.make_node("Tanh", ["part0"], ["t0"]),
        helper.make_node("Sigmoid", ["part1"], ["t1"]),
        helper.make_node("Concat", ["t0", "t1", "part2"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [1, 6]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    width = {"[2, 3, 1]": 2 + 1 + 3, "4": 4 + 2 + 2, "None": 3}[str(split)]  # parts 0, -1 and 1
    model.graph.output[0].CopyFrom(
        helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width] if keepdims else [None])
    )
    rng = np.random.default_rng(0)
    values = {"x": rng.standard_normal((3, 6)).astype(np.float32), "w": rng.standard_normal((1, 6)).astype(np.float32)}
    assert vjp_error(model, values, ["x", "w"], eps=1e-2) < F32_TOL


def _erf_gelu(order: int, scale_op: str, shared: bool) -> onnx.ModelProto:
    """``x * (erf(x / sqrt 2) + 1) * 0.5`` as the classic exporter writes GELU below opset 20 (its
    scaling a ``Div`` or a ``Mul``, operands in either order); ``shared``: the ``erf + 1`` is an output
    too, so that the ops are differentiated one by one."""
    n = helper.make_node
    c = np.array(np.sqrt(2.0) if scale_op == "Div" else 1 / np.sqrt(2.0), np.float32)
    pair = (lambda a, b: [a, b]) if order == 0 else (lambda a, b: [b, a])
    nodes = [
        n(scale_op, ["x", "c"], ["u"]),
        n("Erf", ["u"], ["e"]),
        n("Add", pair("e", "one"), ["a"]),
        n("Mul", pair("x", "a"), ["m"]),
        n("Mul", pair("m", "half"), ["y"]),
    ]
    outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, [3, 5]) for o in (["y", "a"] if shared else ["y"])]
    graph = helper.make_graph(
        nodes,
        "gelu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])],
        outputs,
        initializer=[
            numpy_helper.from_array(c, "c"),
            numpy_helper.from_array(np.array(1.0, np.float32), "one"),
            numpy_helper.from_array(np.array(0.5, np.float32), "half"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("order", [0, 1])
@pytest.mark.parametrize("scale_op", ["Div", "Mul"])
@pytest.mark.parametrize("shared", [False, True])
def test_an_erf_gelu_is_differentiated_as_one_activation(order, scale_op, shared):
    """The GELU's gradient is its local derivative h (a + x k 2/sqrt(pi) exp(-u^2)) from the forward's
    own u = x k and a = erf(u) + 1: the constant and six passes over x's shape, not the nine of the
    five ops' rules (dy*h, dy*a, dy*x, u*u, the exponent, exp, its product, /c, the sum); where an
    inner tensor is read elsewhere, the ops' own rules. Both agree with finite differences."""
    m = _erf_gelu(order, scale_op, shared)
    x = np.random.default_rng(order).uniform(-3, 3, (3, 5)).astype(np.float32)
    outputs = [o.name for o in m.graph.output]
    assert vjp_error(m, {"x": x}, ["x"], outputs=outputs, eps=3e-3) < F32_TOL
    backward = vjp_model(m, outputs=outputs, wrt=["x"]).graph.node[len(m.graph.node) :]
    passes = [b for b in backward if b.op_type not in ("Identity", "Constant")]
    assert (len(passes) > 7) if shared else (len(passes) == 7), [b.op_type for b in passes]
