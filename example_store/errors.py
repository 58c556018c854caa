"""Typed errors, so that callers can tell a bad request from a broken database.

Every message says what to do about it, because the app developer reading it usually cannot
see the store's internals.
"""

from __future__ import annotations


class ExampleStoreError(Exception):
    """Base of every error this package raises on purpose. ``retryable``, as on the device
    runtime's errors: True only where the same call, made later with nothing changed, may succeed
    (another process or connection held the database locked); False where the app, its data or
    its disk must change first (the message says which)."""

    retryable: bool = False

    def __init__(self, *args: object, retryable: bool | None = None) -> None:
        super().__init__(*args)
        if retryable is not None:
            self.retryable = retryable


class InvalidArgumentError(ExampleStoreError, ValueError):
    """A selector, retention policy, example or timestamp is malformed (also a ValueError)."""


class UnknownCollectionError(ExampleStoreError, LookupError):
    """The selector names a collection that no example was ever added to."""


class SchemaMismatchError(ExampleStoreError):
    """Examples do not have the tensor names, dtypes or shapes the collection was created with."""


class KeyStoreError(ExampleStoreError):
    """The key store cannot give a usable key (unreadable file, too-open permissions, bad key)."""


class SealingModeError(ExampleStoreError):
    """A sealed database was opened without a key store, or an unsealed one with a key store."""


class WrongKeyError(ExampleStoreError):
    """The key store's key is missing or is not the key the database was sealed with."""


class TamperedExampleError(ExampleStoreError):
    """A sealed example failed authentication: its payload, nonce, timestamp, collection or the
    collection's metadata was altered on disk. Nothing of the failing chunk is returned."""

    def __init__(self, message: str, *, collection_uri: str, row_id: int | None) -> None:
        super().__init__(message)
        self.collection_uri = collection_uri
        self.row_id = row_id


class InvalidResumptionTokenError(InvalidArgumentError):
    """A selector's ``resume_after`` token is forged, damaged, from another store, or was issued for
    another collection or order."""


class ResumptionNotSupportedError(ExampleStoreError, NotImplementedError):
    """The store's iterators cannot issue resumption tokens (an app's store that does not implement
    :meth:`ExampleIterator.resumption_token`)."""
