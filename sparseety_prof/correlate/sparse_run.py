"""The per-layer sparse records of a micro-batch, taken a run at a time, from values worked out
for the whole drain at once.

A micro-batch of several rows (a prompt, or a llama-server step over several slots) sends its
routing and activation values as records per layer: a routing tensor per layer and kind, and the
activation counts per layer and engine thread. sparse_record takes them one at a
time, each made a dict first: at four server clients that was about half of the correlation's
CPU (scripts/replay_drains.py). Here what each record holds is worked out for all of a drain's
records together (SparseColumns: a few numpy operations per drain), and a run of such records
one after another, for the one micro-batch in flight, is stored with a little Python per record
when it is the common case: each routing tensor whole in one record, each layer's activation
records of one size, none of those layers seen yet for the micro-batch, the first steps'
verification done. The arrays stored are the ones StepSparse.add_tensor and add_act make;
tests/test_correlator.py::test_sparse_runs_equal_the_record_by_record_path compares the two
paths table by table and state by state. Any other run goes to the handlers, record by record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sparseety_prof.capture import events as ev
from sparseety_prof.correlate.drain_index import G_ACT, G_TENSOR_L, G_TENSOR_S, DrainIndex
from sparseety_prof.correlate.feed_state import FeedState
from sparseety_prof.correlate.node_names import parse_name
from sparseety_prof.correlate.step_sparse import (
    GGML_TYPE_I32,
    MAX_ACT_ROWS,
    MAX_ACT_WIDTH,
    MAX_TENSOR_CELLS,
    LayerRows,
    StepSparse,
)
from sparseety_prof.correlate.verification import verify_routing, verifying_sparse

RUN_KINDS = frozenset((ev.EV_TENSOR, ev.EV_ACT))
_STORE_NAMES = ("ids", "weights", "probs")  # StepSparse's routing stores
# node name -> its layer * 4 + its kind (0: not a node name parse_name knows, 1: a dense node,
# 2: an "ffn_moe_" node; layer -1 for none). A model has a few names per layer, seen on every pass:
# each parsed once, and the drain's records looked up one by one (numpy's unique over the names,
# with its sort, cost more at a drain's sizes).
_NAME_CODES: dict[bytes, int] = {}
_UNKNOWN, _DENSE, _MOE = 0, 1, 2


def _name_code(name: bytes) -> int:
    got = _NAME_CODES.get(name)
    if got is None:
        parsed = parse_name(name)
        if parsed is None:
            got = -1 * 4 + _UNKNOWN
        else:
            got = parsed[1] * 4 + (_MOE if parsed[0].startswith("ffn_moe_") else _DENSE)
        if len(_NAME_CODES) < 65536:  # (names come from the target's memory: bounded)
            _NAME_CODES[name] = got
    return got


def _name_codes(names: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The layer and kind of each of these node names (a drain's records'), as arrays."""
    codes = np.fromiter(map(_name_code, names.tolist()), np.int64, len(names))
    return codes >> 2, codes & 3


# a routing tensor's tag -> its store's index in _STORE_NAMES (-1: none; the last entry is every
# tag past the known ones)
_STORE_OF_TAG = np.full(max(ev.TAG_EXPERT_IDS, ev.TAG_EXPERT_WEIGHTS, ev.TAG_ROUTER_PROBS) + 2, -1, np.int64)
_STORE_OF_TAG[[ev.TAG_EXPERT_IDS, ev.TAG_EXPERT_WEIGHTS, ev.TAG_ROUTER_PROBS]] = [0, 1, 2]
# layer numbers are below this (a record naming another is left to the handlers): the runs'
# keys combine a run, a store and a layer in one integer
_LAYER_SPAN = 1 << 20
# the node rows whose activation counts a drain's runs gather at once, at most: their arrays (a
# few int64 arrays of this size) stay within tens of MiB whatever sizes the target's records
# claim. A drain past it (a prompt of thousands of rows on a large MoE model) goes to the
# handlers, which allocate a layer at a time.
_ACT_CELLS_MAX = 1 << 20


