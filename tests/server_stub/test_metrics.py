"""Per-round metric summaries: moments, order statistics, merging, strict JSON, name cap."""

from __future__ import annotations

import json
import math
import os
import sys
import threading

import numpy as np
import pytest
from datasketches import kll_doubles_sketch
from hypothesis import given, settings
from hypothesis import strategies as st

from server_stub.metrics import MetricSummary, RoundMetrics, device_metrics, rounds_frame

EPS = np.finfo(np.float64).eps
TINY = np.finfo(np.float64).smallest_subnormal
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
MODERATE = st.floats(-1e12, 1e12) | NON_FINITE
EXTREME = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [1e308, -1e308, np.finfo(np.float64).max, -np.finfo(np.float64).max, 5e-324]
)
KLL_EPS = kll_doubles_sketch.get_normalized_rank_error(200, False)


def summarise(values) -> MetricSummary:
    s = MetricSummary()
    for v in values:
        s.add(v)
    return s


def assert_close(ours: float, ref: float, n: int, scale: float) -> None:
    """Welford vs numpy's pairwise two-pass: both err by O(n * eps * max|x|) at worst, plus a
    subnormal ulp per step (the overflow-safe x/2 - mean/2 rounds below the normal range)."""
    assert math.isfinite(ours)
    assert abs(ours - ref) <= 1e-9 * abs(ref) + 8 * n * (EPS * scale + TINY), (ours, ref)


def assert_close_std(ours: float, ref: float, n: int, scale: float) -> None:
    """A standard deviation is the root of a variance: an absolute error e in the variance moves
    it by up to sqrt(e), which dominates where the variance is near the subnormal range."""
    assert math.isfinite(ours)
    root_of_variance_error = scale * math.sqrt(8 * n * EPS) + math.sqrt(8 * n * TINY)  # no overflow near 1e308
    assert abs(ours - ref) <= 1e-9 * abs(ref) + 8 * n * (EPS * scale + TINY) + root_of_variance_error, (ours, ref)


def assert_same_moments(a: MetricSummary, b: MetricSummary) -> None:
    assert (a.count, a.non_finite, a.min, a.max) == (b.count, b.non_finite, b.min, b.max)
    if a.count:
        scale = max(abs(a.min), abs(a.max))
        assert_close(a.mean, b.mean, a.count, scale)
        assert_close_std(a.std, b.std, a.count, scale)


def rank_error(values: np.ndarray, q: float, rank: float) -> float:
    """How far ``q`` is from the true ``rank`` quantile, in normalised rank (0 if ties cover it)."""
    below = np.mean(values < q)
    at_or_below = np.mean(values <= q)
    return max(0.0, below - rank, rank - at_or_below)


@given(st.lists(MODERATE, max_size=200))
def test_moments_match_numpy_on_the_finite_values(values):
    s = summarise(values)
    x = np.array([v for v in values if math.isfinite(v)], dtype=np.float64)
    assert s.count == x.size
    assert s.non_finite == len(values) - x.size
    if not x.size:
        assert s.to_json()["mean"] is None
        return
    scale = float(np.abs(x).max())
    assert (s.min, s.max) == (x.min(), x.max())
    assert_close(s.mean, float(x.mean()), x.size, scale)
    assert_close_std(s.std, float(x.std()), x.size, scale)


@given(st.lists(EXTREME, max_size=60))
def test_extreme_values_give_strict_json_and_the_scaled_moments(values):
    s = summarise(values)
    out = s.to_json()
    json.dumps(out, allow_nan=False)
    x = np.array([v for v in values if math.isfinite(v)], dtype=np.float64)
    if not x.size:
        assert all(out[k] is None for k in ("mean", "std", "min", "max", "quantiles"))
        return
    assert s.min <= out["mean"] <= s.max
    assert 0.0 <= out["std"] <= s.max / 2 - s.min / 2
    # numpy's reference on values scaled down by a power of two (exact), so its squares fit.
    shift = max(0, math.frexp(float(np.abs(x).max()))[1] - 500)
    scaled = np.ldexp(x, -shift)
    scale = float(np.abs(x).max())
    assert_close(out["mean"], math.ldexp(float(scaled.mean()), shift), x.size, scale)
    assert_close_std(out["std"], math.ldexp(float(scaled.std()), shift), x.size, scale)


@given(st.lists(MODERATE, max_size=100), st.lists(MODERATE, max_size=100))
def test_merging_equals_summarising_the_concatenation(left, right):
    merged = summarise(left)
    other = summarise(right)
    before = other.to_json()
    merged.merge(other)
    assert other.to_json() == before
    whole = summarise(left + right)
    assert_same_moments(merged, whole)
    # Below k=200 values the sketch keeps everything: its quantiles are exact, so equal.
    assert merged.to_json()["quantiles"] == whole.to_json()["quantiles"]


