"""What a plan's examples may take of a device's memory, whatever its server asks: one batch, and
the shuffle buffer, each at most an eighth of the device's own memory (``examples_share``).

- A plan whose batch cannot fit is refused when it loads (``OverBudget``), before a single example
  is read, and leaves nothing behind; the device trains an honest plan next.
- A batch larger than ``READ_AT_ONCE_MAX`` examples is read in pieces, counted as they come: the
  session ends in ``OverBudget`` one piece past the share, not once the whole batch was read; an
  honest large batch trains exactly the batches the store would have given at once.
- Examples held as Python objects (strings, bytes) count at their objects' bytes, not at the
  pointers ``nbytes`` counts.
- The shuffle buffer's bound is the device's own share: a small device holds less."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime import DeviceClass, FLRuntime, OpStatsStore, Outcome, OverBudget, initial_weights
from device_runtime.batching import SHUFFLE_MAX_BYTES, _shuffle, examples_share, held_bytes
from device_runtime.executor import PlanExecutor
from device_runtime.reading import READ_AT_ONCE_MAX, ExampleReading, MemoryResumptionTokens
from example_store import InMemoryExampleStore
from tests.device_runtime.test_hostile_plans import HostileServer
from tests.support import COLLECTION, digits_plan

PER_EXAMPLE = 64 * 4 + 8  # what the digits plan feeds: 64 float32 pixels and an int64 label


class CountedStore(InMemoryExampleStore):
    """The package's in-memory store, counting the examples it handed out."""

    def __init__(self, n: int, dtype=np.float32) -> None:
        super().__init__(clock=lambda: 100.0)
        rng = np.random.default_rng(0)
        self.add_columns(COLLECTION, {"x": rng.random((n, 64)).astype(dtype), "y": np.arange(n) % 10})
        self.handed_out = 0

    def query_batches(self, selector, batch_size):
        outer = self

        class Counted:
            def __init__(self, inner):
                self.inner = inner

            def __iter__(self):
                return self

            def __next__(self):
                batch = next(self.inner)
                outer.handed_out += len(batch["y"])
                return batch

            def resumption_token(self):
                return self.inner.resumption_token()

            def close(self):
                self.inner.close()

        return Counted(super().query_batches(selector, batch_size))


def test_the_share_is_an_eighth_of_the_devices_memory_and_a_default_devices_is_the_shuffle_bound():
    assert examples_share(2048) == SHUFFLE_MAX_BYTES == 256 << 20
    assert examples_share(16) == 2 << 20
    assert examples_share(DeviceClass().memory_mb) == SHUFFLE_MAX_BYTES


def test_a_plan_whose_batch_cannot_fit_is_refused_before_an_example_is_read(tmp_path):
    """A batch of 20,000 digits (5 MB as fed) on a device that holds 2 MB of examples: its work graph
    makes no tensor the load's check refuses (the logits are 0.8 MB), and the device read the whole
    batch in one chunk before it checked anything."""
    store = CountedStore(20_000)
    server = HostileServer([digits_plan(batch_size=20_000, epochs=1), digits_plan()])
    small = DeviceClass("small", memory_mb=16)
    cache = tmp_path / "cache"
    opstats = OpStatsStore(tmp_path / "app.db")
    with FLRuntime(
        "digits", "http://fl.test", store, transport=server, device_class=small, cache_dir=cache, opstats=opstats
    ) as runtime:
        with pytest.raises(
            OverBudget,
            match=r"trains on batches of 20,000 examples, 5 MB at least; a small device holds 2 MB of examples "
            r"at once \(an eighth of its 16",
        ):
            runtime.run_session()
        assert store.handed_out == 0 and server.aborts == 1 and server.reports == 0
        assert not runtime._plans and not runtime.loaded_plans._loaded  # refused as other plans over budget
        assert not (cache / "plans").exists() or not list((cache / "plans").iterdir())
        assert runtime.run_session().outcome is Outcome.COMPLETED  # the next session, an honest plan
    assert [s.shape for s in opstats.sessions()] == ["-*", "-v[]+^"]


