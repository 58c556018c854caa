"""Central DP's pure core (server_stub.central_dp): DP-FedAvg's clipped noisy mean, adaptive clipping."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy import stats

from server_stub import central_dp as cdp

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)


def updates(dim: int, min_n: int = 1) -> st.SearchStrategy[list[np.ndarray]]:
    return st.lists(arrays(np.float64, dim, elements=finite), min_size=min_n, max_size=12)


@SETTINGS
@given(us=st.integers(1, 20).flatmap(updates), clip=st.floats(0.01, 100))
def test_without_noise_the_mean_is_the_mean_of_the_clipped_updates(us: list[np.ndarray], clip: float) -> None:
    r = cdp.dp_mean(us, clip=clip, noise_multiplier=0.0, rng=np.random.default_rng(0))
    expected = np.mean([u * min(1.0, clip / max(float(np.linalg.norm(u)), 1e-300)) for u in us], axis=0)
    np.testing.assert_allclose(r.mean, expected, rtol=1e-9, atol=1e-9)
    assert r.count == len(us)
    assert r.clipped == sum(np.linalg.norm(u) > clip for u in us)


@SETTINGS
@given(
    data=st.integers(1, 10).flatmap(lambda d: st.tuples(updates(d, 2), arrays(np.float64, d, elements=finite))),
    clip=st.floats(0.01, 100),
    counts=st.lists(st.floats(0, 1e4), min_size=13, max_size=13),
    cap=st.floats(1, 1e3),
)
def test_one_device_moves_the_weighted_sum_by_at_most_the_clip(
    data: tuple[list[np.ndarray], np.ndarray],
    clip: float,
    counts: list[float],
    cap: float,
) -> None:
    us, extra = data
    w = cdp.capped_weights(counts[: len(us) + 1], cap)
    assert ((0 <= w) & (w <= 1)).all()
    rng = np.random.default_rng(0)
    without = cdp.dp_mean(
        us,
        clip=clip,
        noise_multiplier=0.0,
        rng=rng,
        weights=w[: len(us)],
        denominator=1.0,
    )
    with_one = cdp.dp_mean(
        [*us, extra],
        clip=clip,
        noise_multiplier=0.0,
        rng=rng,
        weights=w,
        denominator=1.0,
    )
    assert np.linalg.norm(with_one.mean - without.mean) <= clip * (1 + 1e-9)


def test_the_mean_carries_noise_of_std_z_clip_over_n() -> None:
    rng = np.random.default_rng(4)
    n, dim, z, clip = 50, 20_000, 1.3, 0.7
    us = [np.zeros(dim) for _ in range(n)]
    r = cdp.dp_mean(us, clip=clip, noise_multiplier=z, rng=rng)
    assert r.noise_std == pytest.approx(z * clip / n)
    assert r.mean.std() == pytest.approx(z * clip / n, rel=5 * math.sqrt(2 / dim))


def test_weights_above_one_are_refused_since_they_raise_the_sensitivity() -> None:
    with pytest.raises(cdp.CentralDPError, match="capped_weights"):
        cdp.dp_mean(
            [np.ones(3)],
            clip=1.0,
            noise_multiplier=1.0,
            rng=np.random.default_rng(0),
            weights=[2.0],
        )


@pytest.mark.parametrize("field", ["clip", "noise_multiplier"])
def test_out_of_range_parameters_are_refused_naming_the_field(field: str) -> None:
    args = {"clip": 1.0, "noise_multiplier": 1.0, field: -1.0}
    with pytest.raises(cdp.CentralDPError, match=field):
        cdp.dp_mean([np.ones(3)], rng=np.random.default_rng(0), **args)


@SETTINGS
@given(z=st.floats(0.1, 20), ratio=st.floats(0.5001, 1000))
def test_the_count_and_the_updates_compose_to_the_round_noise_multiplier(z: float, ratio: float) -> None:
    sigma_b = z * ratio
    z_delta = cdp.update_noise_multiplier(z, sigma_b)
    assert z_delta > z
    assert z_delta**-2 + (2 * sigma_b) ** -2 == pytest.approx(z**-2, rel=1e-9)


def test_a_count_noise_that_spends_the_whole_budget_is_refused() -> None:
    with pytest.raises(cdp.CentralDPError, match="must exceed noise_multiplier / 2"):
        cdp.AdaptiveClip(clip=1.0, noise_multiplier=2.0, count_stddev=1.0)


def test_the_geometric_update_shrinks_the_clip_when_too_many_updates_fit() -> None:
    s = cdp.AdaptiveClip(clip=1.0, target_quantile=0.5, learning_rate=0.2, count_stddev=5.0)
    assert cdp.next_clip(s, 0.9).clip == pytest.approx(math.exp(-0.2 * 0.4))
    assert cdp.next_clip(s, 0.1).clip > 1.0
    assert cdp.next_clip(s, 0.5).clip == pytest.approx(1.0)


@pytest.mark.parametrize("target", [0.5, 0.9])
def test_adaptive_clipping_converges_to_the_target_quantile_of_the_norms(
    target: float,
) -> None:
    rng = np.random.default_rng(7)
    n, dim = 100, 4
    state = cdp.AdaptiveClip(
        clip=0.01,
        target_quantile=target,
        learning_rate=0.2,
        count_stddev=n / 20,
        noise_multiplier=1.0,
    )

    def norm_law(size: int) -> np.ndarray:
        return rng.lognormal(mean=0.0, sigma=0.5, size=size)

    clips = []
    for _ in range(300):
        directions = rng.normal(size=(n, dim))
        directions /= np.linalg.norm(directions, axis=1, keepdims=True)
        batch = directions * norm_law(n)[:, None]
        _, state = cdp.adaptive_dp_mean(batch, state, rng)
        clips.append(state.clip)
    true_quantile = math.exp(0.5 * float(stats.norm.ppf(target)))  # lognormal(0, 0.5)
    settled = float(np.mean(clips[-100:]))
    assert settled == pytest.approx(true_quantile, rel=0.1)
    fraction = float(np.mean(norm_law(1_000_000) <= settled))
    assert fraction == pytest.approx(target, abs=0.05)


# ----------------------------------------------------------------------------- DP-FTRL's tree
@given(t=st.integers(0, 5000))
def test_the_tree_nodes_of_a_prefix_cover_its_rounds_once_each_with_one_node_per_set_bit(t: int) -> None:
    covered: list[int] = []
    for level, index in cdp.tree_nodes(t):
        covered.extend(range(index * 2**level + 1, (index + 1) * 2**level + 1))
    assert covered == list(range(1, t + 1))
    assert len(cdp.tree_nodes(t)) == bin(t).count("1")


@given(rounds=st.integers(1, 70), seed=st.integers(0, 2**32))
def test_the_rounds_noise_sums_to_the_trees_prefix_noise_and_the_tree_holds_log_t_nodes(rounds: int, seed: int) -> None:
    """After round t the sum of the rounds' noises is the noise of the nodes covering [1, t]
    (every node drawn once and kept while it covers the prefix), so it has about popcount(t)
    nodes' variance, not t rounds'."""
    rng = np.random.default_rng(seed)
    tree = cdp.TreeNoise(std=0.7)
    drawn: dict[tuple[int, int], np.ndarray] = {}
    total = np.zeros(5)
    for t in range(1, rounds + 1):
        noise, tree = cdp.tree_step(tree, 5, rng)
        total += noise
        assert tree.t == t and [k for k, _ in tree.nodes] == cdp.tree_nodes(t)
        for k, v in tree.nodes:
            assert np.array_equal(drawn.setdefault(k, v), v)  # a node's noise never changes
        np.testing.assert_allclose(total, sum(v for _, v in tree.nodes), atol=1e-9)


def test_the_prefix_noise_of_a_tree_has_the_variance_of_its_nodes() -> None:
    rng = np.random.default_rng(5)
    tree = cdp.TreeNoise(std=2.0)
    prefix = np.zeros(20_000)
    for _ in range(8):  # t = 8: one node, [1, 8]
        noise, tree = cdp.tree_step(tree, prefix.size, rng)
        prefix += noise
    assert abs(prefix.std() / 2.0 - 1) < 6 / math.sqrt(2 * prefix.size)  # one node's, not sqrt(8) times it


def test_a_tree_refuses_noise_of_another_length_and_a_negative_round() -> None:
    _, tree = cdp.tree_step(cdp.TreeNoise(std=1.0), 4, np.random.default_rng(0))
    with pytest.raises(cdp.CentralDPError, match="length"):
        cdp.tree_step(tree, 5, np.random.default_rng(0))
    with pytest.raises(cdp.CentralDPError, match="round"):
        cdp.tree_nodes(-1)
