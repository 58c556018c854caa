"""What a simulated fleet is: one declared, validated config, read from TOML, whose defaults are
calibrated to the paper (Bonawitz et al. 2019, "Towards Federated Learning at Scale").

Every number a fleet simulation draws from lives here, so that a run is fully described by its
config and seed. The defaults and where they come from:

- Availability (sec. 3, sec. 9, Fig. 5-6): the runtime trains only when the phone is idle,
  charging and on an unmetered network, which happens mostly at night in the device's own time
  zone; the paper saw a 4x swing between the day's low and high numbers of participating devices
  for a US-centric population. The defaults mix the four US time zones and add daytime top-up
  charges, so that the number of available devices swings 3-5x between peak and trough
  (``tests/emulator/fleet`` checks it); a round seats at most its goal times its over-selection,
  so participating devices follow the day only when the rounds wait for devices (a fleet of
  1,000 devices, not one of 10,000: ``docs/explanation/fidelity.md``).
- Device classes (sec. 11 "Bias"): only phones with at least 2 GB of memory take part.
- Faults (sec. 9, Appendix A, Fig. 7, Table 1): 6-10% of participants drop out (computation
  errors, network failures, changes in eligibility), and sessions end 75% ``-v[]+^``,
  22% ``-v[]+#`` (reported after the window closed), 2% ``-v[!`` (interrupted).
- The task (sec. 2.2, sec. 9): rounds of a few hundred devices at most; a goal of 100 with the
  server selecting 130% of it.
"""

from __future__ import annotations

import json
import math
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from device_runtime.versions import version_tuple
from server_stub.dp_config import MAX_DELTA, MAX_NOISE_MULTIPLIER, DPConfig
from server_stub.errors import did_you_mean, did_you_mean_path
from server_stub.rounds import MAX_TIMEOUT_S

#: Shares of a mixture must sum to one within this tolerance (TOML users write 0.1 + 0.2 ...).
SHARE_TOLERANCE = 1e-6

#: Paper sec. 11: "at least 2 GB of memory".
MIN_MEMORY_MB = 2048

#: The reference phone's sustained training rate in simulated FLOP/s: the default digits MLP's
#: work-graph FLOPs per example (64-32-10, batch 8: ``plan_cost``'s count), so that it costs
#: exactly one simulated second per example and epoch, as ``compute_s_per_example = 1.0`` did.
REFERENCE_FLOPS_PER_S = 10675.625

