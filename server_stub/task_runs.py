"""A task's life in memory (``TaskRun``): loaded from the store where its rounds go on after its last
one on record, so that a restarted server continues where it stopped, and each of its rounds opened
with the state the round keeps (the round core, Secure Aggregation, the running sum, central DP)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import onnxruntime as ort
from pydantic import ValidationError

from device_runtime.checkpoint import decode_checkpoint, encode_checkpoint
from device_runtime.eligibility import EligibilityPolicies
from device_runtime.executor import PlanExecutor
from device_runtime.plan import PlanError, load_plan
from device_runtime.secure_sum import SecureSumCodec
from secagg import PeerVerifier

from . import ddp_rounds, dp_rounds
from .dp_rounds import TaskDP, spends_privacy
from .errors import BadRequest
from .metrics import RoundMetrics
from .persistence import ServerStore, TaskRecord
from .rounds import RoundConfig, RoundCore
from .secure_rounds import SecureRound, SecureSettings
from .service_state import TaskRun
from .task_choice import Strategy

#: Header and framing allowance on top of the tensors a report must carry.
REPORT_SLACK_BYTES = 64 * 1024


def _advice(task: TaskRecord, fix: str = "values in range") -> str:
    """What a refused task's reason tells the operator to do."""
    return (
        f"it is kept on record and not run: deploy it again under a new task name with {fix}, or stop "
        f"the server and retire it (fedfleet server retire --db DB --population {task.population} --task {task.name})"
    )


class StoredTaskRefused(ValueError):
    """A task on record whose config this server no longer takes (an older release accepted it):
    the reason names the field, its stored value and what to do."""


class NotRetired(ValueError):
    """A task ``retire_refused`` leaves as it is: there is none of that name, or it is not refused."""


class Group(NamedTuple):
    """A population's tasks as a server loads them: the first deploy with a task to run (its runs,
    strategy and turn; None when none has one), and each active task it refuses, with the reason."""

    runs: tuple[list[TaskRun], Strategy, int] | None
    refused: dict[str, str]


def _config_problem(exc: ValidationError) -> str:
    """A stored config's first refusal in one line that names its field and value: a check across
    fields says both itself (``dp.delta 1e-40 is below 1e-30 ...; use ...``), a range names the
    field, the value and the bound."""
    first: dict[str, Any] = dict(exc.errors(include_url=False)[0])
    message = str(first.get("msg", "not valid"))
    if first.get("type") == "value_error":
        return message.removeprefix("Value error, ")
    field = ".".join(str(part) for part in first.get("loc", ()))
    return f"{field} {first.get('input')!r}: {message}"


def stored_config(task: TaskRecord) -> tuple[RoundConfig, EligibilityPolicies]:
    """The task's round config and eligibility policies as stored, validated as a deploy is today;
    ``StoredTaskRefused`` when they no longer pass (what the deploy checked then is on record: it
    is never rewritten to pass)."""
    try:
        return RoundConfig.from_dict(task.config["round"]), EligibilityPolicies.from_dict(task.config["eligibility"])
    except ValidationError as exc:
        where = "eligibility" if exc.title == EligibilityPolicies.__name__ else "config"
        raise StoredTaskRefused(
            f"its stored {where} no longer passes: {_config_problem(exc)}; {_advice(task)}"
        ) from None


#: Why the installed onnxruntime cannot run each stored plan checked in this process (None: it
#: can), by plan id: the id is the plan's SHA-256, so the same bytes always get the same answer,
#: and a server checks a plan once however often its population's tasks are loaded.
_PLAN_PROBLEMS: dict[str, str | None] = {}


def plan_problem(store: ServerStore, task: TaskRecord) -> str | None:
    """Why this server cannot run the task's stored plan, None when it can: an older release
    stored a plan whose opset or IR version the installed onnxruntime refuses, or a graph it
    cannot make a session of or run. The deploy checked the plan on the onnxruntime of its day
    (``PlanExecutor.smoke_test``); an upgrade may refuse it, and a server that found out at its
    first round would stop at every start. The same check runs here, on zeros of the plan's
    weights (only their shapes matter to it): a few milliseconds for a small plan."""
    if task.plan_id not in _PLAN_PROBLEMS:
        problem: str | None = None
        try:
            executor = PlanExecutor(load_plan(store.resource(task.plan_id)))
            executor.smoke_test(
                {name: np.zeros(shape, dtype) for name, (shape, dtype) in executor.weight_spec().items()}
            )
        except PlanError as exc:
            problem = str(exc)
        except Exception as exc:  # noqa: BLE001 - onnx and onnxruntime raise their own classes
            problem = " ".join(str(exc).split())[:500] or type(exc).__name__
        _PLAN_PROBLEMS[task.plan_id] = problem
    return _PLAN_PROBLEMS[task.plan_id]


