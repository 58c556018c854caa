"""A plan's cost on a device (``emulator.fleet.plan_cost``) and the fleet that follows it: FLOPs
counted from the work graph match hand counts, a bigger model's sessions last longer and move more
bytes, devices whose memory cannot hold the plan take no part and are counted, and the same seed
still gives the same run."""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from device_runtime import PlanExecutor, build_mlp_plan, encode_checkpoint, initial_weights
from device_runtime.batching import examples_share
from device_runtime.memory import SESSION_BYTES, training_peak
from emulator.fleet import FleetConfig, FleetRun, device_examples, generate_population, simulate
from emulator.fleet.config import REFERENCE_FLOPS_PER_S
from emulator.fleet.plan_cost import graph_flops, plan_cost
from emulator.fleet.ray_backend import simulate_sharded
from emulator.toolchain import SGD, Momentum, evaluation_plan_from_onnx, onnx_training_plan
from emulator.toolchain.onnx_import import trainable_table
from example_store import ExampleSelector
from tests.emulator.toolchain.models import model as toolchain_model

#: The module's fleets are built once per run: its tests go to one pytest-xdist worker, and its fixtures
#: are session-scoped, so that no test run between two of them makes the worker build them again.
pytestmark = pytest.mark.xdist_group("test_plan_cost")

ROOT = Path(__file__).resolve().parents[3]


def mlp(hidden: tuple[int, ...], batch_size: int = 8, **kwargs: object):
    return build_mlp_plan(
        64,
        hidden,
        10,
        learning_rate=0.3,
        batch_size=batch_size,
        epochs=2,
        selector=ExampleSelector("app:/examples"),
        inputs={"x": "x", "y": "y"},
        shuffle_seed=0,
        name="mlp",
        **kwargs,
    )


def mlp_gemm_flops(sizes: list[int], batch: int) -> int:
    """By hand: each layer's forward Gemm (2 B in out, plus its bias) and weight-gradient Gemm
    (2 in B out, plus the old weight it updates), and for every layer but the first the Gemm that
    takes the gradient back to its input (2 B out in)."""
    total = 0
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
        total += 2 * batch * n_in * n_out + batch * n_out  # forward
        total += 2 * n_in * batch * n_out + n_in * n_out  # weight gradient and SGD step
        if i > 0:
            total += 2 * batch * n_out * n_in  # gradient to the layer's input
    return total


@pytest.mark.parametrize("hidden, batch", [((32,), 8), ((7, 5), 3), ((1024,), 16)])
def test_the_flops_of_an_mlp_plan_are_its_hand_count(hidden, batch):
    cost = plan_cost(mlp(hidden, batch))
    assert cost.flops_by_op["Gemm"] == mlp_gemm_flops([64, *hidden, 10], batch)
    assert cost.flops_per_batch == sum(cost.flops_by_op.values()) < 1.1 * cost.flops_by_op["Gemm"]
    assert cost.flops_per_example == cost.flops_per_batch / batch
    assert cost.unresolved == ()


def test_the_flops_of_a_conv_plan_are_its_hand_count():
    """The digits CNN (examples/tasks): Conv 4x1x3x3 on 8x8 images, MaxPool 2, Gemm 36 -> 10.
    Its training plan's Convs are the forward one and the weight gradient (input and output
    gradient with batch and channels swapped): each 2 x (B x 4 x 6 x 6) x 9 multiply-adds."""
    task = runpy.run_path(str(ROOT / "examples" / "tasks" / "digits_cnn_task.py"))["task"]
    plan = task.build_plan()
    batch = plan.device.batch_size
    cost = plan_cost(plan)
    conv_out = batch * 4 * 6 * 6
    assert cost.flops_by_op["Conv"] == 2 * conv_out * 9 + conv_out + 2 * conv_out * 9
    assert (
        cost.flops_by_op["Gemm"] == mlp_gemm_flops([36, 10], batch) + 2 * batch * 10 * 36
    )  # and the gradient to the Conv
    assert cost.parameters == 4 * 9 + 4 + 36 * 10 + 10
    assert cost.unresolved == ()


