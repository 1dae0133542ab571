"""`report DIR --json`: the report as one JSON document, for scripts. Every count is the
recording's own (rows of its tables); the per-request entries join what the tokens table holds of
a request with where its time went (views/request_timing.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import polars as pl

from sparseety_prof.store.recording import Recording, section
from sparseety_prof.store.recording import open as open_recording
from sparseety_prof.views.request_timing import (
    request_times,
    slowest_requests,
    slowest_tokens,
    token_context,
)

JSON_FORMAT = "sparseety-prof report"
JSON_VERSION = 1
#: the tables whose rows `counts` gives
COUNTED_TABLES = ("tokens", "steps", "requests", "routes", "kernels")


def _clean(v: Any) -> Any:
    """JSON has no NaN or infinity: null, as for a value the recording does not hold."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _records(frame: pl.DataFrame) -> list[dict[str, Any]]:
    return [{k: _clean(v) for k, v in row.items()} for row in frame.iter_rows(named=True)]


def _per_request(tokens: pl.DataFrame, requests: pl.DataFrame) -> pl.DataFrame:
    """One row per request id seen in the tokens or the requests table, in the order first seen
    (tokens first): its token count and log-probs, and where its time went (the first requests
    row of that id; null for a request with no requests row)."""
    produced = tokens.group_by("request_id", maintain_order=True).agg(
        pl.len().cast(pl.Int64).alias("tokens"),
        pl.col("partial").any().alias("tokens_partial"),
        pl.col("log_prob").mean().alias("mean_log_prob"),
        pl.col("log_prob").min().alias("min_log_prob"),
    )
    times = request_times(requests).unique("request_id", keep="first", maintain_order=True)
    joined = produced.join(times, on="request_id", how="full", coalesce=True, maintain_order="left_right")
    return joined.with_columns(
        pl.col("tokens").fill_null(0),
        pl.coalesce("partial", "tokens_partial").alias("partial"),
    ).drop("tokens_partial")


def _step_latency(steps: pl.DataFrame) -> dict[str, dict[str, Any]]:
    dur = (steps["t_end_ns"] - steps["t_start_ns"]) / 1e6
    out: dict[str, dict[str, Any]] = {}
    for phase in ("prefill", "decode"):
        d = dur.filter(steps["phase"] == phase).drop_nulls()
        if len(d):
            out[phase] = {"steps": len(d), "p50_ms": d.quantile(0.5), "p99_ms": d.quantile(0.99)}
    return out


def report_json(rec: Recording | Path, *, anomalies: bool = False) -> dict[str, Any]:
    """The report of a recording (or of the recording at a path) as a JSON-ready dict; with
    `anomalies`, what the anomaly detectors found too."""
    r = rec if isinstance(rec, Recording) else open_recording(rec)
    tokens, steps, requests = r.tokens(), r.steps(), r.requests()
    context = token_context(tokens, steps)
    engine, model = section(r, "engine"), section(r, "model")
    out: dict[str, Any] = {
        "format": JSON_FORMAT,
        "version": JSON_VERSION,
        "recording": str(r.path),
        "engine": {"name": engine.get("name"), "version": engine.get("version")},
        "model": {k: model.get(k) for k in ("path", "architecture", "sha256")},
        "target_pid": section(r, "target").get("pid"),
        "complete": r.complete,
        "losses": section(r, "losses"),
        "counts": {t: r.table(t).height for t in COUNTED_TABLES},
        "requests": _records(_per_request(tokens, requests)),
        "slowest_requests": _records(slowest_requests(request_times(requests), context)),
        "slowest_tokens": _records(slowest_tokens(context)),
        "step_latency": _step_latency(steps),
    }
    if anomalies:
        out["anomalies"] = _records(r.anomalies())
    return out