def plan_runs(plan_id: str) -> None:
    """Note that the plan ``plan_id`` passed this process's check at deploy: ``plan_problem``
    need not run it again when the server loads its task."""
    _PLAN_PROBLEMS[plan_id] = None


def refusals(store: ServerStore, tasks: list[TaskRecord]) -> dict[str, str]:
    """Each active task this server refuses to run, with the reason: its stored config no longer
    passes (``stored_config``), the installed onnxruntime cannot run its stored plan
    (``plan_problem``), or it evaluates a task refused."""
    refused: dict[str, str] = {}
    for task in tasks:
        if task.status != "active":
            continue
        try:
            config, _ = stored_config(task)
        except StoredTaskRefused as exc:
            refused[task.name] = str(exc)
            continue
        problem = plan_problem(store, task)
        if problem is not None:
            refused[task.name] = (
                f"its stored plan does not run on onnxruntime {ort.__version__}: {problem}; "
                f"{_advice(task, 'a plan this onnxruntime runs')}"
            )
            continue
        if config.dp is not None:  # what a deploy refuses today of its plan and dp together
            try:
                dp_rounds.check_deploy(task.name, load_plan(store.resource(task.plan_id)), config)
            except BadRequest as exc:
                said = str(exc).removeprefix(f"task {task.name!r}: ")
                refused[task.name] = f"its stored plan and dp no longer pass: {said}; {_advice(task, 'such a plan')}"
    for task in tasks:
        evaluated = task.config.get("group", {}).get("evaluates")
        if task.status == "active" and task.name not in refused and evaluated in refused:
            refused[task.name] = f"it evaluates task {evaluated!r}, which is refused; {_advice(task)}"
    return refused


def retire_refused(store: ServerStore, population: str, name: str) -> int:
    """Mark the population's task ``name``, one this server refuses (``refusals``) or one an
    operator stopped (``FLService.stop_task``), as ``retired``: no server runs it again, and a
    refusal is no longer said at each start. Its record, rounds, models and privacy ledger stay,
    and its name stays taken. Only for a database no server runs on (a running server has its
    tasks in memory). Returns its round records."""
    if store.population_id(population) is None:
        has = ", ".join(store.population_names()) or "none"
        raise NotRetired(f"there is no population {population!r} (populations: {has})")
    records = store.tasks(population)
    task = next((t for t in records if t.name == name), None)
    if task is None:
        has = ", ".join(t.name for t in records) or "none"
        raise NotRetired(f"population {population!r} has no task {name!r} (its tasks: {has})")
    if task.status != "stopped" and name not in refusals(store, records):
        state = task.status if task.status != "active" else "active or queued: this server runs it"
        raise NotRetired(
            f"task {population}/{name} is {state}; only a refused or a stopped task is retired"
            if task.status == "retired"
            else f"task {population}/{name} is not refused or stopped ({state}); only a refused or a stopped task "
            "is retired (fedfleet stop stops a running one)"
        )
    store.set_task_status(task.id, "retired")
    return len(store.rounds(task.id))


def load_group(store: ServerStore, population: str) -> Group:
    """The first deploy (group of tasks) with an active task it can run, continuing after each
    task's last committed round (and, for alternating tasks, with the turn after the last round
    run); tasks that reached ``max_rounds`` are marked completed. A task whose stored config
    this server refuses is left as it is on record and not run (``refusals``): the other
    tasks of its deploy run, and a deploy with no other task is passed over."""
    records = store.tasks(population)
    refused = refusals(store, records)
    groups: dict[str, list[TaskRecord]] = {}
    for task in records:
        group = task.config.get("group", {})
        groups.setdefault(group.get("first", task.name), []).append(task)
    for members in groups.values():
        runs: dict[str, TaskRun] = {}
        for task in members:
            if task.status != "active" or task.name in refused:
                continue
            run = load_run(store, task)
            if run is None:
                store.set_task_status(task.id, "completed")
                continue
            runs[task.name] = run
        for task in members:
            evaluated = task.config.get("group", {}).get("evaluates")
            if task.name in runs and evaluated is not None:
                if evaluated not in runs:  # its model is final: nothing more to evaluate
                    store.set_task_status(task.id, "completed")
                    del runs[task.name]
                else:
                    runs[task.name].evaluates = runs[evaluated]
        if runs:
            strategy = Strategy(members[0].config.get("group", {}).get("strategy", Strategy.ALTERNATE.value))
            turn = sum(len(store.rounds(task.id)) + store.pruned_counts(task.id)[0] for task in members)
            return Group((list(runs.values()), strategy, turn), refused)
    return Group(None, refused)


