"""The device's privacy floor: what it accepts from a server, whatever the server says."""

from __future__ import annotations

import dataclasses
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime import DEFAULT_SECAGG_POLICY, SecAggPolicy
from secagg import SecAggConfig, UnsafeParameters, complete_graph_threshold, secagg_plus_parameters, seed_commitment

COMMIT = seed_commitment(bytes(32))


def good(n: int, **kw) -> SecAggConfig:
    return SecAggConfig.for_cohort(n, 10, consistency_check=True, min_summed=5, graph_commitment=COMMIT, **kw)


@settings(max_examples=15, deadline=None)
@given(st.one_of(st.integers(5, 400), st.sampled_from([1000, 3000])))
def test_the_librarys_own_parameters_meet_the_default_floor(n):
    assert DEFAULT_SECAGG_POLICY.violation(good(n), n) is None


@settings(max_examples=60, deadline=None)
@given(n=st.integers(5, 200), data=st.data())
def test_a_complete_graph_threshold_at_or_below_two_thirds_is_refused(n, data):
    t = data.draw(st.integers(2, n))
    cfg = dataclasses.replace(good(n, secagg_plus=False), threshold=t, allow_unsafe=True)
    reason = DEFAULT_SECAGG_POLICY.violation(cfg, n)
    assert (reason is None) == (3 * t > 2 * n)
    if reason is not None:
        assert f"threshold {t} is not above 2n/3" in reason and str(complete_graph_threshold(n)) in reason


@settings(max_examples=60, deadline=None)
@given(n=st.integers(5, 200), gamma=st.floats(0.0, 0.95), data=st.data())
def test_a_complete_graph_threshold_holds_the_colluders_the_app_assumes(n, gamma, data):
    """Over the complete graph a server that shows two halves of the honest members two survivor
    lists (one with a device, one without) needs t shares from each half, its colluders giving
    theirs to both: secure only where 2t > n + cn. The floor was 2n/3 whatever the app assumed, so a
    policy of c = 0.8 took t = 7 of 10, which 8 colluders and one honest member reach both ways."""
    t = data.draw(st.integers(2, n))
    cfg = dataclasses.replace(good(n, secagg_plus=False), threshold=t, allow_unsafe=True)
    reason = SecAggPolicy(corrupt_fraction=gamma).violation(cfg, n)
    assert (reason is None) == (3 * t > 2 * n and 2 * t > n * (1 + Fraction(str(gamma))))  # as the fraction written
    if reason is not None and 3 * t > 2 * n:
        assert f"threshold {t} is too low for a group of {n}" in reason and "t > n(1 + c)/2" in reason
    assert SecAggPolicy(corrupt_fraction=0.8).violation(dataclasses.replace(cfg, threshold=n), n) is None
    # and the library's complete graph for that fraction is what such a device takes
    chosen = good(n, secagg_plus=False, corrupt_fraction=gamma)
    assert SecAggPolicy(corrupt_fraction=gamma).violation(chosen, n) is None


@pytest.mark.parametrize(
    "change,words",
    [
        (dict(consistency_check=False), "ConsistencyCheck is off"),
        (dict(min_summed=2), "sums of 2 devices"),
        (dict(graph_commitment=b""), "committed to no seed"),
        (dict(threshold=2), "threshold 2 is not above 2n/3"),
    ],
)
def test_each_weakening_is_refused_with_its_reason(change, words):
    cfg = dataclasses.replace(good(10), allow_unsafe=True, **change)
    assert words in DEFAULT_SECAGG_POLICY.violation(cfg, 10)


def test_a_group_below_the_minimum_is_refused():
    assert "group of 4 devices" in DEFAULT_SECAGG_POLICY.violation(good(4), 4)
    assert SecAggPolicy(min_group_size=3).violation(dataclasses.replace(good(4), min_summed=3), 4) is None


