"""Training throughput of plans whose backward pass the toolchain generated (reverse-mode autodiff
in standard ONNX ops), against baselines measured in the same run:

* CNN on 28x28 inputs (Conv 1->8 3x3, Relu, MaxPool 2, Conv 8->16 3x3, Relu, MaxPool 2, Flatten,
  Gemm 784->10), batch 32, one SGD step per batch, one thread: the generated plan through
  ``PlanExecutor.run_device`` vs torch autograd in eager mode (``torch.set_num_threads(1)``) on the
  same model, exported to ONNX by ``torch.onnx.export``. Goal: ratio >= 1.0.
* MLP 784-128-10 (the hand-written plan of ``device_runtime.plan_builder``, regenerated from its
  ONNX inference model): the generated plan vs the numpy step of ``benchmarks.plan_exec``.
  Goal: ratio >= 1.5 at batch 32 and 128.

The first lines check that each pair computes the same steps. Needs the ``bench`` extra (torch).

Both sides of each pair run on one thread in this process, so examples per second are measured on
the process's CPU time (``time.process_time``): on a shared machine wall time also counts the time
the process waited for a core, which varied by 2x between runs; wall-clock figures are printed too.

    cd /work/main && .venv/bin/python -m benchmarks.plan_autodiff [--quick]

Prints one JSON object per line; the last line is the summary with the targets.
"""

from __future__ import annotations

# first: plan_exec limits BLAS and OpenMP to one thread before numpy is imported
from benchmarks.plan_exec import C, F, H, LR, _data, numpy_step, threadpool_limits

import argparse  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402

from device_runtime.executor import PlanExecutor  # noqa: E402
from device_runtime.plan_builder import build_mlp_plan, initial_weights  # noqa: E402
from emulator.toolchain import SGD, initial_weights_from_onnx, training_plan_from_onnx  # noqa: E402
from example_store import ExampleSelector  # noqa: E402

SIDE, CLASSES, BATCH = 28, 10, 32
CNN_LR = 0.05