def test_every_export_of_one_model_counts_the_same_multiply_adds():
    """A GRU next-token model as torch's classic exporter, the dynamo exporter and the dynamo
    exporter without its optimizer write it: their graphs differ (the unoptimized one computes
    hundreds of shapes from data, which ONNX shape inference leaves open and one run on zeros
    settles), their training plans' multiply-adds do not."""
    from emulator.toolchain.tasks import onnx_import
    from tests.emulator.toolchain.test_exported_models import MANIFEST, task_for

    heavy = {}
    for exporter in ("classic", "dynamo", "dynamo_noopt"):
        entry = next(e for e in MANIFEST["fixtures"] if e["model"] == f"gru_next_token.perturbed.{exporter}.onnx.gz")
        task = task_for(entry)
        cost = plan_cost(onnx_import(task._model_source(), task).plan)
        assert cost.unresolved == ()
        heavy[exporter] = sum(n for op, n in cost.flops_by_op.items() if op in ("MatMul", "Gemm"))
    assert heavy["classic"] == heavy["dynamo"] == heavy["dynamo_noopt"] > 0


def _one_node(op: str, inputs: dict[str, list[int]], output: list[int], **attrs: object) -> dict[str, int]:
    graph = helper.make_graph(
        [helper.make_node(op, list(inputs), ["out"], **attrs)],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, output)],
    )
    shapes = {**{n: tuple(s) for n, s in inputs.items()}, "out": tuple(output)}
    flops, unresolved = graph_flops(graph, shapes)
    assert unresolved == []
    return dict(flops)


def test_the_flops_of_batched_matmul_conv_transpose_einsum_and_lstm_are_their_hand_counts():
    assert _one_node("MatMul", {"a": [5, 2, 3], "b": [5, 3, 4]}, [5, 2, 4]) == {"MatMul": 2 * 5 * 2 * 4 * 3}
    # ConvTranspose: every input element spreads over out-channels-per-group x kernel outputs
    assert _one_node("ConvTranspose", {"x": [2, 3, 4, 4], "w": [3, 6, 2, 2]}, [2, 6, 5, 5]) == {
        "ConvTranspose": 2 * (2 * 3 * 4 * 4) * (6 * 2 * 2)
    }
    assert _one_node("Einsum", {"a": [2, 3, 4], "b": [2, 4, 5]}, [2, 3, 5], equation="bij,bjk->bik") == {
        "Einsum": 2 * 2 * 3 * 4 * 5
    }
    # LSTM: 7 steps, batch 2, input 3, hidden 4: four gates of W (16x3) and R (16x4) per step
    assert _one_node("LSTM", {"x": [7, 2, 3], "w": [1, 16, 3], "r": [1, 16, 4]}, [7, 1, 2, 4], hidden_size=4) == {
        "LSTM": 2 * 7 * 2 * (16 * 3 + 16 * 4)
    }
    assert _one_node("Relu", {"x": [3, 5]}, [3, 5]) == {"Relu": 15}
    assert _one_node("Reshape", {"x": [3, 5], "s": [2]}, [15]) == {}


def _conv_batch_norm_model():
    """A CNN with a BatchNorm (the kind ``plan from-torch`` exports): Conv 4x1x3x3 on 8x8 images,
    BatchNormalization over its 4 channels, Flatten, MatMul 144 -> 10."""
    rng = np.random.default_rng(0)
    inits = {
        "conv": rng.normal(0, 0.3, (4, 1, 3, 3)).astype(np.float32),
        "scale": np.ones(4, np.float32),
        "bias": np.zeros(4, np.float32),
        "running_mean": np.zeros(4, np.float32),
        "running_var": np.ones(4, np.float32),
        "fc": rng.normal(0, 0.1, (144, 10)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "conv"], ["c"]),
        helper.make_node("BatchNormalization", ["c", "scale", "bias", "running_mean", "running_var"], ["bn"]),
        helper.make_node("Relu", ["bn"], ["r"]),
        helper.make_node("Flatten", ["r"], ["flat"]),
        helper.make_node("MatMul", ["flat", "fc"], ["y"]),
    ]
    return toolchain_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])],
        inits,
    )


