"""Property: two stores on one file (two processes of one app, each with its own connections and
its own record of the collections) agree with one model whatever the other did: one deletes a
collection, makes it again with another schema, and the other adds to it and reads it. The other
kept its first record of the collection and added rows under a collection that no longer existed,
then read the new collection's rows with the old schema ('the database is damaged', or
``TamperedExampleError`` in a sealed store, telling the app to delete its data)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from example_store import ExampleSelector, InMemoryKeyStore, SchemaMismatchError, SQLiteExampleStore

SCHEMAS = {  # the schema an app's update changes its collection to
    "v1": lambda i: {"x": np.full(2, i, np.float32)},
    "v2": lambda i: {"x": np.full(3, i, np.int64), "y": np.int64(i)},
}
_uris = itertools.count()

operations = st.lists(
    st.tuples(
        st.integers(0, 1),  # which store
        st.sampled_from(["add", "delete", "read"]),
        st.sampled_from(sorted(SCHEMAS)),
        st.integers(1, 4),
    ),
    max_size=12,
)


@pytest.fixture(scope="module", params=["plain", "sealed"])
def two_stores(request, tmp_path_factory):
    key_store = InMemoryKeyStore() if request.param == "sealed" else None
    path = tmp_path_factory.mktemp("two") / "app.db"
    with SQLiteExampleStore(path, key_store=key_store) as one, SQLiteExampleStore(path, key_store=key_store) as two:
        yield one, two


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=operations)
def test_two_stores_on_one_file_agree_with_one_model(two_stores, steps):
    uri = f"app:/c{next(_uris)}"  # a fresh collection per example, in the module's one file
    schema: str | None = None  # the model: the collection's schema and values, or None when there is none
    values: list[int] = []
    for which, op, version, n in steps:
        store = two_stores[which]
        if op == "add":
            added = [SCHEMAS[version](len(values) + i) for i in range(n)]
            if schema not in (None, version):
                with pytest.raises(SchemaMismatchError):
                    store.add(uri, added)
                continue
            store.add(uri, added)
            schema = version
            values += [len(values) + i for i in range(n)]
        elif op == "delete":
            assert store.delete_collection(uri) == len(values)
            schema, values = None, []
        else:
            assert (uri in store.collections()) == (schema is not None)
            if schema is not None:
                read = [int(e["x"][0]) for e in store.query(ExampleSelector(uri))]
                assert read == values and store.count(ExampleSelector(uri)) == len(values)
                assert store.schema(uri) == schema_of(schema)


def schema_of(version: str) -> dict:
    return {name: (np.asarray(v).dtype, np.asarray(v).shape) for name, v in SCHEMAS[version](0).items()}


def test_a_retention_policy_set_by_one_store_holds_in_the_other_at_once(tmp_path):
    """One process of the app sets a TTL on a collection; the other, open since before, no longer
    reads (nor counts) the examples past it, where it kept the policies it read when it opened
    until its own apply_retention."""
    from example_store import RetentionPolicy

    now = [1000.0]
    path = tmp_path / "app.db"
    with SQLiteExampleStore(path, clock=lambda: now[0]) as one, SQLiteExampleStore(path, clock=lambda: now[0]) as two:
        one.add("app:/d", [SCHEMAS["v1"](i) for i in range(3)], timestamps=[100.0, 500.0, 900.0])
        assert two.count(ExampleSelector("app:/d")) == 3
        one.set_retention("app:/d", RetentionPolicy(ttl_seconds=200.0))
        assert two.retention_for("app:/d") == RetentionPolicy(ttl_seconds=200.0)
        assert [int(e["x"][0]) for e in two.query(ExampleSelector("app:/d"))] == [2]
        one.clear_retention("app:/d")
        assert two.retention_for("app:/d") == RetentionPolicy()
