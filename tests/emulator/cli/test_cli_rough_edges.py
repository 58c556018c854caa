"""What a newcomer meets first on the command line: a server that does not answer or a URL without
http:// is one line naming what to check (for every command that talks to a server), an unknown
onnxruntime release is refused when the plan is built, a deploy that waits behind another task
says so and the status shows it queued, ``--version`` answers, every ``--help`` shows its defaults
in plain text, and ``./dev`` says what it installs before the long quiet install."""

from __future__ import annotations

import argparse
import http.server
import logging
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime import encode_checkpoint, initial_weights
from emulator.cli import commands as cli
from emulator.cli.plan import deployed_line
from emulator.fleet.config import FleetConfig
from emulator.toolchain.bundle import REPORT
from server_stub import RoundConfig, ServerThread, ServerUnreachable
from server_stub.admin_client import AdminClient, check_server_url
from server_stub.cli import parsers, shows_default
from server_stub.schemas import NAME_RULE
from server_stub.serve import free_port
from tests.support import checkout_with_stand_in_python, digits_plan

ROOT = Path(__file__).resolve().parents[3]
TASK_FILE = ROOT / "examples" / "tasks" / "digits_task.py"
ADMIN_KEY = "operator-key-for-the-rough-edges-0123456789"


def _server_commands(directory: Path) -> list[list[str]]:
    """Every command that talks to a server, without its --server."""
    return [
        ["deploy", str(directory), "--population", "p"],
        ["status", "--population", "p"],
        ["rounds", "--population", "p"],
        ["stop", "--population", "p", "--task", "t"],
        ["model", "--population", "p", "--task", "t", "-o", str(directory.parent / "t.ckpt")],
    ]


@pytest.fixture
def bundle(tmp_path, monkeypatch) -> Path:
    """A built bundle with a release report in place, so that deploy gets as far as the server."""
    out = tmp_path / "bundle"
    assert cli.main(["plan", "build", str(TASK_FILE), "-o", str(out), "--runtimes", "1.31.1"]) == 0
    for task_dir in (p for p in out.iterdir() if (p / "manifest.json").is_file()):
        (task_dir / REPORT).write_text("{}", encoding="utf-8")
    monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", ADMIN_KEY)
    return out


@pytest.mark.parametrize("url", ["http://127.0.0.1:{port}", "127.0.0.1:{port}", "localhost:{port}/"])
def test_every_server_command_says_in_one_line_that_the_server_does_not_answer_or_the_url_lacks_a_scheme(
    bundle, capsys, url
):
    port = free_port()  # nothing listens there
    for command in _server_commands(bundle):
        assert cli.main([*command, "--server", url.format(port=port)]) == 2, command
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith(f"fedfleet {command[0]}: ")
        if url.startswith("http://"):
            assert "no answer from the server at http://127.0.0.1" in err
        else:
            assert "needs http:// or https://" in err and f"http://{url.format(port=port)}" in err


class _OtherServer(http.server.BaseHTTPRequestHandler):
    """A server that answers every request 200 with JSON no fedfleet server sends (another service
    on the port, or a server of another API version)."""

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"api_version": 99}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


def test_every_server_command_says_an_answer_of_another_server_is_no_refusal(bundle, capsys):
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OtherServer) as other:
        threading.Thread(target=other.serve_forever, daemon=True).start()
        try:
            for command in _server_commands(bundle):
                code = cli.main([*command, "--server", f"http://127.0.0.1:{other.server_address[1]}"])
                err = capsys.readouterr().err.strip()
                assert code == 2 and len(err.splitlines()) == 1, (command, err)
                assert "the server refused" not in err and "is not a" in err, err
                assert "fedfleet server of this version" in err
        finally:
            other.shutdown()


class _ErrorPages(http.server.BaseHTTPRequestHandler):
    """Another service on the port that answers with its HTML error pages (a 404, a 501 to POST)."""

    def do_POST(self) -> None:
        self.send_error(501, "Unsupported method ('POST')")

    def do_GET(self) -> None:
        self.send_error(404, "File not found")

    def log_message(self, *args: object) -> None:
        pass


