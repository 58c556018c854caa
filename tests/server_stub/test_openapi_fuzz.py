"""Fuzz every operation of the server's OpenAPI document against a real uvicorn server: whatever
a client sends, the answer is never a 5xx, every refusal is ``{"error": {"code", "message"}}``
with a stable code, every success is what the document declares for it (JSON its schema accepts,
or bytes), and no request hangs.

The fuzz gets past the front door. The server has populations with deployed tasks and open device
sessions; each request carries, drawn per example, the admin key, a session token, a wrong key,
no credential or what schemathesis generated; path parameters are either generated or the real
population, session and resource ids; a deploy sometimes carries a real plan and checkpoint, so
its config reaches the service's own checks (a plan that runs, a commit threshold, weights).
Examples are derandomized: a failure found once is found again, and shrinks to its smallest form.
"""

from __future__ import annotations

import base64
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema_rs
import numpy as np
import pytest
import schemathesis
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays, from_dtype

from device_runtime import PlanExecutor, encode_checkpoint, initial_weights, serialize_plan
from device_runtime.eligibility import EligibilityPolicies
from server_stub import AdminKeys, FLService, RoundConfig, ServerStore, ServerThread, create_app
from server_stub.schemas import TaskDeploy
from tests.support import deploy

#: Examples per operation and generation mode in the default run (derandomized: the same ones every
#: run; 150 took 95 s of the default run's 16 minutes, 50 took 47 CPU-s); the slow run draws 1,500 for each.
EXAMPLES = 20
ROOT = Path(__file__).resolve().parents[2]
SLOW_EXAMPLES = 1500
#: Round configs the schema-against-server property draws in the default run (600 took 4.6 CPU-s), and in its slow twin.
CONFIG_EXAMPLES = 150
SLOW_CONFIG_EXAMPLES = 3000
#: No request may take longer: none of these sessions long-polls (they are not SecAgg sessions),
#: so anything slower is a hang.
TIMEOUT_S = 5.0
#: Setting the target up is not under test: the first /openapi.json builds the whole schema, which on
#: a loaded machine has taken longer than TIMEOUT_S.
SETUP_TIMEOUT_S = 60.0
POPULATIONS = ("digits", "picky", "idle")  # a task; a task with eligibility policies; no task
SESSIONS = 8
ERROR_CODE = re.compile(r"[A-Z][A-Z0-9_]*")
HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
HEADER_VALUE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")
TRANSPORT_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "expect", "te", "upgrade"}


def _app():
    """The app (over an empty in-memory store) whose routes the fuzz is parametrized by."""
    return create_app(FLService(ServerStore("sqlite://")), admin_keys=AdminKeys.generate()[0])


ROUTES = sorted(
    (route.path, method)
    for route in _app().routes
    if isinstance(route, APIRoute)
    for method in route.methods - {"HEAD"}
)

#: The module's shared fixture is built once per run: its tests go to one pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("openapi_fuzz")


def _fuzz_cases() -> list:
    """Every documented operation with valid input; and with invalid input where it takes any
    (a body, a query, a credential): a bare path string cannot be made invalid."""
    cases = []
    for path, item in _app().openapi()["paths"].items():
        for method, operation in item.items():
            takes = (
                "requestBody" in operation
                or "security" in operation
                or any(p["in"] != "path" for p in operation.get("parameters", []))
            )
            for mode in ("positive", "negative") if takes else ("positive",):
                cases.append(pytest.param(path, method.upper(), mode, id=f"{method.upper()} {path} {mode}"))
    return cases


FUZZ_CASES = _fuzz_cases()


