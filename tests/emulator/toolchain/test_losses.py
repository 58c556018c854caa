"""Every loss gives the right per-batch sums and the right gradient, checked against autograd on a
linear model; a user's own loss graph is differentiated like the model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from device_runtime import PlanExecutor
from emulator.toolchain import SGD, initial_weights_from_onnx, training_plan_from_onnx
from example_store import ExampleSelector
from tests.emulator.toolchain.models import F, glorot, model

agnp = pytest.importorskip("autograd.numpy")
autograd = pytest.importorskip("autograd")
LR = 0.5


def _linear(features, outputs, seed, head=None):
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["z"])]
    out = "z"
    if head is not None:
        nodes.append(helper.make_node(head, ["z"], ["p"]))
        out = "p"
    return model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", features])],
        [helper.make_tensor_value_info(out, F, ["N", outputs])],
        {"w": glorot(rng, features, outputs), "b": rng.normal(0, 0.1, outputs).astype(np.float32)},
    )


def _one_step(source, loss, x, y):
    plan = training_plan_from_onnx(
        source, label="y", loss=loss, optimizer=SGD(LR), batch_size=len(x), example_selector=ExampleSelector("app:/l")
    )
    weights = initial_weights_from_onnx(source, plan)
    executor = PlanExecutor(plan)
    result = executor.run_device(weights, lambda: [{"x": x, "y": y}])
    new = executor.final_weights(weights, result)
    return plan, weights, {w: (weights[w] - new[w]) / LR for w in ("w", "b")}, result.metrics


def _sigmoid(z):
    return 1 / (1 + agnp.exp(-z))


def _per_example(loss, p, x, y):
    z = x @ p["w"] + p["b"]
    if loss == "mse":
        return agnp.mean((z - y) ** 2, axis=1)
    if loss == "bce_logits":
        return agnp.sum(agnp.maximum(z, 0) - z * y + agnp.log1p(agnp.exp(-agnp.abs(z))), axis=1)
    q = agnp.clip(_sigmoid(z), 1e-7, 1 - 1e-7)  # bce on probabilities
    return -agnp.sum(y * agnp.log(q) + (1 - y) * agnp.log(1 - q), axis=1)


@settings(max_examples=10, deadline=None)
@given(
    kind=st.sampled_from(["mse", "bce_logits", "bce_probabilities"]), n=st.integers(1, 9), seed=st.integers(0, 2**31)
)
def test_builtin_losses_give_the_autograd_gradient_and_sums(kind, n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 4)).astype(np.float32)
    if kind == "mse":
        y, source, loss = rng.standard_normal((n, 3)).astype(np.float32), _linear(4, 3, seed), "mse"
    else:
        y = rng.integers(0, 2, (n, 1)).astype(np.float32)
        head = "Sigmoid" if kind == "bce_logits" else None
        source = _linear(4, 1, seed, head)
        if kind == "bce_probabilities":  # a model whose output is a probability but not from a Sigmoid node
            source = model(
                [
                    helper.make_node("Gemm", ["x", "w", "b"], ["z"]),
                    helper.make_node("Neg", ["z"], ["nz"]),
                    helper.make_node("Exp", ["nz"], ["e"]),
                    helper.make_node("Add", ["e", "one"], ["d"]),
                    helper.make_node("Reciprocal", ["d"], ["p"]),
                ],
                [helper.make_tensor_value_info("x", F, ["N", 4])],
                [helper.make_tensor_value_info("p", F, ["N", 1])],
                {
                    **{i.name: np.frombuffer(i.raw_data, np.float32).reshape(i.dims) for i in source.graph.initializer},
                    "one": np.array(1, np.float32),
                },
            )
        loss = "binary_cross_entropy"
    plan, weights, grads, metrics = _one_step(source, loss, x, y)
    p = {k: weights[k].astype(np.float64) for k in ("w", "b")}
    ref = autograd.grad(lambda q: agnp.mean(_per_example(kind, q, x, y)))(p)
    for w in ("w", "b"):
        np.testing.assert_allclose(grads[w], ref[w], rtol=2e-3, atol=2e-4)
    assert metrics["loss_sum"] == pytest.approx(float(np.sum(_per_example(kind, p, x, y))), rel=1e-4, abs=1e-4)
    assert metrics["count"] == n
    if loss == "binary_cross_entropy":
        z = x @ p["w"] + p["b"]
        assert metrics["correct"] == float(np.sum((z > 0) == (y > 0.5)))


@pytest.mark.parametrize("head", ["Sigmoid", None])
def test_binary_cross_entropy_with_several_labels_counts_at_most_one_correct_per_example(head):
    """Three independent labels per example: ``correct`` sums each example's fraction of labels
    predicted right (the per-label accuracy times n), never more than ``count``, which the server
    holds every report to (a sum over labels made the published accuracy up to 3)."""
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((9, 4)).astype(np.float32), rng.integers(0, 2, (9, 3)).astype(np.float32)
    source = _linear(4, 3, 6, head)
    _, weights, _, metrics = _one_step(source, "binary_cross_entropy", x, y)
    z = x @ weights["w"].astype(np.float64) + weights["b"]
    positive = z > 0 if head == "Sigmoid" else z > 0.5  # without a Sigmoid node the output is read as a probability
    assert metrics["count"] == 9
    assert metrics["correct"] == pytest.approx(float(np.sum(positive == (y > 0.5))) / 3, rel=1e-6)
    assert metrics["correct"] <= metrics["count"]


def test_cross_entropy_reads_the_logits_before_a_final_softmax():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((6, 4)).astype(np.float32) * 30, rng.integers(0, 3, 6)  # saturating logits
    _, weights, grads, metrics = _one_step(_linear(4, 3, 1, head="Softmax"), "cross_entropy", x, y)
    p = {k: weights[k].astype(np.float64) for k in ("w", "b")}

    def mean_ce(q):
        z = x @ q["w"] + q["b"]
        return agnp.mean(
            agnp.log(agnp.sum(agnp.exp(z - agnp.max(z, 1, keepdims=True)), 1)) + agnp.max(z, 1) - z[np.arange(6), y]
        )

    ref = autograd.grad(mean_ce)(p)
    for w in ("w", "b"):
        np.testing.assert_allclose(grads[w], ref[w], rtol=2e-3, atol=2e-4)
    assert np.isfinite(metrics["loss_sum"]) and metrics["loss_sum"] == pytest.approx(6 * mean_ce(p), rel=1e-4)


def test_a_users_loss_graph_is_differentiated_with_the_model():
    """Huber loss (delta 1) as the user's own ONNX graph: prediction, label -> the batch's mean."""
    n = helper.make_node
    huber = helper.make_graph(
        [
            n("Sub", ["pred", "target"], ["d"]),
            n("Abs", ["d"], ["a"]),
            n("Less", ["a", "one"], ["small"]),
            n("Mul", ["d", "d"], ["sq"]),
            n("Mul", ["sq", "half"], ["quad"]),
            n("Sub", ["a", "half"], ["lin"]),
            n("Where", ["small", "quad", "lin"], ["per"]),
            n("ReduceMean", ["per"], ["mean"], keepdims=0),
        ],
        "huber",
        [helper.make_tensor_value_info("pred", F, ["N", 2]), helper.make_tensor_value_info("target", F, ["N", 2])],
        [helper.make_tensor_value_info("mean", F, [])],
        initializer=[
            helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
            helper.make_tensor("half", TensorProto.FLOAT, [], [0.5]),
        ],
    )
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((7, 3)).astype(np.float32), (rng.standard_normal((7, 2)) * 2).astype(np.float32)
    _, weights, grads, metrics = _one_step(_linear(3, 2, 2), huber, x, y)
    p = {k: weights[k].astype(np.float64) for k in ("w", "b")}

    def mean_huber(q):
        d = x @ q["w"] + q["b"] - y
        return agnp.mean(agnp.where(agnp.abs(d) < 1, 0.5 * d * d, agnp.abs(d) - 0.5))

    ref = autograd.grad(mean_huber)(p)
    for w in ("w", "b"):
        np.testing.assert_allclose(grads[w], ref[w], rtol=2e-3, atol=2e-4)
    assert metrics["loss_sum"] == pytest.approx(7 * mean_huber(p), rel=1e-4)


def test_cross_entropy_over_every_position_of_a_sequence():
    """A next-word model scoring each position: logits [N, T, vocab], labels [N, T]; the mean and the
    counts are over all positions."""
    vocab, dim, seq = 7, 4, 5
    rng = np.random.default_rng(3)
    p = {
        "emb": rng.normal(0, 0.5, (vocab, dim)).astype(np.float32),
        "w": glorot(rng, dim, vocab),
        "b": np.zeros(vocab, np.float32),
    }
    n = helper.make_node
    source = model(
        [
            n("Gather", ["emb", "x"], ["e"]),
            n("MatMul", ["e", "w"], ["z"]),
            n("Add", ["z", "b"], ["logits"]),
            n("Softmax", ["logits"], ["probs"], axis=-1),
        ],
        [helper.make_tensor_value_info("x", TensorProto.INT64, ["N", seq])],
        [helper.make_tensor_value_info("probs", F, ["N", seq, vocab])],
        p,
    )
    x, y = rng.integers(0, vocab, (6, seq)), rng.integers(0, vocab, (6, seq))
    plan = training_plan_from_onnx(
        source,
        label="y",
        loss="cross_entropy",
        optimizer=SGD(LR),
        batch_size=6,
        example_selector=ExampleSelector("app:/l"),
    )
    weights = initial_weights_from_onnx(source, plan)
    executor = PlanExecutor(plan)
    result = executor.run_device(weights, lambda: [{"x": x, "y": y}])
    new = executor.final_weights(weights, result)

    def per_position(q):
        z = q["emb"][x] @ q["w"] + q["b"]
        z = z - agnp.max(z, -1, keepdims=True)
        logp = z - agnp.log(agnp.sum(agnp.exp(z), -1, keepdims=True))
        return -agnp.sum(logp * (np.arange(vocab) == y[..., None]), -1)

    ref = autograd.grad(lambda q: agnp.mean(per_position(q)))({k: v.astype(np.float64) for k, v in weights.items()})
    for w in p:
        np.testing.assert_allclose((weights[w] - new[w]) / LR, ref[w], rtol=2e-3, atol=2e-4, err_msg=w)
    assert result.metrics["count"] == 30 and result.num_examples == 6
    assert result.metrics["loss_sum"] == pytest.approx(float(np.sum(per_position(weights))), rel=1e-4)


@pytest.mark.parametrize(("head", "classes"), [("Softmax", 2), ("LogSoftmax", 2), ("Softmax", 5)])
def test_binary_cross_entropy_over_a_softmax_is_refused_naming_cross_entropy(head, classes):
    """A Softmax's columns sum to 1: binary cross-entropy would read them as independent labels'
    probabilities and train another objective (over two classes and one-hot labels, cross-entropy
    from clipped probabilities, where the logits' log-sum-exp is stable)."""
    with pytest.raises(ValueError) as refused:
        _one_step(
            _linear(4, classes, 0, head),
            "binary_cross_entropy",
            np.zeros((3, 4), np.float32),
            np.zeros((3, classes), np.float32),
        )
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    assert f"is a {head} over {classes} classes" in message and "use loss cross_entropy" in message
