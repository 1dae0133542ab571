"""The recorder's GPU side: drains the CUPTI rings of an engine (and of its worker processes)
into the kernel correlator, fed with the host steps the uprobes found, and hands back its tables
(kernels, routes of watched top-k buffers, and GPU-side steps for Python decode loops) as columns,
like the host correlator.

Used by the recorder when `find_rings(pid)` finds a ring, i.e. when the engine was started with
`sparseety-prof launch` (CUDA_INJECTION64_PATH).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sparseety_prof.gpu.correlate import KernelCorrelator
from sparseety_prof.gpu.records import HostStep, LaunchApi, MemcpyActivity, RingCounters
from sparseety_prof.gpu.shm_ring import RingError, ShmRing, find_rings
from sparseety_prof.store.schema import Tables

#: the injection library's own device-to-host copies of watched arguments are reported as
#: launches of this name; they must never be taken for the engine's step-closing copies
STAGING_API = "sparseety_staging_copy"
MAX_STAGING_IDS = 1 << 16


class GpuCapture:
    def __init__(self, rings: list[ShmRing], pid: int) -> None:
        self.rings = rings
        self.pid = pid
        self.correlator = KernelCorrelator()
        self.records = 0
        self._staging: dict[int, None] = {}  # correlation ids of the library's own copies

    @classmethod
    def open(cls, pid: int, paths: list[Path] | None = None) -> GpuCapture | None:
        """The rings of `pid` and its descendants, or None when it was not launched with the
        injection library. A ring that cannot be read is an error the user must see."""
        paths = find_rings(pid) if paths is None else paths
        if not paths:
            return None
        rings = []
        try:
            for p in paths:
                rings.append(ShmRing(p))
        except RingError:
            for r in rings:
                r.close()
            raise
        return cls(rings, pid)

    def add_steps(self, steps: dict[str, list[Any]]) -> None:
        """Host steps from the recorder's step columns (schema.STEPS names)."""
        if not steps.get("step_id"):
            return
        self.correlator.add_steps(
            HostStep(int(s), int(tid), int(t0), int(t1), self.pid)
            for s, tid, t0, t1 in zip(
                steps["step_id"], steps["tid"], steps["t_start_ns"], steps["t_end_ns"], strict=True
            )
            if t0 is not None and t1 is not None
        )

    def poll(self, *, final: bool = False) -> Tables:
        """Drain every ring and return the settled rows (everything, with `final`)."""
        for ring in self.rings:
            recs = ring.drain()
            self.records += len(recs)
            keep = []
            for r in recs:
                if isinstance(r, LaunchApi) and r.api == STAGING_API:
                    self._staging[r.correlation_id] = None
                    if len(self._staging) > MAX_STAGING_IDS:
                        del self._staging[next(iter(self._staging))]
                    continue
                if isinstance(r, MemcpyActivity) and r.correlation_id in self._staging:
                    continue
                keep.append(r)
            self.correlator.add(keep)
        self.correlator.add([self._counters()])
        return self.correlator.flush(final=final)

    def _counters(self) -> RingCounters:
        total = RingCounters()
        for ring in self.rings:
            c = ring.counters()
            for k, v in c.__dict__.items():
                if k == "errors":
                    total.errors.extend(v)
                else:
                    setattr(total, k, getattr(total, k) + v)
        return total

    def meta(self) -> dict[str, Any]:
        c = self._counters()
        return {
            "rings": [str(r.path) for r in self.rings],
            "clock_domains": sorted({r.clock_domain for r in self.rings}),
            "join_mode": self.correlator.mode,
            "records": self.records,
            "ring": {k: v for k, v in c.__dict__.items() if k != "errors"},
            "errors": c.errors[:20],
            "correlator": self.correlator.counters,
            "estimated_clock_offset_ns": self.correlator.estimated_clock_offset_ns,
        }

    def close(self) -> None:
        for r in self.rings:
            finished = r.finished
            r.close()
            if finished:  # the producer exited and everything was drained: leave nothing behind
                r.path.unlink(missing_ok=True)
