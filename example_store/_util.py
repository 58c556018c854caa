"""Argument checks shared by the store implementations."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import islice
from typing import Any

import numpy as np

from .errors import InvalidArgumentError, UnknownCollectionError
from .retention import RetentionPolicy
from .selector import MAX_TIMESTAMP, ExampleSelector, check_seconds
from .spelling import closest


def check_uri(uri: Any) -> str:
    if not isinstance(uri, str) or not uri or "\x00" in uri:
        raise InvalidArgumentError(f"a collection URI must be a non-empty string such as 'app:/digits', got {uri!r}")
    return uri


def check_selector(selector: Any) -> ExampleSelector:
    if not isinstance(selector, ExampleSelector):
        raise InvalidArgumentError(
            f"expected an ExampleSelector, got {type(selector).__name__}; build one with "
            f"ExampleSelector(collection_uri) or ExampleSelector.from_dict(d)"
        )
    return selector


def check_policy(policy: Any) -> RetentionPolicy:
    if not isinstance(policy, RetentionPolicy):
        raise InvalidArgumentError(f"policy must be a RetentionPolicy, got {type(policy).__name__}")
    return policy


def check_timestamp(name: str, value: Any) -> float:
    seconds = math.nan
    if not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating)):
        try:
            seconds = float(value)
        except OverflowError:  # an int past float's range: np.isfinite failed on it with a TypeError
            pass
    if not math.isfinite(seconds):
        raise InvalidArgumentError(f"{name} must be a finite number of unix seconds, got {value!r:.100}")
    return check_seconds(name, seconds)


def take_timestamps(ts_iter: Iterator[float], n: int) -> list[float]:
    chunk = list(islice(ts_iter, n))
    if len(chunk) < n:
        raise InvalidArgumentError("fewer timestamps than examples were given to add(); pass one per example")
    try:
        arr = np.asarray(chunk, dtype=np.float64)
    except (TypeError, ValueError, OverflowError) as exc:  # an int past float's range: OverflowError
        raise InvalidArgumentError(f"timestamps must be numbers of unix seconds ({exc})") from exc
    if arr.ndim != 1 or not np.isfinite(arr).all():
        raise InvalidArgumentError("timestamps must be finite numbers of unix seconds, one per example")
    if len(arr) and arr.max() > MAX_TIMESTAMP:
        check_seconds("add()'s timestamp", float(arr.max()))
    return arr.tolist()


def check_path(name: str, path: Any) -> str | os.PathLike:
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"{name} is a file's path (a str or a pathlib.Path), not {type(path).__name__} {path!r:.100}"
        )
    return path


def check_clock(clock: Any) -> Callable[[], float]:
    """``clock`` as the store reads it: each time it gives is refused when it is milliseconds."""
    if not callable(clock):
        raise InvalidArgumentError(
            f"clock is a function giving unix seconds (time.time, the default), not {type(clock).__name__} {clock!r:.100}"
        )
    if clock is time.time:
        return clock

    def now() -> float:
        return check_seconds("the store's clock() time", clock())

    return now


def iterate(values: Any, what: str) -> Iterator[Any]:
    """An iterator over ``add()``'s examples or timestamps, or ``InvalidArgumentError`` saying what
    they are: one example (a dict) iterated as its tensor names, and None or a number failed with
    a bare TypeError."""
    if isinstance(values, Mapping):
        raise InvalidArgumentError(
            f"add() takes an iterable of {what}, got one dict: to add one example, pass [example]"
        )
    if isinstance(values, (str, bytes)):
        raise InvalidArgumentError(f"add() takes an iterable of {what}, got {type(values).__name__} {values!r:.100}")
    try:
        return iter(values)
    except TypeError:
        raise InvalidArgumentError(
            f"add() takes an iterable of {what} (a list or a generator), got {type(values).__name__} {values!r:.100}"
        ) from None


def unknown_collection(store: str, uri: str, known: Iterable[str]) -> UnknownCollectionError:
    """The error for a selector or call naming a collection ``store`` does not hold, naming the
    collection it most likely meant (a typo of its URI) and those it has."""
    known = list(known)
    # compared past what every URI shares ('app:/'): the scheme alone made 'app:/photos' read as 'app:/contacts'
    prefix = os.path.commonprefix([uri, *known])
    shared = max(prefix.rfind("/"), prefix.rfind(":")) + 1  # whole segments: 'app:/digit' is a typo of 'digits'
    meant = closest(uri[shared:], [k[shared:] for k in known])
    hint = f"did you mean {uri[:shared] + meant!r}? " if meant is not None else ""
    return UnknownCollectionError(
        f"{store} has no collection {uri!r} ({hint}it has {known}); add examples with store.add({uri!r}, examples) "
        f"first, or fix the selector's collection_uri"
    )
