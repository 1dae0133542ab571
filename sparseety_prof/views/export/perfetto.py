"""A recording as a Chrome trace-event JSON file, which ui.perfetto.dev and chrome://tracing open.

Tracks (a trace-event "process" holds "threads", each thread one track):
- the engine process (its real pid): one track per engine thread (real tid) with a slice per step
  (micro-batch) from t_start_ns to t_end_ns, the steps table's row as its args, and on every
  engine thread that computed it, a slice per layer of a step with layer times (layer_times: from
  the thread's previous probe point to this layer's, so under its step on the step's own thread),
  and with thread_waits a counter track per engine thread, "waits <tid>", holding for each step's
  span the milliseconds that thread was runnable but not running, stopped and asleep in it (0
  between steps), with an instant event at the step's end naming the process it waited for
  longest;
- "requests" (pid REQUESTS_PID): one track per request, named by its request id, with a slice per
  token over its step's time, the token's whole event (token_events.py) as its args;
- "GPU kernels" (pid GPU_PID): one track per (device, stream) with a slice per kernel execution,
  the kernels table's row as its args (GPU recordings only).
Flow arrows go from each token to its step, and from each step to its kernels: following them from
a token leads to the kernels that computed it.

Times: the recording's single clock (CLOCK_MONOTONIC), in microseconds since `ts_origin_ns`
(otherData), the earliest time in the file, so that nanoseconds survive as three decimals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, BinaryIO

import polars as pl

from sparseety_prof.store.recording import Recording
from sparseety_prof.terminal_text import visible
from sparseety_prof.views.export.json_text import dumps
from sparseety_prof.views.export.token_events import TokenEvents, iter_rows, token_rows

# Linux pids and tids stay below 2**22: these never collide with the engine's. Synthetic tids are
# unique across processes too, since Perfetto's importer names threads by tid alone.
REQUESTS_PID = 0x7FFF0001
GPU_PID = 0x7FFF0002
REQUEST_TID_BASE = 0x40000000
STREAM_TID_BASE = 0x50000000
FORMAT = "sparseety-prof trace-event export"


@dataclass
class TraceCounts:
    """What was written (events by kind) and what had no time to place it by."""

    steps: int = 0
    tokens: int = 0
    kernels: int = 0
    layers: int = 0
    waits: int = 0
    flows: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: {"steps": 0, "tokens": 0, "kernels": 0})


class _Writer:
    def __init__(self, out: BinaryIO, origin_ns: int) -> None:
        self.out = out
        self.origin_ns = origin_ns
        self.first = True
        self.flow_id = 0

    def us(self, ns: int) -> float:
        return (ns - self.origin_ns) / 1000

    def emit(self, event: dict[str, Any]) -> None:
        self.out.write((("" if self.first else ",\n") + dumps(event)).encode("ascii"))
        self.first = False

    def name(self, pid: int, tid: int | None, value: str) -> None:
        what = "thread_name" if tid is not None else "process_name"
        self.emit({"ph": "M", "name": what, "pid": pid, "tid": tid or 0, "args": {"name": value}})

    def sort_index(self, pid: int, tid: int | None, index: int) -> None:
        what = "thread_sort_index" if tid is not None else "process_sort_index"
        self.emit({"ph": "M", "name": what, "pid": pid, "tid": tid or 0, "args": {"sort_index": index}})

    def flow(self, name: str, src: tuple[int, int, int], dst: tuple[int, int, int]) -> None:
        """An arrow from the slice around src's time on its track to the one around dst's."""
        self.flow_id += 1
        for ph, (pid, tid, ns) in (("s", src), ("f", dst)):
            event = {"ph": ph, "id": self.flow_id, "cat": "flow", "name": name, "pid": pid, "tid": tid}
            event["ts"] = self.us(ns)
            if ph == "f":
                event["bp"] = "e"  # bind to the enclosing slice, not the next one
            self.emit(event)


def _mid(start: int, end: int) -> int:
    # flow ends sit inside their slices, away from the edges the binding would find ambiguous
    return start + (end - start) // 2


def origin_ns(rec: Recording) -> int:
    """The earliest time of any step, token or kernel (0 for an empty recording)."""
    starts = [
        rec.steps()["t_start_ns"].min(),
        rec.tokens()["t_start_ns"].min(),
        rec.kernels()["start_ns"].min(),
    ]
    found = [int(s) for s in starts if s is not None]  # type: ignore[arg-type]
    return min(found) if found else 0


def _timed(df: pl.DataFrame, start: str, end: str) -> pl.DataFrame:
    return df.filter(pl.col(start).is_not_null() & pl.col(end).is_not_null())


def write_perfetto(rec: Recording, out: BinaryIO) -> TraceCounts:
    """Write `rec` as a trace-event JSON object to `out`; returns what it holds."""
    counts = TraceCounts()
    w = _Writer(out, origin_ns(rec))
    steps = rec.steps()
    timed_steps = _timed(steps, "t_start_ns", "t_end_ns")
    counts.skipped["steps"] = steps.height - timed_steps.height
    out.write(b'{"traceEvents":[\n')
    _write_steps(w, timed_steps, counts)
    _write_layers(w, rec.table("layer_times"), timed_steps, counts)
    _write_waits(w, rec.table("thread_waits"), timed_steps, counts)
    step_ends = timed_steps.select(
        "step_id",
        pl.col("pid").fill_null(0).alias("_step_pid"),
        pl.col("tid").fill_null(0).alias("_step_tid"),
        pl.col("t_start_ns").alias("_step_start"),
        pl.col("t_end_ns").alias("_step_end"),
    ).unique(subset="step_id", keep="first", maintain_order=True)
    _write_kernels(w, rec.kernels(), step_ends, counts)
    _write_tokens(w, rec, step_ends, counts)
    other = {
        "format": FORMAT,
        "clock": "CLOCK_MONOTONIC",
        "ts_unit": "microseconds since ts_origin_ns",
        "ts_origin_ns": w.origin_ns,
        "complete": rec.complete,
        "redacted_text": rec.redacted,
        "redaction_levels": rec.redaction_levels,
        "events": {
            "steps": counts.steps,
            "tokens": counts.tokens,
            "kernels": counts.kernels,
            "layers": counts.layers,
            "waits": counts.waits,
        },
        "skipped_without_times": counts.skipped,
    }
    # no displayTimeUnit: Perfetto would take "ns" as the unit of every ts, not of the display
    out.write(('\n],"otherData":' + dumps(other) + "}\n").encode("ascii"))
    return counts


def _write_steps(w: _Writer, steps: pl.DataFrame, counts: TraceCounts) -> None:
    threads = steps.select(pl.col("pid", "tid").fill_null(0)).unique(maintain_order=True)
    for pid in threads["pid"].unique(maintain_order=True).to_list():
        w.name(pid, None, f"engine (pid {pid})")
        w.sort_index(pid, None, 0)
    for pid, tid in threads.iter_rows():
        w.name(pid, tid, f"engine thread {tid}")
    for r in iter_rows(steps):
        w.emit(
            {
                "ph": "X",
                "cat": "step",
                "name": f"{r['phase']} step" if r["phase"] else "step",
                "pid": r["pid"] or 0,
                "tid": r["tid"] or 0,
                "ts": w.us(r["t_start_ns"]),
                "dur": (r["t_end_ns"] - r["t_start_ns"]) / 1000,
                "args": r,
            }
        )
        counts.steps += 1


def _write_layers(w: _Writer, layers: pl.DataFrame, steps: pl.DataFrame, counts: TraceCounts) -> None:
    """A slice per layer_times row with an interval (a thread's first probe point has none: the
    head gap), on its thread's track in the engine process, its row as its args."""
    timed = layers.drop_nulls("dur_ns").join(
        steps.select("step_id", pl.col("pid").fill_null(0).alias("_pid")), on="step_id", how="inner"
    )
    named = set(steps.select(pl.col("pid", "tid").fill_null(0)).iter_rows())
    for pid, tid in timed.select("_pid", "tid").unique(maintain_order=True).iter_rows():
        if (pid, tid) not in named:  # a worker thread that runs no step itself
            w.name(pid, tid, f"engine thread {tid}")
            named.add((pid, tid))
    for r in iter_rows(timed):
        pid = r.pop("_pid")
        w.emit(
            {
                "ph": "X",
                "cat": "layer",
                "name": f"layer {r['layer']}",
                "pid": pid,
                "tid": r["tid"],
                "ts": w.us(r["t_ns"] - r["dur_ns"]),
                "dur": r["dur_ns"] / 1000,
                "args": r,
            }
        )
        counts.layers += 1


