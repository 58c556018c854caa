"""One gradient rule per ONNX op, each written in standard ONNX ops, and the op-coverage table.

A rule takes the emitter, the forward node, the gradients flowing into the node's outputs (None
where none flows) and which inputs want a gradient, and returns one gradient tensor (or None) per
input. Rules use the forward node's own outputs where that saves work (``Sigmoid``: dy*y*(1-y)).

Ops that a training plan rewrites before differentiating (``BatchNormalization`` with batch
statistics, ``LayerNormalization``, active ``Dropout``, ``MaxPool`` with indices) are described in
:mod:`.forward`; their rules here see the rewritten form.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto

from .autodiff import Emitter, UnsupportedOpError, attr

Rule = Callable[[Emitter, onnx.NodeProto, list[str | None], list[bool]], list[str | None]]
RULES: dict[str, Rule] = {}
_NOTES: dict[str, str] = {}

# Ops whose outputs carry no gradient (integer, boolean or piecewise-constant results): allowed
# anywhere in a model, a gradient stops there.
NO_GRADIENT = frozenset({
    "Shape", "Size", "Constant", "ConstantOfShape", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual",
    "Not", "And", "Or", "Xor", "ArgMax", "ArgMin", "Range", "NonZero", "Sign", "Floor", "Ceil", "Round",
    "IsNaN", "IsInf", "OneHot",
})


def rule(*ops: str, note: str = "") -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
            _NOTES[op] = note
        return fn

    return register


def _dy(dys: list[str | None], e: Emitter, node: onnx.NodeProto, i: int = 0) -> str:
    dy = dys[i]
    if dy is None:  # another output carries the gradient; this one contributes zero
        dy = e.zeros_like(node.output[i])
    return dy


def _where(e: Emitter, cond: str, a: str, b: str) -> str:
    return e.op("Where", [cond, a, b])


def _masked(e: Emitter, cond: str, value: str) -> str:
    """``value`` where ``cond`` holds, zero elsewhere: ``value`` times the condition as a number.
    onnxruntime's Where with a scalar branch broadcasts element by element: 3-25x slower than the
    Cast and Mul on MobileNetV2's ReLU6 gradients (1.3 ms against 0.05 for [32, 960, 1, 1])."""
    return e.op("Mul", [value, e.op("Cast", [cond], to=e.elem_type(value))])


# ---------------------------------------------------------------------------- elementwise


@rule("Identity", note="dy")
def _identity(e, node, dys, wants):
    return [_dy(dys, e, node)]


@rule("Add", note="dy, summed over broadcast axes")
def _add(e, node, dys, wants):
    dy, (a, b), y = _dy(dys, e, node), node.input, node.output[0]
    return [e.unbroadcast(dy, y, a) if wants[0] else None, e.unbroadcast(dy, y, b) if wants[1] else None]


@rule("Sub", note="dy, -dy, summed over broadcast axes (then negated)")
def _sub(e, node, dys, wants):
    dy, (a, b), y = _dy(dys, e, node), node.input, node.output[0]
    return [e.unbroadcast(dy, y, a) if wants[0] else None,
            e.op("Neg", [e.unbroadcast(dy, y, b)]) if wants[1] else None]


@rule("Mul", note="dy*b, dy*a, summed over broadcast axes; x*x: dy*2x")
def _mul(e, node, dys, wants):
    dy, (a, b), y = _dy(dys, e, node), node.input, node.output[0]
    if a == b:  # a square: one product instead of two and their sum
        if dy in e.broadcasts and e.shape(a) == e.shape(y):  # a mean's gradient: scale it before it meets a
            return [e.op("Mul", [a, e.op("Mul", [e.broadcasts[dy], e.scalar(2.0, a)])]) if wants[0] else None, None]
        return [e.unbroadcast(e.op("Mul", [dy, e.op("Mul", [a, e.scalar(2.0, a)])]), y, a) if wants[0] else None, None]
    return [e.unbroadcast(e.op("Mul", [dy, b]), y, a) if wants[0] else None,
            e.unbroadcast(e.op("Mul", [dy, a]), y, b) if wants[1] else None]


@rule("Div", note="dy/b, -dy*y/b (a broadcast b: the sum of dy*y, then /b)")
def _div(e, node, dys, wants):
    dy, (a, b), y = _dy(dys, e, node), node.input, node.output[0]
    da = e.unbroadcast(e.op("Div", [dy, b]), y, a) if wants[0] else None
    db = None
    if wants[1]:
        # b is constant along the axes it is summed over: divide (and negate) after the sum, one
        # pass over dy*y instead of three (LayerNormalization's divisor, a softmax's sum)
        db = e.op("Neg", [e.op("Div", [e.unbroadcast(e.op("Mul", [dy, y]), y, b), b])])
    return [da, db]


@rule("Pow", note="dy*p*x^(p-1); exponent: dy*y*log(x)")
def _pow(e, node, dys, wants):
    dy, (x, p), y = _dy(dys, e, node), node.input, node.output[0]
    dx = dp = None
    if wants[0]:
        pv = e.value(p)
        if pv is not None and pv.size == 1:
            p1 = float(pv.reshape(()))
            if p1 == 2.0:
                local = e.op("Mul", [x, e.scalar(2.0, x)])
            else:
                local = e.op("Mul", [e.op("Pow", [x, e.scalar(p1 - 1.0, x)]), e.scalar(p1, x)])
        else:
            pc = e.op("Cast", [p], to=e.elem_type(x))
            local = e.op("Mul", [e.op("Pow", [x, e.op("Sub", [pc, e.scalar(1.0, x)])]), pc])
        dx = e.unbroadcast(e.op("Mul", [dy, local]), y, x)
    if wants[1]:
        dp = e.unbroadcast(e.op("Mul", [dy, e.op("Mul", [y, e.op("Log", [x])])]), y, p)
    return [dx, dp]


@rule("Neg", note="-dy")
def _neg(e, node, dys, wants):
    return [e.op("Neg", [_dy(dys, e, node)])]


@rule("Relu", note="dy where x > 0")
def _relu(e, node, dys, wants):
    x = node.input[0]
    return [_masked(e, e.op("Greater", [x, e.scalar(0.0, x)]), _dy(dys, e, node))]


@rule("LeakyRelu", note="dy where x > 0, alpha*dy elsewhere")
def _leaky(e, node, dys, wants):
    x, dy = node.input[0], _dy(dys, e, node)
    alpha = float(attr(node, "alpha", 0.01))
    return [_where(e, e.op("Greater", [x, e.scalar(0.0, x)]), dy, e.op("Mul", [dy, e.scalar(alpha, x)]))]


