"""Central differential privacy: a trusted server clips, averages and adds Gaussian noise.

DP-FedAvg (McMahan, Ramage, Talwar and Zhang 2018, "Learning Differentially Private Recurrent
Language Models"): each device's update is clipped to L2 norm C, the clipped updates are summed
with weights of at most 1 (unweighted, or the example count capped at ``weight_cap`` and divided
by it), Gaussian noise of std z * C is added to that sum, whose sensitivity to one device is C,
and the sum is divided by a denominator: so the mean carries noise of std z * C / n. Each round is
then one Gaussian mechanism at noise multiplier z for ``server_stub.accounting``.

Adaptive clipping (Andrew, Thakkar, McMahan and Ramaswamy 2021, "Differentially Private Learning
with Adaptive Clipping") moves C towards a target quantile of the update norms by the geometric
update C <- C exp(-eta (b - target)), where b is the fraction of devices whose update was at or
below C, itself privatized: the count gets Gaussian noise of std ``count_stddev``. The count uses
part of the budget, so the updates' noise multiplier rises to z_delta = (z^-2 - (2 sigma_b)^-2)^-1/2
and the pair of releases together is one Gaussian mechanism at z (the paper's Theorem 1).

DP-FTRL with tree aggregation (Kairouz, McMahan, Song, Thakkar, Thakurta and Xu 2021, "Practical
and Private (Deep) Learning without Sampling or Shuffling"): instead of fresh noise each round,
the running sum of the rounds' clipped sums is released through a binary tree whose every node
(a dyadic range of rounds) gets its own Gaussian noise of std z * C, so the sum up to round t
carries the noise of the at most log2(t) + 1 nodes that cover [1, t]. Round t's noised sum gets
the tree's prefix noise at t minus that at t - 1 (``tree_step``): the sum of the rounds' noised
sums up to any round is then the tree's noisy prefix sum, and each round's release a function of
the tree's noisy nodes. A device in at most one round of a tree changes one leaf, so one node per
level: the tree is one ``SingleEpochTreeAggregationDpEvent`` for ``server_stub.accounting``.

Pure: arrays and frozen state in, arrays and new state out; the random source is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from device_runtime.ddp import clip_l2

FloatArray = npt.NDArray[np.float64]


class CentralDPError(ValueError):
    """Central DP parameters out of range; the message names the field."""


def _positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise CentralDPError(f"{name} must be a positive finite number, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise CentralDPError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class DPMean:
    """One round's private aggregate: ``mean`` (noise included), how many updates were summed and
    how many of them the clip shortened (``clipped``), the noise std on the mean, and the total
    weight the sum was divided by."""

    mean: FloatArray
    count: int
    clipped: int
    noise_std: float
    denominator: float


def capped_weights(counts: npt.ArrayLike, weight_cap: float) -> FloatArray:
    """Weights in [0, 1] from example counts: min(count, cap) / cap (McMahan et al.'s capped
    weighting), so no device moves the weighted sum by more than C."""
    _positive("weight_cap", weight_cap)
    c = np.asarray(counts, dtype=np.float64)
    if not np.isfinite(c).all() or (c < 0).any():
        raise CentralDPError("example counts must be finite and >= 0")
    out: FloatArray = np.minimum(c, weight_cap) / weight_cap
    return out


def dp_mean(
    updates: Sequence[npt.ArrayLike] | npt.NDArray[np.float64],
    *,
    clip: float,
    noise_multiplier: float,
    rng: np.random.Generator,
    weights: npt.ArrayLike | None = None,
    denominator: float | None = None,
) -> DPMean:
    """DP-FedAvg's aggregate of one round: sum_i w_i clip(u_i) + N(0, (z C)^2 I), divided by
    ``denominator``.

    ``weights``: each in [0, 1] (``capped_weights``); None is unweighted (all 1). ``denominator``:
    None divides by the sum of the weights (for unweighted, the number of reports; this treats the
    count of reports as public, as Flower's DP wrappers, whose inner FedAvg averages the reports it
    got, do); pass a fixed one (McMahan et al.'s expected total weight, TFF's ``clients_per_round``)
    to keep the count private. Noise of std z * C on the sum is std z * C / denominator on the mean."""
    _positive("clip", clip)
    _non_negative("noise_multiplier", noise_multiplier)
    rows = [np.asarray(u, dtype=np.float64).reshape(-1) for u in updates]
    if not rows:
        raise CentralDPError("no updates to aggregate")
    dim = rows[0].size
    if any(r.size != dim for r in rows):
        raise CentralDPError("updates differ in length")
    w = np.ones(len(rows)) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.size != len(rows):
        raise CentralDPError(f"{w.size} weights for {len(rows)} updates")
    if not np.isfinite(w).all() or (w < 0).any() or (w > 1).any():
        raise CentralDPError("weights must be in [0, 1]: cap them with capped_weights, or the sensitivity is not clip")
    total = np.zeros(dim)
    clipped = 0
    for r, wi in zip(rows, w, strict=True):
        if float(np.linalg.norm(r)) > clip:
            clipped += 1
        total += wi * clip_l2(r, clip)
    den = float(w.sum()) if denominator is None else float(denominator)
    _positive("denominator", den)
    std = noise_multiplier * clip
    if std > 0:
        total = total + rng.normal(0.0, std, size=dim)
    return DPMean(
        mean=total / den,
        count=len(rows),
        clipped=clipped,
        noise_std=std / den,
        denominator=den,
    )


def update_noise_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """z_delta = (z^-2 - (2 sigma_b)^-2)^-1/2: the updates' noise multiplier once the clipped count,
    noised with std ``count_stddev`` (sigma_b), takes its share of a round at ``noise_multiplier``
    (Andrew et al. 2021). The count's sensitivity is 1/2 (b_i - 1/2 in {-1/2, 1/2}), so it is a
    Gaussian mechanism at 2 sigma_b, and the two compose to z exactly."""
    _positive("noise_multiplier", noise_multiplier)
    _positive("count_stddev", count_stddev)
    rest = noise_multiplier**-2 - (2.0 * count_stddev) ** -2
    if rest <= 0:
        raise CentralDPError(
            f"count_stddev {count_stddev:g} spends the whole budget of noise_multiplier {noise_multiplier:g}: "
            f"it must exceed noise_multiplier / 2 = {noise_multiplier / 2:g} (the paper uses about n / 20)"
        )
    return float(rest**-0.5)


@dataclass(frozen=True)
class AdaptiveClip:
    """The state of adaptive clipping between rounds: the current ``clip``; the ``target_quantile``
    of update norms it tracks; the geometric step ``learning_rate`` (eta); the noise std on the
    count of unclipped updates (``count_stddev``); the round's overall ``noise_multiplier``."""

    clip: float
    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_stddev: float = 1.0
    noise_multiplier: float = 1.0

    def __post_init__(self) -> None:
        _positive("clip", self.clip)
        if not 0.0 <= self.target_quantile <= 1.0:
            raise CentralDPError(f"target_quantile must be in [0, 1], got {self.target_quantile!r}")
        _non_negative("learning_rate", self.learning_rate)
        _non_negative("noise_multiplier", self.noise_multiplier)
        _non_negative("count_stddev", self.count_stddev)
        if self.noise_multiplier > 0:
            update_noise_multiplier(self.noise_multiplier, self.count_stddev)

    @property
    def updates_noise_multiplier(self) -> float:
        """The noise multiplier the updates' sum gets (z_delta); 0 when DP is off."""
        if self.noise_multiplier == 0:
            return 0.0
        return update_noise_multiplier(self.noise_multiplier, self.count_stddev)


