"""Devices and strangers talking to a real server on loopback in any order: check-ins, reports
(good, garbage, of the wrong shape, too large, sent again), aborts, downloads and Secure
Aggregation calls on a plain task, each with the session's own token, another device's, a made-up
one or none, under any stats header, content type and query string. Whatever comes, the answer
is never a 5xx, every refusal is ``{"error": {"code", "message"}}`` with the code the sequence
calls for (a stranger never gets past the token check, a device never reports twice), no request
hangs, and the open round counts exactly the reports and aborts the server took."""

from __future__ import annotations

import itertools
import json
from urllib.parse import quote

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from device_runtime import PlanExecutor, encode_checkpoint
from device_runtime.protocol import STATS_HEADER
from server_stub import ServerThread
from tests.support import deploy, digits_plan

KEY = "operator-key-" + "f" * 40
#: No call here long-polls, so anything slower than this is a hang.
TIMEOUT_S = 5.0
_POPULATIONS = itertools.count()

PLAN = digits_plan()
_SPEC = PlanExecutor(PLAN).client_update_spec()


def _update(shape_off: int = 0) -> bytes:
    update = {name: np.zeros(tuple(d + shape_off for d in shape), dtype=dt) for name, (shape, dt) in _SPEC.items()}
    update["num_examples"] = np.array(4, dtype=update["num_examples"].dtype)
    return encode_checkpoint(update)


#: A report body by kind, and the code a device's open session gets for it (None: taken).
BODIES = {
    "good": (_update(), None),
    "garbage": (b"\x00not a checkpoint" * 3, "MALFORMED_UPDATE"),
    "wrong-shape": (_update(shape_off=1), "INVALID_UPDATE"),
    "empty": (b"", "MALFORMED_UPDATE"),
}
#: Header values a client may send: printable Latin-1 (what HTTP carries), JSON or not.
_HEADER_TEXT = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=80
).map(str.strip)  # (a value begins and ends with a visible character: HTTP trims the spaces)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
STATS = st.none() | _HEADER_TEXT | st.builds(json.dumps, _JSON)
CONTENT_TYPES = st.sampled_from(
    [None, "application/octet-stream", "application/json", "text/plain; charset=utf-8", "multipart/form-data; b=x"]
)
TOKENS = st.sampled_from(["own", "other", "made-up", "none"])
#: Every operator route (a stop names a task the population does not have: nothing is stopped).
OPERATOR_ROUTES = [
    ("GET", "/v1/populations"),
    ("POST", "/v1/populations"),
    ("GET", "/v1/populations/{p}"),
    ("POST", "/v1/populations/{p}/tasks"),
    ("POST", "/v1/populations/{p}/task-groups"),
    ("POST", "/v1/populations/{p}/tasks/no-such-task/stop"),
    ("GET", "/v1/populations/{p}/rounds"),
    ("GET", "/v1/populations/{p}/model"),
]
#: Query values that parse as numbers in one reading and not in another.
QUERY_VALUES = st.sampled_from(["", "0", "-1", "1.5", "nan", "inf", "1e309", "99999999999999999999", " 1", "0x1"])


