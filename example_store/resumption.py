"""Resumption tokens: where the last read of a collection stopped, signed by the store.

A token is ``base64url(json).base64url(hmac)``: the JSON names the collection, the order and the
position ``(timestamp, id)`` of the last example returned (``null`` before the first one), and the
HMAC-SHA256 under a key of the store makes a forged or edited token fail. Passed back as
``ExampleSelector(..., resume_after=token)`` it selects the examples strictly after that position in
the same order. Stores that implement their own iterators can reuse :class:`ResumptionTokens`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
from typing import Any

from .errors import InvalidArgumentError, InvalidResumptionTokenError

#: The position of an example in its collection's order: (timestamp, insertion id).
Position = tuple[float, int]
_VERSION = 1
_TAG_BYTES = 16


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class ResumptionTokens:
    """Issues and checks the tokens of one store (``key``: at least 16 secret bytes)."""

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) < 16:
            raise InvalidArgumentError(
                f"a resumption token key is at least 16 secret bytes (secrets.token_bytes(32)), not "
                f"{f'{len(key)} bytes' if isinstance(key, bytes) else type(key).__name__}"
            )
        self._key = key

    def _tag(self, body: bytes) -> bytes:
        return hmac.new(self._key, b"fedfleet example_store resumption v1\x00" + body, hashlib.sha256).digest()[
            :_TAG_BYTES
        ]

    def issue(self, collection_uri: str, order: str, last: Position | None) -> str:
        doc: dict[str, Any] = {"v": _VERSION, "c": collection_uri, "o": order}
        doc["p"] = None if last is None else [float(last[0]), int(last[1])]
        body = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode("utf-8")
        return f"{_b64(body)}.{_b64(self._tag(body))}"

    def verify(self, token: str, collection_uri: str, order: str) -> Position | None:
        """The position the token resumes after (``None``: from the start); raises
        :class:`InvalidResumptionTokenError` for a forged token or one of another collection/order."""
        try:
            body_text, tag_text = token.split(".")
            body, tag = _unb64(body_text), _unb64(tag_text)
        except (ValueError, AttributeError, binascii.Error):
            raise InvalidResumptionTokenError(
                "the selector's resume_after is not a resumption token (expected the string returned by "
                "iterator.resumption_token()); drop resume_after to read from the start"
            ) from None
        if not hmac.compare_digest(tag, self._tag(body)):
            raise InvalidResumptionTokenError(
                "the selector's resume_after token was not issued by this example store (it is forged, "
                "damaged, or comes from another store or device); drop resume_after to read from the start"
            )
        try:
            doc = json.loads(body)
            if doc["v"] != _VERSION:
                raise ValueError(f"version {doc['v']!r}")
            uri, tok_order, pos = doc["c"], doc["o"], doc["p"]
            if pos is not None:
                ts, row = float(pos[0]), pos[1]
                if not math.isfinite(ts) or isinstance(row, bool) or not isinstance(row, int):
                    raise ValueError("bad position")
                pos = (ts, row)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise InvalidResumptionTokenError(f"the resumption token is unreadable ({exc})") from None
        if uri != collection_uri:
            raise InvalidResumptionTokenError(
                f"the resumption token was issued for collection {uri!r}, but the selector reads "
                f"{collection_uri!r}; use a token of the same collection or drop resume_after"
            )
        if tok_order != order:
            raise InvalidResumptionTokenError(
                f"the resumption token was issued for order {tok_order!r}, but the selector asks for "
                f"{order!r}; a token resumes only in the order it was read in"
            )
        return pos
