"""An attested cohort and a graph nobody picks: the checks a client makes on its roster.

The peer verifier here is a set of certified signing keys (the library takes any callable; the
device runtime passes one that checks certificates against the attestation trust anchor)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg import (
    ConfigError,
    ForgedGraph,
    Round,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    TooFewSurvivors,
    UncertifiedPeer,
    UnsafeConfiguration,
    assign_groups,
    crypto,
    parse_message,
    seed_commitment,
    seeded_harary,
)
from secagg.crypto import SigningKey
from secagg.messages import KeyRoster
from secagg.transcript import consistency_payload, key_signing_payload
from tests.secagg.secagg_helpers import make_inputs, seeded

L, R = 3, 2**16


class Cohort:
    """Server and clients with signing keys; ``certified`` is what the clients' verifier knows."""

    def __init__(
        self,
        cfg: SecAggConfig,
        n: int,
        seed: int = 0,
        *,
        certified: set[bytes] | None = None,
        server_verifies: bool = False,
        graph_seed: bytes | None = None,
        is_member=None,
    ) -> None:
        rb = seeded(seed)
        self.cfg = cfg
        self.inputs = make_inputs(n, L, R, seed)
        self.signers = {u: SigningKey(rb) for u in self.inputs}
        self.certified = {s.public_key for s in self.signers.values()} if certified is None else certified
        verify = self.verify
        self.server = SecAggServer(
            cfg, self.inputs, random_bytes=rb, graph_seed=graph_seed, verify_peer=verify if server_verifies else None
        )
        self.clients = {
            u: SecAggClient(u, cfg, x, random_bytes=rb, signer=self.signers[u], verify_peer=verify, is_member=is_member)
            for u, x in self.inputs.items()
        }
        self.adverts = {u: c.start() for u, c in self.clients.items()}

    def verify(self, public_key: bytes, credential: bytes) -> bool:
        return public_key in self.certified

    def rosters(self) -> dict[int, bytes]:
        for u, data in self.adverts.items():
            self.server.receive(u, data)
        return dict(self.server.close_round())


def test_a_roster_with_an_uncertified_key_is_refused_by_every_client():
    cfg = SecAggConfig(L, R, 4, session_label=b"sybil")
    cohort = Cohort(cfg, 5)
    cohort.certified.discard(cohort.signers[5].public_key)  # 5 is the server's own client
    rosters = cohort.rosters()
    for u in range(1, 5):
        assert cohort.clients[u].handle(rosters[u]) is None
        assert isinstance(cohort.clients[u].error, UncertifiedPeer)
        assert "client 5 is not certified" in cohort.clients[u].abort_reason


def test_an_honest_server_refuses_an_uncertified_key_at_advertise_keys():
    cfg = SecAggConfig(L, R, 4, session_label=b"sybil2")
    cohort = Cohort(cfg, 5, server_verifies=True)
    cohort.certified.discard(cohort.signers[5].public_key)
    with pytest.raises(UncertifiedPeer):
        cohort.server.receive(5, cohort.adverts[5])


def test_two_entries_of_one_device_are_refused():
    """The server's sybil: a second seat for one certified device (one key, two entries)."""
    cfg = SecAggConfig(L, R, 4, session_label=b"twice")
    cohort = Cohort(cfg, 5)
    twin = parse_message(cohort.adverts[5])
    sig = crypto.sign(cohort.signers[4], key_signing_payload(cfg.session_tag, 5, twin.c_pk, twin.s_pk))

    class Careless(SecAggServer):  # accepts what an honest server refuses
        def _receive_keys(self, client_id, msg):
            return (msg.c_pk, msg.s_pk, msg.sig_pk, msg.key_sig, msg.credential)

    server = Careless(cfg, cohort.inputs, random_bytes=seeded(1))
    for u, data in cohort.adverts.items():
        if u == 5:
            data = type(twin)(cfg.session_tag, twin.c_pk, twin.s_pk, cohort.signers[4].public_key, sig).to_bytes()
        server.receive(u, data)
    rosters = server.close_round()
    assert cohort.clients[1].handle(rosters[1]) is None
    assert isinstance(cohort.clients[1].error, UncertifiedPeer) and "one device twice" in cohort.clients[1].abort_reason


