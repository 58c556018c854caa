"""Bounding one device's influence: the example-count cap and the clipping of the mean delta."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from server_stub.influence import NUM_EXAMPLES, bound_update

WEIGHTS = ("w", "b")
values = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@st.composite
def updates(draw, *, with_count: bool | None = None):
    """A client update as the executor makes it: float32 weight deltas times n, metric sums and
    (usually) ``num_examples``; sometimes a weight the update lacks is also named."""
    update = {
        "w": draw(hnp.arrays(np.float32, draw(st.sampled_from([(3,), (2, 2)])), elements=values)),
        "b": draw(hnp.arrays(np.float32, (), elements=values)),
        "loss_sum": np.float32(draw(values)),
    }
    if with_count if with_count is not None else draw(st.booleans()):
        update[NUM_EXAMPLES] = np.float32(
            draw(st.sampled_from([0.0, 0.5, 1.0, 3.0]) | st.integers(0, 10**6).map(float))
        )
    return update


def mean_delta_norm(update, n):
    """The norm of the weights over n; with n = 0 there is no mean: 0 for no change, else infinite."""
    if n == 0:
        return 0.0 if not any(np.any(update[w]) for w in WEIGHTS) else math.inf
    return math.sqrt(sum(float(np.sum((np.asarray(update[w], np.float64) / n) ** 2)) for w in WEIGHTS))


def declared(update) -> float:
    return float(update[NUM_EXAMPLES]) if NUM_EXAMPLES in update else 1.0


@given(update=updates(), max_examples=st.integers(1, 10**6), clip=st.none() | st.floats(1e-3, 1e4))
def test_the_result_is_float32_with_the_same_tensors_and_reports_what_was_done(update, max_examples, clip):
    bounded = bound_update(update, [*WEIGHTS, "not_in_the_update"], max_examples=max_examples, clip_norm=clip)
    assert set(bounded.update) == set(update)
    assert all(v.dtype == np.float32 and v.shape == np.shape(update[k]) for k, v in bounded.update.items())
    n = declared(update)
    assert bounded.capped == (n > max_examples)
    expected_norm = mean_delta_norm(update, n)  # capping keeps the per-example means
    assert bounded.mean_delta_norm == expected_norm or math.isclose(
        bounded.mean_delta_norm, expected_norm, rel_tol=1e-9, abs_tol=1e-12
    )
    assert bounded.clipped == (clip is not None and bounded.mean_delta_norm > clip)


@given(update=updates(with_count=True), max_examples=st.integers(1, 10**6))
def test_a_capped_update_keeps_its_means_with_the_weight_of_max_examples_computed_in_float64(update, max_examples):
    """Scaled as a whole by max/n in float64 and rounded once to float32: exactly that, with no
    rounding of the factor or the products to float32 on the way."""
    n = declared(update)
    bounded = bound_update(update, WEIGHTS, max_examples=max_examples, clip_norm=None)
    scale = max_examples / n if n > max_examples else 1.0
    for name, value in update.items():
        expected = (np.asarray(value, np.float64) * scale).astype(np.float32)
        np.testing.assert_array_equal(bounded.update[name], expected)
    if bounded.capped:
        assert bounded.update[NUM_EXAMPLES] == np.float32(max_examples)


@given(update=updates(with_count=True))
def test_a_count_at_the_cap_is_not_capped(update):
    n = int(declared(update))
    bounded = bound_update(update, WEIGHTS, max_examples=max(n, 1), clip_norm=None)
    assert not bounded.capped
    for name, value in update.items():
        np.testing.assert_array_equal(bounded.update[name], value)


@given(update=updates(), clip=st.floats(1e-3, 1e3))
def test_clipping_scales_the_weights_to_the_clip_norm_and_leaves_the_rest(update, clip):
    bounded = bound_update(update, WEIGHTS, max_examples=10**7, clip_norm=clip)
    n = declared(update)
    after = mean_delta_norm(bounded.update, n)
    if bounded.clipped and n == 0:  # a weight change carried by no examples: nothing of it is left
        assert all(not np.any(bounded.update[w]) for w in WEIGHTS)
    elif bounded.clipped:
        assert math.isclose(after, clip, rel_tol=1e-5)
        factor = clip / bounded.mean_delta_norm
        for w in WEIGHTS:
            np.testing.assert_allclose(
                bounded.update[w], np.asarray(update[w], np.float64) * factor, rtol=1e-6, atol=1e-30
            )
    else:
        assert bounded.mean_delta_norm <= clip
        for w in WEIGHTS:
            np.testing.assert_array_equal(bounded.update[w], update[w])
    for name in set(update) - set(WEIGHTS):
        np.testing.assert_array_equal(bounded.update[name], update[name])


@given(update=updates())
def test_a_norm_exactly_at_the_clip_is_not_clipped(update):
    norm = bound_update(update, WEIGHTS, max_examples=10**7, clip_norm=None).mean_delta_norm
    if norm > 0:
        assert not bound_update(update, WEIGHTS, max_examples=10**7, clip_norm=norm).clipped


def test_one_device_claiming_a_huge_count_gets_the_weight_of_max_examples():
    """The attack of the module docstring: n = 1e30 with a delta that is the model's mean."""
    update = {"w": np.full(3, 2e30, np.float32), "b": np.float32(1e30), NUM_EXAMPLES: np.float32(1e30)}
    bounded = bound_update(update, WEIGHTS, max_examples=100, clip_norm=None)
    assert bounded.capped and not bounded.clipped
    np.testing.assert_allclose(bounded.update["w"], 200.0, rtol=1e-6)
    assert bounded.update[NUM_EXAMPLES] == 100


