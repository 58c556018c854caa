"""A Ctrl-C anywhere in the life of the installed ``fedfleet`` command is one line and exit 130: while
its modules still import, while the command runs, and while the interpreter exits after it; in the
teardown after the last exit callback it is ignored and the command's own status stands.

Each case runs the real console script (``fedfleet_entry``) and sends SIGINT at a point the test
sees, never after a guessed delay: the import is under way once numpy's extension is mapped into
the process, and a task file tells by a file that the command runs or that the interpreter exits.
Python's own handler is put back in the child: a test run started in the background inherits
SIGINT ignored, as a terminal's never is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

FEDFLEET = Path(sys.executable).with_name("fedfleet")
#: The longest any step of a case waits for the next (a guard against a hang, not a measure).
PATIENCE_S = 120.0

#: A task file that says by ``<name>.started`` in $PROBE_DIR where the process is, then waits there
#: until ``<name>.go`` appears (and says by ``<name>.done`` that it went on): while the command loads
#: it ("running"), in an exit callback ("exiting"), or at teardown, when the interpreter frees its
#: modules ("teardown"). It defines no task, so that the command then ends at once (exit 2, in one line).
PROBE_TASK = """
import atexit, os, sys, time, types

def wait(name, sleep=time.sleep, exists=os.path.exists, join=os.path.join, opened=open, probe=os.environ["PROBE_DIR"]):
    opened(join(probe, name + ".started"), "w").close()
    for _ in range(2400):
        if exists(join(probe, name + ".go")):
            opened(join(probe, name + ".done"), "w").close()  # its cleanup finished
            return
        sleep(0.05)

class AtTeardown:
    def __del__(self, wait=wait):
        wait("teardown")

at = os.environ["PROBE_AT"]
if at == "running":
    wait("running")
elif at == "exiting":
    atexit.register(wait, "exiting")
elif at == "teardown":
    kept = types.ModuleType("teardown_probe")
    kept.value = AtTeardown()
    sys.modules["teardown_probe"] = kept
"""

NO_TASK = "fedfleet plan build: task file task.py defines no `task` (a Task) or `tasks` (a TaskGroup or a list of Task)"


def _start(tmp_path: Path, at: str) -> subprocess.Popen[str]:
    (tmp_path / "task.py").write_text(PROBE_TASK, encoding="utf-8")
    return subprocess.Popen(
        [str(FEDFLEET), "plan", "build", "task.py", "-o", "out"],
        cwd=tmp_path,
        env={**os.environ, "PROBE_DIR": str(tmp_path), "PROBE_AT": at},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _wait_until(process: subprocess.Popen[str], ready) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            out, err = process.communicate()
            pytest.fail(f"the command ended ({process.returncode}) or hung before the point to interrupt: {err}")
        time.sleep(0.005)


def _interrupt(process: subprocess.Popen[str], ready) -> tuple[str, str]:
    """Ctrl-C to ``process`` once ``ready()``; what it then wrote to stdout and stderr."""
    try:
        _wait_until(process, ready)
        process.send_signal(signal.SIGINT)
        return process.communicate(timeout=PATIENCE_S)
    finally:
        process.kill()
        process.wait()


def _importing(process: subprocess.Popen[str]) -> bool:
    """numpy's extension is mapped: the entry point runs, and the imports below it have a second to go."""
    try:
        return "_multiarray_umath" in Path(f"/proc/{process.pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps to see the import under way")
@pytest.mark.parametrize("at", ["importing", "running"])
def test_ctrl_c_while_the_command_imports_or_runs_is_one_line_and_exit_130(tmp_path, at):
    process = _start(tmp_path, at)
    ready = (lambda: _importing(process)) if at == "importing" else (tmp_path / "running.started").exists
    out, err = _interrupt(process, ready)
    assert (process.returncode, err.strip(), out) == (130, "fedfleet plan: interrupted", ""), err


