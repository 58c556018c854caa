"""Reading real exporters' ONNX files for plan generation: external data beside the model, files that
are not ONNX, which tensors train (``--trainable``/``--frozen``, no scalars or shape constants by
default) and initializers an exporter deduplicated split back into one weight per parameter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from device_runtime.plan import load_plan
from emulator.cli.commands import main
from emulator.toolchain import SGD, training_plan_from_onnx
from example_store import ExampleSelector

from .models import F, mlp

SELECTOR = ExampleSelector("app:/m")


def _save_with_external_data(m: onnx.ModelProto, folder: Path) -> Path:
    """The dynamo exporter's layout: model.onnx and every tensor in model.onnx.data beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save_model(
        m,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="model.onnx.data",
        size_threshold=0,
    )
    return path


def _from_onnx(model: Path, out: Path, *extra: str) -> int:
    return main(
        [
            "plan",
            "from-onnx",
            str(model),
            "--label",
            "y",
            "--loss",
            "cross_entropy",
            "--batch-size",
            "4",
            "-o",
            str(out),
            *extra,
        ]
    )


def test_external_data_is_read_from_the_models_folder_whatever_the_working_directory(tmp_path, monkeypatch, capsys):
    path = _save_with_external_data(mlp(6, 5, 3), tmp_path / "export")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert _from_onnx(path.resolve(), tmp_path / "plan.fedplan") == 0, capsys.readouterr().err
    plan = load_plan((tmp_path / "plan.fedplan").read_bytes())
    assert {"w0", "b0", "w1", "b1"} <= set(plan.weight_names)
    from emulator.toolchain import initial_weights_from_onnx

    weights = initial_weights_from_onnx(path, plan)
    assert np.array_equal(weights["w0"], onnx.numpy_helper.to_array(mlp(6, 5, 3).graph.initializer[0]))


def test_a_missing_external_data_file_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    path = _save_with_external_data(mlp(6, 5, 3), tmp_path / "export")
    (path.parent / "model.onnx.data").unlink()
    monkeypatch.chdir(tmp_path)
    assert _from_onnx(path.resolve(), tmp_path / "plan.fedplan") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert str((path.parent / "model.onnx.data").resolve()) in err and "missing" in err


@pytest.mark.parametrize("content", [b"not a model at all\n", b"PK\x03\x04 a torch checkpoint, zipped", b""])
def test_a_file_that_is_not_onnx_is_one_line_saying_what_to_export(tmp_path, capsys, content):
    path = tmp_path / "model.onnx"
    path.write_bytes(content)
    assert _from_onnx(path, tmp_path / "plan.fedplan") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not an ONNX model" in err and "torch.onnx.export" in err


def test_a_graph_with_no_float_output_is_one_line_saying_what_to_export(tmp_path, capsys):
    m = mlp(6, 5, 3)
    m.graph.node.append(helper.make_node("ArgMax", ["logits"], ["label"], axis=1, keepdims=0))
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info("label", onnx.TensorProto.INT64, ["N"]))
    onnx.save_model(m, str(tmp_path / "model.onnx"))
    assert _from_onnx(tmp_path / "model.onnx", tmp_path / "plan.fedplan") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no float output" in err and "before ArgMax" in err


def test_model_bytes_that_point_at_external_data_are_refused_with_what_to_pass(tmp_path):
    path = _save_with_external_data(mlp(6, 5, 3), tmp_path)
    with pytest.raises(ValueError, match="pass the model's path"):
        training_plan_from_onnx(
            path.read_bytes(),
            label="y",
            loss="cross_entropy",
            optimizer=SGD(0.1),
            batch_size=4,
            example_selector=SELECTOR,
        )


def _scaled_model() -> onnx.ModelProto:
    """A linear layer as the dynamo exporter writes attention: the product scaled by a float32
    tensor of shape [1], and a float32 initializer that only becomes a Reshape's shape."""
    rng = np.random.default_rng(0)
    inits = {
        "enc.0.weight": rng.normal(size=(4, 6)).astype(np.float32),
        "enc.0.bias": np.zeros(6, np.float32),
        "scale": np.array([0.125], np.float32),
        "shape_f": np.array([-1, 3], np.float32),
        "head.weight": rng.normal(size=(3, 3)).astype(np.float32),
        "head.bias": np.zeros(3, np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "enc.0.weight"], ["h0"]),
        helper.make_node("Add", ["h0", "enc.0.bias"], ["h1"]),
        helper.make_node("Mul", ["h1", "scale"], ["h2"]),
        helper.make_node("Cast", ["shape_f"], ["shape"], to=onnx.TensorProto.INT64),
        helper.make_node("Reshape", ["h2", "shape"], ["h3"]),
        helper.make_node("MatMul", ["h3", "head.weight"], ["h4"]),
        helper.make_node("Add", ["h4", "head.bias"], ["logits"]),
    ]
    from .models import model

    return model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 4])],
        [helper.make_tensor_value_info("logits", F, ["N", 3])],
        inits,
    )


def _weights(m, **kwargs) -> tuple[str, ...]:
    return training_plan_from_onnx(
        m, label="y", loss="cross_entropy", optimizer=SGD(0.1), batch_size=4, example_selector=SELECTOR, **kwargs
    ).weight_names


def test_by_default_one_element_scales_and_shape_constants_do_not_train():
    assert _weights(_scaled_model()) == ("enc.0.weight", "enc.0.bias", "head.weight", "head.bias")


