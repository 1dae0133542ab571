"""When the consumer correlates: the drains it takes, their logits rows reduced at once
(correlate/logits_reduce.py), wait here and go to the correlator together every CORRELATE_S.

The ring is drained as often as before (session/sched.py paces it to the ring's fill), and its
space goes back as soon as a drain's logits rows are reduced. The correlation, the rows and the
frames, which cost the consumer most per wake-up, run a quarter as often: each wake-up of the
consumer on cores the engine keeps busy starts from caches the engine has emptied, and the
correlation's CPU per token fell by about a quarter when it ran every 2 s instead of every 0.5 s
(`scripts/profile_consumer.py`, README "Drains reduced at once, correlated together"). Drains
wait no longer than CORRELATE_S, and never past a flush (FlushSchedule: what a flush writes is
what the drains before it held) or the end. Their records are small (about 4 KiB a token beside
the ~130 KiB of floats they no longer hold), so waiting costs little memory."""

from __future__ import annotations

import time

from sparseety_prof.capture.events import EventBatch
from sparseety_prof.correlate.logits_reduce import LogitsReducer, merge

CORRELATE_S = 2.0  # the longest a drain waits for its correlation


class DrainBatches:
    """Reduced drains waiting for the correlator. `reducer` is None without the C statistics
    backend: then each drain is correlated as it is taken (the caller checks)."""

    def __init__(self, correlate_s: float = CORRELATE_S) -> None:
        self.reducer: LogitsReducer | None = LogitsReducer() if LogitsReducer.available() else None
        self.correlate_s = correlate_s
        self._pending: list[EventBatch] = []
        self._since = time.monotonic()  # when the oldest pending drain was added
        self.correlations = 0  # batches handed to the correlator (meta.json consumer)

    def add(self, batch: EventBatch, *, final: bool = False) -> None:
        """A drain's records, its logits rows reduced here."""
        assert self.reducer is not None
        reduced = self.reducer.reduce(batch, final=final)
        if not self._pending:
            self._since = time.monotonic()
        if len(reduced) or not self._pending:
            self._pending.append(reduced)

    def due(self, now: float, *, flush_due: bool) -> bool:
        return bool(self._pending) and (flush_due or now - self._since >= self.correlate_s)

    def take(self) -> list[EventBatch]:
        """The pending drains, merged (one batch unless a layout changed size between them)."""
        pending, self._pending = self._pending, []
        out = merge(pending)
        self.correlations += len(out)
        return out
