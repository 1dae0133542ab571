"""Verify the table's `ggml_tensor` layout on a live engine at attach time, or discover the one
that holds, before the sparse-decision probes are compiled with it.

The engine's weight structs and its last-built graph (llama.cpp builds a worst-case graph when it
creates a context, so one is there before the first request) live in its anonymous writable
memory; it is read through /proc/PID/mem (root, as for the probes), without stopping or waiting
for the engine. tensor_layout_solver decides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import BinaryIO

from sparseety_prof.capture import tensor_layout_solver as tls
from sparseety_prof.capture.gguf_info import TensorInfo
from sparseety_prof.capture.layouts import TensorLayout
from sparseety_prof.capture.proc_maps import read_maps
from sparseety_prof.errors import MissingPrivileges, UnsupportedEngineBuild

REGION_MAX = 256 << 20  # larger anonymous mappings are KV caches and compute buffers, not structs
SCAN_MAX = 2 << 30  # bytes read at most: the tensor contexts are a few MiB even for large models
CHUNK = 16 << 20


@dataclass
class ProcessMemory:
    """The anonymous writable mappings of a live process, read on demand."""

    pid: int
    scanned: int = 0  # bytes searched
    # a search's answer, kept: checking the table and then discovering search for the same names
    _found: dict[tuple[bytes, ...], dict[bytes, list[int]]] = field(default_factory=dict)

    def regions(self) -> list[tuple[int, int]]:
        """(start, end) of each anonymous writable mapping small enough to hold structs."""
        return [
            (m.start, m.end)
            for m in read_maps(self.pid)
            if m.perms.startswith("rw")
            and (m.path in ("", "[heap]") or m.path.startswith("[anon"))
            and m.end - m.start <= REGION_MAX
        ]

    def find(self, needles: tuple[bytes, ...]) -> dict[bytes, list[int]]:
        if needles in self._found:
            return self._found[needles]
        out: dict[bytes, list[int]] = {n: [] for n in needles}
        overlap = max(len(n) for n in needles) - 1
        with self._open_mem() as f:
            for lo, hi in self.regions():
                addr = lo
                while addr < hi and self.scanned < SCAN_MAX:
                    size = min(CHUNK + overlap, hi - addr)
                    try:
                        data = f.read(size) if f.seek(addr) == addr else b""
                    except OSError:
                        break  # unmapped meanwhile, or a guard page: the rest of this region
                    self.scanned += len(data)
                    for n in needles:
                        i = data.find(n)
                        while i >= 0:
                            if i < CHUNK or addr + size >= hi:  # the overlap is the next chunk's
                                out[n].append(addr + i)
                            i = data.find(n, i + 1)
                    addr += CHUNK
        for hits in out.values():
            hits[:] = sorted(set(hits))
        self._found[needles] = out
        return out

    def _open_mem(self) -> BinaryIO:
        try:
            return open(f"/proc/{self.pid}/mem", "rb", buffering=0)
        except PermissionError:
            raise MissingPrivileges(
                f"cannot read /proc/{self.pid}/mem to check the ggml_tensor layout: run as root (sudo), "
                f"with ptrace allowed (kernel.yama.ptrace_scope below 3); a recorder that is not root "
                f"needs CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH (docs/privileges.md)"
            ) from None

    def read(self, addr: int, size: int) -> bytes | None:
        if addr < 0:
            return None
        try:
            with open(f"/proc/{self.pid}/mem", "rb", buffering=0) as f:
                f.seek(addr)
                data = f.read(size)
        except (OSError, OverflowError):
            return None
        return data if len(data) == size else None


@dataclass(frozen=True)
class TensorCheck:
    """How the ggml_tensor layout the probes get was established."""

    layout: TensorLayout
    source: str  # "table, verified on live data" | "discovered on live data"
    weights: int  # weight structs it holds on
    nodes: int  # graph nodes it holds on
    table_failure: str | None  # the invariant the table's layout failed, when it did
    seconds: float
    bytes_scanned: int
    # ith, nth are only in the stack frames of compute calls: the discovery pass checks them
    params_source: str = "table (checked only in the layout-discovery pass: --discover-layout)"

    def to_meta(self) -> dict[str, object]:
        return {
            "tensor_layout": self.layout.__dict__,
            "source": self.source,
            "weights_checked": self.weights,
            "graph_nodes_checked": self.nodes,
            "table_failure": self.table_failure,
            "seconds": round(self.seconds, 3),
            "bytes_scanned": self.bytes_scanned,
            "compute_params": self.params_source,
        }


def _solved(t: TensorLayout) -> tls.Solved:
    return tls.Solved(t.type, t.ne, t.nb, t.src, t.data, t.name)


def verify_tensor_layout(
    mem: tls.Memory, infos: list[TensorInfo], table: TensorLayout, *, what: str
) -> TensorCheck:
    """The table's layout when it holds on `mem`, else the one discovered there; UnsupportedEngineBuild
    (exit 6) naming the invariant when none holds. `what` names the process in messages."""
    t0 = time.monotonic()
    specs = tls.weight_specs(infos)
    first = tls.check(mem, specs, _solved(table))
    if first.layout is not None:
        source, verdict, failure = "table, verified on live data", first, None
    else:
        verdict = tls.solve(mem, specs)
        source, failure = "discovered on live data", first.reason
        if verdict.layout is None:
            raise UnsupportedEngineBuild(
                f"unsupported engine build: no consistent ggml_tensor layout in {what} (the table's: "
                f"{first.reason}; discovery: {verdict.reason}). Recording sparse decisions would produce "
                f"garbage, so nothing was attached"
            )
    s = verdict.layout
    assert s is not None
    layout = replace(table, type=s.type, ne=s.ne, nb=s.nb, src=s.src, data=s.data, name=s.name)
    scanned = mem.scanned if isinstance(mem, ProcessMemory) else 0
    return TensorCheck(
        layout, source, verdict.weights, verdict.nodes, failure, time.monotonic() - t0, scanned
    )
