"""Momentum and Adam steps of a generated plan follow their textbook definitions step after step,
with their state carried from step to step (and session to session) as plan weights."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime import PlanExecutor
from emulator.toolchain import Adam, Momentum, initial_weights_from_onnx, training_plan_from_onnx
from example_store import ExampleSelector
from tests.emulator.toolchain.models import mlp

agnp = pytest.importorskip("autograd.numpy")
autograd = pytest.importorskip("autograd")


def _grad(p, x, y):
    def loss(q):
        z = agnp.maximum(x @ q["w0"] + q["b0"], 0) @ q["w1"] + q["b1"]
        z = z - agnp.max(z, 1, keepdims=True)
        return agnp.mean(agnp.log(agnp.sum(agnp.exp(z), 1)) - z[np.arange(len(y)), y])

    return autograd.grad(loss)(p)


def _reference(opt, p, batches):
    state = {k: np.zeros_like(v) for k, v in p.items()}
    second = {k: np.zeros_like(v) for k, v in p.items()}
    for t, (x, y) in enumerate(batches, start=1):
        g = _grad(p, x, y)
        for k in p:
            if isinstance(opt, Momentum):
                state[k] = opt.beta * state[k] + g[k]
                step = g[k] + opt.beta * state[k] if opt.nesterov else state[k]
                p[k] = p[k] - opt.lr * step
            else:
                state[k] = opt.beta1 * state[k] + (1 - opt.beta1) * g[k]
                second[k] = opt.beta2 * second[k] + (1 - opt.beta2) * g[k] ** 2
                m_hat = state[k] / (1 - opt.beta1**t)
                v_hat = second[k] / (1 - opt.beta2**t)
                p[k] = p[k] - opt.lr * m_hat / (np.sqrt(v_hat) + opt.eps)
    return p


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    steps=st.integers(1, 4),
    opt=st.sampled_from(
        [Momentum(0.1, 0.9), Momentum(0.05, 0.5, nesterov=True), Adam(0.01), Adam(0.05, 0.8, 0.9, 1e-6)]
    ),
)
def test_client_optimizer_steps_match_their_definition(seed, steps, opt):
    source = mlp(5, 4, 3, seed=seed % 100)
    plan = training_plan_from_onnx(
        source,
        label="y",
        loss="cross_entropy",
        optimizer=opt,
        batch_size=6,
        example_selector=ExampleSelector("app:/o"),
        shuffle_buffer=0,
    )
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((6 * steps, 5)).astype(np.float32), rng.integers(0, 3, 6 * steps)
    batches = [(x[i : i + 6], y[i : i + 6]) for i in range(0, len(y), 6)]
    weights = initial_weights_from_onnx(source, plan)
    executor = PlanExecutor(plan)
    result = executor.run_device(weights, lambda: [{"x": a, "y": b} for a, b in batches])
    ours = executor.final_weights(weights, result)
    expected = _reference(opt, {k: weights[k].astype(np.float64) for k in ("w0", "b0", "w1", "b1")}, batches)
    for k, value in expected.items():
        np.testing.assert_allclose(ours[k], value, rtol=1e-3, atol=1e-4, err_msg=k)
    if isinstance(opt, Adam):
        assert ours["adam_step"] == pytest.approx(steps, abs=1e-3)
