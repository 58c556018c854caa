"""Checkpoints: named tensors in a self-describing binary format that is safe to load from an
untrusted peer (no pickle, whitelisted dtypes, every size checked before any allocation)."""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import re
import struct
from collections.abc import Mapping

import numpy as np

MAGIC = b"FLCKPT1\n"
_HEADER_LEN = struct.Struct("<I")
_DIGEST_LEN = 32
MAX_HEADER_BYTES = 1 << 20
MAX_TENSORS = 4096
#: Bracket nesting a header may have; encode_checkpoint writes _WRITTEN_DEPTH ({"tensors": [{"shape": [...]}]}).
MAX_HEADER_DEPTH = 8
_WRITTEN_DEPTH = 4
ALLOWED_DTYPES = frozenset(
    {"float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"}
)


class CheckpointError(ValueError):
    """A checkpoint is malformed, truncated, tampered with or holds what it may not."""


def encode_checkpoint(tensors: Mapping[str, np.ndarray]) -> bytes:
    """Serialize named tensors (little-endian, C order) with a SHA-256 over header and data."""
    layout = []
    blobs = []
    seen: set[str] = set()
    for name, value in tensors.items():
        if str(name) in seen:
            raise CheckpointError(f"tensor name {str(name)!r} is repeated")
        seen.add(str(name))
        arr = np.asarray(value)
        dtype_name = _dtype_name(arr.dtype)
        if dtype_name not in ALLOWED_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {dtype_name}, which checkpoints do not carry")
        data = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
        layout.append((str(name), dtype_name, arr.shape, len(data)))
        blobs.append(data)
    header = _header(tuple(layout))
    digest = hashlib.sha256(header)
    for blob in blobs:
        digest.update(blob)
    return b"".join([MAGIC, _HEADER_LEN.pack(len(header)), header, digest.digest(), *blobs])


