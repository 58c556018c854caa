"""Builders of training and evaluation plans: softmax regression and MLPs, with the SGD step's
backward pass written out in standard ONNX ops (no onnxruntime-training), emitted directly at the
requested opset with an explicit IR version.

The work graph of a training plan takes the weights ``w0, b0, w1, b1, ...`` (float32), ``x``
(float32 ``[N, F]``) and ``y`` (int64 ``[N]``, class ids) and returns the weights after one SGD
step on the batch's mean cross-entropy (``w0_new, b0_new, ...``) and the per-batch sums
``loss_sum`` (with the pre-update weights), ``correct`` and ``count``. The learning rate is a
constant of the graph; the batch dimension is dynamic.

The client update a device reports (see :mod:`device_runtime.executor`) is, all float32:
``<weight>`` = (w_final - w_initial) * n, ``<metric>`` = its sum over all batches of all epochs
divided by the number of epochs, ``num_examples`` = n (examples per epoch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .plan import (
    PLAN_FORMAT_VERSION,
    DeviceConfig,
    Plan,
    PlanError,
    PlanMetadata,
    ServerPart,
    ir_version_for_opset,
    min_runtime_for_opset,
)

if TYPE_CHECKING:  # example_store is imported lazily at load time (as in plan.py)
    from example_store import ExampleSelector

MIN_OPSET = 13
MAX_OPSET = 26
TRAIN_METRICS = ("loss_sum", "correct", "count")
NUM_EXAMPLES = "num_examples"
_F32 = TensorProto.FLOAT
_F64 = TensorProto.DOUBLE
_I64 = TensorProto.INT64


class _Graph:
    """A tiny helper to emit nodes with unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._n = 0

    def tmp(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def op(self, op_type: str, inputs: Sequence[str], out: str | None = None, **attrs) -> str:
        out = out or self.tmp(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=f"n{len(self.nodes)}_{op_type}", **attrs))
        return out

    def const(self, value: np.ndarray, hint: str = "c") -> str:
        name = self.tmp(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def model(self, name: str, inputs, outputs, opset: int) -> bytes:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, initializer=self.initializers)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", opset)],
            producer_name="fedfleet.plan_builder",
            ir_version=ir_version_for_opset(opset),
        )
        onnx.checker.check_model(model)
        return model.SerializeToString()


def _vi(name: str, elem: int, shape: Sequence) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, list(shape))


def _layer_shapes(num_features: int, hidden: Sequence[int], num_classes: int) -> list[tuple[int, int]]:
    sizes = [int(num_features), *[int(h) for h in hidden], int(num_classes)]
    if any(s < 1 for s in sizes):
        raise ValueError(f"layer sizes must be positive, got {sizes}")
    if num_classes < 2:
        raise ValueError("a classifier needs at least 2 classes")
    return list(zip(sizes[:-1], sizes[1:]))


def _weight_names(num_layers: int) -> tuple[str, ...]:
    names: list[str] = []
    for i in range(num_layers):
        names += [f"w{i}", f"b{i}"]
    return tuple(names)


