"""Where a sealed example store gets its key: a small key-store abstraction.

On a phone this is the Android Keystore (keys that never leave secure hardware); in the emulator
it is :class:`FileKeyStore` (one JSON file per device, mode 0600) or :class:`InMemoryKeyStore`
(tests). An app may plug in its own by subclassing :class:`KeyStore`.
"""

from __future__ import annotations

import abc
import base64
import binascii
import errno
import json
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path

from ._util import check_path
from .errors import KeyStoreError

#: Length of the keys the built-in key stores create (AES-256).
KEY_BYTES = 32
_VALID_KEY_LENGTHS = (16, 24, 32)
_FILE_VERSION = 1
#: What to do about a key store file that cannot be read.
_RESTORE = "restore it from a backup: without its keys the sealed example stores cannot be read"

try:  # POSIX advisory locks, so that two processes never create two keys for one alias
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


def check_alias(alias: object) -> str:
    if not isinstance(alias, str) or not alias or "\x00" in alias:
        raise KeyStoreError(f"a key alias must be a non-empty string such as 'example_store', got {alias!r}")
    return alias


def check_key(key: object, alias: str) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) not in _VALID_KEY_LENGTHS:
        got = f"{len(key)} bytes" if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise KeyStoreError(
            f"the key store returned an unusable key for alias {alias!r} ({got}); an AES key is 16, 24 or 32 bytes"
        )
    return bytes(key)


class KeyStore(abc.ABC):
    """Gives an app's secret keys by alias. Keys are random AES keys (16, 24 or 32 bytes)."""

    @abc.abstractmethod
    def get_or_create_key(self, alias: str) -> bytes:
        """The key under ``alias``, creating (and durably keeping) a random one if there is none."""

    def get_key(self, alias: str) -> bytes | None:
        """The key under ``alias``, or ``None`` if there is none. The default creates one (as
        :meth:`get_or_create_key`); override it so that opening a sealed store whose key was lost
        says so rather than reporting a wrong key."""
        return self.get_or_create_key(alias)


class InMemoryKeyStore(KeyStore):
    """Keys in a dict, gone with the process: for tests and for throw-away stores."""

    def __init__(self, keys: dict[str, bytes] | None = None) -> None:
        if keys is not None and not isinstance(keys, Mapping):  # failed with "has no attribute 'items'"
            raise KeyStoreError(f"InMemoryKeyStore takes a dict of alias -> key bytes or None, not {keys!r:.100}")
        self._lock = threading.Lock()
        self._keys = {check_alias(a): check_key(k, a) for a, k in (keys or {}).items()}

    def get_or_create_key(self, alias: str) -> bytes:
        check_alias(alias)
        with self._lock:
            return self._keys.setdefault(alias, secrets.token_bytes(KEY_BYTES))

    def get_key(self, alias: str) -> bytes | None:
        return self._keys.get(check_alias(alias))

    def delete_key(self, alias: str) -> bool:
        """Forgets the key (every store sealed with it becomes unreadable); True if it existed."""
        with self._lock:
            return self._keys.pop(check_alias(alias), None) is not None

    def aliases(self) -> list[str]:
        return sorted(self._keys)

    def __repr__(self) -> str:
        return f"InMemoryKeyStore(aliases={self.aliases()})"


