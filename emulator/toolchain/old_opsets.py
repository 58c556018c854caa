"""Models written below opset 13 (the ONNX Model Zoo's files at opsets 7-12 from CNTK, MXNet and
Caffe2, torch's classic exporter at ``opset_version`` 9-12) as a plan takes them.

A plan is generated at opset 13 or later: such a model is raised by onnx's version converter,
which has gaps this module closes before it runs, and leaves shapes that were fine for the one
batch the model was exported at:

* the converter keeps the file's IR version: below 4 every initializer must also be a graph input,
  which its new initializers (the pads of ``Pad``) are not, so the raised model is stamped with the
  IR version of its new opset (:func:`raise_opset`);
* ``BatchNormalization`` of opsets 7-13 in training mode has five outputs (the running and saved
  statistics), which the converter refuses to take past opset 14; a plan computes the statistics
  itself, so the outputs nothing reads are dropped first;
* ``Upsample`` and opset 10's ``Resize`` become opset 11's ``Resize`` with the coordinates they
  computed (``asymmetric``, nearest flooring), not its half-pixel default;
* the experimental ``ImageScaler``, ``Affine`` and ``ScaledTanh`` of opsets 1-9, which later opsets
  dropped, are written in the standard ops they compute;
* ``is_test=0`` (opset 6) and ``spatial=0`` over one value per channel (opsets 7-8), which the
  converter refuses and which change nothing a plan computes, are set to 1;
* opset 8's ``Scan``, which scans a batch axis of its own and which the converter rewrites by
  dropping its sequence lengths alone (its body then reads a whole batch as one position), is
  refused in one line naming it (:func:`raise_opset`);
* an op the converter still cannot raise is refused in one line naming the node, the op and the
  opsets (:func:`failing_node`);
* a ``Reshape`` to a constant shape that holds the batch size the model was exported at (CNTK's
  MNIST-8 flattens its features to [1, 256]) reshapes to the batch it is given
  (:func:`unpin_batch`);
* a classifier's prediction of shape [N, classes, 1, ..., 1] (SqueezeNet's ``GlobalAveragePool``
  and ``Softmax``) is read as [N, classes] by the cross-entropy, through the softmax the
  converter wrote for opset 12's flattening one (:func:`classes_last`).

Softmax and LogSoftmax below opset 13 normalize over every axis from ``axis`` on; the converter
writes that as ``Flatten``, the op and ``Reshape`` back (the op alone where ``axis`` is the last),
so a plan computes what the model computed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from device_runtime.plan import PlanError, ir_version_for_opset

from .autodiff import DEFAULT_DOMAINS, constant_values
from .emitter import UnsupportedOpError, namer, subgraphs

#: The batch symbol the batch axis of the data inputs is given while it is followed through the graph.
BATCH = "N"
_SOFTMAXES = ("Softmax", "LogSoftmax")


def raise_opset(model: onnx.ModelProto, own: int, target: int) -> onnx.ModelProto:
    """``model`` (opset ``own``) raised to opset ``target`` by onnx's version converter, with the
    gaps of the module docstring closed; a node the converter cannot raise is refused by name."""
    if own < 9:
        _refuse_batched_scans(model.graph)
    model = _copy(model)
    if own < 14 <= target:
        _drop_unread_batch_norm_outputs(model, own)
    _experimental_ops_written_out(model)
    _modes_the_converter_takes(model, own)
    try:
        raised = onnx.version_converter.convert_version(model, target)
    except Exception as exc:  # noqa: BLE001 - the converter raises many kinds
        raise PlanError(failing_node(model, own, target, exc)) from None
    if own < 11:  # every Resize of the raised model was an Upsample or opset 10's Resize
        for node in raised.graph.node:
            if node.op_type == "Resize" and node.domain in DEFAULT_DOMAINS:
                _asymmetric(node)
    raised.ir_version = max(raised.ir_version, ir_version_for_opset(target))
    return raised


def _refuse_batched_scans(graph: onnx.GraphProto) -> None:
    """:class:`UnsupportedOpError` for opset 8's first ``Scan`` of ``graph`` or its subgraphs."""
    for node in graph.node:
        if node.op_type == "Scan" and node.domain in DEFAULT_DOMAINS:
            raise UnsupportedOpError(
                "Scan",
                node.name or node.output[0],
                "is opset 8's Scan, which scans a batch axis of its own and which onnx's version converter does "
                "not rewrite as a later Scan; export the model at opset 9 or later",
            )
        for g in subgraphs(node):
            _refuse_batched_scans(g)


