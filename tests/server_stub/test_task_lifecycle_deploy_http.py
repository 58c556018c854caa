"""A task's life after its first deploy, over real HTTP: a checkpoint that does not fit the plan is
refused naming the task, and a stopped task's committed model goes on as a new task's initial
checkpoint (how a task is resumed, rolled back or given a new round config: there is no restart of
a stopped task and no change of a deployed one, by design)."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from device_runtime import PlanExecutor, encode_checkpoint, initial_weights
from server_stub import AdminError, RoundConfig
from tests.support import digits_plan

ONE_DEVICE = RoundConfig(goal_count=1, over_selection=1.0, min_reports=1, selection_timeout_s=60, report_timeout_s=60)


def test_a_checkpoint_of_another_model_is_refused_naming_the_task(admin):
    """Another task's checkpoint (an MLP's weights for a softmax plan) is one line naming the task
    deployed, as every other refusal of a deploy is, and nothing is stored."""
    admin.create_population("digits")
    other = encode_checkpoint(initial_weights(digits_plan("mlp")))
    with pytest.raises(AdminError) as err:
        admin.deploy_task("digits", "softmax-v2", digits_plan(), other, ONE_DEVICE)
    assert err.value.status == 422 and err.value.code == "INVALID_CHECKPOINT"
    message = str(err.value)
    assert "task 'softmax-v2'" in message and "another task" in message and "\n" not in message
    assert admin.status("digits")["tasks"] == []


def _report_one(http: httpx.Client, plan) -> None:
    spec = PlanExecutor(plan).client_update_spec()
    update = {name: np.full(shape, 0.01, dtype=dtype) for name, (shape, dtype) in spec.items()}
    update["num_examples"] = np.array(4, dtype=update["num_examples"].dtype)
    session = http.post("/v1/populations/digits/checkin", json={"runtime_version": "1.31.1"}).json()
    assert session["status"] == "accepted", session
    r = http.post(
        f"/v1/sessions/{session['session_id']}/report",
        content=encode_checkpoint(update),
        headers={"Authorization": f"Bearer {session['token']}"},
    )
    assert r.status_code == 200, r.text


@pytest.mark.timeout(60)
def test_a_stopped_task_goes_on_from_its_committed_model_as_a_new_task(server, admin):
    """Stop, export, deploy again: the new task's round 0 model is the stopped task's committed
    one, byte for byte, and a round of an earlier model (a roll back) is read by its checkpoint id."""
    plan = digits_plan()
    admin.create_population("digits")
    admin.deploy_task("digits", "v1", plan, encode_checkpoint(initial_weights(plan)), ONE_DEVICE)
    with httpx.Client(base_url=server.url, timeout=10) as http:
        _report_one(http, plan)
    deadline = time.monotonic() + 5  # the commit is written just after the report that closes the round
    while not admin.rounds("digits", "v1") and time.monotonic() < deadline:
        time.sleep(0.02)
    (first,) = admin.rounds("digits", "v1")
    assert admin.stop_task("digits", "v1")["committed_rounds"] == 1
    model, number = admin.model("digits", task="v1")
    assert number == 1
    rolled = admin.checkpoint(first["checkpoint_id"])
    assert all(np.array_equal(model[k], rolled[k]) for k in model)
    admin.deploy_task("digits", "v1-resumed", plan, encode_checkpoint(model), ONE_DEVICE)
    resumed, number = admin.model("digits", task="v1-resumed")
    assert number == 0 and all(np.array_equal(model[k], resumed[k]) for k in model)


def test_a_round_config_refused_at_a_glance_is_refused_before_the_plan_is_run(admin):
    """A round that could commit with fewer devices than ``min_reports`` is refused before the
    plan is loaded and run (tens of seconds for a large model): here the plan is no plan at all,
    and the answer is still the config's refusal."""
    admin.create_population("glance")
    checkpoint = encode_checkpoint(initial_weights(digits_plan()))
    few = RoundConfig(goal_count=3, min_fraction=1.0, min_reports=5)
    with pytest.raises(AdminError) as err:
        admin.deploy_task("glance", "v1", b"not a plan", checkpoint, few)
    assert err.value.status == 400 and err.value.code == "BAD_CONFIG"
    assert "min_reports (5)" in str(err.value)


def test_a_deploy_takes_a_checkpoint_as_large_as_a_device_downloads():
    """The deploy's JSON carries the checkpoint in base64: a checkpoint of the most a device
    downloads fits, with room for the plans (at 512 MiB, one of 380 MB did not)."""
    from device_runtime.protocol import MAX_RESOURCE_BYTES
    from server_stub import app

    assert app.MAX_DEPLOY_BYTES >= 4 * -(-MAX_RESOURCE_BYTES // 3) + (256 << 20)


def test_a_checkpoint_larger_than_a_device_downloads_is_refused_at_deploy(admin, monkeypatch):
    """No device could download it, so no round could run: refused naming the bound, nothing stored."""
    from device_runtime import protocol

    plan = digits_plan()
    checkpoint = encode_checkpoint(initial_weights(plan))
    monkeypatch.setattr(protocol, "MAX_RESOURCE_BYTES", len(checkpoint) - 1)
    admin.create_population("huge")
    with pytest.raises(AdminError) as err:
        admin.deploy_task("huge", "v1", plan, checkpoint, ONE_DEVICE)
    assert err.value.status == 422 and err.value.code == "INVALID_CHECKPOINT"
    assert f"{len(checkpoint):,} bytes, more than a device downloads ({len(checkpoint) - 1:,} bytes" in str(err.value)
    assert admin.status("huge")["tasks"] == []


def test_a_deploy_over_the_size_limit_says_what_to_change(admin, monkeypatch):
    from server_stub import app

    plan = digits_plan()
    monkeypatch.setattr(app, "MAX_DEPLOY_BYTES", 1024)
    admin.create_population("oversize")
    with pytest.raises(AdminError) as err:
        admin.deploy_task("oversize", "v1", plan, encode_checkpoint(initial_weights(plan)), ONE_DEVICE)
    assert err.value.status == 413 and err.value.code == "BODY_TOO_LARGE"
    assert "the checkpoint is at most" in str(err.value) and "smaller model" in str(err.value)


def test_a_deploy_an_earlier_releases_server_refuses_as_too_large_says_the_server_is_older(admin, monkeypatch):
    """A server of the release before took deploys of 512 MiB (a checkpoint of about 380 MB); this
    release's client sends up to the bound of its own server. Refused as BODY_TOO_LARGE by a server
    of a smaller bound (here 1 KiB, for the earlier 512 MiB), a deploy within this release's bound is
    said to have met an older server, where the operator was told only the server's limit."""
    from server_stub import admin_client, app

    assert admin_client.DEPLOY_BYTES == app.MAX_DEPLOY_BYTES  # the client knows its own server's bound
    plan = digits_plan()
    monkeypatch.setattr(app, "MAX_DEPLOY_BYTES", 1024)
    admin.create_population("older")
    with pytest.raises(AdminError) as err:
        admin.deploy_task("older", "v1", plan, encode_checkpoint(initial_weights(plan)), ONE_DEVICE)
    assert err.value.code == "BODY_TOO_LARGE"
    assert "the server is of an earlier release, which takes 512 MiB; upgrade the server" in str(err.value)
    assert "\n" not in str(err.value)
