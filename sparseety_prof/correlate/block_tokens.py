"""Token rows of one-row decode steps whose routing and activations are all in the drain's
AggBlocks (agg_record.py): their per-layer columns stay the blocks' arrays up to the frame.

Made Python lists per token (a list per layer for the expert ids and weights), and made arrays
again by the frame, those columns cost the consumer more than the rest of the token row, and
their cost grows with layers x experts per token. The routes table keeps the same blocks' rows
as arrays (routes.py)."""

from __future__ import annotations

from itertools import pairwise

import numpy as np

from sparseety_prof.correlate.agg_record import AggBlock
from sparseety_prof.store import schema
from sparseety_prof.store.array_rows import ArrayColumn, ArrayRows, RowParts

_IDS, _WEIGHTS, _PROBS, _ZERO, _BELOW = schema.columns(
    "tokens", "expert_ids", "expert_weights", "router_probs", "act_zero_ratio", "act_below_ratio"
)

#: a token row whose per-layer lists are in an AggBlock: (its row in the drain's token columns,
#: the block, the row of its aggregate record in the block)
BlockRow = tuple[int, AggBlock, int]


def block_tokens(tok: schema.Columns, blocks: list[BlockRow]) -> RowParts:
    """One drain's token columns (`tok`, every column; the block rows' per-layer columns are
    placeholders) as RowParts: the other rows as lists, the block rows as ArrayRows whose
    per-layer columns are the blocks' arrays, what the per-row lists would hold:
      * expert_ids, expert_weights: the record's k ids and weights per layer;
      * router_probs: null (an aggregate record has none);
      * act_zero_ratio, act_below_ratio: per layer, or a list of nulls where the pass's
        activations were not counted (--act-every)."""
    n = len(tok["token_id"])
    at = np.fromiter((b[0] for b in blocks), np.intp, len(blocks))
    is_array = np.zeros(n, dtype=bool)
    is_array[at] = True
    if len(blocks) == n:  # every row: the columns as they are
        lists: schema.Columns = {name: [] for name in tok}
        values = tok
    else:  # the two kinds of rows come in a few runs each (a prompt's token among decode steps)
        edges = [0, *(np.flatnonzero(is_array[1:] != is_array[:-1]) + 1).tolist(), n]
        spans = list(pairwise(edges))
        of_blocks = [(a, b) for a, b in spans if is_array[a]]
        of_lists = [(a, b) for a, b in spans if not is_array[a]]
        lists = {name: _spans(col, of_lists) for name, col in tok.items()}
        values = {name: _spans(col, of_blocks) for name, col in tok.items()}
    parts = []
    for start, end in _runs(blocks):
        blk = blocks[start][1]
        rows = np.fromiter((b[2] for b in blocks[start:end]), np.intp, end - start)
        arrays: dict[str, ArrayColumn] = {name: col[start:end] for name, col in values.items()}
        arrays[_IDS] = blk.expert_ids[rows]
        arrays[_WEIGHTS] = blk.expert_weights[rows]
        arrays[_PROBS] = None
        arrays[_ZERO] = blk.act_zero_ratio[rows]
        arrays[_BELOW] = blk.act_below_ratio[rows]
        counted = blk.counted[rows]
        uncounted = {} if counted.all() else {_ZERO: ~counted, _BELOW: ~counted}
        parts.append(ArrayRows(end - start, arrays, {}, uncounted))
    return RowParts(lists, ArrayRows.concat(parts), is_array)


def _spans(col: list[object], spans: list[tuple[int, int]]) -> list[object]:
    """The values of `col` in the [start, end) spans, in order (slices: no step per value)."""
    out: list[object] = []
    for a, b in spans:
        out += col[a:b]
    return out


def _runs(blocks: list[BlockRow]) -> list[tuple[int, int]]:
    """[start, end) of each run of rows from one block."""
    runs = []
    start = 0
    for j in range(1, len(blocks) + 1):
        if j == len(blocks) or blocks[j][1] is not blocks[start][1]:
            runs.append((start, j))
            start = j
    return runs
