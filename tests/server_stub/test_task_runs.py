"""Loading the tasks on record when a server starts: a task an older release stored with
differential-privacy settings this server refuses is left as it is on record and not run, said in
one line at start and in the population's status, while the server serves its other tasks."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from pathlib import Path

import httpx
import onnxruntime as ort
import pytest

from device_runtime import build_eval_plan, encode_checkpoint, initial_weights, serialize_plan
from emulator.cli import commands as cli
from emulator.toolchain import SGD, Adam, initial_weights_from_onnx
from server_stub import DPConfig, RoundConfig, ServerStore, ServerThread
from server_stub.admin_client import task_body
from server_stub.cli import _refused_lines
from server_stub.persistence import resource_id
from tests.device_runtime.test_executor_smoke import broken_zero_plan
from tests.server_stub.test_against_reference_dp import SOURCE, _plan
from tests.support import digits_plan

KEY = "operator-key-" + "r" * 32
CONFIG = RoundConfig(goal_count=2, min_reports=1, selection_timeout_s=600)
DP = DPConfig(mode="central", noise_multiplier=1.0, clip=1.0)
#: What older releases accepted and this one refuses, by population: (field of dp, stored value).
OLDER = {
    "tiny-delta": ("delta", 1e-40),
    "tiny-q": ("sampling_probability", 1e-7),
    "low-noise": ("noise_multiplier", 0.005),
}


def _as_an_older_server_stored_it(db: Path, population: str, field: str, value: float) -> None:
    """The population's task ``private`` rewritten with ``dp.<field>`` at ``value``, as a release
    before today's checks wrote it: the server's own tables, through SQLite alone."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT tasks.id, tasks.config FROM tasks JOIN populations ON populations.id = tasks.population_id "
            "WHERE populations.name = ? AND tasks.name = 'private'",
            (population,),
        ).fetchall()
        assert len(rows) == 1
        for task_id, text in rows:
            config = json.loads(text)
            config["round"]["dp"][field] = value
            conn.execute("UPDATE tasks SET config = ? WHERE id = ?", (json.dumps(config), task_id))
    conn.close()


def _dump(db: Path) -> list[str]:
    conn = sqlite3.connect(db)
    try:
        return [line for line in conn.iterdump() if not line.startswith('INSERT INTO "resources"')]
    finally:
        conn.close()


def test_a_task_stored_with_dp_settings_refused_today_is_not_run_and_the_server_serves_the_others(
    tmp_path, capsys, monkeypatch
):
    db = tmp_path / "fl.db"
    plan = digits_plan()
    checkpoint = encode_checkpoint(initial_weights(plan, seed=0))
    private = RoundConfig(goal_count=2, min_reports=1, selection_timeout_s=600, dp=DP)
    with ServerThread(db, admin_key=KEY) as server, server.admin() as admin:
        admin.create_population("fine")
        admin.deploy_task("fine", "train", plan, checkpoint, CONFIG)
        for population in OLDER:
            admin.create_population(population)
            admin.deploy_task(population, "private", plan, checkpoint, private)
        # a deploy of two tasks whose training task is refused: its evaluation has nothing to evaluate
        admin.create_population("group")
        admin.deploy_tasks(
            "group",
            [
                task_body("private", plan, checkpoint, private),
                task_body("eval", build_eval_plan(plan), None, CONFIG, evaluates="private"),
            ],
        )
        admin.deploy_task("group", "later", plan, checkpoint, CONFIG)  # queued behind them
    for population, (field, value) in OLDER.items():
        _as_an_older_server_stored_it(db, population, field, value)
    _as_an_older_server_stored_it(db, "group", "delta", 1e-40)
    before = _dump(db)

    with ServerThread(db, admin_key=KEY) as server, server.admin() as admin:
        lines = _refused_lines(server.service)
        assert len(lines) == len(OLDER) + 2, lines
        for population, (field, value) in OLDER.items():
            (said,) = [line for line in lines if line.startswith(f"{population}/private: ")]
            assert f"dp.{field} {value:g}" in said and "deploy it again under a new task name" in said, said
            state = {t["name"]: t for t in admin.status(population)["tasks"]}["private"]
            assert state["status"] == "refused" and state["reason"] == said.split(": ", 1)[1]
            assert admin.status(population)["active_task"] is None and admin.rounds(population) == []
        group = {t["name"]: t for t in admin.status("group")["tasks"]}
        assert (group["private"]["status"], group["eval"]["status"]) == ("refused", "refused")
        assert "evaluates task 'private', which is refused" in group["eval"]["reason"]
        assert group["later"]["status"] == "active"  # the next deploy runs instead of waiting for ever
        assert admin.status("group")["active_task"] == "later"
        assert admin.status("fine")["phase"] == "selecting"
        with httpx.Client(base_url=server.url, timeout=10) as http:
            for population in [*OLDER, "fine"]:
                answer = http.post(f"/v1/populations/{population}/checkin", json={"runtime_version": "1.31.1"})
                assert answer.status_code == 200, answer.text
                if population == "fine":
                    assert answer.json()["status"] == "accepted"
                else:
                    assert (answer.json()["status"], answer.json()["reason"]) == ("rejected", "NO_TASK")
        monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", KEY)
        assert cli.main(["status", "--server", server.url, "--population", "tiny-delta"]) == 0
    printed = capsys.readouterr().out
    assert "  private: refused: its stored config no longer passes: dp.delta 1e-40 is below 1e-30" in printed
    after = _dump(db)
    assert [line for line in after if "tasks" in line] == [line for line in before if "tasks" in line]
    assert set(before) <= set(after)  # nothing on record lost or rewritten (the fine task's check-in added none)

    # retired (with the server stopped), a refused task is no longer said at each start
    def retire(population: str, task: str) -> tuple[int, str]:
        code = cli.main(["server", "retire", "--db", str(db), "--population", population, "--task", task])
        said = capsys.readouterr()
        assert len((said.out + said.err).strip().splitlines()) == 1, said
        return code, said.out + said.err

    running = ServerStore(db, hold=True)  # as fedfleet server holds it
    try:
        code, said = retire("tiny-delta", "private")
        assert code == 2 and "in use by another server" in said
    finally:
        running.close()
    code, said = retire("fine", "train")
    assert code == 2 and "is not refused or stopped (active or queued" in said
    code, said = retire("tiny-deltaa", "private")
    assert code == 2 and "there is no population 'tiny-deltaa' (populations: fine, " in said
    code, said = retire("tiny-delta", "private")
    assert code == 0 and said.startswith("retired task tiny-delta/private: no server runs it; its 0 round record(s)")
    with ServerThread(db, admin_key=KEY) as server, server.admin() as admin:
        assert not any(line.startswith("tiny-delta/") for line in _refused_lines(server.service))
        assert [t["status"] for t in admin.status("tiny-delta")["tasks"]] == ["retired"]


