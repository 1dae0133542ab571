"""The request latencies of docs/fleet-metrics.md computed from requests rows one by one, in plain
Python integers: what the metrics endpoint's histograms (session/request_latency.py, vectorised
in polars and numpy) are compared with, by test_metrics_sink.py on frames made there and by
test_metrics_prometheus.py on a real recording through PromQL."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: latency -> its metric's name (the endpoint's prefix and the seconds unit)
METRICS = {
    "time_to_first_token": "sparseety_time_to_first_token_seconds",
    "time_per_output_token": "sparseety_time_per_output_token_seconds",
    "request_duration": "sparseety_request_duration_seconds",
    "request_queue_time": "sparseety_request_queue_time_seconds",
}


def want_latencies(rows: Iterable[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Per latency, the values (seconds) of the rows that have one, in row order."""
    out: dict[str, list[float]] = {k: [] for k in METRICS}

    def observe(name: str, ns: int | None, per: int = 1) -> None:
        if ns is not None and ns >= 0:
            out[name].append(ns / 1e9 / per)

    for r in rows:
        recv, start = r["t_received_ns"], r["t_started_ns"]
        first, last, n = r["t_first_token_ns"], r["t_last_token_ns"], r["output_tokens"]
        arrival = recv if recv is not None else start
        whole = not r["partial"]
        if whole and first is not None and arrival is not None:
            observe("time_to_first_token", first - arrival)
        if n is not None and n >= 2 and first is not None and last is not None:
            observe("time_per_output_token", last - first, n - 1)
        ended = r["end_reason"] not in ("detached", "records_lost")
        if whole and ended and last is not None and arrival is not None:
            observe("request_duration", last - arrival)
        if whole and recv is not None and start is not None:
            observe("request_queue_time", start - recv)
    return out
