"""Regressions for the FL server's audit: each test states a property the server must keep against a
plan, a config, a report or a database that misbehaves. Driven through FLService directly (no HTTP),
with a fake clock, so a round is a few function calls."""

from __future__ import annotations

import contextlib
import inspect
import json
import math

import numpy as np
import pytest
from sqlalchemy.exc import OperationalError

from device_runtime import decode_checkpoint, encode_checkpoint, initial_weights, serialize_plan
from device_runtime.eligibility import EligibilityPolicies
from device_runtime.executor import PlanExecutor
from device_runtime.plan import installed_runtime_version
from device_runtime.wire import CheckinAccepted, ReportAnswer
from server_stub import ApiError, FLService, RoundConfig, ServerStore
from server_stub.errors import InvalidPlan
from tests.device_runtime.test_executor_smoke import broken_zero_plan
from tests.support import digits_plan

POP = "digits"
TASK = "train"
#: Five devices commit a round, all of them needed: the smallest config a published model allows.
CONFIG = RoundConfig(
    goal_count=5, over_selection=1.0, min_fraction=1.0, selection_timeout_s=60.0, report_timeout_s=60.0
)


class Server:
    """An FLService over an SQLite file, on a fake clock; ``restart`` opens a second one on the same file."""

    def __init__(self, path) -> None:
        self.path = path
        self.now = 0.0
        self.stores: list[ServerStore] = []
        self.service = self.restart()

    @property
    def store(self) -> ServerStore:
        return self.service.store

    def restart(self) -> FLService:
        store = ServerStore(self.path)
        self.stores.append(store)
        return FLService(store, clock=lambda: self.now, wall_clock=lambda: 1.7e9 + self.now)

    def deploy(self, plan=None, config: RoundConfig = CONFIG, name: str = TASK):
        plan = plan or digits_plan()
        weights = initial_weights(plan, seed=0)
        self.service.create_population(POP)
        self.service.deploy_task(POP, name, serialize_plan(plan), encode_checkpoint(weights), config)
        return plan, weights

    def checkin(self, n: int) -> list[CheckinAccepted]:
        answers = [self.service.checkin(POP, installed_runtime_version()) for _ in range(n)]
        assert all(isinstance(a, CheckinAccepted) for a in answers), answers
        return answers

    def report(self, session: CheckinAccepted, update: dict) -> ReportAnswer:
        return self.service.report(session.session_id, session.token, encode_checkpoint(update))

    def run_round(self, updates: list[dict]) -> None:
        """One round: as many devices as updates check in, then each reports its update."""
        self.now += 1.0
        for session, update in zip(self.checkin(len(updates)), updates):
            self.report(session, update)

    def model(self) -> dict[str, np.ndarray]:
        """The newest committed model, as stored; checks that the next device is sent the same."""
        stored = decode_checkpoint(self.service.current_model(POP)[0])
        sent = decode_checkpoint(self.store.get_resource(self.checkin(1)[0].checkpoint_id))
        for name in stored:
            np.testing.assert_array_equal(stored[name], sent[name])
        return stored

    def statuses(self) -> list[str]:
        return [r["status"] for r in self.service.rounds(POP)]


@pytest.fixture
def server(tmp_path):
    srv = Server(tmp_path / "s.db")
    yield srv
    for store in srv.stores:
        store.close()


def update_of(plan, num_examples: float = 10.0, **values) -> dict[str, np.ndarray]:
    """A valid client update: zero deltas, ``num_examples`` examples all counted, and ``values``."""
    spec = PlanExecutor(plan).client_update_spec()
    update = {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in spec.items()}
    update["num_examples"] = np.array(num_examples, dtype=np.float32)
    update["count"] = np.array(num_examples, dtype=np.float32)
    for name, value in values.items():
        update[name] = np.broadcast_to(np.asarray(value, dtype=np.float32), spec[name][0]).copy()
    return update


def distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """Euclidean distance between two models, in float64."""
    return math.sqrt(sum(float(np.sum((a[w].astype(np.float64) - b[w]) ** 2)) for w in a))


