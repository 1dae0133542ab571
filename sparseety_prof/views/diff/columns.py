"""The tokens-table columns a diff reads, and which compared columns a pair of runs cannot compare.

A column that one recording did not capture (all null, or empty lists, e.g. expert ids of a dense
model) is "not comparable", never a difference."""

from __future__ import annotations

import polars as pl

from sparseety_prof.store import schema
from sparseety_prof.views.diff.result import ATTN, FFN, MOE

#: Without these a recording cannot be paired at all.
REQUIRED = ("request_id", "decode_order", "token_id", "t_end_ns")
#: Compared columns: name -> (layer kind or None, nesting depth of the per-token value).
COMPARED: dict[str, tuple[str | None, int]] = {
    "log_prob": (None, 0),
    "expert_ids": (MOE, 2),
    "expert_weights": (MOE, 2),
    "act_zero_ratio": (FFN, 1),
    "attn_attended": (ATTN, 1),
}
for _c in (*REQUIRED, *COMPARED, "seq_id", "partial", "token_text"):
    if _c not in schema.TOKENS:  # pragma: no cover - guards against a schema rename
        raise ImportError(f"diff: column {_c!r} is not in schema.TOKENS")


def not_captured(df: pl.DataFrame, column: str, depth: int) -> str | None:
    """Why `column` holds nothing comparable in `df` (None when it does)."""
    s = df[column]
    if df.height == 0 or s.null_count() == s.len():
        return "not captured"
    if depth == 1 and not (s.list.len().fill_null(0).max() or 0):
        return "empty lists"
    if depth == 2:
        inner = s.list.eval(pl.element().list.len()).list.sum().fill_null(0).max()
        if not inner:
            return "empty lists (no MoE layers: a dense model?)"
    return None


def not_comparable(a: pl.DataFrame, b: pl.DataFrame) -> dict[str, str]:
    """Compared column -> why it cannot be compared, for the paired rows of A and B."""
    out: dict[str, str] = {}
    if not (a.height and b.height):
        return out
    for column, (_, depth) in COMPARED.items():
        why_a, why_b = not_captured(a, column, depth), not_captured(b, column, depth)
        if why_a and why_b:
            out[column] = f"{why_a} in A, {why_b} in B" if why_a != why_b else f"{why_a} in both"
        elif why_a or why_b:
            out[column] = f"{why_a} in A" if why_a else f"{why_b} in B"
    if "expert_ids" in out and "expert_weights" not in out:
        out["expert_weights"] = "expert ids not comparable"
    return out