@given(st.lists(EXTREME, max_size=30), st.lists(EXTREME, max_size=30))
def test_merging_extreme_summaries_stays_strict_json(left, right):
    merged = summarise(left)
    merged.merge(summarise(right))
    json.dumps(merged.to_json(), allow_nan=False)
    merged.merge(merged)
    json.dumps(merged.to_json(), allow_nan=False)
    assert merged.count == 2 * sum(math.isfinite(v) for v in left + right)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1000, 4000),
    parts=st.integers(1, 5),
    distribution=st.sampled_from(["normal", "lognormal", "integers", "uniform"]),
)
def test_merged_quantiles_are_within_the_kll_rank_error(seed, n, parts, distribution):
    rng = np.random.default_rng(seed)
    values = {
        "normal": lambda: rng.normal(0, 1, n),
        "lognormal": lambda: rng.lognormal(0, 3, n),
        "integers": lambda: rng.integers(0, 10, n).astype(np.float64),
        "uniform": lambda: rng.uniform(-1e300, 1e300, n),
    }[distribution]()
    merged = MetricSummary()
    for chunk in np.array_split(values, parts):
        merged.merge(summarise(chunk.tolist()))
    assert merged.count == n
    quantiles = merged.to_json()["quantiles"]
    for key, rank in {"p05": 0.05, "p25": 0.25, "p50": 0.5, "p75": 0.75, "p95": 0.95}.items():
        # KLL's bound is probabilistic (99%); 3x keeps this test from ever flaking.
        assert rank_error(values, quantiles[key], rank) <= 3 * KLL_EPS, (key, quantiles[key])


@given(st.lists(MODERATE, max_size=100))
def test_non_finite_values_are_counted_not_added(values):
    s = summarise(values)
    finite = summarise(v for v in values if math.isfinite(v))
    assert s.non_finite == sum(not math.isfinite(v) for v in values)
    assert {**s.to_json(), "non_finite": 0} == finite.to_json()


def test_an_empty_summary_reports_none():
    assert MetricSummary().to_json() == {
        "count": 0,
        "mean": None,
        "std": None,
        "min": None,
        "max": None,
        "non_finite": 0,
        "quantiles": None,
    }


NAMES = st.text("abcxyz_.-", min_size=1, max_size=3) | st.sampled_from(["", "a b", "é", "x" * 65, "_dropped_names", 7])
VALUES = (
    st.floats(-10, 10) | st.integers(-10, 10) | st.sampled_from([True, "1", None, [1.0], np.float32(2.5), np.int64(3)])
)


@given(st.lists(st.dictionaries(NAMES, VALUES, max_size=8), max_size=10), st.integers(0, 6))
def test_names_are_validated_and_capped(reports, cap):
    rm = RoundMetrics(max_names=cap)
    for report in reports:
        rm.add(report)
    assert len(rm) <= cap
    valid = [
        (name, value)
        for report in reports
        for name, value in report.items()
        if isinstance(name, str)
        and 1 <= len(name) <= 64
        and not name.startswith("_")
        and all(c.isascii() and (c.isalnum() or c in "_.-") for c in name)
        and isinstance(value, int | float | np.number)
        and not isinstance(value, bool)
    ]
    kept = sum(rm[name].count + rm[name].non_finite for name in rm)
    assert kept + rm.dropped_names == len(valid)
    out = rm.to_json()
    assert list(out) == sorted(rm) + (["_dropped_names"] if rm.dropped_names else [])
    assert out.get("_dropped_names", 0) == rm.dropped_names
    json.dumps(out, allow_nan=False)


def test_merging_round_metrics_keeps_the_cap_and_counts_what_it_drops():
    a, b = RoundMetrics(max_names=2), RoundMetrics(max_names=2)
    a.add({"loss": 1.0, "accuracy": 0.5})
    b.add({"loss": 3.0, "update_norm": 2.0, "extra": 1.0})
    b.add({"update_norm": 4.0})
    a.merge(b)
    assert sorted(a) == ["accuracy", "loss"]
    assert a["loss"].count == 2 and a["loss"].mean == 2.0
    assert a.dropped_names == 1 + 2  # b's own drop ("extra") + b's two update_norm values
    assert a.to_json()["_dropped_names"] == 3


def test_device_metrics_of_a_hand_made_update():
    w1 = np.array([[3.0, -4.0], [1.0, 2.0]], dtype=np.float32) * 4
    w2 = np.array([0.5, -0.25], dtype=np.float32) * 4
    update = {
        "dense/w": w1,
        "dense/b": w2,
        "loss_sum": np.array(6.0, dtype=np.float32),
        "correct": np.array(3.0, dtype=np.float32),
        "count": np.array(4.0, dtype=np.float32),
        "num_examples": np.array([4.0], dtype=np.float32),
        "not_scalar": np.zeros(2, dtype=np.float32),
    }
    out = device_metrics(update, ["dense/w", "dense/b", "missing"])
    expected_norm = np.sqrt(np.sum(w1.astype(np.float64) ** 2) + np.sum(w2.astype(np.float64) ** 2)) / 4
    assert set(out) == {"loss_sum", "correct", "count", "num_examples", "loss", "accuracy", "update_norm"}
    assert out["loss"] == 1.5 and out["accuracy"] == 0.75 and out["num_examples"] == 4.0
    assert out["update_norm"] == pytest.approx(expected_norm, rel=1e-12)
    assert all(type(v) is float for v in out.values())


