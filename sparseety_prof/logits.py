"""Per-token statistics of raw logits rows (float32, the engine's own values), computed for all
rows of a drain at once: this is the consumer's main per-token cost, so it is vectorised."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .schema import TOP_K

# exp() of values below about -87 is subnormal in float32, and subnormals are ~20x slower here;
# such terms are < 1e-37 of the largest one and change neither the sum nor the entropy.
_EXP_FLOOR = np.float32(-87.0)


@dataclass(frozen=True)
class RowStats:
    log_prob: np.ndarray  # (n,) float64: log-softmax of the row at the chosen token
    top_ids: np.ndarray  # (n, k) int64, most likely first (ties: lower id first)
    top_log_probs: np.ndarray  # (n, k) float64
    entropy: np.ndarray  # (n,) float64, nats


def top_k(rows: np.ndarray, k: int, *, inplace: bool = False) -> np.ndarray:
    """Indices of the k largest values of each row, largest first.

    k argmax passes (over a copy unless `inplace`): about 15 us for a 32,000-entry row here,
    where np.argpartition takes 400 us."""
    work = rows if inplace else rows.copy()
    n = len(work)
    k = min(k, rows.shape[1])
    out = np.empty((n, k), dtype=np.int64)
    ar = np.arange(n)
    for j in range(k):
        i = np.argmax(work, axis=1)
        out[:, j] = i
        work[ar, i] = -np.inf
    return out


def row_stats(rows: np.ndarray, tokens: np.ndarray) -> RowStats:
    """log-softmax of each raw row (before temperature and penalties, as llama-server's n_probs
    defines it), the top-k alternatives and the entropy."""
    rows = np.atleast_2d(np.asarray(rows, dtype=np.float32))
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    m = rows.max(axis=1, keepdims=True)
    z = rows - m
    ar = np.arange(len(rows))
    valid = (tokens >= 0) & (tokens < rows.shape[1])
    lp_z = z[ar, np.clip(tokens, 0, rows.shape[1] - 1)].astype(np.float64)
    zc = np.maximum(z, _EXP_FLOOR)
    e = np.exp(zc)
    # float32 sums: numpy sums a row pairwise, so the relative error stays ~1e-7 (log-probs
    # ~1e-6 off), at a third of the cost of float64 sums
    s = e.sum(axis=1).astype(np.float64)
    lse = np.log(s)
    lp = np.where(valid, lp_z - lse, np.nan)
    # H = -sum p log p = lse - sum(e * z) / s (clamped terms are ~0 either way);
    # (e * zc).sum, not a BLAS dot: see __init__.py
    e *= zc
    entropy = lse - e.sum(axis=1).astype(np.float64) / s
    top = top_k(z, TOP_K, inplace=True)  # z is not needed after this
    top_lp = (rows[ar[:, None], top] - m).astype(np.float64) - lse[:, None]
    return RowStats(lp, top, top_lp, entropy)