def test_a_batch_larger_than_its_plan_tells_is_counted_as_it_is_read_and_refused_past_the_share():
    """The plan feeds float32 pixels (264 bytes an example: 2,500 of them are 0.6 MB), the store
    keeps float64 ones (520 bytes: 1.2 MB), on a device that holds 1 MB of examples: the load's
    check passes the plan, and the device read the whole batch in one chunk."""
    store = CountedStore(5_000, dtype=np.float64)
    plan = digits_plan(batch_size=2_500, epochs=1)
    share = examples_share(8)
    assert 2_500 * PER_EXAMPLE <= share < 2_500 * (64 * 8 + 8)
    reading = ExampleReading.start(
        store, plan.device, population="p", task="t", keeper=MemoryResumptionTokens(), max_batch_bytes=share
    )
    with pytest.raises(OverBudget, match=r"a batch of 2,500 examples holds more than this device gives .* \(1 MB\)"):
        next(iter(reading.open_batches()))
    assert store.handed_out == 2 * READ_AT_ONCE_MAX  # one piece past the share, not the batch
    reading.close()


def test_a_batch_over_the_share_ends_the_session_in_over_budget_and_the_device_trains_the_next_plan(tmp_path):
    store = CountedStore(3_000, dtype=np.float64)
    server = HostileServer([digits_plan(batch_size=2_500, epochs=1), digits_plan()])
    opstats = OpStatsStore(tmp_path / "app.db")
    device = DeviceClass("small", memory_mb=8)
    with FLRuntime(
        "digits", "http://fl.test", store, transport=server, device_class=device, opstats=opstats
    ) as runtime:
        with pytest.raises(OverBudget, match="a batch of 2,500 examples holds more"):
            runtime.run_session()
        assert server.aborts == 1 and server.reports == 0
        assert runtime.run_session().outcome is Outcome.COMPLETED
    assert [s.shape for s in opstats.sessions()] == ["-v[*", "-v[]+^"]


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(READ_AT_ONCE_MAX + 1, 4 * READ_AT_ONCE_MAX),
    batch_size=st.integers(READ_AT_ONCE_MAX + 1, 3 * READ_AT_ONCE_MAX),
    buffer=st.sampled_from([0, 1, 1024, 4096]),
    seed=st.integers(0, 2**31 - 1),
)
def test_an_honest_large_batch_read_in_pieces_trains_the_batches_of_one_read(n, batch_size, buffer, seed):
    plan = digits_plan(batch_size=batch_size, epochs=1, shuffle_seed=seed, shuffle_buffer=buffer)
    store = CountedStore(n)
    executor = PlanExecutor(plan)
    reading = ExampleReading.start(
        store, plan.device, population="p", task="t", keeper=MemoryResumptionTokens(), max_batch_bytes=1 << 40
    )
    pieces = [{k: v.tobytes() for k, v in b.items()} for b in executor.batches_from_examples(reading.open_batches)()]
    whole = executor.batches_from_examples(lambda: store.query_batches(plan.device.selector, batch_size))
    assert pieces == [{k: v.tobytes() for k, v in b.items()} for b in whole()]


def test_examples_held_as_python_objects_count_at_their_bytes():
    texts = np.array([b"x" * 10_000 for _ in range(20)], dtype=object)
    assert texts.nbytes == 160 and held_bytes(texts) > 20 * 10_000
    assert held_bytes(np.zeros((20, 8), np.float32)) == 640
    # the shuffle's bound counts them so: 50 texts of 10 KB fit where 60 were asked for
    chunks = [{"text": np.array([b"x" * 10_000] * 10, dtype=object), "label": np.arange(10)} for _ in range(20)]
    emitted = []
    read = 0
    held = []

    def counted():
        nonlocal read
        for chunk in chunks:
            read += 10
            yield chunk

    for out in _shuffle(counted(), np.random.default_rng(0), 10**9, 50 * 10_100):
        emitted.append(len(out["label"]))
        held.append(read - sum(emitted))
    assert max(held) == 50 and sum(emitted) == 200


