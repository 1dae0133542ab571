"""Detectors over MoE routing (the tokens table's expert_ids): the same experts step after step,
sudden changes of the expert set, and load concentrated on a few experts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from sparseety_prof.store.anomalies import common

#: a collapse: one layer keeps the same expert set COLLAPSE_MIN_RUN tokens in a row while the other
#: MoE layers change theirs on at least COLLAPSE_OTHERS_CHANGING of those tokens (the input did not
#: simply freeze) and the layer chooses other sets elsewhere in the recording
COLLAPSE_MIN_RUN = 8
COLLAPSE_OTHERS_CHANGING = 0.5
#: a jump: a token whose expert sets changed (mean Jaccard distance to the previous token's, over
#: the MoE layers) JUMP_Z robust standard deviations (floor JUMP_SIGMA_FLOOR) above the request's
#: median change, and at least JUMP_MIN_DELTA above it, in a request of JUMP_MIN_TOKENS or more
JUMP_Z = 5.0
JUMP_SIGMA_FLOOR = 0.05
JUMP_MIN_DELTA = 0.5
JUMP_MIN_TOKENS = 8
#: imbalance: the busiest expert of a layer takes IMBALANCE_RATIO times the mean load, over at least
#: IMBALANCE_MIN_PER_EXPERT selections per expert in the recording
IMBALANCE_RATIO = 2.0
IMBALANCE_MIN_PER_EXPERT = 10


def _sets(tokens: pl.DataFrame, meta: Mapping[str, Any] | None) -> pl.DataFrame:
    """(KEYS, layer, experts sorted) per decode-ordered token and MoE layer."""
    df = common.long_form(tokens, "expert_ids", common.layer_map(meta, "moe"))
    return df.filter(pl.col("expert_ids").is_not_null()).with_columns(
        pl.col("expert_ids").list.sort().alias("experts")
    )


def n_experts(tokens: pl.DataFrame, meta: Mapping[str, Any] | None) -> int:
    """The model's expert count (GGUF expert_count in meta.json), else the highest id seen + 1."""
    hp = ((meta or {}).get("model") or {}).get("hyperparameters") or {}
    if isinstance(hp.get("expert_count"), int) and hp["expert_count"] > 0:
        return int(hp["expert_count"])
    seen = tokens["expert_ids"].explode().explode().max()
    return int(seen) + 1 if isinstance(seen, int) else 0


def routing_collapse(
    tokens: pl.DataFrame,
    meta: Mapping[str, Any] | None = None,
    *,
    min_run: int = COLLAPSE_MIN_RUN,
    others_changing: float = COLLAPSE_OTHERS_CHANGING,
) -> pl.DataFrame:
    """Score: the run's length in tokens."""
    df = _sets(tokens, meta)
    if df.is_empty():
        return common.empty()
    total = n_experts(tokens, meta)
    by = ["request_id", "layer"]
    df = df.with_columns(
        (pl.col("experts") != pl.col("experts").shift(1).over(by)).fill_null(True).alias("changed")
    )
    n_layers = df["layer"].n_unique()
    # how many of the other layers changed their experts on the same token
    df = df.with_columns(
        (
            (pl.col("changed").sum().over("request_id", "decode_order") - pl.col("changed"))
            / max(n_layers - 1, 1)
        ).alias("others")
    )
    varies = df.group_by("layer").agg(pl.col("experts").n_unique().alias("sets"))
    runs = (
        df.with_columns(pl.col("changed").cum_sum().over(by).alias("run"))
        .group_by(*by, "run", maintain_order=True)
        .agg(
            pl.col("seq_id", "decode_order", "step_id", "experts").first(),
            pl.col("decode_order").last().alias("decode_order_end"),
            pl.len().alias("n"),
            pl.col("others").slice(1).mean().alias("others"),  # the first token of a run changed itself
        )
        .join(varies, on="layer")
        .filter(
            (pl.col("n") >= min_run)
            & (pl.col("sets") > 1)
            & (pl.col("experts").list.len() < total)
            & ((pl.col("others") >= others_changing) if n_layers > 1 else pl.lit(True))
        )
    )
    rows = [
        {
            **r,
            "kind": "routing_collapse",
            "score": float(r["n"]),
            "reason": f"layer {r['layer']} chose experts {r['experts']} for {r['n']} tokens in a row"
            + (
                f" while the other layers changed theirs on {r['others']:.0%} of them" if n_layers > 1 else ""
            ),
        }
        for r in runs.iter_rows(named=True)
    ]
    return common.frame(rows)