#: Python that starts ``fedfleet plan`` as its console script does, with a Ctrl-C landing while the
#: first of the project's modules loads, the way one does inside a compiled module's initialisation:
#: pybind11's modules turn it into ImportError("initialization failed"), and an import that falls
#: back to another when one fails takes that in its stride.
CTRL_C_IN_AN_EXTENSION = """
import os, signal, sys, time

FAILS = sys.argv[1] == "fails"

class CtrlCInAnExtension:
    def find_spec(self, name, path=None, target=None):
        if name != "emulator":
            return None
        sys.meta_path.remove(self)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(60)
        except KeyboardInterrupt:
            if FAILS:
                raise ImportError("initialization failed") from None
        return None  # the import goes on as if nothing happened

sys.meta_path.insert(0, CtrlCInAnExtension())
sys.argv[1:] = ["plan"]
from fedfleet_entry import main
sys.exit(main())
"""


@pytest.mark.parametrize("import_", ["fails", "falls back"])
def test_ctrl_c_that_an_import_turns_into_an_import_error_or_swallows_is_still_one_line_and_exit_130(import_):
    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_IN_AN_EXTENSION, import_],
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert (done.returncode, done.stderr, done.stdout) == (130, "\nfedfleet plan: interrupted\n", "")


@pytest.mark.parametrize(
    "at, code, said",
    [
        ("exiting", 130, f"{NO_TASK}\n\nfedfleet plan: interrupted as it exited; the command had finished\n"),
        ("teardown", 2, f"{NO_TASK}\n"),  # ignored: the command's own status and line stand
    ],
    ids=["exiting", "teardown"],
)
def test_ctrl_c_after_the_command_ended_is_one_line_or_nothing_never_a_traceback_or_death_by_signal(
    tmp_path, at, code, said
):
    process = _start(tmp_path, at)
    try:
        _wait_until(process, (tmp_path / f"{at}.started").exists)
        process.send_signal(signal.SIGINT)  # an ignored signal is dropped as it is sent
        (tmp_path / f"{at}.go").touch()
        out, err = process.communicate(timeout=PATIENCE_S)
    finally:
        process.kill()
        process.wait()
    assert (process.returncode, err, out) == (code, said, "")
    assert (tmp_path / f"{at}.done").exists()  # the exit's cleanup was not cut short


def test_a_second_ctrl_c_while_the_exit_waits_on_cleanup_ends_it_at_once(tmp_path):
    """The first lets the exit callbacks finish (they clean up); a second does not wait for one that hangs."""
    process = _start(tmp_path, "exiting")
    try:
        _wait_until(process, (tmp_path / "exiting.started").exists)
        process.send_signal(signal.SIGINT)
        assert process.stderr is not None
        said = [process.stderr.readline() for _ in range(3)]  # the command's line, then the interrupted one
        process.send_signal(signal.SIGINT)  # the exit callback still waits for exiting.go, which never comes
        out, err = process.communicate(timeout=PATIENCE_S)
    finally:
        process.kill()
        process.wait()
    assert said[2] == "fedfleet plan: interrupted as it exited; the command had finished\n", said
    assert (process.returncode, err, out) == (130, "", "") and not (tmp_path / "exiting.done").exists()


#: A ``sitecustomize`` for ``fedfleet demo`` that says by ``reset.started`` in $PROBE_DIR that the
#: main thread is handing an SQLite connection back to SQLAlchemy's pool (the devices' example
#: stores do, as the demo makes its fleet) and waits there: a Ctrl-C then lands where the pool
#: catches it, logs it as an ERROR with its traceback and passes it on.
POOL_RESET_PROBE = """
import os, threading, time
from sqlalchemy import event
from sqlalchemy.pool import Pool

def reset(*args, probe=os.environ["PROBE_DIR"]):
    started = os.path.join(probe, "reset.started")
    if threading.current_thread() is threading.main_thread() and not os.path.exists(started):
        open(started, "w").close()
        time.sleep(120)

event.listen(Pool, "reset", reset)
"""


def test_ctrl_c_while_the_demo_hands_a_connection_back_to_its_pool_is_the_one_line(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(POOL_RESET_PROBE, encoding="utf-8")
    process = subprocess.Popen(
        [str(FEDFLEET), "demo", "--devices", "20", "--goal", "8"],
        cwd=tmp_path,
        env={**os.environ, "PROBE_DIR": str(tmp_path), "PYTHONPATH": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    out, err = _interrupt(process, (tmp_path / "reset.started").exists)
    assert (process.returncode, err.strip()) == (130, "fedfleet demo: interrupted"), err
