"""Who a client is to its peers: the signer it holds and the verifier it applies to each peer.

The library stays pure: a driver passes objects that follow these protocols. A device passes
its attested device key (Ed25519, certified by the attestation authority) and a verifier that
checks a peer's certificate against the authority's trust anchor, so that a roster made of
the server's own uncertified clients, or of one device many times, is refused (Bonawitz et al.
2017, Sec. 6: security against a malicious server needs a PKI). Without them each client
signs with a key made for the instance: messages stay bound to their sender and session, but
nothing stops a sybil roster.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Signer(Protocol):
    """An Ed25519 key: ``public_key`` (32 raw bytes), ``credential`` (what certifies the key to
    peers, e.g. a device certificate; may be empty) and ``sign(data) -> 64 bytes``."""

    public_key: bytes
    credential: bytes

    def sign(self, data: bytes) -> bytes: ...


#: ``verify_peer(public_key, credential) -> bool``: True when the credential certifies the key.
PeerVerifier = Callable[[bytes, bytes], bool]
