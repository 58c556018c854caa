"""Shared helpers for the secagg tests: seeded randomness and a step-by-step driver."""

from __future__ import annotations

import random

import numpy as np

from secagg import Round, SecAggClient, SecAggConfig, SecAggServer, crypto, parse_message
from secagg.crypto import SigningKey
from secagg.messages import KIND_B, KIND_S, EncryptedShares
from secagg.shamir import LIMBS
from secagg.transcript import masked_input_payload, share_check_payload, share_digest, unmask_payload


def seeded(seed: int):
    """A deterministic ``random_bytes`` for the state machines."""
    return random.Random(seed).randbytes


def make_inputs(n: int, length: int, modulus: int, seed: int = 0, first_id: int = 1) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {u: rng.integers(0, modulus, length, dtype=np.uint64) for u in range(first_id, first_id + n)}


def exact_sum(inputs: dict[int, np.ndarray], ids, modulus: int) -> list[int]:
    """The sum mod ``modulus`` of the inputs of ``ids``, computed exactly (Python integers)."""
    length = len(next(iter(inputs.values())))
    return [int(v) % modulus for v in sum((inputs[u].astype(object) for u in ids), np.zeros(length, dtype=object))]


class Harness:
    """Server + clients advanced one round at a time, so tests can tamper in between."""

    def __init__(self, config: SecAggConfig, inputs: dict[int, np.ndarray], seed: int = 0) -> None:
        rb = seeded(seed)
        self.config = config
        self.inputs = inputs
        self.server = SecAggServer(config, inputs, random_bytes=rb)
        self.signers = {u: SigningKey(rb) for u in inputs}
        self.clients = {
            u: SecAggClient(u, config, x, random_bytes=rb, signer=self.signers[u]) for u, x in inputs.items()
        }
        self.outbox: dict[int, bytes] = {u: c.start() for u, c in self.clients.items()}
        self.to_clients: dict[int, bytes] = {}

    def server_step(self, silent: set[int] = frozenset()) -> dict[int, bytes]:
        """Deliver the clients' pending messages (except ``silent``), close the round."""
        for u, data in self.outbox.items():
            if u not in silent and data is not None:
                self.server.receive(u, data)
        self.to_clients = self.server.close_round()
        return self.to_clients

    def client_step(self, messages: dict[int, bytes] | None = None) -> dict[int, bytes | None]:
        messages = self.to_clients if messages is None else messages
        self.outbox = {u: self.clients[u].handle(data) for u, data in messages.items()}
        return self.outbox

    def run_to(self, target: Round) -> None:
        """Advance until the server is in ``target`` with the clients' messages for it pending
        in ``to_clients`` (not yet handled by the clients)."""
        self.server_step()
        while self.server.round is not target:
            self.client_step()
            self.server_step()

    def sign_masked(self, u: int, words: bytes) -> bytes:
        """Client u's signature over a masked input (for tests that forge its content)."""
        return crypto.sign(self.signers[u], masked_input_payload(self.server.session_id, u, words))

    def sign_check(self, u: int, complaints) -> bytes:
        """Client u's signature over a share check naming ``complaints``."""
        return crypto.sign(
            self.signers[u], share_check_payload(self.server.session_id, u, np.asarray(complaints, "<u4"))
        )

    def sign_reveals(self, u: int, reveals) -> bytes:
        return crypto.sign(self.signers[u], unmask_payload(self.server.session_id, u, reveals))

    def reseal(self, dealer: int, c_sk, pairs: dict[int, np.ndarray]) -> None:
        """Rewrite the dealer's pending EncryptedShares so that each holder in ``pairs`` gets
        those limbs (its s_sk share, then its b share): a pair that authenticates, with the
        dealer's digests over it, as a malicious dealer holding its own key ``c_sk`` can send."""
        roster = parse_message(self.to_clients[dealer])
        sid, entries = roster.session_id, roster.entries
        sent = parse_message(self.outbox[dealer])
        cts, digests = sent.shares.copy(), sent.digests.copy()
        for v, limbs in pairs.items():
            limbs = np.asarray(limbs, "<u4")
            d = int(np.flatnonzero(digests["holder"] == v)[0])
            digests["s"][d] = np.void(share_digest(sid, dealer, v, KIND_S, limbs[:LIMBS]))
            digests["b"][d] = np.void(share_digest(sid, dealer, v, KIND_B, limbs[LIMBS:]))
            if v != dealer:
                pk = crypto.load_public(entries["c_pk"][entries["id"] == v][0].tobytes())
                key = crypto.share_key(crypto.agree(c_sk, pk), sid, dealer, v)
                row = int(np.flatnonzero(cts["peer"] == v)[0])
                cts["ct"][row] = np.void(crypto.encrypt_share(key, limbs.tobytes(), crypto.share_ad(sid, dealer, v)))
        self.outbox[dealer] = EncryptedShares(sent.session_tag, cts, digests).to_bytes()
