"""Overhead of the profiler on a real engine: tokens/s and inter-token latency with and without
`sparseety-prof record` attached, in interleaved A/B pairs (A = plain, B = profiled; the order
alternates AB, BA, ... so drift hits both sides alike).

    sudo .venv/bin/python scripts/bench_overhead.py [--pairs 20] [--threads 1 2] [--tokens 128]

The engine is llama-cpp-python on the `bench` model of sparseety_prof/synthetic (>= 3 ms/token
here, 32,000-entry vocabulary, so per-token costs that scale with the vocabulary are real),
logits_all off as in normal serving. Tokens/s is measured in the engine process over the decode
phase (first to last generated token); the profiler records the whole time B runs. Each B waits
after attaching until the recorder's one-time start-up work (BPF compile, model sha256) is over
(at most `--settle` seconds): the figures are the steady-state cost of staying attached.
Prints a table, and JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparseety_prof.session.options import Options  # noqa: E402
from sparseety_prof.synthetic import make_model  # noqa: E402

DEFAULT_NICE = Options(pid=0, out=None).nice

PROMPT = "hello the expert router decode sample"
WARMUP_TOKENS = 8  # generated after attaching, before the measured run (and before each A run)


class EngineProc:
    def __init__(self, model: Path, threads: int, n_ctx: int = 512) -> None:
        self.p = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests/engines/llama_engine.py"),
                str(model),
                "--threads",
                str(threads),
                "--no-logits-all",
                "--n-ctx",
                str(n_ctx),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.pid = int(self._read()["ready"])

    def _read(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith("{"):
                return dict(json.loads(line))
        raise RuntimeError("engine exited")

    def run(self, tokens: int) -> list[int]:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"prompts": [PROMPT], "max_tokens": tokens}) + "\n")
        self.p.stdin.flush()
        return list(self._read()["results"][0]["times_ns"])

    def close(self) -> None:
        self.p.kill()
        self.p.wait()


def start_recorder(cmd: list[str]) -> subprocess.Popen[str]:
    """The recorder command `cmd`, started in the repository, once it says it is attached (its
    stderr is left to the caller from there); RuntimeError when it exits first."""
    rec = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert rec.stderr is not None
    said: list[str] = []
    for line in rec.stderr:
        if "attached to PID" in line:
            return rec
        said.append(line)
    raise RuntimeError(f"recorder failed (exit {rec.wait()}): {''.join(said[-20:]).strip()}")


def profiled(
    engine: EngineProc, tokens: int, out: Path, settle: float, mode: str, sched: str, nice: int
) -> tuple[list[int], dict[str, Any]]:
    cmd = [sys.executable, "-m", "sparseety_prof.cli", "record", "--pid", str(engine.pid), "-o", str(out)]
    rec = start_recorder([*cmd, "--mode", mode, "--sched", sched, "--nice", str(nice)])
    lines: list[str] = []
    detached = threading.Event()

    def read_stderr() -> None:
        assert rec.stderr is not None
        for line in rec.stderr:
            lines.append(line)
            if "graph-op probes detached" in line:
                detached.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    wait_quiet(rec.pid, settle)
    # a few forward passes first: the recorder learns which layers apply which attention mask
    # and then detaches the per-layer probes (one-time start-up work, like the BPF compile)
    engine.run(WARMUP_TOKENS)
    if mode == "full":
        detached.wait(settle)
    wait_quiet(rec.pid, settle)
    times = engine.run(tokens)
    rec.send_signal(signal.SIGINT)
    rec.wait(timeout=120)
    reader.join(timeout=10)
    if rec.returncode != 0:
        raise RuntimeError("".join(lines))
    meta = json.loads((out / "meta.json").read_text())
    return times, meta


def cpu_times(pid: int) -> tuple[float, float, float, float]:
    """A running process's utime, stime, and those of the children it has reaped, in seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    utime, stime, cutime, cstime = (int(x) / tick for x in proc_stat(pid)[11:15])
    return utime, stime, cutime, cstime


