"""`--ablate-consumer`: the probes' cost in the engine alone, on a live engine.

What the profiler costs a running engine has two parts: the probes, which run in the engine's own
threads, and the consumer (this process), which competes with them for the cores. To tell them
apart under the same load, the recorder does its start-up work as usual (the probes attached, the
first requests correlated, the attention layer map learned and the graph-op probes it makes
unnecessary detached: the probe set it would keep for the rest of a recording), then drains the
ring and discards every record: no decoding, no correlation, no rows. The engine then pays for
the probes and for the drains that keep the ring from filling, nothing else.
`scripts/bench_sustained.py --ablate-consumer` compares it with the engine alone.

`--ablate-consumer logits` keeps one more piece of work: each drain's records are decoded (their
sequence numbers counted, so losses still show) and its logits rows reduced to their statistics
(correlate/logits_reduce.py, the C backend the recorder uses), then discarded. That is what any
consumer recording full mode's log-probs must do whatever the rest of it costs (the rows are
~130 KiB a token at a 32,000-entry vocabulary, and read once, from the ring): its CPU per token
is a floor under the full recorder's on the same load, and tells what a faster correlation, rows
and writes could at best reach (docs/overhead.md, "The floor under full mode").

The recording keeps the rows made before the ablation began; meta.json `consumer.ablated` says
when it began, what it kept doing and what was discarded.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from sparseety_prof.capture.events import LOGITS_REF, LOGITS_REF_DTYPE, EventBatch
from sparseety_prof.correlate.logits_reduce import LogitsReducer
from sparseety_prof.session.options import ABLATION_KINDS


class ConsumerAblation:
    def __init__(self, kind: str) -> None:
        """`kind`: "" (no ablation) or one of ABLATION_KINDS."""
        if kind and kind not in ABLATION_KINDS:
            raise ValueError(f"--ablate-consumer: {kind!r} is not one of {', '.join(ABLATION_KINDS)}")
        self.kind = kind
        self._t0 = time.monotonic()
        self.began_after_s: float | None = None
        self.records = 0  # discarded
        self.records_untracked = 0  # of them, never decoded (their sequence numbers not counted)
        self.bytes = 0
        self.drains = 0
        # "logits": each drain's logits rows reduced before the discard (None: not asked)
        self.reducer = LogitsReducer() if kind == "logits" else None
        self.rows_reduced = 0

    @staticmethod
    def check(kind: str) -> str | None:
        """Why `kind` cannot run here (None: it can): "logits" measures the C statistics backend."""
        if kind == "logits" and not LogitsReducer.available():
            return (
                "--ablate-consumer logits needs the logits statistics' C backend "
                "(sparseety_prof/native/build.sh), which is not built or not loadable here"
            )
        return None

    @property
    def enabled(self) -> bool:
        return bool(self.kind)

    @property
    def decodes(self) -> bool:
        """Whether the drains are decoded (and their sequence numbers counted) before the discard."""
        return self.reducer is not None

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
        ref = LOGITS_REF_DTYPE.itemsize
        n = sum(len(b) // (ref if size == LOGITS_REF else size) for size, b in records.items())
        self.records += n
        if not self.decodes:
            self.records_untracked += n
        self.bytes += n_bytes
        self.drains += 1

    def reduce(self, batch: EventBatch, *, final: bool = False) -> None:
        """`--ablate-consumer logits`: a decoded drain's logits rows reduced to their statistics,
        which are then dropped with the rest (the rows counted)."""
        assert self.reducer is not None
        out = self.reducer.reduce(batch, final=final)
        if out.logits_stats is not None:
            self.rows_reduced += len(out.logits_stats)

    def meta(self) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        return {
            "kind": self.kind,
            "began_after_s": None if self.began_after_s is None else round(self.began_after_s, 1),
            "drains": self.drains,
            "logits_rows_reduced": self.rows_reduced,
            "records_discarded": self.records,
            "bytes_discarded": self.bytes,
        }
