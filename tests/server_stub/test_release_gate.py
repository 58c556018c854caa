"""The deploy gate, as a pure function: a report lets a task through exactly when it covers every
claimed release with a passed result bound to the uploaded plans; otherwise the refusal names the
release and the check."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server_stub.release_gate import REPORT_FORMAT, ReleaseGateError, check_release_report, minor_key

RELEASES = ["1.15.1", "1.17.3", "1.20.1", "1.23.2", "1.31.1"]
PLAN = hashlib.sha256(b"unversioned").hexdigest()


def vhash(release: str) -> str:
    return hashlib.sha256(release.encode()).hexdigest()


def entry(release: str, failing: str | None = None) -> dict:
    checks = [{"name": "loads", "passed": True, "detail": ""}, {"name": "equivalence", "passed": True, "detail": ""},
              {"name": "loss_decreases", "passed": failing != "loss_decreases", "detail": "losses 2.3, 2.4"}]
    return {"runtime": release, "plan_sha256": vhash(release), "passed": failing is None, "checks": checks}


def report(claimed: list[str], failing: dict[str, str] | None = None) -> dict:
    failing = failing or {}
    return {
        "format": REPORT_FORMAT, "task": "t", "plan_sha256": PLAN, "claimed": claimed,
        "reference": entry("host"), "results": {r: entry(r, failing.get(r)) for r in claimed},
    }


@given(claimed=st.lists(st.sampled_from(RELEASES), min_size=1, unique=True), data=st.data())
def test_a_report_passes_exactly_when_every_claimed_release_passed(claimed, data):
    failing = {r: "loss_decreases" for r in data.draw(st.lists(st.sampled_from(claimed), unique=True))}
    uploaded = {r: vhash(r) for r in claimed}
    if not failing:
        assert check_release_report(report(claimed, failing), PLAN, uploaded) == claimed
        return
    with pytest.raises(ReleaseGateError) as refused:
        check_release_report(report(claimed, failing), PLAN, uploaded)
    first = next(r for r in claimed if r in failing)
    assert refused.value.code == "RELEASE_TEST_FAILED"
    assert (refused.value.runtime, refused.value.check) == (first, "loss_decreases")
    assert first in refused.value.message and "loss_decreases" in refused.value.message


@given(claimed=st.lists(st.sampled_from(RELEASES), min_size=2, unique=True), data=st.data())
def test_a_claimed_release_without_a_result_is_named(claimed, data):
    missing = data.draw(st.sampled_from(claimed))
    r = report(claimed)
    del r["results"][missing]
    with pytest.raises(ReleaseGateError) as refused:
        check_release_report(r, PLAN, {v: vhash(v) for v in claimed})
    assert refused.value.code == "RELEASE_REPORT_INCOMPLETE" and refused.value.runtime == missing


def test_the_report_must_be_bound_to_the_uploaded_plans():
    claimed = ["1.15.1", "1.31.1"]
    uploaded = {r: vhash(r) for r in claimed}
    with pytest.raises(ReleaseGateError, match="not the uploaded plan") as refused:
        check_release_report(report(claimed), hashlib.sha256(b"other").hexdigest(), uploaded)
    assert refused.value.code == "RELEASE_REPORT_MISMATCH"
    with pytest.raises(ReleaseGateError, match="1.31.1.*not the uploaded versioned plan") as refused:
        check_release_report(report(claimed), PLAN, {**uploaded, "1.31.1": vhash("tampered")})
    assert refused.value.runtime == "1.31.1"
    with pytest.raises(ReleaseGateError, match="missing \\['1.31.1'\\]"):
        check_release_report(report(claimed), PLAN, {"1.15.1": vhash("1.15.1")})


def test_a_failed_reference_run_fails_the_gate():
    r = report(["1.31.1"])
    r["reference"] = entry("host", failing="loss_decreases")
    with pytest.raises(ReleaseGateError, match="reference run failed release test 'loss_decreases'"):
        check_release_report(r, PLAN, {"1.31.1": vhash("1.31.1")})


@given(st.one_of(st.none(), st.integers(), st.text(), st.lists(st.text()),
                 st.dictionaries(st.text(), st.recursive(st.none() | st.booleans() | st.text(), lambda c: st.lists(c) | st.dictionaries(st.text(), c)))))
def test_anything_that_is_not_a_report_is_refused_as_malformed(garbage):
    with pytest.raises(ReleaseGateError) as refused:
        check_release_report(garbage, PLAN, {"1.31.1": vhash("1.31.1")})
    assert refused.value.code == "RELEASE_REPORT_MALFORMED"


def test_devices_are_served_per_minor_release():
    assert minor_key("1.17.3") == minor_key("1.17.0") == "1.17" != minor_key("1.18.1")


TRAINED = hashlib.sha256(b"training plan").hexdigest()


def evaluation_report(claimed: list[str], measured: str = TRAINED) -> dict:
    return {**report(claimed), "kind": "eval", "evaluates": {"task": "train", "plan_sha256": measured}}


@given(trained=st.lists(st.sampled_from(RELEASES), min_size=1, unique=True),
       claimed=st.lists(st.sampled_from(RELEASES), min_size=1, unique=True))
def test_an_evaluation_passes_only_when_it_claims_every_release_its_training_task_claims(trained, claimed):
    uploaded = {r: vhash(r) for r in claimed}
    uncovered = [r for r in trained if r not in claimed]
    if not uncovered:
        assert check_release_report(evaluation_report(claimed), PLAN, uploaded, evaluates_plan_sha256=TRAINED,
                                    evaluates_runtimes=trained) == claimed
        return
    with pytest.raises(ReleaseGateError) as refused:
        check_release_report(evaluation_report(claimed), PLAN, uploaded, evaluates_plan_sha256=TRAINED, evaluates_runtimes=trained)
    assert (refused.value.code, refused.value.runtime) == ("RELEASE_REPORT_INCOMPLETE", uncovered[0])


def test_an_evaluation_must_have_measured_the_uploaded_training_plans_models():
    claimed = ["1.15.1", "1.31.1"]
    uploaded = {r: vhash(r) for r in claimed}
    other = hashlib.sha256(b"another training plan").hexdigest()
    with pytest.raises(ReleaseGateError, match="models of training plan") as refused:
        check_release_report(evaluation_report(claimed, measured=other), PLAN, uploaded, evaluates_plan_sha256=TRAINED)
    assert refused.value.code == "RELEASE_REPORT_MISMATCH"
    with pytest.raises(ReleaseGateError, match="not an evaluation task's"):  # a training task's report
        check_release_report(report(claimed), PLAN, uploaded, evaluates_plan_sha256=TRAINED)
    assert check_release_report(evaluation_report(claimed), PLAN, uploaded) == claimed  # deployed on its own
