"""A device's plain report (simple aggregation): what it must pass before it joins the round's
running sum, and how it joins it. The checks run outside the service's lock (decoding and bounding
an update is the costly part); only ``take_report`` runs under it. Nothing of one device's update is
kept apart from the running sum."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import numpy as np

from device_runtime.checkpoint import CheckpointError, decode_checkpoint
from device_runtime.plan import PlanError

from .errors import Conflict, InvalidUpdate
from .influence import bound_update
from .metrics import MetricsOutOfRange, cap_metric_weight, check_metric_sums, device_metrics
from .service_state import TaskRun


@dataclass(frozen=True)
class CheckedReport:
    """A report that passed its checks, bounded: the update to sum and what the round counts of it."""

    update: dict[str, np.ndarray]
    observed: dict[str, float]  # the per-device summaries (none with DP on)
    shape: str | None  # the session's shape so far, as the device sent it
    capped: bool
    clipped: bool


#: Reports checked at once, one a core: checking is arithmetic over the whole update (its digest,
#: its norm and bounding in float64), so more at once only holds more memory, about five times the
#: update's size each. Measured: five DistilBERT reports (268 MB each) checked at once took a
#: server past 7 GB and the kernel killed it; a 100 MB update takes 1.5 to 2.5 s of CPU to check.
CHECKED_AT_ONCE = os.cpu_count() or 1
_checking = threading.BoundedSemaphore(CHECKED_AT_ONCE)


def check_report(run: TaskRun, body: bytes, stats: dict | None, session_age_s: float) -> CheckedReport:
    """Decode, validate and bound one report for ``run``'s plan, at most ``CHECKED_AT_ONCE`` at
    a time (the others wait their turn); raises a 4xx ``ApiError``. ``session_age_s``: how long
    its round has been open, the most its device can have trained."""
    with _checking:
        return _check_report(run, body, stats, session_age_s)


def _check_report(run: TaskRun, body: bytes, stats: dict | None, session_age_s: float) -> CheckedReport:
    if run.codec is not None:
        raise Conflict(
            "this task aggregates with Secure Aggregation; use the session's secagg endpoint",
            code="SECURE_AGGREGATION_REQUIRED",
        )
    try:
        update = decode_checkpoint(body, max_bytes=run.report_limit)
    except CheckpointError as exc:
        raise InvalidUpdate(f"the report is not a valid checkpoint: {exc}", code="MALFORMED_UPDATE") from None
    try:
        run.executor.validate_update(update)
    except PlanError as exc:
        raise InvalidUpdate(f"the report does not match the plan: {exc}") from None
    try:
        check_metric_sums(update)
    except MetricsOutOfRange as exc:
        raise InvalidUpdate(
            f"the report's metrics are out of range: {exc}; the update was not taken", code="INVALID_METRICS"
        ) from None
    central = run.config.dp is not None and run.config.dp.mode == "central"
    bounded = bound_update(
        update,
        run.plan.weight_names if run.is_training else (),
        max_examples=run.config.max_examples_per_report,
        clip_norm=None if central else run.config.clip_update_norm,  # central DP clips to its own clip below
    )
    summed, metrics_capped = cap_metric_weight(bounded.update, run.config.max_examples_per_report)
    # with DP, no summary of one device's values is published beside the noised model: neither of its
    # update and metric sums nor of its training time, which grows with its number of examples
    observed: dict[str, float] = {}
    if run.config.dp is None:
        observed = device_metrics(summed, run.plan.weight_names if run.is_training else ())
        observed.update(stats_metrics(stats, session_age_s))
    return CheckedReport(summed, observed, stats_shape(stats), bounded.capped or metrics_capped, bounded.clipped)


def take_report(run: TaskRun, report: CheckedReport) -> None:
    """Add an accepted report to the open round's sum and counts (under the service's lock)."""
    assert run.accumulator is not None
    summed = report.update
    try:
        if run.dp_round is not None:
            summed = run.dp_round.take(summed, run.plan.weight_names, run.config.max_examples_per_report)
        run.accumulator = run.executor.accumulate(run.accumulator, summed)
    except Exception as exc:  # the plan's own accumulate failed on this update
        raise InvalidUpdate(f"the plan could not aggregate this report: {type(exc).__name__}") from None
    run.device_metrics.add(report.observed)
    run.bounded["capped"] += report.capped
    run.bounded["clipped"] += report.clipped


def stats_shape(stats: object) -> str | None:
    """The session's shape (``-v[]+``...) a device sent with its report or abort, if any."""
    if isinstance(stats, dict) and isinstance(stats.get("shape"), str):
        return stats["shape"]
    return None


def stats_metrics(stats: object, session_age_s: float) -> dict[str, float]:
    """Advisory costs a device reported with its update (its training time), for the summaries:
    a training time is counted when it is one the session can have had, from 0 to
    ``session_age_s`` (a device that claimed 1e308 s set the round's ``training_s`` summary)."""
    if not isinstance(stats, dict):
        return {}
    value = stats.get("training_s")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= session_age_s:
        return {"training_s": float(value)}
    return {}
