"""The one-row decode step, the bulk of any generation, taken from the drained records' columns.

A one-row micro-batch followed by its aggregate, its end and the sampler call that reads its
logits, with nothing else between them, is handled here in one go: the effect of the
correlator's _on_ubatch, _on_step_agg, _on_ubatch_end, _on_sample_begin, _on_logits and
_on_sample_end, without making each record a dict or the row's values numpy arrays. On
llama-server, the effect of _on_slot_token too when the server's call that names the sample's
slot is the next record; otherwise the sample is deferred as _on_sample_end defers it. Anything
unusual leaves it to those handlers.

Most of a generation's steps are plainer still: the sequence continues, the routing and
activations are all in the drain's AggBlock, the attention comes from the learned map
(AttentionMap.attend_one_row). _plain_step makes their rows from the step's values, and the Step
object (with its sparse values and attention state) only for the last of them, when anything
may read it (make_unmade): the step before is dropped unread when its context's next decode
replaces its rows. (docs/overhead.md: "Decode steps without a Step object".) The plain steps
that follow one another after it are taken at once, as columns (plain_run.py).

Both must stay in lockstep with the handlers: tests/test_correlator.py's
test_fast_one_row_steps_equal_the_record_by_record_path and
test_fast_one_row_steps_equal_the_handlers_on_the_server compare them.
"""

from __future__ import annotations

from sparseety_prof.capture import events as ev
from sparseety_prof.capture.logits_rows import LogitsChunk
from sparseety_prof.correlate.agg_record import AggRow
from sparseety_prof.correlate.drain_index import G_SMALL, G_UBATCH_S, DrainIndex
from sparseety_prof.correlate.feed_state import UNMADE_ROWS, FeedState, UnmadeStep
from sparseety_prof.correlate.state import CtxState, SeqState, Step
from sparseety_prof.correlate.step_sparse import StepSparse
from sparseety_prof.correlate.verification import VERIFY_UBATCHES, verifying_sparse
from sparseety_prof.store.schema import PHASE_DECODE, SOURCE_SAMPLER


def fast_step(state: FeedState, idx: DrainIndex, i: int) -> int:
    """The one-row step whose micro-batch is record i (Correlator._fast_step: it changes the
    feed state as the handlers do). Returns the index after the step's records, or 0 when
    anything is unusual (then the handlers take every record as usual)."""
    at = _step_records(idx, i)
    if at is None or not _checks_done(state):
        return 0
    agg_at, end_at, begin_at, sample_at = at
    f = idx.fast()
    u = idx.row[i] + (f.ub_small_at if idx.group[i] == G_UBATCH_S else 0)  # in the micro-batch columns
    if not f.ub_one_row[u]:
        return 0
    tid, ctx = f.ub_tid[u], f.ub_ctx[u]
    s_tid, s_ctx = f.s_tid, f.s_ctx
    end, begin, sample = idx.row[end_at], idx.row[begin_at], idx.row[sample_at]
    if s_tid[end] != tid or s_tid[begin] != tid or s_tid[sample] != tid:
        return 0
    if s_ctx[begin] != ctx or s_ctx[sample] != ctx:
        return 0
    want = f.s_a[begin]  # llama_get_logits_ith's index: this row either way
    if want != -1 and want != 0:
        return 0
    c = state.ctxs.get(ctx)
    if c is None or not c.sampler_seen or (c.decode_seen and c.rows):
        return 0
    seq = f.ub_seq[u]
    st = c.seqs.get(seq)
    if st is None or not _continues(state, st, tid, seq, f.ub_pos[u], f.ub_token[u]):
        return 0
    pre: AggRow | None = None
    if agg_at >= 0:
        pre = _aggregate(state, idx, agg_at, tid)
        if pre is None:
            return 0
    ok, logits = _logits(idx, begin_at + 1, sample_at, tid, ctx)
    if not ok:
        return 0
    if state.unmade is not None:  # the last step not made yet: its rows are replaced below
        if state.unmade.c is c:
            state.unmade = None
        else:
            make_unmade(state)
    slot_at = _slot_call_at(state, idx, sample_at, tid, seq)
    if (
        pre is not None
        and pre.block is not None
        and st.samples > 0
        and (not state.slot_tokens or slot_at >= 0)
        and not state.routes.with_masks
    ):
        attn = state.attn_map.attend_one_row(pre.attn)
        if attn is not None:
            return _plain_step(state, c, st, idx, u, end_at, sample_at, slot_at, pre, attn, logits)
    return _made_step(state, c, st, idx, u, end_at, sample_at, slot_at, pre, logits)


