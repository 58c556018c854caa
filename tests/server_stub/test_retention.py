"""Retention (``fedfleet server --keep-rounds N --keep-days D``): a serving server removes the round
records past either limit and the models nothing names any more, but never what a task goes on
from (its last committed round, its newest record, a DP task's rounds that spent privacy); what it
removed still counts (``max_rounds``, the turns of tasks that take turns) after a restart; and a
server killed while it removes a batch has all of the batch removed or none of it."""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time

import pytest
from sqlalchemy import event

from device_runtime import encode_checkpoint, initial_weights, serialize_plan
from server_stub import AdminClient, FLService, RoundConfig, ServerStore
from server_stub.persistence import NewTask
from server_stub.retention import RETENTION_EVERY_S, Retention, RetentionError
from server_stub.service import TaskSpec
from tests.dying_server import killed_at_statement
from tests.server_stub.test_operators import KEY, _key_file, _Server
from tests.server_stub.test_round_history import ONE_DEVICE, _checked_in, _one_round, _update
from tests.server_stub.test_server_database import _refused
from tests.support import digits_plan, server_command_exit

DAY = 86_400.0
PRIVATE = {"round": {"dp": {"mode": "central"}}, "eligibility": {}}


def _spent(status: str, metrics: dict) -> bool:
    return status == "committed" or bool(metrics.get("released"))


def _history(path) -> tuple[dict[str, int], list[bytes]]:
    """Task ``a``: rounds 1-4 committed (round 2 after an abandoned attempt), then round 5's
    attempts 1 and 2 abandoned; ``b`` (with DP): rounds 1 and 2 committed, an abandoned attempt
    that released a noisy sum and one that did not. Round n of ``a`` ended n days ago counted back
    from 10; every round's model is its own (``models[n]``)."""
    plan = digits_plan()
    models = [encode_checkpoint(initial_weights(plan, seed=seed)) for seed in range(8)]
    store = ServerStore(path)
    try:
        store.create_population("p")
        a, b = store.add_tasks(
            "p",
            [
                NewTask("a", serialize_plan(plan), models[0], {"round": {}, "eligibility": {}}),
                NewTask("b", serialize_plan(plan), models[0], PRIVATE),
            ],
        )
        t = 100 * DAY
        for number, attempt, status, model in [
            (1, 1, "committed", 1),
            (2, 1, "abandoned", None),
            (2, 2, "committed", 2),
            (3, 1, "committed", 3),
            (4, 1, "committed", 4),
            (5, 1, "abandoned", None),
            (5, 2, "abandoned", None),
        ]:
            ended = t - (10 - number - attempt / 10) * DAY
            ckpt = models[model] if model is not None else None
            store.record_round(a.id, number, attempt, status, {"selected": 1}, ended - 60, ended, ckpt)
        for number, attempt, status, released in [
            (1, 1, "committed", 0),
            (2, 1, "abandoned", 1),
            (2, 2, "abandoned", 0),
            (2, 3, "committed", 0),
        ]:
            ckpt = models[4 + number] if status == "committed" else None
            metrics = {"released": released}
            store.record_round(b.id, number, attempt, status, metrics, t - 9 * DAY, t - 9 * DAY, ckpt)
    finally:
        store.close()
    return {"a": a.id, "b": b.id}, models


def _kept(store: ServerStore, task_id: int) -> list[tuple[int, int]]:
    return [(r.number, r.attempt) for r in store.rounds(task_id)]


