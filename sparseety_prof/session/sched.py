"""Where the consumer's CPU comes from while it records."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from sparseety_prof.session.options import Options, Progress
from sparseety_prof.session.sched_slice import set_thread_slice, thread_slice_us


class ConsumerSched:
    """Where the consumer's CPU comes from. It runs at a low priority (`--nice`, default 10), or
    with `--sched idle` as SCHED_IDLE (only CPU the engine leaves idle), so that the engine's
    threads win contention. A low priority can starve it for seconds while the engine keeps every
    core busy (the live view and meta.json show the longest gap, `drain_gap_max_ms`), and the ring
    holds about 1.5 s of tokens: when one drain finds the ring filling (ESCALATE_FILL), the consumer
    takes the engine's own priority (nice 0, SCHED_OTHER) until it has caught up (RELAX_FILL):
    losing records is worse than taking a few percent of the engine's time. Escalations are
    counted in meta.json ("consumer"). With `--slice-us`, it asks for that CPU slice while it runs
    as SCHED_OTHER (sched_slice.py)."""

    ESCALATE_FILL = 0.5
    RELAX_FILL = 0.1

    def __init__(self, opts: Options, progress: Progress) -> None:
        self.progress = progress
        self.mode = opts.sched
        self.nice = opts.nice
        self.tid = threading.get_native_id()
        self.escalated = False
        self.slice_us = opts.slice_us
        self.slice_set = False
        if self.mode == "idle":
            self._policy(os.SCHED_IDLE)
        else:
            self._short_slice()

    def _short_slice(self) -> None:
        if self.slice_us:
            self.slice_set = set_thread_slice(self.tid, self.slice_us) or self.slice_set

    def _policy(self, policy: int) -> None:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, policy, os.sched_param(0))  # this thread: the consumer

    def _niceness(self, value: int) -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, self.tid, value)  # Linux: a TID sets one thread

    def on_backlog(self, backlog: float) -> None:
        if not self.escalated and backlog > self.ESCALATE_FILL:
            self._escalate()

    def _escalate(self) -> None:
        self.escalated = True
        self.progress.escalations += 1
        if self.mode == "idle":
            self._policy(os.SCHED_OTHER)
            self._short_slice()
        self._niceness(0)

    def after_drain(self, fill: float, gap_ms: float) -> None:
        p = self.progress
        p.ring_fill_peak = max(p.ring_fill_peak, fill)
        p.drain_gap_max_ms = max(p.drain_gap_max_ms, gap_ms)
        if not self.escalated and fill > self.ESCALATE_FILL:
            self._escalate()
        elif self.escalated and fill < self.RELAX_FILL:
            self.escalated = False
            self._niceness(self.nice)
            if self.mode == "idle":
                self._policy(os.SCHED_IDLE)

    def meta(self) -> dict[str, Any]:
        p = self.progress
        return {
            "sched": self.mode,
            "nice": self.nice,
            "ring_fill_peak": round(p.ring_fill_peak, 4),
            "drain_gap_max_ms": round(p.drain_gap_max_ms, 1),
            "escalations": p.escalations,
            "slice_us_asked": self.slice_us,
            # what the kernel held at the end (its default where no slice was set or kept)
            "slice_us": thread_slice_us(self.tid) if self.slice_set else None,
        }