def _step_records(idx: DrainIndex, i: int) -> tuple[int, int, int, int] | None:
    """Where the records of a one-row step whose micro-batch is record i are: its aggregate
    (-1 when none), its end, its sampler call's begin and end (its logits records between
    them); None when they do not follow one another so."""
    kinds, n = idx.kinds, len(idx)
    j = i + 1
    agg_at = -1
    if j < n and kinds[j] == ev.EV_STEP_AGG:
        agg_at, j = j, j + 1
    if j + 1 >= n or kinds[j] != ev.EV_UBATCH_END or kinds[j + 1] != ev.EV_SAMPLE_BEGIN:
        return None
    end_at, begin_at = j, j + 1
    j += 2
    while j < n and kinds[j] == ev.EV_LOGITS:
        j += 1
    if j >= n or kinds[j] != ev.EV_SAMPLE_END:
        return None
    return agg_at, end_at, begin_at, j


def _checks_done(state: FeedState) -> bool:
    """The first micro-batches' checks are done (they need the handlers) and none is open."""
    if state.counters.verified_ubatches < VERIFY_UBATCHES or state.open_steps:
        return False
    # the server's struct offsets are checked on micro-batches first
    return state.serving is None or state.server_check.done


def _continues(state: FeedState, st: SeqState, tid: int, seq: int, pos: int, token: int) -> bool:
    """The step's one row continues its sequence's request: the next position, fed the token
    expected, nothing since that would start a new request (a sample never handed to a slot, a
    task launched on the slot, a cut of the sequence)."""
    if pos != st.max_pos + 1 or (st.expect_token is not None and st.expect_token != token):
        return False
    if state.slot_tokens and tid in state.requests.deferred:
        return False  # a sample the server never handed to a slot: emitted before segmentation
    if state.serving is not None:
        launch = state.serving.slots.get(seq)
        if launch is not None and launch.serial > st.launch_serial:
            return False  # a task launched on the slot since: a new request, whatever the positions say
    clears = state.pending_clears.get(tid)
    # a cut of the sequence: segmentation starts a new request
    return not (clears and any(cs in (-1, seq) and p0 <= st.max_pos for cs, p0 in clears))


def _aggregate(state: FeedState, idx: DrainIndex, agg_at: int, tid: int) -> AggRow | None:
    """The step's aggregate record's values, worked out for the drain (agg_rows_batch), when
    _on_step_agg would take them straight off it; else None."""
    f = idx.fast()
    a = idx.row[agg_at]
    if f.agg_tid[a] != tid or f.agg_overlap[a]:
        return None
    if verifying_sparse(state.counters, state.n_expert):
        return None
    return state.agg_pre.get(f.agg_seq[a])


def _slot_call_at(state: FeedState, idx: DrainIndex, sample_at: int, tid: int, seq: int) -> int:
    """On llama-server, the index of the process_token call that names this step's slot when it
    is the next record after the sampler call; else -1."""
    k = sample_at + 1
    if not state.slot_tokens or k >= len(idx) or idx.kinds[k] != ev.EV_SLOT_TOKEN or idx.group[k] != G_SMALL:
        return -1
    f = idx.fast()
    r = idx.row[k]
    return k if f.s_tid[r] == tid and f.s_a[r] == seq else -1


def _made_step(
    state: FeedState,
    c: CtxState,
    st: SeqState,
    idx: DrainIndex,
    u: int,
    end_at: int,
    sample_at: int,
    slot_at: int,
    pre: AggRow | None,
    logits: list[LogitsChunk] | None,
) -> int:
    """The rest of fast_step for a step whose Step is made now: the effect of the handlers of
    its records, in their order. Returns the index after the records taken."""
    f = idx.fast()
    tid, seq, pos, token = f.ub_tid[u], f.ub_seq[u], f.ub_pos[u], f.ub_token[u]
    # _on_ubatch
    step_id = _step_begins(state, c, st, tid, seq, pos)
    tok1, pos1, seq1, out1 = f.ub_rows
    step = Step(
        step_id=step_id,
        ctx_id=c.ctx_id,
        decode_id=c.decode_id,
        tid=tid,
        t_start=f.ub_ts[u],
        t_end=f.s_ts[idx.row[end_at]],
        token=tok1[u],
        pos=pos1[u],
        seq=seq1[u],
        output=out1[u],
        n_tokens=1,
        truncated=False,
        decode_rows=1 if st.samples > 0 else 0,
        _output_index={0: 0},
    )
    c.rows, c.outputs = [(step, 0)], [(step, 0)]
    seen = state.layers_seen
    # _on_step_agg
    if pre is not None:
        step.sparse = StepSparse.from_pre(pre)
        seen["moe"].update(pre.moe_seen)
        seen["ffn"].update(pre.ffn_seen)
        seen["attn"].update(step.sparse.add_agg_attn_lists(pre.attn, state.layers.attn))
    # _on_ubatch_end
    state.steps.add_step(step, 1, PHASE_DECODE, [seq], [token], [pos], [seq], [0])
    if step.sparse is not None:
        seen["attn"].update(state.attn_map.observe(step.sparse))
        # a step whose record routed and counted nothing (the sparse probes out: --duty-cycle)
        # has no routes row to make: a layer gets one for its expert ids or activations
        if pre is None or pre.moe_seen or pre.ffn_seen:
            state.routes.emit(step)
    # _on_sample_begin .. _on_sample_end
    c.sampling.pop(tid, None)
    sampled = f.s_a[idx.row[sample_at]]
    if not state.slot_tokens:
        state.requests.emit_token(c, step, 0, sampled, tid, SOURCE_SAMPLER, logits)
        return sample_at + 1
    # llama-server: the sample waits for the process_token call that names its slot. When that
    # is the next record and names this row's sequence, _on_slot_token's effect here and now.
    if slot_at >= 0:
        _slot_token_check(state, idx, slot_at, sampled)
        state.requests.emit_token(c, step, 0, sampled, tid, SOURCE_SAMPLER, logits)
        return slot_at + 1
    want = f.s_a[idx.row[end_at + 1]]  # the sampler's begin (it follows the end): its row index
    state.requests.sample_end(c, tid, want, sampled, logits)
    return sample_at + 1


