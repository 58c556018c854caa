"""A hostile FL server on a real loopback port (uvicorn): what it sends in a Secure Aggregation
state or in a plan that is valid ONNX ends the device's part in a typed refusal, never in an
exception that is not the SDK's, a hang or memory the device never gives.

- A group assignment whose counts are not integers (``Infinity``, ``1e400``, ``NaN``, which the
  device's JSON parser reads as floats) is refused before a key is advertised, naming the field:
  ``Infinity`` raised ``OverflowError`` out of the app's ``run_session``.
- A group said to have summed the device's input before the device sent one is refused: the
  session ended as completed, taking part, with nothing trained nor sent.
- A masked input asked for before the key rounds ended is refused before the device trains for it.
- A SecAgg+ degree past ``MAX_SECAGG_PLUS_DEGREE`` is refused before it is judged: judging it sums
  binomial tails over degree + 1 terms, and a degree of 2^24 held the device for minutes.
- A small tensor whose data does not fit its type and shape (too long, in segments) is refused
  when the plan loads (``PlanError``; ``CorruptResource`` in a session): numpy's ``ValueError``
  came out of the plan's load.
- A plan of more graph nodes than a device's ``nodes_bound`` is refused before its graphs are
  checked (``OverBudget``): each node took some 3 KB to check and as much to run, and a plan of
  300,000 nodes, 8 MB, took 842 MB and 29 s to load, then 781 MB and 59 s to make its session.
- A sparse initializer is counted at its dense size, which onnxruntime allocates when it makes the
  session: one value declared 10^5 x 10^5 is refused when the plan loads, one over the device's
  memory before it runs (``OverBudget``)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from device_runtime import (
    DeviceClass,
    FLRuntime,
    OpStatsStore,
    Outcome,
    OverBudget,
    PlanError,
    RetryPolicy,
    encode_checkpoint,
    initial_weights,
)
from device_runtime.environment import RuntimeEnvironment
from device_runtime.errors import CorruptResource
from device_runtime.plan import (
    MAX_TENSOR_BYTES,
    NODE_BYTES,
    NODES_SHARE,
    load_plan,
    nodes_bound,
    serialize_plan,
)
from device_runtime.plan_cache import LoadedPlans
from device_runtime.protocol import ProtocolClient
from device_runtime.secagg_policy import SecAggPolicy
from device_runtime.secure_client import (
    MAX_SECAGG_PLUS_DEGREE,
    REFUSED,
    SecureAggregation,
    SecureOutcome,
    SecureResult,
    session_member_key,
)
from device_runtime.secure_sum import SecureSumCodec, config_to_json
from device_runtime.wire import CheckinAccepted
from example_store import InMemoryExampleStore
from secagg import Round, SecAggConfig, assign_groups, group_seed, seed_commitment
from tests.support import COLLECTION, LoopbackApp, digits_plan

SEED = b"hostile seed of thirty-two bytes!"
FAST = RetryPolicy(attempts=1)


class HostileServer(LoopbackApp):
    """An FL server on a loopback port (uvicorn) that accepts every check-in with ``checkin``
    (its ``plan_id`` and ``checkpoint_id`` those of ``plans[n]`` for the n-th session, the last one
    thereafter), serves them, answers every Secure Aggregation poll with ``secagg`` and takes
    reports and aborts, counting them (``aborts`` keeps their reasons). Once a device has sent a
    Secure Aggregation message, polls are answered with ``after_sent`` (by default: its round closed)."""

    def __init__(self) -> None:
        self.plans: list[bytes] = []
        self.checkpoints: list[bytes] = []
        self.by_id: dict[str, bytes] = {}
        self.checkin: dict = {}
        self.secagg: str = json.dumps({"status": "waiting"})
        self.after_sent = json.dumps({"status": "closed"})
        self.sessions = self.reports = self.secagg_sent = 0
        self.aborts: list[str] = []
        app = Starlette(routes=[Route("/{path:path}", self._answer, methods=["GET", "POST"])])
        super().__init__(app)

    def serve(self, *plans) -> None:
        """Serve ``plans`` (wire bytes or ``Plan``s), each with its initial weights, from the next session on."""
        self.plans = [p if isinstance(p, bytes) else serialize_plan(p) for p in plans]
        self.checkpoints = [
            encode_checkpoint(initial_weights(p if not isinstance(p, bytes) else load_plan(p), seed=0)) for p in plans
        ]
        self.by_id = {hashlib.sha256(b).hexdigest(): b for b in self.plans + self.checkpoints}
        self.sessions = self.reports = self.secagg_sent = 0
        self.aborts = []

    async def _answer(self, request: Request) -> Response:
        path = request.url.path
        body = await request.body()
        if path.endswith("/checkin"):
            n = min(self.sessions, len(self.plans) - 1)
            self.sessions += 1
            answer = {
                "status": "accepted",
                "session_id": f"s{self.sessions}",
                "token": "t0k3n",
                "task": "train",
                "round": self.sessions,
                "aggregation": "simple",
                "report_deadline_s": 60.0,
                **self.checkin,
                "plan_id": hashlib.sha256(self.plans[n]).hexdigest(),
                "checkpoint_id": hashlib.sha256(self.checkpoints[n]).hexdigest(),
            }
            return _json(json.dumps(answer))
        if path.startswith("/v1/resources/"):
            return Response(self.by_id[path.rsplit("/", 1)[1]], media_type="application/octet-stream")
        if path.endswith("/secagg"):
            if request.method == "POST":
                self.secagg_sent += 1
                return _json('{"status": "accepted"}')
            return _json(self.after_sent if self.secagg_sent else self.secagg)
        if path.endswith("/abort"):
            self.aborts.append(json.loads(body)["reason"])
            return _json('{"status": "aborted"}')
        if path.endswith("/report"):
            self.reports += 1
        return _json('{"status": "accepted"}')


def _json(text: str) -> Response:
    """``text`` as it is: JSON that Python's encoder would not write (``Infinity``, ``1e400``)."""
    return Response(text.encode(), media_type="application/json")


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileServer]:
    with HostileServer() as server:
        yield server