def _work_graph(layers: list[tuple[int, int]], *, learning_rate: float | None, opset: int) -> bytes:
    """Forward (+ backward and SGD update when learning_rate is not None) over one batch."""
    g = _Graph()
    num_classes = layers[-1][1]
    inputs = []
    for i, (fan_in, fan_out) in enumerate(layers):
        inputs += [_vi(f"w{i}", _F32, [fan_in, fan_out]), _vi(f"b{i}", _F32, [fan_out])]
    inputs += [_vi("x", _F32, ["N", layers[0][0]]), _vi("y", _I64, ["N"])]

    # Forward: z_i = a_{i-1} @ w_i + b_i, a_i = relu(z_i); logits = z_last.
    acts = ["x"]
    pre = []
    for i in range(len(layers)):
        z = g.op("Gemm", [acts[-1], f"w{i}", f"b{i}"], g.tmp(f"z{i}"))
        pre.append(z)
        if i < len(layers) - 1:
            acts.append(g.op("Relu", [z], g.tmp(f"a{i}")))
    logits = pre[-1]
    logp = g.op("LogSoftmax", [logits], "logp", axis=1)  # numerically stable (max-shifted) log-softmax
    classes = g.const(np.arange(num_classes, dtype=np.int64), "classes")
    y_col = g.op("Unsqueeze", ["y", g.const(np.array([1], dtype=np.int64), "axis1")], "y_col")
    onehot = g.op("Cast", [g.op("Equal", [y_col, classes])], "onehot", to=_F32)
    neg_ll = g.op("ReduceSum", [g.op("Mul", [onehot, logp])], keepdims=0)
    g.op("Neg", [neg_ll], "loss_sum")
    pred = g.op("ArgMax", [logits], "pred", axis=1, keepdims=0)
    g.op("ReduceSum", [g.op("Cast", [g.op("Equal", [pred, "y"])], to=_F32)], "correct", keepdims=0)
    g.op("ReduceSum", [g.op("Cast", [g.op("Shape", ["y"])], to=_F32)], "count", keepdims=0)
    outputs = []
    metric_outputs = [_vi(m, _F32, []) for m in TRAIN_METRICS]
    if learning_rate is not None:
        # d(mean loss)/d logits = (softmax - onehot) / N; the step size lr is folded in: g = lr/N * (p - onehot).
        scale = g.op("Div", [g.const(np.array(learning_rate, dtype=np.float32), "lr"), "count"], "lr_over_n")
        probs = g.op("Exp", [logp], "probs")
        grad = g.op("Mul", [g.op("Sub", [probs, onehot]), scale], "g_logits")
        new_names: dict[int, tuple[str, str]] = {}
        for i in reversed(range(len(layers))):
            # w_new = w - a^T @ g  (one Gemm: alpha=-1, beta=1, C=w); b_new = b - sum_rows(g)
            g.op("Gemm", [acts[i], grad, f"w{i}"], f"w{i}_new", alpha=-1.0, beta=1.0, transA=1)
            db = g.op("ReduceSum", [grad, g.const(np.array([0], dtype=np.int64), "axis0")], keepdims=0)
            g.op("Sub", [f"b{i}", db], f"b{i}_new")
            new_names[i] = (f"w{i}_new", f"b{i}_new")
            if i > 0:
                # backprop through the pre-update weights: da = g @ w^T; dz = da * (z > 0)
                da = g.op("Gemm", [grad, f"w{i}"], g.tmp(f"da{i - 1}"), transB=1)
                positive = g.op("Greater", [pre[i - 1], g.const(np.array(0, dtype=np.float32), "zero")])
                grad = g.op("Where", [positive, da, g.const(np.array(0, dtype=np.float32), "zero")], g.tmp(f"g{i - 1}"))
        for i, (fan_in, fan_out) in enumerate(layers):
            outputs += [_vi(new_names[i][0], _F32, [fan_in, fan_out]), _vi(new_names[i][1], _F32, [fan_out])]
    return g.model("work", inputs, outputs + metric_outputs, opset)


def _specs(layers: list[tuple[int, int]]) -> dict[str, list[int]]:
    spec: dict[str, list[int]] = {}
    for i, (fan_in, fan_out) in enumerate(layers):
        spec[f"w{i}"] = [fan_in, fan_out]
        spec[f"b{i}"] = [fan_out]
    return spec


def summing_graphs(update_spec: Mapping[str, Sequence[int]], opset: int) -> tuple[bytes, bytes, bytes]:
    """The server part's ``zero``, ``accumulate`` and ``merge`` graphs for an update of these
    tensors: every plan sums its client updates the same way, in float64 (see ``_server_part``)."""
    # zero: ConstantOfShape keeps the graph small whatever the model size.
    g = _Graph()
    for name, shape in update_spec.items():
        g.op(
            "ConstantOfShape",
            [g.const(np.array(shape, dtype=np.int64), "shape")],
            name,
            value=numpy_helper.from_array(np.zeros(1, dtype=np.float64)),
        )
    zero = g.model("zero", [], [_vi(n, _F64, s) for n, s in update_spec.items()], opset)

    # accumulate: acc (float64) + upd (float32, widened); merge: a + b, both float64.
    g = _Graph()
    ins = []
    for name, shape in update_spec.items():
        ins += [_vi(f"acc/{name}", _F64, shape), _vi(f"upd/{name}", _F32, shape)]
        g.op("Add", [f"acc/{name}", g.op("Cast", [f"upd/{name}"], to=_F64)], name)
    accumulate = g.model("accumulate", ins, [_vi(n, _F64, s) for n, s in update_spec.items()], opset)
    g = _Graph()
    ins = []
    for name, shape in update_spec.items():
        ins += [_vi(f"a/{name}", _F64, shape), _vi(f"b/{name}", _F64, shape)]
        g.op("Add", [f"a/{name}", f"b/{name}"], name)
    merge = g.model("merge", ins, [_vi(n, _F64, s) for n, s in update_spec.items()], opset)
    return zero, accumulate, merge


