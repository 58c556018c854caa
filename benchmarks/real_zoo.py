"""torchvision's and timm's own models through the toolchain: each exported as a model engineer
would, made a training plan, and one SGD step of the plan held to torch autograd's.

    PYTHONPATH=. python -m benchmarks.real_zoo [--only NAME ...] [--exporters from_torch classic ...]

Needs the ``bench`` extra and torchvision and timm, in a virtualenv of their own::

    python -m venv ~/.venvs/zoo && ~/.venvs/zoo/bin/pip install -e '.[bench]' torchvision==0.28.0 timm

(torchvision 0.28 is torch 2.13's). They are not in the ``bench`` extra: PyPI's Linux wheel of
torchvision is a CUDA build whose operator library does not load beside the extra's CPU torch, and
transformers, which imports torchvision wherever it is installed, then fails to import its models
(``export_fixtures`` and ``plan_autodiff`` need them); this module imports torchvision without
those operators (:func:`_import_torchvision`). The tests never import this module. Random
weights only (``weights=None``, ``pretrained=False``): nothing is downloaded. Each model is built
at a reduced size where its constructor allows (fewer blocks, narrower layers, 32x32 or 64x64
images), every dropout and stochastic-depth probability set to 0 so that a step is deterministic,
and perturbed (:func:`benchmarks.export_fixtures.perturb`) so that no two tensors are equal.

Exporters (``--exporters``):

* ``from_torch``: :func:`emulator.toolchain.export_torch`, as ``fedfleet plan from-torch`` exports
  (dynamo, ``optimize=False``, training mode, dynamic batch; the classic exporter where dynamo fails),
  with the buffers and parameters it names ``frozen``;
* ``classic`` and ``dynamo_noopt``: ``torch.onnx.export`` as :func:`benchmarks.export_fixtures.export`
  calls it, then ``fedfleet plan from-onnx``'s import.

Per model and exporter, one JSON line: ``ok`` when the loss is torch's (float64) within 1e-5 relative
and every trained tensor and running statistic lands within :data:`TOLERANCE` of torch's change to
it, or 4 times torch's own float32 error where that is larger (``no_verdict`` where that error is
:data:`NO_VERDICT` or more), and the plan trains every parameter torch's step changes
(``misses_parameters`` and their names otherwise); else the worst tensor, or the
one-line error the toolchain gave (``refused``), or the traceback's last line (``crashed``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from benchmarks import export_fixtures
from benchmarks.export_fixtures import BATCH, LR, batch, export, perturb, reference_step, tied, without_dropout
from benchmarks.torch_models import Input, ModelSpec
from device_runtime.executor import make_session
from emulator.toolchain import TaskError, UnsupportedOpError
from emulator.toolchain.tasks import Task, onnx_import
from emulator.toolchain.torch_export import (
    TorchInput,
    constant_buffers,
    export_torch,
    padding_rows,
    untrained_parameters,
)
from example_store import ExampleSelector


def _import_torchvision() -> None:
    """Import torchvision where its operator library does not load: PyPI's Linux wheels of it are
    CUDA builds, whose ``_C`` needs torch's CUDA libraries, absent beside the CPU torch of the bench
    extra. Its models are plain Python and need none of those operators; only its import registers
    fake kernels for ``torchvision::nms`` and ``qnms`` unguarded, which are defined here (schema only) for it."""
    import sys

    try:
        import torchvision  # noqa: F401
    except ModuleNotFoundError:  # transformers' models (benchmarks.hf_zoo) need no torchvision
        return
    except RuntimeError:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        for op in ("nms", "qnms"):
            _SCHEMAS.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        import torchvision  # noqa: F401


_SCHEMAS = torch.library.Library("torchvision", "FRAGMENT")
_import_torchvision()

CLASSES = 10
TOLERANCE = 2e-4
#: torch's own float32 step this far from its float64 step (of torch's change to a tensor): the model is
#: too ill-conditioned at this size and batch (BatchNorm over a few values) for any float32 step to be
#: judged; ``--side`` larger gives it more values
NO_VERDICT = 0.1
EXPORTERS = ("from_torch", "classic", "dynamo_noopt")


def _tv(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(weights=None, num_classes=CLASSES, **kwargs)

    return make


def _resnet(block: str, layers: list[int], **kwargs: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from torchvision.models import resnet

        return resnet.ResNet(getattr(resnet, block), layers, num_classes=CLASSES, **kwargs)

    return make


def _convnext() -> nn.Module:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)], num_classes=CLASSES)


def _swin(v2: bool = False) -> nn.Module:
    from torchvision.models import swin_transformer as swin

    extra = {"block": swin.SwinTransformerBlockV2, "downsample_layer": swin.PatchMergingV2} if v2 else {}
    return swin.SwinTransformer([4, 4], 16, [2, 2], [2, 4], [4, 4], num_classes=CLASSES, **extra)


def _vit() -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(32, 8, 2, 2, 32, 64, num_classes=CLASSES)


def _maxvit() -> nn.Module:
    from torchvision.models.maxvit import MaxVit

    return MaxVit(
        (32, 32), stem_channels=8, partition_size=2, block_channels=[16, 32], block_layers=[1, 1], head_dim=8,
        stochastic_depth_prob=0.0, num_classes=CLASSES,
    )  # fmt: skip


def _densenet() -> nn.Module:
    from torchvision.models.densenet import DenseNet

    return DenseNet(8, (2, 2), 16, num_classes=CLASSES)


def _timm(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import timm

        # drop_rate: the head's functional dropout (GhostNet's F.dropout), which no Dropout module holds
        return timm.create_model(name, pretrained=False, num_classes=CLASSES, drop_rate=0.0, **kwargs)

    return make


#: name -> (factory, image side)
ZOO: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "tv_resnet18": (_tv("resnet18"), 64),
    "tv_resnet50_1111": (_resnet("Bottleneck", [1, 1, 1, 1], width_per_group=16), 64),
    "tv_resnext_1111": (_resnet("Bottleneck", [1, 1, 1, 1], groups=4, width_per_group=4), 64),
    "tv_wide_resnet_1111": (_resnet("Bottleneck", [1, 1, 1, 1], width_per_group=128), 64),
    "tv_mobilenet_v2": (_tv("mobilenet_v2", width_mult=0.25), 64),
    "tv_mobilenet_v3_small": (_tv("mobilenet_v3_small", width_mult=0.25), 64),
    "tv_mobilenet_v3_large": (_tv("mobilenet_v3_large", width_mult=0.25), 64),
    "tv_efficientnet_b0": (_tv("efficientnet_b0", stochastic_depth_prob=0.0), 64),
    "tv_efficientnet_v2_s": (_tv("efficientnet_v2_s", stochastic_depth_prob=0.0), 64),
    "tv_regnet_x_400mf": (_tv("regnet_x_400mf"), 64),
    "tv_regnet_y_400mf": (_tv("regnet_y_400mf"), 64),
    "tv_mnasnet0_5": (_tv("mnasnet0_5"), 64),
    "tv_shufflenet_v2_x0_5": (_tv("shufflenet_v2_x0_5"), 64),
    "tv_squeezenet1_1": (_tv("squeezenet1_1"), 64),
    "tv_densenet_small": (_densenet, 64),
    "tv_googlenet": (_tv("googlenet", aux_logits=False, init_weights=True), 64),
    "tv_convnext_small": (_convnext, 64),
    "tv_swin_small": (_swin, 32),
    "tv_swin_v2_small": (partial(_swin, True), 32),
    "tv_vit_small": (_vit, 32),
    "tv_maxvit_small": (_maxvit, 32),
    "timm_resnet10t": (_timm("resnet10t"), 64),
    "timm_efficientnet_b0": (_timm("efficientnet_b0"), 64),
    "timm_mobilenetv3_small_050": (_timm("mobilenetv3_small_050"), 64),
    "timm_vit_tiny": (_timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2), 32),
    "timm_deit_tiny": (_timm("deit_tiny_patch16_224", img_size=32, patch_size=8, depth=2), 32),
    "timm_convnext_atto": (_timm("convnext_atto"), 64),
    "timm_mobilevit_xxs": (_timm("mobilevit_xxs"), 64),
    "timm_levit_128s": (_timm("levit_128s", img_size=64), 64),
    "timm_regnety_002": (_timm("regnety_002"), 64),
    "timm_ghostnet_050": (_timm("ghostnet_050"), 64),
    "timm_mobilenetv4_conv_small": (_timm("mobilenetv4_conv_small"), 64),
    "timm_efficientvit_b0": (_timm("efficientvit_b0"), 64),
    "timm_edgenext_xx_small": (_timm("edgenext_xx_small"), 64),
    "timm_poolformer_s12": (_timm("poolformerv2_s12"), 64),
    "timm_fastvit_t8": (_timm("fastvit_t8"), 64),
}


class _RecurrentClassifier(nn.Module):
    """Tokens through a two-layer bidirectional ``kind`` (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``), its
    outputs averaged over the positions whose token is not 0 (padding)."""

    def __init__(self, kind: str, **kwargs: Any) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 8)
        self.rnn = getattr(nn, kind)(8, 8, num_layers=2, bidirectional=True, batch_first=True, **kwargs)
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embedding(tokens))
        mask = (tokens != 0).unsqueeze(-1).to(out.dtype)
        return self.fc((out * mask).sum(1) / mask.sum(1).clamp(min=1.0))


class _UNet(nn.Module):
    """Two down and two up stages with skip concatenations; up by ``ConvTranspose2d`` or by
    ``nn.Upsample(mode=up)`` and a 1x1 convolution."""

    def __init__(self, up: str = "transpose", c: int = 4) -> None:
        super().__init__()

        def block(i: int, o: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())

        def upsample(i: int, o: int) -> nn.Module:
            if up == "transpose":
                return nn.ConvTranspose2d(i, o, 2, stride=2)
            corners = {} if up == "nearest" else {"align_corners": False}
            return nn.Sequential(nn.Upsample(scale_factor=2, mode=up, **corners), nn.Conv2d(i, o, 1))

        self.d1, self.d2, self.mid = block(3, c), block(c, 2 * c), block(2 * c, 4 * c)
        self.u2, self.u1 = upsample(4 * c, 2 * c), upsample(2 * c, c)
        self.c2, self.c1, self.out = block(4 * c, 2 * c), block(2 * c, c), nn.Conv2d(c, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.d1(x)
        b = self.d2(nn.functional.max_pool2d(a, 2))
        m = self.mid(nn.functional.max_pool2d(b, 2))
        y = self.c1(torch.cat([self.u1(self.c2(torch.cat([self.u2(m), b], 1))), a], 1))
        return self.out(y).mean((2, 3))


class _Bags(nn.Module):
    """``nn.EmbeddingBag`` of one bag per row (mean, max with row 0 padding, sum weighted per token)."""

    def __init__(self) -> None:
        super().__init__()
        self.mean = nn.EmbeddingBag(50, 8, mode="mean")
        self.max = nn.EmbeddingBag(50, 8, mode="max", padding_idx=0)
        self.sum = nn.EmbeddingBag(50, 8, mode="sum")
        self.gate = nn.Linear(1, 1)
        self.fc = nn.Linear(24, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        weights = torch.sigmoid(self.gate(tokens.to(self.gate.weight.dtype).unsqueeze(-1) / 50)).squeeze(-1)
        return self.fc(
            torch.cat([self.mean(tokens), self.max(tokens), self.sum(tokens, per_sample_weights=weights)], 1)
        )


class _TriuAttention(nn.Module):
    """Causal self-attention written out, its mask built by ``torch.triu`` and ``masked_fill``,
    scoring the next token at every position."""

    def __init__(self, vocab: int = 50, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.embedding, self.position = nn.Embedding(vocab, dim), nn.Parameter(torch.randn(16, dim) * 0.1)
        self.norm, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.head, self.heads = nn.Linear(dim, vocab, bias=False), heads

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embedding(tokens) + self.position[:length]
        q, k, v = (
            t.view(t.shape[0], length, self.heads, -1).transpose(1, 2) for t in self.qkv(self.norm(x)).chunk(3, -1)
        )
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1), float("-inf"))
        return self.head(x + self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(x.shape)))


class _Audio(nn.Module):
    """A wav2vec-like feature encoder: strided ``Conv1d`` with GroupNorm and GELU, then a linear head."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, c, 10, stride=5, bias=False), nn.GroupNorm(c, c), nn.GELU(),
            nn.Conv1d(c, c, 3, stride=2, bias=False), nn.GELU(),
            nn.Conv1d(c, c, 3, stride=2, groups=2), nn.GroupNorm(2, c), nn.GELU(),
        )  # fmt: skip
        self.fc = nn.Linear(c, CLASSES)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(wave.unsqueeze(1)).mean(2))


