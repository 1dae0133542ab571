"""`diff A B`: compare two recordings of the same prompts, request by request and token by token.

Run the same prompts twice (a dense and a sparse configuration, two engine builds, with and
without a change), record both, and ``sparseety-prof diff A B`` says whether the runs agree and,
where they do not, where they first diverge and how: token id, log-prob, MoE routing, activation
sparsity, attention.

Pairing
    Request ids are generated per run, so requests are paired by order of their first token
    (``t_end_ns``) within each recording: the first request of A with the first of B, and so on.
    Requests already running when the recording began (``partial``; their ``decode_order`` is
    null) are left out of both sides and counted. Different request counts are reported (the
    extra requests are listed as unpaired, and pairs after a missing request may be shifted), and
    so are pairs whose very first tokens differ, the sign of a wrong pairing or different prompts.
    Within a pair, tokens are aligned by ``decode_order`` (0 = first generated token).

Divergence
    The divergence point of a pair is the first ``decode_order`` where the token ids differ.
    Every later token is conditioned on a different history, so by default nothing after it is
    compared (``all_positions``/``--all`` keeps comparing aligned positions, for what that is
    worth). The routing, activation and attention columns of a token row describe the forward
    pass that produced its logits, whose input is the previous token: at the divergence point that
    input is still shared, so they are compared there too (they are often the cause). Log-probs
    are compared only where both runs sampled the same token.

Per pair (and over all pairs) the result holds: tokens compared; the divergence point with the
surrounding tokens of both runs; the largest ``|Δ log_prob|`` and the positions beyond
``logprob`` tolerance; for MoE layers the agreement rate of the selected experts (identical
lists, and identical as sets), the first token and layer whose expert set differs with both
lists, and gate weights of the experts both runs selected against ``weight`` tolerance; per FFN
layer the mean and largest ``|Δ act_zero_ratio|`` against ``ratio`` tolerance; attended cells per
attention layer. Layers are named by model layer when the recordings' meta has ``"layers"``.

A column that one recording did not capture (all null, or empty lists, e.g. expert ids of a
dense model) is "not comparable", never a difference. The runs are *equal* when every pair
matches within tolerance and no request is unpaired; the reorder of an expert list with the
same set and weights is reported but does not count as a difference.

`compare` is a pure function over two tokens frames (+ meta) returning a `DiffResult`;
`render` and `result_json` present it; `run` is the command. ``--json`` prints `result_json`:
the `DiffResult` fields as nested objects (``"format": "sparseety-prof-diff"``, ``"version": 1``,
``equal``, ``a``/``b`` summaries, ``pairs`` with each pair's statistics and context, overall
``log_prob``/``routing``/``act_zero_ratio``/``attn``, ``not_comparable``, ``notes``); a position
is ``{"pair", "decode_order", "layer": {"index", "layer"} | null}``, and a statistic of a column
that is not comparable is null. "Where the largest difference is" is null when it is 0.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from sparseety_prof.errors import CorruptRecording
from sparseety_prof.store import schema

__all__ = [
    "DiffResult",
    "PairResult",
    "Tolerances",
    "compare",
    "diff_recordings",
    "render",
    "result_json",
    "run",
]

JSON_FORMAT = "sparseety-prof-diff"
JSON_VERSION = 1

#: Layer kinds of the per-layer list columns, as named in meta.json's "layers".
MOE, FFN, ATTN = "moe", "ffn", "attn"
_KIND_NAMES = {MOE: "MoE layer", FFN: "FFN layer", ATTN: "attention layer"}

_REQUIRED = ("request_id", "decode_order", "token_id", "t_end_ns")
#: Compared columns: name -> (layer kind or None, nesting depth of the per-token value).
_COMPARED: dict[str, tuple[str | None, int]] = {
    "log_prob": (None, 0),
    "expert_ids": (MOE, 2),
    "expert_weights": (MOE, 2),
    "act_zero_ratio": (FFN, 1),
    "attn_attended": (ATTN, 1),
}
for _c in (*_REQUIRED, *_COMPARED, "seq_id", "partial", "token_text"):
    if _c not in schema.TOKENS:  # pragma: no cover - guards against a schema rename
        raise ImportError(f"diff: column {_c!r} is not in schema.TOKENS")

#: First-difference kinds, in the order they win at the same decode_order (causes before effects).
KINDS = ("attn", "routing", "weights", "act_zero_ratio", "log_prob", "token", "length")


# ------------------------------------------------------------------ result types
@dataclass(frozen=True)
class Tolerances:
    logprob: float = 1e-3  # |Δ log_prob| above this is a difference
    weight: float = 1e-5  # |Δ gate weight| of an expert both runs selected
    ratio: float = 0.0  # |Δ act_zero_ratio| of a layer


@dataclass(frozen=True)
class LayerRef:
    index: int  # position in the per-layer list (A's, when layers are matched by model layer)
    layer: int | None  # model layer (block) index, when the recording's meta names it

    def label(self, kind: str) -> str:
        name = _KIND_NAMES.get(kind, kind)
        return f"{name} {self.layer}" if self.layer is not None else f"{name} #{self.index}"


@dataclass(frozen=True)
class Where:
    pair: int  # index of the request pair (0 = earliest first token)
    decode_order: int
    layer: LayerRef | None = None


@dataclass(frozen=True)
class TokenRef:
    token_id: int | None
    text: str | None  # null when the recording was made with --redact-text
    log_prob: float | None


@dataclass(frozen=True)
class ContextRow:
    decode_order: int
    a: TokenRef | None  # None: no such token in that run (ended, or the row was lost)
    b: TokenRef | None


@dataclass(frozen=True)
class SideSummary:
    requests: int  # complete requests (partial ones excluded)
    tokens: int  # their token rows
    partial_requests: int  # requests already running when the recording began: excluded
    partial_rows: int
    duplicate_rows: int  # second rows for the same (request, decode_order): ignored
    complete: bool | None  # the recording was closed (None: unknown)


@dataclass(frozen=True)
class LogProbStats:
    compared: int  # positions where both runs sampled the same token and both log-probs exist
    max_abs_delta: float | None
    max_at: Where | None
    beyond_tol: int
    first_beyond: Where | None
    first_beyond_delta: float | None


@dataclass(frozen=True)
class RoutingDifference:
    where: Where
    experts_a: list[int]
    experts_b: list[int]


@dataclass(frozen=True)
class RoutingStats:
    compared: int  # (token, MoE layer) pairs with expert ids on both sides
    identical: int  # same experts in the same order
    same_set: int  # same experts, any order
    agreement: float | None  # identical / compared
    set_agreement: float | None  # same_set / compared
    first_difference: RoutingDifference | None  # first (token, layer) whose expert *set* differs
    first_reorder: Where | None  # first (token, layer) with the same set in another order
    weights_compared: int  # (token, layer, expert) selected by both runs, with weights on both sides
    max_weight_delta: float | None
    max_weight_at: Where | None
    weights_beyond_tol: int
    first_weight_beyond: Where | None


@dataclass(frozen=True)
class LayerRatio:
    layer: LayerRef
    compared: int
    mean_abs_delta: float
    max_abs_delta: float
    beyond_tol: int


@dataclass(frozen=True)
class RatioStats:
    compared: int  # (token, FFN layer) pairs
    mean_abs_delta: float | None
    max_abs_delta: float | None
    max_at: Where | None
    beyond_tol: int
    first_beyond: Where | None
    layers: list[LayerRatio]  # in layer order


@dataclass(frozen=True)
class AttnDifference:
    where: Where
    attended_a: int
    attended_b: int


@dataclass(frozen=True)
class AttnStats:
    compared: int  # (token, attention layer) pairs
    differing: int
    max_abs_delta: int | None
    first_difference: AttnDifference | None


@dataclass(frozen=True)
class FirstDifference:
    decode_order: int
    kind: str  # one of KINDS
    detail: str


@dataclass(frozen=True)
class PairResult:
    pair: int
    request_a: str
    request_b: str
    tokens_a: int
    tokens_b: int
    compared: int  # aligned positions compared (up to and including the divergence by default)
    divergence: int | None  # first decode_order whose token ids differ
    token_a: TokenRef | None  # the two tokens at the divergence
    token_b: TokenRef | None
    token_mismatches: int  # compared positions whose token ids differ (> 1 only with --all)
    length_difference: str | None  # "A"/"B": that run goes on after the other ended, same tokens
    gaps_a: int  # positions B has and A lacks inside A's range (lost rows), not compared
    gaps_b: int
    log_prob: LogProbStats
    routing: RoutingStats | None  # None: not comparable
    act_zero_ratio: RatioStats | None
    attn: AttnStats | None
    first_difference: FirstDifference | None
    context_at: int | None  # decode_order the context is centred on
    context: list[ContextRow]
    equal: bool


@dataclass(frozen=True)
class DiffResult:
    equal: bool
    tolerances: Tolerances
    all_positions: bool
    a: SideSummary
    b: SideSummary
    pairs: list[PairResult]
    unpaired_a: list[str]  # request ids of A with no counterpart in B (in first-token order)
    unpaired_b: list[str]
    tokens_compared: int
    pairs_diverged: int  # pairs whose token ids diverge
    pairs_different: int  # pairs with any difference
    first_divergence: Where | None  # first pair (in order) whose tokens diverge, and where
    log_prob: LogProbStats
    routing: RoutingStats | None
    act_zero_ratio: RatioStats | None
    attn: AttnStats | None
    not_comparable: dict[str, str]  # column -> why
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ preparation
@dataclass(frozen=True)
class _Side:
    rows: pl.DataFrame  # complete requests, one row per (pair, decode_order), with a "pair" column
    order: pl.DataFrame  # request_id, pair, tokens, last (max decode_order)
    summary: SideSummary


def _with_schema_columns(df: pl.DataFrame, side: str) -> pl.DataFrame:
    missing = [c for c in _REQUIRED if c not in df.columns]
    if missing:
        raise CorruptRecording(f"the tokens table of {side} lacks the columns {missing}")
    absent = [c for c in schema.TOKENS if c not in df.columns]
    return df.with_columns(pl.lit(None, dtype=schema.TOKENS[c]).alias(c) for c in absent)


def _prepare(df: pl.DataFrame, side: str, complete: bool | None) -> _Side:
    df = _with_schema_columns(df, side)
    partial_row = pl.col("partial").fill_null(False) | pl.col("decode_order").is_null()
    partial_ids = df.filter(partial_row)["request_id"].unique()
    is_partial = pl.col("request_id").is_in(partial_ids.implode()) | pl.col("request_id").is_null()
    partial = df.filter(is_partial)
    kept = df.filter(~is_partial)
    order = (
        kept.group_by("request_id")
        .agg(pl.col("t_end_ns").min().alias("_first"), pl.col("seq_id").min().alias("_seq"))
        .sort(["_first", "_seq", "request_id"], nulls_last=True)
        .with_row_index("pair")
        .with_columns(pl.col("pair").cast(pl.Int64))
        .select("request_id", "pair")
    )
    rows = (
        kept.join(order, on="request_id", how="inner")
        .sort(["pair", "decode_order", "t_end_ns"], nulls_last=True)
        .unique(["pair", "decode_order"], keep="first", maintain_order=True)
    )
    counts = rows.group_by("pair").agg(
        pl.len().alias("tokens"), pl.col("decode_order").max().cast(pl.Int64).alias("last")
    )
    order = order.join(counts, on="pair", how="left").sort("pair")
    summary = SideSummary(
        requests=order.height,
        tokens=rows.height,
        partial_requests=partial.filter(pl.col("request_id").is_not_null())["request_id"].n_unique(),
        partial_rows=partial.height,
        duplicate_rows=kept.height - rows.height,
        complete=complete,
    )
    return _Side(rows=rows, order=order, summary=summary)


def _not_captured(df: pl.DataFrame, column: str, depth: int) -> str | None:
    """Why `column` holds nothing comparable in `df` (None when it does)."""
    s = df[column]
    if df.height == 0 or s.null_count() == s.len():
        return "not captured"
    if depth == 1 and not (s.list.len().fill_null(0).max() or 0):
        return "empty lists"
    if depth == 2:
        inner = s.list.eval(pl.element().list.len()).list.sum().fill_null(0).max()
        if not inner:
            return "empty lists (no MoE layers: a dense model?)"
    return None


def _max_layers(df: pl.DataFrame, column: str) -> int:
    if df.height == 0:
        return 0
    n = df[column].list.len().max()
    return int(n) if isinstance(n, int) else 0


def _meta_layers(
    meta: Mapping[str, Any] | None, kind: str, n: int, side: str, notes: list[str]
) -> list[int] | None:
    layers = meta.get("layers") if meta else None
    names = layers.get(kind) if isinstance(layers, Mapping) else None
    if names is None:
        return None
    if not isinstance(names, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in names):
        notes.append(f"{side}: meta layers.{kind} is not a list of layer numbers: layers named by position")
        return None
    if n and len(names) != n:
        notes.append(
            f"{side}: meta layers.{kind} names {len(names)} layers but the tokens hold {n}: "
            "layers named by position"
        )
        return None
    return names


@dataclass(frozen=True)
class _LayerMap:
    """Which list positions of A and B hold the same layer, slot by slot."""

    idx_a: list[int]
    idx_b: list[int]
    refs: list[LayerRef]  # the layer of each slot


def _layer_map(
    kind: str,
    column: str,
    a: pl.DataFrame,
    b: pl.DataFrame,
    meta_a: Mapping[str, Any] | None,
    meta_b: Mapping[str, Any] | None,
    notes: list[str],
) -> _LayerMap:
    n_a, n_b = _max_layers(a, column), _max_layers(b, column)
    names_a = _meta_layers(meta_a, kind, n_a, "A", notes)
    names_b = _meta_layers(meta_b, kind, n_b, "B", notes)
    label = _KIND_NAMES[kind] + "s"
    if names_a is not None and names_b is not None and names_a != names_b:
        in_b = set(names_b)
        common = [x for x in names_a if x in in_b]
        only_a = sorted(set(names_a) - in_b)
        only_b = sorted(in_b - set(names_a))
        if only_a or only_b:
            notes.append(
                f"{column}: the runs cover different {label} (only in A: {only_a or 'none'}, "
                f"only in B: {only_b or 'none'}): the common ones are compared by model layer"
            )
        idx_a = [names_a.index(x) for x in common]
        idx_b = [names_b.index(x) for x in common]
        return _LayerMap(
            idx_a, idx_b, [LayerRef(index=i, layer=x) for i, x in zip(idx_a, common, strict=True)]
        )
    if n_a != n_b and n_a and n_b:
        notes.append(
            f"{column}: A holds {n_a} {label} per token, B {n_b}: the first {min(n_a, n_b)} are compared"
        )
    m = min(n_a, n_b)
    names = names_a if names_a is not None else names_b
    refs = [
        LayerRef(index=j, layer=names[j] if names is not None and j < len(names) else None) for j in range(m)
    ]
    return _LayerMap(list(range(m)), list(range(m)), refs)


def _slots(win: pl.DataFrame, lmap: _LayerMap, columns: Sequence[str]) -> pl.DataFrame:
    """One row per (pair, decode_order, slot `_j`) of per-layer list columns of the aligned frame:
    A's value of each column under its name, B's under name + "_b", for the layers `lmap` pairs up.
    Token rows where a column is null on either side are left out, as are missing layers."""
    both = [pl.col(c).is_not_null() & pl.col(f"{c}_b").is_not_null() for c in columns]
    gathered = [
        e
        for c in columns
        for e in (
            pl.col(c).list.gather(lmap.idx_a, null_on_oob=True).alias(c),
            pl.col(f"{c}_b").list.gather(lmap.idx_b, null_on_oob=True).alias(f"{c}_b"),
        )
    ]
    first = columns[0]
    d = win.filter(*both).select("pair", "decode_order", *gathered)
    d = d.with_columns(pl.int_ranges(pl.col(first).list.len(), dtype=pl.Int64).alias("_j"))
    names = [n for c in columns for n in (c, f"{c}_b")]
    return d.explode(*names, "_j").filter(
        *[pl.col(n).is_not_null() for n in names], pl.col("_j").is_not_null()
    )


def _with_same_set(r: pl.DataFrame) -> pl.DataFrame:
    """Adds `identical` (same experts, same order) and `same_set` (same experts, any order)."""
    r = r.with_columns(pl.col("expert_ids").eq_missing(pl.col("expert_ids_b")).alias("identical"))
    r = r.with_row_index("_r")
    odd = r.filter(~pl.col("identical"))
    ea = odd.select("_r", pl.col("expert_ids").alias("_e")).explode("_e").drop_nulls()
    eb = odd.select("_r", pl.col("expert_ids_b").alias("_e")).explode("_e").drop_nulls()
    bad = pl.concat(
        [
            odd.filter(pl.col("expert_ids").list.len() != pl.col("expert_ids_b").list.len())["_r"],
            ea.join(eb, on=["_r", "_e"], how="anti")["_r"],
            eb.join(ea, on=["_r", "_e"], how="anti")["_r"],
        ]
    )
    same_set = pl.col("identical") | ~pl.col("_r").is_in(bad.implode())
    return r.with_columns(same_set.alias("same_set")).drop("_r")


def _weight_deltas(win: pl.DataFrame, lmap: _LayerMap) -> pl.DataFrame:
    """|Δ gate weight| per (pair, decode_order, slot, expert selected by both runs)."""
    w = _slots(win, lmap, ["expert_ids", "expert_weights"]).filter(
        (pl.col("expert_ids").list.len() == pl.col("expert_weights").list.len())
        & (pl.col("expert_ids_b").list.len() == pl.col("expert_weights_b").list.len())
    )
    keys = ["pair", "decode_order", "_j"]
    same = (
        w.filter(pl.col("expert_ids").eq_missing(pl.col("expert_ids_b")))
        .select(*keys, "expert_weights", "expert_weights_b")
        .explode("expert_weights", "expert_weights_b")
        .filter(pl.col("expert_weights").is_not_null() & pl.col("expert_weights_b").is_not_null())
        .select(*keys, _abs_delta("expert_weights", "expert_weights_b").alias("delta"))
    )
    odd = w.filter(~pl.col("expert_ids").eq_missing(pl.col("expert_ids_b"))).with_row_index("_r")
    if odd.height == 0:
        return same
    ea = odd.select("_r", *keys, pl.col("expert_ids").alias("_e"), pl.col("expert_weights").alias("_w"))
    eb = odd.select("_r", pl.col("expert_ids_b").alias("_e"), pl.col("expert_weights_b").alias("_w"))
    matched = (
        ea.explode("_e", "_w")
        .join(eb.explode("_e", "_w"), on=["_r", "_e"], how="inner", suffix="_b")
        .filter(pl.col("_e").is_not_null() & pl.col("_w").is_not_null() & pl.col("_w_b").is_not_null())
        .select(*keys, _abs_delta("_w", "_w_b").alias("delta"))
    )
    return pl.concat([same, matched]).sort(keys, maintain_order=True)


def _abs_delta(a: str, b: str) -> pl.Expr:
    """|a - b|, 0 for equal values (infinities and NaNs included), inf when only one is NaN."""
    x, y = pl.col(a).cast(pl.Float64), pl.col(b).cast(pl.Float64)
    return pl.when(x == y).then(0.0).otherwise((x - y).abs().fill_nan(math.inf))


# ------------------------------------------------------------------ statistics
# Each takes the long frame of one comparison, in (pair, decode_order, slot) order, and a grouping
# column: "pair" for per-pair statistics, _ALL (one group) for the whole run.
_ALL = "_all"
Rows = dict[int, dict[str, Any]]


def _grouped(d: pl.DataFrame, by: str) -> pl.DataFrame:
    return d if by in d.columns else d.with_columns(pl.lit(0, pl.Int64).alias(by))


def _first_rows(d: pl.DataFrame, by: str) -> Rows:
    """The first row of each group (frames are kept in pair, decode_order, slot order)."""
    if d.height == 0:
        return {}
    return {int(r[by]): r for r in d.group_by(by, maintain_order=True).first().iter_rows(named=True)}


def _max_rows(d: pl.DataFrame, column: str, by: str) -> Rows:
    """The row of each group with the largest `column` (the first of equals)."""
    if d.height == 0:
        return {}
    g = d.group_by(by).agg(pl.all().get(pl.col(column).arg_max()))
    return {int(r[by]): r for r in g.iter_rows(named=True)}


def _aggregate(d: pl.DataFrame, by: str, **aggs: pl.Expr) -> Rows:
    if d.height == 0:
        return {}
    return {int(r[by]): r for r in d.group_by(by).agg(**aggs).iter_rows(named=True)}


def _float(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) else None


def _where(row: Mapping[str, Any], lmap: _LayerMap | None = None) -> Where:
    layer = lmap.refs[int(row["_j"])] if lmap is not None else None
    return Where(pair=int(row["pair"]), decode_order=int(row["decode_order"]), layer=layer)


EMPTY_LOG_PROB = LogProbStats(0, None, None, 0, None, None)


def _log_prob_stats(d: pl.DataFrame, tol: float, by: str) -> dict[int, LogProbStats]:
    """`d`: pair, decode_order, delta (same token, both log-probs present)."""
    d = _grouped(d, by)
    beyond = pl.col("delta") > tol
    counts = _aggregate(d, by, n=pl.len(), beyond=beyond.sum())
    tops, firsts = _max_rows(d, "delta", by), _first_rows(d.filter(beyond), by)
    out = {}
    for k, c in counts.items():
        top, first = tops.get(k), firsts.get(k)
        out[k] = LogProbStats(
            compared=int(c["n"]),
            max_abs_delta=_float(top["delta"]) if top else None,
            max_at=_where(top) if top and top["delta"] else None,
            beyond_tol=int(c["beyond"]),
            first_beyond=_where(first) if first else None,
            first_beyond_delta=_float(first["delta"]) if first else None,
        )
    return out


EMPTY_ROUTING = RoutingStats(0, 0, 0, None, None, None, None, 0, None, None, 0, None)


def _routing_stats(
    r: pl.DataFrame, w: pl.DataFrame, lmap: _LayerMap, tol: float, by: str
) -> dict[int, RoutingStats]:
    r, w = _grouped(r, by), _grouped(w, by)
    counts = _aggregate(
        r, by, n=pl.len(), identical=pl.col("identical").sum(), same_set=pl.col("same_set").sum()
    )
    firsts = _first_rows(r.filter(~pl.col("same_set")), by)
    reorders = _first_rows(r.filter(pl.col("same_set") & ~pl.col("identical")), by)
    beyond = pl.col("delta") > tol
    w_counts = _aggregate(w, by, n=pl.len(), beyond=beyond.sum())
    w_tops, w_firsts = _max_rows(w, "delta", by), _first_rows(w.filter(beyond), by)
    out = {}
    for k in counts.keys() | w_counts.keys():
        c, wc = counts.get(k, {"n": 0, "identical": 0, "same_set": 0}), w_counts.get(k, {"n": 0, "beyond": 0})
        n, first, reorder = int(c["n"]), firsts.get(k), reorders.get(k)
        top, first_w = w_tops.get(k), w_firsts.get(k)
        out[k] = RoutingStats(
            compared=n,
            identical=int(c["identical"]),
            same_set=int(c["same_set"]),
            agreement=int(c["identical"]) / n if n else None,
            set_agreement=int(c["same_set"]) / n if n else None,
            first_difference=RoutingDifference(
                where=_where(first, lmap),
                experts_a=list(first["expert_ids"]),
                experts_b=list(first["expert_ids_b"]),
            )
            if first
            else None,
            first_reorder=_where(reorder, lmap) if reorder else None,
            weights_compared=int(wc["n"]),
            max_weight_delta=_float(top["delta"]) if top else None,
            max_weight_at=_where(top, lmap) if top and top["delta"] else None,
            weights_beyond_tol=int(wc["beyond"]),
            first_weight_beyond=_where(first_w, lmap) if first_w else None,
        )
    return out


EMPTY_RATIO = RatioStats(0, None, None, None, 0, None, [])


def _ratio_stats(d: pl.DataFrame, lmap: _LayerMap, tol: float, by: str) -> dict[int, RatioStats]:
    d = _grouped(d, by)
    beyond = pl.col("delta") > tol
    counts = _aggregate(d, by, n=pl.len(), mean=pl.col("delta").mean(), beyond=beyond.sum())
    tops, firsts = _max_rows(d, "delta", by), _first_rows(d.filter(beyond), by)
    layers: dict[int, list[LayerRatio]] = {}
    if d.height:
        per_layer = (
            d.group_by(by, "_j")
            .agg(
                pl.len().alias("n"),
                pl.col("delta").mean().alias("mean"),
                pl.col("delta").max().alias("max"),
                beyond.sum().alias("beyond"),
            )
            .sort(by, "_j")
        )
        for row in per_layer.iter_rows(named=True):
            layers.setdefault(int(row[by]), []).append(
                LayerRatio(
                    layer=lmap.refs[int(row["_j"])],
                    compared=int(row["n"]),
                    mean_abs_delta=float(row["mean"]),
                    max_abs_delta=float(row["max"]),
                    beyond_tol=int(row["beyond"]),
                )
            )
    out = {}
    for k, c in counts.items():
        top, first = tops.get(k), firsts.get(k)
        out[k] = RatioStats(
            compared=int(c["n"]),
            mean_abs_delta=_float(c["mean"]),
            max_abs_delta=_float(top["delta"]) if top else None,
            max_at=_where(top, lmap) if top and top["delta"] else None,
            beyond_tol=int(c["beyond"]),
            first_beyond=_where(first, lmap) if first else None,
            layers=layers.get(k, []),
        )
    return out


EMPTY_ATTN = AttnStats(0, 0, None, None)


def _attn_stats(d: pl.DataFrame, lmap: _LayerMap, by: str) -> dict[int, AttnStats]:
    d = _grouped(d, by)
    differ = pl.col("delta") != 0
    counts = _aggregate(d, by, n=pl.len(), differing=differ.sum(), top=pl.col("delta").max())
    firsts = _first_rows(d.filter(differ), by)
    out = {}
    for k, c in counts.items():
        first = firsts.get(k)
        out[k] = AttnStats(
            compared=int(c["n"]),
            differing=int(c["differing"]),
            max_abs_delta=int(c["top"]) if c["top"] is not None else None,
            first_difference=AttnDifference(
                where=_where(first, lmap),
                attended_a=int(first["attn_attended"]),
                attended_b=int(first["attn_attended_b"]),
            )
            if first
            else None,
        )
    return out


# ------------------------------------------------------------------ compare
def _token_ref(row: Mapping[str, Any] | None) -> TokenRef | None:
    if row is None:
        return None
    return TokenRef(token_id=row["token_id"], text=row["token_text"], log_prob=_float(row["log_prob"]))


def _fmt_token(t: TokenRef | None) -> str:
    if t is None:
        return "(none)"
    return f"{t.token_id} '{_visible(t.text)}'" if t.text is not None else f"{t.token_id}"


def _first_difference(
    divergence: Where | None,
    token_a: TokenRef | None,
    token_b: TokenRef | None,
    end: Where | None,
    longer: str | None,
    lp: LogProbStats,
    rt: RoutingStats | None,
    z: RatioStats | None,
    at: AttnStats | None,
    tol: Tolerances,
) -> FirstDifference | None:
    """The earliest difference of a pair; at the same position, causes (attention, routing,
    activations) before effects (log-prob, token)."""
    cands: list[tuple[int, int, str, str]] = []

    def cand(kind: str, where: Where | None, detail: str) -> None:
        if where is not None:
            cands.append((where.decode_order, KINDS.index(kind), kind, detail))

    def layer(where: Where, kind: str) -> str:
        return where.layer.label(kind) if where.layer is not None else _KIND_NAMES[kind]

    if at is not None and at.first_difference is not None:
        f = at.first_difference
        cand(
            "attn", f.where, f"{layer(f.where, ATTN)} attends {f.attended_a} cells in A, {f.attended_b} in B"
        )
    if rt is not None and rt.first_difference is not None:
        g = rt.first_difference
        cand("routing", g.where, f"{layer(g.where, MOE)} experts {g.experts_a} in A, {g.experts_b} in B")
    if rt is not None and rt.first_weight_beyond is not None:
        w = rt.first_weight_beyond
        cand("weights", w, f"{layer(w, MOE)} gate weights differ beyond {tol.weight:g}")
    if z is not None and z.first_beyond is not None:
        zf = z.first_beyond
        cand("act_zero_ratio", zf, f"{layer(zf, FFN)} activation zero ratio differs beyond {tol.ratio:g}")
    if lp.first_beyond is not None:
        cand("log_prob", lp.first_beyond, f"log-prob differs by {_num(lp.first_beyond_delta)} (same token)")
    if divergence is not None:
        cand("token", divergence, f"token {_fmt_token(token_a)} in A, {_fmt_token(token_b)} in B")
    if end is not None and longer is not None:
        shorter = "B" if longer == "A" else "A"
        n = end.decode_order
        cand("length", end, f"{shorter} ends after {n} token{'s' if n != 1 else ''}, {longer} goes on")
    if not cands:
        return None
    o, _, kind, detail = min(cands)
    return FirstDifference(decode_order=o, kind=kind, detail=detail)


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
    """Compare two tokens tables (schema.TOKENS) of runs of the same prompts. See the module doc."""
    tol = tolerances or Tolerances()
    notes: list[str] = []
    sides: list[_Side] = []
    for name, df, meta in (("A", tokens_a, meta_a), ("B", tokens_b, meta_b)):
        complete = meta.get("complete") if meta is not None else None
        side = _prepare(df, name, complete if isinstance(complete, bool) else None)
        sides.append(side)
        s = side.summary
        if s.partial_requests or s.partial_rows:
            notes.append(
                f"{name}: {s.partial_requests} partial request(s) ({s.partial_rows} token rows) were "
                "already running when the recording began: excluded"
            )
        if s.duplicate_rows:
            notes.append(f"{name}: {s.duplicate_rows} repeated (request, decode_order) rows: the first kept")
        if s.complete is False:
            notes.append(f"{name} was never closed (interrupted): its last requests may be cut short")
    sa, sb = sides
    n_pairs = min(sa.summary.requests, sb.summary.requests)
    unpaired_a = sa.order.filter(pl.col("pair") >= n_pairs)["request_id"].to_list()
    unpaired_b = sb.order.filter(pl.col("pair") >= n_pairs)["request_id"].to_list()
    if unpaired_a or unpaired_b:
        more, extra = ("A", unpaired_a) if unpaired_a else ("B", unpaired_b)
        notes.append(
            f"request counts differ: A has {sa.summary.requests}, B {sb.summary.requests}; the last "
            f"{len(extra)} of {more} (by first-token time) are unpaired, and if a request is missing "
            "earlier, later pairs are shifted"
        )
    a = sa.rows.filter(pl.col("pair") < n_pairs)
    b = sb.rows.filter(pl.col("pair") < n_pairs)

    # Columns that cannot be compared.
    not_comparable: dict[str, str] = {}
    if a.height and b.height:
        for column, (_, depth) in _COMPARED.items():
            why_a, why_b = _not_captured(a, column, depth), _not_captured(b, column, depth)
            if why_a and why_b:
                not_comparable[column] = (
                    f"{why_a} in A, {why_b} in B" if why_a != why_b else f"{why_a} in both"
                )
            elif why_a or why_b:
                not_comparable[column] = f"{why_a} in A" if why_a else f"{why_b} in B"
        if "expert_ids" in not_comparable and "expert_weights" not in not_comparable:
            not_comparable["expert_weights"] = "expert ids not comparable"

    # Align by decode_order; the window is what gets compared.
    cols = ["token_id", "token_text", "log_prob", *[c for c in _COMPARED if c != "log_prob"]]
    al = (
        a.select("pair", "decode_order", *cols)
        .join(b.select("pair", "decode_order", *cols), on=["pair", "decode_order"], how="inner", suffix="_b")
        .sort("pair", "decode_order")
    )
    differs = pl.col("token_id").ne_missing(pl.col("token_id_b"))
    div = al.filter(differs).group_by("pair").agg(pl.col("decode_order").min().alias("div"))
    win = al.join(div, on="pair", how="left").sort("pair", "decode_order")
    if not all_positions:
        win = win.filter(pl.col("div").is_null() | (pl.col("decode_order") <= pl.col("div")))

    lp = win.filter(~differs & pl.col("log_prob").is_not_null() & pl.col("log_prob_b").is_not_null()).select(
        "pair", "decode_order", _abs_delta("log_prob", "log_prob_b").alias("delta")
    )
    if "log_prob" in not_comparable:
        lp = lp.clear()

    comparable = a.height > 0 and b.height > 0
    routing = weights = ratios = attn = None
    moe_map = ffn_map = attn_map = None
    if comparable and "expert_ids" not in not_comparable:
        moe_map = _layer_map(MOE, "expert_ids", a, b, meta_a, meta_b, notes)
        routing = _with_same_set(_slots(win, moe_map, ["expert_ids"]))
        one_sided = win.filter(pl.col("expert_ids").is_null() != pl.col("expert_ids_b").is_null()).height
        if one_sided:
            notes.append(f"expert_ids: {one_sided} compared token(s) have routing in one run only: skipped")
        weights = _weight_deltas(win, moe_map)
        if "expert_weights" in not_comparable:
            weights = weights.clear()
    if comparable and "act_zero_ratio" not in not_comparable:
        ffn_map = _layer_map(FFN, "act_zero_ratio", a, b, meta_a, meta_b, notes)
        ratios = _slots(win, ffn_map, ["act_zero_ratio"]).with_columns(
            _abs_delta("act_zero_ratio", "act_zero_ratio_b").alias("delta")
        )
    if comparable and "attn_attended" not in not_comparable:
        attn_map = _layer_map(ATTN, "attn_attended", a, b, meta_a, meta_b, notes)
        attn = _slots(win, attn_map, ["attn_attended"]).with_columns(
            (pl.col("attn_attended").cast(pl.Int64) - pl.col("attn_attended_b").cast(pl.Int64))
            .abs()
            .alias("delta")
        )

    def stats(
        by: str,
    ) -> tuple[dict[int, LogProbStats], dict[int, RoutingStats], dict[int, RatioStats], dict[int, AttnStats]]:
        return (
            _log_prob_stats(lp, tol.logprob, by),
            _routing_stats(routing, weights, moe_map, tol.weight, by)
            if routing is not None and weights is not None and moe_map is not None
            else {},
            _ratio_stats(ratios, ffn_map, tol.ratio, by)
            if ratios is not None and ffn_map is not None
            else {},
            _attn_stats(attn, attn_map, by) if attn is not None and attn_map is not None else {},
        )

    lp_by, rt_by, z_by, at_by = stats("pair")
    lp_all, rt_all, z_all, at_all = stats(_ALL)

    # Per pair: counts, gaps (positions one run lacks inside its own range), the divergence.
    keys = ["pair", "decode_order"]
    only_b = b.select(keys).join(a.select(keys), on=keys, how="anti")
    only_a = a.select(keys).join(b.select(keys), on=keys, how="anti")
    last_a = dict(sa.order.select("pair", "last").iter_rows())
    last_b = dict(sb.order.select("pair", "last").iter_rows())
    gaps_a = _aggregate(
        only_b.join(sa.order.select("pair", "last"), on="pair").filter(
            pl.col("decode_order") <= pl.col("last")
        ),
        "pair",
        n=pl.len(),
    )
    gaps_b = _aggregate(
        only_a.join(sb.order.select("pair", "last"), on="pair").filter(
            pl.col("decode_order") <= pl.col("last")
        ),
        "pair",
        n=pl.len(),
    )
    compared = _aggregate(win, "pair", n=pl.len(), mismatches=differs.sum())
    at_div = {
        int(r["pair"]): r
        for r in win.filter(pl.col("decode_order") == pl.col("div"))
        .select(
            "pair",
            "decode_order",
            "token_id",
            "token_text",
            "log_prob",
            "token_id_b",
            "token_text_b",
            "log_prob_b",
        )
        .iter_rows(named=True)
    }
    shown_cols = ["pair", "decode_order", "token_id", "token_text", "log_prob"]
    rows_a, rows_b = a.select(shown_cols), b.select(shown_cols)

    pairs: list[PairResult] = []
    order_a = sa.order.filter(pl.col("pair") < n_pairs).iter_rows(named=True)
    order_b = sb.order.filter(pl.col("pair") < n_pairs).iter_rows(named=True)
    for ra, rb in zip(order_a, order_b, strict=True):
        i = int(ra["pair"])
        la, lb = last_a.get(i), last_b.get(i)
        la, lb = -1 if la is None else int(la), -1 if lb is None else int(lb)
        dr = at_div.get(i)
        d = int(dr["decode_order"]) if dr else None
        token_a = token_b = None
        if dr is not None:
            token_a = TokenRef(dr["token_id"], dr["token_text"], _float(dr["log_prob"]))
            token_b = TokenRef(dr["token_id_b"], dr["token_text_b"], _float(dr["log_prob_b"]))
        length_difference = ("A" if la > lb else "B") if d is None and la != lb else None
        lp_stats = lp_by.get(i, EMPTY_LOG_PROB)
        rt_stats = rt_by.get(i, EMPTY_ROUTING) if routing is not None else None
        z_stats = z_by.get(i, EMPTY_RATIO) if ratios is not None else None
        at_stats = at_by.get(i, EMPTY_ATTN) if attn is not None else None
        first_diff = _first_difference(
            Where(i, d) if d is not None else None,
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
        context_at = d if d is not None else (first_diff.decode_order if first_diff else None)
        ctx: list[ContextRow] = []
        if context_at is not None:
            lo, hi = max(0, context_at - context), context_at + context
            near = (pl.col("pair") == i) & pl.col("decode_order").is_between(lo, hi)
            by_a = {r["decode_order"]: r for r in rows_a.filter(near).iter_rows(named=True)}
            by_b = {r["decode_order"]: r for r in rows_b.filter(near).iter_rows(named=True)}
            for o in sorted(by_a.keys() | by_b.keys()):
                ctx.append(ContextRow(decode_order=o, a=_token_ref(by_a.get(o)), b=_token_ref(by_b.get(o))))
        c = compared.get(i, {"n": 0, "mismatches": 0})
        pairs.append(
            PairResult(
                pair=i,
                request_a=str(ra["request_id"]),
                request_b=str(rb["request_id"]),
                tokens_a=int(ra["tokens"] or 0),
                tokens_b=int(rb["tokens"] or 0),
                compared=int(c["n"]),
                divergence=d,
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

    first_div = next((Where(p.pair, p.divergence) for p in pairs if p.divergence is not None), None)
    different = sum(1 for p in pairs if not p.equal)
    return DiffResult(
        equal=different == 0 and not unpaired_a and not unpaired_b,
        tolerances=tol,
        all_positions=all_positions,
        a=sa.summary,
        b=sb.summary,
        pairs=pairs,
        unpaired_a=unpaired_a,
        unpaired_b=unpaired_b,
        tokens_compared=win.height,
        pairs_diverged=sum(1 for p in pairs if p.divergence is not None),
        pairs_different=different,
        first_divergence=first_div,
        log_prob=lp_all.get(0, EMPTY_LOG_PROB),
        routing=rt_all.get(0, EMPTY_ROUTING) if routing is not None else None,
        act_zero_ratio=z_all.get(0, EMPTY_RATIO) if ratios is not None else None,
        attn=at_all.get(0, EMPTY_ATTN) if attn is not None else None,
        not_comparable=not_comparable,
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


# ------------------------------------------------------------------ presentation
def result_json(result: DiffResult) -> dict[str, Any]:
    """The result as JSON-ready data (non-finite floats become strings "inf"/"nan")."""

    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    return {"format": JSON_FORMAT, "version": JSON_VERSION, **clean(asdict(result))}


def _num(v: float | None, spec: str = ".3g") -> str:
    if v is None:
        return "—"
    return "0" if v == 0 else format(v, spec)


def _pct(v: float | None) -> str:
    if v is None:
        return "—"
    return "100%" if v == 1 else f"{min(100 * v, 99.99):.2f}%"  # never rounds up to a false 100%


def _at(w: Where | None, kind: str | None = None) -> str:
    if w is None:
        return ""
    s = f"request #{w.pair} token {w.decode_order}"
    if w.layer is not None and kind is not None:
        s += f", {w.layer.label(kind)}"
    return s


def _lp(t: TokenRef | None) -> str:
    return "—" if t is None or t.log_prob is None else f"{t.log_prob + 0.0:.4f}"  # no "-0.0000"


def _visible(text: str) -> str:
    """Token text with control characters escaped (newlines, tabs...), everything else as is."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _token_text(t: TokenRef | None) -> Text:
    if t is None or t.token_id is None:
        return Text("—", style="dim")
    if t.text is None:  # redacted: the id is all there is
        return Text(f"#{t.token_id}")
    return Text.assemble(f"'{_visible(t.text)}'", (f" #{t.token_id}", "dim"))


