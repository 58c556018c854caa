"""A plan from a hostile server that is valid ONNX but hostile cannot read the device's files,
crash the app with onnxruntime's own errors, run for ever or fill the app's memory.

- A tensor kept in an external file (``/etc/passwd``, ``../..``, or a name that happens to exist
  where the app runs) is refused when the plan loads: a plan carries all its data.
- A graph that makes a tensor larger than a device gives (``MAX_TENSOR_BYTES``: a ConstantOfShape,
  Expand, Tile, Range or OneHot to 10^11-10^12 elements, in the graph or a Loop's body, or sized
  from the batch's shape, ``Shape(x) * 10^5``) is refused
  when the plan loads, before onnxruntime allocates it; nothing of it is kept, nor of a plan refused
  for the device's memory (``OverBudget``), and a cached copy of a refused plan is removed.
- A tensor sized from a batch's shape is checked before that batch's step (a last batch smaller
  than the plan's, which the load checked).
- A plan larger than an eighth of the device's memory, whatever budget it declares, is refused
  (``OverBudget``) as it downloads, before it is loaded, which takes some three times its size more.
- A graph that asks onnxruntime for more memory than there is, in a size only its data tells,
  ends the session in the SDK's ``PlanError``; the server hears the abort and the same runtime
  trains an honest plan next.
- A graph whose one step never ends (a Loop of 10^15 iterations) is stopped by force at the
  device's ``max_training_s``.
- A step that takes memory without end in a size only the run tells (a Loop that keeps a tensor a
  trip) is stopped by force once the process has grown by the device's ``memory_mb``, and the
  plan's session is dropped.
- An operator whose one run no forced stop reaches, for a time no size the device bounds limits
  (NonMaxSuppression, RoiAlign), is refused when the plan loads, and so is a pooling window that
  reads each input value more than ``MAX_POOL_OVERLAP`` times.
- A new plan per session: the runtime keeps at most ``MAX_CACHED_PLANS`` loaded."""

from __future__ import annotations

import dataclasses
import hashlib

import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from device_runtime import (
    DeviceClass,
    FLRuntime,
    OpStatsStore,
    Outcome,
    OverBudget,
    PlanError,
    encode_checkpoint,
    initial_weights,
)
from device_runtime.errors import CorruptResource, RuntimeSdkError
from device_runtime.plan import MAX_TENSOR_BYTES, largest_work_tensor, load_plan, serialize_plan
from device_runtime.plan_cache import MAX_CACHED_PLANS
from example_store import InMemoryExampleStore
from tests.support import COLLECTION, digits_plan


def _with_work(plan, nodes, initializers=()):
    """``plan`` whose work graph also runs ``nodes``, their result added to its first metric."""
    model = onnx.ModelProto.FromString(plan.work)
    metric = plan.metric_names[0]
    for node in model.graph.node:
        node.output[:] = [f"{metric}_before" if o == metric else o for o in node.output]
    model.graph.node.extend([*nodes, helper.make_node("Add", [f"{metric}_before", "extra"], [metric])])
    model.graph.initializer.extend(initializers)
    return dataclasses.replace(plan, work=model.SerializeToString())


def _external(location: str):
    tensor = TensorProto(name="outside", data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        tensor.external_data.add(key=key, value=value)
    return _with_work(digits_plan(), [helper.make_node("ReduceSum", ["outside"], ["extra"], keepdims=0)], [tensor])


def _ints(values, name: str):
    return numpy_helper.from_array(np.array(values, np.int64), name)


ONE = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])


def _huge():
    """4 TB of float32, its size a constant: refused when the plan loads."""
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["big"], value=ONE),
        helper.make_node("ReduceSum", ["big"], ["extra"], keepdims=0),
    ]
    return _with_work(digits_plan(), nodes, [_ints([100_000, 100_000, 100], "shape")])


def _huge_from_data():
    """4 TB of float32 whose size only the batch tells (a 10^12 computed from the examples' values),
    which no check before the run can know."""
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["peak"], keepdims=0),
        helper.make_node("Mul", ["peak", "zero"], ["nothing"]),
        helper.make_node("Add", ["nothing", "trillion"], ["how_many"]),
        helper.make_node("Cast", ["how_many"], ["scalar"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["scalar", "one_dim"], ["shape"]),
        helper.make_node("ConstantOfShape", ["shape"], ["big"], value=ONE),
        helper.make_node("ReduceSum", ["big"], ["extra"], keepdims=0),
    ]
    initializers = [
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(np.array(1e12, np.float32), "trillion"),
        _ints([1], "one_dim"),
    ]
    return _with_work(digits_plan(), nodes, initializers)


def _sum_of(*nodes):
    return [*nodes, helper.make_node("ReduceSum", ["big"], ["extra"], keepdims=0)]


