"""Typed errors, so that callers can tell a bad request from a broken database.

Every message says what to do about it, because the app developer reading it usually cannot
see the store's internals.
"""

from __future__ import annotations


class ExampleStoreError(Exception):
    """Base of every error this package raises on purpose."""


class InvalidArgumentError(ExampleStoreError, ValueError):
    """A selector, retention policy, example or timestamp is malformed (also a ValueError)."""


class UnknownCollectionError(ExampleStoreError, LookupError):
    """The selector names a collection that no example was ever added to."""


class SchemaMismatchError(ExampleStoreError):
    """Examples do not have the tensor names, dtypes or shapes the collection was created with."""
