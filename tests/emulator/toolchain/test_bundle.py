"""A damaged bundle (what ``plan build`` and ``plan test`` wrote, edited or cut short since) is
refused in one line that names the file and says to build or test it again: ``read_bundle`` for
``plan test`` and ``deploy``, and ``fedfleet deploy`` before anything reaches the server. A build
replaces only what a build wrote."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from emulator.cli.commands import main
from emulator.releases.workers import WorkerPool
from emulator.toolchain.bundle import build_bundle, read_bundle, release_test_bundle
from emulator.toolchain.tasks import TaskError
from emulator.toolchain.versioning import plan_sha256, versioned_plan
from server_stub import ServerThread
from tests.support import admin_key_file

TASK_FILE = Path(__file__).resolve().parents[3] / "examples" / "tasks" / "digits_task.py"
ADMIN_KEY = "operator-key-for-the-bundle-test-0123456789"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "digits"
    build_bundle(TASK_FILE, out, runtimes=["1.31.1"])
    return out


@pytest.fixture
def bundle(built, tmp_path) -> Path:
    """A copy of the built bundle to damage."""
    return Path(shutil.copytree(built, tmp_path / "digits"))


def _edit_manifest(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def damage(task: Path) -> None:
        path = task / "manifest.json"
        manifest = json.loads(path.read_text())
        edit(manifest)
        path.write_text(json.dumps(manifest))

    return damage


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda t: (t / "manifest.json").write_text("{"), "manifest.json is damaged (Expecting property name"),
        (lambda t: (t / "manifest.json").write_bytes(b"\xff\xfe"), "manifest.json is damaged ("),
        (lambda t: (t / "manifest.json").write_text("[]"), "manifest.json is not a manifest `plan build` writes"),
        (_edit_manifest(lambda m: m.pop("runtimes")), "is not a manifest `plan build` writes"),
        (_edit_manifest(lambda m: m["versions"].update({"1.31.1": "x.fedplan"})), "is not a manifest"),
        (_edit_manifest(lambda m: m.update(task=7)), "is not a manifest"),
        (
            lambda t: (t / "versions" / "1.31.1.fedplan").unlink(),
            "versions/1.31.1.fedplan, which the manifest names, is missing",
        ),
        (lambda t: (t / "initial.ckpt").unlink(), "initial.ckpt, which the manifest names, is missing"),
    ],
)
def test_a_damaged_manifest_or_a_missing_part_is_refused_saying_to_build_again(bundle, damage, says):
    damage(bundle / "digits_mlp")
    with pytest.raises(TaskError, match="build the bundle again") as info:
        read_bundle(bundle)
    assert says in str(info.value)


def test_a_tasks_folder_inside_a_bundle_is_refused_naming_the_bundle(built, capsys):
    """``plan test`` and ``deploy`` of ``DIR/<task>`` (the folder with the plans) name ``DIR``,
    not a build into the task's folder."""
    with pytest.raises(TaskError) as info:
        read_bundle(built / "digits_mlp")
    assert str(info.value) == f"{built / 'digits_mlp'} is one task's folder of the bundle {built}; give {built}"
    assert main(["plan", "test", str(built / "digits_mlp")]) == 2
    assert capsys.readouterr().err.endswith(f"give {built}\n")


def test_deploy_refuses_a_damaged_report_or_round_config_in_one_line_before_the_server(bundle, tmp_path, capsys):
    keys = admin_key_file(tmp_path / "admin.keys", ADMIN_KEY)
    report = bundle / "digits_mlp" / "release_report.json"
    with ServerThread(tmp_path / "server.db", admin_key=ADMIN_KEY) as server:
        deploy = [
            "deploy",
            str(bundle),
            "--server",
            server.url,
            "--population",
            "digits",
            "--admin-key-file",
            str(keys),
        ]
        for text, says in [
            ("{", "release_report.json is damaged (Expecting property name"),
            ("[1]", "release_report.json is not a release report"),
        ]:
            report.write_text(text)
            assert main(deploy) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and says in err, err
            # the command to run, with the key a server that requires signed reports takes
            assert f"run `fedfleet plan test {bundle} --signing-key KEY` again (KEY: a key whose KEY.pub" in err, err
        report.write_text("{}")
        _edit_manifest(lambda m: m["round_config"].update(goal_count=-5))(bundle / "digits_mlp")
        assert main(deploy) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert "round_config is invalid (goal_count: Input should be greater than or equal to 1)" in err
        with server.admin() as admin:
            assert admin.populations() == []  # nothing reached the server


