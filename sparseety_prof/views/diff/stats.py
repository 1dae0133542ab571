"""The statistics of a comparison, per request pair and over the whole run.

Each reduces a long frame of `deltas.Deltas`, in (pair, decode_order, slot) order, grouped by a
column: "pair" for per-pair statistics, `ALL` (one group, key 0) for the whole run. A group with
no row has no entry: the caller substitutes the EMPTY_* statistics of `result`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl

from sparseety_prof.views.diff.deltas import Deltas
from sparseety_prof.views.diff.layers import LayerMap
from sparseety_prof.views.diff.result import (
    AttnDifference,
    AttnStats,
    LayerRatio,
    LogProbStats,
    RatioStats,
    RoutingDifference,
    RoutingStats,
    Tolerances,
    Where,
)

ALL = "_all"
Rows = dict[int, dict[str, Any]]


def _grouped(d: pl.DataFrame, by: str) -> pl.DataFrame:
    return d if by in d.columns else d.with_columns(pl.lit(0, pl.Int64).alias(by))


def _first_rows(d: pl.DataFrame, by: str) -> Rows:
    """The first row of each group (frames are kept in pair, decode_order, slot order)."""
    if d.height == 0:
        return {}
    return {int(r[by]): r for r in d.group_by(by, maintain_order=True).first().iter_rows(named=True)}


def _max_rows(d: pl.DataFrame, column: str, by: str) -> Rows:
    """The row of each group with the largest `column` (the first of equals)."""
    if d.height == 0:
        return {}
    g = d.group_by(by).agg(pl.all().get(pl.col(column).arg_max()))
    return {int(r[by]): r for r in g.iter_rows(named=True)}


def aggregate(d: pl.DataFrame, by: str, **aggs: pl.Expr) -> Rows:
    """Group key -> the named aggregates of that group."""
    if d.height == 0:
        return {}
    return {int(r[by]): r for r in d.group_by(by).agg(**aggs).iter_rows(named=True)}


def as_float(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) else None


def _where(row: Mapping[str, Any], lmap: LayerMap | None = None) -> Where:
    layer = lmap.refs[int(row["_j"])] if lmap is not None else None
    return Where(pair=int(row["pair"]), decode_order=int(row["decode_order"]), layer=layer)


def log_prob_stats(d: pl.DataFrame, tol: float, by: str) -> dict[int, LogProbStats]:
    """`d`: pair, decode_order, delta (same token, both log-probs present)."""
    d = _grouped(d, by)
    beyond = pl.col("delta") > tol
    counts = aggregate(d, by, n=pl.len(), beyond=beyond.sum())
    tops, firsts = _max_rows(d, "delta", by), _first_rows(d.filter(beyond), by)
    out = {}
    for k, c in counts.items():
        top, first = tops.get(k), firsts.get(k)
        out[k] = LogProbStats(
            compared=int(c["n"]),
            max_abs_delta=as_float(top["delta"]) if top else None,
            max_at=_where(top) if top and top["delta"] else None,
            beyond_tol=int(c["beyond"]),
            first_beyond=_where(first) if first else None,
            first_beyond_delta=as_float(first["delta"]) if first else None,
        )
    return out


def routing_stats(
    r: pl.DataFrame, w: pl.DataFrame, lmap: LayerMap, tol: float, by: str
) -> dict[int, RoutingStats]:
    r, w = _grouped(r, by), _grouped(w, by)
    counts = aggregate(
        r, by, n=pl.len(), identical=pl.col("identical").sum(), same_set=pl.col("same_set").sum()
    )
    firsts = _first_rows(r.filter(~pl.col("same_set")), by)
    reorders = _first_rows(r.filter(pl.col("same_set") & ~pl.col("identical")), by)
    beyond = pl.col("delta") > tol
    w_counts = aggregate(w, by, n=pl.len(), beyond=beyond.sum())
    w_tops, w_firsts = _max_rows(w, "delta", by), _first_rows(w.filter(beyond), by)
    out = {}
    for k in counts.keys() | w_counts.keys():
        c, wc = counts.get(k, {"n": 0, "identical": 0, "same_set": 0}), w_counts.get(k, {"n": 0, "beyond": 0})
        n, first, reorder = int(c["n"]), firsts.get(k), reorders.get(k)
        top, first_w = w_tops.get(k), w_firsts.get(k)
        out[k] = RoutingStats(
            compared=n,
            identical=int(c["identical"]),
            same_set=int(c["same_set"]),
            agreement=int(c["identical"]) / n if n else None,
            set_agreement=int(c["same_set"]) / n if n else None,
            first_difference=RoutingDifference(
                where=_where(first, lmap),
                experts_a=list(first["expert_ids"]),
                experts_b=list(first["expert_ids_b"]),
            )
            if first
            else None,
            first_reorder=_where(reorder, lmap) if reorder else None,
            weights_compared=int(wc["n"]),
            max_weight_delta=as_float(top["delta"]) if top else None,
            max_weight_at=_where(top, lmap) if top and top["delta"] else None,
            weights_beyond_tol=int(wc["beyond"]),
            first_weight_beyond=_where(first_w, lmap) if first_w else None,
        )
    return out


def ratio_stats(d: pl.DataFrame, lmap: LayerMap, tol: float, by: str) -> dict[int, RatioStats]:
    d = _grouped(d, by)
    beyond = pl.col("delta") > tol
    counts = aggregate(d, by, n=pl.len(), mean=pl.col("delta").mean(), beyond=beyond.sum())
    tops, firsts = _max_rows(d, "delta", by), _first_rows(d.filter(beyond), by)
    layers: dict[int, list[LayerRatio]] = {}
    if d.height:
        per_layer = (
            d.group_by(by, "_j")
            .agg(
                pl.len().alias("n"),
                pl.col("delta").mean().alias("mean"),
                pl.col("delta").max().alias("max"),
                beyond.sum().alias("beyond"),
            )
            .sort(by, "_j")
        )
        for row in per_layer.iter_rows(named=True):
            layers.setdefault(int(row[by]), []).append(
                LayerRatio(
                    layer=lmap.refs[int(row["_j"])],
                    compared=int(row["n"]),
                    mean_abs_delta=float(row["mean"]),
                    max_abs_delta=float(row["max"]),
                    beyond_tol=int(row["beyond"]),
                )
            )
    out = {}
    for k, c in counts.items():
        top, first = tops.get(k), firsts.get(k)
        out[k] = RatioStats(
            compared=int(c["n"]),
            mean_abs_delta=as_float(c["mean"]),
            max_abs_delta=as_float(top["delta"]) if top else None,
            max_at=_where(top, lmap) if top and top["delta"] else None,
            beyond_tol=int(c["beyond"]),
            first_beyond=_where(first, lmap) if first else None,
            layers=layers.get(k, []),
        )
    return out


def attn_stats(d: pl.DataFrame, lmap: LayerMap, by: str) -> dict[int, AttnStats]:
    d = _grouped(d, by)
    differ = pl.col("delta") != 0
    counts = aggregate(d, by, n=pl.len(), differing=differ.sum(), top=pl.col("delta").max())
    firsts = _first_rows(d.filter(differ), by)
    out = {}
    for k, c in counts.items():
        first = firsts.get(k)
        out[k] = AttnStats(
            compared=int(c["n"]),
            differing=int(c["differing"]),
            max_abs_delta=int(c["top"]) if c["top"] is not None else None,
            first_difference=AttnDifference(
                where=_where(first, lmap),
                attended_a=int(first["attn_attended"]),
                attended_b=int(first["attn_attended_b"]),
            )
            if first
            else None,
        )
    return out


@dataclass(frozen=True)
class Stats:
    """Group key -> statistics; routing, act_zero_ratio and attn are empty when not comparable."""

    log_prob: dict[int, LogProbStats]
    routing: dict[int, RoutingStats]
    act_zero_ratio: dict[int, RatioStats]
    attn: dict[int, AttnStats]


def statistics(d: Deltas, tol: Tolerances, by: str) -> Stats:
    return Stats(
        log_prob=log_prob_stats(d.log_prob, tol.logprob, by),
        routing=routing_stats(d.routing, d.weights, d.moe, tol.weight, by)
        if d.routing is not None and d.weights is not None and d.moe is not None
        else {},
        act_zero_ratio=ratio_stats(d.ratios, d.ffn, tol.ratio, by)
        if d.ratios is not None and d.ffn is not None
        else {},
        attn=attn_stats(d.attn, d.attn_layers, by)
        if d.attn is not None and d.attn_layers is not None
        else {},
    )
