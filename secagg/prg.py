"""Mask expansion: a 32-byte seed -> a vector uniform in [0, R), by AES-256-CTR keystream.

Fast path (R a power of two <= 2^64): the keystream is viewed as uint32 (R <= 2^32) or uint64
words and masks are added/subtracted with wrapping machine arithmetic; since R divides the word
modulus, one final ``& (R - 1)`` gives the exact result mod R. The keystream is written into a
reused buffer (``update_into``) so a mask costs one AES pass plus one numpy add.

Other R: rejection sampling (keep ``word & (2^ceil(log2 R) - 1)`` when it is < R, acceptance
>= 1/2) continuing the same keystream until enough values; additions are done mod R.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

_IV = bytes(16)
MAX_MODULUS = 1 << 62


def is_power_of_two(r: int) -> bool:
    return r > 0 and r & (r - 1) == 0


def word_dtype(modulus: int) -> np.dtype:
    """Element type of masked vectors on the wire and in accumulators."""
    return np.dtype(np.uint32) if modulus <= (1 << 32) else np.dtype(np.uint64)


class MaskAccumulator:
    """Sum of +/- masks and inputs modulo R, reusing one keystream buffer.

    ``add_seed(seed, +1/-1)`` adds or subtracts PRG(seed); ``add_vector`` adds values < R;
    ``value()`` returns the sum reduced mod R.
    """

    def __init__(self, length: int, modulus: int) -> None:
        if not 2 <= modulus <= MAX_MODULUS:
            raise ValueError("modulus must be in [2, 2^62]")
        self.length = length
        self.modulus = modulus
        self.dtype = word_dtype(modulus)
        self.pow2 = is_power_of_two(modulus)
        nbytes = length * self.dtype.itemsize
        self._zeros = bytes(nbytes)
        self._buf = bytearray(nbytes + 16)
        self._view = np.frombuffer(self._buf, dtype=self.dtype, count=length)
        self.acc = np.zeros(length, dtype=self.dtype if self.pow2 else np.uint64)

    def _keystream(self, seed: bytes) -> np.ndarray:
        enc = Cipher(algorithms.AES(seed), modes.CTR(_IV)).encryptor()
        enc.update_into(self._zeros, self._buf)
        return self._view

    def add_seed(self, seed: bytes, sign: int = 1) -> None:
        if self.pow2:
            ks = self._keystream(seed)
            if sign > 0:
                self.acc += ks
            else:
                self.acc -= ks
        else:
            self.add_vector(expand(seed, self.length, self.modulus), sign)

    def add_vector(self, values: np.ndarray, sign: int = 1) -> None:
        """Add (or subtract) a vector whose entries are already reduced mod R."""
        if self.pow2:
            v = values.astype(self.dtype, copy=False)
            if sign > 0:
                self.acc += v
            else:
                self.acc -= v
        else:
            v = values.astype(np.uint64, copy=False)
            r = np.uint64(self.modulus)
            if sign > 0:
                self.acc += v
            else:
                self.acc += r - v
            self.acc %= r

    def value(self) -> np.ndarray:
        """The sum mod R as a fresh uint64 array."""
        out = self.acc.astype(np.uint64)
        if self.pow2:
            if self.modulus < (1 << 64):
                out &= np.uint64(self.modulus - 1)
        else:
            out %= np.uint64(self.modulus)
        return out


def expand(seed: bytes, length: int, modulus: int) -> np.ndarray:
    """PRG(seed) as ``length`` values uniform in [0, modulus) (uint64)."""
    if len(seed) != 32:
        raise ValueError("seed must be 32 bytes")
    dtype = word_dtype(modulus)
    enc = Cipher(algorithms.AES(seed), modes.CTR(_IV)).encryptor()
    if is_power_of_two(modulus):
        words = np.frombuffer(enc.update(bytes(length * dtype.itemsize)), dtype=dtype).astype(np.uint64)
        if modulus < (1 << 64):
            words &= np.uint64(modulus - 1)
        return words
    bits = (modulus - 1).bit_length()
    mask = np.uint64((1 << bits) - 1)
    out = np.empty(length, dtype=np.uint64)
    filled = 0
    while filled < length:
        want = (length - filled) * 2 + 64  # acceptance >= 1/2
        words = np.frombuffer(enc.update(bytes(want * dtype.itemsize)), dtype=dtype).astype(np.uint64) & mask
        good = words[words < np.uint64(modulus)]
        take = min(len(good), length - filled)
        out[filled : filled + take] = good[:take]
        filled += take
    return out
