"""The SDK's default Secure Aggregation policy fails closed: a runtime that cannot check that its
cohort is made of attested devices refuses secure tasks, says why (session result, opstats, the
server), and takes part only when the app explicitly chooses the weaker policy."""

from __future__ import annotations

import threading
import time

from device_runtime import FLRuntime, OpStatsStore, Outcome, RetryPolicy, SecAggPolicy
from emulator import AttestationAuthority
from example_store import SQLiteExampleStore
from server_stub import AttestationVerifier, NonceRegistry, RateLimiter, ServerThread
from tests.support import COLLECTION, deploy, digits_plan

DEVICES = 5
FAST = RetryPolicy(attempts=3, base_delay_s=0.01, max_delay_s=0.05)


def _runtimes(tmp_path, digits, url: str, **kwargs) -> tuple[list[FLRuntime], list]:
    runtimes, closers = [], []
    for i in range(DEVICES):
        store = SQLiteExampleStore(tmp_path / f"app{i}.db")
        part = slice(12 * i, 12 * i + 12)
        store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[part], digits.y_train[part])))
        opstats = OpStatsStore(tmp_path / f"opstats{i}.db")
        extra = {k: (v(i) if callable(v) else v) for k, v in kwargs.items()}
        runtimes.append(
            FLRuntime("digits", url, store, cache_dir=tmp_path / f"cache{i}", retry=FAST, opstats=opstats, **extra)
        )
        closers += [store, opstats]
    return runtimes, closers


def _run_all(runtimes: list[FLRuntime]) -> list:
    results: list = [None] * len(runtimes)

    def go(i: int) -> None:
        results[i] = runtimes[i].run_session()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(runtimes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def _deploy_secure(admin) -> None:
    deploy(
        admin,
        plan=digits_plan("softmax", secure_aggregation=True),
        goal_count=DEVICES,
        over_selection=1.0,
        min_fraction=0.2,
        selection_timeout_s=60,
        report_timeout_s=60,
        secagg_min_group_size=5,
        # deploy_secure's 10 s (tests/support.py): the group forms at the last check-in, before the
        # devices' plan and training session are ready; no device drops, so none is waited out
        secagg_round_timeout_s=10.0,
    )


def _told_to_server(server) -> list[str]:
    """The abort reasons the real service hears (its ``abort`` wrapped, not replaced)."""
    told: list[str] = []
    real_abort = server.service.abort

    def abort(session_id, token, reason, stats=None):
        told.append(reason)
        return real_abort(session_id, token, reason, stats)

    server.service.abort = abort
    return told


def _check_refusals(runtimes: list[FLRuntime], results: list, told: list[str], *, key_missing: bool) -> None:
    for runtime, res in zip(runtimes, results):
        assert res.outcome is Outcome.REPORT_REJECTED and res.rejection_code == "SECAGG_NEEDS_ATTESTATION"
        # refused at check-in: no plan or checkpoint downloaded for nothing (a model of 100 MB), no work, no key
        assert not {"plan_downloaded", "training_started"} & {e.kind for e in res.events}, res.events
        (event,) = [e for e in res.events if e.detail.get("code") == "SECAGG_NEEDS_ATTESTATION"]
        reason = event.detail["reason"]
        assert "no trust anchor" in reason and "require_attested_cohort=False" in reason
        assert ("no attested device key" in reason) == key_missing
        stored = [
            e.detail["reason"]
            for s in runtime.opstats.sessions("digits")
            for e in s.events
            if e.detail.get("code") == "SECAGG_NEEDS_ATTESTATION"
        ]
        assert stored == [reason]
    assert len(told) == len(runtimes) and all("requires an attested cohort" in r for r in told)


def test_an_attested_device_without_the_trust_anchor_refuses_and_says_why(tmp_path, digits):
    authority = AttestationAuthority.generate()
    verifier = AttestationVerifier(
        authority.trust_anchor(), NonceRegistry(ttl_s=60), RateLimiter(burst=20, rate_per_s=5)
    )
    with ServerThread(tmp_path / "server.db", verifier=verifier) as server, server.admin() as admin:
        _deploy_secure(admin)
        told = _told_to_server(server)
        runtimes, closers = _runtimes(
            tmp_path,
            digits,
            server.url,
            attestor=lambda i: authority.new_device_attestor("emulated-phone", time.time()),
        )
        try:
            _check_refusals(runtimes, _run_all(runtimes), told, key_missing=False)
        finally:
            for c in (*runtimes, *closers):
                c.close()
        assert [r["status"] for r in admin.rounds("digits")] in ([], ["abandoned"])  # nobody's update was summed


def test_a_device_with_neither_key_nor_anchor_refuses_and_says_why(tmp_path, server, admin, digits):
    _deploy_secure(admin)
    told = _told_to_server(server)
    runtimes, closers = _runtimes(tmp_path, digits, server.url)
    try:
        _check_refusals(runtimes, _run_all(runtimes), told, key_missing=True)
    finally:
        for c in (*runtimes, *closers):
            c.close()


def test_an_app_that_explicitly_chooses_the_weaker_policy_takes_part(tmp_path, server, admin, digits):
    _deploy_secure(admin)
    weaker = SecAggPolicy(require_attested_cohort=False)
    runtimes, closers = _runtimes(tmp_path, digits, server.url, secagg_policy=weaker)
    try:
        results = _run_all(runtimes)
    finally:
        for c in (*runtimes, *closers):
            c.close()
    assert [r.outcome for r in results] == [Outcome.COMPLETED] * DEVICES
    (record,) = admin.rounds("digits")
    assert record["status"] == "committed" and record["metrics"]["secagg"]["summed_devices"] == DEVICES
