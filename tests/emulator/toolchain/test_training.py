"""ONNX inference models become training plans that the existing executor and server run unchanged."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from device_runtime import PlanExecutor, build_mlp_plan, initial_weights, load_plan, serialize_plan
from device_runtime.plan import PlanError, ir_version_for_opset
from emulator.toolchain import (
    SGD,
    Adam,
    Momentum,
    UnsupportedOpError,
    initial_weights_from_onnx,
    onnx_training_plan,
    training_plan_from_onnx,
)
from example_store import ExampleSelector
from tests.emulator.toolchain.models import F, cnn, mlp, model

SELECTOR = ExampleSelector("app:/digits")
EXPORTED_CNN = Path(__file__).with_name("data") / "cnn_torch.onnx"


def _batches(x, y, size):
    return lambda: [{"x": x[i : i + size], "y": y[i : i + size]} for i in range(0, len(y), size)]


def _cnn_update(source, x, y, **options):
    """One session's update of a cross-entropy SGD plan of ``source`` over ``x``, ``y`` in batches of
    16, unshuffled, from the model's own weights; ``options`` go to the plan."""
    plan = training_plan_from_onnx(
        source,
        label="y",
        loss="cross_entropy",
        optimizer=SGD(0.1),
        batch_size=16,
        example_selector=SELECTOR,
        shuffle_buffer=0,
        **options,
    )
    return PlanExecutor(plan).run_device(initial_weights_from_onnx(source, plan), _batches(x, y, 16)).update, plan


def _train(plan, weights, x, y, rounds):
    """Local training for ``rounds`` sessions in a row; the mean loss of each session."""
    executor = PlanExecutor(plan)
    losses = []
    for _ in range(rounds):
        result = executor.run_device(weights, _batches(x, y, plan.device.batch_size))
        losses.append(result.metrics["loss"])
        weights = executor.final_weights(weights, result)
    return losses, weights


def test_a_regenerated_mlp_takes_exactly_the_hand_written_step():
    reference = build_mlp_plan(64, (16,), 10, learning_rate=0.3, batch_size=8, selector=SELECTOR)
    weights = initial_weights(reference, seed=1)
    onnx_model = mlp(64, 16, 10)
    for init in onnx_model.graph.initializer:
        init.CopyFrom(onnx.numpy_helper.from_array(weights[init.name], init.name))
    plan = training_plan_from_onnx(
        onnx_model, label="y", loss="cross_entropy", optimizer=SGD(0.3), batch_size=8, example_selector=SELECTOR
    )
    assert plan.weight_names == reference.weight_names and plan.metric_names == reference.metric_names
    rng = np.random.default_rng(0)
    x, y = rng.random((40, 64), dtype=np.float32), rng.integers(0, 10, 40)
    ours = PlanExecutor(plan).run_device(weights, _batches(x, y, 8))
    theirs = PlanExecutor(reference).run_device(weights, _batches(x, y, 8))
    for name, value in theirs.update.items():
        np.testing.assert_array_equal(ours.update[name], value, err_msg=name)


@pytest.mark.parametrize("opset", [13, 17, 21])
@pytest.mark.parametrize("optimizer", [SGD(0.1), Momentum(0.1, 0.9), Adam(0.01)], ids=["sgd", "momentum", "adam"])
def test_generated_plans_load_run_and_use_only_standard_ops_at_the_requested_opset(opset, optimizer):
    source = cnn(dropout=0.2, opset=17)  # 17 -> 21 through onnx's version converter, 17 -> 13 through the versioning
    plan = load_plan(
        serialize_plan(
            training_plan_from_onnx(
                source,
                label="y",
                loss="cross_entropy",
                optimizer=optimizer,
                batch_size=4,
                opset=opset,
                example_selector=SELECTOR,
            )
        )
    )
    work = onnx.ModelProto.FromString(plan.work)
    assert [(o.domain, o.version) for o in work.opset_import] == [("", opset)]
    assert work.ir_version == plan.metadata.ir_version == ir_version_for_opset(opset)
    assert {n.domain for n in work.graph.node} <= {""}
    weights = initial_weights_from_onnx(source, plan)
    PlanExecutor(plan).smoke_test(weights)
    assert {"bn_mean", "bn_var"} <= set(plan.weight_names) and "ratio" not in plan.weight_names


