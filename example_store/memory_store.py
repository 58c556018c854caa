"""An ExampleStore in memory: for tests, for apps that produce examples on the fly, and as a
small worked example of implementing the interface, ``query_batches`` included (it slices
decoded columns instead of stacking examples one at a time).

It behaves as :class:`SQLiteExampleStore` does (schemas, ordering with ties in insertion order,
windows, limits, TTL and size-cap retention, resumption tokens), minus persistence and sealing:
nothing is at rest. Queries read a snapshot taken when they start.
"""

from __future__ import annotations

import bisect
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import count, islice

import numpy as np

from ._util import (
    check_clock,
    check_policy,
    check_selector,
    check_timestamp,
    check_uri,
    iterate,
    take_timestamps,
    unknown_collection,
)
from .codec import Example, ExampleLike, Schema
from .errors import ExampleStoreError, InvalidArgumentError
from .interface import ExampleIterator, ExampleStore, check_batch_size
from .resumption import Position, ResumptionTokens
from .retention import CollectionStats, RetentionPolicy
from .selector import ExampleSelector

_CHUNK = 1024


@dataclass
class _MemCollection:
    schema: Schema
    keys: list[Position] = field(default_factory=list)  # sorted (timestamp, insertion id)
    payloads: list[bytes] = field(default_factory=list)  # parallel to keys


