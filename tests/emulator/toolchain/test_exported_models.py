"""Real architectures, exported by torch's two exporters, take torch autograd's own SGD step.

The fixtures in ``exported/`` (``benchmarks/export_fixtures.py`` makes them; the README there says
how) are ResNet-18, MobileNetV2 and V3-small, ShuffleNetV2, torchvision's and transformers' ViT, BERT,
DistilBERT, ALBERT (one layer's weights at every depth), an LSTM classifier, a GRU next-token model
(also with tied embeddings), a Conv1d text model, and the language models GPT-2 (tied output layer),
Llama (RMSNorm, rotary positions, grouped-query attention, SiLU-gated MLP) and T5 (encoder-decoder,
relative position buckets, one embedding shared three ways) scoring every position, a GPT written in
plain torch around ``F.scaled_dot_product_attention`` (tied output layer), a CNN normalized by GroupNorm
and InstanceNorm (with and without affine parameters), a two-layer bidirectional ``nn.RNN`` averaged over
its unpadded positions (the classic exporter's ONNX ``RNN`` ops), DenseNet (``Concat`` of every layer
before) and ConvNeXt (LayerNorm over channels, depthwise 7x7, layer scale), and of torch.nn's own
layers ``nn.TransformerEncoder`` with a padding mask (its layers copies of one, equal when fresh),
``Conv1d`` and ``Conv3d`` (strided, grouped, depthwise of ``padding="same"`` with dilation; GroupNorm,
InstanceNorm1d and 3d), its activations (PReLU, ELU, Softplus, Mish, GLU, SELU, CELU, ...) and
``torch.topk``, ``torch.sort`` and inverse trigonometric functions, at fixture size, each fresh (zero biases, unit gains: what exporters merge) and perturbed, exported with
the classic exporter (training preserved), the dynamo exporter's default (``optimize=True``) and the
dynamo exporter with ``optimize=False`` (DenseNet and ConvNeXt also without dynamic shapes, their batch
fixed at 4). Beside each, torch's step in float64 from the same values.

Each model goes through what ``fedfleet plan from-onnx`` does (``tasks.onnx_import`` on the loaded
file, the initial weights from its initializers); one step of the plan's work graph runs in
onnxruntime and every parameter and running statistic is compared with torch's by name. Nothing here
imports torch.
"""

from __future__ import annotations

import atexit
import gzip
import json
import shutil
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from device_runtime.executor import make_session
from emulator.toolchain import OnnxTrainingPlan
from emulator.toolchain.tasks import Task, TaskError, onnx_import
from example_store import ExampleSelector

#: Each fixture's step is built once per process (``plan_step``) for both tests that read it: they go
#: to one pytest-xdist worker, or each worker would build the steps of the fixtures it was given.
pytestmark = pytest.mark.xdist_group("test_exported_models")

EXPORTED = Path(__file__).with_name("exported")
MANIFEST = json.loads((EXPORTED / "manifest.json").read_text())
STEPPED = [e for e in MANIFEST["fixtures"] if e["family"] != "dropout" and "refused" not in e]
#: Exports whose plan is refused (``refused``: the words of the refusal).
REFUSED = [e for e in MANIFEST["fixtures"] if "refused" in e]
#: Exports of a fixed batch (``dynamo_static``), and the same module's export with a dynamic one.
STATIC = [e for e in STEPPED if e["exporter"] == "dynamo_static"]
DROPOUT = [e for e in MANIFEST["fixtures"] if e["family"] == "dropout"]
#: The dynamo exporter's optimizer folds BatchNorm into the convolutions (in its inference form):
#: that network is not the module's in training, so its step cannot be torch's (a warning says so).
WITH_BATCH_NORM = ("resnet18", "mobilenet_v2", "mobilenet_v3_small", "shufflenet_v2", "densenet")
#: The dynamo exporter's default, ``optimize=True`` (``dynamo_static``: without dynamic shapes too).
OPTIMIZED = ("dynamo", "dynamo_static")
MATCHED = [e for e in STEPPED if not (e["exporter"] in OPTIMIZED and e["family"] in WITH_BATCH_NORM)]
#: The step's error, relative to the largest change torch made to the tensor (float32 noise: the
#: plan computes in float32, the reference in float64; the tester saw 1e-6..3e-5).
TOLERANCE = 2e-4

