"""The rows of a prompt pass as arrays, made from the pass's per-layer stores in a few numpy
calls, when the pass is regular: every layer MoE and FFN, its values for every batch row or for
every output row (llama.cpp computes the last layer of a prompt for its output rows only), every
such row routed and counted. The routes table takes every row of them, the token rows their
output rows' per-layer lists.

The per-row path (StepSparse.row_values, then a row per layer) costs a few microseconds per row
and layer in Python. Anything irregular (a layer missing, a row count neither the batch's nor its
outputs', a row not filled or not counted) returns None: the per-row path then makes the rows,
and counts what it counts."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from sparseety_prof.capture.plans import LayerSet
from sparseety_prof.correlate.agg_record import AggBlock
from sparseety_prof.correlate.state import Step
from sparseety_prof.correlate.step_sparse import NOT_MADE, LayerRows, StepSparse


class PassRows(NamedTuple):
    """Batch rows of a pass and where each layer's value rows are: `batch` (their indices in the
    batch), `out_at` (their output row, -1 for none), `has_out` (out_at >= 0); `n_tokens` and
    `n_out` the pass's rows and output rows."""

    batch: np.ndarray
    out_at: np.ndarray
    has_out: np.ndarray
    n_tokens: int
    n_out: int

    def batch_slice(self) -> slice:
        """`batch` as a slice (it is a range: PassRows.of)."""
        start = int(self.batch[0]) if len(self.batch) else 0
        return slice(start, start + len(self.batch))

    @classmethod
    def of(cls, rows: slice, n_tokens: int, output_index: dict[int, int]) -> PassRows:
        out_at = np.array([output_index.get(b, -1) for b in range(rows.start, rows.stop)], dtype=np.intp)
        batch = np.arange(rows.start, rows.stop, dtype=np.intp)
        return cls(batch, out_at, out_at >= 0, n_tokens, len(output_index))


class PassArrays(NamedTuple):
    """route_arrays' result: per value column of the routes table (ROUTE_VALUES names), [rows x
    layers(, width)] (None: a column with no value, router_probs not captured), and which (row,
    layer) cells the engine computed (a routes row each)."""

    values: dict[str, np.ndarray | None]
    present: np.ndarray


class PassBlock(NamedTuple):
    """pass_block's result: the arrays of every row of the pass (route_arrays), and the same
    values as an AggBlock, a row per batch row, for the token rows of the rows that hold every
    layer (`whole`)."""

    arrays: PassArrays
    block: AggBlock
    whole: np.ndarray  # bool [rows]


def takes_arrays(step: Step) -> bool:
    """Whether the rows of `step` are worth making as arrays on their own: a prompt, whose rows
    outnumber its output rows (only those are token rows) by more than two to one. For a step of
    several slots (every row an output) route_arrays' few dozen numpy calls cost more than its
    handful of rows do in Python (on 4 clients' server drains, measured with
    scripts/replay_drains.py: docs/overhead.md): those are made arrays a run of steps at a time
    (slot_steps.py)."""
    return len(step.seq) > 2 * len(step.output_index())


def pass_block(step: Step, layers: LayerSet) -> PassBlock | None:
    """route_arrays of all the rows of `step` (a prompt: takes_arrays, whose layers are
    `layers.moe`, which are also `layers.ffn`), made once and kept on its StepSparse: the routes
    rows and the token rows both take them. None for an irregular pass, or one not worth it."""
    sp = step.sparse
    assert sp is not None
    if not takes_arrays(step):
        return None
    if sp._pass_block is NOT_MADE:
        rows = slice(step.row_offset, step.row_offset + len(step.seq))
        got = route_arrays(sp, PassRows.of(rows, step.n_tokens, step.output_index()), layers)
        sp._pass_block = None if got is None else _as_block(got)
    made: PassBlock | None = sp._pass_block
    return made


def _as_block(got: PassArrays) -> PassBlock:
    v = got.values
    whole: np.ndarray = np.asarray(got.present.all(axis=1))
    zero, below, n_values = v["act_zero_ratio"], v["act_below_ratio"], v["act_values"]
    counted = whole  # every layer counted where a row holds every layer
    if zero is None or below is None or n_values is None:  # activations not counted at all: the
        # block's arrays hold zeros per row and layer (the layers are MoE and FFN alike), which no
        # row reads as values (none is counted)
        zero, below = np.zeros(got.present.shape), np.zeros(got.present.shape)
        n_values = np.zeros(got.present.shape, dtype=np.int64)
        counted = np.zeros_like(whole)
    block = AggBlock(
        v["expert_ids"],  # type: ignore[arg-type]
        v["expert_weights"],  # type: ignore[arg-type]
        zero,
        below,
        n_values,
        counted,
        v["router_probs"],
    )
    return PassBlock(got, block, whole)


