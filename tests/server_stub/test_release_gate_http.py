"""The deploy gate over HTTP, with plans and a report made by the real toolchain on real releases:
a server that requires release reports refuses a task without a covering, passed report bound to
the uploaded plans and signed by a key it trusts (a 4xx naming the release and the check, or why
the signature is not good enough), and serves each device the plan for its runtime, telling a
device outside the claimed set to come back later."""

from __future__ import annotations

import base64
import copy
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from device_runtime.checkpoint import decode_checkpoint, encode_checkpoint
from device_runtime.plan import load_plan, serialize_plan
from emulator.releases.workers import WorkerPool
from emulator.toolchain.bundle import BuiltTask, build_bundle, release_test_bundle
from emulator.toolchain.release_signing import public_key_bytes, sign_report
from emulator.toolchain.versioning import plan_sha256, versioned_plan
from server_stub import AdminClient, AdminError, RoundConfig, ServerThread
from server_stub.admin_client import task_body
from server_stub.persistence import resource_id
from server_stub.release_gate import canonical_json
from tests.support import server_command_exit

#: The module's shared fixture is built once per run: its tests go to one pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("release_gate_http")

TASK_FILE = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "digits_task.py"
CLAIMED = ["1.15.1", "1.31.1"]
CONFIG = RoundConfig(goal_count=4, min_reports=1)
#: The tester's key, made for this module (a server under test trusts it).
TESTER = Ed25519PrivateKey.generate()
TRUSTED = frozenset({public_key_bytes(TESTER)})


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> BuiltTask:
    out = tmp_path_factory.mktemp("bundle")
    build_bundle(TASK_FILE, out, runtimes=CLAIMED)
    with WorkerPool() as pool:
        (task,) = release_test_bundle(out, pool, signing_key=TESTER)
    assert task.report()["passed"] and "signature" in task.report()
    return task


@pytest.fixture
def gated(tmp_path):
    with ServerThread(tmp_path / "server.db") as server:
        server.service.require_release_reports = True
        server.service.release_trust = TRUSTED
        with server.admin() as admin:
            admin.create_population("digits")
            yield server, admin


def resigned(report: dict, key: Ed25519PrivateKey = TESTER) -> dict:
    """``report`` as the holder of ``key`` would have signed it: a tester's honest report of what it says."""
    return sign_report(report, key)


def body(built: BuiltTask, *, report=None, versions=None) -> dict:
    return task_body(
        "train",
        built.plan,
        built.checkpoint,
        CONFIG,
        versioned_plans=built.versions if versions is None else versions,
        release_report=built.report() if report is None else report,
    )


def refused(admin, payload) -> AdminError:
    with pytest.raises(AdminError) as err:
        admin.deploy_body("digits", payload)
    assert 400 <= err.value.status < 500
    return err.value


def checkin(server, version: str) -> dict:
    return httpx.post(f"{server.url}/v1/populations/digits/checkin", json={"runtime_version": version}).json()


@pytest.mark.timeout(1800)  # a cold cache installs the releases first
def test_a_covering_report_lets_the_task_through_and_each_device_gets_its_plan(gated, built):
    server, admin = gated
    admin.deploy_body("digits", body(built))
    served = {v: checkin(server, v) for v in ("1.15.0", "1.31.1", "1.20.1")}
    assert served["1.15.0"]["plan_id"] == built.manifest["versions"]["1.15.1"]["sha256"]  # served per minor release
    assert served["1.31.1"]["plan_id"] == built.manifest["versions"]["1.31.1"]["sha256"]
    assert served["1.15.0"]["plan_id"] != served["1.31.1"]["plan_id"]
    assert served["1.20.1"]["status"] == "rejected" and served["1.20.1"]["reason"] == "RUNTIME_VERSION_NOT_CLAIMED"
    low, high = served["1.20.1"]["retry_after_s"]
    assert 1800 <= low <= high <= 3600  # nothing changes for that release until another deploy


@pytest.mark.timeout(1800)
def test_a_deploy_without_a_report_is_refused(gated, built):
    _, admin = gated
    err = refused(admin, task_body("train", built.plan, built.checkpoint, CONFIG))
    assert err.code == "RELEASE_REPORT_REQUIRED" and "fedfleet plan test" in str(err)