def sparse_run(state: FeedState, idx: DrainIndex, i: int) -> int:
    """Records i.. while they are routing tensors or activation counts: stored at once when they
    are the common case, else taken by sparse_record one by one. Returns the index after the
    run."""
    kinds, n = idx.kinds, len(idx)
    j = i + 1
    while j < n and kinds[j] in RUN_KINDS:
        j += 1
    if len(state.open_steps) == 1 and not verifying_sparse(state.counters, state.n_expert):
        step = next(iter(state.open_steps.values()))
        sp = step.sparse if step.sparse is not None else StepSparse()
        cols: SparseColumns | None = idx.cache.get("sparse")
        if cols is None:
            cols = idx.cache["sparse"] = SparseColumns(idx)
        if cols.store_run(idx, sp, i, j, state.layers_seen):
            step.sparse = sp
            return j
    for k in range(i, j):
        sparse_record(state, idx.record(k))
    return j


def sparse_record(state: FeedState, r: dict[str, Any]) -> None:
    """One graph-op record (the correlator's handler of routing tensors, activation counts and
    masks, and attention records): it belongs to the micro-batch running when it was produced.
    Worker threads carry no context, so this needs exactly one micro-batch in flight."""
    if len(state.open_steps) != 1:
        unattributed(state)
        return
    step = next(iter(state.open_steps.values()))
    if step.sparse is None:
        step.sparse = StepSparse()
    kind = int(r["kind"])
    if kind == ev.EV_TENSOR:
        got = step.sparse.add_tensor(r)
        if got is not None and int(r["tag"]) == ev.TAG_EXPERT_IDS:
            verify_routing(step.sparse, state.counters, state.n_expert, state.n_expert_used)
        section = "moe"
    elif kind in (ev.EV_ACT, ev.EV_ACT_MASK):
        got = step.sparse.add_act(r, with_bits=kind == ev.EV_ACT_MASK)
        section = "ffn"
    else:
        got = step.sparse.add_attn(r, state.layers.attn)
        section = "attn"
    if got is not None:
        state.layers_seen[section].add(got[1])


def unattributed(state: FeedState) -> None:
    """A graph-op record no single micro-batch claims. Before any micro-batch has begun since
    the attach, it comes from the forward pass the probes were attached in the middle of: the
    attach boundary (like samples_before_first_step), not a loss of the recording."""
    if state.open_steps or any(c.ubatches_seen for c in state.ctxs.values()):
        state.counters.sparse_unattributed += 1
    else:
        state.counters.sparse_before_first_step += 1


@dataclass
class _Run:
    """What a run of records stores when the step has none of its layers yet: its routing
    tensors (store, layer, their columns, their record) and its layers' activation counts
    (layer, zero and below counts per node row, width, node rows per token)."""

    end: int
    tensors: list[tuple[str, int, _TensorColumns, int]]
    acts: list[tuple[int, np.ndarray, np.ndarray, int, int]]


class SparseColumns:
    """What each routing tensor and activation record of one drain holds, for all of them, and
    what each run of them stores (planned for the whole drain at once, when first asked)."""

    def __init__(self, idx: DrainIndex) -> None:
        # (the drain index is not kept: it holds this in its cache, and a cycle would keep the
        # drain's records alive until the garbage collector's next full pass)
        self.tensors = {
            g: _TensorColumns(idx.arrays[g]) for g in (G_TENSOR_S, G_TENSOR_L) if len(idx.arrays[g])
        }
        self.acts = _ActColumns(idx.arrays[G_ACT]) if len(idx.arrays[G_ACT]) else None
        self._runs: dict[int, _Run] | None = None

    def store_run(self, idx: DrainIndex, sp: StepSparse, i: int, j: int, seen: dict[str, set[int]]) -> bool:
        """Store records i..j (a whole run) into the step's values, when every one is the common
        case (see the module's docstring) and the step has none of their layers yet; False, with
        nothing stored, when not."""
        if self._runs is None:
            self._runs = _plan_runs(self, idx)
        run = self._runs.get(i)
        if run is None or run.end != j:
            return False
        for store, layer, _, _ in run.tensors:
            if layer in getattr(sp, store):
                return False  # values of this layer came before: add_tensor merges, record by record
        act_zeros = sp.act_zeros
        for layer, _, _, _, _ in run.acts:
            if layer in act_zeros:
                return False  # counts of this layer came before: add_act merges, record by record
        moe = seen["moe"]
        for store, layer, tc, r in run.tensors:
            getattr(sp, store)[layer] = LayerRows(tc.values[r], tc.filled[r])
            moe.add(layer)
        if run.acts:
            ffn = seen["ffn"]
            for layer, zeros, below, width, slots in run.acts:
                act_zeros[layer], sp.act_below[layer] = zeros, below
                sp.act_width[layer], sp.act_slots[layer] = width, slots
                ffn.add(layer)
        return True


