"""Whole models' generated training steps against an independent autograd (the ``autograd``
package): an MLP, a CNN with batch normalization, a small transformer block (embeddings,
LayerNormalization, self-attention) and an unrolled GRU next-word model like the paper's keyboard.

Each plan takes one SGD step with lr=1 on one batch, so ``w - w_new`` is its gradient of the
batch's mean cross-entropy; the reference differentiates the same forward pass in numpy."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from device_runtime import PlanExecutor
from emulator.toolchain import SGD, initial_weights_from_onnx, training_plan_from_onnx
from example_store import ExampleSelector
from tests.emulator.toolchain.models import F, cnn, glorot, mlp, model

agnp = pytest.importorskip("autograd.numpy")
autograd = pytest.importorskip("autograd")


def _cross_entropy(logits, y):
    shifted = logits - agnp.max(logits, axis=1, keepdims=True)
    logp = shifted - agnp.log(agnp.sum(agnp.exp(shifted), axis=1, keepdims=True))
    return -agnp.mean(logp[np.arange(len(y)), y])


def _plan_gradient(source, x, y, trainable=None):
    plan = training_plan_from_onnx(
        source,
        label="y",
        loss="cross_entropy",
        optimizer=SGD(1.0),
        batch_size=len(y),
        trainable=trainable,
        example_selector=ExampleSelector("app:/m"),
    )
    weights = initial_weights_from_onnx(source, plan)
    executor = PlanExecutor(plan)
    result = executor.run_device(weights, lambda: [{"x": x, "y": y}])
    new = executor.final_weights(weights, result)
    statistics = {s for node in source.graph.node if node.op_type == "BatchNormalization" for s in node.input[3:5]}
    trainable = [w for w in plan.weight_names if w in {i.name for i in source.graph.initializer} - statistics]
    return {w: weights[w].astype(np.float64) for w in trainable}, {
        w: (weights[w] - new[w]).astype(np.float64) for w in trainable
    }


def _check(ours, reference, names):
    for w in names:
        scale = max(float(np.abs(reference[w]).max()), 1e-3)
        np.testing.assert_allclose(ours[w], reference[w], rtol=2e-3, atol=2e-3 * scale, err_msg=w)


def test_mlp_gradient_matches_autograd():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 12)).astype(np.float32), rng.integers(0, 5, 8)
    source = mlp(12, 7, 5, seed=1)
    w, ours = _plan_gradient(source, x, y)

    def loss(p):
        h = agnp.maximum(x @ p["w0"] + p["b0"], 0)
        return _cross_entropy(h @ p["w1"] + p["b1"], y)

    _check(ours, autograd.grad(loss)(w), w)


def _conv(x, w, pad):
    x = agnp.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)), mode="constant")
    k = w.shape[-1]
    h, wd = x.shape[2] - k + 1, x.shape[3] - k + 1
    return sum(
        agnp.einsum("nchw,oc->nohw", x[:, :, i : i + h, j : j + wd], w[:, :, i, j]) for i in range(k) for j in range(k)
    )


@pytest.mark.parametrize("side", [8, 4])
def test_cnn_with_batch_statistics_gradient_matches_autograd(side):
    """At 8x8 the first Conv stays onnxruntime's; at 4x4 both run as sums over their kernel offsets
    and the batch norm's per-channel factors are expanded over the 4x4 positions before they meet
    the activations (the work graph's peephole rewrites)."""
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((6, 1, side, side)).astype(np.float32), rng.integers(0, 10, 6)
    source = cnn(seed=4, side=side)
    w, ours = _plan_gradient(source, x, y)

    def loss(p):
        c = _conv(x, p["conv1_w"], 1) + p["conv1_b"][None, :, None, None]
        mean = agnp.mean(c, axis=(0, 2, 3), keepdims=True)
        var = agnp.mean((c - mean) ** 2, axis=(0, 2, 3), keepdims=True)
        c = (c - mean) / agnp.sqrt(var + 1e-5) * p["bn_scale"][None, :, None, None] + p["bn_bias"][None, :, None, None]
        r = agnp.maximum(c, 0)
        n, ch, hh, ww = r.shape
        pooled = agnp.max(agnp.max(r.reshape(n, ch, hh // 2, 2, ww // 2, 2), axis=5), axis=3)
        c2 = agnp.maximum(_conv(pooled, p["conv2_w"], 1) + p["conv2_b"][None, :, None, None], 0)
        return _cross_entropy(agnp.mean(c2, axis=(2, 3)) @ p["fc_w"] + p["fc_b"], y)

    _check(ours, autograd.grad(loss)(w), w)


def _transformer(vocab=11, seq=5, dim=8, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    p = {
        "emb": rng.normal(0, 0.5, (vocab, dim)).astype(np.float32),
        "pos": rng.normal(0, 0.1, (seq, dim)).astype(np.float32),
        "ln_s": rng.uniform(0.8, 1.2, dim).astype(np.float32),
        "ln_b": rng.normal(0, 0.1, dim).astype(np.float32),
        "wq": glorot(rng, dim, dim),
        "wk": glorot(rng, dim, dim),
        "wv": glorot(rng, dim, dim),
        "wo": glorot(rng, dim, dim),
        "head": glorot(rng, dim, classes),
        "head_b": np.zeros(classes, np.float32),
    }
    consts = {"scale": np.array(1 / np.sqrt(dim), np.float32), "axes1": np.array([1], np.int64)}
    n = helper.make_node
    nodes = [
        n("Gather", ["emb", "x"], ["e"]),
        n("Add", ["e", "pos"], ["h"]),
        n("LayerNormalization", ["h", "ln_s", "ln_b"], ["ln"], axis=-1, epsilon=1e-5),
        n("MatMul", ["ln", "wq"], ["q"]),
        n("MatMul", ["ln", "wk"], ["k"]),
        n("MatMul", ["ln", "wv"], ["v"]),
        n("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        n("MatMul", ["q", "kt"], ["s0"]),
        n("Mul", ["s0", "scale"], ["s"]),
        n("Softmax", ["s"], ["a"], axis=-1),
        n("MatMul", ["a", "v"], ["ctx"]),
        n("MatMul", ["ctx", "wo"], ["o"]),
        n("Add", ["h", "o"], ["res"]),
        n("ReduceMean", ["res", "axes1"], ["pooled"], keepdims=0),
        n("Gemm", ["pooled", "head", "head_b"], ["logits"]),
    ]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.INT64, ["N", seq])],
        [helper.make_tensor_value_info("logits", F, ["N", classes])],
        {**p, **consts},
        opset=18,
        name="transformer",
    )
    return m, p


def test_transformer_block_gradient_matches_autograd():
    source, _ = _transformer()
    rng = np.random.default_rng(2)
    x, y = rng.integers(0, 11, (7, 5)), rng.integers(0, 3, 7)
    w, ours = _plan_gradient(source, x, y)
    assert set(w) == {"emb", "pos", "ln_s", "ln_b", "wq", "wk", "wv", "wo", "head", "head_b"}

    def loss(p):
        h = p["emb"][x] + p["pos"]
        mu = agnp.mean(h, axis=-1, keepdims=True)
        var = agnp.mean((h - mu) ** 2, axis=-1, keepdims=True)
        ln = (h - mu) / agnp.sqrt(var + 1e-5) * p["ln_s"] + p["ln_b"]
        q, k, v = ln @ p["wq"], ln @ p["wk"], ln @ p["wv"]
        s = agnp.einsum("ntd,nsd->nts", q, k) / np.sqrt(8)
        s = s - agnp.max(s, axis=-1, keepdims=True)
        a = agnp.exp(s) / agnp.sum(agnp.exp(s), axis=-1, keepdims=True)
        res = h + agnp.einsum("nts,nsd->ntd", a, v) @ p["wo"]
        return _cross_entropy(agnp.mean(res, axis=1) @ p["head"] + p["head_b"], y)

    _check(ours, autograd.grad(loss)(w), w)


def _gru_next_word(vocab=13, seq=4, dim=6, hidden=5, seed=0):
    """Embeddings, a GRU unrolled over the window (Slice/Squeeze per step), logits over the vocabulary."""
    rng = np.random.default_rng(seed)
    p = {"emb": rng.normal(0, 0.5, (vocab, dim)).astype(np.float32)}
    for g in ("z", "r", "n"):
        p[f"W{g}"], p[f"U{g}"] = glorot(rng, dim, hidden), glorot(rng, hidden, hidden)
        p[f"b{g}"] = np.zeros(hidden, np.float32)
    p["out"], p["out_b"] = glorot(rng, hidden, vocab), np.zeros(vocab, np.float32)
    consts = {"h0": np.zeros((1, hidden), np.float32), "one": np.array(1, np.float32), "ax1": np.array([1], np.int64)}
    n = helper.make_node
    nodes = [n("Gather", ["emb", "x"], ["e"])]
    h = "h0"
    for t in range(seq):
        consts[f"t{t}"], consts[f"t{t + 1}e"] = np.array([t], np.int64), np.array([t + 1], np.int64)
        nodes += [n("Slice", ["e", f"t{t}", f"t{t + 1}e", "ax1"], [f"s{t}"]), n("Squeeze", [f"s{t}", "ax1"], [f"x{t}"])]
        for g in ("z", "r"):
            nodes += [
                n("MatMul", [f"x{t}", f"W{g}"], [f"{g}x{t}"]),
                n("MatMul", [h, f"U{g}"], [f"{g}h{t}"]),
                n("Add", [f"{g}x{t}", f"{g}h{t}"], [f"{g}s{t}"]),
                n("Add", [f"{g}s{t}", f"b{g}"], [f"{g}b{t}"]),
                n("Sigmoid", [f"{g}b{t}"], [f"{g}{t}"]),
            ]
        nodes += [
            n("Mul", [f"r{t}", h], [f"reset{t}"]),
            n("MatMul", [f"x{t}", "Wn"], [f"nx{t}"]),
            n("MatMul", [f"reset{t}", "Un"], [f"nh{t}"]),
            n("Add", [f"nx{t}", f"nh{t}"], [f"ns{t}"]),
            n("Add", [f"ns{t}", "bn"], [f"nb{t}"]),
            n("Tanh", [f"nb{t}"], [f"n{t}"]),
            n("Sub", ["one", f"z{t}"], [f"iz{t}"]),
            n("Mul", [f"iz{t}", f"n{t}"], [f"a{t}"]),
            n("Mul", [f"z{t}", h], [f"b{t}"]),
            n("Add", [f"a{t}", f"b{t}"], [f"h{t + 1}"]),
        ]
        h = f"h{t + 1}"
    nodes.append(n("Gemm", [h, "out", "out_b"], ["logits"]))
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.INT64, ["N", seq])],
        [helper.make_tensor_value_info("logits", F, ["N", vocab])],
        {**p, **consts},
        name="gru_next_word",
    )
    return m, p