def test_trainable_and_frozen_glob_patterns_choose_the_trained_tensors():
    m = _scaled_model()
    assert _weights(m, trainable=["enc.*"]) == ("enc.0.weight", "enc.0.bias")
    assert _weights(m, frozen=["*.bias"]) == ("enc.0.weight", "head.weight")
    assert _weights(m, trainable=["*"], frozen=["head.*"]) == (
        "enc.0.weight",
        "enc.0.bias",
        "scale",
    )  # asked for: trains
    assert _weights(m, trainable=["scale", "head.weight"]) == ("scale", "head.weight")


@pytest.mark.parametrize("kind", ["trainable", "frozen"])
def test_a_pattern_that_matches_no_initializer_is_refused_naming_it(kind):
    with pytest.raises(ValueError, match=rf"{kind} 'decoder\.\*' matches no tensor.*initializers: enc\.0\.weight"):
        _weights(_scaled_model(), **{kind: ["decoder.*"]})


def test_the_task_api_takes_trainable_and_frozen_patterns(tmp_path):
    from emulator.toolchain.tasks import Task

    onnx.save_model(_scaled_model(), str(tmp_path / "m.onnx"))
    task = Task(
        name="scaled",
        model=tmp_path / "m.onnx",
        proxy=lambda: None,  # type: ignore[arg-type, return-value]
        trainable=("*.weight", "scale"),
        frozen=("head.*",),
    )
    assert task.build_plan().weight_names == ("enc.0.weight", "scale")


def test_from_onnx_prints_the_trained_tensors_and_refuses_a_pattern_that_matches_nothing(tmp_path, capsys):
    onnx.save_model(_scaled_model(), str(tmp_path / "m.onnx"))
    assert _from_onnx(tmp_path / "m.onnx", tmp_path / "p.fedplan", "--frozen", "head.*") == 0
    out = capsys.readouterr().out
    assert "enc.0.weight  [4, 6]" in out and "enc.0.bias    [6]" in out and "head.weight" not in out.split("trains:")[1]
    assert "2 trainable tensors, 30 parameters" in out
    assert _from_onnx(tmp_path / "m.onnx", tmp_path / "p.fedplan", "--trainable", "decoder.*") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'decoder.*' matches no tensor" in err and "head.weight" in err


def test_a_one_element_bias_still_trains_by_default():
    from .models import model

    m = model(
        [helper.make_node("Gemm", ["x", "W", "b"], ["pred"])],
        [helper.make_tensor_value_info("x", F, ["N", 4])],
        [helper.make_tensor_value_info("pred", F, ["N", 1])],
        {"W": np.ones((4, 1), np.float32), "b": np.zeros(1, np.float32)},
    )
    plan = training_plan_from_onnx(
        m, label="y", loss="mse", optimizer=SGD(0.1), batch_size=4, example_selector=SELECTOR
    )
    assert plan.weight_names == ("W", "b")


def _two_layers(deduplicated: bool, tied: bool = False) -> onnx.ModelProto:
    """Two linear layers with zero biases; ``deduplicated`` writes them as torch's classic exporter
    does for a fresh model: one bias initializer, the second layer's bias an Identity of it."""
    from .models import model

    rng = np.random.default_rng(3)
    inits = {
        "l0.weight": rng.normal(size=(4, 4)).astype(np.float32),
        "l0.bias": np.zeros(4, np.float32),
        "l1.weight": rng.normal(size=(4, 3)).astype(np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "l0.weight"], ["h0"]),
        helper.make_node("Add", ["h0", "l0.bias"], ["h1"]),
        helper.make_node("Tanh", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "l0.weight" if tied else "l1.weight"], ["h3"]),
    ]
    if tied:
        nodes.append(helper.make_node("MatMul", ["h3", "l1.weight"], ["h4"]))
    else:
        nodes.append(helper.make_node("Identity", ["h3"], ["h4"]))
    if deduplicated:
        nodes.insert(0, helper.make_node("Identity", ["l0.bias"], ["l1.bias"], name="/l1/Identity"))
        inits["l0.bias"] = np.zeros(4, np.float32)
    else:
        inits["l1.bias"] = np.zeros(4, np.float32)
    nodes.append(helper.make_node("Slice", ["h4", "zero", "three", "one"], ["h5"]))
    inits.update({"zero": np.array([0]), "three": np.array([3]), "one": np.array([1])})
    nodes.append(helper.make_node("Add", ["h5", "l1.bias_3"], ["logits"]))
    nodes.insert(-1, helper.make_node("Slice", ["l1.bias", "zero", "three"], ["l1.bias_3"]))
    return model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 4])],
        [helper.make_tensor_value_info("logits", F, ["N", 3])],
        inits,
    )


def _one_step(m: onnx.ModelProto, output: str | None = None) -> dict[str, np.ndarray]:
    from device_runtime import PlanExecutor
    from emulator.toolchain import initial_weights_from_onnx

    plan = training_plan_from_onnx(
        m, label="y", loss="cross_entropy", optimizer=SGD(0.5), batch_size=8, example_selector=SELECTOR, output=output
    )
    weights = initial_weights_from_onnx(m, plan)
    rng = np.random.default_rng(4)
    batch = {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.integers(0, 3, 8)}
    executor = PlanExecutor(plan)
    return executor.final_weights(weights, executor.run_device(weights, lambda: [batch]))


def test_parameters_an_exporter_merged_take_the_step_of_the_model_exported_without_merging():
    merged, separate = _one_step(_two_layers(deduplicated=True)), _one_step(_two_layers(deduplicated=False))
    assert set(merged) == set(separate) == {"l0.weight", "l0.bias", "l1.weight", "l1.bias"}
    for name in separate:
        np.testing.assert_allclose(merged[name], separate[name], rtol=1e-6, atol=1e-7)
    assert not np.allclose(separate["l0.bias"], separate["l1.bias"])  # each bias took its own update


