"""Pace steering (paper, section 2.3): the window a rejected device is told to come back in.

Stateless and probabilistic on the device side: the server names a window that starts when it
expects the next round to open, so that in a small population the devices it turned away come back
together, and the width of the window spreads a large population out (no thundering herd)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RoundPace:
    """An exponentially weighted mean of how long rounds of one task take."""

    mean_duration_s: float | None = None
    weight: float = 0.3

    def observe(self, duration_s: float) -> None:
        if self.mean_duration_s is None:
            self.mean_duration_s = duration_s
        else:
            self.mean_duration_s += self.weight * (duration_s - self.mean_duration_s)

    def retry_window(self, now: float, round_started_at: float, base: tuple[float, float], cap_s: float) -> tuple[float, float]:
        """``base`` = (min, max) spread; the window is shifted to the expected start of the next round."""
        lo, hi = base
        if self.mean_duration_s is None:
            return (lo, hi)
        wait = min(cap_s, max(0.0, round_started_at + self.mean_duration_s - now))
        return (lo + wait, hi + wait)
