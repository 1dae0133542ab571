"""The earliest difference of a request pair, with a one-line description.

At the same decode_order, causes win over effects (the order of `result.KINDS`): a different
attention span or expert set explains a different log-prob, which explains a different token."""

from __future__ import annotations

from sparseety_prof.views.diff.result import (
    ATTN,
    FFN,
    KIND_NAMES,
    KINDS,
    MOE,
    AttnStats,
    FirstDifference,
    LogProbStats,
    RatioStats,
    RoutingStats,
    TokenRef,
    Tolerances,
    Where,
)
from sparseety_prof.views.diff.text import describe_token, num


def _layer(where: Where, kind: str) -> str:
    return where.layer.label(kind) if where.layer is not None else KIND_NAMES[kind]


def first_difference(
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
    """`end`/`longer`: where the shorter run ended and which run goes on, when the tokens agree."""
    cands: list[tuple[int, int, str, str]] = []

    def cand(kind: str, where: Where | None, detail: str) -> None:
        if where is not None:
            cands.append((where.decode_order, KINDS.index(kind), kind, detail))

    if at is not None and at.first_difference is not None:
        f = at.first_difference
        cand(
            "attn", f.where, f"{_layer(f.where, ATTN)} attends {f.attended_a} cells in A, {f.attended_b} in B"
        )
    if rt is not None and rt.first_difference is not None:
        g = rt.first_difference
        cand("routing", g.where, f"{_layer(g.where, MOE)} experts {g.experts_a} in A, {g.experts_b} in B")
    if rt is not None and rt.first_weight_beyond is not None:
        w = rt.first_weight_beyond
        cand("weights", w, f"{_layer(w, MOE)} gate weights differ beyond {tol.weight:g}")
    if z is not None and z.first_beyond is not None:
        zf = z.first_beyond
        cand("act_zero_ratio", zf, f"{_layer(zf, FFN)} activation zero ratio differs beyond {tol.ratio:g}")
    if lp.first_beyond is not None:
        cand("log_prob", lp.first_beyond, f"log-prob differs by {num(lp.first_beyond_delta)} (same token)")
    if divergence is not None:
        cand("token", divergence, f"token {describe_token(token_a)} in A, {describe_token(token_b)} in B")
    if end is not None and longer is not None:
        shorter = "B" if longer == "A" else "A"
        n = end.decode_order
        cand("length", end, f"{shorter} ends after {n} token{'s' if n != 1 else ''}, {longer} goes on")
    if not cands:
        return None
    o, _, kind, detail = min(cands)
    return FirstDifference(decode_order=o, kind=kind, detail=detail)
