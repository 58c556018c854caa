"""Floats <-> integers for secure sum, and the modulus that keeps the sum from wrapping.

A float x is clipped to [-clip, clip] and mapped to q = round((x + clip) * scale) with
scale = (2^bitwidth - 1) / (2 clip), so 0 <= q < 2^bitwidth. Summing n such values gives at
most n (2^bitwidth - 1) < n 2^bitwidth <= R, so with ``modulus_for(n, bitwidth)`` the sum mod R
is the true integer sum. ``dequantize_sum(total, count)`` undoes the offset of ``count`` clients.

Rounding is stochastic when an ``rng`` (numpy Generator) is given, which makes the quantized
sum an unbiased estimate of the float sum; otherwise round-to-nearest.

Weighted averages (FedAvg by example count) through the same secure sum: each client scales
its update by w / max_weight (so it stays in the clip range) and appends w as one extra
integer entry (``encode_weighted``); the server's single secure sum then holds
sum(w_i x_i) / max_weight and sum(w_i), and ``decode_weighted`` divides. R must cover the
weight entry as well: ``modulus_for(n, max(bitwidth, max_weight.bit_length()))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def modulus_for(n: int, bitwidth: int) -> int:
    """Smallest power of two R >= n * 2^bitwidth: the sum of n values < 2^bitwidth never wraps."""
    if n < 1 or bitwidth < 1:
        raise ValueError("n and bitwidth must be >= 1")
    return 1 << (n * (1 << bitwidth) - 1).bit_length()


@dataclass(frozen=True)
class Quantizer:
    """Clipping range [-clip, clip] and 2^bitwidth levels."""

    bitwidth: int = 16
    clip: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.bitwidth <= 52:
            raise ValueError("bitwidth must be in [1, 52]")
        if not self.clip > 0:
            raise ValueError("clip must be > 0")

    @property
    def levels(self) -> int:
        return (1 << self.bitwidth) - 1

    @property
    def scale(self) -> float:
        return self.levels / (2.0 * self.clip)

    def quantize(self, x: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        """Float vector -> uint64 vector in [0, 2^bitwidth)."""
        y = (np.clip(np.asarray(x, dtype=np.float64), -self.clip, self.clip) + self.clip) * self.scale
        if rng is None:
            q = np.rint(y)
        else:
            q = np.floor(y + rng.random(y.shape))
        return np.clip(q, 0, self.levels).astype(np.uint64)

    def dequantize(self, q: np.ndarray) -> np.ndarray:
        return np.asarray(q, dtype=np.float64) / self.scale - self.clip

    def dequantize_sum(self, total: np.ndarray, count: int) -> np.ndarray:
        """The float sum of ``count`` clients' vectors from the integer sum of their quantizations."""
        return np.asarray(total, dtype=np.float64) / self.scale - count * self.clip


def encode_weighted(
    x: np.ndarray, weight: int, max_weight: int, quantizer: Quantizer, rng: np.random.Generator | None = None
) -> np.ndarray:
    """Client side of a weighted average: quantize(w x / max_weight) followed by the weight w."""
    if not 0 <= weight <= max_weight:
        raise ValueError("weight must be in [0, max_weight]")
    q = quantizer.quantize(np.asarray(x, dtype=np.float64) * (weight / max_weight), rng)
    return np.concatenate([q, np.array([weight], dtype=np.uint64)])


def decode_weighted(total: np.ndarray, count: int, max_weight: int, quantizer: Quantizer) -> np.ndarray:
    """Server side: sum(w_i x_i) / sum(w_i) from the secure sum of ``count`` encoded vectors."""
    weighted_sum = quantizer.dequantize_sum(total[:-1], count) * max_weight
    total_weight = float(total[-1])
    if total_weight <= 0:
        raise ValueError("total weight is zero")
    return weighted_sum / total_weight
