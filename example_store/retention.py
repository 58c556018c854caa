"""How long examples live: a TTL and a byte cap per collection, so an app's database cannot grow
without bound on a phone."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import InvalidArgumentError
from .selector import MAX_LIMIT


@dataclass(frozen=True)
class RetentionPolicy:
    """``ttl_seconds``: examples with ``clock() - timestamp > ttl_seconds`` are deleted.
    ``max_bytes``: cap on a collection's total payload bytes; the oldest examples are evicted first.
    ``None`` disables either rule."""

    ttl_seconds: float | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        ttl = self.ttl_seconds
        if ttl is not None:
            if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or ttl < 0:
                raise InvalidArgumentError(
                    f"RetentionPolicy.ttl_seconds must be a finite number >= 0 or None, got {ttl!r}"
                )
            object.__setattr__(self, "ttl_seconds", float(ttl))
        cap = self.max_bytes
        # at most the largest integer a store's SQL takes: a larger cap failed with an OverflowError when saved
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= MAX_LIMIT):
            raise InvalidArgumentError(
                f"RetentionPolicy.max_bytes must be an int from 0 to 2^63 - 1 (None: no cap), got {cap!r}"
            )

    @property
    def is_noop(self) -> bool:
        return self.ttl_seconds is None and self.max_bytes is None


@dataclass(frozen=True)
class CollectionStats:
    """What :meth:`stats` reports about one collection (after expiring examples past their TTL).

    ``payload_bytes`` counts the examples' tensor bytes (what ``max_bytes`` caps); ``stored_bytes``
    is what the payloads take in the store (sealing adds a nonce and a tag per example).
    ``oldest``/``newest`` are timestamps, ``None`` when the collection is empty."""

    collection_uri: str
    count: int
    payload_bytes: int
    stored_bytes: int
    oldest: float | None
    newest: float | None
    retention: RetentionPolicy
