"""Malicious clients: one of them can neither crash its group nor silently corrupt the sum.

A malicious client here holds its own keys and signs its own messages (it is a real member of
the instance) but lies where it can: low-order public keys, wrong or random shares when asked to
unmask, a masked input replayed from another session, a masked input altered on the way, shares
that lie on no polynomial. Every outcome is either the exact sum of the inputs the server says
it summed, or an abort with a reason."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg import (
    BadSignature,
    InconsistentSurvivors,
    InvalidKeys,
    Round,
    SecAggClient,
    SecAggConfig,
    SecAggError,
    SecAggServer,
    crypto,
    parse_message,
)
from secagg.crypto import SigningKey
from secagg.messages import (
    KIND_B,
    KIND_S,
    AdvertiseKeys,
    EncryptedShares,
    MaskedInput,
    ShareCheck,
    SharesForYou,
    UnmaskResponse,
)
from secagg.shamir import LIMBS, P
from secagg.transcript import key_signing_payload, share_check_payload, unmask_payload
from tests.secagg.secagg_helpers import Harness, exact_sum, make_inputs, seeded

# X25519 points of small order (RFC 7748 section 6.1; the Curve25519 twist's small subgroup):
# every agreement with them is all-zero, which anyone can compute.
LOW_ORDER = [
    bytes(32),
    (1).to_bytes(32, "little"),
    bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
    bytes.fromhex("5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157"),
    ((1 << 255) - 19 - 1).to_bytes(32, "little"),
]

BEHAVIOURS = [
    "low_order_key",
    "wrong_share",
    "random_share",
    "replayed_masked_input",
    "altered_masked_input",
    "honest_but_silent",
    "garbage_share_ciphertexts",
    "false_complaints",
    "reveals_survivor_keys",  # the key shares of survivors, which unmask their inputs, for the self-mask ones
    "copies_another_masked_input",  # the masked input another client sent, as its own
]


def low_order_advert(config: SecAggConfig, u: int, signer: SigningKey, c_pk: bytes, s_pk: bytes) -> bytes:
    sig = crypto.sign(signer, key_signing_payload(config.session_tag, u, c_pk, s_pk))
    return AdvertiseKeys(config.session_tag, c_pk, s_pk, signer.public_key, sig).to_bytes()


def _the_others_complete(h: Harness) -> None:
    """Client 5 refused at AdvertiseKeys: the run goes on without it and sums clients 1 to 4 exactly."""
    del h.outbox[5]
    h.run_to(Round.UNMASKING)
    h.client_step()
    h.server_step()
    assert h.server.round is Round.COMPLETED
    assert [int(v) for v in h.server.result()] == exact_sum(h.inputs, [1, 2, 3, 4], 2**16)


@pytest.mark.parametrize("point", LOW_ORDER)
@pytest.mark.parametrize("which", ["c_pk", "s_pk"])
def test_a_low_order_key_is_refused_at_advertise_keys_and_the_rest_complete(point, which):
    cfg = SecAggConfig(3, 2**16, 4, session_label=b"low")
    h = Harness(cfg, make_inputs(5, 3, 2**16, 1), seed=1)
    honest = parse_message(h.outbox[5])
    c_pk, s_pk = (point, honest.s_pk) if which == "c_pk" else (honest.c_pk, point)
    h.outbox[5] = low_order_advert(cfg, 5, h.signers[5], c_pk, s_pk)
    with pytest.raises(InvalidKeys, match="low order"):
        h.server.receive(5, h.outbox[5])
    _the_others_complete(h)
    assert not any(c.aborted for u, c in h.clients.items() if u != 5)


ED25519_P = 2**255 - 19
ORDER_8_Y = 2707385501144840649318225287225658788936804267575313519463743609750303402022
#: every encoding of an Ed25519 point of small order: y in {1, p - 1, 0, the order-8 pair}, either
#: sign bit, and y + p where it fits in 255 bits
SMALL_ORDER = [
    (y | sign << 255).to_bytes(32, "little")
    for y in (1, ED25519_P - 1, 0, ORDER_8_Y, ED25519_P - ORDER_8_Y, ED25519_P, ED25519_P + 1)
    for sign in (0, 1)
]
IDENTITY_SIGNATURE = bytes([1]) + bytes(63)  # R = the identity, S = 0


def test_under_the_identity_as_signing_key_one_signature_verifies_every_message():
    """Why the signing key is checked: verification alone does not refuse a small-order key."""
    identity = SMALL_ORDER[0]
    assert all(crypto.verify_signature(identity, IDENTITY_SIGNATURE, bytes([i]) * i) for i in range(1, 50))
    assert not crypto.usable_signing_key(identity)


def test_a_small_order_signing_key_is_refused_at_advertise_keys_and_the_rest_complete():
    """A client advertising keys under a signing key anyone can sign for (each encoding of each
    small-order point in turn), with the identity's signature, which verifies under the identity
    and under the others one time in two to eight: refused each time, and the others complete."""
    cfg = SecAggConfig(3, 2**16, 4, session_label=b"small")
    h = Harness(cfg, make_inputs(5, 3, 2**16, 1), seed=1)
    honest = parse_message(h.outbox[5])
    for key in SMALL_ORDER:
        assert not crypto.usable_signing_key(key)
        advert = AdvertiseKeys(cfg.session_tag, honest.c_pk, honest.s_pk, key, IDENTITY_SIGNATURE).to_bytes()
        with pytest.raises(InvalidKeys, match="small order"):
            h.server.receive(5, advert)
    assert h.server.responded == frozenset()
    _the_others_complete(h)


@settings(max_examples=50, deadline=None)
@given(seed=st.binary(min_size=32, max_size=32))
def test_every_signing_key_a_client_makes_is_usable(seed):
    assert crypto.usable_signing_key(SigningKey(lambda n: seed[:n]).public_key)


def test_a_client_handed_a_low_order_key_aborts_with_a_typed_reason():
    """A server that forwards a signed low-order key (it should have refused it) gets a typed
    abort from the honest clients, never a bare ValueError."""
    cfg = SecAggConfig(3, 2**16, 3, session_label=b"fwd")
    inputs = make_inputs(3, 3, 2**16, 2)
    rb = seeded(2)
    signers = {u: SigningKey(rb) for u in inputs}
    clients = {u: SecAggClient(u, cfg, x, random_bytes=rb, signer=signers[u]) for u, x in inputs.items()}
    adverts = {u: c.start() for u, c in clients.items()}
    adverts[3] = low_order_advert(cfg, 3, signers[3], LOW_ORDER[2], parse_message(adverts[3]).s_pk)

    class Forwarding(SecAggServer):
        def _receive_keys(self, client_id, msg):
            return (msg.c_pk, msg.s_pk, msg.sig_pk, msg.key_sig, msg.credential)

    server = Forwarding(cfg, inputs, random_bytes=rb)
    for u, data in adverts.items():
        server.receive(u, data)
    rosters = server.close_round()
    for u in (1, 2):
        assert clients[u].handle(rosters[u]) is None
        assert isinstance(clients[u].error, InvalidKeys) and "low-order" in clients[u].abort_reason
        assert not clients[u].holds_secrets


def test_a_wrong_share_is_dropped_and_the_sum_stays_exact():
    cfg = SecAggConfig(3, 2**16, 4, session_label=b"bad")
    h = Harness(cfg, make_inputs(5, 3, 2**16, 3), seed=3)
    h.run_to(Round.UNMASKING)
    out = h.client_step()
    msg = parse_message(out[2])
    reveals = msg.reveals.copy()
    reveals["limbs"][:, 0] = (reveals["limbs"][:, 0].astype(np.int64) + 1) % P  # well-formed, wrong
    out[2] = UnmaskResponse(msg.session_tag, reveals, h.sign_reveals(2, reveals)).to_bytes()
    h.server_step()
    assert h.server.round is Round.COMPLETED, h.server.abort_reason
    assert [int(v) for v in h.server.result()] == exact_sum(h.inputs, range(1, 6), 2**16)
    assert sorted(h.server.bad_shares) == [(2, u) for u in range(1, 6)]


def test_too_few_good_shares_abort_and_say_so():
    """t = 4 of 5: one holder silent and one lying leave 3 good shares of each secret."""
    cfg = SecAggConfig(3, 2**16, 4, session_label=b"few")
    h = Harness(cfg, make_inputs(5, 3, 2**16, 4), seed=4)
    h.run_to(Round.UNMASKING)
    out = h.client_step()
    msg = parse_message(out[2])
    reveals = msg.reveals.copy()
    reveals["limbs"] = np.random.default_rng(0).integers(0, P - 1, reveals["limbs"].shape)
    out[2] = UnmaskResponse(msg.session_tag, reveals, h.sign_reveals(2, reveals)).to_bytes()
    h.server_step(silent={5})
    assert h.server.round is Round.ABORTED
    assert "only 3 good shares" in h.server.abort_reason


def test_shares_on_no_polynomial_abort_rather_than_give_a_wrong_sum():
    """A dealer whose shares of b disagree: reconstructions from two subsets differ."""
    cfg = SecAggConfig(3, 2**16, 4, session_label=b"poly")
    h = Harness(cfg, make_inputs(5, 3, 2**16, 5), seed=5)
    h.run_to(Round.UNMASKING)
    out = h.client_step()
    # Holder 4 reveals a b share of client 1 that differs from the one dealt, and the server's
    # digest for it is replaced as if client 1 had committed to that share at ShareKeys.
    msg = parse_message(out[4])
    reveals = msg.reveals.copy()
    row = np.flatnonzero(reveals["peer"] == 1)[0]
    reveals["limbs"][row, 3] = (int(reveals["limbs"][row, 3]) + 7) % P
    out[4] = UnmaskResponse(msg.session_tag, reveals, h.sign_reveals(4, reveals)).to_bytes()
    from secagg.transcript import share_digest

    held = h.server._digests[4]
    held["b"][held["dealer"] == 1] = np.void(share_digest(h.server.session_id, 1, 4, 0, reveals["limbs"][row]))
    h.server_step()
    assert h.server.round is Round.ABORTED
    assert "client 1 dealt do not lie on one polynomial" in h.server.abort_reason


def test_a_masked_input_replayed_from_another_session_or_altered_is_refused():
    cfg = SecAggConfig(3, 2**16, 3, session_label=b"replay")
    inputs = make_inputs(3, 3, 2**16, 6)
    first, second = Harness(cfg, inputs, seed=6), Harness(cfg, inputs, seed=7)
    for h in (first, second):
        h.run_to(Round.MASKED_INPUT_COLLECTION)
        h.client_step()
    with pytest.raises(BadSignature):  # same label and parameters, another session id
        second.server.receive(1, first.outbox[1])
    good = parse_message(second.outbox[2])
    words = bytearray(good.words)
    words[0] ^= 1
    with pytest.raises(BadSignature):
        second.server.receive(2, MaskedInput(good.session_tag, bytes(words), good.signature).to_bytes())
    with pytest.raises(BadSignature):  # client 3's valid message claimed as client 2's
        second.server.receive(2, second.outbox[3])
    assert second.server.responded == frozenset()


def test_an_unmask_response_from_another_sender_is_refused():
    cfg = SecAggConfig(3, 2**16, 3, session_label=b"sender")
    h = Harness(cfg, make_inputs(3, 3, 2**16, 8), seed=8)
    h.run_to(Round.UNMASKING)
    h.client_step()
    with pytest.raises(BadSignature):
        h.server.receive(1, h.outbox[2])


def test_a_dealer_of_garbage_shares_is_left_out_before_anyone_masks_and_the_group_completes():
    """Nobody could rebuild the secrets of a client whose share pairs no holder can open: its
    holders report it at ShareCheck, the server leaves it out of the masking set, and the others
    mask, unmask and sum without it. Nothing of it is revealed, and it never masked."""
    cfg = SecAggConfig(3, 2**16, 4, session_label=b"garbage")
    inputs = make_inputs(5, 3, 2**16, 9)
    server, clients = _drive(cfg, inputs, {1: "garbage_share_ciphertexts"}, seed=9)
    assert server.round is Round.COMPLETED, server.abort_reason
    assert server.excluded == {1} and server.summed_clients == frozenset(range(2, 6))
    assert [int(v) for v in server.result()] == exact_sum(inputs, range(2, 6), 2**16)
    for u in range(2, 6):
        assert clients[u].completed and clients[u].unopened == {1} and clients[u].error is None
    assert clients[1].round is Round.SHARE_CHECK and not clients[1].aborted  # left waiting, never asked to mask


def test_a_dealer_that_fools_at_most_n_minus_t_holders_stays_and_the_sum_is_exact():
    """Garbage to one holder (n - t = 1 of them): its other holders and itself still give t
    shares, so it is not left out, and the sum includes it."""
    cfg = SecAggConfig(3, 2**16, 5, session_label=b"one")
    h = Harness(cfg, make_inputs(6, 3, 2**16, 10), seed=10)
    h.run_to(Round.SHARE_CHECK)
    msg = parse_message(h.to_clients[2])
    shares = msg.shares.copy()
    shares["ct"][shares["peer"] == 1] = np.void(bytes(shares.dtype["ct"].itemsize))
    h.to_clients[2] = SharesForYou(msg.session_tag, shares).to_bytes()
    h.client_step()
    assert parse_message(h.outbox[2]).complaints.tolist() == [1]
    h.server_step()
    assert not h.server.excluded
    h.client_step()
    h.server_step()
    h.client_step()
    h.server_step()
    assert h.server.round is Round.COMPLETED, h.server.abort_reason
    assert [int(v) for v in h.server.result()] == exact_sum(h.inputs, range(1, 7), 2**16)


def test_a_share_check_that_is_not_signed_by_its_sender_is_refused():
    cfg = SecAggConfig(3, 2**16, 3, session_label=b"check")
    h = Harness(cfg, make_inputs(4, 3, 2**16, 11), seed=11)
    h.run_to(Round.SHARE_CHECK)
    h.client_step()
    with pytest.raises(BadSignature):
        h.server.receive(1, h.outbox[2])
    msg = parse_message(h.outbox[1])
    with pytest.raises(BadSignature):  # a complaint added on the way
        h.server.receive(1, ShareCheck(msg.session_tag, np.array([2], "<u4"), msg.signature).to_bytes())
    with pytest.raises(InconsistentSurvivors):
        h.server.receive(1, ShareCheck(msg.session_tag, np.array([1], "<u4"), h.sign_check(1, [1])).to_bytes())
    assert h.server.responded == frozenset()


def test_secrets_are_dropped_when_no_longer_needed():
    cfg = SecAggConfig(3, 2**16, 3, session_label=b"zero")
    h = Harness(cfg, make_inputs(3, 3, 2**16, 9), seed=9)
    h.run_to(Round.MASKED_INPUT_COLLECTION)
    client = h.clients[1]
    assert client._c is None and client._s is None  # every agreement was done at ShareKeys
    assert client._b is not None and client._seeds
    h.client_step()
    assert client._b is None and not client._seeds and client._x is None
    h.server_step()
    h.client_step()
    assert client.completed and not client.holds_secrets


def _drive(cfg: SecAggConfig, inputs: dict[int, np.ndarray], bad: dict[int, str], seed: int):
    rb = seeded(seed)
    server = SecAggServer(cfg, inputs, random_bytes=rb)
    signers = {u: SigningKey(rb) for u in inputs}
    clients = {u: SecAggClient(u, cfg, x, random_bytes=rb, signer=signers[u]) for u, x in inputs.items()}
    # a finished instance of the same configuration, whose masked inputs get replayed
    old = Harness(cfg, inputs, seed=seed + 1)
    old.run_to(Round.MASKED_INPUT_COLLECTION)
    old_masked = old.client_step()
    rng = random.Random(seed)
    outbox = {u: c.start() for u, c in clients.items()}
    held: dict[int, dict[int, np.ndarray]] = {}  # the shares a client held, kept by one that reveals them
    for u, how in bad.items():
        if how == "low_order_key":
            adv = parse_message(outbox[u])
            outbox[u] = low_order_advert(cfg, u, signers[u], rng.choice(LOW_ORDER), adv.s_pk)
    while not server.round.terminal:
        rnd = server.round
        for u, data in outbox.items():
            if data is None:
                continue
            how = bad.get(u)
            if rnd is Round.MASKED_INPUT_COLLECTION and how == "replayed_masked_input":
                data = old_masked[u]
            elif rnd is Round.MASKED_INPUT_COLLECTION and how == "altered_masked_input":
                msg = parse_message(data)
                words = bytearray(msg.words)
                words[rng.randrange(len(words))] ^= 1 << rng.randrange(8)
                data = MaskedInput(msg.session_tag, bytes(words), msg.signature).to_bytes()
            elif rnd is Round.UNMASKING and how in ("wrong_share", "random_share"):
                msg = parse_message(data)
                rev = msg.reveals.copy()
                if how == "wrong_share":
                    rev["limbs"][:, rng.randrange(rev["limbs"].shape[1])] ^= 1
                else:
                    rev["limbs"] = np.frombuffer(rng.randbytes(rev["limbs"].size * 4), "<u4").reshape(
                        rev["limbs"].shape
                    ) % (P - 1)
                data = UnmaskResponse(
                    msg.session_tag, rev, crypto.sign(signers[u], unmask_payload(server.session_id, u, rev))
                ).to_bytes()
            elif rnd is Round.UNMASKING and how == "reveals_survivor_keys":
                msg = parse_message(data)
                rev = msg.reveals.copy()
                survivors = rev["kind"] == KIND_B
                rev["limbs"][survivors] = [held[u][int(v)][:LIMBS] for v in rev["peer"][survivors]]
                rev["kind"][survivors] = KIND_S
                data = UnmaskResponse(
                    msg.session_tag, rev, crypto.sign(signers[u], unmask_payload(server.session_id, u, rev))
                ).to_bytes()
            elif rnd is Round.MASKED_INPUT_COLLECTION and how == "copies_another_masked_input":
                others = [v for v in sorted(outbox) if v != u and outbox[v] is not None]
                if others:
                    data = outbox[rng.choice(others)]
            elif rnd is Round.UNMASKING and how == "honest_but_silent":
                continue
            elif rnd is Round.SHARE_CHECK and how == "false_complaints":  # blames every sender
                blamed = np.asarray(sorted(server.survivors[Round.SHARE_KEYS] - {u}), "<u4")
                sig = crypto.sign(signers[u], share_check_payload(server.session_id, u, blamed))
                data = ShareCheck(parse_message(data).session_tag, blamed, sig).to_bytes()
            elif rnd is Round.SHARE_KEYS and how == "garbage_share_ciphertexts":
                msg = parse_message(data)
                shares = msg.shares.copy()
                shares["ct"] = [np.void(rng.randbytes(shares.dtype["ct"].itemsize)) for _ in range(len(shares))]
                data = EncryptedShares(msg.session_tag, shares, msg.digests).to_bytes()
            try:
                server.receive(u, data)
            except SecAggError:
                pass  # refused: that client is out of the round, nobody crashes
        incoming = server.close_round()
        outbox = {u: clients[u].handle(data) for u, data in incoming.items()}
        for u, how in bad.items():
            if how == "reveals_survivor_keys" and clients[u]._held:
                held[u] = {v: limbs.copy() for v, limbs in clients[u]._held.items()}
    return server, clients


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_with_malicious_clients_the_sum_is_exact_or_the_instance_aborts(data):
    n = data.draw(st.integers(4, 9), label="n")
    t = data.draw(st.integers((2 * n) // 3 + 1, n), label="t")
    cc = data.draw(st.booleans(), label="consistency_check")
    modulus = data.draw(st.sampled_from([2**16, 2**32, 1_000_003]), label="R")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    cfg = SecAggConfig(5, modulus, t, session_label=b"mal", consistency_check=cc)
    inputs = make_inputs(n, 5, modulus, seed)
    bad_ids = data.draw(st.sets(st.sampled_from(sorted(inputs)), max_size=n - 1), label="malicious")
    bad = {u: data.draw(st.sampled_from(BEHAVIOURS), label=f"client {u}") for u in sorted(bad_ids)}
    server, clients = _drive(cfg, inputs, bad, seed)
    honest = [u for u in inputs if u not in bad]
    assert server.round.terminal
    if server.round is Round.COMPLETED:
        summed = server.summed_clients
        assert not summed & {
            u
            for u, how in bad.items()
            if how in ("low_order_key", "replayed_masked_input", "altered_masked_input", "copies_another_masked_input")
        }
        # a response revealing a survivor's key share is refused whole: the server never takes one
        revealers = {u for u, how in bad.items() if how == "reveals_survivor_keys"}
        assert not server.survivors[Round.UNMASKING] & revealers
        assert [int(v) for v in server.result()] == exact_sum(inputs, summed, modulus)
    else:
        assert server.abort_reason
    if len(honest) >= t:
        # only a dealer of garbage is left out; false complaints never push an honest one below t
        assert server.excluded <= {u for u, how in bad.items() if how == "garbage_share_ciphertexts"}
        # the honest clients alone hold t good shares of every secret that is needed
        assert server.round is Round.COMPLETED, (bad, server.abort_reason)
    if server.round is Round.COMPLETED:  # nobody aborted because of another's bad message
        assert all(clients[u].completed for u in honest)
    for c in clients.values():
        assert c.error is None or isinstance(c.error, SecAggError)
