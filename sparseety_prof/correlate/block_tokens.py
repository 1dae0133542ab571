"""Token rows whose per-layer lists are in an AggBlock (agg_record.py: a one-row decode step's
aggregate record, a regular prompt's arrays, a run of steps over several slots): those columns
stay the blocks' arrays up to the frame.

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


#: more spans of block rows and other rows than this in a drain (a server's steps over several
#: slots, per-row, among one-row steps), and gathering each column's spans costs more than the
#: arrays save: the block rows' lists are then made here and the rows stay columns
MAX_SPANS = 8


def block_tokens(tok: schema.Columns, blocks: list[BlockRow]) -> schema.Columns | RowParts:
    """One drain's token columns (`tok`, every column; the block rows' per-layer columns are
    placeholders) as RowParts whose ArrayRows' per-layer columns are the blocks' arrays, what
    the per-row lists would hold:
      * expert_ids, expert_weights: the record's k ids and weights per layer;
      * router_probs: those captured per layer (a pass's arrays), else null (an aggregate
        record has none);
      * act_zero_ratio, act_below_ratio: per layer, or a list of nulls where the pass's
        activations were not counted (--act-every).
    Every row is one ArrayRows when the other rows are few and regular (_whole); else the other
    rows stay lists and the block rows are ArrayRows; with more than MAX_SPANS spans of the two
    kinds of rows, `tok` itself, the block rows' lists filled in."""
    n = len(tok["token_id"])
    at = np.fromiter((b[0] for b in blocks), np.intp, len(blocks))
    runs = [_gathered(blocks, start, end) for start, end in _runs(blocks)]
    is_array = np.zeros(n, dtype=bool)
    is_array[at] = True
    others = np.flatnonzero(~is_array).tolist()
    if len(others) <= MAX_MERGED:  # every row one ArrayRows, in order, the columns as they are
        whole = _whole(tok, at, runs, others)
        if whole is not None:
            return RowParts({name: [] for name in tok}, [whole], np.ones(n, dtype=bool))
    if len(blocks) == n:  # every row: the columns as they are
        lists: schema.Columns = {name: [] for name in tok}
        values = tok
    else:  # the two kinds of rows come in a few runs each (a prompt's token among decode steps)
        edges = [0, *(np.flatnonzero(is_array[1:] != is_array[:-1]) + 1).tolist(), n]
        spans = list(pairwise(edges))
        if len(spans) > MAX_SPANS:
            _fill_lists(tok, at.tolist(), runs)
            return tok
        of_blocks = [(a, b) for a, b in spans if is_array[a]]
        of_lists = [(a, b) for a, b in spans if not is_array[a]]
        lists = {name: _spans(col, of_lists) for name, col in tok.items()}
        values = {name: _spans(col, of_blocks) for name, col in tok.items()}
    parts = []
    for start, end, got in runs:
        arrays: dict[str, ArrayColumn] = {name: col[start:end] for name, col in values.items()}
        arrays.update(got)
        counted = arrays.pop(_COUNTED)
        assert isinstance(counted, np.ndarray)
        uncounted = {} if counted.all() else {_ZERO: ~counted, _BELOW: ~counted}
        parts.append(ArrayRows(end - start, arrays, {}, uncounted))
    return RowParts(lists, ArrayRows.concat(parts), is_array)


#: at most this many other rows in a drain (a request's first token, sampled after its prompt by
#: the handlers) have their per-layer lists made arrays too, one by one, when they are regular:
#: then every row is one ArrayRows, and no column is split between the two kinds of rows
MAX_MERGED = 8