def _plan_runs(cols: SparseColumns, idx: DrainIndex) -> dict[int, _Run]:
    """Each run of routing and activation records of the drain (a stretch of them between other
    records) that can be stored at once, by its first record: every record one add_tensor or
    add_act would take whole, no routing tensor twice, each layer's activation records of one
    size, no node row counted twice. The activation counts of all of them are gathered with a
    few numpy calls for the drain: a run per server step over a few slots, done one by one, was
    about a fifth of the correlation at four clients (scripts/replay_drains.py)."""
    kinds = idx.kinds_a
    at = np.flatnonzero((kinds == ev.EV_TENSOR) | (kinds == ev.EV_ACT))
    if not len(at):
        return {}
    first = np.ones(len(at), dtype=bool)
    first[1:] = at[1:] != at[:-1] + 1
    run_of = np.cumsum(first) - 1  # per record of a run: its run
    starts = at[first]
    last = np.append(np.flatnonzero(first)[1:] - 1, len(at) - 1)
    ends = at[last] + 1
    groups = idx.group_a[at].astype(np.int64)
    rows = idx.row_a[at].astype(np.int64)
    bad = np.zeros(len(starts), dtype=bool)
    taken = np.zeros(len(at), dtype=bool)
    tensor_at: list[tuple[np.ndarray, _TensorColumns]] = []
    for g, tc in cols.tensors.items():
        sel = np.flatnonzero(groups == g)
        taken[sel] = True
        code = tc.code[rows[sel]]
        bad[run_of[sel[code < 0]]] = True  # a tensor in chunks, or not one add_tensor takes whole
        tensor_at.append((sel, tc))
    is_tensor = taken.copy()  # (only the tensor layouts marked so far)
    if tensor_at:  # a routing tensor twice in a run: add_tensor merges, record by record
        sel = np.concatenate([s for s, _ in tensor_at])
        key = np.concatenate([tc.code[rows[s]] * _LAYER_SPAN + tc.layer[rows[s]] for s, tc in tensor_at])
        _mark_repeated(
            run_of[sel] * (_LAYER_SPAN * len(_STORE_NAMES)) + key, bad, _LAYER_SPAN * len(_STORE_NAMES)
        )
    acts: dict[int, list[tuple[int, np.ndarray, np.ndarray, int, int]]] = {}
    if cols.acts is not None:
        act_sel = np.flatnonzero(groups == G_ACT)
        taken[act_sel] = True
        if len(act_sel):
            acts = _plan_acts(cols.acts, rows[act_sel], run_of[act_sel], bad)
    bad[run_of[~taken]] = True  # records of another layout (an activation mask): record by record
    out: dict[int, _Run] = {}
    good = np.flatnonzero(~bad)
    if not len(good):
        return out
    for k, start, end in zip(good.tolist(), starts[good].tolist(), ends[good].tolist(), strict=True):
        out[start] = _Run(end, [], acts.get(k, []))
    if tensor_at:  # each run's tensors in the order they came
        pick = np.flatnonzero(is_tensor & ~bad[run_of])
        run_start = starts.tolist()
        tensors = cols.tensors
        for run, g, r in zip(run_of[pick].tolist(), groups[pick].tolist(), rows[pick].tolist(), strict=True):
            tc = tensors[g]
            out[run_start[run]].tensors.append((_STORE_NAMES[tc.code_l[r]], tc.layer_l[r], tc, r))
    return out


