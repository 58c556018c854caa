"""The server's check of a Secure Aggregation group's decoded sum (``check_group_sum``), on the
real codec and the real plan's server graphs.

Two properties make the bound: a group of devices that bound their own updates (``bound_update``)
always passes, whatever their updates were and however quantization rounded them; and a sum that
passes, whatever one member sent, moves the committed model by at most ``clip_update_norm`` (up to
the codec's rounding), no more than one honest device could move it, and once its metric sums are
held to their meaning (``hold_metric_sums``) publishes an accuracy in [0, 1] and a loss of at least 0."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime import PlanExecutor, initial_weights
from device_runtime.secure_sum import SecureSumCodec
from server_stub.influence import FLOAT32_SLACK, NUM_EXAMPLES, bound_update, check_group_sum, hold_metric_sums
from tests.support import digits_plan

PLANS = {bits: digits_plan("softmax", secure_aggregation=True, bitwidth=bits) for bits in (24, 12)}
CODECS = {bits: SecureSumCodec(plan) for bits, plan in PLANS.items()}
EXECUTORS = {bits: PlanExecutor(plan) for bits, plan in PLANS.items()}
WEIGHTS = PLANS[24].weight_names
SIZE = sum(CODECS[24].sizes[CODECS[24].names.index(w)] for w in WEIGHTS)
STATE = initial_weights(PLANS[24], seed=0)

bitwidths = st.sampled_from(sorted(PLANS))
clips = st.floats(1e-3, 1e3)
max_examples = st.integers(1, 1000)


def raw_update(
    rng: np.random.Generator,
    codec: SecureSumCodec,
    n: float,
    delta_norm: float,
    *,
    loss: float = 2.3,
    accuracy: float = 0.5,
    per_example: float = 1.0,
) -> dict[str, np.ndarray]:
    """What a device's training could produce: weights delta * n with a mean delta of any norm,
    metric sums over n examples of ``per_example`` positions each (a sequence's labels), right in
    the share ``accuracy`` of them at a mean ``loss``."""
    delta = {w: rng.normal(size=codec.shapes[w]) for w in WEIGHTS}
    scale = delta_norm / math.sqrt(sum(float(np.sum(d**2)) for d in delta.values()))
    update = {w: (d * scale * n).astype(np.float32) for w, d in delta.items()}
    count = np.float32(n * per_example)
    update.update(
        {
            "loss_sum": np.float32(loss * count),
            "correct": min(np.float32(accuracy * count), count),
            "count": count,
            NUM_EXAMPLES: np.float32(n),
        }
    )
    return update


@st.composite
def honest_groups(draw, bits: int, clip: float, most: int):
    """The encodings of a group of 1-8 devices, each bounded as a device bounds its update."""
    codec = CODECS[bits]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    vectors = []
    for _ in range(draw(st.integers(1, 8))):
        n = draw(st.sampled_from([0.0, 0.5, 1.0]) | st.floats(1.0, 5000.0))
        metrics = dict(
            loss=draw(st.sampled_from([0.0]) | st.floats(0.0, 50.0)),
            accuracy=draw(st.sampled_from([0.0, 1.0]) | st.floats(0.0, 1.0)),
            per_example=draw(st.sampled_from([1.0]) | st.floats(1.0, 20.0)),
        )
        raw = raw_update(rng, codec, n, draw(st.floats(0.0, 1e4)), **metrics)
        bounded = bound_update(raw, WEIGHTS, max_examples=min(most, codec.max_count), clip_norm=clip)
        vectors.append(codec.encode(bounded.update, rng))
    return vectors


def decoded(bits: int, vectors: list[np.ndarray]) -> dict[str, np.ndarray]:
    return CODECS[bits].decode_sum(np.sum([v.astype(np.int64) for v in vectors], axis=0), len(vectors))


def verdict(bits: int, total: dict, members: int, most: int, clip: float) -> str | None:
    return check_group_sum(
        total, WEIGHTS, members=members, max_examples=most, clip_norm=clip, tolerance=CODECS[bits].sum_error(members)
    )


@settings(max_examples=150, deadline=None)
@given(data=st.data(), bits=bitwidths, clip=clips, most=max_examples)
def test_any_group_of_devices_that_bound_their_updates_passes(data, bits, clip, most):
    vectors = data.draw(honest_groups(bits, clip, most))
    assert verdict(bits, decoded(bits, vectors), len(vectors), most, clip) is None


@st.composite
def attacks(draw, codec: SecureSumCodec):
    """Any encoding one device can send: each entry anywhere in the codec's range."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    clip_range = codec.quantizer.clip
    shape = draw(st.sampled_from(["constant", "random", "sparse"]))
    level = draw(st.floats(-1.0, 1.0)) * clip_range * draw(st.sampled_from([1.0, 1e-2, 1e-4, 1e-6]))
    update = {}
    for name in codec.names:
        if shape == "constant":
            update[name] = np.full(codec.shapes[name], level, np.float32)
        elif shape == "random":
            update[name] = (rng.uniform(-1, 1, codec.shapes[name]) * level).astype(np.float32)
        else:
            update[name] = np.where(rng.random(codec.shapes[name]) < 0.01, level, 0.0).astype(np.float32)
    for name in (NUM_EXAMPLES, "loss_sum", "correct", "count"):
        update[name] = np.float32(draw(st.sampled_from([0.0]) | st.floats(-1.0, 1.0)) * clip_range)
    return codec.encode(update, rng)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), bits=bitwidths, clip=clips, most=max_examples)
