"""Distributed DP's pure core (device_runtime.ddp): rotation, rounding, noise, calibration, decoding."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy import stats
from scipy.linalg import hadamard

from device_runtime import ddp, ddp_kernel

finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def vectors(min_dim: int = 1, max_dim: int = 300) -> st.SearchStrategy[np.ndarray]:
    return st.integers(min_dim, max_dim).flatmap(lambda d: arrays(np.float64, d, elements=finite))


# --- rotation ----------------------------------------------------------------------------------


@SETTINGS
@given(x=vectors(), seed=st.integers(0, 2**64 - 1))
def test_rotation_is_orthonormal_and_its_inverse_exact(x: np.ndarray, seed: int) -> None:
    y = ddp.rotate(x, seed)
    assert y.size == ddp.padded_dimension(x.size)
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-12, abs=1e-9)
    np.testing.assert_allclose(ddp.unrotate(y, seed, x.size), x, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_fast_walsh_hadamard_equals_the_dense_normalized_matrix(d: int) -> None:
    x = np.random.default_rng(d).normal(size=(3, d))
    np.testing.assert_allclose(ddp.fwht(x), x @ hadamard(d).T / math.sqrt(d), atol=1e-12)


def test_rotation_depends_on_the_public_seed() -> None:
    x = np.random.default_rng(0).normal(size=100)
    assert not np.allclose(ddp.rotate(x, 1), ddp.rotate(x, 2))
    np.testing.assert_array_equal(ddp.rotate(x, 1), ddp.rotate(x, 1))


def test_rotation_spreads_a_spike_over_every_coordinate() -> None:
    x = np.zeros(1000)
    x[3] = 5.0
    y = ddp.rotate(x, 7)
    np.testing.assert_allclose(np.abs(y), 5.0 / math.sqrt(1024))


def butterfly_transform(v: np.ndarray) -> np.ndarray:
    """The unnormalized Walsh-Hadamard transform in int64, one butterfly per bit: the reference the
    blocked float64 transform must equal bit for bit on integers (whose sums float64 holds exactly)."""
    v = v.copy()
    h = 1
    while h < v.size:
        pairs = v.reshape(-1, 2, h)
        v = np.concatenate([pairs[:, :1] + pairs[:, 1:], pairs[:, :1] - pairs[:, 1:]], axis=1).reshape(-1)
        h *= 2
    return v


@SETTINGS
@given(
    bits=st.integers(0, 17),
    short=st.integers(0, 2**17),
    signed=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_the_blocked_transform_of_integers_equals_the_butterflies_bit_for_bit(
    bits: int, short: int, signed: bool, seed: int
) -> None:
    # from 2^15 entries on the transform runs in strips and blocks, reading a source shorter than the
    # padded length (zero past it) and its signs as it goes
    d = 1 << bits
    x = np.random.default_rng(seed).integers(-1000, 1001, size=max(1, d - short % d))
    signs = ddp._negated_signs(seed, d) if signed else None
    got = ddp._fwht_vector(x.astype(np.float64), 1.0, negated_signs=signs, length=d)
    padded = np.zeros(d, dtype=np.int64)
    padded[: x.size] = x if signs is None else x * signs[: x.size]
    np.testing.assert_array_equal(got, butterfly_transform(padded).astype(np.float64))


@SETTINGS
@given(x=vectors(max_dim=140_000), seed=st.integers(0, 2**64 - 1))
def test_the_flat_rotation_equals_the_stacked_one_to_float64_rounding(x: np.ndarray, seed: int) -> None:
    stacked = ddp.rotate(x[None, :], seed)[0]  # signs, then one pass over the vector per factor
    np.testing.assert_allclose(ddp.rotate(x, seed), stacked, rtol=0, atol=1e-13 * (1.0 + np.linalg.norm(x)))


@SETTINGS
@given(bits=st.integers(0, 17), seed=st.integers(0, 2**32))
def test_the_flat_transform_equals_the_stacked_one_to_float64_rounding(bits: int, seed: int) -> None:
    x = np.random.default_rng(seed).normal(size=1 << bits)
    stacked = ddp.fwht(x[None, :])[0]  # the factor-by-factor products, one pass over the vector each
    np.testing.assert_allclose(ddp.fwht(x), stacked, rtol=0, atol=1e-13 * np.linalg.norm(x))


@SETTINGS
@given(seed=st.integers(0, 2**64 - 1), bits=st.integers(0, 17))
def test_rotation_signs_are_the_ones_the_integer_draw_gave_bit_for_bit(seed: int, bits: int) -> None:
    # what devices and servers derived before the signs were read from the raw stream
    drawn = np.random.Generator(np.random.PCG64(seed)).integers(0, 2, size=1 << bits, dtype=np.int8)
    np.testing.assert_array_equal(ddp.rotation_signs(seed, 1 << bits), drawn.astype(np.float64) * 2.0 - 1.0)


# --- clipping and rounding ---------------------------------------------------------------------


@SETTINGS
@given(x=vectors(), clip=st.floats(1e-3, 1e3))
def test_clipping_bounds_the_norm_and_keeps_short_vectors(x: np.ndarray, clip: float) -> None:
    c = ddp.clip_l2(x, clip)
    assert np.linalg.norm(c) <= clip * (1 + 1e-12)
    if np.linalg.norm(x) <= clip:
        np.testing.assert_array_equal(c, x)
    else:
        np.testing.assert_allclose(c * np.linalg.norm(x) / clip, x, rtol=1e-9, atol=1e-9)


def test_clipping_refuses_non_finite_updates() -> None:
    with pytest.raises(ddp.DDPError, match="NaN"):
        ddp.clip_l2(np.array([1.0, np.nan]), 1.0)


@SETTINGS
@given(x=vectors(), scaled_clip=st.floats(0.1, 1e4), seed=st.integers(0, 2**32))
def test_conditional_rounding_stays_within_the_bound_and_next_to_the_input(
    x: np.ndarray, scaled_clip: float, seed: int
) -> None:
    y = ddp.clip_l2(x, scaled_clip)
    bound = ddp.rounding_bound(scaled_clip, x.size)
    q = ddp.conditional_round(y, bound, np.random.default_rng(seed))
    assert float(np.linalg.norm(q)) <= bound
    assert np.all(np.abs(q - y) < 1.0)


def test_conditional_rounding_is_unbiased() -> None:
    y = np.full(200_000, 0.3)
    q = ddp.conditional_round(
        y,
        ddp.rounding_bound(float(np.linalg.norm(y)), y.size),
        np.random.default_rng(0),
    )
    assert q.mean() == pytest.approx(0.3, abs=5 * math.sqrt(0.21 / y.size))


@SETTINGS
@given(y=st.floats(-(2.0**32), 2.0**32), u=st.floats(0.0, 1.0, exclude_max=True))
def test_floor_of_y_plus_u_rounds_up_exactly_when_u_reaches_one_minus_the_fraction_but_within_an_ulp(
    y: float, u: float
) -> None:
    # floor(y + U) is floor(y) + Bernoulli(frac(y)): only a U within float64 rounding of 1 - frac(y)
    # may land on the other side (FAST_ROUNDING_MAX_BOUND)
    floor = math.floor(y)
    up = math.floor(y + u) - floor
    assert up in (0, 1)
    if abs(u - (1.0 - (y - floor))) > float(np.spacing(max(abs(y), 1.0))):
        assert up == (u >= 1.0 - (y - floor))


@pytest.mark.parametrize("offset", [0.0, 2.0**40])
def test_conditional_rounding_is_floor_plus_the_uniform_on_the_generators_draws(offset: float) -> None:
    # below the fast bound floor(y + U); above it (where y + U loses U's low bits) U < frac(y), exactly
    y = offset + np.random.default_rng(1).uniform(-50.0, 50.0, size=1000)
    bound = float(np.linalg.norm(y)) + 1000.0
    assert (bound <= ddp.FAST_ROUNDING_MAX_BOUND) == (offset == 0.0)
    q = ddp.conditional_round(y, bound, np.random.default_rng(2))
    u = np.random.default_rng(2).random(y.size)
    expected = np.floor(y + u) if offset == 0.0 else np.floor(y) + (u < y - np.floor(y))
    np.testing.assert_array_equal(q, expected.astype(np.int64))


def test_fast_conditional_rounding_is_unbiased_at_every_fraction() -> None:
    frac = np.linspace(0.0, 1.0, 64, endpoint=False)
    y = np.tile(frac - 3.0, 20_000)  # negative entries too
    bound = ddp.rounding_bound(float(np.linalg.norm(y)), y.size)
    assert bound <= ddp.FAST_ROUNDING_MAX_BOUND
    q = ddp.conditional_round(y, bound, np.random.default_rng(5)).reshape(-1, 64)
    np.testing.assert_allclose(q.mean(axis=0), frac - 3.0, atol=5 * 0.5 / math.sqrt(20_000))


def test_conditional_rounding_gives_up_with_a_clear_error_on_an_unclipped_input() -> None:
    y = np.full(64, 10.5)
    with pytest.raises(ddp.RoundingFailed, match="not clipped"):
        ddp.conditional_round(y, bound=1.0, rng=np.random.default_rng(0), max_tries=5)


# --- the discrete Gaussian sampler -------------------------------------------------------------


def discrete_gaussian_pmf(variance: float, support: np.ndarray) -> np.ndarray:
    w = np.exp(-(support.astype(np.float64) ** 2) / (2 * variance))
    tail = int(max(abs(support.min()), support.max())) + int(40 * math.sqrt(variance)) + 40
    whole = np.arange(-tail, tail + 1)
    pmf: np.ndarray = w / np.exp(-(whole.astype(np.float64) ** 2) / (2 * variance)).sum()
    return pmf


def discrete_gaussian_variance(sigma2: float) -> float:
    """The law's true variance: sigma^2 up to about exp(-2 pi^2 sigma^2), smaller for small sigma."""
    x = np.arange(-int(40 * math.sqrt(sigma2)) - 40, int(40 * math.sqrt(sigma2)) + 41)
    return float((discrete_gaussian_pmf(sigma2, x) * x.astype(np.float64) ** 2).sum())


