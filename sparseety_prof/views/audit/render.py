"""The `audit` command's output: a terminal report (rich tables) or JSON.

``--json`` prints ``{"format": "sparseety-prof-audit", "version": 1, ...}`` with the AuditResult
fields (attack.py); per-layer scores are keyed by the layer as a string ("-1": a signal that is not
per layer); non-finite floats (no rows) become null."""

from __future__ import annotations

import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from sparseety_prof.terminal_text import json_dumps, text
from sparseety_prof.views.audit.attack import AuditResult, LevelScore, Score, audit
from sparseety_prof.views.audit.observations import ALL_LAYERS

JSON_FORMAT = "sparseety-prof-audit"
JSON_VERSION = 1


def result_json(result: AuditResult) -> dict[str, Any]:
    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    return {"format": JSON_FORMAT, "version": JSON_VERSION, **clean(asdict(result))}


def _pct(x: float) -> str:
    return "—" if not math.isfinite(x) else f"{100 * x:.1f}%"


def _cells(s: Score) -> list[str]:
    return [_pct(s.top1), _pct(s.top5), f"{s.bits:.2f}", f"{s.bits_shuffled:.2f}", str(s.rows)]


def _level_name(lv: LevelScore) -> str:
    if not lv.levels:
        return "none"
    layers = "" if lv.layers is None else " --redact-layers " + ",".join(str(x) for x in lv.layers)
    return "--redact " + ",".join(lv.levels) + layers


def _summary(r: AuditResult) -> Table:
    t = Table(title="sparseety-prof audit: token recovery", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("held out", text(r.heldout))
    t.add_row(
        "trained on", text(", ".join(r.train)) if r.train else text("the other runs (leave-one-run-out)")
    )
    t.add_row("model sha256", text(r.model_sha256 or "unknown"))
    t.add_row(
        "rows",
        f"{r.rows} rows, {r.distinct_tokens} distinct tokens, H(token) = {r.token_entropy_bits:.2f} bits; "
        f"{_pct(r.coverage)} of rows hold a token seen in training (the most a lookup can name)",
    )
    t.add_row(
        "chance", f"top-1 {_pct(r.chance.top1)}, top-5 {_pct(r.chance.top5)} (most frequent training tokens)"
    )
    return t


def _levels(r: AuditResult) -> Table:
    t = Table(
        title="after each redaction level: the best signal left", box=box.SIMPLE_HEAD, title_justify="left"
    )
    for name in ("redaction", "best signal", "top-1", "top-5", "bits", "shuffled", "rows"):
        t.add_column(name, justify="left" if name in ("redaction", "best signal") else "right")
    for lv in r.levels:
        t.add_row(_level_name(lv), lv.best_signal or "(none left)", *_cells(lv.best))
    return t


def _signals(lv: LevelScore) -> Table:
    t = Table(
        title=f"per signal ({_level_name(lv)}): all layers, then the leakiest layer",
        box=box.SIMPLE_HEAD,
        title_justify="left",
    )
    for name in ("signal", "top-1", "top-5", "bits", "shuffled", "rows", "leakiest layer", "its top-1"):
        t.add_column(name, justify="left" if name == "signal" else "right")
    for s in lv.signals:
        top = max(((k, v) for k, v in s.layers.items() if v.rows), key=lambda kv: kv[1].top1, default=None)
        layer = "" if top is None or top[0] == ALL_LAYERS else str(top[0])
        t.add_row(s.signal, *_cells(s.all_layers), layer, _pct(top[1].top1) if top else "")
    return t


def _layers(r: AuditResult) -> Table:
    t = Table(title="layers that leak most (nothing redacted)", box=box.SIMPLE_HEAD, title_justify="left")
    for name in ("signal", "layer", "top-1"):
        t.add_column(name, justify="right" if name != "signal" else "left")
    for signal, layer, top1 in r.leakiest_layers:
        t.add_row(signal, str(layer), _pct(top1))
    return t


def render(r: AuditResult, console: Console) -> None:
    console.print(_summary(r))
    console.print(_levels(r))
    for lv in r.levels:
        if not lv.levels or (len(lv.levels) > 1 and lv.layers is None):
            console.print(_signals(lv))
    if r.leakiest_layers:
        console.print(_layers(r))
    console.print(
        "bits: I(token; top-1 guess), plug-in with the Miller-Madow correction: a lower bound on what "
        "the signal carries, biased upward when there are few rows per token; shuffled: the same "
        "estimate with the guesses shuffled (its bias on these rows). Only bits above shuffled are "
        "information.",
        style="dim",
        markup=False,
    )
    for note in r.notes:
        console.print(text(f"note: {note}", style="dim"))


def run(heldout: Path, train: list[Path], *, as_json: bool = False, console: Console | None = None) -> int:
    result = audit(heldout, train)
    if as_json:
        out = console.file if console is not None else sys.stdout
        print(json_dumps(result_json(result), indent=2), file=out)
        return 0
    render(result, console or Console(highlight=False))
    return 0