def process_cpu_s(pid: int) -> float:
    """utime + stime of a running process, in seconds, with those of the children it has reaped
    (the recorder runs nm and c++filt while it attaches): wait4's rusage at its exit counts them
    too, so a window taken as "wait4's figure minus this one" must subtract them as well."""
    return sum(cpu_times(pid))


def proc_stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (field 3 on: state, ppid, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def wait_quiet(pid: int, limit: float) -> float:
    """Wait until the recorder's start-up work (model sha256, first drains) is over: its CPU time
    grows by less than 10 ms in 300 ms, or `limit` seconds pass. Returns its CPU time then."""
    deadline = time.monotonic() + limit
    prev = process_cpu_s(pid)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        cur = process_cpu_s(pid)
        if cur - prev <= 0.01:
            return cur
        prev = cur
    return prev


def tps(times: list[int]) -> float:
    return (len(times) - 1) / ((times[-1] - times[0]) / 1e9)


def itl_ms(times: list[int]) -> np.ndarray:
    return np.diff(np.array(times, dtype=np.int64)) / 1e6


def bootstrap_median_ci(x: np.ndarray, n: int = 4000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    meds = np.median(rng.choice(x, size=(n, len(x)), replace=True), axis=1)
    lo, hi = np.percentile(meds, [2.5, 97.5])
    return float(lo), float(hi)


# probe-side losses besides the ring's: rows not counted, records not attributable, and probe hits
# whose program the kernel skipped (program_misses)
SPARSE_LOSSES = (
    "sparse_rows_not_captured",
    "attention_rows_not_counted",
    "sparse_unattributed",
    "program_misses",
)


def bench(
    model: Path,
    threads: int,
    pairs: int,
    tokens: int,
    settle: float,
    tmp: Path,
    mode: str,
    sched: str,
    nice: int,
) -> dict[str, Any]:
    eng = EngineProc(model, threads, n_ctx=max(512, 1 << (tokens + 64).bit_length()))
    try:
        for _ in range(3):  # warm up: page in the weights, settle the allocator
            eng.run(tokens)
        ratios, itl_a, itl_b = [], [], []
        events = drops = gaps = rec_tokens = sparse_lost = escalations = 0
        drain_gaps, fills = [], []
        mask_reads: Counter[str] = Counter()
        for i in range(pairs):
            out = tmp / f"{mode}-t{threads}-{i}"
            if i % 2 == 0:
                eng.run(WARMUP_TOKENS)  # as B does after attaching
                a = eng.run(tokens)
                b, meta = profiled(eng, tokens, out, settle, mode, sched, nice)
            else:
                b, meta = profiled(eng, tokens, out, settle, mode, sched, nice)
                eng.run(WARMUP_TOKENS)
                a = eng.run(tokens)
            mask_reads[(meta.get("attention_masks") or {}).get("mask_read", "none")] += 1
            ratios.append(tps(b) / tps(a))
            itl_a.append(itl_ms(a))
            itl_b.append(itl_ms(b))
            losses = meta["losses"]
            events += losses["records_produced"]
            drops += losses["kernel_drops"]
            gaps += losses["seq_gaps"]
            sparse_lost += sum(int(losses.get(k, 0)) for k in SPARSE_LOSSES)
            rec_tokens += meta["counts"]["tokens"]
            consumer = meta.get("consumer", {})
            drain_gaps.append(float(consumer.get("drain_gap_max_ms", 0)))
            fills.append(float(consumer.get("ring_fill_peak", 0)))
            escalations += int(consumer.get("escalations", 0))
            print(
                f"  mode={mode} threads={threads} pair {i + 1}/{pairs}: tokens/s ratio {ratios[-1]:.4f}",
                file=sys.stderr,
            )
    finally:
        eng.close()
    r = np.array(ratios)
    lo, hi = bootstrap_median_ci(r)
    pa, pb = np.percentile(np.concatenate(itl_a), 99), np.percentile(np.concatenate(itl_b), 99)
    return {
        "mode": mode,
        "threads": threads,
        "pairs": pairs,
        "tokens_per_run": tokens,
        "tps_ratio_median": float(np.median(r)),
        "tps_ratio_ci95": [lo, hi],
        "slowdown_median_pct": float((1 - np.median(r)) * 100),
        "itl_p99_ms_plain": float(pa),
        "itl_p99_ms_profiled": float(pb),
        "itl_p99_ratio": float(pb / pa),
        "itl_median_ms_plain": float(np.median(np.concatenate(itl_a))),
        "events": events,
        "events_per_token": events / max(rec_tokens, 1),
        "recorded_tokens": rec_tokens,
        "kernel_drops": drops,
        "seq_gaps": gaps,
        "sparse_losses": sparse_lost,
        "sched": sched,
        "nice": nice,
        # how long the consumer waited for CPU (longest gap between two drains, nominal 500 ms),
        # how full one drain found the ring at worst, and how often it left SCHED_IDLE
        "drain_gap_max_ms_median": float(np.median(drain_gaps)),
        "ring_fill_peak_max": float(max(fills)),
        "escalations": escalations,
        # where the profiled runs read attention masks by the time they ended (attention_map)
        "attention_mask_read": dict(mask_reads),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per run")
    ap.add_argument(
        "--settle",
        type=float,
        default=5.0,
        help="at most this many seconds for the recorder's start-up work before generating",
    )
    ap.add_argument(
        "--mode",
        nargs="+",
        default=["full", "tokens"],
        choices=["full", "tokens"],
        help="recorder modes to measure (full: routing, sparsity, attention too; tokens: tokens only)",
    )
    ap.add_argument(
        "--sched",
        default="nice",
        choices=["idle", "nice"],
        help="the recorder's consumer CPU policy (see `sparseety-prof record --help`)",
    )
    ap.add_argument("--nice", type=int, default=None, help="the recorder's --nice (default: its own)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args()
    model = make_model(ROOT / "models" / "bench.gguf", "bench")
    results = []
    with tempfile.TemporaryDirectory(prefix="sparseety-bench-") as tmp:
        for mode in a.mode:
            for t in a.threads:
                print(
                    f"[bench] mode {mode}, {t} engine thread(s), {a.pairs} A/B pairs of {a.tokens} tokens",
                    file=sys.stderr,
                )
                nice = a.nice if a.nice is not None else DEFAULT_NICE
                results.append(bench(model, t, a.pairs, a.tokens, a.settle, Path(tmp), mode, a.sched, nice))
    print(
        "| mode | engine threads | tokens/s ratio (median) | 95% CI | slowdown | p99 ITL plain → profiled | "
        "events/token | losses | consumer: max drain gap (median), ring peak, escalations |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        lo, hi = r["tps_ratio_ci95"]
        print(
            f"| {r['mode']} | {r['threads']} | {r['tps_ratio_median']:.4f} | [{lo:.4f}, {hi:.4f}] | "
            f"{r['slowdown_median_pct']:.2f}% | "
            f"{r['itl_p99_ms_plain']:.2f} → {r['itl_p99_ms_profiled']:.2f} ms "
            f"(×{r['itl_p99_ratio']:.3f}) | {r['events_per_token']:.1f} | "
            f"{r['kernel_drops']} drops, {r['seq_gaps']} gaps, {r['sparse_losses']} sparse | "
            f"{r['drain_gap_max_ms_median']:.0f} ms, {100 * r['ring_fill_peak_max']:.1f}%, "
            f"{r['escalations']} |"
        )
    for r in results:
        reads = ", ".join(f"{k}: {v}" for k, v in sorted(r["attention_mask_read"].items()))
        print(f"attention masks read at ({r['mode']}, {r['threads']} threads): {reads}", file=sys.stderr)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
