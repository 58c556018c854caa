"""Sampling periods at the float edges of a period, and the policies' dict form."""

from __future__ import annotations

import math

from hypothesis import example, given
from hypothesis import strategies as st

from device_runtime.eligibility import EligibilityPolicies, Participation, evaluate

#: Periods with a fractional part (hundredths of a second, up to 30 days): for these the rounded
#: quotient t / T can reach the next whole number while t is still before k * T.
periods = st.integers(100, 30 * 86400 * 100).map(lambda c: c / 100)


@st.composite
def instants_near_a_period_boundary(draw):
    period = draw(periods)
    k = draw(st.integers(1, int(2e9 / period) + 1))
    boundary = k * period
    at = draw(st.sampled_from([math.nextafter(boundary, 0.0), boundary, math.nextafter(boundary, math.inf)]))
    return period, at


@given(case=instants_near_a_period_boundary(), last_round=st.integers(0, 100))
@example(case=(2392629.761, math.nextafter(723 * 2392629.761, 0.0)), last_round=0)
def test_a_device_is_never_sampled_twice_at_the_same_instant(case, last_round):
    """Whatever the instant, it lies in one period: a device that contributed at ``t`` is not
    eligible again at ``t``, also where ``t / T`` rounds up to the next period's number."""
    period, at = case
    policies = EligibilityPolicies(sampling_period_s=period)
    verdict = evaluate(
        "t", policies, examples_available=1, last=Participation(last_round, at), current_round=last_round + 1, now=at
    )
    assert verdict.failed == ("sampling_period_s",)
    assert not verdict.eligible


@given(
    period=st.integers(1, 30 * 86400).map(float),
    at=st.floats(1e9, 2e9),
    back=st.floats(1e-3, 365 * 86400.0),
)
def test_a_clock_set_back_before_the_last_participation_holds_the_device_out(period, at, back):
    """The user set the clock back past the device's last participation: neither its sampling
    period nor its separation admits it again until the clock is past it (set back a day, a device
    that took part at 00:10 took part again in the day it thought was yesterday)."""
    policies = EligibilityPolicies(sampling_period_s=period, min_separation_s=1.0)
    verdict = evaluate("t", policies, examples_available=1, last=Participation(0, at), current_round=1, now=at - back)
    assert verdict.failed == ("min_separation_s", "sampling_period_s")


@given(
    min_examples=st.integers(0, 10**9),
    rounds=st.integers(0, 10**9),
    seconds=st.integers(0, 10 * 365 * 86400).map(float),
    period=st.integers(0, 10 * 365 * 86400).map(float),
)
def test_policies_survive_their_dict_form(min_examples, rounds, seconds, period):
    policies = EligibilityPolicies(
        min_examples=min_examples, min_separation_rounds=rounds, min_separation_s=seconds, sampling_period_s=period
    )
    data = policies.to_dict()
    assert data == {
        "min_examples": min_examples,
        "min_separation_rounds": rounds,
        "min_separation_s": seconds,
        "sampling_period_s": period,
    }
    assert EligibilityPolicies.from_dict(data) == policies
    assert policies.empty == (not any(data.values()))
