"""The server's checks at their exact edges, found by mutation testing (docs/contributing/mutation.md).

Each test states a property of an honest server: share pairs addressed to exactly the sender's
neighbours, a sender left out exactly when fewer than t holders can use its pairs, client ids
anywhere in the field in every mode, empty unmasking responses, and no sum released (an abort
with a reason instead) when a dropped client's key lacks t good shares or a dealer's shares
rebuild a key it never advertised or no valid secret."""

from __future__ import annotations

import random

import numpy as np
import pytest

from secagg import (
    InconsistentSurvivors,
    ProtocolAborted,
    Round,
    SecAggConfig,
    parse_message,
)
from secagg.config import MAX_CLIENT_ID
from secagg.messages import KIND_S, SHARE_REVEAL, EncryptedShares, ShareCheck, UnmaskResponse
from secagg.shamir import LIMBS, P, secret_to_limbs, share_limbs
from secagg.simulate import run_protocol
from tests.secagg.secagg_helpers import Harness, exact_sum, make_inputs, seeded

L, R = 3, 2**16


def finish(h: Harness, silent: dict[Round, set[int]] | None = None) -> None:
    """Run the harness to its end; ``silent[r]`` go silent from the server's round r on."""
    silent = silent or {}
    gone: set[int] = set()
    while not h.server.round.terminal:
        h.client_step()
        gone |= silent.get(h.server.round, set())
        h.server_step(silent=gone)


def big_ids(n: int, seed: int) -> dict[int, np.ndarray]:
    """n inputs under ids spread over [1, MAX_CLIENT_ID] (most have more than four digits)."""
    ids = sorted(random.Random(seed).sample(range(1, MAX_CLIENT_ID + 1), n))
    return dict(zip(ids, make_inputs(n, L, R, seed).values(), strict=True))


# -- ShareKeys and ShareCheck --------------------------------------------------------------------


@pytest.mark.parametrize("how", ["ourselves", "twice", "stranger", "one-short"])
def test_encrypted_shares_must_address_exactly_the_senders_neighbours(how):
    """A share list of the right length that names a wrong peer (the sender itself, one peer
    twice, a client outside the cohort), or one a peer short, is refused and changes nothing."""
    cfg = SecAggConfig(L, R, 4, session_label=b"addr")
    h = Harness(cfg, make_inputs(5, L, R, 1), seed=1)
    assert h.server.neighbours(1) == () and h.server.excluded == frozenset()  # nothing known yet
    h.run_to(Round.SHARE_KEYS)
    assert h.server.neighbours(1) == (2, 3, 4, 5)
    assert all(h.server.signing_key(u) == h.signers[u].public_key for u in h.clients)
    h.client_step()
    msg = parse_message(h.outbox[2])
    shares = msg.shares.copy()
    if how == "one-short":
        shares = shares[1:]
    else:
        shares["peer"][0] = {"ourselves": 2, "twice": shares["peer"][1], "stranger": 99}[how]
    with pytest.raises(InconsistentSurvivors):
        h.server.receive(2, EncryptedShares(msg.session_tag, shares, msg.digests).to_bytes())
    h.server.receive(2, h.outbox[2])  # the list as sent is accepted
    assert 2 in h.server.responded


@pytest.mark.parametrize("blamers", range(5))
def test_a_sender_is_left_out_exactly_when_fewer_than_t_holders_can_use_its_pairs(blamers):
    """n = 5, t = 4: a sender every holder can use is kept; with c holders reporting its pair,
    n - c can use it (itself included), and it is left out of the masking set iff n - c < t.
    Every client is told exactly that set (by id, whatever its size), and the sum is exact."""
    inputs = big_ids(5, blamers)
    ids = sorted(inputs)
    cfg = SecAggConfig(L, R, 4, session_label=b"left-out")
    h = Harness(cfg, inputs, seed=blamers)
    h.run_to(Round.SHARE_CHECK)
    sender = ids[blamers]
    h.client_step()
    for u in [v for v in ids if v != sender][:blamers]:  # false reports, signed by their senders
        tag = parse_message(h.outbox[u]).session_tag
        h.outbox[u] = ShareCheck(tag, np.array([sender], "<u4"), h.sign_check(u, [sender])).to_bytes()
    to_clients = h.server_step()
    left_out = [sender] if 5 - blamers < 4 else []
    assert sorted(h.server.excluded) == left_out
    assert {tuple(parse_message(d).excluded.tolist()) for d in to_clients.values()} == {tuple(left_out)}
    finish(h)
    assert h.server.round is Round.COMPLETED, h.server.abort_reason
    assert sorted(h.server.summed_clients) == [u for u in ids if u not in left_out]
    assert [int(v) for v in h.server.result()] == exact_sum(inputs, h.server.summed_clients, R)


