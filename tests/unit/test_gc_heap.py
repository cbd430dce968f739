"""shared.gc_heap: the start-up heap leaves the collector's scans, and what is allocated after is still collected."""

from __future__ import annotations

import gc
import weakref

import pytest

from shared.gc_heap import freeze_startup_heap

pytestmark = pytest.mark.unit


class _Node:
    pass


def test_the_startup_heap_is_frozen_and_later_garbage_is_still_collected():
    before = _Node()
    before.self = before  # a cycle alive at the freeze: frozen, out of every scan
    try:
        frozen = freeze_startup_heap("test")
        # this process's modules, functions, classes...; frozen objects still die by refcount (another test's thread
        # may free some meanwhile: CI saw 2 fewer), so the count can only fall from what the freeze reported
        assert 1000 < gc.get_freeze_count() <= frozen
        assert not any(o is before for o in gc.get_objects(generation=2))
        after = _Node()
        after.self = after
        gone = weakref.ref(after)
        del after
        gc.collect()
        assert gone() is None, "a cycle made after the freeze is collected as before"
    finally:
        gc.unfreeze()
