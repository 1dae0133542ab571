"""Which request of A goes with which of B.

Request ids are generated per run, so requests are paired by order of their first token
(``t_end_ns``) within each recording: the first request of A with the first of B, and so on.
Requests already running when the recording began (``partial``; their ``decode_order`` is null)
are left out of both sides and counted. With different request counts the extra requests are
unpaired (and pairs after a missing request may be shifted: only a note can say so)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl

from sparseety_prof.errors import CorruptRecording, UsageError
from sparseety_prof.store import schema
from sparseety_prof.views.diff.columns import REQUIRED
from sparseety_prof.views.diff.result import SideSummary


@dataclass(frozen=True)
class Side:
    rows: pl.DataFrame  # complete requests, one row per (pair, decode_order), with a "pair" column
    order: pl.DataFrame  # request_id, pair, tokens, last (max decode_order)
    summary: SideSummary


@dataclass(frozen=True)
class Pairing:
    a: Side
    b: Side
    pairs: int  # pair indices 0 .. pairs-1 exist on both sides
    rows_a: pl.DataFrame  # the token rows of the paired requests
    rows_b: pl.DataFrame
    unpaired_a: list[str]  # request ids, in first-token order
    unpaired_b: list[str]


def _with_schema_columns(df: pl.DataFrame, side: str) -> pl.DataFrame:
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise CorruptRecording(f"the tokens table of {side} lacks the columns {missing}")
    if df.height and df["token_id"].null_count() == df.height:
        # tokens are what a diff compares: without them every pair would look equal
        raise UsageError(
            f"{side} holds no token ids (recorded or exported with --redact ids): nothing to compare"
        )
    absent = [c for c in schema.TOKENS if c not in df.columns]
    return df.with_columns(pl.lit(None, dtype=schema.TOKENS[c]).alias(c) for c in absent)


def prepare(df: pl.DataFrame, side: str, complete: bool | None) -> Side:
    """One recording's complete requests in first-token order, one row per decode_order."""
    df = _with_schema_columns(df, side)
    partial_row = pl.col("partial").fill_null(False) | pl.col("decode_order").is_null()
    partial_ids = df.filter(partial_row)["request_id"].unique()
    is_partial = pl.col("request_id").is_in(partial_ids.implode()) | pl.col("request_id").is_null()
    partial = df.filter(is_partial)
    kept = df.filter(~is_partial)
    order = (
        kept.group_by("request_id")
        .agg(pl.col("t_end_ns").min().alias("_first"), pl.col("seq_id").min().alias("_seq"))
        .sort(["_first", "_seq", "request_id"], nulls_last=True)
        .with_row_index("pair")
        .with_columns(pl.col("pair").cast(pl.Int64))
        .select("request_id", "pair")
    )
    rows = (
        kept.join(order, on="request_id", how="inner")
        .sort(["pair", "decode_order", "t_end_ns"], nulls_last=True)
        .unique(["pair", "decode_order"], keep="first", maintain_order=True)
    )
    counts = rows.group_by("pair").agg(
        pl.len().alias("tokens"), pl.col("decode_order").max().cast(pl.Int64).alias("last")
    )
    order = order.join(counts, on="pair", how="left").sort("pair")
    summary = SideSummary(
        requests=order.height,
        tokens=rows.height,
        partial_requests=partial.filter(pl.col("request_id").is_not_null())["request_id"].n_unique(),
        partial_rows=partial.height,
        duplicate_rows=kept.height - rows.height,
        complete=complete,
    )
    return Side(rows=rows, order=order, summary=summary)


def _side_notes(name: str, s: SideSummary) -> list[str]:
    notes = []
    if s.partial_requests or s.partial_rows:
        notes.append(
            f"{name}: {s.partial_requests} partial request(s) ({s.partial_rows} token rows) were "
            "already running when the recording began: excluded"
        )
    if s.duplicate_rows:
        notes.append(f"{name}: {s.duplicate_rows} repeated (request, decode_order) rows: the first kept")
    if s.complete is False:
        notes.append(f"{name} was never closed (interrupted): its last requests may be cut short")
    return notes


def pair_requests(
    tokens_a: pl.DataFrame,
    tokens_b: pl.DataFrame,
    meta_a: Mapping[str, Any] | None,
    meta_b: Mapping[str, Any] | None,
    notes: list[str],
) -> Pairing:
    """Prepare both recordings and pair their requests; what the reader should know goes to `notes`."""
    sides: list[Side] = []
    for name, df, meta in (("A", tokens_a, meta_a), ("B", tokens_b, meta_b)):
        complete = meta.get("complete") if meta is not None else None
        side = prepare(df, name, complete if isinstance(complete, bool) else None)
        sides.append(side)
        notes += _side_notes(name, side.summary)
    sa, sb = sides
    n_pairs = min(sa.summary.requests, sb.summary.requests)
    unpaired_a = sa.order.filter(pl.col("pair") >= n_pairs)["request_id"].to_list()
    unpaired_b = sb.order.filter(pl.col("pair") >= n_pairs)["request_id"].to_list()
    if unpaired_a or unpaired_b:
        more, extra = ("A", unpaired_a) if unpaired_a else ("B", unpaired_b)
        notes.append(
            f"request counts differ: A has {sa.summary.requests}, B {sb.summary.requests}; the last "
            f"{len(extra)} of {more} (by first-token time) are unpaired, and if a request is missing "
            "earlier, later pairs are shifted"
        )
    return Pairing(
        a=sa,
        b=sb,
        pairs=n_pairs,
        rows_a=sa.rows.filter(pl.col("pair") < n_pairs),
        rows_b=sb.rows.filter(pl.col("pair") < n_pairs),
        unpaired_a=unpaired_a,
        unpaired_b=unpaired_b,
    )