def test_training_moves_running_statistics_and_reduces_the_loss(digits):
    x = digits.x_train[:256].reshape(-1, 1, 8, 8).astype(np.float32)
    y = digits.y_train[:256]
    source = cnn(seed=3, dropout=0.1)
    plan = training_plan_from_onnx(
        source,
        label="y",
        loss="cross_entropy",
        optimizer=Adam(0.01),
        batch_size=16,
        epochs=2,
        example_selector=SELECTOR,
    )
    start = initial_weights_from_onnx(source, plan)
    losses, trained = _train(plan, start, x, y, 4)
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.8 * losses[0], losses
    assert not np.allclose(trained["bn_mean"], start["bn_mean"]) and np.isfinite(trained["bn_var"]).all()
    # one step per batch, carried from session to session in the checkpoint
    assert trained["adam_step"] == pytest.approx(4 * 2 * 256 / 16)


def test_a_cnn_exported_by_torch_trains_through_a_generated_plan(digits):
    x = digits.x_train.reshape(-1, 1, 8, 8).astype(np.float32)
    plan = training_plan_from_onnx(
        EXPORTED_CNN,
        label="y",
        loss="cross_entropy",
        optimizer=Momentum(0.05, 0.9),
        batch_size=16,
        epochs=2,
        example_selector=SELECTOR,
        inputs={"pixels": "x"},
    )
    start = initial_weights_from_onnx(EXPORTED_CNN, plan)
    assert {"conv1.weight", "bn.weight", "bn.running_mean", "fc.bias"} <= set(plan.weight_names)
    losses, trained = _train(plan, start, x, digits.y_train, 2)
    evaluator = PlanExecutor(plan)
    accuracy = evaluator.evaluate(trained, [{"x": digits.x_test.reshape(-1, 1, 8, 8), "y": digits.y_test}])[
        "eval_accuracy"
    ]
    assert losses[1] < losses[0] and accuracy > 0.8, (losses, accuracy)


def test_an_mlp_exported_by_skl2onnx_trains_through_a_generated_plan(digits):
    skl2onnx = pytest.importorskip("skl2onnx")
    from sklearn.neural_network import MLPClassifier

    clf = MLPClassifier(hidden_layer_sizes=(16,), max_iter=2, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deliberately unconverged fit
        clf.fit(digits.x_train[:100], digits.y_train[:100])
    exported = skl2onnx.to_onnx(
        clf, digits.x_train[:1].astype(np.float32), options={id(clf): {"zipmap": False}}, target_opset=17
    )
    assert any(n.domain == "ai.onnx.ml" for n in exported.graph.node)  # the label branch, pruned by the plan
    plan = training_plan_from_onnx(
        exported,
        label="y",
        loss="cross_entropy",
        optimizer=SGD(0.1),
        batch_size=16,
        epochs=3,
        example_selector=SELECTOR,
        inputs={"X": "x"},
    )
    assert plan.weight_names == ("coefficient", "intercepts", "coefficient1", "intercepts1")
    start = initial_weights_from_onnx(exported, plan)
    losses, _ = _train(plan, start, digits.x_train.astype(np.float32), digits.y_train, 2)
    assert losses[1] < 0.8 * losses[0], losses


def test_an_op_outside_the_table_is_refused_with_its_name_and_node():
    w = {"w": np.ones((4, 3), np.float32)}
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="dense"),
        helper.make_node("Hardmax", ["h"], ["y"], name="the_hardmax_node"),
    ]
    m = model(
        nodes, [helper.make_tensor_value_info("x", F, ["N", 4])], [helper.make_tensor_value_info("y", F, ["N", 3])], w
    )
    with pytest.raises(UnsupportedOpError, match="Hardmax.*the_hardmax_node") as info:
        training_plan_from_onnx(m, label="y", loss="mse", optimizer=SGD(0.1), batch_size=4, example_selector=SELECTOR)
    assert info.value.op_type == "Hardmax" and info.value.node_name == "the_hardmax_node"


