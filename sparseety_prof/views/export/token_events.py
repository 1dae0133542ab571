"""One event per token in the brief's shape: the token and every sparse decision made for it in
one JSON object (identity, token, sampling, routing, activation sparsity, attention/KV, batch
context, timing), as the `jsonl` export writes it and the `perfetto` export attaches to each
token slice.

Per-layer lists are layer-major; each group names the model layers its lists cover (meta.json's
"layers"), or null when the recording does not say. Nulls stay nulls: a recording made with
--redact-text has null token_text, one with --redact ids null token ids, and so on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, BinaryIO

import polars as pl

from sparseety_prof.store.recording import Recording, section
from sparseety_prof.views.export.json_text import dumps

#: rows converted to Python objects at a time
SLICE_ROWS = 4096


def token_rows(rec: Recording) -> pl.DataFrame:
    """The tokens table in its order, with the step's batch (its sequence ids) and the request's
    parent sequence joined on."""
    steps = rec.steps().select("step_id", pl.col("seq_ids").alias("_batch_seq_ids"))
    requests = (
        rec.requests()
        .filter(pl.col("request_id").is_not_null())
        .unique(subset="request_id", keep="first", maintain_order=True)
        .select("request_id", pl.col("parent_seq_id").alias("_parent_seq_id"))
    )
    return (
        rec.tokens()
        .join(steps, on="step_id", how="left", maintain_order="left")
        .join(requests, on="request_id", how="left", maintain_order="left")
    )


class TokenEvents:
    """Builds token events from `token_rows` rows with the recording's constants (model, layers)."""

    def __init__(self, rec: Recording) -> None:
        model = section(rec, "model")
        layers = section(rec, "layers")
        self.model_version = model.get("name") or None
        self.model_sha256 = model.get("sha256") or None
        self.moe_layers = layers.get("moe")
        self.ffn_layers = layers.get("ffn")
        self.attn_layers = layers.get("attn")
        self.act_threshold = rec.meta.get("act_threshold")

    def event(self, r: dict[str, Any]) -> dict[str, Any]:
        return {
            "request_id": r["request_id"],
            "seq_id": r["seq_id"],
            "parent_seq_id": r["_parent_seq_id"],
            "ctx_id": r["ctx_id"],
            "decode_order": r["decode_order"],
            "position": r["pos"],
            "logits_pos": r["logits_pos"],
            "phase": r["phase"],
            "partial": r["partial"],
            "token_id": r["token_id"],
            "token_text": r["token_text"],
            "token_source": r["token_source"],
            "timestamp_unix_ms": r["ts_unix_ms"],
            "model_version": self.model_version,
            "model_sha256": self.model_sha256,
            "sampling": {
                "log_prob": r["log_prob"],
                "entropy": r["entropy"],
                "top_ids": r["top_ids"],
                "top_log_probs": r["top_log_probs"],
            },
            "router": {
                "layers": self.moe_layers,
                "expert_ids": r["expert_ids"],
                "weights": r["expert_weights"],
                "router_probs": r["router_probs"],
            },
            "activation_sparsity": {
                "layers": self.ffn_layers,
                "mlp_zero_ratio": r["act_zero_ratio"],
                "below_threshold_ratio": r["act_below_ratio"],
                "threshold": self.act_threshold,
            },
            "attention": {
                "layers": self.attn_layers,
                "attended": r["attn_attended"],
                "total": r["attn_total"],
                "kv_cells_used": r["kv_cells_used"],
            },
            "batch": {"step_id": r["step_id"], "size": r["batch_size"], "seq_ids": r["_batch_seq_ids"]},
            "time": {"step_start_ns": r["t_start_ns"], "step_end_ns": r["t_end_ns"]},
            "process": {"pid": r["pid"], "tid": r["tid"]},
        }


def iter_rows(df: pl.DataFrame) -> Iterator[dict[str, Any]]:
    """The rows of `df` as dicts, converted a slice at a time."""
    for part in df.iter_slices(n_rows=SLICE_ROWS):
        yield from part.iter_rows(named=True)


def write_jsonl(rec: Recording, out: BinaryIO) -> int:
    """Write one token event per line to `out`; returns the number of lines."""
    events = TokenEvents(rec)
    n = 0
    for part in token_rows(rec).iter_slices(n_rows=SLICE_ROWS):
        lines = [dumps(events.event(r)) for r in part.iter_rows(named=True)]
        if lines:
            out.write(("\n".join(lines) + "\n").encode("ascii"))
        n += len(lines)
    return n