def test_a_weight_the_model_itself_ties_stays_one_weight_and_from_onnx_names_it(tmp_path, capsys):
    onnx.save_model(_two_layers(deduplicated=True, tied=True), str(tmp_path / "m.onnx"))
    assert _from_onnx(tmp_path / "m.onnx", tmp_path / "p.fedplan") == 0
    out = capsys.readouterr().out
    plan = load_plan((tmp_path / "p.fedplan").read_bytes())
    assert plan.weight_names == ("l0.weight", "l0.bias", "l1.weight", "l1.bias")
    assert "shared: l0.weight is one weight read in 2 places" in out
    assert plan.metadata.shared_weights == ("l0.weight",) and "back into weights of their own: l1.bias" in out


def test_running_statistics_that_arrive_through_identity_become_plan_state_of_their_own():
    from .models import model

    rng = np.random.default_rng(5)
    inits = {
        "fc.weight": rng.normal(size=(4, 3)).astype(np.float32),
        "bn.weight": np.ones(3, np.float32),
        "bn.bias": np.zeros(3, np.float32),
    }
    nodes = [
        helper.make_node("Identity", ["bn.bias"], ["bn.running_mean"]),
        helper.make_node("Identity", ["bn.weight"], ["bn.running_var"]),
        helper.make_node("MatMul", ["x", "fc.weight"], ["h"]),
        helper.make_node(
            "BatchNormalization",
            ["h", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"],
            ["logits"],
            epsilon=1e-5,
        ),
    ]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 4])],
        [helper.make_tensor_value_info("logits", F, ["N", 3])],
        inits,
    )
    names = _weights(m)
    assert set(names) == {"fc.weight", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"}


def _dynamo_node(
    op: str, inputs: list[str], outputs: list[str], module: str, reads: list[str], *, rule: str | None = None, **attrs
) -> onnx.NodeProto:
    """A node as torch's dynamo exporter writes it: the module it came from and the FX node, with
    the parameters that node read (torch.export's placeholders, p_<name> with dots as underscores)."""
    node = helper.make_node(op, inputs, outputs, **attrs)
    parts = module.split(".") if module else []
    scopes = ["", *[".".join(parts[: i + 1]) for i in range(len(parts))], op.lower()]
    args = ", ".join(["%x", *(f"%p_{r.replace('.', '_').lower()}" for r in reads)])
    call = f"call_function[target=torch.ops.aten.{op.lower()}.default]"
    props = {
        "pkg.torch.onnx.name_scopes": repr(scopes),
        "pkg.torch.onnx.fx_node": f"%{op.lower()} : [num_users=1] = {call}(args = ({args}), kwargs = {{}})",
    }
    if rule:
        props["pkg.onnxscript.rewriter.rule_name"] = rule
    for key, value in props.items():
        node.metadata_props.add(key=key, value=value)
    return node


def _two_layer_norms(merged: bool, *, metadata: bool = True) -> onnx.ModelProto:
    """x -> LayerNorm ln -> LayerNorm out.LayerNorm -> Linear fc, fresh (unit gains, zero biases).
    ``merged`` writes it as the dynamo exporter's optimizer does: the second LayerNorm's gain and
    bias (torch.export spells their placeholders in lower case) and fc's bias read ln's
    initializers, with no node in between; only the nodes' metadata names what each read."""
    from .models import model

    rng = np.random.default_rng(6)
    inits = {
        "ln.weight": np.ones(4, np.float32),
        "ln.bias": np.zeros(4, np.float32),
        "fc.weight": rng.normal(size=(4, 4)).astype(np.float32),
    }
    gain, bias = "out.LayerNorm.weight", "out.LayerNorm.bias"
    if not merged:
        inits.update({gain: np.ones(4, np.float32), bias: np.zeros(4, np.float32), "fc.bias": np.zeros(4, np.float32)})
    merges = {gain: "ln.weight", bias: "ln.bias", "fc.bias": "ln.bias"} if merged else {}
    own = lambda n: merges.get(n, n)  # noqa: E731
    nodes = [
        _dynamo_node("LayerNormalization", ["x", "ln.weight", "ln.bias"], ["h0"], "ln", ["ln.weight", "ln.bias"]),
        _dynamo_node("LayerNormalization", ["h0", own(gain), own(bias)], ["h1"], "out.LayerNorm", [gain, bias]),
        _dynamo_node("MatMul", ["h1", "fc.weight"], ["h2"], "fc", ["fc.weight", "fc.bias"]),
        _dynamo_node("Add", ["h2", own("fc.bias")], ["logits"], "fc", ["fc.weight", "fc.bias"]),
    ]
    if not metadata:
        for node in nodes:
            del node.metadata_props[:]
    return model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 4])],
        [helper.make_tensor_value_info("logits", F, ["N", 4])],
        inits,
        opset=18,
    )


def test_parameters_the_dynamo_exporter_merged_by_value_take_their_own_step_under_torchs_names():
    merged, separate = _one_step(_two_layer_norms(merged=True)), _one_step(_two_layer_norms(merged=False))
    assert (
        set(merged)
        == set(separate)
        == {"ln.weight", "ln.bias", "out.LayerNorm.weight", "out.LayerNorm.bias", "fc.weight", "fc.bias"}
    )
    for name in separate:
        np.testing.assert_array_equal(merged[name], separate[name])
    assert not np.allclose(separate["ln.bias"], separate["fc.bias"])  # each took its own update


