"""Joins GPU kernel timelines (CUPTI records from the injection library's ring) to token steps, as a
streaming join, and turns them into `kernels`, `routes` and `steps` rows.

Why each rule exists
--------------------
CUPTI hands over activity buffers late, in batches and out of order, while the launch callbacks
(`LaunchApi`) arrive on their own schedule, before or after their kernel's activity. So the
correlator keeps unsettled state and `flush()` emits only what can no longer change.

1. ``"thread"`` (exact). The launch callback runs on the launching thread, in host time. A kernel's
   `correlation_id` finds its `LaunchApi` (tid, enter_ns); the `HostStep` on that tid whose
   [t_start_ns, t_end_ns] contains enter_ns is the step that queued it. No device timestamp is used,
   so GPU queueing lag and a skewed device clock cannot move a kernel to another step, and two
   threads stepping at once never mix. CUDA graph replays fire no per-kernel launch, but their
   kernels carry the correlation id of the `cuGraphLaunch` call, so they join through it too.
2. ``"window"`` (fallback). Kernels without a usable launch record (graph nodes with correlation id
   0, launch records lost) and launches outside every step of their thread go to the step whose
   window contains a time: the launch's enter_ns when a launch record exists (host clock, no GPU
   lag), else the kernel's device start. Among the steps containing it the latest-begun wins;
   when none contains it, the latest step that began before it (else the first one after), and
   `join_error_ns` is the distance to that window (0 inside). The error this rule can make
   silently: GPU work lags the host, so a kernel queued during step k may *execute* during step
   k+1 and be joined to k+1 with error 0. A kernel with no timestamp (start = end = 0) and no
   launch record has no time at all and stays unjoined (counted).
3. ``"gpu_step"`` for engines without host steps (Python decode loops, where no uprobe marks a
   step). Such a loop ends every step by copying the sampled tokens to the host, so a small DtoH
   `MemcpyActivity` (default: <= 64 KiB, `step_close` predicate) that is not a watched-buffer
   copy closes a step; kernels whose time (start, else launch enter) lies in
   (previous close end, this close end] belong to it. GPU steps live in their own id space:
   GPU step n (numbered from 0 in close order) has ``step_id = -1 - n`` (see `gpu_step_id`), so
   they never collide with uprobe step ids (>= 0); kernel rows say ``join = "gpu_step"`` and the
   steps rows have `n_tokens` null. Step 0's `t_start_ns` is null (no previous close seen).

Mode: ``"auto"`` picks ``"host"`` (rules 1, 2) as soon as a `HostStep` arrives, and ``"gpu_step"``
when a GPU step closes (or at the final flush) before any host step did.

Settling and bounds. A kernel is settled when its launch record and the step covering the launch
on its thread are known; otherwise it waits until it is older than `horizon_ns` (then rule 2 or
3), or until ``flush(final=True)``. Age counts from the newest timestamp seen when the kernel
arrived, so a buffer CUPTI delivers late still gets a full horizon for its launch records. The
clock that ages records is the host's (launch, step and `now_ns` times); device times drive it only
while no host time has been seen, so a skewed device clock cannot age records early. Pending
kernels, launch records and steps are capped; beyond the cap the oldest are dropped and counted.

Clock skew. Device timestamps are corrected as ``ts - clock_offset_ns`` (offset = device - host).
Causality says a kernel cannot start before its launch API entered; each violation is counted, and
`estimated_clock_offset_ns` is the median of the negative (start - enter) differences: pass it back
as `clock_offset_ns`. Only a device clock *behind* the host is detectable this way; one ahead looks
like queueing latency. Output `start_ns`/`end_ns` are the corrected values.

Watched buffers. A 2-D int32/uint32/int64 `WatchedBuffer` (n_rows, k) of top-k expert ids becomes
`routes` rows of its step: row = i, expert_ids = row i (its first `route_columns` ids where that is
set), and layer = the index of this launch among the watched launches of the same (kernel,
arg_index) in that step, in launch order (correlation ids increase in launch order). That is the
MoE-layer ordinal, which equals the model layer only when every layer is MoE and every watched
launch was copied (sampling or budget skips shift it). Because a late buffer would renumber layers,
a step's routes are emitted once the step is older than the horizon (or at the final flush); buffers
for a step already emitted are dropped and counted. A watched-buffer copy is recognised by its
correlation id: the injection library must issue the staging copy under the kernel's correlation id
for rule 3 to ignore it. Buffers of CUDA
graph replays carry the graph launch's correlation id, shared by every kernel of the replay, and
the graph node id of their kernel: a buffer belongs to the kernel with both ids (`buffer_captured`
is per node), and its layer order within a replay is the node id order (nodes are numbered in
creation, i.e. capture, order).
"""

