"""Wire messages: typed dataclasses <-> compact binary, parsed with strict validation.

Layout: header ``b"SA" | version u8 | kind u8 | session tag (16 bytes)`` then a body whose
length is fully determined by the kind and the counts it declares; any other length, an
unknown kind or version, or out-of-range ids raise ``MessageFormatError``. Repeated records
are fixed-size numpy structured arrays, so parsing n records costs one ``frombuffer``.
Semantic checks (duplicates, subsets, thresholds) are the state machines' job, so that they
can refuse with a specific reason.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .crypto import GCM_TAG, KEY_BYTES, SIG_BYTES
from .errors import MessageFormatError
from .shamir import LIMBS

VERSION = 3
MAX_CREDENTIAL = 1024  # a device certificate is ~220 bytes
_HEADER = struct.Struct("<2sBB16s")
_COUNT = struct.Struct("<I")
SHARE_PLAINTEXT = 2 * LIMBS * 4  # s_sk share limbs then b share limbs, uint32 each
SHARE_CIPHERTEXT = SHARE_PLAINTEXT + GCM_TAG

KEY_ENTRY = np.dtype(
    [("id", "<u4"), ("c_pk", "V32"), ("s_pk", "V32"), ("sig_pk", "V32"), ("key_sig", "V64"), ("cred_len", "<u2")]
)
DIRECTORY = np.dtype([("id", "<u4"), ("digest", "V16")])  # every advertised entry of U1, by digest
SHARE_DIGEST = np.dtype([("holder", "<u4"), ("s", "V16"), ("b", "V16")])
ADDRESSED_CT = np.dtype([("peer", "<u4"), ("ct", f"V{SHARE_CIPHERTEXT}")])
#: a share pair as its holder receives it: sender, ciphertext, and the sender's digests of the two
#: shares in it (so that the holder can tell a wrong share from a right one before anyone masks)
ROUTED_CT = np.dtype([("peer", "<u4"), ("ct", f"V{SHARE_CIPHERTEXT}"), ("s", "V16"), ("b", "V16")])
SIGNED = np.dtype([("id", "<u4"), ("sig", "V64")])
SHARE_REVEAL = np.dtype([("peer", "<u4"), ("kind", "<u4"), ("limbs", "<u4", (LIMBS,))])
KIND_B, KIND_S = 0, 1


def _records(body: memoryview | bytes, offset: int, dtype: np.dtype, what: str) -> tuple[np.ndarray, int]:
    if len(body) < offset + 4:
        raise MessageFormatError(f"{what}: truncated count")
    (count,) = _COUNT.unpack_from(body, offset)
    offset += 4
    end = offset + count * dtype.itemsize
    if end > len(body):
        raise MessageFormatError(f"{what}: {count} records do not fit")
    arr = np.frombuffer(body, dtype=dtype, count=count, offset=offset)
    return arr, end


def _check_ids(ids: np.ndarray, what: str) -> None:
    if ids.size and (ids.min() == 0 or ids.max() >= (1 << 31) - 1):
        raise MessageFormatError(f"{what}: client id out of range")


def _pack_records(arr: np.ndarray) -> bytes:
    return _COUNT.pack(len(arr)) + arr.tobytes()


@dataclass(eq=False)
class Message:
    """Base: every message carries the session tag of the instance it belongs to."""

    KIND: ClassVar[int] = 0
    session_tag: bytes

    def body(self) -> bytes:  # pragma: no cover - overridden
        raise NotImplementedError

    def to_bytes(self) -> bytes:
        return _HEADER.pack(b"SA", VERSION, self.KIND, self.session_tag) + self.body()

    @classmethod
    def parse_body(cls, tag: bytes, body: memoryview) -> Message:  # pragma: no cover
        raise NotImplementedError


@dataclass(eq=False)
class AdvertiseKeys(Message):
    """Round 0, client -> server: the two X25519 public keys, the Ed25519 key that signs them
    (the attested device key, or one made for this instance), that signature over
    (session tag, client id, c_pk, s_pk), and the credential (certificate) of the signing key."""

    KIND: ClassVar[int] = 1
    c_pk: bytes = b""
    s_pk: bytes = b""
    sig_pk: bytes = bytes(KEY_BYTES)
    key_sig: bytes = bytes(SIG_BYTES)
    credential: bytes = b""

    def body(self) -> bytes:
        return (
            self.c_pk
            + self.s_pk
            + self.sig_pk
            + self.key_sig
            + struct.pack("<H", len(self.credential))
            + self.credential
        )

    @classmethod
    def parse_body(cls, tag: bytes, body: memoryview) -> AdvertiseKeys:
        fixed = 3 * KEY_BYTES + SIG_BYTES + 2
        if len(body) < fixed:
            raise MessageFormatError("AdvertiseKeys: wrong length")
        b = bytes(body)
        (cred_len,) = struct.unpack_from("<H", b, fixed - 2)
        if cred_len > MAX_CREDENTIAL or len(b) != fixed + cred_len:
            raise MessageFormatError("AdvertiseKeys: wrong length")
        return cls(tag, b[:32], b[32:64], b[64:96], b[96:160], b[fixed:])


@dataclass(eq=False)
class KeyRoster(Message):
    """Start of ShareKeys, server -> client: the session id, the revealed graph seed, the
    advertised keys of the client's neighbours (all of U1 for the complete graph), the client's
    own entry included, their credentials (concatenated, ``cred_len`` each), and under SecAgg+
    the directory of all of U1 (id, entry digest) from which the client recomputes the graph."""

    KIND: ClassVar[int] = 2
    session_id: bytes = b""
    entries: np.ndarray = field(default_factory=lambda: np.empty(0, KEY_ENTRY))
    seed: bytes = bytes(32)
    credentials: bytes = b""
    directory: np.ndarray = field(default_factory=lambda: np.empty(0, DIRECTORY))

    def body(self) -> bytes:
        return (
            self.session_id
            + self.seed
            + _pack_records(self.entries)
            + _COUNT.pack(len(self.credentials))
            + self.credentials
            + _pack_records(self.directory)
        )

    @classmethod
    def parse_body(cls, tag: bytes, body: memoryview) -> KeyRoster:
        if len(body) < 64:
            raise MessageFormatError("KeyRoster: truncated")
        entries, end = _records(body, 64, KEY_ENTRY, "KeyRoster")
        blob, end = _records(body, end, np.dtype("u1"), "KeyRoster credentials")
        directory, end = _records(body, end, DIRECTORY, "KeyRoster directory")
        if end != len(body):
            raise MessageFormatError("KeyRoster: trailing bytes")
        if int(entries["cred_len"].sum(dtype=np.int64)) != len(blob) or (
            entries.size and entries["cred_len"].max() > MAX_CREDENTIAL
        ):
            raise MessageFormatError("KeyRoster: credential lengths do not add up")
        _check_ids(entries["id"], "KeyRoster")
        _check_ids(directory["id"], "KeyRoster")
        return cls(tag, bytes(body[:32]), entries, bytes(body[32:64]), blob.tobytes(), directory)

    def credential_list(self) -> list[bytes]:
        ends = np.cumsum(self.entries["cred_len"].astype(np.int64))
        return [self.credentials[e - n : e] for e, n in zip(ends.tolist(), self.entries["cred_len"].tolist())]


@dataclass(eq=False)
class EncryptedShares(Message):
    """ShareKeys, client -> server: one AES-GCM share pair per neighbour (``peer`` = receiver)."""

    KIND: ClassVar[int] = 3
    shares: np.ndarray = field(default_factory=lambda: np.empty(0, ADDRESSED_CT))
    digests: np.ndarray = field(default_factory=lambda: np.empty(0, SHARE_DIGEST))

    def body(self) -> bytes:
        return _pack_records(self.shares) + _pack_records(self.digests)

    @classmethod
    def parse_body(cls, tag: bytes, body: memoryview) -> EncryptedShares:
        shares, end = _records(body, 0, ADDRESSED_CT, "EncryptedShares")
        digests, end = _records(body, end, SHARE_DIGEST, "EncryptedShares digests")
        if end != len(body):
            raise MessageFormatError("EncryptedShares: trailing bytes")
        _check_ids(shares["peer"], "EncryptedShares")
        _check_ids(digests["holder"], "EncryptedShares")
        return cls(tag, shares, digests)


@dataclass(eq=False)
class SharesForYou(Message):
    """Start of ShareCheck, server -> client: the share pairs addressed to the client
    (``peer`` = sender), each with its sender's digests of the two shares. Their senders are
    the client's view of U2."""

    KIND: ClassVar[int] = 4
    shares: np.ndarray = field(default_factory=lambda: np.empty(0, ROUTED_CT))

    def body(self) -> bytes:
        return _pack_records(self.shares)

    @classmethod
    def parse_body(cls, tag: bytes, body: memoryview) -> SharesForYou:
        shares, end = _records(body, 0, ROUTED_CT, "SharesForYou")
        if end != len(body):
            raise MessageFormatError("SharesForYou: trailing bytes")
        _check_ids(shares["peer"], "SharesForYou")
        return cls(tag, shares)