def _cloned_layers(merged: bool) -> onnx.ModelProto:
    """Two linear layers of equal initial weights, as ``nn.TransformerEncoder`` deep-copies one layer
    (zero biases, dropped). ``merged``: as the dynamo exporter's optimizer writes them, the second
    layer's Gemm reading the first's weight, rewritten by ``RemoveOptionalBiasFromGemm`` (its
    metadata still names the placeholders its FX node read)."""
    from .models import model

    weight = np.random.default_rng(7).normal(size=(4, 4)).astype(np.float32)
    inits = {"layers.0.fc.weight": weight} | ({} if merged else {"layers.1.fc.weight": weight.copy()})
    second = "layers.0.fc.weight" if merged else "layers.1.fc.weight"
    reads = lambda k: [f"layers.{k}.fc.weight", f"layers.{k}.fc.bias"]  # noqa: E731
    rule = "RemoveOptionalBiasFromGemm"
    nodes = [
        _dynamo_node("Gemm", ["x", "layers.0.fc.weight"], ["h0"], "layers.0.fc", reads(0), rule=rule, transB=1),
        helper.make_node("Tanh", ["h0"], ["h1"]),
        _dynamo_node("Gemm", ["h1", second], ["logits"], "layers.1.fc", reads(1), rule=rule, transB=1),
    ]
    return model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 4])],
        [helper.make_tensor_value_info("logits", F, ["N", 4])],
        inits,
        opset=18,
    )


def test_a_layers_clone_merged_into_the_first_through_a_gemm_without_its_bias_takes_its_own_step():
    """nn.TransformerEncoder's layers are equal at initialization; the optimizer merged the second's
    weights into the first's and dropped the Gemms' zero biases: the rewritten Gemm's metadata still
    names its own parameter, so it gets its own weight again (it trained as one weight with the
    first: 1.45 times torch's change off)."""
    merged, separate = _one_step(_cloned_layers(merged=True)), _one_step(_cloned_layers(merged=False))
    assert set(merged) == set(separate) == {"layers.0.fc.weight", "layers.1.fc.weight"}
    for name in separate:
        np.testing.assert_array_equal(merged[name], separate[name])


def test_without_the_exporters_metadata_a_merged_initializer_stays_one_weight():
    """Nothing says which parameter a node reads once the metadata is gone: no guess is made."""
    assert set(_one_step(_two_layer_norms(merged=True, metadata=False))) == {"ln.weight", "ln.bias", "fc.weight"}


def _tied_language_model(tie_value: float | None = None) -> onnx.ModelProto:
    """Embedding and decoder that torch ties (one Parameter): torch.export lifts it once, so both
    readers' FX nodes name p_emb_weight, whatever its values (all ones here when ``tie_value``)."""
    from .models import model

    rng = np.random.default_rng(7)
    emb = rng.normal(size=(6, 4)).astype(np.float32) if tie_value is None else np.full((6, 4), tie_value, np.float32)
    nodes = [
        _dynamo_node("Gather", ["emb.weight", "x"], ["e"], "emb", ["emb.weight"]),
        _dynamo_node("ReduceMean", ["e", "axes"], ["h"], "", [], keepdims=0),
        _dynamo_node(
            "Gemm", ["h", "emb.weight", "decoder.bias"], ["logits"], "decoder", ["emb.weight", "decoder.bias"], transB=1
        ),
    ]
    return model(
        nodes,
        [helper.make_tensor_value_info("x", onnx.TensorProto.INT64, ["N", 3])],
        [helper.make_tensor_value_info("logits", F, ["N", 6])],
        {"emb.weight": emb, "decoder.bias": np.zeros(6, np.float32), "axes": np.array([1], np.int64)},
        opset=18,
    )


@pytest.mark.parametrize("tie_value", [None, 1.0])
def test_a_weight_torch_ties_stays_one_weight_whatever_its_values_and_the_plan_lists_it(tmp_path, capsys, tie_value):
    onnx.save_model(_tied_language_model(tie_value), str(tmp_path / "lm.onnx"))
    assert _from_onnx(tmp_path / "lm.onnx", tmp_path / "lm.fedplan") == 0
    out = capsys.readouterr().out
    plan = load_plan((tmp_path / "lm.fedplan").read_bytes())
    assert set(plan.weight_names) == {"emb.weight", "decoder.bias"}
    assert plan.metadata.shared_weights == ("emb.weight",)
    assert "shared: emb.weight is one weight read in 2 places" in out


def test_a_weight_one_module_reads_through_several_nodes_is_not_taken_for_a_tie():
    """An LSTM's gates sliced apart, attention's packed projection: several nodes, one module."""
    from emulator.toolchain.onnx_import import shared_weights

    nodes = [
        helper.make_node("Slice", ["lstm.weight_ih_l0", "s", "e"], [f"g{i}"], name=f"/lstm/Slice_{i}") for i in range(4)
    ]
    nodes.append(helper.make_node("Gather", ["emb.weight", "x"], ["y"], name="/emb/Gather"))
    nodes.append(helper.make_node("MatMul", ["h", "emb.weight"], ["z"], name="/decoder/MatMul"))
    assert shared_weights(nodes, ["lstm.weight_ih_l0", "emb.weight"]) == {"emb.weight": 2}


