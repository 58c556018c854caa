"""The server's side of distributed DP (server_stub.ddp_rounds): the largest group it calibrates
for, the decoded group sum as the plan's update, and the check that drops a sum honest devices
could not have given."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from device_runtime import ddp
from device_runtime.dp_policy import mean_delta
from device_runtime.executor import PlanExecutor
from secagg import Round, SecAggConfig, assign_groups, run_protocol
from server_stub import DPConfig, RoundConfig
from server_stub.ddp_rounds import (
    MAX_EXACT_BITWIDTH,
    decode_group,
    distributed_dp,
    largest_group,
    norm_bound,
    sum_problem,
)
from tests.support import digits_plan

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PLAN = digits_plan("softmax", secure_aggregation=True)
SPEC = PlanExecutor(PLAN).client_update_spec()
NAMES = PLAN.weight_names


@SETTINGS
@given(
    selected=st.integers(1, 80),
    target=st.integers(1, 80),
    k=st.integers(2, 12),
    spare=st.integers(0, 4),
    seed=st.binary(min_size=32, max_size=32),
)
def test_no_group_is_larger_than_the_largest_group_calibrated_for(selected, target, k, spare, seed) -> None:
    selected = min(selected, target)  # a round selects at most its target
    members = [i.to_bytes(4, "little") for i in range(selected)]
    groups = assign_groups(seed, members, k, spare)
    assert all(len(g) <= largest_group(target, k, spare) for g in groups)


def _ddp(z: float, clip: float, mechanism: str = "gaussian"):
    config = RoundConfig(dp=DPConfig(mode="distributed", noise_multiplier=z, clip=clip, mechanism=mechanism))  # type: ignore[arg-type]
    out = distributed_dp(PLAN, PlanExecutor(PLAN), config)
    assert out is not None
    return out


def _update(rng: np.random.Generator, scale: float) -> dict[str, np.ndarray]:
    n = float(rng.integers(1, 50))
    update = {w: (rng.normal(0.0, scale, SPEC[w][0]) * n).astype(np.float32) for w in NAMES}
    update.update({m: np.float32(rng.uniform(0, n)) for m in ("loss_sum", "correct", "count")})
    update["num_examples"] = np.float32(n)
    return update


@SETTINGS
@given(
    count=st.integers(2, 8),
    z=st.sampled_from([0.0, 0.5, 2.0]),
    mechanism=st.sampled_from(["gaussian", "skellam"]),
    scale=st.floats(1e-4, 1.0),
    seed=st.integers(0, 2**32),
)
def test_an_honest_group_sum_decodes_to_its_clipped_mean_deltas_and_is_never_dropped(
    count, z, mechanism, scale, seed
) -> None:
    rng = np.random.default_rng(seed)
    clip = 0.1
    settings_ = _ddp(z, clip, mechanism)
    params = settings_.calibrate(count, count)
    rotation = int(rng.integers(0, 2**63))
    updates = [_update(rng, scale) for _ in range(count)]
    total = np.zeros(params.padded_dim, np.int64)
    for u in updates:
        total = ddp.add_mod(total, ddp.encode(mean_delta(u, NAMES), params, rotation, rng), params.modulus)
    flat = decode_group(total, params, rotation, count)
    summed = settings_.group_total(flat, count)
    assert sum_problem(summed, NAMES, params, count) is None
    assert float(summed["num_examples"]) == count  # every device weighs 1
    assert all(float(summed[m]) == 0.0 for m in ("loss_sum", "correct", "count"))  # never sent
    assert {k: (v.shape, v.dtype) for k, v in summed.items()} == {k: (s, np.dtype(d)) for k, (s, d) in SPEC.items()}
    clipped = sum(ddp.clip_l2(mean_delta(u, NAMES), clip) for u in updates)
    error = float(np.linalg.norm(flat - clipped))
    rounding = count * math.sqrt(params.padded_dim) / params.gamma
    if z == 0.0:
        assert error <= rounding + 1e-9
    else:  # the noise: about central_std(count) on each coordinate
        assert error <= rounding + 2.0 * params.central_std(count) * math.sqrt(params.dim)


def test_a_sum_out_of_bounds_or_not_finite_is_dropped() -> None:
    settings_ = _ddp(1.0, 0.1)
    params = settings_.calibrate(5, 6)
    limit = norm_bound(params, 5)
    assert limit >= 5 * 0.1 + params.central_std(5) * math.sqrt(params.padded_dim)  # clip x members, plus the noise
    inside = settings_.group_total(np.full(settings_.dim, 0.99 * limit / math.sqrt(settings_.dim)), 5)
    assert sum_problem(inside, NAMES, params, 5) is None
    outside = settings_.group_total(np.full(settings_.dim, 1.01 * limit / math.sqrt(settings_.dim)), 5)
    assert "above" in (sum_problem(outside, NAMES, params, 5) or "")
    broken = settings_.group_total(np.full(settings_.dim, np.nan), 5)
    assert "NaN or infinite" in (sum_problem(broken, NAMES, params, 5) or "")


@pytest.mark.parametrize("bitwidth", [24, 32, MAX_EXACT_BITWIDTH])
def test_secure_aggregation_sums_the_encodings_mod_two_to_the_bitwidth_and_they_decode(bitwidth: int) -> None:
    """The secure sum of a distributed-DP round is over ``2^bitwidth`` (up to the widest a deploy
    takes) and the padded dimension: the real protocol's sum decodes to the devices' clipped sum."""
    settings_ = _ddp(0.0, 0.1)
    settings_ = dataclasses.replace(settings_, bitwidth=bitwidth)
    params = settings_.calibrate(5, 6)
    config = dataclasses.replace(SecAggConfig.for_cohort(6, params.padded_dim, bitwidth=1), modulus=params.modulus)
    rng = np.random.default_rng(bitwidth)
    updates = {u: _update(rng, 0.05) for u in range(1, 7)}
    encoded = {u: ddp.encode(mean_delta(x, NAMES), params, 11, rng).astype(np.uint64) for u, x in updates.items()}
    outcome = run_protocol(config, encoded, drops={Round.MASKED_INPUT_COLLECTION: {2}})
    summed = sorted(outcome.server.summed_clients)
    assert summed == [1, 3, 4, 5, 6]
    flat = decode_group(outcome.result, params, 11, len(summed))
    clipped = sum(ddp.clip_l2(mean_delta(updates[u], NAMES), 0.1) for u in summed)
    assert np.linalg.norm(flat - clipped) <= len(summed) * math.sqrt(params.padded_dim) / params.gamma + 1e-9
