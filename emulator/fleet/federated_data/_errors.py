"""The one family of errors the federated data library raises: each message is one line that names
the file, key, column or option at fault and says what to do."""

from __future__ import annotations

import numpy as np

from server_stub.errors import install_hint


class FederatedDataError(ValueError):
    """A dataset that cannot be read or cut as asked; the message says what is wrong and the fix."""


class DataSpecError(FederatedDataError):
    """A ``FORMAT:PATH[,options]`` spec that names no known format, a missing file or a bad option."""


class DataLayoutError(FederatedDataError):
    """A file that is not in the layout its format promises (a missing key, ragged features, ...)."""


class PartitionError(FederatedDataError):
    """A centralized dataset that cannot be cut as asked (too few examples, classes or clients)."""


class MissingDependencyError(FederatedDataError, ImportError):
    """A loader whose optional package is not installed; the message names the extra to install."""


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the system does not say)."""
    import os

    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # not POSIX
        return None


def check_fits(where: str, dtype: object, shape: tuple[int, ...], itemsize: int) -> int:
    """The bytes an array of ``shape`` takes, once they fit in this machine's memory; else a
    ``DataLayoutError`` naming ``where``. A file declares an array of any shape at no cost (HDF5's
    unwritten datasets, an .npy header), and reading one past memory was a MemoryError naming nothing."""
    size = 1
    for n in shape:
        size *= int(n)
    size *= itemsize
    memory = physical_memory()
    if memory is not None and size > memory:
        raise DataLayoutError(
            f"{where} is declared {dtype}{list(shape)}, {size / 2**30:.4g} GiB, more than this "
            f"machine's {memory / 2**30:.4g} GiB of memory"
        )
    return size


def check_finite(values: np.ndarray, where: str, unit: str = "example") -> np.ndarray:
    """``values`` once every float in them is finite and within float32's range (a plan's tensors are
    float32, where 1e39 is infinite); else a ``DataLayoutError`` naming ``where``: one NaN in an
    example makes the update of every device that trains on it NaN."""
    if values.dtype.kind != "f" or not values.size:
        return values
    limit = np.finfo(np.float32).max
    with np.errstate(invalid="ignore"):  # one pass when all is well; float32 holds no value past its range
        fine = np.isfinite(values).all() if values.dtype.itemsize <= 4 else np.abs(values).max() <= limit
        if not fine:
            bad = ~np.isfinite(values) | (np.abs(values) > limit)
            example = int(np.flatnonzero(bad.reshape(len(values), -1).any(axis=1))[0]) if values.ndim else 0
            raise DataLayoutError(
                f"{where} holds values that are NaN, infinite or past float32's range (3.4e38): {int(bad.sum())} of "
                f"them, the first in {unit} {example}; fix or drop those {unit}s"
            )
    return values


def check_readable(path: object, where: str) -> None:
    """A ``DataSpecError`` naming ``path`` when this user may not read it (a file) or list it (a
    folder): pyarrow and h5py say so only inside "not a Parquet file" or "not an HDF5 file"."""
    import os

    if not os.path.exists(str(path)):  # the caller says what is missing
        return
    folder = os.path.isdir(str(path))
    if not os.access(str(path), os.R_OK | (os.X_OK if folder else 0)):
        raise DataSpecError(f"{where}{path} cannot be read: permission denied; {readable_fix(path, folder)}")


def check_link(path: object, where: str) -> None:
    """A ``DataSpecError`` when ``path`` is a symbolic link to nothing (its target moved) or one that
    loops: a folder's files are picked by ``is_file()``, which calls such a link no file, and a
    dataset of links (as a cluster's shared data) lost the examples of every broken one unsaid."""
    import os

    if os.path.islink(str(path)) and not os.path.exists(str(path)):
        try:
            os.stat(str(path))
        except FileNotFoundError:
            why = f"a symbolic link to {os.readlink(str(path))}, which does not exist; link it to the data or remove it"
        except OSError as exc:
            why = f"a symbolic link that loops ({exc.strerror}); link it to the data or remove it"
        else:  # pragma: no cover - exists() and stat() disagree only in a race
            return
        raise DataSpecError(f"{where}{path} is {why}")


def readable_fix(path: object, folder: bool = False) -> str:
    """What to do about a path this user may not read."""
    return f"make it readable to this user (chmod a+r{'x' if folder else ''} {path}) or give a copy that is"


#: Import names whose package on PyPI is named otherwise.
PACKAGES = {"PIL": "pillow"}


def require(module: str, *, extra: str = "data") -> object:
    """Import an optional dependency lazily, or say which extra brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        package = PACKAGES.get(top, top)
        raise MissingDependencyError(
            f"this format needs the '{package}' package: {install_hint(extra)}, or pip install {package}"
        ) from exc