class InMemoryExampleStore(ExampleStore):
    """Examples in memory, with the same behaviour as :class:`SQLiteExampleStore` (see the module
    docstring). ``retention`` is the default policy, ``clock`` gives unix seconds."""

    def __init__(self, *, retention: RetentionPolicy | None = None, clock: Callable[[], float] = time.time) -> None:
        if retention is not None and not isinstance(retention, RetentionPolicy):
            raise InvalidArgumentError(f"retention must be a RetentionPolicy or None, got {type(retention).__name__}")
        self._default_policy = retention or RetentionPolicy()
        self._policies: dict[str, RetentionPolicy] = {}
        self._clock = check_clock(clock)
        self._lock = threading.RLock()
        self._collections: dict[str, _MemCollection] = {}
        self._ids = count(1)
        self._tokens = ResumptionTokens(secrets.token_bytes(32))
        self._closed = False

    # -- collections and policies ----------------------------------------------------------------

    def collections(self) -> list[str]:
        self._check_open()
        return sorted(self._collections)

    def schema(self, collection_uri: str) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        return self._require(collection_uri).schema.as_dict()

    def retention_for(self, collection_uri: str) -> RetentionPolicy:
        check_uri(collection_uri)  # 5 read as a collection with no policy of its own, and got the default
        return self._policies.get(collection_uri, self._default_policy)

    def set_retention(self, collection_uri: str, policy: RetentionPolicy) -> None:
        check_policy(policy)
        check_uri(collection_uri)
        self._check_open()
        with self._lock:
            self._policies[collection_uri] = policy
            coll = self._collections.get(collection_uri)
            if coll is not None:
                self._apply(coll, policy, self._clock())

    def clear_retention(self, collection_uri: str) -> None:
        check_uri(collection_uri)
        with self._lock:
            self._policies.pop(collection_uri, None)

    def _require(self, uri: str) -> _MemCollection:
        self._check_open()
        check_uri(uri)
        coll = self._collections.get(uri)
        if coll is None:
            raise unknown_collection("the in-memory example store", uri, self.collections())
        return coll

    # -- writing -----------------------------------------------------------------------------

    def add(
        self, collection_uri: str, examples: Iterable[ExampleLike], *, timestamps: Iterable[float] | None = None
    ) -> int:
        """Adds examples (all or none) and returns how many; see :meth:`SQLiteExampleStore.add`."""
        self._check_open()
        check_uri(collection_uri)
        example_iter = iterate(examples, "examples (dicts of tensor name -> numpy array)")
        ts_iter = None if timestamps is None else iterate(timestamps, "timestamps, one per example")
        now = self._clock()
        with self._lock:
            coll = self._collections.get(collection_uri)
            schema = None if coll is None else coll.schema
            new_keys: list[Position] = []
            new_payloads: list[bytes] = []
            while chunk := list(islice(example_iter, 2048)):
                if schema is None:
                    schema = Schema.from_example(chunk[0])
                payload = schema.encode(chunk, collection_uri)
                ts = [float(now)] * len(chunk) if ts_iter is None else take_timestamps(ts_iter, len(chunk))
                new_keys.extend((t + 0.0, next(self._ids)) for t in ts)
                new_payloads.extend(_rows(payload, schema.record_size))
            if ts_iter is not None and next(ts_iter, None) is not None:
                raise InvalidArgumentError(f"more timestamps than examples ({len(new_keys)}) were given to add()")
            return self._insert(collection_uri, schema, new_keys, new_payloads)

    def add_columns(
        self, collection_uri: str, columns: Mapping[str, np.ndarray], *, timestamp: float | None = None
    ) -> int:
        """Adds the examples held as columns (tensor name -> array whose first axis runs over the
        examples), all stamped ``timestamp`` (``clock()`` now when None): the store then holds
        what ``add`` of each row as an example would, encoded a column at a time instead of an
        example at a time. Returns how many were added."""
        self._check_open()
        check_uri(collection_uri)
        stamp = self._clock() if timestamp is None else check_timestamp("timestamp", timestamp)
        if not isinstance(columns, Mapping):  # a list or an array failed with "has no attribute 'items'"
            raise InvalidArgumentError(
                f"add_columns takes a dict of tensor name -> array (its first axis over the examples), "
                f"not {type(columns).__name__} {columns!r:.100}"
            )
        arrays = {name: np.asarray(col) for name, col in columns.items()}
        counts = {a.shape[0] if a.ndim else -1 for a in arrays.values()}
        if len(counts) > 1 or -1 in counts:
            raise InvalidArgumentError(
                f"columns must be arrays of one length along their first axis, got { {k: a.shape for k, a in arrays.items()} }"
            )
        n = counts.pop() if counts else 0
        if n == 0:
            return 0
        with self._lock:
            coll = self._collections.get(collection_uri)
            schema = coll.schema if coll is not None else Schema.from_example({k: a[0] for k, a in arrays.items()})
            payload = schema.encode_columns(arrays, n, collection_uri)
            keys = [(float(stamp) + 0.0, next(self._ids)) for _ in range(n)]
            return self._insert(collection_uri, schema, keys, list(_rows(payload, schema.record_size)))

    def _insert(
        self, collection_uri: str, schema: Schema | None, new_keys: list[Position], new_payloads: list[bytes]
    ) -> int:
        """Puts encoded examples into their collection in key order (under the lock), applying
        its retention; how many."""
        if not new_keys:
            return 0
        coll = self._collections.get(collection_uri)
        if coll is None:
            assert schema is not None  # made from the first example: new_keys is not empty
            coll = self._collections[collection_uri] = _MemCollection(schema)
        if not coll.keys or min(new_keys) > coll.keys[-1]:  # the usual case: appending newer examples
            order = sorted(range(len(new_keys)), key=new_keys.__getitem__)
            coll.keys.extend(new_keys[i] for i in order)
            coll.payloads.extend(new_payloads[i] for i in order)
        else:
            merged = sorted(zip(coll.keys + new_keys, coll.payloads + new_payloads), key=lambda kp: kp[0])
            coll.keys = [k for k, _ in merged]
            coll.payloads = [p for _, p in merged]
        self._apply(coll, self.retention_for(collection_uri), self._clock())
        return len(new_keys)

    # -- retention and housekeeping --------------------------------------------------------------

    def _apply(self, coll: _MemCollection, policy: RetentionPolicy, now: float) -> int:
        """Deletes what the policy no longer allows (oldest first); returns how many."""
        drop = 0
        if policy.ttl_seconds is not None:
            drop = bisect.bisect_left(coll.keys, (now - policy.ttl_seconds, -1))
        if policy.max_bytes is not None:
            keep = policy.max_bytes // coll.schema.record_size
            drop = max(drop, len(coll.keys) - keep)
        if drop:
            del coll.keys[:drop], coll.payloads[:drop]
        return drop

    def apply_retention(self) -> int:
        self._check_open()
        with self._lock:
            now = self._clock()
            return sum(self._apply(c, self.retention_for(uri), now) for uri, c in self._collections.items())

    def delete_collection(self, collection_uri: str) -> int:
        self._check_open()
        check_uri(collection_uri)
        with self._lock:
            coll = self._collections.pop(collection_uri, None)
            return 0 if coll is None else len(coll.keys)

    def delete_all(self) -> int:
        """Deletes every collection and every retention policy set; how many examples were deleted."""
        self._check_open()
        with self._lock:
            deleted = sum(len(coll.keys) for coll in self._collections.values())
            self._collections.clear()
            self._policies.clear()
            return deleted

    def delete_before(self, collection_uri: str, timestamp: float) -> int:
        self._check_open()
        check_uri(collection_uri)
        cutoff = check_timestamp("timestamp", timestamp)
        with self._lock:
            coll = self._collections.get(collection_uri)
            if coll is None:
                return 0
            drop = bisect.bisect_left(coll.keys, (cutoff, -1))
            del coll.keys[:drop], coll.payloads[:drop]
            return drop

    def stats(self, collection_uri: str) -> CollectionStats:
        with self._lock:
            coll = self._expire(collection_uri)
            n = len(coll.keys)
            return CollectionStats(
                collection_uri=collection_uri,
                count=n,
                payload_bytes=n * coll.schema.record_size,
                stored_bytes=n * coll.schema.record_size,
                oldest=coll.keys[0][0] if n else None,
                newest=coll.keys[-1][0] if n else None,
                retention=self.retention_for(collection_uri),
            )

    def _expire(self, uri: str) -> _MemCollection:
        coll = self._require(uri)
        ttl = self.retention_for(uri).ttl_seconds
        if ttl is not None:
            self._apply(coll, RetentionPolicy(ttl_seconds=ttl), self._clock())
        return coll

    # -- reading -----------------------------------------------------------------------------

    def _select(self, selector: ExampleSelector) -> tuple[_MemCollection, list[Position], list[bytes], Position | None]:
        check_selector(selector)
        with self._lock:
            coll = self._expire(selector.collection_uri)
            after = None
            if selector.resume_after is not None:
                after = self._tokens.verify(selector.resume_after, selector.collection_uri, selector.order)
            keys = coll.keys
            lo = 0 if selector.start_time is None else bisect.bisect_left(keys, (selector.start_time, -1))
            hi = len(keys) if selector.end_time is None else bisect.bisect_left(keys, (selector.end_time, -1))
            if after is not None:
                if selector.order == "oldest":
                    lo = max(lo, bisect.bisect_right(keys, after))
                else:
                    hi = min(hi, bisect.bisect_left(keys, after))
            sel_keys, sel_payloads = keys[lo:hi], coll.payloads[lo:hi]
        if selector.order == "newest":
            sel_keys.reverse()
            sel_payloads.reverse()
        if selector.limit is not None:
            del sel_keys[selector.limit :], sel_payloads[selector.limit :]
        return coll, sel_keys, sel_payloads, after

    def count(self, selector: ExampleSelector) -> int:
        return len(self._select(selector)[1])

    def query(self, selector: ExampleSelector) -> ExampleIterator:
        coll, keys, payloads, after = self._select(selector)
        return _MemoryIterator(
            coll.schema, keys, payloads, after, self._tokens, selector.collection_uri, selector.order
        )

    def query_batches(self, selector: ExampleSelector, batch_size: int) -> ExampleIterator:
        """Streams batches sliced from columns decoded a chunk at a time (the path the runtime trains on)."""
        size = check_batch_size(batch_size)
        coll, keys, payloads, after = self._select(selector)
        return _MemoryIterator(
            coll.schema, keys, payloads, after, self._tokens, selector.collection_uri, selector.order, size
        )

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> InMemoryExampleStore:
        self._check_open()  # a store closed by an earlier ``with`` is not opened again
        return self

    def _check_open(self) -> None:
        if self._closed:
            raise ExampleStoreError("the in-memory example store is closed; create a new InMemoryExampleStore")

    def __repr__(self) -> str:
        return f"InMemoryExampleStore({len(self._collections)} collections)"


