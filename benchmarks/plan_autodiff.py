"""Training throughput of plans whose backward pass the toolchain generated (reverse-mode autodiff
in standard ONNX ops), against baselines measured in the same run:

* CNN on 28x28 inputs (Conv 1->8 3x3, Relu, MaxPool 2, Conv 8->16 3x3, Relu, MaxPool 2, Flatten,
  Gemm 784->10), batch 32, one SGD step per batch, one thread: the generated plan through
  ``PlanExecutor.run_device`` vs torch autograd in eager mode (``torch.set_num_threads(1)``) on the
  same model, exported to ONNX by ``torch.onnx.export``. Goal: ratio >= 1.0.
* MLP 784-128-10 (the hand-written plan of ``device_runtime.plan_builder``, regenerated from its
  ONNX inference model): the generated plan vs the numpy step of ``benchmarks.plan_exec``.
  Goal: ratio >= 1.5 at batch 32 and 128, which assumes numpy runs with its default kernels (the
  BLAS its wheel bundles, no forced CPU core or disabled SIMD): a line says whether it does.
* Real architectures from ``benchmarks.torch_models`` at benchmark size (ResNet-18, MobileNetV2, a
  tiny BERT, the torchvision and the transformers ViT, the LSTM classifier), batch 32, 32x32 images
  or 16 tokens, exported with training mode preserved: one SGD step of the plan over one of torch
  eager, CPU time. Goal: ``time_ratio_vs_torch`` <= 1.0 (MobileNetV2 <= 1.5). A model the plan
  refuses (an op without a gradient rule) is reported, op and node, and left out.

The first lines check that each pair computes the same steps. Needs the ``bench`` extra (torch,
transformers).

Both sides of each pair run on one thread in this process, so examples per second are measured on
the process's CPU time (``time.process_time``): on a shared machine wall time also counts the time
the process waited for a core, which varied by 2x between runs; wall-clock figures are printed too.

    cd /work/main && .venv/bin/python -m benchmarks.plan_autodiff [--quick] [--models resnet18,lstm]

Prints one JSON object per line; the last line is the summary with the targets.
"""

from __future__ import annotations

# first: plan_exec limits BLAS and OpenMP to one thread before numpy is imported
from benchmarks.plan_exec import LR, C, F, H, _data, numpy_step, threadpool_limits

# isort: split

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
from emulator.toolchain import SGD, UnsupportedOpError, initial_weights_from_onnx, training_plan_from_onnx  # noqa: E402
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
        torch.nn.Conv2d(1, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(16 * 7 * 7, CLASSES),
    )


def export(module) -> onnx.ModelProto:
    import torch

    buf = io.BytesIO()
    torch.onnx.export(
        module.eval(),
        (torch.zeros(2, 1, SIDE, SIDE),),
        buf,
        input_names=["x"],
        output_names=["logits"],
        dynamic_axes={"x": {0: "N"}, "logits": {0: "N"}},
        opset_version=17,
        dynamo=False,
    )
    return onnx.load_from_string(buf.getvalue())


def cnn_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((n, 1, SIDE, SIDE), dtype=np.float32), rng.integers(0, CLASSES, n).astype(np.int64)


def cnn_plan(model: onnx.ModelProto):
    return training_plan_from_onnx(
        model,
        label="y",
        loss="cross_entropy",
        optimizer=SGD(CNN_LR),
        batch_size=BATCH,
        example_selector=ExampleSelector("bench:/images"),
    )


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
    module = torch_cnn()
    model = export(module)
    plan = cnn_plan(model)
    x, y = cnn_data(BATCH * steps, seed=1)
    executor = PlanExecutor(plan)
    w0 = initial_weights_from_onnx(model, plan)
    result = executor.run_device(
        w0, lambda: [{"x": x[i : i + BATCH], "y": y[i : i + BATCH]} for i in range(0, len(y), BATCH)]
    )
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
    nodes = [
        helper.make_node("Gemm", ["x", "w0", "b0"], ["z0"]),
        helper.make_node("Relu", ["z0"], ["a0"]),
        helper.make_node("Gemm", ["a0", "w1", "b1"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", F])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", C])],
        initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _mlp_reference(batch: int):
    return build_mlp_plan(F, (H,), C, selector=ExampleSelector("bench:/mnist"), learning_rate=LR, batch_size=batch)


