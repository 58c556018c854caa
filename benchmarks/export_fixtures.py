"""Real exports of real architectures and torch's own training step for each: the fixtures of
``tests/emulator/toolchain/test_exported_models.py``, which never imports torch.

    PYTHONPATH=. python -m benchmarks.export_fixtures [--only FAMILY ...] [--out DIR]

(needs the ``bench`` extra: torch, transformers, onnxscript). For each family the repository keeps
(:data:`KEPT`, of :data:`benchmarks.torch_models.MODELS`: its ``small`` module, in train mode; the
other families there are made the same way with ``--only NAME --out DIR``) and each of two initial
states,

* ``fresh``: the module as it initializes (zero biases, unit LayerNorm and BatchNorm gains: the
  equal-valued tensors exporters merge into one initializer),
* ``perturbed``: the same with Gaussian noise on every parameter and running statistic (10% of the
  tensor's spread, 0.1 where it has none), so that no two tensors are equal,

(and a GRU language model whose decoder ties the embedding, ``gru_tied``: one weight the model
really shares; and a two-layer bidirectional ``nn.RNN`` classifier, ``birnn``, which the classic
exporter writes as ONNX ``RNN`` ops) it writes the module exported three ways, as a model engineer calls ``torch.onnx.export``
(gzipped, ``<family>.<state>.<exporter>.onnx.gz``: the folder stays a few MB):

* ``classic``: ``dynamo=False, training=TrainingMode.PRESERVE, do_constant_folding=False,
  opset_version=17`` (torch's own advice for a model that is to train: its warning asks for no
  constant folding in a training-preserving export, which keeps BatchNorm and Dropout as they train),
* ``dynamo``: ``dynamo=True`` with the exporter's default ``optimize=True`` (opset 20), what a user
  gets by default: it merges equal-valued parameters without a trace, drops zero biases, folds a
  BatchNorm into the Conv before it and folds weight transposes and gate reorders into new
  constants (the plan warns of the parameters it cannot find),
* ``dynamo_noopt``: ``dynamo=True, optimize=False`` (what the warning and ``plan from-torch`` ask for),

all with the batch axis dynamic (and for the families of :data:`STATIC`, ``dynamo_static``: as
``dynamo`` without ``dynamic_shapes``, the batch fixed at the example args', as the exporter's
default call leaves it) and the weights inside the file (``external_data=False``). The
classic exporter's trace runs the train-mode module once, which moves BatchNorm's running
statistics by the example batch, and writes the moved ones: they are set back to the module's. Of the
dynamo exports' node metadata, ``pkg.torch.onnx.stack_trace`` (source paths and lines of the
machine that exported, most of each file's size), ``namespace`` and ``class_hierarchy`` (the
module path and the classes along it) are dropped; the rest (``pkg.torch.onnx.name_scopes``,
``fx_node``, the optimizer's rule names) is as the exporter wrote it.

Beside them, one reference per family and state (``<family>.<state>.npz``, shared by its three
exports, see :func:`save_reference`): the batch, the loss and every parameter and running
statistic after one SGD step of torch autograd with learning rate :data:`LR`, by torch name. The
step is computed in float64 from the exported float32 values, so that a comparison measures the
plan's float32 error alone; torch's own float32 step's error is saved too, as the noise to
expect. Dropout draws its own masks in torch and in a plan, so the modules these steps start from
have every dropout probability set to 0 (checked: two forward passes agree);
``dropout[_inplace].<exporter>.onnx.gz`` is a separate model with
``Dropout(0.5)`` the tests check statistically. ``manifest.json`` lists every file, the export
calls and the versions that made them.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import platform
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

from benchmarks.torch_models import MODELS, GRUNextToken, ModelSpec
from emulator.toolchain.torch_export import dynamic_batch

OUT = Path(__file__).resolve().parent.parent / "tests" / "emulator" / "toolchain" / "exported"
LR = 1.0
BATCH = 4
STATES = ("fresh", "perturbed")
EXPORTERS = ("classic", "dynamo", "dynamo_noopt")
#: The families also exported as ``dynamo_static`` (their perturbed state): the exporter's default
#: call, ``torch.onnx.export(module, args, path, dynamo=True)`` without ``dynamic_shapes``, which
#: fixes the batch the example args had in the file. DenseNet's plan takes any batch (its flattening
#: ``Reshape`` to [4, C] is rewritten to copy the batch, ``allowzero=1`` and all), ConvNeXt's cannot
#: (its average pool becomes ``as_strided``, a ``Gather`` of indices into the flattened batch of 4):
#: that plan is refused (``refused`` in the manifest: the words the test expects of the refusal).
STATIC = {"densenet": None, "convnext": "exported at a fixed batch size of 4, and node 'node_as_strided' (Gather)"}
CLASSIC_OPSET = 17
DYNAMO_OPSET = 20
DROPOUT_RATE = 0.5
DROPOUT_FEATURES = 512
#: The families, and a GRU language model whose decoder ties the embedding: a weight the model
#: really shares, which must stay one weight.
#: The families whose fixtures the repository keeps (``--only`` takes any of :data:`FAMILIES`, to
#: try the others with ``--out`` elsewhere).
KEPT = (
    "resnet18",
    "mobilenet_v2",
    "mobilenet_v3_small",
    "vit",
    "hf_vit",
    "bert",
    "distilbert",
    "lstm",
    "gru_next_token",
    "conv1d_text",
    "gru_tied",
    "shufflenet_v2",
    "albert",
    "gpt2",
    "llama",
    "t5",
    "gpt_sdpa",
    "norm_cnn",
    "birnn",
    "densenet",
    "convnext",
    "nn_transformer_encoder",
    "conv_nd",
    "activations",
    "ranked_trig",
)


class BiRNNClassifier(nn.Module):
    """A two-layer bidirectional ``nn.RNN`` (tanh) over embedded tokens, its outputs averaged over the
    positions whose token is not 0 (padding): the classic exporter writes ONNX ``RNN`` ops, the
    dynamo exporter the steps in elementary ops."""

    def __init__(self, vocab: int = 200, embed: int = 8, hidden: int = 8, num_classes: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.rnn = nn.RNN(embed, hidden, num_layers=2, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(2 * hidden, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embedding(tokens))
        mask = (tokens != 0).unsqueeze(-1).to(out.dtype)
        return self.fc((out * mask).sum(1) / mask.sum(1).clamp(min=1.0))


FAMILIES: dict[str, ModelSpec] = {
    **MODELS,
    "birnn": ModelSpec("torch.nn", BiRNNClassifier, partial(BiRNNClassifier, 1000, 64, 128), MODELS["lstm"].inputs, 4),
    "gru_tied": ModelSpec(
        "torch.nn",
        partial(GRUNextToken, 200, 16, 16, tie_weights=True),
        partial(GRUNextToken, 200, 128, 128, tie_weights=True),
        MODELS["gru_next_token"].inputs,
        200,
    ),
}
_DROPPED_METADATA = ("pkg.torch.onnx.stack_trace", "namespace", "pkg.torch.onnx.class_hierarchy")


def _seed(family: str) -> int:
    return sum(map(ord, family))


def without_dropout(module: nn.Module) -> nn.Module:
    """Every dropout probability of ``module`` set to 0, in place: ``nn.Dropout`` modules and the
    float ``*dropout*`` attributes some attention classes read instead."""
    for sub in module.modules():
        if isinstance(sub, nn.modules.dropout._DropoutNd):
            sub.p = 0.0
        for key, value in list(vars(sub).items()):
            if "dropout" in key.lower() and isinstance(value, float):
                setattr(sub, key, 0.0)
    return module


def perturb(module: nn.Module, generator: torch.Generator) -> None:
    """Gaussian noise on every parameter (10% of its spread, 0.1 where it has none) and on the
    running statistics (means shifted, variances scaled), in place."""
    with torch.no_grad():
        for _, p in module.named_parameters():
            spread = float(p.std()) if p.numel() > 1 else 0.0
            p.add_(torch.randn(p.shape, generator=generator) * (0.1 * spread if spread > 0 else 0.1))
        for name, b in module.named_buffers():
            if name.endswith("running_mean"):
                b.add_(torch.randn(b.shape, generator=generator) * 0.1)
            elif name.endswith("running_var"):
                b.mul_(torch.exp(torch.randn(b.shape, generator=generator) * 0.1))


def batch(spec: ModelSpec, generator: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A batch of :data:`BATCH` examples for the family's inputs, and labels."""
    inputs = []
    for item in spec.inputs:
        shape = (BATCH, *item.shape)
        if item.dtype == "int64":
            x = torch.randint(0, item.high, shape, generator=generator)
            if item.name == "attention_mask":
                x[:, 0] = 1  # every example attends to at least its first token
        else:
            x = torch.randn(shape, generator=generator)
        inputs.append(x)
    return inputs, torch.randint(0, spec.classes, (BATCH, *spec.label_shape), generator=generator)


