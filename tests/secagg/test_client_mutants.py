"""The client's checks at their exact edges, found by mutation testing (docs/contributing/mutation.md).

Each test states a property of an honest client: a roster entry that differs from the directory,
a share pair that fails one digest or holds a limb outside the field, a cohort inside one SecAgg+
neighbourhood, a sum of exactly ``min_summed`` inputs, peers' credentials, and every secret
buffer overwritten once the client is done."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg import (
    ForgedGraph,
    Round,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    UnsafeConfiguration,
    crypto,
    parse_message,
)
from secagg.config import MAX_CLIENT_ID
from secagg.crypto import SigningKey
from secagg.messages import KeyRoster, MaskRequest, SharesForYou
from secagg.shamir import LIMBS, P
from secagg.simulate import run_protocol
from tests.secagg.secagg_helpers import Harness, exact_sum, make_inputs, seeded

QUICK = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def complaints(reply: bytes) -> list[int]:
    return parse_message(reply).complaints.tolist()


# -- the roster ------------------------------------------------------------------------------------


@QUICK
@given(field=st.sampled_from(["c_pk", "s_pk", "sig_pk", "key_sig"]), pick=st.integers(0, 1), byte=st.integers(0, 31))
def test_a_roster_entry_that_differs_from_the_directory_is_refused(field, pick, byte):
    """Under SecAgg+ the roster carries only our neighbourhood; the directory (id, entry digest)
    of all advertised entries fixes the session id. A server that swaps one field of a
    neighbour's entry (a key of its own) keeps the ids and the session id, and is refused."""
    cfg = SecAggConfig(4, 2**16, 2, session_label=b"dir", degree=2, allow_unsafe=True)
    h = Harness(cfg, make_inputs(5, 4, 2**16), seed=2)
    h.run_to(Round.SHARE_KEYS)
    mine = parse_message(h.to_clients[1])
    entries = mine.entries.copy()
    row = [i for i, u in enumerate(entries["id"].tolist()) if u != 1][pick]  # a neighbour's entry
    value = bytearray(entries[field][row].tobytes())
    value[byte] ^= 0x01
    entries[field][row] = np.void(bytes(value))
    forged = KeyRoster(mine.session_tag, mine.session_id, entries, mine.seed, mine.credentials, mine.directory)
    assert h.clients[1].handle(forged.to_bytes()) is None
    assert isinstance(h.clients[1].error, ForgedGraph), h.clients[1].error
    assert h.clients[2].handle(h.to_clients[2]) is not None  # the roster as sent passes


@pytest.mark.parametrize(
    ("degree", "threshold", "refused"),
    [(6, 4, False), (4, 3, True)],
    ids=["neighbourhood-larger-than-cohort", "neighbourhood-equal-to-cohort-unsafe-t"],
)
def test_a_secagg_plus_cohort_within_one_neighbourhood_is_a_complete_graph(degree, threshold, refused):
    """With n <= k + 1 every client is everyone's neighbour: the roster is all of U1 and the
    complete graph's floor t > 2n/3 applies (a server may not escape it by naming a degree)."""
    n, modulus = 5, 2**16
    cfg = SecAggConfig(3, modulus, threshold, session_label=b"small", degree=degree)
    inputs = make_inputs(n, 3, modulus, seed=degree)
    # the server's own configuration waives the floor (not part of the session tag); the clients' does not
    server = SecAggServer(
        SecAggConfig(3, modulus, threshold, b"small", degree, allow_unsafe=True), inputs, random_bytes=seeded(0)
    )
    clients = {u: SecAggClient(u, cfg, x, random_bytes=seeded(u)) for u, x in inputs.items()}
    for u, c in clients.items():
        server.receive(u, c.start())
    to_clients = server.close_round()
    while not server.round.terminal:
        for u, data in to_clients.items():
            reply = clients[u].handle(data)
            if reply is not None:
                server.receive(u, reply)
        if refused:
            break
        to_clients = server.close_round()
    if refused:
        assert all(isinstance(c.error, UnsafeConfiguration) for c in clients.values())
    else:
        assert server.round is Round.COMPLETED, server.abort_reason
        assert [int(v) for v in server.result()] == exact_sum(inputs, inputs, modulus)


@pytest.mark.parametrize("dropped", [0, 1])
def test_a_sum_of_exactly_min_summed_inputs_is_released(dropped):
    """min_summed is a floor, not a strict bound: 5 advertised with min_summed = 5 is a cohort,
    and 5 survivors out of 6 make a sum."""
    k = 5
    n = k + dropped
    t = {5: 4, 6: 5}[n]  # above 2n/3, and at most the k survivors
    cfg = SecAggConfig(3, 2**16, t, session_label=b"floor", min_summed=k)
    inputs = make_inputs(n, 3, 2**16, seed=n)
    res = run_protocol(cfg, inputs, drops={Round.MASKED_INPUT_COLLECTION: set(range(k + 1, n + 1))})
    assert res.completed, res.abort_reason
    assert res.server.summed_clients == set(range(1, k + 1))
    assert [int(v) for v in res.result] == exact_sum(inputs, range(1, k + 1), 2**16)


class CertifiedKey:
    """A device key with a credential: the authority's signature over the public key."""

    def __init__(self, authority: SigningKey, random_bytes) -> None:
        self._key = SigningKey(random_bytes)
        self.public_key = self._key.public_key
        self.credential = crypto.sign(authority, b"device/" + self.public_key)

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)


