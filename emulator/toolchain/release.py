"""Release tests (paper, section 7.3): a task passes on every runtime it claims, or is not deployed.

For each claimed onnxruntime release, in a worker process inside that release's own cached env
(:mod:`emulator.releases.workers`), with that release's versioned plan:

* ``loads``: the release creates a session for the work graph;
* ``equivalence``: the work graph's outputs on the proxy batch (new weights and metrics of one
  step from the initial model) are within the task's tolerance of the reference run, which is the
  unversioned plan on this interpreter's onnxruntime;
* the task's predicates, judged on what that release computed (local epochs on a proxy shard;
  simulated FedAvg rounds whose device steps run on the release, aggregated by the plan's server
  part as the server would);
* ``budget.*``: peak memory over the worker's baseline and the median time per step, measured in
  the release, and the session time they imply for the largest proxy shard, against the budget.

An evaluation task (``evaluation_of``) is tested the same way, with what is meaningful for a plan
that does not train: ``loads``, ``equivalence`` of its metric sums on the proxy batch, its
predicates judged on the evaluations that release computed (through the device path and the
plan's server part) of the models its training task's simulated rounds produce (those rounds run
once, on the reference), and the budget for one device's evaluation session. Its report names the
training task and the plan whose models it measured.

The reference run is judged by the same predicates, so versioned and unversioned plans pass the
same tests. The report binds every result to the sha256 of the plan it ran (the server's resource
ids); ``server_stub.release_gate`` checks it at deploy. The judging is pure (:func:`compare_outputs`,
:func:`budget_checks`, :func:`report_passed`); the shell around it starts workers and runs steps.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from device_runtime.checkpoint import encode_checkpoint
from device_runtime.executor import PlanExecutor
from device_runtime.plan import Plan
from emulator.releases.envs import RuntimeEnvError
from emulator.releases.workers import RuntimeWorker, WorkerError, WorkerExecutor, WorkerPool
from emulator.toolchain.tasks import Budget, ProxyData, Task, TaskError, Tolerance, Trial, measured_as
from emulator.toolchain.versioning import VersioningError, plan_sha256, versioned_plan
from server_stub.release_gate import REPORT_FORMAT

__all__ = [
    "REPORT_FORMAT",
    "Check",
    "ReleaseTestError",
    "budget_checks",
    "compare_outputs",
    "max_abs_difference",
    "release_table",
    "release_test",
    "report_passed",
    "write_report",
]


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str = ""


class ReleaseTestError(TaskError):
    """The release tests cannot run at all, so there is no report to write: a release's env cannot
    be made (the index unreachable, a full disk: nothing the release did) or the unversioned plan
    fails on the reference. A :class:`TaskError`, so ``plan test`` and a fleet say it in one line."""


def max_abs_difference(reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray]) -> float | None:
    """The largest absolute difference over the outputs both hold with one shape (None if none)."""
    diffs = [
        float(np.max(np.abs(np.asarray(candidate[n], np.float64) - np.asarray(v, np.float64)))) if np.size(v) else 0.0
        for n, v in reference.items()
        if n in candidate and np.shape(candidate[n]) == np.shape(v)
    ]
    return max(diffs) if diffs else None


def compare_outputs(
    reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray], tolerance: Tolerance
) -> Check:
    """Every reference output present in ``candidate`` with its shape and within tolerance."""
    worst_name, worst = "", 0.0
    for name, want in reference.items():
        if name not in candidate:
            return Check("equivalence", False, f"output {name!r} is missing")
        got, want = np.asarray(candidate[name], dtype=np.float64), np.asarray(want, dtype=np.float64)
        if got.shape != want.shape:
            return Check(
                "equivalence", False, f"output {name!r} has shape {list(got.shape)}, the reference {list(want.shape)}"
            )
        if not np.allclose(got, want, rtol=tolerance.rtol, atol=tolerance.atol, equal_nan=False):
            err = float(np.max(np.abs(got - want))) if got.size else 0.0
            return Check(
                "equivalence",
                False,
                f"output {name!r} differs by up to {err:.3g} (rtol {tolerance.rtol:g}, atol {tolerance.atol:g}); "
                "where that is float rounding you accept (a deep model's sums are added up in another order on "
                "another release), set the task's tolerance=Tolerance(rtol=..., atol=...)",
            )
        err = float(np.max(np.abs(got - want))) if got.size else 0.0
        if err >= worst:
            worst_name, worst = name, err
    return Check("equivalence", True, f"max abs difference {worst:.3g} ({worst_name or 'no outputs'})")


def budget_checks(
    budget: Budget, peak_memory_mb: float, step_s: Sequence[float], steps_per_session: int
) -> list[Check]:
    """The measured costs against the budget's limits (only the limits the budget sets)."""
    step_ms = 1000.0 * statistics.median(step_s) if step_s else math.inf
    session_s = step_ms / 1000.0 * steps_per_session
    out = []
    if budget.memory_mb is not None:
        out.append(
            Check(
                "budget.memory_mb",
                peak_memory_mb <= budget.memory_mb,
                f"peak {peak_memory_mb:.1f} MB over the runtime's baseline (budget {budget.memory_mb:g})",
            )
        )
    if budget.step_ms is not None:
        out.append(
            Check(
                "budget.step_ms", step_ms <= budget.step_ms, f"median step {step_ms:.3f} ms (budget {budget.step_ms:g})"
            )
        )
    if budget.session_s is not None:
        out.append(
            Check(
                "budget.session_s",
                session_s <= budget.session_s,
                f"{steps_per_session} steps take {session_s:.3f} s (budget {budget.session_s:g})",
            )
        )
    return out


