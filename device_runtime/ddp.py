"""Distributed differential privacy: the device's encoding and the server's decoding, pure numpy.

The distributed discrete Gaussian mechanism of Kairouz, Liu and Steinke 2021 ("The Distributed
Discrete Gaussian Mechanism for Federated Learning with Secure Aggregation"), as TFF's
``ddp_secure_aggregator`` runs it. The server is not trusted with any one update, so each device
adds its share of the noise before Secure Aggregation and the group's sum carries all of it:

1. clip the flat update to L2 norm ``clip`` (its sensitivity);
2. rotate it with a randomized Hadamard transform from a public per-round seed (random signs, then
   a normalized Walsh-Hadamard transform, padded to a power of two), which spreads a spiky vector
   evenly over the coordinates so that a few bits per coordinate hold it;
3. scale by ``gamma`` and round each coordinate randomly to a neighbouring integer, retrying until
   the rounded vector's norm is within the paper's bound (conditional randomized rounding): that
   bound, not ``gamma * clip``, is the sensitivity in the integer domain that the noise covers;
4. add integer noise (discrete Gaussian, Canonne, Kamath and Steinke 2020; or Skellam, Agarwal et
   al. 2021) whose variance is the target's share for the fewest devices the sum may carry;
5. reduce mod ``2^bitwidth`` for Secure Aggregation.

The server maps the modular sum to signed integers, divides by ``gamma``, unrotates and truncates
(``decode``). ``calibrate`` picks ``gamma`` and each device's noise from the target central noise
multiplier and checks that the noisy sum of the largest group never wraps the modulus except with
probability ``wrap_probability`` (a tail bound, stated on ``wrap_bound``).

Values in, values out: randomness comes only from a ``numpy.random.Generator`` or a seed passed
in; no clocks, no I/O. ``encode`` runs in one compiled pass (``ddp_kernel``, from the generator's
draws) where the install built it and the params are ones it covers (``native_covers``), and in
numpy otherwise: the same laws from different draws. The device's noise floor is ``dp_policy``'s;
the server's decode is wired in ``server_stub.ddp_rounds``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import numpy as np
import numpy.typing as npt

from . import ddp_kernel

Mechanism = Literal["gaussian", "skellam"]
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: Kairouz et al.'s conditional rounding parameter: a rounding attempt exceeds the norm bound with
#: probability at most beta (TFF's default, exp(-1/2)); the bound is then ``rounding_bound``.
DEFAULT_BETA = math.exp(-0.5)
#: The largest probability that some coordinate of the noisy sum wraps the modulus (2^-30).
DEFAULT_WRAP_PROBABILITY = 2.0**-30
#: Rounding attempts before ``encode`` gives up: each fails with probability <= beta (0.61^100 < 1e-21).
DEFAULT_MAX_ROUNDING_TRIES = 100
#: The widest modulus: int64 arithmetic on sums of two residues stays exact below 2^62 each.
MAX_BITWIDTH = 62
#: How much more than the Gaussian mechanism at the accountant's noise multiplier z the integer noise
#: may cost, as a fraction of the Gaussian's part, else the round is refused
#: (``DDPParams.discreteness_problem``). Discrete Gaussian shares: their sum is not one discrete
#: Gaussian, and Kairouz et al.'s bound adds tau * padded_dim / 2 to epsilon^2 of the
#: concentrated-DP guarantee, whose Gaussian part is z^-2. Skellam: Agarwal, Kairouz and Liu's
#: Renyi bound at order alpha adds ((2 alpha - 1) D2^2 + 6 D1) / (4 mu^2) to the Gaussian's
#: alpha D2^2 / (2 mu) (mu the summed variance, D2 and D1 the sensitivities, D1 <= min(sqrt(d) D2,
#: D2^2) for integer vectors), at most z^2 (D2^2 + 3 D1) / mu^2 of alpha / (2 z^2). Both vanish at
#: the default bitwidth; they bind at a few bits, small dimensions and small z: a discrete
#: Gaussian share of variance parameter 0.133 has variance 0.045 (it is 0 in 96 draws of 100), and
#: the Skellam term reached 3.4 times the Gaussian part at 11 bits, 10 parameters and z = 0.3.
MAX_DISCRETENESS_SHARE = 1e-3


class DDPError(ValueError):
    """Distributed DP parameters that cannot work; the message names what to change."""


class ModulusTooSmall(DDPError):
    """The noisy sum of the group could wrap the modulus: raise the bitwidth, or lower the clip,
    the noise multiplier or the group size."""


class RoundingFailed(DDPError):
    """Conditional randomized rounding exceeded its norm bound on every try."""


# ---------------------------------------------------------------------------------------------
# Clipping and the randomized Hadamard rotation


def clip_l2(update: npt.ArrayLike, clip: float) -> FloatArray:
    """``update`` as a flat float64 vector scaled down to L2 norm at most ``clip`` (unchanged if
    already within it): the bound on one device's contribution that all DP here rests on."""
    x = np.asarray(update, dtype=np.float64).reshape(-1)
    factor = _clip_factor(x, clip)
    if factor != 1.0:
        x = x * factor
    return x


def _clip_factor(x: FloatArray, clip: float) -> float:
    """What ``clip_l2`` multiplies the flat ``x`` by: clip / norm above the clip, else 1. The norm
    is computed first; only a norm that is not finite needs the pass that tells a NaN or infinite
    entry (refused) from finite entries whose squares overflow (clipped to zero, as before)."""
    if not clip > 0 or not math.isfinite(clip):
        raise DDPError(f"clip must be a positive finite number, got {clip!r}")
    norm = float(np.linalg.norm(x))
    if not math.isfinite(norm) and not np.isfinite(x).all():
        raise DDPError("the update holds NaN or infinite values; a device must not send it")
    return clip / norm if norm > clip else 1.0


def padded_dimension(dim: int) -> int:
    """The power of two the Hadamard transform works on (at least ``dim``, at least 1)."""
    if dim < 1:
        raise DDPError(f"dim must be >= 1, got {dim}")
    return 1 << (dim - 1).bit_length()


