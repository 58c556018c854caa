"""The attestation trust anchor as a file: the public keys of the authorities whose device
certificates a server accepts. It holds no secret; the authority's private key stays with it."""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Mapping
from pathlib import Path

from device_runtime.attestation import PUBLIC_KEY_BYTES, authority_key_id

from .errors import unreadable

TRUST_FORMAT = "fedfleet-attestation-trust"


class TrustAnchorError(ValueError):
    """A trust anchor file that cannot be used; the message says what is wrong with it."""


def write_trust_anchor(path: str | os.PathLike[str], anchor: Mapping[bytes, bytes]) -> None:
    """Write ``{key_id: public_key}`` (as ``AttestationAuthority.trust_anchor()`` gives it)."""
    body = {
        "format": TRUST_FORMAT,
        "authorities": [
            {"key_id": base64.b64encode(k).decode(), "public_key": base64.b64encode(v).decode()}
            for k, v in anchor.items()
        ],
    }
    Path(path).write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")


def read_trust_anchor(path: str | os.PathLike[str]) -> dict[bytes, bytes]:
    """``{key_id: public_key}`` from a file written by :func:`write_trust_anchor`; every key id
    is checked against its public key."""
    where = os.fspath(path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise TrustAnchorError(f"cannot read the trust anchor {where!r}: {unreadable(exc)}") from None
    except (ValueError, RecursionError):  # an admin key file, say: the parser's words would not say what to give
        raise TrustAnchorError(
            f"{where!r} is not a trust anchor file (it is not JSON); give the trust anchor `fedfleet authority "
            "--trust FILE` wrote"
        ) from None
    if (
        not isinstance(data, dict)
        or data.get("format") != TRUST_FORMAT
        or not isinstance(data.get("authorities"), list)
    ):
        raise TrustAnchorError(
            f"{where!r} is not a trust anchor file (format {TRUST_FORMAT!r}); write one with `fedfleet authority`"
        )
    anchor: dict[bytes, bytes] = {}
    for item in data["authorities"]:
        try:
            key_id = base64.b64decode(item["key_id"], validate=True)
            public = base64.b64decode(item["public_key"], validate=True)
        except (KeyError, TypeError, binascii.Error, ValueError):
            raise TrustAnchorError(f"{where!r}: each authority needs base64 'key_id' and 'public_key'") from None
        if len(public) != PUBLIC_KEY_BYTES or authority_key_id(public) != key_id:
            raise TrustAnchorError(f"{where!r}: an authority's key id does not match its 32-byte public key")
        anchor[key_id] = public
    if not anchor:
        raise TrustAnchorError(f"{where!r} names no authority: no device could ever be admitted")
    return anchor
