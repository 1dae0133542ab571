"""Whether a consumer that gives its core back by itself shortens the engine's waits, on this kernel.

    sudo .venv/bin/python scripts/yield_pieces.py [--seconds 8] [--piece-us 200] [--burst-ms 16]

docs/overhead.md ("In what pieces the recorder's CPU reaches the steps") finds the engine's threads
waiting 2-4 ms each time the recorder takes their core: the kernel ticks at 250 Hz and does not
preempt between ticks, and ggml's threads spin at their barriers, so a consumer that gets the core
keeps it until the tick. A consumer that gave the core back after every ~200 µs of work would cut
each wait to about that. This measures the mechanism alone, without an engine or a recorder:

- a spinner stands for an engine thread (it never sleeps, as ggml's threads do not);
- a simulated consumer at nice 10 (the recorder's default) does `--burst-ms` of CPU work every
  0.5 s (about one drain's work at 0.5 s drains), in steps of 50 µs;
- both are pinned to one core, and `scripts/preempt_stalls.py`'s StallTracer charges the
  spinner's waits to the consumer.

Three ways to run the burst: `none` (all at once: what the recorder's native calls and long
compiled runs do), `yield` (sched_yield after each `--piece-us` of work) and `sleep` (a 20 µs
sleep instead of the yield). Printed per way: the spinner's waits for the consumer (count, total,
the share in waits of 1 ms and more, median and p99 bucket, histogram) and how often the consumer
gave the core back. Each way runs `--seconds`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # bench_figures lives there

from bench_figures import Stalls  # noqa: E402

from scripts.preempt_stalls import StallTracer, table  # noqa: E402

WAYS = ("none", "yield", "sleep")

SPINNER = "while True: pass\n"

# argv: way, piece_us, burst_ms, seconds. Prints how many times it gave the core back.
CONSUMER = r"""
import os, sys, time
way = sys.argv[1]
piece_ns = int(float(sys.argv[2]) * 1000)
burst_ms, seconds = float(sys.argv[3]), float(sys.argv[4])
os.nice(10)
def work(ns):
    end = time.thread_time_ns() + ns
    while time.thread_time_ns() < end:
        pass
given = 0
steps = max(1, int(burst_ms * 1000 / 50))
end = time.monotonic() + seconds
while time.monotonic() < end:
    time.sleep(0.5)
    since = time.perf_counter_ns()
    for _ in range(steps):
        work(50_000)
        if way != "none" and time.perf_counter_ns() - since > piece_ns:
            if way == "yield":
                os.sched_yield()
            else:
                time.sleep(20e-6)
            given += 1
            since = time.perf_counter_ns()
print(given)
"""


class WayResult(NamedTuple):
    way: str
    stalls: Stalls
    given_back: int  # times the consumer gave the core back


def run_way(way: str, seconds: float, piece_us: float, burst_ms: float, cpu: int) -> WayResult:
    """One way, traced: the spinner and the consumer on core `cpu` for `seconds`."""
    if way not in WAYS:
        raise ValueError(f"way must be one of {WAYS}, got {way!r}")
    tracer = StallTracer()
    spinner = subprocess.Popen([sys.executable, "-c", SPINNER])
    try:
        os.sched_setaffinity(spinner.pid, {cpu})
        tracer.add_engine(spinner.pid)
        consumer = subprocess.Popen(
            [sys.executable, "-c", CONSUMER, way, str(piece_us), str(burst_ms), str(seconds)],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
        )
        out, _ = consumer.communicate(timeout=seconds + 30)
        if consumer.returncode != 0:
            raise RuntimeError(f"the simulated consumer exited {consumer.returncode}")
        time.sleep(0.1)  # (the spinner's last wait ends when it runs again)
        stalls = tracer.take({consumer.pid})
    finally:
        spinner.kill()
        spinner.wait()
        tracer.close()
    return WayResult(way, stalls, int(out.strip() or 0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=8.0, help="how long each way runs (default 8)")
    ap.add_argument("--piece-us", type=float, default=200.0, help="work between two give-backs (default 200)")
    ap.add_argument("--burst-ms", type=float, default=16.0, help="the consumer's work per 0.5 s (default 16)")
    ap.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("yield_pieces.py: needs root (BPF)", file=sys.stderr)
        return 2
    cpu = min(os.sched_getaffinity(0))
    print(
        f"[yield_pieces] core {cpu}, a spinner and a consumer at nice 10 doing {a.burst_ms:g} ms every "
        f"0.5 s; {a.seconds:g} s per way; give-backs after {a.piece_us:g} µs of work"
    )
    for way in a.ways:
        r = run_way(way, a.seconds, a.piece_us, a.burst_ms, cpu)
        print(f"\n{way}: the consumer gave the core back {r.given_back} times")
        for row in table(r.stalls):
            print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