def test_a_rule_that_cannot_handle_a_form_names_the_node():
    # a Slice along the dynamic batch axis: its gradient needs the sliced axis's static size
    w = {
        "table": np.ones((3, 3), np.float32),
        "starts": np.array([1], np.int64),
        "ends": np.array([9], np.int64),
        "axes": np.array([0], np.int64),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "table"], ["h"]),
        helper.make_node("Slice", ["h", "starts", "ends", "axes"], ["y"], name="drop_first_example"),
    ]
    m = model(
        nodes, [helper.make_tensor_value_info("x", F, ["N", 3])], [helper.make_tensor_value_info("y", F, ["M", 3])], w
    )
    with pytest.raises(UnsupportedOpError, match="'Slice' \\(node 'drop_first_example'\\).*axes of static size"):
        training_plan_from_onnx(m, label="y", loss="mse", optimizer=SGD(0.1), batch_size=4, example_selector=SELECTOR)


def test_bad_arguments_are_refused_with_what_to_do():
    m = mlp(4, 3, 2)
    with pytest.raises(ValueError, match="is not an initializer"):
        training_plan_from_onnx(
            m,
            label="y",
            loss="cross_entropy",
            optimizer=SGD(0.1),
            batch_size=4,
            trainable=["nope"],
            example_selector=SELECTOR,
        )
    with pytest.raises(ValueError, match="loss 'hinge' is unknown"):
        training_plan_from_onnx(m, label="y", loss="hinge", optimizer=SGD(0.1), batch_size=4, example_selector=SELECTOR)
    with pytest.raises(ValueError, match="lr must be a positive"):
        SGD(0.0)
    with pytest.raises(ValueError, match="inputs must map"):
        training_plan_from_onnx(
            m,
            label="y",
            loss="cross_entropy",
            optimizer=SGD(0.1),
            batch_size=4,
            inputs={"pixels": "x"},
            example_selector=SELECTOR,
        )


def test_frozen_weights_stay_constants_of_the_graph():
    m = mlp(6, 5, 3)
    plan = training_plan_from_onnx(
        m,
        label="y",
        loss="cross_entropy",
        optimizer=SGD(0.1),
        batch_size=4,
        trainable=["w1", "b1"],
        example_selector=SELECTOR,
    )
    assert plan.weight_names == ("w1", "b1")
    assert {"w0", "b0"} <= {i.name for i in onnx.ModelProto.FromString(plan.work).graph.initializer}


def test_a_secure_aggregation_plan_sends_its_whole_update_through_secure_sum():
    from device_runtime.secure_sum import SecureSumCodec

    plan = training_plan_from_onnx(
        mlp(6, 5, 3),
        label="y",
        loss="cross_entropy",
        optimizer=Momentum(0.1),
        batch_size=4,
        secure_aggregation=True,
        bitwidth=20,
        clip_range=64.0,
        example_selector=SELECTOR,
    )
    executor = PlanExecutor(plan)
    codec = SecureSumCodec(plan, executor)
    assert set(codec.names) == set(executor.client_update_spec()) and plan.server.bitwidth == 20
    rng = np.random.default_rng(0)
    update = executor.run_device(
        initial_weights_from_onnx(mlp(6, 5, 3), plan),
        lambda: [{"x": rng.standard_normal((8, 6)).astype(np.float32), "y": rng.integers(0, 3, 8)}],
    ).update
    decoded = codec.decode_sum(codec.encode(update), 1)
    for name, value in update.items():
        np.testing.assert_allclose(decoded[name], value, atol=2 * 64.0 / 2**20)