#: The default run's twins: one export per family, the exporters and states taking turns (the
#: others run with ``-m slow``).
DEFAULT = {
    "resnet18.fresh.classic",
    "mobilenet_v2.fresh.dynamo_noopt",
    "mobilenet_v3_small.fresh.dynamo",
    "vit.fresh.dynamo",
    "hf_vit.perturbed.classic",
    "bert.fresh.dynamo",
    "distilbert.perturbed.dynamo_noopt",
    "lstm.fresh.dynamo",
    "gru_next_token.perturbed.dynamo_noopt",
    "gru_tied.fresh.dynamo",
    "conv1d_text.perturbed.classic",
    "shufflenet_v2.fresh.classic",
    "albert.perturbed.classic",
    "gpt2.perturbed.dynamo",
    "llama.fresh.dynamo_noopt",
    "t5.perturbed.dynamo_noopt",
    "gpt_sdpa.perturbed.classic",
    "norm_cnn.fresh.dynamo",
    "birnn.perturbed.classic",
    "densenet.fresh.classic",
    "densenet.perturbed.dynamo_static",
    "convnext.fresh.dynamo",
    "convnext.perturbed.dynamo_static",
    "nn_transformer_encoder.fresh.dynamo",
    "conv_nd.perturbed.classic",
    "activations.fresh.dynamo_noopt",
    "ranked_trig.perturbed.classic",
    "dropout.classic",
    "dropout_inplace.dynamo",
}


def _params(entries: list[dict[str, Any]]) -> list[Any]:
    """``entries`` as test parameters, those outside :data:`DEFAULT` marked slow."""
    out = []
    for e in entries:
        name = e["model"].removesuffix(".onnx.gz")
        marks = [] if name in DEFAULT else [pytest.mark.slow]
        out.append(pytest.param(e, id=name, marks=marks))
    return out


@dataclass(frozen=True)
class Reference:
    """torch autograd's step on a family's module (``<family>.<state>.npz``): the batch, the loss,
    and by torch name each parameter and running statistic after it and the error torch's own
    float32 step made on it."""

    parameters: list[str]
    statistics: list[str]  # every float buffer
    tied: list[list[str]]
    reused: list[str]  # parameters of modules called more than once (ALBERT's layer)
    examples: dict[str, np.ndarray]
    loss: float
    after: dict[str, np.ndarray]
    float32_error: dict[str, float]

    @property
    def running(self) -> list[str]:
        """The running statistics (a plan's state); the other float buffers (a rotary embedding's
        ``inv_freq``) torch never changes, and neither does a plan."""
        return [n for n in self.statistics if n.endswith(("running_mean", "running_var"))]

    def torch_name(self, weight: str) -> str:
        """The name torch's ``named_parameters`` gives a plan weight: a parameter the model ties has
        several names, and an exporter may keep any of them (the dynamo exporter keeps the last)."""
        for group in self.tied:
            if weight in group:
                return group[0]
        return weight


@cache
def reference(name: str) -> Reference:
    data = np.load(EXPORTED / name)
    index = json.loads(str(data["index"]))
    shapes = [*index["parameters"], *index["statistics"]]
    ends = np.cumsum([int(np.prod(shape)) for _, shape in shapes])
    pieces = np.split(data["after"], ends[:-1])
    after = {n: piece.reshape(shape) for (n, shape), piece in zip(shapes, pieces)}
    examples = {**{n: data[f"input/{n}"] for n in index["inputs"]}, "y": data["label"]}
    return Reference(
        [n for n, _ in index["parameters"]],
        [n for n, _ in index["statistics"]],
        index["tied"],
        index.get("reused", []),
        examples,
        float(data["loss"]),
        after,
        dict(zip(after, map(float, data["float32_error"]))),
    )


@dataclass(frozen=True)
class Step:
    made: OnnxTrainingPlan
    before: dict[str, np.ndarray]
    after: dict[str, np.ndarray]
    loss: float


@cache
def _unpacked_folder() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="fedfleet-exported-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def unpacked(name: str, folder: Path = EXPORTED) -> Path:
    """The fixture's ONNX file, as the exporter wrote it (the folder keeps it gzipped)."""
    path = _unpacked_folder() / name.removesuffix(".gz")
    if not path.exists():
        path.write_bytes(gzip.decompress((folder / name).read_bytes()))
    return path


def task_for(entry: dict[str, Any], manifest: dict[str, Any] = MANIFEST, folder: Path = EXPORTED) -> Task:
    """The task ``fedfleet plan from-onnx MODEL --label y --lr LR --batch-size 4`` builds (``--loss``
    the entry's ``loss``, cross-entropy by default)."""
    return Task(
        name=entry["model"].removesuffix(".onnx.gz").replace(".", "_"),
        model=unpacked(entry["model"], folder),
        proxy=lambda: None,  # type: ignore[arg-type, return-value]
        hyperparameters={"lr": manifest["lr"]},
        label="y",
        loss=entry.get("loss", "cross_entropy"),
        batch_size=manifest["batch"],
        selector=ExampleSelector("app:/exported"),
    )


