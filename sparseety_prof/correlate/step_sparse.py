"""Sparse decisions of one forward pass, assembled from the graph-op probe records.

The probes (probes/sparse_probes.bpf.c) send, per micro-batch:
  * routing tensors per MoE layer: the selected expert ids, the gate weights as applied and
    (optionally) the router probabilities, each as raw rows of the engine's own tensor;
  * activation counts per FFN layer: exact zeros and |x| < threshold per GLU output row (per
    expert slot for MoE layers), counted in BPF by the thread that computed the row;
  * attention mask counts per layer: unmasked cells of the micro-batch's output rows.
This module turns them into per-(batch row, layer) values. A tensor's rows are the micro-batch's
rows, or only its output rows when the engine skipped the others (the last layer with
logits_all=False): anything else is counted as unmapped, never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from sparseety_prof.capture import events as ev
from sparseety_prof.capture.plans import LayerSet

_NAME_RE = re.compile(rb"^(ffn_moe_weights|ffn_moe_weighted|ffn_[a-z0-9_]+|kq_soft_max|__fattn__)-(\d+)$")
GGML_TYPE_F32 = 0
GGML_TYPE_I32 = 26
BLOCK_PAIRS = ev.BLOCK_WORDS


_PARSED: dict[bytes, tuple[str, int] | None] = {}


#: name of a set_input_kq_mask record: "kq_mask-<n>", the n-th call of the micro-batch
KV_MASK_PREFIX = b"kq_mask-"


def parse_name(raw: bytes) -> tuple[str, int] | None:
    """(node kind, layer) of a probed tensor name, e.g. b"ffn_moe_weights-3" -> ("ffn_moe_weights", 3).
    Cached: a model has a few names per layer, seen on every forward pass."""
    got = _PARSED.get(raw, False)
    if got is not False:
        return got  # type: ignore[return-value]
    m = _NAME_RE.match(raw.split(b"\0", 1)[0])
    parsed = (m.group(1).decode(), int(m.group(2))) if m else None
    if len(_PARSED) < 65536:
        _PARSED[raw] = parsed
    return parsed


_AGG_LAYOUTS: dict[LayerSet, tuple[list[int], np.ndarray, list[int], np.ndarray]] = {}


def _agg_layout(layers: LayerSet) -> tuple[list[int], np.ndarray, list[int], np.ndarray]:
    """The MoE and FFN layers an aggregate record can hold, as lists and index arrays (made
    once per layer set: indexing with a Python list converts it on every call)."""
    got = _AGG_LAYOUTS.get(layers)
    if got is None:
        moe = [layer for layer in layers.moe if layer < ev.AGG_MAX_LAYERS]
        ffn = [layer for layer in layers.ffn if layer < ev.AGG_MAX_LAYERS]
        got = _AGG_LAYOUTS[layers] = (moe, np.array(moe, dtype=np.intp), ffn, np.array(ffn, dtype=np.intp))
    return got


_ONE_FILLED = np.ones(1, dtype=bool)
_ONE_FILLED.flags.writeable = False


@dataclass
class _Rows:
    """A per-layer array being filled from record chunks: rows_total x width."""

    values: np.ndarray
    filled: np.ndarray

    @classmethod
    def new(cls, rows: int, width: int, dtype: Any, fill: Any) -> _Rows:
        return cls(np.full((rows, width), fill, dtype=dtype), np.zeros(rows, dtype=bool))


@dataclass
class Problems:
    """Inconsistencies between records and the micro-batch (counted, never guessed around)."""

    unmapped_rows: int = 0  # a tensor whose row count is neither the batch's nor its outputs'


@dataclass
class StepSparse:
    """Sparse records of one micro-batch, by layer."""

    ids: dict[int, _Rows] = field(default_factory=dict)
    weights: dict[int, _Rows] = field(default_factory=dict)
    probs: dict[int, _Rows] = field(default_factory=dict)
    # activation: node rows (token x slot) -> zeros, below; -1 = not counted
    act_zeros: dict[int, np.ndarray] = field(default_factory=dict)
    act_below: dict[int, np.ndarray] = field(default_factory=dict)
    act_width: dict[int, int] = field(default_factory=dict)  # values per node row
    act_slots: dict[int, int] = field(default_factory=dict)  # node rows per token (k for MoE)
    act_bits: dict[int, np.ndarray] = field(default_factory=dict)  # node rows x width, uint8 0/1
    # attention: layer -> mask pointer; mask pointer -> {batch row: attended}
    attn_mask: dict[int, int] = field(default_factory=dict)
    attn_counts: dict[int, dict[int, int]] = field(default_factory=dict)
    _attn_unnamed: int = 0  # unnamed attention nodes seen so far in this pass
    # masks counted where the engine wrote them (set_input_kq_mask), by call order in the
    # micro-batch: call -> mask pointer; call -> {batch row: attended}. Which layers apply which
    # call's mask is not in these records: see AttentionMap.
    kv_masks: dict[int, int] = field(default_factory=dict)
    kv_counts: dict[int, dict[int, int]] = field(default_factory=dict)
    # row 0's routing and activation values read straight off an aggregate record (one-row
    # micro-batches: see from_agg_row); None when the per-layer stores above hold them
    _agg_row: dict[str, list[Any]] | None = None
    _row_cache: dict[int, dict[str, Any]] = field(default_factory=dict)  # asked once the pass ended

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
            sp.ids[layer] = _Rows(ids[layer : layer + 1, :k], _ONE_FILLED)
        for layer, k in zip(np.flatnonzero(k_wts).tolist(), k_wts[k_wts != 0].tolist(), strict=True):
            sp.weights[layer] = _Rows(wts[layer : layer + 1, :k], _ONE_FILLED)
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
        """The same values as from_agg, as the one row's per-layer lists directly (vectorised
        over layers; from_agg builds per-layer stores, ~4x the cost per token). Returns the
        step's sparse values and the MoE and FFN layers it saw."""
        sp = cls()
        moe, moe_idx, ffn, ffn_idx = _agg_layout(layers)
        k_ids, nr = np.asarray(r["k_ids"]), np.asarray(r["act_nr"])
        kid, kwt = k_ids[moe_idx].tolist(), np.asarray(r["k_wts"])[moe_idx].tolist()
        ids_l = np.asarray(r["ids"])[moe_idx].tolist()
        wts_l = np.asarray(r["wts"])[moe_idx].view(np.float32).tolist()
        by_moe = {
            layer: (i[:a] if a else None, w[:b] if b else None)
            for layer, a, b, i, w in zip(moe, kid, kwt, ids_l, wts_l, strict=True)
        }
        # a layer counts when every row was counted and they are one token's rows (from_agg)
        rows, slots = np.asarray(r["act_rows"]), np.asarray(r["act_slots"])
        complete = (nr != 0) & (rows == nr) & (nr == np.maximum(slots, 1))
        ffn_seen = np.flatnonzero(complete).tolist()
        cols = [np.asarray(r[f])[ffn_idx].tolist() for f in ("act_nr", "act_zero", "act_below", "act_ne0")]
        ok = complete[ffn_idx].tolist()
        by_ffn: dict[int, tuple[float, float, int]] = {}
        for layer, good, n_r, zero, below, ne0 in zip(ffn, ok, *cols, strict=True):
            if good and ne0:
                n = n_r * ne0  # n_r == rows per token (k for MoE activations)
                by_ffn[layer] = (zero / n, below / n, n)
        none2 = (None, None)
        sp._agg_row = {
            "expert_ids": [by_moe.get(layer, none2)[0] for layer in layers.moe],
            "expert_weights": [by_moe.get(layer, none2)[1] for layer in layers.moe],
            "router_probs": [None] * len(layers.moe),
            "act_zero_ratio": [by_ffn[layer][0] if layer in by_ffn else None for layer in layers.ffn],
            "act_below_ratio": [by_ffn[layer][1] if layer in by_ffn else None for layer in layers.ffn],
            "act_values": [by_ffn[layer][2] if layer in by_ffn else 0 for layer in layers.ffn],
        }
        return sp, np.flatnonzero(k_ids).tolist(), ffn_seen

    @classmethod
    def from_pre(cls, pre: AggRow) -> StepSparse:
        """The step's values from agg_rows_batch (what from_agg_row computes per record)."""
        sp = cls()
        sp._agg_row = pre.values
        return sp

    @property
    def from_records(self) -> bool:
        """Routing or activation values came as per-layer records (not only attention)."""
        return bool(self.ids or self.weights or self.probs or self.act_zeros)

    def add_agg_attn(self, r: dict[str, Any], attn_layers: tuple[int, ...]) -> list[int]:
        """The attention nodes an aggregate record carries, as add_attn takes their records (the
        one row is batch row 0). Returns the layers seen."""
        n = min(int(r["att_n"]), ev.AGG_MAX_LAYERS)
        if not n:
            return []
        return self.add_agg_attn_lists(
            (
                np.asarray(r["att_mask"])[:n].tolist(),
                np.asarray(r["att_layer"])[:n].tolist(),
                np.asarray(r["att_count"])[:n].tolist(),
                np.asarray(r["att_flags"])[:n].tolist(),
            ),
            attn_layers,
        )

    def add_agg_attn_lists(self, attn: AggAttn, attn_layers: tuple[int, ...]) -> list[int]:
        """add_agg_attn on the record's attention columns as lists (mask, layer, count, flags)."""
        seen: list[int] = []
        for mask, layer, count, flag in zip(*attn, strict=True):
            if flag & ev.ATT_FLAG_KV_MASK:  # a set_input_kq_mask call (layer = its order)
                self.kv_masks[layer] = mask
                if not flag & ev.ATT_FLAG_UNCOUNTED:
                    self.kv_counts.setdefault(layer, {})[0] = count
                continue
            if layer < 0:  # unnamed: the k-th such node is the k-th attention layer (add_attn)
                if self._attn_unnamed >= len(attn_layers):
                    continue
                layer = attn_layers[self._attn_unnamed]
                self._attn_unnamed += 1
            self.attn_mask[layer] = mask
            if not flag & ev.ATT_FLAG_UNCOUNTED:
                self.attn_counts.setdefault(mask, {})[0] = count
            seen.append(layer)
        return seen

    def merge(self, other: StepSparse) -> None:
        """Take `other`'s routing and activation values (an aggregate record of the same pass)."""
        self._agg_row = other._agg_row
        self.attn_mask.update(other.attn_mask)
        for mask, counts in other.attn_counts.items():
            self.attn_counts.setdefault(mask, {}).update(counts)
        self.kv_masks.update(other.kv_masks)
        for call, counts in other.kv_counts.items():
            self.kv_counts.setdefault(call, {}).update(counts)
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
            or ne0 * 4 > stride
            or n_rows * stride > int(r["n_bytes"])
            or row0 + n_rows > rows_total
        ):
            return None
        raw = np.frombuffer(r["data"], dtype="<i4" if is_int else "<f4", count=n_rows * stride // 4)
        block = raw.reshape(n_rows, stride // 4)[:, :ne0]
        cur = store.get(layer)
        if cur is None or cur.values.shape != (rows_total, ne0):
            cur = store[layer] = _Rows.new(
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
        if slots <= 0 or nr % slots:
            return None
        z = self.act_zeros.get(layer)
        if z is None or len(z) != nr:
            z = self.act_zeros[layer] = np.full(nr, -1, dtype=np.int64)
            self.act_below[layer] = np.full(nr, -1, dtype=np.int64)
            self.act_width[layer] = ne0
            self.act_slots[layer] = slots
            if with_bits:
                self.act_bits[layer] = np.zeros((nr, ne0), dtype=np.uint8)
        ir0, n = int(r["ir0"]), int(r["n_rows"])
        n = min(n, nr - ir0, ev.ACT_MAX_ROWS)
        if n > 0:
            z[ir0 : ir0 + n] = list(r["zeros"])[:n]
            self.act_below[layer][ir0 : ir0 + n] = list(r["below"])[:n]
            if with_bits and "bits" in r:
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

    def add_attn(self, r: dict[str, Any], attn_layers: tuple[int, ...] = ()) -> tuple[str, int] | None:
        raw = bytes(r["name"])
        if int(r["aflags"]) & ev.ATT_FLAG_KV_MASK:  # "kq_mask-<n>": the n-th set_input_kq_mask call
            call = int(raw[len(KV_MASK_PREFIX) : len(KV_MASK_PREFIX) + 1])
            self.kv_masks[call] = int(r["mask"])
            n = int(r["n_counted"])
            counts = self.kv_counts.setdefault(call, {})
            for row, att in zip(list(r["row"])[:n], list(r["attended"])[:n], strict=True):
                counts[int(row)] = int(att)
            return None
        parsed = parse_name(raw)
        if parsed is None:
            # An unnamed flash-attention node (some builds name none): attention layers run in
            # order within a forward pass, so the k-th one is the model's k-th attention layer.
            if self._attn_unnamed >= len(attn_layers):
                return None
            parsed = ("__fattn__", attn_layers[self._attn_unnamed])
            self._attn_unnamed += 1
        layer = parsed[1]
        mask = int(r["mask"])
        self.attn_mask[layer] = mask
        n = int(r["n_counted"])
        if n:
            counts = self.attn_counts.setdefault(mask, {})
            for row, att in zip(list(r["row"])[:n], list(r["attended"])[:n], strict=True):
                counts[int(row)] = int(att)
        return parsed

    # ------------------------------------------------------------------ per batch row
    def _tensor_row(
        self, rows: _Rows, batch_row: int, output_index: dict[int, int], n_tokens: int
    ) -> int | None:
        """Index into a tensor's rows for a micro-batch row: the same row when the tensor has a
        row per batch row, the output ordinal when it has only the output rows."""
        total = rows.values.shape[0]
        if total == n_tokens:
            i: int | None = batch_row
        else:
            i = output_index.get(batch_row) if total == len(output_index) else None
        if i is None or not rows.filled[i]:
            return None
        return i

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
        if cached is None and self._agg_row is not None and n_tokens == 1 and not self.from_records:
            cached = self._row_cache[batch_row] = {
                **self._agg_row,
                "attn_attended": self._attended(batch_row, layers),
            }
        if cached is None:
            cached = self._row_cache[batch_row] = self._row_values(
                batch_row, output_index, n_tokens, layers, problems
            )
        return cached

    def _row_values(
        self,
        batch_row: int,
        output_index: dict[int, int],
        n_tokens: int,
        layers: LayerSet,
        problems: Problems,
    ) -> dict[str, Any]:
        """Per-layer values of one micro-batch row, as lists following `layers` (None where the
        engine did not compute that layer for this row, or the record was not captured)."""
        ids: list[list[int] | None] = []
        wts: list[list[float] | None] = []
        prb: list[list[float] | None] = []
        for layer in layers.moe:
            ids.append(self._moe_list(self.ids, layer, batch_row, output_index, n_tokens, problems, True))
            wts.append(
                self._moe_list(self.weights, layer, batch_row, output_index, n_tokens, problems, False)
            )
            prb.append(self._moe_list(self.probs, layer, batch_row, output_index, n_tokens, problems, False))
        zero: list[float | None] = []
        below: list[float | None] = []
        n_values: list[int] = []
        for layer in layers.ffn:
            zr, br, n = self.act_ratios(layer, batch_row, output_index, n_tokens, problems)
            zero.append(zr)
            below.append(br)
            n_values.append(n)
        return {
            "expert_ids": ids,
            "expert_weights": wts,
            "router_probs": prb,
            "act_zero_ratio": zero,
            "act_below_ratio": below,
            "act_values": n_values,
            "attn_attended": self._attended(batch_row, layers),
        }

    def kv_layer_calls(self, attn_layers: tuple[int, ...]) -> dict[int, int] | None:
        """Which set_input_kq_mask call's mask each attention layer applied in this pass (a
        layer's graph-op record names its mask pointer, one call's), or None when some layer
        has no record or its mask is none of the calls'."""
        call_of = {mask: call for call, mask in self.kv_masks.items()}
        out: dict[int, int] = {}
        for layer in attn_layers:
            mask = self.attn_mask.get(layer)
            call = call_of.get(mask) if mask is not None else None
            if call is None:
                return None
            out[layer] = call
        return out

    def kv_counts_agree(self, calls: set[int]) -> bool | None:
        """Whether the two counts of each call's mask are equal: the graph-op probe's (the first
        layer applying the mask counts it) and the one where the engine wrote it. None when
        either is missing."""
        for call in calls:
            by_op, at_write = self.attn_counts.get(self.kv_masks[call]), self.kv_counts.get(call)
            if not by_op or not at_write:
                return None
            if by_op != at_write:
                return False
        return True

    def fill_from_kv(self, layer_calls: dict[int, int]) -> list[int]:
        """Layers with no graph-op record in this pass get the mask of the call they apply
        (layer_calls, learned by AttentionMap); never a layer whose call did not happen.
        Returns the layers filled."""
        filled = []
        done: set[int] = set()  # calls whose counts are filed (one per kind of mask, many layers)
        for layer, call in layer_calls.items():
            mask = self.kv_masks.get(call)
            if mask is None or layer in self.attn_mask:
                continue
            self.attn_mask[layer] = mask
            if call not in done:
                done.add(call)
                kv = self.kv_counts.get(call)
                if kv:
                    counts = self.attn_counts.get(mask)
                    if counts is None:
                        self.attn_counts[mask] = dict(kv)
                    else:
                        for row, att in kv.items():
                            counts.setdefault(row, att)
            filled.append(layer)
        return filled

    def _attended(self, batch_row: int, layers: LayerSet) -> list[int | None]:
        att: list[int | None] = []
        for layer in layers.attn:
            mask = self.attn_mask.get(layer)
            att.append(None if mask is None else self.attn_counts.get(mask, {}).get(batch_row))
        return att

    def _moe_list(
        self,
        store: dict[int, _Rows],
        layer: int,
        batch_row: int,
        output_index: dict[int, int],
        n_tokens: int,
        problems: Problems,
        as_int: bool,
    ) -> Any:
        rows = store.get(layer)
        if rows is None:
            return None
        total = rows.values.shape[0]
        if total != n_tokens and total != len(output_index):
            problems.unmapped_rows += 1
            return None
        i = self._tensor_row(rows, batch_row, output_index, n_tokens)
        if i is None:
            return None
        return rows.values[i].tolist()

    def act_ratios(
        self, layer: int, batch_row: int, output_index: dict[int, int], n_tokens: int, problems: Problems
    ) -> tuple[float | None, float | None, int]:
        z = self.act_zeros.get(layer)
        if z is None:
            return None, None, 0
        slots, width = self.act_slots[layer], self.act_width[layer]
        tokens = len(z) // slots
        if tokens == n_tokens:
            t: int | None = batch_row
        elif tokens == len(output_index):
            t = output_index.get(batch_row)
        else:
            problems.unmapped_rows += 1
            return None, None, 0
        if t is None:
            return None, None, 0
        # plain Python on a handful of values: numpy's per-call cost is ~10x here
        zs = z[t * slots : (t + 1) * slots].tolist()
        bs = self.act_below[layer][t * slots : (t + 1) * slots].tolist()
        if min(zs) < 0 or min(bs) < 0:
            return None, None, 0
        n = slots * width
        return sum(zs) / n, sum(bs) / n, n

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


#: an aggregate record's attention columns, as lists over its att_n nodes: mask pointers, layers
#: (-1: unnamed), counts, flags
AggAttn = tuple[list[int], list[int], list[int], list[int]]


class AggRow(NamedTuple):
    """What the consumer needs of one aggregate record: the row's per-layer values (as
    StepSparse.from_agg_row makes them), the MoE and FFN layers it saw, its attention columns.
    A named tuple: one is made per token, and a frozen dataclass costs several times more to make."""

    values: dict[str, list[Any]]
    moe_seen: list[int]
    ffn_seen: list[int]
    attn: AggAttn


def agg_rows_batch(arr: np.ndarray, layers: LayerSet) -> list[AggRow] | None:
    """from_agg_row and the attention columns for every aggregate record of a drain at once:
    numpy over the [records, layers] arrays and one tolist per column, instead of ~15 numpy
    calls per record (the largest per-token cost of full mode's consumer). Rows whose layers are
    not all complete take from_agg_row; None when the model has layers beyond what
    the record holds (then from_agg_row does it all)."""
    moe, moe_idx, ffn, ffn_idx = _agg_layout(layers)
    if len(moe) != len(layers.moe) or len(ffn) != len(layers.ffn) or not len(arr):
        return None
    k_ids = arr["k_ids"]
    kid = k_ids[:, moe_idx]
    kwt = arr["k_wts"][:, moe_idx]
    k = int(kid.max(initial=0))
    ids_all = arr["ids"][:, moe_idx, :k].tolist()
    wts_all = arr["wts"][:, moe_idx, :k].view(np.float32).tolist()
    # the common row: every MoE layer (and no other) with k ids and k weights, every FFN layer
    # (and no other) with all its rows counted; any other row takes from_agg_row
    moe_full = ((kid == k) & (kwt == k)).all(axis=1) & (k > 0 or not moe)
    moe_full &= (k_ids != 0).sum(axis=1) == len(moe)
    nr, rows, slots = arr["act_nr"], arr["act_rows"], arr["act_slots"]
    complete = (nr != 0) & (rows == nr) & (nr == np.maximum(slots, 1))
    ne0 = arr["act_ne0"]
    ffn_full = (complete[:, ffn_idx] & (ne0[:, ffn_idx] != 0)).all(axis=1) & (
        complete.sum(axis=1) == len(ffn)
    )
    n_vals = nr[:, ffn_idx].astype(np.int64) * ne0[:, ffn_idx]
    with np.errstate(divide="ignore", invalid="ignore"):
        zr_all = (arr["act_zero"][:, ffn_idx] / n_vals).tolist()
        br_all = (arr["act_below"][:, ffn_idx] / n_vals).tolist()
    nv_all = n_vals.tolist()
    att_n = np.minimum(arr["att_n"], ev.AGG_MAX_LAYERS).tolist()
    width = max(att_n, default=0)
    c_mask, c_layer, c_count, c_flags = (
        arr[f][:, :width].tolist() for f in ("att_mask", "att_layer", "att_count", "att_flags")
    )
    none_moe = [None] * len(layers.moe)
    out: list[AggRow] = []
    for i, (full, n_att) in enumerate(zip((moe_full & ffn_full).tolist(), att_n, strict=True)):
        if full:
            moe_seen, ffn_seen = moe, ffn
            values = {
                "expert_ids": ids_all[i],
                "expert_weights": wts_all[i],
                "router_probs": none_moe,
                "act_zero_ratio": zr_all[i],
                "act_below_ratio": br_all[i],
                "act_values": nv_all[i],
            }
        else:
            sp, moe_seen, ffn_seen = StepSparse.from_agg_row({f: arr[f][i] for f in _AGG_ROW_FIELDS}, layers)
            assert sp._agg_row is not None
            values = sp._agg_row
        attn = (c_mask[i][:n_att], c_layer[i][:n_att], c_count[i][:n_att], c_flags[i][:n_att])
        out.append(AggRow(values, moe_seen, ffn_seen, attn))
    return out


_AGG_ROW_FIELDS = (
    "k_ids",
    "k_wts",
    "ids",
    "wts",
    "act_nr",
    "act_rows",
    "act_slots",
    "act_zero",
    "act_below",
    "act_ne0",
)