@dataclass
class Target:
    """The live server and the real ids the fuzz aims at."""

    url: str
    admin_key: str
    schema: schemathesis.BaseSchema
    document: dict
    sessions: list[tuple[str, str]]  # (session id, token)
    resources: list[str]
    plan: str  # base64, as a deploy carries it
    checkpoint: str
    update_spec: dict  # what a report to the sessions' task holds: name -> (shape, dtype)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    with ServerThread(tmp_path_factory.mktemp("fuzz") / "server.db") as server, server.admin() as admin:
        # Rounds that stay open for the whole run: every check-in is selected, nothing times out.
        stable = dict(goal_count=1000, over_selection=1.0, selection_timeout_s=3600.0, report_timeout_s=3600.0)
        plan, weights = deploy(admin, POPULATIONS[0], **stable)
        admin.create_population(POPULATIONS[1])
        admin.deploy_task(
            POPULATIONS[1],
            "train",
            plan,
            encode_checkpoint(weights),
            RoundConfig(min_reports=1, **stable),
            EligibilityPolicies(min_examples=5, min_separation_rounds=2),
        )
        admin.create_population(POPULATIONS[2])
        with httpx.Client(base_url=server.url, timeout=SETUP_TIMEOUT_S) as http:
            answers = [
                http.post(f"/v1/populations/{POPULATIONS[0]}/checkin", json={"runtime_version": "1.31.1"}).json()
                for _ in range(SESSIONS)
            ]
            document = http.get("/openapi.json").json()
        assert all(a["status"] == "accepted" for a in answers), answers
        yield Target(
            url=server.url,
            admin_key=server.admin_key,
            schema=schemathesis.openapi.from_dict(document),
            document=document,
            sessions=[(a["session_id"], a["token"]) for a in answers],
            resources=sorted({a["plan_id"] for a in answers} | {a["checkpoint_id"] for a in answers}),
            plan=base64.b64encode(serialize_plan(plan)).decode(),
            checkpoint=base64.b64encode(encode_checkpoint(initial_weights(plan, seed=0))).decode(),
            update_spec=PlanExecutor(plan).client_update_spec(),
        )


# ----------------------------------------------------------------------------- one exchange
@st.composite
def _updates(draw, spec: dict) -> bytes:
    """A report that decodes: the plan's tensors with any values (NaN, infinities, negative
    counts), sometimes one missing, one too many, or one of another shape or dtype."""
    update = {
        name: draw(arrays(dtype, shape, elements=from_dtype(dtype), fill=from_dtype(dtype)), label=name)
        for name, (shape, dtype) in spec.items()
    }
    change = draw(st.sampled_from(["none", "none", "drop", "extra", "reshape", "retype"]), label="change")
    name = draw(st.sampled_from(sorted(update)), label="changed tensor")
    if change == "drop":
        del update[name]
    elif change == "extra":
        update["surprise"] = np.zeros(3, np.float32)
    elif change == "reshape":
        update[name] = np.zeros(update[name].size + 1, update[name].dtype)
    elif change == "retype":
        update[name] = update[name].astype(np.float64 if update[name].dtype != np.float64 else np.int64)
    return encode_checkpoint(update)


STATS_HEADERS = st.one_of(
    st.dictionaries(
        st.sampled_from(["shape", "training_s", "other"]),
        st.one_of(st.text("TRDUX#^", max_size=20), st.floats(), st.integers(), st.booleans(), st.none()),
    ).map(json.dumps),
    st.integers(1, 5000).map(lambda depth: "[" * depth + "]" * depth),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40),
)


def _often(data: st.DataObject, label: str) -> bool:
    """True three times in four (the first choice, too, is what Hypothesis shrinks towards)."""
    return data.draw(st.sampled_from([True, True, True, False]), label=label)


def _aim(target: Target, case: schemathesis.Case, data: st.DataObject) -> list[tuple[str, str]]:
    """Swap generated path parameters and payloads for real ones, often; returns extra headers."""
    real = {"population": list(POPULATIONS), "sid": [sid for sid, _ in target.sessions], "rid": target.resources}
    for name in list(case.path_parameters or {}):
        if name in real and _often(data, f"real {name}?"):
            case.path_parameters[name] = data.draw(st.sampled_from(real[name]), label=name)
    body = case.body
    if case.path.endswith("/report"):
        if _often(data, "decodable update?"):
            case.body = data.draw(_updates(target.update_spec), label="update")
        if data.draw(st.booleans(), label="stats header?"):
            return [("X-FL-Session-Stats", data.draw(STATS_HEADERS, label="stats"))]
    elif case.path.endswith("/checkin") and isinstance(body, dict) and isinstance(body.get("eligibility"), dict):
        if data.draw(st.booleans(), label="verdict for the real task?"):
            body["eligibility"]["task"] = "train"
    elif case.path.endswith(("/tasks", "/task-groups")) and isinstance(body, dict):
        tasks = body.get("tasks") if case.path.endswith("/task-groups") else [body]
        for task in tasks if isinstance(tasks, list) else []:
            if isinstance(task, dict) and _often(data, "real plan?"):
                task["plan"] = target.plan
                if _often(data, "real checkpoint?"):
                    task["checkpoint"] = target.checkpoint
    return []


