"""The plan executor: device training and its client update, the server part (FedAvg),
update validation, interruption, and the streaming shuffle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime.executor import DeviceResult, PlanExecutor, TrainingInterrupted, all_finite, make_session
from device_runtime.plan import PlanError, UpdateMismatchError
from device_runtime.plan_builder import build_eval_plan, build_mlp_plan, initial_weights
from example_store import ExampleSelector

SEL = ExampleSelector("app:/test")
F, C = 6, 3


def _plan(**kwargs):
    args = dict(learning_rate=0.3, batch_size=4, epochs=2, selector=SEL, inputs={"x": "pixels", "y": "label"})
    args.update(kwargs)
    return build_mlp_plan(F, (5,), C, **args)


def _client_data(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, F)).astype(np.float32), rng.integers(0, C, n).astype(np.int64)


def _opener(x, y, batch):
    return lambda: ({"pixels": x[i : i + batch], "label": y[i : i + batch]} for i in range(0, len(y), batch))


def _numpy_sgd(plan, w, x, y, lr, batch, epochs):
    """Reference: the same SGD over the same batches, in float64 numpy."""
    from tests.device_runtime.test_plan_gradients import grad64

    w = {k: v.astype(np.float64) for k, v in w.items()}
    for _ in range(epochs):
        for i in range(0, len(y), batch):
            g = grad64(w, x[i : i + batch], y[i : i + batch])
            w = {k: w[k] - lr * g[k] for k in w}
    return w


def test_run_device_update_matches_numpy_sgd_and_validates():
    plan = _plan()
    executor = PlanExecutor(plan)
    w0 = initial_weights(plan, seed=1)
    x, y = _client_data(10, seed=0)  # 10 examples in batches of 4: the last batch has 2
    result = executor.run_device(w0, _opener(x, y, 4))
    assert isinstance(result, DeviceResult) and result.num_examples == 10
    executor.validate_update(result.update)
    ref = _numpy_sgd(plan, w0, x, y, 0.3, 4, 2)
    for name in plan.weight_names:
        np.testing.assert_allclose(result.update[name], (ref[name] - w0[name]) * 10, rtol=1e-4, atol=1e-5)
    assert float(result.update["num_examples"]) == 10
    assert float(result.update["count"]) == 10  # sums over epochs / epochs: each example counted once
    assert 0 < result.metrics["loss"] < 5 and 0 <= result.metrics["accuracy"] <= 1
    assert set(result.update) == set(executor.client_update_spec())
    # the caller's weights are not modified
    np.testing.assert_array_equal(w0["w0"], initial_weights(plan, seed=1)["w0"])


def test_fedavg_equals_example_weighted_mean_of_client_models():
    plan = _plan()
    executor = PlanExecutor(plan)
    state = initial_weights(plan, seed=0)
    clients = [_client_data(n, seed=s) for s, n in enumerate((3, 10, 17))]
    results = [executor.run_device(executor.prepare(state), _opener(x, y, 4)) for x, y in clients]

    left = executor.accumulate(executor.accumulate(executor.zero(), results[0].update), results[1].update)
    right = executor.accumulate(executor.zero(), results[2].update)
    acc = executor.merge(left, right)
    aggregate = executor.report(acc)
    new_state, metrics = executor.update(state, aggregate)

    counts = np.array([r.num_examples for r in results], dtype=np.float64)
    models = [executor.final_weights(state, r) for r in results]
    for name in plan.weight_names:
        expected = sum(c * m[name].astype(np.float64) for c, m in zip(counts, models)) / counts.sum()
        np.testing.assert_allclose(new_state[name], expected, rtol=1e-4, atol=1e-6)
        assert new_state[name].dtype == np.float32 and new_state[name].shape == state[name].shape
    assert metrics["num_examples"] == 30
    loss = sum(r.metrics["loss_sum"] for r in results) / counts.sum()
    assert metrics["train_loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["train_accuracy"] == pytest.approx(sum(r.metrics["correct"] for r in results) / 30, rel=1e-5)
    # merge is commutative and zero is its identity
    flipped = executor.merge(right, left)
    for k in acc:
        np.testing.assert_allclose(acc[k], flipped[k], rtol=1e-6)
        np.testing.assert_array_equal(executor.merge(acc, executor.zero())[k], acc[k])
    assert set(executor.zero()) == set(executor.client_update_spec())
    for k, (shape, dtype) in executor.client_update_spec().items():
        assert executor.zero()[k].shape == shape and dtype == np.float32


def test_prepare_broadcasts_the_weights():
    plan = _plan()
    executor = PlanExecutor(plan)
    state = initial_weights(plan, seed=4)
    broadcast = executor.prepare(state)
    assert set(broadcast) == set(plan.weight_names)
    for k in state:
        np.testing.assert_array_equal(broadcast[k], state[k])


def test_eval_plan_aggregates_metrics_and_keeps_the_weights():
    plan = build_eval_plan(_plan())
    executor = PlanExecutor(plan)
    state = initial_weights(plan, seed=0)
    (x1, y1), (x2, y2) = _client_data(5, 1), _client_data(9, 2)
    r1 = executor.run_device(state, _opener(x1, y1, 4))
    r2 = executor.run_device(state, _opener(x2, y2, 4))
    assert set(r1.update) == {"loss_sum", "correct", "count", "num_examples"}
    executor.validate_update(r1.update)
    acc = executor.accumulate(executor.accumulate(executor.zero(), r1.update), r2.update)
    new_state, metrics = executor.update(state, executor.report(acc))
    for k in state:
        np.testing.assert_array_equal(new_state[k], state[k])
    direct = executor.evaluate(state, [{"pixels": np.concatenate([x1, x2]), "label": np.concatenate([y1, y2])}])
    assert metrics["eval_loss"] == pytest.approx(direct["eval_loss"], rel=1e-5)
    assert metrics["eval_accuracy"] == pytest.approx(direct["eval_accuracy"])
    assert metrics["num_examples"] == direct["num_examples"] == 14


def test_validate_update_names_the_offending_tensor():
    plan = _plan()
    executor = PlanExecutor(plan)
    good = {k: np.zeros(s, dtype=d) for k, (s, d) in executor.client_update_spec().items()}
    executor.validate_update(good)
    cases = [
        ({k: v for k, v in good.items() if k != "b0"}, "missing.*b0"),
        ({**good, "extra": np.zeros(1, np.float32)}, "unexpected.*extra"),
        ({**good, "w0": np.zeros((F + 1, 5), np.float32)}, "'w0' has shape"),
        ({**good, "w0": np.zeros((F, 5), np.float64)}, "'w0' has dtype float64"),
        ({**good, "count": np.zeros(1, np.float32)}, "'count' has shape"),
        ({**good, "w1": np.full((5, C), np.nan, np.float32)}, "'w1' holds NaN"),
        ({**good, "b1": np.array([0, np.inf, 0], np.float32)}, "'b1' holds NaN or infinite"),
        ({**good, "num_examples": np.array(-3, np.float32)}, "num_examples.*negative"),
    ]
    for update, pattern in cases:
        with pytest.raises(UpdateMismatchError, match=pattern):
            executor.validate_update(update)
    assert issubclass(UpdateMismatchError, PlanError)


_SPECIAL = st.sampled_from([np.nan, np.inf, -np.inf, 3.4e38, -3.4e38, 6.5e4, 1e-45, 0.0, -0.0, 1.0])


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
    shape=st.sampled_from([(), (1,), (7,), (3, 4)]),
    placed=st.lists(st.tuples(st.integers(0, 11), _SPECIAL), max_size=6),
)
def test_all_finite_says_what_numpy_elementwise_says(dtype, shape, placed):
    """Float32's and float16's one-pass check (their sum in float64) against np.isfinite: values
    near the type's largest, whose float32 sum overflows, are finite; one NaN or infinity is not."""
    value = np.ones(shape, dtype)
    flat = value.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        for at, special in placed:
            if flat.size:
                flat[at % flat.size] = special
    assert all_finite(value) == bool(np.isfinite(value).all())