def test_seeded_dropout_makes_a_session_reproducible_and_masks_change_from_step_to_step(digits):
    x = digits.x_train[:64].reshape(-1, 1, 8, 8).astype(np.float32)
    source = cnn(seed=5, dropout=0.5)

    def session(seed):
        return _cnn_update(source, x, digits.y_train[:64], dropout_seed=seed)[0]

    first, again, other = session(0), session(0), session(1)
    assert all(np.array_equal(first[k], again[k]) for k in first)
    assert not np.array_equal(first["fc_w"], other["fc_w"])


def test_dropout_of_ratio_zero_trains_as_the_identity(digits):
    """torch exports Dropout(p=0) (transformers' ViT defaults) as an active Dropout of ratio 0: the
    step runs no Dropout, draws no mask, and takes the step of the same model without it."""
    x, y = digits.x_train[:32].reshape(-1, 1, 8, 8).astype(np.float32), digits.y_train[:32]
    steps = {}
    for ratio in (0.0, None):
        steps[ratio], plan = _cnn_update(cnn(seed=5, dropout=ratio), x, y)
        if ratio is not None:
            assert "Dropout" not in {n.op_type for n in onnx.ModelProto.FromString(plan.work).graph.node}
    assert all(np.array_equal(steps[0.0][k], steps[None][k]) for k in steps[None])


def test_a_dropout_before_a_trained_head_on_a_frozen_backbone_drops_as_with_the_backbone_trained(digits):
    """No gradient passes back through a Dropout whose input no trained weight feeds, so nothing reads
    its mask, and onnxruntime removes such a Dropout, active or not: the head's step is the one with
    the backbone trained (the same seeded mask), not the one without Dropout."""
    x, y = digits.x_train[:16].reshape(-1, 1, 8, 8).astype(np.float32), digits.y_train[:16]
    steps = {}
    for case, ratio, trainable in (("trained", 0.5, None), ("frozen", 0.5, ["fc_*"]), ("none", None, ["fc_*"])):
        steps[case] = _cnn_update(cnn(seed=5, dropout=ratio), x, y, trainable=trainable)[0]["fc_w"]
    np.testing.assert_allclose(steps["frozen"], steps["trained"], rtol=1e-5, atol=1e-7)
    assert not np.allclose(steps["frozen"], steps["none"], rtol=1e-3, atol=1e-5)


def test_bytes_that_are_not_an_onnx_model_are_refused_with_what_to_do(tmp_path):
    from device_runtime.plan import PlanError
    from emulator.toolchain.training import load_model

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")
    with pytest.raises(PlanError, match=r"bad\.onnx is not an ONNX model.*export the model again"):
        load_model(bad)
    with pytest.raises(PlanError, match="model bytes are not an ONNX model"):
        load_model(b"garbage")


