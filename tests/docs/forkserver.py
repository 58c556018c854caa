"""A fork server for the docs test: one process per test session imports what ``fedfleet`` and the
pages' scripts load, then forks a child per command, so a page's dozen ``fedfleet ...`` and
``python script.py`` lines do not each pay the seconds of importing SQLAlchemy, FastAPI, onnxruntime
and numpy afresh. The page's shell blocks still run in bash as written: the harness puts a stdlib-only
shim at ``.venv/bin/fedfleet`` (and ``.venv/bin/python``) of the page's folder, which sends the
command's argv, folder, environment, umask and its descriptors 0, 1 and 2 over a Unix socket, forwards
the signals it gets to the child's process group, and ends as the child ended (its status, or killed
by the same signal). A child whose shim is gone (killed by the harness's ``killpg``) is killed with its
process group, so nothing outlives the page. What the server cannot run as a fresh process would (a
``python -c``, a different ``PYTHON*`` environment, a script folder that shadows a loaded module, no
server) the shim runs with the real interpreter instead.

What a forked child shares with the server that a fresh process would not: the hash seed
(``PYTHONHASHSEED``) and the modules already imported. ``random`` reseeds itself at fork, numpy's
global generator is reseeded from the OS here, as a fresh process seeds it; the server configures no
logging, so a child starts with none as a fresh process does."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

#: What the pages' commands import: the CLI and what its commands import when run, and what the
#: pages' scripts import (the runtime, the store, the server, sklearn's digits).
PRELOAD = (
    "emulator.cli",
    "emulator.fleet.simulator",
    "emulator.fleet.federated_data",
    "emulator.fleet.workload",
    "emulator.fleet.compare",
    "emulator.fleet.report",
    "emulator.toolchain.tasks",
    "server_stub",
    "server_stub.cli",
    "uvicorn",
    "device_runtime",
    "example_store",
    "sklearn.datasets",
)
READY = b"ready\n"
MAX_MESSAGE = 1 << 20

SHIM = '''#!{python} -IS
"""{kind} for the docs test: runs in the docs test's fork server, or as written if it cannot."""
import json, os, signal, socket, sys

SOCKET, KIND, REAL = {socket!r}, {kind!r}, {real!r}


def fallback(reason=""):
    os.execv(REAL, [REAL, *sys.argv[1:]])


argv = sys.argv
if KIND == "python" and (len(argv) < 2 or (argv[1].startswith("-") and (argv[1] != "-m" or len(argv) < 3))):
    fallback()
umask = os.umask(0)
os.umask(umask)
request = {{
    "kind": KIND, "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "umask": umask,
    "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
}}
try:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(SOCKET)
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    reply = json.loads(conn.recv({max_message}) or b"{{}}")
except (OSError, ValueError):
    fallback()
if "pid" not in reply:
    conn.close()
    fallback()


def forward(signum, frame):
    conn.send(json.dumps({{"signal": signum}}).encode())


for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    if signal.getsignal(signum) != signal.SIG_IGN:
        signal.signal(signum, forward)