@rule("Sigmoid", note="dy*y*(1-y)")
def _sigmoid(e, node, dys, wants):
    y = node.output[0]
    return [e.op("Mul", [_dy(dys, e, node), e.op("Mul", [y, e.op("Sub", [e.scalar(1.0, y), y])])])]


@rule("Tanh", note="dy*(1-y^2)")
def _tanh(e, node, dys, wants):
    y = node.output[0]
    return [e.op("Mul", [_dy(dys, e, node), e.op("Sub", [e.scalar(1.0, y), e.op("Mul", [y, y])])])]


@rule("Exp", note="dy*y")
def _exp(e, node, dys, wants):
    return [e.op("Mul", [_dy(dys, e, node), node.output[0]])]


@rule("Log", note="dy/x")
def _log(e, node, dys, wants):
    return [e.op("Div", [_dy(dys, e, node), node.input[0]])]


@rule("Sqrt", note="dy/(2y)")
def _sqrt(e, node, dys, wants):
    y = node.output[0]
    return [e.op("Div", [e.op("Mul", [_dy(dys, e, node), e.scalar(0.5, y)]), y])]


@rule("Reciprocal", note="-dy*y^2")
def _reciprocal(e, node, dys, wants):
    y = node.output[0]
    return [e.op("Neg", [e.op("Mul", [_dy(dys, e, node), e.op("Mul", [y, y])])])]


@rule("Abs", note="dy*sign(x)")
def _abs(e, node, dys, wants):
    return [e.op("Mul", [_dy(dys, e, node), e.op("Sign", [node.input[0]])])]


@rule("Erf", note="dy*2/sqrt(pi)*exp(-x^2)")
def _erf(e, node, dys, wants):
    x = node.input[0]
    # exp(log(2/sqrt(pi)) - x^2): the constant inside the exponential, one pass less than its product
    local = e.op("Exp", [e.op("Sub", [e.scalar(math.log(2.0 / math.sqrt(math.pi)), x), e.op("Mul", [x, x])])])
    return [e.op("Mul", [_dy(dys, e, node), local])]


@rule("Softplus", note="dy*sigmoid(x)")
def _softplus(e, node, dys, wants):
    return [e.op("Mul", [_dy(dys, e, node), e.op("Sigmoid", [node.input[0]])])]


@rule("Clip", note="dy where min <= x <= max (where the output equals the input)")
def _clip(e, node, dys, wants):
    x, y, dy = node.input[0], node.output[0], _dy(dys, e, node)
    if not any(len(node.input) > i and node.input[i] for i in (1, 2)):
        return [dy]
    # x inside [min, max] exactly where Clip returned it unchanged: one comparison instead of two
    # and their And (a tenth of ReLU6-heavy MobileNetV2's step went to the four passes)
    return [_masked(e, e.op("Equal", [x, y]), dy)] + [None] * (len(node.input) - 1)


@rule("Max", "Min", note="dy to the input that was chosen (the first on ties)")
def _max_min(e, node, dys, wants):
    dy, y = _dy(dys, e, node), node.output[0]
    if len(node.input) == 1:
        return [dy]
    if len(node.input) != 2:
        raise UnsupportedOpError(node.op_type, node.name, "is differentiated with one or two inputs only")
    a, b = node.input
    chose_a = e.op("Equal", [a, y])
    return [e.unbroadcast(_masked(e, chose_a, dy), y, a) if wants[0] else None,
            e.unbroadcast(_masked(e, e.op("Not", [chose_a]), dy), y, b) if wants[1] else None]


@rule("Sum", note="dy to every input")
def _sum(e, node, dys, wants):
    dy, y = _dy(dys, e, node), node.output[0]
    return [e.unbroadcast(dy, y, x) if want else None for x, want in zip(node.input, wants)]


@rule("Where", note="dy where the condition holds to x, elsewhere to y")
def _where_rule(e, node, dys, wants):
    dy, (c, a, b), y = _dy(dys, e, node), node.input, node.output[0]
    return [None,
            e.unbroadcast(_masked(e, c, dy), y, a) if wants[1] else None,
            e.unbroadcast(_masked(e, e.op("Not", [c]), dy), y, b) if wants[2] else None]


@rule("Expand", note="dy summed over the expanded axes")
def _expand(e, node, dys, wants):
    return [e.unbroadcast(_dy(dys, e, node), node.output[0], node.input[0]), None]


@rule("Cast", note="dy cast back (float to float only; to its own type: dy)")
def _cast(e, node, dys, wants):
    x = node.input[0]
    floats = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)
    if e.elem_type(x) not in floats or int(attr(node, "to")) not in floats:
        return [None]
    if int(attr(node, "to")) == e.elem_type(x):  # a cast to its own type (transformers' softmax .to(dtype))
        return [_dy(dys, e, node)]
    return [e.op("Cast", [_dy(dys, e, node)], to=e.elem_type(x))]


@rule("CastLike", note="dy cast back (float to float only; the target-type input takes none)")
def _cast_like(e, node, dys, wants):
    x = node.input[0]
    floats = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)
    if not wants[0] or e.elem_type(x) not in floats or e.elem_type(node.input[1]) not in floats:
        return [None, None]
    return [e.op("CastLike", [_dy(dys, e, node), x]), None]


@rule("HardSigmoid", note="dy*alpha where 0 < alpha*x+beta < 1")
def _hard_sigmoid(e, node, dys, wants):
    x, dy = node.input[0], _dy(dys, e, node)
    alpha, beta = float(attr(node, "alpha", 0.2)), float(attr(node, "beta", 0.5))
    inner = e.op("Add", [e.op("Mul", [x, e.scalar(alpha, x)]), e.scalar(beta, x)])
    inside = e.op("And", [e.op("Greater", [inner, e.scalar(0.0, x)]), e.op("Less", [inner, e.scalar(1.0, x)])])
    return [_masked(e, inside, e.op("Mul", [dy, e.scalar(alpha, x)]))]


@rule("HardSwish", note="0 for x < -3, dy*(x/3+1/2) for -3 <= x <= 3, dy for x > 3")
def _hard_swish(e, node, dys, wants):
    x, dy = node.input[0], _dy(dys, e, node)
    ramp = e.op("Add", [e.op("Mul", [x, e.scalar(1.0 / 3.0, x)]), e.scalar(0.5, x)])
    local = _where(e, e.op("Less", [x, e.scalar(-3.0, x)]), e.scalar(0.0, x),
                   _where(e, e.op("Greater", [x, e.scalar(3.0, x)]), e.scalar(1.0, x), ramp))
    return [e.op("Mul", [dy, local])]