def _asymmetric(resize: onnx.NodeProto) -> None:
    """An opset-11 ``Resize`` the converter wrote for an ``Upsample`` or opset 10's ``Resize``, told
    to map coordinates as they did (``x_in = x_out / scale``, nearest flooring it), in place."""
    attrs = {a.name: a for a in resize.attribute if a.name not in ("coordinate_transformation_mode", "nearest_mode")}
    attrs["coordinate_transformation_mode"] = helper.make_attribute("coordinate_transformation_mode", "asymmetric")
    if "mode" not in attrs or helper.get_attribute_value(attrs["mode"]) == b"nearest":
        attrs["nearest_mode"] = helper.make_attribute("nearest_mode", "floor")
    del resize.attribute[:]
    resize.attribute.extend(attrs.values())


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


_EXPERIMENTAL = ("ImageScaler", "Affine", "ScaledTanh")


def _experimental_ops_written_out(model: onnx.ModelProto) -> None:
    """The experimental ops of opsets 1-9 that later opsets dropped and the converter cannot raise,
    in the standard ops they compute, in place: ``ImageScaler`` (the input scaling of the Model
    Zoo's tiny YOLOv2 and CNTK's files: ``x * scale + bias`` per channel), ``Affine``
    (``alpha * x + beta``) and ``ScaledTanh`` (``alpha * tanh(beta * x)``). Their attributes'
    values become ``Constant`` nodes: no initializer, so never a trained weight."""
    graph = model.graph
    if not any(n.op_type in _EXPERIMENTAL and n.domain in DEFAULT_DOMAINS for n in graph.node):
        return
    fresh = namer(graph)
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.domain in DEFAULT_DOMAINS and node.op_type in _EXPERIMENTAL:
            nodes += _written_out(node, fresh)
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def _written_out(node: onnx.NodeProto, fresh: Callable[[str], str]) -> list[onnx.NodeProto]:
    """One experimental node (:data:`_EXPERIMENTAL`) as the standard ops it computes."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    x, y = node.input[0], node.output[0]
    out: list[onnx.NodeProto] = []

    def const(value, hint: str) -> str:
        name = fresh(f"{y}_{hint}")
        out.append(
            helper.make_node(
                "Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, np.float32), name), name=name
            )
        )
        return name

    if node.op_type == "ScaledTanh":
        inner, tanh = fresh(f"{y}_inner"), fresh(f"{y}_tanh")
        beta, alpha = const(attrs.get("beta", 1.0), "beta"), const(attrs.get("alpha", 1.0), "alpha")
        return [
            *out,
            helper.make_node("Mul", [x, beta], [inner], name=inner),
            helper.make_node("Tanh", [inner], [tanh], name=tanh),
            helper.make_node("Mul", [tanh, alpha], [y], name=node.name),
        ]
    if node.op_type == "ImageScaler":
        scale = attrs.get("scale", 1.0)
        bias = np.asarray(attrs.get("bias", [0.0]), np.float32).reshape(1, -1, 1, 1)
    else:  # Affine
        scale, bias = attrs.get("alpha", 1.0), attrs.get("beta", 0.0)
    scaled = fresh(f"{y}_scaled")
    by, plus = const(scale, "scale"), const(bias, "bias")
    return [
        *out,
        helper.make_node("Mul", [x, by], [scaled], name=scaled),
        helper.make_node("Add", [scaled, plus], [y], name=node.name),
    ]


def _modes_the_converter_takes(model: onnx.ModelProto, own: int) -> None:
    """Attributes the converter refuses where they change nothing a plan computes, in place:
    ``is_test=0`` of opset 6's ``BatchNormalization`` and ``Dropout`` (a plan trains both in their
    training form and evaluates them in their inference form, whatever the file says) becomes 1,
    and ``spatial=0`` of a ``BatchNormalization`` of opsets 7-8 whose scale is one value per channel
    (a normalization over a 2-D [N, C] input: the same either way) becomes 1. A per-activation
    ``spatial=0`` (a scale per channel and position) stays, and is refused by the converter."""
    if own >= 9:
        return
    graph = model.graph
    scales = {i.name: len(i.dims) for i in graph.initializer}
    for node in graph.node:
        if node.domain not in DEFAULT_DOMAINS or node.op_type not in ("BatchNormalization", "Dropout"):
            continue
        for a in node.attribute:
            if a.name == "is_test" and own < 7 and a.i == 0:
                a.i = 1
            elif a.name == "spatial" and a.i == 0 and len(node.input) > 1 and scales.get(node.input[1]) == 1:
                a.i = 1


def _drop_unread_batch_norm_outputs(model: onnx.ModelProto, own: int) -> None:
    """The running and saved statistics a training-mode ``BatchNormalization`` (opsets 7-13) also
    returns, dropped where nothing reads them; one that is read is refused, naming the node."""
    graph = model.graph
    read = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    for node in graph.node:
        if node.op_type != "BatchNormalization" or node.domain not in DEFAULT_DOMAINS or len(node.output) <= 1:
            continue
        used = [o for o in node.output[1:] if o and o in read]
        if used:
            raise PlanError(
                f"node {node.name or node.output[0]!r} (BatchNormalization, opset {own}) returns its batch statistics "
                f"({', '.join(used)}) to other nodes, which no opset from 14 on can express; export the model in train "
                "mode at opset 14 or later (torch.onnx.export(..., opset_version=17)), or with only its output read"
            )
        del node.output[1:]


def failing_node(model: onnx.ModelProto, own: int, target: int, exc: BaseException) -> str:
    """The one-line refusal of a model the converter could not raise: the first node that, alone in
    a model, does not convert, or the converter's own message where every node alone does."""
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    export = (
        "export the model again at opset 13 or later (torch.onnx.export(..., opset_version=17), tf2onnx --opset 17), "
        "or write that node in standard ops in the file"
    )
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - then the nodes are tried untyped
        inferred = model
    types = {v.name: v for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.domain not in DEFAULT_DOMAINS:
            continue
        if not onnx.defs.has(node.op_type):
            return (
                f"node {node.name or node.output[0]!r} ({node.op_type}, opset {own}) is an experimental op that later "
                f"opsets dropped: onnx's version converter cannot raise it to opset {target}; {export}"
            )
        inputs = [
            types.get(i) or helper.make_tensor_value_info(i, onnx.TensorProto.FLOAT, None) for i in node.input if i
        ]
        outputs = [
            types.get(o) or helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in node.output if o
        ]
        single = helper.make_model(
            helper.make_graph([node], "one", inputs, outputs, initializer=[inits[i] for i in node.input if i in inits]),
            opset_imports=[helper.make_opsetid("", own)],
            ir_version=max(model.ir_version, 4),
        )
        try:
            onnx.version_converter.convert_version(single, target)
        except Exception:  # noqa: BLE001
            return (
                f"node {node.name or node.output[0]!r} ({node.op_type}, opset {own}) cannot be raised to opset {target} "
                f"by onnx's version converter ({first}); {export}"
            )
    return f"the model (opset {own}) could not be converted to opset {target} ({first}); {export}"


def unpin_batch(model: onnx.ModelProto, batch: Mapping[str, int], opset: int) -> list[str]:
    """Each ``Reshape`` to a constant shape whose first entry is the batch size the model was
    exported at (``batch``: data input -> its static first dimension) and whose data carries the
    batch axis first, rewritten to keep the batch it is given (the entry 0, which copies it), in
    place; returns the rewritten nodes' names. The data inputs' batch axes must already be
    :data:`BATCH`. A constant shape of another first entry, without 0 or -1, on such data cannot
    take another batch size and is refused, naming the node."""
    sizes = set(batch.values())
    if not sizes:
        return []
    graph = model.graph
    del graph.value_info[:]  # shapes inferred at the exported batch size (the converter's, the exporter's)
    for out in graph.output:
        dims = out.type.tensor_type.shape.dim
        if len(dims) and dims[0].HasField("dim_value") and dims[0].dim_value in sizes:
            dims[0].Clear()
            dims[0].dim_param = BATCH
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - a model shape inference cannot read is left as it is
        return []
    shapes = {v.name: v.type.tensor_type.shape for v in [*inferred.graph.value_info, *inferred.graph.input]}
    values = constant_values(graph, opset)  # initializers, Constant nodes and shape arithmetic of them
    inits = {i.name: i for i in graph.initializer}
    readers: dict[str, int] = {}
    for node in graph.node:
        for i in node.input:
            readers[i] = readers.get(i, 0) + 1
    done = []
    for node in graph.node:
        if node.op_type != "Reshape" or node.domain not in DEFAULT_DOMAINS or len(node.input) < 2:
            continue
        shape = shapes.get(node.input[0])
        if shape is None or not shape.dim or shape.dim[0].dim_param != BATCH:
            continue
        target = values.get(node.input[1])
        if target is None:
            continue
        if target.ndim != 1 or not target.size or (target == 0).any():
            continue
        if int(target[0]) not in sizes:
            if not (target == -1).any():
                raise PlanError(
                    f"node {node.name or node.output[0]!r} (Reshape) reshapes its batch of examples to the constant shape "
                    f"{target.tolist()}, which holds the batch size it was exported at: no other batch fits it; export "
                    "the model with a dynamic batch axis (torch.onnx.export(..., dynamic_axes={'x': {0: 'batch'}}))"
                )
            continue
        kept = target.astype(np.int64)
        kept[0] = 0
        source = inits.get(node.input[1])
        if source is not None and readers[source.name] == 1:
            source.CopyFrom(numpy_helper.from_array(kept, source.name))
        else:  # computed by Constant nodes (torch's view(x.size(0), -1) traced at a fixed batch), or read by
            # other nodes too: a constant of its own
            name = namer(graph)(f"{node.input[1]}_batch")
            graph.initializer.append(numpy_helper.from_array(kept, name))
            node.input[1] = name
        done.append(node.name or node.output[0])
    return done


def classes_last(model: onnx.ModelProto, prediction: str) -> str:
    """The tensor a cross-entropy reads for a prediction of shape [N, classes, 1, ..., 1] (a
    classifier ending in ``GlobalAveragePool``): the converter's 2-D softmax where the prediction
    is its ``Reshape`` back (SqueezeNet's opset-7 ``Softmax``), else a ``Flatten`` of it added to
    the graph; ``prediction`` itself for any other shape."""
    graph = model.graph
    declared = {o.name: o for o in graph.output}.get(prediction)
    if not _classes_then_ones(declared):
        try:  # with the values of Shape nodes, which the converter's Reshape back reads
            inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
        except Exception:  # noqa: BLE001 - a model shape inference cannot read is left as it is
            return prediction
        found = {v.name: v for v in [*inferred.graph.value_info, *inferred.graph.output]}.get(prediction)
        if not _classes_then_ones(found):
            return prediction
    softmax = _flattened_softmax(graph, prediction)
    if softmax is not None:
        return softmax
    flat = namer(graph)(f"{prediction}_classes")
    graph.node.append(helper.make_node("Flatten", [prediction], [flat], axis=1, name=flat))
    return flat


def _flattened_softmax(graph: onnx.GraphProto, tensor: str) -> str | None:
    """The 2-D output of the softmax ``tensor`` is the ``Reshape`` back of, where it is the
    converter's form of an opset-12 softmax over axis 1 (``Reshape(Softmax(Flatten(x)), Shape(x))``)."""
    producers = {o: n for n in graph.node for o in n.output}
    reshape = producers.get(tensor)
    if reshape is None or reshape.op_type != "Reshape" or len(reshape.input) < 2:
        return None
    softmax, shape_of = producers.get(reshape.input[0]), producers.get(reshape.input[1])
    if softmax is None or softmax.op_type not in _SOFTMAXES or shape_of is None or shape_of.op_type != "Shape":
        return None
    flatten = producers.get(softmax.input[0])
    if (
        flatten is None
        or flatten.op_type != "Flatten"
        or next((a.i for a in flatten.attribute if a.name == "axis"), 1) != 1
        or shape_of.input[0] != flatten.input[0]
    ):
        return None
    return softmax.output[0]


def _classes_then_ones(value: onnx.ValueInfoProto | None) -> bool:
    """Whether ``value`` is known to be of shape [N, classes, 1, ..., 1] (at least one 1)."""
    if value is None or not value.type.tensor_type.HasField("shape"):
        return False
    dims = value.type.tensor_type.shape.dim
    return (
        len(dims) >= 3
        and dims[1].HasField("dim_value")
        and all(d.HasField("dim_value") and d.dim_value == 1 for d in dims[2:])
    )