def _sign_bytes(seed: int, padded_dim: int) -> npt.NDArray[np.int8]:
    """One byte per coordinate from the round's public seed; its top bit set means sign +1.

    PCG64 from the seed (a 64-bit seed is used whole, not folded to 32 bits), its 64-bit outputs
    read as little-endian bytes. These are the bits ``Generator.integers(0, 2, dtype=np.int8)``
    draws (its bounded method keeps the top bit of each such byte), read straight from the bit
    generator's stream (which numpy keeps stable across versions) at an eighth of the cost."""
    words = np.random.PCG64(seed).random_raw(-(-padded_dim // 8))
    out: npt.NDArray[np.int8] = words.astype("<u8", copy=False).view(np.int8)[:padded_dim]
    return out


def _negated_signs(seed: int, padded_dim: int) -> npt.NDArray[np.int8]:
    """The rotation's signs negated, as int8 -1/+1: an arithmetic shift smears each byte's top bit
    (the sign +1 when set) over the byte (-1), and or-ing in 1 makes the rest +1; two passes over
    one byte per coordinate. The caller undoes the negation in a scalar it multiplies anyway."""
    b = _sign_bytes(seed, padded_dim)
    np.right_shift(b, 7, out=b)
    b |= 1
    return b


def rotation_signs(seed: int, padded_dim: int) -> FloatArray:
    """The rotation's random signs (+1.0/-1.0) from the round's public seed: devices and server
    derive the same ones (``_sign_bytes``)."""
    out: FloatArray = _negated_signs(seed, padded_dim).astype(np.float64)
    np.negative(out, out=out)
    return out


#: The Hadamard transform is applied in factors of at most 2^_FWHT_FACTOR_BITS: H_(2^b) is the
#: Kronecker product of small H's, each a dense matrix product along one axis of the reshaped vector.
#: Measured (docs/benchmarks/dp.md): factors of 16 run 2-5x faster than one butterfly pass per bit
#: (2^17 to 2^20 entries), whose 20 passes over the vector are bound by memory, not arithmetic;
#: factors of 32 or 64 cost more arithmetic than the passes they save.
_FWHT_FACTOR_BITS = 4
#: A flat vector is transformed in blocks of up to 2^_FWHT_BLOCK_BITS entries (128 KiB of float64,
#: within one core's L2 cache; ``_fwht_vector``): every pass of the factors then works in cache and
#: the vector goes through memory once, where whole-vector passes went through it once per factor
#: (docs/benchmarks/dp.md has the stage timings). A sweep of blocks of 2^11 to 2^15 entries and
#: factors of 4 to 32 found no choice more than 4% faster at 2^17 or 2^20.
_FWHT_BLOCK_BITS = 14


@functools.cache
def _hadamard(n: int) -> FloatArray:
    """The unnormalized n x n Sylvester-Hadamard matrix (n a power of two), read-only."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    h.setflags(write=False)
    return h


def _factor_bits(bits: int) -> list[int]:
    """``bits`` split into as few parts of at most ``_FWHT_FACTOR_BITS`` as possible, evenly."""
    parts = max(1, -(-bits // _FWHT_FACTOR_BITS))
    base, extra = divmod(bits, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def fwht(x: npt.ArrayLike) -> FloatArray:
    """The normalized fast Walsh-Hadamard transform along the last axis (length a power of two),
    O(d log d); it is orthonormal and its own inverse.

    H_(2^b) = H_(2^b1) (x) ... (x) H_(2^bm) with every b_i <= 4: the vector, reshaped to
    (2^b1, ..., 2^bm), is multiplied by each small H along its axis (a matrix product numpy hands to
    BLAS), m passes over memory instead of b. A flat vector takes ``_fwht_vector``'s path."""
    y = np.asarray(x, dtype=np.float64)
    if y.ndim == 1:
        _check_power_of_two(y.size)
        return _fwht_vector(y, 1.0 / math.sqrt(y.size))
    return _fwht_owned(y.copy())


def _check_power_of_two(d: int) -> None:
    if d & (d - 1) or d == 0:
        raise DDPError(f"the Hadamard transform needs a power-of-two length, got {d}")


def _fwht_owned(y: FloatArray) -> FloatArray:
    """``fwht`` of a float64 array the caller no longer needs (no defensive copy)."""
    d = y.shape[-1]
    _check_power_of_two(d)
    lead = y.shape[:-1]
    before, after = math.prod(lead), d
    for b in _factor_bits(d.bit_length() - 1):
        n = 1 << b
        after //= n
        h = _hadamard(n)
        if after == 1:
            y = y.reshape(before, n) @ h
        elif before == 1:
            y = h @ y.reshape(n, after)
        else:
            y = np.matmul(h, y.reshape(before, n, after))
        before *= n
    out: FloatArray = y.reshape(*lead, d)
    out *= 1.0 / math.sqrt(d)
    return out


#: What ``_fwht_vector`` calls with each transformed block while it is in cache (it may overwrite it).
BlockHook = Callable[[FloatArray], None]


def _fwht_vector(
    source: FloatArray,
    scale: float,
    each_block: BlockHook | None = None,
    *,
    negated_signs: npt.NDArray[np.int8] | None = None,
    length: int | None = None,
) -> FloatArray:
    """``scale`` H (``source`` zero-padded to ``length``, a power of two; default its own length),
    times ``negated_signs`` entry by entry first if given, in a new array; ``source`` is left as it
    is.

    H_(2^b) = (H_R (x) I_C)(I_R (x) H_C) with C = 2^min(b, ``_FWHT_BLOCK_BITS``): the vector is an
    R x C matrix whose rows are the blocks. The outer factor H_R runs over column strips of it, a
    strip (R x w, about one block's worth) gathered from ``source`` (with the signs) into a small
    buffer, transformed there and written once. Then each block goes through H_C's factors as a
    chain of single matrix products H_n (Y_(C/n x n))^T, each of which transforms the last index
    digit and moves it to the front, so that after all of them the digits are back in order, and
    the result goes back in place: the vector is read once and written once, the factors work in
    cache, BLAS gets no batches of tiny matrices, and no page of memory is touched that the result
    does not need. ``scale`` rides on the first factor. ``each_block``, if given, sees every
    finished block while it is in cache (``encode`` rounds it there, in place)."""
    m = source.size
    d = m if length is None else length
    bits = d.bit_length() - 1
    inner = min(bits, _FWHT_BLOCK_BITS)
    cols = 1 << inner
    rows = d // cols
    out = np.empty(d)
    if rows == 1:
        if negated_signs is None:
            out[:m] = source
        else:
            np.multiply(source, negated_signs[:m], out=out[:m])
        out[m:] = 0.0
    else:
        _outer_factor(source, negated_signs, out.reshape(rows, cols), scale)
        scale = 1.0
    sizes = [1 << b for b in reversed(_factor_bits(inner))]
    factors = [_hadamard(n) for n in sizes]
    if scale != 1.0:
        factors[0] = factors[0] * scale
    work = (np.empty(cols), np.empty(cols))
    last = len(sizes) - 1
    for start in range(0, d, cols):
        home = out[start : start + cols]
        src = home
        for i, (n, h) in enumerate(zip(sizes, factors, strict=True)):
            # the last product goes back home (the first one has read it); a lone one cannot
            dst = home if i == last and i > 0 else work[i % 2]
            np.matmul(h, src.reshape(cols // n, n).T, out=dst.reshape(n, cols // n))
            src = dst
        if src is not home:
            home[...] = src
        if each_block is not None:
            each_block(home)
    return out


def _outer_factor(
    source: FloatArray, negated_signs: npt.NDArray[np.int8] | None, out: FloatArray, scale: float
) -> None:
    """``out`` (R x C) = ``scale`` (H_R (x) I_C) applied to ``source`` (times the signs) zero-padded
    to R * C, one column strip at a time: the strip gathered into a buffer of about one block,
    H_R's factors applied to it there, the last one written into ``out``'s strip."""
    rows, cols = out.shape
    m = source.size
    width = max(1, cols // rows)
    full, cut = divmod(m, cols)  # rows wholly from source; the next one has ``cut`` entries
    src_rows = source[: full * cols].reshape(full, cols)
    sign_rows = None if negated_signs is None else negated_signs[: rows * cols].reshape(rows, cols)
    strip = np.zeros((rows, width))  # rows past the source stay zero
    work = (np.empty((rows, width)), np.empty((rows, width)))
    sizes = [1 << b for b in _factor_bits(rows.bit_length() - 1)]
    factors = [_hadamard(n) for n in sizes]
    factors[0] = factors[0] * scale
    for c0 in range(0, cols, width):
        if sign_rows is None:
            strip[:full] = src_rows[:, c0 : c0 + width]
        else:
            np.multiply(src_rows[:, c0 : c0 + width], sign_rows[:full, c0 : c0 + width], out=strip[:full])
        if cut:
            part = strip[full]
            take = min(max(cut - c0, 0), width)
            if take:
                seg = source[full * cols + c0 : full * cols + c0 + take]
                if sign_rows is None:
                    part[:take] = seg
                else:
                    np.multiply(seg, sign_rows[full, c0 : c0 + take], out=part[:take])
            part[take:] = 0.0
        src, before = strip, 1
        for i, (n, h) in enumerate(zip(sizes, factors, strict=True)):
            rest = rows // (before * n) * width
            if i == len(sizes) - 1:  # rest == width: the strip of ``out``, split along its rows
                dst = out[:, c0 : c0 + width].reshape(before, n, width)
            else:
                dst = work[i % 2].reshape(before, n, rest)
            np.matmul(h, src.reshape(before, n, rest), out=dst)
            src, before = dst, before * n


def _rotate_vector(x: FloatArray, seed: int, scale: float, each_block: BlockHook | None = None) -> FloatArray:
    """``scale`` H D x for a flat ``x`` zero-padded to a power of two, the negated signs applied as
    the transform reads ``x`` and undone by ``-scale`` (``_fwht_vector``)."""
    pd = padded_dimension(x.size)
    return _fwht_vector(x, -scale / math.sqrt(pd), each_block, negated_signs=_negated_signs(seed, pd), length=pd)


def rotate(x: npt.ArrayLike, seed: int) -> FloatArray:
    """H D x: pad ``x`` (last axis) with zeros to a power of two, flip signs, transform."""
    v = np.asarray(x, dtype=np.float64)
    d = v.shape[-1]
    pd = padded_dimension(d)
    if v.ndim == 1:
        return _rotate_vector(v, seed, 1.0)
    signs = rotation_signs(seed, pd)
    padded = np.zeros((*v.shape[:-1], pd))
    np.multiply(v, signs[:d], out=padded[..., :d])
    return _fwht_owned(padded)


def unrotate(y: npt.ArrayLike, seed: int, dim: int) -> FloatArray:
    """The inverse of ``rotate``: D H y, truncated to the first ``dim`` entries."""
    return _unrotate(y, seed, dim, 1.0)


def _unrotate(y: npt.ArrayLike, seed: int, dim: int, scale: float) -> FloatArray:
    """``scale`` D H y truncated to ``dim`` (``decode`` folds its division by gamma in)."""
    v = np.asarray(y, dtype=np.float64)
    pd = v.shape[-1]
    if padded_dimension(dim) != pd:
        raise DDPError(f"a rotated vector of length {pd} cannot hold dimension {dim}")
    if v.ndim == 1:
        kernel = ddp_kernel.available()  # the compiled transform where the install built it
        if kernel is not None:
            flat: FloatArray = kernel.fwht(np.ascontiguousarray(v), pd, -scale / math.sqrt(pd))[:dim]
        else:
            flat = _fwht_vector(v, -scale / math.sqrt(pd))[:dim]
        flat *= _negated_signs(seed, pd)[:dim]
        return flat
    out: FloatArray = fwht(v)[..., :dim]
    out *= rotation_signs(seed, pd)[:dim]
    if scale != 1.0:
        out *= scale
    return out


# ---------------------------------------------------------------------------------------------
# Conditional randomized rounding


def rounding_bound(scaled_clip: float, padded_dim: int, beta: float = DEFAULT_BETA) -> float:
    """The L2 norm a rounded vector may have (Kairouz et al. 2021, conditional rounding): for a
    vector of norm at most ``scaled_clip`` (``gamma * clip``) in ``padded_dim`` coordinates,
    min(c + sqrt(d), sqrt(c^2 + d/4 + sqrt(2 ln(1/beta)) (c + sqrt(d)/2))). A randomized
    rounding exceeds it with probability at most ``beta``."""
    if not 0 < beta < 1:
        raise DDPError(f"beta must be in (0, 1), got {beta}")
    c, d = scaled_clip, float(padded_dim)
    loose = c + math.sqrt(d)
    tight = math.sqrt(c * c + d / 4 + math.sqrt(2 * math.log(1 / beta)) * (c + math.sqrt(d) / 2))
    return min(loose, tight)


#: Up to this norm bound, rounding draws U uniform in [0, 1) and takes floor(y + U): floor(y) + 1
#: exactly when U >= 1 - frac(y), so floor(y) + Bernoulli(frac(y)) in one pass fewer than drawing
#: the Bernoulli. In float64 the sum y + U is rounded, which can carry a U within half an ulp of
#: y below 1 - frac(y) up to the next integer: the probability of rounding up exceeds frac(y) by
#: at most ulp(y)/2. An accepted rounding has |y_i| < bound + 1, so that is at most 2^-21 here
#: (2^-26 at bitwidth 32's gamma), below the float64 error of y itself. Above it (bitwidths near
#: 53, where ulp(y) nears 1) the rounding compares U with frac(y) exactly.
FAST_ROUNDING_MAX_BOUND = 2.0**32


def conditional_round(
    y: FloatArray,
    bound: float,
    rng: np.random.Generator,
    max_tries: int = DEFAULT_MAX_ROUNDING_TRIES,
) -> IntArray:
    """Round each entry of ``y`` to floor or ceil, up with probability its fractional part
    (unbiased), and retry until the result's L2 norm is at most ``bound``."""
    v = np.asarray(y, dtype=np.float64)
    out: IntArray = _round_conditionally(v, bound, rng, max_tries, np.empty(v.shape)).astype(np.int64)
    return out


def _round_conditionally(
    y: FloatArray, bound: float, rng: np.random.Generator, max_tries: int, work: FloatArray
) -> FloatArray:
    """``conditional_round`` as float64 integers, in ``work`` (an array of y's shape it may
    overwrite) below ``FAST_ROUNDING_MAX_BOUND``; ``y`` is kept for the retries. The norm check
    is one dot product of the candidate with itself, no further array."""
    fast = bound <= FAST_ROUNDING_MAX_BOUND
    if not fast:
        floor = np.floor(y)
        frac = y - floor
    for _ in range(max_tries):
        if fast:
            rounded = rng.random(out=work)
            rounded += y
            np.floor(rounded, out=rounded)
        else:
            rounded = floor + (rng.random(y.shape) < frac)
        if float(np.dot(rounded.reshape(-1), rounded.reshape(-1))) <= bound * bound:
            return rounded
    raise _rounding_failed(bound, max_tries)


def _rounding_failed(bound: float, tries: int) -> RoundingFailed:
    return RoundingFailed(
        f"randomized rounding exceeded the norm bound {bound:.6g} {tries} times; the input is not "
        "clipped to the params' clip, or beta is too small"
    )


# ---------------------------------------------------------------------------------------------
# Integer noise


def sample_discrete_gaussian(variance: float, size: int, rng: np.random.Generator) -> IntArray:
    """``size`` draws from the discrete Gaussian N_Z(0, ``variance``), P(x) ~ exp(-x^2 / 2 variance).

    Canonne, Kamath and Steinke 2020, Algorithm 3, vectorized: with t = floor(sigma) + 1, draw a
    discrete Laplace Y (P ~ exp(-|y| / t): a geometric magnitude, floor(t E) for E ~ Exp(1), and a
    random sign) and accept it with probability exp(-(|Y| - sigma^2/t)^2 / (2 sigma^2)). The
    geometric and the acceptance test use float64 (as TFF's sampler does; the test draws a second
    exponential and accepts when it exceeds the exponent), so the law is exact up to float64 rounding (``sample_discrete_gaussian_exact`` is the all-rational version, for
    checks). Expected draws per sample are under 2. From ``ROUNDED_GAUSSIAN_MIN_VARIANCE`` on, a
    rounded continuous Gaussian, as close to the law as float64 lets this algorithm be."""
    if size < 0:
        raise DDPError(f"size must be >= 0, got {size}")
    if not variance >= 0 or not math.isfinite(variance):
        raise DDPError(f"variance must be a finite number >= 0, got {variance!r}")
    if variance == 0 or size == 0:
        return np.zeros(size, dtype=np.int64)
    if variance >= ROUNDED_GAUSSIAN_MIN_VARIANCE:
        return _rounded_gaussian(variance, size, rng)
    t = math.floor(math.sqrt(variance)) + 1
    shift, scale = variance / t, 1.0 / (2.0 * variance)
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        m = int((size - filled) * 1.4) + 64  # acceptance is above 3/4 for sigma >~ 1, and >= 1/2 always
        # discrete Laplace: |Y| = floor(t E) with E ~ Exp(1) is geometric, P(|Y| >= k) = exp(-k/t)
        magnitude = rng.standard_exponential(m)
        magnitude *= t
        np.floor(magnitude, out=magnitude)
        z = magnitude - shift
        np.multiply(z, z, out=z)
        z *= scale
        # accept with probability exp(-z): P(E' >= z) = exp(-z) for a second E' ~ Exp(1), which
        # spares computing exp; a random sign from whole random bytes, rejecting "-0" so that 0
        # is not counted twice
        accept = rng.standard_exponential(m) >= z
        negative = np.unpackbits(np.frombuffer(rng.bytes((m + 7) // 8), dtype=np.uint8), count=m).view(np.bool_)
        accept &= ~(negative & (magnitude == 0))
        index = np.flatnonzero(accept)[: size - filled]
        got = magnitude[index]
        np.negative(got, out=got, where=negative[index])
        out[filled : filled + got.size] = got
        filled += got.size
    return out


#: From this variance on, ``sample_discrete_gaussian`` rounds a continuous Gaussian to the nearest
#: integer instead of running CKS's rejection sampler (3-4x faster, one draw per coordinate). The two
#: laws' ratio is 1 + (x^2/sigma^2 - 1) / (24 sigma^2) + O(sigma^-4) (average the Gaussian density over
#: the unit cell around x; the normalizers agree to exp(-2 pi^2 sigma^2) by Poisson summation), so their
#: total variation distance is below 0.03 / sigma^2: at sigma^2 >= 2^48, under 1.1e-16 per coordinate,
#: as small as the float64 rounding the rejection sampler's own acceptance test makes. The devices'
#: shares are far above it (sigma ~ 1e8 at bitwidth 32, the default); small variances keep CKS's exact
#: algorithm.
ROUNDED_GAUSSIAN_MIN_VARIANCE = 2.0**48


def _rounded_gaussian(variance: float, size: int, rng: np.random.Generator) -> IntArray:
    """N(0, variance) rounded to the nearest integer: the discrete Gaussian within total variation
    0.03 / variance per draw (see ``ROUNDED_GAUSSIAN_MIN_VARIANCE``)."""
    z = rng.standard_normal(size)
    z *= math.sqrt(variance)
    np.rint(z, out=z)
    out: IntArray = z.astype(np.int64)
    return out


#: From this variance on, ``sample_skellam`` draws a rounded continuous Gaussian instead of the
#: difference of two Poisson draws. numpy's Poisson sampler (PTRS) decides acceptance by comparing
#: -lam + k log(lam) - lgamma(k + 1), terms of size lam log(lam), in float64: their rounding error,
#: 1e-8 at lam = 2^23, grows with lam until the law is wrong (measured, 400,000 draws: a KS p-value of
#: 7e-7 at lam = 1e14; at the default bitwidth's share variance of about 7e15, variance 0.89 of the
#: asked and excess kurtosis 0.63, p = 1e-110), where the noise must follow the law its accounting
#: assumes. The rounded Gaussian is within total variation 0.074 / variance of Skellam(variance)
#: (computed exactly for variances 4 to 1024, a constant 0.073-0.078 times 1 / variance: the two laws
#: share their odd moments, and Skellam's excess kurtosis is 1 / variance), 4.4e-9 here and below
#: 1e-16 at the shares' usual variances: no larger than the float64 error of the Poisson draws it
#: replaces at this variance, which only grows above it.
SKELLAM_ROUNDED_GAUSSIAN_MIN_VARIANCE = 2.0**24


def sample_skellam(variance: float, size: int, rng: np.random.Generator) -> IntArray:
    """``size`` draws from the symmetric Skellam law of this variance: Poisson(v/2) - Poisson(v/2)
    (Agarwal, Kairouz and Liu 2021). Sums of Skellam variables are Skellam, so n devices' shares
    add to the target's law (the discrete Gaussian's sum is only close to one). From
    ``SKELLAM_ROUNDED_GAUSSIAN_MIN_VARIANCE`` on, a rounded continuous Gaussian, within total
    variation 0.074 / variance of the law, where float64 Poisson draws drift from it."""
    if size < 0:
        raise DDPError(f"size must be >= 0, got {size}")
    if not variance >= 0 or not math.isfinite(variance):
        raise DDPError(f"variance must be a finite number >= 0, got {variance!r}")
    if variance >= SKELLAM_ROUNDED_GAUSSIAN_MIN_VARIANCE:
        return _rounded_gaussian(variance, size, rng)
    lam = variance / 2.0
    out: IntArray = (rng.poisson(lam, size) - rng.poisson(lam, size)).astype(np.int64)
    return out


def _uniform_below(n: int, rng: np.random.Generator) -> int:
    """A uniform integer in [0, n) for any positive Python int (rejection on whole bytes)."""
    if n <= 1 << 62:
        return int(rng.integers(0, n))
    nbytes = (n.bit_length() + 7) // 8
    limit = (1 << (8 * nbytes)) - ((1 << (8 * nbytes)) % n)
    while True:
        v = int.from_bytes(rng.bytes(nbytes), "big")
        if v < limit:
            return v % n


def _bernoulli(p: Fraction, rng: np.random.Generator) -> bool:
    return _uniform_below(p.denominator, rng) < p.numerator


def _bernoulli_exp(gamma: Fraction, rng: np.random.Generator) -> bool:
    """Bernoulli(exp(-gamma)) for rational gamma >= 0, exactly (CKS 2020, Algorithm 1)."""
    while gamma > 1:
        if not _bernoulli_exp(Fraction(1), rng):
            return False
        gamma -= 1
    k = 1
    while _bernoulli(gamma / k, rng):
        k += 1
    return k % 2 == 1


def _discrete_laplace_exact(t: int, rng: np.random.Generator) -> int:
    """P(y) ~ exp(-|y| / t) for integer t >= 1, exactly (CKS 2020, Algorithm 2 with s = 1)."""
    while True:
        u = _uniform_below(t, rng)
        if not _bernoulli_exp(Fraction(u, t), rng):
            continue
        v = 0
        while _bernoulli_exp(Fraction(1), rng):
            v += 1
        y = u + t * v
        negative = _bernoulli(Fraction(1, 2), rng)
        if negative and y == 0:
            continue
        return -y if negative else y


def sample_discrete_gaussian_exact(variance: Fraction | int, size: int, rng: np.random.Generator) -> IntArray:
    """The discrete Gaussian in rational arithmetic throughout (CKS 2020, Algorithm 3): exact for
    a rational variance, but pure Python (tens of microseconds a draw): the reference that
    ``sample_discrete_gaussian`` is checked against, not the device's sampler."""
    s2 = Fraction(variance)
    if s2 < 0:
        raise DDPError(f"variance must be >= 0, got {variance}")
    if s2 == 0:
        return np.zeros(size, dtype=np.int64)
    t = math.isqrt(s2.numerator // s2.denominator) + 1  # floor(sqrt(s2)) + 1, exactly
    out = np.empty(size, dtype=np.int64)
    for i in range(size):
        while True:
            y = _discrete_laplace_exact(t, rng)
            gamma = (abs(y) - s2 / t) ** 2 / (2 * s2)
            if _bernoulli_exp(gamma, rng):
                out[i] = y
                break
    return out


def sample_noise(mechanism: Mechanism, variance: float, size: int, rng: np.random.Generator) -> IntArray:
    if mechanism == "gaussian":
        return sample_discrete_gaussian(variance, size, rng)
    if mechanism == "skellam":
        return sample_skellam(variance, size, rng)
    raise DDPError(f"mechanism must be 'gaussian' or 'skellam', got {mechanism!r}")


# ---------------------------------------------------------------------------------------------
# Parameters, calibration and the wrap-around bound


def wrap_bound(
    *,
    gamma: float,
    clip: float,
    padded_dim: int,
    devices: int,
    local_variance: float,
    mechanism: Mechanism,
    wrap_probability: float,
) -> float:
    """A bound B on every coordinate of the integer sum of ``devices`` honest encodings: all
    |S_j| <= B except with probability ``wrap_probability``. The modulus must exceed 2B.

    Three parts, the probability split evenly between the two random ones (union bound over the
    ``padded_dim`` coordinates): the rotated signal, gamma (H D v)_j with ||v|| <= devices * clip,
    is sub-Gaussian over the random signs with variance proxy gamma^2 ||v||^2 / d (Hoeffding;
    it assumes updates chosen without knowing the signs, as an honest device's are); rounding
    moves each device's coordinate by less than 1; the noise, a sum of ``devices`` shares, is
    sub-Gaussian with proxy devices * variance for the discrete Gaussian (CKS 2020) and meets
    Bernstein's bound with b = 1 for Skellam. A malicious device can make the sum wrap; that
    costs accuracy, not privacy, and the server's check of the decoded sum drops such a round."""
    d = float(padded_dim)
    log_term = math.log(4.0 * d / wrap_probability)
    signal = gamma * devices * clip * math.sqrt(2.0 * log_term / d)
    rounding = float(devices)
    total_var = devices * local_variance
    if mechanism == "gaussian":
        noise = math.sqrt(2.0 * total_var * log_term)
    else:
        noise = log_term / 3.0 + math.sqrt(log_term * log_term / 9.0 + 2.0 * log_term * total_var)
    return signal + rounding + noise


@dataclass(frozen=True)
class DDPParams:
    """What every device of a round and the server agree on (the round's plan sends it).

    ``gamma``: integer units per float unit; ``local_variance``: each device's noise variance in
    the integer domain, sized so that ``min_devices`` shares add to (``noise_multiplier`` x the
    integer sensitivity)^2; the modulus is ``2^bitwidth``, checked against ``max_devices``."""

    dim: int
    clip: float
    noise_multiplier: float
    gamma: float
    local_variance: float
    bitwidth: int
    min_devices: int
    max_devices: int
    mechanism: Mechanism = "gaussian"
    beta: float = DEFAULT_BETA
    wrap_probability: float = DEFAULT_WRAP_PROBABILITY

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise DDPError(f"dim must be >= 1, got {self.dim}")
        if not (self.clip > 0 and math.isfinite(self.clip)):
            raise DDPError(f"clip must be a positive finite number, got {self.clip!r}")
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise DDPError(f"noise_multiplier must be a finite number >= 0, got {self.noise_multiplier!r}")
        if not (self.gamma > 0 and math.isfinite(self.gamma)):
            raise DDPError(f"gamma must be a positive finite number, got {self.gamma!r}")
        if not (self.local_variance >= 0 and math.isfinite(self.local_variance)):
            raise DDPError(f"local_variance must be a finite number >= 0, got {self.local_variance!r}")
        if not 1 <= self.bitwidth <= MAX_BITWIDTH:
            raise DDPError(f"bitwidth must be in [1, {MAX_BITWIDTH}], got {self.bitwidth}")
        if not 1 <= self.min_devices <= self.max_devices:
            raise DDPError(f"need 1 <= min_devices <= max_devices, got {self.min_devices}, {self.max_devices}")
        if self.mechanism not in ("gaussian", "skellam"):
            raise DDPError(f"mechanism must be 'gaussian' or 'skellam', got {self.mechanism!r}")
        if not 0 < self.beta < 1:
            raise DDPError(f"beta must be in (0, 1), got {self.beta}")
        if not 0 < self.wrap_probability < 1:
            raise DDPError(f"wrap_probability must be in (0, 1), got {self.wrap_probability}")

    @property
    def padded_dim(self) -> int:
        return padded_dimension(self.dim)

    @property
    def modulus(self) -> int:
        return 1 << self.bitwidth

    @property
    def sensitivity(self) -> float:
        """One device's L2 sensitivity in the integer domain: the conditional rounding bound."""
        return rounding_bound(self.gamma * self.clip, self.padded_dim, self.beta)

    @property
    def inflation(self) -> float:
        """How much rounding widens the sensitivity (and so the noise) over ``gamma * clip``."""
        return self.sensitivity / (self.gamma * self.clip)

    def central_std(self, devices: int) -> float:
        """The float-domain std of each coordinate of the decoded sum of ``devices`` devices."""
        return math.sqrt(devices * self.local_variance) / self.gamma

    def effective_noise_multiplier(self, devices: int) -> float:
        """The noise the sum of ``devices`` devices carries, over the integer sensitivity: at least
        ``noise_multiplier`` once ``devices >= min_devices`` (the accountant's z)."""
        return math.sqrt(devices * self.local_variance) / self.sensitivity

    def tau(self, devices: int) -> float:
        """Kairouz et al.'s tau for ``devices`` discrete Gaussian shares: how far their sum is from
        one discrete Gaussian, 10 sum_{k<n} exp(-2 pi^2 sigma^2 k / (k+1)). Their concentrated-DP
        bound adds tau * padded_dim / 2 to epsilon^2; keep it negligible (local std >~ 2)."""
        s2 = self.local_variance
        return 10.0 * sum(math.exp(-2.0 * math.pi**2 * s2 * k / (k + 1)) for k in range(1, devices))

    def discreteness_problem(self, noise_multiplier: float | None = None, fewest: int | None = None) -> str | None:
        """Why a released sum's integer noise costs more than ``MAX_DISCRETENESS_SHARE`` beyond the
        Gaussian mechanism at ``noise_multiplier`` (default the params'; a device passes its floor
        if higher) that the round is accounted as, or None. Discrete Gaussian: ``tau *
        padded_dim / 2`` of up to ``max_devices`` shares (tau grows with the shares summed) against
        z^-2. Skellam: z^2 (D2^2 + 3 D1) / mu^2, mu the variance of ``fewest`` shares (default
        ``min_devices``; the term shrinks as mu grows). Without noise there is no claim to check."""
        z = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        if z == 0:
            return None
        if self.mechanism == "skellam":
            d2 = self.sensitivity
            d1 = min(math.sqrt(self.padded_dim) * d2, d2 * d2)
            mu = (self.min_devices if fewest is None else fewest) * self.local_variance
            if mu > 0 and z * z * (d2 * d2 + 3.0 * d1) <= MAX_DISCRETENESS_SHARE * mu * mu:
                return None  # products only: z^2 may underflow
            return (
                f"the Skellam noise of {self.min_devices if fewest is None else fewest} devices (variance {mu:.3g}) "
                f"is too small for sensitivity {d2:.3g}: Agarwal et al.'s bound adds more than "
                f"{MAX_DISCRETENESS_SHARE:g} of the Gaussian mechanism's privacy loss at noise multiplier {z:g}"
            )
        tau = self.tau(self.max_devices)
        excess = tau * self.padded_dim / 2.0
        if excess * z * z <= MAX_DISCRETENESS_SHARE:  # no division: z^2 may underflow
            return None
        return (
            f"each device's discrete Gaussian share has variance {self.local_variance:.3g}, too narrow for the "
            f"sum of {self.max_devices} to be one discrete Gaussian (Kairouz et al.'s tau {tau:.3g}): it adds "
            f"{excess:.3g} to epsilon^2, more than {MAX_DISCRETENESS_SHARE:g} of the 1 / z^2 of noise multiplier {z:g}"
        )

    def wrap_bound(self, devices: int | None = None) -> float:
        return wrap_bound(
            gamma=self.gamma,
            clip=self.clip,
            padded_dim=self.padded_dim,
            devices=self.max_devices if devices is None else devices,
            local_variance=self.local_variance,
            mechanism=self.mechanism,
            wrap_probability=self.wrap_probability,
        )

    def check_modulus(self, devices: int | None = None) -> None:
        """Raise ``ModulusTooSmall`` if the noisy sum of ``devices`` (default ``max_devices``)
        encodings could wrap ``2^bitwidth`` beyond ``wrap_probability``."""
        n = self.max_devices if devices is None else devices
        bound = self.wrap_bound(n)
        if 2.0 * bound + 1.0 > self.modulus:
            raise ModulusTooSmall(
                f"the noisy sum of {n} devices reaches +-{bound:.6g} per coordinate (except with probability "
                f"{self.wrap_probability:.3g}), which wraps the modulus 2^{self.bitwidth}: raise bitwidth to at "
                f"least {math.ceil(math.log2(2.0 * bound + 1.0))}, or lower gamma, the clip, the noise multiplier "
                "or the group size"
            )


def calibrate(
    *,
    noise_multiplier: float,
    clip: float,
    dim: int,
    bitwidth: int,
    min_devices: int,
    max_devices: int | None = None,
    mechanism: Mechanism = "gaussian",
    beta: float = DEFAULT_BETA,
    wrap_probability: float = DEFAULT_WRAP_PROBABILITY,
    max_inflation: float = 2.0,
) -> DDPParams:
    """The parameters for a target central noise multiplier ``noise_multiplier`` (z).

    ``min_devices``: the fewest devices whose noise the released sum carries (the group's minimum
    size minus the drop-outs it may lose): each device's share is 1/``min_devices`` of the total
    variance (z x sensitivity)^2, so any sum of at least that many carries the target.
    ``max_devices``: the most devices a sum may hold (the group's size; default ``min_devices``):
    the modulus must hold their noisy sum. The integer sensitivity is the conditional-rounding
    bound, so the float-domain noise on the sum is at least z * clip (``inflation`` says how much
    more). ``gamma`` is the largest that keeps the sum within the modulus (``wrap_bound``); a
    modulus too small for any gamma, or one that leaves rounding inflating the noise more than
    ``max_inflation`` times, raises ``ModulusTooSmall`` naming the bitwidth to use.

    Integer noise that costs more than the Gaussian mechanism it is accounted as
    (``DDPParams.discreteness_problem``: discrete Gaussian shares too narrow for their sum to be one
    discrete Gaussian, Skellam noise small beside its sensitivity) raises ``ModulusTooSmall`` too: a
    wider modulus takes a larger gamma, so more noise in integer units."""

    def fit(bits: int) -> DDPParams:
        return _calibrate(
            noise_multiplier,
            clip,
            dim,
            bits,
            min_devices,
            max_devices,
            mechanism,
            beta,
            wrap_probability,
            max_inflation,
        )

    chosen = fit(bitwidth)
    narrow = chosen.discreteness_problem()
    if narrow is not None:
        need = next((b for b in range(bitwidth + 1, MAX_BITWIDTH + 1) if _wide_enough(fit, b)), None)
        fix = f"raise bitwidth to at least {need}" if need is not None else "raise the noise multiplier"
        raise ModulusTooSmall(f"{narrow}: {fix}")
    return chosen


def _wide_enough(fit: Callable[[int], DDPParams], bits: int) -> bool:
    try:
        return fit(bits).discreteness_problem() is None
    except DDPError:
        return False


def _calibrate(
    noise_multiplier: float,
    clip: float,
    dim: int,
    bitwidth: int,
    min_devices: int,
    max_devices: int | None,
    mechanism: Mechanism,
    beta: float,
    wrap_probability: float,
    max_inflation: float,
) -> DDPParams:
    """``calibrate`` but for the shares' width."""
    n_max = min_devices if max_devices is None else max_devices
    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise DDPError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    if not (clip > 0 and math.isfinite(clip)):
        raise DDPError(f"clip must be a positive finite number, got {clip!r}")
    if not 1 <= min_devices <= n_max:
        raise DDPError(f"need 1 <= min_devices <= max_devices, got {min_devices}, {n_max}")
    if not 1 <= bitwidth <= MAX_BITWIDTH:
        raise DDPError(f"bitwidth must be in [1, {MAX_BITWIDTH}], got {bitwidth}")
    pd = padded_dimension(dim)

    def params(gamma: float) -> DDPParams:
        sens = rounding_bound(gamma * clip, pd, beta)
        var = (noise_multiplier * sens) ** 2 / min_devices
        return DDPParams(
            dim=dim,
            clip=clip,
            noise_multiplier=noise_multiplier,
            gamma=gamma,
            local_variance=var,
            bitwidth=bitwidth,
            min_devices=min_devices,
            max_devices=n_max,
            mechanism=mechanism,
            beta=beta,
            wrap_probability=wrap_probability,
        )

    half = (1 << bitwidth) / 2.0

    def fits(gamma: float) -> bool:
        return 2.0 * params(gamma).wrap_bound() + 1.0 <= 2.0 * half

    lo = 1e-12 / clip
    if not fits(lo):
        params(lo).check_modulus()  # raises, naming the bitwidth the smallest gamma needs
    hi = lo
    while fits(hi * 2.0):
        hi *= 2.0
        if hi > 1e300:
            break
    hi *= 2.0
    for _ in range(200):  # bisect in log space: the bound is increasing in gamma
        mid = math.sqrt(lo * hi)
        if fits(mid):
            lo = mid
        else:
            hi = mid
        if hi / lo < 1.0 + 1e-12:
            break
    chosen = params(lo)
    if chosen.inflation > max_inflation:
        need = bitwidth + math.ceil(math.log2(max(chosen.inflation, 2.0))) + 1
        raise ModulusTooSmall(
            f"with bitwidth {bitwidth} the rounding of {pd} coordinates widens the sensitivity "
            f"{chosen.inflation:.3g}x over the clip (at most {max_inflation:g} allowed): raise bitwidth "
            f"(to about {need}), or lower the dimension, the noise multiplier or the group size"
        )
    return chosen


# ---------------------------------------------------------------------------------------------
# Encode (device) and decode (server)


def encode(
    update: npt.ArrayLike,
    params: DDPParams,
    seed: int,
    rng: np.random.Generator,
    *,
    noise: bool = True,
    max_tries: int = DEFAULT_MAX_ROUNDING_TRIES,
    native: bool | None = None,
) -> IntArray:
    """One device's contribution: clip, rotate with the round's ``seed``, scale by gamma, round
    conditionally, add this device's noise share, reduce mod 2^bitwidth (int64 in [0, modulus)).

    ``noise=False`` leaves the noise out (for tests of the rest; a device never does). ``native``:
    the compiled kernel (``ddp_kernel``, the same laws from its own generator, seeded from ``rng``)
    where it covers the case (``native_covers``), else numpy (None, the default); True insists on the
    kernel (``ddp_kernel.KernelMissing`` or ``DDPError`` if it cannot), False on numpy."""
    x = np.ascontiguousarray(update, dtype=np.float64).reshape(-1)
    if x.size != params.dim:
        raise DDPError(f"the update has {x.size} entries; the params are for {params.dim}")
    bound = params.sensitivity
    scale = _clip_factor(x, params.clip) * params.gamma
    if native is not False:
        kernel = ddp_kernel.load() if native else ddp_kernel.available()
        if kernel is not None and native_covers(params, noise):
            return _encode_native(kernel, x, params, seed, scale, ddp_kernel.new_state(rng), noise, max_tries)
        if native:
            raise DDPError("the compiled encoding does not cover these params (see ddp.native_covers)")
    rng = _private_generator(rng)
    # clip, rotate and scale by gamma in one transform (the clip factor and gamma ride on its
    # scalar); below FAST_ROUNDING_MAX_BOUND the first rounding attempt runs block by block as the
    # transform finishes each one, while it is in cache, in place: one array for the whole encoding
    first = _BlockRounding(rng) if bound <= FAST_ROUNDING_MAX_BOUND else None
    y = _rotate_vector(x, seed, scale, first)
    if first is not None and first.norm2 <= bound * bound:
        rounded = y
    else:
        if first is not None:
            if max_tries <= 1:
                raise _rounding_failed(bound, max_tries)
            y = _rotate_vector(x, seed, scale)  # the attempt overwrote it: the same rotation again
        rounded = _round_conditionally(y, bound, rng, max_tries - (first is not None), np.empty_like(y))
    std = math.sqrt(params.local_variance)
    mask = params.modulus - 1  # mod a power of two: two's complement makes this right for q < 0 too
    if (
        noise
        and params.mechanism == "gaussian"
        and params.local_variance >= ROUNDED_GAUSSIAN_MIN_VARIANCE
        and _FUSED_NOISE_SIGMAS * std + bound <= 2.0**53
    ):
        return _add_rounded_gaussian(rounded, std, rng, mask)
    q = rounded.astype(np.int64)
    if noise:
        q += sample_noise(params.mechanism, params.local_variance, q.size, rng)
    q &= mask
    return q


#: The compiled encoding adds the noise in int64: a share's standard normal beyond 64 (none of the
#: ziggurat's come near it) plus the rounded entry must stay below 2^62, as must the rounding's bound.
_NATIVE_MAX = 2.0**62


def native_covers(params: DDPParams, noise: bool = True) -> bool:
    """Whether the compiled encoding runs these params: the fast rounding (a norm bound up to
    ``FAST_ROUNDING_MAX_BOUND``) and, with noise, the rounded Gaussian share (the discrete Gaussian
    at a variance from ``ROUNDED_GAUSSIAN_MIN_VARIANCE`` on). Skellam and small variances are numpy's."""
    bound = params.sensitivity
    if bound > FAST_ROUNDING_MAX_BOUND:
        return False
    if not noise:
        return True
    std = math.sqrt(params.local_variance)
    return (
        params.mechanism == "gaussian"
        and params.local_variance >= ROUNDED_GAUSSIAN_MIN_VARIANCE
        and _FUSED_NOISE_SIGMAS * std + bound + 1.0 < _NATIVE_MAX
    )


def _encode_native(
    kernel: ddp_kernel.Kernel,
    x: FloatArray,
    params: DDPParams,
    seed: int,
    scale: float,
    state: ddp_kernel.State,
    noise: bool,
    max_tries: int,
) -> IntArray:
    """``encode`` in one compiled pass per attempt: each attempt rotates ``x`` again and draws
    fresh uniforms (and noise) from ``state``; the first whose rounding is within the bound is it."""
    pd = params.padded_dim
    bound = params.sensitivity
    negated = _negated_signs(seed, pd)
    out = np.empty(pd)
    std = math.sqrt(params.local_variance)
    for _ in range(max_tries):
        norm2 = kernel.encode(x, negated, pd, -scale / math.sqrt(pd), state, std, params.modulus - 1, noise, out)
        if norm2 <= bound * bound:
            q: IntArray = out.view(np.int64)
            return q
    raise _rounding_failed(bound, max_tries)


def _private_generator(rng: np.random.Generator) -> np.random.Generator:
    """The generator ``encode`` draws the rounding and the noise from: SFC64 seeded with 256 bits of
    ``rng``. Measured (docs/benchmarks/dp.md) 14-24% faster than PCG64 for the uniforms and the
    Gaussians that are most of the encoding's draws (Philox and MT19937 are slower). Its outputs are
    a function of ``rng``'s, so they are exactly as unpredictable to the server as ``rng`` is: the
    device's runtime seeds ``rng`` from its own entropy and the server sees no output of either."""
    return np.random.Generator(np.random.SFC64(rng.integers(0, 2**64, size=4, dtype=np.uint64)))


class _BlockRounding:
    """``encode``'s first rounding attempt, one block of the rotated vector at a time: floor(y + U)
    in place of the block (``FAST_ROUNDING_MAX_BOUND``), the squared norm summed as it goes."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.norm2 = 0.0
        self.uniform = np.empty(0)

    def __call__(self, y: FloatArray) -> None:
        if self.uniform.size != y.size:
            self.uniform = np.empty(y.size)
        u = self.rng.random(out=self.uniform)
        y += u
        np.floor(y, out=y)
        self.norm2 += float(np.dot(y, y))


def _add_rounded_gaussian(rounded: FloatArray, std: float, rng: np.random.Generator, mask: int) -> IntArray:
    """``rounded`` plus ``_rounded_gaussian`` noise of this std, mod ``mask + 1``, as int64 in the
    memory of ``rounded``: block by block, the noise drawn into a block-sized buffer and added in
    float64, where both are integers and so is their sum, exactly, below 2^53 (``encode`` checks)."""
    q: IntArray = rounded.view(np.int64)
    block = min(rounded.size, 1 << _FWHT_BLOCK_BITS)
    z = np.empty(block)
    for start in range(0, rounded.size, block):
        rng.standard_normal(out=z)
        z *= std
        np.rint(z, out=z)
        z += rounded[start : start + block]
        out = q[start : start + block]
        np.copyto(out, z, casting="unsafe")  # over the rounded block z has just read
        out &= mask
    return q


#: ``encode`` adds the noise to the rounded vector in float64 when every sum is an integer below
#: 2^53 and so exact: a share's standard Gaussian beyond 64 (numpy's sampler returns none beyond
#: about 14; an ideal one with probability under 1e-890) is all it would take to break that.
_FUSED_NOISE_SIGMAS = 64.0


def add_mod(total: npt.ArrayLike, encoding: npt.ArrayLike, modulus: int) -> IntArray:
    """The modular sum Secure Aggregation computes, one encoding at a time (exact in int64)."""
    out: IntArray = np.mod(
        np.asarray(total, dtype=np.int64) + np.asarray(encoding, dtype=np.int64),
        modulus,
    )
    return out


def to_signed(sum_mod: npt.ArrayLike, modulus: int) -> IntArray:
    """Residues in [0, modulus) to integers in [-modulus/2, modulus/2)."""
    if modulus & (modulus - 1) == 0 and modulus <= 1 << MAX_BITWIDTH:
        # a power of two: ((v + m/2) mod m) - m/2 as a mask in two's complement, two passes
        half = modulus // 2
        signed: IntArray = np.add(sum_mod, half, dtype=np.int64)
        signed &= modulus - 1
        signed -= half
        return signed
    v = np.mod(np.asarray(sum_mod, dtype=np.int64), modulus)
    out: IntArray = np.where(v >= modulus // 2, v - modulus, v)
    return out


def decode(sum_mod: npt.ArrayLike, params: DDPParams, seed: int, n: int) -> FloatArray:
    """The float sum of ``n`` devices' clipped updates (plus the noise) from the modular sum of
    their encodings: signed, divided by gamma, unrotated, truncated to ``params.dim``. The caller
    divides by ``n`` for the mean. ``n`` above ``max_devices`` is refused: the modulus was not
    sized for it, so a wrapped sum could not be told from a real one."""
    if not 1 <= n <= params.max_devices:
        raise DDPError(f"the params were sized for 1 to {params.max_devices} devices, not {n}")
    v = np.asarray(sum_mod, dtype=np.int64).reshape(-1)
    if v.size != params.padded_dim:
        raise DDPError(f"the sum has {v.size} entries; the params encode {params.padded_dim}")
    signed = to_signed(v, params.modulus).astype(np.float64)
    return _unrotate(signed, seed, params.dim, 1.0 / params.gamma)  # the division by gamma in the transform


__all__ = [
    "DEFAULT_BETA",
    "DEFAULT_WRAP_PROBABILITY",
    "DDPError",
    "DDPParams",
    "FAST_ROUNDING_MAX_BOUND",
    "MAX_DISCRETENESS_SHARE",
    "Mechanism",
    "ModulusTooSmall",
    "ROUNDED_GAUSSIAN_MIN_VARIANCE",
    "SKELLAM_ROUNDED_GAUSSIAN_MIN_VARIANCE",
    "RoundingFailed",
    "add_mod",
    "calibrate",
    "clip_l2",
    "conditional_round",
    "decode",
    "encode",
    "fwht",
    "native_covers",
    "padded_dimension",
    "rotate",
    "rotation_signs",
    "rounding_bound",
    "sample_discrete_gaussian",
    "sample_discrete_gaussian_exact",
    "sample_noise",
    "sample_skellam",
    "to_signed",
    "unrotate",
    "wrap_bound",
]