@functools.lru_cache(maxsize=64)
def _dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, which numpy works out in Python on every read (a third of encoding an update)."""
    return dtype.name


@functools.lru_cache(maxsize=64)
def _header(layout: tuple[tuple[str, str, tuple[int, ...], int], ...]) -> bytes:
    """The header of tensors laid out as (name, dtype name, shape, bytes), one after another:
    the same for every update of a plan, so written once."""
    entries = []
    offset = 0
    for name, dtype_name, shape, nbytes in layout:
        entries.append({"name": name, "dtype": dtype_name, "shape": list(shape), "offset": offset, "nbytes": nbytes})
        offset += nbytes
    return json.dumps({"tensors": entries}, separators=(",", ":")).encode()


def decode_checkpoint(data: bytes, *, max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """Parse and verify a checkpoint; returns read-only arrays that view ``data``."""
    view = memoryview(data)
    if max_bytes is not None and len(view) > max_bytes:
        raise CheckpointError(f"checkpoint is {len(view)} bytes, more than the limit of {max_bytes}")
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise CheckpointError(
            "not a checkpoint: the magic bytes are missing (was this file written by encode_checkpoint?)"
        )
    pos = len(MAGIC)
    if len(view) < pos + _HEADER_LEN.size:
        raise CheckpointError("checkpoint is truncated before its header length")
    (header_len,) = _HEADER_LEN.unpack_from(view, pos)
    pos += _HEADER_LEN.size
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(f"checkpoint header claims {header_len} bytes, more than {MAX_HEADER_BYTES}")
    if len(view) < pos + header_len + _DIGEST_LEN:
        raise CheckpointError("checkpoint is truncated inside its header")
    header_bytes = bytes(view[pos : pos + header_len])
    pos += header_len
    digest = bytes(view[pos : pos + _DIGEST_LEN])
    pos += _DIGEST_LEN
    body = view[pos:]
    check = hashlib.sha256(header_bytes)
    check.update(body)
    if check.digest() != digest:
        raise CheckpointError("checkpoint checksum mismatch: the data is corrupt or was altered")
    out: dict[str, np.ndarray] = {}
    for name, dtype_name, dtype, shape, count, offset, nbytes in _layout(header_bytes):
        if offset + nbytes > len(body):
            raise CheckpointError(f"tensor {name!r} does not fit its declared shape, dtype and place in the data")
        arr = np.frombuffer(body, dtype=dtype, count=count, offset=offset).reshape(shape)
        if dtype_name == "bool" and count and np.frombuffer(body, dtype=np.uint8, count=count, offset=offset).max() > 1:
            raise CheckpointError(f"tensor {name!r} is bool but holds bytes other than 0 and 1")
        out[name] = arr.astype(dtype.newbyteorder("="), copy=False)
    return out


#: (name, dtype name, dtype, shape, element count, offset, bytes) of each tensor a header declares.
_Layout = tuple[tuple[str, str, np.dtype, tuple[int, ...], int, int, int], ...]
#: Headers up to this size have their layout remembered: every update of a plan has the same
#: header, and a server reads thousands; a hostile stream of large distinct ones costs no memory.
_REMEMBERED_HEADER_BYTES = 4096


def _layout(header_bytes: bytes) -> _Layout:
    if len(header_bytes) <= _REMEMBERED_HEADER_BYTES:
        return _remembered_layout(header_bytes)
    return _read_layout(header_bytes)


def _read_layout(header_bytes: bytes) -> _Layout:
    """Everything a header declares, checked as far as it can be without the data."""
    header = _parse_header(header_bytes)
    try:
        entries = header["tensors"]
        if not isinstance(entries, list):
            raise TypeError("tensors is not a list")
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint header is not valid: {exc}") from None
    if len(entries) > MAX_TENSORS:
        raise CheckpointError(f"checkpoint holds {len(entries)} tensors, more than {MAX_TENSORS}")
    layout = []
    names: set[str] = set()
    for entry in entries:
        try:
            name = entry["name"]
            dtype_name = entry["dtype"]
            shape = tuple(_int(d) for d in entry["shape"])
            offset = _int(entry["offset"])
            nbytes = _int(entry["nbytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint header entry is malformed: {exc}") from None
        if not isinstance(name, str) or name in names:
            raise CheckpointError(f"checkpoint tensor name {name!r} is invalid or repeated")
        names.add(name)
        if dtype_name not in ALLOWED_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {dtype_name!r}, which is not allowed")
        if any(d < 0 for d in shape) or len(shape) > 32:
            raise CheckpointError(f"tensor {name!r} has an invalid shape {shape}")
        dtype = np.dtype(dtype_name).newbyteorder("<")
        count = math.prod(shape)  # exact (Python ints): a huge shape cannot wrap around to match nbytes
        if count * dtype.itemsize != nbytes or offset < 0:
            raise CheckpointError(f"tensor {name!r} does not fit its declared shape, dtype and place in the data")
        layout.append((name, dtype_name, dtype, shape, count, offset, nbytes))
    return tuple(layout)


_remembered_layout = functools.lru_cache(maxsize=64)(_read_layout)


def _parse_header(header_bytes: bytes) -> dict:
    """The header as a dict, parsed only once it is known to be shallow UTF-8 JSON with nothing
    but integers for numbers.

    ``json.loads`` recurses once per bracket: about a thousand nested ``[`` in a 1 MiB header
    raise RecursionError (not a ValueError) deep inside the parser, so the nesting depth is
    measured first, by a linear scan that skips string literals. A header written by
    :func:`encode_checkpoint` is 4 deep and holds only strings and integers; NaN, Infinity,
    floats (``1e999`` parses as infinity) and integers beyond 64 bits are refused."""
    try:
        text = header_bytes.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"checkpoint header is not UTF-8: {exc}") from None
    depth = _nesting_depth(text)
    if depth > MAX_HEADER_DEPTH:
        raise CheckpointError(
            f"checkpoint header nests more than {MAX_HEADER_DEPTH} levels of brackets; encode_checkpoint writes {_WRITTEN_DEPTH}"
        )
    try:
        header = json.loads(text, parse_constant=_refuse_constant, parse_float=_refuse_float, parse_int=_bounded_int)
    except ValueError as exc:  # json.JSONDecodeError and the refusals above
        raise CheckpointError(f"checkpoint header is not valid: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError("checkpoint header is not a JSON object")
    return header


# A string literal, escapes included (so an escaped quote does not end it); one left unclosed runs
# to the end. The pattern always matches at a quote, so substituting it never backtracks.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def _nesting_depth(text: str) -> int:
    """The deepest bracket nesting of JSON ``text`` outside string literals, in linear time. Where
    the text stops being JSON (an unclosed string, a stray ``]``) the parser stops too, so the
    count need be exact only up to there."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(itertools.accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0)


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number a checkpoint header holds")


def _refuse_float(text: str) -> object:
    raise ValueError(f"{text[:40]!r}: checkpoint headers hold only integers")


def _bounded_int(text: str) -> int:
    # 21 characters hold any 64-bit integer with its sign; a longer one is refused before int()
    # spends quadratic time converting it.
    value = int(text) if len(text) <= 21 else None
    if value is None or not -(2**63) <= value < 2**64:
        raise ValueError(
            f"integer {text[:24]}{'...' if len(text) > 24 else ''} is out of range for a checkpoint header"
        )
    return value


def _int(value: object) -> int:
    """A JSON integer (not a bool, float or string)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an integer")
    return value
