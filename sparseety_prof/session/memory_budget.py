"""The consumer's memory against `--max-memory` (default 256 MiB of anonymous memory).

What grows with the load is the rows gathered between two flushes (`--flush-interval`, 10 s by
default: at a few thousand tokens a second in full mode, tens of MiB of Python rows) and the
allocator's free pages kept after them; the rest is fixed (Python, Polars, BCC's libraries, the
ring's arenas) or bounded by its own flag (`--policy-window`, the aggregates' fold). So when a
drain finds the anonymous memory (RSS less file-backed and shared pages: what the recorder itself
allocated) above the budget, the recorder writes the gathered rows out at once, as a flush due
would, and hands freed heap back to the kernel (glibc's malloc_trim). Such flushes are at least
PRESSURE_GAP_S apart, so a budget set below what the recorder needs at rest costs a segment every
few seconds, not one per drain; that case is reported once and counted.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

DEFAULT_MAX_MEMORY = 256 << 20
MIN_MAX_MEMORY = 64 << 20  # Python, Polars and BCC's libraries alone hold more than this
PRESSURE_GAP_S = 2.0
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> tuple[int, int]:
    """The calling process's resident memory and its anonymous part (statm: resident - shared),
    from one small read; zeros when /proc cannot say."""
    try:
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        resident, shared = int(fields[1]), int(fields[2])
    except (OSError, ValueError, IndexError):
        return 0, 0
    return resident * _PAGE_BYTES, (resident - shared) * _PAGE_BYTES


def anon_bytes() -> int:
    """The calling process's resident anonymous memory (resident_bytes)."""
    return resident_bytes()[1]


def trim_heap() -> None:
    """Give the heap's free pages back to the kernel (glibc); elsewhere nothing to do."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


class MemoryBudget:
    """When to relieve memory pressure, and the account of it for meta.json."""

    def __init__(self, limit_bytes: int | None) -> None:
        self.limit = limit_bytes
        self.peak = 0
        self.pressure_flushes = 0
        self.over_after_flush = 0  # pressure flushes that did not bring it under the budget
        self._last_flush = float("-inf")

    def pressed(self, anon: int, now: float) -> bool:
        """Whether a drain that found `anon` bytes at `now` (monotonic seconds) should flush."""
        self.peak = max(self.peak, anon)
        if self.limit is None or anon <= self.limit or now - self._last_flush < PRESSURE_GAP_S:
            return False
        self._last_flush = now
        self.pressure_flushes += 1
        return True

    def relieved(self, anon: int) -> bool:
        """After a pressure flush: True when it brought the memory under the budget. The first
        time it did not, the caller says so (the budget is below what the recorder needs)."""
        self.peak = max(self.peak, anon)
        if self.limit is not None and anon > self.limit:
            self.over_after_flush += 1
            return False
        return True

    def meta(self) -> dict[str, Any]:
        return {
            "max_memory_bytes": self.limit,
            "anon_peak_bytes": self.peak,
            "pressure_flushes": self.pressure_flushes,
            "over_after_flush": self.over_after_flush,
        }
