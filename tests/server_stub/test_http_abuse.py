"""Bad and hostile requests against a real uvicorn server: each gets its 4xx with a stable code,
never a 5xx, and the round goes on and commits."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from device_runtime import PlanExecutor, encode_checkpoint
from device_runtime.clock import VirtualClock
from device_runtime.protocol import STATS_HEADER
from server_stub import ServerThread
from tests.support import deploy


def _valid_update(plan) -> dict:
    spec = PlanExecutor(plan).client_update_spec()
    update = {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in spec.items()}
    update["num_examples"] = np.array(4, dtype=update["num_examples"].dtype)
    return update


def _checkin(http: httpx.Client, population: str = "digits") -> dict:
    answer = http.post(f"/v1/populations/{population}/checkin", json={"runtime_version": "1.31.1"}).json()
    assert answer["status"] == "accepted", answer
    return answer


def _report(http: httpx.Client, session: dict, body: bytes, token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token or session['token']}"}
    return http.post(f"/v1/sessions/{session['session_id']}/report", content=body, headers=headers)


def _code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


def test_every_abuse_gets_its_4xx_and_the_round_commits(server, admin):
    plan, _ = deploy(
        admin, goal_count=2, over_selection=2.0, min_fraction=1.0, report_timeout_s=30, selection_timeout_s=60
    )
    good = encode_checkpoint(_valid_update(plan))
    with httpx.Client(base_url=server.url, timeout=10) as http:
        a, b, c = _checkin(http), _checkin(http), _checkin(http)

        r = _report(http, a, good, token="not-the-token")
        assert r.status_code == 401 and _code(r) == "BAD_SESSION_TOKEN"
        r = _report(http, a, good, token=b["token"])
        assert r.status_code == 401 and _code(r) == "BAD_SESSION_TOKEN"
        r = http.post(f"/v1/sessions/{a['session_id']}/report", content=good)
        assert r.status_code == 401 and _code(r) == "MISSING_TOKEN"
        r = _report(http, a, b"\x00garbage" * 10)
        assert r.status_code == 422 and _code(r) == "MALFORMED_UPDATE"
        r = _report(http, a, b"x" * (a["max_report_bytes"] + 1))
        assert r.status_code == 413 and _code(r) == "BODY_TOO_LARGE"

        wrong_shape = _valid_update(plan)
        first = plan.weight_names[0]
        wrong_shape[first] = np.zeros(tuple(d + 1 for d in wrong_shape[first].shape), dtype=np.float32)
        r = _report(http, a, encode_checkpoint(wrong_shape))
        assert r.status_code == 422 and _code(r) == "INVALID_UPDATE"
        missing = _valid_update(plan)
        del missing[first]
        r = _report(http, a, encode_checkpoint(missing))
        assert r.status_code == 422 and _code(r) == "INVALID_UPDATE"
        nan = _valid_update(plan)
        nan[first] = np.full_like(nan[first], np.nan)
        r = _report(http, a, encode_checkpoint(nan))
        assert r.status_code == 422 and _code(r) == "INVALID_UPDATE"

        r = http.post(
            "/v1/populations/digits/checkin", content=b"{not json", headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 400 and _code(r) == "MALFORMED_BODY"
        r = http.post("/v1/populations/digits/checkin", json={"runtime_version": 131})
        assert r.status_code == 400 and _code(r) == "BAD_FIELD"
        r = http.post("/v1/populations/digits/checkin", json=[1, 2])
        assert r.status_code == 400
        r = http.post(
            "/v1/populations/nope/checkin", json={"runtime_version": "1.31.1"}
        )  # as a population with no task
        assert r.status_code == 200 and r.json()["status"] == "rejected" and r.json()["reason"] == "NO_TASK"
        r = http.get("/v1/resources/" + "0" * 64)
        assert r.status_code == 401 and _code(r) == "MISSING_TOKEN"
        r = http.get("/v1/resources/" + "0" * 64, headers={"Authorization": f"Bearer {a['token']}"})
        assert r.status_code == 404 and _code(r) == "UNKNOWN_RESOURCE"
        r = http.get("/v1/resources/../../etc/passwd")
        assert r.status_code == 404
        r = _report(http, {"session_id": "no-such-session", "token": "x"}, good)  # as a known one with a wrong token
        assert r.status_code == 401 and _code(r) == "BAD_SESSION_TOKEN"
        r = http.post("/v1/populations", content=b"x" * 100_000)
        assert r.status_code == 401 and _code(r) == "ADMIN_KEY_REQUIRED"
        r = admin.http.post("/v1/populations", content=b"x" * 100_000)
        assert r.status_code == 413
        r = http.delete("/v1/populations/digits")
        assert r.status_code == 405

        # The round is unharmed: two good reports commit it, the third is late, a repeat is a duplicate.
        assert _report(http, a, good).status_code == 200
        r = _report(http, a, good)
        assert r.status_code == 409 and _code(r) == "DUPLICATE_REPORT"
        assert _report(http, b, good).status_code == 200
        r = _report(http, c, good)
        assert r.status_code == 409 and _code(r) == "REPORT_LATE"
    rounds = admin.rounds("digits")
    assert [r["status"] for r in rounds] == ["committed"]
    assert rounds[0]["metrics"]["reported"] == 2
    assert rounds[0]["metrics"]["rejected_late"] == 1


@pytest.fixture
def clock():
    """The server's monotonic clock, moved by the test: a deadline passes when the test says so,
    never because the machine was slow, and the ticker cannot close a round behind its back."""
    return VirtualClock(start=1000.0)


@pytest.fixture
def clocked(tmp_path, clock):
    with ServerThread(tmp_path / "server.db", clock=clock.now) as srv, srv.admin() as admin:
        yield srv, admin


def _wait_for_rounds(admin, count: int, timeout_s: float = 5.0) -> list[dict]:
    """Rounds are written just after the request (or tick) that closed them; wait a bounded time."""
    deadline = time.monotonic() + timeout_s
    while len(rounds := admin.rounds("digits")) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(rounds) == count, rounds
    return rounds


def test_report_after_deadline_is_rejected_and_round_goes_on(clocked, clock):
    server, admin = clocked
    plan, _ = deploy(
        admin, goal_count=1, over_selection=2.0, min_fraction=1.0, report_timeout_s=0.5, selection_timeout_s=60
    )
    good = encode_checkpoint(_valid_update(plan))
    with httpx.Client(base_url=server.url, timeout=10) as http:
        # Every deadline passes: the round is abandoned and both reports are late.
        first, second = _checkin(http), _checkin(http)
        clock.advance(0.8)
        r = _report(http, first, good)
        assert r.status_code == 409 and _code(r) == "REPORT_LATE"
        r = _report(http, second, good)
        assert r.status_code == 409 and _code(r) == "REPORT_LATE"
        assert [r["status"] for r in _wait_for_rounds(admin, 1)] == ["abandoned"]

        # The next attempt at round 1: `slow` checks in 0.4 s before `fast`, so once slow's
        # deadline has passed the round is still open, waiting for fast. Slow's report is late by
        # its own deadline alone; fast's, on time, commits the round.
        slow = _checkin(http)
        assert slow["round"] == 1
        clock.advance(0.4)
        fast = _checkin(http)
        clock.advance(0.2)  # slow: 0.1 s past its deadline; fast: 0.3 s before its own
        r = _report(http, slow, good)
        assert r.status_code == 409 and _code(r) == "REPORT_LATE"
        status = admin.status("digits")
        assert status["phase"] == "reporting" and status["round"] == 1
        assert status["current_round"]["rejected_late"] == 1
        assert _report(http, fast, good).status_code == 200
    rounds = _wait_for_rounds(admin, 2)
    assert [r["status"] for r in rounds] == ["abandoned", "committed"]
    assert rounds[1]["metrics"]["reported"] == 1 and rounds[1]["metrics"]["rejected_late"] == 1


@pytest.mark.parametrize("claim", ["1e308", "1.9", "2.1", "-1", '"3"', "true"])
def test_a_training_time_no_session_of_the_round_can_have_had_is_not_summarised(clocked, clock, claim):
    """The advisory training time of a report's stats header is counted from 0 to how long its
    round has been open (2 s here): one device claiming 1e308 s set the round's summary."""
    server, admin = clocked
    plan, _ = deploy(
        admin, goal_count=2, over_selection=1.0, min_fraction=1.0, report_timeout_s=30, selection_timeout_s=60
    )
    good = encode_checkpoint(_valid_update(plan))
    with httpx.Client(base_url=server.url, timeout=10) as http:
        honest, other = _checkin(http), _checkin(http)
        clock.advance(2.0)
        stats = {STATS_HEADER: '{"training_s": 1.5}'}
        assert (
            http.post(
                f"/v1/sessions/{honest['session_id']}/report",
                content=good,
                headers={**stats, "Authorization": f"Bearer {honest['token']}"},
            ).status_code
            == 200
        )
        stats = {STATS_HEADER: f'{{"training_s": {claim}}}'}
        assert (
            http.post(
                f"/v1/sessions/{other['session_id']}/report",
                content=good,
                headers={**stats, "Authorization": f"Bearer {other['token']}"},
            ).status_code
            == 200
        )
    (record,) = _wait_for_rounds(admin, 1)
    training = record["metrics"]["device_metrics"]["training_s"]
    counted = [1.5, 1.9] if claim == "1.9" else [1.5]
    assert (training["count"], training["max"]) == (len(counted), max(counted))


