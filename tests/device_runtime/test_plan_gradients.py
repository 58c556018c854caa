"""The work graph's written-out backward pass: its SGD step equals the gradient of the mean
cross-entropy, checked against a numpy reference and against central finite differences (float64)
of the loss computed by a numpy forward that is itself checked against the graph's forward."""

from __future__ import annotations

import numpy as np
import pytest

from device_runtime.executor import PlanExecutor, make_session
from device_runtime.plan_builder import build_eval_plan, build_mlp_plan, build_softmax_regression_plan, initial_weights
from example_store import ExampleSelector

SEL = ExampleSelector("app:/test")


def forward64(w: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, int]:
    """(sum of per-example cross-entropy, number correct) in float64."""
    a = x.astype(np.float64)
    layers = len(w) // 2
    for i in range(layers):
        z = a @ w[f"w{i}"].astype(np.float64) + w[f"b{i}"].astype(np.float64)
        a = np.maximum(z, 0) if i < layers - 1 else z
    shifted = a - a.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].sum()), int((a.argmax(axis=1) == y).sum())


def grad64(w: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """Analytic gradient of the mean loss (numpy reference backprop, float64)."""
    layers = len(w) // 2
    w64 = {k: v.astype(np.float64) for k, v in w.items()}
    acts, pres = [x.astype(np.float64)], []
    for i in range(layers):
        z = acts[-1] @ w64[f"w{i}"] + w64[f"b{i}"]
        pres.append(z)
        acts.append(np.maximum(z, 0) if i < layers - 1 else z)
    logits = acts[-1]
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    g = p
    g[np.arange(len(y)), y] -= 1
    g /= len(y)
    out = {}
    for i in reversed(range(layers)):
        out[f"w{i}"] = acts[i].T @ g
        out[f"b{i}"] = g.sum(axis=0)
        if i:
            g = (g @ w64[f"w{i}"].T) * (pres[i - 1] > 0)
    return out


def finite_difference(
    w: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, eps: float = 1e-6
) -> dict[str, np.ndarray]:
    w64 = {k: v.astype(np.float64) for k, v in w.items()}
    out = {}
    for name, value in w64.items():
        grad = np.zeros_like(value)
        for idx in np.ndindex(value.shape):
            orig = value[idx]
            value[idx] = orig + eps
            plus = forward64(w64, x, y)[0]
            value[idx] = orig - eps
            minus = forward64(w64, x, y)[0]
            value[idx] = orig
            grad[idx] = (plus - minus) / (2 * eps) / len(y)
        out[name] = grad
    return out


def _data(n: int, features: int, classes: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, features)).astype(np.float32), rng.integers(0, classes, n).astype(np.int64)


def graph_step(plan, w, x, y):
    """(implied gradient (w - w_new)/lr, loss_sum, correct, count) from one run of the work graph."""
    sess = make_session(plan.work)
    names = list(plan.weight_outputs) + list(plan.metric_names)
    out = dict(zip(names, sess.run(names, {**w, "x": x, "y": y})))
    grads = {
        n: (w[n].astype(np.float64) - out[o].astype(np.float64)) / LR
        for n, o in zip(plan.weight_names, plan.weight_outputs)
    }
    return grads, float(out["loss_sum"]), float(out["correct"]), float(out["count"])


LR = 1.0  # the graph folds lr into the step; 1.0 keeps the implied gradient's rounding error small