def test_whatever_one_member_sends_a_passing_sum_moves_the_model_at_most_the_clip_norm(data, bits, clip, most):
    """The committed model (the plan's own report and update graphs over the group's sum) moves by
    at most ``clip_update_norm``, widened only by the codec's rounding (``sum_error``)."""
    honest = data.draw(honest_groups(bits, clip, most))
    vectors = [*honest, data.draw(attacks(CODECS[bits]))]
    members = len(vectors)
    total = decoded(bits, vectors)
    if verdict(bits, total, members, most, clip) is not None:
        return
    executor = EXECUTORS[bits]
    model, metrics = executor.update(
        STATE, executor.report(executor.accumulate(executor.zero(), hold_metric_sums(total)))
    )
    moved = math.sqrt(sum(float(np.sum((np.asarray(model[w], np.float64) - STATE[w]) ** 2)) for w in WEIGHTS))
    tol = CODECS[bits].sum_error(members)
    assert moved <= clip * (1 + FLOAT32_SLACK) * (1 + tol) + tol * math.sqrt(SIZE) + 1e-5
    assert 0.0 <= metrics["train_accuracy"] <= 1.0 and metrics["train_loss"] >= 0.0, metrics


def test_a_device_may_spend_the_budget_its_group_leaves_but_no_more():
    """The bound that remains: with four honest devices that barely move, a fifth may move the
    group's mean up to the clip norm (its group's slack), and a hair above it is refused."""
    codec, clip, most = CODECS[24], 10.0, 1000
    rng = np.random.default_rng(0)
    honest = [codec.encode(raw_update(rng, codec, 100.0, 1e-6), rng) for _ in range(4)]
    direction = rng.normal(size=SIZE)
    direction /= np.linalg.norm(direction)

    def attacker(norm: float) -> np.ndarray:
        flat = direction * norm
        update, at = {}, 0
        for name in WEIGHTS:
            size = codec.sizes[codec.names.index(name)]
            update[name] = flat[at : at + size].reshape(codec.shapes[name]).astype(np.float32)
            at += size
        update.update({name: np.float32(0) for name in ("loss_sum", "correct", "count")})
        update[NUM_EXAMPLES] = np.float32(100)
        return codec.encode(update)

    budget = clip * 500  # the group's total count times the clip: the attacker's own 100 and the others' 400
    within = decoded(24, [*honest, attacker(budget * 0.999)])
    assert verdict(24, within, 5, most, clip) is None
    assert (
        np.sqrt(sum(np.sum(within[w].astype(np.float64) ** 2) for w in WEIGHTS)) / float(within[NUM_EXAMPLES]) <= clip
    )
    assert verdict(24, decoded(24, [*honest, attacker(budget * 1.01)]), 5, most, clip) is not None


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({NUM_EXAMPLES: -624.0}, "outside [0, 5000]"),  # the group: 4 x 100 examples and one -1024
        ({NUM_EXAMPLES: 5001.0}, "outside [0, 5000]"),
        ({"w0": math.inf}, "NaN or infinite"),
        ({"loss_sum": math.nan}, "NaN or infinite"),
        ({"w0": 1024.0 * 5}, "norm of the sum's weight tensors"),
        ({"correct": 1224.0}, "correct (1224) exceeds its count (200)"),  # one member's 1,024 over its count of 0
        ({"correct": 401.0, "count": math.nan}, "NaN or infinite"),
        ({"loss_sum": -1024.0}, "loss_sum is -1024, but it sums non-negative"),
        ({"count": -0.5, "correct": 0.0}, "count is -0.5"),
    ],
)
def test_a_sum_outside_the_bounds_is_refused_with_the_reason(change, words):
    total = {name: np.zeros(shape, np.float32) for name, shape in CODECS[24].shapes.items()}
    total[NUM_EXAMPLES] = np.float32(400.0)
    total.update(count=np.float32(200.0), correct=np.float32(100.0))
    for name, value in change.items():
        total[name] = np.full(CODECS[24].shapes[name], value, np.float32)
    reason = verdict(24, total, 5, 1000, 10.0)
    assert reason is not None and words in reason


