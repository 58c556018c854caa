"""Where a device keeps the plans it downloaded, and where a process keeps the plans it loaded.

A device downloads each plan once (plans are content-addressed, so a cached copy is checked
against its id before use). On a phone the copy lives in the app's cache directory; an emulated
fleet of thousands of devices in one process keeps each device's copies in memory instead, and
loads each plan (parsing it and building its onnxruntime sessions, several MB) once per process
rather than once per device."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from .errors import CorruptResource, OverBudget
from .executor import PlanExecutor
from .plan import Plan, PlanError, load_plan, plan_nodes

try:  # POSIX advisory locks: a lock is released when its process ends, however it ends
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)


class PlanCache(Protocol):
    """A device's downloaded plans by content id."""

    def get(self, plan_id: str) -> bytes | None:
        """The cached bytes of ``plan_id`` if they are intact, else None."""

    def put(self, plan_id: str, data: bytes) -> None:
        """Keep ``data``; a cache that cannot be written costs a later download, never a session."""

    # A cache may also ``discard(plan_id)``: the runtime calls it, where there is one, on a cached
    # plan it refused (for this device's memory, or this runtime's version), which stays no longer.


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


#: Plans a device keeps on disk: the tasks a population runs at once, and the plans of a few
#: earlier deploys. Without a bound, every plan a server ever sent stayed (a hostile server's new
#: plan per session, up to 1 GiB each, filled the phone's storage).
MAX_CACHED_PLANS = 8
#: And at most this many bytes of them (the plan just written is kept whatever its size): eight
#: plans of the 1 GiB a device downloads (``protocol.MAX_RESOURCE_BYTES``) were 8 GiB of a phone.
MAX_CACHED_PLAN_BYTES = 2 << 30
_PLAN_ID = re.compile(r"[0-9a-f]{64}")
#: A partial copy (``.<id>.<random>.tmp``) this old was left by a writer that was killed: removed.
STALE_PARTIAL_S = 3600.0


class DirectoryPlanCache:
    """Plans as files named by their id in ``root/plans`` (the app's cache directory): at most
    ``keep`` of them and ``max_bytes`` of theirs, those used last (a hit counts as a use). The
    files are 0600, and the folders it makes 0700."""

    def __init__(
        self, root: str | os.PathLike, *, keep: int = MAX_CACHED_PLANS, max_bytes: int = MAX_CACHED_PLAN_BYTES
    ) -> None:
        if keep < 1:
            raise ValueError("a plan cache keeps at least 1 plan")
        self.root = Path(root)
        self.keep = keep
        self.max_bytes = max_bytes

    def get(self, plan_id: str) -> bytes | None:
        path = self.root / "plans" / plan_id
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if _sha256(data) != plan_id:
            # a copy changed on disk (storage fault, a tool): dropped, so the download replaces it
            log.warning(
                "cached plan %s does not match its id (changed on disk); removed, downloading it again", plan_id
            )
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # used now: the last to go
        _own_folder(path.parent)  # an updated app may run its cached plan for weeks before another comes
        return data

    def put(self, plan_id: str, data: bytes) -> None:
        path = self.root / "plans" / plan_id
        if path.exists():
            return
        try:
            _private_folders(path.parent)
            _own_folder(path.parent)
            # a name of its own per writer: runtimes sharing the folder never write one partial copy
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{plan_id}.", suffix=".tmp")
            try:
                if fcntl is not None:  # held until renamed: a partial copy whose lock is free is a dead writer's
                    fcntl.flock(fd, fcntl.LOCK_EX)
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                    out.flush()
                    os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self._prune(keeping=plan_id)
        except OSError as exc:
            log.warning("could not cache plan %s: %s", plan_id, exc)

    def discard(self, plan_id: str) -> None:
        """Remove ``plan_id``'s copy (the runtime refused it); a copy that cannot be removed stays."""
        if _PLAN_ID.fullmatch(plan_id):
            with contextlib.suppress(OSError):
                (self.root / "plans" / plan_id).unlink()

    def _prune(self, *, keeping: str) -> None:
        """Remove the plans used longest ago past ``keep`` or ``max_bytes`` (never ``keeping``,
        just written), and the partial copies of writers killed mid-write: those whose writer's
        lock is free, and any older than ``STALE_PARTIAL_S``. By age alone, the partial copy (up to
        a plan's 1 GiB) of an app killed mid-download and started again within the hour stayed
        until another plan was written, which could be weeks."""
        plans = []
        total = 0
        stale = time.time() - STALE_PARTIAL_S
        for entry in os.scandir(self.root / "plans"):
            if _PLAN_ID.fullmatch(entry.name):
                with contextlib.suppress(OSError):
                    info = entry.stat()
                    if entry.name == keeping:
                        total += info.st_size
                    else:
                        plans.append((info.st_mtime_ns, info.st_size, entry.name))
            elif entry.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    if entry.stat().st_mtime < stale or _abandoned(entry):
                        os.unlink(entry.path)
        kept, full = 1, False
        for _, size, name in sorted(plans, reverse=True):  # used last first: once one is over, the rest go
            full = full or kept >= self.keep or total + size > self.max_bytes
            if not full:
                kept, total = kept + 1, total + size
                continue
            with contextlib.suppress(OSError):
                (self.root / "plans" / name).unlink()


