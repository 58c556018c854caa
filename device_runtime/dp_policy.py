"""The device's differential privacy floor under Secure Aggregation: what the app (or the SDK's
default) holds, never the server.

In a distributed-DP round (``device_runtime.ddp``) each device adds a share of the noise, sized so
that the fewest devices whose sum the group may release carry the task's noise together. The
server computes those shares, so a malicious one could send a smaller variance, a larger gamma
(which widens the sensitivity the noise must cover), a ``min_devices`` above what the protocol
really releases, or a modulus the group's sum wraps. Before it advertises a key the device
recomputes everything that follows from the parameters and refuses:

- ``DP_PARAMS_INVALID``: parameters that are not self-consistent (not a valid ``DDPParams``, a
  group session that does not commit to them (``bound_label``), a rotation seed that is not the
  one the round's commitment gives, a dimension that is not this
  device's update, a secure sum whose modulus is not ``2^bitwidth`` or whose length is not the
  padded dimension, a group larger than ``max_devices``, a modulus the group's noisy sum could wrap
  beyond the policy's ``max_wrap_probability``);
- ``DP_NOISE_BELOW_FLOOR``: too little noise. With ``m`` the fewest devices any sum the group
  releases holds (``releasable_minimum``: what the SecAgg client itself enforces, never the
  server's ``min_devices``) and ``z`` the larger of the round's noise multiplier and this policy's
  ``min_noise_multiplier``, it needs ``local_variance * m >= (z * sensitivity)^2``, the
  sensitivity being the conditional-rounding bound the device enforces on its own encoding; and
  integer noise that costs no more than the Gaussian mechanism it is accounted as
  (``DDPParams.discreteness_problem``: discrete Gaussian shares wide enough for the group's sum of
  them to be one discrete Gaussian, as a share of variance well below 1 is not, being almost
  always 0; Skellam noise large beside its sensitivity). A secure round with no DP at all is
  refused too when the policy sets a floor.

The shares add up to the noise the floor counts only if every member of the group encodes with the
same parameters. A server could send each member its own: one member an honest set, the others a
tiny gamma (their sensitivity, and so their shares, nearly nothing) that each passes its own check,
so that the group's sum carries little more than the first member's own share. So the group's
Secure Aggregation session label ends with a digest of the parameters (``bound_label``), which the
device checks against the ones it was sent: the label is in the session tag that every member signs
its keys under and checks its peers' signatures with, so members sent different parameters fail
each other's signatures (under the attested cohort, ``SecAggPolicy``'s default) and none of them
sends a masked input.

Pure: values in, verdicts out; the layout of a plan's update as the flat vector the mechanism
encodes is here too, so that the device and the server lay it out the same way.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from pydantic import ValidationError

from secagg import SecAggConfig

from . import ddp
from .ddp import DEFAULT_WRAP_PROBABILITY, DDPError, DDPParams
from .executor import NUM_EXAMPLES
from .wire import DDPRoundParams

#: ``SecureResult.code`` / ``SessionResult.rejection_code``: the round's noise is below this device's floor
DP_NOISE_BELOW_FLOOR = "DP_NOISE_BELOW_FLOOR"
#: ``SecureResult.code`` / ``SessionResult.rejection_code``: the round's DP parameters are not self-consistent
DP_PARAMS_INVALID = "DP_PARAMS_INVALID"
#: Relative slack of the floor check for the float rounding of ``calibrate``'s division.
FLOOR_SLACK = 1e-9


@dataclass(frozen=True)
class DPPolicy:
    """The noise floor a device enforces on every distributed-DP round it joins.

    ``min_noise_multiplier``: the least noise multiplier any sum the group releases must carry,
    whatever the task asks (0, the default: no floor of the app's own; a task that asks for
    distributed DP still always gets at least its own noise multiplier, and a device with a floor
    above 0 refuses secure rounds that add no noise at all). ``max_wrap_probability``: the largest
    probability, by the parameters' own tail bound, that the group's noisy sum wraps the modulus
    (a wrapped sum costs the round, not privacy)."""

    min_noise_multiplier: float = 0.0
    max_wrap_probability: float = DEFAULT_WRAP_PROBABILITY

    def __post_init__(self) -> None:
        if not (self.min_noise_multiplier >= 0 and math.isfinite(self.min_noise_multiplier)):
            raise ValueError(f"min_noise_multiplier must be a finite number >= 0, got {self.min_noise_multiplier!r}")
        if not 0 < self.max_wrap_probability < 1:
            raise ValueError(f"max_wrap_probability must be in (0, 1), got {self.max_wrap_probability!r}")


DEFAULT_DP_POLICY = DPPolicy()


@dataclass(frozen=True)
class DDPRound:
    """A round's distributed-DP parameters as the device accepted them, and its rotation seed."""

    params: DDPParams
    rotation_seed: int