def export_call(exporter: str) -> str:
    """The call, as the manifest and the README show it."""
    if exporter == "classic":
        return (
            f"torch.onnx.export(module.train(), args, path, dynamo=False, training=TrainingMode.PRESERVE, "
            f"do_constant_folding=False, opset_version={CLASSIC_OPSET}, dynamic_axes=<batch>)"
        )
    optimize = "" if exporter in ("dynamo", "dynamo_static") else ", optimize=False"
    shapes = "" if exporter == "dynamo_static" else "dynamic_shapes=<batch>, "
    return (
        f"torch.onnx.export(module.train(), args, path, dynamo=True{optimize}, opset_version={DYNAMO_OPSET}, "
        f"{shapes}external_data=False)"
    )


def export(module: nn.Module, args: list[torch.Tensor], names: list[str], exporter: str, path: Path) -> None:
    """``module`` exported by ``exporter`` to ``path`` (``.onnx.gz``)."""
    gzipped, path = path, path.with_suffix("")
    original, module = module, copy.deepcopy(module).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "classic":
            axes = {n: {0: "batch"} for n in [*names, "logits"]}
            torch.onnx.export(
                module,
                tuple(args),
                str(path),
                dynamo=False,
                training=torch.onnx.TrainingMode.PRESERVE,
                do_constant_folding=False,
                opset_version=CLASSIC_OPSET,
                input_names=names,
                output_names=["logits"],
                dynamic_axes=axes,
            )
        else:
            torch.onnx.export(
                module,
                tuple(args),
                str(path),
                dynamo=True,
                optimize=exporter in ("dynamo", "dynamo_static"),
                opset_version=DYNAMO_OPSET,
                input_names=names,
                output_names=["logits"],
                dynamic_shapes=None
                if exporter == "dynamo_static"
                else dynamic_batch(module, len(args), torch.export.Dim("batch")),
                external_data=False,
                verbose=False,
            )
    model = onnx.load(str(path))
    # The classic exporter's trace runs the train-mode module on the example batch, which moves
    # BatchNorm's running statistics, and writes the moved ones: set them back to the module's.
    buffers = {n: b.detach().numpy() for n, b in original.named_buffers() if b.is_floating_point()}
    for init in model.graph.initializer:
        if init.name in buffers and not np.array_equal(numpy_helper.to_array(init), buffers[init.name]):
            init.CopyFrom(numpy_helper.from_array(buffers[init.name], init.name))
    strip_metadata(model)
    save_gzipped(model, gzipped)
    path.unlink()