def all_finite(tensors: dict[str, np.ndarray]) -> bool:
    return all(np.isfinite(v).all() for v in tensors.values())


# 1 ------------------------------------------------------------------------------------------------


def test_a_plan_whose_server_graph_does_not_run_is_refused_at_deploy_and_leaves_nothing_behind(server):
    plan = digits_plan()
    weights = encode_checkpoint(initial_weights(plan, seed=0))
    server.service.create_population(POP)
    with pytest.raises(InvalidPlan, match="zero") as refused:
        server.service.deploy_task(POP, TASK, serialize_plan(broken_zero_plan(plan)), weights, CONFIG)
    assert refused.value.status == 422
    assert server.store.tasks(POP) == []
    # the name is still free and the population takes a good plan
    server.service.deploy_task(POP, TASK, serialize_plan(plan), weights, CONFIG)
    assert [t.name for t in server.store.tasks(POP)] == [TASK]
    # and a server started on this database comes up with the good task active
    assert server.restart().population_status(POP)["active_task"] == TASK


# 2 ------------------------------------------------------------------------------------------------

NON_FINITE = (math.nan, math.inf, -math.inf)
_ROUND_FLOATS = ("over_selection", "min_fraction", "selection_timeout_s", "report_timeout_s", "secagg_round_timeout_s")


def test_a_round_config_with_a_non_finite_number_is_refused():
    cases = [{name: x} for name in _ROUND_FLOATS for x in NON_FINITE]
    cases += [{"retry_window_s": (0.0, x)} for x in NON_FINITE] + [{"retry_window_s": (x, 1.0)} for x in NON_FINITE]
    accepted = []
    for fields in cases:
        for make in (lambda f: RoundConfig(**f), RoundConfig.from_dict):
            try:
                make(fields)
            except ValueError:  # pydantic's ValidationError is one
                continue
            accepted.append(fields)
    assert accepted == []


def test_eligibility_policies_with_a_non_finite_number_are_refused():
    fields = ("min_examples", "min_separation_rounds", "min_separation_s", "sampling_period_s")
    accepted = []
    for name in fields:
        for x in NON_FINITE:
            try:
                EligibilityPolicies.from_dict({name: x})
            except ValueError:
                continue
            accepted.append({name: x})
    assert accepted == []


# 3, 4 ---------------------------------------------------------------------------------------------


def test_round_metrics_stay_finite_when_the_reports_metric_sums_overflow_float32(server):
    plan, _ = server.deploy()
    big = float(np.finfo(np.float32).max) * 0.9  # 3.06e38: finite alone, two of them are not in float32
    updates = [update_of(plan, loss_sum=big), update_of(plan, loss_sum=big)] + [update_of(plan) for _ in range(3)]
    server.run_round(updates)
    assert server.statuses() == ["committed"]
    for service in (server.service, server.restart()):
        json.dumps(service.rounds(POP), allow_nan=False)  # raises on NaN or infinity


def test_a_round_commits_a_finite_model_when_the_reports_weight_sums_overflow_float32(server):
    plan, _ = server.deploy()
    big = float(np.finfo(np.float32).max) * 0.9
    first = plan.weight_names[0]
    updates = [update_of(plan, 1.0, **{first: big}), update_of(plan, 1.0, **{first: big})]
    updates += [update_of(plan, 1.0) for _ in range(3)]
    server.run_round(updates)
    assert server.statuses() == ["committed"]
    assert all_finite(server.model())


# 5 ------------------------------------------------------------------------------------------------


def test_one_report_claiming_huge_num_examples_cannot_set_the_model(server):
    config = RoundConfig(
        goal_count=5, over_selection=1.2, min_fraction=1.0, selection_timeout_s=60.0, report_timeout_s=60.0
    )
    plan, start = server.deploy(config=config)
    target = {w: start[w] + np.float32(50.0) for w in plan.weight_names}
    claimed = 1e30
    forged = update_of(plan, claimed, **{w: (target[w] - start[w]) * np.float32(claimed) for w in plan.weight_names})
    assert all_finite(forged)  # a valid update as far as shapes, dtype and finiteness go
    attacker, *honest = server.checkin(6)
    with contextlib.suppress(ApiError):  # refusing the report outright protects the model too
        server.report(attacker, forged)
    for session in honest:  # four or five are needed, depending on whether the forged one counted
        with contextlib.suppress(ApiError):
            server.report(session, update_of(plan, 1000.0))
    assert server.statuses() == ["committed"]
    # the forged report may move the model, but by a bounded weight (the cap) and norm (the clip)
    assert distance(server.model(), target) > 0.5 * distance(start, target)