class _Unpool(nn.Module):
    """SegNet's decoder step: ``max_pool2d`` with indices, ``max_unpool2d`` back."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec, self.fc = (
            nn.Conv2d(3, 4, 3, padding=1),
            nn.Conv2d(4, 3, 3, padding=1),
            nn.Linear(3, CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.enc(x))
        pooled, indices = nn.functional.max_pool2d(h, 2, return_indices=True)
        return self.fc(
            self.dec(nn.functional.max_unpool2d(pooled, indices, (2, 2), output_size=h.shape[-2:])).mean((2, 3))
        )


class _Volume(nn.Module):
    """``Conv3d`` with BatchNorm3d, ``avg_pool3d``, ``ConvTranspose3d`` and trilinear ``interpolate``."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv3d(1, c, 3, padding=1, stride=(1, 2, 2)), nn.BatchNorm3d(c)
        self.up, self.fc = nn.ConvTranspose3d(c, c, 2, stride=2), nn.Linear(c, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.avg_pool3d(torch.relu(self.norm(self.conv(x.unsqueeze(1)))), 2)
        return self.fc(nn.functional.interpolate(self.up(h), scale_factor=(1, 2, 2), mode="trilinear").amax((2, 3, 4)))


class _PaddedAttention(nn.Module):
    """``nn.MultiheadAttention`` with a key padding mask, then ``nn.TransformerDecoderLayer`` with
    a causal mask (``torch.triu``) and the memory's padding mask."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embedding, self.attention = nn.Embedding(50, dim), nn.MultiheadAttention(dim, 2, batch_first=True)
        self.decoder = nn.TransformerDecoderLayer(dim, 2, 32, dropout=0.0, batch_first=True, norm_first=True)
        self.fc = nn.Linear(dim, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x, padding = self.embedding(tokens), tokens == 0
        y, _ = self.attention(x, x, x, key_padding_mask=padding, need_weights=False)
        causal = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool), diagonal=1)
        return self.fc(self.decoder(y, x, tgt_mask=causal, memory_key_padding_mask=padding).mean(1))


class _Scalars(nn.Module):
    """ReZero's one-element gate and a 0-d learned temperature: parameters torch trains."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.f, self.fc = nn.Linear(3, 8), nn.Linear(8, 8), nn.Linear(8, CLASSES)
        self.alpha, self.temperature = nn.Parameter(torch.tensor([0.1])), nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x.mean((2, 3)))
        return self.fc(h + self.alpha * torch.relu(self.f(h))) * self.temperature


