"""The one device check of the CUPTI injection library (run by scripts/gpu_check.sh on a GPU machine).

Needs only what such a machine has preinstalled: Python with torch, triton and nvidia-cuda-cupti.
The library comes prebuilt in cupti_ext/build/ (built on a machine without a GPU). No polars, no
BCC: `records.py`, `errors.py`, `capture/proc_maps.py`, `capture/untrusted_files.py`,
`capture/process_match.py`, `shm_ring.py` and `launch.py` are loaded by file path.

A small MoE decode loop (hidden 1024, 16 experts, top-2, 4 layers, 8 sequences, greedy next token
from a 4096-entry vocab head, 1000 timed steps) runs in child processes in three modes: library
off, library on (kernels only), library on with the top-k ids watched (argument 0 of the Triton
kernel `topk_hist_kernel`, copied after every launch, and the same ids through a CUDA C++ kernel
launched with <<<>>>, the runtime-API path); after one discarded warm-up run, 3 rounds
with the modes in rotating order, tokens/s reported per run and as medians. The ring is drained
directly while each child runs.
Then the same decode step captured as a `torch.cuda.CUDAGraph` and replayed (mode "graphs", once):
the watched Triton kernel is a node of the graph, so its top-k ids are copied after every replay
from the pointers the library resolved when the graph was instantiated; half-way the step is
captured again into a new graph (new static tensors: new pointers) and the first graph is dropped.
Every replay's copies must be byte-equal to PyTorch's static top-k tensors of that replay, and
each copy's (correlation id, graph node id) must be that of a kernel record of the watched kernel.

Then the Python-tables cases, through the project's own commands (they need polars and rich, which
gpu_check.sh brings from build/gpu_pydeps.tar.xz where the machine lacks them, and root): the eager
loop started under `sparseety-prof launch --watch`, recorded by `sparseety-prof record` (GPU only),
and started without injection, recorded by `sparseety-prof record --late-attach --watch`; each
recording's `routes` and `kernels` tables are checked against PyTorch's top-k tensors of every step.

Prints one JSON object and writes it to `--results` (default results/gpu_check/, one file per run
named by date and device, with the date, driver and device in it); exit 0 when every check passed,
1 when one failed, 2 when the machine cannot run the check at all (no GPU, no torch, library not
built). The CUDA C++ kernel is built
once with torch's load_inline (nvcc, ~1 min); where that fails the other checks still run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from array import array
from pathlib import Path
from types import ModuleType
from typing import Any

try:  # only the child needs triton; the parent must still start (and fail clearly) without it
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "sparseety_prof" / "gpu"
# gpu/launch.py, loaded by path, imports the package's standard-library modules (capture/resources.py)
sys.path.insert(0, str(ROOT))
LIB = ROOT / "cupti_ext" / "build" / "libsparseety_cupti.so"
KERNEL = "topk_hist_kernel"
WATCH = f"{KERNEL}:0:int32:arg2"  # topk_ids pointer is arg 0, its element count the int32 arg 2
# A CUDA C++ kernel launched with <<<>>> (a runtime-API launch, as vLLM's moe_align_block_size
# is), built on the machine with torch's load_inline: the runtime launch path of the watch.
RT_KERNEL = "sparseety_copy_ids_kernel"
RT_WATCH = f"{RT_KERNEL}:0:int32:arg2"
RT_CPP = "torch::Tensor copy_ids(torch::Tensor ids);"
RT_CUDA = """
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
__global__ void sparseety_copy_ids_kernel(const int* ids, int* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = ids[i];
}
torch::Tensor copy_ids(torch::Tensor ids) {
    auto out = torch::empty_like(ids);
    int n = (int)ids.numel();
    sparseety_copy_ids_kernel<<<(n + 127) / 128, 128, 0, at::cuda::getCurrentCUDAStream()>>>(
        ids.data_ptr<int>(), out.data_ptr<int>(), n);
    return out;
}
"""
HIDDEN, EXPERTS, TOPK, LAYERS, BATCH, VOCAB, FFN = 1024, 16, 2, 4, 8, 4096, 512
# The Python-tables cases need (rows, k) buffers to get `routes`: the same pointer, shaped by constants
TABLES_WATCH = f"{KERNEL}:0:int32:{BATCH},{TOPK}"
WARMUP = 10
RESULTS = ROOT / "results" / "gpu_check"

if HAVE_TRITON:

    @triton.jit
    def topk_hist_kernel(topk_ids_ptr, hist_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        ids = tl.load(topk_ids_ptr + offs, mask=mask, other=0)
        tl.atomic_add(hist_ptr + ids, 1, mask=mask)


def fail(msg: str, code: int = 2) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr)
    sys.exit(code)


def load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------- child: the decode loop


def runtime_ext(build_dir: Path) -> Any:
    """The CUDA C++ extension (built on first use, then loaded from build_dir)."""
    from torch.utils.cpp_extension import load_inline

    build_dir.mkdir(parents=True, exist_ok=True)
    return load_inline(
        name="sparseety_gpucheck_ext",
        cpp_sources=RT_CPP,
        cuda_sources=RT_CUDA,
        functions=["copy_ids"],
        build_directory=str(build_dir),
        extra_cuda_cflags=["-O2"],
        verbose=False,
    )


def make_model(torch: Any, dev: Any) -> tuple[Any, Any, list[tuple[Any, Any, Any]]]:
    """Embedding, vocab head and per layer (router, w1, w2): the same weights in every child."""
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape: int) -> Any:
        return (torch.randn(*shape, generator=g, device=dev) * 0.05).to(torch.bfloat16)

    emb, head = rnd(VOCAB, HIDDEN), rnd(HIDDEN, VOCAB)
    layers = [
        (rnd(HIDDEN, EXPERTS), rnd(EXPERTS, HIDDEN, FFN), rnd(EXPERTS, FFN, HIDDEN)) for _ in range(LAYERS)
    ]
    return emb, head, layers


def child(steps: int, out: Path, ext_dir: Path | None) -> None:
    import torch

    ext = runtime_ext(ext_dir) if ext_dir is not None else None

    t_begin = time.monotonic_ns()
    dev = torch.device("cuda")
    bf = torch.bfloat16
    emb, head, layers = make_model(torch, dev)
    hist = torch.zeros(EXPERTS, dtype=torch.int32, device=dev)
    tokens = torch.arange(BATCH, device=dev) % VOCAB
    kept: list[Any] = []

    def step(tokens: Any, keep: bool) -> Any:
        x = emb[tokens]
        for router, w1, w2 in layers:
            probs = torch.softmax((x @ router).float(), dim=-1)
            weights, ids = torch.topk(probs, TOPK, dim=-1)
            topk_ids = ids.to(torch.int32).contiguous()
            n = topk_ids.numel()
            topk_hist_kernel[(triton.cdiv(n, 128),)](topk_ids, hist, n, BLOCK=128)
            if ext is not None:
                ext.copy_ids(topk_ids)  # the same ids again, through a runtime-API launch
            if keep:
                kept.append(topk_ids.clone())
            h = torch.einsum("bh,bkhf->bkf", x, w1[ids.flatten()].view(BATCH, TOPK, HIDDEN, FFN))
            h = torch.nn.functional.silu(h)
            y = torch.einsum("bkf,bkfh->bkh", h, w2[ids.flatten()].view(BATCH, TOPK, FFN, HIDDEN))
            x = x + (y * weights.to(bf).unsqueeze(-1)).sum(1)
        nxt = torch.argmax((x @ head).float(), dim=-1)
        nxt.tolist()  # the device-to-host copy of the sampled ids that closes a step in Python engines
        return nxt

    for _ in range(WARMUP):
        tokens = step(tokens, keep=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens = step(tokens, keep=True)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    with open(out / "topk.bin", "wb") as f:
        for t in kept:
            f.write(t.cpu().numpy().tobytes())
    info = {
        "pid": os.getpid(),
        "tokens_per_s": BATCH * steps / dt,
        "t_begin": t_begin,
        "t_end": time.monotonic_ns(),
    }
    (out / "child.json").write_text(json.dumps(info))


def graph_child(steps: int, out: Path) -> None:
    """The decode step as a CUDA graph: captured once, replayed `steps // 2` times, captured again
    into a new graph (new static tensors, so new pointers; the first graph is then dropped) and
    replayed for the rest. After each replay the static top-k tensors are cloned on the same
    stream: those clones are PyTorch's ids of that replay, in layer order."""
    import torch

    t_begin = time.monotonic_ns()
    dev = torch.device("cuda")
    bf = torch.bfloat16
    emb, head, layers = make_model(torch, dev)
    hist = torch.zeros(EXPERTS, dtype=torch.int32, device=dev)

    def step(tokens: Any, topk_out: list[Any]) -> Any:
        x = emb[tokens]
        for router, w1, w2 in layers:
            probs = torch.softmax((x @ router).float(), dim=-1)
            weights, ids = torch.topk(probs, TOPK, dim=-1)
            topk_ids = ids.to(torch.int32).contiguous()
            n = topk_ids.numel()
            topk_hist_kernel[(triton.cdiv(n, 128),)](topk_ids, hist, n, BLOCK=128)
            topk_out.append(topk_ids)
            h = torch.einsum("bh,bkhf->bkf", x, w1[ids.flatten()].view(BATCH, TOPK, HIDDEN, FFN))
            h = torch.nn.functional.silu(h)
            y = torch.einsum("bkf,bkfh->bkh", h, w2[ids.flatten()].view(BATCH, TOPK, FFN, HIDDEN))
            x = x + (y * weights.to(bf).unsqueeze(-1)).sum(1)
        return torch.argmax((x @ head).float(), dim=-1)

    def capture(tokens: Any) -> tuple[Any, Any, Any, list[Any]]:
        static_tokens = tokens.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture: Triton compiles here
            for _ in range(3):
                step(static_tokens, [])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        static_ids: list[Any] = []
        with torch.cuda.graph(graph):
            static_out = step(static_tokens, static_ids)
        return graph, static_tokens, static_out, static_ids

    kept: list[Any] = []
    pointers: list[list[int]] = []
    tokens = torch.arange(BATCH, device=dev) % VOCAB
    replays = 0
    for phase_steps in (steps // 2, steps - steps // 2):
        # The previous graph (and its memory pool) lives on until this capture is instantiated, so
        # the new static tensors cannot reuse its addresses: the copies must follow new pointers.
        # Rebinding `graph` then destroys the previous executable graph.
        graph, static_tokens, static_out, static_ids = capture(tokens)
        pointers.append([t.data_ptr() for t in static_ids])
        for _ in range(phase_steps):
            graph.replay()
            kept.extend(t.clone() for t in static_ids)
            tokens = static_out.clone()
            tokens.tolist()  # the sampled ids reach the host: the step's end, as in a serving loop
            static_tokens.copy_(tokens)
            replays += 1
    torch.cuda.synchronize()
    with open(out / "topk.bin", "wb") as f:
        for t in kept:
            f.write(t.cpu().numpy().tobytes())
    info = {
        "pid": os.getpid(),
        "replays": replays,
        "pointers": pointers,
        "t_begin": t_begin,
        "t_end": time.monotonic_ns(),
    }
    (out / "child.json").write_text(json.dumps(info))


def tables_child(steps: int, out: Path) -> None:
    """The eager decode loop for the Python-tables cases: the model is put on the GPU (the process
    is a CUDA process from here on, which late attach needs), `ready` says so with the pid, and the
    loop starts only once the parent has `record` attached and touched `go`, so every step is
    recorded. PyTorch's own top-k tensors of every step and layer go to topk.bin."""
    import torch

    dev = torch.device("cuda")
    bf = torch.bfloat16
    emb, head, layers = make_model(torch, dev)
    hist = torch.zeros(EXPERTS, dtype=torch.int32, device=dev)
    torch.cuda.synchronize()
    (out / "ready.tmp").write_text(str(os.getpid()))
    os.replace(out / "ready.tmp", out / "ready")  # whole, or not there
    deadline = time.monotonic() + 120
    while not (out / "go").exists():
        if time.monotonic() > deadline:
            raise SystemExit("gpu_check tables child: no `go` within 120 s")
        time.sleep(0.01)
    tokens = torch.arange(BATCH, device=dev) % VOCAB
    kept: list[Any] = []
    for _ in range(steps):
        x = emb[tokens]
        for router, w1, w2 in layers:
            probs = torch.softmax((x @ router).float(), dim=-1)
            weights, ids = torch.topk(probs, TOPK, dim=-1)
            topk_ids = ids.to(torch.int32).contiguous()
            n = topk_ids.numel()
            topk_hist_kernel[(triton.cdiv(n, 128),)](topk_ids, hist, n, BLOCK=128)
            kept.append(topk_ids.clone())
            h = torch.einsum("bh,bkhf->bkf", x, w1[ids.flatten()].view(BATCH, TOPK, HIDDEN, FFN))
            h = torch.nn.functional.silu(h)
            y = torch.einsum("bkf,bkfh->bkh", h, w2[ids.flatten()].view(BATCH, TOPK, FFN, HIDDEN))
            x = x + (y * weights.to(bf).unsqueeze(-1)).sum(1)
        tokens = torch.argmax((x @ head).float(), dim=-1)
        tokens.tolist()  # the one device-to-host copy of a step: GPU-only `record` closes steps on it
    torch.cuda.synchronize()
    with open(out / "topk.bin", "wb") as f:
        for t in kept:
            f.write(t.cpu().numpy().tobytes())
    (out / "child.json").write_text(json.dumps({"pid": os.getpid(), "steps": steps}))


# ---------------------------------------------------------------- parent


def run_mode(
    mode: str, steps: int, tmp: Path, shm_ring: Any, launch: Any, ext_dir: Path | None = None
) -> dict[str, Any]:
    out = tmp
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARSEETY_", "CUDA_INJECTION64"))}
    if mode != "off":
        watch = (WATCH + (f";{RT_WATCH}" if ext_dir is not None else "")) if mode == "buffers" else None
        watch = WATCH if mode == "graphs" else watch
        env = launch.build_env(env, LIB, watch=watch, flush_ms=50)
        env["SPARSEETY_SHM_NAME"] = "sparseety-gpucheck.{pid}"
    p0 = time.monotonic_ns()
    # The children run on a fixed set of cores (not the parent's draining core) where the machine
    # has them: on a VM the scheduler otherwise moves a launch-bound loop around and tokens/s
    # varies by a third from run to run.
    cores = sorted(os.sched_getaffinity(0))
    child_cores = set(cores[1:5]) if len(cores) >= 5 else set(cores)

    def pin() -> None:
        os.sched_setaffinity(0, child_cores)

    proc = subprocess.Popen(
        [sys.executable, __file__, "--graph-child" if mode == "graphs" else "--child"]
        + ["--steps", str(steps), "--out", str(out)]
        + (["--ext", str(ext_dir)] if ext_dir is not None and mode != "graphs" else []),
        env=env,
        preexec_fn=pin,
    )
    ring_path = Path("/dev/shm") / f"sparseety-gpucheck.{proc.pid}"
    ring, records = None, []
    while True:
        done = proc.poll() is not None
        if mode != "off" and ring is None and ring_path.exists():
            try:
                ring = shm_ring.ShmRing(ring_path)
            except shm_ring.RingError:
                ring = None  # not initialised yet
        if ring is not None:
            records += ring.drain()
        if done:
            break
        time.sleep(0.05)
    p1 = time.monotonic_ns()
    result: dict[str, Any] = {"exit_code": proc.returncode}
    if proc.returncode != 0:
        return result
    info = json.loads((out / "child.json").read_text())
    if "tokens_per_s" in info:
        result["tokens_per_s"] = round(info["tokens_per_s"], 1)
    if mode == "off":
        return result
    if ring is None:
        result["injection_fired"] = False
        return result
    records += ring.drain()
    result |= analyse(records, ring, shm_ring, p0, p1, out if mode == "buffers" else None)
    if mode == "graphs":
        result |= analyse_graphs(records, out, info)
    ring.close()
    ring_path.unlink(missing_ok=True)
    return result


def analyse(
    records: list[Any], ring: Any, shm_ring: Any, p0: int, p1: int, out: Path | None
) -> dict[str, Any]:
    rec = sys.modules["records"]
    kernels = [r for r in records if isinstance(r, rec.KernelActivity)]
    launches = [r for r in records if isinstance(r, rec.LaunchApi)]
    watched = [r for r in records if isinstance(r, rec.WatchedBuffer)]
    c = ring.counters()
    stamps = [t for k in kernels for t in (k.start_ns, k.end_ns) if t] + [
        t for r in launches for t in (r.enter_ns, r.exit_ns)
    ]
    launched = {r.correlation_id for r in launches}
    uncovered: dict[str, int] = {}
    for k in kernels:
        if k.correlation_id not in launched:
            uncovered[k.name[:80]] = uncovered.get(k.name[:80], 0) + 1
    res: dict[str, Any] = {
        "injection_fired": True,
        "finished": ring.finished,
        "clock_domain": "monotonic" if ring.clock_domain == shm_ring.CLOCK_MONOTONIC else "cupti_default",
        "timestamps_in_window": bool(stamps) and all(p0 <= t <= p1 for t in stamps),
        "kernels": len(kernels),
        "untimed_kernels": sum(1 for k in kernels if k.start_ns == 0),
        "launch_records": len(launches),
        "launch_apis": sorted({r.api for r in launches}),
        "launch_coverage": round(
            sum(1 for k in kernels if k.correlation_id in launched) / max(len(kernels), 1), 4
        ),
        "uncovered_kernels": dict(sorted(uncovered.items(), key=lambda kv: -kv[1])[:5]),
        "memcpy_dtoh": sum(1 for r in records if isinstance(r, rec.MemcpyActivity) and r.kind == "DtoH"),
        "counters": {k: v for k, v in vars(c).items() if k != "errors"},
        "errors": c.errors,
        # The library's own time in the engine's launch path, robust where tokens/s is noisy.
        "callback_us_per_launch": round(c.callback_ns / 1000 / max(c.launches_seen, 1), 3),
    }
    if out is not None:
        expected = (out / "topk.bin").read_bytes()
        got = b"".join(w.data for w in sorted(watched, key=lambda w: w.correlation_id) if w.kernel == KERNEL)
        res["watched_buffers"] = len(watched)
        res["topk_bytes_expected"] = len(expected)
        res["topk_equal"] = got == expected
        res["topk_shapes"] = sorted({w.shape for w in watched})
        rt = [w for w in sorted(watched, key=lambda w: w.correlation_id) if RT_KERNEL in w.kernel]
        if rt:  # the runtime-API launches of the extension's kernel, watched the same way
            res["runtime_watched_buffers"] = len(rt)
            res["runtime_topk_equal"] = b"".join(w.data for w in rt) == expected
            res["runtime_launch_apis"] = sorted(
                {r.api for r in launches if r.correlation_id in {w.correlation_id for w in rt}}
            )
    return res


def analyse_graphs(records: list[Any], out: Path, info: dict[str, Any]) -> dict[str, Any]:
    """The graph replays' copies against PyTorch's static top-k tensors of each replay."""
    rec = sys.modules["records"]
    graph_watched = sorted(
        (r for r in records if isinstance(r, rec.WatchedBuffer) and r.graph_node_id),
        key=lambda w: (w.correlation_id, w.graph_node_id),  # replay order, then capture (layer) order
    )
    watched_kernels = {
        (k.correlation_id, k.graph_node_id)
        for k in records
        if isinstance(k, rec.KernelActivity) and k.graph_id and KERNEL in k.name
    }
    copied = [(w.correlation_id, w.graph_node_id) for w in graph_watched]
    expected = (out / "topk.bin").read_bytes()
    per_copy = len(expected) // max(info["replays"] * LAYERS, 1)
    got = b"".join(w.data for w in graph_watched)
    mismatched = sum(
        1 for i, w in enumerate(graph_watched) if w.data != expected[i * per_copy : (i + 1) * per_copy]
    )
    phases = info["pointers"]
    return {
        "graph_replays": info["replays"],
        "graph_watched_buffers": len(graph_watched),
        "graph_watched_expected": info["replays"] * LAYERS,
        "graph_topk_equal": got == expected,
        "graph_topk_mismatched_copies": mismatched,
        # every copy is tagged with the node id of a kernel record of the watched kernel, and every
        # such kernel execution has its copy
        "graph_node_ids_match": sorted(copied) == sorted(watched_kernels) and len(set(copied)) == len(copied),
        # where they differ: how many on each side, a few pairs of each, and the node ids on each
        # side (to tell node ids that differ from correlation ids that do)
        "graph_id_pairs": {
            "copies": len(copied),
            "copies_distinct": len(set(copied)),
            "kernels": len(watched_kernels),
            "copies_without_kernel": sorted(set(copied) - watched_kernels)[:6],
            "kernels_without_copy": sorted(watched_kernels - set(copied))[:6],
            "kernel_node_ids": sorted({n for _, n in watched_kernels})[:16],
            "copy_node_ids": sorted({n for _, n in copied})[:16],
            "all_graph_kernel_node_ids": sorted(
                {k.graph_node_id for k in records if isinstance(k, rec.KernelActivity) and k.graph_id}
            )[:64],
        },
        "graph_ids": sorted({w.graph_id for w in graph_watched}),
        "graph_new_pointers": len(phases) == 2 and not set(phases[0]) & set(phases[1]),
    }


def cli_env(pythonpath: str | None) -> dict[str, str]:
    """The environment the project's own CLI runs in here: this checkout first on PYTHONPATH, then
    the dependencies gpu_check.sh unpacked (if any), no injection settings of ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARSEETY_", "CUDA_INJECTION64"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), pythonpath) if p)
    return env


def python_tables_missing(env: dict[str, str]) -> str | None:
    """Why the project's Python side cannot run with this interpreter (None when it can)."""
    r = subprocess.run(
        [sys.executable, "-c", "import polars, rich, sparseety_prof.cli"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return None if r.returncode == 0 else r.stderr.strip().splitlines()[-1][-300:]


def wait_for(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.02)


def run_tables(case: str, steps: int, tmp: Path, env: dict[str, str]) -> dict[str, Any]:
    """One Python-tables case through the project's own commands. "launch": the loop started under
    `sparseety-prof launch --watch`, then `sparseety-prof record --pid N -o DIR` (GPU only).
    "late_attach": the loop started without injection, then `sparseety-prof record --pid N
    --late-attach --watch ... -o DIR`. The recording's tables are checked against PyTorch's ids.
    About 25 s each on an H200: torch import and CUDA start-up ~10 s, `record` start-up and the
    attach ~5 s, the steps < 1 s, writing and reading the recording ~5 s."""
    tmp.mkdir(parents=True)
    rec = tmp / "rec"
    cli = [sys.executable, "-m", "sparseety_prof.cli"]
    loop = [sys.executable, __file__, "--tables-child", "--steps", str(steps), "--out", str(tmp)]
    if case == "launch":
        argv = [*cli, "launch", "--watch", TABLES_WATCH, "--flush-ms", "50", "--", *loop]
        record = [*cli, "record", "--pid", "{pid}", "-o", str(rec)]
    else:
        argv = loop
        record = [*cli, "record", "--pid", "{pid}", "--late-attach", "--watch", TABLES_WATCH, "-o", str(rec)]
    result: dict[str, Any] = {"commands": [" ".join(argv[2:] if case == "launch" else ["<loop>"])]}
    engine_log = open(tmp / "engine.log", "w")  # noqa: SIM115 (closed in the finally below)
    engine = subprocess.Popen(argv, env=env, stdout=engine_log, stderr=engine_log, text=True)
    rec_proc: subprocess.Popen[str] | None = None
    pid = ""
    log = tmp / "record.log"
    try:
        wait_for(lambda: (tmp / "ready").exists() or engine.poll() is not None, 120, "ready loop")
        if engine.poll() is not None:
            return result | {
                "exit_code": engine.returncode,
                "engine_log": (tmp / "engine.log").read_text()[-1500:],
            }
        pid = (tmp / "ready").read_text().strip()
        cmd = [a.replace("{pid}", pid) for a in record]
        result["commands"].append(" ".join(cmd[2:]))
        with open(log, "w") as f:
            rec_proc = subprocess.Popen(cmd, env=env, stderr=f, stdout=f, text=True)
        wait_for(
            lambda: "attached to PID" in log.read_text() or rec_proc is None or rec_proc.poll() is not None,
            90,
            "`record` attached",
        )
        (tmp / "go").touch()
        engine.wait(timeout=120)
        rec_rc = rec_proc.wait(timeout=120)
    except (TimeoutError, subprocess.TimeoutExpired) as e:
        result["error"] = str(e)
        rec_rc = None
    finally:
        if engine.poll() is None and pid:
            with contextlib.suppress(ProcessLookupError):  # under `launch`, the loop is its child
                os.kill(int(pid), signal.SIGKILL)
        for p in (engine, rec_proc):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        engine_log.close()
    result |= {
        "exit_code": engine.returncode,
        "record_exit_code": rec_rc,
        "record_log": log.read_text()[-1500:] if log.exists() else "",
        "engine_log": (tmp / "engine.log").read_text()[-1500:],
    }
    if engine.returncode != 0 or rec_rc != 0 or not (tmp / "topk.bin").exists():
        return result
    return result | analyse_tables(rec, (tmp / "topk.bin").read_bytes(), LAYERS, BATCH, TOPK, KERNEL)


def analyse_tables(rec_dir: Path, topk: bytes, layers: int, rows: int, k: int, kernel: str) -> dict[str, Any]:
    """A GPU-only recording's `routes` and `kernels` against the engine's own int32 top-k ids
    (`topk`: per step, per layer, rows x k, in launch order). Routes of a step are its watched
    launches in order (layer = ordinal); GPU step ids count down from -1, so chronological order is
    by descending step id."""
    import polars as pl

    import sparseety_prof

    r = sparseety_prof.open(rec_dir)
    routes = r.routes().sort(["step_id", "layer", "row"], descending=[True, False, False])
    kernels = r.kernels()
    per_step = layers * rows * k
    n_steps = len(topk) // (4 * per_step)
    expected = [
        list(array("i", topk[i * 4 * k : (i + 1) * 4 * k])) for i in range(len(topk) // (4 * k))
    ]  # one list per (step, layer, row)
    got = [list(ids) for ids in routes["expert_ids"].to_list()]
    step_ids = routes["step_id"].unique().to_list()
    layers_per_step = routes.group_by("step_id").agg(pl.col("layer").n_unique().alias("n"))["n"].to_list()
    first_bad = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    watched = kernels.filter(kernels["name"].str.contains(kernel, literal=True))
    return {
        "routes_rows": routes.height,
        "routes_rows_expected": len(expected),
        "routes_steps": len(step_ids),
        "routes_steps_expected": n_steps,
        "routes_layers_per_step": sorted(set(layers_per_step)),
        "routes_equal": got == expected,
        "routes_first_mismatch": first_bad,
        "kernels_rows": kernels.height,
        "watched_kernel_rows": watched.height,
        "watched_kernels_captured": int(watched["buffer_captured"].sum()),
        "watched_kernel_joins": sorted(set(watched["join"].drop_nulls().to_list())),
        # every watched kernel is in the step its routes rows are in
        "watched_kernel_steps_match": sorted(watched["step_id"].drop_nulls().unique().to_list())
        == sorted(step_ids),
        "gpu_meta": {k2: v for k2, v in r.meta.get("gpu", {}).items() if k2 in ("join_mode", "late_attach")},
    }


def tables_ok(res: dict[str, Any], steps: int) -> bool:
    return (
        res.get("routes_equal") is True
        and res.get("routes_steps") == steps
        and res.get("watched_kernel_rows") == steps * LAYERS == res.get("watched_kernels_captured")
        and res.get("watched_kernel_joins") == ["gpu_step"]
        and res.get("watched_kernel_steps_match") is True
    )


def driver_version(proc_version: str) -> str | None:
    """The driver version from /proc/driver/nvidia/version's first line ("... Kernel Module
    570.133.20 ..." or "... Open Kernel Module for x86_64  570.133.20 ...")."""
    lines = proc_version.splitlines()
    if not lines:
        return None
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9]+(?:\.[0-9]+)+)", lines[0])
    return m.group(1) if m else lines[0].strip() or None


def machine_facts(torch: Any) -> dict[str, Any]:
    """Date, driver and device of this run, for the results file."""
    try:
        driver = driver_version(Path("/proc/driver/nvidia/version").read_text())
    except OSError:
        driver = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "driver": driver,
        "device": torch.cuda.get_device_name(0),
        "cuda_runtime": torch.version.cuda,
    }


def write_results(report: dict[str, Any], results: Path) -> Path:
    """The report as results/gpu_check/<date>-<device>.json (kept in the repository)."""
    results.mkdir(parents=True, exist_ok=True)
    stamp = str(report["date"]).replace(":", "").replace("+0000", "Z")
    device = re.sub(r"[^A-Za-z0-9]+", "-", str(report["device"])).strip("-").lower()
    path = results / f"{stamp}-{device}.json"
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return path


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """What a run does, for --dry-run (and the smoke test): no GPU, torch or polars needed."""
    return {
        "library": str(LIB),
        "library_built": LIB.is_file(),
        "eager_modes": ["off", "kernels", "buffers"],
        "rounds": args.rounds,
        "steps": args.steps,
        "graph_replays": args.graph_steps,
        "watch": WATCH,
        "tables": {
            "steps": args.tables_steps,
            "launch": [
                f"sparseety-prof launch --watch {TABLES_WATCH} --flush-ms 50 -- <loop>",
                "sparseety-prof record --pid <loop> -o <dir>",
            ],
            "late_attach": [
                "<loop> (no injection)",
                f"sparseety-prof record --pid <loop> --late-attach --watch {TABLES_WATCH} -o <dir>",
            ],
            "python_deps": os.environ.get("SPARSEETY_GPU_CHECK_PYDEPS") or "the interpreter's own",
            "pythonpath": os.environ.get("PYTHONPATH", ""),
        },
        "results": str(args.results),
    }


def run_all_tables(steps: int, tmp: Path) -> dict[str, Any]:
    """Both Python-tables cases, or why they cannot run on this machine."""
    env = cli_env(os.environ.get("PYTHONPATH"))
    deps = os.environ.get("SPARSEETY_GPU_CHECK_PYDEPS") or "the interpreter's own"
    missing = python_tables_missing(env)
    if missing is not None:
        return {"python_deps": deps, "not_run": f"the project's Python side does not import here: {missing}"}
    if os.geteuid() != 0:
        return {"python_deps": deps, "not_run": "`record` (and late attach) need root here"}
    out: dict[str, Any] = {"python_deps": deps}
    for case in ("launch", "late_attach"):
        print(f"gpu_check: Python tables, {case}", file=sys.stderr, flush=True)
        out[case] = run_tables(case, steps, tmp / case, env)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--graph-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--graph-steps", type=int, default=200, help="CUDA graph replays in the graphs mode (default 200)"
    )
    ap.add_argument(
        "--results", type=Path, default=RESULTS, help=f"folder for the JSON result (default {RESULTS})"
    )
    ap.add_argument("--steps", type=int, default=1000, help="decode steps timed per run (default 1000)")
    # 3 rounds: each run is a new process (torch and Triton start-up, ~10 s on an H200), and the
    # whole check is to fit in 4 minutes there (5 rounds took 347 s)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each mode, in rotating order (default 3)")
    ap.add_argument("--tables-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--tables-steps",
        type=int,
        default=50,
        help="decode steps of each Python-tables case (launch, late attach; default 50)",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print the cases and the sparseety-prof commands they run, as JSON, and exit (no GPU needed)",
    )
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--ext", type=Path, help=argparse.SUPPRESS)
    ap.add_argument(
        "--no-runtime-kernel",
        action="store_true",
        help="skip the CUDA C++ kernel (built with torch's load_inline) that checks runtime-API launches",
    )
    args = ap.parse_args()
    if args.child:
        child(args.steps, args.out, args.ext)
        return 0
    if args.graph_child:
        graph_child(args.steps, args.out)
        return 0
    if args.tables_child:
        tables_child(args.steps, args.out)
        return 0
    if args.dry_run:
        print(json.dumps(plan(args), indent=1))
        return 0

    t_check = time.monotonic()
    if not (Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia").exists()):
        fail("no GPU on this machine (no /dev/nvidiactl, no NVIDIA driver): run this on the GPU machine")
    try:
        import torch
    except ImportError:
        fail(f"torch is not importable by {sys.executable}: run with the machine's Python stack (PYTHON=...)")
    if not HAVE_TRITON:
        fail(f"triton is not importable by {sys.executable}")
    if not torch.cuda.is_available():
        fail("torch sees no GPU (torch.cuda.is_available() is False)")
    if not LIB.is_file():
        fail(f"{LIB} is missing: build it with `bash cupti_ext/build.sh` and carry cupti_ext/build/")
    load("records", GPU / "records.py")
    load("errors", ROOT / "sparseety_prof" / "errors.py")
    load("proc_maps", ROOT / "sparseety_prof" / "capture" / "proc_maps.py")
    load("untrusted_files", ROOT / "sparseety_prof" / "capture" / "untrusted_files.py")
    load("process_match", ROOT / "sparseety_prof" / "capture" / "process_match.py")
    shm_ring = load("shm_ring", GPU / "shm_ring.py")
    launch = load("sparseety_launch", GPU / "launch.py")
    libcupti = launch.find_libcupti()

    import tempfile

    report: dict[str, Any] = machine_facts(torch) | {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "libcupti": str(libcupti) if libcupti else None,
    }
    modes = ("off", "kernels", "buffers")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="sparseety-gpucheck-") as tmp:
        ext_dir: Path | None = None
        if not args.no_runtime_kernel:
            # built once here (nvcc, ~1 min), loaded by every child from the same directory
            print("gpu_check: building the CUDA C++ kernel (torch load_inline)", file=sys.stderr, flush=True)
            t_build = time.monotonic()
            try:
                runtime_ext(Path(tmp) / "ext")
                ext_dir = Path(tmp) / "ext"
                report["runtime_kernel"] = f"built in {time.monotonic() - t_build:.0f} s"
            except Exception as e:  # no nvcc, no ninja: the other checks still run
                report["runtime_kernel"] = f"not built: {type(e).__name__}: {str(e)[-400:]}"
        # One discarded run first: the GPU leaves its idle clocks and the caches fill. Then the
        # modes rotate round by round, so no mode always runs first or last.
        report["warmup"] = run_mode("off", args.steps, Path(tmp) / "warmup", shm_ring, launch, ext_dir)
        for r in range(args.rounds):
            for mode in modes[r % 3 :] + modes[: r % 3]:
                print(f"gpu_check: round {r + 1}/{args.rounds}: {mode}", file=sys.stderr, flush=True)
                runs[mode].append(
                    run_mode(mode, args.steps, Path(tmp) / f"{mode}-{r}", shm_ring, launch, ext_dir)
                )
        print("gpu_check: CUDA graph replays", file=sys.stderr, flush=True)
        graphs = run_mode("graphs", args.graph_steps, Path(tmp) / "graphs", shm_ring, launch)
        report["graphs"] = graphs
        report["tables"] = tables = run_all_tables(args.tables_steps, Path(tmp) / "tables")
    for mode in modes:
        report[mode] = runs[mode][-1] | {"tokens_per_s_runs": [x.get("tokens_per_s") for x in runs[mode]]}
    speed = {m: statistics.median(x.get("tokens_per_s", 0.0) for x in runs[m]) for m in modes}
    report["tokens_per_s_median"] = {m: round(v, 1) for m, v in speed.items()}
    report["slowdown_vs_off"] = {m: round(1 - speed[m] / speed["off"], 4) for m in modes[1:] if speed["off"]}
    if "callback_us_per_launch" in runs["buffers"][-1]:
        # What a watched launch adds over a plain one (the copy and event enqueued on its stream).
        k, b = runs["kernels"][-1]["counters"], runs["buffers"][-1]["counters"]
        report["callback_us_per_watched_launch"] = round(
            (b["callback_ns"] - k["callback_ns"])
            / 1000
            / max(runs["buffers"][-1].get("watched_buffers", 0), 1),
            2,
        )
    every = [x for m in modes[1:] for x in runs[m]]
    checks = {
        "children_ok": all(x.get("exit_code") == 0 for m in modes for x in runs[m]),
        "injection_fired": all(x.get("injection_fired") for x in every),
        "clock_monotonic": all(
            x.get("clock_domain") == "monotonic" and x.get("timestamps_in_window") for x in every
        ),
        "launch_coverage": all(x.get("launch_coverage", 0) >= 0.99 for x in every),
        "topk_equal": all(x.get("topk_equal") for x in runs["buffers"]),
        "no_losses": all(
            x.get("counters", {}).get(f, 1) == 0 for x in every for f in ("ring_dropped", "activity_dropped")
        ),
        "no_errors": all(not x.get("errors") for x in every),
    }
    if ext_dir is not None:  # the runtime-API launch path of the watch
        checks["runtime_topk_equal"] = all(x.get("runtime_topk_equal") for x in runs["buffers"])
    checks |= {
        "graphs_ran": graphs.get("exit_code") == 0 and graphs.get("injection_fired") is True,
        "graph_topk_equal": graphs.get("graph_topk_equal") is True
        and graphs.get("graph_watched_buffers") == graphs.get("graph_watched_expected"),
        "graph_node_ids_match": graphs.get("graph_node_ids_match") is True,
        "graph_new_pointers": graphs.get("graph_new_pointers") is True,
        "graph_no_errors": not graphs.get("errors")
        and graphs.get("counters", {}).get("buffers_failed", 1) == 0,
    }
    # The project's own launch / record / late attach and its Python tables; not run (and so not
    # passed) where the machine's Python cannot import the project or record lacks root.
    for case in ("launch", "late_attach"):
        checks[f"tables_{case}"] = tables_ok(tables.get(case, {}), args.tables_steps)
    report["checks"] = checks
    report["ok"] = all(checks.values())
    report["elapsed_s"] = round(time.monotonic() - t_check, 1)  # the acceptance: 4 minutes on one H200
    print(json.dumps(report, indent=1, default=str))
    print(f"gpu_check: written to {write_results(report, args.results)}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