def _store(n: int = 16) -> InMemoryExampleStore:
    store = InMemoryExampleStore()
    rng = np.random.default_rng(0)
    store.add(COLLECTION, [{"x": rng.random(64).astype(np.float32), "y": int(i % 10)} for i in range(n)])
    return store


# ----------------------------------------------------------------------------- Secure Aggregation
SESSION = CheckinAccepted(
    session_id="s1",
    token="t0k3n",
    task="train",
    round=1,
    plan_id="0" * 64,
    checkpoint_id="1" * 64,
    aggregation="secure_sum",
    report_deadline_s=60.0,
    max_examples_per_report=100,
    clip_update_norm=1.0,
    secagg_commitment=base64.b64encode(seed_commitment(SEED)).decode(),
)
#: Four other members and this device (by its session, as the server names an unattested device).
MEMBERS = [hashlib.sha256(bytes([i])).digest() for i in range(4)] + [session_member_key(SESSION.session_id)]


def _honest_state(vector_length: int = 4, **config_changes) -> dict:
    """AdvertiseKeys as an honest server sends it to this device under the default floor (but an
    unattested cohort): its group and seat from the revealed seed, the group's graph committed."""
    [group] = assign_groups(SEED, MEMBERS, 5)
    config = SecAggConfig(
        vector_length=vector_length,
        modulus=2**32,
        threshold=4,
        consistency_check=True,
        min_summed=5,
        graph_commitment=seed_commitment(group_seed(SEED, 0)),
        allow_unsafe=True,
    )
    return {
        "status": "active",
        "round": Round.ADVERTISE_KEYS.value,
        "seq": 1,
        "client_id": group.index(MEMBERS[-1]) + 1,
        "group_size": 5,
        "config": {**config_to_json(config), **config_changes},
        "assignment": {
            "seed": base64.b64encode(SEED).decode(),
            "members": [base64.b64encode(m).decode() for m in MEMBERS],
            "min_group_size": 5,
            "group": 0,
        },
    }


