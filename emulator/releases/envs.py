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
* An install that fails says why in one line (the index unreachable, a full disk, no wheel for this
  Python) and keeps pip's whole output in ``<cache>/onnxruntime-1.17.3.failed.log``.
* The env is made with this interpreter when the release has a wheel for it, else with a
  ``python3.X`` on ``PATH`` that it has one for (:data:`WHEEL_PYTHONS`: onnxruntime 1.15 and 1.16
  have none for Python 3.12): the env talks to the project only through pipes, so its Python need
  not be the project's.
* An env whose files were damaged after it was made (its onnxruntime no longer imports) is found by
  :meth:`RuntimeEnv.problem` and made again by :meth:`RuntimeEnv.repaired`.

:func:`cached_envs` lists the envs (release, state, Python, size) and :func:`remove_envs` deletes
them, as ``python -m emulator.releases.cache list|remove`` does.

Code runs in the env with ``python -I`` (isolated: neither the caller's working directory nor
``PYTHONPATH`` leaks in, so the project's packages cannot shadow the env's onnxruntime)::

    env = RuntimeEnv.for_release("1.17.3")
    env.run_json("import onnxruntime; result = {'v': onnxruntime.__version__}")  # {'v': '1.17.3'}
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CACHE_ENV_VAR",
    "KNOWN_RELEASES",
    "MARKER_NAME",
    "WHEEL_PYTHONS",
    "RuntimeEnv",
    "RuntimeEnvError",
    "available_releases",
    "cache_root",
    "cached_envs",
    "child_environ",
    "install_failure",
    "latest_patch_per_minor",
    "measured_release",
    "python_for_release",
    "remove_envs",
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

#: The onnxruntime minors (first, last) with a CPython 3.X wheel among the releases above, by X
#: (`pip index versions onnxruntime --python-version 3.X --only-binary=:all:`, checked 2026-11-27
#: for Linux x86_64): a release outside its Python's range is installed with another Python.
WHEEL_PYTHONS: dict[int, tuple[int, int]] = {10: (15, 23), 11: (15, 32), 12: (17, 32), 13: (20, 32), 14: (24, 32)}

_RELEASE = re.compile(r"^1\.(\d+)\.(\d+)$")
_INSTALL_TIMEOUT = 1800.0
_FAILED_LOG = "onnxruntime-{version}.failed.log"

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


def measured_release(version: str) -> str:
    """The release of :data:`KNOWN_RELEASES` that onnxruntime ``version`` is measured as: itself, or
    for an earlier patch the latest patch of its minor ('1.24.1' -> '1.24.4'). A patch of a minor
    loads the opsets and IR versions, and lacks the kernels, of the minor's latest (measured on
    1.15.0, 1.17.0 and 1.24.1), so its versioned plan is the minor's. Raises ValueError, in one
    line naming the known releases, for anything else: not a release, a minor not measured, or a
    patch newer than the measured one (which nobody has measured yet)."""
    known = "; the known releases are " + ", ".join(KNOWN_RELEASES) + ", and the earlier patches of each"
    match = _RELEASE.match(version) if isinstance(version, str) else None
    if match is None:
        raise ValueError(f"{str(version)[:40]!r} is not a release 1.X.Y{known}")
    minor, patch = int(match.group(1)), int(match.group(2))
    measured = next((r for r in KNOWN_RELEASES if _minor(r) == minor), None)
    if measured is None:
        raise ValueError(f"onnxruntime minor 1.{minor} was not measured{known}")
    if patch > int(measured.rsplit(".", 1)[1]):
        raise ValueError(
            f"onnxruntime {version} is newer than {measured}, the patch of 1.{minor} measured (measure it: "
            f"python -m emulator.releases.support --releases {version}){known}"
        )
    return measured


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