class _Detached(nn.Module):
    """A straight-through rounding ``h + (round(h) - h).detach()`` and a detached gate."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.proj, self.fc = nn.Linear(3, 8), nn.Linear(8, 8), nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x.mean((2, 3)))
        rounded = h + (torch.round(h * 4) / 4 - h).detach()
        return self.fc(rounded * torch.sigmoid(self.proj(h).detach()) + self.proj(h))


_TOKENS = (Input("tokens", (16,), "int64", 50),)
_IMAGE16 = (Input("image", (3, 16, 16)),)


#: torch.nn architectures (and torch's own recurrent, upsampling and masking idioms) at small
#: sizes, beside the torchvision and timm models: run with ``--only NAME``
def _nn(factory: Callable[[], nn.Module], inputs: tuple[Input, ...], classes: int = CLASSES, **kw: Any) -> ModelSpec:
    return ModelSpec("torch.nn", factory, factory, inputs, classes, **kw)


NN_ZOO: dict[str, ModelSpec] = {
    "nn_bilstm": _nn(partial(_RecurrentClassifier, "LSTM"), _TOKENS),
    "nn_bigru": _nn(partial(_RecurrentClassifier, "GRU"), _TOKENS),
    "nn_birnn_relu": _nn(partial(_RecurrentClassifier, "RNN", nonlinearity="relu"), _TOKENS),
    "nn_unet_transpose": _nn(_UNet, _IMAGE16),
    "nn_unet_nearest": _nn(partial(_UNet, "nearest"), _IMAGE16),
    "nn_unet_bilinear": _nn(partial(_UNet, "bilinear"), _IMAGE16),
    "nn_unet_bicubic": _nn(partial(_UNet, "bicubic"), _IMAGE16),
    "nn_embedding_bag": _nn(_Bags, _TOKENS),
    "nn_triu_attention": _nn(_TriuAttention, _TOKENS, 50, label_shape=(16,)),
    "nn_audio_conv1d": _nn(_Audio, (Input("wave", (400,)),)),
    "nn_max_unpool": _nn(_Unpool, _IMAGE16),
    "nn_conv3d": _nn(_Volume, (Input("volume", (4, 8, 8)),)),
    "nn_padded_attention": _nn(_PaddedAttention, _TOKENS),
    "nn_scalar_parameters": _nn(_Scalars, (Input("image", (3, 4, 4)),)),
    "nn_detach": _nn(_Detached, (Input("image", (3, 4, 4)),)),
}


def run_nn(name: str, exporter: str, state: str = "perturbed") -> dict[str, Any]:
    """:func:`step_check` on :data:`NN_ZOO`'s ``name``, ``fresh`` (as it initializes) or ``perturbed``."""
    spec = NN_ZOO[name]
    torch.manual_seed(0)
    module = without_dropout(spec.small()).train()
    generator = torch.Generator().manual_seed(1)
    if state == "perturbed":
        perturb(module, generator)
    inputs, labels = batch(spec, generator)
    specs = [TorchInput(i.name, i.shape, i.dtype) for i in spec.inputs]
    return step_check(module, specs, inputs, labels, exporter, {"model": name, "exporter": exporter, "state": state})


