"""A newcomer's typical mistakes, each refused in one line that says what to do: a misspelt fleet
config key, section or ``--sweep`` key names the one it is closest to and what the table takes; an
option's value out of range is said by the option (``--hours must be above 0``), not by the
validator's words; a key file of another kind where a trust file or an admin key file goes says
what it is and what to give; a population the server does not have names the one it has; a file of
a bundle names the bundle; a task's missing model says where the path is read from; an option
named like a positional argument says it is given without it."""

from __future__ import annotations

from pathlib import Path

import pytest

from emulator.cli import commands as cli
from emulator.toolchain.bundle import SOURCE, TASK_FILE, check_bundle_path
from emulator.toolchain.tasks import TaskError
from server_stub import ServerThread
from tests.support import read_only_folder

ADMIN_KEY = "operator-key-for-the-mistakes-0123456789"
#: Words of the validator and the classes behind the config, which a command line never shows.
API_WORDS = ("FleetConfig", "Input should", "ModelProto", "Traceback", "Section")


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and not any(word in err for word in API_WORDS), err
    return err


@pytest.mark.parametrize(
    ("toml", "said"),
    [
        (
            "[fleet]\nhourz = 3\n",
            "fleet.hourz: [fleet] has no key 'hourz' (did you mean hours?); it takes devices, hours,",
        ),
        (
            "[taks]\ngoal_count = 8\n",
            "taks: not a section of a fleet config (did you mean task?); the sections are fleet,",
        ),
        (
            "[[device_classes]]\nname = 'a'\nshare = 1.0\nspeed = 1.0\nmemory_mb = 4096\nmemroy_mb = 1\n",
            "device_classes.0.memroy_mb: [device_classes] has no key 'memroy_mb' (did you mean memory_mb?)",
        ),
        ("[fleet]\nhours = -3.0\n", "fleet.hours must be above 0 (got -3.0)"),
        ("[fleet]\ndevices = '40'\n", "fleet.devices must be a whole number (got '40')"),
        ("fleet = 3\n", "fleet must be a table ([fleet])"),
    ],
)
def test_a_fleet_config_mistake_names_the_key_it_is_closest_to_and_what_the_table_takes(toml, said, tmp_path, capsys):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(toml, encoding="utf-8")
    assert cli.main(["simulate", str(fleet), "--no-progress"]) == 2
    assert said in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--hours", "-1"], "fedfleet simulate: --hours must be above 0 (got -1.0)\n"),
        (["--devices", "0"], "fedfleet simulate: --devices must be at least 1 (got 0)\n"),
        (["--dp", "central", "--dp-clip", "0"], "fedfleet simulate: --dp-clip must be above 0 (got 0.0)\n"),
        (
            ["--sweep", "goal_cont=8,16"],
            "--sweep task.goal_cont: the config has no such field (did you mean task.goal_count?)",
        ),
        (["--sweep", "fleet.device=8,16"], "(did you mean fleet.devices?)"),
        (["--sweep", "hours=1,2"], "--sweep task.hours: the config has no such field (did you mean fleet.hours?)"),
        (["--sweep", "fleett.devices=8,16"], "the config has no section 'fleett' (did you mean fleet?)"),
    ],
)
def test_a_simulate_option_mistake_is_said_by_the_option_with_the_field_it_is_closest_to(argv, said, capsys):
    assert cli.main(["simulate", "--no-progress", *argv]) == 2
    assert said in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["simulate", "--fleet", "f.toml"], "--fleet (fleet is given without --fleet: fedfleet simulate FLEET ...)"),
        (
            ["plan", "build", "-o", "out", "--task", "t.py"],
            "--task (task file is given without --task: fedfleet plan build TASK_FILE ...)",
        ),
    ],
)
def test_an_option_named_like_a_positional_argument_says_it_is_given_without_it(argv, said, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert said in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["status", "--server", "http://127.0.0.1:1", "--population", "p", "--last", "5"],
            "--last 5 (--last is an option of fedfleet rounds, not of fedfleet status)",
        ),
        (
            ["plan", "build", "t.py", "--signing-key", "k"],
            "(--signing-key is an option of fedfleet plan test, not of fedfleet plan build)",
        ),
        (  # a required option left out: the error is still the option given to the wrong command
            ["deploy", "b", "--server", "http://127.0.0.1:1", "--signing-key", "k"],
            "(--signing-key is an option of fedfleet plan test, not of fedfleet deploy; or did you mean --tls-key?)",
        ),
        (
            ["server", "--population", "digits"],
            "(--population is an option of fedfleet server retire, fedfleet deploy, fedfleet status, fedfleet rounds, "
            "fedfleet stop and fedfleet model, not of fedfleet server)",
        ),
        (
            ["demo", "--hours", "1"],
            "(--hours is an option of fedfleet simulate, not of fedfleet demo; or did you mean --rounds?)",
        ),
    ],
)
def test_an_option_of_another_command_names_the_command_that_takes_it(argv, said, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert said in _one_line(capsys.readouterr().err)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """A tester's signing key and its trust line, and an attestation authority's key and trust anchor,
    as the commands write them."""
    folder = tmp_path_factory.mktemp("keys")
    assert cli.main(["plan", "keygen", "--key", str(folder / "tester.key")]) == 0
    assert cli.main(["authority", "--key", str(folder / "authority.key"), "--trust", str(folder / "trust.json")]) == 0
    return folder


@pytest.mark.parametrize(
    ("option", "file", "said"),
    [
        (
            "--release-trust",
            "tester.key",
            "is the private signing key of `fedfleet plan keygen`, which stays secret; give {keys}/tester.key.pub",
        ),
        (
            "--attestation-trust",
            "authority.key",
            "is the attestation authority's private key (`fedfleet authority --key`), which stays secret; give the trust anchor",
        ),
        (
            "--admin-key-file",
            "tester.key",
            "is the private signing key of `fedfleet plan keygen`, not an admin key file; give a file of operator keys",
        ),
        (
            "--admin-key-file",
            "tester.key.pub",
            "is a release trust file (testers' public keys, `fedfleet plan keygen`'s KEY.pub), not an admin key file",
        ),
        (
            "--release-trust",
            "trust.json",
            "is an attestation trust anchor (`fedfleet authority --trust`), not a release trust file",
        ),
        (
            "--attestation-trust",
            "tester.key.pub",
            "not a trust anchor; give the trust anchor `fedfleet authority --trust FILE` wrote",
        ),
    ],
)
def test_a_key_file_of_another_kind_says_what_it_is_and_what_to_give(option, file, said, keys, tmp_path, capsys):
    argv = ["server", "--port", "0", "--db", str(tmp_path / "s.db"), option, str(keys / file)]
    assert cli.main(argv) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith(f"fedfleet server: {option} {keys / file} is ") and said.format(keys=keys) in err, err
    assert not (tmp_path / "s.db").exists()


def test_deploy_refuses_a_signing_key_as_its_admin_key_file_before_any_request(keys, tmp_path, capsys):
    (tmp_path / TASK_FILE).write_text("", encoding="utf-8")
    argv = ["deploy", str(tmp_path), "--server", "http://127.0.0.1:9", "--population", "p"]
    assert cli.main([*argv, "--admin-key-file", str(keys / "tester.key")]) == 2
    assert "is the private signing key of `fedfleet plan keygen`, not an admin key file" in _one_line(
        capsys.readouterr().err
    )


@pytest.mark.parametrize("command", ["status", "rounds"])
def test_a_population_the_server_does_not_have_names_the_one_it_has(command, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", ADMIN_KEY)
    with ServerThread(tmp_path / "server.db", admin_key=ADMIN_KEY) as server, server.admin() as admin:
        admin.create_population("digits")
        admin.create_population("glyphs")
        assert cli.main([command, "--server", server.url, "--population", "digit"]) == 1
    err = _one_line(capsys.readouterr().err)
    assert "'digit' does not exist" in err and err.endswith("(did you mean digits?); it has digits, glyphs\n"), err


def _bundle(folder):
    """A bundle's layout as ``plan build`` writes it: its task file and source beside a task's folder."""
    (folder / "digits_mlp").mkdir(parents=True)
    for name in (TASK_FILE, SOURCE, "digits_mlp/manifest.json", "digits_mlp/initial.ckpt", "digits_mlp/plan.fedplan"):
        (folder / name).write_text("{}", encoding="utf-8")
    return folder


@pytest.mark.parametrize("name", [SOURCE, "digits_mlp/manifest.json", "digits_mlp/initial.ckpt"])
def test_a_file_of_a_bundle_names_the_bundle_it_is_in(name, tmp_path, capsys):
    bundle = _bundle(tmp_path / "bundle")
    with pytest.raises(TaskError, match=f"is a file of the bundle {bundle}; give the bundle folder {bundle}$"):
        check_bundle_path(bundle / name)
    for argv in (["plan", "test", str(bundle / name)], ["simulate", "--no-progress", "--task", str(bundle / name)]):
        assert cli.main(argv) == 2
        assert f"is a file of the bundle {bundle}; give {bundle} (plan build: its task file" in _one_line(
            capsys.readouterr().err
        )


def test_a_plan_file_alone_still_says_how_to_make_a_bundle(tmp_path):
    (tmp_path / "model.fedplan").write_bytes(b"plan")
    with pytest.raises(TaskError, match="is a file, not a bundle directory; `fedfleet plan from-onnx"):
        check_bundle_path(tmp_path / "model.fedplan")


def test_a_tasks_missing_model_says_where_its_path_is_read_from(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "task.py").write_text(
        "from emulator.toolchain.tasks import ProxyData, Task\n"
        "import numpy as np\n"
        "data = {'x': np.zeros((8, 3), np.float32), 'y': np.zeros(8, np.int64)}\n"
        "task = Task(name='t', model='missing.onnx', proxy=ProxyData.split(data, devices=2))\n",
        encoding="utf-8",
    )
    assert cli.main(["plan", "build", "task.py", "-o", "out"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert (
        f"its model 'missing.onnx' is no file (a relative path is read from the working directory, {tmp_path})" in err
    )
    assert "Path(__file__).parent / 'model.onnx'" in err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["plan", "build", "digits_taks.py", "-o", "out"],
            "task file digits_taks.py does not exist (did you mean digits_task.py?)",
        ),
        (
            ["plan", "test", "digits_taks.py"],
            "digits_taks.py: no such file or folder (did you mean digits_task.py?); give a task file or",
        ),
        (["simulate", "--no-progress", "--task", "digits_taks.py"], "no such file (did you mean digits_task.py?)"),
        (["simulate", "--no-progress", "smal.toml"], "no fleet config at smal.toml (did you mean small.toml?)"),
        (
            ["deploy", "bundel", "--server", "http://127.0.0.1:9", "--population", "p"],
            "bundel: no such folder (did you mean bundle?); give a bundle folder",
        ),
    ],
)
def test_a_misspelt_path_names_the_file_beside_it_that_it_is_closest_to(argv, said, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", ADMIN_KEY)
    (tmp_path / "digits_task.py").write_text("", encoding="utf-8")
    (tmp_path / "small.toml").write_text("", encoding="utf-8")
    _bundle(tmp_path / "bundle")
    assert cli.main(argv) == 2
    err = _one_line(capsys.readouterr().err)
    assert said in err
    if argv[1:2] == ["--no-progress"] and argv[2].endswith(".toml"):  # and from where a relative path was looked up
        assert f"(from {tmp_path}); pass an existing TOML file" in err


def test_a_misspelt_choice_names_the_choice_it_is_closest_to(capsys):
    with pytest.raises(SystemExit):
        cli.main(["simulate", "--dp", "centrl"])
    assert "invalid choice: 'centrl' (did you mean central?); choose from central, distributed" in _one_line(
        capsys.readouterr().err
    )


def test_a_misspelt_key_file_names_the_file_beside_it(keys, tmp_path, capsys):
    assert cli.main(["server", "--db", str(tmp_path / "s.db"), "--attestation-trust", str(keys / "trst.json")]) == 2
    said = f"cannot read the trust anchor '{keys / 'trst.json'}': no such file (did you mean {keys / 'trust.json'}?)"
    assert said in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--devices", "0"], "fedfleet demo: --devices must be at least 1 (got 0)\n"),
        (["--goal", "0"], "fedfleet demo: --goal must be between 1 and the number of devices (100): "),
        (["--time-limit", "0"], "fedfleet demo: --time-limit must be positive seconds (got 0.0)\n"),
        (["--secagg-group", "1"], "fedfleet demo: --secagg-group must be at least 2: "),
    ],
)
def test_a_demo_option_out_of_range_is_said_by_the_option_as_typed(argv, said, capsys):
    assert cli.main(["demo", *argv]) == 2
    assert _one_line(capsys.readouterr().err).startswith(said)


def test_the_demo_options_a_refusal_names_are_the_demo_parser_s():
    import argparse

    sub = argparse.ArgumentParser().add_subparsers()
    cli._demo_parser(sub)
    parsed = {a.dest: a.option_strings[0] for a in sub.choices["demo"]._actions if a.dest != "help"}
    assert {k: v for k, v in parsed.items() if k != "secure"} == cli.DEMO_OPTIONS


def test_an_output_folder_that_refuses_files_is_said_with_what_to_give(tmp_path, capsys):
    """``plan build -o`` a folder on a read-only file system (here immutable: root writes past modes)
    said the system's words alone, "[Errno 30] Read-only file system: 'ro/task.py'"."""
    with read_only_folder(tmp_path / "locked") as locked:
        task = Path(__file__).resolve().parents[3] / "examples" / "tasks" / "digits_task.py"
        assert cli.main(["plan", "build", str(task), "-o", str(locked)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"fedfleet plan build: cannot use {locked}")
    assert "; give files that can be read and an output folder that can be written" in err and "[Errno" not in err
