"""A federated analytics plan: a histogram (or a plain count) of one example tensor over the
devices' data, summed by the server in the clear or through Secure Aggregation.

Each device reports, per bin, how many of its values fall in ``[edges[i], edges[i+1])`` (the last
bin also takes its right edge) and how many examples it read; the round's metrics are the fleet's
totals (``bin_00``, ``bin_01``, ..., ``num_examples``). With ``secure_aggregation`` the server only
ever sees the sum: every count is clipped to ``max_examples_per_device`` and quantized to
``bitwidth`` bits (the default of 40 bits keeps each device's rounding error below 1e-7 of an
example, so totals round to the exact count).

The plan is an ``eval`` plan with no weights: nothing is trained, and the checkpoint is empty.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from onnx import TensorProto

from device_runtime.plan import Plan
from device_runtime.plan_builder import assemble_plan

from .autodiff import Emitter
from .server_optimizers import server_part
from .training import MAX_OPSET, MIN_OPSET, _model, _vi

_F32 = TensorProto.FLOAT
VALUES = "values"


def bin_names(num_bins: int) -> tuple[str, ...]:
    return tuple(f"bin_{i:02d}" for i in range(num_bins))


def analytics_plan(
    *,
    feature: str,
    example_selector,
    edges: Sequence[float] | None = None,
    feature_shape: Sequence[int] = (),
    batch_size: int = 256,
    secure_aggregation: bool = False,
    max_examples_per_device: int = 10_000,
    bitwidth: int = 40,
    opset: int = 17,
    name: str | None = None,
) -> Plan:
    """A plan that counts the examples of ``example_selector`` and, with ``edges`` (increasing,
    at least two), histograms the values of example tensor ``feature`` (every entry of it; one
    example's tensor has shape ``feature_shape``)."""
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(f"opset must be in {MIN_OPSET}..{MAX_OPSET}, got {opset}")
    if batch_size < 1 or max_examples_per_device < 1:
        raise ValueError("batch_size and max_examples_per_device must be >= 1")
    bounds = None if edges is None else np.asarray(edges, dtype=np.float32)
    if bounds is not None and (
        bounds.ndim != 1 or len(bounds) < 2 or not np.all(np.diff(bounds) > 0) or not np.all(np.isfinite(bounds))
    ):
        raise ValueError(f"edges must be at least two finite, strictly increasing numbers, got {edges!r}")
    e = Emitter(opset, {}, {}, {VALUES, "count"})
    e.record(VALUES, _F32, ("N", *feature_shape))
    count = e.op(
        "ReduceSum", [e.op("Cast", [e.op("Gather", [e.op("Shape", [VALUES]), e.ints([0])])], to=_F32)], keepdims=0
    )
    e.op("Identity", [count], out="count")
    metrics: list[str] = []
    if bounds is not None:
        flat = e.op("Reshape", [VALUES, e.ints([-1, 1])])
        lo, hi = e.const(bounds[:-1], "lo"), e.const(bounds[1:], "hi")
        inside = e.op("And", [e.op("GreaterOrEqual", [flat, lo]), e.op("Less", [flat, hi])])
        last = e.op("Equal", [flat, e.const(bounds[-1:], "top")])  # the last bin is closed on the right
        onehot_last = e.op("And", [last, e.const(np.arange(len(bounds) - 1) == len(bounds) - 2, "is_last")])
        hits = e.op("Cast", [e.op("Or", [inside, onehot_last])], to=_F32)
        counts = e.reduce("ReduceSum", hits, [0], keepdims=False)
        for i, bin_name in enumerate(bin_names(len(bounds) - 1)):
            e.op("Gather", [counts, e.const(np.array(i, dtype=np.int64), "i")], out=bin_name)
            metrics.append(bin_name)
    metrics.append("count")
    work = _model(
        "work",
        e.nodes,
        [_vi(VALUES, _F32, ["N", *feature_shape])],
        [_vi(m, _F32, ()) for m in metrics],
        e.initializers,
        opset,
    )
    server = server_part(
        {},
        kind="eval",
        metrics=metrics,
        opset=opset,
        secure_sum=secure_aggregation,
        bitwidth=bitwidth,
        clip_range=float(max_examples_per_device),
    )
    return assemble_plan(
        name=name or (f"histogram_{feature}" if bounds is not None else f"count_{feature}"),
        kind="eval",
        work=work,
        weight_names=(),
        weight_outputs=(),
        metric_names=metrics,
        server=server,
        selector=example_selector,
        inputs={VALUES: feature},
        batch_size=batch_size,
        opset=opset,
    )
