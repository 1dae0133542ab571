"""Token alignment: the two runs' rows side by side, by (pair, decode_order), and per layer
(decode_order 0 is the first generated token).

The divergence point of a pair is the first ``decode_order`` where the token ids differ. Every
later token is conditioned on a different history, so by default nothing after it is compared
(``all_positions`` keeps comparing aligned positions, for what that is worth). The per-layer
columns of a token row describe the forward pass that produced its logits, whose input is the
previous token: at the divergence point that input is still shared, so they are compared there
too (they are often the cause)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import polars as pl

from sparseety_prof.views.diff.columns import COMPARED
from sparseety_prof.views.diff.layers import LayerMap

#: The columns of both runs in an aligned frame: A's under their name, B's under name + "_b".
ALIGNED_COLUMNS = ["token_id", "token_text", "log_prob", *[c for c in COMPARED if c != "log_prob"]]
#: On an aligned frame: the two runs sampled different tokens at this position.
TOKENS_DIFFER = pl.col("token_id").ne_missing(pl.col("token_id_b"))


def align(a: pl.DataFrame, b: pl.DataFrame, all_positions: bool) -> pl.DataFrame:
    """The positions to compare: rows present in both runs, in (pair, decode_order) order, with
    each pair's divergence point in "div" (null: none); up to it unless `all_positions`."""
    cols = ALIGNED_COLUMNS
    al = (
        a.select("pair", "decode_order", *cols)
        .join(b.select("pair", "decode_order", *cols), on=["pair", "decode_order"], how="inner", suffix="_b")
        .sort("pair", "decode_order")
    )
    div = al.filter(TOKENS_DIFFER).group_by("pair").agg(pl.col("decode_order").min().alias("div"))
    win = al.join(div, on="pair", how="left").sort("pair", "decode_order")
    if not all_positions:
        win = win.filter(pl.col("div").is_null() | (pl.col("decode_order") <= pl.col("div")))
    return win


def slots(win: pl.DataFrame, lmap: LayerMap, columns: Sequence[str]) -> pl.DataFrame:
    """One row per (pair, decode_order, slot `_j`) of per-layer list columns of the aligned frame:
    A's value of each column under its name, B's under name + "_b", for the layers `lmap` pairs up.
    Token rows where a column is null on either side are left out, as are missing layers."""
    both = [pl.col(c).is_not_null() & pl.col(f"{c}_b").is_not_null() for c in columns]
    gathered = [
        e
        for c in columns
        for e in (
            pl.col(c).list.gather(lmap.idx_a, null_on_oob=True).alias(c),
            pl.col(f"{c}_b").list.gather(lmap.idx_b, null_on_oob=True).alias(f"{c}_b"),
        )
    ]
    first = columns[0]
    d = win.filter(*both).select("pair", "decode_order", *gathered)
    d = d.with_columns(pl.int_ranges(pl.col(first).list.len(), dtype=pl.Int64).alias("_j"))
    names = [n for c in columns for n in (c, f"{c}_b")]
    return d.explode(*names, "_j").filter(
        *[pl.col(n).is_not_null() for n in names], pl.col("_j").is_not_null()
    )


def abs_delta(a: str, b: str) -> pl.Expr:
    """|a - b|, 0 for equal values (infinities and NaNs included), inf when only one is NaN."""
    x, y = pl.col(a).cast(pl.Float64), pl.col(b).cast(pl.Float64)
    return pl.when(x == y).then(0.0).otherwise((x - y).abs().fill_nan(math.inf))
