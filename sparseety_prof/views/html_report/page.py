"""The HTML page: one file, its CSS inline, its charts inline SVG, no script and nothing fetched.

Its Content-Security-Policy (default-src 'none', inline style only) makes the browser refuse any
script and any load from elsewhere, so even text that escaped `esc` could not run or call out;
every string from the recording is escaped all the same."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from sparseety_prof.views.html_report import svg
from sparseety_prof.views.html_report.data import ANOMALY_CAP, MAX_EXPERTS, STEP_POINTS, TOKEN_CAP, ReportData
from sparseety_prof.views.html_report.flame import flame_svg
from sparseety_prof.views.html_report.svg import esc, num

#: what the page's policy allows: its own inline <style>; no script, no fetch, no image, no frame
CSP = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"
#: request ids listed for --request
REQUESTS_LISTED = 20
#: MoE layers whose experts per token are drawn (each a plot of tokens x experts; the change map
#: above them covers every layer)
DETAIL_LAYERS = 8

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fff}
h1{font-size:1.4em}h2{font-size:1.15em;margin:1.6em 0 .3em;border-bottom:1px solid #ccc}
section{margin-bottom:1.2em}.note{color:#555;font-style:italic}.missing{color:#8a5a00;font-weight:600}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:2px 6px;
vertical-align:top;text-align:left}th{background:#f3f3f3}code{white-space:pre-wrap;word-break:break-all}
svg{display:block;margin:.4em 0;overflow:visible}svg .lbl{font-size:12px;fill:#222}
svg .tick{font-size:10px;fill:#555}svg .axis{stroke:#888}svg .frame{fill:none;stroke:#ccc}
details{margin:.2em 0}summary{cursor:pointer}
svg .fl{font-size:11px;fill:#000;pointer-events:none}
"""


def _panel(anchor: str, title: str, body: str, note: str = "") -> str:
    n = f'<p class="note">{esc(note)}</p>' if note else ""
    return f'<section id="{anchor}"><h2>{esc(title)}</h2>{n}{body}</section>'


def _missing(why: str) -> str:
    return f'<p class="missing">{esc(why)}</p>'


def _table(head: list[str], rows: list[list[str]]) -> str:
    """`rows` are already-escaped cells."""
    h = "".join(f"<th>{esc(c)}</th>" for c in head)
    b = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{b}</tbody></table>"


def _header(d: ReportData) -> str:
    rows = [[esc(k), esc(v)] for k, v in d.facts]
    if d.request is not None:
        rows.append(
            [
                "request shown",
                f"<code>{esc(d.request)}</code> ({d.request_tokens} tokens"
                + (f"; the first {TOKEN_CAP} are shown" if d.request_tokens > TOKEN_CAP else "")
                + ")",
            ]
        )
    others = [f"<code>{esc(r)}</code>" for r in d.request_ids[:REQUESTS_LISTED]]
    if others:
        more = (
            f" and {len(d.request_ids) - REQUESTS_LISTED} more"
            if len(d.request_ids) > REQUESTS_LISTED
            else ""
        )
        rows.append(["requests (longest first)", ", ".join(others) + esc(more)])
    return _table(["", ""], rows)


def _load(d: ReportData) -> tuple[str, str]:
    if d.load is None:
        why = d.notes.get("load", "not captured")
        return _panel("expert-load", "Expert load per layer", _missing(why)), _panel(
            "load-imbalance", "Load imbalance per layer", _missing(why)
        )
    load = d.load
    totals = load.counts.sum(axis=1)

    def tip(i: int, j: int) -> str:
        n = int(load.counts[i, j])
        share = n / totals[i] if totals[i] else 0.0
        return f"layer {load.layers[i]}, expert {j}: {n} selections ({share:.1%} of the layer's)"

    heat = svg.heatmap(
        load.counts.astype(float),
        load.layers,
        list(range(load.counts.shape[1])),
        row_title="layer",
        col_title="expert",
        tip=tip,
        label="expert load per layer",
    )
    imb = load.imbalance()
    bars = svg.bars(
        load.layers,
        [("busiest expert / mean", [float(x) for x in imb])],
        cat_title="layer",
        y_title="busiest expert's selections / the mean per expert (1 = balanced)",
        label="load imbalance per layer",
    )
    worst = int(np.argmax(imb)) if len(imb) else 0
    return (
        _panel(
            "expert-load", "Expert load per layer", heat, f"selections per expert, counted over {load.source}"
        ),
        _panel(
            "load-imbalance",
            "Load imbalance per layer",
            bars,
            f"most imbalanced: layer {load.layers[worst]} ({num(float(imb[worst]))}x the mean)"
            if len(imb)
            else "",
        ),
    )


def _expert_sets(d: ReportData) -> list[list[set[int] | None]] | None:
    """Per shown token, per MoE layer, the experts it chose (None where the layer has no list)."""
    lists = d.tokens["expert_ids"].to_list()
    if not any(lists):  # null, or an empty list per token (a dense model: no MoE layer)
        return None
    return [[set(e) if e is not None else None for e in (t or [])] for t in lists]


