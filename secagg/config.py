"""Parameters every party of one SecAgg instance must agree on, and the session tag they give."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .crypto import sha256
from .errors import ConfigError, UnsafeParameters
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
    consistency_check: run the ConsistencyCheck round; min_summed: no sum of fewer inputs is
    ever released (the group size floor k); graph_commitment: H(seed) of the server's graph
    seed, published before the cohort was known (empty: the server's seed is taken on trust).

    Unsafe parameters are refused (``UnsafeParameters``) unless ``allow_unsafe``: under SecAgg+
    t must be a majority of a neighbourhood (2t > k + 1), and for the complete graph over n
    clients t > 2n/3 (checked by ``check_cohort`` once n is known: Bonawitz et al. 2017, secure
    against a malicious server colluding with fewer than n/3 clients). ``allow_unsafe`` is not
    part of the session tag: it is each party's own choice.
    """

    vector_length: int
    modulus: int
    threshold: int
    session_label: bytes = b""
    degree: int | None = None
    consistency_check: bool = False
    min_summed: int = 0
    graph_commitment: bytes = b""
    allow_unsafe: bool = False

    def __post_init__(self) -> None:
        if self.vector_length < 1:
            raise ConfigError("vector_length must be >= 1")
        if not 2 <= self.modulus <= MAX_MODULUS:
            raise ConfigError("modulus must be in [2, 2^62]")
        if self.threshold < 2:
            raise ConfigError("threshold must be >= 2")
        if self.min_summed < 0:
            raise ConfigError("min_summed must be >= 0")
        if len(self.graph_commitment) not in (0, 32):
            raise ConfigError("graph_commitment must be empty or 32 bytes")
        if self.degree is not None:
            if self.degree < 2 or self.degree % 2:
                raise ConfigError("degree must be even and >= 2")
            if self.threshold > self.degree + 1:
                raise ConfigError("threshold exceeds neighbourhood size")
            if not self.allow_unsafe and 2 * self.threshold <= self.degree + 1:
                raise UnsafeParameters(
                    f"threshold {self.threshold} is not a majority of a neighbourhood of {self.degree + 1}: "
                    "use secagg_plus_parameters(n) or pass allow_unsafe=True"
                )

    def cohort_problem(self, n: int) -> str | None:
        """Why t is unsafe for n clients sharing with everyone (complete graph), or None."""
        if self.allow_unsafe or (self.degree is not None and self.degree < n - 1):
            return None
        if 3 * self.threshold <= 2 * n:
            return (
                f"threshold {self.threshold} is not above 2n/3 for n = {n}: a server colluding with n/3 "
                f"clients could rebuild an input; use complete_graph_threshold({n}) = {complete_graph_threshold(n)}"
            )
        return None

    def check_cohort(self, n: int) -> None:
        """Raise ``UnsafeParameters`` if t is unsafe for a cohort of n (see ``cohort_problem``)."""
        problem = self.cohort_problem(n)
        if problem is not None:
            raise UnsafeParameters(problem + " or pass allow_unsafe=True")

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
        min_summed: int = 0,
        graph_commitment: bytes = b"",
    ) -> SecAggConfig:
        """Sensible parameters for n clients: R from the bitwidth, t and the graph from n.

        ``secagg_plus=None`` picks SecAgg+ only when its degree is below (n - 1) / 2: for small
        cohorts a sparse graph saves little and the complete graph's single threshold is simpler
        (with the defaults, which hold against a server that splits survivor lists, the switch
        happens between n = 300 and n = 400).
        """
        modulus = modulus_for(n, bitwidth)
        if secagg_plus is not False:
            g = secagg_plus_parameters(n, corrupt_fraction, dropout_rate)
            if not g.complete and (secagg_plus or 2 * g.degree < n - 1):
                return cls(
                    vector_length,
                    modulus,
                    g.threshold,
                    session_label,
                    g.degree,
                    consistency_check=consistency_check,
                    min_summed=min_summed,
                    graph_commitment=graph_commitment,
                )
        return cls(
            vector_length,
            modulus,
            complete_graph_threshold(n, corrupt_fraction),
            session_label,
            None,
            consistency_check=consistency_check,
            min_summed=min_summed,
            graph_commitment=graph_commitment,
        )

    @property
    def session_tag(self) -> bytes:
        """16 bytes naming this instance (label + every shared parameter): on every message."""
        enc = struct.pack(
            "<QQQQ?Q",
            self.vector_length,
            self.modulus,
            self.threshold,
            self.degree or 0,
            self.consistency_check,
            self.min_summed,
        )
        return sha256(b"secagg/session/v2", self.session_label, enc, self.graph_commitment)[:16]
