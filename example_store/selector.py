"""What a plan asks the store for: a collection, a time window, a limit and an order.

It is a frozen value that travels inside plan files, so it validates itself on construction and
round-trips through JSON-safe dicts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import InvalidArgumentError

ORDERS = ("oldest", "newest")
_FIELDS = ("collection_uri", "start_time", "end_time", "limit", "order", "resume_after")
_MAX_TOKEN_CHARS = 4096
#: The largest limit: what a store's SQL takes (an SQLite INTEGER, int64).
MAX_LIMIT = 2**63 - 1
#: The latest time a store takes, 3000-01-01T00:00:00Z in unix seconds. A time past it is
#: milliseconds taken for seconds (Android's ``System.currentTimeMillis()`` is about 1.7e12): an
#: example stamped so would never expire under a TTL, and a window so bounded would hold nothing.
MAX_TIMESTAMP = 32_503_680_000.0


def check_seconds(name: str, value: float) -> float:
    """``value`` (a finite float) if it is a time of seconds since the epoch, not milliseconds."""
    if value > MAX_TIMESTAMP:
        raise InvalidArgumentError(
            f"{name} {value!r} is past the year 3000: the example store takes seconds since the epoch "
            f"(time.time()), and this looks like milliseconds (System.currentTimeMillis()); divide it by 1000"
        )
    return value


def _check_time(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(
            f"ExampleSelector.{name} must be a number of unix seconds or None, got {value!r} ({type(value).__name__})"
        )
    try:
        value = float(value)
    except OverflowError:  # an int past float's range (a plan's JSON can hold 10^400)
        value = math.inf
    if not math.isfinite(value):
        raise InvalidArgumentError(f"ExampleSelector.{name} must be finite, got {value!r}; use None for no bound")
    return check_seconds(f"ExampleSelector.{name}", value)


@dataclass(frozen=True)
class ExampleSelector:
    """Selects examples of one collection: ``start_time <= timestamp < end_time``, ordered by
    timestamp (ties broken by insertion order), at most ``limit`` of them.

    ``resume_after`` is a resumption token from an earlier iterator of the same collection and
    order (``iterator.resumption_token()``): the selection then starts strictly after the last
    example that iterator returned. The store checks the token when it is queried.

    Raises :class:`InvalidArgumentError` (a ``ValueError`` and an ``ExampleStoreError``) when a
    field is malformed.
    """

    collection_uri: str
    start_time: float | None = None
    end_time: float | None = None
    limit: int | None = None
    order: str = "oldest"
    resume_after: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.collection_uri, str) or not self.collection_uri or "\x00" in self.collection_uri:
            raise InvalidArgumentError(
                f"ExampleSelector.collection_uri must be a non-empty string such as 'app:/digits', "
                f"got {self.collection_uri!r}"
            )
        object.__setattr__(self, "start_time", _check_time("start_time", self.start_time))
        object.__setattr__(self, "end_time", _check_time("end_time", self.end_time))
        if self.limit is not None and (
            isinstance(self.limit, bool) or not isinstance(self.limit, int) or not 0 <= self.limit <= MAX_LIMIT
        ):
            raise InvalidArgumentError(
                f"ExampleSelector.limit must be an int from 0 to 2^63 - 1 or None, got {self.limit!r:.80}"
            )
        if self.order not in ORDERS:
            raise InvalidArgumentError(f"ExampleSelector.order must be one of {ORDERS}, got {self.order!r}")
        token = self.resume_after
        if token is not None and (not isinstance(token, str) or not token or len(token) > _MAX_TOKEN_CHARS):
            raise InvalidArgumentError(
                f"ExampleSelector.resume_after must be a resumption token string from "
                f"iterator.resumption_token(), or None, got {token!r:.80}"
            )

    def resuming(self, token: str | None) -> ExampleSelector:
        """The same selector, resuming after ``token`` (``None``: from the start)."""
        return dataclasses.replace(self, resume_after=token)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (plan files carry it); :meth:`from_dict` reads it back. ``resume_after``
        appears only when set, so selectors without one read the same as before it existed."""
        d = {name: getattr(self, name) for name in _FIELDS}
        if d["resume_after"] is None:
            del d["resume_after"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExampleSelector:
        """Parses and validates a dict written by :meth:`to_dict`; unknown keys are rejected so that
        a typo in a plan is not silently ignored."""
        if not isinstance(d, Mapping):
            raise InvalidArgumentError(f"an example selector must be a JSON object, got {type(d).__name__}")
        unknown = sorted(str(k) for k in d if k not in _FIELDS)
        if unknown:
            raise InvalidArgumentError(
                f"unknown example selector field(s) {unknown}; the allowed fields are {list(_FIELDS)}"
            )
        if "collection_uri" not in d:
            raise InvalidArgumentError("an example selector needs a 'collection_uri' field, e.g. 'app:/digits'")
        return cls(**{k: d[k] for k in _FIELDS if k in d})