def unclipped_fraction(norms: npt.ArrayLike, clip: float, count_stddev: float, rng: np.random.Generator) -> float:
    """The privatized fraction of updates with norm at most ``clip``: (sum b_i + N(0, sigma_b^2)) / n."""
    n = np.asarray(norms, dtype=np.float64).reshape(-1)
    if n.size == 0:
        raise CentralDPError("no update norms")
    return noised_fraction(int(np.sum(n <= clip)), n.size, count_stddev, rng)


def noised_fraction(
    unclipped: int, reports: int, count_stddev: float, rng: np.random.Generator, *, expected: int | None = None
) -> float:
    """``unclipped_fraction`` from a count kept as reports arrive (a server that sums each report
    and keeps no norm): (count + N(0, sigma_b^2)) / reports. Divided by the reports the round got,
    as Flower's ``DifferentialPrivacyServerSideAdaptiveClipping`` does; with ``expected`` (a task
    whose counts are withheld) by that fixed number instead, as TFF's quantile estimator divides by
    ``expected_num_records`` and Andrew et al. by the expected cohort."""
    if reports <= 0:
        raise CentralDPError("no reports to count")
    if not 0 <= unclipped <= reports:
        raise CentralDPError(f"{unclipped} unclipped of {reports} reports")
    if expected is not None and expected <= 0:
        raise CentralDPError(f"the expected count must be >= 1, got {expected}")
    _non_negative("count_stddev", count_stddev)
    count = float(unclipped)
    if count_stddev > 0:
        count += float(rng.normal(0.0, count_stddev))
    return count / (reports if expected is None else expected)