def load_run(store: ServerStore, task: TaskRecord) -> TaskRun | None:
    """The task as it stands after its last committed round; None once it has run its course
    (``max_rounds`` committed, or its privacy budget spent)."""
    config, eligibility = stored_config(task)
    plan = load_plan(store.resource(task.plan_id))
    executor = PlanExecutor(plan)
    history = store.rounds(task.id)
    committed = [r for r in history if r.status == "committed"]
    committed_count = len(committed) + store.pruned_counts(task.id)[1]  # with those retention removed
    if config.max_rounds is not None and committed_count >= config.max_rounds:
        return None
    dp = TaskDP.load(config, [r.metrics for r in history if spends_privacy(r.status, r.metrics)])
    if dp is not None and not dp.allows_next():  # its privacy budget is spent
        return None
    last = committed[-1] if committed else None
    ckpt_id = last.checkpoint_id if last is not None and last.checkpoint_id else task.initial_checkpoint_id
    state = {k: np.array(v) for k, v in decode_checkpoint(store.resource(ckpt_id)).items()}
    number = (last.number + 1) if last else 1
    # after the last attempt on record (not their count: one whose record a stopped server
    # never wrote leaves a gap, and a round on record under (number, attempt) is not written again)
    attempt = 1 + max((r.attempt for r in history if r.number == number), default=0)
    spec = executor.client_update_spec()
    limit = REPORT_SLACK_BYTES + sum(int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in spec.values())
    return TaskRun(
        record=task,
        plan=plan,
        executor=executor,
        config=config,
        eligibility=eligibility,
        state=state,
        broadcast_id=store.put_resource(encode_checkpoint(executor.prepare(state)), "checkpoint"),
        round_number=number,
        attempt=attempt,
        committed_rounds=committed_count,
        report_limit=limit,
        weight=float(task.config.get("group", {}).get("weight", 1.0)),
        codec=SecureSumCodec(plan, executor) if plan.server.secure_sum else None,
        ddp=ddp_rounds.distributed_dp(plan, executor, config),
        versions=dict(task.config.get("versions", {})),
        dp=dp,
    )


def open_round(
    run: TaskRun,
    now: float,
    wall_now: float,
    secagg_random_bytes: Callable[[int], bytes],
    certifies: PeerVerifier | None = None,
) -> None:
    """Open ``run``'s next round at ``now``: a fresh round core, Secure Aggregation round (whose
    seeds come from ``secagg_random_bytes``, and whose groups take only keys ``certifies``
    accepts, ``SecureRound``), running sum and counts. An evaluation task measures the model its
    training task has now."""
    if run.evaluates is not None:
        run.state = run.evaluates.state
        run.broadcast_id = run.evaluates.broadcast_id
    settings = SecureSettings.for_config(run.config) if run.codec is not None else None
    run.core = RoundCore(
        run.round_number,
        run.config,
        now,
        deadlines_from_selection_end=settings is not None,
        finalization_s=settings.finalization_s if settings is not None else 0.0,
    )
    if settings is not None:
        assert run.codec is not None
        run.secure = SecureRound(
            run.codec,
            settings,
            f"{run.record.name}/{run.round_number}/{run.attempt}",
            random_bytes=secagg_random_bytes,
            ddp=run.ddp,
            certifies=certifies,
        )
    run.accumulator = run.executor.zero()
    run.dp_round = run.dp.open_round(run.codec is not None) if run.dp is not None else None
    run.device_metrics = RoundMetrics()
    run.bounded = {"capped": 0, "clipped": 0}
    run.started_wall = wall_now