def mlp_plan(batch: int):
    weights = initial_weights(_mlp_reference(batch), seed=0)
    return training_plan_from_onnx(
        mlp_model(weights),
        label="y",
        loss="cross_entropy",
        optimizer=SGD(LR),
        batch_size=batch,
        example_selector=ExampleSelector("bench:/mnist"),
        inputs={"x": "x"},
    ), weights


def check_mlp_same_step(batch: int = 32, steps: int = 5) -> dict:
    x, y = _data(batch * steps, seed=1)
    plan, w0 = mlp_plan(batch)
    executor = PlanExecutor(plan)
    result = executor.run_device(
        w0, lambda: [{"x": x[i : i + batch], "y": y[i : i + batch]} for i in range(0, len(y), batch)]
    )
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


# ---------------------------------------------------------------------------- real architectures vs torch

REAL_MODELS = ("resnet18", "mobilenet_v2", "bert", "vit", "hf_vit", "lstm")
#: the plan's step time over torch eager's: at most 1.0 (as fast as torch), MobileNetV2 1.5
REAL_GOALS = {"mobilenet_v2": 1.5}
REAL_LR = 0.01
LABEL = "label"


def _real_spec(name: str):
    from benchmarks.torch_models import spec

    return spec(name)


def real_module(name: str, *, dropout: bool = True):
    """The family's benchmark-size module with seeded random weights, in training mode; without
    ``dropout`` its Dropout is off (eval mode but for BatchNorm, which keeps batch statistics), so
    that the plan and torch can be held to the same step."""
    import torch

    torch.manual_seed(0)
    module = _real_spec(name).full().train()
    if not dropout:
        module.eval()
        for m in module.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.train()
    return module


