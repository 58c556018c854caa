"""The SQLite implementation of ExampleStore: one database file per app, via SQLAlchemy 2.

Layout: a ``collections`` table (uri, schema recorded on first insert) and an ``examples`` table
with one row per example (id, collection id, timestamp, payload BLOB) indexed on
(collection, timestamp), so selectors become index range scans. DDL lives in SQLAlchemy Core;
the hot paths (bulk insert, streaming select) use the raw DBAPI connection that SQLAlchemy
hands out, because Core's per-row overhead would dominate for ~300-byte rows.

Concurrency: writes are serialized by a lock inside the process (SQLite has one writer anyway);
reads take a pooled connection of their own and no lock, and WAL lets them run while an add()
commits. Connections are created with ``check_same_thread=False`` so one store can be shared with
a worker thread.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice, repeat
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import (
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    inspect,
    select,
)
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import QueuePool

from .codec import Example, Schema
from .errors import ExampleStoreError, InvalidArgumentError, UnknownCollectionError
from .interface import ExampleIterator, ExampleStore, check_batch_size
from .retention import RetentionPolicy
from .selector import ExampleSelector

#: Written to ``PRAGMA user_version``; a file with another non-zero version is refused.
FORMAT_VERSION = 1
#: Examples per insert batch and rows per fetch while streaming.
INSERT_CHUNK = 2048
READ_CHUNK = 1024

metadata = MetaData()
collections_table = Table(
    "collections",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("uri", String, nullable=False, unique=True),
    Column("schema", Text, nullable=False),
    Column("record_size", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
)
examples_table = Table(
    "examples",
    metadata,
    # A rowid alias: new ids are above every live id, so id order is insertion order.
    Column("id", Integer, primary_key=True),
    Column("collection_id", Integer, ForeignKey("collections.id"), nullable=False),
    Column("timestamp", Float, nullable=False),
    Column("payload", LargeBinary, nullable=False),
    Index("ix_examples_collection_timestamp", "collection_id", "timestamp"),
)

_INSERT_SQL = "INSERT INTO examples (collection_id, timestamp, payload) VALUES (?, ?, ?)"
_first = itemgetter(0)


def configure_connection(dbapi_connection: sqlite3.Connection) -> None:
    """WAL so that readers and the writer do not block each other; synchronous=NORMAL because in
    WAL mode it is still crash-safe (only the last commits may roll back on power loss)."""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL").fetchall()
        cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()


@dataclass(frozen=True)
class _Collection:
    id: int
    uri: str
    schema: Schema


class SQLiteExampleStore(ExampleStore):
    """An app's example store in one SQLite file (created if missing).

    ``retention`` is the default policy of every collection (see :meth:`set_retention` for
    per-collection ones); ``clock`` gives unix seconds, for default timestamps and TTLs.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        retention: RetentionPolicy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        if str(path) == ":memory:" or str(path) == "":
            raise InvalidArgumentError("SQLiteExampleStore needs a file path (one database file per app), not ':memory:'")
        if retention is not None and not isinstance(retention, RetentionPolicy):
            raise InvalidArgumentError(f"retention must be a RetentionPolicy or None, got {type(retention).__name__}")
        self._default_policy = retention or RetentionPolicy()
        self._policies: dict[str, RetentionPolicy] = {}
        self._clock = clock
        self._lock = threading.RLock()
        self._collections: dict[str, _Collection] = {}
        self._iterators: weakref.WeakSet[_SQLiteIterator] = weakref.WeakSet()
        self._closed = False
        self._engine = self._open_engine()

    # -- setup -------------------------------------------------------------------------------

    def _open_engine(self) -> Engine:
        engine = create_engine(
            URL.create("sqlite", database=str(self.path)),
            connect_args={"check_same_thread": False, "timeout": 30.0},
            poolclass=QueuePool,
            pool_size=4,
            max_overflow=-1,  # never block a reader waiting for a pooled connection
        )
        event.listen(engine, "connect", lambda dbapi_connection, _record: configure_connection(dbapi_connection))
        try:
            with engine.begin() as conn:
                version = conn.exec_driver_sql("PRAGMA user_version").scalar()
                if version not in (0, FORMAT_VERSION):
                    raise ExampleStoreError(
                        f"{self.path} has format version {version}, but this example store reads version "
                        f"{FORMAT_VERSION}: open it with the matching fedfleet version, or move it aside"
                    )
                metadata.create_all(conn)
                self._check_tables(conn)
                if version == 0:
                    conn.exec_driver_sql(f"PRAGMA user_version = {FORMAT_VERSION}")
        except ExampleStoreError:
            engine.dispose()
            raise
        except (SQLAlchemyError, sqlite3.Error, OSError) as exc:
            engine.dispose()
            reason = getattr(exc, "orig", None) or exc
            raise ExampleStoreError(
                f"cannot open the example store at {self.path}: {reason}. If the file is not an example "
                f"store (or is damaged), move it aside or delete it to start a fresh one; if its directory "
                f"does not exist, create it first."
            ) from exc
        return engine

    def _check_tables(self, conn: Connection) -> None:
        inspector = inspect(conn)
        for table in (collections_table, examples_table):
            found = {c["name"] for c in inspector.get_columns(table.name)}
            expected = {c.name for c in table.columns}
            if not expected <= found:
                raise ExampleStoreError(
                    f"{self.path} has a table {table.name!r} with columns {sorted(found)}, not an example "
                    f"store's {sorted(expected)}: use another file for the example store"
                )

    @property
    def journal_mode(self) -> str:
        """The journal mode SQLite actually runs in ('wal' unless the filesystem cannot do it)."""
        with self._engine.connect() as conn:
            return str(conn.exec_driver_sql("PRAGMA journal_mode").scalar())

    # -- collections and policies ---------------------------------------------------------

    def collections(self) -> list[str]:
        """URIs of every collection that has ever received an example, sorted."""
        self._check_open()
        with self._db_errors("list collections"), self._engine.connect() as conn:
            return list(conn.execute(select(collections_table.c.uri).order_by(collections_table.c.uri)).scalars())

    def schema(self, collection_uri: str) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """The collection's tensors: name -> (dtype, shape), in payload order."""
        return self._require(collection_uri).schema.as_dict()

    def retention_for(self, collection_uri: str) -> RetentionPolicy:
        return self._policies.get(collection_uri, self._default_policy)

    def set_retention(self, collection_uri: str, policy: RetentionPolicy) -> None:
        """Overrides the store's default policy for one collection (kept in memory: apps set it at
        start-up) and applies it at once if the collection exists."""
        if not isinstance(policy, RetentionPolicy):
            raise InvalidArgumentError(f"policy must be a RetentionPolicy, got {type(policy).__name__}")
        _check_uri(collection_uri)
        self._check_open()
        with self._lock:
            self._policies[collection_uri] = policy
            coll = self._lookup(collection_uri)
            if coll is not None and not policy.is_noop:
                with self._db_errors("apply retention"), self._engine.begin() as conn:
                    cursor = conn.connection.driver_connection.cursor()
                    try:
                        _apply_policy(cursor, coll, policy, self._clock())
                    finally:
                        cursor.close()

    def _lookup(self, uri: str, conn: Connection | None = None) -> _Collection | None:
        coll = self._collections.get(uri)
        if coll is not None:
            return coll
        query = select(collections_table.c.id, collections_table.c.schema).where(collections_table.c.uri == uri)
        if conn is None:
            with self._db_errors("look up a collection"), self._engine.connect() as own:
                row = own.execute(query).first()
        else:
            row = conn.execute(query).first()
        if row is None:
            return None
        coll = _Collection(row.id, uri, Schema.from_json(row.schema))
        self._collections[uri] = coll
        return coll

    def _require(self, uri: str) -> _Collection:
        self._check_open()
        _check_uri(uri)
        coll = self._lookup(uri)
        if coll is None:
            known = self.collections()
            raise UnknownCollectionError(
                f"the example store {self.path} has no collection {uri!r} (it has {known}); add examples "
                f"with store.add({uri!r}, examples) first, or fix the selector's collection_uri"
            )
        return coll

    # -- writing -----------------------------------------------------------------------------

    def add(
        self,
        collection_uri: str,
        examples: Iterable[Example],
        *,
        timestamps: Iterable[float] | None = None,
    ) -> int:
        """Adds examples in one transaction (all or none) and returns how many were added.

        Timestamps default to ``clock()`` now. The first insert into a collection records its
        schema; later examples must match it (:class:`SchemaMismatchError`). Retention is applied
        to the collection in the same transaction."""
        self._check_open()
        _check_uri(collection_uri)
        now = self._clock()
        example_iter = iter(examples)
        ts_iter = None if timestamps is None else iter(timestamps)
        total = 0
        created: _Collection | None = None
        with self._lock, self._db_errors("add examples"), self._engine.begin() as conn:
            coll = self._lookup(collection_uri, conn)
            cursor = conn.connection.driver_connection.cursor()
            try:
                while chunk := list(islice(example_iter, INSERT_CHUNK)):
                    if coll is None:
                        coll = created = self._create_collection(conn, collection_uri, Schema.from_example(chunk[0]), now)
                    payload = coll.schema.encode(chunk, collection_uri)
                    size = coll.schema.record_size
                    rows = [payload[i : i + size] for i in range(0, len(payload), size)]
                    ts = repeat(now) if ts_iter is None else _take_timestamps(ts_iter, len(chunk))
                    cursor.executemany(_INSERT_SQL, zip(repeat(coll.id), ts, rows))
                    total += len(chunk)
                if ts_iter is not None and next(ts_iter, None) is not None:
                    raise InvalidArgumentError(f"more timestamps than examples ({total}) were given to add()")
                if total:
                    _apply_policy(cursor, coll, self.retention_for(collection_uri), self._clock())
            finally:
                cursor.close()
        if created is not None:  # only cache what was committed
            self._collections[collection_uri] = created
        return total

    def _create_collection(self, conn: Connection, uri: str, schema: Schema, now: float) -> _Collection:
        result = conn.execute(
            collections_table.insert().values(
                uri=uri, schema=schema.to_json(), record_size=schema.record_size, created_at=now
            )
        )
        return _Collection(int(result.inserted_primary_key[0]), uri, schema)

    def apply_retention(self) -> int:
        """Applies every collection's policy now; returns how many examples were deleted."""
        self._check_open()
        deleted = 0
        with self._lock, self._db_errors("apply retention"), self._engine.begin() as conn:
            uris = list(conn.execute(select(collections_table.c.uri)).scalars())
            cursor = conn.connection.driver_connection.cursor()
            try:
                now = self._clock()
                for uri in uris:
                    policy = self.retention_for(uri)
                    if not policy.is_noop:
                        deleted += _apply_policy(cursor, self._lookup(uri, conn), policy, now)
            finally:
                cursor.close()
        return deleted

    def _expire(self, coll: _Collection) -> None:
        """The cheap part of retention that runs before reads: TTL only, and a write transaction
        only when an index probe finds an expired example."""
        ttl = self.retention_for(coll.uri).ttl_seconds
        if ttl is None:
            return
        cutoff = self._clock() - ttl
        with self._db_errors("expire examples"):
            with self._engine.connect() as conn:
                expired = conn.exec_driver_sql(
                    "SELECT 1 FROM examples WHERE collection_id = ? AND timestamp < ? LIMIT 1", (coll.id, cutoff)
                ).first()
            if expired is None:
                return
            with self._lock, self._engine.begin() as conn:
                conn.exec_driver_sql(
                    "DELETE FROM examples WHERE collection_id = ? AND timestamp < ?", (coll.id, cutoff)
                )

    # -- reading -----------------------------------------------------------------------------

    def count(self, selector: ExampleSelector) -> int:
        coll = self._require(_check_selector(selector).collection_uri)
        self._expire(coll)
        where, params = _where(coll, selector)
        with self._db_errors("count examples"), self._engine.connect() as conn:
            n = int(conn.exec_driver_sql(f"SELECT COUNT(*) FROM examples WHERE {where}", tuple(params)).scalar())
        return n if selector.limit is None else min(n, selector.limit)

    def query(self, selector: ExampleSelector) -> ExampleIterator:
        """Streams examples as dicts of views into per-chunk decoded arrays."""
        return self._open_iterator(selector, None)

    def query_batches(self, selector: ExampleSelector, batch_size: int) -> ExampleIterator:
        """Streams batches decoded a chunk at a time (the fast path the runtime trains on)."""
        return self._open_iterator(selector, check_batch_size(batch_size))

    def _open_iterator(self, selector: ExampleSelector, batch_size: int | None) -> _SQLiteIterator:
        coll = self._require(_check_selector(selector).collection_uri)
        self._expire(coll)
        where, params = _where(coll, selector)
        direction = "ASC" if selector.order == "oldest" else "DESC"
        sql = f"SELECT payload FROM examples WHERE {where} ORDER BY timestamp {direction}, id {direction}"
        if selector.limit is not None:
            sql += " LIMIT ?"
            params.append(selector.limit)
        chunk = READ_CHUNK if batch_size is None else batch_size * max(1, READ_CHUNK // batch_size)
        with self._db_errors("query examples"):
            proxied = self._engine.raw_connection()
            try:
                cursor = proxied.driver_connection.cursor()
                cursor.arraysize = chunk
                cursor.execute(sql, params)
            except BaseException:
                proxied.close()
                raise
        iterator = _SQLiteIterator(proxied, cursor, coll.schema, batch_size, str(self.path))
        self._iterators.add(iterator)
        return iterator

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Closes open iterators and the connection pool; idempotent."""
        if self._closed:
            return
        self._closed = True
        for iterator in list(self._iterators):
            iterator.close()
        self._engine.dispose()

    def _check_open(self) -> None:
        if self._closed:
            raise ExampleStoreError(f"the example store {self.path} is closed; open a new SQLiteExampleStore")

    @contextmanager
    def _db_errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except (SQLAlchemyError, sqlite3.Error) as exc:
            reason = getattr(exc, "orig", None) or exc
            raise ExampleStoreError(
                f"could not {action} in {self.path}: {reason}. If the file is damaged, move it aside or "
                f"delete it to start a fresh store; if it is locked, retry later."
            ) from exc

    def __repr__(self) -> str:
        return f"SQLiteExampleStore({str(self.path)!r})"


class _SQLiteIterator(ExampleIterator):
    """Streams rows of one SELECT; decodes a chunk at a time. Holds a pooled connection (and so a
    WAL read snapshot) until exhausted or closed, never a lock."""

    def __init__(
        self, proxied: Any, cursor: sqlite3.Cursor, schema: Schema, batch_size: int | None, path: str
    ) -> None:
        self._proxied = proxied
        self._cursor: sqlite3.Cursor | None = cursor
        self._schema = schema
        self._batch_size = batch_size
        self._path = path
        self._pending: Iterator[dict[str, np.ndarray]] = iter(())

    def __next__(self) -> dict[str, np.ndarray]:
        item = next(self._pending, None)
        if item is not None:
            return item
        if self._cursor is None:
            raise StopIteration
        try:
            rows = self._cursor.fetchmany()
            if not rows:
                raise StopIteration
            columns = self._schema.decode(b"".join(map(_first, rows)), len(rows))
        except StopIteration:
            self.close()
            raise
        except sqlite3.Error as exc:
            self.close()
            raise ExampleStoreError(
                f"reading examples from {self._path} failed: {exc}; if the file is damaged, delete it"
            ) from exc
        except BaseException:
            self.close()
            raise
        n = len(rows)
        if self._batch_size is None:
            self._pending = iter(self._schema.split(columns, n))
        else:
            bs = self._batch_size
            self._pending = iter([{k: v[i : i + bs] for k, v in columns.items()} for i in range(0, n, bs)])
        return next(self._pending)

    def close(self) -> None:
        """Finalizes the statement (ending the read snapshot) and returns the connection to the pool."""
        cursor, proxied = self._cursor, self._proxied
        self._cursor = self._proxied = None
        self._pending = iter(())
        if cursor is not None:
            try:
                cursor.close()
            except sqlite3.Error:
                pass
        if proxied is not None:
            proxied.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown or a pool already disposed
            pass


# -- helpers -----------------------------------------------------------------------------------


def _check_uri(uri: Any) -> None:
    if not isinstance(uri, str) or not uri or "\x00" in uri:
        raise InvalidArgumentError(f"a collection URI must be a non-empty string such as 'app:/digits', got {uri!r}")


def _check_selector(selector: Any) -> ExampleSelector:
    if not isinstance(selector, ExampleSelector):
        raise InvalidArgumentError(
            f"expected an ExampleSelector, got {type(selector).__name__}; build one with "
            f"ExampleSelector(collection_uri) or ExampleSelector.from_dict(d)"
        )
    return selector


def _where(coll: _Collection, selector: ExampleSelector) -> tuple[str, list[Any]]:
    clauses, params = ["collection_id = ?"], [coll.id]
    if selector.start_time is not None:
        clauses.append("timestamp >= ?")
        params.append(selector.start_time)
    if selector.end_time is not None:
        clauses.append("timestamp < ?")
        params.append(selector.end_time)
    return " AND ".join(clauses), params


def _take_timestamps(ts_iter: Iterator[float], n: int) -> list[float]:
    chunk = list(islice(ts_iter, n))
    if len(chunk) < n:
        raise InvalidArgumentError("fewer timestamps than examples were given to add(); pass one per example")
    try:
        arr = np.asarray(chunk, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"timestamps must be numbers of unix seconds ({exc})") from exc
    if arr.ndim != 1 or not np.isfinite(arr).all():
        raise InvalidArgumentError("timestamps must be finite numbers of unix seconds, one per example")
    return arr.tolist()


def _apply_policy(cursor: sqlite3.Cursor, coll: _Collection, policy: RetentionPolicy, now: float) -> int:
    """Deletes what the policy no longer allows, inside the caller's transaction."""
    deleted = 0
    if policy.ttl_seconds is not None:
        cursor.execute(
            "DELETE FROM examples WHERE collection_id = ? AND timestamp < ?", (coll.id, now - policy.ttl_seconds)
        )
        deleted += cursor.rowcount
    if policy.max_bytes is not None:
        keep = policy.max_bytes // coll.schema.record_size  # payloads have a fixed size per collection
        (n,) = cursor.execute("SELECT COUNT(*) FROM examples WHERE collection_id = ?", (coll.id,)).fetchone()
        if n > keep:
            cursor.execute(
                "DELETE FROM examples WHERE id IN (SELECT id FROM examples WHERE collection_id = ? "
                "ORDER BY timestamp ASC, id ASC LIMIT ?)",
                (coll.id, n - keep),
            )
            deleted += cursor.rowcount
    return deleted
