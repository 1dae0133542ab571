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


def _row(table: Table, *cells: object) -> None:
    """A row whose every cell is shown as Text with hidden characters spelled out: ids, names
    and paths in a recording come from the target and its clients."""
    table.add_row(*[text(c) for c in cells])


def print_report(path: Path, *, console: Console | None = None, anomalies: bool = False) -> None:
    """The recording's header, then per-request, GPU-kernel and step-latency tables (each only when
    the recording holds such rows), then with `anomalies` what the anomaly detectors found."""
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
