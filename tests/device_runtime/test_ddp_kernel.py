"""The compiled distributed-DP encoding (device_runtime.ddp_kernel, _ddp_kernel.c) and its ziggurat
tables (device_runtime.ziggurat): built, current, and drawing the laws the privacy argument needs.
``test_ddp.py`` holds the encoding against its reference on the kernel's own draws."""

from __future__ import annotations

import math
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from device_runtime import ddp, ddp_kernel, ziggurat


@pytest.fixture(scope="module")
def kernel() -> ddp_kernel.Kernel:
    return ddp_kernel.load()


def test_the_install_built_the_kernel_from_this_source(kernel: ddp_kernel.Kernel) -> None:
    # an install without a compiler falls back to numpy silently; here one must have been found
    assert kernel.path.parent == Path(ddp.__file__).parent
    assert ddp_kernel.available() is kernel


def test_a_library_of_another_version_is_refused_with_what_to_do(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a stale library with")
    source = tmp_path / "stale.c"
    source.write_text("int ddp_kernel_version(void) { return 0; }\n")
    lib = tmp_path / "stale.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
    with pytest.raises(ddp_kernel.KernelMissing, match="version 0, this code needs .*reinstall"):
        ddp_kernel.open_library(lib)
    with pytest.raises(ddp_kernel.KernelMissing, match="cannot load"):
        ddp_kernel.open_library(source)  # not a library at all


def test_the_cpu_s_clone_gives_the_baseline_s_results_bit_for_bit(tmp_path: Path, kernel: ddp_kernel.Kernel) -> None:
    # the installed library runs the AVX2 or AVX-512 clone where the CPU has it; a seeded run must
    # encode the same on a machine without them
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the baseline with")
    source = Path(ddp_kernel.__file__).with_name("_ddp_kernel.c")
    lib = tmp_path / "baseline.so"
    flags = ["-O3", "-fno-math-errno", "-fno-strict-aliasing", "-ffp-contract=off", "-Wno-psabi"]  # setup.py's
    subprocess.run([cc, *flags, "-DDDP_NO_CLONES", "-shared", "-fPIC", "-o", str(lib), str(source), "-lm"], check=True)
    baseline = ddp_kernel.open_library(lib)
    for dim in (3, 5000, 70_000):
        p = ddp.calibrate(noise_multiplier=1.0, clip=1.0, dim=dim, bitwidth=32, min_devices=5, max_devices=11)
        x = np.random.default_rng(dim).normal(size=dim)
        pd = p.padded_dim
        signs = ddp._negated_signs(9, pd)
        results = []
        for k in (kernel, baseline):
            state = ddp_kernel.new_state(np.random.default_rng(1))
            out = np.empty(pd)
            norm2 = k.encode(
                x, signs, pd, 0.5 * p.gamma / math.sqrt(pd), state, math.sqrt(p.local_variance), 2**32 - 1, True, out
            )
            results.append((norm2, out.tobytes(), state.tobytes(), k.fwht(x, pd, 0.3).tobytes()))
        assert results[0] == results[1]


# --- the ziggurat's tables ----------------------------------------------------------------------


def test_the_layers_have_one_area_and_close_at_the_peak() -> None:
    t = ziggurat.layers()
    # Marsaglia and Tsang's r for 256 layers, solved here rather than copied
    assert t.r == pytest.approx(3.6541528853610088, rel=1e-14)
    areas = np.asarray(t.layer_areas())
    assert np.abs(areas / t.v - 1.0).max() < 1e-12
    # stacked without gaps: each layer's top is the next one's bottom, the cap reaches the peak
    assert t.highs[1:-1] == t.lows[2:]
    assert t.highs[0] == t.lows[1] and t.highs[-1] == 1.0
    # the cap is at least as wide as its lower corner, so it covers the density's cap whole
    corner = math.sqrt(-2.0 * math.log(t.lows[-1]))
    assert t.widths[-1] >= corner
    # the fast bound never admits a point above the density: below it x < the next corner
    for i in range(1, ziggurat.LAYERS - 1):
        x = t.fast[i] * t.widths[i] / 2.0**ziggurat.POSITION_BITS
        assert ziggurat.density(x) >= t.highs[i]
    assert t.fast[-1] == 0
    assert t.fast[0] * t.widths[0] / 2.0**ziggurat.POSITION_BITS < t.r


# --- the draws ---------------------------------------------------------------------------------


def looks_standard_normal(z: np.ndarray) -> bool:
    """N(0, 1): its CDF (Kolmogorov-Smirnov), and how often each region the sampler treats apart
    is reached: the tail past r (Marsaglia's method), the wedges, the cap near 0."""
    n = z.size
    if stats.kstest(z, "norm").pvalue < 1e-4:
        return False
    r = ziggurat.layers().r
    for lo, hi in ((4.0, np.inf), (r, np.inf), (2.5, r), (0.0, 0.2), (1.0, 1.1)):
        p = 2.0 * (stats.norm.cdf(hi) - stats.norm.cdf(lo))
        count = int(((np.abs(z) >= lo) & (np.abs(z) < hi)).sum())
        if abs(count - n * p) > 5.0 * math.sqrt(n * p * (1 - p)) + 1:
            return False
    return abs(z.mean()) < 5.0 / math.sqrt(n) and abs(z.var() - 1.0) < 5.0 * math.sqrt(2.0 / n)


def test_the_normals_follow_the_standard_normal(kernel: ddp_kernel.Kernel) -> None:
    state = ddp_kernel.new_state(np.random.default_rng(3))
    assert looks_standard_normal(kernel.normals(state, 1 << 21))


def no_tail(fast: np.ndarray, width: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
    fast[0] = 1 << ziggurat.POSITION_BITS  # the base strip drawn whole, Marsaglia's tail never


def wider_layers(fast: np.ndarray, width: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
    width[1:] *= 1.03


def no_wedge_test(fast: np.ndarray, width: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
    hi[1:] = lo[1:]  # every point of a layer's rectangle accepted, under the density or not


@pytest.mark.parametrize("breakage", [no_tail, wider_layers, no_wedge_test])
def test_the_normal_check_fails_for_broken_tables(breakage: Callable[..., None]) -> None:
    broken = ddp_kernel.open_library(ddp_kernel.load().path)
    tables = ziggurat.as_array().copy()
    n = ziggurat.LAYERS
    breakage(tables[:n].view(np.uint64), tables[n : 2 * n], tables[2 * n : 3 * n], tables[3 * n : 4 * n])
    broken._tables = tables
    z = broken.normals(ddp_kernel.new_state(np.random.default_rng(3)), 1 << 21)
    assert not looks_standard_normal(z)


def test_the_uniforms_are_uniform_on_the_unit_interval(kernel: ddp_kernel.Kernel) -> None:
    u = kernel.uniforms(ddp_kernel.new_state(np.random.default_rng(4)), 1 << 20)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert stats.kstest(u, "uniform").pvalue > 1e-4
    # the rounding's probabilities: 52 bits, so no two draws in 2^20 should coincide in practice
    assert np.unique(u).size == u.size
    # four lanes interleaved: no draw tells anything of the next ones, its own lane's included
    for lag in range(1, 9):
        assert abs(np.corrcoef(u[:-lag], u[lag:])[0, 1]) < 5.0 / math.sqrt(u.size)


def test_the_stream_is_the_state_s_alone(kernel: ddp_kernel.Kernel) -> None:
    a = ddp_kernel.new_state(np.random.default_rng(5))
    b = a.copy()
    np.testing.assert_array_equal(kernel.normals(a, 1000), kernel.normals(b, 1000))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(
        kernel.uniforms(a, 10), kernel.uniforms(ddp_kernel.new_state(np.random.default_rng(6)), 10)
    )


# --- the transform -----------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(bits=st.integers(0, 18), fill=st.floats(0.0, 1.0), seed=st.integers(0, 2**32))
def test_the_compiled_transform_is_the_numpy_one(bits: int, fill: float, seed: int) -> None:
    # past 2^14 entries the outer factor runs over strips of columns; the zero padding of a
    # partly filled vector crosses rows and strips
    d = 1 << bits
    m = max(1, int(d * fill))
    x = np.random.default_rng(seed).normal(size=m)
    padded = np.zeros(d)
    padded[:m] = x
    got = ddp_kernel.load().fwht(x, d, 0.5)
    np.testing.assert_allclose(got, ddp.fwht(padded) * math.sqrt(d) * 0.5, rtol=0, atol=1e-12 * math.sqrt(d) * 4)


def test_the_kernel_refuses_arrays_it_cannot_read(kernel: ddp_kernel.Kernel) -> None:
    state = ddp_kernel.new_state(np.random.default_rng(0))
    with pytest.raises(ValueError, match="float64"):
        kernel.fwht(np.zeros(4, dtype=np.float32), 4)
    with pytest.raises(ValueError, match="cannot pad"):
        kernel.fwht(np.zeros(5), 4)
    with pytest.raises(ValueError, match="uint64 array of 20"):
        kernel.normals(np.zeros(4, dtype=np.uint64), 1)
    frozen = state.copy()
    frozen.setflags(write=False)
    with pytest.raises(ValueError, match="writable"):
        kernel.uniforms(frozen, 1)


def test_no_stream_of_the_state_is_all_zero() -> None:
    class Zeros(np.random.Generator):
        def integers(self, *args: object, **kwargs: object) -> np.ndarray:  # type: ignore[override]
            return np.zeros(ddp_kernel.STATE_WORDS, dtype=np.uint64)

    state = ddp_kernel.new_state(Zeros(np.random.PCG64(0)))
    assert state[:16].reshape(4, 4).any(axis=0).all()  # every lane (a column: word w of lane l at 4 w + l)
    assert state[16:].any()