def test_an_update_without_weights_has_norm_zero_and_is_never_clipped():
    bounded = bound_update(
        {"loss_sum": np.float32(5.0), NUM_EXAMPLES: np.float32(2.0)}, WEIGHTS, max_examples=10, clip_norm=1e-9
    )
    assert bounded.mean_delta_norm == 0.0
    assert not bounded.clipped and not bounded.capped


@given(update=updates(), max_examples=st.integers(1, 10**6), clip=st.floats(1e-3, 1e4))
def test_every_bounded_update_moves_its_weights_at_most_the_clip_times_its_count(update, max_examples, clip):
    """The invariant a Secure Aggregation group's check adds up: ||delta * n|| <= clip * n, also
    for n < 1 and n = 0 (no examples, so no weight change), up to the rounding to float32."""
    bounded = bound_update(update, WEIGHTS, max_examples=max_examples, clip_norm=clip)
    n = declared(bounded.update)
    assert n <= max_examples
    norm = math.sqrt(sum(float(np.sum(np.asarray(bounded.update[w], np.float64) ** 2)) for w in WEIGHTS))
    assert norm <= clip * n * (1 + 1e-6)


@given(update=updates(with_count=True), clip=st.floats(1e-3, 1e4))
def test_an_update_within_both_bounds_comes_back_bit_for_bit(update, clip):
    """What keeps an honest group's sum unchanged by the devices' own bounding."""
    n = declared(update)
    if mean_delta_norm(update, n) > clip:
        update = {**update, **{w: np.zeros_like(update[w]) for w in WEIGHTS}}
    bounded = bound_update(update, WEIGHTS, max_examples=max(math.ceil(n), 1), clip_norm=clip)
    assert not bounded.capped and not bounded.clipped
    for name, value in update.items():
        assert bounded.update[name].tobytes() == np.asarray(value).tobytes()


@pytest.mark.parametrize("count", [-1024.0, -1e-30, math.nan, math.inf])
def test_a_negative_or_non_finite_count_is_refused_not_bounded(count):
    """Only a validated update can be bounded; a device never sends one that is not (it drops out)."""
    with pytest.raises(ValueError, match="validated"):
        bound_update(
            {"w": np.ones(3, np.float32), NUM_EXAMPLES: np.float32(count)}, WEIGHTS, max_examples=10, clip_norm=1.0
        )