@pytest.mark.parametrize("field", ["eligibility", "round"])
def test_a_stored_config_refused_today_names_where_its_field_is(field):
    from server_stub.persistence import TaskRecord
    from server_stub.task_runs import StoredTaskRefused, stored_config

    config = {"round": RoundConfig().to_dict(), "eligibility": {"min_examples": 0}}
    if field == "eligibility":
        config["eligibility"]["min_examples"] = -1
    else:
        config["round"]["goal_count"] = 0
    with pytest.raises(StoredTaskRefused) as refused:
        stored_config(TaskRecord(1, "p", "t", "0" * 64, "0" * 64, config, "active"))
    said = str(refused.value)
    assert ("stored eligibility" if field == "eligibility" else "stored config") in said
    assert ("min_examples -1" if field == "eligibility" else "goal_count 0") in said


def _with_stored_plan(db: Path, population: str, task: str, plan: bytes) -> None:
    """The population's task ``task`` pointed at ``plan``, as an older release stored it: the
    server's own tables, through SQLite alone."""
    with sqlite3.connect(db) as conn:
        conn.execute(
            "INSERT OR IGNORE INTO resources (id, kind, data, created_at) VALUES (?, 'plan', ?, 0)",
            (resource_id(plan), plan),
        )
        changed = conn.execute(
            "UPDATE tasks SET plan_id = ? WHERE name = ? AND population_id = "
            "(SELECT id FROM populations WHERE name = ?)",
            (resource_id(plan), task, population),
        ).rowcount
        assert changed == 1
    conn.close()


