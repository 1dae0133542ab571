"""A watch on the ring's backlog from a thread of its own, at the engine's priority.

The consumer checks the backlog when it drains, but at a low priority on cores the engine keeps
busy, one drain's work can take it a second or more of wall time (it gets about a tenth of a
core), while a small model at thousands of tokens/s fills the ring in about as long: the check
comes too late. This thread only reads two positions of the ring's memory every WATCH_S and, when
the backlog passes the consumer's escalation threshold, raises the consumer's priority from
outside (setpriority on its thread id). It needs the GIL for that, which the consumer drops at
least every 5 ms of its own running time, so the priority is raised within one of the consumer's
time slices instead of after its drain. Its own cost: WATCH_S wakeups of a few microseconds.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

WATCH_S = 0.05


class RingWatch:
    def __init__(self, pending: Callable[[], float], on_backlog: Callable[[float], None]) -> None:
        """`pending`: the share of the ring not yet drained (read off the ring's memory, from this
        thread); `on_backlog`: told each reading (the consumer's escalation rule)."""
        self._pending = pending
        self._on_backlog = on_backlog
        self._stop = threading.Event()  # set by the consumer's loop, never from a signal handler
        self.readings = 0
        self._thread = threading.Thread(target=self._run, name="ring-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # the recorder lowered its own priority before this thread was made: take the engine's
        # back (root may; without CAP_SYS_NICE it stays low and only the drains escalate)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 0)
        while not self._stop.wait(WATCH_S):
            try:
                share = self._pending()
            except (ValueError, OSError):  # the ring is gone (closed at detach)
                return
            self.readings += 1
            self._on_backlog(share)

    def close(self) -> None:
        """Stop watching (before the ring is unmapped)."""
        self._stop.set()
        self._thread.join(timeout=5)
