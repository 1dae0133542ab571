"""`report DIR --html FILE`: one self-contained HTML page of a recording (expert load, load
imbalance, routing over decode order, sparsity per layer, log-prob, step latency, anomalies and the
per-token table). data.py gathers the numbers, svg.py draws the charts, page.py assembles the page.

The page opens without network: CSS inline, charts inline SVG drawn here, no script; its
Content-Security-Policy forbids scripts and loads from anywhere. Every string from the recording
(token text, request ids, model names) is HTML-escaped."""

from __future__ import annotations

from typing import BinaryIO

from sparseety_prof.store.recording import Recording
from sparseety_prof.views.html_report.data import gather
from sparseety_prof.views.html_report.page import render

__all__ = ["write_html"]


def write_html(rec: Recording, out: BinaryIO, *, request: str | None = None) -> str | None:
    """Write the page to `out`; returns the request it shows (None: the recording has no tokens).
    UsageError when `request` is not a request of the recording."""
    data = gather(rec, request=request)
    # ASCII with character references: the bytes mean the same whatever charset a viewer assumes
    out.write(render(data, rec.redaction_levels).encode("ascii", "xmlcharrefreplace"))
    return data.request
