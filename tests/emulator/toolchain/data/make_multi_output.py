"""Writes ``two_heads.onnx`` and ``aux_first.onnx``: small modules whose forward returns several
tensors, exported by torch's dynamo exporter (``optimize=False``, opset 21, batch dynamic) with each
output under the name the module gives it:

- ``two_heads.onnx``: ``(logits [N, 3], features [N, 16])``, two float outputs with a batch axis and a
  class axis, of which the plan cannot tell which the loss reads;
- ``aux_first.onnx``: ``(aux_loss [], logits [N, 3])``, a scalar regularization term before the logits,
  which a plan trained on the first float output would take for the prediction.

The tests read the files and never import torch; regenerate them with the benchmark extra installed:

    .venv/bin/python -m tests.emulator.toolchain.data.make_multi_output
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import onnx

from .make_embedding_bag import _strip

HERE = Path(__file__).parent


def main() -> None:
    import torch

    class TwoHeads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(8, 16)
            self.head = torch.nn.Linear(16, 3)

        def forward(self, x):
            features = torch.relu(self.body(x))
            return self.head(features), features

    class AuxFirst(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(8, 3)

        def forward(self, x):
            logits = self.head(x)
            return (logits**2).mean(), logits

    for module, name, outputs in (
        (TwoHeads, "two_heads", ["logits", "features"]),
        (AuxFirst, "aux_first", ["aux_loss", "logits"]),
    ):
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = Path(tmp) / "model.onnx"
            torch.onnx.export(
                module().train(),
                (torch.randn(2, 8),),
                str(path),
                dynamo=True,
                optimize=False,
                opset_version=21,
                input_names=["x"],
                output_names=outputs,
                dynamic_shapes=({0: torch.export.Dim("batch")},),
                external_data=False,
                verbose=False,
            )
            model = onnx.load(str(path))
        _strip(model.graph)
        out = HERE / f"{name}.onnx"
        onnx.save(model, str(out))
        print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