def _prepare(server: HostileServer, state: str, policy: SecAggPolicy) -> SecureResult | None:
    """This device's key rounds against ``server`` answering every poll with ``state``."""
    server.secagg, server.secagg_sent = state, 0
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += max(seconds, 0.01)

    client = ProtocolClient(server.url, retry=FAST)
    try:
        secure = SecureAggregation(
            client, SESSION, deadline=1.0, sleep=sleep, clock=lambda: now[0], long_poll_s=0.0, policy=policy
        )
        return secure.prepare()
    finally:
        client.close()


UNATTESTED = SecAggPolicy(require_attested_cohort=False)


def test_an_honest_assignment_is_taken_and_the_device_advertises_its_keys(hostile):
    """The state the tests below bend, as it is: the device joins and sends its keys."""
    result = _prepare(hostile, json.dumps(_honest_state()), UNATTESTED)
    assert hostile.secagg_sent == 1
    assert result is not None and result.outcome is SecureOutcome.EXCLUDED and not result.refused


def _secure_session(hostile: HostileServer, tmp_path, state: str, after_sent: str | None = None):
    """A secure-sum session of the app's ``run_session`` against ``hostile``, which answers the
    device's first poll with ``state`` (and, with ``after_sent``, what follows its first message):
    its result and the sessions its opstats kept. The server's honest answers are put back after."""
    hostile.checkin = {
        "aggregation": "secure_sum",
        "max_examples_per_report": 100,
        "clip_update_norm": 1.0,
        "secagg_commitment": SESSION.secagg_commitment,
    }
    hostile.secagg = state
    if after_sent is not None:
        hostile.after_sent = after_sent
    opstats = OpStatsStore(tmp_path / "app.db")
    try:
        with FLRuntime(
            "digits", hostile.url, _store(), opstats=opstats, retry=FAST, secagg_policy=UNATTESTED
        ) as runtime:
            result = runtime.run_session()
    finally:
        hostile.checkin, hostile.after_sent = {}, json.dumps({"status": "closed"})
    return result, [s.shape for s in opstats.sessions()]


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "1e400", "NaN", "5.5", "true", '"5"'])
@pytest.mark.parametrize("field", ["min_group_size", "group", "spare"])
def test_an_assignment_whose_counts_are_not_integers_is_refused_before_a_key_is_advertised(hostile, field, value):
    """The device's JSON parser reads ``Infinity`` and ``1e400`` as float infinity: turned into a
    count, it raised ``OverflowError`` out of the device's session (and ``5.5`` was taken as 5)."""
    state = (
        json.dumps(_honest_state())
        .replace('"group": 0', '"group": 0, "spare": 0')
        .replace(f'"{field}": {5 if field == "min_group_size" else 0}', f'"{field}": {value}')
    )
    assert value in state
    result = _prepare(hostile, state, UNATTESTED)
    assert result is not None and result.refused and result.code == REFUSED
    assert f"assignment.{field}" in result.detail and hostile.secagg_sent == 0


def test_a_session_whose_assignment_holds_infinity_ends_refused_and_the_server_hears_why(hostile, tmp_path):
    """The same, through the app's ``run_session``: it raised ``OverflowError``; now the session ends
    as refused (``SECAGG_REFUSED``), in opstats, and the server hears the abort with the reason."""
    hostile.serve(digits_plan(secure_aggregation=True))
    state = json.dumps(_honest_state()).replace('"min_group_size": 5', '"min_group_size": Infinity')
    result, shapes = _secure_session(hostile, tmp_path, state)
    assert result.outcome is Outcome.REPORT_REJECTED and result.rejection_code == REFUSED
    assert hostile.secagg_sent == 0 and len(hostile.aborts) == 1
    assert "assignment.min_group_size" in hostile.aborts[0]
    assert shapes == ["-v#"]