def test_every_server_command_says_an_error_page_of_another_server_is_no_refusal_in_one_line(bundle, capsys):
    """The page was printed whole, a dozen lines of HTML after "the server refused:", exit status 1."""
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ErrorPages) as other:
        threading.Thread(target=other.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{other.server_address[1]}"
        try:
            for command in _server_commands(bundle):
                code = cli.main([*command, "--server", url])
                err = capsys.readouterr().err.strip()
                assert code == 2 and len(err.splitlines()) == 1, (command, err)
                assert err.startswith(f"fedfleet {command[0]}: {url} answered ") and "<" not in err, err
                assert "with no fedfleet error in it; is --server a fedfleet server of this version" in err
        finally:
            other.shutdown()


def test_every_server_command_given_https_for_a_plain_http_server_says_to_give_http(bundle, capsys):
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OtherServer) as plain:
        threading.Thread(target=plain.serve_forever, daemon=True).start()
        try:
            for command in _server_commands(bundle):
                code = cli.main([*command, "--server", f"https://127.0.0.1:{plain.server_address[1]}"])
                err = capsys.readouterr().err.strip()
                assert code == 2 and len(err.splitlines()) == 1, (command, err)
                assert f"fedfleet server speaks plain HTTP: give http://127.0.0.1:{plain.server_address[1]}" in err
        finally:
            plain.shutdown()


