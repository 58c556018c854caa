"""FedAvg over a federated dataset's clients with a task's own plan: the device part of each
session in onnxruntime as a device runs it, the aggregation by the plan's server part, what
``plan test``'s simulated rounds do, but over the dataset's clients instead of the proxy shards."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from device_runtime.executor import PlanExecutor
from emulator.fleet.federated_data import FederatedDataset
from emulator.releases.workers import RuntimeWorker, WorkerExecutor
from emulator.toolchain.tasks import Task


def test_accuracy(executor: WorkerExecutor, model: Mapping[str, np.ndarray], data: FederatedDataset) -> float:
    """The model's accuracy over every test example of ``data`` (pooled over the clients)."""
    correct = count = 0.0
    for examples in data.test.values():
        out = executor.worker.run(executor.plan.work, {**model, **executor.feeds(examples)}, ["correct", "count"])
        correct, count = correct + float(out["correct"]), count + float(out["count"])
    return correct / count


def fedavg(task: Task, data: FederatedDataset, *, rounds: int, clients_per_round: int, seed: int = 0) -> list[float]:
    """Test accuracy before the first round and after each of ``rounds`` rounds of
    ``clients_per_round`` clients drawn (seeded) from ``data``'s training clients."""
    plan = task.build_plan()
    state = {k: np.asarray(v, dtype=np.float32) for k, v in task.weights(plan).items()}
    server = PlanExecutor(plan)
    rng = np.random.default_rng(seed)
    ids = list(data.client_ids)
    with RuntimeWorker.host() as worker:
        executor = WorkerExecutor(plan, worker)
        model = {w: state[w] for w in plan.weight_names}
        accuracies = [test_accuracy(executor, model, data)]
        for _ in range(rounds):
            acc = server.zero()
            for client in rng.choice(len(ids), size=clients_per_round, replace=False):
                shard = data.train[ids[client]]
                result = executor.run_device(model, executor.batches_from_examples(lambda s=shard: [s]))
                acc = server.accumulate(acc, result.update)
            state, _ = server.update(state, server.report(acc))
            state = {k: np.asarray(v, dtype=np.float32) for k, v in state.items()}
            model = {w: state[w] for w in plan.weight_names}
            accuracies.append(test_accuracy(executor, model, data))
    return accuracies
