"""Deploying tasks: the ``TaskSpec`` of one task, everything a deploy checks before anything is
stored (names, plans, checkpoints, round configs, release reports), and the release's resources.
A plan that loads but does not run is refused here, with nothing stored, instead of failing rounds
later; every refusal is a 4xx ``ApiError`` that names the task and what to change."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from device_runtime import protocol
from device_runtime.checkpoint import CheckpointError, decode_checkpoint
from device_runtime.eligibility import EligibilityPolicies
from device_runtime.executor import PlanExecutor
from device_runtime.plan import Plan, PlanError, load_plan
from device_runtime.secure_sum import SecureSumCodec

from . import ddp_rounds, dp_rounds, task_runs
from .errors import ApiError, BadRequest, Conflict, InvalidCheckpoint, InvalidPlan, NotFound, quoted
from .persistence import NewTask, ServerStore, TaskRecord, resource_id
from .release_gate import ReleaseGateError, check_release_report, minor_key
from .rounds import RoundConfig
from .schemas import NAME_RULE, is_name
from .secure_rounds import SecureSettings
from .task_choice import Strategy

#: Tasks one deploy may bring together.
MAX_TASKS_PER_GROUP = 16


@dataclass(frozen=True)
class TaskSpec:
    """One task of a deploy. ``evaluates`` names a training task of the same deploy whose
    current model an evaluation task measures (it then needs no checkpoint of its own).
    ``versioned_plans`` (onnxruntime release -> plan bytes) and ``release_report`` (the JSON
    ``fedfleet plan test`` wrote) come together: devices are then served the plan of their release."""

    name: str
    plan: bytes
    checkpoint: bytes | None
    config: RoundConfig = RoundConfig()
    eligibility: EligibilityPolicies = EligibilityPolicies()
    weight: float = 1.0
    evaluates: str | None = None
    versioned_plans: dict[str, bytes] = field(default_factory=dict)
    release_report: dict | None = None


def new_tasks(
    store: ServerStore,
    population: str,
    specs: list[TaskSpec],
    strategy: Strategy,
    *,
    require_release_reports: bool,
    release_trust: frozenset[bytes],
) -> list[NewTask]:
    """The tasks of one deploy as they are to be stored, once every check passed: each carries its
    versioned plans and release report as resources its config names, stored with the task in
    one transaction (``ServerStore.add_tasks``), so a server killed meanwhile keeps none of them.
    Nothing is written here. Raises a 4xx ``ApiError``; the caller stores the tasks."""
    if not specs or len(specs) > MAX_TASKS_PER_GROUP:
        raise BadRequest(f"a deploy holds 1 to {MAX_TASKS_PER_GROUP} tasks", code="BAD_CONFIG")
    names = [s.name for s in specs]
    for spec in specs:
        check_name(spec.name, "task")
        check_config(spec)  # before any plan is loaded and run: a large model's takes tens of seconds
    if len(set(names)) != len(names):
        raise BadRequest("the tasks of one deploy need distinct names", code="BAD_CONFIG")
    existing = {t.name: t for t in store.tasks(population)}
    taken = sorted(existing.keys() & set(names))
    if taken and any(existing[s.name].plan_id != resource_id(s.plan) for s in specs if s.name in existing):
        raise task_exists(population, taken)
    if taken and len(taken) < len(names):
        raise deployed_beside_new(population, taken, [n for n in names if n not in existing])
    checked: dict[str, tuple[Plan, bytes]] = {}
    for spec in sorted(specs, key=lambda s: s.evaluates is not None):  # trained tasks first
        trained = None
        if spec.evaluates is not None:
            if spec.evaluates not in checked or checked[spec.evaluates][0].kind != "train":
                raise BadRequest(
                    f"task {spec.name!r} evaluates {spec.evaluates!r}, which is not a training task of this deploy",
                    code="BAD_CONFIG",
                )
            trained = checked[spec.evaluates][0]
        checkpoint = (
            spec.checkpoint
            if spec.checkpoint is not None
            else (checked[spec.evaluates][1] if spec.evaluates is not None else None)
        )
        if checkpoint is None:
            raise BadRequest(f"task {spec.name!r} needs an initial checkpoint", code="MISSING_FIELD")
        checked[spec.name] = (validate_task(spec, checkpoint, trained), checkpoint)
    by_name = {s.name: s for s in specs}
    releases = {
        s.name: check_release(
            s,
            checked[s.name][0],
            require_release_reports,
            by_name[s.evaluates] if s.evaluates is not None else None,
            trusted=release_trust,
            checkpoint=checked[s.name][1],
        )
        for s in specs
    }
    # checked last: a client that creates the population on this answer (fedfleet deploy) then knows
    # the deploy would be taken, and never leaves behind a population whose deploy was refused
    if store.population_id(population) is None:
        raise NotFound(f"population {quoted(population)} does not exist; create it first", code="UNKNOWN_POPULATION")
    items = []
    for s in specs:
        release, resources = release_resources(s, releases[s.name])
        config = {
            "round": s.config.to_dict(),
            "eligibility": s.eligibility.to_dict(),
            "group": {"strategy": strategy.value, "weight": s.weight, "evaluates": s.evaluates, "first": specs[0].name},
            **release,
        }
        items.append(NewTask(s.name, s.plan, checked[s.name][1], config, resources))
    return items


def deployed_beside_new(population: str, taken: list[str], new: list[str]) -> Conflict:
    """A deploy that holds tasks already deployed beside new ones (the same group sent with a task
    added, say): whatever their content, the new ones deploy on their own."""
    return Conflict(
        f"population {quoted(population)} has task {taken[0]!r} deployed already; a deployed task cannot join "
        f"a new deploy: deploy {', '.join(map(repr, new))} without it (and a changed task under a new name)",
        code="TASK_EXISTS",
    )


def task_exists(population: str, taken: list[str]) -> Conflict:
    return Conflict(
        f"population {quoted(population)} already has a task named {taken[0]!r}, deployed with other content; "
        "deploy changed tasks under new names (the same deploy sent again is answered with the tasks it made)",
        code="TASK_EXISTS",
    )


def stored_before(store: ServerStore, population: str, items: list[NewTask]) -> list[TaskRecord] | None:
    """The tasks of a deploy already stored exactly as ``items`` (a deploy sent again after its
    answer was lost), or None when none of its names is taken. A name taken with other content
    raises ``TASK_EXISTS``."""
    existing = {t.name: t for t in store.tasks(population)}
    taken = [item for item in items if item.name in existing]
    if not taken:
        return None
    differs = sorted(
        i.name
        for i in taken
        if existing[i.name].plan_id != resource_id(i.plan)
        or existing[i.name].initial_checkpoint_id != resource_id(i.checkpoint)
        or existing[i.name].config != json.loads(json.dumps(i.config))
    )
    if differs:
        raise task_exists(population, differs)
    if len(taken) < len(items):  # the same tasks again, and new ones beside them
        raise deployed_beside_new(
            population, [i.name for i in taken], [i.name for i in items if i.name not in existing]
        )
    return [existing[i.name] for i in items]


def release_resources(
    spec: TaskSpec, versions: dict[str, tuple[str, bytes]]
) -> tuple[dict, tuple[tuple[bytes, str], ...]]:
    """What the task's config says of its release (the ids of its versioned plans and report, and
    the releases claimed), and those resources as (bytes, kind), to be stored with the task."""
    if spec.release_report is None:
        return {}, ()
    report = json.dumps(spec.release_report, sort_keys=True, separators=(",", ":")).encode()
    names = {
        "versions": {key: resource_id(data) for key, (_, data) in versions.items()},
        "release": {"report_id": resource_id(report), "claimed": sorted(release for release, _ in versions.values())},
    }
    return names, (*((data, "plan") for _, data in versions.values()), (report, "release_report"))


def validate_task(spec: TaskSpec, checkpoint: bytes, trained: Plan | None) -> Plan:
    """What a deploy checks of one task's plan and checkpoint before anything is stored (its round
    config is checked before, by ``check_config``); raises a 4xx ``ApiError``."""
    if len(checkpoint) > protocol.MAX_RESOURCE_BYTES:
        raise InvalidCheckpoint(
            f"task {spec.name!r}: the initial checkpoint is {len(checkpoint):,} bytes, more than a device downloads "
            f"({protocol.MAX_RESOURCE_BYTES:,} bytes, and a device half its memory); no device could take part: "
            "train fewer weights or a smaller model"
        )
    try:
        plan = load_plan(spec.plan)
    except PlanError as exc:
        raise InvalidPlan(f"task {spec.name!r}: the plan was refused: {exc}") from None
    if plan.kind not in ("train", "eval"):
        raise InvalidPlan(f"task {spec.name!r}: plans of kind {plan.kind!r} cannot be deployed")
    try:
        weights = decode_checkpoint(checkpoint)
    except CheckpointError as exc:
        raise InvalidCheckpoint(f"task {spec.name!r}: the initial checkpoint was refused: {exc}") from None
    executor = PlanExecutor(plan)
    try:
        executor.client_update_spec()
        try:
            check_weights(executor, weights)
        except InvalidCheckpoint as exc:  # named as every other refusal of a deploy: which task's checkpoint
            raise InvalidCheckpoint(
                f"task {spec.name!r}: the initial checkpoint does not fit its plan (a checkpoint of another task "
                f"or model?): {exc.message}"
            ) from None
        if trained is not None and PlanExecutor(trained).weight_spec() != executor.weight_spec():
            raise InvalidPlan(f"task {spec.name!r}: its model's weights differ from those of the task it evaluates")
        executor.smoke_test(weights)
    except PlanError as exc:
        raise InvalidPlan(f"task {spec.name!r}: {exc}") from None
    task_runs.plan_runs(resource_id(spec.plan))  # the check a server makes of a stored plan at start
    config = spec.config
    dp_rounds.check_deploy(spec.name, plan, config)
    if plan.server.secure_sum:
        try:
            SecureSumCodec(plan, executor)
        except PlanError as exc:
            raise InvalidPlan(f"task {spec.name!r}: the plan's secure aggregation is not usable: {exc}") from None
        if plan.kind == "train" and config.clip_update_norm is None:
            raise BadRequest(
                f"task {spec.name!r}: a Secure Aggregation training task needs clip_update_norm: the server sees "
                "only each group's sum, and can bound one device's influence only through the norm its devices "
                "clip to; set clip_update_norm (the default is 10.0)",
                code="BAD_CONFIG",
            )
        if config.report_timeout_s <= 3 * config.secagg_round_timeout_s:
            raise BadRequest(
                f"report_timeout_s ({config.report_timeout_s}) must exceed three secagg_round_timeout_s "
                f"({config.secagg_round_timeout_s}): the key rounds and training fit in it (ConsistencyCheck and "
                "Unmasking follow it)",
                code="BAD_CONFIG",
            )
    ddp_rounds.check_deploy(spec.name, plan, executor, config, SecureSettings.for_config(config).spare)
    return plan


def check_config(spec: TaskSpec) -> None:
    """The round config and weight of one task, read without its plan; raises ``BadRequest``.
    Checked for every task of a deploy before any plan: loading and running a large model's plan
    takes the server tens of seconds (a ResNet-50's, 40 s on 2 busy cores), which an operator
    waited for to learn of a round config refused at a glance."""
    config = spec.config
    if config.commit_threshold < config.min_reports:  # every kind publishes: a model, or metrics and totals
        raise BadRequest(
            f"task {spec.name!r}: a round could commit with {config.commit_threshold} device(s) "
            f"(goal_count {config.goal_count} x min_fraction {config.min_fraction}), fewer than min_reports "
            f"({config.min_reports}); what a round publishes (a model, an evaluation's loss and accuracy, an "
            "analytics total) would give back so few devices' own values. Raise goal_count, or lower min_reports knowingly",
            code="BAD_CONFIG",
        )
    if not (spec.weight > 0 and np.isfinite(spec.weight)):
        raise BadRequest(f"task {spec.name!r}: weight must be a positive number", code="BAD_CONFIG")


def check_release(
    spec: TaskSpec,
    plan: Plan,
    required: bool,
    trained: TaskSpec | None = None,
    *,
    trusted: frozenset[bytes] = frozenset(),
    checkpoint: bytes | None = None,
) -> dict[str, tuple[str, bytes]]:
    """The versioned plans by minor release, once the release report lets the task through (an
    evaluation's report also has to match ``trained``, the training task it measures). Its
    signature is checked against ``trusted`` unless the server neither requires reports nor
    trusts any signer (``--allow-untested-plans`` without ``--release-trust``). ``checkpoint`` is
    the deploy's initial checkpoint, which a report naming the one it tested from must match."""
    if spec.release_report is None:
        if spec.versioned_plans or required:
            raise ApiError(
                f"task {spec.name!r}: this server deploys only tasks whose release report covers every runtime they "
                "claim; run `fedfleet plan test` and deploy with `fedfleet deploy`"
                if required
                else f"task {spec.name!r}: versioned plans come with the release report that tested them",
                code="RELEASE_REPORT_REQUIRED",
                status=422,
            )
        return {}
    hashes = {release: resource_id(data) for release, data in spec.versioned_plans.items()}
    try:
        trained_claimed = (trained.release_report or {}).get("claimed") if trained is not None else None
        claimed = check_release_report(
            spec.release_report,
            resource_id(spec.plan),
            hashes,
            trusted_keys=trusted if trusted or required else None,
            evaluates_plan_sha256=resource_id(trained.plan) if trained is not None else None,
            evaluates_runtimes=trained_claimed if isinstance(trained_claimed, list) else None,
            checkpoint_sha256=resource_id(checkpoint) if checkpoint is not None else None,
        )
    except ReleaseGateError as exc:
        raise ApiError(f"task {spec.name!r}: {exc.message}", code=exc.code, status=422) from None
    executor = PlanExecutor(plan)
    versions = {}
    for release in claimed:
        try:
            vplan = load_plan(spec.versioned_plans[release], runtime_version=release)
            same = (vplan.kind, vplan.weight_names, vplan.metric_names) == (
                plan.kind,
                plan.weight_names,
                plan.metric_names,
            )
            if not same or PlanExecutor(vplan).weight_spec() != executor.weight_spec():
                raise PlanError("its model, weights or metrics differ from the unversioned plan's")
        except PlanError as exc:
            raise InvalidPlan(f"task {spec.name!r}: the plan for onnxruntime {release} was refused: {exc}") from None
        versions[minor_key(release)] = (release, spec.versioned_plans[release])
    return versions


def check_name(name: str, what: str) -> None:
    """A name is safe in a URL path: a name of only dots would be the segment '.' or '..'."""
    if not is_name(name):
        raise BadRequest(f"{what} name {quoted(name)} refused: {NAME_RULE}", code="BAD_NAME")


def check_weights(executor: PlanExecutor, weights: dict[str, np.ndarray]) -> None:
    """The initial checkpoint holds exactly the plan's weights, in their shapes and dtypes."""
    expected = {
        name: spec for name, spec in executor.client_update_spec().items() if name in executor.plan.weight_names
    }
    if not expected:
        expected = executor.weight_spec()
    if set(weights) != set(expected):
        raise InvalidCheckpoint(f"the checkpoint holds {sorted(weights)} but the plan's weights are {sorted(expected)}")
    for name, (shape, dtype) in expected.items():
        if tuple(weights[name].shape) != tuple(shape) or weights[name].dtype != np.dtype(dtype):
            raise InvalidCheckpoint(
                f"weight {name!r} is {weights[name].dtype}{list(weights[name].shape)}, "
                f"the plan needs {np.dtype(dtype)}{list(shape)}"
            )
