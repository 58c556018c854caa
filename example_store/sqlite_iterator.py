"""Streaming an SQLite example store's rows: one pooled connection per iterator, rows fetched in
chunks of ``READ_CHUNK`` by an index range scan (``where_clause``), opened if the store is sealed, and
decoded into examples or batches; its position is what a resumption token records."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from operator import itemgetter, length_hint
from typing import Any

import numpy as np

from .errors import ExampleStoreError
from .interface import ExampleIterator
from .resumption import Position, ResumptionTokens
from .sealing import Collection, RowSealer
from .selector import ExampleSelector

#: Rows per fetch while streaming.
READ_CHUNK = 1024

_payload_of = itemgetter(0)


class SQLiteIterator(ExampleIterator):
    """Streams rows of one SELECT; decodes (and unseals) a chunk at a time. Holds a pooled
    connection (and so a WAL read snapshot) until exhausted or closed, never a lock."""

    def __init__(
        self,
        proxied: Any,
        cursor: sqlite3.Cursor,
        coll: Collection,
        batch_size: int | None,
        path: str,
        sealer: RowSealer | None,
        tokens: ResumptionTokens,
        order: str,
        after: Position | None,
    ) -> None:
        self._proxied = proxied
        self._cursor: sqlite3.Cursor | None = cursor
        self._coll = coll
        self._schema = coll.schema
        self._batch_size = batch_size
        self._path = path
        self._sealer = sealer
        self._tokens = tokens
        self._order = order
        self._pending: Iterator[dict[str, np.ndarray]] = iter(())
        # Position tracking for resumption tokens, off the per-example path: the current chunk's
        # rows, how many items (examples or batches) it was split into, and where the previous
        # chunks ended. What was returned is derived from how much of _pending is left.
        self._rows: list[tuple[bytes, int, float]] | None = None  # (payload, id, timestamp)
        self._items = 0
        self._before: Position | None = after

    def __next__(self) -> dict[str, np.ndarray]:
        item = next(self._pending, None)
        if item is not None:
            return item
        if self._cursor is None:
            raise StopIteration
        if self._rows:  # every row of the chunk was returned
            last = self._rows[-1]
            self._before = (last[2], last[1])
            self._rows = None
        try:
            rows = self._cursor.fetchmany()
            if not rows:
                raise StopIteration
            n = len(rows)
            if self._sealer is None:
                payload = b"".join(map(_payload_of, rows))
            else:
                payload = self._sealer.open(self._coll, rows, self._path)
            columns = self._schema.decode(payload, n)
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
        if self._batch_size is None:
            items = self._schema.split(columns, n)
        else:
            bs = self._batch_size
            items = [{k: v[i : i + bs] for k, v in columns.items()} for i in range(0, n, bs)]
        self._rows, self._items = rows, len(items)
        self._pending = iter(items)
        return next(self._pending)

    def _position(self) -> Position | None:
        rows = self._rows
        if not rows:
            return self._before
        returned = self._items - length_hint(self._pending)
        if returned <= 0:
            return self._before
        per = 1 if self._batch_size is None else self._batch_size
        row = rows[min(returned * per, len(rows)) - 1]
        return (row[2], row[1])

    def resumption_token(self) -> str:
        return self._tokens.issue(self._coll.uri, self._order, self._position())

    def close(self) -> None:
        """Finalizes the statement (ending the read snapshot) and returns the connection to the pool."""
        self._before = self._position()
        self._rows = None
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


def where_clause(
    coll: Collection, selector: ExampleSelector, after: Position | None, not_before: float | None = None
) -> tuple[str, list[Any]]:
    """``not_before``: a TTL's cutoff whose expired examples are still in the file (not deleted)."""
    clauses: list[str] = ["collection_id = ?"]
    params: list[Any] = [coll.id]
    if not_before is not None:
        clauses.append("timestamp >= ?")
        params.append(not_before)
    if selector.start_time is not None:
        clauses.append("timestamp >= ?")
        params.append(selector.start_time)
    if selector.end_time is not None:
        clauses.append("timestamp < ?")
        params.append(selector.end_time)
    if after is not None:
        clauses.append("(timestamp, id) > (?, ?)" if selector.order == "oldest" else "(timestamp, id) < (?, ?)")
        params.extend(after)
    return " AND ".join(clauses), params
