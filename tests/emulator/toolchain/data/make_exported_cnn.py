"""Writes ``cnn_torch.onnx``: a small CNN for the 8x8 digits (Conv, BatchNormalization, Relu,
MaxPool, Conv, GlobalAveragePool-like AveragePool, Flatten, Gemm) exported by ``torch.onnx.export``.

The tests read the file and never import torch; regenerate it with the benchmark extra installed:

    .venv/bin/python -m tests.emulator.toolchain.data.make_exported_cnn
"""

from __future__ import annotations

import io
from pathlib import Path

OUT = Path(__file__).with_name("cnn_torch.onnx")


def main() -> None:
    import torch

    class DigitsCNN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = torch.nn.Conv2d(1, 6, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(6)
            self.conv2 = torch.nn.Conv2d(6, 8, 3)
            self.fc = torch.nn.Linear(8 * 2 * 2, 10)

        def forward(self, x):
            x = torch.relu(self.bn(self.conv1(x)))
            x = torch.nn.functional.max_pool2d(x, 2)
            x = torch.relu(self.conv2(x))
            x = torch.nn.functional.avg_pool2d(x, 1)
            return self.fc(torch.flatten(x, 1))

    torch.manual_seed(0)
    model = DigitsCNN()
    with torch.no_grad():  # distinct running statistics (equal initializers would be merged by the exporter)
        model.train()
        for _ in range(3):
            model(torch.randn(16, 1, 8, 8) * 4 + 2)
    model.eval()
    buf = io.BytesIO()
    torch.onnx.export(
        model,
        (torch.zeros(2, 1, 8, 8),),
        buf,
        input_names=["pixels"],
        output_names=["logits"],
        dynamic_axes={"pixels": {0: "N"}, "logits": {0: "N"}},
        opset_version=17,
        dynamo=False,
        do_constant_folding=False,
        training=torch.onnx.TrainingMode.PRESERVE,
    )
    OUT.write_bytes(buf.getvalue())
    print(f"wrote {OUT} ({len(buf.getvalue())} bytes)")


if __name__ == "__main__":
    main()