class FileKeyStore(KeyStore):
    """Keys in one JSON file readable by its owner only (mode 0600), written atomically.

    Stands for the device's keystore in the emulator: the file is created on the first key, a
    file with group or world permissions is refused, and creating a key holds an exclusive lock
    on ``<path>.lock`` so that two processes cannot each create a different key for one alias."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(check_path("FileKeyStore's path", path))
        self._lock = threading.Lock()

    def get_or_create_key(self, alias: str) -> bytes:
        check_alias(alias)
        with self._lock, self._file_lock():
            keys = self._read()
            if alias not in keys:
                keys[alias] = secrets.token_bytes(KEY_BYTES)
                self._write(keys)
            return keys[alias]

    def get_key(self, alias: str) -> bytes | None:
        check_alias(alias)
        with self._lock:
            return self._read().get(alias)

    def delete_key(self, alias: str) -> bool:
        """Forgets the key (every store sealed with it becomes unreadable); True if it existed."""
        check_alias(alias)
        with self._lock, self._file_lock():
            keys = self._read()
            if keys.pop(alias, None) is None:
                return False
            self._write(keys)
            return True

    def aliases(self) -> list[str]:
        with self._lock:
            return sorted(self._read())

    # -- file handling -----------------------------------------------------------------------

    @contextmanager
    def _file_lock(self) -> Iterator[None]:
        if fcntl is None:  # pragma: no cover
            yield
            return
        try:
            fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise KeyStoreError(f"cannot lock the key store {self.path}: {exc}; does its directory exist?") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _read(self) -> dict[str, bytes]:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise KeyStoreError(f"cannot read the key store {self.path}: {exc}") from exc
        if stat.S_ISDIR(os.fstat(fd).st_mode):  # opened read-only on Linux; reading it fails without a name
            os.close(fd)
            raise KeyStoreError(f"the key store {self.path} is a folder; give the path of a file (made if missing)")
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if os.name == "posix" and mode & 0o077:
                raise KeyStoreError(
                    f"the key store {self.path} is readable by other users (mode {mode & 0o777:o}); its keys "
                    f"may have leaked. Restrict it with `chmod 600 {self.path}` if you trust it, or delete it "
                    f"(which makes every store sealed with its keys unreadable)"
                )
            data = f.read()
        try:
            doc = json.loads(data)
            version = doc.get("version")
        except (ValueError, AttributeError) as exc:
            raise KeyStoreError(f"the key store {self.path} is damaged ({exc}); {_RESTORE}") from exc
        if isinstance(version, int) and not isinstance(version, bool) and version > _FILE_VERSION:
            # a newer release's file is whole: said to be damaged, it was restored from a backup (or
            # deleted), and the keys of every store sealed since that backup were lost with it
            raise KeyStoreError(
                f"the key store {self.path} has format version {version}, written by a newer fedfleet version "
                f"(this one reads version {_FILE_VERSION}): open it with that version; it is left as it is"
            )
        try:
            if version != _FILE_VERSION:
                raise ValueError(f"unsupported version {version!r}")
            keys = {check_alias(a): base64.b64decode(k, validate=True) for a, k in doc["keys"].items()}
            for alias, key in keys.items():
                check_key(key, alias)
            return keys
        except (ValueError, KeyError, TypeError, AttributeError, binascii.Error, KeyStoreError) as exc:
            raise KeyStoreError(f"the key store {self.path} is damaged ({exc}); {_RESTORE}") from exc

    def _write(self, keys: dict[str, bytes]) -> None:
        """Under the file lock (``_file_lock``): written aside, then renamed over the key store."""
        self._remove_partial_copies()
        doc = {"version": _FILE_VERSION, "keys": {a: base64.b64encode(k).decode("ascii") for a, k in keys.items()}}
        tmp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                if hasattr(os, "fchmod"):
                    os.fchmod(fd, 0o600)  # whatever the umask
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(doc, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
                sync_folder(self.path.parent)  # the rename itself on disk: else a power cut may undo it
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise KeyStoreError(f"cannot write the key store {self.path}: {exc}; {_write_advice(exc)}") from exc

    def _remove_partial_copies(self) -> None:
        """Remove the copies that writers killed before their rename left beside the file: each held
        keys, a new one among them, in a file nobody removed. Every writer writes its copy under the
        file lock this one holds, so any copy found now is a dead writer's."""
        if fcntl is None:  # pragma: no cover - no lock: another writer may be writing its copy
            return
        partial = re.compile(rf"\.{re.escape(self.path.name)}\.[0-9a-f]{{8}}\.tmp")
        try:
            entries = list(os.scandir(self.path.parent))
        except OSError:
            return
        for entry in entries:
            if partial.fullmatch(entry.name):
                with suppress(OSError):
                    os.unlink(entry.path)

    def __repr__(self) -> str:
        return f"FileKeyStore({str(self.path)!r})"


def sync_folder(folder: str | os.PathLike[str]) -> None:
    """Flush ``folder``'s entries to disk (the rename of a file into it: else a power cut may undo
    it), where the platform can open a folder to sync it (not Windows); a file system that cannot
    sync a folder is passed. The key stores', the device's attestation key's and the server's
    backups' renames all go through it."""
    if not hasattr(os, "O_DIRECTORY"):  # pragma: no cover - Windows: renames are not synced this way
        return
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except PermissionError:  # a folder this app may write but not list (mode -wx): nothing to sync it by
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


#: A write that failed for want of space: a full disk, a quota, or the process's file size limit.
_NO_SPACE = frozenset(getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EFBIG") if hasattr(errno, name))


def _write_advice(exc: OSError) -> str:
    """What to do about a key store that could not be written: on a full disk it asked whether its
    directory existed, which sent the app looking in the wrong place."""
    if exc.errno in _NO_SPACE:
        return "the disk is full: free space and retry (the key store is unchanged)"
    return "does its directory exist, and may this app write to it?"
