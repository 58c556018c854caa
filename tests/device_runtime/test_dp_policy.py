"""The device's noise floor under Secure Aggregation (device_runtime.dp_policy): whatever
distributed-DP parameters a server sends, the device either refuses them with a typed reason, or
every sum its group can release carries at least the floor's noise and fits the modulus."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from device_runtime import ddp
from device_runtime.dp_policy import (
    DEFAULT_DP_POLICY,
    DP_NOISE_BELOW_FLOOR,
    DP_PARAMS_INVALID,
    DPPolicy,
    DPRefusal,
    check_round,
    noise_problem,
    releasable_minimum,
    rotation_seed,
    round_answer,
)
from secagg import SecAggConfig, complete_graph_threshold

COMMITMENT = bytes(range(32))
SEED = rotation_seed(COMMITMENT)
DIM = 650
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def honest(z: float = 1.0, k: int = 5, n: int = 6, bitwidth: int = 32, **kw) -> tuple[ddp.DDPParams, SecAggConfig]:
    """What an honest server sends a group of ``n`` that releases no sum of fewer than ``k``."""
    config = SecAggConfig(
        vector_length=ddp.padded_dimension(DIM),
        modulus=1 << bitwidth,
        threshold=complete_graph_threshold(n),
        min_summed=k,
        consistency_check=True,
    )
    params = ddp.calibrate(
        noise_multiplier=z,
        clip=1.0,
        dim=DIM,
        bitwidth=bitwidth,
        min_devices=releasable_minimum(config),
        max_devices=n,
        **kw,
    )
    return params, config


def check(params: ddp.DDPParams, config: SecAggConfig, n: int = 6, policy: DPPolicy = DEFAULT_DP_POLICY, **wire):
    return check_round(
        {**round_answer(params, SEED), **wire},
        config=config,
        group_size=n,
        dim=DIM,
        commitment=COMMITMENT,
        policy=policy,
    )


def test_an_honest_round_passes_and_its_released_sums_carry_the_task_noise() -> None:
    params, config = honest(z=1.3)
    accepted = check(params, config)
    assert accepted is not None and accepted.params == params and accepted.rotation_seed == SEED
    assert params.effective_noise_multiplier(releasable_minimum(config)) >= 1.3 * (1 - 1e-9)


def _refused(code: str, params: ddp.DDPParams, config: SecAggConfig, **kw) -> str:
    with pytest.raises(DPRefusal) as refused:
        check(params, config, **kw)
    assert refused.value.code == code
    return str(refused.value)


def test_a_smaller_variance_is_refused() -> None:
    params, config = honest()
    _refused(DP_NOISE_BELOW_FLOOR, dataclasses.replace(params, local_variance=params.local_variance * 0.9), config)


def test_a_larger_gamma_is_refused() -> None:
    """A larger gamma widens the sensitivity the same noise must cover (and may wrap the modulus)."""
    params, config = honest(bitwidth=40)
    message = _refused(DP_NOISE_BELOW_FLOOR, dataclasses.replace(params, gamma=params.gamma * 1.5), config)
    assert "noise multiplier" in message


def test_shares_sized_for_more_devices_than_the_group_may_release_are_refused() -> None:
    """The server sizes each share for sums of 6 (``min_devices`` 6), but the group releases sums of 5."""
    params, config = honest(k=5, n=6)
    fewer = ddp.calibrate(noise_multiplier=1.0, clip=1.0, dim=DIM, bitwidth=32, min_devices=6, max_devices=6)
    assert releasable_minimum(config) == 5
    _refused(DP_NOISE_BELOW_FLOOR, fewer, config)


def test_a_modulus_the_group_could_wrap_is_refused() -> None:
    params, config = honest(bitwidth=32)
    # the same shares in 16 bits: the secure sum agrees on 2^16, but the noisy sum of 6 does not fit it
    narrow = dataclasses.replace(params, bitwidth=16)
    message = _refused(DP_PARAMS_INVALID, narrow, dataclasses.replace(config, modulus=1 << 16))
    assert "raise bitwidth to at least" in message
    # a secure sum whose modulus is not the encoding's 2^bitwidth
    _refused(DP_PARAMS_INVALID, params, dataclasses.replace(config, modulus=1 << 33))
    # a group larger than the modulus was sized for
    _refused(DP_PARAMS_INVALID, params, config, n=7)
    # a tail bound loosened to let a small modulus pass
    _refused(DP_PARAMS_INVALID, params, config, wrap_probability=0.5)


def test_discrete_gaussian_shares_too_narrow_to_carry_their_variance_are_refused() -> None:
    """A server names noise multiplier 0.05 and sizes the shares for it at gamma 1: variance 0.137
    each, which passes the variance check, but a discrete Gaussian of variance parameter 0.137 has
    variance 0.049 (it is 0 in 95 draws of 100), and the sum of six is not one discrete Gaussian
    (Kairouz et al.'s tau 7.8): the released sum would carry a third of the noise variance the
    accountant counts."""
    _, config = honest()
    base = ddp.DDPParams(
        dim=DIM,
        clip=1.0,
        noise_multiplier=0.05,
        gamma=1.0,
        local_variance=1.0,
        bitwidth=32,
        min_devices=5,
        max_devices=6,
    )
    narrow = dataclasses.replace(base, local_variance=(0.05 * base.sensitivity) ** 2 / 5)
    assert 0.1 < narrow.local_variance < 0.3 and law_variance(narrow) < narrow.local_variance / 2
    assert noise_problem(narrow, releasable_minimum(config), 0.0) is None  # the variance check alone passes it
    assert "too narrow" in _refused(DP_NOISE_BELOW_FLOOR, narrow, config)
    wide = dataclasses.replace(narrow, noise_multiplier=0.5, local_variance=(0.5 * base.sensitivity) ** 2 / 5)
    assert check(wide, config) is not None


def test_skellam_noise_small_beside_its_sensitivity_is_refused() -> None:
    """Skellam shares sized for noise multiplier 0.3 at gamma 1 (sensitivity 17): the variance check
    passes, but Agarwal et al.'s bound puts the sum's privacy loss well above the Gaussian
    mechanism's that the round is accounted as. Calibrated at the default bitwidth, the same
    mechanism passes."""
    _, config = honest()
    base = ddp.DDPParams(
        dim=DIM,
        clip=1.0,
        noise_multiplier=0.3,
        gamma=1.0,
        local_variance=1.0,
        bitwidth=32,
        min_devices=5,
        max_devices=6,
        mechanism="skellam",
    )
    small = dataclasses.replace(base, local_variance=(0.3 * base.sensitivity) ** 2 / 5)
    assert noise_problem(small, releasable_minimum(config), 0.0) is None  # the variance check alone passes it
    assert "Agarwal" in _refused(DP_NOISE_BELOW_FLOOR, small, config)
    calibrated, config = honest(z=0.3, mechanism="skellam")
    assert check(calibrated, config) is not None


def test_parameters_that_do_not_fit_the_round_are_refused() -> None:
    params, config = honest()
    _refused(DP_PARAMS_INVALID, params, config, rotation_seed=(SEED + 1) % (1 << 64))
    _refused(DP_PARAMS_INVALID, params, config, dim=DIM + 1)
    _refused(DP_PARAMS_INVALID, params, dataclasses.replace(config, vector_length=2048))
    _refused(DP_PARAMS_INVALID, params, config, gamma=-1.0)
    _refused(DP_PARAMS_INVALID, params, config, local_variance="lots")
    _refused(DP_PARAMS_INVALID, params, config, min_devices=9)  # above max_devices: not valid params


def test_an_app_floor_above_the_task_noise_refuses_the_round_and_any_round_without_noise() -> None:
    params, config = honest(z=1.0)
    floor = DPPolicy(min_noise_multiplier=1.5)
    assert "floor 1.5" in _refused(DP_NOISE_BELOW_FLOOR, params, config, policy=floor)
    with pytest.raises(DPRefusal) as refused:
        check_round(None, config=config, group_size=6, dim=DIM, commitment=COMMITMENT, policy=floor)
    assert refused.value.code == DP_NOISE_BELOW_FLOOR
    # without a floor of the app's, a secure round without DP is an ordinary secure round
    assert check_round(None, config=config, group_size=6, dim=DIM, commitment=COMMITMENT) is None


def test_a_policy_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="min_noise_multiplier"):
        DPPolicy(min_noise_multiplier=math.nan)
    with pytest.raises(ValueError, match="max_wrap_probability"):
        DPPolicy(max_wrap_probability=1.0)


def law_variance(params: ddp.DDPParams) -> float:
    """The variance of one noise share's law, summed exactly from its probability mass function
    (a discrete Gaussian's is below its variance parameter, far below for parameters under 1;
    above 64 they agree to far below float64, and Skellam's is its parameter)."""
    v = params.local_variance
    if params.mechanism == "skellam" or v > 64:
        return v
    k = np.arange(-60, 61, dtype=np.float64)
    w = np.exp(-(k * k) / (2 * v)) if v > 0 else (k == 0).astype(np.float64)
    return float((k * k * w).sum() / w.sum())


def _released_minimum(config: SecAggConfig) -> int:
    """The spec, independently of the code: an honest client refuses survivor lists below the
    threshold, and over the complete graph below ``min_summed`` too."""
    return max(1, config.threshold, config.min_summed if config.degree is None else 0)


TAMPERED = ("local_variance", "gamma", "min_devices", "max_devices", "modulus", "threshold", "min_summed", "wrap")


@SETTINGS
@given(
    z=st.floats(0.0, 4.0),
    floor=st.floats(0.0, 4.0),
    k=st.integers(2, 8),
    spare=st.integers(0, 6),
    bitwidth=st.integers(6, 62),
    mechanism=st.sampled_from(["gaussian", "skellam"]),
    tampered=st.sets(st.sampled_from(TAMPERED), max_size=3),
    factor=st.floats(0.0, 4.0),
    count=st.integers(1, 20),
    bits=st.integers(2, 62),
    wrap=st.sampled_from([2.0**-40, 2.0**-10, 0.25]),
)
def test_any_params_a_server_sends_pass_with_noise_above_the_floor_on_every_releasable_sum_or_are_refused(
    z, floor, k, spare, bitwidth, mechanism, tampered, factor, count, bits, wrap
) -> None:  # fmt: skip
    """The server keeps honest values or changes up to three fields at once (shares sized for
    another count of devices, a scaled variance or gamma, any group counts, any modulus, a
    loosened or tightened tail bound)."""
    n = k + spare
    try:
        base, honest_config = honest(z=z, k=k, n=n, bitwidth=bitwidth, mechanism=mechanism)
    except ddp.DDPError:
        event("no honest params")
        return  # nothing honest fits these: the tampered cases of other draws cover what a server may send
    config = dataclasses.replace(
        honest_config,
        modulus=1 << bits if "modulus" in tampered else honest_config.modulus,
        threshold=min(count, n) if "threshold" in tampered and count >= 2 else honest_config.threshold,
        min_summed=count if "min_summed" in tampered else honest_config.min_summed,
        allow_unsafe=True,
    )
    most = count if "max_devices" in tampered else base.max_devices
    fewest = min(count if "min_devices" in tampered else base.min_devices, most)
    sent = {  # shares sized for ``fewest`` devices, then scaled
        "local_variance": base.local_variance
        * base.min_devices
        / fewest
        * (factor if "local_variance" in tampered else 1.0),
        "gamma": base.gamma * (max(factor, 0.1) if "gamma" in tampered else 1.0),
        "min_devices": fewest,
        "max_devices": most,
        "wrap_probability": wrap if "wrap" in tampered else base.wrap_probability,
    }
    policy = DPPolicy(min_noise_multiplier=floor)
    try:
        accepted = check(base, config, n=n, policy=policy, **sent)
    except DPRefusal as refused:
        assert refused.code in (DP_NOISE_BELOW_FLOOR, DP_PARAMS_INVALID)
        event(f"refused: {refused.code}")
        return
    assert accepted is not None
    event("accepted")
    params = accepted.params
    target = max(floor, params.noise_multiplier) * params.sensitivity
    for m in range(_released_minimum(config), n + 1):  # every sum the group may release
        assert m * params.local_variance >= target**2 * (1 - 1e-9)
        if target >= 0.01 * params.sensitivity:  # the least noise multiplier a task takes: the shares' law carries it
            assert m * law_variance(params) >= target**2 * (1 - ddp.MAX_DISCRETENESS_SHARE)
    assert config.modulus == params.modulus and config.vector_length == params.padded_dim
    assert params.wrap_probability <= policy.max_wrap_probability
    params.check_modulus(n)  # the group's noisy sum fits the modulus
