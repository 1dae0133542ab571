"""The per-layer sparse records of a micro-batch, taken a run at a time, from values worked out
for the whole drain at once.

A micro-batch of several rows (a prompt, or a llama-server step over several slots) sends its
routing and activation values as records per layer: a routing tensor per layer and kind, and the
activation counts per layer and engine thread. The correlator's _on_sparse takes them one at a
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

from typing import TYPE_CHECKING, Any

import numpy as np

from sparseety_prof.capture import events as ev
from sparseety_prof.capture.drain_index import G_ACT, G_TENSOR_L, G_TENSOR_S, DrainIndex
from sparseety_prof.correlate.node_names import parse_name
from sparseety_prof.correlate.step_sparse import (
    GGML_TYPE_I32,
    MAX_ACT_ROWS,
    MAX_ACT_WIDTH,
    MAX_TENSOR_CELLS,
    LayerRows,
    StepSparse,
)
from sparseety_prof.correlate.verification import verifying_sparse

if TYPE_CHECKING:
    from sparseety_prof.correlate.correlator import Correlator

RUN_KINDS = frozenset((ev.EV_TENSOR, ev.EV_ACT))
_STORES = {ev.TAG_EXPERT_IDS: "ids", ev.TAG_EXPERT_WEIGHTS: "weights", ev.TAG_ROUTER_PROBS: "probs"}


def sparse_run(corr: Correlator, idx: DrainIndex, i: int) -> int:
    """Records i.. while they are routing tensors or activation counts: stored at once when they
    are the common case, else given to the correlator's handler one by one. Returns the index
    after the run."""
    kinds, n = idx.kinds, len(idx)
    j = i + 1
    while j < n and kinds[j] in RUN_KINDS:
        j += 1
    if len(corr.open_steps) == 1 and not verifying_sparse(corr.counters, corr.n_expert):
        step = next(iter(corr.open_steps.values()))
        sp = step.sparse if step.sparse is not None else StepSparse()
        cols: SparseColumns | None = idx.cache.get("sparse")
        if cols is None:
            cols = idx.cache["sparse"] = SparseColumns(idx)
        if cols.store_run(sp, idx.group[i:j], idx.row[i:j], corr.layers_seen):
            step.sparse = sp
            return j
    for k in range(i, j):
        corr._on_sparse(idx.record(k))
    return j


class SparseColumns:
    """What each routing tensor and activation record of one drain holds, for all of them."""

    def __init__(self, idx: DrainIndex) -> None:
        self.tensors = {
            g: _TensorColumns(idx.arrays[g]) for g in (G_TENSOR_S, G_TENSOR_L) if len(idx.arrays[g])
        }
        self.acts = _ActColumns(idx.arrays[G_ACT]) if len(idx.arrays[G_ACT]) else None

    def store_run(
        self, sp: StepSparse, groups: list[int], rows: list[int], seen: dict[str, set[int]]
    ) -> bool:
        """Store a run of records (their layouts and rows) into the step's values, when every
        one is the common case (see the module's docstring); False, with nothing stored, when
        not."""
        tensors: list[tuple[_TensorColumns, int]] = []
        keys: set[tuple[str, int]] = set()
        act_rows: list[int] = []
        for g, r in zip(groups, rows, strict=True):
            tc = self.tensors.get(g)
            if tc is not None:
                key = tc.keys[r]
                if key is None or key in keys or key[1] in getattr(sp, key[0]):
                    return False  # a tensor in chunks or twice: add_tensor merges, record by record
                keys.add(key)
                tensors.append((tc, r))
            elif g == G_ACT and self.acts is not None:
                act_rows.append(r)
            else:
                return False
        act = self.acts.plan(act_rows, sp) if act_rows and self.acts is not None else None
        if act_rows and act is None:
            return False
        for tc, r in tensors:
            store, layer = tc.keys[r]  # type: ignore[misc]
            getattr(sp, store)[layer] = LayerRows(tc.values[r], tc.filled[r])
            seen["moe"].add(layer)
        if act is not None:
            assert self.acts is not None
            seen["ffn"].update(self.acts.store(sp, *act))
        return True


class _TensorColumns:
    """Per record of one tensor layout: its (store, layer) when it holds a whole routing tensor
    that add_tensor would take (else None), and then its values and filled flags: arrays of
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
        self.keys: list[tuple[str, int] | None] = [None] * n
        self.values: list[Any] = [None] * n
        self.filled: list[Any] = [None] * n
        # a model has a few node names per layer: each parsed once
        names, at = np.unique(arr["name"], return_inverse=True)
        layer_of = [None if p is None else p[1] for p in map(parse_name, names.tolist())]
        at = at.reshape(-1)
        rows_ok = np.flatnonzero(ok)
        for r, tag, name_at in zip(
            rows_ok.tolist(), f["tag"][rows_ok].tolist(), at[rows_ok].tolist(), strict=True
        ):
            store, layer = _STORES.get(tag), layer_of[name_at]
            if store is not None and layer is not None:
                self.keys[r] = (store, layer)
        rows = np.array([r for r, k in enumerate(self.keys) if k is not None], dtype=np.intp)
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
        codes, of = np.unique(code, return_inverse=True)
        of = of.reshape(-1)
        by_shape = rows[np.argsort(of, kind="stable")]
        ends = np.cumsum(np.bincount(of, minlength=len(codes))).tolist()
        data = arr["data"]
        start = 0
        for key, end in zip(codes.tolist(), ends, strict=True):
            sel, start = by_shape[start:end], end
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


# a run of at most this many activation records is planned by a loop over them, a longer one by
# numpy calls: their fixed cost (~30 us) is what a loop spends on about thirty records
PLAN_LOOP_MAX = 32

# each layer of a run: (layer, node rows, width, slots)
_ActLayers = list[tuple[int, int, int, int]]


class _ActColumns:
    """Per activation record: its layer, node rows per token (slots), node rows in all, width,
    first row and rows counted (as add_act clips them), and whether add_act would take it; its
    counts stay in the drained records until stored. Arrays over the drain's records: a prompt
    sends about fifteen records per layer (each engine thread's rows, a few rows a record), and
    a loop per record here, and per record of a run in plan, was a tenth of the correlation."""

    def __init__(self, arr: np.ndarray) -> None:
        self.zeros = np.ascontiguousarray(arr["zeros"]).astype(np.int64)
        self.below = np.ascontiguousarray(arr["below"]).astype(np.int64)
        self.width = self.zeros.shape[1]
        nr = self.nr = arr["nr_total"].astype(np.int64)
        ir0 = self.ir0 = arr["ir0"].astype(np.int64)
        self.n = np.minimum(np.minimum(arr["n_rows"].astype(np.int64), nr - ir0), ev.ACT_MAX_ROWS).clip(0)
        ne0 = self.ne0 = arr["ne0"].astype(np.int64)
        # a model has a few node names per layer: each parsed once
        names, at = np.unique(arr["name"], return_inverse=True)
        parsed = [parse_name(name) for name in names.tolist()]
        layer_of = np.array([-1 if p is None else p[1] for p in parsed], dtype=np.int64)
        moe_of = np.array([p is not None and p[0].startswith("ffn_moe_") for p in parsed], dtype=bool)
        known_of = np.array([p is not None for p in parsed], dtype=bool)
        at = at.reshape(-1)
        self.layer = layer_of[at]
        slots = self.slots = np.where(known_of[at], np.where(moe_of[at], arr["ne1"].astype(np.int64), 1), 0)
        self._lists: tuple[list[Any], ...] | None = None  # the columns above as lists (_plan_loop)
        self.ok = (
            (slots > 0)
            & (nr % np.maximum(slots, 1) == 0)
            & (nr <= MAX_ACT_ROWS)
            & (ne0 > 0)
            & (ne0 <= MAX_ACT_WIDTH)
        )

    def plan(self, rows: list[int], sp: StepSparse) -> tuple[_ActLayers, Any, Any] | None:
        """For records `rows` of one run: their layers (in the order they first come), and each
        counted node row's position in the layers' rows one after another and in this drain's
        counts; None unless every record is one add_act would take, for a layer the step has no
        counts of yet, each layer's records of one size, no node row counted twice. A loop over
        the records for a short run (a server step over a few slots: two records a layer), numpy
        for a long one (a prompt: fifteen a layer), each where it costs less."""
        if len(rows) <= PLAN_LOOP_MAX:
            return self._plan_loop(rows, sp)
        return self._plan_arrays(rows, sp)

    def _plan_loop(self, rows: list[int], sp: StepSparse) -> tuple[_ActLayers, list[int], list[int]] | None:
        if self._lists is None:
            self._lists = tuple(
                a.tolist() for a in (self.layer, self.nr, self.ne0, self.slots, self.ok, self.ir0, self.n)
            )
        layer_of, nr, ne0, slots_of, ok, ir0, n_of = self._lists
        layers: _ActLayers = []
        base_of: dict[int, tuple[int, int]] = {}  # layer -> (its index in layers, its first position)
        size = 0
        dst: list[int] = []
        src: list[int] = []
        for r in rows:
            if not ok[r]:
                return None
            layer, total, width, slots = layer_of[r], nr[r], ne0[r], slots_of[r]
            got = base_of.get(layer)
            if got is None:
                if layer in sp.act_zeros:
                    return None  # counts of this layer came before: add_act merges, record by record
                got = base_of[layer] = (len(layers), size)
                layers.append((layer, total, width, slots))
                size += total
            elif layers[got[0]][1:] != (total, width, slots):
                return None
            start, first, n = got[1] + ir0[r], r * self.width, n_of[r]
            dst.extend(range(start, start + n))
            src.extend(range(first, first + n))
        if len(set(dst)) != len(dst):
            return None  # node rows counted by two records: add_act's order decides, record by record
        return layers, dst, src

    def _plan_arrays(
        self, rows: list[int], sp: StepSparse
    ) -> tuple[_ActLayers, np.ndarray, np.ndarray] | None:
        r = np.asarray(rows, dtype=np.intp)
        if not self.ok[r].all():
            return None
        layers_u, first, inv = np.unique(self.layer[r], return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
        head = r[first]  # each layer's first record
        total, width, slots = self.nr[head], self.ne0[head], self.slots[head]
        if not (
            (self.nr[r] == total[inv]).all()
            and (self.ne0[r] == width[inv]).all()
            and (self.slots[r] == slots[inv]).all()
        ):
            return None
        order = np.argsort(first, kind="stable")  # the layers in the order they first come
        layers: _ActLayers = list(
            zip(
                layers_u[order].tolist(),
                total[order].tolist(),
                width[order].tolist(),
                slots[order].tolist(),
                strict=True,
            )
        )
        if any(layer in sp.act_zeros for layer, _, _, _ in layers):
            return None  # counts of this layer came before: add_act merges, record by record
        base = np.empty(len(order), dtype=np.int64)
        base[order] = np.cumsum(total[order]) - total[order]  # each layer's first position
        n = self.n[r]
        # record j's rows: start_j, start_j + 1, ... (n_j of them), all records' one after another
        within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        dst = np.repeat(base[inv] + self.ir0[r], n) + within
        src = np.repeat(r * self.width, n) + within
        if len(dst) and np.bincount(dst).max() > 1:
            return None  # node rows counted by two records: add_act's order decides, record by record
        return layers, dst, src

    def store(self, sp: StepSparse, layers: _ActLayers, dst: Any, src: Any) -> set[int]:
        """The planned counts into the step's stores: per layer its node rows' zero and below
        counts (-1 where no record counted a row), as add_act leaves them."""
        size = sum(total for _, total, _, _ in layers)
        zeros = np.full(size, -1, dtype=np.int64)
        below = np.full(size, -1, dtype=np.int64)
        if len(dst):
            at, frm = np.asarray(dst), np.asarray(src)
            zeros[at] = self.zeros.reshape(-1)[frm]
            below[at] = self.below.reshape(-1)[frm]
        start = 0
        for layer, total, width, slots in layers:
            sp.act_zeros[layer], sp.act_below[layer] = (
                zeros[start : start + total],
                below[start : start + total],
            )
            sp.act_width[layer], sp.act_slots[layer] = width, slots
            start += total
        return {layer for layer, _, _, _ in layers}
