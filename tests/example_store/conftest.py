"""Shared fixtures: the same behavioural tests run on every ExampleStore implementation."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import pytest

from example_store import InMemoryExampleStore, InMemoryKeyStore, RetentionPolicy, SQLiteExampleStore
from tests.example_store.store_helpers import IMPLEMENTATIONS

StoreFactory = Callable[..., object]


@pytest.fixture(params=IMPLEMENTATIONS)
def make_store(request, tmp_path) -> Iterator[StoreFactory]:
    """Opens a store of the parametrized kind; ``make_store(retention=..., clock=...)``. For the
    SQLite kinds, calling it again reopens the same file (with the same key store)."""
    kind = request.param
    key_store = InMemoryKeyStore()
    opened = []
    counter = itertools.count()

    def factory(*, retention: RetentionPolicy | None = None, clock=None, fresh: bool = False):
        kwargs = {"retention": retention}
        if clock is not None:
            kwargs["clock"] = clock
        if kind == "memory":
            store = InMemoryExampleStore(**kwargs)
        else:
            name = f"app{next(counter)}.db" if fresh else "app.db"
            if kind == "sqlite-sealed":
                kwargs["key_store"] = key_store
            store = SQLiteExampleStore(tmp_path / name, **kwargs)
        opened.append(store)
        return store

    factory.kind = kind  # type: ignore[attr-defined]
    yield factory
    for store in opened:
        store.close()


@pytest.fixture
def any_store(make_store):
    return make_store()
