"""Which of an exported model's initializers a training plan trains.

Exporters store more than weights as float initializers: an attention scale of shape [1], the
shape a ``Reshape`` takes, the exponent of a ``Pow``. By default a plan trains the float32
initializers of rank >= 1 that reach the prediction along a differentiable path, except the
one-element ones that only scale;
``trainable`` and ``frozen`` glob patterns (:func:`fnmatch.fnmatchcase` on initializer names) say
otherwise. Pure functions over the graph: nodes, initializers and tensor types in, names out.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Mapping, Sequence, Set
from fnmatch import fnmatchcase
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from .autodiff import TensorInfo
from .emitter import namer, node_reads, subgraphs
from .forward import is_float
from .gradients import NO_GRADIENT

_F32 = TensorProto.FLOAT
_REDUCE = (
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceSumSquare",
)
#: Input slots that carry shapes, indices, axes, hyperparameters or statistics: no gradient reaches
#: an initializer through them, so it does not train by default.
NON_DIFFERENTIABLE_INPUTS: dict[str, frozenset[int]] = {
    "Reshape": frozenset({1}),
    "Expand": frozenset({1}),
    "Tile": frozenset({1}),
    "Slice": frozenset({1, 2, 3, 4}),
    "Pad": frozenset({1, 3}),
    "Squeeze": frozenset({1}),
    "Unsqueeze": frozenset({1}),
    "Split": frozenset({1}),
    "Resize": frozenset({1, 2, 3}),
    "Upsample": frozenset({1}),
    "Gather": frozenset({1}),
    "GatherElements": frozenset({1}),
    "GatherND": frozenset({1}),
    "ScatterND": frozenset({1}),
    "ScatterElements": frozenset({1}),
    "TopK": frozenset({1}),
    "CumSum": frozenset({1}),
    "Trilu": frozenset({1}),
    "Where": frozenset({0}),
    "Pow": frozenset({1}),
    "Clip": frozenset({1, 2}),
    "Dropout": frozenset({1, 2}),
    "BatchNormalization": frozenset({3, 4}),
    "ConstantOfShape": frozenset({0}),
    **{op: frozenset({1}) for op in _REDUCE},
}


class TrainableError(ValueError):
    """A ``trainable`` or ``frozen`` pattern that selects nothing, or a tensor that cannot train."""


def on_float_path(
    nodes: Sequence[onnx.NodeProto],
    infos: Mapping[str, TensorInfo],
    prediction: str,
    detached: Set[str] = frozenset(),
) -> set[str]:
    """The tensors from which ``prediction`` is reached through differentiable float inputs
    (``nodes`` in topological order): a tensor outside it feeds only shape arithmetic, integer or
    boolean paths, ``detached`` tensors (see :func:`detached_tensors`), or branches the prediction
    does not read. What a subgraph reads of the outer scope (an ``If`` branch's weights) reaches
    the node's outputs as its inputs do."""
    reached = {prediction}
    for node in reversed(nodes):
        if node.op_type in NO_GRADIENT or not any(o in reached and o not in detached for o in node.output if o):
            continue
        skip = NON_DIFFERENTIABLE_INPUTS.get(node.op_type, frozenset())
        read = [name for k, name in enumerate(node.input) if k not in skip]
        for name in [*read, *sorted(node_reads(node) - set(node.input))]:
            info = infos.get(name)
            if name and (info is None or is_float(info.elem_type)):
                reached.add(name)
    return reached


def _size(init: onnx.TensorProto) -> int:
    return int(np.prod([int(d) for d in init.dims])) if len(init.dims) else 1


def only_scales(nodes: Sequence[onnx.NodeProto], inits: Mapping[str, onnx.TensorProto]) -> set[str]:
    """One-element initializers that every reader multiplies or divides by (an attention scale) or
    expands (a fill value: the zero paddle2onnx expands into an RNN's initial state); a one-element
    bias (a single-output regressor's) is a parameter and not among them."""
    readers: dict[str, set[str]] = {}
    for node in nodes:
        for name in node.input:
            if name in inits:
                readers.setdefault(name, set()).add(node.op_type)
    return {n for n, ops in readers.items() if _size(inits[n]) == 1 and (ops <= {"Mul", "Div"} or ops == {"Expand"})}


def default_trainable(
    inits: Mapping[str, onnx.TensorProto],
    reached: Set[str],
    scales: Set[str] = frozenset(),
    parameters: Set[str] = frozenset(),
) -> list[str]:
    """Float32 initializers of rank >= 1 on a float path to the prediction, less the one-element
    ``scales`` (see :func:`only_scales`), which stay constants; and the module's declared
    ``parameters`` there (see :func:`declared_parameters`) whatever their size."""
    return [
        n
        for n, i in inits.items()
        if n in reached and i.data_type == _F32 and (n in parameters or (len(i.dims) >= 1 and n not in scales))
    ]


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or fnmatchcase(name, pattern)


def _some(names: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def select_trainable(
    inits: Mapping[str, onnx.TensorProto],
    reached: Set[str],
    trainable: Sequence[str] | None,
    frozen: Sequence[str] = (),
    *,
    statistics: Set[str] = frozenset(),
    scales: Set[str] = frozenset(),
    buffers: Set[str] = frozenset(),
    parameters: Set[str] = frozenset(),
) -> list[str]:
    """The initializers to train, in the model's order: ``trainable`` patterns (default: see
    :func:`default_trainable`) less ``frozen`` ones, less running ``statistics`` and less the
    module's other ``buffers`` (see :func:`constant_buffers`). A name given exactly is taken as it
    is (any float32 initializer); a glob takes the float32 initializers it matches that reach the
    prediction. A pattern that matches no initializer is refused, naming it."""
    names = list(inits)
    if isinstance(trainable, str) or isinstance(frozen, str):
        raise TrainableError("trainable and frozen take a list of names or glob patterns, not one string")
    for kind, patterns in (("trainable", trainable or ()), ("frozen", frozen)):
        for p in patterns:
            if not any(_matches(n, p) for n in names):
                raise TrainableError(
                    f"{kind} {p!r} matches no tensor: it is not an initializer of the model nor a glob "
                    f"pattern for one; initializers: {_some(names)}"
                )
    if trainable is None:
        chosen = [
            n for n in default_trainable(inits, reached, scales, parameters) if n not in statistics and n not in buffers
        ]
    else:
        chosen = []
        for p in trainable:
            if p in inits:
                if inits[p].data_type != _F32:
                    dtype = onnx.helper.tensor_dtype_to_np_dtype(inits[p].data_type)
                    raise TrainableError(f"trainable {p!r} is {dtype}; plans train float32 weights")
                picked = [p]
            else:
                matched = [n for n in names if _matches(n, p)]
                picked = [
                    n
                    for n in matched
                    if inits[n].data_type == _F32 and n in reached and n not in statistics and n not in buffers
                ]
                if not picked:
                    raise TrainableError(
                        f"trainable {p!r} matches only tensors that cannot train (not float32, or on no "
                        f"float path to the output): {_some(matched)}"
                    )
            chosen += [n for n in picked if n not in chosen]
        chosen.sort(key=names.index)
    return [n for n in chosen if not any(_matches(n, p) for p in frozen)]


def trainable_table(shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Lines for a person: each trained tensor and its shape, then the parameter count."""
    width = max((len(n) for n in shapes), default=0)
    lines = [f"  {n.ljust(width)}  {list(s)}" for n, s in shapes.items()]
    count = sum(int(np.prod(s)) if s else 1 for s in shapes.values())
    lines.append(f"  {len(shapes)} trainable tensors, {count:,} parameters")
    return lines


def split_deduplicated(model: onnx.ModelProto) -> dict[str, str]:
    """Give every parameter an exporter merged into another its own initializer again, in place;
    returns each new initializer's name -> the initializer it was copied from.

    Exporters keep one initializer for parameters of equal values (a fresh model's zero biases,
    LayerNorm gains of one). Trained as one weight, such parameters would all take the sum of
    their gradients. torch's classic exporter reads the merged ones through ``Identity`` nodes
    named after them: each such ``Identity`` of an initializer becomes an initializer of its own
    (its output's name, the initializer's value). The dynamo exporter's optimizer leaves no node
    behind, but every node it writes names the FX node it came from (see
    :func:`split_by_fx_origin`); its own ``Identity`` nodes are FX nodes too (``aten.clone``,
    ``aten.alias``: the same parameter read again, as DeBERTa reads its relative embeddings in every
    layer) and stay. A weight the model itself shares (tied embeddings) stays one."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    outputs = {o.name for o in graph.output}
    split: dict[str, str] = {}
    kept = []
    for node in graph.node:
        source = node.input[0] if node.op_type == "Identity" and node.input else ""
        target = node.output[0] if node.output else ""
        dynamo = _metadata(node, _FX_NODE) is not None  # an FX node's copy or alias: the same tensor
        if source in inits and target and target not in outputs and target not in inits and not dynamo:
            inits[target] = _copy(inits[source], target, graph)
            split[target] = source
            continue
        kept.append(node)
    if split:
        del graph.node[:]
        graph.node.extend(kept)
        for vi in list(graph.value_info):  # the aliases' inferred types would now shadow initializers
            if vi.name in split:
                graph.value_info.remove(vi)
    split.update(split_by_fx_origin(model))
    return split


def _copy(init: onnx.TensorProto, name: str, graph: onnx.GraphProto) -> onnx.TensorProto:
    copy = onnx.TensorProto()
    copy.CopyFrom(init)
    copy.name = name
    graph.initializer.append(copy)
    return copy


# ---------------------------------------------------------------------------- the dynamo exporter's node metadata

_FX_NODE = "pkg.torch.onnx.fx_node"
_NAME_SCOPES = "pkg.torch.onnx.name_scopes"
_REWRITTEN = "pkg.onnxscript.rewriter.rule_name"
#: The optimizer's rules that leave a node reading what its FX node read (less a zero bias, or with
#: its shape input computed): the node's metadata still names its own parameters.
_SAME_READS = ("RemoveOptionalBiasFrom", "MaterializeReshapeShape")
_PLACEHOLDER = re.compile(r"%([pb]_\w+)")
#: Buffers that train as plan state (BatchNorm's running statistics); other buffers are index tables.
_STATISTICS = ("running_mean", "running_var")


def _placeholder(name: str, kind: str) -> str:
    """torch.export's name for a lifted parameter (``p_``) or buffer (``b_``): the name in lower
    case with every character but letters and digits an underscore (``placeholder_naming_pass``;
    two names that collide so get a suffix there, which is not undone here)."""
    return f"{kind}_{re.sub(r'[^a-zA-Z0-9]', '_', name).lower()}"


def _metadata(node: onnx.NodeProto, key: str) -> str | None:
    for prop in node.metadata_props:
        if prop.key == key:
            return prop.value
    return None


def fx_reads(node: onnx.NodeProto) -> frozenset[str] | None:
    """The parameters and buffers (torch.export's placeholders ``p_<name>``, ``b_<name>``) the FX
    node that became ``node`` took as arguments, from the dynamo exporter's ``pkg.torch.onnx.fx_node``
    metadata (``%linear = call_function[...](args = (%x, %p_fc_weight, %p_fc_bias), ...)``); None
    for a node without it (another exporter, or a graph rewritten by a tool that drops metadata)."""
    text = _metadata(node, _FX_NODE)
    if text is None:
        return None
    return frozenset(_PLACEHOLDER.findall(text.split(" = ", 1)[-1]))


def node_module(node: onnx.NodeProto) -> str | None:
    """The torch module whose forward made ``node`` (dotted, ``""`` for the root): the dynamo
    exporter's ``pkg.torch.onnx.name_scopes`` (``['', 'layer1', 'layer1.0', 'layer1.0.conv1', 'conv2d']``),
    else the classic exporter's node name (``/layer1/layer1.0/conv1/Conv``); None when neither says."""
    scopes = _metadata(node, _NAME_SCOPES)
    if scopes is not None:
        try:
            names = ast.literal_eval(scopes)
        except (ValueError, SyntaxError):
            return None
        return str(names[-2]) if isinstance(names, list) and len(names) >= 2 else ""
    if node.name.startswith("/"):
        return node.name[1:].rsplit("/", 1)[0] if "/" in node.name[1:] else ""
    return None


_SIGNATURE = "pkg.torch.export.ExportedProgram.graph_signature"
_SIGNATURE_LINE = re.compile(r"^(\w+): (?:PARAMETER|BUFFER) target='([^']+)'", re.M)
_BUFFER_LINE = re.compile(r"^\w+: BUFFER target='([^']+)'", re.M)
_PARAMETER_LINE = re.compile(r"^\w+: PARAMETER target='([^']+)'", re.M)


class _TorchNames:
    """torch names and torch.export's placeholders for them, both ways: from the exported program's
    signature the dynamo exporter writes in the graph's metadata (``p_ln_weight: PARAMETER
    target='ln.weight'``), else by torch.export's own spelling rule (:func:`_placeholder`)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        text = next((p.value for p in model.graph.metadata_props if p.key == _SIGNATURE), "")
        self.by_placeholder = dict(_SIGNATURE_LINE.findall(text))
        self.placeholders = {name: p for p, name in self.by_placeholder.items()}

    def placeholder(self, name: str, kind: str) -> str | None:
        """``name``'s placeholder (``kind`` ``p`` or ``b``); None for a name the signature lacks."""
        if self.by_placeholder:
            found = self.placeholders.get(name)
            return found if found is not None and found.startswith(kind + "_") else None
        return _placeholder(name, kind)

    def reads(self, name: str, own: frozenset[str]) -> bool:
        return any(self.placeholder(name, kind) in own for kind in "pb")

    def name(self, placeholder: str, module: str | None) -> str:
        """The torch name of ``placeholder``, read where a node of ``module`` reads it; without the
        signature a best guess (below ``module``, underscores for dots, in lower case)."""
        if placeholder in self.by_placeholder:
            return self.by_placeholder[placeholder]
        rest, prefix = placeholder[1:], _placeholder(module, "") if module else ""
        return f"{module}.{rest[len(prefix) + 1 :]}" if module and rest.startswith(prefix + "_") else rest[1:]


def _merged_name(name: str, module: str | None, own: frozenset[str], taken: Set[str], names: _TorchNames) -> str | None:
    """The parameter a node reads through ``name`` when its FX node read another one: the node's
    module joined with the longest tail of ``name`` that names a parameter the FX node read and
    that has no initializer of its own (``ln.weight`` read by ``ln2``'s node: ``ln2.weight``;
    ``layers.0.attn.out_proj.bias`` read by ``layers.1.attn``'s: ``layers.1.attn.out_proj.bias``)."""
    parts = name.split(".")
    for start in range(len(parts)):
        tail = ".".join(parts[start:])
        candidate = f"{module}.{tail}" if module else tail
        if candidate != name and candidate not in taken and names.reads(candidate, own):
            return candidate
    return None


def split_by_fx_origin(model: onnx.ModelProto) -> dict[str, str]:
    """Split the parameters the dynamo exporter's optimizer merged by value, in place; returns each
    new initializer's name -> the initializer it was merged into.

    torch.export lifts the parameters as placeholders (a weight the model ties: one placeholder
    that every use reads), and the exporter records on each ONNX node the FX node it came from,
    with the placeholders it read. The optimizer then keeps one initializer for equal-valued
    tensors and has every reader read it, but the readers' metadata still names the placeholder
    each read. A node whose FX node did not read the initializer it reads now reads a merged
    parameter: it gets an initializer of its own, named as torch names it (:func:`_merged_name`),
    with the merged value. A tied weight's readers all name its placeholder, so it stays one
    weight, whatever its values. A node whose FX node read no parameter the merged one could be
    reads a constant of the exporter's that the optimizer merged into a parameter of equal value
    (the ones and zeros an ``InstanceNormalization`` or ``LayerNormalization`` without affine
    parameters needs as its scale and bias, merged into a fresh affine one's weight and bias): it
    reads that value as a ``Constant`` node of its own again, which never trains. Relies on the
    ``pkg.torch.onnx.fx_node`` metadata torch's dynamo exporter writes (torch 2.5 and later); a
    graph without it is left as it is."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    names = _TorchNames(model)
    # by position: protobuf makes a new wrapper of a node at each access, so an id() taken of one
    # may be another node's by the next loop (a KeyError some runs and not others)
    nodes = list(graph.node)
    reads = [fx_reads(node) for node in nodes]
    lifted = frozenset().union(*(r for r in reads if r), names.by_placeholder)
    original = set(inits)
    split: dict[str, str] = {}
    constants: list[onnx.NodeProto] = []
    fresh = namer(graph)
    for node, own in zip(nodes, reads):
        if own is None or not _reads_as_its_fx_node(node):
            continue  # a rewrite rule's node (a BatchNorm fused into a Conv) carries one of its sources' metadata
        for k, name in enumerate(node.input):
            if name not in original or not is_float(inits[name].data_type):
                continue
            if not names.reads(name, lifted) or names.reads(name, own):
                continue  # a constant of the exporter's own, or the node reads its own parameter
            target = _merged_name(name, node_module(node), own, original, names) if own else None
            if target is None:
                if names.placeholder(name, "p") in lifted and not _reads_a_parameter_like(
                    own, inits[name], names, inits
                ):
                    constant = fresh(f"{node.name or node.op_type}_constant")
                    constants.append(
                        onnx.helper.make_node("Constant", [], [constant], name=constant, value=inits[name])
                    )
                    node.input[k] = constant
                continue
            if target not in inits:
                inits[target] = _copy(inits[name], target, graph)
                split[target] = name
            node.input[k] = target
    for at, constant in enumerate(constants):
        graph.node.insert(at, constant)
    return split


def _reads_as_its_fx_node(node: onnx.NodeProto) -> bool:
    """Whether ``node`` reads the parameters its FX node read: it is the exporter's own, or every
    optimizer rule that rewrote it is one of :data:`_SAME_READS` (a Gemm whose zero bias was dropped:
    the second of an ``nn.TransformerEncoder``'s layers, deep copies of one that are equal at
    initialization, then reads the first's merged weight, which must be split back)."""
    rules = _metadata(node, _REWRITTEN)
    return rules is None or all(rule.strip().startswith(_SAME_READS) for rule in rules.split(","))


def _reads_a_parameter_like(
    own: frozenset[str], init: onnx.TensorProto, names: _TorchNames, inits: Mapping[str, onnx.TensorProto]
) -> bool:
    """Whether an FX node that read the placeholders ``own`` read one that ``init`` could stand for:
    a parameter of the same shape with no initializer of its own (merged into ``init``, under a name
    :func:`_merged_name` could not tell)."""
    for placeholder in own:
        name = names.by_placeholder.get(placeholder)
        if name is None or name not in inits or list(inits[name].dims) == list(init.dims):
            return True
    return False


def constant_buffers(model: onnx.ModelProto) -> set[str]:
    """Initializers the exported program declares buffers of the module, not parameters, other than
    running statistics: torch never trains them (a rotary embedding's ``inv_freq``, BART's
    ``final_logits_bias``), so neither does a plan by default. Read from the program's signature in
    the dynamo exporter's graph metadata (``b_...: BUFFER target='...'``); the classic exporter
    writes none, so there a person names them with ``frozen`` (``plan from-torch`` does it itself)."""
    text = next((p.value for p in model.graph.metadata_props if p.key == _SIGNATURE), "")
    present = {i.name for i in model.graph.initializer}
    found = {name for name in _BUFFER_LINE.findall(text) if name in present and not name.endswith(_STATISTICS)}
    return found | keras_preprocessing_constants(model)


def detached_tensors(model: onnx.ModelProto) -> set[str]:
    """The outputs of the dynamo exporter's ``Identity`` nodes for ``Tensor.detach()`` (FX node
    ``aten.detach.default``; ``optimize=False``, or its optimizer removes them): torch's step sends no
    gradient through them (a stop-gradient, a straight-through estimator's ``(q - x).detach()``), nor
    does a plan's. The classic exporter's trace drops ``detach`` without a trace, and no export marks
    a ``torch.no_grad()`` block of ``forward``: its gradient flows in a plan."""
    return {
        node.output[0]
        for node in model.graph.node
        if node.op_type == "Identity"
        and node.output
        and (_metadata(node, _FX_NODE) or "").split("(args", 1)[0].endswith("target=torch.ops.aten.detach.default]")
    }


def declared_parameters(model: onnx.ModelProto) -> set[str]:
    """Initializers the exported program declares parameters of the module (``p_...: PARAMETER
    target='...'`` in the dynamo exporter's graph metadata): torch trains each whatever its size, so
    a plan does by default too, where a one-element initializer otherwise stays a constant (a
    learned temperature or ReZero's gate read by a ``Mul``, a 0-d ``nn.Parameter``). The classic
    exporter writes none."""
    text = next((p.value for p in model.graph.metadata_props if p.key == _SIGNATURE), "")
    present = {i.name for i in model.graph.initializer}
    return {name for name in _PARAMETER_LINE.findall(text) if name in present}


#: The scope tf2onnx's names give the constants of Keras's ``Rescaling`` and ``Normalization``
#: layers (named after their class unless their author names them).
_KERAS_PREPROCESSING = re.compile(r"(?:^|/)(?:rescaling|normalization)(?:_[0-9]+)?/")


def keras_preprocessing_constants(model: onnx.ModelProto) -> set[str]:
    """The initializers of a tf2onnx conversion that Keras's ``Rescaling`` and ``Normalization``
    layers hold (keras.applications' EfficientNet scales and normalizes its input so): Keras never
    trains them (a ``Normalization``'s mean and variance are non-trainable weights, a
    ``Rescaling``'s scale and offset constants), so neither does a plan by default. Known by their
    layer's name in tf2onnx's (``efficientnetb0/rescaling/add:0``,
    ``ConstantFolding/efficientnetb0/normalization/truediv_recip:0``); a layer its author named
    otherwise is named in ``frozen``."""
    if model.producer_name != TF2ONNX:
        return set()
    return {i.name for i in model.graph.initializer if _KERAS_PREPROCESSING.search(i.name)}


def refold_tied_transposes(model: onnx.ModelProto) -> list[str]:
    """Read a parameter again where the dynamo exporter's optimizer folded its transpose into a new
    constant although the parameter keeps its own initializer, in place; returns the constants
    replaced. A linear layer whose weight is tied to an embedding (GPT-2's, T5's and Qwen2's output
    layer reads the token embedding) computes ``x @ W.T``: the optimizer folds ``W.T`` into
    ``val_*`` while the embedding's ``Gather`` still reads ``W``, and trained as two weights the
    tie would come apart. A constant read by a node whose FX node read a parameter (``p_...``)
    with an initializer whose transpose it equals, value for value, becomes a ``Transpose`` of that
    parameter. Folded transposes of weights with no initializer left stay (they train under their
    new name; :func:`lost_parameters` names the parameters)."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    names = _TorchNames(model)
    transposed: dict[str, str] = {}  # parameter -> its Transpose node's output
    replaced: dict[str, str] = {}
    added: list[onnx.NodeProto] = []
    for node in graph.node:
        own = fx_reads(node)
        if not own:
            continue
        for k, name in enumerate(node.input):
            init = inits.get(name)
            if init is None or name in names.placeholders or len(init.dims) != 2 or not is_float(init.data_type):
                continue
            for placeholder in sorted(p for p in own if p.startswith("p_")):
                source = inits.get(names.name(placeholder, node_module(node)))
                if source is None or list(source.dims) != list(reversed(init.dims)):
                    continue
                value = onnx.numpy_helper.to_array(init)
                if not np.array_equal(onnx.numpy_helper.to_array(source).T, value):
                    continue
                if source.name not in transposed:
                    out = f"{source.name}.transposed"
                    transpose = onnx.helper.make_node("Transpose", [source.name], [out], name=out, perm=[1, 0])
                    transpose.metadata_props.extend(node.metadata_props)  # the reader's module reads the weight
                    added.append(transpose)
                    transposed[source.name] = out
                node.input[k] = transposed[source.name]
                replaced[name] = source.name
                break
    if added:
        nodes = [*added, *graph.node]
        del graph.node[:]
        graph.node.extend(nodes)
        read = {i for n in graph.node for i in n.input}
        for init in [i for i in graph.initializer if i.name in replaced and i.name not in read]:
            graph.initializer.remove(init)
    return sorted(replaced)


def _trains(placeholder: str, name: str) -> bool:
    return placeholder.startswith("p_") or name.endswith(_STATISTICS)


def lost_parameters(model: onnx.ModelProto) -> list[str]:
    """Parameters and running statistics of the exported program with no initializer of their own
    (after :func:`split_by_fx_origin`): the dynamo exporter's optimizer folded them into new
    constants (a transposed weight, an LSTM's gates in ONNX order, a BatchNorm into the convolution
    before it, an embedding looked up at constant positions) or dropped them (a zero bias). A node
    still names those it read; one whose every reader was folded away is known from the program's
    signature when the graph holds folded constants, unless it is the second name of a tied weight
    (its module's nodes read another module's parameter). Empty without the dynamo exporter's metadata."""
    graph = model.graph
    names = _TorchNames(model)
    present = {i.name for i in graph.initializer}
    lost: set[str] = set()
    read: set[str] = set()
    borrowed: set[str] = set()  # modules whose nodes read another module's parameter (a tie)
    for node in graph.node:
        own = fx_reads(node)
        if not own:
            continue
        module = node_module(node)
        read |= own
        for placeholder in own:
            name = names.name(placeholder, module)
            if name not in present and _trains(placeholder, name):
                lost.add(name)
            if module is not None and name.rpartition(".")[0] != module:
                borrowed.add(module)
    folded = any(i.name not in names.placeholders and is_float(i.data_type) for i in graph.initializer)
    if names.by_placeholder and folded:
        for placeholder, name in names.by_placeholder.items():
            if (
                placeholder not in read
                and name not in present
                and _trains(placeholder, name)
                and name.rpartition(".")[0] not in borrowed
            ):
                lost.add(name)
    return sorted(lost)


def lost_parameters_warning(lost: Sequence[str]) -> str:
    """One line for a person: what the exporter did and how to export instead."""
    return (
        f"the exporter folded or dropped {len(lost)} of the module's parameters and running statistics "
        f"({_some(list(lost), 6)}): the plan cannot train them as the module does (a BatchNorm folded into a "
        "convolution is gone, a dropped zero bias stays zero, a folded weight trains under a new name); export "
        "with torch.onnx.export(module.train(), ..., dynamo=True, optimize=False), or with `fedfleet plan from-torch`"
    )


def metadata_dropped(model: onnx.ModelProto) -> bool:
    """Whether ``model`` is a dynamo export (torch's producer name, every node named ``node_...``)
    without the exported program's signature: asked for an opset below 18, the exporter writes opset
    18 and has onnx's version converter lower it, which drops all of its metadata. Then
    :func:`lost_parameters` cannot name what the optimizer folded or dropped (its folded constants,
    ``val_...``, train under those names, a dropped zero bias stays zero, without a word), nor
    :func:`constant_buffers` the buffers torch never trains."""
    return (
        model.producer_name == "pytorch"
        and len(model.graph.node) > 0
        and all(n.name.startswith("node_") for n in model.graph.node)
        and not any(p.key == _SIGNATURE for p in model.graph.metadata_props)
    )


METADATA_DROPPED_WARNING = (
    "the model is torch's dynamo export lowered below opset 18 by onnx's version converter, which drops the "
    "exporter's metadata: the plan cannot tell which parameters the exporter's optimizer folded into new "
    "constants or dropped, nor which buffers torch never trains; export at opset_version 18 or later with "
    "optimize=False, or with `fedfleet plan from-torch`"
)


def shared_weights(nodes: Sequence[onnx.NodeProto], weights: Sequence[str]) -> dict[str, int]:
    """Trained weights the model itself shares (tied embeddings): weight -> how many modules read
    it. A reader's module comes from the exporter (:func:`node_module`), so that a weight one
    module reads through several nodes (an LSTM's gates sliced apart, attention's packed
    projection) is not taken for a tie; where no exporter says, each reading node counts."""
    readers: dict[str, set[object]] = {}
    for position, node in enumerate(nodes):
        if node.op_type in ("Shape", "Size"):
            continue  # reads the shape alone
        module = node_module(node)
        for name in set(node.input):  # a node by its position: protobuf's wrappers' ids are reused
            readers.setdefault(name, set()).add(position if module is None else module)
    return {w: len(readers[w]) for w in weights if len(readers.get(w, ())) > 1}


def exported_for_inference(nodes: Sequence[onnx.NodeProto], inits: Mapping[str, onnx.TensorProto]) -> bool:
    """Whether the graph looks exported in eval mode: convolutions with weights, and no
    ``BatchNormalization`` nor ``Dropout`` anywhere. Both torch exporters fold BatchNorm into the
    convolutions' weights and biases and drop Dropout by default, so such a plan trains a network
    without them; a model that never had them looks the same, which is why this only warns. A
    network normalized otherwise (GroupNorm and InstanceNorm, which exports keep in eval mode as
    ``InstanceNormalization`` or ``GroupNormalization``; ConvNeXt's LayerNorm) was built without
    BatchNorm: it is not warned of."""
    ops = {n.op_type for n in nodes}
    convolutions = any(
        n.op_type in ("Conv", "ConvTranspose") and len(n.input) > 1 and n.input[1] in inits for n in nodes
    )
    return convolutions and not ops & {*_NORMALIZATIONS, "Dropout"}


#: The normalization ops an export keeps in eval mode too (BatchNorm's is folded away).
_NORMALIZATIONS = ("BatchNormalization", "InstanceNormalization", "GroupNormalization", "LayerNormalization")


EVAL_MODE_WARNING = (
    "the model looks exported in eval mode (convolutions, no BatchNormalization, no Dropout): exporters fold "
    "BatchNorm into the convolutions and drop Dropout by default, so the plan trains a network without them; "
    "export the module in train mode keeping them (`fedfleet plan from-torch`, or "
    "torch.onnx.export(model.train(), "
    "..., dynamo=True, optimize=False)), or ignore this if it has neither"
)


#: The standard ops of a quantized model (onnxruntime.quantization's QDQ and QOperator formats,
#: torch.ao's converted modules): an integer tensor between a weight and the prediction, which no
#: gradient crosses.
QUANTIZATION_OPS = frozenset(
    {
        "QuantizeLinear",
        "DequantizeLinear",
        "DynamicQuantizeLinear",
        "QLinearConv",
        "QLinearMatMul",
        "MatMulInteger",
        "ConvInteger",
    }
)
#: Their inputs that are scales and zero points, not data.
_QUANTIZATION_PARAMETERS = frozenset({1, 2})
_OTHER_PRECISIONS: dict[int, str] = {
    TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16",
    TensorProto.DOUBLE: "float64",
}


#: The integer types a quantized weight is stored in (QDQ's int8 and uint8, and the 4-bit ones).
_QUANTIZED = frozenset(
    {TensorProto.INT8, TensorProto.UINT8, TensorProto.INT4, TensorProto.UINT4, TensorProto.INT16, TensorProto.UINT16}
)


def quantized_weight(
    nodes: Sequence[onnx.NodeProto], inits: Mapping[str, onnx.TensorProto], prediction: str
) -> str | None:
    """Why a quantized model does not train, for a person, or None: a quantization op that the
    prediction needs reads a weight (an initializer of rank >= 1: a float one a QuantizeLinear
    rounds, an 8- or 4-bit integer one a DequantizeLinear scales; not an int64 or boolean mask or
    index) through its data input. A plan trains float32
    weights with gradients, and rounding to integers has none: such a weight would never train, and
    the layers before it neither. A quantized input (the features rounded before the first layer)
    trains, since no weight is behind it."""
    from .autodiff import needed_for

    needed = needed_for(nodes, [prediction])
    weights = {n for n, i in inits.items() if len(i.dims) >= 1 and (is_float(i.data_type) or i.data_type in _QUANTIZED)}
    behind: dict[str, str] = {n: n for n in weights}  # tensor -> a weight it reads
    for node in nodes:
        skip = (
            _QUANTIZATION_PARAMETERS
            if node.op_type in QUANTIZATION_OPS
            else NON_DIFFERENTIABLE_INPUTS.get(node.op_type, frozenset())
        )
        weight = next((behind[t] for k, t in enumerate(node.input) if k not in skip and t in behind), None)
        if weight is None:
            continue
        if node.op_type in QUANTIZATION_OPS and set(node.output) & needed:
            return (
                f"the model is quantized: its {node.op_type} node {node.name or node.output[0]!r} reads the weight "
                f"{weight!r}, and a plan trains float32 weights by their gradients, which no rounding to integers "
                "has; export the float model (before onnxruntime.quantization's quantize_static or quantize_dynamic, "
                "or torch.ao's convert), train that, and quantize the trained model; or name the float layers to "
                "train with trainable="
            )
        for out in node.output:
            behind.setdefault(out, weight)
    return None


def nothing_to_train(
    nodes: Sequence[onnx.NodeProto],
    infos: Mapping[str, TensorInfo],
    inits: Mapping[str, onnx.TensorProto],
    prediction: str,
) -> str:
    """Why no weight trains by default, for a person: the model is quantized, its weights are of
    another float type, the weights are not initializers at all, or the float path from them to
    ``prediction`` is cut (an ArgMax, a comparison, a cast to integers)."""
    from .autodiff import needed_for

    quantized = quantized_weight(nodes, inits, prediction)
    if quantized is not None:
        return quantized
    needed = needed_for(nodes, [prediction])
    weights = [n for n, i in inits.items() if n in needed and i.data_type == _F32 and len(i.dims) >= 1]
    others = [n for n, i in inits.items() if n in needed and i.data_type in _OTHER_PRECISIONS and len(i.dims) >= 1]
    if not weights and others:
        precision = _OTHER_PRECISIONS[inits[others[0]].data_type]
        return (
            f"the model's weights are {precision} ({_some(others, 4)}), and a plan trains float32 weights; export "
            "the model in float32 (in torch, model.float() before torch.onnx.export, not model.half(), "
            "model.bfloat16() or model.double(); a float16 ONNX file is the float32 one before "
            "onnxconverter_common's float16 conversion)"
        )
    if not weights:
        return (
            "the model has nothing to train: no float32 initializer computes the output; export the model with its "
            "weights as float32 initializers (torch.onnx.export's default export_params=True, not as Constant nodes or "
            "graph inputs: an onnxscript model's weights go in graph.initializer, not among its arguments), or name "
            "the tensors to train with trainable="
        )
    cut = sorted(
        {
            n.op_type
            for n in nodes
            if set(n.output) & needed
            and (
                n.op_type in NO_GRADIENT or any(o in infos and not is_float(infos[o].elem_type) for o in n.output if o)
            )
        }
    )
    return (
        f"no gradient reaches the output {prediction!r} from the model's weights ({_some(weights, 4)}): the path goes "
        f"through ops without one ({', '.join(cut) or 'none found'}); export the model up to its float prediction "
        "(logits or scores, before ArgMax, a comparison or a cast to integers)"
    )


def save_onnx(model: onnx.ModelProto, path: str | os.PathLike, *, data_file: str | None = None) -> None:
    """Write ``model`` to ``path``; with ``data_file``, its tensors of 1 KiB or more go to that file
    beside it (a name relative to the model's folder), as protobuf caps a model file at 2 GiB. A
    data file already there is replaced: onnx appends to it, and each writing over a bundle grew it
    by the whole model."""
    if data_file is None:
        onnx.save_model(model, os.fspath(path))
    else:
        (Path(path).parent / data_file).unlink(missing_ok=True)
        onnx.save_model(
            model,
            os.fspath(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=data_file,
            size_threshold=1024,
        )


def inference_form(model: onnx.ModelProto) -> None:
    """Dropout and BatchNormalization in their inference form, in place: a train-mode export (what
    keeps them at all) writes Dropout with training_mode=True and the classic exporter BatchNorm
    with training_mode=1 and its statistics as outputs, which an evaluation would run as they are:
    with random masks and the batch's statistics. A training plan rewrites both for training anyway.
    Stochastic depth becomes the Dropout it is first (:func:`stochastic_depth_as_dropout`)."""
    stochastic_depth_as_dropout(model)
    graph = model.graph
    dropped: set[str] = set()
    for node in graph.node:
        if node.op_type == "Dropout" and len(node.input) > 2:
            dropped.update(node.input[2:])
            del node.input[2:]
        elif node.op_type == "BatchNormalization" and any(a.name == "training_mode" for a in node.attribute):
            kept = [a for a in node.attribute if a.name != "training_mode"]
            del node.attribute[:]
            node.attribute.extend(kept)
    read = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    for node in graph.node:
        if node.op_type in ("Dropout", "BatchNormalization"):
            while len(node.output) > 1 and node.output[-1] not in read:
                del node.output[-1]
    orphans = dropped - read  # the True the training_mode inputs read
    for init in [i for i in graph.initializer if i.name in orphans]:
        graph.initializer.remove(init)
    for node in [n for n in graph.node if n.op_type == "Constant" and set(n.output) <= orphans]:
        graph.node.remove(node)


#: The ``producer_name`` tf2onnx writes (``tf2onnx.convert.from_keras``, ``from_function``, Keras 3's
#: ``model.export(format="onnx")``).
TF2ONNX = "tf2onnx"


def single_recurrent_bias(model: onnx.ModelProto) -> list[str]:
    """The LSTMs of a tf2onnx conversion, each read with the recurrent half of its bias held at zero,
    in place; returns their ``B`` initializers. An ONNX ``LSTM`` adds an input bias and a recurrent
    bias; Keras's layer has one, which tf2onnx writes as the input half of ``B``, the recurrent half
    zeros. Trained as it stands, both halves would take the bias's gradient: their sum, the layer's
    bias, would move twice as far as Keras moves it. ``B`` stays the weight, read through a ``Mul``
    by a constant mask (ones, then zeros), so the recurrent half's gradient is zero and it stays
    zero. A Keras ``GRU`` (``reset_after=True``, the form tf2onnx writes as a ``GRU``) has two
    biases, as torch's LSTM does whatever their values: those are left alone."""
    if model.producer_name != TF2ONNX:
        return []
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    fresh = namer(graph)
    nodes: list[onnx.NodeProto] = []
    masked: list[str] = []
    for node in graph.node:
        bias = node.input[3] if node.op_type == "LSTM" and len(node.input) > 3 else ""
        value = onnx.numpy_helper.to_array(inits[bias]) if bias in inits else None
        if value is None or value.ndim != 2 or value.shape[1] % 2 or np.any(value[:, value.shape[1] // 2 :]):
            nodes.append(node)
            continue
        mask, held = fresh(f"{bias}_input_half"), fresh(f"{bias}_single")
        ones = np.zeros(value.shape, dtype=value.dtype)
        ones[:, : value.shape[1] // 2] = 1
        nodes.append(onnx.helper.make_node("Constant", [], [mask], value=onnx.numpy_helper.from_array(ones, mask)))
        nodes.append(onnx.helper.make_node("Mul", [bias, mask], [held]))
        node.input[3] = held
        nodes.append(node)
        masked.append(bias)
    if masked:
        kept = [onnx.NodeProto() for _ in nodes]
        for copy, node in zip(kept, nodes):
            copy.CopyFrom(node)
        del graph.node[:]
        graph.node.extend(kept)
    return masked


def tf2onnx_folded_batch_norms(model: onnx.ModelProto) -> list[str]:
    """The Keras layers whose ``BatchNormalization`` a tf2onnx conversion folded into constants: into
    the convolution before it (tf.keras's fused layer: the optimizer ``remove_back_to_back`` writes
    ``<conv>_weights_fused_bn`` and ``<conv>_bias_fused_bn``; Keras 3's, whose scale TensorFlow's
    graph optimizer multiplies into the kernel: ``<conv>/convolution/merged_input``), or, over Dense
    features (the unfused form, ``x * gamma / sqrt(var + eps) + (beta - mean * ...)``), into the
    ``<layer>/batchnorm/mul`` and ``.../sub`` constants of the frozen graph. Either trains as a
    fixed scale and shift, without batch statistics. Empty for other producers."""
    if model.producer_name != TF2ONNX:
        return []
    found = set()
    for init in model.graph.initializer:
        name = init.name
        if name.endswith(("_weights_fused_bn", "_bias_fused_bn")):
            conv = name.removesuffix("_weights_fused_bn").removesuffix("_bias_fused_bn")
            found.add(conv.rpartition("/")[0] or conv)
        elif (match := re.fullmatch(r"(.+)/batchnorm/(mul|sub)(_[0-9]+)?(:0)?", name)) is not None:
            found.add(match.group(1))
        elif (match := re.fullmatch(r"(.+)/[^/]+/merged_input(:0)?", name)) is not None:
            found.add(match.group(1))
    return sorted(found)


def folded_batch_norm_warning(layers: Sequence[str]) -> str:
    """One line for a person: what tf2onnx did and how to convert instead."""
    return (
        f"tf2onnx folded {len(layers)} BatchNormalization layer(s) into constants ({_some(list(layers), 6)}): the plan "
        "trains a fixed scale and shift there (or a kernel times the scale), without batch statistics, not as Keras "
        "trains the layer; with tf.keras (Keras 2) convert with tf2onnx.convert.from_keras(model, ..., "
        "optimizers=<tf2onnx.optimizer._optimizers less 'remove_back_to_back'>), which keeps one after a "
        "convolution, and give one over Dense features a [N, 1, 1, features] input (Keras 3's export folds every one)"
    )


def _constant(graph: onnx.GraphProto, name: str) -> np.ndarray | None:
    """The value of ``name`` where it is an initializer or a ``Constant``'s output, seen through
    ``Cast`` and ``CastLike`` (the dynamo exporter casts a constant like the tensor it meets)."""
    for init in graph.initializer:
        if init.name == name:
            return onnx.numpy_helper.to_array(init)
    for node in graph.node:
        if name in node.output:
            if node.op_type in ("Cast", "CastLike"):
                return _constant(graph, node.input[0])
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                return onnx.numpy_helper.to_array(node.attribute[0].t)
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value_float":
                return np.array(node.attribute[0].f, dtype=np.float32)
            return None
    return None


def stochastic_depth_as_dropout(model: onnx.ModelProto) -> int:
    """Each stochastic depth (torchvision's ``StochasticDepth``, timm's ``DropPath``, transformers'
    ``drop_path``: a residual branch kept per example with probability ``keep`` and scaled by
    ``1/keep`` in training, the identity in evaluation) as the ``Dropout`` of ones it is, in place;
    returns how many. Both exporters write its training form as ``Less(RandomUniformLike(t), keep)``,
    cast to float and divided by ``keep``, and transformers' as ``Floor(Add(RandomUniformLike(t),
    keep))`` (0 or 1) that multiplies the branch divided by ``keep`` (that mask becomes the Dropout's
    times ``keep``): random in an evaluation plan too, and drawn unseeded. As
    ``Dropout(ones like t, 1 - keep)`` (active, as a train-mode export's Dropout is) it is the
    identity where Dropout is inactive (:func:`inference_form`) and a seeded mask in training.
    The form without the division (``scale_by_keep=False``) is left as it is."""
    graph = model.graph
    nodes = [onnx.NodeProto() for _ in graph.node]  # copies, told apart by position (protobuf makes
    for copy, node in zip(nodes, graph.node):  # its wrappers anew at each access)
        copy.CopyFrom(node)
    readers: dict[str, list[int]] = {}
    for k, node in enumerate(nodes):
        for i in node.input:
            readers.setdefault(i, []).append(k)
    outputs = {o.name for o in graph.output}

    def only_reader(tensor: str, *ops: str) -> int | None:
        """The one node that reads ``tensor``'s values (a ``CastLike`` that reads only its type aside)."""
        found = [
            k for k in readers.get(tensor, []) if not (nodes[k].op_type == "CastLike" and nodes[k].input[0] != tensor)
        ]
        return found[0] if len(found) == 1 and nodes[found[0]].op_type in ops and tensor not in outputs else None

    fresh = namer(graph)
    replaced: dict[int, list[onnx.NodeProto]] = {}  # position -> the nodes in its place (none: removed)

    def as_dropout(at_draw: int, keep: float, base: str, name: str) -> onnx.NodeProto:
        """The draw at ``at_draw`` replaced by ones of its shape, and the ``Dropout`` of them at
        ratio ``1 - keep`` (output ``base``, values 0 or ``1/keep``) that takes the mask's place."""
        draw = nodes[at_draw]
        shape, ones = fresh(f"{base}_shape"), fresh(f"{base}_ones")
        ratio = onnx.numpy_helper.from_array(np.array(1.0 - keep, dtype=np.float32), fresh(f"{base}_drop_ratio"))
        training = onnx.numpy_helper.from_array(np.array(True), fresh(f"{base}_training_mode"))
        graph.initializer.extend([ratio, training])
        ones_value = onnx.helper.make_tensor("value", _F32, [1], [1.0])
        replaced[at_draw] = [
            onnx.helper.make_node("Shape", [draw.input[0]], [shape]),
            onnx.helper.make_node("ConstantOfShape", [shape], [ones], value=ones_value),
        ]
        for k in readers.get(draw.output[0], []):  # a CastLike to the draw's type: the ones' type
            if nodes[k].op_type == "CastLike" and nodes[k].input[1] == draw.output[0]:
                nodes[k].input[1] = ones
        return onnx.helper.make_node("Dropout", [ones, ratio.name, training.name], [base], name=fresh(name))

    for at_draw, draw in enumerate(nodes):
        if draw.op_type != "RandomUniformLike":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in draw.attribute}
        if attrs.get("low", 0.0) != 0.0 or attrs.get("high", 1.0) != 1.0:
            continue
        at_add = only_reader(draw.output[0], "Add")
        if at_add is not None:  # transformers' drop_path: floor(keep + u), 1 with probability keep
            add = nodes[at_add]
            keep = _constant(graph, add.input[1] if add.input[0] == draw.output[0] else add.input[0])
            at_floor = only_reader(add.output[0], "Floor")
            if at_floor is None or keep is None or keep.size != 1 or not 0 < float(keep) < 1:
                continue
            base = nodes[at_floor].output[0]
            scaled = fresh(f"{base}_scaled")
            keep_value = onnx.numpy_helper.from_array(np.array(float(keep), dtype=np.float32), fresh(f"{base}_keep"))
            graph.initializer.append(keep_value)
            replaced[at_floor] = [  # the mask of 0 and 1/keep times keep: 0 or 1, and keep where inactive
                as_dropout(at_draw, float(keep), scaled, f"{nodes[at_floor].name or base}_stochastic_depth"),
                onnx.helper.make_node("Mul", [scaled, keep_value.name], [base]),
            ]
            replaced[at_add] = []
            continue
        at_less = only_reader(draw.output[0], "Less")
        if at_less is None or nodes[at_less].input[0] != draw.output[0]:
            continue
        less = nodes[at_less]
        keep = _constant(graph, less.input[1])
        at_cast = only_reader(less.output[0], "Cast", "CastLike")
        at_div = only_reader(nodes[at_cast].output[0], "Div") if at_cast is not None else None
        if at_cast is None or at_div is None or nodes[at_div].input[0] != nodes[at_cast].output[0]:
            continue
        cast, div = nodes[at_cast], nodes[at_div]
        if keep is None or keep.size != 1 or not 0 < float(keep) < 1:
            continue
        by = _constant(graph, div.input[1])
        if by is None or by.size != 1 or not np.isclose(float(by), float(keep)):
            continue
        if cast.op_type == "Cast" and onnx.helper.get_attribute_value(cast.attribute[0]) != _F32:
            continue
        base = div.output[0]
        replaced[at_div] = [as_dropout(at_draw, float(keep), base, f"{div.name or base}_stochastic_depth")]
        replaced[at_less] = replaced[at_cast] = []
    if replaced:
        del graph.node[:]
        graph.node.extend(n for k, node in enumerate(nodes) for n in replaced.get(k, [node]))
    return sum(n.op_type == "Dropout" for ns in replaced.values() for n in ns)


def local_functions_inlined(model: onnx.ModelProto) -> bool:
    """Replace, in place, each call of a model-local function (onnxscript's ``@script`` functions
    that a ``@script`` model calls, a ``FunctionProto`` a hand-written model holds) by the nodes
    of its body, recursively, as ``onnx.inliner`` does: a plan differentiates standard ops, and a
    call is a node of the function's own domain. Models that call none are left as they are
    (the dynamo exporter's graphs keep their node metadata). Returns whether any call was inlined."""
    local = {(f.domain, f.name) for f in model.functions}
    if not local or not any((n.domain, n.op_type) in local for n in _all_nodes(model.graph)):
        return False
    import onnx.inliner

    model.CopyFrom(onnx.inliner.inline_local_functions(model))
    return True


def _all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    out = []
    for node in graph.node:
        out.append(node)
        for g in subgraphs(node):
            out += _all_nodes(g)
    return out


def population_running_variance(model: onnx.ModelProto) -> bool:
    """Whether the framework ``model`` was exported from moves a BatchNorm's running variance with the
    batch's population variance, where torch and TensorFlow take the unbiased one (n/(n-1)): Paddle
    (paddle2onnx's producer in older releases, its graph's name ``PaddlePaddle Graph in PIR mode``
    in paddle2onnx 2, which leaves the producer empty) and Flax (jax2onnx's producer)."""
    return model.producer_name.startswith(("PaddlePaddle", "jax2onnx")) or model.graph.name.startswith("PaddlePaddle")


def zero_copies_the_batch(model: onnx.ModelProto, reshapes: Sequence[str]) -> None:
    """The ``Reshape`` nodes named (by name, or first output) whose constant shape now starts with 0
    for the batch it is given (:func:`.old_opsets.unpin_batch`) without ``allowzero``, in place:
    the dynamo exporter writes every ``Reshape`` with ``allowzero=1``, which reads that 0 as a
    dimension of zero (the plan's step then failed at every batch size). Their shapes hold no other
    0, so nothing else changes."""
    named = set(reshapes)
    for node in model.graph.node:
        if node.op_type == "Reshape" and (node.name or node.output[0]) in named:
            kept = [a for a in node.attribute if a.name != "allowzero"]
            del node.attribute[:]
            node.attribute.extend(kept)


#: onnxruntime's words for the node a run failed at.
_FAILED_NODE = re.compile(r"running (\w+) node\. Name:'([^']*)'")


def pinned_batch(model: onnx.ModelProto, exported: Mapping[str, int]) -> str | None:
    """Where a model exported at a fixed batch size (``exported``: data input -> that size; the
    default ``torch.onnx.export(model, args, path)`` fixes it) still computes with that size after
    its inputs' batch axes are made dynamic and its ``Reshape`` nodes to the batch are rewritten
    (:func:`.old_opsets.unpin_batch`): the dynamo exporter writes ``as_strided`` as a ``Gather``
    of indices into the flattened batch, and an ``Expand`` or ``Reshape`` to a shape it computed as
    constants holds the batch too. Such a plan fails on a device at its first batch of another size
    (an epoch's last batch is short), or computes another batch's examples. The model runs in
    onnxruntime on zeros at its own batch size, one less and one more: returns the node a run failed
    at, or the output that kept the exported batch size (``None`` where every run keeps its batch, or
    where the first does not run either, which says nothing about the batch)."""
    import onnxruntime as ort

    sizes = set(exported.values())
    if len(sizes) != 1:
        return None
    (size,) = sizes

    def zeros(batch: int) -> dict[str, np.ndarray]:
        feeds = {}
        for vi in model.graph.input:
            dims = [
                d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1 for d in vi.type.tensor_type.shape.dim
            ]
            if dims:
                dims[0] = batch
            dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
            feeds[vi.name] = np.zeros(dims, dtype=dtype)
        return feeds

    options = ort.SessionOptions()
    options.log_severity_level = 4  # the failure is reported below; declared output shapes are no concern here
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        session.run(None, zeros(size))
    except Exception:  # noqa: BLE001 - a model that does not run as it is says nothing about its batch
        return None
    for batch in sorted({max(size - 1, 1), size + 1} - {size}):
        try:
            outputs = session.run(None, zeros(batch))
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises several kinds
            found = _FAILED_NODE.search(str(exc))
            return f"node {found.group(2)!r} ({found.group(1)})" if found else str(exc).splitlines()[0][:200]
        if np.ndim(outputs[0]) and np.shape(outputs[0])[0] != batch:
            return f"the output {session.get_outputs()[0].name!r}"
    return None


def pinned_batch_error(size: int, where: str) -> str:
    """One line for a person: what the export fixed and how to export instead."""
    return (
        f"the model was exported at a fixed batch size of {size}, and {where} computes with that size: the plan "
        f"would fail on a device at any other (an epoch's last batch is short); export it with a dynamic batch axis "
        "(torch.onnx.export(..., dynamo=True, dynamic_shapes=...), or dynamic_axes={'x': {0: 'batch'}} with "
        "dynamo=False), or with `fedfleet plan from-torch`"
    )


def dilated_same_padding_written_out(model: onnx.ModelProto) -> list[str]:
    """Give each ``Conv`` of ``auto_pad`` ``SAME_UPPER`` or ``SAME_LOWER`` with a dilation above 1 the
    pads it stands for, in place, and return the nodes' names. torch's classic exporter writes
    ``padding="same"`` with a ``dilation`` so, and onnxruntime's Conv refuses it at its first run
    ("Dilation not supported for AutoPadType::SAME_UPPER"): a plan (and the model itself) would fail
    on every device. Each axis pads ``(out - 1) * stride + (kernel - 1) * dilation + 1 - size`` in
    all, half on each side and the odd one at the end (``SAME_UPPER``) or the start; with a stride of
    1 that is ``(kernel - 1) * dilation`` whatever the size, otherwise the input's spatial size comes
    from shape inference, and a Conv whose size is not known is left as it is (its gradient is
    refused for it, naming the node)."""
    graph = model.graph
    convs = [
        n
        for n in graph.node
        if n.op_type == "Conv"
        and n.domain in ("", "ai.onnx")
        and _text_attr(n, "auto_pad") in ("SAME_UPPER", "SAME_LOWER")
        and any(d != 1 for d in _ints_attr(n, "dilations"))
    ]
    if not convs:
        return []
    inits = {i.name: i for i in graph.initializer}
    sizes: dict[str, list[int | None]] = {}
    if any(any(s != 1 for s in _ints_attr(n, "strides")) for n in convs):
        inferred = onnx.shape_inference.infer_shapes(model)
        for vi in [*inferred.graph.input, *inferred.graph.value_info]:
            dims = vi.type.tensor_type.shape.dim
            sizes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    done = []
    for node in convs:
        kernel = _ints_attr(node, "kernel_shape") or (
            [int(d) for d in inits[node.input[1]].dims[2:]] if node.input[1] in inits else []
        )
        nd = len(kernel)
        if not nd:
            continue
        strides = _ints_attr(node, "strides") or [1] * nd
        dilations = _ints_attr(node, "dilations") or [1] * nd
        spatial = sizes.get(node.input[0], [None] * (nd + 2))[2:]
        pads = [0] * (2 * nd)
        for i in range(nd):
            if strides[i] == 1:
                total = (kernel[i] - 1) * dilations[i]
            elif i < len(spatial) and spatial[i] is not None:
                size = int(spatial[i])  # type: ignore[arg-type]
                total = max((-(-size // strides[i]) - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - size, 0)
            else:
                break
            small, big = total // 2, total - total // 2
            upper = _text_attr(node, "auto_pad") == "SAME_UPPER"
            pads[i], pads[nd + i] = (small, big) if upper else (big, small)
        else:
            kept = [a for a in node.attribute if a.name not in ("auto_pad", "pads")]
            del node.attribute[:]
            node.attribute.extend([*kept, onnx.helper.make_attribute("pads", pads)])
            done.append(node.name)
    return done


def _text_attr(node: onnx.NodeProto, name: str) -> str:
    for a in node.attribute:
        if a.name == name:
            return a.s.decode()
    return "NOTSET"


def _ints_attr(node: onnx.NodeProto, name: str) -> list[int]:
    for a in node.attribute:
        if a.name == name:
            return [int(v) for v in a.ints]
    return []