def test_a_server_url_with_the_apis_own_path_says_to_give_it_without(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", ADMIN_KEY)
    with ServerThread(tmp_path / "s.db", admin_key=ADMIN_KEY) as server:
        code = cli.main(["status", "--server", f"{server.url}/v1", "--population", "p"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert f"(NOT_FOUND); {server.url}/v1 has no such route: give the server's URL without /v1 (behind a proxy" in err
    assert "have the proxy strip /v1 before it passes a request on)" in err


@pytest.mark.parametrize("population", ["a/b", "..", "my app", ""])
def test_every_server_command_refuses_a_population_no_server_takes_in_one_line_before_any_request(
    bundle, capsys, population
):
    port = free_port()  # nothing listens there: a request would say so instead
    for command in _server_commands(bundle):
        command[command.index("--population") + 1] = population
        assert cli.main([*command, "--server", f"http://127.0.0.1:{port}"]) == 2, command
        err = capsys.readouterr().err
        assert err == f"fedfleet {command[0]}: --population {population!r} refused: {NAME_RULE}\n"


@pytest.mark.parametrize("url", ["ftp://host", "http://", "", "127.0.0.1", "host:80"])
def test_a_server_url_without_http_or_a_host_is_refused_before_any_request(url):
    with pytest.raises(ServerUnreachable):
        AdminClient(url, admin_key=ADMIN_KEY)
    assert check_server_url("https://fl.example:8443/") == "https://fl.example:8443"


def test_an_unknown_release_is_refused_when_the_plan_is_built_and_nothing_is_written(tmp_path, capsys):
    out = tmp_path / "bundle"
    assert cli.main(["plan", "build", str(TASK_FILE), "-o", str(out), "--runtimes", "9.9.9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedfleet plan build: ") and len(err.strip().splitlines()) == 1
    assert "9.9.9" in err and "1.31.1" in err
    assert not list(out.glob("*/manifest.json"))


def test_a_deploy_behind_a_task_that_never_ends_is_said_queued_and_the_status_shows_it(tmp_path, capsys, monkeypatch):
    plan = digits_plan()
    checkpoint = encode_checkpoint(initial_weights(plan, seed=0))
    with ServerThread(tmp_path / "server.db", admin_key=ADMIN_KEY) as server, server.admin() as admin:
        admin.create_population("p")
        first = admin.deploy_task("p", "forever", plan, checkpoint, RoundConfig())  # no max_rounds: it never ends
        second = admin.deploy_task("p", "next", plan, checkpoint, RoundConfig())
        assert first["status"] == "active" and "queued_behind" not in first
        assert second["status"] == "queued" and second["queued_behind"] == ["forever"]
        assert "queued behind forever" in deployed_line(second) and "active" in deployed_line(first)
        assert "or is stopped (fedfleet stop --task)" in deployed_line(
            second
        )  # how it starts behind a task that never ends
        status = admin.status("p")
        assert {t["name"]: t["status"] for t in status["tasks"]} == {"forever": "active", "next": "queued"}
        monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", ADMIN_KEY)
        assert cli.main(["status", "--server", server.url, "--population", "p"]) == 0
    printed = capsys.readouterr().out
    assert "next: queued behind forever" in printed and "forever: active" in printed


def test_stop_stops_a_task_that_never_ends_and_the_queued_deploy_runs(tmp_path, capsys, monkeypatch):
    plan = digits_plan()
    checkpoint = encode_checkpoint(initial_weights(plan, seed=0))
    monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", ADMIN_KEY)
    with ServerThread(tmp_path / "server.db", admin_key=ADMIN_KEY) as server, server.admin() as admin:
        admin.create_population("p")
        admin.deploy_task("p", "forever", plan, checkpoint, RoundConfig())  # no max_rounds: it never ends
        admin.deploy_task("p", "next", plan, checkpoint, RoundConfig())
        stop = ["stop", "--server", server.url, "--population", "p", "--task", "forever"]
        assert cli.main(stop) == 0
        said = capsys.readouterr().out
        assert "stopped task forever of population p: its round 1 abandoned; 0 committed round(s) on record" in said
        assert "running now: next" in said
        assert cli.main(["status", "--server", server.url, "--population", "p"]) == 0
        printed = capsys.readouterr().out
        assert "forever: stopped" in printed and "next: active" in printed and "open round: next round 1" in printed
        model_line = next(line for line in said.splitlines() if line.startswith("its final model: "))
        assert model_line == (
            f"its final model: fedfleet model --server {server.url} --population p --task forever -o forever.ckpt"
        )
        monkeypatch.chdir(tmp_path)  # the command as printed runs: forever committed no round, which it says
        assert cli.main(model_line.removeprefix("its final model: fedfleet ").split()) == 2
        assert capsys.readouterr().err == (
            "fedfleet model: task forever of population p has no committed round yet: its model is still the initial "
            "one (its bundle's initial.ckpt)\n"
        )
        for argv, code, err in (
            (
                stop,
                1,
                "fedfleet stop: the server refused: task 'forever' of population 'p' is stopped already (TASK_STOPPED)",
            ),
            ([*stop[:-1], "nxet"], 1, "has no task 'nxet' (did you mean next?)"),
            ([*stop[:4], "q", *stop[5:]], 1, "population 'q' does not exist"),
            ([*stop[:-1], "../x"], 2, "fedfleet stop: --task '../x' refused: "),
        ):
            assert cli.main(argv) == code, argv
            captured = capsys.readouterr().err.strip()
            assert len(captured.splitlines()) == 1 and err in captured, captured


def test_the_commands_stop_prints_run_as_pasted_with_a_key_file_whose_path_has_a_space(tmp_path, capsys):
    """The printed `fedfleet model ... --admin-key-file PATH` split a path with a space in two."""
    plan = digits_plan()
    keys = tmp_path / "my keys" / "admin.key"
    keys.parent.mkdir()
    keys.write_text(ADMIN_KEY + "\n")
    with ServerThread(tmp_path / "server.db", admin_key=ADMIN_KEY) as server, server.admin() as admin:
        admin.create_population("p")
        admin.deploy_task("p", "t", plan, encode_checkpoint(initial_weights(plan, seed=0)), RoundConfig())
        argv = ["stop", "--server", server.url, "--population", "p", "--task", "t", "--admin-key-file", str(keys)]
        assert cli.main(argv) == 0
        said = capsys.readouterr().out
        for prefix in ("its final model: fedfleet ", "its rounds: fedfleet "):
            line = next(line for line in said.splitlines() if line.startswith(prefix))
            args = shlex.split(line.removeprefix(prefix))
            assert args[args.index("--admin-key-file") + 1] == str(keys), line
        assert cli.main(args) == 0  # the rounds command, pasted
        assert "t" in capsys.readouterr().out


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"fedfleet {cli.version()}"


def _parser() -> argparse.ArgumentParser:
    """The whole ``fedfleet`` parser tree, as main builds it."""
    built: list[argparse.ArgumentParser] = []

    def stop(self, *args, **kwargs):
        built.append(self)
        raise SystemExit(0)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = stop  # type: ignore[method-assign]
    try:
        with pytest.raises(SystemExit):
            cli.main([])
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    return built[0]


def test_every_help_shows_each_default_in_plain_text():
    tree = parsers(_parser())
    assert len(tree) >= 14  # fedfleet, its commands and plan's subcommands
    for parser in tree:
        text = parser.format_help()
        assert "`" not in text, f"{parser.prog} --help prints markup"
        formatter = parser._get_formatter()
        for action in parser._actions:
            if shows_default(action):
                line = formatter._expand_help(action) if action.help is not None else ""
                assert str(action.default) in line or "default" in line, (parser.prog, action.option_strings, line)


@settings(deadline=None)
@given(
    value=st.floats(max_value=-1e-300, allow_infinity=True, allow_nan=False),
    style=st.sampled_from(["{:e}", "{:E}", "{!r}", "{:g}", "{:.3e}"]),
)
def test_a_negative_number_in_any_notation_is_an_options_value_not_an_option(value, style):
    """``--delta -1e-5`` was 'expected one argument': argparse (before 3.14) takes '-1e-5' and
    '-inf' for options. Here they reach the option, whose own check then says what is allowed."""
    text = style.format(value)
    parser = _parser()
    simulate = parser.parse_args(["simulate", "--delta", text, "--no-progress", "--dp-clip", text])
    assert simulate.delta == simulate.dp_clip == float(text) and simulate.no_progress
    assert parser.parse_args(["server", "--rate-burst", text]).rate_burst == float(text)


def test_a_negative_delta_is_one_line_naming_the_field(tmp_path, capsys):
    assert cli.main(["simulate", "--dp", "central", "--delta", "-1e-5", "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == "fedfleet simulate: --delta must be above 0 (got -1e-05)\n"


def test_dev_says_what_it_installs_before_the_first_install(tmp_path):
    """``./dev`` in a copy of the checkout whose Python is a stand-in that logs: the message comes
    before pip runs, on stderr; the second use installs nothing and says nothing."""
    work, env = checkout_with_stand_in_python(tmp_path)
    first = subprocess.run(
        ["./dev", "shell", "-c", "pass"], cwd=work, env=env, capture_output=True, text=True, timeout=60
    )
    assert first.returncode == 0, first.stderr
    lines = first.stderr.splitlines()
    said = next(i for i, line in enumerate(lines) if line.startswith("./dev: installing"))
    pip = next(i for i, line in enumerate(lines) if "-m pip install" in line)
    assert said < pip and first.stdout == ""
    second = subprocess.run(
        ["./dev", "shell", "-c", "pass"], cwd=work, env=env, capture_output=True, text=True, timeout=60
    )
    assert "installing" not in second.stderr and "pip" not in second.stderr


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["simulate", "--hourz", "1"], "fedfleet simulate: unrecognized arguments: --hourz (did you mean --hours?)"),
        (
            ["plan", "build", "t.py", "-o", "b", "--runtime-s"],
            "fedfleet plan build: unrecognized arguments: --runtime-s",
        ),
        (["plan", "build", "t.py"], "fedfleet plan build: the following arguments are required: -o/--out"),
        (["simulate", "--hours", "abc"], "fedfleet simulate: argument --hours: invalid float value: 'abc'"),
        (["server", "--port", "99999"], "fedfleet server: argument --port: 99999 is not a port"),
        # a misspelled required option is named as unknown, not as the one missing
        (
            ["plan", "from-onnx", "m.onnx", "--lable", "y", "-o", "d"],
            "fedfleet plan from-onnx: unrecognized arguments: --lable (did you mean --label?)",
        ),
        # a group's mistakes, where argparse named its internal plan_command and command
        (
            ["plan", "--lable", "y"],
            "fedfleet plan: --lable comes after a command: fedfleet plan keygen|from-onnx|from-torch ... --label "
            "(did you mean --label?)",
        ),
        (["--devices", "5"], "fedfleet: --devices comes after a command: fedfleet demo|simulate ... --devices;"),
        (["plan", "--zzz"], "fedfleet plan: --zzz is an option of neither fedfleet plan nor its commands"),
        (["plan"], "fedfleet plan: name a command: fedfleet plan build|test|keygen|from-onnx|from-torch ...;"),
        ([], "fedfleet: name a command: fedfleet demo|server|"),
        (["plan", "bild"], "fedfleet plan: bild is not a command (did you mean build?): fedfleet plan build|test|"),
        (["simualte"], "fedfleet: simualte is not a command (did you mean simulate?): fedfleet demo|"),
    ],
)
def test_a_usage_mistake_is_one_line_naming_the_command_and_its_help(argv, line, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    command = line.split(":")[0]
    assert exit_.value.code == 2 and err.startswith(line) and err.endswith(f"; see {command} --help\n"), err
    assert (
        err.count("\n") == 1 and "usage:" not in err and "plan_command" not in err and "argument command" not in err
    ), err


@pytest.mark.parametrize("argv", [["plan", "keygen", "--key"], ["authority", "--trust", "t.json", "--key"]])
def test_a_key_named_by_a_folder_is_refused_as_a_folder_not_as_an_existing_key(argv, tmp_path, capsys):
    folder = tmp_path / "keys"
    folder.mkdir()
    assert cli.main([*argv, str(folder)]) == 2
    err = capsys.readouterr().err
    assert "is a folder; name a file" in err and "--force" not in err and err.count("\n") == 1, err
    assert not any(folder.iterdir()) and sorted(p.name for p in tmp_path.iterdir()) == ["keys"]


@pytest.mark.parametrize(
    ("command", "model", "maker"),
    [
        (["plan", "build", "-o", "out"], "model.onnx", "plan from-onnx"),
        (["plan", "test"], "model.pth", "plan from-torch"),
        (["simulate", "--no-progress", "--task"], "model.onnx", "plan from-onnx"),
    ],
)
def test_a_model_file_given_as_a_task_file_names_the_command_that_takes_it(command, model, maker, tmp_path, capsys):
    path = tmp_path / model
    path.write_bytes(b"PK\x03\x04\x00binary")  # not Python: run as a task file it failed on null bytes
    assert cli.main([*command, str(path)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"fedfleet {command[0]}")
        and f"{path} is a" in err
        and f"`fedfleet {maker} " in err
        and err.count("\n") == 1
    ), err
    assert "null bytes" not in err and not (tmp_path / "out").exists()


def test_simulate_help_says_what_runs_without_a_config_and_without_out(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    fleet = FleetConfig.default().fleet
    assert exit_.value.code == 0 and "(without it, only the summary line is written)" in text
    assert f"({fleet.devices:,} without a fleet config)" in text and f"({fleet.hours:g} without a fleet config)" in text


@pytest.mark.parametrize("out", ["compare.png", "run3"])
def test_compare_refuses_an_out_that_is_not_an_html_file_before_reading_the_runs(out, tmp_path, capsys):
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / out)]) == 2
    err = capsys.readouterr().err
    assert err == f"fedfleet compare: --out {tmp_path / out}: the comparison is one HTML page; name a .html file\n"
    assert not any(tmp_path.iterdir())


def test_a_simulation_interrupted_under_its_progress_bar_ends_with_the_interrupted_line(tmp_path, capsys, monkeypatch):
    """The bar is drawn for the last time before the line, which stays the last on the screen."""
    from emulator.fleet.simulator import ProgressBar

    draw = ProgressBar.__call__

    def draw_then_interrupt(self, t_s: float, rounds: int, active: int) -> None:
        draw(self, t_s, rounds, active)
        raise KeyboardInterrupt  # Ctrl-C with the bar on the screen

    monkeypatch.setattr(ProgressBar, "__call__", draw_then_interrupt)
    assert cli.main(["simulate", "--devices", "40", "--hours", "1"]) == 130
    err = capsys.readouterr().err
    assert "simulated" in err  # the bar was drawn
    assert err.rstrip().splitlines()[-1] == "fedfleet simulate: interrupted, no tables or report written", err


def test_progress_on_a_stderr_that_is_no_terminal_is_a_line_each_simulated_hour(capsys):
    """Where rich draws nothing until the end (a log file, a CI job): a day of 10,000 devices was
    minutes without a word."""
    from emulator.fleet.simulator import ProgressBar

    bar = ProgressBar(3 * 3600.0)
    for t_s in range(0, 3 * 3600 + 1, 900):
        bar(float(t_s), t_s // 3600, 7)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"simulated {h}.00 h of 3.00" for h in range(4)], lines
    assert lines[-1].startswith("simulated 3.00 h of 3.00: rounds committed 3, devices active 7 (")
    short = ProgressBar(1800.0)  # a run shorter than an hour: its start, and where it ended
    for t_s in (0.0, 900.0, 1800.0):
        short(t_s, 1, 2)
    short.close()
    ends = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in ends] == ["simulated 0.00 h of 0.50", "simulated 0.50 h of 0.50"], ends


SERVER = ["--server", "http://127.0.0.1:9", "--population", "p"]  # never asked: the path is refused first


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["plan", "build", "day.toml", "-o", "out"],
            "fedfleet plan build: day.toml is a fleet config, not a task file (Python, .py); `fedfleet simulate day.toml` runs it",
        ),
        (
            ["simulate", "--no-progress", "--task", "day.toml"],
            "fedfleet simulate: --task day.toml is a fleet config, not a task file (Python, .py); `fedfleet simulate day.toml` runs it",
        ),
        (
            ["simulate", "--no-progress", "task.py"],
            "fedfleet simulate: task.py is a task file, not a fleet config; `fedfleet plan build task.py -o DIR` builds "
            "it, `fedfleet simulate --task task.py` simulates it",
        ),
        (
            ["plan", "from-onnx", "task.py", "--label", "y", "-o", "out"],
            "fedfleet plan from-onnx: task.py is a task file, not an ONNX model; `fedfleet plan build task.py -o DIR`",
        ),
        (
            ["plan", "from-onnx", "model.pt", "--label", "y", "-o", "out"],
            "fedfleet plan from-onnx: model.pt is a PyTorch checkpoint (torch.save), not an ONNX model; "
            "`fedfleet plan from-torch MODULE:FACTORY",
        ),
        (
            ["plan", "from-onnx", "model.onnx", "--label", "y", "-o", "out"],
            "fedfleet plan from-onnx: model.onnx: no such file; give the path of the ONNX model file (.onnx)",
        ),
        (
            ["plan", "from-onnx", "bundle", "--label", "y", "-o", "out.fedplan"],
            "fedfleet plan from-onnx: bundle: a folder; give the path of the ONNX model file (.onnx)",
        ),
        (["deploy", "task.py", *SERVER], "fedfleet deploy: task.py is a task file, not a bundle folder; "),
        (
            ["deploy", "bundle/t/manifest.json", *SERVER],
            "fedfleet deploy: bundle/t/manifest.json is a file of the bundle bundle; give the bundle folder bundle",
        ),
        (
            ["plan", "test", "bundle/t/plan.fedplan"],
            "fedfleet plan test: bundle/t/plan.fedplan is a plan built into the bundle bundle; give bundle (plan "
            "build: its task file, bundle/task.py)",
        ),
    ],
)
def test_a_file_of_another_kind_is_refused_in_one_line_naming_the_command_that_takes_it(
    argv, line, tmp_path, capsys, monkeypatch
):
    """Where a task file ran as TOML ('fix the syntax'), a fleet config or plan as Python ('name
    'fleet' is not defined', 'null bytes'), and a bundle's own file was 'a file, not a bundle'."""
    monkeypatch.chdir(tmp_path)
    Path("day.toml").write_text("[fleet]\ndevices = 10\n", encoding="utf-8")
    Path("task.py").write_text("raise SystemExit('a task file run as a fleet config or model')\n", encoding="utf-8")
    Path("model.pt").write_bytes(b"PK\x03\x04\x00binary")
    Path("bundle/t").mkdir(parents=True)
    for part in ("bundle/task.py", "bundle/source.json", "bundle/t/manifest.json", "bundle/t/plan.fedplan"):
        Path(part).write_bytes(b"\x00")
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(line) and captured.err.count("\n") == 1 and captured.out == "", captured.err
    assert not Path("out").exists() and not Path("out.fedplan").exists()


