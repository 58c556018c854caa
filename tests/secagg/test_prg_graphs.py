import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg import harary_neighbours, secagg_plus_parameters
from secagg.crypto import hkdf_sha256
from secagg.graphs import _log_binom_pmf, binom_tail_ge
from secagg.prg import MaskAccumulator, expand
from tests.secagg.secagg_helpers import seeded


def _chi2_uniform(values: np.ndarray, modulus: int, bins: int = 64) -> float:
    """Chi-square statistic of ``values`` against uniform on [0, modulus), in ``bins`` ranges."""
    edges = [-(-i * modulus // bins) for i in range(bins + 1)]  # ceil(i R / bins)
    idx = np.searchsorted(np.array(edges[1:], dtype=np.uint64), values, side="right")
    counts = np.bincount(idx, minlength=bins)[:bins]
    exp = len(values) * np.diff(np.array(edges, dtype=np.float64)) / modulus
    return float(((counts - exp) ** 2 / exp).sum())


@pytest.mark.parametrize("modulus", [2**16, 2**32, 2**40, 1000, 2**31 - 1, 3 * 2**40 + 1])
def test_expand_is_uniform_and_in_range(modulus):
    v = expand(seeded(modulus)(32), 64_000, modulus)
    assert v.dtype == np.uint64 and v.max() < modulus
    assert _chi2_uniform(v, modulus) < 130  # 63 dof; p ~ 1e-6


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 2**62), st.integers(1, 300), st.integers(0, 10**6))
def test_accumulator_matches_reference(modulus, length, seed):
    rb = seeded(seed)
    seeds = [rb(32) for _ in range(4)]
    signs = [1, -1, -1, 1]
    x = np.random.default_rng(seed).integers(0, modulus, length, dtype=np.uint64)
    acc = MaskAccumulator(length, modulus)
    acc.add_vector(x)
    ref = [int(v) for v in x]
    for s, g in zip(seeds, signs):
        acc.add_seed(s, g)
        m = expand(s, length, modulus)
        ref = [(a + g * int(b)) % modulus for a, b in zip(ref, m)]
    assert acc.value().tolist() == ref


def test_hkdf_matches_cryptography():
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    for length in (32, 64, 80):
        ref = HKDF(hashes.SHA256(), length, b"salt", b"info").derive(b"ikm")
        assert hkdf_sha256(b"ikm", b"salt", b"info", length) == ref


@settings(max_examples=30, deadline=None)
@given(st.integers(5, 300), st.integers(1, 40), st.integers(0, 1000))
def test_harary_graph_is_regular_symmetric_connected(n, half, seed):
    k = min(2 * half, n - 1 if (n - 1) % 2 == 0 else n - 2)
    if k < 2:
        return
    ids = list(range(10, 10 + n))
    g = harary_neighbours(ids, k, seeded(seed))
    assert set(g) == set(ids)
    for u, nb in g.items():
        assert len(nb) == k and len(set(nb)) == k and u not in nb
        for v in nb:
            assert u in g[v]
    seen, stack = {ids[0]}, [ids[0]]
    while stack:
        for v in g[stack.pop()]:
            if v not in seen:
                seen.add(v)
                stack.append(v)
    assert seen == set(ids)


@given(k=st.integers(0, 400), t=st.integers(-2, 402), p=st.sampled_from([0.0, 1 / 3, 0.05, 0.95, 0.5, 1.0]))
def test_a_binomial_tail_is_the_sum_of_its_terms_bit_for_bit(k, t, p):
    """The tail from terms computed once per (k, p) adds the same floats in the same order as
    summing each term's own exp, so the parameters chosen from it cannot move."""
    direct = 1.0 if t <= 0 else min(1.0, sum(math.exp(_log_binom_pmf(k, i, p)) for i in range(t, k + 1)))
    assert binom_tail_ge(k, t, p) == direct


def test_secagg_plus_parameters_are_sensible():
    small = secagg_plus_parameters(10)
    assert small.complete
    prev = 0
    for n in (1_000, 10_000, 100_000, 1_000_000):
        g = secagg_plus_parameters(n)
        assert not g.complete and g.degree % 2 == 0
        assert 2 * g.threshold > g.degree + 1
        assert g.degree >= prev and g.degree < 40 * math.log(n)  # grows like log n
        assert binom_tail_ge(g.degree, g.threshold, 1 / 3) <= 2.0**-40 / n
        assert 1 - binom_tail_ge(g.degree, g.threshold - 1, 0.95) <= 2.0**-30 / n
        # a server splitting survivor lists needs 2t - (k + 1) corrupt holders answering both ways
        assert binom_tail_ge(g.degree, 2 * g.threshold - (g.degree + 1), 1 / 3) <= 2.0**-40 / n
        semi = secagg_plus_parameters(n, malicious_server=False)  # Bell et al.'s semi-honest choice
        assert (
            semi.degree <= g.degree
            and binom_tail_ge(semi.degree, 2 * semi.threshold - semi.degree - 1, 1 / 3) > 2.0**-40 / n
        )
        prev = g.degree
    # more drop-out or more corruption needs a larger neighbourhood
    assert secagg_plus_parameters(10_000, 0.05, 0.3).degree > secagg_plus_parameters(10_000, 0.05, 0.05).degree
    assert secagg_plus_parameters(10_000, 0.3, 0.05).degree > secagg_plus_parameters(10_000, 0.05, 0.05).degree
