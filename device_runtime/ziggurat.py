"""The ziggurat tables of the compiled encoding's Gaussian sampler (``_ddp_kernel.c``).

The ziggurat method (Marsaglia and Tsang 2000) covers the half-normal density f(x) = exp(-x^2/2)
with 256 layers of equal area v: a base strip [0, v / f(r)) x [0, f(r)) whose part past r stands for
the tail, and rectangles [0, x_i) x [f(x_i), f(x_(i+1))) stacked up to the peak. A draw picks a layer
uniformly and a point uniformly in it; a point under the density is the sample, any other is drawn
again, and the tail is sampled exactly by Marsaglia's method. The law is exactly the normal's as
long as every layer's area is the same v and together they cover the density: so r is solved for
here, not copied, until the layers close at the peak (the top layer's width is v over its height,
which is at least its lower corner x_255, so it covers the density's cap whole; the sliver past
x_255 is always rejected). What is left is float64 rounding of the layers' areas (below 1e-12
relative, checked by ``layer_areas``).

Values in, values out: the tables are computed once and cached; the kernel reads them as one
float64 array (``as_array``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

LAYERS = 256
#: The position of a point in its layer is a 52-bit integer: x = bits * width / 2^52.
POSITION_BITS = 52


def density(x: float) -> float:
    """The half-normal density without its normalizer."""
    return math.exp(-0.5 * x * x)


def tail_area(r: float) -> float:
    """The area under ``density`` past r: sqrt(pi/2) erfc(r / sqrt(2))."""
    return math.sqrt(math.pi / 2.0) * math.erfc(r / math.sqrt(2.0))


def layer_area(r: float) -> float:
    """v: the base strip's area, r f(r) plus the tail's, which every layer shares."""
    return r * density(r) + tail_area(r)


def _corners(r: float) -> tuple[list[float], bool]:
    """x_1 = r, x_2, ...: each layer's right edge, the next one's from x_i (f(x_(i+1)) - f(x_i)) = v;
    and whether the layers reach the peak within 255 (a larger r makes thinner layers)."""
    v = layer_area(r)
    xs = [r]
    for _ in range(1, LAYERS - 1):
        top = density(xs[-1]) + v / xs[-1]
        if top >= 1.0:
            return xs, True
        xs.append(math.sqrt(-2.0 * math.log(top)))
    return xs, density(xs[-1]) + v / xs[-1] >= 1.0


@functools.cache
def solve_r() -> float:
    """The largest r whose 255 layers close at the peak, by bisection to float64 resolution."""
    lo, hi = 3.0, 4.0
    while True:
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            return lo
        if _corners(mid)[1]:
            lo = mid
        else:
            hi = mid


@dataclass(frozen=True)
class Layers:
    """Each layer's width, its height range, and the fast bound: a position below ``fast`` (in
    2^-52 of the width) is under the density at any height of the layer."""

    r: float
    v: float
    widths: tuple[float, ...]
    lows: tuple[float, ...]
    highs: tuple[float, ...]
    fast: tuple[int, ...]

    def layer_areas(self) -> list[float]:
        """Each layer's area (the base strip's with the tail): all equal to v up to float64."""
        base = self.r * self.highs[0] + tail_area(self.r)
        return [base] + [w * (h - lo) for w, h, lo in zip(self.widths[1:], self.highs[1:], self.lows[1:], strict=True)]


@functools.cache
def layers() -> Layers:
    r = solve_r()
    v = layer_area(r)
    xs, closed = _corners(r)
    if not closed or len(xs) != LAYERS - 1:
        raise AssertionError("the ziggurat's layers do not close at the peak")
    scale = float(1 << POSITION_BITS)
    widths = [v / density(r)]
    lows, highs = [0.0], [density(r)]
    fast = [max(math.floor(scale * r / widths[0]) - 1, 0)]
    for i in range(1, LAYERS):
        x = xs[i - 1]
        if i < LAYERS - 1:
            nxt, width, high = xs[i], x, density(xs[i])
        else:  # the cap: as wide as its area needs, nothing under the density at every height
            nxt, width, high = 0.0, v / (1.0 - density(x)), 1.0
        widths.append(width)
        lows.append(density(x))
        highs.append(high)
        # one below the exact bound: a point on it goes to the wedge test, which decides exactly
        fast.append(max(math.floor(scale * nxt / width) - 1, 0))
    return Layers(r, v, tuple(widths), tuple(lows), tuple(highs), tuple(fast))


@functools.cache
def as_array() -> npt.NDArray[np.float64]:
    """The tables as the kernel's ``ziggurat_t`` reads them: fast (uint64 bits), width / 2^52, lo,
    hi (256 each), then r; read-only."""
    t = layers()
    out = np.empty(4 * LAYERS + 1)
    out[:LAYERS].view(np.uint64)[:] = np.asarray(t.fast, dtype=np.uint64)
    out[LAYERS : 2 * LAYERS] = np.asarray(t.widths) / float(1 << POSITION_BITS)
    out[2 * LAYERS : 3 * LAYERS] = t.lows
    out[3 * LAYERS : 4 * LAYERS] = t.highs
    out[4 * LAYERS] = t.r
    out.setflags(write=False)
    return out


__all__ = ["LAYERS", "Layers", "as_array", "density", "layer_area", "layers", "solve_r", "tail_area"]
