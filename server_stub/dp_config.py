"""A task's differential privacy settings: ``RoundConfig(dp=DPConfig(...))``.

Two modes, by who adds the noise:

- ``central``: a trusted server. Each report's mean update is clipped to ``clip`` (L2) and given a
  weight of at most 1 (``weighting``), the weighted sum gets Gaussian noise of std
  ``noise_multiplier * clip`` before the plan's server part averages it (DP-FedAvg,
  ``server_stub.central_dp``); with ``target_quantile`` the clip adapts to that quantile of the
  update norms (Andrew et al. 2021), the count it learns from noised too.
- ``distributed``: the server is not trusted; the task runs under Secure Aggregation. Each device
  clips, rotates, quantizes its update and adds its share of discrete noise
  (``device_runtime.ddp``) so that any sum the protocol releases carries noise of at least
  ``noise_multiplier`` times the sensitivity; the device checks that against its own floor.

Either way each committed round is one Gaussian mechanism at ``noise_multiplier`` for the
accountant (``server_stub.accounting``), which reports epsilon at ``delta`` after every round and
stops the task before a round would take it past ``max_epsilon``; with ``tree_rounds`` (DP-FTRL)
each tree of rounds is one tree-aggregation mechanism instead. By default nothing is assumed
about how devices are selected; ``sampling_probability`` opts in to amplification by sampling and
is only as true as the selection probability the population's eligibility policies enforce.

Pure: a frozen, validated value; out-of-range fields are refused by name (``dp.noise_multiplier``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, Strict
from pydantic.dataclasses import dataclass

from .accounting import MIN_NOISE_MULTIPLIER, MIN_SAMPLED_NOISE_MULTIPLIER

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)
_Int = Annotated[int, Strict()]
_Float = Annotated[float, Strict()]

#: The largest noise multiplier taken: far past any useful one, small enough to stay a number.
MAX_NOISE_MULTIPLIER = 1e4
#: The largest delta taken: a delta near 1/population or below is what the guarantee needs.
MAX_DELTA = 0.1
#: The least delta taken: below 1/population^2 of any population (1e15 devices) no guarantee is
#: meant; down to 5e-324 the accountant would report an epsilon for it all the same.
MIN_DELTA = 1e-30
#: The least ``sampling_probability`` taken: a round's cohort is a larger share of any population
#: than one device in a million; below it dp-accounting's Renyi divergences lose their precision
#: (some cancel to below 0 at a large multiplier, which the accountant leaves out) and the epsilons
#: are 0 or near it, a setting nobody means.
MIN_SAMPLING_PROBABILITY = 1e-6

DPMode = Literal["central", "distributed"]
Weighting = Literal["unweighted", "capped"]
DDPMechanism = Literal["gaussian", "skellam"]
Accountant = Literal["pld", "rdp"]
Counts = Literal["public", "withheld"]


@dataclass(frozen=True, config=_STRICT)
class DPConfig:
    """Differential privacy for one task (see the module docstring for the two modes).

    ``noise_multiplier``: z, the Gaussian noise's std over one device's sensitivity (``clip``);
    0 turns the noise off (epsilon is then infinite: for audits and tests, never a deployment);
    otherwise at least ``MIN_NOISE_MULTIPLIER`` (``MIN_SAMPLED_NOISE_MULTIPLIER`` with sampling).
    ``clip``: each device's update is clipped to this L2 norm (with ``target_quantile``, the
    starting clip). ``delta``: the delta epsilon is reported at (``MIN_DELTA`` to ``MAX_DELTA``). ``max_epsilon``: the task stops
    (completes) before a round would take it past this. ``weighting`` (central): every report
    weighs 1 (``unweighted``, the mean divides by the number of reports, which is treated as public)
    or min(examples, max_examples_per_report) / max_examples_per_report (``capped``, divided by the
    fixed goal_count). ``target_quantile`` / ``clip_learning_rate`` / ``clipped_count_stddev``
    (central): adaptive clipping; the count's std defaults to goal_count / 20, as in TFF.
    ``mechanism`` / ``bitwidth`` (distributed): the devices' discrete noise and the modulus 2^bitwidth
    of the secure sum. ``sampling_probability``: opt in to amplification by sampling at this
    probability (``MIN_SAMPLING_PROBABILITY`` to 1, see the module docstring). ``accountant``: ``pld`` or ``rdp``. ``tree_rounds``
    (central): DP-FTRL with tree aggregation instead of fresh noise each round, a new tree every
    ``tree_rounds`` rounds (``central_dp.tree_step``); it assumes each device takes part in at most
    one round of a tree, and is accounted by RDP whatever ``accountant`` says. ``counts`` (central):
    ``public`` publishes the round's counts (selected, reported, dropped, late, shapes, duration) and
    divides the unweighted mean by the reports, so epsilon covers a device's data and not whether it
    took part; ``withheld`` leaves them out of the round records and the population's status and
    divides by the fixed ``goal_count`` (the adaptive clip's fraction too), so that the ledger's
    add-or-remove epsilon covers participation as well (``dp_rounds.withhold_counts``)."""

    mode: DPMode
    noise_multiplier: Annotated[_Float, Field(ge=0.0, le=MAX_NOISE_MULTIPLIER)]
    clip: Annotated[_Float, Field(gt=0.0, le=1e6)]
    delta: Annotated[_Float, Field(gt=0.0, le=MAX_DELTA)] = 1e-5
    max_epsilon: Annotated[_Float, Field(gt=0.0, le=1e6)] | None = None
    weighting: Weighting = "unweighted"
    target_quantile: Annotated[_Float, Field(gt=0.0, lt=1.0)] | None = None
    clip_learning_rate: Annotated[_Float, Field(gt=0.0, le=10.0)] = 0.2
    clipped_count_stddev: Annotated[_Float, Field(gt=0.0, le=1e6)] | None = None
    mechanism: DDPMechanism = "gaussian"
    bitwidth: Annotated[_Int, Field(ge=8, le=62)] = 32
    sampling_probability: Annotated[_Float, Field(gt=0.0, le=1.0)] | None = None
    accountant: Accountant = "pld"
    tree_rounds: Annotated[_Int, Field(ge=1, le=1 << 20)] | None = None
    counts: Counts = "public"

    def __post_init__(self) -> None:
        if self.delta < MIN_DELTA:
            raise ValueError(
                f"dp.delta {self.delta:g} is below {MIN_DELTA:g}, smaller than any guarantee means (delta is meant "
                f"near 1/population or below); use {MIN_DELTA:g} to {MAX_DELTA:g}"
            )
        q = self.sampling_probability
        if q is not None and q < MIN_SAMPLING_PROBABILITY:
            raise ValueError(
                f"dp.sampling_probability {q:g} is below {MIN_SAMPLING_PROBABILITY:g}, one device in a million of the "
                "population a round (the accountant's figures there are 0 or near it); use "
                f"{MIN_SAMPLING_PROBABILITY:g} to 1, or leave it out to account without sampling"
            )
        z = self.noise_multiplier
        if 0.0 < z < MIN_NOISE_MULTIPLIER:
            raise ValueError(
                f"dp.noise_multiplier {z:g} is above 0 but below {MIN_NOISE_MULTIPLIER:g}: one round would cost epsilon "
                f"above 5000, no privacy worth accounting; use at least {MIN_NOISE_MULTIPLIER:g} (or 0: noise off)"
            )
        sampled = self.sampling_probability is not None and self.sampling_probability < 1.0
        if sampled and 0.0 < z < MIN_SAMPLED_NOISE_MULTIPLIER:
            raise ValueError(
                f"dp.noise_multiplier {z:g} is below {MIN_SAMPLED_NOISE_MULTIPLIER:g}, the least a task with "
                "dp.sampling_probability takes (its privacy loss distribution grows as 1 / z^2: at 0.1 it takes "
                "20 s and 500 MB to build, at 0.001 38 GB); raise dp.noise_multiplier, or account without sampling"
            )
        if self.mode == "distributed" and (self.target_quantile is not None or self.weighting != "unweighted"):
            raise ValueError(
                "dp: adaptive clipping (target_quantile) and capped weighting are central DP's; a distributed "
                "task clips each update to a fixed clip and weighs every device 1"
            )
        if self.tree_rounds is not None and (
            self.mode != "central" or self.target_quantile is not None or self.sampling_probability is not None
        ):
            raise ValueError(
                "dp.tree_rounds (DP-FTRL) is central DP at a fixed clip without sampling: drop dp.target_quantile and "
                "dp.sampling_probability, and use dp.mode 'central'"
            )
        if self.counts == "withheld" and self.mode != "central":
            raise ValueError(
                "dp.counts 'withheld' is central DP's: under distributed DP the server is not trusted and sees which "
                "devices check in and send masked inputs, so withholding the counts from what it publishes hides "
                "nothing from it; use dp.counts 'public' (epsilon covers a device's data, not its participation)"
            )
        if self.clipped_count_stddev is not None and self.target_quantile is None:
            raise ValueError("dp.clipped_count_stddev is for adaptive clipping: set dp.target_quantile too")


__all__ = [
    "Counts",
    "DDPMechanism",
    "DPConfig",
    "DPMode",
    "MAX_DELTA",
    "MAX_NOISE_MULTIPLIER",
    "MIN_DELTA",
    "MIN_SAMPLING_PROBABILITY",
    "Weighting",
]
