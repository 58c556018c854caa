"""Secure Aggregation at its edges: exactly t signers, SecAgg+ one device past a full graph, the
largest client id, inputs and masked inputs at the modulus, wire constants, and the refusals
that need one field wrong while the rest is right."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg import (
    BadSignature,
    ConfigError,
    InconsistentSurvivors,
    InvalidInput,
    InvalidKeys,
    MessageFormatError,
    OutOfOrder,
    Round,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    UncertifiedPeer,
    crypto,
    parse_message,
    run_protocol,
)
from secagg.client import consistency_payload, roster_session_id
from secagg.config import MAX_CLIENT_ID
from secagg.messages import (
    KEY_ENTRY,
    KIND_B,
    KIND_S,
    AdvertiseKeys,
    EncryptedShares,
    KeyRoster,
    MaskedInput,
    UnmaskResponse,
)
from secagg.transcript import entry_digests, key_signing_payload
from tests.secagg.secagg_helpers import Harness, exact_sum, make_inputs, seeded


@settings(max_examples=20, deadline=None)
@given(n=st.integers(3, 7), data=st.data())
def test_with_consistency_check_exactly_t_signatures_are_enough_and_the_sum_is_exact(n, data):
    t = data.draw(st.integers(2, n), label="t")
    u3_size = data.draw(st.integers(t, n), label="|U3|")
    cfg = SecAggConfig(4, 2**16, t, session_label=b"cc", consistency_check=True, allow_unsafe=True)
    inputs = make_inputs(n, 4, 2**16, seed=n)
    ids = sorted(inputs)
    drops = {Round.MASKED_INPUT_COLLECTION: set(ids[u3_size:]), Round.CONSISTENCY_CHECK: set(ids[t:u3_size])}
    res = run_protocol(cfg, inputs, drops=drops, random_bytes=seeded(n))
    assert res.completed, res.abort_reason
    assert res.server.summed_clients == set(ids[:u3_size])
    assert [int(v) for v in res.result] == exact_sum(inputs, ids[:u3_size], 2**16)
    assert res.server.survivors[Round.CONSISTENCY_CHECK] == frozenset(ids[:t])
    assert res.server.survivors[Round.UNMASKING] == frozenset(ids[:t])
    assert res.server.responded == frozenset() and res.server.expected_clients == frozenset()


@pytest.mark.parametrize("k", [2, 4])
def test_secagg_plus_one_device_past_a_complete_graph_is_exact(k):
    """n = k + 2: the first cohort size where neighbourhoods are not everyone; each client gets
    only its own neighbourhood's roster and survivor list, and the sum is still exact."""
    n = k + 2
    cfg = SecAggConfig(6, 2**20 + 7, 2, session_label=b"plus", degree=k, allow_unsafe=True)
    inputs = make_inputs(n, 6, 2**20 + 7, seed=k)
    drops = {Round.MASKED_INPUT_COLLECTION: {n}}
    res = run_protocol(cfg, inputs, drops=drops, random_bytes=seeded(k))
    assert res.completed, res.abort_reason
    assert [int(v) for v in res.result] == exact_sum(inputs, range(1, n), 2**20 + 7)


def test_a_secagg_plus_client_refuses_a_roster_larger_than_its_neighbourhood():
    k, n = 2, 5
    cfg = SecAggConfig(4, 2**16, 2, session_label=b"plus", degree=k, allow_unsafe=True)
    h = Harness(cfg, make_inputs(n, 4, 2**16), seed=1)
    h.run_to(Round.SHARE_KEYS)
    mine = parse_message(h.to_clients[1])
    assert len(mine.entries) == k + 1 and len(mine.directory) == n
    stranger = next(u for u in range(1, n + 1) if u not in set(mine.entries["id"].tolist()))
    extra = parse_message(h.to_clients[stranger]).entries
    extra = extra[extra["id"] == stranger]
    bigger = KeyRoster(
        mine.session_tag,
        mine.session_id,
        np.concatenate([mine.entries, extra]),
        mine.seed,
        mine.credentials,
        mine.directory,
    )
    assert h.clients[1].handle(bigger.to_bytes()) is None
    assert isinstance(h.clients[1].error, InconsistentSurvivors)
    assert h.clients[2].handle(h.to_clients[2]) is not None  # the honest roster is accepted


