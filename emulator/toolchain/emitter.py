"""What the autodiff engine, its gradient rules and the training forward rewrites share: the
:class:`Emitter` that writes new nodes and constants into a graph, the type and shape of a tensor,
the error for an op without a rule, and reading a node's attributes and what it reads.

A leaf module (it imports nothing of the toolchain): :mod:`.autodiff` drives the rules of
:mod:`.gradients` and the rewrites of :mod:`.forward`, which both emit through this, so none of the
three has to import another back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

DEFAULT_DOMAINS = ("", "ai.onnx")
Dim = int | str | None


class UnsupportedOpError(ValueError):
    """A node whose op has no gradient rule (or that a rule cannot handle in this form)."""

    def __init__(self, op_type: str, node_name: str, detail: str = "") -> None:
        self.op_type = op_type
        self.node_name = node_name
        what = f"op {op_type!r} (node {node_name!r})"
        reason = detail or "has no gradient rule"
        super().__init__(
            f"{what} {reason}; see emulator.toolchain.OP_COVERAGE for the ops a training plan can "
            "differentiate, freeze the weights behind it (trainable=...), or rewrite the model with covered ops"
        )


@dataclass(frozen=True)
class TensorInfo:
    elem_type: int
    shape: tuple[Dim, ...] | None  # None: rank unknown; a dim is an int, a symbol, or None

    @property
    def static_shape(self) -> tuple[int, ...] | None:
        if self.shape is None or not all(isinstance(d, int) for d in self.shape):
            return None
        return tuple(int(d) for d in self.shape)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Composite:
    """Nodes emitted together whose gradient is emitted as a whole (an unrolled LSTM's steps): the
    engine differentiates none of the nodes writing ``tensors`` one by one, but calls ``gradient``
    once, with the gradients reaching ``outputs`` (None where none does) and which of ``inputs``
    want one, for one gradient (or None) per input. Every reader of ``outputs`` outside the group
    comes after all its nodes. ``saved``: the tensors of the group that ``gradient`` reads, which a
    forward pruned to what its outputs need keeps as well."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    tensors: frozenset[str]
    gradient: Callable[[list[str | None], list[bool]], list[str | None]]
    saved: tuple[str, ...] = ()


def attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs ``node`` runs (a ``Loop``'s body, an ``If``'s branches)."""
    return [g for a in node.attribute for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs))]


def default_opset(model: onnx.ModelProto) -> int | None:
    """The version of the standard (``ai.onnx``) opset ``model`` imports; None when it imports none."""
    return next((int(o.version) for o in model.opset_import if o.domain in DEFAULT_DOMAINS), None)


def namer(graph: onnx.GraphProto) -> Callable[[str], str]:
    """A function giving names (``hint``, else ``hint_1``, ...) that no tensor of ``graph``, nor any
    name it gave before, has."""
    taken = {t for n in graph.node for t in [*n.input, *n.output]}
    taken |= {i.name for i in [*graph.initializer, *graph.input, *graph.output]}

    def fresh(hint: str) -> str:
        name, k = hint, 0
        while name in taken:
            k += 1
            name = f"{hint}_{k}"
        taken.add(name)
        return name

    return fresh


def own_names(graph: onnx.GraphProto) -> set[str]:
    """The names ``graph`` itself defines (its inputs, initializers and nodes' outputs)."""
    return {i.name for i in [*graph.input, *graph.initializer]} | {o for n in graph.node for o in n.output}


def _outer_reads(graph: onnx.GraphProto) -> set[str]:
    """The names ``graph``'s nodes (and the subgraphs inside them) read that ``graph`` does not define."""
    read: set[str] = set()
    for node in graph.node:
        read |= node_reads(node)
    return read - own_names(graph)


def node_reads(node: onnx.NodeProto) -> set[str]:
    """What ``node`` reads, the names of the outer scope its subgraphs read included."""
    read = {i for i in node.input if i}
    for g in subgraphs(node):
        read |= _outer_reads(g)
    return read


class Emitter:
    """Emits new nodes and constants into a graph with unique names, opset-aware.

    Knows the type and shape of every forward tensor (``infos``) and of the tensors it makes when
    the caller records them, and the values of constants (initializers and ``Constant`` nodes)."""

    def __init__(
        self, opset: int, infos: dict[str, TensorInfo], constants: Mapping[str, np.ndarray], taken: Iterable[str]
    ):
        self.opset = opset
        self.infos = dict(infos)
        self.constants = dict(constants)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._taken = set(taken)
        self._n = 0
        self._ints: dict[tuple, str] = {}
        self._scalars: dict[tuple, str] = {}
        # an Expand's output -> its smaller input: where the expanded gradient is added to another
        # of the full shape, the Add broadcasts the small one instead (one pass over the tensor less)
        self.broadcasts: dict[str, str] = {}
        # a weight gradient Gemm(a, dy, transA=1)'s output -> (a, dy): a weight used several times (a
        # recurrent one, every step) sums one Gemm over all uses' rows instead of a small one per use
        self.products: dict[str, tuple[str, str]] = {}
        # a tensor -> one that is known to have its shape where inference cannot tell (the sum over a
        # Conv's kernel offsets and its terms, whose rows come from a Reshape to [-1, C]): the sum's
        # gradient goes to each term as it is, without the reduction over axes found at run time
        self.same_shape: dict[str, str] = {}
        # a tensor written by a group of nodes differentiated as a whole -> that group
        self.composites: dict[str, Composite] = {}
        # tensors known to hold zeros only (a ConstantOfShape of 0): an LSTM from zero states skips
        # its first step's recurrent product
        self.zeros: set[str] = set()
        # a value computed once and read wherever it is needed, by what it is (the count of elements
        # over dimensions of known sizes or graph-wide symbols, the batch's: every batch norm of a
        # stage divides by the same)
        self.shared: dict[tuple, str] = {}

    # ------------------------------------------------------------------ names and nodes

    def fresh(self, hint: str) -> str:
        hint = hint.replace("/", "_")
        while True:
            self._n += 1
            name = f"{hint}__{self._n}"
            if name not in self._taken:
                self._taken.add(name)
                return name

    def reserve(self, name: str) -> str:
        """``name`` if nobody uses it yet, else a fresh variant of it."""
        if name in self._taken:
            return self.fresh(name)
        self._taken.add(name)
        return name

    def op(
        self, op_type: str, inputs: Sequence[str], *, out: str | None = None, hint: str | None = None, **attrs
    ) -> str:
        out = out or self.fresh(hint or op_type.lower())
        self._taken.add(out)
        if op_type == "Transpose" and list(attrs.get("perm", [1, 0])) == list(range(len(attrs.get("perm", [])))):
            # no transpose at all: onnxruntime 1.15's GemmTransposeFusion fuses Transpose(perm=[0, 1]) after a
            # Gemm as if it swapped the axes, and the plan failed on that release
            op_type, attrs = "Identity", {}
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=self.fresh(f"g_{op_type}"), **attrs))
        return out

    def op_multi(self, op_type: str, inputs: Sequence[str], outputs: Sequence[str], **attrs) -> list[str]:
        outs = [self.reserve(o) for o in outputs]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.fresh(f"g_{op_type}"), **attrs))
        return outs

    def rename(self, old: str, new: str) -> None:
        """Give the emitted tensor ``old`` the name ``new`` everywhere it is written or read."""
        self._taken.add(new)
        for node in self.nodes:
            for i, name in enumerate(node.input):
                if name == old:
                    node.input[i] = new
            for i, name in enumerate(node.output):
                if name == old:
                    node.output[i] = new
        if old in self.infos:
            self.infos[new] = self.infos[old]

    def record(self, name: str, elem_type: int, shape: tuple[Dim, ...] | None) -> str:
        self.infos[name] = TensorInfo(elem_type, shape)
        return name

    def saved_by_composites(self) -> list[str]:
        """Every tensor a :class:`Composite`'s gradient reads."""
        groups = {id(g): g for g in self.composites.values()}
        return [t for g in groups.values() for t in g.saved]

    def composite(
        self,
        start: int,
        inputs: Sequence[str],
        outputs: Sequence[str],
        gradient: Callable[[list[str | None], list[bool]], list[str | None]],
        saved: Sequence[str] = (),
    ) -> None:
        """The nodes emitted since ``len(self.nodes)`` was ``start`` form a :class:`Composite`."""
        tensors = frozenset(o for n in self.nodes[start:] for o in n.output if o)
        group = Composite(tuple(inputs), tuple(outputs), tensors, gradient, tuple(saved))
        for t in tensors:
            self.composites[t] = group

    # ------------------------------------------------------------------ constants

    def const(self, value: np.ndarray, hint: str = "c") -> str:
        name = self.fresh(hint)
        arr = np.asarray(value)
        self.initializers.append(numpy_helper.from_array(arr, name))
        self.constants[name] = arr
        self.infos[name] = TensorInfo(helper.np_dtype_to_tensor_dtype(arr.dtype), tuple(arr.shape))
        return name

    def ints(self, values: Sequence[int]) -> str:
        key = tuple(int(v) for v in values)
        if key not in self._ints:
            self._ints[key] = self.const(np.array(key, dtype=np.int64), "ints")
        return self._ints[key]

    def scalar(self, value: float, like: str) -> str:
        """A rank-0 constant of the element type of tensor ``like``."""
        elem = self.elem_type(like)
        key = (float(value), elem)
        if key not in self._scalars:
            dtype = helper.tensor_dtype_to_np_dtype(elem)
            self._scalars[key] = self.const(np.array(value, dtype=dtype), "k")
        return self._scalars[key]

    def value(self, name: str) -> np.ndarray | None:
        """The value of a constant tensor, or None when it is computed at run time."""
        return self.constants.get(name)

    # ------------------------------------------------------------------ types and shapes

    def info(self, name: str) -> TensorInfo | None:
        return self.infos.get(name)

    def elem_type(self, name: str) -> int:
        info = self.infos.get(name)
        return info.elem_type if info is not None else TensorProto.FLOAT

    def shape(self, name: str) -> tuple[Dim, ...] | None:
        info = self.infos.get(name)
        return None if info is None else info.shape

    def rank(self, name: str) -> int | None:
        shape = self.shape(name)
        return None if shape is None else len(shape)

    def shape_of(self, name: str) -> str:
        """A 1-D int64 tensor holding the shape of ``name``: a constant when inference fixed it."""
        info = self.infos.get(name)
        if info is not None and info.static_shape is not None:
            return self.ints(info.static_shape)
        return self.op("Shape", [name], hint="shape")

    # ------------------------------------------------------------------ opset-aware helpers

    def reduce(self, op_type: str, x: str, axes: Sequence[int] | None, keepdims: bool, hint: str | None = None) -> str:
        """Reduce over ``axes`` (None: all), with the axes as an input from the opset that wants it."""
        input_axes = op_type == "ReduceSum" and self.opset >= 13 or self.opset >= 18
        if axes is None:
            return self.op(op_type, [x], keepdims=int(keepdims), hint=hint)
        if input_axes:
            return self.op(op_type, [x, self.ints(axes)], keepdims=int(keepdims), hint=hint)
        return self.op(op_type, [x], axes=list(axes), keepdims=int(keepdims), hint=hint)

    def unsqueeze(self, x: str, axes: Sequence[int]) -> str:
        return self.op("Unsqueeze", [x, self.ints(axes)])

    def reshape_like(self, x: str, like: str) -> str:
        return self.op("Reshape", [x, self.shape_of(like)])

    def broadcast_to(self, small: str, like: str) -> str:
        """``small`` (which broadcasts to ``like``) expanded to ``like``'s shape, remembered as such."""
        out = self.op("Expand", [small, self.shape_of(like)])
        self.broadcasts[out] = small
        return out

    def zeros_like(self, like: str) -> str:
        dtype = helper.tensor_dtype_to_np_dtype(self.elem_type(like))
        return self.op(
            "ConstantOfShape",
            [self.shape_of(like)],
            value=numpy_helper.from_array(np.zeros(1, dtype=dtype)),
            hint="zeros",
        )

    def unbroadcast(self, grad: str, out: str, target: str) -> str:
        """Sum ``grad`` (shaped like the broadcast result ``out``) down to the shape of ``target``."""
        if out in self.same_shape and self.same_shape[out] == self.same_shape.get(target):
            return grad
        s_out, s_in = self.shape(out), self.shape(target)
        if s_out is not None and s_in is not None:
            if s_out == s_in and all(d is not None for d in s_in):
                return grad
            lead = len(s_out) - len(s_in)
            axes = list(range(lead))
            dynamic = False
            for i, d_in in enumerate(s_in):
                d_out = s_out[lead + i]
                if d_in == d_out and d_in is not None:
                    continue
                if d_in == 1:
                    axes.append(lead + i)
                elif isinstance(d_in, int) and d_in > 1:
                    continue
                else:
                    dynamic = True
            if not dynamic:
                if not axes:
                    return grad
                if all(a < lead for a in axes):  # only leading axes: drop them as they are summed
                    return self.reduce("ReduceSum", grad, axes, keepdims=False)
                summed = self.reduce("ReduceSum", grad, axes, keepdims=True)
                if lead == 0:
                    return summed
                return self.reshape_like(summed, target)
        return self._unbroadcast_dynamic(grad, target)

    def _unbroadcast_dynamic(self, grad: str, target: str) -> str:
        # axes where the target (left-padded with 1s) is 1 but the gradient is not, found at run time
        g_shape = self.op("Shape", [grad])
        t_shape = self.op("Shape", [target])
        g_rank = self.op("Shape", [g_shape])
        t_rank = self.op("Shape", [t_shape])
        pad = self.op("Sub", [g_rank, t_rank])
        ones = self.op("Expand", [self.ints([1]), pad])
        padded = self.op("Concat", [ones, t_shape], axis=0)
        one = self.ints([1])
        is_one = self.op("Equal", [padded, one])
        differs = self.op("Not", [self.op("Equal", [g_shape, one])])
        axes = self.op("Reshape", [self.op("NonZero", [self.op("And", [is_one, differs])]), self.ints([-1])])
        summed = self.op("ReduceSum", [grad, axes], keepdims=1, noop_with_empty_axes=1)
        return self.op("Reshape", [summed, t_shape])
