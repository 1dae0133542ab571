"""`report DIR --explain ...` in the terminal: views/explain.py's explanation of one token on one
screen. Every string from the recording (request ids, token text, function and node names) is
shown through terminal_text (print_fitted does it for table cells)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console

from sparseety_prof.terminal_text import text
from sparseety_prof.views.explain import SHOWN_ROWS
from sparseety_prof.views.fitted_table import print_fitted

_TOKEN_LEGEND = "lp: log-prob (nats) of the raw logits row; gap: wait since the request's previous token"
_DECISION_HEADERS = ["layer", "experts", "weights", "act zero", "act below", "attended"]
_DECISION_LEGEND = (
    "experts, weights: the MoE layer's selected experts and gate weights as applied; act zero, act "
    "below: share of the FFN activations exactly zero / under the recording's act_threshold; "
    "attended: attention cells the token's row attended"
)


def _cell(v: object, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    if isinstance(v, list):
        return "[" + ", ".join(_cell(x, 2) for x in v) + "]"
    return str(v)


def _token_label(token_text: object, token_id: object) -> str:
    return repr(token_text) if token_text is not None else f"#{token_id}"


def _print_token(con: Console, e: Mapping[str, Any]) -> None:
    t = e["token"]
    which = "asked for" if e["chosen"] == "asked" else "the request's slowest"
    con.print(
        text(
            f"request {t['request_id']} token {_cell(t['decode_order'])} ({which}): "
            f"{_token_label(t['token_text'], t['token_id'])} id {_cell(t['token_id'])}, "
            f"{_cell(t['phase'])}, pos {_cell(t['pos'])}"
        ),
        style="bold",
    )
    con.print(
        text(
            f"lp {_cell(t['log_prob'])}  entropy {_cell(t['entropy'])}  gap {_cell(t['gap_ms'], 2)} ms  "
            f"step {_cell(t['step_id'])} {_cell(t['step_ms'], 2)} ms"
        )
    )
    alts = e["alternatives"]
    if alts:
        cells = ", ".join(
            f"{_token_label(a['token_text'], a['token_id'])} {_cell(a['log_prob'], 2)}" for a in alts
        )
        con.print(text(f"alternatives: {cells}"))
    step = e["step"]
    if step is not None:
        seqs = step.get("seq_ids") or []
        con.print(
            text(
                f"step: {_cell(step.get('n_tokens'))} rows ({_cell(step.get('prompt_rows'))} prompt, "
                f"{_cell(step.get('decode_rows'))} decode), {len(seqs)} sequences, thread "
                f"{_cell(step.get('tid'))}"
            )
        )
    else:
        con.print(text("step: not in this recording"))
    con.print(_TOKEN_LEGEND, style="dim", markup=False, highlight=False)


def _print_decisions(con: Console, rows: Sequence[Mapping[str, Any]]) -> None:
    if not rows:
        con.print(text("decisions: none recorded for this token (sparse capture off, or redacted)"))
        return
    cells = [
        [
            _cell(r["layer"]),
            _cell(r.get("expert_ids")),
            _cell(r.get("expert_weights")),
            _cell(r.get("act_zero_ratio")),
            _cell(r.get("act_below_ratio")),
            _cell(r.get("attn_attended")),
        ]
        for r in rows
    ]
    print_fitted(con, "decisions by layer", _DECISION_HEADERS, cells, legend=_DECISION_LEGEND)


def _header(column: str) -> str:
    """Times in ns are shown in ms: instants (t_...) from the step's start, durations as they are."""
    if not column.endswith("_ns"):
        return column
    return column.removesuffix("_ns") + (" +ms" if column.startswith("t_") else " ms")


def _ms_cell(column: str, v: object, step_start: int | None) -> str:
    if column.endswith("_ns") and isinstance(v, int):
        if column.startswith("t_"):
            return f"{(v - step_start) / 1e6:.3f}" if step_start is not None else str(v)
        return f"{v / 1e6:.3f}"
    return _cell(v)


def _print_timing(con: Console, name: str, section: Mapping[str, Any], step_start: int | None) -> None:
    if section["state"] != "rows" or not section["rows"]:
        con.print(text(section["note"] or f"{name}: nothing for this step"))
        return
    if name == "layer_times" and section.get("by_layer"):
        grid = section["by_layer"]
        headers = list(grid[0])
        print_fitted(
            con,
            "layer_times: the step by layer and thread",
            headers,
            [[_cell(r[h]) for h in headers] for r in grid],
        )
    if name == "op_times" and section.get("by_op"):
        summary = section["by_op"]
        headers = list(summary[0])
        cells = [[_cell(r[h]) for h in headers] for r in summary[:SHOWN_ROWS]]
        print_fitted(con, "op_times by operator", headers, cells)
    columns, rows = section["columns"], section["rows"]
    cells = [[_ms_cell(c, r.get(c), step_start) for c in columns] for r in rows[:SHOWN_ROWS]]
    more = f", the largest {SHOWN_ROWS} of {len(rows)}" if len(rows) > SHOWN_ROWS else ""
    title = f"{name} ({section.get('rank_by') or 'as recorded'}{more})"
    if name == "cpu_stacks":
        con.print(
            text(
                f"cpu_stacks: hottest functions of {section['step_kind']} steps ({section['kind_samples']} "
                f"samples, {section['step_samples']} in this step{more})"
            )
        )
        title = "cpu_stacks"
    print_fitted(con, title, [_header(c) for c in columns], cells)
    if section["note"]:
        con.print(text(section["note"]))


def print_explain(e: Mapping[str, Any], *, console: Console | None = None) -> None:
    """The explanation (views/explain.py `explain`) on the console."""
    con = console or Console()
    _print_token(con, e)
    _print_decisions(con, e["decisions"])
    step_start = (e["step"] or {}).get("t_start_ns")
    for name, section in e["timing"].items():
        _print_timing(con, name, section, step_start)