def _rows(payload: bytes, size: int) -> list[bytes]:
    """Encoded examples back to back, one bytes object each."""
    return [payload[i : i + size] for i in range(0, len(payload), size)]


class _MemoryIterator(ExampleIterator):
    """Decodes a snapshot of payloads a chunk at a time; counts what it returned for its token.
    With ``batch_size`` it returns batches: slices of the decoded columns, a chunk being a whole
    number of batches so that only the last batch is short."""

    def __init__(
        self,
        schema: Schema,
        keys: list[Position],
        payloads: list[bytes],
        after: Position | None,
        tokens: ResumptionTokens,
        uri: str,
        order: str,
        batch_size: int | None = None,
    ) -> None:
        self._schema = schema
        self._batch_size = batch_size
        self._chunk = _CHUNK if batch_size is None else batch_size * max(1, _CHUNK // batch_size)
        self._columns: dict[str, np.ndarray] = {}
        self._rows = 0
        self._keys: list[Position] | None = keys
        self._payloads = payloads
        self._start = after
        self._tokens, self._uri, self._order = tokens, uri, order
        self._returned = 0
        self._pending: list[Example] = []
        self._pos = 0

    def __next__(self) -> Example:
        if self._batch_size is not None:
            return self._next_batch(self._batch_size)
        if self._pos == len(self._pending):
            if self._keys is None:
                raise StopIteration
            done = self._returned
            chunk = self._payloads[done : done + _CHUNK]
            if not chunk:
                self.close()
                raise StopIteration
            columns = self._schema.decode(b"".join(chunk), len(chunk))
            self._pending, self._pos = self._schema.split(columns, len(chunk)), 0
        item = self._pending[self._pos]
        self._pos += 1
        self._returned += 1
        return item

    def _next_batch(self, size: int) -> dict[str, np.ndarray]:
        if self._pos == self._rows:
            if self._keys is None:
                raise StopIteration
            done = self._returned
            chunk = self._payloads[done : done + self._chunk]
            if not chunk:
                self.close()
                raise StopIteration
            self._columns, self._rows, self._pos = self._schema.decode(b"".join(chunk), len(chunk)), len(chunk), 0
        start, stop = self._pos, min(self._pos + size, self._rows)
        self._pos = stop
        self._returned += stop - start
        return {name: col[start:stop] for name, col in self._columns.items()}

    def resumption_token(self) -> str:
        last = self._keys[self._returned - 1] if self._keys and self._returned else self._start
        return self._tokens.issue(self._uri, self._order, last)

    def close(self) -> None:
        if self._keys is not None:
            self._start = self._keys[self._returned - 1] if self._returned else self._start
            self._keys = None
        self._payloads, self._pending, self._pos = [], [], 0
        self._columns, self._rows = {}, 0
