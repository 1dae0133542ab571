"""Causes from the thread_waits table (the scheduler's view of each step): what held a step back,
in words the step's anomaly can carry: "thread T waited D ms for PID P (NAME)"."""

from __future__ import annotations

from collections.abc import Mapping

import polars as pl

from sparseety_prof.terminal_text import visible

#: a wait or a stop is named as a step's cause when it is at least this share of the step's time
CAUSE_SHARE = 0.25


def wait_causes(
    waits: pl.DataFrame, step_ns: Mapping[int, int], *, share: float = CAUSE_SHARE
) -> dict[int, str]:
    """step_id -> the longest stop, or the longest wait for one named process, of any of the step's
    threads, when it is at least `share` of the step's duration (`step_ns`). Process names are
    the processes' own: escaped for a terminal."""
    if waits.is_empty():
        return {}
    stops = waits.filter(pl.col("stopped_ns") > 0).select(
        "step_id",
        "tid",
        pl.col("stopped_ns").alias("ns"),
        pl.lit(None, pl.Int32()).alias("pid"),
        pl.lit(None, pl.String()).alias("comm"),
    )
    named = waits.filter(pl.col("top_ns") > 0).select(
        "step_id",
        "tid",
        pl.col("top_ns").alias("ns"),
        pl.col("top_pid").alias("pid"),
        pl.col("top_comm").alias("comm"),
    )
    longest = pl.concat([stops, named]).sort("ns", descending=True).unique("step_id", keep="first")
    out: dict[int, str] = {}
    for sid, tid, ns, pid, comm in longest.iter_rows():
        dur = step_ns.get(sid)
        if not dur or ns < share * dur:
            continue
        if pid is None:
            out[sid] = f"thread {tid} stopped {ns / 1e6:.1f} ms (SIGSTOP or a tracer)"
        else:
            out[sid] = f"thread {tid} waited {ns / 1e6:.1f} ms for PID {pid} ({visible(comm or '?')})"
    return out