def _routing(d: ReportData, levels: list[str]) -> str:
    title = "Routing over decode order"
    if d.request is None:
        return _panel("routing", title, _missing(d.notes["request"]))
    sets = _expert_sets(d)
    if sets is None:
        if "routing" in levels:
            why = "redacted (--redact routing)"
        elif not d.moe_layers:
            why = "not captured: the model has no MoE layers (a dense model)"
        else:
            why = "not captured: no MoE routing for this request (recorded with --mode tokens?)"
        return _panel("routing", title, _missing(why))
    n_layers = max(len(t) for t in sets)
    layers = d.moe_layers if len(d.moe_layers) == n_layers else list(range(n_layers))
    change = np.full((n_layers, len(sets)), np.nan)
    for j in range(1, len(sets)):
        for i in range(n_layers):
            a = sets[j][i] if i < len(sets[j]) else None
            b = sets[j - 1][i] if i < len(sets[j - 1]) else None
            if a is not None and b is not None and (a or b):
                change[i, j] = 1 - len(a & b) / len(a | b)
    grid = svg.binned_grid(
        change,
        layers,
        row_title="layer",
        col_title="token (decode order)",
        low="same experts",
        high="all changed",
        label="routing changes per layer",
    )
    detail: list[str] = []
    # at most DETAIL_LAYERS of them, spread evenly from the first MoE layer to the last
    shown = sorted({round(k * (n_layers - 1) / max(1, DETAIL_LAYERS - 1)) for k in range(DETAIL_LAYERS)})
    for i in shown if n_layers > DETAIL_LAYERS else range(n_layers):
        layer = layers[i]
        marks = [
            (j, e)
            for j, t in enumerate(sets)
            if i < len(t) and t[i]
            for e in t[i] or ()
            if 0 <= e < MAX_EXPERTS
        ]
        if not marks:
            continue
        width = max(e for _, e in marks) + 1
        if d.load is not None:
            width = max(width, d.load.counts.shape[1])
        plot = svg.dots(
            marks, len(sets), width, col_title="token", row_title="expert", label=f"layer {layer}"
        )
        summary = f"<summary>layer {esc(layer)}: experts chosen per token</summary>"
        detail.append(f"<details{' open' if not detail else ''}>{summary}{plot}</details>")
    note = (
        f"request {visible_short(d.request)}: each cell is how much a layer's expert set changed from the "
        "previous token (Jaccard distance: 0 = the same experts, 1 = none in common)"
    ) + (
        f"; the experts chosen are drawn for {DETAIL_LAYERS} of the {n_layers} MoE layers, spread evenly"
        if n_layers > DETAIL_LAYERS
        else ""
    )
    return _panel("routing", title, grid + "".join(detail), note)


def visible_short(s: str, n: int = 60) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def _sparsity(d: ReportData) -> str:
    title = "Activation sparsity per layer"
    if d.sparsity is None:
        return _panel("sparsity", title, _missing(d.notes.get("sparsity", "not captured")))
    s = d.sparsity
    chart = svg.bars(
        s.layers,
        [("act_zero_ratio", s.zero), ("act_below_ratio", s.below)],
        cat_title="layer",
        y_title="mean share of FFN activations: exactly zero / below the threshold",
        label="activation sparsity per layer",
    )  # scaled to the largest ratio: SiLU layers' few percent would not show on a 0-1 axis
    return _panel("sparsity", title, chart, f"mean over {s.source}")


def _logprob(d: ReportData) -> str:
    title = "Log-prob over the sequence"
    if d.request is None:
        return _panel("logprob", title, _missing(d.notes["request"]))
    lp = d.tokens.with_row_index("i").filter(pl.col("log_prob").is_not_null())
    if not lp.height:
        return _panel("logprob", title, _missing("not captured: no log-probs for this request"))
    chart = svg.scatter(
        [("log-prob", lp["i"].to_list(), lp["log_prob"].to_list())],
        x_title="token (decode order)",
        y_title="log-prob of the sampled token (nats)",
        label="log-prob over the sequence",
        join=True,
    )
    return _panel("logprob", title, chart, f"request {visible_short(d.request)}")


def _steps(d: ReportData) -> str:
    title = "Step latency"
    if d.steps is None:
        return _panel("steps", title, _missing(d.notes.get("steps", "not captured")))
    st = d.steps
    series = []
    for phase in sorted(set(st.phase)):
        idx = [k for k, p in enumerate(st.phase) if p == phase]
        series.append((phase, [float(st.x[k]) for k in idx], [st.ms[k] for k in idx]))
    chart = svg.scatter(series, x_title="step id", y_title="step duration (ms)", label="step latency")
    note = f"{st.total} steps" + (
        f"; binned by {st.binned} (at most {STEP_POINTS} points), each point the slowest of its bin"
        if st.binned > 1
        else ""
    )
    return _panel("steps", title, chart, note)


