"""The CPU sampler (issue 62): where the engine's threads spend their CPU, statistically.

A software cpu-clock perf event on every CPU, at `rate_hz` samples per second of CPU time, runs
probes/cpu_sampler.bpf.c, which keeps the engine process's samples only: their user stacks (a
stack map), one count per (thread, stack, kernel-or-not) and a small timed record per sample for
the join to steps (session/cpu_profile.py). Compiled and attached on its own, apart from the
probes: it traps nothing in the engine, and its perf events are its only cost there.

User stacks are walked by the kernel through frame pointers: a library built without them gives
stacks cut short at its frames (the sampled function itself, the leaf, is always right).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
from dataclasses import dataclass, field
from typing import Any

from sparseety_prof.capture.resources import PROBES_DIR
from sparseety_prof.errors import BpfUnavailable, MissingPrivileges

#: samples per second of CPU time a sampled thread gets (--cpu-sample-hz): a prime, so that the
#: sampling does not beat in step with periodic work at round rates (the usual 49/99 Hz of perf tools)
DEFAULT_RATE_HZ = 49
MAX_RATE_HZ = 10_000
STACK_SLOTS = 16384  # distinct user stacks kept (a full map loses new stacks, counted)
COUNT_SLOTS = 65536  # distinct (thread, stack, kernel) counts
SAMPLE_PAGES = 64  # the per-sample ring (24-byte records), pages
SOURCE = "cpu_sampler.bpf.c"

#: lost[] slots of the BPF program
LOST_RING, LOST_STACK, LOST_COUNT = 0, 1, 2


class _SampleRec(ctypes.Structure):
    _fields_ = [
        ("ts", ctypes.c_uint64),
        ("tid", ctypes.c_uint32),
        ("stack_id", ctypes.c_int32),
        ("kernel", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


@dataclass(frozen=True)
class Sample:
    """One sample of an engine thread: when (CLOCK_MONOTONIC ns), which thread, its user stack
    (addresses, leaf first; empty when the stack was not taken) and whether the CPU was in the
    kernel for it."""

    ts: int
    tid: int
    stack: tuple[int, ...]
    kernel: bool


@dataclass
class CpuSampler:
    """The attached sampler of one process. `take()` returns the samples since the last call;
    `close()` detaches (idempotent)."""

    bpf: Any
    pid: int
    rate_hz: int
    _pending: list[tuple[int, int, int, int]] = field(default_factory=list)
    _stacks: dict[int, tuple[int, ...]] = field(default_factory=dict)
    _closed: bool = False
    _paused: bool = False

    @classmethod
    def attach(cls, pid: int, rate_hz: int = DEFAULT_RATE_HZ) -> CpuSampler:
        """Loaded and started: sampling from now on."""
        sampler = cls.load(pid, rate_hz)
        sampler.start()
        return sampler

    @classmethod
    def load(cls, pid: int, rate_hz: int = DEFAULT_RATE_HZ) -> CpuSampler:
        """The program compiled and loaded, not yet sampling (`start`): the recorder compiles it
        before the probes attach, so that the compile holds back no drain of their records."""
        if not 0 < rate_hz <= MAX_RATE_HZ:
            raise ValueError(f"the CPU sampling rate must be within 1..{MAX_RATE_HZ} Hz, got {rate_hz}")
        from sparseety_prof.capture.bpf_loader import import_bcc  # (numpy and bcc: at attach only)

        bcc = import_bcc()
        cflags = [
            f"-DTARGET_TGID={pid}",
            f"-DSTACK_SLOTS={STACK_SLOTS}",
            f"-DCOUNT_SLOTS={COUNT_SLOTS}",
            f"-DSAMPLE_PAGES={SAMPLE_PAGES}",
        ]
        try:
            b = bcc.BPF(text=(PROBES_DIR / SOURCE).read_bytes(), cflags=cflags)
        except Exception as e:
            if "Operation not permitted" in str(e):
                raise MissingPrivileges(
                    f"the kernel refused the CPU sampler's BPF program ({e}): run as root"
                ) from None
            raise BpfUnavailable(f"could not compile/load the CPU sampler's BPF program: {e}") from None
        sampler = cls(bpf=b, pid=pid, rate_hz=rate_hz)
        b[b"samples"].open_ring_buffer(sampler._on_record)
        return sampler

    def start(self) -> None:
        """The perf events opened on every CPU: sampling begins. BpfUnavailable (the program
        unloaded) when the kernel refuses them."""
        from sparseety_prof.capture.bpf_loader import import_bcc

        bcc = import_bcc()
        try:
            self.bpf.attach_perf_event(
                ev_type=bcc.PerfType.SOFTWARE,
                ev_config=bcc.PerfSWConfig.CPU_CLOCK,
                fn_name=b"on_cpu_sample",
                sample_freq=self.rate_hz,
            )
        except Exception as e:
            self.close()
            raise BpfUnavailable(f"could not open the CPU sampler's perf events: {e}") from None

    def pause(self) -> None:
        """The perf events closed: no sample after this one, so that what `take()` returns next
        and the kernel's counts (`meta()`) cover the same samples. Idempotent."""
        if self._closed or self._paused:
            return
        from sparseety_prof.capture.bpf_loader import import_bcc

        bcc = import_bcc()
        self._paused = True
        # (never attached, or already gone: nothing samples either way)
        with contextlib.suppress(Exception):
            self.bpf.detach_perf_event(ev_type=bcc.PerfType.SOFTWARE, ev_config=bcc.PerfSWConfig.CPU_CLOCK)

    def _on_record(self, _ctx: Any, data: Any, _size: int) -> None:
        r = ctypes.cast(data, ctypes.POINTER(_SampleRec)).contents
        self._pending.append((r.ts, r.tid, r.stack_id, r.kernel))

    def take(self) -> list[Sample]:
        """The samples recorded since the last call, in the ring's order, their stacks read."""
        if self._closed:
            return []
        self.bpf.ring_buffer_consume()
        got, self._pending = self._pending, []
        return [Sample(ts, tid, self._stack(sid), bool(k)) for ts, tid, sid, k in got]

    def _stack(self, stack_id: int) -> tuple[int, ...]:
        """The addresses of a stack id, read once: the map never replaces a stack (no
        BPF_F_REUSE_STACKID), so an id keeps meaning the same stack."""
        if stack_id < 0:
            return ()
        got = self._stacks.get(stack_id)
        if got is None:
            try:
                got = tuple(int(a) for a in self.bpf[b"stacks"].walk(stack_id))
            except KeyError:
                got = ()
            self._stacks[stack_id] = got
        return got

    def counts(self) -> dict[tuple[int, bool], int]:
        """The kernel-side counts, per (thread, kernel-or-not): every sample, joined or not."""
        out: dict[tuple[int, bool], int] = {}
        for k, v in self.bpf[b"counts"].items():
            key = (int(k.tid), bool(k.kernel))
            out[key] = out.get(key, 0) + int(v.value)
        return out

    def lost(self) -> dict[str, int]:
        """Samples whose record the ring could not take, stacks the map could not keep, counts
        the count map could not keep."""
        table = self.bpf[b"lost"]
        got = [int(table[ctypes.c_int(i)].value) for i in (LOST_RING, LOST_STACK, LOST_COUNT)]
        return {"ring": got[0], "stacks": got[1], "counts": got[2]}

    def meta(self) -> dict[str, Any]:
        """meta.json's cpu_sampler counts (before close: they are read off the maps)."""
        counts = self.counts()
        return {
            "rate_hz": self.rate_hz,
            "samples": sum(counts.values()),
            "samples_in_kernel": sum(n for (_, k), n in counts.items() if k),
            "threads": len({tid for tid, _ in counts}),
            "lost": self.lost(),
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.bpf.cleanup()
        except OSError as e:
            if e.errno != errno.ESRCH:
                raise