def test_a_task_whose_stored_plan_this_onnxruntime_refuses_is_refused_and_the_server_serves_the_others(
    tmp_path, capsys
):
    """One plan stored at an opset above what the installed onnxruntime runs (load_plan refuses
    it), one whose ``zero`` graph onnxruntime cannot run: the server starts, runs the
    fine population, lists both (and the evaluation of the second) as refused with onnxruntime's
    reason, and ``fedfleet server retire`` retires them."""
    db = tmp_path / "fl.db"
    plan = digits_plan()
    checkpoint = encode_checkpoint(initial_weights(plan, seed=0))
    with ServerThread(db, admin_key=KEY) as server, server.admin() as admin:
        for population in ("fine", "opset", "graph"):
            admin.create_population(population)
        admin.deploy_task("fine", "train", plan, checkpoint, CONFIG)
        admin.deploy_task("opset", "train", plan, checkpoint, CONFIG)
        admin.deploy_tasks(
            "graph",
            [
                task_body("train", plan, checkpoint, CONFIG),
                task_body("eval", build_eval_plan(plan), None, CONFIG, evaluates="train"),
            ],
        )
    too_new = dataclasses.replace(plan, metadata=dataclasses.replace(plan.metadata, opset=99))
    _with_stored_plan(db, "opset", "train", serialize_plan(too_new))
    _with_stored_plan(db, "graph", "train", serialize_plan(broken_zero_plan(plan)))

    with ServerThread(db, admin_key=KEY) as server, server.admin() as admin:
        lines = sorted(_refused_lines(server.service))
        assert len(lines) == 3, lines
        assert lines[0].startswith("graph/eval: it evaluates task 'train', which is refused")
        assert lines[1].startswith(f"graph/train: its stored plan does not run on onnxruntime {ort.__version__}: ")
        assert "'zero'" in lines[1] and "a plan this onnxruntime runs" in lines[1]
        assert lines[2].startswith("opset/train: its stored plan does not run on onnxruntime ")
        assert "plan opset 99 is above" in lines[2] and "fedfleet server retire" in lines[2]
        for population in ("opset", "graph"):
            assert {t["status"] for t in admin.status(population)["tasks"]} == {"refused"}
            assert admin.status(population)["active_task"] is None
        assert admin.status("fine")["phase"] == "selecting"
        with httpx.Client(base_url=server.url, timeout=10) as http:
            answer = http.post("/v1/populations/opset/checkin", json={"runtime_version": ort.__version__})
            assert (answer.json()["status"], answer.json()["reason"]) == ("rejected", "NO_TASK")

    for population, task in (("opset", "train"), ("graph", "eval"), ("graph", "train")):
        assert cli.main(["server", "retire", "--db", str(db), "--population", population, "--task", task]) == 0
    assert capsys.readouterr().out.count("retired task ") == 3
    with ServerThread(db, admin_key=KEY) as server:
        assert _refused_lines(server.service) == []


def test_a_dp_task_an_older_release_stored_with_an_adam_plan_is_refused_when_loaded(tmp_path):
    """A deploy refuses DP over a plan whose update carries its client optimizer's state; a task an
    older release stored so went on running after the upgrade, each round's noised moments making
    the next step NaN."""
    db = tmp_path / "fl.db"
    sgd, adam = _plan(SGD(0.1)), _plan(Adam(0.01))
    private = dataclasses.replace(CONFIG, dp=DP)
    with ServerThread(db, admin_key=KEY) as server, server.admin() as admin:
        admin.create_population("digits")
        admin.deploy_task("digits", "private", sgd, encode_checkpoint(initial_weights_from_onnx(SOURCE, sgd)), private)
    _with_stored_plan(db, "digits", "private", serialize_plan(adam))
    with ServerThread(db, admin_key=KEY) as server, server.admin() as admin:
        lines = _refused_lines(server.service)
        assert len(lines) == 1 and lines[0].startswith("digits/private: its stored plan and dp no longer pass: "), lines
        assert "adam_step" in lines[0] and "fedfleet server retire" in lines[0]
        assert admin.status("digits")["active_task"] is None


def test_a_stopped_task_is_retired_and_a_running_or_retired_one_is_not(tmp_path, capsys):
    db = tmp_path / "fl.db"
    plan = digits_plan()
    checkpoint = encode_checkpoint(initial_weights(plan, seed=0))
    with ServerThread(db, admin_key=KEY) as server, server.admin() as admin:
        admin.create_population("p")
        admin.deploy_task("p", "old", plan, checkpoint, CONFIG)
        admin.deploy_task("p", "new", plan, checkpoint, CONFIG)  # queued behind it
        admin.stop_task("p", "old")

    def retire(task: str) -> tuple[int, str]:
        code = cli.main(["server", "retire", "--db", str(db), "--population", "p", "--task", task])
        said = capsys.readouterr()
        assert len((said.out + said.err).strip().splitlines()) == 1, said
        return code, said.out + said.err

    code, said = retire("old")
    assert code == 0 and said.startswith("retired task p/old: no server runs it; its 1 round record(s)"), said
    code, said = retire("old")
    assert code == 2 and "task p/old is retired; only a refused or a stopped task is retired" in said
    code, said = retire("new")
    assert code == 2 and "is not refused or stopped (active or queued" in said and "fedfleet stop" in said
    with ServerThread(db, admin_key=KEY) as server, server.admin() as admin:
        states = {t["name"]: t["status"] for t in admin.status("p")["tasks"]}
        assert states == {"old": "retired", "new": "active"}
