"""The devices of a fleet: who they are, how fast, on what network, with which runtime, when
they are available, and how often they fail.

Every device draws from its own random stream, seeded from ``(fleet seed, device index)``: a
device's spec is the same whatever the fleet's size or the order devices are built in, and the
same seed gives the same population bit for bit.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from .availability import DeviceAvailability, model_availability
from .config import FleetConfig
from .trace_format import load_traces, never_available

FAULT_KINDS = ("app_killed", "network_lost", "conditions_changed")


def device_seed(seed: int, index: int, stream: str = "device") -> int:
    """A 64-bit seed for one device's ``stream``; independent of every other device's."""
    digest = hashlib.blake2b(f"fedfleet/{stream}/{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def device_id(index: int) -> str:
    return f"d{index:06d}"


@dataclass(frozen=True, slots=True)
class NetworkSpec:
    """``down_bps``/``up_bps`` in bits per second; ``latency_s`` one way."""

    name: str
    down_bps: float
    up_bps: float
    latency_s: float

    def download_s(self, nbytes: int) -> float:
        """Time to receive ``nbytes`` in one request: a round trip plus the transfer."""
        return 2.0 * self.latency_s + 8.0 * nbytes / self.down_bps

    def upload_s(self, nbytes: int) -> float:
        return 2.0 * self.latency_s + 8.0 * nbytes / self.up_bps


@dataclass(frozen=True, slots=True)
class DeviceFaults:
    """Hazard rates per hour of session time, and the chance a report is held back.

    See :class:`emulator.fleet.config.FaultSection` for what each fault means to a session."""

    app_killed_per_h: float
    network_lost_per_h: float
    conditions_change_per_h: float
    late_report_prob: float
    late_delay_s: float

    @property
    def total_per_h(self) -> float:
        return self.app_killed_per_h + self.network_lost_per_h + self.conditions_change_per_h

    def first_fault(self, rng: random.Random, within_s: float) -> tuple[str, float] | None:
        """The first of the three hazards to strike within ``within_s`` seconds of session
        time, as ``(kind, seconds after the start)``, or ``None`` if none does. Competing
        exponential clocks: one draw for the time, one for which hazard it was."""
        total = self.total_per_h
        if total <= 0.0:
            return None
        after = rng.expovariate(total / 3600.0)
        if after >= within_s:
            return None
        pick = rng.random() * total
        if pick < self.app_killed_per_h:
            return FAULT_KINDS[0], after
        if pick < self.app_killed_per_h + self.network_lost_per_h:
            return FAULT_KINDS[1], after
        return FAULT_KINDS[2], after

    def late_delay(self, rng: random.Random) -> float:
        """Extra seconds this session's report is held back (0.0 for most sessions)."""
        if rng.random() < self.late_report_prob:
            return rng.expovariate(1.0 / self.late_delay_s) if self.late_delay_s > 0 else 0.0
        return 0.0

    def survival(self, session_s: float) -> float:
        """Probability a session of ``session_s`` seconds meets none of the hazards."""
        return math.exp(-self.total_per_h * session_s / 3600.0)


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One device of the fleet. ``speed`` multiplies compute time (> 1 is slower);
    ``takes_part`` is False below the fleet's memory floor (paper sec. 11: 2 GB): such a device
    is in the fleet but never runs the FL runtime. ``seed`` seeds the device's own streams."""

    device_id: str
    index: int
    utc_offset_h: float
    start_utc_hour: float
    device_class: str
    speed: float
    memory_mb: int
    takes_part: bool
    network: NetworkSpec
    runtime_version: str
    availability: DeviceAvailability
    faults: DeviceFaults
    seed: int
    #: The audit's canary number (``emulator.fleet.audit``), -1 for an ordinary device.
    canary: int = -1

    def local_hour(self, t: float) -> float:
        """The device's local hour of the day (0-24) at simulated time ``t``."""
        return (self.start_utc_hour + self.utc_offset_h + t / 3600.0) % 24.0

    __hash__ = None  # type: ignore[assignment]  # its availability is mutable arrays


def _chooser(shares: Sequence[float]):
    cumulative = list(accumulate(shares))
    cumulative[-1] = math.inf  # shares sum to 1 within tolerance; never fall off the end

    def choose(u: float) -> int:
        return bisect.bisect_right(cumulative, u)

    return choose


