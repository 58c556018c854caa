"""A built task on disk: what ``fedfleet plan build`` writes, ``plan test`` tests and ``deploy`` sends.

Layout of ``DIR`` (one sub-directory per task; a task group has several)::

    DIR/task.py                      a copy of the task file (its predicates and proxy data)
    DIR/source.json                  where the task file was (loaded from there while it exists)
    DIR/<task>/manifest.json         names, sha256 ids, opsets and IR versions of everything below
    DIR/<task>/plan.fedplan          the unversioned plan
    DIR/<task>/versions/<release>.fedplan   one versioned plan per claimed onnxruntime release
    DIR/<task>/initial.ckpt          the initial model (an evaluation's is its training task's)
    DIR/<task>/release_report.json   written (and signed, with ``--signing-key``) by ``plan test``

The plans are tested and deployed as the exact bytes in the bundle, so the report's hashes are the
ids the server computes for what it receives.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import ValidationError

from device_runtime.checkpoint import decode_checkpoint, encode_checkpoint
from device_runtime.eligibility import EligibilityPolicies
from device_runtime.plan import Plan, load_plan, serialize_plan
from emulator.releases.workers import WorkerPool
from emulator.toolchain.release import release_test, write_report
from emulator.toolchain.release_signing import sign_report
from emulator.toolchain.tasks import Task, TaskError, check_known_releases, fields_said, load_tasks, measured_as
from emulator.toolchain.versioning import plan_sha256, versioned_plan
from server_stub.admin_client import AdminClient, AdminError, task_body
from server_stub.errors import did_you_mean_path
from server_stub.rounds import RoundConfig

__all__ = [
    "BuiltTask",
    "TaskBuild",
    "build_bundle",
    "build_task",
    "bundle_task_file",
    "deploy_bundle",
    "read_bundle",
    "release_test_bundle",
]

MANIFEST = "manifest.json"
REPORT = "release_report.json"
TASK_FILE = "task.py"
SOURCE = "source.json"


@dataclass(frozen=True)
class BuiltTask:
    """One task of a bundle, read back: its plans as bytes and what the manifest says."""

    task: Task
    root: Path
    plan: bytes
    versions: dict[str, bytes]
    checkpoint: bytes
    manifest: dict[str, Any]

    @property
    def report_path(self) -> Path:
        return self.root / REPORT

    def report(self) -> dict[str, Any] | None:
        try:
            report = json.loads(self.report_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except ValueError as exc:  # not JSON, not UTF-8
            raise TaskError(
                f"{self.report_path} is damaged ({exc}); {retest_hint(self.root.parent, 'again')}"
            ) from None
        if not isinstance(report, dict):
            raise TaskError(f"{self.report_path} is not a release report; {retest_hint(self.root.parent, 'again')}")
        return report


def retest_hint(directory: str | Path, when: str) -> str:
    """What to run for a bundle's missing or damaged release reports (``when``: first, again): the
    test with the signing key a server that requires signed reports takes."""
    return (
        f"run `fedfleet plan test {directory} --signing-key KEY` {when} (KEY: a key whose KEY.pub line is in the "
        "server's --release-trust file; without --signing-key, only a server started with --allow-untested-plans "
        "takes the report)"
    )


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _write_task(root: Path, built: TaskBuild) -> None:
    """A task's folder appears whole or not at all: written aside, then renamed into place, so that
    a build interrupted half way leaves no plan without its manifest (which the next build would
    refuse to replace as not its own)."""
    staging = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}.", suffix=".partial"))
    try:
        _write(staging / "plan.fedplan", built.plan_bytes)
        _write(staging / "initial.ckpt", built.checkpoint)
        for release, data in built.versions.items():
            _write(staging / "versions" / f"{release}.fedplan", data)
        manifest = json.dumps(built.manifest, indent=1, sort_keys=True) + "\n"
        (staging / MANIFEST).write_text(manifest, encoding="utf-8")
        if root.exists():
            shutil.rmtree(root)
        staging.rename(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@dataclass(frozen=True)
class TaskBuild:
    """One task built in memory, as ``plan build`` writes it: the unversioned plan, one versioned
    plan per claimed release (the bytes a release report's hashes name), the initial model and
    the manifest. ``build_bundle`` writes it to disk; the fleet simulator deploys it as it is."""

    task: Task
    plan: Plan
    plan_bytes: bytes
    versioned: dict[str, Plan]
    versions: dict[str, bytes]
    checkpoint: bytes
    manifest: dict[str, Any]


def build_task(task: Task, *, say: Callable[[str], None] = lambda _m: None) -> TaskBuild:
    """Build one task: its plan, initial model and a versioned plan for each claimed runtime;
    raises VersioningError naming the op and the release when a claimed release cannot run it."""
    plan = task.build_plan(say=say)
    plan_bytes = serialize_plan(plan)
    versioned: dict[str, Plan] = {}
    versions: dict[str, bytes] = {}
    entries = {}
    for release in task.runtimes:
        vplan = versioned_plan(plan, release)
        data = serialize_plan(vplan)
        versioned[release], versions[release] = vplan, data
        entries[release] = {
            "file": f"versions/{release}.fedplan",
            "sha256": plan_sha256(data),
            "opset": vplan.metadata.opset,
            "ir_version": vplan.metadata.ir_version,
        }
        measured = measured_as(release)
        if measured is not None:
            entries[release]["measured_as"] = measured
        as_measured = f" (an earlier patch of {release.rsplit('.', 1)[0]}: versioned as {measured})" if measured else ""
        say(
            f"{task.name}: onnxruntime {release}{as_measured}: opset {vplan.metadata.opset}, "
            f"IR {vplan.metadata.ir_version}, {plan_sha256(data)[:12]}"
        )
    manifest = {
        "task": task.name,
        "plan": {
            "file": "plan.fedplan",
            "sha256": plan_sha256(plan_bytes),
            "opset": plan.metadata.opset,
            "ir_version": plan.metadata.ir_version,
        },
        "checkpoint": "initial.ckpt",
        "versions": entries,
        "runtimes": list(task.runtimes),
        "round_config": task.rounds.to_dict(),
        "kind": plan.kind,
        "evaluates": task.evaluates.name if task.evaluates is not None else None,
    }
    if not task.eligibility.empty:  # absent: none (bundles written before the field existed)
        manifest["eligibility"] = task.eligibility.to_dict()
    return TaskBuild(task, plan, plan_bytes, versioned, versions, encode_checkpoint(task.weights(plan)), manifest)


def build_bundle(
    task_file: str | Path,
    out: str | Path,
    *,
    runtimes: list[str] | None = None,
    say: Callable[[str], None] = lambda _m: None,
) -> list[Path]:
    """Build every task of ``task_file`` into ``out``; raises VersioningError naming the op and
    the release when a claimed release cannot run the plan."""
    out = Path(out)
    tasks = [
        dataclasses.replace(task, runtimes=tuple(runtimes)) if runtimes else task for task in load_tasks(task_file)
    ]
    for task in tasks:  # before anything is written
        check_known_releases(task)
        root = out / task.name
        if root.exists() and not (root / MANIFEST).is_file():  # a build replaces the folder of a task it built
            raise TaskError(f"{root} exists and is not a task `plan build` wrote; give -o a new folder, or a bundle's")
    if out.is_file():
        raise TaskError(f"{out} is a file; give -o a folder for the bundle")
    if (
        (out / TASK_FILE).exists()
        and not (out / SOURCE).is_file()
        and (out / TASK_FILE).resolve() != Path(task_file).resolve()
    ):
        raise TaskError(f"{out / TASK_FILE} is not a copy `plan build` wrote; give -o a new folder, or a bundle's")
    out.mkdir(parents=True, exist_ok=True)
    if Path(task_file).resolve() != (out / TASK_FILE).resolve():  # a stub plan from-onnx wrote is built in place
        shutil.copyfile(task_file, out / TASK_FILE)
    source = {"task_file": str(Path(task_file).resolve())}
    (out / SOURCE).write_text(json.dumps(source, indent=1) + "\n", encoding="utf-8")
    roots = []
    for task in tasks:
        built = build_task(task, say=say)
        root = out / task.name
        _write_task(root, built)
        manifest = built.manifest
        say(
            f"{task.name}: unversioned plan opset {built.plan.metadata.opset}, {manifest['plan']['sha256'][:12]} -> {root}"
        )
        roots.append(root)
    return roots


def bundle_task_file(directory: str | Path) -> Path:
    """The task file of a bundle folder to load: where it was built from while it is still there (a
    task file may read files beside it, such as its model), else the bundle's copy. ``plan test``,
    ``deploy`` and ``simulate --task DIR`` load this one; the plans are checked against the manifest."""
    directory = Path(directory)
    try:
        original = Path(json.loads((directory / SOURCE).read_text(encoding="utf-8"))["task_file"])
    except (OSError, ValueError, KeyError, TypeError):
        return directory / TASK_FILE
    return original if original.is_file() else directory / TASK_FILE


def bundle_holding(path: str | Path) -> Path | None:
    """The bundle folder a file of it is in (its task file, a task's plan, manifest or report), if any."""
    for folder in list(Path(path).parents)[:3]:
        if (folder / TASK_FILE).is_file() and (folder / SOURCE).is_file():
            return folder
    return None


def check_bundle_path(path: str | Path) -> None:
    """Refuse a file where a bundle directory is wanted: one of a bundle's own files by naming the
    bundle, any other by saying how to make one (a newcomer's plan file from ``plan from-onnx -o
    X.fedplan`` has no checkpoint nor task to test); a missing path by the one its name is closest to."""
    if not Path(path).exists():
        raise TaskError(f"{path}: no such folder{did_you_mean_path(path)}; give a bundle folder (plan build makes one)")
    if Path(path).is_file() and (bundle := bundle_holding(path)) is not None:
        raise TaskError(f"{path} is a file of the bundle {bundle}; give the bundle folder {bundle}")
    if Path(path).is_file():
        raise TaskError(
            f"{path} is a file, not a bundle directory; `fedfleet plan from-onnx MODEL.onnx --label y -o DIR` "
            "writes one from a model (`plan build TASK.py -o DIR` from a task file), then `plan test DIR`"
        )


def _is_manifest(manifest: Any) -> bool:
    """Whether ``manifest`` has the fields ``read_bundle`` reads, of the types ``build_bundle`` writes."""

    def names_a_file(entry: Any) -> bool:
        return isinstance(entry, dict) and isinstance(entry.get("file"), str) and isinstance(entry.get("sha256"), str)

    return (
        isinstance(manifest, dict)
        and isinstance(manifest.get("task"), str)
        and names_a_file(manifest.get("plan"))
        and isinstance(manifest.get("checkpoint"), str)
        and isinstance(manifest.get("versions"), dict)
        and all(names_a_file(v) for v in manifest["versions"].values())
        and isinstance(manifest.get("runtimes"), list)
        and all(isinstance(r, str) for r in manifest["runtimes"])
        and isinstance(manifest.get("round_config"), dict)
    )


def _read_manifest(path: Path) -> dict[str, Any]:
    """A task's manifest, refused in one line when it is not what ``plan build`` wrote."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # not JSON, not UTF-8
        raise TaskError(f"{path} is damaged ({exc}); build the bundle again") from None
    if not _is_manifest(manifest):
        raise TaskError(
            f"{path} is not a manifest `plan build` writes (task, plan, checkpoint, versions, runtimes, "
            "round_config); build the bundle again"
        )
    return manifest


def _read_part(root: Path, name: str) -> bytes:
    """A file the manifest names, refused in one line when it is gone."""
    try:
        return (root / name).read_bytes()
    except FileNotFoundError:
        raise TaskError(f"{root}: {name}, which the manifest names, is missing; build the bundle again") from None


def read_bundle(directory: str | Path) -> list[BuiltTask]:
    """The tasks of a bundle, with their plans checked against the manifest's ids."""
    directory = Path(directory)
    check_bundle_path(directory)
    if not (directory / TASK_FILE).is_file():
        if (directory / MANIFEST).is_file() and (directory.parent / TASK_FILE).is_file():
            raise TaskError(
                f"{directory} is one task's folder of the bundle {directory.parent}; give {directory.parent}"
            )
        raise TaskError(
            f"{directory} is not a built task (no {TASK_FILE}); run `fedfleet plan build TASK.py -o {directory}`"
        )
    by_name = {t.name: t for t in load_tasks(bundle_task_file(directory))}
    built = []
    for manifest_path in sorted(directory.glob(f"*/{MANIFEST}")):
        root = manifest_path.parent
        manifest = _read_manifest(manifest_path)
        task = by_name.get(manifest["task"])
        if task is None:
            raise TaskError(
                f"{directory / TASK_FILE} no longer defines task {manifest['task']!r}; build the bundle again"
            )
        task = dataclasses.replace(task, runtimes=tuple(manifest["runtimes"]))
        check_known_releases(task)
        plan = _read_part(root, manifest["plan"]["file"])
        versions = {r: _read_part(root, v["file"]) for r, v in manifest["versions"].items()}
        for name, data, want in [
            ("plan", plan, manifest["plan"]["sha256"]),
            *((r, versions[r], v["sha256"]) for r, v in manifest["versions"].items()),
        ]:
            if plan_sha256(data) != want:
                raise TaskError(f"{root}: the {name} plan does not match its manifest id; build the bundle again")
        built.append(BuiltTask(task, root, plan, versions, _read_part(root, manifest["checkpoint"]), manifest))
    if not built:
        raise TaskError(f"{directory} holds no built task; run `fedfleet plan build`")
    names = {b.task.name for b in built}
    for b in built:
        if b.task.evaluates is not None and b.task.evaluates.name not in names:
            raise TaskError(
                f"{directory}: {b.task.name!r} evaluates {b.task.evaluates.name!r}, which is not built here; "
                "build the bundle again"
            )
    return built


def release_test_bundle(
    directory: str | Path,
    pool: WorkerPool,
    *,
    say: Callable[[str], None] = lambda _m: None,
    signing_key: Ed25519PrivateKey | None = None,
) -> list[BuiltTask]:
    """Run the release tests of every task of a bundle on its exact plans; each report, signed
    with ``signing_key`` when given (a server that checks signatures refuses it otherwise), is
    written next to its plans (``BuiltTask.report()`` reads it)."""
    built_tasks = read_bundle(directory)
    by_name = {b.task.name: b for b in built_tasks}
    for built in built_tasks:
        say(f"{built.task.name}: release tests on {', '.join(built.task.runtimes)}")
        versioned = {r: load_plan(data, runtime_version=r) for r, data in built.versions.items()}
        trained = None
        if built.task.evaluates is not None:  # the models it measures come from its training task's plan
            source = by_name[built.task.evaluates.name]
            trained = (load_plan(source.plan), decode_checkpoint(source.checkpoint))
        report = release_test(
            built.task,
            pool=pool,
            plan=load_plan(built.plan),
            versioned=versioned,
            weights=decode_checkpoint(built.checkpoint),
            progress=say,
            trained=trained,
        )
        write_report(report if signing_key is None else sign_report(report, signing_key), built.report_path)
    return built_tasks


def manifest_eligibility(built: BuiltTask | TaskBuild) -> EligibilityPolicies:
    """The eligibility policies a built task deploys with, refused in one line when edited into
    something the server would refuse."""
    try:
        return EligibilityPolicies.from_dict(built.manifest.get("eligibility", {}))
    except ValidationError as exc:
        where = getattr(built, "root", built.task.name)
        raise TaskError(
            f"{where}: the manifest's eligibility is invalid ({fields_said(exc)}); build the bundle again"
        ) from None


def deploy_bundle(directory: str | Path, admin: AdminClient, population: str) -> dict[str, Any]:
    """Send every task of a bundle with its versioned plans and release report (one task, or a
    group that shares the population's rounds; an evaluation task goes without a checkpoint of
    its own and takes the model of the training task it measures)."""
    bodies = []
    for built in read_bundle(directory):
        report = built.report()
        if report is None:
            raise TaskError(f"{built.root} has no release report; {retest_hint(directory, 'first')}")
        try:
            config = RoundConfig.from_dict(built.manifest["round_config"])
        except ValidationError as exc:
            raise TaskError(
                f"{built.root}: the manifest's round_config is invalid ({fields_said(exc)}); build the bundle again"
            ) from None
        evaluates = built.manifest.get("evaluates")  # an evaluation takes its training task's model
        bodies.append(
            task_body(
                built.task.name,
                built.plan,
                None if evaluates else built.checkpoint,
                config,
                manifest_eligibility(built),
                versioned_plans=built.versions,
                release_report=report,
                evaluates=evaluates,
            )
        )
    send = (
        (lambda: admin.deploy_body(population, bodies[0]))
        if len(bodies) == 1
        else (lambda: admin.deploy_tasks(population, bodies))
    )
    try:
        return send()
    except AdminError as exc:  # the server checks the tasks first: a refused deploy creates no population
        if exc.code != "UNKNOWN_POPULATION":
            raise
    admin.create_population(population)
    return send()
