"""The latencies an SRE pages on, per request, from the requests table's rows: time to first
token, time per output token, request duration and queue time, in seconds, named and bucketed
after the OpenTelemetry GenAI model server metrics (gen_ai.server.time_to_first_token,
gen_ai.server.time_per_output_token, gen_ai.server.request.duration; the conventions have no
queue time, which takes the request duration's buckets). docs/fleet-metrics.md lists them.

Every time is a difference of two CLOCK_MONOTONIC columns of one row (schema.REQUESTS), taken in
integer nanoseconds and then divided by 1e9. `t0`, a request's arrival, is `t_received_ns` (the
server read its bytes from the socket) where the server reports it, else `t_started_ns` (its slot
launch, or its sequence's first step for other front ends), as the table's `ttft_ms` takes it:

- time to first token = t_first_token_ns - t0, for a request not `partial`;
- time per output token = (t_last_token_ns - t_first_token_ns) / (output_tokens - 1), for a
  request with output_tokens >= 2 (the tokens after the first, over the time after the first;
  a partial request's counts and times are those the recorder saw, which agree);
- request duration = t_last_token_ns - t0 (to the last output token), for a request not
  `partial` that ended (end_reason neither "detached" nor "records_lost": the recorder did not
  see its end);
- queue time = t_started_ns - t_received_ns, for a request not `partial` whose server reported
  both (llama-server: from reading the request to launching it on a slot).

A row missing a column a latency needs gives no value for it (NaN); so does a difference below
zero, which one monotonic clock cannot give. A request forked from another sequence (n > 1
completions) counts in output_tokens the tokens it shares with its parent, and its own first
token in t_first_token_ns: its time per output token is as the formula gives it."""

from __future__ import annotations

import numpy as np
import polars as pl

from sparseety_prof.store import schema

#: gen_ai.server.time_to_first_token's recommended bucket boundaries (seconds)
TTFT_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
#: gen_ai.server.time_per_output_token's recommended bucket boundaries (seconds)
TPOT_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
#: gen_ai.server.request.duration's recommended bucket boundaries (seconds)
DURATION_BUCKETS: tuple[float, ...] = (
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)

TTFT = "time_to_first_token"
TPOT = "time_per_output_token"
DURATION = "request_duration"
QUEUE = "request_queue_time"
#: latency -> its bucket boundaries, in exposition order (the metric is <prefix>_<name>_seconds)
BUCKETS: dict[str, tuple[float, ...]] = {
    TTFT: TTFT_BUCKETS,
    TPOT: TPOT_BUCKETS,
    DURATION: DURATION_BUCKETS,
    QUEUE: DURATION_BUCKETS,
}
#: end reasons of requests whose end the recorder did not see (schema.REQUESTS end_reason)
UNSEEN_ENDS: tuple[str, ...] = ("detached", "records_lost")
#: what request_latencies reads of a requests row
COLUMNS = schema.columns(
    "requests",
    "t_received_ns",
    "t_started_ns",
    "t_first_token_ns",
    "t_last_token_ns",
    "output_tokens",
    "end_reason",
    "partial",
)


def request_latencies(df: pl.DataFrame) -> dict[str, np.ndarray]:
    """Per latency of BUCKETS, one float64 value per row of a requests frame, in seconds (NaN
    where the row gives none; see the module docstring for each definition)."""
    whole = ~pl.col("partial").fill_null(False)
    t0 = pl.coalesce("t_received_ns", "t_started_ns")
    ended = ~pl.col("end_reason").is_in(list(UNSEEN_ENDS)).fill_null(False)
    several = pl.col("output_tokens") >= 2
    # the differences in Int64 ns, exact and null-aware, in polars; the divisions in numpy, which
    # divides (polars may multiply by the reciprocal instead, and a value on a bucket boundary
    # would then fall either side of it)
    ns = df.select(
        pl.when(whole).then(pl.col("t_first_token_ns") - t0).alias(TTFT),
        pl.when(several).then(pl.col("t_last_token_ns") - pl.col("t_first_token_ns")).alias(TPOT),
        pl.when(whole & ended).then(pl.col("t_last_token_ns") - t0).alias(DURATION),
        pl.when(whole).then(pl.col("t_started_ns") - pl.col("t_received_ns")).alias(QUEUE),
        pl.when(several).then(pl.col("output_tokens") - 1).alias("after_first"),
    )
    out = {name: _floats(ns[name]) / 1e9 for name in BUCKETS}
    out[TPOT] = out[TPOT] / _floats(ns["after_first"])
    for values in out.values():
        values[values < 0] = np.nan  # not on one monotonic clock: not observed
    return out


def _floats(column: pl.Series) -> np.ndarray:
    """A column of integers as float64, NaN where null (differences of ns: exact in float64)."""
    return column.cast(pl.Float64).to_numpy().astype(np.float64, copy=True)
