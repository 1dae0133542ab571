"""The consumer's CPU policy: low priority while it keeps up, the engine's priority (nice 0) once a
drain finds more of the ring filled than its pace allows for, back once drains have found it
nearly empty for a while; SCHED_IDLE with --sched idle; drains sooner when the ring fills fast."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import run_cli

from sparseety_prof.session.options import Options, Progress
from sparseety_prof.session.ring_watch import FOLLOW_MAX_S, NativeRingWatch, native_available
from sparseety_prof.session.sched import ConsumerSched as _ConsumerSched
from sparseety_prof.session.sched_slice import set_thread_slice, thread_slice_us


def run_in_thread(fn: object) -> None:
    err: list[BaseException] = []

    def target() -> None:
        try:
            fn()  # type: ignore[operator]
        except BaseException as e:
            err.append(e)

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if err:
        raise err[0]


@pytest.mark.root  # a negative niceness needs CAP_SYS_NICE
def test_an_escalation_never_lowers_a_priority_above_the_engines() -> None:
    def body() -> None:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, -5)
        try:
            p = Progress()
            s = _ConsumerSched(Options(pid=1, out=None, nice=-5), p)
            s.on_backlog(0.9)  # behind: counted, and the consumer keeps its -5 (not 0)
            assert os.getpriority(os.PRIO_PROCESS, tid) == -5 and p.escalations == 1
        finally:
            os.setpriority(os.PRIO_PROCESS, tid, 0)

    run_in_thread(body)


@pytest.mark.root  # lowering a thread's niceness back to 0 needs CAP_SYS_NICE
def test_escalates_to_nice_0_while_the_ring_fills_and_relaxes_after() -> None:
    def body() -> None:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, 10)
        p = Progress()
        s = _ConsumerSched(Options(pid=1, out=None, nice=10, drain_interval=0.5), p)
        s.started = 90.0  # (the drains below give their own times)
        s.on_backlog(0.2)
        assert os.getpriority(os.PRIO_PROCESS, tid) == 10 and p.escalations == 0
        s.on_backlog(0.4)  # more pending than the pace allows for: take the engine's priority
        assert os.getpriority(os.PRIO_PROCESS, tid) == 0 and p.escalations == 1
        s.after_drain(0.3, 900.0, now=100.0)  # not caught up yet
        assert os.getpriority(os.PRIO_PROCESS, tid) == 0
        s.after_drain(0.02, 500.0, now=101.0)  # caught up, but only just
        s.after_drain(0.2, 500.0, now=102.0)  # and behind again: the calm starts over
        s.after_drain(0.02, 500.0, now=103.0)
        s.after_drain(0.02, 500.0, now=103.0 + s.RELAX_HOLD_S - 0.5)
        assert os.getpriority(os.PRIO_PROCESS, tid) == 0
        s.after_drain(0.02, 500.0, now=103.0 + s.RELAX_HOLD_S)  # calm long enough: back to --nice
        assert os.getpriority(os.PRIO_PROCESS, tid) == 10 and p.escalations == 1
        assert p.ring_fill_peak == 0.3 and p.drain_gap_max_ms == 900.0
        s.after_flush(0.01, 0.01, "collector")  # a short piece of a flush
        s.after_flush(400.0, 30.0, "rows tokens")  # a piece that waited for the CPU
        s.after_flush(200.0, 35.0, "segment routes")  # more CPU, less wall: not the longest
        assert s.meta() == {
            "sched": "nice",
            "ring_watch": None,  # (no watch made here)
            "nice": 10,
            "ring_fill_peak": 0.3,
            "drain_gap_max_ms": 900.0,
            "drain_gap_max_at_s": 10.0,  # the longest gap ended at the first drain
            "flush_wall_max_ms": 400.0,
            "flush_cpu_ms": 30.0,
            "flush_piece_max": "rows tokens",
            "escalations": 1,
            "gap_escalations": 0,
            "max_drain_gap_s": 5.0,  # (the default)
            "drain_interval_s": 0.5,
            "drain_wait_min_ms": 500.0,
            "slice_us_asked": 0,
            "slice_us": None,
        }

    run_in_thread(body)


def _custom_slices() -> bool:
    """Whether this kernel keeps a fair thread's custom slice (EEVDF, Linux 6.12 and later)."""
    got: list[int | None] = []

    def probe() -> None:
        tid = threading.get_native_id()
        got.append(thread_slice_us(tid) if set_thread_slice(tid, 300) else None)

    run_in_thread(probe)
    return got == [300]


