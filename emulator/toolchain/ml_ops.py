"""scikit-learn's models as skl2onnx writes them, in the standard ops a plan differentiates.

skl2onnx writes a linear model (``LogisticRegression``, ``LinearSVC``, ``LinearRegression``,
``Ridge``...) and its preprocessing as ops of the ``ai.onnx.ml`` domain whose weights are
attributes: nothing a plan could train, and ops with no gradient rule. :func:`standard_form`
writes them, in place, in the standard ops they compute (onnxruntime's kernels are the
reference, outputs equal within float32 rounding):

- ``LinearClassifier``: ``X @ W + b`` with ``W`` and ``b`` new initializers
  (``<node>.coefficients`` [features, classes], ``<node>.intercepts``) that train, then its
  ``post_transform``; ``LOGISTIC`` over the two tied rows skl2onnx writes for a binary model
  (``[-w, w]``), or over one row, is the ``Softmax`` of ``z * [-1/2, 1/2]`` (``[sigmoid(-z),
  sigmoid(z)]``), one row ``w`` training; the label output is the ``ArgMax`` read in the class labels;
- ``LinearRegressor``: ``X @ W + b``;
- ``Scaler`` (``(X - offset) * scale``) and ``Normalizer`` (``MAX``, ``L1``, ``L2``; a zero row stays
  zero, as in onnxruntime), their constants ``Constant`` nodes that never train; an ``L1``
  ``Normalizer`` of a ``Softmax`` is that ``Softmax``, and one of one-vs-rest sigmoids is the
  ``Softmax`` of their logarithms, so that ``cross_entropy`` reads logits;
- ``ZipMap`` (the classes' probabilities as a sequence of maps, skl2onnx's default): its input,
  under the name of its output, as the float tensor a loss reads.

A form with no such translation (``post_transform`` ``PROBIT`` or ``SOFTMAX_ZERO``) is refused in
one line; the other ``ai.onnx.ml`` ops (trees, SVMs with kernels, encoders) are refused by the
plan where the loss reads them: they have no gradient. A naive Bayes classifier, which skl2onnx
writes in standard ops, is refused by :func:`refuse_naive_bayes`: a gradient step on its counted
statistics trains no naive Bayes model.

:func:`probabilities_as_logits` does the same for the probabilities skl2onnx writes in standard
ops, which ``cross_entropy`` would otherwise read as logits: a binary ``MLPClassifier``'s or
``SGDClassifier``'s ``Concat(1 - sigmoid(z), sigmoid(z))`` becomes the ``Softmax`` above, and
``SGDClassifier``'s normalized one-vs-rest probabilities are read through their ``Log``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .autodiff import DEFAULT_DOMAINS, constant_values
from .emitter import attr, default_opset, namer

ML_DOMAIN = "ai.onnx.ml"
#: The ``ai.onnx.ml`` ops :func:`standard_form` writes in standard ops.
TRANSLATED = ("LinearClassifier", "LinearRegressor", "Scaler", "Normalizer", "ZipMap")
SKL2ONNX = "skl2onnx"
_F32 = TensorProto.FLOAT


class _Writer:
    """Nodes and initializers written for one graph, under fresh names."""

    def __init__(self, graph: onnx.GraphProto, opset: int) -> None:
        self.graph = graph
        self.opset = opset
        self.fresh: Callable[[str], str] = namer(graph)
        self.nodes: list[onnx.NodeProto] = []
        self.producers: dict[str, onnx.NodeProto] = {}

    def op(self, op_type: str, inputs: list[str], output: str | None = None, **attrs) -> str:
        out = output or self.fresh(f"{op_type.lower()}_out")
        node = helper.make_node(op_type, inputs, [out], name=self.fresh(f"{out}_{op_type}"), **attrs)
        self.nodes.append(node)
        self.producers[out] = node
        return out

    def reduce(self, op_type: str, x: str) -> str:
        """``op_type`` over axis 1 (the features), kept: its axes an input from opset 18 on (``ReduceSum``'s from 13)."""
        if self.opset >= (13 if op_type == "ReduceSum" else 18):
            return self.op(op_type, [x, self.const(np.array([1]), "axes")], keepdims=1)
        return self.op(op_type, [x], axes=[1], keepdims=1)

    def const(self, value: np.ndarray, hint: str) -> str:
        """A ``Constant`` node: never an initializer, so never trained."""
        name = self.fresh(hint)
        self.op("Constant", [], name, value=numpy_helper.from_array(value, name))
        return name

    def weight(self, value: np.ndarray, name: str) -> str:
        """A new float32 initializer: a weight the plan trains."""
        name = self.fresh(name)
        self.graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), name))
        return name


