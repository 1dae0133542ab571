"""Steps over several slots (a server decoding its concurrent requests: one row per sequence,
every row an output) made arrays a run of steps at a time.

Such a step has only a handful of rows, so neither its per-row values (a few microseconds per
row and layer in Python) nor arrays made per step (route_arrays: a few dozen numpy calls per
pass) are cheap. The steps of a drain come one after another, though, and their per-layer values
all have the same shapes: here the values of a run of such steps are stacked once per store for
all of them (a run of S steps of R rows over L layers: one stack of S x L arrays per store), and
the routes rows of the whole run, and the AggBlock its token rows read, come out of those.

A step is taken when it is regular: every row an output and copied, every layer MoE and FFN with
its routing for every row (router probabilities on every layer or on none) and its activations
counted for every row, or for none (a pass --act-every leaves out). Anything else is left to
the per-row path, which then counts what it counts. tests/test_correlator.py compares the two.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from sparseety_prof.capture.plans import LayerSet
from sparseety_prof.correlate.agg_record import AggBlock
from sparseety_prof.correlate.state import Step
from sparseety_prof.correlate.step_sparse import StepSparse
from sparseety_prof.correlate.tables import ROUTE_KEYS, ROUTE_LAYER, ROUTE_VALUES
from sparseety_prof.store.array_rows import ArrayColumn, ArrayRows

_IDS, _WEIGHTS, _PROBS, _ZERO, _BELOW, _VALUES = ROUTE_VALUES


class SlotRun(NamedTuple):
    """A run of steps made arrays: their routes rows (None when not made), and for each step the
    AggBlock its token rows read and the block row of its batch row 0."""

    routes: ArrayRows | None
    blocks: list[tuple[AggBlock, int]]


def shape_key(sp: StepSparse, n_rows: int, layers: LayerSet) -> tuple[object, ...] | None:
    """What a step's values must share with the other steps of a stack: its rows, the routing's
    width and kind, and per FFN layer the node rows per token and the values per node row; None
    when the step is not regular (then the per-row path takes it)."""
    ids, weights, probs = sp.ids, sp.weights, sp.probs
    width = None
    for layer in layers.moe:
        i, w = ids.get(layer), weights.get(layer)
        if i is None or w is None or i.values.shape != w.values.shape or len(i.values) != n_rows:
            return None
        if width is None:
            width = i.values.shape[1]
        elif i.values.shape[1] != width:
            return None
    if not width:
        return None
    with_probs = bool(probs)
    probs_width = 0
    if with_probs:  # every layer's, all of one width (the model's experts)
        shapes = {None if (p := probs.get(layer)) is None else p.values.shape for layer in layers.moe}
        if len(shapes) != 1 or None in shapes:
            return None
        (shape,) = shapes
        assert shape is not None
        if shape[0] != n_rows:
            return None
        probs_width = shape[1]
    act: tuple[tuple[int, int], ...] | None = None  # None: no layer's activations counted (--act-every)
    if sp.act_zeros:
        got: list[tuple[int, int]] = []
        for layer in layers.ffn:
            z, slots = sp.act_zeros.get(layer), sp.act_slots.get(layer)
            if z is None or not slots or len(z) != n_rows * slots:
                return None
            got.append((slots, sp.act_width[layer]))
        act = tuple(got)
    return n_rows, width, ids[layers.moe[0]].values.dtype, with_probs, probs_width, act


def slot_runs(
    steps: list[Step], key: tuple[object, ...], layers: LayerSet, *, rows: bool
) -> list[tuple[int, int, SlotRun | None]]:
    """`steps` (all of one shape_key) as spans [start, end) of steps, each with its arrays (its
    routes rows when `rows`, and the block its token rows read), or None for a step whose values
    are missing after all (a row not filled, a row's activations not counted): the per-row path
    then takes it."""
    n_rows, _, _, with_probs, _, act = key
    assert isinstance(n_rows, int) and (act is None or isinstance(act, tuple))
    moe, ffn = layers.moe, layers.ffn
    sps: list[StepSparse] = [s.sparse for s in steps]  # type: ignore[misc]
    n_steps, n_layers = len(steps), len(moe)
    ok = np.ones(n_steps, dtype=bool)

    def stacked(store: str) -> np.ndarray:
        """[steps, rows, layers, width], and the steps with a row not filled marked in ok."""
        got = [getattr(sp, store)[layer] for sp in sps for layer in moe]
        ok[:] &= np.stack([lr.filled for lr in got]).reshape(n_steps, -1).all(axis=1)
        values = np.stack([lr.values for lr in got]).reshape(n_steps, n_layers, n_rows, -1)
        return values.transpose(0, 2, 1, 3)

    ids, weights = stacked("ids"), stacked("weights")
    probs = stacked("probs") if with_probs else None
    # activations: per FFN layer its counts per node row (node rows per token of one size here);
    # none counted: ratios 0 and not counted (null), as aggregate records have them
    if act is None:
        sums = np.zeros((2, n_steps, n_rows, len(ffn)), dtype=np.int64)
        per_value = np.ones(len(ffn), dtype=np.int64)
    else:
        slots = {s for s, _ in act}
        if len(slots) != 1:
            return [(k, k + 1, None) for k in range(n_steps)]
        (n_slots,) = slots
        zeros = [sp.act_zeros[layer] for sp in sps for layer in ffn]
        below = [sp.act_below[layer] for sp in sps for layer in ffn]
        counts = np.stack(zeros + below).reshape(2, n_steps, len(ffn), n_rows, n_slots)
        ok &= (counts >= 0).all(axis=(0, 2, 3, 4))  # every row counted
        per_value = np.array([s * w for s, w in act], dtype=np.int64)  # values per token and layer
        sums = counts.sum(axis=4).transpose(0, 1, 3, 2)  # [zero/below, steps, rows, layers]
    out: list[tuple[int, int, SlotRun | None]] = []
    start = 0
    for end in [*(np.flatnonzero(ok[1:] != ok[:-1]) + 1).tolist(), n_steps]:
        if not ok[start]:
            out.extend((k, k + 1, None) for k in range(start, end))
        else:
            span = slice(start, end)
            total = (end - start) * n_rows
            block = AggBlock(
                ids[span].reshape(total, n_layers, -1),
                weights[span].reshape(total, n_layers, -1),
                (sums[0, span] / per_value).reshape(total, len(ffn)),
                (sums[1, span] / per_value).reshape(total, len(ffn)),
                np.tile(per_value, (total, 1)) if act is not None else np.zeros((total, len(ffn)), np.int64),
                np.full(total, act is not None),
                None if probs is None else probs[span].reshape(total, n_layers, -1),
            )
            part = steps[start:end]
            routes = _routes_rows(part, block, n_rows, layers) if rows else None
            out.append((start, end, SlotRun(routes, [(block, k * n_rows) for k in range(end - start)])))
        start = end
    return out


def _routes_rows(steps: list[Step], block: AggBlock, n_rows: int, layers: LayerSet) -> ArrayRows:
    """A routes row per row of each step and layer (every layer MoE and FFN), in the per-row
    path's order: step by step, row by row, layer by layer."""
    n_layers = len(layers.moe)
    total = len(steps) * n_rows
    keys = np.empty((total, len(ROUTE_KEYS)), dtype=np.int64)  # in ROUTE_KEYS order
    keys[:, 0] = np.repeat([s.step_id for s in steps], n_rows)
    keys[:, 1] = np.repeat([s.ctx_id for s in steps], n_rows)
    keys[:, 2] = np.concatenate([s.seq for s in steps])
    keys[:, 3] = np.concatenate([s.pos for s in steps])
    keys[:, 4] = np.tile(np.arange(n_rows), len(steps))
    arrays: dict[str, ArrayColumn] = {
        name: np.repeat(keys[:, j], n_layers) for j, name in enumerate(ROUTE_KEYS)
    }
    arrays[ROUTE_LAYER] = np.tile(np.asarray(layers.moe, dtype=np.int64), total)
    k = block.expert_ids.shape[2]
    arrays[_IDS] = block.expert_ids.reshape(total * n_layers, k)
    arrays[_WEIGHTS] = block.expert_weights.reshape(total * n_layers, k)
    arrays[_PROBS] = None if block.router_probs is None else block.router_probs.reshape(total * n_layers, -1)
    arrays[_ZERO] = block.act_zero_ratio.reshape(-1)
    arrays[_BELOW] = block.act_below_ratio.reshape(-1)
    arrays[_VALUES] = block.act_values.reshape(-1)
    nulls = {}
    if not block.counted.all():  # a row whose activations were not counted: its values are null
        not_counted = np.repeat(~block.counted, n_layers)
        nulls = {name: not_counted for name in (_ZERO, _BELOW, _VALUES)}
    return ArrayRows(total * n_layers, arrays, nulls)
