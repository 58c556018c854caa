"""The protocol's rounds and terminal states, shared by client and server."""

from __future__ import annotations

from enum import Enum


class Round(str, Enum):
    ADVERTISE_KEYS = "AdvertiseKeys"
    SHARE_KEYS = "ShareKeys"
    SHARE_CHECK = "ShareCheck"
    MASKED_INPUT_COLLECTION = "MaskedInputCollection"
    CONSISTENCY_CHECK = "ConsistencyCheck"
    UNMASKING = "Unmasking"
    COMPLETED = "Completed"
    ABORTED = "Aborted"

    @property
    def terminal(self) -> bool:
        return self in (Round.COMPLETED, Round.ABORTED)
