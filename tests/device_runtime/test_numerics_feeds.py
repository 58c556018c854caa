"""What the executor feeds a plan of a device's examples, and what it does when the numbers go
wrong: values the plan's input type cannot hold, values that are no numbers, NaN and infinite
features and regression labels, and training that diverges. Each is a PlanError naming the example
tensor (and the example and step), or a session that stops at its first non-finite step; never a
step on silently changed values."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from device_runtime.batching import join_chunks
from device_runtime.executor import PlanExecutor
from device_runtime.plan import PlanError
from device_runtime.plan_builder import initial_weights
from emulator.toolchain import SGD, evaluation_plan_from_onnx, initial_weights_from_onnx, training_plan_from_onnx
from example_store import ExampleSelector
from tests.device_runtime.test_executor import _plan
from tests.emulator.toolchain.models import mlp

SELECTOR = ExampleSelector("app:/numbers")


def _toolchain_plan(model: onnx.ModelProto, loss: str = "cross_entropy"):
    plan = training_plan_from_onnx(
        model, label="y", loss=loss, optimizer=SGD(0.1), batch_size=4, epochs=1, example_selector=SELECTOR
    )
    return PlanExecutor(plan), initial_weights_from_onnx(model, plan)


def _cast_input(model: onnx.ModelProto, elem_type: int, name: str = "x") -> onnx.ModelProto:
    """``model`` taking its input ``name`` as ``elem_type``, cast to float32 first."""
    for value in model.graph.input:
        if value.name == name:
            value.type.tensor_type.elem_type = elem_type
    for node in model.graph.node:
        node.input[:] = [f"{name}_float" if i == name else i for i in node.input]
    model.graph.node.insert(0, helper.make_node("Cast", [name], [f"{name}_float"], to=TensorProto.FLOAT))
    onnx.checker.check_model(model)
    return model


UINT8, UINT8_WEIGHTS = _toolchain_plan(_cast_input(mlp(4, 5, 3), TensorProto.UINT8))
INT32, INT32_WEIGHTS = _toolchain_plan(_cast_input(mlp(4, 5, 3), TensorProto.INT32))
Y = np.array([0, 1, 2, 0])


def _batch(x, y=Y):
    return lambda: [{"x": x, "y": y}]


@settings(max_examples=30, deadline=None)
@given(values=st.lists(st.integers(-300, 600), min_size=16, max_size=16))
def test_a_uint8_feature_trains_on_the_values_it_holds_and_refuses_the_rest(values):
    """Stored as int64 (what an app's store gives back of Python ints), the values 0-255 train as
    the same values stored as uint8; any other is refused naming the first one, where numpy's cast
    fed -5 as 251 and 300 as 44."""
    x = np.array(values, np.int64).reshape(4, 4)
    if all(0 <= v <= 255 for v in values):
        got = UINT8.run_device(UINT8_WEIGHTS, _batch(x))
        want = UINT8.run_device(UINT8_WEIGHTS, _batch(x.astype(np.uint8)))
        for name in want.update:
            np.testing.assert_array_equal(got.update[name], want.update[name])
        return
    first = next(i for i, v in enumerate(values) if not 0 <= v <= 255)
    with pytest.raises(PlanError) as refused:
        UINT8.run_device(UINT8_WEIGHTS, _batch(x))
    assert str(refused.value).startswith(
        f"example tensor 'x' holds values that the plan's uint8 input 'x' cannot hold exactly (example {first // 4} "
        f"of the batch holds {values[first]}, which becomes {values[first] % 256}); store whole numbers from 0 to 255"
    )


@pytest.mark.parametrize(
    "executor, weights, x, says",
    [
        (UINT8, UINT8_WEIGHTS, np.full((4, 4), 1.5), "example 0 of the batch holds 1.5, which becomes 1"),
        (
            UINT8,
            UINT8_WEIGHTS,
            np.where(np.arange(16).reshape(4, 4) == 9, np.nan, 3.0),
            "example 2 of the batch holds nan",
        ),
        (INT32, INT32_WEIGHTS, np.full((4, 4), 2**32 + 3), "holds 4294967299, which becomes 3"),
        (INT32, INT32_WEIGHTS, np.full((4, 4), 7.25, np.float32), "holds 7.25, which becomes 7"),
    ],
    ids=["uint8-fraction", "uint8-nan", "int32-past-its-range", "int32-fraction"],
)
def test_an_integer_feature_is_refused_where_the_cast_would_change_a_value(executor, weights, x, says):
    with pytest.raises(PlanError, match=rf"example tensor 'x' holds values that the plan's .* \(.*{re.escape(says)}"):
        executor.run_device(weights, _batch(x))
    # the same type's values, and values a wider type holds exactly, train
    executor.run_device(weights, _batch(np.full((4, 4), 7.0)))


def test_a_class_id_stored_as_a_fraction_is_refused_by_a_plan_of_the_builder_too():
    """The builder's plans name their labels ``y`` without ``class_ids``: a label of 1.5 trained
    as class 1."""
    executor = PlanExecutor(_plan(epochs=1))
    weights = initial_weights(executor.plan, seed=0)
    x = np.zeros((4, 6), np.float32)
    executor.run_device(weights, lambda: [{"pixels": x, "label": np.array([0.0, 1.0, 2.0, 0.0])}])
    with pytest.raises(
        PlanError, match=r"'label' holds fractions, .*\(example 1 of the batch holds 1.5, which becomes 1\)"
    ):
        executor.run_device(weights, lambda: [{"pixels": x, "label": np.array([0.0, 1.5, 2.0, 0.0])}])


def test_text_where_the_plan_reads_numbers_is_a_plan_error_naming_the_tensor():
    x = np.array([["a", "b", "c", "d"]] * 4)
    with pytest.raises(PlanError, match=r"example tensor 'x' \(<U1\) cannot be read as the plan's uint8"):
        UINT8.run_device(UINT8_WEIGHTS, _batch(x))


def test_a_models_input_named_y_is_a_feature_beside_the_plans_own_labels():
    """The executor read any input ``y`` as the builder's labels: a model of inputs ``x`` and ``y``
    was refused as holding no class ids ('labels must be class ids ... got shape (4, 4)')."""
    rng = np.random.default_rng(0)
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("Add", ["x", "y"], ["sum"]), helper.make_node("MatMul", ["sum", "w"], ["logits"])],
            "two_inputs",
            [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N", 4]) for name in ("x", "y")],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
            initializer=[helper.make_tensor("w", TensorProto.FLOAT, [4, 3], rng.normal(size=12).tolist())],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,
    )
    plan = training_plan_from_onnx(
        model, label="label", loss="cross_entropy", optimizer=SGD(0.1), batch_size=4, example_selector=SELECTOR
    )
    executor = PlanExecutor(plan)
    x, y = rng.normal(size=(4, 4)), rng.normal(size=(4, 4))
    result = executor.run_device(
        initial_weights_from_onnx(model, plan), lambda: [{"x": x, "y": y, "label": np.array([0, 1, 2, 0])}]
    )
    assert result.num_examples == 4
    with pytest.raises(PlanError, match=r"example tensor 'label' holds class ids from 0 to 3"):
        executor.run_device(
            initial_weights_from_onnx(model, plan), lambda: [{"x": x, "y": y, "label": np.array([0, 1, 3, 0])}]
        )


@pytest.mark.parametrize("loss", ["mse", "binary_cross_entropy"])
def test_a_models_integer_input_named_y_is_a_feature_of_a_plan_whose_loss_has_no_class_ids(loss):
    """Token ids in an input ``y`` of an mse or binary cross-entropy plan (whose labels are
    ``label``, and which records no ``class_ids``) were refused as the builder's labels: 'labels
    must be class ids in [0, 3) of shape [N], got shape (4, 5)'."""
    rng = np.random.default_rng(0)
    head = [helper.make_node("Sigmoid", ["scores"], ["out"])] if loss == "binary_cross_entropy" else []
    model = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("Gather", ["embedding", "y"], ["embedded"]),
                helper.make_node("ReduceMean", ["embedded"], ["mean"], axes=[1], keepdims=0),
                helper.make_node("MatMul", ["mean", "w"], ["scores" if head else "out"]),
                *head,
            ],
            "tokens_named_y",
            [helper.make_tensor_value_info("y", TensorProto.INT64, ["N", 5])],
            [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 3])],
            initializer=[
                helper.make_tensor("embedding", TensorProto.FLOAT, [20, 4], rng.normal(size=80).tolist()),
                helper.make_tensor("w", TensorProto.FLOAT, [4, 3], rng.normal(size=12).tolist()),
            ],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,
    )
    plan = training_plan_from_onnx(
        model, label="target", loss=loss, optimizer=SGD(0.1), batch_size=4, example_selector=SELECTOR
    )
    assert "y" in plan.device.inputs and not plan.device.class_ids
    target = (rng.random((4, 3)) > 0.5).astype(np.float32)
    batch = {"y": rng.integers(0, 20, (4, 5)), "target": target}
    assert PlanExecutor(plan).run_device(initial_weights_from_onnx(model, plan), lambda: [batch]).num_examples == 4


