"""Turns the probe records of one process into steps and token rows.

Pure consumer-side logic, fed in sequence-number order: no BPF here, so it is unit-tested on
synthetic records. State is kept per engine context (a draft or embedding context in the same
process never mixes with another) and per sequence within it.

Requests. On llama-server (a built binary or xllamacpp), a sequence serves the request whose
task was last launched on its slot (serving.py: HTTP read -> task post -> slot launch), and the
server's own process_token call says which slot each sampled token went to. Other front ends
have no request objects: a sequence starts a new (segmented) request when
  * the engine removed cells of it from its cache (llama_memory_seq_rm with p0 at or before the
    last cached position, or llama_memory_clear), or
  * a forward pass's input for it is not the continuation: not at the next position, or not the
    token sampled last.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import Any

import numpy as np
import numpy.ma

from sparseety_prof.capture import events as ev
from sparseety_prof.capture.drain_index import G_LOGITS, G_SMALL, G_UBATCH, DrainIndex
from sparseety_prof.capture.plans import LayerSet
from sparseety_prof.correlate.agg_record import AggRow, agg_rows_batch
from sparseety_prof.correlate.attention_map import AttentionMap
from sparseety_prof.correlate.logits import BACKEND, RowStats, row_stats, row_stats_at
from sparseety_prof.correlate.serving import ID_SEGMENTED, Launch, RequestAgg, ServingTracker
from sparseety_prof.correlate.step_sparse import Problems, StepSparse
from sparseety_prof.errors import UnsupportedEngineBuild
from sparseety_prof.store.schema import PHASE_DECODE, PHASE_PREFILL, SOURCE_NEXT_INPUT, SOURCE_SAMPLER

_SPARSE_TOKEN_COLUMNS = (
    "expert_ids",
    "expert_weights",
    "router_probs",
    "act_zero_ratio",
    "act_below_ratio",
    "attn_attended",
    "kv_cells_used",
)
_NO_SPARSE: dict[str, object] = dict.fromkeys(_SPARSE_TOKEN_COLUMNS)
_NO_SPARSE_VALUES: tuple[object, ...] = tuple(_NO_SPARSE.values())
# the token table's columns as _emit_token fills them (the statistics and texts come at take_rows)
_TOKEN_ROW = (
    "request_id",
    "ctx_id",
    "seq_id",
    "decode_order",
    "pos",
    "logits_pos",
    "phase",
    "token_id",
    "token_source",
    "step_id",
    "t_start_ns",
    "t_end_ns",
    "ts_unix_ms",
    "batch_size",
    "partial",
    "pid",
    "tid",
    "attn_total",
    *_SPARSE_TOKEN_COLUMNS,
)
VERIFY_UBATCHES = 16  # micro-batches sanity-checked against the layout at attach time
MAX_SEQ_ID = 1 << 16
STATS_BLOCK = 64  # logits rows per statistics call (one C call per block)
_ROW0 = np.zeros(1, dtype=np.int64)
_ROUTE_COLUMNS = (
    "step_id",
    "ctx_id",
    "seq_id",
    "pos",
    "row",
    "layer",
    "expert_ids",
    "expert_weights",
    "router_probs",
    "act_zero_ratio",
    "act_below_ratio",
    "act_values",
)
_ROUTE_VALUES = _ROUTE_COLUMNS[6:]  # per-layer values, as row_values gives them


@dataclass
class Step:
    step_id: int
    ctx_id: int
    decode_id: int
    tid: int
    t_start: int
    t_end: int | None
    token: np.ndarray
    pos: np.ndarray
    seq: np.ndarray
    output: np.ndarray
    n_tokens: int
    truncated: bool
    row_offset: int = 0  # rows [0, row_offset) of a truncated micro-batch were not copied
    decode_rows: int = 0  # rows that feed back a token sampled for their sequence (the rest: prompt)
    sparse: StepSparse | None = None  # routing, activation and attention records of this pass
    _output_index: dict[int, int] | None = None
    _seq_rows: dict[int, np.ndarray] | None = None

    def seq_rows(self) -> dict[int, np.ndarray]:
        """Sequence id -> its row indices (in batch order). One-row steps, the bulk of a decode,
        skip numpy's unique/flatnonzero (microseconds each, per token)."""
        if self._seq_rows is None:
            if len(self.seq) == 1:
                self._seq_rows = {int(self.seq[0]): _ROW0}
            else:
                self._seq_rows = {int(v): np.flatnonzero(self.seq == v) for v in np.unique(self.seq)}
        return self._seq_rows

    def output_index(self) -> dict[int, int]:
        """Batch row -> ordinal among the rows that produce logits (the rows a tensor has when
        the engine computed a layer for output rows only)."""
        if self._output_index is None:
            rows = np.flatnonzero(self.output) + self.row_offset
            self._output_index = {int(r): k for k, r in enumerate(rows)}
        return self._output_index


@dataclass
class SeqState:
    request_id: str
    partial: bool
    max_pos: int
    agg: RequestAgg | None = None  # the request's row-to-be (None once it was emitted)
    launch_serial: int = 0  # server: the slot launch this request came from
    samples: int = 0
    expect_token: int | None = None  # token sampled last, not yet fed back
    next_input_pending: tuple[Step, int] | None = None  # output row awaiting a next_input token


@dataclass
class SampleState:
    idx: int
    tid: int
    chunks: dict[int, np.ndarray] = field(default_factory=dict)
    n_vocab: int = 0
    chunk_len: int = 1


@dataclass
class CtxState:
    ctx_id: int
    decode_id: int = -1
    decode_seen: bool = False
    rows: list[tuple[Step, int] | None] = field(default_factory=list)  # the decode's rows, batch order
    outputs: list[tuple[Step, int]] = field(default_factory=list)  # rows that produce logits
    public_batch: tuple[int, int, int] | None = None  # (n_tokens, tok0, pos0) to verify
    sampler_seen: bool = False
    # micro-batches recorded on this context: a sample before the first one finishes a decode
    # that ran before the probes were in (attach boundary), not one the recording lost
    ubatches_seen: int = 0
    seqs: dict[int, SeqState] = field(default_factory=dict)
    requests: int = 0
    sampling: dict[int, SampleState] = field(default_factory=dict)  # by tid