@pytest.mark.parametrize(
    ("degree", "threshold", "n", "cc"),
    [(None, 4, 5, False), (None, 4, 5, True), (4, 3, 7, False), (4, 3, 7, True)],
    ids=["complete", "complete-consistency", "secagg-plus", "secagg-plus-consistency"],
)
def test_client_ids_anywhere_in_the_field_give_the_exact_sum_in_every_mode(degree, threshold, n, cc):
    """Ids are Shamir points up to p - 2: survivor lists, consistency payloads and left-out
    lists carry them whole (a 30-bit id is not a four-character string)."""
    cfg = SecAggConfig(L, R, threshold, session_label=b"ids", degree=degree, consistency_check=cc)
    inputs = big_ids(n, n + (degree or 0))
    res = run_protocol(cfg, inputs, drops={Round.MASKED_INPUT_COLLECTION: {max(inputs)}}, random_bytes=seeded(n))
    assert res.completed, res.abort_reason
    assert res.server.summed_clients == set(inputs) - {max(inputs)}
    assert [int(v) for v in res.result] == exact_sum(inputs, res.server.summed_clients, R)


# -- Unmasking ------------------------------------------------------------------------------------


@pytest.mark.parametrize("empty", [1, 5])
def test_an_empty_unmasking_response_is_no_shares(empty):
    """A (signed) response that reveals nothing is accepted and counts as no good share: with t
    others the sum is exact; when every responder sends one, the instance aborts with a reason."""
    cfg = SecAggConfig(L, R, 4, session_label=b"empty")
    h = Harness(cfg, make_inputs(5, L, R, 2), seed=2)
    h.run_to(Round.UNMASKING)
    out = h.client_step()
    nothing = np.empty(0, SHARE_REVEAL)
    for u in list(out)[:empty]:
        out[u] = UnmaskResponse(parse_message(out[u]).session_tag, nothing, h.sign_reveals(u, nothing)).to_bytes()
    h.server_step()
    if empty == 1:
        assert h.server.round is Round.COMPLETED, h.server.abort_reason
        assert [int(v) for v in h.server.result()] == exact_sum(h.inputs, range(1, 6), R)
    else:
        assert h.server.round is Round.ABORTED
        assert "only 0 good shares" in h.server.abort_reason
        with pytest.raises(ProtocolAborted):
            h.server.result()


@pytest.mark.parametrize("liars", [0, 1])
def test_no_sum_is_released_while_a_dropped_clients_key_lacks_t_good_shares(liars):
    """Client 5 drops before its masked input: its s_sk must be rebuilt from t good shares to
    remove the pairwise masks the others added for it. One holder revealing a wrong share of
    it leaves 3 < t = 4: the server aborts instead of returning a sum that is still masked."""
    cfg = SecAggConfig(L, R, 4, session_label=b"key")
    h = Harness(cfg, make_inputs(5, L, R, 3), seed=3)
    h.run_to(Round.MASKED_INPUT_COLLECTION)
    h.client_step()
    h.server_step(silent={5})
    out = h.client_step()
    for u in [1, 2, 3, 4][:liars]:
        msg = parse_message(out[u])
        rev = msg.reveals.copy()
        row = rev["peer"] == 5
        assert rev["kind"][row].tolist() == [KIND_S]
        rev["limbs"][row, 0] ^= 1
        out[u] = UnmaskResponse(msg.session_tag, rev, h.sign_reveals(u, rev)).to_bytes()
    h.server_step(silent={5})
    if liars:
        assert h.server.round is Round.ABORTED
        assert "key s_sk of client 5" in h.server.abort_reason
    else:
        assert h.server.round is Round.COMPLETED, h.server.abort_reason
        assert [int(v) for v in h.server.result()] == exact_sum(h.inputs, range(1, 5), R)


def redeal(h: Harness, dealer: int, c_sk, s_limbs: np.ndarray, b_limbs: np.ndarray) -> None:
    """The dealer sends every holder (itself included) shares of the given limbs instead."""
    holders = parse_message(h.to_clients[dealer]).entries["id"].tolist()
    shares = share_limbs(np.concatenate([s_limbs, b_limbs]), holders, h.config.threshold, seeded(dealer))
    h.reseal(dealer, c_sk, dict(zip(holders, shares, strict=True)))


@pytest.mark.parametrize("lie", ["foreign-key", "no-valid-secret"])
def test_a_dealer_whose_shares_rebuild_a_wrong_secret_makes_the_instance_abort_with_a_reason(lie):
    """Shares that match their digests and lie on one polynomial, but rebuild an s_sk whose
    public key is not the one the dealer advertised (it drops, so its key is rebuilt), or a b
    whose limbs encode no 32-byte secret (it stays, so its b is rebuilt): never a sum, always
    an abort with a reason."""
    cfg = SecAggConfig(L, R, 4, session_label=b"dealer")
    h = Harness(cfg, make_inputs(5, L, R, 4), seed=4)
    h.run_to(Round.SHARE_KEYS)
    dealer = 5
    c_sk = h.clients[dealer]._c.private  # the dealer's own key: it lies with it
    h.client_step()
    zero = secret_to_limbs(bytes(32))
    if lie == "foreign-key":
        redeal(h, dealer, c_sk, secret_to_limbs(random.Random(4).randbytes(32)), zero)
        silent = {Round.MASKED_INPUT_COLLECTION: {dealer}}
    else:
        redeal(h, dealer, c_sk, zero, np.full(LIMBS, P - 1, np.uint64))
        silent = {}
    h.server_step()
    finish(h, silent)
    assert h.server.round is Round.ABORTED
    assert h.server.abort_reason
    with pytest.raises(ProtocolAborted) as err:
        h.server.result()
    assert err.value.reason == h.server.abort_reason
