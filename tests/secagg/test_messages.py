import numpy as np

from secagg import parse_message
from secagg.messages import (
    ADDRESSED_CT,
    KEY_ENTRY,
    ROUTED_CT,
    SHARE_REVEAL,
    SIGNED,
    AdvertiseKeys,
    ConsistencyRequest,
    ConsistencySignature,
    EncryptedShares,
    KeyRoster,
    MaskedInput,
    MaskRequest,
    ShareCheck,
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
    routed = np.zeros(2, ROUTED_CT)
    routed["peer"] = [4, 5]
    sigs = np.zeros(1, SIGNED)
    sigs["id"] = 9
    rev = np.zeros(2, SHARE_REVEAL)
    rev["peer"] = [1, 2]
    rev["kind"] = [0, 1]
    msgs = [
        AdvertiseKeys(TAG, b"a" * 32, b"b" * 32, b"c" * 32),
        KeyRoster(TAG, b"s" * 32, entries),
        EncryptedShares(TAG, cts),
        SharesForYou(TAG, routed),
        ShareCheck(TAG, np.array([3, 7], "<u4"), b"h" * 64),
        MaskRequest(TAG, np.array([5], "<u4")),
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


def test_the_fields_that_bind_a_message_roundtrip_and_their_lengths_are_checked():
    import pytest

    from secagg import MessageFormatError
    from secagg.messages import DIRECTORY, SHARE_DIGEST

    entries = np.zeros(2, KEY_ENTRY)
    entries["id"] = [1, 2]
    entries["cred_len"] = [3, 0]
    directory = np.zeros(3, DIRECTORY)
    directory["id"] = [1, 2, 3]
    digests = np.zeros(2, SHARE_DIGEST)
    digests["holder"] = [1, 2]
    msgs = [
        AdvertiseKeys(TAG, b"a" * 32, b"b" * 32, b"c" * 32, b"d" * 64, b"certificate"),
        KeyRoster(TAG, b"s" * 32, entries, b"r" * 32, b"abc", directory),
        EncryptedShares(TAG, np.ones(1, ADDRESSED_CT), digests),
        MaskedInput(TAG, b"\x01\x02\x03\x04", b"g" * 64),
        UnmaskResponse(TAG, np.zeros(0, SHARE_REVEAL), b"h" * 64),
    ]
    for m in msgs:
        back = parse_message(m.to_bytes())
        assert back.to_bytes() == m.to_bytes()
    roster = parse_message(msgs[1].to_bytes())
    assert roster.credential_list() == [b"abc", b""] and roster.seed == b"r" * 32
    short = KeyRoster(TAG, b"s" * 32, entries, b"r" * 32, b"ab", directory)  # 2 bytes for 3 declared
    with pytest.raises(MessageFormatError, match="credential"):
        parse_message(short.to_bytes())
    with pytest.raises(MessageFormatError):
        parse_message(AdvertiseKeys(TAG, b"a" * 32, b"b" * 32, b"c" * 32, b"d" * 64, b"x" * 2000).to_bytes())
    with pytest.raises(MessageFormatError):
        parse_message(MaskedInput(TAG, b"", b"").to_bytes())  # no room for a signature