def test_validate_update_takes_finite_values_whose_float32_sum_overflows():
    plan = _plan()
    executor = PlanExecutor(plan)
    big = {k: np.full(s, 3.4e38, dtype=d) for k, (s, d) in executor.client_update_spec().items()}
    executor.validate_update(big)
    big["w0"][1, 2] = np.nan
    with pytest.raises(UpdateMismatchError, match="'w0' holds NaN"):
        executor.validate_update(big)


def test_should_abort_raises_between_batches():
    plan = _plan(epochs=3)
    executor = PlanExecutor(plan)
    x, y = _client_data(40, 0)
    calls = []

    def abort_after_5() -> bool:
        calls.append(1)
        return len(calls) > 5

    with pytest.raises(TrainingInterrupted):
        executor.run_device(initial_weights(plan), _opener(x, y, 4), should_abort=abort_after_5)
    assert len(calls) == 6
    # an executor can be used again after an interruption
    assert executor.run_device(initial_weights(plan), _opener(x, y, 4), should_abort=lambda: False).num_examples == 40


def test_bad_inputs_are_reported_clearly():
    plan = _plan()
    executor = PlanExecutor(plan)
    x, y = _client_data(8, 0)
    with pytest.raises(PlanError, match="no tensor 'pixels'"):
        executor.run_device(initial_weights(plan), lambda: [{"x": x, "label": y}])
    with pytest.raises(ValueError, match="class ids"):
        executor.run_device(initial_weights(plan), lambda: [{"pixels": x, "label": y + C}])
    with pytest.raises(
        PlanError, match=rf"tensor 'pixels' has shape \({F + 1},\) per example; the plan takes \({F},\)"
    ):
        executor.run_device(initial_weights(plan), lambda: [{"pixels": np.c_[x, x[:, :1]], "label": y}])
    with pytest.raises(PlanError, match=rf"tensor 'pixels' has shape \(\) per example; the plan takes \({F},\)"):
        executor.run_device(initial_weights(plan), lambda: [{"pixels": x[:, 0], "label": y}])
    with pytest.raises(PlanError, match="missing"):
        executor.run_device({"w0": np.zeros((F, 5), np.float32)}, lambda: [])
    with pytest.raises(PlanError, match="shape"):
        executor.run_device({**initial_weights(plan), "w0": np.zeros((F, 4), np.float32)}, lambda: [])


