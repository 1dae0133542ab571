"""Per-token statistics of one raw logits row (float32, the engine's own values)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .schema import TOP_K


@dataclass(frozen=True)
class RowStats:
    log_prob: float
    top_ids: list[int]
    top_log_probs: list[float]
    entropy: float


def row_stats(row: np.ndarray, token_id: int) -> RowStats:
    """log-softmax of the raw row in float64 (before temperature and penalties, as the issue and
    llama-server's n_probs define it), the top-k alternatives and the entropy in nats."""
    x = row.astype(np.float64)
    m = float(np.max(x))
    z = x - m
    lse = float(np.log(np.sum(np.exp(z))))
    lp = z - lse
    k = min(TOP_K, len(lp))
    top = np.argpartition(-lp, k - 1)[:k]
    top = top[np.lexsort((top, -lp[top]))]  # by log-prob desc, ties by id
    p = np.exp(lp)
    entropy = float(-np.sum(p * lp))
    tok_lp = float(lp[token_id]) if 0 <= token_id < len(lp) else float("nan")
    return RowStats(tok_lp, [int(i) for i in top], [float(lp[i]) for i in top], entropy)
