"""Turns the probe records of one process into the steps, tokens, routes, masks and requests
tables.

Pure consumer-side logic, fed in sequence-number order: no BPF here, so it is unit-tested on
synthetic records. State is kept per engine context (a draft or embedding context in the same
process never mixes with another) and per sequence within it (state.py). This module holds the
record handlers; the modules beside it hold the concerns they hand over to: which request a
sequence's rows belong to and the token rows (request_tokens.py), the routes and masks tables
(routes.py), layout checks (verification.py), the one-row decode step taken from the
records' columns (fast_step.py), which must do what six of the handlers here do, and runs of
per-layer routing and activation records stored at once (sparse_run.py), which must do what
_on_sparse does.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np

from sparseety_prof.capture import events as ev
from sparseety_prof.capture.logits_rows import owned
from sparseety_prof.capture.plans import LayerSet
from sparseety_prof.correlate.agg_record import AggRow, agg_rows_batch
from sparseety_prof.correlate.attention_map import AttentionMap
from sparseety_prof.correlate.drain_index import G_SMALL, DrainIndex
from sparseety_prof.correlate.fast_step import UnmadeStep, fast_sample, fast_step, make_unmade
from sparseety_prof.correlate.plain_run import plain_run
from sparseety_prof.correlate.request_tokens import RequestTokens
from sparseety_prof.correlate.routes import RoutesTables
from sparseety_prof.correlate.server_layout_check import ServerLayoutCheck
from sparseety_prof.correlate.serving import ServingTracker
from sparseety_prof.correlate.sparse_run import RUN_KINDS, sparse_run
from sparseety_prof.correlate.state import Counters, CtxState, HeadDropped, SampleState, Step
from sparseety_prof.correlate.step_sparse import Problems, StepSparse
from sparseety_prof.correlate.tables import ATTENTION_COLUMNS, STEP_ROW, RowBuffer
from sparseety_prof.correlate.verification import (
    MAX_BATCH_ROWS,
    verify_routing,
    verify_ubatch,
    verifying_sparse,
)
from sparseety_prof.store.array_rows import ArrayRows, RowParts, split_rows
from sparseety_prof.store.schema import PHASE_DECODE, PHASE_PREFILL, Columns, RowTables


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
        routes_rows: bool = True,
        head_verdicts: dict[str, bool] | None = None,
        head_drops_routes: bool = False,
        head_rows_apart: Mapping[str, Collection[str]] | None = None,
    ) -> None:
        """`routes_rows`: make the routes table's rows, or only count them (RoutesTables).
        `head_verdicts`: with head sampling in the probes, each request's verdict (the draw its
        first token saw) is put there by request id, for the head policy (request_verdicts.Head).
        `head_drops_routes` (with `head_verdicts`, when nothing but the recording reads routes
        rows): the routes rows of a request the probes drew to drop are counted, not made, from
        its draw on (RoutesTables.head_dropped, take_head_dropped): the policy would drop them.
        `head_rows_apart` (with `head_verdicts`, when nothing but the recording and the always-on
        aggregates reads token and steps rows): the token rows of a request the probes drew to
        drop, and the steps rows all of whose sequences' requests drew drop when made, are set
        apart (take_apart) with only the columns named per table (the others null): what the
        aggregates count and what the policy learns from them, never framed whole nor held."""
        self.pid = pid
        self.n_vocab = n_vocab
        self.wall_offset_ns = wall_offset_ns
        self.layers = layers or LayerSet()
        self.n_expert = n_expert
        self.n_expert_used = n_expert_used
        self.serving = serving
        self.server_check = ServerLayoutCheck()  # fed only when serving
        self.slot_tokens = slot_tokens
        self.ctxs: dict[int, CtxState] = {}  # by context pointer
        self._last_seq: int | None = None  # highest record sequence number fed so far
        self.open_steps: dict[int, Step] = {}  # by tid
        self.pending_clears: dict[int, list[tuple[int, int]]] = {}  # by tid: (seq, p0)
        self.next_step_id = 0
        self.counters = Counters()
        self.problems = Problems()
        self.layers_seen: dict[str, set[int]] = {"moe": set(), "ffn": set(), "attn": set()}
        self.attn_map = AttentionMap(self.layers.attn)
        self._agg_pre: dict[int, AggRow] = {}  # this drain's aggregate records, by sequence number
        # the last one-row step of fast_step whose Step is not made yet (UnmadeStep): made when
        # anything may read it, dropped when its context's next decode replaces it
        self._unmade: UnmadeStep | None = None
        self._steps = RowBuffer(STEP_ROW)
        # head_rows_apart: the steps rows set apart, and the columns kept of each table's
        self._steps_apart: RowBuffer | None = None
        self._apart_columns = head_rows_apart
        self._tokens_apart: list[ArrayRows] = []
        self.rows_set_apart = {"tokens": 0, "steps": 0}  # since the start
        self.requests = RequestTokens(
            pid=pid,
            wall_offset_ns=wall_offset_ns,
            texts=texts,
            layers=self.layers,
            problems=self.problems,
            counters=self.counters,
            serving=serving,
            slot_tokens=slot_tokens,
            head_verdicts=head_verdicts,
        )
        self.routes = RoutesTables(self.layers, self.problems, with_masks=with_masks, rows=routes_rows)
        self.head_dropped: HeadDropped | None = None
        if (head_drops_routes or head_rows_apart) and head_verdicts is not None and not with_masks:
            self.head_dropped = self.requests.head_dropped = HeadDropped()
            if head_drops_routes:
                self.routes.head_dropped = self.head_dropped
            if head_rows_apart:
                self._steps_apart = RowBuffer(STEP_ROW)
                self.requests.dropped_requests = set()
                kept = head_rows_apart.get("tokens", ())
                self.requests.apart_without_attention = not any(c in kept for c in ATTENTION_COLUMNS)

    # Methods written in other modules, as methods that call them: a compiled module's function
    # does not bind as a method when assigned in a class body (build_stamp.py).
    def _fast_step(self, idx: DrainIndex, i: int) -> int:
        """The one-row decode step at record i, from the records' columns (fast_step.py)."""
        return fast_step(self, idx, i)

    def _fast_sample(self, idx: DrainIndex, i: int) -> int:
        """A sampler call at record i, from the records' columns (fast_step.py)."""
        return fast_sample(self, idx, i)

    def _make_unmade(self) -> None:
        make_unmade(self)

    def _plain_run(self, idx: DrainIndex, p: int, stop: int) -> int:
        """A run of plain steps at once (plain_run.py)."""
        return plain_run(self, idx, p, stop)

    def _sparse_run(self, idx: DrainIndex, i: int) -> int:
        """A run of per-layer routing and activation records at once (sparse_run.py)."""
        return sparse_run(self, idx, i)

    # ------------------------------------------------------------------ public
    def records_lost(self) -> None:
        """Records were lost before the next batch (ring full, sequence gap): every sequence
        known so far may have run steps never seen, so a request seen next on one of them
        mid-way is partial, as one running at attach is."""
        for c in self.ctxs.values():
            c.unsure.update(c.seqs)

    def feed(self, batch: ev.EventBatch, *, losses_seen: bool = False) -> None:
        """Consume one drained batch. Records are processed in sequence-number order: the
        micro-batches of one-row decode steps by `_fast_step`, every other record by its
        handler, as a dict (DrainIndex.record). Once records have been lost (`losses_seen`),
        each hole in the sequence numbers marks where the sequences may have missed steps."""
        idx = DrainIndex(batch)
        holes = self._holes(idx.seqs) if losses_seen else []
        hole = holes.pop(0) if holes else -1
        if len(idx.seqs):
            self._last_seq = max(self._last_seq or 0, int(idx.seqs[-1]))
        # the aggregate records' values, all at once (see agg_rows_batch)
        pre = None
        if len(batch.step_agg):
            pre = agg_rows_batch(batch.step_agg, self.layers)
            # agg_begin marks a pass whose activations --act-every skips: active 2
            self.counters.act_sampled_out += int(np.count_nonzero(batch.step_agg["active"] == 2))
        self._agg_pre = dict(zip(batch.step_agg["seq"].tolist(), pre, strict=True)) if pre else {}
        kinds, n, i = idx.kinds, len(idx), 0
        while i < n:
            if 0 <= hole <= i:  # records were lost just before this one
                self.records_lost()
                hole = holes.pop(0) if holes else -1
            kind = kinds[i]
            if kind == ev.EV_UBATCH:
                nxt = self._fast_step(idx, i)
                if nxt:
                    if self._unmade is not None:  # a plain step: the same that follow, at once
                        nxt = self._plain_run(idx, nxt, hole if hole >= 0 else n)
                    i = nxt
                    continue
            if self._unmade is not None and kind != ev.EV_SEQ_RM and kind != ev.EV_DECODE_BEGIN:
                self._make_unmade()  # anything but these may read the context's rows
            if kind in RUN_KINDS:
                i = self._sparse_run(idx, i)
                continue
            elif kind == ev.EV_SAMPLE_BEGIN:
                nxt = self._fast_sample(idx, i)
                if nxt:
                    i = nxt
                    continue
            elif kind in _FROM_COLUMNS and idx.group[i] == G_SMALL:
                # once per token each: from the columns
                r = idx.row[i]
                a, b = idx.col(G_SMALL, "a")[r], idx.col(G_SMALL, "b")[r]
                if kind == ev.EV_DECODE_BEGIN:
                    self._decode_begin(idx.col(G_SMALL, "ctx")[r], a, b, idx.col(G_SMALL, "c")[r])
                elif kind == ev.EV_SEQ_RM:
                    self._seq_rm(idx.col(G_SMALL, "tid")[r], a, b)
                else:  # EV_SLOT_TOKEN
                    self.requests.slot_token(idx.col(G_SMALL, "tid")[r], a, b)
                i += 1
                continue
            handler = _HANDLERS.get(kind)
            if handler is not None:
                handler(self, idx.record(i))
            i += 1
        if self._unmade is not None:
            self._make_unmade()
        # logits chunks are views into this drain's batch: copy those still waiting
        for c in self.ctxs.values():
            for smp in c.sampling.values():
                smp.chunks = {k: owned(v) for k, v in smp.chunks.items()}
        self.requests.keep_deferred()

    def _holes(self, seqs: np.ndarray) -> list[int]:
        """Indices of the records (in sequence order) that follow missing sequence numbers,
        since the last batch too. A record still in flight on another CPU looks missing as
        well: marking a sequence unsure errs on the safe side (partial, never a false start)."""
        if len(seqs) == 0:
            return []
        at = (np.flatnonzero(np.diff(seqs) > 1) + 1).tolist()
        if self._last_seq is not None and int(seqs[0]) > self._last_seq + 1:
            at.insert(0, 0)
        return at

    @property
    def logits_cpu_s(self) -> float:
        """CPU time spent on the logits rows' statistics so far, in take_tables (PendingStats)."""
        return self.requests.stats.cpu_s

    def take_tables(self, *, final: bool = False) -> RowTables:
        """The rows produced since the last call, by table: tokens, steps, routes, masks and
        requests, each with every column of its schema. With `final`, every request still open
        is finished too (end_reason "detached" unless one is known)."""
        routes, masks = self.routes.take()
        self.counters.sparse_unmapped_rows = self.problems.unmapped_rows
        tokens = self.requests.take_tokens()
        if self._apart_columns is not None:
            tokens = self._set_tokens_apart(tokens)
        return {
            "tokens": tokens,
            "steps": self._steps.take(),
            "routes": routes,
            "masks": masks,
            "requests": self.requests.take_requests(self.ctxs.values(), final=final),
        }

    def take_apart(self) -> dict[str, list[ArrayRows]]:
        """The rows set apart (`head_rows_apart`) since the last call, by table (after
        take_tables: its tokens are split there)."""
        if self._steps_apart is None or self._apart_columns is None:
            return {}
        out: dict[str, list[ArrayRows]] = {}
        steps = self._steps_apart.take()
        n_steps = len(steps["step_id"])
        if n_steps:
            out["steps"] = [ArrayRows.of_lists(steps, list(range(n_steps)), self._apart_columns["steps"])]
        if self._tokens_apart:
            out["tokens"], self._tokens_apart = self._tokens_apart, []
        for table, parts in out.items():
            self.rows_set_apart[table] += sum(p.n for p in parts)
        return out

    def _set_tokens_apart(self, tokens: Columns | RowParts) -> Columns | RowParts:
        """The token rows less those of requests the probes drew to drop (kept for take_apart)."""
        reqs = self.requests
        dropped = reqs.dropped_requests
        rids = tokens["request_id"]
        if not dropped or not rids:
            return tokens
        apart = np.fromiter((r in dropped for r in rids), dtype=bool, count=len(rids))
        assert self._apart_columns is not None
        rest, parts = split_rows(tokens, apart, self._apart_columns["tokens"])
        self._tokens_apart += parts
        return rest

    # ------------------------------------------------------------------ steps
    def _ctx(self, ptr: int) -> CtxState:
        st = self.ctxs.get(ptr)
        if st is None:
            st = self.ctxs[ptr] = CtxState(ctx_id=len(self.ctxs))
        return st

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
        """The steps table's row of a finished micro-batch."""
        self._add_step_values(
            step.step_id,
            step.ctx_id,
            step.decode_id,
            step.t_start,
            step.t_end,
            step.n_tokens,
            n_outputs,
            phase,
            step.decode_rows,
            seq_ids,
            token_ids,
            positions,
            row_seq_ids,
            output_rows,
            step.truncated,
            step.tid,
        )

    def step_rows(self, ctx_id: int, seq_ids: list[int]) -> RowBuffer:
        """Where a steps row over `seq_ids` goes: set apart when every one's request drew drop
        (`head_rows_apart`; a row over no sequence is kept, as the policy keeps it)."""
        apart = self._steps_apart
        if apart is not None and self.head_dropped and self.head_dropped.holds_seqs(ctx_id, seq_ids):
            return apart
        return self._steps

    def _add_step_values(
        self,
        step_id: int,
        ctx_id: int,
        decode_id: int,
        t_start: int,
        t_end: int | None,
        n_tokens: int,
        n_outputs: int,
        phase: str,
        decode_rows: int,
        seq_ids: list[int],
        token_ids: list[int],
        positions: list[int],
        row_seq_ids: list[int],
        output_rows: list[int],
        truncated: bool,
        tid: int,
    ) -> None:
        """The same from the step's values (a tuple in STEP_ROW order: one per micro-batch, no
        keyword dict; fast_step's steps whose Step is not made yet)."""
        self.step_rows(ctx_id, seq_ids).add_values(
            (
                step_id,
                ctx_id,
                decode_id,
                t_start,
                t_end,
                (t_start + self.wall_offset_ns) // 1_000_000,
                n_tokens,
                n_outputs,
                phase,
                n_tokens - decode_rows,
                decode_rows,
                seq_ids,
                token_ids,
                positions,
                row_seq_ids,
                output_rows,
                truncated,
                self.pid,
                tid,
            )
        )

    # ------------------------------------------------------------------ handlers
    # _on_ubatch, _on_step_agg, _on_ubatch_end, _on_sample_begin, _on_logits and _on_sample_end
    # have a twin in fast_step.py: a change to one is a change to the other.
    def _on_decode_begin(self, r: dict[str, Any]) -> None:
        self._decode_begin(int(r["ctx"]), int(r["a"]), int(r["b"]), int(r["c"]))

    def _decode_begin(self, ctx: int, n_tokens: int, token0: int, pos0: int) -> None:
        c = self._ctx(ctx)
        if self._unmade is not None:  # its context's rows are replaced here: it is never read
            if self._unmade.c is c:
                self._unmade = None
            else:
                self._make_unmade()
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
        # sizes come from the target's memory: clamped to what the record holds and to a batch
        # of MAX_BATCH_ROWS, so a record past verification cannot drive an allocation
        n_tokens = min(int(r["n_tokens"]), MAX_BATCH_ROWS)
        m = max(0, min(int(r["n_copied"]), ev.MAX_UB_TOK, n_tokens))
        row_offset = max(0, min(int(r["row_offset"]), n_tokens - m, MAX_BATCH_ROWS - len(c.rows) - m))
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
            n_tokens=n_tokens,
            truncated=bool(int(r["flags"]) & ev.UB_FLAG_TRUNCATED),
            row_offset=row_offset,
        )
        self.next_step_id += 1
        verify_ubatch(
            c, step, self.counters, self.n_vocab, has_tokens=not (int(r["flags"]) & ev.UB_FLAG_NO_TOKENS)
        )
        if self.serving is not None and not self.server_check.done:
            self.server_check.on_ubatch(step.seq.tolist())
        self.open_steps[tid] = step
        if self.slot_tokens:
            # a sample still waiting for the process_token call that names its slot gets none
            # now: llama-server hands out every sampled token before its next decode. Emitted
            # before this micro-batch is segmented, it stays with the request it was sampled for
            # (a task launched on its slot since takes the slot's next rows, not that token).
            self.requests.flush_deferred(tid)
        clears = self.pending_clears.pop(tid, [])
        self.requests.segment(c, step, clears)
        c.rows.extend([None] * step.row_offset)  # batch positions whose rows were not copied
        c.rows.extend((step, i) for i in range(m))
        off = step.row_offset
        c.outputs.extend((step, r - off) for r in step.output_index())
        if not c.sampler_seen:  # remember each sequence's last output row for a next_input token
            for i in np.flatnonzero(step.output):
                st = c.seqs.get(int(step.seq[i]))
                if st is not None:
                    st.next_input_pending = (step, int(i))

    def _on_ubatch_end(self, r: dict[str, Any]) -> None:
        step = self.open_steps.pop(int(r["tid"]), None)
        if step is None:
            return
        if int(r["a"]):  # a pass of several rows, every one a head-dropped request's: no activations
            self.counters.act_sampled_out += 1
            if step.sparse is not None:
                step.sparse.act_uncounted = True
        step.t_end = int(r["ts_ns"])
        groups = step.seq_rows()
        most_rows = max((len(rows) for rows in groups.values()), default=0)
        outputs = list(step.output_index())  # the output rows, in batch order
        self._add_step_row(
            step,
            len(outputs),
            PHASE_PREFILL if most_rows > 1 else PHASE_DECODE,
            sorted(groups),
            step.token.tolist(),
            step.pos.tolist(),
            step.seq.tolist(),
            outputs,
        )
        if step.sparse is not None:
            # layers whose masks were counted where the engine wrote them (graph-op probes gone)
            self.layers_seen["attn"].update(self.attn_map.observe(step.sparse))
            self.routes.emit(step)

    def _on_step_agg(self, r: dict[str, Any]) -> None:
        """The aggregate of a one-row micro-batch, sent by its own thread before its end record.
        Records of layers that did not fit it (e.g. attention) may have come before: merge."""
        step = self.open_steps.get(int(r["tid"]))
        if step is None or int(r["overlap"]):
            self._unattributed()
            return
        verifying = verifying_sparse(self.counters, self.n_expert)
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
                verify_routing(agg, self.counters, self.n_expert, self.n_expert_used)
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
            self._unattributed()
            return
        step = next(iter(self.open_steps.values()))
        if step.sparse is None:
            step.sparse = StepSparse()
        kind = int(r["kind"])
        if kind == ev.EV_TENSOR:
            got = step.sparse.add_tensor(r)
            if got is not None and int(r["tag"]) == ev.TAG_EXPERT_IDS:
                verify_routing(step.sparse, self.counters, self.n_expert, self.n_expert_used)
            section = "moe"
        elif kind in (ev.EV_ACT, ev.EV_ACT_MASK):
            got = step.sparse.add_act(r, with_bits=kind == ev.EV_ACT_MASK)
            section = "ffn"
        else:
            got = step.sparse.add_attn(r, self.layers.attn)
            section = "attn"
        if got is not None:
            self.layers_seen[section].add(got[1])

    def _unattributed(self) -> None:
        """A graph-op record no single micro-batch claims. Before any micro-batch has begun since
        the attach, it comes from the forward pass the probes were attached in the middle of: the
        attach boundary (like samples_before_first_step), not a loss of the recording."""
        if self.open_steps or any(c.ubatches_seen for c in self.ctxs.values()):
            self.counters.sparse_unattributed += 1
        else:
            self.counters.sparse_before_first_step += 1

    def _on_sample_begin(self, r: dict[str, Any]) -> None:
        c = self._ctx(int(r["ctx"]))
        c.sampler_seen = True
        c.sampling[int(r["tid"])] = SampleState(idx=int(r["a"]), tid=int(r["tid"]))

    def _on_logits(self, r: dict[str, Any]) -> None:
        c = self._ctx(int(r["ctx"]))
        s = c.sampling.get(int(r["tid"]))
        if s is None:
            return
        n, chunk = int(r["n_vals"]), int(r["chunk"])
        if chunk >= ev.MAX_LOGITS_CHUNKS:
            return  # beyond any vocabulary a record set can carry: left incomplete, and counted
        # a view into the drained batch, valid until the next drain; feed() copies the chunks of
        # sampler calls still open when it returns (take_tables uses the others before then)
        s.chunks[chunk] = r["vals"][:n]
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
            if len(s.chunks) == n_chunks and all(k in s.chunks for k in range(n_chunks)):
                logits = [s.chunks[k] for k in range(n_chunks)]
            else:
                self.counters.logits_incomplete += 1
        self.requests.sample_end(c, tid, idx, int(r["a"]), logits)

    def _on_head_draw(self, r: dict[str, Any]) -> None:
        keep = bool(r["b"])
        c, seq = self._ctx(int(r["ctx"])), int(r["a"])
        c.head_draw[seq] = keep
        dropped = self.head_dropped
        st = c.seqs.get(seq)
        if dropped is not None and st is not None and not st.head_judged:
            # the request has no token yet: this draw is the one its first token will take
            # (RequestTokens._add_token_row), and its prompt's rows come after it
            dropped.judge(c.ctx_id, seq, keep)
        if keep:
            self.counters.head_draws_kept += 1
        else:
            self.counters.head_draws_dropped += 1

    def _on_seq_rm(self, r: dict[str, Any]) -> None:
        self._seq_rm(int(r["tid"]), int(r["a"]), int(r["b"]))

    def _seq_rm(self, tid: int, seq: int, p0: int) -> None:
        self.pending_clears.setdefault(tid, []).append((seq, p0))

    def _on_mem_clear(self, r: dict[str, Any]) -> None:
        self.pending_clears.setdefault(int(r["tid"]), []).append((-1, 0))

    # ---- serving context (llama-server)
    def _on_http(self, r: dict[str, Any]) -> None:
        if self.serving is not None:
            self.serving.on_http(int(r["tid"]), int(r["ts_ns"]), r["data"])

    def _on_task_post(self, r: dict[str, Any]) -> None:
        self._task_post(int(r["tid"]), int(r["a"]), int(r["b"]), int(r["ptr"]))

    def _task_post(self, tid: int, task: int, b: int, span_bytes: int) -> None:
        if self.serving is not None:
            self.server_check.on_task_post(tid, task)
            self.serving.on_task_post(tid, task, b == 1, span_bytes)

    def _on_slot_launch(self, r: dict[str, Any]) -> None:
        if self.serving is not None:
            self.server_check.on_slot_launch(int(r["a"]), int(r["b"]))
            self.serving.on_slot_launch(int(r["ts_ns"]), int(r["a"]), int(r["b"]))

    def _on_slot_child(self, r: dict[str, Any]) -> None:
        if self.serving is not None:
            self.serving.on_slot_child(int(r["a"]), int(r["c"]), int(r["b"]))

    def _on_slot_release(self, r: dict[str, Any]) -> None:
        """The slot finished its request: emit the request's row now."""
        self.requests.flush_deferred(int(r["tid"]))
        self.server_check.on_slot_release(int(r["a"]))
        launch = self.serving.slots.get(int(r["a"])) if self.serving is not None else None
        if launch is None:
            return
        for c in self.ctxs.values():
            st = c.seqs.get(launch.slot)
            if st is not None and st.launch_serial == launch.serial:
                self.requests.finish_request(st, "released")

    def _on_slot_token(self, r: dict[str, Any]) -> None:
        self.requests.slot_token(int(r["tid"]), int(r["a"]), int(r["b"]))


# small records taken from the drain's columns, not made a dict (feed)
_FROM_COLUMNS = frozenset((ev.EV_DECODE_BEGIN, ev.EV_SEQ_RM, ev.EV_SLOT_TOKEN))

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
    ev.EV_HEAD_DRAW: Correlator._on_head_draw,
}
