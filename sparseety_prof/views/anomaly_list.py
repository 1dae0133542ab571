"""`report DIR --anomalies`: what the anomaly detectors found, one block per anomaly: its kind,
where (request, decode order, layer), its score, the detector's reason, and the tokens around it
with the anomaly's own tokens highlighted."""

from __future__ import annotations

from typing import Any

import polars as pl
from rich.console import Console
from rich.text import Text

from sparseety_prof.store.recording import Recording
from sparseety_prof.terminal_text import text, visible

#: tokens shown before and after an anomaly, and at most this many of its own (a long loop is
#: shown by its start and its end)
CONTEXT = 3
SHOWN_INSIDE = 8


def _token(row: dict[str, Any]) -> str:
    """A token as a person reads it: its text made visible (spaces as '␣' so that token edges
    show), or its id when the text was redacted."""
    if row["token_text"] is not None:
        return visible(row["token_text"]).replace(" ", "␣") or "''"
    return f"#{row['token_id']}" if row["token_id"] is not None else "?"


def tokens_around(tokens: pl.DataFrame, a: dict[str, Any]) -> Text | None:
    """The anomaly's tokens (reverse video) with CONTEXT tokens each side; None when it belongs to
    no request's decode order (recording-wide, or a request joined mid-way)."""
    if a["request_id"] is None or a["decode_order"] is None:
        return None
    first, last = (
        a["decode_order"],
        a["decode_order_end"] if a["decode_order_end"] is not None else a["decode_order"],
    )
    req = tokens.filter(
        (pl.col("request_id") == a["request_id"])
        & pl.col("decode_order").is_between(first - CONTEXT, last + CONTEXT)
    ).sort("decode_order")
    out = Text()
    if first > CONTEXT:
        out.append("… ")
    skipped = False
    for row in req.iter_rows(named=True):
        d = row["decode_order"]
        inside = first <= d <= last
        if inside and d - first >= SHOWN_INSIDE // 2 and last - d >= SHOWN_INSIDE // 2:
            if not skipped:
                out.append(f"[{last - first + 1 - SHOWN_INSIDE} more] ", style="dim")
                skipped = True
            continue
        out.append(_token(row), style="reverse" if inside else "")
        out.append(" ")
    if req.height and req["decode_order"].max() == last + CONTEXT:
        out.append("…")
    return out


def _where(a: dict[str, Any]) -> str:
    parts = []
    if a["request_id"] is not None:
        parts.append(f"request {visible(a['request_id'])}")
    if a["decode_order"] is not None:
        end = a["decode_order_end"]
        parts.append(
            f"decode order {a['decode_order']}" + (f"-{end}" if end not in (None, a["decode_order"]) else "")
        )
    if a["layer"] is not None:
        parts.append(f"layer {a['layer']}")
    if a["step_id"] is not None:
        parts.append(f"step {a['step_id']}")
    return ", ".join(parts) or "whole recording"


def print_anomalies(con: Console, rec: Recording) -> None:
    found = rec.anomalies()
    con.rule(f"anomalies ({found.height})")
    if found.is_empty():
        con.print("no anomalies found")
        return
    tokens = rec.tokens()
    for a in found.iter_rows(named=True):
        head = Text()
        head.append(a["kind"], style="bold")
        head.append(f"  score {a['score']:.1f}  ")
        head.append(_where(a))
        con.print(head)
        con.print(text(a["reason"]), style="", soft_wrap=False)
        around = tokens_around(tokens, a)
        if around is not None:
            con.print(Text("  tokens: ") + around)
