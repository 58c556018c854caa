"""What the server sees: masked inputs look uniform; after Unmasking it holds no individual input."""

import numpy as np
import pytest

from secagg import Round, SecAggConfig, parse_message
from tests.secagg.secagg_helpers import Harness, make_inputs

# chi-square with 255 degrees of freedom: mean 255, sd ~22.6; 400 is ~6.4 sd (p < 1e-9)
CHI2_255_LIMIT = 400.0


def _byte_chi2(raw: bytes) -> float:
    counts = np.bincount(np.frombuffer(raw, dtype=np.uint8), minlength=256)
    exp = len(raw) / 256
    return float(((counts - exp) ** 2 / exp).sum())


@pytest.mark.parametrize("modulus", [2**32, 2**64 // 4])
def test_masked_input_is_not_the_input_and_looks_uniform(modulus):
    n, length = 5, 20_000
    cfg = SecAggConfig(length, modulus, 3, session_label=b"priv", allow_unsafe=True)
    inputs = {u: np.full(length, 7, dtype=np.uint64) for u in range(1, n + 1)}  # very non-uniform inputs
    h = Harness(cfg, inputs, seed=11)
    h.run_to(Round.MASKED_INPUT_COLLECTION)
    out = h.client_step()
    for u in (1, 4):
        words = parse_message(out[u]).words
        y = np.frombuffer(words, dtype=np.uint32 if modulus <= 2**32 else np.uint64)
        assert not np.array_equal(y, inputs[u])
        assert np.count_nonzero(y == 7) < 5
        raw = words if modulus in (2**32,) else (y.astype("<u8") & np.uint64(2**56 - 1)).tobytes()
        if modulus != 2**32:  # low 7 bytes of each 62-bit word are uniform; drop the top byte
            raw = b"".join(raw[i : i + 7] for i in range(0, len(raw), 8))
        assert _byte_chi2(raw) < CHI2_255_LIMIT


def test_masked_values_uniform_mod_non_power_of_two():
    modulus, length = 1_000_003, 40_000
    cfg = SecAggConfig(length, modulus, 2, session_label=b"priv2", allow_unsafe=True)
    inputs = {u: np.zeros(length, dtype=np.uint64) for u in (1, 2, 3)}
    h = Harness(cfg, inputs, seed=5)
    h.run_to(Round.MASKED_INPUT_COLLECTION)
    y = np.frombuffer(parse_message(h.client_step()[2]).words, dtype=np.uint32)
    assert y.max() < modulus
    bins = 100
    counts = np.bincount((y.astype(np.int64) * bins) // modulus, minlength=bins)
    exp = length / bins
    assert float(((counts - exp) ** 2 / exp).sum()) < 200  # 99 dof, ~7 sd


def _arrays_in(obj, seen=None):
    """Every numpy array and bytes object reachable from ``obj``'s attributes."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        yield obj
        return
    if isinstance(obj, (bytes, bytearray, memoryview)):
        yield np.frombuffer(bytes(obj), dtype=np.uint8)
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _arrays_in(k, seen)
            yield from _arrays_in(v, seen)
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from _arrays_in(v, seen)
        return
    attrs = getattr(obj, "__dict__", None)
    if attrs is not None:
        yield from _arrays_in(attrs, seen)
    for slot in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, slot):
            yield from _arrays_in(getattr(obj, slot), seen)


def _contains(haystack: np.ndarray, needle: bytes) -> bool:
    return needle in np.ascontiguousarray(haystack).tobytes()


def test_server_state_holds_no_individual_input_or_masked_input():
    n, length, modulus = 7, 64, 2**24
    cfg = SecAggConfig(length, modulus, 4, session_label=b"mem", allow_unsafe=True)
    inputs = make_inputs(n, length, modulus, 21)
    h = Harness(cfg, inputs, seed=2)
    h.run_to(Round.MASKED_INPUT_COLLECTION)
    masked = h.client_step()
    h.server_step(silent={7})  # 7 drops before its masked input
    h.client_step()
    h.server_step(silent={3})  # 3 drops after its masked input
    assert h.server.round is Round.COMPLETED
    needles = []
    for x in inputs.values():
        needles += [x.astype("<u4").tobytes()[:64], x.astype("<u8").tobytes()[:64]]
    for data in masked.values():
        needles.append(parse_message(data).words[:64])
    arrays = list(_arrays_in(h.server))
    assert arrays
    for arr in arrays:
        for needle in needles:
            assert not _contains(arr, needle)
    total = sum(inputs[u].astype(object) for u in range(1, 7))
    assert [int(v) for v in h.server.result()] == [int(v) % modulus for v in total]