def test_without_a_clip_norm_or_weights_only_the_count_and_finiteness_are_checked():
    total = {"w0": np.full((64, 10), 1e6, np.float32), NUM_EXAMPLES: np.float32(10.0)}
    assert check_group_sum(total, WEIGHTS, members=5, max_examples=10, clip_norm=None) is None
    assert check_group_sum(total, (), members=5, max_examples=10, clip_norm=1.0) is None
    assert (
        check_group_sum({**total, NUM_EXAMPLES: np.float32(51)}, (), members=5, max_examples=10, clip_norm=1.0)
        is not None
    )


def test_without_a_count_the_right_answers_are_held_to_the_examples():
    total = {"w0": np.zeros((64, 10), np.float32), "correct": np.float32(11.0), NUM_EXAMPLES: np.float32(10.0)}
    reason = check_group_sum(total, WEIGHTS, members=1, max_examples=10, clip_norm=1.0)
    assert reason is not None and "exceeds its num_examples (10)" in reason
    assert (
        check_group_sum({**total, "correct": np.float32(10.0)}, WEIGHTS, members=1, max_examples=10, clip_norm=1.0)
        is None
    )


@pytest.mark.parametrize(
    ("sums", "held"),
    [
        (dict(loss_sum=-0.001, correct=-0.001, count=-0.001), dict(loss_sum=0.0, correct=0.0, count=0.0)),
        (dict(loss_sum=3.0, correct=10.002, count=10.0), dict(loss_sum=3.0, correct=10.0, count=10.0)),
        (dict(loss_sum=3.0, correct=0.001, count=-0.001), dict(loss_sum=3.0, correct=0.0, count=0.0)),
        (dict(loss_sum=3.0, correct=4.0, count=10.0), dict(loss_sum=3.0, correct=4.0, count=10.0)),
    ],
)
def test_a_passing_sums_metric_sums_are_held_to_their_meaning_and_nothing_else_changes(sums, held):
    """Within the codec's rounding (0.0012 per entry for five members at 24 bits) a sum passes
    (``correct`` a hair above its count, a count a hair below 0): held, its accuracy is in [0, 1] however small the count, and every other tensor is as it came."""
    total = {name: np.full(shape, 0.25, np.float32) for name, shape in CODECS[24].shapes.items()}
    total[NUM_EXAMPLES] = np.float32(10.0)
    total.update({name: np.float32(value) for name, value in sums.items()})
    assert verdict(24, total, 5, 1000, 10.0) is None
    out = hold_metric_sums(total)
    assert {name: float(out[name]) for name in held} == held
    assert all(out[name].dtype == np.float32 for name in out)
    assert all(np.array_equal(out[name], total[name]) for name in total if name not in held)
