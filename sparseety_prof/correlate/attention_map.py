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

from sparseety_prof.correlate.attention_records import AttentionRecords

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
    _candidate: dict[int, int] | None = field(default=None, repr=False)
    _agree: int = field(default=0, repr=False)

    @property
    def ready(self) -> bool:
        """The map is learned: the graph-op probes may go."""
        return self.layer_calls is not None

    @property
    def wants_ops_detached(self) -> bool:
        """Learned, and the graph-op probes not yet asked to go (asked once: a probe that would
        not detach keeps sending records that agree with the map)."""
        return self.ready and not self.detach_tried

    def ops_detach_done(self, *, none_left: bool) -> None:
        """The session detached what it could; `none_left`: no graph-op probe remains."""
        self.detach_tried, self.ops_detached = True, none_left

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
        return []

    def meta(self) -> dict[str, Any]:
        """For the recording's metadata: where the masks were read, and the map."""
        return {
            "mask_read": "set_input_kq_mask" if self.ops_detached else "graph_ops",
            "layer_calls": {str(k): v for k, v in (self.layer_calls or {}).items()},
            "passes_at_set_input": self.passes_seen,
            "learned_after_passes": self.learned_after,
            "disagreements": self.disagreements,
        }
