"""How the server checks plain reports: at most ``CHECKED_AT_ONCE`` at a time, since each check
holds several copies of the update (its digest, its norm and bounding in float64), so that the
reports of a large model arriving together do not take the server's memory at once."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np

from device_runtime import PlanExecutor, encode_checkpoint
from server_stub import reports
from tests.support import deploy


def _update(plan) -> bytes:
    spec = PlanExecutor(plan).client_update_spec()
    update = {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in spec.items()}
    update["num_examples"] = np.array(4, dtype=update["num_examples"].dtype)
    return encode_checkpoint(update)


def test_reports_arriving_together_are_checked_one_at_a_time_at_a_limit_of_one(server, admin, monkeypatch):
    """Five DistilBERT reports (268 MB each) checked at once took a server past 7 GB; here, with
    the limit at one, three reports sent at once are checked one after another, and all taken."""
    plan, _ = deploy(admin, goal_count=3, over_selection=1.0, min_fraction=1.0, selection_timeout_s=60)
    monkeypatch.setattr(reports, "_checking", threading.BoundedSemaphore(1), raising=False)
    decode = reports.decode_checkpoint
    active, most, guard = [0], [0], threading.Lock()

    def slow_decode(*args, **kwargs):
        with guard:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.1)
        try:
            return decode(*args, **kwargs)
        finally:
            with guard:
                active[0] -= 1

    monkeypatch.setattr(reports, "decode_checkpoint", slow_decode)
    body = _update(plan)
    with httpx.Client(base_url=server.url, timeout=10) as http:
        sessions = [
            http.post("/v1/populations/digits/checkin", json={"runtime_version": "1.31.1"}).json() for _ in range(3)
        ]
    assert all(s["status"] == "accepted" for s in sessions), sessions
    answers: list[int] = []

    def send(session: dict) -> None:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            r = http.post(
                f"/v1/sessions/{session['session_id']}/report",
                content=body,
                headers={"Authorization": f"Bearer {session['token']}"},
            )
            answers.append(r.status_code)

    threads = [threading.Thread(target=send, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(answers) == [200, 200, 200]
    assert most[0] == 1
