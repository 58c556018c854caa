"""A next-character task on a dataset with speakers: Shakespeare's plays, one client per speaking
role in a play, from ``examples/data/shakespeare`` (LEAF's JSON layout, 20-character windows;
``.venv/bin/python -m examples.data.make_shakespeare`` rebuilds it, its README says from what).

The model reads the last ``CONTEXT`` characters of each window (a neural n-gram model, Bengio et
al. 2003: the LSTM LEAF trains costs far more per example than a phone session should here):
Slice, an embedding (Gather from an 81 x 8 table: LEAF's 80 characters and the unknown one),
Reshape, Gemm to 128, Relu, Gemm to 81 logits, at opset 21: 21,465 weights. It is an ONNX model made
here with onnx's helpers; ``training_plan_from_onnx`` generates its backward pass (the table's
gradient is a scatter-add of the rows the batch read). With ``WINDOW = 80`` it runs on LEAF's own
Shakespeare files (``x`` 80 character ids, ``y`` the next one).

    fedfleet plan test examples/tasks/shakespeare_task.py
    fedfleet simulate examples/fleets/shakespeare.toml --out runs/shakespeare

Measured (``tests/examples/test_workloads.py``, deterministic): on the proxy data below (16 roles'
training windows as 16 devices, held-out: those roles' test windows), 0.28 held-out accuracy after 6
simulated FedAvg rounds (the predicate asks 0.25); FedAvg over all 299 roles, 10 a round, reaches
0.29 on every role's test windows after 5 rounds, 0.31 after 10 and 0.37 after 40. Predicting the
most frequent character (a space) is right 0.19 of the time; LEAF's two-layer LSTM over all 80
characters reaches about 0.5 on its full data.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from emulator.fleet.federated_data import LEAF_CHARACTERS, load_leaf
from emulator.toolchain.tasks import Budget, ProxyData, Task, accuracy_after_rounds, loss_decreases
from example_store import ExampleSelector
from server_stub import RoundConfig

DATA = Path(__file__).resolve().parents[1] / "data" / "shakespeare"
WINDOW = 20  # what each example's x holds (LEAF's own files: 80)
CONTEXT, EMBEDDING, HIDDEN = 10, 8, 128
VOCABULARY = len(LEAF_CHARACTERS) + 1  # + the id of a character outside LEAF's set
SELECTOR = ExampleSelector("app:/shakespeare")
BATCH_SIZE = 8
EPOCHS = 1
PROXY_ROLES = 16


def ngram_model(seed: int = 0) -> bytes:
    """The inference model: ``x`` int64 [N, 80] character ids -> ``logits`` [N, 81] for the next one."""
    rng = np.random.default_rng(seed)

    def normal(name: str, shape: list[int], scale: float):
        return numpy_helper.from_array((scale * rng.standard_normal(shape)).astype(np.float32), name)

    def ints(name: str, values: list[int]):
        return numpy_helper.from_array(np.array(values, np.int64), name)

    features = CONTEXT * EMBEDDING
    initializers = [
        ints("context_start", [-CONTEXT]),
        ints("context_end", [WINDOW]),
        ints("context_axis", [1]),
        ints("flat_shape", [-1, features]),
        normal("embedding", [VOCABULARY, EMBEDDING], 1.0),
        normal("hidden_w", [features, HIDDEN], np.sqrt(2.0 / features)),
        numpy_helper.from_array(np.zeros(HIDDEN, np.float32), "hidden_b"),
        normal("out_w", [HIDDEN, VOCABULARY], np.sqrt(1.0 / HIDDEN)),
        numpy_helper.from_array(np.zeros(VOCABULARY, np.float32), "out_b"),
    ]
    nodes = [
        helper.make_node("Slice", ["x", "context_start", "context_end", "context_axis"], ["context"]),
        helper.make_node("Gather", ["embedding", "context"], ["embedded"]),
        helper.make_node("Reshape", ["embedded", "flat_shape"], ["flat"]),
        helper.make_node("Gemm", ["flat", "hidden_w", "hidden_b"], ["hidden"]),
        helper.make_node("Relu", ["hidden"], ["relu"]),
        helper.make_node("Gemm", ["relu", "out_w", "out_b"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "shakespeare_ngram",
        [helper.make_tensor_value_info("x", TensorProto.INT64, ["N", WINDOW])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", VOCABULARY])],
        initializer=initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10).SerializeToString()


@functools.cache
def proxy() -> ProxyData:
    """``PROXY_ROLES`` roles of the shipped files drawn with seed 0: each one's training windows a device's
    shard, their test windows together the holdout."""
    data = load_leaf(DATA)
    roles = [
        data.client_ids[i] for i in np.random.default_rng(0).choice(len(data.client_ids), PROXY_ROLES, replace=False)
    ]
    holdout = {k: np.concatenate([data.test[r][k] for r in roles]) for k in ("x", "y")}
    return ProxyData(tuple(data.train[r] for r in roles), holdout)


task = Task(
    name="shakespeare_ngram",
    model=ngram_model(),
    proxy=proxy,
    hyperparameters={"lr": 0.3},
    selector=SELECTOR,
    batch_size=BATCH_SIZE,
    epochs=EPOCHS,
    predicates=(loss_decreases(epochs=3), accuracy_after_rounds(rounds=6, at_least=0.25)),
    rounds=RoundConfig(goal_count=10, max_rounds=60),
    budget=Budget(memory_mb=256, step_ms=50, session_s=30),
)