def _in_a_loop(nodes, initializers):
    """``nodes`` (making 'big' from ``initializers``) in the body of a Loop of one trip."""
    body = helper.make_graph(
        [
            *nodes,
            helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0),
            helper.make_node("Identity", ["c"], ["c_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("total", TensorProto.FLOAT, None),
        ],
        initializers,
    )
    trips = [_ints(1, "trips"), numpy_helper.from_array(np.array(True), "go")]
    loop = helper.make_node("Loop", ["trips", "go"], ["totals"], body=body)
    return [loop, helper.make_node("ReduceSum", ["totals"], ["extra"], keepdims=0)], trips


_LOOPED = _in_a_loop([helper.make_node("ConstantOfShape", ["shape"], ["big"], value=ONE)], [_ints([10**12], "shape")])
#: Graphs that make a tensor of 10^11-10^12 elements from constants (x is the batch, 8 x 64; y its labels).
HUGE_GRAPHS = {
    "ConstantOfShape": (
        _sum_of(helper.make_node("ConstantOfShape", ["shape"], ["big"], value=ONE)),
        [_ints([10**6, 10**6], "shape")],
    ),
    "Expand": (_sum_of(helper.make_node("Expand", ["x", "shape"], ["big"])), [_ints([10**9, 1, 1], "shape")]),
    "Tile": (_sum_of(helper.make_node("Tile", ["x", "repeats"], ["big"])), [_ints([10**5, 10**5], "repeats")]),
    "Range": (
        _sum_of(
            helper.make_node("Range", ["start", "limit", "delta"], ["steps"]),
            helper.make_node("Cast", ["steps"], ["big"], to=TensorProto.FLOAT),
        ),
        [_ints(0, "start"), _ints(10**12, "limit"), _ints(1, "delta")],
    ),
    "OneHot": (
        _sum_of(helper.make_node("OneHot", ["y", "depth", "off_on"], ["big"])),
        [_ints(10**11, "depth"), numpy_helper.from_array(np.array([0.0, 1.0], np.float32), "off_on")],
    ),
    "Loop": _LOOPED,
    # sized from the batch's shape, 8 x 64, times 10^5 each: 5 x 10^11 elements
    "Shape": (
        _sum_of(
            helper.make_node("Shape", ["x"], ["dims"]),
            helper.make_node("Mul", ["dims", "factor"], ["shape"]),
            helper.make_node("ConstantOfShape", ["shape"], ["big"], value=ONE),
        ),
        [_ints([10**5, 10**5], "factor")],
    ),
}


def _endless():
    state = [helper.make_tensor_value_info(n, t, []) for n, t in (("c", TensorProto.BOOL), ("v", TensorProto.FLOAT))]
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c_out"]), helper.make_node("Add", ["v", "v"], ["v_out"])],
        "spin",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), *state],
        [
            helper.make_tensor_value_info(n, t, [])
            for n, t in (("c_out", TensorProto.BOOL), ("v_out", TensorProto.FLOAT))
        ],
    )
    initializers = [
        numpy_helper.from_array(np.array(10**15, np.int64), "trips"),
        numpy_helper.from_array(np.array(True), "go"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
    ]
    nodes = [helper.make_node("Loop", ["trips", "go", "zero"], ["extra"], body=body)]
    return _with_work(digits_plan(), nodes, initializers)


@pytest.mark.parametrize("location", ["/etc/passwd", "../../../../etc/passwd", "passwd"])
def test_a_tensor_in_an_external_file_is_refused_wherever_the_app_runs(tmp_path, monkeypatch, location):
    """'passwd' exists where this app runs: the ONNX checker, which looks for the file there,
    passed it, and onnxruntime failed with an error of its own when the session was made."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n" * 4)
    with pytest.raises(PlanError, match="keeps tensor 'outside' in an external file"):
        load_plan(serialize_plan(_external(location)))


class HostileServer(httpx.BaseTransport):
    """Accepts every check-in with ``plans[n]`` for the n-th session (the last one thereafter),
    serves them with their initial weights, takes reports and aborts; ``aborts`` counts aborts."""

    def __init__(self, plans, report_deadline_s: float = 60.0) -> None:
        self.report_deadline_s = report_deadline_s
        self.reports = 0
        self.plans = [serialize_plan(p) for p in plans]
        self.checkpoints = [encode_checkpoint(initial_weights(p, seed=0)) for p in plans]
        self.sessions = 0
        self.aborts = 0
        self.by_id = {hashlib.sha256(b).hexdigest(): b for b in self.plans + self.checkpoints}

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith("/checkin"):
            n = min(self.sessions, len(self.plans) - 1)
            self.sessions += 1
            answer = {
                "status": "accepted",
                "session_id": f"s{self.sessions}",
                "token": "t0k3n",
                "task": "train",
                "round": self.sessions,
                "plan_id": hashlib.sha256(self.plans[n]).hexdigest(),
                "checkpoint_id": hashlib.sha256(self.checkpoints[n]).hexdigest(),
                "aggregation": "simple",
                "report_deadline_s": self.report_deadline_s,
            }
            return httpx.Response(200, json=answer)
        if path.startswith("/v1/resources/"):
            return httpx.Response(200, content=self.by_id[path.rsplit("/", 1)[1]])
        if path.endswith("/abort"):
            self.aborts += 1
            return httpx.Response(200, json={"status": "aborted"})
        if path.endswith("/report"):
            self.reports += 1
        return httpx.Response(200, json={"status": "accepted"})


def _store(n: int = 16) -> InMemoryExampleStore:
    store = InMemoryExampleStore()
    rng = np.random.default_rng(0)
    store.add(COLLECTION, [{"x": rng.random(64).astype(np.float32), "y": int(i % 10)} for i in range(n)])
    return store


@pytest.mark.parametrize("op", sorted(HUGE_GRAPHS))
def test_a_graph_that_makes_a_tensor_larger_than_a_device_gives_is_refused_when_the_plan_loads(op):
    """onnxruntime allocated such a tensor when it made the session (constant folding) or at the
    first step, whatever the device's memory: what the machine could give went through, and on a
    phone the app ends."""
    nodes, initializers = HUGE_GRAPHS[op]
    with pytest.raises(
        PlanError, match=r"graph 'work' makes tensor '\w+' of [\d,]+ bytes before it has run a step"
    ) as refused:
        load_plan(serialize_plan(_with_work(digits_plan(), nodes, initializers)))
    assert f"more than the {MAX_TENSOR_BYTES:,} a device gives one tensor" in str(refused.value)


def test_a_plan_with_a_tensor_larger_than_a_device_gives_is_refused_unrun_and_not_kept(tmp_path):
    server = HostileServer([_huge(), digits_plan()])
    cache = tmp_path / "cache"
    with FLRuntime("digits", "http://fl.test", _store(), transport=server, cache_dir=cache) as runtime:
        with pytest.raises(
            CorruptResource, match=r"was refused: graph 'work' makes tensor 'big' of 4,000,000,000,000 bytes"
        ):
            runtime.run_session()
        assert server.aborts == 1 and not runtime._plans and not runtime.loaded_plans._loaded
        assert not (cache / "plans").exists() or not list((cache / "plans").iterdir())
        assert runtime.run_session().outcome is Outcome.COMPLETED  # the next session, an honest plan
    assert server.reports == 1


def test_a_plan_whose_graph_makes_a_tensor_larger_than_the_device_gives_is_refused_before_it_runs(tmp_path):
    """Under ``MAX_TENSOR_BYTES``, but over this device's memory: a 256 MB tensor on a device that
    gives 64 MB. The plan's declared memory budget is the server's word (this one declares none);
    the device compared nothing else, and onnxruntime allocated the tensor when it made the session."""
    nodes = _sum_of(helper.make_node("ConstantOfShape", ["shape"], ["big"], value=ONE))
    server = HostileServer([_with_work(digits_plan(), nodes, [_ints([64 << 20], "shape")]), digits_plan()])
    small = DeviceClass("small", memory_mb=64)
    with FLRuntime("digits", "http://fl.test", _store(), transport=server, device_class=small) as runtime:
        with pytest.raises(
            OverBudget, match=r"makes tensor 'big' of 256 MB before it has run a step; a small device gives 64"
        ):
            runtime.run_session()
        assert server.aborts == 1 and server.reports == 0
        assert all(not executor._sessions for executor in runtime._executors.values())  # nothing was run
        assert runtime.run_session().outcome is Outcome.COMPLETED  # the next session, an honest plan


def _padded(megabytes: float):
    """The digits plan carrying ``megabytes`` of weights more in its work graph, declaring the
    memory budget of a small plan (1 MB)."""
    pad = numpy_helper.from_array(np.ones(int(megabytes * (1 << 18)), np.float32), "pad")
    plan = _with_work(digits_plan(), [helper.make_node("ReduceSum", ["pad"], ["extra"], keepdims=0)], [pad])
    return dataclasses.replace(plan, metadata=dataclasses.replace(plan.metadata, memory_budget_mb=1))


@pytest.mark.parametrize("sent", ["declared", "streamed"])
def test_a_plan_larger_than_the_device_takes_is_refused_unread_whatever_budget_it_declares(tmp_path, sent):
    """A plan of 2 MB that declares a budget of 1 MB, on a device of 8 MB: the device took any plan
    up to the protocol's 1 GiB and loaded it, holding it some eight times over, before any budget
    was read (a 1 GiB plan on a 2 GB device). Past an eighth of its memory the download stops in
    ``OverBudget`` (its size declared: before a byte of it is read), nothing is cached, the server
    hears the abort, and an honest plan trains next."""
    server = HostileServer([_padded(2), digits_plan()])
    if sent == "streamed":  # no content-length: cut off as it comes
        served = server.handle_request

        def handle_request(request: httpx.Request) -> httpx.Response:
            answer = served(request)
            if not request.url.path.startswith("/v1/resources/"):
                return answer
            body = answer.content
            return httpx.Response(
                200, stream=httpx.ByteStream(body), headers={"content-type": "application/octet-stream"}
            )

        server.handle_request = handle_request  # type: ignore[method-assign]
    tiny = DeviceClass("tiny", memory_mb=8)
    cache = tmp_path / "cache"
    with FLRuntime(
        "digits", "http://fl.test", _store(), transport=server, device_class=tiny, cache_dir=cache
    ) as runtime:
        with pytest.raises(
            OverBudget, match=r"a tiny device of 8 MB takes a plan of at most 1.0 MB \(1/8 of its memory"
        ):
            runtime.run_session()
        assert server.aborts == 1 and not runtime._plans
        assert not (cache / "plans").exists() or not list((cache / "plans").iterdir())
        assert runtime.run_session().outcome is Outcome.COMPLETED
    assert server.reports == 1


def _over_a_small_device():
    """Plans a device of 64 MB refuses for memory: one that declares 128 MB, one whose graph makes
    a 256 MB tensor before a step (and declares nothing)."""
    declared = digits_plan()
    declared = dataclasses.replace(declared, metadata=dataclasses.replace(declared.metadata, memory_budget_mb=128))
    nodes = _sum_of(helper.make_node("ConstantOfShape", ["shape"], ["big"], value=ONE))
    return {"declared": declared, "made": _with_work(digits_plan(), nodes, [_ints([64 << 20], "shape")])}


@pytest.mark.parametrize("how", ["declared", "made"])
def test_a_plan_refused_for_the_devices_memory_leaves_nothing_behind(tmp_path, how):
    """The refused plan stayed in the plan cache on disk and loaded in the runtime's memory (its
    graphs, its executor), as many times as a server named a new one."""
    refused = _over_a_small_device()[how]
    server = HostileServer([refused, digits_plan()])
    small = DeviceClass("small", memory_mb=64)
    cache = tmp_path / "cache"
    with FLRuntime(
        "digits", "http://fl.test", _store(), transport=server, device_class=small, cache_dir=cache
    ) as runtime:
        with pytest.raises(OverBudget):
            runtime.run_session()
        assert server.aborts == 1
        assert not runtime._plans and not runtime._executors and not runtime.loaded_plans._loaded
        assert not (cache / "plans").exists() or not list((cache / "plans").iterdir())
        assert runtime.run_session().outcome is Outcome.COMPLETED  # the next session, an honest plan
        assert len(list((cache / "plans").iterdir())) == 1 and len(runtime.loaded_plans._loaded) == 1
    assert server.reports == 1


@pytest.mark.parametrize(
    ("later", "refusal"),
    [
        (
            {"device_class": DeviceClass("small", memory_mb=64)},
            (OverBudget, "asks for 128 MB; a small device gives 64"),
        ),
        ({"runtime_version": "1.14.0"}, (CorruptResource, "was refused")),
    ],
    ids=["smaller-device", "older-runtime"],
)
def test_a_cached_plan_the_runtime_now_refuses_is_removed_from_the_cache(tmp_path, later, refusal):
    """A plan cached by a runtime that could run it (an app whose settings or onnxruntime changed
    since) is refused from the cache, and the copy goes with the refusal: it stayed, and was read
    and refused again at each session the server named it."""
    plan = _over_a_small_device()["declared"]
    cache = tmp_path / "cache"
    with FLRuntime("digits", "http://fl.test", _store(), transport=HostileServer([plan]), cache_dir=cache) as runtime:
        assert runtime.run_session().outcome is Outcome.COMPLETED
    assert len(list((cache / "plans").iterdir())) == 1
    server = HostileServer([plan])
    with FLRuntime("digits", "http://fl.test", _store(), transport=server, cache_dir=cache, **later) as runtime:
        with pytest.raises(refusal[0], match=refusal[1]):
            runtime.run_session()
        assert not list((cache / "plans").iterdir()) and not runtime.loaded_plans._loaded
    assert server.aborts == 1


def _sized_by_the_batch(elements: int):
    """A graph whose tensor has ``elements // batch`` float32s: ``ConstantOfShape(elements /
    Shape(x)[0])``, small at the plan's batch size, which the load checks, and ``elements`` at a
    last batch of one example."""
    nodes = _sum_of(
        helper.make_node("Shape", ["x"], ["dims"]),
        helper.make_node("Gather", ["dims", "first"], ["batch"]),
        helper.make_node("Div", ["elements", "batch"], ["how_many"]),
        helper.make_node("ConstantOfShape", ["how_many"], ["big"], value=ONE),
    )
    return _with_work(digits_plan(), nodes, [_ints([0], "first"), _ints([elements], "elements")])


def test_a_tensor_sized_from_a_batchs_shape_is_checked_before_that_batchs_step(tmp_path):
    """16 MB at the plan's batch of 8, 128 MB at the last batch of one example, on a device that
    gives 64 MB: the load passed it, and onnxruntime allocated it at that step. The session ends in
    ``OverBudget`` before the step, the server hears the abort, and an honest plan trains next."""
    plan = _sized_by_the_batch(32 << 20)
    assert load_plan(serialize_plan(plan)) is not None  # under the device's memory at the batch size
    server = HostileServer([plan, digits_plan()])
    small = DeviceClass("small", memory_mb=64)
    with FLRuntime("digits", "http://fl.test", _store(17), transport=server, device_class=small) as runtime:
        with pytest.raises(OverBudget, match=r"makes tensor 'big' of 128 MB at a batch of shapes \[\('x', \(1, 64\)\)"):
            runtime.run_session()
        assert server.aborts == 1 and server.reports == 0
        assert runtime.run_session().outcome is Outcome.COMPLETED
    assert server.reports == 1


def test_a_graph_that_asks_for_more_memory_than_there_is_ends_in_the_sdks_error_and_the_app_goes_on(tmp_path):
    server = HostileServer([_huge_from_data(), digits_plan()])
    opstats = OpStatsStore(tmp_path / "app.db")
    with FLRuntime("digits", "http://fl.test", _store(), transport=server, opstats=opstats) as runtime:
        with pytest.raises(PlanError, match=r"the plan's 'work' graph failed at step 0: .*ConstantOfShape") as failed:
            runtime.run_session()
        assert isinstance(failed.value, RuntimeSdkError)  # what the scheduler records without a traceback
        assert server.aborts == 1
        assert runtime.run_session().outcome is Outcome.COMPLETED  # the next session, an honest plan
    assert [s.shape for s in opstats.sessions()] == ["-v[*", "-v[]+^"]


def test_a_step_that_never_ends_is_stopped_at_the_devices_training_time(tmp_path):
    server = HostileServer([_endless()])
    device = DeviceClass("small", max_training_s=0.3)
    with FLRuntime("digits", "http://fl.test", _store(), transport=server, device_class=device) as runtime:
        result = runtime.run_session()
    assert result.outcome is Outcome.INTERRUPTED and server.aborts == 1
    assert "over the device's training time (0.3 s" in result.events[-1].detail["reason"]


def _hoarding(trips: int):
    """A Loop of ``trips`` whose every trip keeps a 1 MB tensor (its scan output): memory that only
    the run tells, as a trip count computed from the examples would be."""
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["c"], ["c_out"]),
            helper.make_node("ConstantOfShape", ["chunk_shape"], ["chunk"], value=ONE),
        ],
        "hoard",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("chunk", TensorProto.FLOAT, [256, 1024]),
        ],
        [_ints([256, 1024], "chunk_shape")],
    )
    nodes = [
        helper.make_node("Loop", ["trips", "go"], ["chunks"], body=body),
        helper.make_node("ReduceSum", ["chunks"], ["extra"], keepdims=0),
    ]
    return _with_work(digits_plan(), nodes, [_ints(trips, "trips"), numpy_helper.from_array(np.array(True), "go")])


def test_a_step_that_takes_more_memory_than_the_device_has_is_stopped_and_its_session_dropped(tmp_path):
    """A step that kept 1 MB a trip for 1,000 trips (2 GB with the Loop's output) on a device of
    64 MB: no check before the run can size it, and the device gave it whatever the machine had
    (10^12 trips ended only at the machine's limit). It is stopped as it passes the device's
    memory, the server hears the abort, the plan's session (whose arena kept what the step took) is
    dropped, and an honest plan trains next."""
    server = HostileServer([_hoarding(1_000), digits_plan()])
    small = DeviceClass("small", memory_mb=64)
    with FLRuntime("digits", "http://fl.test", _store(), transport=server, device_class=small) as runtime:
        result = runtime.run_session()
        assert result.outcome is Outcome.INTERRUPTED and server.aborts == 1 and server.reports == 0
        assert result.events[-1].detail["reason"].startswith("over the device's memory (64 MB, memory_mb)")
        assert not runtime._plans and not runtime.loaded_plans._loaded  # its session's arena held 64 MB and more
        assert runtime.run_session().outcome is Outcome.COMPLETED  # the next session, an honest plan


#: Nodes of one run no forced stop reaches, whose time the device cannot bound: small here.
UNSTOPPABLE = {
    "NonMaxSuppression": (
        [
            helper.make_node("NonMaxSuppression", ["boxes", "scores", "most"], ["picked"]),
            helper.make_node("Cast", ["picked"], ["big"], to=TensorProto.FLOAT),
        ],
        [
            numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(1, 4, 4), "boxes"),
            numpy_helper.from_array(np.ones((1, 1, 4), np.float32), "scores"),
            _ints([4], "most"),
        ],
    ),
    "RoiAlign": (
        [
            helper.make_node("Reshape", ["x", "image"], ["images"]),
            helper.make_node("RoiAlign", ["images", "rois", "which"], ["big"], sampling_ratio=2),
        ],
        [
            _ints([-1, 1, 8, 8], "image"),
            numpy_helper.from_array(np.array([[0, 0, 7, 7]], np.float32), "rois"),
            _ints([0], "which"),
        ],
    ),
}


@pytest.mark.parametrize("op", sorted(UNSTOPPABLE))
def test_an_operator_whose_one_run_no_forced_stop_reaches_is_refused_when_the_plan_loads(op):
    """Each held a device past its training time in one node, where the forced stop, checked
    between nodes, does not reach: 4 million boxes (64 MB, made by a Range) some 10 hours in
    NonMaxSuppression, a RoiAlign of sampling ratio 100,000 some 16 minutes per output value."""
    nodes, initializers = UNSTOPPABLE[op]
    with pytest.raises(PlanError, match=rf"graph 'work' uses {op}, whose one run takes the square of"):
        load_plan(serialize_plan(_with_work(digits_plan(), _sum_of(*nodes), initializers)))


def _pooled(op: str, window: int):
    """``op`` over the batch as 8 x 8 images, of a ``window`` x ``window`` at stride 1, padded to it."""
    half = window // 2
    nodes = [
        helper.make_node("Reshape", ["x", "image"], ["images"]),
        helper.make_node(op, ["images"], ["big"], kernel_shape=[window, window], pads=[half, half, half, half]),
    ]
    return _with_work(digits_plan(), _sum_of(*nodes), [_ints([-1, 1, 8, 8], "image")])


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool", "LpPool"])
def test_a_pooling_window_that_reads_each_value_past_the_bound_is_refused_when_the_plan_loads(op):
    """A MaxPool of a 512 x 512 window at stride 1 over 1 MB ran 75 s in one node, where the forced
    stop does not reach (2,048 x 2,048 over 16 MB, at that pace, some 5 hours); 64 x 64 is the most."""
    with pytest.raises(
        PlanError,
        match=rf"graph 'work' uses a {op} of window 65 x 65 at strides 1 x 1, which reads each input value "
        r"about 4,225 times in one node, where no forced stop reaches .* a device takes at most 4,096",
    ):
        load_plan(serialize_plan(_pooled(op, 65)))
    load_plan(serialize_plan(_pooled(op, 64)))


def test_a_new_plan_per_session_leaves_at_most_the_cached_plans_loaded(tmp_path):
    """Every plan a runtime ran stayed loaded (its graphs and onnxruntime session): a server that
    sent a new plan per session grew the app's memory without end."""
    plans = [digits_plan(learning_rate=0.01 * (i + 1), epochs=1) for i in range(MAX_CACHED_PLANS + 3)]
    server = HostileServer(plans)
    with FLRuntime("digits", "http://fl.test", _store(8), transport=server, cache_dir=tmp_path / "cache") as runtime:
        for _ in plans:
            assert runtime.run_session().outcome is Outcome.COMPLETED
        assert len(runtime._plans) == len(runtime._executors) == MAX_CACHED_PLANS
        assert len(runtime.loaded_plans._loaded) == MAX_CACHED_PLANS
        assert len(list((tmp_path / "cache" / "plans").iterdir())) == MAX_CACHED_PLANS


def test_a_report_after_the_sessions_window_is_still_sent_within_its_own_time(tmp_path):
    """Past the report window no request of a session starts, but its last word: the report goes,
    late (the server counts it so, and its metrics), as an abort would."""
    import time

    server = HostileServer([digits_plan()], report_deadline_s=0.0)
    with FLRuntime("digits", "http://fl.test", _store(), transport=server, timeout_s=0.2) as runtime:
        result = runtime.run_session(before_report=lambda: time.sleep(0.3))  # past 0 s and one timeout
    assert result.outcome is Outcome.COMPLETED and server.reports == 1


def test_a_work_graph_loaded_again_at_another_batch_size_is_sized_at_that_batch():
    """The sizes found for a work graph are remembered by its bytes, for every plan that loads
    them (a fleet's devices each load their own): a plan of the same graph whose batch is one
    example is sized at that batch, 128 MB where the batch of 8 makes 16 MB."""
    plan = _sized_by_the_batch(32 << 20)
    one = dataclasses.replace(plan, device=dataclasses.replace(plan.device, batch_size=1))
    assert one.work == plan.work
    sized = [largest_work_tensor(load_plan(serialize_plan(p))) for p in (plan, one, plan)]
    assert sized == [("big", 16 << 20), ("big", 128 << 20), ("big", 16 << 20)]


def _sized_in_a_loop_by_the_data():
    """A Loop whose trips are the batch's largest pixel and whose body makes ``i * 10^12`` floats:
    nothing for a batch of zeros, 4 TB at the first batch whose pixels reach 2, a size no check
    before the step can know (it is the loop's counter, from the examples' values)."""
    state = [helper.make_tensor_value_info(n, t, []) for n, t in (("c", TensorProto.BOOL), ("v", TensorProto.FLOAT))]
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["c"], ["c_out"]),
            helper.make_node("Mul", ["i", "trillion"], ["how_many"]),
            helper.make_node("Reshape", ["how_many", "one_dim"], ["shape"]),
            helper.make_node("ConstantOfShape", ["shape"], ["big"], value=ONE),
            helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0),
            helper.make_node("Add", ["v", "total"], ["v_out"]),
        ],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), *state],
        [
            helper.make_tensor_value_info(n, t, [])
            for n, t in (("c_out", TensorProto.BOOL), ("v_out", TensorProto.FLOAT))
        ],
        [_ints(10**12, "trillion"), _ints([1], "one_dim")],
    )
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["peak"], keepdims=0),
        helper.make_node("Cast", ["peak"], ["trips"], to=TensorProto.INT64),
        helper.make_node("Loop", ["trips", "go", "zero"], ["extra"], body=body),
    ]
    initializers = [
        numpy_helper.from_array(np.array(True), "go"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
    ]
    return nodes, initializers


def test_a_size_from_the_data_inside_a_loop_ends_the_session_cleanly_after_steps_that_ran(tmp_path):
    """Three batches of zeros train, the fourth makes the loop's second trip allocate 4 TB: the step
    fails in the SDK's ``PlanError``, the server hears the abort, the session is recorded as an
    error, where it stopped reading is not kept (the next session of the task reads from the
    start), and the same runtime trains an honest plan next."""
    resuming = {"resume_examples": True, "shuffle_buffer": 0, "epochs": 1}
    hostile = _with_work(digits_plan(**resuming), *_sized_in_a_loop_by_the_data())
    assert load_plan(serialize_plan(hostile)) is not None  # nothing to refuse before it runs
    store = InMemoryExampleStore(clock=lambda: 100.0)
    x = np.zeros((40, 64), np.float32)
    x[24:] = 2.0
    store.add_columns(COLLECTION, {"x": x, "y": np.arange(40) % 10})
    server = HostileServer([hostile, digits_plan(**resuming)])
    opstats = OpStatsStore(tmp_path / "app.db")
    with FLRuntime("digits", "http://fl.test", store, transport=server, opstats=opstats) as runtime:
        with pytest.raises(PlanError, match=r"the plan's 'work' graph failed at step 3: .*no update was made"):
            runtime.run_session()
        assert server.aborts == 1 and server.reports == 0
        assert opstats.resumption_token("digits", "train", COLLECTION) is None
        honest = runtime.run_session()
    assert honest.outcome is Outcome.COMPLETED and honest.num_examples == 40
    assert next(e.detail["resume"] for e in honest.events if e.kind == "training_started") == "from_start"
    assert opstats.resumption_token("digits", "train", COLLECTION) is not None
    assert [s.shape for s in opstats.sessions()] == ["-v[*", "-v[]+^"]


def _serving_first(data: bytes, honest):
    """A HostileServer whose first session gets the plan ``data`` (bytes no Plan serializes to),
    with ``honest``'s weights, and every later one ``honest``."""
    server = HostileServer([honest, honest])
    server.plans[0] = data
    server.by_id[hashlib.sha256(data).hexdigest()] = data
    return server


HOSTILE_DEVICE_FIELDS = {
    # SeedSequence raised a ValueError at the first batch, not one of the SDK's errors
    "negative-seed": ({"shuffle_seed": -1}, "shuffle_seed must be >= 0 or null, got -1"),
    # onnx raised a ValueError pinning the batch into the graph's int64 dim
    "batch-past-int64": ({"batch_size": 10**30}, "batch_size 1,000,000,000,000,000,000,000,000,000,000 is past"),
    # the example store's InvalidResumptionTokenError reached the app
    "selector-token": (
        {"selector": {"collection_uri": COLLECTION, "resume_after": "garbage"}},
        r"names a resumption token \(resume_after\)",
    ),
    # SQLite's OverflowError when the store counted, float()'s when the plan loaded
    "selector-limit-past-int64": (
        {"selector": {"collection_uri": COLLECTION, "limit": 2**63}},
        "example selector is invalid: ExampleSelector.limit must be an int from 0 to 2",
    ),
    "selector-time-past-float": (
        {"selector": {"collection_uri": COLLECTION, "end_time": -(10**400)}},
        "example selector is invalid: ExampleSelector.end_time must be finite",
    ),
    # the examples were bound over the weights the checkpoint gave
    "examples-as-weights": ({"inputs": {"x": "x", "y": "y", "b0": "y"}}, "feeds examples to its weight 'b0'"),
}


@pytest.mark.parametrize("field", sorted(HOSTILE_DEVICE_FIELDS))
def test_hostile_device_fields_are_refused_when_the_plan_loads(field, tmp_path):
    from tests.device_runtime.test_resume_examples import _rewrite_device

    fields, words = HOSTILE_DEVICE_FIELDS[field]
    honest = digits_plan("mlp")
    data = _rewrite_device(serialize_plan(honest), **fields)
    with pytest.raises(PlanError, match=words):
        load_plan(data)
    server = _serving_first(data, honest)
    with FLRuntime("digits", "http://fl.test", _store(), transport=server, cache_dir=tmp_path) as runtime:
        with pytest.raises(CorruptResource, match=words):
            runtime.run_session()
        assert server.aborts == 1 and runtime.run_session().outcome is Outcome.COMPLETED


def _typed(name: str, kind: str):
    """The digits plan whose work graph takes or gives ``name`` as a ``kind`` other than a tensor."""
    plan = digits_plan()
    model = onnx.ModelProto.FromString(plan.work)
    element = helper.make_tensor_type_proto(TensorProto.FLOAT, None)
    made = {
        "sequence": lambda: helper.make_sequence_type_proto(element),
        "optional": lambda: helper.make_optional_type_proto(element),
    }[kind]()
    for value in (*model.graph.input, *model.graph.output):
        if value.name == name:
            value.type.CopyFrom(made)
    return dataclasses.replace(plan, work=model.SerializeToString())


@pytest.mark.parametrize("name", ["x", "w0", "loss_sum"])
@pytest.mark.parametrize("kind", ["sequence", "optional"])
def test_a_graph_that_takes_or_gives_other_than_tensors_is_refused_when_the_plan_loads(name, kind, tmp_path):
    """The checker passes a graph input or output of a sequence or optional type; the device read
    its dtype to feed it and failed with a KeyError, not one of the SDK's errors."""
    plan = _typed(name, kind)
    with pytest.raises(PlanError, match=rf"graph 'work' takes or gives '{name}' as a {kind}_type"):
        load_plan(serialize_plan(plan))
    server = _serving_first(serialize_plan(plan), digits_plan())
    with FLRuntime("digits", "http://fl.test", _store(), transport=server, cache_dir=tmp_path) as runtime:
        with pytest.raises(CorruptResource, match="a plan's graphs take and give tensors"):
            runtime.run_session()
        assert server.aborts == 1 and runtime.run_session().outcome is Outcome.COMPLETED


def _rewrite_header(data: bytes, **fields: object) -> bytes:
    """The plan ``data`` with its header's top-level ``fields`` changed, re-sealed."""
    import json

    from device_runtime.plan import _PREFIX, MAGIC

    _, version, header_len, total = _PREFIX.unpack_from(data, 0)
    header = json.loads(data[_PREFIX.size : _PREFIX.size + header_len])
    header.update(fields)
    header_bytes = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    body = data[_PREFIX.size + header_len : total - 32]
    content = _PREFIX.pack(MAGIC, version, len(header_bytes), _PREFIX.size + len(header_bytes) + len(body) + 32)
    content += header_bytes + body
    return content + hashlib.sha256(content).digest()


def test_a_plan_whose_weight_output_is_also_a_metric_is_refused_and_sends_nothing(tmp_path):
    """The metric's binding took the output, so the weight's buffer was never written: the device
    reported an update made of that buffer's uninitialized memory (the app's memory, to the server)."""
    honest = digits_plan()
    outputs = [honest.metric_names[0], *honest.weight_outputs[1:]]
    data = _rewrite_header(serialize_plan(honest), weight_outputs=outputs)
    with pytest.raises(PlanError, match="output 'loss_sum' is both a weight output and a metric"):
        load_plan(data)
    server = _serving_first(data, honest)
    with FLRuntime("digits", "http://fl.test", _store(), transport=server, cache_dir=tmp_path) as runtime:
        with pytest.raises(CorruptResource, match="is both a weight output and a metric"):
            runtime.run_session()
        assert server.reports == 0 and server.aborts == 1
        assert runtime.run_session().outcome is Outcome.COMPLETED


def _products_of_constants(n: int, chained: int):
    """A work graph that multiplies a constant n x n matrix by itself ``chained`` times."""
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["m0"], value=ONE)]
    nodes += [helper.make_node("MatMul", [f"m{i}", f"m{i}"], [f"m{i + 1}"]) for i in range(chained)]
    nodes.append(helper.make_node("ReduceSum", [f"m{chained}"], ["extra"], keepdims=0))
    return _with_work(digits_plan(), nodes, [_ints([n, n], "shape")])


