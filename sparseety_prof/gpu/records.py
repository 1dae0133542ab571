"""Plain records of the GPU path, as the shared-memory ring of `cupti_ext` delivers them and as the
kernel correlator consumes them. Pure Python (no numpy, no polars): `scripts/gpu_check.py` runs
them on a GPU machine that has neither.

Every timestamp is CLOCK_MONOTONIC nanoseconds (the injection library registers a CUPTI
timestamp callback before enabling any activity kind), the clock eBPF's `bpf_ktime_get_ns` uses,
so host steps found by the uprobes and device records compare directly. A zero start/end means
CUPTI did not time the record.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KernelActivity:
    """One kernel execution (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)."""

    correlation_id: int  # joins to the LaunchApi record of the launch (0 for some graph replays)
    name: str
    start_ns: int  # 0 when CUPTI gave none
    end_ns: int
    device: int = 0
    context_id: int = 0
    stream_id: int = 0
    grid: tuple[int, int, int] = (0, 0, 0)
    block: tuple[int, int, int] = (0, 0, 0)
    shared_mem_bytes: int = 0
    graph_id: int = 0  # non-zero: ran as a node of a CUDA graph
    graph_node_id: int = 0


@dataclass(frozen=True)
class LaunchApi:
    """A host API call that launched work (kernel, graph, memcpy): the callback at API exit."""

    correlation_id: int
    api: str  # cuLaunchKernel, cuLaunchKernelEx, cudaLaunchKernel, cuGraphLaunch, cudaMemcpyAsync, ...
    tid: int  # launching thread (kernel tid, as in /proc/PID/task)
    enter_ns: int
    exit_ns: int
    pid: int = 0
    graph_id: int = 0  # graph launches: the graph (exec) launched


@dataclass(frozen=True)
class MemcpyActivity:
    """One memory copy (CUPTI_ACTIVITY_KIND_MEMCPY)."""

    correlation_id: int
    kind: str  # "HtoD", "DtoH", "DtoD", "HtoH", "PtoP", "unknown"
    bytes: int
    start_ns: int
    end_ns: int
    device: int = 0
    stream_id: int = 0
    graph_id: int = 0


@dataclass(frozen=True)
class WatchedBuffer:
    """The contents of a watched kernel argument (mask or top-k ids), copied on the launch's stream
    right after the kernel and published once that copy completed."""

    correlation_id: int
    kernel: str  # the launched kernel's name
    arg_index: int
    dtype: str  # numpy dtype name: "int32", "int64", "float32", "uint8", ...
    shape: tuple[int, ...]
    data: bytes
    tid: int = 0
    launch_ns: int = 0
    # A CUDA graph replay: every kernel of one replay has the graph launch's correlation id, so the
    # node (CUPTI's graphNodeId of the executable graph's node, as on the kernel record) tells which
    # kernel the buffer belongs to. 0 for eager launches.
    graph_id: int = 0
    graph_node_id: int = 0


@dataclass(frozen=True)
class HostStep:
    """A token step seen by the uprobes on the host: [t_start_ns, t_end_ns] on thread `tid`."""

    step_id: int
    tid: int
    t_start_ns: int
    t_end_ns: int
    pid: int = 0


@dataclass
class RingCounters:
    """Losses and costs the injection library reports about itself."""

    activity_dropped: int = 0  # CUPTI's own dropped activity records
    ring_dropped: int = 0  # records the shared-memory ring had no room for
    buffers_skipped_sampling: int = 0  # watched launches not copied because of the sampling rate
    buffers_skipped_budget: int = 0  # watched launches not copied because of the byte budget
    buffers_failed: int = 0  # copies that could not be enqueued
    callback_ns: int = 0  # CPU time spent in the library's callbacks
    launches_seen: int = 0
    graph_launches: int = 0
    errors: list[str] = field(default_factory=list)  # failures reported through the ring