def test_secagg_plus_degree_and_threshold_follow_bell_et_al():
    n = 1000
    cfg = good(n, secagg_plus=True)
    floor = secagg_plus_parameters(n)
    assert (cfg.degree, cfg.threshold) == (floor.degree, floor.threshold)
    assert DEFAULT_SECAGG_POLICY.violation(cfg, n) is None
    sparse = dataclasses.replace(cfg, degree=floor.degree - 10, threshold=(floor.degree - 10) // 2 + 2)
    assert "degree" in DEFAULT_SECAGG_POLICY.violation(sparse, n)
    majority = dataclasses.replace(cfg, threshold=cfg.degree // 2, allow_unsafe=True)
    assert "not a majority" in DEFAULT_SECAGG_POLICY.violation(majority, n)
    low = dataclasses.replace(cfg, threshold=cfg.degree // 2 + 1)
    assert low.threshold < floor.threshold
    assert "too low for degree" in DEFAULT_SECAGG_POLICY.violation(low, n)
    # a server that assumes fewer colluders than the device does
    assert DEFAULT_SECAGG_POLICY.violation(good(n, secagg_plus=True, corrupt_fraction=0.05), n) is not None


def test_the_library_refuses_unsafe_parameters_unless_asked():
    with pytest.raises(UnsafeParameters, match="majority"):
        SecAggConfig(10, 2**16, 3, degree=6)
    SecAggConfig(10, 2**16, 3, degree=6, allow_unsafe=True)
    with pytest.raises(UnsafeParameters, match="allow_unsafe"):
        SecAggConfig(10, 2**16, 6).check_cohort(9)
    SecAggConfig(10, 2**16, 7).check_cohort(9)
    SecAggConfig(10, 2**16, 6, allow_unsafe=True).check_cohort(9)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(5, 600),
    require_check=st.booleans(),
    min_group=st.integers(2, 5),
    sparse=st.booleans(),
    check=st.booleans(),
)
def test_a_policy_accepts_only_groups_whose_devices_see_the_whole_survivor_list(
    n, require_check, min_group, sparse, check
):
    """A device holds ``min_group_size`` on a released sum by counting the survivor list it is
    shown, which is the whole list over the complete graph and under ConsistencyCheck; a SecAgg+
    device without ConsistencyCheck is shown its neighbourhood's part only. So no policy, not even
    ``require_consistency_check=False``, accepts a sparse graph without ConsistencyCheck, and that
    policy still takes the library's own parameters in every other case."""
    policy = SecAggPolicy(min_group_size=min_group, require_consistency_check=require_check)
    cfg = SecAggConfig.for_cohort(
        n, 10, consistency_check=check, min_summed=5, graph_commitment=COMMIT, secagg_plus=sparse and n > 40
    )
    seen_whole = cfg.degree is None or cfg.degree >= n - 1 or cfg.consistency_check
    reason = policy.violation(cfg, n)
    if not seen_whole:
        assert reason is not None
        assert ("ConsistencyCheck is off" if require_check else f"minimum of {min_group} inputs") in reason
    else:
        assert (reason is None) == (check or not require_check)


def _sparse(n: int, k: int) -> SecAggConfig:
    return SecAggConfig(10, 2**20, k // 2 + 1, degree=k, consistency_check=True, min_summed=5, graph_commitment=COMMIT)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(6, 160),
    gamma=st.sampled_from([0.0, 0.05, 1 / 3, 0.5, 0.8, 0.9]),
    delta=st.sampled_from([0.0, 0.05, 0.2, 0.4]),
    data=st.data(),
)
def test_a_degree_is_refused_exactly_when_it_is_below_the_librarys_least(n, gamma, delta, data):
    """The device looks for a qualifying degree no further than the one it was sent; its answer
    is still the floor's: refused exactly when k < secagg_plus_parameters(n).degree."""
    k = 2 * data.draw(st.integers(1, (n - 2) // 2))
    policy = SecAggPolicy(corrupt_fraction=gamma, dropout_rate=delta)
    reason = policy.violation(_sparse(n, k), n)
    below = k < secagg_plus_parameters(n, gamma, delta).degree
    assert (reason is not None and f"SecAgg+ degree {k} is below the least for n = {n}" in reason) == below


@pytest.mark.parametrize("n,k,gamma", [(3000, 2996, 0.8), (10**7, 4096, 0.9)])
def test_judging_a_sparse_group_under_many_colluders_is_cheap(n, k, gamma):
    """A server's sparse configuration made a device assuming 80% colluders search every degree
    up to n with every threshold (15 s of CPU for n = 3,000; with 90%, 10^7 degrees)."""
    start = time.process_time()
    reason = SecAggPolicy(corrupt_fraction=gamma).violation(_sparse(n, k), n)
    assert reason is not None and f"SecAgg+ degree {k} is below the least" in reason
    assert time.process_time() - start < 3.0