def default_count_stddev(goal_count: int) -> float:
    """The clipped count's noise std when a task sets none: goal_count / 20, as TFF's
    ``DifferentiallyPrivateFactory.gaussian_adaptive`` (about n / 20 in Andrew et al.)."""
    return goal_count / 20.0


def report_weight(num_examples: float, weighting: str, weight_cap: float) -> float:
    """One report's weight in the DP sum: 1 (``unweighted``), or min(n, cap) / cap (``capped``,
    ``capped_weights``); in [0, 1] either way, so the sum's sensitivity stays the clip."""
    if weighting == "unweighted":
        return 1.0
    if weighting == "capped":
        return float(capped_weights([num_examples], weight_cap)[0])
    raise CentralDPError(f"weighting must be 'unweighted' or 'capped', got {weighting!r}")


def report_contribution(
    weight_sum: npt.ArrayLike, num_examples: float, *, clip: float, weight: float
) -> tuple[FloatArray, bool]:
    """One report's bounded contribution to a streamed DP-FedAvg sum: its mean update
    ``weight_sum / num_examples`` (a report carries delta * n) clipped to ``clip``, times
    ``weight``; and whether the mean's norm was at or below ``clip`` (adaptive clipping's b_i).

    Whatever a device sends, the result has norm at most ``clip``: so adding or removing one
    report moves the sum by at most C, the sensitivity the noise is calibrated to. A report of
    no examples has no mean: it contributes zeros (and counts as clipped unless it changes nothing)."""
    _positive("clip", clip)
    if not (0.0 <= weight <= 1.0):
        raise CentralDPError(f"weight must be in [0, 1], got {weight!r}")
    w = np.asarray(weight_sum, dtype=np.float64).reshape(-1)
    if not np.isfinite(w).all() or not (math.isfinite(num_examples) and num_examples >= 0):
        raise CentralDPError("a report's update and num_examples must be finite (num_examples >= 0)")
    if num_examples <= 0:
        return np.zeros_like(w), not np.any(w)
    mean = w / num_examples
    norm = math.sqrt(float(np.square(mean).sum()))
    out: FloatArray = clip_l2(mean, clip) * weight
    return out, norm <= clip


def noised_sum(total: npt.ArrayLike, *, clip: float, noise_multiplier: float, rng: np.random.Generator) -> FloatArray:
    """The noise step on an accumulated sum of contributions: + N(0, (z C)^2) on every entry
    (nothing with z = 0). The sum's sensitivity to one report is C (``report_contribution``)."""
    _positive("clip", clip)
    _non_negative("noise_multiplier", noise_multiplier)
    t = np.asarray(total, dtype=np.float64)
    std = noise_multiplier * clip
    if std == 0:
        return t.copy()
    out: FloatArray = t + rng.normal(0.0, std, size=t.shape)
    return out


def denominator(weighting: str, reports: int, goal_count: int, *, counts: str = "public") -> float:
    """What the noised sum is divided by (``DPConfig``): the number of reports for
    ``unweighted`` (treated as public), the fixed ``goal_count`` for ``capped`` (McMahan et al.'s
    expected total weight q W when every report weighs 1; reports of fewer examples than the cap
    weigh less and the mean comes out smaller by their mean weight; dividing by the noiseless total
    weight would publish it). With ``counts="withheld"`` always ``goal_count``: dividing by the
    reports would put their number, which is then not published, into the model's scale."""
    if weighting not in ("unweighted", "capped"):
        raise CentralDPError(f"weighting must be 'unweighted' or 'capped', got {weighting!r}")
    if weighting == "unweighted" and counts == "public":
        if reports <= 0:
            raise CentralDPError("no reports to average")
        return float(reports)
    if goal_count <= 0:
        raise CentralDPError(f"goal_count must be >= 1, got {goal_count}")
    return float(goal_count)


