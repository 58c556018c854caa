"""Reverse-mode differentiation of an ONNX graph, written out in standard ONNX ops.

The engine walks the forward nodes that lie between the tensors to differentiate (``wrt``) and the
seeded tensors (usually the loss) in reverse topological order and asks each node's rule in
:mod:`.gradients` for the gradients of its inputs; gradients reaching one tensor along several
paths are added. A group of nodes that a rewrite of :mod:`.forward` emitted with a gradient of
its own (an unrolled LSTM: :class:`.emitter.Composite`) is differentiated as a whole. The result is plain nodes of the default domain at the graph's opset, so that a
training step runs in stock onnxruntime (onnxruntime-training is deprecated since 1.20 and its
graphs do not load in plain onnxruntime).

Shapes come from ONNX shape inference; where a rule needs a shape that inference could not fix
(a dynamic batch dimension, say) it reads it at run time with ``Shape``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# the names the rules and rewrites share live in the leaf module .emitter; re-exported here, where
# the toolchain's modules and users have always imported them
from .emitter import (
    DEFAULT_DOMAINS,
    Composite,
    Dim,
    Emitter,
    TensorInfo,
    UnsupportedOpError,
    attr,
    default_opset,
    node_reads,
)
from .forward import decompose
from .gradients import (
    NO_GRADIENT,
    RULES,
    batch_norm_gradient,
    batch_norms,
    conv_tap_sums,
    erf_gelu_gradient,
    erf_gelus,
    tap_sum_input_gradient,
)

__all__ = [
    "DEFAULT_DOMAINS",
    "Dim",
    "Emitter",
    "TensorInfo",
    "UnsupportedOpError",
    "attr",
    "backward",
    "constant_values",
    "differentiable",
    "needed_for",
    "refine_infos",
    "tensor_infos",
    "vjp_model",
]


def tensor_infos(model: onnx.ModelProto) -> dict[str, TensorInfo]:
    """Element type and shape of every tensor of ``model`` that shape inference can type.

    Shape arithmetic computed from constants alone is folded first (:func:`constant_values`):
    onnx's data propagation stops at ops such as ``Mod`` (torchvision's multi-head attention
    slices a shape with starts computed so), and every shape downstream would lose its rank.
    Where the inputs have symbolic dimensions (the batch), inference also runs twice with them set
    to two sets of sizes, where data propagation goes through everything: a dimension equal in both
    runs is static, one that follows an input's symbol is that symbol (a segmentation head's
    ``Resize`` to the sizes ``Shape`` read keeps the batch ``N``)."""
    folded = _with_constants_folded(model)
    infos = _inferred(folded)
    symbols = sorted({d for i in folded.graph.input for d in _dims(i) if isinstance(d, str)})
    if not symbols:
        return infos
    runs = []
    for sizes in ({s: 3 + k for k, s in enumerate(symbols)}, {s: 13 + 2 * k for k, s in enumerate(symbols)}):
        try:
            runs.append(_inferred_to_fixpoint(_with_input_sizes(folded, sizes)))
        except Exception:  # noqa: BLE001 - inference with concrete sizes is only a refinement
            return infos
    first, second = runs
    for name, a in first.items():
        b = second.get(name)
        if b is None or a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
            continue
        known = infos.get(name)
        base = (
            known.shape if known is not None and known.shape is not None and len(known.shape) == len(a.shape) else None
        )
        dims: list[Dim] = []
        for k, (x, y) in enumerate(zip(a.shape, b.shape)):
            if base is not None and isinstance(base[k], int):
                dims.append(base[k])
            elif isinstance(x, int) and x == y:
                dims.append(x)
            else:
                match = [s for i, s in enumerate(symbols) if (x, y) == (3 + i, 13 + 2 * i)]
                dims.append(match[0] if match else (base[k] if base is not None else None))
        infos[name] = TensorInfo(known.elem_type if known is not None else a.elem_type, tuple(dims))
    return infos


def refine_infos(infos: dict[str, TensorInfo], newer: Mapping[str, TensorInfo]) -> None:
    """``infos`` updated in place with ``newer`` (the shapes of a rewritten graph, for the tensors
    the rewrite added), keeping each dimension that ``infos`` fixed and ``newer`` did not: a tensor
    the rewrite kept has the shape it had, and inference of the rewritten graph can know less of
    it (a batch-statistics BatchNorm or a convolution written out as a sum over its kernel offsets
    reads the batch at run time, and a Reshape whose size follows from it no longer infers its
    other dimensions: ShuffleNetV2's channel split then had no channel count to slice)."""
    for name, new in newer.items():
        old = infos.get(name)
        if old is None or old.shape is None or new.shape is None or len(old.shape) != len(new.shape):
            infos[name] = new if old is None or new.shape is not None else old
            continue
        dims = [
            o
            if isinstance(o, int) or (isinstance(o, str) and not isinstance(n, int) and not _unknown(o) and _unknown(n))
            else n
            for o, n in zip(old.shape, new.shape)
        ]
        infos[name] = TensorInfo(new.elem_type, tuple(dims))


def _unknown(dim: Dim) -> bool:
    """A dimension inference named for itself (``unk__3``) or left empty: no input's symbol."""
    return dim is None or (isinstance(dim, str) and dim.startswith("unk__"))


#: Rounds of inference and folding at most: each folds the sizes one more block reads from the block
#: before (torchvision's ShuffleNetV2 splits channels at a size read and divided in each of its 16
#: units, which data propagation does not follow: 4 rounds left its last convolution without sizes).
FOLD_ROUNDS = 64


def _inferred_to_fixpoint(model: onnx.ModelProto, rounds: int = FOLD_ROUNDS) -> dict[str, TensorInfo]:
    """Inference, then the sizes ``Shape`` reads folded into constants (with the float arithmetic
    that data propagation skips: an interpolation's output size computed as ceil(h * scale)), and
    again while that folds more."""
    infos = _inferred(model)
    for _ in range(rounds):
        refolded = _with_constants_folded(model, infos)
        if _constants(refolded) == _constants(model):
            break
        model = refolded
        infos = _inferred(model)
    return infos


def _constants(model: onnx.ModelProto) -> int:
    return sum(n.op_type == "Constant" for n in model.graph.node)


def _dims(vi: onnx.ValueInfoProto) -> list[Dim]:
    tt = vi.type.tensor_type
    return (
        [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
        if tt.HasField("shape")
        else []
    )


def _with_input_sizes(model: onnx.ModelProto, sizes: Mapping[str, int]) -> onnx.ModelProto:
    """A copy of ``model`` whose inputs' symbolic dimensions are the given sizes."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.value_info[:]
    for vi in out.graph.input:
        if vi.type.tensor_type.HasField("shape"):
            for d in vi.type.tensor_type.shape.dim:
                if not d.HasField("dim_value") and d.dim_param in sizes:
                    size = sizes[d.dim_param]
                    d.Clear()
                    d.dim_value = size
    return out


def _inferred(model: onnx.ModelProto) -> dict[str, TensorInfo]:
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    infos: dict[str, TensorInfo] = {}
    g = inferred.graph
    for vi in [*g.input, *g.value_info, *g.output]:
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            continue
        shape: tuple[Dim, ...] | None = None
        if tt.HasField("shape"):
            shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
        infos[vi.name] = TensorInfo(tt.elem_type, shape)
    for init in g.initializer:
        infos[init.name] = TensorInfo(init.data_type, tuple(int(d) for d in init.dims))
    return infos


def _with_constants_folded(model: onnx.ModelProto, infos: Mapping[str, TensorInfo] | None = None) -> onnx.ModelProto:
    """``model`` with each node whose outputs :func:`constant_values` folds replaced by ``Constant``
    nodes (the model itself when there are none)."""
    opset = default_opset(model)
    graph = model.graph
    values = constant_values(graph, opset, infos)
    inits = {i.name for i in graph.initializer}
    nodes, changed = [], False
    for node in graph.node:
        outs = [o for o in node.output if o]
        if node.op_type != "Constant" and outs and all(o in values and o not in inits for o in outs):
            nodes += [helper.make_node("Constant", [], [o], value=numpy_helper.from_array(values[o], o)) for o in outs]
            changed = True
        else:
            nodes.append(node)
    if not changed:
        return model
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    del folded.graph.node[:]
    folded.graph.node.extend(nodes)
    return folded


def constant_values(
    graph: onnx.GraphProto, opset: int | None = None, infos: Mapping[str, TensorInfo] | None = None
) -> dict[str, np.ndarray]:
    """Values of the graph's initializers and of its ``Constant`` nodes' outputs; given the graph's
    ``opset``, also of the small shape arithmetic computed from constants alone (the dynamo
    exporter's unoptimized graphs build a ``ReduceMean``'s axes or a ``Slice``'s starts with
    ``Reshape``, ``Concat`` and ``Cast`` of ``Constant`` nodes), so that rules read them as constants.
    Given the tensors' ``infos`` too, the static dimensions a ``Shape`` reads count as constants
    (a rotary embedding halves its last axis at ``x.shape[-1] // 2`` while the batch stays dynamic)."""
    values = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    # tensors no trainable weight can feed: a folded value stays what it is while the model trains
    fixed = {n for n, v in values.items() if not np.issubdtype(v.dtype, np.floating)}
    partial: dict[str, list[int | None]] = {}  # shape vectors with some dimensions known
    for node in graph.node:
        if node.domain not in DEFAULT_DOMAINS:
            continue
        if node.op_type == "Constant":
            a = node.attribute[0]
            if a.name == "value":
                values[node.output[0]] = numpy_helper.to_array(a.t)
            elif a.name in ("value_float", "value_int"):
                values[node.output[0]] = np.array(helper.get_attribute_value(a))
            elif a.name in ("value_floats", "value_ints"):
                values[node.output[0]] = np.array(helper.get_attribute_value(a))
            else:
                continue
            fixed.add(node.output[0])
        elif opset is not None and _foldable(node, values, fixed):
            folded = _fold(node, values, opset)
            if folded is not None:
                values.update(folded)
                fixed.update(folded)
        elif infos is not None:
            known = _known_dims(node, values, fixed, partial, infos)
            if known is not None and all(d is not None for d in known):
                scalar = node.op_type == "Gather" and values[node.input[1]].ndim == 0
                values[node.output[0]] = np.array(known[0] if scalar else known, dtype=np.int64)
                fixed.add(node.output[0])
            elif known is not None:
                partial[node.output[0]] = known
    return values


def _known_dims(
    node: onnx.NodeProto,
    values: Mapping[str, np.ndarray],
    fixed: set[str],
    partial: Mapping[str, list[int | None]],
    infos: Mapping[str, TensorInfo],
) -> list[int | None] | None:
    """The entries of a ``Shape`` (or a ``Gather``, ``Slice`` or ``Concat`` of shapes) that shape
    inference fixed, None for the others; None when the node is none of these."""

    def dims(name: str) -> list[int | None] | None:
        if name in partial:
            return partial[name]
        if name in fixed and values[name].ndim <= 1 and np.issubdtype(values[name].dtype, np.integer):
            return [int(v) for v in values[name].reshape(-1)]
        return None

    op = node.op_type
    if op == "Shape":
        info = infos.get(node.input[0])
        if info is None or info.shape is None:
            return None
        shape = [d if isinstance(d, int) else None for d in info.shape]
        start, end = attr(node, "start", 0), attr(node, "end")
        return shape[start:end] if end is not None else shape[start:]
    if op == "Gather" and int(attr(node, "axis", 0)) == 0:
        data, idx = dims(node.input[0]), node.input[1]
        if data is None or idx not in fixed or values[idx].ndim > 1:
            return None
        return [data[int(i)] for i in values[idx].reshape(-1)]
    if op == "Slice" and len(node.input) >= 3:
        data = dims(node.input[0])
        bounds = [values[i].reshape(-1) if i in fixed else None for i in node.input[1:]]
        if data is None or any(b is None for b, i in zip(bounds, node.input[1:]) if i):
            return None
        starts, ends = bounds[0], bounds[1]
        axes = bounds[2] if len(node.input) > 3 and node.input[3] else None
        if starts is None or ends is None or (axes is not None and [int(a) for a in axes] not in ([0], [-1])):
            return None
        steps = bounds[3] if len(bounds) > 3 else None
        step = int(steps[0]) if steps is not None else 1
        return data[int(starts[0]) : int(ends[0]) : step]
    if op == "Concat":
        parts = [dims(i) for i in node.input]
        known = [p for p in parts if p is not None]
        return [d for p in known for d in p] if len(known) == len(parts) else None
    return None


# ops that read no graph attribute and draw no random numbers, evaluated on constants when their inputs are small
_FOLD_LIMIT = 4096
_NOT_FOLDED = frozenset(
    {
        "Dropout",
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
        "Loop",
        "If",
        "Scan",
        "SequenceMap",
    }
)


def _foldable(node: onnx.NodeProto, values: Mapping[str, np.ndarray], fixed: set[str]) -> bool:
    if (
        node.op_type in _NOT_FOLDED
        or not node.input
        or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
    ):
        return False
    return all(not i or (i in fixed and values[i].size <= _FOLD_LIMIT) for i in node.input)


def _fold(node: onnx.NodeProto, values: Mapping[str, np.ndarray], opset: int) -> dict[str, np.ndarray] | None:
    """The node's outputs computed by onnx's reference implementation, or None where it cannot."""
    from onnx.reference import ReferenceEvaluator

    try:
        run = ReferenceEvaluator(node, opsets={"": opset})
        outs = run.run(None, {i: values[i] for i in node.input if i})
    except Exception:  # noqa: BLE001 - an op the reference does not cover stays computed at run time
        return None
    return {
        o: np.asarray(v) for o, v in zip(node.output, outs) if o and v is not None and np.asarray(v).size <= _FOLD_LIMIT
    }


def needed_for(nodes: Sequence[onnx.NodeProto], targets: Iterable[str]) -> set[str]:
    """Every tensor ``targets`` are computed from (themselves included), what subgraphs read of the
    outer scope too."""
    needed = set(targets)
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            needed |= node_reads(node)
    return needed


FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16})
# inputs of an op that steer it but carry no gradient although they may be float: CastLike's target type
NON_DIFFERENTIABLE_INPUTS: dict[str, tuple[int, ...]] = {"CastLike": (1,)}


def differentiable(
    nodes: Sequence[onnx.NodeProto],
    sources: Iterable[str],
    infos: Mapping[str, TensorInfo],
    detached: Set[str] = frozenset(),
) -> set[str]:
    """The tensors a gradient can reach from ``sources`` (themselves included), nodes in topological order.

    It follows float tensors only, through ops that carry a gradient (not every tensor computed from them):
    integer, boolean and shape paths (``Shape`` and the arithmetic on it, a boolean mask, an index
    buffer), the outputs of ops without a gradient and ``detached`` tensors (``Tensor.detach()``)
    stop it, so that they need no rule. A tensor whose type inference could not fix counts as float
    (the rule decides)."""
    reached = set(sources)
    for node in nodes:
        if node.domain in DEFAULT_DOMAINS and node.op_type in NO_GRADIENT:
            continue
        skip = NON_DIFFERENTIABLE_INPUTS.get(node.op_type, ()) if node.domain in DEFAULT_DOMAINS else ()
        if not any(i in reached for k, i in enumerate(node.input) if i and k not in skip):
            continue
        for o in node.output:
            info = infos.get(o)
            if o in detached:
                continue
            if o and (info is None or info.elem_type in FLOAT_TYPES or info.elem_type == TensorProto.UNDEFINED):
                reached.add(o)
    return reached


def backward(
    emitter: Emitter,
    nodes: Sequence[onnx.NodeProto],
    seeds: Mapping[str, str],
    wrt: Sequence[str],
    lookup_masks: Mapping[str, str] | None = None,
    detached: Set[str] = frozenset(),
) -> dict[str, str | None]:
    """Emit the gradients of the seeded tensors' sum with respect to each of ``wrt``.

    ``lookup_masks`` (weight -> a tensor broadcasting over it) multiplies the gradient each row
    lookup of the weight (``Gather`` on its first axis) gives it, and no other: torch's
    ``nn.Embedding(padding_idx=...)`` keeps its padding row out of the lookup's gradient, while an
    output layer tied to the embedding still trains that row. No gradient flows through the
    ``detached`` tensors (torch's ``Tensor.detach()``).

    ``seeds`` maps a forward tensor to the tensor holding the gradient flowing into it (for a
    scalar loss: a ones tensor, or 1/N for the mean). Only nodes on a path from ``wrt`` to a seed
    along which a gradient flows (:func:`differentiable`) are differentiated. Returns ``wrt`` name -> gradient tensor, or
    None where no seeded tensor depends on it (a zero gradient). Raises
    :class:`UnsupportedOpError` for the first node on the way that no rule covers."""
    live = differentiable(nodes, wrt, emitter.infos, detached)
    needed = needed_for(nodes, seeds)
    _refuse_control_flow(nodes, live, needed)
    gelus = erf_gelus(nodes, emitter, live)
    norms = batch_norms(nodes, emitter, needed)
    tap_sums = conv_tap_sums(nodes, emitter)  # their windows' gradients are gathered from dy at the sum
    gathered = {term for t in tap_sums.values() if t.target in live for term in t.terms}
    grads: dict[str, list[str]] = {}  # a tensor -> the gradients reaching it, summed when its producer needs them
    for name, seed in seeds.items():
        if name in live:
            grads.setdefault(name, []).append(seed)
    done: set[int] = set()  # the composites differentiated already (by id)
    for node in reversed(nodes):
        group = emitter.composites.get(node.output[0]) if node.output else None
        if group is not None:  # the whole group at once, when the walk meets its last node
            if id(group) not in done:
                done.add(id(group))
                _composite_gradient(emitter, group, grads, live)
            continue
        outs = [_total(emitter, grads, o) if o else None for o in node.output]
        if all(g is None for g in outs):
            continue
        if not any(i in live for i in node.input if i) or not any(o in needed for o in node.output):
            continue
        if node.domain not in DEFAULT_DOMAINS:
            raise UnsupportedOpError(
                node.op_type, node.name, f"is in domain {node.domain!r}; only standard ONNX ops are covered"
            )
        if node.op_type in NO_GRADIENT:
            continue
        bn = norms.get(node.output[0])
        if bn is not None and outs[0] is not None:  # the whole normalization at once, as the GELU below
            bn_wants = [bn.x in live, bn.scale in live, bn.bias in live]
            for name, grad in zip((bn.x, bn.scale, bn.bias), batch_norm_gradient(emitter, bn, outs[0], bn_wants)):
                if grad is not None:
                    grads.setdefault(name, []).append(grad)
            continue
        gelu = gelus.get(node.output[0])
        if gelu is not None and outs[0] is not None:  # the whole pattern at once: its inner tensors get no gradient
            if gelu[0] in live:
                grads.setdefault(gelu[0], []).append(erf_gelu_gradient(emitter, gelu, outs[0]))
            continue
        rule = RULES.get(node.op_type)
        if rule is None:
            raise UnsupportedOpError(node.op_type, node.name)
        wants = [
            bool(i) and i in live and not (k == 0 and node.output[0] in gathered) for k, i in enumerate(node.input)
        ]
        in_grads = rule(emitter, node, outs, wants)
        tap_sum = tap_sums.get(node.output[0])
        if tap_sum is not None and tap_sum.target in live and outs[0] is not None:
            grads.setdefault(tap_sum.target, []).append(tap_sum_input_gradient(emitter, tap_sum, outs[0]))
        mask = (lookup_masks or {}).get(node.input[0]) if node.op_type == "Gather" else None
        if mask is not None and in_grads[0] is not None and int(attr(node, "axis", 0)) == 0:
            in_grads = [emitter.op("Mul", [in_grads[0], mask]), *in_grads[1:]]
        for name, grad, want in zip(node.input, in_grads, wants):
            if grad is not None and want:
                grads.setdefault(name, []).append(grad)
    return {w: _total(emitter, grads, w) for w in wrt}


#: Ops that run a subgraph: no rule differentiates them.
CONTROL_FLOW = frozenset({"Loop", "Scan", "If"})


def _refuse_control_flow(nodes: Sequence[onnx.NodeProto], live: set[str], needed: set[str]) -> None:
    """:class:`UnsupportedOpError` for the first ``Loop``, ``Scan`` or ``If`` a gradient must cross,
    before any rule meets the tensors of unknown shape it computes (a ``Slice`` of a Loop's output
    would be refused for its shape, not for the loop)."""
    for node in nodes:
        if (
            node.domain in DEFAULT_DOMAINS
            and node.op_type in CONTROL_FLOW
            and any(i in live for i in node_reads(node))  # a branch's weights are read from inside it
            and any(o in needed for o in node.output)
        ):
            raise UnsupportedOpError(
                node.op_type, node.name or node.output[0], _CONTROL_FLOW_REFUSALS.get(node.op_type, _SUBGRAPH)
            )


_SUBGRAPH = (
    "runs a subgraph, which no rule differentiates (a Loop or Scan of the main graph whose length is known when "
    "the plan is made is unrolled, one inside another subgraph is not); export the computation without it: a "
    "recurrence as an ONNX LSTM or GRU op or as a Loop or Scan over a fixed length"
)
_CONTROL_FLOW_REFUSALS = {
    "If": "runs a subgraph chosen at run time, which no rule differentiates: its condition is not known when the "
    "plan is made (it is computed from the input data or the batch size; one computed from constants and static "
    "shapes is replaced by its branch); export both branches as ops and choose between their results with Where, "
    "or the branch the model trains with alone (torch.jit.trace records the branch its example takes)",
}


def _composite_gradient(emitter: Emitter, group: Composite, grads: dict[str, list[str]], live: set[str]) -> None:
    """The gradients of a :class:`Composite`'s inputs, from those reaching its outputs."""
    outs = [_total(emitter, grads, o) for o in group.outputs]
    wants = [i in live for i in group.inputs]
    if all(g is None for g in outs) or not any(wants):
        return
    for name, grad, want in zip(group.inputs, group.gradient(outs, wants), wants):
        if grad is not None and want:
            grads.setdefault(name, []).append(grad)


def _total(emitter: Emitter, grads: dict[str, list[str]], name: str) -> str | None:
    """The sum of the gradients reaching ``name`` (None when none does), emitted once: the weight
    gradients of several uses as one Gemm over their rows stacked; the others in one Sum, where a
    mean's expanded gradient is added in its small form (the Sum broadcasts it) when another is of
    the full shape."""
    parts = grads.get(name)
    if not parts:
        return None
    info = emitter.info(name)
    if len(parts) > 1:
        products = [p for p in parts if p in emitter.products]
        if len(products) > 1:
            rows = [emitter.products[p] for p in products]
            left = emitter.op("Concat", [a for a, _ in rows], axis=0)
            right = emitter.op("Concat", [d for _, d in rows], axis=0)
            parts = [p for p in parts if p not in emitter.products] + [emitter.op("Gemm", [left, right], transA=1)]
        if any(p not in emitter.broadcasts for p in parts):
            parts = [emitter.broadcasts.get(p, p) for p in parts]
        if len(parts) > 1:
            parts = [emitter.op("Sum", parts, hint=f"d_{name}")]
    total = parts[0]
    if info is not None:  # a gradient has its tensor's type and shape
        emitter.infos.setdefault(total, info)
    grads[name] = [total]
    return total


def vjp_model(model: onnx.ModelProto, *, outputs: Sequence[str], wrt: Sequence[str]) -> onnx.ModelProto:
    """The model's vector-Jacobian product: the same inputs plus one cotangent input
    ``seed/<output>`` per output, returning ``grad/<name>`` = d(sum_o seed_o * o)/d name for each of
    ``wrt`` (inputs or initializers; initializers stay constants). Zero gradients come out as zeros.

    Used to check every rule against finite differences and whole models against an
    independent autograd."""
    graph = model.graph
    opset = next(o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS)
    infos = tensor_infos(model)
    taken = (
        {t for n in graph.node for t in [*n.input, *n.output]}
        | {i.name for i in graph.input}
        | {i.name for i in graph.initializer}
    )
    e = Emitter(opset, infos, constant_values(graph, opset, infos), taken)
    nodes = decompose(e, list(graph.node))
    if len(nodes) != len(graph.node) or e.initializers:  # shapes of the written-out ops, for the rules
        probe = helper.make_model(
            helper.make_graph(
                nodes, "probe", list(graph.input), list(graph.output), initializer=[*graph.initializer, *e.initializers]
            ),
            opset_imports=list(model.opset_import),
            ir_version=model.ir_version,
        )
        refine_infos(e.infos, tensor_infos(probe))
    seeds = {}
    seed_inputs = []
    for o in outputs:
        name = e.reserve(f"seed/{o}")
        info = infos[o]
        seed_inputs.append(_value_info(name, info))
        e.record(name, info.elem_type, info.shape)
        seeds[o] = name
    grads = backward(e, nodes, seeds, wrt)
    outs = []
    for w in wrt:
        name = f"grad/{w}"
        grad = grads[w]
        e.op("Identity", [grad if grad is not None else e.zeros_like(w)], out=name)
        outs.append(_value_info(name, infos[w]))
    new_graph = helper.make_graph(
        [*nodes, *e.nodes],
        graph.name,
        [*graph.input, *seed_inputs],
        outs,
        initializer=[*graph.initializer, *e.initializers],
    )
    out = helper.make_model(new_graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    onnx.checker.check_model(out)
    return out


def _value_info(name: str, info: TensorInfo) -> onnx.ValueInfoProto:
    shape = None if info.shape is None else [d if d is not None else None for d in info.shape]
    return helper.make_tensor_value_info(name, info.elem_type, shape)
