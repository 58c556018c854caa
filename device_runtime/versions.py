"""Runtime version strings, compared as tuples of integers."""

from __future__ import annotations

import functools
import re

_VERSION = re.compile(r"^\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?")


def version_tuple(version: str) -> tuple[int, int, int]:
    """'1.31.1' -> (1, 31, 1); trailing tags such as '+cpu' or 'rc1' are ignored."""
    if not isinstance(version, str):
        raise ValueError(f"{version!r} is not a version such as '1.31.1'")
    return _parsed(version)


@functools.lru_cache(maxsize=256)  # a server reads the same few versions on every check-in
def _parsed(version: str) -> tuple[int, int, int]:
    match = _VERSION.match(version)
    if match is None:
        raise ValueError(f"{version!r} is not a version such as '1.31.1'")
    return tuple(int(g) if g is not None else 0 for g in match.groups())  # type: ignore[return-value]