def _whole(tok: schema.Columns, at: np.ndarray, runs: list[_Run], others: list[int]) -> ArrayRows | None:
    """Every token row as one ArrayRows: the block rows' per-layer arrays, and the other rows'
    lists made arrays where they are regular (all of one shape, no null inside a list, lists of
    nulls for activations not counted; router probabilities for all rows or for none); None
    when any is not."""
    n = len(tok["token_id"])
    first = runs[0][2]
    ids0, weights0, zero0, probs0 = first[_IDS], first[_WEIGHTS], first[_ZERO], first[_PROBS]
    assert ids0 is not None and weights0 is not None and zero0 is not None
    shape, act_shape, with_probs = ids0.shape[1:], zero0.shape[1:], probs0 is not None
    probs_shape = None if probs0 is None else probs0.shape[1:]
    for _, _, got in runs[1:]:
        p = got[_PROBS]
        if (
            got[_IDS].shape[1:] != shape  # type: ignore[union-attr]
            or got[_ZERO].shape[1:] != act_shape  # type: ignore[union-attr]
            or (p is None) == with_probs
            or (p is not None and p.shape[1:] != probs_shape)
        ):
            return None
    ids = np.empty((n, *shape), dtype=ids0.dtype)
    weights = np.empty((n, *shape), dtype=weights0.dtype)
    zero, below = np.empty((n, *act_shape)), np.empty((n, *act_shape))
    probs = None if probs0 is None or probs_shape is None else np.empty((n, *probs_shape), dtype=probs0.dtype)
    counted = np.empty(n, dtype=bool)
    for start, end, got in runs:
        rows = at[start:end]
        ids[rows], weights[rows] = got[_IDS], got[_WEIGHTS]
        zero[rows], below[rows], counted[rows] = got[_ZERO], got[_BELOW], got[_COUNTED]
        if probs is not None:
            probs[rows] = got[_PROBS]
    for r in others:
        row_probs = tok[_PROBS][r]
        if (row_probs is None) == with_probs:
            return None
        if not (
            _put(ids, r, tok[_IDS][r])
            and _put(weights, r, tok[_WEIGHTS][r])
            and (probs is None or _put(probs, r, row_probs))
        ):
            return None
        z, b = tok[_ZERO][r], tok[_BELOW][r]
        if not isinstance(z, list) or not isinstance(b, list):
            return None
        if len(z) == len(b) == act_shape[0] and z.count(None) == len(z) and b.count(None) == len(b):
            counted[r] = False  # activations not counted: a list of nulls
            zero[r] = below[r] = 0.0
        elif _put(zero, r, z) and _put(below, r, b):
            counted[r] = True
        else:
            return None
    arrays: dict[str, ArrayColumn] = dict(tok)
    arrays.update({_IDS: ids, _WEIGHTS: weights, _PROBS: probs, _ZERO: zero, _BELOW: below})
    uncounted = {} if counted.all() else {_ZERO: ~counted, _BELOW: ~counted}
    return ArrayRows(n, arrays, {}, uncounted)


def _put(dst: np.ndarray, r: int, values: object) -> bool:
    """dst[r] = values when they are a list of dst[r]'s shape with no null inside (numpy reads a
    None among floats as NaN: NaN counts as a null here); False, dst[r] unset, otherwise."""
    if not isinstance(values, list):
        return False
    try:
        a = np.asarray(values, dtype=dst.dtype)
    except (TypeError, ValueError):
        return False
    if a.shape != dst.shape[1:] or (a.dtype.kind == "f" and np.isnan(a).any()):
        return False
    dst[r] = a
    return True


_COUNTED = "__counted"
#: one block's rows start..end of the drain's block rows, and their per-layer arrays (_gathered)
_Run = tuple[int, int, dict[str, np.ndarray | None]]


def _gathered(blocks: list[BlockRow], start: int, end: int) -> _Run:
    """The per-layer arrays of block rows start..end (rows of one block), and _COUNTED: whether
    each row's activations were counted."""
    blk = blocks[start][1]
    rows = np.fromiter((b[2] for b in blocks[start:end]), np.intp, end - start)
    return (
        start,
        end,
        {
            _IDS: blk.expert_ids[rows],
            _WEIGHTS: blk.expert_weights[rows],
            _PROBS: None if blk.router_probs is None else blk.router_probs[rows],
            _ZERO: blk.act_zero_ratio[rows],
            _BELOW: blk.act_below_ratio[rows],
            _COUNTED: blk.counted[rows],
        },
    )


def _fill_lists(
    tok: schema.Columns, at: list[int], runs: list[tuple[int, int, dict[str, np.ndarray | None]]]
) -> None:
    """The block rows' per-layer columns as the per-row lists (tolist of the gathered arrays)."""
    for start, end, got in runs:
        counted = got[_COUNTED]
        assert counted is not None
        for name in (_IDS, _WEIGHTS, _PROBS, _ZERO, _BELOW):
            a = got[name]
            col = tok[name]
            if a is None:
                for r in at[start:end]:
                    col[r] = None  # a router_probs column of nulls: null
                continue
            values = a.tolist()
            if name in (_ZERO, _BELOW) and not counted.all():
                nulls: list[object] = [None] * a.shape[1]
                values = [v if c else list(nulls) for v, c in zip(values, counted.tolist(), strict=True)]
            for r, v in zip(at[start:end], values, strict=True):
                col[r] = v


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
