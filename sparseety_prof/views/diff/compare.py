"""`compare`: two tokens tables (+ meta) in, a `DiffResult` out; a pure function.

Pair the requests, align their tokens, take the per-column differences, reduce them per pair and
over the run, and find each pair's first difference and the tokens around it. The runs are
*equal* when every pair matches within tolerance and no request is unpaired. Most pairs differing
at their very first token is noted: the sign of a wrong pairing, or of different prompts."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import polars as pl

from sparseety_prof.views.diff.alignment import TOKENS_DIFFER, align
from sparseety_prof.views.diff.columns import not_comparable
from sparseety_prof.views.diff.deltas import Deltas, deltas
from sparseety_prof.views.diff.first_difference import first_difference
from sparseety_prof.views.diff.pairing import Pairing, pair_requests
from sparseety_prof.views.diff.result import (
    EMPTY_ATTN,
    EMPTY_LOG_PROB,
    EMPTY_RATIO,
    EMPTY_ROUTING,
    ContextRow,
    DiffResult,
    PairResult,
    TokenRef,
    Tolerances,
    Where,
)
from sparseety_prof.views.diff.stats import ALL, Rows, Stats, aggregate, as_float, statistics

_SHOWN = ["pair", "decode_order", "token_id", "token_text", "log_prob"]


def _token_ref(row: Mapping[str, Any] | None) -> TokenRef | None:
    if row is None:
        return None
    return TokenRef(token_id=row["token_id"], text=row["token_text"], log_prob=as_float(row["log_prob"]))


def _gaps(lacking: pl.DataFrame, order: pl.DataFrame) -> Rows:
    """Per pair: the positions one side lacks (`lacking`) inside that side's own range (`order`)."""
    within = lacking.join(order.select("pair", "last"), on="pair").filter(
        pl.col("decode_order") <= pl.col("last")
    )
    return aggregate(within, "pair", n=pl.len())


def _context(
    rows_a: pl.DataFrame, rows_b: pl.DataFrame, pair: int, at: int, context: int
) -> list[ContextRow]:
    """The tokens of both runs within `context` positions of `at`."""
    lo, hi = max(0, at - context), at + context
    near = (pl.col("pair") == pair) & pl.col("decode_order").is_between(lo, hi)
    by_a = {r["decode_order"]: r for r in rows_a.filter(near).iter_rows(named=True)}
    by_b = {r["decode_order"]: r for r in rows_b.filter(near).iter_rows(named=True)}
    return [
        ContextRow(decode_order=o, a=_token_ref(by_a.get(o)), b=_token_ref(by_b.get(o)))
        for o in sorted(by_a.keys() | by_b.keys())
    ]


def _pair_results(
    p: Pairing, win: pl.DataFrame, d: Deltas, by_pair: Stats, tol: Tolerances, context: int
) -> list[PairResult]:
    a, b = p.rows_a, p.rows_b
    keys = ["pair", "decode_order"]
    only_b = b.select(keys).join(a.select(keys), on=keys, how="anti")
    only_a = a.select(keys).join(b.select(keys), on=keys, how="anti")
    last_a = dict(p.a.order.select("pair", "last").iter_rows())
    last_b = dict(p.b.order.select("pair", "last").iter_rows())
    gaps_a, gaps_b = _gaps(only_b, p.a.order), _gaps(only_a, p.b.order)
    compared = aggregate(win, "pair", n=pl.len(), mismatches=TOKENS_DIFFER.sum())
    div_cols = ["token_id", "token_text", "log_prob", "token_id_b", "token_text_b", "log_prob_b"]
    at_div = {
        int(r["pair"]): r
        for r in win.filter(pl.col("decode_order") == pl.col("div"))
        .select("pair", "decode_order", *div_cols)
        .iter_rows(named=True)
    }
    rows_a, rows_b = a.select(_SHOWN), b.select(_SHOWN)

    pairs: list[PairResult] = []
    order_a = p.a.order.filter(pl.col("pair") < p.pairs).iter_rows(named=True)
    order_b = p.b.order.filter(pl.col("pair") < p.pairs).iter_rows(named=True)
    for ra, rb in zip(order_a, order_b, strict=True):
        i = int(ra["pair"])
        la, lb = last_a.get(i), last_b.get(i)
        la, lb = -1 if la is None else int(la), -1 if lb is None else int(lb)
        dr = at_div.get(i)
        div = int(dr["decode_order"]) if dr else None
        token_a = token_b = None
        if dr is not None:
            token_a = TokenRef(dr["token_id"], dr["token_text"], as_float(dr["log_prob"]))
            token_b = TokenRef(dr["token_id_b"], dr["token_text_b"], as_float(dr["log_prob_b"]))
        length_difference = ("A" if la > lb else "B") if div is None and la != lb else None
        lp_stats = by_pair.log_prob.get(i, EMPTY_LOG_PROB)
        rt_stats = by_pair.routing.get(i, EMPTY_ROUTING) if d.routing is not None else None
        z_stats = by_pair.act_zero_ratio.get(i, EMPTY_RATIO) if d.ratios is not None else None
        at_stats = by_pair.attn.get(i, EMPTY_ATTN) if d.attn is not None else None
        first_diff = first_difference(
            Where(i, div) if div is not None else None,
            token_a,
            token_b,
            Where(i, min(la, lb) + 1) if length_difference else None,
            length_difference,
            lp_stats,
            rt_stats,
            z_stats,
            at_stats,
            tol,
        )
        context_at = div if div is not None else (first_diff.decode_order if first_diff else None)
        ctx = _context(rows_a, rows_b, i, context_at, context) if context_at is not None else []
        c = compared.get(i, {"n": 0, "mismatches": 0})
        pairs.append(
            PairResult(
                pair=i,
                request_a=str(ra["request_id"]),
                request_b=str(rb["request_id"]),
                tokens_a=int(ra["tokens"] or 0),
                tokens_b=int(rb["tokens"] or 0),
                compared=int(c["n"]),
                divergence=div,
                token_a=token_a,
                token_b=token_b,
                token_mismatches=int(c["mismatches"]),
                length_difference=length_difference,
                gaps_a=int(gaps_a.get(i, {"n": 0})["n"]),
                gaps_b=int(gaps_b.get(i, {"n": 0})["n"]),
                log_prob=lp_stats,
                routing=rt_stats,
                act_zero_ratio=z_stats,
                attn=at_stats,
                first_difference=first_diff,
                context_at=context_at,
                context=ctx,
                equal=first_diff is None,
            )
        )
    return pairs