@pytest.mark.root
def test_the_consumer_takes_the_slice_it_is_given_and_keeps_it_through_escalation() -> None:
    if not _custom_slices():
        pytest.skip(f"kernel {os.uname().release} keeps no custom slice for SCHED_OTHER (Linux 6.12+ does)")

    def body() -> None:
        tid = threading.get_native_id()
        default = thread_slice_us(tid)
        assert default is not None and default > 100  # the kernel's own, about 1-3 ms
        s = _ConsumerSched(Options(pid=1, out=None, nice=10, slice_us=100), Progress())
        assert thread_slice_us(tid) == 100
        s.on_backlog(0.9)  # niceness changes keep it
        assert os.getpriority(os.PRIO_PROCESS, tid) == 0 and thread_slice_us(tid) == 100
        s.after_drain(0.0, 1.0, now=1.0)
        s.after_drain(0.0, 1.0, now=1.0 + s.RELAX_HOLD_S)
        assert os.getpriority(os.PRIO_PROCESS, tid) == 10 and thread_slice_us(tid) == 100
        assert s.meta()["slice_us"] == 100
        # out of range: clamped to the kernel's bounds; 0 gives the kernel's default back
        assert set_thread_slice(tid, 5) and thread_slice_us(tid) == 100
        assert set_thread_slice(tid, 0) and thread_slice_us(tid) == default

    def kernel_default() -> None:
        tid = threading.get_native_id()
        default = thread_slice_us(tid)
        s = _ConsumerSched(Options(pid=1, out=None, nice=10), Progress())  # the default: the kernel's
        assert thread_slice_us(tid) == default and s.meta()["slice_us"] is None

    def idle() -> None:
        tid = threading.get_native_id()
        s = _ConsumerSched(Options(pid=1, out=None, nice=10, sched="idle", slice_us=100), Progress())
        assert not s.slice_set  # SCHED_IDLE has no slice to ask for
        s.on_backlog(0.9)  # escalated to SCHED_OTHER: the short slice comes with it
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER and thread_slice_us(tid) == 100

    for fn in (body, kernel_default, idle):
        run_in_thread(fn)


@pytest.mark.root
def test_idle_policy_leaves_sched_idle_while_escalated() -> None:
    def body() -> None:
        s = _ConsumerSched(Options(pid=1, out=None, nice=10, sched="idle", slice_us=100), Progress())
        assert os.sched_getscheduler(0) == os.SCHED_IDLE
        s.on_backlog(0.9)
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
        s.after_drain(0.0, 500.0, now=10.0)
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
        s.after_drain(0.0, 500.0, now=10.0 + s.RELAX_HOLD_S)
        assert os.sched_getscheduler(0) == os.SCHED_IDLE

    run_in_thread(body)


def _fake_ring(
    pending: int, size: int = 1 << 20
) -> tuple[ctypes.Array[ctypes.c_uint64], tuple[int, int, int]]:
    """Producer and consumer positions in memory, `pending` bytes apart, as RingReader.positions
    gives them for the ring's pages."""
    pos = (ctypes.c_uint64 * 2)(pending, 0)
    addr = ctypes.addressof(pos)
    return pos, (addr, addr + 8, size)


