"""Redaction levels (`--redact ids,routing,sparsity,masks`): what a recording leaves out of the
per-token signals that recover prompts (token ids, MoE expert choices, activation sparsity, masks).

Applied to every frame before it is written, at record time (RecordingWriter) and at export
(`sparseety-prof redact`), and by `audit` to measure what each level leaves. Which columns each
level empties or coarsens is schema.py's (REDACT_NULL, REDACT_COARSEN). Nulled columns keep their
name and dtype, so a redacted recording has the same schema and every reader still opens it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from sparseety_prof.errors import UsageError
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


def parse_layers(text: str) -> frozenset[int]:
    """Model layers from "0,2,5-7" (ValueError on anything else)."""
    out: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"bad layer list {text!r}: give layers like 0,2,5-7")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"bad layer range {part!r} in {text!r}")
        out.update(range(first, last + 1))
    return frozenset(out)


def redaction_from_flags(
    redact: list[str], layers: str | None
) -> tuple[frozenset[str], frozenset[int] | None]:
    """`--redact` values and `--redact-layers` (or None), checked: UsageError says what is wrong."""
    try:
        levels = parse_levels(redact)
        subset = None if layers is None else parse_layers(layers)
    except ValueError as e:
        raise UsageError(f"--redact{'-layers' if 'layer' in str(e) else ''}: {e}") from None
    if subset is not None and not levels & set(schema.REDACT_PER_LAYER):
        raise UsageError(f"--redact-layers needs --redact with one of {', '.join(schema.REDACT_PER_LAYER)}")
    return levels, subset


@dataclass(frozen=True)
class Redaction:
    """What a recording leaves out: `levels`, the per-layer ones limited to `layers` when given.
    `list_layers` (meta.json "layers") says which model layer each element of the tokens table's
    per-layer lists is; without it, a layer subset empties those lists whole (never less)."""

    levels: frozenset[str] = frozenset()
    layers: frozenset[int] | None = None
    list_layers: Mapping[str, Sequence[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = self.levels - set(LEVELS)
        if unknown:
            raise ValueError(f"unknown redaction levels {sorted(unknown)}")
        if self.layers is not None and not self.levels & set(schema.REDACT_PER_LAYER):
            raise ValueError(f"a layer subset needs one of the levels {', '.join(schema.REDACT_PER_LAYER)}")

    def to_meta(self) -> dict[str, object]:
        return {
            "levels": ordered(self.levels),
            "layers": None if self.layers is None else sorted(self.layers),
            "sparsity_step": SPARSITY_STEP if "sparsity" in self.levels else None,
        }

    def frame(self, table: str, df: pl.DataFrame) -> pl.DataFrame:
        """`df` (rows of `table`) as this redaction stores it: same columns and dtypes."""
        exprs = []
        for level in ordered(self.levels):
            limited = self.layers is not None and level in schema.REDACT_PER_LAYER
            for c in schema.REDACT_NULL.get(level, {}).get(table, ()):
                exprs.append(self._column(table, c, None, limited))
            for c in schema.REDACT_COARSEN.get(level, {}).get(table, ()):
                exprs.append(self._column(table, c, _coarse, limited))
        return df.with_columns(exprs) if exprs else df

    def _column(
        self, table: str, c: str, change: Callable[[pl.Expr], pl.Expr] | None, limited: bool
    ) -> pl.Expr:
        dtype = schema.TABLES[table][c]
        null = pl.lit(None, dtype=dtype.inner if isinstance(dtype, pl.List) else dtype)
        per_element = isinstance(dtype, pl.List) and c in schema.TOKEN_LIST_LAYERS and table == "tokens"
        if per_element:  # one element per layer of a kind: change the elements of those layers
            kind_layers = self.list_layers.get(schema.TOKEN_LIST_LAYERS[c])
            by_layer = limited and kind_layers is not None and self.layers is not None
            if change is None and not by_layer:
                return pl.lit(None, dtype=dtype).alias(c)  # every layer (or no map to say which)
            element = null if change is None else change(pl.element())
            if by_layer:
                assert kind_layers is not None and self.layers is not None
                at = [i for i, layer in enumerate(kind_layers) if layer in self.layers]
                element = pl.when(pl.int_range(pl.len()).is_in(at)).then(element).otherwise(pl.element())
            return pl.col(c).list.eval(element).cast(dtype).alias(c)
        new = pl.lit(None, dtype=dtype) if change is None else change(pl.col(c)).cast(dtype)
        if limited and self.layers is not None and "layer" in schema.TABLES[table]:
            new = pl.when(pl.col("layer").is_in(sorted(self.layers))).then(new).otherwise(pl.col(c))
        return new.alias(c)


def redact_frame(table: str, df: pl.DataFrame, levels: Iterable[str]) -> pl.DataFrame:
    """`df` (rows of `table`) as `levels` store it, on every layer: same columns and dtypes."""
    return Redaction(frozenset(levels)).frame(table, df)


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
