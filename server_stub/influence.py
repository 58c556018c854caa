"""Bounding devices' influence on a round: one report at a time, or one Secure Aggregation group.

A plain report is bounded as it arrives by ``bound_update`` (``device_runtime.influence``, the
one definition: the example count capped at ``max_examples_per_report``, the mean delta clipped
to ``clip_update_norm``). Under Secure Aggregation the server never sees one device's update:
each device bounds its own with the same function before masking it, and the server checks the
one thing it does see, each group's decoded sum, before the sum is used (``check_group_sum``).

Pure: values in, verdicts out."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from device_runtime.influence import NUM_EXAMPLES, Bounded, bound_update

#: Relative slack of the norm check for the float32 rounding of each device's bounded update.
FLOAT32_SLACK = 1e-6


def check_group_sum(
    total: Mapping[str, np.ndarray],
    weight_names: Iterable[str],
    *,
    members: int,
    max_examples: int,
    clip_norm: float | None,
    tolerance: float = 0.0,
) -> str | None:
    """None if ``total`` (the decoded sum of ``members`` devices' updates) is one that devices
    bounded by ``bound_update`` could have sent; otherwise why it is not, for the round's metrics.

    With ``N`` the sum's ``num_examples`` and ``W`` its weight tensors, a sum passes when every
    value is finite, ``0 <= N <= members * max_examples`` and ``||W|| <= clip_norm * N``. Every
    bounded update has ``||w_i|| <= clip_norm * n_i``, so an honest group always passes, and a
    passing group moves the mean ``W / N`` by at most ``clip_norm``: whatever one of its members
    sent, the round's model moves no more than one honest device could move it. (A member can
    still spend the budget the others leave unused: its group's slack.) ``tolerance`` is the
    largest error of one decoded entry (``SecureSumCodec.sum_error``); each bound is widened by
    that much, and the norm by ``FLOAT32_SLACK`` for the rounding of the updates to float32."""
    for name, value in total.items():
        if not np.isfinite(np.asarray(value, dtype=np.float64)).all():
            return f"the sum's {name!r} holds NaN or infinite values"
    n = float(total[NUM_EXAMPLES]) if NUM_EXAMPLES in total else None
    if n is not None:
        most = members * max_examples
        if not -tolerance <= n <= most + tolerance:
            return (
                f"the sum's {NUM_EXAMPLES} is {n:.6g}, outside [0, {most}] "
                f"({members} devices x max_examples_per_report {max_examples})"
            )
    weights = [np.asarray(total[w], dtype=np.float64) for w in weight_names if w in total]
    if clip_norm is None or not weights:
        return None
    norm = math.sqrt(sum(float(np.sum(np.square(w))) for w in weights))
    size = sum(w.size for w in weights)
    count = max(n if n is not None else float(members), 0.0)
    limit = clip_norm * (count + tolerance) * (1 + FLOAT32_SLACK) + tolerance * math.sqrt(size)
    if norm > limit:
        return (
            f"the norm of the sum's weight tensors is {norm:.6g}, above clip_update_norm {clip_norm:g} x "
            f"{NUM_EXAMPLES} {count:.6g}"
        )
    return None


__all__ = ["NUM_EXAMPLES", "Bounded", "bound_update", "check_group_sum"]
