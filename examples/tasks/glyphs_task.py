"""A task on a dataset with writers: a small CNN on 16x16 glyphs of 62 classes (FEMNIST's digits,
capitals and small letters), one client per font family, from ``examples/data/glyphs`` (LEAF's JSON
layout; ``.venv/bin/python -m examples.data.make_glyphs`` rebuilds it, its README says from what).

The model is an ONNX inference model made here with onnx's helpers, as an exporter would write it
(Reshape, Conv 8x3x3 with padding, Relu, MaxPool, Flatten, Gemm to 62 logits at opset 21: 31,886
weights); ``training_plan_from_onnx`` generates its backward pass.

    fedfleet plan test examples/tasks/glyphs_task.py
    fedfleet simulate examples/fleets/glyphs.toml --out runs/glyphs

Measured (``tests/examples/test_workloads.py``, deterministic): on the proxy data below (16 writers'
training examples as 16 devices, held-out: those writers' test examples), 0.55 held-out accuracy
after 6 simulated FedAvg rounds of 3 local epochs (the predicate asks 0.5); FedAvg over all 165
writers, 10 a round, reaches 0.54 on every writer's test examples after 5 rounds, 0.72 after 10 and
0.79 after 40 (a CNN of two Conv layers trained centrally on all of it reached 0.82, measured once
with torch: capitals and small letters such as ``o``/``O``, ``s``/``S`` and ``l``/``I``/``1`` differ
by size alone).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from emulator.fleet.federated_data import load_leaf
from emulator.toolchain.tasks import Budget, ProxyData, Task, accuracy_after_rounds, loss_decreases
from example_store import ExampleSelector
from server_stub import RoundConfig

DATA = Path(__file__).resolve().parents[1] / "data" / "glyphs"
SIDE, CLASSES, CHANNELS = 16, 62, 8
SELECTOR = ExampleSelector("app:/glyphs")
BATCH_SIZE = 8
EPOCHS = 3
PROXY_WRITERS = 16


def cnn_model(seed: int = 0) -> bytes:
    """The inference model: ``x`` float [N, 256] (a 16x16 image, row-major) -> ``logits`` [N, 62]."""
    rng = np.random.default_rng(seed)

    def he(name: str, shape: list[int], fan_in: int):
        return numpy_helper.from_array((np.sqrt(2.0 / fan_in) * rng.standard_normal(shape)).astype(np.float32), name)

    pooled = CHANNELS * (SIDE // 2) ** 2
    initializers = [
        numpy_helper.from_array(np.array([-1, 1, SIDE, SIDE], np.int64), "image_shape"),
        he("conv_w", [CHANNELS, 1, 3, 3], 9),
        numpy_helper.from_array(np.zeros(CHANNELS, np.float32), "conv_b"),
        he("fc_w", [pooled, CLASSES], pooled),
        numpy_helper.from_array(np.zeros(CLASSES, np.float32), "fc_b"),
    ]
    nodes = [
        helper.make_node("Reshape", ["x", "image_shape"], ["image"]),
        helper.make_node("Conv", ["image", "conv_w", "conv_b"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("MaxPool", ["relu"], ["pool"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["pool"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "glyphs_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", SIDE * SIDE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])],
        initializer=initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10).SerializeToString()


@functools.cache
def proxy() -> ProxyData:
    """``PROXY_WRITERS`` writers spread over the shipped files (every tenth): each one's training examples a
    device's shard, their test examples together the holdout."""
    data = load_leaf(DATA)
    writers = data.client_ids[:: len(data.client_ids) // PROXY_WRITERS][:PROXY_WRITERS]
    holdout = {k: np.concatenate([data.test[w][k] for w in writers]) for k in ("x", "y")}
    return ProxyData(tuple(data.train[w] for w in writers), holdout)


task = Task(
    name="glyphs_cnn",
    model=cnn_model(),
    proxy=proxy,
    hyperparameters={"lr": 0.3},
    selector=SELECTOR,
    batch_size=BATCH_SIZE,
    epochs=EPOCHS,
    predicates=(loss_decreases(epochs=3), accuracy_after_rounds(rounds=6, at_least=0.5)),
    rounds=RoundConfig(goal_count=10, max_rounds=40),
    budget=Budget(memory_mb=256, step_ms=50, session_s=30),
)
