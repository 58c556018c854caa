"""The server optimizers' update graphs against Flower's strategies on the same rounds, with
numbers recorded from Flower: FedAvgM and FedYogi take Flower's steps; FedAdam takes Reddi et al.'s
Algorithm 2 as written, and Flower's FedAdam that step times Adam's bias correction."""

from __future__ import annotations

import math

import numpy as np
import pytest

from device_runtime import PlanExecutor
from emulator.toolchain import SGD, FedAdam, FedAvgM, FedYogi, training_plan_from_onnx
from example_store import ExampleSelector
from tests.emulator.toolchain.models import mlp

START = np.array([0.5, -0.25], np.float32)
# each round's example-weighted mean delta: two clients of 10 and 30 examples sent d - 0.1 and d + 0.1/3
DELTAS = [np.array([0.1, -0.2]), np.array([0.05, 0.3]), np.array([-0.2, 0.1])]

# Recorded from flwr 1.42.0 (numpy 2.4.6): a strategy with initial_parameters [START], then for each
# round r aggregate_fit(r + 1, results) where results are the two clients' FitRes holding
# current + DELTAS[r] - 0.1 (num_examples 10) and current + DELTAS[r] + 0.1 / 3 (num_examples 30);
# the first array of the aggregated parameters after the last round.
FLOWER = {
    "FedAvgM(server_learning_rate=1.0, server_momentum=0.9)": [0.6660001277923584, -0.12199991941452026],
    "FedYogi(eta=0.01, beta_1=0.9, beta_2=0.99, tau=1e-3)": [0.5174902677536011, -0.25087109208106995],
    "FedAdam(eta=0.01, beta_1=0.9, beta_2=0.99, tau=1e-3), 1 round": [0.5067496350686401, -0.25707104616830756],
    "FedAdam(eta=0.01, beta_1=0.9, beta_2=0.99, tau=1e-3), 3 rounds": [0.5122961849608962, -0.25186469881368573],
}


def _run(opt, rounds: int) -> np.ndarray:
    """Our update graph over ``rounds`` of DELTAS, on the plan's bias ``b1`` (two entries)."""
    plan = training_plan_from_onnx(
        mlp(3, 2, 2),
        label="y",
        loss="cross_entropy",
        optimizer=SGD(0.1),
        batch_size=4,
        server_optimizer=opt,
        example_selector=ExampleSelector("app:/s"),
    )
    executor = PlanExecutor(plan)
    state = {w: np.zeros(s, np.float32) for w, (s, _) in executor.weight_spec().items()}
    state["b1"] = START.copy()
    for r in range(rounds):
        aggregate = {w: np.zeros(np.shape(state[w])) for w in plan.weight_names}
        aggregate["b1"] = DELTAS[r]
        aggregate.update(train_loss=1.0, train_accuracy=0.5, num_examples=40.0)
        state, _ = executor.update(state, aggregate)
    return state["b1"]


def _adam(rounds: int, *, bias_corrected: bool) -> np.ndarray:
    """Reddi et al.'s FedAdam written out (lr 0.01, betas 0.9 / 0.99, tau 1e-3); with
    ``bias_corrected``, Flower's: lr times sqrt(1 - b2^(r+1)) / (1 - b1^(r+1)) in round r."""
    w, m, v = START.astype(np.float64), np.zeros(2), np.zeros(2)
    for r, d in enumerate(DELTAS[:rounds], start=1):
        m = 0.9 * m + 0.1 * d
        v = 0.99 * v + 0.01 * d * d
        lr = 0.01 * (math.sqrt(1 - 0.99 ** (r + 1)) / (1 - 0.9 ** (r + 1)) if bias_corrected else 1.0)
        w = w + lr * m / (np.sqrt(v) + 1e-3)
    return w


@pytest.mark.parametrize(
    ("opt", "recorded"),
    [
        (FedAvgM(lr=1.0, momentum=0.9), "FedAvgM(server_learning_rate=1.0, server_momentum=0.9)"),
        (FedYogi(lr=0.01, beta1=0.9, beta2=0.99, tau=1e-3), "FedYogi(eta=0.01, beta_1=0.9, beta_2=0.99, tau=1e-3)"),
    ],
    ids=["FedAvgM", "FedYogi"],
)
def test_fedavgm_and_fedyogi_take_flowers_steps(opt, recorded):
    np.testing.assert_allclose(_run(opt, 3), FLOWER[recorded], rtol=0, atol=2e-6)


@pytest.mark.parametrize("rounds", [1, 3])
def test_fedadam_is_reddis_rule_without_bias_correction_and_flowers_is_it_with(rounds):
    flower = FLOWER[f"FedAdam(eta=0.01, beta_1=0.9, beta_2=0.99, tau=1e-3), {rounds} round{'s' * (rounds > 1)}"]
    np.testing.assert_allclose(_adam(rounds, bias_corrected=True), flower, rtol=0, atol=1e-6)  # Flower sums in float32
    ours = _run(FedAdam(lr=0.01, beta1=0.9, beta2=0.99, tau=1e-3), rounds)
    np.testing.assert_allclose(ours, _adam(rounds, bias_corrected=False), rtol=0, atol=2e-6)
    if rounds == 1:  # one step: Flower's is 0.742 of the paper's
        np.testing.assert_allclose(
            (np.array(flower) - START) / (ours - START), math.sqrt(1 - 0.99**2) / 0.19, rtol=1e-4
        )
