"""Every answer the server gives is declared once, in ``device_runtime.wire``: the OpenAPI document
names a schema for every 2xx JSON answer and says bytes where a route sends bytes; what the
service really answers, on direct routes and FastAPI's alike, is its route's model field for field
(no field the model would drop or lack); and an operator's client refuses an answer out of shape."""

from __future__ import annotations

import asyncio
import base64
import json
import random

import httpx
import pytest
from fastapi.routing import APIRoute
from pydantic import TypeAdapter

from device_runtime import encode_checkpoint, initial_weights
from device_runtime.eligibility import EligibilityPolicies
from device_runtime.plan import serialize_plan
from device_runtime.wire import (
    AbortAnswer,
    CheckinAccepted,
    CheckinRejected,
    EligibilityInfo,
    PopulationStatus,
    ReportAnswer,
    RoundList,
    SecAggState,
)
from server_stub import AdminClient, AdminKeys, ApiError, FLService, RoundConfig, ServerStore, create_app
from server_stub.admin_client import AdminError
from tests.server_stub.test_defects import update_of
from tests.server_stub.test_secagg_malicious_server import Attack, harness  # noqa: F401  (harness: a fixture)
from tests.support import digits_plan

BINARY = {"type": "string", "format": "binary"}
#: The routes whose answer is bytes: a plan or checkpoint, and a task's model.
DOWNLOADS = {("/v1/resources/{rid}", "get"), ("/v1/populations/{population}/model", "get")}


def _typed(schema: dict, components: dict) -> bool:
    """A named schema (or a choice of named schemas) whose object declares its fields."""
    refs = [schema] if "$ref" in schema else schema.get("oneOf", schema.get("anyOf", []))
    if not refs or any("$ref" not in ref for ref in refs):
        return False
    named = [components[ref["$ref"].rsplit("/", 1)[1]] for ref in refs]
    return all(n.get("type") == "object" and n.get("properties") for n in named)


def test_every_2xx_json_answer_is_a_named_schema_and_every_download_is_binary():
    app = create_app(FLService(ServerStore("sqlite://")), admin_keys=AdminKeys.generate()[0])
    document = app.openapi()
    components = document["components"]["schemas"]
    untyped = []
    for path, item in document["paths"].items():
        for method, operation in item.items():
            answers = {status: r for status, r in operation["responses"].items() if status.startswith("2")}
            assert answers, f"{method} {path} declares no success"
            for status, response in answers.items():
                content = response.get("content", {})
                if (path, method) in DOWNLOADS:
                    assert content == {"application/octet-stream": {"schema": BINARY}}, (
                        f"{method} {path} {status}: {content}"
                    )
                    continue
                schema = content.get("application/json", {}).get("schema", {})
                if set(content) != {"application/json"} or not _typed(schema, components):
                    untyped.append(f"{method.upper()} {path} {status}: {json.dumps(content)[:120]}")
            if path.endswith(("/report", "/secagg")) and method == "post":  # uploads are bytes too
                assert operation["requestBody"]["content"] == {"application/octet-stream": {"schema": BINARY}}
    assert not untyped, "answers without a named schema:\n" + "\n".join(untyped)


class Recorder:
    """Requests into the app in process; keeps each JSON answer with the route that gave it."""

    def __init__(self, app, admin_key: str) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fl.test")
        self.admin = {"Authorization": f"Bearer {admin_key}"}
        self.seen: list[tuple[str, str, int, bytes]] = []

    def send(self, method: str, route: str, path: str, **kw) -> httpx.Response:
        response = self.loop.run_until_complete(self.http.request(method, path, **kw))
        assert response.status_code < 300, (method, path, response.text)
        self.seen.append((route, method.lower(), response.status_code, response.content))
        return response

    def close(self) -> None:
        self.loop.run_until_complete(self.http.aclose())
        self.loop.close()


