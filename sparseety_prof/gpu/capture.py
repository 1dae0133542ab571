"""The recorder's GPU side: drains the CUPTI rings of an engine (and of its worker processes)
into the kernel correlator, fed with the host steps the uprobes found, and hands back its tables
(kernels, routes of watched top-k buffers, and GPU-side steps for Python decode loops) as columns,
like the host correlator.

Used by the recorder when `find_rings(pid)` finds a ring that the engine (or one of its workers)
maps, i.e. when it was started with `sparseety-prof launch` (CUDA_INJECTION64_PATH) or received
the library by `--late-attach`. A ring that turns out damaged while being read is dropped and named
in the metadata's errors: the recording goes on.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sparseety_prof.gpu.correlate import KernelCorrelator
from sparseety_prof.gpu.late_attach import NOT_SEEN
from sparseety_prof.gpu.records import HostStep, LaunchApi, MemcpyActivity, RingCounters
from sparseety_prof.gpu.shm_ring import (
    RingError,
    ShmRing,
    find_rings,
    open_ring,
    remove_stale_rings,
)
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
        self._failed: list[str] = []  # rings dropped because they could not be read

    @classmethod
    def open(cls, pid: int, paths: list[Path] | None = None) -> GpuCapture | None:
        """The rings that `pid` and its descendants map, or None when it was not launched with the
        injection library (rings of processes that are gone are removed first). `paths`: ring
        files to read instead, whoever maps them. A ring that cannot be read is an error the
        user must see."""
        if paths is None:
            remove_stale_rings()
            found = find_rings(pid)
            opens = [lambda f=f: open_ring(f) for f in found]
        else:
            opens = [lambda p=p: ShmRing(p) for p in paths]
        if not opens:
            return None
        rings: list[ShmRing] = []
        try:
            for op in opens:
                rings.append(op())
        except RingError:
            for r in rings:
                r.close()
            raise
        return cls(rings, pid)

    def add_steps(self, steps: Mapping[str, list[Any]]) -> None:
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
        for ring in list(self.rings):
            try:
                recs = ring.drain()
            except RingError as e:
                self._drop(ring, e)
                continue
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

    def _drop(self, ring: ShmRing, error: RingError) -> None:
        self._failed.append(f"ring dropped: {error}")
        self.rings.remove(ring)
        ring.close()

    def _counters(self) -> RingCounters:
        total = RingCounters(errors=list(self._failed))
        for ring in list(self.rings):
            try:
                c = ring.counters()
            except RingError as e:
                self._drop(ring, e)
                total.errors.append(self._failed[-1])
                continue
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
            "rings_dropped": len(self._failed),
            "join_mode": self.correlator.mode,
            "records": self.records,
            "ring": {k: v for k, v in c.__dict__.items() if k != "errors"},
            "errors": c.errors[:20],
            "correlator": self.correlator.counters,
            "estimated_clock_offset_ns": self.correlator.estimated_clock_offset_ns,
            "late_attach": [
                {"ring": str(r.path), "attached_mono_ns": r.header.start_mono_ns, "not_seen": NOT_SEEN}
                for r in self.rings
                if r.header.late_attach
            ],
        }

    def close(self) -> None:
        for r in self.rings:
            try:
                if r.finished:  # the producer exited and everything was drained: leave nothing behind
                    r.unlink()
            except RingError:
                pass
            r.close()
