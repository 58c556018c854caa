"""Writes ``embedding_bag.onnx``: ``nn.EmbeddingBag(mode="mean")`` over bags of 4 tokens, then a linear
layer, exported by torch's dynamo exporter (``optimize=False``, opset 21, batch dynamic), which writes
the bags as a ``Loop`` over them building a sequence. onnxruntime 1.32's constant folding crashes the
process (a segmentation fault) on this file; with graph optimizations off it runs.

The tests read the file and never import torch; regenerate it with the benchmark extra installed:

    .venv/bin/python -m tests.emulator.toolchain.data.make_embedding_bag
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import onnx

OUT = Path(__file__).with_name("embedding_bag.onnx")


def main() -> None:
    import torch

    class Bags(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = torch.nn.EmbeddingBag(6, 3, mode="mean")
            self.fc = torch.nn.Linear(3, 2)

        def forward(self, ids):
            return self.fc(self.bag(ids))

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = Path(tmp) / "model.onnx"
        torch.onnx.export(
            Bags().eval(),
            (torch.zeros(2, 4, dtype=torch.int64),),
            str(path),
            dynamo=True,
            optimize=False,
            opset_version=21,
            input_names=["ids"],
            output_names=["logits"],
            dynamic_shapes=({0: torch.export.Dim("batch")},),
            external_data=False,
            verbose=False,
        )
        model = onnx.load(str(path))
    _strip(model.graph)
    onnx.save(model, str(OUT))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


#: node metadata dropped, as benchmarks/export_fixtures.py drops it (the exporting machine's source paths:
#: most of the file); the FX node each came from stays
_DROPPED = ("pkg.torch.onnx.stack_trace", "namespace", "pkg.torch.onnx.class_hierarchy")


def _strip(graph: onnx.GraphProto) -> None:
    """The nodes' :data:`_DROPPED` metadata and doc strings dropped, in subgraphs too."""
    for node in graph.node:
        kept = [p for p in node.metadata_props if p.key not in _DROPPED]
        del node.metadata_props[:]
        node.metadata_props.extend(kept)
        node.doc_string = ""
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _strip(attribute.g)


if __name__ == "__main__":
    main()