def work_step(
    entry: dict[str, Any],
    examples: dict[str, np.ndarray],
    manifest: dict[str, Any] = MANIFEST,
    folder: Path = EXPORTED,
) -> Step:
    """``entry``'s plan as ``fedfleet plan from-onnx`` makes it, and one step of its work graph in
    onnxruntime from the model's own initial weights on ``examples``."""
    task = task_for(entry, manifest, folder)
    made = onnx_import(task._model_source(), task)
    plan = made.plan
    before = task.weights(plan)
    feeds = {**before, **{graph_input: examples[name] for graph_input, name in plan.device.inputs.items()}}
    session = make_session(plan.work)
    values = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    after = {w: values[out] for w, out in zip(plan.weight_names, plan.weight_outputs)}
    return Step(made, before, after, float(values["loss_sum"] / values["count"]))


@cache
def plan_step(model: str) -> Step:
    """One fixture's step on its reference batch, built once per file for every test here."""
    entry = next(e for e in STEPPED if e["model"] == model)
    return work_step(entry, reference(entry["reference"]).examples)


#: A tensor torch barely moves (a BatchNorm's bias or running mean before another BatchNorm: its
#: gradient is zero but for rounding) is compared at this fraction of the largest change torch
#: made to any tensor of the model, since any float32 rounding of it is of that order.
FLOOR = 1e-3


def scales(reference: dict[str, np.ndarray], before: dict[str, np.ndarray]) -> dict[str, float]:
    """Per tensor: the largest change torch's step made to it, at least :data:`FLOOR` of the largest
    change it made to any tensor."""
    changes = {n: float(np.abs(reference[n].astype(np.float64) - before[n]).max(initial=0)) for n in reference}
    floor = FLOOR * max(changes.values(), default=0.0)
    return {n: max(c, floor, 1e-30) for n, c in changes.items()}


def relative_differences(
    ours: dict[str, np.ndarray], reference: dict[str, np.ndarray], before: dict[str, np.ndarray]
) -> dict[str, float]:
    """Per tensor: the largest difference from torch's new value beyond the float32 rounding of the
    values themselves (a tensor of magnitude 10 that moves by 1e-4 cannot agree closer than its last
    bits), over the tensor's :func:`scales`."""
    scale = scales(reference, before)
    out = {}
    for n, ref in reference.items():
        ref64 = ref.astype(np.float64)
        excess = np.abs(ours[n].astype(np.float64) - ref64) - 4 * np.finfo(np.float32).eps * np.abs(ref64)
        out[n] = max(float(excess.max(initial=0)), 0.0) / scale[n]
    return out


@pytest.mark.parametrize("entry", _params(MATCHED))
def test_a_plan_step_matches_torch_autograds_step_for_every_parameter_by_name(entry):
    """The loss, and every parameter and running statistic the plan has under torch's name, as
    torch's float64 step has them, within float32 noise: :data:`TOLERANCE`, or 4 times the error
    of torch's own float32 step on the same model and batch where that is larger (a MobileNet at
    batch 4 normalizes 1x1 feature maps over 4 values: float32 torch lands 1e-2 from float64)."""
    step, ref = plan_step(entry["model"]), reference(entry["reference"])
    assert step.loss == pytest.approx(ref.loss, rel=1e-5)
    torch_name = ref.torch_name
    compared = {w: ref.after[torch_name(w)] for w in step.after if torch_name(w) in ref.after}
    differences = relative_differences(step.after, compared, step.before)
    scale = scales(compared, step.before)
    noise = max(ref.float32_error[torch_name(w)] / scale[w] for w in compared)
    worst = max(differences, key=differences.get)
    assert differences[worst] <= max(TOLERANCE, 4 * noise), (
        f"{worst}: {differences[worst]:.3g} of torch's change (torch float32: {noise:.3g})"
    )
    if entry["exporter"] not in OPTIMIZED:
        assert {torch_name(w) for w in compared} == set(ref.parameters) | set(ref.running)