status = json.loads(conn.recv({max_message}) or b'{{"status": 137}}')["status"]
if os.WIFSIGNALED(status):
    signum = os.WTERMSIG(status)
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
sys.exit(os.waitstatus_to_exitcode(status))
'''


def write_shim(path: Path, kind: str, server_socket: Path, real: Path) -> None:
    """Write the shim for ``kind`` ("fedfleet" or "python") at ``path``; ``real`` runs what the server cannot."""
    path.write_text(
        SHIM.format(
            python=sys.executable, kind=kind, socket=str(server_socket), real=str(real), max_message=MAX_MESSAGE
        ),
        encoding="utf-8",
    )
    path.chmod(0o755)


class ForkServer:
    """The server process, seen from the test session: started once, stopped (and waited) at the end."""

    def __init__(self, folder: Path) -> None:
        self.socket = folder / "fork.sock"
        self._process = subprocess.Popen(
            [sys.executable, __file__, str(self.socket)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, (str(_root()), os.environ.get("PYTHONPATH")))),
            },
        )
        assert self._process.stdout is not None
        if self._process.stdout.readline() != READY:
            self.stop()
            raise RuntimeError("the docs test's fork server did not start")

    @property
    def pid(self) -> int:
        """The server's process id: the parent of every command it runs."""
        return self._process.pid

    def stop(self) -> None:
        """Close the server's stdin: it kills what still runs, reaps it and exits; wait for it."""
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def _root() -> Path:
    return Path(__file__).resolve().parents[2]


@dataclass
class _Running:
    pid: int
    conn: socket.socket
    pidfd: int
    shim_gone: bool = False


def serve(path: Path) -> None:
    """Preload, listen, and fork a child per request until stdin closes."""
    for module in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    own_env = {k: v for k, v in os.environ.items() if k.startswith("PYTHON")}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "stop")
    running: dict[int, _Running] = {}  # by the connection's fd
    by_pidfd: dict[int, _Running] = {}
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    with open(os.devnull, "wb") as devnull:  # nobody reads the pipe after READY: it must never fill
        os.dup2(devnull.fileno(), sys.stdout.fileno())
    stopping = False
    while not stopping or running:
        for key, _ in selector.select():
            if key.data == "stop":
                stopping = True
                selector.unregister(key.fd)
                selector.unregister(listener)
                for child in running.values():
                    _kill_group(child.pid, signal.SIGKILL)
            elif key.data == "accept":
                conn, _ = listener.accept()
                child = _start(conn, own_env, [listener.fileno(), selector.fileno(), sys.stdin.fileno()], running)
                if child is not None:
                    running[conn.fileno()] = child
                    by_pidfd[child.pidfd] = child
                    selector.register(conn, selectors.EVENT_READ, "conn")
                    selector.register(child.pidfd, selectors.EVENT_READ, "exit")
            elif key.data == "conn":
                child = running.get(key.fd)
                if child is None or child.conn is not key.fileobj:
                    continue
                message = child.conn.recv(MAX_MESSAGE)
                if not message:  # the shim is gone: so is what it ran
                    selector.unregister(key.fd)
                    child.shim_gone = True
                    _kill_group(child.pid, signal.SIGKILL)
                else:
                    _kill_group(child.pid, json.loads(message)["signal"])
            elif key.data == "exit":
                child = by_pidfd.pop(key.fd, None)
                if child is None:
                    continue
                selector.unregister(key.fd)
                _, status = os.waitpid(child.pid, 0)
                os.close(child.pidfd)
                if not child.shim_gone:
                    selector.unregister(child.conn)
                    with contextlib.suppress(OSError):
                        child.conn.send(json.dumps({"status": status}).encode())
                _kill_group(child.pid, signal.SIGKILL)  # what it left behind, as the page's killpg would
                running.pop(child.conn.fileno())
                child.conn.close()
    listener.close()
    path.unlink(missing_ok=True)


def _kill_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


def _start(conn: socket.socket, own_env: dict[str, str], server_fds: list[int], running: dict) -> _Running | None:
    """Read a request and fork its child, or tell the shim to run it itself (and return None)."""
    try:
        data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
        request = json.loads(data)
    except (OSError, ValueError):
        conn.close()
        return None
    reason = _cannot_serve(request, own_env)
    if reason or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.send(json.dumps({"fallback": reason or "no descriptors"}).encode())
        conn.close()
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd in [*server_fds, *(c.conn.fileno() for c in running.values()), *(c.pidfd for c in running.values())]:
            with contextlib.suppress(OSError):
                os.close(fd)
        conn.close()
        _child(request, fds)
    for fd in fds:
        os.close(fd)
    with contextlib.suppress(ProcessLookupError):
        os.setpgid(pid, pid)  # also done by the child: whichever runs first
    pidfd = os.pidfd_open(pid)
    with contextlib.suppress(OSError):
        conn.send(json.dumps({"pid": pid}).encode())
    return _Running(pid, conn, pidfd)


def _cannot_serve(request: dict, own_env: dict[str, str]) -> str:
    """Why a fresh process would differ from a forked child here ("" when it would not)."""
    theirs = {k: v for k, v in request["env"].items() if k.startswith("PYTHON")}
    if theirs != own_env:
        return "a different PYTHON* environment"
    if request["kind"] == "python":
        argv = request["argv"]
        folder = Path(request["cwd"]) if argv[1] == "-m" else (Path(request["cwd"]) / argv[1]).parent
        loaded = {name for name in sys.modules if "." not in name}
        if any((folder / f"{name}.py").exists() or (folder / name).is_dir() for name in loaded):
            return f"{folder} holds a module of the name of one already imported"
    return ""


def _child(request: dict, fds: list[int]) -> None:
    """Become the command as a fresh process would run it; never returns."""
    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), line_buffering=False)
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), line_buffering=os.isatty(1))
    sys.stderr = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)), errors="backslashreplace", line_buffering=True
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN if request["sigint_ignored"] else signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # a fresh process seeds the global generator from the OS
    argv: list[str] = request["argv"]
    code = 0
    try:
        if request["kind"] == "fedfleet":
            sys.argv = list(argv)
            sys.path[0] = str(Path(os.path.abspath(argv[0])).parent)
            from emulator.cli import main

            code = main()
        elif argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv[1:]
            sys.path[0] = str(Path(os.path.abspath(argv[1])).parent)
            runpy.run_path(argv[1], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    os._exit(_exit_status(code))


def _exit_status(code: object) -> int:
    """What ``sys.exit(code)`` makes the process's status, after the interpreter's shutdown steps."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:
        print(code, file=sys.stderr)
        status = 1
    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads, as at exit
    atexit._run_exitfuncs()
    _flush()
    return status


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
