"""One drain's records in sequence-number order, without making each record a Python object.

The correlator walks records in the order the probes produced them. Making every record a dict
first (one per record, ~8 per decoded token) was a fixed cost per token whether or not the
record needed more than a glance; here the order is one numpy argsort over all layouts, fields
are read from per-layout column lists made once per drain (one tolist per column), and a dict is
made only for a record that takes the general path (`record`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sparseety_prof.capture import events as ev
from sparseety_prof.capture.events import EventBatch

# layouts in EventBatch.groups() order (G_UBATCH_S: micro-batches of up to UB_SMALL_TOK rows)
(
    G_SMALL,
    G_UBATCH,
    G_LOGITS,
    G_TENSOR_S,
    G_TENSOR_L,
    G_ACT,
    G_ACT_MASK,
    G_ATTN,
    G_STEP_AGG,
    G_HTTP,
    G_UBATCH_S,
) = range(11)
# all fields become values; in the other layouts (micro-batch, logits, aggregate) array fields
# stay views into the drained records
_WHOLE_ROW = (G_SMALL, G_TENSOR_S, G_TENSOR_L, G_ACT, G_ACT_MASK, G_ATTN)


class DrainIndex:
    """kinds[i], group[i], row[i]: the i-th record in sequence-number order, its layout and its
    index in that layout's array."""

    __slots__ = (
        "_cols",
        "_fast",
        "_fields",
        "_rows",
        "arrays",
        "cache",
        "group",
        "group_a",
        "kinds",
        "kinds_a",
        "logits_chunk",
        "logits_data",
        "logits_stats",
        "logits_vals",
        "row",
        "row_a",
        "seqs",
    )

    def __init__(self, batch: EventBatch) -> None:
        self.arrays = batch.groups()
        self.logits_chunk = batch.logits_chunk  # floats per logits record
        self.logits_vals = batch.logits_vals  # a logits record's floats, where they lie
        self.logits_data = batch.logits_data  # the bytes they lie in (at a record's "at")
        self.logits_stats = batch.logits_stats  # or, reduced when drained, their statistics
        present = [(g, a) for g, a in enumerate(self.arrays) if len(a)]
        self._rows: dict[int, list[tuple[Any, ...]]] = {}
        self._cols: dict[tuple[int, str], list[Any]] = {}
        self._fields: dict[int, list[tuple[str, Any]]] = {}
        self._fast: FastColumns | None = None
        # what the correlator's other column paths work out once per drain (sparse_run.py)
        self.cache: dict[str, Any] = {}
        if not present:
            self.seqs: np.ndarray = np.empty(0, np.uint64)
            self.kinds_a: np.ndarray = np.empty(0, np.int64)
            self.group_a: np.ndarray = np.empty(0, np.int8)
            self.row_a: np.ndarray = np.empty(0, np.int64)
            self.kinds: list[int] = []
            self.group: list[int] = []
            self.row: list[int] = []
            return
        seq = np.concatenate([a["seq"] for _, a in present])
        order = np.argsort(seq, kind="stable")
        self.seqs = seq[order]  # sequence numbers, ascending
        # each as an array too, for the paths that work on all records at once (sparse_run.py)
        self.kinds_a = np.concatenate([a["kind"] for _, a in present])[order]
        self.group_a = np.concatenate([np.full(len(a), g, dtype=np.int8) for g, a in present])[order]
        self.row_a = np.concatenate([np.arange(len(a)) for _, a in present])[order]
        self.kinds = self.kinds_a.tolist()
        self.group = self.group_a.tolist()
        self.row = self.row_a.tolist()

    def __len__(self) -> int:
        return len(self.kinds)

    def col(self, group: int, name: str) -> list[Any]:
        """A scalar field of every record of a layout, as Python values (made once)."""
        key = (group, name)
        col = self._cols.get(key)
        if col is None:
            col = self._cols[key] = self.arrays[group][name].tolist()
        return col

    def first(self, group: int, name: str) -> list[Any]:
        """Element 0 of an array field of every record of a layout (a one-row micro-batch's row)."""
        key = (group, name + "[0]")
        col = self._cols.get(key)
        if col is None:
            col = self._cols[key] = self.arrays[group][name][:, 0].tolist()
        return col

    def fast(self) -> FastColumns:
        """The columns the correlator's one-row step path reads, made once per drain."""
        if self._fast is None:
            self._fast = FastColumns(self)
        return self._fast

    def record(self, i: int) -> dict[str, Any]:
        """The i-th record as the correlator's handlers take it: a dict of its fields (array
        fields of the big layouts as views, valid until the next drain)."""
        g, r = self.group[i], self.row[i]
        arr = self.arrays[g]
        names = arr.dtype.names or ()
        if g in _WHOLE_ROW:
            rows = self._rows.get(g)
            if rows is None:
                rows = self._rows[g] = arr.tolist()
            return dict(zip(names, rows[r], strict=True))
        if g == G_HTTP:
            h = arr[r]
            return {
                "kind": int(h["kind"]),
                "tid": int(h["tid"]),
                "ts_ns": int(h["ts_ns"]),
                "data": ev.http_copied(h),
            }
        fields = self._fields.get(g)
        if fields is None:  # per field: its column (array fields) or its values as a list
            dt = arr.dtype
            fields = self._fields[g] = [(n, arr[n]) if dt[n].shape else (n, self.col(g, n)) for n in names]
        d: dict[str, Any] = {n: col[r] for n, col in fields}
        if g == G_LOGITS:
            d["vals"] = self.logits_vals(r)
        return d


