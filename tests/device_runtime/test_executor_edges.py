"""The plan executor at its edges: how batches are split (size one, empty, none at all), one
example, labels at the class count, a forced stop, the shuffle's epochs and buffer sizes, and
the output contract the deploy-time smoke test checks."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime.executor import PlanExecutor, TrainingInterrupted, _expect
from device_runtime.plan import PlanError
from device_runtime.plan_builder import build_eval_plan, initial_weights
from tests.device_runtime.test_executor import C, F, _client_data, _examples, _ids, _plan
from tests.device_runtime.test_plan_gradients import grad64

PLAN = _plan(epochs=1)  # MLP F -> 5 -> C: its hidden layer is wider than the class count
EXECUTOR = PlanExecutor(PLAN)
EVAL_EXECUTOR = PlanExecutor(build_eval_plan(PLAN))
WEIGHTS = initial_weights(PLAN, seed=1)
X, Y = _client_data(12, 3)


def split(cuts: list[int]) -> list[dict]:
    bounds = [0, *sorted(cuts), len(Y)]
    return [{"pixels": X[a:b], "label": Y[a:b]} for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(0, len(Y)), max_size=6))
def test_evaluation_is_the_same_however_the_examples_are_batched(cuts):
    """Batches of one, empty batches (repeated cuts) and a training plan's own work graph give
    the metrics of one batch of everything."""
    whole = EVAL_EXECUTOR.evaluate(WEIGHTS, split([]))
    assert whole["num_examples"] == len(Y)
    for executor in (EVAL_EXECUTOR, EXECUTOR):
        got = executor.evaluate(WEIGHTS, split(cuts))
        assert got["num_examples"] == len(Y)
        assert got["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-5)
        assert got["eval_accuracy"] == pytest.approx(whole["eval_accuracy"])


def test_evaluating_no_examples_gives_nan_metrics_and_a_zero_count():
    for batches in ([], [{"pixels": X[:0], "label": Y[:0]}]):
        got = EVAL_EXECUTOR.evaluate(WEIGHTS, batches)
        assert got["num_examples"] == 0
        assert np.isnan(got["eval_loss"]) and np.isnan(got["eval_accuracy"])


def test_empty_batches_between_batches_change_nothing_in_training():
    plain = EXECUTOR.run_device(WEIGHTS, lambda: split([4, 8]))
    gappy = EXECUTOR.run_device(WEIGHTS, lambda: split([4, 4, 8, 8]))
    assert gappy.num_examples == plain.num_examples == len(Y)
    for name in plain.update:
        np.testing.assert_array_equal(gappy.update[name], plain.update[name])


def test_one_example_trains_reports_its_loss_and_rebuilds_the_model():
    plan = _plan(epochs=1, batch_size=1)
    executor = PlanExecutor(plan)
    result = executor.run_device(WEIGHTS, lambda: [{"pixels": X[:1], "label": Y[:1]}])
    assert result.num_examples == 1
    assert set(result.metrics) >= {"loss", "accuracy"}
    assert result.metrics["loss"] == pytest.approx(float(result.update["loss_sum"]))
    final = executor.final_weights(WEIGHTS, result)
    g = grad64({k: v.astype(np.float64) for k, v in WEIGHTS.items()}, X[:1], Y[:1])
    for k, w in WEIGHTS.items():
        assert final[k].dtype == np.float32
        np.testing.assert_allclose(final[k], w - 0.3 * g[k], rtol=1e-4, atol=1e-6)


def test_labels_must_be_class_ids_below_the_class_count_in_one_dimension():
    """An app's examples that do not fit the plan are one of the SDK's errors (PlanError, also a
    ValueError), as a missing tensor or another shape are: a bare ValueError was logged by the
    scheduler as an unexpected failure, with its traceback, at every run."""
    for bad in (np.full(4, C), np.full(4, 4), Y[:4].reshape(4, 1)):  # 4 < the hidden width 5
        with pytest.raises(PlanError, match="class ids"):
            EXECUTOR.run_device(WEIGHTS, lambda bad=bad: [{"pixels": X[:4], "label": bad}])
    EXECUTOR.run_device(WEIGHTS, lambda: [{"pixels": X[:4], "label": np.full(4, C - 1)}])


def test_batch_tensors_must_agree_on_the_batch_size_and_an_empty_batch_is_skipped():
    with pytest.raises(PlanError, match="batch size"):
        EXECUTOR.run_device(WEIGHTS, lambda: [{"pixels": X[:4], "label": Y[:3]}])
    empty = EXECUTOR.run_device(WEIGHTS, lambda: [{"pixels": X[:0], "label": Y[:0]}])
    assert empty.num_examples == 0


def test_a_step_that_fails_raises_a_plan_error_with_the_runtimes_words_and_a_forced_stop_is_an_interruption(
    capfd,
):
    wrong_width = [{"pixels": np.zeros((4, F + 1), np.float32), "label": Y[:4]}]
    with pytest.raises(PlanError, match=rf"has shape \({F + 1},\) per example; the plan takes \({F},\)"):
        EXECUTOR.run_device(WEIGHTS, lambda: wrong_width)  # the executor sees it before the step
    work = onnx.ModelProto.FromString(PLAN.work)  # a graph that leaves the width open: only the step sees it
    next(v for v in work.graph.input if v.name == "x").type.tensor_type.shape.dim[1].dim_param = "features"
    open_width = PlanExecutor(dataclasses.replace(PLAN, work=work.SerializeToString()))
    with pytest.raises(PlanError, match=r"the plan's 'work' graph failed at step 0: .*Gemm.*Dimension mismatch"):
        open_width.run_device(WEIGHTS, lambda: wrong_width)  # the SDK's error, onnxruntime's first line
    assert "onnxruntime" not in capfd.readouterr().err  # said once, in the error: not again in its log on stderr
    stop = ort.RunOptions()
    stop.terminate = True
    with pytest.raises(TrainingInterrupted):
        EXECUTOR.run_device(WEIGHTS, lambda: split([]), run_options=stop)


def test_every_epoch_of_a_seeded_shuffle_has_its_own_order():
    opener = PlanExecutor(_plan(batch_size=8, shuffle_seed=5, shuffle_buffer=32)).batches_from_examples(
        _examples(60, 7)
    )
    orders = [_ids(opener()) for _ in range(4)]
    assert all(sorted(o) == list(range(60)) for o in orders)
    assert len({tuple(o) for o in orders}) == 4


def test_an_unseeded_shuffle_still_yields_every_example_once():
    opener = PlanExecutor(_plan(batch_size=8, shuffle_seed=None, shuffle_buffer=32)).batches_from_examples(
        _examples(60, 7)
    )
    assert sorted(_ids(opener())) == list(range(60))


def test_a_buffer_of_one_keeps_the_order_and_of_two_shuffles():
    keep = PlanExecutor(_plan(batch_size=8, shuffle_seed=5, shuffle_buffer=1)).batches_from_examples(_examples(60, 7))
    assert _ids(keep()) == list(range(60))
    mixed = PlanExecutor(_plan(batch_size=8, shuffle_seed=5, shuffle_buffer=2)).batches_from_examples(_examples(60, 7))
    order = _ids(mixed())
    assert sorted(order) == list(range(60)) and order != list(range(60))


def test_nothing_to_read_gives_no_batches_with_or_without_a_shuffle():
    for buffer in (0, 32):
        opener = PlanExecutor(_plan(shuffle_seed=1, shuffle_buffer=buffer)).batches_from_examples(lambda: iter(()))
        assert list(opener()) == []


@pytest.mark.parametrize(
    "chunk",
    [
        {"pixels": np.zeros((3, F), np.float32)},  # no labels
        {"pixels": np.zeros((3, F), np.float32), "label": np.zeros(2, np.int64)},  # 3 examples or 2?
        {"pixels": np.zeros(F, np.float32)[0], "label": np.int64(1)},  # scalars: no example axis
    ],
)
def test_a_chunk_without_every_tensor_or_one_example_axis_is_refused(chunk):
    opener = EXECUTOR.batches_from_examples(lambda: [chunk])
    with pytest.raises(PlanError):
        list(opener())


@given(
    dims=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    dynamic=st.lists(st.booleans(), min_size=3, max_size=3),
    data=st.data(),
)
def test_a_graph_output_fits_its_promise_exactly_when_names_rank_sizes_and_dtype_match(dims, dynamic, data):
    promised_shape = tuple(None if dyn else d for d, dyn in zip(dims, dynamic))
    promise = {"out": (promised_shape, np.float32)}
    fitting = np.zeros(tuple(d + 1 if dyn else d for d, dyn in zip(dims, dynamic)), np.float32)
    _expect("report", {"out": fitting}, promise)
    with pytest.raises(PlanError):
        _expect("report", {"out": fitting, "extra": fitting}, promise)
    _expect("update", {"out": fitting, "extra": fitting}, promise, exact=False)
    with pytest.raises(PlanError):
        _expect("report", {"out": fitting[None]}, promise)  # one more dimension
    with pytest.raises(PlanError):
        _expect("report", {"out": fitting.astype(np.float64)}, promise)
    fixed = [i for i, d in enumerate(promised_shape) if d is not None]
    if fixed:
        i = data.draw(st.sampled_from(fixed))
        wrong = list(fitting.shape)
        wrong[i] += 1
        with pytest.raises(PlanError):
            _expect("report", {"out": np.zeros(wrong, np.float32)}, promise)


def test_examples_of_any_numeric_dtype_train_as_the_graphs_dtypes():
    native = EXECUTOR.run_device(WEIGHTS, lambda: split([6]))
    widened = EXECUTOR.run_device(
        WEIGHTS,
        lambda: [{"pixels": b["pixels"].astype(np.float64), "label": b["label"].astype(np.int32)} for b in split([6])],
    )
    for name in native.update:
        np.testing.assert_array_equal(widened.update[name], native.update[name])


def test_a_batch_whose_first_tensor_has_no_example_axis_is_refused():
    with pytest.raises(PlanError, match="batch size"):
        EXECUTOR.run_device(WEIGHTS, lambda: [{"pixels": np.float32(0.5), "label": Y[:1]}])


def test_an_executor_builds_each_graphs_session_once():
    executor = PlanExecutor(PLAN)
    work = executor._session("work")
    executor.run_device(WEIGHTS, lambda: split([]))
    assert executor._session("work") is work
    assert executor._session("zero") is executor._session("zero") is not work


def _reference_shuffle(chunks, rng, capacity):
    """The bounded shuffle as specified: the pool grows by each chunk in turn; whenever it holds
    more than ``capacity``, a random subset of the excess leaves it; at the end the rest leaves
    in random order."""
    pool = None
    for chunk in chunks:
        pool = chunk if pool is None else {k: np.concatenate([pool[k], chunk[k]]) for k in chunk}
        size = len(pool["x"])
        if size > capacity:
            perm = rng.permutation(size)
            yield {k: v[perm[: size - capacity]] for k, v in pool.items()}
            pool = {k: v[perm[size - capacity :]] for k, v in pool.items()}
    if pool is not None and len(pool["x"]):
        perm = rng.permutation(len(pool["x"]))
        yield {k: v[perm] for k, v in pool.items()}


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 12), max_size=20), capacity=st.integers(2, 40), seed=st.integers(0, 2**32 - 1))
def test_the_shuffle_takes_the_order_its_specification_gives(sizes, capacity, seed):
    from device_runtime.batching import _shuffle

    def chunks():
        start = 0
        for n in sizes:
            ids = np.arange(start, start + n)
            start += n
            yield {"x": ids.astype(np.float32), "y": ids}

    ours = [c["y"].tolist() for c in _shuffle(chunks(), np.random.default_rng(seed), capacity)]
    spec = [c["y"].tolist() for c in _reference_shuffle(chunks(), np.random.default_rng(seed), capacity)]
    assert ours == spec


def test_the_server_graphs_take_values_of_any_dtype_and_layout_as_their_inputs_declare():
    """A server hands the graphs what it decoded or loaded: float64 where the graph reads float32,
    float32 where it keeps a float64 accumulator, arrays that are not contiguous. Each value is
    converted to its input's declared dtype, so the aggregate and the new state are those of the
    values in the graphs' own dtypes."""
    update = EXECUTOR.run_device(EXECUTOR.prepare(WEIGHTS), lambda: iter(split([]))).update
    acc = EXECUTOR.accumulate(EXECUTOR.zero(), update)
    doubles = {name for name, double, _ in EXECUTOR._graph_io("accumulate")[0] if double}
    assert doubles, "the plan keeps no float64 accumulator: the test would not reach one"

    def other(values: dict) -> dict:
        """float32 as float64, float64 that float32 holds exactly as float32, every matrix as a
        Fortran-ordered copy."""
        out = {}
        for k, v in values.items():
            v = np.asarray(v)
            narrow = v.astype(np.float32)
            flipped = v.astype(np.float64) if v.dtype == np.float32 else narrow if np.array_equal(narrow, v) else v
            out[k] = np.asfortranarray(flipped) if flipped.ndim == 2 else flipped
        return out

    exact_acc = {k: np.asarray(v, np.float32).astype(v.dtype) for k, v in acc.items()}
    for k, v in EXECUTOR.accumulate(exact_acc, update).items():
        np.testing.assert_array_equal(EXECUTOR.accumulate(other(exact_acc), other(update))[k], v)
    for k, v in EXECUTOR.report(exact_acc).items():
        np.testing.assert_array_equal(EXECUTOR.report(other(exact_acc))[k], v)
    aggregate = EXECUTOR.report(exact_acc)
    state, metrics = EXECUTOR.update(WEIGHTS, aggregate)
    other_state, other_metrics = EXECUTOR.update(other(WEIGHTS), other(aggregate))
    assert other_metrics == metrics
    for k, v in state.items():
        np.testing.assert_array_equal(other_state[k], v)
