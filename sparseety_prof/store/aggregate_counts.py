"""The counting behind store/aggregates.py, in numpy: a frame's list columns flattened to arrays,
and rows counted by key.

Each Polars group-by, explode and join of the first version had a fixed cost whatever the rows,
paid at every flush once buckets close, which made a fold of a few thousand tokens a visible part
of the recorder's CPU per token (docs/overhead.md). These are the same counts in one sort each."""

from __future__ import annotations

import numpy as np
import polars as pl

#: the layer of a list element past the model's layers (meta.json "layers" shorter than the list)
NO_LAYER = -1


def valid(s: pl.Series) -> np.ndarray:
    """Which values of `s` are not null, as a bool array."""
    return s.is_not_null().to_numpy()


def flat_list(s: pl.Series) -> tuple[np.ndarray, np.ndarray, pl.Series]:
    """The elements of a list column: for each, the row it is in and its index in that row's
    list, and the elements themselves (a Series: nulls stay nulls). Null rows and empty lists
    have none."""
    lens_s = s.list.len()
    lens = (lens_s.fill_null(0) if lens_s.null_count() else lens_s).to_numpy().astype(np.int64)
    n = int(lens.sum())
    row = np.repeat(np.arange(len(s), dtype=np.int64), lens)
    starts = np.cumsum(lens) - lens
    index = np.arange(n, dtype=np.int64) - np.repeat(starts, lens)
    exploded = s.explode()  # a null row and an empty list each explode to one null
    per_row = np.maximum(lens, 1)
    if len(exploded) == int(per_row.sum()):
        real = np.repeat(lens > 0, per_row)
        values = exploded if real.all() else exploded.filter(pl.Series(real))
    else:  # (a Polars that drops them instead)
        values = s.filter(pl.Series(lens > 0)).explode() if n else exploded.head(0)
    return row, index, values


def layer_of(index: np.ndarray, layers: list[int] | None) -> np.ndarray:
    """The model layer of each list index (`layers[i]`; the index itself without a layer list;
    NO_LAYER past the list's end)."""
    if not layers:
        return index
    table = np.asarray(layers, dtype=np.int64)
    return np.where(index < len(table), table[np.minimum(index, len(table) - 1)], NO_LAYER)


#: key combinations at most for counting with one bincount (a sort beyond: lexsort)
DENSE_KEYS = 1 << 22


def count_keys(*keys: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """The distinct rows of the key columns (int64 arrays of one length) and how many times
    each occurs, sorted by the keys (first key first). Keys of small ranges (bucket indices,
    layers, bins, expert ids) are counted by one bincount over their combined code, in one pass,
    far cheaper than a lexsort of the same rows."""
    if not len(keys[0]):
        return [np.empty(0, np.int64) for _ in keys], np.empty(0, np.int64)
    lows = [int(k.min()) for k in keys]
    spans = [int(k.max()) - lo + 1 for k, lo in zip(keys, lows, strict=True)]
    if int(np.prod(spans, dtype=np.float64)) <= DENSE_KEYS:
        code = np.zeros(len(keys[0]), dtype=np.int64)
        for k, lo, span in zip(keys, lows, spans, strict=True):
            code = code * span + (k - lo)
        all_counts = np.bincount(code, minlength=1)
        at = np.flatnonzero(all_counts)
        counts = all_counts[at]
        out: list[np.ndarray] = []
        for lo, span in zip(lows[::-1], spans[::-1], strict=True):
            out.append(at % span + lo)
            at = at // span
        return out[::-1], counts
    order = np.lexsort(keys[::-1])
    sorted_keys = [k[order] for k in keys]
    change = np.zeros(len(order), dtype=bool)
    change[0] = True
    for k in sorted_keys:
        change[1:] |= k[1:] != k[:-1]
    starts = np.flatnonzero(change)
    counts = np.diff(np.append(starts, len(order)))
    return [k[starts] for k in sorted_keys], counts
