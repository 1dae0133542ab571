"""Turns the probe records of one process into the steps, tokens, routes, masks and requests
tables.

Pure consumer-side logic, fed in sequence-number order: no BPF here, so it is unit-tested on
synthetic records. State is kept per engine context (a draft or embedding context in the same
process never mixes with another) and per sequence within it (state.py). This module holds the
feed loop and the record handlers; what they change between records is one FeedState
(feed_state.py), which the fast paths take too: the one-row decode step taken from the records'
columns (fast_step.py), which must do what six of the handlers here do, runs of such steps at
once (plain_run.py), and runs of per-layer routing and activation records stored at once
(sparse_run.py), which must do what its sparse_record does. The modules beside it hold the
concerns they hand over to: which request a sequence's rows belong to and the token rows
(request_tokens.py), the routes and masks tables (routes.py), the steps table
(steps_table.py), layout checks (verification.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np

from sparseety_prof.capture import events as ev
from sparseety_prof.capture.logits_rows import owned
from sparseety_prof.capture.plans import LayerSet
from sparseety_prof.correlate.agg_record import agg_rows_batch
from sparseety_prof.correlate.attention_map import AttentionMap
from sparseety_prof.correlate.drain_index import G_SMALL, DrainIndex
from sparseety_prof.correlate.fast_step import fast_sample, fast_step, make_unmade
from sparseety_prof.correlate.feed_state import FeedState
from sparseety_prof.correlate.layer_times import LayerClock
from sparseety_prof.correlate.plain_run import plain_run
from sparseety_prof.correlate.request_tokens import RequestTokens
from sparseety_prof.correlate.routes import RoutesTables
from sparseety_prof.correlate.server_layout_check import ServerLayoutCheck
from sparseety_prof.correlate.serving import ServingTracker
from sparseety_prof.correlate.sparse_run import RUN_KINDS, sparse_record, sparse_run, unattributed
from sparseety_prof.correlate.state import Counters, HeadDropped, SampleState, Step
from sparseety_prof.correlate.step_sparse import Problems, StepSparse
from sparseety_prof.correlate.steps_table import StepsTable
from sparseety_prof.correlate.tables import ATTENTION_COLUMNS
from sparseety_prof.correlate.verification import (
    MAX_BATCH_ROWS,
    verify_routing,
    verify_ubatch,
    verifying_sparse,
)
from sparseety_prof.store.array_rows import ArrayRows, RowParts, split_rows
from sparseety_prof.store.schema import PHASE_DECODE, PHASE_PREFILL, Columns, RowTables


class Correlator:
    """Drained records to the recording's rows. Its options:
    `routes_rows`: make the routes table's rows, or only count them (RoutesTables).
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
        self.pid = pid
        self.wall_offset_ns = wall_offset_ns
        layers = layers or LayerSet()
        counters, problems = Counters(), Problems()
        self._last_seq: int | None = None  # highest record sequence number fed so far
        requests = RequestTokens(
            pid=pid,
            wall_offset_ns=wall_offset_ns,
            texts=texts,
            layers=layers,
            problems=problems,
            counters=counters,
            serving=serving,
            slot_tokens=slot_tokens,
            head_verdicts=head_verdicts,
        )
        routes = RoutesTables(layers, problems, with_masks=with_masks, rows=routes_rows)
        # locals, not the attributes read back: compiled (mypyc), an attribute read right after
        # `= None` kept the narrowed type None and refused the object _drop_heads set
        head_dropped: HeadDropped | None = None
        apart_columns: Mapping[str, Collection[str]] | None = None  # of each table's rows set apart
        if (head_drops_routes or head_rows_apart) and head_verdicts is not None and not with_masks:
            head_dropped = self._drop_heads(requests, routes, drops_routes=head_drops_routes)
            if head_rows_apart:
                apart_columns = head_rows_apart
                self._set_rows_apart(requests, head_rows_apart)
        self.head_dropped = head_dropped
        self._apart_columns = apart_columns
        steps = StepsTable(
            pid=pid,
            wall_offset_ns=wall_offset_ns,
            head_dropped=head_dropped,
            apart=apart_columns is not None,
        )
        self.state = FeedState(
            layers=layers,
            n_vocab=n_vocab,
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            slot_tokens=slot_tokens,
            serving=serving,
            counters=counters,
            problems=problems,
            requests=requests,
            routes=routes,
            steps=steps,
            attn_map=AttentionMap(layers.attn),
        )
        self._tokens_apart: list[ArrayRows] = []
        self.rows_set_apart = {"tokens": 0, "steps": 0}  # since the start
        # the aggregate records' timed probe points, until their steps are taken (layer_times)
        self.layer_clock = LayerClock()
        requests.slowest = self.layer_clock.slowest_of

    @staticmethod
    def _drop_heads(requests: RequestTokens, routes: RoutesTables, *, drops_routes: bool) -> HeadDropped:
        """Head sampling in the probes: the sequences whose requests drew drop, shared by the
        request tokens and (with `drops_routes`: their rows counted, not made) the routes."""
        dropped = requests.head_dropped = HeadDropped()
        if drops_routes:
            routes.head_dropped = dropped
        return dropped

    @staticmethod
    def _set_rows_apart(requests: RequestTokens, rows_apart: Mapping[str, Collection[str]]) -> None:
        """The token rows of requests drawn to drop set apart, with the columns named per table."""
        requests.dropped_requests = set()
        kept = rows_apart.get("tokens", ())
        requests.apart_without_attention = not any(c in kept for c in ATTENTION_COLUMNS)

    # what the recorder and its metadata read (FeedState holds them)
    @property
    def counters(self) -> Counters:
        return self.state.counters

    @property
    def problems(self) -> Problems:
        return self.state.problems

    @property
    def requests(self) -> RequestTokens:
        return self.state.requests

    @property
    def routes(self) -> RoutesTables:
        return self.state.routes

    @property
    def attn_map(self) -> AttentionMap:
        return self.state.attn_map

    @property
    def serving(self) -> ServingTracker | None:
        return self.state.serving

    @property
    def server_check(self) -> ServerLayoutCheck:
        return self.state.server_check

    @property
    def layers_seen(self) -> dict[str, set[int]]:
        return self.state.layers_seen

    # The fast paths, as methods that call them: the seams tests replace to compare them with
    # the handlers (a compiled module's function does not bind as a method when assigned in a
    # class body: build_stamp.py).
    def _fast_step(self, idx: DrainIndex, i: int) -> int:
        """The one-row decode step at record i, from the records' columns (fast_step.py)."""
        return fast_step(self.state, idx, i)

    def _fast_sample(self, idx: DrainIndex, i: int) -> int:
        """A sampler call at record i, from the records' columns (fast_step.py)."""
        return fast_sample(self.state, idx, i)

    # ------------------------------------------------------------------ public
    def records_lost(self) -> None:
        """Records were lost before the next batch (ring full, sequence gap): every sequence
        known so far may have run steps never seen, so a request seen next on one of them
        mid-way is partial, as one running at attach is."""
        for c in self.state.ctxs.values():
            c.unsure.update(c.seqs)

    def feed(self, batch: ev.EventBatch, *, losses_seen: bool = False) -> None:
        """Consume one drained batch. Records are processed in sequence-number order: the
        micro-batches of one-row decode steps by `_fast_step`, every other record by its
        handler, as a dict (DrainIndex.record). Once records have been lost (`losses_seen`),
        each hole in the sequence numbers marks where the sequences may have missed steps."""
        state = self.state
        idx = DrainIndex(batch)
        holes = self._holes(idx.seqs) if losses_seen else []
        hole = holes.pop(0) if holes else -1
        if len(idx.seqs):
            self._last_seq = max(self._last_seq or 0, int(idx.seqs[-1]))
        self._take_aggregates(batch)
        kinds, n, i = idx.kinds, len(idx), 0
        while i < n:
            if 0 <= hole <= i:  # records were lost just before this one
                self.records_lost()
                hole = holes.pop(0) if holes else -1
            kind = kinds[i]
            if kind == ev.EV_UBATCH:
                nxt = self._fast_step(idx, i)
                if nxt:
                    if state.unmade is not None:  # a plain step: the same that follow, at once
                        nxt = plain_run(state, idx, nxt, hole if hole >= 0 else n)
                    i = nxt
                    continue
            if state.unmade is not None and kind != ev.EV_SEQ_RM and kind != ev.EV_DECODE_BEGIN:
                make_unmade(state)  # anything but these may read the context's rows
            if kind in RUN_KINDS:
                i = sparse_run(state, idx, i)
                continue
            elif kind == ev.EV_SAMPLE_BEGIN:
                nxt = self._fast_sample(idx, i)
                if nxt:
                    i = nxt
                    continue
            elif kind in _FROM_COLUMNS and idx.group[i] == G_SMALL:
                self._small_from_columns(idx, i, kind)  # once per token each
                i += 1
                continue
            handler = _HANDLERS.get(kind)
            if handler is not None:
                handler(self, idx.record(i))
            i += 1
        if state.unmade is not None:
            make_unmade(state)
        # logits chunks are views into this drain's batch: copy those still waiting
        for c in state.ctxs.values():
            for smp in c.sampling.values():
                smp.chunks = {k: owned(v) for k, v in smp.chunks.items()}
        state.requests.keep_deferred()

    def _take_aggregates(self, batch: ev.EventBatch) -> None:
        """This drain's aggregate records' values, all at once (see agg_rows_batch), by
        sequence number, for _on_step_agg and the fast paths."""
        state = self.state
        pre = None
        self.layer_clock.add_drain(batch.step_agg)
        aggs = batch.step_agg
        if len(aggs):
            several = aggs["active"] == ev.AGG_TIMES_ONLY  # passes of several rows: times alone
            if several.any():
                aggs = aggs[~several]
        if len(aggs):
            pre = agg_rows_batch(aggs, state.layers)
            # agg_begin marks a pass whose activations --act-every skips: active 2
            state.counters.act_sampled_out += int(np.count_nonzero(aggs["active"] == 2))
        state.agg_pre = dict(zip(aggs["seq"].tolist(), pre, strict=True)) if pre else {}

    def _small_from_columns(self, idx: DrainIndex, i: int, kind: int) -> None:
        """A decode call, a cache cut or a slot's token at record i, from the drain's columns
        (not made a dict)."""
        r = idx.row[i]
        a, b = idx.col(G_SMALL, "a")[r], idx.col(G_SMALL, "b")[r]
        if kind == ev.EV_DECODE_BEGIN:
            self._decode_begin(idx.col(G_SMALL, "ctx")[r], a, b, idx.col(G_SMALL, "c")[r])
        elif kind == ev.EV_SEQ_RM:
            self._seq_rm(idx.col(G_SMALL, "tid")[r], a, b)
        else:  # EV_SLOT_TOKEN
            self.state.requests.slot_token(idx.col(G_SMALL, "tid")[r], a, b)

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
        return self.state.requests.stats.cpu_s

    def take_tables(self, *, final: bool = False) -> RowTables:
        """The rows produced since the last call, by table: tokens, steps, routes, masks and
        requests, each with every column of its schema. With `final`, every request still open
        is finished too (end_reason "detached" unless one is known)."""
        state = self.state
        routes, masks = state.routes.take()
        state.counters.sparse_unmapped_rows = state.problems.unmapped_rows
        # the steps first: their layer times give their tokens' slowest layer
        steps = state.steps.take()
        layer_times = self.layer_clock.take(steps)
        tokens = state.requests.take_tokens()
        if self._apart_columns is not None:
            tokens = self._set_tokens_apart(tokens)
        return {
            "tokens": tokens,
            "steps": steps,
            "routes": routes,
            "masks": masks,
            "layer_times": layer_times,
            "requests": state.requests.take_requests(state.ctxs.values(), final=final),
        }

    def take_apart(self) -> dict[str, list[ArrayRows]]:
        """The rows set apart (`head_rows_apart`) since the last call, by table (after
        take_tables: its tokens are split there)."""
        steps = self.state.steps.take_apart()
        if steps is None or self._apart_columns is None:
            return {}
        out: dict[str, list[ArrayRows]] = {}
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
        dropped = self.state.requests.dropped_requests
        rids = tokens["request_id"]
        if not dropped or not rids:
            return tokens
        apart = np.fromiter((r in dropped for r in rids), dtype=bool, count=len(rids))
        assert self._apart_columns is not None
        rest, parts = split_rows(tokens, apart, self._apart_columns["tokens"])
        self._tokens_apart += parts
        return rest

    # ------------------------------------------------------------------ handlers
    # _on_ubatch, _on_step_agg, _on_ubatch_end, _on_sample_begin, _on_logits and _on_sample_end
    # have a twin in fast_step.py: a change to one is a change to the other.
    def _on_decode_begin(self, r: dict[str, Any]) -> None:
        self._decode_begin(int(r["ctx"]), int(r["a"]), int(r["b"]), int(r["c"]))

    def _decode_begin(self, ctx: int, n_tokens: int, token0: int, pos0: int) -> None:
        state = self.state
        c = state.ctx(ctx)
        if state.unmade is not None:  # its context's rows are replaced here: it is never read
            if state.unmade.c is c:
                state.unmade = None
            else:
                make_unmade(state)
        c.decode_id += 1
        c.decode_seen = True
        c.rows, c.outputs = [], []
        c.public_batch = (n_tokens, token0, pos0) if n_tokens >= 0 else None

    def _on_ubatch(self, r: dict[str, Any]) -> None:
        state = self.state
        c = state.ctx(int(r["ctx"]))
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
            step_id=state.next_step_id,
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
        state.next_step_id += 1
        verify_ubatch(
            c, step, state.counters, state.n_vocab, has_tokens=not (int(r["flags"]) & ev.UB_FLAG_NO_TOKENS)
        )
        if state.serving is not None and not state.server_check.done:
            state.server_check.on_ubatch(step.seq.tolist())
        state.open_steps[tid] = step
        if state.slot_tokens:
            # a sample still waiting for the process_token call that names its slot gets none
            # now: llama-server hands out every sampled token before its next decode. Emitted
            # before this micro-batch is segmented, it stays with the request it was sampled for
            # (a task launched on its slot since takes the slot's next rows, not that token).
            state.requests.flush_deferred(tid)
        clears = state.pending_clears.pop(tid, [])
        state.requests.segment(c, step, clears)
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
        state = self.state
        step = state.open_steps.pop(int(r["tid"]), None)
        if step is None:
            return
        if int(r["a"]):  # a pass of several rows, every one a head-dropped request's: no activations
            state.counters.act_sampled_out += 1
            if step.sparse is not None:
                step.sparse.act_uncounted = True
        step.t_end = int(r["ts_ns"])
        groups = step.seq_rows()
        most_rows = max((len(rows) for rows in groups.values()), default=0)
        outputs = list(step.output_index())  # the output rows, in batch order
        state.steps.add_step(
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
            state.layers_seen["attn"].update(state.attn_map.observe(step.sparse))
            state.routes.emit(step)

    def _on_step_agg(self, r: dict[str, Any]) -> None:
        """The aggregate of a one-row micro-batch, sent by its own thread before its end record.
        Records of layers that did not fit it (e.g. attention) may have come before: merge."""
        state = self.state
        if int(r["active"]) == ev.AGG_TIMES_ONLY:  # a pass of several rows: its layer times alone
            return  # (the layer clock took them with the drain)
        step = state.open_steps.get(int(r["tid"]))
        if step is None or int(r["overlap"]):
            unattributed(state)
            return
        verifying = verifying_sparse(state.counters, state.n_expert)
        pre = state.agg_pre.get(int(r["seq"]))
        if not verifying and (step.sparse is None or not step.sparse.from_records):
            # the common case (nothing but maybe attention records came before): the row's
            # values straight off the record
            if pre is not None:
                agg, moe_seen, ffn_seen = StepSparse.from_pre(pre), pre.moe_seen, pre.ffn_seen
            else:
                agg, moe_seen, ffn_seen = StepSparse.from_agg_row(r, state.layers)
        else:  # per-layer stores: checked against the model, or merged with per-layer records
            agg = StepSparse.from_agg(r)
            moe_seen, ffn_seen = list(agg.ids), list(agg.act_zeros)
            if agg.ids:
                verify_routing(agg, state.counters, state.n_expert, state.n_expert_used)
        if step.sparse is None:
            step.sparse = agg
        else:
            step.sparse.merge(agg)
        state.layers_seen["moe"].update(moe_seen)
        state.layers_seen["ffn"].update(ffn_seen)
        if pre is not None:
            state.layers_seen["attn"].update(step.sparse.add_agg_attn_lists(pre.attn, state.layers.attn))
        else:
            state.layers_seen["attn"].update(step.sparse.add_agg_attn(r, state.layers.attn))

    def _on_sparse(self, r: dict[str, Any]) -> None:
        sparse_record(self.state, r)

    def _on_sample_begin(self, r: dict[str, Any]) -> None:
        c = self.state.ctx(int(r["ctx"]))
        c.sampler_seen = True
        c.sampling[int(r["tid"])] = SampleState(idx=int(r["a"]), tid=int(r["tid"]))

    def _on_logits(self, r: dict[str, Any]) -> None:
        c = self.state.ctx(int(r["ctx"]))
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
        state = self.state
        c = state.ctx(int(r["ctx"]))
        tid = int(r["tid"])
        s = c.sampling.pop(tid, None)
        if c.ubatches_seen == 0:
            # the decode this sample finishes ran before the probes were attached: the
            # recording starts at the next one (counted, and not a loss of the recording)
            state.counters.samples_before_first_step += 1
            return
        idx = s.idx if s is not None else int(r["c"])
        logits = None
        if s is not None and s.chunks:
            n_chunks = -(-s.n_vocab // s.chunk_len)
            if len(s.chunks) == n_chunks and all(k in s.chunks for k in range(n_chunks)):
                logits = [s.chunks[k] for k in range(n_chunks)]
            else:
                state.counters.logits_incomplete += 1
        state.requests.sample_end(c, tid, idx, int(r["a"]), logits)

    def _on_head_draw(self, r: dict[str, Any]) -> None:
        state = self.state
        keep = bool(r["b"])
        c, seq = state.ctx(int(r["ctx"])), int(r["a"])
        c.head_draw[seq] = keep
        dropped = self.head_dropped
        st = c.seqs.get(seq)
        if dropped is not None and st is not None and not st.head_judged:
            # the request has no token yet: this draw is the one its first token will take
            # (RequestTokens._add_token_row), and its prompt's rows come after it
            dropped.judge(c.ctx_id, seq, keep)
        if keep:
            state.counters.head_draws_kept += 1
        else:
            state.counters.head_draws_dropped += 1

    def _on_seq_rm(self, r: dict[str, Any]) -> None:
        self._seq_rm(int(r["tid"]), int(r["a"]), int(r["b"]))

    def _seq_rm(self, tid: int, seq: int, p0: int) -> None:
        self.state.pending_clears.setdefault(tid, []).append((seq, p0))

    def _on_mem_clear(self, r: dict[str, Any]) -> None:
        self.state.pending_clears.setdefault(int(r["tid"]), []).append((-1, 0))

    # ---- serving context (llama-server)
    def _on_http(self, r: dict[str, Any]) -> None:
        state = self.state
        if state.serving is not None:
            state.serving.on_http(int(r["tid"]), int(r["ts_ns"]), r["data"])

    def _on_task_post(self, r: dict[str, Any]) -> None:
        self.state.task_post(int(r["tid"]), int(r["a"]), int(r["b"]), int(r["ptr"]))

    def _on_slot_launch(self, r: dict[str, Any]) -> None:
        state = self.state
        if state.serving is not None:
            state.server_check.on_slot_launch(int(r["a"]), int(r["b"]))
            state.serving.on_slot_launch(int(r["ts_ns"]), int(r["a"]), int(r["b"]))

    def _on_slot_child(self, r: dict[str, Any]) -> None:
        state = self.state
        if state.serving is not None:
            state.serving.on_slot_child(int(r["a"]), int(r["c"]), int(r["b"]))

    def _on_slot_release(self, r: dict[str, Any]) -> None:
        """The slot finished its request: emit the request's row now."""
        state = self.state
        state.requests.flush_deferred(int(r["tid"]))
        state.server_check.on_slot_release(int(r["a"]))
        launch = state.serving.slots.get(int(r["a"])) if state.serving is not None else None
        if launch is None:
            return
        for c in state.ctxs.values():
            st = c.seqs.get(launch.slot)
            if st is not None and st.launch_serial == launch.serial:
                state.requests.finish_request(st, "released")

    def _on_slot_token(self, r: dict[str, Any]) -> None:
        self.state.requests.slot_token(int(r["tid"]), int(r["a"]), int(r["b"]))


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