def test_a_group_said_to_have_summed_an_input_the_device_never_sent_is_refused(hostile, tmp_path):
    """Told its group completed with its input summed right after it advertised its keys, the device
    ended its session as completed (``-v^``: taking part, which its eligibility policies read) with
    nothing trained nor sent. Its input can be in a sum only once its masked input has left."""
    plan = digits_plan(secure_aggregation=True)
    hostile.serve(plan)
    state = json.dumps(_honest_state(vector_length=SecureSumCodec(plan).vector_length))
    result, shapes = _secure_session(hostile, tmp_path, state, json.dumps({"status": "completed", "included": True}))
    assert hostile.secagg_sent == 1  # its keys
    assert result.outcome is Outcome.REPORT_REJECTED and result.rejection_code == REFUSED
    assert "the server says this device's input was summed, but it has sent none" in hostile.aborts[0]
    assert shapes == ["-v#"]


def test_a_masked_input_asked_for_before_the_key_rounds_ended_is_refused_before_training(hostile, tmp_path):
    """Asked for its masked input right after it advertised its keys (no ShareKeys, no ShareCheck),
    the device trained for it, then its client refused the request as out of order: the training
    was for nothing. It refuses before it trains."""
    plan = digits_plan(secure_aggregation=True)
    hostile.serve(plan)
    state = _honest_state(vector_length=SecureSumCodec(plan).vector_length)
    asked = {**state, "round": Round.MASKED_INPUT_COLLECTION.value, "seq": 2, "message": "AAAA"}
    result, shapes = _secure_session(hostile, tmp_path, json.dumps(state), json.dumps(asked))
    assert result.outcome is Outcome.REPORT_REJECTED and result.rejection_code == REFUSED
    assert "asked for its masked input during AdvertiseKeys, before its key rounds ended" in hostile.aborts[0]
    assert shapes == ["-v#"]  # no training ('[')


@pytest.mark.parametrize("degree", [MAX_SECAGG_PLUS_DEGREE, 2 * MAX_SECAGG_PLUS_DEGREE, 1 << 18])
def test_a_secagg_plus_degree_past_what_a_device_judges_is_refused_before_it_is_judged(hostile, degree):
    """A group said to be 2^64 devices with a SecAgg+ degree of 2^18 and a threshold of every
    neighbour: judging it summed binomial tails over 2^18 + 1 terms (a second; 2^24 took minutes and
    gigabytes, kept for later judgements), and the floor took it. Up to ``MAX_SECAGG_PLUS_DEGREE``
    a degree is judged as before (this one passes the floor, and the device advertises its keys)."""
    state = _honest_state(degree=degree, threshold=degree + 1)
    del state["assignment"]
    state["group_size"] = 2**64
    policy = SecAggPolicy(require_attested_cohort=False, require_graph_commitment=False)
    result = _prepare(hostile, json.dumps(state), policy)
    if degree <= MAX_SECAGG_PLUS_DEGREE:
        assert hostile.secagg_sent == 1 and result is not None and result.outcome is SecureOutcome.EXCLUDED
        return
    assert result is not None and result.refused and result.code == REFUSED and hostile.secagg_sent == 0
    assert f"SecAgg+ degree {degree} is above the {MAX_SECAGG_PLUS_DEGREE} this device judges" in result.detail


# ----------------------------------------------------------------------------- plans
def _with_work(plan, nodes, initializers=(), sparse=()):
    """``plan`` whose work graph also runs ``nodes``, their result ('extra') added to its first metric."""
    model = onnx.ModelProto.FromString(plan.work)
    metric = plan.metric_names[0]
    for node in model.graph.node:
        node.output[:] = [f"{metric}_before" if o == metric else o for o in node.output]
    model.graph.node.extend([*nodes, helper.make_node("Add", [f"{metric}_before", "extra"], [metric])])
    model.graph.initializer.extend(initializers)
    model.graph.sparse_initializer.extend(sparse)
    return dataclasses.replace(plan, work=model.SerializeToString())


ONE = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
#: Shape vectors of two int64s whose data does not fit them, which the ONNX checker lets through.
UNFIT: dict[str, Callable[[], TensorProto]] = {
    "raw data too long": lambda: TensorProto(
        name="shape", data_type=TensorProto.INT64, dims=[2], raw_data=np.array([4, 4, 4], "<i8").tobytes()
    ),
    "values too many": lambda: TensorProto(name="shape", data_type=TensorProto.INT64, dims=[2], int64_data=[4, 4, 4]),
    "in segments": lambda: TensorProto(
        name="shape", data_type=TensorProto.INT64, dims=[2], int64_data=[4, 4], segment=TensorProto.Segment(end=1)
    ),
}


