"""`export DIR --otlp URL`: a finished recording's requests (and steps) sent as the same spans
`record --otlp` sends live (session/otlp_spans.py), waiting for the collector instead of
dropping."""

from __future__ import annotations

from typing import Any

import polars as pl

from sparseety_prof.errors import UsageError
from sparseety_prof.session.options import Progress
from sparseety_prof.session.otlp_sink import OtlpSink
from sparseety_prof.session.otlp_spans import wall_offset_from
from sparseety_prof.store.recording import Recording
from sparseety_prof.terminal_text import visible

REQUESTS_PER_FRAME = 256  # requests fed to the sink at a time, with their tokens


def send_recording(rec: Recording, url: str, *, token_event_rate: float, steps: bool) -> dict[str, Any]:
    """Feed the recording through an OtlpSink in request order; the sink's close account."""
    tokens, requests = rec.tokens(), rec.requests()
    step_rows = rec.steps()
    offset = wall_offset_from(tokens, step_rows)
    if offset is None:
        raise UsageError(
            f"{visible(rec.path)} has no token or step rows: nothing to send (or to place in time)"
        )
    sink = OtlpSink(url, token_event_rate=token_event_rate, steps=steps, blocking=True, wall_offset_ns=offset)
    sink.open(rec.meta)
    keys = ["request_id", "ctx_id", "seq_id"]
    chunk = (
        requests.select(keys).with_row_index("_chunk").with_columns(pl.col("_chunk") // REQUESTS_PER_FRAME)
    )
    chunk = chunk.unique(subset=keys, keep="first", maintain_order=True)
    tagged = tokens.join(chunk, on=keys, how="left", nulls_equal=True, maintain_order="left")
    by_chunk = tagged.partition_by("_chunk", as_dict=True, include_key=False, maintain_order=True)
    req_by_chunk = (
        requests.with_row_index("_chunk")
        .with_columns(pl.col("_chunk") // REQUESTS_PER_FRAME)
        .partition_by("_chunk", as_dict=True, include_key=False, maintain_order=True)
    )
    for (n,), reqs in req_by_chunk.items():
        toks = by_chunk.get((n,))
        if toks is not None:
            sink.take("tokens", toks)
        sink.take("requests", reqs)
        sink.drained(Progress())
    if steps and step_rows.height:
        sink.take("steps", step_rows)
    return sink.close(rec.meta)
