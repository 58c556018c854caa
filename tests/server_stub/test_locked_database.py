"""A database that another process holds locked: the server keeps answering (no lock is held
across a write, no handler blocks the event loop), and a commit whose write fails abandons its
round instead of being applied later a second time; the device whose report closed the round is
told so, and the abandoned round is on record once the database is free."""

from __future__ import annotations

import sqlite3
import threading
import time

import httpx
import numpy as np

from device_runtime import PlanExecutor, encode_checkpoint
from server_stub import ServerThread
from tests.support import deploy

GOAL = 5


def _update(plan, delta: float) -> bytes:
    spec = PlanExecutor(plan).client_update_spec()
    update = {
        n: np.full(s, delta * 4, dtype=d) if n in plan.weight_names else np.zeros(s, dtype=d)
        for n, (s, d) in spec.items()
    }
    update["num_examples"] = np.array(4, dtype=np.float32)
    return encode_checkpoint(update)


def _checkin(http: httpx.Client) -> httpx.Response:
    return http.post("/v1/populations/digits/checkin", json={"runtime_version": "1.31.1"})


def _report(http: httpx.Client, session: dict, body: bytes) -> httpx.Response:
    return http.post(
        f"/v1/sessions/{session['session_id']}/report",
        content=body,
        headers={"Authorization": f"Bearer {session['token']}"},
    )


def test_a_locked_database_neither_freezes_the_server_nor_applies_a_round_twice(tmp_path):
    db = tmp_path / "server.db"
    with (
        ServerThread(db, busy_timeout_s=2.0) as server,
        server.admin() as admin,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        plan, weights = deploy(
            admin,
            goal_count=GOAL,
            over_selection=1.0,
            min_fraction=1.0,
            selection_timeout_s=600,
            report_timeout_s=600,
            retry_window_s=(0.1, 0.2),
        )
        body = _update(plan, 0.01)
        sessions = [_checkin(http).json() for _ in range(GOAL)]
        for s in sessions[:-1]:
            assert _report(http, s, body).status_code == 200

        holder = sqlite3.connect(db, timeout=0.1, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
        last: list[httpx.Response] = []
        committing = threading.Thread(target=lambda: last.append(_report(http, sessions[-1], body)))
        try:
            committing.start()  # the goal is reached: its commit waits for the lock
            # While that write waits, the server answers health, status and check-ins.
            probes = [http.get("/v1/health"), admin.http.get("/v1/populations/digits"), _checkin(http)]
            still_waiting = committing.is_alive()
        finally:
            committing.join(timeout=30)
            holder.execute("ROLLBACK")
            holder.close()
        assert still_waiting, "the commit did not wait for the locked database"
        assert [p.status_code for p in probes] == [200, 200, 200]
        assert probes[2].json()["reason"] == "ROUND_FULL"  # no round is open while one is being written
        assert last[0].status_code == 200
        assert last[0].json()["round_status"] == "abandoned"  # taken into a round that was not committed

        # The failed write abandoned the round; its record is written by the ticker once the
        # database is free, and until then no round opens (its devices would train for nothing).
        deadline = time.monotonic() + 30
        while (statuses := [r["status"] for r in admin.rounds("digits")]) == []:
            assert time.monotonic() < deadline, "the abandoned round's record was never written"
            time.sleep(0.05)
        assert statuses == ["abandoned"]
        # The next attempt commits one mean update, once.
        sessions = [_checkin(http).json() for _ in range(GOAL)]
        assert all(s["status"] == "accepted" and s["round"] == 1 for s in sessions), sessions
        assert all(_report(http, s, body).status_code == 200 for s in sessions)
        assert [(r["round"], r["attempt"], r["status"]) for r in admin.rounds("digits")] == [
            (1, 1, "abandoned"),
            (1, 2, "committed"),
        ]
        model, number = admin.model("digits")
        assert number == 1 and sum(r["status"] == "committed" for r in admin.rounds("digits")) == 1
        for name in plan.weight_names:
            np.testing.assert_allclose(model[name], weights[name] + np.float32(0.01), rtol=1e-6, atol=1e-7)