CASES = {
    "softmax_regression": lambda: build_softmax_regression_plan(6, 4, learning_rate=LR, selector=SEL),
    "mlp_2_hidden": lambda: build_mlp_plan(6, (5, 4), 3, learning_rate=LR, selector=SEL),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_graph_gradient_matches_numpy_backprop_and_finite_differences(case):
    plan = CASES[case]()
    w = initial_weights(plan, seed=3)
    rng = np.random.default_rng(1)
    for name in w:  # non-zero biases exercise their gradients through the whole network
        if name.startswith("b"):
            w[name] = (0.1 * rng.standard_normal(w[name].shape)).astype(np.float32)
    x, y = _data(7, 6, int(w[plan.weight_names[-1]].shape[0]), seed=2)

    grads, loss_sum, correct, count = graph_step(plan, w, x, y)
    ref_loss, ref_correct = forward64(w, x, y)
    assert count == len(y)
    assert correct == ref_correct
    assert loss_sum == pytest.approx(ref_loss, rel=1e-5)  # the numpy forward is the graph's forward

    reference = grad64(w, x, y)
    fd = finite_difference(w, x, y)
    for name in plan.weight_names:
        scale = np.abs(reference[name]).max() + 1e-3
        # the FD check validates the numpy reference independently of how it was derived ...
        np.testing.assert_allclose(reference[name], fd[name], atol=1e-6 * scale + 1e-8, err_msg=name)
        # ... and the graph's step against both
        np.testing.assert_allclose(grads[name], reference[name], atol=2e-4 * scale, rtol=1e-3, err_msg=name)
        np.testing.assert_allclose(grads[name], fd[name], atol=2e-4 * scale, rtol=1e-3, err_msg=name)
        assert np.abs(grads[name]).max() > 0, f"{name} got no gradient"


def test_check_would_fail_for_a_wrong_gradient():
    plan = CASES["mlp_2_hidden"]()
    w = initial_weights(plan, seed=3)
    x, y = _data(7, 6, 3, seed=2)
    grads, *_ = graph_step(plan, w, x, y)
    wrong = dict(grads)
    wrong["w1"] = grads["w1"] * 1.01  # a 1 % error in one matrix
    scale = np.abs(grads["w1"]).max()
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(wrong["w1"], finite_difference(w, x, y)["w1"], atol=2e-4 * scale, rtol=1e-3)


def test_learning_rate_scales_the_step_and_batch_dimension_is_dynamic():
    w = None
    for batch in (1, 5, 13):
        x, y = _data(batch, 6, 3, seed=batch)
        steps = {}
        for lr in (0.5, 0.05):
            plan = build_mlp_plan(6, (4,), 3, learning_rate=lr, selector=SEL)
            w = initial_weights(plan, seed=0)
            sess = make_session(plan.work)
            new = sess.run(["w0_new"], {**w, "x": x, "y": y})[0]
            steps[lr] = w["w0"] - new
        np.testing.assert_allclose(steps[0.5], 10 * steps[0.05], rtol=1e-3, atol=1e-7)


def test_a_few_sgd_steps_reduce_the_loss():
    plan = build_mlp_plan(8, (16, 8), 3, learning_rate=0.5, batch_size=16, epochs=5, selector=SEL)
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((3, 8)) * 2
    y = rng.integers(0, 3, 96)
    x = (centers[y] + rng.standard_normal((96, 8))).astype(np.float32)
    executor = PlanExecutor(plan)
    evaluator = PlanExecutor(build_eval_plan(plan))
    w0 = initial_weights(plan, seed=0)
    before = evaluator.evaluate(w0, [{"x": x, "y": y}])
    result = executor.run_device(w0, lambda: [{"x": x[i : i + 16], "y": y[i : i + 16]} for i in range(0, 96, 16)])
    after = evaluator.evaluate(executor.final_weights(w0, result), [{"x": x, "y": y}])
    assert after["eval_loss"] < 0.5 * before["eval_loss"]
    assert after["eval_accuracy"] > 0.9
    # the graph's forward in the eval plan agrees with the numpy forward
    ref_loss, ref_correct = forward64(w0, x, y)
    assert before["eval_loss"] == pytest.approx(ref_loss / 96, rel=1e-5)
    assert before["eval_accuracy"] == pytest.approx(ref_correct / 96)


def test_log_softmax_is_stable_for_huge_logits():
    plan = build_softmax_regression_plan(2, 3, learning_rate=0.1, selector=SEL)
    w = {"w0": np.array([[1e4, -1e4, 0], [0, 0, 0]], dtype=np.float32), "b0": np.zeros(3, dtype=np.float32)}
    x = np.array([[10.0, 0.0], [-10.0, 0.0]], dtype=np.float32)
    y = np.array([1, 1], dtype=np.int64)
    sess = make_session(plan.work)
    out = sess.run(None, {**w, "x": x, "y": y})
    assert all(np.isfinite(o).all() for o in out)
    loss = dict(zip([o.name for o in sess.get_outputs()], out))["loss_sum"]
    assert float(loss) == pytest.approx(2e5, rel=1e-3)  # logits [1e5, -1e5, 0] -> 2e5; [-1e5, 1e5, 0] -> 0