@pytest.mark.timeout(1800)
def test_a_failed_check_is_refused_naming_the_release_and_the_check(gated, built):
    _, admin = gated
    report = copy.deepcopy(built.report())
    checks = report["results"]["1.31.1"]["checks"]
    predicate = next(c for c in checks if c["name"].startswith("accuracy_after"))
    predicate["passed"] = False
    err = refused(admin, body(built, report=resigned(report)))
    assert err.code == "RELEASE_TEST_FAILED" and "1.31.1" in str(err) and predicate["name"] in str(err)


@pytest.mark.timeout(1800)
def test_a_report_that_does_not_cover_a_claimed_release_is_refused(gated, built):
    _, admin = gated
    report = copy.deepcopy(built.report())
    del report["results"]["1.15.1"]
    err = refused(admin, body(built, report=resigned(report)))
    assert err.code == "RELEASE_REPORT_INCOMPLETE" and "1.15.1" in str(err)


@pytest.mark.timeout(1800)
def test_plans_other_than_the_tested_ones_are_refused(gated, built):
    _, admin = gated
    plan = load_plan(built.plan)
    other = serialize_plan(versioned_plan(plan, "1.31.1", opset=20))  # valid for 1.31, but not what was tested
    assert plan_sha256(other) != built.manifest["versions"]["1.31.1"]["sha256"]
    err = refused(admin, body(built, versions={**built.versions, "1.31.1": other}))
    assert err.code == "RELEASE_REPORT_MISMATCH" and "1.31.1" in str(err)
    err = refused(admin, body(built, versions={"1.15.1": built.versions["1.15.1"]}))
    assert err.code == "RELEASE_REPORT_MISMATCH"


@pytest.mark.timeout(1800)
def test_malformed_reports_get_a_4xx_never_a_5xx(gated, built):
    _, admin = gated
    for report in ({}, {"format": "x"}, resigned({"format": "fedfleet-release-report/1", "claimed": [1]})):
        assert refused(admin, body(built, report=report)).code == "RELEASE_REPORT_MALFORMED"


@pytest.mark.timeout(1800)
def test_without_the_gate_the_existing_deploy_path_is_unchanged(tmp_path, built):
    with ServerThread(tmp_path / "server.db") as server, server.admin() as admin:
        admin.create_population("digits")
        admin.deploy_body("digits", task_body("train", built.plan, built.checkpoint, CONFIG))
        answer = checkin(server, "1.31.1")
    assert answer["status"] == "accepted" and answer["plan_id"] == built.manifest["plan"]["sha256"]


@pytest.mark.timeout(1800)
def test_the_server_command_requires_release_reports_unless_told_otherwise(tmp_path, built):
    """Without flags: a deploy with no report is refused, one signed by a key the server was not
    given is untrusted, and the command says how to trust one; with --allow-untested-plans the
    same deploy is accepted."""
    key = "operator-key-for-the-gate-test-0123456789"
    (tmp_path / "admin.keys").write_text(key + "\n")
    verdicts = {}
    for flags in ([], ["--allow-untested-plans"]):
        proc, url, printed = start_server(tmp_path, f"s{len(flags)}.db", *flags)
        try:
            with AdminClient(url, admin_key=key) as admin:
                admin.create_population("digits")
                for kind, deploy in (
                    ("no report", task_body("train", built.plan, built.checkpoint, CONFIG)),
                    ("signed", body(built)),
                ):
                    try:
                        admin.deploy_body("digits", deploy)
                        verdicts[tuple(flags), kind] = "accepted"
                    except AdminError as exc:
                        verdicts[tuple(flags), kind] = exc.code
        finally:
            proc.terminate()
            out = printed + proc.communicate(timeout=10)[0]
        if not flags:
            assert "--release-trust FILE" in out
    assert verdicts[(), "no report"] == "RELEASE_REPORT_REQUIRED"
    assert verdicts[(), "signed"] == "RELEASE_REPORT_UNTRUSTED"
    assert verdicts[("--allow-untested-plans",), "no report"] == "accepted"