def _mark_repeated(keys: np.ndarray, bad: np.ndarray, span: int = _LAYER_SPAN) -> None:
    """Mark in `bad` the run (key // span) of every key found more than once."""
    if len(keys) > 1:
        k = np.sort(keys)
        twice = k[1:][k[1:] == k[:-1]]
        if len(twice):
            bad[twice // span] = True


def _plan_acts(
    ac: _ActColumns, rows: np.ndarray, run_of: np.ndarray, bad: np.ndarray
) -> dict[int, list[tuple[int, np.ndarray, np.ndarray, int, int]]]:
    """The activation records `rows` (in the order they came), of runs `run_of`: per run, its
    layers in the order they first come, each with its node rows' zero and below counts (-1
    where no record counted a row), as add_act leaves them. Marks in `bad` the runs whose
    records add_act would not all take, a layer's records of two sizes, or a node row counted
    twice (add_act's order decides those, record by record)."""
    bad[run_of[~ac.ok[rows]]] = True
    layer = ac.layer[rows]
    # (run, layer) groups: a layer's records come one after another (its op ends before the next
    # layer's starts), so a group is a stretch of one key; a key in two stretches leaves its run
    # to the handlers
    key = run_of * _LAYER_SPAN + (layer + 1)
    new = np.ones(len(key), dtype=bool)
    new[1:] = key[1:] != key[:-1]
    head = np.flatnonzero(new)  # each group's first record, in the order they came
    inv = np.cumsum(new) - 1  # each record's group
    _mark_repeated(key[head], bad)
    head_rows = rows[head]
    total, width, slots = ac.nr[head_rows], ac.ne0[head_rows], ac.slots[head_rows]
    same = (ac.nr[rows] == total[inv]) & (ac.ne0[rows] == width[inv]) & (ac.slots[rows] == slots[inv])
    bad[run_of[~same]] = True
    total = np.where(bad[run_of[head]], 0, total)  # (no room for a run not taken)
    size = int(total.sum())
    if size > _ACT_CELLS_MAX:
        # node rows from the target's memory past any drain of a real model's: not allocated at
        # once, the handlers take those runs layer by layer
        bad[run_of] = True
        return {}
    base = np.cumsum(total) - total  # each group's first node row, all groups one after another
    n = np.where(bad[run_of], 0, ac.n[rows])
    within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    dst = np.repeat(base[inv] + ac.ir0[rows], n) + within
    src = np.repeat(rows * ac.width, n) + within
    if len(dst):
        counted = np.bincount(dst, minlength=size)
        twice = np.flatnonzero(counted > 1)
        if len(twice):
            group_of = np.repeat(np.arange(len(total)), total)
            bad[run_of[head[group_of[twice]]]] = True
    zeros = np.full(size, -1, dtype=np.int64)
    below = np.full(size, -1, dtype=np.int64)
    zeros[dst] = ac.zeros.reshape(-1)[src]
    below[dst] = ac.below.reshape(-1)[src]
    out: dict[int, list[tuple[int, np.ndarray, np.ndarray, int, int]]] = {}
    for run, lay, b, t, w, sl in zip(
        run_of[head].tolist(),
        layer[head].tolist(),
        base.tolist(),
        total.tolist(),
        width.tolist(),
        slots.tolist(),
        strict=True,
    ):
        if not bad[run]:
            out.setdefault(run, []).append((lay, zeros[b : b + t], below[b : b + t], w, sl))
    return out


class _TensorColumns:
    """Per record of one tensor layout: its store and layer when it holds a whole routing tensor
    that add_tensor would take (else -1), and then its values and filled flags: arrays of
    their own (copies, made per shape for all records of that shape at once), as add_tensor
    leaves them."""

    def __init__(self, arr: np.ndarray) -> None:
        f = {k: arr[k].astype(np.int64) for k in ("tag", "type", "row0", "n_rows", "rows_total", "ne0")}
        stride, n_bytes = arr["row_stride"].astype(np.int64), arr["n_bytes"].astype(np.int64)
        ok = (
            (stride % 4 == 0)
            & (f["n_rows"] >= 1)
            & (f["ne0"] * 4 <= stride)
            & (f["n_rows"] * stride <= np.minimum(n_bytes, arr.dtype["data"].itemsize))
            & (f["row0"] == 0)
            & (f["n_rows"] == f["rows_total"])
            & (f["rows_total"] * f["ne0"] <= MAX_TENSOR_CELLS)
        )
        n = len(arr)
        self.values: list[Any] = [None] * n
        self.filled: list[Any] = [None] * n
        layer, _ = _name_codes(arr["name"])
        store = _STORE_OF_TAG[np.minimum(f["tag"], len(_STORE_OF_TAG) - 1)]
        taken = ok & (store >= 0) & (layer >= 0) & (layer < _LAYER_SPAN)
        # the store (its index in _STORE_NAMES) and layer of each record add_tensor would take
        # whole, -1 for the others (lists: read one record at a time, as Python ints)
        self.code = np.where(taken, store, -1)
        self.layer = np.where(taken, layer, -1)
        self.code_l: list[int] = self.code.tolist()
        self.layer_l: list[int] = self.layer.tolist()
        rows = np.flatnonzero(taken)
        if not len(rows):
            return
        # the records by the shape of their values, one code each: type, values per row, row
        # stride and rows (each under 2**16 once `ok`: the record's data is 16 KiB at most)
        code = (
            ((f["type"][rows] == GGML_TYPE_I32).astype(np.int64) << 48)
            | (f["ne0"][rows] << 32)
            | (stride[rows] << 16)
            | f["n_rows"][rows]
        )
        order = np.argsort(code, kind="stable")
        by_shape, code = rows[order], code[order]
        cut = (np.flatnonzero(code[1:] != code[:-1]) + 1).tolist()
        data = arr["data"]
        for start, end in zip([0, *cut], [*cut, len(code)], strict=True):
            key = int(code[start])
            sel = by_shape[start:end]
            is_int, ne0, row_stride, n_rows = (
                key >> 48,
                (key >> 32) & 0xFFFF,
                (key >> 16) & 0xFFFF,
                key & 0xFFFF,
            )
            raw = data[sel].view(np.uint8).reshape(len(sel), -1)[:, : n_rows * row_stride]
            block = raw.view("<i4" if is_int else "<f4").reshape(len(sel), n_rows, row_stride // 4)
            values = np.array(block[:, :, :ne0], dtype=np.int32 if is_int else np.float32)
            filled = np.ones((len(sel), n_rows), dtype=bool)
            # (iterating the blocks yields each record's view: cheaper than indexing them one by one)
            for r, v, fl in zip(sel.tolist(), values, filled, strict=True):
                self.values[r], self.filled[r] = v, fl


class _ActColumns:
    """Per activation record: its layer, node rows per token (slots), node rows in all, width,
    first row and rows counted (as add_act clips them), and whether add_act would take it; its
    counts stay in the drained records until stored. Arrays over the drain's records: a prompt
    sends about fifteen records per layer (each engine thread's rows, a few rows a record), and
    a loop per record here was a tenth of the correlation."""

    def __init__(self, arr: np.ndarray) -> None:
        self.zeros = np.ascontiguousarray(arr["zeros"]).astype(np.int64)
        self.below = np.ascontiguousarray(arr["below"]).astype(np.int64)
        self.width = self.zeros.shape[1]
        nr = self.nr = arr["nr_total"].astype(np.int64)
        ir0 = self.ir0 = arr["ir0"].astype(np.int64)
        self.n = np.minimum(np.minimum(arr["n_rows"].astype(np.int64), nr - ir0), ev.ACT_MAX_ROWS).clip(0)
        ne0 = self.ne0 = arr["ne0"].astype(np.int64)
        self.layer, kind = _name_codes(arr["name"])
        slots = self.slots = np.where(
            kind == _MOE, arr["ne1"].astype(np.int64), (kind == _DENSE).astype(np.int64)
        )
        self.ok = (
            (slots > 0)
            & (nr % np.maximum(slots, 1) == 0)
            & (nr <= MAX_ACT_ROWS)
            & (ne0 > 0)
            & (ne0 <= MAX_ACT_WIDTH)
            & (self.layer < _LAYER_SPAN - 1)
        )