FLOAT, FLOAT_WEIGHTS = _toolchain_plan(mlp(4, 5, 3))
REGRESSION, REGRESSION_WEIGHTS = _toolchain_plan(mlp(4, 5, 3), loss="mse")


class _Counted:
    """Batches of ``x`` and ``y`` four at a time, counting how many were taken."""

    def __init__(self, x, y):
        self.x, self.y, self.taken = x, y, 0

    def __call__(self):
        for i in range(0, len(self.y), 4):
            self.taken += 1
            yield {"x": self.x[i : i + 4], "y": self.y[i : i + 4]}


@pytest.mark.parametrize(
    "executor, weights, tensor, bad, says",
    [
        (FLOAT, FLOAT_WEIGHTS, "x", np.nan, "example tensor 'x' holds nan"),
        (FLOAT, FLOAT_WEIGHTS, "x", 1e39, "example tensor 'x' holds inf"),  # float64 past float32's range
        (REGRESSION, REGRESSION_WEIGHTS, "y", np.inf, "example tensor 'y' holds inf"),
        (REGRESSION, REGRESSION_WEIGHTS, "y", np.nan, "example tensor 'y' holds nan"),
    ],
    ids=["nan-feature", "float64-overflow", "infinite-label", "nan-label"],
)
def test_a_non_finite_feature_or_label_is_named_with_its_example_and_step(executor, weights, tensor, bad, says):
    """The update was refused as NaN weights after the whole session, without a word of which
    example made them."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 4))
    y = rng.normal(size=(12, 3)) if executor is REGRESSION else np.arange(12) % 3
    data = {"x": x, "y": y.astype(np.float64)}
    data[tensor][6] = bad  # the third example of the second batch
    batches = _Counted(data["x"], data["y"] if executor is REGRESSION else y)
    with pytest.raises(PlanError, match=rf"{says} \(example 2 of the batch at step 1, .*no update was made"):
        executor.run_device(weights, batches)
    assert batches.taken == 2


def test_training_that_diverges_stops_at_its_first_non_finite_step_and_its_update_is_not_valid():
    """Weights of 1e38 overflow the logits at the first step: the session stops there (it ran
    all its batches before) and its update is refused as the device and the server refuse it."""
    rng = np.random.default_rng(0)
    batches = _Counted(rng.normal(size=(20, 4)), np.arange(20) % 3)
    huge = {name: np.full_like(value, 1e38) for name, value in FLOAT_WEIGHTS.items()}
    result = FLOAT.run_device(huge, batches)
    assert batches.taken == 1 and not np.isfinite(result.metrics["loss_sum"])
    with pytest.raises(PlanError, match="holds NaN or infinite values"):
        FLOAT.validate_update(result.update)
    healthy = _Counted(rng.normal(size=(20, 4)), np.arange(20) % 3)
    FLOAT.validate_update(FLOAT.run_device(FLOAT_WEIGHTS, healthy).update)
    assert healthy.taken == 5


def test_an_evaluation_whose_loss_overflows_in_one_batch_goes_on_and_counts_every_example():
    """A finite label of 1e30 overflows the squared error in float32: the evaluation stopped at
    that batch and reported 8 of its 20 examples, as if the others were not there."""
    tp = REGRESSION.plan
    ep = evaluation_plan_from_onnx(
        mlp(4, 5, 3), label="y", loss="mse", batch_size=4, example_selector=SELECTOR, training_plan=tp
    )
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(20, 4)).astype(np.float32), rng.normal(size=(20, 3)).astype(np.float32)
    y[5] = 1e30
    batches = _Counted(x, y)
    result = PlanExecutor(ep).run_device(REGRESSION_WEIGHTS, batches)
    assert batches.taken == 5 and result.num_examples == 20 and result.metrics["count"] == 20
    assert not np.isfinite(result.metrics["loss_sum"])


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


def test_sequences_of_many_lengths_are_refused_in_a_line_naming_three_of_them():
    """Every length was listed: 400 lengths in a shuffle's buffer made a message of 4,400 characters."""
    parts = [{"tokens": (np.arange(n) % 20)[None], "y": np.array([n % 3])} for n in range(1, 401)]
    with pytest.raises(PlanError) as refused:
        join_chunks(parts)
    assert str(refused.value).startswith(
        "example tensor 'tokens' holds examples of shape (1,) and (2,) and (3,) and 397 more, which no batch"
    )
    assert len(str(refused.value)) < 200