def _cpu(d: ReportData) -> str:
    """The CPU sampler's flame graphs: the whole recording, then each phase and the page's request
    folded away (<details>: no script)."""
    title = "Where the CPU went (sampled)"
    c = d.cpu
    if c is None:
        return _panel("cpu", title, _missing(d.notes.get("cpu", "not captured")))
    parts = [flame_svg(c.everything, "flame graph of every sample")]
    folded_away = [
        (f"{phase} steps" if phase != "between steps" else phase, pairs)
        for phase, pairs in c.by_phase.items()
    ]
    if d.request is not None:
        folded_away.append((f"request {visible_short(d.request)}", c.request))
    for what, pairs in folded_away:
        n = sum(v for _, v in pairs)
        graph = flame_svg(pairs, f"flame graph: {what}") or _missing("no sample")
        parts.append(f"<details><summary>{esc(what)}: {n} samples</summary>{graph}</details>")
    top = [[esc(name), f"{100 * share:.1f}%"] for name, share in c.top]
    table = _table(["function", "share of samples"], top)
    parts.append(f"<details><summary>the functions the CPU was in</summary>{table}</details>")
    partial = [f for f in c.files if f.get("symbols") != "symtab"]
    named = "; ".join(f"{f['path']}: {f['symbols']}" for f in partial[:8])
    note = (
        f"{c.samples} samples at {c.rate_hz} Hz of CPU time per thread; hover a frame for its share. "
        "Python frames are not named (the interpreter's C functions show instead)"
        + (f"; files named from their dynamic symbols or less: {named}" if named else "")
    )
    return _panel("cpu", title, "".join(parts), note)


def _anomalies(d: ReportData) -> str:
    title = "Anomalies"
    if d.anomalies.is_empty():
        return _panel("anomalies", title, "<p>no anomalies found</p>")
    rows = []
    for a in d.anomalies.iter_rows(named=True):
        end = a["decode_order_end"]
        where = (
            ""
            if a["decode_order"] is None
            else str(a["decode_order"]) + (f"-{end}" if end not in (None, a["decode_order"]) else "")
        )
        rows.append(
            [
                esc(a["kind"]),
                esc(num(a["score"]) if a["score"] is not None else ""),
                f"<code>{esc(a['request_id'])}</code>" if a["request_id"] is not None else "whole recording",
                esc(where),
                esc("" if a["layer"] is None else a["layer"]),
                esc("" if a["step_id"] is None else a["step_id"]),
                esc(a["reason"]),
            ]
        )
    note = f"{d.anomaly_total} found" + (
        f"; the {ANOMALY_CAP} highest scores are listed" if d.anomaly_total > ANOMALY_CAP else ""
    )
    table = _table(["kind", "score", "request", "decode order", "layer", "step", "reason"], rows)
    return _panel("anomalies", title, table, note)


def _per_layer(layers: list[int], values: list[Any] | None, fmt: Any) -> str:
    if values is None:
        return ""
    names = layers if len(layers) == len(values) else list(range(len(values)))
    return " · ".join(f"L{n} {fmt(v)}" for n, v in zip(names, values, strict=True))


def _experts(e: list[int] | None) -> str:
    return "-" if e is None else ",".join(str(x) for x in e)


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _token_table(d: ReportData) -> str:
    title = "Tokens and their decisions"
    if d.request is None:
        return _panel("tokens", title, _missing(d.notes["request"]))
    rows = []
    for t in d.tokens.iter_rows(named=True):
        text = (
            f"<code>{esc(t['token_text'])}</code>"
            if t["token_text"] is not None
            else '<span class="note">redacted</span>'
        )
        rows.append(
            [
                esc("" if t["decode_order"] is None else t["decode_order"]),
                esc("" if t["step_id"] is None else t["step_id"]),
                text,
                esc("redacted" if t["token_id"] is None else t["token_id"]),
                esc("" if t["log_prob"] is None else f"{t['log_prob']:.3f}"),
                esc(_per_layer(d.moe_layers, t["expert_ids"], _experts) or "not captured"),
                esc(_per_layer(d.ffn_layers, t["act_zero_ratio"], _ratio) or "not captured"),
                esc(_per_layer(d.ffn_layers, t["act_below_ratio"], _ratio) or "not captured"),
            ]
        )
    table = _table(
        ["decode order", "step", "token", "id", "log-prob", "experts per layer", "zero ratio", "below ratio"],
        rows,
    )
    cap = (
        f"the first {TOKEN_CAP} of the request's {d.request_tokens} tokens (the page keeps at most "
        f"{TOKEN_CAP}; choose another request with --request ID)"
        if d.request_tokens > TOKEN_CAP
        else f"all {d.request_tokens} tokens of the request (the page keeps at most {TOKEN_CAP})"
    )
    return _panel("tokens", title, table, f"request {visible_short(d.request)}: {cap}")


def render(d: ReportData, levels: list[str]) -> str:
    """The whole page as text (the caller encodes it as ASCII with character references)."""
    load, imbalance = _load(d)
    body = [
        f"<h1>sparseety-prof report: {esc(d.title)}</h1>",
        _header(d),
        load,
        imbalance,
        _routing(d, levels),
        _sparsity(d),
        _logprob(d),
        _steps(d),
        _cpu(d),
        _anomalies(d),
        _token_table(d),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>sparseety-prof report: {esc(d.title)}</title><style>{CSS}</style></head>"
        "<body>" + "\n".join(body) + "</body></html>\n"
    )