def generate_population(config: FleetConfig, *, indices: Sequence[int] | range | None = None) -> list[DeviceSpec]:
    """The fleet's devices (all of them, or those at ``indices``, e.g. one shard's).

    If the config names an availability trace, devices take their conditions from it (devices
    the trace does not mention are never available); otherwise from the diurnal model. The whole
    fleet ends with the audit's canary devices (``canary_specs``), if the config asks for any."""
    fleet = config.fleet
    explicit_indices = indices
    indices = range(fleet.devices) if indices is None else indices
    zones = config.availability.time_zones
    classes = config.device_classes
    networks = config.network_classes
    versions = config.runtime_versions
    pick_zone = _chooser([z.share for z in zones])
    pick_class = _chooser([c.share for c in classes])
    pick_network = _chooser([n.share for n in networks])
    pick_version = _chooser([v.share for v in versions])
    faults_cfg = config.faults
    sigma = faults_cfg.device_sigma
    horizon_s = config.horizon_s
    traces = None
    if config.availability.trace is not None:
        traces = load_traces(
            config.availability.trace,
            devices=fleet.devices,
            battery=config.availability.battery,
            horizon_s=config.horizon_s,
        )
    out: list[DeviceSpec] = []
    for index in indices:
        if not 0 <= index < fleet.devices:
            raise IndexError(f"device index {index} is outside the fleet of {fleet.devices} devices")
        seed = device_seed(fleet.seed, index)
        rng = random.Random(seed)
        zone = zones[pick_zone(rng.random())]
        cls = classes[pick_class(rng.random())]
        net = networks[pick_network(rng.random())]
        version = versions[pick_version(rng.random())].version
        jitter_down = math.exp(rng.gauss(0.0, net.jitter_sigma)) if net.jitter_sigma else 1.0
        jitter_up = math.exp(rng.gauss(0.0, net.jitter_sigma)) if net.jitter_sigma else 1.0
        network = NetworkSpec(
            net.name, net.down_mbps * 1e6 * jitter_down, net.up_mbps * 1e6 * jitter_up, net.latency_ms / 1000.0
        )
        # Mean-one log-normal: exp(N(-sigma^2/2, sigma)).
        flaky = math.exp(rng.gauss(-0.5 * sigma * sigma, sigma)) if sigma else 1.0
        faults = DeviceFaults(
            faults_cfg.app_killed_per_h * flaky,
            faults_cfg.network_lost_per_h * flaky,
            faults_cfg.conditions_change_per_h * flaky,
            faults_cfg.late_report_prob,
            faults_cfg.late_delay_s,
        )
        did = device_id(index)
        if traces is not None:
            availability = traces.get(did) or never_available()
        else:
            # A separate stream: changing the availability model leaves the other draws alone.
            availability = model_availability(
                config.availability,
                random.Random(device_seed(fleet.seed, index, "availability")),
                utc_offset_h=zone.utc_offset_h,
                start_utc_hour=fleet.start_utc_hour,
                horizon_s=horizon_s,
            )
        out.append(
            DeviceSpec(
                device_id=did,
                index=index,
                utc_offset_h=zone.utc_offset_h,
                start_utc_hour=fleet.start_utc_hour,
                device_class=cls.name,
                speed=cls.speed,
                memory_mb=cls.memory_mb,
                takes_part=cls.memory_mb >= fleet.min_memory_mb,
                network=network,
                runtime_version=version,
                availability=availability,
                faults=faults,
                seed=seed,
            )
        )
    if explicit_indices is None:
        out.extend(canary_specs(config, out))
    return out


#: A canary device's id is this and its number (``canary0003``).
CANARY_PREFIX = "canary"


def canary_specs(config: FleetConfig, devices: Sequence[DeviceSpec]) -> list[DeviceSpec]:
    """The audit's ``dp.audit_canaries`` canary devices, after the fleet's own: canary k is a copy of
    an ordinary device spread over the fleet (its conditions, class, network and examples, so it
    takes part like any device) with an id and seed of its own (its own attested key)."""
    k_total = config.dp.audit_canaries
    taking_part = [d for d in devices if d.takes_part]
    if not k_total or not taking_part:
        return []
    return [
        dataclasses.replace(
            taking_part[k * len(taking_part) // k_total],
            device_id=f"{CANARY_PREFIX}{k:04d}",
            seed=device_seed(config.fleet.seed, k, "canary"),
            canary=k,
        )
        for k in range(k_total)
    ]