@dataclass(eq=False)
class MaskedInput(Message):
    """MaskedInputCollection, client -> server: y = x + PRG(b) + sum of +/- pairwise masks mod R,
    and the sender's signature over (session id, sender, y), so a masked input replayed from
    another session or altered on the way is refused. ``words`` is uint32 (R <= 2^32) or
    uint64; the receiver checks the length and dtype."""

    KIND: ClassVar[int] = 5
    words: bytes = b""
    signature: bytes = bytes(SIG_BYTES)

    def body(self) -> bytes:
        return self.words + self.signature

    @classmethod
    def parse_body(cls, tag: bytes, body: memoryview) -> MaskedInput:
        if len(body) < SIG_BYTES:
            raise MessageFormatError("MaskedInput: truncated")
        return cls(tag, bytes(body[:-SIG_BYTES]), bytes(body[-SIG_BYTES:]))


@dataclass(eq=False)
class ConsistencyRequest(Message):
    """ConsistencyCheck, server -> client: U3, the clients whose masked input arrived."""

    KIND: ClassVar[int] = 6
    survivors: np.ndarray = field(default_factory=lambda: np.empty(0, "<u4"))

    def body(self) -> bytes:
        return _pack_records(np.asarray(self.survivors, dtype="<u4"))

    @classmethod
    def parse_body(cls, tag: bytes, body: memoryview) -> ConsistencyRequest:
        ids, end = _records(body, 0, np.dtype("<u4"), "ConsistencyRequest")
        if end != len(body):
            raise MessageFormatError("ConsistencyRequest: trailing bytes")
        _check_ids(ids, "ConsistencyRequest")
        return cls(tag, ids)