@pytest.mark.root
@pytest.mark.parametrize("kind", ["python", "native"])
def test_a_watch_woken_early_follows_the_ring_until_rearmed(kind: str) -> None:
    """One wakeup per arming, and the mark is an estimate: a wakeup that finds the ring below the
    threshold leaves the watch disarmed until the consumer's next drain, which a consumer starved
    of CPU (--sched idle on busy cores) does not make; live, 6-8 s of records were lost that way.
    Performed: woken with a quarter of the ring pending, never woken again, the watch escalates
    the SCHED_IDLE consumer once the ring passes the threshold (its readings, not a wakeup), and
    a watch rearmed after such a wakeup goes back to sleep: no readings without a wakeup."""
    if kind == "native" and not native_available():
        pytest.fail("libringwatch.so is not built: run sparseety_prof/native/build.sh")
    seen: dict[str, object] = {}
    pos, positions = _fake_ring(1 << 18)  # 25% pending: below the threshold

    def wait_for(cond: object, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond() and time.monotonic() < deadline:  # type: ignore[operator]
            time.sleep(0.005)

    def pending() -> float:
        return (pos[0] - pos[1]) / (1 << 20)

    def consumer() -> None:
        p = Progress()
        s = _ConsumerSched(Options(pid=1, out=None, nice=10, sched="idle"), p)
        wake = os.eventfd(0, os.EFD_NONBLOCK)
        watch = s.watch(pending, wake, lambda: None, positions if kind == "native" else None)
        try:
            # an early wakeup, then a rearm (a drain): asleep again, whatever the ring does
            os.eventfd_write(wake, 1)
            wait_for(lambda: watch.wakeups == 1)
            os.eventfd_read(wake)
            wait_for(lambda: watch.polls >= 2)  # following: it reads the ring on its own
            watch.rearm()
            time.sleep(FOLLOW_MAX_S + 0.1)  # (the reading under way when rearmed still comes)
            polls = watch.polls
            pos[0] = 900_000  # 86% pending, and no producer wakes the watch: rearmed, it sleeps
            time.sleep(0.3)
            raised = watch.escalations if isinstance(watch, NativeRingWatch) else 0
            seen["rearmed"] = (watch.polls - polls, raised, p.escalations)
            # the consumer drains the ring; the next early wakeup is not followed by another
            pos[1] = 900_000 - (1 << 18)
            os.eventfd_write(wake, 1)
            wait_for(lambda: watch.wakeups == 2)
            seen["policy_before"] = os.sched_getscheduler(0)
            pos[0] = 900_000 + 900_000  # filling past the threshold, never woken
            wait_for(lambda: os.sched_getscheduler(0) == os.SCHED_OTHER)
            seen["raised"] = (os.sched_getscheduler(0), watch.wakeups)
            if kind == "native":
                s.after_drain(0.9, 500.0, now=10.0)  # the drain counts the watch's escalation
            seen["counted"] = p.escalations
            time.sleep(0.1)
            polls = watch.polls
            time.sleep(0.2)
            seen["escalated_polls"] = watch.polls - polls  # escalated: the drains rearm it
        finally:
            watch.close()
            os.close(wake)

    run_in_thread(consumer)
    assert seen["rearmed"] == (0, 0, 0)
    assert seen["policy_before"] == os.SCHED_IDLE
    assert seen["raised"] == (os.SCHED_OTHER, 2)
    assert seen["counted"] == 1
    assert seen["escalated_polls"] == 0


@pytest.mark.root
@pytest.mark.parametrize("kind", ["python", "native"])
def test_a_consumer_that_does_not_drain_is_raised_after_the_drain_gap(kind: str) -> None:
    """--sched idle on cores the engine keeps busy, with a sampling policy: the ring never fills, so
    neither a producer's wakeup nor the watch's following raises the consumer, and rows waited
    20 s in the ring between drains. Performed: with records pending (an eighth of the ring, below
    the threshold), no wakeup and no drain, the watch raises the SCHED_IDLE consumer about
    --max-drain-gap later; a consumer that drains (rearms the watch) more often than that, or an
    empty ring, is left alone; and these checks are neither wakeups nor readings."""
    if kind == "native" and not native_available():
        pytest.fail("libringwatch.so is not built: run sparseety_prof/native/build.sh")
    gap = 0.3
    seen: dict[str, object] = {}
    pos, positions = _fake_ring(1 << 17)

    def pending() -> float:
        return (pos[0] - pos[1]) / (1 << 20)

    def consumer() -> None:
        p = Progress()
        s = _ConsumerSched(Options(pid=1, out=None, nice=10, sched="idle", max_drain_gap=gap), p)
        wake = os.eventfd(0, os.EFD_NONBLOCK)
        watch = s.watch(pending, wake, lambda: None, positions if kind == "native" else None)
        try:
            for _ in range(12):  # drains every 0.1 s, records pending: left alone
                time.sleep(0.1)
                watch.rearm()
            seen["draining"] = (os.sched_getscheduler(0), s.gap_escalations)
            pos[1] = pos[0]  # no drain, nothing pending: left alone
            time.sleep(4 * gap)
            seen["empty"] = (os.sched_getscheduler(0), s.gap_escalations)
            pos[0] += 1 << 17  # no drain, records pending
            deadline = time.monotonic() + 10 * gap
            while os.sched_getscheduler(0) != os.SCHED_OTHER and time.monotonic() < deadline:
                time.sleep(0.005)
            seen["raised"] = (os.sched_getscheduler(0), s.gap_escalations, watch.wakeups, watch.polls)
            if kind == "native":
                s.after_drain(0.125, 500.0, now=10.0)  # the drain counts the watch's escalation
            seen["counted"] = (p.escalations, s.meta()["gap_escalations"])
        finally:
            watch.close()
            os.close(wake)

    run_in_thread(consumer)
    assert seen["draining"] == (os.SCHED_IDLE, 0)
    assert seen["empty"] == (os.SCHED_IDLE, 0)
    # raised within the loop's deadline (never, without the check); how soon is not asserted:
    # on a loaded host that is the scheduler's to say
    assert seen["raised"] == (os.SCHED_OTHER, 1, 0, 0), seen
    assert seen["counted"] == (1, 1)


@pytest.mark.root
@pytest.mark.parametrize("kind", ["python", "native"])
def test_the_ring_watch_leaves_sched_idle_to_the_consumer(kind: str) -> None:
    """With --sched idle the consumer's thread is SCHED_IDLE when it makes the watch's thread,
    which inherits the policy: a niceness does not change it, and a SCHED_IDLE watch would not
    run while the engine keeps the cores busy, the time it is there for. It takes SCHED_OTHER at
    nice 0; the consumer stays SCHED_IDLE."""
    if kind == "native" and not native_available():
        pytest.fail("libringwatch.so is not built: run sparseety_prof/native/build.sh")
    seen: dict[str, object] = {}
    _pos, positions = _fake_ring(0)  # (alive while the watch reads it)

    def consumer() -> None:
        s = _ConsumerSched(Options(pid=1, out=None, nice=10, sched="idle"), Progress())
        wake = os.eventfd(0, os.EFD_NONBLOCK)
        watch = s.watch(lambda: 0.0, wake, lambda: None, positions if kind == "native" else None)
        try:
            assert isinstance(watch, NativeRingWatch) == (kind == "native")
            tid = watch.thread_id()
            assert tid is not None
            seen["watch"] = (os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid))
            seen["consumer"] = os.sched_getscheduler(0)
            seen["meta"] = s.meta()["ring_watch"]
        finally:
            watch.close()
            watch.close()  # twice is fine
            os.close(wake)

    run_in_thread(consumer)
    assert seen["watch"] == (os.SCHED_OTHER, 0)
    assert seen["consumer"] == os.SCHED_IDLE
    assert seen["meta"] == kind