@dataclass
class Counters:
    samples_unresolved: int = 0  # sampler index that matches no row of the last decode
    logits_incomplete: int = 0  # token rows whose logits row lost a chunk
    verified_ubatches: int = 0
    verified_decodes: int = 0  # micro-batches checked against the public llama_batch
    sparse_unattributed: int = 0  # graph-op records while no (or more than one) micro-batch ran
    sparse_unmapped_rows: int = 0  # tensor rows that match neither the batch nor its outputs
    verified_sparse: int = 0  # routing records checked against the model's expert counts
    slot_tokens_unresolved: int = 0  # server samples whose slot has no output row in the decode
    samples_before_first_step: int = 0  # samples of a decode that ran before the attach


class Correlator:
    def __init__(
        self,
        *,
        pid: int,
        n_vocab: int,
        wall_offset_ns: int,
        texts: Callable[[list[int]], list[str | None]] | None = None,
        layers: LayerSet | None = None,
        n_expert: int = 0,
        n_expert_used: int = 0,
        with_masks: bool = False,
        serving: ServingTracker | None = None,
        slot_tokens: bool = False,
    ) -> None:
        self.pid = pid
        self.n_vocab = n_vocab
        self.wall_offset_ns = wall_offset_ns
        self.texts = texts
        self.ctxs: dict[int, CtxState] = {}
        self.open_steps: dict[int, Step] = {}  # by tid
        self.pending_clears: dict[int, list[tuple[int, int]]] = {}  # by tid: (seq, p0)
        self.next_step_id = 0
        self.counters = Counters()
        self._tokens = _RowBuffer()
        self._pending_rows: list[tuple[int, list[np.ndarray]]] = []  # (token row, logits row chunks)
        self._steps = _RowBuffer()
        self.layers = layers or LayerSet()
        self.n_expert = n_expert
        self.n_expert_used = n_expert_used
        self.with_masks = with_masks
        self.problems = Problems()
        self._agg_pre: dict[int, AggRow] = {}  # this drain's aggregate records, by sequence number
        self.layers_seen: dict[str, set[int]] = {"moe": set(), "ffn": set(), "attn": set()}
        self.attn_map = AttentionMap(self.layers.attn)
        self._routes: dict[str, list[object]] = {}
        self._routes_layout: tuple[list[int], list[int | None], list[int | None], bool] | None = None
        # routes rows of _emit_routes' common case not yet in _routes: (step_id, ctx_id, seq, pos,
        # row, the row's values)
        self._routes_pending: list[tuple[int, int, int, int, int, dict[str, Any]]] = []
        self._masks: dict[str, list[object]] = {}
        self.serving = serving
        # server: a sample waits for the process_token call that names its slot (by thread)
        self.slot_tokens = slot_tokens
        self._deferred: dict[int, tuple[CtxState, int, int, list[np.ndarray] | None]] = {}
        self._requests: dict[str, list[object]] = {}  # finished request rows
        self._stats_scratch: dict[int, np.ndarray] = {}  # row width -> reused block of rows

    # ------------------------------------------------------------------ public
    def feed(self, batch: ev.EventBatch) -> None:
        """Consume one drained batch. Records are processed in sequence-number order: the
        micro-batches of one-row decode steps by `_fast_step`, every other record by its
        handler, as a dict (DrainIndex.record)."""
        idx = DrainIndex(batch)
        # the aggregate records' values, all at once (see agg_rows_batch)
        pre = agg_rows_batch(batch.step_agg, self.layers) if len(batch.step_agg) else None
        self._agg_pre = dict(zip(batch.step_agg["seq"].tolist(), pre, strict=True)) if pre else {}
        kinds, n, i = idx.kinds, len(idx), 0
        while i < n:
            kind = kinds[i]
            if kind == ev.EV_UBATCH:
                nxt = self._fast_step(idx, i)
                if nxt:
                    i = nxt
                    continue
            elif (kind == ev.EV_DECODE_BEGIN or kind == ev.EV_SEQ_RM) and idx.group[i] == G_SMALL:
                # once per token each: from the columns
                r = idx.row[i]
                a, b = idx.col(G_SMALL, "a")[r], idx.col(G_SMALL, "b")[r]
                if kind == ev.EV_DECODE_BEGIN:
                    self._decode_begin(idx.col(G_SMALL, "ctx")[r], a, b, idx.col(G_SMALL, "c")[r])
                else:
                    self._seq_rm(idx.col(G_SMALL, "tid")[r], a, b)
                i += 1
                continue
            handler = _HANDLERS.get(kind)
            if handler is not None:
                handler(self, idx.record(i))
            i += 1
        for c in self.ctxs.values():
            for smp in c.sampling.values():
                smp.chunks = {k: np.array(v) for k, v in smp.chunks.items()}
        for tid, (c, idx_, token, logits) in self._deferred.items():
            if logits is not None:  # views into this drain's batch
                self._deferred[tid] = (c, idx_, token, [np.array(x) for x in logits])

    def take_request_rows(self, *, final: bool = False) -> dict[str, list[object]]:
        """Rows of the requests that ended since the last call; with `final`, every request
        still open too (end_reason "detached" unless one is known)."""
        if final:
            for c in self.ctxs.values():
                for st in c.seqs.values():
                    self._finish_request(st, "detached")
        rows, self._requests = self._requests, {}
        return rows

    def take_rows(self) -> tuple[dict[str, list[object]], dict[str, list[object]]]:
        """Token and step columns produced since the last call."""
        tok, st = self._tokens.take(), self._steps.take()
        self._fill_stats(tok)
        if tok and self.texts is not None:
            tok["token_text"] = list(self.texts([int(t) for t in tok["token_id"]]))  # type: ignore[call-overload]
        return tok, st

    def take_sparse_rows(self) -> tuple[dict[str, list[object]], dict[str, list[object]]]:
        """Routes and masks columns produced since the last call."""
        self._flush_routes()
        routes, masks = self._routes, self._masks
        self._routes, self._masks = {}, {}
        self.counters.sparse_unmapped_rows = self.problems.unmapped_rows
        return routes, masks

    def _fill_stats(self, tok: dict[str, list[object]]) -> None:
        """Statistics of every captured logits row of this drain, in one vectorised pass."""
        pending, self._pending_rows = self._pending_rows, []
        n = len(tok.get("token_id", []))
        for k in ("log_prob", "top_ids", "top_log_probs", "entropy"):
            if n:
                tok[k] = [None] * n
        by_len: dict[int, list[tuple[int, list[np.ndarray]]]] = {}
        for i, chunks in pending:
            by_len.setdefault(sum(len(ch) for ch in chunks), []).append((i, chunks))
        for width, group in by_len.items():
            for b0 in range(0, len(group), STATS_BLOCK):
                block = group[b0 : b0 + STATS_BLOCK]
                toks = np.array([tok["token_id"][i] for i, _ in block], dtype=np.int64)
                st = self._block_stats(width, [chunks for _, chunks in block], toks)
                lps, tops = st.log_prob.tolist(), st.top_ids.tolist()
                top_lps, ents = st.top_log_probs.tolist(), st.entropy.tolist()
                for j, (i, _) in enumerate(block):
                    tok["log_prob"][i] = lps[j]
                    tok["top_ids"][i] = tops[j]
                    tok["top_log_probs"][i] = top_lps[j]
                    tok["entropy"][i] = ents[j]

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
        return row_stats(self._stats_scratch[width][: len(rows)], toks, overwrite=True)

    def _joined(self, width: int, j: int, chunks: list[np.ndarray]) -> np.ndarray:
        """Row j of the scratch block of `width`-float rows, filled with `chunks`. One block per
        width, kept between drains: a fresh multi-MB array per block costs page faults on every
        write."""
        scratch = self._stats_scratch.get(width)
        if scratch is None:
            scratch = self._stats_scratch[width] = np.empty((STATS_BLOCK, width), dtype=np.float32)
        row = scratch[j]
        off = 0
        for ch in chunks:
            row[off : off + len(ch)] = ch
            off += len(ch)
        return row

    # ------------------------------------------------------------------ helpers
    def _ctx(self, ptr: int) -> CtxState:
        st = self.ctxs.get(ptr)
        if st is None:
            st = self.ctxs[ptr] = CtxState(ctx_id=len(self.ctxs))
        return st

    def _wall_ms(self, t_ns: int) -> int:
        return (t_ns + self.wall_offset_ns) // 1_000_000

    @staticmethod
    def _append(cols: dict[str, list[object]], **row: object) -> None:
        for k, v in row.items():
            col = cols.get(k)  # not setdefault: it builds an empty list per call (~25 per row)
            if col is None:
                col = cols[k] = []
            col.append(v)

    # ------------------------------------------------------------------ handlers
    def _fast_step(self, idx: DrainIndex, i: int) -> int:
        """A one-row decode step, the bulk of any generation, handled from the records' columns:
        its micro-batch (record i), aggregate, end, and the sampler call that reads its logits,
        with nothing else between them. The effect is the handlers' (_on_ubatch, _on_step_agg,
        _on_ubatch_end, _on_sample_begin, _on_logits, _on_sample_end), without making each record
        a dict or the row's values numpy arrays. Returns the index after the step's records, or
        0 when anything is unusual (then the handlers take every record as usual)."""
        kinds, n = idx.kinds, len(idx)
        j = i + 1
        agg_at = -1
        if j < n and kinds[j] == ev.EV_STEP_AGG:
            agg_at, j = j, j + 1
        if j + 1 >= n or kinds[j] != ev.EV_UBATCH_END or kinds[j + 1] != ev.EV_SAMPLE_BEGIN:
            return 0
        end_at, begin_at = j, j + 1
        j += 2
        logits_at = j
        while j < n and kinds[j] == ev.EV_LOGITS:
            j += 1
        if j >= n or kinds[j] != ev.EV_SAMPLE_END:
            return 0
        sample_at = j
        if (
            self.counters.verified_ubatches < VERIFY_UBATCHES
            or self.open_steps
            or self.serving is not None
            or self.slot_tokens
        ):
            return 0
        f = idx.fast()
        u = idx.row[i]
        if not f.ub_one_row[u]:
            return 0
        tid, ctx = f.ub_tid[u], f.ub_ctx[u]
        s_tid, s_ctx = f.s_tid, f.s_ctx
        end, begin, sample = idx.row[end_at], idx.row[begin_at], idx.row[sample_at]
        if s_tid[end] != tid or s_tid[begin] != tid or s_tid[sample] != tid:
            return 0
        if s_ctx[begin] != ctx or s_ctx[sample] != ctx:
            return 0
        c = self.ctxs.get(ctx)
        if c is None or not c.sampler_seen or (c.decode_seen and c.rows):
            return 0
        want = f.s_a[begin]  # llama_get_logits_ith's index: this row either way
        if want != -1 and want != 0:
            return 0
        seq, pos, token = f.ub_seq[u], f.ub_pos[u], f.ub_token[u]
        st = c.seqs.get(seq)
        if st is None or pos != st.max_pos + 1 or (st.expect_token is not None and st.expect_token != token):
            return 0
        clears = self.pending_clears.get(tid)
        if clears and any(cs in (-1, seq) and p0 <= st.max_pos for cs, p0 in clears):
            return 0  # the sequence was cut: _segment starts a new request
        pre: AggRow | None = None
        if agg_at >= 0:
            a = idx.row[agg_at]
            if f.agg_tid[a] != tid or f.agg_overlap[a]:
                return 0
            if self._verifying_sparse():
                return 0
            pre = self._agg_pre.get(f.agg_seq[a])
            if pre is None:
                return 0
        logits: list[np.ndarray] | None = None
        if logits_at < sample_at:
            rows = idx.row[logits_at:sample_at]
            for r in rows:
                if f.lg_tid[r] != tid or f.lg_ctx[r] != ctx:
                    return 0
            vals = idx.arrays[G_LOGITS]["vals"]
            n_chunks = -(-f.lg_n_vocab[rows[-1]] // vals.shape[1])
            if len(rows) != n_chunks or any(f.lg_chunk[r] != k for k, r in enumerate(rows)):
                return 0  # incomplete or out of order: _on_sample_end counts it
            logits = [vals[r][: f.lg_n_vals[r]] for r in rows]

        # _on_ubatch
        if not c.decode_seen:
            c.decode_id += 1
        c.ubatches_seen += 1
        ub = idx.arrays[G_UBATCH][u]
        step = Step(
            step_id=self.next_step_id,
            ctx_id=c.ctx_id,
            decode_id=c.decode_id,
            tid=tid,
            t_start=f.ub_ts[u],
            t_end=f.s_ts[end],
            token=ub["token"][:1].copy(),
            pos=ub["pos"][:1].copy(),
            seq=ub["seq_id"][:1].copy(),
            output=ub["output"][:1].copy(),
            n_tokens=1,
            truncated=False,
            _output_index={0: 0},
        )
        self.next_step_id += 1
        self.pending_clears.pop(tid, None)
        # _segment: the sequence continues (with a sampler seen, no next-input token is pending)
        if st.samples > 0:
            step.decode_rows = 1
        st.next_input_pending = None
        st.expect_token = None
        st.max_pos = max(st.max_pos, pos)
        c.rows, c.outputs = [(step, 0)], [(step, 0)]
        # _on_step_agg
        if pre is not None:
            step.sparse = StepSparse.from_pre(pre)
            self.layers_seen["moe"].update(pre.moe_seen)
            self.layers_seen["ffn"].update(pre.ffn_seen)
            self.layers_seen["attn"].update(step.sparse.add_agg_attn_lists(pre.attn, self.layers.attn))
        # _on_ubatch_end
        self._add_step_row(step, 1, PHASE_DECODE, [seq], [token], [pos], [seq], [0])
        if step.sparse is not None:
            self.layers_seen["attn"].update(self.attn_map.observe(step.sparse))
            self._emit_routes(step)
        # _on_sample_begin .. _on_sample_end
        c.sampling.pop(tid, None)
        self._emit_token(c, step, 0, f.s_a[sample], tid, SOURCE_SAMPLER, logits)
        return sample_at + 1

    def _on_decode_begin(self, r: dict[str, Any]) -> None:
        self._decode_begin(int(r["ctx"]), int(r["a"]), int(r["b"]), int(r["c"]))

    def _decode_begin(self, ctx: int, n_tokens: int, token0: int, pos0: int) -> None:
        c = self._ctx(ctx)
        c.decode_id += 1
        c.decode_seen = True
        c.rows, c.outputs = [], []
        c.public_batch = (n_tokens, token0, pos0) if n_tokens >= 0 else None

    def _on_ubatch(self, r: dict[str, Any]) -> None:
        c = self._ctx(int(r["ctx"]))
        tid = int(r["tid"])
        if not c.decode_seen:  # no decode entry seen on this context: one micro-batch per decode
            c.decode_id += 1
            c.rows, c.outputs = [], []
        m = int(r["n_copied"])
        c.ubatches_seen += 1
        step = Step(
            step_id=self.next_step_id,
            ctx_id=c.ctx_id,
            decode_id=c.decode_id,
            tid=tid,
            t_start=int(r["ts_ns"]),
            t_end=None,
            token=np.array(r["token"][:m]),
            pos=np.array(r["pos"][:m]),
            seq=np.array(r["seq_id"][:m]),
            output=np.array(r["output"][:m]),
            n_tokens=int(r["n_tokens"]),
            truncated=bool(int(r["flags"]) & ev.UB_FLAG_TRUNCATED),
            row_offset=int(r["row_offset"]),
        )
        self.next_step_id += 1
        self._verify(c, step, has_tokens=not (int(r["flags"]) & 2))
        self.open_steps[tid] = step
        clears = self.pending_clears.pop(tid, [])
        self._segment(c, step, clears)
        c.rows.extend([None] * step.row_offset)  # batch positions whose rows were not copied
        c.rows.extend((step, i) for i in range(m))
        c.outputs.extend((step, i) for i in range(m) if step.output[i])
        if not c.sampler_seen:  # remember each sequence's last output row for a next_input token
            for i in np.flatnonzero(step.output):
                st = c.seqs.get(int(step.seq[i]))
                if st is not None:
                    st.next_input_pending = (step, int(i))

    def _on_ubatch_end(self, r: dict[str, Any]) -> None:
        step = self.open_steps.pop(int(r["tid"]), None)
        if step is None:
            return
        step.t_end = int(r["ts_ns"])
        groups = step.seq_rows()
        most_rows = max((len(r) for r in groups.values()), default=0)
        self._add_step_row(
            step,
            int(np.count_nonzero(step.output)),
            PHASE_PREFILL if most_rows > 1 else PHASE_DECODE,
            sorted(groups),
            step.token.tolist(),
            step.pos.tolist(),
            step.seq.tolist(),
            (np.flatnonzero(step.output) + step.row_offset).tolist(),
        )
        if step.sparse is not None:
            # layers whose masks were counted where the engine wrote them (graph-op probes gone)
            self.layers_seen["attn"].update(self.attn_map.observe(step.sparse))
            self._emit_routes(step)

    def _add_step_row(
        self,
        step: Step,
        n_outputs: int,
        phase: str,
        seq_ids: list[int],
        token_ids: list[int],
        positions: list[int],
        row_seq_ids: list[int],
        output_rows: list[int],
    ) -> None:
        """The steps table's row of a finished micro-batch (the row's columns are named here only:
        _RowBuffer keeps the order of the first row's)."""
        self._steps.add(
            step_id=step.step_id,
            ctx_id=step.ctx_id,
            decode_id=step.decode_id,
            t_start_ns=step.t_start,
            t_end_ns=step.t_end,
            ts_unix_ms=self._wall_ms(step.t_start),
            n_tokens=step.n_tokens,
            n_outputs=n_outputs,
            phase=phase,
            prompt_rows=step.n_tokens - step.decode_rows,
            decode_rows=step.decode_rows,
            seq_ids=seq_ids,
            token_ids=token_ids,
            positions=positions,
            row_seq_ids=row_seq_ids,
            output_rows=output_rows,
            truncated=step.truncated,
            pid=self.pid,
            tid=step.tid,
        )

    def _route_layout(self) -> tuple[list[int], list[int | None], list[int | None], bool]:
        """The routes table's layers (MoE or FFN, in model order), per layer its index in the
        per-row MoE and FFN value lists, and whether every layer is both (the lists then line
        up with the table's layers): fixed for a recording, computed once."""
        if self._routes_layout is None:
            layers = self.layers
            moe_pos = {layer: k for k, layer in enumerate(layers.moe)}
            ffn_pos = {layer: k for k, layer in enumerate(layers.ffn)}
            all_layers = sorted(set(layers.moe) | set(layers.ffn))
            km_of = [moe_pos.get(layer) for layer in all_layers]
            kf_of = [ffn_pos.get(layer) for layer in all_layers]
            identity = km_of == kf_of == list(range(len(all_layers)))
            self._routes_layout = (all_layers, km_of, kf_of, identity)
        return self._routes_layout

    def _route_columns(self) -> dict[str, list[object]]:
        cols = self._routes
        if not cols:
            for name in _ROUTE_COLUMNS:
                cols[name] = []
        return cols

    def _flush_routes(self) -> None:
        """The routes rows gathered so far by _emit_routes (every layer is MoE and FFN, all
        computed for the row: the common case), one extend per column for all of them."""
        pending, self._routes_pending = self._routes_pending, []
        if not pending:
            return
        all_layers = self._route_layout()[0]
        n_layers = len(all_layers)
        cols = self._route_columns()
        for name, k in (("step_id", 0), ("ctx_id", 1), ("seq_id", 2), ("pos", 3), ("row", 4)):
            cols[name].extend(chain.from_iterable(repeat(p[k], n_layers) for p in pending))
        cols["layer"].extend(all_layers * len(pending))
        for name in _ROUTE_VALUES:
            cols[name].extend(chain.from_iterable(p[5][name] for p in pending))

    def _emit_routes(self, step: Step) -> None:
        """The long form: one row per (batch row, FFN layer) the engine computed, from the same
        per-row values the token rows use (computed once per row). Whole columns are extended at
        once per row: per-value appends were the largest consumer cost of full mode. Rows of the
        common case are gathered and extended once per drain (_flush_routes)."""
        sp = step.sparse
        assert sp is not None
        out_index = step.output_index()
        all_layers, km_of, kf_of, identity = self._route_layout()
        n_layers = len(all_layers)
        cols = self._route_columns()
        for i, (seq, pos) in enumerate(zip(step.seq.tolist(), step.pos.tolist(), strict=True)):
            b = step.row_offset + i
            v = sp.row_values(b, out_index, step.n_tokens, self.layers, self.problems)
            ids_v, w_v, p_v = v["expert_ids"], v["expert_weights"], v["router_probs"]
            zr_v, br_v, nv_v = v["act_zero_ratio"], v["act_below_ratio"], v["act_values"]
            values: dict[str, Sequence[object]]
            if identity and None not in ids_v and None not in zr_v:
                # every layer is MoE and FFN, all computed for this row: the lists as they are
                if not self.with_masks:  # (mask rows follow each routes row: no gathering then)
                    self._routes_pending.append((step.step_id, step.ctx_id, seq, pos, b, v))
                    continue
                keep: Sequence[int] = range(n_layers)
                values = {
                    "layer": all_layers,
                    "expert_ids": ids_v,
                    "expert_weights": w_v,
                    "router_probs": p_v,
                    "act_zero_ratio": zr_v,
                    "act_below_ratio": br_v,
                    "act_values": nv_v,
                }
            else:
                ids = [ids_v[k] if k is not None else None for k in km_of]
                zr = [zr_v[k] if k is not None else None for k in kf_of]
                # a layer not computed for this row (or not captured) gets no row: none is invented
                keep = [j for j in range(n_layers) if ids[j] is not None or zr[j] is not None]
                if not keep:
                    continue
                values = {
                    "layer": list(all_layers),
                    "expert_ids": ids,
                    "expert_weights": [w_v[k] if k is not None else None for k in km_of],
                    "router_probs": [p_v[k] if k is not None else None for k in km_of],
                    "act_zero_ratio": zr,
                    "act_below_ratio": [br_v[k] if k is not None else None for k in kf_of],
                    "act_values": [nv_v[k] if zr[j] is not None else None for j, k in enumerate(kf_of)],
                }
                if len(keep) < n_layers:
                    values = {k: [vals[j] for j in keep] for k, vals in values.items()}
            self._flush_routes()  # rows keep the order of their steps
            n = len(keep)
            for name, value in (
                ("step_id", step.step_id),
                ("ctx_id", step.ctx_id),
                ("seq_id", seq),
                ("pos", pos),
                ("row", b),
            ):
                cols[name].extend([value] * n)
            for name, vals in values.items():
                cols[name].extend(vals)
            if self.with_masks:
                self._emit_masks(step, sp, seq, pos, b, keep, out_index)

    def _emit_masks(
        self,
        step: Step,
        sp: StepSparse,
        seq: int,
        pos: int,
        b: int,
        keep: Iterable[int],
        out_index: dict[int, int],
    ) -> None:
        """Rows of the masks table for batch row b, for the routes layers at indices `keep`."""
        all_layers = self._route_layout()[0]
        for j in keep:
            layer = all_layers[j]
            bits = sp.act_mask_bits(layer, b, out_index, step.n_tokens)
            if bits is not None:
                self._append(
                    self._masks,
                    step_id=step.step_id,
                    ctx_id=step.ctx_id,
                    seq_id=seq,
                    pos=pos,
                    row=b,
                    layer=layer,
                    n_values=len(bits),
                    nonzero_bits=np.packbits(bits).tobytes(),
                )

    def _on_step_agg(self, r: dict[str, Any]) -> None:
        """The aggregate of a one-row micro-batch, sent by its own thread before its end record.
        Records of layers that did not fit it (e.g. attention) may have come before: merge."""
        step = self.open_steps.get(int(r["tid"]))
        if step is None or int(r["overlap"]):
            self.counters.sparse_unattributed += 1
            return
        verifying = self._verifying_sparse()
        pre = self._agg_pre.get(int(r["seq"]))
        if not verifying and (step.sparse is None or not step.sparse.from_records):
            # the common case (nothing but maybe attention records came before): the row's
            # values straight off the record
            if pre is not None:
                agg, moe_seen, ffn_seen = StepSparse.from_pre(pre), pre.moe_seen, pre.ffn_seen
            else:
                agg, moe_seen, ffn_seen = StepSparse.from_agg_row(r, self.layers)
        else:  # per-layer stores: checked against the model, or merged with per-layer records
            agg = StepSparse.from_agg(r)
            moe_seen, ffn_seen = list(agg.ids), list(agg.act_zeros)
            if agg.ids:
                self._verify_routing(agg)
        if step.sparse is None:
            step.sparse = agg
        else:
            step.sparse.merge(agg)
        self.layers_seen["moe"].update(moe_seen)
        self.layers_seen["ffn"].update(ffn_seen)
        if pre is not None:
            self.layers_seen["attn"].update(step.sparse.add_agg_attn_lists(pre.attn, self.layers.attn))
        else:
            self.layers_seen["attn"].update(step.sparse.add_agg_attn(r, self.layers.attn))

    def _on_sparse(self, r: dict[str, Any]) -> None:
        """A graph-op record belongs to the micro-batch running when it was produced. Worker
        threads carry no context, so this needs exactly one micro-batch in flight."""
        if len(self.open_steps) != 1:
            self.counters.sparse_unattributed += 1
            return
        step = next(iter(self.open_steps.values()))
        if step.sparse is None:
            step.sparse = StepSparse()
        kind = int(r["kind"])
        if kind == ev.EV_TENSOR:
            got = step.sparse.add_tensor(r)
            if got is not None and int(r["tag"]) == ev.TAG_EXPERT_IDS:
                self._verify_routing(step.sparse)
            section = "moe"
        elif kind in (ev.EV_ACT, ev.EV_ACT_MASK):
            got = step.sparse.add_act(r, with_bits=kind == ev.EV_ACT_MASK)
            section = "ffn"
        else:
            got = step.sparse.add_attn(r, self.layers.attn)
            section = "attn"
        if got is not None:
            self.layers_seen[section].add(got[1])

    def _verifying_sparse(self) -> bool:
        """The first aggregate records of an MoE model are still checked against the model."""
        return self.counters.verified_sparse < VERIFY_UBATCHES and bool(self.n_expert)

    def _verify_routing(self, sp: StepSparse) -> None:
        """The first routing tensors are checked against the model: k values per row, expert ids
        in range. A tensor layout read wrongly fails here instead of recording garbage."""
        if self.counters.verified_sparse >= VERIFY_UBATCHES or not self.n_expert:
            return
        problems = []
        for layer, rows in sp.ids.items():
            k = rows.values.shape[1]
            if self.n_expert_used and k != self.n_expert_used:
                problems.append(f"layer {layer}: {k} experts per row, the model selects {self.n_expert_used}")
            filled = rows.values[rows.filled]
            if filled.size and (filled.min() < 0 or filled.max() >= self.n_expert):
                problems.append(f"layer {layer}: expert ids outside [0, {self.n_expert})")
        if problems:
            raise _failed_verification("routing tensors", problems[:3])
        self.counters.verified_sparse += 1

    def _on_sample_begin(self, r: dict[str, Any]) -> None:
        c = self._ctx(int(r["ctx"]))
        c.sampler_seen = True
        c.sampling[int(r["tid"])] = SampleState(idx=int(r["a"]), tid=int(r["tid"]))

    def _on_logits(self, r: dict[str, Any]) -> None:
        c = self._ctx(int(r["ctx"]))
        s = c.sampling.get(int(r["tid"]))
        if s is None:
            return
        n = int(r["n_vals"])
        # a view into the drained batch, valid until the next drain; feed() copies the chunks of
        # sampler calls still open when it returns (take_rows uses the others before then)
        s.chunks[int(r["chunk"])] = r["vals"][:n]
        s.n_vocab = int(r["n_vocab"])
        s.chunk_len = len(r["vals"])

    def _on_sample_end(self, r: dict[str, Any]) -> None:
        c = self._ctx(int(r["ctx"]))
        tid = int(r["tid"])
        s = c.sampling.pop(tid, None)
        if c.ubatches_seen == 0:
            # the decode this sample finishes ran before the probes were attached: the
            # recording starts at the next one (counted, and not a loss of the recording)
            self.counters.samples_before_first_step += 1
            return
        idx = s.idx if s is not None else int(r["c"])
        logits = None
        if s is not None and s.chunks:
            n_chunks = -(-s.n_vocab // s.chunk_len)
            if len(s.chunks) == n_chunks:
                logits = [s.chunks[k] for k in range(n_chunks)]
            else:
                self.counters.logits_incomplete += 1
        if self.slot_tokens:
            # the server's process_token call for this sample names its slot: wait for it (a
            # sample it never hands to a slot is emitted by batch index when the next comes)
            self._flush_deferred(tid)
            self._deferred[tid] = (c, idx, int(r["a"]), logits)
            return
        self._emit_sample(c, idx, int(r["a"]), tid, logits)

    def _emit_sample(
        self,
        c: CtxState,
        idx: int,
        token: int,
        tid: int,
        logits: list[np.ndarray] | None,
        slot: int | None = None,
    ) -> None:
        where = self._resolve(c, idx)
        if slot is not None and (where is None or int(where[0].seq[where[1]]) != slot):
            # the batch index does not lead to the slot's row (the micro-batch was split and
            # reordered by sequence): the slot's only output row of this decode is the one
            mine = [(st, i) for st, i in c.outputs if int(st.seq[i]) == slot]
            where = mine[0] if len(mine) == 1 else None
            if where is None:
                self.counters.slot_tokens_unresolved += 1
                return
        if where is None:
            self.counters.samples_unresolved += 1
            return
        step, i = where
        self._emit_token(c, step, i, token, tid, SOURCE_SAMPLER, logits)

    def _flush_deferred(self, tid: int) -> None:
        d = self._deferred.pop(tid, None)
        if d is not None:
            c, idx, token, logits = d
            self._emit_sample(c, idx, token, tid, logits)

    # ---- serving context (llama-server)
    def _on_http(self, r: dict[str, Any]) -> None:
        if self.serving is not None:
            self.serving.on_http(int(r["tid"]), int(r["ts_ns"]), r["data"])

    def _on_task_post(self, r: dict[str, Any]) -> None:
        if self.serving is not None:
            self.serving.on_task_post(int(r["tid"]), int(r["a"]), int(r["b"]) == 1, int(r["ptr"]))

    def _on_slot_launch(self, r: dict[str, Any]) -> None:
        if self.serving is not None:
            self.serving.on_slot_launch(int(r["ts_ns"]), int(r["a"]), int(r["b"]))

    def _on_slot_child(self, r: dict[str, Any]) -> None:
        if self.serving is not None:
            self.serving.on_slot_child(int(r["a"]), int(r["c"]), int(r["b"]))

    def _on_slot_release(self, r: dict[str, Any]) -> None:
        """The slot finished its request: emit the request's row now."""
        self._flush_deferred(int(r["tid"]))
        launch = self.serving.slots.get(int(r["a"])) if self.serving is not None else None
        if launch is None:
            return
        for c in self.ctxs.values():
            st = c.seqs.get(launch.slot)
            if st is not None and st.launch_serial == launch.serial:
                self._finish_request(st, "released")

    def _on_slot_token(self, r: dict[str, Any]) -> None:
        tid = int(r["tid"])
        d = self._deferred.pop(tid, None)
        if d is None:
            return
        c, idx, token, logits = d
        if token != int(r["b"]) and self.serving is not None:
            self.serving.counters.slot_token_mismatch += 1
        self._emit_sample(c, idx, token, tid, logits, slot=int(r["a"]))

    def _on_seq_rm(self, r: dict[str, Any]) -> None:
        self._seq_rm(int(r["tid"]), int(r["a"]), int(r["b"]))

    def _seq_rm(self, tid: int, seq: int, p0: int) -> None:
        self.pending_clears.setdefault(tid, []).append((seq, p0))

    def _on_mem_clear(self, r: dict[str, Any]) -> None:
        self.pending_clears.setdefault(int(r["tid"]), []).append((-1, 0))

    # ------------------------------------------------------------------ logic
    def _resolve(self, c: CtxState, idx: int) -> tuple[Step, int] | None:
        """Map llama_get_logits_ith's index to a micro-batch row: negative = from the end of the
        decode's outputs, otherwise a position in the decode's batch (micro-batches in order).

        A decode split into several micro-batches with outputs of several sequences may have
        been split by sequence (split_equal), which reorders rows: batch positions are then not
        known, and the sample is counted as unresolved rather than given to the wrong sequence."""
        if idx < 0:
            j = len(c.outputs) + idx
            return c.outputs[j] if 0 <= j < len(c.outputs) else None
        if len({id(s) for s, _ in c.outputs}) > 1 and len({int(s.seq[i]) for s, i in c.outputs}) > 1:
            return None
        row = c.rows[idx] if idx < len(c.rows) else None
        if row is None:
            return None
        step, i = row
        return (step, i) if step.output[i] else None

    def _segment(self, c: CtxState, step: Step, clears: list[tuple[int, int]]) -> None:
        for seq, rows in sorted(step.seq_rows().items()):
            first = int(rows[0])
            tok, pos = int(step.token[first]), int(step.pos[first])
            st = c.seqs.get(seq)
            launch = self.serving.slots.get(seq) if self.serving is not None else None
            if launch is not None and (st is None or launch.serial > st.launch_serial):
                # the server launched a task on this slot since: a new request, whatever the
                # positions say (a cached prompt prefix makes a new request look continued)
                self._new_request(c, seq, step, rows, launch=launch)
                continue
            cleared = st is not None and any(cs in (-1, seq) and p0 <= st.max_pos for cs, p0 in clears)
            # In a truncated micro-batch the sequence's first rows may be among those not copied:
            # then any position past the last one cached continues it.
            hidden_head = step.row_offset > 0 and first == 0
            continues = (
                st is not None
                and not cleared
                and (pos == st.max_pos + 1 or (hidden_head and pos > st.max_pos))
                and (st.expect_token is None or st.expect_token == tok or hidden_head)
            )
            if st is not None and continues:
                if len(rows) == 1 and st.samples > 0:
                    step.decode_rows += 1  # a sampled token fed back
                self._maybe_next_input(c, st, step, first, len(rows))
                st.expect_token = None
                st.max_pos = max(st.max_pos, int(step.pos[rows].max()))
                continue
            # A new request. Seen for the first time since attach as a lone token past position 0,
            # it was most likely already running: partial (a prefix-cache hit that leaves a single
            # prompt token to evaluate looks the same; partial errs on the safe side).
            partial = st is None and len(rows) == 1 and pos > 0
            self._new_request(c, seq, step, rows, partial=partial)

    def _new_request(
        self,
        c: CtxState,
        seq: int,
        step: Step,
        rows: np.ndarray,
        *,
        partial: bool = False,
        launch: Launch | None = None,
    ) -> None:
        old = c.seqs.get(seq)
        if old is not None:
            self._finish_request(old, None)
        c.requests += 1
        if launch is not None:
            rid, src, serial = launch.request_id, launch.id_source, launch.serial
        else:
            rid, src, serial = (
                f"r{c.ctx_id}-{seq}-{c.requests}",
                ID_SEGMENTED,
                old.launch_serial if old else 0,
            )
        agg = RequestAgg(rid, src, c.ctx_id, seq, self.pid, partial, step.t_start)
        if launch is not None:
            agg.slot_id, agg.task_id, agg.parent_seq_id = launch.slot, launch.task_id, launch.parent_seq_id
            agg.t_received_ns, agg.t_started_ns = launch.t_received_ns, launch.t_ns
        c.seqs[seq] = SeqState(
            request_id=rid, partial=partial, max_pos=int(step.pos[rows].max()), agg=agg, launch_serial=serial
        )

    def _finish_request(self, st: SeqState, reason: str | None) -> None:
        if st.agg is None:
            return
        if st.agg.end_reason is None:
            st.agg.end_reason = reason
        for k, v in st.agg.row().items():
            self._requests.setdefault(k, []).append(v)
        st.agg = None

    def _maybe_next_input(self, c: CtxState, st: SeqState, step: Step, row: int, n_rows: int) -> None:
        """Engines that sample without a probed sampler call: the token is the next input.

        Only a continuation of exactly one row is a sampled token fed back; more rows are the
        next chunk of a prompt evaluated over several decode calls."""
        pending, st.next_input_pending = st.next_input_pending, None
        if c.sampler_seen or pending is None or n_rows != 1:
            return
        prev_step, prev_row = pending
        self._emit_token(c, prev_step, prev_row, int(step.token[row]), step.tid, SOURCE_NEXT_INPUT, None)

    def _emit_token(
        self,
        c: CtxState,
        step: Step,
        i: int,
        token: int,
        tid: int,
        source: str,
        logits: list[np.ndarray] | None,
    ) -> None:
        seq = int(step.seq[i])
        logits_pos = int(step.pos[i])
        st = c.seqs.get(seq)
        if st is None:  # attached between a forward pass and its sampling
            self._new_request(c, seq, step, np.array([i]), partial=True)
            st = c.seqs[seq]
        if logits is not None:  # statistics are computed for the whole drain in take_rows
            self._pending_rows.append((len(self._tokens), logits))
        first = st.samples == 0
        if first and st.agg is not None and st.agg.parent_seq_id is not None and not st.partial:
            # a fork (n > 1 completions): the child continues the parent's sequence after its
            # prompt, and the parent's first token(s) are the child's too
            parent = c.seqs.get(st.agg.parent_seq_id)
            base = parent.agg.prompt_tokens if parent is not None and parent.agg is not None else None
            if base is not None and logits_pos + 1 >= base:
                st.samples = logits_pos + 1 - base
                st.agg.prompt_tokens = base
                st.agg.inherited = st.samples
        sparse_values: tuple[object, ...] = _NO_SPARSE_VALUES
        if step.sparse is not None:
            v = step.sparse.row_values(
                step.row_offset + i, step.output_index(), step.n_tokens, self.layers, self.problems
            )
            att = [a for a in v["attn_attended"] if a is not None]
            sparse_values = (  # in _SPARSE_TOKEN_COLUMNS order
                v["expert_ids"] if self.layers.moe else [],
                v["expert_weights"] if self.layers.moe else [],
                v["router_probs"] if v["router_probs"].count(None) < len(v["router_probs"]) else None,
                v["act_zero_ratio"],
                v["act_below_ratio"],
                v["attn_attended"],
                max(att) if att else None,
            )
        # in _TOKEN_ROW order: one tuple per token, no keyword dict (a row per token)
        self._tokens.add_values(
            _TOKEN_ROW,
            (
                st.request_id,
                c.ctx_id,
                seq,
                None if st.partial else st.samples,
                logits_pos + 1,
                logits_pos,
                PHASE_PREFILL if st.samples == 0 and not st.partial else PHASE_DECODE,
                token,
                source,
                step.step_id,
                step.t_start,
                step.t_end,
                self._wall_ms(step.t_end) if step.t_end is not None else None,
                step.n_tokens,
                st.partial,
                self.pid,
                tid,
                logits_pos + 1,
                *sparse_values,
            ),
        )
        st.samples += 1
        st.expect_token = token
        if st.agg is not None:
            st.agg.add_token(logits_pos, step.t_end, token)

    def _verify(self, c: CtxState, step: Step, *, has_tokens: bool) -> None:
        """Sanity-check the first micro-batches read with this build's layout; compare with the
        public llama_batch (stable C API) where the decode probe could read it."""
        if self.counters.verified_ubatches >= VERIFY_UBATCHES:
            return
        problems = []
        if not 0 < step.n_tokens <= 1 << 20:
            problems.append(f"n_tokens={step.n_tokens}")
        m = len(step.token)
        if m:
            if has_tokens and (step.token.min() < 0 or step.token.max() >= self.n_vocab):
                problems.append(f"token ids outside [0, {self.n_vocab})")
            if not np.isin(step.output, (0, 1)).all():
                problems.append("output flags not 0/1")
            if step.seq.min() < 0 or step.seq.max() >= MAX_SEQ_ID:
                problems.append("sequence ids out of range")
            for s in np.unique(step.seq):
                p = step.pos[step.seq == s]
                if len(p) > 1 and not (np.diff(p) == 1).all():
                    problems.append(f"positions of sequence {int(s)} not consecutive")
                    break
            if step.pos.min() < 0:
                problems.append("negative positions")
        if c.public_batch is not None and m:
            n, tok0, pos0 = c.public_batch
            c.public_batch = None
            # a truncated micro-batch starts row_offset rows into the batch (positions are
            # consecutive within a prompt); its first token is not among the copied rows
            off = step.row_offset
            if (
                step.n_tokens > n
                or (has_tokens and off == 0 and tok0 != int(step.token[0]))
                or (pos0 >= 0 and pos0 + off != int(step.pos[0]))
            ):
                problems.append(
                    f"micro-batch (n={step.n_tokens}, row {off}: token={int(step.token[0])}, "
                    f"pos={int(step.pos[0])}) does not match the public llama_batch "
                    f"(n={n}, token0={tok0}, pos0={pos0})"
                )
            else:
                self.counters.verified_decodes += 1
        if problems:
            raise _failed_verification("llama_ubatch layout", problems)
        self.counters.verified_ubatches += 1


class _RowBuffer:
    """Rows of one table (every row with the same columns, in the same order), kept as tuples
    and made into columns when taken: one list append per row instead of one dict lookup and
    append per column (~45 per token for the token and step rows)."""

    __slots__ = ("names", "rows")

    def __init__(self) -> None:
        self.names: tuple[str, ...] = ()
        self.rows: list[tuple[object, ...]] = []

    def add(self, **row: object) -> None:
        if not self.rows:
            self.names = tuple(row)
        elif len(row) != len(self.names):
            raise ValueError(f"row with columns {sorted(row)}, expected {sorted(self.names)}")
        self.rows.append(tuple(row.values()))

    def add_values(self, names: tuple[str, ...], values: tuple[object, ...]) -> None:
        """A row given as values in the order of `names` (the same names for every row)."""
        if not self.rows:
            self.names = names
        elif names is not self.names and names != self.names:
            raise ValueError(f"row with columns {sorted(names)}, expected {sorted(self.names)}")
        self.rows.append(values)

    def __len__(self) -> int:
        return len(self.rows)

    def take(self) -> dict[str, list[object]]:
        """The rows so far as columns; the buffer is empty afterwards."""
        rows, self.rows = self.rows, []
        if not rows:
            return {}
        return {name: list(col) for name, col in zip(self.names, zip(*rows, strict=True), strict=True)}


def _failed_verification(what: str, problems: list[str]) -> UnsupportedEngineBuild:
    return UnsupportedEngineBuild(
        f"unsupported engine build: the {what} failed verification on live data ("
        + "; ".join(problems)
        + "). Nothing more was recorded."
    )


_HANDLERS: dict[int, Callable[[Correlator, dict[str, Any]], None]] = {
    ev.EV_DECODE_BEGIN: Correlator._on_decode_begin,
    ev.EV_UBATCH: Correlator._on_ubatch,
    ev.EV_UBATCH_END: Correlator._on_ubatch_end,
    ev.EV_SAMPLE_BEGIN: Correlator._on_sample_begin,
    ev.EV_LOGITS: Correlator._on_logits,
    ev.EV_SAMPLE_END: Correlator._on_sample_end,
    ev.EV_SEQ_RM: Correlator._on_seq_rm,
    ev.EV_MEM_CLEAR: Correlator._on_mem_clear,
    ev.EV_TENSOR: Correlator._on_sparse,
    ev.EV_ACT: Correlator._on_sparse,
    ev.EV_ACT_MASK: Correlator._on_sparse,
    ev.EV_ATTN: Correlator._on_sparse,
    ev.EV_STEP_AGG: Correlator._on_step_agg,
    ev.EV_HTTP_READ: Correlator._on_http,
    ev.EV_TASK_POST: Correlator._on_task_post,
    ev.EV_SLOT_LAUNCH: Correlator._on_slot_launch,
    ev.EV_SLOT_CHILD: Correlator._on_slot_child,
    ev.EV_SLOT_RELEASE: Correlator._on_slot_release,
    ev.EV_SLOT_TOKEN: Correlator._on_slot_token,
}
