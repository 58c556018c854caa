"""Shamir secret sharing over GF(p), p = 2^31 - 1, vectorised with numpy.

Why this field: every product of two field elements fits in a uint64 (< 2^62), so sharing and
reconstruction are plain numpy array arithmetic with no Python big ints. A 32-byte secret is
split into ``LIMBS`` = 9 limbs of 30 bits (270 >= 256 bits); each limb is shared with its own
polynomial but all limbs and all secrets share one Horner loop. Evaluation points are the
holders' client ids (1 <= id < p).

Lagrange coefficients at 0 depend only on the set of holders, so they are computed once per
holder set (vectorised over many sets) and reused for every secret reconstructed from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

P = (1 << 31) - 1
LIMB_BITS = 30
LIMBS = 9  # 9 * 30 = 270 bits >= 256
SECRET_BYTES = 32
_LIMB_MASK = (1 << LIMB_BITS) - 1
_P64 = np.uint64(P)


def secret_to_limbs(secret: bytes) -> np.ndarray:
    """32 bytes -> LIMBS field elements (little-endian 30-bit chunks)."""
    if len(secret) != SECRET_BYTES:
        raise ValueError("secret must be 32 bytes")
    v = int.from_bytes(secret, "little")
    return np.array([(v >> (LIMB_BITS * i)) & _LIMB_MASK for i in range(LIMBS)], dtype=np.uint64)


def limbs_to_secret(limbs: Sequence[int] | np.ndarray) -> bytes:
    """Inverse of ``secret_to_limbs``; raises ValueError if the limbs do not encode 32 bytes."""
    v = 0
    for i, limb in enumerate(limbs):
        limb = int(limb)
        if limb > _LIMB_MASK:
            raise ValueError("limb out of range")
        v |= limb << (LIMB_BITS * i)
    if v >> (8 * SECRET_BYTES):
        raise ValueError("reconstructed value exceeds 32 bytes")
    return v.to_bytes(SECRET_BYTES, "little")


def _random_field(random_bytes: Callable[[int], bytes], shape: tuple[int, ...]) -> np.ndarray:
    count = int(np.prod(shape))
    raw = np.frombuffer(random_bytes(8 * count), dtype=np.uint64).reshape(shape)
    return raw % _P64  # bias < 2^-33: negligible


def share_limbs(
    limbs: np.ndarray, holders: Sequence[int] | np.ndarray, threshold: int, random_bytes: Callable[[int], bytes]
) -> np.ndarray:
    """Share field elements ``limbs`` (shape (m,)) among ``holders``; any ``threshold`` recover them.

    Returns shape (len(holders), m): row i is the share held by ``holders[i]``.
    """
    x = np.asarray(holders, dtype=np.uint64).reshape(-1, 1)
    if threshold < 1:
        raise ValueError("threshold must be >= 1")
    if np.any(x == 0) or np.any(x >= _P64):
        raise ValueError("holder ids must be in [1, p)")
    limbs = np.asarray(limbs, dtype=np.uint64) % _P64
    coeffs = _random_field(random_bytes, (threshold - 1, limbs.shape[0]))  # degree 1..t-1
    acc = np.zeros((x.shape[0], limbs.shape[0]), dtype=np.uint64)
    for d in range(threshold - 2, -1, -1):  # Horner from the top coefficient
        acc = (acc * x + coeffs[d]) % _P64
    return (acc * x + limbs) % _P64


def share_secrets(
    secrets: Sequence[bytes], holders: Sequence[int], threshold: int, random_bytes: Callable[[int], bytes]
) -> np.ndarray:
    """Share several 32-byte secrets at once; returns (len(holders), len(secrets) * LIMBS)."""
    limbs = np.concatenate([secret_to_limbs(s) for s in secrets])
    return share_limbs(limbs, holders, threshold, random_bytes)


def _mulmod(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    product: np.ndarray = (a * b) % _P64
    return product


def _prod_mod(a: np.ndarray) -> np.ndarray:
    """Product mod p along the last axis (tree reduction, all values < p)."""
    while a.shape[-1] > 1:
        if a.shape[-1] % 2:
            a = np.concatenate([a, np.ones(a.shape[:-1] + (1,), dtype=np.uint64)], axis=-1)
        a = _mulmod(a[..., 0::2], a[..., 1::2])
    return a[..., 0]


def _powmod(a: np.ndarray, e: int) -> np.ndarray:
    result = np.ones_like(a)
    base = a.copy()
    while e:
        if e & 1:
            result = _mulmod(result, base)
        base = _mulmod(base, base)
        e >>= 1
    return result


def lagrange_at_zero(holder_sets: np.ndarray) -> np.ndarray:
    """Lagrange coefficients at x=0 for each row of holder ids (shape (S, t) -> (S, t)).

    lambda_i = prod_{j != i} x_j / (x_j - x_i) mod p. Rows must hold distinct ids in [1, p).
    """
    x = np.asarray(holder_sets, dtype=np.uint64)
    if x.ndim == 1:
        x = x[None, :]
    s, t = x.shape
    out = np.empty((s, t), dtype=np.uint64)
    chunk = max(1, 4_000_000 // max(1, t * t))
    eye = np.eye(t, dtype=bool)
    for lo in range(0, s, chunk):
        xs = x[lo : lo + chunk]
        num = np.broadcast_to(xs[:, None, :], (xs.shape[0], t, t)).copy()  # [i, j] = x_j
        den = (xs[:, None, :] + _P64 - xs[:, :, None]) % _P64  # [i, j] = x_j - x_i
        num[:, eye] = 1
        den[:, eye] = 1
        n_i = _prod_mod(num)
        d_i = _prod_mod(den)
        if np.any(d_i == 0):
            raise ValueError("holder ids must be distinct")
        out[lo : lo + chunk] = _mulmod(n_i, _powmod(d_i, P - 2))
    return out


def reconstruct_limbs(shares: np.ndarray, coefficients: np.ndarray) -> np.ndarray:
    """Recover secrets from shares (S, t, m) with Lagrange coefficients (S, t) or (t,) -> (S, m)."""
    shares = np.asarray(shares, dtype=np.uint64)
    coefficients = np.asarray(coefficients, dtype=np.uint64)
    if coefficients.ndim == 1:
        coefficients = np.broadcast_to(coefficients, shares.shape[:2])
    acc = np.zeros((shares.shape[0], shares.shape[2]), dtype=np.uint64)
    for i in range(shares.shape[1]):
        acc += _mulmod(coefficients[:, i, None], shares[:, i, :])
        acc %= _P64
    return acc


def reconstruct_secret(holders: Sequence[int], shares: np.ndarray) -> bytes:
    """Convenience: one 32-byte secret from ``t`` shares (shape (t, LIMBS)) held by ``holders``."""
    lam = lagrange_at_zero(np.asarray(holders, dtype=np.uint64)[None, :])
    return limbs_to_secret(reconstruct_limbs(np.asarray(shares)[None], lam)[0])
