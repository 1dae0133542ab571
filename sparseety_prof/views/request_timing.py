"""Where each request's time went, and the slowest requests and tokens with their step's batch
context: the answers an operator asks a recording first. Computed from the recording's requests,
tokens and steps tables only (store/schema.py), for `report`, `report --json` and the live view.

Per request (a row of the requests table):
  queued   slot launch - bytes received: waiting for a free slot (null where the server's socket
           read was not seen: a front end without one, or a request running before the attach)
  prompt   first token - slot launch: prompt processing (the first token comes from the last
           prompt step)
  decode   last token - first token
  ttft     the requests table's own (first token - received, or - started without a socket read)
  total    last token - received (or - started)
  prompt tok/s  prompt rows computed per second of prompt; decode tok/s  tokens after the first per
           second of decode
Per token: `gap`, the time since the request's previous token (what the client waits for it; null
for a request's first token seen), and its step's batch context: the sequences in the step, the
step's rows, and how many of them were prompt rows (a prompt sharing the step slows its decode)."""

from __future__ import annotations

import polars as pl

#: slowest requests and tokens listed by default
SLOWEST = 5

_NS_PER_MS = 1e6


def _ms(later: str, earlier: str | pl.Expr) -> pl.Expr:
    start = pl.col(earlier) if isinstance(earlier, str) else earlier
    return (pl.col(later) - start) / _NS_PER_MS


def _per_second(count: pl.Expr, ms: pl.Expr) -> pl.Expr:
    return pl.when((ms > 0) & (count > 0)).then(count / (ms / 1e3)).otherwise(None)


def request_times(requests: pl.DataFrame) -> pl.DataFrame:
    """One row per row of the requests table, in its order: where that request's time went."""
    arrived = pl.coalesce("t_received_ns", "t_started_ns")
    prompt_ms = _ms("t_first_token_ns", "t_started_ns")
    decode_ms = _ms("t_last_token_ns", "t_first_token_ns")
    return requests.select(
        "request_id",
        "id_source",
        _ms("t_started_ns", "t_received_ns").alias("queued_ms"),
        prompt_ms.alias("prompt_ms"),
        decode_ms.alias("decode_ms"),
        "ttft_ms",
        _ms("t_last_token_ns", arrived).alias("total_ms"),
        "prompt_tokens",
        "output_tokens",
        _per_second(pl.col("prompt_tokens").cast(pl.Float64), prompt_ms).alias("prompt_tok_s"),
        _per_second((pl.col("output_tokens") - 1).cast(pl.Float64), decode_ms).alias("decode_tok_s"),
        "itl_p50_ms",
        "itl_p99_ms",
        "end_reason",
        "partial",
    )


def token_context(tokens: pl.DataFrame, steps: pl.DataFrame) -> pl.DataFrame:
    """Each token with its gap since the request's previous token and its step's batch context
    (null where the step is not in the steps table)."""
    step_ctx = steps.select(
        "step_id",
        _ms("t_end_ns", "t_start_ns").alias("step_ms"),
        pl.col("seq_ids").list.len().cast(pl.Int32).alias("step_seqs"),
        pl.col("n_tokens").alias("step_rows"),
        pl.col("prompt_rows").alias("step_prompt_rows"),
    ).unique("step_id", keep="first", maintain_order=True)
    return (
        tokens.select("request_id", "decode_order", "token_id", "token_text", "phase", "step_id", "t_end_ns")
        .with_row_index("_row")
        .sort(["request_id", "t_end_ns", "_row"], nulls_last=True)
        .with_columns((pl.col("t_end_ns").diff().over("request_id") / _NS_PER_MS).alias("gap_ms"))
        .join(step_ctx, on="step_id", how="left")
        .sort("_row")
        .drop("_row")
    )


def slowest_tokens(context: pl.DataFrame, n: int = SLOWEST) -> pl.DataFrame:
    """The `n` tokens that kept their request waiting longest (largest gap), slowest first (ties:
    the earlier token, then by request id)."""
    return (
        context.filter(pl.col("gap_ms").is_not_null())
        .sort(["gap_ms", "t_end_ns", "request_id"], descending=[True, False, False])
        .head(n)
    )


def request_context(context: pl.DataFrame) -> pl.DataFrame:
    """Per request, the batch context of its decode tokens (those with a gap): how many there
    were, the mean sequences per step, how many shared their step with prompt rows, and the
    longest gap."""
    decode = context.filter(pl.col("gap_ms").is_not_null())
    return decode.group_by("request_id", maintain_order=True).agg(
        pl.len().alias("decode_steps"),
        pl.col("step_seqs").mean().alias("mean_step_seqs"),
        (pl.col("step_prompt_rows") > 0).sum().alias("steps_with_prompt_rows"),
        pl.col("gap_ms").max().alias("max_gap_ms"),
    )


def slowest_requests(times: pl.DataFrame, context: pl.DataFrame, n: int = SLOWEST) -> pl.DataFrame:
    """The `n` requests with the longest total time, slowest first (ties: by request id), with
    their batch context."""
    ranked = (
        times.filter(pl.col("total_ms").is_not_null())
        .sort(["total_ms", "request_id"], descending=[True, False])
        .head(n)
    )
    return ranked.join(request_context(context), on="request_id", how="left", maintain_order="left")
