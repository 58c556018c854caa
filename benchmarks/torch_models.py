"""Real architectures as their libraries define them, for the exporter fixtures and ``plan_autodiff``.

ResNet-18, MobileNetV2 and MobileNetV3-small follow torchvision's definitions (module names,
layer order, BatchNorm and Dropout placement, initialization), with a width that can be cut down
so that a test fixture stays under 200 KB of weights (``small``: 10-150 KB each); the vision transformer follows torchvision's
``VisionTransformer`` (``nn.MultiheadAttention``, a class token, GELU MLPs). BERT, DistilBERT and
ViT come from Hugging Face ``transformers`` with tiny configs. The recurrent and 1-D convolutional
text models are the small classifiers a model engineer writes around ``nn.LSTM``, ``nn.GRU`` and
``nn.Conv1d``. Random weights only: nothing is downloaded.

Needs the ``bench`` extra (torch and transformers); the tests never import this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

__all__ = ["Input", "ModelSpec", "MODELS", "spec"]


# ----------------------------------------------------------------------------- torchvision's ResNet


def _conv3x3(cin: int, cout: int, stride: int = 1, groups: int = 1, dilation: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=dilation, groups=groups, bias=False, dilation=dilation)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision.models.ResNet with BasicBlocks; ``width`` is the first stage's planes (64 there)."""

    def __init__(self, layers: list[int], num_classes: int = 10, width: int = 64) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * BasicBlock.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(_conv1x1(self.inplanes, planes, stride), nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 10, width: int = 64) -> ResNet:
    return ResNet([2, 2, 2, 2], num_classes, width)


# ----------------------------------------------------------------------------- torchvision's MobileNets


