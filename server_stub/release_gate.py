"""The deploy gate (paper, section 7.3): a task is accepted only with a release report that covers
every runtime it claims, all passed, bound to the plans being uploaded.

An evaluation task deployed with the training task it measures is also checked against that task:
its report must have measured the models of the uploaded training plan, and it must claim every
release the training task claims (else the devices of a release would train but never be asked to
evaluate, and its rounds would turn them away).

Pure: it reads the report (JSON, as ``fedfleet plan test`` writes it) and the sha256 ids of the
uploaded plans, and returns the claimed releases or raises :class:`ReleaseGateError`, whose code
is stable and whose message names the failing release and check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from device_runtime.versions import version_tuple

__all__ = ["REPORT_FORMAT", "ReleaseGateError", "check_release_report", "minor_key"]

REPORT_FORMAT = "fedfleet-release-report/1"


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
    return ReleaseGateError("RELEASE_REPORT_MALFORMED", f"the release report {what}; send the JSON `fedfleet plan test` wrote")


def check_release_report(
    report: Any,
    plan_sha256: str,
    versioned: Mapping[str, str],
    *,
    evaluates_plan_sha256: str | None = None,
    evaluates_runtimes: Sequence[str] | None = None,
) -> list[str]:
    """The claimed releases, once ``report`` covers each of them with a passed result bound to the
    uploaded versioned plan (``versioned``: release -> sha256) and to the unversioned plan. For an
    evaluation task, ``evaluates_plan_sha256`` / ``evaluates_runtimes`` are the plan id and claimed
    releases of the training task it measures."""
    if not isinstance(report, Mapping) or report.get("format") != REPORT_FORMAT:
        raise _malformed(f"is not in format {REPORT_FORMAT!r}")
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
    if report.get("plan_sha256") != plan_sha256:
        raise ReleaseGateError(
            "RELEASE_REPORT_MISMATCH",
            f"the release report tested plan {str(report.get('plan_sha256'))[:12]}..., not the uploaded plan "
            f"{plan_sha256[:12]}...; run `fedfleet plan test` on the plans you deploy",
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


def _check_evaluation(report: Mapping[str, Any], claimed: list[str], trained_sha256: str,
                      trained_runtimes: Sequence[str] | None) -> None:
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