def _slot_token_check(state: FeedState, idx: DrainIndex, slot_at: int, sampled: int) -> None:
    """_on_slot_token's check: the token the server handed to the slot is the one sampled."""
    if idx.col(G_SMALL, "b")[idx.row[slot_at]] != sampled and state.serving is not None:
        state.serving.counters.slot_token_mismatch += 1


def _step_begins(state: FeedState, c: CtxState, st: SeqState, tid: int, seq: int, pos: int) -> int:
    """_on_ubatch's effect on the correlator's state for a one-row step that continues its
    sequence (with a sampler seen, no next-input token is pending). Returns its step id."""
    if not c.decode_seen:
        c.decode_id += 1
    c.ubatches_seen += 1
    step_id = state.next_step_id
    state.next_step_id += 1
    state.pending_clears.pop(tid, None)
    st.next_input_pending = None
    st.expect_token = None
    st.max_pos = max(st.max_pos, pos)
    if c.unsure:
        c.unsure.discard(seq)  # it continued: nothing of it was lost
    return step_id


def _plain_step(
    state: FeedState,
    c: CtxState,
    st: SeqState,
    idx: DrainIndex,
    u: int,
    end_at: int,
    sample_at: int,
    slot_at: int,
    pre: AggRow,
    attn: tuple[list[int], list[int | None]],
    logits: list[LogitsChunk] | None,
) -> int:
    """The rest of fast_step for the bulk of a generation: a step that continues its sequence,
    with its routing and activations all in the drain's AggBlock and its attention from the
    learned map (attn: AttentionMap.attend_one_row's); on llama-server, one whose slot's call
    is the next record (slot_at). Its rows are made from its values; its
    Step, which only its context's rows hold (c.rows, c.outputs), is made by make_unmade when
    anything may read those, and never when the context's next step replaces them first
    (feed, _decode_begin): the effect of the steps below, at a fraction of the cost."""
    f = idx.fast()
    tid, seq, pos, token = f.ub_tid[u], f.ub_seq[u], f.ub_pos[u], f.ub_token[u]
    t_start, t_end = f.ub_ts[u], f.s_ts[idx.row[end_at]]
    assert pre.block is not None
    block = (pre.block, pre.block_row)
    # _on_ubatch
    step_id = _step_begins(state, c, st, tid, seq, pos)
    state.unmade = UnmadeStep(c, step_id, c.decode_id, tid, t_start, t_end, f.ub_rows, u, pre)
    c.rows = c.outputs = UNMADE_ROWS
    # _on_step_agg, _on_ubatch_end
    state.layers_seen["moe"].update(pre.moe_seen)
    state.layers_seen["ffn"].update(pre.ffn_seen)
    filled, attended = attn
    state.steps.add_values(
        step_id,
        c.ctx_id,
        c.decode_id,
        t_start,
        t_end,
        1,
        1,
        PHASE_DECODE,
        1,
        [seq],
        [token],
        [pos],
        [seq],
        [0],
        False,
        tid,
    )
    state.layers_seen["attn"].update(filled)
    state.routes.one_row_block(step_id, c.ctx_id, seq, pos, block)
    # _on_sample_begin .. _on_sample_end
    c.sampling.pop(tid, None)
    sampled = f.s_a[idx.row[sample_at]]
    if slot_at >= 0:  # llama-server: the call that names its slot is the next record
        _slot_token_check(state, idx, slot_at, sampled)
    state.requests.one_row_token(
        c, st, step_id, seq, pos, sampled, tid, t_start, t_end, logits, attended, block
    )
    return slot_at + 1 if slot_at >= 0 else sample_at + 1


