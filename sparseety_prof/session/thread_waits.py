"""The scheduler program's per-(step, thread) records joined to the steps: the thread_waits table.

A record (capture/sched_waits.py) carries the step as the scheduler program saw it: the thread
that ran it and its start and end, taken on the same trap as the token probes' own (a few
microseconds apart). Its step is the steps row of that thread whose window holds the record's
midpoint. A record whose step has not arrived yet waits (the main ring may be drained before the
step's records reach it); one older than every step of its thread still to come, or than HOLD_S,
or still unjoined at the end, is counted unjoined (a step the policy set apart, or whose records
were lost).
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from sparseety_prof.capture.bpf_loader import Session
from sparseety_prof.capture.sched_waits import WAIT_DTYPE, SchedWaits, StepTrap, load_program, step_trap
from sparseety_prof.errors import ProfError
from sparseety_prof.store import schema

HOLD_S = 30.0
#: steps kept per thread to join records to (a drain's worth and more)
STEPS_KEPT = 4096
_COLUMNS = schema.columns(
    "thread_waits",
    "step_id",
    "pid",
    "tid",
    "step_thread",
    "on_cpu_ns",
    "runnable_ns",
    "sleep_ns",
    "stopped_ns",
    "waited_recorder_ns",
    "waited_engine_ns",
    "waited_other_ns",
    "top_pid",
    "top_comm",
    "top_ns",
)
schema.check_columns("thread_waits", _COLUMNS)
# record field -> column, for the durations
_DURATIONS = {
    "on_ns": "on_cpu_ns",
    "run_ns": "runnable_ns",
    "sleep_ns": "sleep_ns",
    "stop_ns": "stopped_ns",
    "rec_ns": "waited_recorder_ns",
    "eng_ns": "waited_engine_ns",
    "oth_ns": "waited_other_ns",
}


class StepWindows:
    """The latest steps of each thread that runs steps: (start, end, step_id), in start order."""

    def __init__(self) -> None:
        self._starts: dict[int, list[int]] = {}
        self._steps: dict[int, list[tuple[int, int, int]]] = {}

    def add(self, steps: Mapping[str, list[Any]]) -> None:
        cols = [steps.get(c) or [] for c in ("tid", "t_start_ns", "t_end_ns", "step_id")]
        for tid, t0, t1, sid in zip(*cols, strict=True):
            if tid is None or t0 is None or t1 is None or sid is None:
                continue
            starts = self._starts.setdefault(int(tid), [])
            steps_of = self._steps.setdefault(int(tid), [])
            at = bisect.bisect_right(starts, int(t0))
            starts.insert(at, int(t0))
            steps_of.insert(at, (int(t0), int(t1), int(sid)))
            if len(starts) > STEPS_KEPT:
                del starts[0], steps_of[0]

    def at(self, tid: int, t: int) -> int | None:
        """The step_id of `tid`'s step whose window holds `t`."""
        starts = self._starts.get(tid)
        if not starts:
            return None
        i = bisect.bisect_right(starts, t) - 1
        if i < 0:
            return None
        t0, t1, sid = self._steps[tid][i]
        return sid if t0 <= t <= t1 else None

    def latest_end(self, tid: int) -> int:
        steps_of = self._steps.get(tid)
        return steps_of[-1][1] if steps_of else 0


