"""Small ONNX inference models written with onnx.helper, as a user's exporter would hand them over."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F = TensorProto.FLOAT


def model(
    nodes, inputs, outputs, initializers: dict[str, np.ndarray], opset: int = 17, name: str = "m"
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        name,
        inputs,
        outputs,
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in initializers.items()],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(m)
    return m


def glorot(rng: np.random.Generator, fan_in: int, fan_out: int, shape=None) -> np.ndarray:
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape or (fan_in, fan_out)).astype(np.float32)


def mlp(
    features: int, hidden: int, classes: int, seed: int = 0, *, softmax: bool = False, opset: int = 17
) -> onnx.ModelProto:
    """Gemm-Relu-Gemm (the layout of device_runtime.plan_builder), optionally ending in Softmax."""
    rng = np.random.default_rng(seed)
    weights = {
        "w0": glorot(rng, features, hidden),
        "b0": np.zeros(hidden, np.float32),
        "w1": glorot(rng, hidden, classes),
        "b1": np.zeros(classes, np.float32),
    }
    nodes = [
        helper.make_node("Gemm", ["x", "w0", "b0"], ["z0"]),
        helper.make_node("Relu", ["z0"], ["a0"]),
        helper.make_node("Gemm", ["a0", "w1", "b1"], ["logits"]),
    ]
    out = "logits"
    if softmax:
        nodes.append(helper.make_node("Softmax", ["logits"], ["probs"], axis=1))
        out = "probs"
    return model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", features])],
        [helper.make_tensor_value_info(out, F, ["N", classes])],
        weights,
        opset=opset,
        name="mlp",
    )


def cnn(
    seed: int = 0,
    *,
    side: int = 8,
    channels: int = 4,
    classes: int = 10,
    opset: int = 17,
    dropout: float | None = None,
    batch_norm: bool = True,
) -> onnx.ModelProto:
    """Conv-BatchNormalization-Relu-MaxPool-Conv-Relu-GlobalAveragePool-Flatten-(Dropout)-Gemm."""
    rng = np.random.default_rng(seed)
    c2 = 2 * channels
    w = {
        "conv1_w": glorot(rng, 9, 9 * channels, (channels, 1, 3, 3)),
        "conv1_b": np.zeros(channels, np.float32),
        "conv2_w": glorot(rng, 9 * channels, 9 * c2, (c2, channels, 3, 3)),
        "conv2_b": np.zeros(c2, np.float32),
        "fc_w": glorot(rng, c2, classes),
        "fc_b": np.zeros(classes, np.float32),
    }
    nodes = [helper.make_node("Conv", ["x", "conv1_w", "conv1_b"], ["c1"], pads=[1, 1, 1, 1])]
    last = "c1"
    if batch_norm:
        w.update(
            {
                "bn_scale": rng.uniform(0.5, 1.5, channels).astype(np.float32),
                "bn_bias": rng.normal(0, 0.1, channels).astype(np.float32),
                "bn_mean": rng.normal(0, 0.1, channels).astype(np.float32),
                "bn_var": rng.uniform(0.5, 1.5, channels).astype(np.float32),
            }
        )
        nodes.append(
            helper.make_node(
                "BatchNormalization", ["c1", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["bn"], epsilon=1e-5
            )
        )
        last = "bn"
    nodes += [
        helper.make_node("Relu", [last], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "conv2_w", "conv2_b"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
    ]
    last = "f"
    if dropout is not None:
        w["ratio"] = np.array(dropout, np.float32)
        nodes.append(helper.make_node("Dropout", ["f", "ratio"], ["d"]))
        last = "d"
    nodes.append(helper.make_node("Gemm", [last, "fc_w", "fc_b"], ["logits"]))
    return model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 1, side, side])],
        [helper.make_tensor_value_info("logits", F, ["N", classes])],
        w,
        opset=opset,
        name="cnn",
    )
