"""Detector over step timing: steps far slower than the recording's usual step of their phase."""

from __future__ import annotations

import polars as pl

from sparseety_prof.store.anomalies import common
from sparseety_prof.store.anomalies.layer_causes import layer_causes
from sparseety_prof.store.anomalies.waits import wait_causes

#: a slow step: its duration (per token, for prompt steps, whose cost grows with their size) is
#: SLOW_Z robust standard deviations above the phase's median (sigma floored at SLOW_SIGMA_FLOOR
#: of the median, so a very steady engine does not flag jitter) and at least SLOW_RATIO times it,
#: among at least SLOW_MIN_STEPS steps of that phase and shape change (see slow_steps)
SLOW_Z = 6.0
SLOW_SIGMA_FLOOR = 0.1
SLOW_RATIO = 2.0
SLOW_MIN_STEPS = 8
#: a step with a new shape whose own kind has fewer than SLOW_MIN_STEPS steps (one request: its
#: first decode step) is measured against the phase's steady steps instead, at this multiple of the
#: ratio: a new graph costs a steady step's time again at most, a stalled one far more
SLOW_RESHAPED_RATIO = 3.0


def slow_steps(
    steps: pl.DataFrame,
    tokens: pl.DataFrame,
    *,
    z: float = SLOW_Z,
    sigma_floor: float = SLOW_SIGMA_FLOOR,
    ratio: float = SLOW_RATIO,
    min_steps: int = SLOW_MIN_STEPS,
    waits: pl.DataFrame | None = None,
    layer_times: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """Score: the step's cost in robust standard deviations above its phase's median. The anomaly
    names the first token the step produced (a step that produced none is reported without one).

    A step whose shape (rows, output rows) differs from its context's previous step is measured only
    against other such steps: llama.cpp builds and allocates a new compute graph for it, so the
    first decode step of every request costs more than the steady ones (1.3-2x on the test
    models, tests/test_anomalies_planted.py) and would otherwise be flagged in clean runs. Where
    such steps are too few to have a usual cost of their own (a recording of one request has one
    first decode step), a new-shape step is measured against its phase's steady steps at
    SLOW_RESHAPED_RATIO times the ratio.

    With the thread_waits table (`waits`), the reason names what held the step back where the
    scheduler saw it: a stop, or a wait for another process (anomalies/waits.py); with the
    layer_times table (`layer_times`), the layer that took far more than its usual time
    (anomalies/layer_causes.py). Both when both hold: a preempted thread makes its layer slow."""
    ms = (pl.col("t_end_ns") - pl.col("t_start_ns")) / 1e6
    cost = (
        pl.when(pl.col("phase") == "prefill")
        .then(ms / pl.max_horizontal(pl.col("n_tokens"), 1))
        .otherwise(ms)
    )
    shape = pl.struct(pl.col("n_tokens"), pl.col("n_outputs"))
    group = ("phase", "reshaped")
    df = (
        steps.filter(pl.col("t_end_ns").is_not_null() & pl.col("t_start_ns").is_not_null())
        .sort("t_start_ns")
        .with_columns(
            ms.alias("ms"),
            cost.alias("cost"),
            (shape != shape.shift(1).over("ctx_id")).fill_null(True).alias("reshaped"),
        )
    )
    # each kind's usual cost and spread, among kinds with enough steps to have one
    med = pl.col("cost").median()
    stats = (
        df.with_columns(med.over(group).alias("usual"))
        .group_by(group)
        .agg(
            pl.len().alias("n"),
            pl.col("usual").first(),
            (pl.col("cost") - pl.col("usual")).abs().median().alias("mad"),
        )
        .filter(pl.col("n") >= min_steps)
        .drop("n")
    )
    steady = stats.filter(~pl.col("reshaped")).drop("reshaped")
    own = df.join(stats, on=group, how="inner").with_columns(
        pl.lit(ratio).alias("ratio"), pl.lit(False).alias("lone")
    )
    # a new shape too rare to have its own usual (one request's first decode step) against the
    # steady steps of its phase, at a wider ratio
    lone = (
        df.filter(pl.col("reshaped"))
        .join(stats.select(group), on=group, how="anti")
        .join(steady, on="phase", how="inner")
        .with_columns(pl.lit(ratio * SLOW_RESHAPED_RATIO).alias("ratio"), pl.lit(True).alias("lone"))
    )
    df = pl.concat([own, lone])
    if df.is_empty():
        return common.empty()
    sigma = pl.max_horizontal(pl.col("mad") * common.MAD_TO_SIGMA, pl.col("usual") * sigma_floor)
    df = (
        df.with_columns(((pl.col("cost") - pl.col("usual")) / sigma).alias("score"))
        .filter((pl.col("score") >= z) & (pl.col("cost") >= pl.col("ratio") * pl.col("usual")))
        .join(
            tokens.sort("t_end_ns")
            .group_by("step_id")
            .agg(pl.col("request_id", "seq_id", "decode_order").first()),
            on="step_id",
            how="left",
        )
        .sort("step_id")
    )
    step_ns = {
        r["step_id"]: r["t_end_ns"] - r["t_start_ns"]
        for r in df.select("step_id", "t_start_ns", "t_end_ns").iter_rows(named=True)
    }
    causes = wait_causes(waits if waits is not None else pl.DataFrame(), step_ns)
    for sid, cause in layer_causes(
        layer_times if layer_times is not None else pl.DataFrame(), step_ns
    ).items():
        causes[sid] = f"{causes[sid]}; {cause}" if sid in causes else cause
    rows = [
        {
            **r,
            "kind": "slow_step",
            "decode_order_end": r["decode_order"],
            "reason": f"{r['phase']} step {r['step_id']} took {r['ms']:.2f} ms"
            + (f" ({r['n_tokens']} tokens)" if r["phase"] == "prefill" else "")
            + f", {r['cost'] / r['usual']:.1f}x the usual {r['usual']:.2f} ms"
            + (" per token" if r["phase"] == "prefill" else "")
            + (" of steps with a new shape" if r["reshaped"] and not r["lone"] else "")
            + (" of steady steps (a new shape, too few of its kind)" if r["lone"] else "")
            + (f": {causes[r['step_id']]}" if r["step_id"] in causes else ""),
        }
        for r in df.iter_rows(named=True)
    ]
    return common.frame(rows)
