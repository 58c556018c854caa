"""Typed errors: every refusal and every bad message maps to one class, never a bare crash."""

from __future__ import annotations


class SecAggError(Exception):
    """Base class of every error raised by the secagg package."""


class ConfigError(SecAggError, ValueError):
    """The protocol parameters are inconsistent (threshold, modulus, vector length...)."""


class UnsafeParameters(ConfigError):
    """Parameters that would let a malicious server (with its colluding clients) learn an
    individual input; pass ``allow_unsafe=True`` only for a semi-honest experiment."""


class InvalidInput(SecAggError, ValueError):
    """An input vector of the wrong shape, type or range for the configuration."""


class MessageFormatError(SecAggError, ValueError):
    """Bytes that do not parse as a well-formed message of the expected kind."""


class ProtocolViolation(SecAggError):
    """A well-formed message that an honest party must refuse; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class WrongSession(ProtocolViolation):
    """The message belongs to another session (label or configuration differ)."""


class OutOfOrder(ProtocolViolation):
    """A message for another round than the current one (replayed or reordered)."""


class PrematureMessage(ProtocolViolation):
    """A client's message for a round the protocol has not reached or does not run (an Unmasking
    response during ShareKeys), or a message only a server sends. No honest client sends one: it
    answers the request of the round it is in, so its answer is never ahead of the server's round."""


class DuplicateMessage(ProtocolViolation):
    """A second message from the same client in the same round (a replay)."""


class UnexpectedClient(ProtocolViolation):
    """A message from a client that is not expected in this round."""


class InconsistentSurvivors(ProtocolViolation):
    """A survivor list that is not a subset of the previous one, has duplicates or omits us."""


class TooFewSurvivors(ProtocolViolation):
    """Fewer than the threshold t of peers remain: continuing would leak or cannot finish."""


class InvalidKeys(ProtocolViolation):
    """Advertised keys that are malformed, low-order, repeated, or do not match our own."""


class UncertifiedPeer(ProtocolViolation):
    """A roster entry whose signing key the peer verifier does not certify, whose key signature
    does not verify, or a second entry of one device (a sybil roster)."""


class ForgedGraph(ProtocolViolation):
    """The roster does not match the neighbourhood (or group) that the revealed seed and the
    advertised keys determine, or the seed does not open the commitment."""


class UnsafeConfiguration(ProtocolViolation):
    """The server's parameters (or the roster it sent) fall below what the client accepts."""


class BadSignature(ProtocolViolation):
    """A ConsistencyCheck signature that does not verify."""


class RevealRefused(ProtocolViolation):
    """The server asked for both the self-mask share and the key share of one peer."""


class ProtocolAborted(SecAggError):
    """Raised by ``result()`` when the protocol ended in Aborted; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