def test_parameters_the_exporter_folded_or_dropped_are_warned_of_in_one_line_naming_them(tmp_path, capsys):
    """The dynamo optimizer's BatchNorm fused into a Conv and a dropped zero bias: the nodes'
    metadata still names the parameters they read, which have no initializer any more."""
    from .models import model

    rng = np.random.default_rng(8)
    nodes = [
        _dynamo_node("Conv", ["x", "conv.weight"], ["c"], "bn", ["bn.weight", "bn.bias"], rule="FuseBatchNormIntoConv"),
        _dynamo_node("Flatten", ["c"], ["f"], "", []),
        _dynamo_node(
            "Gemm",
            ["f", "fc.weight"],
            ["logits"],
            "fc",
            ["fc.weight", "fc.bias"],
            transB=1,
            rule="RemoveOptionalBiasFromGemm",
        ),
    ]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 1, 2, 2])],
        [helper.make_tensor_value_info("logits", F, ["N", 3])],
        {
            "conv.weight": rng.normal(size=(2, 1, 1, 1)).astype(np.float32),
            "fc.weight": rng.normal(size=(3, 8)).astype(np.float32),
        },
        opset=18,
    )
    onnx.save_model(m, str(tmp_path / "m.onnx"))
    assert _from_onnx(tmp_path / "m.onnx", tmp_path / "m.fedplan") == 0
    (err,) = [line for line in capsys.readouterr().err.splitlines() if "folded or dropped" in line]
    assert err.startswith("fedfleet plan from-onnx: warning:")  # the command as typed, as its other lines
    named = err.split("(", 1)[1].split(")", 1)[0]
    assert set(named.split(", ")) == {"bn.weight", "bn.bias", "fc.bias"}
    assert "optimize=False" in err and "from-torch" in err


def _with_signature(m: onnx.ModelProto, parameters: dict[str, str]) -> onnx.ModelProto:
    """The exported program's signature as the dynamo exporter writes it in the graph's metadata."""
    lines = [f"{p}: PARAMETER target='{name}'" for p, name in parameters.items()]
    m.graph.metadata_props.add(
        key="pkg.torch.export.ExportedProgram.graph_signature",
        value="\n# inputs\n" + "\n".join(lines) + "\nx: USER_INPUT\n",
    )
    return m


def test_a_parameter_folded_away_whole_is_named_from_the_programs_signature_but_a_tied_ones_second_name_is_not():
    """Positions looked up at constant indices fold into a constant (``embedding_2``) and no node
    names their table any more; the program's signature still lists it, with its exact spelling.
    A tied weight's second name is listed too, read by no node: its module's node reads the other
    name's placeholder, which tells the two apart."""
    from emulator.toolchain.onnx_import import lost_parameters

    from .models import model

    rng = np.random.default_rng(9)
    nodes = [
        _dynamo_node("Gather", ["decoder.weight", "x"], ["e"], "emb", ["decoder.weight"]),
        _dynamo_node("Add", ["e", "embedding_2"], ["h"], "", []),
        _dynamo_node("ReduceMean", ["h", "axes"], ["p"], "", [], keepdims=0),
        _dynamo_node("Gemm", ["p", "decoder.weight"], ["logits"], "decoder", ["decoder.weight"], transB=1),
    ]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", onnx.TensorProto.INT64, ["N", 3])],
        [helper.make_tensor_value_info("logits", F, ["N", 6])],
        {
            "decoder.weight": rng.normal(size=(6, 4)).astype(np.float32),
            "embedding_2": rng.normal(size=(3, 4)).astype(np.float32),
            "axes": np.array([1], np.int64),
        },
        opset=18,
    )
    _with_signature(
        m,
        {"p_emb_weight": "emb.weight", "p_pos_table_weight": "pos.Table.weight", "p_decoder_weight": "decoder.weight"},
    )
    assert lost_parameters(m) == ["pos.Table.weight"]


def test_a_parameter_the_dynamo_exporter_reads_again_through_an_identity_stays_one_weight():
    # torch.export writes aten.clone / aten.alias as Identity nodes with their FX node's metadata
    # (DeBERTa reads its relative embeddings so in every layer): one parameter, one weight, its
    # gradient the sum over its readers, where the classic exporter's Identity of a merged
    # initializer (no such metadata) is a parameter of its own
    from .models import model

    rng = np.random.default_rng(8)
    inits = {"rel.weight": rng.normal(size=(4, 4)).astype(np.float32)}

    def two_reads(dynamo: bool) -> onnx.ModelProto:
        if dynamo:
            alias = _dynamo_node("Identity", ["rel.weight"], ["alias_1"], "encoder", ["rel.weight"])
        else:
            alias = helper.make_node("Identity", ["rel.weight"], ["alias_1"])
        nodes = [
            alias,
            helper.make_node("MatMul", ["x", "rel.weight"], ["h"]),
            helper.make_node("MatMul", ["h", "alias_1"], ["logits"]),
        ]
        return model(
            nodes,
            [helper.make_tensor_value_info("x", F, ["N", 4])],
            [helper.make_tensor_value_info("logits", F, ["N", 4])],
            inits,
            opset=18,
        )

    assert set(_one_step(two_reads(dynamo=True))) == {"rel.weight"}
    assert set(_one_step(two_reads(dynamo=False))) == {"rel.weight", "alias_1"}