@rule("Dropout", note="dy*mask/(1-ratio) when training, dy at inference")
def _dropout(e, node, dys, wants):
    dy = _dy(dys, e, node)
    training = len(node.input) > 2 and node.input[2] and e.value(node.input[2]) is not None and bool(e.value(node.input[2]))
    if not training:
        return [dy, None, None][: len(node.input)]
    if len(node.output) < 2 or not node.output[1]:
        raise UnsupportedOpError(node.op_type, node.name, "in training mode needs its mask output")
    ratio = 0.5
    if len(node.input) > 1 and node.input[1]:
        rv = e.value(node.input[1])
        if rv is None:
            raise UnsupportedOpError(node.op_type, node.name, "needs a constant ratio")
        ratio = float(rv)
    mask = e.op("Cast", [node.output[1]], to=e.elem_type(node.output[0]))
    scaled = e.op("Mul", [mask, e.scalar(1.0 / (1.0 - ratio), node.output[0])])
    return [e.op("Mul", [dy, scaled]), None, None][: len(node.input)]


# ---------------------------------------------------------------------------- matrices


@rule("MatMul", note="dy@b^T, a^T@dy (batched, broadcast)")
def _matmul(e, node, dys, wants):
    dy, (a, b), y = _dy(dys, e, node), node.input, node.output[0]
    ra, rb = e.rank(a), e.rank(b)
    if ra is None or rb is None:
        raise UnsupportedOpError(node.op_type, node.name, "needs inputs of known rank")
    if ra == 1 or rb == 1:
        return _matmul_vector(e, node, dy, wants, ra, rb)
    da = db = None
    if wants[0]:
        bt = e.op("Transpose", [b], perm=[*range(rb - 2), rb - 1, rb - 2])
        da = e.unbroadcast(e.op("MatMul", [dy, bt]), y, a)
    if wants[1]:
        if rb == 2:  # a weight: the batch dimensions folded into the rows, one Gemm
            db = _weight_product(e, a if ra == 2 else _rows(e, a), dy if ra == 2 else _rows(e, dy))
        else:
            at = e.op("Transpose", [a], perm=[*range(ra - 2), ra - 1, ra - 2])
            db = e.unbroadcast(e.op("MatMul", [at, dy]), y, b)
    return [da, db]


def _weight_product(e: Emitter, left: str, right: str) -> str:
    """left^T right, remembered as such: the uses of one weight then sum as one Gemm (see
    :func:`.autodiff.backward`)."""
    out = e.op("Gemm", [left, right], transA=1)
    e.products[out] = (left, right)
    return out


def _rows(e: Emitter, t: str) -> str:
    """``t`` reshaped to a matrix [-1, last dimension]."""
    shape = e.shape(t)
    last = shape[-1] if shape else None
    if isinstance(last, int):
        return e.op("Reshape", [t, e.ints([-1, last])])
    tail = e.op("Slice", [e.op("Shape", [t]), e.ints([-1]), e.ints([len(shape)])])
    return e.op("Reshape", [t, e.op("Concat", [e.ints([-1]), tail], axis=0)])


def _matmul_vector(e, node, dy, wants, ra, rb):
    a, b = node.input
    a2 = e.unsqueeze(a, [0]) if ra == 1 else a
    b2 = e.unsqueeze(b, [1]) if rb == 1 else b
    dy2 = dy
    if rb == 1:
        dy2 = e.unsqueeze(dy2, [-1])
    if ra == 1:
        dy2 = e.unsqueeze(dy2, [-2])
    r2a, r2b = max(ra, 2), max(rb, 2)
    da = db = None
    if wants[0]:
        bt = e.op("Transpose", [b2], perm=[*range(r2b - 2), r2b - 1, r2b - 2])
        full = e.op("MatMul", [dy2, bt])
        da = e.reshape_like(e._unbroadcast_dynamic(full, a2), a)
    if wants[1]:
        at = e.op("Transpose", [a2], perm=[*range(r2a - 2), r2a - 1, r2a - 2])
        full = e.op("MatMul", [at, dy2])
        db = e.reshape_like(e._unbroadcast_dynamic(full, b2), b)
    return [da, db]


@rule("Gemm", note="alpha*dy@B'^T, alpha*A'^T@dy, beta*dy summed to C")
def _gemm(e, node, dys, wants):
    dy = _dy(dys, e, node)
    a, b = node.input[0], node.input[1]
    alpha, beta = float(attr(node, "alpha", 1.0)), float(attr(node, "beta", 1.0))
    ta, tb = int(attr(node, "transA", 0)), int(attr(node, "transB", 0))
    out: list[str | None] = [None] * len(node.input)
    if wants[0]:
        if ta == 0:
            out[0] = e.op("Gemm", [dy, b], alpha=alpha, transB=1 - tb)
        else:
            out[0] = e.op("Gemm", [b, dy], alpha=alpha, transA=tb, transB=1)
    if wants[1]:
        if alpha == 1.0 and ta == 0:
            out[1] = _weight_product(e, a, dy) if tb == 0 else _weight_product(e, dy, a)
        elif tb == 0:
            out[1] = e.op("Gemm", [a, dy], alpha=alpha, transA=1 - ta)
        else:
            out[1] = e.op("Gemm", [dy, a], alpha=alpha, transA=1, transB=ta)
    if len(node.input) > 2 and node.input[2] and wants[2]:
        dc = dy if beta == 1.0 else e.op("Mul", [dy, e.scalar(beta, node.output[0])])
        out[2] = e.unbroadcast(dc, node.output[0], node.input[2])
    return out


# ---------------------------------------------------------------------------- softmax family


def _axis(e: Emitter, node: onnx.NodeProto, default: int) -> int:
    axis = int(attr(node, "axis", default))
    rank = e.rank(node.input[0])
    if e.opset < 13:
        raise UnsupportedOpError(node.op_type, node.name, "is differentiated at opset 13 or later only")
    return axis if axis >= 0 or rank is None else axis + rank


@rule("Softmax", note="y*(dy - sum(dy*y))")
def _softmax(e, node, dys, wants):
    dy, y = _dy(dys, e, node), node.output[0]
    axis = _axis(e, node, -1)
    s = e.reduce("ReduceSum", e.op("Mul", [dy, y]), [axis], keepdims=True)
    return [e.op("Mul", [y, e.op("Sub", [dy, s])])]


@rule("LogSoftmax", note="dy - exp(y)*sum(dy)")
def _log_softmax(e, node, dys, wants):
    dy, y = _dy(dys, e, node), node.output[0]
    axis = _axis(e, node, -1)
    s = e.reduce("ReduceSum", dy, [axis], keepdims=True)
    return [e.op("Sub", [dy, e.op("Mul", [e.op("Exp", [y]), s])])]