def _credential(target: Target, case: schemathesis.Case, data: st.DataObject, headers: dict) -> str:
    """Set the Authorization header to one kind of credential, favouring the one the operation
    takes (so that most requests get past authentication); returns the kind, for messages."""
    params = case.path_parameters or {}
    kinds = ["admin", "session", "none", "wrong", "generated"]
    if params.get("sid") in {sid for sid, _ in target.sessions} or params.get("rid") in target.resources:
        kinds = ["session"] * 4 + kinds
    elif any(s == {"adminKey": []} for s in case.operation.definition.raw.get("security", [])):
        kinds = ["admin"] * 4 + kinds
    kind = data.draw(st.sampled_from(kinds), label="credential")
    if kind == "generated":
        return kind
    headers.pop("Authorization", None)
    if kind == "admin":
        headers["Authorization"] = f"Bearer {target.admin_key}"
    elif kind == "wrong":
        headers["Authorization"] = "Bearer " + "x" * 43
    elif kind == "session":
        own = [token for sid, token in target.sessions if sid == params.get("sid")]
        tokens = own * 4 + [token for _, token in target.sessions] if own else [token for _, token in target.sessions]
        headers["Authorization"] = f"Bearer {data.draw(st.sampled_from(tokens), label='token')}"
    return kind


def _header_bytes(value: object) -> bytes:
    text = value if isinstance(value, str) else json.dumps(value)
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        return text.encode("utf-8")


def _query(params: dict) -> list[tuple[str, str]]:
    out = []
    for name, value in (params or {}).items():
        for item in value if isinstance(value, list) else [value]:
            out.append((str(name), item if isinstance(item, str) else json.dumps(item)))
    return out


def _request(
    target: Target, http: httpx.Client, case: schemathesis.Case, data: st.DataObject
) -> tuple[httpx.Request, str]:
    extra = _aim(target, case, data)
    kwargs = case.as_transport_kwargs(base_url=target.url)
    headers = dict(kwargs.get("headers") or {})
    headers.update(extra)
    kind = _credential(target, case, data, headers)
    # Only headers a client can put on the wire (h11 refuses the rest before anything is sent).
    wire = [
        (name.encode(), _header_bytes(value))
        for name, value in headers.items()
        if HEADER_NAME.fullmatch(name)
        and name.lower() not in TRANSPORT_HEADERS
        and HEADER_VALUE.fullmatch(str(value))
        and str(value) == str(value).strip()
    ]
    if "json" in kwargs:
        content = json.dumps(kwargs["json"]).encode()
    else:
        raw = kwargs.get("data")
        content = raw.encode() if isinstance(raw, str) else raw
    request = http.build_request(
        kwargs["method"], kwargs["url"], params=_query(kwargs.get("params")), headers=wire, content=content
    )
    shown = (content or b"")[:300]
    return request, f"{request.method} {request.url} [credential: {kind}] body {shown!r}"


def _check(response: httpx.Response, described: str) -> None:
    status = response.status_code
    assert status < 500, f"{described} -> {status}: {response.text[:500]}"
    if status >= 400:
        assert response.headers.get("content-type", "").startswith("application/json"), (
            f"{described} -> {status}, not JSON"
        )
        body = response.json()
        assert isinstance(body, dict) and set(body) == {"error"}, f"{described} -> {status} {body!r}"
        error = body["error"]
        assert isinstance(error, dict) and set(error) == {"code", "message"}, f"{described} -> {status} {body!r}"
        assert isinstance(error["code"], str) and ERROR_CODE.fullmatch(error["code"]), (
            f"{described} -> {status} {body!r}"
        )
        assert isinstance(error["message"], str) and error["message"], f"{described} -> {status} {body!r}"