@dataclass(eq=False)
class ConsistencySignature(Message):
    """ConsistencyCheck, client -> server: Ed25519 signature over (session id, U3)."""

    KIND: ClassVar[int] = 7
    signature: bytes = b""

    def body(self) -> bytes:
        return self.signature

    @classmethod
    def parse_body(cls, tag: bytes, body: memoryview) -> ConsistencySignature:
        if len(body) != SIG_BYTES:
            raise MessageFormatError("ConsistencySignature: wrong length")
        return cls(tag, bytes(body))


@dataclass(eq=False)
class UnmaskRequest(Message):
    """Start of Unmasking, server -> client: U3 (restricted to the client's neighbourhood) and,
    with ConsistencyCheck, the signatures of U4 over U3."""

    KIND: ClassVar[int] = 8
    survivors: np.ndarray = field(default_factory=lambda: np.empty(0, "<u4"))
    signatures: np.ndarray = field(default_factory=lambda: np.empty(0, SIGNED))

    def body(self) -> bytes:
        return _pack_records(np.asarray(self.survivors, dtype="<u4")) + _pack_records(self.signatures)

    @classmethod
    def parse_body(cls, tag: bytes, body: memoryview) -> UnmaskRequest:
        ids, end = _records(body, 0, np.dtype("<u4"), "UnmaskRequest")
        sigs, end = _records(body, end, SIGNED, "UnmaskRequest")
        if end != len(body):
            raise MessageFormatError("UnmaskRequest: trailing bytes")
        _check_ids(ids, "UnmaskRequest")
        _check_ids(sigs["id"], "UnmaskRequest")
        return cls(tag, ids, sigs)