def _bag_of_tokens(*, guard: bool = False) -> onnx.ModelProto:
    """A classifier over the mean of 4 tokens' embeddings (a table of 6 rows); ``guard`` maps
    negative ids to row 0 first, as a model that handles its own padding does."""
    ids = "tokens"
    nodes = []
    if guard:
        nodes += [
            helper.make_node("Less", ["tokens", "zero"], ["negative"]),
            helper.make_node("Where", ["negative", "zero", "tokens"], ["ids"]),
        ]
        ids = "ids"
    nodes += [
        helper.make_node("Unsqueeze", [ids, "last"], ["ids_3d"]),
        helper.make_node("Squeeze", ["ids_3d", "last"], ["ids_2d"]),
        helper.make_node("Gather", ["table", "ids_2d"], ["embedded"]),
        helper.make_node("ReduceMean", ["embedded", "one"], ["pooled"], keepdims=0),
        helper.make_node("MatMul", ["pooled", "w"], ["logits"]),
    ]
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        nodes,
        "bag",
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["N", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
        initializer=[
            onnx.numpy_helper.from_array(rng.standard_normal((6, 5)).astype(np.float32), "table"),
            onnx.numpy_helper.from_array(rng.standard_normal((5, 3)).astype(np.float32), "w"),
            onnx.numpy_helper.from_array(np.array(0, dtype=np.int64), "zero"),
            onnx.numpy_helper.from_array(np.array([-1], dtype=np.int64), "last"),
            onnx.numpy_helper.from_array(np.array([1], dtype=np.int64), "one"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


@pytest.mark.parametrize("bad", [-1, 6])
def test_token_ids_outside_the_embedding_table_are_refused_before_they_train_its_last_row(bad):
    """ONNX's Gather reads id -1 as the table's last row (torch's embedding refuses it): a store whose
    padding id is -1 would train that row without a word. The device refuses the batch, naming the
    tensor and the table's rows; ids in range train, and so does a model that maps its own padding."""
    executor, weights = _toolchain_plan(_bag_of_tokens())
    good = np.array([[0, 1, 2, 5], [5, 4, 3, 2], [0, 0, 0, 0], [1, 1, 1, 1]])
    trained = executor.final_weights(weights, executor.run_device(weights, lambda: [{"tokens": good, "y": Y}]))
    assert not np.allclose(trained["table"], weights["table"])

    padded = good.copy()
    padded[2, 3] = bad
    with pytest.raises(PlanError, match=rf"'tokens' holds ids from {min(bad, 0)} to {max(bad, 5)}.*table of 6 rows"):
        executor.run_device(weights, lambda: [{"tokens": padded, "y": Y}])

    guarded, guarded_weights = _toolchain_plan(_bag_of_tokens(guard=True))
    negative = np.where(padded < 0, padded, np.minimum(padded, 5))
    guarded.run_device(guarded_weights, lambda: [{"tokens": negative, "y": Y}])  # its own Where maps -1 to row 0


def test_an_integer_input_whose_other_columns_a_slice_drops_before_the_table_is_not_refused():
    """Only the first 4 columns of ``tokens`` are looked up (a Slice keeps them); the 5th is a count
    the model reads as a number. A count past the table's rows is the model's honest input: the
    batch trains, where the id check read every column as a token id and refused it."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("Slice", ["tokens", "start", "four", "axis"], ["ids"]),
            helper.make_node("Gather", ["table", "ids"], ["embedded"]),
            helper.make_node("ReduceMean", ["embedded", "axis"], ["pooled"], keepdims=0),
            helper.make_node("Gather", ["tokens", "four"], ["length"], axis=1),
            helper.make_node("Cast", ["length"], ["length_float"], to=TensorProto.FLOAT),
            helper.make_node("Concat", ["pooled", "length_float"], ["features"], axis=1),
            helper.make_node("MatMul", ["features", "w"], ["logits"]),
        ],
        "bag_and_count",
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["N", 5])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
        initializer=[
            onnx.numpy_helper.from_array(rng.standard_normal((6, 5)).astype(np.float32), "table"),
            onnx.numpy_helper.from_array(rng.standard_normal((6, 3)).astype(np.float32) * 0.01, "w"),
            *(
                onnx.numpy_helper.from_array(np.array([v], dtype=np.int64), n)
                for n, v in [("start", 0), ("four", 4), ("axis", 1)]
            ),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    executor, weights = _toolchain_plan(model)
    tokens = np.array([[0, 1, 2, 5, 40], [5, 4, 3, 2, 7], [0, 0, 0, 0, 12], [1, 1, 1, 1, 3]])
    trained = executor.final_weights(weights, executor.run_device(weights, lambda: [{"tokens": tokens, "y": Y}]))
    assert not np.allclose(trained["table"], weights["table"])