def _server_part(weights: dict[str, list[int]], kind: str, opset: int) -> ServerPart:
    """MapReduceForm graphs for FedAvg (train) or metric averaging (eval); see plan.py for names.

    Client updates arrive as float32; the accumulator, the aggregate and the metrics are float64,
    so that no sum of finite reports can overflow (two float32 loss sums near 3e38 would), and the
    new weights are cast back to float32."""
    update_spec: dict[str, list[int]] = dict(weights) if kind == "train" else {}
    update_spec.update({m: [] for m in TRAIN_METRICS})
    update_spec[NUM_EXAMPLES] = []
    prefix = "train" if kind == "train" else "eval"
    agg_metrics = (f"{prefix}_loss", f"{prefix}_accuracy", NUM_EXAMPLES)

    zero, accumulate, merge = summing_graphs(update_spec, opset)

    # report: mean delta per weight = acc[w] / max(n, 1); metrics = sums / max(count, 1).
    g = _Graph()
    one = g.const(np.array(1, dtype=np.float64), "one")
    n = g.op("Max", [f"acc/{NUM_EXAMPLES}", one], "n_safe")
    count = g.op("Max", ["acc/count", one], "count_safe")
    report_out = []
    for name in weights if kind == "train" else ():
        g.op("Div", [f"acc/{name}", n], name)
        report_out.append(_vi(name, _F64, weights[name]))
    g.op("Div", ["acc/loss_sum", count], agg_metrics[0])
    g.op("Div", ["acc/correct", count], agg_metrics[1])
    g.op("Identity", [f"acc/{NUM_EXAMPLES}"], agg_metrics[2])
    report_out += [_vi(m, _F64, []) for m in agg_metrics]
    report = g.model("report", [_vi(f"acc/{n_}", _F64, s) for n_, s in update_spec.items()], report_out, opset)
    aggregate_spec = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in report_out}

    # update: new state = state + mean delta (train) or state (eval); metrics passed through.
    g = _Graph()
    ins = [_vi(f"state/{w}", _F32, s) for w, s in weights.items()]
    ins += [_vi(f"agg/{a}", _F64, s) for a, s in aggregate_spec.items()]
    outs = []
    for w, s in weights.items():
        if kind == "train":
            g.op("Add", [f"state/{w}", g.op("Cast", [f"agg/{w}"], to=_F32)], w)
        else:
            g.op("Identity", [f"state/{w}"], w)
        outs.append(_vi(w, _F32, s))
    for m in agg_metrics:
        g.op("Identity", [f"agg/{m}"], m)
        outs.append(_vi(m, _F64, []))
    update = g.model("update", ins, outs, opset)

    g = _Graph()
    for w in weights:
        g.op("Identity", [f"state/{w}"], w)
    prepare = g.model(
        "prepare",
        [_vi(f"state/{w}", _F32, s) for w, s in weights.items()],
        [_vi(w, _F32, s) for w, s in weights.items()],
        opset,
    )
    return ServerPart(
        prepare=prepare,
        zero=zero,
        accumulate=accumulate,
        merge=merge,
        report=report,
        update=update,
        bitwidth=None,
        secure_sum=(),
    )


def _check_args(opset: int, learning_rate: float, batch_size: int, epochs: int, inputs: Mapping[str, str]) -> None:
    if not (MIN_OPSET <= opset <= MAX_OPSET):
        raise PlanError(f"opset {opset} is not supported by the builder; use {MIN_OPSET}..{MAX_OPSET}")
    if not (np.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"learning_rate must be a positive number, got {learning_rate!r}")
    if batch_size < 1 or epochs < 1:
        raise ValueError("batch_size and epochs must be >= 1")
    if set(inputs) != {"x", "y"}:
        raise ValueError(
            f"inputs must map the work graph's inputs 'x' and 'y' to example tensor names, got {dict(inputs)}"
        )


