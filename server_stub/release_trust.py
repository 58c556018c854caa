"""The release trust file: the public keys of the testers whose signed release reports a server
accepts (``fedfleet server --release-trust FILE``). It holds no secret; each tester's private key
stays with the tester (``fedfleet plan keygen`` makes the pair).

Format, one key per line, the way ``fedfleet plan keygen`` prints it (and writes it to
``KEY.pub``)::

    # blank lines and lines starting with '#' are skipped
    ed25519 mGq2Gd4GXbqbAeRWu6R1nJmFb2s8rKXfUz+oQk0rT8E= alice@model-team

that is ``ed25519``, the raw 32-byte Ed25519 public key in standard base64, then an optional label
that only people read. Removing a line and restarting the server revokes that key.
"""

from __future__ import annotations

import base64
import binascii
import os

from .errors import unreadable
from .release_gate import PUBLIC_KEY_BYTES, SIGNATURE_ALGORITHM

__all__ = ["ReleaseTrustError", "parse_release_trust", "read_release_trust", "trust_line"]

#: A trust file names a few keys; a bigger one is a wrong file.
MAX_TRUST_FILE_BYTES = 1 << 20


class ReleaseTrustError(ValueError):
    """A release trust file that cannot be used; the message says which line and why."""


def trust_line(public_key: bytes, label: str = "") -> str:
    """The line that makes a server trust ``public_key`` (raw 32 bytes)."""
    line = f"{SIGNATURE_ALGORITHM} {base64.b64encode(public_key).decode()}"
    return f"{line} {' '.join(label.split())}" if label.strip() else line


def parse_release_trust(text: str, where: str = "the release trust file") -> frozenset[bytes]:
    """The raw public keys of ``text`` (the format above); refuses a malformed line naming it, and
    a file that names no key (a server trusting nobody would refuse every report)."""
    keys = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split(maxsplit=2)
        public = None
        if len(fields) >= 2 and fields[0] == SIGNATURE_ALGORITHM:
            try:
                public = base64.b64decode(fields[1], validate=True)
            except (binascii.Error, ValueError):
                public = None
        if public is None or len(public) != PUBLIC_KEY_BYTES:
            raise ReleaseTrustError(
                f"{where}, line {number}: expected '{SIGNATURE_ALGORITHM} <base64 32-byte public key> [label]' as "
                "`fedfleet plan keygen` prints it"
            )
        keys.add(public)
    if not keys:
        raise ReleaseTrustError(
            f"{where} names no key: every release report would be refused; add the line "
            "`fedfleet plan keygen` printed for each tester you trust"
        )
    return frozenset(keys)


def read_release_trust(path: str | os.PathLike[str]) -> frozenset[bytes]:
    """The trusted keys of the file at ``path``."""
    where = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TRUST_FILE_BYTES + 1)
        if len(data) > MAX_TRUST_FILE_BYTES:
            raise ReleaseTrustError(f"{where!r} is over {MAX_TRUST_FILE_BYTES} bytes: not a release trust file")
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ReleaseTrustError(f"cannot read the release trust file {where!r}: {unreadable(exc)}") from None
    return parse_release_trust(text, repr(where))
