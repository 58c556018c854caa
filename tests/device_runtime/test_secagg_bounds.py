"""Under Secure Aggregation the device bounds its own update before masking it: the server sees only
its group's sum and cannot cap or clip one device's part of it. The round's bounds come with the
check-in; a device whose update is not valid drops out instead of sending it."""

from __future__ import annotations

import json
import math
import threading

import httpx
import numpy as np
import onnxruntime
import pytest

from device_runtime import FLRuntime, OpStatsStore, Outcome, ProtocolError, RetryPolicy, SecAggPolicy
from device_runtime.protocol import ProtocolClient
from example_store import InMemoryExampleStore, SQLiteExampleStore
from tests.support import COLLECTION, deploy, digits_plan

DEVICES = 5
EXAMPLES = 12  # per device; two epochs: num_examples 12 per device
FAST = RetryPolicy(attempts=3, base_delay_s=0.01, max_delay_s=0.05)
#: Each Secure Aggregation round's timeout: 10 s (deploy_secure's, tests/support.py), as the group
#: forms at the last check-in, before that device's plan and training session are ready; no device
#: drops, so no round is waited out.
SECAGG_ROUND_S = 10.0


def _sessions(tmp_path, digits, url: str) -> tuple[list, list[FLRuntime]]:
    """One session on each of five runtimes at once (the weaker policy: these devices are not attested)."""
    runtimes, closers = [], []
    for i in range(DEVICES):
        store = SQLiteExampleStore(tmp_path / f"app{i}.db")
        part = slice(EXAMPLES * i, EXAMPLES * (i + 1))
        store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[part], digits.y_train[part])))
        opstats = OpStatsStore(tmp_path / f"opstats{i}.db")
        runtimes.append(
            FLRuntime(
                "digits",
                url,
                store,
                cache_dir=tmp_path / f"cache{i}",
                retry=FAST,
                opstats=opstats,
                secagg_policy=SecAggPolicy(require_attested_cohort=False),
            )
        )
        closers += [store, opstats]
    results: list = [None] * DEVICES

    def go(i: int) -> None:
        results[i] = runtimes[i].run_session()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(DEVICES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for c in (*runtimes, *closers):
        c.close()
    return results, runtimes


def test_devices_cap_and_clip_their_updates_before_masking(tmp_path, server, admin, digits):
    """Bounds that bind (4 of each device's 12 examples, a mean delta of norm 0.05): the round
    commits with the capped count and a model moved by at most the clip, which only devices
    that bounded their own updates give (the server never sees one)."""
    clip = 0.05
    plan, w0 = deploy(
        admin,
        plan=digits_plan("softmax", secure_aggregation=True),
        goal_count=DEVICES,
        over_selection=1.0,
        min_fraction=1.0,
        selection_timeout_s=60,
        report_timeout_s=60,
        secagg_min_group_size=5,
        secagg_round_timeout_s=SECAGG_ROUND_S,
        max_examples_per_report=4,
        clip_update_norm=clip,
    )
    results, _ = _sessions(tmp_path, digits, server.url)
    assert [r.outcome for r in results] == [Outcome.COMPLETED] * DEVICES
    for result in results:
        (upload,) = [e for e in result.events if e.kind == "upload_started"]
        assert upload.detail["secure"] and upload.detail["capped"] and upload.detail["clipped"]
    (record,) = admin.rounds("digits")
    assert record["status"] == "committed" and record["metrics"]["secagg"]["dropped"] == []
    assert round(record["metrics"]["num_examples"], 3) == DEVICES * 4  # not 5 x 12: capped on each device
    model, _ = admin.model("digits")
    moved = math.sqrt(sum(float(np.sum((np.asarray(model[w], np.float64) - w0[w]) ** 2)) for w in plan.weight_names))
    assert 0 < moved <= clip * 1.01


def test_a_device_whose_update_is_not_valid_drops_out_instead_of_sending_it(tmp_path, server, admin, digits):
    """Training diverged (a learning rate of 1e38: infinite weights): the update would be garbage
    in its group's sum; the device leaves its group, says why, and nothing is committed."""
    told: list[str] = []
    real_abort = server.service.abort

    def abort(session_id, token, reason, stats=None):  # the real service's abort, heard
        told.append(reason)
        return real_abort(session_id, token, reason, stats)

    server.service.abort = abort
    deploy(
        admin,
        plan=digits_plan("softmax", secure_aggregation=True, learning_rate=1e38),
        goal_count=DEVICES,
        over_selection=1.0,
        min_fraction=1.0,
        selection_timeout_s=60,
        report_timeout_s=60,
        secagg_min_group_size=5,
        secagg_round_timeout_s=SECAGG_ROUND_S,
    )
    results, _ = _sessions(tmp_path, digits, server.url)
    # (on a loaded machine a device can miss a key round and be left out before it trains)
    trained = [r for r in results if "training_completed" in [e.kind for e in r.events]]
    assert trained
    for result in trained:
        assert (result.outcome, result.rejection_code) == (Outcome.REPORT_REJECTED, "INVALID_UPDATE")
        assert "upload_started" not in [e.kind for e in result.events]
        (rejected,) = [e for e in result.events if e.kind == "upload_rejected"]
        assert "NaN or infinite" in rejected.detail["reason"]
    assert len([r for r in told if r.startswith("the update is not valid")]) == len(trained)
    assert all(r["status"] != "committed" for r in admin.rounds("digits"))


def test_the_check_in_of_a_secure_task_carries_its_bounds(server, admin):
    deploy(
        admin,
        plan=digits_plan("softmax", secure_aggregation=True),
        goal_count=5,
        over_selection=1.0,
        selection_timeout_s=60,
        report_timeout_s=60,
        max_examples_per_report=7,
        clip_update_norm=0.5,
    )
    client = ProtocolClient(server.url)
    session = client.checkin("digits", onnxruntime.__version__)
    client.close()
    assert (session.max_examples_per_report, session.clip_update_norm) == (7, 0.5)


GOOD = {
    "status": "accepted",
    "session_id": "s1",
    "token": "t0k3n",
    "task": "train",
    "round": 3,
    "plan_id": "a" * 64,
    "checkpoint_id": "b" * 64,
    "aggregation": "secure_sum",
    "report_deadline_s": 60.0,
    "max_examples_per_report": 1000,
    "clip_update_norm": 10.0,
}


@pytest.mark.parametrize(
    "change",
    [
        {"max_examples_per_report": None},
        {"max_examples_per_report": 0},
        {"max_examples_per_report": 2.5},
        {"max_examples_per_report": True},
        {"max_examples_per_report": "1000"},
        {"clip_update_norm": -1.0},
        {"clip_update_norm": 0},
        {"clip_update_norm": "10"},
        {"clip_update_norm": 10**400},
        {"clip_update_norm": [10.0]},
        {"max_examples_per_report": ...},
        {"clip_update_norm": ...},  # missing
    ],
)
def test_a_secure_check_in_without_well_formed_bounds_is_a_protocol_error(tmp_path, change):
    """A device in a Secure Aggregation round cannot take part without the round's bounds: nobody else can apply them."""
    answer = {k: v for k, v in {**GOOD, **change}.items() if v is not ...}
    body = json.dumps(answer).encode()
    headers = {"content-type": "application/json"}
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body, headers=headers))
    store = InMemoryExampleStore()
    store.add("app:/digits", [{"x": [0.0] * 64, "y": 1}])
    runtime = FLRuntime("p", "http://fl.test", store, transport=transport, cache_dir=tmp_path / "cache")
    name = next(iter(change))
    with runtime, pytest.raises(ProtocolError, match=name):
        runtime.run_session()