class DeviceSessions(RuleBasedStateMachine):
    """A population of its own with a plain task whose round stays open; the model keeps each
    session's token, resources and state (``open``, ``reported``, ``aborted``)."""

    sessions = Bundle("sessions")

    def __init__(self, server: ServerThread, admin) -> None:
        super().__init__()
        self.server, self.admin = server, admin
        self.http = httpx.Client(base_url=server.url, timeout=TIMEOUT_S)
        self.population = f"fuzz-{next(_POPULATIONS)}"
        self.state: dict[str, str] = {}
        self.tokens: dict[str, str] = {}
        self.resources: dict[str, tuple[str, str]] = {}
        self.revoked: set[str] = set()  # sessions whose device aborted: their token opens nothing more

    @initialize()
    def deploy(self) -> None:
        deploy(
            self.admin,
            self.population,
            plan=PLAN,
            goal_count=200,
            over_selection=1.0,
            min_fraction=1.0,
            selection_timeout_s=3600,
            report_timeout_s=3600,
        )

    def teardown(self) -> None:
        self.http.close()

    # ------------------------------------------------------------------ helpers
    def _auth(self, sid: str, token: str) -> dict[str, str]:
        if token == "none":
            return {}
        if token == "own":
            return {"Authorization": f"Bearer {self.tokens[sid]}"}
        if token == "other":
            others = [t for s, t in self.tokens.items() if s != sid]
            return {"Authorization": f"Bearer {others[0] if others else 'x' * 43}"}
        return {"Authorization": "Bearer " + "A" * 43}

    def _expect(self, answer: httpx.Response, code: str | None) -> None:
        assert answer.status_code < 500, answer.text
        if code is None:
            assert answer.status_code in (200, 304), answer.text
            return
        assert answer.status_code >= 400, (code, answer.text)
        error = answer.json()["error"]
        assert set(error) == {"code", "message"} and error["message"], error
        assert error["code"] == code, (code, answer.text)

    @staticmethod
    def _token_code(token: str) -> str | None:
        """What a call with ``token`` gets before anything else is looked at."""
        return {"none": "MISSING_TOKEN", "other": "BAD_SESSION_TOKEN", "made-up": "BAD_SESSION_TOKEN"}.get(token)

    # ------------------------------------------------------------------ rules
    @rule(target=sessions)
    def check_in(self) -> str:
        answer = self.http.post(f"/v1/populations/{self.population}/checkin", json={"runtime_version": "1.31.1"})
        self._expect(answer, None)
        body = answer.json()
        assert body["status"] == "accepted", body
        sid = body["session_id"]
        self.state[sid], self.tokens[sid] = "open", body["token"]
        self.resources[sid] = (body["plan_id"], body["checkpoint_id"])
        return sid

    @rule(sid=sessions, kind=st.sampled_from(sorted(BODIES)), token=TOKENS, stats=STATS, ctype=CONTENT_TYPES)
    def report(self, sid: str, kind: str, token: str, stats: str | None, ctype: str | None) -> None:
        body, refused = BODIES[kind]
        headers = self._auth(sid, token)
        if stats is not None:
            headers[STATS_HEADER] = stats.encode("latin-1")  # type: ignore[assignment]
        if ctype is not None:
            headers["Content-Type"] = ctype
        answer = self.http.post(f"/v1/sessions/{sid}/report", content=body, headers=headers)
        code = self._token_code(token)
        if code is None:
            code = (
                "SESSION_CLOSED"
                if sid in self.revoked
                else {"reported": "DUPLICATE_REPORT"}.get(self.state[sid], refused)
            )
        if code == "DUPLICATE_REPORT" and refused is not None:
            assert answer.status_code < 500 and answer.json()["error"]["code"] in (code, refused), answer.text
            return
        self._expect(answer, code)
        if answer.status_code == 200:
            self.state[sid] = "reported"

    @rule(sid=sessions, token=TOKENS, reason=st.text(max_size=300))
    def abort(self, sid: str, token: str, reason: str) -> None:
        answer = self.http.post(f"/v1/sessions/{sid}/abort", json={"reason": reason}, headers=self._auth(sid, token))
        self._expect(answer, self._token_code(token))
        if answer.status_code == 200:
            assert answer.json()["status"] == ("aborted" if self.state[sid] == "open" else "ignored")
            self.state[sid] = "aborted" if self.state[sid] == "open" else self.state[sid]
            self.revoked.add(sid)

    @rule(sid=sessions, which=st.sampled_from([0, 1, 2]), token=TOKENS, etag=st.none() | _HEADER_TEXT)
    def download(self, sid: str, which: int, token: str, etag: str | None) -> None:
        rid = (*self.resources[sid], "0" * 64)[which]
        headers = self._auth(sid, token)
        if etag is not None:
            headers["If-None-Match"] = etag.encode("latin-1")  # type: ignore[assignment]
        answer = self.http.get(f"/v1/resources/{rid}", headers=headers)
        assert answer.status_code < 500, answer.text
        holder = sid if token == "own" else next((s for s, t in self.tokens.items() if s != sid), None)
        revoked = holder in self.revoked
        if token == "none":
            self._expect(answer, "MISSING_TOKEN")
        elif token == "made-up" or holder is None or revoked:
            self._expect(answer, "BAD_SESSION_TOKEN")
        elif which == 2:
            self._expect(answer, "UNKNOWN_RESOURCE")
        else:  # every session of the task has the same two resources
            self._expect(answer, None)

    @rule(sid=sessions, token=TOKENS, after=QUERY_VALUES, wait=QUERY_VALUES)
    def secagg_on_a_plain_task(self, sid: str, token: str, after: str, wait: str) -> None:
        headers = self._auth(sid, token)
        answer = self.http.get(f"/v1/sessions/{sid}/secagg", params={"after": after, "wait": wait}, headers=headers)
        assert answer.status_code not in (200, 500), answer.text  # a plain task's session is in no group
        codes = ("BAD_QUERY", "MISSING_TOKEN", "BAD_SESSION_TOKEN", "NOT_IN_GROUP")
        assert answer.json()["error"]["code"] in codes, answer.text
        posted = self.http.post(f"/v1/sessions/{sid}/secagg", content=b"\x01\x02", headers=headers)
        assert posted.status_code < 500 and posted.status_code != 200, posted.text
        assert set(posted.json()["error"]) == {"code", "message"}, posted.text

    @rule(sid=st.text(min_size=1, max_size=40), token=st.sampled_from(["made-up", "none"]))
    def a_session_that_does_not_exist(self, sid: str, token: str) -> None:
        path = httpx.URL(self.server.url).copy_with(raw_path=f"/v1/sessions/{_quoted(sid)}/report".encode())
        answer = self.http.post(path, content=BODIES["good"][0], headers=self._auth(sid, token))
        assert answer.status_code < 500, answer.text
        assert answer.json()["error"]["code"] in ("NOT_FOUND", "MISSING_TOKEN", "BAD_SESSION_TOKEN")

    @rule(
        route=st.sampled_from(OPERATOR_ROUTES),
        credential=st.sampled_from(["none", "wrong-key", "device-token", "key-as-basic", "key-without-scheme"]),
        body=st.none() | st.binary(max_size=64) | st.builds(lambda v: json.dumps(v).encode(), _JSON),
    )
    def an_operator_call_without_the_admin_key(
        self, route: tuple[str, str], credential: str, body: bytes | None
    ) -> None:
        method, path = route
        token = next(iter(self.tokens.values()), "d" * 43)
        header = {
            "wrong-key": f"Bearer {KEY[:-1]}g",
            "device-token": f"Bearer {token}",
            "key-as-basic": f"Basic {KEY}",
            "key-without-scheme": KEY,
        }.get(credential)
        headers = {"Authorization": header} if header is not None else {}
        answer = self.http.request(method, path.format(p=self.population), content=body, headers=headers)
        wanted = "BAD_ADMIN_KEY" if credential in ("wrong-key", "device-token") else "ADMIN_KEY_REQUIRED"
        self._expect(answer, wanted)
        assert answer.status_code == 401

    @invariant()
    def the_round_counts_what_the_server_took(self) -> None:
        if not self.state:
            return
        current = self.admin.status(self.population)["current_round"]
        states = list(self.state.values())
        assert current["selected"] == len(states)
        assert current["reported"] == states.count("reported")
        assert current["aborted"] == states.count("aborted")


def _quoted(text: str) -> str:
    return quote(text, safe="")


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    with ServerThread(tmp_path_factory.mktemp("fuzz") / "server.db", admin_key=KEY) as server, server.admin() as admin:
        yield server, admin


def _run(fuzzed, examples: int, steps: int) -> None:
    server, admin = fuzzed
    run_state_machine_as_test(
        lambda: DeviceSessions(server, admin),
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )


def test_any_sequence_of_device_and_stranger_calls_gets_its_code_and_the_round_counts_what_was_taken(fuzzed):
    _run(fuzzed, examples=6, steps=15)


@pytest.mark.slow
def test_any_sequence_of_device_and_stranger_calls_gets_its_code_and_the_round_counts_what_was_taken_long_run(
    fuzzed,
):
    _run(fuzzed, examples=200, steps=40)
