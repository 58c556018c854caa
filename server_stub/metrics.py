"""Per-round summaries of device-reported metrics (paper, section 7.4).

The paper's FL server keeps, per round, moments and order statistics of what devices report
(loss, accuracy, update norms, counts), because a mean alone hides the shape of a fleet: a few
devices with a diverging loss or a huge update barely move the mean but show in the tails. This
module is that bookkeeping as pure state: it does no I/O and reads no clock, so the service, the
fleet simulator and the tests all feed it the same way, one device report at a time.

Choices, and why:

* Moments by Welford in float64, with a power-of-two scale on the second moment. Client updates
  are float32 and a round may have millions of reports; a naive sum of squares loses the variance
  to cancellation, and with values near 1e308 the squares overflow. The standard deviation of
  finite values is always finite (at most half the range), so the output never needs inf or NaN.
* Order statistics from an Apache DataSketches KLL sketch: bounded memory (a few KB for k=200)
  whatever the number of devices, mergeable across aggregators, with a known rank error
  (``kll_doubles_sketch.get_normalized_rank_error(k, False)``, about 1.3% at k=200).
* Non-finite values are counted, not added: one device reporting NaN or inf would otherwise make
  the round's mean and quantiles meaningless. The count still tells the operator it happened.
* Metric names are validated and capped per round: the names come from devices, so a malicious
  device could otherwise send a million distinct names and make the server keep a sketch each.

Only plain (non-SecAgg) rounds can have per-device metrics: under Secure Aggregation the server
never sees one device's update, which is the point of it.

Before a plain report is summed, its metric sums are held to what they mean (``check_metric_sums``,
``cap_metric_weight``): a device that set ``correct`` to 4e27 made the round publish a
``train_accuracy`` of 4e27, and one ``loss_sum`` of -4e27 a negative ``train_loss``; and with a
task's ``max_loss`` its mean loss counts as at most that (``hold_loss``), a report's or a group's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from datasketches import kll_doubles_sketch

from .errors import install_hint

if TYPE_CHECKING:
    import pandas

__all__ = [
    "MetricSummary",
    "MetricsOutOfRange",
    "RoundMetrics",
    "cap_metric_weight",
    "check_metric_sums",
    "device_metrics",
    "hold_loss",
    "rounds_frame",
]

DEFAULT_K = 200
DEFAULT_MAX_NAMES = 32
QUANTILES: dict[str, float] = {"p05": 0.05, "p25": 0.25, "p50": 0.5, "p75": 0.75, "p95": 0.95}
DROPPED_NAMES_KEY = "_dropped_names"
#: The metric sums whose meaning the server knows, as every plan the builders and the toolchain
#: make sums them over a device's examples: losses, right predictions, and what was measured
#: (examples, or the label positions of a sequence). A plan's server part turns them into
#: ``<kind>_loss = sum(loss_sum) / sum(count)`` and ``<kind>_accuracy = sum(correct) / sum(count)``.
LOSS_SUM, CORRECT, COUNT, NUM_EXAMPLES = "loss_sum", "correct", "count", "num_examples"

# A leading underscore is reserved for RoundMetrics' own keys (``_dropped_names``), so a device
# cannot shadow them with a metric of the same name.
_NAME = re.compile(r"[A-Za-z0-9.-][A-Za-z0-9_.-]{0,63}")
# The per-term magnitude bound of the scaled second moment: a product of two factors below
# 2**450 stays below 2**900, leaving 2**123 of headroom for the sum before float64 overflows.
_FACTOR_EXP = 450
_M2_RESCALE_ABOVE = 2.0**960


class MetricSummary:
    """Count, mean, variance, min, max and approximate quantiles of one named metric."""

    __slots__ = ("count", "non_finite", "min", "max", "_mean", "_m2", "_exp", "_sketch")

    def __init__(self, k: int = DEFAULT_K) -> None:
        self.count = 0
        self.non_finite = 0
        self.min = math.inf
        self.max = -math.inf
        self._mean = 0.0
        # The second moment M2 (sum of squared deviations) is kept as _m2 * 4**_exp: with
        # values near 1e308, M2 itself is not a float64, but its square root always is.
        self._m2 = 0.0
        self._exp = 0
        self._sketch = kll_doubles_sketch(k)

    @property
    def mean(self) -> float | None:
        if not self.count:
            return None
        return min(max(self._mean, self.min), self.max)  # rounding must not leave [min, max]

    @property
    def std(self) -> float | None:
        """Population standard deviation (divide by n): the spread of the devices seen, not an estimate."""
        if not self.count:
            return None
        std = math.ldexp(math.sqrt(max(self._m2, 0.0) / self.count), self._exp)
        # Popoviciu: std <= range/2. Also catches rounding at the very edge of float64.
        return min(std, self.max / 2 - self.min / 2)

    @property
    def k(self) -> int:
        return self._sketch.k

    def add(self, value: float) -> None:
        """Add one device's value; NaN and +-inf are counted in ``non_finite`` instead."""
        x = float(value)
        if not math.isfinite(x):
            self.non_finite += 1
            return
        self._sketch.update(x)
        self.count += 1
        self.min = min(self.min, x)
        self.max = max(self.max, x)
        if self.count == 1:
            self._mean = x
            return
        # Halves: x - mean can overflow for values of opposite sign near 1e308, x/2 - mean/2
        # cannot, and for normal floats it is exactly (x - mean)/2.
        half_before = x / 2 - self._mean / 2
        self._mean += math.ldexp(half_before / self.count, 1)
        half_after = x / 2 - self._mean / 2
        self._add_m2(half_before, half_after, 1.0)

    def merge(self, other: MetricSummary) -> None:
        """Fold ``other`` in (Chan et al.'s parallel update); ``other`` is left unchanged."""
        if other is self:
            other = self.copy()
        self.non_finite += other.non_finite
        if not other.count:
            return
        self._sketch.merge(other._sketch)
        if not self.count:
            self.count, self.min, self.max = other.count, other.min, other.max
            self._mean, self._m2, self._exp = other._mean, other._m2, other._exp
            return
        na, nb = self.count, other.count
        n = na + nb
        half_delta = other._mean / 2 - self._mean / 2
        # The convex form cannot overflow, whatever the two means are.
        self._mean = self._mean * (na / n) + other._mean * (nb / n)
        self.count = n
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        exp = max(self._exp, other._exp)
        self._m2 = math.ldexp(self._m2, 2 * (self._exp - exp)) + math.ldexp(other._m2, 2 * (other._exp - exp))
        self._exp = exp
        self._add_m2(half_delta, half_delta, na * nb / n)

    def _add_m2(self, half_a: float, half_b: float, weight: float) -> None:
        """M2 += (2*half_a) * (2*half_b) * weight, in the scaled representation."""
        biggest = max(abs(half_a), abs(half_b))
        if biggest:
            need = math.frexp(biggest)[1] + 1 - _FACTOR_EXP
            if need > self._exp:
                self._m2 = math.ldexp(self._m2, 2 * (self._exp - need))
                self._exp = need
        self._m2 += math.ldexp(half_a, 1 - self._exp) * math.ldexp(half_b, 1 - self._exp) * weight
        if self._m2 > _M2_RESCALE_ABOVE:
            self._m2 = math.ldexp(self._m2, -128)
            self._exp += 64

    def quantile(self, rank: float) -> float | None:
        """The smallest value v seen (approximately) such that a fraction >= rank of values are <= v."""
        if self._sketch.is_empty():
            return None
        return float(self._sketch.get_quantile(rank, True))

    def copy(self) -> MetricSummary:
        out = MetricSummary(self.k)
        out.count, out.non_finite, out.min, out.max = self.count, self.non_finite, self.min, self.max
        out._mean, out._m2, out._exp = self._mean, self._m2, self._exp
        out._sketch = kll_doubles_sketch.deserialize(self._sketch.serialize())
        return out

    def to_json(self) -> dict[str, Any]:
        """Plain JSON numbers only (``json.dumps(..., allow_nan=False)`` accepts it); None when empty."""
        empty = not self.count
        return {
            "count": self.count,
            "mean": self.mean,
            "std": self.std,
            "min": None if empty else self.min,
            "max": None if empty else self.max,
            "non_finite": self.non_finite,
            "quantiles": None if empty else {key: self.quantile(rank) for key, rank in QUANTILES.items()},
        }

    def __repr__(self) -> str:
        return f"MetricSummary(count={self.count}, mean={self.mean}, std={self.std}, non_finite={self.non_finite})"


