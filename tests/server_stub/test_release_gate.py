"""The deploy gate, as a pure function: a report lets a task through exactly when it covers every
claimed release with a passed result bound to the uploaded plans; otherwise the refusal names the
release and the check."""

from __future__ import annotations

import base64
import copy
import hashlib
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from emulator.toolchain.release_signing import public_key_bytes, sign_report
from server_stub.release_gate import (
    MAX_REPORT_BYTES,
    RECORDED_RELEASES,
    REPORT_FORMAT,
    ReleaseGateError,
    canonical_json,
    check_release_report,
    check_release_signature,
    known_release,
    minor_key,
)
from server_stub.schemas import TaskDeploy

RELEASES = ["1.15.1", "1.17.3", "1.20.1", "1.23.2", "1.31.1"]
PLAN = hashlib.sha256(b"unversioned").hexdigest()


def vhash(release: str) -> str:
    return hashlib.sha256(release.encode()).hexdigest()


def entry(release: str, failing: str | None = None) -> dict:
    checks = [
        {"name": "loads", "passed": True, "detail": ""},
        {"name": "equivalence", "passed": True, "detail": ""},
        {"name": "loss_decreases", "passed": failing != "loss_decreases", "detail": "losses 2.3, 2.4"},
    ]
    return {"runtime": release, "plan_sha256": vhash(release), "passed": failing is None, "checks": checks}


