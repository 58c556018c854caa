"""Distributed differential privacy in a Secure Aggregation round: the server's side.

A training task with ``RoundConfig.dp.mode == "distributed"`` runs under Secure Aggregation; its
devices add the noise (``device_runtime.ddp``), the server never holds one update. Here:

- at deploy, the refusals that name the field (``check_deploy``): distributed DP without Secure
  Aggregation, on a task that does not train, or with a ``dp.bitwidth`` whose modulus the largest
  group's noisy sum could wrap (or wider than the devices' float64 encoding holds exactly);
- once the round's groups are formed, its parameters (``DistributedDP.calibrate``): the noise
  multiplier, clip, mechanism and bitwidth of the task, the plan's weight count as the dimension,
  ``min_devices`` the fewest devices any group may release (``releasable_minimum`` of each
  group's configuration, as the devices recompute it) and ``max_devices`` the largest group; the
  rotation seed comes from the round's commitment (``dp_policy.rotation_seed``), shown before the
  cohort was known; the secure sum's modulus is ``2^bitwidth`` and its length the padded dimension;
- a completed group's modular sum decoded (signed, over gamma, unrotated) into the group's float
  sum of clipped mean deltas, every device weighing 1 (``num_examples`` is the number summed,
  the loss and accuracy sums zero: the devices do not send them), and checked before it is
  accumulated (``sum_problem``): finite, and within the norm that devices following the mechanism
  can reach, with the noise's tail bound (``norm_bound``); otherwise it is dropped.

Pure: values in, values out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from device_runtime.ddp import DDPError, DDPParams, ModulusTooSmall, calibrate, decode
from device_runtime.dp_policy import update_dim
from device_runtime.executor import NUM_EXAMPLES, PlanExecutor
from device_runtime.plan import Plan

from .errors import BadRequest
from .rounds import RoundConfig

#: The widest modulus a distributed-DP task may use: the devices scale and round in float64
#: (``device_runtime.ddp.encode``), exact for integers below 2^53 only; above it the rounding's norm
#: check fails at random (measured: one of six encodings at 2^62) and the sum loses its low bits.
MAX_EXACT_BITWIDTH = 53
#: Relative slack of the norm check for the float32 rounding of the decoded sum.
FLOAT32_SLACK = 1e-6
#: Skellam noise is sub-exponential, not sub-Gaussian: its cumulant v (cosh(lambda) - 1) stays below
#: cosh(1) v lambda^2 / 2 for |lambda| <= 1, the range that matters once each coordinate's std is
#: well above the tail's log term (as calibrated variances are). A margin taken for the check, not a
#: proof for every variance: a Skellam sum it wrongly drops costs a round, never privacy.
SKELLAM_PROXY = math.cosh(1.0)


def largest_group(selection_target: int, min_group_size: int, spare: int) -> int:
    """The most devices ``secagg.assign_groups`` puts in one group of a round that selects at most
    ``selection_target``: groups of at least ``k + spare`` split the rest evenly, so none reaches
    ``2 (k + spare)``; a single group of fewer holds them all."""
    return max(min_group_size, min(selection_target, 2 * (min_group_size + spare) - 1))


@dataclass(frozen=True)
class DistributedDP:
    """A task's distributed-DP settings with the layout of its plan's update."""

    noise_multiplier: float
    clip: float
    bitwidth: int
    mechanism: str
    weight_names: tuple[str, ...]
    spec: Mapping[str, tuple[tuple[int, ...], np.dtype]]

    @property
    def dim(self) -> int:
        return update_dim({w: self.spec[w][0] for w in self.weight_names}, self.weight_names)

    @property
    def padded_dim(self) -> int:
        return 1 << (self.dim - 1).bit_length()

    def calibrate(self, min_devices: int, max_devices: int) -> DDPParams:
        """Raises ``ModulusTooSmall`` (naming the bitwidth to use) or ``DDPError``."""
        return calibrate(
            noise_multiplier=self.noise_multiplier,
            clip=self.clip,
            dim=self.dim,
            bitwidth=self.bitwidth,
            min_devices=min_devices,
            max_devices=max_devices,
            mechanism="skellam" if self.mechanism == "skellam" else "gaussian",
        )

    def group_total(self, flat: np.ndarray, count: int) -> dict[str, np.ndarray]:
        """The group's decoded sum as the plan's client update: the weight tensors' sums of mean
        deltas, ``num_examples`` the devices summed (each weighs 1), every other tensor zero."""
        out: dict[str, np.ndarray] = {}
        at = 0
        for name in self.weight_names:
            shape, dtype = self.spec[name]
            size = int(np.prod(shape, dtype=np.int64))
            out[name] = flat[at : at + size].reshape(shape).astype(dtype)
            at += size
        for name, (shape, dtype) in self.spec.items():
            if name not in out:
                out[name] = np.full(shape, count if name == NUM_EXAMPLES else 0, dtype=dtype)
        return out


def distributed_dp(plan: Plan, executor: PlanExecutor, config: RoundConfig) -> DistributedDP | None:
    """The task's distributed-DP settings, or None when its rounds add no device noise."""
    dp = config.dp
    if dp is None or dp.mode != "distributed" or plan.kind != "train" or not plan.server.secure_sum:
        return None
    return DistributedDP(
        dp.noise_multiplier, dp.clip, dp.bitwidth, dp.mechanism, plan.weight_names, executor.client_update_spec()
    )


