"""One cached virtual environment per real onnxruntime release, to run code against that release.

The plan toolchain tests every versioned plan on the exact onnxruntime release it claims (DESIGN.md,
"Plan toolchain"); :mod:`emulator.releases.support` measures what each release loads. Both need the real
wheels side by side, which one interpreter cannot import at once, so each release gets its own venv:

* ``<cache>/onnxruntime-1.17.3/`` made with ``python -m venv`` and ``pip install onnxruntime==1.17.3``
  (plus ``numpy<2`` for 1.18 and older: their wheels were built against numpy 1.x and crash on import
  with numpy 2). The project itself (and onnx) is not installed there: callers send what the env
  needs (serialized models, arrays) as JSON.
* ``<cache>`` is ``$FEDFLEET_RUNTIME_CACHE`` or ``~/.cache/fedfleet/runtimes``.
* An env is *valid* only once its marker file exists. The marker is written last, after pip succeeded
  and the env's own ``onnxruntime.__version__`` was read back and matched, so an install that failed
  or was interrupted leaves no valid env: the next :meth:`RuntimeEnv.for_release` wipes the leftover
  and starts again. A per-release lock file serializes concurrent creators (two test workers, or a
  measurement running beside a test session).

Code runs in the env with ``python -I`` (isolated: neither the caller's working directory nor
``PYTHONPATH`` leaks in, so the project's packages cannot shadow the env's onnxruntime)::

    env = RuntimeEnv.for_release("1.17.3")
    env.run_json("import onnxruntime; result = {'v': onnxruntime.__version__}")  # {'v': '1.17.3'}
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CACHE_ENV_VAR",
    "KNOWN_RELEASES",
    "MARKER_NAME",
    "RuntimeEnv",
    "RuntimeEnvError",
    "available_releases",
    "cache_root",
    "child_environ",
    "latest_patch_per_minor",
    "requirements_for",
]

CACHE_ENV_VAR = "FEDFLEET_RUNTIME_CACHE"
MARKER_NAME = "fedfleet-runtime-env.json"
FIRST_MINOR, LAST_MINOR = 15, 32

# The latest patch of each minor release 1.15-1.32 on PyPI, all of which have CPython 3.11 wheels
# (`pip index versions onnxruntime`, checked when this list was written). available_releases() can
# ask the index instead, which also drops releases without a wheel for the running interpreter.
KNOWN_RELEASES: tuple[str, ...] = (
    "1.15.1",
    "1.16.3",
    "1.17.3",
    "1.18.1",
    "1.19.2",
    "1.20.1",
    "1.21.1",
    "1.22.1",
    "1.23.2",
    "1.24.4",
    "1.25.1",
    "1.26.0",
    "1.27.0",
    "1.28.0",
    "1.29.0",
    "1.30.0",
    "1.31.1",
    "1.32.0",
)

_RELEASE = re.compile(r"^1\.(\d+)\.(\d+)$")
_INSTALL_TIMEOUT = 1800.0

# Runs inside the env: reads {"code", "payload"} from stdin, runs the code with `payload` bound, and
# writes the `result` it leaves to the file named by argv[1] (not stdout, which native libraries and
# the snippet itself may print to).
_RUNNER = """\
import json, sys
request = json.load(sys.stdin)
namespace = {"__name__": "__fedfleet_snippet__", "payload": request["payload"]}
exec(compile(request["code"], "<fedfleet snippet>", "exec"), namespace)
with open(sys.argv[1], "w", encoding="utf-8") as out:
    json.dump(namespace.get("result"), out)
"""


class RuntimeEnvError(RuntimeError):
    """An env could not be made, or code run in it failed; the message carries the tail of its stderr."""


def cache_root() -> Path:
    """Where the envs live: ``$FEDFLEET_RUNTIME_CACHE`` or ``~/.cache/fedfleet/runtimes``."""
    configured = os.environ.get(CACHE_ENV_VAR)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "fedfleet" / "runtimes"


def _minor(version: str) -> int:
    match = _RELEASE.match(version)
    if match is None:
        raise ValueError(f"{version!r} is not an onnxruntime release such as '1.17.3'")
    return int(match.group(1))


def requirements_for(version: str) -> list[str]:
    """The pip requirements of the env for onnxruntime ``version``."""
    requirements = [f"onnxruntime=={version}"]
    if _minor(version) <= 18:
        requirements.append("numpy<2")
    return requirements


def latest_patch_per_minor(
    versions: Iterable[str], first_minor: int = FIRST_MINOR, last_minor: int = LAST_MINOR
) -> list[str]:
    """Keep the highest final 1.x.y of each minor in [first_minor, last_minor], oldest first."""
    best: dict[int, tuple[int, int]] = {}
    for version in versions:
        match = _RELEASE.match(version.strip())
        if match is None:  # pre-releases, dev builds, other majors
            continue
        minor, patch = int(match.group(1)), int(match.group(2))
        if first_minor <= minor <= last_minor and (minor not in best or patch > best[minor][1]):
            best[minor] = (minor, patch)
    return [f"1.{minor}.{patch}" for minor, patch in sorted(best.values())]


def available_releases(*, query_index: bool = False, python: str | os.PathLike[str] | None = None) -> list[str]:
    """The latest patch of each onnxruntime minor 1.15-1.32, oldest first.

    By default the fixed :data:`KNOWN_RELEASES` (reproducible, no network). With ``query_index``,
    ``pip index versions onnxruntime`` run by ``python`` (default: this interpreter) decides, which
    lists only releases with a wheel for that interpreter.
    """
    if not query_index:
        return list(KNOWN_RELEASES)
    completed = subprocess.run(
        [str(python or sys.executable), "-m", "pip", "index", "versions", "onnxruntime"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((ln for ln in completed.stdout.splitlines() if ln.startswith("Available versions:")), None)
    if completed.returncode != 0 or line is None:
        raise RuntimeEnvError(f"pip index versions onnxruntime failed: {_tail(completed.stderr or completed.stdout)}")
    return latest_patch_per_minor(line.split(":", 1)[1].split(","))


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def child_environ() -> dict[str, str]:
    """The environment of a process run in an env: nothing that points the interpreter elsewhere."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _env_python(path: Path) -> Path:
    return path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


