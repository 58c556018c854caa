"""Argument checks shared by the store implementations."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import Any

import numpy as np

from .errors import InvalidArgumentError
from .retention import RetentionPolicy
from .selector import ExampleSelector


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
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not np.isfinite(value)
    ):
        raise InvalidArgumentError(f"{name} must be a finite number of unix seconds, got {value!r}")
    return float(value)


def take_timestamps(ts_iter: Iterator[float], n: int) -> list[float]:
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
