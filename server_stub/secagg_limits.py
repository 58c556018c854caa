"""How large a Secure Aggregation message a device can need to send, so that the server refuses a
larger body before reading it (``FLService.secagg_limit``); a fixed 64 MiB had let six strangers'
uploads to a session that did not exist take 400 MB of the server's memory.

A device of a group of n sends, by round (``secagg.messages``): its keys and credential; a share
pair for each of its n - 1 peers with a digest per holder; the senders whose shares it could not
use; its masked input (``vector_length`` words as wide as the modulus needs) and a signature;
a consistency signature; one revealed share per member. Every message carries the same header,
and each list of records its count; no list holds more than one record per member."""

from __future__ import annotations

import numpy as np

from secagg.crypto import KEY_BYTES, SIG_BYTES
from secagg.messages import ADDRESSED_CT, MAX_CREDENTIAL, SHARE_DIGEST, SHARE_REVEAL, ConsistencySignature
from secagg.prg import word_dtype

#: The header every message starts with (magic, version, kind, session tag).
HEADER_BYTES = len(ConsistencySignature(bytes(16), bytes(SIG_BYTES)).to_bytes()) - SIG_BYTES
#: Room on top of the largest message (and all a device outside any group may send: a refusal
#: of anything it sends is then a 409 that says why, not a 413).
SECAGG_SLACK_BYTES = 4096
_COUNT = 4  # a record list's count, u32


def largest_client_message(group_size: int, vector_length: int, modulus: int) -> int:
    """Bytes of the largest message a device of a group of ``group_size`` sends, for inputs of
    ``vector_length`` entries mod ``modulus``."""
    n = max(1, group_size)
    bodies = (
        3 * KEY_BYTES + SIG_BYTES + 2 + MAX_CREDENTIAL,  # AdvertiseKeys
        2 * _COUNT + (n - 1) * ADDRESSED_CT.itemsize + n * SHARE_DIGEST.itemsize,  # EncryptedShares
        _COUNT + n * np.dtype("<u4").itemsize + SIG_BYTES,  # ShareCheck
        vector_length * word_dtype(modulus).itemsize + SIG_BYTES,  # MaskedInput
        SIG_BYTES,  # ConsistencySignature
        _COUNT + n * SHARE_REVEAL.itemsize + SIG_BYTES,  # UnmaskResponse
    )
    return HEADER_BYTES + max(bodies)


def secagg_upload_limit(group_size: int, vector_length: int, modulus: int) -> int:
    """The body limit of a device's Secure Aggregation message: its largest one plus the slack."""
    return largest_client_message(group_size, vector_length, modulus) + SECAGG_SLACK_BYTES