def test_a_build_into_a_folder_it_did_not_write_leaves_that_folders_files_alone(tmp_path):
    """A build replaces OUT/<task> and OUT/task.py: in a project's folder those may be the user's."""
    project = tmp_path / "project"
    (project / "digits_mlp").mkdir(parents=True)
    (project / "digits_mlp" / "notes.txt").write_text("mine")
    with pytest.raises(TaskError, match="digits_mlp exists and is not a task `plan build` wrote"):
        build_bundle(TASK_FILE, project)
    (project / "digits_mlp" / "notes.txt").unlink()
    (project / "digits_mlp").rmdir()
    (project / "task.py").write_text("mine")
    with pytest.raises(TaskError, match="task.py is not a copy `plan build` wrote"):
        build_bundle(TASK_FILE, project)
    assert (project / "task.py").read_text() == "mine" and sorted(p.name for p in project.iterdir()) == ["task.py"]
    with pytest.raises(TaskError, match="is a file; give -o a folder"):
        build_bundle(TASK_FILE, project / "task.py")


def test_a_bundle_builds_again_over_itself(built, bundle):
    assert [p.name for p in build_bundle(TASK_FILE, bundle, runtimes=["1.31.1"])] == ["digits_mlp"]
    assert (bundle / "digits_mlp" / "manifest.json").read_bytes() == (
        built / "digits_mlp" / "manifest.json"
    ).read_bytes()


