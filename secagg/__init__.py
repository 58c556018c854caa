"""Secure Aggregation (Bonawitz et al., CCS 2017; SecAgg+ graphs from Bell et al. 2020).

Pure, sans-I/O state machines: ``SecAggClient`` and ``SecAggServer`` take message bytes and
return message bytes; a driver moves the bytes and decides when a round's deadline passes.
Randomness is injectable (``random_bytes``); nothing here reads clocks, sleeps or does I/O.
See ``server`` for the driver loop and robust reconstruction, and ``client`` for the checks an
honest client makes. Against a malicious server: parameters below the safe floor are refused
unless the caller passes ``allow_unsafe=True``; clients sign their keys and messages with a
``Signer`` and accept only peers a ``PeerVerifier`` certifies; SecAgg+ neighbourhoods derive from
a committed seed and every advertised key (``seeded_harary``), groups from a seed and the
members' keys (``assign_groups``). Against malicious clients: low-order keys are refused, a
client whose share pairs too few holders can open is left out before anyone masks (ShareCheck),
bad revealed shares are detected and dropped, and masked inputs and unmask responses are bound
to their session and sender.

``__all__`` holds what a driver of either side calls; the PRG and mask accumulation are
``secagg.prg``'s own.
"""

from .client import SecAggClient
from .config import MAX_CLIENT_ID, SecAggConfig
from .errors import (
    BadSignature,
    ConfigError,
    DuplicateMessage,
    ForgedGraph,
    InconsistentSurvivors,
    InvalidInput,
    InvalidKeys,
    MessageFormatError,
    OutOfOrder,
    PrematureMessage,
    ProtocolAborted,
    ProtocolViolation,
    RevealRefused,
    SecAggError,
    TooFewSurvivors,
    UncertifiedPeer,
    UnexpectedClient,
    UnsafeConfiguration,
    UnsafeParameters,
    WrongSession,
)
from .graphs import (
    GraphParameters,
    assign_groups,
    complete_graph_threshold,
    group_seed,
    harary_neighbours,
    least_secagg_plus_degree,
    secagg_plus_parameters,
    seeded_harary,
)
from .identity import PeerVerifier, Signer
from .messages import Message, parse_message
from .quantize import Quantizer, decode_weighted, encode_weighted, modulus_for
from .rounds import Round
from .server import SecAggServer
from .simulate import SimulationResult, run_protocol
from .transcript import seed_commitment

__all__ = [
    "BadSignature",
    "ConfigError",
    "DuplicateMessage",
    "ForgedGraph",
    "GraphParameters",
    "InconsistentSurvivors",
    "InvalidInput",
    "InvalidKeys",
    "MAX_CLIENT_ID",
    "Message",
    "MessageFormatError",
    "OutOfOrder",
    "PeerVerifier",
    "PrematureMessage",
    "ProtocolAborted",
    "ProtocolViolation",
    "Quantizer",
    "RevealRefused",
    "Round",
    "SecAggClient",
    "SecAggConfig",
    "SecAggError",
    "SecAggServer",
    "Signer",
    "SimulationResult",
    "TooFewSurvivors",
    "UncertifiedPeer",
    "UnexpectedClient",
    "UnsafeConfiguration",
    "UnsafeParameters",
    "WrongSession",
    "assign_groups",
    "complete_graph_threshold",
    "decode_weighted",
    "encode_weighted",
    "group_seed",
    "harary_neighbours",
    "modulus_for",
    "parse_message",
    "run_protocol",
    "least_secagg_plus_degree",
    "secagg_plus_parameters",
    "seed_commitment",
    "seeded_harary",
]
