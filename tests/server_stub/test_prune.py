"""``fedfleet prune``: a stopped server's old rounds lose their models, nothing else: every round's
record stays (metrics and privacy figures), each task keeps its latest model and its initial one, a
model another record still names stays, and a server started on the pruned database goes on from
where it stopped. A running server's database is refused."""

from __future__ import annotations

import hashlib
import sqlite3
import time

import pytest

from device_runtime import decode_checkpoint, encode_checkpoint, initial_weights, serialize_plan
from emulator.cli import commands as cli
from server_stub import FLService, ServerStore
from server_stub.persistence import NewTask
from tests.support import digits_plan

DAY = 86_400.0


def _history(path) -> tuple[list[bytes], dict[str, int]]:
    """Task ``a`` (active): rounds 1-3 committed 10, 9 and 8 days ago, an abandoned attempt between;
    task ``b`` (completed): round 1 committed 10 days ago with ``a``'s initial model, round 2 today.
    Models ``m0``..``m4`` (``m0`` is ``a``'s initial one)."""
    plan = digits_plan()
    models = [encode_checkpoint(initial_weights(plan, seed=seed)) for seed in range(5)]
    store = ServerStore(path)
    try:
        store.create_population("p")
        a, b = store.add_tasks(
            "p",
            [
                NewTask("a", serialize_plan(plan), models[0], {"round": {"min_reports": 1}, "eligibility": {}}),
                NewTask("b", serialize_plan(plan), models[4], {"round": {"min_reports": 1}, "eligibility": {}}),
            ],
        )
        store.set_task_status(b.id, "completed")
        now = time.time()
        dp = {"dp_rounds": 1, "epsilon": 0.5}
        store.record_round(a.id, 1, 1, "committed", dp, now - 10 * DAY, now - 10 * DAY, models[1])
        store.record_round(a.id, 2, 1, "abandoned", {"selected": 3}, now - 9.5 * DAY, now - 9.5 * DAY)
        store.record_round(a.id, 2, 2, "committed", dp, now - 9 * DAY, now - 9 * DAY, models[2])
        store.record_round(a.id, 3, 1, "committed", dp, now - 8 * DAY, now - 8 * DAY, models[3])
        store.record_round(b.id, 1, 1, "committed", {}, now - 10 * DAY, now - 10 * DAY, models[0])
        store.record_round(b.id, 2, 1, "committed", {}, now - 60.0, now - 60.0, models[1])
    finally:
        store.close()
    with sqlite3.connect(path) as raw:  # each model stored when its round ended, as a running server does
        raw.execute(
            "UPDATE resources SET created_at = (SELECT min(ended_at) FROM rounds WHERE checkpoint_id = resources.id) WHERE kind = 'checkpoint' AND id IN (SELECT checkpoint_id FROM rounds)"
        )
    return models, {"a": a.id, "b": b.id}


