"""torch's dynamo exporter asked for opset 17, which it writes at opset 18 and lowers with onnx's
version converter (dropping every piece of the exporter's metadata), and the same export at opset 18:
the fixtures of a test in ``tests/emulator/toolchain/test_model_bundle.py``, which never
imports torch.

    PYTHONPATH=. python -m benchmarks.lowered_dynamo_fixtures [--out DIR]

(needs torch and onnxscript: the ``bench`` or ``torch`` extra). One MLP (``Linear(6, 8)``, ReLU,
``Linear(8, 3)``) over two positions per example (``x`` [N, 2, 6], so that each layer is a ``MatMul``
of the weight's transpose), in train mode, exported as a model engineer calls it: ``torch.onnx.export(module,
(x,), path, dynamo=True, opset_version=OPSET, input_names=["x"], dynamic_shapes=({0: batch},),
external_data=False)`` with the exporter's default ``optimize=True``, which folds each weight's
transpose into a new constant (``val_...``); ``mlp.dynamo.opset<OPSET>.onnx``, a few KB each.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
from torch import nn

OUT = Path(__file__).resolve().parent.parent / "tests" / "emulator" / "toolchain" / "exported" / "lowered"
OPSETS = (17, 18)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    out: Path = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    x = torch.randn(4, 2, 6)
    for opset in OPSETS:
        path = out / f"mlp.dynamo.opset{opset}.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                mlp(),
                (x,),
                str(path),
                dynamo=True,
                opset_version=opset,
                input_names=["x"],
                dynamic_shapes=({0: torch.export.Dim("batch")},),
                external_data=False,
                verbose=False,
            )
        print(path, path.stat().st_size)


if __name__ == "__main__":
    main()
