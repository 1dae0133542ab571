"""One request's decisions per token: the experts each MoE layer chose and the share of exactly-zero
activations in each FFN layer, as a table that fits the terminal (the demo's last screen)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl
from rich.console import Console

from sparseety_prof.views.fitted_table import print_fitted

HEADERS = ("#", "token", "experts per MoE layer", "zero %", "below %")
Row = tuple[str, str, str, str, str]


def _percents(values: list[float | None] | None) -> str:
    return " ".join("-" if v is None else f"{100 * v:.0f}" for v in values) if values else "-"


def _layers(meta: Mapping[str, Any], kind: str, n: int) -> list[int]:
    got = (meta.get("layers") or {}).get(kind)
    return [int(x) for x in got][:n] if isinstance(got, list) and len(got) >= n else list(range(n))


def first_request(tokens: pl.DataFrame) -> str | None:
    """The request whose first token came first among those seen from their start."""
    seen = tokens.filter(pl.col("decode_order").is_not_null()).sort("t_end_ns")
    return str(seen["request_id"][0]) if seen.height else None


def decision_rows(tokens: pl.DataFrame, request_id: str, limit: int) -> list[Row]:
    """The request's first `limit` tokens in decode order: decode order, text, the experts of each
    MoE layer in the engine's order (layers separated by "|"), and per FFN layer the % of
    activations exactly zero and below the threshold."""
    req = tokens.filter(pl.col("request_id") == request_id).sort("decode_order").head(limit)
    rows = []
    cols = ("decode_order", "token_id", "token_text", "expert_ids", "act_zero_ratio", "act_below_ratio")
    for order, tid, txt, experts, zero, below in req.select(cols).iter_rows():
        shown = txt if txt is not None else f"<{tid}>"
        ex = "|".join(",".join(str(e) for e in layer or ()) for layer in experts) if experts else "-"
        rows.append(("-" if order is None else str(order), shown, ex, _percents(zero), _percents(below)))
    return rows


def print_decisions(
    con: Console, tokens: pl.DataFrame, meta: Mapping[str, Any], request_id: str, *, limit: int = 24
) -> list[Row]:
    """The table of `decision_rows` (through terminal_text: token text comes from the model) with
    a legend naming the layers; returns the rows shown."""
    rows = decision_rows(tokens, request_id, limit)
    req = tokens.filter(pl.col("request_id") == request_id)
    n_moe = max((len(x) for x in req["expert_ids"].to_list() if x), default=0)
    n_ffn = max((len(x) for x in req["act_zero_ratio"].to_list() if x), default=0)
    moe = " ".join(f"L{x}" for x in _layers(meta, "moe", n_moe)) or "none recorded"
    ffn = " ".join(f"L{x}" for x in _layers(meta, "ffn", n_ffn)) or "none recorded"
    print_fitted(
        con,
        f"decisions per token: request {request_id} (first {len(rows)} of {req.height} tokens)",
        HEADERS,
        rows,
        legend=f"#: decode order. experts: the ids each MoE layer's router chose, its order, layers {moe} "
        f"separated by |. zero %, below %: activations exactly zero, and |x| < meta act_threshold, "
        f"layers {ffn}.",
    )
    return rows