def test_old_models_go_and_every_record_the_latest_models_and_what_others_name_stay(tmp_path, capsys):
    db = tmp_path / "fl.db"
    models, _ = _history(db)
    store = ServerStore(db)
    before = {t.name: [r.to_json() for r in store.rounds(t.id)] for t in store.tasks("p")}
    store.close()
    common = ["prune", "--db", str(db), "--older-than-days", "7"]
    assert cli.main([*common, "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("would drop the models of 3 round(s)")
    store = ServerStore(db)
    assert {t.name: [r.to_json() for r in store.rounds(t.id)] for t in store.tasks("p")} == before
    store.close()
    assert cli.main(common) == 0
    said = capsys.readouterr().out
    assert said.startswith("dropped the models of 3 round(s)") and "and 1 checkpoint(s)" in said, said
    store = ServerStore(db)
    try:
        after = {t.name: [r.to_json() for r in store.rounds(t.id)] for t in store.tasks("p")}
        # the old rounds but each task's latest lose their models (a's abandoned attempt had none)
        assert [r["checkpoint_id"] is None for r in after["a"]] == [True, True, True, False]
        assert [r["checkpoint_id"] is None for r in after["b"]] == [True, False]
        for name in after:  # the records are as they were but for the models' ids
            assert [{**r, "checkpoint_id": None} for r in after[name]] == [
                {**r, "checkpoint_id": None} for r in before[name]
            ]
        ids = {m: hashlib.sha256(m).hexdigest() for m in models}
        gone = [i for i, m in enumerate(models) if store.get_resource(ids[m]) is None]
        # m0 is a's initial model and m1 b's latest: they stay although old rounds no longer name them
        assert gone == [2]
        with sqlite3.connect(db) as raw:
            assert raw.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        store.close()
    store = ServerStore(db)
    try:  # a server started on it goes on with a's round 4 from round 3's model
        service = FLService(store)
        status = service.population_status("p")
        assert status["active_task"] == "a" and status["round"] == 4
        model, number, _ = service.current_model("p", "a")
        assert number == 3 and decode_checkpoint(model).keys() == decode_checkpoint(models[3]).keys()
        assert model == models[3]
    finally:
        store.close()


def test_a_database_a_server_holds_a_missing_file_and_a_bad_age_are_refused_in_one_line(tmp_path, capsys):
    db = tmp_path / "fl.db"
    _history(db)
    server = ServerStore(db)
    server.hold()
    try:
        assert cli.main(["prune", "--db", str(db), "--older-than-days", "7"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("fedfleet prune: the database") and "in use by another server" in err
        assert len(err.splitlines()) == 1
    finally:
        server.close()
    assert cli.main(["prune", "--db", str(tmp_path / "nothing.db"), "--older-than-days", "7"]) == 2
    assert (
        capsys.readouterr().err
        == f"fedfleet prune: {tmp_path / 'nothing.db'} does not exist (the --db the server ran with)\n"
    )
    assert not (tmp_path / "nothing.db").exists()
    for bad in ("-1", "nan", "inf", "x"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["prune", "--db", str(db), "--older-than-days", bad])
        assert exit_.value.code == 2 and "give a number of days from 0 to 100000" in capsys.readouterr().err


def test_plans_and_release_reports_no_task_names_go_once_old_and_a_tasks_stay(tmp_path, capsys):
    """A server killed during a deploy, before a deploy was stored in one transaction, kept a
    release's versioned plan and report with no task naming them."""
    db = tmp_path / "fl.db"
    ids = {name: hashlib.sha256(name).hexdigest() for name in (b"plan", b"v2", b"report", b"lost v2", b"lost report")}
    config = {"versions": {"v2": ids[b"v2"]}, "release": {"report_id": ids[b"report"], "claimed": ["r2"]}}
    store = ServerStore(db)
    try:
        store.create_population("p")
        resources = ((b"v2", "plan"), (b"report", "release_report"))
        store.add_tasks("p", [NewTask("a", b"plan", b"model", config, resources)])
        store.put_resource(b"lost v2", "plan")
        store.put_resource(b"lost report", "release_report")
    finally:
        store.close()
    with sqlite3.connect(db) as raw:  # all stored two days ago
        raw.execute("UPDATE resources SET created_at = created_at - 2 * 86400")
    store = ServerStore(db)
    try:  # a deploy in progress: a lost plan stored within the grace period stays
        store.put_resource(b"lost v2", "plan")
        assert store.drop_unnamed_checkpoints(time.time() - 60.0) == (1, len(b"lost report"))
        assert store.get_resource(ids[b"lost report"]) is None and store.get_resource(ids[b"lost v2"]) == b"lost v2"
    finally:
        store.close()
    with sqlite3.connect(db) as raw:
        raw.execute("UPDATE resources SET created_at = created_at - 2 * 86400 WHERE id = ?", (ids[b"lost v2"],))
    assert cli.main(["prune", "--db", str(db), "--older-than-days", "1"]) == 0
    assert "and 1 checkpoint(s), plan(s) and release report(s) nothing names" in capsys.readouterr().out
    store = ServerStore(db)
    try:
        gone = [name for name, rid in ids.items() if store.get_resource(rid) is None]
        assert gone == [b"lost v2", b"lost report"]
        assert store.get_resource(hashlib.sha256(b"model").hexdigest()) == b"model"
    finally:
        store.close()
