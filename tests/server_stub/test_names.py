"""Population and task names travel in URL paths: a name made only of dots would be the segment
'.' or '..' ('%2E%2E' reaches it), so the service and the HTTP schema refuse it (issue 20,
defect 8), with the name rule in the error, and agree on every other name."""

from __future__ import annotations

import re

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from device_runtime import encode_checkpoint, initial_weights, serialize_plan
from server_stub import ApiError, FLService, RoundConfig, ServerStore
from server_stub.admin_client import task_body
from server_stub.schemas import NAME_RULE, CreatePopulation
from tests.support import digits_plan

DOTS = ["." * n for n in (1, 2, 3, 128)]
CONFIG = RoundConfig(goal_count=4, min_reports=1)


def follows_the_rule(name: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9._-]{1,128}", name) is not None and name.strip(".") != ""


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    store = ServerStore(tmp_path_factory.mktemp("names") / "server.db")
    yield FLService(store)
    store.close()


@given(name=st.text(alphabet="a.Z9-_/ %", min_size=0, max_size=130) | st.sampled_from(DOTS))
def test_the_service_and_the_schema_accept_exactly_the_names_that_follow_the_rule(service, name):
    try:
        CreatePopulation(name=name)
        schema_accepts = True
    except ValueError:
        schema_accepts = False
    try:
        service.create_population(name)
        service_accepts = True
    except ApiError as exc:
        assert exc.code == "BAD_NAME" and NAME_RULE in exc.message
        service_accepts = False
    assert schema_accepts == service_accepts == follows_the_rule(name)


@pytest.mark.parametrize("name", DOTS)
def test_a_task_named_only_dots_is_refused_and_nothing_is_stored(service, name):
    plan = digits_plan()
    service.create_population("digits-dots")
    with pytest.raises(ApiError) as refused:
        service.deploy_task(
            "digits-dots", name, serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), CONFIG
        )
    assert refused.value.code == "BAD_NAME" and "not only dots" in refused.value.message
    assert service.store.tasks("digits-dots") == []


def test_names_of_dots_are_refused_over_http_and_unreachable_as_path_segments(server, admin):
    http = admin.http
    for name in DOTS:
        r = http.post("/v1/populations", json={"name": name})
        assert r.status_code == 400 and r.json()["error"]["code"] == "BAD_NAME"
        assert NAME_RULE in r.json()["error"]["message"]
    assert admin.populations() == []
    for path in ("/v1/populations/%2E%2E", "/v1/populations/%2E", "/v1/populations/%2E%2E%2E/rounds"):
        r = http.get(path)
        assert r.status_code == 404, (path, r.status_code)
    # a device is answered for a name that does not exist as for a population with nothing to train
    r = httpx.post(f"{server.url}/v1/populations/%2E%2E/checkin", json={"runtime_version": "1.31.1"})
    assert r.status_code == 200 and r.json()["status"] == "rejected" and r.json()["reason"] == "NO_TASK"
    admin.create_population("digits")
    plan = digits_plan()
    body = task_body("..", plan, encode_checkpoint(initial_weights(plan, seed=0)), CONFIG)
    r = http.post("/v1/populations/digits/tasks", json=body)
    assert (
        r.status_code == 400
        and r.json()["error"]["code"] == "BAD_NAME"
        and "not only dots" in r.json()["error"]["message"]
    )
    group = {"tasks": [{**body, "name": "train"}, {**body, "name": "eval", "evaluates": "..."}]}
    r = http.post("/v1/populations/digits/task-groups", json=group)
    assert r.status_code == 400 and r.json()["error"]["code"] == "BAD_NAME"
    assert admin.status("digits")["tasks"] == []
    assert admin.populations() == ["digits"]


def test_a_name_longer_than_any_valid_one_is_quoted_cut_in_a_404_that_says_all_it_says(server, admin):
    """A path segment of 5,000 characters names no population: the 404 quotes its first 128
    characters and its length, and keeps the end of its sentence (cut at the message cap, it lost it)."""
    http, name = admin.http, "x" * 5000
    for path, code in (
        (f"/v1/populations/{name}/rounds", "UNKNOWN_POPULATION"),
        (f"/v1/populations/{name}/model", "UNKNOWN_POPULATION"),
        (f"/v1/populations/{name}", "UNKNOWN_POPULATION"),
        (f"/v1/populations/{name}/tasks", "UNKNOWN_POPULATION"),
    ):
        r = http.get(path) if not path.endswith("/tasks") else http.post(path, json=_one_task())
        error = r.json()["error"]
        assert (r.status_code, error["code"]) == (404, code), path
        assert len(error["message"]) < 250 and "(5,000 characters)" in error["message"], error["message"]
        assert error["message"].endswith(("does not exist", "create it first")), error["message"]
    admin.create_population("digits")
    r = http.get("/v1/populations/digits/rounds", params={"task": "t" * 128})  # a valid name is quoted whole
    assert r.status_code == 404 and f"'{'t' * 128}'" in r.json()["error"]["message"]


def _one_task() -> dict:
    plan = digits_plan()
    return task_body("train", plan, encode_checkpoint(initial_weights(plan, seed=0)), CONFIG)


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_path_with_a_slash_too_many_is_a_path_the_server_does_not_have(server, admin, method):
    """Every route's path with a trailing slash is answered as any unknown path (404 NOT_FOUND, a
    JSON body), not redirected to the path without it (307, empty body)."""
    admin.create_population("digits")
    paths = [route["path"] for route in _routes(admin.http)]
    assert "/v1/populations/{population}/rounds" in paths
    for path in paths:
        concrete = re.sub(r"\{[^}]+\}", lambda m: "digits" if m.group(0) == "{population}" else "x", path)
        r = admin.http.request(method, concrete + "/")
        assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND", (method, concrete, r.status_code)


def _routes(http: httpx.Client) -> list[dict]:
    spec = http.get("/openapi.json").json()
    return [{"path": path} for path in spec["paths"]]


def test_an_unknown_task_names_the_close_one_and_the_tasks_the_population_has(service):
    """``trian`` is refused naming ``train`` and the population's tasks, sorted; past a few, the
    rest are counted; a population without tasks says so."""
    plan = digits_plan()
    plan_bytes, checkpoint = serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0))
    service.create_population("digits-tasks")
    with pytest.raises(ApiError) as refused:
        service.rounds("digits-tasks", "train")
    assert refused.value.message == "population 'digits-tasks' has no task 'train'; it has no task yet"
    for name in ("train", "eval", "b", "c", "d", "e", "f"):
        service.deploy_task("digits-tasks", name, plan_bytes, checkpoint, CONFIG)
    for ask in (
        lambda task: service.rounds("digits-tasks", task),
        lambda task: service.current_model("digits-tasks", task),
    ):
        with pytest.raises(ApiError) as refused:
            ask("trian")
        assert (refused.value.code, refused.value.message) == (
            "UNKNOWN_TASK",
            "population 'digits-tasks' has no task 'trian' (did you mean train?); it has b, c, d, e, eval and 2 more",
        )
    with pytest.raises(ApiError) as refused:
        service.rounds("digits-tasks", "zzzz")
    assert refused.value.message.endswith("has no task 'zzzz'; it has b, c, d, e, eval and 2 more")
