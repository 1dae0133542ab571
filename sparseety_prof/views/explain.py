"""`report DIR --explain REQUEST[:DECODE_ORDER]`: everything a recording holds about one token,
gathered in one place (views/explain_print.py shows it on one screen, `--json` prints it).

Parts:
- the token: its text, log-prob, entropy and the alternatives the sampler's row ranked highest;
- its step: the forward pass that produced it, its duration and batch context, the wait for it;
- its decisions: per model layer, the experts and gate weights, the activation sparsity and the
  attention cells it attended;
- where its step's time went, from the timing tables (layer_times, thread_waits, cpu_stacks,
  op_times): the rows of its step, or of its step kind where the table is kept per kind. Each is
  read by its schema's column names; a table this version of the schema lacks, or one the
  recording was written without (an older recording), or one with no rows (its capture was off)
  is said so in words, never shown as an empty table.

Without DECODE_ORDER the request's slowest token is explained: the one its client waited for
longest (views/request_timing.py's gap), else the one whose step took longest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl

from sparseety_prof.errors import UsageError
from sparseety_prof.session.cpu_profile import step_kind
from sparseety_prof.store import schema
from sparseety_prof.store.recording import Recording, list_layers
from sparseety_prof.views.request_timing import token_context

JSON_FORMAT = "sparseety-prof explain"
JSON_VERSION = 1

#: the timing tables an explanation reads, in the order shown
TIME_TABLES = ("layer_times", "thread_waits", "cpu_stacks", "op_times")
#: what turns each table's capture on or off, for the sentence that says it was off
CAPTURE_HINTS: dict[str, str] = {
    "layer_times": "the sparse probes time one-row steps; --mode tokens and --no-layer-times have none",
    "thread_waits": "--no-sched-waits turns it off",
    "cpu_stacks": "--cpu-sample-hz 0 turns it off",
    "op_times": "record --trace-ops turns it on",
}
#: the column a timing table's rows are ranked by, where its first duration is not the one: a
#: thread's wait for a CPU, not its time on one
RANK_BY = {"thread_waits": "runnable_ns"}
#: rows of a timing table shown for one step (the largest first); --json gives them all
SHOWN_ROWS = 12


@dataclass(frozen=True)
class TokenRef:
    """Which token: a request id, and its decode order (None: the request's slowest token)."""

    request_id: str
    decode_order: int | None


def parse_token_ref(value: str, request_ids: set[str]) -> TokenRef:
    """REQUEST or REQUEST:DECODE_ORDER. A request id may itself hold ':' (any client's header):
    a value that is a recorded request id whole is that request; otherwise the text after the
    last ':' must be a decode order (a non-negative integer)."""
    if value in request_ids:
        return TokenRef(value, None)
    head, sep, tail = value.rpartition(":")
    if sep and tail.isascii() and tail.isdigit():
        return TokenRef(head, int(tail))
    return TokenRef(value, None)


def _clean(v: Any) -> Any:
    """JSON has no NaN or infinity: null, as for a value the recording does not hold."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


def _records(frame: pl.DataFrame) -> list[dict[str, Any]]:
    return [{k: _clean(v) for k, v in row.items()} for row in frame.iter_rows(named=True)]


def pick_token(rec: Recording, ref: TokenRef) -> dict[str, Any]:
    """The tokens row `ref` names, with its gap and step context (token_context's columns);
    UsageError naming what the recording holds when there is none."""
    tokens = rec.tokens()
    mine = tokens.filter(pl.col("request_id") == ref.request_id)
    if not mine.height:
        known = tokens["request_id"].unique(maintain_order=True).drop_nulls().to_list()
        shown = ", ".join(repr(r) for r in known[:10]) + (", ..." if len(known) > 10 else "")
        raise UsageError(
            f"--explain: no request {ref.request_id!r} in this recording's tokens"
            + (f" (requests: {shown})" if known else " (it holds no tokens)")
        )
    context = token_context(mine, rec.steps()).with_row_index("_row")
    full = mine.with_row_index("_row")
    if ref.decode_order is not None:
        hit = context.filter(pl.col("decode_order") == ref.decode_order)
        if not hit.height:
            orders: list[int] = mine["decode_order"].drop_nulls().to_list()
            span = f"{min(orders)} to {max(orders)}" if orders else "none (partial request)"
            raise UsageError(
                f"--explain: request {ref.request_id!r} has no token of decode order "
                f"{ref.decode_order} (its decode orders: {span})"
            )
    else:  # the slowest: the longest wait for it, else the longest step
        hit = context.sort(
            ["gap_ms", "step_ms", "_row"], descending=[True, True, False], nulls_last=True
        ).head(1)
    row = hit.row(0, named=True)
    token = full.filter(pl.col("_row") == row["_row"]).drop("_row").row(0, named=True)
    return {**token, "gap_ms": row["gap_ms"], "step_ms": row["step_ms"]}


def _alternatives(rec: Recording, token: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The sampler row's top entries (id, log-prob), with the text the recording holds for that id
    (only ids it sampled somewhere have a text)."""
    ids, lps = token.get("top_ids") or [], token.get("top_log_probs") or []
    texts = dict(
        rec.tokens()
        .select("token_id", "token_text")
        .drop_nulls()
        .unique("token_id", keep="first")
        .iter_rows()
    )
    return [
        {"token_id": i, "log_prob": _clean(lp), "token_text": texts.get(i)}
        for i, lp in zip(ids, lps, strict=False)
    ]


def decisions(meta: Mapping[str, Any], token: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per model layer, what the token's row decided there: the tokens table's per-layer lists
    placed on meta.json's layer lists (schema.TOKEN_LIST_LAYERS says which list is which kind)."""
    layers = list_layers(meta)
    out: dict[int, dict[str, Any]] = {}
    for column, kind in schema.TOKEN_LIST_LAYERS.items():
        values = token.get(column)
        if values is None:
            continue
        for layer, v in zip(layers.get(kind, []), values, strict=False):
            out.setdefault(layer, {"layer": layer})[column] = _clean(v)
    return [out[k] for k in sorted(out)]


def _step_row(rec: Recording, step_id: int | None) -> dict[str, Any] | None:
    if step_id is None:
        return None
    steps = rec.steps().filter(pl.col("step_id") == step_id)
    return {k: _clean(v) for k, v in steps.row(0, named=True).items()} if steps.height else None


def table_state(rec: Recording, name: str) -> tuple[str, str]:
    """(state, sentence) of a timing table in this recording: "unknown" (this version's schema
    has no such table), "absent" (the recording was written without it), "empty" (no rows: its
    capture was off), or "rows"."""
    if name not in schema.TABLES:
        return "unknown", f"{name}: this version of sparseety-prof has no {name} table"
    listed = rec.meta.get("tables")
    if not isinstance(listed, dict) or name not in listed:
        return "absent", (
            f"{name}: not in this recording (it was written by a version of sparseety-prof "
            f"without the {name} table)"
        )
    if not rec.table(name).height:
        hint = f": {CAPTURE_HINTS[name]}" if name in CAPTURE_HINTS else ""
        return (
            "empty",
            f"{name}: no rows in this recording (its capture was off{hint}; or it captured nothing)",
        )
    return "rows", ""


def _duration_column(name: str, columns: Mapping[str, pl.DataType]) -> str | None:
    """The column the rows are ranked by: the table's own (RANK_BY), else a duration or a count,
    by its schema name."""
    if RANK_BY.get(name) in columns:
        return RANK_BY[name]
    for suffix in ("dur_ns", "_ns", "samples", "count"):
        for name, dtype in columns.items():
            if name.endswith(suffix) and dtype.is_numeric() and not name.startswith("t_"):
                return name
    return None


def _rows_for(rec: Recording, name: str, step: Mapping[str, Any] | None) -> tuple[pl.DataFrame, str]:
    """The table's rows for the token's step (by step_id), with the sentence said when none."""
    df = rec.table(name)
    if "step_id" not in schema.TABLES[name]:
        return df, ""
    if step is None:
        return df.clear(), f"{name}: the token's step is not in this recording"
    got = df.filter(pl.col("step_id") == step["step_id"])
    if not got.height:
        return got, f"{name}: no rows for step {step['step_id']} (its capture was not on then)"
    return got, ""


def timing_section(rec: Recording, name: str, step: Mapping[str, Any] | None) -> dict[str, Any]:
    """One timing table's part of the explanation: its state, a sentence when there is nothing
    to show, the columns shown and its rows (ranked by their duration or count, largest first)."""
    state, note = table_state(rec, name)
    out: dict[str, Any] = {"table": name, "state": state, "note": note, "rows": []}
    if state != "rows":
        return out
    if name == "cpu_stacks":
        return {**out, **hottest_functions(rec, step)}
    rows, note = _rows_for(rec, name, step)
    if name == "layer_times" and rows.height:
        out["by_layer"] = _records(layer_grid(rows))
    by = _duration_column(name, schema.TABLES[name])
    if by is not None and rows.height:
        rows = rows.sort(by, descending=True, nulls_last=True)
    out["note"] = note
    out["rank_by"] = by
    out["columns"] = [c for c in schema.TABLES[name] if c not in ("step_id", "pid")]
    out["rows"] = _records(rows)
    if name == "op_times" and rows.height:
        out["by_op"] = _records(op_summary(rows))
    return out


def op_summary(rows: pl.DataFrame) -> pl.DataFrame:
    """op_times rows of one step per operator: its nodes, their time summed over the threads,
    and the longest one's on a thread (ms), the largest total first."""
    return (
        rows.group_by("op")
        .agg(
            pl.col("node").n_unique().alias("nodes"),
            (pl.col("dur_ns").sum() / 1e6).alias("total ms"),
            (pl.col("dur_ns").max() / 1e6).alias("longest ms"),
        )
        .sort(["total ms", "op"], descending=[True, False])
    )


def _thread_ms(dur: pl.Expr) -> pl.Expr:
    """A thread's time at a layer in ms; null where it has none (its first probe point)."""
    return pl.when(dur.is_not_null().any()).then(dur.sum() / 1e6)


def layer_grid(rows: pl.DataFrame) -> pl.DataFrame:
    """layer_times rows of one step as a grid: one row per layer, one column per graph thread
    ("thread N ms": the time since the thread's previous probe point, null where it has none),
    and the latest any thread came to the layer ("lag ms")."""
    threads = sorted(t for t in rows["thread"].unique().to_list() if t is not None)
    return (
        rows.group_by("layer")
        .agg(
            *[
                _thread_ms(pl.col("dur_ns").filter(pl.col("thread") == t)).alias(f"thread {t} ms")
                for t in threads
            ],
            (pl.col("lag_ns").max() / 1e6).alias("lag ms"),
        )
        .sort("layer", nulls_last=True)
    )


def hottest_functions(rec: Recording, step: Mapping[str, Any] | None) -> dict[str, Any]:
    """Where the CPU went in steps of the token's step kind (prompt, decode or mixed: the sampler's
    step_kind): the sampled functions (the innermost frame of each folded stack) by their samples
    over all such steps of the recording, and how many samples fell in the token's own step."""
    if step is None:
        return {"note": "cpu_stacks: the token's step is not in this recording"}
    kind = step_kind(step.get("prompt_rows"), step.get("decode_rows"))
    rows = rec.table("cpu_stacks").filter(pl.col("step_kind") == kind)
    total = int(rows["samples"].sum())
    own = int(rows.filter(pl.col("step_id") == step["step_id"])["samples"].sum())
    top = (
        rows.group_by(pl.col("stack").str.split(";").list.last().alias("function"))
        .agg(pl.col("samples").sum())
        .with_columns((pl.col("samples") / total).alias("share"))
        .sort(["samples", "function"], descending=[True, False])
    )
    note = "" if total else f"cpu_stacks: no samples in {kind} steps"
    return {
        "note": note,
        "step_kind": kind,
        "kind_samples": total,
        "step_samples": own,
        "rank_by": "samples",
        "columns": ["function", "samples", "share"],
        "rows": _records(top),
    }


def explain(rec: Recording, ref: TokenRef) -> dict[str, Any]:
    """The explanation of one token, as plain values (JSON-ready: NaN is null)."""
    token = pick_token(rec, ref)
    step = _step_row(rec, token.get("step_id"))
    shown = {
        k: _clean(token.get(k))
        for k in (
            "request_id",
            "decode_order",
            "phase",
            "pos",
            "token_id",
            "token_text",
            "log_prob",
            "entropy",
            "step_id",
            "tid",
            "partial",
        )
    }
    shown["gap_ms"] = _clean(token["gap_ms"])
    shown["step_ms"] = _clean(token["step_ms"])
    return {
        "format": JSON_FORMAT,
        "version": JSON_VERSION,
        "recording": str(rec.path),
        "chosen": "asked" if ref.decode_order is not None else "slowest",
        "token": shown,
        "alternatives": _alternatives(rec, token),
        "step": step,
        "decisions": decisions(rec.meta, token),
        "timing": {name: timing_section(rec, name, step) for name in TIME_TABLES},
    }
