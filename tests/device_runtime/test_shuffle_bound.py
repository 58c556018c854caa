"""A plan's shuffle buffer is bounded by the device's memory: a hostile plan asking for 10^9
examples holds at most what fits in the device's share (``SHUFFLE_MAX_BYTES``) and still trains,
while an honest plan's buffer shuffles exactly as it did before the bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime.batching import SHUFFLE_MAX_BYTES, _chunks, _shuffle, batches_from_examples
from device_runtime.executor import PlanExecutor
from device_runtime.plan import DeviceConfig
from device_runtime.plan_builder import build_mlp_plan, initial_weights
from device_runtime.reading import READ_AT_ONCE_MAX, ExampleReading, MemoryResumptionTokens
from example_store import ExampleSelector, InMemoryExampleStore, SQLiteExampleStore

URI = "app:/images"
F, C = 16, 3
N = 3000
PER_EXAMPLE = F * 4 + 8  # float32 pixels and an int64 label
HOSTILE = 10**9


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, F)).astype(np.float32)
    x[:, 0] = np.arange(N)  # each example's id, to see which ones came out
    y = rng.integers(0, C, N)
    with SQLiteExampleStore(tmp_path_factory.mktemp("shuffle") / "examples.db") as s:
        s.add(URI, ({"pixels": x[i], "label": np.int64(y[i])} for i in range(N)))
        yield s


def _plan(**kwargs):
    args = dict(
        learning_rate=0.1,
        batch_size=16,
        epochs=1,
        selector=ExampleSelector(URI),
        inputs={"x": "pixels", "y": "label"},
        shuffle_seed=7,
        shuffle_buffer=HOSTILE,
    )
    args.update(kwargs)
    return build_mlp_plan(F, (4,), C, **args)


def _held(source, capacity: int, max_bytes: int):
    """Run the shuffle over ``source`` and return, after each chunk it emits, how many examples
    it has read and not yet emitted (what it holds), with the ids it emitted."""
    read = [0]

    def counted():
        for chunk in source:
            read[0] += len(chunk["label"])
            yield chunk

    held, ids = [], []
    for out in _shuffle(counted(), np.random.default_rng(1), capacity, max_bytes):
        ids.extend(out["pixels"][:, 0].astype(int).tolist())
        held.append(read[0] - len(ids))
    return held, ids


def test_a_hostile_shuffle_buffer_holds_at_most_the_devices_share(store):
    plan = _plan()
    cap = 200
    reading = ExampleReading.start(store, plan.device, population="p", task="t", keeper=MemoryResumptionTokens())
    assert reading.available == N > READ_AT_ONCE_MAX
    chunk_sizes = []

    def source():
        for chunk in _chunks(reading.open_batches(), ["pixels", "label"], True):
            chunk_sizes.append(len(chunk["label"]))
            yield chunk

    held, ids = _held(source(), plan.device.shuffle_buffer, cap * PER_EXAMPLE)
    # the selection was read in batches of the plan's batch size, not in one chunk of everything
    assert max(chunk_sizes) == plan.device.batch_size
    # the shuffle held the cap's examples, never the collection (the last emission empties it)
    assert max(held) == cap and held[-1] == 0
    assert sorted(ids) == list(range(N))  # every example came out once
    reading.close()


def test_the_bound_follows_the_largest_examples_read_so_far():
    # chunks whose examples grow (float16, then float64 pixels): the buffer shrinks to what fits
    # the widest examples read
    narrow = {"pixels": np.zeros((50, 8), np.float16), "label": np.arange(50)}
    wide = {"pixels": np.zeros((50, 8), np.float64), "label": np.arange(50)}
    cap = 60 * (8 * 8 + 8)  # 60 wide examples, 180 narrow ones
    held, _ = _held(iter([narrow, narrow, narrow]), HOSTILE, cap)
    assert held == [0]  # 150 narrow examples fit: one permutation at the end
    held, _ = _held(iter([narrow, narrow, wide, wide, wide]), HOSTILE, cap)
    assert held[0] == 60 and max(held) == 60 and held[-1] == 0


def test_a_hostile_plan_trains_over_a_store_larger_than_the_bound(store):
    plan = _plan(epochs=2)
    executor = PlanExecutor(plan)
    reading = ExampleReading.start(store, plan.device, population="p", task="t", keeper=MemoryResumptionTokens())
    opener = executor.batches_from_examples(reading.open_batches, max_held_bytes=100 * PER_EXAMPLE)
    result = executor.run_device(initial_weights(plan, seed=0), opener)
    assert result.num_examples == N
    assert np.isfinite(result.metrics["loss"])
    reading.close()
    # the same plan and data give the same batches: the bound depends on the examples alone
    runs = []
    for _ in range(2):
        again = ExampleReading.start(store, plan.device, population="p", task="t", keeper=MemoryResumptionTokens())
        opener = executor.batches_from_examples(again.open_batches, max_held_bytes=100 * PER_EXAMPLE)
        runs.append([b["pixels"][:, 0].tolist() for b in opener()])
        again.close()
    assert runs[0] == runs[1]
    assert sorted(i for b in runs[0] for i in b) == list(range(N))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 2500),
    batch_size=st.integers(1, 64),
    buffer=st.sampled_from([0, 1, 64, 1024, 2048, 4096]),
    chunk=st.integers(1, 300),
    width=st.integers(1, 64),
    seed=st.integers(0, 2**31 - 1),
)
def test_honest_plans_shuffle_as_before_the_bound(n, batch_size, buffer, chunk, width, seed):
    store = InMemoryExampleStore(clock=lambda: 100.0)
    x = np.arange(n * width, dtype=np.float32).reshape(n, width)
    store.add_columns(URI, {"x": x, "y": np.arange(n)})
    device = DeviceConfig(ExampleSelector(URI), batch_size, 1, seed, buffer, {"x": "x", "y": "y"})

    def chunks():
        return store.query_batches(device.selector, chunk)

    def plain(batches):
        return [{k: v.tobytes() for k, v in b.items()} for b in batches]

    # the device's bound does not bite: the batches are those of an unbounded buffer
    assert plain(batches_from_examples(device, chunks)()) == plain(
        batches_from_examples(device, chunks, max_held_bytes=1 << 62)()
    )
    # and a session's reading (in one chunk or in batches) trains the batches of one chunk
    reading = ExampleReading.start(store, device, population="p", task="t", keeper=MemoryResumptionTokens())
    at_once = batches_from_examples(device, lambda: store.query_batches(device.selector, max(n, batch_size)))
    if buffer > 1 and n <= buffer:
        assert plain(batches_from_examples(device, reading.open_batches)()) == plain(at_once())


def test_an_honest_default_buffer_of_images_fits_the_bound():
    # 1,024 examples of a 224 x 224 x 3 image and a label: the default buffer is not cut
    assert 1024 * (224 * 224 * 3 + 8) <= SHUFFLE_MAX_BYTES
