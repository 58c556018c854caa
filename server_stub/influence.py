"""Bounding devices' influence on a round: one report at a time, or one Secure Aggregation group.

A plain report is bounded as it arrives by ``bound_update`` (``device_runtime.influence``, the
one definition: the example count capped at ``max_examples_per_report``, the mean delta clipped
to ``clip_update_norm``). Under Secure Aggregation the server never sees one device's update:
each device bounds its own with the same function before masking it, and the server checks the
one thing it does see, each group's decoded sum, before the sum is used (``check_group_sum``), and
holds the sum's metric sums to what they mean before they join the round's (``hold_metric_sums``).

Pure: values in, verdicts out."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from device_runtime.influence import NUM_EXAMPLES, Bounded, bound_update

from .metrics import CORRECT, COUNT, LOSS_SUM, hold_loss

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
    still spend the budget the others leave unused: its group's slack.) The metric sums are held
    to what every honest device's are (``metrics.check_metric_sums``, which a plain report must
    pass): ``loss_sum``, ``correct`` and ``count`` not negative, and ``correct`` at most the count
    (``count``, else ``N``); one member's ``correct`` of 1,024 over a ``count`` of 0 made a round
    of honest devices at accuracy 0.5 publish a ``train_accuracy`` of 26. ``tolerance`` is the
    largest error of one decoded entry (``SecureSumCodec.sum_error``); each bound is widened by
    that much (twice for a difference of two entries), and the norm by ``FLOAT32_SLACK`` for the
    rounding of the updates to float32."""
    for name, value in total.items():
        if not np.isfinite(np.asarray(value, dtype=np.float64)).all():
            return f"the sum's {name!r} holds NaN or infinite values"
    problem = _metric_sums_problem(total, tolerance)
    if problem is not None:
        return problem
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


def _scalar(total: Mapping[str, np.ndarray], name: str) -> float | None:
    value = total.get(name)
    if value is None or np.size(value) != 1:
        return None
    return float(np.asarray(value, dtype=np.float64).reshape(()))


def _metric_sums_problem(total: Mapping[str, np.ndarray], tolerance: float) -> str | None:
    """Why the sum's metric sums are not ones honest devices' could add up to, or None."""
    values = {name: _scalar(total, name) for name in (LOSS_SUM, CORRECT, COUNT, NUM_EXAMPLES)}
    for name in (LOSS_SUM, CORRECT, COUNT):
        value = values[name]
        if value is not None and value < -tolerance:
            return f"the sum's {name} is {value:.6g}, but it sums non-negative values"
    which = COUNT if values[COUNT] is not None else NUM_EXAMPLES
    counted, correct = values[which], values[CORRECT]
    if counted is not None and correct is not None and correct > counted + 2 * tolerance:
        return f"the sum's {CORRECT} ({correct:.6g}) exceeds its {which} ({counted:.6g}): more right answers than questions"
    return None


def hold_metric_sums(total: Mapping[str, np.ndarray], max_loss: float | None = None) -> dict[str, np.ndarray]:
    """A passing sum (``check_group_sum``) with its metric sums moved into what they mean:
    ``loss_sum``, ``correct`` and ``count`` at least 0, and ``correct`` at most the count. The
    check lets each be off by the codec's rounding, and a member that knows its peers' counts (a
    fleet whose devices hold 10 examples each) could spend that rounding on a count near 0 under a
    ``correct`` just above it: an accuracy of 30. Held here, every group's ``correct`` is at most its
    count, and so is the round's: its published accuracy stays in [0, 1] and its loss at least 0.
    An honest sum moves by no more than its rounding. With ``max_loss`` (the task's
    ``RoundConfig.max_loss``) the group's ``loss_sum`` is held to ``max_loss`` times its count too
    (``metrics.hold_loss``, as each plain report's is): the server sees no member's loss, so one
    member's ``loss_sum`` of 1e30 can lift its group's mean loss to ``max_loss``, never past it."""
    out = dict(total)
    for name in (LOSS_SUM, CORRECT, COUNT):
        if _scalar(out, name) is not None:
            out[name] = np.maximum(np.asarray(out[name]), 0).astype(np.asarray(out[name]).dtype)
    which = COUNT if _scalar(out, COUNT) is not None else NUM_EXAMPLES
    if _scalar(out, CORRECT) is not None and _scalar(out, which) is not None:
        most = np.maximum(np.asarray(out[which]), 0)
        out[CORRECT] = np.minimum(np.asarray(out[CORRECT]), most).astype(np.asarray(out[CORRECT]).dtype)
    return hold_loss(out, max_loss)[0]


__all__ = ["NUM_EXAMPLES", "Bounded", "bound_update", "check_group_sum", "hold_metric_sums"]