def test_a_secure_demo_whose_rounds_seat_too_few_devices_for_a_group_is_refused_before_it_runs(capsys):
    """Where each round was abandoned, without a word why, until the time limit (10 minutes)."""
    argv = ["demo", "--secure", "--devices", "20", "--goal", "10", "--secagg-group", "13"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        "fedfleet demo: --secagg-group 13: a Secure Aggregation group holds more than that many devices, and a "
        "round of --goal 10 seats 13, so no round could commit; use a smaller --secagg-group (default 5) or a larger --goal\n"
    )


def test_simulate_out_without_matplotlib_is_refused_before_the_run_naming_the_extra(tmp_path, capsys, monkeypatch):
    """Where the run went to its end and its report's first plot was a FleetReportError traceback."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where the sim extra is not installed
    out = tmp_path / "run"
    assert cli.main(["simulate", "--devices", "20", "--hours", "0.1", "--out", str(out), "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"fedfleet simulate: --out {out} gets the run's plots, which need matplotlib: pip install 'fedfleet[sim]' "
        "(in a checkout: .venv/bin/pip install -e '.[sim]'); or leave out --out for the summary line alone\n"
    )
    assert captured.out == "" and not out.exists()


@pytest.mark.parametrize(("command", "plan_alone"), [("from-onnx", True), ("from-torch", False)])
def test_plan_alone_is_offered_only_by_the_command_that_writes_one(command, plan_alone, capsys):
    """from-torch refuses -o PLAN.fedplan (it writes a bundle), so its help does not offer it."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exit_.value.code == 0 and ("a path ending in .fedplan writes the training plan alone" in text) is plan_alone


