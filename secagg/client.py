"""The client's state machine (one device in one SecAgg instance).

Usage: ``msg = client.start()`` (AdvertiseKeys), then for every message the server sends,
``reply = client.handle(data)``; send ``reply`` if it is not None. ``client.round`` names the
round the client is in; after Unmasking it is Completed. Any refusal (see ``errors``) moves it
to Aborted with ``abort_reason`` and ``error`` set, and it then answers nothing.

Checks an honest client makes before answering (Bonawitz et al. 2017, Fig. 4 / 6): the session
tag and session id; at least t peers in every list; no duplicate ids; every list a subset of
the previous round's and containing ourselves; our own advertised keys echoed unchanged; distinct
keys; every share ciphertext authenticates under the key bound to (sender, us, session); with
ConsistencyCheck, >= t valid signatures over the same survivor set; and it reveals for each peer
either the share of b (peer sent its masked input) or of s_sk (it did not), never both.

Under SecAgg+ a client sees only its neighbours' keys, so it cannot recompute the session id
(a hash of all advertised keys) and takes the server's value; a server that gives neighbours
different ids gains nothing, since every share key and AEAD tag is bound to it and the shares
then fail to decrypt. Nor can it check the graph itself; like Bell et al.'s semi-honest
variant, SecAgg+ here trusts the server to sample the Harary graph honestly.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from . import crypto
from .config import MAX_CLIENT_ID, SecAggConfig
from .errors import (
    BadSignature,
    DecryptionFailed,
    InconsistentSurvivors,
    InvalidKeys,
    MessageFormatError,
    OutOfOrder,
    ProtocolViolation,
    RevealRefused,
    SecAggError,
    TooFewSurvivors,
    WrongSession,
)
from .messages import (
    ADDRESSED_CT,
    KIND_B,
    KIND_S,
    SHARE_REVEAL,
    AdvertiseKeys,
    ConsistencyRequest,
    ConsistencySignature,
    EncryptedShares,
    KeyRoster,
    MaskedInput,
    Message,
    SharesForYou,
    UnmaskRequest,
    UnmaskResponse,
    parse_message,
)
from .prg import MaskAccumulator
from .rounds import Round
from .shamir import LIMBS, P, share_secrets


def roster_session_id(session_tag: bytes, entries: np.ndarray) -> bytes:
    """Session id = H(tag, advertised keys sorted by id): binds every key to the instance."""
    return crypto.sha256(b"secagg/sid", session_tag, np.sort(entries, order="id").tobytes())


def consistency_payload(session_id: bytes, survivors: np.ndarray) -> bytes:
    return b"secagg/consistency" + session_id + np.sort(np.asarray(survivors, dtype="<u4")).tobytes()


def _unique_sorted(ids: np.ndarray, what: str) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64)
    s = np.unique(ids)
    if len(s) != len(ids):
        raise InconsistentSurvivors(f"duplicate client ids in {what}")
    return s


class SecAggClient:
    """One client. ``input_vector``: ``config.vector_length`` integers in [0, R)."""

    def __init__(
        self,
        client_id: int,
        config: SecAggConfig,
        input_vector: np.ndarray | None = None,
        *,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        if not 1 <= client_id <= MAX_CLIENT_ID:
            raise ValueError(f"client_id must be in [1, {MAX_CLIENT_ID}]")
        self.id = client_id
        self.config = config
        self._tag = config.session_tag
        self._x: np.ndarray | None = None
        self._random_bytes = random_bytes
        self.round = Round.ADVERTISE_KEYS
        self.abort_reason: str | None = None
        self.error: SecAggError | None = None
        self._started = False
        self._c = self._s = None
        self._sig: crypto.SigningKey | None = None
        self._session_id = b""
        self._peers: dict[int, tuple[bytes, bytes, bytes]] = {}  # U1 view: id -> (c_pk, s_pk, sig_pk)
        self._u2: np.ndarray = np.empty(0, np.int64)  # senders of our shares, ourselves included
        self._held: dict[int, np.ndarray] = {}  # peer -> its s_sk share limbs + b share limbs
        self._u3: np.ndarray | None = None
        self._revealed: dict[int, int] = {}
        if input_vector is not None:
            self.set_input(input_vector)

    # -- driver API -------------------------------------------------------------------------
    def set_input(self, input_vector: np.ndarray) -> None:
        """Set the vector to sum (integers in [0, R)); allowed until the masked input is sent,
        so key exchange can start while the device still computes its update."""
        if self.round not in (Round.ADVERTISE_KEYS, Round.SHARE_KEYS):
            raise OutOfOrder("the masked input was already sent")
        x = np.asarray(input_vector)
        if x.shape != (self.config.vector_length,):
            raise ValueError(f"input must have shape ({self.config.vector_length},)")
        if x.dtype.kind not in "ui" or (x.size and (x.min() < 0 or int(x.max()) >= self.config.modulus)):
            raise ValueError("input entries must be integers in [0, modulus)")
        self._x = x

    def start(self) -> bytes:
        """AdvertiseKeys: generate the two key pairs and announce the public halves."""
        if self._started:
            raise OutOfOrder("start() called twice")
        self._started = True
        self._c = crypto.KeyPair(self._random_bytes)
        self._s = crypto.KeyPair(self._random_bytes)
        sig_pk = bytes(32)
        if self.config.consistency_check:
            self._sig = crypto.SigningKey(self._random_bytes)
            sig_pk = self._sig.public_bytes
        return AdvertiseKeys(self._tag, self._c.public_bytes, self._s.public_bytes, sig_pk).to_bytes()

    def handle(self, data: bytes) -> bytes | None:
        """Process one server message; returns the reply to send, or None (done or aborted)."""
        if self.round.terminal:
            return None
        try:
            if not self._started:
                raise OutOfOrder("message before start()")
            msg = parse_message(data)
            if msg.session_tag != self._tag:
                raise WrongSession("message for another session")
            return self._dispatch(msg)
        except (ProtocolViolation, MessageFormatError) as exc:
            self._abort(exc)
            return None

    @property
    def completed(self) -> bool:
        return self.round is Round.COMPLETED

    @property
    def aborted(self) -> bool:
        return self.round is Round.ABORTED

    # -- rounds ---------------------------------------------------------------------------------
    def _abort(self, exc: SecAggError) -> None:
        self.round = Round.ABORTED
        self.error = exc
        self.abort_reason = getattr(exc, "reason", None) or str(exc)
        self._held.clear()

    def _dispatch(self, msg: Message) -> bytes | None:
        expected = {
            Round.ADVERTISE_KEYS: KeyRoster,
            Round.SHARE_KEYS: SharesForYou,
            Round.MASKED_INPUT_COLLECTION: ConsistencyRequest if self.config.consistency_check else UnmaskRequest,
            Round.CONSISTENCY_CHECK: UnmaskRequest,
        }[self.round]
        if type(msg) is not expected:
            raise OutOfOrder(f"got {type(msg).__name__} during {self.round.value}, expected {expected.__name__}")
        if isinstance(msg, KeyRoster):
            return self._share_keys(msg)
        if isinstance(msg, SharesForYou):
            return self._masked_input(msg)
        if isinstance(msg, ConsistencyRequest):
            return self._consistency(msg)
        return self._unmask(msg)

    def _share_keys(self, msg: KeyRoster) -> bytes:
        cfg, t = self.config, self.config.threshold
        entries = msg.entries
        ids = _unique_sorted(entries["id"], "the key roster")
        if self.id not in set(ids.tolist()):
            raise InconsistentSurvivors("our own id is missing from the key roster")
        if len(ids) < t:
            raise TooFewSurvivors(f"key roster has {len(ids)} clients < threshold {t}")
        if cfg.degree is not None and len(ids) > cfg.degree + 1:
            raise InconsistentSurvivors(f"roster of {len(ids)} exceeds the neighbourhood size {cfg.degree + 1}")
        c_pks, s_pks = entries["c_pk"].tobytes(), entries["s_pk"].tobytes()
        c_list = [c_pks[i : i + 32] for i in range(0, len(c_pks), 32)]
        s_list = [s_pks[i : i + 32] for i in range(0, len(s_pks), 32)]
        if len(set(c_list) | set(s_list)) != 2 * len(ids):
            raise InvalidKeys("advertised public keys are not all distinct")
        sig_pks = entries["sig_pk"].tobytes()
        peers = {}
        for i, u in enumerate(entries["id"].tolist()):
            peers[u] = (c_list[i], s_list[i], sig_pks[32 * i : 32 * i + 32])
        if peers[self.id][:2] != (self._c.public_bytes, self._s.public_bytes):
            raise InvalidKeys("the roster does not carry our own public keys")
        if cfg.degree is None:
            sid = roster_session_id(self._tag, entries)
            if msg.session_id != sid:
                raise WrongSession("session id does not match the advertised keys")
        self._session_id = msg.session_id
        self._peers = peers
        holders = ids.tolist()
        b = self._random_bytes(32)
        self._b = b
        shares = share_secrets([self._s.private_bytes, b], holders, t, self._random_bytes).astype("<u4")
        out = np.empty(len(holders) - 1, dtype=ADDRESSED_CT)
        cts = []
        c_sk, sid = self._c.private, self._session_id
        j = 0
        for i, v in enumerate(holders):
            if v == self.id:
                self._held[self.id] = shares[i].copy()
                continue
            try:
                shared = crypto.agree(c_sk, crypto.load_public(peers[v][0]))
            except ValueError as exc:
                raise InvalidKeys(f"unusable public key of client {v}") from exc
            key = crypto.share_key(shared, sid, self.id, v)
            cts.append(crypto.encrypt_share(key, shares[i].tobytes(), crypto.share_ad(sid, self.id, v)))
            out["peer"][j] = v
            j += 1
        out["ct"] = np.frombuffer(b"".join(cts), dtype=out.dtype["ct"]) if cts else out["ct"]
        self.round = Round.SHARE_KEYS
        return EncryptedShares(self._tag, out).to_bytes()

    def _masked_input(self, msg: SharesForYou) -> bytes:
        t = self.config.threshold
        if self._x is None:
            raise OutOfOrder("no input vector was set before MaskedInputCollection")
        senders = _unique_sorted(msg.shares["peer"], "the shares list")
        sender_set = set(senders.tolist())
        if self.id in sender_set:
            raise InconsistentSurvivors("a share claims to come from ourselves")
        if not sender_set <= self._peers.keys():
            raise InconsistentSurvivors("shares from clients that were not in the key roster")
        if len(senders) + 1 < t:
            raise TooFewSurvivors(f"{len(senders) + 1} clients shared keys < threshold {t}")
        c_sk, sid = self._c.private, self._session_id
        cts = msg.shares["ct"].tobytes()
        size = msg.shares.dtype["ct"].itemsize
        for i, u in enumerate(msg.shares["peer"].tolist()):
            shared = crypto.agree(c_sk, crypto.load_public(self._peers[u][0]))
            key = crypto.share_key(shared, sid, u, self.id)
            pt = crypto.decrypt_share(key, cts[i * size : (i + 1) * size], crypto.share_ad(sid, u, self.id))
            if pt is None:
                raise DecryptionFailed(f"share pair from client {u} does not decrypt")
            limbs = np.frombuffer(pt, dtype="<u4")
            if limbs.max(initial=0) >= P:
                raise DecryptionFailed(f"share pair from client {u} is out of range")
            self._held[u] = limbs
        self._u2 = np.union1d(senders, [self.id])
        acc = MaskAccumulator(self.config.vector_length, self.config.modulus)
        acc.add_vector(self._x)
        acc.add_seed(self._b)
        s_sk = self._s.private
        for v in senders.tolist():
            shared = crypto.agree(s_sk, crypto.load_public(self._peers[v][1]))
            acc.add_seed(crypto.mask_seed(shared, sid, self.id, v), 1 if self.id < v else -1)
        words = acc.value().astype(acc.dtype.newbyteorder("<")).tobytes()
        del acc
        self._x = None  # no longer needed; do not keep the plain input around
        self.round = Round.MASKED_INPUT_COLLECTION
        return MaskedInput(self._tag, words).to_bytes()

    def _check_u3(self, survivors: np.ndarray) -> np.ndarray:
        t = self.config.threshold
        u3 = _unique_sorted(survivors, "the survivor list")
        if not np.isin(u3, self._u2).all():
            raise InconsistentSurvivors("survivor list is not a subset of the clients that shared keys")
        if self.id not in set(u3.tolist()):
            raise InconsistentSurvivors("survivor list omits us although we sent our masked input")
        if len(u3) < t:
            raise TooFewSurvivors(f"{len(u3)} survivors < threshold {t}")
        return u3

    def _consistency(self, msg: ConsistencyRequest) -> bytes:
        u3 = self._check_u3(msg.survivors)
        self._u3 = u3
        sig = self._sig.sign(consistency_payload(self._session_id, u3))
        self.round = Round.CONSISTENCY_CHECK
        return ConsistencySignature(self._tag, sig).to_bytes()

    def _unmask(self, msg: UnmaskRequest) -> bytes:
        t = self.config.threshold
        if self.config.consistency_check:
            u3 = _unique_sorted(msg.survivors, "the survivor list")
            if self._u3 is None or not np.array_equal(u3, self._u3):
                raise InconsistentSurvivors("survivor list differs from the one we signed")
            signers = _unique_sorted(msg.signatures["id"], "the signature list")
            if not np.isin(signers, u3).all():
                raise InconsistentSurvivors("signatures from clients outside the survivor list")
            if len(signers) < t:
                raise TooFewSurvivors(f"{len(signers)} consistency signatures < threshold {t}")
            payload = consistency_payload(self._session_id, u3)
            sigs = msg.signatures["sig"].tobytes()
            for i, v in enumerate(msg.signatures["id"].tolist()):
                if not crypto.verify_signature(self._peers[v][2], sigs[64 * i : 64 * i + 64], payload):
                    raise BadSignature(f"consistency signature of client {v} does not verify")
        else:
            u3 = self._check_u3(msg.survivors)
        in_u3 = set(u3.tolist())
        peers = self._u2.tolist()
        reveals = np.empty(len(peers), dtype=SHARE_REVEAL)
        for i, u in enumerate(peers):
            kind = KIND_B if u in in_u3 else KIND_S
            if self._revealed.setdefault(u, kind) != kind:
                raise RevealRefused(f"refusing to reveal both the self-mask and the key share of client {u}")
            held = self._held[u]
            reveals[i] = (u, kind, held[LIMBS:] if kind == KIND_B else held[:LIMBS])
        self._held.clear()
        self.round = Round.COMPLETED
        return UnmaskResponse(self._tag, reveals).to_bytes()