def make_unmade(state: FeedState) -> None:
    """Make the Step of the last _plain_step (when anything may read it: the feed loop,
    _decode_begin and fast_step call this): the Step, its sparse values and its attention state
    as fast_step's other path leaves them, in its context's rows."""
    um, state.unmade = state.unmade, None
    if um is None or um.c.rows is not UNMADE_ROWS:
        return  # (its rows were replaced: nothing reads it)
    tok1, pos1, seq1, out1 = um.rows
    step = Step(
        step_id=um.step_id,
        ctx_id=um.c.ctx_id,
        decode_id=um.decode_id,
        tid=um.tid,
        t_start=um.t_start,
        t_end=um.t_end,
        token=tok1[um.u],
        pos=pos1[um.u],
        seq=seq1[um.u],
        output=out1[um.u],
        n_tokens=1,
        truncated=False,
        decode_rows=1,
        _output_index={0: 0},
    )
    step.sparse = StepSparse.from_pre(um.pre)
    state.attn_map.fill_state(step.sparse, um.pre.attn)  # (the map and record attend_one_row took)
    um.c.rows, um.c.outputs = [(step, 0)], [(step, 0)]


def _logits(
    idx: DrainIndex, start: int, end: int, tid: int, ctx: int
) -> tuple[bool, list[LogitsChunk] | None]:
    """The logits chunks of records start..end (one sampler call's), as _on_logits and
    _on_sample_end assemble them (None when there are none); False first when they are not all
    of this thread and context, complete and in order (then the handlers take them, and count
    them)."""
    if start >= end:
        return True, None
    f = idx.fast()
    rows = idx.row[start:end]
    for r in rows:
        if f.lg_tid[r] != tid or f.lg_ctx[r] != ctx:
            return False, None
    n_chunks = -(-f.lg_n_vocab[rows[-1]] // idx.logits_chunk)
    if len(rows) != n_chunks or n_chunks > ev.MAX_LOGITS_CHUNKS:
        return False, None  # _on_logits leaves chunks past MAX_LOGITS_CHUNKS out: incomplete
    if any(f.lg_chunk[r] != k for k, r in enumerate(rows)):
        return False, None
    vals = idx.logits_vals
    return True, [vals(r)[: f.lg_n_vals[r]] for r in rows]


def fast_sample(state: FeedState, idx: DrainIndex, i: int) -> int:
    """A sampler call whose begin is record i, its logits and its end, when nothing else comes
    between them and its context has run a micro-batch: the effect of _on_sample_begin,
    _on_logits and _on_sample_end, from the records' columns (the samples of a micro-batch of
    several rows, where fast_step does not apply), and on llama-server _on_slot_token's when the
    call that names the sample's slot is the next record. Returns the index after the last record
    taken, or 0 (the handlers take every record as usual)."""
    kinds, n = idx.kinds, len(idx)
    j = i + 1
    while j < n and kinds[j] == ev.EV_LOGITS:
        j += 1
    if j >= n or kinds[j] != ev.EV_SAMPLE_END or idx.group[j] != G_SMALL or idx.group[i] != G_SMALL:
        return 0
    f = idx.fast()
    b, e = idx.row[i], idx.row[j]
    tid, ctx = f.s_tid[b], f.s_ctx[b]
    if f.s_tid[e] != tid or f.s_ctx[e] != ctx:
        return 0
    c = state.ctxs.get(ctx)
    if c is None or c.ubatches_seen == 0:
        return 0  # a sample of a decode from before the attach: _on_sample_end counts it
    ok, logits = _logits(idx, i + 1, j, tid, ctx)
    if not ok:
        return 0
    c.sampler_seen = True
    c.sampling.pop(tid, None)  # a begin whose end was lost: this begin replaced it, this end ends it
    k = j + 1
    if state.slot_tokens and k < n and kinds[k] == ev.EV_SLOT_TOKEN and idx.group[k] == G_SMALL:
        r = idx.row[k]
        if f.s_tid[r] == tid:
            # llama-server's process_token call for this sample, next: sample_end's deferral and
            # _on_slot_token's emission at once (each slot of a step over several: its own)
            sampled = f.s_a[e]
            _slot_token_check(state, idx, k, sampled)
            state.requests.sample_to_slot(c, tid, f.s_a[b], sampled, logits, int(f.s_a[r]))
            return k + 1
    state.requests.sample_end(c, tid, f.s_a[b], f.s_a[e], logits)
    return j + 1
