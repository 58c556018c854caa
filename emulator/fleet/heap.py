"""The garbage collector during a simulated run, and while a report's figures are drawn.

A fleet is a large heap that lives as long as the run: devices, their example stores, their
schedulers and fibers (about a million objects for 10,000 devices). CPython's full collections
walk all of it, and in a day of 10,000 devices they found a few dozen objects to free while
taking about an eighth of the run's time. During a run the heap as it stands is frozen (never
scanned again) and full collections wait until the run ends; young collections, which free the
short-lived cycles of requests and sessions, go on as usual. A run builds its fleet inside that
block (and a shard that only builds devices has a block of its own): the fleet's growth from
nothing set off nine full collections in the 10,000-device day.

Before freezing, a block collects the young generations only. A full collection there walked the
whole heap of the process, which in a process that imported much and runs many fleets (a test
worker, a notebook, a sweep) took 0.2-0.3 s of CPU a run, and found nothing to free after an
earlier run (its fleet is freed as it is released). Older garbage stays frozen while the run
lasts and goes to the first full collection after it."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

#: Collections of the middle generation between full ones while a run lasts: in effect none.
RUN_FULL_COLLECTION_EVERY = 1_000_000


_lock = threading.Lock()
_depth = 0  # blocks entered and not yet left, in any thread: the outermost one does the work
_thresholds: tuple[int, int, int] = gc.get_threshold()


@contextlib.contextmanager
def long_lived_heap() -> Iterator[None]:
    """Freeze the heap and defer full collections for the ``with`` block; both are undone on
    leaving it (also on an exception), and the next full collection sees the whole heap again.
    A block inside another does nothing of its own (a run builds its fleet inside its own)."""
    global _depth, _thresholds
    with _lock:
        _depth += 1
        if _depth == 1:
            _thresholds = gc.get_threshold()
            gc.collect(1)  # the young generations: what building the run's server left
            gc.freeze()
            gc.set_threshold(_thresholds[0], _thresholds[1], RUN_FULL_COLLECTION_EVERY)
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.set_threshold(*_thresholds)
                gc.unfreeze()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while figures are drawn. matplotlib makes tens of
    thousands of objects per figure, which live as long as the figure does (a :class:`Figure` keeps
    it): the collector, started every few hundred allocations, freed nothing and scanned the
    whole process each time it reached the oldest objects (a simulator's run among them), an
    eighth of the report's time. It runs again, as it did, once the figures are drawn."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
