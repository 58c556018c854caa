"""What the executor feeds a plan of a device's examples, and what it does when the numbers go
wrong: examples of one tensor at shapes that no batch stacks are a PlanError naming the tensor."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from device_runtime.executor import PlanExecutor
from device_runtime.plan import PlanError
from emulator.toolchain import SGD, initial_weights_from_onnx, training_plan_from_onnx
from example_store import ExampleSelector

SELECTOR = ExampleSelector("app:/numbers")


def _toolchain_plan(model: onnx.ModelProto, loss: str = "cross_entropy"):
    plan = training_plan_from_onnx(
        model, label="y", loss=loss, optimizer=SGD(0.1), batch_size=4, epochs=1, example_selector=SELECTOR
    )
    return PlanExecutor(plan), initial_weights_from_onnx(model, plan)


def _sequences() -> tuple[PlanExecutor, dict]:
    """Token ids [N, T] of any length T -> the mean of their embeddings -> 3 classes."""
    rng = np.random.default_rng(0)
    model = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("Gather", ["embedding", "tokens"], ["embedded"]),
                helper.make_node("ReduceMean", ["embedded"], ["mean"], axes=[1], keepdims=0),
                helper.make_node("MatMul", ["mean", "w"], ["logits"]),
            ],
            "sequences",
            [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["N", "T"])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
            initializer=[
                helper.make_tensor("embedding", TensorProto.FLOAT, [20, 4], rng.normal(size=80).tolist()),
                helper.make_tensor("w", TensorProto.FLOAT, [4, 3], rng.normal(size=12).tolist()),
            ],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,
    )
    return _toolchain_plan(model)


def test_sequences_of_varied_length_are_refused_naming_the_tensor_and_its_shapes():
    """An app's own store may hand them over (the SQLite store refuses them as they are added):
    numpy's ValueError joining them in the shuffle named no tensor. A store read in pieces says the
    same (``test_examples_in_memory``)."""
    executor, weights = _sequences()
    examples = [{"tokens": np.arange(n) % 20, "y": np.int64(n % 3)} for n in (3, 3, 5, 3, 5, 3)]
    with pytest.raises(
        PlanError, match=r"example tensor 'tokens' holds examples of shape \(3,\) and \(5,\), which no batch"
    ):
        executor.run_device(weights, executor.batches_from_examples(lambda: examples, batched=False))
    same = [{"tokens": np.arange(5) % 20, "y": np.int64(k % 3)} for k in range(6)]
    assert executor.run_device(weights, executor.batches_from_examples(lambda: same, batched=False)).num_examples == 6