def test_a_demo_stopped_by_its_time_limit_says_so_and_how_many_rounds_it_committed(capsys):
    """The table and the summary end as a finished demo's do; the line says why it has fewer rounds."""
    argv = ["demo", "--devices", "10", "--goal", "7", "--rounds", "50", "--time-limit", "0.3"]
    assert cli.main(argv) in (0, 1)
    err = capsys.readouterr().err
    assert re.search(
        r"^fedfleet demo: stopped at --time-limit 0.3 s with \d+ of 50 rounds committed; give a longer", err, re.M
    )


def test_rounds_of_a_population_with_none_on_record_says_so_instead_of_a_bare_header(tmp_path, capsys, monkeypatch):
    plan = digits_plan()
    with ServerThread(tmp_path / "server.db", admin_key=ADMIN_KEY) as server, server.admin() as admin:
        admin.create_population("p")
        admin.deploy_task("p", "t", plan, encode_checkpoint(initial_weights(plan, seed=0)), RoundConfig())
        monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", ADMIN_KEY)
        assert cli.main(["rounds", "--server", server.url, "--population", "p"]) == 0
        assert cli.main(["rounds", "--server", server.url, "--population", "p", "--task", "t"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        "no rounds of p on record yet: a round is on record once it commits or is abandoned",
        "no rounds of task t of p on record yet: a round is on record once it commits or is abandoned",
    ]


@pytest.mark.parametrize(
    ("content", "env", "said"),
    [
        ("short\n", None, "--admin-key-file {file}: admin keys must be 16-512 printable ASCII characters"),
        ("", None, "--admin-key-file {file}: no admin key was given"),
        (None, "short", "$FEDFLEET_ADMIN_KEYS: admin keys must be 16-512 printable ASCII characters"),
    ],
)
def test_an_unusable_operator_key_is_said_with_where_it_came_from(content, env, said, tmp_path, capsys, monkeypatch):
    """The key's rule alone did not say which file or variable broke it (the server is not asked)."""
    key = tmp_path / "operator.key"
    argv = ["status", "--server", f"http://127.0.0.1:{free_port()}", "--population", "p"]
    if content is not None:
        key.write_text(content)
        key.chmod(0o600)
        argv += ["--admin-key-file", str(key)]
    if env is not None:
        monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", env)
    for command in (argv, ["stop", *argv[1:], "--task", "t"]):
        assert cli.main(command) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"fedfleet {command[0]}: " + said.format(file=key)), err