@pytest.mark.root
def test_the_native_watch_escalates_and_the_policy_learns_it_at_the_next_drain() -> None:
    """Woken with the ring past the threshold, the C watch raises the consumer's thread itself
    (SCHED_IDLE -> SCHED_OTHER at nice 0), once; the next drain counts it, and relaxing lets it
    escalate again. Woken below the threshold it does not escalate (it follows the ring instead:
    the next test)."""
    if not native_available():
        pytest.fail("libringwatch.so is not built: run sparseety_prof/native/build.sh")
    seen: dict[str, object] = {}
    pos, positions = _fake_ring(1 << 18)  # a quarter of the ring pending: below the threshold

    def wait_for(cond: object) -> None:
        deadline = time.monotonic() + 5
        while not cond() and time.monotonic() < deadline:  # type: ignore[operator]
            time.sleep(0.005)

    def consumer() -> None:
        p = Progress()
        s = _ConsumerSched(Options(pid=1, out=None, nice=10, sched="idle"), p)
        wake = os.eventfd(0, os.EFD_NONBLOCK)
        armed: list[int] = []
        watch = s.watch(lambda: 0.0, wake, lambda: armed.append(1), positions)
        assert isinstance(watch, NativeRingWatch)
        try:
            os.eventfd_write(wake, 1)
            wait_for(lambda: watch.wakeups == 1)
            seen["below"] = (os.sched_getscheduler(0), watch.escalations)
            os.eventfd_read(wake)  # (edge-triggered: the next write is a new edge)
            pos[0] = 900_000  # 86% pending
            os.eventfd_write(wake, 1)
            wait_for(lambda: watch.escalations == 1)
            seen["raised"] = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0), p.escalations)
            os.eventfd_read(wake)
            os.eventfd_write(wake, 1)  # escalated already: not again
            wait_for(lambda: watch.wakeups == 3)
            s.after_drain(0.9, 500.0, now=10.0)  # the drain learns of it: counted once
            seen["counted"] = (watch.escalations, p.escalations, s.escalated)
            s.after_drain(0.0, 500.0, now=10.5)
            s.after_drain(0.0, 500.0, now=10.5 + s.RELAX_HOLD_S)  # calm: relaxed
            seen["relaxed"] = (os.sched_getscheduler(0), s.escalated)
            os.eventfd_read(wake)
            os.eventfd_write(wake, 1)  # still filled: the watch escalates again
            wait_for(lambda: watch.escalations == 2)
            s.after_drain(0.9, 500.0, now=12.0)
            seen["again"] = (os.sched_getscheduler(0), p.escalations, s.meta()["escalations"])
            seen["armed"] = len(armed)
        finally:
            watch.close()
            os.close(wake)
        # closed (before the ring goes): its counters stay, and nothing is counted twice
        seen["closed"] = (watch.escalations, watch.wakeups, s.meta()["escalations"], s.escalated)

    run_in_thread(consumer)
    assert seen["below"] == (os.SCHED_IDLE, 0)
    assert seen["raised"] == (os.SCHED_OTHER, 0, 0)  # raised by the watch; counted at the drain
    assert seen["counted"] == (1, 1, True)
    assert seen["relaxed"] == (os.SCHED_IDLE, False)
    assert seen["again"] == (os.SCHED_OTHER, 2, 2)
    assert seen["armed"] == 1  # at the start (the recorder rearms after each drain)
    assert seen["closed"] == (2, 4, 2, True)


