"""Detectors over what the model said: repetition loops and log-probability collapse."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from sparseety_prof.store.anomalies import common

#: a loop: a block of 1..MAX_PERIOD token ids repeated back to back at least MIN_REPEATS times
#: and covering at least MIN_SPAN tokens (so "the the the" is not a loop, 8 x "the" is)
LOOP_MAX_PERIOD = 16
LOOP_MIN_REPEATS = 3.0
LOOP_MIN_SPAN = 8
#: a log-prob collapse: LOGPROB_MIN_RUN tokens in a row each LOGPROB_Z robust standard deviations
#: below the request's median log-prob (sigma floored at LOGPROB_SIGMA_FLOOR nats), in a request
#: of at least LOGPROB_MIN_TOKENS tokens (fewer make no baseline)
LOGPROB_Z = 4.0
LOGPROB_SIGMA_FLOOR = 0.25
LOGPROB_MIN_RUN = 3
LOGPROB_MIN_TOKENS = 16


def _loops_in(
    ids: np.ndarray, max_period: int, min_repeats: float, min_span: int
) -> list[tuple[int, int, int]]:
    """(start, end inclusive, period) of each loop in one request's token ids, every window that
    qualifies at its shortest period: one whose tokens all lie in loops of shorter periods already
    found is the same loop (a period-2 loop is also a period-4 one) and is left out."""
    taken = np.zeros(len(ids), dtype=bool)
    found: list[tuple[int, int, int]] = []
    for p in range(1, min(max_period, len(ids) // 2) + 1):
        same = np.concatenate([np.zeros(p, dtype=bool), ids[p:] == ids[:-p]])
        # runs of `same`: token i repeats token i - p, so the loop starts p tokens before the run
        edges = np.diff(np.concatenate([[0], same.astype(np.int8), [0]]))
        for run_start, run_end in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True):
            start, end = int(run_start) - p, int(run_end) - 1
            span = end - start + 1
            if span >= min_span and span / p >= min_repeats and not taken[start : end + 1].all():
                taken[start : end + 1] = True
                found.append((start, end, p))
    return sorted(found)


def repetition_loops(
    tokens: pl.DataFrame,
    *,
    max_period: int = LOOP_MAX_PERIOD,
    min_repeats: float = LOOP_MIN_REPEATS,
    min_span: int = LOOP_MIN_SPAN,
) -> pl.DataFrame:
    """The same n-gram of token ids repeating back to back. Score: how many times it repeats."""
    rows = []
    for (request_id,), req in (
        common.ordered(tokens)
        .filter(pl.col("token_id").is_not_null())
        .group_by("request_id", maintain_order=True)
    ):
        ids = req["token_id"].to_numpy()
        for start, end, p in _loops_in(ids, max_period, min_repeats, min_span):
            first = req.row(start, named=True)
            repeats = (end - start + 1) / p
            gram = ", ".join(str(x) for x in ids[start : start + p])
            rows.append(
                {
                    "kind": "repetition_loop",
                    "score": repeats,
                    "request_id": request_id,
                    "seq_id": first["seq_id"],
                    "decode_order": first["decode_order"],
                    "decode_order_end": req["decode_order"][end],
                    "step_id": first["step_id"],
                    "reason": f"token ids [{gram}] repeat {repeats:.1f} times in a row "
                    f"({end - start + 1} tokens, period {p})",
                }
            )
    return common.frame(rows)


def logprob_collapse(
    tokens: pl.DataFrame,
    *,
    z: float = LOGPROB_Z,
    sigma_floor: float = LOGPROB_SIGMA_FLOOR,
    min_run: int = LOGPROB_MIN_RUN,
    min_tokens: int = LOGPROB_MIN_TOKENS,
) -> pl.DataFrame:
    """A run of tokens the model itself found very unlikely, against the request's own baseline.
    Score: the largest drop in robust standard deviations."""
    df = (
        common.ordered(tokens)
        .filter(pl.col("log_prob").is_not_null() & pl.col("log_prob").is_finite())
        .filter(pl.len().over("request_id") >= min_tokens)
        .with_columns(
            (-common.robust_z(pl.col("log_prob"), sigma_floor=sigma_floor, over="request_id")).alias("score"),
            pl.col("log_prob").median().over("request_id").alias("baseline"),
        )
        .with_columns((pl.col("score") >= z).alias("flag"))
    )
    baseline = dict(df.group_by("request_id").agg(pl.col("baseline").first()).iter_rows())

    def reason(run: dict[str, Any]) -> str:
        highest = float(
            df.filter(
                (pl.col("request_id") == run["request_id"])
                & pl.col("decode_order").is_between(run["decode_order"], run["decode_order_end"])
            )["log_prob"].max()  # type: ignore[arg-type]
        )
        return (
            f"{run['n']} tokens in a row at log-prob {highest:.2f} or less "
            f"(request median {baseline[run['request_id']]:.2f}; up to {run['score']:.1f} sigma below)"
        )

    return common.runs(df, kind="logprob_collapse", by=("request_id",), min_len=min_run, reason=reason)