@pytest.mark.parametrize(
    ("keep_rounds", "keep_days", "kept_a"),
    [
        (1, None, [(4, 1), (5, 2)]),  # the last committed round and the newest record stay
        (4, None, [(3, 1), (4, 1), (5, 1), (5, 2)]),
        (None, 6.95, [(3, 1), (4, 1), (5, 1), (5, 2)]),  # round 3 ended 6.9 days before "now"
        (3, 6.95, [(4, 1), (5, 1), (5, 2)]),  # a record goes when either limit says so
    ],
)
def test_the_records_past_either_limit_go_with_their_models_and_what_a_task_goes_on_from_stays(
    tmp_path, keep_rounds, keep_days, kept_a
):
    db = tmp_path / "fl.db"
    ids, models = _history(db)
    store = ServerStore(db)
    try:
        before = {name: store.rounds(tid) for name, tid in ids.items()}
        retention = Retention(keep_rounds, keep_days)
        now = 100 * DAY
        done = store.prune_rounds(
            keep_rounds=retention.keep_rounds,
            ended_before=retention.ended_before(now),
            limit=2,  # a batch at a time, as the service removes them
            resources_before=1e12,  # every model stored before now
            private=_spent,
        )
        while done.rounds:
            assert done.rounds <= 2
            done = store.prune_rounds(
                keep_rounds=keep_rounds,
                ended_before=retention.ended_before(now),
                limit=2,
                resources_before=1e12,
                private=_spent,
            )
        assert _kept(store, ids["a"]) == kept_a
        # the DP task keeps every record that spent privacy (its ledger); the abandoned attempt
        # that released nothing goes only past the limits
        private = _kept(store, ids["b"])
        assert {(1, 1), (2, 1), (2, 3)} <= set(private) and len(private) in (3, 4)
        # what is kept is as it was; the counts of what went are kept
        for name, tid in ids.items():
            assert [r for r in before[name] if (r.number, r.attempt) in _kept(store, tid)] == store.rounds(tid)
            removed = [r for r in before[name] if (r.number, r.attempt) not in _kept(store, tid)]
            assert store.pruned_counts(tid) == (len(removed), sum(r.status == "committed" for r in removed))
        # the models of removed rounds are gone; those kept rounds and tasks name stay
        named = {r.checkpoint_id for tid in ids.values() for r in store.rounds(tid)} | {resource(models[0])}
        for model in models[1:]:
            assert (store.get_resource(resource(model)) is not None) == (resource(model) in named)
    finally:
        store.close()


