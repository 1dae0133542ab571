"""The recorder's own CPU per generated token under each `--policy`, on a real engine.

    sudo .venv/bin/python scripts/bench_policy_cpu.py [--repeats 2] [--requests 16] [--tokens 48]
        [--threads 1] [--compare OPTIONS [OPTIONS ...]]

llama-cpp-python on the `bench` model of sparseety_prof/synthetic (32,000-entry vocabulary), `--threads`
engine threads. With `--compare`, the same for each set of recorder options given (e.g.
`--compare '--flush-interval 2' '--flush-interval 10'`) instead of each policy. For each policy,
in interleaved rounds: `sparseety-prof record --policy ...` is attached,
its one-time start-up work (BPF compile, model sha256, attention-map learning on a few warm-up
tokens) is let finish, then `--requests` requests of `--tokens` tokens are generated (prompts
alternate, so each is a request of its own) and the recorder is stopped. The figure is the
recorder's CPU time (user + system) from after the start-up work to its exit, close included,
divided by the tokens generated in that window. Prints a table (median and range per policy)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_overhead import EngineProc, process_cpu_s, start_recorder, wait_quiet  # noqa: E402

from sparseety_prof.synthetic import make_model  # noqa: E402

PROMPTS = ["hello the expert router decode sample", "one two three four five", "the sparse decode"]
POLICIES = [
    ["full"],
    ["aggregate"],
    ["head:0.1"],
    ["tail:0.99"],
    ["anomaly"],
    ["head:0.1", "tail:0.99", "anomaly"],
]


def generate(engine: EngineProc, prompts: list[str], tokens: int) -> int:
    """Generated tokens."""
    assert engine.p.stdin is not None
    engine.p.stdin.write(json.dumps({"prompts": prompts, "max_tokens": tokens}) + "\n")
    engine.p.stdin.flush()
    return sum(len(r["ids"]) for r in engine._read()["results"])


def one(engine: EngineProc, policy: list[str], out: Path, requests: int, tokens: int) -> dict[str, Any]:
    """`policy`: --policy values, or (with --compare) one string of recorder options."""
    cmd = [sys.executable, "-m", "sparseety_prof.cli", "record", "--pid", str(engine.pid), "-o", str(out)]
    for p in policy:
        cmd += shlex.split(p) if p.startswith("-") else ["--policy", p]
    rec = start_recorder(cmd)
    generate(engine, [PROMPTS[2]], 8)  # warm-up: the attention-map learning and probe detach
    wait_quiet(rec.pid, 10.0)
    cpu0 = process_cpu_s(rec.pid)
    n = generate(engine, [PROMPTS[i % 2] for i in range(requests)], tokens)
    rec.send_signal(signal.SIGINT)
    _, status, usage = os.wait4(rec.pid, 0)
    rec.returncode = os.waitstatus_to_exitcode(status)
    rest = rec.stderr.read()
    if rec.returncode != 0:
        raise RuntimeError(rest)
    meta = json.loads((out / "meta.json").read_text())
    cpu = usage.ru_utime + usage.ru_stime - cpu0
    return {
        "policy": "+".join(policy),
        "tokens": n,
        "cpu_s": cpu,
        "us_per_token": cpu / n * 1e6,
        "meta": meta,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="engine threads")
    ap.add_argument(
        "--compare",
        nargs="+",
        default=None,
        metavar="OPTIONS",
        help="compare these recorder option sets instead of the policies, e.g. "
        "--compare '--flush-interval 2' '--flush-interval 10'",
    )
    a = ap.parse_args()
    variants = [[c] for c in a.compare] if a.compare else POLICIES
    model = make_model(ROOT / "models" / "bench.gguf", "bench")
    engine = EngineProc(model, threads=a.threads)
    got: dict[str, list[dict[str, Any]]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="sparseety-policy-cpu-") as tmp:
            for r in range(a.repeats):
                order = variants if r % 2 == 0 else variants[::-1]
                for i, policy in enumerate(order):
                    res = one(engine, policy, Path(tmp) / f"{r}-{i}", a.requests, a.tokens)
                    got.setdefault(res["policy"], []).append(res)
                    print(
                        f"[policy-cpu] {res['policy']}: {res['us_per_token']:.0f} µs/token", file=sys.stderr
                    )
    finally:
        engine.close()
    print(f"{a.threads} engine thread(s), {a.repeats} interleaved runs of {a.requests} x {a.tokens} tokens")
    print("| policy | recorder CPU per token (median) | range | tokens per run | requests kept / dropped |")
    print("| --- | --- | --- | --- | --- |")
    for name, runs in got.items():
        us = sorted(x["us_per_token"] for x in runs)
        kept = runs[-1]["meta"]["policy"].get("requests", {})
        print(
            f"| {name} | {us[len(us) // 2]:.0f} µs | {us[0]:.0f}-{us[-1]:.0f} µs | {runs[-1]['tokens']} | "
            f"{kept.get('kept', '-')} / {kept.get('dropped', '-')} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
