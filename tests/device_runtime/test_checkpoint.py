"""Checkpoints: round trips, and refusal of anything truncated, altered or not allowed."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from device_runtime.checkpoint import MAGIC, CheckpointError, decode_checkpoint, encode_checkpoint


def _sample() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w0": rng.standard_normal((3, 4)).astype(np.float32),
        "b0": np.zeros(4, dtype=np.float32),
        "num_examples": np.array(17.0, dtype=np.float32),
        "ids": np.arange(5, dtype=np.int64),
        "mask": np.array([True, False, True]),
        "half": np.array([1.5, -2.0], dtype=np.float16),
        "empty": np.zeros((0, 7), dtype=np.float64),
        "big_endian": np.arange(6, dtype=">i4").reshape(2, 3),
    }


def _assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        x, y = np.asarray(a[name]), b[name]
        assert y.shape == x.shape, name
        assert y.dtype == x.dtype.newbyteorder("="), name
        np.testing.assert_array_equal(y, x)


def test_round_trip_keeps_names_order_dtypes_shapes_values():
    tensors = _sample()
    out = decode_checkpoint(encode_checkpoint(tensors))
    _assert_same(tensors, out)
    assert out["num_examples"].shape == ()
    assert out["big_endian"].dtype == np.dtype("int32")


def test_empty_checkpoint_round_trips():
    assert decode_checkpoint(encode_checkpoint({})) == {}


def test_every_truncation_is_refused():
    data = encode_checkpoint(_sample())
    for cut in range(len(data)):
        with pytest.raises(CheckpointError):
            decode_checkpoint(data[:cut])


def test_every_single_bit_flip_is_refused():
    data = bytearray(encode_checkpoint({"w": np.arange(6, dtype=np.float32), "n": np.array(3.0, dtype=np.float32)}))
    for pos in range(len(data)):
        for bit in (0, 7):
            flipped = bytearray(data)
            flipped[pos] ^= 1 << bit
            with pytest.raises(CheckpointError):
                decode_checkpoint(bytes(flipped))


def test_bad_magic_and_size_limit():
    data = encode_checkpoint(_sample())
    with pytest.raises(CheckpointError, match="magic"):
        decode_checkpoint(b"NOTACKPT" + data[8:])
    with pytest.raises(CheckpointError, match="limit"):
        decode_checkpoint(data, max_bytes=len(data) - 1)
    decode_checkpoint(data, max_bytes=len(data))


@pytest.mark.parametrize("value", [np.array([object(), 1], dtype=object), np.array(["a", "b"]), np.array([1 + 2j])])
def test_disallowed_dtypes_are_refused_on_encode(value):
    with pytest.raises(CheckpointError, match="dtype"):
        encode_checkpoint({"bad": value})


def _forge(entries: list, body: bytes) -> bytes:
    """A checkpoint with a hand-written header and a valid checksum (an attacker can compute it)."""
    header = json.dumps({"tensors": entries}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + hashlib.sha256(header + body).digest() + body


@pytest.mark.parametrize(
    "entry",
    [
        {"name": "x", "dtype": "object", "shape": [1], "offset": 0, "nbytes": 8},
        {"name": "x", "dtype": "float32", "shape": [3], "offset": 0, "nbytes": 8},  # does not fit its shape
        {"name": "x", "dtype": "float32", "shape": [2], "offset": 4, "nbytes": 8},  # runs past the data
        {"name": "x", "dtype": "float32", "shape": [-2], "offset": 0, "nbytes": 8},
        {"name": "x", "dtype": "float32", "shape": [2**62, 2**62, 0, 2], "offset": 0, "nbytes": 8},
        {"name": "x", "dtype": "float32", "shape": [2.0], "offset": 0, "nbytes": 8},
        {"name": "x", "dtype": "float32", "shape": [2], "offset": "0", "nbytes": 8},
        {"name": 5, "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8},
        {"dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8},
        {"name": "x", "dtype": "bool", "shape": [8], "offset": 0, "nbytes": 8},  # bytes other than 0/1
        "not an object",
    ],
)
def test_forged_headers_with_valid_checksum_are_refused(entry):
    body = np.array([1.0, 2.0], dtype=np.float32).tobytes()
    with pytest.raises(CheckpointError):
        decode_checkpoint(_forge([entry], body))


def test_repeated_names_are_refused():
    body = np.zeros(2, dtype=np.float32).tobytes()
    entry = {"name": "x", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}
    with pytest.raises(CheckpointError, match="repeated"):
        decode_checkpoint(_forge([entry, entry], body))
    with pytest.raises(CheckpointError, match="repeated"):
        encode_checkpoint({1: np.zeros(1), "1": np.zeros(1)})


def test_non_json_header_is_refused():
    header = b"\xff\xfe not json"
    data = MAGIC + struct.pack("<I", len(header)) + header + hashlib.sha256(header).digest()
    with pytest.raises(CheckpointError, match="header"):
        decode_checkpoint(data)


_dtypes = st.sampled_from(["float32", "float64", "float16", "int8", "int32", "int64", "uint8", "uint64", "bool"])
_arrays = _dtypes.flatmap(
    lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=12), _arrays, max_size=5))
def test_property_round_trip(tensors):
    out = decode_checkpoint(encode_checkpoint(tensors))
    assert list(out) == list(tensors)
    for name, value in tensors.items():
        assert out[name].dtype == value.dtype and out[name].shape == value.shape
        np.testing.assert_array_equal(out[name], value)  # NaNs compare equal here


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300), st.integers(min_value=0))
def test_property_garbage_never_escapes_as_another_error(garbage, seed):
    data = encode_checkpoint({"a": np.arange(3, dtype=np.int32)})
    pos = seed % (len(data) + 1)
    for candidate in (garbage, MAGIC + garbage, data[:pos] + garbage):
        try:
            decode_checkpoint(candidate)
        except CheckpointError:
            pass


def _forge_header(header: bytes, body: bytes = b"") -> bytes:
    """A checkpoint with raw header bytes and a valid checksum."""
    return MAGIC + struct.pack("<I", len(header)) + header + hashlib.sha256(header + body).digest() + body


@pytest.mark.parametrize("depth", [9, 1_000, 100_000, (1 << 20) - 20])
@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_deeply_nested_headers_are_refused_not_a_recursion_error(depth, opener):
    closer = "]" if opener == "[" else "}"
    nested = (opener * depth + closer * depth).encode()
    for header in (nested, b'{"tensors":' + nested + b"}", opener.encode() * depth):
        if len(header) > 1 << 20:
            header = header[: 1 << 20]
        with pytest.raises(CheckpointError, match="nests more than 8 levels"):
            decode_checkpoint(_forge_header(header))


def test_brackets_inside_strings_do_not_count_as_nesting():
    name = '[[[[[[[[[[{{{{{{{{ \\" ]]]]'  # with an escaped quote, which does not end the string
    tensors = {name: np.arange(3, dtype=np.int32)}
    out = decode_checkpoint(encode_checkpoint(tensors))
    np.testing.assert_array_equal(out[name], tensors[name])


@pytest.mark.parametrize(
    "value", ["NaN", "Infinity", "-Infinity", "1e999", "2.0", "-0.0", "1" * 30, "-" + "9" * 5000, str(2**64)]
)
def test_header_numbers_other_than_64_bit_integers_are_refused(value):
    for header in (
        '{"tensors":[{"name":"x","dtype":"float32","shape":[' + value + '],"offset":0,"nbytes":0}]}',
        '{"tensors":[],"extra":' + value + "}",  # even in a field the decoder does not read
    ):
        with pytest.raises(CheckpointError, match="header"):
            decode_checkpoint(_forge_header(header.encode()))


# Bytes of JSON's structure and of its literals, so that the fuzzer reaches the parser's paths.
_json_ish = st.lists(
    st.sampled_from(list(b'[]{}",:\\ 0123456789-+.eEtrufalsnNIy') + [0xFF, 0xC3, 0x00, 0x7F]), max_size=400
).map(bytes)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(st.binary(max_size=400), _json_ish, _json_ish.map(lambda b: b'{"tensors":[' + b)), st.integers(1, 3000)
)
def test_property_any_header_bytes_give_a_checkpoint_error_or_a_checkpoint(header, repeat):
    for candidate in (header, header * repeat):
        try:
            decode_checkpoint(_forge_header(candidate))
        except CheckpointError:
            pass


def _resealed(header: bytes, body: bytes) -> bytes:
    """A checkpoint of ``header`` and ``body`` with a valid checksum."""
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, hashlib.sha256(header + body).digest(), body])


def test_a_remembered_header_still_has_its_data_checked():
    data = encode_checkpoint(_sample())
    _assert_same(_sample(), decode_checkpoint(data))  # the header's layout is now remembered
    (header_len,) = struct.unpack_from("<I", data, len(MAGIC))
    header = data[len(MAGIC) + 4 : len(MAGIC) + 4 + header_len]
    body = data[len(MAGIC) + 4 + header_len + 32 :]
    with pytest.raises(CheckpointError, match="does not fit"):
        decode_checkpoint(_resealed(header, body[:-1]))
    mask = json.loads(header)["tensors"][4]
    assert mask["name"] == "mask"
    flipped = bytearray(body)
    flipped[mask["offset"]] = 2  # a bool that is neither 0 nor 1
    with pytest.raises(CheckpointError, match="bool"):
        decode_checkpoint(_resealed(header, bytes(flipped)))
    _assert_same(_sample(), decode_checkpoint(data))


def test_equal_layouts_share_a_header_and_distinct_ones_do_not():
    a = encode_checkpoint({"w": np.zeros((2, 3), np.float32)})
    b = encode_checkpoint({"w": np.ones((2, 3), np.float32)})
    c = encode_checkpoint({"w": np.zeros((3, 2), np.float32)})

    def header(data: bytes) -> bytes:
        (n,) = struct.unpack_from("<I", data, len(MAGIC))
        return data[len(MAGIC) + 4 : len(MAGIC) + 4 + n]

    assert header(a) == header(b) != header(c)
    assert decode_checkpoint(c)["w"].shape == (3, 2)
