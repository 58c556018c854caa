"""Secure Aggregation (Bonawitz et al., CCS 2017; SecAgg+ graphs from Bell et al. 2020).

Pure, sans-I/O state machines: ``SecAggClient`` and ``SecAggServer`` take message bytes and
return message bytes; a driver moves the bytes and decides when a round's deadline passes.
Randomness is injectable (``random_bytes``); nothing here reads clocks, sleeps or does I/O.
See ``server`` for the driver loop and ``client`` for the checks an honest client makes.
"""

from .client import SecAggClient
from .config import MAX_CLIENT_ID, SecAggConfig
from .errors import (
    BadSignature,
    ConfigError,
    DecryptionFailed,
    DuplicateMessage,
    InconsistentSurvivors,
    InvalidKeys,
    MessageFormatError,
    OutOfOrder,
    ProtocolAborted,
    ProtocolViolation,
    RevealRefused,
    SecAggError,
    TooFewSurvivors,
    UnexpectedClient,
    WrongSession,
)
from .graphs import GraphParameters, complete_graph_threshold, harary_neighbours, secagg_plus_parameters
from .messages import Message, parse_message
from .prg import MaskAccumulator, expand
from .quantize import Quantizer, decode_weighted, encode_weighted, modulus_for
from .rounds import Round
from .server import SecAggServer
from .simulate import SimulationResult, run_protocol

__all__ = [
    "BadSignature",
    "ConfigError",
    "DecryptionFailed",
    "DuplicateMessage",
    "GraphParameters",
    "InconsistentSurvivors",
    "InvalidKeys",
    "MAX_CLIENT_ID",
    "MaskAccumulator",
    "Message",
    "MessageFormatError",
    "OutOfOrder",
    "ProtocolAborted",
    "ProtocolViolation",
    "Quantizer",
    "RevealRefused",
    "Round",
    "SecAggClient",
    "SecAggConfig",
    "SecAggError",
    "SecAggServer",
    "SimulationResult",
    "TooFewSurvivors",
    "UnexpectedClient",
    "WrongSession",
    "complete_graph_threshold",
    "decode_weighted",
    "encode_weighted",
    "expand",
    "harary_neighbours",
    "modulus_for",
    "parse_message",
    "run_protocol",
    "secagg_plus_parameters",
]