from __future__ import annotations

import statistics
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from sparseety_prof.gpu.kernel_rows import KernelRows, gpu_step_id, gpu_step_index
from sparseety_prof.gpu.records import (
    HostStep,
    KernelActivity,
    LaunchApi,
    MemcpyActivity,
    RingCounters,
    WatchedBuffer,
)
from sparseety_prof.store.schema import Tables

__all__ = ["KernelCorrelator", "Mode", "gpu_step_id", "gpu_step_index"]

Mode = Literal["auto", "host", "gpu_step"]
Record = KernelActivity | LaunchApi | MemcpyActivity | WatchedBuffer | RingCounters

DEFAULT_HORIZON_NS = 2_000_000_000
STEP_CLOSE_MAX_BYTES = 64 * 1024
_OFFSET_SAMPLES = 4096

COUNTER_NAMES = (
    "kernels_in",
    "kernels_out",
    "joined_thread",
    "joined_window",
    "joined_gpu_step",
    "unjoined",  # kernel rows emitted with a null step
    "no_launch_record",  # kernel rows emitted without their LaunchApi (lost, or correlation id 0)
    "zero_timestamp",  # kernel and DtoH records with start or end 0
    "state_overflow",  # pending kernels, launches or steps dropped beyond the caps
    "causality_violations",  # kernel start before its launch entered (device clock behind)
    "gpu_steps",
    "late_closes",  # step-closing copies that arrived after a later close was settled
    "steps_ignored",  # host steps that arrived after auto mode chose gpu_step
    "routes_rows",
    "buffers_unjoined",  # watched buffers whose step could not be found
    "buffers_late",  # watched buffers whose step's routes were already emitted
    "buffers_after_kernel_row",  # arrived after their kernel row said buffer_captured = False
    "buffers_malformed",  # data size does not match dtype and shape
)


def _default_close(m: MemcpyActivity) -> bool:
    return m.bytes <= STEP_CLOSE_MAX_BYTES


@dataclass
class _Timeline:
    """Steps sorted by start, with the starts kept apart for bisection."""

    starts: list[int] = field(default_factory=list)
    steps: list[HostStep] = field(default_factory=list)

    def insert(self, s: HostStep) -> None:
        i = bisect_right(self.starts, s.t_start_ns)
        self.starts.insert(i, s.t_start_ns)
        self.steps.insert(i, s)

    def remove(self, s: HostStep) -> None:
        i = bisect_left(self.starts, s.t_start_ns)
        while i < len(self.steps):
            if self.steps[i] is s:
                del self.starts[i], self.steps[i]
                return
            i += 1


@dataclass
class _Pending:
    kernel: KernelActivity
    start: int | None  # corrected; None when CUPTI gave 0
    end: int | None
    arrived_ns: int  # the aging clock when it arrived


@dataclass
class _Buffer:
    buf: WatchedBuffer
    arrived_ns: int


@dataclass
class _Close:
    copy: MemcpyActivity
    end: int  # corrected


