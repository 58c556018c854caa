"""A task's life in memory (``TaskRun``): loaded from the store where its rounds go on after its last
one on record, so that a restarted server continues where it stopped, and each of its rounds opened
with the state the round keeps (the round core, Secure Aggregation, the running sum, central DP)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from device_runtime.checkpoint import decode_checkpoint, encode_checkpoint
from device_runtime.eligibility import EligibilityPolicies
from device_runtime.executor import PlanExecutor
from device_runtime.plan import load_plan
from device_runtime.secure_sum import SecureSumCodec
from secagg import PeerVerifier

from . import ddp_rounds
from .dp_rounds import TaskDP, spends_privacy
from .metrics import RoundMetrics
from .persistence import ServerStore, TaskRecord
from .rounds import RoundConfig, RoundCore
from .secure_rounds import SecureRound, SecureSettings
from .service_state import TaskRun
from .task_choice import Strategy

#: Header and framing allowance on top of the tensors a report must carry.
REPORT_SLACK_BYTES = 64 * 1024


def load_group(store: ServerStore, population: str) -> tuple[list[TaskRun], Strategy, int] | None:
    """The first deploy (group of tasks) with an active task, continuing after each task's
    last committed round (and, for alternating tasks, with the turn after the last round
    run); tasks that reached ``max_rounds`` are marked completed."""
    groups: dict[str, list[TaskRecord]] = {}
    for task in store.tasks(population):
        group = task.config.get("group", {})
        groups.setdefault(group.get("first", task.name), []).append(task)
    for members in groups.values():
        runs: dict[str, TaskRun] = {}
        for task in members:
            if task.status != "active":
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
            return list(runs.values()), strategy, turn
    return None


def load_run(store: ServerStore, task: TaskRecord) -> TaskRun | None:
    """The task as it stands after its last committed round; None once it has run its course
    (``max_rounds`` committed, or its privacy budget spent)."""
    plan = load_plan(store.resource(task.plan_id))
    executor = PlanExecutor(plan)
    config = RoundConfig.from_dict(task.config["round"])
    eligibility = EligibilityPolicies.from_dict(task.config["eligibility"])
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