def _loss_with(plan, store, max_held_bytes: int) -> float:
    executor = PlanExecutor(plan)
    reading = ExampleReading.start(store, plan.device, population="p", task="t", keeper=MemoryResumptionTokens())
    result = executor.run_device(
        initial_weights(plan, seed=0),
        executor.batches_from_examples(reading.open_batches, max_held_bytes=max_held_bytes),
    )
    reading.close()
    return result.metrics["loss"]


def test_the_shuffle_of_a_small_device_holds_its_own_share(tmp_path):
    """600 examples (158 KB) under a buffer of 10^9 on a device of 1 MB (128 KB of examples): the
    device shuffles through what its share holds, as its session's loss shows; it held all 600,
    the share of a default device."""
    store = CountedStore(600)
    plan = digits_plan(epochs=1, shuffle_seed=3, shuffle_buffer=10**9)
    plan = dataclasses.replace(plan, name="hostile_buffer")
    own, default = _loss_with(plan, store, examples_share(1)), _loss_with(plan, store, SHUFFLE_MAX_BYTES)
    assert own != default
    server = HostileServer([plan])
    with FLRuntime(
        "digits", "http://fl.test", store, transport=server, device_class=DeviceClass("tiny", memory_mb=1)
    ) as runtime:
        result = runtime.run_session()
    assert result.outcome is Outcome.COMPLETED and result.metrics["loss"] == own


def test_a_session_of_many_epochs_keeps_one_iterator_not_one_per_epoch(tmp_path):
    """A plan of 10^9 epochs over one example (stopped at the device's training time) kept every
    epoch's closed iterator until the session ended: 1 MB more a second."""
    from example_store import SQLiteExampleStore

    with SQLiteExampleStore(tmp_path / "examples.db") as store:
        store.add(COLLECTION, [{"x": np.zeros(64, np.float32), "y": 1}])
        plan = digits_plan(epochs=200, resume_examples=True)
        executor = PlanExecutor(plan)
        reading = ExampleReading.start(store, plan.device, population="p", task="t", keeper=MemoryResumptionTokens())
        result = executor.run_device(initial_weights(plan), executor.batches_from_examples(reading.open_batches))
        assert result.num_examples == 1
        assert len(reading._opened) == 1
        reading.training_completed()
        assert reading.position() is not None  # the last epoch's iterator, read to its end
        reading.close()


def test_a_large_batch_whose_pieces_disagree_in_shape_ends_in_the_sdks_error():
    """An app's store whose examples change shape between two pieces of one batch: numpy's
    ValueError joining them, not one of the SDK's errors."""
    from device_runtime import PlanError
    from tests.device_runtime.test_app_example_stores import ListExampleStore

    wide = [(float(i), {"x": np.zeros(64, np.float32), "y": np.int64(1)}) for i in range(READ_AT_ONCE_MAX)]
    narrow = [(float(i), {"x": np.zeros(32, np.float32), "y": np.int64(1)}) for i in range(READ_AT_ONCE_MAX, 1500)]
    store = ListExampleStore(COLLECTION, wide + narrow)
    plan = digits_plan(batch_size=1500, epochs=1)
    reading = ExampleReading.start(store, plan.device, population="p", task="t", keeper=MemoryResumptionTokens())
    with pytest.raises(
        PlanError, match=r"example tensor 'x' holds examples of shape \(64,\) and \(32,\), which no batch"
    ):
        next(iter(reading.open_batches()))
    reading.close()


def test_an_examples_bytes_are_counted_without_wrapping_around():
    """Dims of 2^32 x 2^32 made 0 in int64: a plan's batch of them passed the device's check."""
    import onnx

    plan = digits_plan()
    assert PlanExecutor(plan).example_bytes() == PER_EXAMPLE
    model = onnx.ModelProto.FromString(plan.work)
    x = next(v for v in model.graph.input if v.name == "x")
    x.type.tensor_type.shape.dim[1].dim_value = 2**32
    x.type.tensor_type.shape.dim.add().dim_value = 2**32
    wide = dataclasses.replace(plan, work=model.SerializeToString())
    assert PlanExecutor(wide).example_bytes() == 2**64 * 4 + 8
