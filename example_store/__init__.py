"""Where an app keeps its training examples, and how the FL runtime reads them back.

:class:`ExampleStore` is the interface apps implement; :class:`SQLiteExampleStore` is the
implementation on one SQLite file per app. The runtime selects examples with an
:class:`ExampleSelector` and streams them with ``query`` or ``query_batches``. The package knows
nothing about plans or servers.
"""

from .codec import Example, Schema, TensorSpec
from .errors import (
    ExampleStoreError,
    InvalidArgumentError,
    SchemaMismatchError,
    UnknownCollectionError,
)
from .interface import ExampleIterator, ExampleStore
from .retention import RetentionPolicy
from .selector import ExampleSelector
from .sqlite_store import SQLiteExampleStore

__all__ = [
    "Example",
    "ExampleIterator",
    "ExampleSelector",
    "ExampleStore",
    "ExampleStoreError",
    "InvalidArgumentError",
    "RetentionPolicy",
    "SQLiteExampleStore",
    "Schema",
    "SchemaMismatchError",
    "TensorSpec",
    "UnknownCollectionError",
]
