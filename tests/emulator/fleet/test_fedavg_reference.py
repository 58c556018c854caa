"""The model a simulated fleet commits, round after round, against FedAvg written here in numpy: the
same initial model, the devices each round accepted (read from the run's own sessions.csv), each
one's examples, local SGD over shuffled mini-batches for two epochs, the updates weighted by the
devices' example counts, and for FedAdam the server optimizer of Reddi et al. (2021) over the rounds.
Faults stay on: drop-outs and late reports are in the rows, and only accepted reports count."""

from __future__ import annotations

import json

import numpy as np
import pytest

from device_runtime.checkpoint import decode_checkpoint
from emulator.fleet import FleetConfig, simulate
from emulator.fleet.population import generate_population
from emulator.fleet.tables import RoundRow, SessionRow
from server_stub import FLService, ServerStore

LR, EPOCHS, BATCH, SHUFFLE_SEED = 0.05, 2, 8, 0
WEIGHTS = ("w0", "b0", "w1", "b1")

MLP_TASK = f"""
from device_runtime import build_mlp_plan
from emulator.datasets import load_digits_dataset
from emulator.toolchain.tasks import ProxyData, Task
from example_store import ExampleSelector

SELECTOR = ExampleSelector("app:/examples")


def proxy():
    d = load_digits_dataset(test_fraction=0.2, seed=0)
    return ProxyData.split({{"x": d.x_test, "y": d.y_test}}, devices=2, seed=0)


task = Task(
    name="reference_mlp",
    model=lambda hp: build_mlp_plan(64, (16,), 10, learning_rate={LR}, batch_size={BATCH}, epochs={EPOCHS},
                                    selector=SELECTOR, shuffle_seed={SHUFFLE_SEED}),
    proxy=proxy, selector=SELECTOR, batch_size={BATCH}, epochs={EPOCHS},
)
"""

ONNX_FEDADAM_TASK = f"""
import numpy as np
from onnx import TensorProto, helper, numpy_helper
from emulator.datasets import load_digits_dataset
from emulator.toolchain import FedAdam
from emulator.toolchain.tasks import ProxyData, Task
from example_store import ExampleSelector

SELECTOR = ExampleSelector("app:/examples")


def model():
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array((0.1 * rng.standard_normal([64, 16])).astype(np.float32), "w0"),
             numpy_helper.from_array(np.zeros(16, np.float32), "b0"),
             numpy_helper.from_array((0.1 * rng.standard_normal([16, 10])).astype(np.float32), "w1"),
             numpy_helper.from_array(np.zeros(10, np.float32), "b1")]
    nodes = [helper.make_node("Gemm", ["x", "w0", "b0"], ["z0"]), helper.make_node("Relu", ["z0"], ["a0"]),
             helper.make_node("Gemm", ["a0", "w1", "b1"], ["logits"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10).SerializeToString()


def proxy():
    d = load_digits_dataset(test_fraction=0.2, seed=0)
    return ProxyData.split({{"x": d.x_test, "y": d.y_test}}, devices=2, seed=0)


task = Task(name="reference_adam", model=model(), proxy=proxy, hyperparameters={{"lr": {LR}}}, selector=SELECTOR,
            batch_size={BATCH}, epochs={EPOCHS}, server_optimizer=FedAdam(lr=0.05))
"""


