"""An ONNX inference model to a training plan: forward, loss, generated backward pass and the
client optimizer's step in one ``work`` graph, and the server part with its server optimizer.

The work graph keeps the conventions of :mod:`device_runtime.plan_builder`, so the existing
executor and server run it unchanged: it takes the weights (float32) and the batch's tensors and
returns ``<weight>_new`` for every weight and the per-batch sums ``loss_sum``, ``count`` (and
``correct`` for classification). The plan's weights are the trainable initializers, the running
statistics of ``BatchNormalization`` and the client optimizer's state (see :mod:`.optimizers`).

The batch dimension of the model's inputs is made dynamic (the last batch of an epoch is short),
and the graph is emitted at the requested opset with the IR version that carries it
(:func:`device_runtime.plan.ir_version_for_opset`), with standard ONNX ops only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, external_data_helper, helper, numpy_helper

from device_runtime.executor import PlanExecutor
from device_runtime.plan import Plan, PlanError, ir_version_for_opset
from device_runtime.plan_builder import assemble_plan

from . import loops, ml_ops, old_opsets, onnx_import, peephole
from .autodiff import (
    DEFAULT_DOMAINS,
    Emitter,
    TensorInfo,
    UnsupportedOpError,
    attr,
    backward,
    constant_values,
    needed_for,
    refine_infos,
    tensor_infos,
)
from .emitter import default_opset, namer, node_reads
from .forward import is_float, training_forward
from .losses import check_loss, emit_loss, label_type, loss_metric_names
from .optimizers import SGD, Adam, Momentum, Optimizer
from .server_optimizers import FedAvg, ServerOptimizer, server_part

MIN_OPSET = 13
MAX_OPSET = 26
_F32 = TensorProto.FLOAT

ModelLike = onnx.ModelProto | bytes | str | PathLike


def load_model(model: ModelLike) -> onnx.ModelProto:
    """``model`` as a ModelProto: a ModelProto (copied), serialized bytes, or a path to a file.

    A file's external data (the dynamo exporter's ``model.onnx.data``) is read from the model's
    own folder, whatever the working directory; a missing data file, a file that is not ONNX and
    bytes that point at external data are refused in one line that says what to do."""
    if isinstance(model, onnx.ModelProto):
        out = onnx.ModelProto()
        out.CopyFrom(model)
        _check_is_model(out, "the ModelProto")
        _refuse_unread_external_data(out, "the ModelProto")
        return out
    if isinstance(model, (str, PathLike)):
        path = Path(model)
        if not path.is_file():
            raise FileNotFoundError(f"no ONNX model at {path}; pass a path to a .onnx file, its bytes, or a ModelProto")
        try:
            out = onnx.load(str(path), load_external_data=False)
        except DecodeError:
            raise PlanError(_not_onnx(path)) from None
        _check_is_model(out, str(path))
        _load_external_data(out, path)
        return out
    if isinstance(model, (bytes, bytearray, memoryview)):
        try:
            out = onnx.ModelProto.FromString(bytes(model))
        except DecodeError:
            raise PlanError(
                f"the model bytes are not an ONNX model (their protobuf does not parse); {_EXPORT_HINT}"
            ) from None
        _check_is_model(out, "the model bytes")
        _refuse_unread_external_data(out, "the model bytes")
        return out
    raise TypeError(f"model must be an onnx.ModelProto, bytes or a path, got {type(model).__name__}")


_EXPORT_HINT = (
    "export the model again, to ONNX (torch.onnx.export(module, example_inputs, 'model.onnx'), or "
    "`fedfleet plan from-torch` "
    "for a PyTorch module) and pass that file"
)


def _not_onnx(path: Path) -> str:
    """What a file that does not parse as ONNX is, when its first bytes say (torch.save writes a zip)."""
    with path.open("rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04":
        return (
            f"{path} is not an ONNX model: it is a zip archive, as torch.save writes a PyTorch checkpoint; a checkpoint "
            f"holds weights, not the graph: {_EXPORT_HINT}"
        )
    return f"{path} is not an ONNX model (its protobuf does not parse); {_EXPORT_HINT}"


def _check_is_model(model: onnx.ModelProto, what: str) -> None:
    """Refuse what parsed as protobuf but holds no ONNX graph (many byte strings parse)."""
    if not model.HasField("graph") or not model.graph.node or not model.graph.output or not model.opset_import:
        raise PlanError(f"{what} is not an ONNX model (no graph with nodes, outputs and an opset); {_EXPORT_HINT}")


def _external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in external_data_helper._get_all_tensors(model) if external_data_helper.uses_external_data(t)]


def _load_external_data(model: onnx.ModelProto, path: Path) -> None:
    """Read the tensors stored outside ``path`` from the files beside it (not the working directory)."""
    tensors = _external_tensors(model)
    if not tensors:
        return
    base = path.resolve().parent
    for tensor in tensors:
        location = external_data_helper.ExternalDataInfo(tensor).location
        if not (base / location).is_file():
            raise PlanError(
                f"{path} keeps its weights in {base / location}, which is missing; put the data file the "
                f"exporter wrote beside the model, or export without external data"
            )
    try:
        external_data_helper.load_external_data_for_model(model, str(base))
    except (onnx.checker.ValidationError, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PlanError(f"{path}: its external data could not be read ({first}); export the model again") from None


def _refuse_unread_external_data(model: onnx.ModelProto, what: str) -> None:
    tensors = _external_tensors(model)
    if tensors:
        location = external_data_helper.ExternalDataInfo(tensors[0]).location
        raise PlanError(
            f"{what} keep weights in an external data file ({location}) that bytes cannot carry; "
            "pass the model's path instead, so that the data file beside it is read"
        )


def model_opset(model: onnx.ModelProto) -> int:
    opset = default_opset(model)
    if opset is not None:
        return opset
    raise ValueError(
        "the model imports no default-domain (ai.onnx) opset: it holds no standard ONNX op; export a model of "
        "standard ops (a neural network by torch.onnx.export, or a linear model or MLP by skl2onnx)"
    )


def at_opset(model: onnx.ModelProto, opset: int | None) -> tuple[onnx.ModelProto, int]:
    """The model at the requested opset (its own when None), converted when they differ."""
    own = model_opset(model)
    target = own if opset is None else int(opset)
    if target < MIN_OPSET and opset is None:
        target = MIN_OPSET
    if not MIN_OPSET <= target <= MAX_OPSET:
        raise PlanError(f"opset {target} is not supported for generated plans; use {MIN_OPSET}..{MAX_OPSET}")
    if target > own and own < MIN_OPSET:  # the Model Zoo's and older exporters' files: onnx's converter, gaps closed
        model = old_opsets.raise_opset(model, own, target)
    elif target > own:
        try:
            model = onnx.version_converter.convert_version(model, target)
        except Exception as exc:  # noqa: BLE001 - the converter raises many kinds
            raise PlanError(
                f"the model (opset {own}) could not be converted to opset {target} ({str(exc).splitlines()[0][:200]}); "
                f"export it at opset {target} or leave opset=None"
            ) from None
    elif target < own:
        # onnx's converter cannot lower basic ops below opset 14-15: the plan versioning's own
        # rewrites between opsets do it (they refuse, naming the op, what they cannot rewrite)
        from .versioning import convert_model

        model = onnx.ModelProto.FromString(convert_model(model.SerializeToString(), target))
    return model, target


@dataclass
class ModelParts:
    """A model read for plan generation: its graph with a dynamic batch dimension and what a plan
    needs to know about it."""

    model: onnx.ModelProto
    opset: int
    data_inputs: dict[str, str]  # graph input -> example tensor name
    prediction: str
    initializers: dict[str, onnx.TensorProto]
    split: dict[str, str]  # initializer split off an exporter's deduplicated one -> that one
    lost: list[str] = field(
        default_factory=list
    )  # parameters the exporter folded or dropped (onnx_import.lost_parameters)
    # initializer several modules read -> how many (onnx_import.shared_weights, read before an opset
    # conversion, which drops the nodes' metadata)
    shared: dict[str, int] = field(default_factory=dict)
    # the module's buffers that are not running statistics (onnx_import.constant_buffers): not trained
    buffers: set[str] = field(default_factory=set)
    # Keras layers whose BatchNormalization tf2onnx folded into constants (onnx_import.tf2onnx_folded_batch_norms)
    folded_batch_norms: list[str] = field(default_factory=list)
    # a BatchNorm's running variance moves with the population variance (onnx_import.population_running_variance)
    population_running_variance: bool = False
    # a dynamo export lowered below opset 18, without the exporter's metadata (onnx_import.metadata_dropped)
    metadata_dropped: bool = False
    # the module's parameters the exported program declares (onnx_import.declared_parameters): trained
    # by default whatever their size
    parameters: set[str] = field(default_factory=set)
    # Tensor.detach()'s outputs (onnx_import.detached_tensors): no gradient flows through them
    detached: set[str] = field(default_factory=set)
    # the model's inputs fed the label that the prediction does not read (a loss computed in forward)
    label_inputs: list[str] = field(default_factory=list)


def as_trained(m: onnx.ModelProto) -> dict[str, str]:
    """``m`` in place, in the form whose initializers a plan trains, each parameter its own (the
    first steps of :func:`read_model`; a trained checkpoint goes back into a model through them,
    ``trained_model``): returns each split copy -> the initializer it was copied from."""
    onnx_import.local_functions_inlined(m)
    onnx_import.stochastic_depth_as_dropout(m)
    onnx_import.single_recurrent_bias(m)
    split = onnx_import.split_deduplicated(m)
    onnx_import.refold_tied_transposes(m)
    return split


def read_model(
    model: ModelLike,
    *,
    opset: int | None,
    output: str | None,
    inputs: Mapping[str, str] | None,
    label: str,
    loss: object = None,
) -> ModelParts:
    """``model`` read for a plan at ``opset``; with the ``cross_entropy`` loss, a prediction of shape
    [N, classes, 1, ..., 1] is read as [N, classes] (:func:`.old_opsets.classes_last`)."""
    m = load_model(model)
    folded_batch_norms = onnx_import.tf2onnx_folded_batch_norms(m)
    split = as_trained(m)
    lost = onnx_import.lost_parameters(m)
    metadata_dropped = onnx_import.metadata_dropped(m)
    shared = onnx_import.shared_weights(m.graph.node, [i.name for i in m.graph.initializer])
    buffers = onnx_import.constant_buffers(m)
    parameters = onnx_import.declared_parameters(m)
    detached = onnx_import.detached_tensors(m)
    population = onnx_import.population_running_variance(m)
    ml_ops.standard_form(m)
    buffers |= ml_ops.preprocessing_constants(m)
    _refuse_other_domains(m, output)
    m, target = at_opset(m, opset)
    _check_valid(m, target)
    onnx_import.dilated_same_padding_written_out(m)
    graph = m.graph
    inits = {i.name: i for i in graph.initializer}
    data = [i for i in graph.input if i.name not in inits]
    if not data:
        raise ValueError(
            "the model has no data inputs (every graph input is an initializer); export it with its example "
            "inputs as graph inputs (the tensors a device feeds it)"
        )
    exported_batch = {}  # data input -> the batch size it was exported at, where it is fixed
    for vi in data:  # the last batch of an epoch is short: the batch dimension must be dynamic
        dims = vi.type.tensor_type.shape.dim
        if len(dims):
            if dims[0].HasField("dim_value"):
                exported_batch[vi.name] = dims[0].dim_value
            dims[0].Clear()
            dims[0].dim_param = old_opsets.BATCH
    del graph.input[:]
    graph.input.extend(data)
    names = [i.name for i in data]
    if inputs is None:
        inputs = {n: n for n in names}
    if set(inputs) != set(names):
        raise ValueError(
            f"inputs must map each of the model's inputs {names} to an example tensor name, got {dict(inputs)}"
        )
    if output is None:
        floats = [o.name for o in graph.output if is_float(o.type.tensor_type.elem_type)]
        if not floats:
            raise ValueError(
                "the model has no float output to compute a loss from (outputs: "
                f"{', '.join(o.name for o in graph.output)}); export the model up to its float prediction "
                "(logits or scores, before ArgMax or a cast), or name the float tensor the loss reads "
                "(--output of plan from-onnx, output= in a Task)"
            )
        output = floats[0]
    produced = {o for n in graph.node for o in n.output} | set(names) | set(inits)
    if output not in produced:
        raise ValueError(f"output {output!r} is no tensor of the model")
    inputs, names, label_inputs = _label_input_dropped(graph, dict(inputs), label, output)
    if loops.unroll_control_flow(m, output):  # before the Loop's, Scan's and If's outputs are read for their shapes
        inits = {i.name: i for i in graph.initializer}
    if exported_batch:  # a Reshape to the one batch size the model was exported at (CNTK's MNIST-8)
        onnx_import.zero_copies_the_batch(m, old_opsets.unpin_batch(m, exported_batch, target))
        inits = {i.name: i for i in graph.initializer}
        pinned = onnx_import.pinned_batch(m, exported_batch)
        if pinned:
            raise PlanError(onnx_import.pinned_batch_error(max(exported_batch.values()), pinned))
    if loss == "cross_entropy":
        output = ml_ops.probabilities_as_logits(m, old_opsets.classes_last(m, output))
    output = _read_as_float32(m, output)
    if not set(names) & needed_for(graph.node, [output]):
        raise ValueError(
            f"the output {output!r} does not depend on the model's inputs ({', '.join(names)}); export the "
            "model with the example tensors it computes from as inputs that reach the output (an input the "
            "exporter traced as a constant is folded into the graph)"
        )
    return ModelParts(
        m,
        target,
        dict(inputs),
        output,
        inits,
        split,
        lost,
        shared,
        buffers,
        folded_batch_norms,
        population,
        metadata_dropped,
        parameters,
        detached,
        label_inputs,
    )


_OTHER_FLOATS = (TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _read_as_float32(m: onnx.ModelProto, output: str) -> str:
    """The prediction the loss reads, as float32: a float64, float16 or bfloat16 ``output`` (float32
    weights whose model casts its prediction, a last ``Cast`` or a mixed-precision export) is
    read through a ``Cast`` to float32 added to the graph, whose gradient casts back. The loss
    computed in the output's own type gave metrics of that type where the plan declares float32,
    a work graph onnxruntime did not load. Its type is the one the graph declares, or the ``to``
    of the ``Cast`` that makes it. A ``Cast`` of a float32 tensor is read before it instead: the
    loss then finds the ``Softmax`` or ``Sigmoid`` that makes the prediction."""
    graph = m.graph
    declared = {v.name: v.type.tensor_type.elem_type for v in [*graph.output, *graph.value_info, *graph.input]}
    elem = declared.get(output)
    producer = next((n for n in graph.node if output in n.output), None)
    cast = (
        producer if producer is not None and producer.op_type == "Cast" and producer.domain in DEFAULT_DOMAINS else None
    )
    if elem is None and cast is not None:
        elem = next((int(a.i) for a in cast.attribute if a.name == "to"), None)
    if elem not in _OTHER_FLOATS:
        return output
    if cast is not None and _elem_type(m, cast.input[0], declared) == _F32:
        # a last Cast of a float32 prediction: read before it, where the loss sees the Softmax or
        # Sigmoid that makes it (through two Casts, cross_entropy read probabilities as logits)
        return cast.input[0]
    cast = namer(graph)(f"{output}_float32")
    graph.node.append(helper.make_node("Cast", [output], [cast], to=_F32, name=cast))
    return cast


def _elem_type(m: onnx.ModelProto, tensor: str, declared: Mapping[str, int]) -> int | None:
    """``tensor``'s element type: declared, an initializer's, or as ONNX's shape inference finds it."""
    if tensor in declared:
        return declared[tensor]
    init = next((i for i in m.graph.initializer if i.name == tensor), None)
    if init is not None:
        return int(init.data_type)
    try:
        inferred = onnx.shape_inference.infer_shapes(m)
    except Exception:  # a model the inference cannot follow: its prediction is read through a Cast
        return None
    return next((v.type.tensor_type.elem_type for v in inferred.graph.value_info if v.name == tensor), None)