def test_each_peers_credential_reaches_the_verifier_with_its_key():
    """The credential a client's signer carries goes out in its advertisement, travels in the
    roster, and the server's and every peer's verifier are asked about exactly that (key,
    credential) pair; with credentials that certify their keys the instance completes."""
    cfg = SecAggConfig(3, 2**16, 4, session_label=b"cred")
    inputs = make_inputs(5, 3, 2**16, seed=5)
    rb = seeded(5)
    authority = SigningKey(rb)
    signers = {u: CertifiedKey(authority, rb) for u in inputs}
    asked: list[tuple[bytes, bytes]] = []

    def verify(public_key: bytes, credential: bytes) -> bool:
        asked.append((public_key, credential))
        return crypto.verify_signature(authority.public_key, credential, b"device/" + public_key)

    clients = {
        u: SecAggClient(u, cfg, x, random_bytes=rb, signer=signers[u], verify_peer=verify) for u, x in inputs.items()
    }
    server = SecAggServer(cfg, inputs, random_bytes=rb, verify_peer=verify)
    outbox = {u: c.start() for u, c in clients.items()}
    while not server.round.terminal:
        for u, data in outbox.items():
            if data is not None:
                server.receive(u, data)
        outbox = {u: clients[u].handle(data) for u, data in server.close_round().items()}
    assert server.round is Round.COMPLETED, server.abort_reason
    # the server asks once per client, each of the 4 peers once more
    assert sorted(asked) == sorted((s.public_key, s.credential) for s in signers.values() for _ in range(5))
    assert [int(v) for v in server.result()] == exact_sum(inputs, inputs, 2**16)


# -- the share check -----------------------------------------------------------------------------


@QUICK
@given(
    ids=st.sets(st.integers(1, MAX_CLIENT_ID), min_size=4, max_size=4),
    kind=st.sampled_from(["s", "b"]),
    pick=st.integers(0, 2),
)
def test_a_share_pair_that_fails_either_digest_is_reported_by_its_senders_id(ids, kind, pick):
    """The holder checks both halves of a share pair against its sender's digests; one wrong
    half is enough to report the sender (by its id, whatever its size) at ShareCheck."""
    cfg = SecAggConfig(3, 2**16, 3, session_label=b"digest")
    inputs = {u: x for u, x in zip(sorted(ids), make_inputs(4, 3, 2**16).values(), strict=True)}
    h = Harness(cfg, inputs, seed=len(ids))
    h.run_to(Round.SHARE_CHECK)
    me = min(ids)
    msg = parse_message(h.to_clients[me])
    shares = msg.shares.copy()
    sender = int(shares["peer"][pick])
    digest = bytearray(shares[kind][pick].tobytes())
    digest[0] ^= 0x80
    shares[kind][pick] = np.void(bytes(digest))
    replies = h.client_step({**h.to_clients, me: SharesForYou(msg.session_tag, shares).to_bytes()})
    assert complaints(replies[me]) == [sender]
    assert h.clients[me].unopened == {sender}
    assert all(complaints(r) == [] for u, r in replies.items() if u != me)


@QUICK
@given(at=st.integers(0, 2 * LIMBS - 1), value=st.sampled_from([P - 1, P]) | st.integers(P, 2**32 - 1))
def test_a_share_limb_at_or_above_the_field_prime_is_reported(at, value):
    """A sender that deals a limb outside the field (with digests over it and a ciphertext that
    authenticates) is reported; a limb just below the prime is a field element and is kept."""
    cfg = SecAggConfig(3, 2**16, 3, session_label=b"limb")
    h = Harness(cfg, make_inputs(4, 3, 2**16, 6), seed=6)
    h.run_to(Round.SHARE_KEYS)
    dealer, holder = 2, 1
    c_sk = h.clients[dealer]._c.private  # the dealer's own key: it lies with it
    h.client_step()
    limbs = np.arange(2 * LIMBS, dtype=np.uint64) * 1000 + 7  # field elements
    limbs[at] = value
    h.reseal(dealer, c_sk, {holder: limbs})
    h.server_step()
    replies = h.client_step()
    assert complaints(replies[holder]) == ([dealer] if value >= P else [])


# -- zeroization ---------------------------------------------------------------------------------


def _secret_buffers(client: SecAggClient) -> list:
    return [b for b in (client._b, *client._seeds.values(), *client._held.values()) if b is not None]


@pytest.mark.parametrize("exclude", [False, True], ids=["all-senders", "one-sender-left-out"])
@pytest.mark.parametrize(
    "stop",
    [Round.SHARE_CHECK, Round.MASKED_INPUT_COLLECTION, Round.UNMASKING, None],
    ids=lambda r: getattr(r, "value", "completes"),
)
def test_every_secret_buffer_is_overwritten_once_the_client_is_done(stop, exclude):
    """b, the pairwise mask seeds and the held shares are overwritten with zeros (not only
    dropped) when they are used, when a sender is left out of the masking set, and at the
    latest when the client completes or aborts (here on a malformed message at ``stop``)."""
    cfg = SecAggConfig(3, 2**16, 4, session_label=b"wipe")
    h = Harness(cfg, make_inputs(5, 3, 2**16, 8), seed=8)
    client = h.clients[1]
    seen: list = []
    h.server_step()
    while not client.round.terminal:
        seen.extend(_secret_buffers(client))
        if h.server.round is stop:
            assert client.handle(b"\x00" * 24) is None and client.aborted
            break
        if exclude and h.server.round is Round.MASKED_INPUT_COLLECTION:
            h.to_clients[1] = MaskRequest(parse_message(h.to_clients[1]).session_tag, np.array([5], "<u4")).to_bytes()
        h.client_step()
        h.server_step()
    assert seen and not client.holds_secrets
    assert [not any(bytes(b)) for b in seen] == [True] * len(seen)
