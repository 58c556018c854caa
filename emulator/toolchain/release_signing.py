"""The tester's signing key: ``fedfleet plan test --signing-key KEY`` signs each release report so
a server can tell a report the tests wrote from one a person wrote or edited
(``server_stub.release_gate``). The key is Ed25519, as device attestation uses.

``fedfleet plan keygen --key KEY`` writes the private key to ``KEY`` (JSON, mode 0600) and the
line a server's ``--release-trust`` file takes to ``KEY.pub`` (``server_stub.release_trust``).
The signature covers the whole report but its ``signature`` (plan hashes, claimed releases, every
result and measurement), as canonical JSON, so changing any of it after signing voids it.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from server_stub.release_gate import SIGNATURE_ALGORITHM, signing_payload
from server_stub.release_trust import trust_line

__all__ = [
    "KEY_FORMAT",
    "SigningKeyError",
    "generate_signing_key",
    "load_signing_key",
    "public_key_bytes",
    "public_key_path",
    "sign_report",
]

KEY_FORMAT = "fedfleet-release-signing-key"


class SigningKeyError(ValueError):
    """A signing key file that cannot be made or read; the message says what to do."""


def public_key_bytes(key: Ed25519PrivateKey) -> bytes:
    """The raw 32-byte public key a server trusts."""
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def public_key_path(path: str | os.PathLike[str]) -> Path:
    """Where the trust line of the key at ``path`` goes: ``KEY.pub``."""
    path = Path(path)
    return path.with_name(path.name + ".pub")


def sign_report(report: Mapping[str, Any], key: Ed25519PrivateKey) -> dict[str, Any]:
    """``report`` with its ``signature``: an Ed25519 signature by ``key`` of
    ``release_gate.signing_payload`` (any signature it had is replaced)."""
    try:
        payload = signing_payload(report)
    except ValueError as exc:  # a non-finite number: no server could parse the report either
        raise SigningKeyError(f"the release report cannot be signed: {exc}") from None
    body = {k: v for k, v in report.items() if k != "signature"}
    body["signature"] = {
        "algorithm": SIGNATURE_ALGORITHM,
        "public_key": base64.b64encode(public_key_bytes(key)).decode(),
        "value": base64.b64encode(key.sign(payload)).decode(),
    }
    return body


def generate_signing_key(path: str | os.PathLike[str], *, label: str = "", force: bool = False) -> Ed25519PrivateKey:
    """A new key: the private key to ``path`` (mode 0600; an existing file is kept unless
    ``force``; its folder must exist) and its trust line to ``KEY.pub``."""
    path = Path(path)
    if path.exists() and not force:
        raise SigningKeyError(
            f"{path} already exists; servers may trust it. Name a new file, or pass --force to "
            "replace it (reports signed with the old key stop being accepted where only it is trusted)"
        )
    if not path.parent.is_dir():  # as `fedfleet authority`: a mistyped folder is said, not made
        raise SigningKeyError(
            f"cannot write the signing key {path}: there is no folder {path.parent}; make it first "
            f"(mkdir -p {path.parent}) or name a file in a folder that exists"
        )
    key = Ed25519PrivateKey.generate()
    body = json.dumps(
        {
            "format": KEY_FORMAT,
            "private_key": base64.b64encode(
                key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
            ).decode(),
        }
    ).encode("utf-8")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        public_key_path(path).write_text(trust_line(public_key_bytes(key), label) + "\n", encoding="utf-8")
    except OSError as exc:
        raise SigningKeyError(
            f"cannot write the signing key {path} ({exc.strerror or exc}); name a file in a folder that can be written"
        ) from None
    return key


def load_signing_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """The key ``generate_signing_key`` wrote to ``path``."""
    not_a_key = f"{path} is not a release signing key; make one with `fedfleet plan keygen --key FILE`"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SigningKeyError(f"no signing key at {path}; make one with `fedfleet plan keygen --key {path}`") from None
    except IsADirectoryError:
        raise SigningKeyError(f"{path} is a folder; give the key file `fedfleet plan keygen` wrote") from None
    except UnicodeDecodeError:
        raise SigningKeyError(not_a_key) from None
    except OSError as exc:
        raise SigningKeyError(f"cannot read the signing key {path}: {exc.strerror or exc}") from None
    if text.startswith("ed25519 "):  # the KEY.pub line beside it: the half a server trusts
        private = str(path).removesuffix(".pub")
        raise SigningKeyError(
            f"{path} is a public key (the line a server trusts); sign with the private key beside it, such as {private}"
        )
    try:
        data = json.loads(text)
    except ValueError:
        raise SigningKeyError(not_a_key) from None
    raw = None
    if isinstance(data, dict) and data.get("format") == KEY_FORMAT and isinstance(data.get("private_key"), str):
        try:
            raw = base64.b64decode(data["private_key"], validate=True)
        except (binascii.Error, ValueError):
            raw = None
    if raw is None or len(raw) != 32:
        raise SigningKeyError(not_a_key)
    return Ed25519PrivateKey.from_private_bytes(raw)
