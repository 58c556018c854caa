"""The one family of errors the federated data library raises: each message is one line that names
the file, key, column or option at fault and says what to do."""

from __future__ import annotations


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


def require(module: str, *, extra: str = "data") -> object:
    """Import an optional dependency lazily, or say which extra brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise MissingDependencyError(
            f"this format needs the '{top}' package: pip install 'fedfleet[{extra}]' (or pip install {top})"
        ) from exc
