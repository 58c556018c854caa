"""The deploy gate (paper, section 7.3): a task is accepted only with a release report that covers
every runtime it claims, all passed, bound to the plans being uploaded.

An evaluation task deployed with the training task it measures is also checked against that task:
its report must have measured the models of the uploaded training plan, and it must claim every
release the training task claims (else the devices of a release would train but never be asked to
evaluate, and its rounds would turn them away).

Consistency alone proves nothing: anyone can write a report that says "passed". So the report
carries an Ed25519 signature by the key of whoever ran the tests (``fedfleet plan test
--signing-key``), over its canonical JSON (:func:`signing_payload`); the server trusts the keys
its operator names (``--release-trust``), refuses a report no trusted key signed or that changed
after signing, refuses claims of onnxruntime releases the measured record does not know (a report
cannot have run on a release that does not exist), and refuses a report larger than
:data:`MAX_REPORT_BYTES` before reading it further (it is stored with the task).

Pure: it reads the report (JSON, as ``fedfleet plan test`` writes it), the sha256 ids of the
uploaded plans, the trusted public keys and the known releases, and returns the claimed releases
or raises :class:`ReleaseGateError`, whose code is stable and whose message names the failing
release and check.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from device_runtime.plan import load_ort_support_record
from device_runtime.versions import version_tuple

__all__ = [
    "MAX_REPORT_BYTES",
    "RECORDED_RELEASES",
    "RELEASE_CODES",
    "REPORT_FORMAT",
    "SIGNATURE_ALGORITHM",
    "ReleaseGateError",
    "canonical_json",
    "check_release_report",
    "check_release_signature",
    "known_release",
    "minor_key",
    "signing_payload",
]

REPORT_FORMAT = "fedfleet-release-report/1"
#: `plan test` writes about 1 KB per release (all 18: some 25 KB); the report is stored with the task.
MAX_REPORT_BYTES = 1 << 20
SIGNATURE_ALGORITHM = "ed25519"
#: Signed before the report, so a release report's signature means nothing in any other protocol.
SIGNING_CONTEXT = b"fedfleet.release-report.v1\x00"
PUBLIC_KEY_BYTES, SIGNATURE_BYTES = 32, 64
#: The releases the measured record (``device_runtime/ort_support.json``) lists: the latest patch
#: of each minor when it was measured.
RECORDED_RELEASES: tuple[str, ...] = tuple(str(row["release"]) for row in load_ort_support_record())
_RELEASE = re.compile(r"([0-9]{1,4})\.([0-9]{1,4})\.([0-9]{1,6})")
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


#: The codes a ``ReleaseGateError`` carries (a deploy answers them 422), and the deploy's own when
#: a task that claims releases comes without a report.
RELEASE_CODES = (
    "RELEASE_REPORT_REQUIRED",
    "RELEASE_REPORT_MALFORMED",
    "RELEASE_REPORT_TOO_LARGE",
    "RELEASE_REPORT_UNSIGNED",
    "RELEASE_REPORT_BAD_SIGNATURE",
    "RELEASE_REPORT_UNTRUSTED",
    "RELEASE_REPORT_MISMATCH",
    "RELEASE_REPORT_INCOMPLETE",
    "RELEASE_UNKNOWN",
    "RELEASE_TEST_FAILED",
)


class ReleaseGateError(ValueError):
    """The report does not let the task through; ``code`` says why, ``runtime`` and ``check``
    name the release and check that failed (when one did)."""

    def __init__(self, code: str, message: str, *, runtime: str | None = None, check: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.runtime = runtime
        self.check = check


def minor_key(version: str) -> str:
    """Devices are served per minor release: '1.17.3' and '1.17.0' share the plan of '1.17'."""
    major, minor, _ = version_tuple(version)
    return f"{major}.{minor}"


def _malformed(what: str) -> ReleaseGateError:
    return ReleaseGateError(
        "RELEASE_REPORT_MALFORMED", f"the release report {what}; send the JSON `fedfleet plan test` wrote"
    )


def canonical_json(value: Any) -> bytes:
    """``value`` as one exact byte string (sorted keys, compact separators, ASCII, no NaN): what a
    report parses to is encoded the same by the tester who signs it and the server that checks it."""
    return _ENCODER.encode(value).encode("ascii")


def signing_payload(report: Mapping[str, Any]) -> bytes:
    """What a report's signature covers: everything in it but ``signature`` (plan hashes, claimed
    releases, every result), canonical, after a tag that binds it to this use."""
    return SIGNING_CONTEXT + canonical_json({k: v for k, v in report.items() if k != "signature"})


def _check_size(report: Any) -> None:
    """Refuse a report over :data:`MAX_REPORT_BYTES` once that many bytes are encoded, not after
    encoding all of it."""
    size = 0
    try:
        for chunk in _ENCODER.iterencode(report):
            size += len(chunk)
            if size > MAX_REPORT_BYTES:
                break
    except (TypeError, ValueError, RecursionError):
        raise _malformed("is not plain JSON (finite numbers, string keys)") from None
    if size > MAX_REPORT_BYTES:
        raise ReleaseGateError(
            "RELEASE_REPORT_TOO_LARGE",
            f"the release report is over {MAX_REPORT_BYTES} bytes as JSON, far more than `fedfleet plan test` writes; "
            "send the report it wrote, unchanged",
        )


def _b64(value: Any, length: int) -> bytes | None:
    if not isinstance(value, str) or len(value) > 2 * length:
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == length else None


def check_release_signature(report: Mapping[str, Any], trusted_keys: Collection[bytes]) -> bytes:
    """The signer's raw public key, once ``report["signature"]`` is an Ed25519 signature of
    :func:`signing_payload` by one of ``trusted_keys`` (raw 32-byte public keys)."""
    how = (
        "sign it with `fedfleet plan test --signing-key KEY` (`fedfleet plan keygen --key KEY` makes a key) and "
        "have the server's operator trust the key"
    )
    if not trusted_keys:
        how = (
            "this server trusts no signer of release reports: its operator names the testers' public keys with "
            "`fedfleet server --release-trust FILE`"
        )
    signature = report.get("signature")
    if signature is None:
        raise ReleaseGateError("RELEASE_REPORT_UNSIGNED", f"the release report is not signed; {how}")
    public = _b64(signature.get("public_key"), PUBLIC_KEY_BYTES) if isinstance(signature, Mapping) else None
    value = _b64(signature.get("value"), SIGNATURE_BYTES) if isinstance(signature, Mapping) else None
    if public is None or value is None or signature.get("algorithm") != SIGNATURE_ALGORITHM:
        raise ReleaseGateError(
            "RELEASE_REPORT_BAD_SIGNATURE",
            "the release report's signature is not an Ed25519 signature as `fedfleet plan test --signing-key` writes it "
            "(base64 'public_key' and 'value'); send the report it wrote, unchanged",
        )
    if public not in trusted_keys:
        key = base64.b64encode(public).decode()
        raise ReleaseGateError(
            "RELEASE_REPORT_UNTRUSTED",
            f"the release report is signed by key {key}, which this server does not trust; "
            + (
                how
                if not trusted_keys
                else "sign with a key the operator trusts, or ask the operator to add this key "
                "to the server's --release-trust file"
            ),
        )
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(value, signing_payload(report))
    except (InvalidSignature, ValueError):
        raise ReleaseGateError(
            "RELEASE_REPORT_BAD_SIGNATURE",
            "the release report does not match its signature: it was changed after `fedfleet plan test` signed it; "
            "send the report it wrote, or run the tests again",
        ) from None
    return public


def known_release(version: str, recorded: Collection[str] = RECORDED_RELEASES) -> bool:
    """Whether ``version`` ('1.17.3') is an onnxruntime release the record knows: its minor was
    measured, at this patch or a later one."""
    match = _RELEASE.fullmatch(version) if isinstance(version, str) else None
    if match is None:
        return False
    for release in recorded:
        known = _RELEASE.fullmatch(release)
        if (
            known is not None
            and known.groups()[:2] == match.groups()[:2]
            and int(known.group(3)) >= int(match.group(3))
        ):
            return True
    return False


def check_release_report(
    report: Any,
    plan_sha256: str,
    versioned: Mapping[str, str],
    *,
    trusted_keys: Collection[bytes] | None = None,
    known_releases: Collection[str] = RECORDED_RELEASES,
    evaluates_plan_sha256: str | None = None,
    evaluates_runtimes: Sequence[str] | None = None,
    checkpoint_sha256: str | None = None,
) -> list[str]:
    """The claimed releases, once ``report`` covers each of them with a passed result bound to the
    uploaded versioned plan (``versioned``: release -> sha256) and to the unversioned plan, signed
    by one of ``trusted_keys`` (``None``: the signature is not checked, for a server that takes
    untested plans and trusts no signer), and each claimed release is one of ``known_releases``.
    For an evaluation task, ``evaluates_plan_sha256`` / ``evaluates_runtimes`` are the plan id and
    claimed releases of the training task it measures. ``checkpoint_sha256`` is the id of the
    deploy's initial checkpoint: a report that names the one it tested from (``plan test`` does,
    for a training task) must name this one, as its predicates were judged from that model."""
    _check_size(report)
    if not isinstance(report, Mapping) or report.get("format") != REPORT_FORMAT:
        raise _malformed(f"is not in format {REPORT_FORMAT!r}")
    if trusted_keys is not None:
        check_release_signature(report, trusted_keys)
    claimed, results, reference = report.get("claimed"), report.get("results"), report.get("reference")
    if not isinstance(claimed, list) or not claimed or not all(isinstance(v, str) for v in claimed):
        raise _malformed("names no claimed runtimes")
    if not isinstance(results, Mapping) or not isinstance(reference, Mapping):
        raise _malformed("has no results")
    try:
        keys = [minor_key(v) for v in claimed]
    except ValueError:
        raise _malformed(f"claims runtimes that are not versions: {claimed}") from None
    if len(set(keys)) != len(keys):
        raise _malformed(f"claims two patches of one minor release: {claimed}")
    unknown = [v for v in claimed if not known_release(v, known_releases)]
    if unknown:
        raise ReleaseGateError(
            "RELEASE_UNKNOWN",
            f"the release report claims onnxruntime {str(unknown[0])[:40]}, which is not a release this server knows "
            "(device_runtime/ort_support.json, measured with `python -m emulator.releases.support`); claim released "
            "versions such as " + ", ".join(sorted(known_releases, key=version_tuple)[-3:]),
            runtime=str(unknown[0])[:40],
        )
    if report.get("plan_sha256") != plan_sha256:
        raise ReleaseGateError(
            "RELEASE_REPORT_MISMATCH",
            f"the release report tested plan {str(report.get('plan_sha256'))[:12]}..., not the uploaded plan "
            f"{plan_sha256[:12]}...; run `fedfleet plan test` on the plans you deploy",
        )
    tested_from = report.get("checkpoint_sha256")
    if tested_from is not None and checkpoint_sha256 is not None and tested_from != checkpoint_sha256:
        raise ReleaseGateError(
            "RELEASE_REPORT_MISMATCH",
            f"the release report tested initial checkpoint {str(tested_from)[:12]}..., not the uploaded one "
            f"{checkpoint_sha256[:12]}... (replaced after `fedfleet plan test`, or from another build); "
            "deploy the checkpoint the bundle was tested with, or run `fedfleet plan test` on the bundle again",
        )
    if set(versioned) != set(claimed):
        missing, extra = sorted(set(claimed) - set(versioned)), sorted(set(versioned) - set(claimed))
        raise ReleaseGateError(
            "RELEASE_REPORT_MISMATCH",
            f"the task claims {sorted(claimed)} but versioned plans were uploaded for {sorted(versioned)} "
            f"(missing {missing}, not claimed {extra}); upload one versioned plan per claimed runtime",
            runtime=(missing or extra)[0],
        )
    if evaluates_plan_sha256 is not None:
        _check_evaluation(report, claimed, evaluates_plan_sha256, evaluates_runtimes)
    _passed_entry(reference, "reference run", None)
    for runtime in claimed:
        entry = results.get(runtime)
        if not isinstance(entry, Mapping):
            raise ReleaseGateError(
                "RELEASE_REPORT_INCOMPLETE",
                f"the release report has no result for onnxruntime {runtime}, which the task claims; test on it",
                runtime=runtime,
            )
        if entry.get("plan_sha256") != versioned[runtime]:
            raise ReleaseGateError(
                "RELEASE_REPORT_MISMATCH",
                f"onnxruntime {runtime}: the report tested plan {str(entry.get('plan_sha256'))[:12]}..., "
                f"not the uploaded versioned plan {versioned[runtime][:12]}...; test the plans you deploy",
                runtime=runtime,
            )
        _passed_entry(entry, f"onnxruntime {runtime}", runtime)
    return list(claimed)


def _check_evaluation(
    report: Mapping[str, Any], claimed: list[str], trained_sha256: str, trained_runtimes: Sequence[str] | None
) -> None:
    evaluates = report.get("evaluates")
    if not isinstance(evaluates, Mapping) or report.get("kind") != "eval":
        raise ReleaseGateError(
            "RELEASE_REPORT_MISMATCH",
            "the release report is not an evaluation task's (it names no training task whose models it measured); "
            "declare the task with evaluation_of(...) and run `fedfleet plan test` again",
        )
    if evaluates.get("plan_sha256") != trained_sha256:
        raise ReleaseGateError(
            "RELEASE_REPORT_MISMATCH",
            f"the evaluation was tested on the models of training plan {str(evaluates.get('plan_sha256'))[:12]}..., not "
            f"the uploaded one {trained_sha256[:12]}...; test the evaluation together with the training task you deploy",
        )
    try:
        covered = {minor_key(v) for v in claimed}
        uncovered = [v for v in trained_runtimes or () if minor_key(str(v)) not in covered]
    except ValueError:
        raise _malformed("claims runtimes that are not versions") from None
    if uncovered:
        raise ReleaseGateError(
            "RELEASE_REPORT_INCOMPLETE",
            f"the evaluation does not claim onnxruntime {uncovered[0]}, which the training task it measures claims; its "
            "devices could not take part in evaluation rounds. Claim and test the same releases for both",
            runtime=uncovered[0],
        )


def _passed_entry(entry: Mapping[str, Any], where: str, runtime: str | None) -> None:
    checks = entry.get("checks")
    if not isinstance(checks, list) or not checks or not all(isinstance(c, Mapping) for c in checks):
        raise _malformed(f"has no checks for the {where}")
    for check in checks:
        if check.get("passed") is not True:
            name = str(check.get("name", "?"))[:80]
            detail = str(check.get("detail", ""))[:200]
            raise ReleaseGateError(
                "RELEASE_TEST_FAILED",
                f"the {where} failed release test {name!r}: {detail}; fix the task or stop claiming that runtime",
                runtime=runtime,
                check=name,
            )
    if entry.get("passed") is not True:
        raise ReleaseGateError("RELEASE_TEST_FAILED", f"the {where} did not pass", runtime=runtime)