def next_clip(state: AdaptiveClip, b: float) -> AdaptiveClip:
    """The geometric quantile update: C <- C exp(-eta (b - target)); too many updates below C
    (b above the target) shrinks it, too few grows it."""
    return replace(
        state,
        clip=state.clip * math.exp(-state.learning_rate * (b - state.target_quantile)),
    )


def adaptive_dp_mean(
    updates: Sequence[npt.ArrayLike] | npt.NDArray[np.float64],
    state: AdaptiveClip,
    rng: np.random.Generator,
    *,
    weights: npt.ArrayLike | None = None,
    denominator: float | None = None,
) -> tuple[DPMean, AdaptiveClip]:
    """One round of DP-FedAvg with adaptive clipping: the aggregate at the current clip with the
    updates' noise multiplier z_delta, and the state with the next clip (from the noised count).
    With ``noise_multiplier`` 0 nothing is noised (DP off) and the clip still adapts."""
    rows = [np.asarray(u, dtype=np.float64).reshape(-1) for u in updates]
    result = dp_mean(
        rows,
        clip=state.clip,
        noise_multiplier=state.updates_noise_multiplier,
        rng=rng,
        weights=weights,
        denominator=denominator,
    )
    norms = [float(np.linalg.norm(r)) for r in rows]
    sigma_b = state.count_stddev if state.noise_multiplier > 0 else 0.0
    b = unclipped_fraction(norms, state.clip, sigma_b, rng)
    return result, next_clip(state, b)


def tree_nodes(t: int) -> list[tuple[int, int]]:
    """The dyadic nodes whose sums make the prefix of rounds [1, t], largest first: (level, index),
    node (h, i) covering rounds i 2^h + 1 .. (i + 1) 2^h (its index counted at its level)."""
    if t < 0:
        raise CentralDPError(f"a tree's round must be >= 0, got {t}")
    out = []
    start = 0
    for level in reversed(range(t.bit_length())):
        if t >> level & 1:
            out.append((level, start >> level))
            start += 1 << level
    return out


@dataclass(frozen=True)
class TreeNoise:
    """One tree of DP-FTRL: the noise std of each node (z * C), the rounds it has released (``t``)
    and the noise of the nodes that cover [1, t] (``tree_nodes(t)``), flat, one vector per node."""

    std: float
    t: int = 0
    nodes: tuple[tuple[tuple[int, int], FloatArray], ...] = ()


def tree_step(tree: TreeNoise, size: int, rng: np.random.Generator) -> tuple[FloatArray, TreeNoise]:
    """Round ``t + 1``'s noise on its sum, flat of ``size``: the tree's prefix noise at t + 1
    (the nodes it shares with t kept, the others drawn from ``rng``) minus the prefix noise at t;
    and the tree after the round."""
    _non_negative("std", tree.std)
    held = dict(tree.nodes)
    if any(v.shape != (size,) for v in held.values()):
        raise CentralDPError(f"the tree's noise has another length than the sum's {size}")
    nodes = [
        (k, held[k] if k in held else (rng.normal(0.0, tree.std, size=size) if tree.std > 0 else np.zeros(size)))
        for k in tree_nodes(tree.t + 1)
    ]
    kept = {k for k, _ in nodes}
    noise: FloatArray = np.zeros(size)
    for k, v in nodes:  # the shared nodes cancel: only the drawn ones are added ...
        if k not in held:
            noise = noise + v
    for k, v in tree.nodes:  # ... and the ones the larger node replaces taken out
        if k not in kept:
            noise = noise - v
    return noise, TreeNoise(tree.std, tree.t + 1, tuple(nodes))


__all__ = [
    "AdaptiveClip",
    "CentralDPError",
    "TreeNoise",
    "DPMean",
    "adaptive_dp_mean",
    "capped_weights",
    "default_count_stddev",
    "denominator",
    "dp_mean",
    "next_clip",
    "noised_fraction",
    "noised_sum",
    "report_contribution",
    "report_weight",
    "tree_nodes",
    "tree_step",
    "unclipped_fraction",
    "update_noise_multiplier",
]