def test_a_native_watch_dropped_without_close_stops_its_thread() -> None:
    """An error path that loses the watch without close(): its thread is stopped when the watch
    goes (before what maps the ring can), not left reading the ring's memory."""
    if not native_available():
        pytest.fail("libringwatch.so is not built: run sparseety_prof/native/build.sh")
    pos, positions = _fake_ring(0)
    wake = os.eventfd(0, os.EFD_NONBLOCK)
    watch = NativeRingWatch(
        wake, lambda: None, positions, threshold=0.35, consumer_tid=0, nice_to=0, owner=pos
    )
    tid = watch.thread_id()
    assert tid is not None and os.path.exists(f"/proc/self/task/{tid}")
    del watch
    gc.collect()
    assert not os.path.exists(f"/proc/self/task/{tid}")
    os.close(wake)


_GIL_HELD = r"""
import ctypes, os, subprocess, sys, threading
from sparseety_prof.session.options import Options, Progress
from sparseety_prof.session.sched import ConsumerSched
native = sys.argv[1] == "native"
pos = (ctypes.c_uint64 * 2)(900_000, 0)  # 86% of the ring pending
positions = (ctypes.addressof(pos), ctypes.addressof(pos) + 8, 1 << 20)
holding = ctypes.PyDLL(None)  # its calls keep the GIL
out = {}
def consumer():
    s = ConsumerSched(Options(pid=1, out=None, nice=10, sched="idle"), Progress())
    r, w = os.pipe()
    watch = s.watch(lambda: 0.86, r, lambda: None, positions if native else None)
    watch.thread_id()
    tid = threading.get_native_id()
    # another process wakes the watch as a producer would, then reads this thread's scheduling
    # policy (/proc .../stat field 41) while the thread still holds the GIL
    script = "sleep 0.3; printf x >&%d; sleep 0.5; " % w
    script += "sed 's/.*) //' /proc/%d/task/%d/stat | cut -d' ' -f39" % (os.getpid(), tid)
    probe = subprocess.Popen(["sh", "-c", script], pass_fds=(w,), stdout=subprocess.PIPE, text=True)
    os.close(w)
    holding.usleep(1_500_000)  # the GIL held, as by a consumer the kernel stopped mid-Python
    out["policy"] = probe.communicate()[0].strip()
    out["kind"] = type(watch).__name__
    watch.close()
t = threading.Thread(target=consumer)
t.start()
t.join()
print(out["kind"], out["policy"])
"""