def test_a_graph_of_constant_products_is_computed_in_its_steps_where_a_forced_stop_reaches(tmp_path):
    """onnxruntime's constant folding computed the products when the session was made, which the
    device's forced stop at its training time does not reach: 400 products of 2,000 x 2,000
    matrices kept it for minutes. The session's graph keeps them as steps, and the device's
    training time stops the first one."""
    from device_runtime.executor import make_session

    plan = _products_of_constants(4, 3)
    optimized = tmp_path / "optimized.onnx"
    make_session(plan.work, optimized_to=str(optimized))
    ran = onnx.load(str(optimized))
    assert sum(node.op_type == "MatMul" for node in ran.graph.node) == 3  # not folded into a constant
    server = HostileServer([_products_of_constants(2_000, 400), digits_plan()])
    device = DeviceClass("small", max_training_s=0.3)
    with FLRuntime("digits", "http://fl.test", _store(), transport=server, device_class=device) as runtime:
        result = runtime.run_session()
        assert result.outcome is Outcome.INTERRUPTED and server.aborts == 1
        assert "over the device's training time (0.3 s" in result.events[-1].detail["reason"]
        assert runtime.run_session().outcome is Outcome.COMPLETED


def test_a_graph_whose_constant_folding_crashed_onnxruntime_makes_a_session():
    """The Loop the dynamo exporter writes for nn.EmbeddingBag: onnxruntime's constant folding ends
    the process in a segmentation fault when it makes a session of it (the app, for a plan whose
    graph holds it); the device's sessions fold no constants. Made in a process of its own, which
    the fault would end."""
    import subprocess
    import sys
    from pathlib import Path

    graph = Path(__file__).parents[1] / "emulator" / "toolchain" / "data" / "embedding_bag.onnx"
    code = "import sys; from device_runtime.executor import make_session; make_session(open(sys.argv[1], 'rb').read())"
    made = subprocess.run([sys.executable, "-c", code, str(graph)], capture_output=True, timeout=60)
    assert made.returncode == 0, made.stderr.decode()[-500:]