def _unfit(how: str):
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["filled"], value=ONE),
        helper.make_node("ReduceSum", ["filled"], ["extra"], keepdims=0),
    ]
    return _with_work(digits_plan(), nodes, [UNFIT[how]()])


@pytest.mark.parametrize("how", sorted(UNFIT))
def test_a_tensor_whose_data_does_not_fit_its_shape_is_refused_when_the_plan_loads(how):
    with pytest.raises(PlanError, match=r"graph 'work' holds tensor 'shape', whose data does not fit its type"):
        load_plan(serialize_plan(_unfit(how)))


def test_a_session_whose_plan_holds_a_tensor_that_does_not_fit_ends_in_the_sdks_error(hostile, tmp_path):
    """numpy's ``ValueError`` ("cannot reshape array of size 3 into shape (2,)") came out of the
    app's ``run_session``; now the plan is refused as corrupt, not cached, the server hears the
    abort, and the same runtime trains an honest plan next."""
    hostile.serve(_unfit("raw data too long"), digits_plan())
    cache = tmp_path / "cache"
    with FLRuntime("digits", hostile.url, _store(), cache_dir=cache, retry=FAST) as runtime:
        with pytest.raises(CorruptResource, match="whose data does not fit its type and shape"):
            runtime.run_session()
        assert len(hostile.aborts) == 1 and not runtime._plans and not runtime.loaded_plans._loaded
        assert not (cache / "plans").exists() or not list((cache / "plans").iterdir())
        assert runtime.run_session().outcome is Outcome.COMPLETED
    assert hostile.reports == 1


def _sparse(rows: int, cols: int) -> onnx.SparseTensorProto:
    """One float32 value at [0, 0] of a ``rows`` x ``cols`` tensor named 'big': a few bytes of a plan."""
    values = numpy_helper.from_array(np.array([1.0], np.float32), "big")
    return helper.make_sparse_tensor(values, numpy_helper.from_array(np.array([0], np.int64), "big_at"), [rows, cols])


def _sparse_in_a_loop(rows: int, cols: int):
    body = helper.make_graph(
        [helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0), helper.make_node("Identity", ["c"], ["c_out"])],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("total", TensorProto.FLOAT, None),
        ],
        sparse_initializer=[_sparse(rows, cols)],
    )
    trips = [numpy_helper.from_array(np.array(1, np.int64), "trips"), numpy_helper.from_array(np.array(True), "go")]
    nodes = [
        helper.make_node("Loop", ["trips", "go"], ["totals"], body=body),
        helper.make_node("ReduceSum", ["totals"], ["extra"], keepdims=0),
    ]
    return _with_work(digits_plan(), nodes, trips)


def _sparse_plan(rows: int, cols: int, where: str = "graph"):
    if where == "loop":
        return _sparse_in_a_loop(rows, cols)
    return _with_work(
        digits_plan(), [helper.make_node("ReduceSum", ["big"], ["extra"], keepdims=0)], sparse=[_sparse(rows, cols)]
    )


@pytest.mark.parametrize("where", ["graph", "loop"])
def test_a_sparse_initializer_larger_than_a_device_gives_dense_is_refused_when_the_plan_loads(where):
    """One value declared 10^5 x 10^5: 40 GB that onnxruntime allocated when it made the session."""
    with pytest.raises(
        PlanError, match=r"makes tensor 'big' of 40,000,000,000 bytes before it has run a step"
    ) as refused:
        load_plan(serialize_plan(_sparse_plan(100_000, 100_000, where)))
    assert f"more than the {MAX_TENSOR_BYTES:,} a device gives one tensor" in str(refused.value)


