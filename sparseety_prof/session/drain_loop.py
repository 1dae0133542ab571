"""The consumer's drains: the ring read at its pace, each drain's records decoded and handed to the
recorder as batches for the correlator, and after each drain the rows made durable and flushed on
schedule (session/row_outlet.py).

How a drain becomes batches is chosen once, when the loop opens:

- each drain is one batch, correlated as taken; its logits rows are read where they lie in the
  ring, whose space goes back once the batch is consumed;
- with `--correlate-every`, drains are reduced as taken (their logits rows to statistics) and
  correlated together when due (session/drain_batches.py);
- under `--ablate-consumer`, once its start-up work is done, drains are taken and dropped
  (session/ablation.py): no batch at all.

The loop knows nothing of the correlator or the rows: `batches()` yields, the recorder consumes.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from sparseety_prof.capture.bpf_loader import RingReader, Session
from sparseety_prof.capture.events import EventBatch, SeqTracker, decode_groups
from sparseety_prof.session.ablation import ConsumerAblation
from sparseety_prof.session.drain_batches import DrainBatches
from sparseety_prof.session.memory_budget import MemoryBudget
from sparseety_prof.session.options import Options, Progress
from sparseety_prof.session.ring_watch import NativeRingWatch, RingWatch
from sparseety_prof.session.row_outlet import RowOutlet
from sparseety_prof.session.sched import ConsumerSched
from sparseety_prof.session.stage_cpu import StageCpu
from sparseety_prof.store.buffers import FlushSchedule


@dataclass
class DrainLoop:
    """The ring reader and what paces it, for one run: the drain pace and priority (sched.py),
    the flush schedule, the memory budget, the ring watch, --ablate-consumer, the drains kept
    for --correlate-every (None: each correlated as taken), the sequence numbers."""

    sess: Session
    reader: RingReader
    sched: ConsumerSched
    flush: FlushSchedule
    budget: MemoryBudget
    watch: RingWatch | NativeRingWatch
    ablation: ConsumerAblation
    batched: DrainBatches | None
    tracker: SeqTracker
    stages: StageCpu
    progress: Progress

    @classmethod
    def open(cls, opts: Options, sess: Session, progress: Progress, stages: StageCpu) -> DrainLoop:
        reader = RingReader(sess)
        sched = ConsumerSched(opts, progress, mirror_threads=True)
        return cls(
            sess=sess,
            reader=reader,
            sched=sched,
            flush=FlushSchedule(opts.flush_s),
            budget=MemoryBudget(opts.max_memory),
            watch=sched.watch(
                reader.pending_share, reader.wake_fd, reader.arm_watch, reader.positions(), owner=reader
            ),
            ablation=ConsumerAblation(opts.ablate_consumer),
            batched=(
                DrainBatches(opts.correlate_every)
                if opts.correlate_every and DrainBatches.available()
                else None
            ),
            tracker=SeqTracker(),
            stages=stages,
            progress=progress,
        )

    def batches(
        self,
        out: RowOutlet,
        *,
        stopped: Callable[[], bool],
        stop: Callable[[str], None],
        wait: Callable[[float], object],
        after_drain: Callable[[float], None],
    ) -> Iterator[EventBatch]:
        """The batches of drain after drain until `stopped()`: between drains a flush's pieces
        (`out.flush_pieces`) and the pause (`wait(seconds)`); after each drain's batches are
        consumed, its rows made durable and flushed on schedule, the memory budget kept, then
        `after_drain(time the drain was taken)`. A recording that cannot be written asks
        `stop("write error")`."""
        t_prev = time.monotonic()
        while not stopped():
            # the pieces of a flush under way until the next drain is due; the pace is counted from
            # the last drain: the work since (its correlation, a flush's pieces that waited for the
            # CPU at nice 10) is part of the wait, not added to it
            sched = self.sched
            out.flush_pieces(sched, until=t_prev + sched.wait_s, stopped=stopped)
            if out.write_failed:
                stop("write error")
            wait(self.flush.wait_s(max(0.0, sched.wait_s - (time.monotonic() - t_prev))))
            self.stages.lap("loop")
            records = self.reader.take(sched.on_backlog)
            self.stages.lap("ring_walk")
            now = time.monotonic()
            filled = self.reader.last_take_bytes / (self.sess.ring_pages * mmap.PAGESIZE)
            sched.after_drain(filled, (now - t_prev) * 1e3)
            yield from self._drained(records, now, filled)
            self.watch.rearm()
            out.keep_durable(self.flush, now, in_pieces=True)  # (its pieces: flush_pieces)
            if out.write_failed:
                stop("write error")
            out.relieve_memory(self.budget, self.progress.anon_bytes, now, sched)  # (read by this drain)
            self.stages.lap("flush")
            after_drain(now)
            t_prev = now

    def _drained(self, records: dict[int, np.ndarray], now: float, filled: float) -> Iterator[EventBatch]:
        """One drain's records as the batches to correlate now, as this loop takes them."""
        if self.ablation.active:  # --ablate-consumer: drained and dropped (logits: their rows reduced first)
            if self.ablation.decodes:
                self.ablation.reduce(self.decode(records, ring_data=self.reader.data))
                self.stages.lap("logits")
            self.ablation.discard(records, self.reader.last_take_bytes)
            self.reader.release()
        elif self.batched is None:
            yield self.decode(records, ring_data=self.reader.data)
            self.reader.release()  # the logits rows read where they lay: their space goes back now
        else:
            self.batched.add(self.decode(records, ring_data=self.reader.data))  # logits reduced
            self.stages.lap("logits")
            self.reader.release()
            behind = filled > ConsumerSched.PACE_FILL or self.sched.escalated
            if self.batched.due(now, flush_due=self.flush.is_due(now), behind=behind):
                yield from self.batched.take()

    def waiting(self) -> list[EventBatch]:
        """The drains --correlate-every still holds, as batches (none otherwise)."""
        return self.batched.take() if self.batched is not None else []

    def close(self) -> dict[int, np.ndarray]:
        """The watch closed and the ring's last records taken (the probes still in: the recorder
        reads their counters and detaches them next)."""
        self.watch.close()
        self.stages.lap("loop")
        rest = self.reader.stop()
        self.stages.lap("ring_walk")
        return rest

    def rest(self, rest: dict[int, np.ndarray], error: BaseException | None) -> list[EventBatch]:
        """The batches of the records left once the probes are gone (the last one final); after
        an error, none: only their sequence numbers counted. Ablated, one empty batch, so that
        the open requests end."""
        if error is not None:
            self.tracker.update(decode_groups(rest, self.sess.logits_chunk).seqs(), final=True)
            return []
        if self.ablation.active:  # the last records dropped too
            if self.ablation.decodes:
                self.ablation.reduce(self.decode(rest, final=True), final=True)
                self.stages.lap("logits")
            self.ablation.discard(rest, 0)
            return [EventBatch(logits_chunk=self.sess.logits_chunk)]
        batch = self.decode(rest, final=True)
        if self.batched is None:
            return [batch]
        self.batched.add(batch, final=True)
        self.stages.lap("logits")
        return self.batched.take()

    def decode(
        self, records: dict[int, np.ndarray], *, ring_data: np.ndarray | None = None, final: bool = False
    ) -> EventBatch:
        """One drain's records, by layout; their sequence numbers counted (losses). Logits
        records taken by reference are read in `ring_data` (the ring's memory), until the caller
        hands their space back."""
        batch = decode_groups(records, self.sess.logits_chunk, ring_data)
        self.tracker.update(batch.seqs(), final=final)
        self.stages.lap("decode")
        return batch
