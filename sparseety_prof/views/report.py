"""`report DIR`: summary tables of a recording in the terminal."""

from __future__ import annotations

from pathlib import Path

import polars as pl
from rich.console import Console
from rich.table import Table

from sparseety_prof.store.recording import open as open_recording
from sparseety_prof.store.recording import section
from sparseety_prof.terminal_text import text
from sparseety_prof.views.anomaly_list import print_anomalies
from sparseety_prof.views.fitted_table import print_fitted
from sparseety_prof.views.request_timing import (
    request_times,
    slowest_requests,
    slowest_tokens,
    token_context,
)

#: short headers for the requests table (its legend says what they mean), so that it fits 80 columns
_HEADERS = {
    "request_id": "request",
    "mean_log_prob": "lp mean",
    "min_log_prob": "lp min",
    "span_ms": "span ms",
    "ttft_ms": "ttft ms",
    "itl_p50_ms": "itl p50",
}
_LEGEND = (
    "lp: log-prob of the sampled tokens (nats); span: first to last token; id: where the request id "
    "came from; ttft: time to first token; itl p50: median inter-token latency (ms)"
)


_TIMING_HEADERS = ["request", "queued", "prompt", "decode", "ttft", "total", "in", "out", "in/s", "out/s"]
_TIMING_LEGEND = (
    "ms; queued: received to slot launch (- where the server's socket read was not seen); prompt: slot "
    "launch to first token; decode: first to last token; total: received (or started) to last token; "
    "in, out: prompt rows computed, tokens generated; in/s: prompt rows per second of prompt; out/s: "
    "tokens after the first per second of decode"
)
_SLOW_REQUEST_HEADERS = [
    "request",
    "total ms",
    "out/s",
    "steps",
    "seqs/step",
    "w/ prompt",
    "worst gap",
]
_SLOW_REQUEST_LEGEND = (
    "out/s: tokens after the first per second of decode; steps: its decode steps; seqs/step: mean "
    "sequences sharing them; w/ prompt: how many also ran prompt rows; worst gap: its longest wait "
    "for a token (ms)"
)
_SLOW_TOKEN_HEADERS = ["request", "#", "token", "gap ms", "step ms", "seqs", "rows", "prompt rows"]
_SLOW_TOKEN_LEGEND = (
    "#: decode order; gap: time since the request's previous token; step: its forward pass; seqs, "
    "rows, prompt rows: the sequences, rows and prompt rows in that step"
)


def _cell(v: object, digits: int = 1) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _token_label(text_value: str | None, token_id: int | None) -> str:
    return repr(text_value) if text_value is not None else f"#{token_id}" if token_id is not None else "?"


def print_timing(con: Console, requests: pl.DataFrame, tokens: pl.DataFrame, steps: pl.DataFrame) -> None:
    """Where each request's time went, then the slowest requests and tokens with their step's
    batch context (views/request_timing.py)."""
    times = request_times(requests)
    context = token_context(tokens, steps)
    if times.height:
        cells = [
            [
                _cell(r[c])
                for c in ("request_id", "queued_ms", "prompt_ms", "decode_ms", "ttft_ms", "total_ms")
            ]
            + [_cell(r["prompt_tokens"]), _cell(r["output_tokens"])]
            + [_cell(r["prompt_tok_s"]), _cell(r["decode_tok_s"])]
            for r in times.iter_rows(named=True)
        ]
        print_fitted(con, "where the time went", _TIMING_HEADERS, cells, legend=_TIMING_LEGEND)
        slow = slowest_requests(times, context)
        if slow.height:
            cells = [
                [
                    _cell(r["request_id"]),
                    _cell(r["total_ms"]),
                    _cell(r["decode_tok_s"]),
                    _cell(r["decode_steps"]),
                    _cell(r["mean_step_seqs"]),
                    _cell(r["steps_with_prompt_rows"]),
                    _cell(r["max_gap_ms"]),
                ]
                for r in slow.iter_rows(named=True)
            ]
            print_fitted(con, "slowest requests", _SLOW_REQUEST_HEADERS, cells, legend=_SLOW_REQUEST_LEGEND)
    slow_tokens = slowest_tokens(context)
    if slow_tokens.height:
        cells = [
            [
                _cell(r["request_id"]),
                _cell(r["decode_order"]),
                _token_label(r["token_text"], r["token_id"]),
                _cell(r["gap_ms"], 2),
                _cell(r["step_ms"], 2),
                _cell(r["step_seqs"]),
                _cell(r["step_rows"]),
                _cell(r["step_prompt_rows"]),
            ]
            for r in slow_tokens.iter_rows(named=True)
        ]
        print_fitted(con, "slowest tokens", _SLOW_TOKEN_HEADERS, cells, legend=_SLOW_TOKEN_LEGEND)


