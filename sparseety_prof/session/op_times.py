"""The op_times table (issue 62, `record --trace-ops ON/PERIOD`): each graph node the CPU backend
computed in a step, on each engine thread, from the node probes of capture/op_trace.py, put in for
a window of ON seconds every PERIOD by the duty cycle (session/duty_cycle.py and duty_driver.py,
the same schedule and switching as `--duty-cycle`; the probes are detached between windows).

A node runs on a thread from its entry to the thread's next node entry, or to the end of its graph
(ggml_graph_compute's return: every thread has passed the graph's last barrier then): its share of
the node's work and its wait at the barrier after it. Only the steps that ran whole inside a
window are kept (the probes in before the step began, not taken out before it ended): a step cut
by a window's edge would list part of its nodes. A node is numbered by its order among the nodes
its thread computed in the step; every graph thread runs every node, so a node has the same number
on each thread.

A step's events are all in the probes' ring before the step ends (its graphs end inside it), so
its rows are made as soon as its steps row arrives.
"""

from __future__ import annotations

import bisect
import mmap
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparseety_prof.capture.layouts import TensorLayout
from sparseety_prof.capture.op_trace import (
    EVENT_BYTES,
    OP_FUSED,
    OP_GRAPH_END,
    OP_PAGES,
    OP_SYMBOLS,
    OpEvent,
    OpTracer,
)
from sparseety_prof.capture.probe_switch import ProbeSwitch
from sparseety_prof.session.duty_cycle import DutySpec
from sparseety_prof.session.duty_driver import DutyDriver
from sparseety_prof.store import schema

_COLUMNS = schema.columns(
    "op_times", "step_id", "ctx_id", "tid", "thread", "node", "op", "name", "layer", "t_start_ns", "dur_ns"
)
schema.check_columns("op_times", _COLUMNS)
#: how long a time of lost events is remembered after the latest step end: steps come in order,
#: at most a drain's batch behind the events
LOSS_HOLD_NS = 60_000_000_000


def node_layer(name: str) -> int | None:
    """The model layer of a node named "<what>-<layer>" (llama.cpp's graph callback names)."""
    _, sep, tail = name.rpartition("-")
    return int(tail) if sep and tail.isascii() and tail.isdigit() else None


@dataclass(frozen=True)
class NodeRun:
    """One node on one thread: its entry event and when the thread left it (CLOCK_MONOTONIC ns)."""

    entry: OpEvent
    t_end: int


class OpSwitch(ProbeSwitch):
    """The node probes' switch, which keeps when they were in: [in, out] in CLOCK_MONOTONIC ns,
    in once attached, out (None while in) as the detach begins."""

    def __init__(self, tracer: OpTracer) -> None:
        super().__init__(tracer.session, OP_SYMBOLS)
        self.lock = threading.Lock()
        self.windows: list[list[int | None]] = [[time.monotonic_ns(), None]]

    def disarm(self) -> None:
        if not self.armed:
            return
        with self.lock:
            self.windows[-1][1] = time.monotonic_ns()
        super().disarm()

    def arm(self) -> None:
        if self.armed:
            return
        super().arm()
        with self.lock:
            self.windows.append([time.monotonic_ns(), None])

    def snapshot(self) -> list[list[int | None]]:
        with self.lock:
            return [list(w) for w in self.windows]


@dataclass
class _Step:
    step_id: int
    ctx_id: int | None
    t_start: int
    t_end: int
    runs: list[NodeRun] = field(default_factory=list)


def _window(t0: int, t1: int, windows: list[list[int | None]]) -> bool:
    """The probes were in for the whole of [t0, t1]."""
    return any(w_in is not None and w_in <= t0 and (w_out is None or t1 <= w_out) for w_in, w_out in windows)