def _tied_output_layer(folded: bool) -> onnx.ModelProto:
    """GPT-2's output layer reads the token embedding: ``linear(h, emb.weight)`` is ``h @ emb.weight.T``,
    whose transpose the dynamo exporter's optimizer folds into a constant (``val_9``) while the
    embedding's ``Gather`` still reads ``emb.weight``; ``folded=False`` is the graph before it."""
    from .models import model

    emb = np.random.default_rng(10).normal(size=(6, 4)).astype(np.float32)
    inits = {"emb.weight": emb, "axes": np.array([1], np.int64)}
    if folded:
        inits["val_9"] = np.ascontiguousarray(emb.T)
        head = [_dynamo_node("MatMul", ["h", "val_9"], ["logits"], "lm_head", ["emb.weight"])]
    else:
        head = [
            _dynamo_node("Transpose", ["emb.weight"], ["w_t"], "lm_head", ["emb.weight"], perm=[1, 0]),
            _dynamo_node("MatMul", ["h", "w_t"], ["logits"], "lm_head", ["emb.weight"]),
        ]
    m = model(
        [
            _dynamo_node("Gather", ["emb.weight", "x"], ["e"], "emb", ["emb.weight"]),
            _dynamo_node("ReduceMean", ["e", "axes"], ["h"], "", [], keepdims=0),
            *head,
        ],
        [helper.make_tensor_value_info("x", onnx.TensorProto.INT64, ["N", 3])],
        [helper.make_tensor_value_info("logits", F, ["N", 6])],
        inits,
        opset=18,
    )
    return _with_signature(m, {"p_emb_weight": "emb.weight"})


def test_a_tied_weight_whose_transpose_the_optimizer_folded_stays_one_weight_with_the_unfolded_step():
    from device_runtime import PlanExecutor
    from emulator.toolchain import initial_weights_from_onnx

    steps = []
    for folded in (True, False):
        m = _tied_output_layer(folded)
        plan = training_plan_from_onnx(
            m, label="y", loss="cross_entropy", optimizer=SGD(0.5), batch_size=8, example_selector=SELECTOR
        )
        assert plan.weight_names == ("emb.weight",) and plan.metadata.shared_weights == ("emb.weight",)
        weights = initial_weights_from_onnx(m, plan)
        rng = np.random.default_rng(4)
        batch = {"x": rng.integers(0, 6, (8, 3)), "y": rng.integers(0, 6, 8)}
        executor = PlanExecutor(plan)
        steps.append(
            executor.final_weights(weights, executor.run_device(weights, lambda batch=batch: [batch]))["emb.weight"]
        )
    np.testing.assert_allclose(steps[0], steps[1], rtol=1e-6, atol=1e-7)


def test_a_folded_constant_that_is_no_parameters_transpose_is_left_as_it_is():
    from emulator.toolchain.onnx_import import refold_tied_transposes

    m = _tied_output_layer(folded=True)
    val = next(i for i in m.graph.initializer if i.name == "val_9")
    val.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(val) + np.float32(1e-3), "val_9"))
    assert refold_tied_transposes(m) == []
    assert any(n.input[1] == "val_9" for n in m.graph.node if n.op_type == "MatMul")


def test_buffers_the_programs_signature_declares_do_not_train_unless_named():
    """A rotary embedding's inv_freq, BART's final_logits_bias: buffers on a float path to the
    output, which torch never trains; the classic exporter's file cannot tell them from parameters."""
    from .models import model

    rng = np.random.default_rng(11)
    nodes = [
        _dynamo_node("MatMul", ["x", "fc.weight"], ["h"], "fc", ["fc.weight"]),
        _dynamo_node("Add", ["h", "final_bias"], ["logits"], "", []),
    ]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 4])],
        [helper.make_tensor_value_info("logits", F, ["N", 3])],
        {"fc.weight": rng.normal(size=(4, 3)).astype(np.float32), "final_bias": np.zeros((1, 3), np.float32)},
        opset=18,
    )
    assert _weights(m) == ("fc.weight", "final_bias")  # no signature: nothing says it is a buffer
    _with_signature(m, {"p_fc_weight": "fc.weight"})
    m.graph.metadata_props[0].value += "b_final_bias: BUFFER target='final_bias' persistent=True\n"
    assert _weights(m) == ("fc.weight",)
    assert _weights(m, trainable=["fc.weight", "final_bias"]) == ("fc.weight", "final_bias")
    assert _weights(m, trainable=["*"]) == ("fc.weight",)


def test_one_element_parameters_the_programs_signature_declares_train_as_torch_trains_them():
    """A learned temperature (a 0-d ``nn.Parameter``) and ReZero's gate (one element, read by a
    ``Mul``) look like constants to a file alone, and stay so without a signature; the dynamo
    exporter's declares them parameters, and the plan's step on them is the loss's gradient."""
    from device_runtime import PlanExecutor
    from emulator.toolchain import initial_weights_from_onnx

    from .models import model

    rng = np.random.default_rng(12)
    values = {
        "fc.weight": rng.normal(size=(4, 3)).astype(np.float32),
        "alpha": np.array([0.7], np.float32),
        "temp": np.array(1.5, np.float32),
    }
    nodes = [
        _dynamo_node("MatMul", ["x", "fc.weight"], ["h"], "fc", ["fc.weight"]),
        _dynamo_node("Mul", ["h", "alpha"], ["gated"], "", ["alpha"]),
        _dynamo_node("Mul", ["gated", "temp"], ["logits"], "", ["temp"]),
    ]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 4])],
        [helper.make_tensor_value_info("logits", F, ["N", 3])],
        values,
        opset=18,
    )
    assert _weights(m) == ("fc.weight",)  # no signature: one-element scales stay constants
    _with_signature(m, {"p_fc_weight": "fc.weight", "p_alpha": "alpha", "p_temp": "temp"})
    plan = training_plan_from_onnx(
        m, label="y", loss="cross_entropy", optimizer=SGD(0.5), batch_size=8, example_selector=SELECTOR
    )
    assert plan.weight_names == ("fc.weight", "alpha", "temp")
    assert _weights(m, frozen=["temp"]) == ("fc.weight", "alpha")
    batch = {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.integers(0, 3, 8)}
    executor = PlanExecutor(plan)
    weights = initial_weights_from_onnx(m, plan)
    after = executor.final_weights(weights, executor.run_device(weights, lambda: [batch]))

    def loss(alpha: float, temp: float) -> float:
        z = batch["x"].astype(np.float64) @ values["fc.weight"] * alpha * temp
        z -= z.max(axis=1, keepdims=True)
        return float(np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(8), batch["y"]]))

    a, t, eps = 0.7, 1.5, 1e-6
    d_alpha = (loss(a + eps, t) - loss(a - eps, t)) / (2 * eps)
    d_temp = (loss(a, t + eps) - loss(a, t - eps)) / (2 * eps)
    np.testing.assert_allclose(after["alpha"], [a - 0.5 * d_alpha], rtol=1e-5)
    np.testing.assert_allclose(after["temp"], t - 0.5 * d_temp, rtol=1e-5)