def looks_discrete_gaussian(samples: np.ndarray, sigma2: float) -> bool:
    """N_Z(0, sigma2)'s mean, variance and whole pmf (chi-square over cells of >= 20 expected draws)."""
    n = samples.size
    var = discrete_gaussian_variance(sigma2)
    if sigma2 >= 1:
        assert var == pytest.approx(sigma2, rel=1e-6)
    if abs(samples.mean()) > 5 * math.sqrt(var / n):
        return False
    if abs(samples.var() - var) > 5 * var * math.sqrt(2 / n):
        return False
    variance = sigma2
    lo, hi = int(samples.min()), int(samples.max())
    support = np.arange(lo - 1, hi + 2)
    expected = discrete_gaussian_pmf(variance, support) * n
    observed = np.bincount(samples - (lo - 1), minlength=support.size).astype(np.float64)
    keep = expected >= 20
    cells_o = np.append(observed[keep], observed[~keep].sum() + (n - observed.sum()))
    cells_e = np.append(expected[keep], n - expected[keep].sum())
    chi2 = float(((cells_o - cells_e) ** 2 / np.maximum(cells_e, 1e-300)).sum())
    return bool(stats.chi2.sf(chi2, cells_o.size - 1) > 1e-4)


Sampler = Callable[[float, int, np.random.Generator], np.ndarray]


