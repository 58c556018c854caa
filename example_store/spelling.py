"""Which of the names a program knows a mistyped one was meant as: what its refusals name (a
collection URI, a CLI option, a data format). Here, at the bottom of the project's packages, so
that each package says it the same way."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The one of ``choices`` that ``word`` was most likely meant as (a typo of it), or None."""
    found = difflib.get_close_matches(word, list(choices), 1)
    return found[0] if found else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """A message's ending that names the choice closest to ``word``, " (did you mean X?)", for a
    message that refuses it; "" when no choice is close."""
    meant = closest(word, choices)
    return f" (did you mean {meant}?)" if meant else ""