# 6 ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        RoundConfig(goal_count=1),
        RoundConfig(goal_count=4, over_selection=1.5, min_fraction=1.0),
        RoundConfig(goal_count=10, min_fraction=0.4),  # commits with ceil(10 * 0.4) = 4 reports
    ],
)
def test_a_task_whose_rounds_could_publish_a_model_from_fewer_than_five_devices_is_refused(server, config):
    with pytest.raises(ApiError) as refused:
        server.deploy(config=config)
    assert refused.value.code == "BAD_CONFIG"
    assert server.store.tasks(POP) == []


# 7 ------------------------------------------------------------------------------------------------


class FailFirstCommitWrite:
    """Wraps ServerStore.record_round: the first write of a committed round raises OperationalError
    (the disk is full, the database is locked), every other call goes through."""

    def __init__(self, store: ServerStore) -> None:
        self.record_round = store.record_round
        self.failed: dict | None = None

    def __call__(self, *args, **kwargs):
        call = inspect.signature(self.record_round).bind(*args, **kwargs).arguments
        if self.failed is None and call["status"] == "committed":
            self.failed = call
            raise OperationalError("INSERT INTO rounds ...", {}, Exception("database or disk is full"))
        return self.record_round(*args, **kwargs)


def test_a_commit_whose_database_write_fails_is_not_applied_twice(server, monkeypatch):
    plan, start = server.deploy()
    rng = np.random.default_rng(7)
    updates = []
    for i in range(5):
        n = 10.0 + i
        deltas = {w: rng.normal(0.0, 0.01, start[w].shape) * n for w in plan.weight_names}  # mean delta norm ~0.25
        updates.append(update_of(plan, n, **deltas))
    mean = {
        w: sum(u[w].astype(np.float64) for u in updates) / sum(float(u["num_examples"]) for u in updates)
        for w in plan.weight_names
    }

    fault = FailFirstCommitWrite(server.store)
    monkeypatch.setattr(server.store, "record_round", fault)
    sessions = server.checkin(5)
    for session, update in zip(sessions[:4], updates[:4]):
        server.report(session, update)
    with contextlib.suppress(OperationalError, ApiError):  # what the fifth device is told is the server's choice
        server.report(sessions[4], updates[4])
    assert fault.failed is not None, "the round did not try to commit"

    server.run_round(updates)  # the database works again; the next round commits
    records = server.service.rounds(POP)
    assert records[-1]["status"] == "committed"
    failed = [r for r in records if (r["round"], r["attempt"]) == (fault.failed["number"], fault.failed["attempt"])]
    assert all(r["status"] != "committed" for r in failed), records
    committed = sum(1 for r in records if r["status"] == "committed")
    model = server.model()
    for w in plan.weight_names:
        np.testing.assert_allclose(model[w], start[w] + committed * mean[w], rtol=1e-5, atol=1e-6)


# 8 ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tâche", "task\u0663", "\uff54\uff41\uff53\uff4b", "naïve-pop"])
def test_names_outside_ascii_are_refused(server, name):
    """isalnum() is true for 'â', Arabic-Indic digits and fullwidth letters; names are ASCII."""
    plan = digits_plan()
    weights = encode_checkpoint(initial_weights(plan, seed=0))
    server.service.create_population(POP)
    with pytest.raises(ApiError) as refused:
        server.service.deploy_task(POP, name, serialize_plan(plan), weights, CONFIG)
    assert refused.value.code == "BAD_NAME"
    with pytest.raises(ApiError) as refused:
        server.service.create_population(name)
    assert refused.value.code == "BAD_NAME"
    assert server.store.tasks(POP) == [] and server.store.population_names() == [POP]
