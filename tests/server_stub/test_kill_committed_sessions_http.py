"""A server that stops once a round's commit is on record and before the round's last device heard
of it (killed with SIGKILL in ``test_server_kills_http.py``), then starts again on its SQLite file:
the device that asks again is told its update is in the round on record, not that its session is
unknown, so that it keeps its session as taking part instead of training and sending its examples
again. Only the sessions of each task's last committed round are kept, by their token's hash."""

from __future__ import annotations

import httpx
import numpy as np
import onnxruntime

from device_runtime import PlanExecutor, encode_checkpoint
from device_runtime.protocol import ProtocolClient
from device_runtime.wire import CheckinAccepted
from server_stub import ServerThread
from tests.support import deploy


def _reported(url: str, plan) -> CheckinAccepted:
    """A device's session of the open round, its update reported (a round of one: committed)."""
    client = ProtocolClient(url)
    try:
        session = client.checkin("digits", onnxruntime.__version__)
        assert isinstance(session, CheckinAccepted), session
        spec = PlanExecutor(plan).client_update_spec()
        update = {name: np.full(shape, 0.01, dtype=dtype) for name, (shape, dtype) in spec.items()}
        update["num_examples"] = np.array(4, dtype=update["num_examples"].dtype)
        client.report(session, encode_checkpoint(update))
    finally:
        client.close()
    return session


def _sent_again(url: str, session: CheckinAccepted, token: str | None = None) -> tuple[int, str]:
    """The status and error code of the session's report sent again (by its device: its token)."""
    answer = httpx.post(
        f"{url}/v1/sessions/{session.session_id}/report",
        content=b"\0" * 64,
        headers={"Authorization": f"Bearer {token or session.token}", "Content-Type": "application/octet-stream"},
    )
    return answer.status_code, answer.json()["error"]["code"]


def test_a_report_sent_again_after_a_restart_is_taken_once_while_its_round_is_the_last_committed(tmp_path):
    db = tmp_path / "server.db"
    with ServerThread(db) as server, server.admin() as admin:
        plan, _ = deploy(admin, goal_count=1, over_selection=1.0)
        first = _reported(server.url, plan)
        assert [r["status"] for r in admin.rounds("digits")] == ["committed"]
    with ServerThread(db) as restarted:  # the sessions of the first server are gone from memory
        assert _sent_again(restarted.url, first) == (409, "DUPLICATE_REPORT")
        # neither the token of another session nor a guess is taken for it
        second = _reported(restarted.url, plan)
        assert _sent_again(restarted.url, first, token=second.token) == (401, "BAD_SESSION_TOKEN")
        assert _sent_again(restarted.url, first, token="x" * 43) == (401, "BAD_SESSION_TOKEN")
        # the second session's round is the task's last committed: the first is forgotten
        assert _sent_again(restarted.url, first) == (401, "BAD_SESSION_TOKEN")
    with ServerThread(db) as again:
        assert _sent_again(again.url, second) == (409, "DUPLICATE_REPORT")
