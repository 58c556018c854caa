"""Where an app keeps its training examples, and how the FL runtime reads them back.

:class:`ExampleStore` is the interface apps implement; :class:`SQLiteExampleStore` is the
implementation on one SQLite file per app (optionally sealed at rest with AES-GCM under a key of a
:class:`KeyStore`), and :class:`InMemoryExampleStore` a small in-memory one. The runtime selects
examples with an :class:`ExampleSelector` and streams them with ``query`` or ``query_batches``;
an iterator's ``resumption_token()`` lets the next session continue where this one stopped. The
package knows nothing about plans or servers.

``__all__`` holds what an app, a store's author and a task author call; the SQLite engine the
runtime's and the server's databases share is imported from ``example_store.sqlite_engine``.
"""

from .codec import Example, ExampleLike, Schema, TensorSpec
from .errors import (
    ExampleStoreError,
    InvalidArgumentError,
    InvalidResumptionTokenError,
    KeyStoreError,
    ResumptionNotSupportedError,
    SchemaMismatchError,
    SealingModeError,
    TamperedExampleError,
    UnknownCollectionError,
    WrongKeyError,
)
from .interface import ExampleIterator, ExampleStore
from .keystore import FileKeyStore, InMemoryKeyStore, KeyStore
from .memory_store import InMemoryExampleStore
from .resumption import ResumptionTokens
from .retention import CollectionStats, RetentionPolicy
from .selector import ExampleSelector
from .sqlite_store import SQLiteExampleStore

__all__ = [
    "CollectionStats",
    "Example",
    "ExampleLike",
    "ExampleIterator",
    "ExampleSelector",
    "ExampleStore",
    "ExampleStoreError",
    "FileKeyStore",
    "InMemoryExampleStore",
    "InMemoryKeyStore",
    "InvalidArgumentError",
    "InvalidResumptionTokenError",
    "KeyStore",
    "KeyStoreError",
    "ResumptionNotSupportedError",
    "ResumptionTokens",
    "RetentionPolicy",
    "SQLiteExampleStore",
    "Schema",
    "SchemaMismatchError",
    "SealingModeError",
    "TamperedExampleError",
    "TensorSpec",
    "UnknownCollectionError",
    "WrongKeyError",
]