def _write_waits(w: _Writer, waits: pl.DataFrame, steps: pl.DataFrame, counts: TraceCounts) -> None:
    """Per thread_waits row, the counter "waits <tid>" set to the step's runnable, stopped and
    sleeping milliseconds of that thread at the step's start and back to 0 at its end; and where
    a process held the thread's CPU, an instant event at the step's end on the thread's track
    saying which (its name as the process set it, made visible)."""
    timed = waits.join(
        steps.select("step_id", pl.col("t_start_ns").alias("_start"), pl.col("t_end_ns").alias("_end")),
        on="step_id",
        how="inner",
    ).sort("_start")
    zero = {"runnable_ms": 0.0, "stopped_ms": 0.0, "sleep_ms": 0.0}
    for r in iter_rows(timed):
        start, end = r.pop("_start"), r.pop("_end")
        pid, tid, name = r["pid"] or 0, r["tid"] or 0, f"waits {r['tid']}"
        values = {k: (r[f"{k[:-3]}_ns"] or 0) / 1e6 for k in zero}
        w.emit({"ph": "C", "name": name, "pid": pid, "ts": w.us(start), "args": values})
        w.emit({"ph": "C", "name": name, "pid": pid, "ts": w.us(end), "args": zero})
        if r["top_pid"] is not None and r["top_ns"]:
            who = (
                f"waited {r['top_ns'] / 1e6:.2f} ms for PID {r['top_pid']} ({visible(r['top_comm'] or '?')})"
            )
            w.emit(
                {
                    "ph": "i",
                    "s": "t",
                    "cat": "wait",
                    "name": who,
                    "pid": pid,
                    "tid": tid,
                    "ts": w.us(end),
                    "args": r,
                }
            )
        counts.waits += 1


