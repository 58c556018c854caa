"""A fleet on its real onnxruntime releases (``[fleet] real_runtimes = true``): the simulator's
plan takes the model engineer's path to a deploy (paper, section 7.3) before the run starts.

* the plan is versioned for every release of ``runtime_versions``
  (:func:`emulator.toolchain.versioning.versioned_plan`);
* each versioned plan is release-tested on its real release in that release's cached env
  (:func:`emulator.toolchain.release.release_test`: it loads, one step matches the reference run
  within tolerance, a local epoch runs), and a release that fails stops the run before it starts;
* the task is deployed with the report, which binds the hashes of the exact bytes deployed, so
  the server's release gate lets it through and serves each device the plan of its minor release;
* devices train through :class:`~emulator.releases.workers.ReleasePlans`: one worker process per
  release, shared by all of its devices.

Compute still costs virtual time from the device model (the plan's cost per example, see
``plan_cost``, times the device's speed), never the worker's wall clock, so a run stays a
function of its config and seed; what the releases change is the numbers the devices report.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from device_runtime.plan import Plan, PlanError, serialize_plan
from emulator.releases.workers import WorkerPool
from emulator.toolchain.tasks import Predicate, ProxyData, Task, TaskError, Trial

from .events import SimulationError

__all__ = ["PROXY_DEVICES", "ReleasedPlans", "release_tested_plans"]

#: Proxy shards the release tests train on (cut from the fleet's held-out test set).
PROXY_DEVICES = 2


@dataclass(frozen=True)
class ReleasedPlans:
    """What a deploy with versioned plans sends: the unversioned plan, one versioned plan per
    release (the bytes the report's hashes name) and the release report."""

    plan: bytes
    versioned: dict[str, bytes]
    report: dict[str, Any]


def _finite_losses(trial: Trial) -> tuple[bool, str]:
    losses = trial.loss_by_epoch
    return bool(losses) and all(map(math.isfinite, losses)), "losses " + ", ".join(f"{v:.4g}" for v in losses)


#: What every release must show beyond loading and matching the reference: a local epoch on a proxy
#: shard ends with a finite loss. No more, so that a fleet may study a task that learns badly.
_trains_to_a_finite_loss = Predicate("local_epoch_loss_is_finite", _finite_losses, local_epochs=1)


def release_tested_plans(
    plan: Plan,
    weights: Mapping[str, np.ndarray],
    releases: Sequence[str],
    test_set: tuple[np.ndarray, np.ndarray] | Mapping[str, np.ndarray] | None,
    pool: WorkerPool,
    *,
    seed: int = 0,
    task: Task | None = None,
    versioned: Mapping[str, Plan] | None = None,
    trained: tuple[Plan, Mapping[str, np.ndarray]] | None = None,
) -> ReleasedPlans:
    """Version ``plan`` for each of ``releases`` and release-test it there; raises
    :class:`SimulationError` naming the release and the check when one cannot run it.

    ``task`` (a task file's, claiming ``releases``) is tested as ``fedfleet plan test`` tests it:
    its own proxy data and predicates, and for an evaluation ``trained`` (its training task's plan
    and initial model). Without it, the plan is tested on shards of ``test_set`` for a finite loss."""
    from emulator.toolchain.release import release_table, release_test
    from emulator.toolchain.versioning import versioned_plan

    plans: dict[str, Plan] = dict(versioned or {})
    for release in releases:
        if release in plans:
            continue
        try:
            plans[release] = versioned_plan(plan, release)
        except PlanError as exc:  # VersioningError, or a release outside the known support table
            raise SimulationError(
                f"fleet.real_runtimes: no plan for onnxruntime {release} ({exc}); remove it from runtime_versions"
            ) from None
    if task is None:
        assert test_set is not None
        examples = (
            {"x": np.asarray(test_set[0]), "y": np.asarray(test_set[1])}
            if isinstance(test_set, tuple)
            else dict(test_set)
        )
        proxy = ProxyData.split(examples, devices=PROXY_DEVICES, seed=seed)
        task = Task(
            name=plan.name,
            model=lambda _hp: plan,
            proxy=proxy,
            runtimes=tuple(releases),
            predicates=(_trains_to_a_finite_loss,),
        )
    try:
        report = release_test(task, pool=pool, plan=plan, versioned=plans, weights=weights, trained=trained)
    except (TaskError, ValueError) as exc:  # the task's proxy data or predicates cannot run
        raise SimulationError(f"fleet.real_runtimes: task {task.name!r} cannot be release-tested: {exc}") from None
    if not report["passed"]:
        raise SimulationError(
            f"fleet.real_runtimes: task {task.name!r} failed its release tests; remove the failing releases from "
            "runtime_versions or set fleet.real_runtimes = false:\n" + release_table(report)
        )
    return ReleasedPlans(serialize_plan(plan), {r: serialize_plan(p) for r, p in plans.items()}, report)
