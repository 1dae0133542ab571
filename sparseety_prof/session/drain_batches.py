"""`--correlate-every SECONDS`: the drains the consumer takes, their logits rows reduced at
once (correlate/logits_reduce.py), wait here and go to the correlator together.

The ring is drained as often as without it (session/sched.py paces it to the ring's fill), and
its space goes back as soon as a drain's logits rows are reduced. The correlation, the rows and
the frames run less often, each on more drains: each wake-up of the consumer starts from caches
the engine has emptied. With a core of its own (`scripts/profile_consumer.py`, one engine thread
on two cores) that cut the recorder's CPU per token by a sixth; with both cores kept busy by the
engine (`scripts/bench_sustained.py`) it cost more, so it is not the default (docs/overhead.md,
"Logits rows reduced as they are drained"). Drains wait no longer than SECONDS, not at all while
the consumer is behind, and never past a flush (FlushSchedule: what a flush writes is what the
drains before it held) or the end. Their records are small (about 4 KiB a token beside the
~130 KiB of floats they no longer hold), so waiting costs little memory."""

from __future__ import annotations

import time

import numpy as np

from sparseety_prof.capture.events import EventBatch
from sparseety_prof.capture.logits_rows import LogitsStats
from sparseety_prof.correlate.logits_reduce import GROUPS, UNPAIRED, LogitsReducer

# `--correlate-every`'s suggested value (scripts/replay_drains.py replays it by default): the
# drains of 1 s together. Correlating every 2 s cut the most CPU per token with an idle core for
# the consumer, but with both cores kept busy by the engine the consumer, at nice 10, took long
# enough over 2 s of drains for the ring to fill further behind it than correlating every drain
# (docs/overhead.md).
CORRELATE_S = 1.0


class DrainBatches:
    """Reduced drains waiting for the correlator (only with the C statistics backend: available()).

    A drain's records are copied once, into buffers kept from one correlation to the next (a
    fresh array per drain and layout, then one more copy to put the drains together, cost
    several microseconds per token in page faults and copies). What take() returns is valid
    until the next add(), as a drain's records were until the next take."""

    def __init__(self, correlate_s: float = CORRELATE_S) -> None:
        self.reducer = LogitsReducer()
        self.correlate_s = correlate_s
        self._buf: dict[str, np.ndarray] = {}  # per layout: records gathered (the first _used)
        self._used: dict[str, int] = {}
        self._refs: list[np.ndarray] = []  # the reduced logits records, `at` made global
        self._stats: list[LogitsStats] = []
        self._n_stats = 0
        self._chunk = 0
        self._sealed: list[EventBatch] = []  # batches of an earlier layout, copied
        self._taken = True  # take() returned the gathered records: the next add starts over
        self._since = time.monotonic()  # when the oldest waiting drain came
        self.correlations = 0  # batches handed to the correlator (meta.json consumer)

    @staticmethod
    def available() -> bool:
        return LogitsReducer.available()

    def add(self, batch: EventBatch, *, final: bool = False) -> None:
        """A drain's records, its logits rows reduced here."""
        reduced = self.reducer.reduce(batch, final=final)
        if self._taken:
            self._restart()
        elif not self._fits(reduced):
            self._sealed.append(self._gathered(copy=True))
            self._restart()
        self._chunk = reduced.logits_chunk
        for name in GROUPS:
            self._append(name, getattr(reduced, name))
        refs = reduced.logits
        if len(refs):
            refs = refs.copy()
            paired = refs["at"] != UNPAIRED
            refs["at"][paired] += np.uint64(self._n_stats)
            self._refs.append(refs)
        if reduced.logits_stats is not None and len(reduced.logits_stats):
            self._stats.append(reduced.logits_stats)
            self._n_stats += len(reduced.logits_stats)

    def due(self, now: float, *, flush_due: bool, behind: bool = False) -> bool:
        """Whether the waiting drains go to the correlator now: CORRELATE_S after the oldest,
        before a flush, or at once when the consumer is `behind` (its drain found more of the
        ring filled than the pace aims for, or it runs escalated): a correlation is the
        longest stretch without a drain, so it is kept short then."""
        return not self._taken and (flush_due or behind or now - self._since >= self.correlate_s)

    def take(self) -> list[EventBatch]:
        """The drains added since the last take, as one batch (more when a layout changed size
        between them: a step aggregate record sized for another model)."""
        if self._taken:
            return []
        out = [*self._sealed, self._gathered(copy=False)]
        self._sealed = []
        self._taken = True
        self.correlations += len(out)
        return out

    def _restart(self) -> None:
        self._used = dict.fromkeys(self._buf, 0)
        self._refs, self._stats, self._n_stats = [], [], 0
        self._taken = False
        self._since = time.monotonic()

    def _fits(self, b: EventBatch) -> bool:
        """Whether `b`'s records can join those gathered (each layout of one size)."""
        if b.logits_chunk != self._chunk:
            return False
        for name in GROUPS:
            recs = getattr(b, name)
            if len(recs) and self._used.get(name) and self._buf[name].dtype != recs.dtype:
                return False
        return True

    def _append(self, name: str, recs: np.ndarray) -> None:
        if not len(recs):
            return
        buf, used = self._buf.get(name), self._used.get(name, 0)
        if buf is None or buf.dtype != recs.dtype:  # (nothing of another size gathered: _fits)
            buf, used = np.empty(max(len(recs), 64), dtype=recs.dtype), 0
            self._buf[name] = buf
        if used + len(recs) > len(buf):
            grown = np.empty(max(2 * len(buf), used + len(recs)), dtype=buf.dtype)
            grown[:used] = buf[:used]
            buf = self._buf[name] = grown
        buf[used : used + len(recs)] = recs
        self._used[name] = used + len(recs)

    def _gathered(self, *, copy: bool) -> EventBatch:
        out = EventBatch(logits_chunk=self._chunk or 1024)
        for name in GROUPS:
            buf = self._buf.get(name)
            if buf is not None:
                view = buf[: self._used.get(name, 0)]
                setattr(out, name, view.copy() if copy else view)
        if self._refs:
            out.logits = np.concatenate(self._refs) if len(self._refs) > 1 else self._refs[0]
        out.logits_stats = LogitsStats.concat(self._stats)
        return out