def check_deploy(name: str, plan: Plan, executor: PlanExecutor, config: RoundConfig, spare: int) -> None:
    """Refuse a distributed-DP task that cannot run, naming the field (``BAD_CONFIG``, 400). What
    any DP mode needs (a training task, a budget a round fits) is ``dp_rounds.check_deploy``'s."""
    dp = config.dp
    if dp is None or dp.mode != "distributed":
        return
    if not plan.server.secure_sum:
        raise BadRequest(
            f"task {name!r}: dp.mode 'distributed' needs Secure Aggregation (the devices' noise shares protect "
            "one update only inside a secure sum): add secure aggregation to the plan, or use dp.mode 'central'",
            code="BAD_CONFIG",
        )
    if dp.bitwidth > MAX_EXACT_BITWIDTH:
        raise BadRequest(
            f"task {name!r}: dp.bitwidth {dp.bitwidth} is above {MAX_EXACT_BITWIDTH}: the devices' encoding is "
            f"exact only for integers below 2^{MAX_EXACT_BITWIDTH}; use dp.bitwidth {MAX_EXACT_BITWIDTH} or less",
            code="BAD_CONFIG",
        )
    ddp = distributed_dp(plan, executor, config)
    assert ddp is not None
    k = config.secagg_min_group_size
    most = largest_group(config.selection_target, k, spare)
    try:
        ddp.calibrate(min_devices=k, max_devices=most)
    except ModulusTooSmall as exc:
        raise BadRequest(
            f"task {name!r}: dp.bitwidth {dp.bitwidth} is too small for groups of up to {most} devices: {exc}",
            code="BAD_CONFIG",
        ) from None
    except DDPError as exc:
        raise BadRequest(
            f"task {name!r}: dp.clip {dp.clip:g} with dp.noise_multiplier {dp.noise_multiplier:g} and dp.bitwidth "
            f"{dp.bitwidth} gives no encoding the devices can run ({exc}); use a clip near the updates' norms",
            code="BAD_CONFIG",
        ) from None


def decode_group(total_mod: np.ndarray, params: DDPParams, seed: int, count: int) -> np.ndarray:
    """The float sum of ``count`` devices' clipped mean deltas plus the noise (flat, float64)."""
    return decode(total_mod, params, seed, count)


def norm_bound(params: DDPParams, count: int) -> float:
    """The largest L2 norm the decoded sum of ``count`` honest encodings reaches, except with
    probability ``params.wrap_probability``.

    Each device's rounded, rotated vector has norm at most ``sensitivity`` (conditional rounding
    enforces it), so the signal part is at most ``count * sensitivity / gamma`` (at least
    ``count * clip``); the noise, ``padded_dim`` independent coordinates each a sum of ``count``
    shares, is sub-Gaussian with proxy ``count * local_variance`` (the discrete Gaussian, Canonne,
    Kamath and Steinke 2020; Skellam with ``SKELLAM_PROXY``), so its squared norm is below
    sigma^2 (d + 2 sqrt(d t) + 2 t) with probability 1 - e^-t (Hsu, Kakade and Zhang 2012). The
    unrotation is orthonormal and the truncation to ``dim`` only shortens the vector."""
    d = float(params.padded_dim)
    t = math.log(1.0 / params.wrap_probability)
    proxy = count * params.local_variance * (SKELLAM_PROXY if params.mechanism == "skellam" else 1.0)
    noise = math.sqrt(proxy * (d + 2.0 * math.sqrt(d * t) + 2.0 * t))
    return (count * params.sensitivity + noise) / params.gamma


def sum_problem(
    total: Mapping[str, np.ndarray], weight_names: Sequence[str], params: DDPParams, count: int
) -> str | None:
    """Why a group's decoded sum is not one ``count`` devices following the mechanism could give
    (for the round's metrics), or None."""
    for name, value in total.items():
        if not np.isfinite(np.asarray(value, dtype=np.float64)).all():
            return f"the decoded sum's {name!r} holds NaN or infinite values"
    norm = math.sqrt(sum(float(np.sum(np.square(np.asarray(total[w], dtype=np.float64)))) for w in weight_names))
    limit = norm_bound(params, count) * (1.0 + FLOAT32_SLACK)
    if norm > limit:
        return (
            f"the norm of the decoded sum is {norm:.6g}, above {limit:.6g}: {count} devices' clip {params.clip:g} "
            f"and the noise's tail bound (std {params.central_std(count):.4g} per coordinate)"
        )
    return None


__all__ = [
    "MAX_EXACT_BITWIDTH",
    "DistributedDP",
    "check_deploy",
    "decode_group",
    "distributed_dp",
    "largest_group",
    "norm_bound",
    "sum_problem",
]
