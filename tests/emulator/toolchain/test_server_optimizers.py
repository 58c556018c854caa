"""The server part of generated plans: FedAvg, FedAvgM, FedAdam and FedYogi as ONNX update graphs
whose state persists across rounds in the server's checkpoint; the real server runs them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime import FLRuntime, Outcome, PlanExecutor, RuntimeEnvironment, encode_checkpoint
from device_runtime.clock import VirtualClock
from device_runtime.server_ops import SERVER_STATE_PREFIX
from emulator.devices.inprocess import InProcessTransport
from emulator.toolchain import (
    SGD,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedYogi,
    Momentum,
    initial_weights_from_onnx,
    training_plan_from_onnx,
)
from example_store import ExampleSelector, SQLiteExampleStore
from server_stub import AdminClient, AdminKeys, FLService, RoundConfig, ServerStore, create_app
from tests.emulator.toolchain.models import mlp
from tests.support import COLLECTION

URL = "http://fl.internal"


def _reference(opt, w, deltas):
    """The server optimizers of Reddi et al. (2021) in numpy, for one weight over several rounds."""
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for d in deltas:
        if isinstance(opt, FedAvgM):
            m = opt.momentum * m + d
            w = w + opt.lr * m
        elif isinstance(opt, FedAdam):
            m = opt.beta1 * m + (1 - opt.beta1) * d
            if isinstance(opt, FedYogi):
                v = v - (1 - opt.beta2) * d * d * np.sign(v - d * d)
            else:
                v = opt.beta2 * v + (1 - opt.beta2) * d * d
            w = w + opt.lr * m / (np.sqrt(v) + opt.tau)
        else:
            w = w + opt.lr * d
    return w


OPTIMIZERS = [FedAvg(), FedAvg(lr=0.5), FedAvgM(lr=1.0, momentum=0.9), FedAdam(lr=0.1), FedYogi(lr=0.1, tau=1e-2)]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: repr(o))
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31), rounds=st.integers(1, 4))
def test_server_update_graphs_follow_the_published_rules(opt, seed, rounds):
    plan = training_plan_from_onnx(
        mlp(3, 2, 2),
        label="y",
        loss="cross_entropy",
        optimizer=Momentum(0.1),
        batch_size=4,
        server_optimizer=opt,
        example_selector=ExampleSelector(COLLECTION),
    )
    executor = PlanExecutor(plan)
    rng = np.random.default_rng(seed)
    state = {w: rng.standard_normal(s).astype(np.float32) for w, (s, _) in executor.weight_spec().items()}
    start = {k: v.copy() for k, v in state.items()}
    deltas = {w: [rng.standard_normal(state[w].shape) * 0.1 for _ in range(rounds)] for w in state}
    for r in range(rounds):
        aggregate = {w: deltas[w][r] for w in plan.weight_names}
        aggregate.update(train_loss=1.0, train_accuracy=0.5, num_examples=8.0)
        state, metrics = executor.update(state, aggregate)
        assert metrics == {"train_loss": 1.0, "train_accuracy": 0.5, "num_examples": 8.0}
    carried = sorted(k for k in state if k.startswith(SERVER_STATE_PREFIX))
    assert len(carried) == 4 * len(opt.slots())  # one state tensor per slot and trainable weight
    for w in ("w0", "b0", "w1", "b1"):
        np.testing.assert_allclose(
            state[w], _reference(opt, start[w].astype(np.float64), deltas[w]), rtol=2e-5, atol=2e-5
        )
    for w in ("w0.momentum", "b1.momentum"):  # client optimizer state is averaged, never moved by the server optimizer
        np.testing.assert_allclose(state[w], start[w] + sum(deltas[w]), rtol=2e-5, atol=2e-5)


def test_client_optimizer_state_that_does_not_carry_over_is_reset_every_round():
    plan = training_plan_from_onnx(
        mlp(3, 2, 2),
        label="y",
        loss="cross_entropy",
        optimizer=Momentum(0.1, carry_state=False),
        batch_size=4,
        example_selector=ExampleSelector(COLLECTION),
    )
    executor = PlanExecutor(plan)
    state = {w: np.ones(s, np.float32) for w, (s, _) in executor.weight_spec().items()}
    aggregate = {w: np.full(s, 0.5) for w, (s, _) in executor.weight_spec().items()}
    aggregate.update(train_loss=1.0, train_accuracy=0.5, num_examples=8.0)
    new, _ = executor.update(state, aggregate)
    assert all(np.all(new[w] == 0) for w in plan.weight_names if w.endswith(".momentum"))
    assert np.all(new["w0"] == 1.5)


def test_fedadam_plan_trains_through_the_server_and_keeps_its_state_in_the_checkpoint(tmp_path, digits):
    clock = VirtualClock()
    service = FLService(ServerStore(tmp_path / "server.db"), clock=clock.now, wall_clock=clock.now)
    keys, key = AdminKeys.generate()
    source = mlp(64, 16, 10, seed=2)
    plan = training_plan_from_onnx(
        source,
        label="y",
        loss="cross_entropy",
        optimizer=SGD(0.2),
        batch_size=8,
        epochs=2,
        server_optimizer=FedAdam(lr=0.05),
        example_selector=ExampleSelector(COLLECTION),
    )
    start = initial_weights_from_onnx(source, plan)
    losses = []
    with InProcessTransport(create_app(service, admin_keys=keys)) as transport:
        with AdminClient(URL, admin_key=key, transport=transport) as admin:
            admin.create_population("digits")
            admin.deploy_task(
                "digits",
                "train",
                plan,
                encode_checkpoint(start),
                RoundConfig(goal_count=4, over_selection=1.0, min_fraction=1.0, min_reports=1),
            )
            stores = []
            for i in range(4):
                store = SQLiteExampleStore(tmp_path / f"d{i}.db")
                part = slice(60 * i, 60 * i + 60)
                store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[part], digits.y_train[part])))
                stores.append(store)
            for _round in range(3):
                results = []
                for store in stores:
                    with FLRuntime(
                        "digits", URL, store, transport=transport, environment=RuntimeEnvironment(clock=clock.now)
                    ) as runtime:
                        results.append(runtime.run_session())
                assert [r.outcome for r in results] == [Outcome.COMPLETED] * 4
                losses.append(np.mean([r.metrics["loss"] for r in results]))
            rounds = admin.rounds("digits")
            model, number = admin.model("digits")
            for store in stores:
                store.close()
    service.store.close()
    assert [r["status"] for r in rounds] == ["committed"] * 3 and number == 3
    assert {k for k in model if k.startswith(SERVER_STATE_PREFIX)} == {
        f"{SERVER_STATE_PREFIX}fedadam/{slot}/{w}" for slot in ("m", "v") for w in plan.weight_names
    }
    assert losses[-1] < losses[0], losses
    assert rounds[-1]["metrics"]["train_loss"] < rounds[0]["metrics"]["train_loss"]
