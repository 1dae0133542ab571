"""A watch on the ring's backlog from a thread of its own, at the engine's priority.

The consumer checks the backlog when it drains, but at a low priority on cores the engine keeps
busy, one drain's work can take it a second or more of wall time (it gets about a tenth of a
core), while a small model at thousands of tokens/s fills the ring in about as long: the check
comes too late. This thread raises the consumer's priority from outside (setpriority on its thread
id) as soon as the backlog passes the consumer's escalation threshold. It needs the GIL for that,
which the consumer drops at least every switch interval of its own running time
(sys.getswitchinterval), so the priority is raised within one of the consumer's time slices
instead of after its drain.

It does not poll a calm ring. It sleeps in epoll on the ring's map fd, edge-triggered, and the
producers wake it. After each drain the consumer arms it (`rearm`) with the record sequence number
at which the ring will be about as full as the threshold again (RingReader.arm_watch); the first
record past that number is submitted with BPF_RB_FORCE_WAKEUP and disarms it (rb_wake() in
probes/token_probes.bpf.c). A calm ring costs nothing here. Polling on a timer, as this did, cost
CPU at every wakeup, and the wakeups added up to a share of the recorder's CPU per token
(docs/overhead.md; scripts/profile_consumer.py measures it).

One wakeup per arming, though, and the mark is an estimate (from the mean record size; before the
first drain, from the largest record's, early on purpose): a wakeup that finds the ring below the
threshold leaves the watch disarmed until the next drain rearms it, and a consumer starved of CPU
does not drain. Under --sched idle the first drain's early wakeup was followed by seconds in which
nothing watched the ring filling, and a large part of the run's records was lost. So after a
wakeup that did not escalate, the watch follows the ring: it reads it every FOLLOW_S (longer
while it fills slowly, up to FOLLOW_MAX_S) until the consumer rearms it (`rearm`: not merely
when the backlog falls, as a starved consumer releases part of the ring now and then long before
its drain ends) or the backlog passes the threshold. That is a few timer wakeups, only between
an early wakeup and the next drain.

A consumer that gets no CPU (--sched idle on cores the engine keeps busy) but whose ring does not
fill drains only when it does: with a sampling policy, every 20 s, so rows reached the recording,
the live view and the sinks that late. With `max_gap_s` the watch also checks, every `max_gap_s`,
whether the consumer rearmed it since the last check (it does after every drain), and escalates
it when not while records are pending: records wait at most about twice that. One timer wakeup
per `max_gap_s`.

Its thread needs the GIL to run at all, and the consumer holds it wherever the kernel stopped it:
at nice 10 the consumer runs again within milliseconds, but under --sched idle on cores the engine
keeps busy it may wait seconds, and the escalation with it (docs/overhead.md, "How the consumer keeps up").
NativeRingWatch is the same watch in C (sparseety_prof/native/ringwatch.c), whose thread never
takes the GIL and raises the consumer's priority itself; the consumer's policy learns of it at its
next drain (ConsumerSched). It is used where libringwatch.so is built; RingWatch otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparseety_prof.capture.resources import native_library

# Between readings while following the ring after a wakeup below the threshold (module docstring;
# FOLLOW_MS in ringwatch.c): FOLLOW_S, doubled after each reading that finds the ring filled by
# less than FOLLOW_STEP of it since the last, up to FOLLOW_MAX_S (a consumer starved of a
# slow-filling ring read it a thousand times over at a fixed period). At the fastest fill seen (a
# small model filling the ring in about a second) the ring goes from the threshold to full in
# well under a second: FOLLOW_MAX_S stays below that.
FOLLOW_S = 0.02
FOLLOW_MAX_S = 0.25
FOLLOW_STEP = 0.05


class _Armed:
    """What both watches share: the producers wake them once per arming (RingReader.arm_watch)."""

    _arm: Callable[[], None]

    def rearm(self) -> None:
        """After a drain (the consumer's thread): the mark moves with the consumer, so this arms
        the watch whether or not it was woken (and ends its following the ring)."""
        with contextlib.suppress(OSError, KeyError, ValueError):  # the ring is gone
            self._arm()
            self._armed()

    def _armed(self) -> None:
        """Tell the watch's thread that the producers' wakeup is armed again."""
        raise NotImplementedError


class RingWatch(_Armed):
    def __init__(
        self,
        pending: Callable[[], float],
        on_backlog: Callable[[float], object],
        wake_fd: int,
        arm: Callable[[], None],
        *,
        max_gap_s: float = 0.0,
        on_gap: Callable[[], object] | None = None,
    ) -> None:
        """`pending`: the share of the ring not yet drained (read off the ring's memory, from this
        thread); `on_backlog`: told each reading (the consumer's escalation rule); `wake_fd`: an fd
        that becomes readable when the producers wake the watch (the ring's map fd); `arm`: lets
        the producers wake it once more (RingReader.arm_watch). `on_backlog` returns whether the
        consumer is escalated (then the watch waits for the next wakeup instead of following the
        ring). `on_gap`: called when records are pending and no drain rearmed the watch for
        `max_gap_s` (0: never checked)."""
        self._pending = pending
        self._on_backlog = on_backlog
        self._on_gap = on_gap
        self._max_gap_s = max_gap_s if on_gap is not None and max_gap_s > 0 else 0.0
        self._arm = arm
        self.wakeups = 0  # times the thread woke for the ring (the first may be the registration)
        self.readings = 0
        self.polls = 0  # readings while following the ring (after a wakeup below the threshold)
        self._arms = 0  # rearm()s so far (read by the thread: an int's update is atomic under the GIL)
        # set by the consumer's loop (close), never from a signal handler
        self._stop_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._ep = select.epoll()
        # edge-triggered: the ring's fd is readable whenever anything is pending (nearly always);
        # only a producer's wakeup makes a new edge
        self._ep.register(wake_fd, select.EPOLLIN | select.EPOLLET)
        self._ep.register(self._stop_fd, select.EPOLLIN)
        arm()
        self.started = threading.Event()  # set once the thread has taken its priority
        self.tid: int | None = None  # the thread's id, once started
        self._thread = threading.Thread(target=self._run, name="ring-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # the recorder lowered its own priority before this thread was made, and a new thread
        # inherits it: take the engine's back, its policy first (with --sched idle this thread
        # would otherwise stay SCHED_IDLE, which a niceness does not change, and never run while
        # the engine keeps the cores busy: the very time it is for), then its niceness (root may;
        # without CAP_SYS_NICE it stays low and only the drains escalate)
        tid = self.tid = threading.get_native_id()
        with contextlib.suppress(OSError):
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 0)
        self.started.set()
        follow = FollowRule()
        follow_at = 0.0  # while following the ring: when the next reading is due
        gap = self._max_gap_s
        check_at = time.monotonic() + gap if gap else 0.0  # the drain check: when due (0: never)
        arms_checked = self._arms
        while True:
            due = min((t for t in (follow_at if follow.following else 0.0, check_at) if t), default=0.0)
            timeout = -1.0 if not due else max(0.0, due - time.monotonic())
            try:
                events = self._ep.poll(timeout)
            except (ValueError, OSError):  # closed under it
                return
            if any(fd == self._stop_fd for fd, _ in events):
                return
            now = time.monotonic()
            if check_at and now >= check_at:
                # no drain since the last check (none rearmed the watch) and records waiting
                try:
                    waiting = self._arms == arms_checked and self._pending() > 0
                except (ValueError, OSError):  # the ring is gone (closed at detach)
                    return
                if waiting and self._on_gap is not None:
                    self._on_gap()
                arms_checked, check_at = self._arms, now + gap
            if not events and not (follow.following and now >= follow_at):
                continue  # the drain check's wakeup alone
            if events:
                self.wakeups += 1
            else:
                self.polls += 1
            try:
                share = self._pending()
            except (ValueError, OSError):  # the ring is gone (closed at detach)
                return
            self.readings += 1
            follow.reading(bool(events), bool(self._on_backlog(share)), self._arms, share)
            follow_at = now + follow.wait

    def _armed(self) -> None:
        self._arms += 1

    def thread_id(self, timeout: float = 5.0) -> int | None:
        """The watch's thread id, once it has taken its priority (None if not within `timeout`)."""
        return self.tid if self.started.wait(timeout) else None

    def close(self) -> None:
        """Stop watching (before the ring is unmapped). Closing twice is fine."""
        if self._ep.closed:
            return
        with contextlib.suppress(OSError):
            os.eventfd_write(self._stop_fd, 1)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._ep.close()
            os.close(self._stop_fd)


@dataclass
class FollowRule:
    """Whether the watch follows the ring after a reading, and how long until its next reading
    (the module docstring; sparseety_watch_follow in ringwatch.c, which
    tests/test_native_twins.py holds equal to this)."""

    following: bool = False  # reading the ring on a timer (since a wakeup below the threshold)
    arms_seen: int = 0  # the consumer's arms when the following began
    wait: float = FOLLOW_S  # until the next reading while following
    last: float = 0.0  # the share pending at the last reading

    def reading(self, woke: bool, escalated: bool, arms: int, share: float) -> None:
        """After a reading of `share` (woken by a producer, `woke`, or on the timer while
        following), with `escalated` and the consumer's `arms` as they are now."""
        if escalated:
            self.following = False  # the consumer's drains rearm the watch
        elif woke:
            self.following, self.arms_seen = True, arms  # below the threshold: disarmed until rearmed
            self.wait = FOLLOW_S
        elif arms != self.arms_seen:
            self.following = False  # the consumer rearmed the producers' wakeup since
        elif share - self.last < FOLLOW_STEP:
            self.wait = min(2 * self.wait, FOLLOW_MAX_S)
        else:
            self.wait = FOLLOW_S
        self.last = share


# sparseety_prof/native/ringwatch.c, built by sparseety_prof/native/build.sh
_WATCH_LIB = native_library("libringwatch.so")
_WATCH_ABI = 5
_WAKEUPS, _READINGS, _ESCALATIONS, _TID, _POLLS, _GAP_ESCALATIONS = range(6)  # sparseety_watch_counter's


def _load_watch(path: Path) -> Any:
    """The C watch's library, or None (missing, unloadable, or of another ABI version)."""
    try:
        lib = ctypes.CDLL(str(path), use_errno=True)
        if lib.sparseety_watch_abi() != _WATCH_ABI:
            return None
        p = ctypes.c_void_p
        lib.sparseety_watch_start.argtypes = [
            ctypes.c_int,
            p,
            p,
            ctypes.c_uint64,
            ctypes.c_double,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
        ]
        lib.sparseety_watch_start.restype = p
        lib.sparseety_watch_stop.argtypes = [p]
        lib.sparseety_watch_stop.restype = None
        lib.sparseety_watch_free.argtypes = [p]
        lib.sparseety_watch_free.restype = None
        lib.sparseety_watch_set_escalated.argtypes = [p, ctypes.c_int]
        lib.sparseety_watch_set_escalated.restype = None
        lib.sparseety_watch_armed.argtypes = [p]
        lib.sparseety_watch_armed.restype = None
        lib.sparseety_watch_counter.argtypes = [p, ctypes.c_int]
        lib.sparseety_watch_counter.restype = ctypes.c_uint64
    except (OSError, AttributeError):
        return None
    return lib


_watch_lib = _load_watch(_WATCH_LIB)


def native_available() -> bool:
    """Whether NativeRingWatch can be made (libringwatch.so built and loaded)."""
    return _watch_lib is not None


class NativeRingWatch(_Armed):
    """RingWatch's job in a C thread that never takes the GIL (ringwatch.c): woken by the producers
    through `wake_fd`, it reads the ring's positions at `positions` (RingReader.positions: the
    producer's and consumer's addresses and the ring's data bytes) and, past `threshold` of the
    ring pending, makes thread `consumer_tid` (with `all_threads`, every thread of the process
    but its own) SCHED_OTHER at niceness `nice_to`, once until
    `set_escalated(False)`; the same when records are pending and no drain rearmed it for
    `max_gap_s` (0: never checked). `escalations` counts them (ConsumerSched reads it at each
    drain), `gap_escalations` those of the second kind.
    close() must come before the ring is unmapped (RingReader.stop)."""

    def __init__(
        self,
        wake_fd: int,
        arm: Callable[[], None],
        positions: tuple[int, int, int],
        *,
        threshold: float,
        consumer_tid: int,
        nice_to: int,
        owner: object = None,
        all_threads: bool = False,
        max_gap_s: float = 0.0,
    ) -> None:
        """`owner`: what keeps the ring's positions mapped (the RingReader), held while the
        thread may read them. `all_threads`: an escalation raises every other thread of the
        process too, but the watch's own (thread_priority.py)."""
        if _watch_lib is None:
            raise OSError("libringwatch.so is not built (sparseety_prof/native/build.sh)")
        self._arm = arm
        self._owner = owner
        prod, cons, size = positions
        arm()
        gap_ms = round(max_gap_s * 1e3)
        handle = _watch_lib.sparseety_watch_start(
            wake_fd, prod, cons, size, threshold, consumer_tid, nice_to, int(all_threads), gap_ms
        )
        if not handle:
            err = ctypes.get_errno()
            raise OSError(err, f"the ring watch's thread did not start: {os.strerror(err)}")
        self._handle: int | None = handle
        self._final: dict[int, int] = {}  # the counters at close
        # a watch dropped without close() (an error path) still stops its thread
        self._finalizer = weakref.finalize(self, _watch_lib.sparseety_watch_free, handle)

    def _counter(self, which: int) -> int:
        if self._handle is None or _watch_lib is None:
            return self._final.get(which, 0)  # closed: as they were when it stopped
        return int(_watch_lib.sparseety_watch_counter(self._handle, which))

    @property
    def wakeups(self) -> int:
        return self._counter(_WAKEUPS)

    @property
    def readings(self) -> int:
        return self._counter(_READINGS)

    @property
    def escalations(self) -> int:
        return self._counter(_ESCALATIONS)

    @property
    def polls(self) -> int:
        """Readings while following the ring after a wakeup below the threshold."""
        return self._counter(_POLLS)

    @property
    def gap_escalations(self) -> int:
        """Escalations because records waited while no drain came for `max_gap_s`."""
        return self._counter(_GAP_ESCALATIONS)

    def thread_id(self, timeout: float = 5.0) -> int | None:
        """The watch's thread id, once it has taken its priority (None if not within `timeout`)."""
        deadline = time.monotonic() + timeout
        while self._handle is not None:
            tid = self._counter(_TID)
            if tid or time.monotonic() >= deadline:
                return tid or None
            time.sleep(0.001)
        return None

    def _armed(self) -> None:
        if self._handle is not None and _watch_lib is not None:
            _watch_lib.sparseety_watch_armed(self._handle)

    def set_escalated(self, escalated: bool) -> None:
        """The consumer escalated (True: the watch does not again) or relaxed (False: it may)."""
        if self._handle is not None and _watch_lib is not None:
            _watch_lib.sparseety_watch_set_escalated(self._handle, int(escalated))

    def close(self) -> None:
        """Stop the thread (before the ring is unmapped). Closing twice is fine."""
        handle = self._handle
        if handle is None or _watch_lib is None:
            return
        _watch_lib.sparseety_watch_stop(handle)  # the thread is gone: its counters hold still
        counters = (_WAKEUPS, _READINGS, _ESCALATIONS, _POLLS, _GAP_ESCALATIONS)
        self._final = {k: int(_watch_lib.sparseety_watch_counter(handle, k)) for k in counters}
        self._handle = None
        self._finalizer()  # frees it, once
        self._owner = None