def test_a_model_invalid_at_its_opset_is_refused_in_one_line_before_a_plan_is_built():
    """torch's dynamo exporter asked for opset 17 writes Split's num_outputs (an opset-18 attribute) into it."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Split", ["h"], ["a", "b"], axis=1, num_outputs=2, name="qkv_split"),
        helper.make_node("Mul", ["a", "b"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", F, ["N", 3])],
        [helper.make_tensor_value_info("y", F, ["N", 2])],
        initializer=[numpy_helper.from_array(np.ones((3, 4), np.float32), "w")],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(PlanError, match="not valid ONNX at opset 17 .*num_outputs.*export it again") as info:
        training_plan_from_onnx(m, label="y", loss="mse", optimizer=SGD(0.1), batch_size=4, example_selector=SELECTOR)
    assert len(str(info.value).splitlines()) == 1


def _bag_of_embeddings(vocab: int = 12, dim: int = 4, classes: int = 3) -> onnx.ModelProto:
    """ids [N, T] -> the mean of their embeddings -> a linear layer: a text classifier's shape."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Gather", ["emb", "x"], ["looked"]),
        helper.make_node("ReduceMean", ["looked", "axis"], ["pooled"], keepdims=0),
        helper.make_node("MatMul", ["pooled", "w"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "bag",
        [helper.make_tensor_value_info("x", onnx.TensorProto.INT64, ["N", 5])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", classes])],
        initializer=[
            numpy_helper.from_array(rng.normal(size=(vocab, dim)).astype(np.float32), "emb"),
            numpy_helper.from_array(rng.normal(size=(dim, classes)).astype(np.float32), "w"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axis"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=ir_version_for_opset(18))


@pytest.mark.parametrize("optimizer", [SGD(0.5), Momentum(0.5, 0.9), Adam(0.05)], ids=["sgd", "momentum", "adam"])
def test_frozen_rows_get_no_gradient_and_the_other_rows_the_same_step(optimizer):
    # nn.Embedding(padding_idx=p) keeps row p as it is; exporters drop padding_idx, frozen_rows restores it
    source = _bag_of_embeddings()
    weights = {i.name: numpy_helper.to_array(i) for i in source.graph.initializer if i.name != "axis"}
    x = np.array([[0, 1, 1, 2, 3], [4, 0, 0, 5, 1], [1, 1, 1, 1, 6]], dtype=np.int64)  # 0 pads every row
    y = np.array([0, 2, 1])

    def step(**kw):
        plan = training_plan_from_onnx(
            source, label="y", loss="cross_entropy", optimizer=optimizer, batch_size=3, example_selector=SELECTOR, **kw
        )
        executor = PlanExecutor(plan)
        start = initial_weights_from_onnx(source, plan)
        return executor.final_weights(start, executor.run_device(start, _batches(x, y, 3)))

    free, kept = step(), step(frozen_rows={"emb": [0, -1]})  # -1: the last row, as numpy counts
    np.testing.assert_array_equal(kept["emb"][[0, 11]], weights["emb"][[0, 11]])
    assert not np.allclose(free["emb"][0], weights["emb"][0])  # row 0 is read, so it would train
    np.testing.assert_allclose(kept["emb"][1:11], free["emb"][1:11], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(kept["w"], free["w"], rtol=1e-6, atol=1e-7)


def test_a_frozen_row_of_an_embedding_the_output_layer_ties_trains_through_the_output_layer_alone():
    # torch's padding_idx keeps the padding row out of the lookup's gradient only: GPT-style tied
    # output layers (BART's, BERT's masked-LM head) still train it, as logits of the padding token
    vocab, dim, lr = 6, 4, 0.5
    rng = np.random.default_rng(1)
    emb = rng.normal(size=(vocab, dim)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["emb", "x"], ["looked"]),
        helper.make_node("ReduceMean", ["looked", "axis"], ["pooled"], keepdims=0),
        helper.make_node("Transpose", ["emb"], ["emb_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["pooled", "emb_t"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("x", onnx.TensorProto.INT64, ["N", 5])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", vocab])],
        initializer=[numpy_helper.from_array(emb, "emb"), numpy_helper.from_array(np.array([1], np.int64), "axis")],
    )
    source = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=ir_version_for_opset(18))
    x = np.array([[0, 1, 1, 2, 3], [4, 0, 0, 5, 1], [1, 1, 1, 1, 0]], dtype=np.int64)  # 0 pads every row
    y = np.array([0, 2, 1])
    plan = training_plan_from_onnx(
        source,
        label="y",
        loss="cross_entropy",
        optimizer=SGD(lr),
        batch_size=3,
        example_selector=SELECTOR,
        frozen_rows={"emb": [0]},
    )
    executor = PlanExecutor(plan)
    start = initial_weights_from_onnx(source, plan)
    after = executor.final_weights(start, executor.run_device(start, _batches(x, y, 3)))["emb"]
    pooled = emb.astype(np.float64)[x].mean(axis=1)
    logits = pooled @ emb.T.astype(np.float64)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    d_logits = (p / p.sum(axis=1, keepdims=True) - np.eye(vocab)[y]) / len(y)
    output_layer = d_logits.T @ pooled  # the output layer's part of emb's gradient
    np.testing.assert_allclose(after[0], emb[0] - lr * output_layer[0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(after[1], emb[1] - lr * output_layer[1])  # row 1 is looked up too: both parts


def test_frozen_rows_of_an_untrained_weight_or_past_its_rows_are_refused_by_name():
    kw = {"label": "y", "loss": "cross_entropy", "optimizer": SGD(0.1), "batch_size": 3, "example_selector": SELECTOR}
    with pytest.raises(ValueError, match="frozen_rows names 'emb', which the plan does not train"):
        training_plan_from_onnx(_bag_of_embeddings(), frozen=["emb"], frozen_rows={"emb": [0]}, **kw)
    with pytest.raises(ValueError, match=r"frozen_rows\['emb'\] holds 12, not a row of its 12"):
        training_plan_from_onnx(_bag_of_embeddings(), frozen_rows={"emb": [0, 12]}, **kw)


def test_a_cross_entropy_plan_names_its_classes_and_a_device_refuses_ids_past_them(tmp_path):
    """A one-hot loss counts a label past the classes as nothing: without the check a device trained
    on the other examples of the batch, and a fleet on such data committed rounds without a word."""
    plan = training_plan_from_onnx(
        mlp(8, 4, 5), label="y", loss="cross_entropy", optimizer=SGD(0.1), batch_size=4, example_selector=SELECTOR
    )
    (label_input,) = plan.device.class_ids
    assert plan.device.class_ids == {label_input: 5} and plan.device.inputs[label_input] == "y"
    again = load_plan(serialize_plan(plan))
    assert again.device.class_ids == plan.device.class_ids
    weights = initial_weights_from_onnx(mlp(8, 4, 5), plan)
    x = np.random.default_rng(0).random((8, 8), dtype=np.float32)
    executor = PlanExecutor(again)
    executor.run_device(weights, _batches(x, np.arange(8) % 5, 4))  # ids 0..4 train
    for bad in (np.arange(8) % 6, np.where(np.arange(8) == 3, -1, 0)):
        with pytest.raises(ValueError, match=r"holds class ids from -?\d+ to \d+, but the plan scores 5 classes"):
            executor.run_device(weights, _batches(x, bad, 4))
    executor.run_device(weights, _batches(x, (np.arange(8) % 5).astype(np.float32), 4))  # 0.0, 1.0, ...: ids
    with pytest.raises(ValueError, match="holds fractions, but the plan reads class ids"):
        executor.run_device(weights, _batches(x, np.full(8, 2.5, np.float32), 4))


@pytest.mark.parametrize(
    "class_ids, says",
    [({"nowhere": 3}, "not one of its inputs"), ({"x": 0}, "numbers of classes"), ({"x": "3"}, "numbers of classes")],
)
def test_a_plan_whose_class_ids_are_corrupt_is_refused(class_ids, says):
    plan = training_plan_from_onnx(
        mlp(8, 4, 5), label="y", loss="cross_entropy", optimizer=SGD(0.1), batch_size=4, example_selector=SELECTOR
    )
    data = serialize_plan(dataclasses.replace(plan, device=dataclasses.replace(plan.device, class_ids=class_ids)))
    with pytest.raises(PlanError, match=says):
        load_plan(data)


def test_a_reshape_to_the_exported_batch_with_allowzero_takes_any_batch():
    """The dynamo exporter writes every ``Reshape`` with ``allowzero=1``; exported at a fixed batch of 4
    (``torch.onnx.export(model, args, path)``), its ``x.view(4, -1)`` is a constant ``[4, 6]`` that the
    plan rewrites to copy the batch it is given: with ``allowzero`` that copy would be a zero, and the
    plan's step fails at every batch size, 4 too."""
    rng = np.random.default_rng(0)
    source = model(
        [
            helper.make_node("Reshape", ["x", "flat"], ["features"], allowzero=1),
            helper.make_node("MatMul", ["features", "w"], ["logits"]),
        ],
        [helper.make_tensor_value_info("x", F, [4, 2, 3])],
        [helper.make_tensor_value_info("logits", F, [4, 3])],
        {"flat": np.array([4, 6], np.int64), "w": rng.normal(size=(6, 3)).astype(np.float32)},
    )
    plan = training_plan_from_onnx(
        source, label="y", loss="cross_entropy", optimizer=SGD(0.1), batch_size=4, example_selector=SELECTOR
    )
    x, y = rng.normal(size=(7, 2, 3)).astype(np.float32), np.array([0, 1, 2, 0, 1, 2, 0])
    result = PlanExecutor(plan).run_device(initial_weights_from_onnx(source, plan), _batches(x, y, 4))
    assert result.num_examples == 7 and np.isfinite(result.metrics["loss"])


def _own_loss_model(with_labels: bool) -> onnx.ModelProto:
    """A linear classifier of 4 features into 3 classes; ``with_labels``: as ``forward(x, y)`` returning
    ``(loss, logits)`` exports, the labels an input of its own that a loss output reads (a loss of
    the model's own: the logits' row sums times the label), beside the logits."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["logits"]),
    ]
    inputs = [helper.make_tensor_value_info("x", F, ["N", 4])]
    outputs = [helper.make_tensor_value_info("logits", F, ["N", 3])]
    if with_labels:
        nodes += [
            helper.make_node("Cast", ["y"], ["yf"], to=onnx.TensorProto.FLOAT),
            helper.make_node("ReduceSum", ["logits", "one"], ["rows"], keepdims=0),
            helper.make_node("Mul", ["rows", "yf"], ["scaled"]),
            helper.make_node("ReduceMean", ["scaled"], ["own_loss"], keepdims=0),
        ]
        inputs.append(helper.make_tensor_value_info("y", onnx.TensorProto.INT64, ["N"]))
        outputs.insert(0, helper.make_tensor_value_info("own_loss", F, []))
    return model(
        nodes,
        inputs,
        outputs,
        {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": np.zeros(3, np.float32), "one": np.array([1])},
    )


def test_labels_the_model_reads_for_its_own_loss_alone_become_the_plans_label_and_the_plan_says_so():
    """``forward(x, y) -> (loss, logits)`` exported: the loss reads the logits (``output``), which do
    not read ``y``; the plan's label takes that input's place and its step is the classifier's
    without it, where the plan was refused (the label taken for a feature). The line says the model's
    own loss is not the one trained."""
    from .test_onnx_import import _one_step

    stepped = _one_step(_own_loss_model(with_labels=True), output="logits")
    alone = _one_step(_own_loss_model(with_labels=False))
    assert set(stepped) == set(alone) == {"w", "b"}
    for name in alone:
        np.testing.assert_array_equal(stepped[name], alone[name])
    made = onnx_training_plan(
        _own_loss_model(with_labels=True),
        label="y",
        loss="cross_entropy",
        output="logits",
        optimizer=SGD(0.5),
        batch_size=8,
        example_selector=ExampleSelector("app:/m"),
    )
    assert made.plan.device.inputs == {"x": "x", "label": "y"}  # y once, as the label
    (line,) = made.warnings
    assert "input 'y' is the label 'y'" in line and "with its cross_entropy loss" in line


def test_a_prediction_computed_from_the_label_is_refused_in_one_line_saying_to_export_the_logits():
    """The model's own loss as the prediction (``forward(x, y)`` returning its loss): one line naming
    the label and the output, saying what to export."""
    with pytest.raises(ValueError) as refused:
        onnx_training_plan(
            _own_loss_model(with_labels=True),
            label="y",
            loss="mse",
            output="own_loss",
            optimizer=SGD(0.5),
            batch_size=8,
            example_selector=ExampleSelector("app:/m"),
        )
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    assert "the label 'y'" in message and "'own_loss' is computed from it" in message and "logits" in message
    assert "such as 'label'" in message  # not the label's own name