@pytest.mark.parametrize("optimizer", [SGD(0.1), Momentum(0.1)])
def test_the_parameters_are_the_trained_ones_the_toolchain_prints_and_the_rest_of_the_checkpoint_apart(optimizer):
    """A plan of a model with a BatchNorm: ``parameters`` is what the toolchain trains and prints
    (its "N parameters"), of the training and the evaluation plan alike; the running statistics
    and the optimizer's state are ``untrained_values``. The running statistics were counted as
    parameters: 1,506 in the summary where ``plan from-torch`` had printed 1,498."""
    source = _conv_batch_norm_model()
    options = dict(label="y", loss="cross_entropy", batch_size=8, example_selector=ExampleSelector("app:/examples"))
    made = onnx_training_plan(source, optimizer=optimizer, **options)
    plan = made.plan
    assert made.trainable == {"conv": (4, 1, 3, 3), "scale": (4,), "bias": (4,), "fc": (144, 10)}
    printed = trainable_table(made.trainable)[-1]  # what from-torch and from-onnx print of it
    cost = plan_cost(plan)
    assert printed.endswith(f"{cost.parameters:,} parameters") and cost.parameters == 36 + 4 + 4 + 1440
    momentum = cost.parameters if isinstance(optimizer, Momentum) else 0
    assert cost.untrained_values == 4 + 4 + momentum
    assert cost.summary()["parameters"] == cost.parameters
    assert cost.summary()["untrained_values"] == cost.untrained_values
    weights = PlanExecutor(plan).weight_spec()
    assert cost.parameters + cost.untrained_values == sum(int(np.prod(s)) for s, _ in weights.values())
    evaluation = plan_cost(evaluation_plan_from_onnx(source, training_plan=plan, **options))
    assert (evaluation.parameters, evaluation.untrained_values) == (cost.parameters, cost.untrained_values)


def test_memory_is_the_device_runtime_s_own_estimate_at_least_the_declared_budget():
    """The fleet seats a device by the estimate the device refuses a plan by
    (``device_runtime.memory.training_peak``); before, an upper bound held every intermediate value
    of a step at once, and the fleet left out devices that ran the plan."""
    plan = mlp((32,))
    cost = plan_cost(plan)
    assert cost.parameters == 64 * 32 + 32 + 32 * 10 + 10
    assert cost.state_bytes == 4 * cost.parameters
    assert cost.batch_bytes == 8 * 64 * 4 + 8 * 8  # x float32, y int64
    assert cost.activation_bytes > 8 * (32 + 10) * 4  # at least the forward activations
    assert cost.memory_mb == training_peak(plan).peak_mb
    assert cost.fits(cost.memory_mb) and not cost.fits(cost.memory_mb * 0.99)
    assert plan_cost(mlp((32,), memory_budget_mb=300)).memory_mb == 300.0
    session = SESSION_BYTES / 2**20  # onnxruntime's own, whatever the plan
    assert plan_cost(mlp((1024,))).memory_mb - session > 10 * (cost.memory_mb - session)


def test_the_bytes_are_the_real_plan_checkpoint_and_update():
    from device_runtime.plan import serialize_plan

    plan = mlp((16,))
    cost = plan_cost(plan)
    weights = initial_weights(plan, seed=3)
    rng = np.random.default_rng(0)
    batches = [{"x": rng.random((8, 64), dtype=np.float32), "y": rng.integers(0, 10, 8)}]
    update = PlanExecutor(plan).run_device(weights, lambda: batches).update
    assert cost.plan_bytes == len(serialize_plan(plan))
    assert cost.checkpoint_bytes == len(encode_checkpoint(weights))
    assert cost.update_bytes == len(encode_checkpoint(update))


