"""The per-column differences of the aligned positions, as long frames the statistics reduce.

Log-probs are compared only where both runs sampled the same token. Expert lists are compared as
lists (identical) and as sets (a reorder with the same set is not a routing difference); gate
weights only for experts both runs selected."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl

from sparseety_prof.views.diff.alignment import TOKENS_DIFFER, abs_delta, slots
from sparseety_prof.views.diff.layers import LayerMap, layer_map
from sparseety_prof.views.diff.result import ATTN, FFN, MOE


@dataclass(frozen=True)
class Deltas:
    """Each frame is in (pair, decode_order, slot `_j`) order; None: the column is not comparable."""

    log_prob: pl.DataFrame  # pair, decode_order, delta
    routing: pl.DataFrame | None  # slots of expert_ids with `identical` and `same_set`
    weights: pl.DataFrame | None  # pair, decode_order, _j, delta: one row per expert both selected
    moe: LayerMap | None
    ratios: pl.DataFrame | None  # slots of act_zero_ratio with delta
    ffn: LayerMap | None
    attn: pl.DataFrame | None  # slots of attn_attended with delta (cells)
    attn_layers: LayerMap | None


def with_same_set(r: pl.DataFrame) -> pl.DataFrame:
    """Adds `identical` (same experts, same order) and `same_set` (same experts, any order)."""
    r = r.with_columns(pl.col("expert_ids").eq_missing(pl.col("expert_ids_b")).alias("identical"))
    r = r.with_row_index("_r")
    odd = r.filter(~pl.col("identical"))
    ea = odd.select("_r", pl.col("expert_ids").alias("_e")).explode("_e").drop_nulls()
    eb = odd.select("_r", pl.col("expert_ids_b").alias("_e")).explode("_e").drop_nulls()
    bad = pl.concat(
        [
            odd.filter(pl.col("expert_ids").list.len() != pl.col("expert_ids_b").list.len())["_r"],
            ea.join(eb, on=["_r", "_e"], how="anti")["_r"],
            eb.join(ea, on=["_r", "_e"], how="anti")["_r"],
        ]
    )
    same_set = pl.col("identical") | ~pl.col("_r").is_in(bad.implode())
    return r.with_columns(same_set.alias("same_set")).drop("_r")


def weight_deltas(win: pl.DataFrame, lmap: LayerMap) -> pl.DataFrame:
    """|Δ gate weight| per (pair, decode_order, slot, expert selected by both runs)."""
    w = slots(win, lmap, ["expert_ids", "expert_weights"]).filter(
        (pl.col("expert_ids").list.len() == pl.col("expert_weights").list.len())
        & (pl.col("expert_ids_b").list.len() == pl.col("expert_weights_b").list.len())
    )
    keys = ["pair", "decode_order", "_j"]
    same = (
        w.filter(pl.col("expert_ids").eq_missing(pl.col("expert_ids_b")))
        .select(*keys, "expert_weights", "expert_weights_b")
        .explode("expert_weights", "expert_weights_b")
        .filter(pl.col("expert_weights").is_not_null() & pl.col("expert_weights_b").is_not_null())
        .select(*keys, abs_delta("expert_weights", "expert_weights_b").alias("delta"))
    )
    odd = w.filter(~pl.col("expert_ids").eq_missing(pl.col("expert_ids_b"))).with_row_index("_r")
    if odd.height == 0:
        return same
    ea = odd.select("_r", *keys, pl.col("expert_ids").alias("_e"), pl.col("expert_weights").alias("_w"))
    eb = odd.select("_r", pl.col("expert_ids_b").alias("_e"), pl.col("expert_weights_b").alias("_w"))
    matched = (
        ea.explode("_e", "_w")
        .join(eb.explode("_e", "_w"), on=["_r", "_e"], how="inner", suffix="_b")
        .filter(pl.col("_e").is_not_null() & pl.col("_w").is_not_null() & pl.col("_w_b").is_not_null())
        .select(*keys, abs_delta("_w", "_w_b").alias("delta"))
    )
    return pl.concat([same, matched]).sort(keys, maintain_order=True)


def deltas(
    win: pl.DataFrame,
    a: pl.DataFrame,
    b: pl.DataFrame,
    meta_a: Mapping[str, Any] | None,
    meta_b: Mapping[str, Any] | None,
    not_comparable: Mapping[str, str],
    notes: list[str],
) -> Deltas:
    """The differences of the aligned window `win`; `a`, `b` (the paired rows) size the layer maps."""
    lp = win.filter(~TOKENS_DIFFER & pl.col("log_prob").is_not_null() & pl.col("log_prob_b").is_not_null())
    lp = lp.select("pair", "decode_order", abs_delta("log_prob", "log_prob_b").alias("delta"))
    if "log_prob" in not_comparable:
        lp = lp.clear()

    comparable = a.height > 0 and b.height > 0
    routing = weights = ratios = attn = None
    moe_map = ffn_map = attn_map = None
    if comparable and "expert_ids" not in not_comparable:
        moe_map = layer_map(MOE, "expert_ids", a, b, meta_a, meta_b, notes)
        routing = with_same_set(slots(win, moe_map, ["expert_ids"]))
        one_sided = win.filter(pl.col("expert_ids").is_null() != pl.col("expert_ids_b").is_null()).height
        if one_sided:
            notes.append(f"expert_ids: {one_sided} compared token(s) have routing in one run only: skipped")
        weights = weight_deltas(win, moe_map)
        if "expert_weights" in not_comparable:
            weights = weights.clear()
    if comparable and "act_zero_ratio" not in not_comparable:
        ffn_map = layer_map(FFN, "act_zero_ratio", a, b, meta_a, meta_b, notes)
        ratios = slots(win, ffn_map, ["act_zero_ratio"]).with_columns(
            abs_delta("act_zero_ratio", "act_zero_ratio_b").alias("delta")
        )
    if comparable and "attn_attended" not in not_comparable:
        attn_map = layer_map(ATTN, "attn_attended", a, b, meta_a, meta_b, notes)
        attn = slots(win, attn_map, ["attn_attended"]).with_columns(
            (pl.col("attn_attended").cast(pl.Int64) - pl.col("attn_attended_b").cast(pl.Int64))
            .abs()
            .alias("delta")
        )
    return Deltas(lp, routing, weights, moe_map, ratios, ffn_map, attn, attn_map)
