"""Attention records of one forward pass: which mask each attention layer applied, and how many
cells of it each batch row attends.

Two probes report them: the graph-op probes (soft_max / flash attention, per layer: the layer and
its mask) and the one where the engine writes each kind of mask once per pass
(set_input_kq_mask: the mask, by call order, but not the layers). AttentionMap learns which call
each layer applies, so that the graph-op probes can go.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sparseety_prof.capture import events as ev
from sparseety_prof.correlate.node_names import parse_name

#: name of a set_input_kq_mask record: "kq_mask-<n>", the n-th call of the micro-batch
KV_MASK_PREFIX = b"kq_mask-"

#: an aggregate record's attention columns, as lists over its att_n nodes: mask pointers, layers
#: (-1: unnamed), counts, flags
AggAttn = tuple[list[int], list[int], list[int], list[int]]


@dataclass
class AttentionRecords:
    # layer -> mask pointer; mask pointer -> {batch row: attended}
    attn_mask: dict[int, int] = field(default_factory=dict)
    attn_counts: dict[int, dict[int, int]] = field(default_factory=dict)
    _attn_unnamed: int = 0  # unnamed attention nodes seen so far in this pass
    # masks counted where the engine wrote them, by call order in the micro-batch: call -> mask
    # pointer; call -> {batch row: attended}
    kv_masks: dict[int, int] = field(default_factory=dict)
    kv_counts: dict[int, dict[int, int]] = field(default_factory=dict)

    def add_attn(self, r: dict[str, Any], attn_layers: tuple[int, ...] = ()) -> tuple[str, int] | None:
        """A graph-op or set_input_kq_mask record. Returns the graph node's (kind, layer)."""
        raw = bytes(r["name"])
        if int(r["aflags"]) & ev.ATT_FLAG_KV_MASK:  # "kq_mask-<n>": the n-th set_input_kq_mask call
            digit = raw[len(KV_MASK_PREFIX) : len(KV_MASK_PREFIX) + 1]
            if not raw.startswith(KV_MASK_PREFIX) or not digit.isdigit():
                return None  # not the probe's own name: nothing to attribute it to
            call = int(digit)
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

    def add_agg_attn(self, r: dict[str, Any], attn_layers: tuple[int, ...]) -> list[int]:
        """The attention nodes an aggregate record carries, as add_attn takes their records (the
        one row is batch row 0). Returns the layers seen."""
        n = min(int(r["att_n"]), len(r["att_mask"]))
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

    def merge_attention(self, other: AttentionRecords) -> None:
        self.attn_mask.update(other.attn_mask)
        for mask, counts in other.attn_counts.items():
            self.attn_counts.setdefault(mask, {}).update(counts)
        self.kv_masks.update(other.kv_masks)
        for call, counts in other.kv_counts.items():
            self.kv_counts.setdefault(call, {}).update(counts)

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

    def attended(self, batch_row: int, attn_layers: tuple[int, ...]) -> list[int | None]:
        """Per attention layer: the cells batch row attends (None when not counted)."""
        att: list[int | None] = []
        for layer in attn_layers:
            mask = self.attn_mask.get(layer)
            att.append(None if mask is None else self.attn_counts.get(mask, {}).get(batch_row))
        return att
