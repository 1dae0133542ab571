"""Redaction levels (`--redact ids,routing,sparsity,masks`): what a recording leaves out of the
per-token signals that recover prompts (token ids, MoE expert choices, activation sparsity, masks).

Applied to every frame before it is written, at record time (RecordingWriter) and at export
(`sparseety-prof redact`), and by `audit` to measure what each level leaves. Which columns each
level empties or coarsens is schema.py's (REDACT_NULL, REDACT_COARSEN). Nulled columns keep their
name and dtype, so a redacted recording has the same schema and every reader still opens it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import polars as pl

from sparseety_prof.store import schema

LEVELS = schema.REDACT_LEVELS
SPARSITY_STEP = schema.REDACT_SPARSITY_STEP


def parse_levels(values: Iterable[str]) -> frozenset[str]:
    """Levels from command-line values, each one level or a comma-separated list ("routing,masks").
    ValueError names an unknown level and the known ones."""
    levels = {v.strip() for value in values for v in value.split(",") if v.strip()}
    unknown = sorted(levels - set(LEVELS))
    if unknown:
        raise ValueError(f"unknown redaction level {', '.join(unknown)}; levels are {', '.join(LEVELS)}")
    return frozenset(levels)


def ordered(levels: Iterable[str]) -> list[str]:
    """`levels` in LEVELS order (how meta.json and the views list them)."""
    got = set(levels)
    return [lv for lv in LEVELS if lv in got]


def redacted_columns(table: str, levels: Iterable[str]) -> tuple[list[str], list[str]]:
    """(columns stored as nulls, columns coarsened) of `table` under `levels`."""
    nulls: list[str] = []
    coarse: list[str] = []
    for level in ordered(levels):
        nulls += schema.REDACT_NULL.get(level, {}).get(table, ())
        coarse += schema.REDACT_COARSEN.get(level, {}).get(table, ())
    return nulls, [c for c in coarse if c not in nulls]


def redact_frame(table: str, df: pl.DataFrame, levels: Iterable[str]) -> pl.DataFrame:
    """`df` (rows of `table`) as `levels` store it: same columns and dtypes."""
    nulls, coarse = redacted_columns(table, levels)
    if not nulls and not coarse:
        return df
    dtypes = schema.TABLES[table]
    exprs = [pl.lit(None, dtype=dtypes[c]).alias(c) for c in nulls]
    for c in coarse:
        if isinstance(dtypes[c], pl.List):
            exprs.append(pl.col(c).list.eval(_coarse(pl.element())).cast(dtypes[c]).alias(c))
        else:
            exprs.append(_coarse(pl.col(c)).cast(dtypes[c]).alias(c))
    return df.with_columns(exprs)


def _coarse(e: pl.Expr) -> pl.Expr:
    return (e / SPARSITY_STEP).round(0) * SPARSITY_STEP


class ExpertLoad:
    """How often each expert was selected, per MoE layer: the aggregate that "routing" keeps (load
    balance is a performance question; which token chose which expert is the leak)."""

    def __init__(self) -> None:
        self.counts: dict[int, np.ndarray] = {}
        self.rows: dict[int, int] = {}

    def add(self, routes: pl.DataFrame) -> None:
        """Count the experts of `routes` rows (schema.ROUTES) before they are redacted."""
        got = routes.select("layer", "expert_ids").drop_nulls()
        if got.height == 0:
            return
        rows = got.group_by("layer").len()
        for layer, n in rows.iter_rows():
            self.rows[layer] = self.rows.get(layer, 0) + n
        flat = got.explode("expert_ids").drop_nulls()
        for (layer,), part in flat.group_by(["layer"]):
            ids = part["expert_ids"].to_numpy()
            ids = ids[ids >= 0]
            c = np.bincount(ids) if ids.size else np.zeros(0, np.int64)
            old = self.counts.get(int(layer), np.zeros(0, np.int64))
            size = max(old.size, c.size)
            self.counts[int(layer)] = np.pad(old, (0, size - old.size)) + np.pad(c, (0, size - c.size))

    def to_meta(self) -> dict[str, dict[str, object]]:
        return {
            str(layer): {"rows": self.rows.get(layer, 0), "selections": [int(x) for x in self.counts[layer]]}
            for layer in sorted(self.counts)
        }