def report_passed(report: Mapping[str, Any]) -> bool:
    """A report passes when the reference and every claimed release passed every check."""
    entries = [report["reference"], *report["results"].values()]
    return all(e["passed"] and all(c["passed"] for c in e["checks"]) for e in entries) and set(
        report["results"]
    ) == set(report["claimed"])


# ----------------------------------------------------------------------------- the shell


def _only(shard: Mapping[str, np.ndarray]) -> Callable[[], list[Mapping[str, np.ndarray]]]:
    """The examples of one shard, opened anew for each pass (bound now, not when called)."""
    return lambda: [shard]


def _batches(
    executor: WorkerExecutor, shard: Mapping[str, np.ndarray], epochs: int
) -> list[list[dict[str, np.ndarray]]]:
    open_batches = executor.batches_from_examples(lambda: [shard])
    return [[executor.feeds(b) for b in open_batches()] for _ in range(epochs)]


def _mean_loss(values: Sequence[Sequence[float]], metric_names: Sequence[str]) -> float:
    names = list(metric_names)
    if "loss_sum" in names and "count" in names:
        count = sum(v[names.index("count")] for v in values)
        return sum(v[names.index("loss_sum")] for v in values) / count if count else math.nan
    return float(np.mean([v[0] for v in values])) if values else math.nan


def _holdout_metrics(
    executor: WorkerExecutor, weights: Mapping[str, np.ndarray], holdout: Mapping[str, np.ndarray]
) -> tuple[float, float]:
    plan = executor.plan
    names = [m for m in ("loss_sum", "correct", "count") if m in plan.metric_names]
    if "loss_sum" not in names or "count" not in names:
        return math.nan, math.nan
    out = executor.worker.run(plan.work, {**weights, **executor.feeds(holdout)}, names)
    count = float(out["count"])
    accuracy = float(out["correct"]) / count if "correct" in out else math.nan  # regression: no accuracy
    return accuracy, float(out["loss_sum"]) / count


@dataclass(frozen=True)
class _Run:
    trial: Trial
    step_s: list[float]
    peak_memory_mb: float
    steps_per_session: int