def _label_input_dropped(
    graph: onnx.GraphProto, inputs: dict[str, str], label: str, output: str
) -> tuple[dict[str, str], list[str], list[str]]:
    """``inputs`` (and the graph's data inputs' names) without the one fed the label where the
    prediction does not read it: a module whose forward takes the labels to compute its own loss
    beside the logits (``forward(x, y) -> (loss, logits)``, transformers' ``labels=``) reads them
    for that loss alone, and the plan's label takes their place. One the prediction reads is
    refused: one example tensor would be read as the features and as the label. Returns the inputs,
    the data inputs' names and the inputs dropped."""
    fed = [name for name, example in inputs.items() if example == label]
    if fed:
        needed = needed_for(graph.node, [output]) | {output}
        if any(name in needed for name in fed):
            other = "label" if label != "label" else "y"
            raise ValueError(
                f"the label {label!r} is an example tensor the model reads as an input, and the output "
                f"{output!r} is computed from it (a loss computed in forward?); a plan computes the loss itself from "
                "the prediction: export the model up to its logits (forward returning them, alone or beside its own "
                f"loss: --output or output= names them), or give the label a name of its own, such as {other!r}"
            )
        kept = [vi for vi in graph.input if vi.name not in fed]
        del graph.input[:]
        graph.input.extend(kept)
        inputs = {name: example for name, example in inputs.items() if name not in fed}
    return inputs, [vi.name for vi in graph.input], fed


