"""What the request latency histograms of --metrics-port cost the consumer: CPU time of one
MetricsTally.add("requests", frame) (session/request_latency.py's differences and divisions and
the four histograms' updates) for frames of 1, 16 and 256 requests rows, the median of --repeat
rounds of 200 calls each, in the process's CPU time (polars may work on threads of its own).
docs/fleet-metrics.md quotes it.

    .venv/bin/python scripts/request_latency_cost.py [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import polars as pl  # noqa: E402

from sparseety_prof.session.metrics_tally import MetricsTally  # noqa: E402
from sparseety_prof.store import schema  # noqa: E402

S = 1_000_000_000
CALLS = 200


def requests_frame(n: int) -> pl.DataFrame:
    """n server requests, each read, launched, answered with 50 tokens and released."""
    cols: schema.Columns = {c: [None] * n for c in schema.REQUESTS}
    cols.update(
        t_received_ns=[i * S for i in range(n)],
        t_started_ns=[i * S + 5_000 for i in range(n)],
        t_first_token_ns=[i * S + 10_000_000 for i in range(n)],
        t_last_token_ns=[i * S + 900_000_000 for i in range(n)],
        output_tokens=[50] * n,
        partial=[False] * n,
        end_reason=["released"] * n,
    )
    return schema.frame("requests", cols)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    for n in (1, 16, 256):
        df, tally = requests_frame(n), MetricsTally([], 0, [])
        tally.add("requests", df)  # polars' first-call set-up out of the timing
        rounds = []
        for _ in range(a.repeat):
            c0 = time.process_time()
            for _ in range(CALLS):
                tally.add("requests", df)
            rounds.append((time.process_time() - c0) / CALLS)
        print(f"{n:4d} requests rows per frame: {statistics.median(rounds) * 1e6:.0f} us CPU per frame")


if __name__ == "__main__":
    main()