def _row(table: Table, *cells: object) -> None:
    """A row whose every cell is shown as Text with hidden characters spelled out: ids, names
    and paths in a recording come from the target and its clients."""
    table.add_row(*[text(c) for c in cells])


def print_report(path: Path, *, console: Console | None = None, anomalies: bool = False) -> None:
    """The recording's header, then per-request tables (what each produced; where its time went;
    the slowest requests and tokens with their batch context), GPU-kernel and step-latency tables
    (each only when the recording holds such rows), then with `anomalies` what the anomaly
    detectors found."""
    con = console or Console()
    r = open_recording(path)
    tokens, steps = r.tokens(), r.steps()

    head = Table(title=text(f"recording {path}"), show_header=False)
    engine = section(r, "engine")
    model = section(r, "model")
    _row(head, "engine", f"{engine.get('name', '?')} {engine.get('version', '?')}")
    _row(
        head,
        "model",
        f"{model.get('path', '?')} ({model.get('architecture', '?')}, sha256 "
        f"{str(model.get('sha256', ''))[:12]}…)",
    )
    _row(head, "target", f"PID {section(r, 'target').get('pid', '?')}")
    _row(
        head,
        "complete",
        str(r.complete) + ("" if r.complete else " (interrupted: the last segment may be lost)"),
    )
    losses = section(r, "losses")
    _row(head, "losses", ", ".join(f"{k}={v}" for k, v in losses.items()) or "unknown")
    _row(head, "tokens / steps", f"{tokens.height} / {steps.height}")
    con.print(head)

    if tokens.height:
        per_req = tokens.group_by("request_id", maintain_order=True).agg(
            pl.len().alias("tokens"),
            pl.col("partial").any().alias("partial"),
            pl.col("log_prob").mean().alias("mean_log_prob"),
            pl.col("log_prob").min().alias("min_log_prob"),
            ((pl.col("t_end_ns").max() - pl.col("t_end_ns").min()) / 1e6).alias("span_ms"),
        )
        reqs = r.requests()
        if reqs.height:  # id source, time to first token and inter-token latency, when recorded
            per_req = per_req.join(
                reqs.group_by("request_id", maintain_order=True).agg(
                    pl.col("id_source").first().alias("id"),
                    pl.col("ttft_ms").max().alias("ttft_ms"),
                    pl.col("itl_p50_ms").median().alias("itl_p50_ms"),
                    pl.col("end_reason").first().alias("end"),
                ),
                on="request_id",
                how="left",
            )
        headers = [_HEADERS.get(c, c) for c in per_req.columns]
        cells = [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row] for row in per_req.iter_rows()]
        print_fitted(con, "requests", headers, cells, legend=_LEGEND)
    print_timing(con, r.requests(), tokens, steps)
    kernels = r.kernels()
    if kernels.height:
        k_us = (pl.col("end_ns") - pl.col("start_ns")) / 1e3
        top = (
            kernels.group_by("name")
            .agg(pl.len().alias("launches"), k_us.sum().alias("total_us"), k_us.median().alias("median_us"))
            .sort("total_us", descending=True, nulls_last=True)
            .head(10)
        )
        joined = kernels.filter(pl.col("step_id").is_not_null()).height
        cells = [[f"{v:.1f}" if isinstance(v, float) else str(v) for v in row] for row in top.iter_rows()]
        print_fitted(con, f"GPU kernels ({kernels.height}, {joined} joined to a step)", top.columns, cells)
    if steps.height:
        dur = ((steps["t_end_ns"] - steps["t_start_ns"]) / 1e6).drop_nulls()
        lat = []
        for phase in ("prefill", "decode"):
            d = dur.filter(steps["phase"] == phase)
            if len(d):
                lat.append([phase, str(len(d)), f"{d.quantile(0.5):.3f}", f"{d.quantile(0.99):.3f}"])
        print_fitted(con, "steps (ms)", ["phase", "steps", "p50", "p99"], lat)
    if anomalies:
        print_anomalies(con, r)