def _refuse_other_domains(model: onnx.ModelProto, output: str | None) -> None:
    """Refuse, in one line that says what to export, a prediction computed by ops outside the
    standard domains (skl2onnx's trees are ``ai.onnx.ml`` ops: no gradient, and no plan may hold
    them; its linear models' ops were written in standard ops by :func:`.ml_ops.standard_form`) or, at opset 13 and later, by ops of the standard domain that ONNX does
    not define (what an exporter could not convert); such ops on a branch the loss does not read
    are pruned later."""
    graph = model.graph
    if output is None:
        floats = [o.name for o in graph.output if is_float(o.type.tensor_type.elem_type)]
        output = floats[0] if floats else None
    if output is None:
        return
    ml_ops.refuse_naive_bayes(model, output)  # standard ops, but no model a gradient trains
    needed = needed_for(graph.node, [output])
    # older files' experimental ops: written out by old_opsets (a file of ai.onnx.ml ops alone, such as
    # onnxmltools' XGBoost, imports no standard opset)
    current = (default_opset(model) or MIN_OPSET) >= MIN_OPSET
    for node in graph.node:
        if current and node.domain in DEFAULT_DOMAINS and set(node.output) & needed and not onnx.defs.has(node.op_type):
            raise ValueError(
                f"op {node.op_type!r} (node {node.name!r}) is no ONNX op: the exporter left it unconverted (tf2onnx "
                "writes a TensorFlow op it cannot convert as it is, such as the Erfc of TensorFlow 2.16's exact "
                "gelu); export the model with ops ONNX has (gelu(approximate=True)) or with an exporter that converts it"
            )
    others = sorted(
        {(n.domain, n.op_type) for n in graph.node if n.domain not in DEFAULT_DOMAINS and set(n.output) & needed}
    )
    if others:
        ops = ", ".join(f"{d}.{op}" for d, op in others)
        trees = " (a tree's prediction is piecewise constant: no gradient reaches its thresholds or leaves)" * any(
            op.startswith("TreeEnsemble") for _, op in others
        )
        raise ValueError(
            f"the output {output!r} is computed by {ops}: ops outside the standard ONNX domains have no gradient "
            f"and no place in a plan{trees}; export a differentiable model (skl2onnx of a linear model, whose "
            f"{', '.join(ml_ops.TRANSLATED)} a plan writes in standard ops, or of an MLPClassifier or MLPRegressor; "
            "a neural network by torch.onnx.export or `fedfleet plan from-torch`)"
        )