def _as_float(value: object) -> float | None:
    """A device value as float, or None if it is not a real number (bools and strings are not)."""
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, int | np.integer):
        try:
            return float(value)
        except OverflowError:  # a Python int beyond float64: count it as non-finite
            return math.inf if value > 0 else -math.inf
    if isinstance(value, float | np.floating):
        return float(value)
    return None


class RoundMetrics(Mapping[str, MetricSummary]):
    """Metric name -> :class:`MetricSummary` for one round, with a cap on distinct names."""

    def __init__(self, max_names: int = DEFAULT_MAX_NAMES, k: int = DEFAULT_K) -> None:
        self.max_names = max_names
        self.k = k
        # Values dropped because the name cap was reached (counted per value: keeping the
        # dropped names to count them would be the memory the cap exists to bound).
        self.dropped_names = 0
        self._summaries: dict[str, MetricSummary] = {}

    def __getitem__(self, name: str) -> MetricSummary:
        return self._summaries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._summaries)

    def __len__(self) -> int:
        return len(self._summaries)

    def _slot(self, name: str) -> MetricSummary | None:
        summary = self._summaries.get(name)
        if summary is None and len(self._summaries) < self.max_names:
            summary = self._summaries[name] = MetricSummary(self.k)
        return summary

    def add(self, values: Mapping[str, float]) -> None:
        """Add one device's metrics; bad names and non-numbers are ignored, not errors."""
        for name, value in values.items():
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                continue
            x = _as_float(value)
            if x is None:
                continue
            summary = self._slot(name)
            if summary is None:
                self.dropped_names += 1
            else:
                summary.add(x)

    def merge(self, other: RoundMetrics) -> None:
        """Fold ``other`` in; names beyond this cap count their values in ``dropped_names``."""
        self.dropped_names += other.dropped_names
        for name, theirs in list(other.items()):
            ours = self._slot(name)
            if ours is None:
                self.dropped_names += theirs.count + theirs.non_finite
            else:
                ours.merge(theirs)

    def to_json(self) -> dict[str, dict]:
        out: dict[str, Any] = {name: self._summaries[name].to_json() for name in sorted(self._summaries)}
        if self.dropped_names > 0:
            out[DROPPED_NAMES_KEY] = self.dropped_names
        return out

    def __repr__(self) -> str:
        return f"RoundMetrics({sorted(self._summaries)}, dropped_names={self.dropped_names})"


