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
    count of reports as public, as TFF's unweighted DP mean does); pass a fixed one (McMahan et
    al.'s expected total weight) to keep the count private. Noise of std z * C on the sum is
    std z * C / denominator on the mean."""
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
    count = float(np.sum(n <= clip))
    if count_stddev > 0:
        count += float(rng.normal(0.0, count_stddev))
    return count / n.size


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


__all__ = [
    "AdaptiveClip",
    "CentralDPError",
    "DPMean",
    "adaptive_dp_mean",
    "capped_weights",
    "dp_mean",
    "next_clip",
    "unclipped_fraction",
    "update_noise_multiplier",
]
