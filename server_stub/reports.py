"""A device's plain report (simple aggregation): what it must pass before it joins the round's
running sum, and how it joins it. The checks run outside the service's lock (decoding and bounding
an update is the costly part); only ``take_report`` runs under it. Nothing of one device's update is
kept apart from the running sum.

What a report holds of the server's memory, for an update of ``S`` bytes:

- while its body arrives and while it waits its turn to be checked: at most
  ``SPOOL_IN_MEMORY_BYTES`` (1 MiB); a larger body goes to an unlinked file (``BodySpool``, in
  ``tempfile``'s folder: ``TMPDIR``), so reports waiting together cost disk, not memory. Held whole
  in memory, five reports of a 67-million-weight model (268 MB each) arriving together took a
  server to 9.3 GB;
- while it is checked (at most ``CHECKED_AT_ONCE`` at a time): its body, mapped from its file
  (page cache the kernel can drop, not memory of the process's own), its bounded copy of ``S``
  bytes when it is capped or clipped (``bound_report``), and float64 pieces of 8 MB; then, in
  the service's lock, what the plan's ``accumulate`` takes to add it to the round's sum. Bounding
  in float64 copies of the whole update held about five times ``S`` and took 1 s per 100 MB.
  ``benchmarks/server_reports.py`` measures the server's peak with reports arriving together.

The bodies are spooled by the HTTP app (``create_app``); ``FLService.report`` takes them as bytes or
as a view of the spool (``BodySpool.view()``)."""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, cast

import numpy as np

from device_runtime.checkpoint import CheckpointError, decode_checkpoint
from device_runtime.influence import Bounded
from device_runtime.plan import PlanError

from .errors import Conflict, InvalidUpdate
from .influence import NUM_EXAMPLES
from .metrics import MetricsOutOfRange, cap_metric_weight, check_metric_sums, device_metrics, hold_loss, sum_of_squares
from .service_state import TaskRun


@dataclass(frozen=True)
class CheckedReport:
    """A report that passed its checks, bounded: the update to sum and what the round counts of it."""

    update: dict[str, np.ndarray]
    observed: dict[str, float]  # the per-device summaries (none with DP on)
    shape: str | None  # the session's shape so far, as the device sent it
    capped: bool
    clipped: bool


def cores_available() -> int:
    """The cores this process may run on: its CPU affinity, within its cgroup's CPU quota where one
    is set (a container given 2 CPUs on a host of 64). ``os.cpu_count()`` counts the host's cores,
    and a server checking reports on each of them at once in a container of two held as many
    updates as the host had cores, for no more speed."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def cgroup_cpu_quota(
    root: Path = Path("/sys/fs/cgroup"), cgroup_file: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The CPUs the process's cgroup may use (quota over period), the least of its cgroup's and its
    parents' (cgroup v2 ``cpu.max``) or of the CPU controller's (v1 ``cpu.cfs_quota_us``); None
    where no quota is set or none can be read."""
    quotas: list[float] = []
    root = root.resolve()
    with contextlib.suppress(OSError, ValueError):
        for line in cgroup_file.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2: walk from the process's cgroup up to the root
                folder = (root / path.lstrip("/")).resolve()
                while True:
                    with contextlib.suppress(OSError, ValueError):
                        quota, period = (folder / "cpu.max").read_text().split()[:2]
                        if quota != "max":
                            quotas.append(int(quota) / int(period))
                    if folder == root or root not in folder.parents:
                        break
                    folder = folder.parent
            elif "cpu" in controllers.split(","):  # v1: the CPU controller's own folder
                for folder in (root / "cpu" / path.lstrip("/"), root / "cpu"):
                    with contextlib.suppress(OSError, ValueError):
                        quota_us = int((folder / "cpu.cfs_quota_us").read_text())
                        period_us = int((folder / "cpu.cfs_period_us").read_text())
                        if quota_us > 0 and period_us > 0:
                            quotas.append(quota_us / period_us)
    positive = [q for q in quotas if q > 0]
    return min(positive) if positive else None


#: Reports checked at once, one a core the process may use: checking is arithmetic over the whole
#: update (its digest, its norm, its bounded copy), so more at once only holds more memory.
#: Measured: five DistilBERT reports (268 MB each) checked at once took a server past 7 GB and the
#: kernel killed it; a 100 MB update takes 1.5 to 2.5 s of CPU to check. The HTTP app lets this
#: many reports at a time into its thread pool (``create_app``), so that reports waiting their turn
#: hold no worker thread: 40 of them waiting (anyio's default pool) left no thread for a check-in.
CHECKED_AT_ONCE = cores_available()
_checking = threading.BoundedSemaphore(CHECKED_AT_ONCE)
#: A report body up to this size is kept in memory as it arrives; a larger one goes to a file.
SPOOL_IN_MEMORY_BYTES = 1 << 20
#: Values of a tensor bounded at a time (8 MB of float64): chunks of one tensor, exactly as the whole.
_CHUNK = 1 << 20