def test_no_gradient_flows_through_a_detach_the_dynamo_exporter_wrote():
    """``logits = h * h.detach()``, ``h = x @ W``: the exporter writes the detach as an ``Identity``
    (FX node ``aten.detach.default``), and the plan's step is torch's, the detached factor held
    constant (differentiated through, the gradient would double); and a weight that reaches the
    loss only through a detach does not train."""
    from device_runtime import PlanExecutor
    from emulator.toolchain import initial_weights_from_onnx

    from .models import model

    rng = np.random.default_rng(13)
    w0, w1 = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(4, 3)).astype(np.float32)

    def detach(source: str, out: str) -> onnx.NodeProto:
        node = helper.make_node("Identity", [source], [out])
        node.metadata_props.add(
            key="pkg.torch.onnx.fx_node",
            value=f"%{out} : [num_users=1] = call_function[target=torch.ops.aten.detach.default]"
            f"(args = (%{source},), kwargs = {{}})",
        )
        return node

    nodes = [
        _dynamo_node("MatMul", ["x", "fc.weight"], ["h"], "fc", ["fc.weight"]),
        _dynamo_node("MatMul", ["x", "other.weight"], ["o"], "other", ["other.weight"]),
        detach("h", "d"),
        detach("o", "od"),
        _dynamo_node("Mul", ["h", "d"], ["hd"], "", []),
        _dynamo_node("Add", ["hd", "od"], ["logits"], "", []),
    ]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 4])],
        [helper.make_tensor_value_info("logits", F, ["N", 3])],
        {"fc.weight": w0, "other.weight": w1},
        opset=18,
    )
    plan = training_plan_from_onnx(
        m, label="y", loss="cross_entropy", optimizer=SGD(0.5), batch_size=8, example_selector=SELECTOR
    )
    assert plan.weight_names == ("fc.weight",)  # other.weight reaches the loss only detached
    x = rng.normal(size=(8, 4)).astype(np.float32)
    batch = {"x": x, "y": rng.integers(0, 3, 8)}
    executor = PlanExecutor(plan)
    weights = initial_weights_from_onnx(m, plan)
    after = executor.final_weights(weights, executor.run_device(weights, lambda: [batch]))["fc.weight"]
    xd = x.astype(np.float64)
    held, shift = xd @ w0, xd @ w1  # the detached factor and term: constants

    def loss(w: np.ndarray) -> float:
        z = (xd @ w) * held + shift
        z -= z.max(axis=1, keepdims=True)
        return float(np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(8), batch["y"]]))

    grad = np.zeros((4, 3))
    for i in np.ndindex(4, 3):
        step = np.zeros((4, 3))
        step[i] = 1e-6
        grad[i] = (loss(w0 + step) - loss(w0 - step)) / 2e-6
    np.testing.assert_allclose(after, w0 - 0.5 * grad, rtol=1e-4, atol=1e-6)


def _with_local_functions(flat: onnx.ModelProto) -> onnx.ModelProto:
    """``flat``'s Gemm-Relu-Gemm with its layers as model-local functions, as onnxscript writes a
    ``@script`` model that calls ``@script`` functions: ``dense_relu`` calls ``dense``, each in the
    domain ``this``."""
    dense = helper.make_function(
        "this",
        "dense",
        ["x", "w", "b"],
        ["y"],
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"])],
        [helper.make_opsetid("", 17)],
    )
    dense_relu = helper.make_function(
        "this",
        "dense_relu",
        ["x", "w", "b"],
        ["y"],
        [helper.make_node("dense", ["x", "w", "b"], ["z"], domain="this"), helper.make_node("Relu", ["z"], ["y"])],
        [helper.make_opsetid("", 17), helper.make_opsetid("this", 1)],
    )
    graph = onnx.GraphProto()
    graph.CopyFrom(flat.graph)
    del graph.node[:]
    graph.node.extend(
        [
            helper.make_node("dense_relu", ["x", "w0", "b0"], ["a0"], domain="this", name="layer0"),
            helper.make_node("dense", ["a0", "w1", "b1"], ["logits"], domain="this", name="layer1"),
        ]
    )
    m = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("this", 1)],
        functions=[dense, dense_relu],
        ir_version=8,
    )
    onnx.checker.check_model(m)
    return m


