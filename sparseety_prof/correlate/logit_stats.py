"""The statistics of the token rows' logits rows (log-prob of the token, top ids, entropy),
computed for a whole drain at once when the rows are taken: one C call per block of rows instead
of one per token. Rows reduced when they were drained (correlate/logits_reduce.py) come with
their statistics: they are looked up, for the token they were computed for."""

from __future__ import annotations

import time

import numpy as np

from sparseety_prof.capture.logits_rows import LogitsChunk, LogitsStats, StatsRow
from sparseety_prof.correlate.logits import BACKEND, RowStats, row_stats, row_stats_at
from sparseety_prof.correlate.tables import TOKEN_STATS
from sparseety_prof.store.schema import Columns

STATS_BLOCK = 64  # logits rows per statistics call


class PendingStats:
    """Logits rows waiting for their statistics, by the token row they belong to."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, list[np.ndarray]]] = []  # (token row, logits row chunks)
        # rows of consecutive token rows, each one record's floats: (first token row, the
        # records' bytes, each row's offset there, the rows' width), read where they lie
        self.runs: list[tuple[int, np.ndarray, np.ndarray, int]] = []
        # rows reduced when drained: (token row, its statistics' row), and runs of them
        # (first token row, the table, each row's index there)
        self.reduced: list[tuple[int, StatsRow]] = []
        self.reduced_runs: list[tuple[int, LogitsStats, np.ndarray]] = []
        # reduced rows whose statistics were of another token than the row's (never expected:
        # the token of both is the sampler call's result): left null, counted
        self.token_mismatch = 0
        self._scratch: dict[int, np.ndarray] = {}  # row width -> reused block of rows
        self.cpu_s = 0.0  # the calling thread's CPU time in fill (meta.json consumer.cpu_s_by_stage)

    def add(self, token_row: int, chunks: list[LogitsChunk]) -> None:
        first = chunks[0]
        if isinstance(first, StatsRow):
            self.reduced.append((token_row, first))
        else:
            self.rows.append((token_row, chunks))  # type: ignore[arg-type]  # (all floats then)

    def add_run(self, first_row: int, chunks: list[list[LogitsChunk]]) -> None:
        """add for token rows first_row, first_row + 1, ...: chunks[j] is row j's."""
        for row, ch in zip(range(first_row, first_row + len(chunks)), chunks, strict=True):
            self.add(row, ch)

    def add_run_at(
        self, first_row: int, data: np.ndarray | LogitsStats, offsets: np.ndarray, width: int
    ) -> None:
        """add for token rows first_row, first_row + 1, ... whose logits rows are `width` floats
        at byte `offsets` in `data` (a drain's records: alive until its rows are taken). With
        the C backend, their addresses go to it as they are (no array made per row). Rows
        reduced when drained: `data` is their statistics, `offsets` their rows there."""
        if isinstance(data, LogitsStats):
            self.reduced_runs.append((first_row, data, offsets))
            return
        if BACKEND == "c":
            self.runs.append((first_row, data, offsets, width))
            return
        rows: list[list[LogitsChunk]] = [[data[at : at + 4 * width].view("<f4")] for at in offsets.tolist()]
        self.add_run(first_row, rows)

    def fill(self, tok: Columns) -> None:
        """Set the statistics columns of `tok` (null for rows without a logits row)."""
        t0 = time.thread_time()
        pending, self.rows = self.rows, []
        n = len(tok["token_id"])
        none: list[object] = [None] * n
        log_prob, top_ids, top_lps, entropy = (none.copy() for _ in TOKEN_STATS)
        by_len: dict[int, list[tuple[int, list[np.ndarray]]]] = {}
        for i, chunks in pending:
            by_len.setdefault(sum(len(ch) for ch in chunks), []).append((i, chunks))
        for width, group in by_len.items():
            for b0 in range(0, len(group), STATS_BLOCK):
                block = group[b0 : b0 + STATS_BLOCK]
                toks = np.array([tok["token_id"][i] for i, _ in block], dtype=np.int64)
                st = self._block_stats(width, [chunks for _, chunks in block], toks)
                lps, tops = st.log_prob.tolist(), st.top_ids.tolist()
                tlps, ents = st.top_log_probs.tolist(), st.entropy.tolist()
                for j, (i, _) in enumerate(block):
                    log_prob[i], top_ids[i], top_lps[i], entropy[i] = lps[j], tops[j], tlps[j], ents[j]
        runs, self.runs = self.runs, []
        for first, data, offsets, width in runs:
            addresses = offsets.astype(np.int64) + data.ctypes.data
            toks = np.array(tok["token_id"][first : first + len(offsets)], dtype=np.int64)
            for b0 in range(0, len(offsets), STATS_BLOCK):
                st = row_stats_at(addresses[b0 : b0 + STATS_BLOCK], width, toks[b0 : b0 + STATS_BLOCK])
                a = first + b0
                b = a + len(st.log_prob)
                log_prob[a:b], top_ids[a:b] = st.log_prob.tolist(), st.top_ids.tolist()
                top_lps[a:b], entropy[a:b] = st.top_log_probs.tolist(), st.entropy.tolist()
        self._fill_reduced(tok["token_id"], (log_prob, top_ids, top_lps, entropy))
        tok.update(zip(TOKEN_STATS, (log_prob, top_ids, top_lps, entropy), strict=True))
        self.cpu_s += time.thread_time() - t0

    def _fill_reduced(self, token_ids: list[object], out: tuple[list[object], ...]) -> None:
        """The rows reduced when drained: their statistics, looked up. A statistics row of
        another token than the token row's (or none: j < 0) leaves the row null; the first is
        counted (token_mismatch), the second is what the floats would have given (a row the
        correlator never completes is never added)."""
        log_prob, top_ids, top_lps, entropy = out
        singles, self.reduced = self.reduced, []
        runs, self.reduced_runs = self.reduced_runs, []
        for i, sr in singles:
            if sr.j < 0:
                continue
            t = sr.table
            if int(t.token[sr.j]) != token_ids[i]:
                self.token_mismatch += 1
                continue
            log_prob[i], entropy[i] = float(t.log_prob[sr.j]), float(t.entropy[sr.j])
            top_ids[i], top_lps[i] = t.top_ids[sr.j].tolist(), t.top_log_probs[sr.j].tolist()
        for first, t, offsets in runs:
            if not len(t):
                continue  # no row of the run was complete
            ok = offsets < len(t)  # (unpaired records: past the table's end, compared unsigned)
            js = np.where(ok, offsets, 0).astype(np.int64)
            n = len(js)
            want = np.asarray(token_ids[first : first + n], dtype=np.int64)
            same = ok & (t.token[js] == want)
            self.token_mismatch += int(np.count_nonzero(ok & ~same))
            lps, ents = t.log_prob[js].tolist(), t.entropy[js].tolist()
            tops, tlps = t.top_ids[js].tolist(), t.top_log_probs[js].tolist()
            for j, good in enumerate(same.tolist()):
                if good:
                    i = first + j
                    log_prob[i], top_ids[i], top_lps[i], entropy[i] = lps[j], tops[j], tlps[j], ents[j]

    def _block_stats(self, width: int, rows: list[list[np.ndarray]], toks: np.ndarray) -> RowStats:
        """Statistics of up to STATS_BLOCK rows of `width` floats, each given as its chunks.
        With the C backend a row of one chunk is read where it lies (in the drained records):
        only rows split over several records are put together first."""
        if BACKEND == "c":
            addresses = np.empty(len(rows), dtype=np.int64)
            for j, chunks in enumerate(rows):
                # vocabularies above LOGITS_CHUNK_MAX: the row is put together first
                row = chunks[0] if len(chunks) == 1 else self._joined(width, j, chunks)
                addresses[j] = row.ctypes.data
            return row_stats_at(addresses, width, toks)
        for j, chunks in enumerate(rows):
            self._joined(width, j, chunks)
        return row_stats(self._scratch[width][: len(rows)], toks, overwrite=True)

    def _joined(self, width: int, j: int, chunks: list[np.ndarray]) -> np.ndarray:
        """Row j of the scratch block of `width`-float rows, filled with `chunks`. One block per
        width, kept between drains: a fresh multi-MB array per block costs page faults on every
        write."""
        scratch = self._scratch.get(width)
        if scratch is None:
            scratch = self._scratch[width] = np.empty((STATS_BLOCK, width), dtype=np.float32)
        row = scratch[j]
        off = 0
        for ch in chunks:
            row[off : off + len(ch)] = ch
            off += len(ch)
        return row
