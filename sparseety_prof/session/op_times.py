"""The op_times table (issue 62, `record --trace-ops ON/PERIOD`): each graph node the CPU backend
computed in a step, on each engine thread, from the node probes of capture/op_trace.py, put in for
a window of ON seconds every PERIOD by the duty cycle (session/duty_cycle.py and duty_driver.py,
the same schedule and switching as `--duty-cycle`; the probes are detached between windows).

Only the steps that ran whole inside a window are kept (the probes in before the step began, not
taken out before it ended): a step cut by a window's edge would list part of its nodes. A node is
numbered by its order among the nodes its thread computed in the step; every graph thread runs
every node, so a node has the same number on each thread.

A thread's node is sent when that thread enters its next node, so a step's last nodes come with
the next step's first ones. A step's rows are made once every thread that ran it has sent a node
that began after the step ended, or when the probes are taken out (the nodes still open are read
from the probes' map then: nothing runs to change it).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparseety_prof.capture.layouts import TensorLayout
from sparseety_prof.capture.op_trace import OP_SYMBOLS, NodeRun, OpTracer
from sparseety_prof.capture.probe_switch import ProbeSwitch
from sparseety_prof.session.duty_cycle import DutySpec
from sparseety_prof.session.duty_driver import DutyDriver
from sparseety_prof.store import schema

_COLUMNS = schema.columns(
    "op_times", "step_id", "ctx_id", "tid", "thread", "node", "op", "name", "layer", "t_start_ns", "dur_ns"
)
schema.check_columns("op_times", _COLUMNS)


def node_layer(name: str) -> int | None:
    """The model layer of a node named "<what>-<layer>" (llama.cpp's graph callback names)."""
    _, sep, tail = name.rpartition("-")
    return int(tail) if sep and tail.isascii() and tail.isdigit() else None


class OpSwitch(ProbeSwitch):
    """The node probes' switch, which keeps when they were in (CLOCK_MONOTONIC ns) and, each
    time they come out, the nodes still open in the probes' map."""

    def __init__(self, tracer: OpTracer) -> None:
        super().__init__(tracer.session, OP_SYMBOLS)
        self.tracer = tracer
        self.lock = threading.Lock()
        self.windows: list[list[int | None]] = [[time.monotonic_ns(), None]]  # [in, out]
        self.flushed: list[NodeRun] = []

    def disarm(self) -> None:
        """Out, then the nodes still open read: the window is closed (its end set) only with
        them, so that a step seen inside a closed window has all its nodes."""
        if not self.armed:
            return
        out = time.monotonic_ns()
        super().disarm()
        open_nodes = self.tracer.open_nodes()
        with self.lock:
            self.windows[-1][1] = out
            self.flushed.extend(open_nodes)

    def arm(self) -> None:
        if self.armed:
            return
        super().arm()
        with self.lock:
            self.windows.append([time.monotonic_ns(), None])

    def take(self) -> tuple[list[NodeRun], list[list[int | None]]]:
        with self.lock:
            got, self.flushed = self.flushed, []
            return got, [list(w) for w in self.windows]


@dataclass
class _Step:
    step_id: int
    ctx_id: int | None
    t_start: int
    t_end: int
    runs: list[NodeRun] = field(default_factory=list)


class OpTimes:
    """Node runs joined to whole traced steps, as op_times rows (`rows`)."""

    def __init__(self, tracer: OpTracer, spec: DutySpec, log: Callable[[str], None]) -> None:
        self.tracer = tracer
        self.spec = spec
        self.switch = OpSwitch(tracer)
        self.driver = DutyDriver(spec, self.switch, log)
        self._steps: list[_Step] = []  # traced steps whose rows are not made yet
        self._runs: list[NodeRun] = []  # runs whose step is not known yet
        self._last_seen: dict[int, int] = {}  # tid -> start of its latest node run
        self._latest_end = 0  # the latest step end given
        self.nodes = 0  # node runs recorded
        self.outside = 0  # node runs outside every whole traced step
        self.steps = 0  # steps recorded
        self._stopped = False

    def start(self) -> None:
        self.driver.start()

    @staticmethod
    def _window(t0: int, t1: int, windows: list[list[int | None]]) -> list[int | None] | None:
        """The window the probes were in for the whole of [t0, t1], if any."""
        for w in windows:
            w_in, w_out = w
            if w_in is not None and w_in <= t0 and (w_out is None or t1 <= w_out):
                return w
        return None

    def rows(self, steps: Mapping[str, list[Any]], *, final: bool = False) -> schema.Tables:
        """The rows that can be made now from the steps given (the recorder's steps columns) and
        the nodes taken since; every held one with `final`."""
        flushed, windows = self.switch.take()
        runs = [*self.tracer.take(), *flushed]
        for r in runs:
            self._last_seen[r.tid] = max(self._last_seen.get(r.tid, 0), r.t_start)
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
            if self._window(int(t0), int(t1), windows) is not None:
                self._steps.append(_Step(int(sid), ctx, int(t0), int(t1)))
        self._steps.sort(key=lambda s: s.t_start)
        self._place([*self._runs, *runs], final=final)
        ready = [s for s in self._steps if final or self._complete(s, windows)]
        if not ready:
            return {}
        done = {id(s) for s in ready}
        self._steps = [s for s in self._steps if id(s) not in done]
        return {"op_times": self._columns(ready)}

    def _place(self, runs: list[NodeRun], *, final: bool) -> None:
        """Each run into the traced step whose window holds it; a run is held while no step
        ending after it is known (its step may come later), else counted outside every whole
        traced step."""
        starts = [s.t_start for s in self._steps]
        held: list[NodeRun] = []
        for r in runs:
            i = bisect.bisect_right(starts, r.t_start) - 1
            if i >= 0 and r.t_end <= self._steps[i].t_end:
                self._steps[i].runs.append(r)
            elif final or r.t_start <= self._latest_end:
                self.outside += 1
            else:
                held.append(r)
        self._runs = held

    def _complete(self, s: _Step, windows: list[list[int | None]]) -> bool:
        """All the step's nodes are in: its window is closed (the open ones were read then), or
        every thread that ran it has sent a node that began after it."""
        w = self._window(s.t_start, s.t_end, windows)
        if w is not None and w[1] is not None:
            return True
        return bool(s.runs) and all(self._last_seen.get(tid, 0) > s.t_end for tid in {r.tid for r in s.runs})

    def _columns(self, ready: list[_Step]) -> schema.Columns:
        cols: schema.Columns = {c: [] for c in _COLUMNS}
        for s in ready:
            if not s.runs:
                continue
            self.steps += 1
            by_tid: dict[int, list[NodeRun]] = {}
            for r in s.runs:
                by_tid.setdefault(r.tid, []).append(r)
            for tid, runs in by_tid.items():
                for i, r in enumerate(sorted(runs, key=lambda r: r.t_start)):
                    name = r.name.split(b"\0", 1)[0].decode(errors="replace")
                    values = (
                        s.step_id,
                        s.ctx_id,
                        tid,
                        r.ith,
                        i,
                        self.tracer.names.name(r.op) + ("+MUL" if r.fused else ""),
                        name,
                        node_layer(name),
                        r.t_start,
                        r.t_end - r.t_start,
                    )
                    for c, v in zip(_COLUMNS, values, strict=True):
                        cols[c].append(v)
                    self.nodes += 1
        return cols

    def stop(self) -> None:
        """The duty cycle stops and the probes come out (the nodes still open read); rows()
        with final then makes the rest."""
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
                "lost": self.tracer.lost(),
                "op_names": "engine's GGML_OP_NAME" if self.tracer.names.table is not None else "numbers",
                "points": self.tracer.session.probes_meta(),
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
