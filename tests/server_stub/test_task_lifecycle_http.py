"""A task's life over real HTTP: it is completed after ``max_rounds`` committed rounds, and the
population's next deploy starts at once. Every wait here is bounded, so a server that ignored
``max_rounds`` fails in seconds instead of running rounds until a global timeout."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from device_runtime import PlanExecutor, encode_checkpoint, initial_weights
from server_stub import RoundConfig
from tests.support import digits_plan

MAX_ROUNDS = 3


def _update(plan) -> bytes:
    spec = PlanExecutor(plan).client_update_spec()
    update = {name: np.full(shape, 0.01, dtype=dtype) for name, (shape, dtype) in spec.items()}
    update["num_examples"] = np.array(4, dtype=update["num_examples"].dtype)
    return encode_checkpoint(update)


def _wait_until(predicate, what: str, timeout_s: float = 5.0):
    """``predicate()`` once it is truthy; fails after ``timeout_s`` (commits are written just
    after the request that closes the round, possibly by the ticker)."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert value, f"not within {timeout_s}s: {what}"
    return value


def _one_round(http: httpx.Client, update: bytes) -> dict:
    """One device checks in (again while the last round is being written) and reports."""

    def checkin() -> dict | None:
        answer = http.post("/v1/populations/digits/checkin", json={"runtime_version": "1.31.1"}).json()
        return answer if answer["status"] == "accepted" else None

    session = _wait_until(checkin, "a check-in is accepted")
    r = http.post(
        f"/v1/sessions/{session['session_id']}/report",
        content=update,
        headers={"Authorization": f"Bearer {session['token']}"},
    )
    assert r.status_code == 200, r.text
    return session


@pytest.mark.timeout(60)
def test_a_task_completes_after_max_rounds_and_the_next_deploy_starts(server, admin):
    plan = digits_plan()
    checkpoint = encode_checkpoint(initial_weights(plan, seed=0))
    admin.create_population("digits")
    one_device = dict(goal_count=1, over_selection=1.0, min_reports=1, selection_timeout_s=60, report_timeout_s=60)
    admin.deploy_task("digits", "first", plan, checkpoint, RoundConfig(max_rounds=MAX_ROUNDS, **one_device))
    admin.deploy_task("digits", "second", plan, checkpoint, RoundConfig(**one_device))
    update = _update(plan)
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for number in range(1, MAX_ROUNDS + 1):
            session = _one_round(http, update)
            assert (session["task"], session["round"]) == ("first", number)
            _wait_until(
                lambda number=number: len(admin.rounds("digits", "first")) == number,
                f"round {number} of 'first' is written",
            )

        _wait_until(lambda: admin.status("digits")["active_task"] == "second", "'second' is the active task")
        status = admin.status("digits")
        assert {t["name"]: t["status"] for t in status["tasks"]} == {"first": "completed", "second": "active"}
        assert [t["name"] for t in status["active_tasks"]] == ["second"]
        session = _one_round(http, update)
        assert (session["task"], session["round"]) == ("second", 1)

    first = admin.rounds("digits", "first")
    assert [(r["round"], r["status"]) for r in first] == [(n, "committed") for n in range(1, MAX_ROUNDS + 1)]
    assert [(r["round"], r["status"]) for r in admin.rounds("digits", "second")] == [(1, "committed")]
