"""Losses of a training or evaluation plan and the per-batch metrics that come with them.

Every loss gives ``loss_sum`` (the batch's summed per-example loss) and ``count`` (its number of
examples); classification losses also give ``correct``. The step minimizes the batch's mean loss.
The built-in losses write their gradient at the model's prediction in closed form (softmax minus
one-hot for cross-entropy), which is both exact and cheaper than differentiating the loss graph;
a user's loss graph is inlined and differentiated like the model.

When the model ends in ``Softmax`` (cross-entropy) or ``Sigmoid`` (binary cross-entropy), as
exported classifiers do, the loss reads the logits before it: the log-sum-exp form is stable where
``log(softmax)`` underflows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .autodiff import DEFAULT_DOMAINS, Dim, Emitter

BUILTIN_LOSSES = ("cross_entropy", "binary_cross_entropy", "mse")
_F32 = TensorProto.FLOAT


@dataclass
class LossGraph:
    loss_sum: str
    metrics: dict[str, str]  # metric name -> scalar float32 tensor (loss_sum, count, correct, ...)
    seeds: dict[str, str] = field(default_factory=dict)  # forward tensor -> d(scaled mean loss)/d tensor
    nodes: list[onnx.NodeProto] = field(default_factory=list)  # a user's loss, to differentiate
    classes: int | None = None  # the label's number of classes, for a loss that takes class ids


def label_type(loss: str | onnx.ModelProto | onnx.GraphProto) -> int:
    """The element type the label input takes for ``loss``."""
    if loss == "cross_entropy":
        return TensorProto.INT64
    if isinstance(loss, str):
        return _F32
    graph = loss.graph if isinstance(loss, onnx.ModelProto) else loss
    return graph.input[1].type.tensor_type.elem_type


def check_loss(loss) -> None:
    if isinstance(loss, str):
        if loss not in BUILTIN_LOSSES:
            raise ValueError(
                f"loss {loss!r} is unknown; use one of {BUILTIN_LOSSES} or an ONNX graph (prediction, label) -> scalar"
            )
        return
    if not isinstance(loss, (onnx.ModelProto, onnx.GraphProto)):
        raise TypeError(
            f"loss must be a name from {BUILTIN_LOSSES} or an onnx ModelProto/GraphProto, got {type(loss).__name__}"
        )
    graph = loss.graph if isinstance(loss, onnx.ModelProto) else loss
    if len(graph.input) != 2 or len(graph.output) != 1:
        raise ValueError(
            "a loss graph takes exactly two inputs (prediction, label) and returns one scalar (the batch's mean loss)"
        )


def emit_loss(
    e: Emitter,
    loss,
    prediction: str,
    label: str,
    producers: dict[str, onnx.NodeProto],
    *,
    factor: float | None,
) -> LossGraph:
    """Emit ``loss`` of ``prediction`` against ``label``; with ``factor`` also the seeds of the
    backward pass: the gradient of ``factor`` times the batch's mean loss (an SGD step folds its
    learning rate in here; other optimizers take factor 1)."""
    if loss == "cross_entropy":  # one label per example, or per position of a sequence
        count = e.op("Cast", [e.op("Size", [label])], to=_F32, hint="count")
    else:
        count = e.op("Cast", [e.op("Gather", [e.op("Shape", [label]), e.ints([0])])], to=_F32)
        count = e.op("ReduceSum", [count], keepdims=0, hint="count")  # [1] -> scalar
    scale = None
    if factor is not None:
        scale = e.op("Div", [e.const(np.array(factor, dtype=np.float32), "factor"), count], hint="factor_over_n")
        e.record(scale, _F32, ())
    if loss == "cross_entropy":
        out = _cross_entropy(e, prediction, label, producers, scale)
    elif loss == "binary_cross_entropy":
        out = _binary_cross_entropy(e, prediction, label, producers, count, scale)
    elif loss == "mse":
        out = _mse(e, prediction, label, count, scale)
    else:
        out = _custom(e, loss, prediction, label, count, factor)
    out.metrics["count"] = count
    out.metrics["loss_sum"] = out.loss_sum
    return out


def _before(
    e: Emitter, producers: dict[str, onnx.NodeProto], tensor: str, op_type: str, last_axis: bool = False
) -> str | None:
    """The input of the ``op_type`` node that makes ``tensor`` (through Identity nodes), if any;
    with ``last_axis`` only when that node works on the last axis (Softmax's default)."""
    node = producers.get(tensor)
    while node is not None and node.op_type == "Identity" and node.domain in DEFAULT_DOMAINS:
        node = producers.get(node.input[0])
    if node is None or node.op_type != op_type or node.domain not in DEFAULT_DOMAINS:
        return None
    if last_axis:
        axis = next((int(a.i) for a in node.attribute if a.name == "axis"), -1)
        rank = e.rank(node.input[0])
        if axis != -1 and (rank is None or axis != rank - 1):
            return None
    return node.input[0]


def _as_f32(e: Emitter, t: str) -> str:
    return t if e.elem_type(t) == _F32 else e.op("Cast", [t], to=_F32)


def _cross_entropy(e: Emitter, prediction: str, label: str, producers, scale: str | None) -> LossGraph:
    """Classes on the last axis: [N, classes] with labels [N], or [N, ..., classes] with labels
    [N, ...] (a next-word model scoring every position); the mean is over all labels."""
    logits = (
        _before(e, producers, prediction, "Softmax", last_axis=True)
        or _before(e, producers, prediction, "LogSoftmax", last_axis=True)
        or prediction
    )
    shape = e.shape(logits)
    if shape is None or len(shape) < 2 or not isinstance(shape[-1], int):
        raise ValueError(
            f"cross_entropy needs a prediction of shape [N, ..., classes] with a fixed number of classes, got {shape}"
        )
    if shape[-1] == 1:  # the softmax of one score is 1 whatever the weights: the loss is 0 and nothing trains
        raise ValueError(
            f"cross_entropy needs at least two classes, and the prediction {prediction!r} has one score per example "
            "(a regressor's, or a binary classifier's logit): use loss mse for a regressor, binary_cross_entropy "
            "for one logit"
        )
    logp = e.op("LogSoftmax", [logits], axis=-1, hint="logp")
    classes = e.const(np.arange(shape[-1], dtype=np.int64), "classes")
    onehot = e.op("Cast", [e.op("Equal", [e.unsqueeze(label, [-1]), classes])], to=e.elem_type(logits), hint="onehot")
    loss_sum = _as_f32(e, e.op("Neg", [e.op("ReduceSum", [e.op("Mul", [onehot, logp])], keepdims=0)]))
    pred = e.op("ArgMax", [logits], axis=-1, keepdims=0)
    correct = e.op("ReduceSum", [e.op("Cast", [e.op("Equal", [pred, label])], to=_F32)], keepdims=0, hint="correct")
    out = LossGraph(loss_sum, {"correct": correct}, classes=int(shape[-1]))
    if scale is not None:
        out.seeds[logits] = e.op("Mul", [e.op("Sub", [e.op("Exp", [logp]), onehot]), scale], hint="d_logits")
    return out


def _binary_cross_entropy(
    e: Emitter, prediction: str, label: str, producers, count: str, scale: str | None
) -> LossGraph:
    """One or several independent labels per example. An example's loss is the mean of its labels'
    (torch's ``BCEWithLogitsLoss`` and Keras' ``binary_crossentropy``, whose batch loss is the mean
    over every label), as ``mse`` averages an example's outputs: a sum over k labels trained k times
    the step and reported k times the loss. ``correct`` sums, per example, the fraction of its labels
    predicted right, so that it is at most ``count`` (the server refuses a report whose ``correct``
    exceeds its ``count``) and the accuracy is per label."""
    softmax = next(
        (op for op in ("Softmax", "LogSoftmax") if _before(e, producers, prediction, op, last_axis=True) is not None),
        None,
    )
    if softmax is not None:  # its columns sum to 1: not independent labels' probabilities
        shape = e.shape(prediction)
        classes = f"{shape[-1]} " if shape and isinstance(shape[-1], int) else ""
        raise ValueError(
            f"binary_cross_entropy reads every column of the prediction {prediction!r} as an independent label's "
            f"probability, but it is a {softmax} over {classes}classes, which sum to 1: over more than two classes a "
            "step would train another objective, and over two cross-entropy from clipped probabilities; use loss "
            "cross_entropy, with one class id "
            "per example, or export the model with one Sigmoid output for binary_cross_entropy"
        )
    logits = _before(e, producers, prediction, "Sigmoid")
    target = e.op("Reshape", [_cast_like(e, label, prediction), e.shape_of(prediction)], hint="target")
    shape = e.shape(prediction)
    labels = None if _example_size(shape) == 1 else _per_example_size(e, prediction, count)
    if scale is not None and labels is not None:  # the mean over an example's labels
        scale = e.op("Div", [scale, _as_f32(e, labels)])
    zero = e.scalar(0.0, prediction)
    one = e.scalar(1.0, prediction)
    half = e.scalar(0.5, prediction)
    out: LossGraph
    if logits is not None:
        # max(z, 0) - z*y + log(1 + exp(-|z|)), and its gradient sigmoid(z) - y
        per = e.op(
            "Add",
            [
                e.op("Sub", [e.op("Max", [logits, zero]), e.op("Mul", [logits, target])]),
                e.op("Softplus", [e.op("Neg", [e.op("Abs", [logits])])]),
            ],
        )
        positive = e.op("Greater", [logits, zero])
        out = LossGraph(_example_mean(e, per, labels), {})
        if scale is not None:
            out.seeds[logits] = e.op("Mul", [e.op("Sub", [prediction, target]), scale], hint="d_logits")
    else:
        # the prediction is a probability: clip it away from 0 and 1 so that the logs stay finite
        eps = e.scalar(1e-7, prediction)
        p = e.op("Clip", [prediction, eps, e.op("Sub", [one, eps])])
        per = e.op(
            "Neg",
            [
                e.op(
                    "Add",
                    [
                        e.op("Mul", [target, e.op("Log", [p])]),
                        e.op("Mul", [e.op("Sub", [one, target]), e.op("Log", [e.op("Sub", [one, p])])]),
                    ],
                )
            ],
        )
        positive = e.op("Greater", [prediction, half])
        out = LossGraph(_example_mean(e, per, labels), {})
        if scale is not None:
            local = e.op("Div", [e.op("Sub", [p, target]), e.op("Mul", [p, e.op("Sub", [one, p])])])
            out.seeds[prediction] = e.op("Mul", [local, scale], hint="d_prediction")
    agree = e.op("Equal", [positive, e.op("Greater", [target, half])])
    hits = e.op("ReduceSum", [e.op("Cast", [agree], to=_F32)], keepdims=0, hint="correct" if labels is None else None)
    out.metrics["correct"] = hits if labels is None else e.op("Div", [hits, _as_f32(e, labels)], hint="correct")
    return out


def _example_mean(e: Emitter, per: str, labels: str | None) -> str:
    """The batch's sum over examples of each example's mean over its ``labels`` (None: one each)."""
    total = e.op("ReduceSum", [per], keepdims=0)
    return _as_f32(e, total if labels is None else e.op("Div", [total, labels]))


def _cast_like(e: Emitter, t: str, like: str) -> str:
    return t if e.elem_type(t) == e.elem_type(like) else e.op("Cast", [t], to=e.elem_type(like))


def _example_size(shape: tuple[Dim, ...] | None) -> int | None:
    """Elements per example (the dimensions after the batch) when inference fixed them all."""
    if shape is None:
        return None
    dims = [d for d in shape[1:] if isinstance(d, int)]
    return int(np.prod(dims, dtype=np.int64)) if len(dims) == len(shape) - 1 else None


def _per_example_size(e: Emitter, prediction: str, count: str) -> str:
    shape = e.shape(prediction)
    size = _example_size(shape)
    if size is not None:
        return e.scalar(float(size), prediction)
    elements = e.op("Cast", [e.op("Size", [prediction])], to=e.elem_type(prediction))
    return e.op("Div", [elements, _cast_like(e, count, prediction)])


def _mse(e: Emitter, prediction: str, label: str, count: str, scale: str | None) -> LossGraph:
    target = e.op("Reshape", [_cast_like(e, label, prediction), e.shape_of(prediction)], hint="target")
    diff = e.op("Sub", [prediction, target])
    per_example = _per_example_size(e, prediction, count)
    loss_sum = _as_f32(e, e.op("Div", [e.op("ReduceSum", [e.op("Mul", [diff, diff])], keepdims=0), per_example]))
    out = LossGraph(loss_sum, {})
    if scale is not None:
        factor = e.op("Div", [e.op("Mul", [_cast_like(e, scale, prediction), e.scalar(2.0, prediction)]), per_example])
        out.seeds[prediction] = e.op("Mul", [diff, factor], hint="d_prediction")
    return out


def _custom(e: Emitter, loss, prediction: str, label: str, count: str, factor: float | None) -> LossGraph:
    graph = loss.graph if isinstance(loss, onnx.ModelProto) else loss
    rename = {graph.input[0].name: prediction, graph.input[1].name: label}
    for init in graph.initializer:
        rename[init.name] = e.const(numpy_helper.to_array(init), f"loss_{init.name}")
    nodes = []
    for node in graph.node:
        for o in node.output:
            if o and o not in rename:
                rename[o] = e.fresh(f"loss_{o}")
        copy = helper.make_node(
            node.op_type,
            [rename.get(i, i) if i else "" for i in node.input],
            [rename[o] if o else "" for o in node.output],
            name=e.fresh(f"loss_{node.name or node.op_type}"),
            domain=node.domain,
        )
        copy.attribute.extend(node.attribute)
        nodes.append(copy)
    e.nodes += nodes
    mean = rename[graph.output[0].name]
    loss_sum = e.op("Mul", [_as_f32(e, e.op("ReduceSum", [mean], keepdims=0)), count], hint="loss_sum")
    out = LossGraph(loss_sum, {}, nodes=nodes)
    if factor is not None:
        # the user's scalar is already the batch mean: its seed is the factor itself
        elem = graph.output[0].type.tensor_type.elem_type
        out.seeds[mean] = e.const(np.array(factor, dtype=helper.tensor_dtype_to_np_dtype(elem)), "loss_seed")
    return out


def loss_metric_names(loss) -> tuple[str, ...]:
    """The per-batch sums a plan with ``loss`` can report."""
    if loss in ("cross_entropy", "binary_cross_entropy"):
        return ("loss_sum", "correct", "count")
    return ("loss_sum", "count")