@pytest.mark.root
@pytest.mark.parametrize("kind", ["native", "python"])
def test_only_the_native_watch_raises_a_consumer_that_holds_the_gil(kind: str) -> None:
    """The case the C watch is for, performed: the consumer's thread holds Python's GIL without
    running (here: in a C call that keeps it, as a SCHED_IDLE consumer the kernel stopped mid-
    Python holds it on busy cores) when the producers wake the watch with the ring 86% full.
    The C watch raises it to SCHED_OTHER at once, GIL or not; the Python watch cannot run until
    the GIL comes back, and the consumer is still SCHED_IDLE half a second later (another process
    reads its policy meanwhile)."""
    if not native_available():
        pytest.fail("libringwatch.so is not built: run sparseety_prof/native/build.sh")
    r = subprocess.run([sys.executable, "-c", _GIL_HELD, kind], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    watch, policy = r.stdout.split()
    assert watch == ("NativeRingWatch" if kind == "native" else "RingWatch")
    assert int(policy) == (os.SCHED_OTHER if kind == "native" else os.SCHED_IDLE)


_MIRRORED = r"""
import ctypes, json, os, sys, threading, time
import polars as pl
from sparseety_prof.session.options import Options, Progress
from sparseety_prof.session.sched import ConsumerSched
native = sys.argv[1] == "native"
pos = (ctypes.c_uint64 * 2)(900_000, 0)  # 86% of the ring pending
positions = (ctypes.addressof(pos), ctypes.addressof(pos) + 8, 1 << 20)
def states():
    out = {}
    for t in os.listdir("/proc/self/task"):
        stat = open(f"/proc/self/task/{t}/stat").read()
        f = stat[stat.rfind(")") + 2 :].split()
        out[t] = [open(f"/proc/self/task/{t}/comm").read().strip(), int(f[38]), int(f[16])]
    return out
stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()  # made before the consumer lowered itself
os.nice(10)  # as the recorder does, then its policy
s = ConsumerSched(Options(pid=1, out=None, nice=10, sched="idle"), Progress(), mirror_threads=True)
wake = os.eventfd(0, os.EFD_NONBLOCK)
watch = s.watch(lambda: 0.86, wake, lambda: None, positions if native else None)
pl.DataFrame({"a": list(range(1000))}).group_by("a").len()  # Polars' pool, made by the lowered consumer
out = {"watch": str(watch.thread_id()), "kind": type(watch).__name__, "low": states()}
os.eventfd_write(wake, 1)  # a producer past the mark: the watch escalates
deadline = time.monotonic() + 5
while not (watch.escalations if native else s.escalated) and time.monotonic() < deadline:
    time.sleep(0.005)
out["raised"] = states()
s.after_drain(0.9, 500.0, now=10.0)
s.after_drain(0.0, 500.0, now=10.5)
s.after_drain(0.0, 500.0, now=10.5 + s.RELAX_HOLD_S)  # calm: relaxed
out["relaxed"] = states()
watch.close()
stop.set()
print(json.dumps(out))
"""


@pytest.mark.root
@pytest.mark.parametrize("kind", ["native", "python"])
def test_every_thread_of_the_recorder_follows_the_consumers_priority(kind: str) -> None:
    """The consumer's work also runs on Polars' threads, which a lowered consumer makes lowered
    and which kept that priority when it escalated: the raised consumer waited on a SCHED_IDLE
    worker. Performed in a child process: a thread made before, Polars' pool made after the
    consumer went SCHED_IDLE at nice 10; the watch escalates (raising every thread itself, the C
    watch without the GIL), then the policy relaxes: each time every thread has the consumer's
    policy and niceness, but the watch's, at the engine's (SCHED_OTHER, nice 0) throughout."""
    if kind == "native" and not native_available():
        pytest.fail("libringwatch.so is not built: run sparseety_prof/native/build.sh")
    r = subprocess.run([sys.executable, "-c", _MIRRORED, kind], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["kind"] == ("NativeRingWatch" if kind == "native" else "RingWatch")
    watch = out["watch"]
    low, raised, relaxed = out["low"], out["raised"], out["relaxed"]
    assert "polars-0" in [name for name, _p, _n in low.values()]
    assert len(low) >= 4 and set(low) <= set(raised) and set(low) <= set(relaxed)
    for tid in low:
        expected_low = [os.SCHED_OTHER, 0] if tid == watch else [os.SCHED_IDLE, 10]
        assert low[tid][1:] == expected_low, (tid, low[tid])
        assert raised[tid][1:] == [os.SCHED_OTHER, 0], (tid, raised[tid])
        assert relaxed[tid][1:] == expected_low, (tid, relaxed[tid])


def test_rows_gathered_over_drains_become_one_frame_per_frame_rows() -> None:
    import pytest

    from sparseety_prof.store import schema
    from sparseety_prof.store.buffers import ColumnBuffer

    def rows(table: str, **given: list[object]) -> dict[str, list[object]]:
        return schema.fill_absent(table, given, [c for c in schema.TABLES[table] if c not in given])

    buf = ColumnBuffer()
    buf.FRAME_ROWS = 5
    assert buf.add("tokens", rows("tokens", token_id=[1, 2], seq_id=[0, 0]), final=False) == []
    assert buf.add("tokens", {}, final=False) == []  # a drain without rows
    assert buf.add("tokens", rows("tokens", token_id=[], seq_id=[]), final=False) == []
    (df,) = buf.add("tokens", rows("tokens", token_id=[3, 4, 5], seq_id=[0, 0, 1]), final=False)
    assert df["token_id"].to_list() == [1, 2, 3, 4, 5] and df["seq_id"].to_list() == [0, 0, 0, 0, 1]
    assert df.columns == list(schema.TABLES["tokens"])
    # the end of the recording takes what is left, however few rows
    (last,) = buf.add("tokens", rows("tokens", token_id=[7], seq_id=[2]), final=True)
    assert last["token_id"].to_list() == [7] and last["seq_id"].to_list() == [2]
    # a drain whose columns are not the table's fails there, naming them
    with pytest.raises(ValueError, match="tkoen_id"):
        buf.add("tokens", {"tkoen_id": [1]}, final=False)
    # what is left when the recording ends on an error is taken by take_all()
    buf.add("steps", rows("steps", step_id=[9]), final=False)
    [(table, df)] = buf.take_all()
    assert table == "steps" and df["step_id"].to_list() == [9]
    assert buf.take_all() == []


@pytest.mark.parametrize("value", ["-1", "50", "100001"])
def test_a_slice_the_kernel_would_not_grant_is_a_usage_error(tmp_path: Path, value: str) -> None:
    r = run_cli("record", "--pid", "1", "-o", str(tmp_path / "rec"), "--slice-us", value)
    assert r.returncode == 2 and "--slice-us must be 0" in r.stderr
    assert not (tmp_path / "rec").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--drain-interval", "0.01"], "--drain-interval must be from 0.05 to 10 s"),
        (["--drain-interval", "11"], "--drain-interval must be from 0.05 to 10 s"),
        # every pause would look like a starved consumer and raise its priority
        (["--drain-interval", "2", "--max-drain-gap", "1"], "must be shorter than --max-drain-gap"),
    ],
)
def test_a_drain_interval_out_of_range_is_a_usage_error(
    tmp_path: Path, args: list[str], message: str
) -> None:
    r = run_cli("record", "--pid", "1", "-o", str(tmp_path / "rec"), *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "rec").exists()


