"""What a simulated device sees of the simulation around it: ``DeviceWorld``.

``SimDevice`` is written against this protocol, not against ``FleetSimulator``, so the device
module does not depend on the module that builds and drives the fleet (which depends on it);
``FleetSimulator`` is one ``DeviceWorld``, and a test may hand a device a smaller one."""

from __future__ import annotations

from typing import Any, Protocol

from .events import EventLoop, Fibers
from .secure_fleet import FleetAttestation
from .sim_transport import AsgiCaller, HttpCaller
from .tables import SessionRow


class DeviceWorld(Protocol):
    """The clock and loop a device runs on, the server it talks to, what it trains, and where
    it reports what happened to it."""

    loop: EventLoop
    fibers: Fibers
    #: unix seconds at the run's time 0, and the run's length in seconds
    epoch: float
    horizon_s: float
    population: str
    server_url: str
    caller: AsgiCaller | HttpCaller
    #: the collection the devices' examples go to (the plan's selector reads it)
    collection_uri: str
    #: plan id -> the plan's bytes, as the server serves them (the devices' plan cache reads it)
    plan_bytes: dict[str, bytes]
    #: the executors the devices share, by plan and release (``LoadedPlans`` or ``ReleasePlans``)
    loaded_plans: Any
    max_training_s: float
    #: a secure task's attestation authority and trust anchor, or None
    attestation: FleetAttestation | None

    def examples(self, spec: Any) -> Any:
        """The examples of the device ``spec`` (see ``LazyExampleStore``)."""
        ...

    def seconds_per_example(self, plan: Any) -> float:
        """Simulated seconds of one example for one epoch of ``plan`` on the reference phone."""
        ...

    def canary_report(self, canary: int) -> Any:
        """What the audit's canary number ``canary`` reports instead of its trained update: a
        ``RuntimeEnvironment.report_update`` (see ``emulator.fleet.audit``)."""
        ...

    def set_status(self, device: Any, status: str) -> None: ...

    def add_session(self, row: SessionRow) -> None: ...

    def count_error(self, kind: str) -> None: ...
