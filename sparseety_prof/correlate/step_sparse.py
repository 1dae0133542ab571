"""Sparse decisions of one forward pass, assembled from the graph-op probe records.

The probes (probes/sparse_*.bpf.c) send, per micro-batch:
  * routing tensors per MoE layer: the selected expert ids, the gate weights as applied and
    (optionally) the router probabilities, each as raw rows of the engine's own tensor;
  * activation counts per FFN layer: exact zeros and |x| < threshold per GLU output row (per
    expert slot for MoE layers), counted in BPF by the thread that computed the row;
  * attention mask counts per layer: unmasked cells of the micro-batch's output rows (kept by
    AttentionRecords, attention_records.py).
This module turns them into per-(batch row, layer) values. A tensor's rows are the micro-batch's
rows, or only its output rows when the engine skipped the others (the last layer with
logits_all=False): anything else is counted as unmapped, never guessed. One-row micro-batches
usually send all of it as one aggregate record instead (agg_record.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sparseety_prof.capture import events as ev
from sparseety_prof.capture.plans import LayerSet
from sparseety_prof.correlate.agg_record import AggBlock, AggRow, agg_row_values, block_row_values
from sparseety_prof.correlate.attention_records import AttentionRecords
from sparseety_prof.correlate.node_names import parse_name

GGML_TYPE_F32 = 0
GGML_TYPE_I32 = 26
BLOCK_PAIRS = ev.BLOCK_WORDS
# Bounds on sizes read from the target's memory, far above real models (a routing tensor of an
# 8k-token micro-batch over 256 experts holds 2M cells; an FFN 64k wide): a record beyond them is
# dropped rather than allowed to size an allocation.
MAX_TENSOR_CELLS = 1 << 24
MAX_ACT_ROWS = 1 << 20
MAX_ACT_WIDTH = 1 << 18
MAX_MASK_CELLS = 1 << 28

# StepSparse.fill_rows' numpy calls per layer cost about as much as a dozen rows' per-row Python
# (scripts/bench_prompt_rows.py, 8 MoE layers): fewer rows take the per-row path
FILL_ROWS_MIN = 12

# _row_values' per-layer plan: the MoE stores' (ids, weights, probs) and the FFN layers' entries
_LayerPlan = tuple[list[Any], list[Any], list[Any], list[Any]]
_UNMAPPED = object()  # a layer whose row count is neither the batch's nor its outputs'

_ONE_FILLED = np.ones(1, dtype=bool)
_ONE_FILLED.flags.writeable = False


@dataclass
class LayerRows:
    """A per-layer array being filled from record chunks: rows_total x width."""

    values: np.ndarray
    filled: np.ndarray

    @classmethod
    def new(cls, rows: int, width: int, dtype: Any, fill: Any) -> LayerRows:
        return cls(np.full((rows, width), fill, dtype=dtype), np.zeros(rows, dtype=bool))


@dataclass
class Problems:
    """Inconsistencies between records and the micro-batch (counted, never guessed around)."""

    unmapped_rows: int = 0  # a tensor whose row count is neither the batch's nor its outputs'


NOT_MADE = "not made"  # a memo's value before it is made (None is a result)


@dataclass
class StepSparse(AttentionRecords):
    """Sparse records of one micro-batch, by layer (the attention part: AttentionRecords)."""

    ids: dict[int, LayerRows] = field(default_factory=dict)
    weights: dict[int, LayerRows] = field(default_factory=dict)
    probs: dict[int, LayerRows] = field(default_factory=dict)
    # activation: node rows (token x slot) -> zeros, below; -1 = not counted
    act_zeros: dict[int, np.ndarray] = field(default_factory=dict)
    act_below: dict[int, np.ndarray] = field(default_factory=dict)
    act_width: dict[int, int] = field(default_factory=dict)  # values per node row
    act_slots: dict[int, int] = field(default_factory=dict)  # node rows per token (k for MoE)
    act_bits: dict[int, np.ndarray] = field(default_factory=dict)  # node rows x width, uint8 0/1
    # the probes left the pass's activations uncounted on purpose (head sampling: every row a
    # dropped request's; its end record's a = 1): no activation record is missing from it
    act_uncounted: bool = False
    # row 0's routing and activation values read straight off an aggregate record (one-row
    # micro-batches: see from_agg_row); None when the per-layer stores above hold them
    _agg_row: dict[str, list[Any]] | None = None
    # the same values in the drain's arrays (agg_rows_batch), with the record's row there
    _agg_block: tuple[AggBlock, int] | None = None
    _row_cache: dict[int, dict[str, Any]] = field(default_factory=dict)  # asked once the pass ended
    # the pass's rows as arrays (pass_arrays.pass_block), made once the pass ended; NOT_MADE before
    _pass_block: Any = NOT_MADE
    # a step over several slots made arrays with the steps around it (slot_steps.py): the block
    # its token rows read, and the block row of its batch row 0
    _slot_block: tuple[AggBlock, int] | None = None
    # what each layer holds, as lists, worked out once for all rows of the pass (_layer_plan):
    # ((n_tokens, output rows, layers) it was made for, the plan)
    _plan: tuple[tuple[int, int, LayerSet], _LayerPlan] | None = None

    # ------------------------------------------------------------------ records
    @classmethod
    def from_agg(cls, r: dict[str, Any]) -> StepSparse:
        """A one-row micro-batch's aggregate record (struct ev_step_agg)."""
        sp = cls()
        k_ids, k_wts = np.asarray(r["k_ids"]), np.asarray(r["k_wts"])
        # copies: a step may end drains after its record arrived, and drained memory is reused
        ids, wts = np.array(r["ids"]), np.array(r["wts"])
        # views into those copies, and one shared "filled" flag
        for layer, k in zip(np.flatnonzero(k_ids).tolist(), k_ids[k_ids != 0].tolist(), strict=True):
            sp.ids[layer] = LayerRows(ids[layer : layer + 1, :k], _ONE_FILLED)
        for layer, k in zip(np.flatnonzero(k_wts).tolist(), k_wts[k_wts != 0].tolist(), strict=True):
            sp.weights[layer] = LayerRows(wts[layer : layer + 1, :k], _ONE_FILLED)
        nr = np.asarray(r["act_nr"])
        present = np.flatnonzero(nr)
        if len(present):
            # plain ints for the layers present: numpy scalar access per field costs more here
            rows_l = np.asarray(r["act_rows"])[present].tolist()
            nr_l = nr[present].tolist()
            slots_l = np.asarray(r["act_slots"])[present].tolist()
            zero_l = np.asarray(r["act_zero"])[present].tolist()
            below_l = np.asarray(r["act_below"])[present].tolist()
            ne0_l = np.asarray(r["act_ne0"])[present].tolist()
            for j, layer in enumerate(present.tolist()):
                slots = max(slots_l[j], 1)
                if rows_l[j] != nr_l[j] or nr_l[j] != slots:
                    continue  # not every row counted, or not one token's rows: not captured
                z = np.zeros(slots, dtype=np.int64)
                b = np.zeros(slots, dtype=np.int64)
                z[0], b[0] = zero_l[j], below_l[j]  # totals over slots
                sp.act_zeros[layer], sp.act_below[layer] = z, b
                sp.act_width[layer], sp.act_slots[layer] = ne0_l[j], slots
        return sp

    @classmethod
    def from_agg_row(cls, r: dict[str, Any], layers: LayerSet) -> tuple[StepSparse, list[int], list[int]]:
        """The same values as from_agg, as the one row's per-layer lists directly (from_agg
        builds per-layer stores, ~4x the cost per token). Returns the step's sparse values and
        the MoE and FFN layers it saw."""
        sp = cls()
        sp._agg_row, moe_seen, ffn_seen = agg_row_values(r, layers)
        return sp, moe_seen, ffn_seen

    @classmethod
    def from_pre(cls, pre: AggRow) -> StepSparse:
        """The step's values from agg_rows_batch (what from_agg_row computes per record)."""
        sp = cls()
        sp._agg_row = pre.values
        if pre.block is not None:
            sp._agg_block = (pre.block, pre.block_row)
        return sp

    def agg_block_row(self) -> tuple[AggBlock, int] | None:
        """Where the drain's AggBlock holds row 0's values, when they are what row_values gives
        for a one-row pass (they all came from its aggregate record); else None."""
        return self._agg_block if not self.from_records else None

    def _agg_values(self) -> dict[str, list[Any]] | None:
        """Row 0's values from its aggregate record, made from the AggBlock when first asked."""
        if self._agg_row is None and self._agg_block is not None:
            self._agg_row = block_row_values(*self._agg_block)
        return self._agg_row

    @property
    def from_records(self) -> bool:
        """Routing or activation values came as per-layer records (not only attention)."""
        return bool(self.ids or self.weights or self.probs or self.act_zeros)

    def merge(self, other: StepSparse) -> None:
        """Take `other`'s routing and activation values (an aggregate record of the same pass)."""
        self._agg_row, self._agg_block = other._agg_row, other._agg_block
        self.merge_attention(other)
        self.ids.update(other.ids)
        self.weights.update(other.weights)
        self.act_zeros.update(other.act_zeros)
        self.act_below.update(other.act_below)
        self.act_width.update(other.act_width)
        self.act_slots.update(other.act_slots)

    def add_tensor(self, r: dict[str, Any]) -> tuple[str, int] | None:
        parsed = parse_name(bytes(r["name"]))
        if parsed is None:
            return None
        tag = int(r["tag"])
        target = {
            ev.TAG_EXPERT_IDS: self.ids,
            ev.TAG_EXPERT_WEIGHTS: self.weights,
            ev.TAG_ROUTER_PROBS: self.probs,
        }
        store = target.get(tag)
        if store is None:
            return None
        layer = parsed[1]
        ne0, stride, n_rows = int(r["ne0"]), int(r["row_stride"]), int(r["n_rows"])
        rows_total, row0 = int(r["rows_total"]), int(r["row0"])
        is_int = int(r["type"]) == GGML_TYPE_I32
        if (
            stride % 4
            or n_rows < 1
            or ne0 * 4 > stride
            or n_rows * stride > min(int(r["n_bytes"]), len(r["data"]))
            or row0 + n_rows > rows_total
            or rows_total * ne0 > MAX_TENSOR_CELLS
        ):
            return None  # sizes the record cannot hold, or a tensor no micro-batch has
        raw = np.frombuffer(r["data"], dtype="<i4" if is_int else "<f4", count=n_rows * stride // 4)
        block = raw.reshape(n_rows, stride // 4)[:, :ne0]
        cur = store.get(layer)
        if cur is None or cur.values.shape != (rows_total, ne0):
            cur = store[layer] = LayerRows.new(
                rows_total, ne0, np.int32 if is_int else np.float32, -1 if is_int else np.nan
            )
        cur.values[row0 : row0 + n_rows] = block
        cur.filled[row0 : row0 + n_rows] = True
        return parsed

    def add_act(self, r: dict[str, Any], *, with_bits: bool) -> tuple[str, int] | None:
        parsed = parse_name(bytes(r["name"]))
        if parsed is None:
            return None
        kind, layer = parsed
        ne0, ne1, nr = int(r["ne0"]), int(r["ne1"]), int(r["nr_total"])
        slots = ne1 if kind.startswith("ffn_moe_") else 1
        if slots <= 0 or nr % slots or nr > MAX_ACT_ROWS or not 0 < ne0 <= MAX_ACT_WIDTH:
            return None  # sizes from the target's memory beyond any model: not allocated
        z = self.act_zeros.get(layer)
        if z is None or len(z) != nr:
            z = self.act_zeros[layer] = np.full(nr, -1, dtype=np.int64)
            self.act_below[layer] = np.full(nr, -1, dtype=np.int64)
            self.act_width[layer] = ne0
            self.act_slots[layer] = slots
            if with_bits and nr * ne0 <= MAX_MASK_CELLS:
                self.act_bits[layer] = np.zeros((nr, ne0), dtype=np.uint8)
        ir0, n = int(r["ir0"]), int(r["n_rows"])
        n = min(n, nr - ir0, ev.ACT_MAX_ROWS)
        if n > 0:
            # (lists when the drain's records were made lists at once: DrainIndex.record)
            z[ir0 : ir0 + n] = r["zeros"][:n]
            self.act_below[layer][ir0 : ir0 + n] = r["below"][:n]
            bits = self.act_bits.get(layer) if with_bits and "bits" in r else None
            if bits is not None and bits.shape[1] == ne0:
                self._unpack_bits(layer, r["bits"], ir0, n, ne0)
        return parsed

    def _unpack_bits(self, layer: int, words: bytes, ir0: int, n: int, ne0: int) -> None:
        """Undo the probe's block layout: row rr, block cb covers pairs [start+vlo, start+vhi)
        with start/vlo/vhi chosen exactly as glu_return chooses them."""
        ppr = ne0 // 2
        bpr = -(-ppr // BLOCK_PAIRS)
        bits = np.unpackbits(np.frombuffer(words, dtype=np.uint8), bitorder="little")
        out = self.act_bits[layer]
        for rr in range(n):
            row = np.zeros(ne0, dtype=np.uint8)
            for cb in range(bpr):
                b = rr * bpr + cb
                if b >= len(bits) // (2 * BLOCK_PAIRS):
                    break
                p0 = cb * BLOCK_PAIRS
                if p0 + BLOCK_PAIRS <= ppr:
                    start, vlo, vhi = p0, 0, BLOCK_PAIRS
                elif ppr >= BLOCK_PAIRS:
                    start, vlo, vhi = ppr - BLOCK_PAIRS, p0 - (ppr - BLOCK_PAIRS), BLOCK_PAIRS
                else:
                    start, vlo, vhi = 0, 0, ppr
                blk = bits[b * 2 * BLOCK_PAIRS : (b + 1) * 2 * BLOCK_PAIRS]
                row[2 * (start + vlo) : 2 * (start + vhi)] = blk[2 * vlo : 2 * vhi]
            out[ir0 + rr] = row

    # ------------------------------------------------------------------ per batch row
    def row_values(
        self,
        batch_row: int,
        output_index: dict[int, int],
        n_tokens: int,
        layers: LayerSet,
        problems: Problems,
    ) -> dict[str, Any]:
        """Per-layer values of one micro-batch row (see _row_values), computed once: the routes
        table and the token row both ask for them after the pass ended."""
        cached = self._row_cache.get(batch_row)
        agg = self._agg_values() if cached is None and n_tokens == 1 and not self.from_records else None
        if agg is not None:
            cached = self._row_cache[batch_row] = {
                **agg,
                "attn_attended": self.attended(batch_row, layers.attn),
            }
        if cached is None:
            cached = self._row_cache[batch_row] = self._row_values(
                batch_row, output_index, n_tokens, layers, problems
            )
        return cached

    def fill_rows(
        self,
        batch_rows: list[int],
        output_index: dict[int, int],
        n_tokens: int,
        layers: LayerSet,
        problems: Problems,
        *,
        min_rows: int = 0,
    ) -> None:
        """What row_values gives for each of `batch_rows` (a prompt's rows), made for all of
        them at once: per layer one numpy gather instead of three calls per row and layer. The
        values, and the problems counted, are row_values' own (tests/test_sparse.py checks them
        row by row); rows asked for before are left as they are. Fewer rows than `min_rows`
        (default FILL_ROWS_MIN) are left to row_values."""
        rows = [b for b in batch_rows if b not in self._row_cache]
        if len(rows) < (min_rows or FILL_ROWS_MIN) or n_tokens < 2:
            return  # row_values' own path, per row (one-row steps take the aggregate's lists)
        g = _RowGather(rows, output_index, n_tokens, problems)
        ids = [g.moe_column(self.ids, layer) for layer in layers.moe]
        wts = [g.moe_column(self.weights, layer) for layer in layers.moe]
        prb = [g.moe_column(self.probs, layer) for layer in layers.moe]
        zero: list[list[Any]] = []
        below: list[list[Any]] = []
        n_values: list[list[int]] = []
        for layer in layers.ffn:
            z = self.act_zeros.get(layer)
            if z is None:
                got = None
            else:
                got = g.act_column(z, self.act_below[layer], self.act_slots[layer], self.act_width[layer])
            zero_col, below_col, values_col = got if got is not None else (g.none_col, g.none_col, [0] * g.m)
            zero.append(zero_col)
            below.append(below_col)
            n_values.append(values_col)
        columns = (ids, wts, prb, zero, below, n_values)
        per_row = zip(*(zip(*col, strict=True) if col else [()] * g.m for col in columns), strict=True)
        for b, (i, w, p, zr, br, nv) in zip(rows, per_row, strict=True):
            self._row_cache[b] = {
                "expert_ids": list(i),
                "expert_weights": list(w),
                "router_probs": list(p),
                "act_zero_ratio": list(zr),
                "act_below_ratio": list(br),
                "act_values": list(nv),
                "attn_attended": self.attended(b, layers.attn),
            }

    def _row_values(
        self,
        batch_row: int,
        output_index: dict[int, int],
        n_tokens: int,
        layers: LayerSet,
        problems: Problems,
    ) -> dict[str, Any]:
        """Per-layer values of one micro-batch row, as lists following `layers` (None where the
        engine did not compute that layer for this row, or the record was not captured).

        A layer's tensor holds a row per batch row or per output row; any other row count is
        counted as unmapped (per row asked). What each layer holds is worked out once for all
        the pass's rows (_layer_plan): per row, only indexing."""
        plan = self._plan
        if plan is None or plan[0] != (n_tokens, len(output_index), layers):
            plan = self._plan = (
                (n_tokens, len(output_index), layers),
                self._layer_plan(n_tokens, output_index, layers),
            )
        out_row = output_index.get(batch_row)
        moe: list[list[Any]] = []
        for store_plan in plan[1][:3]:
            col: list[Any] = []
            for got in store_plan:
                if got is None:
                    col.append(None)
                elif got is _UNMAPPED:
                    problems.unmapped_rows += 1
                    col.append(None)
                else:
                    vals, filled, by_output = got
                    i = out_row if by_output else batch_row
                    col.append(vals[i] if i is not None and filled[i] else None)
            moe.append(col)
        zero: list[float | None] = []
        below: list[float | None] = []
        n_values: list[int] = []
        for got in plan[1][3]:
            zr, br, counted = self._act_ratios(got, out_row, batch_row, problems)
            zero.append(zr)
            below.append(br)
            n_values.append(counted)
        return {
            "expert_ids": moe[0],
            "expert_weights": moe[1],
            "router_probs": moe[2],
            "act_zero_ratio": zero,
            "act_below_ratio": below,
            "act_values": n_values,
            "attn_attended": self.attended(batch_row, layers.attn),
        }

    @staticmethod
    def _act_ratios(
        got: Any, out_row: int | None, batch_row: int, problems: Problems
    ) -> tuple[float | None, float | None, int]:
        """One row's zero and below-threshold shares of an FFN layer (its _layer_plan entry `got`)
        and the values counted; None, None, 0 when the layer was not counted for the row."""
        if got is None:
            return None, None, 0
        if got is _UNMAPPED:
            problems.unmapped_rows += 1
            return None, None, 0
        zl, bl, slots, n, by_output = got
        t = out_row if by_output else batch_row
        if t is None:
            return None, None, 0
        # plain Python on a handful of values (numpy's per-call cost is ~10x here)
        zs = zl[t * slots : (t + 1) * slots]
        bs = bl[t * slots : (t + 1) * slots]
        if min(zs) < 0 or min(bs) < 0:
            return None, None, 0
        return sum(zs) / n, sum(bs) / n, n

    def _layer_plan(self, n_tokens: int, output_index: dict[int, int], layers: LayerSet) -> _LayerPlan:
        """Per MoE store and layer: None (no values), _UNMAPPED (a row count neither the batch's
        nor its outputs'), or its values and filled flags as lists and whether they are by output
        row; per FFN layer the same with its zero and below counts as lists, node rows per token
        and values per token. Made once the pass ended: the stores do not change after."""
        n_out = len(output_index)
        moe_plans: list[list[Any]] = []
        for store in (self.ids, self.weights, self.probs):
            plan: list[Any] = []
            for layer in layers.moe:
                rows = store.get(layer)
                if rows is None:
                    plan.append(None)
                    continue
                total = len(rows.values)
                if total != n_tokens and total != n_out:
                    plan.append(_UNMAPPED)
                    continue
                plan.append((rows.values.tolist(), rows.filled.tolist(), total != n_tokens))
            moe_plans.append(plan)
        ffn_plan: list[Any] = []
        for layer in layers.ffn:
            z = self.act_zeros.get(layer)
            if z is None:
                ffn_plan.append(None)
                continue
            slots = self.act_slots[layer]
            tokens = len(z) // slots
            if tokens != n_tokens and tokens != n_out:
                ffn_plan.append(_UNMAPPED)
                continue
            n = slots * self.act_width[layer]
            ffn_plan.append((z.tolist(), self.act_below[layer].tolist(), slots, n, tokens != n_tokens))
        return moe_plans[0], moe_plans[1], moe_plans[2], ffn_plan

    def act_mask_bits(
        self, layer: int, batch_row: int, output_index: dict[int, int], n_tokens: int
    ) -> np.ndarray | None:
        bits = self.act_bits.get(layer)
        z = self.act_zeros.get(layer)
        if bits is None or z is None:
            return None
        slots = self.act_slots[layer]
        tokens = len(z) // slots
        t = (
            batch_row
            if tokens == n_tokens
            else (output_index.get(batch_row) if tokens == len(output_index) else None)
        )
        if t is None or (z[t * slots : (t + 1) * slots] < 0).any():
            return None
        return bits[t * slots : (t + 1) * slots].reshape(-1)


class _RowGather:
    """A pass's per-row arrays gathered for some of its batch rows (StepSparse.fill_rows): per
    layer one numpy gather, the values and problems row_values would give row by row."""

    def __init__(
        self, rows: list[int], output_index: dict[int, int], n_tokens: int, problems: Problems
    ) -> None:
        m = self.m = len(rows)
        self.n_tokens = n_tokens
        self.n_out = len(output_index)
        self.problems = problems
        self.out_at = np.array([output_index.get(b, -1) for b in rows], dtype=np.intp)
        # the rows' indices into an array with a row per batch row (a slice when they follow
        # each other: cheaper than a gather) or per output row (-1 where a row has no output)
        contiguous = rows[-1] - rows[0] == m - 1
        self.by_batch: slice | np.ndarray = slice(rows[0], rows[-1] + 1) if contiguous else np.array(rows)
        self.outputs_all = bool((self.out_at >= 0).all())
        self.none_col: list[Any] = [None] * m
        self.all_ok = [True] * m

    def gather(self, values: np.ndarray, filled: np.ndarray | None) -> tuple[list[Any], list[bool]] | None:
        """Each row's entry of a per-row array, and whether it has one; None when its row
        count matches neither the batch nor its outputs (unmapped)."""
        total, out_at = values.shape[0], self.out_at
        if total == self.n_tokens or (total == self.n_out and self.outputs_all):
            at = self.by_batch if total == self.n_tokens else out_at
            if filled is None or filled[at].all():
                return values[at].tolist(), self.all_ok
            return values[at].tolist(), filled[at].tolist()
        if total != self.n_out:
            return None
        ok = out_at >= 0
        if filled is not None:
            ok[ok] = filled[out_at[ok]]
        return values[np.where(ok, out_at, 0)].tolist(), ok.tolist()

    def moe_column(self, store: dict[int, LayerRows], layer: int) -> list[Any]:
        """Each row's values of one routing store's layer (None where it has none)."""
        got = store.get(layer)
        if got is None:
            return self.none_col
        g = self.gather(got.values, got.filled)
        if g is None:
            self.problems.unmapped_rows += self.m
            return self.none_col
        vals, ok = g
        return vals if ok is self.all_ok else [v if good else None for v, good in zip(vals, ok, strict=True)]

    def act_column(
        self, zeros: np.ndarray, below: np.ndarray, slots: int, width: int
    ) -> tuple[list[Any], list[Any], list[int]] | None:
        """Each row's activation zero and below ratios and values counted of one FFN layer
        (its counts per node row), or None when they map to no row (counted unmapped)."""
        n = slots * width
        # per token: its counts summed over its slots, and whether every slot was
        # counted (-1: not), as [zeros, below, counted] rows
        zb = np.stack((zeros, below)).reshape(2, -1, slots)
        per_token = np.empty((zb.shape[1], 3), dtype=np.int64)
        per_token[:, :2] = zb.sum(axis=2).T
        per_token[:, 2] = zb.min(axis=2).min(axis=0) >= 0
        g = self.gather(per_token, None)
        if g is None:
            self.problems.unmapped_rows += self.m
            return None
        vals, ok = g
        # int sums over a float division: the same value as sum(list) / n per row
        good = [o and bool(c) for (_, _, c), o in zip(vals, ok, strict=True)]
        return (
            [zs / n if o else None for (zs, _, _), o in zip(vals, good, strict=True)],
            [bs / n if o else None for (_, bs, _), o in zip(vals, good, strict=True)],
            [n if o else 0 for o in good],
        )
