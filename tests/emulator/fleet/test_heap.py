"""A run freezes the heap and defers full collections, and leaves the collector as it found it,
also when the run fails."""

from __future__ import annotations

import gc
import weakref

import pytest

from emulator.fleet.heap import RUN_FULL_COLLECTION_EVERY, long_lived_heap


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_collector_is_restored_after_a_run_and_after_a_failed_one():
    before = gc.get_threshold()
    with long_lived_heap():
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (before[0], before[1], RUN_FULL_COLLECTION_EVERY)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), long_lived_heap():
        raise RuntimeError("the run failed")
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_young_cycles_are_still_collected_during_a_run():
    with long_lived_heap():
        gc.collect(1)
        Cycle()
        assert gc.collect(1) >= 1  # a young collection still frees the cycle


def test_a_block_inside_another_leaves_the_outer_one_in_force():
    before = gc.get_threshold()
    with long_lived_heap():
        frozen = gc.get_freeze_count()
        with long_lived_heap():  # building the fleet inside the run: no collection of its own
            Cycle()
            # not frozen again (a freeze would add the objects made since); the count may only fall,
            # as any thread of the worker (a server left by an earlier test) frees frozen objects
            assert gc.get_freeze_count() <= frozen
        assert 0 < gc.get_freeze_count() <= frozen  # still frozen, still deferred
        assert gc.get_threshold() == (before[0], before[1], RUN_FULL_COLLECTION_EVERY)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_older_garbage_is_frozen_with_the_run_and_freed_by_the_first_full_collection_after_it():
    """Entering a run collects the young generations only (a full collection there walked the whole
    heap of a process that imported much for every run); a cycle already in the oldest generation
    stays frozen while the run lasts, and the first full collection after it frees it."""
    gc.disable()  # no automatic collection, in any thread, between the steps
    try:
        cycle = Cycle()
        freed = weakref.ref(cycle)
        gc.collect()  # the cycle, still referenced, moves to the oldest generation
        del cycle
        with long_lived_heap():
            gc.collect()
            assert freed() is not None  # frozen: no collection during the run sees it
        gc.collect()
        assert freed() is None
    finally:
        gc.enable()