def _refuse(node: onnx.NodeProto, why: str) -> ValueError:
    return ValueError(
        f"op 'ai.onnx.ml.{node.op_type}' (node {node.name!r}) {why}; export the model without it, or as a network of "
        "standard ops (skl2onnx of an MLPClassifier or MLPRegressor, torch.onnx.export)"
    )


def _as_float(w: _Writer, x: str, types: dict[str, int]) -> str:
    return x if types.get(x, _F32) == _F32 else w.op("Cast", [x], to=_F32)


def _linear(w: _Writer, node: onnx.NodeProto, x: str, coefficients: np.ndarray, intercepts: np.ndarray) -> str:
    """``x @ coefficients.T + intercepts``, both new weights named after ``node``."""
    base = node.name or node.op_type
    weight = w.weight(coefficients.T, f"{base}.coefficients")
    bias = w.weight(intercepts, f"{base}.intercepts")
    return w.op("Add", [w.op("MatMul", [x, weight]), bias])


def _rows(node: onnx.NodeProto, count: int, width: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The coefficients as rows of ``width`` (``count`` rows when the width is unknown) and the intercepts."""
    flat = np.asarray(attr(node, "coefficients", []), np.float64)
    intercepts = np.asarray(attr(node, "intercepts", []), np.float64)
    rows = len(intercepts) or (flat.size // width if width else count)
    if rows == 0 or flat.size % rows or (width and flat.size != rows * width):
        raise _refuse(node, f"has {flat.size} coefficients, not a whole number of rows of its {width} features")
    return flat.reshape(rows, -1), intercepts if len(intercepts) else np.zeros(rows)


def _classifier(w: _Writer, node: onnx.NodeProto, x: str, width: int | None) -> None:
    labels_ints = attr(node, "classlabels_ints")
    labels_strings = attr(node, "classlabels_strings")
    labels = (
        np.asarray(labels_ints, np.int64)
        if labels_ints
        else np.asarray([s.decode() if isinstance(s, bytes) else s for s in labels_strings or []], dtype=object)
    )
    post = attr(node, "post_transform", b"NONE")
    post = post.decode() if isinstance(post, bytes) else post
    if post not in ("NONE", "LOGISTIC", "SOFTMAX"):
        raise _refuse(node, f"has post_transform {post}, which no standard op computes as onnxruntime does")
    coefficients, intercepts = _rows(node, len(labels), width)
    label_out, scores_out = (list(node.output) + ["", ""])[:2]
    binary = len(labels) == 2
    one_row = binary and len(coefficients) == 1
    tied = (
        binary
        and len(coefficients) == 2
        and np.array_equal(coefficients[0], -coefficients[1])
        and intercepts[0] == -intercepts[1]
    )
    if not one_row and len(coefficients) != len(labels):
        raise _refuse(node, f"has {len(coefficients)} rows of coefficients for {len(labels)} classes")
    if one_row or tied:  # one score z: onnxruntime's [1 - z, z], or [-z, z] for skl2onnx's two tied rows
        z = _linear(w, node, x, coefficients[-1:], intercepts[-1:])
        if post == "LOGISTIC":  # [sigmoid(-z), sigmoid(z)] == softmax([-z/2, z/2])
            logits = w.op("Mul", [z, w.const(np.array([-0.5, 0.5], np.float32), "two_classes")])
            scores = w.op("Softmax", [logits], scores_out or None, axis=-1)
        elif tied:
            scores = w.op("Mul", [z, w.const(np.array([-1.0, 1.0], np.float32), "two_classes")], scores_out or None)
            if post == "SOFTMAX":
                scores = w.op("Softmax", [scores], scores_out or None, axis=-1)
        else:
            signed = w.op("Mul", [z, w.const(np.array([-1.0, 1.0], np.float32), "two_classes")])
            scores = w.op("Add", [signed, w.const(np.array([1.0, 0.0], np.float32), "one_minus")], scores_out or None)
        if one_row:
            positive = w.op("Greater", [z, w.const(np.zeros((1,), np.float32), "zero")])
            index = w.op("Squeeze", [w.op("Cast", [positive], to=TensorProto.INT64), w.const(np.array([1]), "axis")])
        else:
            index = w.op("ArgMax", [scores], axis=1, keepdims=0)
    else:
        z = _linear(w, node, x, coefficients, intercepts)
        transform = {"NONE": "Identity", "LOGISTIC": "Sigmoid", "SOFTMAX": "Softmax"}[post]
        kwargs = {"axis": -1} if transform == "Softmax" else {}
        scores = w.op(transform, [z], scores_out or None, **kwargs)
        index = w.op("ArgMax", [scores], axis=1, keepdims=0)
    if label_out:
        table = (
            numpy_helper.from_array(labels, "labels")
            if labels.dtype != object
            else helper.make_tensor("labels", TensorProto.STRING, [len(labels)], [s.encode() for s in labels])
        )
        name = w.fresh("class_labels")
        table.name = name
        w.op("Constant", [], name, value=table)
        w.op("Gather", [name, index], label_out, axis=0)


def _regressor(w: _Writer, node: onnx.NodeProto, x: str, width: int | None) -> None:
    post = attr(node, "post_transform", b"NONE")
    post = post.decode() if isinstance(post, bytes) else post
    if post != "NONE":
        raise _refuse(node, f"has post_transform {post}, which no standard op computes as onnxruntime does")
    coefficients, intercepts = _rows(node, int(attr(node, "targets", 1)), width)
    out = _linear(w, node, x, coefficients, intercepts)
    w.op("Identity", [out], node.output[0])


def _scaler(w: _Writer, node: onnx.NodeProto, x: str) -> None:
    offset = np.asarray(attr(node, "offset", [0.0]), np.float32)
    scale = np.asarray(attr(node, "scale", [1.0]), np.float32)
    shifted = w.op("Sub", [x, w.const(offset, f"{node.name or 'Scaler'}.offset")])
    w.op("Mul", [shifted, w.const(scale, f"{node.name or 'Scaler'}.scale")], node.output[0])


def _normalizer(w: _Writer, node: onnx.NodeProto, x: str) -> None:
    norm = attr(node, "norm", b"MAX")
    norm = norm.decode() if isinstance(norm, bytes) else norm
    y = node.output[0]
    before = w.producers.get(x)
    if norm == "L1" and before is not None and before.op_type == "Softmax":  # already sums to one
        w.op("Identity", [x], y)
        return
    if norm == "L1" and before is not None and before.op_type == "Sigmoid":  # one-vs-rest probabilities
        logits = w.op("Neg", [w.op("Softplus", [w.op("Neg", [before.input[0]])])])  # log(sigmoid(z))
        w.op("Softmax", [logits], y, axis=-1)
        return
    if norm == "MAX":
        size = w.reduce("ReduceMax", x)
    elif norm == "L1":
        size = w.reduce("ReduceSum", w.op("Abs", [x]))
    elif norm == "L2":
        size = w.op("Sqrt", [w.reduce("ReduceSumSquare", x)])
    else:
        raise _refuse(node, f"has norm {norm!r}, which onnxruntime does not compute")
    zero = w.op("Equal", [size, w.const(np.zeros((1,), np.float32), "zero")])
    size = w.op("Where", [zero, w.const(np.ones((1,), np.float32), "one"), size])  # a zero row stays zero
    w.op("Div", [x, size], y)


def standard_form(model: onnx.ModelProto) -> list[str]:
    """Write the ``ai.onnx.ml`` ops of :data:`TRANSLATED` in ``model``'s main graph in standard ops,
    in place (see the module's docstring); returns the weights added."""
    graph = model.graph
    if not any(n.domain == ML_DOMAIN and n.op_type in TRANSLATED for n in graph.node):
        return []
    inferred = onnx.shape_inference.infer_shapes(model)
    types: dict[str, int] = {}
    widths: dict[str, int | None] = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        t = vi.type.tensor_type
        types[vi.name] = t.elem_type
        dims = t.shape.dim
        widths[vi.name] = dims[-1].dim_value if len(dims) >= 1 and dims[-1].HasField("dim_value") else None
    w = _Writer(graph, default_opset(model) or 13)
    before = len(graph.initializer)
    for node in graph.node:
        if node.domain != ML_DOMAIN or node.op_type not in TRANSLATED:
            w.nodes.append(node)
            w.producers.update({o: node for o in node.output})
            continue
        if node.op_type == "ZipMap":
            w.op("Identity", [node.input[0]], node.output[0])
            _zipmap_output_as_tensor(graph, node)
            continue
        x = _as_float(w, node.input[0], types)
        if node.op_type == "LinearClassifier":
            _classifier(w, node, x, widths.get(node.input[0]))
        elif node.op_type == "LinearRegressor":
            _regressor(w, node, x, widths.get(node.input[0]))
        elif node.op_type == "Scaler":
            _scaler(w, node, x)
        else:
            _normalizer(w, node, x)
    del graph.node[:]
    graph.node.extend(w.nodes)
    return [i.name for i in graph.initializer[before:]]


def _zipmap_output_as_tensor(graph: onnx.GraphProto, node: onnx.NodeProto) -> None:
    """The graph output a ``ZipMap`` wrote (a sequence of maps) declared as the float tensor
    [N, classes] its input is."""
    classes = len(attr(node, "classlabels_int64s", None) or attr(node, "classlabels_strings", None) or [])
    for k, out in enumerate(graph.output):
        if out.name == node.output[0]:
            graph.output[k].CopyFrom(helper.make_tensor_value_info(out.name, _F32, ["N", classes or None]))


#: The class prior every skl2onnx naive Bayes converter writes (``jointi`` for GaussianNB,
#: ``class_log_prior`` for the others), numbered when a graph holds two.
_NAIVE_BAYES_PRIOR = re.compile(r"(jointi|class_log_prior)\d*")


def refuse_naive_bayes(model: onnx.ModelProto, prediction: str) -> None:
    """Refuse, in one line saying what to export instead, a ``prediction`` skl2onnx computes from a
    naive Bayes classifier (``GaussianNB``, ``MultinomialNB``, ``BernoulliNB``, ``ComplementNB``,
    ``CategoricalNB``). Its weights are statistics counted from the data (class priors, per-class
    feature means and variances or log-frequencies), some precomputed from others (GaussianNB's
    ``sigma_sum_log``, the log-normalizer of ``sigma``), and its output is probabilities: a gradient
    step moves them apart and trains neither a naive Bayes model nor a sound classifier."""
    if model.producer_name != SKL2ONNX:
        return
    producers = {o: n for n in model.graph.node for o in n.output}
    needed = _ancestors(producers, prediction) & {i.name for i in model.graph.initializer}
    if not any(_NAIVE_BAYES_PRIOR.fullmatch(name) for name in needed):
        return
    gaussian = any(name.startswith("sigma_sum_log") for name in needed)
    kind = "GaussianNB" if gaussian else "naive Bayes (MultinomialNB, BernoulliNB, ComplementNB or CategoricalNB)"
    counted = "per-class feature means and variances" if gaussian else "per-class feature log-frequencies"
    raise ValueError(
        f"the output {prediction!r} is a scikit-learn {kind} classifier's: its class priors and {counted} are counted "
        "from the data, not learned by gradient steps, which would train no naive Bayes model; export a classifier "
        "that trains by gradient instead: skl2onnx of a LogisticRegression or SGDClassifier(loss='log_loss') (a "
        "linear model a plan writes in standard ops) or an MLPClassifier, or a network by torch.onnx.export or "
        "`fedfleet plan from-torch`"
    )


def probabilities_as_logits(model: onnx.ModelProto, prediction: str) -> str:
    """The tensor ``cross_entropy`` reads as logits for ``prediction`` where skl2onnx wrote a
    classifier's probabilities in standard ops (see the module's docstring); ``prediction``
    itself otherwise. Rewrites in place."""
    graph = model.graph
    if model.producer_name != SKL2ONNX:
        return prediction
    producers = {o: n for n in graph.node for o in n.output}
    node = producers.get(prediction)
    while node is not None and node.op_type == "Identity":  # a ZipMap's, written as Identity by standard_form
        node = producers.get(node.input[0])
    if node is None or node.domain not in DEFAULT_DOMAINS:
        return prediction
    values = constant_values(graph)
    if node.op_type == "Concat" and len(node.input) == 2 and attr(node, "axis") in (1, -1):
        minus, sigmoid = (producers.get(i) for i in node.input)
        if (
            sigmoid is not None
            and sigmoid.op_type == "Sigmoid"
            and minus is not None
            and minus.op_type == "Sub"
            and minus.input[1] == node.input[1]
            and np.all(values.get(minus.input[0], np.zeros(1)) == 1)
            and minus.input[0] in values
        ):
            fresh = namer(graph)
            half = fresh("two_classes")
            logits = fresh(f"{prediction}_logits")
            at = list(graph.node).index(node)
            written = [
                helper.make_node(
                    "Constant", [], [half], value=numpy_helper.from_array(np.array([-0.5, 0.5], np.float32), half)
                ),
                helper.make_node("Mul", [sigmoid.input[0], half], [logits], name=logits),
                helper.make_node("Softmax", [logits], [node.output[0]], name=node.name or logits, axis=-1),
            ]
            del graph.node[at]
            for k, n in enumerate(written):
                graph.node.insert(at + k, n)
        return prediction
    summed = _normalized(producers, node) if node.op_type == "Div" else None
    if summed is None:
        return prediction
    z = _sigmoid_of(producers, values, summed)
    if z is None:
        raise ValueError(
            f"the output {prediction!r} is probabilities divided by their sum (node {node.name!r}), which "
            "cross_entropy would read as logits; export the classifier's scores (its decision function) and train "
            "them with cross_entropy, or name the tensor before the normalization with output="
        )
    fresh = namer(graph)
    negated, soft, logits = fresh(f"{z}_negated"), fresh(f"{z}_softplus"), fresh(f"{prediction}_logits")
    graph.node.extend(  # sigmoid(z_k) / sum_j sigmoid(z_j) == softmax(log(sigmoid(z)))_k, log(sigmoid(z)) == -softplus(-z)
        [
            helper.make_node("Neg", [z], [negated], name=negated),
            helper.make_node("Softplus", [negated], [soft], name=soft),
            helper.make_node("Neg", [soft], [logits], name=logits),
        ]
    )
    probabilities = fresh(f"{prediction}_softmax")
    graph.node.append(helper.make_node("Softmax", [logits], [probabilities], name=probabilities, axis=-1))
    return probabilities


def _normalized(producers: dict[str, onnx.NodeProto], div: onnx.NodeProto) -> str | None:
    """What ``div`` divides by the ``ReduceSum`` of (through additions, skl2onnx's guard against a
    zero sum), where its numerator is computed from it."""
    numerator = _ancestors(producers, div.input[0])
    denominator = producers.get(div.input[1])
    while denominator is not None and denominator.op_type == "Add":
        denominator = next((producers[i] for i in denominator.input if i in producers), None)
    if denominator is not None and denominator.op_type == "ReduceSum" and denominator.input[0] in numerator:
        return denominator.input[0]
    return None


def _sigmoid_of(producers: dict[str, onnx.NodeProto], values: dict[str, np.ndarray], tensor: str) -> str | None:
    """``z`` where ``tensor`` is ``Sigmoid(z)``, or skl2onnx's ``1 / (exp(-1 * z) + 1)``; else None."""
    node = producers.get(tensor)
    if node is not None and node.op_type == "Sigmoid":
        return node.input[0]
    if node is None or node.op_type != "Reciprocal" or (add := producers.get(node.input[0])) is None:
        return None
    if add.op_type != "Add" or not any(i in values and np.array_equal(values[i], 1) for i in add.input):
        return None
    exp = next((producers[i] for i in add.input if i in producers and producers[i].op_type == "Exp"), None)
    minus = producers.get(exp.input[0]) if exp is not None else None
    if minus is None or minus.op_type not in ("Mul", "Neg"):
        return None
    if minus.op_type == "Neg":
        return minus.input[0]
    z = [i for i in minus.input if not (i in values and np.array_equal(values[i], -1))]
    return z[0] if len(z) == 1 else None


def _ancestors(producers: dict[str, onnx.NodeProto], tensor: str) -> set[str]:
    seen, todo = {tensor}, [tensor]
    while todo:
        node = producers.get(todo.pop())
        for i in node.input if node is not None else ():
            if i and i not in seen:
                seen.add(i)
                todo.append(i)
    return seen


_AFFINE = ("Add", "Sub", "Mul", "Div")
_LAYERS = ("MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum")


def preprocessing_constants(model: onnx.ModelProto) -> set[str]:
    """The initializers of a skl2onnx conversion that its preprocessing steps hold
    (``MinMaxScaler``'s scale and shift written as ``Mul`` and ``Add``, a ``StandardScaler``'s
    ``Sub`` and ``Div``): read only by those element-wise ops, on features no ``MatMul`` or
    ``Gemm`` has computed yet. scikit-learn never trains them, so neither does a plan by default
    (a layer's bias, added after its ``MatMul``, trains)."""
    if model.producer_name != SKL2ONNX:
        return set()
    graph = model.graph
    inits = {i.name for i in graph.initializer}
    after_layer: set[str] = set()  # tensors a layer's output reaches
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.op_type in _LAYERS or any(i in after_layer for i in node.input):
            after_layer.update(node.output)
        for i in node.input:
            if i in inits:
                readers.setdefault(i, []).append(node)
    return {
        name
        for name, nodes in readers.items()
        if all(n.op_type in _AFFINE and not any(i in after_layer for i in n.input if i != name) for n in nodes)
    }