def test_client_ids_run_from_one_to_the_largest_shamir_point():
    cfg = SecAggConfig(2, 2**8, 2, session_label=b"ids", allow_unsafe=True)
    inputs = {1: np.array([1, 2], np.uint64), MAX_CLIENT_ID: np.array([3, 4], np.uint64)}
    res = run_protocol(cfg, inputs, random_bytes=seeded(0))
    assert res.completed and [int(v) for v in res.result] == [4, 6]
    for bad in (0, MAX_CLIENT_ID + 1):
        with pytest.raises(ConfigError):
            SecAggClient(bad, cfg)
        with pytest.raises(ConfigError):
            SecAggServer(cfg, [1, bad])


@pytest.mark.parametrize("modulus", [2**16, 1000])
def test_an_input_must_be_integers_in_zero_to_the_modulus(modulus):
    cfg = SecAggConfig(3, modulus, 2, session_label=b"in", allow_unsafe=True)
    client = SecAggClient(1, cfg)
    client.set_input(np.array([0, 1, modulus - 1], np.int64))
    for bad in (np.array([0, 1, modulus], np.int64), np.array([0, -1, 1], np.int64), np.array([0.0, 1.0, 2.0])):
        with pytest.raises(InvalidInput):
            client.set_input(bad)


@pytest.mark.parametrize("excess", [0, 1])
def test_the_server_refuses_a_masked_input_entry_at_or_above_the_modulus(excess):
    modulus = 1000
    cfg = SecAggConfig(3, modulus, 2, session_label=b"mi", allow_unsafe=True)
    h = Harness(cfg, make_inputs(3, 3, modulus), seed=2)
    h.run_to(Round.MASKED_INPUT_COLLECTION)
    h.client_step()
    good = parse_message(h.outbox[1])
    words = (
        np.frombuffer(good.words, np.uint64).copy()
        if len(good.words) == 24
        else np.frombuffer(good.words, np.uint32).copy()
    )
    words[0] = modulus + excess
    with pytest.raises(MessageFormatError):
        h.server.receive(1, MaskedInput(good.session_tag, words.tobytes()).to_bytes())
    words[0] = modulus - 1
    with pytest.raises(BadSignature):  # not what client 1 signed
        h.server.receive(1, MaskedInput(good.session_tag, words.tobytes(), good.signature).to_bytes())
    h.server.receive(1, MaskedInput(good.session_tag, words.tobytes(), h.sign_masked(1, words.tobytes())).to_bytes())


def test_the_server_refuses_keys_that_repeat_another_clients_or_lack_a_signature():
    cfg = SecAggConfig(2, 2**8, 2, session_label=b"keys", consistency_check=True, allow_unsafe=True)
    h = Harness(cfg, make_inputs(3, 2, 2**8), seed=3)
    one, two = parse_message(h.outbox[1]), parse_message(h.outbox[2])
    h.server.receive(1, h.outbox[1])
    tag = cfg.session_tag
    with pytest.raises(InvalidKeys):  # reuses only the encryption key of client 1
        h.server.receive(2, AdvertiseKeys(tag, one.c_pk, two.s_pk, two.sig_pk).to_bytes())
    with pytest.raises(InvalidKeys):  # reuses only the masking key of client 1
        h.server.receive(2, AdvertiseKeys(tag, two.c_pk, one.s_pk, two.sig_pk).to_bytes())
    with pytest.raises(InvalidKeys, match="small order"):  # no signing key: all zero, a point anyone can sign for
        h.server.receive(2, AdvertiseKeys(tag, two.c_pk, two.s_pk, bytes(32), two.key_sig).to_bytes())
    with pytest.raises(UncertifiedPeer):  # a signing key that did not sign them
        h.server.receive(2, AdvertiseKeys(tag, two.c_pk, two.s_pk, one.sig_pk[::-1], two.key_sig).to_bytes())
    with pytest.raises(UncertifiedPeer):  # the keys signed for another id
        h.server.receive(3, AdvertiseKeys(tag, two.c_pk, two.s_pk, two.sig_pk, two.key_sig).to_bytes())
    three = parse_message(h.outbox[3])
    twice = crypto.sign(h.signers[1], key_signing_payload(tag, 3, three.c_pk, three.s_pk))
    with pytest.raises(UncertifiedPeer):  # one signing key (device) twice
        h.server.receive(3, AdvertiseKeys(tag, three.c_pk, three.s_pk, one.sig_pk, twice).to_bytes())
    h.server.receive(2, h.outbox[2])
    assert h.server.responded == {1, 2}