def device_metrics(update: Mapping[str, np.ndarray], weight_names: Iterable[str]) -> dict[str, float]:
    """The per-device metrics of one client update as the server receives it.

    Every scalar non-weight tensor (``loss_sum``, ``correct``, ``count``, ``num_examples``, ...)
    under its own name; ``loss`` and ``accuracy`` per example when ``count`` > 0; and, when the
    update carries weights, ``update_norm``: the L2 norm of the mean weight delta. The weights are
    sent as delta * num_examples (see ``device_runtime.executor``), hence the division; a large
    norm is the usual sign of a diverging or malicious device.
    """
    weights = set(weight_names)
    out: dict[str, float] = {}
    for name, tensor in update.items():
        if name in weights:
            continue
        arr = np.asarray(tensor)
        if arr.size == 1 and arr.dtype.kind in "fiu":
            out[name] = float(arr.reshape(()).astype(np.float64))
    count = out.get("count")
    if count is not None and count > 0:
        if "loss_sum" in out:
            out["loss"] = out["loss_sum"] / count
        if "correct" in out:
            out["accuracy"] = out["correct"] / count
    present = [w for w in weights if w in update]
    if present:
        # Per-tensor norms in float64, combined by hypot (which scales, so no overflow in between). A sum of
        # squares, not np.linalg.norm: that is BLAS's dot, which above 10,000 entries wakes OpenBLAS's worker
        # threads, and they spin on the other cores after it (in a fleet simulation, as much CPU as the whole run).
        norms = [math.sqrt(sum_of_squares(update[w])) for w in sorted(present)]
        n = out.get("num_examples", 1.0)
        out["update_norm"] = math.hypot(*norms) / (n if n > 1.0 else 1.0)
    return out


#: Values ``sum_of_squares`` holds in float64 at a time (8 MB), and numpy's pairwise block (its
#: ``PW_BLOCKSIZE``: a sum of at most this many values is one unrolled loop, never split).
SQUARES_AT_ONCE = 1 << 20
_PAIRWISE_BLOCK = 128


