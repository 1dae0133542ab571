"""Causes from the layer_times table (the time each layer took on each engine thread): which layer
held a step back, in words the step's anomaly can carry: "layer 17 took 3.0x its median"."""

from __future__ import annotations

from collections.abc import Mapping

import polars as pl

#: a layer is named as a step's cause when its time beyond its usual time is at least this share
#: of the step's time
CAUSE_SHARE = 0.25
#: and it took at least this multiple of its usual time (a layer 10% slower is no cause)
CAUSE_RATIO = 2.0


def layer_causes(
    layer_times: pl.DataFrame,
    step_ns: Mapping[int, int],
    *,
    share: float = CAUSE_SHARE,
    ratio: float = CAUSE_RATIO,
) -> dict[int, str]:
    """step_id -> the layer whose time in that step (its slowest thread's) went furthest beyond its
    usual time (the median over every step the table holds of that layer's slowest-thread time),
    when that excess is at least `share` of the step's duration (`step_ns`) and the layer took at
    least `ratio` times its usual time. The head gap (no duration) is never a cause."""
    if layer_times.is_empty() or not step_ns:
        return {}
    per_step = (
        layer_times.filter(pl.col("dur_ns").is_not_null())
        .sort("dur_ns", descending=True)
        .group_by("step_id", "layer", maintain_order=True)
        .agg(pl.col("dur_ns").first(), pl.col("tid").first())
    )
    usual = per_step.group_by("layer").agg(pl.col("dur_ns").median().alias("usual_ns"))
    flagged = pl.DataFrame(
        {"step_id": list(step_ns), "step_ns": list(step_ns.values())},
        schema={"step_id": pl.Int64(), "step_ns": pl.Int64()},
    )
    found = (
        per_step.join(flagged, on="step_id", how="inner")
        .join(usual, on="layer", how="inner")
        .with_columns((pl.col("dur_ns") - pl.col("usual_ns")).alias("excess_ns"))
        .filter(
            (pl.col("excess_ns") >= share * pl.col("step_ns"))
            & (pl.col("dur_ns") >= ratio * pl.col("usual_ns"))
            & (pl.col("usual_ns") > 0)
        )
        .sort("excess_ns", descending=True)
        .unique("step_id", keep="first")
    )
    return {
        sid: f"layer {layer} took {dur / usual:.1f}x its median ({dur / 1e6:.2f} ms against "
        f"{usual / 1e6:.2f} ms, thread {tid})"
        for sid, layer, dur, tid, usual in found.select(
            "step_id", "layer", "dur_ns", "tid", "usual_ns"
        ).iter_rows()
    }
