import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from secagg.shamir import (
    LIMBS,
    P,
    lagrange_at_zero,
    limbs_to_secret,
    reconstruct_limbs,
    reconstruct_secret,
    secret_to_limbs,
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


def test_fewer_than_t_shares_reveal_nothing_about_the_limbs():
    # with t-1 shares, every candidate secret is equally consistent: the shares of two different
    # secrets under the same randomness differ, but the distribution over random coefficients
    # is uniform; check the weaker, testable fact that t-1 shares do not reconstruct the secret
    rb = random.Random(1).randbytes
    secret = bytes(range(32))
    holders = list(range(1, 11))
    shares = share_secrets([secret], holders, 5, rb)
    lam = lagrange_at_zero(np.array([holders[:4]]))
    got = reconstruct_limbs(shares[None, :4, :], lam)[0]
    assert not np.array_equal(got, secret_to_limbs(secret))


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
