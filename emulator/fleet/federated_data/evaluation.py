"""Per-client accuracy as LEAF and FedScale report it: the 10th, 50th and 90th percentile over clients.

A global model can be accurate on average and poor for a tail of clients (non-IID data); the
percentiles show that tail. Each client's accuracy is its correct / total on its own test examples;
the percentiles are over clients, unweighted, with numpy's linear interpolation (LEAF's
``np.percentile``), and ``accuracy`` is the example-weighted mean (LEAF's ``np.average`` with the
clients' test counts as weights), which equals correct / total over all clients. Clients with no
test example have no accuracy and are left out (``skipped`` counts them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ._errors import FederatedDataError


@dataclass(frozen=True)
class ClientAccuracy:
    """p10/p50/p90 of per-client accuracy, the example-weighted accuracy, and how many clients."""

    p10: float
    p50: float
    p90: float
    accuracy: float
    clients: int
    skipped: int = 0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "p10": self.p10,
            "p50": self.p50,
            "p90": self.p90,
            "accuracy": self.accuracy,
            "clients": self.clients,
            "skipped": self.skipped,
        }


def client_accuracy_percentiles(correct: Mapping[str, int], total: Mapping[str, int]) -> ClientAccuracy:
    """Percentiles of per-client accuracy from each client's correct and total counts."""
    if set(correct) != set(total):
        extra = sorted(set(correct) ^ set(total))[:3]
        raise FederatedDataError(f"correct and total must count the same clients; these are in one only: {extra}")
    clients = sorted(total)
    for c in clients:
        if not 0 <= correct[c] <= total[c]:
            raise FederatedDataError(
                f"client {c!r} has {correct[c]} correct of {total[c]}; counts must satisfy 0 <= correct <= total"
            )
    scored = [c for c in clients if total[c] > 0]
    if not scored:
        raise FederatedDataError("no client has a test example; evaluate on clients with test data")
    right = np.array([correct[c] for c in scored], dtype=np.float64)
    seen = np.array([total[c] for c in scored], dtype=np.float64)
    acc = right / seen
    p10, p50, p90 = (float(v) for v in np.percentile(acc, [10, 50, 90]))
    return ClientAccuracy(p10, p50, p90, float(right.sum() / seen.sum()), len(scored), len(clients) - len(scored))
