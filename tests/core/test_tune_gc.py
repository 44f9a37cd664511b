"""`clora.procs.tune_gc`: what a service holds after start-up leaves the collector's reach, young
collections come far less often, and cycles made afterwards are still freed."""

from __future__ import annotations

import gc
import weakref

import pytest

from clora.procs import GC_THRESHOLDS, tune_gc


@pytest.fixture
def restored_gc():
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


class Node:
    pass


def test_start_up_objects_are_frozen_and_later_cycles_are_still_freed(restored_gc):
    kept = [Node() for _ in range(100)]               # a service's start-up state
    tune_gc()
    assert gc.get_threshold() == GC_THRESHOLDS
    assert gc.get_freeze_count() >= len(kept)

    a, b = Node(), Node()
    a.other, b.other = b, a                          # a cycle made while serving
    gone = weakref.ref(a)
    del a, b
    assert gone() is not None                        # reference counting alone cannot free it
    gc.collect()
    assert gone() is None
