"""The duty cycle run against the probes: a thread of its own takes the expensive probes out and
puts them back on the schedule (session/duty_cycle.py, capture/probe_switch.py), so that window
edges do not wait for the next drain (drains come up to --drain-interval apart). The drain loop
tells it what each drain saw (`observe`): the controller's tokens and ring fill.

The thread made from the consumer's thread shares its placement (placement.py), but not its
priority: a window that ends late costs the engine its traps for longer, and under `--sched idle`
on busy cores a thread at the consumer's priority may wait long for the CPU. So, like the ring
watch (ring_watch.py), it runs at the engine's own priority (SCHED_OTHER, nice 0), which it
asserts again after each switch (the consumer's priority changes are given to every thread but
the watch's: thread_priority.py). It runs briefly: detaching waits in the kernel for most of its
time. Without CAP_SYS_NICE it cannot raise itself, and stays at the consumer's priority.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from sparseety_prof.capture.bpf_loader import Session
from sparseety_prof.capture.probe_switch import DUTY_SYMBOLS, DUTY_SYMBOLS_LOGITS, ProbeSwitch
from sparseety_prof.session.duty_cycle import DutyCycle, DutySpec
from sparseety_prof.session.options import Progress


class DutyDriver:
    def __init__(
        self, spec: DutySpec, switch: ProbeSwitch, log: Callable[[str], None], since: float | None = None
    ) -> None:
        """`since`: when the attach that put the probes in began (time.monotonic())."""
        self.switch = switch
        self.cycle = DutyCycle(spec, time.monotonic(), since)
        self._log = log
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="duty-cycle", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            _engine_priority()
            while True:
                with self._lock:
                    wait = self.cycle.next_change() - time.monotonic()
                if self._stop.wait(max(0.0, wait)):
                    return
                with self._lock:
                    self._step(time.monotonic())
                _engine_priority()
        except BaseException as e:  # the probes stay as they are; close() reports it
            self.error = e

    def _step(self, now: float) -> None:
        action = self.cycle.tick(now)
        if action == "disarm":
            self.switch.disarm()
            self.cycle.disarmed(now, time.monotonic())
        elif action == "arm":
            self.switch.arm()
            self.cycle.armed_again(now, time.monotonic())

    def observe(self, now: float, tokens: int, fill: float, losses: int) -> None:
        """What a drain saw (the drain loop's hook)."""
        with self._lock:
            self.cycle.observe(now, tokens, fill, losses)

    def observe_drain(self, now: float, progress: Progress, taken_bytes: int) -> None:
        """`observe` from the drain loop's own counters: the bytes the drain took, of the ring's."""
        ring_bytes = self.switch.session.ring_pages * mmap.PAGESIZE
        self.observe(
            now, progress.tokens, taken_bytes / ring_bytes, progress.kernel_drops + progress.seq_gaps
        )
        with self._lock:
            progress.sparse_coverage = self.cycle.coverage(now)

    def close(self) -> None:
        """Stop switching (before the session detaches everything): the probes are left as they
        are, and a window still open ends now."""
        self._stop.set()
        self._thread.join(timeout=30)
        with self._lock:
            self.cycle.close(time.monotonic())
        if self.error is not None:
            self._log(f"sparseety-prof: --duty-cycle stopped switching: {self.error}")

    def meta(self) -> dict[str, Any]:
        with self._lock:
            out = self.cycle.meta(time.monotonic())
        c = self.switch.cost
        out["probes"] = self.switch.symbols
        out["switch"] = {
            "how": "detach/attach",
            "arms": c.arms,
            "disarms": c.disarms,
            "arm_ms_max": round(c.arm_ms_max, 2),
            "disarm_ms_max": round(c.disarm_ms_max, 2),
            "cpu_ms": round(c.cpu_ms, 2),
            "failures": c.failures,
        }
        return out


def _engine_priority() -> None:
    """This thread at the engine's priority (SCHED_OTHER, nice 0), where it may raise itself."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        if os.sched_getscheduler(tid) != os.SCHED_OTHER:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    with contextlib.suppress(OSError):
        if os.getpriority(os.PRIO_PROCESS, tid) > 0:
            os.setpriority(os.PRIO_PROCESS, tid, 0)  # Linux: a TID sets one thread


def open_duty_driver(
    spec: DutySpec | None, session: Session, log: Callable[[str], None], since: float | None = None
) -> DutyDriver | None:
    """The duty cycle asked for, started on the session's probes; None when none is asked, or
    when the capture attached none of the per-layer probes it switches (--mode tokens: nothing
    to take out)."""
    if spec is None:
        return None
    switch = ProbeSwitch(session, DUTY_SYMBOLS_LOGITS if spec.logits else DUTY_SYMBOLS)
    if not any(p.symbol in DUTY_SYMBOLS for p in switch.probes):
        log("sparseety-prof: --duty-cycle: no per-layer MoE/FFN probe attached, nothing to switch")
        return None
    driver = DutyDriver(spec, switch, log, since)
    driver.start()
    log(
        f"sparseety-prof: --duty-cycle {spec.text}: {', '.join(switch.symbols)} in for {spec.on_s:g} s "
        f"every {spec.period_s:g} s"
    )
    return driver