def test_unrolled_gru_next_word_model_gradient_matches_autograd():
    source, params = _gru_next_word()
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 13, (9, 4)), rng.integers(0, 13, 9)
    w, ours = _plan_gradient(source, x, y, trainable=list(params))  # the zero initial state h0 stays a constant

    def loss(p):
        e = p["emb"][x]
        h = agnp.zeros((1, 5))
        for t in range(4):
            xt = e[:, t]
            z = 1 / (1 + agnp.exp(-(xt @ p["Wz"] + h @ p["Uz"] + p["bz"])))
            r = 1 / (1 + agnp.exp(-(xt @ p["Wr"] + h @ p["Ur"] + p["br"])))
            nn = agnp.tanh(xt @ p["Wn"] + (r * h) @ p["Un"] + p["bn"])
            h = (1 - z) * nn + z * h
        return _cross_entropy(h @ p["out"] + p["out_b"], y)

    _check(ours, autograd.grad(loss)(w), w)


def test_gru_op_next_word_model_gradient_matches_autograd():
    """The same kind of model with the GRU op itself (as torch.onnx.export writes nn.GRU:
    linear_before_reset=1, time-major input), unrolled by the toolchain."""
    vocab, seq, dim, hidden = 13, 4, 6, 5
    rng = np.random.default_rng(7)
    p = {
        "emb": rng.normal(0, 0.5, (vocab, dim)).astype(np.float32),
        "W": rng.normal(0, 0.4, (1, 3 * hidden, dim)).astype(np.float32),
        "R": rng.normal(0, 0.4, (1, 3 * hidden, hidden)).astype(np.float32),
        "B": rng.normal(0, 0.1, (1, 6 * hidden)).astype(np.float32),
        "out": glorot(rng, hidden, vocab),
        "out_b": np.zeros(vocab, np.float32),
    }
    n = helper.make_node
    nodes = [
        n("Gather", ["emb", "x"], ["e"]),
        n("Transpose", ["e"], ["e_t"], perm=[1, 0, 2]),
        n("GRU", ["e_t", "W", "R", "B"], ["", "h_last"], hidden_size=hidden, linear_before_reset=1, name="the_gru"),
        n("Squeeze", ["h_last", "ax0"], ["h"]),
        n("Gemm", ["h", "out", "out_b"], ["logits"]),
    ]
    source = model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.INT64, ["N", seq])],
        [helper.make_tensor_value_info("logits", F, ["N", vocab])],
        {**p, "ax0": np.array([0], np.int64)},
    )
    x, y = rng.integers(0, vocab, (9, seq)), rng.integers(0, vocab, 9)
    w, ours = _plan_gradient(source, x, y)
    assert set(w) == set(p)

    def loss(q):
        e = q["emb"][x]
        h = agnp.zeros((1, hidden))
        wb, rb = q["B"][0, : 3 * hidden], q["B"][0, 3 * hidden :]
        for t in range(seq):
            g = e[:, t] @ q["W"][0].T + wb
            hr = h @ q["R"][0].T + rb
            z = 1 / (1 + agnp.exp(-(g[:, :hidden] + hr[:, :hidden])))
            r = 1 / (1 + agnp.exp(-(g[:, hidden : 2 * hidden] + hr[:, hidden : 2 * hidden])))
            cand = agnp.tanh(g[:, 2 * hidden :] + r * hr[:, 2 * hidden :])
            h = (1 - z) * cand + z * h
        return _cross_entropy(h @ q["out"] + q["out_b"], y)

    _check(ours, autograd.grad(loss)(w), w)


