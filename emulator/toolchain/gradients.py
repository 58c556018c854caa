"""One gradient rule per ONNX op, each written in standard ONNX ops, and the op-coverage table.

A rule takes the emitter, the forward node, the gradients flowing into the node's outputs (None
where none flows) and which inputs want a gradient, and returns one gradient tensor (or None) per
input. Rules use the forward node's own outputs where that saves work (``Sigmoid``: dy*y*(1-y)).

The exact GELU that exporters write in five ops below opset 20 is differentiated as one activation
(:func:`erf_gelus`), a batch-statistics normalization as :mod:`.forward` writes it is differentiated
at its output in closed form (:func:`batch_norms`), and a Conv written as a sum over its kernel
offsets takes its input gradient at the sum, gathered from dy (:func:`conv_tap_sums`). Ops that a training plan rewrites before
differentiating (``BatchNormalization`` with batch statistics, ``LayerNormalization``, active
``Dropout``, ``MaxPool`` with indices) are described in :mod:`.forward`; their rules here see the
rewritten form.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto

from .emitter import Emitter, UnsupportedOpError, attr

Rule = Callable[[Emitter, onnx.NodeProto, list[str | None], list[bool]], list[str | None]]
RULES: dict[str, Rule] = {}
_NOTES: dict[str, str] = {}

# Ops whose outputs carry no gradient (integer, boolean or piecewise-constant results): allowed
# anywhere in a model, a gradient stops there.
NO_GRADIENT = frozenset(
    {
        "Shape",
        "Size",
        "Constant",
        "ConstantOfShape",
        "Equal",
        "Greater",
        "GreaterOrEqual",
        "Less",
        "LessOrEqual",
        "Not",
        "And",
        "Or",
        "Xor",
        "ArgMax",
        "ArgMin",
        "Range",
        "NonZero",
        "Sign",
        "Floor",
        "Ceil",
        "Round",
        "IsNaN",
        "IsInf",
        "OneHot",
    }
)


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
    return [e.unbroadcast(dy, y, a) if wants[0] else None, e.op("Neg", [e.unbroadcast(dy, y, b)]) if wants[1] else None]


@rule("Mul", note="dy*b, dy*a, summed over broadcast axes; x*x: dy*2x")
def _mul(e, node, dys, wants):
    dy, (a, b), y = _dy(dys, e, node), node.input, node.output[0]
    if a == b:  # a square: one product instead of two and their sum
        if dy in e.broadcasts and e.shape(a) == e.shape(y):  # a mean's gradient: scale it before it meets a
            return [e.op("Mul", [a, e.op("Mul", [e.broadcasts[dy], e.scalar(2.0, a)])]) if wants[0] else None, None]
        return [e.unbroadcast(e.op("Mul", [dy, e.op("Mul", [a, e.scalar(2.0, a)])]), y, a) if wants[0] else None, None]
    return [
        e.unbroadcast(e.op("Mul", [dy, b]), y, a) if wants[0] else None,
        e.unbroadcast(e.op("Mul", [dy, a]), y, b) if wants[1] else None,
    ]


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
    return [
        e.unbroadcast(_masked(e, chose_a, dy), y, a) if wants[0] else None,
        e.unbroadcast(_masked(e, e.op("Not", [chose_a]), dy), y, b) if wants[1] else None,
    ]


@rule("Sum", note="dy to every input")
def _sum(e, node, dys, wants):
    dy, y = _dy(dys, e, node), node.output[0]
    return [e.unbroadcast(dy, y, x) if want else None for x, want in zip(node.input, wants)]


@rule("Where", note="dy where the condition holds to x, elsewhere to y")
def _where_rule(e, node, dys, wants):
    dy, (c, a, b), y = _dy(dys, e, node), node.input, node.output[0]
    return [
        None,
        e.unbroadcast(_masked(e, c, dy), y, a) if wants[1] else None,
        e.unbroadcast(_masked(e, e.op("Not", [c]), dy), y, b) if wants[2] else None,
    ]


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
    local = _where(
        e,
        e.op("Less", [x, e.scalar(-3.0, x)]),
        e.scalar(0.0, x),
        _where(e, e.op("Greater", [x, e.scalar(3.0, x)]), e.scalar(1.0, x), ramp),
    )
    return [e.op("Mul", [dy, local])]


@rule("Dropout", note="dy*mask/(1-ratio) when training, dy at inference")
def _dropout(e, node, dys, wants):
    dy = _dy(dys, e, node)
    training = (
        len(node.input) > 2 and node.input[2] and e.value(node.input[2]) is not None and bool(e.value(node.input[2]))
    )
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


# ---------------------------------------------------------------------------- composite patterns


def erf_gelus(
    nodes: Sequence[onnx.NodeProto], e: Emitter, live: set[str]
) -> dict[str, tuple[str, str, str, float, float]]:
    """The exact GELU as exporters write it below opset 20 (``Gelu``'s): ``x * (erf(x / c) + 1) * h``
    with constants no gradient reaches (``live``: the tensors one does), whose inner tensors nothing
    else reads. Output -> (x, x/c, erf + 1, 1/c, h); the output's gradient
    is then one local derivative (:func:`erf_gelu_gradient`) instead of the five ops' rules (nine
    passes over the activations where six do)."""
    producers = {o: n for n in nodes for o in n.output}
    readers: dict[str, int] = {}
    for n in nodes:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1

    def scalar(name: str) -> float | None:
        v = e.value(name) if name not in live else None
        return float(v.reshape(())) if v is not None and v.size == 1 else None

    def only(name: str, op: str) -> onnx.NodeProto | None:
        node = producers.get(name)
        ok = node is not None and node.op_type == op and node.domain in ("", "ai.onnx") and readers.get(name) == 1
        return node if ok else None

    def split(node: onnx.NodeProto) -> tuple[str, float] | None:  # (tensor, constant) of a product or sum with one
        for a, b in (node.input, reversed(node.input)):
            k = scalar(b)
            if k is not None and scalar(a) is None:
                return a, k
        return None

    found: dict[str, tuple[str, str, str, float, float]] = {}
    for node in nodes:
        pair = split(node) if node.op_type == "Mul" and node.domain in ("", "ai.onnx") else None
        if pair is None:
            continue
        inner, h = pair
        prod = only(inner, "Mul")
        if prod is None:
            continue
        for x, a in (prod.input, reversed(prod.input)):
            add = only(a, "Add")
            one = split(add) if add is not None else None
            erf = only(one[0], "Erf") if one is not None and one[1] == 1.0 else None
            scaled = producers.get(erf.input[0]) if erf is not None else None
            c = scalar(scaled.input[1]) if scaled is not None else None
            if (
                erf is None
                or scaled is None
                or readers.get(erf.input[0]) != 1
                or scaled.op_type not in ("Div", "Mul")
                or scaled.input[0] != x
                or not c
            ):
                continue
            found[node.output[0]] = (x, erf.input[0], a, 1.0 / c if scaled.op_type == "Div" else c, h)
            break
    return found


def erf_gelu_gradient(e: Emitter, pattern: tuple[str, str, str, float, float], dy: str) -> str:
    """d/dx of h * x * (erf(x k) + 1) = h * (a + x * k 2/sqrt(pi) exp(-u^2)), u = x k, a = erf(u) + 1
    (the forward's own tensors); the constant h first, where onnxruntime folds it into the MatMul
    that made ``dy``."""
    x, u, a, k, h = pattern
    local = e.op("Exp", [e.op("Sub", [e.scalar(math.log(abs(k) * 2.0 / math.sqrt(math.pi)), x), e.op("Mul", [u, u])])])
    if k < 0:
        local = e.op("Neg", [local])
    total = e.op("Add", [a, e.op("Mul", [x, local])])
    return e.op("Mul", [e.op("Mul", [dy, e.scalar(h, x)]), total])


@dataclass(frozen=True)
class BatchNormPattern:
    """A normalization with batch statistics as :func:`.forward`'s batch-norm rewrite writes it:
    ``(x - mean) * (1 / sqrt(var + eps) * scale) + bias``, the mean and the population variance
    over ``axes`` (kept as 1s)."""

    x: str
    mean: str
    centred: str
    inv: str
    gain: str
    scale: str
    bias: str
    axes: tuple[int, ...]


def batch_norms(nodes: Sequence[onnx.NodeProto], e: Emitter, needed: set[str]) -> dict[str, BatchNormPattern]:
    """The batch-statistics normalizations among ``nodes`` (:class:`BatchNormPattern`) whose inner
    tensors no other differentiated tensor reads (``needed``: the tensors the loss is computed from;
    the running statistics' updates read the mean and variance and are not), by output. Their
    gradient is then taken at once (:func:`batch_norm_gradient`): the centred input's three
    per-channel terms, instead of the twelve ops' rules, which also sum the mean's and the
    variance's paths over the activations where the first is known to vanish."""
    producers = {o: n for n in nodes for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)

    def made(name: str, op: str) -> onnx.NodeProto | None:
        node = producers.get(name)
        return node if node is not None and node.op_type == op and node.domain in ("", "ai.onnx") else None

    def kept_axes(node: onnx.NodeProto | None) -> tuple[int, ...] | None:
        if (
            node is None
            or not int(attr(node, "keepdims", 1))
            or (len(node.input) > 1 and e.value(node.input[1]) is None)
        ):
            return None
        axes = _reduce_axes(e, node)
        return None if not axes or any(a < 0 for a in axes) else tuple(axes)

    found: dict[str, BatchNormPattern] = {}

    def chain(name: str, ops: Sequence[str]) -> list[onnx.NodeProto] | None:
        """The producers of ``name``, of its producer's first input and so on, of the ops ``ops``."""
        out = []
        for op in ops:
            node = made(name, op)
            if node is None:
                return None
            out.append(node)
            name = node.input[0]
        return out

    for node in nodes:
        prod = made(node.input[0], "Mul") if node.op_type == "Add" and node.domain in ("", "ai.onnx") else None
        if prod is None:
            continue
        centred, gain = prod.input
        sub, scaled = made(centred, "Sub"), made(gain, "Mul")
        mean = made(sub.input[1], "ReduceMean") if sub is not None else None
        if sub is None or mean is None or scaled is None or mean.input[0] != sub.input[0]:
            continue
        inv, scale = scaled.input
        path = chain(inv, ("Reciprocal", "Sqrt", "Add", "ReduceMean", "Mul"))
        axes = kept_axes(mean)
        if path is None or axes is None:
            continue
        recip, root, shifted, var, square = path
        if list(square.input) != [centred, centred] or kept_axes(var) != axes or e.value(shifted.input[1]) is None:
            continue
        x_shape, gain_shape = e.shape(sub.input[0]), e.shape(gain)
        if (  # a gain that varies over the reduced axes (a layer norm's) or an output broadcast past x: the rules
            x_shape is None
            or gain_shape is None
            or len(gain_shape) != len(x_shape)
            or any(gain_shape[a] != 1 for a in axes)
            or e.shape(node.output[0]) != x_shape
        ):
            continue
        inner = [mean, sub, square, var, shifted, root, recip, scaled, prod]
        own = {id(n) for n in [*inner, node]}
        if any(id(r) not in own and r.output[0] in needed for n in inner for r in readers.get(n.output[0], [])):
            continue
        found[node.output[0]] = BatchNormPattern(
            sub.input[0], sub.input[1], centred, inv, gain, scale, node.input[1], axes
        )
    return found


def batch_norm_gradient(e: Emitter, bn: BatchNormPattern, dy: str, wants: Sequence[bool]) -> list[str | None]:
    """The gradients of a :class:`BatchNormPattern`'s x, scale and bias (where ``wants``), with
    s1 = sum(dy) and s2 = sum(dy * centred) over its axes, n the elements per channel:
    dbias = s1, dscale = inv * s2, dx = dy * gain + centred * k1 + k2 with the per-channel
    k1 = -gain * inv * dscale / n and k2 = -gain * s1 / n (the mean's path, whose term through the
    variance is a sum of the centred input: zero)."""
    axes = list(bn.axes)
    s1 = e.reduce("ReduceSum", dy, axes, keepdims=True, hint="bn_dbias")
    s2 = e.reduce("ReduceSum", e.op("Mul", [dy, bn.centred]), axes, keepdims=True)
    dscale = e.op("Mul", [s2, bn.inv], hint="bn_dscale")
    dx = None
    if wants[0]:
        over_n = e.op("Div", [bn.gain, _count(e, bn.x, bn.mean, axes)])
        k1 = e.op("Neg", [e.op("Mul", [e.op("Mul", [over_n, bn.inv]), dscale])])
        k2 = e.op("Neg", [e.op("Mul", [over_n, s1])])
        dx = e.op("Sum", [e.op("Mul", [dy, bn.gain]), e.op("Mul", [bn.centred, k1]), k2], hint="bn_dx")
    return [
        dx,
        e.unbroadcast(dscale, bn.gain, bn.scale) if wants[1] else None,
        e.unbroadcast(s1, bn.mean, bn.bias) if wants[2] else None,
    ]


# ---------------------------------------------------------------------------- more activations


def _local(e: Emitter, node: onnx.NodeProto, dys: list[str | None], local: str) -> list[str | None]:
    """dy times the elementwise derivative ``local``, for a one-input op."""
    return [e.op("Mul", [_dy(dys, e, node), local])]


def _positive(e: Emitter, x: str, threshold: float = 0.0) -> str:
    return e.op("Greater", [x, e.scalar(threshold, x)])


@rule("Gelu", note="dy*(Phi(x) + x*phi(x)); tanh approximation: its own derivative")
def _gelu(e, node, dys, wants):
    x = node.input[0]
    approximate = attr(node, "approximate", b"none")
    approximate = approximate.decode() if isinstance(approximate, bytes) else approximate
    half = e.scalar(0.5, x)
    if approximate == "tanh":  # y = x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)
        c, k = math.sqrt(2.0 / math.pi), 0.044715
        x2 = e.op("Mul", [x, x])
        u = e.op(
            "Mul",
            [e.op("Mul", [x, e.op("Add", [e.scalar(1.0, x), e.op("Mul", [x2, e.scalar(k, x)])])]), e.scalar(c, x)],
        )
        t = e.op("Tanh", [u])
        du = e.op("Add", [e.scalar(c, x), e.op("Mul", [x2, e.scalar(3.0 * k * c, x)])])
        sech2 = e.op("Sub", [e.scalar(1.0, x), e.op("Mul", [t, t])])
        local = e.op(
            "Mul", [half, e.op("Add", [e.op("Add", [e.scalar(1.0, x), t]), e.op("Mul", [e.op("Mul", [x, sech2]), du])])]
        )
        return _local(e, node, dys, local)
    if approximate != "none":
        raise UnsupportedOpError(
            node.op_type, node.name, f"has approximate={approximate!r}; 'none' and 'tanh' are covered"
        )
    cdf = e.op(
        "Mul",
        [half, e.op("Add", [e.scalar(1.0, x), e.op("Erf", [e.op("Mul", [x, e.scalar(1.0 / math.sqrt(2.0), x)])])])],
    )
    pdf = e.op(
        "Mul",
        [
            e.op("Exp", [e.op("Mul", [e.op("Mul", [x, x]), e.scalar(-0.5, x)])]),
            e.scalar(1.0 / math.sqrt(2.0 * math.pi), x),
        ],
    )
    return _local(e, node, dys, e.op("Add", [cdf, e.op("Mul", [x, pdf])]))


@rule("Mish", note="dy*(t + x*(1-t^2)*sigmoid(x)), t = tanh(softplus(x))")
def _mish(e, node, dys, wants):
    x = node.input[0]
    t = e.op("Tanh", [e.op("Softplus", [x])])
    sech2 = e.op("Sub", [e.scalar(1.0, x), e.op("Mul", [t, t])])
    return _local(e, node, dys, e.op("Add", [t, e.op("Mul", [e.op("Mul", [x, sech2]), e.op("Sigmoid", [x])])]))


@rule("Elu", note="dy where x > 0, dy*(y+alpha) elsewhere")
def _elu(e, node, dys, wants):
    x, y = node.input[0], node.output[0]
    alpha = float(attr(node, "alpha", 1.0))
    return _local(e, node, dys, _where(e, _positive(e, x), e.scalar(1.0, x), e.op("Add", [y, e.scalar(alpha, x)])))


@rule("Selu", note="dy*gamma where x > 0, dy*(y+alpha*gamma) elsewhere")
def _selu(e, node, dys, wants):
    x, y = node.input[0], node.output[0]
    alpha, gamma = (
        float(attr(node, "alpha", 1.67326319217681884765625)),
        float(attr(node, "gamma", 1.05070102214813232421875)),
    )
    return _local(
        e, node, dys, _where(e, _positive(e, x), e.scalar(gamma, x), e.op("Add", [y, e.scalar(alpha * gamma, x)]))
    )


@rule("Celu", note="dy where x > 0, dy*exp(x/alpha) elsewhere")
def _celu(e, node, dys, wants):
    x = node.input[0]
    alpha = float(attr(node, "alpha", 1.0))
    return _local(
        e, node, dys, _where(e, _positive(e, x), e.scalar(1.0, x), e.op("Exp", [e.op("Div", [x, e.scalar(alpha, x)])]))
    )


@rule("ThresholdedRelu", note="dy where x > alpha")
def _thresholded_relu(e, node, dys, wants):
    x = node.input[0]
    return [_where(e, _positive(e, x, float(attr(node, "alpha", 1.0))), _dy(dys, e, node), e.scalar(0.0, x))]


@rule("Shrink", note="dy where abs(x) > lambd")
def _shrink(e, node, dys, wants):
    x = node.input[0]
    lambd = float(attr(node, "lambd", 0.5))
    outside = e.op("Or", [_positive(e, x, lambd), e.op("Less", [x, e.scalar(-lambd, x)])])
    return [_where(e, outside, _dy(dys, e, node), e.scalar(0.0, x))]


@rule("Softsign", note="dy/(1+abs(x))^2")
def _softsign(e, node, dys, wants):
    x = node.input[0]
    d = e.op("Add", [e.scalar(1.0, x), e.op("Abs", [x])])
    return [e.op("Div", [_dy(dys, e, node), e.op("Mul", [d, d])])]


@rule("PRelu", note="dy where x > 0, slope*dy elsewhere; slope: dy*x where x <= 0, summed over broadcast axes")
def _prelu(e, node, dys, wants):
    (x, slope), y, dy = node.input, node.output[0], _dy(dys, e, node)
    positive, zero = _positive(e, x), e.scalar(0.0, x)
    dx = _where(e, positive, dy, e.op("Mul", [dy, slope])) if wants[0] else None
    dslope = e.unbroadcast(_where(e, positive, zero, e.op("Mul", [dy, x])), y, slope) if wants[1] else None
    return [dx, dslope]


@rule("Sin", note="dy*cos(x)")
def _sin(e, node, dys, wants):
    return _local(e, node, dys, e.op("Cos", [node.input[0]]))


@rule("Cos", note="-dy*sin(x)")
def _cos(e, node, dys, wants):
    return [e.op("Neg", [e.op("Mul", [_dy(dys, e, node), e.op("Sin", [node.input[0]])])])]


@rule("Tan", note="dy*(1+y^2)")
def _tan(e, node, dys, wants):
    y = node.output[0]
    return _local(e, node, dys, e.op("Add", [e.scalar(1.0, y), e.op("Mul", [y, y])]))


@rule("Sinh", note="dy*cosh(x)")
def _sinh(e, node, dys, wants):
    return _local(e, node, dys, e.op("Cosh", [node.input[0]]))


@rule("Cosh", note="dy*sinh(x)")
def _cosh(e, node, dys, wants):
    return _local(e, node, dys, e.op("Sinh", [node.input[0]]))


def _inverse_root(e: Emitter, node: onnx.NodeProto, dys: list[str | None], x: str, square_first: bool) -> str:
    """dy/sqrt(1 - x^2) (``square_first`` False) or dy/sqrt(x^2 - 1)."""
    squared = e.op("Mul", [x, x])
    one = e.scalar(1.0, x)
    inside = e.op("Sub", [squared, one] if square_first else [one, squared])
    return e.op("Div", [_dy(dys, e, node), e.op("Sqrt", [inside])])


@rule("Asin", note="dy/sqrt(1-x^2)")
def _asin(e, node, dys, wants):
    return [_inverse_root(e, node, dys, node.input[0], square_first=False)]


@rule("Acos", note="-dy/sqrt(1-x^2)")
def _acos(e, node, dys, wants):
    return [e.op("Neg", [_inverse_root(e, node, dys, node.input[0], square_first=False)])]


@rule("Acosh", note="dy/sqrt(x^2-1)")
def _acosh(e, node, dys, wants):
    return [_inverse_root(e, node, dys, node.input[0], square_first=True)]


@rule("Asinh", note="dy/sqrt(x^2+1)")
def _asinh(e, node, dys, wants):
    x = node.input[0]
    return [e.op("Div", [_dy(dys, e, node), e.op("Sqrt", [e.op("Add", [e.op("Mul", [x, x]), e.scalar(1.0, x)])])])]


@rule("Atan", note="dy/(1+x^2)")
def _atan(e, node, dys, wants):
    x = node.input[0]
    return [e.op("Div", [_dy(dys, e, node), e.op("Add", [e.scalar(1.0, x), e.op("Mul", [x, x])])])]


@rule("Atanh", note="dy/(1-x^2)")
def _atanh(e, node, dys, wants):
    x = node.input[0]
    return [e.op("Div", [_dy(dys, e, node), e.op("Sub", [e.scalar(1.0, x), e.op("Mul", [x, x])])])]


# ---------------------------------------------------------------------------- more shapes and indexing


def _constant_ints(e: Emitter, node: onnx.NodeProto, index: int, what: str) -> list[int] | None:
    """The node's constant integer input ``index`` as a list (None when the input is absent)."""
    if len(node.input) <= index or not node.input[index]:
        return None
    value = e.value(node.input[index])
    if value is None:
        raise UnsupportedOpError(node.op_type, node.name, f"needs constant {what}")
    return [int(v) for v in np.asarray(value).reshape(-1)]


def _static_dim(e: Emitter, node: onnx.NodeProto, x: str, axis: int) -> int:
    shape = e.shape(x)
    size = shape[axis] if shape is not None else None
    if not isinstance(size, int):
        raise UnsupportedOpError(node.op_type, node.name, f"needs a static size of axis {axis}")
    return size


def _slice1(e: Emitter, t: str, start: int, end: int, axis: int, step: int = 1) -> str:
    return e.op("Slice", [t, e.ints([start]), e.ints([end]), e.ints([axis]), e.ints([step])])


@rule("Tile", note="dy reshaped to (repeat, size) pairs and summed over the repeats (repeats read at run time too)")
def _tile(e, node, dys, wants):
    x, dy = node.input[0], _dy(dys, e, node)
    rank = e.rank(x)
    if rank is None:
        raise UnsupportedOpError(node.op_type, node.name, "needs an input of known rank")
    # [r0, d0, r1, d1, ...]: the repeats (x.repeat(batch, 1, 1) reads one from Shape) beside x's sizes
    repeats = e.value(node.input[1])
    repeats = e.ints([int(r) for r in repeats.reshape(-1)]) if repeats is not None else node.input[1]
    pairs = e.op("Concat", [e.unsqueeze(repeats, [1]), e.unsqueeze(e.shape_of(x), [1])], axis=1)
    shape = e.op("Reshape", [pairs, e.ints([-1])])
    summed = e.reduce("ReduceSum", e.op("Reshape", [dy, shape]), list(range(0, 2 * rank, 2)), keepdims=False)
    return [summed, None]


@rule(
    "Pad",
    note="constant: dy cropped (Pad by the negated pads); reflect, edge, wrap: the border's dy added back "
    "where it was read",
)
def _pad(e, node, dys, wants):
    x, dy = node.input[0], _dy(dys, e, node)
    mode = attr(node, "mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    rank = e.rank(x)
    if rank is None:
        raise UnsupportedOpError(node.op_type, node.name, "needs an input of known rank")
    pads = _constant_ints(e, node, 1, "pads")
    axes = _constant_ints(e, node, 3, "axes") or list(range(rank))
    axes = [a + rank if a < 0 else a for a in axes]
    k = len(axes)
    grads: list[str | None] = [None] * len(node.input)
    if mode == "constant":
        grads[0] = (
            e.op("Pad", [dy, e.ints([-p for p in pads]), "", e.ints(axes)])
            if e.opset >= 18
            else e.op("Pad", [dy, e.ints(_full_pads([-p for p in pads], axes, rank))])
        )
        return grads
    if mode not in ("reflect", "edge", "wrap") or any(p < 0 for p in pads):
        raise UnsupportedOpError(node.op_type, node.name, f"with mode={mode!r} and negative pads is not differentiated")
    g = dy
    for i, axis in enumerate(axes):
        begin, end = int(pads[i]), int(pads[k + i])
        if begin or end:
            g = _unpad_axis(e, node, g, mode, axis, begin, end, _static_dim(e, node, x, axis))
    grads[0] = g
    return grads


def _full_pads(pads: Sequence[int], axes: Sequence[int], rank: int) -> list[int]:
    full = [0] * (2 * rank)
    for i, a in enumerate(axes):
        full[a], full[rank + a] = pads[i], pads[len(axes) + i]
    return full


def _unpad_axis(e: Emitter, node, g: str, mode: str, axis: int, begin: int, end: int, n: int) -> str:
    """The gradient of padding one axis of length ``n`` by (begin, end) in a border mode: the middle,
    plus each border's gradient added where it was read from."""
    total = begin + n + end
    parts = []  # (the border's gradient, where its first row lands in x, its length)
    if begin:
        head = _slice1(e, g, 0, begin, axis)
        parts.append(
            {
                "reflect": (_slice1(e, head, begin - 1, -total - 1, axis, -1), 1, begin),  # y[j] = x[begin-j]
                "edge": (e.reduce("ReduceSum", head, [axis], keepdims=True), 0, 1),
                "wrap": (head, n - begin, begin),
            }[mode]
        )  # y[j] = x[n-begin+j]
    if end:
        tail = _slice1(e, g, begin + n, total, axis)
        parts.append(
            {
                "reflect": (
                    _slice1(e, tail, end - 1, -total - 1, axis, -1),
                    n - 1 - end,
                    end,
                ),  # y[begin+n+k] = x[n-2-k]
                "edge": (e.reduce("ReduceSum", tail, [axis], keepdims=True), n - 1, 1),
                "wrap": (tail, 0, end),
            }[mode]
        )  # y[begin+n+k] = x[k]
    out = _slice1(e, g, begin, begin + n, axis)
    rank = e.rank(node.input[0])
    if rank is None:
        raise UnsupportedOpError(node.op_type, node.name, "needs an input of known rank")
    for block, at, size in parts:
        if at < 0 or at + size > n:
            raise UnsupportedOpError(node.op_type, node.name, f"pads more than the axis holds in mode {mode!r}")
        pads = [0] * (2 * rank)
        pads[axis], pads[rank + axis] = at, n - at - size
        out = e.op("Add", [out, e.op("Pad", [block, e.ints(pads)])])
    return out


@rule("GatherElements", note="dy scattered-added into zeros of x's shape at the indices")
def _gather_elements(e, node, dys, wants):
    data, idx = node.input
    if e.opset < 16:
        raise UnsupportedOpError(
            node.op_type, node.name, "is differentiated at opset 16 or later (ScatterElements with add)"
        )
    axis = int(attr(node, "axis", 0))
    return [e.op("ScatterElements", [e.zeros_like(data), idx, _dy(dys, e, node)], axis=axis, reduction="add"), None]


@rule("TopK", note="values: dy written into zeros of x's shape at the Indices output (torch.topk, torch.sort)")
def _topk(e, node, dys, wants):
    if len(node.output) < 2 or not node.output[1]:
        raise UnsupportedOpError(node.op_type, node.name, "is differentiated with its Indices output only")
    x, indices = node.input[0], node.output[1]
    axis = int(attr(node, "axis", -1))
    # each slice's indices are distinct: a plain scatter writes every value's gradient at its place
    return [e.op("ScatterElements", [e.zeros_like(x), indices, _dy(dys, e, node)], axis=axis), None]


@rule("GatherND", note="dy scattered-added into zeros of x's shape at the indices (batch_dims 0)")
def _gather_nd(e, node, dys, wants):
    data, idx = node.input
    if int(attr(node, "batch_dims", 0)) or e.opset < 16:
        raise UnsupportedOpError(
            node.op_type, node.name, "is differentiated with batch_dims=0 at opset 16 or later only"
        )
    return [e.op("ScatterND", [e.zeros_like(data), idx, _dy(dys, e, node)], reduction="add"), None]


@rule(
    "ScatterND",
    "ScatterElements",
    note="data: dy where nothing was written; updates: dy gathered at the indices (reduction none or add)",
)
def _scatter(e, node, dys, wants):
    (_, idx, updates), dy = node.input, _dy(dys, e, node)
    reduction = attr(node, "reduction", b"none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if reduction not in ("none", "add"):
        raise UnsupportedOpError(node.op_type, node.name, f"with reduction={reduction!r} is not differentiated")
    extra = {"axis": int(attr(node, "axis", 0))} if node.op_type == "ScatterElements" else {}
    ddata = dupdates = None
    if wants[0]:
        ddata = dy if reduction == "add" else e.op(node.op_type, [dy, idx, e.zeros_like(updates)], **extra)
    if wants[2]:
        dupdates = e.op("GatherElements" if extra else "GatherND", [dy, idx], **extra)
    return [ddata, None, dupdates]


@rule("CumSum", note="dy summed the other way along the axis")
def _cumsum(e, node, dys, wants):
    return [
        e.op(
            "CumSum",
            [_dy(dys, e, node), node.input[1]],
            exclusive=int(attr(node, "exclusive", 0)),
            reverse=1 - int(attr(node, "reverse", 0)),
        ),
        None,
    ]


@rule("ReverseSequence", note="dy reversed back with the same lengths (the reversal undoes itself)")
def _reverse_sequence(e, node, dys, wants):
    axes = {"batch_axis": int(attr(node, "batch_axis", 1)), "time_axis": int(attr(node, "time_axis", 0))}
    return [e.op("ReverseSequence", [_dy(dys, e, node), node.input[1]], **axes), None]


@rule("Trilu", note="dy with the same triangle kept")
def _trilu(e, node, dys, wants):
    inputs = [_dy(dys, e, node), *node.input[1:]]
    return [e.op("Trilu", inputs, upper=int(attr(node, "upper", 1))), None][: len(node.input)]


@rule(
    "DepthToSpace",
    "SpaceToDepth",
    note="dy moved back (SpaceToDepth and DepthToSpace in DCR order undo each "
    "other; CRD through Reshape and Transpose)",
)
def _depth_space(e, node, dys, wants):
    x, dy = node.input[0], _dy(dys, e, node)
    b = int(attr(node, "blocksize"))
    mode = attr(node, "mode", b"DCR")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if node.op_type == "SpaceToDepth":
        return [e.op("DepthToSpace", [dy], blocksize=b, mode="DCR")]
    if mode == "DCR":
        return [e.op("SpaceToDepth", [dy], blocksize=b)]
    shape = e.shape(x)  # CRD: y[n, c, h*b+i, w*b+j] = x[n, c*b*b + i*b + j, h, w]
    if shape is None or not all(isinstance(d, int) for d in shape[1:]):
        raise UnsupportedOpError(node.op_type, node.name, "in CRD mode needs static channel and spatial sizes")
    _, c, h, w = shape
    six = e.op("Reshape", [dy, e.ints([-1, c // (b * b), h, b, w, b])])
    return [e.op("Reshape", [e.op("Transpose", [six], perm=[0, 1, 3, 5, 2, 4]), e.ints([-1, c, h, w])])]


# ---------------------------------------------------------------------------- transposed convolution and resizing


@rule(
    "ConvTranspose",
    note="dx: Conv of dy with the same weight; dw: Conv of dy and x with batch and channels swapped "
    "(grouped: one Conv with the groups); db: sum",
)
def _conv_transpose(e, node, dys, wants):
    x, w = node.input[0], node.input[1]
    y, dy = node.output[0], _dy(dys, e, node)
    xshape, wshape, yshape = e.shape(x), e.shape(w), e.shape(y)
    static = [s is not None and all(isinstance(d, int) for d in s[1:]) for s in (xshape, wshape, yshape)]
    if not all(static) or not isinstance(wshape[0], int):
        raise UnsupportedOpError(
            node.op_type, node.name, "needs static channel and spatial sizes and a weight of static shape"
        )
    auto = attr(node, "auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto not in ("NOTSET", "VALID") or attr(node, "output_shape") is not None:
        raise UnsupportedOpError(
            node.op_type, node.name, "is differentiated with explicit pads only (no auto_pad or output_shape)"
        )
    kernel = [int(d) for d in wshape[2:]]
    nd = len(kernel)
    group = int(attr(node, "group", 1))
    strides = list(attr(node, "strides", [1] * nd))
    dil = list(attr(node, "dilations", [1] * nd))
    pads = list(attr(node, "pads", [0] * (2 * nd))) if auto == "NOTSET" else [0] * (2 * nd)
    in_dims = [int(d) for d in xshape[2:]]
    c_out_group = int(wshape[1])
    grads: list[str | None] = [None] * len(node.input)
    if wants[0]:  # ConvTranspose is the adjoint of Conv with the same attributes: dx = Conv(dy, w)
        dx = e.op("Conv", [dy, w], strides=strides, pads=pads, dilations=dil, group=group)
        grads[0] = _crop_to(e, dx, in_dims)
    if wants[1]:
        # dw[ci, co, k] = sum over n, i of x[n, ci, i] * dy[n, co, i*s + k*d - pad]: a Conv of dy (channels as the
        # batch) with x (batch as the channels), the groups' blocks of dy's channels side by side
        n_dims = list(range(2, 2 + nd))
        dyg = e.op("Reshape", [dy, e.ints([0, group, c_out_group, *[int(d) for d in yshape[2:]]])])
        dyt = e.op(
            "Reshape",
            [
                e.op("Transpose", [dyg], perm=[2, 1, 0, *[d + 1 for d in n_dims]]),
                e.ints([c_out_group, -1, *[int(d) for d in yshape[2:]]]),
            ],
        )  # [Cout/g, g*N, ...]
        xt = e.op("Transpose", [x], perm=[1, 0, *n_dims])  # [Cin, N, ...]
        full = e.op("Conv", [dyt, xt], strides=dil, dilations=strides, pads=pads, group=group)  # [Cout/g, Cin, k' ...]
        trimmed = e.op("Slice", [full, e.ints([0] * nd), e.ints(kernel), e.ints(n_dims)])
        grads[1] = e.op("Transpose", [trimmed], perm=[1, 0, *n_dims])
    if len(node.input) > 2 and node.input[2] and wants[2]:
        grads[2] = e.reduce("ReduceSum", dy, [0, *range(2, 2 + nd)], keepdims=False)
    return grads


def _crop_to(e: Emitter, t: str, dims: list[int]) -> str:
    """``t`` [N, C, spatial...] cut to the spatial ``dims`` where it is longer (output_padding beyond the strides)."""
    shape = e.shape(t)
    if shape is not None and [d for d in shape[2:]] == dims:
        return t
    nd = len(dims)
    return e.op("Slice", [t, e.ints([0] * nd), e.ints(dims), e.ints(list(range(2, 2 + nd)))])


@rule(
    "Resize",
    note="dy contracted with each resized axis's interpolation weights (any separable mode: nearest, "
    "linear, cubic; static sizes)",
)
def _resize(e, node, dys, wants):
    x, y, dy = node.input[0], node.output[0], _dy(dys, e, node)
    xshape, yshape = e.shape(x), e.shape(y)
    if xshape is None or yshape is None or len(xshape) != len(yshape):
        raise UnsupportedOpError(node.op_type, node.name, "needs input and output of known rank")
    rank = len(xshape)
    transform = attr(node, "coordinate_transformation_mode", b"half_pixel")
    transform = transform.decode() if isinstance(transform, bytes) else transform
    policy = attr(node, "keep_aspect_ratio_policy", b"stretch")
    policy = policy.decode() if isinstance(policy, bytes) else policy
    if transform == "tf_crop_and_resize" or policy != "stretch":
        raise UnsupportedOpError(
            node.op_type, node.name, "is differentiated without tf_crop_and_resize or a keep_aspect_ratio_policy"
        )
    axes = [int(a) + rank if int(a) < 0 else int(a) for a in attr(node, "axes", list(range(rank)))]
    scales = _constant_floats(e, node, 2) if e.opset >= 11 else None
    g = dy
    for k, axis in enumerate(axes):
        n, m = xshape[axis], yshape[axis]
        scale = scales[k] if scales else None
        if n == m and scale in (None, 1.0):
            continue
        if not isinstance(n, int) or not isinstance(m, int):
            raise UnsupportedOpError(node.op_type, node.name, f"needs static sizes of the resized axis {axis}")
        weights = _resize_weights(node, e.opset, n, m, scale)  # [n, m]: x[i]'s share of y[j]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(e.elem_type(x))
        if axis == rank - 2:
            g = e.op("MatMul", [e.const(weights.astype(dtype), "resize_weights"), g])
        else:
            back = e.const(np.ascontiguousarray(weights.T).astype(dtype), "resize_weights")
            if axis == rank - 1:
                g = e.op("MatMul", [g, back])
            else:
                perm = [*range(axis), *range(axis + 1, rank), axis]
                moved = e.op("MatMul", [e.op("Transpose", [g], perm=perm), back])
                g = e.op("Transpose", [moved], perm=[*range(axis), rank - 1, *range(axis, rank - 1)])
    return [g] + [None] * (len(node.input) - 1)


def _constant_floats(e: Emitter, node: onnx.NodeProto, index: int) -> list[float] | None:
    if len(node.input) <= index or not node.input[index]:
        return None
    value = e.value(node.input[index])
    if value is None:
        shape = e.shape(node.input[index])
        if shape is not None and shape[:1] == (0,):
            return None
        raise UnsupportedOpError(node.op_type, node.name, "needs constant scales")
    return [float(v) for v in np.asarray(value).reshape(-1)] or None


def _resize_weights(node: onnx.NodeProto, opset: int, n: int, m: int, scale: float | None) -> np.ndarray:
    """The [n, m] matrix of one resized axis: the node's own attributes applied by onnxruntime (the
    runtime that trains the plan) to the identity along the last axis, so that every mode's rounding
    is the kernel's (onnx's reference implementation differs from it for an output of length 1)."""
    import onnxruntime as ort

    kept = [a for a in node.attribute if a.name not in ("axes", "keep_aspect_ratio_policy")]
    eye = np.eye(n, dtype=np.float32).reshape(1, 1, n, n)
    if scale is not None:
        extra = [onnx.numpy_helper.from_array(np.array([1.0, 1.0, 1.0, scale], dtype=np.float32), "scales")]
        one = onnx.helper.make_node("Resize", ["x", "", "scales"], ["y"])
    else:
        extra = [onnx.numpy_helper.from_array(np.array([1, 1, n, m], dtype=np.int64), "sizes")]
        one = onnx.helper.make_node("Resize", ["x", "", "", "sizes"], ["y"])
    one.attribute.extend(kept)
    graph = onnx.helper.make_graph(
        [one],
        "resize_weights",
        [onnx.helper.make_tensor_value_info("x", TensorProto.FLOAT, eye.shape)],
        [onnx.helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=extra,
    )
    opsets = [onnx.helper.make_opsetid("", max(opset, 13))]
    model = onnx.helper.make_model(graph, opset_imports=opsets, ir_version=onnx.helper.find_min_ir_version_for(opsets))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    (weights,) = session.run(None, {"x": eye})
    if weights.shape != (1, 1, n, m):
        raise UnsupportedOpError(
            node.op_type, node.name, f"resizes an axis of {n} to {m}, which its scale does not give"
        )
    return np.asarray(weights[0, 0], dtype=np.float64)


# ---------------------------------------------------------------------------- Einsum


def _einsum_terms(e: Emitter, node: onnx.NodeProto) -> tuple[list[str], str]:
    """The operands' subscripts and the output's, each as a string of letters with the ellipsis
    written out in letters no term uses (the operands' ranks from shape inference)."""
    equation = attr(node, "equation")
    equation = (equation.decode() if isinstance(equation, bytes) else equation).replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    terms = lhs.split(",")
    free = [c for c in "ZYXWVUTSRQPONMLKJIHGFEDCBA" if c not in equation]
    widths = []
    for term, x in zip(terms, node.input):
        rank = e.rank(x)
        if "..." in term and rank is None:
            raise UnsupportedOpError(node.op_type, node.name, "needs operands of known rank for an ellipsis")
        widths.append(rank - len(term.replace("...", "")) if "..." in term and rank is not None else 0)
    width = max(widths, default=0)
    ellipsis = "".join(free[:width])
    if any(w not in (0, width) for w, t in zip(widths, terms) if "..." in t):
        raise UnsupportedOpError(node.op_type, node.name, "is differentiated with ellipses of one width only")
    terms = [t.replace("...", ellipsis) for t in terms]
    if "->" not in equation:  # implicit output: the letters seen once, in alphabetical order
        letters = "".join(terms)
        rhs = ellipsis + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ellipsis))
    else:
        rhs = rhs.replace("...", ellipsis)
    return terms, rhs


@rule(
    "Einsum",
    note="each operand's gradient is the Einsum of dy with the other operands (letters of that operand "
    "alone broadcast back)",
)
def _einsum(e, node, dys, wants):
    terms, rhs = _einsum_terms(e, node)
    dy = _dy(dys, e, node)
    grads: list[str | None] = []
    for k, (term, x) in enumerate(zip(terms, node.input)):
        if not wants[k]:
            grads.append(None)
            continue
        if len(set(term)) != len(term):
            raise UnsupportedOpError(
                node.op_type, node.name, f"repeats a letter in {term!r} (a diagonal); not differentiated"
            )
        others = [(t, i) for j, (t, i) in enumerate(zip(terms, node.input)) if j != k]
        seen = set(rhs).union(*[set(t) for t, _ in others])
        kept = "".join(c for c in term if c in seen)
        equation = ",".join([rhs, *[t for t, _ in others]]) + "->" + kept
        g = e.op("Einsum", [dy, *[i for _, i in others]], equation=equation)
        if kept != term:  # letters summed over in this operand alone: their gradient is dy broadcast along them
            g = e.op("Expand", [e.unsqueeze(g, [p for p, c in enumerate(term) if c not in seen]), e.shape_of(x)])
        grads.append(g)
    return grads


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
    end = len(shape) if shape is not None else np.iinfo(np.int64).max  # an unknown rank: the Slice clamps
    tail = e.op("Slice", [e.op("Shape", [t]), e.ints([-1]), e.ints([end])])
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
    """The number of elements of ``x`` over ``axes`` (``y``: x reduced over them), computed once per
    graph for the same dimensions when each is a number or a symbol of the graph's inputs."""
    shape = e.shape(x)
    key = None
    if shape is not None:
        dims = [shape[a] for a in (axes if axes is not None else range(len(shape)))]
        known = [d for d in dims if isinstance(d, int)]
        if len(known) == len(dims):
            return e.scalar(float(np.prod(known)), x)
        if all(isinstance(d, int) or (isinstance(d, str) and d and not d.startswith("unk__")) for d in dims):
            key = ("count", tuple(dims), e.elem_type(x))
    if key is not None and key in e.shared:
        return e.shared[key]
    elem = e.elem_type(x)
    n = e.op("Div", [e.op("Cast", [e.op("Size", [x])], to=elem), e.op("Cast", [e.op("Size", [y])], to=elem)])
    if key is not None:
        e.shared[key] = n
    return n


@rule(
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceSumSquare",
    "ReduceL2",
    "ReduceLogSumExp",
    note="dy broadcast back (mean: /count; max/min: to the arg-extrema, shared on ties; sum of squares: 2x*dy)",
)
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


@rule(
    "Reshape",
    "Flatten",
    "Squeeze",
    "Unsqueeze",
    note="dy reshaped to x (Squeeze/Unsqueeze: the inverse op on the same axes)",
)
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
        split = e.op(
            "Concat",
            [e.op("Slice", [e.op("Shape", [x]), e.ints([axis]), e.ints([axis + 1])]) for x in node.input],
            axis=0,
        )
    outs = e.op_multi("Split", [dy, split], [e.fresh("split") for _ in node.input], axis=axis)
    return list(outs)


@rule("Split", note="dys concatenated (zeros for outputs without a gradient)")
def _split(e, node, dys, wants):
    axis = int(attr(node, "axis", 0))
    parts = [dys[i] if dys[i] is not None else e.zeros_like(o) for i, o in enumerate(node.output)]
    return [e.op("Concat", parts, axis=axis)] + [None] * (len(node.input) - 1)


@rule(
    "Slice",
    note="dy padded back with zeros (strided and reversed slices spread back first; static sliced dims, "
    "or from a start to the end); Slices that cut one tensor into consecutive pieces are rewritten as one Split "
    "before differentiating",
)
def _slice(e, node, dys, wants):
    x, dy = node.input[0], _dy(dys, e, node)
    shape = e.shape(x)
    values = [e.value(i) if i else None for i in node.input[1:]]
    if shape is None or any(v is None for v, name in zip(values, node.input[1:]) if name):
        raise UnsupportedOpError(
            node.op_type, node.name, "needs constant starts/ends/axes/steps and an input of known rank"
        )
    starts, ends = [int(v) for v in values[0].reshape(-1)], [int(v) for v in values[1].reshape(-1)]
    axes = (
        [int(v) for v in values[2].reshape(-1)]
        if len(values) > 2 and values[2] is not None
        else list(range(len(starts)))
    )
    steps = [int(v) for v in values[3].reshape(-1)] if len(values) > 3 and values[3] is not None else [1] * len(starts)
    rank = len(shape)
    pads = [0] * (2 * rank)
    g = dy
    for s, t, a, step in zip(starts, ends, axes, steps):
        a = a + rank if a < 0 else a
        dim = shape[a]
        if not isinstance(dim, int):
            if step != 1 or s < 0 or t < _TO_THE_END:
                raise UnsupportedOpError(
                    node.op_type,
                    node.name,
                    "is differentiated on axes of static size only, or from a start to the end (a batch axis)",
                )
            pads[a] = s  # x[s:] of an axis whose size is known at run time only (the dynamo exporter's x[:, 0] slices
            continue  # the batch axis whole)
        first, count, stride = slice_span(s, t, step, dim)
        if count == 0:
            return [e.zeros_like(x)] + [None] * (len(node.input) - 1)
        if step < 0:  # the selected rows in ascending order
            g = e.op("Slice", [g, e.ints([-1]), e.ints([-count - 1]), e.ints([a]), e.ints([-1])])
        if stride > 1:
            g = _unstride(e, g, a, count, stride, rank)
        pads[a], pads[rank + a] = first, dim - first - count * stride
    return [e.op("Pad", [g, e.ints(pads)])] + [None] * (len(node.input) - 1)


_TO_THE_END = 2**31 - 1  # an end at least this large takes an axis to its end, as exporters write x[s:]


def slice_span(start: int, end: int, step: int, dim: int) -> tuple[int, int, int]:
    """(the lowest index a Slice takes on an axis of ``dim``, how many it takes, their spacing), with
    ONNX's clamping of starts and ends."""
    if step > 0:
        s = min(max(start + dim if start < 0 else start, 0), dim)
        t = min(max(end + dim if end < 0 else end, 0), dim)
        count = max(0, -(-(t - s) // step))
        return s, count, step
    s = min(max(start + dim if start < 0 else start, 0), dim - 1)
    t = min(max(end + dim if end < 0 else end, -1), dim - 1)
    count = max(0, -(-(s - t) // -step))
    return s + (count - 1) * step, count, -step


def _unstride(e: Emitter, g: str, axis: int, count: int, stride: int, rank: int) -> str:
    """``g``'s ``count`` rows along ``axis`` spread ``stride`` apart with zeros between (and after the last)."""
    padded = e.op(
        "Pad", [e.unsqueeze(g, [axis + 1]), e.ints([0] * (rank + axis + 2) + [stride - 1] + [0] * (rank - axis - 1))]
    )
    shape = e.shape_of(g)
    parts = [e.ints([count * stride])]
    if axis:
        parts.insert(0, e.op("Slice", [shape, e.ints([0]), e.ints([axis])]))
    if axis < rank - 1:
        parts.append(e.op("Slice", [shape, e.ints([axis + 1]), e.ints([rank])]))
    return e.op("Reshape", [padded, e.op("Concat", parts, axis=0) if len(parts) > 1 else parts[0]])


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
    if isinstance(shape[axis], int):
        size: int | str = int(shape[axis])
    elif e.opset >= 16:  # read at run time (the dynamo exporter's unoptimized graphs leave sizes symbolic)
        size = e.op("Reshape", [e.op("Slice", [e.op("Shape", [data]), e.ints([axis]), e.ints([axis + 1])]), e.ints([])])
    else:
        raise UnsupportedOpError(node.op_type, node.name, "needs a static size of the gathered axis below opset 16")
    if axis:  # dy is data[:axis] + idx + data[axis+1:]: bring the index dimensions to the front
        front = [*range(axis, axis + irank), *range(axis), *range(axis + irank, rank + irank - 1)]
        dy = e.op("Transpose", [dy], perm=front)
        moved = e.op("Transpose", [data], perm=[axis, *range(axis), *range(axis + 1, rank)])
        e.record(moved, e.elem_type(data), (shape[axis], *shape[:axis], *shape[axis + 1 :]))
        grad = _gather_rows(e, moved, idx, dy, size)
        back = [*range(1, axis + 1), 0, *range(axis + 1, rank)]
        return [e.op("Transpose", [grad], perm=back), None]
    return [_gather_rows(e, data, idx, dy, size), None]


def _gather_rows(e: Emitter, data: str, idx: str, dy: str, rows: int | str) -> str:
    """The gradient of Gather(data, idx, axis=0): the rows of dy added into zeros at idx (``rows``:
    data's first dimension, or a tensor holding it)."""
    i64 = e.op("Cast", [idx], to=TensorProto.INT64)
    zero = e.const(np.array(0, dtype=np.int64), "zero")
    count = e.const(np.array(rows, dtype=np.int64), "rows") if isinstance(rows, int) else rows
    fixed = _where(e, e.op("Less", [i64, zero]), e.op("Add", [i64, count]), i64)
    if e.opset >= 16:
        return e.op("ScatterND", [e.zeros_like(data), e.unsqueeze(fixed, [-1]), dy], reduction="add")
    # one-hot product: rows of dy summed per index (below opset 16 the rule refuses a dynamic size)
    rank = e.rank(data)
    assert isinstance(rows, int) and rank is not None, "Gather's rule checks the rank and the size below opset 16"
    flat = e.op("Reshape", [fixed, e.ints([-1, 1])])
    onehot = e.op("Cast", [e.op("Equal", [flat, e.ints(list(range(rows)))])], to=e.elem_type(data))
    rest = e.op("Slice", [e.shape_of(data), e.ints([1]), e.ints([rank])])
    dy2 = e.op("Reshape", [dy, e.op("Concat", [e.ints([-1]), e.op("ReduceProd", [rest], keepdims=1)], axis=0)])
    return e.reshape_like(e.op("Gemm", [onehot, dy2], transA=1), data)


# ---------------------------------------------------------------------------- convolution and pooling


def conv_geometry(
    e: Emitter, node: onnx.NodeProto, x: str, kernel: Sequence[int]
) -> tuple[list[int], list[int], list[int], list[int]]:
    """(strides, pads [begin..., end...], dilations, input spatial dims) with auto_pad resolved."""
    shape = e.shape(x)
    nd = len(kernel)
    dims = [d for d in shape[2:] if isinstance(d, int)] if shape is not None else []
    if shape is None or len(dims) != len(shape) - 2:
        raise UnsupportedOpError(node.op_type, node.name, "needs static spatial dimensions to differentiate")
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
            raise UnsupportedOpError(
                node.op_type, node.name, "has a window layout (ceil_mode?) whose gradient is not covered"
            )
        extra.append(gap)
    return extra


@rule(
    "Conv",
    note="dx: ConvTranspose of dy (grouped as the Conv); dw: Conv of x and dy with batch and channels swapped "
    "(per group), or per kernel offset a Gemm (dense) or a product summed over positions (depthwise); db: sum",
)
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
    out_dims = (
        [int(d) for d in yshape[2:]] if yshape is not None and all(isinstance(d, int) for d in yshape[2:]) else None
    )
    if out_dims is None:
        raise UnsupportedOpError(node.op_type, node.name, "needs an output of static spatial size")
    c_out, c_in_group = int(wshape[0]), int(wshape[1])
    grads: list[str | None] = [None] * len(node.input)
    if wants[0]:
        grads[0] = e.op(
            "ConvTranspose",
            [dy, w],
            strides=strides,
            pads=pads,
            dilations=dil,
            group=group,
            output_padding=_output_padding(node, dims, out_dims, kernel, strides, pads, dil),
        )
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
    if (
        list(attr(node, "strides", [1, 1])) != kernel
        or any(attr(node, "pads", [0] * 4))
        or any(d != 1 for d in attr(node, "dilations", [1, 1]))
        or int(attr(node, "ceil_mode", 0))
    ):
        return None
    auto = attr(node, "auto_pad", b"NOTSET")
    if (auto.decode() if isinstance(auto, bytes) else auto) not in ("NOTSET", "VALID"):
        return None
    if shape[2] % kernel[0] or shape[3] % kernel[1]:
        return None
    return kernel[0], kernel[1]


def _conv_weight_grad_per_offset(
    e: Emitter, x: str, dy: str, kernel, strides, pads, dil, out_dims, c_out: int, c_in: int
) -> str:
    """dW[:, :, i, j] = dy @ (the input window at offset (i, j))^T, one Gemm per kernel offset over
    all examples and positions: [Cout, OH*OW*N] x [OH*OW*N, Cin]. With 8 or more input channels
    this beats the Conv with batch and channels swapped (0.34 against 0.54 ms of CPU for the second
    Conv of the 28x28 benchmark CNN); with one input channel the Gemms degenerate to
    matrix-vector products and the Conv wins (0.26 against 0.66 ms). The input is laid out
    channels last ([H, W, N, Cin]) so that each window is a Slice of whole rows: 21 against 79 us
    a window for ResNet-18's 64-channel 8x8 layers as [Cin, N, H, W] (onnxruntime 1.32, AVX-512)."""
    xt = e.op("Transpose", [x], perm=[2, 3, 0, 1])  # [H, W, N, Cin]
    if any(pads):
        xt = e.op("Pad", [xt, e.ints([pads[0], pads[1], 0, 0, pads[2], pads[3], 0, 0])])
    rows = e.op("Reshape", [e.op("Transpose", [dy], perm=[1, 2, 3, 0]), e.ints([c_out, -1])])  # [Cout, OH*OW*N]
    columns = []
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            start = [i * dil[0], j * dil[1]]
            end = [start[0] + strides[0] * (out_dims[0] - 1) + 1, start[1] + strides[1] * (out_dims[1] - 1) + 1]
            window = e.op("Slice", [xt, e.ints(start), e.ints(end), e.ints([0, 1]), e.ints(strides)])
            product = e.op("Gemm", [rows, e.op("Reshape", [window, e.ints([-1, c_in])])])  # [Cout, Cin]
            columns.append(e.unsqueeze(product, [2]))
    return e.op("Reshape", [e.op("Concat", columns, axis=2), e.ints([c_out, c_in, *kernel])])


def _swapped_weight_grad(
    e: Emitter, x: str, dy: str, kernel, strides, pads, dil, dims, group: int, c_out: int, c_in_group: int
) -> str:
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


def _depthwise_weight_grad(
    e: Emitter, x: str, dy: str, kernel, strides, pads, dil, dims, out_dims, channels: int, c_out: int
) -> str:
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
        if not all(
            any(pads[a] <= f + s * t < pads[a] + dims[a] for t in range(o))
            for a, (f, s, o) in enumerate(zip(firsts, strides, out_dims))
        ):
            rows.append(
                e.const(np.zeros((1, c_out), dtype=helper_dtype(e, dy)), "zero_tap")
            )  # the window is all padding
            continue
        ends = [f + s * (o - 1) + 1 for f, s, o in zip(firsts, strides, out_dims)]
        window = e.op("Slice", [xt, e.ints(firsts), e.ints(ends), e.ints(list(range(nd))), e.ints(strides)])
        window = e.op("Reshape", [window, e.ints([-1, channels, 1] if m > 1 else [-1, channels])])
        summed = e.reduce("ReduceSum", e.op("Mul", [window, dyt]), [0], keepdims=True)
        rows.append(e.op("Reshape", [summed, e.ints([1, c_out])]) if m > 1 else summed)
    taps = e.op("Concat", rows, axis=0) if len(rows) > 1 else rows[0]  # [k..., Cout]
    return e.op("Reshape", [e.op("Transpose", [taps], perm=[1, 0]), e.ints([c_out, 1, *kernel])])


@dataclass(frozen=True)
class TapSum:
    """A Conv written as a sum over its kernel offsets (:mod:`.forward`'s taps, channels last:
    ``[spatial..., N, C]``): each term a window of one tensor times the offset's weights, a Gemm
    (dense: the window's rows by the [Cout, Cin] weight, transposed) or a Mul (depthwise: by a
    [1, C] weight). Term k's output position j reads input position ``firsts[k] + strides * j``."""

    target: str  # where the input gradient goes: the windows' tensor, or the input of the Pad that made it
    firsts: tuple[tuple[int, ...], ...]  # per term, in ``target``'s positions (negative: in the padding)
    strides: tuple[int, ...]
    out_dims: tuple[int, ...]
    dims: tuple[int, ...]  # the target's spatial sizes
    weights: tuple[str, ...]
    terms: tuple[str, ...]  # the terms' outputs, whose window input takes no gradient of its own
    dense: bool
    channels: int  # of dy: Cout (dense) or C (depthwise)
    c_in: int  # of the windows


def conv_tap_sums(nodes: Sequence[onnx.NodeProto], e: Emitter) -> dict[str, TapSum]:
    """The sums of :class:`TapSum` terms among ``nodes`` (output -> the pattern) whose input gradient,
    gathered per input position (:func:`tap_sum_input_gradient`), multiplies no more rows than the
    windows' own gradients: windows as large as the input (a padded Conv), or with strides, an input
    whose sizes they divide and whose every phase some offset reads."""
    producers = {o: n for n in nodes for o in n.output if o}

    def const(name: str) -> list[int] | None:
        v = e.value(name) if name else None
        return None if v is None else [int(i) for i in v.reshape(-1)]

    def window(name: str) -> tuple[str, list[int], list[int], list[int]] | None:
        """(the tensor of [spatial..., N, C] it is a window of, its first position, its size, the
        strides) per spatial axis, for a Slice of whole rows, or of the axes split into (blocks,
        stride) by a Reshape (a strided window: one phase of a block range)."""
        node = producers.get(name)
        if node is None or node.op_type != "Slice" or len(node.input) < 4:
            return None
        starts, ends, axes = const(node.input[1]), const(node.input[2]), const(node.input[3])
        steps = const(node.input[4]) if len(node.input) > 4 and node.input[4] else None
        if starts is None or ends is None or axes != list(range(len(starts))) or steps not in (None, [1] * len(starts)):
            return None
        sizes = [b - a for a, b in zip(starts, ends)]
        split = producers.get(node.input[0])
        shape = const(split.input[1]) if split is not None and split.op_type == "Reshape" else None
        source = e.shape(split.input[0]) if split is not None else None
        nd = len(starts) // 2
        if shape is None or source is None or len(source) != nd + 2 or len(shape) != 2 * nd + 2:
            return node.input[0], starts, sizes, [1] * len(starts)
        strides = shape[1 : 2 * nd : 2]
        if (
            shape[-1] != source[-1]
            or shape[-2] not in (-1, source[-2])
            or shape[0 : 2 * nd : 2] != [d // s if isinstance(d, int) else -2 for d, s in zip(source, strides)]
            or any(sizes[1::2] != [1] * nd or d % s for d, s in zip(source[:nd], strides) if isinstance(d, int))
        ):
            return None
        assert split is not None
        firsts = [b * s + p for b, p, s in zip(starts[0::2], starts[1::2], strides)]
        return split.input[0], firsts, sizes[0::2], strides

    found: dict[str, TapSum] = {}
    for node in nodes:
        if node.op_type != "Sum" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        terms = [producers.get(t) for t in node.input]
        dense = terms[0] is not None and terms[0].op_type == "Gemm"
        windows: list[tuple[str, list[int], list[int], list[int]] | None] = []
        weights: list[str] = []
        for t in terms:
            if t is None:
                windows.append(None)
            elif dense and t.op_type == "Gemm" and len(t.input) == 2 and not int(attr(t, "transA", 0)):
                ok = int(attr(t, "transB", 0)) == 1 and float(attr(t, "alpha", 1.0)) == 1.0
                rows = producers.get(t.input[0])
                shape = const(rows.input[1]) if ok and rows is not None and rows.op_type == "Reshape" else None
                windows.append(
                    window(rows.input[0]) if rows is not None and shape is not None and len(shape) == 2 else None
                )
            elif not dense and t.op_type == "Mul":
                windows.append(window(t.input[0]))
            else:
                windows.append(None)
            weights.append(t.input[1] if t is not None else "")
        known = [w for w in windows if w is not None]
        if len(known) < len(windows) or len({(w[0], tuple(w[2]), tuple(w[3])) for w in known}) != 1:
            continue
        source, _, out_dims, strides = known[0]
        nd = len(out_dims)
        xshape, wshape = e.shape(source), e.shape(weights[0])
        if xshape is None or wshape is None or len(xshape) != nd + 2 or not all(isinstance(d, int) for d in wshape):
            continue
        channels, c_in = (wshape[0], wshape[1]) if dense else (xshape[-1], xshape[-1])
        if not isinstance(channels, int) or not isinstance(c_in, int) or any(e.shape(w) != wshape for w in weights):
            continue
        if (dense and (len(wshape) != 2 or c_in != xshape[-1])) or (
            not dense and (len(wshape) > 2 or wshape[-1] != channels or any(d != 1 for d in wshape[:-1]))
        ):
            continue  # a depthwise term scales each channel alike at every position
        target, before = source, [0] * nd
        pad = producers.get(source)
        pads = const(pad.input[1]) if pad is not None and pad.op_type == "Pad" and len(pad.input) > 1 else None
        if (
            pad is not None
            and pads is not None
            and len(pads) == 2 * (nd + 2)
            and attr(pad, "mode", b"constant") in (b"constant", "constant")
            and (len(pad.input) < 3 or not pad.input[2] or _zero(e.value(pad.input[2])))
            and len(pad.input) < 4
            and not any(pads[nd : nd + 2] + pads[2 * nd + 2 :])
            and min(pads) >= 0
        ):
            target, before = pad.input[0], pads[:nd]
        tshape = e.shape(target)
        dims = [d for d in tshape[:nd] if isinstance(d, int)] if tshape is not None and len(tshape) == nd + 2 else []
        if len(dims) != nd or any(d % s for d, s in zip(dims, strides)):
            continue
        firsts = [tuple(f - b for f, b in zip(w[1], before)) for w in known]
        phases = {tuple(f % s for f, s in zip(first, strides)) for first in firsts}
        if len(phases) < int(np.prod(strides)) or np.prod(dims) > np.prod(out_dims) * np.prod(strides):
            continue
        found[node.output[0]] = TapSum(
            target,
            tuple(firsts),
            tuple(strides),
            tuple(out_dims),
            tuple(dims),
            tuple(weights),
            tuple(node.input),
            dense,
            channels,
            c_in,
        )
    return found


def _zero(value: np.ndarray | None) -> bool:
    return value is not None and not np.any(value)


def _phases(
    firsts: Sequence[Sequence[int]], strides: Sequence[int]
) -> dict[tuple[int, ...], list[tuple[int, tuple[int, ...]]]]:
    """The terms of a gathered input gradient by the phase of the input positions they reach: input
    position ``m * stride + phase`` takes term k's output position m - c_k (term k reads input
    position ``first_k + stride * j`` at its output position j). Phase -> [(k, c_k)]."""
    phases: dict[tuple[int, ...], list[tuple[int, tuple[int, ...]]]] = {}
    for k, first in enumerate(firsts):
        phase = tuple(f % s for f, s in zip(first, strides))
        phases.setdefault(phase, []).append((k, tuple((f - p) // s for f, p, s in zip(first, phase, strides))))
    return phases


def _interleaved(e: Emitter, sums: list[str], strides: Sequence[int], dims: Sequence[int], channels: int) -> str:
    """The phases' gradients (``[blocks..., N, C]`` each, phases in row-major order) as one
    ``[dims..., N, C]``: one Concat and a Transpose that moves whole rows of N*C values."""
    nd = len(dims)
    if len(sums) == 1:
        return e.op("Reshape", [sums[0], e.ints([*dims, -1, channels])])
    blocks = [d // s for d, s in zip(dims, strides)]
    total = e.op("Reshape", [e.op("Concat", sums, axis=0), e.ints([*strides, *blocks, -1, channels])])
    total = e.op("Transpose", [total], perm=[*(i for a in range(nd) for i in (nd + a, a)), 2 * nd, 2 * nd + 1])
    return e.op("Reshape", [total, e.ints([*dims, -1, channels])])


def tap_sum_input_gradient(e: Emitter, t: TapSum, dy: str) -> str:
    """The gradient of ``t.target``, gathered per input position (:func:`_phases`): each term is a
    window of dy padded once, times the offset's weights, and a phase's gradient is their sum; with
    strides the phases are interleaved. Padding each term's window gradient to the input's size and
    summing them did three times the passes over memory (ResNet-18's 4x4 and 2x2 layers)."""
    nd = len(t.out_dims)
    g = dy if not t.dense and t.strides == (1,) * nd else e.op("Reshape", [dy, e.ints([*t.out_dims, -1, t.channels])])
    blocks = [d // s for d, s in zip(t.dims, t.strides)]
    phases = _phases(t.firsts, t.strides)
    shifts = [c for group in phases.values() for _, c in group]
    low = [max(0, *(c[a] for c in shifts)) for a in range(nd)]
    high = [max(0, *(blocks[a] - t.out_dims[a] - c[a] for c in shifts)) for a in range(nd)]
    if any(low) or any(high):
        g = e.op("Pad", [g, e.ints([*low, 0, 0, *high, 0, 0])])
    padded = [low[a] + t.out_dims[a] + high[a] for a in range(nd)]
    sums = []
    for phase in np.ndindex(*t.strides):
        terms = []
        for k, shift in phases[tuple(phase)]:
            start = [low[a] - shift[a] for a in range(nd)]
            part = g
            if start != [0] * nd or blocks != padded:
                part = e.op(
                    "Slice", [g, e.ints(start), e.ints([f + b for f, b in zip(start, blocks)]), e.ints(list(range(nd)))]
                )
            if t.dense:
                terms.append(e.op("Gemm", [e.op("Reshape", [part, e.ints([-1, t.channels])]), t.weights[k]]))
            else:
                terms.append(e.op("Mul", [part, t.weights[k]]))
        sums.append(terms[0] if len(terms) == 1 else e.op("Sum", terms))
    if len(sums) == 1 and not t.dense:
        return sums[0]
    return _interleaved(e, sums, t.strides, t.dims, t.c_in)


@dataclass(frozen=True)
class PoolWindows:
    """A MaxPool whose gradient finds each window's first maximum itself (:func:`pool_windows`)."""

    kernel: list[int]
    strides: list[int]
    pads: list[int]
    dims: list[int]
    out_dims: list[int]
    channels: int


def pool_windows(e: Emitter, node: onnx.NodeProto) -> PoolWindows | None:
    """The geometry of a float MaxPool of static sizes whose windows overlap or leave gaps (not
    :func:`tiling_pool`'s), whose strides divide the input and whose kernel is at least its stride
    (every input position is in some window): its gradient compares each window's values with the
    output (:func:`_first_max_gradient`), as onnxruntime's MaxPool with Indices, 3.3 ms for
    ResNet-18's first pool, is ten times slower than without."""
    kernel = [int(k) for k in attr(node, "kernel_shape", [])]
    nd = len(kernel)
    shape, yshape = e.shape(node.input[0]), e.shape(node.output[0])
    if not nd or shape is None or yshape is None or len(shape) != nd + 2 or len(yshape) != nd + 2:
        return None
    dims, out_dims = shape[1:], yshape[2:]
    if not all(isinstance(d, int) for d in [*dims, *out_dims]) or e.elem_type(node.input[0]) not in (
        TensorProto.FLOAT,
        TensorProto.DOUBLE,
    ):
        return None
    auto = attr(node, "auto_pad", b"NOTSET")
    strides = [int(s) for s in attr(node, "strides", [1] * nd)]
    pads = [int(p) for p in attr(node, "pads", [0] * (2 * nd))]
    if (
        (auto.decode() if isinstance(auto, bytes) else auto) != "NOTSET"
        or int(attr(node, "ceil_mode", 0))
        or int(attr(node, "storage_order", 0))
        or any(int(d) != 1 for d in attr(node, "dilations", [1] * nd))
        or any(k < s or d % s for k, s, d in zip(kernel, strides, dims[1:]))  # type: ignore[operator]
    ):
        return None
    return PoolWindows(kernel, strides, pads, [int(d) for d in dims[1:]], [int(d) for d in out_dims], int(dims[0]))  # type: ignore[arg-type]


def _first_max_gradient(e: Emitter, node: onnx.NodeProto, p: PoolWindows, dy: str) -> str:
    """dy to each window's first maximum (in the window's row-major order, as the Indices count),
    channels last: the windows are Slices of the input padded with -inf (its axes split into
    (blocks, stride)), each compared with the output, less the positions an earlier offset took;
    the input's gradient is then gathered per position (:func:`_phases`) from the offsets' masked dy,
    each shifted by a Pad. 2.8 ms for ResNet-18's first pool (3x3, stride 2, on 16x16) against
    4.4 for MaxPool with Indices and its scatter (onnxruntime 1.32, one thread)."""
    x, y = node.input[0], node.output[0]
    nd = len(p.kernel)
    lengths = []
    for a in range(nd):
        need = p.kernel[a] + p.strides[a] * (p.out_dims[a] - 1)
        lengths.append(-(-max(need, p.dims[a] + p.pads[a]) // p.strides[a]) * p.strides[a])
    pad_end = [n - d - b for n, d, b in zip(lengths, p.dims, p.pads)]
    lowest = e.const(np.array(-np.inf, dtype=helper_dtype(e, x)), "minus_inf")
    xt = e.op("Transpose", [x], perm=[*range(2, 2 + nd), 0, 1])  # [spatial..., N, C]
    xt = e.op("Pad", [xt, e.ints([*p.pads[:nd], 0, 0, *pad_end, 0, 0]), lowest])
    split = [d for a in range(nd) for d in (lengths[a] // p.strides[a], p.strides[a])]
    xt = e.op("Reshape", [xt, e.ints([*split, -1, p.channels])])
    windowed = [d for o in p.out_dims for d in (o, 1)]
    yt = e.op("Reshape", [e.op("Transpose", [y], perm=[*range(2, 2 + nd), 0, 1]), e.ints([*windowed, -1, p.channels])])
    dyt = e.op(
        "Reshape", [e.op("Transpose", [dy], perm=[*range(2, 2 + nd), 0, 1]), e.ints([*p.out_dims, -1, p.channels])]
    )
    taken = None
    masked = []
    for offset in np.ndindex(*p.kernel):
        starts = [v for i, s in zip(offset, p.strides) for v in divmod(i, s)]
        ends = [v + w for v, w in zip(starts, windowed)]
        window = e.op("Slice", [xt, e.ints(starts), e.ints(ends), e.ints(list(range(2 * nd)))])
        hit = e.op("Equal", [window, yt])
        first = hit if taken is None else e.op("And", [hit, e.op("Not", [taken])])
        taken = hit if taken is None else e.op("Or", [taken, hit])
        mask = e.op("Reshape", [e.op("Cast", [first], to=e.elem_type(x)), e.ints([*p.out_dims, -1, p.channels])])
        masked.append(e.op("Mul", [mask, dyt]))
    blocks = [d // s for d, s in zip(p.dims, p.strides)]
    phases = _phases([[i - b for i, b in zip(offset, p.pads)] for offset in np.ndindex(*p.kernel)], p.strides)
    sums = []
    for phase in np.ndindex(*p.strides):
        terms = []
        for k, shift in phases[tuple(phase)]:  # the phase's position m takes masked[k] at m - shift
            shifted = masked[k]
            if list(shift) != [0] * nd or blocks != p.out_dims:
                ends = [b - o - c for b, o, c in zip(blocks, p.out_dims, shift)]
                shifted = e.op("Pad", [shifted, e.ints([*shift, 0, 0, *ends, 0, 0])])
            terms.append(shifted)
        sums.append(terms[0] if len(terms) == 1 else e.op("Sum", terms))
    dxt = _interleaved(e, sums, p.strides, p.dims, p.channels)
    return e.op("Transpose", [dxt], perm=[nd, nd + 1, *range(nd)])


def helper_dtype(e: Emitter, t: str):
    return onnx.helper.tensor_dtype_to_np_dtype(e.elem_type(t))


@rule(
    "MaxPool",
    note="windows that tile the input: dy to each window's first maximum (ArgMax over the window); "
    "overlapping windows, strides dividing the input: to each window's first position equal to the output "
    "(channels last); otherwise dy scattered-added to the Indices output",
)
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
            back = e.op(
                "DepthToSpace",
                [e.op("Reshape", [spread, e.ints([-1, k * c, h // kh, w // kw])])],
                blocksize=kh,
                mode="DCR",
            )
            return [back]
        six = e.op("Reshape", [spread, e.ints([-1, kh, kw, c, h // kh, w // kw])])
        return [e.op("Reshape", [e.op("Transpose", [six], perm=[0, 3, 4, 1, 5, 2]), e.ints([-1, c, h, w])])]
    windows = pool_windows(e, node) if len(node.output) < 2 or not node.output[1] else None
    if windows is not None:
        return [_first_max_gradient(e, node, windows, dy)]
    if len(node.output) < 2 or not node.output[1]:
        raise UnsupportedOpError(node.op_type, node.name, "needs its Indices output (training plans add it)")
    kernel = list(attr(node, "kernel_shape"))
    strides = list(attr(node, "strides", [1] * len(kernel)))
    overlapping = any(s < k for s, k in zip(strides, kernel)) or any(
        d != 1 for d in attr(node, "dilations", [1] * len(kernel))
    )
    flat_x = e.op("Reshape", [e.zeros_like(x), e.ints([-1])])
    flat_i = e.op("Reshape", [node.output[1], e.ints([-1])])
    flat_dy = e.op("Reshape", [dy, e.ints([-1])])
    if overlapping and e.opset < 16:
        raise UnsupportedOpError(
            node.op_type, node.name, "with overlapping windows is differentiated at opset 16 or later"
        )
    extra = {"reduction": "add"} if e.opset >= 16 else {}
    scattered = e.op("ScatterElements", [flat_x, flat_i, flat_dy], axis=0, **extra)
    return [e.reshape_like(scattered, x)]


@rule(
    "AveragePool",
    note="dy spread over each window: ConvTranspose with a constant kernel (ceil_mode's last windows "
    "too, their divisor as onnxruntime counts it)",
)
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
    k1 = e.const(np.ones((1, 1, *kernel), dtype=dtype), "k1")
    # ceil_mode: the last windows run past the end padding; counted as more end padding, cropped by ConvTranspose
    overhang = [
        max(0, (o - 1) * s + (k - 1) * d + 1 - (n + pads[i] + pads[nd + i]))
        for i, (o, s, k, d, n) in enumerate(zip(out_dims, strides, kernel, dil, dims))
    ]
    ends = [pads[nd + i] + overhang[i] for i in range(nd)]
    include_pad = int(attr(node, "count_include_pad", 0))
    if include_pad and any(overhang):
        # each window's divisor: the inputs and explicit pads it covers, not the overhang
        padded = [n + pads[i] + pads[nd + i] for i, n in enumerate(dims)]
        counts = e.op(
            "Conv",
            [e.const(np.ones((1, 1, *padded), dtype=dtype), "ones"), k1],
            strides=strides,
            pads=[0] * nd + overhang,
            dilations=dil,
        )
        scaled = e.op("Div", [dy, counts])
    elif include_pad or not any(pads[:nd] + ends):
        scaled = e.op("Div", [dy, e.scalar(float(np.prod(kernel)), y)])
    else:
        # each window's divisor: how many real (unpadded) inputs it covers
        counts = e.op(
            "Conv",
            [e.const(np.ones((1, 1, *dims), dtype=dtype), "ones"), k1],
            strides=strides,
            pads=pads[:nd] + ends,
            dilations=dil,
        )
        scaled = e.op("Div", [dy, counts])
    pads = pads[:nd] + ends
    extra = _output_padding(node, dims, out_dims, kernel, strides, pads, dil)
    return [
        e.op(
            "ConvTranspose",
            [scaled, ones],
            strides=strides,
            pads=pads,
            dilations=dil,
            group=channels,
            output_padding=extra,
        )
    ]


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
    "become state updated with momentum (the variance unbiased, n/(n-1), as torch); the gradient is taken "
    "at the output in closed form; evaluation keeps the op",
    "LayerNormalization": "rewritten into ReduceMean/Sub/Mul/Sqrt/Div before differentiating (opset >= 17)",
    "InstanceNormalization": "rewritten into ReduceMean/Sub/Mul/Sqrt/Div over the spatial axes before differentiating",
    "GroupNormalization": "rewritten into Reshape to the groups and ReduceMean/Sub/Mul/Sqrt/Div before differentiating "
    "(scale and bias per group before opset 21, per channel from 21)",
    "LRN": "rewritten into Mul/Reshape, a Conv of ones summing the squares over each window of channels, "
    "Pow and Div before differentiating (AlexNet's and GoogLeNet's local response normalization)",
    "Scan": "opset 9 and later, of the main graph (or brought into it by an unrolled Loop or Scan, or a chosen If "
    "branch), its scanned axes of a static length (not the batch): unrolled into copies of its body, each reading "
    "its position of the scan inputs by Slice (one Split in all) forwards or backwards, the scan outputs stacked by "
    "Unsqueeze and Concat along their axes in either order, before differentiating, at most 1,000 of them and "
    "200,000 nodes in the unrolled graph; opset 8's "
    "Scan (a batch axis of its own) and a Scan over the batch or a length of None are refused",
    "SequenceAt": "of a SplitToSequence at a constant position: rewritten as the Slice (and Squeeze) it reads before "
    "differentiating",
    "GRU": "unrolled over its static sequence length into MatMul/Slice/Sigmoid/Tanh (forward, reverse or bidirectional, "
    "layout 0, default activations, also spelt out as tf2onnx writes them, either linear_before_reset, no "
    "sequence_lens)",
    "If": "of the main graph (or brought into it by an unrolled Loop or Scan, or a chosen branch), its condition known "
    "when the plan is made (a constant, or computed from constants and static shapes, no element of it from the batch "
    "or another dimension known only at run time): replaced by the nodes of the branch it takes before "
    "differentiating; refused where a gradient crosses it otherwise",
    "Loop": "of the main graph (or brought into it by an unrolled Loop or Scan, or a chosen If branch), its trip count known when the plan is made (a constant, or folded from static "
    "shapes with the batch axis dynamic) and its condition computed from constants, the iteration number and the "
    "counters it carries: unrolled into copies of its body (those counters constants in each copy, the scan outputs "
    "stacked by Unsqueeze and Concat) before differentiating, at most 1,000 of them and 200,000 nodes in the unrolled "
    "graph; refused otherwise",
    "LSTM": "unrolled over its static sequence length into Gemm/Split/Sigmoid/Tanh (forward, reverse or bidirectional, "
    "layout 0, default activations, also spelt out as tf2onnx writes them, no peepholes, no sequence_lens); its "
    "gradient is emitted for the unrolled steps as a whole, step by step; tf2onnx's zero recurrent half of the "
    "bias (Keras's LSTM has one bias) is kept at zero",
    "RNN": "unrolled over its static sequence length into MatMul/Split/Tanh or Relu (forward, reverse or "
    "bidirectional, layout 0, a tanh or relu activation per direction: torch's nonlinearity, no clip, no "
    "sequence_lens)",
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
    return "\n".join(
        [
            "# Ops a generated training plan covers",
            "",
            "Generated from `emulator.toolchain.OP_COVERAGE` (`python -m emulator.toolchain.gradients`); a test keeps",
            "the two equal. An op outside this table is refused with `UnsupportedOpError`, naming the op and the",
            "node. Every gradient rule is checked against finite differences over random shapes",
            "(`tests/emulator/toolchain/test_gradients.py`), the written-out ops (`LayerNormalization`,",
            "`InstanceNormalization`, `GroupNormalization`, `LRN`, `GRU`, `LSTM`, `RNN`) against onnxruntime's own kernels",
            "for them. A recurrent model may also come unrolled by its author (`Slice` and `Squeeze` per step, `MatMul`,",
            "`Sigmoid`, `Tanh`).",
            "",
            "Whole architectures, exported by torch's classic and dynamo exporters, take torch autograd's own SGD",
            "step parameter by parameter (`tests/emulator/toolchain/test_exported_models.py`): ResNet-18,",
            "MobileNetV2 and V3-small, ShuffleNetV2 (channel split and shuffle), torchvision's and transformers'",
            "ViT, BERT, DistilBERT, ALBERT (one layer's weights at every depth), LSTM, GRU, bidirectional RNN and",
            "Conv1d text models, GPT-2 (tied output layer), Llama (RMSNorm, rotary positions, grouped-query",
            "attention, SiLU-gated MLP), T5 (encoder-decoder, relative position buckets), DenseNet (`Concat` of",
            "every layer before) and ConvNeXt (LayerNorm over channels, depthwise 7x7, GELU, layer scale), and",
            "DenseNet exported with its batch fixed at 4 (the exporter's default call) at any batch; of torch.nn's",
            "own layers, `nn.TransformerEncoder` with a padding mask, `Conv1d` and `Conv3d` (strided, grouped,",
            'depthwise of `padding="same"` with dilation, GroupNorm, InstanceNorm1d and 3d), its activations',
            "(PReLU, ELU, Softplus, Mish, GLU, SELU, CELU, Hardtanh, LogSigmoid, ...) and `torch.topk`, `torch.sort`",
            "and inverse trigonometric functions. EfficientNet-B0 (SiLU, squeeze-excite), SqueezeNet, Swin",
            "(`torch.roll`, window partition, relative position bias), RoBERTa, Qwen2, BART, Whisper's encoder and",
            "`nn.Transformer` (encoder-decoder, causal and padding masks, tied output layer;",
            "`benchmarks/torch_models.py`) were checked the same way (`python -m benchmarks.export_fixtures --only",
            "NAME --out DIR`, fresh and perturbed; BART's padding row and `final_logits_bias` and Whisper's",
            "position table frozen as `plan from-torch` freezes them; of `nn.Transformer` fresh, the dynamo",
            "exporter's `optimize=True` folds the cross-attention's input projection, whose zero bias then reads",
            "the encoder's equal one: the plan's warning names it, and `optimize=False` keeps them apart).",
            "",
            "Models below opset 13 (the ONNX Model Zoo's files at opsets 6-12, torch's classic exporter at",
            "`opset_version` 9-12) are raised to the plan's opset first (`emulator/toolchain/old_opsets.py`):",
            "`Upsample` becomes this table's `Resize`, `ImageScaler`, `Affine` and `ScaledTanh` its `Mul`, `Add`",
            "and `Tanh`. They take torch's step, or that of the same network written at opset 17",
            "(`tests/emulator/toolchain/test_old_opsets.py`).",
            "",
            "Keras models converted by tf2onnx take TensorFlow's own step the same way",
            "(`tests/emulator/toolchain/test_keras_exports.py`): an MLP, a CNN, MobileNetV2's inverted residual,",
            "LSTM (one bias), bidirectional LSTM, GRU (also `go_backwards`: `ReverseSequence`) and transformer",
            "(MultiHeadAttention as tf2onnx's `Gemm` and `MatMul`) models, and the recurrences tf2onnx writes as a",
            "`Loop`, unrolled (`emulator/toolchain/loops.py`): `SimpleRNN`, `GRU(reset_after=False)`, a masked LSTM",
            "or GRU (`Embedding(mask_zero=True)`, `Masking`) and Keras 3's GRU; over a sequence of run-time length the",
            "`Loop` is refused, naming it: no rule differentiates a subgraph.",
            "",
            "scikit-learn models converted by skl2onnx take torch autograd's step from the estimator's own",
            "attributes (`tests/emulator/toolchain/test_sklearn_exports.py`): `LogisticRegression`, `SGDClassifier`,",
            "`LinearSVC`, `LinearRegression`, `Ridge`, `MLPClassifier`, `MLPRegressor` and pipelines with",
            "`StandardScaler`, `MinMaxScaler` and `Normalizer`. Their `ai.onnx.ml` ops `LinearClassifier`,",
            "`LinearRegressor`, `Scaler`, `Normalizer` and `ZipMap` are written in this table's ops first",
            "(`emulator/toolchain/ml_ops.py`), the linear weights becoming trained initializers and the scalers'",
            "constants staying constants; tree ensembles and the other `ai.onnx.ml` ops are refused where the loss",
            "reads them: they have no gradient.",
            "",
            "PaddlePaddle models exported by paddle2onnx take Paddle's own step",
            "(`tests/emulator/toolchain/test_paddle_exports.py`): an MLP, a CNN with `BatchNorm2D` (its running",
            "variance moved with the population variance, as Paddle moves it) and `LayerNorm`, an Embedding",
            "text classifier with GELU, LSTM and GRU classifiers and a `TransformerEncoderLayer`; Flax NNX modules exported by jax2onnx take JAX's step",
            "(`tests/emulator/toolchain/test_jax_exports.py`): an MLP with LayerNorm and GELU and an NHWC CNN with",
            "BatchNorm (the running variance moved as Flax moves it, with the population variance).",
            "",
            coverage_markdown(),
            "",
        ]
    )


if __name__ == "__main__":  # regenerates the document
    import sys

    sys.stdout.write(coverage_document())
