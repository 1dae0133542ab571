"""The recorder's threads at the consumer's priority.

The consumer lowers its own thread (`--nice`, `--sched idle`) and raises it when it falls behind
(sched.py). Its work does not all run on that thread: Polars runs frames and Parquet writes on its
pool's thread (`polars-0`) and its writers' runtime (`tokio-rt-worker`, `async-executor`), and the
sinks and the model hasher have threads of their own. A thread takes the priority of the thread
that made it, once: Polars' threads, made lazily from a consumer already at SCHED_IDLE, stayed
SCHED_IDLE at nice 10 when the consumer was raised, so the raised consumer waited on them, a flush
piece of a few milliseconds of the consumer's CPU taking seconds of wall time on busy cores, with
the ring nearly full. So every change of the consumer's priority is mirrored to every thread of the
process but the ring watch's (which runs at the engine's priority throughout: ring_watch.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable


def thread_ids() -> list[int]:
    """The ids of this process's threads now (a thread may end before it is used)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task") if t.isdigit()]
    except OSError:
        return []


def mirror_priority(source_tid: int, exclude: Iterable[int] = ()) -> int:
    """Give every thread of this process but `source_tid` and `exclude` the policy and niceness
    `source_tid` has now; returns how many threads were set. Raising a priority needs root
    (CAP_SYS_NICE): without it a thread may stay lower, which only slows the recorder."""
    try:
        policy = os.sched_getscheduler(source_tid)
        nice = os.getpriority(os.PRIO_PROCESS, source_tid)
    except OSError:
        return 0
    if policy not in (os.SCHED_OTHER, os.SCHED_IDLE, os.SCHED_BATCH):
        return 0  # a real-time consumer (set from outside): its helpers are left as they are
    skip = {source_tid, *exclude}
    done = 0
    for tid in thread_ids():
        if tid in skip:
            continue
        with contextlib.suppress(OSError):  # (gone since, or not ours to raise)
            # the niceness first: a SCHED_IDLE thread made SCHED_OTHER keeps the niceness it had
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            if os.sched_getscheduler(tid) != policy:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
            done += 1
    return done
