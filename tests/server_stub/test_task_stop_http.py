"""Stopping a task on a running server over real HTTP (uvicorn on loopback, a SQLite file, real
devices): its open round is closed without committing and its devices' sessions end as in any
round closed under them, the population's next deploy starts, the stop is on record before its
answer and stays after a restart (and a kill), and a stop the server cannot make is a 4xx with a
stable code."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

from device_runtime import (
    FLRuntime,
    Outcome,
    PlanExecutor,
    RetryPolicy,
    build_eval_plan,
    encode_checkpoint,
    initial_weights,
)
from device_runtime.plan import serialize_plan
from example_store import SQLiteExampleStore
from server_stub import AdminClient, AdminError, FLService, RoundConfig, ServerStore, ServerThread, task_body
from tests.support import COLLECTION, PROCESS_ADMIN_KEY, ServerProcess, deploy_secure, digits_plan, in_threads

#: Rounds of two devices that stay open until both report (or a minute passes): a round is open
#: with its devices mid-session for as long as a test holds them. No ``max_rounds``: never completed.
TWO_DEVICES = dict(goal_count=2, over_selection=1.0, min_reports=1, selection_timeout_s=60, report_timeout_s=60)
FAST = RetryPolicy(attempts=3, base_delay_s=0.01, max_delay_s=0.05)


def _devices(tmp_path, digits, url: str, count: int) -> tuple[list[FLRuntime], list[SQLiteExampleStore]]:
    stores, devices = [], []
    for i in range(count):
        store = SQLiteExampleStore(tmp_path / f"app{i}.db")
        part = slice(12 * i, 12 * i + 12)
        store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[part], digits.y_train[part])))
        stores.append(store)
        devices.append(FLRuntime("p", url, store, cache_dir=tmp_path / f"cache{i}", retry=FAST))
    return devices, stores


def _tasks(admin: AdminClient) -> dict[str, str]:
    return {t["name"]: t["status"] for t in admin.status("p")["tasks"]}


def _deploy_two(admin: AdminClient) -> None:
    """``forever`` (no ``max_rounds``: it never completes), and ``next`` queued behind it."""
    plan = digits_plan()
    checkpoint = encode_checkpoint(initial_weights(plan, seed=0))
    admin.create_population("p")
    admin.deploy_task("p", "forever", plan, checkpoint, RoundConfig(**TWO_DEVICES))
    admin.deploy_task("p", "next", plan, checkpoint, RoundConfig(**TWO_DEVICES))


@pytest.mark.timeout(60)
def test_a_task_stopped_mid_round_ends_its_sessions_starts_the_next_deploy_and_stays_stopped(tmp_path, digits):
    db = tmp_path / "server.db"
    with ServerThread(db) as server, server.admin() as admin:
        _deploy_two(admin)
        devices, stores = _devices(tmp_path, digits, server.url, 2)
        try:
            first = in_threads(2, lambda i: devices[i].run_session(), 30)
            assert [(r.outcome, r.task, r.round) for r in first if r] == [(Outcome.COMPLETED, "forever", 1)] * 2

            # round 2: both devices checked in and trained, their reports not yet sent
            trained = [threading.Event() for _ in devices]
            stopped = threading.Event()

            def mid_session(i: int):
                def hold() -> None:
                    trained[i].set()
                    assert stopped.wait(20)

                return devices[i].run_session(before_report=hold)

            ended: list = []
            sessions = threading.Thread(target=lambda: ended.extend(in_threads(2, mid_session, 30)))
            sessions.start()
            assert all(t.wait(20) for t in trained)
            assert admin.status("p")["phase"] == "reporting"
            answer = admin.stop_task("p", "forever")
            stopped.set()
            sessions.join(30)

            assert answer == {
                "population": "p",
                "task": "forever",
                "status": "stopped",
                "stopped": ["forever"],
                "abandoned_round": 2,
                "committed_rounds": 1,
                "running": ["next"],
            }
            # their reports come to a closed round: refused as late, the session over
            assert [(r.outcome, r.task, r.round, r.rejection_code) for r in ended] == [
                (Outcome.REPORT_REJECTED, "forever", 2, "REPORT_LATE")
            ] * 2
            # nothing of it left behind: each checks in again and completes a round of the next deploy
            after = in_threads(2, lambda i: devices[i].run_session(), 30)
            assert [(r.outcome, r.task, r.round) for r in after if r] == [(Outcome.COMPLETED, "next", 1)] * 2
        finally:
            for c in (*devices, *stores):
                c.close()

        assert _tasks(admin) == {"forever": "stopped", "next": "active"}
        assert admin.status("p")["active_task"] == "next"
        rounds = admin.rounds("p", "forever")
        assert [(r["round"], r["status"]) for r in rounds] == [(1, "committed"), (2, "abandoned")]
        assert rounds[1]["metrics"]["error"] == "its task was stopped"
        assert rounds[1]["metrics"]["reported"] == 0 and rounds[1]["checkpoint_id"] is None
        # its final model: round 1's, still served
        weights, number = admin.model("p", task="forever")
        assert number == 1
        committed = admin.checkpoint(rounds[0]["checkpoint_id"])
        assert all(np.array_equal(weights[k], committed[k]) for k in committed)

    with ServerThread(db) as server, server.admin() as admin:  # started again on the same file
        assert _tasks(admin) == {"forever": "stopped", "next": "active"}
        assert [(r["round"], r["status"]) for r in admin.rounds("p", "forever")] == [(1, "committed"), (2, "abandoned")]
        assert admin.status("p")["active_task"] == "next"
        with pytest.raises(AdminError) as again:
            admin.stop_task("p", "forever")
        assert (again.value.status, again.value.code) == (409, "TASK_STOPPED")


def _report(http: httpx.Client, plan) -> str:
    """One device checks in to the open round and reports a made-up update; the task it was in."""
    session = http.post("/v1/populations/p/checkin", json={"runtime_version": "1.31.1"}).json()
    assert session["status"] == "accepted", session
    spec = PlanExecutor(plan).client_update_spec()
    update = {name: np.full(shape, 0.01, dtype=dtype) for name, (shape, dtype) in spec.items()}
    update["num_examples"] = np.array(4, dtype=update["num_examples"].dtype)
    r = http.post(
        f"/v1/sessions/{session['session_id']}/report",
        content=encode_checkpoint(update),
        headers={"Authorization": f"Bearer {session['token']}"},
    )
    assert r.status_code == 200, r.text
    return session["task"]


def test_a_stop_the_server_cannot_make_is_a_4xx_with_a_stable_code(server, admin):
    plan = digits_plan()
    checkpoint = encode_checkpoint(initial_weights(plan, seed=0))
    admin.create_population("p")
    one = dict(goal_count=1, over_selection=1.0, min_reports=1, selection_timeout_s=60, report_timeout_s=60)
    admin.deploy_task("p", "once", plan, checkpoint, RoundConfig(max_rounds=1, **one))
    admin.deploy_task("p", "forever", plan, checkpoint, RoundConfig(**one))
    admin.deploy_task("p", "queued", plan, checkpoint, RoundConfig(**one))
    with httpx.Client(base_url=server.url, timeout=10) as http:
        assert _report(http, plan) == "once"  # its one round: completed

        def refused(population: str, task: str, key: str | None = server.admin_key) -> tuple[int, str]:
            headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
            r = http.post(f"/v1/populations/{population}/tasks/{task}/stop", headers=headers)
            assert 400 <= r.status_code < 500 and "Traceback" not in r.text, r.text
            return r.status_code, r.json()["error"]["code"]

        assert refused("p", "forever", key=None) == (401, "ADMIN_KEY_REQUIRED")
        assert refused("p", "forever", key="not-a-key-of-this-server-0123456789") == (401, "BAD_ADMIN_KEY")
        assert refused("nope", "forever") == (404, "UNKNOWN_POPULATION")
        assert refused("p", "forevr") == (404, "UNKNOWN_TASK")
        assert refused("p", "once") == (409, "TASK_NOT_RUNNING")
        assert _tasks(admin) == {"once": "completed", "forever": "active", "queued": "queued"}

        # a queued task is stopped before it runs: the running one goes on, no round of it opened
        answer = admin.stop_task("p", "queued")
        assert (answer["stopped"], answer["abandoned_round"], answer["running"]) == (["queued"], None, ["forever"])
        # on record once answered (what a server killed now keeps): another connection to the file reads it
        store = ServerStore(server.db_path)
        try:
            assert {t.name: t.status for t in store.tasks("p")}["queued"] == "stopped"
        finally:
            store.close()
        assert refused("p", "queued") == (409, "TASK_STOPPED")
        assert admin.stop_task("p", "forever")["running"] == []
        assert refused("p", "forever") == (409, "TASK_STOPPED")
        assert _tasks(admin) == {"once": "completed", "forever": "stopped", "queued": "stopped"}
        assert admin.status("p")["active_task"] is None
        # devices of a population with nothing left to run are told so, as for one without a task
        assert http.post("/v1/populations/p/checkin", json={"runtime_version": "1.31.1"}).json()["status"] == "rejected"
        assert admin.rounds("p", "queued") == []
        with pytest.raises(AdminError) as taken:  # its name stays taken
            admin.deploy_task("p", "forever", plan, checkpoint, RoundConfig(max_rounds=3, **one))
        assert taken.value.code == "TASK_EXISTS"


def test_stopping_one_task_of_a_deploy_stops_its_evaluation_and_leaves_the_others_running(server, admin):
    plan = digits_plan()
    checkpoint = encode_checkpoint(initial_weights(plan, seed=0))
    admin.create_population("p")
    config = RoundConfig(**TWO_DEVICES)
    admin.deploy_tasks(
        "p",
        [
            task_body("train", plan, checkpoint, config),
            task_body("eval", build_eval_plan(plan), None, config, evaluates="train"),
            task_body("other", plan, checkpoint, config),
        ],
    )
    admin.deploy_task("p", "later", plan, checkpoint, config)
    answer = admin.stop_task("p", "train")  # its round is the open one
    assert (answer["stopped"], answer["abandoned_round"], answer["running"]) == (["train", "eval"], 1, ["other"])
    assert _tasks(admin) == {"train": "stopped", "eval": "stopped", "other": "active", "later": "queued"}
    assert admin.status("p")["active_task"] == "other"
    answer = admin.stop_task("p", "other")  # the last of its deploy: the next deploy starts
    assert answer["running"] == ["later"] and admin.status("p")["active_task"] == "later"


def test_an_idle_populations_status_names_the_strategy_of_its_last_deploy(server, admin, capsys, monkeypatch):
    """Shown while a round runs and dropped once none did: ``fedfleet status`` of a population whose
    weighted deploy was stopped said no strategy, as if its tasks had never shared rounds."""
    from emulator.cli import commands as cli

    plan = digits_plan()
    checkpoint = encode_checkpoint(initial_weights(plan, seed=0))
    admin.create_population("p")
    assert admin.status("p")["strategy"] is None  # no deploy yet
    config = RoundConfig(**TWO_DEVICES)
    admin.deploy_tasks(
        "p", [task_body("a", plan, checkpoint, config), task_body("b", plan, checkpoint, config)], "weighted"
    )
    assert admin.status("p")["strategy"] == "weighted"
    admin.stop_task("p", "a")
    assert admin.stop_task("p", "b")["running"] == []
    status = admin.status("p")
    assert (status["active_task"], status["strategy"]) == (None, "weighted")
    monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", server.admin_key)
    assert cli.main(["status", "--server", server.url, "--population", "p"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "population p (strategy weighted)"


def test_a_round_closed_just_before_the_stop_is_written_as_it_ended_and_its_task_stays_stopped(tmp_path, monkeypatch):
    """The last round of a task with ``max_rounds`` closes, and the stop comes before its commit is
    written: the round commits, and the commit does not mark the stopped task completed."""
    plan = digits_plan()
    service = FLService(ServerStore(tmp_path / "server.db"))
    service.create_population("p")
    one = dict(goal_count=1, over_selection=1.0, min_reports=1, selection_timeout_s=60, report_timeout_s=60)
    service.deploy_task(
        "p",
        "once",
        serialize_plan(plan),
        encode_checkpoint(initial_weights(plan, seed=0)),
        RoundConfig(max_rounds=1, **one),
    )
    session = service.checkin("p", "1.31.1")
    spec = PlanExecutor(plan).client_update_spec()
    update = {name: np.full(shape, 0.01, dtype=dtype) for name, (shape, dtype) in spec.items()}
    update["num_examples"] = np.array(4, dtype=update["num_examples"].dtype)
    with monkeypatch.context() as held:  # the report's thread leaves its round's commit to be written
        held.setattr(service._commits, "flush", lambda **_: None)
        assert service.report(session.session_id, session.token, encode_checkpoint(update)).round_status == "open"
    answer = service.stop_task("p", "once")
    assert (answer.abandoned_round, answer.committed_rounds, answer.running) == (None, 1, [])
    assert [(r["round"], r["status"]) for r in service.rounds("p")] == [(1, "committed")]
    assert {t["name"]: t["status"] for t in service.population_status("p")["tasks"]} == {"once": "stopped"}
    service.store.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_server_killed_right_after_answering_a_stop_has_the_task_stopped_once_restarted(tmp_path, authority):
    server = ServerProcess(tmp_path, authority)
    server.start()
    try:
        with AdminClient(server.url, admin_key=PROCESS_ADMIN_KEY) as admin:
            _deploy_two(admin)
            assert admin.stop_task("p", "forever")["running"] == ["next"]
            server.kill()
            server.start()
            assert _tasks(admin) == {"forever": "stopped", "next": "active"}
            assert admin.status("p")["active_task"] == "next"
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_secure_round_stopped_with_its_group_mid_protocol_ends_each_session(
    attested_server, attested_admin, attested_runtimes, population
):
    deploy_secure(attested_admin, population, goal_count=5, secagg_min_group_size=5, secagg_target_group_size=5)
    fleet = attested_runtimes(attested_server.url, population, 5)
    trained = [threading.Event() for _ in fleet.runtimes]
    stopped = threading.Event()

    def session(i: int):
        def hold() -> None:  # its keys and shares sent, its masked input not yet
            trained[i].set()
            assert stopped.wait(30)

        return fleet.runtimes[i].run_session(before_report=hold)

    ended: list = []
    sessions = threading.Thread(target=lambda: ended.extend(in_threads(5, session, 60)))
    sessions.start()
    assert all(t.wait(30) for t in trained)
    answer = attested_admin.stop_task(population, "train")
    stopped.set()
    sessions.join(60)
    assert (answer["stopped"], answer["abandoned_round"], answer["running"]) == (["train"], 1, [])
    # each is told its group's round is over (closed under it: left out), as when a round's deadline passes
    assert [(r.outcome, r.round, r.rejection_code) for r in ended] == [
        (Outcome.REPORT_REJECTED, 1, "SECAGG_EXCLUDED")
    ] * 5
    rounds = attested_admin.rounds(population)
    assert [(r["round"], r["status"], r["metrics"]["error"]) for r in rounds] == [
        (1, "abandoned", "its task was stopped")
    ]