def test_the_servers_answers_are_their_routes_models_field_for_field(tmp_path):
    now = [1000.0]
    keys, admin_key = AdminKeys.generate()
    store = ServerStore(tmp_path / "server.db")
    service = FLService(store, rng=random.Random(3), clock=lambda: now[0])
    app = create_app(service, admin_keys=keys)
    models = {
        (r.path, m.lower()): TypeAdapter(r.response_model)
        for r in app.routes
        if isinstance(r, APIRoute)
        for m in r.methods
        if r.response_model is not None
    }
    plan = digits_plan()
    recorder = Recorder(app, admin_key)
    send = recorder.send
    try:
        send("GET", "/v1/health", "/v1/health")
        send("POST", "/v1/populations", "/v1/populations", json={"name": "pop"}, headers=recorder.admin)
        send("POST", "/v1/populations", "/v1/populations", json={"name": "pop"}, headers=recorder.admin)  # 200: exists
        send("GET", "/v1/populations/{population}/eligibility", "/v1/populations/pop/eligibility")  # no task yet
        send(
            "POST",
            "/v1/populations/{population}/checkin",
            "/v1/populations/pop/checkin",
            json={"runtime_version": "1.31.1"},
        )
        task = {
            "name": "train",
            "plan": _b64(serialize_plan(plan)),
            "checkpoint": _b64(encode_checkpoint(initial_weights(plan))),
            "config": RoundConfig(goal_count=2, over_selection=1.0, min_reports=2, report_timeout_s=60.0).to_dict(),
            "eligibility": EligibilityPolicies(min_examples=1).to_dict(),
        }
        send(
            "POST", "/v1/populations/{population}/tasks", "/v1/populations/pop/tasks", json=task, headers=recorder.admin
        )
        queued = {**task, "name": "later", "eligibility": EligibilityPolicies().to_dict()}
        send(
            "POST",
            "/v1/populations/{population}/task-groups",
            "/v1/populations/pop/task-groups",
            json={"strategy": "weighted", "tasks": [queued]},
            headers=recorder.admin,
        )
        send("GET", "/v1/populations/{population}/eligibility", "/v1/populations/pop/eligibility")
        verdict = {"task": "train", "eligible": True}
        sessions = [
            send(
                "POST",
                "/v1/populations/{population}/checkin",
                "/v1/populations/pop/checkin",
                json={"runtime_version": "1.31.1", "eligibility": verdict},
            ).json()
            for _ in range(3)
        ]
        assert [s["status"] for s in sessions] == ["accepted", "accepted", "rejected"]
        send("GET", "/v1/populations/{population}", "/v1/populations/pop", headers=recorder.admin)
        update = encode_checkpoint(update_of(plan))
        for s in sessions[:2]:
            auth = {"Authorization": f"Bearer {s['token']}"}
            send(
                "POST",
                "/v1/sessions/{sid}/report",
                f"/v1/sessions/{s['session_id']}/report",
                content=update,
                headers=auth,
            )
        auth = {"Authorization": f"Bearer {sessions[0]['token']}"}
        send(
            "POST", "/v1/sessions/{sid}/abort", f"/v1/sessions/{sessions[0]['session_id']}/abort", json={}, headers=auth
        )
        send("GET", "/v1/populations", "/v1/populations", headers=recorder.admin)
        send("GET", "/v1/populations/{population}", "/v1/populations/pop", headers=recorder.admin)
        send("GET", "/v1/populations/{population}/rounds", "/v1/populations/pop/rounds", headers=recorder.admin)
        send(
            "POST",
            "/v1/populations/{population}/tasks/{task}/stop",
            "/v1/populations/pop/tasks/train/stop",
            headers=recorder.admin,
        )
        # the operators' answers the service builds as dicts: FastAPI would drop a field the model
        # lacks on its way out, so the dicts themselves are compared with the models
        for built, model in (
            (service.population_status("pop"), PopulationStatus),
            ({"rounds": service.rounds("pop")}, RoundList),
        ):
            plain = json.loads(json.dumps(built))
            assert model.model_validate(plain).model_dump(mode="json", exclude_unset=True) == plain
        assert plain["rounds"], "no round was on record to compare"
    finally:
        recorder.close()
        store.close()
    checked = set()
    for route, method, _status, body in recorder.seen:
        answer = json.loads(body)
        model = models[(route, method)]
        assert model.dump_python(model.validate_json(body), mode="json", exclude_unset=True) == answer, (route, answer)
        checked.add((route, method))
    # a plain task's session is in no Secure Aggregation group (409 NOT_IN_GROUP): the states of a
    # secure round are held to their model by the next test
    secagg = {("/v1/sessions/{sid}/secagg", "get"), ("/v1/sessions/{sid}/secagg", "post")}
    assert checked == set(models) - {("/v1/attestation/nonce", "post"), *secagg}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize(
    "call, answer",
    [
        (
            lambda a: a.status("pop"),
            {"population": "pop", "strategy": None, "active_task": None, "active_tasks": [], "tasks": "none"},
        ),
        (lambda a: a.status("pop"), {"population": "pop"}),
        (lambda a: a.rounds("pop"), {"rounds": [{"round": "1"}]}),
        (lambda a: a.populations(), {"populations": "all"}),
        (lambda a: a.populations(), ["pop"]),
        (lambda a: a.create_population("pop"), {"name": "pop", "created": [True]}),
    ],
)
def test_an_operators_answer_out_of_shape_is_an_admin_error_naming_the_field(call, answer):
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=answer))
    with (
        AdminClient("http://fl.test", admin_key="k", transport=transport) as admin,
        pytest.raises(AdminError) as refused,
    ):
        call(admin)
    assert refused.value.code == "MALFORMED_ANSWER" and refused.value.status == 200
    assert "is not a" in str(refused.value)


