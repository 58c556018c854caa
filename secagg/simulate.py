"""A reference in-process driver: the server and all clients in one loop, with drop-outs.

Used by the tests and the benchmark, and a template for real drivers: deliver each client's
reply to ``server.receive``, then ``close_round`` and hand the clients their next messages.
A client listed in ``drops[r]`` goes silent from round ``r`` on (it never sends its round-r
message nor anything later).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from .client import SecAggClient
from .config import SecAggConfig
from .errors import SecAggError
from .rounds import Round
from .server import SecAggServer


@dataclass
class SimulationResult:
    server: SecAggServer
    clients: dict[int, SecAggClient]
    result: np.ndarray | None
    abort_reason: str | None
    rejected: list[tuple[int, SecAggError]] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return self.result is not None


def run_protocol(
    config: SecAggConfig,
    inputs: Mapping[int, np.ndarray],
    *,
    drops: Mapping[Round, set[int]] | None = None,
    random_bytes: Callable[[int], bytes] = os.urandom,
) -> SimulationResult:
    """Run one instance to its end; returns the server, the clients and the outcome."""
    drops = drops or {}
    server = SecAggServer(config, inputs.keys(), random_bytes=random_bytes)
    clients = {u: SecAggClient(u, config, x, random_bytes=random_bytes) for u, x in inputs.items()}
    gone: set[int] = set()
    rejected: list[tuple[int, SecAggError]] = []
    outbox: dict[int, bytes | None] = {u: c.start() for u, c in clients.items()}
    while not server.round.terminal:
        gone |= drops.get(server.round, set())
        for u, data in outbox.items():
            if data is None or u in gone:
                continue
            try:
                server.receive(u, data)
            except SecAggError as exc:
                rejected.append((u, exc))
        incoming = server.close_round()
        outbox = {u: clients[u].handle(data) for u, data in incoming.items() if u not in gone}
    result = server.result() if server.round is Round.COMPLETED else None
    return SimulationResult(server, clients, result, server.abort_reason, rejected)
