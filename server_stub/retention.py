"""How much of each task's round history a running server keeps (``fedfleet server --keep-rounds N
--keep-days D``): a server that runs for months would otherwise keep every round's record (about
2 KB) and every committed round's model for ever. ``FLService.apply_retention`` removes, in small
transactions while the server serves, the records beyond the newest ``keep_rounds`` of each task and
those that ended more than ``keep_days`` ago, and the models nothing names any more; what a task
needs to go on (its last committed round, its newest record, a DP task's rounds that spent privacy)
is never removed, and what was removed is counted (``ServerStore.prune_rounds``). A removed round
still named by a page's cursor pages on from where it was (``removed_rounds``, kept a day); late
reports of a removed round are logged once (how many), not written."""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Seconds (on the service's clock) between retention passes of a serving server; the first pass
#: comes at the first tick.
RETENTION_EVERY_S = 60.0
#: Round records one transaction removes at most: the commits that wait for the database's write
#: lock wait for one batch, not for a whole history a first pass removes.
RETENTION_BATCH = 500
#: Seconds a checkpoint nothing names is kept after it was stored: a task being deployed or
#: activated stores what its devices are sent before the service lists it among its live models.
RESOURCE_GRACE_S = 60.0
#: The most days ``keep_days`` may say (as ``fedfleet prune --older-than-days``).
MAX_DAYS = 100_000.0


class RetentionError(ValueError):
    """A retention setting out of range; the message names the option and its range."""


@dataclass(frozen=True)
class Retention:
    """``keep_rounds``: each task's newest so many round records (each attempt is one) are kept;
    ``keep_days``: records that ended within so many days are kept. A record goes when either says
    so; None keeps what it would remove (both None: every record is kept)."""

    keep_rounds: int | None = None
    keep_days: float | None = None

    def __post_init__(self) -> None:
        if self.keep_rounds is not None and (isinstance(self.keep_rounds, bool) or not 1 <= self.keep_rounds):
            raise RetentionError(f"--keep-rounds must be a whole number of at least 1 (got {self.keep_rounds})")
        if self.keep_days is not None and not (math.isfinite(self.keep_days) and 0.0 < self.keep_days <= MAX_DAYS):
            raise RetentionError(
                f"--keep-days must be a number of days above 0, at most {MAX_DAYS:g} (got {self.keep_days})"
            )

    @property
    def keeps_everything(self) -> bool:
        return self.keep_rounds is None and self.keep_days is None

    def ended_before(self, wall_now: float) -> float | None:
        """The end (unix seconds) before which a record is past ``keep_days``, or None."""
        return None if self.keep_days is None else wall_now - self.keep_days * 86_400.0

    def describe(self) -> str:
        """One line for the server's banner."""
        if self.keeps_everything:
            return "every round record (--keep-rounds, --keep-days)"
        limits = []
        if self.keep_rounds is not None:
            limits.append(f"the newest {self.keep_rounds} round record(s) of each task")
        if self.keep_days is not None:
            limits.append(
                f"none older than {self.keep_days:g} day(s)"
                if limits
                else f"the round records of the last {self.keep_days:g} day(s)"
            )
        return f"{', '.join(limits)}, checked every {RETENTION_EVERY_S:g} s"
