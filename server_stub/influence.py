"""Bounding one device's influence on a round before its update is summed.

A client update holds example-weighted sums: each weight tensor is ``delta * n`` and the metric
tensors are sums over the device's ``n = num_examples`` examples. A device that declares an
enormous ``n`` (or sends an enormous delta) could otherwise set the model to anything it likes:
with three devices, ``n = 1e30`` made one of them the whole average. Two standard bounds apply:

- the declared count is capped: an update with ``n > max_examples`` is scaled as a whole by
  ``max_examples / n``, which keeps its per-example means and gives it the weight of
  ``max_examples`` examples;
- the mean delta (``delta * n / n``) is clipped to an L2 norm of ``clip_norm`` across all weight
  tensors (the clipping of DP-FedAvg, without the noise).

Pure: arrays in, arrays out; the arithmetic is float64 and the result float32 like the input."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

NUM_EXAMPLES = "num_examples"


@dataclass(frozen=True)
class Bounded:
    """The update to sum, and what was done to it (for the round's metrics)."""

    update: dict[str, np.ndarray]
    capped: bool
    clipped: bool
    mean_delta_norm: float


def bound_update(
    update: Mapping[str, np.ndarray],
    weight_names: Iterable[str],
    *,
    max_examples: int,
    clip_norm: float | None,
) -> Bounded:
    """Cap the declared example count, then clip the mean delta's norm; see the module docstring."""
    out = {k: np.asarray(v, dtype=np.float64) for k, v in update.items()}
    weights = [w for w in weight_names if w in out]
    n = float(out[NUM_EXAMPLES]) if NUM_EXAMPLES in out else 1.0
    capped = n > max_examples
    if capped:
        scale = max_examples / n
        out = {k: v * scale for k, v in out.items()}
        n = float(max_examples)
    per_example = max(n, 1.0)
    norm = float(np.sqrt(sum(float(np.sum(np.square(out[w] / per_example))) for w in weights))) if weights else 0.0
    clipped = clip_norm is not None and norm > clip_norm
    if clipped:
        assert clip_norm is not None
        factor = clip_norm / norm
        for w in weights:
            out[w] = out[w] * factor
    if not capped and not clipped and all(np.asarray(v).dtype == np.float32 for v in update.values()):
        # nothing was scaled, and float32 -> float64 -> float32 is exact: the update as it came
        return Bounded({k: np.asarray(v) for k, v in update.items()}, False, False, norm)
    result = {k: v.astype(np.float32) for k, v in out.items()}
    return Bounded(result, capped, clipped, norm)