def _make_divisible(v: float, divisor: int = 8, min_value: int | None = None) -> int:
    min_value = min_value or divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class Conv2dNormActivation(nn.Sequential):
    def __init__(
        self,
        cin: int,
        cout: int,
        kernel_size: int = 3,
        stride: int = 1,
        groups: int = 1,
        activation: Callable[..., nn.Module] | None = nn.ReLU6,
    ) -> None:
        layers: list[nn.Module] = [
            nn.Conv2d(cin, cout, kernel_size, stride, (kernel_size - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
        ]
        if activation is not None:
            layers.append(activation(inplace=True))
        super().__init__(*layers)


class InvertedResidual(nn.Module):
    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(Conv2dNormActivation(inp, hidden, kernel_size=1))
        layers += [
            Conv2dNormActivation(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    """torchvision.models.MobileNetV2 (its inverted-residual table, ReLU6, Dropout 0.2, init)."""

    def __init__(
        self,
        num_classes: int = 10,
        width_mult: float = 1.0,
        dropout: float = 0.2,
        last_channel: int | None = None,
        round_nearest: int = 8,
    ) -> None:
        super().__init__()
        settings = [
            [1, 16, 1, 1],
            [6, 24, 2, 2],
            [6, 32, 3, 2],
            [6, 64, 4, 2],
            [6, 96, 3, 1],
            [6, 160, 3, 2],
            [6, 320, 1, 1],
        ]
        input_channel = _make_divisible(32 * width_mult, round_nearest)
        # torchvision keeps 1280 at any width; ``last_channel`` cuts it for a small fixture
        self.last_channel = last_channel or _make_divisible(1280 * max(1.0, width_mult), round_nearest)
        features: list[nn.Module] = [Conv2dNormActivation(3, input_channel, stride=2)]
        for t, c, n, s in settings:
            output_channel = _make_divisible(c * width_mult, round_nearest)
            for i in range(n):
                features.append(InvertedResidual(input_channel, output_channel, s if i == 0 else 1, t))
                input_channel = output_channel
        features.append(Conv2dNormActivation(input_channel, self.last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(self.last_channel, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeeze: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class InvertedResidualV3(nn.Module):
    def __init__(
        self, cin: int, kernel: int, expanded: int, cout: int, use_se: bool, hardswish: bool, stride: int
    ) -> None:
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        act = nn.Hardswish if hardswish else nn.ReLU
        layers: list[nn.Module] = []
        if expanded != cin:
            layers.append(Conv2dNormActivation(cin, expanded, kernel_size=1, activation=act))
        layers.append(
            Conv2dNormActivation(expanded, expanded, kernel_size=kernel, stride=stride, groups=expanded, activation=act)
        )
        if use_se:
            layers.append(SqueezeExcitation(expanded, _make_divisible(expanded // 4)))
        layers.append(Conv2dNormActivation(expanded, cout, kernel_size=1, activation=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.use_res_connect else self.block(x)


class MobileNetV3(nn.Module):
    """torchvision.models.mobilenet_v3_small: SE blocks with Hardsigmoid, Hardswish, Dropout 0.2."""

    def __init__(
        self, num_classes: int = 10, width_mult: float = 1.0, dropout: float = 0.2, last_channel: int | None = None
    ) -> None:
        super().__init__()
        d = lambda c: _make_divisible(c * width_mult)  # noqa: E731
        # input channels, kernel, expanded, output channels, SE, hardswish, stride (torchvision's small table)
        table = [
            (16, 3, 16, 16, True, False, 2),
            (16, 3, 72, 24, False, False, 2),
            (24, 3, 88, 24, False, False, 1),
            (24, 5, 96, 40, True, True, 2),
            (40, 5, 240, 40, True, True, 1),
            (40, 5, 240, 40, True, True, 1),
            (40, 5, 120, 48, True, True, 1),
            (48, 5, 144, 48, True, True, 1),
            (48, 5, 288, 96, True, True, 2),
            (96, 5, 576, 96, True, True, 1),
            (96, 5, 576, 96, True, True, 1),
        ]
        layers: list[nn.Module] = [Conv2dNormActivation(3, d(16), stride=2, activation=nn.Hardswish)]
        for cin, k, exp, cout, se, hs, s in table:
            layers.append(InvertedResidualV3(d(cin), k, d(exp), d(cout), se, hs, s))
        last_conv = 6 * d(96)
        layers.append(Conv2dNormActivation(d(96), last_conv, kernel_size=1, activation=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        # torchvision's MobileNetV3 takes last_channel (1024 for small, scaled by the width)
        last_channel = last_channel or _make_divisible(1024 * width_mult)
        self.classifier = nn.Sequential(
            nn.Linear(last_conv, last_channel),
            nn.Hardswish(inplace=True),
            nn.Dropout(p=dropout, inplace=True),
            nn.Linear(last_channel, num_classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# ----------------------------------------------------------------------------- torchvision's ViT


class EncoderBlock(nn.Module):
    def __init__(self, heads: int, dim: int, mlp_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(dim, heads, dropout=0.0, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(mlp_dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = self.dropout(y) + x
        return x + self.mlp(self.ln_2(x))


class VisionTransformer(nn.Module):
    """torchvision.models.VisionTransformer: a patchifying Conv, a class token, learned positions."""

    def __init__(
        self,
        image_size: int = 32,
        patch_size: int = 8,
        layers: int = 2,
        heads: int = 4,
        dim: int = 64,
        mlp_dim: int = 128,
        num_classes: int = 10,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.patch_size, self.dim = patch_size, dim
        self.conv_proj = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size)
        seq = (image_size // patch_size) ** 2 + 1
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.empty(1, seq, dim).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.Sequential(*[EncoderBlock(heads, dim, mlp_dim, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x)
        x = x.reshape(x.shape[0], self.dim, -1).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.ln(self.layers(self.dropout(x + self.pos_embedding)))
        return self.head(x[:, 0])


# ----------------------------------------------------------------------------- text models


class LSTMClassifier(nn.Module):
    def __init__(self, vocab: int = 200, embed: int = 16, hidden: int = 32, num_classes: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embedding(tokens))
        return self.fc(out[:, -1])


class GRUNextToken(nn.Module):
    """The next token after the sequence (the last step's output over the vocabulary); with
    ``tie_weights`` the decoder reads the embedding's weight, as PyTorch's word_language_model
    example ties them (Press and Wolf, 2017; needs ``embed == hidden``)."""

    def __init__(self, vocab: int = 200, embed: int = 16, hidden: int = 32, tie_weights: bool = False) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.gru = nn.GRU(embed, hidden, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)
        if tie_weights:
            self.decoder.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.embedding(tokens))
        return self.decoder(out[:, -1])


class Conv1dText(nn.Module):
    def __init__(self, vocab: int = 200, embed: int = 16, channels: int = 32, num_classes: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.conv = nn.Conv1d(embed, channels, 3, padding=1)
        self.dropout = nn.Dropout(0.1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv(self.embedding(tokens).transpose(1, 2)))
        return self.fc(self.dropout(torch.amax(x, dim=2)))


class _Logits(nn.Module):
    """A transformers model's logits alone (its forward returns an output object)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(*inputs).logits


def bert(hidden: int = 32, layers: int = 2, heads: int = 2, vocab: int = 200, num_classes: int = 4) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
        num_labels=num_classes,
        attn_implementation="eager",
    )
    return _Logits(BertForSequenceClassification(config))


def distilbert(hidden: int = 32, layers: int = 2, heads: int = 2, vocab: int = 200, num_classes: int = 4) -> nn.Module:
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    config = DistilBertConfig(
        vocab_size=vocab,
        dim=hidden,
        n_layers=layers,
        n_heads=heads,
        hidden_dim=2 * hidden,
        max_position_embeddings=64,
        num_labels=num_classes,
        attn_implementation="eager",
    )
    return _Logits(DistilBertForSequenceClassification(config))


def hf_vit(
    hidden: int = 32, layers: int = 2, heads: int = 2, image_size: int = 32, patch_size: int = 8, num_classes: int = 10
) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        image_size=image_size,
        patch_size=patch_size,
        num_labels=num_classes,
        attn_implementation="eager",
    )
    return _Logits(ViTForImageClassification(config))


# ----------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Input:
    """One model input: its name, its shape without the batch axis, and how to draw its values."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"  # "float32" (standard normal) or "int64" (uniform in [0, high))
    high: int = 0


@dataclass(frozen=True)
class ModelSpec:
    """A family: how to make the module at fixture size and at benchmark size, its inputs, its classes."""

    family: str
    small: Callable[[], nn.Module]
    full: Callable[[], nn.Module]
    inputs: tuple[Input, ...]
    classes: int
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


_IMAGE = (Input("image", (3, 32, 32)),)
_TOKENS = (Input("tokens", (16,), "int64", 200),)
_BERT = (Input("input_ids", (16,), "int64", 200), Input("attention_mask", (16,), "int64", 2))

MODELS: dict[str, ModelSpec] = {
    "resnet18": ModelSpec("torchvision", partial(resnet18, 10, 2), partial(resnet18, 10, 64), _IMAGE, 10),
    "mobilenet_v2": ModelSpec(
        "torchvision",
        partial(MobileNetV2, 10, 0.1, last_channel=32, round_nearest=4),
        partial(MobileNetV2, 10, 1.0),
        _IMAGE,
        10,
    ),
    "mobilenet_v3_small": ModelSpec(
        "torchvision", partial(MobileNetV3, 10, 0.1, last_channel=32), partial(MobileNetV3, 10, 1.0), _IMAGE, 10
    ),
    "vit": ModelSpec(
        "torchvision",
        partial(VisionTransformer, dim=16, mlp_dim=32),
        partial(VisionTransformer, patch_size=4, layers=4, heads=4, dim=128, mlp_dim=256),
        _IMAGE,
        10,
    ),
    "hf_vit": ModelSpec("transformers", partial(hf_vit, 16), partial(hf_vit, 128, 4, 4, 32, 4), _IMAGE, 10),
    "bert": ModelSpec("transformers", partial(bert, 16), partial(bert, 128, 2, 2, 1000), _BERT, 4),
    "distilbert": ModelSpec("transformers", partial(distilbert, 16), partial(distilbert, 128, 2, 2, 1000), _BERT, 4),
    "lstm": ModelSpec(
        "torch.nn", partial(LSTMClassifier, 200, 16, 16), partial(LSTMClassifier, 1000, 64, 128), _TOKENS, 4
    ),
    "gru_next_token": ModelSpec(
        "torch.nn", partial(GRUNextToken, 200, 16, 16), partial(GRUNextToken, 200, 64, 128), _TOKENS, 200
    ),
    "conv1d_text": ModelSpec("torch.nn", Conv1dText, partial(Conv1dText, 1000, 64, 128), _TOKENS, 4),
}


def spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise SystemExit(f"no model {name!r}; choose from {', '.join(MODELS)}") from None
