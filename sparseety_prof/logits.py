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
    where np.argpartition takes 400 us. In place, the row is left as it was."""
    return _top_k(rows if inplace else rows.copy(), k)[0]


def _top_k(work: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, values) of the k largest of each row; `work` is restored afterwards."""
    n = len(work)
    k = min(k, work.shape[1])
    idx = np.empty((n, k), dtype=np.int64)
    vals = np.empty((n, k), dtype=work.dtype)
    ar = np.arange(n)
    for j in range(k):
        i = np.argmax(work, axis=1)
        idx[:, j] = i
        vals[:, j] = work[ar, i]
        work[ar, i] = -np.inf
    work[ar[:, None], idx] = vals
    return idx, vals


def row_stats(rows: np.ndarray, tokens: np.ndarray, *, overwrite: bool = False) -> RowStats:
    """log-softmax of each raw row (before temperature and penalties, as llama-server's n_probs
    defines it), the top-k alternatives and the entropy.

    With `overwrite`, a float32 `rows` array is used as scratch (the consumer's own block copy):
    each pass over a 32,000-entry row costs microseconds, and this is the consumer's largest
    cost per token, so passes and temporaries are kept to a minimum."""
    rows = np.atleast_2d(np.asarray(rows, dtype=np.float32))
    if not overwrite:
        rows = rows.copy()
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    ar = np.arange(len(rows))
    valid = (tokens >= 0) & (tokens < rows.shape[1])
    m = rows.max(axis=1, keepdims=True)
    z = np.subtract(rows, m, out=rows)  # x - max, in place
    lp_z = z[ar, np.clip(tokens, 0, rows.shape[1] - 1)].astype(np.float64)
    top, top_z = _top_k(z, TOP_K)
    zc = np.maximum(z, _EXP_FLOOR, out=z)  # z is not needed after this
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
    top_lp = top_z.astype(np.float64) - lse[:, None]
    return RowStats(lp, top, top_lp, entropy)