def resource(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_retention_limits_out_of_range_are_refused():
    for bad in (dict(keep_rounds=0), dict(keep_rounds=True), dict(keep_days=0.0), dict(keep_days=float("nan"))):
        with pytest.raises(RetentionError):
            Retention(**bad)


def _served(path, **config) -> tuple[FLService, object]:
    from device_runtime.clock import VirtualClock

    clock = VirtualClock(time.time())  # the wall clock resources are stored at
    service = FLService(
        ServerStore(path), clock=clock.now, wall_clock=clock.now, retention=Retention(**config.pop("retention", {}))
    )
    return service, clock


def test_a_serving_server_applies_retention_and_a_restart_counts_what_it_removed(tmp_path, caplog):
    """Six rounds commit and a selection times out; the ticker removes all but the newest two
    records, and the models of removed rounds that no session may still download; the model served
    is the last committed one; after a restart on the file the task still stops at its
    ``max_rounds``, counting the committed rounds removed."""
    db = tmp_path / "fl.db"
    plan = digits_plan()
    service, clock = _served(db, retention={"keep_rounds": 2})
    update = _update(plan)
    try:
        service.create_population("p")
        config = RoundConfig(**ONE_DEVICE, max_rounds=7)
        checkpoint = encode_checkpoint(initial_weights(plan))
        service.deploy_tasks("p", [TaskSpec("t", serialize_plan(plan), checkpoint, config)])
        for _ in range(6):
            _one_round(service, clock, update)
        [task] = service.store.tasks("p")
        models = [r.checkpoint_id for r in service.store.rounds(task.id)]
        clock.advance(2 * RETENTION_EVERY_S)  # past the pass's wait and the models' grace; round 7 times out
        with caplog.at_level(logging.INFO, logger="server_stub.service"):
            service.tick()
        kept = service.store.rounds(task.id)
        assert [(r.number, r.status) for r in kept] == [(6, "committed"), (7, "abandoned")]
        assert service.store.pruned_counts(task.id) == (5, 5)
        assert "retention: removed 5 round record(s) (5 committed) and 2 checkpoint(s)" in caplog.text
        # rounds 1 and 2's models are gone; the sessions of the last closed rounds may still fetch theirs
        assert [service.store.get_resource(rid) is not None for rid in models] == [False, False] + [True] * 4
        model, number, _ = service.current_model("p")
        assert number == 6 and model == service.store.resource(kept[0].checkpoint_id)
    finally:
        service.store.close()
    service, clock = _served(db)
    try:
        status = service.population_status("p")
        assert [(t["round"], t["committed_rounds"]) for t in status["active_tasks"]] == [(7, 6)]
        _one_round(service, clock, update)  # round 7 is its last: max_rounds counts the removed ones
        assert service.task_states("p")["t"]["status"] == "completed"
    finally:
        service.store.close()


def test_a_commit_queued_while_a_pass_holds_the_write_turn_is_written_as_the_pass_ends(tmp_path):
    """The report that completes a round while a retention batch holds the commits' write turn
    waits for its commit; the commit is written as the batch ends, not at some later tick (this
    service has no ticker: the report would wait for ever)."""
    plan = digits_plan()
    service, clock = _served(tmp_path / "fl.db", retention={"keep_rounds": 1})
    try:
        service.create_population("p")
        checkpoint = encode_checkpoint(initial_weights(plan))
        service.deploy_tasks("p", [TaskSpec("t", serialize_plan(plan), checkpoint, RoundConfig(**ONE_DEVICE))])
        answer = _checked_in(service, clock)
        answered = []
        device = threading.Thread(
            target=lambda: answered.append(service.report(answer.session_id, answer.token, _update(plan))),
            daemon=True,
        )
        with service._commits.writing():
            device.start()
            device.join(0.5)
            assert not answered  # its round's commit waits for the write turn
        device.join(60)
        assert [a.round_status for a in answered] == ["committed"]
    finally:
        service.store.close()


def test_the_server_command_says_its_retention_and_refuses_limits_out_of_range(tmp_path, capsys):
    keys = _key_file(tmp_path)
    for bad, words in ((["--keep-rounds", "0"], "--keep-rounds"), (["--keep-days", "-1"], "--keep-days")):
        code = server_command_exit(
            ["--db", str(tmp_path / "fl.db"), "--port", "0", "--admin-key-file", str(keys), *bad]
        )
        _refused(code, capsys.readouterr().err, words)


# killed (SIGKILL, a process of its own: -m slow), or failed in this process (the write refused)
@pytest.mark.parametrize("how", [pytest.param("killed", marks=pytest.mark.slow), "failed"])
def test_a_pass_killed_or_failed_while_it_removes_a_batch_has_all_of_it_removed_or_none(tmp_path, how):
    """Stopped once the batch's first records are deleted, before its transaction commits: the
    records and the counts of removed ones agree after it (none removed), and a pass then removes
    them once."""
    db = tmp_path / "fl.db"
    ids, _ = _history(db)
    prune = dict(keep_rounds=1, ended_before=None, limit=100, resources_before=1e12)
    if how == "killed":
        done = killed_at_statement(db, "INSERT INTO pruned_rounds", f"store.prune_rounds(**{prune!r})")
        assert done.returncode == -9, done.stderr
    else:
        store = ServerStore(db)

        def refuse(conn, cursor, statement, *args) -> None:
            if statement.startswith("INSERT INTO pruned_rounds"):
                raise OSError(28, "No space left on device")

        event.listen(store.engine, "after_cursor_execute", refuse)
        try:
            with pytest.raises(OSError):
                store.prune_rounds(**prune)  # type: ignore[arg-type]
        finally:
            store.close()
    store = ServerStore(db)
    try:
        assert len(_kept(store, ids["a"])) == 7 and store.pruned_counts(ids["a"]) == (0, 0)
        store.prune_rounds(**prune)  # type: ignore[arg-type]
        assert _kept(store, ids["a"]) == [(4, 1), (5, 2)] and store.pruned_counts(ids["a"]) == (5, 3)
    finally:
        store.close()


@pytest.mark.slow  # a server process of its own; the same pass in this process: the tests above
@pytest.mark.timeout(90)
def test_the_server_command_removes_old_rounds_as_it_starts_and_serves_the_last_committed_model(tmp_path):
    db = tmp_path / "fl.db"
    ids, models = _history(db)
    store = ServerStore(db)
    store.set_task_status(ids["b"], "completed")  # its DP config is a stand-in: only a goes on
    store.close()
    server = _Server("--db", str(db), "--port", "0", "--admin-key-file", str(_key_file(tmp_path)), "--keep-rounds", "1")
    try:
        banner = server.banner()
        assert "keeps:       the newest 1 round record(s) of each task, checked every 60 s" in banner, banner
        found = re.search(r"listening on (http://\S+)", banner)
        assert found is not None
        server.wait_healthy(found[1])
        with AdminClient(found[1], admin_key=KEY) as admin:
            deadline = time.monotonic() + 30
            while len(admin.rounds("p", task="a")) > 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            kept = admin.rounds("p", task="a")
            assert [(r["round"], r["attempt"]) for r in kept] == [(4, 1), (5, 2)]
            assert admin.model("p", task="a")[1] == 4
            assert kept[0]["checkpoint_id"] == resource(models[4])
            assert admin.status("p")["active_tasks"][0]["committed_rounds"] == 4
    finally:
        server.stop()