def rounded_gaussian(scale: float) -> Sampler:
    return lambda v, n, rng: np.rint(rng.normal(0.0, scale * math.sqrt(v), n)).astype(np.int64)


def discrete_laplace(v: float, n: int, rng: np.random.Generator) -> np.ndarray:
    b = math.sqrt(v / 2)  # a Laplace with the same variance, rounded
    out: np.ndarray = np.rint(rng.laplace(0.0, b, n)).astype(np.int64)
    return out


@pytest.mark.parametrize("variance", [0.25, 2.0, 30.0, 1e4])
def test_discrete_gaussian_sampler_matches_the_law(variance: float) -> None:
    samples = ddp.sample_discrete_gaussian(variance, 200_000, np.random.default_rng(11))
    assert samples.dtype == np.int64
    assert looks_discrete_gaussian(samples, variance)


@pytest.mark.parametrize(
    ("name", "sampler", "variance"),
    [
        ("rounded Gaussian, 5% too wide", rounded_gaussian(1.05), 30.0),
        ("rounded Gaussian, 5% too narrow", rounded_gaussian(0.95), 1e4),
        ("rounded Gaussian at a small scale", rounded_gaussian(1.0), 0.25),
        ("rounded Laplace of the same variance", discrete_laplace, 2.0),
        ("rounded Laplace of the same variance", discrete_laplace, 1e4),
    ],
)
def test_the_sampler_check_fails_for_a_broken_sampler(name: str, sampler: Sampler, variance: float) -> None:
    assert not looks_discrete_gaussian(sampler(variance, 200_000, np.random.default_rng(11)), variance), name