Share = Annotated[float, Field(gt=0.0, le=1.0)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Hour = Annotated[float, Field(ge=0.0, le=24.0)]
#: how long a daily window lasts: a night of more than a day would run into the next one
DayLength = Annotated[float, Field(gt=0.0, le=24.0)]
#: a spread or a lead in hours around a daily window: more than a day would move it past the next
#: day's (and a device's windows are drawn day by day over the span they reach: 1e9 hours took minutes)
Spread = Annotated[float, Field(ge=0.0, le=24.0)]
Rate = Annotated[float, Field(ge=0.0, le=1e6)]
NonNegative = Annotated[float, Field(ge=0.0, le=1e9)]
Positive = Annotated[float, Field(gt=0.0, le=1e9)]
#: The server's timeouts and retry windows: at most a week (``server_stub.rounds.MAX_TIMEOUT_S``).
Timeout = Annotated[float, Field(gt=0.0, le=MAX_TIMEOUT_S)]
Wait = Annotated[float, Field(ge=0.0, le=MAX_TIMEOUT_S)]
#: What a name (a device class's, a population's) may hold: it ends up in file names and URLs.
NAME_PATTERN = r"^[A-Za-z0-9_.+-]+$"
Name = Annotated[str, Field(min_length=1, max_length=64, pattern=NAME_PATTERN)]


class FleetConfigError(ValueError):
    """A fleet config that cannot describe a fleet; the message names the field and the fix."""


class _Section(BaseModel):
    """Strict: no unknown keys (a typo is an error, not a silent default), no NaN or infinity,
    no bools or strings for numbers, frozen so a run's config cannot change under it."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


def _check_shares(items: list[Any], field: str) -> None:
    total = math.fsum(item.share for item in items)
    if abs(total - 1.0) > SHARE_TOLERANCE:
        raise ValueError(f"the shares of {field} sum to {total:.6g}; make them sum to 1")
    names = [getattr(item, "name", None) for item in items]
    if None not in names and len(set(names)) != len(names):
        raise ValueError(f"{field} names must be unique; got {names}")


class FleetSection(_Section):
    """Size, length and seed of the run. Simulated time 0 falls at ``start_utc_hour`` of a UTC day."""

    devices: int = Field(10_000, ge=1, le=10_000_000)
    hours: float = Field(24.0, gt=0.0, le=24.0 * 366)
    seed: int = Field(0, ge=0, lt=2**63)
    start_utc_hour: float = Field(0.0, ge=0.0, lt=24.0)
    #: Paper sec. 11: the device code is deployed only to phones with at least 2 GB of memory.
    min_memory_mb: int = Field(MIN_MEMORY_MB, ge=0, le=1_048_576)
    #: Paper sec. 7.3: each device trains its release's versioned plan on that real onnxruntime
    #: release (one worker process per release, see ``emulator.fleet.releases``); off, every device
    #: trains the one plan on this interpreter's onnxruntime.
    real_runtimes: bool = False


class TimeZone(_Section):
    utc_offset_h: float = Field(ge=-12.0, le=14.0)
    share: Share


def _us_time_zones() -> list[TimeZone]:
    # Paper Appendix A: "primarily from the same time zone"; sec. 9: "US-centric". Shares
    # roughly follow the US population by zone (Eastern, Central, Mountain, Pacific).
    return [
        TimeZone(utc_offset_h=-5.0, share=0.47),
        TimeZone(utc_offset_h=-6.0, share=0.29),
        TimeZone(utc_offset_h=-7.0, share=0.07),
        TimeZone(utc_offset_h=-8.0, share=0.17),
    ]


class NightWindow(_Section):
    """The night: the phone lies idle on its charger, at home on Wi-Fi (paper sec. 3, Fig. 5).

    A device has its habitual bedtime (``start_h`` plus a per-device offset drawn once with
    ``start_device_sd_h``), and each night starts near it (``start_daily_sd_h``) and lasts
    ``duration_h`` (``duration_sd_h``). With ``probability`` a night has such a window at all
    (some nights the phone is not charged). Only ``home_wifi_share`` of devices have an
    unmetered network at home; theirs is up from ``wifi_before_h`` before the night starts to
    ``wifi_after_h`` after it ends."""

    probability: Probability = 0.85
    start_h: Hour = 23.0
    start_device_sd_h: Spread = 1.5
    start_daily_sd_h: Spread = 0.5
    duration_h: DayLength = 7.0
    duration_sd_h: Spread = 1.0
    min_duration_h: Annotated[float, Field(ge=0.0, le=24.0)] = 1.0
    home_wifi_share: Probability = 0.85
    wifi_before_h: Spread = 3.0
    wifi_after_h: Spread = 0.75


class DayCharging(_Section):
    """Top-up charges during the day (at a desk, in a car): a Poisson process of
    ``sessions_per_day`` between ``from_h`` and ``to_h`` local time, each lasting an exponential
    time of mean ``mean_duration_h``; a charge is on an unmetered network with
    ``unmetered_prob`` and left idle with ``idle_prob``. They keep the day's trough at about a
    quarter of the night's peak (paper sec. 9: a 4x swing of participating devices) instead of none: with the defaults the
    available devices of a day swing 4.1-4.2x (10,000 devices, seeds 0 and 1, sampled every
    5 minutes), peaking at about 60% of the fleet in the US night."""

    sessions_per_day: Annotated[float, Field(ge=0.0, le=1440.0)] = 3.5  # at most one a minute
    from_h: Hour = 7.0
    to_h: Hour = 22.0
    mean_duration_h: DayLength = 1.5
    unmetered_prob: Probability = 0.75
    idle_prob: Probability = 0.7

    @model_validator(mode="after")
    def _window(self) -> Self:
        if self.from_h > self.to_h:
            raise ValueError(f"from_h ({self.from_h}) must not be after to_h ({self.to_h})")
        return self


class ScreenOn(_Section):
    """The user picks up an idle phone: a Poisson process of ``per_hour`` interruptions while
    the phone would be idle, each lasting an exponential time of mean ``mean_minutes``. The
    runtime must abort then (paper sec. 3): the source of ``-v[!`` sessions (Table 1)."""

    per_hour: Annotated[float, Field(ge=0.0, le=60.0)] = 0.2  # at most one a minute
    mean_minutes: Positive = 3.0


class Battery(_Section):
    """Battery level: drawn uniformly in [``start_min``, ``start_max``] at time 0, rising while
    charging, draining slowly while idle and faster while in use, never below ``floor``."""

    start_min: Probability = 0.3
    start_max: Probability = 1.0
    charge_per_hour: Rate = 0.45
    idle_drain_per_hour: Rate = 0.01
    active_drain_per_hour: Rate = 0.07
    floor: Probability = 0.02

    @model_validator(mode="after")
    def _range(self) -> Self:
        if self.start_min > self.start_max:
            raise ValueError(f"start_min ({self.start_min}) must not exceed start_max ({self.start_max})")
        return self


class AvailabilitySection(_Section):
    """When each device is idle, charging and on an unmetered network. ``trace`` replaces the
    model with a recorded CSV (format in ``emulator.fleet.traces``); a relative path is read
    relative to the config file it came from."""

    time_zones: list[TimeZone] = Field(default_factory=_us_time_zones, min_length=1)
    night: NightWindow = NightWindow()
    day: DayCharging = DayCharging()
    screen_on: ScreenOn = ScreenOn()
    battery: Battery = Battery()
    trace: str | None = None

    @model_validator(mode="after")
    def _shares(self) -> Self:
        _check_shares(self.time_zones, "availability.time_zones")
        return self


class DeviceClass(_Section):
    """``speed`` multiplies compute time (> 1 is slower than the reference phone). ``memory_mb``
    is what the device gives a plan: a class below ``fleet.min_memory_mb`` never runs the FL
    runtime, and one whose memory cannot hold every plan the fleet serves (each training and
    evaluation task's: its peak estimate, or one batch in the eighth of its memory a device gives
    examples, ``PlanCost.fits``) does not take part in that run; the summary counts those devices as ``devices_short_of_memory``."""

    name: Name
    share: Share
    speed: float = Field(gt=0.0, le=1000.0)
    memory_mb: int = Field(ge=1, le=1_048_576)


def _device_classes() -> list[DeviceClass]:
    # The "entry" class is below the paper's 2 GB floor (sec. 11) and never takes part.
    return [
        DeviceClass(name="entry", share=0.08, speed=2.5, memory_mb=1536),
        DeviceClass(name="low", share=0.22, speed=1.8, memory_mb=2048),
        DeviceClass(name="mid", share=0.40, speed=1.25, memory_mb=4096),
        DeviceClass(name="high", share=0.22, speed=1.0, memory_mb=6144),
        DeviceClass(name="flagship", share=0.08, speed=0.7, memory_mb=8192),
    ]


class NetworkClass(_Section):
    """An unmetered network (training needs one, paper sec. 3): bandwidth in megabits per second,
    one-way latency in milliseconds. Each device's bandwidth varies around its class's by a
    log-normal factor of sigma ``jitter_sigma``."""

    name: Name
    share: Share
    down_mbps: float = Field(gt=0.0, le=1e5)
    up_mbps: float = Field(gt=0.0, le=1e5)
    latency_ms: float = Field(ge=0.0, le=60_000.0)
    jitter_sigma: float = Field(0.3, ge=0.0, le=3.0)


def _network_classes() -> list[NetworkClass]:
    # Home Wi-Fi upload is a fraction of download. Paper Fig. 9's asymmetry is in the bytes, and small
    # here: a device keeps its plan in its plan cache and uploads its update uncompressed, so a
    # completed session moves about as many bytes up as down (docs/explanation/fidelity.md).
    return [
        NetworkClass(name="wifi-slow", share=0.25, down_mbps=5.0, up_mbps=1.0, latency_ms=60.0),
        NetworkClass(name="wifi", share=0.50, down_mbps=30.0, up_mbps=8.0, latency_ms=25.0),
        NetworkClass(name="wifi-fast", share=0.25, down_mbps=150.0, up_mbps=40.0, latency_ms=10.0),
    ]


class RuntimeVersion(_Section):
    version: str = Field(min_length=1, max_length=32)
    share: Share

    @model_validator(mode="after")
    def _parse(self) -> Self:
        version_tuple(self.version)  # raises ValueError naming the bad string
        return self


def _runtime_versions() -> list[RuntimeVersion]:
    # A fleet runs old releases for months (paper sec. 7.3: versioned plans per runtime release).
    return [
        RuntimeVersion(version="1.31.1", share=0.40),
        RuntimeVersion(version="1.28.0", share=0.20),
        RuntimeVersion(version="1.23.2", share=0.15),
        RuntimeVersion(version="1.22.1", share=0.10),
        RuntimeVersion(version="1.20.1", share=0.10),
        RuntimeVersion(version="1.17.3", share=0.05),
    ]


class FaultSection(_Section):
    """Faults as hazards: rates per hour of session time (from check-in to the end of the
    report), so a session of length T survives a hazard of rate r with probability exp(-r T).

    - ``app_killed_per_h``: the OS kills the app; the device vanishes without a word (an
      abandoned session, the server's deadline reclaims it);
    - ``network_lost_per_h``: the connection drops; the request in flight fails;
    - ``conditions_change_per_h``: the device stops being idle/charging/unmetered for a reason
      the availability model does not draw; the runtime's abort path runs (``-v[!``);
    - ``late_report_prob``: the session is a straggler; its report is held back by an extra
      exponential delay of mean ``late_delay_s``, usually past the window (``-v[]+#``).

    Each device scales all its hazards by its own factor, log-normal with sigma
    ``device_sigma`` and mean 1 (some phones are flakier).

    Defaults (paper sec. 9: 6-10% of participants drop out; Table 1: 75% ``-v[]+^``, 22%
    ``-v[]+#``, 2% ``-v[!``): the hazards sum to 1.25/h, which over the couple of minutes a
    session is exposed gives about 4% drop-out; screen-on interruptions and the end of a charge
    (the availability model) add about 3%. Measured with the fleet simulator over a day:

    - 10,000 devices, seed 0: drop-out 7.4%; shapes 72.2% ``-v[]+^``, 20.4% ``-v[]+#``,
      4.9% ``-v[!``; 275 of the 278 rounds that closed committed, 235 of them on their reporting
      window with fewer than 100 reports; 6.6% of sessions starting between 00:00 and 06:00 local
      time dropped out, 8.0% between 06:00 and 18:00 and 7.0% in the evening;
    - 3,000 devices, seed 3: drop-out 7.4%, 6.6% of sessions starting between 00:00 and 06:00
      local time, 8.3% between 06:00 and 18:00 and 7.6% in the evening: higher by day as in
      Appendix A (Fig. 7), because daytime charges are short; 152 of 153 rounds committed, and
      21.1% of sessions reported to a closed round (``-v[]+#``).

    ``#`` is what a round's 130% over-selection leaves over (Appendix A, Fig. 7): the sessions
    that neither dropped out nor reported before the round closed, on its goal or on its
    reporting window (``TaskSection.report_timeout_s``); stragglers and abandoned rounds add to
    it.
    """

    app_killed_per_h: Rate = 0.45
    network_lost_per_h: Rate = 0.5
    conditions_change_per_h: Rate = 0.3
    late_report_prob: Probability = 0.08
    late_delay_s: NonNegative = 600.0
    device_sigma: float = Field(0.5, ge=0.0, le=3.0)


class DataSection(_Section):
    """Each device's examples: a non-IID sample of ``dataset``'s training split. A device's label
    mix is drawn from a Dirichlet of concentration ``label_alpha`` over the classes (small:
    a few classes per device, as in McMahan et al.'s shards); its example count is log-normal
    with median ``examples_median`` and sigma ``examples_sigma``, clipped to
    [``examples_min``, ``examples_max``]. Devices sample the split independently, so any number
    of devices can be served by a small dataset."""

    dataset: Literal["digits"] = "digits"
    #: A federated dataset instead (``emulator.fleet.federated_data``): ``format`` is one of the data
    #: spec's (``leaf``, ``tff-h5``, ``table``, ``npz``, ``digits``), ``path`` its file or folder
    #: (relative to the config file's folder), ``options`` the spec's options (``client`` for a
    #: table, ``partition``/``clients`` for npz and digits, ``test_split``, ...). Each client of its
    #: training split is then a device's examples (see ``emulator.fleet.data``), and the keys below
    #: but ``test_fraction`` apply only to the default sampling.
    format: Literal["leaf", "tff-h5", "table", "npz", "digits"] | None = None
    path: str | None = Field(None, min_length=1, max_length=4096)
    options: dict[Annotated[str, Field(min_length=1, max_length=64)], str | int | float] = Field(
        default_factory=dict, max_length=32
    )
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    label_alpha: float = Field(0.3, gt=0.0, le=1e4)
    examples_median: int = Field(40, ge=1, le=1_000_000)
    examples_sigma: float = Field(0.6, ge=0.0, le=5.0)
    examples_min: int = Field(8, ge=1, le=1_000_000)
    examples_max: int = Field(400, ge=1, le=1_000_000)

    @field_validator("options", mode="before")
    @classmethod
    def _switches(cls, options: Any) -> Any:
        """TOML's ``true``/``false`` for the spec's yes/no options (``header = false``, ``lazy = true``)."""
        if isinstance(options, dict):
            return {k: ("yes" if v else "no") if isinstance(v, bool) else v for k, v in options.items()}
        return options

    @model_validator(mode="after")
    def _bounds(self) -> Self:
        if self.format is None and (self.path is not None or self.options):
            raise ValueError("data.path and data.options need data.format (leaf, tff-h5, table, npz or digits)")
        if self.format is not None and self.format != "digits" and self.path is None:
            raise ValueError(f"data.format = {self.format!r} needs data.path, the file or folder to read")
        if not self.examples_min <= self.examples_median <= self.examples_max:
            raise ValueError(
                f"need examples_min <= examples_median <= examples_max; got "
                f"{self.examples_min}, {self.examples_median}, {self.examples_max}"
            )
        return self


class TaskSection(_Section):
    """The FL task the fleet runs (paper sec. 2.2 and 9): a round goal of 100 (a few hundred
    devices at most are enough), 130% over-selection to absorb 6-10% drop-out and stragglers,
    a selection timeout, and a reporting window that caps device participation time (Fig. 8).
    The window, ``report_timeout_s``, is 3 minutes from a device's check-in (the paper's rounds take
    2-3 minutes, sec. 8): long enough that most rounds reach their goal, short enough that some
    close on it with the slowest devices still training, which is where Table 1's 75/22 split comes
    from (a round that always made its goal of 100 out of 130 would accept 1/1.3 = 77% of its
    sessions, and reject only the 23% its drop-outs left). Pace steering (sec. 2.3): a device that
    is not selected is told to come back at a random time in [``retry_min_s``, ``retry_max_s``],
    which spreads check-ins instead of a thundering herd;
    with 10,000 devices the defaults bring about 1-5 check-ins per second, trough to peak.

    A session's compute time follows the plan (``emulator.fleet.plan_cost``): each example of
    each epoch costs the work graph's FLOPs per example over ``reference_flops_per_s``, the
    sustained training rate of the reference phone (speed 1.0), times the device class's
    ``speed``. The default rate is the default digits MLP's FLOPs per example
    (``REFERENCE_FLOPS_PER_S``), so that model trains one example per simulated second as it
    always did here: it stands for the paper's production models, whose sessions last minutes
    (Fig. 8), where the 2,410-parameter model itself trains in microseconds on a real phone. A
    bigger model costs proportionally more (hidden ``[1024]``: 32x; a million parameters: about
    630x, hours per session, far past the 3-minute window); to study a real model at a real
    phone's pace, set ``reference_flops_per_s`` to one (a mid-range phone sustains about 1e9 to
    1e10 FLOP/s of fp32 training on its CPU). ``compute_s_per_example``, when set, overrides the
    plan's cost with that many simulated seconds per example and epoch, whatever the model."""

    population: Name = "digits"
    goal_count: int = Field(100, ge=1, le=1_000_000)
    over_selection: float = Field(1.3, ge=1.0, le=100.0)
    min_fraction: float = Field(0.8, gt=0.0, le=1.0)
    selection_timeout_s: Timeout = 300.0
    report_timeout_s: Timeout = 180.0
    retry_min_s: Wait = 600.0
    retry_max_s: Wait = 1800.0
    hidden: list[Annotated[int, Field(ge=1, le=4096)]] = Field(default_factory=lambda: [32], max_length=8)
    learning_rate: Positive = 0.3
    batch_size: int = Field(8, ge=1, le=100_000)
    epochs: int = Field(2, ge=1, le=1000)
    compute_s_per_example: NonNegative | None = None
    reference_flops_per_s: Positive = REFERENCE_FLOPS_PER_S
    secure: bool = False
    #: With ``secure``: groups of at least this many attested devices (the devices' own floor is 5),
    #: and how long each key round waits for a group's messages (covers a poll and a round trip).
    secagg_group_size: int = Field(5, ge=2, le=100_000)
    secagg_round_timeout_s: Timeout = 10.0
    #: With ``secure``: how many devices a round's groups take when it has them (each group one
    #: Aggregator; its key rounds cost each member a key agreement per peer), never fewer than
    #: ``secagg_group_size`` + 1.
    secagg_target_group_size: int = Field(100, ge=2, le=100_000)
    max_rounds: int | None = Field(None, ge=1)
    #: A task file (``fedfleet plan build``'s input, relative to the config file's folder): the fleet
    #: builds and deploys its tasks instead of the built-in digits MLP (``emulator/fleet/digits_task.py``).
    #: See :data:`ROUND_KEYS` and :data:`BUILT_IN_KEYS` for what the keys above then mean.
    file: str | None = Field(None, min_length=1, max_length=4096)
    #: The summary's ``time_to_target_accuracy_s``: simulated seconds to the end of the first committed
    #: round whose model's test accuracy is at least this.
    target_accuracy: float | None = Field(None, ge=0.0, le=1.0)
    #: How the tasks of a task file with several training tasks (a task group) share the rounds:
    #: ``alternate`` (take turns, what ``fedfleet deploy`` asks for) or ``weighted``.
    strategy: Literal["alternate", "weighted"] = "alternate"

    @property
    def explicit(self) -> frozenset[str]:
        """The keys the fleet file, ``--goal`` or a ``--sweep`` set (not left at their defaults)."""
        return frozenset(self.model_fields_set)

    @model_validator(mode="after")
    def _retry(self) -> Self:
        if self.retry_min_s > self.retry_max_s:
            raise ValueError(f"retry_min_s ({self.retry_min_s}) must not exceed retry_max_s ({self.retry_max_s})")
        return self


class DPSection(_Section):
    """Differential privacy for the fleet's training tasks (``server_stub.dp_config.DPConfig``, which
    says what each field means and what the guarantee assumes). ``mode``: None (the default) runs
    no DP, or the task file's own ``RoundConfig.dp``; ``central`` (the server adds Gaussian noise
    of std ``noise_multiplier`` x ``clip`` to the sum of clipped updates) or ``distributed`` (each
    device adds its share of discrete noise under Secure Aggregation: needs ``task.secure``, or a
    task file of secure tasks). Set, it replaces every training task's DP settings. ``clip``: each
    device's update (weights after minus before, L2) is clipped to it; ``delta``: the delta epsilon is
    reported at; ``max_epsilon``: the task completes before a round would take it past this;
    ``tree_rounds`` (central): DP-FTRL, each tree of this many rounds noised by tree aggregation;
    ``counts`` (central): ``withheld`` keeps the rounds' counts out of what the server publishes.

    ``audit_canaries``: K canary devices join the fleet for the one-shot privacy audit
    (``emulator.fleet.audit``): each reports, whenever selected, its random direction scaled to the
    clip; the summary's ``audit_epsilon`` is the estimate from the final model. Needs DP on."""

    mode: Literal["central", "distributed"] | None = None
    noise_multiplier: float = Field(1.0, ge=0.0, le=MAX_NOISE_MULTIPLIER)
    clip: float = Field(1.0, gt=0.0, le=1e6)
    delta: float = Field(1e-5, gt=0.0, le=MAX_DELTA)
    max_epsilon: float | None = Field(None, gt=0.0, le=1e6)
    tree_rounds: int | None = Field(None, ge=1, le=1 << 20)
    counts: Literal["public", "withheld"] = "public"
    audit_canaries: int = Field(0, ge=0, le=10_000)

    @model_validator(mode="after")
    def _needs_mode(self) -> Self:
        fields = type(self).model_fields
        loose = sorted(  # set to other than its default (a written-out config holds every default)
            k for k in self.model_fields_set - {"mode", "audit_canaries"} if getattr(self, k) != fields[k].default
        )
        if self.mode is None and loose:
            raise ValueError(
                f"{', '.join(f'dp.{k}' for k in loose)} {'needs' if len(loose) == 1 else 'need'} dp.mode "
                "(central or distributed; --dp) to mean anything"
            )
        try:  # what the server's own DPConfig refuses beyond the ranges above (a multiplier below its floor)
            self.config()
        except ValidationError as exc:
            raise ValueError("; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())) from None
        return self

    def config(self) -> DPConfig | None:
        """The tasks' ``RoundConfig.dp`` this section asks for (None: leave it as the task has it)."""
        if self.mode is None:
            return None
        return DPConfig(
            mode=self.mode,
            noise_multiplier=self.noise_multiplier,
            clip=self.clip,
            delta=self.delta,
            max_epsilon=self.max_epsilon,
            tree_rounds=self.tree_rounds,
            counts=self.counts,
        )


#: With a task file, these ``[task]`` keys override every task's RoundConfig when the fleet config
#: sets them (or ``--goal``/``--sweep`` does); left at their defaults, the task's RoundConfig holds.
ROUND_KEYS: dict[str, str] = {
    "goal_count": "goal_count",
    "over_selection": "over_selection",
    "min_fraction": "min_fraction",
    "selection_timeout_s": "selection_timeout_s",
    "report_timeout_s": "report_timeout_s",
    "max_rounds": "max_rounds",
    "secagg_group_size": "secagg_min_group_size",
    "secagg_round_timeout_s": "secagg_round_timeout_s",
    "secagg_target_group_size": "secagg_target_group_size",
}
#: ``retry_min_s``/``retry_max_s`` override the RoundConfig's ``retry_window_s`` (either one set: both).
RETRY_KEYS = ("retry_min_s", "retry_max_s")
#: These keys shape the built-in digits MLP only; a task file's own model, hyperparameters and
#: Secure Aggregation are what it deploys, so the fleet refuses them beside a task file.
BUILT_IN_KEYS = ("hidden", "learning_rate", "batch_size", "epochs", "secure")


class FleetConfig(_Section):
    """A whole fleet: ``FleetConfig.default()`` is the paper-calibrated fleet,
    ``FleetConfig.load(path)`` reads one from TOML, ``config.replace(devices=..., hours=...,
    seed=...)`` applies command-line overrides."""

    fleet: FleetSection = FleetSection()
    availability: AvailabilitySection = AvailabilitySection()
    device_classes: list[DeviceClass] = Field(default_factory=_device_classes, min_length=1)
    network_classes: list[NetworkClass] = Field(default_factory=_network_classes, min_length=1)
    runtime_versions: list[RuntimeVersion] = Field(default_factory=_runtime_versions, min_length=1)
    faults: FaultSection = FaultSection()
    data: DataSection = DataSection()
    task: TaskSection = TaskSection()
    dp: DPSection = DPSection()

    @model_validator(mode="after")
    def _distributed_is_secure(self) -> Self:
        if self.dp.mode == "distributed" and self.task.file is None and not self.task.secure:
            raise ValueError(
                "dp.mode = distributed adds the noise on devices under Secure Aggregation: set task.secure = true "
                "(--secure) too"
            )
        return self

    @model_validator(mode="after")
    def _shares(self) -> Self:
        _check_shares(self.device_classes, "device_classes")
        _check_shares(self.network_classes, "network_classes")
        _check_shares(self.runtime_versions, "runtime_versions")
        versions = [v.version for v in self.runtime_versions]
        if len(set(versions)) != len(versions):
            raise ValueError(f"runtime_versions must be unique; got {versions}")
        minors = [version_tuple(v)[:2] for v in versions]
        if self.fleet.real_runtimes and len(set(minors)) != len(minors):
            raise ValueError(
                f"with fleet.real_runtimes, runtime_versions needs one patch per minor release (the server serves "
                f"versioned plans per minor release); got {versions}"
            )
        if not any(c.memory_mb >= self.fleet.min_memory_mb for c in self.device_classes):
            raise ValueError(
                f"no device class has fleet.min_memory_mb ({self.fleet.min_memory_mb}) of memory, so no device "
                "would take part; add such a class or lower fleet.min_memory_mb"
            )
        return self

    @classmethod
    def default(cls) -> FleetConfig:
        return cls()

    @classmethod
    def from_dict(
        cls, data: object, *, source: str = "fleet config", named: Mapping[str, str] | None = None
    ) -> FleetConfig:
        """Validate ``data``; errors become one :class:`FleetConfigError` naming every bad field, by
        the name ``named`` gives its dotted key (a command-line option) or else by its key."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise FleetConfigError(_describe(exc, source, named)) from None

    @classmethod
    def load(cls, path: str | Path) -> FleetConfig:
        """Read a TOML file; a relative ``availability.trace`` is resolved against its folder."""
        path = Path(path)
        try:
            raw = path.read_bytes()
            if raw.startswith((b"\xff\xfe", b"\xfe\xff")):  # Notepad's "Unicode", PowerShell 5's Out-File
                raise FleetConfigError(f"{path} is UTF-16 text; TOML is UTF-8: save it as UTF-8") from None
            # a byte order mark, as Windows editors and PowerShell write UTF-8, is read past as in a trace
            data = tomllib.loads(raw.decode("utf-8-sig"))
        except FileNotFoundError:
            here = "" if path.is_absolute() else f" (from {Path.cwd()})"  # a relative path: from where it was looked up
            raise FleetConfigError(
                f"no fleet config at {path}{did_you_mean_path(path)}{here}; pass an existing TOML file"
            ) from None
        except OSError as exc:  # a folder, a file without read permission
            raise FleetConfigError(
                f"cannot read the fleet config {path} ({exc.strerror or exc}); pass a TOML file"
            ) from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise FleetConfigError(f"{path} is not valid TOML ({exc}); fix the syntax") from None
        trace = data.get("availability", {}).get("trace") if isinstance(data.get("availability"), dict) else None
        if isinstance(trace, str) and not Path(trace).is_absolute():
            data["availability"]["trace"] = str((path.parent / trace).resolve())
        _resolve(data, "task", "file", path.parent)
        _resolve(data, "data", "path", path.parent)
        options = data.get("data", {}).get("options") if isinstance(data.get("data"), dict) else None
        if isinstance(options, dict):
            for key in ("test", "vocab"):  # the data spec's options that name files
                _resolve(data["data"], "options", key, path.parent)
        return cls.from_dict(data, source=str(path))

    def replace(
        self,
        *,
        devices: int | None = None,
        hours: float | None = None,
        seed: int | None = None,
        goal: int | None = None,
        task_file: str | Path | None = None,
        target_accuracy: float | None = None,
        data: Any = None,
        secure: bool | None = None,
        dp: dict[str, Any] | None = None,
        named: Mapping[str, str] | None = None,
    ) -> FleetConfig:
        """The same fleet with the command line's overrides (``None`` keeps the value). Keys left at
        their defaults stay unset (``TaskSection.explicit``). ``data`` is a parsed data spec
        (``federated_data.DataSpec``) whose paths are already resolved; ``secure`` sets ``task.secure``;
        ``dp``: ``[dp]`` keys (``--dp``, ``--noise-multiplier``, ...) over the file's. ``named``: the
        option that set each dotted key (``{"fleet.hours": "--hours"}``), which an error names it by."""
        out = self.dump()
        fleet = out.setdefault("fleet", {})
        for key, value in (("devices", devices), ("hours", hours), ("seed", seed)):
            if value is not None:
                fleet[key] = value
        task = out.setdefault("task", {})
        if goal is not None:
            task["goal_count"] = goal
        if task_file is not None:
            task["file"] = str(Path(task_file).resolve())
        if target_accuracy is not None:
            task["target_accuracy"] = target_accuracy
        if secure is not None:
            task["secure"] = secure
        if dp:
            out.setdefault("dp", {}).update(dp)
        if data is not None:
            section = out.setdefault("data", {})
            section.update(format=data.format, options={k: str(v) for k, v in data.options.items()})
            section.pop("path", None)
            if data.path is not None:
                section["path"] = str(Path(data.path).resolve())
        return FleetConfig.from_dict(out, source="the fleet config with the command line's options", named=named)

    def dump(self) -> dict[str, Any]:
        """The config as plain data with only the keys that were set: ``from_dict`` of it is this
        config, and which ``[task]`` keys were set survives (a task file's RoundConfig depends on it)."""
        return self.model_dump(mode="json", exclude_unset=True)

    def to_toml(self) -> str:
        """TOML that :meth:`load` reads back to an equal config, with only the keys that were set (as
        :meth:`dump`): a task file's RoundConfig holds for the ``[task]`` keys left unset."""
        return _to_toml(self.dump())

    @property
    def horizon_s(self) -> float:
        return self.fleet.hours * 3600.0


def _resolve(data: dict, section: str, key: str, folder: Path) -> None:
    """A relative path of ``[section] key`` made absolute against the config file's folder."""
    table = data.get(section)
    value = table.get(key) if isinstance(table, dict) else None
    if isinstance(table, dict) and isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
        table[key] = str((folder / Path(value).expanduser()).resolve())


def _describe(exc: ValidationError, source: str, named: Mapping[str, str] | None = None) -> str:
    """One line naming every bad field, each as the user wrote it: its key, or the command-line
    option ``named`` maps its dotted key to. ``source`` heads the line unless every field was named."""
    lines, only_named = [], True
    for err in _union_errors(exc.errors(include_url=False)):
        where = ".".join(str(p) for p in err["loc"])
        only_named = only_named and where in (named or {})
        if err["type"] == "extra_forbidden":
            lines.append(unknown_key(err["loc"]))
        elif err["type"] == "value_error":  # a validator's own sentence names its fields already
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {msg}" if where else msg)
            only_named = only_named and bool(where)
        elif (plain := _plain(err)) is not None:
            lines.append(f"{(named or {}).get(where, where)} {plain}")
        else:
            lines.append(f"{where or '(top level)'}: {err['msg']}")
    return "; ".join(lines) if only_named else f"{source} is invalid: " + "; ".join(lines)


def _union_errors(errors: list[Any]) -> list[Any]:
    """A value that fits none of a union's kinds (``[data] options``' text or numbers) is one error
    naming them all, where pydantic gives one per kind, each at a key with the kind's tag added
    (``data.options.clients.str``, ``.int``, ``.float``)."""
    out: list[Any] = []
    for err in errors:
        loc, kind = tuple(err["loc"]), err["type"]
        if kind in KINDS and loc and loc[-1] in UNION_TAGS:
            last = out[-1] if out else None
            if last is not None and last.get("kinds") and last["loc"] == loc[:-1]:
                last["kinds"].append(KINDS[kind])
                continue
            out.append({"loc": loc[:-1], "type": "union_kinds", "kinds": [KINDS[kind]], "input": err.get("input")})
            continue
        out.append(err)
    return out


#: The tags pydantic adds to a key for each kind of a union it tried.
UNION_TAGS = ("str", "int", "float", "bool")


def _plain(err: Any) -> str | None:
    """What a field must be, said without the validator's words ("Input should be greater than 0":
    "must be above 0 (got -1)"); None for an error this does not know."""
    ctx, given = err.get("ctx", {}), err.get("input")
    kind = err["type"]
    if kind in LIMITS:
        words, bound = LIMITS[kind]
        limit = ctx[bound]
        return f"must be {words} {f'{limit:g}' if isinstance(limit, float) else limit} (got {given!r})"
    if kind in KINDS:
        return f"must be {KINDS[kind]} (got {given!r})"
    if kind == "union_kinds":
        kinds = err["kinds"]
        said = kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"
        return f"must be {said} (got {given!r})"
    if kind == "string_too_short":
        return f"must not be empty (got {given!r})" if ctx["min_length"] == 1 else None
    if kind == "string_too_long":
        return f"must be at most {ctx['max_length']} characters long (got {len(given)})"
    if kind == "string_pattern_mismatch" and ctx["pattern"] == NAME_PATTERN:
        return f"may hold only ASCII letters, digits and _ . + - (got {given!r})"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return f"must be a table ([{'.'.join(str(p) for p in err['loc'] if not isinstance(p, int))}])"
    if kind == "list_type" and not _holds_tables(tuple(err["loc"])):
        return f"must be an array in brackets (got {given!r})"
    if kind == "list_type":
        return f"must be an array of tables ([[{'.'.join(str(p) for p in err['loc'])}]])"
    if kind == "missing":
        return "is missing; add it"
    if kind == "literal_error":
        return f"must be {ctx['expected']} (got {given!r})"
    return None


#: A number's bounds as the user reads them, by pydantic's type: the words and the bound's ``ctx`` key.
LIMITS = {
    "greater_than": ("above", "gt"),
    "greater_than_equal": ("at least", "ge"),
    "less_than": ("below", "lt"),
    "less_than_equal": ("at most", "le"),
}
#: The kinds of value a field takes, by pydantic's type for a value of another kind.
KINDS = {
    "int_type": "a whole number",
    "float_type": "a number",
    "finite_number": "a finite number",
    "bool_type": "true or false",
    "string_type": "text (in quotes)",
}


def _holds_tables(loc: tuple[int | str, ...]) -> bool:
    """Whether the list at ``loc`` holds tables (``[[device_classes]]``) rather than values (``hidden``)."""
    *table, key = loc
    model: Any = FleetConfig
    for part in table:
        if isinstance(part, int):
            continue
        annotation = model.model_fields[part].annotation
        model = typing.get_args(annotation)[0] if typing.get_origin(annotation) is list else annotation
    if not isinstance(model, type) or not issubclass(model, BaseModel) or key not in model.model_fields:
        return True
    items = typing.get_args(model.model_fields[str(key)].annotation)
    return bool(items) and isinstance(items[0], type) and issubclass(items[0], BaseModel)


def _table_keys(loc: tuple[int | str, ...]) -> list[str]:
    """The keys the table at ``loc`` takes (``("fleet",)``: ``[fleet]``'s; ``()``: the sections)."""
    model: Any = FleetConfig
    for part in loc:
        if isinstance(part, int):  # an item of an array of tables: the item's model is the list's
            continue
        annotation = model.model_fields[part].annotation
        model = typing.get_args(annotation)[0] if typing.get_origin(annotation) is list else annotation
    return list(model.model_fields)


def unknown_key(loc: tuple[int | str, ...]) -> str:
    """What to do about the unknown key at ``loc``: the key it is closest to and the keys its table takes."""
    *table, key = loc
    keys = _table_keys(tuple(table))
    where = ".".join(str(p) for p in loc)
    if not table:
        return (
            f"{where}: not a section of a fleet config{did_you_mean(str(key), keys)}; the sections are "
            f"{', '.join(keys)} (examples/fleets/default.toml shows them)"
        )
    named = ".".join(str(p) for p in table if not isinstance(p, int))
    return f"{where}: [{named}] has no key {key!r}{did_you_mean(str(key), keys)}; it takes {', '.join(keys)}"


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        # JSON's string escapes are TOML's too; TOML also forbids a raw DEL, which JSON leaves alone
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007F")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def _to_toml(data: dict, prefix: str = "") -> str:
    scalars, tables, arrays = [], [], []
    for key, value in data.items():
        if value is None:
            continue
        if isinstance(value, dict):
            tables.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            arrays.append((key, value))
        else:
            scalars.append(f"{key} = {_toml_value(value)}")
    out = "\n".join(scalars) + ("\n" if scalars else "")
    for key, value in tables:
        name = f"{prefix}{key}"
        out += f"\n[{name}]\n" + _to_toml(value, f"{name}.")
    for key, items in arrays:
        name = f"{prefix}{key}"
        for item in items:
            out += f"\n[[{name}]]\n" + _to_toml(item, f"{name}.")
    return out
