"""`--ablate-consumer`: the probes' cost in the engine alone, on a live engine.

What the profiler costs a running engine has two parts: the probes, which run in the engine's own
threads, and the consumer (this process), which competes with them for the cores. To tell them
apart under the same load, the recorder does its start-up work as usual (the probes attached, the
first requests correlated, the attention layer map learned and the graph-op probes it makes
unnecessary detached: the probe set it would keep for the rest of a recording), then drains the
ring and discards every record: no decoding, no correlation, no rows. The engine then pays for
the probes and for the drains that keep the ring from filling, nothing else.
`scripts/bench_sustained.py --ablate-consumer` compares it with the engine alone.

The recording keeps the rows made before the ablation began; meta.json `consumer.ablated` says
when it began and what was discarded.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from sparseety_prof.capture.events import LOGITS_REF, LOGITS_REF_DTYPE


class ConsumerAblation:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._t0 = time.monotonic()
        self.began_after_s: float | None = None
        self.records = 0  # discarded
        self.bytes = 0
        self.drains = 0

    def begins(self, tokens: int, kv_mask_probe: bool, ops_detach_tried: bool) -> bool:
        """Whether discarding begins now: once the start-up work is done, tokens recorded and the
        graph-op attention probes detached where the session counts the masks elsewhere (until
        then the probes are not the set a recording keeps)."""
        if self.enabled and not self.active and tokens > 0 and (ops_detach_tried or not kv_mask_probe):
            self.began_after_s = time.monotonic() - self._t0
            return True
        return False

    @property
    def active(self) -> bool:
        """Discarding: every drain from now on."""
        return self.began_after_s is not None

    def discard(self, records: dict[int, np.ndarray], n_bytes: int) -> None:
        """One drain's records (RingReader.take's groups: {record size: their bytes}, the logits
        records taken by reference under LOGITS_REF), counted and dropped; `n_bytes`: what they
        took in the ring."""
        for size, buf in records.items():
            self.records += len(buf) // (LOGITS_REF_DTYPE.itemsize if size == LOGITS_REF else size)
        self.bytes += n_bytes
        self.drains += 1

    def meta(self) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        return {
            "began_after_s": None if self.began_after_s is None else round(self.began_after_s, 1),
            "drains": self.drains,
            "records_discarded": self.records,
            "bytes_discarded": self.bytes,
        }