def _mobile_block(seed=0, channels=4, hidden=8, classes=3, side=6):
    """MobileNetV2's inverted residual, twice: 1x1 expansion, BatchNormalization, Clip(0, 6) (ReLU6),
    depthwise 3x3 (stride 1 on 6x6: the grouped Conv and its gradient rule; stride 2 down to 3x3:
    few enough positions to train as taps), 1x1 projection, a residual Add."""
    rng = np.random.default_rng(seed)
    p = {
        "expand": glorot(rng, channels, hidden, (hidden, channels, 1, 1)),
        "dw1": glorot(rng, 9, 9, (hidden, 1, 3, 3)),
        "dw2": glorot(rng, 9, 9, (hidden, 1, 3, 3)),
        "dw2_b": rng.normal(0, 0.1, hidden).astype(np.float32),
        "project": glorot(rng, hidden, channels, (channels, hidden, 1, 1)),
        "fc": glorot(rng, channels, classes),
        "fc_b": np.zeros(classes, np.float32),
    }
    for bn in ("bn0", "bn1"):
        p[f"{bn}_s"], p[f"{bn}_b"] = (
            rng.uniform(0.5, 1.5, hidden).astype(np.float32),
            rng.normal(0, 0.1, hidden).astype(np.float32),
        )
    stats = {
        f"{bn}_{k}": v
        for bn in ("bn0", "bn1")
        for k, v in (("mean", np.zeros(hidden, np.float32)), ("var", np.ones(hidden, np.float32)))
    }
    consts = {"lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32)}
    n = helper.make_node
    nodes = [
        n("Conv", ["x", "expand"], ["e"]),
        n("BatchNormalization", ["e", "bn0_s", "bn0_b", "bn0_mean", "bn0_var"], ["e_bn"]),
        n("Clip", ["e_bn", "lo", "hi"], ["e_r"]),
        n("Conv", ["e_r", "dw1"], ["d1"], group=hidden, pads=[1, 1, 1, 1]),
        n("BatchNormalization", ["d1", "bn1_s", "bn1_b", "bn1_mean", "bn1_var"], ["d1_bn"]),
        n("Clip", ["d1_bn", "lo", "hi"], ["d1_r"]),
        n("Conv", ["d1_r", "dw2", "dw2_b"], ["d2"], group=hidden, pads=[1, 1, 1, 1], strides=[2, 2]),
        n("Conv", ["d2", "project"], ["pr"]),
        n("AveragePool", ["x"], ["skip"], kernel_shape=[2, 2], strides=[2, 2]),
        n("Add", ["pr", "skip"], ["res"]),
        n("GlobalAveragePool", ["res"], ["g"]),
        n("Flatten", ["g"], ["f"]),
        n("Gemm", ["f", "fc", "fc_b"], ["logits"]),
    ]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", channels, side, side])],
        [helper.make_tensor_value_info("logits", F, ["N", classes])],
        {**p, **stats, **consts},
        name="mobile",
    )
    return m, p