class FastColumns:
    """Fields of the micro-batch, small, aggregate and logits records as Python lists, for the
    correlator's one-row step path (about 25 field reads per step: a dict lookup each through
    DrainIndex.col was a measurable share of it)."""

    __slots__ = (
        "agg_overlap",
        "agg_seq",
        "agg_tid",
        "lg_chunk",
        "lg_ctx",
        "lg_n_vals",
        "lg_n_vocab",
        "lg_tid",
        "s_a",
        "s_ctx",
        "s_tid",
        "s_ts",
        "ub_ctx",
        "ub_one_row",
        "ub_pos",
        "ub_rows",
        "ub_seq",
        "ub_small_at",
        "ub_tid",
        "ub_token",
        "ub_ts",
    )

    def __init__(self, idx: DrainIndex) -> None:
        # the micro-batch columns hold both its layouts, the large records' first: a record of
        # G_UBATCH_S is at ub_small_at + its row (fast_step's index)
        big, small = idx.arrays[G_UBATCH], idx.arrays[G_UBATCH_S]
        self.ub_small_at = len(big)
        one_row: list[bool] = []
        for ub in (big, small):
            # a micro-batch of one row, copied whole, that produces logits, with no flag set
            one = (ub["n_copied"] == 1) & (ub["n_tokens"] == 1) & (ub["row_offset"] == 0) & (ub["flags"] == 0)
            one_row += (one & (ub["output"][:, 0] == 1)).tolist()
        self.ub_one_row = one_row
        self.ub_tid, self.ub_ctx, self.ub_ts = (
            idx.col(G_UBATCH, f) + idx.col(G_UBATCH_S, f) for f in ("tid", "ctx", "ts_ns")
        )
        self.ub_seq, self.ub_pos, self.ub_token = (
            idx.first(G_UBATCH, f) + idx.first(G_UBATCH_S, f) for f in ("seq_id", "pos", "token")
        )
        # row 0's token, position, sequence and output flag of every micro-batch as one-element
        # arrays, made for the whole drain at once (a Step's arrays: views of these copies)
        self.ub_rows: tuple[np.ndarray, ...] = tuple(
            np.concatenate((big[f][:, :1], small[f][:, :1])) for f in ("token", "pos", "seq_id", "output")
        )
        self.s_tid, self.s_ctx, self.s_a, self.s_ts = (
            idx.col(G_SMALL, f) for f in ("tid", "ctx", "a", "ts_ns")
        )
        self.agg_tid, self.agg_overlap, self.agg_seq = (
            idx.col(G_STEP_AGG, f) for f in ("tid", "overlap", "seq")
        )
        self.lg_tid, self.lg_ctx, self.lg_chunk, self.lg_n_vals, self.lg_n_vocab = (
            idx.col(G_LOGITS, f) for f in ("tid", "ctx", "chunk", "n_vals", "n_vocab")
        )
