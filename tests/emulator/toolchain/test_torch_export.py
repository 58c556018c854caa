"""``fedfleet plan from-torch`` and ``from_torch``: a PyTorch module exported so that it trains right,
then written as ``plan from-onnx`` writes a bundle. torch is an optional extra: the default tests
never import it (they check what a machine without it is told); the test of the real export is
marked slow and runs only where torch is installed (``pip install 'fedfleet[torch]'``)."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import numpy_helper

from emulator.cli.commands import main
from emulator.toolchain.tasks import TaskError
from emulator.toolchain.torch_export import (
    TorchInput,
    dynamic_batch,
    export_failure,
    export_mismatch,
    parse_input,
)

FACTORY = '''
import torch

class Net(torch.nn.Module):
    """Conv-BatchNorm twice, LayerNorm, Dropout and zero biases: what a default export loses or merges."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        self.conv2, self.bn2 = torch.nn.Conv2d(4, 6, 3, padding=1), torch.nn.BatchNorm2d(6)
        self.ln, self.drop, self.fc = torch.nn.LayerNorm(96), torch.nn.Dropout(0.25), torch.nn.Linear(96, 10)
        with torch.no_grad():
            for layer in (self.conv1, self.conv2, self.fc):
                layer.bias.zero_()

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        x = self.ln(torch.flatten(torch.relu(self.bn2(self.conv2(x))), 1))
        return self.fc(self.drop(x))


def make_cnn():
    torch.manual_seed(0)
    return Net()
