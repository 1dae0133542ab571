"""The logits statistics' floor: what the C backend (correlate/logits.py row_stats, the recorder's
`logits` stage) costs per row at a vocabulary size, with the rows in the CPU's caches and with
them evicted first, on this thread's CPU clock.

    .venv/bin/python scripts/bench_logit_stats.py [--vocab 32000] [--rows 1 16 160] [--repeat 5]

Every row is read whole once (log-sum-exp, entropy and the top-k need every value), so the cost
per row grows with the vocabulary whatever the consumer's design; the recorder reads the rows in
the ring, where the probes wrote them up to a drain interval earlier. "warm": the best of
`--repeat` calls on the same rows; "cold": one call after a buffer of `--evict-mb` was read, which
pushes the rows out of the caches this VM shows (its L3 may be shared with other tenants).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from sparseety_prof.correlate.logits import BACKEND, row_stats

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 160], help="rows per call")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--evict-mb", type=int, default=1024, help="bytes read between cold calls")
    a = ap.parse_args()
    if a.vocab < 1 or a.repeat < 1 or min(a.rows) < 1:
        ap.error("--vocab, --rows and --repeat must be positive")
    rng = np.random.default_rng(0)
    evict = np.ones(a.evict_mb * 2**20 // 8)
    print(f"backend {BACKEND}, vocabulary {a.vocab:,} ({a.vocab * 4 / 1024:.0f} KiB a row)")
    print("| rows per call | warm µs per row | cold µs per row |")
    print("| --- | --- | --- |")
    for n in a.rows:
        # logits of a trained model's spread (a few units), so that the top-k scan stays rare
        rows = (rng.standard_normal((n, a.vocab)) * 3).astype(np.float32)
        tokens = rng.integers(0, a.vocab, n)
        warm = float("inf")
        for _ in range(a.repeat):
            t = time.thread_time()
            row_stats(rows, tokens)
            warm = min(warm, time.thread_time() - t)
        cold = float("inf")
        for _ in range(a.repeat):
            evict.sum()
            t = time.thread_time()
            row_stats(rows, tokens)
            cold = min(cold, time.thread_time() - t)
        print(f"| {n} | {warm / n * 1e6:.1f} | {cold / n * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
