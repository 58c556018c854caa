"""Every refusal of an honest client, and every rejection by the server, is typed and final."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg import (
    BadSignature,
    DuplicateMessage,
    InconsistentSurvivors,
    InvalidKeys,
    MessageFormatError,
    OutOfOrder,
    PrematureMessage,
    Round,
    SecAggConfig,
    SecAggError,
    TooFewSurvivors,
    UnexpectedClient,
    WrongSession,
    parse_message,
)
from secagg.messages import ConsistencyRequest, KeyRoster, MaskRequest, SharesForYou, UnmaskRequest
from tests.secagg.secagg_helpers import Harness, make_inputs

N, L, R, T = 6, 16, 2**16, 4


def harness(cc: bool = False, label: bytes = b"s1", degree=None, t: int = T, n: int = N) -> Harness:
    cfg = SecAggConfig(L, R, t, session_label=label, consistency_check=cc, degree=degree, allow_unsafe=True)
    return Harness(cfg, make_inputs(n, L, R, 7), seed=3)


def refused(h: Harness, u: int, data: bytes, error: type) -> None:
    client = h.clients[u]
    assert client.handle(data) is None
    assert client.round is Round.ABORTED
    assert isinstance(client.error, error), (client.error, error)
    assert client.abort_reason and client.abort_reason == client.error.reason  # the refusal's own reason
    assert client.handle(h.to_clients.get(u, data)) is None  # stays aborted, answers nothing


def test_roster_refusals():
    h = harness()
    h.run_to(Round.SHARE_KEYS)
    good = parse_message(h.to_clients[1])
    e = good.entries
    cases = [
        (np.concatenate([e, e[-1:]]), InconsistentSurvivors),  # duplicate id
        (e[e["id"] != 1], InconsistentSurvivors),  # omits us
        (e[: T - 1] if 1 in e["id"][: T - 1] else e[: T - 1], TooFewSurvivors),
    ]
    for entries, err in cases:
        h2 = harness()
        h2.run_to(Round.SHARE_KEYS)
        refused(h2, 1, KeyRoster(good.session_tag, good.session_id, entries, good.seed).to_bytes(), err)
    # our own key replaced
    h3 = harness()
    h3.run_to(Round.SHARE_KEYS)
    e2 = e.copy()
    e2["c_pk"][0] = e2["c_pk"][1]
    refused(h3, 1, KeyRoster(good.session_tag, good.session_id, e2, good.seed).to_bytes(), InvalidKeys)
    # another client's key swapped: the session id no longer matches the keys
    h4 = harness()
    h4.run_to(Round.SHARE_KEYS)
    e3 = e.copy()
    e3["s_pk"][2] = bytes(range(32))
    refused(h4, 1, KeyRoster(good.session_tag, good.session_id, e3, good.seed).to_bytes(), WrongSession)
    # a session id for another roster, and another seed than the one the session id binds
    h5 = harness()
    h5.run_to(Round.SHARE_KEYS)
    refused(h5, 1, KeyRoster(good.session_tag, bytes(32), e, good.seed).to_bytes(), WrongSession)
    h6 = harness()
    h6.run_to(Round.SHARE_KEYS)
    refused(h6, 1, KeyRoster(good.session_tag, good.session_id, e, bytes(32)).to_bytes(), WrongSession)


def test_message_for_another_session_is_refused():
    h, other = harness(label=b"a"), harness(label=b"b")
    h.run_to(Round.SHARE_KEYS)
    other.run_to(Round.SHARE_KEYS)
    refused(h, 1, other.to_clients[1], WrongSession)


def _at_share_check() -> tuple[Harness, SharesForYou]:
    h = harness()
    h.run_to(Round.SHARE_CHECK)
    return h, parse_message(h.to_clients[1])


def refused_when_opened(h: Harness, msg: SharesForYou, shares: np.ndarray) -> None:
    """A share pair that does not authenticate is reported at ShareCheck, before anyone masks,
    and never revealed; its sender keeps t holders, so nobody leaves it out of the masking set,
    the instance goes on and the sum stays exact from the other holders' shares."""
    h.client_step({**h.to_clients, 1: SharesForYou(msg.session_tag, shares).to_bytes()})
    bad = {int(u) for u, a, b in zip(msg.shares["peer"], msg.shares["ct"], shares["ct"]) if a.tobytes() != b.tobytes()}
    assert set(parse_message(h.outbox[1]).complaints.tolist()) == bad
    h.server_step()
    assert h.server.round is Round.MASKED_INPUT_COLLECTION and not h.server.excluded
    h.client_step()
    h.server_step()
    assert h.server.round is Round.UNMASKING
    reply = h.clients[1].handle(h.to_clients[1])
    assert h.clients[1].completed and h.clients[1].unopened == bad
    revealed = set(parse_message(reply).reveals["peer"].tolist())
    assert revealed == set(range(1, N + 1)) - bad
    h.outbox = {1: reply, **{u: h.clients[u].handle(d) for u, d in h.to_clients.items() if u != 1}}
    h.server_step()
    assert h.server.round is Round.COMPLETED
    want = sum(x.astype(object) for x in h.inputs.values())
    assert [int(v) for v in h.server.result()] == [int(v) % R for v in want]


