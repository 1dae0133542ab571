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

from .events import EventBatch

# layouts in EventBatch.groups() order
G_SMALL, G_UBATCH, G_LOGITS, G_TENSOR_S, G_TENSOR_L, G_ACT, G_ACT_MASK, G_ATTN, G_STEP_AGG, G_HTTP = range(10)
_WHOLE_ROW = (G_SMALL, G_TENSOR_S, G_TENSOR_L, G_ACT, G_ACT_MASK, G_ATTN)  # all fields become values
_ARRAY_VIEWS = (G_UBATCH, G_LOGITS, G_STEP_AGG)  # array fields stay views into the drained records


class DrainIndex:
    """kinds[i], group[i], row[i]: the i-th record in sequence-number order, its layout and its
    index in that layout's array."""

    __slots__ = ("_cols", "_rows", "arrays", "group", "kinds", "row")

    def __init__(self, batch: EventBatch) -> None:
        self.arrays = batch.groups()
        present = [(g, a) for g, a in enumerate(self.arrays) if len(a)]
        self._rows: dict[int, list[tuple[Any, ...]]] = {}
        self._cols: dict[tuple[int, str], list[Any]] = {}
        if not present:
            self.kinds: list[int] = []
            self.group: list[int] = []
            self.row: list[int] = []
            return
        seq = np.concatenate([a["seq"] for _, a in present])
        order = np.argsort(seq, kind="stable")
        self.kinds = np.concatenate([a["kind"] for _, a in present])[order].tolist()
        self.group = np.concatenate([np.full(len(a), g, dtype=np.int8) for g, a in present])[order].tolist()
        self.row = np.concatenate([np.arange(len(a)) for _, a in present])[order].tolist()

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
                "data": bytes(h["data"])[: int(h["n_copied"])],
            }
        dt = arr.dtype
        d: dict[str, Any] = {}
        for n in names:
            d[n] = arr[n][r] if dt[n].shape else self.col(g, n)[r]
        return d