def no_stochastic_depth(module: nn.Module) -> nn.Module:
    """Every stochastic-depth (drop-path) probability of ``module`` set to 0, in place: torchvision's
    ``StochasticDepth`` and timm's ``DropPath`` (transformers' ``SwinDropPath`` and the like) keep
    theirs in ``p`` and ``drop_prob``."""
    for sub in module.modules():
        if type(sub).__name__.endswith(("StochasticDepth", "DropPath", "DropBlock2d")):  # SwinDropPath too
            for attr in ("p", "drop_prob"):
                if isinstance(getattr(sub, attr, None), float):
                    setattr(sub, attr, 0.0)
    return module


def _plan_step(
    model_path: Path,
    frozen: list[str],
    inputs: dict[str, np.ndarray],
    labels: np.ndarray,
    frozen_rows: dict[str, tuple[int, ...]] | None = None,
) -> tuple:
    task = Task(
        name="zoo",
        model=model_path,
        proxy=lambda: None,  # type: ignore[arg-type, return-value]
        hyperparameters={"lr": LR},
        label="y",
        batch_size=BATCH,
        selector=ExampleSelector("app:/zoo"),
        frozen=tuple(frozen),
        frozen_rows=frozen_rows or {},
    )
    made = onnx_import(task._model_source(), task)
    plan = made.plan
    before = task.weights(plan)
    examples = {**inputs, "y": labels}
    feeds = {**before, **{g: examples[n] for g, n in plan.device.inputs.items()}}
    session = make_session(plan.work)
    start = time.process_time()
    values = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    seconds = time.process_time() - start
    after = {w: values[out] for w, out in zip(plan.weight_names, plan.weight_outputs)}
    return made, before, after, float(values["loss_sum"] / values["count"]), seconds


