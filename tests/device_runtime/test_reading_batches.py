"""A session reads a selection that fits its plan's shuffle buffer in one chunk: the batches it
trains are those reading it in batches of the plan's batch size gives, with or without resuming,
a limit or a shuffle."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime.batching import batches_from_examples
from device_runtime.plan import DeviceConfig
from device_runtime.reading import ExampleReading, MemoryResumptionTokens
from example_store import ExampleSelector, InMemoryExampleStore


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 60),
    batch_size=st.integers(1, 9),
    buffer=st.sampled_from([0, 1, 16, 64]),
    seed=st.integers(0, 2**31 - 1),
    limit=st.none() | st.integers(1, 40),
    resume=st.booleans(),
)
def test_a_selection_read_at_once_trains_the_batches_read_in_batches_give(n, batch_size, buffer, seed, limit, resume):
    store = InMemoryExampleStore(clock=lambda: 100.0)
    store.add_columns("app:/c", {"x": np.arange(n * 2, dtype=np.float32).reshape(n, 2), "y": np.arange(n)})
    device = DeviceConfig(
        ExampleSelector("app:/c", limit=limit), batch_size, 1, seed, buffer, {"x": "x", "y": "y"}, resume
    )
    keeper = MemoryResumptionTokens()
    for _ in range(3):  # successive sessions of a resuming plan read successive slices
        reading = ExampleReading.start(store, device, population="p", task="t", keeper=keeper)
        got = list(batches_from_examples(device, reading.open_batches)())
        want = list(
            batches_from_examples(
                device, lambda selector=reading.selector: store.query_batches(selector, device.batch_size)
            )()
        )
        assert [{k: v.tolist() for k, v in b.items()} for b in got] == [
            {k: v.tolist() for k, v in b.items()} for b in want
        ]
        reading.training_completed()
        reading.commit()
