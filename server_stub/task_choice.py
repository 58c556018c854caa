"""Which of a population's tasks runs the next round (paper, section 7.1: several tasks per
population, e.g. training alternating with evaluation, A/B tests between models, a grid of
hyper-parameters). Pure: it takes the candidates, the turn and a random source."""

from __future__ import annotations

import random
from collections.abc import Sequence
from enum import Enum


class Strategy(str, Enum):
    """``alternate``: the tasks take turns in the order they were deployed (training, then
    evaluation of the model it just committed, ...). ``weighted``: each round draws a task with
    probability proportional to its weight (A/B between two models; a weighted grid)."""

    ALTERNATE = "alternate"
    WEIGHTED = "weighted"


def choose_task(strategy: Strategy, weights: Sequence[float], turn: int, rng: random.Random) -> int:
    """The index of the task that runs the next round, of ``len(weights)`` candidates."""
    if not weights:
        raise ValueError("there is no task to choose from")
    if strategy is Strategy.ALTERNATE:
        return turn % len(weights)
    total = sum(weights)
    if not total > 0:
        return turn % len(weights)
    pick = rng.random() * total
    for index, weight in enumerate(weights):
        pick -= weight
        if pick < 0:
            return index
    # rounding can leave a sliver past the last step: the last task that may run at all takes it
    return max(i for i, weight in enumerate(weights) if weight > 0)