def real_batches(name: str, n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Batches of the family's inputs (floats standard normal, integers uniform below their bound) and class labels."""
    spec = _real_spec(name)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        batch = {}
        for inp in spec.inputs:
            shape = (BATCH, *inp.shape)
            batch[inp.name] = (
                rng.standard_normal(shape, dtype=np.float32)
                if inp.dtype == "float32"
                else rng.integers(0, inp.high, shape).astype(np.int64)
            )
        batch[LABEL] = rng.integers(0, spec.classes, BATCH).astype(np.int64)
        out.append(batch)
    return out


def export_for_training(name: str, module) -> onnx.ModelProto:
    """The module exported as a training plan needs it: training mode preserved (BatchNorm and
    Dropout kept), no constant folding (every parameter its own initializer), a dynamic batch."""
    import torch

    names = [inp.name for inp in _real_spec(name).inputs]
    example = real_batches(name, 1, seed=99)[0]
    buf = io.BytesIO()
    torch.onnx.export(
        module,
        tuple(torch.from_numpy(example[k][:2]) for k in names),
        buf,
        input_names=names,
        output_names=["logits"],
        dynamic_axes={k: {0: "N"} for k in [*names, "logits"]},
        opset_version=17,
        dynamo=False,
        training=torch.onnx.TrainingMode.PRESERVE,
        do_constant_folding=False,
    )
    return onnx.load_from_string(buf.getvalue())


def real_plan(name: str, model: onnx.ModelProto):
    names = [inp.name for inp in _real_spec(name).inputs]
    return training_plan_from_onnx(
        model,
        label=LABEL,
        loss="cross_entropy",
        optimizer=SGD(REAL_LR),
        batch_size=BATCH,
        example_selector=ExampleSelector("bench:/real"),
        inputs={k: k for k in names},
    )


def real_torch_steps(name: str, module, batches) -> list[float]:
    """SGD steps of torch eager over tensors made from ``batches``; returns each step's loss."""
    import torch

    opt = torch.optim.SGD(module.parameters(), lr=REAL_LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(module(*batch[0]), batch[1])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _tensors(name: str, batches, dtype=None):
    import torch

    names = [inp.name for inp in _real_spec(name).inputs]

    def cast(a):
        t = torch.from_numpy(a)
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    return [([cast(b[k]) for k in names], torch.from_numpy(b[LABEL])) for b in batches]


def check_real_same_step(name: str) -> dict:
    """One SGD step of the plan against torch's on the same weights and batch, both measured
    against torch's step in float64: the step's loss within 1e-5 relative, and the update (every
    trained tensor and running statistic, as one vector) within 1e-3 relative. torch's float32
    step is reported beside it. Not a tighter bound: torch accumulates its reductions in double,
    onnxruntime in float32, and a deep net's ReLU6 or Relu turns a rounding difference at a kink
    into a whole element's gradient (MobileNetV2: 3e-4 for the plan, 1e-5 for torch float32)."""
    import copy

    import torch

    module = real_module(name, dropout=False)
    model = export_for_training(name, module)
    reference = copy.deepcopy(
        module
    )  # after the export: its trace ran BatchNorm once, and the model holds those statistics
    plan = real_plan(name, model)
    batch = real_batches(name, 1, seed=1)
    executor = PlanExecutor(plan)
    w0 = initial_weights_from_onnx(model, plan)
    result = executor.run_device(w0, lambda: batch)
    ours = executor.final_weights(w0, result)
    loss = result.metrics["loss_sum"] / result.metrics["count"]
    torch32 = copy.deepcopy(reference)
    loss32 = real_torch_steps(name, torch32, _tensors(name, batch))[0]
    torch64 = copy.deepcopy(reference).double()
    loss64 = real_torch_steps(name, torch64, _tensors(name, batch, torch.float64))[0]
    start = {k: v.detach().double().numpy() for k, v in reference.state_dict().items()}
    exact = {k: v.detach().numpy() for k, v in torch64.state_dict().items()}
    theirs = {k: v.detach().numpy() for k, v in torch32.state_dict().items()}
    shared = [k for k in ours if k in exact and exact[k].dtype.kind == "f"]
    step = float(np.sqrt(sum(float(np.sum((exact[k] - start[k]) ** 2)) for k in shared)))

    def error(values: dict[str, np.ndarray]) -> float:
        return float(np.sqrt(sum(float(np.sum((values[k] - exact[k]) ** 2)) for k in shared))) / step

    plan_error, torch_error = error(ours), error(theirs)
    loss_error, torch_loss_error = abs(loss - loss64) / abs(loss64), abs(loss32 - loss64) / abs(loss64)
    ok = plan_error <= 1e-3 and loss_error <= 1e-5
    if not ok:
        raise SystemExit(
            f"the plan's {name} step and torch's disagree: update error {plan_error:.2e} (torch float32: "
            f"{torch_error:.2e}), loss error {loss_error:.2e} (torch float32: {torch_loss_error:.2e})"
        )
    return {
        "check": f"{name}_same_step",
        "tensors_compared": len(shared),
        "plan_tensors": len(ours),
        "update_error": float(f"{plan_error:.3g}"),
        "torch_float32_update_error": float(f"{torch_error:.3g}"),
        "loss_error": float(f"{loss_error:.3g}"),
        "torch_float32_loss_error": float(f"{torch_loss_error:.3g}"),
        "ok": ok,
    }


def bench_real(name: str, steps: int, repeats: int) -> dict:
    """ms per step (CPU time) of the plan and of torch eager, both in training mode with Dropout
    active, over ``repeats`` interleaved runs of ``steps`` steps each: short runs, many of them,
    so that both sides meet the shared machine's quiet and busy moments alike. The ratio is taken
    on each side's best run, as the rows above; the medians' ratio is printed too."""
    module = real_module(name)
    model = export_for_training(name, module)
    plan = real_plan(name, model)
    executor = PlanExecutor(plan)
    w0 = initial_weights_from_onnx(model, plan)
    batches = real_batches(name, steps, seed=0)
    tensors = _tensors(name, batches)
    executor.run_device(w0, lambda: batches)  # warm-up
    real_torch_steps(name, module, tensors)
    runs: dict[str, list] = {"plan": [], "torch": []}
    for _ in range(repeats):
        runs["plan"].append(_timed(lambda: executor.run_device(w0, lambda: batches)))
        runs["torch"].append(_timed(lambda: real_torch_steps(name, module, tensors)))
    cpu = {k: sorted(1000 * c / steps for c, _ in v) for k, v in runs.items()}
    wall = {k: min(1000 * w / steps for _, w in v) for k, v in runs.items()}
    plan_ms, torch_ms = cpu["plan"][0], cpu["torch"][0]
    return {
        "model": name,
        "batch": BATCH,
        "steps": steps,
        "repeats": repeats,
        "plan_ms_per_step": round(plan_ms, 2),
        "torch_ms_per_step": round(torch_ms, 2),
        "time_ratio_vs_torch": round(plan_ms / torch_ms, 3),
        "median_time_ratio_vs_torch": round(float(np.median(cpu["plan"]) / np.median(cpu["torch"])), 3),
        "wall_time_ratio_vs_torch": round(wall["plan"] / wall["torch"], 3),
    }


def numpy_kernels() -> dict:
    """Which BLAS and CPU kernels numpy runs, read without threadpoolctl: the build's BLAS
    (``numpy.show_config``), the core OpenBLAS picked at run time (its own ``get_corename``, when
    the bundled library is found), the SIMD extensions found, and the environment variables that
    override any of them. ``default`` is True when nothing is overridden and the BLAS is the
    OpenBLAS numpy's wheel bundles."""
    import ctypes
    import glob
    import os

    config = np.show_config(mode="dicts")
    blas = config.get("Build Dependencies", {}).get("blas", {})
    corename = None
    libs = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in glob.glob(os.path.join(libs, "*openblas*")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in (
            "scipy_openblas_get_corename64_",
            "scipy_openblas_get_corename",
            "openblas_get_corename64_",
            "openblas_get_corename",
        ):
            fn = getattr(lib, symbol, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                corename = fn().decode()
                break
    overrides = {
        k: os.environ[k]
        for k in (
            "OPENBLAS_CORETYPE",
            "OPENBLAS_VERBOSE",
            "NPY_DISABLE_CPU_FEATURES",
            "NPY_ENABLE_CPU_FEATURES",
            "MKL_DEBUG_CPU_TYPE",
            "MKL_ENABLE_INSTRUCTIONS",
        )
        if os.environ.get(k)
    }
    simd = config.get("SIMD Extensions", {})
    bundled = "openblas" in str(blas.get("name", "")).lower() and corename is not None
    return {
        "blas": blas.get("name"),
        "blas_version": blas.get("version"),
        "blas_build": blas.get("openblas configuration"),
        "blas_core": corename,
        "simd_found": simd.get("found"),
        "overrides": overrides,
        "default": bool(bundled and not overrides),
    }


def _real_rows(names: list[str], steps: int, repeats: int, targets: dict, skipped: dict) -> None:
    for name in names:
        try:
            _emit(check_real_same_step(name))
            row = bench_real(name, steps, repeats)
        except UnsupportedOpError as exc:  # another op rule is missing: say which, leave the row out
            skipped[name] = f"the plan refuses op {exc.op_type!r} (node {exc.node_name!r}): {exc}"
            _emit({"model": name, "skipped": True, "op": exc.op_type, "node": exc.node_name, "reason": str(exc)})
            continue
        _emit(row)
        goal = REAL_GOALS.get(name, 1.0)
        ratio = row["time_ratio_vs_torch"]
        targets[f"{name}_time_ratio_vs_torch_b{BATCH}"] = {"value": ratio, "goal": goal, "met": bool(ratio <= goal)}


def _best(pairs: list[tuple[float, float]], n: int) -> tuple[float, float]:
    """Examples per CPU second and per wall second, each the best of the repeats."""
    return n / min(cpu for cpu, _ in pairs), n / min(wall for _, wall in pairs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller run (a few minutes)")
    parser.add_argument(
        "--models",
        default=",".join(REAL_MODELS),
        help=f"comma-separated real architectures to time against torch ({', '.join(REAL_MODELS)}; '' for none)",
    )
    args = parser.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    try:
        import torch
    except ImportError:
        raise SystemExit(
            "plan_autodiff compares with torch: install the bench extra first (.venv/bin/pip install -e '.[bench]')"
        ) from None

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    repeats = 3 if args.quick else 7
    cnn_n = 1024 if args.quick else 4096
    mlp_n = 16384 if args.quick else 65536
    targets: dict = {}
    skipped: dict = {}
    kernels = numpy_kernels()
    limiter = threadpool_limits(limits=1) if threadpool_limits is not None else None
    try:
        _emit({"numpy_kernels": kernels})
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
            _emit(
                {
                    "impl": impl,
                    "model": "cnn_28x28",
                    "batch": BATCH,
                    "examples": cnn_n,
                    "examples_per_cpu_s": round(eps, 1),
                    "examples_per_wall_s": round(wall, 1),
                }
            )
        _emit(
            {
                "model": "cnn_28x28",
                "batch": BATCH,
                "ratio_vs_torch": round(ratio, 3),
                "wall_ratio_vs_torch": round(plan_wall / torch_wall, 3),
            }
        )
        targets["cnn_ratio_vs_torch_b32"] = {"value": round(ratio, 3), "goal": 1.0, "met": bool(ratio >= 1.0)}
        for batch in (32, 128):
            runs = {"plan": [], "numpy": []}
            for _ in range(repeats):
                runs["plan"].append(bench_mlp_plan(batch, mlp_n))
                runs["numpy"].append(bench_mlp_numpy(batch, mlp_n))
            (plan_eps, plan_wall), (numpy_eps, numpy_wall) = _best(runs["plan"], mlp_n), _best(runs["numpy"], mlp_n)
            ratio = plan_eps / numpy_eps
            for impl, eps, wall in (("generated_plan", plan_eps, plan_wall), ("numpy", numpy_eps, numpy_wall)):
                _emit(
                    {
                        "impl": impl,
                        "model": "mlp_784_128_10",
                        "batch": batch,
                        "examples": mlp_n,
                        "examples_per_cpu_s": round(eps, 1),
                        "examples_per_wall_s": round(wall, 1),
                    }
                )
            _emit(
                {
                    "model": "mlp_784_128_10",
                    "batch": batch,
                    "ratio_vs_numpy": round(ratio, 3),
                    "wall_ratio_vs_numpy": round(plan_wall / numpy_wall, 3),
                }
            )
            targets[f"mlp_ratio_vs_numpy_b{batch}"] = {
                "value": round(ratio, 3),
                "goal": 1.5,
                "met": bool(ratio >= 1.5),
                "numpy_default_kernels": kernels["default"],
            }
        _real_rows(names, 2, 4 if args.quick else 12, targets, skipped)
    finally:
        if limiter is not None:
            limiter.restore_original_limits()
    _emit(
        {
            "summary": True,
            "quick": args.quick,
            "onnxruntime": ort.__version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "numpy_default_kernels": kernels["default"],
            "python": platform.python_version(),
            "threads": 1,
            "targets": targets,
            "skipped": skipped,
        }
    )


if __name__ == "__main__":
    main()
