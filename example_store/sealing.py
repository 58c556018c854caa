"""Sealing an SQLite example store's rows at rest: AES-256-GCM under a key derived (HKDF) from the
app's key and the database's random salt. A sealed payload is ``nonce (12 random bytes) ||
ciphertext || tag (16)``; its associated data binds the row id, the timestamp, the collection id,
URI and schema (``Collection.ad_prefix``), so a flipped byte, a row moved to another collection, an
edited timestamp or schema all fail authentication (``TamperedExampleError``)."""

from __future__ import annotations

import base64
import hashlib
import os
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .codec import Schema
from .errors import TamperedExampleError

#: The sealing modes recorded in ``store_meta``.
SEALING_NONE = "none"
SEALING_AES_GCM = "aes-256-gcm"
NONCE_BYTES = 12
TAG_BYTES = 16

_ROW_AD = struct.Struct("<qd")  # row id, timestamp
_AD_DOMAIN = b"fedfleet example_store v2 row\x00"


@dataclass(frozen=True)
class Collection:
    id: int
    uri: str
    schema: Schema
    ad_prefix: bytes  # associated data shared by the collection's sealed rows
    schema_text: str = ""  # as the database keeps it


def collection_record(coll_id: int, uri: str, schema_text: str) -> Collection:
    digest = hashlib.sha256(
        _AD_DOMAIN + struct.pack("<q", coll_id) + uri.encode("utf-8") + b"\x00" + schema_text.encode("utf-8")
    ).digest()
    return Collection(coll_id, uri, Schema.from_json(schema_text), digest, schema_text)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _hkdf(key: bytes, salt: bytes, purpose: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=b"fedfleet example_store v2 " + purpose).derive(
        key
    )


class RowSealer:
    """AES-GCM sealing of payload rows under the database's data key."""

    _CHECK_PLAINTEXT = b"fedfleet example store key check"

    def __init__(self, app_key: bytes, salt: bytes) -> None:
        self._aead = AESGCM(_hkdf(app_key, salt, b"payload sealing"))
        self._check_ad = b"key-check\x00" + salt
        self.token_key = _hkdf(app_key, salt, b"resumption tokens")

    def key_check(self) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, self._CHECK_PLAINTEXT, self._check_ad)

    def verify_key_check(self, blob: bytes) -> bool:
        try:
            return self._aead.decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], self._check_ad) == self._CHECK_PLAINTEXT
        except (InvalidTag, ValueError):
            return False

    def seal(self, coll: Collection, first_id: int, timestamps: list[float], payload: bytes) -> list[bytes]:
        size = coll.schema.record_size
        n = len(timestamps)
        nonces = os.urandom(NONCE_BYTES * n)
        encrypt, pack, prefix = self._aead.encrypt, _ROW_AD.pack, coll.ad_prefix
        sealed: list[bytes] = []
        append = sealed.append
        for i in range(n):
            nonce = nonces[NONCE_BYTES * i : NONCE_BYTES * (i + 1)]
            append(
                nonce + encrypt(nonce, payload[size * i : size * (i + 1)], prefix + pack(first_id + i, timestamps[i]))
            )
        return sealed

    def open(self, coll: Collection, rows: list[tuple[bytes, int, float]], path: str) -> bytes:
        """The plaintext payloads of rows (sealed payload, id, timestamp), back to back."""
        decrypt, pack, prefix = self._aead.decrypt, _ROW_AD.pack, coll.ad_prefix
        out: list[bytes] = []
        append = out.append
        row_id = None
        try:
            for blob, row_id, ts in rows:
                append(decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], prefix + pack(row_id, ts)))
        except (InvalidTag, ValueError, TypeError, struct.error):
            raise TamperedExampleError(
                f"example {row_id} of collection {coll.uri!r} in {path} failed authentication: its payload, "
                f"nonce, timestamp or collection (or the collection's schema) was altered on disk, or the row "
                f"was moved from another collection. Nothing was returned from it; delete the collection "
                f"(store.delete_collection({coll.uri!r})) or the file to start afresh",
                collection_uri=coll.uri,
                row_id=row_id,
            ) from None
        return b"".join(out)
