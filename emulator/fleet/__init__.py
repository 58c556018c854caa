"""Fleet simulation: thousands of emulated devices on one virtual clock, and the report of a run.

``__all__`` holds what a fleet user calls; the event loop, fibers and simulated transport the
simulator runs on are imported from their modules (``events``, ``sim_transport``)."""

from .availability import (
    AVAILABLE,
    BATTERY_LOW,
    CHARGING,
    IDLE,
    UNMETERED,
    Availability,
    DeviceAvailability,
    count_available,
)
from .compare import FleetCompareError, write_compare
from .config import FleetConfig, FleetConfigError
from .data import device_examples, fleet_dataset
from .events import SimulationError
from .population import DeviceFaults, DeviceSpec, NetworkSpec, generate_population
from .ray_backend import RayBackendError, parse_sweep, run_many, simulate_sharded, sweep_configs
from .releases import ReleasedPlans, release_tested_plans
from .report import FleetReportError, summarize, write_report
from .secure_fleet import FleetAttestation
from .simulator import FleetSimulator, simulate
from .tables import FleetRun, FleetTableError, RoundRow, SessionRow, TimelineRow
from .traces import TraceAvailability, TraceError, load_traces, write_traces
from .workload import Workload, WorkloadError, load_workload

__all__ = [
    "FleetAttestation",
    "AVAILABLE",
    "Availability",
    "BATTERY_LOW",
    "CHARGING",
    "DeviceAvailability",
    "DeviceFaults",
    "DeviceSpec",
    "FleetConfig",
    "FleetConfigError",
    "IDLE",
    "NetworkSpec",
    "TraceAvailability",
    "TraceError",
    "UNMETERED",
    "count_available",
    "device_examples",
    "fleet_dataset",
    "generate_population",
    "load_traces",
    "write_traces",
    "ReleasedPlans",
    "release_tested_plans",
    "FleetReportError",
    "FleetCompareError",
    "write_compare",
    "FleetRun",
    "FleetTableError",
    "RoundRow",
    "SessionRow",
    "TimelineRow",
    "summarize",
    "write_report",
    "FleetSimulator",
    "SimulationError",
    "simulate",
    "RayBackendError",
    "parse_sweep",
    "run_many",
    "simulate_sharded",
    "sweep_configs",
    "Workload",
    "WorkloadError",
    "load_workload",
]
