"""Which layers apply which attention mask, learned while both mask probes run, so that the
per-layer graph-op probes can be detached.

The engine writes each micro-batch's KQ mask once per kind of mask (full attention, sliding
window) in `llama_kv_cache::set_input_kq_mask`, and every attention layer of that kind applies
that same tensor. The probe there sees the mask but not the layers; the soft_max /
flash-attention probes see layer and mask, but cost two uprobe hits per layer and engine thread
per token (32 of the 57 hits per token of full mode on the bench model). So at attach both run;
once LEARN_PASSES consecutive forward passes gave the same layer -> call map, with every
attention layer mapped and both probes counting the same cells for every mask, the consumer
detaches the graph-op probes and files each call's counts under the layers of the map. A pass
whose counts disagree stops the learning for good: the graph-op probes then stay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparseety_prof.capture import events as ev
from sparseety_prof.correlate.attention_records import AggAttn, AttentionRecords

LEARN_PASSES = 3  # consecutive agreeing forward passes before the map is trusted


@dataclass
class AttentionMap:
    attn_layers: tuple[int, ...]
    layer_calls: dict[int, int] | None = None  # layer -> set_input_kq_mask call, once learned
    passes_seen: int = 0  # passes with masks counted at set_input_kq_mask
    disagreements: int = 0  # passes where the two counts of a mask differed (learning stops)
    learned_after: int = 0  # passes_seen when the map was learned
    detach_tried: bool = False  # the session was asked to detach the graph-op probes
    ops_detached: bool = False  # ... and none is left attached
    ops_detach_ms: float | None = None  # the wall time the session's detach took
    _candidate: dict[int, int] | None = field(default=None, repr=False)
    _agree: int = field(default=0, repr=False)
    # the learned map as the one-row methods below read it: each call with its layers (calls in
    # the order their first layer comes in layer_calls), and each attention layer's call
    _layers_of_call: tuple[tuple[int, tuple[int, ...]], ...] = field(default=(), repr=False)
    _call_of_layer: tuple[int | None, ...] = field(default=(), repr=False)

    @property
    def ready(self) -> bool:
        """The map is learned: the graph-op probes may go."""
        return self.layer_calls is not None

    @property
    def wants_ops_detached(self) -> bool:
        """Learned, and the graph-op probes not yet asked to go (asked once: a probe that would
        not detach keeps sending records that agree with the map)."""
        return self.ready and not self.detach_tried

    def ops_detach_done(self, *, none_left: bool, wall_ms: float | None = None) -> None:
        """The session detached what it could (in `wall_ms`); `none_left`: no graph-op probe
        remains."""
        self.detach_tried, self.ops_detached, self.ops_detach_ms = True, none_left, wall_ms

    def observe(self, sp: AttentionRecords) -> list[int]:
        """One finished forward pass: learn from it while learning, else give its layers the
        masks of the calls they apply. Returns the layers filled that way."""
        if not sp.kv_masks:
            return []
        self.passes_seen += 1
        if self.layer_calls is not None:
            return sp.fill_from_kv(self.layer_calls)
        if self.disagreements or not self.attn_layers:
            return []
        calls = sp.kv_layer_calls(self.attn_layers)
        agree = sp.kv_counts_agree(set(calls.values())) if calls is not None else None
        if agree is False:
            self.disagreements += 1
            return []
        if calls is None or agree is None:
            self._agree = 0
            return []
        if calls == self._candidate:
            self._agree += 1
        else:
            self._candidate, self._agree = calls, 1
        if self._agree >= LEARN_PASSES:
            self.layer_calls, self.learned_after = calls, self.passes_seen
            by_call: dict[int, list[int]] = {}
            for layer, call in calls.items():
                by_call.setdefault(call, []).append(layer)
            self._layers_of_call = tuple((call, tuple(ls)) for call, ls in by_call.items())
            self._call_of_layer = tuple(calls.get(layer) for layer in self.attn_layers)
        return []

    # ---- one-row passes once the map is learned: every decode step of a generation. Their
    # aggregate record carries the set_input_kq_mask calls only (the graph-op probes are gone).
    def attend_one_row(self, attn: AggAttn) -> tuple[list[int], list[int | None]] | None:
        """What add_agg_attn_lists, observe and attended(0, attn_layers) give for a one-row pass
        with nothing else of its attention recorded: the layers filled and the row's attended
        cells per attention layer; the pass is counted as observe counts it. No AttentionRecords
        is made (fill_state makes one, for the pass whose step is kept). None when the map is
        not learned or the record carries a graph-op node (then those take the pass)."""
        kv = self._kv(attn)
        if kv is None:
            return None
        kv_masks, _, attn_counts, filled = kv
        if not kv_masks:  # observe: a pass without masks is not counted
            return [], [None] * len(self.attn_layers)
        self.passes_seen += 1
        return filled, self._attended(kv_masks, attn_counts)

    def one_row_picks(self, attn: AggAttn) -> tuple[list[int], list[int | None], bool] | None:
        """attend_one_row as a plan, for every record with this record's masks, calls and flags
        (the steps of a generation differ only in their counts): the layers filled, for each
        attention layer the index in the record's counts of its attended cells (None: none),
        and whether the pass is counted. Nothing is counted here. None where attend_one_row
        would return None. (_kv and _attended never compare counts, only carry them: run with
        the counts' indices as counts, they give the indices.)"""
        masks, calls, counts, flags = attn
        kv = self._kv((masks, calls, list(range(len(counts))), flags))
        if kv is None:
            return None
        kv_masks, _, attn_counts, filled = kv
        if not kv_masks:
            return [], [None] * len(self.attn_layers), False
        return filled, self._attended(kv_masks, attn_counts), True

    def fill_state(self, sp: AttentionRecords, attn: AggAttn) -> bool:
        """The attention state add_agg_attn_lists and observe leave on `sp` (which holds none
        yet) for a pass attend_one_row took (and counted): False where it would return None."""
        kv = self._kv(attn)
        if kv is None or sp.kv_masks or sp.kv_counts or sp.attn_mask or sp.attn_counts:
            return False
        sp.kv_masks, sp.kv_counts, sp.attn_counts, _ = kv
        if sp.kv_masks:
            for call, layers in self._layers_of_call:
                mask = sp.kv_masks.get(call)
                if mask is not None:
                    sp.attn_mask.update(dict.fromkeys(layers, mask))
        return True

    def _kv(
        self, attn: AggAttn
    ) -> tuple[dict[int, int], dict[int, dict[int, int]], dict[int, dict[int, int]], list[int]] | None:
        """A one-row record's calls as add_agg_attn_lists files them (kv_masks, kv_counts), the
        counts fill_from_kv gives their masks (attn_counts; a mask two calls share keeps the
        first call's count of a row, as there) and the layers it fills; None when the map is not
        learned or the record carries a graph-op node."""
        if self.layer_calls is None:
            return None
        masks, calls, counts, flags = attn
        for flag in flags:
            if not flag & ev.ATT_FLAG_KV_MASK:
                return None
        kv_masks: dict[int, int] = {}
        kv_counts: dict[int, dict[int, int]] = {}
        for mask, call, count, flag in zip(masks, calls, counts, flags, strict=True):
            kv_masks[call] = mask
            if not flag & ev.ATT_FLAG_UNCOUNTED:
                kv_counts.setdefault(call, {})[0] = count
        attn_counts: dict[int, dict[int, int]] = {}
        filled: list[int] = []
        for call, layers in self._layers_of_call:
            at = kv_masks.get(call)
            if at is None:
                continue
            got = kv_counts.get(call)
            if got:
                have = attn_counts.get(at)
                if have is None:
                    attn_counts[at] = dict(got)
                else:
                    for row, att in got.items():
                        have.setdefault(row, att)
            filled.extend(layers)
        return kv_masks, kv_counts, attn_counts, filled

    def _attended(self, kv_masks: dict[int, int], attn_counts: dict[int, dict[int, int]]) -> list[int | None]:
        """attended(0, attn_layers): a layer's cells are those of its call's mask at row 0."""
        at_call = {call: attn_counts.get(mask, {}).get(0) for call, mask in kv_masks.items()}
        return [at_call.get(call) if call is not None else None for call in self._call_of_layer]

    def meta(self) -> dict[str, Any]:
        """For the recording's metadata: where the masks were read, and the map."""
        return {
            "mask_read": "set_input_kq_mask" if self.ops_detached else "graph_ops",
            "layer_calls": {str(k): v for k, v in (self.layer_calls or {}).items()},
            "passes_at_set_input": self.passes_seen,
            "learned_after_passes": self.learned_after,
            "ops_detach_ms": None if self.ops_detach_ms is None else round(self.ops_detach_ms, 1),
            "disagreements": self.disagreements,
        }