def _depthwise(x, w, stride):
    """A depthwise 3x3 Conv with padding 1 in autograd's numpy."""
    x = agnp.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), mode="constant")
    out = (x.shape[2] - 3) // stride + 1
    span = stride * (out - 1) + 1
    return sum(
        x[:, :, i : i + span : stride, j : j + span : stride] * w[None, :, 0, i, j, None, None]
        for i in range(3)
        for j in range(3)
    )


def test_mobilenet_block_gradient_matches_autograd():
    source, _ = _mobile_block()
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((5, 4, 6, 6)).astype(np.float32), rng.integers(0, 3, 5)
    w, ours = _plan_gradient(source, x, y)
    plan = training_plan_from_onnx(
        source,
        label="y",
        loss="cross_entropy",
        optimizer=SGD(1.0),
        batch_size=5,
        example_selector=ExampleSelector("app:/m"),
    )
    work = onnx.ModelProto.FromString(plan.work)
    grouped = [
        node
        for node in work.graph.node
        if node.op_type == "Conv" and any(a.name == "group" and a.i > 1 for a in node.attribute)
    ]
    assert [node.output[0] for node in grouped] == ["d1"]  # the 3x3-output depthwise Conv runs as taps

    def bn(c, s, b):
        mean = agnp.mean(c, axis=(0, 2, 3), keepdims=True)
        var = agnp.mean((c - mean) ** 2, axis=(0, 2, 3), keepdims=True)
        return (c - mean) / agnp.sqrt(var + 1e-5) * s[None, :, None, None] + b[None, :, None, None]

    def loss(p):
        e = agnp.clip(bn(agnp.einsum("nchw,oc->nohw", x, p["expand"][:, :, 0, 0]), p["bn0_s"], p["bn0_b"]), 0, 6)
        d1 = agnp.clip(bn(_depthwise(e, p["dw1"], 1), p["bn1_s"], p["bn1_b"]), 0, 6)
        d2 = _depthwise(d1, p["dw2"], 2) + p["dw2_b"][None, :, None, None]
        skip = agnp.mean(agnp.mean(x.reshape(5, 4, 3, 2, 3, 2), axis=5), axis=3)
        res = agnp.einsum("nchw,oc->nohw", d2, p["project"][:, :, 0, 0]) + skip
        return _cross_entropy(agnp.mean(res, axis=(2, 3)) @ p["fc"] + p["fc_b"], y)

    _check(ours, autograd.grad(loss)(w), w)
