"""Where the recorder's CPU goes, per generated token, on a real engine: a sampling profile of the
consumer (py-spy) split by stage.

    sudo .venv/bin/python scripts/profile_consumer.py [--requests 96] [--tokens 64] [--threads 1]
        [--record-args '...'] [--raw FILE] [--engine server --clients 4 --seconds 60]

With `--record-args=--bpf-stats` it also prints each probe program's runs and time per token in
the engine's threads (meta.json bpf_programs).

llama-cpp-python on the `bench` model of sparseety_prof/synthetic (32,000-entry vocabulary, 8 MoE
layers), or with `--engine server` xllamacpp's llama-server on the same model, `--clients` HTTP
clients streaming completions for `--seconds` (scripts/bench_sustained.py's load).
`sparseety-prof record` is attached, its start-up work let finish, then py-spy samples it
(without pausing it: --nonblocking) while the load runs (`--requests` requests of `--tokens`
tokens, or the server's clients) and the recorder is stopped and closes. py-spy is installed
under build/py-spy from PyPI when it is not on PATH.

Prints the recorder's CPU per token over that window (close included, as bench_policy_cpu.py
counts it) and a table: each stage's share of the samples in which the recorder was not waiting,
and that share of the CPU per token. A sample counts as waiting when it is in the pause between
drains, or in the probes' detach at close (the kernel waits for running probes to finish there:
wall time, not CPU). Samples are wall-clock, so a stage that waits in a system call is overstated;
the shares of pure computation are what this is for.

py-spy sees no frame inside the correlator compiled by mypyc (correlate/build_stamp.py): its work
is counted under the stage that called it. `SPARSEETY_PROF_PURE_PYTHON=1` (inherited by the
recorder) profiles the correlator's source, stage by stage, at the source's cost.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))
from bench_overhead import EngineProc, process_cpu_s, start_recorder, wait_quiet  # noqa: E402
from bench_policy_cpu import PROMPTS, generate  # noqa: E402
from bench_sustained import Server  # noqa: E402

from sparseety_prof.synthetic import make_model  # noqa: E402

PYSPY_DIR = ROOT / "build" / "py-spy"

#: samples preempted at a stage clock read: not CPU (STAGES says why)
PREEMPTED = "preempted at a stage clock read"

# (stage, the first frame in a sample's stack that puts it there), checked in this order: the first
# match wins, so a finer stage comes before the one that contains it
STAGES: list[tuple[str, str]] = [
    ("waiting between drains", "StopFlag.wait"),
    # the stage clock's read (thread_time, a system call): a consumer at nice 10 is preempted right
    # after it, and wall-clock samples land there (a third of the busy samples of a full-mode run,
    # for well under a microsecond of CPU per read); not CPU, so left out like the waits
    (PREEMPTED, "StageCpu.lap"),
    # asleep in epoll until the probes wake it (its few wakeups per second are counted here too)
    ("ring watch (waiting)", "RingWatch._run"),
    ("probes' detach at close (waiting)", "Session.close"),
    ("ring walk (copy out of the ring)", "RingReader.take"),
    ("logits statistics (C)", "PendingStats.fill"),
    ("aggregate records, per drain (numpy)", "agg_rows_batch"),
    ("one-row decode steps (fast path)", "fast_step ("),
    ("record handlers (prompts, first tokens)", "Correlator.feed"),
    ("token, step, request rows", "Correlator.take_tables"),
    ("frames from rows (Polars)", "ColumnBuffer.add"),
    ("flushes: Parquet segments, meta.json", "RowOutlet.flush_pieces"),
    ("flushes under memory pressure", "RowOutlet.relieve_memory"),
    ("aggregates, policy, sinks", "RowOutlet.emit"),
    ("decode of record groups", "decode_groups"),
    ("rest of a drain", "Recorder._consume"),
]
IDLE = {
    "waiting between drains",
    PREEMPTED,
    "ring watch (waiting)",
    "probes' detach at close (waiting)",
}


def py_spy() -> str:
    found = shutil.which("py-spy")
    if found:
        return found
    exe = PYSPY_DIR / "bin" / "py-spy"
    if not exe.exists():
        print("[profile] installing py-spy into build/py-spy (PyPI)", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(PYSPY_DIR), "py-spy"],
            check=True,
        )
    return str(exe)


def stage_of(stack: list[str]) -> str:
    for name, marker in STAGES:
        if any(marker in frame for frame in stack):
            return name
    return "other (exit, start of close, meta.json)"


def read_raw(path: Path) -> Counter[str]:
    """py-spy's raw (collapsed) output: `frame;frame;... count` per line, outermost frame first."""
    counts: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            counts[stage_of(stack.split(";"))] += int(n)
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="engine threads")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--record-args", default="", help="extra recorder options, e.g. '--policy aggregate'")
    ap.add_argument("--raw", type=Path, default=None, help="keep py-spy's raw samples here")
    ap.add_argument("--engine", choices=("llama-cpp-python", "server"), default="llama-cpp-python")
    ap.add_argument("--clients", type=int, default=1, help="server: concurrent clients (and slots)")
    ap.add_argument("--seconds", type=float, default=60.0, help="server: how long the clients stream")
    a = ap.parse_args()
    spy_exe = py_spy()
    model = make_model(ROOT / "models" / "bench.gguf", "bench")
    engine: EngineProc | Server
    if a.engine == "server":
        engine = Server(model, threads=a.threads, clients=a.clients)
        load = f"{a.clients} client(s) for {a.seconds:.0f} s on llama-server"
    else:
        engine = EngineProc(model, threads=a.threads)
        load = f"{a.requests} requests x {a.tokens}"

    def work(warm_up: bool) -> int:
        if isinstance(engine, Server):
            return engine.load(2.0 if warm_up else a.seconds, 8 if warm_up else a.tokens).tokens
        if warm_up:
            return generate(engine, [PROMPTS[2]], 8)
        return generate(engine, [PROMPTS[i % 2] for i in range(a.requests)], a.tokens)

    try:
        with tempfile.TemporaryDirectory(prefix="sparseety-profile-") as tmp:
            raw = a.raw or Path(tmp) / "samples.txt"
            cmd = [sys.executable, "-m", "sparseety_prof.cli", "record", "--pid", str(engine.pid)]
            cmd += ["-o", str(Path(tmp) / "rec"), *shlex.split(a.record_args)]
            rec = start_recorder(cmd)
            assert rec.stderr is not None
            work(warm_up=True)  # attention-map learning, probe detach
            wait_quiet(rec.pid, 10.0)
            spy_cmd = [spy_exe, "record", "-p", str(rec.pid), "-r", str(a.rate), "--nonblocking"]
            spy = subprocess.Popen(
                [*spy_cmd, "-f", "raw", "-o", str(raw)],
                env={**os.environ, "PYTHONPATH": str(PYSPY_DIR)},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)  # py-spy attached
            cpu0 = process_cpu_s(rec.pid)
            n = work(warm_up=False)
            rec.send_signal(signal.SIGINT)
            rest = rec.stderr.read()
            _, status, usage = os.wait4(rec.pid, 0)
            rec.returncode = os.waitstatus_to_exitcode(status)
            if rec.returncode != 0:
                raise RuntimeError(f"recorder exited {rec.returncode}: {rest}")
            spy.wait(timeout=60)
            cpu_us = (usage.ru_utime + usage.ru_stime - cpu0) / n * 1e6
            counts = read_raw(raw)
            meta = json.loads((Path(tmp) / "rec" / "meta.json").read_text())
    finally:
        engine.close()
    busy = {k: v for k, v in counts.items() if k not in IDLE}
    total = sum(busy.values())
    print(
        f"{n} tokens ({load}, {a.threads} engine thread(s)"
        f"{', ' + a.record_args if a.record_args else ''}): recorder CPU {cpu_us:.0f} µs/token "
        f"(attached, after start-up, to exit); {total} busy samples "
        f"({counts.get(PREEMPTED, 0)} more {PREEMPTED}, left out)"
    )
    print("| stage | share of busy samples | ≈ µs per token |")
    print("| --- | --- | --- |")
    for name, v in sorted(busy.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {v / total * 100:.1f}% | {v / total * cpu_us:.0f} |")
    # the same run on the consumer thread's CPU clock (session/stage_cpu.py): CPU, not wall time
    by_stage = meta.get("consumer", {}).get("cpu_s_by_stage", {})
    n_rec = max(int(meta["counts"]["tokens"]), 1)
    print(f"\nmeta.json consumer.cpu_s_by_stage, from the first drain on, per recorded token ({n_rec}):")
    print("| stage | µs per token |")
    print("| --- | --- |")
    for name, v in by_stage.items():
        print(f"| {name} | {v / n_rec * 1e6:.0f} |")
    print(f"| sum | {sum(by_stage.values()) / n_rec * 1e6:.0f} |")
    bpf = meta.get("bpf_programs", {})
    if bpf.get("stats") == "on":  # --record-args=--bpf-stats: the probes' own time in the engine
        print(
            f"\nmeta.json bpf_programs: {bpf['run_ns'] / n_rec / 1e3:.1f} µs per recorded token in the "
            f"engine's threads, {bpf['runs'] / n_rec:.1f} runs (the uprobe traps not counted)"
        )
        print("| program | runs per token | µs per token | µs per run |")
        print("| --- | --- | --- | --- |")
        for name, p in sorted(bpf["programs"].items(), key=lambda kv: -kv[1]["run_ns"]):
            per_run = p["run_ns"] / max(p["runs"], 1) / 1e3
            print(f"| {name} | {p['runs'] / n_rec:.2f} | {p['run_ns'] / n_rec / 1e3:.2f} | {per_run:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