_VALIDATORS: dict[tuple[str, str, int], tuple[str, jsonschema_rs.Draft202012Validator | None]] = {}


def _answer_validator(
    target: Target, path: str, method: str, status: int
) -> tuple[str, jsonschema_rs.Draft202012Validator | None]:
    """The media type the document declares for a success of the operation, and a validator of its JSON schema."""
    key = (path, method, status)
    if key not in _VALIDATORS:
        _VALIDATORS[key] = _declared_answer(target, path, method, status)
    return _VALIDATORS[key]


def _declared_answer(
    target: Target, path: str, method: str, status: int
) -> tuple[str, jsonschema_rs.Draft202012Validator | None]:
    declared = target.document["paths"][path][method.lower()]["responses"].get(str(status), {}).get("content", {})
    [(media, body)] = declared.items() if len(declared) == 1 else [("undeclared", {})]
    if media != "application/json":
        return media, None
    return media, jsonschema_rs.Draft202012Validator({**body["schema"], "components": target.document["components"]})


def _check_answer(target: Target, path: str, method: str, response: httpx.Response, described: str) -> None:
    """A success is what the document declares for it: JSON its schema accepts, or bytes where it says bytes."""
    if not 200 <= response.status_code < 300:
        return
    media, validator = _answer_validator(target, path, method, response.status_code)
    assert response.headers.get("content-type", "").split(";")[0] == media, (
        f"{described} -> {response.status_code} {media}"
    )
    if validator is not None:
        errors = [e.message for e in validator.iter_errors(response.json())]
        assert not errors, f"{described} -> {response.status_code} {response.text[:300]}: {errors[:3]}"


#: The codes the HTTP server answers before a request reaches a route (``http_guards``, the router):
#: the document names them in its description, not per route.
SERVER_CODES = {
    "MALFORMED_REQUEST",
    "HEADER_TIMEOUT",
    "HEADERS_TOO_LARGE",
    "SERVER_BUSY",
    "HTTP_VERSION_NOT_SUPPORTED",
    "CLIENT_CERTIFICATE_REQUIRED",
    "NOT_FOUND",
    "METHOD_NOT_ALLOWED",
}


def _check_error_documented(target: Target, path: str, method: str, response: httpx.Response, described: str) -> None:
    """A refusal is one the document lists for the route, status and code; or one of the server's own."""
    if response.status_code < 400:
        return
    code = response.json()["error"]["code"]
    if code in SERVER_CODES:
        assert f"{response.status_code} {code}" in target.document["info"]["description"], f"{described} -> {code}"
        return
    declared = target.document["paths"][path][method.lower()]["responses"].get(str(response.status_code), {})
    assert code in declared.get("x-error-codes", ()), f"{described} -> {response.status_code} {code}: undocumented"


def _fuzz(target: Target, path: str, method: str, mode: str, examples: int) -> None:
    operation = target.schema[path][method]
    strategy = operation.as_strategy(schemathesis.GenerationMode(mode))

    with httpx.Client(timeout=TIMEOUT_S) as http:

        @settings(
            max_examples=examples,
            derandomize=True,
            deadline=None,
            database=None,
            print_blob=False,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
        )
        @given(case=strategy, data=st.data())
        def exchange(case: schemathesis.Case, data: st.DataObject) -> None:
            request, described = _request(target, http, case, data)
            started = time.monotonic()
            try:
                response = http.send(request)
            except httpx.TimeoutException:
                raise AssertionError(f"{described} hung: no answer within {TIMEOUT_S} s") from None
            except httpx.TransportError as exc:
                raise AssertionError(f"{described} broke the connection: {exc!r}") from None
            assert time.monotonic() - started < TIMEOUT_S, described
            _check(response, described)
            _check_answer(target, path, method, response, described)
            _check_error_documented(target, path, method, response, described)

        exchange()


@pytest.mark.parametrize("path, method, mode", FUZZ_CASES)
def test_no_request_gets_a_server_error_or_hangs(target, path, method, mode):
    _fuzz(target, path, method, mode, EXAMPLES)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path, method, mode", FUZZ_CASES)