'''


@given(
    name=st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True),
    shape=st.lists(st.integers(1, 64), max_size=4),
    dtype=st.sampled_from(["float32", "float16", "int64", "int32", "bool"]),
)
def test_an_input_spec_reads_back_as_written(name, shape, dtype):
    spec = f"{name}:{'x'.join(map(str, shape))}:{dtype}"
    assert parse_input(spec) == TorchInput(name, tuple(shape), dtype)
    assert parse_input(spec.rsplit(":", 1)[0]).dtype == "float32"  # the default


@pytest.mark.parametrize("spec", ["x", "x:1,28,28", "x:0x3", "x:3:notadtype", ":3", "x:3:float32:extra"])
def test_a_malformed_input_spec_is_refused_with_an_example(spec):
    with pytest.raises(TaskError, match="--input"):
        parse_input(spec)


def test_the_batch_axis_follows_forwards_signature_one_entry_per_argument_or_one_tuple_for_star_args():
    """A wrapper whose ``forward(*inputs)`` passes them on (around a transformers model, to return
    its logits) takes one tuple of shapes: one entry per input made torch.export refuse every such
    module as a structure mismatch, and the export fell back to the classic exporter."""

    class Named:
        def forward(self, input_ids, attention_mask=None):
            return input_ids

    class Wrapper:
        def forward(self, *inputs):
            return inputs[0]

    assert dynamic_batch(Named(), 2, "N") == ({0: "N"}, {0: "N"})
    assert dynamic_batch(Wrapper(), 2, "N") == (({0: "N"}, {0: "N"}),)
    assert dynamic_batch(Wrapper(), 1, "N") == (({0: "N"},),)


def test_a_model_returning_a_mapping_is_exported_as_the_value_the_loss_reads():
    """A transformers model returns an output object (a mapping) holding, besides its logits, a
    key-value cache no exporter can return: it is traced through a view of it whose forward returns
    the logits alone, sharing its weights and submodules, so that the export names them as torch does."""
    from emulator.toolchain.torch_export import _one_output

    class LanguageModel:
        def __init__(self):
            self.weights = {"lm_head.weight": np.ones((3, 2))}

        def forward(self, tokens, mask=None):
            logits = self.weights["lm_head.weight"][tokens]
            return {"logits": logits, "past_key_values": object(), "hidden": logits + 1}

    model = LanguageModel()
    view = _one_output(model, "hidden")
    hidden = view.forward(np.array([0, 2]))
    assert hidden.shape == (2, 2) and (hidden == 2).all()
    assert isinstance(view, LanguageModel) and view.weights is model.weights
    assert dynamic_batch(view, 1, "N") == (({0: "N"},),)
    assert model.forward(np.array([1]))["past_key_values"] is not None  # the model itself is unchanged


def _batch(*shape, dtype="float32"):
    return np.zeros((2, *shape), dtype=dtype)  # the trace's batch of 2


class _Cache:
    """A key-value cache object, as transformers' DynamicCache: no tensor."""


GOOGLENET = collections.namedtuple("GoogLeNetOutputs", ["logits", "aux_logits2", "aux_logits1"])


def test_of_several_values_forward_returns_the_loss_reads_the_one_named_or_the_only_prediction():
    """``--output`` picks by name or index; without it, the only float tensor with a batch and a
    class axis is taken and said to be; several such are refused in one line listing them all."""
    from emulator.toolchain.torch_export import forward_choice, forward_outputs

    googlenet = forward_outputs(GOOGLENET(_batch(5), _batch(5), _batch(5)))
    with pytest.raises(TaskError) as refused:
        forward_choice(googlenet, None, loss="cross_entropy")
    assert str(refused.value) == (
        "forward returns 3 values (logits float32 [N, 5], aux_logits2 float32 [N, 5], aux_logits1 float32 [N, 5]); "
        "give --output with the index or name of the one the loss reads"
    )
    assert forward_choice(googlenet, "logits", loss="cross_entropy") == (0, "logits", None)
    assert forward_choice(googlenet, 2, loss="cross_entropy") == (2, "aux_logits1", None)
    with pytest.raises(TaskError, match=r"--output 'aux' names no tensor forward returns \(logits float32"):
        forward_choice(googlenet, "aux", loss="cross_entropy")
    language_model = forward_outputs({"logits": _batch(8, 50), "past_key_values": _Cache()})
    key, name, line = forward_choice(language_model, None, loss="cross_entropy")
    assert (key, name) == ("logits", "logits") and line == (
        "forward returns 2 values (logits float32 [N, 8, 50], past_key_values (_Cache)): the loss reads 'logits', "
        "the only float one with a batch axis and a class axis (--output picks another)"
    )
    with pytest.raises(TaskError, match="names no tensor"):
        forward_choice(language_model, "past_key_values", loss="cross_entropy")
    with_aux_loss = forward_outputs((np.float32(0.5), _batch(3)))  # (aux_loss, logits)
    assert forward_choice(with_aux_loss, None, loss="mse")[:2] == (1, "1")
    with pytest.raises(TaskError, match=r"forward returns 2 values \(0 float32 \[N, 3\], 1 float32 \[N, 4, 16\]\)"):
        forward_choice(forward_outputs((_batch(3), _batch(4, 16))), None, loss="cross_entropy")
    ids = forward_outputs((_batch(3), _batch(dtype="int64")))  # (scores, predicted ids)
    assert forward_choice(ids, None, loss="binary_cross_entropy")[:2] == (0, "0")
    assert forward_outputs(_batch(3)) is None  # one tensor: nothing to choose


def test_an_export_that_computes_something_else_than_the_module_is_noted_in_one_line(tmp_path):
    """The module's outputs against the exported file's on the same examples: float32 rounding
    passes, a different computation (an exporter's wrong trace) is named with how far off it is."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"]), helper.make_node("Shape", ["x"], ["n"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3]),
         helper.make_tensor_value_info("n", TensorProto.INT64, [2])],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])],
    )  # fmt: skip
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    x = np.array([[1.0, -2.0, 3.0], [0.5, 0.25, -4.0]], dtype=np.float32)
    shape = np.array([2, 3], dtype=np.int64)
    assert export_mismatch(path, {"x": x}, [2 * x * (1 + 1e-6), shape]) is None
    off = 2 * x
    off[1, 2] += 0.08  # 1e-2 of the largest output, 8
    note = export_mismatch(path, {"x": x}, [off, np.zeros(2, np.int64)])
    assert note is not None and "'y'" in note and "1.0e-02" in note and "\n" not in note
    broken = export_mismatch(path, {"x": x.astype(np.float64)}, [2 * x])
    assert broken is not None and broken.startswith("the exported model did not run in onnxruntime")


def test_an_export_that_onnxruntimes_optimizer_crashes_on_is_compared_as_written():
    """nn.EmbeddingBag through the dynamo exporter (``data/make_embedding_bag.py``): a Loop over the
    bags building a sequence, on which onnxruntime 1.32's constant folding ended the process with a
    segmentation fault (``plan from-torch`` with it); the file itself runs and is compared."""
    path = Path(__file__).with_name("data") / "embedding_bag.onnx"
    weights = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
    ids = np.array([[1, 2, 2, 5], [0, 3, 4, 1], [5, 5, 5, 0]], dtype=np.int64)
    logits = weights["bag.weight"][ids].mean(1) @ weights["fc.weight"].T + weights["fc.bias"]
    assert export_mismatch(path, {"ids": ids}, [logits]) is None
    note = export_mismatch(path, {"ids": ids}, [logits + 1])
    assert note is not None and note.startswith("the exported model's 'logits' differs")


def test_a_failed_export_says_its_root_cause_in_one_line_and_the_way_round_it():
    # the dynamo exporter wraps what failed: its own first line names only the step, in colour
    class ConversionError(Exception):
        pass

    try:
        try:
            raise ValueError(
                "Cannot view a tensor with shape torch.Size([s23, 8, 4, 8]) as (s23, 8, 32)!\nWhile executing"
            )
        except ValueError as inner:
            raise ConversionError(
                "Failed to decompose the FX graph. \x1b[96mThis is step 2/3\x1b[0m. Next steps:\n- Create an issue"
            ) from inner
    except ConversionError as exc:
        message = export_failure(exc)
    assert "\n" not in message and "\x1b" not in message
    assert message.startswith("torch.onnx.export failed: ValueError: Cannot view a tensor")
    assert "TrainingMode.PRESERVE" in message and "plan from-onnx" in message
    # without a cause, the error itself
    assert export_failure(RuntimeError("unsupported op")).startswith(
        "torch.onnx.export failed: RuntimeError: unsupported op;"
    )


def test_from_torch_without_torch_says_in_one_line_to_install_the_torch_extra(tmp_path, monkeypatch, capsys):
    (tmp_path / "models.py").write_text(FACTORY)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError, installed or not
    args = [
        "plan",
        "from-torch",
        f"{tmp_path / 'models.py'}:make_cnn",
        "--input",
        "x:1x8x8",
        "--label",
        "y",
        "-o",
        str(tmp_path / "bundle"),
    ]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'fedfleet[torch]'" in err and "Traceback" not in err
    assert not (tmp_path / "bundle").exists()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_from_torch_makes_a_bundle_whose_sgd_step_is_torch_autograds(tmp_path, monkeypatch, capsys):
    """The step of the bundle's plan from its initial checkpoint, with the Dropout mask the plan drew,
    against torch's SGD step of the module: every parameter and running statistic within float32 noise."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    import onnx
    import onnxruntime as ort

    from device_runtime.checkpoint import decode_checkpoint
    from device_runtime.plan import load_plan

    (tmp_path / "models.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    assert (
        main(
            [
                "plan",
                "from-torch",
                "models:make_cnn",
                "--input",
                "x:1x8x8",
                "--label",
                "y",
                "--lr",
                "0.1",
                "--runtimes",
                "1.31.1",
                "-o",
                "bundle",
            ]
        )
        == 0
    ), capsys.readouterr().err
    printed = capsys.readouterr()
    assert "looks exported in eval mode" not in printed.err and "inputs: x ['N', 1, 8, 8] float32" in printed.out
    model = onnx.load(str(tmp_path / "bundle" / "model.onnx"))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("BatchNormalization") == 2 and [
        len(n.input) for n in model.graph.node if n.op_type == "Dropout"
    ] == [2]
    sys.path.insert(0, str(tmp_path))
    try:
        from models import make_cnn
    finally:
        sys.path.remove(str(tmp_path))
    net = make_cnn()
    plan = load_plan((tmp_path / "bundle" / "make_cnn" / "plan.fedplan").read_bytes())
    start = decode_checkpoint((tmp_path / "bundle" / "make_cnn" / "initial.ckpt").read_bytes())
    state = {k: v.numpy() for k, v in net.state_dict().items() if not k.endswith("num_batches_tracked")}
    assert set(state) <= set(start) and all(np.array_equal(start[k], v) for k, v in state.items())  # its own weights

    work = onnx.ModelProto.FromString(plan.work)
    (mask,) = [n.output[1] for n in work.graph.node if n.op_type == "Dropout"]
    work.graph.output.append(onnx.helper.make_tensor_value_info(mask, onnx.TensorProto.BOOL, None))
    rng = np.random.default_rng(1)
    batch = {"x": rng.normal(size=(8, 1, 8, 8)).astype(np.float32), "y": rng.integers(0, 10, 8)}
    feeds = {**{w: start[w] for w in plan.weight_names}, **{g: batch[e] for g, e in plan.device.inputs.items()}}
    values = ort.InferenceSession(work.SerializeToString()).run([*plan.weight_outputs, mask], feeds)
    stepped, drawn = dict(zip(plan.weight_names, values)), values[-1].astype(np.float32)

    class Masked(torch.nn.Module):  # torch's Dropout with the plan's mask
        def forward(self, x):
            return x * torch.from_numpy(drawn) / 0.75

    net.drop = Masked()
    net.train()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    torch.nn.functional.cross_entropy(net(torch.from_numpy(batch["x"])), torch.from_numpy(batch["y"])).backward()
    optimizer.step()
    for name, value in net.state_dict().items():
        if not name.endswith("num_batches_tracked"):
            np.testing.assert_allclose(stepped[name], value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def _plan_step(bundle, task: str, features: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    """One step of the bundle's plan from its initial checkpoint on one batch: the stepped weights."""
    import onnxruntime as ort

    from device_runtime.checkpoint import decode_checkpoint
    from device_runtime.plan import load_plan

    plan = load_plan((bundle / task / "plan.fedplan").read_bytes())
    start = decode_checkpoint((bundle / task / "initial.ckpt").read_bytes())
    feeds = {w: start[w] for w in plan.weight_names}
    for graph_input, example in plan.device.inputs.items():
        feeds[graph_input] = labels if example == "y" else features
    session = ort.InferenceSession(onnx.ModelProto.FromString(plan.work).SerializeToString())
    return dict(zip(plan.weight_names, session.run(plan.weight_outputs, feeds)))


def _import_factory(folder, module: str, factory: str):
    sys.path.insert(0, str(folder))
    try:
        return getattr(__import__(module), factory)
    finally:
        sys.path.remove(str(folder))


def _torch_stepped(folder, module: str, factory: str, ids: np.ndarray, labels: np.ndarray, lr: float = 0.5):
    """The factory's module after one torch SGD step (mean cross-entropy) on the batch: what the
    bundle's plan step is held to."""
    import torch

    net = _import_factory(folder, module, factory)()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    torch.nn.functional.cross_entropy(net(torch.from_numpy(ids)), torch.from_numpy(labels)).backward()
    optimizer.step()
    return net


EMBEDDING_FACTORY = '''
import torch

