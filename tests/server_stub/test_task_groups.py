"""Several tasks per population (paper section 7.1): tasks deployed together share the
population's rounds, a strategy picks the task of each round, and each task keeps its own rounds,
checkpoints and metrics. Driven through FLService on a fake clock."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from device_runtime import (
    PlanExecutor,
    build_eval_plan,
    decode_checkpoint,
    encode_checkpoint,
    initial_weights,
    serialize_plan,
)
from device_runtime.plan import installed_runtime_version
from device_runtime.wire import CheckinAccepted
from server_stub import ApiError, FLService, RoundConfig, ServerStore, Strategy, TaskSpec
from tests.support import digits_plan

POP = "p"
CONFIG = RoundConfig(goal_count=5, over_selection=1.0, min_fraction=1.0)


class Harness:
    def __init__(self, path, seed: int = 0) -> None:
        self.path, self.now, self.seed = path, 0.0, seed
        self.service = self.open()

    def open(self) -> FLService:
        service = FLService(ServerStore(self.path), clock=lambda: self.now, rng=random.Random(self.seed))
        service.create_population(POP)
        return service

    def round(self, make_update) -> str:
        """One round: five devices check in and report; returns the task that ran it."""
        self.now += 1.0
        sessions = [self.service.checkin(POP, installed_runtime_version()) for _ in range(5)]
        assert all(isinstance(s, CheckinAccepted) for s in sessions), sessions
        assert len({s.task for s in sessions}) == 1
        for i, s in enumerate(sessions):
            self.service.report(s.session_id, s.token, encode_checkpoint(make_update(s.task, i)))
        return sessions[0].task


def _update(plan, delta: float, i: int) -> dict:
    spec = PlanExecutor(plan).client_update_spec()
    update = {
        name: np.full(shape, delta * 10, dtype=dtype) if name in plan.weight_names else np.zeros(shape, dtype)
        for name, (shape, dtype) in spec.items()
    }
    update["num_examples"] = np.array(10, dtype=np.float32)
    update["count"] = np.array(10, dtype=np.float32)
    update["loss_sum"] = np.array(5 + i, dtype=np.float32)
    update["correct"] = np.array(7, dtype=np.float32)
    return update


def test_alternating_training_and_evaluation_evaluates_the_model_just_committed(tmp_path):
    train = digits_plan()
    evaluation = build_eval_plan(train)
    h = Harness(tmp_path / "s.db")
    weights = initial_weights(train, seed=0)
    h.service.deploy_tasks(
        POP,
        [
            TaskSpec("train", serialize_plan(train), encode_checkpoint(weights), CONFIG),
            TaskSpec("eval", serialize_plan(evaluation), None, CONFIG, evaluates="train"),
        ],
        Strategy.ALTERNATE,
    )
    plans = {"train": train, "eval": evaluation}
    order = [h.round(lambda task, i: _update(plans[task], 0.01, i)) for _ in range(4)]
    assert order == ["train", "eval", "train", "eval"]

    train_rounds = h.service.rounds(POP, "train")
    eval_rounds = h.service.rounds(POP, "eval")
    assert [r["round"] for r in train_rounds] == [1, 2] and [r["round"] for r in eval_rounds] == [1, 2]
    assert all(r["status"] == "committed" for r in train_rounds + eval_rounds)
    # Each evaluation measured the model its training round had just committed, and changed nothing.
    for trained, evaluated in zip(train_rounds, eval_rounds):
        model = decode_checkpoint(h.service.resource(evaluated["metrics"]["evaluated_checkpoint_id"], admin=True))
        committed = decode_checkpoint(h.service.resource(trained["checkpoint_id"], admin=True))
        for name in train.weight_names:
            np.testing.assert_array_equal(model[name], committed[name])
        assert evaluated["checkpoint_id"] is None
        assert evaluated["metrics"]["eval_loss"] == pytest.approx(np.mean([5, 6, 7, 8, 9]) / 10)
        assert evaluated["metrics"]["device_metrics"]["loss"]["count"] == 5
    model, number, task = h.service.current_model(POP)
    assert (number, task) == (2, "train")
    expected = {w: weights[w] + 2 * np.float32(0.01) for w in train.weight_names}
    for name, value in decode_checkpoint(model).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-6)
    # Asked for by the evaluation task's name: the model it measures, named as its training task's
    # (it was the initial model, labelled with the evaluation's own round 2).
    assert h.service.current_model(POP, "eval") == (model, 2, "train")


def test_weighted_tasks_run_in_proportion_and_keep_their_own_models(tmp_path):
    plan_a, plan_b = digits_plan(), digits_plan(learning_rate=0.05)
    h = Harness(tmp_path / "s.db", seed=7)
    h.service.deploy_tasks(
        POP,
        [
            TaskSpec(
                "a", serialize_plan(plan_a), encode_checkpoint(initial_weights(plan_a, seed=1)), CONFIG, weight=3.0
            ),
            TaskSpec(
                "b", serialize_plan(plan_b), encode_checkpoint(initial_weights(plan_b, seed=2)), CONFIG, weight=1.0
            ),
        ],
        Strategy.WEIGHTED,
    )
    deltas = {"a": 0.01, "b": -0.02}
    ran = Counter(h.round(lambda task, i: _update(plan_a, deltas[task], i)) for _ in range(60))
    assert 30 <= ran["a"] <= 55 and ran["a"] + ran["b"] == 60  # 45 expected; binomial sd 3.4
    for task, seed in (("a", 1), ("b", 2)):
        rounds = h.service.rounds(POP, task)
        assert [r["round"] for r in rounds] == list(range(1, ran[task] + 1))
        model, number, _ = h.service.current_model(POP, task)
        assert number == ran[task]
        start = initial_weights(plan_a, seed=seed)
        for name, value in decode_checkpoint(model).items():
            np.testing.assert_allclose(value, start[name] + ran[task] * np.float32(deltas[task]), rtol=1e-4, atol=1e-5)


def test_a_group_continues_after_a_restart_with_each_tasks_rounds(tmp_path):
    plan = digits_plan()
    h = Harness(tmp_path / "s.db")
    h.service.deploy_tasks(
        POP,
        [
            TaskSpec("t1", serialize_plan(plan), encode_checkpoint(initial_weights(plan)), CONFIG),
            TaskSpec("t2", serialize_plan(plan), encode_checkpoint(initial_weights(plan)), CONFIG),
        ],
    )
    for _ in range(3):
        h.round(lambda task, i: _update(plan, 0.01, i))
    h.service.store.close()
    h.service = h.open()
    status = h.service.population_status(POP)
    assert {t["name"]: t["round"] for t in status["active_tasks"]} == {"t1": 3, "t2": 2}
    h.round(lambda task, i: _update(plan, 0.01, i))
    assert [r["round"] for r in h.service.rounds(POP, "t1")] == [1, 2]
    assert len(h.service.rounds(POP, "t2")) in (1, 2)


def test_a_group_with_one_bad_task_stores_nothing(tmp_path):
    plan = digits_plan()
    h = Harness(tmp_path / "s.db")
    good = TaskSpec("good", serialize_plan(plan), encode_checkpoint(initial_weights(plan)), CONFIG)
    with pytest.raises(ApiError) as err:
        h.service.deploy_tasks(
            POP, [good, TaskSpec("bad", b"not a plan", encode_checkpoint(initial_weights(plan)), CONFIG)]
        )
    assert err.value.code == "INVALID_PLAN" and "'bad'" in err.value.message
    with pytest.raises(ApiError) as err:
        h.service.deploy_tasks(
            POP, [good, TaskSpec("ev", serialize_plan(build_eval_plan(plan)), None, CONFIG, evaluates="nope")]
        )
    assert err.value.code == "BAD_CONFIG"
    assert h.service.store.tasks(POP) == []
    h.service.deploy_tasks(POP, [good])
    assert h.service.population_status(POP)["active_task"] == "good"


def test_when_training_completes_its_evaluation_completes_and_the_next_deploy_starts(tmp_path):
    train = digits_plan()
    h = Harness(tmp_path / "s.db")
    weights = encode_checkpoint(initial_weights(train))
    two_rounds = RoundConfig(goal_count=5, over_selection=1.0, min_fraction=1.0, max_rounds=2)
    h.service.deploy_tasks(
        POP,
        [
            TaskSpec("train", serialize_plan(train), weights, two_rounds),
            TaskSpec("eval", serialize_plan(build_eval_plan(train)), None, CONFIG, evaluates="train"),
        ],
    )
    h.service.deploy_task(POP, "next", serialize_plan(train), weights, CONFIG)
    plans = {"train": train, "eval": build_eval_plan(train), "next": train}
    order = [h.round(lambda task, i: _update(plans[task], 0.01, i)) for _ in range(4)]
    assert order == ["train", "eval", "train", "next"]
    statuses = {t["name"]: t["status"] for t in h.service.population_status(POP)["tasks"]}
    assert statuses == {"train": "completed", "eval": "completed", "next": "active"}
