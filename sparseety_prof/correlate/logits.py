"""Per-token statistics of raw logits rows (float32, the engine's own values), computed for all
rows of a drain at once: this is the consumer's main per-token cost.

Two implementations of the same contract: a small C library (sparseety_prof/native/rowstats.c,
built by sparseety_prof/native/build.sh, two passes over each row) when it is built, and numpy
(the reference, ten passes) otherwise. `BACKEND` says which one `row_stats` uses."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from sparseety_prof.capture.resources import native_library
from sparseety_prof.store.schema import TOP_K

# exp() of values below about -87 is subnormal in float32, and subnormals are far slower here;
# such terms are < 1e-37 of the largest one and change neither the sum nor the entropy.
_EXP_FLOOR = np.float32(-87.0)

# Built next to this module by sparseety_prof/native/build.sh (scripts/setup.sh runs it). Never
# compiled at import: without it, row_stats quietly uses numpy.
LIB_PATH = native_library("librowstats.so")
_ABI_VERSION = 2  # must match RS_ABI_VERSION in rowstats.c
_MAX_K = 16  # RS_MAX_K in rowstats.c


@dataclass(frozen=True)
class RowStats:
    log_prob: np.ndarray  # (n,) float64: log-softmax of the row at the chosen token
    top_ids: np.ndarray  # (n, k) int64, most likely first (ties: lower id first)
    top_log_probs: np.ndarray  # (n, k) float64
    entropy: np.ndarray  # (n,) float64, nats


def _load_library(path: Path) -> ctypes.CDLL | None:
    """The C backend at `path`, or None when it is missing, does not load, or is of another ABI
    version (a stale build): the caller then falls back to numpy."""
    try:
        lib = ctypes.CDLL(str(path))
        lib.sparseety_rowstats_abi.restype = ctypes.c_int
        lib.sparseety_rowstats_abi.argtypes = []
        if lib.sparseety_rowstats_abi() != _ABI_VERSION:
            return None
        fn = lib.sparseety_rowstats
        fn_ptrs = lib.sparseety_rowstats_ptrs
        level = lib.sparseety_rowstats_level
    except (OSError, AttributeError):
        return None
    # pointers as plain integers: numpy's ndpointer checks cost more than the row, and row_stats
    # makes the arrays itself
    p = ctypes.c_void_p
    i64 = ctypes.c_int64
    for f in (fn, fn_ptrs):
        f.argtypes = [p, i64, i64, p, i64, p, p, p, p, ctypes.c_int]
        f.restype = ctypes.c_int
    level.argtypes = []
    level.restype = ctypes.c_int
    return lib


_lib = _load_library(LIB_PATH)
BACKEND: Literal["c", "numpy"] = "c" if _lib is not None else "numpy"


def native_level() -> int | None:
    """The x86-64 level the C backend runs at on this CPU (4: AVX-512, 3: AVX2+FMA, 1: baseline
    SSE2 or another architecture), None without the library."""
    return None if _lib is None else int(_lib.sparseety_rowstats_level())


def _addr(a: np.ndarray) -> int:
    """Address of a C-contiguous array's data. ndarray.ctypes.data builds a helper object; a
    ctypes view of a writable buffer costs a fraction of that, and there are six per call."""
    if a.flags.writeable:
        # numpy arrays are buffers, but numpy does not declare it to type checkers
        return ctypes.addressof(ctypes.c_char.from_buffer(a))  # type: ignore[arg-type]
    return int(a.ctypes.data)


def top_k(rows: np.ndarray, k: int, *, inplace: bool = False) -> np.ndarray:
    """Indices of the k largest values of each row, largest first.

    k argmax passes (over a copy unless `inplace`): for a vocabulary-sized row far cheaper than
    np.argpartition (docs/overhead.md). In place, the row is left as it was."""
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
    # Once a row's largest remaining value is -inf (masked tokens), argmax keeps returning the
    # first -inf entry, which may be one picked before: the rest of the list is the row's lowest
    # -inf ids (none picked yet, as everything picked before was larger). Fixed before restoring,
    # where a repeated id would write -inf over a picked value.
    for r in np.flatnonzero(np.isneginf(vals[:, -1])):
        j0 = int(np.argmax(np.isneginf(vals[r])))
        work[r, idx[r, :j0]] = vals[r, :j0]
        idx[r, j0:] = np.flatnonzero(np.isneginf(work[r]))[: k - j0]
    work[ar[:, None], idx] = vals
    return idx, vals


def row_stats(rows: np.ndarray, tokens: np.ndarray, *, overwrite: bool = False) -> RowStats:
    """log-softmax of each raw row (before temperature and penalties, as llama-server's n_probs
    defines it), the top-k alternatives and the entropy.

    With `overwrite`, a float32 `rows` array may be used as scratch (the consumer's own block
    copy; only the numpy backend does). The C backend when it is built, numpy otherwise."""
    if _lib is not None:
        return _row_stats_c(_lib, rows, tokens)
    return _row_stats_numpy(rows, tokens, overwrite=overwrite)


def row_stats_at(addresses: np.ndarray, width: int, tokens: np.ndarray, *, level: int = 0) -> RowStats:
    """row_stats of rows that lie anywhere in memory: `addresses` (int64) holds the address of
    each row's `width` float32 values, which must stay alive and unchanged during the call. C
    backend only (check BACKEND): it spares the consumer a copy of every logits row."""
    if _lib is None:
        raise RuntimeError("row_stats_at needs the C backend (sparseety_prof/native/build.sh)")
    addresses = np.ascontiguousarray(addresses, dtype=np.int64).reshape(-1)
    tokens = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64).reshape(-1))
    if width <= 0 or len(tokens) != len(addresses):
        raise ValueError(f"row_stats_at: {len(addresses)} rows, {len(tokens)} tokens, width {width}")
    return _call_c(_lib.sparseety_rowstats_ptrs, addresses, len(addresses), width, tokens, level)


def _row_stats_c(lib: ctypes.CDLL, rows: np.ndarray, tokens: np.ndarray, *, level: int = 0) -> RowStats:
    """row_stats through rowstats.c: one call for the whole block, as the call itself costs a few
    microseconds. The rows are only read. `level` forces an instruction-set level (tests); 0 picks
    the best this CPU has."""
    rows = np.ascontiguousarray(np.atleast_2d(rows), dtype=np.float32)
    tokens = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64).reshape(-1))
    if rows.ndim != 2 or rows.shape[1] == 0 or len(tokens) != len(rows):
        # shapes the C side does not take: numpy raises (or copes) as it always has
        return _row_stats_numpy(rows, tokens)
    n, width = rows.shape
    return _call_c(lib.sparseety_rowstats, rows, n, width, tokens, level)


def _call_c(fn: Any, rows: np.ndarray, n: int, width: int, tokens: np.ndarray, level: int) -> RowStats:
    k = min(TOP_K, width, _MAX_K)
    lp = np.empty(n, np.float64)
    top = np.empty((n, k), np.int64)
    top_lp = np.empty((n, k), np.float64)
    entropy = np.empty(n, np.float64)
    if n:
        rc = fn(
            _addr(rows),
            n,
            width,
            _addr(tokens),
            k,
            _addr(lp),
            _addr(top),
            _addr(top_lp),
            _addr(entropy),
            level,
        )
        if rc != 0:  # -1: arguments (checked by the callers), -2: a forced level this CPU lacks
            raise ValueError(f"sparseety_rowstats returned {rc} (n={n} width={width} k={k} level={level})")
    return RowStats(lp, top, top_lp, entropy)


def _row_stats_numpy(rows: np.ndarray, tokens: np.ndarray, *, overwrite: bool = False) -> RowStats:
    """The numpy implementation: the reference for the C backend, and the fallback without it.

    Each pass over a 32,000-entry row costs microseconds, so passes and temporaries are kept to
    a minimum; with `overwrite`, a float32 `rows` array is used as scratch."""
    rows = np.atleast_2d(np.asarray(rows, dtype=np.float32))
    if not overwrite:
        rows = rows.copy()
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if rows.shape[1] == 0:
        raise ValueError("row_stats: rows of zero width")
    ar = np.arange(len(rows))
    valid = (tokens >= 0) & (tokens < rows.shape[1])
    # top-k on the raw values (ties to the lower id, as the reference orders them), which also gives
    # the max; log-probs from raw values in float64, where x - max is exact (float32 x - max is
    # not, far below the max: ~1e-3 off at a log-prob of -5e4)
    top, top_x = _top_k(rows, TOP_K)
    m = top_x[:, :1]
    m64 = m.astype(np.float64)
    x_tok = rows[ar, np.clip(tokens, 0, rows.shape[1] - 1)].astype(np.float64)
    z = np.subtract(rows, m, out=rows)  # x - max, in place
    zc = np.maximum(z, _EXP_FLOOR, out=z)  # z is not needed after this
    e = np.exp(zc)
    # float32 sums: numpy sums a row pairwise, so the relative error stays ~1e-7 (log-probs
    # ~1e-6 off), at a third of the cost of float64 sums
    s = e.sum(axis=1).astype(np.float64)
    lse = np.log(s)
    lp = np.where(valid, (x_tok - m64[:, 0]) - lse, np.nan)
    # H = -sum p log p = lse - sum(e * z) / s (clamped terms are ~0 either way);
    # (e * zc).sum, not a BLAS dot: see __init__.py
    e *= zc
    entropy = lse - e.sum(axis=1).astype(np.float64) / s
    top_lp = (top_x.astype(np.float64) - m64) - lse[:, None]
    return RowStats(lp, top, top_lp, entropy)