def test_the_server_refuses_shares_that_do_not_address_exactly_the_neighbours():
    cfg = SecAggConfig(2, 2**8, 2, session_label=b"sh", allow_unsafe=True)
    h = Harness(cfg, make_inputs(4, 2, 2**8), seed=4)
    h.run_to(Round.SHARE_KEYS)
    h.client_step()
    shares = parse_message(h.outbox[1]).shares
    stranger = shares.copy()
    stranger["peer"][0] = 99  # as many shares as neighbours, one of them for a non-neighbour
    for wrong in (shares[:-1], np.concatenate([shares, shares[:1]]), stranger):
        with pytest.raises(InconsistentSurvivors):
            h.server.receive(1, EncryptedShares(cfg.session_tag, wrong).to_bytes())
    assert h.server.responded == frozenset()


@pytest.mark.parametrize("flip", ["b_for_a_dropped_peer", "s_for_a_survivor"])
def test_the_server_refuses_a_reveal_of_the_wrong_kind(flip):
    cfg = SecAggConfig(2, 2**8, 3, session_label=b"rv", allow_unsafe=True)
    h = Harness(cfg, make_inputs(5, 2, 2**8), seed=5)
    h.run_to(Round.MASKED_INPUT_COLLECTION)
    h.client_step()
    h.server_step(silent={5})  # 5 shared its keys but sent no masked input
    h.client_step()
    reveals = parse_message(h.outbox[1]).reveals.copy()
    dropped = reveals["peer"] == 5
    assert set(reveals["kind"][dropped]) == {KIND_S} and set(reveals["kind"][~dropped]) == {KIND_B}
    if flip == "b_for_a_dropped_peer":
        reveals["kind"][dropped] = KIND_B
    else:
        reveals["kind"][np.flatnonzero(~dropped)[0]] = KIND_S
    with pytest.raises(InconsistentSurvivors):
        h.server.receive(1, UnmaskResponse(cfg.session_tag, reveals, h.sign_reveals(1, reveals)).to_bytes())


def test_before_the_end_there_is_no_result_and_after_an_abort_nothing_is_pending():
    cfg = SecAggConfig(2, 2**8, 3, session_label=b"end", allow_unsafe=True)
    server = SecAggServer(cfg, [1, 2, 3])
    assert server.session_id == b""
    with pytest.raises(OutOfOrder):
        server.result()
    h = Harness(cfg, make_inputs(3, 2, 2**8), seed=6)
    h.server.receive(1, h.outbox[1])
    h.server.close_round()  # 1 < t: aborted
    assert h.server.round is Round.ABORTED
    assert h.server.responded == frozenset() and h.server.expected_clients == frozenset()


def test_a_client_that_aborts_on_a_malformed_message_says_why():
    client = SecAggClient(1, SecAggConfig(2, 2**8, 2, session_label=b"why", allow_unsafe=True))
    assert client.abort_reason is None and client.error is None
    client.start()
    assert client.handle(b"not a message") is None
    assert isinstance(client.error, MessageFormatError)
    assert client.abort_reason == str(client.error) and client.abort_reason


def test_session_ids_and_consistency_payloads_follow_the_documented_encoding():
    """Fixed by the protocol, not by this implementation: a client on another code base must
    compute the same entry digests, session id (SHA-256 over length-prefixed parts "secagg/sid",
    the session tag, the revealed seed and the directory of (id, entry digest) sorted by id) and
    sign the same ConsistencyCheck payload."""
    entries = np.zeros(3, KEY_ENTRY)
    entries["id"] = [7, 3, 5]
    entries["cred_len"] = [0, 2, 0]
    for i, f in enumerate(("c_pk", "s_pk", "sig_pk")):
        entries[f] = [np.void(bytes([i * 16 + j]) * 32) for j in range(3)]
    creds = [b"", b"ab", b""]
    tag, seed = bytes(range(16)), bytes(range(32, 64))

    def h(*parts):
        return hashlib.sha256(b"".join(struct.pack("<I", len(p)) + p for p in parts)).digest()

    directory = entry_digests(entries, creds)
    assert directory["id"].tolist() == [3, 5, 7]
    assert directory["digest"][0].tobytes() == h(b"secagg/entry", entries[1].tobytes(), b"ab")[:16]
    want = h(b"secagg/sid", tag, seed, directory.tobytes())
    assert roster_session_id(tag, seed, directory) == want
    assert roster_session_id(tag, seed, directory[::-1]) == want  # order-free
    assert roster_session_id(tag, bytes(32), directory) != want
    sid = bytes(32)
    assert consistency_payload(sid, np.array([9, 2, 10])) == b"secagg/consistency" + sid + struct.pack("<3I", 2, 9, 10)