def test_a_sparse_initializer_over_the_devices_memory_is_refused_before_it_runs(hostile, tmp_path):
    """128 MB dense on a device that gives 64 MB: the device counted it as nothing, and onnxruntime
    made it dense (twice, at its peak) when the session was made."""
    hostile.serve(_sparse_plan(8192, 4096), digits_plan())
    small = DeviceClass("small", memory_mb=64)
    with FLRuntime("digits", hostile.url, _store(), device_class=small, retry=FAST) as runtime:
        with pytest.raises(OverBudget, match=r"makes tensor 'big' of 128 MB before it has run a step; a small device"):
            runtime.run_session()
        assert len(hostile.aborts) == 1 and hostile.reports == 0
        assert all(not executor._sessions for executor in runtime._executors.values())  # nothing was run
        assert runtime.run_session().outcome is Outcome.COMPLETED
    assert hostile.reports == 1


def _many_nodes(count: int):
    """The digits plan whose work graph also passes the batch through ``count`` Identity nodes."""
    nodes = [helper.make_node("Identity", ["x"], ["n0"])]
    nodes += [helper.make_node("Identity", [f"n{i}"], [f"n{i + 1}"]) for i in range(count)]
    return _with_work(digits_plan(), [*nodes, helper.make_node("ReduceSum", [f"n{count}"], ["extra"], keepdims=0)])


def test_a_plan_of_more_nodes_than_the_device_checks_and_runs_is_refused_before_its_graphs_are_checked(
    hostile, tmp_path
):
    """Each node of a plan took some 2.8 KB and 0.1 ms of the device to check as the plan loaded,
    then as much again in onnxruntime's session: the 256 MB a default device downloads hold ten
    million nodes (300,000 took 842 MB and 29 s, then 781 MB and 59 s). A device of 16 MB takes
    1,365 nodes (``nodes_bound``): a plan of 1,400 is refused in ``OverBudget``, not kept, the
    server hears the abort, and an honest plan trains next; a runtime sharing the loaded plan with
    a larger device's (a simulation's) refuses it too."""
    most, _ = nodes_bound(16, "tiny")
    assert most == 16 * (1 << 20) // (NODES_SHARE * NODE_BYTES) == 1365
    hostile.serve(_many_nodes(1400), digits_plan())
    tiny = DeviceClass("tiny", memory_mb=16)
    cache = tmp_path / "cache"
    with FLRuntime("digits", hostile.url, _store(), device_class=tiny, cache_dir=cache, retry=FAST) as runtime:
        with pytest.raises(OverBudget, match=r"holds more than 1,365 nodes in its graphs: a tiny device of 16 MB"):
            runtime.run_session()
        assert len(hostile.aborts) == 1 and not runtime._plans and not runtime.loaded_plans._loaded
        assert not (cache / "plans").exists() or not list((cache / "plans").iterdir())
        assert runtime.run_session().outcome is Outcome.COMPLETED
    assert hostile.reports == 1
    shared = LoadedPlans()
    hostile.serve(_many_nodes(1400))
    with FLRuntime(
        "digits", hostile.url, _store(), retry=FAST, environment=RuntimeEnvironment(loaded_plans=shared)
    ) as runtime:
        assert runtime.run_session().outcome is Outcome.COMPLETED  # a default device takes 174,762
    with FLRuntime(
        "digits",
        hostile.url,
        _store(),
        device_class=tiny,
        retry=FAST,
        environment=RuntimeEnvironment(loaded_plans=shared),
    ) as runtime:
        with pytest.raises(OverBudget, match="holds more than 1,365 nodes"):
            runtime.run_session()


def test_a_secure_session_whose_plan_sends_nothing_to_secure_sum_is_refused_before_its_keys(hostile, tmp_path):
    """A server that names ``secure_sum`` for a plan that sends nothing to it: the device
    advertised its keys and trained, then failed on the plan at its report. It refuses before its
    keys, untrained."""
    hostile.serve(digits_plan())
    aborts = len(hostile.aborts)
    with pytest.raises(PlanError, match="sends nothing to secure sum"):  # a broken server's, as the SDK raises them
        _secure_session(hostile, tmp_path, json.dumps(_honest_state()))
    assert hostile.secagg_sent == 0  # no key advertised
    assert hostile.aborts[aborts:] == ["error: PlanError"]  # the server told
    assert [s.shape for s in OpStatsStore(tmp_path / "app.db").sessions()] == ["-v*"]  # nothing trained
