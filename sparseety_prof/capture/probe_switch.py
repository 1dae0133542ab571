"""The expensive probes taken out of the engine and put back (`--duty-cycle`).

The per-layer MoE/FFN probes (get_rows, the weighted multiply, the GLU) trap once per layer and
engine thread per forward pass: most of the probes' cost. Between duty-cycle windows they are
detached, not left with a program that returns early: detaching closes the probe's perf event,
and the kernel removes its breakpoint from the engine's text once no event uses it, so the
engine's instructions run as they were, without a trap. Disabling the perf event instead
(PERF_EVENT_IOC_DISABLE) leaves the breakpoint in place, so each hit still traps into the kernel
(docs/tuning.md, `--duty-cycle`, shows both, measured). The probes that tag token boundaries
(micro-batch, sampler, logits, serving) stay attached: every token is still recorded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sparseety_prof.capture import target as tg
from sparseety_prof.capture.bpf_loader import AttachedProbe, Session

#: the probes a duty cycle takes out between windows: the per-layer MoE/FFN graph ops
DUTY_SYMBOLS = (tg.SYM_GET_ROWS, tg.SYM_MUL, tg.SYM_GLU)
#: with --duty-logits, the logits row's probe too: its copy of the row is the largest per-token
#: transfer, and its statistics the consumer's costliest per-token work (the sampler probes stay:
#: each token is still recorded, with a null log-prob outside windows)
DUTY_SYMBOLS_LOGITS = (*DUTY_SYMBOLS, tg.SYM_LOGITS_ITH)


@dataclass
class SwitchCost:
    """How long arming and disarming took (the engine runs meanwhile; this is the recorder's)."""

    arms: int = 0
    disarms: int = 0
    arm_ms_max: float = 0.0
    disarm_ms_max: float = 0.0
    cpu_ms: float = 0.0  # the switching thread's CPU in them, summed
    failures: int = 0  # a probe that could not be attached or detached (the engine exiting)


class ProbeSwitch:
    """Detach (`disarm`) and attach again (`arm`) the attached probes of `symbols`, through the
    session's BPF object and the programs it already loaded. Not thread-safe by itself: one
    caller at a time (session/duty_driver.py holds its lock)."""

    def __init__(self, session: Session, symbols: tuple[str, ...] = DUTY_SYMBOLS) -> None:
        self.session = session
        self.probes: list[AttachedProbe] = [p for p in session.attached if p.symbol in symbols]
        self.armed = True  # compile_and_attach attached them all
        self.cost = SwitchCost()

    @property
    def symbols(self) -> list[str]:
        return sorted({p.symbol for p in self.probes})

    def disarm(self) -> None:
        """Detach: entry probes first, so that no call is entered with its return probe gone
        (per-thread state opened at an entry is closed by its return)."""
        if not self.armed:
            return
        t0, cpu0 = time.monotonic(), time.thread_time()
        bpf, pid = self.session.bpf, self.session.pid
        for p in sorted(self.probes, key=lambda p: p.kind != "entry"):
            fn = bpf.detach_uretprobe if p.kind == "return" else bpf.detach_uprobe
            try:
                fn(name=p.via or p.library, addr=p.address, pid=pid)
            except Exception:  # BCC raises bare Exception; the probe may be gone with its process
                self.cost.failures += 1
        self.armed = False
        ms = (time.monotonic() - t0) * 1e3
        self.cost.cpu_ms += (time.thread_time() - cpu0) * 1e3
        self.cost.disarms += 1
        self.cost.disarm_ms_max = max(self.cost.disarm_ms_max, ms)

    def arm(self) -> None:
        """Attach again: return probes first (as compile_and_attach does)."""
        if self.armed:
            return
        t0, cpu0 = time.monotonic(), time.thread_time()
        bpf, pid = self.session.bpf, self.session.pid
        for p in sorted(self.probes, key=lambda p: p.kind != "return"):
            fn = bpf.attach_uretprobe if p.kind == "return" else bpf.attach_uprobe
            try:
                fn(name=p.via or p.library, addr=p.address, fn_name=p.program, pid=pid)
            except Exception:
                self.cost.failures += 1
        self.armed = True
        ms = (time.monotonic() - t0) * 1e3
        self.cost.cpu_ms += (time.thread_time() - cpu0) * 1e3
        self.cost.arms += 1
        self.cost.arm_ms_max = max(self.cost.arm_ms_max, ms)
