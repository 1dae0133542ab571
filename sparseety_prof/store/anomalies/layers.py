"""Detectors over the per-layer activation and attention lists: sparsity spikes and attention
coverage collapse."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from sparseety_prof.store.anomalies import common

#: a spike: a token whose act_zero_ratio in a layer is SPARSITY_Z robust standard deviations (floor
#: SPARSITY_SIGMA_FLOOR) from that layer's median over the recording, and SPARSITY_MIN_DELTA away
SPARSITY_Z = 6.0
SPARSITY_SIGMA_FLOOR = 0.02
SPARSITY_MIN_DELTA = 0.1
#: a collapse: a layer attends to at most COVERAGE_RATIO of the share of visible cells it attended
#: to at the request's start (median over its first COVERAGE_WARMUP tokens), for COVERAGE_MIN_RUN
#: tokens in a row, once the sequence holds at least COVERAGE_MIN_CELLS cells
COVERAGE_RATIO = 0.5
COVERAGE_WARMUP = 8
COVERAGE_MIN_RUN = 2
COVERAGE_MIN_CELLS = 16


def sparsity_spikes(
    tokens: pl.DataFrame,
    meta: Mapping[str, Any] | None = None,
    *,
    z: float = SPARSITY_Z,
    sigma_floor: float = SPARSITY_SIGMA_FLOOR,
    min_delta: float = SPARSITY_MIN_DELTA,
) -> pl.DataFrame:
    """Score: the largest distance from the layer's median in robust standard deviations."""
    df = common.long_form(tokens, "act_zero_ratio", common.layer_map(meta, "ffn"))
    df = df.filter(pl.col("act_zero_ratio").is_not_null() & pl.col("act_zero_ratio").is_not_nan())
    if df.is_empty():
        return common.empty()
    x = pl.col("act_zero_ratio")
    df = df.with_columns(
        common.robust_z(x, sigma_floor=sigma_floor, over="layer").abs().alias("score"),
        x.median().over("layer").alias("usual"),
    ).with_columns(((pl.col("score") >= z) & ((x - pl.col("usual")).abs() >= min_delta)).alias("flag"))

    def reason(run: dict[str, Any]) -> str:
        seg = df.filter(
            (pl.col("request_id") == run["request_id"])
            & (pl.col("layer") == run["layer"])
            & pl.col("decode_order").is_between(run["decode_order"], run["decode_order_end"])
        )
        usual = seg["usual"][0]
        far = seg.sort((x - pl.col("usual")).abs(), descending=True)["act_zero_ratio"][0]
        return (
            f"layer {run['layer']}: {far:.0%} of activations exactly zero against the layer's usual "
            f"{usual:.0%} ({run['n']} token{'s' if run['n'] > 1 else ''})"
        )

    return common.runs(df, kind="sparsity_spike", by=("request_id", "layer"), min_len=1, reason=reason)


def attention_collapse(
    tokens: pl.DataFrame,
    meta: Mapping[str, Any] | None = None,
    *,
    ratio: float = COVERAGE_RATIO,
    warmup: int = COVERAGE_WARMUP,
    min_run: int = COVERAGE_MIN_RUN,
    min_cells: int = COVERAGE_MIN_CELLS,
) -> pl.DataFrame:
    """Coverage = attn_attended / kv_cells_used per attention layer. Score: the request's starting
    coverage divided by the lowest coverage of the run (how many times less it attends to)."""
    df = common.long_form(
        tokens.filter(pl.col("kv_cells_used") > 0),
        "attn_attended",
        common.layer_map(meta, "attn"),
        extra=("kv_cells_used",),
    )
    df = df.filter(pl.col("attn_attended").is_not_null())
    if df.is_empty():
        return common.empty()
    by = ("request_id", "layer")
    cov = pl.col("attn_attended") / pl.col("kv_cells_used")
    df = (
        df.with_columns(cov.alias("coverage"))
        .with_columns(pl.col("coverage").head(warmup).median().over(by).alias("start"))
        .with_columns((pl.col("start") / pl.max_horizontal(pl.col("coverage"), pl.lit(1e-9))).alias("score"))
        .with_columns(
            ((pl.col("coverage") <= ratio * pl.col("start")) & (pl.col("kv_cells_used") >= min_cells)).alias(
                "flag"
            )
        )
    )

    def reason(run: dict[str, Any]) -> str:
        seg = df.filter(
            (pl.col("request_id") == run["request_id"])
            & (pl.col("layer") == run["layer"])
            & pl.col("decode_order").is_between(run["decode_order"], run["decode_order_end"])
        ).sort("coverage")
        low = seg.row(0, named=True)
        return (
            f"layer {run['layer']} attended to {low['attn_attended']} of {low['kv_cells_used']} "
            f"visible cells ({low['coverage']:.0%}; {low['start']:.0%} at the request's start) "
            f"for {run['n']} tokens"
        )

    return common.runs(df, kind="attention_collapse", by=by, min_len=min_run, reason=reason)