@pytest.mark.timeout(1800)
def test_a_restarted_server_still_serves_each_release_its_plan(tmp_path, built):
    db = tmp_path / "server.db"
    with ServerThread(db, release_trust=TRUSTED) as server, server.admin() as admin:
        server.service.require_release_reports = True
        admin.create_population("digits")
        admin.deploy_body("digits", body(built))
    with ServerThread(db) as server:  # the versions come back from the database
        answers = {v: checkin(server, v) for v in ("1.15.1", "1.31.1", "1.18.1")}
    assert answers["1.15.1"]["plan_id"] == built.manifest["versions"]["1.15.1"]["sha256"]
    assert answers["1.31.1"]["plan_id"] == built.manifest["versions"]["1.31.1"]["sha256"]
    assert answers["1.18.1"]["reason"] == "RUNTIME_VERSION_NOT_CLAIMED"


# -- issue 20, defect 7: the gate checks who vouches for a report, not only that it is consistent


def refused_and_nothing_stored(server, admin, payload) -> AdminError:
    err = refused(admin, payload)
    assert admin.status("digits")["tasks"] == []
    assert server.store.get_resource(resource_id(base64.b64decode(payload["plan"]))) is None  # not even the plan
    return err


@pytest.mark.timeout(1800)
def test_a_signed_report_by_a_trusted_key_is_accepted_end_to_end(tmp_path, built):
    with ServerThread(tmp_path / "server.db", release_trust=TRUSTED) as server, server.admin() as admin:
        server.service.require_release_reports = True
        admin.create_population("digits")
        admin.deploy_body("digits", body(built))  # the report exactly as `plan test --signing-key` wrote it
        stored = json.loads(server.store.get_resource(resource_id(canonical_json(built.report()))))
        answer = checkin(server, "1.31.1")
    assert stored["signature"] == built.report()["signature"]  # kept with the task, signature and all
    assert answer["status"] == "accepted" and answer["plan_id"] == built.manifest["versions"]["1.31.1"]["sha256"]


@pytest.mark.timeout(1800)
def test_a_hand_written_passed_report_is_refused_as_unsigned(gated, built):
    server, admin = gated
    forged = copy.deepcopy(built.report())
    del forged["signature"]  # every byte a real run wrote, but nobody vouches for it
    err = refused_and_nothing_stored(server, admin, body(built, report=forged))
    assert err.code == "RELEASE_REPORT_UNSIGNED" and "--signing-key" in str(err)


@pytest.mark.timeout(1800)
def test_a_failed_report_edited_to_passed_no_longer_matches_its_signature(gated, built):
    server, admin = gated
    failed = copy.deepcopy(built.report())
    entry = failed["results"]["1.31.1"]
    check = next(c for c in entry["checks"] if c["name"].startswith("accuracy_after"))
    check["passed"] = entry["passed"] = failed["passed"] = False
    failed = resigned(failed)  # what the tester's run signed
    assert refused(admin, body(built, report=failed)).code == "RELEASE_TEST_FAILED"
    edited = copy.deepcopy(failed)
    edited["results"]["1.31.1"]["checks"][edited["results"]["1.31.1"]["checks"].index(check)]["passed"] = True
    edited["results"]["1.31.1"]["passed"] = edited["passed"] = True
    err = refused_and_nothing_stored(server, admin, body(built, report=edited))
    assert err.code == "RELEASE_REPORT_BAD_SIGNATURE" and "changed after" in str(err)


@pytest.mark.timeout(1800)
def test_a_claim_of_a_release_that_does_not_exist_is_refused(gated, built):
    server, admin = gated
    report = copy.deepcopy(built.report())
    report["claimed"].append("9.9.9")
    # the unversioned plan claims no newest release, so it loads for 9.9.9 too
    report["results"]["9.9.9"] = {
        **report["results"]["1.31.1"],
        "runtime": "9.9.9",
        "plan_sha256": plan_sha256(built.plan),
    }
    versions = {**built.versions, "9.9.9": built.plan}
    err = refused_and_nothing_stored(server, admin, body(built, report=resigned(report), versions=versions))
    assert err.code == "RELEASE_UNKNOWN" and "9.9.9" in str(err)


@pytest.mark.timeout(1800)
def test_an_8_mb_report_is_refused_before_it_is_stored(gated, built):
    server, admin = gated
    junk = resigned({**built.report(), "notes": "x" * (8 << 20)})  # signed, passed, consistent: only too large
    err = refused_and_nothing_stored(server, admin, body(built, report=junk))
    assert err.code == "RELEASE_REPORT_TOO_LARGE" and err.status == 422