# ---------------------------------------------------------------------------- reductions


def _reduce_axes(e: Emitter, node: onnx.NodeProto) -> list[int] | None:
    """The node's reduced axes, normalized; None for all axes."""
    axes = attr(node, "axes")
    if len(node.input) > 1 and node.input[1]:
        value = e.value(node.input[1])
        if value is None:
            raise UnsupportedOpError(node.op_type, node.name, "needs constant axes")
        axes = [int(v) for v in value.reshape(-1)]
    rank = e.rank(node.input[0])
    if not axes:
        if int(attr(node, "noop_with_empty_axes", 0)):
            return []
        return None
    if rank is None:
        if any(a < 0 for a in axes):
            raise UnsupportedOpError(node.op_type, node.name, "needs an input of known rank for negative axes")
        return sorted(axes)
    return sorted(a + rank if a < 0 else a for a in axes)


def _keep(e: Emitter, node: onnx.NodeProto, t: str, axes: list[int] | None) -> str:
    """``t`` (a reduced tensor) with the reduced axes kept as 1s, so that it broadcasts on x."""
    if int(attr(node, "keepdims", 1)) or axes is None or not axes:
        if axes is None and not int(attr(node, "keepdims", 1)):
            rank = e.rank(node.input[0])
            if rank is None:
                return t  # a scalar broadcasts everywhere
            return e.op("Reshape", [t, e.ints([1] * rank)])
        return t
    return e.unsqueeze(t, axes)


def _count(e: Emitter, x: str, y: str, axes: list[int] | None) -> str:
    shape = e.shape(x)
    if shape is not None:
        dims = [shape[a] for a in (axes if axes is not None else range(len(shape)))]
        if all(isinstance(d, int) for d in dims):
            return e.scalar(float(np.prod(dims)), x)
    elem = e.elem_type(x)
    return e.op("Div", [e.op("Cast", [e.op("Size", [x])], to=elem), e.op("Cast", [e.op("Size", [y])], to=elem)])


@rule("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceSumSquare", "ReduceL2", "ReduceLogSumExp",
      note="dy broadcast back (mean: /count; max/min: to the arg-extrema, shared on ties; sum of squares: 2x*dy)")
def _reduce(e, node, dys, wants):
    x, y, dy = node.input[0], node.output[0], _dy(dys, e, node)
    axes = _reduce_axes(e, node)
    grads: list[str | None] = [None] * len(node.input)
    if axes == []:
        grads[0] = dy
        return grads
    dyk = _keep(e, node, dy, axes)
    yk = _keep(e, node, y, axes)
    op = node.op_type
    if op == "ReduceSum":
        local = dyk
    elif op == "ReduceMean":
        local = e.op("Div", [dyk, _count(e, x, y, axes)])
    elif op in ("ReduceMax", "ReduceMin"):
        mask = e.op("Cast", [e.op("Equal", [x, yk])], to=e.elem_type(x))
        ties = e.reduce("ReduceSum", mask, axes, keepdims=True)
        local = e.op("Mul", [mask, e.op("Div", [dyk, ties])])
    elif op == "ReduceSumSquare":  # the reduced factor first: one pass over x
        local = e.op("Mul", [x, e.op("Mul", [dyk, e.scalar(2.0, x)])])
    elif op == "ReduceL2":
        local = e.op("Mul", [x, e.op("Div", [dyk, yk])])
    else:  # ReduceLogSumExp
        local = e.op("Mul", [dyk, e.op("Exp", [e.op("Sub", [x, yk])])])
    if op in ("ReduceSum", "ReduceMean"):  # the others' local gradient already has x's shape
        grads[0] = e.broadcast_to(local, x)
    else:
        grads[0] = local
    return grads


# ---------------------------------------------------------------------------- shapes


@rule("Reshape", "Flatten", "Squeeze", "Unsqueeze", note="dy reshaped to x (Squeeze/Unsqueeze: the inverse op on the same axes)")
def _reshape(e, node, dys, wants):
    dy = _dy(dys, e, node)
    axes = _squeezed_axes(e, node) if node.op_type in ("Squeeze", "Unsqueeze") else None
    if axes is not None:  # no Shape to read at run time for a dynamic batch
        back = e.op("Unsqueeze" if node.op_type == "Squeeze" else "Squeeze", [dy, e.ints(axes)])
        return [back] + [None] * (len(node.input) - 1)
    return [e.reshape_like(dy, node.input[0])] + [None] * (len(node.input) - 1)


def _squeezed_axes(e: Emitter, node: onnx.NodeProto) -> list[int] | None:
    """The axes a Squeeze removes (of its input) or an Unsqueeze inserts (of its output), normalized;
    None when not known (no constant axes, an unknown rank) or below opset 13 (axes an attribute)."""
    if e.opset < 13:
        return None
    rank = e.rank(node.input[0] if node.op_type == "Squeeze" else node.output[0])
    if len(node.input) < 2 or not node.input[1]:
        shape = e.shape(node.input[0])
        if node.op_type != "Squeeze" or shape is None or not all(isinstance(d, int) for d in shape):
            return None
        return [a for a, d in enumerate(shape) if d == 1]
    value = e.value(node.input[1])
    if value is None or rank is None:
        return None
    return sorted(int(a) + rank if int(a) < 0 else int(a) for a in value.reshape(-1))


@rule("Transpose", note="dy transposed back")
def _transpose(e, node, dys, wants):
    perm = attr(node, "perm")
    if perm is None:
        rank = e.rank(node.input[0])
        if rank is None:
            raise UnsupportedOpError(node.op_type, node.name, "needs perm or an input of known rank")
        perm = list(reversed(range(rank)))
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return [e.op("Transpose", [_dy(dys, e, node)], perm=inverse)]


@rule("Concat", note="dy split back")
def _concat(e, node, dys, wants):
    dy = _dy(dys, e, node)
    axis = int(attr(node, "axis"))
    rank = e.rank(node.output[0])
    if axis < 0:
        if rank is None:
            raise UnsupportedOpError(node.op_type, node.name, "needs an output of known rank for a negative axis")
        axis += rank
    sizes = []
    for x in node.input:
        shape = e.shape(x)
        sizes.append(shape[axis] if shape is not None and isinstance(shape[axis], int) else None)
    if all(s is not None for s in sizes):
        split = e.ints(sizes)
    else:
        split = e.op("Concat", [e.op("Slice", [e.op("Shape", [x]), e.ints([axis]), e.ints([axis + 1])]) for x in node.input], axis=0)
    outs = e.op_multi("Split", [dy, split], [e.fresh("split") for _ in node.input], axis=axis)
    return list(outs)