def test_status_of_a_population_without_a_task_says_so_and_how_to_deploy_one(tmp_path, capsys, monkeypatch):
    """It printed the population's name alone, as if the answer had been cut short."""
    with ServerThread(tmp_path / "server.db", admin_key=ADMIN_KEY) as server, server.admin() as admin:
        admin.create_population("p")
        monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", ADMIN_KEY)
        assert cli.main(["status", "--server", server.url, "--population", "p"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "population p",
        f"  no task yet: fedfleet deploy BUNDLE --server {server.url} --population p deploys one",
    ]


@pytest.mark.parametrize(
    ("name", "content", "said"),
    [
        ("admin.key", b"c2VjcmV0LW9wZXJhdG9yLWtleQ==\n", "`--admin-key-file admin.key`"),
        ("tester.key.pub", b"ed25519 AAAA tester\n", "`fedfleet server --release-trust tester.key.pub`"),
        ("report.json", b'{"passed": null}\n', "`fedfleet deploy DIR`"),
        ("model.onnx.data", b"\x00\x00\x80?", "`fedfleet plan from-onnx MODEL.onnx"),
        ("digits.npz", b"PK\x03\x04\x00", "`fedfleet simulate --data npz:digits.npz`"),
        ("notes.txt", b"the lr sweep: 0.1 was too slow\n", "it does not parse as Python (SyntaxError"),
        ("words.txt", b"sweep\n", "it does not run as Python: NameError: name 'sweep' is not defined"),
    ],
)
def test_a_file_that_is_no_python_given_as_a_task_file_says_a_task_file_is_python_in_one_line(
    name, content, said, tmp_path, capsys, monkeypatch
):
    """Where the key, trust line, JSON, weights or text ran as Python, a SyntaxError or NameError of its content."""
    monkeypatch.chdir(tmp_path)
    Path(name).write_bytes(content)
    assert cli.main(["plan", "test", name]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"fedfleet plan test: {name} is ") and captured.err.count("\n") == 1, captured.err
    assert "not a task file (Python, .py)" in captured.err and said in captured.err, captured.err
    assert captured.out == "" and not Path("build").exists()


def test_a_task_file_without_the_py_suffix_still_builds(tmp_path, capsys):
    task_file = tmp_path / "digits_task"  # Python under another name runs as before
    task_file.write_text(TASK_FILE.read_text(encoding="utf-8"), encoding="utf-8")
    assert cli.main(["plan", "build", str(task_file), "-o", str(tmp_path / "out"), "--runtimes", "1.31.1"]) == 0
    assert (tmp_path / "out" / "digits_mlp" / "plan.fedplan").is_file()


@pytest.mark.parametrize(
    "argv",
    [["plan", "keygen", "--key", "{d}/tester.key"], ["authority", "--trust", "{d}/t.json", "--key", "{d}/a.key"]],
)
def test_a_key_in_a_folder_that_does_not_exist_is_refused_naming_the_folder_and_none_is_made(argv, tmp_path, capsys):
    folder = tmp_path / "keys"  # mistyped: plan keygen made it and wrote the key there, authority refused
    assert cli.main([a.format(d=folder) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fedfleet {' '.join(argv[:2]) if argv[0] == 'plan' else 'authority'}: cannot write ")
    assert "folder" in err and err.count("\n") == 1, err
    assert not folder.exists()
    if argv[0] == "plan":
        assert f"there is no folder {folder}; make it first (mkdir -p {folder})" in err, err


def test_plan_test_of_a_group_ends_with_how_many_tasks_failed_and_which(tmp_path, capsys):
    task_file = tmp_path / "pair.py"  # the failed task first: the last task's "passed" was the last line
    task_file.write_text(f"""
import dataclasses, runpy
from emulator.toolchain.tasks import Budget
base = dataclasses.replace(runpy.run_path({str(TASK_FILE)!r})["task"], predicates=())
tasks = [dataclasses.replace(base, name="narrow", budget=Budget(step_ms=1e-9)), dataclasses.replace(base, name="roomy")]
""")
    assert cli.main(["plan", "test", str(task_file), "-o", str(tmp_path / "out"), "--runtimes", "1.31.1"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("roomy: passed") and lines[-1] == "1 of 2 tasks failed: narrow", lines


def test_deploy_of_an_untested_bundle_gives_the_plan_test_command_with_its_signing_key(tmp_path, capsys, monkeypatch):
    out = tmp_path / "bundle"
    assert cli.main(["plan", "build", str(TASK_FILE), "-o", str(out), "--runtimes", "1.31.1"]) == 0
    monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", ADMIN_KEY)
    capsys.readouterr()
    assert cli.main(["deploy", str(out), "--server", "http://127.0.0.1:9", "--population", "p"]) == 2
    err = capsys.readouterr().err
    assert f"run `fedfleet plan test {out} --signing-key KEY` first" in err and err.count("\n") == 1, err
    assert "--allow-untested-plans" in err  # where a report tested without a key goes


def test_a_password_in_the_server_url_is_in_no_message_and_no_log_line(bundle, capsys, caplog):
    """``--server https://user:secret@host/``: the one line saying the server does not answer, or
    that the URL is not one, named the URL whole."""
    caplog.set_level(logging.DEBUG)
    port = free_port()  # nothing listens there
    for url, said in [
        (
            f"http://operator:hunter2@127.0.0.1:{port}/",
            f"no answer from the server at http://operator:***@127.0.0.1:{port}",
        ),
        (f"operator:hunter2@127.0.0.1:{port}", f"e.g. http://operator:***@127.0.0.1:{port}"),
    ]:
        for command in _server_commands(bundle):
            assert cli.main([*command, "--server", url]) == 2, command
            err = capsys.readouterr().err
            assert said in err and "hunter2" not in err, err
    with pytest.raises(ServerUnreachable) as unreachable:
        AdminClient(f"https://operator:hunter2@127.0.0.1:{port}", admin_key=ADMIN_KEY).status("p")
    assert "hunter2" not in str(unreachable.value) and "operator:***@" in str(unreachable.value)
    assert not [r for r in caplog.records if "hunter2" in r.getMessage()]


def test_rounds_of_a_task_withholding_its_counts_shows_a_dash_not_a_zero(tmp_path, capsys, monkeypatch):
    """A central-DP task with ``dp.counts="withheld"`` publishes no counts: the table says ``-``
    where it read the missing counts as 0 devices selected and 0 reported, for a round that committed."""
    import httpx
    import numpy as np

    from device_runtime import PlanExecutor
    from server_stub import DPConfig

    plan = digits_plan()
    dp = DPConfig(mode="central", noise_multiplier=1.0, clip=1.0, counts="withheld")
    config = RoundConfig(goal_count=1, over_selection=1.0, min_fraction=1.0, min_reports=1, dp=dp)
    update = {n: np.zeros(shape, dtype) for n, (shape, dtype) in PlanExecutor(plan).client_update_spec().items()}
    update.update(num_examples=np.array(4.0, np.float32), count=np.array(4.0, np.float32))
    with ServerThread(tmp_path / "server.db", admin_key=ADMIN_KEY) as server, server.admin() as admin:
        admin.create_population("p")
        admin.deploy_task("p", "t", plan, encode_checkpoint(initial_weights(plan, seed=0)), config)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            session = http.post("/v1/populations/p/checkin", json={"runtime_version": "1.31.1"}).json()
            sent = http.post(
                f"/v1/sessions/{session['session_id']}/report",
                content=encode_checkpoint(update),
                headers={"Authorization": f"Bearer {session['token']}"},
            )
            assert sent.status_code == 200, sent.text
        monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", ADMIN_KEY)
        assert cli.main(["rounds", "--server", server.url, "--population", "p"]) == 0
    _, row = capsys.readouterr().out.splitlines()
    assert row.split()[:6] == ["t", "1", "1", "committed", "-", "-"], row
