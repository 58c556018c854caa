"""The docs test's fork server runs a page's commands as fresh processes would: through the shim in
the page's ``.venv/bin``, a command's output, exit status and signals are its own, a background
command ends when the harness stops the page, and what the server cannot run runs as written."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.docs import test_code_blocks
from tests.docs.forkserver import ForkServer
from tests.docs.test_code_blocks import ROOT, Block, run_page

HERE = ROOT / "tests" / "docs" / "test_forkserver.py"

pytestmark = test_code_blocks.on_the_fork_server

SHOW = """import os, random, sys

import numpy as np

print("parent", os.getppid())
print("argv", sys.argv)
print("cwd", os.getcwd())
print("env", os.environ.get("DOCS_X"))
print("stdin", sys.stdin.read().strip())
print("random", random.random(), np.random.random())
print("path0", sys.path[0])
"""


def _blocks(*pieces: tuple[str, str | None, str]) -> list[Block]:
    return [Block(HERE, line, lang, title, code, "run") for line, (lang, title, code) in enumerate(pieces, 1)]


def _lines(path: Path) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in path.read_text(encoding="utf-8").splitlines() if " " in line)


def test_a_script_runs_in_the_server_with_its_own_argv_folder_environment_stdin_and_random_state(
    tmp_path: Path, fork_server: ForkServer
) -> None:
    run_page(
        _blocks(
            ("python", "show.py", SHOW),
            (
                "bash",
                None,
                "mkdir sub && cd sub && echo hi | DOCS_X=1 ../.venv/bin/python ../show.py a 'b c' > ../one.txt",
            ),
            ("bash", None, "echo there | python show.py > two.txt"),
        ),
        tmp_path,
        fork_server,
    )
    one, two = _lines(tmp_path / "one.txt"), _lines(tmp_path / "two.txt")
    assert one["parent"] == two["parent"] == str(fork_server.pid)
    assert one["argv"] == "['../show.py', 'a', 'b c']" and one["cwd"] == str(tmp_path / "sub")
    assert (one["env"], one["stdin"], two["env"], two["stdin"]) == ("1", "hi", "None", "there")
    assert one["path0"] == two["path0"] == str(tmp_path)
    assert one["random"] != two["random"]


def test_fedfleet_runs_in_the_server_and_prints_what_it_prints_as_a_fresh_process(
    tmp_path: Path, fork_server: ForkServer
) -> None:
    run_page(
        _blocks(("bash", None, ".venv/bin/fedfleet --version > version.txt; fedfleet --version >> version.txt")),
        tmp_path,
        fork_server,
    )
    version = (tmp_path / "version.txt").read_text(encoding="utf-8").splitlines()
    assert len(version) == 2 and version[0] == version[1] and version[0].startswith("fedfleet ")


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("import sys; sys.exit(3)", 3),
        ("raise ValueError('no')", 1),
        ("import sys; sys.exit('a message')", 1),
        ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", 128 + 15),
        ("import os; os._exit(7)", 7),
    ],
)
def test_a_failing_command_gives_the_shell_its_status(
    tmp_path: Path, fork_server: ForkServer, code: str, status: int
) -> None:
    run_page(
        _blocks(
            ("python", "fail.py", code),
            ("bash", None, "set +e; .venv/bin/python fail.py 2> err.txt; echo $? > status.txt"),
        ),
        tmp_path,
        fork_server,
    )
    assert int((tmp_path / "status.txt").read_text(encoding="utf-8")) == status


def test_fedfleet_gives_the_shell_its_usage_error_and_a_failing_block_fails(
    tmp_path: Path, fork_server: ForkServer
) -> None:
    run_page(
        _blocks(("bash", None, "set +e; fedfleet compare 2> err.txt; echo $? > status.txt")), tmp_path, fork_server
    )
    assert (tmp_path / "status.txt").read_text(encoding="utf-8").strip() == "2"
    assert (tmp_path / "err.txt").read_text(encoding="utf-8").startswith("fedfleet compare: ")
    again = tmp_path / "again"
    again.mkdir()
    with pytest.raises(pytest.fail.Exception, match="exited 2"):
        run_page(_blocks(("bash", None, "fedfleet compare")), again, fork_server)


SERVE = """import os, signal, sys, time

if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[2], "w") as out:
    out.write(str(os.getpid()))
while True:
    time.sleep(1)
"""


@pytest.mark.parametrize("kind", ["polite", "stubborn"])
def test_a_background_command_ends_when_the_harness_stops_the_page(
    tmp_path: Path, fork_server: ForkServer, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the stubborn command ignores SIGTERM and sits out the harness's grace before SIGKILL: 1 s of it here
    monkeypatch.setattr(test_code_blocks, "STOP_GRACE_S", 1.0)
    run_page(
        _blocks(
            ("python", "serve.py", SERVE),
            ("bash", None, f".venv/bin/python serve.py {kind} pid.txt &\nuntil test -s pid.txt; do sleep 0.1; done"),
        ),
        tmp_path,
        fork_server,
    )
    pid = int((tmp_path / "pid.txt").read_text(encoding="utf-8"))
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_exec_replaces_the_shell_with_the_command(tmp_path: Path, fork_server: ForkServer) -> None:
    run_page(
        _blocks(("python", "show.py", SHOW), ("bash", None, "exec .venv/bin/python show.py < /dev/null > out.txt")),
        tmp_path,
        fork_server,
    )
    assert _lines(tmp_path / "out.txt")["parent"] == str(fork_server.pid)


def test_what_the_server_cannot_run_as_a_fresh_process_would_runs_as_written(
    tmp_path: Path, fork_server: ForkServer
) -> None:
    run_page(
        _blocks(
            ("python", "show.py", SHOW),
            ("bash", None, "mkdir numpy && .venv/bin/python show.py < /dev/null > shadowed.txt"),
            ("bash", None, "PYTHONHASHSEED=1 .venv/bin/python show.py < /dev/null > env.txt"),
            ("bash", None, ".venv/bin/python -c 'import os; print(\"parent\", os.getppid())' > c.txt"),
        ),
        tmp_path,
        fork_server,
    )
    for name in ("shadowed.txt", "env.txt", "c.txt"):
        assert _lines(tmp_path / name)["parent"] != str(fork_server.pid), name
