"""Parameters every party of one SecAgg instance must agree on, and the session tag they give."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .crypto import sha256
from .errors import ConfigError
from .graphs import complete_graph_threshold, secagg_plus_parameters
from .prg import MAX_MODULUS
from .quantize import modulus_for
from .shamir import P

MAX_CLIENT_ID = P - 1  # ids are Shamir evaluation points: 1 <= id < p


@dataclass(frozen=True)
class SecAggConfig:
    """One SecAgg instance's parameters.

    vector_length: entries per input; modulus: R (inputs and the sum are mod R);
    threshold: t (per neighbourhood under SecAgg+); degree: None for the complete graph, else
    the even degree k of the SecAgg+ Harary graph; session_label: bytes the driver supplies
    (e.g. task, round and aggregator ids) so messages of one instance are void in any other;
    consistency_check: run the ConsistencyCheck round (complete graph only).
    """

    vector_length: int
    modulus: int
    threshold: int
    session_label: bytes = b""
    degree: int | None = None
    consistency_check: bool = False

    def __post_init__(self) -> None:
        if self.vector_length < 1:
            raise ConfigError("vector_length must be >= 1")
        if not 2 <= self.modulus <= MAX_MODULUS:
            raise ConfigError("modulus must be in [2, 2^62]")
        if self.threshold < 2:
            raise ConfigError("threshold must be >= 2")
        if self.degree is not None:
            if self.degree < 2 or self.degree % 2:
                raise ConfigError("degree must be even and >= 2")
            if self.threshold > self.degree + 1:
                raise ConfigError("threshold exceeds neighbourhood size")
            if self.consistency_check:
                raise ConfigError("ConsistencyCheck is implemented for the complete graph only")

    @classmethod
    def for_cohort(
        cls,
        n: int,
        vector_length: int,
        *,
        bitwidth: int = 16,
        session_label: bytes = b"",
        secagg_plus: bool | None = None,
        corrupt_fraction: float = 1 / 3,
        dropout_rate: float = 0.05,
        consistency_check: bool = False,
    ) -> "SecAggConfig":
        """Sensible parameters for n clients: R from the bitwidth, t and the graph from n.

        ``secagg_plus=None`` picks SecAgg+ only when its degree is below (n - 1) / 2: for small
        cohorts a sparse graph saves little and the complete graph's single threshold is simpler
        (with the defaults the switch happens between n = 150 and n = 200).
        """
        modulus = modulus_for(n, bitwidth)
        if secagg_plus is not False:
            g = secagg_plus_parameters(n, corrupt_fraction, dropout_rate)
            if not g.complete and (secagg_plus or 2 * g.degree < n - 1):
                return cls(vector_length, modulus, g.threshold, session_label, g.degree, consistency_check)
        return cls(vector_length, modulus, complete_graph_threshold(n), session_label, None, consistency_check)

    @property
    def session_tag(self) -> bytes:
        """16 bytes naming this instance (label + every parameter): on every message."""
        enc = struct.pack("<QQQQ?", self.vector_length, self.modulus, self.threshold, self.degree or 0,
                          self.consistency_check)
        return sha256(b"secagg/session/v1", self.session_label, enc)[:16]