@rule("Split", note="dys concatenated (zeros for outputs without a gradient)")
def _split(e, node, dys, wants):
    axis = int(attr(node, "axis", 0))
    parts = [dys[i] if dys[i] is not None else e.zeros_like(o) for i, o in enumerate(node.output)]
    return [e.op("Concat", parts, axis=axis)] + [None] * (len(node.input) - 1)


@rule("Slice", note="dy padded back with zeros (steps of 1, static sliced dims)")
def _slice(e, node, dys, wants):
    x, dy = node.input[0], _dy(dys, e, node)
    shape = e.shape(x)
    values = [e.value(i) if i else None for i in node.input[1:]]
    if shape is None or any(v is None for v, name in zip(values, node.input[1:]) if name):
        raise UnsupportedOpError(node.op_type, node.name, "needs constant starts/ends/axes/steps and an input of known rank")
    starts, ends = [int(v) for v in values[0].reshape(-1)], [int(v) for v in values[1].reshape(-1)]
    axes = [int(v) for v in values[2].reshape(-1)] if len(values) > 2 and values[2] is not None else list(range(len(starts)))
    steps = [int(v) for v in values[3].reshape(-1)] if len(values) > 3 and values[3] is not None else [1] * len(starts)
    rank = len(shape)
    pads = [0] * (2 * rank)
    for s, t, a, step in zip(starts, ends, axes, steps):
        a = a + rank if a < 0 else a
        dim = shape[a]
        if step != 1 or not isinstance(dim, int):
            raise UnsupportedOpError(node.op_type, node.name, "is differentiated with steps of 1 on axes of static size only")
        s = min(max(s + dim if s < 0 else s, 0), dim)
        t = min(max(t + dim if t < 0 else t, 0), dim)
        pads[a], pads[rank + a] = s, dim - max(t, s)
    return [e.op("Pad", [dy, e.ints(pads)])] + [None] * (len(node.input) - 1)


@rule("Pad", note="dy sliced back (constant mode, pads of zero or more)")
def _pad(e, node, dys, wants):
    x, dy = node.input[0], _dy(dys, e, node)
    mode = attr(node, "mode", b"constant")
    rank = e.rank(x)
    if (mode.decode() if isinstance(mode, bytes) else mode) != "constant" or rank is None:
        raise UnsupportedOpError(node.op_type, node.name, "is differentiated in constant mode with an input of known rank only")
    if e.opset < 11:
        pads = [int(p) for p in attr(node, "pads")]
    else:
        value = e.value(node.input[1])
        if value is None or (len(node.input) > 3 and node.input[3] and e.value(node.input[3]) is None):
            raise UnsupportedOpError(node.op_type, node.name, "needs constant pads and axes")
        pads = [int(p) for p in value.reshape(-1)]
    axes = list(range(rank))
    if len(node.input) > 3 and node.input[3]:
        axes = [int(a) + rank if int(a) < 0 else int(a) for a in e.value(node.input[3]).reshape(-1)]
    if any(p < 0 for p in pads) or (len(node.input) > 2 and node.input[2] and len(wants) > 2 and wants[2]):
        raise UnsupportedOpError(node.op_type, node.name, "is differentiated with pads >= 0 and a constant padding value only")
    begins = dict(zip(axes, pads[: len(axes)]))
    moved = [a for a in axes if pads[axes.index(a)] or pads[len(axes) + axes.index(a)]]
    if not moved:
        return [dy] + [None] * (len(node.input) - 1)
    shape = e.shape(x)
    if not all(isinstance(shape[a], int) for a in moved):
        raise UnsupportedOpError(node.op_type, node.name, "needs static sizes of the padded axes")
    starts = [begins[a] for a in moved]
    ends = [begins[a] + int(shape[a]) for a in moved]
    return [e.op("Slice", [dy, e.ints(starts), e.ints(ends), e.ints(moved)])] + [None] * (len(node.input) - 1)


@rule("Gather", note="dy scattered-added into zeros of x's shape (any axis: moved to the front and back)")
def _gather(e, node, dys, wants):
    data, idx = node.input
    dy = _dy(dys, e, node)
    shape, ishape = e.shape(data), e.shape(idx)
    if shape is None or ishape is None:
        raise UnsupportedOpError(node.op_type, node.name, "needs data and indices of known rank")
    rank, irank = len(shape), len(ishape)
    axis = int(attr(node, "axis", 0))
    axis = axis + rank if axis < 0 else axis
    if not isinstance(shape[axis], int):
        raise UnsupportedOpError(node.op_type, node.name, "needs a static size of the gathered axis")
    if axis:  # dy is data[:axis] + idx + data[axis+1:]: bring the index dimensions to the front
        front = [*range(axis, axis + irank), *range(axis), *range(axis + irank, rank + irank - 1)]
        dy = e.op("Transpose", [dy], perm=front)
        moved = e.op("Transpose", [data], perm=[axis, *range(axis), *range(axis + 1, rank)])
        e.record(moved, e.elem_type(data), (shape[axis], *shape[:axis], *shape[axis + 1:]))
        grad = _gather_rows(e, moved, idx, dy, int(shape[axis]))
        back = [*range(1, axis + 1), 0, *range(axis + 1, rank)]
        return [e.op("Transpose", [grad], perm=back), None]
    return [_gather_rows(e, data, idx, dy, int(shape[0])), None]


def _gather_rows(e: Emitter, data: str, idx: str, dy: str, rows: int) -> str:
    """The gradient of Gather(data, idx, axis=0): the rows of dy added into zeros at idx."""
    i64 = e.op("Cast", [idx], to=TensorProto.INT64)
    zero = e.const(np.array(0, dtype=np.int64), "zero")
    fixed = _where(e, e.op("Less", [i64, zero]), e.op("Add", [i64, e.const(np.array(rows, dtype=np.int64), "rows")]), i64)
    if e.opset >= 16:
        return e.op("ScatterND", [e.zeros_like(data), e.unsqueeze(fixed, [-1]), dy], reduction="add")
    # one-hot product: rows of dy summed per index
    flat = e.op("Reshape", [fixed, e.ints([-1, 1])])
    onehot = e.op("Cast", [e.op("Equal", [flat, e.ints(list(range(rows)))])], to=e.elem_type(data))
    rest = e.op("Slice", [e.shape_of(data), e.ints([1]), e.ints([len(e.shape(data))])])
    dy2 = e.op("Reshape", [dy, e.op("Concat", [e.ints([-1]), e.op("ReduceProd", [rest], keepdims=1)], axis=0)])
    return e.reshape_like(e.op("Gemm", [onehot, dy2], transA=1), data)


