import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg.shamir import (
    LIMBS,
    P,
    lagrange_at_zero,
    limbs_to_secret,
    reconstruct_secret,
    secret_to_limbs,
    share_limbs,
    share_secrets,
)


@given(st.binary(min_size=32, max_size=32))
def test_limbs_roundtrip(secret):
    limbs = secret_to_limbs(secret)
    assert limbs.shape == (LIMBS,) and limbs.max() < P
    assert limbs_to_secret(limbs) == secret


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_any_t_shares_reconstruct(data):
    n = data.draw(st.integers(2, 20))
    t = data.draw(st.integers(1, n))
    holders = sorted(data.draw(st.sets(st.integers(1, P - 1), min_size=n, max_size=n)))
    secrets = [data.draw(st.binary(min_size=32, max_size=32)) for _ in range(2)]
    rb = random.Random(data.draw(st.integers(0, 1000))).randbytes
    shares = share_secrets(secrets, holders, t, rb)
    assert shares.shape == (n, 2 * LIMBS)
    pick = sorted(data.draw(st.permutations(range(n)))[:t])
    xs = [holders[i] for i in pick]
    assert reconstruct_secret(xs, shares[pick, :LIMBS]) == secrets[0]
    assert reconstruct_secret(xs, shares[pick, LIMBS:]) == secrets[1]


def _coefficients_through(points: list[tuple[int, int]]) -> list[int]:
    """Coefficients (constant first) of the polynomial of degree < len(points) over GF(p) through
    ``points``, by expanding the Lagrange basis with exact integers."""
    out = [0] * len(points)
    for i, (xi, yi) in enumerate(points):
        basis, denominator = [1], 1
        for j, (xj, _) in enumerate(points):
            if j != i:  # basis *= (x - xj)
                basis = [(a - xj * b) % P for a, b in zip([0] + basis, basis + [0])]
                denominator = denominator * (xi - xj) % P
        scale = yi * pow(denominator, P - 2, P) % P
        out = [(o + scale * b) % P for o, b in zip(out, basis)]
    return out


def _scripted_randomness(words: np.ndarray):
    """A ``random_bytes`` that hands out exactly ``words`` (uint64, each < p). ``share_limbs``
    takes its polynomial coefficients from these words: (t - 1, m), degree 1 first."""
    data = np.ascontiguousarray(words, dtype=np.uint64).tobytes()

    def random_bytes(n: int) -> bytes:
        assert n == len(data), (n, len(data))
        return data

    return random_bytes


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_t_minus_1_shares_are_equally_consistent_with_every_secret(data):
    """Perfect secrecy of t-out-of-n sharing: for ANY secret and ANY values of the shares of
    ANY t-1 holders there is exactly one choice of the random coefficients that makes
    ``share_secrets`` produce those shares. Existence is checked here, by solving for the
    coefficients (the polynomial through (0, secret) and the t-1 points) and replaying the
    sharing with them; uniqueness follows by counting (p^(t-1) coefficient vectors onto
    p^(t-1) share vectors). With uniform coefficients the t-1 shares are then uniform whatever
    the secret: they carry no information about it."""
    t = data.draw(st.integers(2, 7), label="t")
    n = data.draw(st.integers(t, 12), label="n")
    holders = sorted(data.draw(st.sets(st.integers(1, P - 1), min_size=n, max_size=n), label="holders"))
    seen = sorted(data.draw(st.permutations(range(n)), label="order")[: t - 1])
    secret = data.draw(st.binary(min_size=32, max_size=32), label="secret")
    target = np.array(
        data.draw(
            st.one_of(
                st.lists(
                    st.lists(st.integers(0, P - 1), min_size=LIMBS, max_size=LIMBS), min_size=t - 1, max_size=t - 1
                ),
                # or what the t-1 holders saw of another secret's sharing
                st.builds(
                    lambda other, seed: share_secrets([other], holders, t, random.Random(seed).randbytes)[
                        seen
                    ].tolist(),
                    st.binary(min_size=32, max_size=32),
                    st.integers(0, 2**32 - 1),
                ),
            ),
            label="their shares",
        ),
        dtype=np.uint64,
    ).reshape(t - 1, LIMBS)
    limbs = secret_to_limbs(secret)
    words = np.empty((t - 1, LIMBS), dtype=np.uint64)
    for j in range(LIMBS):
        points = [(0, int(limbs[j]))] + [(holders[i], int(target[k, j])) for k, i in enumerate(seen)]
        words[:, j] = _coefficients_through(points)[1:]
    replayed = share_secrets([secret], holders, t, _scripted_randomness(words))
    assert np.array_equal(replayed[seen], target)
    # and it is a sharing of this secret: any t of the shares rebuild it
    assert reconstruct_secret(holders[:t], replayed[:t]) == secret


def _chi_square(counts: np.ndarray, expected: np.ndarray) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


def test_shares_of_t_minus_1_holders_look_uniform_whatever_the_secret():
    """The statistical view of the same property, independent of how randomness is consumed:
    with a seeded source, the pairs of shares two holders get under t = 3 are spread evenly
    over GF(p)^2 (16 x 16 buckets), for the secret 0 and for the largest limb alike, and the
    two distributions are indistinguishable (chi-square homogeneity)."""
    t, holders, draws, buckets = 3, [5, 17, 123456], 20_000, 16
    cells = buckets * buckets
    histograms = []
    for seed, value in ((1, 0), (2, (1 << 30) - 1)):
        shares = share_limbs(np.full(draws, value, dtype=np.uint64), holders, t, random.Random(seed).randbytes)
        a, b = (shares[:2] * buckets // P).astype(np.int64)  # holders 5 and 17: t - 1 of them
        histograms.append(np.bincount(a * buckets + b, minlength=cells).astype(float))
    # chi-square with df = 255: mean 255, sd 22.6; 5 sd above the mean
    limit = (cells - 1) + 5 * (2 * (cells - 1)) ** 0.5
    for h in histograms:
        assert _chi_square(h, np.full(cells, draws / cells)) < limit
    both = histograms[0] + histograms[1]
    homogeneity = sum(_chi_square(h, both / 2) for h in histograms)
    assert homogeneity < limit


def test_lagrange_rows_match_python_reference():
    xs = np.array([[3, 7, 11, 200], [1, 2, 3, 4]], dtype=np.uint64)
    lam = lagrange_at_zero(xs)
    for row, lrow in zip(xs.tolist(), lam.tolist()):
        for i, xi in enumerate(row):
            num = den = 1
            for j, xj in enumerate(row):
                if j != i:
                    num = num * xj % P
                    den = den * (xj - xi) % P
            assert lrow[i] == num * pow(den, P - 2, P) % P


def test_duplicate_holders_rejected():
    with pytest.raises(ValueError):
        lagrange_at_zero(np.array([[1, 2, 2]]))
    with pytest.raises(ValueError):
        share_secrets([bytes(32)], [0, 1], 2, random.Random(0).randbytes)
