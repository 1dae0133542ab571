"""The CUPTI injection library (cupti_ext) without a GPU: built against the CUDA 13 headers, driven
by cupti_ext/tests/driver.c through stub libcupti / libcuda, its shared-memory ring read back with
sparseety_prof/gpu/shm_ring.py and checked field by field. Also the reader on damaged rings,
`launch`, and that scripts/gpu_check.sh fails fast and clearly where there is no GPU."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
from conftest import MappingProcess

from sparseety_prof.capture.process_match import descendants
from sparseety_prof.commands.exit_codes import CUPTI_LIBRARY_MISSING
from sparseety_prof.errors import CommandNotStarted, CuptiLibraryMissing, UsageError
from sparseety_prof.gpu import launch as launch_mod
from sparseety_prof.gpu.correlate import KernelCorrelator
from sparseety_prof.gpu.records import HostStep, KernelActivity, LaunchApi, MemcpyActivity, WatchedBuffer
from sparseety_prof.gpu.shm_ring import (
    CLOCK_CUPTI_DEFAULT,
    CLOCK_MONOTONIC,
    HEADER_SIZE,
    MAGIC,
    RingError,
    ShmRing,
    find_rings,
)

ROOT = Path(__file__).resolve().parent.parent
WATCH = "topk_hist_kernel:0:int32:arg1,arg2;moe_align_block_size_kernel:0:int64:grid.x*2"
RT_MOE = "_ZN4vllm28moe_align_block_size_kernelIlEEvPKT_"


@pytest.fixture(scope="session")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cupti_build")
    r = subprocess.run(
        ["bash", str(ROOT / "cupti_ext" / "build.sh"), str(out)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.fail(f"cupti_ext/build.sh failed (exit {r.returncode}):\n{r.stderr}")
    return out


class Run:
    def __init__(self, proc: subprocess.Popen[str], name: str) -> None:
        self.proc = proc
        self.path = Path("/dev/shm") / name


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = f"sparseety-test-{uuid.uuid4().hex[:12]}"
    yield name
    Path("/dev/shm", name).unlink(missing_ok=True)


def env_for(build: Path, shm_name: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARSEETY_", "STUB_"))}
    env |= {
        "CUDA_INJECTION64_PATH": str(build / "libsparseety_cupti.so"),
        "SPARSEETY_CUPTI_PATH": str(build / "libcupti_stub.so"),
        "SPARSEETY_CUDA_PATH": str(build / "libcuda_stub.so"),
        "SPARSEETY_SHM_NAME": shm_name,
        "SPARSEETY_FLUSH_MS": "10",
    }
    return env | extra


def run_driver(build: Path, scenario: str, env: dict[str, str]) -> tuple[dict[str, list[str]], int]:
    r = subprocess.run([str(build / "driver"), scenario], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"driver {scenario} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    out = {
        line.split(" ", 1)[0]: line.split(" ", 1)[1].split() for line in r.stdout.splitlines() if " " in line
    }
    return out, r.returncode


T = TypeVar("T")


def by_type(records: Sequence[object], cls: type[T]) -> list[T]:
    return [r for r in records if isinstance(r, cls)]


# ---------------------------------------------------------------- the library, end to end


def test_main_scenario_records_everything_field_by_field(build: Path, shm_name: str) -> None:
    t_start = time.monotonic_ns()
    out, _ = run_driver(build, "main", env_for(build, shm_name, SPARSEETY_WATCH=WATCH))
    t_end = time.monotonic_ns()
    assert out["init"] == ["1"]

    # The timestamp callback was registered before any activity kind was enabled, and returns
    # CLOCK_MONOTONIC.
    calls = out["log"][0].split(";")
    assert calls[:3] == ["subscribe", "timestamp", "register"]
    assert calls.index("timestamp") < min(i for i, c in enumerate(calls) if c.startswith("enable:"))
    assert {"enable:10", "enable:1"} <= set(calls)  # CONCURRENT_KERNEL, MEMCPY
    needed = ["1:307", "1:442", "1:652", "1:653", "1:514", "1:515", "1:279"]  # driver launch/graph/memcpy
    needed += ["2:211", "2:214", "2:430", "2:431", "2:505", "2:311", "2:41"]  # runtime
    assert {f"cb:{cb}" for cb in needed} <= set(calls)
    before, ts, after = map(int, out["timestamp"])
    assert before <= ts <= after

    ring = ShmRing(Path("/dev/shm") / shm_name)
    assert stat.S_IMODE(os.stat(ring.path).st_mode) == 0o600
    assert ring.finished
    assert ring.clock_domain == CLOCK_MONOTONIC
    assert t_start <= ring.header.start_mono_ns <= t_end
    assert abs(ring.header.calib_mono_ns - ring.header.start_mono_ns) < 10**9
    records = ring.drain()
    c = ring.counters()
    raw = ring.raw_counters()
    assert c.errors == []
    assert ring.drain() == []  # consumed

    launches = by_type(records, LaunchApi)
    apis: dict[str, list[LaunchApi]] = {}
    for rec in launches:
        apis.setdefault(rec.api, []).append(rec)
    drv = apis["cuLaunchKernel"]
    rt = apis["cudaLaunchKernel"]
    assert sorted(r.correlation_id for r in drv) == [*range(100000, 100300), 300004]
    assert sorted(r.correlation_id for r in rt) == list(range(200000, 200300))
    # Two threads launched at once: each keeps its own tid, in order, with sane times.
    assert len({r.tid for r in drv if r.correlation_id < 300000}) == 1
    assert len({r.tid for r in rt}) == 1
    assert drv[0].tid != rt[0].tid
    assert [r.correlation_id for r in rt] == sorted(r.correlation_id for r in rt)
    for r in launches:
        assert t_start <= r.enter_ns <= r.exit_ns <= t_end
        assert r.pid == ring.header.pid
    assert [(r.correlation_id, r.graph_id) for r in apis["cuGraphLaunch"]] == [(300000, 77)]
    assert [r.correlation_id for r in apis["cuMemcpyDtoHAsync_v2"]] == [300001]
    # the host-to-device copy 300002 is not recorded
    assert [r.correlation_id for r in apis["cudaMemcpyAsync"]] == [300003]

    # Watched buffers: exactly the arrays the "engine" held, shaped by the rules.
    watched = {w.correlation_id: w for w in by_type(records, WatchedBuffer)}
    assert len(watched) == 60 == raw["buffers_copied"]
    tid_of = {r.correlation_id: r.tid for r in launches}
    for i in range(0, 300, 10):
        w = watched[100000 + i]
        assert (w.kernel, w.arg_index, w.dtype, w.shape) == ("topk_hist_kernel", 0, "int32", (4, 2))
        assert w.data == array("i", [(i * 31 + j * 7) % 64 for j in range(8)]).tobytes()
        assert w.tid == tid_of[100000 + i]
        w = watched[200000 + i]
        assert (w.kernel, w.arg_index, w.dtype, w.shape) == (RT_MOE, 0, "int64", (6,))
        assert w.data == array("q", [i * 13 + j for j in range(6)]).tobytes()
        assert t_start <= w.launch_ns <= t_end
    assert 300004 not in watched  # the failed launch is recorded but not copied
    # The library's own copies re-enter the callback: recorded under their own name, not recursed on.
    assert len(apis["sparseety_staging_copy"]) == 60
    assert out["copies"] == ["60", "host_allocs", "1"]

    # Activity: order as delivered (out of order kept), untimed records kept with 0.
    base = int(out["activity_base"][0])
    kernels = by_type(records, KernelActivity)
    assert [(k.correlation_id, k.start_ns, k.end_ns) for k in kernels] == [
        (100001, base + 2000, base + 3000),
        (100000, base + 1000, base + 1500),
        (100002, 0, 0),
        (300000, base + 5000, base + 6000),
    ]
    k = kernels[0]
    assert (k.name, k.device, k.context_id, k.stream_id) == ("gemm_kernel_bf16", 0, 1, 7)
    assert (k.grid, k.block, k.shared_mem_bytes, k.graph_id) == ((2, 1, 1), (128, 1, 1), 1536, 0)
    assert (kernels[3].name, kernels[3].graph_id, kernels[3].graph_node_id) == ("graph_node_kernel", 77, 5)
    assert by_type(records, MemcpyActivity) == [
        MemcpyActivity(300001, "DtoH", 64, base + 4000, base + 4100, device=0, stream_id=7, graph_id=0)
    ]
    assert (c.activity_dropped, c.ring_dropped, c.buffers_failed) == (3, 0, 0)
    assert (c.buffers_skipped_sampling, c.buffers_skipped_budget) == (0, 0)
    assert c.launches_seen == 601 and c.graph_launches == 1
    assert c.callback_ns > 0
    assert raw["records_written"] == len(records)
    ring.close()


def test_sampling_budget_and_bad_rule_are_counted(build: Path, shm_name: str) -> None:
    env = env_for(
        build,
        shm_name,
        SPARSEETY_WATCH="topk_hist_kernel:0:int32:arg1,arg2",
        SPARSEETY_WATCH_FILE=str(ROOT / "cupti_ext" / "tests" / "watch_bad.txt"),
        SPARSEETY_SAMPLE_EVERY="2",
        SPARSEETY_BUFFER_BYTES_PER_S="100",
    )
    run_driver(build, "limits", env)
    with ShmRing(Path("/dev/shm") / shm_name) as ring:
        records = ring.drain()
        c = ring.counters()
    # 10 launches, every 2nd sampled (0, 2, 4, 6, 8); 32 bytes each under a 100 B/s budget: 3 fit.
    assert sorted(w.correlation_id for w in by_type(records, WatchedBuffer)) == [100000, 100002, 100004]
    assert (c.buffers_skipped_sampling, c.buffers_skipped_budget) == (5, 2)
    # bad_kernel's rule reads argument 5 of a 3-argument kernel: refused, counted, reported once.
    assert c.buffers_failed == 1
    assert len(c.errors) == 1 and "bad_kernel" in c.errors[0] and "argument 5 does not exist" in c.errors[0]


def test_kernel_handles_are_named_by_cupti_symbol_name(build: Path, shm_name: str) -> None:
    # Driver launches of handles that cuFuncGetName and cuFuncGetParamInfo refuse (CUkernel; one
    # seen on an H200 with torch 2.11): CUPTI's symbolName names them.
    run_driver(
        build, "handles", env_for(build, shm_name, SPARSEETY_WATCH="topk_hist_kernel:0:int32:arg1*arg2")
    )
    with ShmRing(Path("/dev/shm") / shm_name) as ring:
        records = ring.drain()
        c = ring.counters()
    watched = sorted(by_type(records, WatchedBuffer), key=lambda w: w.correlation_id)
    assert [w.correlation_id for w in watched] == [400000, 400001, 400002]
    for i, w in enumerate(watched):
        assert w.kernel == "topk_hist_kernel" and w.shape == (8,)
        assert w.data == bytes(np.arange(i * 8, i * 8 + 8, dtype=np.int32).tobytes())
    # The handle launched without a symbol name cannot be matched: said once, nothing copied.
    assert c.buffers_failed == 0
    assert len(c.errors) == 1 and "without a symbol name" in c.errors[0] and "(code 400)" in c.errors[0]


@pytest.mark.root
def test_a_ring_name_planted_by_another_user_does_not_cost_the_engine_its_ring(
    build: Path, shm_name: str
) -> None:
    """Another local user creates the engine's ring name in /dev/shm first. The engine (a third
    user here, so it cannot remove that file) takes an unguessable name of its own instead of
    losing its ring, and the planted file is left as it was."""
    planted = Path("/dev/shm") / shm_name
    planted.write_bytes(b"planted")
    os.chown(planted, 65534, 65534)
    os.chmod(planted, 0o644)
    lib = Path(tempfile.mkdtemp(prefix="sparseety-cupti-"))  # readable by the engine's user
    try:
        os.chmod(lib, 0o755)
        for f in build.iterdir():
            if f.is_file():
                shutil.copy(f, lib / f.name)
                os.chmod(lib / f.name, 0o755)
        r = subprocess.run(
            [str(lib / "driver"), "main"],
            env=env_for(lib, shm_name),
            capture_output=True,
            text=True,
            timeout=60,
            user=65533,
            group=65533,
            extra_groups=[],
        )
        assert r.returncode == 0, r.stderr
        assert planted.read_bytes() == b"planted" and planted.stat().st_uid == 65534
        rings = sorted(Path("/dev/shm").glob(f"{shm_name}.*"))
        assert [re.fullmatch(re.escape(shm_name) + r"\.[0-9a-f]{16}", p.name) is not None for p in rings] == [
            True
        ]
        assert rings[0].stat().st_uid == 65533
        ring = ShmRing(rings[0])
        try:
            assert ring.finished and by_type(ring.drain(), LaunchApi)
        finally:
            ring.close()
    finally:
        for p in Path("/dev/shm").glob(f"{shm_name}.*"):
            p.unlink()
        shutil.rmtree(lib)


def test_full_ring_drops_and_counts_then_recovers(build: Path, shm_name: str) -> None:
    env = env_for(build, shm_name, SPARSEETY_RING_BYTES="4096")
    proc = subprocess.Popen(
        [str(build / "driver"), "ringfull"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdin is not None
    lines = [proc.stdout.readline() for _ in range(3)]
    assert lines[0] == "init 1\n" and lines[2] == "filled\n", lines
    ring = ShmRing(Path("/dev/shm") / shm_name)
    assert ring.header.capacity == 4096
    first = ring.drain()
    dropped = ring.counters().ring_dropped
    # 72-byte launch records: the first 56 fit, the rest were dropped, nothing was torn.
    assert [r.correlation_id for r in by_type(first, LaunchApi)] == list(range(1000, 1056))
    assert len(first) + dropped == 200
    proc.stdin.write("go\n")
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
    second = ring.drain()  # these wrapped around the end of the data area
    assert [(r.api, r.correlation_id) for r in by_type(second, LaunchApi)] == [
        ("cuLaunchKernel", 5000 + i) for i in range(20)
    ]
    assert ring.counters().ring_dropped == dropped
    assert ring.finished
    ring.close()


def test_subscribe_refused_keeps_engine_running_and_says_why(build: Path, shm_name: str) -> None:
    out, _ = run_driver(build, "fail", env_for(build, shm_name, STUB_CUPTI_SUBSCRIBE_RESULT="39"))
    assert out["init"] == ["1"]
    assert out["log"] == ["subscribe"]  # nothing enabled, no buffer callbacks taken from the other tool
    assert out["fired"] == ["0"]
    with ShmRing(Path("/dev/shm") / shm_name) as ring:
        assert ring.drain() == []
        errors = ring.counters().errors
        assert ring.clock_domain == CLOCK_CUPTI_DEFAULT
    assert len(errors) == 1
    assert "MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED" in errors[0] and "(code 39)" in errors[0]


def test_timestamp_callback_refused_reader_converts_clock(build: Path, shm_name: str) -> None:
    env = env_for(build, shm_name, STUB_CUPTI_TIMESTAMP_RESULT="1", SPARSEETY_WATCH="not a watch entry")
    out, _ = run_driver(build, "fail", env)
    assert out["init"] == ["1"] and out["fired"] == ["1"]
    with ShmRing(Path("/dev/shm") / shm_name) as ring:
        records = ring.drain()
        errors = ring.counters().errors
        h = ring.header
        assert ring.clock_domain == CLOCK_CUPTI_DEFAULT
    assert any("SPARSEETY_WATCH" in e and "pattern:arg:dtype:rule" in e for e in errors)
    assert any("cuptiActivityRegisterTimestampCallback" in e for e in errors)
    (k,) = by_type(records, KernelActivity)
    t = 1700000000000000000
    assert (k.start_ns, k.end_ns) == (
        t - h.calib_realtime_ns + h.calib_mono_ns,
        t + 1000 - h.calib_realtime_ns + h.calib_mono_ns,
    )


# ---------------------------------------------------------------- CUDA graphs

GRAPH_WATCH = "topk_graph_kernel:0:int32:arg1,arg2"
GRAPH_TOPK = "_ZN4vllm17topk_graph_kernelEPiiiS0_"


class GraphRun:
    """driver's `graphs` scenario under the stubs: an MoE step launched eagerly once, then captured
    and replayed as a CUDA graph (A: 4 replays, its source graph destroyed right after
    instantiation; B: captured again with new buffers and instantiated anew, 3 replays; C: new
    buffers moved into B's executable with cuGraphExecUpdate, 3 replays; D: layer 0's node given a
    new buffer with cuGraphExecKernelNodeSetParams, 2 replays), read back from the ring."""

    def __init__(self, build: Path, shm_name: str, **extra_env: str) -> None:
        env = env_for(build, shm_name, SPARSEETY_WATCH=GRAPH_WATCH, **extra_env)
        r = subprocess.run(
            [str(build / "driver"), "graphs"], env=env, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, f"driver graphs exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
        self.stdout = r.stdout
        # what the "kernel" wrote, logged by the kernel itself as it ran on the stub device:
        # (correlation id, graph node id) -> int32 values
        self.wrote: dict[tuple[int, int], list[int]] = {}
        self.steps: list[tuple[int, int, int, int]] = []  # the engine's own step windows around each replay
        for line in r.stdout.splitlines():
            f = line.split()
            if f[0] == "wrote":
                key = (int(f[1]), int(f[2]))
                assert key not in self.wrote
                self.wrote[key] = [int(v) for v in f[3].split(",")]
            elif f[0] == "step":
                self.steps.append((int(f[1]), int(f[2]), int(f[3]), int(f[4])))
            elif f[0] == "syncs":
                self.syncs, self.violations = int(f[1]), int(f[3])
        with ShmRing(Path("/dev/shm") / shm_name) as ring:
            self.records = ring.drain()
            self.counters = ring.counters()
            self.raw = ring.raw_counters()
            self.pid = ring.header.pid


@pytest.fixture(scope="module")
def graph_run(build: Path) -> Iterator[GraphRun]:
    name = f"sparseety-test-{uuid.uuid4().hex[:12]}"
    try:
        yield GraphRun(build, name)
    finally:
        Path("/dev/shm", name).unlink(missing_ok=True)


def test_graph_replays_copy_what_each_replay_wrote_and_follow_new_pointers(graph_run: GraphRun) -> None:
    g = graph_run
    assert g.counters.errors == [] and g.counters.buffers_failed == 0
    # The library never waited for the device (no synchronize call of any kind reached the stub
    # libcuda), and nothing of it was enqueued on a stream while that stream was being captured.
    assert (g.syncs, g.violations) == (0, 0)

    kernels = by_type(g.records, KernelActivity)
    graph_launches = sorted(
        r.correlation_id for r in by_type(g.records, LaunchApi) if r.api == "cuGraphLaunch"
    )
    assert len(graph_launches) == 12 == g.counters.graph_launches
    topk_runs = {(k.correlation_id, k.graph_node_id): k for k in kernels if k.name == GRAPH_TOPK}
    # 2 eager launches + 2 watched nodes x 12 replays, each logged by the kernel as it ran
    assert set(g.wrote) == set(topk_runs) and len(g.wrote) == 26
    assert {c for c, n in g.wrote if n} == set(graph_launches)

    watched = {(w.correlation_id, w.graph_node_id): w for w in by_type(g.records, WatchedBuffer)}
    assert len(watched) == len(by_type(g.records, WatchedBuffer)) == 26 == g.raw["buffers_copied"]
    for key, values in g.wrote.items():
        w = watched[key]
        assert w.data == array("i", values).tobytes(), key  # byte-equal to what this very run wrote
        assert (w.kernel, w.arg_index, w.dtype, w.shape) == (GRAPH_TOPK, 0, "int32", (4, 2))
        assert w.graph_id == topk_runs[key].graph_id  # 0 for the eager launches
    # Every replay wrote other ids, and each copy has its own replay's.
    per_node: dict[int, set[bytes]] = {}
    for (_, node), w in watched.items():
        per_node.setdefault(node, set()).add(w.data)
    assert sorted(len(v) for n, v in per_node.items() if n) == [4, 4, 8, 8]
    # Re-instantiated with new buffers (B), updated with new ones (C), one node given a new buffer
    # (D): the executable's node ids stay through the updates, the copies follow the new pointers
    # (the values above are the new buffers' own: stale pointers would show the previous phase's
    # last ids).
    nodes_by_launch = [sorted(n for c, n in g.wrote if c == corr) for corr in graph_launches]
    assert (
        len({tuple(n) for n in nodes_by_launch[:4]}) == 1
        and len({tuple(n) for n in nodes_by_launch[4:]}) == 1
    )
    assert nodes_by_launch[0] != nodes_by_launch[4]


def test_graph_resolved_from_the_clones_when_instantiation_names_no_source_graph(
    build: Path, shm_name: str
) -> None:
    """Should GRAPHEXEC_CREATED come without its source graph, the original nodes the
    instantiation reported as cloned are read instead: the same copies (graph id unknown: 0)."""
    g = GraphRun(build, shm_name, STUB_CUDA_EXEC_CREATED_WITHOUT_GRAPH="1")
    assert g.counters.errors == [] and (g.syncs, g.violations) == (0, 0)
    watched = {(w.correlation_id, w.graph_node_id): w for w in by_type(g.records, WatchedBuffer)}
    assert set(watched) == set(g.wrote) and len(watched) == 26
    for key, values in g.wrote.items():
        assert watched[key].data == array("i", values).tobytes()
        assert watched[key].graph_id == 0


def test_graph_copies_carry_the_replayed_node_ids_when_clones_are_reported_before_instantiation(
    build: Path, shm_name: str
) -> None:
    """The H200 run of 2026-12-04 (results/gpu_check/): every graph copy carried its source node's
    id and every replayed kernel a clone's, so no copy joined its kernel. A driver that reports the
    clones before GRAPHEXEC_CREATE_STARTING gives that when the library keeps only the reports
    after it: the copies must carry the ids the replayed kernels' activity records carry, and
    every watched kernel of a replay must then be marked captured by the correlator."""
    g = GraphRun(build, shm_name, STUB_CUDA_CLONES_BEFORE_STARTING="1")
    assert g.counters.errors == [] and (g.syncs, g.violations) == (0, 0)
    watched = {(w.correlation_id, w.graph_node_id): w for w in by_type(g.records, WatchedBuffer)}
    replayed = {
        (k.correlation_id, k.graph_node_id)
        for k in by_type(g.records, KernelActivity)
        if k.name == GRAPH_TOPK and k.graph_node_id
    }
    assert len(replayed) == 24
    assert {key for key in watched if key[1]} == replayed
    for key, values in g.wrote.items():
        assert watched[key].data == array("i", values).tobytes(), key
    c = KernelCorrelator()
    c.add_steps(HostStep(n, tid, t0, t1, g.pid) for n, tid, t0, t1 in g.steps)
    c.add(g.records)
    k = c.flush(final=True)["kernels"]
    topk = [cap for name, cap in zip(k["name"], k["buffer_captured"], strict=True) if name == GRAPH_TOPK]
    assert len(topk) == 26 and all(topk)


def test_graph_rows_through_the_python_side(graph_run: GraphRun) -> None:
    """The correlator with the engine's own step windows (step 0 eager, then one per replay): each
    replay's kernels join their step by the graph launch's thread and time; only the watched nodes
    say buffer_captured; routes carry the ids each replay wrote, layer 0 and 1 in capture order."""
    check_graph_rows(graph_run)


def test_graph_rows_are_the_same_when_clones_are_reported_before_instantiation(
    build: Path, shm_name: str
) -> None:
    """The same rows, graph replays and the eager step alike, in the clone order the H200 run implies."""
    check_graph_rows(GraphRun(build, shm_name, STUB_CUDA_CLONES_BEFORE_STARTING="1"))


def check_graph_rows(g: GraphRun) -> None:
    c = KernelCorrelator()
    c.add_steps(HostStep(n, tid, t0, t1, g.pid) for n, tid, t0, t1 in g.steps)
    c.add(g.records)
    tables = c.flush(final=True)
    k = tables["kernels"]
    rows = [dict(zip(k, vals, strict=True)) for vals in zip(*k.values(), strict=True)]
    graph_rows = [r for r in rows if r["graph_id"] is not None]
    assert len(graph_rows) == 36  # 12 replays x 3 nodes
    launches = sorted({r["correlation_id"] for r in graph_rows})
    for r in graph_rows:
        step = 1 + launches.index(r["correlation_id"])  # step 0 is the eager one
        assert (r["step_id"], r["join"], r["api"]) == (step, "thread", "cuGraphLaunch")
        assert r["graph_node_id"] is not None
        assert r["buffer_captured"] is (r["name"] == GRAPH_TOPK)
    routes = tables["routes"]
    got: dict[tuple[int, int], list[list[int]]] = {}
    for route_step, row, layer, ids in zip(
        routes["step_id"], routes["row"], routes["layer"], routes["expert_ids"], strict=True
    ):
        assert isinstance(route_step, int) and isinstance(layer, int) and isinstance(ids, list)
        got.setdefault((route_step, layer), []).append(ids)
        assert row == len(got[(route_step, layer)]) - 1
    eager = sorted(key for key in g.wrote if key[1] == 0)
    assert [r["step_id"] for r in rows if (r["correlation_id"], 0) in eager] == [0, 0]
    expected = {(0, layer): g.wrote[key] for layer, key in enumerate(eager)}
    for replay_step, corr in enumerate(launches, start=1):
        n0, n1 = sorted(n for cc, n in g.wrote if cc == corr)
        expected |= {(replay_step, 0): g.wrote[(corr, n0)], (replay_step, 1): g.wrote[(corr, n1)]}
    assert got == {key: [v[i * 2 : i * 2 + 2] for i in range(4)] for key, v in expected.items()}


def test_gpu_check_graph_analysis_on_the_stub_run(
    graph_run: GraphRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scripts/gpu_check.py's graph analysis (what decides the GPU run) applied to the stub run:
    the kernel's own log of each replay stands for PyTorch's static top-k tensors."""
    from sparseety_prof.gpu import records as records_mod

    spec = importlib.util.spec_from_file_location("gpu_check_under_test", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setitem(sys.modules, "records", records_mod)
    monkeypatch.setattr(gpu_check, "KERNEL", "topk_graph_kernel")
    monkeypatch.setattr(gpu_check, "LAYERS", 2)
    replays = {c for c, n in graph_run.wrote if n}
    expected = b"".join(
        array("i", graph_run.wrote[key]).tobytes() for key in sorted(k for k in graph_run.wrote if k[1])
    )
    (tmp_path / "topk.bin").write_bytes(expected)
    info = {"replays": len(replays), "pointers": [[1, 2], [3, 4]]}
    res = gpu_check.analyse_graphs(graph_run.records, tmp_path, info)
    assert res["graph_topk_equal"] and res["graph_node_ids_match"] and res["graph_new_pointers"]
    assert (
        res["graph_watched_buffers"],
        res["graph_watched_expected"],
        res["graph_topk_mismatched_copies"],
    ) == (
        24,
        24,
        0,
    )
    (tmp_path / "topk.bin").write_bytes(expected[:-1] + bytes([expected[-1] ^ 1]))  # one id off
    res = gpu_check.analyse_graphs(graph_run.records, tmp_path, info)
    assert not res["graph_topk_equal"] and res["graph_topk_mismatched_copies"] == 1
    first = next(r for r in graph_run.records if isinstance(r, WatchedBuffer) and r.graph_node_id)
    lost = gpu_check.analyse_graphs([r for r in graph_run.records if r is not first], tmp_path, info)
    assert not lost["graph_node_ids_match"] and lost["graph_watched_buffers"] == 23


# ---------------------------------------------------------------- the reader on damaged rings


def write_ring(
    path: Path,
    *,
    magic: int = MAGIC,
    version: int = 1,
    capacity: int = 4096,
    size: int | None = None,
    data: bytes = b"",
    head: int | None = None,
) -> None:
    buf = bytearray(HEADER_SIZE + capacity)
    struct.pack_into("<QIIQII", buf, 0, magic, version, HEADER_SIZE, capacity, 1, CLOCK_MONOTONIC)
    buf[HEADER_SIZE : HEADER_SIZE + len(data)] = data
    struct.pack_into("<Q", buf, 64, len(data) if head is None else head)
    path.write_bytes(bytes(buf[: size if size is not None else len(buf)]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"magic": 0}, "bad magic"),
        ({"version": 7}, "format version 7"),
        ({"size": 100}, "truncated"),
        ({"size": HEADER_SIZE + 1024}, "truncated"),
        ({"capacity": 5000}, "corrupt header"),
        ({"data": struct.pack("<IHH", 12, 2, 0) + bytes(8)}, "corrupt record"),
        ({"data": struct.pack("<IHH", 16, 2, 0) + bytes(8)}, "too short"),
        ({"data": struct.pack("<IHH", 16, 2, 0) + bytes(8), "head": 8}, "corrupt record"),
        (  # a graph replay's buffer must name its node: without it, it would join no kernel
            {
                "data": struct.pack("<IHH", 96, 6, 0)
                + struct.pack("<QIIIIIIQ4Q", 1, 1, 1, 0, 5, 1, 0, 0, 0, 0, 0, 0)
                + bytes(16)
            },
            "has no node id",
        ),
    ],
)
def test_reader_rejects_damaged_rings_clearly(tmp_path: Path, kwargs: dict[str, int], message: str) -> None:
    path = tmp_path / "ring"
    write_ring(path, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(RingError, match=message):
        ShmRing(path).drain()


def test_reader_skips_pad_and_unknown_records(tmp_path: Path) -> None:
    err = b"boom"
    data = struct.pack("<IHH", 8, 0x50, 0) + struct.pack("<IHH", 16, 99, 0) + bytes(8)
    data += struct.pack("<IHH", 24, 5, 0) + struct.pack("<iI", -1, 4) + err + bytes(4)
    write_ring(tmp_path / "ring", data=data)
    with ShmRing(tmp_path / "ring") as ring:
        assert ring.drain() == []
        assert ring.counters().errors == ["boom (code -1)"]
        assert ring.read_tail == len(data)
        raw = (tmp_path / "ring").read_bytes()
        assert struct.unpack_from("<Q", raw, 128)[0] == len(data)  # stored for the producers
        assert raw[HEADER_SIZE : HEADER_SIZE + len(data)] == bytes(len(data))  # zeroed for the producers


def test_find_rings_covers_descendant_processes(tmp_path: Path) -> None:
    write_ring(tmp_path / "src")
    child = MappingProcess(tmp_path / "sparseety-prof-cupti.{pid}", copy_from=tmp_path / "src")
    try:
        assert child.pid in descendants(os.getpid())
        (tmp_path / "sparseety-prof-cupti.1").write_bytes(b"")  # init: not ours
        found = find_rings(os.getpid(), shm_dir=tmp_path)
        assert [(f.path, f.pid) for f in found] == [
            (tmp_path / f"sparseety-prof-cupti.{child.pid}", child.pid)
        ]
        assert found[0].mapped.inode == os.stat(child.path).st_ino
    finally:
        child.close()


# ---------------------------------------------------------------- launch


def test_launch_sets_injection_env_and_returns_exit_code(
    build: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    dump = tmp_path / "env.json"
    code = f"import json, os, sys; json.dump(dict(os.environ), open({str(dump)!r}, 'w')); sys.exit(3)"
    parser = argparse.ArgumentParser()
    launch_mod.add_arguments(parser)
    args = parser.parse_args(["--watch", WATCH, "--sample-every", "4", "--", sys.executable, "-c", code])
    lib = build / "libsparseety_cupti.so"
    rc = launch_mod.launch(args.command[1:], watch=args.watch, sample_every=args.sample_every, library=lib)
    assert rc == 3
    env = json.loads(dump.read_text())
    assert (
        env["CUDA_INJECTION64_PATH"] == str(lib.resolve())
        and Path(env["CUDA_INJECTION64_PATH"]).is_absolute()
    )
    assert (env["SPARSEETY_WATCH"], env["SPARSEETY_SAMPLE_EVERY"]) == (WATCH, "4")
    assert "SPARSEETY_RING_BYTES" not in env
    err = capfd.readouterr().err  # sudo only for a user who is not root
    assert "sparseety-prof attach -p" in err and ("sudo" in err) == (os.geteuid() != 0)


def test_launch_refuses_without_built_library(tmp_path: Path) -> None:
    with pytest.raises(CuptiLibraryMissing, match="not built: run `sparseety-prof build-cupti`"):
        launch_mod.launch(["true"], library=tmp_path / "missing.so")
    with pytest.raises(UsageError, match="no command given"):
        launch_mod.launch([], library=tmp_path / "missing.so")
    stand_in = tmp_path / "lib.so"  # only its presence is checked before the command starts
    stand_in.write_bytes(b"")
    with pytest.raises(CommandNotStarted, match="cannot start /nonexistent/engine: No such file"):
        launch_mod.launch(["/nonexistent/engine"], library=stand_in)
    with pytest.raises(UsageError, match=r"watch file .*absent\.txt does not exist"):
        launch_mod.launch(["true"], library=stand_in, watch_file=str(tmp_path / "absent.txt"))


@pytest.mark.parametrize(
    ("argv", "library", "code", "says"),
    [
        (["--", "true"], "missing.so", CUPTI_LIBRARY_MISSING, "not built: run `sparseety-prof build-cupti`"),
        ([], "missing.so", 2, "no command given"),
        (["--", "/nonexistent/engine"], "lib.so", 127, "cannot start /nonexistent/engine"),
        (["--watch", "k:0:int32:4:x", "--", "true"], "lib.so", 2, "--watch/--preset:"),
    ],
)
def test_launch_exits_with_the_projects_codes(
    tmp_path: Path, argv: list[str], library: str, code: int, says: str
) -> None:
    """`sparseety-prof launch` as a user runs it: each refusal its exit code (docs/exit-codes.md)
    and one `sparseety-prof: error:` line."""
    (tmp_path / "lib.so").write_bytes(b"")
    r = subprocess.run(
        [sys.executable, "-m", "sparseety_prof.cli", "launch", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SPARSEETY_CUPTI_LIB": str(tmp_path / library)},
        cwd=ROOT,
    )
    assert r.returncode == code, r.stderr
    assert r.stderr.startswith("sparseety-prof: error: ") and says in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr


# ---------------------------------------------------------------- the GPU check script


def test_gpu_check_fails_fast_and_clearly_without_gpu() -> None:
    has_gpu = Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia").exists()
    if has_gpu:
        pytest.skip("this machine has a GPU: run scripts/gpu_check.sh itself")
    t = time.monotonic()
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=120
    )
    assert r.returncode != 0
    assert "gpu_check:" in r.stderr and ("no GPU" in r.stderr or "torch" in r.stderr), r.stderr
    assert time.monotonic() - t < 60


def test_gpu_check_dry_run_and_help_need_no_gpu(tmp_path: Path) -> None:
    """--dry-run names the project's own commands of the Python-tables cases; gpu_check.sh puts a
    packed dependency folder on PYTHONPATH (and says so) only where the interpreter lacks polars.
    The interpreter here is a bare python3 without polars, like a GPU machine's might be."""
    bare = shutil.which("python3", path="/usr/bin:/bin")
    assert bare is not None
    has_polars = subprocess.run([bare, "-c", "import polars"], capture_output=True).returncode == 0
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "--tables-steps" in r.stdout and "--dry-run" in r.stdout
    # a stand-in for build/gpu_pydeps.tar.xz in a copy of the scripts: a module the run can import
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("gpu_check.sh", "gpu_check.py"):
        shutil.copy(ROOT / "scripts" / name, repo / "scripts" / name)
    (repo / "build").mkdir()
    pkg = tmp_path / "pkg"
    (pkg / "main" / "packed_marker").mkdir(parents=True)
    (pkg / "main" / "packed_marker" / "__init__.py").write_text("")
    (pkg / "numpy").mkdir()
    subprocess.run(
        ["tar", "-cJf", str(repo / "build" / "gpu_pydeps.tar.xz"), "-C", str(pkg), "."], check=True
    )
    (repo / "build" / "gpu_pydeps.tar.xz.versions").write_text("polars-test.dist-info")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPARSEETY_GPU_CHECK_PYDEPS")}
    r = subprocess.run(
        ["bash", str(repo / "scripts" / "gpu_check.sh"), "--dry-run", "--tables-steps", "7"],
        env=env | {"PYTHON": bare},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["tables"]["steps"] == 7
    assert plan["tables"]["launch"][1] == "sparseety-prof record --pid <loop> -o <dir>"
    assert "--late-attach --watch topk_hist_kernel:0:int32:8,2" in plan["tables"]["late_attach"][1]
    if has_polars:
        assert plan["tables"]["python_deps"] == "the interpreter's own"
    else:
        assert plan["tables"]["python_deps"] == "build/gpu_pydeps.tar.xz (polars-test.dist-info)"
        unpacked = plan["tables"]["pythonpath"].split(":")
        assert Path(unpacked[0]).name == "main" and unpacked[0].startswith("/tmp/sparseety-gpucheck-deps.")
        has_numpy = subprocess.run([bare, "-c", "import numpy"], capture_output=True).returncode == 0
        assert (len(unpacked) > 1 and Path(unpacked[1]).name == "numpy") is not has_numpy
    assert not list(Path("/tmp").glob("sparseety-gpucheck-deps.*"))  # unpacked for the run only


def test_gpu_check_reads_the_driver_version_and_names_its_result_file(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gpu_check_facts", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    open_module = (
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.133.20  Release Build  (dvs@U16)\n"
        "GCC version:  gcc version 12.3.0\n"
    )
    legacy = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
    assert gpu_check.driver_version(open_module) == "570.133.20"
    assert gpu_check.driver_version(legacy) == "535.104.05"
    assert gpu_check.driver_version("") is None
    report = {"date": "2026-12-01T09:55:00+00:00", "device": "NVIDIA H200", "ok": True}
    path = gpu_check.write_results(report, tmp_path / "results")
    assert path.name == "2026-12-01T095500Z-nvidia-h200.json"
    assert json.loads(path.read_text()) == report


def test_reader_loads_by_file_path_without_the_package(tmp_path: Path) -> None:
    # As scripts/gpu_check.py does on a machine without polars: records.py, errors.py, proc_maps.py,
    # untrusted_files.py, process_match.py, then shm_ring.py by path.
    write_ring(tmp_path / "ring")
    code = f"""
import importlib.util, os, sys
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod)
    return mod
load("records", {str(ROOT / "sparseety_prof/gpu/records.py")!r})
load("errors", {str(ROOT / "sparseety_prof/errors.py")!r})
load("proc_maps", {str(ROOT / "sparseety_prof/capture/proc_maps.py")!r})
load("untrusted_files", {str(ROOT / "sparseety_prof/capture/untrusted_files.py")!r})
load("process_match", {str(ROOT / "sparseety_prof/capture/process_match.py")!r})
shm_ring = load("shm_ring", {str(ROOT / "sparseety_prof/gpu/shm_ring.py")!r})
ring = shm_ring.ShmRing({str(tmp_path / "ring")!r})
assert ring.drain() == [] and shm_ring.find_rings(os.getpid()) == []  # this process maps no ring
assert "sparseety_prof" not in sys.modules and "polars" not in sys.modules
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.stdout == "ok\n", r.stderr
