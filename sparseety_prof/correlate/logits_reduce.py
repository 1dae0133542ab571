"""Logits rows reduced to their statistics as soon as they are drained, so that the ring's space
goes back at once and the correlation can run on several drains together.

Why: the logits records are nearly all of what the probes send (about 130 KiB a token at a
32,000-entry vocabulary, against about 4 KiB of everything else). The consumer reads them where
they lie in the ring (RingReader.take by reference) and the ring's space waits for it, so the
ring's size sets how often the consumer has to wake up and correlate: about every half second
with the default 64 MiB ring. With the rows reduced here, a drain keeps only the small records
and each row's statistics, and the ring's space goes back at once; under `--correlate-every`
the recorder then correlates several drains together (session/drain_batches.py), and the ring's
size only bounds a burst.

The statistics are those the correlator computes at take_tables (logit_stats.py: the same C
call on the same floats, so the same values), for the token the sampler call returned. Which
row a sampler call used is decided here as Correlator._on_sample_begin, _on_logits and
_on_sample_end decide it, per (context, thread), in sequence order: a begin starts the call
afresh, a logits record sets its chunk (a later read of the same chunk replaces it), the end
takes the chunks when all of the row's are there. A logits record whose call has not ended by
the end of the drain is copied and reduced with the next drain (at most one call per engine
thread is ever open). Once records were lost (only then does the correlator look for holes in
the sequence numbers), such a record, correlated with the later drains, may leave a hole where
it was: the correlator then marks the sequences of that stretch unsure, the safe side.
The correlator takes each record's statistics where it took its floats
(capture/logits_rows.py StatsRow) and checks that they are of the token row's token.

Needs the C backend (correlate/logits.py row_stats_at): without it, the recorder correlates
every drain as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np

from sparseety_prof.capture import events as ev
from sparseety_prof.capture.logits_rows import LogitsStats
from sparseety_prof.correlate.logits import BACKEND, row_stats_at

_Vals: TypeAlias = Callable[[int], np.ndarray]  # a logits record's index -> its floats

#: `at` of a reduced logits record whose row no sampler call completed (past any table's end)
UNPAIRED = np.uint64(1 << 63)


@dataclass
class _Open:
    """A sampler call not ended yet: the logits records of each chunk read so far (their index
    in the reduce's list) and the vocabulary size the last one gave."""

    chunks: dict[int, int] = field(default_factory=dict)
    n_vocab: int = 0


@dataclass
class _Carried:
    """A logits record held over to the next drain: its header and `at` field, and its floats."""

    ref: np.ndarray  # one LOGITS_REF_DTYPE record
    vals: np.ndarray  # its n_vals floats, owned


class LogitsReducer:
    """Reduces each drain's logits records (EventBatch) to their statistics; see the module."""

    def __init__(self) -> None:
        self._carried: list[_Carried] = []
        self.cpu_s = 0.0  # this thread's CPU time in reduce (meta.json consumer.cpu_s_by_stage logits)
        self.carried = 0  # logits records held over to a later drain
        self.dropped_open = 0  # records of calls still open at the end (never a token row)

    @staticmethod
    def available() -> bool:
        return BACKEND == "c"

    def reduce(self, batch: ev.EventBatch, *, final: bool = False) -> ev.EventBatch:
        """`batch` with its logits records reduced: a new batch, whose other records are
        `batch`'s arrays (valid as long as they are: the caller copies them before the next
        take reuses the drain's memory, session/drain_batches.py). With `final`, records of
        calls still open are dropped: those calls never end, and the correlator never makes
        their rows."""
        t0 = time.thread_time()
        refs, vals_of = self._logits_in(batch)
        jobs, at, open_calls = self._pair(batch.small, refs, batch.logits_chunk)
        stats = self._stats(jobs, refs, vals_of, self._addresses(batch, refs))
        keep = np.ones(len(refs), dtype=bool)
        self._carried = []
        for call in open_calls:
            for li in call.chunks.values():
                keep[li] = False
                if final:
                    self.dropped_open += 1
                else:
                    self._carried.append(_Carried(refs[li : li + 1].copy(), np.array(vals_of(li))))
                    self.carried += 1
        out_refs = refs[keep].copy()
        out_refs["at"] = at[keep]
        out = ev.EventBatch(logits_chunk=batch.logits_chunk)
        for name in GROUPS:
            setattr(out, name, getattr(batch, name))
        out.logits = out_refs
        out.logits_stats = stats
        self.cpu_s += time.thread_time() - t0
        return out

    def _logits_in(self, batch: ev.EventBatch) -> tuple[np.ndarray, _Vals]:
        """The logits records to reduce (the held ones first: they are older) and a way to get
        each one's floats."""
        held = self._carried
        refs = batch.logits if not held else np.concatenate([*(c.ref for c in held), batch.logits])
        n_held = len(held)
        data, chunk = batch.logits_data, batch.logits_chunk

        def vals_of(li: int) -> np.ndarray:
            if li < n_held:
                return held[li].vals
            r = refs[li]
            a = int(r["at"])
            return data[a : a + 4 * chunk].view("<f4")[: int(r["n_vals"])]

        return refs, vals_of

    def _addresses(self, batch: ev.EventBatch, refs: np.ndarray) -> np.ndarray:
        """Each logits record's floats' address (the held ones' in their copies), at once: per
        record in Python, the address cost as much as the statistics of its 32,000 floats."""
        n_held = len(self._carried)
        out = np.empty(len(refs), dtype=np.int64)
        for i, c in enumerate(self._carried):
            out[i] = c.vals.ctypes.data
        if len(batch.logits):
            out[n_held:] = batch.logits["at"].astype(np.int64) + batch.logits_data.ctypes.data
        return out

    @staticmethod
    def _pair(
        small: np.ndarray, refs: np.ndarray, chunk_len: int
    ) -> tuple[list[tuple[list[int], int]], np.ndarray, list[_Open]]:
        """Which logits records make whose row: the completed calls ([their records' indices,
        chunk 0 first], the sampled token), each record's `at` (its call's index among them, or
        UNPAIRED), and the calls still open at the end (only those that read logits)."""
        at = np.full(len(refs), UNPAIRED, dtype=np.uint64)
        if not len(refs):
            return [], at, []
        regular = LogitsReducer._pair_regular(small, refs, chunk_len)
        if regular is not None:
            at[:] = np.arange(len(refs), dtype=np.uint64)
            return [([li], t) for li, t in enumerate(regular.tolist())], at, []
        kinds = small["kind"]
        sel = np.flatnonzero((kinds == ev.EV_SAMPLE_BEGIN) | (kinds == ev.EV_SAMPLE_END))
        seq = np.concatenate([small["seq"][sel], refs["seq"]])
        order = np.argsort(seq, kind="stable").tolist()
        n_small = len(sel)
        s_kind, s_ctx = kinds[sel].tolist(), small["ctx"][sel].tolist()
        s_tid, s_a = small["tid"][sel].tolist(), small["a"][sel].tolist()
        l_ctx, l_tid = refs["ctx"].tolist(), refs["tid"].tolist()
        l_chunk, l_vocab = refs["chunk"].tolist(), refs["n_vocab"].tolist()
        calls: dict[tuple[int, int], _Open] = {}
        jobs: list[tuple[list[int], int]] = []
        for o in order:
            if o >= n_small:  # a logits record (Correlator._on_logits)
                li = o - n_small
                chunk = l_chunk[li]
                if chunk >= ev.MAX_LOGITS_CHUNKS:
                    continue
                call = calls.setdefault((l_ctx[li], l_tid[li]), _Open())
                call.chunks[chunk] = li  # a record it replaces stays UNPAIRED
                call.n_vocab = l_vocab[li]
                continue
            key = (s_ctx[o], s_tid[o])
            if s_kind[o] == ev.EV_SAMPLE_BEGIN:
                calls.pop(key, None)  # its records, if any, are replaced (UNPAIRED)
                continue
            done = calls.pop(key, None)  # EV_SAMPLE_END (Correlator._on_sample_end)
            if done is None or not done.chunks:
                continue
            n_chunks = -(-done.n_vocab // chunk_len)
            if len(done.chunks) != n_chunks or any(k not in done.chunks for k in range(n_chunks)):
                continue  # incomplete: the correlator counts it
            rows = [done.chunks[k] for k in range(n_chunks)]
            at[rows] = len(jobs)
            jobs.append((rows, s_a[o]))
        return jobs, at, [c for c in calls.values() if c.chunks]

    @staticmethod
    def _pair_regular(small: np.ndarray, refs: np.ndarray, chunk_len: int) -> np.ndarray | None:
        """_pair's answer at once when every logits record is the common case, else None: a row
        of one record (chunk 0 of at most chunk_len floats), whose call ends right after it (the
        next begin or end of its context and thread, in sequence order, is an end) and that
        follows no other logits record of that call. Each record then makes its own row, for
        its end's token. (A call cut by the drain, a row of several records or read twice:
        the loop.)"""
        kinds = small["kind"]
        sel = np.flatnonzero((kinds == ev.EV_SAMPLE_BEGIN) | (kinds == ev.EV_SAMPLE_END))
        n_small, n = len(sel), len(sel) + len(refs)
        ctx = np.concatenate([small["ctx"][sel], refs["ctx"]])
        tid = np.concatenate([small["tid"][sel], refs["tid"]])
        kind = np.concatenate([kinds[sel], np.full(len(refs), ev.EV_LOGITS, dtype=kinds.dtype)])
        seq = np.concatenate([small["seq"][sel], refs["seq"]])
        order = np.lexsort((seq, tid, ctx))
        where = np.empty(n, dtype=np.int64)
        where[order] = np.arange(n)
        p = where[n_small:]  # each logits record's place in that order
        if p.max() + 1 >= n:
            return None  # the last of all: its call has not ended
        nxt, prv = p + 1, p - 1
        o_ctx, o_tid, o_kind = ctx[order], tid[order], kind[order]
        ends_next = (o_ctx[nxt] == o_ctx[p]) & (o_tid[nxt] == o_tid[p]) & (o_kind[nxt] == ev.EV_SAMPLE_END)
        prv_c = np.maximum(prv, 0)
        after_logits = (prv >= 0) & (o_ctx[prv_c] == o_ctx[p]) & (o_tid[prv_c] == o_tid[p])
        after_logits &= o_kind[prv_c] == ev.EV_LOGITS
        n_vocab = refs["n_vocab"]
        ok = ends_next & ~after_logits & (refs["chunk"] == 0) & (n_vocab >= 1) & (n_vocab <= chunk_len)
        if not ok.all():
            return None
        return np.asarray(small["a"][sel][order[nxt]], dtype=np.int64)

    @staticmethod
    def _stats(
        jobs: list[tuple[list[int], int]], refs: np.ndarray, vals_of: _Vals, addr: np.ndarray
    ) -> LogitsStats:
        """The statistics of each completed call's row, in the order of `jobs`: rows of one
        record read where they lie (`addr`), rows of several put together first."""
        if not jobs:
            return LogitsStats.empty()
        n_vals = refs["n_vals"].tolist()
        firsts = [rows[0] for rows, _ in jobs]
        tokens_all = np.array([t for _, t in jobs], dtype=np.int64)
        widths = np.array(
            [n_vals[rows[0]] if len(rows) == 1 else sum(n_vals[li] for li in rows) for rows, _ in jobs]
        )
        parts: list[tuple[np.ndarray, LogitsStats]] = []
        for width in np.unique(widths).tolist():
            which = np.flatnonzero(widths == width)
            addresses = addr[np.asarray(firsts)[which]]
            keep_alive: list[np.ndarray] = []
            for j, w in enumerate(which.tolist()):
                rows = jobs[w][0]
                if len(rows) > 1:
                    row = np.concatenate([vals_of(li) for li in rows])
                    keep_alive.append(row)
                    addresses[j] = row.ctypes.data
            tokens = tokens_all[which]
            st = row_stats_at(addresses, int(width), tokens)
            # Read after the call, so that the joined rows live until it returns: the compiled
            # correlator (mypyc) drops a reference after its last use, and a list only appended
            # to would be freed before the C code reads the rows through their addresses.
            keep_alive.clear()
            parts.append((which, LogitsStats(tokens, st.log_prob, st.top_ids, st.top_log_probs, st.entropy)))
        if len(parts) == 1:
            return parts[0][1]
        table = LogitsStats.concat([p for _, p in parts])
        order = np.argsort(np.concatenate([w for w, _ in parts]), kind="stable")
        return LogitsStats(
            table.token[order],
            table.log_prob[order],
            table.top_ids[order],
            table.top_log_probs[order],
            table.entropy[order],
        )


#: EventBatch's record arrays other than the logits records
GROUPS = (
    "small",
    "ubatch",
    "ubatch_s",
    "tensor_s",
    "tensor_l",
    "act",
    "act_mask",
    "attn",
    "step_agg",
    "http",
)