def _timed(run) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of ``run()``."""
    cpu, wall = time.process_time(), time.perf_counter()
    run()
    return time.process_time() - cpu, time.perf_counter() - wall


def _emit(obj: dict) -> None:
    print(json.dumps({"benchmark": "plan_autodiff", **obj}), flush=True)


# ---------------------------------------------------------------------------- CNN vs torch


def torch_cnn():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(16 * 7 * 7, CLASSES),
    )


def export(module) -> onnx.ModelProto:
    import torch

    buf = io.BytesIO()
    torch.onnx.export(module.eval(), (torch.zeros(2, 1, SIDE, SIDE),), buf, input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "N"}, "logits": {0: "N"}}, opset_version=17, dynamo=False)
    return onnx.load_from_string(buf.getvalue())


def cnn_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((n, 1, SIDE, SIDE), dtype=np.float32), rng.integers(0, CLASSES, n).astype(np.int64)


def cnn_plan(model: onnx.ModelProto):
    return training_plan_from_onnx(model, label="y", loss="cross_entropy", optimizer=SGD(CNN_LR), batch_size=BATCH,
                                   example_selector=ExampleSelector("bench:/images"))


def torch_steps(module, x: np.ndarray, y: np.ndarray) -> float:
    """SGD steps over the batches in eager torch; returns the summed loss."""
    import torch

    opt = torch.optim.SGD(module.parameters(), lr=CNN_LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    total = 0.0
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    module.train()
    for i in range(0, len(y), BATCH):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(module(xt[i : i + BATCH]), yt[i : i + BATCH])
        loss.backward()
        opt.step()
        total += loss.item() * len(yt[i : i + BATCH])
    return total


def check_cnn_same_step(steps: int = 4) -> dict:
    import torch

    module = torch_cnn()
    model = export(module)
    plan = cnn_plan(model)
    x, y = cnn_data(BATCH * steps, seed=1)
    executor = PlanExecutor(plan)
    w0 = initial_weights_from_onnx(model, plan)
    result = executor.run_device(w0, lambda: [{"x": x[i : i + BATCH], "y": y[i : i + BATCH]} for i in range(0, len(y), BATCH)])
    ours = executor.final_weights(w0, result)
    loss = torch_steps(module, x, y)
    theirs = {name: p.detach().numpy() for name, p in module.named_parameters()}
    diff = max(float(np.abs(ours[k] - theirs[k]).max()) for k in theirs)
    ok = diff < 1e-4 and abs(loss - result.metrics["loss_sum"]) < 1e-3 * abs(loss)
    if not ok:
        raise SystemExit(f"the generated CNN step and torch's disagree (max weight diff {diff})")
    return {"check": "cnn_same_step", "steps": steps, "max_weight_diff": diff, "ok": ok}


def bench_cnn_plan(model, x, y) -> tuple[float, float]:
    plan = cnn_plan(model)
    executor = PlanExecutor(plan)
    w0 = initial_weights_from_onnx(model, plan)
    batches = [{"x": x[i : i + BATCH], "y": y[i : i + BATCH]} for i in range(0, len(y), BATCH)]
    executor.run_device(w0, lambda: batches[:4])  # warm-up
    return _timed(lambda: executor.run_device(w0, lambda: batches))


def bench_cnn_torch(x, y) -> tuple[float, float]:
    module = torch_cnn()
    torch_steps(module, x[: 4 * BATCH], y[: 4 * BATCH])  # warm-up
    return _timed(lambda: torch_steps(module, x, y))


# ---------------------------------------------------------------------------- MLP vs numpy


def mlp_model(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The hand-written plan's model as an ONNX inference model: Gemm-Relu-Gemm."""
    nodes = [helper.make_node("Gemm", ["x", "w0", "b0"], ["z0"]), helper.make_node("Relu", ["z0"], ["a0"]),
             helper.make_node("Gemm", ["a0", "w1", "b1"], ["logits"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", F])],
                              [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", C])],
                              initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _mlp_reference(batch: int):
    return build_mlp_plan(F, (H,), C, selector=ExampleSelector("bench:/mnist"), learning_rate=LR, batch_size=batch)


def mlp_plan(batch: int):
    weights = initial_weights(_mlp_reference(batch), seed=0)
    return training_plan_from_onnx(mlp_model(weights), label="y", loss="cross_entropy", optimizer=SGD(LR), batch_size=batch,
                                   example_selector=ExampleSelector("bench:/mnist"), inputs={"x": "x"}), weights


def check_mlp_same_step(batch: int = 32, steps: int = 5) -> dict:
    x, y = _data(batch * steps, seed=1)
    plan, w0 = mlp_plan(batch)
    executor = PlanExecutor(plan)
    result = executor.run_device(w0, lambda: [{"x": x[i : i + batch], "y": y[i : i + batch]} for i in range(0, len(y), batch)])
    ours = executor.final_weights(w0, result)
    ref = {k: v.copy() for k, v in w0.items()}
    for i in range(0, len(y), batch):
        numpy_step(ref, x[i : i + batch], y[i : i + batch])
    diff = max(float(np.abs(ours[k] - ref[k]).max()) for k in ref)
    if diff >= 1e-4:
        raise SystemExit(f"the regenerated MLP step and the numpy step disagree (max weight diff {diff})")
    return {"check": "mlp_same_step", "steps": steps, "max_weight_diff": diff, "ok": True}


def bench_mlp_plan(batch: int, n: int) -> tuple[float, float]:
    x, y = _data(n)
    batches = [{"x": x[i : i + batch], "y": y[i : i + batch]} for i in range(0, n, batch)]
    plan, w0 = mlp_plan(batch)
    executor = PlanExecutor(plan)
    executor.run_device(w0, lambda: batches[:4])
    return _timed(lambda: executor.run_device(w0, lambda: batches))


def bench_mlp_numpy(batch: int, n: int) -> tuple[float, float]:
    x, y = _data(n)
    w = {k: v.copy() for k, v in initial_weights(_mlp_reference(batch), seed=0).items()}

    def steps() -> None:
        for i in range(0, n, batch):
            numpy_step(w, x[i : i + batch], y[i : i + batch])

    return _timed(steps)


def _best(pairs: list[tuple[float, float]], n: int) -> tuple[float, float]:
    """Examples per CPU second and per wall second, each the best of the repeats."""
    return n / min(cpu for cpu, _ in pairs), n / min(wall for _, wall in pairs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller run (about a minute)")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        raise SystemExit("plan_autodiff compares with torch: install the bench extra first (.venv/bin/pip install -e '.[bench]')") from None

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    repeats = 3 if args.quick else 7
    cnn_n = 1024 if args.quick else 4096
    mlp_n = 16384 if args.quick else 65536
    targets = {}
    limiter = threadpool_limits(limits=1) if threadpool_limits is not None else None
    try:
        _emit(check_cnn_same_step())
        _emit(check_mlp_same_step())
        model = export(torch_cnn())
        x, y = cnn_data(cnn_n)
        # Interleave the two so that drifts of the machine's speed hit both alike; keep the best.
        runs: dict[str, list] = {"plan": [], "torch": []}
        for _ in range(repeats):
            runs["plan"].append(bench_cnn_plan(model, x, y))
            runs["torch"].append(bench_cnn_torch(x, y))
        (plan_eps, plan_wall), (torch_eps, torch_wall) = _best(runs["plan"], cnn_n), _best(runs["torch"], cnn_n)
        ratio = plan_eps / torch_eps
        for impl, eps, wall in (("generated_plan", plan_eps, plan_wall), ("torch_eager", torch_eps, torch_wall)):
            _emit({"impl": impl, "model": "cnn_28x28", "batch": BATCH, "examples": cnn_n,
                   "examples_per_cpu_s": round(eps, 1), "examples_per_wall_s": round(wall, 1)})
        _emit({"model": "cnn_28x28", "batch": BATCH, "ratio_vs_torch": round(ratio, 3),
               "wall_ratio_vs_torch": round(plan_wall / torch_wall, 3)})
        targets["cnn_ratio_vs_torch_b32"] = {"value": round(ratio, 3), "goal": 1.0, "met": bool(ratio >= 1.0)}
        for batch in (32, 128):
            runs = {"plan": [], "numpy": []}
            for _ in range(repeats):
                runs["plan"].append(bench_mlp_plan(batch, mlp_n))
                runs["numpy"].append(bench_mlp_numpy(batch, mlp_n))
            (plan_eps, plan_wall), (numpy_eps, numpy_wall) = _best(runs["plan"], mlp_n), _best(runs["numpy"], mlp_n)
            ratio = plan_eps / numpy_eps
            for impl, eps, wall in (("generated_plan", plan_eps, plan_wall), ("numpy", numpy_eps, numpy_wall)):
                _emit({"impl": impl, "model": "mlp_784_128_10", "batch": batch, "examples": mlp_n,
                       "examples_per_cpu_s": round(eps, 1), "examples_per_wall_s": round(wall, 1)})
            _emit({"model": "mlp_784_128_10", "batch": batch, "ratio_vs_numpy": round(ratio, 3),
                   "wall_ratio_vs_numpy": round(plan_wall / numpy_wall, 3)})
            targets[f"mlp_ratio_vs_numpy_b{batch}"] = {"value": round(ratio, 3), "goal": 1.5, "met": bool(ratio >= 1.5)}
    finally:
        if limiter is not None:
            limiter.restore_original_limits()
    _emit({"summary": True, "quick": args.quick, "onnxruntime": ort.__version__, "torch": torch.__version__,
           "numpy": np.__version__, "python": platform.python_version(), "threads": 1, "targets": targets})


if __name__ == "__main__":
    main()