@pytest.mark.timeout(1800)
def test_a_report_signed_by_a_key_the_server_does_not_trust_is_refused(gated, built):
    server, admin = gated
    stranger = Ed25519PrivateKey.generate()
    err = refused_and_nothing_stored(server, admin, body(built, report=resigned(built.report(), stranger)))
    assert err.code == "RELEASE_REPORT_UNTRUSTED" and "--release-trust" in str(err)
    server.service.release_trust = frozenset()  # a gated server that names no signer refuses every report
    for report, code in (
        (built.report(), "RELEASE_REPORT_UNTRUSTED"),
        ({k: v for k, v in built.report().items() if k != "signature"}, "RELEASE_REPORT_UNSIGNED"),
    ):
        err = refused_and_nothing_stored(server, admin, body(built, report=report))
        assert err.code == code and "fedfleet server --release-trust FILE" in str(err)


def start_server(tmp_path, db: str, *flags: str) -> tuple[subprocess.Popen, str, str]:
    """``python -m server_stub`` on a port of its own choosing, read from its banner: a port picked
    free beforehand could be taken by another test's server before this one bound it, and the
    admin calls then reached that server. Returns the process, its URL and its banner."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server_stub",
            "--db",
            str(tmp_path / db),
            "--port",
            "0",
            "--admin-key-file",
            str(tmp_path / "admin.keys"),
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    url, printed = None, ""
    for line in proc.stdout:  # the banner's last line is flushed
        printed += line
        if found := re.search(r"listening on (http://\S+)", line):
            url = found.group(1)
        if "OpenAPI:" in line:
            break
    assert url is not None, f"the server printed no URL: {printed}"
    with httpx.Client(timeout=1) as http:  # the banner comes as the server binds, before it answers
        for _ in range(400):
            try:
                if http.get(f"{url}/v1/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert proc.poll() is None, f"the server exited: {printed}"
                time.sleep(0.05)
    return proc, url, printed


@pytest.mark.timeout(1800)
def test_the_server_command_trusts_the_keys_of_its_release_trust_file(tmp_path, built, capsys):
    """A report signed by a key of the --release-trust file is deployed (without the file it is
    untrusted: the test above); a file with a line that is no key stops the command."""
    key = "operator-key-for-the-trust-test-0123456789"
    (tmp_path / "admin.keys").write_text(key + "\n")
    trust = tmp_path / "release-trust"
    trust.write_text(
        "# testers whose release reports we deploy\n\n"
        f"ed25519 {built.report()['signature']['public_key']} alice@model-team\n"
    )
    proc, url, printed = start_server(tmp_path, "s.db", "--release-trust", str(trust))
    try:
        with AdminClient(url, admin_key=key) as admin:
            admin.create_population("digits")
            admin.deploy_body("digits", body(built))
    finally:
        proc.terminate()
        out = printed + proc.communicate(timeout=10)[0]
    assert "signed by one of the 1 key(s)" in out
    trust.write_text("ed25519 not-a-key\n")
    args = ["--db", str(tmp_path / "bad.db"), "--port", "0", "--admin-key-file", str(tmp_path / "admin.keys")]
    assert server_command_exit([*args, "--release-trust", str(trust)]) == 2
    err = capsys.readouterr().err
    assert "line 1" in err and "fedfleet plan keygen" in err


@pytest.mark.timeout(1800)
def test_an_initial_checkpoint_other_than_the_tested_one_is_refused(gated, built):
    """The predicates were judged from the bundle's initial model: one replaced after `plan test`
    (a stale file, another task's model of the same shapes, a model that diverges) is not what the
    signed report vouches for, so the deploy is refused naming both ids, and nothing is stored."""
    server, admin = gated
    assert built.report()["checkpoint_sha256"] == resource_id(built.checkpoint)
    weights = decode_checkpoint(built.checkpoint)
    diverging = encode_checkpoint({name: np.full_like(w, 50.0) for name, w in weights.items()})
    payload = body(built)
    payload["checkpoint"] = base64.b64encode(diverging).decode()
    err = refused_and_nothing_stored(server, admin, payload)
    assert err.code == "RELEASE_REPORT_MISMATCH" and "initial checkpoint" in str(err)
    assert resource_id(built.checkpoint)[:12] in str(err) and resource_id(diverging)[:12] in str(err)
    admin.deploy_body("digits", body(built))  # the tested one goes through