class DPRefusal(Exception):
    """The round's DP parameters fail this device's checks; ``code`` says which kind."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def rotation_seed(commitment: bytes) -> int:
    """The round's public rotation seed, from the commitment the server showed before it knew its
    cohort (``secagg_commitment``): every device and the server derive the same one."""
    return int.from_bytes(hashlib.sha256(b"fedfleet/ddp-rotation\x00" + commitment).digest()[:8], "little")


#: What a distributed-DP group's session label ends with, before the hex digest of its DP parameters.
LABEL_MARK = b"/ddp="


def params_digest(answer: Mapping[str, object] | DDPRoundParams) -> bytes:
    """SHA-256 of the round's DP parameters as the devices receive them (``round_answer``), over
    their canonical JSON: the server and each device compute it from the same values."""
    wire = answer if isinstance(answer, DDPRoundParams) else DDPRoundParams.model_validate(answer)
    text = json.dumps(wire.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(b"fedfleet/ddp-params\x00" + text.encode()).digest()


def bound_label(label: bytes, answer: Mapping[str, object] | DDPRoundParams) -> bytes:
    """A group's Secure Aggregation session label that commits to the round's DP parameters (the
    server's side of the check in ``check_round``; see the module docstring)."""
    return label + LABEL_MARK + params_digest(answer).hex().encode()


def releasable_minimum(config: SecAggConfig) -> int:
    """The fewest masked inputs a sum of this group can hold, as an honest SecAgg client enforces
    it: over the complete graph it refuses survivor lists shorter than ``min_summed`` or the
    threshold; under SecAgg+ it checks its own neighbourhood's ``threshold`` survivors only."""
    if config.degree is None:
        return max(1, config.threshold, config.min_summed)
    return max(1, config.threshold)


def noise_problem(params: DDPParams, releasable: int, floor: float) -> str | None:
    """Why a sum of ``releasable`` devices' encodings carries less noise than ``floor`` (or the
    params' own noise multiplier) times the sensitivity, or None."""
    z = max(floor, params.noise_multiplier)
    need = (z * params.sensitivity) ** 2
    have = params.local_variance * releasable
    if have < need * (1.0 - FLOOR_SLACK):
        got = math.sqrt(have) / params.sensitivity
        return (
            f"a released sum of {releasable} devices would carry noise multiplier {got:.4g}, below "
            f"{z:.4g} (this device's floor {floor:g}, the task's {params.noise_multiplier:g})"
        )
    return None


def check_round(
    raw: object,
    *,
    config: SecAggConfig,
    group_size: int,
    dim: int | None,
    commitment: bytes | None,
    policy: DPPolicy = DEFAULT_DP_POLICY,
) -> DDPRound | None:
    """The round's DP parameters (``raw``: the ``ddp`` field of the Secure Aggregation state) once
    they pass every check of the module docstring; None for a round without DP when the policy
    has no floor. Raises ``DPRefusal``."""
    if raw is None:
        if policy.min_noise_multiplier > 0:
            raise DPRefusal(
                DP_NOISE_BELOW_FLOOR,
                f"the round adds no noise; this device's floor is noise multiplier {policy.min_noise_multiplier:g}",
            )
        return None
    try:
        wire = DDPRoundParams.model_validate(raw)
        params = DDPParams(**wire.model_dump(exclude={"rotation_seed"}))
        sensitivity = params.sensitivity
    except (ValidationError, DDPError, OverflowError, ValueError) as exc:
        raise DPRefusal(DP_PARAMS_INVALID, f"the round's DP parameters are malformed: {str(exc)[:300]}") from None
    if not (math.isfinite(sensitivity) and sensitivity > 0):
        raise DPRefusal(DP_PARAMS_INVALID, "the round's DP parameters give no finite sensitivity")
    if commitment is not None and wire.rotation_seed != rotation_seed(commitment):
        raise DPRefusal(DP_PARAMS_INVALID, "the rotation seed is not the one the round's commitment gives")
    if dim is not None and params.dim != dim:
        raise DPRefusal(
            DP_PARAMS_INVALID, f"the parameters encode {params.dim} entries; this device's update has {dim}"
        )
    if config.modulus != params.modulus:
        raise DPRefusal(
            DP_PARAMS_INVALID,
            f"the secure sum's modulus is {config.modulus}, not 2^{params.bitwidth} as the encoding's",
        )
    if config.vector_length != params.padded_dim:
        raise DPRefusal(
            DP_PARAMS_INVALID,
            f"the secure sum has {config.vector_length} entries, not the encoding's {params.padded_dim}",
        )
    if group_size > params.max_devices:
        raise DPRefusal(
            DP_PARAMS_INVALID, f"the modulus is sized for {params.max_devices} devices; the group has {group_size}"
        )
    if params.wrap_probability > policy.max_wrap_probability:
        raise DPRefusal(
            DP_PARAMS_INVALID,
            f"the modulus is sized to wrap with probability {params.wrap_probability:.3g}, "
            f"above this device's {policy.max_wrap_probability:.3g}",
        )
    problem = noise_problem(params, releasable_minimum(config), policy.min_noise_multiplier)
    if problem is not None:  # privacy first: a larger gamma both wraps the modulus and thins the noise
        raise DPRefusal(DP_NOISE_BELOW_FLOOR, problem)
    narrow = params.discreteness_problem(
        max(policy.min_noise_multiplier, params.noise_multiplier), releasable_minimum(config)
    )
    if narrow is not None:
        raise DPRefusal(DP_NOISE_BELOW_FLOOR, narrow)
    try:
        params.check_modulus()
    except DDPError as exc:
        raise DPRefusal(DP_PARAMS_INVALID, str(exc)) from None
    # last: parameters below the floor are named as such, whatever the label
    if not config.session_label.endswith(LABEL_MARK + params_digest(wire).hex().encode()):
        raise DPRefusal(
            DP_PARAMS_INVALID,
            "the group's Secure Aggregation session does not commit to these DP parameters: the other members "
            "may have been sent others",
        )
    return DDPRound(params, wire.rotation_seed)


def round_answer(params: DDPParams, seed: int) -> dict:
    """The ``ddp`` field of a Secure Aggregation state (the server's side of ``check_round``)."""
    wire = DDPRoundParams(
        dim=params.dim,
        clip=float(params.clip),
        noise_multiplier=float(params.noise_multiplier),
        gamma=float(params.gamma),
        local_variance=float(params.local_variance),
        bitwidth=params.bitwidth,
        min_devices=params.min_devices,
        max_devices=params.max_devices,
        mechanism=params.mechanism,
        beta=float(params.beta),
        wrap_probability=float(params.wrap_probability),
        rotation_seed=seed,
    )
    return wire.model_dump(mode="json")


# ---------------------------------------------------------------------------------------------
# The update as the flat vector the mechanism encodes


def update_dim(shapes: Mapping[str, Sequence[int]], weight_names: Sequence[str]) -> int:
    """The length of the flat vector of a training plan's weight deltas."""
    return int(sum(int(np.prod(shapes[w], dtype=np.int64)) for w in weight_names))


def mean_delta(update: Mapping[str, np.ndarray], weight_names: Sequence[str]) -> npt.NDArray[np.float64]:
    """A client update's mean weight change (each weight tensor is ``delta * n``), flat in the order
    of ``weight_names``: unweighted, every device counts once whatever its ``n``. An update of no
    examples changes nothing."""
    n = float(update[NUM_EXAMPLES]) if NUM_EXAMPLES in update else 1.0
    flat = np.concatenate([np.asarray(update[w], dtype=np.float64).reshape(-1) for w in weight_names])
    if not n > 0:
        return np.zeros_like(flat)
    out: npt.NDArray[np.float64] = flat / n
    return out


def encode_update(
    update: Mapping[str, np.ndarray], weight_names: Sequence[str], accepted: DDPRound, rng: np.random.Generator
) -> npt.NDArray[np.uint64]:
    """The secure sum's input: the mean delta clipped, rotated, scaled, rounded, noised, mod 2^bitwidth."""
    encoded = ddp.encode(mean_delta(update, weight_names), accepted.params, accepted.rotation_seed, rng)
    out: npt.NDArray[np.uint64] = encoded.astype(np.uint64)
    return out


__all__ = [
    "DDPRound",
    "DEFAULT_DP_POLICY",
    "DPPolicy",
    "DPRefusal",
    "DP_NOISE_BELOW_FLOOR",
    "DP_PARAMS_INVALID",
    "LABEL_MARK",
    "bound_label",
    "check_round",
    "encode_update",
    "mean_delta",
    "noise_problem",
    "params_digest",
    "releasable_minimum",
    "rotation_seed",
    "round_answer",
    "update_dim",
]