def save_gzipped(model: onnx.ModelProto, path: Path) -> None:
    """``model`` gzipped into ``path``, byte for byte the same for the same model (no time or
    name in the gzip header). The fixtures' graphs and metadata shrink 3-4x; their weights hardly."""
    with path.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as f:
        f.write(model.SerializeToString())


def strip_metadata(model: onnx.ModelProto) -> None:
    """Drop the node metadata the tests do not read (:data:`_DROPPED_METADATA`), in place."""
    for node in model.graph.node:
        kept = [p for p in node.metadata_props if p.key not in _DROPPED_METADATA]
        del node.metadata_props[:]
        node.metadata_props.extend(kept)


def _step(
    module: nn.Module, inputs: list[torch.Tensor], labels: torch.Tensor, dtype: torch.dtype
) -> tuple[float, dict]:
    model = copy.deepcopy(module).to(dtype).train()
    logits = model(*[x.to(dtype) if x.is_floating_point() else x for x in inputs])
    # the mean over every label: one per example, or one per position of a language model's sequence
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:  # as torch.optim.SGD: a parameter whose requires_grad is off stays
                p -= LR * p.grad
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if b.is_floating_point())]
    return loss.item(), {n: t.detach().double().numpy() for n, t in tensors}


def reference_step(
    module: nn.Module, inputs: list[torch.Tensor], labels: torch.Tensor
) -> tuple[float, dict[str, np.ndarray], dict[str, float]]:
    """One SGD step (learning rate :data:`LR`, mean cross-entropy) of torch autograd in float64
    from the module's float32 values: the loss and every parameter and float buffer after it, and
    how far torch's own float32 step lands from it per tensor (the largest difference beyond the
    values' own float32 rounding): the noise a float32 implementation of this step shows on this
    model and batch."""
    loss, after = _step(module, inputs, labels, torch.float64)
    _, after32 = _step(module, inputs, labels, torch.float32)
    errors = {}
    for n, v in after.items():
        error = np.abs(after32[n] - v) - 4 * np.finfo(np.float32).eps * np.abs(v)
        errors[n] = max(float(error.max(initial=0)), 0.0)
    return loss, {n: v.astype(np.float32) for n, v in after.items()}, errors