def assemble_plan(
    *,
    name: str,
    kind: str,
    work: bytes,
    weight_names: Sequence[str],
    weight_outputs: Sequence[str],
    metric_names: Sequence[str],
    server: ServerPart,
    selector: ExampleSelector,
    inputs: Mapping[str, str],
    batch_size: int,
    opset: int,
    epochs: int = 1,
    shuffle_seed: int | None = None,
    shuffle_buffer: int = 0,
    resume: bool = False,
    metadata: PlanMetadata | None = None,
    min_runtime_version: str | None = None,
    max_runtime_version: str | None = None,
    memory_budget_mb: int | None = None,
    time_budget_s: float | None = None,
    shared_weights: Sequence[str] = (),
    class_ids: Mapping[str, int] | None = None,
) -> Plan:
    """The one place a ``Plan`` is put together, for this module's builders and the toolchain's:
    the device's feeding, the format version, and metadata derived from ``opset`` (its IR
    version and, unless given, the first onnxruntime release that runs it). ``metadata`` replaces
    the derived metadata whole (an evaluation plan keeps its training plan's). ``class_ids``: the
    inputs that take class ids, with their numbers of classes (``DeviceConfig.class_ids``)."""
    if metadata is None:
        metadata = PlanMetadata(
            opset=opset,
            ir_version=ir_version_for_opset(opset),
            min_runtime_version=min_runtime_version or min_runtime_for_opset(opset),
            max_runtime_version=max_runtime_version,
            memory_budget_mb=memory_budget_mb,
            time_budget_s=time_budget_s,
            shared_weights=tuple(shared_weights),
        )
    return Plan(
        name=name,
        kind=kind,
        format_version=PLAN_FORMAT_VERSION,
        device=DeviceConfig(
            selector=selector,
            batch_size=int(batch_size),
            epochs=int(epochs),
            shuffle_seed=shuffle_seed,
            shuffle_buffer=int(shuffle_buffer),
            inputs=dict(inputs),
            resume=bool(resume),
            class_ids=dict(class_ids or {}),
        ),
        work=work,
        weight_names=tuple(weight_names),
        weight_outputs=tuple(weight_outputs),
        metric_names=tuple(metric_names),
        server=server,
        metadata=metadata,
    )


def build_mlp_plan(
    num_features: int,
    hidden_sizes: Sequence[int],
    num_classes: int,
    *,
    learning_rate: float = 0.1,
    batch_size: int = 32,
    epochs: int = 1,
    selector: ExampleSelector,
    inputs: Mapping[str, str] = {"x": "x", "y": "y"},  # noqa: B006 - never mutated
    shuffle_seed: int | None = 0,
    shuffle_buffer: int = 1024,
    opset: int = 17,
    name: str | None = None,
    min_runtime_version: str | None = None,
    max_runtime_version: str | None = None,
    memory_budget_mb: int | None = None,
    time_budget_s: float | None = None,
    secure_aggregation: bool = False,
    bitwidth: int = 24,
    clip_range: float = 1024.0,
    resume_examples: bool = False,
) -> Plan:
    """A training plan for an MLP with ReLU hidden layers and a softmax output (one SGD step per
    batch, mean cross-entropy). ``hidden_sizes=()`` is softmax regression.

    ``resume_examples`` makes each device continue reading where its last completed session of
    this task stopped, or one killed once its update had started to leave (``DeviceConfig.resume``); with a selector ``limit`` successive sessions then
    train on successive slices of the device's data instead of the same first ``limit`` examples.

    ``secure_aggregation`` sends the whole client update through Secure Aggregation: each entry
    is clipped to [-clip_range, clip_range] and quantized to ``bitwidth`` bits. The entries are
    example-weighted sums (delta * n, loss and count sums), so ``clip_range`` bounds n times the
    largest weight change; the default leaves room for hundreds of examples per device."""
    _check_args(opset, learning_rate, batch_size, epochs, inputs)
    if not isinstance(resume_examples, bool):
        raise TypeError(f"resume_examples must be True or False, got {resume_examples!r}")
    layers = _layer_shapes(num_features, hidden_sizes, num_classes)
    weights = _specs(layers)
    names = _weight_names(len(layers))
    if name is None:
        name = "mlp_" + "_".join(str(s) for s in [num_features, *hidden_sizes, num_classes])
    return assemble_plan(
        name=name,
        kind="train",
        work=_work_graph(layers, learning_rate=float(learning_rate), opset=opset),
        weight_names=names,
        weight_outputs=[f"{n}_new" for n in names],
        metric_names=TRAIN_METRICS,
        server=_secure(_server_part(weights, "train", opset), names, secure_aggregation, bitwidth, clip_range),
        selector=selector,
        inputs=inputs,
        batch_size=batch_size,
        epochs=epochs,
        shuffle_seed=shuffle_seed,
        shuffle_buffer=shuffle_buffer,
        resume=resume_examples,
        opset=opset,
        min_runtime_version=min_runtime_version,
        max_runtime_version=max_runtime_version,
        memory_budget_mb=memory_budget_mb,
        time_budget_s=time_budget_s,
    )