def _kernel_tracks(kernels: pl.DataFrame) -> dict[tuple[int | None, int | None], int]:
    keys = (
        kernels.select("device", "stream_id")
        .unique(maintain_order=True)
        .sort("device", "stream_id", nulls_last=True)
    )
    return {(d, s): STREAM_TID_BASE + i for i, (d, s) in enumerate(keys.iter_rows())}


def _write_kernels(w: _Writer, kernels: pl.DataFrame, step_ends: pl.DataFrame, counts: TraceCounts) -> None:
    timed = _timed(kernels, "start_ns", "end_ns")
    counts.skipped["kernels"] = kernels.height - timed.height
    if not timed.height:
        return
    tracks = _kernel_tracks(timed)
    w.name(GPU_PID, None, "GPU kernels")
    w.sort_index(GPU_PID, None, 2)
    for (device, stream), tid in tracks.items():
        w.name(GPU_PID, tid, f"GPU {device} stream {stream}")
    joined = timed.join(step_ends, on="step_id", how="left", maintain_order="left")
    for r in iter_rows(joined):
        tid = tracks[(r["device"], r["stream_id"])]
        step = {k: r.pop(k) for k in ("_step_pid", "_step_tid", "_step_start", "_step_end")}
        w.emit(
            {
                "ph": "X",
                "cat": "kernel",
                "name": r["name"] or "kernel",
                "pid": GPU_PID,
                "tid": tid,
                "ts": w.us(r["start_ns"]),
                "dur": (r["end_ns"] - r["start_ns"]) / 1000,
                "args": r,
            }
        )
        counts.kernels += 1
        if step["_step_start"] is not None:
            src = (step["_step_pid"], step["_step_tid"], _mid(step["_step_start"], step["_step_end"]))
            w.flow("step -> kernel", src, (GPU_PID, tid, _mid(r["start_ns"], r["end_ns"])))
            counts.flows += 1


def _write_tokens(w: _Writer, rec: Recording, step_ends: pl.DataFrame, counts: TraceCounts) -> None:
    tokens = token_rows(rec)
    timed = _timed(tokens, "t_start_ns", "t_end_ns")
    counts.skipped["tokens"] = tokens.height - timed.height
    if not timed.height:
        return
    w.name(REQUESTS_PID, None, "requests")
    w.sort_index(REQUESTS_PID, None, 1)
    events = TokenEvents(rec)
    tracks: dict[str | None, int] = {}
    joined = timed.join(step_ends, on="step_id", how="left", maintain_order="left")
    for r in iter_rows(joined):
        tid = tracks.get(r["request_id"])
        if tid is None:
            tid = tracks[r["request_id"]] = REQUEST_TID_BASE + len(tracks)
            label = r["request_id"] if r["request_id"] is not None else "(no request id)"
            w.name(REQUESTS_PID, tid, label)
            w.sort_index(REQUESTS_PID, tid, len(tracks))
        w.emit(
            {
                "ph": "X",
                "cat": "token",
                "name": _token_name(r),
                "pid": REQUESTS_PID,
                "tid": tid,
                "ts": w.us(r["t_start_ns"]),
                "dur": (r["t_end_ns"] - r["t_start_ns"]) / 1000,
                "args": events.event(r),
            }
        )
        counts.tokens += 1
        if r["_step_start"] is not None:
            src = (REQUESTS_PID, tid, _mid(r["t_start_ns"], r["t_end_ns"]))
            w.flow(
                "token -> step", src, (r["_step_pid"], r["_step_tid"], _mid(r["_step_start"], r["_step_end"]))
            )
            counts.flows += 1


def _token_name(r: dict[str, Any]) -> str:
    if r["token_text"] is not None:
        return str(r["token_text"])
    return f"token {r['token_id']}" if r["token_id"] is not None else "token"
