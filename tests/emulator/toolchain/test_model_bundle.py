"""``fedfleet plan from-onnx MODEL -o DIR``: an exported model becomes a bundle (the model, a task file
stub, the plans and the initial checkpoint) that ``plan test`` and ``deploy`` take as it is; a model
that cannot train is refused in one line that says what to export; an eval-mode export is warned of."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from device_runtime import FLRuntime, Outcome, PlanExecutor, RuntimeEnvironment, load_plan
from device_runtime.checkpoint import decode_checkpoint
from emulator.cli.commands import main
from emulator.releases.workers import ReleasePlans, WorkerPool
from emulator.toolchain.bundle import read_bundle
from example_store import SQLiteExampleStore
from server_stub import ServerThread
from server_stub.release_trust import read_release_trust

from .models import F, cnn, mlp, model

CNN = Path(__file__).with_name("data") / "cnn_torch.onnx"  # torch.onnx.export's: pixels [N, 1, 8, 8] -> logits [N, 10]
ADMIN_KEY = "operator-key-for-the-bundle-test-0123456789"
RELEASES = ["1.15.1", "1.31.1"]


def _from_onnx(path: Path, out: Path, *extra: str) -> int:
    return main(
        [
            "plan",
            "from-onnx",
            str(path),
            "--label",
            "y",
            "--batch-size",
            "16",
            "--runtimes",
            *RELEASES,
            "-o",
            str(out),
            *extra,
        ]
    )


def _manifest(bundle: Path, task: str) -> dict:
    return json.loads((bundle / task / "manifest.json").read_text())


@pytest.mark.timeout(1800)  # a cold cache installs the releases first
def test_from_onnx_writes_a_bundle_that_plan_test_and_deploy_take_and_a_device_trains_with(
    tmp_path, capsys, monkeypatch, digits
):
    out = tmp_path / "cnn"
    assert _from_onnx(CNN, out, "--collection", "app:/digit_images", "--name", "cnn") == 0
    printed = capsys.readouterr().out
    assert (
        "inputs: pixels ['N', 1, 8, 8] float32; label: y" in printed
        and "reads collection: app:/digit_images" in printed
    )
    assert "conv1.weight  [6, 1, 3, 3]" in printed  # the trained tensors' table
    assert f"fedfleet plan test {out} --signing-key KEY" in printed
    assert f"fedfleet deploy {out} --server URL --population P" in printed
    assert "with data whose features are pixels, y (" in printed
    assert f"fedfleet simulate --task {out} --data FORMAT:PATH" in printed
    checkpoint = decode_checkpoint((out / "cnn" / "initial.ckpt").read_bytes())
    for init in onnx.load(str(CNN)).graph.initializer:  # the exported weights are the initial model
        if init.name in checkpoint:
            assert np.array_equal(checkpoint[init.name], numpy_helper.to_array(init)), init.name
    key = tmp_path / "tester.key"
    assert main(["plan", "keygen", "--key", str(key)]) == 0
    assert main(["plan", "test", str(out), "--signing-key", str(key)]) == 0, capsys.readouterr()
    assert "cnn: passed" in capsys.readouterr().out
    trusted = read_release_trust(Path(f"{key}.pub"))
    with (
        ServerThread(tmp_path / "server.db", admin_key=ADMIN_KEY, release_trust=trusted) as server,
        WorkerPool() as pool,
    ):
        server.service.require_release_reports = True
        monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", ADMIN_KEY)
        assert main(["deploy", str(out), "--server", server.url, "--population", "digits"]) == 0, capsys.readouterr()
        with SQLiteExampleStore(tmp_path / "device.db") as store:
            store.add(
                "app:/digit_images",
                ({"pixels": x.reshape(1, 8, 8), "y": y} for x, y in zip(digits.x_train[:64], digits.y_train[:64])),
            )
            with FLRuntime(
                "digits",
                server.url,
                store,
                runtime_version="1.31.1",
                cache_dir=tmp_path / "cache",
                environment=RuntimeEnvironment(loaded_plans=ReleasePlans(pool)),
            ) as runtime:
                result = runtime.run_session()
    assert result.outcome == Outcome.COMPLETED and result.task == "cnn" and result.num_examples == 64


def _external(folder: Path) -> Path:
    """An MLP saved as the dynamo exporter saves, its weights in model.onnx.data beside it."""
    folder.mkdir(parents=True)
    path = folder / "mlp.onnx"
    onnx.save_model(
        mlp(6, 5, 3),
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="mlp.onnx.data",
        size_threshold=0,
    )
    return path


def test_plan_build_of_the_stub_reproduces_the_bundle_and_a_moved_bundle_still_reads(tmp_path, monkeypatch, capsys):
    path = _external(tmp_path / "export")
    monkeypatch.chdir(tmp_path)
    assert _from_onnx(path, Path("bundle")) == 0, capsys.readouterr().err
    out = tmp_path / "bundle"
    assert sorted(p.name for p in out.iterdir()) == ["mlp", "model.onnx", "model.onnx.data", "source.json", "task.py"]
    assert main(["plan", "build", str(out / "task.py"), "-o", str(tmp_path / "again")]) == 0
    assert _manifest(out, "mlp")["plan"] == _manifest(tmp_path / "again", "mlp")["plan"]
    assert _manifest(out, "mlp")["versions"] == _manifest(tmp_path / "again", "mlp")["versions"]
    moved = tmp_path / "elsewhere" / "bundle"
    shutil.move(str(out), str(moved))  # its source.json names a task file that is gone: the copy inside is read
    (built,) = read_bundle(moved)
    assert built.task.name == "mlp" and built.task.runtimes == tuple(RELEASES)
    assert built.task.proxy_data().shards[0]["x"].shape[1:] == (6,)


def test_plan_test_of_a_bundles_task_file_builds_and_tests_that_bundle(tmp_path, monkeypatch, capsys):
    """``plan test DIR/task.py`` (the stub, once edited) builds into DIR, where deploy reads the
    report, not into build/task, where every bundle's stub would go."""
    onnx.save_model(mlp(6, 5, 3), str(tmp_path / "mlp.onnx"))
    monkeypatch.chdir(tmp_path)
    assert _from_onnx(tmp_path / "mlp.onnx", tmp_path / "bundle") == 0
    assert main(["plan", "test", str(tmp_path / "bundle" / "task.py")]) == 0, capsys.readouterr().err
    assert (tmp_path / "bundle" / "mlp" / "release_report.json").is_file()
    assert not (tmp_path / "build").exists()
    (tmp_path / "other.py").write_text((tmp_path / "bundle" / "task.py").read_text().replace("model.onnx", "mlp.onnx"))
    assert main(["plan", "test", "other.py"]) == 0, capsys.readouterr().err  # any other task file: build/<stem>
    assert (tmp_path / "build" / "other" / "mlp" / "release_report.json").is_file()


