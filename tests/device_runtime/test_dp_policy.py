"""The device's noise floor under Secure Aggregation (device_runtime.dp_policy): whatever
distributed-DP parameters a server sends, the device either refuses them with a typed reason, or
every sum its group can release carries at least the floor's noise and fits the modulus."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from device_runtime import ddp
from device_runtime.dp_policy import (
    DEFAULT_DP_POLICY,
    DP_NOISE_BELOW_FLOOR,
    DP_PARAMS_INVALID,
    DPPolicy,
    DPRefusal,
    bound_label,
    check_round,
    noise_problem,
    releasable_minimum,
    rotation_seed,
    round_answer,
)
from secagg import SecAggClient, SecAggConfig, SecAggServer, UncertifiedPeer, complete_graph_threshold, parse_message
from secagg import server as secagg_server
from secagg.crypto import SigningKey
from secagg.transcript import key_signing_payload

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
    """``check_round`` of ``params`` (with ``wire``'s fields changed) as one server sends them to
    every member alike: the group's session label commits to them, as ``secure_rounds`` binds it."""
    answer = {**round_answer(params, SEED), **wire}
    try:
        config = dataclasses.replace(config, session_label=bound_label(config.session_label, answer))
    except ValidationError:
        pass  # parameters no device takes: check_round refuses them whatever the label
    return check_round(
        answer,
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


def _thinned(params: ddp.DDPParams, config: SecAggConfig, shrink: float) -> ddp.DDPParams:
    """The round's parameters with a gamma ``shrink`` times smaller and shares resized to it: as
    self-consistent as the honest ones, and as far above the floor for their own sensitivity."""
    gamma = params.gamma / shrink
    small = dataclasses.replace(params, gamma=gamma, local_variance=1.0)
    need = (params.noise_multiplier * small.sensitivity) ** 2 / releasable_minimum(config)
    return dataclasses.replace(small, local_variance=need * (1 + 1e-6))


def test_members_sent_different_parameters_fail_each_others_signatures_before_any_input(monkeypatch) -> None:
    """Equivocation: the server sends one member the honest parameters and the other five a gamma
    10,000 times smaller with shares resized to it. Each set passes its own device's floor, yet the
    group's sum would carry the first member's update (sensitivity ~gamma clip) with about its own
    share of noise only: noise multiplier z / sqrt(5) instead of z. Each group's session label
    commits to the parameters, so the two sets give two session tags; a member checks its peers'
    key signatures under its own tag, and the target refuses the roster (``UncertifiedPeer``)
    before any masked input exists."""
    params, config = honest(z=1.0, k=5, n=6)
    thin = _thinned(params, config, 1e4)
    for p in (params, thin):  # each set alone passes the device that receives it
        assert check(p, config) is not None
    m = releasable_minimum(config)
    mixed = math.sqrt(params.local_variance + (m - 1) * thin.local_variance) / params.sensitivity
    assert mixed < 0.5  # what the target's update would carry in the group's sum (z = 1 asked)

    answers = {p: round_answer(p, SEED) for p in (params, thin)}
    bound = {p: dataclasses.replace(config, session_label=bound_label(b"", a)) for p, a in answers.items()}
    with pytest.raises(DPRefusal, match="does not commit") as refused:  # the other set's session, its own params
        check_round(answers[params], config=bound[thin], group_size=6, dim=DIM, commitment=COMMITMENT)
    assert refused.value.code == DP_PARAMS_INVALID

    # the protocol itself: the target joins under its parameters' session, the others under theirs;
    # the server relays their keys under the target's tag (a message's header is not signed) and
    # skips its own check of their signatures (``key_signing_payload`` under each one's own tag)
    small = {p: dataclasses.replace(c, vector_length=4) for p, c in bound.items()}

    def target_takes_roster(others: ddp.DDPParams) -> Exception | None:
        configs = {u: small[params if u == 1 else others] for u in range(1, 7)}
        rb = random.Random(0).randbytes
        clients = {
            u: SecAggClient(
                u,
                configs[u],
                np.zeros(4, dtype=np.uint64),
                random_bytes=rb,
                signer=SigningKey(rb),
                verify_peer=lambda key, credential: True,
            )
            for u in range(1, 7)
        }
        with monkeypatch.context() as patch:
            patch.setattr(
                secagg_server,
                "key_signing_payload",
                lambda tag, u, c_pk, s_pk: key_signing_payload(configs[u].session_tag, u, c_pk, s_pk),
            )
            server = SecAggServer(configs[1], range(1, 7), random_bytes=rb)
            for u, c in clients.items():
                message = parse_message(c.start())
                server.receive(u, dataclasses.replace(message, session_tag=configs[1].session_tag).to_bytes())
            roster = server.close_round()
        assert (clients[1].handle(roster[1]) is None) == clients[1].aborted  # it shares its keys or aborts
        return clients[1].error

    assert target_takes_roster(params) is None  # one set for every member: the keys check out
    assert small[params].session_tag != small[thin].session_tag
    refused = target_takes_roster(thin)
    assert isinstance(refused, UncertifiedPeer) and "not signed" in str(refused)


@settings(max_examples=25, deadline=None)
@given(
    field=st.sampled_from(["gamma", "local_variance", "clip", "noise_multiplier", "min_devices"]),
    factor=st.floats(1.001, 1e4),
)
def test_a_device_takes_only_the_parameters_its_groups_session_commits_to(field: str, factor: float) -> None:
    """Any change to any parameter after the server bound the group's session to the honest set
    is refused by the device that receives it (and the honest set still passes)."""
    params, config = honest(z=1.0, k=5, n=6)
    answer = round_answer(params, SEED)
    config = dataclasses.replace(config, session_label=bound_label(b"task/group-0", answer))
    assert check_round(answer, config=config, group_size=6, dim=DIM, commitment=COMMITMENT) is not None
    value = answer[field] * factor
    changed = {**answer, field: int(math.ceil(value)) if field == "min_devices" else value}
    changed["max_devices"] = max(changed["max_devices"], changed["min_devices"])
    with pytest.raises(DPRefusal):
        check_round(changed, config=config, group_size=6, dim=DIM, commitment=COMMITMENT)