def test_keys_not_signed_by_their_device_are_refused():
    cfg = SecAggConfig(L, R, 4, session_label=b"unsigned")
    cohort = Cohort(cfg, 5)
    rosters = cohort.rosters()
    msg = parse_message(rosters[1])
    entries = msg.entries.copy()
    entries["key_sig"][entries["id"] == 3] = np.void(bytes(64))
    forged = KeyRoster(msg.session_tag, msg.session_id, entries, msg.seed, msg.credentials)
    assert cohort.clients[1].handle(forged.to_bytes()) is None
    assert isinstance(cohort.clients[1].error, UncertifiedPeer) and "client 3" in cohort.clients[1].abort_reason


def test_consistency_check_signatures_use_the_attested_keys():
    cfg = SecAggConfig(L, R, 4, session_label=b"cc", consistency_check=True)
    cohort = Cohort(cfg, 5)
    to_clients = cohort.rosters()
    outbox = {}
    while cohort.server.round is not Round.CONSISTENCY_CHECK:
        outbox = {u: cohort.clients[u].handle(d) for u, d in to_clients.items()}
        for u, d in outbox.items():
            cohort.server.receive(u, d)
        to_clients = cohort.server.close_round()
    replies = {u: cohort.clients[u].handle(d) for u, d in to_clients.items()}
    payload = consistency_payload(cohort.server.session_id, np.arange(1, 6))
    for u, data in replies.items():
        assert crypto.verify_signature(cohort.signers[u].public_key, parse_message(data).signature, payload)
        cohort.server.receive(u, data)
    to_clients = cohort.server.close_round()
    for u, data in to_clients.items():
        cohort.server.receive(u, cohort.clients[u].handle(data))
    cohort.server.close_round()
    assert cohort.server.round is Round.COMPLETED


def test_a_roster_with_someone_from_another_group_is_refused():
    cfg = SecAggConfig(L, R, 4, session_label=b"member")
    outsider = SigningKey(seeded(99)).public_key
    members: set[bytes] = set()  # the group the committed seed assigns, known once the keys are made
    cohort = Cohort(cfg, 5, is_member=lambda key: key in members)
    members |= {s.public_key for u, s in cohort.signers.items() if u != 5} | {outsider}
    rosters = cohort.rosters()
    assert cohort.clients[1].handle(rosters[1]) is None
    assert isinstance(cohort.clients[1].error, ForgedGraph) and "client 5" in cohort.clients[1].abort_reason


def test_a_complete_graph_roster_too_large_for_its_threshold_is_refused():
    """t = 4 is safe for 5 clients, not for 6: a server padding the roster lowers t/n."""
    cfg = SecAggConfig(L, R, 4, session_label=b"pad", allow_unsafe=True)
    cohort = Cohort(cfg, 6)
    rosters = cohort.rosters()
    strict = SecAggClient(1, SecAggConfig(L, R, 4, session_label=b"pad"), cohort.inputs[1], signer=cohort.signers[1])
    strict._c, strict._s, strict._started = cohort.clients[1]._c, cohort.clients[1]._s, True
    assert strict.handle(rosters[1]) is None
    assert isinstance(strict.error, UnsafeConfiguration) and "2n/3" in strict.abort_reason


PLUS = dict(degree=4, threshold=3)


def _plus_cohort(n: int, seed: int = 0, **kw) -> Cohort:
    graph_seed = bytes([seed]) * 32
    floor = {"min_summed": kw.pop("min_summed")} if "min_summed" in kw else {}
    cfg = SecAggConfig(
        L,
        R,
        PLUS["threshold"],
        session_label=b"plus",
        degree=PLUS["degree"],
        graph_commitment=seed_commitment(graph_seed),
        consistency_check=kw.pop("cc", False),
        **floor,
    )
    return Cohort(cfg, n, seed, graph_seed=graph_seed, **kw)