class BodySpool:
    """A request body as it arrives (``write``), kept in memory up to ``in_memory_bytes`` and beyond
    that in an unlinked file in ``folder`` (``tempfile``'s default: ``TMPDIR``, else ``/tmp``; put it
    on a disk where ``/tmp`` is a tmpfs, whose files are memory). In memory, the pieces are added to
    one buffer as they come, never joined at the end (which held a body twice at that moment), nor
    a buffer of its declared size made before it is sent (which a client could claim and not send).
    ``view()`` is the whole body: from a file, the file mapped read-only, so that the update decoded
    from it views the page cache rather than a copy. ``close()`` lets go of the file (a mapping in
    use stays valid until its arrays are gone)."""

    def __init__(self, *, in_memory_bytes: int | None = None, folder: str | None = None) -> None:
        self.in_memory_bytes = SPOOL_IN_MEMORY_BYTES if in_memory_bytes is None else in_memory_bytes
        self.folder = folder
        self.size = 0
        self._memory = bytearray()
        self._file: IO[bytes] | None = None

    @property
    def on_disk(self) -> bool:
        return self._file is not None

    def write(self, chunk: bytes) -> None:
        """Append ``chunk``; raises ``OSError`` where the spool file cannot take it (a full disk)."""
        self.size += len(chunk)
        if self._file is None and self.size > self.in_memory_bytes:
            self._file = tempfile.TemporaryFile(dir=self.folder)  # noqa: SIM115 - closed by close()
            self._file.write(self._memory)
            self._memory = bytearray()
        if self._file is not None:
            self._file.write(chunk)
        else:
            self._memory += chunk  # grown in place (realloc), a fraction over its size at most

    def in_memory(self) -> bytearray:
        """The body, kept in memory (``in_memory_bytes`` at least its size); the spool lets go of it."""
        if self._file is not None:
            raise ValueError("the body is in the spool's file: read it with view()")
        body, self._memory = self._memory, bytearray()
        return body

    def view(self) -> memoryview:
        """The body as it came, read-only: in memory, or its file mapped."""
        if self._file is None:
            return memoryview(self._memory).toreadonly()
        self._file.flush()
        mapped = mmap.mmap(self._file.fileno(), self.size, access=mmap.ACCESS_READ)
        self.close()  # the mapping holds the file's pages; the file is unlinked already
        return memoryview(mapped)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._memory = bytearray()

    def __enter__(self) -> BodySpool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_report(run: TaskRun, body: bytes | memoryview, stats: dict | None, session_age_s: float) -> CheckedReport:
    """Decode, validate and bound one report for ``run``'s plan, at most ``CHECKED_AT_ONCE`` at
    a time (the others wait their turn); raises a 4xx ``ApiError``. ``session_age_s``: how long
    its round has been open, the most its device can have trained."""
    with _checking:
        return _check_report(run, body, stats, session_age_s)


def _check_report(run: TaskRun, body: bytes | memoryview, stats: dict | None, session_age_s: float) -> CheckedReport:
    if run.codec is not None:
        raise Conflict(
            "this task aggregates with Secure Aggregation; use the session's secagg endpoint",
            code="SECURE_AGGREGATION_REQUIRED",
        )
    try:
        update = decode_checkpoint(
            cast(bytes, body), max_bytes=run.report_limit
        )  # any buffer: it reads a memoryview of it
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
    bounded = bound_report(
        update,
        run.plan.weight_names if run.is_training else (),
        max_examples=run.config.max_examples_per_report,
        clip_norm=None if central else run.config.clip_update_norm,  # central DP clips to its own clip below
    )
    summed, metrics_capped = cap_metric_weight(bounded.update, run.config.max_examples_per_report)
    summed = hold_loss(summed, run.config.max_loss)[0]  # RoundConfig.max_loss: a mean loss counts as at most it
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


def bound_report(
    update: Mapping[str, np.ndarray],
    weight_names: Iterable[str],
    *,
    max_examples: float,
    clip_norm: float | None,
) -> Bounded:
    """``device_runtime.influence.bound_update(update, ...)``, bit for bit, in a fraction of its memory
    and time: the same float64 arithmetic by pieces of at most a million values, where
    ``bound_update`` made float64 copies of the whole update (twice when capped) and three float64
    temporaries of each weight tensor. Each tensor's sum of squares is numpy's pairwise sum of the
    whole tensor, rebuilt from its pieces (``metrics.sum_of_squares``), so the norm, and with it every
    bounded value, is the same to the last bit (``tests/server_stub/test_reports.py`` holds them
    equal); the scaling is elementwise. ``mean_delta_norm`` is NaN without a ``clip_norm``: no norm
    is needed then, and none is taken."""
    names = [w for w in weight_names if w in update]
    n = float(np.asarray(update[NUM_EXAMPLES], dtype=np.float64)) if NUM_EXAMPLES in update else 1.0
    if not (math.isfinite(n) and n >= 0):
        raise ValueError(f"{NUM_EXAMPLES} is {n}: only a validated update (finite, not negative) can be bounded")
    capped = n > max_examples
    scale = max_examples / n if capped else None
    if capped:
        n = float(max_examples)
    norm = math.nan
    if clip_norm is not None:
        if n > 0:
            norm = math.sqrt(sum(sum_of_squares(update[w], scale, n) for w in names))
        else:
            norm = 0.0 if all(not np.any(update[w]) for w in names) else math.inf
    clipped = clip_norm is not None and norm > clip_norm
    factor = clip_norm / norm if clip_norm is not None and clipped else None
    if not capped and not clipped and all(np.asarray(v).dtype == np.float32 for v in update.values()):
        return Bounded({k: np.asarray(v) for k, v in update.items()}, False, False, norm)
    weights = set(names)
    out = {k: _scaled(v, scale, factor if k in weights else None) for k, v in update.items()}
    return Bounded(out, capped, clipped, norm)


def _scaled(value: np.ndarray, scale: float | None, factor: float | None) -> np.ndarray:
    """``value`` in float64, times ``scale`` then ``factor`` (where given), rounded once to float32."""
    value = np.asarray(value)
    out = np.empty(value.shape, dtype=np.float32)
    flat_in, flat_out = value.reshape(-1), out.reshape(-1)
    for start in range(0, flat_in.size, _CHUNK):
        work = flat_in[start : start + _CHUNK].astype(np.float64)
        if scale is not None:
            work *= scale
        if factor is not None:
            work *= factor
        flat_out[start : start + _CHUNK] = work  # float64 -> float32, as astype rounds
    return out


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