def routing_jumps(
    tokens: pl.DataFrame,
    meta: Mapping[str, Any] | None = None,
    *,
    z: float = JUMP_Z,
    sigma_floor: float = JUMP_SIGMA_FLOOR,
    min_delta: float = JUMP_MIN_DELTA,
    min_tokens: int = JUMP_MIN_TOKENS,
) -> pl.DataFrame:
    """Score: the token's change rate in robust standard deviations above the request's usual."""
    df = _sets(tokens, meta)
    if df.is_empty():
        return common.empty()
    prev = pl.col("experts").shift(1).over("request_id", "layer")
    inter = pl.col("experts").list.set_intersection(prev).list.len()
    union = pl.col("experts").list.set_union(prev).list.len()
    per_token = (
        df.with_columns((1 - inter / union).alias("change"))
        .filter(pl.col("change").is_not_null())
        .group_by("request_id", "decode_order", maintain_order=True)
        .agg(pl.col("seq_id", "step_id").first(), pl.col("change").mean())
        .filter(pl.len().over("request_id") >= min_tokens)
        .with_columns(
            common.robust_z(pl.col("change"), sigma_floor=sigma_floor, over="request_id").alias("score"),
            pl.col("change").median().over("request_id").alias("usual"),
        )
        .with_columns(
            ((pl.col("score") >= z) & (pl.col("change") - pl.col("usual") >= min_delta)).alias("flag")
        )
    )
    # each jumping token is its own anomaly: a jump is one change, not a state
    rows = [
        {
            **r,
            "kind": "routing_jump",
            "decode_order_end": r["decode_order"],
            "reason": f"the experts changed by {r['change']:.0%} (mean Jaccard distance over the layers) "
            f"against the request's usual {r['usual']:.0%}",
        }
        for r in per_token.filter(pl.col("flag")).iter_rows(named=True)
    ]
    return common.frame(rows)


def load_imbalance(
    tokens: pl.DataFrame,
    meta: Mapping[str, Any] | None = None,
    *,
    ratio: float = IMBALANCE_RATIO,
    min_per_expert: int = IMBALANCE_MIN_PER_EXPERT,
) -> pl.DataFrame:
    """Per MoE layer, over the tokens of every request seen from its start. Score: the busiest
    expert's load / the mean load."""
    total = n_experts(tokens, meta)
    df = common.long_form(tokens, "expert_ids", common.layer_map(meta, "moe"))
    if df.is_empty() or total == 0:
        return common.empty()
    counts = (
        df.select("layer", pl.col("expert_ids").alias("expert"))
        .explode("expert")
        .drop_nulls()
        .group_by("layer", "expert")
        .len()
    )
    rows = []
    for (layer,), c in counts.group_by("layer"):
        selections = int(c["len"].sum())
        if selections < min_per_expert * total:
            continue
        mean = selections / total
        busiest = c.sort("len", descending=True).row(0, named=True)
        score = busiest["len"] / mean
        if score >= ratio:
            unused = total - c.height
            rows.append(
                {
                    "kind": "load_imbalance",
                    "score": score,
                    "layer": layer,
                    "reason": f"expert {busiest['expert']} took {busiest['len'] / selections:.0%} of layer "
                    f"{layer}'s {selections} selections ({score:.1f}x the mean"
                    + (f"; {unused} of {total} experts never chosen)" if unused else ")"),
                }
            )
    return common.frame(sorted(rows, key=lambda r: r["layer"]))
