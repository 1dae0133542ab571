"""What every detector shares: robust statistics, the decode-ordered token frame, per-layer lists in
long form, and turning flagged tokens into runs of anomaly rows."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import polars as pl

from sparseety_prof.store import schema

#: median absolute deviation -> standard deviation of a normal distribution
MAD_TO_SIGMA = 1.4826
#: token columns that locate an anomaly
KEYS = ("request_id", "seq_id", "decode_order", "step_id")


def empty() -> pl.DataFrame:
    return pl.DataFrame(schema=schema.ANOMALIES)


def robust_z(x: pl.Expr, *, sigma_floor: float, over: str | Sequence[str] | None = None) -> pl.Expr:
    """(x - median) / (1.4826 * MAD), the MAD floored at `sigma_floor` so that a baseline with no
    spread (every value equal) does not make the smallest change infinitely significant."""
    med = x.median() if over is None else x.median().over(over)
    dev = (x - med).abs()
    mad = dev.median() if over is None else dev.median().over(over)
    sigma = pl.max_horizontal(mad * MAD_TO_SIGMA, pl.lit(sigma_floor))
    return (x - med) / sigma


def ordered(tokens: pl.DataFrame) -> pl.DataFrame:
    """The tokens with a decode order, one request after the other, in decode order (a request seen
    from its start; rows of a request the profiler joined mid-way have no decode order)."""
    return tokens.filter(pl.col("decode_order").is_not_null()).sort("request_id", "decode_order")


def layer_map(meta: Mapping[str, Any] | None, kind: str) -> list[int] | None:
    """meta.json's "layers"[kind]: which model layer each element of a per-layer list is."""
    layers = (meta or {}).get("layers")
    got = layers.get(kind) if isinstance(layers, dict) else None
    return [int(x) for x in got] if isinstance(got, list) else None


def long_form(
    tokens: pl.DataFrame, column: str, layers: list[int] | None, *, extra: Sequence[str] = ()
) -> pl.DataFrame:
    """One row per (token, list element) of a per-layer list column of the decode-ordered tokens,
    with the element's model layer (`layers[index]`, or the index itself without a layer map) in
    "layer", and the token's `extra` columns."""
    df = ordered(tokens).select(*KEYS, *extra, column).filter(pl.col(column).is_not_null())
    df = df.with_columns(pl.int_ranges(0, pl.col(column).list.len()).alias("layer")).explode(column, "layer")
    if layers is not None:
        df = df.filter(pl.col("layer") < len(layers)).with_columns(
            pl.col("layer").replace_strict(list(range(len(layers))), layers, return_dtype=pl.Int32())
        )
    return df.with_columns(pl.col("layer").cast(pl.Int32()))


def runs(
    flagged: pl.DataFrame,
    *,
    kind: str,
    by: Sequence[str],
    min_len: int,
    reason: Callable[[dict[str, Any]], str],
) -> pl.DataFrame:
    """Rows of `flagged` (KEYS, the `by` columns, a boolean "flag" and a float "score", in decode
    order within each group) merged into runs of consecutive flagged tokens; a run of at least
    `min_len` tokens becomes one anomaly with its largest score. `reason(run)` words it from the
    run's columns (the KEYS of its first token, "decode_order_end", "n", "score", the `by` values)."""
    if flagged.is_empty():
        return empty()
    grouped = (
        flagged.with_columns(
            (pl.col("flag") != pl.col("flag").shift(1).over(by))
            .fill_null(True)
            .cum_sum()
            .over(by)
            .alias("run")
        )
        .filter(pl.col("flag"))
        .group_by(*by, "run", maintain_order=True)
        .agg(
            *[pl.col(k).first() for k in KEYS if k not in by],
            pl.col("decode_order").last().alias("decode_order_end"),
            pl.len().alias("n"),
            pl.col("score").max(),
        )
        .filter(pl.col("n") >= min_len)
    )
    rows = [{**row, "kind": kind, "reason": reason(row)} for row in grouped.iter_rows(named=True)]
    return frame(rows)


def frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """Anomaly rows (dicts with any of the ANOMALIES columns; the rest null) as the schema's frame."""
    if not rows:
        return empty()
    return pl.DataFrame(
        {c: [r.get(c) for r in rows] for c in schema.ANOMALIES}, schema=schema.ANOMALIES, strict=False
    )