class KernelCorrelator:
    """Streaming join of kernel activity to token steps; see the module docstring for the rules.

    Parameters
    ----------
    mode
        ``"auto"`` (host steps present: thread/window joins; none: gpu_step), or forced.
    horizon_ns
        How long an unsettled kernel, buffer or step-closing copy may wait for late records.
    clock_offset_ns
        Device clock minus host clock; subtracted from every device timestamp.
    step_close
        gpu_step mode: which DtoH copies close a step (watched-buffer copies never do).
    max_pending, max_steps
        Caps on unsettled kernels / launch records / buffers, and on retained steps.
    route_columns
        Keep only the first this many ids of each watched row in `routes` (the model's experts
        per token, for kernels whose rows rank every expert: llama.cpp); None keeps them all.

    Examples
    --------
    >>> c = KernelCorrelator(horizon_ns=2_000_000_000)  # doctest: +SKIP
    >>> c.add_steps(host_steps); c.add(ring_records)  # any order, any batching  # doctest: +SKIP
    >>> c.flush(now_ns)["kernels"]  # settled rows only; flush(final=True) at the end  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        mode: Mode = "auto",
        horizon_ns: int = DEFAULT_HORIZON_NS,
        clock_offset_ns: int = 0,
        step_close: Callable[[MemcpyActivity], bool] = _default_close,
        max_pending: int = 262_144,
        max_steps: int = 65_536,
        route_columns: int | None = None,
    ) -> None:
        self.mode: Mode = mode
        self.route_columns = route_columns
        self.horizon_ns = horizon_ns
        self.clock_offset_ns = clock_offset_ns
        self.step_close = step_close
        self.max_pending = max_pending
        self.max_steps = max_steps
        self._counts = dict.fromkeys(COUNTER_NAMES, 0)
        self._ring: RingCounters | None = None
        self._host_now = 0
        self._dev_now = 0
        # host mode
        self._by_tid: dict[int, _Timeline] = {}
        self._all = _Timeline()
        self._step_by_id: dict[int, HostStep] = {}
        self._max_step_ns = 0
        self._routes_cutoff: int | None = None  # steps ending before it had their routes emitted
        # both modes
        self._launches: dict[int, LaunchApi] = {}
        self._pending: dict[int, _Pending] = {}
        self._pending_corr: dict[int, int] = {}
        self._seq = 0
        # A kernel is (correlation id, graph node id): the kernels of one CUDA graph replay share
        # the graph launch's correlation id and differ by node (0 for eager launches).
        self._buffers: dict[tuple[int, int, int], _Buffer] = {}  # (corr, node, arg_index)
        self._buffer_corr: dict[int, None] = {}  # correlation ids with a watched buffer (bounded)
        self._captured: dict[tuple[int, int], None] = {}  # kernels with a watched buffer (bounded)
        self._emitted: dict[tuple[int, int], tuple[int | None, bool]] = {}  # -> (step_id, buffer_captured)
        self._offsets: deque[int] = deque(maxlen=_OFFSET_SAMPLES)
        # gpu_step mode
        self._closes: list[_Close] = []
        self._sealed_ends: list[int] = []  # end of GPU step _sealed_base + i
        self._sealed_base = 0

    # ---- input

    def add_steps(self, steps: Iterable[HostStep]) -> None:
        for s in steps:
            if self.mode == "gpu_step":
                self._counts["steps_ignored"] += 1
                continue
            if self.mode == "auto":
                self.mode = "host"
                self._closes.clear()
            self._by_tid.setdefault(s.tid, _Timeline()).insert(s)
            self._all.insert(s)
            self._step_by_id[s.step_id] = s
            self._max_step_ns = max(self._max_step_ns, s.t_end_ns - s.t_start_ns)
            self._host_now = max(self._host_now, s.t_end_ns)
            if len(self._all.steps) > self.max_steps:
                old = self._all.steps[0]
                self._all.remove(old)
                self._by_tid[old.tid].remove(old)
                self._step_by_id.pop(old.step_id, None)
                self._counts["state_overflow"] += 1

    def add(self, records: Iterable[Record]) -> None:
        for r in records:
            if isinstance(r, KernelActivity):
                self._add_kernel(r)
            elif isinstance(r, LaunchApi):
                self._launches[r.correlation_id] = r
                self._host_now = max(self._host_now, r.exit_ns)
                if len(self._launches) > self.max_pending:
                    del self._launches[next(iter(self._launches))]
                    self._counts["state_overflow"] += 1
            elif isinstance(r, MemcpyActivity):
                self._add_memcpy(r)
            elif isinstance(r, WatchedBuffer):
                self._add_buffer(r)
            elif isinstance(r, RingCounters):
                self._ring = r  # cumulative: the latest snapshot wins
            else:
                raise TypeError(f"not a GPU record: {type(r).__name__}")

    def _now(self) -> int:
        return self._host_now if self._host_now else self._dev_now

    def _dev(self, ts: int) -> int | None:
        return ts - self.clock_offset_ns if ts else None

    def _add_kernel(self, k: KernelActivity) -> None:
        self._counts["kernels_in"] += 1
        start, end = self._dev(k.start_ns), self._dev(k.end_ns)
        if start is None or end is None:
            self._counts["zero_timestamp"] += 1
            start = end = None
        else:
            self._dev_now = max(self._dev_now, end)
        self._pending[self._seq] = _Pending(k, start, end, self._now())
        self._seq += 1
        self._pending_corr[k.correlation_id] = self._pending_corr.get(k.correlation_id, 0) + 1
        if len(self._pending) > self.max_pending:
            self._drop_pending(next(iter(self._pending)))
            self._counts["state_overflow"] += 1

    def _drop_pending(self, key: int) -> None:
        corr = self._pending.pop(key).kernel.correlation_id
        n = self._pending_corr[corr] - 1
        if n:
            self._pending_corr[corr] = n
        else:
            del self._pending_corr[corr]

    def _add_memcpy(self, m: MemcpyActivity) -> None:
        if m.kind != "DtoH" or self.mode == "host":
            return
        end = self._dev(m.end_ns)
        if end is None or not m.start_ns:
            self._counts["zero_timestamp"] += 1
            return
        self._dev_now = max(self._dev_now, end)
        self._closes.append(_Close(m, end))
        if len(self._closes) > self.max_pending:
            self._closes.remove(min(self._closes, key=lambda c: c.end))
            self._counts["state_overflow"] += 1

    def _add_buffer(self, b: WatchedBuffer) -> None:
        self._host_now = max(self._host_now, b.launch_ns)
        self._buffers[(b.correlation_id, b.graph_node_id, b.arg_index)] = _Buffer(b, self._now())
        self._buffer_corr[b.correlation_id] = None
        self._captured[(b.correlation_id, b.graph_node_id)] = None
        done = self._emitted.get((b.correlation_id, b.graph_node_id))
        if done is not None and not done[1]:
            self._counts["buffers_after_kernel_row"] += 1
        if len(self._buffers) > self.max_pending:
            del self._buffers[next(iter(self._buffers))]
            self._counts["state_overflow"] += 1
        if len(self._buffer_corr) > self.max_pending:
            del self._buffer_corr[next(iter(self._buffer_corr))]
        if len(self._captured) > self.max_pending:
            del self._captured[next(iter(self._captured))]

    # ---- output

    @property
    def counters(self) -> dict[str, int]:
        """The correlator's own losses and tallies, then the injection library's (``ring_*``)."""
        out = dict(self._counts)
        ring = self._ring or RingCounters()
        out["ring_activity_dropped"] = ring.activity_dropped
        out["ring_dropped"] = ring.ring_dropped
        out["ring_buffers_skipped_sampling"] = ring.buffers_skipped_sampling
        out["ring_buffers_skipped_budget"] = ring.buffers_skipped_budget
        out["ring_buffers_failed"] = ring.buffers_failed
        out["ring_errors"] = len(ring.errors)
        out["pending_kernels"] = len(self._pending)  # a gauge, not a loss
        return out

    @property
    def estimated_clock_offset_ns(self) -> int | None:
        """Median of the negative (kernel start - launch enter) seen, or None without violations."""
        return int(statistics.median(self._offsets)) if self._offsets else None

    def flush(self, now_ns: int | None = None, *, final: bool = False) -> Tables:
        """Emit the settled rows: the ``kernels``, ``routes`` and ``steps`` tables, every column
        of each (the ones the GPU cannot know are null: kernel_rows.py)."""
        if now_ns is not None:
            self._host_now = max(self._host_now, now_ns)
        out = KernelRows(self.route_columns)
        if self.mode == "host":
            self._flush_host(out, final)
        else:
            self._flush_gpu(out, final)
        if final and self.mode == "auto":
            self.mode = "gpu_step"
        while self._launches:  # launch records far older than the horizon serve no kernel any more
            first = next(iter(self._launches.values()))
            if first.exit_ns >= self._now() - 4 * self.horizon_ns:
                break
            del self._launches[first.correlation_id]
        self._counts["routes_rows"] += len(out.routes["step_id"])
        return out.tables()

    # ---- host mode: thread, then window

    def _thread_step(self, tid: int, t: int) -> HostStep | None:
        tl = self._by_tid.get(tid)
        if tl is None:
            return None
        i = bisect_right(tl.starts, t) - 1
        return tl.steps[i] if i >= 0 and tl.steps[i].t_end_ns >= t else None

    def _window_step(self, t: int) -> tuple[HostStep, int] | None:
        tl = self._all
        i = bisect_right(tl.starts, t)
        j = i - 1
        while j >= 0 and tl.starts[j] >= t - self._max_step_ns:
            if tl.steps[j].t_end_ns >= t:
                return tl.steps[j], 0
            j -= 1
        if i > 0:
            return tl.steps[i - 1], t - tl.steps[i - 1].t_end_ns
        if i < len(tl.steps):
            return tl.steps[i], tl.steps[i].t_start_ns - t
        return None

    def _flush_host(self, out: KernelRows, final: bool) -> None:
        cutoff = self._now() - self.horizon_ns
        for key, p in list(self._pending.items()):
            k = p.kernel
            launch = self._launches.get(k.correlation_id) if k.correlation_id else None
            if launch is not None:
                s = self._thread_step(launch.tid, launch.enter_ns)
                if s is not None:
                    self._emit(out, key, launch, s.step_id, "thread", 0, s.pid)
                    continue
            if not final and p.arrived_ns >= cutoff:
                continue
            t = launch.enter_ns if launch is not None else p.start
            hit = self._window_step(t) if t is not None else None
            if hit is None:
                self._emit(out, key, launch, None, None, None, None)
            else:
                self._emit(out, key, launch, hit[0].step_id, "window", hit[1], hit[0].pid)
        self._flush_routes_host(out, final, cutoff)

    def _flush_routes_host(self, out: KernelRows, final: bool, cutoff: int) -> None:
        seal = self._now() + 1 if final else cutoff
        ready: list[tuple[int, WatchedBuffer]] = []
        for key, b in list(self._buffers.items()):
            w = b.buf
            tid, t = w.tid, w.launch_ns
            launch = self._launches.get(w.correlation_id)
            if not (tid and t) and launch is not None:
                tid, t = launch.tid, launch.enter_ns
            s = self._thread_step(tid, t) if tid and t else None
            if s is None:
                done = self._emitted.get((w.correlation_id, w.graph_node_id))
                s = self._step_by_id.get(done[0]) if done is not None and done[0] is not None else None
            if s is None:
                if final or b.arrived_ns < cutoff:
                    del self._buffers[key]
                    self._counts["buffers_unjoined"] += 1
                continue
            if self._routes_cutoff is not None and s.t_end_ns < self._routes_cutoff:
                del self._buffers[key]
                self._counts["buffers_late"] += 1
            elif s.t_end_ns < seal:
                del self._buffers[key]
                ready.append((s.step_id, w))
        self._routes_cutoff = max(self._routes_cutoff or seal, seal)
        self._counts["buffers_malformed"] += out.add_routes(ready)

    # ---- gpu_step mode

    def _flush_gpu(self, out: KernelRows, final: bool) -> None:
        cutoff = self._now() - self.horizon_ns
        first_new = self._sealed_base + len(self._sealed_ends)
        self._seal_closes(out, final, cutoff)
        n_sealed = self._sealed_base + len(self._sealed_ends)
        if n_sealed and self.mode == "auto":
            self.mode = "gpu_step"
        for key, p in list(self._pending.items()):
            launch = self._launches.get(p.kernel.correlation_id) if p.kernel.correlation_id else None
            t = p.start if p.start is not None else (launch.enter_ns if launch is not None else None)
            n = self._gpu_index(t)
            if n is not None:
                self._emit(out, key, launch, gpu_step_id(n), "gpu_step", 0, None)
            elif final or (t is None and p.arrived_ns < cutoff):
                self._emit(out, key, launch, None, None, None, None)
        ready: list[tuple[int, WatchedBuffer]] = []
        for bkey, b in list(self._buffers.items()):
            w = b.buf
            done = self._emitted.get((w.correlation_id, w.graph_node_id))
            if done is not None and done[0] is not None:
                n = gpu_step_index(done[0])
            elif w.correlation_id in self._pending_corr and not final:
                continue  # its kernel's step is not closed yet
            else:
                launch = self._launches.get(w.correlation_id)
                n = self._gpu_index(launch.enter_ns if launch is not None else (w.launch_ns or None))
            if n is None:
                if final or b.arrived_ns < cutoff:
                    del self._buffers[bkey]
                    self._counts["buffers_unjoined"] += 1
                continue
            del self._buffers[bkey]
            if n < first_new:
                self._counts["buffers_late"] += 1
            else:
                ready.append((gpu_step_id(n), w))
        self._counts["buffers_malformed"] += out.add_routes(ready)

    def _gpu_index(self, t: int | None) -> int | None:
        """GPU step n such that t lies in (end of n-1, end of n], among the settled closes."""
        if t is None or not self._sealed_ends or t > self._sealed_ends[-1]:
            return None
        i = bisect_left(self._sealed_ends, t)
        if i == 0 and self._sealed_base:
            return None  # before the oldest step still kept
        return self._sealed_base + i

    def _seal_closes(self, out: KernelRows, final: bool, cutoff: int) -> None:
        self._closes.sort(key=lambda c: c.end)
        keep: list[_Close] = []
        for c in self._closes:
            if not final and c.end >= cutoff:
                keep.append(c)
                continue
            if self._sealed_ends and c.end <= self._sealed_ends[-1]:
                self._counts["late_closes"] += 1
                continue
            if c.copy.correlation_id in self._buffer_corr or not self.step_close(c.copy):
                continue
            n = self._sealed_base + len(self._sealed_ends)
            prev = self._sealed_ends[-1] if self._sealed_ends else None
            launch = self._launches.get(c.copy.correlation_id)
            self._sealed_ends.append(c.end)
            self._counts["gpu_steps"] += 1
            out.add_step(
                gpu_step_id(n),
                prev,
                c.end,
                launch.pid if launch is not None and launch.pid else None,
                launch.tid if launch is not None else None,
            )
        self._closes = keep
        if len(self._sealed_ends) > self.max_steps:
            drop = len(self._sealed_ends) - self.max_steps
            del self._sealed_ends[:drop]
            self._sealed_base += drop

    # ---- rows

    def _emit(
        self,
        out: KernelRows,
        key: int,
        launch: LaunchApi | None,
        step_id: int | None,
        join: str | None,
        error: int | None,
        step_pid: int | None,
    ) -> None:
        p = self._pending[key]
        self._drop_pending(key)
        k = p.kernel
        c = self._counts
        c["kernels_out"] += 1
        c["joined_" + join if join else "unjoined"] += 1
        if launch is None:
            c["no_launch_record"] += 1
        elif p.start is not None and p.start < launch.enter_ns:
            c["causality_violations"] += 1
            self._offsets.append(p.start - launch.enter_ns)
        captured = (k.correlation_id, k.graph_node_id) in self._captured
        if k.correlation_id:
            self._emitted[(k.correlation_id, k.graph_node_id)] = (step_id, captured)
            if len(self._emitted) > self.max_pending:
                del self._emitted[next(iter(self._emitted))]
        pid = launch.pid if launch is not None and launch.pid else step_pid
        out.add_kernel(k, p.start, p.end, launch, step_id, join, error, pid, captured)
