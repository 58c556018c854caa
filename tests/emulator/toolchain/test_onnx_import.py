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
from emulator.cli import main
from emulator.toolchain import SGD, training_plan_from_onnx
from example_store import ExampleSelector

from .models import F, mlp

SELECTOR = ExampleSelector("app:/m")


def _save_with_external_data(m: onnx.ModelProto, folder: Path) -> Path:
    """The dynamo exporter's layout: model.onnx and every tensor in model.onnx.data beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save_model(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=0)
    return path


def _from_onnx(model: Path, out: Path, *extra: str) -> int:
    return main(["plan", "from-onnx", str(model), "--label", "y", "--loss", "cross_entropy", "--batch-size", "4",
                 "-o", str(out), *extra])


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
        training_plan_from_onnx(path.read_bytes(), label="y", loss="cross_entropy", optimizer=SGD(0.1), batch_size=4,
                                example_selector=SELECTOR)