def test_device_metrics_without_weights_or_examples():
    evaluation = {"loss_sum": np.array(2.0, np.float32), "count": np.array(0.0, np.float32)}
    assert device_metrics(evaluation, ["w"]) == {"loss_sum": 2.0, "count": 0.0}
    no_examples = {"w": np.array([3.0, 4.0], np.float32), "num_examples": np.array(0.0, np.float32)}
    assert device_metrics(no_examples, ["w"]) == {"num_examples": 0.0, "update_norm": 5.0}


def test_rounds_frame_flattens_two_rounds():
    def round_json(number, status, shapes, loss):
        rm = RoundMetrics()
        for v in loss:
            rm.add({"loss": v})
        return {
            "task": "train",
            "round": number,
            "attempt": 1,
            "status": status,
            "checkpoint_id": f"c{number}",
            "started_at": float(number),
            "ended_at": number + 1.5,
            "metrics": {
                "selected": 13,
                "reported": len(loss),
                "rejected_late": 0,
                "aborted": 1,
                "dropped": 1,
                "duration_s": 1.5,
                "shapes": shapes,
                "train_loss": sum(loss) / len(loss),
                "device_metrics": rm.to_json(),
            },
        }

    rounds = [round_json(1, "committed", {"-v[]+^": 2}, [1.0, 3.0]), round_json(2, "failed", {"-v[]!": 1}, [2.0])]
    frame = rounds_frame(rounds)
    assert len(frame) == 2
    for column in [
        "task",
        "round",
        "attempt",
        "status",
        "checkpoint_id",
        "started_at",
        "ended_at",
        "selected",
        "reported",
        "rejected_late",
        "aborted",
        "dropped",
        "duration_s",
        "train_loss",
        "shape.-v[]+^",
        "shape.-v[]!",
        "device_metrics.loss.count",
        "device_metrics.loss.mean",
        "device_metrics.loss.std",
        "device_metrics.loss.min",
        "device_metrics.loss.max",
        "device_metrics.loss.non_finite",
        "device_metrics.loss.p05",
        "device_metrics.loss.p50",
        "device_metrics.loss.p95",
    ]:
        assert column in frame.columns, column
    assert "metrics" not in frame.columns and "device_metrics.loss.quantiles.p50" not in frame.columns
    assert frame["round"].tolist() == [1, 2]
    assert frame["status"].tolist() == ["committed", "failed"]
    assert frame["shape.-v[]+^"].tolist() == [2, 0] and frame["shape.-v[]!"].tolist() == [0, 1]
    assert frame["device_metrics.loss.mean"].tolist() == [2.0, 2.0]
    assert frame["device_metrics.loss.std"].tolist() == [1.0, 0.0]
    assert frame["device_metrics.loss.p50"].tolist() == [1.0, 2.0]
    assert frame["train_loss"].tolist() == [2.0, 2.0]


def test_rounds_frame_names_the_extra_when_pandas_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match=r"fedfleet\[analysis\]"):
        rounds_frame([])


def _thread_cpu_ticks() -> dict[str, int]:
    """Each thread of this process: CPU ticks used so far (utime + stime of /proc/self/task/*/stat)."""
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        out[task] = int(fields[11]) + int(fields[12])
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2, reason="needs Linux and 2 cores")
def test_update_norms_run_on_the_calling_thread_alone():
    """A fleet simulation computes these for every report on its one thread; BLAS's dot (which
    np.linalg.norm is) hands vectors above 10,000 entries to OpenBLAS's worker threads, which then
    spin on the other cores: in a fleet of the glyphs CNN that doubled the process's CPU."""
    update = {"w": np.random.default_rng(0).standard_normal(60_000).astype(np.float32), "num_examples": np.float32(3.0)}
    main = str(threading.get_native_id())
    before = _thread_cpu_ticks()
    while _thread_cpu_ticks()[main] - before[main] < 30:  # 0.3 s of this thread's CPU at 100 ticks a second
        for _ in range(50):
            out = device_metrics(update, ["w"])
    after = _thread_cpu_ticks()
    others = sum(ticks - before.get(task, 0) for task, ticks in after.items() if task != main)
    assert out["update_norm"] == pytest.approx(float(np.linalg.norm(update["w"].astype(np.float64))) / 3.0, rel=1e-12)
    assert others <= 0.1 * (after[main] - before[main]), (others, after[main] - before[main])