def compare(
    before: dict[str, np.ndarray], after: dict[str, np.ndarray], reference: dict[str, np.ndarray], errors: dict
) -> tuple[str | None, float, float, int]:
    """The worst tensor's difference from torch's step over torch's change to it (at least 1e-3 of
    the largest change to any tensor), beyond the values' float32 rounding; torch float32's own
    error on the same scale; how many tensors were compared."""
    names = [n for n in after if n in reference]
    changes = {n: float(np.abs(reference[n].astype(np.float64) - before[n]).max(initial=0)) for n in names}
    floor = 1e-3 * max(changes.values(), default=0.0)
    worst, worst_value, noise = None, 0.0, 0.0
    for n in names:
        scale = max(changes[n], floor, 1e-30)
        ref = reference[n].astype(np.float64)
        excess = np.abs(after[n].astype(np.float64) - ref) - 4 * np.finfo(np.float32).eps * np.abs(ref)
        value = max(float(excess.max(initial=0)), 0.0) / scale
        noise = max(noise, errors[n] / scale)
        if value >= worst_value:
            worst, worst_value = n, value
    return worst, worst_value, noise, len(names)


def run(name: str, exporter: str, side: int | None = None) -> dict[str, Any]:
    factory, default_side = ZOO[name]
    side = side or default_side
    torch.manual_seed(0)
    module = no_stochastic_depth(without_dropout(factory())).train()
    generator = torch.Generator().manual_seed(1)
    perturb(module, generator)
    x = torch.randn((BATCH, 3, side, side), generator=generator)
    y = torch.randint(0, CLASSES, (BATCH,), generator=generator)
    row = {"model": name, "exporter": exporter, "side": side}
    return step_check(module, [TorchInput("image", (3, side, side))], [x], y, exporter, row)


