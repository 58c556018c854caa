"""torch's classic exporter at the opsets of its older users (9-12), and torch's own training step for
each: the fixtures of ``tests/emulator/toolchain/test_old_opsets.py``, which never imports torch.

    PYTHONPATH=. python -m benchmarks.old_opset_fixtures [--out DIR]

(needs torch: the ``bench`` or ``torch`` extra). Four small modules (:data:`MODULES`: a CNN with
BatchNorm and Dropout, a residual block with BatchNorm, an LSTM classifier over token ids, an MLP
ending in ``log_softmax``), each perturbed (10% noise on every parameter and running statistic, as
``benchmarks.export_fixtures`` does) and with its dropout probability 0, are exported with
``torch.onnx.export(module, (x,), path, dynamo=False, opset_version=OPSET, training=MODE,
do_constant_folding=MODE is EVAL, dynamic_axes=<batch>)`` at the opsets and modes of :data:`EXPORTS`
(``viewcnn``, flattened with ``x.view(x.size(0), -1)`` and ending in ``softmax``, without
``dynamic_axes``, as the export's own default has it: ``.static.onnx``, its batch size of 4 in the
graph):
``PRESERVE`` keeps BatchNorm with its five training outputs (opsets 9-13) and Dropout with its ratio;
``EVAL`` with constant folding, torch's default, folds BatchNorm into the convolutions (and is also
exported at opset 17: the network the older file must train as). Beside each
module, ``<module>.npz``: the batch (``x``, ``y``), the loss and every parameter and running statistic
after one SGD step (learning rate :data:`LR`) of torch autograd in float64 from the float32 values
(``after/<torch name>``), in train mode, and the loss of its first three examples (``loss3``). The files are a few KB each, uncompressed.
"""

from __future__ import annotations

import argparse
import copy
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

from benchmarks.export_fixtures import LR, perturb, reference_step, without_dropout

OUT = Path(__file__).resolve().parent.parent / "tests" / "emulator" / "toolchain" / "exported" / "old_opsets"
BATCH = 4


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.drop, self.fc = nn.Dropout(0.25), nn.Linear(8 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        x = torch.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(self.drop(torch.flatten(x, 1)))


class ResidualBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn0 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn0(self.stem(x)))
        x = torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.lstm, self.fc = nn.Embedding(50, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, (h, _) = self.lstm(self.embedding(tokens))
        return self.fc(h[-1])


class LogSoftmaxMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(12, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.out(torch.relu(self.hidden(x))), dim=1)


class ViewSoftmaxCNN(nn.Module):
    """Flattened by ``x.view(x.size(0), -1)`` and ending in ``softmax``: exported without
    ``dynamic_axes``, the trace writes the batch size as a constant of the Reshape's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(4 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return torch.softmax(self.fc(x.view(x.size(0), -1)), dim=1)


#: module -> (class, the batch's input, the number of classes)
MODULES = {
    "cnn": (SmallCNN, lambda g: torch.randn(BATCH, 1, 8, 8, generator=g), 10),
    "resblock": (ResidualBlock, lambda g: torch.randn(BATCH, 3, 8, 8, generator=g), 10),
    "lstm": (LSTMClassifier, lambda g: torch.randint(0, 50, (BATCH, 6), generator=g), 5),
    "mlp": (LogSoftmaxMLP, lambda g: torch.randn(BATCH, 12, generator=g), 3),
    "viewcnn": (ViewSoftmaxCNN, lambda g: torch.randn(BATCH, 1, 8, 8, generator=g), 10),
}
#: (module, opset, mode, with a dynamic batch axis) exported
EXPORTS = [
    ("cnn", 9, "preserve", True),
    ("cnn", 12, "preserve", True),
    ("cnn", 10, "eval", True),
    ("cnn", 17, "eval", True),
    ("resblock", 9, "preserve", True),
    ("resblock", 11, "preserve", True),
    ("lstm", 9, "preserve", True),
    ("lstm", 12, "eval", True),
    ("lstm", 17, "eval", True),
    ("mlp", 10, "preserve", True),
    ("viewcnn", 9, "preserve", False),
    ("viewcnn", 11, "eval", False),
]


def file_name(module: str, opset: int, mode: str, dynamic: bool) -> str:
    return f"{module}.opset{opset}.{mode}{'' if dynamic else '.static'}.onnx"


def export(module: nn.Module, x: torch.Tensor, opset: int, mode: str, dynamic: bool, path: Path) -> None:
    preserve = mode == "preserve"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            copy.deepcopy(module).train(preserve),
            (x,),
            str(path),
            dynamo=False,
            opset_version=opset,
            training=torch.onnx.TrainingMode.PRESERVE if preserve else torch.onnx.TrainingMode.EVAL,
            do_constant_folding=not preserve,
            input_names=["x"],
            output_names=["logits"],
            dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}} if dynamic else None,
        )
    model = onnx.load(str(path))
    # the trace of a train-mode module moves BatchNorm's running statistics: the module's are written
    buffers = {n: b.detach().numpy() for n, b in module.named_buffers() if b.is_floating_point()}
    for init in model.graph.initializer:
        if init.name in buffers:
            init.CopyFrom(numpy_helper.from_array(buffers[init.name], init.name))
    model.producer_version = torch.__version__
    onnx.save(model, str(path))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    modules = {}
    for name, (cls, make_input, classes) in MODULES.items():
        generator = torch.Generator().manual_seed(sum(map(ord, name)))
        torch.manual_seed(sum(map(ord, name)))
        module = without_dropout(cls())
        perturb(module, generator)
        x = make_input(generator)
        y = torch.randint(0, classes, (BATCH,), generator=generator)
        loss, after, _ = reference_step(module, [x], y)
        loss3 = reference_step(module, [x[:3]], y[:3])[0]  # a short last batch, which a fixed batch axis refuses
        np.savez_compressed(
            args.out / f"{name}.npz",
            x=x.numpy(),
            y=y.numpy(),
            loss=np.float64(loss),
            loss3=np.float64(loss3),
            lr=np.float64(LR),
            **{f"after/{n}": v for n, v in after.items()},
        )
        modules[name] = (module, x)
    for name, opset, mode, dynamic in EXPORTS:
        module, x = modules[name]
        export(module, x, opset, mode, dynamic, args.out / file_name(name, opset, mode, dynamic))
        print(file_name(name, opset, mode, dynamic), flush=True)


if __name__ == "__main__":
    main()