def test_a_tampered_ciphertext_is_never_revealed():
    h, msg = _at_share_check()
    shares = msg.shares.copy()
    raw = bytearray(shares["ct"][0].tobytes())
    raw[5] ^= 1
    shares["ct"][0] = bytes(raw)
    refused_when_opened(h, msg, shares)


def test_a_ciphertext_addressed_to_someone_else_is_never_revealed():
    h, msg = _at_share_check()
    for_two = parse_message(h.to_clients[2]).shares
    shares = msg.shares.copy()
    src = for_two[for_two["peer"] == 3][0]  # 3 -> 2, handed to 1 as if 3 -> 1
    shares["ct"][shares["peer"] == 3] = src["ct"]
    refused_when_opened(h, msg, shares)


def test_a_ciphertext_with_a_relabelled_sender_is_never_revealed():
    h, msg = _at_share_check()
    shares = msg.shares.copy()
    a, b = shares["ct"][0].copy(), shares["ct"][1].copy()
    shares["ct"][0], shares["ct"][1] = b, a
    refused_when_opened(h, msg, shares)


@pytest.mark.parametrize(
    "mutate,err",
    [
        (lambda s: np.concatenate([s, s[:1]]), InconsistentSurvivors),  # duplicate sender
        (lambda s: s[: T - 2], TooFewSurvivors),
    ],
)
def test_share_list_refusals(mutate, err):
    h, msg = _at_share_check()
    refused(h, 1, SharesForYou(msg.session_tag, mutate(msg.shares)).to_bytes(), err)


def test_shares_from_outside_the_roster_are_refused():
    h, msg = _at_share_check()
    shares = msg.shares.copy()
    shares["peer"][0] = 999
    refused(h, 1, SharesForYou(msg.session_tag, shares).to_bytes(), InconsistentSurvivors)


def _at_unmasking(cc=False) -> tuple[Harness, UnmaskRequest]:
    h = harness(cc=cc)
    h.run_to(Round.UNMASKING)
    return h, parse_message(h.to_clients[1])


@pytest.mark.parametrize(
    "survivors,err",
    [
        ([1, 2, 3, 4, 5, 6, 77], InconsistentSurvivors),  # not a subset of U2
        ([1, 2, 3], TooFewSurvivors),
        ([2, 3, 4, 5, 6], InconsistentSurvivors),  # omits us
        ([1, 2, 2, 3, 4], InconsistentSurvivors),  # duplicate ids
    ],
)
def test_survivor_list_refusals(survivors, err):
    h, msg = _at_unmasking()
    refused(h, 1, UnmaskRequest(msg.session_tag, np.array(survivors, "<u4"), msg.signatures).to_bytes(), err)


def test_survivor_list_must_be_subset_of_the_shares_we_received():
    h = harness()
    h.run_to(Round.SHARE_CHECK)
    msg = parse_message(h.to_clients[1])
    h.client_step({1: SharesForYou(msg.session_tag, msg.shares[msg.shares["peer"] != 6]).to_bytes()})
    tag = msg.session_tag
    h.client_step({1: MaskRequest(tag).to_bytes()})
    refused(h, 1, UnmaskRequest(tag, np.arange(1, 7, dtype="<u4")).to_bytes(), InconsistentSurvivors)


