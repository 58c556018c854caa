"""The server's state machine, driven round by round by an outside driver.

Driver loop (e.g. an HTTP layer)::

    server = SecAggServer(config, client_ids)
    while not server.round.terminal:
        # deliver what arrives: server.receive(client_id, data) for clients in
        # server.expected_clients; it raises a SecAggError subclass for a message it refuses
        # (malformed, wrong session, wrong round, duplicate, unexpected client) and ignores it.
        # when server.is_round_complete or the round's deadline passes:
        outgoing = server.close_round()  # {client_id: bytes} for the next round
        # send each client its message (clients not in ``outgoing`` are out of the protocol)
    total = server.result()  # uint64 array mod R, or raises ProtocolAborted(reason)

``close_round`` moves to Aborted (``abort_reason``) when fewer than t clients answered the round
or, in Unmasking, when some secret cannot be rebuilt from t shares. The server keeps only the
running sum of masked inputs, never an individual one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import numpy as np

from . import crypto
from .client import consistency_payload, roster_session_id
from .config import MAX_CLIENT_ID, SecAggConfig
from .errors import (
    BadSignature,
    DuplicateMessage,
    InconsistentSurvivors,
    InvalidKeys,
    MessageFormatError,
    OutOfOrder,
    ProtocolAborted,
    UnexpectedClient,
    WrongSession,
)
from .graphs import harary_neighbours
from .messages import (
    ADDRESSED_CT,
    KEY_ENTRY,
    KIND_B,
    KIND_S,
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
    parse_message,
)
from .prg import MaskAccumulator
from .rounds import Round
from .shamir import lagrange_at_zero, limbs_to_secret, reconstruct_limbs

_EXPECTED_MESSAGE = {
    Round.ADVERTISE_KEYS: AdvertiseKeys,
    Round.SHARE_KEYS: EncryptedShares,
    Round.MASKED_INPUT_COLLECTION: MaskedInput,
    Round.CONSISTENCY_CHECK: ConsistencySignature,
    Round.UNMASKING: UnmaskResponse,
}


class SecAggServer:
    """The server of one SecAgg instance over the cohort ``client_ids``."""

    def __init__(
        self,
        config: SecAggConfig,
        client_ids: Iterable[int],
        *,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        ids = sorted(set(int(i) for i in client_ids))
        if any(not 1 <= i <= MAX_CLIENT_ID for i in ids):
            raise ValueError(f"client ids must be in [1, {MAX_CLIENT_ID}]")
        self.config = config
        self.threshold = config.threshold
        self.cohort: frozenset[int] = frozenset(ids)
        self.round = Round.ADVERTISE_KEYS
        self.abort_reason: str | None = None
        self._tag = config.session_tag
        self._random_bytes = random_bytes
        self._expected: frozenset[int] = self.cohort
        self._responses: dict[int, object] = {}
        #: survivors of each round: U1 (advertised), U2 (shared keys), U3 (masked input),
        #: U4 (signed, with ConsistencyCheck), U5 (unmasked)
        self.survivors: dict[Round, frozenset[int]] = {}
        self._keys: dict[int, tuple[bytes, bytes, bytes]] = {}
        self._neighbours: dict[int, tuple[int, ...]] = {}
        self.session_id = b""
        self._sum: MaskAccumulator | None = None
        self._result: np.ndarray | None = None
        self._u2: frozenset[int] = frozenset()
        self._u3: frozenset[int] = frozenset()

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
            raise OutOfOrder(f"got {type(msg).__name__} during {self.round.value}")
        handler = {
            Round.ADVERTISE_KEYS: self._receive_keys,
            Round.SHARE_KEYS: self._receive_shares,
            Round.MASKED_INPUT_COLLECTION: self._receive_masked,
            Round.CONSISTENCY_CHECK: self._receive_signature,
            Round.UNMASKING: self._receive_reveals,
        }[self.round]
        self._responses[client_id] = handler(client_id, msg)

    def close_round(self) -> dict[int, bytes]:
        """End the current round; returns the next round's message per client (or {})."""
        if self.round.terminal:
            return {}
        responders = frozenset(self._responses)
        self.survivors[self.round] = responders
        if len(responders) < self.threshold:
            return self._abort(f"{self.round.value}: only {len(responders)} clients answered, threshold is {self.threshold}")
        closer = {
            Round.ADVERTISE_KEYS: self._close_advertise,
            Round.SHARE_KEYS: self._close_share_keys,
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

    # -- helpers ------------------------------------------------------------------------------
    def _abort(self, reason: str) -> dict[int, bytes]:
        self.round = Round.ABORTED
        self.abort_reason = reason
        self._responses = {}
        self._sum = None
        return {}

    def _advance(self, next_round: Round, expected: Iterable[int]) -> None:
        self.round = next_round
        self._expected = frozenset(expected)
        self._responses = {}

    def _holders(self, u: int) -> tuple[int, ...]:
        return tuple(sorted(self._neighbours[u] + (u,)))

    # -- AdvertiseKeys ------------------------------------------------------------------------
    def _receive_keys(self, client_id: int, msg: AdvertiseKeys) -> tuple[bytes, bytes, bytes]:
        if msg.c_pk == msg.s_pk:
            raise InvalidKeys("the two public keys must differ")
        if self.config.consistency_check and msg.sig_pk == bytes(32):
            raise InvalidKeys("ConsistencyCheck needs a signing key")
        seen = {k for keys in self._responses.values() for k in keys[:2]}
        if msg.c_pk in seen or msg.s_pk in seen:
            raise InvalidKeys("public key already advertised by another client")
        return (msg.c_pk, msg.s_pk, msg.sig_pk)

    def _close_advertise(self) -> dict[int, bytes]:
        u1 = sorted(self._responses)
        self._keys = dict(self._responses)
        entries = np.empty(len(u1), dtype=KEY_ENTRY)
        entries["id"] = u1
        for field, idx in (("c_pk", 0), ("s_pk", 1), ("sig_pk", 2)):
            entries[field] = np.frombuffer(b"".join(self._keys[u][idx] for u in u1), dtype="V32")
        self.session_id = roster_session_id(self._tag, entries)
        degree = self.config.degree if self.config.degree is not None else len(u1)
        self._neighbours = harary_neighbours(u1, degree, self._random_bytes)
        out: dict[int, bytes] = {}
        if degree >= len(u1) - 1:
            data = KeyRoster(self._tag, self.session_id, entries).to_bytes()
            out = dict.fromkeys(u1, data)
        else:
            pos = {u: i for i, u in enumerate(u1)}
            for u in u1:
                rows = [pos[v] for v in self._holders(u)]
                out[u] = KeyRoster(self._tag, self.session_id, entries[rows]).to_bytes()
        self._advance(Round.SHARE_KEYS, u1)
        return out

    # -- ShareKeys ----------------------------------------------------------------------------
    def _receive_shares(self, client_id: int, msg: EncryptedShares) -> np.ndarray:
        peers = msg.shares["peer"]
        if len(peers) != len(self._neighbours[client_id]) or not np.array_equal(
            np.sort(peers), np.asarray(self._neighbours[client_id], dtype=peers.dtype)
        ):
            raise InconsistentSurvivors("encrypted shares must address exactly the client's neighbours")
        return msg.shares

    def _close_share_keys(self) -> dict[int, bytes]:
        u2 = sorted(self._responses)
        blocks = [self._responses[u] for u in u2]
        senders = np.repeat(np.asarray(u2, dtype=np.uint32), [len(b) for b in blocks])
        allshares = np.concatenate(blocks) if blocks else np.empty(0, ADDRESSED_CT)
        keep = np.isin(allshares["peer"], np.asarray(u2, dtype=np.uint32))
        allshares, senders = allshares[keep], senders[keep]
        order = np.argsort(allshares["peer"], kind="stable")
        receivers = allshares["peer"][order]
        routed = np.empty(len(order), dtype=ADDRESSED_CT)
        routed["peer"] = senders[order]
        routed["ct"] = allshares["ct"][order]
        bounds = np.searchsorted(receivers, np.asarray(u2, dtype=np.uint32), side="left")
        ends = np.searchsorted(receivers, np.asarray(u2, dtype=np.uint32), side="right")
        out = {u: SharesForYou(self._tag, routed[lo:hi]).to_bytes() for u, lo, hi in zip(u2, bounds, ends)}
        self._u2 = frozenset(u2)
        self._sum = MaskAccumulator(self.config.vector_length, self.config.modulus)
        self._advance(Round.MASKED_INPUT_COLLECTION, u2)
        return out

    # -- MaskedInputCollection ----------------------------------------------------------------
    def _receive_masked(self, client_id: int, msg: MaskedInput) -> bool:
        acc = self._sum
        if len(msg.words) != self.config.vector_length * acc.dtype.itemsize:
            raise MessageFormatError("masked input has the wrong length")
        y = np.frombuffer(msg.words, dtype=acc.dtype.newbyteorder("<"))
        if (self.config.modulus < (1 << (8 * acc.dtype.itemsize))) and y.max() >= self.config.modulus:
            raise MessageFormatError("masked input entries must be < R")
        acc.add_vector(y)  # summed at once; the individual vector is not kept
        return True

    def _close_masked(self) -> dict[int, bytes]:
        u3 = np.asarray(sorted(self._responses), dtype="<u4")
        self._u3 = frozenset(u3.tolist())
        if self.config.consistency_check:
            data = ConsistencyRequest(self._tag, u3).to_bytes()
            out = dict.fromkeys(u3.tolist(), data)
            self._advance(Round.CONSISTENCY_CHECK, u3.tolist())
            return out
        out = self._unmask_requests(u3, np.empty(0, SIGNED))
        self._advance(Round.UNMASKING, u3.tolist())
        return out

    def _unmask_requests(self, u3: np.ndarray, sigs: np.ndarray) -> dict[int, bytes]:
        if self.config.degree is None or len(self._neighbours) <= self.config.degree + 1:
            data = UnmaskRequest(self._tag, u3, sigs).to_bytes()
            return dict.fromkeys(u3.tolist(), data)
        return {
            u: UnmaskRequest(self._tag, np.asarray([v for v in self._holders(u) if v in self._u3], "<u4"), sigs).to_bytes()
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
        peers = rev["peer"].astype(np.int64)
        if len(np.unique(peers)) != len(peers):
            raise InconsistentSurvivors("duplicate peers in the unmasking response")
        allowed = [u for u in self._holders(client_id) if u in self._u2]
        if not np.isin(peers, allowed).all():
            raise InconsistentSurvivors("shares of clients the responder does not hold")
        in_u3 = np.isin(peers, np.fromiter(self._u3, dtype=np.int64))
        if np.any(rev["kind"][in_u3] != KIND_B) or np.any(rev["kind"][~in_u3] != KIND_S):
            raise InconsistentSurvivors("wrong share kind: b for U3, s_sk for U2 minus U3")
        return rev

    def _close_unmasking(self) -> dict[int, bytes]:
        t = self.threshold
        u5 = sorted(self._responses)
        blocks = [self._responses[u] for u in u5]
        holders = np.repeat(np.asarray(u5, dtype=np.int64), [len(b) for b in blocks])
        rev = np.concatenate(blocks)
        self._responses = {}
        order = np.lexsort((holders, rev["peer"], rev["kind"]))  # group by (kind, peer), holders ascending
        rev, holders = rev[order], holders[order]
        key = rev["kind"].astype(np.int64) << 32 | rev["peer"].astype(np.int64)
        starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        counts = np.diff(np.r_[starts, len(key)])
        group_kind, group_peer = rev["kind"][starts], rev["peer"][starts].astype(np.int64)
        needed = {(KIND_B, u) for u in self._u3} | {(KIND_S, u) for u in self._u2 - self._u3 if any(
            v in self._u3 for v in self._neighbours[u])}
        have = {(int(k), int(p)): c for k, p, c in zip(group_kind, group_peer, counts)}
        for kind, u in sorted(needed):
            if have.get((kind, u), 0) < t:
                what = "self-mask b" if kind == KIND_B else "key s_sk"
                return self._abort(f"Unmasking: only {have.get((kind, u), 0)} shares of the {what} of client {u}, threshold is {t}")
        sel = counts >= t
        starts, group_kind, group_peer = starts[sel], group_kind[sel], group_peer[sel]
        idx = starts[:, None] + np.arange(t)[None, :]
        xs = holders[idx]
        shares = rev["limbs"][idx].astype(np.uint64)
        uniq, inverse = np.unique(xs, axis=0, return_inverse=True)  # one Lagrange row per holder set
        lam = lagrange_at_zero(uniq)[inverse.reshape(-1)]
        limbs = reconstruct_limbs(shares, lam)
        acc = self._sum
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
                        seed = crypto.mask_seed(crypto.agree(s_sk, crypto.load_public(self._keys[v][1])), self.session_id, u, v)
                        acc.add_seed(seed, -1 if v < u else 1)  # undo the mask v added for u
        except ValueError as exc:
            return self._abort(f"Unmasking: a reconstructed secret is invalid ({exc})")
        self._result = acc.value()
        self._sum = None
        self.survivors[Round.UNMASKING] = frozenset(u5)
        self.round = Round.COMPLETED
        self._expected = frozenset()
        return {}
