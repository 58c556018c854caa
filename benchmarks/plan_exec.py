"""Training throughput of the plan executor's work step vs the same SGD step in numpy.

MLP 784-128-10, float32, one thread for both (onnxruntime: intra/inter-op 1 thread; numpy:
BLAS limited to one thread via threadpoolctl and the env vars set before numpy is imported).
Measures examples/s at batch 32 and 128 through ``PlanExecutor.run_device`` (IOBinding,
ping-pong weights) and through a hand-written numpy forward + backward + update.

    cd /work/main && .venv/bin/python -m benchmarks.plan_exec [--quick]

Prints one JSON object per line; the last line is the summary with the targets.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

try:
    from threadpoolctl import threadpool_limits  # noqa: E402
except ImportError:  # pragma: no cover
    threadpool_limits = None

import onnxruntime as ort  # noqa: E402

from device_runtime.executor import PlanExecutor  # noqa: E402
from device_runtime.plan_builder import build_mlp_plan, initial_weights  # noqa: E402

F, H, C = 784, 128, 10
LR = 0.1


def numpy_step(w: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """One SGD step in place on ``w``: forward, mean cross-entropy, backward, update."""
    w0, b0, w1, b1 = w["w0"], w["b0"], w["w1"], w["b1"]
    n = x.shape[0]
    z0 = x @ w0
    z0 += b0
    a0 = np.maximum(z0, 0)
    logits = a0 @ w1
    logits += b1
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    sumexp = exp.sum(axis=1, keepdims=True)
    rows = np.arange(n)
    loss_sum = float(np.log(sumexp[:, 0]).sum() - shifted[rows, y].sum())
    correct = float((logits.argmax(axis=1) == y).sum())
    g = exp / sumexp
    g[rows, y] -= 1.0
    g *= np.float32(LR / n)
    da0 = g @ w1.T
    da0 *= z0 > 0
    w1 -= a0.T @ g
    b1 -= g.sum(axis=0)
    w0 -= x.T @ da0
    b0 -= da0.sum(axis=0)
    return loss_sum, correct


def _data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((n, F), dtype=np.float32), rng.integers(0, C, n).astype(np.int64)


def bench_numpy(batch: int, n: int, repeats: int) -> float:
    x, y = _data(n)
    batches = [(x[i : i + batch], y[i : i + batch]) for i in range(0, n, batch)]
    best = 0.0
    plan = build_mlp_plan(F, (H,), C, selector=_selector(), learning_rate=LR, batch_size=batch)
    w0 = initial_weights(plan, seed=0)
    for _ in range(repeats):
        w = {k: v.copy() for k, v in w0.items()}
        t = time.perf_counter()
        for xb, yb in batches:
            numpy_step(w, xb, yb)
        best = max(best, n / (time.perf_counter() - t))
    return best


def bench_plan(batch: int, n: int, repeats: int) -> float:
    x, y = _data(n)
    batches = [{"x": x[i : i + batch], "y": y[i : i + batch]} for i in range(0, n, batch)]
    plan = build_mlp_plan(F, (H,), C, selector=_selector(), learning_rate=LR, batch_size=batch)
    executor = PlanExecutor(plan)
    w0 = initial_weights(plan, seed=0)
    executor.run_device(w0, lambda: batches[:4])  # warm-up: session creation, first-run allocations
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        executor.run_device(w0, lambda: batches)
        best = max(best, n / (time.perf_counter() - t))
    return best


def check_same_step(batch: int = 32, steps: int = 5) -> dict:
    """Both implementations compute the same SGD steps (so the comparison is fair)."""
    x, y = _data(batch * steps, seed=1)
    plan = build_mlp_plan(F, (H,), C, selector=_selector(), learning_rate=LR, batch_size=batch)
    w0 = initial_weights(plan, seed=0)
    executor = PlanExecutor(plan)
    result = executor.run_device(
        w0, lambda: [{"x": x[i : i + batch], "y": y[i : i + batch]} for i in range(0, len(y), batch)]
    )
    ours = executor.final_weights(w0, result)
    ref = {k: v.copy() for k, v in w0.items()}
    loss = 0.0
    for i in range(0, len(y), batch):
        loss += numpy_step(ref, x[i : i + batch], y[i : i + batch])[0]
    diff = max(float(np.abs(ours[k] - ref[k]).max()) for k in ref)
    ok = diff < 1e-4 and abs(loss - result.metrics["loss_sum"]) < 1e-3 * abs(loss)
    if not ok:
        raise SystemExit(f"the plan's step and the numpy step disagree (max weight diff {diff})")
    return {
        "steps": steps,
        "max_weight_diff": diff,
        "loss_sum_plan": round(result.metrics["loss_sum"], 4),
        "loss_sum_numpy": round(loss, 4),
        "ok": ok,
    }


def _selector():
    from example_store import ExampleSelector

    return ExampleSelector("bench:/mnist")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller run (a few seconds)")
    args = parser.parse_args(argv)
    n = 16384 if args.quick else 65536
    repeats = 5 if args.quick else 9
    results = {}
    limiter = threadpool_limits(limits=1) if threadpool_limits is not None else None
    try:
        print(json.dumps({"benchmark": "plan_exec", "check": "same_step", **check_same_step()}), flush=True)
        for batch in (32, 128):
            # Interleave the two so that drifts of the machine's speed hit both alike.
            ort_eps = max(bench_plan(batch, n, 1) for _ in range(repeats))
            np_eps = max(bench_numpy(batch, n, 1) for _ in range(repeats))
            ratio = ort_eps / np_eps
            results[batch] = ratio
            for impl, eps in (("plan_executor", ort_eps), ("numpy", np_eps)):
                print(
                    json.dumps(
                        {
                            "benchmark": "plan_exec",
                            "impl": impl,
                            "model": "mlp_784_128_10",
                            "batch": batch,
                            "examples": n,
                            "examples_per_s": round(eps, 1),
                        }
                    ),
                    flush=True,
                )
            print(json.dumps({"benchmark": "plan_exec", "batch": batch, "ratio_vs_numpy": round(ratio, 3)}), flush=True)
    finally:
        if limiter is not None:
            limiter.restore_original_limits()
    summary = {
        "benchmark": "plan_exec",
        "summary": True,
        "quick": args.quick,
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "threads": 1,
        "targets": {
            f"ratio_vs_numpy_b{b}": {"value": round(r, 3), "goal": 1.0, "met": bool(r >= 1.0)}
            for b, r in results.items()
        },
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
