"""Which task runs the next round: turns, and the weighted draw as the interval the draw falls in."""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from server_stub.task_choice import Strategy, choose_task

#: The largest value ``random.random()`` returns: [0, 1) in steps of 2**-53.
LARGEST_DRAW = 1.0 - 2.0**-53


class FixedDraw:
    """A random source whose every draw is ``value`` (and that counts its draws)."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.draws = 0

    def random(self) -> float:
        self.draws += 1
        return self.value


@given(weights=st.lists(st.floats(0, 10), min_size=1, max_size=6), turn=st.integers(0, 10**6))
def test_alternate_takes_turns_in_deployment_order_and_draws_nothing(weights, turn):
    rng = FixedDraw(0.5)
    assert choose_task(Strategy.ALTERNATE, weights, turn, rng) == turn % len(weights)
    assert rng.draws == 0


@given(n=st.integers(1, 6), turn=st.integers(0, 10**6))
def test_weights_that_sum_to_zero_fall_back_to_taking_turns(n, turn):
    assert choose_task(Strategy.WEIGHTED, [0.0] * n, turn, FixedDraw(0.5)) == turn % n


@given(
    weights=st.lists(st.integers(0, 4), min_size=1, max_size=6).filter(any),
    sixty_fourths=st.integers(0, 63),
    turn=st.integers(0, 100),
)
@example(weights=[1, 1], sixty_fourths=32, turn=0)  # on the boundary between the two
@example(weights=[2, 0, 2], sixty_fourths=32, turn=0)  # on the empty interval of a weight 0
def test_a_weighted_draw_picks_the_half_open_interval_it_falls_in(weights, sixty_fourths, turn):
    """Task i owns [w_0 + ... + w_(i-1), w_0 + ... + w_i) of [0, total): a draw on a boundary
    belongs to the task after it, and a task of weight 0 owns nothing. Small integer weights
    and draws in 64ths keep the arithmetic exact, so boundaries are hit exactly. Totals below
    one (weights 0.25, 0.5) are drawn too, by scaling."""
    for scale in (1.0, 0.125):
        scaled = [w * scale for w in weights]
        u = sixty_fourths / 64
        point = u * sum(scaled)
        lower = 0.0
        for expected, weight in enumerate(scaled):  # noqa: B007 - the loop finds `expected`, read after it
            if lower <= point < lower + weight:
                break
            lower += weight
        rng = FixedDraw(u)
        chosen = choose_task(Strategy.WEIGHTED, scaled, turn, rng)
        assert chosen == expected
        assert scaled[chosen] > 0
        assert rng.draws == 1


@given(thousandths=st.lists(st.integers(1, 1000), min_size=1, max_size=6), turn=st.integers(0, 100))
def test_the_largest_draw_picks_the_last_task_when_it_has_weight(thousandths, turn):
    """``sum`` and the running subtraction round differently, so the largest draw can survive
    every subtraction ([0.3, 0.7]: nothing is left, but nothing below zero either): it still
    names the last task, not an index past the end or before it."""
    weights = [t / 1000 for t in thousandths]
    assert choose_task(Strategy.WEIGHTED, weights, turn, FixedDraw(LARGEST_DRAW)) == len(weights) - 1


def test_the_rounding_fallthrough_is_reached():
    """The case the property above relies on exists: the draw survives every subtraction."""
    weights = [0.3, 0.7]
    pick = LARGEST_DRAW * sum(weights)
    for weight in weights:
        pick -= weight
    assert pick >= 0
    assert choose_task(Strategy.WEIGHTED, weights, 0, FixedDraw(LARGEST_DRAW)) == 1


@given(weights=st.lists(st.floats(0, 100), min_size=1, max_size=8), seed=st.integers(0, 2**32))
def test_a_weighted_choice_is_an_index_of_a_task(weights, seed):
    chosen = choose_task(Strategy.WEIGHTED, weights, 7, random.Random(seed))
    assert 0 <= chosen < len(weights)


def test_no_task_is_an_error():
    with pytest.raises(ValueError):
        choose_task(Strategy.WEIGHTED, [], 0, random.Random(0))


def test_a_task_of_weight_zero_is_never_drawn_even_by_the_largest_random_number():
    import random as _random

    from server_stub.task_choice import Strategy, choose_task

    class Largest(_random.Random):
        def random(self) -> float:
            return 1.0 - 2.0**-53

    weights = [0.2, 0.251, 0.869, 0.4, 0.1, 0.0]
    assert choose_task(Strategy.WEIGHTED, weights, 0, Largest()) == 4