@pytest.mark.parametrize("entry", _params(STEPPED))
def test_every_parameter_keeps_its_own_weight_and_only_real_ties_are_shared(entry):
    """One plan weight per torch parameter, named as torch names it; a weight the model ties is one
    weight, in the plan's metadata, and so is one that a module called at several places reads
    (ALBERT's layer), listed where the exporter names the calls apart (the classic exporter's
    ``/albert_layers.0_1/`` scopes; the dynamo exporter's name scopes are the module's for every
    call); what the exporter folded or dropped is warned of, by name."""
    step, ref = plan_step(entry["model"]), reference(entry["reference"])
    made = step.made
    tied = {group[0] for group in ref.tied} | (set(ref.reused) if entry["exporter"] == "classic" else set())
    trained = {ref.torch_name(w) for w in made.trainable}
    shared = [{ref.torch_name(w) for w in made.plan.metadata.shared_weights}, {ref.torch_name(w) for w in made.shared}]
    if entry["exporter"] in OPTIMIZED:  # and constants it folded that several modules read (a rotary table)
        shared = [names & set(ref.parameters) for names in shared]
    assert shared == [tied & trained] * 2
    weights = {ref.torch_name(w) for w in made.plan.weight_names}
    lost = [w for w in made.warnings if "folded or dropped" in w]
    if entry["exporter"] not in OPTIMIZED:
        assert trained == set(ref.parameters), "the plan trains other tensors than the module's parameters"
        assert set(ref.running) <= weights
        assert not made.lost and not lost
        return
    # optimize=True: whatever is not a weight of its own was folded or dropped, and said so by name
    missing = {n for n in [*ref.parameters, *ref.running] if n not in weights}
    named = {ref.torch_name(n) for n in made.lost}
    # the program's signature lists every name of a tied weight; one whose module never runs under
    # that name (T5's ``shared``, called as the encoder's and decoder's ``embed_tokens``) is read by
    # no node and taken for folded
    assert missing <= named and named - missing <= {group[0] for group in ref.tied}
    assert bool(missing) == bool(lost)
    if missing:
        assert "optimize=False" in lost[0] and len(lost[0].splitlines()) == 1


