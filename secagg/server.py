"""The server's state machine, driven round by round by an outside driver.

Driver loop (e.g. an HTTP layer)::

    server = SecAggServer(config, client_ids)
    while not server.round.terminal:
        # deliver what arrives: server.receive(client_id, data) for clients in
        # server.expected_clients; it raises a SecAggError subclass for a message it refuses
        # (malformed, wrong session, wrong round, duplicate, unexpected client, bad signature,
        # unusable key) and ignores it: that client is simply not among the round's survivors.
        # when server.is_round_complete or the round's deadline passes:
        outgoing = server.close_round()  # {client_id: bytes} for the next round
        # send each client its message (clients not in ``outgoing`` are out of the protocol)
    total = server.result()  # uint64 array mod R, or raises ProtocolAborted(reason)

``close_round`` moves to Aborted (``abort_reason``) when fewer than t clients answered the round,
when fewer than t are left to mask after ShareCheck, when fewer than ``min_summed`` masked inputs
arrived, or in Unmasking when some secret lacks t good shares. The server keeps only the running
sum of masked inputs, never an individual one.

Robust reconstruction: at ShareKeys each dealer sends, with its encrypted shares, a digest of
every share it dealt (``transcript.share_digest``). A revealed share that does not match its
digest is dropped (``bad_shares`` records who sent it), so one malicious holder can neither
corrupt the sum nor make it abort while t good shares remain. Every secret is rebuilt from the
first t good shares and, when more arrived, again from the last t: a dealer whose shares do not
lie on one polynomial makes the instance abort rather than give a wrong sum.

Robust dealing: a client that deals share pairs its holders cannot use (ciphertexts that do not
authenticate, values that differ from its own digests) could otherwise make its group abort, as
nobody could unmask it. So every holder opens its pairs at ShareCheck, before anyone masks, and
reports the senders whose pair it cannot use; the server then leaves out of the masking set
(``excluded``) every sender that fewer than t answering holders (itself included) can rebuild,
and the others mask over the rest (``MaskRequest``). A sender left out is like one that dropped
during ShareKeys: nobody masks with it and none of its secrets is ever asked for, so a server that
lies about complaints learns nothing it could not learn by dropping clients, which it always
could. A report reveals only which pairs failed. False reports leave an honest sender out only
when fewer than t honest clients answer, when colluders could stall the group by keeping silent
anyway (an honest sender keeps every honest holder and itself). What still makes a
group abort (exact or abort, never a wrong sum): a dealer whose shares match its digests but lie
on no polynomial (catching it at ShareCheck needs verifiable secret sharing, and this field has no
group of order p for Feldman commitments), and any secret left with fewer than t good shares at
Unmasking.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from . import crypto
from .config import MAX_CLIENT_ID, SecAggConfig
from .errors import (
    BadSignature,
    ConfigError,
    DuplicateMessage,
    InconsistentSurvivors,
    InvalidKeys,
    MessageFormatError,
    OutOfOrder,
    PrematureMessage,
    ProtocolAborted,
    UncertifiedPeer,
    UnexpectedClient,
    WrongSession,
)
from .graphs import seeded_harary
from .identity import PeerVerifier
from .messages import (
    ADDRESSED_CT,
    KEY_ENTRY,
    KIND_B,
    KIND_S,
    ROUTED_CT,
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
    parse_message,
)
from .prg import MaskAccumulator
from .rounds import Round
from .shamir import lagrange_at_zero, limbs_to_secret, reconstruct_limbs
from .transcript import (
    consistency_payload,
    entry_digests,
    graph_key,
    key_signing_payload,
    masked_input_payload,
    roster_session_id,
    seed_commitment,
    share_check_payload,
    share_digest_prefix,
    unmask_payload,
)

_HELD_DIGEST = np.dtype([("dealer", "<i8"), ("s", "V16"), ("b", "V16")])

_EXPECTED_MESSAGE = {
    Round.ADVERTISE_KEYS: AdvertiseKeys,
    Round.SHARE_KEYS: EncryptedShares,
    Round.SHARE_CHECK: ShareCheck,
    Round.MASKED_INPUT_COLLECTION: MaskedInput,
    Round.CONSISTENCY_CHECK: ConsistencySignature,
    Round.UNMASKING: UnmaskResponse,
}

_ROUND_OF = {kind: r for r, kind in _EXPECTED_MESSAGE.items()}


class _Rosters(Mapping[int, bytes]):
    """Each client's KeyRoster under SecAgg+, built when asked for: every one carries the
    directory of all of U1, so holding them all at once would cost n^2 bytes."""

    def __init__(self, build: Callable[[int], bytes], ids: list[int]) -> None:
        self._build, self._ids = build, ids
        self._set = frozenset(ids)

    def __getitem__(self, u: int) -> bytes:
        if u not in self._set:
            raise KeyError(u)
        return self._build(u)

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


class SecAggServer:
    """The server of one SecAgg instance over the cohort ``client_ids``.

    ``graph_seed``: the seed whose commitment is ``config.graph_commitment`` (drawn here when
    None and the configuration commits to nothing); ``verify_peer`` as for the client: an honest
    server refuses uncertified keys at AdvertiseKeys instead of letting every client abort."""

    def __init__(
        self,
        config: SecAggConfig,
        client_ids: Iterable[int],
        *,
        random_bytes: Callable[[int], bytes] = os.urandom,
        graph_seed: bytes | None = None,
        verify_peer: PeerVerifier | None = None,
    ) -> None:
        ids = sorted(set(int(i) for i in client_ids))
        if any(not 1 <= i <= MAX_CLIENT_ID for i in ids):
            raise ConfigError(f"client ids must be in [1, {MAX_CLIENT_ID}]")
        config.check_cohort(len(ids))
        if graph_seed is None:
            if config.graph_commitment:
                raise ConfigError("the configuration commits to a graph seed: pass it as graph_seed")
            graph_seed = random_bytes(32)
        if len(graph_seed) != 32 or (
            config.graph_commitment and seed_commitment(graph_seed) != config.graph_commitment
        ):
            raise ConfigError("graph_seed must be 32 bytes and open the configuration's graph_commitment")
        self.config = config
        self.threshold = config.threshold
        self.cohort: frozenset[int] = frozenset(ids)
        self.round = Round.ADVERTISE_KEYS
        self.abort_reason: str | None = None
        self.graph_seed = graph_seed
        self._tag = config.session_tag
        self._verify_peer = verify_peer
        self._expected: frozenset[int] = self.cohort
        # what this round's handler returned per client (the round's own type), read by its close
        self._responses: dict[int, Any] = {}
        #: survivors of each round: U1 (advertised), U2 (shared keys), U3 (masked input),
        #: U4 (signed, with ConsistencyCheck), U5 (unmasked)
        self.survivors: dict[Round, frozenset[int]] = {}
        #: (holder, dealer) of every revealed share that did not match its dealer's digest
        self.bad_shares: list[tuple[int, int]] = []
        self._keys: dict[int, tuple[bytes, bytes, bytes, bytes, bytes]] = {}
        self._advertised: set[bytes] = set()  # every public key accepted at AdvertiseKeys
        self._neighbours: dict[int, tuple[int, ...]] = {}
        self._digests: dict[int, np.ndarray] = {}
        self.session_id = b""
        self._sum: MaskAccumulator | None = None
        self._result: np.ndarray | None = None
        self._u2: frozenset[int] = frozenset()
        self._u3: frozenset[int] = frozenset()
        #: senders left out of the masking set at ShareCheck: fewer than t holders could use their shares
        self.excluded: frozenset[int] = frozenset()

    # -- driver API -------------------------------------------------------------------------
    @property
    def expected_clients(self) -> frozenset[int]:
        """Clients from which a message is expected in the current round."""
        return frozenset() if self.round.terminal else self._expected

    @property
    def responded(self) -> frozenset[int]:
        return frozenset(self._responses)

    @property
    def is_round_complete(self) -> bool:
        """True when every expected client answered (the driver may close the round early)."""
        return not self.round.terminal and len(self._responses) == len(self._expected)

    def neighbours(self, client_id: int) -> tuple[int, ...]:
        """The client's neighbours in the masking graph (after AdvertiseKeys)."""
        return self._neighbours.get(client_id, ())

    def receive(self, client_id: int, data: bytes) -> None:
        """Accept one client's message for the current round, or raise (state unchanged)."""
        if self.round.terminal:
            raise OutOfOrder(f"protocol is {self.round.value}")
        if client_id not in self._expected:
            raise UnexpectedClient(f"client {client_id} is not expected in {self.round.value}")
        if client_id in self._responses:
            raise DuplicateMessage(f"client {client_id} already answered {self.round.value}")
        msg = parse_message(data)
        if msg.session_tag != self._tag:
            raise WrongSession("message for another session")
        expected = _EXPECTED_MESSAGE[self.round]
        if type(msg) is not expected:
            raise self._misplaced(type(msg).__name__, _ROUND_OF.get(type(msg)))
        handlers: dict[Round, Callable[[int, Any], object]] = {
            Round.ADVERTISE_KEYS: self._receive_keys,
            Round.SHARE_KEYS: self._receive_shares,
            Round.SHARE_CHECK: self._receive_share_check,
            Round.MASKED_INPUT_COLLECTION: self._receive_masked,
            Round.CONSISTENCY_CHECK: self._receive_signature,
            Round.UNMASKING: self._receive_reveals,
        }
        self._responses[client_id] = handlers[self.round](client_id, msg)

    def close_round(self) -> Mapping[int, bytes]:
        """End the current round; returns the next round's message per client (or {})."""
        if self.round.terminal:
            return {}
        responders = frozenset(self._responses)
        self.survivors[self.round] = responders
        if len(responders) < self.threshold:
            return self._abort(
                f"{self.round.value}: only {len(responders)} clients answered, threshold is {self.threshold}"
            )
        closer = {
            Round.ADVERTISE_KEYS: self._close_advertise,
            Round.SHARE_KEYS: self._close_share_keys,
            Round.SHARE_CHECK: self._close_share_check,
            Round.MASKED_INPUT_COLLECTION: self._close_masked,
            Round.CONSISTENCY_CHECK: self._close_consistency,
            Round.UNMASKING: self._close_unmasking,
        }[self.round]
        return closer()

    def result(self) -> np.ndarray:
        """The sum mod R of the inputs of the clients in U3 (uint64)."""
        if self.round is Round.ABORTED:
            raise ProtocolAborted(self.abort_reason or "aborted")
        if self._result is None:
            raise OutOfOrder(f"no result yet: protocol is in {self.round.value}")
        return self._result.copy()

    @property
    def summed_clients(self) -> frozenset[int]:
        """U3: the clients whose inputs are in the sum (for dequantization)."""
        return self.survivors.get(Round.MASKED_INPUT_COLLECTION, frozenset())

    def signing_key(self, client_id: int) -> bytes:
        """The signing key a client advertised (after AdvertiseKeys): who it is to its peers."""
        return self._keys[client_id][2]

    # -- helpers ------------------------------------------------------------------------------
    def _misplaced(self, kind: str, its_round: Round | None) -> OutOfOrder | PrematureMessage:
        """The refusal of a message of another round: ``OutOfOrder`` for one of a round this
        instance has moved past (an answer that came late), ``PrematureMessage`` for anything else
        (a round not reached or not run, a server's message), which no honest client sends."""
        rounds = list(_EXPECTED_MESSAGE)
        runs = its_round is not None and (its_round is not Round.CONSISTENCY_CHECK or self.config.consistency_check)
        if runs and its_round is not None and rounds.index(its_round) < rounds.index(self.round):
            return OutOfOrder(f"got {kind} during {self.round.value}")
        what = f"a message of {its_round.value}" if its_round is not None else "a message only a server sends"
        return PrematureMessage(f"got {kind} ({what}) during {self.round.value}: no client sends one now")

    def _abort(self, reason: str) -> dict[int, bytes]:
        self.round = Round.ABORTED
        self.abort_reason = reason
        self._responses = {}
        self._sum = None
        self._digests = {}
        return {}

    def _advance(self, next_round: Round, expected: Iterable[int]) -> None:
        self.round = next_round
        self._expected = frozenset(expected)
        self._responses = {}

    def _holders(self, u: int) -> tuple[int, ...]:
        return tuple(sorted(self._neighbours[u] + (u,)))

    @property
    def _sparse(self) -> bool:
        return self.config.degree is not None and len(self._keys) > self.config.degree + 1

    # -- AdvertiseKeys ------------------------------------------------------------------------
    def _receive_keys(self, client_id: int, msg: AdvertiseKeys) -> tuple[bytes, bytes, bytes, bytes, bytes]:
        if msg.c_pk == msg.s_pk:
            raise InvalidKeys("the two public keys must differ")
        for what, key in (("encryption", msg.c_pk), ("masking", msg.s_pk)):
            if not crypto.usable_public_key(key):
                raise InvalidKeys(f"the {what} key is not a usable X25519 key (low order)")
        if not crypto.usable_signing_key(msg.sig_pk):
            raise InvalidKeys("the signing key is an Ed25519 point of small order, for which anyone can sign")
        if msg.c_pk in self._advertised or msg.s_pk in self._advertised:
            raise InvalidKeys("public key already advertised by another client")
        payload = key_signing_payload(self._tag, client_id, msg.c_pk, msg.s_pk)
        if not crypto.verify_signature(msg.sig_pk, msg.key_sig, payload):
            raise UncertifiedPeer("the advertised keys are not signed by the advertised signing key")
        if self._verify_peer is not None and not self._verify_peer(msg.sig_pk, msg.credential):
            raise UncertifiedPeer("the signing key is not certified by the trust anchor")
        if msg.sig_pk in self._advertised:
            raise UncertifiedPeer("this signing key (device) already advertised keys in this instance")
        self._advertised.update((msg.c_pk, msg.s_pk, msg.sig_pk))  # accepted: nothing below can refuse
        return (msg.c_pk, msg.s_pk, msg.sig_pk, msg.key_sig, msg.credential)

    def _close_advertise(self) -> Mapping[int, bytes]:
        u1 = sorted(self._responses)
        self._keys = dict(self._responses)
        entries = np.empty(len(u1), dtype=KEY_ENTRY)
        entries["id"] = u1
        for field, idx in (("c_pk", 0), ("s_pk", 1), ("sig_pk", 2)):
            entries[field] = np.frombuffer(b"".join(self._keys[u][idx] for u in u1), dtype="V32")
        entries["key_sig"] = np.frombuffer(b"".join(self._keys[u][3] for u in u1), dtype="V64")
        entries["cred_len"] = [len(self._keys[u][4]) for u in u1]
        credentials = [self._keys[u][4] for u in u1]
        directory = entry_digests(entries, credentials)
        self.session_id = roster_session_id(self._tag, self.graph_seed, directory)
        degree = self.config.degree if self.config.degree is not None else len(u1)
        self._neighbours = seeded_harary(u1, degree, graph_key(self.session_id))
        self._advance(Round.SHARE_KEYS, u1)
        if not self._sparse:
            data = KeyRoster(self._tag, self.session_id, entries, self.graph_seed, b"".join(credentials)).to_bytes()
            return dict.fromkeys(u1, data)
        pos = {u: i for i, u in enumerate(u1)}

        def roster(u: int) -> bytes:
            rows = [pos[v] for v in self._holders(u)]
            creds = b"".join(credentials[r] for r in rows)
            return KeyRoster(self._tag, self.session_id, entries[rows], self.graph_seed, creds, directory).to_bytes()

        return _Rosters(roster, u1)

    # -- ShareKeys ----------------------------------------------------------------------------
    def _receive_shares(self, client_id: int, msg: EncryptedShares) -> tuple[np.ndarray, np.ndarray]:
        peers = msg.shares["peer"]
        if len(peers) != len(self._neighbours[client_id]) or not np.array_equal(
            np.sort(peers), np.asarray(self._neighbours[client_id], dtype=peers.dtype)
        ):
            raise InconsistentSurvivors("encrypted shares must address exactly the client's neighbours")
        digests = np.sort(msg.digests, order="holder")
        if not np.array_equal(digests["holder"], np.asarray(self._holders(client_id), dtype=digests["holder"].dtype)):
            raise InconsistentSurvivors("share digests must cover exactly the client and its neighbours")
        return msg.shares, digests

    def _close_share_keys(self) -> dict[int, bytes]:
        u2 = sorted(self._responses)
        self._digests = self._digests_by_holder(u2)
        blocks = [self._responses[u][0] for u in u2]
        senders = np.repeat(np.asarray(u2, dtype=np.uint32), [len(b) for b in blocks])
        allshares = np.concatenate(blocks) if blocks else np.empty(0, ADDRESSED_CT)
        keep = np.isin(allshares["peer"], np.asarray(u2, dtype=np.uint32))
        allshares, senders = allshares[keep], senders[keep]
        order = np.argsort(allshares["peer"], kind="stable")
        receivers = allshares["peer"][order]
        routed = np.empty(len(order), dtype=ROUTED_CT)
        routed["peer"] = senders[order]
        routed["ct"] = allshares["ct"][order]
        bounds = np.searchsorted(receivers, np.asarray(u2, dtype=np.uint32), side="left")
        ends = np.searchsorted(receivers, np.asarray(u2, dtype=np.uint32), side="right")
        for u, lo, hi in zip(u2, bounds, ends):  # each pair travels with its dealer's digests
            held = self._digests[u]
            rows = np.searchsorted(held["dealer"], routed["peer"][lo:hi].astype(np.int64))
            routed["s"][lo:hi], routed["b"][lo:hi] = held["s"][rows], held["b"][rows]
        out = {u: SharesForYou(self._tag, routed[lo:hi]).to_bytes() for u, lo, hi in zip(u2, bounds, ends)}
        self._u2 = frozenset(u2)
        self._advance(Round.SHARE_CHECK, u2)
        return out

    # -- ShareCheck ---------------------------------------------------------------------------
    def _receive_share_check(self, client_id: int, msg: ShareCheck) -> frozenset[int]:
        complaints = np.asarray(msg.complaints, dtype=np.int64)
        if len(np.unique(complaints)) != len(complaints):
            raise InconsistentSurvivors("duplicate ids in the share check")
        senders = [v for v in self._neighbours[client_id] if v in self._u2]
        if not np.isin(complaints, senders).all():
            raise InconsistentSurvivors("a complaint about a client that sent no share pair to the complainer")
        payload = share_check_payload(self.session_id, client_id, complaints)
        if not crypto.verify_signature(self._keys[client_id][2], msg.signature, payload):
            raise BadSignature(f"the share check of client {client_id} is not signed by it for this session")
        return frozenset(complaints.tolist())

    def _close_share_check(self) -> dict[int, bytes]:
        """Leave out of the masking set every sender that fewer than t answering holders (itself
        included) can rebuild from: its secret could never be unmasked, and with nobody masking
        with it none is needed. It is as if it had dropped before ShareKeys ended, a choice a
        server always had, so this reveals nothing; and an honest sender keeps every honest
        holder and itself, so false complaints leave it out only when fewer than t honest
        clients answer."""
        t = self.threshold
        complaints: dict[int, frozenset[int]] = dict(self._responses)
        answered = set(complaints)
        excluded: set[int] = set()
        while True:  # a left-out holder no longer counts for the others
            holders = answered - excluded
            more = {
                v
                for v in self._u2 - excluded
                if sum(1 for h in self._neighbours[v] if h in holders and v not in complaints[h]) + (v in holders) < t
            }
            if not more:
                break
            excluded |= more
        self.excluded = frozenset(excluded)
        self._u2 = self._u2 - self.excluded
        maskers = sorted(answered - excluded)
        if len(maskers) < t:
            return self._abort(
                f"ShareCheck: only {len(maskers)} clients left to mask after leaving out "
                f"{sorted(excluded)}, threshold is {t}"
            )
        data = MaskRequest(self._tag, np.asarray(sorted(excluded), dtype="<u4")).to_bytes()
        self._sum = MaskAccumulator(self.config.vector_length, self.config.modulus)
        self._advance(Round.MASKED_INPUT_COLLECTION, maskers)
        return dict.fromkeys(maskers, data)

    def _digests_by_holder(self, u2: list[int]) -> dict[int, np.ndarray]:
        """The dealers' share digests regrouped per holder, sorted by dealer."""
        blocks = [self._responses[u][1] for u in u2]
        dealers = np.repeat(np.asarray(u2, dtype=np.int64), [len(b) for b in blocks])
        allrows = np.concatenate(blocks)
        order = np.lexsort((dealers, allrows["holder"]))
        holders, dealers, allrows = allrows["holder"][order], dealers[order], allrows[order]
        out = np.empty(len(order), dtype=_HELD_DIGEST)
        out["dealer"], out["s"], out["b"] = dealers, allrows["s"], allrows["b"]
        starts = np.flatnonzero(np.r_[True, holders[1:] != holders[:-1]])
        ends = np.r_[starts[1:], len(holders)]
        return {int(holders[a]): out[a:b] for a, b in zip(starts, ends)}

    # -- MaskedInputCollection ----------------------------------------------------------------
    def _receive_masked(self, client_id: int, msg: MaskedInput) -> bool:
        acc = self._sum
        if acc is None:
            raise OutOfOrder("no sum is open before MaskedInputCollection")
        if len(msg.words) != self.config.vector_length * acc.dtype.itemsize:
            raise MessageFormatError("masked input has the wrong length")
        y = np.frombuffer(msg.words, dtype=acc.dtype.newbyteorder("<"))
        if (self.config.modulus < (1 << (8 * acc.dtype.itemsize))) and y.max() >= self.config.modulus:
            raise MessageFormatError("masked input entries must be < R")
        payload = masked_input_payload(self.session_id, client_id, msg.words)
        if not crypto.verify_signature(self._keys[client_id][2], msg.signature, payload):
            raise BadSignature(f"the masked input of client {client_id} is not signed by it for this session")
        acc.add_vector(y)  # summed at once; the individual vector is not kept
        return True

    def _close_masked(self) -> Mapping[int, bytes]:
        u3 = np.asarray(sorted(self._responses), dtype="<u4")
        self._u3 = frozenset(u3.tolist())
        if len(u3) < self.config.min_summed:
            return self._abort(
                f"MaskedInputCollection: only {len(u3)} masked inputs, a sum needs at least {self.config.min_summed}"
            )
        if self.config.consistency_check:
            data = ConsistencyRequest(self._tag, u3).to_bytes()
            out = dict.fromkeys(u3.tolist(), data)
            self._advance(Round.CONSISTENCY_CHECK, u3.tolist())
            return out
        out = self._unmask_requests(u3, np.empty(0, SIGNED))
        self._advance(Round.UNMASKING, u3.tolist())
        return out

    def _unmask_requests(self, u3: np.ndarray, sigs: np.ndarray) -> dict[int, bytes]:
        if not self._sparse:
            data = UnmaskRequest(self._tag, u3, sigs).to_bytes()
            return dict.fromkeys(u3.tolist(), data)
        if self.config.consistency_check:  # all of U3 (what was signed), neighbours' signatures
            return {
                u: UnmaskRequest(self._tag, u3, sigs[np.isin(sigs["id"], self._holders(u))]).to_bytes()
                for u in u3.tolist()
            }
        return {
            u: UnmaskRequest(
                self._tag, np.asarray([v for v in self._holders(u) if v in self._u3], "<u4"), sigs
            ).to_bytes()
            for u in u3.tolist()
        }

    # -- ConsistencyCheck ---------------------------------------------------------------------
    def _receive_signature(self, client_id: int, msg: ConsistencySignature) -> bytes:
        payload = consistency_payload(self.session_id, np.asarray(sorted(self._u3), "<u4"))
        if not crypto.verify_signature(self._keys[client_id][2], msg.signature, payload):
            raise BadSignature(f"consistency signature of client {client_id} does not verify")
        return msg.signature

    def _close_consistency(self) -> dict[int, bytes]:
        u4 = sorted(self._responses)
        sigs = np.empty(len(u4), dtype=SIGNED)
        sigs["id"] = u4
        sigs["sig"] = np.frombuffer(b"".join(self._responses[u] for u in u4), dtype="V64")
        out = self._unmask_requests(np.asarray(sorted(self._u3), "<u4"), sigs)
        out = {u: out[u] for u in u4}
        self._advance(Round.UNMASKING, u4)
        return out

    # -- Unmasking ----------------------------------------------------------------------------
    def _receive_reveals(self, client_id: int, msg: UnmaskResponse) -> np.ndarray:
        rev = msg.reveals
        payload = unmask_payload(self.session_id, client_id, rev)
        if not crypto.verify_signature(self._keys[client_id][2], msg.signature, payload):
            raise BadSignature(f"the unmasking response of client {client_id} is not signed by it for this session")
        peers = rev["peer"].astype(np.int64)
        if len(np.unique(peers)) != len(peers):
            raise InconsistentSurvivors("duplicate peers in the unmasking response")
        allowed = [u for u in self._holders(client_id) if u in self._u2]
        if not np.isin(peers, allowed).all():
            raise InconsistentSurvivors("shares of clients the responder does not hold")
        in_u3 = np.isin(peers, np.fromiter(self._u3, dtype=np.int64))
        if np.any(rev["kind"][in_u3] != KIND_B) or np.any(rev["kind"][~in_u3] != KIND_S):
            raise InconsistentSurvivors("wrong share kind: b for U3, s_sk for U2 minus U3")
        dealt = self._digests[client_id]  # (dealer, s, b) of every share this client holds
        rows = dealt[np.minimum(np.searchsorted(dealt["dealer"], peers), len(dealt) - 1)]
        if not np.array_equal(rows["dealer"], peers):
            raise InconsistentSurvivors("shares of clients that dealt none to the responder")
        want = np.where(rev["kind"] == KIND_B, rows["b"].view("S16"), rows["s"].view("S16"))
        limbs = np.ascontiguousarray(rev["limbs"], dtype="<u4")
        sid, me = self.session_id, client_id
        got = [
            hashlib.sha256(share_digest_prefix(sid, u, me, k) + limbs[i].tobytes()).digest()[:16]
            for i, (u, k) in enumerate(zip(peers.tolist(), rev["kind"].tolist()))
        ]
        good = np.asarray(got, dtype="S16") == want if got else np.ones(0, dtype=bool)
        self.bad_shares.extend((client_id, int(u)) for u in peers[~good])
        kept: np.ndarray = rev[good]
        return kept

    def _close_unmasking(self) -> dict[int, bytes]:
        t = self.threshold
        u5 = sorted(self._responses)
        blocks = [self._responses[u] for u in u5]
        holders = np.repeat(np.asarray(u5, dtype=np.int64), [len(b) for b in blocks])
        rev = np.concatenate(blocks)
        self._responses = {}
        self._digests = {}
        order = np.lexsort((holders, rev["peer"], rev["kind"]))  # group by (kind, peer), holders ascending
        rev, holders = rev[order], holders[order]
        key = rev["kind"].astype(np.int64) << 32 | rev["peer"].astype(np.int64)
        starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if len(key) else np.empty(0, np.int64)
        counts = np.diff(np.r_[starts, len(key)])
        group_kind, group_peer = rev["kind"][starts], rev["peer"][starts].astype(np.int64)
        needed = {(KIND_B, u) for u in self._u3} | {
            (KIND_S, u) for u in self._u2 - self._u3 if any(v in self._u3 for v in self._neighbours[u])
        }
        have = {(int(k), int(p)): c for k, p, c in zip(group_kind, group_peer, counts)}
        for kind, u in sorted(needed):
            if have.get((kind, u), 0) < t:
                what = "self-mask b" if kind == KIND_B else "key s_sk"
                return self._abort(
                    f"Unmasking: only {have.get((kind, u), 0)} good shares of the {what} of client {u}, "
                    f"threshold is {t}"
                )
        sel = counts >= t
        starts, counts, group_kind, group_peer = starts[sel], counts[sel], group_kind[sel], group_peer[sel]
        limbs = self._reconstruct(rev, holders, starts[:, None] + np.arange(t)[None, :])
        spare = np.flatnonzero(counts > t)  # rebuild these again from their last t shares
        if len(spare):
            last = (starts + counts)[spare, None] - t + np.arange(t)[None, :]
            again = self._reconstruct(rev, holders, last)
            bad = spare[np.any(again != limbs[spare], axis=1)]
            if len(bad):
                u = int(group_peer[bad[0]])
                return self._abort(f"Unmasking: the shares client {u} dealt do not lie on one polynomial")
        acc = self._sum
        if acc is None:
            return self._abort("Unmasking: no masked inputs were summed")
        try:
            for kind, u, row in zip(group_kind.tolist(), group_peer.tolist(), limbs):
                secret = limbs_to_secret(row)
                if kind == KIND_B:
                    if u in self._u3:
                        acc.add_seed(secret, -1)
                    continue
                if u not in self._u2 or u in self._u3:
                    continue
                s_sk = crypto.load_private(secret)
                if s_sk.public_key().public_bytes_raw() != self._keys[u][1]:
                    return self._abort(f"Unmasking: rebuilt key of client {u} does not match its advertised key")
                for v in self._neighbours[u]:
                    if v in self._u3:
                        seed = crypto.mask_seed(
                            crypto.agree(s_sk, crypto.load_public(self._keys[v][1])), self.session_id, u, v
                        )
                        acc.add_seed(seed, -1 if v < u else 1)  # undo the mask v added for u
        except ValueError as exc:
            return self._abort(f"Unmasking: a reconstructed secret is invalid ({exc})")
        self._result = acc.value()
        self._sum = None
        self.survivors[Round.UNMASKING] = frozenset(u5)
        self.round = Round.COMPLETED
        self._expected = frozenset()
        return {}

    @staticmethod
    def _reconstruct(rev: np.ndarray, holders: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Secrets from the shares at rows ``idx`` (one row of t indices per secret)."""
        if not len(idx):
            return np.empty((0, rev["limbs"].shape[1]), dtype=np.uint64)
        xs = holders[idx]
        shares = rev["limbs"][idx].astype(np.uint64)
        uniq, inverse = np.unique(xs, axis=0, return_inverse=True)  # one Lagrange row per holder set
        lam = lagrange_at_zero(uniq)[inverse.reshape(-1)]
        return reconstruct_limbs(shares, lam)