def step_check(
    module: nn.Module,
    specs: list[TorchInput],
    inputs: list[torch.Tensor],
    labels: torch.Tensor,
    exporter: str,
    row: dict[str, Any],
) -> dict[str, Any]:
    """``row`` completed with the verdict on ``module`` (dropout off, perturbed) exported by
    ``exporter`` with inputs ``specs``: its plan's SGD step on the batch ``inputs``, ``labels`` (one
    per example, or one per position) against torch autograd's."""
    row = {**row, "params": sum(p.numel() for p in module.parameters())}
    names = [s.name for s in specs]
    try:
        loss, reference, errors = reference_step(module, inputs, labels)
    except Exception as exc:  # noqa: BLE001 - the library's model itself
        return {**row, "result": "torch_failed", "error": f"{type(exc).__name__}: {exc}"[:300]}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        start = time.perf_counter()
        try:
            if exporter == "from_torch":
                notes: list[str] = []
                export_torch(module, specs, path, notes=notes)
                if notes:
                    row["notes"] = notes
            else:
                export(module, inputs, names, exporter, path.with_suffix(".onnx.gz"))
                path.write_bytes(gzip.decompress(path.with_suffix(".onnx.gz").read_bytes()))
            # what `plan from-torch` freezes itself, and a file's user names (--frozen, frozen_rows)
            initializers = {i.name for i in onnx.load(str(path), load_external_data=False).graph.initializer}
            frozen = [*constant_buffers(module, initializers), *untrained_parameters(module, initializers)]
            rows = padding_rows(module, initializers)
        except TaskError as exc:
            return {**row, "result": "export_refused", "error": str(exc)[:400]}
        except Exception as exc:  # noqa: BLE001 - the exporter's own failure
            return {**row, "result": "export_failed", "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
        row["export_s"] = round(time.perf_counter() - start, 1)
        start = time.perf_counter()
        try:
            made, before, after, plan_loss, step_s = _plan_step(
                path, frozen, {n: x.numpy() for n, x in zip(names, inputs)}, labels.numpy(), rows
            )
        except (TaskError, UnsupportedOpError) as exc:
            return {**row, "result": "refused", "error": str(exc)[:400]}
        except Exception as exc:  # noqa: BLE001 - a traceback is a defect to report
            tb = traceback.format_exception(exc)
            return {**row, "result": "crashed", "error": "".join(tb[-3:])[-800:]}
        row["plan_s"] = round(time.perf_counter() - start, 1)
        row["step_cpu_s"] = round(step_s, 3)
        # float buffers torch never trains (Swin V2's coordinate table): a classic export cannot tell
        # them from parameters, so its plan trains them unless they are named frozen
        stats = {n for n, _ in module.named_buffers() if n.endswith(("running_mean", "running_var"))}
        buffers = {n for n, b in module.named_buffers() if b.is_floating_point() and n not in stats}
        trained_buffers = sorted(buffers & set(made.trainable))
        if trained_buffers:
            row["trained_buffers"] = trained_buffers
            after = {n: v for n, v in after.items() if n not in buffers}
        worst, value, noise, compared = compare(before, after, reference, errors)
        loss_error = abs(plan_loss - loss) / abs(loss)
        missing = sorted(set(reference) - set(after))
        untrained = _untrained(module, reference, set(after))
        ok = loss_error <= 1e-5 and value <= max(TOLERANCE, 4 * noise)
        return {
            **row,
            "result": ("ok" if not trained_buffers else "ok_but_trains_buffers")
            if ok and not untrained
            else "misses_parameters"
            if ok
            else "wrong_step"
            if noise < NO_VERDICT
            else "no_verdict",
            **({"untrained": untrained[:8]} if untrained else {}),
            "loss_error": float(f"{loss_error:.3g}"),
            "worst": worst,
            "worst_error": float(f"{value:.3g}"),
            "torch32_error": float(f"{noise:.3g}"),
            "compared": compared,
            "not_in_plan": missing[:8],
            "warnings": [w[:200] for w in made.warnings],
        }


def _untrained(module: nn.Module, reference: dict[str, np.ndarray], trained: set[str]) -> list[str]:
    """The parameters torch's step changed that the plan does not train under any of their names
    (a tied one's other name, which an exporter may keep, counts)."""
    names = {n: [n] for n, _ in module.named_parameters()}
    for group in tied(module):
        names[group[0]] = group
    values = dict(module.named_parameters())
    return sorted(
        n
        for n, aliases in names.items()
        if n in reference
        and not trained.intersection(aliases)
        and not np.array_equal(reference[n], values[n].detach().numpy())
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=[*ZOO, *NN_ZOO])
    parser.add_argument("--exporters", nargs="+", choices=EXPORTERS, default=["from_torch"])
    parser.add_argument("--side", type=int, help="the image side, for every model (default: each its own)")
    parser.add_argument(
        "--opset", type=int, help="the classic and dynamo_noopt exports' opset (default: export_fixtures')"
    )
    parser.add_argument("--fresh", action="store_true", help="torch.nn models as they initialize, not perturbed")
    args = parser.parse_args(argv)
    if args.opset:
        export_fixtures.CLASSIC_OPSET = export_fixtures.DYNAMO_OPSET = args.opset
    for name in args.only or list(ZOO):
        for exporter in args.exporters:
            if name in NN_ZOO:
                row = run_nn(name, exporter, "fresh" if args.fresh else "perturbed")
            else:
                row = run(name, exporter, args.side)
            print(
                json.dumps({**row, **({"opset": args.opset} if args.opset and exporter != "from_torch" else {})}),
                flush=True,
            )


if __name__ == "__main__":
    main()