@pytest.mark.parametrize("part", ["initial.ckpt", "1.31.1.fedplan"])
def test_a_build_interrupted_while_writing_a_task_keeps_the_task_it_had_and_builds_again(
    built, bundle, part, monkeypatch
):
    """Ctrl-C half way through a task's folder leaves the folder of the last build, never a plan
    without its manifest (which the next build would refuse to replace as not its own)."""
    from emulator.toolchain import bundle as bundle_module

    write = bundle_module._write

    def interrupted(path: Path, data: bytes) -> None:
        if path.name == part:
            raise KeyboardInterrupt
        write(path, data)

    monkeypatch.setattr(bundle_module, "_write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_bundle(TASK_FILE, bundle, runtimes=["1.31.1"])
    assert sorted(p.name for p in bundle.iterdir()) == ["digits_mlp", "source.json", "task.py"]  # no staging left
    assert read_bundle(bundle)  # the last build's task, whole
    monkeypatch.setattr(bundle_module, "_write", write)
    build_bundle(TASK_FILE, bundle, runtimes=["1.31.1"])
    assert (bundle / "digits_mlp" / "manifest.json").read_bytes() == (
        built / "digits_mlp" / "manifest.json"
    ).read_bytes()


def test_ctrl_c_during_a_command_is_one_line_and_exit_code_130(tmp_path):
    """A real SIGINT while `plan build` loads the task file. Python's own handler is put back
    first: a test run started in the background inherits SIGINT ignored, as a terminal's never is."""
    task = tmp_path / "task.py"
    task.write_text(
        "import os, signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\nos.kill(os.getpid(), signal.SIGINT)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "emulator.cli", "plan", "build", str(task), "-o", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip() == "fedfleet plan: interrupted" and done.stdout == ""
    assert not (tmp_path / "out").exists()


def test_an_earlier_patch_of_a_measured_minor_is_built_as_that_minors_plan_and_says_so(tmp_path, capsys):
    """Devices on onnxruntime 1.24.1 are served the plan of minor 1.24: a task may claim 1.24.1, whose
    versioned plan is the one built for 1.24.4 (the minor's measured release), byte for byte."""
    out = tmp_path / "digits"
    assert main(["plan", "build", str(TASK_FILE), "-o", str(out), "--runtimes", "1.24.1", "1.31.1"]) == 0
    said = capsys.readouterr().out
    assert "onnxruntime 1.24.1 (an earlier patch of 1.24: versioned as 1.24.4): opset 21" in said
    (built,) = read_bundle(out)  # what `plan test` and `deploy` read
    assert built.task.runtimes == ("1.24.1", "1.31.1")
    assert built.manifest["versions"]["1.24.1"]["measured_as"] == "1.24.4"
    assert "measured_as" not in built.manifest["versions"]["1.31.1"]
    plan = built.task.build_plan()
    assert plan_sha256(built.versions["1.24.1"]) == plan_sha256(versioned_plan(plan, "1.24.4"))


@pytest.mark.parametrize(
    ("release", "says"),
    [("1.33.0", "minor 1.33 was not measured"), ("1.24.5", "newer than 1.24.4, the patch of 1.24 measured")],
)
def test_a_minor_never_measured_or_a_newer_patch_is_refused_in_one_line_naming_the_known_releases(
    tmp_path, capsys, release, says
):
    assert main(["plan", "build", str(TASK_FILE), "-o", str(tmp_path / "b"), "--runtimes", release]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"claims {release}" in err and says in err
    assert "1.15.1, 1.16.3" in err and "1.32.0" in err and not (tmp_path / "b").exists()


def test_a_tasks_eligibility_policies_reach_the_server_its_deploy_and_its_evaluation(built, tmp_path, capsys):
    """A task file's ``Task.eligibility`` (how many examples a device needs, how often it may join)
    is built into the bundle and sent by ``fedfleet deploy``: the server publishes it to devices.
    A mapping is taken as its fields; a field the server would refuse is a TaskError naming it."""
    import dataclasses
    import runpy

    from device_runtime import EligibilityPolicies
    from emulator.toolchain.tasks import Task, evaluation_of

    (tmp_path / "task.py").write_text(
        "import dataclasses, runpy\n"
        "from device_runtime import EligibilityPolicies\n"
        f"base = runpy.run_path({str(TASK_FILE)!r})['task']\n"
        "task = dataclasses.replace(base, eligibility=EligibilityPolicies(min_examples=20, min_separation_rounds=3))\n",
        encoding="utf-8",
    )
    build_bundle(tmp_path / "task.py", tmp_path / "bundle", runtimes=["1.31.1"])
    manifest = json.loads((tmp_path / "bundle" / "digits_mlp" / "manifest.json").read_text())
    assert manifest["eligibility"]["min_examples"] == 20 and manifest["eligibility"]["min_separation_rounds"] == 3
    with WorkerPool() as pool:
        release_test_bundle(tmp_path / "bundle", pool)
    keys = admin_key_file(tmp_path / "admin.keys", ADMIN_KEY)
    with ServerThread(tmp_path / "server.db", admin_key=ADMIN_KEY) as server:
        deploy = ["deploy", str(tmp_path / "bundle"), "--server", server.url, "--population", "digits"]
        assert main([*deploy, "--admin-key-file", str(keys)]) == 0, capsys.readouterr().err
        # the status command deploy prints next runs as pasted: with the key file deploy was given
        line = capsys.readouterr().out.splitlines()[-1]
        status = shlex.split(line.removeprefix("next: fedfleet ").removesuffix(" (its tasks and open round)"))
        assert status[:1] == ["status"] and status[status.index("--admin-key-file") + 1] == str(keys), line
        assert main(status) == 0, capsys.readouterr().err
        assert "digits_mlp: active" in capsys.readouterr().out
        import httpx

        published = httpx.get(f"{server.url}/v1/populations/digits/eligibility").json()
        _edit_manifest(lambda m: m["eligibility"].update(min_examples="20"))(tmp_path / "bundle" / "digits_mlp")
        assert main([*deploy, "--admin-key-file", str(keys)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "the manifest's eligibility is invalid (min_examples: Input should be" in err
    assert published["policies"] == EligibilityPolicies(min_examples=20, min_separation_rounds=3).to_dict()

    base = runpy.run_path(str(TASK_FILE))["task"]
    task = dataclasses.replace(base, eligibility={"sampling_period_s": 86400.0})
    assert task.eligibility == EligibilityPolicies(sampling_period_s=86400.0)
    assert evaluation_of(task).eligibility == task.eligibility  # unless told otherwise
    assert evaluation_of(task, eligibility=EligibilityPolicies()).eligibility.empty
    with pytest.raises(
        TaskError,
        match=r"task 'digits_mlp': eligibility is invalid \(min_examples: Input should be greater than or equal to 0\); give EligibilityPolicies\(",
    ):
        dataclasses.replace(base, eligibility={"min_examples": -1})
    assert isinstance(base, Task) and base.eligibility.empty
    assert "eligibility" not in json.loads((built / "digits_mlp" / "manifest.json").read_text())  # none: as before
