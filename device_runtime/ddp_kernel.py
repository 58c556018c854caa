"""The compiled distributed-DP encoding (``_ddp_kernel.c``), loaded with ctypes.

``pip install`` builds ``device_runtime/_ddp_kernel*.so`` with the machine's C compiler (setup.py,
an optional extension: without a compiler the install still succeeds). ``ddp.encode`` uses it when
it loaded and falls back to numpy otherwise; ``load()`` says which, and ``KernelMissing`` says why
not. The library holds no Python code and no state: each call gets its generator state
(``STATE_WORDS`` uint64 words: four xoshiro256++ streams for the rounding's uniforms, one for the
noise) and the ziggurat tables (``ziggurat.as_array``) from here.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from pathlib import Path

import numpy as np
import numpy.typing as npt

from . import ziggurat

#: The ``DDP_KERNEL_VERSION`` this module was written for; a library built from another version of
#: the source is not used (re-run the install: ``./dev`` does it when the source is newer).
KERNEL_VERSION = 2
MODULE = "device_runtime._ddp_kernel"
#: The generator state's words (``_ddp_kernel.c``'s STATE_WORDS): four xoshiro256++ streams side
#: by side for the rounding (word w of lane l at 4 w + l), then one for the noise.
STATE_WORDS = 20
#: The entries of one block (``_ddp_kernel.c``'s BLOCK_BITS): the encoding rounds, then noises, one
#: block at a time, drawing a block's uniforms and then its normals.
BLOCK_ENTRIES = 1 << 14

FloatArray = npt.NDArray[np.float64]
State = npt.NDArray[np.uint64]

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class KernelMissing(RuntimeError):
    """The compiled encoding is not there or not usable; the message says how to build it."""


def _pointer(a: np.ndarray) -> int:
    return int(a.ctypes.data)


class Kernel:
    """The loaded library's functions, with their argument types declared and checked here."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._encode = lib.ddp_encode
        self._encode.argtypes = [_P, _I64, _P, _I64, ctypes.c_double, _P, _P, ctypes.c_double, _I64, ctypes.c_int, _P]
        self._encode.restype = ctypes.c_double
        self._fwht = lib.ddp_fwht
        self._fwht.argtypes = [_P, _I64, _P, _I64, ctypes.c_double, _P]
        self._fwht.restype = None
        self._uniform = lib.ddp_fill_uniform
        self._uniform.argtypes = [_P, _P, _I64]
        self._uniform.restype = None
        self._normal = lib.ddp_fill_normal
        self._normal.argtypes = [_P, _P, _P, _I64]
        self._normal.restype = None
        self._tables = ziggurat.as_array()

    def encode(
        self,
        x: FloatArray,
        negated_signs: npt.NDArray[np.int8],
        padded_dim: int,
        scale: float,
        state: State,
        std: float,
        mask: int,
        noise: bool,
        out: FloatArray,
    ) -> float:
        """``out`` = the encoding's int64 residues (in its 8-byte entries) of scale H (signs x),
        rounded and noised block by block (``_ddp_kernel.c``); returns the rounding's squared norm."""
        _check(x, np.float64, x.size)
        _check(negated_signs, np.int8, padded_dim)
        _check(out, np.float64, padded_dim)
        _check_state(state)
        if x.size > padded_dim or padded_dim & (padded_dim - 1):
            raise ValueError(f"cannot pad {x.size} entries to {padded_dim}")
        return float(
            self._encode(
                _pointer(x),
                x.size,
                _pointer(negated_signs),
                padded_dim,
                scale,
                _pointer(state),
                _pointer(self._tables),
                std,
                mask,
                int(noise),
                _pointer(out),
            )
        )

    def fwht(self, x: FloatArray, padded_dim: int, scale: float = 1.0) -> FloatArray:
        """scale H (x zero-padded to ``padded_dim``), H unnormalized: the encoding's transform."""
        _check(x, np.float64, x.size)
        if x.size > padded_dim or padded_dim < 1 or padded_dim & (padded_dim - 1):
            raise ValueError(f"cannot pad {x.size} entries to {padded_dim}")
        out = np.empty(padded_dim)
        self._fwht(_pointer(x), x.size, None, padded_dim, scale, _pointer(out))
        return out

    def uniforms(self, state: State, n: int) -> FloatArray:
        """The next ``n`` uniforms in [0, 1) of the rounding's lanes, as the encoding draws them
        (52 bits each; the last step's unused lanes dropped)."""
        _check_state(state)
        out = np.empty(n)
        self._uniform(_pointer(state), _pointer(out), n)
        return out

    def normals(self, state: State, n: int) -> FloatArray:
        """The next ``n`` standard normals of the noise's stream, as the encoding draws them."""
        _check_state(state)
        out = np.empty(n)
        self._normal(_pointer(state), _pointer(self._tables), _pointer(out), n)
        return out


def _check(a: np.ndarray, dtype: type, size: int) -> None:
    if a.dtype != dtype or not a.flags.c_contiguous or a.size != size:
        raise ValueError(f"expected a contiguous {np.dtype(dtype).name} array of {size} entries")


def _check_state(state: State) -> None:
    _check(state, np.uint64, STATE_WORDS)
    if not state.flags.writeable:
        raise ValueError("the generator state must be writable: every draw advances it")


def new_state(rng: np.random.Generator) -> State:
    """The kernel's generator state from ``rng``: 256 bits for each of its five xoshiro256++
    streams, none of them all zero (a zero state stays zero)."""
    state = rng.integers(0, 2**64, size=STATE_WORDS, dtype=np.uint64)
    lanes = state[:16].reshape(4, 4)  # [word, lane]
    for lane in range(4):
        if not lanes[:, lane].any():
            lanes[0, lane] = 1
    if not state[16:].any():
        state[16] = 1
    return state


def library_path() -> Path:
    """Where the built library is (the package's extension module file), or ``KernelMissing``."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or spec.origin is None:
        raise KernelMissing(
            "the compiled DP encoding (device_runtime/_ddp_kernel.c) is not built: reinstall the package "
            "with a C compiler on the machine (`./dev` does it: `rm .venv/.installed && ./dev test`)"
        )
    return Path(spec.origin)


@functools.cache
def load() -> Kernel:
    """The kernel, loaded once; ``KernelMissing`` if it is not built, not loadable or stale."""
    return open_library(library_path())


def open_library(path: Path) -> Kernel:
    """The kernel in the library at ``path``; ``KernelMissing`` if it cannot load or is stale."""
    try:
        lib = ctypes.CDLL(str(path))
        version = int(lib.ddp_kernel_version())
    except (OSError, AttributeError) as e:
        raise KernelMissing(f"cannot load the compiled DP encoding at {path}: {e}") from e
    if version != KERNEL_VERSION:
        raise KernelMissing(
            f"the compiled DP encoding at {path} is version {version}, this code needs {KERNEL_VERSION}: "
            "reinstall the package (`./dev` does it when the C source is newer than its install)"
        )
    return Kernel(lib, path)


@functools.cache
def available() -> Kernel | None:
    """The kernel if it loads, else None (``load`` says why); decided once per process."""
    try:
        return load()
    except KernelMissing:
        return None


__all__ = [
    "BLOCK_ENTRIES",
    "KERNEL_VERSION",
    "Kernel",
    "KernelMissing",
    "available",
    "library_path",
    "load",
    "new_state",
    "open_library",
]