def test_the_cost_is_a_function_of_the_plan_alone():
    assert plan_cost(mlp((48, 16))) == plan_cost(mlp((48, 16)))


def test_the_default_rate_gives_the_default_digits_mlp_one_second_per_example():
    """The calibration: the default fleet's plan (64-32-10, batch 8) costs exactly what
    ``compute_s_per_example = 1.0`` did, so default runs are unchanged."""
    task = FleetConfig.default().task
    assert task.compute_s_per_example is None
    plan = mlp(tuple(task.hidden), task.batch_size)
    assert plan_cost(plan).compute_s_per_example(task.reference_flops_per_s) == 1.0
    assert task.reference_flops_per_s == REFERENCE_FLOPS_PER_S


# ----------------------------------------------------------------------------- the fleet

SMALL = {"devices": 40, "hours": 1.0, "start_utc_hour": 6.0}


def fleet(
    seed: int = 1, classes: list[dict] | None = None, fleet_extra: dict | None = None, **task: object
) -> FleetConfig:
    data = FleetConfig.default().model_dump()
    data["task"] = {k: v for k, v in data["task"].items() if v is not None}
    data["fleet"].update(SMALL, seed=seed, **(fleet_extra or {}))
    data["task"].update({"goal_count": 8, "retry_min_s": 60.0, "retry_max_s": 300.0, **task})
    if classes is not None:
        data["device_classes"] = classes
    return FleetConfig.from_dict(data)


@pytest.fixture(scope="session")
def by_hidden() -> dict[int, FleetRun]:
    # an hour's report window: the devices train up to an hour (the big model's session, about 40
    # minutes, would be stopped at the default 600 s of max_training_s)
    return {h: simulate(fleet(hidden=[h], report_timeout_s=3600.0), progress=False) for h in (32, 1024)}


def _trained(run: FleetRun) -> list:
    return [s for s in run.sessions if s.examples > 0]


def test_a_bigger_plan_gives_longer_sessions_in_proportion_to_its_flops(by_hidden):
    small, big = by_hidden[32], by_hidden[1024]
    ratio = big.plan_cost["flops_per_example"] / small.plan_cost["flops_per_example"]
    assert ratio > 25
    assert big.plan_cost["compute_s_per_example"] == pytest.approx(ratio * small.plan_cost["compute_s_per_example"])
    config = small.config
    specs = {s.device_id: s for s in generate_population(config)}
    for run in (small, big):
        per_example = run.plan_cost["compute_s_per_example"] * config.task.epochs
        trained = _trained(run)
        assert trained
        for s in trained:
            spec = specs[s.device_id]
            assert s.compute_s == pytest.approx(s.examples * per_example * spec.speed, rel=1e-6)
            assert s.examples == len(device_examples(config, spec)[1])
    # per example on the reference phone (the big model's sessions that end in time are the faster devices')
    mean = {
        h: np.mean([s.compute_s / s.examples / specs[s.device_id].speed for s in _trained(r)])
        for h, r in by_hidden.items()
    }
    assert mean[1024] > 25 * mean[32]


def test_a_bigger_plan_sends_and_receives_more_bytes(by_hidden):
    small, big = by_hidden[32], by_hidden[1024]
    assert big.plan_cost["checkpoint_bytes"] > 25 * small.plan_cost["checkpoint_bytes"]
    for run in (small, big):
        accepted = [s for s in run.sessions if s.accepted and s.bytes_down > 0]
        assert accepted
        # every accepted session downloaded the model; every upload carried a whole update
        assert all(s.bytes_down > run.plan_cost["checkpoint_bytes"] for s in accepted)
        assert all(s.bytes_up > run.plan_cost["update_bytes"] for s in run.sessions if s.shape.endswith(("^", "#")))
    down = {h: np.median([s.bytes_down for s in r.sessions if s.accepted]) for h, r in by_hidden.items()}
    assert down[1024] > 10 * down[32]
    assert big.summary()["plan_cost"]["parameters"] == 64 * 1024 + 1024 + 1024 * 10 + 10