def test_a_refusal_nested_deeper_than_a_parser_goes_is_an_admin_error():
    """httpx's ``Response.json`` (``json.loads``) recursed once per bracket: RecursionError."""
    deep = b'{"error":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    transport = httpx.MockTransport(lambda request: httpx.Response(403, content=deep))
    with (
        AdminClient("http://fl.test", admin_key="k", transport=transport) as admin,
        pytest.raises(AdminError) as refused,
    ):
        admin.populations()
    assert refused.value.status == 403 and refused.value.code is None


def test_every_secure_aggregation_state_of_an_honest_round_is_a_secagg_state_field_for_field(harness, monkeypatch):  # noqa: F811
    """The long poll sends the service's state as it is (a malicious-server test bends it), so the
    states of a real Secure Aggregation round are checked against ``SecAggState`` here."""
    h = harness(Attack(), devices=5)
    seen: list[dict] = []
    original = h.service.secagg_status

    def recording(session_id: str, token: str) -> dict:
        state = original(session_id, token)
        seen.append(json.loads(json.dumps(state)))
        return state

    monkeypatch.setattr(h.service, "secagg_status", recording)  # undone before the module's next test
    results = h.run()
    assert all(r is not None and r.outcome.value == "completed" for r in results), results
    assert {"active", "completed"} <= {s["status"] for s in seen}
    for state in seen:
        assert SecAggState.model_validate(state).model_dump(mode="json", exclude_unset=True) == state


def test_the_service_builds_its_answers_to_devices_as_the_wire_models(tmp_path):
    """Not dicts that a test compares with the models afterwards: each answer is the model, checked
    as it is made, and what a direct route sends is that model's JSON."""
    now = [1000.0]
    store = ServerStore(tmp_path / "server.db")
    service = FLService(store, rng=random.Random(3), clock=lambda: now[0])
    try:
        assert service.eligibility_info("pop") == EligibilityInfo(task=None)
        turned_away = service.checkin("pop", "1.31.1")
        assert isinstance(turned_away, CheckinRejected) and turned_away.reason == "NO_TASK"
        plan = digits_plan()
        service.create_population("pop")
        config = RoundConfig(goal_count=2, over_selection=1.0, min_reports=2, report_timeout_s=60.0)
        service.deploy_task("pop", "train", serialize_plan(plan), encode_checkpoint(initial_weights(plan)), config)
        info = service.eligibility_info("pop")
        assert isinstance(info, EligibilityInfo) and (info.task, info.round) == ("train", 1)
        first, second = (service.checkin("pop", "1.31.1") for _ in range(2))
        assert isinstance(first, CheckinAccepted) and isinstance(second, CheckinAccepted)
        assert first.model_fields_set >= {"status", "session_id", "token", "plan_id", "max_report_bytes"}
        assert "secagg_commitment" not in first.model_fields_set  # a plain round shows no commitment
        answer = service.report(first.session_id, first.token, encode_checkpoint(update_of(plan)))
        assert answer == ReportAnswer(status="accepted", round=1, round_status="open")
        assert service.abort(second.session_id, second.token, "user left") == AbortAnswer(status="aborted")
        assert service.abort(second.session_id, second.token, "again") == AbortAnswer(status="ignored")
    finally:
        store.close()


def _error_statuses() -> set[str]:
    """Every status an error answer can have: each ``ApiError``'s, and the app's own 405 and 500."""
    found, todo = set(), [ApiError]
    while todo:
        cls = todo.pop()
        found.add(str(cls.status))
        todo.extend(cls.__subclasses__())
    return found | {"405", "500"}


def test_every_error_answer_a_route_declares_is_the_error_body_of_a_status_an_error_has():
    """Each route declares its own error answers (``tests/server_stub/test_openapi_fuzz.py`` checks
    that every refusal the fuzz meets is among them); each is the error body, with a status some
    error has, and 500 is declared everywhere."""
    app = create_app(FLService(ServerStore("sqlite://")), admin_keys=AdminKeys.generate()[0])
    document = app.openapi()
    statuses = _error_statuses()
    assert {"400", "401", "404", "409", "413", "422", "429", "503", "505"} <= statuses
    error_body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    for path, item in document["paths"].items():
        for method, operation in item.items():
            responses = operation["responses"]
            errors = {s for s in responses if not s.startswith("2") and s != "304"}
            assert "500" in errors and errors <= statuses, f"{method.upper()} {path} declares {sorted(errors)}"
            for status in errors:
                assert responses[status]["content"] == error_body, (method, path, status)