def _check_valid(model: onnx.ModelProto, opset: int) -> None:
    """Refuse in one line a model that is not valid ONNX at its opset, before a plan is built on it:
    torch's dynamo exporter asked for opset 17 writes opset 18's Split(num_outputs=...) into it."""
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PlanError(
            f"the model is not valid ONNX at opset {opset} ({first}); export it again, at opset 18 or later "
            "with torch's dynamo exporter, or build the plan at a later opset (opset=21)"
        ) from None


def check_ops(nodes: Sequence[onnx.NodeProto]) -> None:
    """Refuse the first node outside the standard ONNX domains, naming it.

    Any standard op runs forward (in onnxruntime); only the ops on a path along which a gradient
    flows from a trainable weight to the loss need a rule, and :func:`.autodiff.backward` refuses
    those without one by op and node."""
    for node in nodes:
        if node.domain not in DEFAULT_DOMAINS:
            raise UnsupportedOpError(
                node.op_type, node.name, f"is in domain {node.domain!r}; plans use standard ONNX ops only"
            )


def default_trainable(
    nodes: Sequence[onnx.NodeProto],
    inits: Mapping[str, onnx.TensorProto],
    prediction: str,
    infos: Mapping[str, TensorInfo] | None = None,
    parameters: Set[str] = frozenset(),
    detached: Set[str] = frozenset(),
) -> list[str]:
    """Float32 initializers of rank >= 1 on a differentiable float path to ``prediction`` (not through
    ``detached`` tensors), less one-element scales, and the declared ``parameters`` there (see
    :mod:`.onnx_import`)."""
    reached = onnx_import.on_float_path(nodes, infos or {}, prediction, detached)
    return onnx_import.default_trainable(inits, reached, onnx_import.only_scales(nodes, inits), parameters)