def save_reference(
    path: Path, module: nn.Module, spec: ModelSpec, inputs: list[torch.Tensor], labels: torch.Tensor
) -> None:
    """``path`` (npz): the batch, the loss, and the tensors after the step as one float32 array in
    the order of ``index`` (a JSON text: each parameter's and running statistic's torch name and
    shape, the tied parameters, the parameters of modules called more than once, the inputs, the
    classes), with torch float32's error per tensor. A language model's label is one token per
    position (``spec.label_shape``), its loss the mean over them all."""
    loss, after, errors = reference_step(module, inputs, labels)
    parameters = [n for n, _ in module.named_parameters()]
    statistics = [n for n, b in module.named_buffers() if b.is_floating_point()]
    order = [*parameters, *statistics]
    index = {
        "parameters": [[n, list(after[n].shape)] for n in parameters],
        "statistics": [[n, list(after[n].shape)] for n in statistics],
        "tied": tied(module),
        "reused": reused(module, inputs),
        "inputs": [i.name for i in spec.inputs],
        "classes": spec.classes,
    }
    np.savez_compressed(
        path,
        index=np.array(json.dumps(index)),
        label=labels.numpy(),
        loss=np.float64(loss),
        lr=np.float64(LR),
        after=np.concatenate([after[n].ravel() for n in order]),
        float32_error=np.array([errors[n] for n in order]),
        **{f"input/{i.name}": x.numpy() for i, x in zip(spec.inputs, inputs)},
    )


def _deterministic(module: nn.Module, inputs: list[torch.Tensor]) -> bool:
    outs = [copy.deepcopy(module).train()(*inputs) for _ in range(2)]
    return bool(torch.equal(outs[0], outs[1]))


