"""The one-shot empirical privacy audit (``emulator.fleet.audit``) on rounds of the central DP mean
(``server_stub.central_dp.dp_mean``): canaries inserted as clients that report their direction at
the clip whenever selected. With noise (z = 1) the estimate stays below the accountant's epsilon;
with the noise off (clipping still on) it is far above it: the audit can fail. Each canary takes part
in half the rounds (which ones at random): a participation count that varied from canary to canary
would widen the fitted Gaussian by that spread, which is not the mechanism's, and lower the estimate."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.fleet import audit
from server_stub.accounting import epsilon
from server_stub.central_dp import dp_mean

DIM = 5000
CLIENTS = 20  # real clients per round
CANARIES = 20
ROUNDS = 20
CLIP = 1.0
DELTA = 1e-5


def dp_run(noise_multiplier: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A small DP-FedAvg training run with canary clients: (initial, final) flat weights."""
    rng = np.random.default_rng(seed)
    initial = rng.normal(0.0, 0.1, DIM)
    w = initial.copy()
    directions = audit.canary_directions(seed, CANARIES, DIM)
    signal = rng.normal(0.0, 1.0, DIM)
    signal *= 0.2 / np.linalg.norm(signal)
    takes_part = np.array([rng.permutation(ROUNDS) < ROUNDS // 2 for _ in range(CANARIES)])
    for t in range(ROUNDS):
        # real clients: a shared direction (what the model learns) plus their own, norms about the clip
        updates = [signal + rng.normal(0.0, 1.0 / math.sqrt(DIM), DIM) for _ in range(CLIENTS)]
        updates += [d * CLIP for d in directions[takes_part[:, t]]]
        w = w + dp_mean(updates, clip=CLIP, noise_multiplier=noise_multiplier, rng=rng).mean
    return initial, w


def test_canary_directions_are_unit_seeded_and_distinct():
    a = audit.canary_directions(7, 5, 300)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0)
    np.testing.assert_array_equal(a, audit.canary_directions(7, 5, 300))
    np.testing.assert_array_equal(a[3], audit.canary_direction(7, 3, 300))
    assert not np.allclose(a, audit.canary_directions(8, 5, 300))
    assert np.abs(a @ a.T - np.eye(5)).max() < 0.3  # nearly orthogonal in 300 dimensions


def test_fresh_canaries_cosines_follow_the_null_of_variance_one_over_d():
    delta = np.random.default_rng(1).normal(size=DIM)
    c = audit.cosines(delta, audit.canary_directions(3, 400, DIM))
    assert abs(c.mean()) < 5 / math.sqrt(DIM * 400)
    assert c.std() == pytest.approx(1 / math.sqrt(DIM), rel=0.15)


def test_flatten_and_unflatten_are_inverse():
    arrays = {"b": np.arange(3.0), "w": np.arange(6.0).reshape(2, 3)}
    flat = audit.flatten(arrays, ["w", "b"])
    back = audit.unflatten(flat, {k: v.shape for k, v in arrays.items()}, ["w", "b"])
    assert all(np.array_equal(back[k], arrays[k]) for k in arrays)


def test_with_noise_the_estimate_stays_below_the_accountants_epsilon():
    accountant = epsilon(1.0, ROUNDS, DELTA)
    for seed in range(3):
        initial, final = dp_run(1.0, seed)
        est = audit.audit(initial, final, seed=seed, canaries=CANARIES, delta=DELTA)
        assert 0 < est.epsilon < accountant, (seed, est)
        assert abs(est.null_mean) < 4 * est.null_std / math.sqrt(CANARIES)  # the fresh ones saw nothing


def test_with_the_noise_off_the_estimate_is_far_above_the_noisy_runs_accountant():
    """The audit can fail: clipping alone leaves each canary's direction plainly in the model. The
    threshold is the accountant's epsilon for the same rounds at z = 1 (about 28, an upper bound for
    any noisy run of these rounds); without noise the estimate is about twice that."""
    accountant = epsilon(1.0, ROUNDS, DELTA)
    for seed in range(3):
        initial, final = dp_run(0.0, seed)
        est = audit.audit(initial, final, seed=seed, canaries=CANARIES, delta=DELTA)
        assert est.epsilon > accountant, (seed, est)
        assert est.mean > 5 * est.null_std


def test_no_signal_is_epsilon_zero_and_a_perfect_separation_is_infinite():
    assert audit.one_shot_epsilon([-0.1, 0.05, -0.02], delta=DELTA, dim=DIM).epsilon == 0.0
    assert audit.one_shot_epsilon([0.3, 0.3, 0.3], delta=DELTA, dim=DIM).epsilon == math.inf
    with pytest.raises(audit.AuditError, match="at least 2"):
        audit.one_shot_epsilon([0.3], delta=DELTA, dim=DIM)


@settings(max_examples=30, deadline=None)
@given(mean=st.floats(0.01, 1.0), std=st.floats(0.01, 1.0), shift=st.floats(0.001, 1.0))
def test_the_estimate_grows_with_the_canaries_mean_cosine(mean: float, std: float, shift: float):
    base = np.array([mean - std, mean + std])
    lo = audit.one_shot_epsilon(base, delta=DELTA, dim=DIM).epsilon
    hi = audit.one_shot_epsilon(base + shift, delta=DELTA, dim=DIM).epsilon
    assert hi >= lo


def test_scaling_to_participation_counts_keeps_the_audit_failing_without_noise_when_counts_vary():
    """In a fleet a canary takes part only when selected: with counts that vary (here each round
    takes a canary with probability 1/2) the raw cosines' spread is mostly the counts', which caps
    the estimate; scaled per participation, the run without noise is again far above the
    accountant, and the one with noise still below it."""
    rng = np.random.default_rng(5)
    accountant = epsilon(1.0, ROUNDS, DELTA)
    for z, check in ((1.0, lambda e: e < accountant), (0.0, lambda e: e > accountant)):
        w0 = rng.normal(0.0, 0.1, DIM)
        w = w0.copy()
        directions = audit.canary_directions(1, CANARIES, DIM)
        counts = np.zeros(CANARIES)
        signal = rng.normal(0.0, 1.0, DIM)
        signal *= 0.2 / np.linalg.norm(signal)
        for _ in range(ROUNDS):
            chosen = rng.random(CANARIES) < 0.5
            counts += chosen
            updates = [signal + rng.normal(0.0, 1.0 / math.sqrt(DIM), DIM) for _ in range(CLIENTS)]
            updates += [d * CLIP for d in directions[chosen]]
            w = w + dp_mean(updates, clip=CLIP, noise_multiplier=z, rng=rng).mean
        est = audit.audit(w0, w, seed=1, canaries=CANARIES, delta=DELTA, participations=counts)
        assert check(est.epsilon), (z, est)


def test_canaries_that_never_took_part_are_left_out_of_the_fit():
    scaled = audit.per_participation([0.2, 0.1, 0.0, 0.3], [2, 1, 0, 3])
    np.testing.assert_allclose(scaled, [0.2, 0.2, 0.2])
    with pytest.raises(audit.AuditError, match="participation counts"):
        audit.per_participation([0.2, 0.1], [1])