def report(claimed: list[str], failing: dict[str, str] | None = None) -> dict:
    failing = failing or {}
    return {
        "format": REPORT_FORMAT,
        "task": "t",
        "plan_sha256": PLAN,
        "claimed": claimed,
        "reference": entry("host"),
        "results": {r: entry(r, failing.get(r)) for r in claimed},
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


@given(
    st.one_of(
        st.none(),
        st.integers(),
        st.text(),
        st.lists(st.text()),
        st.dictionaries(
            st.text(),
            st.recursive(st.none() | st.booleans() | st.text(), lambda c: st.lists(c) | st.dictionaries(st.text(), c)),
        ),
    )
)
def test_anything_that_is_not_a_report_is_refused_as_malformed(garbage):
    with pytest.raises(ReleaseGateError) as refused:
        check_release_report(garbage, PLAN, {"1.31.1": vhash("1.31.1")})
    assert refused.value.code == "RELEASE_REPORT_MALFORMED"


def test_devices_are_served_per_minor_release():
    assert minor_key("1.17.3") == minor_key("1.17.0") == "1.17" != minor_key("1.18.1")


TRAINED = hashlib.sha256(b"training plan").hexdigest()


def evaluation_report(claimed: list[str], measured: str = TRAINED) -> dict:
    return {**report(claimed), "kind": "eval", "evaluates": {"task": "train", "plan_sha256": measured}}


@given(
    trained=st.lists(st.sampled_from(RELEASES), min_size=1, unique=True),
    claimed=st.lists(st.sampled_from(RELEASES), min_size=1, unique=True),
)
def test_an_evaluation_passes_only_when_it_claims_every_release_its_training_task_claims(trained, claimed):
    uploaded = {r: vhash(r) for r in claimed}
    uncovered = [r for r in trained if r not in claimed]
    if not uncovered:
        assert (
            check_release_report(
                evaluation_report(claimed), PLAN, uploaded, evaluates_plan_sha256=TRAINED, evaluates_runtimes=trained
            )
            == claimed
        )
        return
    with pytest.raises(ReleaseGateError) as refused:
        check_release_report(
            evaluation_report(claimed), PLAN, uploaded, evaluates_plan_sha256=TRAINED, evaluates_runtimes=trained
        )
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


# -- who vouches for a report (issue 20, defect 7): signed by a trusted key, unchanged since, on
# releases that exist, of a size `plan test` writes

TESTER = Ed25519PrivateKey.generate()
TRUSTED = frozenset({public_key_bytes(TESTER)})
CLAIMED = ["1.15.1", "1.31.1"]
UPLOADED = {r: vhash(r) for r in CLAIMED}


def gate(r: dict, trusted=TRUSTED, claimed=CLAIMED) -> list[str]:
    return check_release_report(r, PLAN, {v: vhash(v) for v in claimed}, trusted_keys=trusted)


def refusal(r: dict, **kwargs) -> ReleaseGateError:
    with pytest.raises(ReleaseGateError) as refused:
        gate(r, **kwargs)
    return refused.value


def paths(value, prefix=()):
    """Every (path, leaf) of a JSON value."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, (*prefix, i))
    else:
        yield prefix, value


def test_a_report_signed_by_a_trusted_key_passes():
    assert gate(sign_report(report(CLAIMED), TESTER)) == CLAIMED


def test_a_hand_written_passed_report_is_refused_as_unsigned():
    assert refusal(report(CLAIMED)).code == "RELEASE_REPORT_UNSIGNED"


@given(data=st.data())
def test_any_change_after_signing_voids_the_signature(data):
    signed = sign_report(report(CLAIMED, {"1.31.1": "loss_decreases"}), TESTER)  # a failed run, signed
    assert refusal(signed).code == "RELEASE_TEST_FAILED"
    # every leaf but the signature's, and the format (a report in another format is not read further)
    path, leaf = data.draw(st.sampled_from([p for p in paths(signed) if p[0][0] not in ("signature", "format")]))
    changed = copy.deepcopy(signed)
    target = changed
    for part in path[:-1]:
        target = target[part]
    other = st.one_of(st.booleans(), st.integers(), st.text(max_size=8))
    new = data.draw(other.filter(lambda v: v != leaf or type(v) is not type(leaf)))
    target[path[-1]] = new
    assert refusal(changed).code == "RELEASE_REPORT_BAD_SIGNATURE"


def test_a_failed_report_edited_to_passed_is_refused():
    signed = sign_report(report(CLAIMED, {"1.31.1": "loss_decreases"}), TESTER)
    edited = copy.deepcopy(signed)
    entry = edited["results"]["1.31.1"]
    entry["passed"] = True
    for check in entry["checks"]:
        check["passed"] = True
    err = refusal(edited)
    assert err.code == "RELEASE_REPORT_BAD_SIGNATURE" and "changed after" in err.message


def test_a_signer_the_server_does_not_trust_is_refused_naming_its_key():
    stranger = Ed25519PrivateKey.generate()
    err = refusal(sign_report(report(CLAIMED), stranger))
    assert err.code == "RELEASE_REPORT_UNTRUSTED"
    assert base64.b64encode(public_key_bytes(stranger)).decode() in err.message and "--release-trust" in err.message


def test_a_server_that_trusts_nobody_tells_its_operator_to_name_keys():
    for r, code in (
        (report(CLAIMED), "RELEASE_REPORT_UNSIGNED"),
        (sign_report(report(CLAIMED), TESTER), "RELEASE_REPORT_UNTRUSTED"),
    ):
        err = refusal(r, trusted=frozenset())
        assert err.code == code and "fedfleet server --release-trust FILE" in err.message


@pytest.mark.parametrize(
    "signature",
    [
        None,
        "sig",
        {},
        {"algorithm": "rsa"},
        {"algorithm": "ed25519", "public_key": "x", "value": "y"},
        {"algorithm": "ed25519", "public_key": base64.b64encode(b"k" * 32).decode(), "value": 3},
    ],
)
def test_a_signature_that_is_not_one_is_refused_as_bad(signature):
    r = {**report(CLAIMED), "signature": signature}
    assert refusal(r).code == ("RELEASE_REPORT_UNSIGNED" if signature is None else "RELEASE_REPORT_BAD_SIGNATURE")


def test_a_claim_of_a_release_that_does_not_exist_is_refused():
    err = refusal(sign_report(report([*CLAIMED, "9.9.9"]), TESTER), claimed=[*CLAIMED, "9.9.9"])
    assert err.code == "RELEASE_UNKNOWN" and err.runtime == "9.9.9" and "9.9.9" in err.message


@given(st.tuples(st.integers(0, 10), st.integers(0, 60), st.integers(0, 30)))
def test_a_release_is_known_exactly_when_the_record_measured_its_minor_at_that_patch_or_later(version):
    text = ".".join(map(str, version))
    recorded = {minor_key(r): int(r.split(".")[2]) for r in RECORDED_RELEASES}
    minor = f"{version[0]}.{version[1]}"
    assert known_release(text) == (minor in recorded and version[2] <= recorded[minor])
    assert all(known_release(r) for r in RECORDED_RELEASES) and not known_release(text + "+cpu")


def test_an_8_mb_report_is_refused_as_too_large():
    junk = sign_report({**report(CLAIMED), "notes": "x" * (8 << 20)}, TESTER)
    assert refusal(junk).code == "RELEASE_REPORT_TOO_LARGE"
    assert refusal({"notes": ["x"] * (1 << 20)}).code == "RELEASE_REPORT_TOO_LARGE"  # however the bytes are spread
    assert len(canonical_json(report(RELEASES))) < MAX_REPORT_BYTES // 100


finite = st.floats(allow_nan=False, allow_infinity=False)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | finite | st.text(max_size=12),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)


@given(extra=st.dictionaries(st.text(max_size=8).filter(lambda k: k != "signature"), json_values, max_size=4))
def test_a_signature_survives_the_report_file_and_the_servers_parser(extra):
    """Signed in memory, written as `plan test` writes it, read back, sent and parsed by the
    server's schema: the canonical bytes are the same, so the signature still verifies."""
    signed = sign_report({**report(CLAIMED), **{k: v for k, v in extra.items() if k not in report(CLAIMED)}}, TESTER)
    on_disk = json.loads(json.dumps(signed, indent=1, sort_keys=True))
    body = json.dumps({"name": "t", "plan": "", "release_report": on_disk})
    parsed = TaskDeploy.model_validate_json(body).release_report
    assert check_release_signature(parsed, TRUSTED) == public_key_bytes(TESTER)