def _simulated_rounds(
    plan: Plan,
    server: PlanExecutor,
    weights: Mapping[str, np.ndarray],
    proxy: ProxyData,
    executor: WorkerExecutor,
    rounds: int,
) -> Iterator[dict[str, np.ndarray]]:
    """The model before the first simulated FedAvg round and after each of ``rounds``: every proxy
    shard is a device whose steps run in ``executor``'s worker, aggregated by the plan's server part."""
    state = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}  # + any server optimizer state
    model = {w: state[w] for w in plan.weight_names}
    yield model
    for _ in range(rounds):
        acc = server.zero()
        for shard in proxy.shards:
            result = executor.run_device(model, executor.batches_from_examples(_only(shard)))
            acc = server.accumulate(acc, result.update)
        state, _metrics = server.update(state, server.report(acc))
        state = {k: np.asarray(v, dtype=np.float32) for k, v in state.items()}
        model = {w: state[w] for w in plan.weight_names}
        yield model


def _steps_per_session(plan: Plan, proxy: ProxyData) -> int:
    largest = max(len(next(iter(s.values()))) for s in proxy.shards)
    return math.ceil(largest / plan.device.batch_size) * plan.device.epochs


def _run_task(
    task: Task,
    plan: Plan,
    server: PlanExecutor,
    weights: Mapping[str, np.ndarray],
    proxy: ProxyData,
    worker: RuntimeWorker,
) -> _Run:
    """Local epochs and simulated rounds of ``plan`` whose device steps run in ``worker``."""
    executor = WorkerExecutor(plan, worker)
    epochs = _batches(executor, proxy.shards[0], task.local_epochs)
    flat = [b for epoch in epochs for b in epoch]
    trained = worker.train(plan, weights, flat)
    losses, start = [], 0
    for epoch in epochs:
        losses.append(_mean_loss(trained.metric_values[start : start + len(epoch)], plan.metric_names))
        start += len(epoch)
    accuracies, round_losses = [], []
    for model in _simulated_rounds(plan, server, weights, proxy, executor, task.simulated_rounds):
        accuracy, loss = _holdout_metrics(executor, model, proxy.holdout)
        accuracies.append(accuracy)
        round_losses.append(loss)
    trial = Trial(worker.version, tuple(losses), tuple(accuracies), tuple(round_losses))
    return _Run(trial, trained.step_s, trained.peak_memory_mb, _steps_per_session(plan, proxy))


def _run_evaluation(
    plan: Plan,
    server: PlanExecutor,
    models: Sequence[Mapping[str, np.ndarray]],
    proxy: ProxyData,
    worker: RuntimeWorker,
) -> _Run:
    """The evaluation plan on each round's model: the holdout through the device path in
    ``worker``, the round's metrics from the plan's server part; costs of one device's session."""
    executor = WorkerExecutor(plan, worker)
    accuracies, losses = [], []
    for model in models:
        result = executor.run_device(model, executor.batches_from_examples(lambda: [proxy.holdout]))
        _, metrics = server.update(model, server.report(server.accumulate(server.zero(), result.update)))
        accuracies.append(metrics.get("eval_accuracy", math.nan))
        losses.append(metrics.get("eval_loss", math.nan))
    measured = worker.train(plan, models[0], _batches(executor, proxy.shards[0], 1)[0])
    trial = Trial(worker.version, (), tuple(accuracies), tuple(losses))
    return _Run(trial, measured.step_s, measured.peak_memory_mb, _steps_per_session(plan, proxy))


def _judge(task: Task, run: _Run) -> list[Check]:
    checks = []
    for p in task.predicates:
        try:
            passed, detail = p.check(run.trial)
        except Exception as exc:  # noqa: BLE001 - a predicate is user code: its failure fails it
            passed, detail = False, f"the predicate raised {type(exc).__name__}: {exc}"
        checks.append(Check(p.name, bool(passed), detail))
    return checks + budget_checks(task.budget, run.peak_memory_mb, run.step_s, run.steps_per_session)


