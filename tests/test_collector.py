"""session/collector.py: the cyclic collector off while the consumer runs, run after flushes."""

from __future__ import annotations

import gc
import weakref

from sparseety_prof.session import collector
from sparseety_prof.session.collector import FlushTimedCollector


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    """A reference cycle nothing else holds: only the cyclic collector frees it."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_cycles_wait_for_a_flush_and_the_collector_is_left_as_found() -> None:
    assert gc.isenabled()
    c = FlushTimedCollector()
    c.start()
    try:
        assert not gc.isenabled()
        ref = _cycle()
        for _ in range(20_000):  # far past the automatic threshold (700 allocations)
            _Node()
        assert ref() is not None  # no automatic pass freed it
        c.after_flush()
        assert ref() is None and c.collections == 1
    finally:
        c.stop()
    assert gc.isenabled()


def test_every_full_every_th_flush_collects_the_oldest_generation_too() -> None:
    """A cycle that survived young collections (moved to the oldest generation) is freed by the
    full collection every FULL_EVERY flushes."""
    c = FlushTimedCollector()
    c.start()
    try:
        ref = _cycle()
        gc.collect(1)  # ... survives nothing: it is garbage, so a young pass frees it at once
        assert ref() is None
        keep = [_Node()]
        keep[0].other = keep[0]  # a cycle held alive while young passes run: moves to gen 2
        ref = weakref.ref(keep[0])
        for _ in range(3):
            gc.collect(1)
        keep.clear()
        for _ in range(collector.FULL_EVERY - 1):
            c.after_flush()
        assert ref() is not None  # only young passes so far
        c.after_flush()
        assert ref() is None and c.collections == collector.FULL_EVERY
    finally:
        c.stop()
    assert gc.isenabled()