def sum_of_squares(tensor: np.ndarray, scale: float | None = None, divisor: float | None = None) -> float:
    """``float(np.sum(np.square(t)))`` for ``t`` the tensor in float64, times ``scale`` and divided by
    ``divisor`` where given, to the last bit, holding at most ``SQUARES_AT_ONCE`` float64 values: numpy
    sums a contiguous array pairwise (two halves, the first's length rounded down to a multiple of 8,
    each summed the same way down to blocks of 128), so each half is summed here by ``np.sum`` of its
    own once it fits, and the halves are added as numpy adds them. Whole, a tensor of 16 million
    weights held 128 MB of float64 for its norm, twice (its copy and its square), in every report's
    check. ``tests/server_stub/test_reports.py`` holds the two equal."""
    return float(_pairwise_squares(np.asarray(tensor).reshape(-1), scale, divisor))


def _pairwise_squares(flat: np.ndarray, scale: float | None, divisor: float | None) -> np.floating:
    if flat.size <= max(SQUARES_AT_ONCE, _PAIRWISE_BLOCK):
        work = flat.astype(np.float64)  # a copy, whatever the dtype: it is written below
        if scale is not None:
            work *= scale
        if divisor is not None:
            work /= divisor
        np.square(work, out=work)
        return np.sum(work)
    half = flat.size // 2
    half -= half % 8
    return _pairwise_squares(flat[:half], scale, divisor) + _pairwise_squares(flat[half:], scale, divisor)


class MetricsOutOfRange(ValueError):
    """A report's metric sums hold a value no device computing them honestly can send."""


def _scalar(update: Mapping[str, np.ndarray], name: str) -> float | None:
    value = update.get(name)
    if value is None or np.size(value) != 1:
        return None
    return float(np.asarray(value, dtype=np.float64).reshape(()))


def check_metric_sums(update: Mapping[str, np.ndarray]) -> None:
    """Raise :class:`MetricsOutOfRange` unless the known metric sums mean what they say:
    ``loss_sum``, ``correct`` and ``count`` are >= 0 (a loss is non-negative, as every built-in
    one is), ``correct`` is at most ``count`` (``num_examples`` for a plan that sums no ``count``),
    and with nothing counted there is no loss. Refused rather than clamped: no rounding gets an
    honest device there, so a report that does is broken or forged, and its update is not taken
    either. Other metric sums (a histogram's bins) are only finite, as every tensor of a report."""
    values = {name: _scalar(update, name) for name in (LOSS_SUM, CORRECT, COUNT, NUM_EXAMPLES)}
    for name in (LOSS_SUM, CORRECT, COUNT):
        value = values[name]
        if value is not None and not value >= 0.0:
            raise MetricsOutOfRange(f"{name} is {value:g}, but it sums non-negative values")
    counted = values[COUNT] if values[COUNT] is not None else values[NUM_EXAMPLES]
    correct, loss = values[CORRECT], values[LOSS_SUM]
    if counted is not None and correct is not None and correct > counted:
        which = COUNT if values[COUNT] is not None else NUM_EXAMPLES
        raise MetricsOutOfRange(
            f"{CORRECT} ({correct:g}) exceeds {which} ({counted:g}): more right answers than questions"
        )
    if counted == 0.0 and loss is not None and loss > 0.0:
        raise MetricsOutOfRange(f"{LOSS_SUM} is {loss:g} over no counted example")


def cap_metric_weight(update: Mapping[str, np.ndarray], max_count: int) -> tuple[dict[str, np.ndarray], bool]:
    """``update`` with the weight of its loss and accuracy in the round capped like its model
    update's: a ``count`` above ``max_count`` scales ``loss_sum``, ``correct`` and ``count`` by
    ``max_count / count`` (in float64, rounded once to float32), which keeps the device's mean loss
    and accuracy. ``bound_update`` caps ``num_examples``, but ``count`` is a separate tensor: one
    report with ``count`` and ``correct`` of 1e30 was the whole round's accuracy. True if capped."""
    count = _scalar(update, COUNT)
    if count is None or count <= max_count:
        return dict(update), False
    scale = max_count / count
    out = dict(update)
    out[COUNT] = np.full(np.shape(update[COUNT]), max_count, dtype=np.float32)
    for name in (LOSS_SUM, CORRECT):
        if name in out:
            out[name] = (np.asarray(out[name], dtype=np.float64) * scale).astype(np.float32)
    if CORRECT in out:  # rounding to float32 must not lift it over the count it is a part of
        out[CORRECT] = np.asarray(np.minimum(out[CORRECT], out[COUNT]), dtype=np.float32)
    return out, True