def test_a_forged_secagg_plus_neighbourhood_is_refused():
    cohort = _plus_cohort(12)
    rosters = cohort.rosters()
    mine = parse_message(rosters[1])
    neighbours = set(mine.entries["id"].tolist())
    stranger = next(u for u in range(2, 13) if u not in neighbours)
    other = parse_message(rosters[stranger]).entries
    victim_row = next(i for i, u in enumerate(mine.entries["id"].tolist()) if u != 1)
    entries = mine.entries.copy()
    entries[victim_row] = other[other["id"] == stranger][0]  # a hand-picked neighbour
    forged = KeyRoster(mine.session_tag, mine.session_id, np.sort(entries, order="id"), mine.seed, b"", mine.directory)
    assert cohort.clients[1].handle(forged.to_bytes()) is None
    assert isinstance(cohort.clients[1].error, ForgedGraph)
    assert "neighbourhood the revealed seed" in cohort.clients[1].abort_reason
    assert cohort.clients[2].handle(rosters[2]) is not None  # the true neighbourhood passes


def test_a_seed_that_does_not_open_the_commitment_is_refused():
    with pytest.raises(ConfigError, match="commitment"):
        SecAggServer(
            SecAggConfig(L, R, 3, degree=4, graph_commitment=seed_commitment(bytes(32))),
            range(1, 9),
            graph_seed=bytes([1]) * 32,
        )
    cohort = _plus_cohort(12, seed=3)
    rosters = cohort.rosters()
    mine = parse_message(rosters[1])
    other_seed = KeyRoster(mine.session_tag, mine.session_id, mine.entries, bytes(32), mine.credentials, mine.directory)
    assert cohort.clients[1].handle(other_seed.to_bytes()) is None
    assert isinstance(cohort.clients[1].error, ForgedGraph) and "commitment" in cohort.clients[1].abort_reason


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(8, 14), seed=st.integers(0, 200), short=st.integers(1, 3))
def test_a_secagg_plus_client_refuses_a_signed_survivor_list_shorter_than_min_summed(n, seed, short):
    """Under SecAgg+ with ConsistencyCheck each client is shown all of U3, so it holds the floor
    on a sum's size as over the complete graph: a server that names fewer survivors than
    ``min_summed`` (leaving out clients outside this one's neighbourhood, so that its own
    neighbours still reach t) gets no signature, and so no sum of that size."""
    cohort = _plus_cohort(n, seed=seed, cc=True, min_summed=n)
    to_clients = cohort.rosters()
    for _ in range(3):  # ShareKeys, ShareCheck, MaskedInputCollection: every client takes part
        for u, data in to_clients.items():
            cohort.server.receive(u, cohort.clients[u].handle(data))
        to_clients = cohort.server.close_round()
    assert cohort.server.round is Round.CONSISTENCY_CHECK
    request = parse_message(to_clients[1])
    neighbours = set(cohort.clients[1]._peers)
    strangers = [u for u in request.survivors.tolist() if u not in neighbours][:short]
    survivors = request.survivors[~np.isin(request.survivors, strangers)]
    forged = type(request)(request.session_tag, survivors).to_bytes()
    assert cohort.clients[1].handle(forged) is None
    assert isinstance(cohort.clients[1].error, TooFewSurvivors)
    assert f"minimum of {n} inputs" in cohort.clients[1].abort_reason
    assert cohort.clients[2].handle(to_clients[2]) is not None  # the true list of all n passes


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(7, 16), seed=st.integers(0, 200), drops=st.data())
def test_secagg_plus_with_consistency_check_is_exact_or_aborts(n, seed, drops):
    cohort = _plus_cohort(n, seed=seed, cc=True)
    gone = drops.draw(st.sets(st.integers(1, n), max_size=2), label="drop before masked input")
    to_clients = cohort.rosters()
    while not cohort.server.round.terminal:
        rnd = cohort.server.round
        for u, data in to_clients.items():
            if rnd is Round.MASKED_INPUT_COLLECTION and u in gone:
                continue
            reply = cohort.clients[u].handle(data)
            if reply is not None:
                cohort.server.receive(u, reply)
        to_clients = cohort.server.close_round()
    if cohort.server.round is Round.COMPLETED:
        summed = cohort.server.summed_clients
        assert summed == set(range(1, n + 1)) - gone
        total = sum(cohort.inputs[u].astype(object) for u in summed)
        assert [int(v) for v in cohort.server.result()] == [int(v) % R for v in total]
    else:
        assert cohort.server.abort_reason
    if not gone:
        assert cohort.server.round is Round.COMPLETED


