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
