"""Eligibility: policies evaluated on the device, the verdict in the check-in, every rejection over
real HTTP."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from device_runtime import (
    FLRuntime,
    OpStatsStore,
    Outcome,
    RetryPolicy,
    RuntimeEnvironment,
    SessionRejected,
    encode_checkpoint,
    initial_weights,
)
from device_runtime.clock import VirtualClock
from device_runtime.eligibility import EligibilityPolicies, Participation, evaluate
from example_store import SQLiteExampleStore
from server_stub import RoundConfig
from tests.support import COLLECTION, digits_plan

FAST = RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.02)


def _deploy(admin, policies: EligibilityPolicies, **config):
    plan = digits_plan()
    admin.create_population("digits")
    config.setdefault("min_reports", 1)  # rounds of a few devices, knowingly
    admin.deploy_task(
        "digits", "train", plan, encode_checkpoint(initial_weights(plan)), RoundConfig(**config), policies
    )


def _runtime(tmp_path, server, digits, n, name="d", **kwargs):
    store = SQLiteExampleStore(tmp_path / f"{name}.db")
    store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:n], digits.y_train[:n])))
    return FLRuntime("digits", server.url, store, retry=FAST, opstats=OpStatsStore(tmp_path / f"{name}.db"), **kwargs)


def test_data_availability_and_a_missing_verdict(tmp_path, server, admin, digits):
    _deploy(admin, EligibilityPolicies(min_examples=50), goal_count=5)
    with pytest.raises(SessionRejected) as rejected:
        _runtime(tmp_path, server, digits, 30, "small").run_session()
    assert rejected.value.reason == "INELIGIBLE:min_examples"
    assert _runtime(tmp_path, server, digits, 64, "big").run_session().outcome is Outcome.COMPLETED
    answer = httpx.post(f"{server.url}/v1/populations/digits/checkin", json={"runtime_version": "1.31.1"}).json()
    assert answer == {"status": "rejected", "reason": "ELIGIBILITY_REQUIRED", "retry_after_s": [5.0, 15.0]}
    lying = {"runtime_version": "1.31.1", "eligibility": {"task": "train", "eligible": "yes"}}
    r = httpx.post(f"{server.url}/v1/populations/digits/checkin", json=lying)
    assert r.status_code == 400 and r.json()["error"]["code"] == "BAD_FIELD"


def test_minimum_separation_in_rounds(tmp_path, server, admin, digits):
    _deploy(admin, EligibilityPolicies(min_separation_rounds=2), goal_count=1, over_selection=1.0)
    device = _runtime(tmp_path, server, digits, 20, "a")
    other = _runtime(tmp_path, server, digits, 20, "b")
    assert device.run_session().round == 1
    with pytest.raises(SessionRejected) as rejected:
        device.run_session()  # round 2: only one round since its last
    assert rejected.value.reason == "INELIGIBLE:min_separation_rounds"
    assert other.run_session().round == 2
    assert device.run_session().round == 3


def test_minimum_separation_in_time_and_sampling_period(tmp_path, server, admin, digits):
    _deploy(
        admin, EligibilityPolicies(min_separation_s=3600, sampling_period_s=86_400), goal_count=1, over_selection=1.0
    )
    clock = VirtualClock(start=1_767_225_600.0 + 3600)  # 01:00 UTC
    device = _runtime(tmp_path, server, digits, 20, environment=RuntimeEnvironment(clock=clock.now))
    assert device.run_session().outcome is Outcome.COMPLETED
    clock.advance(600)
    with pytest.raises(SessionRejected) as rejected:
        device.run_session()
    assert rejected.value.reason == "INELIGIBLE:min_separation_s,sampling_period_s"
    clock.advance(4 * 3600)
    with pytest.raises(SessionRejected) as rejected:
        device.run_session()
    assert rejected.value.reason == "INELIGIBLE:sampling_period_s"
    clock.advance(20 * 3600)  # the next day
    assert device.run_session().outcome is Outcome.COMPLETED


def off_or(strategy):
    """0 turns a policy off."""
    return st.just(0) | strategy


@st.composite
def eligibility_cases(draw):
    """Policies, data and a history whose times and rounds land on every side of each policy's
    boundary: exactly K rounds or S seconds later, and the last second of a sampling period and
    the first of the next. Times are whole seconds, so float arithmetic is exact."""
    policies = EligibilityPolicies(
        min_examples=draw(off_or(st.integers(1, 100))),
        min_separation_rounds=draw(off_or(st.integers(1, 6))),
        min_separation_s=float(draw(off_or(st.integers(1, 30 * 86400)))),
        sampling_period_s=float(draw(off_or(st.integers(1, 30 * 86400)))),
    )
    available = draw(st.integers(0, 120))
    last_round = draw(st.integers(0, 10_000))
    current_round = last_round + draw(st.integers(0, 10))
    at = draw(st.integers(0, 4_000_000_000))
    gaps = [st.integers(0, 90 * 86400)]
    s, period = int(policies.min_separation_s), int(policies.sampling_period_s)
    if s:
        gaps.append(st.sampled_from([s - 1, s, s + 1]))
    if period:
        to_next_period = period - at % period
        gaps.append(
            st.sampled_from([to_next_period - 1, to_next_period, to_next_period + period - 1, to_next_period + period])
        )
    now = at + draw(st.one_of(gaps))
    last = draw(st.sampled_from([None, Participation(last_round, float(at))]))
    return policies, available, last, current_round, float(now)


def expected_failures(
    policies: EligibilityPolicies, available: int, last: Participation | None, current_round: int, now: float
) -> tuple[str, ...]:
    """The policies as the README states them, in whole numbers: at least ``min_examples``;
    eligible again K rounds or S seconds after the last participation (not sooner); at most once
    per sampling period, the periods being [k*T, (k+1)*T) since the epoch."""
    failed = []
    if available < policies.min_examples:
        failed.append("min_examples")
    if last is not None:
        k, s, period = policies.min_separation_rounds, int(policies.min_separation_s), int(policies.sampling_period_s)
        if k and not current_round >= last.round + k:
            failed.append("min_separation_rounds")
        if s and not int(now) >= int(last.at) + s:
            failed.append("min_separation_s")
        if period:
            first_second_of_next_period = (int(last.at) // period + 1) * period
            if int(now) < first_second_of_next_period:  # now >= last.at: still in the last one's period
                failed.append("sampling_period_s")
    return tuple(failed)


@settings(max_examples=300)
@given(case=eligibility_cases())
@example(case=(EligibilityPolicies(min_separation_s=60.0), 0, Participation(3, 1000.0), 4, 1060.0))  # exactly S later
@example(case=(EligibilityPolicies(min_separation_s=60.0), 0, Participation(3, 1000.0), 4, 1059.0))
@example(case=(EligibilityPolicies(sampling_period_s=100.0), 0, Participation(3, 199.0), 4, 200.0))  # next period
@example(case=(EligibilityPolicies(sampling_period_s=100.0), 0, Participation(3, 200.0), 4, 299.0))  # same period
@example(case=(EligibilityPolicies(min_separation_rounds=2), 0, Participation(3, 0.0), 5, 1.0))  # exactly K later
@example(case=(EligibilityPolicies(min_separation_rounds=2), 0, Participation(3, 0.0), 4, 1.0))
@example(case=(EligibilityPolicies(min_examples=5), 5, None, 4, 1.0))
def test_verdict_matches_the_policies_for_any_history(case):
    policies, available, last, current_round, now = case
    verdict = evaluate("t", policies, examples_available=available, last=last, current_round=current_round, now=now)
    assert verdict.task == "t"
    assert verdict.failed == expected_failures(policies, available, last, current_round, now)
    assert verdict.eligible == (not verdict.failed)
    assert verdict.to_json() == {"task": "t", "eligible": not verdict.failed, "failed": list(verdict.failed)}


def test_policies_validate():
    with pytest.raises(ValueError):
        EligibilityPolicies(min_examples=-1)
    with pytest.raises(ValueError):
        EligibilityPolicies.from_dict({"min_exampels": 3})
    assert EligibilityPolicies.from_dict({"min_examples": 3}).min_examples == 3