def _label_shape(loss, prediction_shape) -> list:
    if loss == "cross_entropy":  # one class id per example, or per position: the prediction less its class axis
        return ["N"] if prediction_shape is None else ["N", *prediction_shape[1:-1]]
    if isinstance(loss, str):
        if prediction_shape is None:
            return ["N"]
        return ["N", *prediction_shape[1:]]
    graph = loss.graph if isinstance(loss, onnx.ModelProto) else loss
    dims = graph.input[1].type.tensor_type.shape.dim
    return ["N", *[d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in dims[1:]]]


def _vi(name: str, elem: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, None if shape is None else list(shape))


def _live_nodes(nodes: Sequence[onnx.NodeProto], outputs: Sequence[str]) -> list[onnx.NodeProto]:
    needed = needed_for(nodes, outputs)
    return [n for n in nodes if any(o in needed for o in n.output if o)]


def masks_read(e: Emitter, nodes: Sequence[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` with the output of each active ``Dropout`` whose mask nothing reads taken through
    ``Where(mask, output, 0)`` (the same values): onnxruntime removes such a Dropout, active or not, so
    one no gradient passes back through (before a trained head on a frozen backbone, or on a
    stochastic depth's ones) did not drop at all."""
    read = {i for n in nodes for i in n.input}
    out: list[onnx.NodeProto] = []
    for node in nodes:
        if node.op_type != "Dropout" or len(node.input) < 3 or len(node.output) < 2 or node.output[1] in read:
            out.append(node)
            continue
        y = node.output[0]
        raw = e.fresh(f"{y}_dropped")
        copy = onnx.NodeProto()
        copy.CopyFrom(node)  # with its seed
        copy.output[0] = raw
        out.append(copy)
        zero = e.const(np.zeros((), dtype=helper.tensor_dtype_to_np_dtype(e.elem_type(node.input[0]))), "zero")
        out.append(helper.make_node("Where", [node.output[1], raw, zero], [y]))
    return out


def _model(name: str, nodes, inputs, outputs, initializers, opset: int) -> bytes:
    """The generated graph as a checked model, after the rewrites of :mod:`.peephole`."""

    def make(nodes, initializers) -> onnx.ModelProto:
        used = set().union(*(node_reads(n) for n in nodes))  # a subgraph's reads of the outer scope too
        graph = helper.make_graph(
            list(nodes), name, inputs, outputs, initializer=[i for i in initializers if i.name in used]
        )
        return helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", opset)],
            producer_name="fedfleet.toolchain",
            ir_version=ir_version_for_opset(opset),
        )

    model = make(nodes, initializers)
    shapes = peephole.inferred_shapes(model)
    ranks = {name: len(shape) for name, shape in shapes.items()}
    model = make(*peephole.rank_matched_constants(model.graph.node, model.graph.initializer, ranks))
    model = make(*peephole.short_broadcasts_expanded(model.graph.node, model.graph.initializer, shapes))
    onnx.checker.check_model(model)
    return model.SerializeToString()


@dataclass(frozen=True)
class OnnxTrainingPlan:
    """A generated training plan and what a person should see of it: the tensors it trains."""

    plan: Plan
    trainable: dict[str, tuple[int, ...]]  # trained initializer -> its shape, in the model's order
    split: dict[str, str]  # parameter given its own weight again -> the initializer an exporter merged it into
    shared: dict[str, int]  # trained weight the model itself shares -> how many modules (or nodes) read it
    # what a person should know before training it, one line each (an eval-mode export, lost parameters)
    warnings: tuple[str, ...] = ()
    lost: tuple[
        str, ...
    ] = ()  # parameters the exporter folded or dropped, which the plan cannot train as the module does


def training_plan_from_onnx(model: ModelLike, **kwargs: Any) -> Plan:
    """A training plan for ``model``; the arguments are :func:`onnx_training_plan`'s."""
    return onnx_training_plan(model, **kwargs).plan


def onnx_training_plan(
    model: ModelLike,
    *,
    label: str,
    loss,
    optimizer: Optimizer,
    trainable: Sequence[str] | None = None,
    frozen: Sequence[str] = (),
    frozen_rows: Mapping[str, Sequence[int]] | None = None,
    output: str | None = None,
    metrics: Sequence[str] | None = None,
    batch_size: int,
    epochs: int = 1,
    opset: int | None = None,
    server_optimizer: ServerOptimizer = FedAvg(),
    secure_aggregation: bool = False,
    example_selector,
    inputs: Mapping[str, str] | None = None,
    name: str | None = None,
    shuffle_seed: int | None = 0,
    shuffle_buffer: int = 1024,
    min_runtime_version: str | None = None,
    max_runtime_version: str | None = None,
    memory_budget_mb: int | None = None,
    time_budget_s: float | None = None,
    bitwidth: int = 24,
    clip_range: float = 1024.0,
    resume_examples: bool = False,
    dropout_seed: int | None = 0,
) -> OnnxTrainingPlan:
    """A training plan for ``model`` (an ONNX inference model: ModelProto, bytes or path).

    ``label`` names the example tensor holding the label; ``inputs`` maps the model's inputs to
    example tensor names (default: the same names); ``output`` is the model tensor the loss reads
    (default: its first float output). ``loss`` is ``"cross_entropy"`` (class ids), ``"binary_cross_entropy"``,
    ``"mse"`` or an ONNX graph (prediction, label) -> the batch's mean loss. ``trainable`` names the
    initializers to train, exactly or by glob pattern (default: every float32 initializer of rank >= 1
    on a differentiable float path to the output: not a one-element tensor that only scales, such
    as an attention scale, nor one that feeds only shape arithmetic); ``frozen`` patterns take tensors out of that
    set; the others stay constants. A pattern that matches no initializer is refused. ``frozen_rows``
    maps trained weights to rows (indices on their first axis) that no gradient reaches, as torch's
    ``nn.Embedding(padding_idx=...)`` keeps its padding row (exporters drop that argument; ``plan
    from-torch`` reads it from the module): of a weight looked up by row (``Gather``), the lookups'
    gradient alone, so that an output layer tied to the embedding still trains the row, as in
    torch; of any other weight, its whole gradient. ``metrics``
    picks among the loss's per-batch sums (default all: ``loss_sum``, ``count`` and, for
    classification, ``correct``). Parameters an exporter merged into one initializer (read through
    ``Identity`` nodes, or named in the dynamo exporter's node metadata) get weights of their own
    (:func:`.onnx_import.split_deduplicated`); weights the model itself ties stay one and are listed
    in the plan's metadata (``shared_weights``); parameters the exporter folded or dropped are
    warned of (``OnnxTrainingPlan.warnings``).

    Raises :class:`UnsupportedOpError` naming the op and node of a node without a gradient rule
    (:data:`OP_COVERAGE`) on a path along which a gradient flows from a trainable weight to the loss
    (integer, boolean and shape paths and float paths no trainable weight reaches need none), and
    ``ValueError``/``PlanError`` for arguments that cannot make a plan.

    ``dropout_seed`` seeds active ``Dropout`` nodes so that a session is reproducible (every device
    then draws the same sequence of masks); ``None`` leaves them to onnxruntime's randomness."""
    check_loss(loss)
    if not isinstance(optimizer, (SGD, Momentum, Adam)):
        raise TypeError(
            f"optimizer must be SGD(lr), Momentum(lr, beta) or Adam(lr, ...), got {type(optimizer).__name__}"
        )
    if batch_size < 1 or epochs < 1:
        raise ValueError("batch_size and epochs must be >= 1")
    parts = read_model(model, opset=opset, output=output, inputs=inputs, label=label, loss=loss)
    graph = parts.model.graph
    chosen_metrics = _metrics(loss, metrics)

    infos = tensor_infos(parts.model)
    taken = (
        {t for n in graph.node for t in [*n.input, *n.output]} | set(parts.initializers) | {i.name for i in graph.input}
    )
    taken |= {"loss_sum", "count", "correct"}
    e = Emitter(parts.opset, infos, constant_values(graph, parts.opset, infos), taken)
    fw = training_forward(
        e,
        list(graph.node),
        set(parts.initializers),
        dropout_seed,
        unbiased_running_variance=not parts.population_running_variance,
    )
    nodes = _live_nodes(fw.nodes, [parts.prediction, *fw.state_updates.values(), *e.saved_by_composites()])
    check_ops(nodes)
    # shapes of the rewritten forward (the rules read them)
    probe = helper.make_model(
        helper.make_graph(
            nodes,
            "probe",
            list(graph.input),
            [_vi(parts.prediction, 0, None)],
            initializer=[*parts.initializers.values(), *e.initializers],
        ),
        opset_imports=[helper.make_opsetid("", parts.opset)],
        ir_version=ir_version_for_opset(parts.opset),
    )
    refine_infos(e.infos, tensor_infos(probe))

    reached = onnx_import.on_float_path(nodes, e.infos, parts.prediction, parts.detached)
    quantized = onnx_import.quantized_weight(nodes, parts.initializers, parts.prediction) if trainable is None else None
    if quantized is not None:  # its layers behind the rounding would be left out of training without a word
        raise ValueError(quantized)
    weights = onnx_import.select_trainable(
        parts.initializers,
        reached,
        trainable,
        frozen,
        statistics=set(fw.state_updates),
        buffers=parts.buffers,
        scales=onnx_import.only_scales(nodes, parts.initializers),
        parameters=parts.parameters,
    )
    if not weights:
        raise ValueError(onnx_import.nothing_to_train(nodes, e.infos, parts.initializers, parts.prediction))
    stats = [s for s in fw.state_updates if s not in weights]

    label_input = e.reserve("label")
    e.record(label_input, label_type(loss), tuple(_label_shape(loss, e.shape(parts.prediction))))
    producers = {o: n for n in nodes for o in n.output}
    factor = float(optimizer.lr) if optimizer.folds_lr else 1.0
    lg = emit_loss(e, loss, parts.prediction, label_input, producers, factor=factor)
    # frozen rows of a weight looked up by row (an embedding's padding row) are kept out of its lookups'
    # gradient alone, as torch's padding_idx: a tied output layer still trains them
    row_masks = {
        w: e.const(_row_mask(parts.initializers[w].dims, rows))
        for w, rows in _checked_rows(frozen_rows or {}, weights, parts.initializers).items()
    }
    looked_up = {n.input[0] for n in nodes if n.op_type == "Gather" and int(attr(n, "axis", 0)) == 0}
    lookup_masks = {w: m for w, m in row_masks.items() if w in looked_up}
    grads = backward(e, [*nodes, *lg.nodes], lg.seeds, weights, lookup_masks, parts.detached)
    missing = [w for w, g in grads.items() if g is None]
    if missing:
        raise ValueError(f"the loss does not depend on {missing}; leave them out of trainable")
    grad_of = {w: g for w, g in grads.items() if g is not None}
    for w, mask in row_masks.items():
        if w not in lookup_masks:
            grad_of[w] = e.op("Mul", [grad_of[w], mask])

    slots = optimizer.slots(e, weights)
    slot_values = {s.name: s.name for s in slots}
    shared = {s.name: s.name for s in slots if s.weight is None}
    if isinstance(optimizer, Adam):
        shared = optimizer.shared_step(e, shared)
    outputs_of: dict[str, str] = {}  # weight (incl. state) -> its new-value output name
    new_values: dict[str, str] = {}
    for w in weights:
        out = e.reserve(f"{w}_new")
        mine = {s.name: slot_values[s.name] for s in slots if s.weight == w}
        new_values.update(optimizer.step(e, w, grad_of[w], mine, shared, out))
        outputs_of[w] = out
    for s in slots:
        new_values.setdefault(s.name, shared.get(s.name, s.name))
    for stat in stats:
        new_values[stat] = fw.state_updates[stat]
    for state_name, tensor in new_values.items():
        outputs_of[state_name] = e.op("Identity", [tensor], out=e.reserve(f"{state_name}_new"))
    for metric in chosen_metrics:
        e.op("Identity", [lg.metrics[metric]], out=metric)

    weight_names = [*weights, *stats, *[s.name for s in slots]]
    shapes = {w: tuple(int(d) for d in parts.initializers[w].dims) for w in [*weights, *stats]}
    shapes.update({s.name: shapes[s.weight] if s.weight is not None else () for s in slots})
    work_inputs = [_vi(w, _F32, shapes[w]) for w in weight_names]
    work_inputs += list(graph.input)
    work_inputs.append(_vi(label_input, label_type(loss), e.shape(label_input)))
    work_outputs = [_vi(outputs_of[w], _F32, shapes[w]) for w in weight_names]
    work_outputs += [_vi(m, _F32, ()) for m in chosen_metrics]
    all_nodes = masks_read(e, _live_nodes([*nodes, *e.nodes], [o.name for o in work_outputs]))
    constants = [i for n, i in parts.initializers.items() if n not in weight_names] + e.initializers
    work = _model("work", all_nodes, work_inputs, work_outputs, constants, parts.opset)

    shared_weights = {w: parts.shared[w] for w in weights if w in parts.shared}
    reset = [s.name for s in slots] if not optimizer.carry_state else []
    server = server_part(
        shapes,
        kind="train",
        metrics=chosen_metrics,
        opset=parts.opset,
        trainable=weights,
        reset=reset,
        optimizer=server_optimizer,
        secure_sum=secure_aggregation,
        bitwidth=bitwidth,
        clip_range=clip_range,
    )
    plan = assemble_plan(
        name=name or (graph.name or "model"),
        kind="train",
        work=work,
        weight_names=weight_names,
        weight_outputs=[outputs_of[w] for w in weight_names],
        metric_names=chosen_metrics,
        server=server,
        selector=example_selector,
        inputs={**parts.data_inputs, label_input: label},
        class_ids={label_input: lg.classes} if lg.classes is not None else None,
        batch_size=batch_size,
        epochs=epochs,
        shuffle_seed=shuffle_seed,
        shuffle_buffer=shuffle_buffer,
        resume=resume_examples,
        opset=parts.opset,
        min_runtime_version=min_runtime_version,
        max_runtime_version=max_runtime_version,
        memory_budget_mb=memory_budget_mb,
        time_budget_s=time_budget_s,
        shared_weights=list(shared_weights),
    )
    warnings: tuple[str, ...] = ()
    if parts.folded_batch_norms:  # tf2onnx's folding, known by name (its Dropout is gone in any conversion)
        warnings += (onnx_import.folded_batch_norm_warning(parts.folded_batch_norms),)
    elif parts.model.producer_name != onnx_import.TF2ONNX and onnx_import.exported_for_inference(
        graph.node, parts.initializers
    ):
        warnings += (onnx_import.EVAL_MODE_WARNING,)
    if parts.label_inputs:
        own = f"its {loss} loss" if isinstance(loss, str) else "the task's loss graph"
        warnings += (
            f"the model's input {parts.label_inputs[0]!r} is the label {label!r}, which the prediction "
            f"{parts.prediction!r} does not read (the model computes a loss of its own from it?): the plan trains "
            f"{parts.prediction!r} with {own} on the label, not with the model's",
        )
    if parts.lost:
        warnings += (onnx_import.lost_parameters_warning(parts.lost),)
    elif parts.metadata_dropped:
        warnings += (onnx_import.METADATA_DROPPED_WARNING,)
    return OnnxTrainingPlan(
        plan, {w: shapes[w] for w in weights}, dict(parts.split), shared_weights, warnings, tuple(parts.lost)
    )


def _checked_rows(
    frozen_rows: Mapping[str, Sequence[int]], weights: Sequence[str], inits: Mapping[str, onnx.TensorProto]
) -> dict[str, tuple[int, ...]]:
    """``frozen_rows`` with every weight trained and every row on its first axis, else ``ValueError``."""
    out: dict[str, tuple[int, ...]] = {}
    for w, rows in frozen_rows.items():
        if w not in weights:
            raise ValueError(f"frozen_rows names {w!r}, which the plan does not train; name one of {list(weights)}")
        size = int(inits[w].dims[0])
        bad = [r for r in rows if not isinstance(r, int) or isinstance(r, bool) or not -size <= r < size]
        if bad:
            raise ValueError(f"frozen_rows[{w!r}] holds {bad[0]!r}, not a row of its {size}")
        out[w] = tuple(sorted({r % size for r in rows}))
    return out


def _row_mask(dims: Sequence[int], rows: Sequence[int]) -> np.ndarray:
    """Ones of shape [dims[0], 1, ...] (broadcasting over the rest) with zeros at ``rows``."""
    mask = np.ones((int(dims[0]),) + (1,) * (len(dims) - 1), dtype=np.float32)
    mask[list(rows)] = 0.0
    return mask


def _metrics(loss, metrics: Sequence[str] | None) -> tuple[str, ...]:
    available = loss_metric_names(loss)
    if metrics is None:
        return available
    unknown = sorted(set(metrics) - set(available))
    if unknown:
        raise ValueError(f"metrics {unknown} are not computed for this loss; choose among {available}")
    chosen = [m for m in available if m in metrics]
    if "count" not in chosen:
        chosen.append("count")  # the server divides the sums by it
    return tuple(chosen)


def initial_weights_from_onnx(model: ModelLike, plan: Plan) -> dict[str, np.ndarray]:
    """The plan's starting checkpoint: the model's values for its trained initializers and
    running statistics, zeros for the optimizer state."""
    loaded = load_model(model)
    onnx_import.split_deduplicated(loaded)  # the plan's names for parameters an exporter merged
    ml_ops.standard_form(loaded)  # a linear model's weights, attributes of its ai.onnx.ml op
    inits = {i.name: numpy_helper.to_array(i) for i in loaded.graph.initializer}
    spec = PlanExecutor(plan).weight_spec()
    out = {}
    for w, (shape, _dtype) in spec.items():
        value = inits.get(w)
        out[w] = (
            np.asarray(value, dtype=np.float32).reshape(shape)
            if value is not None
            else np.zeros(shape, dtype=np.float32)
        )
    return out
