"""Where the consumer's CPU comes from while it records."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from sparseety_prof.capture.bpf_loader import RING_WAKE_FILL
from sparseety_prof.session.options import Options, Progress
from sparseety_prof.session.ring_watch import NativeRingWatch, RingWatch, native_available
from sparseety_prof.session.sched_slice import set_thread_slice, thread_slice_us
from sparseety_prof.session.thread_priority import mirror_priority


class ConsumerSched:
    """Where the consumer's CPU comes from, and when it drains. It runs at a low priority
    (`--nice`, default 10), or with `--sched idle` as SCHED_IDLE (only CPU the engine leaves idle),
    so that the engine's threads win contention. It drains every `--drain-interval` s (`drain_s`),
    or sooner when the ring fills fast (PACE_FILL). A low priority can starve it while the engine
    keeps every core busy
    (meta.json shows the longest gap between drains, `drain_gap_max_ms`): when a drain finds more of
    the ring filled than the pace allows for (ESCALATE_FILL), the consumer did not get the CPU to
    keep up, and it takes the engine's own priority (nice 0, SCHED_OTHER; a negative `--nice` is
    kept) until drains have found less than RELAX_FILL of it filled for RELAX_HOLD_S: losing
    records is worse than taking a few percent of the engine's time, and a consumer that relaxed
    at once would fall behind again.
    It escalates the same way when records have waited while no drain came for `max_drain_gap` s
    (the ring watch checks: ring_watch.py), so that a consumer under --sched idle on busy cores
    still drains that often, not only when the ring fills.
    Escalations are counted in meta.json ("consumer"). With `--slice-us`, it asks for that CPU slice
    while it runs as SCHED_OTHER (sched_slice.py). With `mirror_threads` (the recorder), each change
    of the consumer's priority is given to every other thread of the process but the ring watch's:
    Polars' threads run the consumer's frames and writes (thread_priority.py)."""

    # Pace: at the rate the last drain saw, the next one should find at most this share of the
    # ring filled, so a burst has room before the escalation and before any loss. At ordinary
    # rates (a 32k vocabulary, a few hundred tokens a second) that is more than
    # `drain_s` away; a small model at thousands of tokens/s fills the ring in about a second.
    PACE_FILL = 0.25
    MIN_WAIT_S = 0.02
    # On a small MoE at thousands of tokens a second on saturated cores, a consumer at nice 10
    # gets less of a core than it needs (docs/overhead.md), so the drain that first finds half the
    # ring filled (the threshold this was) takes longer, at that priority, than the rest of the
    # ring lasts.
    # (the producers wake the ring watch at the same share: RING_WAKE_FILL)
    ESCALATE_FILL = RING_WAKE_FILL
    # Relaxing: drains that find less than the pace aims for are keeping up. A fixed tenth of the
    # ring (what this was) is more than a 32k-vocabulary model fills at its ordinary rate between
    # two drains 0.5 s apart: a consumer escalated once then kept nice 0 for the rest of the run.
    RELAX_FILL = 0.2
    RELAX_HOLD_S = 1.0

    def __init__(self, opts: Options, progress: Progress, *, mirror_threads: bool = False) -> None:
        self.progress = progress
        self.drain_s = opts.drain_interval  # the longest pause (--drain-interval)
        self.wait_s = self.drain_s  # before the next drain (after_drain sets it)
        self.started = time.monotonic()
        self.wait_min_s = self.drain_s
        self.mode = opts.sched
        self.max_gap_s = opts.max_drain_gap
        self._gap_escalations = 0  # by the Python watch's drain check (on_gap)
        self.nice = opts.nice
        self.tid = threading.get_native_id()
        self.escalated = False
        self._calm_since: float | None = None  # escalated: since when drains found the ring calm
        # the ring watch's thread escalates too: one change of priority at a time (never taken in a
        # signal handler)
        self._lock = threading.Lock()
        # the watch in C (watch()), and how many escalations of its after_drain has seen
        self._native: NativeRingWatch | None = None
        self._native_seen = 0
        self._watch_kind: str | None = None  # "native" or "python" once watch() made it
        self.slice_us = opts.slice_us
        self.slice_set = False
        self._mirror_threads = mirror_threads
        self._watch_tid: int | None = None  # left at the engine's priority by _mirror
        if self.mode == "idle":
            self._policy(os.SCHED_IDLE)
        else:
            self._apply_slice()
        self._mirror()

    def _mirror(self) -> None:
        """The consumer's policy and niceness to the recorder's other threads, but the watch's."""
        if self._mirror_threads:
            mirror_priority(self.tid, () if self._watch_tid is None else (self._watch_tid,))

    def _apply_slice(self) -> None:
        if self.slice_us:
            self.slice_set = set_thread_slice(self.tid, self.slice_us) or self.slice_set

    def _policy(self, policy: int) -> None:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(self.tid, policy, os.sched_param(0))  # the consumer's thread

    def _niceness(self, value: int) -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, self.tid, value)  # Linux: a TID sets one thread

    def on_backlog(self, backlog: float) -> bool:
        """The share of the ring pending, seen while draining or by the ring watch's thread;
        whether the consumer is escalated now (the watch stops following the ring then)."""
        with self._lock:
            if not self.escalated and backlog > self.ESCALATE_FILL:
                self._escalate()
            return self.escalated

    def on_gap(self) -> None:
        """The Python ring watch's drain check: records have waited while no drain came for
        `max_gap_s`."""
        with self._lock:
            if not self.escalated:
                self._gap_escalations += 1
                self._escalate()

    @property
    def gap_escalations(self) -> int:
        """Escalations because a drain was overdue (of `progress.escalations`)."""
        return self._native.gap_escalations if self._native is not None else self._gap_escalations

    def watch(
        self,
        pending: Callable[[], float],
        wake_fd: int,
        arm: Callable[[], None],
        positions: tuple[int, int, int] | None = None,
        owner: object = None,
    ) -> RingWatch | NativeRingWatch:
        """Watch the backlog from a thread at the engine's priority, woken by the producers through
        `wake_fd` once `arm`ed (ring_watch.py); the caller closes it before the ring goes away.
        Given the ring's `positions` (RingReader.positions; `owner` keeps them mapped), the watch
        runs in C without the GIL where libringwatch.so is built (NativeRingWatch: it escalates
        by itself, and each drain learns of it, after_drain); else in Python, through
        on_backlog."""
        if positions is not None and native_available():
            with contextlib.suppress(OSError):  # (a thread it could not start: the Python watch)
                self._native = NativeRingWatch(
                    wake_fd,
                    arm,
                    positions,
                    threshold=self.ESCALATE_FILL,
                    consumer_tid=self.tid,
                    nice_to=min(0, self.nice),
                    owner=owner,
                    all_threads=self._mirror_threads,
                    max_gap_s=self.max_gap_s,
                )
                self._watch_kind = "native"
                self._watch_tid = self._native.thread_id() if self._mirror_threads else None
                return self._native
        self._watch_kind = "python"
        w = RingWatch(pending, self.on_backlog, wake_fd, arm, max_gap_s=self.max_gap_s, on_gap=self.on_gap)
        self._watch_tid = w.thread_id() if self._mirror_threads else None
        return w

    def _sync_native(self) -> None:
        """What the C watch did since the last drain: an escalation it made is this policy's too
        (counted, the slice asked for, the priority set again: a relax since may have lowered
        it). One made while this policy had escalated too (both saw the fill) is the same."""
        w = self._native
        if w is None:
            return
        n = w.escalations
        if n == self._native_seen:
            return
        self._native_seen = n
        if not self.escalated:
            self._escalate()

    def _escalate(self) -> None:
        self.escalated = True
        self.progress.escalations += 1
        self._raise()
        if self._native is not None:
            self._native.set_escalated(True)  # (it does not escalate again until relaxed)

    def _raise(self) -> None:
        if self.mode == "idle":
            self._policy(os.SCHED_OTHER)
            self._apply_slice()
        self._niceness(min(0, self.nice))
        self._mirror()

    def after_drain(self, fill: float, gap_ms: float, now: float | None = None) -> None:
        """After a drain that found `fill` of the ring filled, `gap_ms` after the one before (at
        `now`, time.monotonic): the priority for what follows, and how long to wait before the
        next drain (`wait_s`)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._after_drain(fill, gap_ms, now)

    def _after_drain(self, fill: float, gap_ms: float, now: float) -> None:
        self._sync_native()
        self.wait_s = self.drain_s
        if fill > 0 and gap_ms > 0:
            self.wait_s = min(self.drain_s, max(self.MIN_WAIT_S, self.PACE_FILL * gap_ms / 1e3 / fill))
            self.wait_min_s = min(self.wait_min_s, self.wait_s)
        p = self.progress
        p.ring_fill_peak = max(p.ring_fill_peak, fill)
        if gap_ms > p.drain_gap_max_ms:
            p.drain_gap_max_ms, p.drain_gap_max_at_s = gap_ms, now - self.started
        if not self.escalated and fill > self.ESCALATE_FILL:
            self._escalate()
        if not self.escalated:
            return
        if fill >= self.RELAX_FILL:
            self._calm_since = None
        elif self._calm_since is None:
            self._calm_since = now
        elif now - self._calm_since >= self.RELAX_HOLD_S:
            self._calm_since = None
            self.escalated = False
            self._niceness(self.nice)
            if self.mode == "idle":
                self._policy(os.SCHED_IDLE)
            self._mirror()
            if self._native is not None:  # lowered first: an escalation from now on is the watch's
                self._native.set_escalated(False)

    def after_flush(self, wall_ms: float, cpu_ms: float, piece: str = "") -> None:
        """A piece of the loop's flush work between two drains (flush_round.py; or a whole
        flush forced by memory pressure) took `wall_ms`, `cpu_ms` of it on the consumer's thread:
        the longest is kept, with what it was (`piece`). At nice 10 on a busy machine the wall time
        is several times the CPU, and a drain that comes due waits for the piece under way."""
        p = self.progress
        if wall_ms > p.flush_wall_max_ms:
            p.flush_wall_max_ms, p.flush_cpu_ms, p.flush_piece_max = wall_ms, cpu_ms, piece

    def meta(self) -> dict[str, Any]:
        with self._lock:
            self._sync_native()  # (an escalation the watch made since the last drain counts)
        p = self.progress
        return {
            "sched": self.mode,
            # where the ring watch ran: "native" (C, without the GIL) or "python" (ring_watch.py)
            "ring_watch": self._watch_kind,
            "nice": self.nice,
            "ring_fill_peak": round(p.ring_fill_peak, 4),
            "drain_gap_max_ms": round(p.drain_gap_max_ms, 1),
            "drain_gap_max_at_s": round(p.drain_gap_max_at_s, 1),  # (after the consumer's start)
            "flush_wall_max_ms": round(p.flush_wall_max_ms, 1),
            "flush_cpu_ms": round(p.flush_cpu_ms, 1),  # (of that piece, on the consumer's thread)
            "flush_piece_max": p.flush_piece_max,  # what that piece was (flush_round.py)
            "escalations": p.escalations,
            # of those, because records waited while no drain came for max_drain_gap_s (0: never)
            "gap_escalations": self.gap_escalations,
            "max_drain_gap_s": self.max_gap_s,
            "drain_interval_s": self.drain_s,  # the longest pause (--drain-interval)
            "drain_wait_min_ms": round(self.wait_min_s * 1e3, 1),  # the shortest pause the pace chose
            "slice_us_asked": self.slice_us,
            # what the kernel held at the end (its default where no slice was set or kept)
            "slice_us": thread_slice_us(self.tid) if self.slice_set else None,
        }