def _local_sgd(w: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """One device's session: EPOCHS passes of mean cross-entropy SGD over batches of BATCH, each
    epoch's order the documented shuffle of the plan's seed and the epoch."""
    for epoch in range(EPOCHS):
        order = np.random.default_rng([SHUFFLE_SEED, epoch]).permutation(len(y))
        for i in range(0, len(y), BATCH):
            xb, yb = x[order[i : i + BATCH]], y[order[i : i + BATCH]]
            z0 = xb @ w["w0"] + w["b0"]
            a0 = np.maximum(z0, 0.0)
            z1 = a0 @ w["w1"] + w["b1"]
            p = np.exp(z1 - z1.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            g = (p - np.eye(10)[yb]) / len(yb)
            dz = (g @ w["w1"].T) * (z0 > 0)
            w = {
                "w0": w["w0"] - LR * (xb.T @ dz),
                "b0": w["b0"] - LR * dz.sum(0),
                "w1": w["w1"] - LR * (a0.T @ g),
                "b1": w["b1"] - LR * g.sum(0),
            }
    return w


class _FedAdam:
    """Reddi et al.'s FedAdam over the rounds' mean updates (lr 0.05, beta1 0.9, beta2 0.99, tau 1e-3)."""

    def __init__(self) -> None:
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}

    def __call__(self, w: dict[str, np.ndarray], delta: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for k, d in delta.items():
            self.m[k] = 0.9 * self.m.get(k, 0.0) + 0.1 * d
            self.v[k] = 0.99 * self.v.get(k, 0.0) + 0.01 * d * d
            out[k] = w[k] + 0.05 * self.m[k] / (np.sqrt(self.v[k]) + 1e-3)
        return out


def _attempt(session: SessionRow, rounds: list[RoundRow]) -> RoundRow | None:
    """The attempt of its round a session took part in: a session names its round without the
    attempt, and attempts follow each other, so the last one that had opened when the device checked
    in, or the first when none had (its check-in was on the wire as the round opened)."""
    attempts = [r for r in rounds if r.round_id.rsplit("/", 1)[0] == session.round_id]
    opened = [r for r in attempts if r.start_s <= session.start_s]
    return opened[-1] if opened else (attempts[0] if attempts else None)


@pytest.mark.parametrize("server", ["fedavg", "fedadam"])
def test_each_committed_model_is_the_example_weighted_average_of_its_accepted_devices_training(tmp_path, server):
    task_file = tmp_path / "task.py"
    task_file.write_text(MLP_TASK if server == "fedavg" else ONNX_FEDADAM_TASK, encoding="utf-8")
    config = FleetConfig.from_dict(
        {
            "fleet": {"devices": 60, "hours": 1.0, "start_utc_hour": 6.0, "seed": 0},
            "task": {
                "file": str(task_file),
                "goal_count": 7,
                "report_timeout_s": 600.0,
                "retry_min_s": 60.0,
                "retry_max_s": 300.0,
                "compute_s_per_example": 0.05,
            },
            # 15 clients for 60 devices: each client's examples are trained by about four devices
            "data": {"format": "digits", "options": {"partition": "dirichlet", "alpha": 0.5, "clients": 15}},
        }
    )
    out = tmp_path / "run"
    run = simulate(config, out_dir=out, progress=False)
    sessions = SessionRow.from_csv(out / "sessions.csv")
    rounds = RoundRow.from_csv(out / "rounds.csv")
    assert json.loads((out / "summary.json").read_text())["devices_per_client"] == 4.0
    assert any(s.shape.endswith("#") for s in sessions)  # late reports happened, and are not in the models

    from emulator.fleet.workload import load_workload

    workload = load_workload(config)
    specs = {s.device_id: s for s in generate_population(config)}
    store = ServerStore(out / "server" / "server.db")
    try:
        records = FLService(store).rounds(config.task.population)
        initial = decode_checkpoint(workload.training[0].build.checkpoint)
        w = {k: initial[k].astype(np.float64) for k in WEIGHTS}
        adam = _FedAdam()
        checked, devices_seen, weighting_shows = 0, [], False
        for record, row in zip(records, rounds, strict=True):
            assert row.round_id == f"{record['task']}/{record['round']}/{record['attempt']}"
            if record["status"] != "committed":
                continue
            accepted = [s for s in sessions if s.shape.endswith("^") and _attempt(s, rounds) is row]
            assert len(accepted) == row.accepted >= 7
            total, summed, plain = 0, {k: 0.0 for k in WEIGHTS}, {k: 0.0 for k in WEIGHTS}
            for s in accepted:
                examples = workload.device_examples(specs[s.device_id])["app:/examples"]
                x, y = examples["x"].astype(np.float64), examples["y"].astype(np.int64)
                assert len(y) == s.examples
                trained = _local_sgd(w, x, y)
                for k in WEIGHTS:
                    summed[k] = summed[k] + (trained[k] - w[k]) * len(y)
                    plain[k] = plain[k] + (trained[k] - w[k]) / len(accepted)
                total += len(y)
                devices_seen.append(examples["y"].tobytes() + examples["x"].tobytes())
            mean = {k: summed[k] / total for k in WEIGHTS}
            unweighted = {k: w[k] + plain[k] for k in WEIGHTS}
            w = {k: w[k] + mean[k] for k in WEIGHTS} if server == "fedavg" else adam(w, mean)
            committed = decode_checkpoint(store.get_resource(record["checkpoint_id"]))
            for k in WEIGHTS:
                np.testing.assert_allclose(committed[k], w[k], rtol=0, atol=2e-6, err_msg=f"{row.round_id} {k}")
            if server == "fedavg":
                weighting_shows |= max(float(np.abs(unweighted[k] - w[k]).max()) for k in WEIGHTS) > 1e-3
            checked += 1
    finally:
        store.close()
    assert checked >= 3 and checked == sum(r.committed for r in run.rounds)
    assert len(set(devices_seen)) < len(devices_seen)  # a client's examples trained by more than one device
    assert weighting_shows or server != "fedavg"  # the check tells weighted from unweighted averaging
