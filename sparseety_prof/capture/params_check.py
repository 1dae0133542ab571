"""The `ggml_compute_params` offsets (ith, nth) the sparse-decision probes read, checked on raw
copies of the params of live compute calls (the layout-discovery pass copies them at
ggml_compute_forward_get_rows, on every compute thread).

Invariant: 0 <= ith < nth <= MAX_THREADS on every call. The table's offsets are kept when it
holds; otherwise the one other pair for which it holds, more strictly (see _holds), is used.
Which OS thread gets which ith is not checked: the thread calling decode is ith 0 and may change.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_THREADS = 1024
RECORD = 24  # struct dsc_params: tid u32, ok u32, raw[16]
WORDS = 4  # int32 words of the copy


@dataclass(frozen=True)
class ParamsVerdict:
    offsets: tuple[int, int] | None  # (ith, nth)
    calls: int  # compute calls the verdict was made on
    source: str  # "table, verified on live data" | "discovered on live data" | why none


def parse(records: list[bytes]) -> list[tuple[int, tuple[int, ...]]]:
    """(thread id, the params' first int32 words) of every readable copy."""
    out = []
    for r in records:
        if len(r) >= RECORD and int.from_bytes(r[4:8], "little"):
            words = tuple(
                int.from_bytes(r[8 + 4 * i : 12 + 4 * i], "little", signed=True) for i in range(WORDS)
            )
            out.append((int.from_bytes(r[0:4], "little"), words))
    return out


def _holds(calls: list[tuple[int, tuple[int, ...]]], ith_at: int, nth_at: int, *, strict: bool) -> str | None:
    """None when (ith, nth) at these word indices is consistent on every call, else the invariant
    that failed. `strict` (a pair other than the table's) also asks that nth take at most two
    values (llama.cpp's n_threads and n_threads_batch) and, where it is above 1, that more than
    one ith was seen (with one thread, any zero word next to nth would fit)."""
    for _, w in calls:
        ith, nth = w[ith_at], w[nth_at]
        if not 0 <= ith < nth <= MAX_THREADS:
            return f"0 <= ith < nth <= {MAX_THREADS} (ith={ith}, nth={nth})"
    if strict:
        nths = {w[nth_at] for _, w in calls}
        if len(nths) > 2:
            return f"nth one of n_threads, n_threads_batch (seen {sorted(nths)[:4]})"
        if max(nths) > 1 and len({w[ith_at] for _, w in calls}) < 2:
            return "more than one ith seen where nth > 1"
    return None


def check_params(records: list[bytes], table: tuple[int, int]) -> ParamsVerdict:
    calls = parse(records)
    if not calls:
        return ParamsVerdict(None, 0, "not checked: no CPU compute call copied")
    ti, tn = table[0] // 4, table[1] // 4
    failed = _holds(calls, ti, tn, strict=False)
    if failed is None:
        return ParamsVerdict(table, len(calls), "table, verified on live data")
    fits = [
        (i, n)
        for i in range(WORDS)
        for n in range(WORDS)
        if i != n and _holds(calls, i, n, strict=True) is None
    ]
    if len(fits) == 1:
        i, n = fits[0]
        return ParamsVerdict(
            (4 * i, 4 * n), len(calls), f"discovered on live data (the table's failed: {failed})"
        )
    return ParamsVerdict(
        None, len(calls), f"invariant failed at the table's offsets: {failed}; {len(fits)} other pairs fit"
    )