def test_a_sender_the_server_left_out_for_one_client_only_is_never_revealed_by_it():
    """A server that names a sender as left out to one client but not to the others (to get that
    client's share of it by another route) gains what dropping the sender for that client alone
    would give: the client masks without it, and refuses a survivor list that names it."""
    h = harness()
    h.run_to(Round.MASKED_INPUT_COLLECTION)
    tag = parse_message(h.to_clients[1]).session_tag
    h.client_step({**h.to_clients, 1: MaskRequest(tag, np.array([6], "<u4")).to_bytes()})
    assert 6 not in h.clients[1]._held and 6 not in h.clients[1]._u2
    refused(h, 1, UnmaskRequest(tag, np.arange(1, 7, dtype="<u4")).to_bytes(), InconsistentSurvivors)


def test_consistency_check_refusals():
    h, msg = _at_unmasking(cc=True)
    sigs = msg.signatures
    bad = sigs.copy()
    raw = bytearray(bad["sig"][1].tobytes())
    raw[0] ^= 0xFF
    bad["sig"][1] = bytes(raw)
    refused(h, 1, UnmaskRequest(msg.session_tag, msg.survivors, bad).to_bytes(), BadSignature)
    h, msg = _at_unmasking(cc=True)
    refused(h, 2, UnmaskRequest(msg.session_tag, msg.survivors, msg.signatures[: T - 1]).to_bytes(), TooFewSurvivors)
    h, msg = _at_unmasking(cc=True)
    refused(h, 3, UnmaskRequest(msg.session_tag, msg.survivors[:-1], msg.signatures).to_bytes(), InconsistentSurvivors)


def test_malicious_server_cannot_split_reveals_with_consistency_check():
    """The server tells client 1 that 6 dropped (to get 6's key share) while the others saw 6's
    masked input (b shares): the survivor set signed in ConsistencyCheck exposes it."""
    h = harness(cc=True)
    h.run_to(Round.CONSISTENCY_CHECK)
    msg = parse_message(h.to_clients[1])
    lie = ConsistencyRequest(msg.session_tag, msg.survivors[msg.survivors != 6]).to_bytes()
    out = h.client_step({**h.to_clients, 1: lie})
    with pytest.raises(BadSignature):
        h.server.receive(1, out[1])  # 1 signed a different set: its signature does not verify
    for u in range(2, 7):
        h.server.receive(u, out[u])
    req = h.server.close_round()
    # forward the honest request to client 1, who signed the lie: it refuses
    refused(h, 1, req[2], InconsistentSurvivors)


def test_replayed_and_out_of_order_messages_are_refused():
    h = harness()
    h.run_to(Round.SHARE_KEYS)
    roster = h.to_clients[1]
    h.client_step()
    refused(h, 1, roster, OutOfOrder)  # replay of the previous round's message
    h2 = harness()
    h2.run_to(Round.UNMASKING)
    early = harness()
    early.run_to(Round.SHARE_KEYS)
    early.to_clients = {1: h2.to_clients[1]}
    refused(early, 1, h2.to_clients[1], OutOfOrder)  # a later round's message, too early
    h3 = harness()
    h3.run_to(Round.SHARE_KEYS)
    msg = parse_message(h3.to_clients[1])
    refused(h3, 1, UnmaskRequest(msg.session_tag, np.arange(1, 7, dtype="<u4")).to_bytes(), OutOfOrder)


def test_client_never_reveals_both_shares_of_a_peer():
    h = harness()
    h.run_to(Round.MASKED_INPUT_COLLECTION)
    h.client_step()
    h.server_step(silent={6})  # 6 drops before its masked input: others reveal its s_sk share
    out = h.client_step()
    for data in out.values():
        rev = parse_message(data).reveals
        assert len(set(rev["peer"].tolist())) == len(rev)
        kinds = dict(zip(rev["peer"].tolist(), rev["kind"].tolist()))
        assert kinds[6] == 1 and all(k == 0 for p, k in kinds.items() if p != 6)
    # a second request (e.g. claiming 6 survived after all) finds the client done: no answer
    msg = parse_message(h.to_clients[1])
    again = UnmaskRequest(msg.session_tag, np.arange(1, 7, dtype="<u4")).to_bytes()
    assert h.clients[1].handle(again) is None and h.clients[1].completed