def test_no_request_gets_a_server_error_or_hangs_long_run(target, path, method, mode):
    _fuzz(target, path, method, mode, SLOW_EXAMPLES)


# ----------------------------------------------------------------------------- the document
def test_openapi_is_3_1_and_documents_every_route(target):
    document = target.document
    assert document["openapi"].startswith("3.1.")
    documented = sorted((path, method.upper()) for path, item in document["paths"].items() for method in item)
    assert documented == ROUTES
    assert document == _app().openapi()  # what is served is what the app declares
    for path, item in document["paths"].items():
        for method, operation in item.items():
            errors = {status: a for status, a in operation["responses"].items() if status >= "4"}
            assert "500" in errors, f"{method} {path}"
            for status, answer in errors.items():
                assert "ErrorBody" in json.dumps(answer) and answer["x-error-codes"], f"{method} {status} {path}"
                assert answer["description"].endswith(": " + ", ".join(answer["x-error-codes"])), f"{method} {path}"
            tags = operation.get("tags", [])
            if tags == ["operators"]:
                assert operation["security"] == [{"adminKey": []}], f"{method} {path}"
            if path.startswith("/v1/sessions/"):
                assert operation["security"] == [{"sessionToken": []}], f"{method} {path}"


def _documented_codes(document: dict) -> dict[tuple[str, str], set[str]]:
    return {
        (method.upper(), path): {c for a in op["responses"].values() for c in a.get("x-error-codes", ())}
        for path, item in document["paths"].items()
        for method, op in item.items()
    }


def test_each_route_documents_only_the_error_codes_it_can_send():
    """The document listed every status on every route (a 401 and a 422 on /v1/health)."""
    codes = _documented_codes(_app().openapi())
    assert codes[("GET", "/v1/health")] == {"DATABASE_GONE", "INTERNAL"}
    assert codes[("GET", "/v1/populations/{population}/eligibility")] == {"INTERNAL"}
    assert codes[("GET", "/v1/populations")] == {
        "ADMIN_KEY_REQUIRED",
        "BAD_ADMIN_KEY",
        "DATABASE_UNAVAILABLE",
        "INTERNAL",
    }
    assert "DATABASE_UNAVAILABLE" not in codes[("POST", "/v1/attestation/nonce")]
    devices = {c for (_, path), found in codes.items() if "/sessions/" in path or "/checkin" in path for c in found}
    operators = codes[("POST", "/v1/populations/{population}/tasks")]
    assert not devices & {"ADMIN_KEY_REQUIRED", "TASK_EXISTS", "INVALID_PLAN", "RELEASE_TEST_FAILED"}
    assert not operators & {"MISSING_TOKEN", "BAD_SESSION_TOKEN", "REPORT_LATE", "RATE_LIMITED"}
    assert "422" not in json.dumps(_app().openapi()["paths"]["/v1/populations/{population}/rounds"])


def test_every_error_code_the_server_sends_is_documented():
    """Every code written in the server's source (an error's class, ``code="..."``, the release gate's
    and the attestation verifier's) is one a route lists or, for the HTTP server's own, the description."""
    from device_runtime import attestation

    sources = [*(ROOT / "server_stub").glob("*.py"), Path(attestation.__file__)]
    written = {
        code
        for source in sources
        for code in re.findall(
            r'(?:code="|code, http_status = "|status, code = \d+, "|ReleaseGateError\(\s*")([A-Z][A-Z0-9_]+)"',
            source.read_text(encoding="utf-8"),
        )
    }
    document = _app().openapi()
    documented = {c for found in _documented_codes(document).values() for c in found}
    assert all(code in document["info"]["description"] for code in SERVER_CODES)
    # the bases' defaults, which every raise of theirs overrides
    bases = {"ATTESTATION_FAILED", "BAD_REQUEST", "UNAUTHORIZED", "CONFLICT"}
    assert len(written) > 50 and written - documented - SERVER_CODES <= bases, written - documented - SERVER_CODES


_CONFIG_VALIDATORS: dict[int, tuple[dict, jsonschema_rs.Draft202012Validator]] = {}