class Bag(torch.nn.Module):
    """Token ids to a class: an embedding whose row 0 pads, a float buffer that scales it and a
    parameter whose requires_grad is off that shifts it, none of which torch trains (a rotary
    embedding's inv_freq is such a buffer, Whisper's position table such a parameter)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(12, 4, padding_idx=0)
        self.register_buffer("scale", torch.tensor([0.5, 2.0, 1.0, 1.5]), persistent=False)
        self.shift = torch.nn.Parameter(torch.tensor([0.1, -0.2, 0.3, 0.0]), requires_grad=False)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, ids):
        return self.fc((self.emb(ids) * self.scale + self.shift).mean(dim=1))


def make_bag():
    torch.manual_seed(0)
    return Bag()
'''


@pytest.mark.slow
def test_from_torch_trains_no_embedding_padding_row_buffer_or_frozen_parameter_as_torch_does(
    tmp_path, monkeypatch, capsys
):
    pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    (tmp_path / "bag.py").write_text(EMBEDDING_FACTORY)  # not models.py: the other test imports that name
    monkeypatch.chdir(tmp_path)
    args = ["plan", "from-torch", "bag:make_bag", "--input", "ids:5:int64", "--label", "y", "--lr", "0.5"]
    assert main([*args, "--runtimes", "1.31.1", "-o", "bundle"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "no gradient reaches row 0 of emb.weight" in printed
    task = (tmp_path / "bundle" / "task.py").read_text()
    assert "frozen_rows={'emb.weight': (0,)}" in task and "frozen=('scale', 'shift')" in task
    ids = np.array([[3, 4, 0, 0, 0], [5, 0, 0, 0, 0]], dtype=np.int64)  # padded with 0
    labels = np.array([1, 2])
    stepped = _plan_step(tmp_path / "bundle", "make_bag", ids, labels)
    net = _torch_stepped(tmp_path, "bag", "make_bag", ids, labels)
    # neither the buffer nor the frozen parameter is a plan weight: they stay constants of the plan
    assert set(stepped) == set(net.state_dict()) - {"shift"}
    state = net.state_dict()
    for name, value in stepped.items():
        np.testing.assert_allclose(value, state[name].numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


BAGS_FACTORY = '''
import torch

class Bags(torch.nn.Module):
    """Bags of token ids to a class: nn.EmbeddingBag's three modes, row 0 padding in two of them,
    the sum's rows weighted per token by a trained gate."""

    def __init__(self):
        super().__init__()
        self.mean = torch.nn.EmbeddingBag(12, 4, mode="mean", padding_idx=0)
        self.max = torch.nn.EmbeddingBag(12, 4, mode="max", padding_idx=0)
        self.sum = torch.nn.EmbeddingBag(12, 4, mode="sum")
        self.gate = torch.nn.Linear(1, 1)
        self.fc = torch.nn.Linear(12, 3)

    def forward(self, ids):
        weights = torch.sigmoid(self.gate(ids.to(torch.float32).unsqueeze(-1))).squeeze(-1)
        bags = [self.mean(ids), self.max(ids), self.sum(ids, per_sample_weights=weights)]
        return self.fc(torch.cat(bags, dim=1))