def hold_loss(update: Mapping[str, np.ndarray], max_loss: float | None) -> tuple[dict[str, np.ndarray], bool]:
    """``update`` (one report, or one Secure Aggregation group's sum) with its ``loss_sum`` held to
    ``max_loss`` times its count (``count``, else ``num_examples``): a mean loss above the task's
    ``RoundConfig.max_loss`` counts as ``max_loss``. The loss has no range of its own (cross-entropy
    and squared error grow without bound), so without it one report of ``loss_sum`` 1e30 over 10
    examples was the round's whole ``train_loss``; held, it moves the round's mean loss by at most its
    weight's share of ``max_loss``, and the round's ``train_loss`` stays at most ``max_loss``. Held, not
    refused: an honest device whose training diverged gets there, and its update is within its clip.
    True if held."""
    loss = _scalar(update, LOSS_SUM)
    counted = _scalar(update, COUNT)
    if counted is None:
        counted = _scalar(update, NUM_EXAMPLES)
    if max_loss is None or loss is None or counted is None or loss <= max_loss * max(counted, 0.0):
        return dict(update), False
    out = dict(update)
    held = np.full(np.shape(update[LOSS_SUM]), max_loss * max(counted, 0.0), dtype=np.float64)
    out[LOSS_SUM] = held.astype(np.asarray(update[LOSS_SUM]).dtype)
    return out, True


def _flatten(prefix: str, obj: Mapping[str, Any], row: dict[str, Any]) -> None:
    for key, value in obj.items():
        if isinstance(value, Mapping):
            _flatten(f"{prefix}{key}.", value, row)
        elif value is None or isinstance(value, str | int | float | bool):
            row[f"{prefix}{key}"] = value


def _round_row(item: Mapping[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for key, value in item.items():
        if key != "metrics" and (value is None or isinstance(value, str | int | float | bool)):
            row[key] = value
    for key, value in (item.get("metrics") or {}).items():
        if key == "shapes" and isinstance(value, Mapping):
            for shape, n in value.items():
                row[f"shape.{shape}"] = n
        elif key == "device_metrics" and isinstance(value, Mapping):
            for name, summary in value.items():
                if not isinstance(summary, Mapping):  # _dropped_names
                    row[f"device_metrics.{name}"] = summary
                    continue
                flat = {k: v for k, v in summary.items() if k != "quantiles"}
                flat.update(summary.get("quantiles") or {})
                _flatten(f"device_metrics.{name}.", flat, row)
        elif isinstance(value, Mapping):
            _flatten(f"{key}.", value, row)
        elif value is None or isinstance(value, str | int | float | bool):
            row[f"metrics.{key}" if key in row else key] = value
    return row


def rounds_frame(rounds: list[dict]) -> pandas.DataFrame:
    """One row per round of ``GET /v1/populations/{p}/rounds``, for analysis in pandas.

    Columns: the round's scalar fields, its scalar metrics (prefixed ``metrics.`` only if a
    top-level field has the same name), ``device_metrics.<name>.<stat>`` with the quantiles as
    ``device_metrics.<name>.p50`` etc., and ``shape.<shape>`` counts (0 where a round had none).
    A task with differential privacy adds ``epsilon``, ``delta``, ``dp_rounds``, ``noise_multiplier``,
    ``dp_mode`` and ``dp_clip`` (``server_stub.dp_rounds.ROUND_KEYS``) on its rounds that spent privacy
    (``server_stub.dp_rounds.spends_privacy``).
    """
    try:
        import pandas as pd
    except ImportError as exc:
        raise ImportError(f"rounds_frame needs pandas: {install_hint('analysis')}") from exc
    frame = pd.DataFrame([_round_row(item) for item in rounds])
    shape_columns = [c for c in frame.columns if c.startswith("shape.")]
    if shape_columns:
        frame[shape_columns] = frame[shape_columns].fillna(0).astype("int64")
    return frame