@dataclass(eq=False)
class UnmaskResponse(Message):
    """Unmasking, client -> server: for each peer one share, of b (peer in U3) or of s_sk
    (peer in U2 minus U3), never both; signed by the sender over (session id, sender, reveals)."""

    KIND: ClassVar[int] = 9
    reveals: np.ndarray = field(default_factory=lambda: np.empty(0, SHARE_REVEAL))
    signature: bytes = bytes(SIG_BYTES)

    def body(self) -> bytes:
        return _pack_records(self.reveals) + self.signature

    @classmethod
    def parse_body(cls, tag: bytes, body: memoryview) -> UnmaskResponse:
        reveals, end = _records(body, 0, SHARE_REVEAL, "UnmaskResponse")
        if end + SIG_BYTES != len(body):
            raise MessageFormatError("UnmaskResponse: wrong length")
        _check_ids(reveals["peer"], "UnmaskResponse")
        if reveals.size and (reveals["kind"].max() > 1 or reveals["limbs"].max() >= (1 << 31) - 1):
            raise MessageFormatError("UnmaskResponse: bad share kind or value")
        return cls(tag, reveals, bytes(body[end:]))


@dataclass(eq=False)
class ShareCheck(Message):
    """ShareCheck, client -> server: the senders whose share pair the client could not use (it
    does not decrypt, holds a value outside the field, or differs from its sender's digest),
    signed over (session id, sender, those ids). The server leaves out of the masking set every
    sender that fewer than t holders could use, before anyone masks (``server``)."""

    KIND: ClassVar[int] = 10
    complaints: np.ndarray = field(default_factory=lambda: np.empty(0, "<u4"))
    signature: bytes = bytes(SIG_BYTES)

    def body(self) -> bytes:
        return _pack_records(np.asarray(self.complaints, dtype="<u4")) + self.signature

    @classmethod
    def parse_body(cls, tag: bytes, body: memoryview) -> ShareCheck:
        ids, end = _records(body, 0, np.dtype("<u4"), "ShareCheck")
        if end + SIG_BYTES != len(body):
            raise MessageFormatError("ShareCheck: wrong length")
        _check_ids(ids, "ShareCheck")
        return cls(tag, ids, bytes(body[end:]))


@dataclass(eq=False)
class MaskRequest(Message):
    """Start of MaskedInputCollection, server -> client: the senders left out of the masking set
    (too few holders could use their shares); the client masks over the others only."""

    KIND: ClassVar[int] = 11
    excluded: np.ndarray = field(default_factory=lambda: np.empty(0, "<u4"))

    def body(self) -> bytes:
        return _pack_records(np.asarray(self.excluded, dtype="<u4"))

    @classmethod
    def parse_body(cls, tag: bytes, body: memoryview) -> MaskRequest:
        ids, end = _records(body, 0, np.dtype("<u4"), "MaskRequest")
        if end != len(body):
            raise MessageFormatError("MaskRequest: trailing bytes")
        _check_ids(ids, "MaskRequest")
        return cls(tag, ids)


MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.KIND: cls
    for cls in (
        AdvertiseKeys,
        KeyRoster,
        EncryptedShares,
        SharesForYou,
        MaskedInput,
        ConsistencyRequest,
        ConsistencySignature,
        UnmaskRequest,
        UnmaskResponse,
        ShareCheck,
        MaskRequest,
    )
}


def parse_message(data: bytes | bytearray | memoryview) -> Message:
    """Bytes -> the typed message; ``MessageFormatError`` for anything malformed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MessageFormatError("message must be bytes")
    view = memoryview(data).cast("B")
    if len(view) < _HEADER.size:
        raise MessageFormatError("message shorter than its header")
    magic, version, kind, tag = _HEADER.unpack_from(view, 0)
    if magic != b"SA":
        raise MessageFormatError("bad magic")
    if version != VERSION:
        raise MessageFormatError(f"unsupported version {version}")
    cls = MESSAGE_TYPES.get(kind)
    if cls is None:
        raise MessageFormatError(f"unknown message kind {kind}")
    return cls.parse_body(tag, view[_HEADER.size :])