def _secure(server: ServerPart, weights: Sequence[str], on: bool, bitwidth: int, clip_range: float) -> ServerPart:
    if not on:
        return server
    names = (*weights, *TRAIN_METRICS, NUM_EXAMPLES)
    return dataclasses.replace(server, bitwidth=int(bitwidth), clip_range=float(clip_range), secure_sum=names)


def build_softmax_regression_plan(
    num_features: int,
    num_classes: int,
    *,
    selector: ExampleSelector,
    inputs: Mapping[str, str] = {"x": "x", "y": "y"},  # noqa: B006 - never mutated
    learning_rate: float = 0.1,
    batch_size: int = 32,
    epochs: int = 1,
    shuffle_seed: int | None = 0,
    shuffle_buffer: int = 1024,
    opset: int = 17,
    name: str | None = None,
    min_runtime_version: str | None = None,
    max_runtime_version: str | None = None,
    memory_budget_mb: int | None = None,
    time_budget_s: float | None = None,
    secure_aggregation: bool = False,
    bitwidth: int = 24,
    clip_range: float = 1024.0,
    resume_examples: bool = False,
) -> Plan:
    """A training plan for multinomial logistic regression: ``build_mlp_plan`` without hidden
    layers, whose docstring says what each keyword does. They are spelled out (not ``**kwargs``)
    so that a type checker and an IDE know them: a misspelt one, or a selector given as its URI
    string, is said where it is written."""
    return build_mlp_plan(
        num_features,
        (),
        num_classes,
        learning_rate=learning_rate,
        batch_size=batch_size,
        epochs=epochs,
        selector=selector,
        inputs=inputs,
        shuffle_seed=shuffle_seed,
        shuffle_buffer=shuffle_buffer,
        opset=opset,
        name=name or f"softmax_{num_features}_{num_classes}",
        min_runtime_version=min_runtime_version,
        max_runtime_version=max_runtime_version,
        memory_budget_mb=memory_budget_mb,
        time_budget_s=time_budget_s,
        secure_aggregation=secure_aggregation,
        bitwidth=bitwidth,
        clip_range=clip_range,
        resume_examples=resume_examples,
    )


def _layers_of(plan: Plan) -> list[tuple[int, int]]:
    model = onnx.ModelProto.FromString(plan.work)
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    layers = []
    i = 0
    while f"w{i}" in shapes:
        fan_in, fan_out = shapes[f"w{i}"]
        layers.append((fan_in, fan_out))
        i += 1
    if not layers or _weight_names(len(layers)) != plan.weight_names:
        raise PlanError(f"plan {plan.name!r} was not made by this builder (weights {plan.weight_names})")
    return layers


def build_eval_plan(train_plan: Plan) -> Plan:
    """The evaluation twin of a training plan: same model and data; the work graph computes only
    ``loss_sum``, ``correct`` and ``count``; the server part averages them into ``eval_loss`` and
    ``eval_accuracy`` and its update passes the weights through unchanged."""
    layers = _layers_of(train_plan)
    opset = train_plan.metadata.opset
    return assemble_plan(
        name=f"{train_plan.name}_eval",
        kind="eval",
        work=_work_graph(layers, learning_rate=None, opset=opset),
        weight_names=train_plan.weight_names,
        weight_outputs=(),
        metric_names=TRAIN_METRICS,
        server=_server_part(_specs(layers), "eval", opset),
        selector=train_plan.device.selector,
        inputs=train_plan.device.inputs,
        batch_size=train_plan.device.batch_size,
        opset=opset,
        metadata=train_plan.metadata,
    )


def initial_weights(plan: Plan, seed: int = 0) -> dict[str, np.ndarray]:
    """Glorot-uniform weight matrices and zero biases (float32), deterministic for a seed."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for i, (fan_in, fan_out) in enumerate(_layers_of(plan)):
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        out[f"w{i}"] = rng.uniform(-limit, limit, size=(fan_in, fan_out)).astype(np.float32)
        out[f"b{i}"] = np.zeros(fan_out, dtype=np.float32)
    return out
