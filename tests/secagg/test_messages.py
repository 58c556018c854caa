import numpy as np

from secagg import parse_message
from secagg.messages import (
    ADDRESSED_CT,
    KEY_ENTRY,
    SHARE_REVEAL,
    SIGNED,
    AdvertiseKeys,
    ConsistencyRequest,
    ConsistencySignature,
    EncryptedShares,
    KeyRoster,
    MaskedInput,
    SharesForYou,
    UnmaskRequest,
    UnmaskResponse,
)

TAG = bytes(range(16))


def test_every_message_roundtrips():
    entries = np.zeros(3, KEY_ENTRY)
    entries["id"] = [1, 2, 3]
    cts = np.zeros(2, ADDRESSED_CT)
    cts["peer"] = [4, 5]
    sigs = np.zeros(1, SIGNED)
    sigs["id"] = 9
    rev = np.zeros(2, SHARE_REVEAL)
    rev["peer"] = [1, 2]
    rev["kind"] = [0, 1]
    msgs = [
        AdvertiseKeys(TAG, b"a" * 32, b"b" * 32, b"c" * 32),
        KeyRoster(TAG, b"s" * 32, entries),
        EncryptedShares(TAG, cts),
        SharesForYou(TAG, cts),
        MaskedInput(TAG, b"\x01\x02\x03\x04"),
        ConsistencyRequest(TAG, np.array([1, 2], "<u4")),
        ConsistencySignature(TAG, b"g" * 64),
        UnmaskRequest(TAG, np.array([1, 2], "<u4"), sigs),
        UnmaskResponse(TAG, rev),
    ]
    for m in msgs:
        data = m.to_bytes()
        back = parse_message(data)
        assert type(back) is type(m)
        assert back.to_bytes() == data
        assert back.session_tag == TAG
