"""Helpers shared by the example-store tests."""

from __future__ import annotations

import numpy as np

IMPLEMENTATIONS = ("sqlite", "sqlite-sealed", "memory")
URI = "app:/digits"


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_examples(n: int, start: int = 0) -> list[dict]:
    return [{"x": np.arange(3, dtype=np.float32) + i, "y": np.int64(i)} for i in range(start, start + n)]


def labels(examples) -> list[int]:
    return [int(e["y"]) for e in examples]
