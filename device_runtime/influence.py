"""Bounding one device's influence on a round before its update is summed.

A client update holds example-weighted sums: each weight tensor is ``delta * n`` and the metric
tensors are sums over the device's ``n = num_examples`` examples. A device that declares an
enormous ``n`` (or sends an enormous delta) could otherwise set the model to anything it likes:
with three devices, ``n = 1e30`` made one of them the whole average. Two standard bounds apply:

- the declared count is capped: an update with ``n > max_examples`` is scaled as a whole by
  ``max_examples / n``, which keeps its per-example means and gives it the weight of
  ``max_examples`` examples;
- the mean delta ``delta * n / n`` is clipped to an L2 norm of ``clip_norm`` across all weight
  tensors (the clipping of DP-FedAvg, without the noise); an update of ``n = 0`` examples has no
  mean, so any weight change it carries is clipped to nothing.

After both, ``||delta * n|| <= clip_norm * n`` holds for every update, so a sum of bounded
updates has a weight part of norm at most ``clip_norm`` times its total count: the committed mean
moves no further than one bounded device could move it. Plain reports are bounded by the server
as they arrive; under Secure Aggregation the server never sees one update, so each device bounds
its own before it masks it, with this same function and the round's bounds from its check-in,
and the server checks what it can, each group's sum (``server_stub.influence.check_group_sum``).

Pure: arrays in, arrays out; the arithmetic is float64 and the result float32 like the input."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from .executor import NUM_EXAMPLES


@dataclass(frozen=True)
class Bounded:
    """The update to sum, and what was done to it (for the round's metrics or the device's log)."""

    update: dict[str, np.ndarray]
    capped: bool
    clipped: bool
    mean_delta_norm: float


def bound_update(
    update: Mapping[str, np.ndarray],
    weight_names: Iterable[str],
    *,
    max_examples: float,
    clip_norm: float | None,
) -> Bounded:
    """Cap the declared example count, then clip the mean delta's norm; see the module docstring.

    The update must be a valid one (``PlanExecutor.validate_update``: finite, ``num_examples``
    not negative); a negative or non-finite count raises ``ValueError``."""
    out = {k: np.asarray(v, dtype=np.float64) for k, v in update.items()}
    weights = [w for w in weight_names if w in out]
    n = float(out[NUM_EXAMPLES]) if NUM_EXAMPLES in out else 1.0
    if not (math.isfinite(n) and n >= 0):
        raise ValueError(f"{NUM_EXAMPLES} is {n}: only a validated update (finite, not negative) can be bounded")
    capped = n > max_examples
    if capped:
        scale = max_examples / n
        out = {k: v * scale for k, v in out.items()}
        n = float(max_examples)
    norm = _mean_delta_norm([out[w] for w in weights], n)
    clipped = clip_norm is not None and norm > clip_norm
    if clipped:
        assert clip_norm is not None
        factor = clip_norm / norm  # 0 for a weight change carried by no examples
        for w in weights:
            out[w] = out[w] * factor
    if not capped and not clipped and all(np.asarray(v).dtype == np.float32 for v in update.values()):
        # nothing was scaled, and float32 -> float64 -> float32 is exact: the update as it came
        return Bounded({k: np.asarray(v) for k, v in update.items()}, False, False, norm)
    result = {k: v.astype(np.float32) for k, v in out.items()}
    return Bounded(result, capped, clipped, norm)


def _mean_delta_norm(weights: list[np.ndarray], n: float) -> float:
    """``||sum of weights|| / n`` across the tensors; with ``n = 0``, 0 for no change and inf otherwise."""
    if n > 0:
        return math.sqrt(sum(float(np.sum(np.square(w / n))) for w in weights))
    return 0.0 if all(not np.any(w) for w in weights) else math.inf


__all__ = ["NUM_EXAMPLES", "Bounded", "bound_update"]