def test_from_onnx_writes_over_its_own_bundle_only(tmp_path, capsys):
    onnx.save_model(mlp(6, 5, 3), str(tmp_path / "mlp.onnx"))
    assert _from_onnx(tmp_path / "mlp.onnx", tmp_path / "bundle") == 0
    assert _from_onnx(tmp_path / "mlp.onnx", tmp_path / "bundle", "--name", "renamed") == 0
    assert [b.task.name for b in read_bundle(tmp_path / "bundle")] == ["renamed"]  # nothing of the first left
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    capsys.readouterr()
    assert _from_onnx(tmp_path / "mlp.onnx", foreign) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "did not write" in err and (foreign / "notes.txt").is_file()


def test_a_plan_file_path_writes_the_plan_alone_and_deploy_of_it_says_how_to_make_a_bundle(tmp_path, capsys):
    onnx.save_model(mlp(6, 5, 3), str(tmp_path / "mlp.onnx"))
    assert _from_onnx(tmp_path / "mlp.onnx", tmp_path / "mlp.fedplan") == 0
    assert "-o DIR (a directory) writes a bundle" in capsys.readouterr().out
    assert (
        main(
            [
                "deploy",
                str(tmp_path / "mlp.fedplan"),
                "--server",
                "http://127.0.0.1:9",
                "--population",
                "p",
                "--admin-key-file",
                str(tmp_path / "mlp.fedplan"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "plan from-onnx" in err and "-o DIR" in err
    assert main(["plan", "test", str(tmp_path / "mlp.fedplan")]) == 2  # not run as a task file
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a file, not a bundle directory" in err


def _normalized_cnn(op: str) -> onnx.ModelProto:
    """``cnn(batch_norm=False)`` with ``op`` (one group per channel: GroupNorm(4, 4)) after its first
    convolution: a network torch exports in eval mode as it trains."""
    model = cnn(batch_norm=False)
    graph = model.graph
    channels = numpy_helper.to_array(next(i for i in graph.initializer if i.name == "conv1_b")).shape[0]
    for name, value in (("norm_scale", 1.0), ("norm_bias", 0.0)):
        graph.initializer.append(numpy_helper.from_array(np.full(channels, value, np.float32), name))
    extra = {"num_groups": channels} if op == "GroupNormalization" else {}
    at = next(k for k, n in enumerate(graph.node) if n.op_type == "Conv") + 1
    graph.node.insert(at, helper.make_node(op, ["c1", "norm_scale", "norm_bias"], ["c1_normalized"], **extra))
    for node in graph.node[at + 1 :]:
        node.input[:] = ["c1_normalized" if i == "c1" else i for i in node.input]
    if op == "GroupNormalization":
        model.opset_import[0].version = 21
    return model


@pytest.mark.parametrize(
    "graph, warned",
    [
        (cnn(batch_norm=False), True),  # what torch.onnx.export writes by default: BatchNorm folded, Dropout gone
        (cnn(batch_norm=True), False),
        (cnn(batch_norm=False, dropout=0.5), False),
        (mlp(6, 5, 3), False),  # no convolution: nothing says BatchNorm was folded
        (_normalized_cnn("InstanceNormalization"), False),  # GroupNorm and InstanceNorm, as the exporters write them
        (_normalized_cnn("GroupNormalization"), False),
    ],
    ids=["conv_alone", "conv_batch_norm", "conv_dropout", "mlp", "conv_instance_norm", "conv_group_norm"],
)
def test_from_onnx_warns_in_one_line_when_the_graph_looks_exported_in_eval_mode(tmp_path, capsys, graph, warned):
    onnx.save_model(graph, str(tmp_path / "m.onnx"))
    assert _from_onnx(tmp_path / "m.onnx", tmp_path / "m.fedplan") == 0
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == ([err] if warned else [])
    assert ("looks exported in eval mode" in err and "optimize=False" in err) == warned


LOWERED = Path(__file__).with_name("exported") / "lowered"  # benchmarks/lowered_dynamo_fixtures.py


@pytest.mark.parametrize(
    ("opset", "says"),
    [
        (17, "torch's dynamo export lowered below opset 18 by onnx's version converter, which drops the exporter's"),
        (18, "the exporter folded or dropped 2 of the module's parameters and running statistics (0.weight, 2.weight)"),
    ],
)
def test_a_dynamo_export_lowered_below_opset_18_is_warned_that_its_folded_weights_cannot_be_named(
    tmp_path, capsys, opset, says
):
    """Asked for opset 17, torch's dynamo exporter writes opset 18 and lowers it with onnx's version
    converter, which drops the metadata that names the weights its optimizer folded (``val_0`` is
    ``0.weight`` transposed): without a warning the plan trained them under those names unsaid."""
    assert _from_onnx(LOWERED / f"mlp.dynamo.opset{opset}.onnx", tmp_path / "b") == 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "optimize=False" in err


def test_a_bundle_from_torch_s_own_export_is_not_warned_of_eval_mode(tmp_path):
    # from-torch exports in training mode itself: a convolution without BatchNorm nor Dropout is
    # the module as written, not one folded by an eval-mode export
    from emulator.toolchain.model_bundle import bundle_from_onnx

    onnx.save_model(cnn(batch_norm=False), str(tmp_path / "m.onnx"))
    kinds = {}
    for command in ("from-onnx", "from-torch"):
        made = bundle_from_onnx(
            tmp_path / "m.onnx", tmp_path / command, label="y", command=command, runtimes=["1.31.1"]
        )
        kinds[command] = any("looks exported in eval mode" in w for w in made.warnings)
    assert kinds == {"from-onnx": True, "from-torch": False}


def _tree(path: Path) -> None:
    from skl2onnx import to_onnx
    from sklearn.tree import DecisionTreeClassifier

    x = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    onnx.save_model(to_onnx(DecisionTreeClassifier().fit(x, x[:, 0] > 0), x[:1], options={"zipmap": False}), str(path))


def _argmax(path: Path) -> None:
    onnx.save_model(
        model(
            [
                helper.make_node("Gemm", ["x", "W", "b"], ["z"]),
                helper.make_node("ArgMax", ["z"], ["k"], axis=1, keepdims=1),
                helper.make_node("Cast", ["k"], ["logits"], to=F),
            ],
            [helper.make_tensor_value_info("x", F, ["N", 4])],
            [helper.make_tensor_value_info("logits", F, ["N", 1])],
            {"W": np.ones((4, 3), np.float32), "b": np.zeros(3, np.float32)},
        ),
        str(path),
    )


def _constant_output(path: Path) -> None:
    onnx.save_model(
        model(
            [helper.make_node("Add", ["w", "b"], ["logits"]), helper.make_node("Identity", ["x"], ["seen"])],
            [helper.make_tensor_value_info("x", F, ["N", 4])],
            [helper.make_tensor_value_info("logits", F, ["N", 3])],
            {"w": np.ones((1, 3), np.float32), "b": np.zeros(3, np.float32)},
        ),
        str(path),
    )


def _weights_as_constants(path: Path) -> None:
    m = mlp(6, 5, 3)
    nodes = [helper.make_node("Constant", [], [i.name], value=i) for i in m.graph.initializer] + list(m.graph.node)
    del m.graph.initializer[:], m.graph.node[:]
    m.graph.node.extend(nodes)
    onnx.save_model(m, str(path))


def _unconverted_op(path: Path) -> None:
    """tf2onnx 1.17 leaves TensorFlow 2.21's Erfc (its exact gelu) in the graph as it is."""
    m = mlp(6, 5, 3)
    relu = next(n for n in m.graph.node if n.op_type == "Relu")
    relu.op_type, relu.name = "Erfc", "dense_1/Gelu/Erfc"
    onnx.save_model(m, str(path))


def _pinned_batch(path: Path) -> None:
    """The features read through a Gather of indices into the flattened batch and reshaped to it, as
    the dynamo exporter writes ``as_strided`` (ConvNeXt's pooling) when exported without dynamic
    shapes: the graph holds its batch of 4 beyond any Reshape of the batch."""
    m = mlp(5, 6, 3)
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 4
    gemm = next(n for n in m.graph.node if n.op_type == "Gemm")
    gemm.input[0] = "strided"
    constants = {"flat": [-1], "indices": list(range(20)), "batch_shape": [4, 5]}
    m.graph.initializer.extend(numpy_helper.from_array(np.array(v, np.int64), k) for k, v in constants.items())
    nodes = [
        helper.make_node("Reshape", ["x", "flat"], ["x_flat"]),
        helper.make_node("Gather", ["x_flat", "indices"], ["gathered"], name="node_as_strided"),
        helper.make_node("Reshape", ["gathered", "batch_shape"], ["strided"]),
    ]
    rest = list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend([*nodes, *rest])  # before the first Gemm
    onnx.save_model(m, str(path))


def _torch_checkpoint(path: Path) -> None:
    path.write_bytes(b"PK\x03\x04" + bytes(60))  # torch.save writes a zip archive


@pytest.mark.parametrize(
    "make, says",
    [
        (_tree, "ai.onnx.ml.TreeEnsembleClassifier"),
        (_argmax, "through ops without one (ArgMax)"),
        (_constant_output, "does not depend on the model's inputs (x)"),
        (_weights_as_constants, "not as Constant nodes or graph inputs"),
        (_torch_checkpoint, "as torch.save writes a PyTorch checkpoint"),
        (_unconverted_op, "op 'Erfc' (node 'dense_1/Gelu/Erfc') is no ONNX op"),
        (_pinned_batch, "exported at a fixed batch size of 4, and node 'node_as_strided' (Gather) computes with"),
    ],
    ids=[
        "sklearn_tree",
        "argmax",
        "constant_output",
        "weights_as_constants",
        "torch_checkpoint",
        "unconverted_op",
        "pinned_batch",
    ],
)
def test_a_model_that_cannot_train_is_refused_in_one_line_saying_what_to_export(tmp_path, capsys, make, says):
    make(tmp_path / "m.onnx")
    assert _from_onnx(tmp_path / "m.onnx", tmp_path / "bundle") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and says in err and "export" in err
    assert not (tmp_path / "bundle").exists()  # nothing half-written


@pytest.mark.parametrize(
    "file_name, extra, says",
    [
        ("m.onnx", ("--runtimes", "9.9.9"), "claims 9.9.9, not an onnxruntime release"),
        ("my model.onnx", (), "the model file's name 'my model' is no task name"),
        ("m.onnx", ("--name", ".."), "task name '..' refused"),
        ("m.onnx", ("--collection", ""), "collection '' refused"),
        ("m.onnx", ("--label", "x"), "the label 'x' is an example tensor the model reads as an input"),
    ],
)
def test_options_a_bundle_cannot_have_are_refused_in_one_line_before_anything_is_written(
    tmp_path, capsys, file_name, extra, says
):
    onnx.save(mlp(F, 8, 10), tmp_path / file_name)
    assert (
        main(["plan", "from-onnx", str(tmp_path / file_name), "--label", "y", "-o", str(tmp_path / "b"), *extra]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and says in err, err
    assert not (tmp_path / "b").exists()


def test_from_onnx_keeps_the_rows_frozen_rows_names_out_of_training(tmp_path, capsys):
    from .test_training import _bag_of_embeddings

    onnx.save_model(_bag_of_embeddings(), str(tmp_path / "bag.onnx"))
    assert _from_onnx(tmp_path / "bag.onnx", tmp_path / "bundle", "--frozen-rows", "emb:0,3", "--name", "bag") == 0
    out = capsys.readouterr().out
    assert "no gradient reaches row 0, 3 of emb" in out
    assert "frozen_rows={'emb': (0, 3)}" in (tmp_path / "bundle" / "task.py").read_text()
    # the plan file alone too, and a malformed spec is one line naming the form
    assert _from_onnx(tmp_path / "bag.onnx", tmp_path / "bag.fedplan", "--frozen-rows", "emb:0", "--name", "bag") == 0
    plan = load_plan((tmp_path / "bag.fedplan").read_bytes())
    rng = np.random.default_rng(0)
    weights = {"emb": rng.normal(size=(12, 4)).astype(np.float32), "w": rng.normal(size=(4, 3)).astype(np.float32)}
    executor = PlanExecutor(plan)
    x = np.array([[0, 1, 2, 0, 0]] * 16, dtype=np.int64)
    result = executor.run_device(weights, lambda: [{"x": x, "y": np.zeros(16, dtype=np.int64)}])
    stepped = executor.final_weights(weights, result)
    np.testing.assert_array_equal(stepped["emb"][0], weights["emb"][0])
    assert not np.allclose(stepped["emb"][1], weights["emb"][1])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        _from_onnx(tmp_path / "bag.onnx", tmp_path / "b2", "--frozen-rows", "emb")
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "give NAME:ROW[,ROW] (emb.weight:0), not 'emb'" in err


def test_a_model_exported_at_batch_one_gets_its_classes_as_the_stubs_labels(tmp_path, capsys):
    """The ONNX Model Zoo's files take one example (an input of shape [1, features]): the stub's
    label is read from the model run on one random example instead of being a guess."""
    m = mlp(5, 6, 4, softmax=True)
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1
    onnx.save_model(m, str(tmp_path / "zoo.onnx"))
    assert _from_onnx(tmp_path / "zoo.onnx", tmp_path / "bundle") == 0
    assert "did not run on random examples" not in capsys.readouterr().err
    assert "'y': ('int64', (), 4)" in (tmp_path / "bundle" / "task.py").read_text()


def test_a_model_exported_at_a_batch_of_four_runs_on_four_examples_for_the_stubs_labels(tmp_path, capsys):
    """``torch.onnx.export(model, args, path)`` without dynamic shapes fixes the batch the example
    args had: the model that reads the stub's labels off it is given that many examples."""
    m = mlp(5, 6, 4)
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 4
    onnx.save_model(m, str(tmp_path / "fixed.onnx"))
    assert _from_onnx(tmp_path / "fixed.onnx", tmp_path / "bundle") == 0
    assert "did not run on random examples" not in capsys.readouterr().err
    assert "'y': ('int64', (), 4)" in (tmp_path / "bundle" / "task.py").read_text()


def test_the_last_step_of_a_sequence_read_by_a_gemm_trains_on_onnxruntime_1_15(tmp_path, capsys):
    """A recurrent model's ``h[:, -1]`` into its output layer (Gather on axis 1 of a scalar index, then
    Gemm): the gradient brings no axis to the front, and a Transpose of perm [0, 1] after the Gemm
    was fused by onnxruntime 1.15's GemmTransposeFusion as if it swapped the axes (the ScatterND after
    it refused its updates' shape, on that release alone): the plan writes no such Transpose."""
    rng = np.random.default_rng(0)
    net = model(
        [
            helper.make_node("Mul", ["x", "scale"], ["h"]),  # [N, T, H]: a trained weight before the Gather
            helper.make_node("Gather", ["h", "last"], ["h_last"], axis=1),  # [N, H]
            helper.make_node("Gemm", ["h_last", "w", "b"], ["logits"], transB=1),
        ],
        [helper.make_tensor_value_info("x", F, ["N", 3, 5])],
        [helper.make_tensor_value_info("logits", F, ["N", 4])],
        {
            "scale": np.ones(5, np.float32),
            "last": np.array(-1, np.int64),
            "w": rng.normal(size=(4, 5)).astype(np.float32),
            "b": np.zeros(4, np.float32),
        },
    )
    path = tmp_path / "last_step.onnx"
    path.write_bytes(net.SerializeToString())
    out = tmp_path / "bundle"
    assert main(["plan", "from-onnx", str(path), "--label", "y", "--runtimes", "1.15.1", "-o", str(out)]) == 0
    plan = load_plan((out / "last_step" / "versions" / "1.15.1.fedplan").read_bytes())
    transposes = [n for n in onnx.ModelProto.FromString(plan.work).graph.node if n.op_type == "Transpose"]
    assert all(list(a.ints) != list(range(len(a.ints))) for n in transposes for a in n.attribute if a.name == "perm")
    capsys.readouterr()
    assert main(["plan", "test", str(out)]) == 0, capsys.readouterr()
    assert "last_step: passed" in capsys.readouterr().out


def test_a_language_models_stub_draws_token_ids_over_its_whole_vocabulary(tmp_path, capsys):
    """A tiny GPT-2 as the dynamo exporter writes it (tokens read by a Shape and a Reshape before
    the embedding's Gather): the stub's random tokens take every id of its 200-word vocabulary, not
    the two that [0, 2) gave, so plan test compares the releases over the whole embedding."""
    from .test_exported_models import unpacked

    assert _from_onnx(unpacked("gpt2.fresh.dynamo.onnx.gz"), tmp_path / "bundle", "--name", "gpt") == 0
    stub = (tmp_path / "bundle" / "task.py").read_text()
    assert re.search(r"'tokens': \('int64', \(\d+,\), 200\)", stub), stub


TWO_HEADS = Path(__file__).with_name("data") / "two_heads.onnx"  # torch's export of (logits [N, 3], features [N, 16])
AUX_FIRST = Path(__file__).with_name("data") / "aux_first.onnx"  # (aux_loss [], logits [N, 3])


def test_a_model_with_two_predictions_is_refused_in_one_line_listing_them_until_output_names_one(tmp_path, capsys):
    """Two float outputs with a batch and a class axis: which the label is compared with is the
    person's to say; the plan, the stub and the plan its rebuild makes read the one named."""
    for out in (tmp_path / "b", tmp_path / "two.fedplan"):
        assert _from_onnx(TWO_HEADS, out, "--runtimes", "1.31.1") == 2
        assert capsys.readouterr().err == (
            "fedfleet plan from-onnx: the model has 2 outputs (logits float32 [N, 3], features float32 [N, 16]); "
            "give --output with the name of the one the loss reads\n"
        )
        assert not out.exists()
    assert _from_onnx(TWO_HEADS, tmp_path / "b", "--runtimes", "1.31.1", "--output", "logit") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--output 'logit' names no tensor of the model's outputs (logits" in err
    bundle = tmp_path / "b"
    assert _from_onnx(TWO_HEADS, bundle, "--runtimes", "1.31.1", "--output", "features", "--loss", "mse") == 0
    printed = capsys.readouterr().out
    assert "body.weight" in printed and "head.weight" not in printed  # the features' layers alone train
    assert "    output='features',  # the model output the loss reads\n" in (bundle / "task.py").read_text()
    assert "'y': ('float32', (16,))" in (bundle / "task.py").read_text()  # labels of the features' shape
    assert main(["plan", "build", str(bundle / "task.py"), "-o", str(tmp_path / "again")]) == 0
    assert _manifest(bundle, "two_heads")["plan"] == _manifest(tmp_path / "again", "two_heads")["plan"]
    assert _from_onnx(TWO_HEADS, tmp_path / "two.fedplan", "--output", "logits") == 0
    plan = load_plan((tmp_path / "two.fedplan").read_bytes())
    assert sorted(plan.weight_names) == ["body.bias", "body.weight", "head.bias", "head.weight"]


def test_the_only_float_output_with_a_batch_axis_is_the_prediction_and_said_to_be(tmp_path, capsys):
    """(aux_loss, logits): a scalar before the logits, which the first float output would have been;
    the logits are chosen, in a printed line, and written into the stub; the Python API alike."""
    from emulator.toolchain import bundle_from_onnx
    from emulator.toolchain.tasks import TaskError

    assert _from_onnx(AUX_FIRST, tmp_path / "b", "--runtimes", "1.31.1") == 0
    printed = capsys.readouterr().out
    assert printed.startswith(
        "the model has 2 outputs (aux_loss float32 [], logits float32 [N, 3]): the loss reads 'logits', the only "
        "float one with a batch axis and a class axis (--output picks another)\n"
    )
    assert "'y': ('int64', (), 3)" in (tmp_path / "b" / "task.py").read_text()  # three classes: the logits'
    assert "output='logits'" in (tmp_path / "b" / "task.py").read_text()
    said: list[str] = []
    made = bundle_from_onnx(
        TWO_HEADS, tmp_path / "api", label="y", output="logits", runtimes=["1.31.1"], say=said.append
    )
    assert made.trainable.keys() == {"body.weight", "body.bias", "head.weight", "head.bias"}
    assert not any("outputs" in line for line in said)
    with pytest.raises(TaskError, match=r"the model has 2 outputs \(logits float32 \[N, 3\], features"):
        bundle_from_onnx(TWO_HEADS, tmp_path / "api2", label="y", runtimes=["1.31.1"])


def test_a_classifier_exported_with_its_argmax_trains_the_logits_its_output_names(tmp_path, capsys):
    """A model whose only output is the ArgMax of its logits: refused in one line naming
    ``--output``; ``--output logits`` (a tensor inside the graph, as a Task's ``output=`` may name)
    makes the bundle, its stub's label drawn over the logits' 3 classes, the weights beside the
    model in a data file read for it; the stub builds the same plan again."""
    m = mlp(6, 5, 3)
    m.graph.node.append(helper.make_node("ArgMax", ["logits"], ["label"], axis=1, keepdims=0))
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info("label", onnx.TensorProto.INT64, ["N"]))
    (tmp_path / "export").mkdir()
    path = tmp_path / "export" / "argmax.onnx"
    onnx.save_model(m, str(path), save_as_external_data=True, location="argmax.onnx.data", size_threshold=0)
    assert _from_onnx(path, tmp_path / "refused") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "before ArgMax" in err and "--output" in err
    bundle = tmp_path / "bundle"
    assert _from_onnx(path, bundle, "--output", "logits") == 0, capsys.readouterr().err
    assert "warning" not in capsys.readouterr().err
    stub = (bundle / "task.py").read_text()
    assert "'y': ('int64', (), 3)" in stub and "output='logits'," in stub
    assert main(["plan", "build", str(bundle / "task.py"), "-o", str(tmp_path / "again")]) == 0
    assert _manifest(bundle, "argmax")["plan"] == _manifest(tmp_path / "again", "argmax")["plan"]


def test_the_stubs_report_window_grows_with_the_checkpoint(tmp_path, capsys):
    """A stub's rounds kept the default report window of 60 s whatever the model: every report of
    a ResNet-50 (a 98 MiB checkpoint, a session of 70 to 110 s) came late. The stub now sets a
    window of 60 s and 3 s per MiB of weights, which the bundle's manifest and a deploy carry."""
    from emulator.toolchain.model_bundle import report_timeout_for
    from server_stub.rounds import MAX_TIMEOUT_S

    assert report_timeout_for(0) == 60.0
    assert report_timeout_for(102_467_205) == 354.0  # ResNet-50's checkpoint
    assert report_timeout_for(1 << 40) == MAX_TIMEOUT_S
    wide = mlp(5, 20_000, 4)  # 180,084 weights, 0.7 MiB
    onnx.save_model(wide, str(tmp_path / "wide.onnx"))
    assert _from_onnx(tmp_path / "wide.onnx", tmp_path / "bundle", "--name", "wide") == 0, capsys.readouterr().err
    weights = 4 * sum(int(np.prod(t.dims)) for t in wide.graph.initializer)
    window = _manifest(tmp_path / "bundle", "wide")["round_config"]["report_timeout_s"]
    assert window == report_timeout_for(weights) == 63.0
    assert "rounds=RoundConfig(report_timeout_s=63.0)" in (tmp_path / "bundle" / "task.py").read_text()