def _entry(
    plan: Plan | None, runtime: str, checks: list[Check], run: _Run | None, diff: float | None = None
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "runtime": runtime,
        "plan_sha256": plan_sha256(plan) if plan is not None else None,
        "opset": plan.metadata.opset if plan is not None else None,
        "ir_version": plan.metadata.ir_version if plan is not None else None,
        "passed": all(c.passed for c in checks),
        "checks": [asdict(c) for c in checks],
    }
    if run is not None:
        entry["measured"] = {
            "peak_memory_mb": round(run.peak_memory_mb, 2),
            "median_step_ms": round(1000 * statistics.median(run.step_s), 4) if run.step_s else None,
            "steps_per_session": run.steps_per_session,
            "max_abs_diff": diff,
        }
        entry["trial"] = {
            k: [None if not math.isfinite(x) else round(x, 6) for x in v] if isinstance(v, tuple) else v
            for k, v in asdict(run.trial).items()
        }
    return entry


def release_test(
    task: Task,
    *,
    pool: WorkerPool,
    plan: Plan | None = None,
    versioned: Mapping[str, Plan] | None = None,
    weights: Mapping[str, np.ndarray] | None = None,
    runtimes: Sequence[str] | None = None,
    host: RuntimeWorker | None = None,
    progress: Callable[[str], None] | None = None,
    trained: tuple[Plan, Mapping[str, np.ndarray]] | None = None,
) -> dict[str, Any]:
    """Run the release tests of ``task`` on each of its claimed runtimes (or ``runtimes``) and
    return the report. ``plan`` / ``versioned`` / ``weights`` are the exact plans and initial model
    to test (as built for a deploy); by default they are made from the task here. For an
    evaluation task, ``trained`` is its training task's plan and initial model (by default built
    from ``task.evaluates``)."""
    plan = plan if plan is not None else task.build_plan()
    if (plan.kind == "eval") != (task.evaluates is not None):
        raise TaskError(f"task {task.name!r} is a {task.kind} task but its plan is of kind {plan.kind!r}")
    claimed = list(runtimes if runtimes is not None else task.runtimes)
    weights = dict(weights) if weights is not None else task.weights(plan)
    proxy = task.proxy_data()
    server = PlanExecutor(plan)
    own_host = host is None
    host = host if host is not None else RuntimeWorker.host()
    say = progress or (lambda _message: None)
    try:
        say(f"reference: unversioned plan on onnxruntime {host.version}")
        ref_executor = WorkerExecutor(plan, host)
        probe = _batches(ref_executor, proxy.shards[0], 1)[0][0]
        feeds = {**{k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}, **probe}
        outputs = [*plan.weight_outputs, *plan.metric_names]
        extra: dict[str, Any] = {}
        try:
            reference_outputs = host.run(plan.work, feeds, outputs)
            if task.evaluates is not None:
                if trained is None:
                    trained_plan = task.evaluates.build_plan()
                    trained = (trained_plan, task.evaluates.weights(trained_plan))
                say(
                    f"{task.evaluates.name}: {task.simulated_rounds} simulated rounds whose models the evaluation "
                    "measures"
                )
                models = list(
                    _simulated_rounds(
                        trained[0],
                        PlanExecutor(trained[0]),
                        trained[1],
                        proxy,
                        WorkerExecutor(trained[0], host),
                        task.simulated_rounds,
                    )
                )
                run_on: Callable[[Plan, RuntimeWorker], _Run] = lambda p, w: _run_evaluation(  # noqa: E731
                    p, server, models, proxy, w
                )
                extra["evaluates"] = {"task": task.evaluates.name, "plan_sha256": plan_sha256(trained[0])}
            else:
                run_on = lambda p, w: _run_task(task, p, server, weights, proxy, w)  # noqa: E731
                # the initial model the predicates were judged from: a deploy with another is not what was tested
                extra["checkpoint_sha256"] = hashlib.sha256(encode_checkpoint(weights)).hexdigest()
            ref_run = run_on(plan, host)
        except WorkerError as exc:  # the plan itself does not run: no release can be compared with it
            raise ReleaseTestError(
                f"task {task.name!r}: the unversioned plan does not run on the reference, this interpreter's "
                f"onnxruntime {host.version} ({exc}); fix the plan and build it again"
            ) from None
        report: dict[str, Any] = {
            "format": REPORT_FORMAT,
            "task": task.name,
            "kind": plan.kind,
            **extra,
            "plan_sha256": plan_sha256(plan),
            "opset": plan.metadata.opset,
            "reference": _entry(plan, host.version, _judge(task, ref_run), ref_run),
            "tolerance": asdict(task.tolerance),
            "budget": asdict(task.budget),
            "claimed": claimed,
            "results": {},
        }
        for runtime in claimed:
            say(f"onnxruntime {runtime}")
            vplan: Plan | None = None
            run: _Run | None = None
            diff: float | None = None
            checks: list[Check] = []
            step = "versioned_plan"  # the check a failure of the release is recorded as
            try:
                vplan = (
                    versioned[runtime]
                    if versioned is not None and runtime in versioned
                    else versioned_plan(plan, runtime)
                )
                step = "loads"
                if not pool.env_ready(runtime):
                    say(f"onnxruntime {runtime}: installing its env (once; a minute or two, 150-250 MB on disk)")
                worker = pool.worker(runtime)  # an env that cannot be made is not the release's doing
                worker.load(vplan.work)
                checks.append(Check("loads", True, f"opset {vplan.metadata.opset}, IR {vplan.metadata.ir_version}"))
                step = "equivalence"
                candidate = worker.run(vplan.work, feeds, outputs)
                checks.append(compare_outputs(reference_outputs, candidate, task.tolerance))
                diff = max_abs_difference(reference_outputs, candidate)
                step = "runs"  # local epochs, simulated rounds
                run = run_on(vplan, worker)
                checks += _judge(task, run)
            except (VersioningError, WorkerError) as exc:
                checks.append(Check(step, False, str(exc)))
            except RuntimeEnvError as exc:
                raise ReleaseTestError(str(exc)) from None
            report["results"][runtime] = _entry(vplan, runtime, checks, run, diff)
            measured = measured_as(runtime)
            if measured is not None:  # tested on its own wheel, versioned as its minor's measured release
                report["results"][runtime]["measured_as"] = measured
        report["passed"] = report_passed(report)
        return report
    finally:
        if own_host:
            host.close()