SHORT = [
    {"name": "tiny", "share": 0.3, "speed": 1.0, "memory_mb": 1},
    {"name": "mid", "share": 0.7, "speed": 1.0, "memory_mb": 4096},
]


@pytest.fixture(scope="session")
def short_of_memory() -> FleetRun:
    # hidden [2048]: a plan of about 1.6 MB, more than the tiny class's 1 MB
    return simulate(
        fleet(seed=2, classes=SHORT, fleet_extra={"min_memory_mb": 1}, hidden=[2048], compute_s_per_example=0.2),
        progress=False,
    )


def test_a_device_class_whose_memory_cannot_hold_the_plan_takes_no_part_and_is_counted(short_of_memory):
    run = short_of_memory
    assert run.plan_cost["memory_mb"] > 1
    tiny = [s.device_id for s in generate_population(run.config) if s.device_class == "tiny"]
    assert tiny
    assert run.devices_short_of_memory == len(tiny)
    assert run.summary()["devices_short_of_memory"] == len(tiny)
    assert not [s for s in run.sessions if s.device_class == "tiny"]
    assert [s for s in run.sessions if s.device_class == "mid" and s.shape.endswith("^")]
    # the timeline counts only the devices that take part
    assert max(row.available for row in run.timeline) <= SMALL["devices"] - len(tiny)


def test_the_sharded_run_leaves_out_the_same_devices(short_of_memory):
    sharded = simulate_sharded(short_of_memory.config, shards=2, ray=False)
    assert sharded.digest == short_of_memory.digest
    assert sharded.timeline == short_of_memory.timeline
    assert sharded.devices_short_of_memory == short_of_memory.devices_short_of_memory


def test_a_device_class_that_holds_the_plan_but_not_one_batch_of_it_takes_no_part_and_is_counted():
    """A device refuses a plan whose one batch takes more than an eighth of its memory (OverBudget
    at load, ``device_runtime.batching.examples_share``): batches of 1,000 digits (264,000 bytes as
    the device counts them) of a hidden layer of 4 fit the tiny class's 2 MB peak (1.4 MB) but not
    its 256 KiB for examples, so its devices are counted short of memory, as the device would refuse
    them, and none is seated to fail."""
    classes = [{**SHORT[0], "memory_mb": 2}, SHORT[1]]
    config = fleet(seed=2, classes=classes, fleet_extra={"min_memory_mb": 1}, batch_size=1000, hidden=[4])
    cost = plan_cost(mlp((4,), batch_size=1000))
    assert cost.memory_mb < 2 and cost.fed_batch_bytes == 1000 * (64 * 4 + 8) > examples_share(2)
    assert not cost.fits(2) and cost.fits(4096) and cost.least_memory_mb == 1000 * 264 * 8 / 2**20
    run = _tiny_left_out(config)
    assert [s for s in run.sessions if s.device_class == "mid" and s.shape.endswith("^")]


def _tiny_left_out(config: FleetConfig) -> FleetRun:
    """The run of ``config``, held to having counted every device of its "tiny" class short of
    memory, seated none of them, and met no error."""
    run = simulate(config, progress=False)
    tiny = [s.device_id for s in generate_population(config) if s.device_class == "tiny"]
    assert tiny and run.devices_short_of_memory == len(tiny)
    assert run.summary()["devices_short_of_memory"] == len(tiny)
    assert not [s for s in run.sessions if s.device_class == "tiny"]
    assert run.errors == {}
    return run