@pytest.mark.parametrize("n", [1, 8, 64, 65, 500])  # small batches are checked in Python, large ones in numpy
def test_a_label_outside_the_classes_is_refused_in_any_batch(n):
    plan = _plan(batch_size=n, epochs=1)
    executor = PlanExecutor(plan)
    x, y = _client_data(n, 1)
    y[:] = 0
    y[-1] = C - 1
    executor.run_device(initial_weights(plan), lambda: [{"pixels": x, "label": y}])  # both ends are classes
    for bad in (-1, C):
        y[n // 2] = bad
        with pytest.raises(ValueError, match=rf"class ids in \[0, {C}\) .* from {y.min()} to {y.max()}$"):
            executor.run_device(initial_weights(plan), lambda: [{"pixels": x, "label": y}])


def test_no_examples_gives_a_zero_update():
    plan = _plan()
    executor = PlanExecutor(plan)
    result = executor.run_device(initial_weights(plan), lambda: [])
    assert result.num_examples == 0
    executor.validate_update(result.update)
    assert all(not np.any(v) for v in result.update.values())


# ---------------------------------------------------------------------- shuffling and batching


def _examples(n: int, chunk: int, pulled: list[int] | None = None):
    def open_examples():
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            if pulled is not None:
                pulled.append(stop)
            yield {
                "pixels": np.repeat(np.arange(start, stop, dtype=np.float32)[:, None], F, axis=1),
                "label": np.arange(start, stop) % C,
                "unused": np.zeros(stop - start),
            }

    return open_examples


def _ids(batches) -> list[int]:
    return [int(v) for b in batches for v in b["pixels"][:, 0]]


def test_shuffle_is_deterministic_per_seed_and_differs_per_epoch():
    plan = _plan(batch_size=8, shuffle_seed=123, shuffle_buffer=32)
    open_a = PlanExecutor(plan).batches_from_examples(_examples(100, 7))
    open_b = PlanExecutor(plan).batches_from_examples(_examples(100, 7))
    a1, a2 = _ids(open_a()), _ids(open_a())
    b1, b2 = _ids(open_b()), _ids(open_b())
    assert a1 == b1 and a2 == b2  # same seed, same epoch -> same order
    assert a1 != a2  # a new order each epoch
    assert sorted(a1) == sorted(a2) == list(range(100))  # every example exactly once per epoch
    assert a1 != list(range(100))
    other = _ids(
        PlanExecutor(_plan(batch_size=8, shuffle_seed=124, shuffle_buffer=32)).batches_from_examples(
            _examples(100, 7)
        )()
    )
    assert other != a1
    batches = list(open_a())
    assert [len(b["label"]) for b in batches] == [8] * 12 + [4]
    assert set(batches[0]) == {"pixels", "label"}
    for b in batches:  # examples stay whole: labels follow their pixels
        np.testing.assert_array_equal(b["label"], b["pixels"][:, 0].astype(np.int64) % C)


def _reference_order(n: int, chunk: int, capacity: int, seed: int, epoch: int) -> list[int]:
    """The documented shuffle, from ``default_rng([seed, epoch])``: whenever the buffer holds more
    than ``capacity`` examples, a random subset of the excess leaves; the rest leaves at the end."""
    rng = np.random.default_rng([seed, epoch])
    pool: list[int] = []
    out: list[int] = []
    for start in range(0, n, chunk):
        pool.extend(range(start, min(n, start + chunk)))
        if len(pool) > capacity:
            perm = rng.permutation(len(pool))
            out.extend(pool[i] for i in perm[: len(pool) - capacity])
            pool = [pool[i] for i in perm[len(pool) - capacity :]]
    out.extend(pool[i] for i in rng.permutation(len(pool)))
    return out


def test_shuffles_are_those_of_the_seed_and_epoch_on_any_executor():
    """Every runtime version shuffles a plan's examples alike: a fleet's devices must train on
    the same order whichever executor, or how many sessions before, ran the plan."""
    for seed in (0, 123, 2**40):
        plan = _plan(batch_size=8, shuffle_seed=seed, shuffle_buffer=32)
        executor = PlanExecutor(plan)
        for _ in range(2):  # a later session of the same executor starts again at epoch 0
            open_batches = executor.batches_from_examples(_examples(100, 7))
            assert [_ids(open_batches()) for _ in range(3)] == [_reference_order(100, 7, 32, seed, e) for e in range(3)]


def test_shuffle_streams_with_a_bounded_buffer():
    pulled: list[int] = []
    plan = _plan(batch_size=16, shuffle_seed=0, shuffle_buffer=64)
    opener = PlanExecutor(plan).batches_from_examples(_examples(100_000, 10, pulled))
    batches = opener()
    first = next(batches)
    assert len(first["label"]) == 16
    assert pulled[-1] <= 64 + 10 + 16  # buffer + one chunk + one batch, not the collection
    seen = len(first["label"])
    for b in batches:
        seen += len(b["label"])
        assert pulled[-1] - seen <= 64 + 10 + 16
    assert seen == 100_000


def test_unbatched_examples_and_no_shuffle():
    plan = _plan(batch_size=3, shuffle_buffer=0)
    source = lambda: ({"pixels": np.full(F, i, np.float32), "label": i % C} for i in range(10))  # noqa: E731
    batches = list(PlanExecutor(plan).batches_from_examples(source, batched=False)())
    assert _ids(batches) == list(range(10))
    assert [len(b["label"]) for b in batches] == [3, 3, 3, 1]


def test_run_device_on_shuffled_batches_counts_each_example_once_per_epoch():
    plan = _plan(batch_size=5, epochs=3, shuffle_seed=9, shuffle_buffer=16)
    executor = PlanExecutor(plan)
    result = executor.run_device(initial_weights(plan), executor.batches_from_examples(_examples(23, 4)))
    assert result.num_examples == 23
    assert float(result.update["count"]) == 23
    executor.validate_update(result.update)


def test_make_session_is_single_threaded():
    plan = _plan()
    sess = make_session(plan.work)
    assert sess.get_providers() == ["CPUExecutionProvider"]
    options = sess.get_session_options()
    assert options.intra_op_num_threads == 1 and options.inter_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"


@pytest.mark.parametrize("kind", ["train", "eval"])
def test_sessions_on_one_executor_do_not_see_each_other(kind):
    """One executor serves session after session with the same buffers: each result equals a
    fresh executor's, whatever ran before it (another device's weights, an interrupted session),
    and a result stays what it was when later sessions run."""
    plan = _plan() if kind == "train" else build_eval_plan(_plan())
    shared = PlanExecutor(plan)
    runs = [(initial_weights(plan, seed=s), *_client_data(6 + 3 * s, seed=s)) for s in range(4)]
    earlier = []
    for i, (w, x, y) in enumerate(runs):
        if i == 2:  # an interrupted session in between
            with pytest.raises(TrainingInterrupted):
                shared.run_device(runs[0][0], _opener(x, y, 4), should_abort=iter([False, False, True]).__next__)
        got = shared.run_device(w, _opener(x, y, 4))
        fresh = PlanExecutor(plan).run_device(w, _opener(x, y, 4))
        assert got.metrics == fresh.metrics and got.num_examples == fresh.num_examples
        for name in fresh.update:
            np.testing.assert_array_equal(got.update[name], fresh.update[name])
        earlier.append((got, {k: v.copy() for k, v in got.update.items()}))
    for got, kept in earlier:
        for name, value in kept.items():
            np.testing.assert_array_equal(got.update[name], value)


def test_threads_sharing_an_executor_each_train_on_their_own_buffers():
    import threading

    plan = _plan(epochs=3)
    shared = PlanExecutor(plan)
    jobs = [(initial_weights(plan, seed=s), *_client_data(40, seed=s)) for s in range(6)]
    want = [PlanExecutor(plan).run_device(w, _opener(x, y, 4)).update for w, x, y in jobs]
    got: dict[int, list] = {}

    def worker(i: int) -> None:
        w, x, y = jobs[i]
        got[i] = [shared.run_device(w, _opener(x, y, 4)).update for _ in range(5)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, updates in got.items():
        for update in updates:
            for name, value in want[i].items():
                np.testing.assert_array_equal(update[name], value)
    assert len(got) == len(jobs)