class ThreadWaits:
    """Records taken from `waits` joined to the steps given (add_steps), as thread_waits rows."""

    def __init__(
        self, waits: SchedWaits, *, hold_s: float = HOLD_S, clock: Callable[[], int] = time.monotonic_ns
    ) -> None:
        self.waits = waits
        self._windows = StepWindows()
        self._pending = np.zeros(0, WAIT_DTYPE)
        self._hold_ns = int(hold_s * 1e9)
        self._clock = clock
        self.joined = 0
        self.unjoined = 0
        self._losses: dict[str, int] = {}
        self._programs: dict[str, dict[str, int]] = {}

    def add_steps(self, steps: Mapping[str, list[Any]]) -> None:
        self._windows.add(steps)

    def poll(self, *, final: bool = False) -> schema.Tables:
        """The records taken now and those waiting, joined: {"thread_waits": columns} (empty when
        none joined)."""
        recs = np.concatenate([self._pending, self.waits.take()])
        return self.join(recs, final=final)

    def join(self, recs: np.ndarray, *, final: bool = False) -> schema.Tables:
        """`recs` (WAIT_DTYPE) joined; the rest kept for later, or counted unjoined."""
        now = self._clock()
        sids: list[int] = []
        rows: list[int] = []
        keep: list[int] = []
        mids = (recs["t_start"] // 2 + recs["t_end"] // 2).tolist()
        for i, (tid, mid, end) in enumerate(
            zip(recs["step_tid"].tolist(), mids, recs["t_end"].tolist(), strict=True)
        ):
            sid = self._windows.at(tid, mid)
            if sid is not None:
                sids.append(sid)
                rows.append(i)
            elif not final and end > self._windows.latest_end(tid) and now - end < self._hold_ns:
                keep.append(i)  # its step has not arrived yet
            else:
                self.unjoined += 1
        self._pending = recs[keep]
        self.joined += len(rows)
        if not rows:
            return {}
        r = recs[rows]
        cols: dict[str, list[Any]] = {
            "step_id": sids,
            "pid": [self.waits.pid] * len(rows),
            "tid": r["tid"].astype(np.int64).tolist(),
            "step_thread": (r["tid"] == r["step_tid"]).tolist(),
        }
        for field, col in _DURATIONS.items():
            cols[col] = r[field].astype(np.int64).tolist()
        named = r["top_tgid"] != 0
        cols["top_pid"] = [
            int(p) if n else None for p, n in zip(r["top_tgid"].tolist(), named.tolist(), strict=True)
        ]
        cols["top_comm"] = [
            c.decode(errors="replace") if n else None
            for c, n in zip(r["top_comm"].tolist(), named.tolist(), strict=True)
        ]
        cols["top_ns"] = [
            int(v) if n else None for v, n in zip(r["top_ns"].tolist(), named.tolist(), strict=True)
        ]
        return {"thread_waits": cols}

    def rows(self, steps: Mapping[str, list[Any]], *, final: bool = False) -> schema.Tables:
        """One drain's steps in, the rows joined so far out."""
        self.add_steps(steps)
        return self.poll(final=final)

    def stop(self) -> None:
        """The counts of what was lost, read while the program is loaded."""
        self._losses = self.waits.losses()
        self._programs = self.waits.program_costs()

    def meta(self) -> dict[str, Any]:
        """meta.json `sched_waits`."""
        return {
            "rows": self.joined,
            "records_unjoined": self.unjoined,
            "compile_s": round(self.waits.compile_s, 3),
            **(self._losses or self.waits.losses()),
            # with --bpf-stats: its programs' runs and run time (the kernel's counts)
            "programs": self._programs,
        }

    def close(self) -> None:
        self.waits.close()


class ProgramLoad:
    """The scheduler program compiled and loaded (capture/sched_waits.py load_program) before the
    token probes attach: its compile then delays the attach, not the first drain after it, while
    records would pile up in the ring (BCC cannot compile two programs at once in one process).
    `take()` hands the program over once; `discard()` unloads it when nobody took it."""

    def __init__(self, on: bool, pid: int, recorder_pid: int) -> None:
        self._result: tuple[Any, float] | None = None
        self._error: ProfError | None = None
        self._taken = not on
        if on:
            try:
                self._result = load_program(pid, recorder_pid)
            except ProfError as e:
                self._error = e

    def take(self) -> tuple[Any, float] | None:
        """The loaded program and its compile time (None: off); ProfError when it could not load."""
        if self._taken:
            return None
        self._taken = True
        if self._error is not None:
            raise self._error
        return self._result

    def discard(self) -> None:
        """Unload the program if it was never taken (the attach failed)."""
        if not self._taken and self._result is not None:
            _unload(self._result[0])
        self._taken = True


def _unload(bpf: Any) -> None:
    with contextlib.suppress(Exception):
        bpf.cleanup()


def open_thread_waits(load: ProgramLoad, sess: Session, log: Callable[[str], None]) -> ThreadWaits | None:
    """The loaded scheduler program attached to the steps of the engine `sess` is attached to
    (None: off, or it could not be loaded or attached: the recording goes on without the table,
    and says why)."""
    trap: StepTrap | None = step_trap(sess)
    try:
        loaded = load.take()
        if loaded is None:
            return None
        if trap is None:
            loaded[0].cleanup()
            log("sparseety-prof: thread waits not recorded: the step probe is not attached")
            return None
        return ThreadWaits(SchedWaits(loaded[0], loaded[1], sess.pid, trap))
    except ProfError as e:
        log(f"sparseety-prof: thread waits not recorded: {e}")
        return None
