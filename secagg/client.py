"""The client's state machine (one device in one SecAgg instance).

Usage: ``msg = client.start()`` (AdvertiseKeys), then for every message the server sends,
``reply = client.handle(data)``; send ``reply`` if it is not None. ``client.round`` names the
round the client is in; after Unmasking it is Completed. Any refusal (see ``errors``) moves it
to Aborted with ``abort_reason`` and ``error`` set, and it then answers nothing.

Checks an honest client makes before answering (Bonawitz et al. 2017, Fig. 4 / 6): the session
tag and session id; parameters at or above the safe floor (t > 2n/3 over the complete graph,
a majority of each SecAgg+ neighbourhood, at least ``min_summed`` clients); at least t peers in
every list, and at least ``min_summed`` survivors in a survivor list it sees whole (over the
complete graph, and under SecAgg+ with ConsistencyCheck); no duplicate ids; every list a subset of the previous round's and containing
ourselves; our own advertised keys echoed unchanged; distinct, usable (not low-order) keys;
every entry's keys signed by its signing key, that key certified by ``verify_peer`` and used by
one entry only (no sybils); under SecAgg+ our neighbourhood is the one the revealed seed and
the directory of all advertised entries determine, and the seed opens the commitment in the
configuration; every share pair authenticates under the key bound to (sender, us, session)
and matches its sender's digests (one that does not is reported at ShareCheck, before anyone
masks, and never revealed: the server leaves out of the masking set every sender whose pairs
fewer than t holders could use, so one client dealing garbage cannot make its group abort); it
masks over the senders minus those the server leaves out, at least t with itself, and nothing of
a left-out sender is ever revealed; with ConsistencyCheck, >= t valid signatures over the same
survivor set; and it reveals for each peer either the share of b (peer sent its masked input)
or of s_sk (it did not), never both. Masked inputs, share checks and unmask responses are signed
over (session id, sender).

Each key agreement is done once, at ShareKeys: the share keys and mask seeds it yields are kept
until used, and private keys, b, seeds and held shares are dropped as soon as they are no longer
needed, and at the latest on completion or abort.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from . import crypto
from .config import MAX_CLIENT_ID, SecAggConfig
from .errors import (
    BadSignature,
    ConfigError,
    ForgedGraph,
    InconsistentSurvivors,
    InvalidInput,
    InvalidKeys,
    OutOfOrder,
    RevealRefused,
    SecAggError,
    TooFewSurvivors,
    UncertifiedPeer,
    UnsafeConfiguration,
    WrongSession,
)
from .graphs import keyed_ring
from .identity import PeerVerifier, Signer
from .messages import (
    ADDRESSED_CT,
    KIND_B,
    KIND_S,
    SHARE_DIGEST,
    SHARE_REVEAL,
    AdvertiseKeys,
    ConsistencyRequest,
    ConsistencySignature,
    EncryptedShares,
    KeyRoster,
    MaskedInput,
    MaskRequest,
    Message,
    ShareCheck,
    SharesForYou,
    UnmaskRequest,
    UnmaskResponse,
    parse_message,
)
from .prg import MaskAccumulator
from .rounds import Round
from .shamir import LIMBS, P, share_secrets
from .transcript import (
    consistency_payload,
    entry_digests,
    graph_key,
    key_signing_payload,
    masked_input_payload,
    roster_session_id,
    seed_commitment,
    share_check_payload,
    share_digest,
    unmask_payload,
)

__all__ = ["SecAggClient", "consistency_payload", "roster_session_id"]


def _unique_sorted(ids: np.ndarray, what: str) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64)
    s = np.unique(ids)
    if len(s) != len(ids):
        raise InconsistentSurvivors(f"duplicate client ids in {what}")
    return s


T = TypeVar("T")


def _held_since(value: T | None, what: str) -> T:
    """A secret an earlier round made (the rounds' order guarantees it): an out-of-order error,
    not an AttributeError, should it ever be missing."""
    if value is None:
        raise OutOfOrder(f"{what} is not held in this round")
    return value


def _wipe(buf: bytearray | None) -> None:
    if buf is not None:
        buf[:] = bytes(len(buf))


class SecAggClient:
    """One client. ``input_vector``: ``config.vector_length`` integers in [0, R).

    ``signer`` signs this client's keys and messages (default: a key made for this instance);
    ``verify_peer(public_key, credential)`` must certify every roster entry's signing key
    (default: no check); ``is_member(public_key)``, when given, says whether a signing key may
    be in the roster at all (the group the driver recomputed from the committed seed).
    """

    def __init__(
        self,
        client_id: int,
        config: SecAggConfig,
        input_vector: np.ndarray | None = None,
        *,
        random_bytes: Callable[[int], bytes] = os.urandom,
        signer: Signer | None = None,
        verify_peer: PeerVerifier | None = None,
        is_member: Callable[[bytes], bool] | None = None,
    ) -> None:
        if not 1 <= client_id <= MAX_CLIENT_ID:
            raise ConfigError(f"client_id must be in [1, {MAX_CLIENT_ID}]")
        self.id = client_id
        self.config = config
        self._tag = config.session_tag
        self._x: np.ndarray | None = None
        self._random_bytes = random_bytes
        self._signer = signer
        self._verify_peer = verify_peer
        self._is_member = is_member
        self.round = Round.ADVERTISE_KEYS
        self.abort_reason: str | None = None
        self.error: SecAggError | None = None
        self._started = False
        self._c: crypto.KeyPair | None = None
        self._s: crypto.KeyPair | None = None
        self._b: bytearray | None = None
        self._session_id = b""
        self._peers: dict[int, tuple[bytes, bytes, bytes]] = {}  # neighbourhood: id -> (c_pk, s_pk, sig_pk)
        self._universe: np.ndarray = np.empty(0, np.int64)  # U1 (all of it, also under SecAgg+)
        self._inbound: dict[int, bytes] = {}  # peer -> AES-GCM key of the share pair it sends us
        self._seeds: dict[int, bytearray] = {}  # peer -> pairwise mask seed
        self._u2: np.ndarray = np.empty(0, np.int64)  # senders of our shares, ourselves included
        self._held: dict[int, np.ndarray] = {}  # peer -> its s_sk share limbs + b share limbs
        self._senders: np.ndarray = np.empty(0, np.int64)  # peers whose share pairs we received
        #: peers whose share pair we could not use (reported at ShareCheck): nothing is revealed for them
        self.unopened: set[int] = set()
        self._u3: np.ndarray | None = None
        self._revealed: dict[int, int] = {}
        if input_vector is not None:
            self.set_input(input_vector)

    # -- driver API -------------------------------------------------------------------------
    def set_input(self, input_vector: np.ndarray) -> None:
        """Set the vector to sum (integers in [0, R)); allowed until the masked input is sent,
        so key exchange can start while the device still computes its update."""
        if self.round not in (Round.ADVERTISE_KEYS, Round.SHARE_KEYS, Round.SHARE_CHECK):
            raise OutOfOrder("the masked input was already sent")
        x = np.asarray(input_vector)
        if x.shape != (self.config.vector_length,):
            raise InvalidInput(f"input must have shape ({self.config.vector_length},)")
        if x.dtype.kind not in "ui" or (x.size and (x.min() < 0 or int(x.max()) >= self.config.modulus)):
            raise InvalidInput("input entries must be integers in [0, modulus)")
        self._x = x

    def start(self) -> bytes:
        """AdvertiseKeys: generate the two key pairs and announce the public halves, signed."""
        if self._started:
            raise OutOfOrder("start() called twice")
        self._started = True
        self._c = crypto.KeyPair(self._random_bytes)
        self._s = crypto.KeyPair(self._random_bytes)
        signer = self._signer = self._signer if self._signer is not None else crypto.SigningKey(self._random_bytes)
        c_pk, s_pk = self._c.public_bytes, self._s.public_bytes
        sig = crypto.sign(signer, key_signing_payload(self._tag, self.id, c_pk, s_pk))
        return AdvertiseKeys(self._tag, c_pk, s_pk, signer.public_key, sig, signer.credential).to_bytes()

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
        except SecAggError as exc:
            self._abort(exc)
            return None

    @property
    def completed(self) -> bool:
        return self.round is Round.COMPLETED

    @property
    def aborted(self) -> bool:
        return self.round is Round.ABORTED

    @property
    def holds_secrets(self) -> bool:
        """True while any private key, b, mask seed, share key or held share is in memory."""
        return bool(self._c or self._s or self._b or self._seeds or self._inbound or self._held or self._x is not None)

    # -- rounds ---------------------------------------------------------------------------------
    def _abort(self, exc: SecAggError) -> None:
        self.round = Round.ABORTED
        self.error = exc
        self.abort_reason = getattr(exc, "reason", None) or str(exc)
        self._zeroize()

    def _zeroize(self) -> None:
        """Drop every secret (the X25519 objects free and cleanse their memory in OpenSSL)."""
        self._c = self._s = None
        _wipe(self._b)
        self._b = None
        for seed in self._seeds.values():
            _wipe(seed)
        self._seeds.clear()
        self._inbound.clear()
        for held in self._held.values():
            if held.flags.writeable:
                held.fill(0)
        self._held.clear()
        self._x = None

    def _dispatch(self, msg: Message) -> bytes | None:
        expected = {
            Round.ADVERTISE_KEYS: KeyRoster,
            Round.SHARE_KEYS: SharesForYou,
            Round.SHARE_CHECK: MaskRequest,
            Round.MASKED_INPUT_COLLECTION: ConsistencyRequest if self.config.consistency_check else UnmaskRequest,
            Round.CONSISTENCY_CHECK: UnmaskRequest,
        }[self.round]
        if type(msg) is not expected:
            raise OutOfOrder(f"got {type(msg).__name__} during {self.round.value}, expected {expected.__name__}")
        if isinstance(msg, KeyRoster):
            return self._share_keys(msg)
        if isinstance(msg, SharesForYou):
            return self._check_shares(msg)
        if isinstance(msg, MaskRequest):
            return self._masked_input(msg)
        if isinstance(msg, ConsistencyRequest):
            return self._consistency(msg)
        if isinstance(msg, UnmaskRequest):
            return self._unmask(msg)
        raise OutOfOrder(f"got {type(msg).__name__} during {self.round.value}")

    @property
    def _sparse(self) -> bool:
        """SecAgg+ with neighbourhoods smaller than U1: we see our neighbours only."""
        return self.config.degree is not None and len(self._universe) > self.config.degree + 1

    def _check_roster(self, msg: KeyRoster) -> tuple[np.ndarray, list[bytes]]:
        cfg, t = self.config, self.config.threshold
        entries = msg.entries
        ids = _unique_sorted(entries["id"], "the key roster")
        if self.id not in set(ids.tolist()):
            raise InconsistentSurvivors("our own id is missing from the key roster")
        if len(ids) < t:
            raise TooFewSurvivors(f"key roster has {len(ids)} clients < threshold {t}")
        if cfg.degree is not None and len(ids) > cfg.degree + 1:
            raise InconsistentSurvivors(f"roster of {len(ids)} exceeds the neighbourhood size {cfg.degree + 1}")
        c_pks, s_pks, sig_pks = (entries[f].tobytes() for f in ("c_pk", "s_pk", "sig_pk"))
        c_list = [c_pks[i : i + 32] for i in range(0, len(c_pks), 32)]
        s_list = [s_pks[i : i + 32] for i in range(0, len(s_pks), 32)]
        sig_list = [sig_pks[i : i + 32] for i in range(0, len(sig_pks), 32)]
        if len(set(c_list) | set(s_list)) != 2 * len(ids):
            raise InvalidKeys("advertised public keys are not all distinct")
        if len(set(sig_list)) != len(ids):
            raise UncertifiedPeer("two roster entries carry one signing key (one device twice)")
        credentials = msg.credential_list()
        key_sigs = entries["key_sig"].tobytes()
        own = (
            _held_since(self._c, "the key pair c").public_bytes,
            _held_since(self._s, "the key pair s").public_bytes,
            _held_since(self._signer, "the signing key").public_key,
        )
        for i, u in enumerate(entries["id"].tolist()):
            if u == self.id:
                if (c_list[i], s_list[i], sig_list[i]) != own:
                    raise InvalidKeys("the roster does not carry our own public keys")
                continue
            if self._verify_peer is not None:  # without a PKI anyone could sign with a fresh key
                payload = key_signing_payload(self._tag, u, c_list[i], s_list[i])
                if not crypto.verify_signature(sig_list[i], key_sigs[64 * i : 64 * i + 64], payload):
                    raise UncertifiedPeer(f"the keys of client {u} are not signed by its signing key")
                if not self._verify_peer(sig_list[i], credentials[i]):
                    raise UncertifiedPeer(f"the signing key of client {u} is not certified by the trust anchor")
            if self._is_member is not None and not self._is_member(sig_list[i]):
                raise ForgedGraph(f"client {u} is not a member of the group the committed seed assigns us")
            self._peers[u] = (c_list[i], s_list[i], sig_list[i])
        self._peers[self.id] = own
        return ids, credentials

    def _check_graph(self, msg: KeyRoster, ids: np.ndarray, credentials: list[bytes]) -> None:
        cfg = self.config
        mine = entry_digests(msg.entries, credentials)
        if len(msg.directory):
            directory = np.sort(msg.directory, order="id")
            universe = _unique_sorted(directory["id"], "the directory")
            pos = np.searchsorted(universe, mine["id"])
            if np.any(pos >= len(universe)) or not np.array_equal(directory[np.minimum(pos, len(universe) - 1)], mine):
                raise ForgedGraph("the roster's entries differ from the directory of advertised keys")
        else:
            directory, universe = mine, ids
        self._universe = universe
        if cfg.graph_commitment and seed_commitment(msg.seed) != cfg.graph_commitment:
            raise ForgedGraph("the revealed seed does not open the server's commitment")
        sid = roster_session_id(self._tag, msg.seed, directory)
        if msg.session_id != sid:
            raise WrongSession("session id does not match the advertised keys")
        self._session_id = sid
        n = len(universe)
        if n < cfg.min_summed:
            raise UnsafeConfiguration(f"only {n} clients advertised keys, fewer than the minimum of {cfg.min_summed}")
        if cfg.degree is not None and self._sparse:
            ring = keyed_ring(universe.tolist(), graph_key(sid))
            at = int(np.flatnonzero(ring == self.id)[0])
            half = cfg.degree // 2
            holders = np.sort(ring[(at + np.arange(-half, half + 1)) % n])
            if not np.array_equal(holders, ids):
                raise ForgedGraph("the roster is not the neighbourhood the revealed seed and the advertised keys give")
        elif len(ids) != n:
            raise InconsistentSurvivors("a complete-graph roster must hold every client of the directory")
        else:
            problem = cfg.cohort_problem(n)
            if problem is not None:
                raise UnsafeConfiguration(problem)

    def _share_keys(self, msg: KeyRoster) -> bytes:
        t = self.config.threshold
        ids, credentials = self._check_roster(msg)
        self._check_graph(msg, ids, credentials)
        holders = ids.tolist()
        c, s = _held_since(self._c, "the key pair c"), _held_since(self._s, "the key pair s")
        sid, c_sk, s_sk = self._session_id, c.private, s.private
        self._b = bytearray(self._random_bytes(32))
        shares = share_secrets([s.private_bytes, bytes(self._b)], holders, t, self._random_bytes).astype("<u4")
        out = np.empty(len(holders) - 1, dtype=ADDRESSED_CT)
        digests = np.empty(len(holders), dtype=SHARE_DIGEST)
        cts = []
        j = 0
        for i, v in enumerate(holders):
            digests[i] = (
                v,
                np.void(share_digest(sid, self.id, v, KIND_S, shares[i, :LIMBS])),
                np.void(share_digest(sid, self.id, v, KIND_B, shares[i, LIMBS:])),
            )
            if v == self.id:
                self._held[self.id] = shares[i].copy()
                continue
            c_pk, s_pk, _ = self._peers[v]
            try:
                c_shared = crypto.agree(c_sk, crypto.load_public(c_pk))
                s_shared = crypto.agree(s_sk, crypto.load_public(s_pk))
            except ValueError:
                raise InvalidKeys(f"unusable (low-order) public key of client {v}") from None
            self._inbound[v] = crypto.share_key(c_shared, sid, v, self.id)
            self._seeds[v] = bytearray(crypto.mask_seed(s_shared, sid, self.id, v))
            key = crypto.share_key(c_shared, sid, self.id, v)
            cts.append(crypto.encrypt_share(key, shares[i].tobytes(), crypto.share_ad(sid, self.id, v)))
            out["peer"][j] = v
            j += 1
        out["ct"] = np.frombuffer(b"".join(cts), dtype=out.dtype["ct"]) if cts else out["ct"]
        shares.fill(0)
        self._c = self._s = None  # every agreement is done: the private keys are not needed again
        self.round = Round.SHARE_KEYS
        return EncryptedShares(self._tag, out, digests).to_bytes()

    def _check_shares(self, msg: SharesForYou) -> bytes:
        """Open every share pair sent to us and report the senders whose pair we cannot use.
        Done before masking (it needs no input, so a device does it before training): the
        server can then leave such a sender out of everyone's masking set."""
        t = self.config.threshold
        senders = _unique_sorted(msg.shares["peer"], "the shares list")
        sender_set = set(senders.tolist())
        if self.id in sender_set:
            raise InconsistentSurvivors("a share claims to come from ourselves")
        if not sender_set <= self._inbound.keys():
            raise InconsistentSurvivors("shares from clients that were not in the key roster")
        if len(senders) + 1 < t:
            raise TooFewSurvivors(f"{len(senders) + 1} clients shared keys < threshold {t}")
        sid, me = self._session_id, self.id
        size = msg.shares.dtype["ct"].itemsize
        cts = msg.shares["ct"].tobytes()
        for i, (u, d_s, d_b) in enumerate(zip(msg.shares["peer"].tolist(), msg.shares["s"], msg.shares["b"])):
            pt = crypto.decrypt_share(self._inbound[u], cts[i * size : (i + 1) * size], crypto.share_ad(sid, u, me))
            limbs = np.frombuffer(pt, dtype="<u4").copy() if pt is not None else None
            if (
                limbs is None
                or limbs.max(initial=0) >= P
                or share_digest(sid, u, me, KIND_S, limbs[:LIMBS]) != d_s.tobytes()
                or share_digest(sid, u, me, KIND_B, limbs[LIMBS:]) != d_b.tobytes()
            ):
                self.unopened.add(u)
                continue
            self._held[u] = limbs
        self._inbound.clear()
        self._senders = senders
        self.round = Round.SHARE_CHECK
        complaints = np.asarray(sorted(self.unopened), dtype="<u4")
        signature = crypto.sign(_held_since(self._signer, "the signing key"), share_check_payload(sid, me, complaints))
        return ShareCheck(self._tag, complaints, signature).to_bytes()

    def _masked_input(self, msg: MaskRequest) -> bytes:
        t = self.config.threshold
        if self._x is None:
            raise OutOfOrder("no input vector was set before MaskedInputCollection")
        excluded = set(_unique_sorted(msg.excluded, "the excluded list").tolist())
        if self.id in excluded:
            raise InconsistentSurvivors("the server left this client out of the masking set it asked it to mask over")
        senders = self._senders[~np.isin(self._senders, list(excluded))] if excluded else self._senders
        if len(senders) + 1 < t:
            raise TooFewSurvivors(f"{len(senders) + 1} clients in the masking set < threshold {t}")
        for v in excluded & self._held.keys():  # never revealed: nobody masks with v
            self._held.pop(v).fill(0)
        for v in excluded & self._seeds.keys():
            _wipe(self._seeds.pop(v))
        sid = self._session_id
        self._u2 = np.union1d(senders, [self.id])
        acc = MaskAccumulator(self.config.vector_length, self.config.modulus)
        acc.add_vector(self._x)
        acc.add_seed(bytes(_held_since(self._b, "the self-mask seed b")))
        for v in senders.tolist():
            acc.add_seed(bytes(self._seeds[v]), 1 if self.id < v else -1)
        words = acc.value().astype(acc.dtype.newbyteorder("<")).tobytes()
        del acc
        self._x = None  # no longer needed; do not keep the plain input around
        _wipe(self._b)
        self._b = None
        for seed in self._seeds.values():
            _wipe(seed)
        self._seeds.clear()
        self.round = Round.MASKED_INPUT_COLLECTION
        signature = crypto.sign(_held_since(self._signer, "the signing key"), masked_input_payload(sid, self.id, words))
        return MaskedInput(self._tag, words, signature).to_bytes()

    def _check_u3(self, survivors: np.ndarray) -> np.ndarray:
        """The survivor list as this client must see it; under SecAgg+ with ConsistencyCheck it
        is all of U3, of which our neighbourhood's part is checked."""
        t = self.config.threshold
        u3 = _unique_sorted(survivors, "the survivor list")
        if self.id not in set(u3.tolist()):
            raise InconsistentSurvivors("survivor list omits us although we sent our masked input")
        local = u3
        if self._sparse and self.config.consistency_check:
            if not np.isin(u3, self._universe).all():
                raise InconsistentSurvivors("survivor list names clients that never advertised keys")
            local = u3[np.isin(u3, np.fromiter(self._peers, np.int64))]
        if not np.isin(local, self._u2).all():
            raise InconsistentSurvivors("survivor list is not a subset of the clients that shared keys")
        if len(local) < t:
            raise TooFewSurvivors(f"{len(local)} survivors < threshold {t}")
        # the whole survivor list is seen over the complete graph, and under SecAgg+ with
        # ConsistencyCheck (without it a client is shown its neighbourhood's part only)
        if (not self._sparse or self.config.consistency_check) and len(u3) < self.config.min_summed:
            raise TooFewSurvivors(f"{len(u3)} survivors < the minimum of {self.config.min_summed} inputs in a sum")
        return u3

    def _consistency(self, msg: ConsistencyRequest) -> bytes:
        u3 = self._check_u3(msg.survivors)
        self._u3 = u3
        sig = crypto.sign(_held_since(self._signer, "the signing key"), consistency_payload(self._session_id, u3))
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
            if not np.isin(signers, np.fromiter(self._peers, np.int64)).all():
                raise InconsistentSurvivors("signatures from clients outside our neighbourhood")
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
        peers = [u for u in self._u2.tolist() if u not in self.unopened]
        reveals = np.empty(len(peers), dtype=SHARE_REVEAL)
        for i, u in enumerate(peers):
            kind = KIND_B if u in in_u3 else KIND_S
            if self._revealed.setdefault(u, kind) != kind:
                raise RevealRefused(f"refusing to reveal both the self-mask and the key share of client {u}")
            held = self._held[u]
            reveals[i] = (u, kind, held[LIMBS:] if kind == KIND_B else held[:LIMBS])
        self._zeroize()
        self.round = Round.COMPLETED
        signature = crypto.sign(
            _held_since(self._signer, "the signing key"), unmask_payload(self._session_id, self.id, reveals)
        )
        return UnmaskResponse(self._tag, reveals, signature).to_bytes()