def route_arrays(sp: StepSparse, at: PassRows, layers: LayerSet) -> PassArrays | None:
    """The rows `at` x the layers `layers.moe` (which are also `layers.ffn`) of a regular pass;
    None otherwise. The layers' arrays are stacked first, so that the numpy calls are per pass
    and kind of layer, not per layer."""
    ids = _moe(sp.ids, at, layers.moe)
    weights = _moe(sp.weights, at, layers.moe)
    if ids is None or weights is None or ids[0].shape != weights[0].shape or not ids[0].shape[2]:
        return None
    if not (ids[1] == weights[1]).all():
        return None
    probs = None
    if sp.probs:
        got = _moe(sp.probs, at, layers.moe)
        if got is None or not (got[1] == ids[1]).all():
            return None
        probs = got[0]
    act = _act(sp, at, layers.ffn)
    zero: np.ndarray | None
    below: np.ndarray | None
    n_values: np.ndarray | None
    if act is None and sp.act_uncounted and not sp.act_zeros:
        # a dropped request's prompt (head sampling in the probes): routing only, the activation
        # columns null in every row
        zero = below = n_values = None
    elif act is None or not (act[3] == ids[1]).all():
        return None
    else:
        zero, below, n_values, _ = act
    return PassArrays(
        {
            "expert_ids": ids[0],
            "expert_weights": weights[0],
            "router_probs": probs,
            "act_zero_ratio": zero,
            "act_below_ratio": below,
            "act_values": n_values,
        },
        ids[1],
    )


def _by_output(total: int, at: PassRows) -> bool | None:
    """Whether a layer holding `total` value rows holds them per output row (False: per batch
    row); None when neither."""
    if total == at.n_tokens:
        return False
    return True if total == at.n_out else None


def _moe(
    store: dict[int, LayerRows], at: PassRows, layers: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray] | None:
    """The store's values of the rows for every layer, [rows x layers x width], and which cells
    hold one; None unless every layer holds a filled value row per batch row or per output row,
    all of one width. Layer by layer, each a slice or a short gather: stacking the layers first
    cost more than the few rows of a prompt."""
    got: list[LayerRows] = []
    for layer in layers:
        lr = store.get(layer)
        if lr is None or _by_output(len(lr.values), at) is None:
            return None
        got.append(lr)
    if not got:
        return None
    width = got[0].values.shape[1]
    if any(lr.values.shape[1] != width for lr in got):
        return None
    values = np.zeros((len(at.batch), len(got), width), dtype=got[0].values.dtype)
    present = np.zeros((len(at.batch), len(got)), dtype=bool)
    batch = at.batch_slice()
    out_src, out_dst = at.out_at[at.has_out], np.flatnonzero(at.has_out)
    for j, lr in enumerate(got):
        if len(lr.values) == at.n_tokens:  # a value row per batch row (_by_output False)
            if not lr.filled[batch].all():
                return None  # a row not filled
            values[:, j] = lr.values[batch]
            present[:, j] = True
        else:  # per output row
            if not lr.filled[out_src].all():
                return None
            values[out_dst, j] = lr.values[out_src]
            present[out_dst, j] = True
    return values, present


def _act(
    sp: StepSparse, at: PassRows, layers: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Zero and below-threshold ratios and values counted, [rows x layers], and which cells hold
    them; None unless every layer counted every row it holds, all with one number of node rows
    per token."""
    slots = {sp.act_slots.get(layer) for layer in layers}
    if len(slots) != 1 or None in slots:
        return None
    (n_slots,) = slots
    assert n_slots is not None
    modes: list[bool] = []
    for layer in layers:
        z = sp.act_zeros.get(layer)
        mode = None if z is None or len(z) % n_slots else _by_output(len(z) // n_slots, at)
        if mode is None:
            return None
        modes.append(mode)
    n_rows = len(at.batch)
    zero = np.zeros((n_rows, len(layers)))
    below = np.zeros((n_rows, len(layers)))
    n_values = np.zeros((n_rows, len(layers)), dtype=np.int64)
    present = np.zeros((n_rows, len(layers)), dtype=bool)
    for by_output in (False, True):
        cols = [j for j, m in enumerate(modes) if m is by_output]
        if not cols:
            continue
        picked = [layers[j] for j in cols]
        tokens = at.n_out if by_output else at.n_tokens
        # every layer's counts one after another (one concatenate: np.stack costs a call per layer)
        counts = np.concatenate([sp.act_zeros[la] for la in picked] + [sp.act_below[la] for la in picked])
        counts = counts.reshape(2, len(cols), tokens, n_slots)
        if by_output:
            counts = counts[:, :, at.out_at[at.has_out]]
            cells: tuple[Any, np.ndarray] = (np.flatnonzero(at.has_out)[:, None], np.array(cols))
        else:
            counts = counts[:, :, at.batch_slice()]
            cells = (slice(None), np.array(cols))
        if (counts < 0).any():
            return None  # a row not counted
        n = np.array([n_slots * sp.act_width[la] for la in picked], dtype=np.int64)
        ratios = counts.sum(axis=3) / n[:, None]  # [zero/below, layers, rows]
        zero[cells] = ratios[0].T
        below[cells] = ratios[1].T
        n_values[cells] = n
        present[cells] = True
    return zero, below, n_values, present