def reused(module: nn.Module, inputs: list[torch.Tensor]) -> list[str]:
    """Parameters of modules the forward pass calls more than once (ALBERT's one layer applied at
    every depth): one weight each, which a plan must keep one."""
    module = copy.deepcopy(module)  # a train-mode pass moves BatchNorm's running statistics
    calls: dict[str, int] = {}
    for name, sub in module.named_modules():
        sub.register_forward_pre_hook(lambda m, args, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    with torch.no_grad():
        module(*inputs)
    return [
        f"{name}.{p}" if name else p
        for name, sub in module.named_modules()
        if calls.get(name, 0) > 1
        for p, _ in sub.named_parameters(recurse=False)
    ]


def tied(module: nn.Module) -> list[list[str]]:
    """Groups of torch names that are one parameter (the model's own tying)."""
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def family_fixtures(
    family: str, out: Path, say: Callable[[str], None], references_only: bool = False
) -> list[dict[str, Any]]:
    spec = FAMILIES[family]
    entries = []
    for state in STATES:
        torch.manual_seed(_seed(family))
        module = without_dropout(spec.small()).train()
        generator = torch.Generator().manual_seed(_seed(family) + 1)
        if state == "perturbed":
            perturb(module, generator)
        inputs, labels = batch(spec, generator)
        if not _deterministic(module, inputs):
            raise SystemExit(f"{family}: two train-mode forward passes differ; some dropout is still active")
        reference = f"{family}.{state}.npz"
        save_reference(out / reference, module, spec, inputs, labels)
        static = ("dynamo_static",) if family in STATIC and state == "perturbed" else ()
        for exporter in (*EXPORTERS, *static):
            path = out / f"{family}.{state}.{exporter}.onnx.gz"
            if not references_only:
                export(module, inputs, [i.name for i in spec.inputs], exporter, path)
                say(f"  {path.name}: {path.stat().st_size // 1024} KB")
            entry = {"family": family, "state": state, "exporter": exporter, "model": path.name, "reference": reference}
            if static and exporter in static and STATIC[family]:
                entry["refused"] = STATIC[family]
            entries.append(entry)
    return entries


class Dropped(nn.Module):
    """Dropout(0.5) on the input, then a linear layer without bias: one example's weight gradient
    is zero in exactly the columns of the dropped inputs, and scaled by 1/(1-p) in the others."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.dropout = nn.Dropout(DROPOUT_RATE, inplace=inplace)
        self.fc = nn.Linear(DROPOUT_FEATURES, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.dropout(x))


def dropout_fixtures(out: Path, say: Callable[[str], None], references_only: bool = False) -> list[dict[str, Any]]:
    entries = []
    for inplace in (False, True):
        torch.manual_seed(0)
        module = Dropped(inplace).train()
        x = torch.randn(BATCH, DROPOUT_FEATURES)
        for exporter in EXPORTERS:
            path = out / f"dropout{'_inplace' if inplace else ''}.{exporter}.onnx.gz"
            if not references_only:
                export(module, [x], ["x"], exporter, path)
                say(f"  {path.name}: {path.stat().st_size // 1024} KB")
            entries.append(
                {
                    "family": "dropout",
                    "inplace": inplace,
                    "exporter": exporter,
                    "model": path.name,
                    "rate": DROPOUT_RATE,
                }
            )
    return entries


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[*FAMILIES, "dropout"],
        help="these families only (the manifest keeps the others' entries)",
    )
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--references-only",
        action="store_true",
        help="write the torch steps again, not the exports (they start from the same seeded modules)",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest_path = args.out / "manifest.json"
    keep = args.only or args.references_only
    old = json.loads(manifest_path.read_text()) if manifest_path.exists() and keep else {"fixtures": []}
    chosen = args.only or [*KEPT, "dropout"]
    entries = [e for e in old["fixtures"] if e["family"] not in chosen]
    for family in chosen:
        print(family, flush=True)
        say = lambda line: print(line, flush=True)  # noqa: E731
        if family == "dropout":
            entries += dropout_fixtures(args.out, say, args.references_only)
        else:
            entries += family_fixtures(family, args.out, say, args.references_only)
    import onnxscript
    import transformers

    order = [*KEPT, *(f for f in FAMILIES if f not in KEPT), "dropout"]
    exporters = [*EXPORTERS, "dynamo_static"]
    entries.sort(key=lambda e: (order.index(e["family"]), e.get("state", ""), exporters.index(e["exporter"])))
    manifest = {
        "regenerate": "PYTHONPATH=. python -m benchmarks.export_fixtures  (needs the bench extra)",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "onnxscript": onnxscript.__version__,
            "onnx": onnx.__version__,
            "python": platform.python_version(),
        },
        "exporters": {e: export_call(e) for e in exporters},
        "batch": BATCH,
        "lr": LR,
        "fixtures": entries,
    }
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {len(entries)} fixtures to {args.out} ({total // 1024} KB in all)")


if __name__ == "__main__":
    main()