def make_bags():
    torch.manual_seed(0)
    return Bags()
'''


@pytest.mark.slow
def test_from_torch_trains_an_embedding_bag_of_one_bag_per_row_as_torch_does(tmp_path, monkeypatch, capsys):
    """Both exporters write nn.EmbeddingBag as a Loop over the bags, which a plan cannot unroll with
    the batch known at run time only: bags of one length (a 2-D input) are exported as the rows
    gathered and reduced, and the plan takes torch's step, padding rows and empty bags included."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    (tmp_path / "bags.py").write_text(BAGS_FACTORY)
    monkeypatch.chdir(tmp_path)
    args = ["plan", "from-torch", "bags:make_bags", "--input", "ids:5:int64", "--label", "y", "--lr", "0.5"]
    assert main([*args, "--runtimes", "1.31.1", "-o", "bundle"]) == 0, capsys.readouterr().err
    assert "Loop" not in {n.op_type for n in onnx.load(str(tmp_path / "bundle" / "model.onnx")).graph.node}
    ids = np.array([[3, 4, 0, 3, 0], [5, 11, 2, 7, 1], [0, 0, 0, 0, 0]], dtype=np.int64)  # an empty bag
    labels = np.array([1, 2, 0])
    stepped = _plan_step(tmp_path / "bundle", "make_bags", ids, labels)
    net = _torch_stepped(tmp_path, "bags", "make_bags", ids, labels)
    assert set(stepped) == set(net.state_dict())
    for name, value in net.state_dict().items():
        np.testing.assert_allclose(stepped[name], value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


PADDED_FACTORY = '''
import torch

