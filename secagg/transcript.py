"""The byte strings both sides hash, sign and derive from: one definition, so that client and
server (and a client on another code base) agree on them exactly.

Every hash is SHA-256 over length-prefixed parts behind a domain tag (``crypto.sha256``), so no
value of one kind can be read as another.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from . import crypto
from .messages import DIRECTORY, KEY_ENTRY

_U32 = struct.Struct("<I")


def seed_commitment(seed: bytes) -> bytes:
    """What a server publishes before it knows its cohort; the seed it reveals must open it."""
    return crypto.sha256(b"secagg/seed-commitment", seed)


def key_signing_payload(session_tag: bytes, client_id: int, c_pk: bytes, s_pk: bytes) -> bytes:
    """What a client signs at AdvertiseKeys: its two keys, for this instance and this id only."""
    return crypto.sha256(b"secagg/advertise", session_tag, _U32.pack(client_id), c_pk, s_pk)


def entry_digests(entries: np.ndarray, credentials: list[bytes]) -> np.ndarray:
    """The directory of a roster: (id, 16-byte digest of the whole entry and credential)."""
    out = np.empty(len(entries), DIRECTORY)
    out["id"] = entries["id"]
    raw = np.ascontiguousarray(entries).view(np.uint8).reshape(len(entries), KEY_ENTRY.itemsize)
    out["digest"] = [
        np.void(crypto.sha256(b"secagg/entry", raw[i].tobytes(), cred)[:16]) for i, cred in enumerate(credentials)
    ]
    return np.sort(out, order="id")


def roster_session_id(session_tag: bytes, seed: bytes, directory: np.ndarray) -> bytes:
    """Session id = H(tag, revealed seed, directory of U1 sorted by id): binds every advertised
    key and the graph's seed to the instance; every share key and signature uses it."""
    return crypto.sha256(b"secagg/sid", session_tag, seed, np.sort(directory, order="id").tobytes())


def graph_key(session_id: bytes) -> bytes:
    """AES key of the SecAgg+ ring order (``graphs.keyed_ring``): a function of the seed and of
    every advertised entry, through the session id."""
    return crypto.sha256(b"secagg/graph", session_id)


def consistency_payload(session_id: bytes, survivors: np.ndarray) -> bytes:
    return b"secagg/consistency" + session_id + np.sort(np.asarray(survivors, dtype="<u4")).tobytes()


def masked_input_payload(session_id: bytes, sender: int, words: bytes) -> bytes:
    return crypto.sha256(b"secagg/masked-input", session_id, _U32.pack(sender), words)


def share_check_payload(session_id: bytes, sender: int, complaints: np.ndarray) -> bytes:
    return crypto.sha256(
        b"secagg/share-check", session_id, _U32.pack(sender), np.sort(np.asarray(complaints, dtype="<u4")).tobytes()
    )


def unmask_payload(session_id: bytes, sender: int, reveals: np.ndarray) -> bytes:
    return crypto.sha256(b"secagg/unmask", session_id, _U32.pack(sender), np.ascontiguousarray(reveals).tobytes())


_SHARE_DIGEST = struct.Struct("<IIB")


def share_digest(session_id: bytes, dealer: int, holder: int, kind: int, limbs: np.ndarray) -> bytes:
    """16-byte digest of one half of a share pair (kind: KIND_B or KIND_S), sent by the dealer
    to the server at ShareKeys so that a holder revealing a wrong share is caught and its share
    dropped: SHA-256("secagg/share-digest" | session id | dealer, holder (u32) | kind (u8) |
    limbs (u32 each))[:16]. A share is 279 uniformly random bits: its digest reveals nothing."""
    return hashlib.sha256(
        share_digest_prefix(session_id, dealer, holder, kind) + np.asarray(limbs, dtype="<u4").tobytes()
    ).digest()[:16]


def share_digest_prefix(session_id: bytes, dealer: int, holder: int, kind: int) -> bytes:
    return b"secagg/share-digest" + session_id + _SHARE_DIGEST.pack(dealer, holder, kind)
