"""An ONNX inference model to an evaluation plan: the model's forward pass as exported (batch
normalization with running statistics, no dropout) and the loss's per-batch sums; the server
averages them into ``eval_loss`` (and ``eval_accuracy``) and leaves the model as it is.

An evaluation task that measures a training task's model must take exactly that task's weights
(the server checks it), so ``training_plan`` lends its weight list: optimizer state becomes an
input the graph does not read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from onnx import TensorProto

from device_runtime.executor import PlanExecutor
from device_runtime.plan import Plan
from device_runtime.plan_builder import assemble_plan

from . import onnx_import
from .autodiff import Emitter, constant_values, tensor_infos
from .losses import check_loss, emit_loss, label_type
from .server_optimizers import server_part
from .training import (
    ModelLike,
    _label_shape,
    _live_nodes,
    _metrics,
    _model,
    _vi,
    check_ops,
    default_trainable,
    read_model,
)

_F32 = TensorProto.FLOAT


def evaluation_plan_from_onnx(
    model: ModelLike,
    *,
    label: str,
    loss,
    example_selector,
    batch_size: int,
    training_plan: Plan | None = None,
    trainable: Sequence[str] | None = None,
    output: str | None = None,
    metrics: Sequence[str] | None = None,
    opset: int | None = None,
    inputs: Mapping[str, str] | None = None,
    name: str | None = None,
) -> Plan:
    """An evaluation plan for ``model`` (same arguments as :func:`training_plan_from_onnx`).

    The weights fed from the checkpoint are ``training_plan``'s when given, else ``trainable``
    (default: the float32 initializers a training plan would train, plus running statistics)."""
    check_loss(loss)
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    parts = read_model(
        model,
        opset=opset if training_plan is None else training_plan.metadata.opset,
        output=output,
        inputs=inputs,
        label=label,
        loss=loss,
    )
    onnx_import.inference_form(parts.model)  # a train-mode export's Dropout and BatchNorm, as evaluation runs them
    graph = parts.model.graph
    chosen = _metrics(loss, metrics)
    nodes = _live_nodes(list(graph.node), [parts.prediction])
    check_ops(nodes)
    if training_plan is not None:
        spec = PlanExecutor(training_plan).weight_spec()
        weights = {w: tuple(shape) for w, (shape, _dtype) in spec.items()}
    else:
        names = (
            list(trainable)
            if trainable is not None
            else [
                w
                for w in default_trainable(
                    nodes,
                    parts.initializers,
                    parts.prediction,
                    tensor_infos(parts.model),
                    parts.parameters,
                    parts.detached,
                )
                if w not in parts.buffers
            ]
        )
        for node in nodes:  # running statistics come from the checkpoint too
            if node.op_type == "BatchNormalization":
                names += [s for s in node.input[3:5] if s in parts.initializers and s not in names]
        weights = {w: tuple(int(d) for d in parts.initializers[w].dims) for w in names}
    taken = (
        {t for n in graph.node for t in [*n.input, *n.output]} | set(parts.initializers) | {i.name for i in graph.input}
    )
    taken |= {"loss_sum", "count", "correct"}
    e = Emitter(parts.opset, tensor_infos(parts.model), constant_values(graph, parts.opset), taken)
    label_input = e.reserve("label")
    e.record(label_input, label_type(loss), tuple(_label_shape(loss, e.shape(parts.prediction))))
    producers = {o: n for n in nodes for o in n.output}
    lg = emit_loss(e, loss, parts.prediction, label_input, producers, factor=None)
    for metric in chosen:
        e.op("Identity", [lg.metrics[metric]], out=metric)
    work_inputs = [_vi(w, _F32, s) for w, s in weights.items()] + list(graph.input)
    work_inputs.append(_vi(label_input, label_type(loss), e.shape(label_input)))
    work_outputs = [_vi(m, _F32, ()) for m in chosen]
    all_nodes = _live_nodes([*nodes, *e.nodes], list(chosen))
    constants = [i for n, i in parts.initializers.items() if n not in weights] + e.initializers
    work = _model("work", all_nodes, work_inputs, work_outputs, constants, parts.opset)
    return assemble_plan(
        name=name or (f"{training_plan.name}_eval" if training_plan is not None else f"{graph.name or 'model'}_eval"),
        kind="eval",
        work=work,
        weight_names=list(weights),
        weight_outputs=(),
        metric_names=chosen,
        server=server_part(weights, kind="eval", metrics=chosen, opset=parts.opset),
        selector=example_selector,
        inputs={**parts.data_inputs, label_input: label},
        class_ids={label_input: lg.classes} if lg.classes is not None else None,
        batch_size=batch_size,
        opset=parts.opset,
        metadata=training_plan.metadata if training_plan is not None else None,
    )