def test_server_rejections_leave_state_unchanged():
    h = harness()
    other = harness(label=b"other")
    with pytest.raises(MessageFormatError):
        h.server.receive(1, b"garbage")
    with pytest.raises(UnexpectedClient):
        h.server.receive(99, h.outbox[1])
    with pytest.raises(WrongSession):
        h.server.receive(1, other.outbox[1])
    h.server.receive(1, h.outbox[1])
    with pytest.raises(DuplicateMessage):
        h.server.receive(1, h.outbox[1])
    with pytest.raises(InvalidKeys):
        h.server.receive(2, h.outbox[1])  # same keys as client 1
    assert h.server.responded == {1}
    for u in range(2, N + 1):
        h.server.receive(u, h.outbox[u])
    assert h.server.is_round_complete
    h.to_clients = h.server.close_round()
    with pytest.raises(OutOfOrder):
        h.server.receive(1, h.outbox[1])  # an AdvertiseKeys during ShareKeys
    h.client_step()
    h.server_step()
    h.client_step()
    h.server_step()
    h.client_step()
    bad = bytearray(h.outbox[1])
    with pytest.raises(MessageFormatError):
        h.server.receive(1, bytes(bad[:-4]))  # masked input of the wrong length
    h.server_step()
    assert h.server.round is Round.UNMASKING
    h.client_step()
    h.server_step()
    assert h.server.round is Round.COMPLETED
    want = sum(x.astype(object) for x in h.inputs.values())
    assert [int(v) for v in h.server.result()] == [int(v) % R for v in want]


@pytest.mark.parametrize("cc", [False, True])
def test_a_message_of_another_round_is_out_of_order_only_when_the_server_moved_past_it(cc):
    """Every message client 1 sends in a run, and every one the server sends it, delivered in every
    round of an identical run: one of a round the server has moved past (an answer that came late)
    is ``OutOfOrder``; one of a round it has not reached or does not run, or a server's message, is
    ``PrematureMessage`` (no honest client sends one); either leaves the server as it was, and the
    run then sums exactly."""
    sent: list[bytes] = []  # client 1's messages, then the server's messages to it
    reference = harness(cc)
    sent.append(reference.outbox[1])
    while not reference.server.round.terminal:
        reference.server_step()
        if 1 in reference.to_clients:
            sent.append(reference.to_clients[1])
        reference.client_step()
        if reference.outbox.get(1) is not None:
            sent.append(reference.outbox[1])
    rounds = [r for r in Round if not r.terminal and (cc or r is not Round.CONSISTENCY_CHECK)]
    kinds = {type(parse_message(data)).__name__ for data in sent}
    assert len(sent) == len(kinds) == len(rounds) + len(rounds) - 1  # one of each, the server's too
    h = harness(cc)
    seen: list[str] = []
    while not h.server.round.terminal:
        now = h.server.round
        for data in sent:
            if data == h.outbox.get(1):
                continue
            kind = type(parse_message(data)).__name__
            with pytest.raises((OutOfOrder, PrematureMessage)) as refused:
                h.server.receive(1, data)
            late = kind in seen
            assert isinstance(refused.value, OutOfOrder if late else PrematureMessage), (now, kind, refused.value)
            assert h.server.round is now and h.server.responded == frozenset()
        seen.append(type(parse_message(h.outbox[1])).__name__)
        h.server_step()
        h.client_step()
    assert h.server.round is Round.COMPLETED
    want = sum(x.astype(object) for x in h.inputs.values())
    assert [int(v) for v in h.server.result()] == [int(v) % R for v in want]


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_is_a_typed_error_never_a_crash(data):
    with pytest.raises(MessageFormatError):
        parse_message(b"XX" + data)
    try:
        parse_message(data)
    except MessageFormatError:
        pass


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_mutated_messages_make_clients_abort_or_are_rejected(data):
    h = harness()
    target = data.draw(st.sampled_from([Round.SHARE_KEYS, Round.MASKED_INPUT_COLLECTION, Round.UNMASKING]))
    h.run_to(target)
    raw = bytearray(h.to_clients[1])
    pos = data.draw(st.integers(0, len(raw) - 1))
    raw[pos] ^= data.draw(st.integers(1, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    reply = h.clients[1].handle(bytes(raw))
    client = h.clients[1]
    if reply is None:
        assert client.aborted and isinstance(client.error, SecAggError)
    else:  # a flip that changed nothing the client relies on (e.g. an unused signing key byte)
        assert not client.aborted
    # the server never crashes on a mutated client message either
    h2 = harness()
    h2.run_to(target)
    h2.client_step()
    raw = bytearray(h2.outbox[1])
    raw[data.draw(st.integers(0, len(raw) - 1))] ^= 0x55
    try:
        h2.server.receive(1, bytes(raw))
    except SecAggError:
        assert 1 not in h2.server.responded