def test_exact_rational_sampler_matches_the_law() -> None:
    samples = ddp.sample_discrete_gaussian_exact(Fraction(3, 2), 3000, np.random.default_rng(5))
    assert looks_discrete_gaussian(samples, 1.5)


def test_skellam_noise_has_the_asked_variance() -> None:
    s = ddp.sample_skellam(50.0, 200_000, np.random.default_rng(3))
    assert abs(s.mean()) < 5 * math.sqrt(50 / s.size)
    assert s.var() == pytest.approx(50.0, rel=5 * math.sqrt(2 / s.size))


def test_zero_variance_is_no_noise() -> None:
    rng = np.random.default_rng(0)
    assert not ddp.sample_discrete_gaussian(0.0, 10, rng).any()
    assert not ddp.sample_skellam(0.0, 10, rng).any()


# --- calibration, encoding and decoding -------------------------------------------------------


def sum_encodings(encodings: list[np.ndarray], modulus: int) -> np.ndarray:
    total = np.zeros_like(encodings[0])
    for e in encodings:
        total = ddp.add_mod(total, e, modulus)
    return total


@SETTINGS
@given(
    x=vectors(max_dim=200),
    clip=st.floats(0.01, 100),
    bits=st.integers(12, 30),
    seed=st.integers(0, 2**32),
)
def test_round_trip_without_noise_reproduces_the_clipped_vector_within_the_rounding_bound(
    x: np.ndarray, clip: float, bits: int, seed: int
) -> None:
    p = ddp.calibrate(
        noise_multiplier=1.0,
        clip=clip,
        dim=x.size,
        bitwidth=bits,
        min_devices=1,
        max_inflation=1e9,
    )
    enc = ddp.encode(x, p, seed, np.random.default_rng(seed), noise=False)
    assert enc.dtype == np.int64 and (enc >= 0).all() and (enc < p.modulus).all()
    out = ddp.decode(enc, p, seed, 1)
    assert np.linalg.norm(out - ddp.clip_l2(x, clip)) <= math.sqrt(p.padded_dim) / p.gamma * (1 + 1e-9)


