"""Operator authentication: admin bearer keys from a file or the environment.

Only SHA-256 digests of the keys are held, and a presented key is compared against each of them in
constant time, so the time a refusal takes says nothing about how much of a key was right."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

from .errors import unreadable

log = logging.getLogger(__name__)

#: The environment variable that may hold admin keys, separated by commas or whitespace.
ADMIN_KEYS_ENV = "FEDFLEET_ADMIN_KEYS"
#: Shorter keys are refused: an admin key must not be guessable.
MIN_KEY_CHARS = 16
#: Longer bearer tokens are refused by the HTTP layer before any comparison.
MAX_KEY_CHARS = 512


class AdminKeyError(ValueError):
    """An admin key file or variable that cannot be used; the message says how to fix it."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class AdminKeys:
    """The operator keys a server accepts. ``verify`` is constant-time per key."""

    def __init__(self, keys: Iterable[str]) -> None:
        digests = []
        for key in keys:
            key = key.strip()
            if not key:
                continue
            if (
                not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS
                or not key.isascii()
                or not key.isprintable()
                or " " in key
            ):
                raise AdminKeyError(
                    f"admin keys must be {MIN_KEY_CHARS}-{MAX_KEY_CHARS} printable ASCII characters without spaces; "
                    "make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
                )
            digests.append(_digest(key))
        if not digests:
            raise AdminKeyError("no admin key was given: an empty key file or variable would lock every operator out")
        self._digests = tuple(digests)

    def __len__(self) -> int:
        return len(self._digests)

    def replace_with(self, other: AdminKeys) -> None:
        """Accept ``other``'s keys from now on, instead of these (a key file read again): one
        assignment, so a request checked meanwhile sees the old keys or the new ones, never none."""
        self._digests = other._digests

    def verify(self, presented: str | None) -> bool:
        if not presented:
            return False
        digest = _digest(presented)
        ok = False
        for known in self._digests:  # no early exit: every key is compared
            ok |= hmac.compare_digest(digest, known)
        return ok

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> AdminKeys:
        """One key per line; blank lines and lines starting with ``#`` are skipped. A file other
        users may read or write is used, with a warning (as ssh warns of a private key's)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
            mode = os.stat(path).st_mode
        except (OSError, UnicodeDecodeError) as exc:
            raise AdminKeyError(f"cannot read the admin key file {os.fspath(path)!r}: {unreadable(exc)}") from None
        lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        keys = cls(lines)
        if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning(
                "the admin key file %s is open to other users (mode %s): run chmod 600 %s",
                os.fspath(path),
                oct(stat.S_IMODE(mode)),
                os.fspath(path),
            )
        return keys

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> AdminKeys | None:
        """The keys in ``FEDFLEET_ADMIN_KEYS``, or None when it is not set."""
        raw = (os.environ if environ is None else environ).get(ADMIN_KEYS_ENV)
        if raw is None:
            return None
        return cls(raw.replace(",", " ").split())

    @classmethod
    def generate(cls) -> tuple[AdminKeys, str]:
        """A fresh random key (for a test server or a first start): the keys and the key itself."""
        key = secrets.token_urlsafe(32)
        return cls([key]), key