def test_a_model_calling_its_own_functions_takes_the_step_of_the_same_model_written_flat():
    """onnxscript's ``@script`` models call model-local functions (nodes of their own domain); the
    plan inlines them, nested ones too, and trains what the flat graph trains."""
    flat = mlp(4, 6, 3, seed=2)
    flat.graph.initializer[1].CopyFrom(onnx.numpy_helper.from_array(np.linspace(-1, 1, 6).astype(np.float32), "b0"))
    called, written_flat = _one_step(_with_local_functions(flat)), _one_step(flat)
    assert set(called) == set(written_flat) == {"w0", "b0", "w1", "b1"}
    for name in written_flat:
        np.testing.assert_array_equal(called[name], written_flat[name])
    assert not np.array_equal(written_flat["w0"], onnx.numpy_helper.to_array(flat.graph.initializer[0]))


def _dilated_conv(padding: dict[str, object], kernel: int, stride: int, side: int = 7) -> onnx.ModelProto:
    """A dilated Conv (dilation 2) over a [N, 2, side, side] image, mean-pooled to 3 classes: padded as
    ``padding`` says (``auto_pad`` SAME, as torch's classic exporter writes ``padding="same"``, or
    the explicit ``pads`` that stand for it)."""
    from .models import model

    rng = np.random.default_rng(5)
    out = -(-side // stride)
    ramp = (np.arange(1, 1 + out * out, dtype=np.float32) / out).reshape(out, out)
    conv = helper.make_node(
        "Conv", ["x", "w", "b"], ["h"], kernel_shape=[kernel, kernel], dilations=[2, 2], strides=[stride] * 2, **padding
    )
    return model(
        [
            conv,
            helper.make_node("Constant", [], ["ramp"], value=onnx.numpy_helper.from_array(ramp)),
            helper.make_node("Tanh", ["h"], ["t"]),
            helper.make_node("Mul", ["t", "ramp"], ["r"]),  # so that every position's value counts apart
            helper.make_node("ReduceMean", ["r"], ["logits"], axes=[2, 3], keepdims=0),
        ],
        [helper.make_tensor_value_info("x", F, ["N", 2, side, side])],
        [helper.make_tensor_value_info("logits", F, ["N", 3])],
        {
            "w": rng.normal(size=(3, 2, kernel, kernel)).astype(np.float32),
            "b": rng.normal(size=3).astype(np.float32),
        },
    )


def _conv_step(m: onnx.ModelProto, side: int = 7) -> dict[str, np.ndarray]:
    from device_runtime import PlanExecutor
    from emulator.toolchain import initial_weights_from_onnx

    plan = training_plan_from_onnx(
        m, label="y", loss="mse", optimizer=SGD(0.5), batch_size=4, example_selector=SELECTOR
    )
    weights = initial_weights_from_onnx(m, plan)
    rng = np.random.default_rng(6)
    batch = {
        "x": rng.normal(size=(4, 2, side, side)).astype(np.float32),
        "y": rng.normal(size=(4, 3)).astype(np.float32),
    }
    executor = PlanExecutor(plan)
    return executor.final_weights(weights, executor.run_device(weights, lambda: [batch]))


@pytest.mark.parametrize(
    ("auto_pad", "kernel", "stride", "side", "pads"),
    [
        ("SAME_UPPER", 3, 1, 7, [2, 2, 2, 2]),  # torch's padding="same", dilation=2: (3 - 1) * 2 in all
        ("SAME_LOWER", 4, 1, 7, [3, 3, 3, 3]),  # (4 - 1) * 2 = 6 in all
        # a stride of 2 over 8: 4 out, (4 - 1) * 2 + (3 - 1) * 2 + 1 - 8 = 3 in all, the odd one at the end
        ("SAME_UPPER", 3, 2, 8, [1, 1, 2, 2]),
        ("SAME_LOWER", 3, 2, 8, [2, 2, 1, 1]),  # or at the start
    ],
)
def test_a_dilated_conv_of_same_padding_takes_the_step_of_its_explicit_pads(auto_pad, kernel, stride, side, pads):
    """onnxruntime refuses a Conv of auto_pad SAME with dilations at its first run (torch's classic
    exporter writes padding="same" with dilation=2 so): the plan writes the pads out, and its step
    is that of the same Conv written with them."""
    same = _conv_step(_dilated_conv({"auto_pad": auto_pad}, kernel, stride, side), side)
    explicit = _conv_step(_dilated_conv({"pads": pads}, kernel, stride, side), side)
    assert set(same) == {"w", "b"}
    for name in explicit:
        np.testing.assert_allclose(same[name], explicit[name], rtol=1e-6, atol=1e-6, err_msg=name)


def test_a_model_written_again_with_its_tensors_beside_it_replaces_its_data_file(tmp_path):
    """onnx appends the tensors to a data file of that name already there: a bundle's model written
    over again grew its data file by the whole model each time (from-torch of a large model, or
    fedfleet model --onnx --force)."""
    import onnxruntime as ort

    from emulator.toolchain.onnx_import import save_onnx

    model = mlp(64, 32, 3, seed=0)
    path = tmp_path / "model.onnx"
    for _ in range(3):  # (saving moves a model's tensors out of it: each time a model of its own)
        save_onnx(mlp(64, 32, 3, seed=0), path, data_file="model.onnx.data")
    weights = sum(np.prod(i.dims) * 4 for i in model.graph.initializer if np.prod(i.dims) * 4 >= 1024)
    assert (tmp_path / "model.onnx.data").stat().st_size == weights
    x = np.ones((2, 64), np.float32)
    got = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    assert got.shape == (2, 3) and np.isfinite(got).all()