def release_table(report: Mapping[str, Any]) -> str:
    """The report as a table a person reads: one row per release (the reference first), whether it
    passed, the largest difference from the reference's outputs, the median step and peak memory;
    then the first failed check of each release that failed, and the measured release each earlier
    patch (1.24.1) is versioned as."""
    rows = [("release", "passed", "max abs diff", "ms/step", "peak MB")]
    failures = []  # and the earlier patches' notes
    entries = [(f"reference {report['reference']['runtime']}", report["reference"]), *report["results"].items()]
    for name, entry in entries:
        measured = entry.get("measured") or {}
        failed = [c for c in entry["checks"] if not c["passed"]]
        diff = measured.get("max_abs_diff")
        step, peak = measured.get("median_step_ms"), measured.get("peak_memory_mb")
        rows.append(
            (
                name,
                "yes" if entry["passed"] and not failed else "FAILED",
                "-" if diff is None else f"{diff:.3g}",
                "-" if step is None else f"{step:.3f}",
                "-" if peak is None else f"{peak:.1f}",
            )
        )
        if failed:
            failures.append(f"{name}: {failed[0]['name']}: {failed[0]['detail']}")
        if entry.get("measured_as"):
            failures.append(
                f"{name}: an earlier patch, versioned as {entry['measured_as']} (its minor's measured release)"
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
        for row in rows
    ]
    return "\n".join([*lines, *failures])


def write_report(report: Mapping[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # whole or not at all: an interrupted `plan test` keeps the report it had, never half of one
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
