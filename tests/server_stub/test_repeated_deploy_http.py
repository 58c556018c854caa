"""A deploy sent again after its answer was lost (the operator's retry) is answered with the tasks
it made, stored once; the same names with other content are still refused."""

from __future__ import annotations

import httpx
import pytest

from device_runtime import encode_checkpoint, initial_weights
from server_stub import AdminError, RoundConfig, task_body
from tests.support import digits_plan

CONFIG = RoundConfig(goal_count=3, min_reports=2)


@pytest.fixture
def bodies():
    plan = digits_plan()
    checkpoint = encode_checkpoint(initial_weights(plan, seed=0))
    return plan, checkpoint


def test_the_same_deploy_sent_again_gets_the_tasks_it_made_stored_once(server, admin, bodies):
    plan, checkpoint = bodies
    admin.create_population("digits")
    body = task_body("mlp", plan, checkpoint, CONFIG)
    url = f"{server.url}/v1/populations/digits/tasks"
    headers = {"Authorization": f"Bearer {server.admin_key}"}
    first = httpx.post(url, json=body, headers=headers, timeout=60)
    again = httpx.post(url, json=body, headers=headers, timeout=60)
    assert (first.status_code, again.status_code) == (201, 200), again.text
    answer = again.json()
    assert "already_deployed" not in first.json() and answer.pop("already_deployed") is True
    assert answer == first.json()
    assert [t.name for t in server.store.tasks("digits")] == ["mlp"]
    assert [t["name"] for t in admin.status("digits")["tasks"]] == ["mlp"]


@pytest.mark.parametrize(
    "change",
    [
        lambda plan, checkpoint: task_body("mlp", plan, checkpoint, RoundConfig(goal_count=4, min_reports=2)),
        lambda plan, checkpoint: task_body("mlp", plan, encode_checkpoint(initial_weights(plan, seed=1)), CONFIG),
    ],
    ids=["config", "checkpoint"],
)
def test_the_same_name_with_other_content_is_refused(server, admin, bodies, change):
    plan, checkpoint = bodies
    admin.create_population("digits")
    admin.deploy_body("digits", task_body("mlp", plan, checkpoint, CONFIG))
    with pytest.raises(AdminError) as refused:
        admin.deploy_body("digits", change(plan, checkpoint))
    assert (refused.value.status, refused.value.code) == (409, "TASK_EXISTS")
    assert "other content" in str(refused.value) and "new names" in str(refused.value)
    (stored,) = server.store.tasks("digits")
    assert stored.config["round"]["goal_count"] == 3


def test_a_group_sent_again_is_answered_as_made_and_one_taken_name_refuses_a_new_group(server, admin, bodies):
    plan, checkpoint = bodies
    admin.create_population("digits")
    group = [task_body("a", plan, checkpoint, CONFIG), task_body("b", plan, checkpoint, CONFIG)]
    first = admin.deploy_tasks("digits", group)
    again = admin.deploy_tasks("digits", group)
    assert [t.get("already_deployed") for t in again["tasks"]] == [True, True]
    assert [t["plan_id"] for t in again["tasks"]] == [t["plan_id"] for t in first["tasks"]]
    with pytest.raises(AdminError) as refused:
        admin.deploy_tasks("digits", [group[0], task_body("c", plan, checkpoint, CONFIG)])
    assert refused.value.code == "TASK_EXISTS"  # a's content is the same: what to do is deploy c alone
    assert "has task 'a' deployed already; a deployed task cannot join a new deploy" in str(refused.value)
    assert "deploy 'c' without it" in str(refused.value) and "other content" not in str(refused.value)
    assert [t.name for t in server.store.tasks("digits")] == ["a", "b"]


def test_a_deploy_sends_the_settings_changed_from_their_defaults_and_the_server_fills_in_the_rest(
    server, admin, bodies
):
    """A server refuses a setting it does not know (one a later release added): a deploy that
    sent every setting was refused by an earlier release's server for a field the task left at
    its default (``max_loss``, ``dp.counts``)."""
    plan, checkpoint = bodies
    admin.create_population("digits")
    body = task_body("mlp", plan, checkpoint, CONFIG)
    assert body["config"] == {"goal_count": 3, "min_reports": 2}
    url = f"{server.url}/v1/populations/digits/tasks"
    headers = {"Authorization": f"Bearer {server.admin_key}"}
    later = {**body, "config": {**body["config"], "a_later_releases_setting": 0}}
    refused = httpx.post(url, json=later, headers=headers, timeout=60)
    assert refused.status_code == 400 and "config.a_later_releases_setting" in refused.text, refused.text
    assert httpx.post(url, json=body, headers=headers, timeout=60).status_code == 201
    [task] = server.store.tasks("digits")
    assert RoundConfig.from_dict(task.config["round"]) == CONFIG