def test_no_sum_of_fewer_than_min_summed_inputs_is_released():
    """Groups of 6 with k = 5: two drop before their masked input, the server aborts instead of
    releasing a sum of 4, and a client shown a survivor list of 4 refuses it."""
    cfg = SecAggConfig(L, R, 4, session_label=b"k", min_summed=5, allow_unsafe=True)
    cohort = Cohort(cfg, 6)
    to_clients = cohort.rosters()
    for rnd in (Round.SHARE_KEYS, Round.SHARE_CHECK, Round.MASKED_INPUT_COLLECTION):
        replies = {u: cohort.clients[u].handle(d) for u, d in to_clients.items()}
        for u, data in replies.items():
            if rnd is Round.MASKED_INPUT_COLLECTION and u in (5, 6):
                continue
            cohort.server.receive(u, data)
        last = to_clients
        to_clients = cohort.server.close_round()
    assert cohort.server.round is Round.ABORTED
    assert "only 4 masked inputs, a sum needs at least 5" in cohort.server.abort_reason
    honest = Cohort(dataclasses.replace(cfg, session_label=b"k2"), 6, seed=1)
    to_clients = honest.rosters()
    for _ in range(3):
        for u, d in to_clients.items():
            honest.server.receive(u, honest.clients[u].handle(d))
        to_clients = honest.server.close_round()
    msg = parse_message(to_clients[1])
    short = type(msg)(msg.session_tag, msg.survivors[:4], msg.signatures).to_bytes()
    assert honest.clients[1].handle(short) is None
    assert "minimum of 5 inputs" in honest.clients[1].abort_reason
    del last


@settings(max_examples=50, deadline=None)
@given(count=st.integers(0, 60), k=st.integers(2, 8), spare=st.integers(0, 2), seed=st.binary(min_size=32, max_size=32))
def test_groups_partition_the_members_and_none_is_smaller_than_k(count, k, spare, seed):
    members = [bytes([i % 256, i // 256]) * 16 for i in range(count)]
    groups = assign_groups(seed, members, k, spare)
    assert sorted(m for g in groups for m in g) == sorted(members) if count >= k else groups == []
    assert all(len(g) >= k for g in groups)
    if count >= 2 * (k + spare):
        assert all(len(g) >= k + spare for g in groups)
    assert assign_groups(seed, list(reversed(members)), k, spare) == groups  # the order sent does not matter


def test_one_member_changed_reshuffles_every_group():
    """Nobody can aim at a group: a sybil's key decides nothing alone, every key moves everyone."""
    members = [bytes([i]) * 32 for i in range(1, 31)]
    seed = bytes(range(32))
    before = assign_groups(seed, members, 5, 1)
    after = assign_groups(seed, members[:-1] + [b"\xff" * 32], 5, 1)
    same = [set(g) & set(members[:-1]) for g in before]
    assert [set(g) & set(members[:-1]) for g in after] != same
    assert sum(max(len(set(a) & b) for b in same) for a in after) < 20  # most members moved groups


@settings(max_examples=30, deadline=None)
@given(n=st.integers(3, 40), half=st.integers(1, 4), key=st.binary(min_size=32, max_size=32))
def test_the_seeded_graph_is_regular_symmetric_and_the_same_for_everyone(n, half, key):
    ids = list(range(5, 5 + n))
    graph = seeded_harary(ids, 2 * half, key)
    for u, nbrs in graph.items():
        assert u not in nbrs and all(u in graph[v] for v in nbrs)
        assert len(nbrs) == min(2 * half, n - 1)
    assert seeded_harary(list(reversed(ids)), 2 * half, key) == graph