# ---------------------------------------------------------------------------- convolution and pooling


def conv_geometry(e: Emitter, node: onnx.NodeProto, x: str, kernel: Sequence[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """(strides, pads [begin..., end...], dilations, input spatial dims) with auto_pad resolved."""
    shape = e.shape(x)
    nd = len(kernel)
    if shape is None or not all(isinstance(d, int) for d in shape[2:]):
        raise UnsupportedOpError(node.op_type, node.name, "needs static spatial dimensions to differentiate")
    dims = [int(d) for d in shape[2:]]
    strides = list(attr(node, "strides", [1] * nd))
    dil = list(attr(node, "dilations", [1] * nd))
    pads = list(attr(node, "pads", [0] * (2 * nd)))
    auto = attr(node, "auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        pads = [0] * (2 * nd)
        for i in range(nd):
            out = -(-dims[i] // strides[i])
            total = max((out - 1) * strides[i] + (kernel[i] - 1) * dil[i] + 1 - dims[i], 0)
            small, big = total // 2, total - total // 2
            pads[i], pads[nd + i] = (small, big) if auto == "SAME_UPPER" else (big, small)
    elif auto == "VALID":
        pads = [0] * (2 * nd)
    return strides, pads, dil, dims


def _output_padding(node, dims, out_dims, kernel, strides, pads, dil) -> list[int]:
    nd = len(dims)
    extra = []
    for i in range(nd):
        covered = strides[i] * (out_dims[i] - 1) + (kernel[i] - 1) * dil[i] + 1 - pads[i] - pads[nd + i]
        gap = dims[i] - covered
        if gap < 0 or gap >= max(strides[i], dil[i]):
            raise UnsupportedOpError(node.op_type, node.name, "has a window layout (ceil_mode?) whose gradient is not covered")
        extra.append(gap)
    return extra


@rule("Conv", note="dx: ConvTranspose of dy (grouped as the Conv); dw: Conv of x and dy with batch and channels swapped "
                   "(per group), or per kernel offset a Gemm (dense) or a product summed over positions (depthwise); db: sum")
def _conv(e, node, dys, wants):
    x, w = node.input[0], node.input[1]
    y, dy = node.output[0], _dy(dys, e, node)
    wshape = e.shape(w)
    if wshape is None or not all(isinstance(d, int) for d in wshape):
        raise UnsupportedOpError(node.op_type, node.name, "needs a weight of static shape")
    kernel = [int(d) for d in wshape[2:]]
    nd = len(kernel)
    group = int(attr(node, "group", 1))
    strides, pads, dil, dims = conv_geometry(e, node, x, kernel)
    yshape = e.shape(y)
    out_dims = [int(d) for d in yshape[2:]] if yshape is not None and all(isinstance(d, int) for d in yshape[2:]) else None
    if out_dims is None:
        raise UnsupportedOpError(node.op_type, node.name, "needs an output of static spatial size")
    c_out, c_in_group = int(wshape[0]), int(wshape[1])
    grads: list[str | None] = [None] * len(node.input)
    if wants[0]:
        grads[0] = e.op("ConvTranspose", [dy, w], strides=strides, pads=pads, dilations=dil, group=group,
                        output_padding=_output_padding(node, dims, out_dims, kernel, strides, pads, dil))
    if wants[1] and group == 1 and nd == 2 and c_in_group >= 8 and len(e.shape(x) or ()) == 4:
        grads[1] = _conv_weight_grad_per_offset(e, x, dy, kernel, strides, pads, dil, out_dims, c_out, c_in_group)
    elif wants[1] and group > 1 and c_in_group == 1:
        grads[1] = _depthwise_weight_grad(e, x, dy, kernel, strides, pads, dil, dims, out_dims, group, c_out)
    elif wants[1]:
        grads[1] = _swapped_weight_grad(e, x, dy, kernel, strides, pads, dil, dims, group, c_out, c_in_group)
    if len(node.input) > 2 and node.input[2] and wants[2]:
        grads[2] = e.reduce("ReduceSum", dy, [0, *range(2, 2 + nd)], keepdims=False)
    return grads


def tiling_pool(e: Emitter, node: onnx.NodeProto) -> tuple[int, int] | None:
    """(kh, kw) when a 2-D MaxPool's windows tile its input exactly (kernel == stride, no padding
    or dilation, sizes divisible), else None."""
    kernel = list(attr(node, "kernel_shape", []))
    shape = e.shape(node.input[0])
    if len(kernel) != 2 or shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape[1:]):
        return None
    if list(attr(node, "strides", [1, 1])) != kernel or any(attr(node, "pads", [0] * 4)) or \
            any(d != 1 for d in attr(node, "dilations", [1, 1])) or int(attr(node, "ceil_mode", 0)):
        return None
    auto = attr(node, "auto_pad", b"NOTSET")
    if (auto.decode() if isinstance(auto, bytes) else auto) not in ("NOTSET", "VALID"):
        return None
    if shape[2] % kernel[0] or shape[3] % kernel[1]:
        return None
    return kernel[0], kernel[1]


def _conv_weight_grad_per_offset(e: Emitter, x: str, dy: str, kernel, strides, pads, dil, out_dims, c_out: int, c_in: int) -> str:
    """dW[:, :, i, j] = dy @ (the input window at offset (i, j))^T, one Gemm per kernel offset over
    all examples and positions: [Cout, N*OH*OW] x [N*OH*OW, Cin]. With 8 or more input channels
    this beats the Conv with batch and channels swapped (0.34 against 0.54 ms of CPU for the second
    Conv of the 28x28 benchmark CNN); with one input channel the Gemms degenerate to
    matrix-vector products and the Conv wins (0.26 against 0.66 ms)."""
    xt = e.op("Transpose", [x], perm=[1, 0, 2, 3])  # [Cin, N, H, W]
    if any(pads):
        xt = e.op("Pad", [xt, e.ints([0, 0, pads[0], pads[1], 0, 0, pads[2], pads[3]])])
    rows = e.op("Reshape", [e.op("Transpose", [dy], perm=[1, 0, 2, 3]), e.ints([c_out, -1])])  # [Cout, N*OH*OW]
    columns = []
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            start = [i * dil[0], j * dil[1]]
            end = [start[0] + strides[0] * (out_dims[0] - 1) + 1, start[1] + strides[1] * (out_dims[1] - 1) + 1]
            window = e.op("Slice", [xt, e.ints(start), e.ints(end), e.ints([2, 3]), e.ints(strides)])
            product = e.op("Gemm", [rows, e.op("Reshape", [window, e.ints([c_in, -1])])], transB=1)  # [Cout, Cin]
            columns.append(e.unsqueeze(product, [2]))
    return e.op("Reshape", [e.op("Concat", columns, axis=2), e.ints([c_out, c_in, *kernel])])


def _swapped_weight_grad(e: Emitter, x: str, dy: str, kernel, strides, pads, dil, dims, group: int, c_out: int,
                         c_in_group: int) -> str:
    """dW as a Conv whose batch is the input channel within a group and whose channels are the
    examples: x as [Cin/g, g*N, spatial...] convolved, ``group`` groups, with dy as the kernel
    [Cout, N, out spatial...] (strides and dilations trade places) gives [Cin/g, Cout, k...]. Each
    group meets only its own outputs, so the work is that of the forward Conv; the all-pairs Conv
    of x and dy masked to the diagonal blocks took ``group`` times as long (ResNeXt's 32-group 3x3
    layers at batch 32: 4-10x slower, onnxruntime 1.32)."""
    nd = len(kernel)
    rows = e.op("Reshape", [x, e.ints([0, group, c_in_group, *dims])])
    rows = e.op("Transpose", [rows], perm=[2, 1, 0, *range(3, 3 + nd)])  # [Cin/g, g, N, spatial...]
    rows = e.op("Reshape", [rows, e.ints([c_in_group, -1, *dims])])
    kernels = e.op("Transpose", [dy], perm=[1, 0, *range(2, 2 + nd)])  # [Cout, N, out spatial...]
    full = e.op("Conv", [rows, kernels], strides=dil, dilations=strides, pads=pads, group=group)
    # the result can be larger than the kernel when the strides do not divide the input evenly
    trimmed = e.op("Slice", [full, e.ints([0] * nd), e.ints(kernel), e.ints(list(range(2, 2 + nd)))])
    return e.op("Transpose", [trimmed], perm=[1, 0, *range(2, 2 + nd)])


def _depthwise_weight_grad(e: Emitter, x: str, dy: str, kernel, strides, pads, dil, dims, out_dims, channels: int,
                           c_out: int) -> str:
    """dW of a depthwise Conv (one input channel per group, Cout/Cin outputs each): per kernel
    offset, (the input window at that offset) times dy summed over examples and positions, with
    the channels last ([spatial..., N, C]) so that the windows are Slices of whole rows and the sum
    runs over the leading axis. On MobileNetV2's layers (batch 32) 1.2-4.6 ms against 3.9-9.4 for
    the swapped Conv with one input channel per group, whose strided im2col is slow."""
    nd = len(kernel)
    m = c_out // channels
    xt = e.op("Transpose", [x], perm=[*range(2, 2 + nd), 0, 1])  # [spatial..., N, C]
    if any(pads):
        xt = e.op("Pad", [xt, e.ints([*pads[:nd], 0, 0, *pads[nd:], 0, 0])])
    dyt = e.op("Transpose", [dy], perm=[*range(2, 2 + nd), 0, 1])
    dyt = e.op("Reshape", [dyt, e.ints([-1, channels, m] if m > 1 else [-1, channels])])
    rows = []
    for offset in np.ndindex(*kernel):
        firsts = [i * d for i, d in zip(offset, dil)]
        if not all(any(pads[a] <= f + s * t < pads[a] + dims[a] for t in range(o))
                   for a, (f, s, o) in enumerate(zip(firsts, strides, out_dims))):
            rows.append(e.const(np.zeros((1, c_out), dtype=helper_dtype(e, dy)), "zero_tap"))  # the window is all padding
            continue
        ends = [f + s * (o - 1) + 1 for f, s, o in zip(firsts, strides, out_dims)]
        window = e.op("Slice", [xt, e.ints(firsts), e.ints(ends), e.ints(list(range(nd))), e.ints(strides)])
        window = e.op("Reshape", [window, e.ints([-1, channels, 1] if m > 1 else [-1, channels])])
        summed = e.reduce("ReduceSum", e.op("Mul", [window, dyt]), [0], keepdims=True)
        rows.append(e.op("Reshape", [summed, e.ints([1, c_out])]) if m > 1 else summed)
    taps = e.op("Concat", rows, axis=0) if len(rows) > 1 else rows[0]  # [k..., Cout]
    return e.op("Reshape", [e.op("Transpose", [taps], perm=[1, 0]), e.ints([c_out, 1, *kernel])])


def helper_dtype(e: Emitter, t: str):
    return onnx.helper.tensor_dtype_to_np_dtype(e.elem_type(t))


@rule("MaxPool", note="windows that tile the input: dy to each window's first maximum (ArgMax over the window); "
                      "otherwise dy scattered-added to the Indices output")
def _maxpool(e, node, dys, wants):
    x, dy = node.input[0], _dy(dys, e, node)
    tile = tiling_pool(e, node)
    if tile is not None and (len(node.output) < 2 or not node.output[1]):
        # The windows' k = kh*kw offsets as an outer axis: ArgMax over it picks each window's first
        # maximum, as the Indices would, and every broadcast runs over whole rows (onnxruntime
        # broadcasts over a small inner axis, or transposes small axes, several times slower).
        # Square windows use SpaceToDepth / DepthToSpace, whose kernels do exactly this layout.
        kh, kw = tile
        _, c, h, w = e.shape(x)
        k, rest = kh * kw, c * (h // kh) * (w // kw)
        if kh == kw:
            rows = e.op("Reshape", [e.op("SpaceToDepth", [x], blocksize=kh), e.ints([-1, k, rest])])
        else:
            windows = e.op("Reshape", [x, e.ints([-1, c, h // kh, kh, w // kw, kw])])
            rows = e.op("Reshape", [e.op("Transpose", [windows], perm=[0, 3, 5, 1, 2, 4]), e.ints([-1, k, rest])])
        first = e.op("ArgMax", [rows], axis=1, keepdims=1)
        offsets = e.const(np.arange(k, dtype=np.int64).reshape(1, k, 1), "offsets")
        mask = e.op("Cast", [e.op("Equal", [first, offsets])], to=e.elem_type(x))
        spread = e.op("Mul", [mask, e.op("Reshape", [dy, e.ints([-1, 1, rest])])])
        if kh == kw:
            back = e.op("DepthToSpace", [e.op("Reshape", [spread, e.ints([-1, k * c, h // kh, w // kw])])], blocksize=kh, mode="DCR")
            return [back]
        six = e.op("Reshape", [spread, e.ints([-1, kh, kw, c, h // kh, w // kw])])
        return [e.op("Reshape", [e.op("Transpose", [six], perm=[0, 3, 4, 1, 5, 2]), e.ints([-1, c, h, w])])]
    if len(node.output) < 2 or not node.output[1]:
        raise UnsupportedOpError(node.op_type, node.name, "needs its Indices output (training plans add it)")
    kernel = list(attr(node, "kernel_shape"))
    strides = list(attr(node, "strides", [1] * len(kernel)))
    overlapping = any(s < k for s, k in zip(strides, kernel)) or any(d != 1 for d in attr(node, "dilations", [1] * len(kernel)))
    flat_x = e.op("Reshape", [e.zeros_like(x), e.ints([-1])])
    flat_i = e.op("Reshape", [node.output[1], e.ints([-1])])
    flat_dy = e.op("Reshape", [dy, e.ints([-1])])
    if overlapping and e.opset < 16:
        raise UnsupportedOpError(node.op_type, node.name, "with overlapping windows is differentiated at opset 16 or later")
    extra = {"reduction": "add"} if e.opset >= 16 else {}
    scattered = e.op("ScatterElements", [flat_x, flat_i, flat_dy], axis=0, **extra)
    return [e.reshape_like(scattered, x)]


@rule("AveragePool", note="dy spread over each window: ConvTranspose with a constant kernel")
def _avgpool(e, node, dys, wants):
    x, y, dy = node.input[0], node.output[0], _dy(dys, e, node)
    kernel = [int(k) for k in attr(node, "kernel_shape")]
    nd = len(kernel)
    strides, pads, dil, dims = conv_geometry(e, node, x, kernel)
    xshape, yshape = e.shape(x), e.shape(y)
    if yshape is None or not all(isinstance(d, int) for d in yshape[1:]) or not isinstance(xshape[1], int):
        raise UnsupportedOpError(node.op_type, node.name, "needs static channel and spatial sizes")
    channels = int(xshape[1])
    out_dims = [int(d) for d in yshape[2:]]
    dtype = onnx.helper.tensor_dtype_to_np_dtype(e.elem_type(x))
    ones = e.const(np.ones((channels, 1, *kernel), dtype=dtype), "pool_kernel")
    if int(attr(node, "count_include_pad", 0)) or not any(pads):
        scaled = e.op("Div", [dy, e.scalar(float(np.prod(kernel)), y)])
    else:
        # each window's divisor: how many real (unpadded) inputs it covers
        counts = e.op("Conv", [e.const(np.ones((1, 1, *dims), dtype=dtype), "ones"), e.const(np.ones((1, 1, *kernel), dtype=dtype), "k1")],
                      strides=strides, pads=pads, dilations=dil)
        scaled = e.op("Div", [dy, counts])
    extra = _output_padding(node, dims, out_dims, kernel, strides, pads, dil)
    return [e.op("ConvTranspose", [scaled, ones], strides=strides, pads=pads, dilations=dil, group=channels, output_padding=extra)]


@rule("GlobalAveragePool", note="dy/(H*W) broadcast over each channel")
def _gap(e, node, dys, wants):
    x, y = node.input[0], node.output[0]
    scaled = e.op("Div", [_dy(dys, e, node), _count(e, x, y, list(range(2, e.rank(x) or 4)))])
    return [e.broadcast_to(scaled, x)]


@rule("GlobalMaxPool", note="dy to each channel's maximum (shared on ties)")
def _gmp(e, node, dys, wants):
    x, y, dy = node.input[0], node.output[0], _dy(dys, e, node)
    axes = list(range(2, e.rank(x) or 4))
    mask = e.op("Cast", [e.op("Equal", [x, y])], to=e.elem_type(x))
    ties = e.reduce("ReduceSum", mask, axes, keepdims=True)
    return [e.op("Mul", [mask, e.op("Div", [dy, ties])])]


# ---------------------------------------------------------------------------- the table

_DECOMPOSED = {
    "BatchNormalization": "training: rewritten with batch statistics (mean/var over N and spatial axes); running statistics "
                          "become state updated with momentum (the variance unbiased, n/(n-1), as torch); "
                          "evaluation keeps the op",
    "LayerNormalization": "rewritten into ReduceMean/Sub/Mul/Sqrt/Div before differentiating (opset >= 17)",
    "GRU": "unrolled over its static sequence length into MatMul/Split/Sigmoid/Tanh (forward direction, layout 0, "
           "default activations, either linear_before_reset, no sequence_lens)",
    "LSTM": "unrolled over its static sequence length into MatMul/Split/Sigmoid/Tanh (forward direction, layout 0, "
            "default activations, no peepholes, no sequence_lens)",
}


def op_coverage() -> dict[str, str]:
    """Op -> how a training plan handles it: its gradient rule, no gradient, or a rewrite."""
    table = {op: f"gradient: {_NOTES[op]}" for op in RULES}
    table.update({op: "no gradient (integer, boolean or piecewise-constant result)" for op in NO_GRADIENT})
    table.update({op: how for op, how in _DECOMPOSED.items()})
    table["Dropout"] = "training: active (mask output); gradient dy*mask/(1-ratio); evaluation: identity"
    table["MaxPool"] = "gradient: " + _NOTES["MaxPool"] + " (training plans add the Indices output where needed)"
    return dict(sorted(table.items()))


OP_COVERAGE: dict[str, str] = op_coverage()


def coverage_markdown() -> str:
    """The table as Markdown, for the README."""
    rows = ["| op | in a training plan |", "|---|---|"]
    rows += [f"| {op} | {how} |" for op, how in OP_COVERAGE.items()]
    return "\n".join(rows)



def coverage_document() -> str:
    """emulator/toolchain/OP_COVERAGE.md, the table as the README links it."""
    return "\n".join([
        "# Ops a generated training plan covers",
        "",
        "Generated from `emulator.toolchain.OP_COVERAGE` (`python -m emulator.toolchain.gradients`); a test keeps",
        "the two equal. An op outside this table is refused with `UnsupportedOpError`, naming the op and the",
        "node. Every gradient rule is checked against finite differences over random shapes",
        "(`tests/emulator/toolchain/test_gradients.py`), the written-out ops (`LayerNormalization`, `GRU`,",
        "`LSTM`) against onnxruntime's own kernels for them. A recurrent model may also come unrolled by its",
        "author (`Slice` and `Squeeze` per step, `MatMul`, `Sigmoid`, `Tanh`).",
        "",
        coverage_markdown(),
        "",
    ])


if __name__ == "__main__":  # regenerates the document
    import sys

    sys.stdout.write(coverage_document())