def _python_version(python: str | os.PathLike[str]) -> tuple[int, ...] | None:
    """(3, 11, 7) for an interpreter that runs and has ``venv``; None for one that does not (a
    pyenv shim of a version not selected exits 127)."""
    try:
        completed = subprocess.run(
            [str(python), "-c", "import sys, venv; print(*sys.version_info[:3])"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    try:
        return tuple(int(p) for p in completed.stdout.split()) if completed.returncode == 0 else None
    except ValueError:
        return None


def _span(minors: Sequence[int]) -> str:
    low, high = min(minors), max(minors)
    return f"3.{low}" if low == high else f"3.{low}-3.{high}"


def python_for_release(version: str, *, current: tuple[int, int] | None = None, search_path: str | None = None) -> str:
    """The interpreter to make the env of onnxruntime ``version`` with: this one (``current``, by
    default its version) unless :data:`WHEEL_PYTHONS` says the release has no wheel for it, then the
    newest ``python3.X`` on ``search_path`` (default ``$PATH``) that it has one for."""
    minor = _minor(version)
    here = current or (sys.version_info[0], sys.version_info[1])
    fits = [py for py, (first, last) in sorted(WHEEL_PYTHONS.items(), reverse=True) if first <= minor <= last]
    if here[0] != 3 or here[1] not in WHEEL_PYTHONS or not fits or here[1] in fits:
        return sys.executable  # a wheel for it, or nothing known against it: pip decides
    for py in fits:
        found = shutil.which(f"python3.{py}", path=search_path)
        if found is not None and (_python_version(found) or ())[:2] == (3, py):
            return found
    raise RuntimeEnvError(
        f"onnxruntime {version} has wheels for Python {_span(fits)} only, not for this interpreter's "
        f"{here[0]}.{here[1]}; put one of those on PATH (as python3.{fits[0]}) to make its env with, and run again"
    )


#: What pip prints when it cannot reach the index (urllib3's and the OS's words), shortest first.
_UNREACHABLE = (
    "Connection refused",
    "Network is unreachable",
    "No route to host",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Read timed out",
    "ConnectTimeoutError",
    "ProxyError",
    "CERTIFICATE_VERIFY_FAILED",
    "Failed to establish a new connection",
)
_NO_SPACE = ("No space left on device", "[Errno 28]", "Disk quota exceeded", "[Errno 122]")


def _disk_full(cache: Path) -> str:
    return (
        f"the disk holding {cache} is full (an env takes 150-250 MB): free space there, or set "
        f"${CACHE_ENV_VAR} to a folder on a disk with room"
    )


def install_failure(output: str, version: str, *, python: str, cache: Path) -> str:
    """Why pip could not install onnxruntime ``version`` (its ``output``), in one line that says what
    to do: a full disk, an index that does not answer, no wheel for this ``python`` ('3.12')."""
    if any(words in output for words in _NO_SPACE):
        return _disk_full(cache)
    unreachable = next((words for words in _UNREACHABLE if words in output), None)
    if unreachable is not None:
        return (
            f"the package index could not be reached ({unreachable}): connect to it, or point pip at one "
            "that answers (PIP_INDEX_URL), and run again"
        )
    listed = re.search(r"requirement onnxruntime==\S+ \(from versions: ([^)]*)\)", output)
    if listed is not None and listed.group(1).strip() == "none":  # pip without retries says no more
        return (
            "the package index listed no onnxruntime at all (unreachable, or an index without it): check the "
            "network and PIP_INDEX_URL, and run again"
        )
    if listed is not None:
        minor = version.rsplit(".", 1)[0] + "."
        same = [v.strip() for v in listed.group(1).split(",") if v.strip().startswith(minor)]
        has = f"of {minor[:-1]} it has {', '.join(same)}" if same else f"it has no {minor[:-1]} release for it"
        return f"the package index has no onnxruntime {version} for Python {python} on this platform ({has})"
    errors = [ln.removeprefix("ERROR:").strip() for ln in output.splitlines() if ln.startswith("ERROR:")]
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    return errors[0] if errors else (lines[-1] if lines else "pip said nothing")


def _lock_path(root: Path, version: str) -> Path:
    return root / f".onnxruntime-{version}.lock"


@contextmanager
def _locked(lock_path: Path):
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock_path, "a")  # noqa: SIM115 - held for the with block below
    except OSError as exc:
        raise RuntimeEnvError(
            f"cannot use the runtime env cache {lock_path.parent} ({exc.strerror or exc}); "
            f"set ${CACHE_ENV_VAR} to a folder you can write"
        ) from None
    with handle:
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

        ``base_python`` makes the venv (default: :func:`python_for_release`). With ``create=False``
        a missing or invalid env raises instead of being installed.
        """
        requirements_for(version)  # validates the version string before touching the disk
        root = Path(cache).expanduser() if cache is not None else cache_root()
        env = cls(version, root / f"onnxruntime-{version}")
        if env.is_valid():
            return env
        if not create:
            raise RuntimeEnvError(f"no valid env for onnxruntime {version} under {root}")
        with _locked(_lock_path(root, version)):
            if not env.is_valid():  # another process may have finished it while we waited
                env._create(base_python)
        return env

    def problem(self) -> str | None:
        """None when the env's interpreter imports numpy and its onnxruntime at this release, else
        what went wrong (one line): files deleted or overwritten since the env was made."""
        try:
            completed = subprocess.run(
                [str(self.python), "-I", "-c", "import numpy, onnxruntime; print(onnxruntime.__version__)"],
                capture_output=True,
                text=True,
                env=child_environ(),
                timeout=300,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"its interpreter {self.python} does not run ({exc})"
        lines = completed.stdout.strip().splitlines()
        if completed.returncode == 0 and lines and lines[-1] == self.version:
            return None
        if completed.returncode == 0:
            return f"it imports onnxruntime {lines[-1] if lines else '?'!r}"
        return _tail(completed.stderr, 1) or f"its interpreter exits with {completed.returncode}"

    def repaired(self, *, base_python: str | os.PathLike[str] | None = None) -> RuntimeEnv:
        """This env, made again if it is damaged (see :meth:`problem`). Checked under the env's lock,
        so an env another process has just made again is kept."""
        with _locked(_lock_path(self.path.parent, self.version)):
            if not self.is_valid() or self.problem() is not None:
                self._create(base_python)
        return self

    def _create(self, base_python: str | os.PathLike[str] | None) -> None:
        if self.path.exists():  # leftover of a failed or interrupted install: never reused
            shutil.rmtree(self.path)
        base = str(base_python) if base_python is not None else python_for_release(self.version)
        python_version = _python_version(base)
        if python_version is None:
            raise RuntimeEnvError(
                f"cannot make the env of onnxruntime {self.version}: {base} is not a Python with venv that runs"
            )
        log = self.path.parent / _FAILED_LOG.format(version=self.version)
        try:
            self._run_checked([base, "-m", "venv", str(self.path)], "python -m venv", log)
            requirements = requirements_for(self.version)
            self._run_checked(
                [str(self.python), "-m", "pip", "install", "--disable-pip-version-check", "--no-input", *requirements],
                f"pip install {' '.join(requirements)}",
                log,
                python=".".join(map(str, python_version[:2])),
            )
            probe = self._run_checked(
                [str(self.python), "-I", "-c", "import onnxruntime; print(onnxruntime.__version__)"],
                "import onnxruntime",
                log,
            )
            installed = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else ""
            if installed != self.version:
                raise RuntimeEnvError(f"env for onnxruntime {self.version} imports onnxruntime {installed!r}")
            marker = {"onnxruntime": self.version, "requirements": requirements}
            tmp = self.marker.with_suffix(".tmp")
            try:
                tmp.write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")
                os.replace(tmp, self.marker)  # atomic: the env turns valid in one step
            except OSError as exc:
                why = _disk_full(self.path.parent) if exc.errno in (errno.ENOSPC, errno.EDQUOT) else exc.strerror
                raise RuntimeEnvError(f"cannot finish the env of onnxruntime {self.version}: {why}") from None
            log.unlink(missing_ok=True)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    def _run_checked(
        self, argv: list[str], what: str, log: Path, *, python: str = ""
    ) -> subprocess.CompletedProcess[str]:
        """Run one install step; a failure is one line (``install_failure``) naming ``log``, which
        keeps the step's whole output."""
        try:
            completed = subprocess.run(
                argv, capture_output=True, text=True, env=child_environ(), timeout=_INSTALL_TIMEOUT
            )
        except subprocess.TimeoutExpired:
            raise RuntimeEnvError(
                f"cannot install onnxruntime {self.version}: {what} took over {_INSTALL_TIMEOUT:g} s"
            ) from None
        if completed.returncode != 0:
            output = f"$ {' '.join(argv)}\n{completed.stdout}\n{completed.stderr}"
            try:
                log.write_text(output, encoding="utf-8")
                where = f"; the whole output: {log}"
            except OSError:  # a full disk, say: the line has to do without it
                log.unlink(missing_ok=True)
                where = ""
            why = install_failure(output, self.version, python=python or "this", cache=self.path.parent)
            raise RuntimeEnvError(f"cannot install onnxruntime {self.version} ({what} failed): {why}{where}")
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


# ----------------------------------------------------------------------------- the cache as a whole


def _size(path: Path) -> int:
    """Bytes ``path`` takes on disk (allocated blocks, as ``du``), links not followed."""
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except OSError:  # removed while we walked
                pass
    return total


def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def cached_envs(cache: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """The envs under ``cache`` (default :func:`cache_root`), oldest release first: ``release``,
    ``path``, ``valid`` (finished installing; see :meth:`RuntimeEnv.is_valid`), ``python`` (the
    version of the Python that made it) and ``bytes`` on disk."""
    root = Path(cache).expanduser() if cache is not None else cache_root()
    found = []
    for path in root.glob("onnxruntime-*") if root.is_dir() else []:
        version = path.name.removeprefix("onnxruntime-")
        if not path.is_dir() or _RELEASE.match(version) is None:
            continue
        try:  # what `python -m venv` wrote: the version of the Python that made the env
            config = (path / "pyvenv.cfg").read_text(encoding="utf-8")
        except OSError:
            config = ""
        python = next((ln.split("=", 1)[1].strip() for ln in config.splitlines() if ln.startswith("version")), None)
        valid = RuntimeEnv(version, path).is_valid()
        found.append({"release": version, "path": str(path), "valid": valid, "python": python, "bytes": _size(path)})
    return sorted(found, key=lambda e: _release_key(e["release"]))


def remove_envs(releases: Sequence[str] | None = None, *, cache: str | os.PathLike[str] | None = None) -> list[str]:
    """Delete the envs of ``releases`` (None: every env) under ``cache``, each under its lock so that
    an install under way finishes first; the releases removed. A worker already running from a
    removed env goes on (its files stay until it exits)."""
    root = Path(cache).expanduser() if cache is not None else cache_root()
    wanted = [e["release"] for e in cached_envs(root)] if releases is None else list(releases)
    removed = []
    for version in wanted:
        requirements_for(version)  # a release string, not a path: nothing outside the cache goes
        path = root / f"onnxruntime-{version}"
        with _locked(_lock_path(root, version)):
            if path.exists():
                shutil.rmtree(path)
                removed.append(version)
            (root / _FAILED_LOG.format(version=version)).unlink(missing_ok=True)
        # the empty lock file stays: deleting it could let a process waiting on it and a newcomer
        # locking a new file of that name install the release at once
    return removed
