"""The cpu_stacks table read back: folded stacks per request, per phase, per step kind.

A step's samples belong to every request whose rows the step computed: the requests of its
sequences (steps.seq_ids) whose window (requests.t_started_ns to t_last_token_ns) holds the
step's start. A step that batched several requests counts its samples for each of them (their
CPU was spent at once); samples between steps belong to no request.
"""

from __future__ import annotations

import polars as pl

from sparseety_prof.store.recording import Recording

#: the columns of a folded-stack summary, besides its grouping
SUMMARY = ("stack", "samples")


def request_steps(steps: pl.DataFrame, requests: pl.DataFrame) -> pl.DataFrame:
    """(step_id, request_id): each step with the requests it computed rows for."""
    if steps.height == 0 or requests.height == 0:
        return pl.DataFrame(schema={"step_id": pl.Int64(), "request_id": pl.String()})
    seqs = (
        steps.select("step_id", "ctx_id", "t_start_ns", pl.col("seq_ids").alias("seq_id"))
        .explode("seq_id")
        .drop_nulls(["seq_id", "t_start_ns"])
        .sort("t_start_ns")
    )
    windows = (
        requests.select("request_id", "ctx_id", "seq_id", "t_started_ns", "t_last_token_ns")
        .drop_nulls(["t_started_ns", "seq_id", "ctx_id"])
        .sort("t_started_ns")
    )
    # both sorted by time above (polars cannot check it within the `by` groups: said, not warned)
    joined = seqs.join_asof(
        windows,
        left_on="t_start_ns",
        right_on="t_started_ns",
        by=["ctx_id", "seq_id"],
        strategy="backward",
        check_sortedness=False,
    )
    inside = pl.col("t_last_token_ns").is_null() | (pl.col("t_start_ns") <= pl.col("t_last_token_ns"))
    return joined.filter(pl.col("request_id").is_not_null() & inside).select("step_id", "request_id").unique()


def stacks_by_request(rec: Recording) -> pl.DataFrame:
    """Folded stacks per (request, phase, step kind): request_id, phase, step_kind, stack, samples."""
    pairs = request_steps(rec.steps(), rec.requests())
    return (
        rec.cpu_stacks()
        .join(pairs, on="step_id")
        .group_by("request_id", "phase", "step_kind", "stack")
        .agg(pl.col("samples").sum())
        .sort("request_id", "samples", descending=[False, True])
    )


def folded(stacks: pl.DataFrame, *by: str) -> pl.DataFrame:
    """The samples of each folded stack, per the `by` columns (none: the whole profile)."""
    return stacks.group_by(*by, "stack").agg(pl.col("samples").sum()).sort([*by, "samples"], descending=True)


def folded_text(stacks: pl.DataFrame) -> str:
    """Brendan Gregg's folded format ("frame;frame;leaf COUNT" per line), what flamegraph.pl,
    speedscope and inferno read."""
    return "".join(f"{s} {n}\n" for s, n in folded(stacks).select(SUMMARY).iter_rows())


def self_shares(stacks: pl.DataFrame, top: int = 10) -> list[tuple[str, float]]:
    """The functions the CPU was in (the leaf of each stack) and their share of the samples."""
    if stacks.height == 0:
        return []
    leaves = (
        stacks.select(pl.col("stack").str.split(";").list.last().alias("function"), "samples")
        .group_by("function")
        .agg(pl.col("samples").sum())
        .sort("samples", "function", descending=[True, False])
    )
    total = int(leaves["samples"].sum())
    return [(f, n / total) for f, n in leaves.head(top).iter_rows()]
