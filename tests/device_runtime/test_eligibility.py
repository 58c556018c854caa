"""Eligibility: policies evaluated on the device, the verdict in the check-in, every rejection over
real HTTP."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from device_runtime import FLRuntime, OpStatsStore, Outcome, RetryPolicy, SessionRejected, encode_checkpoint, initial_weights
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
    admin.deploy_task("digits", "train", plan, encode_checkpoint(initial_weights(plan)), RoundConfig(**config), policies)


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
    _deploy(admin, EligibilityPolicies(min_separation_s=3600, sampling_period_s=86_400), goal_count=1, over_selection=1.0)
    clock = VirtualClock(start=1_767_225_600.0 + 3600)  # 01:00 UTC
    device = _runtime(tmp_path, server, digits, 20, clock=clock.now)
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


@given(
    available=st.integers(0, 100),
    min_examples=st.integers(0, 100),
    last_round=st.integers(0, 50),
    gap=st.integers(0, 10),
    k=st.integers(0, 5),
)
def test_verdict_is_eligible_exactly_when_nothing_failed(available, min_examples, last_round, gap, k):
    policies = EligibilityPolicies(min_examples=min_examples, min_separation_rounds=k)
    verdict = evaluate("t", policies, examples_available=available, last=Participation(last_round, 0.0), current_round=last_round + gap, now=1.0)
    assert verdict.eligible == (not verdict.failed)
    assert ("min_examples" in verdict.failed) == (available < min_examples)
    assert ("min_separation_rounds" in verdict.failed) == (k > 0 and gap < k)


def test_policies_validate():
    with pytest.raises(ValueError):
        EligibilityPolicies(min_examples=-1)
    with pytest.raises(ValueError):
        EligibilityPolicies.from_dict({"min_exampels": 3})
    assert EligibilityPolicies.from_dict({"min_examples": 3}).min_examples == 3
