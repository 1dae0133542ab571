"""Overhead of staying attached under sustained load, with everything the profiler does counted.

    sudo .venv/bin/python scripts/bench_sustained.py [--engine llama-cpp-python server]
        [--clients 1 4] [--seconds 60] [--pairs 6] [--mode full tokens] [--contend N] [--json FILE]
        [--tokens 64] [--spread 0.5] [--record-args '...'] [--ablate-consumer | --bare-traps]
        [--engine-cpus CPUS|n-1] [--recorder-cpus CPUS] [--duty-cycle ON/PERIOD] [--cpu-sample-hz HZ]

Each A/B pair runs the same load twice on one warm engine: A plain, B with `sparseety-prof record`
attached BEFORE the load starts and stopped (SIGINT, then its close: last drains, Parquet writes,
meta.json) before B's figures are taken. The order alternates AB, BA, ... so drift hits both
sides alike. The load is requests back to back for `--seconds`: prompts of several lengths
(prompt processing and time to first token are inside the window), answers of `--tokens` on
average, each request's length drawn within ±`--spread` of it from a seeded sequence per client,
the same sequence on both sides (AnswerLengths). With answers all of one length, the server's
clients end and send together by chance and fall out of step again, and the share of steps that
run a prompt (and with it the inter-token p99 and TTFT) moves from side to side; lengths that
differ keep them out of step. `--spread 0` is the load of one length.

- llama-cpp-python (tests/engines/llama_engine.py, logits_all off as in serving): one request
  at a time; times are taken in the engine process.
- server (xllamacpp's llama-server, tests/engines/server_engine.py, --parallel = clients):
  `--clients` HTTP clients streaming /completion at once; times are when each streamed token
  reached its client (the socket tracepoints and the request-id probes are inside the window).

Per side: tokens/s over the whole window (all requests' tokens over first request sent to last
token received), time to first token p50/p99, inter-token latency p99, over every gap and over
the gaps of decode steps alone: on a server a step that takes in another request's prompt is a
prefill long for every slot streaming (Side.prefill_gaps; the share of such gaps is printed),
and with up to 2% of such gaps a p99 over all gaps sits at the edge of that population. Per B:
the recorder's CPU time from the end of its attach to its exit (utime + stime from wait4, which
includes its close) per token it recorded, its CPU for the attach itself, its peak RSS, and its
losses. Ratios are profiled / plain per pair; medians with bootstrap 95% intervals. Prints a
Markdown table; the figures in the README come from this command.

Taking the cost apart: `--ablate-consumer` has the recorder discard its records once its start-up
work is done (the probes' programs and the drains alone; `--ablate-consumer logits` reduces each
drain's logits rows to their statistics first: the floor under a full-mode consumer); `--bare-traps` makes B
scripts/bare_traps.py instead, a no-op program on each probe point that a calibration recording
(same `--record-args`, before the pairs) kept on the engine: the uprobe traps alone, with each
point's traps per generated token printed. Both print the engine's user and system CPU per
token on each side.

The recorder's cost controls (docs/tuning.md): `--engine-cpus n-1` pins the engine to every core
but the last (with `--threads` to match), so that record's `--recorder-cpus auto` finds the
last core free and runs there; `--recorder-cpus`, `--duty-cycle` and `--cpu-sample-hz` (the CPU
sampler's rate; 0: off, the sampler's own cost as the difference) are passed to record as they
are given. Each pair's line and the JSON name where the recorder ran and the duty cycle's
coverage (meta.json recorder_placement, duty_cycle). On a 2-core host:

    sudo .venv/bin/python scripts/bench_sustained.py --engine llama-cpp-python --threads 1 --engine-cpus n-1
    sudo .venv/bin/python scripts/bench_sustained.py --engine llama-cpp-python --duty-cycle 2s/20s
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the test engines and bench_figures live there


from bench_figures import (  # noqa: E402
    STALL_ROWS,
    AnswerLengths,
    Side,
    answer_lengths,
    idle_cpu_s,
    losses_text,
    preemptions,
    stall_figures,
)

from scripts.bare_traps import probe_points  # noqa: E402
from scripts.bench_overhead import (  # noqa: E402
    SPARSE_LOSSES,
    EngineProc,
    bootstrap_median_ci,
    cpu_times,
    proc_stat,
    wait_quiet,
)
from scripts.preempt_stalls import StallTracer  # noqa: E402
from sparseety_prof.correlate import build_stamp  # noqa: E402
from sparseety_prof.session.placement import cpu_list_text, parse_cpu_list  # noqa: E402
from sparseety_prof.synthetic import make_model  # noqa: E402

ENGINES = ROOT / "tests" / "engines"
#: --ablate-consumer KIND (the recorder's), and what its B side then pays for
ABLATED = {"drain": "probes only", "logits": "probes and the logits statistics"}
CALIBRATION_MAX_S = 30.0  # --bare-traps: the longest load added for the recorder's start-up work
# prompts of different lengths: prompt processing is part of the load
PROMPTS = [
    "hello the expert router decode sample",
    "one two three four five six seven eight nine ten eleven twelve",
    "what is the time",
    "token expert router decode " * 6,
    "the sparse decode sample of a longer request that keeps the prompt phase busy " * 3,
]


# ------------------------------------------------------------------ engines and their load
class LlamaCppPython(EngineProc):
    """bench_overhead's engine process (logits_all off, as in serving), one request at a time."""

    name = "llama-cpp-python"

    def __init__(self, model: Path, threads: int, clients: int) -> None:
        if clients != 1:
            raise SystemExit("llama-cpp-python serves one request at a time: --clients 1 only")
        super().__init__(model, threads, n_ctx=1024)

    def load(self, seconds: float, tokens: int | AnswerLengths) -> Side:
        assert self.p.stdin is not None
        side, i, lengths = Side(), 0, answer_lengths(tokens)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.p.stdin.write(
                json.dumps({"prompts": [PROMPTS[i % len(PROMPTS)]], "max_tokens": lengths(0, i)}) + "\n"
            )
            self.p.stdin.flush()
            (r,) = self._read()["results"]
            side.add(int(r["t_request_ns"]), [int(t) for t in r["times_ns"]])
            i += 1
        return side