@pytest.mark.parametrize("entry", _params(DROPOUT))
def test_the_plans_dropout_drops_at_its_rate_and_scales_what_it_keeps(entry):
    """One example through ``Dropout(p)`` and a linear layer without bias: the weight's gradient is
    zero in exactly the columns of the dropped inputs and ``g x m / (1 - p)`` in all of them (``g``
    the loss's gradient at the logits computed from the kept inputs), so the step shows the mask;
    about ``p`` of 512 inputs are dropped (4.5 standard deviations allowed; the plan's dropout is
    seeded, so the check is deterministic)."""
    p, lr = entry["rate"], MANIFEST["lr"]
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((1, 512)).astype(np.float32), np.array([1])
    step = work_step(entry, {"x": x, "y": y})
    (weight,) = step.made.trainable
    w = step.before[weight].astype(np.float64)
    delta = w - step.after[weight]
    if w.shape[0] == 512:  # the dynamo exporter's optimizer stores the weight transposed
        w, delta = w.T, delta.T
    kept = np.abs(delta).sum(axis=0) > 0
    assert abs((1 - kept.mean()) - p) < 4.5 * np.sqrt(p * (1 - p) / 512), f"dropped {1 - kept.mean():.3f}, not {p}"
    inputs = x[0] * kept / (1 - p)
    logits = w @ inputs
    g = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum() - np.eye(len(logits))[y[0]]
    np.testing.assert_allclose(delta, lr * np.outer(g, inputs), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("entry", _params(STATIC))
def test_a_plan_of_an_export_at_a_fixed_batch_takes_a_short_batch_as_the_dynamic_exports_plan_does(entry):
    """``torch.onnx.export(module, args, path)`` without dynamic shapes fixes the batch of 4 in the file
    (DenseNet's flattening ``Reshape`` to [4, C], written with ``allowzero=1``); the plan takes any
    batch, as a device's short last batch of an epoch needs: on the first 3 examples, the loss and
    step of the same module exported with its batch dynamic (``dynamo``, also ``optimize=True``)."""
    dynamic = next(e for e in STEPPED if e["exporter"] == "dynamo" and e["reference"] == entry["reference"])
    examples = {n: v[:3] for n, v in reference(entry["reference"]).examples.items()}
    fixed, ours = work_step(entry, examples), work_step(dynamic, examples)
    assert fixed.loss == pytest.approx(ours.loss, rel=1e-5)
    scale = max(float(np.abs(ours.after[w] - ours.before[w]).max()) for w in ours.after)
    for w, value in fixed.after.items():
        np.testing.assert_allclose(value, ours.after[w], rtol=1e-4, atol=1e-5 * scale, err_msg=w)


@pytest.mark.parametrize("entry", _params(REFUSED))
def test_an_export_whose_graph_holds_its_fixed_batch_is_refused_in_one_line_naming_the_node(entry):
    """ConvNeXt exported without dynamic shapes: the dynamo exporter writes its pooling's
    ``as_strided`` as a ``Gather`` of indices into the flattened batch of 4, which no other batch
    fits. A plan would fail on a device at its first short batch; it is refused instead, in one line
    naming the node and saying how to export."""
    task = task_for(entry)
    with pytest.raises(TaskError) as refused:
        onnx_import(task._model_source(), task)
    message = str(refused.value)
    assert entry["refused"] in message and "dynamic_shapes" in message and "plan from-torch" in message
    assert len(message.splitlines()) == 1


def test_a_training_export_of_zero_dropouts_draws_no_mask():
    """transformers' ViT keeps its hidden and attention dropout at 0; the classic exporter in training
    mode writes each as an active ``Dropout`` of ratio 0 with a mask output that nothing reads: the
    plan's step runs no Dropout (the same step as without it, drawing no random mask either way)."""
    entry = next(e for e in STEPPED if e["model"] == "hf_vit.perturbed.classic.onnx.gz")
    source = onnx.load_from_string(gzip.decompress((EXPORTED / entry["model"]).read_bytes()))
    dropouts = [n for n in source.graph.node if n.op_type == "Dropout"]
    assert dropouts and all(len(n.output) == 2 and n.output[1] for n in dropouts)
    work = onnx.ModelProto.FromString(plan_step(entry["model"]).made.plan.work)
    assert "Dropout" not in {n.op_type for n in work.graph.node}


#: The exports whose trained weights go back into the model in the default run (ties, folded
#: transposes read again, parameters the dynamo exporter merged, the classic exporter's Identity
#: copies, BatchNorm's statistics, a dilated Conv of SAME padding onnxruntime refuses as exported);
#: the others run with ``-m slow``.
EXPORTED_BACK = {
    "conv_nd.perturbed.classic",
    "gpt2.perturbed.dynamo",
    "t5.perturbed.dynamo_noopt",
    "bert.fresh.dynamo",
    "resnet18.fresh.classic",
    "nn_transformer_encoder.fresh.dynamo",
}


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param(
            e,
            id=e["model"].removesuffix(".onnx.gz"),
            marks=[] if e["model"].removesuffix(".onnx.gz") in EXPORTED_BACK else [pytest.mark.slow],
        )
        for e in STEPPED
    ],
)
def test_a_plan_steps_weights_go_back_into_the_export_each_under_its_own_initializer(entry, tmp_path):
    """``fedfleet model --onnx``: after one step of the plan, the export as it came, with every weight
    the plan trains (and every running statistic) at its new value in an initializer of its own, the
    export's other initializers as they were, runs in onnxruntime on the step's examples."""
    from device_runtime.plan import serialize_plan
    from emulator.toolchain.trained_model import trained_onnx

    step, ref = plan_step(entry["model"]), reference(entry["reference"])
    bundle = tmp_path / "bundle"
    (bundle / "task").mkdir(parents=True)
    shutil.copyfile(unpacked(entry["model"]), bundle / "model.onnx")
    (bundle / "task" / "plan.fedplan").write_bytes(serialize_plan(step.made.plan))
    (bundle / "task" / "manifest.json").write_text(json.dumps({"task": "task", "plan": {"file": "plan.fedplan"}}))
    model, made = trained_onnx(bundle, step.after)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    assert sorted(made.trained) == sorted(step.made.plan.weight_names)
    for w in step.made.plan.weight_names:
        np.testing.assert_array_equal(inits[w], step.after[w], err_msg=w)
    original = {i.name: i for i in onnx.load(str(unpacked(entry["model"]))).graph.initializer}
    for name, value in inits.items():
        if name not in made.trained and name in original:
            np.testing.assert_array_equal(value, onnx.numpy_helper.to_array(original[name]), err_msg=name)
    session = make_session(model.SerializeToString())
    inputs = {i.name for i in session.get_inputs()}
    feeds = {g: ref.examples[e] for g, e in step.made.plan.device.inputs.items() if g in inputs}
    if inputs <= set(feeds):  # (a model whose forward takes its labels for a loss of its own: not an app's)
        assert all(np.all(np.isfinite(out)) for out in session.run(None, feeds) if np.asarray(out).dtype.kind == "f")