def _own_folder(folder: Path) -> None:
    """Makes the ``plans`` folder, which an earlier version made 0755, its owner's only: listable by
    every user, it named the plans the device downloaded."""
    with contextlib.suppress(OSError):
        if (mode := stat.S_IMODE(folder.stat().st_mode)) & 0o077:
            os.chmod(folder, mode & 0o700)


def _private_folders(folder: Path) -> None:
    """Makes ``folder`` and its missing parents readable by their owner only (0700): their names
    are the ids of the plans the device downloaded, which say what tasks it took part in, and the
    folders were 0755 under the usual umask, listable by every user of the machine. A folder that
    exists is left as it is: the app chose it."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for made in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another runtime's writer made it meanwhile
            made.mkdir(mode=0o700)


def _abandoned(entry: os.DirEntry) -> bool:
    """Whether ``entry`` is a partial copy (``.<id>.<random>.tmp``) whose writer's lock is free:
    the writer's process ended before renaming it (a writer holds the lock until it renames)."""
    if fcntl is None or not (entry.name.startswith(".") and _PLAN_ID.fullmatch(entry.name[1:65])):
        return False
    fd = os.open(entry.path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # a live writer's
    finally:
        os.close(fd)
    return True


#: The temp folder's plan caches of runtimes given no ``cache_dir`` (``own_cache_folder``).
OWN_CACHE_PREFIX = "fl-plan-cache-"
#: Held locked (``flock``) by the process whose runtime owns the folder, for the runtime's life.
_OWNER_LOCK = ".owner.lock"


def own_cache_folder() -> tuple[str, Callable[[], None]]:
    """A plan cache folder in the temp folder for a runtime given no ``cache_dir``, and what
    removes it (at the runtime's ``close``, or when it is collected). The folder stays locked while
    its runtime lives; first, the folders of runtimes whose process was killed (SIGKILL, the OS
    ending an app: no ``close`` ran) are removed. Each such kill left its plans, up to
    ``MAX_CACHED_PLAN_BYTES``, in the temp folder for good."""
    root = tempfile.gettempdir()
    if fcntl is None:  # pragma: no cover - no lock to tell a live owner by
        path = tempfile.mkdtemp(prefix=OWN_CACHE_PREFIX)
        return path, lambda: shutil.rmtree(path, ignore_errors=True)
    _remove_orphans(root)
    # made and locked under another name, then renamed: a folder of the prefix is never unlocked
    # while its owner lives, so another process's sweep cannot take one being made
    making = tempfile.mkdtemp(prefix=f".{OWN_CACHE_PREFIX}new-")
    fd = os.open(os.path.join(making, _OWNER_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    path = os.path.join(root, OWN_CACHE_PREFIX + os.path.basename(making).rsplit("-", 1)[-1])
    try:
        os.rename(making, path)
    except OSError:
        os.close(fd)
        shutil.rmtree(making, ignore_errors=True)
        raise

    def remove() -> None:
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)

    return path, remove


def _remove_orphans(root: str) -> None:
    """Remove the own cache folders in ``root`` whose owner's lock is free (its process ended)."""
    assert fcntl is not None
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(OWN_CACHE_PREFIX):
            continue
        try:
            fd = os.open(os.path.join(entry.path, _OWNER_LOCK), os.O_RDWR)
        except OSError:  # no lock: not a folder this made (or one made before folders were locked)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its runtime lives
            os.close(fd)
            continue
        try:
            log.info("removing the plan cache %s of a runtime whose app was killed", entry.path)
            shutil.rmtree(entry.path, ignore_errors=True)
        finally:
            os.close(fd)


class MemoryPlanCache:
    """One device's cache in memory. The bytes of a plan are held once in ``shared`` (a dict
    that many devices' caches may share); each device remembers only which ids it downloaded,
    so each still downloads a plan the first time it meets it."""

    def __init__(self, shared: dict[str, bytes] | None = None) -> None:
        self._shared = shared if shared is not None else {}
        self._ids: set[str] = set()

    def get(self, plan_id: str) -> bytes | None:
        return self._shared.get(plan_id) if plan_id in self._ids else None

    def put(self, plan_id: str, data: bytes) -> None:
        if _sha256(data) != plan_id:
            return
        self._shared.setdefault(plan_id, data)
        self._ids.add(plan_id)

    def discard(self, plan_id: str) -> None:
        """This device no longer has ``plan_id``; the shared bytes are other devices' too and stay."""
        self._ids.discard(plan_id)


class LoadedPlans:
    """Plans parsed and ready to run, keyed by content id and runtime version (a plan is
    checked against the version that runs it). One per FLRuntime by default; a simulation shares
    one among all its devices, which then share each plan's onnxruntime sessions."""

    def __init__(self, *, keep: int | None = None) -> None:
        """``keep``: how many plans stay loaded, those used last (all when None: a simulation's
        are its operator's). A runtime's own keeps ``MAX_CACHED_PLANS``: each loaded plan holds
        its graphs and onnxruntime sessions in memory, and a hostile server's new plan per
        session grew the app's memory without end."""
        if keep is not None and keep < 1:
            raise ValueError("loaded plans keep at least 1 plan")
        self.keep = keep
        self._loaded: OrderedDict[tuple[str, str], tuple[Plan, PlanExecutor]] = OrderedDict()
        self._lock = threading.Lock()

    def load(
        self, plan_id: str, data: bytes, runtime_version: str, *, max_nodes: tuple[int, str] | None = None
    ) -> tuple[Plan, PlanExecutor]:
        """Raises CorruptResource when the plan is refused (malformed, or not for this version), and
        ``OverBudget`` when its graphs hold more nodes than ``max_nodes`` allows (``plan.nodes_bound``:
        a loaded plan is checked again for each device that asks, as the devices of a simulation
        that share their loaded plans have memories of their own)."""
        key = (plan_id, runtime_version)
        with self._lock:
            found = self._loaded.get(key)
            if found is not None:
                self._loaded.move_to_end(key)
        if found is not None:
            if max_nodes is not None and plan_nodes(found[0]) > max_nodes[0]:
                raise OverBudget(
                    f"plan {found[0].name!r} holds more than {max_nodes[0]:,} nodes in its graphs: {max_nodes[1]}"
                )
            return found
        try:
            plan = load_plan(data, runtime_version=runtime_version, max_nodes=max_nodes)
        except PlanError as exc:
            raise CorruptResource(f"plan {plan_id} was refused: {exc}") from exc
        loaded = (plan, PlanExecutor(plan))
        with self._lock:
            kept = self._loaded.setdefault(key, loaded)
            while self.keep is not None and len(self._loaded) > self.keep:
                self._loaded.popitem(last=False)
            return kept

    def forget(self, plan_id: str, runtime_version: str) -> None:
        """Unload ``plan_id`` for ``runtime_version`` (a runtime refused it: nothing of it stays)."""
        with self._lock:
            self._loaded.pop((plan_id, runtime_version), None)