def _pair_notes(pairs: list[PairResult]) -> list[str]:
    notes = []
    gaps = sum(p.gaps_a + p.gaps_b for p in pairs)
    if gaps:
        notes.append(f"{gaps} token position(s) recorded in one run only (lost rows?): not compared")
    at_zero = [p.pair for p in pairs if p.divergence == 0]
    if len(pairs) > 1 and len(at_zero) * 2 > len(pairs):
        notes.append(
            f"{len(at_zero)} of {len(pairs)} pairs differ at their first token: if both runs used the same "
            "prompts, the pairing by first-token time may be wrong (or the prompts differ)"
        )
    if not pairs:
        notes.append("no complete request to compare")
    return notes


def compare(
    tokens_a: pl.DataFrame,
    tokens_b: pl.DataFrame,
    *,
    meta_a: Mapping[str, Any] | None = None,
    meta_b: Mapping[str, Any] | None = None,
    tolerances: Tolerances | None = None,
    all_positions: bool = False,
    context: int = 3,
) -> DiffResult:
    """Compare two tokens tables (schema.TOKENS) of runs of the same prompts; `context`: tokens
    shown either side of each pair's first difference. See the package doc."""
    tol = tolerances or Tolerances()
    notes: list[str] = []
    p = pair_requests(tokens_a, tokens_b, meta_a, meta_b, notes)
    skipped = not_comparable(p.rows_a, p.rows_b)
    win = align(p.rows_a, p.rows_b, all_positions)
    d = deltas(win, p.rows_a, p.rows_b, meta_a, meta_b, skipped, notes)
    pairs = _pair_results(p, win, d, statistics(d, tol, "pair"), tol, context)
    notes += _pair_notes(pairs)
    overall = statistics(d, tol, ALL)

    first_div = next((Where(q.pair, q.divergence) for q in pairs if q.divergence is not None), None)
    different = sum(1 for q in pairs if not q.equal)
    return DiffResult(
        equal=different == 0 and not p.unpaired_a and not p.unpaired_b,
        tolerances=tol,
        all_positions=all_positions,
        a=p.a.summary,
        b=p.b.summary,
        pairs=pairs,
        unpaired_a=p.unpaired_a,
        unpaired_b=p.unpaired_b,
        tokens_compared=win.height,
        pairs_diverged=sum(1 for q in pairs if q.divergence is not None),
        pairs_different=different,
        first_divergence=first_div,
        log_prob=overall.log_prob.get(0, EMPTY_LOG_PROB),
        routing=overall.routing.get(0, EMPTY_ROUTING) if d.routing is not None else None,
        act_zero_ratio=overall.act_zero_ratio.get(0, EMPTY_RATIO) if d.ratios is not None else None,
        attn=overall.attn.get(0, EMPTY_ATTN) if d.attn is not None else None,
        not_comparable=skipped,
        notes=notes,
    )


def diff_recordings(
    path_a: str | Path,
    path_b: str | Path,
    *,
    tolerances: Tolerances | None = None,
    all_positions: bool = False,
    context: int = 3,
) -> DiffResult:
    """Open two recordings (UsageError / CorruptRecording as `recording.open`) and `compare` them."""
    from sparseety_prof.store.recording import open as open_recording

    ra, rb = open_recording(path_a), open_recording(path_b)
    return compare(
        ra.tokens(),
        rb.tokens(),
        meta_a=ra.meta,
        meta_b=rb.meta,
        tolerances=tolerances,
        all_positions=all_positions,
        context=context,
    )
