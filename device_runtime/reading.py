"""How a session reads its plan's examples, and where a resuming plan continues from.

A plan whose device part sets ``resume`` (``DeviceConfig.resume``) does not start at the first
selected example every time: the runtime keeps, per population, task and collection, the
resumption token of the last *completed* session (``iterator.resumption_token()`` of the example
store) and queries ``selector.resuming(token)`` next time. With a selector ``limit`` successive
sessions thus train on successive slices of the device's data.

Rules, chosen so that a device never loses data and never keeps partial state:

* The token is saved only when the session completed (its update was accepted). An interrupted,
  rejected or failed session leaves the saved token as it was, so the next session reads those
  examples again. In an ``OpStatsStore`` it is saved in the transaction that records the session's
  last events: an app killed then keeps both or neither. An app killed once the update had
  started to leave keeps the session as taking part (``-v[]+``: the server may hold its update),
  and with it where it stopped reading (``opstats.READ_TO``, written before the upload): the next
  session reads on from there (``OpStatsStore.resumption_token``) rather than sending that slice
  again.
* Several epochs re-open the selection once each; the token kept is that of the last epoch's
  iterator, which was opened last (so it saw every example added meanwhile) and, in a completed
  session, was read to its end: it is the furthest position read.
* Wrap-around: when resuming selects no examples at all (everything was read), the session reads
  from the beginning (the plan's selector without a token) rather than failing with
  ``NoExamples``. A partial last slice (fewer than ``limit`` examples left) is read as it is.
* A token the store refuses (``InvalidResumptionTokenError``: the store was re-keyed or replaced,
  the plan's order changed) is dropped with a logged warning and the session reads from the start.
* A store whose iterators cannot issue tokens (``ResumptionNotSupportedError``) still trains; a
  warning is logged and every session reads from the start.

Tokens are kept by a :class:`ResumptionTokenKeeper`: the runtime's ``OpStatsStore`` (in the app's
SQLite database, so they survive a restart) or, without one, :class:`MemoryResumptionTokens`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import numpy as np

from example_store import (
    ExampleIterator,
    ExampleSelector,
    ExampleStore,
    InvalidArgumentError,
    ResumptionNotSupportedError,
    UnknownCollectionError,
)

from .batching import chunk_bytes, join_chunks
from .errors import OverBudget
from .plan import DeviceConfig, PlanError

log = logging.getLogger(__name__)

#: The most examples a session reads in one chunk: to shuffle them at once (an honest plan's
#: default shuffle buffer), or as one batch; larger selections are read in batches of the plan's
#: batch size, and a larger batch in pieces of this many examples, counted as they come.
READ_AT_ONCE_MAX = 1024

#: How a session chose its examples (the ``resume`` detail of its ``training_started`` event).
READ_ALL = "all"  # the plan does not resume
READ_CONTINUED = "continued"  # after the saved token
READ_FROM_START = "from_start"  # no usable saved token yet
READ_WRAPPED = "wrapped"  # everything after the saved token was read: from the beginning again


@runtime_checkable
class ResumptionTokenKeeper(Protocol):
    """Where a runtime keeps the resumption tokens of resuming plans (``OpStatsStore`` is one)."""

    def resumption_token(self, population: str, task: str, collection_uri: str) -> str | None: ...

    def save_resumption_token(
        self, population: str, task: str, collection_uri: str, token: str, at: float | None = None
    ) -> None: ...

    def forget_resumption_token(self, population: str, task: str, collection_uri: str) -> None: ...


class MemoryResumptionTokens:
    """Tokens in memory, for a runtime without an opstats database: they last as long as the runtime."""

    def __init__(self) -> None:
        self._tokens: dict[tuple[str, str, str], str] = {}

    def resumption_token(self, population: str, task: str, collection_uri: str) -> str | None:
        return self._tokens.get((population, task, collection_uri))

    def save_resumption_token(
        self, population: str, task: str, collection_uri: str, token: str, at: float | None = None
    ) -> None:
        self._tokens[(population, task, collection_uri)] = token

    def forget_resumption_token(self, population: str, task: str, collection_uri: str) -> None:
        self._tokens.pop((population, task, collection_uri), None)


def _count(store: ExampleStore, selector: ExampleSelector) -> int:
    try:
        return store.count(selector)
    except UnknownCollectionError:
        return 0


class ExampleReading:
    """One session's reading of its plan's examples: the selector it reads (resumed or not), the
    iterators its epochs opened, and the token to save if, and only if, the session completes."""

    def __init__(
        self,
        store: ExampleStore,
        device: DeviceConfig,
        selector: ExampleSelector,
        available: int,
        mode: str,
        key: tuple[str, str, str] | None = None,
        keeper: ResumptionTokenKeeper | None = None,
        max_batch_bytes: int | None = None,
    ) -> None:
        self.store = store
        self.device = device
        self.selector = selector
        self.available = available
        self.mode = mode
        self._key = key
        self._keeper = keeper
        self.max_batch_bytes = max_batch_bytes
        #: The iterator the last epoch opened (the one whose position is kept), and no other: an
        #: epoch opens its iterator once the one before read its last batch, and a plan of 10^9
        #: epochs over one example kept a closed iterator per epoch, 1 MB a second.
        self._opened: list[ExampleIterator] = []
        self._stopped_at: str | None = None

    @classmethod
    def start(
        cls,
        store: ExampleStore,
        device: DeviceConfig,
        *,
        population: str,
        task: str,
        keeper: ResumptionTokenKeeper,
        max_batch_bytes: int | None = None,
    ) -> ExampleReading:
        """Choose what this session reads (see the module docstring for the rules). A batch that
        holds more than ``max_batch_bytes`` ends the session in ``OverBudget`` (``open_batches``)."""
        base = device.selector
        if not device.resume:
            return cls(store, device, base, _count(store, base), READ_ALL, max_batch_bytes=max_batch_bytes)
        key = (population, task, base.collection_uri)
        mode = READ_FROM_START
        token = keeper.resumption_token(*key)
        if token is not None:
            try:
                resumed = base.resuming(token)
                available = _count(store, resumed)
            except (InvalidArgumentError, ResumptionNotSupportedError) as exc:
                log.warning(
                    "population %r, task %r: the example store refused the saved resumption token for %r (%s); "
                    "it is dropped and this session reads from the start",
                    population,
                    task,
                    base.collection_uri,
                    exc,
                )
                keeper.forget_resumption_token(*key)
            else:
                if available > 0:
                    return cls(store, device, resumed, available, READ_CONTINUED, key, keeper, max_batch_bytes)
                mode = READ_WRAPPED
        return cls(store, device, base.resuming(None), _count(store, base), mode, key, keeper, max_batch_bytes)

    @property
    def resumes(self) -> bool:
        return self._key is not None

    def open_batches(self) -> Iterator[dict[str, np.ndarray]]:
        """The ``open_examples`` callable of ``PlanExecutor.batches_from_examples``: called once
        per epoch; the last iterator opened is the one whose position is kept. It reads in
        batches of the plan's batch size, or at once when the selection fits the plan's shuffle
        buffer and holds at most ``READ_AT_ONCE_MAX`` examples: the shuffle then permutes all of
        it at once however it came, so the batches trained are the same, and one chunk costs less
        to check, pool and cut than dozens (a text client's 280 examples in batches of 8: 0.5 ms a
        session). The bound keeps a hostile plan's buffer of 10^9 from reading a store of 100,000
        images in one chunk.

        A batch of more than ``READ_AT_ONCE_MAX`` examples is read in pieces of that many, joined
        into the batches the store would have given (so it trains the same), and counted as they
        come: one that holds more than ``max_batch_bytes`` ends the session in ``OverBudget`` with
        at most one piece read past it (a plan's batch of 10^9 examples read everything at once)."""
        device = self.device
        size = device.batch_size
        if device.shuffle_buffer > 1 and self.available <= min(device.shuffle_buffer, READ_AT_ONCE_MAX):
            size = max(size, self.available)
        self.close()
        if size <= READ_AT_ONCE_MAX:
            iterator = self.store.query_batches(self.selector, size)
            self._opened = [iterator]
            return iterator
        pieces = self.store.query_batches(self.selector, READ_AT_ONCE_MAX)
        self._opened = [pieces]
        return _joined(pieces, size, self.max_batch_bytes)

    def training_completed(self) -> None:
        """Note where reading stopped (after every epoch ran to its end); nothing is saved yet."""
        if not self.resumes or not self._opened:
            return
        try:
            self._stopped_at = self._opened[-1].resumption_token()
        except ResumptionNotSupportedError as exc:
            log.warning(
                "the plan asks to resume reading %r, but the example store cannot (%s); every session reads from the start",
                self.selector.collection_uri,
                exc,
            )

    def position(self) -> tuple[str, str, str, str] | None:
        """(population, task, collection URI, token) where this session stopped, to save once it
        completed (``commit``, or with its events: ``OpStatsStore.record_session(resumption=)``);
        None when there is nothing to save."""
        if self._key is None or self._stopped_at is None:
            return None
        return (*self._key, self._stopped_at)

    def commit(self, at: float | None = None) -> None:
        """Save where this session stopped: call only once the session completed."""
        position = self.position()
        if position is not None and self._keeper is not None:
            self._keeper.save_resumption_token(*position, at if at is not None else time.time())

    def close(self) -> None:
        """Give back every cursor at once (an interrupted session leaves its iterators open)."""
        for iterator in self._opened:
            iterator.close()


def _joined(pieces: ExampleIterator, size: int, max_bytes: int | None) -> Iterator[dict[str, np.ndarray]]:
    """The pieces' examples in batches of ``size`` (the last one may be smaller), in order; raises
    ``OverBudget`` as soon as the pieces of one batch hold more than ``max_bytes``."""
    parts: list[dict[str, np.ndarray]] = []
    count = held = 0
    for piece in pieces:
        if not piece:
            continue
        n = len(next(iter(piece.values())))
        parts.append(piece)
        count += n
        held += chunk_bytes(piece)
        if max_bytes is not None and held > max_bytes:
            raise OverBudget(
                f"a batch of {size:,} examples holds more than this device gives a plan's examples at once "
                f"({max_bytes / (1 << 20):,.0f} MB): {held / (1 << 20):,.0f} MB in its first {count:,} examples"
            )
        if count >= size:
            whole = _joined_parts(parts)
            yield {k: v[:size] for k, v in whole.items()}
            rest = {k: v[size:] for k, v in whole.items()}
            count -= size
            parts = [rest] if count else []
            held = chunk_bytes(rest) if count else 0
    if parts:
        yield _joined_parts(parts)


def _joined_parts(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    try:
        return join_chunks(parts)
    except PlanError:  # it names the tensor and its shapes
        raise
    except (KeyError, ValueError) as exc:  # a store's pieces of other tensors, or other shapes
        raise PlanError(f"the examples of one batch disagree on their tensors or shapes ({exc!s:.200})") from None