class Server:
    name = "server"

    def __init__(self, model: Path, threads: int, clients: int) -> None:
        self.clients = clients
        port = _free_port()
        self.p = subprocess.Popen(
            [
                sys.executable,
                str(ENGINES / "server_engine.py"),
                str(model),
                "--port",
                str(port),
                "--threads",
                str(threads),
                "--parallel",
                str(clients),
                "--n-ctx",
                str(1024 * clients),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.p.stdout is not None
        ready = json.loads(self.p.stdout.readline())
        self.pid = int(ready["ready"])
        self.port = port

    def _stream(self, prompt: str, tokens: int) -> tuple[int, list[int]]:
        """One streamed completion: when it was sent, and when each token's chunk arrived."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        body = {
            "prompt": prompt,
            "n_predict": tokens,
            "stream": True,
            "temperature": 0,
            "cache_prompt": False,
        }
        t0 = time.perf_counter_ns()
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        times: list[int] = []
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("content") or chunk.get("tokens"):
                times.append(time.perf_counter_ns())
            if chunk.get("stop"):
                break
        conn.close()
        return t0, times

    def load(self, seconds: float, tokens: int | AnswerLengths) -> Side:
        side, lock, lengths = Side(), threading.Lock(), answer_lengths(tokens)
        deadline = time.monotonic() + seconds

        def client(k: int) -> None:
            i, n = k, 0
            while time.monotonic() < deadline:
                t0, times = self._stream(PROMPTS[i % len(PROMPTS)], lengths(k, n))
                with lock:
                    side.add(t0, times)
                i += self.clients
                n += 1

        threads = [threading.Thread(target=client, args=(k,)) for k in range(self.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return side

    def close(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.close()
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ the recorder
class Recording:
    """`sparseety-prof record` on the engine, attached before the load; its CPU split at attach."""

    def __init__(self, pid: int, out: Path, mode: str, extra: list[str]) -> None:
        cmd = [sys.executable, "-m", "sparseety_prof.cli", "record", "--pid", str(pid), "-o", str(out)]
        self.out = out
        self.p = subprocess.Popen([*cmd, "--mode", mode, *extra], stderr=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.p.stderr is not None
        self.lines: list[str] = []
        for line in self.p.stderr:
            self.lines.append(line)
            if "attached to PID" in line:
                break
        else:
            raise RuntimeError(f"recorder failed ({self.p.wait()}): {''.join(self.lines)}")
        # start-up (BPF compile, model sha256 and weight scan) is attach cost, not per-token cost
        self.attach_cpu_s = wait_quiet(self.p.pid, 30.0)
        self.attach_minflt = _minor_faults(self.p.pid)
        self._reader = threading.Thread(target=self._drain_stderr, daemon=True)
        self._reader.start()

    def _drain_stderr(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            self.lines.append(line)

    def stop(self) -> dict[str, Any]:
        """SIGINT, then wait for its exit: its close is inside the measured window."""
        ru = interrupt_and_reap(self.p)
        self._reader.join(timeout=10)
        if self.p.returncode != 0:
            raise RuntimeError(f"recorder exited {self.p.returncode}: {''.join(self.lines)}")
        meta = json.loads((self.out / "meta.json").read_text())
        cpu = ru.ru_utime + ru.ru_stime
        return {
            "meta": meta,
            "cpu_total_s": cpu,
            "cpu_attached_s": cpu - self.attach_cpu_s,
            "attach_cpu_s": self.attach_cpu_s,
            "peak_rss_mib": ru.ru_maxrss / 1024,
            # page faults served without I/O (a fresh page zeroed, or mapped), attach left out
            "minflt_attached": ru.ru_minflt - self.attach_minflt,
        }


def interrupt_and_reap(p: subprocess.Popen[str]) -> Any:
    """SIGINT to `p`, then its exit, its return code set: wait4's rusage (its CPU and peak RSS)."""
    p.send_signal(signal.SIGINT)
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return ru


class BareTrapsSide:
    """scripts/bare_traps.py on the engine: a no-op program at each probe point of a recording
    (`probes` the meta.json of a calibration recording on the same engine), attached before the
    load and detached, with its run statistics read, before B's figures are taken."""

    def __init__(self, pid: int, probes: Path) -> None:
        cmd = [sys.executable, str(ROOT / "scripts" / "bare_traps.py"), "--pid", str(pid), "--probes"]
        self.p = subprocess.Popen(
            [*cmd, str(probes), "--stats"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert self.p.stderr is not None
        lines: list[str] = []
        for line in self.p.stderr:  # BCC's compiler may say things first
            lines.append(line)
            if "attached to PID" in line:
                break
        else:
            raise RuntimeError(f"bare_traps failed ({self.p.wait()}): {''.join(lines)}")
        self.attach_cpu_s = wait_quiet(self.p.pid, 30.0)

    def stop(self) -> dict[str, Any]:
        """SIGINT, then its exit (the detach inside the window, as the recorder's close is)."""
        assert self.p.stdout is not None and self.p.stderr is not None
        ru = interrupt_and_reap(self.p)
        out, err = self.p.stdout.read(), self.p.stderr.read()
        if self.p.returncode != 0:
            raise RuntimeError(f"bare_traps exited {self.p.returncode}: {err}")
        runs = json.loads(out.splitlines()[-1])["runs"]
        return {
            "runs": runs,
            "traps": sum(runs.values()),
            "cpu_attached_s": ru.ru_utime + ru.ru_stime - self.attach_cpu_s,
            "attach_cpu_s": self.attach_cpu_s,
            "peak_rss_mib": ru.ru_maxrss / 1024,
        }


def _minor_faults(pid: int) -> int:
    """minflt + cminflt of a running process (wait4's rusage at its exit counts the reaped
    children's too, as process_cpu_s says of the CPU times)."""
    f = proc_stat(pid)
    return int(f[7]) + int(f[8])


class Contenders:
    """`n` processes that spin on the CPU at the default priority for the whole benchmark, both
    sides of every pair: the engine and the recorder share the cores with someone else, as on a
    busy host (the recorder, at nice 10, gets what is left; the ring must absorb the wait or
    count what it cannot)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Contenders:
        for _ in range(self.n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


# ------------------------------------------------------------------ pairs
def timed_load(
    eng: Any, seconds: float, tokens: AnswerLengths, tracer: StallTracer | None = None, recorder: int = 0
) -> Side:
    """eng.load, with the engine's user and system CPU time over it (all its threads: the probes'
    run time and their traps are its system time); with a `tracer` (--stalls), its threads' waits
    when preempted over the side, the process `recorder` (its PID; 0: none) as the recorder's."""
    if tracer is not None:
        tracer.take(set())  # (what came before this side: the other side, the recorder's attach)
    u0, s0, _, _ = cpu_times(eng.pid)
    p0 = preemptions(eng.pid)
    i0 = idle_cpu_s()
    side: Side = eng.load(seconds, tokens)
    side.machine_idle_s = idle_cpu_s() - i0
    u1, s1, _, _ = cpu_times(eng.pid)
    side.engine_user_s, side.engine_sys_s = u1 - u0, s1 - s0
    side.engine_preempted = preemptions(eng.pid) - p0
    if tracer is not None:
        side.stalls = tracer.take({recorder} if recorder else set())
    return side


def calibrate(eng: Any, a: argparse.Namespace, mode: str, tmp: Path) -> Path:
    """--bare-traps: a recording with the recorder options of the run, long enough for its start-up
    work (the attention layer map learned, the graph-op probes detached), whose meta.json names
    the probe points the recorder keeps on this engine."""
    out = tmp / f"{eng.name}-calibration-{mode}"
    rec = Recording(eng.pid, out, mode, shlex.split(a.record_args))
    eng.load(min(10.0, a.seconds), a.tokens)
    # until the graph-op probes go (3 forward passes that agree, usually the first request; tokens
    # mode has none): an engine build without the mask-writing symbol never detaches them
    waited = 0.0
    while mode == "full" and waited < CALIBRATION_MAX_S:
        if any("graph-op probes detached" in line for line in rec.lines):
            break
        eng.load(2.0, a.tokens)
        waited += 2.0
    rec.stop()
    meta = out / "meta.json"
    recorded = json.loads(meta.read_text())
    points, kept = recorded["probes"], probe_points(recorded)
    print(
        f"  calibration: the recorder keeps {len(kept)} probe points on this engine "
        f"({len(points) - len(kept)} detached once its start-up work was done)",
        file=sys.stderr,
    )
    return meta


def pair_figures(
    rows: dict[str, list[float]], pa: Side, pb: Side, out: dict[str, Any], per_tokens: int
) -> None:
    """One pair's figures: B's ratios to A, the profiler's CPU per token (`per_tokens`: the tokens
    it recorded, or B's generated tokens where it records none) and the engine's CPU per token
    it generated on each side."""
    rows["tps"].append(pb.tps() / pa.tps())
    rows["ttft_p50"].append(np.percentile(pb.ttft_ms(), 50) / np.percentile(pa.ttft_ms(), 50))
    rows["ttft_p99"].append(np.percentile(pb.ttft_ms(), 99) / np.percentile(pa.ttft_ms(), 99))
    gaps = {side: p.itl_ms() for side, p in (("a", pa), ("b", pb))}
    decode = {side: p.itl_decode_ms() for side, p in (("a", pa), ("b", pb))}
    rows["itl_p99"].append(np.percentile(gaps["b"], 99) / np.percentile(gaps["a"], 99))
    rows["itl_p99_decode"].append(np.percentile(decode["b"], 99) / np.percentile(decode["a"], 99))
    rows["cpu_us_per_token"].append(out["cpu_attached_s"] / max(per_tokens, 1) * 1e6)
    rows["attach_cpu_s"].append(out["attach_cpu_s"])
    rows["rss"].append(out["peak_rss_mib"])
    for side, p in (("a", pa), ("b", pb)):
        rows[f"prefill_gaps_{side}"].append(1.0 - len(decode[side]) / max(len(gaps[side]), 1))
        rows[f"engine_user_{side}"].append(p.engine_user_s / max(p.tokens, 1) * 1e6)
        rows[f"engine_sys_{side}"].append(p.engine_sys_s / max(p.tokens, 1) * 1e6)
        rows[f"engine_preempted_{side}"].append(p.engine_preempted / max(p.tokens, 1))
        rows[f"idle_{side}"].append(p.machine_idle_s / max(p.tokens, 1) * 1e6)
    if pa.stalls is not None and pb.stalls is not None:
        stall_figures(rows, pa, pb)


def bench(
    engine_cls: type, model: Path, a: argparse.Namespace, clients: int, mode: str, tmp: Path
) -> dict[str, Any]:
    eng = engine_cls(model, a.threads, clients)
    engine_cores = pin_engine(eng.pid, a.engine_cpus) if a.engine_cpus else None
    lengths = AnswerLengths(a.tokens, a.spread)
    rows: dict[str, list[float]] = {
        k: []
        for k in (
            "tps",
            "ttft_p50",
            "ttft_p99",
            "itl_p99",
            "itl_p99_decode",
            "prefill_gaps_a",
            "prefill_gaps_b",
            "cpu_us_per_token",
            "attach_cpu_s",
            "rss",
            "engine_user_a",
            "engine_user_b",
            "engine_sys_a",
            "engine_sys_b",
            "engine_preempted_a",
            "engine_preempted_b",
            "idle_a",
            "idle_b",
        )
    }
    losses = records = tokens = bpf_runs = bpf_ns = 0  # losses: ring records, of `records`
    # the probes' other losses, by kind (rows not counted, unattributed records, skipped
    # programs): not ring records, so never added to the ring's count
    not_captured: dict[str, int] = {}
    placed: list[str | None] = []  # per pair: the cores the recorder was pinned to (None: not pinned)
    coverage: list[float | None] = []  # per pair: the duty cycle's coverage (None: no duty cycle)
    traps_per_token: list[float] = []  # --bare-traps: the no-op programs' runs per token B generated
    bare_runs: dict[str, int] = {}  # ... and each point's, summed over the pairs
    bare_tokens = 0
    tracer: StallTracer | None = None
    if a.stalls:
        rows.update({k: [] for k in STALL_ROWS})
        tracer = StallTracer()
        tracer.add_engine(eng.pid)
    try:
        eng.load(min(10.0, a.seconds), a.tokens)  # warm-up: weights paged in, allocator settled
        bare_probes = calibrate(eng, a, mode, tmp) if a.bare_traps else None
        consumer: list[dict[str, Any]] = []
        stage_s: dict[str, float] = {}  # the consumer's CPU by stage, summed over the pairs
        bpf_by_program: dict[str, int] = {}  # with --bpf-stats: each probe program's ns, summed
        for i in range(a.pairs):
            order = ("A", "B") if i % 2 == 0 else ("B", "A")
            sides: dict[str, Side] = {}
            rec_out: dict[str, Any] = {}
            for which in order:
                if which == "A":
                    sides["A"] = timed_load(eng, a.seconds, lengths, tracer)
                elif bare_probes is not None:
                    bare = BareTrapsSide(eng.pid, bare_probes)
                    sides["B"] = timed_load(eng, a.seconds, lengths, tracer, bare.p.pid)
                    rec_out = bare.stop()
                else:
                    extra = shlex.split(a.record_args) + cost_flags(a)
                    if a.ablate_consumer:
                        extra.append(f"--ablate-consumer={a.ablate_consumer}")
                    rec = Recording(eng.pid, tmp / f"{eng.name}-{clients}-{mode}-{i}", mode, extra)
                    sides["B"] = timed_load(eng, a.seconds, lengths, tracer, rec.p.pid)
                    rec_out = rec.stop()
            pa, pb = sides["A"], sides["B"]
            if bare_probes is not None:
                pair_figures(rows, pa, pb, rec_out, pb.tokens)
                traps_per_token.append(rec_out["traps"] / max(pb.tokens, 1))
                bare_tokens += pb.tokens
                for point, n in rec_out["runs"].items():
                    bare_runs[point] = bare_runs.get(point, 0) + n
                print(
                    f"  {eng.name} clients={clients} mode={mode} (bare traps) pair {i + 1}/{a.pairs}: "
                    f"tokens/s ratio {rows['tps'][-1]:.4f}, {pb.tokens} tokens in B, "
                    f"{traps_per_token[-1]:.1f} traps/token, engine system CPU "
                    f"{rows['engine_sys_a'][-1]:.0f} → {rows['engine_sys_b'][-1]:.0f} µs/token",
                    file=sys.stderr,
                )
                continue
            meta = rec_out["meta"]
            n_rec = int(meta["counts"]["tokens"])
            if a.ablate_consumer:  # the recording holds the start-up work's tokens only
                ablated = (meta.get("consumer") or {}).get("ablated")
                if not ablated or ablated.get("began_after_s") is None:
                    raise RuntimeError(f"the recorder never began discarding: {meta.get('consumer')}")
                n_rec = pb.tokens
            pair_figures(rows, pa, pb, rec_out, n_rec)
            lz = meta["losses"]
            # a record dropped in the kernel has taken its sequence number: it is also a gap,
            # so the two counts are two views of the same records (the larger one counts both)
            ring_lost = max(int(lz["kernel_drops"]), int(lz["seq_gaps"]))
            losses += ring_lost
            # each kind that lost anything, for the per-pair line: a loss is named, never a bare count
            lost_kinds = {k: int(lz.get(k, 0)) for k in ("kernel_drops", "seq_gaps", *SPARSE_LOSSES)}
            lost_text = ", ".join(f"{k} {v}" for k, v in lost_kinds.items() if v) or "none"
            for k in SPARSE_LOSSES:
                if lost_kinds[k]:
                    not_captured[k] = not_captured.get(k, 0) + lost_kinds[k]
            records += int(lz["records_produced"])
            tokens += n_rec
            cons = meta.get("consumer", {})
            consumer.append(cons)
            placed.append((meta.get("recorder_placement") or {}).get("pinned"))
            coverage.append((meta.get("duty_cycle") or {}).get("coverage"))
            for k, v in cons.get("cpu_s_by_stage", {}).items():
                stage_s[k] = stage_s.get(k, 0.0) + float(v)
            bpf = meta.get("bpf_programs", {})
            probes = ""
            if bpf.get("stats") == "on":  # --record-args --bpf-stats: the probes' time in the engine
                bpf_runs += int(bpf["runs"])
                bpf_ns += int(bpf["run_ns"])
                for name, prog in bpf["programs"].items():
                    bpf_by_program[name] = bpf_by_program.get(name, 0) + int(prog["run_ns"])
                probes = (
                    f", probes {int(bpf['run_ns']) / max(n_rec, 1) / 1e3:.1f} µs/token in the engine "
                    f"({int(bpf['runs']) / max(n_rec, 1):.0f} runs)"
                )
            print(
                f"  {eng.name} clients={clients} mode={mode} pair {i + 1}/{a.pairs}: tokens/s ratio "
                f"{rows['tps'][-1]:.4f}, ITL p99 ratio {rows['itl_p99'][-1]:.3f} (decode steps "
                f"{rows['itl_p99_decode'][-1]:.3f}; gaps with a prefill {rows['prefill_gaps_a'][-1]:.2%} "
                f"in A, {rows['prefill_gaps_b'][-1]:.2%} in B), "
                f"{pb.tokens} tokens in B ({n_rec} recorded), recorder "
                f"{rows['cpu_us_per_token'][-1]:.0f} µs CPU/token, "
                f"{rec_out['minflt_attached'] / max(n_rec, 1):.2f} page faults/token, "
                f"{cons.get('escalations')} escalation(s), "
                f"ring peak {cons.get('ring_fill_peak')}, longest gap {cons.get('drain_gap_max_ms')} ms "
                f"(ending {cons.get('drain_gap_max_at_s')} s after the consumer's start; graph-op probes "
                f"detached in {(meta.get('attention_masks') or {}).get('ops_detach_ms')} ms), "
                f"longest piece of a flush {cons.get('flush_wall_max_ms')} ms ({cons.get('flush_cpu_ms')} ms "
                f"of CPU, {cons.get('flush_piece_max')}; {cons.get('flush_pieces')} pieces in "
                f"{cons.get('flushes')} flushes), "
                f"{cons.get('drains_logits_by_ref')} of {cons.get('drains')} drains read logits in the ring, "
                f"engine system CPU {rows['engine_sys_a'][-1]:.0f} → {rows['engine_sys_b'][-1]:.0f} "
                f"µs/token, user {rows['engine_user_a'][-1]:.0f} → {rows['engine_user_b'][-1]:.0f}, "
                f"its threads preempted {rows['engine_preempted_a'][-1]:.2f} → "
                f"{rows['engine_preempted_b'][-1]:.2f} times/token, machine idle CPU "
                f"{rows['idle_a'][-1]:.0f} → {rows['idle_b'][-1]:.0f} µs/token, losses: {lost_text}, "
                f"recorder pinned to {placed[-1] or 'nothing'}"
                + (f", duty-cycle coverage {coverage[-1]}" if coverage[-1] is not None else "")
                + probes,
                file=sys.stderr,
            )
    finally:
        eng.close()
        if tracer is not None:
            tracer.close()
    out: dict[str, Any] = {
        "bare_traps": a.bare_traps,
        "traps_per_token": traps_per_token,
        "traps_per_token_by_point": {
            k: v / max(bare_tokens, 1) for k, v in sorted(bare_runs.items(), key=lambda kv: -kv[1])
        },
        "contend": a.contend,
        "engine": eng.name,
        "clients": clients,
        "mode": mode
        + (f" {a.record_args}" if a.record_args else "")
        + (f" (consumer ablated: {ABLATED[a.ablate_consumer]})" if a.ablate_consumer else "")
        + (" (bare traps: no-op programs at its probe points)" if a.bare_traps else "")
        + (f" (+{a.contend} spinning processes)" if a.contend else "")
        + "".join(f" {flag}" for flag in cost_flags(a))
        + (f" (engine on cores {cpu_list_text(engine_cores)})" if engine_cores else ""),
        "engine_cpus": cpu_list_text(engine_cores) if engine_cores else None,
        "recorder_pinned": placed,  # per pair (meta.json recorder_placement.pinned)
        "duty_coverage": coverage,  # per pair (meta.json duty_cycle.coverage)
        "pairs": a.pairs,
        "tokens": a.tokens,
        "spread": a.spread,
        "seconds": a.seconds,
        "threads": a.threads,
        "losses": losses,
        "records": records,
        "not_captured": not_captured,
        "recorded_tokens": tokens,
        "consumer": consumer,  # per pair: meta.json's account of how the drains went
        # over all pairs: CPU µs per recorded token, by stage (meta.json consumer.cpu_s_by_stage)
        "cpu_us_per_token_by_stage": {k: v / max(tokens, 1) * 1e6 for k, v in stage_s.items()},
        # with --bpf-stats: the probe programs' own run time and runs per recorded token
        "bpf_us_per_token": bpf_ns / max(tokens, 1) / 1e3 if bpf_runs else None,
        "bpf_runs_per_token": bpf_runs / max(tokens, 1) if bpf_runs else None,
        "bpf_us_per_token_by_program": {
            k: v / max(tokens, 1) / 1e3 for k, v in sorted(bpf_by_program.items(), key=lambda kv: -kv[1])
        },
    }
    for k, v in rows.items():
        x = np.array(v)
        lo, hi = bootstrap_median_ci(x)
        out[k] = {"median": float(np.median(x)), "ci95": [lo, hi], "values": v}
    return out


def print_stages(results: list[dict[str, Any]]) -> None:
    """Where the recorder's CPU went, per recorded token, by stage (its own thread's CPU clock:
    session/stage_cpu.py), over all the pairs of each configuration."""
    by = [r for r in results if r["cpu_us_per_token_by_stage"]]
    if not by:
        return
    names = list(by[0]["cpu_us_per_token_by_stage"])
    print()
    print("| engine | clients | mode | " + " | ".join(names) + " | sum |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in names) + " | --- |")
    for r in by:
        st = r["cpu_us_per_token_by_stage"]
        cells = " | ".join(f"{st.get(k, 0.0):.0f}" for k in names)
        print(f"| {r['engine']} | {r['clients']} | {r['mode']} | {cells} | {sum(st.values()):.0f} µs |")
    for r in by:
        if r.get("bpf_us_per_token") is not None:
            print(
                f"{r['engine']} {r['mode']}: the probe programs ran {r['bpf_us_per_token']:.1f} µs per "
                f"recorded token in the engine's threads ({r['bpf_runs_per_token']:.0f} runs; the uprobe "
                "traps not counted)"
            )
            top = list(r["bpf_us_per_token_by_program"].items())[:5]
            print("  the costliest: " + ", ".join(f"{name} {us:.1f} µs" for name, us in top))


def print_traps(results: list[dict[str, Any]]) -> None:
    """--bare-traps: how often each probe point trapped per token B generated."""
    for r in results:
        if r["traps_per_token_by_point"]:
            print()
            print(f"{r['engine']} {r['clients']} client(s): traps per generated token by probe point")
            for point, n in r["traps_per_token_by_point"].items():
                print(f"  {n:7.2f}  {point}")


def print_engine_cpu(results: list[dict[str, Any]]) -> None:
    """The engine process's CPU per generated token, plain (A) and profiled (B), medians over the
    pairs: the probes' run time and traps land in its system time; its user time holds its
    threads' spinning at the graph's barriers, so it follows the wall time; how often its threads
    were preempted (involuntary context switches) says how often another thread (the recorder's,
    at a low priority) took one of their cores; the machine's idle CPU per token (idle_cpu_s) is
    the room left on the cores, which a recorder can use without taking one from the engine."""
    print()
    print(
        "| engine | clients | mode | engine user µs/token, plain → profiled | system, plain → profiled "
        "| its threads preempted per token, plain → profiled | machine idle CPU µs/token, plain → profiled |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        u_a, u_b = r["engine_user_a"]["median"], r["engine_user_b"]["median"]
        s_a, s_b = r["engine_sys_a"]["median"], r["engine_sys_b"]["median"]
        p_a, p_b = r["engine_preempted_a"]["median"], r["engine_preempted_b"]["median"]
        i_a, i_b = r["idle_a"]["median"], r["idle_b"]["median"]
        cells = f"{u_a:.0f} → {u_b:.0f} | {s_a:.0f} → {s_b:.0f} | {p_a:.2f} → {p_b:.2f}"
        cells += f" | {i_a:.0f} → {i_b:.0f}"
        print(f"| {r['engine']} | {r['clients']} | {r['mode']} | {cells} |")


def print_stalls(results: list[dict[str, Any]]) -> None:
    """--stalls: how the engine's threads waited when preempted, medians over the pairs: for the
    recorder (B), in all and in waits of 1 ms and more (a wait holds the whole step back at the
    next barrier, so the inter-token tail follows the long ones: docs/overhead.md), and for
    anything else on each side (the machine's own noise, the benchmark's clients, the engine's
    other threads)."""
    stalled = [r for r in results if "wait_rec_b" in r]
    if not stalled:
        return
    print()
    print(
        "| engine | clients | mode | engine waits for the recorder, µs/token | of it in waits ≥ 1 ms "
        "| waits ≥ 1 ms per 100 tokens | engine waits for anything else, µs/token, plain → profiled |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in stalled:
        m = {k: r[k]["median"] for k in STALL_ROWS}
        print(
            f"| {r['engine']} | {r['clients']} | {r['mode']} | {m['wait_rec_b']:.0f} "
            f"| {m['wait_rec_long_share_b']:.0%} | {m['long_waits_rec_b']:.1f} "
            f"| {m['wait_other_a']:.0f} → {m['wait_other_b']:.0f} |"
        )


def pin_engine(pid: int, text: str) -> frozenset[int]:
    """--engine-cpus: every thread of the engine pinned to these cores (threads it makes later
    inherit their maker's); `n-1`: every core this process may use but the last, the host that
    leaves the engine a core short."""
    machine = sorted(os.sched_getaffinity(0))
    cores = frozenset(machine[:-1]) if text == "n-1" else parse_cpu_list(text)
    if not cores:
        raise SystemExit(
            f"--engine-cpus {text}: no core left to the engine (this host: {cpu_list_text(set(machine))})"
        )
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cores)
    return cores


def cost_flags(a: argparse.Namespace) -> list[str]:
    """The recorder's cost controls asked for (--duty-cycle, --recorder-cpus, --cpu-sample-hz), as
    record's flags."""
    flags = []
    if a.cpu_sample_hz is not None:
        flags.append(f"--cpu-sample-hz={a.cpu_sample_hz}")
    if a.duty_cycle:
        flags.append(f"--duty-cycle={a.duty_cycle}")
    if a.recorder_cpus:
        flags.append(f"--recorder-cpus={a.recorder_cpus}")
    return flags


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--engine", nargs="+", default=["llama-cpp-python", "server"], choices=["llama-cpp-python", "server"]
    )
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4], help="concurrent clients (server)")
    ap.add_argument("--seconds", type=float, default=60.0, help="sustained load per side of a pair")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request, on average")
    ap.add_argument(
        "--spread",
        type=float,
        default=0.5,
        help="each request's answer length within ±SPREAD × --tokens (seeded, the same on both sides); "
        "0: every answer --tokens long",
    )
    ap.add_argument("--threads", type=int, default=2, help="engine threads")
    ap.add_argument("--mode", nargs="+", default=["full"], choices=["full", "tokens"])
    ap.add_argument("--model", default="bench", help="sparseety_prof/synthetic preset (default: bench)")
    ap.add_argument(
        "--record-args",
        default="",
        metavar="ARGS",
        help="more options for the recorder, e.g. '--policy aggregate' or '--metrics-port 9464 --otlp URL'",
    )
    ap.add_argument(
        "--contend",
        type=int,
        default=0,
        metavar="N",
        help="N more processes spinning on the CPU during the whole run (losses under contention)",
    )
    ap.add_argument(
        "--ablate-consumer",
        nargs="?",
        const="drain",
        default="",
        choices=tuple(ABLATED),
        metavar="KIND",
        help="the recorder drains and discards the records once its start-up work is done (its "
        "--ablate-consumer KIND): the probes' cost in the engine alone; with KIND logits, each "
        "drain's logits rows reduced to their statistics first (the floor under a full-mode "
        "consumer); CPU per token is then per token the engine generated on side B",
    )
    ap.add_argument(
        "--bare-traps",
        action="store_true",
        help="B runs scripts/bare_traps.py instead of the recorder: a no-op program at each probe "
        "point the recorder keeps on the engine (a calibration recording with --record-args finds "
        "them): the uprobe traps' cost alone",
    )
    ap.add_argument(
        "--stalls",
        action="store_true",
        help="also trace the engine threads' waits when preempted, per side, by who took their CPU "
        "(scripts/preempt_stalls.py: a BPF program on sched_switch, which runs on every context "
        "switch of the machine, on both sides alike)",
    )
    ap.add_argument(
        "--engine-cpus",
        default=None,
        metavar="CPUS",
        help="pin the engine's threads to these cores (a CPU list such as 0, or n-1: every core but the "
        "last, leaving the recorder a core of its own; give --threads to match)",
    )
    ap.add_argument(
        "--recorder-cpus",
        default=None,
        metavar="CPUS",
        help="record's --recorder-cpus (auto, none or a CPU list; default: record's own, auto)",
    )
    ap.add_argument(
        "--duty-cycle",
        default=None,
        metavar="ON/PERIOD",
        help="record's --duty-cycle, e.g. 2s/20s (one window in ten)",
    )
    ap.add_argument(
        "--cpu-sample-hz",
        type=int,
        default=None,
        metavar="HZ",
        help="record's --cpu-sample-hz (0: the CPU sampler off; default: record's own)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args()
    if a.bare_traps and a.ablate_consumer:
        raise SystemExit("--bare-traps and --ablate-consumer are two different B sides: one at a time")
    if os.geteuid() != 0:
        raise SystemExit("run as root: the recorder attaches eBPF uprobes")
    model = make_model(ROOT / "models" / f"{a.model}.gguf", a.model)
    # the recorder runs the correlator's compiled build only while it matches the source: say
    # which, since a stale build (a source edited since) runs the source, slower
    print(f"[bench] correlator: {build_stamp.STATE}", file=sys.stderr)
    results = []
    with tempfile.TemporaryDirectory(prefix="sparseety-sustained-") as tmp, Contenders(a.contend):
        for name in a.engine:
            cls = LlamaCppPython if name == "llama-cpp-python" else Server
            for clients in [1] if name == "llama-cpp-python" else a.clients:
                for mode in a.mode:
                    print(
                        f"[bench] {name}, {clients} client(s), mode {mode}, "
                        f"{a.pairs} pairs of {a.seconds:.0f} s, "
                        f"answers of {a.tokens} tokens ± {a.spread:.0%}",
                        file=sys.stderr,
                    )
                    results.append(bench(cls, model, a, clients, mode, Path(tmp)))
    print(
        "| engine | clients | mode | tokens/s ratio [95% CI] | TTFT p50 ratio | TTFT p99 ratio "
        "| ITL p99 ratio | ITL p99 ratio, decode steps | gaps with a prefill, A / B "
        "| recorder CPU/token (attached → exit) | attach CPU | peak RSS | losses |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        t = r["tps"]
        print(
            f"| {r['engine']} | {r['clients']} | {r['mode']} "
            f"| {t['median']:.4f} [{t['ci95'][0]:.4f}, {t['ci95'][1]:.4f}] "
            f"| {r['ttft_p50']['median']:.3f} | {r['ttft_p99']['median']:.3f} | {r['itl_p99']['median']:.3f} "
            f"| {r['itl_p99_decode']['median']:.3f} "
            f"| {r['prefill_gaps_a']['median']:.2%} / {r['prefill_gaps_b']['median']:.2%} "
            f"| {r['cpu_us_per_token']['median']:.0f} µs | {r['attach_cpu_s']['median']:.1f} s "
            f"| {r['rss']['median']:.0f} MiB | {losses_text(r)} |"
        )
    print_stages(results)
    print_traps(results)
    print_engine_cpu(results)
    print_stalls(results)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