def render(
    result: DiffResult, console: Console | None = None, *, name_a: str = "A", name_b: str = "B"
) -> None:
    """The terminal report: summary, one line per request pair, the first divergence in context."""
    con = console or Console()
    tol = result.tolerances

    head = Table(title="sparseety-prof diff", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    head.add_row("A", Text(name_a))
    head.add_row("B", Text(name_b))
    sa, sb = result.a, result.b
    req = f"A {sa.requests}, B {sb.requests}; {len(result.pairs)} paired by first-token time"
    if result.unpaired_a or result.unpaired_b:
        req += f"; unpaired: A {len(result.unpaired_a)}, B {len(result.unpaired_b)}"
    if sa.partial_requests or sb.partial_requests:
        req += f" (partial excluded: A {sa.partial_requests}, B {sb.partial_requests})"
    head.add_row("requests", req)
    rule = "all aligned positions" if result.all_positions else "up to each pair's divergence"
    head.add_row("tokens compared", f"{result.tokens_compared} ({rule})")
    fd = result.first_divergence
    head.add_row(
        "token divergence",
        f"{result.pairs_diverged} of {len(result.pairs)} pairs"
        + (f"; first: {_at(fd)}" if fd is not None else ""),
    )
    lp = result.log_prob
    head.add_row(
        "log-prob",
        f"max |Δ| {_num(lp.max_abs_delta)}"
        + (f" at {_at(lp.max_at)}" if lp.max_at and lp.max_abs_delta else "")
        + f"; {lp.beyond_tol} of {lp.compared} beyond {tol.logprob:g}",
    )
    rt = result.routing
    if rt is not None:
        line = (
            f"agreement {_pct(rt.agreement)} identical, {_pct(rt.set_agreement)} as sets "
            f"({rt.compared} token×layer)"
        )
        if rt.first_difference:
            g = rt.first_difference
            line += f"; first set difference: {_at(g.where, MOE)}: {g.experts_a} vs {g.experts_b}"
        head.add_row("routing", line)
        head.add_row(
            "expert weights",
            f"max |Δ| {_num(rt.max_weight_delta)}"
            + (f" at {_at(rt.max_weight_at, MOE)}" if rt.max_weight_at and rt.max_weight_delta else "")
            + f"; {rt.weights_beyond_tol} of {rt.weights_compared} beyond {tol.weight:g}",
        )
    z = result.act_zero_ratio
    if z is not None:
        worst = max(z.layers, key=lambda x: x.mean_abs_delta, default=None)
        line = f"mean |Δ| {_num(z.mean_abs_delta)}, max {_num(z.max_abs_delta)}"
        if z.max_at and z.max_abs_delta:
            line += f" at {_at(z.max_at, FFN)}"
        if worst is not None and worst.mean_abs_delta:
            line += f"; worst layer {worst.layer.label(FFN)} (mean {_num(worst.mean_abs_delta)})"
        line += f"; {z.beyond_tol} of {z.compared} beyond {tol.ratio:g}"
        head.add_row("act zero ratio", line)
    at = result.attn
    if at is not None:
        line = f"{at.differing} of {at.compared} token×layer differ"
        if at.first_difference:
            ad = at.first_difference
            line += f"; first: {_at(ad.where, ATTN)}: {ad.attended_a} vs {ad.attended_b} cells"
        head.add_row("attention", line)
    for column, why in result.not_comparable.items():
        head.add_row("not comparable", f"{column}: {why}")
    con.print(head)

    if result.pairs:
        caption = "cmp: positions compared; |Δlp|: largest |Δ log-prob|"
        t = Table(title="request pairs (by first-token time)", box=box.SIMPLE_HEAD, pad_edge=False)
        for c in ("#", "requests A / B", "tokens", "cmp", "diverges", "|Δlp|"):
            t.add_column(c, overflow="fold")
        if result.routing is not None:
            t.add_column("experts=", overflow="fold")
            caption += "; experts=: token×MoE-layer with the same expert set"
        if result.act_zero_ratio is not None:
            t.add_column("|Δzero|", overflow="fold")
            caption += "; |Δzero|: largest |Δ act_zero_ratio|"
        if result.attn is not None:
            t.add_column("attn≠", overflow="fold")
            caption += "; attn≠: token×attention-layer with other attended cells"
        t.add_column("first difference", overflow="fold")
        t.caption = caption
        for p in result.pairs:
            cells: list[str | Text] = [
                str(p.pair),
                Text(f"{p.request_a} / {p.request_b}"),
                f"{p.tokens_a}/{p.tokens_b}",
                str(p.compared),
                "—" if p.divergence is None else f"at {p.divergence}",
                _num(p.log_prob.max_abs_delta),
            ]
            if result.routing is not None:
                cells.append(_pct(p.routing.set_agreement) if p.routing else "—")
            if result.act_zero_ratio is not None:
                cells.append(_num(p.act_zero_ratio.max_abs_delta) if p.act_zero_ratio else "—")
            if result.attn is not None:
                cells.append(str(p.attn.differing) if p.attn else "—")
            pf = p.first_difference
            cells.append(
                Text("equal", style="green")
                if pf is None
                else Text(f"{pf.kind} at {pf.decode_order}", style="red")
            )
            t.add_row(*cells)
        con.print(t)
        for p in result.pairs:
            pf = p.first_difference
            if pf is None:
                continue
            pline = Text(f"#{p.pair} ", style="bold")
            pline.append(f"{p.request_a} / {p.request_b}: ")
            pline.append(f"first difference at token {pf.decode_order} ({pf.kind}): {pf.detail}", style="red")
            if p.divergence is not None and pf.kind != "token":
                pline.append(f"; tokens diverge at {p.divergence}: token {_fmt_token(p.token_a)} in A, ")
                pline.append(f"{_fmt_token(p.token_b)} in B")
            con.print(pline)

    shown = next((p for p in result.pairs if p.divergence is not None), None)
    shown = shown or next((p for p in result.pairs if p.first_difference is not None), None)
    if shown is not None and shown.context:
        sf = shown.first_difference
        title = (
            f"request #{shown.pair} ({shown.request_a} / {shown.request_b}) "
            + (f"diverges at token {shown.divergence}" if shown.divergence is not None else "")
            + (
                f"; first difference at token {sf.decode_order} ({sf.kind})"
                if sf is not None and (shown.divergence is None or sf.decode_order < shown.divergence)
                else ""
            )
        )
        con.print(Text(title, style="bold"))
        ctx = Table()
        for col in ("token", "A", "A log-prob", "B", "B log-prob", ""):
            ctx.add_column(col)
        for row in shown.context:
            mark = ""
            if row.decode_order == shown.divergence:
                mark = "◀ diverge"
            elif sf is not None and row.decode_order == sf.decode_order:
                mark = f"◀ {sf.kind}"
            style = "bold red" if row.decode_order == shown.context_at else None
            ctx.add_row(
                str(row.decode_order),
                _token_text(row.a),
                _lp(row.a),
                _token_text(row.b),
                _lp(row.b),
                mark,
                style=style,
            )
        con.print(ctx)
        if shown.divergence is not None and not result.all_positions:
            con.print(
                Text(
                    "after the divergence the runs condition on different tokens: later positions are not "
                    "compared (use --all to compare them anyway)",
                    style="dim",
                )
            )

    z = result.act_zero_ratio
    if z is not None and any(x.mean_abs_delta for x in z.layers):
        con.print(Text("activation zero ratio by layer (largest mean |Δ| first)", style="bold"))
        lt = Table()
        for col in ("layer", "compared", "mean |Δ|", "max |Δ|", f"> {tol.ratio:g}"):
            lt.add_column(col)
        for x in sorted(z.layers, key=lambda x: -x.mean_abs_delta)[:8]:
            lt.add_row(
                x.layer.label(FFN),
                str(x.compared),
                _num(x.mean_abs_delta),
                _num(x.max_abs_delta),
                str(x.beyond_tol),
            )
        con.print(lt)

    for note in result.notes:
        con.print(Text(f"note: {note}", style="yellow"))
    if result.unpaired_a or result.unpaired_b:
        con.print(Text(f"unpaired: A {result.unpaired_a}, B {result.unpaired_b}", style="yellow"))
    if result.equal:
        con.print(Text("the runs are equal within tolerances", style="bold green"))
    else:
        reasons: list[str] = []
        if result.pairs_different:
            reasons.append(f"{result.pairs_different} of {len(result.pairs)} request pairs differ")
        if result.unpaired_a or result.unpaired_b:
            reasons.append("request counts differ")
        con.print(Text("the runs differ: " + "; ".join(reasons), style="bold red"))


def run(
    path_a: Path,
    path_b: Path,
    *,
    tolerances: Tolerances | None = None,
    all_positions: bool = False,
    context: int = 3,
    as_json: bool = False,
    console: Console | None = None,
) -> int:
    """The `diff` command: 0 when the runs are equal within tolerances, 1 when they differ."""
    result = diff_recordings(
        path_a, path_b, tolerances=tolerances, all_positions=all_positions, context=context
    )
    if as_json:
        out = console.file if console is not None else sys.stdout
        out.write(json.dumps(result_json(result), indent=2, ensure_ascii=False) + "\n")
    else:
        render(result, console or Console(), name_a=str(path_a), name_b=str(path_b))
    return 0 if result.equal else 1