class OpTimes:
    """Node entries paired into runs, joined to whole traced steps, as op_times rows (`rows`)."""

    def __init__(self, tracer: OpTracer, spec: DutySpec, log: Callable[[str], None]) -> None:
        self.tracer = tracer
        self.spec = spec
        self.switch = OpSwitch(tracer)
        self.driver = DutyDriver(spec, self.switch, log)
        self._open: dict[int, OpEvent] = {}  # tid -> the node it is in
        self._runs: list[NodeRun] = []  # runs whose step is not known yet
        self._latest_end = 0  # the latest step end given
        self._steps_seen = 0  # steps given, traced or not
        self._lost_seen = 0  # the ring's lost count at the last call
        self._last_call_ns = time.monotonic_ns()
        self._lossy: list[tuple[int, int]] = []  # times whose steps may have lost events
        self.steps_lossy = 0  # traced steps not kept: some of their events may be lost
        self.nodes = 0  # node runs recorded
        self.outside = 0  # node runs outside every whole traced step, or cut by a window's edge
        self.steps = 0  # steps recorded
        self._stopped = False

    def start(self) -> None:
        self.driver.start()

    def _pair(self, events: list[OpEvent], windows: list[list[int | None]]) -> list[NodeRun]:
        """Runs from the events in ring order: a thread's node ends at its next entry or at the
        end of a graph; a node still open when the probes came out has no end (dropped)."""
        runs: list[NodeRun] = []
        outs = sorted(w[1] for w in windows if w[1] is not None)
        for e in events:
            if e.kind == OP_GRAPH_END:
                # every graph thread passed the last barrier: the nodes open then are done
                for tid, entry in list(self._open.items()):
                    if entry.ts <= e.ts:
                        runs.append(NodeRun(entry, e.ts))
                        del self._open[tid]
                continue
            before = self._open.get(e.tid)
            if before is not None:
                runs.append(NodeRun(before, e.ts))
            self._open[e.tid] = e
        # an entry before the probes last came out, still open: its end was not seen
        if outs:
            for tid, entry in list(self._open.items()):
                if entry.ts <= outs[-1]:
                    del self._open[tid]
                    self.outside += 1
        return [r for r in runs if not self._cut(r, outs)]

    def _cut(self, r: NodeRun, outs: list[int]) -> bool:
        """The probes came out between the run's entry and its end (its end is a later node's)."""
        i = bisect.bisect_left(outs, r.entry.ts)
        if i < len(outs) and outs[i] < r.t_end:
            self.outside += 1
            return True
        return False

    def rows(self, steps: Mapping[str, list[Any]], *, final: bool = False) -> schema.Tables:
        """The rows of the traced steps given (the recorder's steps columns), from the events
        taken since; the runs of steps not given yet wait for them (every held one is dropped
        with `final`)."""
        windows = self.switch.snapshot()
        self._note_losses()
        events = self.tracer.take()
        runs = [*self._runs, *self._pair(events, windows)]
        traced: list[_Step] = []
        for sid, ctx, t0, t1 in zip(
            steps.get("step_id") or [],
            steps.get("ctx_id") or [],
            steps.get("t_start_ns") or [],
            steps.get("t_end_ns") or [],
            strict=False,
        ):
            if sid is None or t0 is None or t1 is None:
                continue
            self._latest_end = max(self._latest_end, int(t1))
            if any(a <= t1 and t0 <= b for a, b in self._lossy):
                self.steps_lossy += 1  # some of its events may be among those lost: not kept
            elif _window(int(t0), int(t1), windows):
                traced.append(_Step(int(sid), ctx, int(t0), int(t1)))
        traced.sort(key=lambda s: s.t_start)
        starts = [s.t_start for s in traced]
        held: list[NodeRun] = []
        for r in runs:
            i = bisect.bisect_right(starts, r.entry.ts) - 1
            if i >= 0 and r.t_end <= traced[i].t_end:
                traced[i].runs.append(r)
            elif final or r.entry.ts <= self._latest_end:
                self.outside += 1
            else:
                held.append(r)
        self._runs = held
        self._observe(len(steps.get("step_id") or []), len(events))
        cols = self._columns(traced)
        return {"op_times": cols} if cols["step_id"] else {}

    def _note_losses(self) -> None:
        """Events the ring could not take since the last call: they belong to steps running since
        then (CLOCK_MONOTONIC [last call, now]), whose rows would lack nodes."""
        now, lost = time.monotonic_ns(), self.tracer.lost()
        if lost > self._lost_seen:
            self._lost_seen = lost
            self._lossy.append((self._last_call_ns, now))
        self._last_call_ns = now
        self._lossy = [(a, b) for a, b in self._lossy if b >= self._latest_end - LOSS_HOLD_NS]

    def _observe(self, n_steps: int, n_events: int) -> None:
        """What the duty cycle's controller weighs (DutyCycle.observe): the engine's steps so far
        (its pace in and out of windows; steps stand for tokens), the share of the ring this
        drain found filled, and the events lost."""
        self._steps_seen += n_steps
        fill = n_events * EVENT_BYTES / (OP_PAGES * mmap.PAGESIZE)
        self.driver.observe(time.monotonic(), self._steps_seen, fill, self.tracer.lost())

    def _columns(self, traced: list[_Step]) -> schema.Columns:
        cols: schema.Columns = {c: [] for c in _COLUMNS}
        for s in traced:
            if not s.runs:
                continue
            self.steps += 1
            by_tid: dict[int, list[NodeRun]] = {}
            for r in s.runs:
                by_tid.setdefault(r.entry.tid, []).append(r)
            for tid, runs in by_tid.items():
                for i, r in enumerate(sorted(runs, key=lambda r: r.entry.ts)):
                    e = r.entry
                    name = e.name.split(b"\0", 1)[0].decode(errors="replace")
                    op = self.tracer.names.name(e.op) + ("+MUL" if e.kind == OP_FUSED else "")
                    values = (
                        s.step_id,
                        s.ctx_id,
                        tid,
                        e.ith,
                        i,
                        op,
                        name,
                        node_layer(name),
                        e.ts,
                        r.t_end - e.ts,
                    )
                    for c, v in zip(_COLUMNS, values, strict=True):
                        cols[c].append(v)
                    self.nodes += 1
        return cols

    def stop(self) -> None:
        """The duty cycle stops and the probes come out; rows() with final then makes the rest."""
        if self._stopped:
            return
        self._stopped = True
        self.driver.close()
        self.switch.disarm()

    def close(self) -> None:
        self.stop()
        self.tracer.close()

    def meta(self) -> dict[str, Any]:
        out = self.driver.meta()
        out.update(
            {
                "window": self.spec.text,
                "nodes": self.nodes,
                "steps": self.steps,
                "nodes_outside_whole_steps": self.outside,
                "steps_with_lost_events": self.steps_lossy,
                "lost": self.tracer.lost(),
                "op_names": "engine's GGML_OP_NAME" if self.tracer.names.table is not None else "numbers",
                "points": self.tracer.session.probes_meta(),
                # [in, out] CLOCK_MONOTONIC ns: attached, detach began (the steps kept lie inside)
                "traced_windows_ns": self.switch.snapshot(),
            }
        )
        return out


def open_op_times(
    pid: int, spec: DutySpec | None, libs: list[Path], tensor: TensorLayout, log: Callable[[str], None]
) -> OpTimes | None:
    """The node probes attached and their duty cycle started (`--trace-ops`), or None when not
    asked."""
    if spec is None:
        return None
    tracer = OpTracer.attach(pid, libs, tensor)
    ops = OpTimes(tracer, spec, log)
    ops.start()
    log(
        f"sparseety-prof: --trace-ops {spec.text}: every graph node on every engine thread, "
        f"{spec.on_s:g} s every {spec.period_s:g} s"
    )
    return ops