def _round_config_validator(document: dict) -> jsonschema_rs.Draft202012Validator:
    """The RoundConfig schema's validator, compiled once per document (not once per drawn config)."""
    kept = _CONFIG_VALIDATORS.get(id(document))
    if kept is None or kept[0] is not document:
        validator = jsonschema_rs.Draft202012Validator(
            {"$ref": "#/components/schemas/RoundConfig", "components": document["components"]}
        )
        kept = _CONFIG_VALIDATORS[id(document)] = (document, validator)
    return kept[1]


INTEGER_FIELDS = {"goal_count", "max_rounds", "secagg_min_group_size", "min_reports", "max_examples_per_report"}
FIELDS = sorted(RoundConfig.__dataclass_fields__) + ["unknown_field"]
EDGES = [
    0,
    1,
    2,
    -1,
    0.0,
    -0.0,
    1e-300,
    0.5,
    1.0,
    1.5,
    100.0,
    100.5,
    604800.0,
    604800.5,
    1e6,
    1e6 + 1,
    100_000,
    100_001,
    10**30,
    1e308,
]
VALUES = st.one_of(
    st.sampled_from(EDGES),
    st.integers(-10, 10**7),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.lists(st.one_of(st.sampled_from(EDGES), st.floats(-10, 10**6, allow_nan=False)), max_size=3),
)


def _server_accepts(config: dict) -> bool:
    body = json.dumps({"name": "t", "plan": "", "config": config})
    try:
        TaskDeploy.model_validate_json(body)
    except ValueError:
        return False
    return True


CONFIGS = st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=4)


@settings(max_examples=CONFIG_EXAMPLES, derandomize=True, deadline=None)
@given(config=CONFIGS)
def test_round_config_schema_refuses_what_the_server_refuses(target, config):
    _schema_and_server_agree(target.document, config)


@pytest.mark.slow
@settings(max_examples=SLOW_CONFIG_EXAMPLES, derandomize=True, deadline=None)
@given(config=CONFIGS)
def test_round_config_schema_refuses_what_the_server_refuses_long_run(target, config):
    _schema_and_server_agree(target.document, config)


def _schema_and_server_agree(document: dict, config: dict) -> None:
    """The RoundConfig schema accepts exactly the configs the server accepts, but for a reversed retry window."""
    # JSON Schema counts 1.0 as an integer and cannot say so otherwise; the server's counts are
    # strict JSON integers. A client that writes a count as 1.0 gets BAD_CONFIG.
    assume(not any(isinstance(config.get(k), float) and config[k].is_integer() for k in INTEGER_FIELDS))
    in_schema = _round_config_validator(document).is_valid(config)
    accepted = _server_accepts(config)
    # The one rule JSON Schema cannot state: a retry window's min is at most its max.
    window = config.get("retry_window_s")
    reversed_window = isinstance(window, list) and len(window) == 2 and window[0] > window[1]
    assert accepted == (in_schema and not reversed_window), config


def test_round_config_bounds_are_in_the_document_and_enforced_over_http(target):
    schema = target.document["components"]["schemas"]["RoundConfig"]["properties"]
    assert schema["goal_count"]["minimum"] == 1 and schema["goal_count"]["type"] == "integer"
    assert schema["min_fraction"]["exclusiveMinimum"] == 0.0 and schema["min_fraction"]["maximum"] == 1.0
    assert schema["over_selection"]["minimum"] == 1.0
    assert "min <= max" in schema["retry_window_s"]["description"]
    validator = _round_config_validator(target.document)
    headers = {"Authorization": f"Bearer {target.admin_key}"}
    with httpx.Client(base_url=target.url, timeout=TIMEOUT_S, headers=headers) as http:
        for bad in (
            {"goal_count": 0},
            {"goal_count": True},
            {"min_fraction": 0.0},
            {"over_selection": 0.5},
            {"retry_window_s": [1.0, 2.0, 3.0]},
            {"report_timeout_s": 1e9},
            {"surprise": 1},
        ):
            assert not validator.is_valid(bad), bad
            body = {"name": "t", "plan": target.plan, "checkpoint": target.checkpoint, "config": bad}
            r = http.post("/v1/populations/idle/tasks", content=json.dumps(body))
            assert r.status_code == 400 and r.json()["error"]["code"] == "BAD_CONFIG", (bad, r.text)