@SETTINGS
@given(
    dim=st.integers(1, 128),
    n=st.integers(2, 40),
    bits=st.integers(10, 24),
    aligned=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_the_modular_sum_of_many_encodings_decodes_to_the_sum_of_clipped_vectors(
    dim: int, n: int, bits: int, aligned: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    clip = 1.0
    try:
        p = ddp.calibrate(
            noise_multiplier=0.5,
            clip=clip,
            dim=dim,
            bitwidth=bits,
            min_devices=n,
            max_inflation=1e9,
        )
    except ddp.ModulusTooSmall:
        return  # a bitwidth too small for n devices is refused, not used
    base = rng.normal(size=dim)
    updates = [base * 10 if aligned else rng.normal(size=dim) * 10 for _ in range(n)]  # all clipped
    encodings = [ddp.encode(u, p, seed, rng, noise=False) for u in updates]
    out = ddp.decode(sum_encodings(encodings, p.modulus), p, seed, n)
    expected = sum(ddp.clip_l2(u, clip) for u in updates)
    assert np.linalg.norm(out - expected) <= n * math.sqrt(p.padded_dim) / p.gamma * (1 + 1e-9)


def reference_draws(
    native: bool, seed: int, padded_dim: int, noise: bool
) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
    """The encoding's draws for one rounding attempt as a function: (uniforms, standard normals).

    numpy's path draws every attempt's uniforms from its SFC64 and then the noise once; the
    compiled one draws block by block from its xoshiro256++, each block's uniforms then (with
    noise) its normals, and every attempt draws its noise anew."""
    if not native:
        gen = ddp._private_generator(np.random.default_rng(seed))

        def numpy_draws() -> tuple[np.ndarray, np.ndarray]:
            return gen.random(padded_dim), np.empty(0)

        numpy_draws.gen = gen  # type: ignore[attr-defined]
        return numpy_draws
    kernel = ddp_kernel.load()
    state = ddp_kernel.new_state(np.random.default_rng(seed))
    cols = min(padded_dim, ddp_kernel.BLOCK_ENTRIES)

    def native_draws() -> tuple[np.ndarray, np.ndarray]:
        us, zs = [], []
        for _ in range(padded_dim // cols):
            us.append(kernel.uniforms(state, cols))
            if noise:
                zs.append(kernel.normals(state, cols))
        return np.concatenate(us), np.concatenate(zs) if zs else np.empty(0)

    return native_draws


@pytest.mark.parametrize("native", [False, True], ids=["numpy", "compiled"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dim=st.integers(1, 40_000),
    norm=st.floats(0.01, 10.0),
    rotation_seed=st.integers(0, 2**64 - 1),
    seed=st.integers(0, 2**32),
    beta=st.sampled_from([ddp.DEFAULT_BETA, 0.99]),
)
def test_the_fast_encoding_is_the_reference_rounding_and_noise_on_the_same_draws(
    native: bool, dim: int, norm: float, rotation_seed: int, seed: int, beta: float
) -> None:
    # encode clips, rotates and scales in one transform, rounds block by block as the transform
    # finishes them and adds the noise block by block (in numpy or in the compiled kernel); the
    # reference does each step whole on the same generator's draws: equal wherever float64
    # rounding of the rotation cannot move y + U across an integer
    # from 16 entries on, the share's variance is above ROUNDED_GAUSSIAN_MIN_VARIANCE (the fused path);
    # beta 0.99 tightens the norm bound so that an input at the clip often needs a second try
    p = ddp.calibrate(noise_multiplier=1.0, clip=1.0, dim=dim, bitwidth=32, min_devices=5, max_devices=11, beta=beta)
    assert ddp.native_covers(p, noise=False)
    # a share's variance below ROUNDED_GAUSSIAN_MIN_VARIANCE needs the exact sampler, numpy's
    noisy_too = ddp.native_covers(p)
    assert noisy_too == (p.local_variance >= ddp.ROUNDED_GAUSSIAN_MIN_VARIANCE)
    x = np.random.default_rng(seed).normal(size=dim)
    x *= norm / np.linalg.norm(x)
    y = ddp.rotate(ddp.clip_l2(x, p.clip), rotation_seed) * p.gamma
    mask = p.modulus - 1
    std = math.sqrt(p.local_variance)
    for noise in (False, True) if noisy_too or not native else (False,):
        got = ddp.encode(x, p, rotation_seed, np.random.default_rng(seed), noise=noise, native=native)
        draws = reference_draws(native, seed, p.padded_dim, noise)
        for _ in range(ddp.DEFAULT_MAX_ROUNDING_TRIES):  # an input at the clip may need another try
            uniforms, normals = draws()
            sum_ = y + uniforms
            rounded = np.floor(sum_)
            if float(np.dot(rounded, rounded)) <= p.sensitivity**2:
                break
        expected = rounded.astype(np.int64)
        if noise and native:
            expected += np.rint(normals * std).astype(np.int64)
        elif noise:
            expected += ddp.sample_noise(p.mechanism, p.local_variance, p.padded_dim, draws.gen)  # type: ignore[attr-defined]
        expected &= mask
        settled = np.abs(sum_ - np.rint(sum_)) > 1e-6 * (1.0 + np.abs(y).max())
        np.testing.assert_array_equal(got[settled], expected[settled])
        assert ((ddp.to_signed((got - expected) & mask, p.modulus)[~settled]) ** 2 <= 1).all()


def test_the_noisy_sum_of_the_largest_group_stays_inside_the_sized_modulus() -> None:
    rng = np.random.default_rng(1)
    p = ddp.calibrate(
        noise_multiplier=1.0,
        clip=1.0,
        dim=4096,
        bitwidth=16,
        min_devices=20,
        max_devices=25,
    )
    updates = [rng.normal(size=4096) for _ in range(25)]
    signed = sum(ddp.to_signed(ddp.encode(u, p, 3, rng), p.modulus) for u in updates)
    total = ddp.to_signed(sum_encodings([ddp.encode(u, p, 3, rng) for u in updates], p.modulus), p.modulus)
    assert np.abs(np.asarray(signed)).max() <= p.wrap_bound() < p.modulus / 2
    assert np.abs(total).max() <= p.wrap_bound()


def test_a_modulus_one_bit_short_of_the_wrap_bound_is_refused_naming_the_bitwidth() -> None:
    p = ddp.calibrate(noise_multiplier=1.0, clip=1.0, dim=1000, bitwidth=20, min_devices=50)
    needed = math.ceil(math.log2(2 * p.wrap_bound() + 1))
    ddp.DDPParams(**{**p.__dict__, "bitwidth": needed}).check_modulus()
    short = ddp.DDPParams(**{**p.__dict__, "bitwidth": needed - 1})
    with pytest.raises(ddp.ModulusTooSmall, match=f"raise bitwidth to at least {needed}"):
        short.check_modulus()
    with pytest.raises(ddp.ModulusTooSmall, match="bitwidth"):
        ddp.calibrate(noise_multiplier=1.0, clip=1.0, dim=1000, bitwidth=6, min_devices=50)


def test_calibration_refuses_a_bitwidth_that_rounding_would_swamp() -> None:
    p = ddp.calibrate(noise_multiplier=1.0, clip=1.0, dim=2**16, bitwidth=12, min_devices=10)
    assert 1.05 < p.inflation <= 2.0  # 12 bits leave rounding a visible share of the noise
    with pytest.raises(ddp.ModulusTooSmall, match="raise bitwidth"):
        ddp.calibrate(
            noise_multiplier=1.0,
            clip=1.0,
            dim=2**16,
            bitwidth=12,
            min_devices=10,
            max_inflation=1.05,
        )
    with pytest.raises(ddp.ModulusTooSmall, match="raise bitwidth to at least"):
        ddp.calibrate(noise_multiplier=1.0, clip=1.0, dim=2**16, bitwidth=10, min_devices=10)


def skellam_rdp_excess(params: ddp.DDPParams, devices: int, alpha: int) -> float:
    """Agarwal, Kairouz and Liu 2021 (Theorem 3.5): what the Skellam mechanism's Renyi divergence at
    integer order ``alpha`` may exceed the Gaussian's alpha D2^2 / (2 mu) by, for ``devices`` shares."""
    mu = devices * params.local_variance
    d2 = params.sensitivity
    d1 = min(math.sqrt(params.padded_dim) * d2, d2 * d2)  # an integer vector's l1 norm is at most its l2 norm squared
    return min(((2 * alpha - 1) * d2 * d2 + 6 * d1) / (4 * mu * mu), 3 * d1 / (2 * mu))


@SETTINGS
@given(
    z=st.sampled_from([0.3, 1.0, 3.0]),
    bitwidth=st.integers(8, 20),
    dim=st.sampled_from([10, 100, 650]),
    k=st.sampled_from([5, 20, 100]),
)
@example(z=0.3, bitwidth=11, dim=10, k=5)  # a Skellam sum once calibrated with 3.4 times the Gaussian's loss on top
def test_calibrated_skellam_noise_costs_what_the_gaussian_mechanism_it_is_accounted_as_does(
    z: float, bitwidth: int, dim: int, k: int
) -> None:
    try:
        p = ddp.calibrate(
            noise_multiplier=z,
            clip=1.0,
            dim=dim,
            bitwidth=bitwidth,
            min_devices=k,
            max_devices=2 * k,
            mechanism="skellam",
        )
    except ddp.ModulusTooSmall as refused:
        if "Agarwal" in str(refused):  # the bitwidth it names fits
            need = int(str(refused).rsplit("raise bitwidth to at least ", 1)[1])
            ddp.calibrate(
                noise_multiplier=z,
                clip=1.0,
                dim=dim,
                bitwidth=need,
                min_devices=k,
                max_devices=2 * k,
                mechanism="skellam",
            )
        return
    for n in (k, 2 * k):  # any released sum: the fewest shares are the worst
        for alpha in (2, 8, 32, 256):
            gaussian = alpha / (2 * z * z)  # the accountant's
            assert skellam_rdp_excess(p, n, alpha) <= ddp.MAX_DISCRETENESS_SHARE * gaussian


@SETTINGS
@given(
    z=st.sampled_from([0.3, 1.0, 3.0]),
    bitwidth=st.integers(8, 20),
    dim=st.sampled_from([10, 100, 650]),
    k=st.sampled_from([5, 20, 100]),
)
@example(z=1.0, bitwidth=11, dim=10, k=100)  # shares of 0.13, refused: 13 bits fit
def test_calibrated_discrete_gaussian_shares_carry_the_variance_they_are_sized_with(
    z: float, bitwidth: int, dim: int, k: int
) -> None:
    """A discrete Gaussian's variance is below its variance parameter, far below under 1 (a share
    of parameter 0.133, which a group of 100 to 200 devices of 10 parameters at 11 bits was once
    sized with, has variance 0.045): calibrated shares are wide enough that the law's variance, summed exactly,
    is the parameter's, and their sum one discrete Gaussian to within ``MAX_DISCRETENESS_SHARE``; a modulus
    too narrow for that is refused, naming the bitwidth that fits."""
    try:
        p = ddp.calibrate(noise_multiplier=z, clip=1.0, dim=dim, bitwidth=bitwidth, min_devices=k, max_devices=2 * k)
    except ddp.ModulusTooSmall as refused:
        if "too narrow" in str(refused):  # the bitwidth it names fits
            need = int(str(refused).rsplit("raise bitwidth to at least ", 1)[1])
            wide = ddp.calibrate(noise_multiplier=z, clip=1.0, dim=dim, bitwidth=need, min_devices=k, max_devices=2 * k)
            assert wide.discreteness_problem() is None
        return
    kk = np.arange(-80, 81, dtype=np.float64)
    weights = np.exp(-(kk * kk) / (2 * p.local_variance))
    law = float((kk * kk * weights).sum() / weights.sum()) if p.local_variance < 64 else p.local_variance
    assert law >= p.local_variance * (1 - ddp.MAX_DISCRETENESS_SHARE)
    assert p.tau(p.max_devices) * p.padded_dim / 2 <= ddp.MAX_DISCRETENESS_SHARE / z**2


@pytest.mark.parametrize("mechanism", ["gaussian", "skellam"])
def test_the_noise_of_the_fewest_devices_sums_to_the_target_std(
    mechanism: ddp.Mechanism,
) -> None:
    z, clip, n, dim = 1.5, 0.5, 16, 8192
    p = ddp.calibrate(
        noise_multiplier=z,
        clip=clip,
        dim=dim,
        bitwidth=24,
        min_devices=n,
        max_devices=20,
        mechanism=mechanism,
    )
    rng = np.random.default_rng(2)
    zeros = np.zeros(dim)
    out = ddp.decode(
        sum_encodings([ddp.encode(zeros, p, 9, rng) for _ in range(n)], p.modulus),
        p,
        9,
        n,
    )
    target = z * p.sensitivity / p.gamma  # z times the integer sensitivity, in float units
    assert p.central_std(n) == pytest.approx(target, rel=1e-12)
    assert target >= z * clip
    assert out.std() == pytest.approx(target, rel=5 * math.sqrt(2 / dim))
    assert p.effective_noise_multiplier(n) == pytest.approx(z)
    assert p.effective_noise_multiplier(20) > z  # a larger group only adds noise


def test_decode_refuses_more_devices_than_the_modulus_was_sized_for() -> None:
    p = ddp.calibrate(
        noise_multiplier=1.0,
        clip=1.0,
        dim=10,
        bitwidth=20,
        min_devices=5,
        max_devices=8,
    )
    with pytest.raises(ddp.DDPError, match="sized for 1 to 8"):
        ddp.decode(np.zeros(16, dtype=np.int64), p, 0, 9)


def test_params_refuse_out_of_range_values_naming_the_field() -> None:
    with pytest.raises(ddp.DDPError, match="noise_multiplier"):
        ddp.calibrate(noise_multiplier=-1.0, clip=1.0, dim=10, bitwidth=20, min_devices=5)
    with pytest.raises(ddp.DDPError, match="clip"):
        ddp.calibrate(noise_multiplier=1.0, clip=0.0, dim=10, bitwidth=20, min_devices=5)
    with pytest.raises(ddp.DDPError, match="bitwidth"):
        ddp.calibrate(noise_multiplier=1.0, clip=1.0, dim=10, bitwidth=63, min_devices=5)
    with pytest.raises(ddp.DDPError, match="min_devices"):
        ddp.calibrate(
            noise_multiplier=1.0,
            clip=1.0,
            dim=10,
            bitwidth=20,
            min_devices=5,
            max_devices=4,
        )


@SETTINGS
@given(
    bits=st.integers(1, ddp.MAX_BITWIDTH),
    values=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=50),
)
def test_signed_residues_are_the_centered_representatives_for_any_int64(bits: int, values: list[int]) -> None:
    # a power-of-two modulus takes the two's-complement mask, overflow of v + m/2 included
    m = 1 << bits
    expected = [((v % m) + m // 2) % m - m // 2 for v in values]
    assert ddp.to_signed(np.asarray(values, dtype=np.int64), m).tolist() == expected
    if 3 * m < 2**63:  # another modulus takes numpy's mod (within int64)
        assert ddp.to_signed(np.asarray(values, dtype=np.int64), 3 * m).tolist() == [
            v % (3 * m) - (3 * m if v % (3 * m) >= (3 * m) // 2 else 0) for v in values
        ]


def test_the_encodings_rounding_shrinks_an_update_by_a_small_fraction_of_one_integer_unit() -> None:
    """Conditional rounding keeps a rounding only if its norm is within the bound, so it favours
    the shorter ones: the decoded update falls short along its own direction, by 0.04 / gamma to
    0.09 / gamma of the clip as measured from 12 to 32 bits (docs/benchmarks/dp.md), and is
    unbiased across it. At 12 bits for 256 parameters (the coarsest rounding a group of six
    takes), without noise, 800 encodings of one unit vector."""
    p = ddp.calibrate(noise_multiplier=1.0, clip=1.0, dim=256, bitwidth=12, min_devices=5, max_devices=6)
    q = dataclasses.replace(p, local_variance=0.0)  # the rounding alone
    rng = np.random.default_rng(0)
    x = rng.normal(size=256)
    x /= np.linalg.norm(x)
    trials = 800
    mean = sum(ddp.decode(ddp.encode(x, q, 7, rng), q, 7, 1) for _ in range(trials)) / trials
    along = float(mean @ x) - 1.0
    across = float(np.linalg.norm(mean - (mean @ x) * x))
    # each coordinate's rounding error is within +-1 / gamma, of std at most 1 / (2 gamma)
    spread = 0.5 / q.gamma / math.sqrt(trials)
    assert -0.2 / q.gamma < along < 5 * spread
    assert across < 1.5 * spread * math.sqrt(256)  # the sampling's own spread, no bias across
