"""What `--otlp` costs the consumer thread: the OTLP sink's take() per token row (summaries, and
token events at a few rates) and the cost of one request span and one step span, on a real
recording's rows.

    .venv/bin/python scripts/bench_otlp_take.py DIR [--frame-rows 2048] [--requests 16] [--repeat 20]

The recording's token rows are tiled into frames of --frame-rows rows (the recorder's largest
frame, store/buffers.ColumnBuffer.FRAME_ROWS) spread over --requests requests, as a busy server's
flush would hand them over. Token rows: the process's CPU per row (polars runs on its own
threads); spans: the calling thread's CPU per span (sending them runs on the SDK's own thread, to
a receiver in this process that answers every POST)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from otlp_receiver import OtlpReceiver  # noqa: E402

import sparseety_prof  # noqa: E402
from sparseety_prof.session.options import Progress  # noqa: E402
from sparseety_prof.session.otlp_sink import OtlpSink  # noqa: E402


def token_frame(tokens: pl.DataFrame, rows: int, requests: int) -> pl.DataFrame:
    reps = -(-rows // tokens.height)
    tiled = pl.concat([tokens] * reps).head(rows)
    return tiled.with_columns(
        (pl.lit("bench-") + (pl.int_range(pl.len()) % requests).cast(pl.String)).alias("request_id"),
        (pl.int_range(pl.len()) % requests).cast(pl.Int32).alias("seq_id"),
    )


def cpu_us_per(fn: object, n_items: int, repeat: int, clock: object = time.process_time_ns) -> float:
    """Median CPU microseconds per item over `repeat` runs of fn(): the process's CPU (polars
    works on its own threads), or `clock`."""
    runs = []
    for _ in range(repeat):
        t0 = clock()  # type: ignore[operator]
        fn()  # type: ignore[operator]
        runs.append((clock() - t0) / 1e3 / n_items)  # type: ignore[operator]
    return sorted(runs)[len(runs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recording", type=Path)
    ap.add_argument("--frame-rows", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    rec = sparseety_prof.open(args.recording)
    tokens, requests, steps = rec.tokens(), rec.requests(), rec.steps()
    frame = token_frame(tokens, args.frame_rows, args.requests)
    receiver = OtlpReceiver()
    try:
        print(f"{args.recording}: {tokens.height} token rows tiled into frames of {frame.height} rows")
        for rate in (0.0, 0.1, 1.0):
            sink = OtlpSink(receiver.url, token_event_rate=rate, wall_offset_ns=0)
            sink.open(rec.meta)

            def take(s: OtlpSink = sink) -> None:
                s.take("tokens", frame)
                s._summaries.drop_all()  # each run starts from no open request, as a new flush would

            us = cpu_us_per(take, frame.height, args.repeat)
            sink.close(rec.meta)
            print(f"take(tokens), token events {rate:g}: {us:.2f} us CPU per token")
        sink = OtlpSink(receiver.url, steps=True, wall_offset_ns=0)
        sink.open(rec.meta)
        many = pl.concat([requests] * max(1, 256 // max(1, requests.height)))

        def place() -> None:
            sink.take("requests", many)
            sink.drained(Progress())

        # spans: the calling thread's CPU (sending them is the SDK thread's, and the receiver is here)
        thread = time.thread_time_ns
        print(
            f"request span: {cpu_us_per(place, many.height, 5, thread):.1f} us CPU per span (calling thread)"
        )
        step_us = cpu_us_per(lambda: sink.take("steps", steps), steps.height, 5, thread)
        print(f"step span (--otlp-steps): {step_us:.1f} us CPU per span (calling thread)")
        acc = sink.close(rec.meta)
        print(f"sent {acc['sent']} spans, dropped {acc['dropped']}, receiver got {len(receiver.spans)}")
    finally:
        receiver.close()


if __name__ == "__main__":
    main()
