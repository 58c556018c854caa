"""The devices' noise shares are discrete Gaussians of variance ~1e16 (sigma ~ 1e8 at the default
bitwidth 32), which ``sample_discrete_gaussian`` draws as a rounded continuous Gaussian for speed
(``ROUNDED_GAUSSIAN_MIN_VARIANCE``): the draws must still be integers of the law's mean, variance and
shape on both sides of that switch, and so must Skellam shares, which switch to it too
(``SKELLAM_ROUNDED_GAUSSIAN_MIN_VARIANCE``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from device_runtime import ddp


@pytest.mark.parametrize("factor", [0.5, 1.0, 4.0, 1e4])
def test_large_variance_draws_are_integers_of_the_discrete_gaussians_mean_variance_and_shape(factor: float) -> None:
    variance = ddp.ROUNDED_GAUSSIAN_MIN_VARIANCE * factor
    n = 200_000
    x = ddp.sample_discrete_gaussian(variance, n, np.random.default_rng(3))
    assert x.dtype == np.int64 and x.size == n
    sigma = math.sqrt(variance)
    assert abs(x.mean()) < 5 * sigma / math.sqrt(n)
    assert x.var() == pytest.approx(variance, rel=5 * math.sqrt(2 / n))
    # at this scale the discrete law's cdf is the continuous one's to ~1/sigma: a KS test holds
    assert stats.kstest(x / sigma, "norm").pvalue > 1e-4


def test_the_shape_check_fails_for_a_laplace_of_the_same_variance() -> None:
    variance = ddp.ROUNDED_GAUSSIAN_MIN_VARIANCE * 4
    x = np.rint(np.random.default_rng(3).laplace(0.0, math.sqrt(variance / 2), 200_000))
    assert stats.kstest(x / math.sqrt(variance), "norm").pvalue <= 1e-4


def test_an_encoding_at_the_default_bitwidth_carries_its_share_of_noise() -> None:
    p = ddp.calibrate(noise_multiplier=1.0, clip=1.0, dim=4096, bitwidth=32, min_devices=5, max_devices=11)
    assert p.local_variance >= ddp.ROUNDED_GAUSSIAN_MIN_VARIANCE  # the fast path is the one devices take
    rng = np.random.default_rng(9)
    zero = np.zeros(4096)
    noisy = ddp.to_signed(ddp.encode(zero, p, 1, rng), p.modulus)
    assert noisy.std() == pytest.approx(math.sqrt(p.local_variance), rel=0.1)


def _default_skellam_share() -> float:
    """A Skellam share's variance as a round at the default bitwidth calibrates it (about 7e15)."""
    p = ddp.calibrate(
        noise_multiplier=1.0, clip=1.0, dim=1000, bitwidth=32, min_devices=5, max_devices=8, mechanism="skellam"
    )
    return p.local_variance


@pytest.mark.parametrize(
    "variance",
    [2.0**20, ddp.SKELLAM_ROUNDED_GAUSSIAN_MIN_VARIANCE, 2.0**40, 2.0**48, _default_skellam_share()],
    ids=["2^20", "switch", "2^40", "2^48", "default-share"],
)
def test_skellam_shares_at_every_variance_have_the_laws_variance_and_shape(variance: float) -> None:
    """Skellam shares of the sizes devices draw (about 7e15 at bitwidth 32) must follow the law the
    accounting assumes: numpy's Poisson sampler, which draws them as a difference of two Poissons at
    small variances, loses its law to float64 rounding for large means (variance 0.89 of the asked
    one and a KS p-value of 1e-110 at the default share), so large ones are drawn otherwise."""
    n = 200_000
    x = ddp.sample_skellam(variance, n, np.random.default_rng(7))
    assert x.dtype == np.int64 and x.size == n
    sigma = math.sqrt(variance)
    assert abs(x.mean()) < 5 * sigma / math.sqrt(n)
    assert x.var() == pytest.approx(variance, rel=5 * math.sqrt(2 / n))
    assert abs(stats.kurtosis(x.astype(np.float64))) < 5 * math.sqrt(24 / n)  # the law's is 1 / variance
    assert stats.kstest(x / sigma, "norm").pvalue > 1e-4
