"""The SQLite implementation of ExampleStore: one database file per app, via SQLAlchemy 2.

Layout: a ``collections`` table (uri, schema recorded on first insert), an ``examples`` table
with one row per example (id, collection id, timestamp, payload BLOB) indexed on
(collection, timestamp), so selectors become index range scans, a ``retention_policies`` table
(per-collection policies an app set) and ``store_meta`` (format, sealing mode, salts). DDL lives
in SQLAlchemy Core; the hot paths (bulk insert, streaming select) use the raw DBAPI connection
that SQLAlchemy hands out, because Core's per-row overhead would dominate for ~300-byte rows.

Sealing at rest: a store opened with a :class:`KeyStore` seals every payload with AES-256-GCM
under a key derived (HKDF) from the app's key and a random salt of the database. A sealed
payload is ``nonce (12 random bytes) || ciphertext || tag (16)``; its associated data binds the
row id, the timestamp, the collection id, URI and schema, so a flipped byte, a row moved to
another collection, an edited timestamp or schema all fail authentication
(:class:`TamperedExampleError`). What stays readable on disk: collection URIs, schemas,
timestamps and counts. Deleting rows (or restoring deleted ones) is not detected.

Deleting at rest: the database file is made readable by its owner only, SQLite overwrites the rows
it deletes with zeros (``secure_delete``), and each delete an app asks for (``delete_collection``,
``delete_before``, ``delete_all``, ``apply_retention``, ``set_retention``) then cuts the
write-ahead log to 0 bytes, where the log kept its earlier copies of the deleted rows' pages. A
read that began before the delete holds the log until it ends; it is cut then at the store's next
write or at ``close``, and an app killed before that has it cut when it opens the store again. The rows that retention deletes as examples are added or read are zeroed in
the database too, and leave the log at the next of those calls or at ``close`` (cutting the log
syncs the disk, some 15 ms: too much for every add).

Concurrency: writes are serialized by a lock inside the process (SQLite has one writer anyway);
reads take a pooled connection of their own and no lock, and WAL lets them run while an add()
commits. Connections are created with ``check_same_thread=False`` so one store can be shared with
a worker thread.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import secrets
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from itertools import islice, repeat
from pathlib import Path
from typing import cast

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
    inspect,
    select,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import QueuePool

from ._util import (
    check_clock,
    check_path,
    check_policy,
    check_selector,
    check_timestamp,
    check_uri,
    iterate,
    take_timestamps,
    unknown_collection,
)
from .codec import ExampleLike, Schema
from .errors import (
    ExampleStoreError,
    InvalidArgumentError,
    KeyStoreError,
    SealingModeError,
    WrongKeyError,
)
from .interface import ExampleIterator, ExampleStore, check_batch_size
from .keystore import KeyStore, check_alias, check_key
from .resumption import Position, ResumptionTokens
from .retention import CollectionStats, RetentionPolicy
from .sealing import (
    NONCE_BYTES,
    SEALING_AES_GCM,
    SEALING_NONE,
    TAG_BYTES,
    Collection,
    RowSealer,
    b64,
    collection_record,
)
from .selector import ExampleSelector
from .sqlite_engine import damaged_wal, scrub_wal, sqlite_advice, sqlite_engine, sqlite_locked, write_locked
from .sqlite_iterator import READ_CHUNK, SQLiteIterator, where_clause

log = logging.getLogger(__name__)

#: Written to ``PRAGMA user_version``. Version 1 files (no sealing, no persisted policies) are
#: upgraded in place when opened; a file with another non-zero version is refused.
FORMAT_VERSION = 2
_READABLE_VERSIONS = (0, 1, FORMAT_VERSION)
#: Examples per insert batch.
INSERT_CHUNK = 2048
DEFAULT_KEY_ALIAS = "example_store"

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
retention_table = Table(
    "retention_policies",
    metadata,
    Column("collection_uri", String, primary_key=True),
    Column("ttl_seconds", Float, nullable=True),
    Column("max_bytes", Integer, nullable=True),
)
meta_table = Table(
    "store_meta",
    metadata,
    Column("key", String, primary_key=True),
    Column("value", Text, nullable=False),
)

_INSERT_SQL = "INSERT INTO examples (collection_id, timestamp, payload) VALUES (?, ?, ?)"
_INSERT_WITH_ID_SQL = "INSERT INTO examples (id, collection_id, timestamp, payload) VALUES (?, ?, ?, ?)"
# Reserving ids also takes SQLite's write lock, so no other writer can interleave.
_RESERVE_IDS_SQL = (
    "UPDATE store_meta SET value = CAST(value AS INTEGER) + ? WHERE key = 'next_row_id' "
    "RETURNING CAST(value AS INTEGER)"
)


class SQLiteExampleStore(ExampleStore):
    """An app's example store in one SQLite file (created if missing).

    ``retention`` is the default policy of every collection (see :meth:`set_retention` for
    per-collection ones, which are kept in the database); ``clock`` gives unix seconds, for
    default timestamps and TTLs. With ``key_store``, payloads are sealed with AES-GCM under the
    key ``key_alias`` of that key store; the mode is recorded when the database is created, and a
    sealed database cannot be opened without its key (nor an unsealed one with a key store).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        retention: RetentionPolicy | None = None,
        clock: Callable[[], float] = time.time,
        key_store: KeyStore | None = None,
        key_alias: str = DEFAULT_KEY_ALIAS,
    ) -> None:
        self.path = Path(check_path("SQLiteExampleStore's path", path))
        if str(path) == ":memory:" or str(path) == "":
            raise InvalidArgumentError(
                "SQLiteExampleStore needs a file path (one database file per app), not ':memory:'"
            )
        if retention is not None and not isinstance(retention, RetentionPolicy):
            raise InvalidArgumentError(f"retention must be a RetentionPolicy or None, got {type(retention).__name__}")
        if key_store is not None and not isinstance(key_store, KeyStore):
            raise InvalidArgumentError(f"key_store must be a KeyStore or None, got {type(key_store).__name__}")
        check_alias(key_alias)
        self.key_alias = key_alias
        self._default_policy = retention or RetentionPolicy()
        self._clock = check_clock(clock)
        self._lock = threading.RLock()
        self._collections: dict[str, Collection] = {}
        self._iterators: weakref.WeakSet[SQLiteIterator] = weakref.WeakSet()
        self._closed = False
        # a delete's earlier copies are still in the write-ahead log: cut it at the next write or close
        self._scrub_pending = False
        # retention deleted rows as examples were added or read: cut the log at the next delete call
        self._retention_in_log = False
        self._sealer: RowSealer | None = None
        self._tokens: ResumptionTokens
        self._engine = self._open_engine(key_store, key_alias)
        if _wal_holds_frames(self.path):
            # an app killed between a delete and the cut of the log (or while a read held it) left
            # the deleted rows' earlier pages in it, and nothing else would cut it
            self._scrub(1)

    # -- setup -------------------------------------------------------------------------------

    def _open_engine(self, key_store: KeyStore | None, key_alias: str) -> Engine:
        if damaged_wal(self.path):
            log.warning(
                "the write-ahead log of the example store %s (%s-wal) is damaged (zeroed or garbled, as a power "
                "cut can leave it): the examples added since the store's last checkpoint are lost, and it opens "
                "with those written before",
                self.path,
                self.path,
            )
        engine = sqlite_engine(
            self.path,
            poolclass=QueuePool,
            pool_size=4,
            max_overflow=-1,  # never block a reader waiting for a pooled connection
            private=True,
        )
        try:
            with write_locked(engine) as conn:
                version = conn.exec_driver_sql("PRAGMA user_version").scalar()
                if version not in _READABLE_VERSIONS:
                    raise ExampleStoreError(
                        f"{self.path} has format version {version}, but this example store reads versions "
                        f"up to {FORMAT_VERSION}: open it with the matching fedfleet version, or move it aside"
                    )
                metadata.create_all(conn)
                self._check_tables(conn)
                meta = {k: v for k, v in conn.execute(select(meta_table.c.key, meta_table.c.value))}
                if "sealing" not in meta:
                    meta = self._init_meta(conn, key_store, key_alias)
                if version != FORMAT_VERSION:
                    conn.exec_driver_sql(f"PRAGMA user_version = {FORMAT_VERSION}")
            self._setup_sealing(meta, key_store, key_alias)
        except ExampleStoreError:
            engine.dispose()
            raise
        except (SQLAlchemyError, sqlite3.Error, OSError) as exc:
            engine.dispose()
            raise ExampleStoreError(
                f"cannot open the example store at {self.path}: {sqlite_advice(exc)}", retryable=sqlite_locked(exc)
            ) from exc
        except BaseException:
            engine.dispose()
            raise
        return engine

    def _check_tables(self, conn: Connection) -> None:
        inspector = inspect(conn)
        for table in metadata.sorted_tables:
            found = {c["name"] for c in inspector.get_columns(table.name)}
            expected = {c.name for c in table.columns}
            if not expected <= found:
                raise ExampleStoreError(
                    f"{self.path} has a table {table.name!r} with columns {sorted(found)}, not an example "
                    f"store's {sorted(expected)}: use another file for the example store"
                )

    def _init_meta(self, conn: Connection, key_store: KeyStore | None, key_alias: str) -> dict[str, str]:
        """Records the sealing mode of a new (or version 1) database."""
        if key_store is not None and conn.execute(select(collections_table.c.id).limit(1)).first() is not None:
            raise SealingModeError(
                f"{self.path} holds unsealed examples written by an older version; open it without a "
                f"key_store, or start a new sealed store in another file and add the examples to it"
            )
        salt = secrets.token_bytes(16)
        meta = {"salt": b64(salt)}
        if key_store is None:
            meta.update(sealing=SEALING_NONE, token_key=b64(secrets.token_bytes(32)))
        else:
            key = self._fetch_key(key_store, key_alias, create=True)
            assert key is not None  # create=True: the key store made one if it held none
            (max_id,) = conn.exec_driver_sql("SELECT COALESCE(MAX(id), 0) FROM examples").one()
            meta.update(
                sealing=SEALING_AES_GCM,
                key_alias=key_alias,
                key_check=b64(RowSealer(key, salt).key_check()),
                next_row_id=str(int(max_id) + 1),
            )
        conn.execute(meta_table.insert(), [{"key": k, "value": v} for k, v in meta.items()])
        return meta

    def _fetch_key(self, key_store: KeyStore, alias: str, *, create: bool) -> bytes | None:
        try:
            key = key_store.get_or_create_key(alias) if create else key_store.get_key(alias)
        except ExampleStoreError:
            raise
        except Exception as exc:
            raise KeyStoreError(f"the key store {key_store!r} failed to give the key {alias!r}: {exc}") from exc
        return None if key is None else check_key(key, alias)

    def _setup_sealing(self, meta: dict[str, str], key_store: KeyStore | None, key_alias: str) -> None:
        mode = meta.get("sealing")
        try:
            salt = base64.b64decode(meta["salt"], validate=True)
            if mode == SEALING_NONE:
                if key_store is not None:
                    raise SealingModeError(
                        f"{self.path} was created unsealed, so its examples are plaintext on disk; open it "
                        f"without key_store, or start a new sealed store in another file"
                    )
                self._tokens = ResumptionTokens(base64.b64decode(meta["token_key"], validate=True))
                return
            if mode != SEALING_AES_GCM:
                raise ExampleStoreError(
                    f"{self.path} is sealed with {mode!r}, which this version cannot read; open it with the "
                    f"fedfleet version that wrote it"
                )
            sealed_alias = meta["key_alias"]
            key_check = base64.b64decode(meta["key_check"], validate=True)
        except (KeyError, ValueError, binascii.Error) as exc:
            raise ExampleStoreError(
                f"the store metadata of {self.path} is damaged ({exc!r}); move the file aside or delete it"
            ) from exc
        if key_store is None:
            raise SealingModeError(
                f"{self.path} is sealed (AES-GCM under key alias {sealed_alias!r}); open it with "
                f"SQLiteExampleStore(path, key_store=..., key_alias={sealed_alias!r}) and the app's key store"
            )
        hint = "" if key_alias == sealed_alias else f" (it was sealed under alias {sealed_alias!r}, not {key_alias!r})"
        key = self._fetch_key(key_store, key_alias, create=False)
        if key is None:
            raise WrongKeyError(
                f"the key store {key_store!r} has no key {key_alias!r} for the sealed store {self.path}{hint}; "
                f"without the key it was sealed with its examples cannot be read: restore the key store, or "
                f"delete the file to start afresh"
            )
        sealer = RowSealer(key, salt)
        if not sealer.verify_key_check(key_check):
            raise WrongKeyError(
                f"the key {key_alias!r} of {key_store!r} is not the key {self.path} was sealed with{hint}; "
                f"open it with the key store that created it, or delete the file to start afresh"
            )
        self._sealer = sealer
        self._tokens = ResumptionTokens(sealer.token_key)

    @property
    def sealed(self) -> bool:
        """Whether payloads are sealed with AES-GCM at rest."""
        return self._sealer is not None

    @property
    def journal_mode(self) -> str:
        """The journal mode SQLite actually runs in ('wal' unless the filesystem cannot do it)."""
        with self._engine.connect() as conn:
            return str(conn.exec_driver_sql("PRAGMA journal_mode").scalar())

    # -- collections and policies ---------------------------------------------------------

    def collections(self) -> list[str]:
        """URIs of every collection that holds (or held) examples and was not deleted, sorted."""
        self._check_open()
        with self._db_errors("list collections"), self._engine.connect() as conn:
            return list(conn.execute(select(collections_table.c.uri).order_by(collections_table.c.uri)).scalars())

    def schema(self, collection_uri: str) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """The collection's tensors: name -> (dtype, shape), in payload order."""
        return self._require(collection_uri).schema.as_dict()

    def retention_for(self, collection_uri: str) -> RetentionPolicy:
        """The collection's own policy if one was set, else the store's default. Read from the
        database each time: another process of the app (or another store on the file) may have
        set it since, and its examples past a TTL are not to be read."""
        check_uri(collection_uri)  # 5 read as a collection with no policy of its own, and got the default
        self._check_open()
        return self._retention(collection_uri)

    def _retention(self, collection_uri: str, conn: Connection | None = None) -> RetentionPolicy:
        query = select(retention_table.c.ttl_seconds, retention_table.c.max_bytes).where(
            retention_table.c.collection_uri == collection_uri
        )
        if conn is None:
            with self._db_errors("read a retention policy"), self._engine.connect() as own:
                row = own.execute(query).first()
        else:
            row = conn.execute(query).first()
        return self._default_policy if row is None else RetentionPolicy(row.ttl_seconds, row.max_bytes)

    def set_retention(self, collection_uri: str, policy: RetentionPolicy) -> None:
        """Sets one collection's policy (over the store's default), saves it in the database so it
        survives a restart, and applies it at once if the collection exists. The collection need
        not exist yet."""
        check_policy(policy)
        check_uri(collection_uri)
        self._check_open()
        with self._lock, self._db_errors("set a retention policy"), self._engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO retention_policies (collection_uri, ttl_seconds, max_bytes) VALUES (?, ?, ?) "
                "ON CONFLICT (collection_uri) DO UPDATE SET ttl_seconds = excluded.ttl_seconds, "
                "max_bytes = excluded.max_bytes",
                (collection_uri, policy.ttl_seconds, policy.max_bytes),
            )
            coll = self._lookup(collection_uri, conn)
            deleted = 0
            if coll is not None and not policy.is_noop:
                cursor = _cursor(conn.connection.driver_connection)
                try:
                    deleted = _apply_policy(cursor, coll, policy, self._clock())
                finally:
                    cursor.close()
        self._scrub(deleted)

    def clear_retention(self, collection_uri: str) -> None:
        """Forgets the collection's own policy: the store's default applies to it again."""
        check_uri(collection_uri)
        self._check_open()
        with self._lock, self._db_errors("clear a retention policy"), self._engine.begin() as conn:
            conn.execute(retention_table.delete().where(retention_table.c.collection_uri == collection_uri))

    def _lookup(self, uri: str, conn: Connection | None = None) -> Collection | None:
        """The collection as the database holds it now: another process (or store) may have
        deleted it, or made it again with another schema, since this store last saw it. The
        cached record is reused while its id and schema are the database's."""
        query = select(collections_table.c.id, collections_table.c.schema).where(collections_table.c.uri == uri)
        if conn is None:
            with self._db_errors("look up a collection"), self._engine.connect() as own:
                row = own.execute(query).first()
        else:
            row = conn.execute(query).first()
        if row is None:
            self._collections.pop(uri, None)
            return None
        coll = self._collections.get(uri)
        if coll is None or coll.id != row.id or coll.schema_text != row.schema:
            coll = self._collections[uri] = collection_record(row.id, uri, row.schema)
        return coll

    def _require(self, uri: str) -> Collection:
        self._check_open()
        check_uri(uri)
        coll = self._lookup(uri)
        if coll is None:
            raise unknown_collection(f"the example store {self.path}", uri, self.collections())
        return coll

    # -- writing -----------------------------------------------------------------------------

    def add(
        self,
        collection_uri: str,
        examples: Iterable[ExampleLike],
        *,
        timestamps: Iterable[float] | None = None,
    ) -> int:
        """Adds examples in one transaction (all or none) and returns how many were added.

        Timestamps default to ``clock()`` now. The first insert into a collection records its
        schema; later examples must match it (:class:`SchemaMismatchError`). Retention is applied
        to the collection in the same transaction."""
        self._check_open()
        check_uri(collection_uri)
        example_iter = iterate(examples, "examples (dicts of tensor name -> numpy array)")
        ts_iter = None if timestamps is None else iterate(timestamps, "timestamps, one per example")
        now = self._clock()
        sealer = self._sealer
        total = 0
        created: Collection | None = None
        # under the write lock from the look-up on: no other process deletes the collection between
        with self._lock, self._db_errors("add examples"), write_locked(self._engine) as conn:
            coll = self._lookup(collection_uri, conn)
            cursor = _cursor(conn.connection.driver_connection)
            try:
                while chunk := list(islice(example_iter, INSERT_CHUNK)):
                    if coll is None:
                        schema = Schema.from_example(chunk[0])
                        _check_row_fits(schema, cursor, sealed=sealer is not None)
                        coll = created = self._create_collection(conn, collection_uri, schema, now)
                    payload = coll.schema.encode(chunk, collection_uri)
                    n = len(chunk)
                    if sealer is None:
                        size = coll.schema.record_size
                        rows = [payload[i : i + size] for i in range(0, len(payload), size)]
                        ts = repeat(now) if ts_iter is None else take_timestamps(ts_iter, n)
                        cursor.executemany(_INSERT_SQL, zip(repeat(coll.id), ts, rows))
                    else:
                        # + 0.0 turns -0.0 into 0.0, as SQLite reads it back: the timestamp is authenticated
                        ts_list = (
                            [float(now) + 0.0] * n
                            if ts_iter is None
                            else [t + 0.0 for t in take_timestamps(ts_iter, n)]
                        )
                        (end,) = cursor.execute(_RESERVE_IDS_SQL, (n,)).fetchall()[0]
                        first = int(end) - n
                        sealed = sealer.seal(coll, first, ts_list, payload)
                        cursor.executemany(
                            _INSERT_WITH_ID_SQL, zip(range(first, first + n), repeat(coll.id), ts_list, sealed)
                        )
                    total += n
                if ts_iter is not None and next(ts_iter, None) is not None:
                    raise InvalidArgumentError(f"more timestamps than examples ({total}) were given to add()")
                if total and coll is not None:  # a collection exists once an example was added
                    if _apply_policy(cursor, coll, self._retention(collection_uri, conn), self._clock()):
                        self._retention_in_log = True
            finally:
                cursor.close()
        if created is not None:  # only cache what was committed
            self._collections[collection_uri] = created
        if self._scrub_pending:
            self._scrub(1)
        return total

    def _create_collection(self, conn: Connection, uri: str, schema: Schema, now: float) -> Collection:
        schema_text = schema.to_json()
        result = conn.execute(
            collections_table.insert().values(
                uri=uri, schema=schema_text, record_size=schema.record_size, created_at=now
            )
        )
        key = result.inserted_primary_key
        assert key is not None  # the INSERT of one row
        return collection_record(int(key[0]), uri, schema_text)

    # -- retention and housekeeping ------------------------------------------------------------

    def apply_retention(self) -> int:
        """Applies every collection's policy now (re-reading the saved policies); returns how many
        examples were deleted."""
        self._check_open()
        deleted = 0
        with self._lock, self._db_errors("apply retention"), self._engine.begin() as conn:
            saved = {
                row.collection_uri: RetentionPolicy(row.ttl_seconds, row.max_bytes)
                for row in conn.execute(select(retention_table))
            }
            uris = list(conn.execute(select(collections_table.c.uri)).scalars())
            cursor = _cursor(conn.connection.driver_connection)
            try:
                now = self._clock()
                for uri in uris:
                    policy = saved.get(uri, self._default_policy)
                    if not policy.is_noop and (coll := self._lookup(uri, conn)) is not None:  # listed above
                        deleted += _apply_policy(cursor, coll, policy, now)
            finally:
                cursor.close()
        self._scrub(deleted)
        return deleted

    def delete_collection(self, collection_uri: str) -> int:
        """Deletes the collection's examples and its schema (a later add may use a new schema);
        returns how many examples were deleted, 0 for an unknown collection. Its saved retention
        policy stays (see :meth:`clear_retention`)."""
        self._check_open()
        check_uri(collection_uri)
        with self._lock, self._db_errors("delete a collection"), self._engine.begin() as conn:
            coll = self._lookup(collection_uri, conn)
            if coll is None:
                return 0
            deleted = conn.exec_driver_sql("DELETE FROM examples WHERE collection_id = ?", (coll.id,)).rowcount
            conn.exec_driver_sql("DELETE FROM collections WHERE id = ?", (coll.id,))
            self._collections.pop(collection_uri, None)
        self._scrub(1)
        return int(deleted)

    def delete_all(self) -> int:
        """Deletes every collection's examples, its schema and URI, and every saved retention
        policy: what an app's "delete my data" asks for. Returns how many examples were deleted.
        The store stays open and usable, sealed under the same key; the rows are overwritten on
        disk and the write-ahead log cut (see the module's docstring), so that the file keeps none
        of the deleted examples' bytes, nor their collections' names."""
        self._check_open()
        with self._lock, self._db_errors("delete every collection"), self._engine.begin() as conn:
            deleted = conn.exec_driver_sql("DELETE FROM examples").rowcount
            conn.exec_driver_sql("DELETE FROM collections")
            conn.exec_driver_sql("DELETE FROM retention_policies")
            self._collections.clear()
        self._scrub(1)
        return int(deleted)

    def _scrub(self, deleted: int) -> None:
        """After a commit that deleted ``deleted`` rows: cut the write-ahead log, which holds the
        pages as they were before the delete, or leave it for the next write or ``close`` when a
        read still holds an older snapshot."""
        if deleted <= 0 and not self._scrub_pending and not self._retention_in_log:
            return
        self._retention_in_log = False
        try:
            proxied = self._engine.raw_connection()
        except (SQLAlchemyError, sqlite3.Error):
            self._scrub_pending = True
            return
        try:
            self._scrub_pending = not scrub_wal(cast(sqlite3.Connection, proxied.driver_connection))
        finally:
            proxied.close()

    def delete_before(self, collection_uri: str, timestamp: float) -> int:
        """Deletes the collection's examples with ``timestamp < timestamp``; returns how many
        (0 for an unknown collection)."""
        self._check_open()
        check_uri(collection_uri)
        cutoff = check_timestamp("timestamp", timestamp)
        with self._lock, self._db_errors("delete examples"), self._engine.begin() as conn:
            coll = self._lookup(collection_uri, conn)
            if coll is None:
                return 0
            deleted = int(
                conn.exec_driver_sql(
                    "DELETE FROM examples WHERE collection_id = ? AND timestamp < ?", (coll.id, cutoff)
                ).rowcount
            )
        self._scrub(deleted)
        return deleted

    def stats(self, collection_uri: str) -> CollectionStats:
        """Count, bytes and timestamp range of a collection (after expiring what its TTL drops)."""
        coll = self._require(collection_uri)
        not_before = self._expire(coll)
        with self._db_errors("read collection statistics"), self._engine.connect() as conn:
            n, oldest, newest, stored = conn.exec_driver_sql(
                "SELECT COUNT(*), MIN(timestamp), MAX(timestamp), COALESCE(SUM(LENGTH(payload)), 0) "
                "FROM examples WHERE collection_id = ? AND timestamp >= ?",
                (coll.id, float("-inf") if not_before is None else not_before),
            ).one()
        return CollectionStats(
            collection_uri=collection_uri,
            count=int(n),
            payload_bytes=int(n) * coll.schema.record_size,
            stored_bytes=int(stored),
            oldest=None if oldest is None else float(oldest),
            newest=None if newest is None else float(newest),
            retention=self.retention_for(collection_uri),
        )

    def _expire(self, coll: Collection) -> float | None:
        """The cheap part of retention that runs before reads: TTL only, and a write transaction
        only when an index probe finds an expired example. Returns None, or the TTL's cutoff when
        the expired examples could not be deleted (a full disk, where SQLite needs room even to
        delete; a read-only file): the read then leaves them out itself. The delete's error made
        the whole collection unreadable, a session's training included, until space was freed."""
        ttl = self.retention_for(coll.uri).ttl_seconds
        if ttl is None:
            return None
        cutoff = self._clock() - ttl
        with self._db_errors("expire examples"), self._engine.connect() as conn:
            expired = conn.exec_driver_sql(
                "SELECT 1 FROM examples WHERE collection_id = ? AND timestamp < ? LIMIT 1", (coll.id, cutoff)
            ).first()
        if expired is None:
            return None
        try:
            with self._lock, self._engine.begin() as conn:
                conn.exec_driver_sql(
                    "DELETE FROM examples WHERE collection_id = ? AND timestamp < ?", (coll.id, cutoff)
                )
            self._retention_in_log = True
        except (SQLAlchemyError, sqlite3.Error) as exc:
            log.warning(
                "could not delete the examples of %s past their TTL in %s (%s); they are not read, and are "
                "deleted at a later read",
                coll.uri,
                self.path,
                sqlite_advice(exc),
            )
            return cutoff
        return None

    # -- reading -----------------------------------------------------------------------------

    def _resume_position(self, selector: ExampleSelector) -> Position | None:
        if selector.resume_after is None:
            return None
        return self._tokens.verify(selector.resume_after, selector.collection_uri, selector.order)

    def count(self, selector: ExampleSelector) -> int:
        coll = self._require(check_selector(selector).collection_uri)
        after = self._resume_position(selector)
        not_before = self._expire(coll)
        where, params = where_clause(coll, selector, after, not_before)
        with self._db_errors("count examples"), self._engine.connect() as conn:
            n = int(conn.exec_driver_sql(f"SELECT COUNT(*) FROM examples WHERE {where}", tuple(params)).scalar_one())
        return n if selector.limit is None else min(n, selector.limit)

    def query(self, selector: ExampleSelector) -> ExampleIterator:
        """Streams examples as dicts of views into per-chunk decoded arrays."""
        return self._open_iterator(selector, None)

    def query_batches(self, selector: ExampleSelector, batch_size: int) -> ExampleIterator:
        """Streams batches decoded a chunk at a time (the fast path the runtime trains on)."""
        return self._open_iterator(selector, check_batch_size(batch_size))

    def _open_iterator(self, selector: ExampleSelector, batch_size: int | None) -> SQLiteIterator:
        coll = self._require(check_selector(selector).collection_uri)
        after = self._resume_position(selector)
        not_before = self._expire(coll)
        where, params = where_clause(coll, selector, after, not_before)
        direction = "ASC" if selector.order == "oldest" else "DESC"
        sql = (
            f"SELECT payload, id, timestamp FROM examples WHERE {where} ORDER BY timestamp {direction}, id {direction}"
        )
        if selector.limit is not None:
            sql += " LIMIT ?"
            params.append(selector.limit)
        chunk = READ_CHUNK if batch_size is None else batch_size * max(1, READ_CHUNK // batch_size)
        with self._db_errors("query examples"):
            proxied = self._engine.raw_connection()
            try:
                cursor = _cursor(proxied.driver_connection)
                cursor.arraysize = chunk
                cursor.execute(sql, params)
            except BaseException:
                proxied.close()
                raise
        iterator = SQLiteIterator(
            proxied, cursor, coll, batch_size, str(self.path), self._sealer, self._tokens, selector.order, after
        )
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
        if self._scrub_pending:  # a read held the log at a delete; this store's reads have ended now
            self._scrub(1)
        self._engine.dispose()

    def __enter__(self) -> SQLiteExampleStore:
        self._check_open()  # a store closed by an earlier ``with`` is not opened again
        return self

    def _check_open(self) -> None:
        if self._closed:
            raise ExampleStoreError(f"the example store {self.path} is closed; open a new SQLiteExampleStore")

    @contextmanager
    def _db_errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except (SQLAlchemyError, sqlite3.Error) as exc:
            raise ExampleStoreError(
                f"could not {action} in {self.path}: {sqlite_advice(exc)}", retryable=sqlite_locked(exc)
            ) from exc

    def __repr__(self) -> str:
        return f"SQLiteExampleStore({str(self.path)!r}{', sealed' if self.sealed else ''})"


def _wal_holds_frames(path: Path) -> bool:
    """Whether ``path``'s write-ahead log holds more than its 32-byte header: pages that no
    checkpoint cut away since (a log of 0 bytes, or none, is what a cut or a clean close leaves)."""
    try:
        return os.path.getsize(f"{path}-wal") > 32
    except OSError:
        return False


def _cursor(driver_connection: object) -> sqlite3.Cursor:
    """A cursor on the pysqlite connection under SQLAlchemy's (the engine is always SQLite's), where
    rows are inserted and read in bulk without SQLAlchemy's per-row cost."""
    return cast(sqlite3.Connection, driver_connection).cursor()


def _check_row_fits(schema: Schema, cursor: sqlite3.Cursor, *, sealed: bool) -> None:
    """``InvalidArgumentError`` for examples larger than SQLite keeps in one row (10^9 bytes by
    default), said before any is encoded: they were copied into one payload, then refused by
    SQLite with advice to delete the database."""
    size = schema.record_size + (NONCE_BYTES + TAG_BYTES if sealed else 0)
    limit = cursor.connection.getlimit(sqlite3.SQLITE_LIMIT_LENGTH)
    if size > limit:
        raise InvalidArgumentError(
            f"an example of {schema.describe()} takes {size:,} bytes, more than the {limit:,} the example store keeps "
            f"in one row: split it into examples of smaller tensors, or keep large data (media, say) outside the "
            f"example store and store what the plan reads of it"
        )


def _apply_policy(cursor: sqlite3.Cursor, coll: Collection, policy: RetentionPolicy, now: float) -> int:
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