@contextmanager
def _locked(lock_path: Path):
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass(frozen=True)
class RuntimeEnv:
    """A venv holding one onnxruntime release. Make one with :meth:`for_release`."""

    version: str
    path: Path

    @property
    def python(self) -> Path:
        """The env's interpreter."""
        return _env_python(self.path)

    @property
    def marker(self) -> Path:
        return self.path / MARKER_NAME

    def is_valid(self) -> bool:
        """True when the install finished (marker present, same requirements) and the interpreter exists."""
        try:
            record = json.loads(self.marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return (
            isinstance(record, dict)
            and record.get("onnxruntime") == self.version
            and record.get("requirements") == requirements_for(self.version)
            and self.python.exists()
        )

    @classmethod
    def for_release(
        cls,
        version: str,
        *,
        cache: str | os.PathLike[str] | None = None,
        base_python: str | os.PathLike[str] | None = None,
        create: bool = True,
    ) -> RuntimeEnv:
        """The env for onnxruntime ``version``, reused when valid, else (re)made.

        ``base_python`` makes the venv (default: this interpreter). With ``create=False`` a missing
        or invalid env raises instead of being installed.
        """
        requirements_for(version)  # validates the version string before touching the disk
        root = Path(cache).expanduser() if cache is not None else cache_root()
        env = cls(version, root / f"onnxruntime-{version}")
        if env.is_valid():
            return env
        if not create:
            raise RuntimeEnvError(f"no valid env for onnxruntime {version} under {root}")
        with _locked(root / f".onnxruntime-{version}.lock"):
            if not env.is_valid():  # another process may have finished it while we waited
                env._create(Path(base_python) if base_python is not None else Path(sys.executable))
        return env

    def _create(self, base_python: Path) -> None:
        if self.path.exists():  # leftover of a failed or interrupted install: never reused
            shutil.rmtree(self.path)
        try:
            self._run_checked([str(base_python), "-m", "venv", str(self.path)], "python -m venv")
            requirements = requirements_for(self.version)
            self._run_checked(
                [str(self.python), "-m", "pip", "install", "--disable-pip-version-check", "--no-input", *requirements],
                f"pip install {' '.join(requirements)}",
            )
            probe = self._run_checked(
                [str(self.python), "-I", "-c", "import onnxruntime; print(onnxruntime.__version__)"],
                "import onnxruntime",
            )
            installed = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else ""
            if installed != self.version:
                raise RuntimeEnvError(f"env for onnxruntime {self.version} imports onnxruntime {installed!r}")
            marker = {"onnxruntime": self.version, "requirements": requirements}
            tmp = self.marker.with_suffix(".tmp")
            tmp.write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")
            os.replace(tmp, self.marker)  # atomic: the env turns valid in one step
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    def _run_checked(self, argv: list[str], what: str) -> subprocess.CompletedProcess[str]:
        try:
            completed = subprocess.run(
                argv, capture_output=True, text=True, env=child_environ(), timeout=_INSTALL_TIMEOUT
            )
        except subprocess.TimeoutExpired:
            raise RuntimeEnvError(f"{what} for onnxruntime {self.version} timed out") from None
        if completed.returncode != 0:
            raise RuntimeEnvError(
                f"{what} for onnxruntime {self.version} failed (exit {completed.returncode}):\n"
                f"{_tail(completed.stderr or completed.stdout)}"
            )
        return completed

    def run_json(self, code: str, payload: Any = None, *, timeout: float = 600.0) -> Any:
        """Run ``code`` in the env and return the JSON value it assigns to ``result``.

        ``payload`` (any JSON value; base64 for bytes) is bound to the name ``payload`` before the
        code runs. A snippet that raises, or does not finish within ``timeout`` seconds, raises
        :class:`RuntimeEnvError` with the tail of the env's stderr.
        """
        request = json.dumps({"code": code, "payload": payload})
        with tempfile.TemporaryDirectory(prefix="fedfleet-run-") as tmp:
            out = Path(tmp) / "result.json"
            try:
                completed = subprocess.run(
                    [str(self.python), "-I", "-c", _RUNNER, str(out)],
                    input=request,
                    capture_output=True,
                    text=True,
                    env=child_environ(),
                    cwd=tmp,
                    timeout=timeout,
                )
            except subprocess.TimeoutExpired:
                raise RuntimeEnvError(f"code in onnxruntime {self.version} env timed out after {timeout} s") from None
            if completed.returncode != 0 or not out.exists():
                raise RuntimeEnvError(
                    f"code in onnxruntime {self.version} env failed (exit {completed.returncode}):\n"
                    f"{_tail(completed.stderr)}"
                )
            return json.loads(out.read_text(encoding="utf-8"))
