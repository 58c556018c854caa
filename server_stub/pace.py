"""Pace steering (paper, section 2.3): the window a rejected device is told to come back in.

Stateless and probabilistic on the device side: the server names a window, the device draws its
return uniformly in it. Two parts: ``CheckinPace`` sizes the window to the population (a large
population is spread out so that check-ins arrive at about the rate its rounds need, not as fast
as the task's own retry window would bring them), and ``RoundPace`` shifts it to when the next
round is expected to open. A population too small to fill a selection window of itself is
gathered instead (``Rendezvous``): its next selection opens once enough devices are expected, and
the devices turned away are told a window that starts as it opens, so that they come back together."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


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

    def retry_window(
        self, now: float, round_started_at: float, base: tuple[float, float], cap_s: float
    ) -> tuple[float, float]:
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


#: The share of a selection window the devices gathered for it are told to arrive in, when just
#: enough are expected: they fill the round in its first part, and stragglers still find it open.
RENDEZVOUS_SPREAD = 0.5
#: The share of the devices told to come to a selection that do, before one has been measured
#: (some stop being idle, charging or on an unmetered network before then, and come later).
FIRST_SHOW = 0.8
#: How much one rendezvous' measured show-up moves the estimate.
SHOW_WEIGHT = 0.3
#: Devices expected at a selection per seat before it opens: a round that fills only part of its
#: seats loses the drop-outs and late reports its over-selection was to absorb, and is abandoned.
RENDEZVOUS_MARGIN = 1.25
#: How long the estimate of check-ins that come of themselves remembers (seconds): shorter than
#: ``RATE_MEMORY_S``, so that a burst (a fleet starting, the night's first chargers) it no longer
#: sees stops promising a selection the devices that fill it.
NATURAL_MEMORY_S = 600.0
#: The shortest and longest time a deferred selection waits for its devices to gather, in
#: selection windows (1 and 10 minutes for the fleet's 5-minute window): a task of 10-second
#: windows gathers in seconds. Past the longest, the opening is planned again (those told come
#: and are told the next one), so that a rate misjudged low costs one wait, not an hour.
MIN_GATHER = 0.2
MAX_GATHER = 2.0
#: How many times in a row a selection is planned again before it opens with the devices that
#: came: a population that never gathers enough for its seats still trains, in rounds that may fail.
#: Each round opened short spends its devices' participation (they wait for their next job) for
#: nothing: at 3, 600 devices of the glyphs fleet committed 19 of 44 rounds in 2 hours, at 10 24 of
#: 30, with more sessions in committed rounds.
MAX_DEFERRALS = 10


@dataclass
class Rendezvous:
    """Pace steering for a small population (paper, section 2.3: "in the case of small device
    populations, pace steering is used to ensure that a sufficient number of devices connect to
    the server simultaneously").

    A population is small when the check-ins that come of themselves (``natural``: the devices'
    own cadence, not those answering a rendezvous) would bring fewer than ``RENDEZVOUS_MARGIN``
    times a round's seats within its selection window: a round opened on them times out with a few dozen devices and is abandoned,
    round after round, their training lost. Then the next selection opens only once enough
    devices are expected (``plan``), and every device turned away meanwhile is told to come back
    just as it opens (``tell``): the window starts at the opening and is sized to the arrivals
    needed. The server keeps counts only, no per-device state: how many it told to come to the
    next opening, and what share of those told to come to the last one did (some stop being
    available before then: they keep their own conditions and come later)."""

    natural: CheckinPace = field(default_factory=lambda: CheckinPace(memory_s=NATURAL_MEMORY_S))
    show: float = FIRST_SHOW
    aimed_at: float | None = None  # the opening the devices told so far are aimed at
    told: int = 0
    _aim_end: float = 0.0  # the latest end of a window told for it
    _last: tuple[float, float, int] | None = None  # (opening, window end, told) of the last rendezvous
    _arrived: int = 0  # check-ins in the last rendezvous' window

    def observe_checkin(self, now: float) -> None:
        """A check-in in the window of the last rendezvous answers it, up to as many as were told
        to come; any other came of itself."""
        last = self._last
        if last is not None and last[0] <= now <= last[1] and self._arrived < last[2]:
            self._arrived += 1
            self.natural._decay_to(now)  # time passes for the rate all the same
        else:
            self.natural.observe_checkin(now)

    def watch(self, now: float) -> None:
        """The server starts watching the population's check-ins at ``now`` (a selection opens),
        unless it already has: ``small`` counts the time watched from here, not from the first
        check-in, which comes a device's latency later. Counted from that check-in, a fleet whose
        first selection timed out short (opened at 0, its first device in at 1 s) had been watched
        for a second less than a selection window when it closed, and its second round opened at
        once and was abandoned too: 52 of 500 devices' participation spent for nothing."""
        if self.natural._first is None:
            self.natural._decay_to(now)

    def natural_arrivals(self, selection_s: float) -> float:
        """Check-ins expected of themselves within a selection window of ``selection_s``."""
        return self.natural.rate * selection_s

    def small(self, now: float, seats: int, selection_s: float) -> bool:
        """Whether a round opened now would rely on luck: the check-ins that come of themselves in
        its selection window fall short of ``RENDEZVOUS_MARGIN`` times its seats. Never before a
        whole selection window of check-ins was watched (from ``watch`` or the first check-in): a
        fresh server opens its rounds at once, and a handful of check-ins in a few seconds says
        nothing yet about the population."""
        self.natural._decay_to(now)
        first = self.natural._first
        return (
            first is not None
            and now >= first + selection_s  # as a selection's deadline is reckoned: no rounding short
            and self.natural._weight > 0.0
            and self.natural_arrivals(selection_s) < RENDEZVOUS_MARGIN * seats
        )

    def expected(self) -> float:
        """Devices expected at the opening those told so far are aimed at."""
        return self.told * self.show

    def tell(self, now: float, opens_at: float, seats: int, selection_s: float) -> tuple[float, float]:
        """The retry window of a device turned away while the next selection opens at
        ``opens_at``: it starts there, and is ``RENDEZVOUS_SPREAD`` of the selection window wide
        when just the seats are expected, wider (up to the whole window) when more are, so that
        those beyond the seats, who will be turned away again, do not all come at once."""
        if self.aimed_at != opens_at:
            self._close_aim()
            self.aimed_at, self.told = opens_at, 0
        self.told += 1
        lo, hi = rendezvous_window(now, opens_at, self.expected(), seats, selection_s)
        self._aim_end = max(self._aim_end, now + hi)
        return (lo, hi)

    def plan(self, now: float, seats: int, selection_s: float) -> float:
        """When the next selection opens, asked when a round closed or a deferred opening came:
        ``now`` if the devices told to come now and those expected of themselves reach
        ``RENDEZVOUS_MARGIN`` times the seats;
        otherwise once enough more are expected to have checked in (and been told to come then)."""
        needed = RENDEZVOUS_MARGIN * seats
        self.natural._decay_to(now)
        expected = self.expected() + self.natural_arrivals(selection_s)
        self._close_aim()
        if expected >= needed:
            return now
        return now + gather_s(needed - expected, self.natural.rate * self.show, selection_s)

    def _close_aim(self) -> None:
        """The devices told so far go to the last rendezvous, whose window measures how many come."""
        if self.aimed_at is None:
            return
        last = self._last
        if last is not None and last[2] > 0:
            seen = min(1.0, self._arrived / last[2])
            self.show += SHOW_WEIGHT * (seen - self.show)
        self._last = None
        if self.told > 0:
            self._last = (self.aimed_at, self._aim_end, self.told)
        self._arrived = 0
        self.aimed_at, self.told, self._aim_end = None, 0, 0.0


def rendezvous_window(
    now: float, opens_at: float, expected: float, seats: int, selection_s: float
) -> tuple[float, float]:
    """The window (seconds from ``now``) of a device told to come to a selection opening at
    ``opens_at`` with ``expected`` devices told so far, of ``seats``, in a window of ``selection_s``."""
    wait = max(0.0, opens_at - now)
    plenty = min(2.0, max(1.0, expected / seats)) if seats > 0 else 1.0
    return (wait, wait + RENDEZVOUS_SPREAD * selection_s * plenty)


def gather_s(missing: float, rate: float, selection_s: float) -> float:
    """How long ``missing`` devices take to check in at ``rate`` per second (and come when told),
    between ``MIN_GATHER`` and ``MAX_GATHER`` selection windows of ``selection_s``."""
    longest = MAX_GATHER * selection_s
    if rate <= 0.0:
        return longest
    return min(longest, max(MIN_GATHER * selection_s, missing / rate))
