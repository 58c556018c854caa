"""Where a runtime's sessions read and spend time and memory: ``RuntimeEnvironment``.

On a phone these are the system's own (the wall clock, real sleeps, the process's resident
memory); a simulation on virtual time hands the runtime its models instead, all in one object,
as Federated Compute's client takes a ``SimpleTaskEnvironment``. The app's own settings (its
population, server, stores, policies) stay ``FLRuntime``'s arguments."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .errors import InvalidSetting, check_number
from .opstats import rss_mb
from .plan import Plan
from .plan_cache import LoadedPlans


class WorkMeter(Protocol):
    """Hears of every batch the plan trained on, once it is done: where a simulation charges
    the device's compute time to its virtual clock (a device's real training takes its own time).
    ``settle`` is called once training ends, however it ends, before the session does anything
    else: a meter that kept the time to itself while the batches ran spends it then."""

    def trained(self, plan: Plan, examples: int) -> None: ...

    def settle(self) -> None: ...


@dataclass(frozen=True)
class RuntimeEnvironment:
    """``clock`` (unix seconds) and ``sleep`` are where a session reads and spends time (the
    protocol's retries and backoff sleep through it); ``work_meter`` hears of every trained batch
    (a simulation charges its compute time to a virtual clock); ``memory_probe`` gives the
    resident memory in MB (the plan's memory budget is checked against it); ``loaded_plans``:
    parsed plans and their executors, which devices emulated in one process share (a runtime
    keeps its own when None). ``secagg_poll_s``: None on a device, whose Secure Aggregation waits
    in long polls the server holds; a runtime on a virtual clock sets it, and then polls without a
    held request and spends ``secagg_poll_s`` between polls through ``sleep`` (a server cannot hold
    a request for a time it does not share), longer while it waits for its group's other masked
    inputs (up to ``secure_client.IDLE_POLL_MAX_S``). ``report_update``: None on a device; a simulation's
    audit sets it on its canary devices, whose report is then ``report_update(plan, update)``
    instead of the trained update (the canary's direction, ``emulator.fleet.audit``), sent through
    the same protocol, plain or secure."""

    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    work_meter: WorkMeter | None = None
    memory_probe: Callable[[], float] = rss_mb
    loaded_plans: LoadedPlans | None = None
    secagg_poll_s: float | None = None
    report_update: Callable[[Plan, dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None

    def __repr__(self) -> str:
        # the fields given, functions by name: help(FLRuntime) showed the default's as
        # ``<function rss_mb at 0x7f...>`` and every field at its default, in the runtime's signature
        given = []
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if value is not spec.default:
                shown = getattr(value, "__qualname__", None) if callable(value) else None
                given.append(f"{spec.name}={shown or repr(value)}")
        return f"RuntimeEnvironment({', '.join(given)})"

    def __post_init__(self) -> None:
        """Settings of the wrong kind raise ``InvalidSetting`` here: a clock of ``SystemClock()``
        (where its ``now`` goes) failed at the first session with "object is not callable"."""
        for name, such in (
            ("clock", "time.time, or a Clock's now"),
            ("sleep", "time.sleep, or a Clock's sleep"),
            ("memory_probe", "of no arguments giving MB"),
            ("report_update", "or None"),
        ):
            value = getattr(self, name)
            if not callable(value) and not (name == "report_update" and value is None):
                raise InvalidSetting(
                    f"RuntimeEnvironment's {name} is a function ({such}), not {type(value).__name__} {value!r:.100}"
                )
        meter = self.work_meter
        if meter is not None and not all(callable(getattr(meter, m, None)) for m in ("trained", "settle")):
            raise InvalidSetting(
                f"work_meter {type(meter).__name__} needs trained(plan, examples) and settle() (see WorkMeter)"
            )
        if self.secagg_poll_s is not None:  # None: the server's long polls
            check_number("RuntimeEnvironment's secagg_poll_s", self.secagg_poll_s, positive=True)


#: The system's own clock, sleep and memory: what a runtime on a phone uses.
DEVICE_ENVIRONMENT = RuntimeEnvironment()