def test_deploy_refuses_bad_plans_and_checkpoints(server, admin):
    import base64

    from server_stub import AdminError, RoundConfig
    from tests.support import digits_plan

    admin.create_population("p")
    plan = digits_plan()
    with pytest.raises(AdminError) as err:
        admin.deploy_task("p", "t", b"not a plan", encode_checkpoint({"w": np.zeros(2, np.float32)}), RoundConfig())
    assert err.value.status == 422 and err.value.code == "INVALID_PLAN"
    with pytest.raises(AdminError) as err:
        admin.deploy_task("p", "t", plan, encode_checkpoint({"w": np.zeros(2, np.float32)}), RoundConfig())
    assert err.value.code == "INVALID_CHECKPOINT"
    with pytest.raises(AdminError) as err:
        admin.deploy_task("p", "t", plan, b"junk", RoundConfig())
    assert err.value.code == "INVALID_CHECKPOINT"
    http = admin.http
    r = http.post("/v1/populations/p/tasks", json={"name": "t", "plan": "%%%", "checkpoint": ""})
    assert r.status_code == 400 and _code(r) == "BAD_FIELD"
    body = {"name": "t", "plan": base64.b64encode(b"x").decode(), "checkpoint": "", "config": {"goal_count": -1}}
    r = http.post("/v1/populations/p/tasks", json=body)
    assert r.status_code == 400 and _code(r) == "BAD_CONFIG"
    r = http.post("/v1/populations", json={"name": "bad name/with slash"})
    assert r.status_code == 400 and _code(r) == "BAD_NAME"
