"""What a simulated device keeps small: its random streams and its example store, which is
filled only when first read."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from emulator.fleet.sim_device import LazyExampleStore, StreamRandom
from example_store import ExampleSelector, InMemoryExampleStore

seeds = st.integers(0, 2**64 - 1)


@given(seed=seeds, k=st.integers(1, 200), lo=st.floats(-1e6, 1e6), width=st.floats(0, 1e6))
def test_a_stream_repeats_from_its_seed_and_stays_in_range(seed, k, lo, width):
    a, b = StreamRandom(seed), StreamRandom(seed)
    xs = [a.random() for _ in range(20)]
    assert xs == [b.random() for _ in range(20)]
    assert all(0.0 <= x < 1.0 for x in xs)
    assert a.getrandbits(k) == b.getrandbits(k) < 2**k
    assert lo <= a.uniform(lo, lo + width) <= lo + width
    assert 0 <= a.randrange(k) < k
    assert a.expovariate(1.0) >= 0.0


@given(seed=seeds)
def test_neighbouring_seeds_give_unrelated_streams(seed):
    other = (seed + 1) % 2**64
    a, b = StreamRandom(seed), StreamRandom(other)
    assert [a.getrandbits(64) for _ in range(4)] != [b.getrandbits(64) for _ in range(4)]


def test_a_stream_is_uniform_enough_for_the_fault_model():
    rng = StreamRandom(7)
    xs = np.array([rng.random() for _ in range(20_000)])
    counts = np.histogram(xs, bins=10, range=(0.0, 1.0))[0]
    # chi-square with 9 degrees of freedom: 27.9 is its 0.1% tail
    assert ((counts - 2000) ** 2 / 2000).sum() < 27.9


@given(n=st.integers(1, 60), seed=st.integers(0, 2**32 - 1), limit=st.integers(1, 80))
def test_the_lazy_store_answers_as_the_store_filled_at_start(n, seed, limit):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = rng.integers(0, 10, size=n).astype(np.int64)
    loads = []

    def examples():
        loads.append(1)
        return x, y

    lazy = LazyExampleStore("app:/ex", examples, clock=lambda: 100.0)
    assert loads == []  # nothing is built before the store is read
    eager = InMemoryExampleStore(clock=lambda: 100.0)
    eager.add("app:/ex", ({"x": xi, "y": yi} for xi, yi in zip(x, y)))
    selector = ExampleSelector("app:/ex", limit=limit)
    assert lazy.count(selector) == eager.count(selector) == min(n, limit)
    got = [(e["x"].tobytes(), int(e["y"])) for e in lazy.query(selector)]
    want = [(e["x"].tobytes(), int(e["y"])) for e in eager.query(selector)]
    assert got == want
    assert lazy.collections() == ["app:/ex"] and loads == [1]
