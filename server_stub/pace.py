"""Pace steering (paper, section 2.3): the window a rejected device is told to come back in.

Stateless and probabilistic on the device side: the server names a window, the device draws its
return uniformly in it. Two parts: ``CheckinPace`` sizes the window to the population (a large
population is spread out so that check-ins arrive at about the rate its rounds need, not as fast
as the task's own retry window would bring them), and ``RoundPace`` shifts it to when the next
round is expected to open, so that in a small population the devices turned away come back
together."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class RoundPace:
    """An exponentially weighted mean of how long rounds of one task take."""

    mean_duration_s: float | None = None
    weight: float = 0.3
    #: the part of a round after its selection closed: how fast rounds can go when check-ins
    #: fill them at once (the whole duration would feed back: paced slower, rounds last longer)
    mean_reporting_s: float | None = None

    def observe(self, duration_s: float, reporting_s: float | None = None) -> None:
        if self.mean_duration_s is None:
            self.mean_duration_s = duration_s
        else:
            self.mean_duration_s += self.weight * (duration_s - self.mean_duration_s)
        if reporting_s is not None:
            if self.mean_reporting_s is None:
                self.mean_reporting_s = reporting_s
            else:
                self.mean_reporting_s += self.weight * (reporting_s - self.mean_reporting_s)

    def retry_window(self, now: float, round_started_at: float, base: tuple[float, float], cap_s: float) -> tuple[float, float]:
        """``base`` = (min, max) spread; the window is shifted to the expected start of the next round."""
        lo, hi = base
        if self.mean_duration_s is None:
            return (lo, hi)
        wait = min(cap_s, max(0.0, round_started_at + self.mean_duration_s - now))
        return (lo + wait, hi + wait)


#: How long the check-in rate estimate remembers (seconds): long enough to average over the
#: returns of devices told to wait, short enough to follow the diurnal swing (paper, Fig. 5).
RATE_MEMORY_S = 1800.0
#: Check-ins asked for per seat of a round: some of those who come are turned away because the
#: round filled, and a round that cannot fill waits for its selection timeout.
SEATS_MARGIN = 1.5
#: The longest mean wait a window is stretched to: a population far larger than its rounds
#: need checks in about once a day, not more.
MAX_WAIT_S = 86_400.0
#: Below this many devices per seat the population is not stretched at all: the rounds need most
#: of it, and spreading rejected devices while participants come straight back would select the
#: same few devices round after round.
MIN_DEVICES_PER_SEAT = 4.0


@dataclass
class CheckinPace:
    """How many devices are checking in, and how far to spread them (paper, section 2.3).

    The server sees only check-ins; by Little's law the devices cycling through check-in and
    rejection number about ``rate * mean wait`` (the rate they arrive at times the mean wait they
    were told). Rounds need ``SEATS_MARGIN * seats`` check-ins per round, so a rejected device is
    told to come back after ``population / needed rate``: the task's retry window stretched by
    that factor (never shrunk below it). A population that grows at the day's peak is spread
    thinner, one that shrinks at night is called back sooner, and a small population (or one the
    rounds need all of) keeps the task's own window. No per-device state: the device draws its
    return time uniformly in the window it is given."""

    memory_s: float = RATE_MEMORY_S
    margin: float = SEATS_MARGIN
    max_wait_s: float = MAX_WAIT_S
    _weight: float = 0.0  # check-ins, each decaying with exp(-age / memory_s)
    _seen_for: float = 0.0  # decayed span of time observed, so a young estimate is not biased low
    _last: float | None = None
    _first: float | None = None
    mean_wait_s: float | None = None  # what the devices now away were told
    _told_at: float = 0.0

    def _decay_to(self, now: float) -> None:
        if self._last is None:
            self._first = self._last = now
            return
        dt = max(0.0, now - self._last)
        if dt > 0.0:
            keep = math.exp(-dt / self.memory_s)
            self._weight *= keep
            self._seen_for = self._seen_for * keep + self.memory_s * (1.0 - keep)
            self._last = now

    def observe_checkin(self, now: float) -> None:
        self._decay_to(now)
        self._weight += 1.0

    @property
    def rate(self) -> float:
        """Check-ins per second over the recent past (0 until time has passed)."""
        return self._weight / self._seen_for if self._seen_for > 0.0 else 0.0

    def population(self) -> float:
        """Devices estimated to be cycling through check-ins (0 without history). Until a whole
        wait has passed the devices seen are new ones, not returns: the estimate counts no more
        than those that came."""
        seen_s = (self._last - self._first) if self._last is not None and self._first is not None else 0.0
        return self.rate * min(self.mean_wait_s or 0.0, seen_s)

    def stretch(self, base_wait_s: float, seats: int, round_s: float) -> float:
        """The factor a window whose mean wait is ``base_wait_s`` is stretched by, at least 1
        and at most what makes the mean wait ``max_wait_s``. Rounds of ``seats`` devices that
        report for ``round_s`` need ``margin * seats / round_s`` check-ins per second (the
        reporting time, not the whole round: a round paced slower selects slower and would ask
        for slower pacing still), and the population comes back at that rate when told to wait
        ``population / needed`` seconds."""
        if seats <= 0 or round_s <= 0.0 or base_wait_s <= 0.0 or self.mean_wait_s is None:
            return 1.0
        population = self.population()
        if population < MIN_DEVICES_PER_SEAT * seats:
            return 1.0
        needed = self.margin * seats / round_s
        return max(1.0, min(self.max_wait_s, population / needed) / base_wait_s)

    def window(self, now: float, base: tuple[float, float], seats: int, round_s: float) -> tuple[float, float]:
        """The window to hand a rejected device: ``base`` stretched to the population's size."""
        lo, hi = base
        self._decay_to(now)
        k = self.stretch((lo + hi) / 2.0, seats, round_s)
        told = (lo + hi) / 2.0 * k
        # The devices arriving now were told their waits about one wait ago: the mean follows
        # what is told with a lag of one mean wait, or a rising wait would inflate the estimate
        # of the population and feed on itself.
        if self.mean_wait_s is None:
            self.mean_wait_s = told
        else:
            since = max(0.0, now - self._told_at)
            self.mean_wait_s += -math.expm1(-since / max(self.mean_wait_s, 1e-9)) * (told - self.mean_wait_s)
        self._told_at = now
        return (lo * k, hi * k)