class Padded(torch.nn.Module):
    """Token ids whose 0 pads, through nn.TransformerEncoder with src_key_padding_mask: in eval mode
    its fast path fails on a batch of padding alone, which zeros are."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(12, 8)
        layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 1)
        self.fc = torch.nn.Linear(8, 3)

    def forward(self, ids):
        padding = ids == 0
        kept = (~padding).unsqueeze(-1).to(torch.float32)
        hidden = self.encoder(self.emb(ids), src_key_padding_mask=padding) * kept
        return self.fc(hidden.sum(1) / kept.sum(1).clamp(min=1.0))


def make_padded():
    torch.manual_seed(0)
    return Padded()
'''


@pytest.mark.slow
def test_from_torch_traces_integer_inputs_as_ones_where_the_module_fails_on_zeros(tmp_path, monkeypatch, capsys):
    """The trace's integer examples are zeros, all padding to a model whose padding id is 0; where
    its forward fails on them, ones are traced instead, and the plan takes torch's step."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    (tmp_path / "padded.py").write_text(PADDED_FACTORY)
    monkeypatch.chdir(tmp_path)
    args = ["plan", "from-torch", "padded:make_padded", "--input", "ids:5:int64", "--label", "y", "--lr", "0.5"]
    assert main([*args, "--runtimes", "1.31.1", "-o", "bundle"]) == 0, capsys.readouterr().err
    ids = np.array([[3, 4, 0, 0, 0], [5, 11, 2, 7, 1], [6, 0, 9, 0, 0]], dtype=np.int64)
    labels = np.array([1, 2, 0])
    stepped = _plan_step(tmp_path / "bundle", "make_padded", ids, labels)
    net = _torch_stepped(tmp_path, "padded", "make_padded", ids, labels)
    assert set(stepped) == set(net.state_dict())
    for name, value in net.state_dict().items():
        np.testing.assert_allclose(stepped[name], value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


PROJECTED_LSTM_FACTORY = """
import torch


class Tagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 8)
        self.rnn = torch.nn.LSTM(8, 16, num_layers=2, batch_first=True, proj_size=4)
        self.head = torch.nn.Linear(4, 5)

    def forward(self, ids):
        return self.head(self.rnn(self.emb(ids))[0][:, -1])


def make():
    return Tagger()
"""


@pytest.mark.slow
def test_from_torch_refuses_an_lstm_with_projections_in_one_line_naming_it_and_the_way_round(
    tmp_path, monkeypatch, capsys
):
    """torch's dynamo exporter leaves out an nn.LSTM's weight_hr (the plan failed in onnxruntime,
    or its release rewrite was invalid ONNX) and the classic one refuses it: from-torch names the
    module before exporting, and writes nothing."""
    pytest.importorskip("torch")
    (tmp_path / "projected.py").write_text(PROJECTED_LSTM_FACTORY)
    monkeypatch.chdir(tmp_path)
    code = main(["plan", "from-torch", "projected:make", "--input", "ids:6:int64", "--label", "y", "-o", "bundle"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "nn.LSTM 'rnn' has proj_size=4" in err and "give it proj_size=0" in err
    assert not (tmp_path / "bundle").exists()


MAX_NORM_FACTORY = """
import torch


class Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.words = torch.nn.Embedding(50, 8, max_norm=1.0)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, ids):
        return self.head(self.words(ids).mean(1))


def make():
    return Bag()
"""


@pytest.mark.slow
def test_from_torch_refuses_an_embedding_with_max_norm_in_one_line_naming_it_and_the_way_round(
    tmp_path, monkeypatch, capsys
):
    """An nn.Embedding with max_norm renormalizes the rows it reads in its weight, in place: the
    dynamo exporter reads the weight through a detach (the plan trained the head alone, 36 of 436
    values, without a word) and the classic one leaves the renormalization out. from-torch names
    the module before exporting, and writes nothing."""
    pytest.importorskip("torch")
    (tmp_path / "bag.py").write_text(MAX_NORM_FACTORY)
    monkeypatch.chdir(tmp_path)
    code = main(["plan", "from-torch", "bag:make", "--input", "ids:6:int64", "--label", "y", "-o", "bundle"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "nn.Embedding 'words' has max_norm=1" in err and "give it max_norm=None" in err
    assert not (tmp_path / "bundle").exists()


UNEXPORTED_TRAINING_FACTORY = """
import torch


class Counted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.words = torch.nn.Embedding(50, 8, scale_grad_by_freq=True)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, ids):
        return self.head(self.words(ids).mean(1))


class Normed(torch.nn.Module):
    def __init__(self, hook):
        super().__init__()
        normed = torch.nn.utils.spectral_norm if hook else torch.nn.utils.parametrizations.spectral_norm
        self.body = torch.nn.Sequential(torch.nn.Embedding(50, 12), normed(torch.nn.Linear(12, 8)))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, ids):
        return self.head(torch.relu(self.body(ids)).mean(1))


def counted():
    return Counted()


def normed():
    return Normed(hook=False)


def normed_hook():
    return Normed(hook=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "factory, says",
    [
        ("counted", "nn.Embedding 'words' has scale_grad_by_freq=True"),
        ("normed", "'body.1' (Linear) has spectral_norm on its weight"),
        ("normed_hook", "'body.1' (Linear) has spectral_norm on its weight"),
    ],
)
def test_from_torch_refuses_a_layer_whose_training_step_no_exporter_writes_in_one_line_naming_it(
    tmp_path, monkeypatch, capsys, factory, says
):
    """An nn.Embedding with scale_grad_by_freq (the dynamo exporter leaves the scaling out: the plan took
    another step than torch's, without a word) and a Linear with spectral_norm, as a parametrization
    or as the older hook (its power iteration moves _u and _v in place: the plan's loss was 15% off
    torch's): refused before the export, naming the module, and nothing is written."""
    pytest.importorskip("torch")
    (tmp_path / "layers.py").write_text(UNEXPORTED_TRAINING_FACTORY)
    monkeypatch.chdir(tmp_path)
    code = main(["plan", "from-torch", f"layers:{factory}", "--input", "ids:6:int64", "--label", "y", "-o", "bundle"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert says in err
    assert not (tmp_path / "bundle").exists()


T5_FACTORY = '''
import torch
from transformers import T5Config, T5EncoderModel


class Encoder(torch.nn.Module):
    """transformers' T5 encoder without dropout, mean-pooled to 5 classes: torch.export (torch 2.13)
    cannot trace its attention's view once a Dropout of ratio 0 no longer copies."""

    def __init__(self):
        super().__init__()
        config = T5Config(vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4, dropout_rate=0.0)
        self.t5 = T5EncoderModel(config)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, ids):
        return self.head(self.t5(input_ids=ids).last_hidden_state.mean(dim=1))


def make_t5():
    torch.manual_seed(0)
    return Encoder()
'''


@pytest.mark.slow
def test_from_torch_falls_back_to_the_classic_exporter_and_says_why(tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    pytest.importorskip("transformers")
    (tmp_path / "t5_factory.py").write_text(T5_FACTORY)
    monkeypatch.chdir(tmp_path)
    args = [
        "plan",
        "from-torch",
        "t5_factory:make_t5",
        "--input",
        "ids:6:int64",
        "--label",
        "y",
        "--runtimes",
        "1.31.1",
    ]
    assert main([*args, "-o", "bundle"]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "dynamo exporter failed" in line]
    assert len(warned) == 1 and "exported with the classic one, in training mode" in warned[0]
    ids = np.array([[3, 4, 9, 0, 0, 0], [5, 7, 7, 7, 1, 0]], dtype=np.int64)
    labels = np.array([1, 4])
    stepped = _plan_step(tmp_path / "bundle", "make_t5", ids, labels)
    net = _import_factory(tmp_path, "t5_factory", "make_t5")()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    torch.nn.functional.cross_entropy(net(torch.from_numpy(ids)), torch.from_numpy(labels)).backward()
    optimizer.step()
    params = dict(net.named_parameters())
    assert set(stepped) == set(params)  # the tied embedding once, under the name torch shares
    for name, value in params.items():
        np.testing.assert_allclose(stepped[name], value.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


TWO_INPUTS = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.emb = torch.nn.Linear(6, 3), torch.nn.Embedding(10, 3)

    def forward(self, x, tokens):
        return self.fc(x) + self.emb(tokens).mean(1)


def make_net():
    torch.manual_seed(0)
    return Net()
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_each_input_flag_is_one_argument_of_forward_and_inputs_forward_refuses_are_named(tmp_path, capsys):
    """``--input x:6 --input tokens:4:int64`` gives forward two arguments (a repeated flag kept only
    the last); inputs the module's own forward fails on get one line naming them and what to give,
    not the exporter's advice to export by hand (which would fail the same way)."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    (tmp_path / "models.py").write_text(TWO_INPUTS)
    factory = f"{tmp_path / 'models.py'}:make_net"
    common = ["--label", "y", "--runtimes", "1.31.1"]
    out = tmp_path / "bundle"
    assert (
        main(["plan", "from-torch", factory, "--input", "x:6", "--input", "tokens:4:int64", *common, "-o", str(out)])
        == 0
    )
    printed = capsys.readouterr().out
    assert "x ['N', 6] float32" in printed and "tokens ['N', 4] int64" in printed
    assert (
        main(["plan", "from-torch", factory, "--input", "x:5", "tokens:4:int64", *common, "-o", str(tmp_path / "b")])
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith(
        "fedfleet plan from-torch: the module's forward failed on the --input examples "
        "(x [2, 5] float32, tokens [2, 4] int64): RuntimeError: "
    )
    assert err.endswith(
        "give one --input per argument of forward, in order, each with one example's shape "
        "(without the batch axis) and dtype\n"
    )
    assert len(err.splitlines()) == 1 and not (tmp_path / "b").exists()


VERSIONED = """
import torch


class Versioned(torch.nn.Module):
    '''Reads the version of its state's layout as torchvision's MNASNet does, and raises without it.'''

    _version = 2

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        if local_metadata.get("version") not in (1, 2):
            raise ValueError(f"version should be set to 1 or 2 instead of {local_metadata.get('version')}")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def make_net():
    torch.manual_seed(0)
    return Versioned()
"""


@pytest.mark.slow
def test_a_module_that_reads_its_state_version_when_loaded_is_exported(tmp_path):
    """The module's state is restored after the export with the versions ``state_dict`` keeps beside it
    (``_metadata``): torchvision's MNASNet raised a ValueError without them, a traceback."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    (tmp_path / "models.py").write_text(VERSIONED)
    factory = f"{tmp_path / 'models.py'}:make_net"
    out = tmp_path / "bundle"
    assert (
        main(["plan", "from-torch", factory, "--input", "x:4", "--label", "y", "--runtimes", "1.31.1", "-o", str(out)])
        == 0
    )
    assert any(out.iterdir())


HEADS_FACTORY = '''
import collections

import torch

Outputs = collections.namedtuple("Outputs", ["logits", "aux_logits"])


class WithAux(torch.nn.Module):
    """As torchvision's GoogLeNet and Inception: auxiliary logits besides the logits in training mode
    alone, the logits alone in eval mode."""

    def __init__(self):
        super().__init__()
        self.body, self.bn = torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16)
        self.fc, self.aux = torch.nn.Linear(16, 3), torch.nn.Linear(16, 3)

    def forward(self, x):
        h = torch.relu(self.bn(self.body(x)))
        return Outputs(self.fc(h), self.aux(h)) if self.training else self.fc(h)


class Dict(WithAux):
    def forward(self, x):
        h = torch.relu(self.bn(self.body(x)))
        return {"features": h, "logits": self.fc(h)}


def with_aux():
    torch.manual_seed(0)
    return WithAux()


def with_dict():
    torch.manual_seed(0)
    return Dict()
'''


@pytest.mark.slow
def test_from_torch_exports_the_value_of_forwards_that_output_names_alone(tmp_path, monkeypatch, capsys):
    """Auxiliary logits returned in training mode only, and a dict: refused without ``--output``,
    listing them; with it (a name or an index), the file holds that output alone, under its name,
    and the plan trains no weight of another head."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    (tmp_path / "heads.py").write_text(HEADS_FACTORY)
    monkeypatch.chdir(tmp_path)
    args = ["--input", "x:8", "--label", "y", "--runtimes", "1.31.1"]
    assert main(["plan", "from-torch", "heads:with_aux", *args, "-o", "aux"]) == 2
    assert capsys.readouterr().err == (
        "fedfleet plan from-torch: forward returns 2 values (logits float32 [N, 3], aux_logits float32 [N, 3]); "
        "give --output with the index or name of the one the loss reads\n"
    )
    for factory, output in (("heads:with_aux", "0"), ("heads:with_dict", "logits")):
        assert main(["plan", "from-torch", factory, *args, "--output", output, "-o", "bundle"]) == 0, (
            capsys.readouterr().err
        )
        printed = capsys.readouterr()
        assert "differs from the module's" not in printed.err and "fc.weight" in printed.out
        model = onnx.load(str(tmp_path / "bundle" / "model.onnx"))
        assert [o.name for o in model.graph.output] == ["logits"]
        assert not {i.name for i in model.graph.initializer} & {"aux.weight", "aux.bias"}
