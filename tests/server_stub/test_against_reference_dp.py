"""Central and distributed DP against DP-FedAvg as McMahan et al. 2018 ("Learning Differentially
Private Recurrent Language Models", Algorithm 1) and TFF's and Flower's DP aggregators apply it:
what is clipped and noised is the model's change, which clients make with SGD (or with an optimizer
started afresh each round whose state stays on the device). A plan whose update carries its client
optimizer's state is refused at deploy: that state would share the clip with the model and take
the noise."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import helper

from device_runtime import PlanExecutor
from emulator.toolchain import SGD, Adam, Momentum, initial_weights_from_onnx, training_plan_from_onnx
from example_store import ExampleSelector
from server_stub import DPConfig, RoundConfig
from server_stub import central_dp as cdp
from server_stub.dp_rounds import CentralRound, TaskDP, check_deploy, client_optimizer_state
from server_stub.errors import BadRequest
from tests.emulator.toolchain.models import F, glorot, mlp, model

SOURCE = mlp(5, 4, 3, seed=1)


def _plan(optimizer, source=SOURCE):
    return training_plan_from_onnx(
        source,
        label="y",
        loss="cross_entropy",
        optimizer=optimizer,
        batch_size=8,
        example_selector=ExampleSelector("app:/o"),
    )


@pytest.mark.parametrize("mode", ["central", "distributed"])
@pytest.mark.parametrize(
    "optimizer",
    [Adam(0.01), Adam(0.01, carry_state=False), Momentum(0.1), Momentum(0.1, carry_state=False)],
    ids=repr,
)
def test_a_dp_task_whose_update_holds_client_optimizer_state_is_refused_naming_it(mode, optimizer):
    plan = _plan(optimizer)
    config = RoundConfig(goal_count=10, dp=DPConfig(mode=mode, noise_multiplier=1.0, clip=1.0))
    with pytest.raises(BadRequest) as refused:
        check_deploy("t", plan, config)
    message = str(refused.value)
    assert refused.value.code == "BAD_CONFIG" and "\n" not in message
    assert client_optimizer_state(plan.weight_names)[0] in message and "SGD" in message
    # a momentum plan has no step count nor second moment, which its refusal said it had
    assert ("second moment" in message) == isinstance(optimizer, Adam), message


def test_a_dp_task_of_an_sgd_plan_is_taken():
    plan = _plan(SGD(0.1))
    assert client_optimizer_state(plan.weight_names) == []
    check_deploy("t", plan, RoundConfig(goal_count=10, dp=DPConfig(mode="central", noise_multiplier=1.0, clip=1.0)))


def test_a_models_own_weight_named_momentum_is_the_models_and_its_sgd_dp_task_is_taken():
    """A model's weights called ``momentum`` and ``head.momentum`` (an SGD plan's, no optimizer
    state at all) were refused at deploy as its client optimizer's state."""
    rng = np.random.default_rng(0)
    names = ("encoder.weight", "momentum", "head.momentum", "head.bias")
    source = model(
        [
            helper.make_node("Gemm", ["x", names[0], names[1]], ["z0"]),
            helper.make_node("Relu", ["z0"], ["a0"]),
            helper.make_node("Gemm", ["a0", names[2], names[3]], ["logits"]),
        ],
        [helper.make_tensor_value_info("x", F, ["N", 5])],
        [helper.make_tensor_value_info("logits", F, ["N", 3])],
        dict(zip(names, [glorot(rng, 5, 4), np.zeros(4, np.float32), glorot(rng, 4, 3), np.zeros(3, np.float32)])),
    )
    config = RoundConfig(goal_count=10, dp=DPConfig(mode="central", noise_multiplier=1.0, clip=1.0))
    plan = _plan(SGD(0.1), source)
    assert client_optimizer_state(plan.weight_names) == []
    check_deploy("t", plan, config)
    state = client_optimizer_state(_plan(Momentum(0.1), source).weight_names)
    assert sorted(state) == sorted(f"{w}.momentum" for w in names)


def test_what_the_refusal_prevents_a_noised_adam_state_makes_the_next_round_nan():
    """Why the refusal: ten devices' Adam updates through one central DP round (z = 1, C = 1) as the
    server sums them, then a device's next session from the model the round made. The step count's
    delta (5 steps) outweighs the model's (about 0.1 a weight) in the clipped norm, and the noise on
    the averaged second moment leaves entries below zero, whose square root is NaN."""
    plan = _plan(Adam(0.01))
    executor = PlanExecutor(plan)
    weights = initial_weights_from_onnx(SOURCE, plan)
    rng = np.random.default_rng(0)
    task = TaskDP.load(RoundConfig(goal_count=10, dp=DPConfig(mode="central", noise_multiplier=1.0, clip=1.0)), [])
    assert task is not None
    central = task.open_round(secure=False)
    assert isinstance(central, CentralRound)

    def batches():
        x, y = rng.standard_normal((40, 5)).astype(np.float32), rng.integers(0, 3, 40)
        return [{"x": x[i : i + 8], "y": y[i : i + 8]} for i in range(0, 40, 8)]

    total: dict[str, np.ndarray] = {}
    for _ in range(10):
        data = batches()
        taken = central.take(executor.run_device(weights, lambda data=data: data).update, plan.weight_names, 1000)
        total = {k: total.get(k, 0) + np.asarray(v, np.float64) for k, v in taken.items()}
    noised, _ = central.close(total, plan.weight_names, np.random.default_rng(1))
    n = float(noised["num_examples"])
    aggregate = {w: noised[w] / n for w in plan.weight_names}
    aggregate.update(train_loss=1.0, train_accuracy=0.5, num_examples=n)
    state, _ = executor.update(weights, aggregate)
    assert min(float(state[w].min()) for w in plan.weight_names if w.endswith(".adam_v")) < 0
    data = batches()
    after = executor.run_device(state, lambda: data).update
    assert not all(np.isfinite(v).all() for v in after.values())


def test_adaptive_clipping_grows_a_clip_every_update_exceeds_as_andrew_et_al_write_it():
    """Andrew et al. 2021 (Algorithm 1): b is the fraction of updates at or below the clip and
    C <- C exp(-eta (b - gamma)). Four updates of norm 17.3 against a clip of 0.1 (b = 0, gamma 0.5,
    eta 0.2, no noise) grow it by exp(0.1) a round. Flower 1.42's
    DifferentialPrivacyServerSideAdaptiveClipping, given the same (FedAvg inside, noise_multiplier 0,
    initial_clipping_norm 0.1, target_clipped_quantile 0.5, clip_norm_lr 0.2), counted the clipped
    updates in b's place and recorded 0.0904837, 0.0818731, 0.0740818, 0.0670320, 0.0606531: the
    clip shrank away from every update."""
    state = cdp.AdaptiveClip(clip=0.1, target_quantile=0.5, learning_rate=0.2, noise_multiplier=0.0)
    clips = []
    for _ in range(5):
        _, state = cdp.adaptive_dp_mean([np.full(3, 10.0)] * 4, state, np.random.default_rng(0))
        clips.append(state.clip)
    np.testing.assert_allclose(clips, [0.1 * math.exp(0.1 * r) for r in range(1, 6)], rtol=1e-12)
