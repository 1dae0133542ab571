"""Python's cyclic garbage collector, run when the consumer chooses rather than every few hundred
allocations.

The consumer allocates a few dozen Python objects per token (row tuples, per-layer lists) and
keeps them until the next flush: the collector's automatic passes kept walking those live rows, a
cost per token that scripts/replay_drains.py measures (docs/overhead.md). Almost none of them are
cycles: reference counting frees them. So while the consumer runs the automatic passes are off,
and the young generations are collected after each flush, when the rows gathered since the
last one have been handed over and the live young objects are few; every FULL_EVERY flushes,
all generations. A cycle made in between lives until then: one flush interval (10 s by
default), which the memory budget (memory_budget.py) sees like any other allocation.
"""

from __future__ import annotations

import gc

FULL_EVERY = 30


class FlushTimedCollector:
    """Between start() and stop() the automatic collector is off and after_flush() collects.
    stop() leaves it as it found it (on, in a standalone recorder)."""

    def __init__(self) -> None:
        self._was_enabled = gc.isenabled()
        self._flushes = 0
        self.collections = 0

    def start(self) -> None:
        # what was made before (modules, the vocabulary's strings, the model's metadata) lives as
        # long as the recording: out of the collector's sight for good
        gc.freeze()
        gc.disable()

    def after_flush(self) -> None:
        self._flushes += 1
        gc.collect(2 if self._flushes % FULL_EVERY == 0 else 1)
        self.collections += 1

    def stop(self) -> None:
        if self._was_enabled:
            gc.enable()
