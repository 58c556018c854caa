"""Real architectures as their libraries define them, for the exporter fixtures and ``plan_autodiff``.

ResNet-18, MobileNetV2 and MobileNetV3-small follow torchvision's definitions (module names,
layer order, BatchNorm and Dropout placement, initialization), with a width that can be cut down
so that a test fixture stays under 200 KB of weights (``small``: 10-150 KB each); the vision transformer follows torchvision's
``VisionTransformer`` (``nn.MultiheadAttention``, a class token, GELU MLPs). BERT, DistilBERT and
ViT come from Hugging Face ``transformers`` with tiny configs. The recurrent and 1-D convolutional
text models are the small classifiers a model engineer writes around ``nn.LSTM``, ``nn.GRU`` and
``nn.Conv1d``; torch.nn's own layers (``nn.TransformerEncoder``, ``nn.Transformer``, ``Conv1d`` and
``Conv3d``, the activations, ``torch.topk`` and the inverse trigonometric functions) have small
families of their own. Random weights only: nothing is downloaded.

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


def _init_convolutions(module: nn.Module, linear_std: float | None = None) -> None:
    """torchvision's MobileNet and EfficientNet initialization of convolutions and BatchNorm, and
    with ``linear_std`` MobileNet's of its linear layers (EfficientNet's differ)."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear) and linear_std is not None:
            nn.init.normal_(m.weight, 0, linear_std)
            nn.init.zeros_(m.bias)


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
        _init_convolutions(self, linear_std=0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


class SqueezeExcitation(nn.Module):
    """torchvision.ops.SqueezeExcitation (MobileNetV3: ReLU and Hardsigmoid; EfficientNet: SiLU and Sigmoid)."""

    def __init__(
        self,
        channels: int,
        squeeze: int,
        activation: Callable[[], nn.Module] = nn.ReLU,
        scale_activation: Callable[[], nn.Module] = nn.Hardsigmoid,
    ) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation = activation()
        self.scale_activation = scale_activation()

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
        _init_convolutions(self, linear_std=0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# ----------------------------------------------------------------------------- torchvision's EfficientNet


class MBConv(nn.Module):
    """torchvision's EfficientNet block: expand, depthwise, squeeze-excite (SiLU, Sigmoid), project."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        expanded = _make_divisible(cin * expand_ratio)
        layers: list[nn.Module] = []
        if expanded != cin:
            layers.append(Conv2dNormActivation(cin, expanded, kernel_size=1, activation=nn.SiLU))
        layers += [
            Conv2dNormActivation(expanded, expanded, kernel, stride, groups=expanded, activation=nn.SiLU),
            SqueezeExcitation(expanded, max(1, cin // 4), nn.SiLU, nn.Sigmoid),
            Conv2dNormActivation(expanded, cout, kernel_size=1, activation=None),
        ]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torchvision's stochastic depth drops whole residual branches at random in training; the
        # fixtures' steps must be deterministic, so it is left out (its rate 0)
        return x + self.block(x) if self.use_res_connect else self.block(x)


class EfficientNet(nn.Module):
    """torchvision.models.efficientnet_b0 (its MBConv table, SiLU, squeeze-excite, Dropout 0.2, init),
    with a width and a depth multiplier as torchvision's B1-B7 scale it."""

    def __init__(self, num_classes: int = 10, width_mult: float = 1.0, depth_mult: float = 1.0, dropout: float = 0.2):
        super().__init__()
        import math

        # expand ratio, kernel, stride, input channels, output channels, layers (torchvision's B0 table)
        table = [
            (1, 3, 1, 32, 16, 1),
            (6, 3, 2, 16, 24, 2),
            (6, 5, 2, 24, 40, 2),
            (6, 3, 2, 40, 80, 3),
            (6, 5, 1, 80, 112, 3),
            (6, 5, 2, 112, 192, 4),
            (6, 3, 1, 192, 320, 1),
        ]
        d = lambda c: _make_divisible(c * width_mult)  # noqa: E731
        layers: list[nn.Module] = [Conv2dNormActivation(3, d(32), stride=2, activation=nn.SiLU)]
        for expand, k, s, cin, cout, n in table:
            stage = []
            for i in range(int(math.ceil(n * depth_mult))):
                stage.append(MBConv(d(cin) if i == 0 else d(cout), d(cout), k, s if i == 0 else 1, expand))
            layers.append(nn.Sequential(*stage))
        last = 4 * d(320)
        layers.append(Conv2dNormActivation(d(320), last, kernel_size=1, activation=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout, inplace=True), nn.Linear(last, num_classes))
        _init_convolutions(self)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                init_range = 1.0 / math.sqrt(m.out_features)
                nn.init.uniform_(m.weight, -init_range, init_range)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# ----------------------------------------------------------------------------- torchvision's ShuffleNetV2


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    batch, channels, height, width = x.size()
    x = x.view(batch, groups, channels // groups, height, width)
    x = torch.transpose(x, 1, 2).contiguous()
    return x.view(batch, -1, height, width)


def _depthwise(channels: int, stride: int) -> nn.Conv2d:
    return nn.Conv2d(channels, channels, 3, stride, 1, bias=False, groups=channels)


class ShuffleUnit(nn.Module):
    """torchvision's ShuffleNetV2 InvertedResidual: a channel split (stride 1) or two branches
    (stride 2), concatenated and shuffled."""

    def __init__(self, inp: int, oup: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        branch = oup // 2
        if stride > 1:
            self.branch1 = nn.Sequential(
                _depthwise(inp, stride),
                nn.BatchNorm2d(inp),
                nn.Conv2d(inp, branch, 1, bias=False),
                nn.BatchNorm2d(branch),
                nn.ReLU(inplace=True),
            )
        else:
            self.branch1 = nn.Sequential()
        self.branch2 = nn.Sequential(
            nn.Conv2d(inp if stride > 1 else branch, branch, 1, bias=False),
            nn.BatchNorm2d(branch),
            nn.ReLU(inplace=True),
            _depthwise(branch, stride),
            nn.BatchNorm2d(branch),
            nn.Conv2d(branch, branch, 1, bias=False),
            nn.BatchNorm2d(branch),
            nn.ReLU(inplace=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


class ShuffleNetV2(nn.Module):
    """torchvision.models.shufflenet_v2_x1_0 (``repeats`` [4, 8, 4], ``channels`` [24, 116, 232, 464, 1024])."""

    def __init__(self, repeats: list[int], channels: list[int], num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(
            nn.Conv2d(3, channels[0], 3, 2, 1, bias=False), nn.BatchNorm2d(channels[0]), nn.ReLU(inplace=True)
        )
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        cin = channels[0]
        for name, n, cout in zip(("stage2", "stage3", "stage4"), repeats, channels[1:]):
            setattr(
                self,
                name,
                nn.Sequential(ShuffleUnit(cin, cout, 2), *[ShuffleUnit(cout, cout, 1) for _ in range(n - 1)]),
            )
            cin = cout
        self.conv5 = nn.Sequential(
            nn.Conv2d(cin, channels[-1], 1, bias=False), nn.BatchNorm2d(channels[-1]), nn.ReLU(inplace=True)
        )
        self.fc = nn.Linear(channels[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.conv1(x))
        x = self.conv5(self.stage4(self.stage3(self.stage2(x))))
        return self.fc(x.mean([2, 3]))


# ----------------------------------------------------------------------------- torchvision's SqueezeNet


class Fire(nn.Module):
    def __init__(self, inplanes: int, squeeze: int, expand1x1: int, expand3x3: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(inplanes, squeeze, kernel_size=1)
        self.squeeze_activation = nn.ReLU(inplace=True)
        self.expand1x1 = nn.Conv2d(squeeze, expand1x1, kernel_size=1)
        self.expand1x1_activation = nn.ReLU(inplace=True)
        self.expand3x3 = nn.Conv2d(squeeze, expand3x3, kernel_size=3, padding=1)
        self.expand3x3_activation = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.squeeze_activation(self.squeeze(x))
        return torch.cat(
            [self.expand1x1_activation(self.expand1x1(x)), self.expand3x3_activation(self.expand3x3(x))], 1
        )


class SqueezeNet(nn.Module):
    """torchvision.models.squeezenet1_1 (Fire modules, ceil-mode max pools, a convolutional classifier
    after Dropout 0.5, init), its channels divided by ``shrink``."""

    def __init__(self, num_classes: int = 10, shrink: int = 1, dropout: float = 0.5) -> None:
        super().__init__()
        c = lambda n: max(1, n // shrink)  # noqa: E731
        fire = lambda i, s, e: Fire(c(i), c(s), c(e), c(e))  # noqa: E731
        self.features = nn.Sequential(
            nn.Conv2d(3, c(64), kernel_size=3, stride=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True),
            fire(64, 16, 64),
            fire(128, 16, 64),
            nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True),
            fire(128, 32, 128),
            fire(256, 32, 128),
            nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True),
            fire(256, 48, 192),
            fire(384, 48, 192),
            fire(384, 64, 256),
            fire(512, 64, 256),
        )
        final_conv = nn.Conv2d(c(512), num_classes, kernel_size=1)
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), final_conv, nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d((1, 1))
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                if m is final_conv:
                    nn.init.normal_(m.weight, mean=0.0, std=0.01)
                else:
                    nn.init.kaiming_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.classifier(self.features(x)), 1)


# ----------------------------------------------------------------------------- torchvision's DenseNet


class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int, bn_size: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, bn_size * growth, kernel_size=1, stride=1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, kernel_size=3, stride=1, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = self.conv1(self.relu1(self.norm1(torch.cat(features, 1))))
        return self.conv2(self.relu2(self.norm2(x)))


class DenseBlock(nn.ModuleDict):
    def __init__(self, layers: int, cin: int, growth: int, bn_size: int) -> None:
        super().__init__()
        for i in range(layers):
            self.add_module(f"denselayer{i + 1}", DenseLayer(cin + i * growth, growth, bn_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseNet(nn.Module):
    """torchvision.models.densenet121 (``growth`` 32, ``blocks`` (6, 12, 24, 16), 64 initial features,
    ``bn_size`` 4): every layer reads the concatenation of all before it; transitions halve the
    channels and average-pool."""

    def __init__(
        self,
        growth: int = 32,
        blocks: tuple[int, ...] = (6, 12, 24, 16),
        init_features: int = 64,
        bn_size: int = 4,
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        layers: list[tuple[str, nn.Module]] = [
            ("conv0", nn.Conv2d(3, init_features, kernel_size=7, stride=2, padding=3, bias=False)),
            ("norm0", nn.BatchNorm2d(init_features)),
            ("relu0", nn.ReLU(inplace=True)),
            ("pool0", nn.MaxPool2d(kernel_size=3, stride=2, padding=1)),
        ]
        channels = init_features
        for i, n in enumerate(blocks):
            layers.append((f"denseblock{i + 1}", DenseBlock(n, channels, growth, bn_size)))
            channels += n * growth
            if i != len(blocks) - 1:
                transition = nn.Sequential()
                transition.add_module("norm", nn.BatchNorm2d(channels))
                transition.add_module("relu", nn.ReLU(inplace=True))
                transition.add_module("conv", nn.Conv2d(channels, channels // 2, kernel_size=1, bias=False))
                transition.add_module("pool", nn.AvgPool2d(kernel_size=2, stride=2))
                layers.append((f"transition{i + 1}", transition))
                channels //= 2
        layers.append(("norm5", nn.BatchNorm2d(channels)))
        from collections import OrderedDict

        self.features = nn.Sequential(OrderedDict(layers))
        self.classifier = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.relu(self.features(x), inplace=True)
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, (1, 1)), 1)
        return self.classifier(x)


# ----------------------------------------------------------------------------- torchvision's ConvNeXt


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor (torchvision's: permuted to NHWC and back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = nn.functional.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class Permute(nn.Module):
    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.permute(x, self.dims)


class CNBlock(nn.Module):
    def __init__(self, dim: int, layer_scale: float = 1e-6) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim, bias=True),
            Permute([0, 2, 3, 1]),
            nn.LayerNorm(dim, eps=1e-6),
            nn.Linear(dim, 4 * dim, bias=True),
            nn.GELU(),
            nn.Linear(4 * dim, dim, bias=True),
            Permute([0, 3, 1, 2]),
        )
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1) * layer_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torchvision's stochastic depth is left out, as in MBConv
        return self.layer_scale * self.block(x) + x


class ConvNeXt(nn.Module):
    """torchvision.models.convnext_tiny (``dims`` 96..768, ``depths`` (3, 3, 9, 3)): a 4x4 patchifying
    stem, depthwise 7x7 blocks with LayerNorm over the channels, GELU and layer scale, LayerNorm2d
    downsampling."""

    def __init__(
        self, dims: tuple[int, ...] = (96, 192, 384, 768), depths: tuple[int, ...] = (3, 3, 9, 3), num_classes: int = 10
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Sequential(nn.Conv2d(3, dims[0], kernel_size=4, stride=4, bias=True), LayerNorm2d(dims[0], eps=1e-6))
        ]
        for i, (dim, depth) in enumerate(zip(dims, depths)):
            layers.append(nn.Sequential(*[CNBlock(dim) for _ in range(depth)]))
            if i + 1 < len(dims):
                layers.append(
                    nn.Sequential(LayerNorm2d(dim, eps=1e-6), nn.Conv2d(dim, dims[i + 1], kernel_size=2, stride=2))
                )
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            LayerNorm2d(dims[-1], eps=1e-6), nn.Flatten(1), nn.Linear(dims[-1], num_classes)
        )
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.avgpool(self.features(x)))


# ----------------------------------------------------------------------------- torchvision's Swin Transformer


def _patch_merging_pad(x: torch.Tensor) -> torch.Tensor:
    height, width, _ = x.shape[-3:]
    x = nn.functional.pad(x, (0, 0, 0, width % 2, 0, height % 2))
    return torch.cat([x[..., 0::2, 0::2, :], x[..., 1::2, 0::2, :], x[..., 0::2, 1::2, :], x[..., 1::2, 1::2, :]], -1)


class PatchMerging(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)
        self.norm = nn.LayerNorm(4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduction(self.norm(_patch_merging_pad(x)))


def shifted_window_attention(
    x: torch.Tensor,
    qkv: nn.Linear,
    proj: nn.Linear,
    relative_position_bias: torch.Tensor,
    window: list[int],
    heads: int,
    shift: list[int],
) -> torch.Tensor:
    """torchvision.models.swin_transformer.shifted_window_attention (its dropouts at 0): pad to whole
    windows, roll by the shift, attend within each window with a relative position bias and, shifted,
    a mask between the rolled-in regions, then roll back."""
    batch, height, width, channels = x.shape
    pad_r = (window[1] - width % window[1]) % window[1]
    pad_b = (window[0] - height % window[0]) % window[0]
    x = nn.functional.pad(x, (0, 0, 0, pad_r, 0, pad_b))
    _, pad_h, pad_w, _ = x.shape
    shift = shift.copy()
    if window[0] >= pad_h:
        shift[0] = 0
    if window[1] >= pad_w:
        shift[1] = 0
    if sum(shift) > 0:
        x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
    windows = (pad_h // window[0]) * (pad_w // window[1])
    x = x.view(batch, pad_h // window[0], window[0], pad_w // window[1], window[1], channels)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(batch * windows, window[0] * window[1], channels)
    q, k, v = qkv(x).reshape(x.size(0), x.size(1), 3, heads, channels // heads).permute(2, 0, 3, 1, 4)
    attn = (q * (channels // heads) ** -0.5).matmul(k.transpose(-2, -1)) + relative_position_bias
    if sum(shift) > 0:
        mask = x.new_zeros((pad_h, pad_w))
        h_slices = ((0, -window[0]), (-window[0], -shift[0]), (-shift[0], None))
        w_slices = ((0, -window[1]), (-window[1], -shift[1]), (-shift[1], None))
        count = 0
        for h in h_slices:
            for w in w_slices:
                mask[h[0] : h[1], w[0] : w[1]] = count
                count += 1
        mask = mask.view(pad_h // window[0], window[0], pad_w // window[1], window[1])
        mask = mask.permute(0, 2, 1, 3).reshape(windows, window[0] * window[1])
        mask = mask.unsqueeze(1) - mask.unsqueeze(2)
        mask = mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)
        attn = attn.view(x.size(0) // windows, windows, heads, x.size(1), x.size(1)) + mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, heads, x.size(1), x.size(1))
    x = proj(nn.functional.softmax(attn, dim=-1).matmul(v).transpose(1, 2).reshape(x.size(0), x.size(1), channels))
    x = x.view(batch, pad_h // window[0], pad_w // window[1], window[0], window[1], channels)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(batch, pad_h, pad_w, channels)
    if sum(shift) > 0:
        x = torch.roll(x, shifts=(shift[0], shift[1]), dims=(1, 2))
    return x[:, :height, :width, :].contiguous()


class ShiftedWindowAttention(nn.Module):
    def __init__(self, dim: int, window: list[int], shift: list[int], heads: int) -> None:
        super().__init__()
        self.window, self.shift, self.heads = window, shift, heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window[0] - 1) * (2 * window[1] - 1), heads))
        coords = torch.flatten(
            torch.stack(torch.meshgrid(torch.arange(window[0]), torch.arange(window[1]), indexing="ij")), 1
        )
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        relative[:, :, 0] += window[0] - 1
        relative[:, :, 1] += window[1] - 1
        relative[:, :, 0] *= 2 * window[1] - 1
        self.register_buffer("relative_position_index", relative.sum(-1).flatten())
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.window[0] * self.window[1]
        bias = self.relative_position_bias_table[self.relative_position_index]
        bias = bias.view(n, n, -1).permute(2, 0, 1).contiguous().unsqueeze(0)
        return shifted_window_attention(x, self.qkv, self.proj, bias, self.window, self.heads, self.shift)


class SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int, window: list[int], shift: list[int], mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ShiftedWindowAttention(dim, window, shift, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))
        for m in self.mlp.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.normal_(m.bias, std=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torchvision's stochastic depth is left out, as in MBConv
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SwinTransformer(nn.Module):
    """torchvision.models.swin_t (``embed`` 96, ``depths`` (2, 2, 6, 2), ``heads`` (3, 6, 12, 24),
    windows of 7, patches of 4): windowed attention shifted by half a window in every second block
    (``torch.roll`` and a mask), patch merging (strided slices, concatenated) between stages."""

    def __init__(
        self,
        embed: int = 96,
        depths: tuple[int, ...] = (2, 2, 6, 2),
        heads: tuple[int, ...] = (3, 6, 12, 24),
        window: int = 7,
        patch: int = 4,
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Sequential(nn.Conv2d(3, embed, patch, patch), Permute([0, 2, 3, 1]), nn.LayerNorm(embed))
        ]
        dim = embed
        for i, (depth, count) in enumerate(zip(depths, heads)):
            layers.append(
                nn.Sequential(
                    *[
                        SwinBlock(dim, count, [window, window], [0, 0] if k % 2 == 0 else [window // 2, window // 2])
                        for k in range(depth)
                    ]
                )
            )
            if i < len(depths) - 1:
                layers.append(PatchMerging(dim))
                dim *= 2
        self.features = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.features(x)).permute(0, 3, 1, 2)
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


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


class CausalBlock(nn.Module):
    """A GPT block written in plain torch: pre-LayerNorm attention through
    ``F.scaled_dot_product_attention`` (causal: ``is_causal``, or a boolean lower-triangular
    ``attn_mask``) on a packed query-key-value projection, then a tanh-GELU MLP."""

    def __init__(self, hidden: int, heads: int, mask: bool) -> None:
        super().__init__()
        self.heads, self.mask = heads, mask
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = (
            z.view(b, t, self.heads, h // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(h, -1)
        )
        if self.mask:
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        else:
            a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class SdpaGPT(nn.Module):
    """A GPT-2-style causal language model in plain torch (as nanoGPT writes one): token and
    learned position embeddings, :class:`CausalBlock` layers (the first with ``is_causal``, the
    others with a boolean mask), a final LayerNorm and an output layer tied to the token embedding;
    the next token at every position."""

    def __init__(
        self, vocab: int = 200, hidden: int = 16, layers: int = 2, heads: int = 2, positions: int = 16
    ) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(positions, hidden)
        self.blocks = nn.ModuleList([CausalBlock(hidden, heads, mask=i > 0) for i in range(layers)])
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class NormCNN(nn.Module):
    """A CNN normalized without BatchNorm: convolutions with GroupNorm, InstanceNorm with affine
    parameters and without (a residual connection around the last), ReLU and SiLU, global average
    pooling and a linear classifier."""

    def __init__(self, num_classes: int = 10, channels: int = 8, groups: int = 4) -> None:
        super().__init__()
        self.conv1, self.gn = nn.Conv2d(3, channels, 3, padding=1), nn.GroupNorm(groups, channels)
        self.conv2, self.inorm = nn.Conv2d(channels, channels, 3, padding=1), nn.InstanceNorm2d(channels, affine=True)
        self.conv3, self.inorm_plain = nn.Conv2d(channels, channels, 3, padding=1), nn.InstanceNorm2d(channels)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.gn(self.conv1(x)))
        x = nn.functional.silu(self.inorm(self.conv2(x)))
        x = torch.relu(self.inorm_plain(self.conv3(x))) + x
        return self.fc(nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


class _Logits(nn.Module):
    """A transformers model's logits alone (its forward returns an output object); ``keywords`` name
    the inputs where they are not its first positional arguments (an encoder-decoder's
    ``decoder_input_ids``)."""

    def __init__(self, model: nn.Module, keywords: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.model = model
        self.keywords = keywords

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.keywords:
            return self.model(**dict(zip(self.keywords, inputs))).logits
        return self.model(*inputs).logits


def _bert_like(
    config_class: Any,
    model_class: Any,
    hidden: int,
    layers: int,
    heads: int,
    vocab: int,
    num_classes: int,
    **extra: Any,
) -> nn.Module:
    """A transformers sequence classifier of BERT's configuration fields, eager attention."""
    config = config_class(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
        num_labels=num_classes,
        attn_implementation="eager",
        **extra,
    )
    return _Logits(model_class(config))


def bert(hidden: int = 32, layers: int = 2, heads: int = 2, vocab: int = 200, num_classes: int = 4) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return _bert_like(BertConfig, BertForSequenceClassification, hidden, layers, heads, vocab, num_classes)


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


def roberta(hidden: int = 32, layers: int = 2, heads: int = 2, vocab: int = 200, num_classes: int = 4) -> nn.Module:
    from transformers import RobertaConfig, RobertaForSequenceClassification

    return _bert_like(RobertaConfig, RobertaForSequenceClassification, hidden, layers, heads, vocab, num_classes)


def albert(
    hidden: int = 32, layers: int = 2, heads: int = 2, embedding: int = 16, vocab: int = 200, num_classes: int = 4
) -> nn.Module:
    """ALBERT: a factorized embedding and one set of layer weights shared by every layer."""
    from transformers import AlbertConfig, AlbertForSequenceClassification

    return _bert_like(
        AlbertConfig,
        AlbertForSequenceClassification,
        hidden,
        layers,
        heads,
        vocab,
        num_classes,
        embedding_size=embedding,
    )


def gpt2(hidden: int = 32, layers: int = 2, heads: int = 2, vocab: int = 200) -> nn.Module:
    """GPT-2's language model: the next token at every position, the output layer tied to the
    token embedding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab, n_positions=64, n_embd=hidden, n_layer=layers, n_head=heads, attn_implementation="eager"
    )
    return _Logits(GPT2LMHeadModel(config))


def _decoder_lm(
    config_class: Any, model_class: Any, hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, **extra: Any
) -> nn.Module:
    """A transformers causal language model of Llama's configuration fields, eager attention."""
    config = config_class(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        attn_implementation="eager",
        **extra,
    )
    return _Logits(model_class(config))


def llama(hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 200) -> nn.Module:
    """Llama's language model: RMSNorm, rotary positions, grouped-query attention, a SiLU-gated MLP."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _decoder_lm(LlamaConfig, LlamaForCausalLM, hidden, layers, heads, kv_heads, vocab)


def qwen2(hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 200) -> nn.Module:
    """Qwen2's language model: Llama's with biases on the query, key and value projections, and the
    output layer tied to the token embedding (as its small releases are)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _decoder_lm(Qwen2Config, Qwen2ForCausalLM, hidden, layers, heads, kv_heads, vocab, tie_word_embeddings=True)


def t5(hidden: int = 32, layers: int = 2, heads: int = 2, vocab: int = 200) -> nn.Module:
    """T5 (encoder-decoder, relative position buckets, RMS layer norm, ReLU feed-forward): the target
    tokens' logits given the source and the shifted target; one embedding shared by the encoder,
    the decoder and the output layer."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=vocab,
        d_model=hidden,
        d_kv=hidden // heads,
        d_ff=2 * hidden,
        num_layers=layers,
        num_heads=heads,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        decoder_start_token_id=0,
        attn_implementation="eager",
    )
    return _Logits(T5ForConditionalGeneration(config), ("input_ids", "decoder_input_ids"))


def bart(hidden: int = 32, layers: int = 2, heads: int = 2, vocab: int = 200) -> nn.Module:
    """BART (encoder-decoder, learned positions, GELU): the target tokens' logits given the source
    and the shifted target; one embedding shared by the encoder, the decoder and the output layer."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=vocab,
        d_model=hidden,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=2 * hidden,
        decoder_ffn_dim=2 * hidden,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    return _Logits(BartForConditionalGeneration(config), ("input_ids", "decoder_input_ids"))


def whisper_encoder(hidden: int = 32, layers: int = 2, heads: int = 2, mels: int = 8, frames: int = 32) -> nn.Module:
    """Whisper's encoder as an audio classifier: two Conv1d with GELU over log-mel frames, a sinusoidal
    position table that does not train (``requires_grad`` off), pre-LayerNorm attention blocks."""
    from transformers import WhisperConfig, WhisperForAudioClassification

    config = WhisperConfig(
        num_mel_bins=mels,
        d_model=hidden,
        encoder_layers=layers,
        encoder_attention_heads=heads,
        encoder_ffn_dim=2 * hidden,
        max_source_positions=frames // 2,
        num_labels=4,
        attn_implementation="eager",
    )
    return _Logits(WhisperForAudioClassification(config))


# ----------------------------------------------------------------------------- torch.nn's own layers


class TransformerClassifier(nn.Module):
    """``nn.TransformerEncoder`` (post-norm ReLU layers, a final LayerNorm) over embedded tokens with
    learned positions, token 0 masked as padding (``src_key_padding_mask``), mean-pooled."""

    def __init__(
        self, vocab: int = 200, hidden: int = 16, layers: int = 2, heads: int = 2, num_classes: int = 4
    ) -> None:
        super().__init__()
        self.embedding, self.position = nn.Embedding(vocab, hidden), nn.Parameter(torch.randn(16, hidden) * 0.02)
        layer = nn.TransformerEncoderLayer(hidden, heads, 2 * hidden, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(hidden), enable_nested_tensor=False)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) + self.position[: tokens.shape[1]]
        return self.fc(self.encoder(x, src_key_padding_mask=tokens == 0).mean(1))


class Seq2SeqTransformer(nn.Module):
    """``nn.Transformer`` (pre-norm GELU layers): the target tokens' logits given the source, the
    target causally masked (``generate_square_subsequent_mask``), the source's token 0 masked as
    padding, one embedding for both and an output layer tied to it."""

    def __init__(self, vocab: int = 200, hidden: int = 16, layers: int = 1, heads: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.transformer = nn.Transformer(
            hidden, heads, layers, layers, 2 * hidden, dropout=0.1, activation="gelu", batch_first=True, norm_first=True
        )
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(target.shape[1], dtype=self.embedding.weight.dtype)
        padding = source == 0
        y = self.transformer(
            self.embedding(source),
            self.embedding(target),
            tgt_mask=causal,
            tgt_is_causal=True,
            src_key_padding_mask=padding,
            memory_key_padding_mask=padding,
        )
        return self.head(y)


class ConvND(nn.Module):
    """``Conv1d`` and ``Conv3d`` over one image: a strided Conv1d, a depthwise one of ``padding="same"``
    with dilation 2 (the classic exporter's ``auto_pad=SAME_UPPER``, which onnxruntime runs only
    with the pads written out), InstanceNorm1d; a Conv3d, a grouped strided one, GroupNorm and
    InstanceNorm3d; ELU and Softplus between them."""

    def __init__(self, channels: int = 4, num_classes: int = 10) -> None:
        super().__init__()
        c = channels
        self.line = nn.Conv1d(3, c, 5, stride=2, padding=2)
        self.line_same = nn.Conv1d(c, c, 3, padding="same", dilation=2, groups=c)
        self.line_norm = nn.InstanceNorm1d(c, affine=True)
        self.volume = nn.Conv3d(1, c, 3, padding=1)
        self.volume_norm = nn.GroupNorm(2, c)
        self.volume_grouped = nn.Conv3d(c, c, 3, stride=2, groups=2)
        self.volume_instance = nn.InstanceNorm3d(c)
        self.fc = nn.Linear(2 * c, num_classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        a = self.line_norm(self.line_same(nn.functional.elu(self.line(image.flatten(2)))))
        b = self.volume(image.unsqueeze(1))
        b = self.volume_instance(self.volume_grouped(nn.functional.softplus(self.volume_norm(b))))
        return self.fc(torch.cat([a.mean(2), b.mean((2, 3, 4))], 1))


class Activations(nn.Module):
    """torch.nn's activations in a row: PReLU (one slope, and one per feature), ELU, Softplus, Mish,
    GLU, then the sum of SELU, CELU, Hardtanh, LogSigmoid, Softsign, Tanhshrink, SiLU, ReLU6,
    Hardswish, LeakyReLU and a Softplus of beta 2 and threshold 1."""

    def __init__(self, features: int = 48, hidden: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.inp, self.prelu = nn.Linear(features, hidden), nn.PReLU()
        self.l2, self.prelu2 = nn.Linear(hidden, hidden), nn.PReLU(hidden)
        self.l3, self.l4, self.l5 = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.l6, self.fc = nn.Linear(hidden, 2 * hidden), nn.Linear(hidden, num_classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        f = nn.functional
        h = self.prelu2(self.l2(self.prelu(self.inp(image.flatten(1)))))
        h = f.glu(self.l6(f.mish(self.l5(f.softplus(self.l4(f.elu(self.l3(h))))))))
        h = f.selu(h) + f.celu(h) + f.hardtanh(h) + f.logsigmoid(h) + f.softsign(h) + f.tanhshrink(h)
        h = h + f.silu(h) + f.relu6(h) + f.hardswish(h) + f.leaky_relu(h, 0.1) + f.softplus(h, beta=2.0, threshold=1.0)
        return self.fc(h)


class RankedTrig(nn.Module):
    """``torch.topk`` and ``torch.sort`` of features (ONNX ``TopK``), ``torch.atan2``, ``asin``,
    ``acos`` and ``tan`` of others (``Atan``, ``Asin``, ``Acos``, ``Tan``; the classic exporter has no
    ``sinh`` or ``cosh``), a linear classifier."""

    def __init__(self, features: int = 48, hidden: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.inp, self.fc = (
            nn.Linear(features, 2 * hidden),
            nn.Linear(hidden // 2 + hidden // 4 + hidden // 4, num_classes),
        )
        self.hidden = hidden

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        h = self.inp(image.flatten(1))
        q = self.hidden // 4
        a, b = h[:, : self.hidden], h[:, self.hidden :]
        top = a.topk(self.hidden // 2, dim=1).values
        ranked = b.sort(dim=1, descending=True).values[:, :q]
        angles = torch.atan2(b[:, :q], b[:, q : 2 * q]) + torch.asin(torch.tanh(b[:, 2 * q : 3 * q]))
        return self.fc(
            torch.cat([top, ranked * torch.acos(torch.tanh(ranked) * 0.9), angles + torch.tan(angles * 0.3)], 1)
        )


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
    #: a label per example (``()``) or per position (``(16,)``: a language model's next tokens)
    label_shape: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


_IMAGE = (Input("image", (3, 32, 32)),)
_TOKENS = (Input("tokens", (16,), "int64", 200),)
_BERT = (Input("input_ids", (16,), "int64", 200), Input("attention_mask", (16,), "int64", 2))
_SEQ2SEQ = (Input("input_ids", (16,), "int64", 200), Input("decoder_input_ids", (16,), "int64", 200))

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
    "gpt_sdpa": ModelSpec("torch.nn", SdpaGPT, partial(SdpaGPT, 1000, 128, 4, 4), _TOKENS, 200, label_shape=(16,)),
    "norm_cnn": ModelSpec("torch.nn", NormCNN, partial(NormCNN, 10, 64, 8), _IMAGE, 10),
    "efficientnet_b0": ModelSpec(
        "torchvision",
        partial(EfficientNet, 10, 0.1, 0.34),
        partial(EfficientNet, 10, 1.0, 1.0),
        _IMAGE,
        10,
    ),
    "shufflenet_v2": ModelSpec(
        "torchvision",
        partial(ShuffleNetV2, [2, 2, 2], [8, 16, 32, 64, 64]),
        partial(ShuffleNetV2, [4, 8, 4], [24, 116, 232, 464, 1024]),
        _IMAGE,
        10,
    ),
    "squeezenet": ModelSpec("torchvision", partial(SqueezeNet, 10, 8), partial(SqueezeNet, 10, 1), _IMAGE, 10),
    "densenet": ModelSpec(
        "torchvision",
        partial(DenseNet, 4, (2, 2), 8, 2),
        partial(DenseNet, 32, (6, 12, 24, 16), 64, 4),
        _IMAGE,
        10,
    ),
    "convnext": ModelSpec(
        "torchvision",
        partial(ConvNeXt, (8, 16), (2, 2)),
        partial(ConvNeXt, (96, 192, 384, 768), (3, 3, 9, 3)),
        _IMAGE,
        10,
    ),
    "swin": ModelSpec(
        "torchvision",
        partial(SwinTransformer, 16, (2, 2), (2, 4), 4),
        partial(SwinTransformer, 96, (2, 2, 6, 2), (3, 6, 12, 24), 4),
        _IMAGE,
        10,
    ),
    "whisper_encoder": ModelSpec(
        "transformers",
        partial(whisper_encoder, 16),
        partial(whisper_encoder, 128, 4, 4, 80, 200),
        (Input("input_features", (8, 32)),),
        4,
    ),
    "roberta": ModelSpec("transformers", partial(roberta, 16), partial(roberta, 128, 2, 2, 1000), _BERT, 4),
    "albert": ModelSpec("transformers", partial(albert, 16, 2, 2, 8), partial(albert, 128, 4, 2, 64, 1000), _BERT, 4),
    "gpt2": ModelSpec(
        "transformers", partial(gpt2, 16), partial(gpt2, 128, 2, 2, 1000), _TOKENS, 200, label_shape=(16,)
    ),
    "llama": ModelSpec(
        "transformers", partial(llama, 16), partial(llama, 128, 2, 4, 2, 1000), _TOKENS, 200, label_shape=(16,)
    ),
    "qwen2": ModelSpec(
        "transformers", partial(qwen2, 16), partial(qwen2, 128, 2, 4, 2, 1000), _TOKENS, 200, label_shape=(16,)
    ),
    "t5": ModelSpec("transformers", partial(t5, 16), partial(t5, 128, 2, 2, 1000), _SEQ2SEQ, 200, label_shape=(16,)),
    "bart": ModelSpec(
        "transformers", partial(bart, 16), partial(bart, 128, 2, 2, 1000), _SEQ2SEQ, 200, label_shape=(16,)
    ),
    "nn_transformer_encoder": ModelSpec(
        "torch.nn", TransformerClassifier, partial(TransformerClassifier, 1000, 128, 4, 4), _TOKENS, 4
    ),
    "nn_transformer": ModelSpec(
        "torch.nn",
        Seq2SeqTransformer,
        partial(Seq2SeqTransformer, 1000, 128, 2, 4),
        (Input("source", (16,), "int64", 200), Input("target", (16,), "int64", 200)),
        200,
        label_shape=(16,),
    ),
    "conv_nd": ModelSpec("torch.nn", ConvND, partial(ConvND, 32), (Input("image", (3, 8, 8)),), 10),
    "activations": ModelSpec("torch.nn", Activations, partial(Activations, 48, 256), (Input("image", (3, 4, 4)),), 10),
    "ranked_trig": ModelSpec("torch.nn", RankedTrig, partial(RankedTrig, 48, 256), (Input("image", (3, 4, 4)),), 10),
}


def spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise SystemExit(f"no model {name!r}; choose from {', '.join(MODELS)}") from None