def test_a_fleet_none_of_whose_classes_holds_one_batch_is_refused_saying_so():
    from emulator.fleet.events import SimulationError

    tiny = [{"name": "tiny", "share": 1.0, "speed": 1.0, "memory_mb": 1}]
    with pytest.raises(SimulationError, match=r"needs 1\.2\d* MB \(one batch of 600 examples takes 0\.151\d* MB"):
        simulate(fleet(classes=tiny, fleet_extra={"min_memory_mb": 1}, batch_size=600, hidden=[4]), progress=False)


def test_the_same_seed_gives_the_same_digest_with_the_plans_cost(by_hidden):
    again = simulate(fleet(hidden=[1024], report_timeout_s=3600.0), progress=False)
    assert again.digest == by_hidden[1024].digest
    assert again.sessions == by_hidden[1024].sessions


def test_a_fleet_none_of_whose_classes_can_hold_the_plan_is_refused_before_it_starts():
    from emulator.fleet.events import SimulationError

    tiny = [{"name": "tiny", "share": 1.0, "speed": 1.0, "memory_mb": 1}]
    with pytest.raises(SimulationError, match=r"no device class can hold the plan: it needs 2\.\d+ MB .* at most 1 MB"):
        simulate(fleet(classes=tiny, fleet_extra={"min_memory_mb": 1}, hidden=[2048]), progress=False)


EVAL_TASK = """
import runpy

from emulator.toolchain.tasks import evaluation_of
from example_store import ExampleSelector

task = runpy.run_path(TASK_FILE)["task"]
# batches of 600 digits: 158,400 bytes as a device counts them, more than a 1 MB device's 128 KiB
evaluation = evaluation_of(task, selector=ExampleSelector("app:/digits_heldout"), batch_size=600)
tasks = [task, evaluation]
"""


def eval_fleet(tmp_path: Path, classes: list[dict]) -> FleetConfig:
    """A small fleet of the digits MLP (batches of 16) and an evaluation of it in batches of 600."""
    task_file = Path(__file__).resolve().parents[3] / "examples" / "tasks" / "digits_task.py"
    (tmp_path / "eval_task.py").write_text(EVAL_TASK.replace("TASK_FILE", repr(str(task_file))), encoding="utf-8")
    return FleetConfig.from_dict(
        {
            "fleet": {"devices": 40, "hours": 1.0, "seed": 2, "start_utc_hour": 6.0, "min_memory_mb": 1},
            "task": {"file": str(tmp_path / "eval_task.py"), "goal_count": 6, "compute_s_per_example": 0.2},
            "data": {"format": "digits", "options": {"partition": "dirichlet", "alpha": 0.5, "clients": 30}},
            "device_classes": classes,
        }
    )


def test_a_device_class_that_holds_the_training_plan_but_not_the_evaluation_plan_takes_no_part(tmp_path):
    """A device checks every plan it is served at load (OverBudget): a class that holds the
    training plan but not the evaluation task's would be seated for evaluation rounds only to fail
    each one, so it is counted short of memory and takes no part, as a class short of the training
    plan's memory is."""
    from emulator.fleet.simulator import served_costs
    from emulator.fleet.workload import load_workload

    config = eval_fleet(tmp_path, SHORT)
    costs = served_costs(load_workload(config))
    assert costs["digits_mlp"].fits(1) and not costs["digits_mlp_eval"].fits(1) and costs["digits_mlp_eval"].fits(4096)
    run = _tiny_left_out(config)
    assert [s for s in run.sessions if s.task == "digits_mlp_eval" and s.shape.endswith("^")]


def test_a_fleet_none_of_whose_classes_holds_the_evaluation_plan_is_refused_naming_its_task(tmp_path):
    from emulator.fleet.events import SimulationError

    tiny = [{"name": "tiny", "share": 1.0, "speed": 1.0, "memory_mb": 1}]
    with pytest.raises(SimulationError, match=r"no device class can hold the plan of task 'digits_mlp_eval': it needs"):
        simulate(eval_fleet(tmp_path, tiny), progress=False)
