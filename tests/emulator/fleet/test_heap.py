"""A run freezes the heap and defers full collections, and leaves the collector as it found it,
also when the run fails."""

from __future__ import annotations

import gc

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