def test_drains_come_sooner_when_the_ring_fills_fast() -> None:
    s = _ConsumerSched(Options(pid=1, out=None, nice=0, drain_interval=0.5), Progress())
    assert s.wait_s == 0.5
    s.after_drain(0.01, 500.0)  # an ordinary rate: a quarter of the ring is seconds away
    assert s.wait_s == 0.5
    s.after_drain(1.0, 400.0)  # the whole ring in 400 ms: a quarter of it in 100 ms
    assert s.wait_s == pytest.approx(0.1)
    s.after_drain(0.9, 10.0)  # faster than any pause is worth: the shortest
    assert s.wait_s == s.MIN_WAIT_S
    s.after_drain(0.0, 20.0)  # nothing came: back to the longest pause
    assert s.wait_s == 0.5
    assert s.meta()["drain_wait_min_ms"] == s.MIN_WAIT_S * 1e3


@pytest.mark.root  # the watch takes nice 0 back, and raises the consumer to it
def test_the_ring_watch_escalates_a_consumer_busy_elsewhere() -> None:
    """Woken by the producers (here: an eventfd written as the kernel's ring wakeup would make
    its fd readable), the watch's thread sees the ring filled while the consumer's thread is busy
    (here: sleeping at nice 10 without draining) and raises the consumer's priority from outside.
    Not woken, it does nothing at all: it does not poll."""
    pending = [0.05]
    wake = os.eventfd(0, os.EFD_NONBLOCK)
    armed: list[float] = []
    done = threading.Event()
    seen: dict[str, object] = {}

    def consumer() -> None:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, 10)
        p = Progress()
        s = _ConsumerSched(Options(pid=1, out=None, nice=10), p)
        watch = s.watch(lambda: pending[0], wake, lambda: armed.append(time.monotonic()))
        try:
            pending[0] = 0.6  # filling, but no producer woke the watch: nothing happens
            time.sleep(0.3)
            seen["unwoken"] = (os.getpriority(os.PRIO_PROCESS, tid), p.escalations, watch.wakeups)
            os.eventfd_write(wake, 1)  # the producer that passed the mark
            deadline = time.monotonic() + 5
            while not s.escalated and time.monotonic() < deadline:
                time.sleep(0.01)
            seen["woken"] = (os.getpriority(os.PRIO_PROCESS, tid), p.escalations, watch.wakeups)
            watch.rearm()  # after a drain: armed again, at the consumer's position
        finally:
            watch.close()
            watch.close()  # twice is fine
            done.set()

    run_in_thread(consumer)
    os.close(wake)
    assert done.is_set()
    assert seen["unwoken"] == (10, 0, 0)
    assert seen["woken"] == (0, 1, 1)
    assert len(armed) == 2  # at the start, and by rearm()


def test_the_ring_watch_stops_when_the_ring_is_gone() -> None:
    from sparseety_prof.session.ring_watch import RingWatch

    calls: list[float] = []

    def gone() -> float:
        raise ValueError("mmap closed or invalid")

    wake = os.eventfd(1, os.EFD_NONBLOCK)  # woken at once
    w = RingWatch(gone, calls.append, wake, lambda: None)
    w._thread.join(timeout=5)
    assert not w._thread.is_alive() and calls == [] and w.readings == 0 and w.wakeups == 1
    w.close()  # closing a watch that stopped by itself is fine
    os.close(wake)
