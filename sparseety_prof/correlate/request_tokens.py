"""Which request each sequence's rows belong to, and the token and request rows that come out.

On llama-server (a built binary or xllamacpp), a sequence serves the request whose task was last
launched on its slot (serving.py: HTTP read -> task post -> slot launch), and the server's own
process_token call says which slot each sampled token went to. Other front ends have no request
objects: a sequence starts a new (segmented) request when
  * the engine removed cells of it from its cache (llama_memory_seq_rm with p0 at or before the
    last cached position, or llama_memory_clear), or
  * a forward pass's input for it is not the continuation: not at the next position, or not the
    token sampled last.
Segmentation and token emission call each other (a continued sequence may emit the token fed
back to it; a token of a sequence never seen starts a request), so they live together here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import itemgetter

import numpy as np

from sparseety_prof.capture.logits_rows import LogitsChunk, owned
from sparseety_prof.capture.plans import LayerSet
from sparseety_prof.correlate.agg_record import AggBlock
from sparseety_prof.correlate.block_tokens import block_tokens
from sparseety_prof.correlate.logit_stats import PendingStats
from sparseety_prof.correlate.pass_arrays import pass_block
from sparseety_prof.correlate.serving import ID_SEGMENTED, Launch, RequestAgg, ServingTracker
from sparseety_prof.correlate.state import Counters, CtxState, HeadDropped, SeqState, Step
from sparseety_prof.correlate.step_sparse import Problems
from sparseety_prof.correlate.tables import (
    NO_SPARSE_VALUES,
    REQUEST_ROW,
    SPARSE_TOKEN_COLUMNS,
    TOKEN_ROW,
    TOKEN_SLOWEST,
    TOKEN_TEXT,
    RowBuffer,
)
from sparseety_prof.store.array_rows import RowParts
from sparseety_prof.store.schema import (
    PHASE_DECODE,
    PHASE_PREFILL,
    SOURCE_NEXT_INPUT,
    SOURCE_SAMPLER,
    Columns,
)

_LOST = "records_lost"
# the per-layer lists of SPARSE_TOKEN_COLUMNS (its first five), which the arrays may hold
SPARSE_LISTS = SPARSE_TOKEN_COLUMNS[:5]  # requests.end_reason: records were lost after its last token seen


@dataclass
class _Deferred:
    """A server sample waiting for its process_token call, which names the slot. It keeps the
    rows of the decode it read: when no call comes, it is emitted at the next sample, after
    another decode may have replaced the context's rows."""

    ctx: CtxState
    idx: int
    token: int
    logits: list[LogitsChunk] | None
    rows: list[tuple[Step, int] | None]
    outputs: list[tuple[Step, int]]


