import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg import Quantizer, decode_weighted, encode_weighted, modulus_for


@given(st.integers(1, 100_000), st.integers(1, 30))
def test_modulus_never_wraps(n, bitwidth):
    r = modulus_for(n, bitwidth)
    assert r & (r - 1) == 0
    assert r >= n * (1 << bitwidth)
    assert r < 2 * n * (1 << bitwidth)
    assert n * ((1 << bitwidth) - 1) < r


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 24), st.floats(0.01, 100), st.integers(1, 50), st.integers(0, 2**32 - 1))
def test_sum_dequantizes_within_error(bitwidth, clip, n, seed):
    q = Quantizer(bitwidth, clip)
    rng = np.random.default_rng(seed)
    xs = rng.uniform(-clip, clip, (n, 17))
    total = sum(q.quantize(x) for x in xs)
    assert total.max() < modulus_for(n, bitwidth)
    est = q.dequantize_sum(total, n)
    assert np.all(np.abs(est - xs.sum(axis=0)) <= n * (0.5 / q.scale) + 1e-9 * n * clip)


def test_clipping_and_range():
    q = Quantizer(8, 1.0)
    v = q.quantize(np.array([-5.0, -1.0, 0.0, 1.0, 5.0]))
    assert v.tolist() == [0, 0, 128, 255, 255]
    assert v.dtype == np.uint64


def test_stochastic_rounding_is_unbiased():
    q = Quantizer(4, 1.0)
    x = np.full(200_000, 0.0333)
    est = q.dequantize(q.quantize(x, np.random.default_rng(0))).mean()
    assert abs(est - 0.0333) < 2e-3


def test_weighted_average_through_a_sum():
    q = Quantizer(16, 1.0)
    rng = np.random.default_rng(3)
    xs = rng.uniform(-1, 1, (5, 10))
    ws = [1, 10, 100, 7, 0]
    enc = sum(encode_weighted(x, w, 128, q) for x, w in zip(xs, ws))
    got = decode_weighted(enc, 5, 128, q)
    want = (np.array(ws)[:, None] * xs).sum(0) / sum(ws)
    assert np.allclose(got, want, atol=5 * 128 / q.scale / sum(ws) + 1e-6)
