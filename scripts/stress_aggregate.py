"""Stress: the smallest MoE test model at its top token rate, the recorder attached with
`--policy aggregate` for the whole run; whether it keeps up (losses), what its memory does over
time, and whether the aggregates count every token the engine generated.

    sudo .venv/bin/python scripts/stress_aggregate.py [--seconds 600] [--model moe] [--threads 2]

Requests run back to back (bench_sustained's llama-cpp-python load, 64 tokens each). The
recorder's resident memory (VmRSS) and its anonymous part (RssAnon: its heap, what a memory budget
is about; the rest is shared libraries' pages such as BCC's LLVM) are sampled every second from
/proc. Prints one JSON object."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_sustained import LlamaCppPython, Recording, make_model  # noqa: E402

import sparseety_prof  # noqa: E402

BUDGET_MIB = 256  # the consumer memory budget issue 17 names


def _status_kib(pid: int, keys: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in keys:
                    out[key] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--model", default="moe", help="sparseety_prof/synthetic preset (default: moe)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    a = ap.parse_args()
    model = make_model(ROOT / "models" / f"{a.model}.gguf", a.model)
    eng = LlamaCppPython(model, a.threads, 1)
    samples: list[tuple[float, int, int]] = []  # (seconds since load start, VmRSS KiB, RssAnon KiB)
    with tempfile.TemporaryDirectory(prefix="sparseety-stress-") as tmp:
        try:
            rec = Recording(eng.pid, Path(tmp) / "rec", "full", ["--policy", "aggregate"])
            done = threading.Event()
            t0 = time.monotonic()

            def sample() -> None:
                while not done.wait(1.0):
                    kib = _status_kib(rec.p.pid, ("VmRSS", "RssAnon"))
                    if kib:
                        samples.append((time.monotonic() - t0, kib.get("VmRSS", 0), kib.get("RssAnon", 0)))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            side = eng.load(a.seconds, a.tokens)
            done.set()
            sampler.join()
            stopped = rec.stop()
        finally:
            eng.close()
        r = sparseety_prof.open(Path(tmp) / "rec")
        agg = r.aggregates()
        counted = int(agg.filter(agg["metric"] == "tokens")["count"].sum())
        meta = stopped["meta"]
        anon = [s[2] for s in samples]
        rss = [s[1] for s in samples]
        minute = [s for s in samples if s[0] <= 60.0]
        result = {
            "seconds": a.seconds,
            "model": a.model,
            "tokens_generated": side.tokens,
            "tokens_per_s": round(side.tps(), 1),
            "aggregate_tokens_counted": counted,
            "rows_dropped_by_policy": meta.get("policy", {}).get("rows_dropped"),
            "losses": {k: v for k, v in meta["losses"].items() if v},
            "recorder_cpu_us_per_token": round(stopped["cpu_attached_s"] / max(side.tokens, 1) * 1e6, 1),
            "recorder_rss_mib": {
                "first_minute_max": max(s[1] for s in minute) / 1024 if minute else None,
                "max": max(rss) / 1024 if rss else None,
                "last": rss[-1] / 1024 if rss else None,
            },
            "recorder_anon_mib": {
                "first_minute_max": max(s[2] for s in minute) / 1024 if minute else None,
                "max": max(anon) / 1024 if anon else None,
                "last": anon[-1] / 1024 if anon else None,
            },
            "anon_under_budget": bool(anon) and max(anon) / 1024 <= BUDGET_MIB,
            # how the drains went (ring fill peak, longest gap, escalations, pace) and the budget's account
            "consumer": meta.get("consumer"),
            "memory_budget": meta.get("profiler_memory", {}).get("budget"),
            "recording_bytes": sum(p.stat().st_size for p in (Path(tmp) / "rec").rglob("*") if p.is_file()),
        }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