class RequestTokens:
    def __init__(
        self,
        *,
        pid: int,
        wall_offset_ns: int,
        texts: Callable[[list[int]], list[str | None]] | None,
        layers: LayerSet,
        problems: Problems,
        counters: Counters,
        serving: ServingTracker | None,
        slot_tokens: bool,
        head_verdicts: dict[str, bool] | None = None,
    ) -> None:
        self.pid = pid
        self.head_verdicts = head_verdicts  # Correlator's `head_verdicts`
        # RoutesTables.head_dropped (the correlator shares it): sequences whose request drew drop
        self.head_dropped: HeadDropped | None = None
        # Correlator head_rows_apart: the requests whose first token took a drop verdict, until
        # their rows are taken after they finish (take_requests; the policy pops `head_verdicts`
        # as it learns a request: the correlator keeps its own)
        self.dropped_requests: set[str] | None = None
        self.dropped_finished: list[str] = []
        # the rows set apart keep no attention columns: a dropped request's later token rows do
        # not count its attended cells (Correlator, from head_rows_apart's columns)
        self.apart_without_attention = False
        self.wall_offset_ns = wall_offset_ns
        self.texts = texts
        self.layers = layers
        self.problems = problems
        self.counters = counters
        self.serving = serving
        # server: a sample waits for the process_token call that names its slot (by thread)
        self.slot_tokens = slot_tokens
        self.deferred: dict[int, _Deferred] = {}
        self.tokens = RowBuffer(TOKEN_ROW)
        # token rows whose per-layer lists are in an AggBlock: (row in self.tokens, block, its row)
        self._block_rows: list[tuple[int, AggBlock, int]] = []
        # token rows of steps over several slots whose arrays are made when taken (_later)
        self._later_rows: list[tuple[int, Step, int]] = []
        self.stats = PendingStats()
        self.requests = RowBuffer(REQUEST_ROW)  # finished requests
        # the slowest layer of steps by their ids (the correlator's LayerClock.slowest_of), for the
        # token rows when taken
        self.slowest: Callable[[list[int]], Sequence[tuple[object, object, object]]] | None = None

    # ------------------------------------------------------------------ rows out
    def take_tokens(self) -> Columns | RowParts:
        """Token rows since the last call, with their logits statistics and texts: columns, or
        RowParts when the per-layer lists of rows are in AggBlocks (block_tokens). Their step's
        slowest layer from `slowest` (LayerClock.slowest_of), null columns without it."""
        tok = self.tokens.take()
        self.stats.fill(tok)
        step_ids = tok["step_id"]
        if self.slowest is not None and step_ids:
            per_token = self.slowest(step_ids)  # type: ignore[arg-type]
            for name, col in zip(TOKEN_SLOWEST, zip(*per_token, strict=True), strict=True):
                tok[name] = list(col)
        else:
            for name in TOKEN_SLOWEST:
                tok[name] = [None] * len(step_ids)
        ids = tok["token_id"]
        if self.texts is not None and ids:
            tok[TOKEN_TEXT] = list(self.texts([int(t) for t in ids]))  # type: ignore[call-overload]
        else:  # no vocabulary: the text column stays null
            tok[TOKEN_TEXT] = [None] * len(ids)
        blocks, self._block_rows = self._block_rows, []
        later, self._later_rows = self._later_rows, []
        if later:  # the routes rows were taken first: the slot steps' arrays are made
            for r, step, i in later:
                block = self._block_of(step, i)
                if block is not None:
                    blocks.append((r, *block))
                else:  # a step the arrays did not take: its per-row values
                    values = self._row_lists(step, i)
                    for name, value in zip(SPARSE_LISTS, values, strict=False):
                        tok[name][r] = value
            blocks.sort(key=itemgetter(0))
        return block_tokens(tok, blocks) if blocks else tok

    def take_requests(self, ctxs: Iterable[CtxState], *, final: bool) -> Columns:
        """Rows of the requests that ended since the last call; with `final`, every request
        still open too (end_reason "detached" unless one is known)."""
        if final:
            for c in ctxs:
                for st in c.seqs.values():
                    self.finish_request(st, "detached")
        if self.dropped_finished:  # their rows are all taken (take_tokens first): forgotten
            assert self.dropped_requests is not None
            self.dropped_requests.difference_update(self.dropped_finished)
            self.dropped_finished = []
        return self.requests.take()

    def keep_deferred(self) -> None:
        """The deferred samples' logits are views into the drained batch: copy them before the
        next drain reuses its memory."""
        for d in self.deferred.values():
            if d.logits is not None:
                d.logits = [owned(x) for x in d.logits]

    # ------------------------------------------------------------------ requests
    def segment(self, c: CtxState, step: Step, clears: list[tuple[int, int]]) -> None:
        """Give each sequence of a new micro-batch its request: the one it continues, or a new one."""
        tokens, positions = step.token.tolist(), step.pos.tolist()  # (read per sequence)
        for seq, rows in sorted(step.seq_rows().items()):
            first = int(rows[0])
            tok, pos = tokens[first], positions[first]
            st = c.seqs.get(seq)
            unsure = seq in c.unsure
            c.unsure.discard(seq)
            launch = self.serving.slots.get(seq) if self.serving is not None else None
            if launch is not None and (st is None or launch.serial > st.launch_serial):
                # the server launched a task on this slot since: a new request, whatever the
                # positions say (a cached prompt prefix makes a new request look continued)
                self.new_request(c, seq, step, rows, launch=launch, old_end=_LOST if unsure else None)
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
                st.max_pos = max(st.max_pos, pos if len(rows) == 1 else int(step.pos[rows].max()))
                continue
            # A new request. Seen for the first time since attach (or since records were lost) as a
            # lone token past position 0, it was most likely already running: partial (a
            # prefix-cache hit that leaves a single prompt token to evaluate looks the same;
            # partial errs on the safe side).
            partial = (st is None or unsure) and len(rows) == 1 and pos > 0
            # the request it replaces may have run on in steps the records of were lost
            self.new_request(c, seq, step, rows, partial=partial, old_end=_LOST if unsure else None)

    def new_request(
        self,
        c: CtxState,
        seq: int,
        step: Step,
        rows: np.ndarray,
        *,
        partial: bool = False,
        launch: Launch | None = None,
        old_end: str | None = None,
    ) -> None:
        old = c.seqs.get(seq)
        if old is not None:
            self.finish_request(old, old_end)
        if self.head_dropped:
            self.head_dropped.forget(c.ctx_id, seq)  # the new request is not judged yet
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

    def finish_request(self, st: SeqState, reason: str | None) -> None:
        if st.agg is None:
            return
        if st.agg.end_reason is None:
            st.agg.end_reason = reason
        self.requests.add(**st.agg.row())
        st.agg = None
        if self.dropped_requests and st.request_id in self.dropped_requests:
            self.dropped_finished.append(st.request_id)

    def _maybe_next_input(self, c: CtxState, st: SeqState, step: Step, row: int, n_rows: int) -> None:
        """Engines that sample without a probed sampler call: the token is the next input.

        Only a continuation of exactly one row is a sampled token fed back; more rows are the
        next chunk of a prompt evaluated over several decode calls."""
        pending, st.next_input_pending = st.next_input_pending, None
        if c.sampler_seen or pending is None or n_rows != 1:
            return
        prev_step, prev_row = pending
        self.emit_token(c, prev_step, prev_row, int(step.token[row]), step.tid, SOURCE_NEXT_INPUT, None)

    # ------------------------------------------------------------------ samples and tokens
    def sample_end(
        self, c: CtxState, tid: int, idx: int, token: int, logits: list[LogitsChunk] | None
    ) -> None:
        """A sampler call returned `token` for llama_get_logits_ith's index `idx`."""
        if self.slot_tokens:
            # the server's process_token call for this sample names its slot: wait for it (a
            # sample it never hands to a slot is emitted by batch index when the next comes)
            self.flush_deferred(tid)
            self.deferred[tid] = _Deferred(c, idx, token, logits, c.rows, c.outputs)
            return
        self.emit_sample(c, idx, token, tid, logits)

    def sample_to_slot(
        self, c: CtxState, tid: int, idx: int, token: int, logits: list[LogitsChunk] | None, slot: int
    ) -> None:
        """sample_end, then slot_token naming `slot` for it (the server's process_token call came
        right after the sampler call), without the deferral in between."""
        self.flush_deferred(tid)
        self.emit_sample(c, idx, token, tid, logits, slot=slot, decode=(c.rows, c.outputs))

    def slot_token(self, tid: int, slot: int, token: int) -> None:
        """The server handed the thread's last sampled token to `slot`."""
        d = self.deferred.pop(tid, None)
        if d is None:
            return
        if d.token != token and self.serving is not None:
            self.serving.counters.slot_token_mismatch += 1
        self.emit_sample(d.ctx, d.idx, d.token, tid, d.logits, slot=slot, decode=(d.rows, d.outputs))

    def flush_deferred(self, tid: int) -> None:
        d = self.deferred.pop(tid, None)
        if d is not None:
            # resolved against the decode it sampled from, not the one running now
            self.emit_sample(d.ctx, d.idx, d.token, tid, d.logits, decode=(d.rows, d.outputs))

    def emit_sample(
        self,
        c: CtxState,
        idx: int,
        token: int,
        tid: int,
        logits: list[LogitsChunk] | None,
        slot: int | None = None,
        decode: tuple[list[tuple[Step, int] | None], list[tuple[Step, int]]] | None = None,
    ) -> None:
        """`decode`: the rows and output rows of the decode the sample read (default: the
        context's current decode)."""
        rows, outputs = decode if decode is not None else (c.rows, c.outputs)
        where = self._resolve(rows, outputs, idx)
        if slot is not None and (where is None or int(where[0].seq[where[1]]) != slot):
            # the batch index does not lead to the slot's row (the micro-batch was split and
            # reordered by sequence): the slot's only output row of this decode is the one
            mine = [(st, i) for st, i in outputs if int(st.seq[i]) == slot]
            where = mine[0] if len(mine) == 1 else None
            if where is None:
                self.counters.slot_tokens_unresolved += 1
                return
        if where is None:
            self.counters.samples_unresolved += 1
            return
        step, i = where
        self.emit_token(c, step, i, token, tid, SOURCE_SAMPLER, logits)

    @staticmethod
    def _resolve(
        rows: list[tuple[Step, int] | None], outputs: list[tuple[Step, int]], idx: int
    ) -> tuple[Step, int] | None:
        """Map llama_get_logits_ith's index to a micro-batch row: negative = from the end of the
        decode's outputs, otherwise a position in the decode's batch (micro-batches in order).

        A decode split into several micro-batches with outputs of several sequences may have
        been split by sequence (split_equal), which reorders rows: batch positions are then not
        known, and the sample is counted as unresolved rather than given to the wrong sequence."""
        if idx < 0:
            j = len(outputs) + idx
            return outputs[j] if 0 <= j < len(outputs) else None
        if len({id(s) for s, _ in outputs}) > 1 and len({int(s.seq[i]) for s, i in outputs}) > 1:
            return None
        row = rows[idx] if idx < len(rows) else None
        if row is None:
            return None
        step, i = row
        return (step, i) if step.output[i] else None

    def _block_of(self, step: Step, i: int) -> tuple[AggBlock, int] | None:
        """Where an AggBlock holds row i's per-layer lists as row_values would make them: a
        one-row step's aggregate record; when every layer is MoE and FFN, also a regular
        prompt's arrays (pass_arrays; its output rows hold every layer) or a step over several
        slots made arrays with the steps around it (slot_steps)."""
        layers = self.layers
        sp = step.sparse
        if sp is None or not layers.moe:
            return None
        if step.n_tokens == 1:  # (routing columns: the MoE layers; activations: the FFN layers)
            return sp.agg_block_row()
        if layers.moe != layers.ffn:
            return None
        if sp._slot_block is not None:
            block, row0 = sp._slot_block
            return block, row0 + i
        if len(step.seq) > 1 and not step.over_slots():  # (a step over slots is no prompt: takes_arrays)
            got = pass_block(step, layers)
            if got is not None and got.whole[i]:
                return got.block, i
        return None

    def _row_lists(self, step: Step, i: int) -> tuple[object, ...]:
        """Row i's sparse columns (SPARSE_TOKEN_COLUMNS order) from its per-row values."""
        assert step.sparse is not None
        v = step.sparse.row_values(
            step.row_offset + i, step.output_index(), step.n_tokens, self.layers, self.problems
        )
        att = [a for a in v["attn_attended"] if a is not None]
        return (
            v["expert_ids"] if self.layers.moe else [],
            v["expert_weights"] if self.layers.moe else [],
            v["router_probs"] if v["router_probs"].count(None) < len(v["router_probs"]) else None,
            v["act_zero_ratio"],
            v["act_below_ratio"],
            v["attn_attended"],
            max(att) if att else None,
        )

    def _later(self, step: Step) -> bool:
        """A step over several slots whose arrays are made when the routes rows are taken, with
        the steps after it (slot_steps.py): its token rows' per-layer lists wait for them."""
        layers = self.layers
        return bool(layers.moe) and layers.moe == layers.ffn and step.over_slots()

    def emit_token(
        self,
        c: CtxState,
        step: Step,
        i: int,
        token: int,
        tid: int,
        source: str,
        logits: list[LogitsChunk] | None,
    ) -> None:
        """The token row of `token`, sampled from row i of `step`."""
        seq = int(step.seq[i])
        logits_pos = int(step.pos[i])
        st = c.seqs.get(seq)
        if st is None:  # attached between a forward pass and its sampling
            self.new_request(c, seq, step, np.array([i]), partial=True)
            st = c.seqs[seq]
        if logits is not None:  # statistics are computed for the whole drain in take_tokens
            self.stats.add(len(self.tokens), logits)
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
        sparse_values: tuple[object, ...] = NO_SPARSE_VALUES
        sp = step.sparse
        block = self._block_of(step, i) if sp is not None else None
        if sp is not None and (block is not None or self._later(step)):
            # the row's routing and activations are all in an AggBlock (the drain's aggregate
            # records, or the pass's arrays): its per-layer lists stay there (block_tokens); or
            # they are set when the rows are taken (take_tokens), from the run's arrays. Only the
            # attention is made here, unless the row goes apart without attention columns (a
            # request already judged dropped: the first token's verdict is taken with its row)
            dropped = self.dropped_requests
            if not (self.apart_without_attention and st.head_judged and dropped and st.request_id in dropped):
                sparse_values = self._attention_values(sp.attended(step.row_offset + i, self.layers.attn))
            if block is not None:
                self._block_rows.append((len(self.tokens), *block))
            else:
                self._later_rows.append((len(self.tokens), step, i))
        elif sp is not None:
            sparse_values = self._row_lists(step, i)
        self._add_token_row(
            c,
            st,
            seq,
            logits_pos,
            token,
            source,
            step.step_id,
            step.t_start,
            step.t_end,
            step.n_tokens,
            tid,
            sparse_values,
        )

    @staticmethod
    def _attention_values(attended: list[int | None]) -> tuple[object, ...]:
        """A row's sparse columns when only its attention is made here: the attended cells per
        attention layer and the most of them (the other lists come from an AggBlock)."""
        cells = [a for a in attended if a is not None]
        return (None, None, None, None, None, attended, max(cells) if cells else None)

    def one_row_token(
        self,
        c: CtxState,
        st: SeqState,
        step_id: int,
        seq: int,
        pos: int,
        token: int,
        tid: int,
        t_start: int,
        t_end: int,
        logits: list[LogitsChunk] | None,
        attended: list[int | None],
        block: tuple[AggBlock, int],
    ) -> None:
        """emit_token's effect for the sampler's token of a one-row step that continues its
        sequence (st.samples > 0) and whose values are all in `block`, from the step's values
        (fast_step, before its Step is made); `attended`: the row's attended cells per attention
        layer."""
        if logits is not None:
            self.stats.add(len(self.tokens), logits)
        self._block_rows.append((len(self.tokens), *block))
        self._add_token_row(
            c,
            st,
            seq,
            pos,
            token,
            SOURCE_SAMPLER,
            step_id,
            t_start,
            t_end,
            1,
            tid,
            self._attention_values(attended),
        )

    def one_row_tokens(
        self,
        c: CtxState,
        st: SeqState,
        step_ids: list[int],
        seq: int,
        positions: list[int],
        sampled: list[int],
        tid: int,
        t_starts: list[int],
        t_ends: list[int],
        logits: list[list[LogitsChunk]] | None,
        attended: list[list[int | None]],
        most_attended: list[int | None],
        block: AggBlock,
        block_rows: list[int],
    ) -> None:
        """one_row_token for a run of one-row steps that continue sequence `seq` (plain_run.py):
        the same rows, made with zip over their columns (`most_attended`: each row's most
        attended cells over its layers)."""
        n = len(step_ids)
        at = len(self.tokens)
        if logits is not None:
            self.stats.add_run(at, logits)
        self._block_rows.extend(zip(range(at, at + n), [block] * n, block_rows, strict=True))
        partial = st.partial
        offset = self.wall_offset_ns
        nothing = [None] * n
        self.tokens.extend_values(
            zip(
                [st.request_id] * n,
                [c.ctx_id] * n,
                [seq] * n,
                nothing if partial else range(st.samples, st.samples + n),
                [p + 1 for p in positions],
                positions,
                [PHASE_DECODE] * n,  # (st.samples > 0)
                sampled,
                [SOURCE_SAMPLER] * n,
                step_ids,
                t_starts,
                t_ends,
                [(t + offset) // 1_000_000 for t in t_ends],
                [1] * n,
                [partial] * n,
                [self.pid] * n,
                [tid] * n,
                [p + 1 for p in positions],
                nothing,
                nothing,
                nothing,
                nothing,
                nothing,
                attended,
                most_attended,
                strict=True,
            )
        )
        st.samples += n
        st.expect_token = sampled[-1]
        if st.agg is not None:
            for pos, t_end, token in zip(positions, t_ends, sampled, strict=True):
                st.agg.add_token(pos, t_end, token)

    def _add_token_row(
        self,
        c: CtxState,
        st: SeqState,
        seq: int,
        logits_pos: int,
        token: int,
        source: str,
        step_id: int,
        t_start: int,
        t_end: int | None,
        n_tokens: int,
        tid: int,
        sparse_values: tuple[object, ...],
    ) -> None:
        """The token row, and the sequence's state after it."""
        if self.head_verdicts is not None and not st.head_judged:
            # the request's first token: the probes copied its logits row if its sequence's last
            # draw kept it (a sequence with no draw yet, none of its outputs listed, was copied)
            st.head_judged = True
            keep = self.head_verdicts[st.request_id] = c.head_draw.get(seq, True)
            if self.head_dropped is not None:  # (the draw may have judged it already)
                self.head_dropped.judge(c.ctx_id, seq, keep)
            if not keep and self.dropped_requests is not None:
                self.dropped_requests.add(st.request_id)
        # in TOKEN_ROW order: one tuple per token, no keyword dict (a row per token)
        self.tokens.add_values(
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
                step_id,
                t_start,
                t_end,
                (t_end + self.wall_offset_ns) // 1_000_000 if t_end is not None else None,
                n_tokens,
                st.partial,
                self.pid,
                tid,
                logits_pos + 1,
                *sparse_values,
            )
        )
        st.samples += 1
        st.expect_token = token
        if st.agg is not None:
            st.agg.add_token(logits_pos, t_end, token)
