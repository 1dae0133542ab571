"""Runs of one-row decode steps, taken as columns.

After a _plain_step (fast_step.py), the records of a generation usually repeat it step after
step: the decode call, its one-row micro-batch, its aggregate record, the micro-batch's end, the
sampler's begin, its logits records and its end (on llama-server, then the call that names the
step's slot). plain_run takes every such step that follows at once: fast_step's checks as numpy
comparisons over the drain's columns, its effects (and those of the feed loop's _decode_begin
before each step) as columns zipped into rows. The last step is left unmade, as _plain_step
leaves it. (docs/overhead.md: "Runs of decode steps as columns".)

What fast_step reads and a plain step does not change holds for the whole run as it held for
the step before it: verification done, no open step, the server's checks done, no sample
deferred, no slot launched, no sequence cut, routing checks done, no masks' rows, the attention
map learned. What a step changes (its sequence's position and expected token, the context's
decode) is checked step against step. A step that fails a check ends the run; fast_step takes
it, or the handlers.

tests/test_correlator.py's test_fast_one_row_steps_equal_the_record_by_record_path and
test_fast_one_row_steps_equal_the_handlers_on_the_server compare every table and every piece of
state with the record-by-record path.
"""

from __future__ import annotations

from operator import itemgetter
from typing import NamedTuple

import numpy as np

from sparseety_prof.capture import events as ev
from sparseety_prof.capture.logits_rows import LogitsChunk
from sparseety_prof.correlate.agg_record import AggRow
from sparseety_prof.correlate.drain_index import (
    G_LOGITS,
    G_SMALL,
    G_STEP_AGG,
    G_UBATCH,
    G_UBATCH_S,
    DrainIndex,
)
from sparseety_prof.correlate.feed_state import UNMADE_ROWS, FeedState, UnmadeStep
from sparseety_prof.correlate.state import CtxState, SeqState

#: fewer steps than this go one by one (fast_step): the run's numpy set-up costs more
MIN_RUN = 3
#: a step's records before its logits (decode call, micro-batch, aggregate, end, sampler begin)
_HEAD = (ev.EV_DECODE_BEGIN, ev.EV_UBATCH, ev.EV_STEP_AGG, ev.EV_UBATCH_END, ev.EV_SAMPLE_BEGIN)
_HEAD_GROUPS = (G_SMALL, -1, G_STEP_AGG, G_SMALL, G_SMALL)  # -1: either micro-batch layout
#: records a step may have before its decode call, each at most once
_BEFORE = (ev.EV_SEQ_RM, ev.EV_TASK_POST)


class RunColumns(NamedTuple):
    """The drain's record order and the fields plain_run reads, as numpy arrays (made once per
    drain, in DrainIndex.cache)."""

    kinds: np.ndarray
    group: np.ndarray
    row: np.ndarray
    s_tid: np.ndarray
    s_ctx: np.ndarray
    s_a: np.ndarray
    s_b: np.ndarray
    s_c: np.ndarray
    s_ptr: np.ndarray
    s_ts: np.ndarray
    ub_one_row: np.ndarray
    ub_tid: np.ndarray
    ub_ctx: np.ndarray
    ub_seq: np.ndarray
    ub_pos: np.ndarray
    ub_token: np.ndarray
    ub_ts: np.ndarray
    agg_tid: np.ndarray
    agg_overlap: np.ndarray
    agg_seq: np.ndarray
    lg_tid: np.ndarray
    lg_ctx: np.ndarray
    lg_chunk: np.ndarray
    lg_n_vals: np.ndarray
    lg_n_vocab: np.ndarray


def _columns(idx: DrainIndex) -> RunColumns:
    got = idx.cache.get("plain_run")
    if got is None:
        a = idx.arrays
        small, big, little, agg, lg = a[G_SMALL], a[G_UBATCH], a[G_UBATCH_S], a[G_STEP_AGG], a[G_LOGITS]

        def ub(name: str, first: bool = False) -> np.ndarray:
            if first:
                return np.concatenate((big[name][:, 0], little[name][:, 0]))
            return np.concatenate((big[name], little[name]))

        f = idx.fast()
        got = idx.cache["plain_run"] = RunColumns(
            kinds=np.asarray(idx.kinds, dtype=np.int64),
            group=np.asarray(idx.group, dtype=np.int64),
            row=np.asarray(idx.row, dtype=np.int64),
            s_tid=small["tid"],
            s_ctx=small["ctx"],
            s_a=small["a"],
            s_b=small["b"],
            s_c=small["c"],
            s_ptr=small["ptr"],
            s_ts=small["ts_ns"],
            ub_one_row=np.asarray(f.ub_one_row, dtype=bool),
            ub_tid=ub("tid"),
            ub_ctx=ub("ctx"),
            ub_seq=ub("seq_id", True),
            ub_pos=ub("pos", True),
            ub_token=ub("token", True),
            ub_ts=ub("ts_ns"),
            agg_tid=agg["tid"],
            agg_overlap=agg["overlap"],
            agg_seq=agg["seq"],
            lg_tid=lg["tid"],
            lg_ctx=lg["ctx"],
            lg_chunk=lg["chunk"],
            lg_n_vals=lg["n_vals"],
            lg_n_vocab=lg["n_vocab"],
        )
    return got


class _Shape(NamedTuple):
    """The records of each step of a run, as its first step has them."""

    before: list[int]  # the kinds of the calls before its decode call, in their order
    k: int  # its logits records (one per chunk)
    slot: int  # 1 on llama-server: the call that names the step's slot ends it
    size: int  # its records

    @property
    def at(self) -> int:
        """The decode call's place in a step's records."""
        return len(self.before)

    @property
    def logits(self) -> slice:
        """The logits records' places in a step's records."""
        return slice(self.at + len(_HEAD), self.at + len(_HEAD) + self.k)


def plain_run(state: FeedState, idx: DrainIndex, p: int, stop: int) -> int:
    """After a _plain_step whose records end before record p: the plain steps that follow from
    p, before record `stop` (where records were lost: the feed loop marks that first), taken at
    once. Returns the index after them, or p when there are fewer than MIN_RUN."""
    um = state.unmade
    if um is None:
        return p
    n = min(len(idx), stop)
    shape = _run_shape(idx.kinds, p, n, state.slot_tokens)
    if shape is None:
        return p
    col = _columns(idx)
    rows, ub_group = _rows_of_shape(col, shape, p, n)
    if len(rows) < MIN_RUN:
        return p
    f = idx.fast()
    at, slot = shape.at, shape.slot
    u = rows[:, at + 1] + np.where(ub_group == G_UBATCH_S, f.ub_small_at, 0)  # in the micro-batch columns
    m = _continuing(state, idx, col, shape, rows, u)
    if m < MIN_RUN:
        return p
    agg = rows[:m, at + 2]
    found = _one_block(state, [state.agg_pre.get(s) for s in col.agg_seq[agg].tolist()])
    if found is None:
        return p
    pres, plan = found
    m = len(pres)
    rows = rows[:m]
    if ev.EV_TASK_POST in shape.before:  # llama-server's loop's tasks: the serving state's (a
        # plain step reads none of it)
        posts = rows[:, shape.before.index(ev.EV_TASK_POST)]
        values = (col.s_tid[posts], col.s_a[posts], col.s_b[posts], col.s_ptr[posts])
        for post_tid, task, b, span_bytes in zip(*(v.tolist() for v in values), strict=True):
            state.task_post(post_tid, task, b, span_bytes)
    sampled = col.s_a[rows[:, shape.size - 1 - slot]]
    _apply(state, idx, um.c, um.c.seqs[f.ub_seq[um.u]], u[:m], rows, sampled, shape, pres, plan)
    return p + m * shape.size


def _run_shape(kinds: list[int], p: int, n: int, slot_tokens: bool) -> _Shape | None:
    """The records of the step at p, when they may start a run of MIN_RUN steps before n: the
    calls before its decode (llama-cpp-python cuts the cache past the position, llama-server
    posts its loop's task), its logits records (one per chunk) and on llama-server the slot's
    call."""
    q = p
    while q < n and kinds[q] in _BEFORE and q - p < len(_BEFORE):
        q += 1
    before = kinds[p:q]
    if q + len(_HEAD) >= n or kinds[q] != ev.EV_DECODE_BEGIN or len(set(before)) < len(before):
        return None
    q += len(_HEAD)
    while q < n and kinds[q] == ev.EV_LOGITS:
        q += 1
    k = q - p - len(before) - len(_HEAD)
    slot = 1 if slot_tokens else 0
    size = len(before) + len(_HEAD) + k + 1 + slot
    if (n - p) // size < MIN_RUN or k > ev.MAX_LOGITS_CHUNKS:
        return None
    return _Shape(before, k, slot, size)


def _rows_of_shape(col: RunColumns, shape: _Shape, p: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The records' rows in their layouts' columns, one line per step, of the steps from p
    whose records have the first's kinds and layouts (as many as follow one another), and the
    layout of each one's micro-batch."""
    m, size, at = (n - p) // shape.size, shape.size, shape.at
    tail = (ev.EV_SAMPLE_END, ev.EV_SLOT_TOKEN)[: 1 + shape.slot]
    kinds = np.array([*shape.before, *_HEAD, *[ev.EV_LOGITS] * shape.k, *tail])
    groups = np.array([*[G_SMALL] * at, *_HEAD_GROUPS, *[G_LOGITS] * shape.k, *[G_SMALL] * len(tail)])
    span = slice(p, p + m * size)
    kind_m, group_m, row_m = (a[span].reshape(m, size) for a in (col.kinds, col.group, col.row))
    ok = (kind_m == kinds).all(axis=1) & ((group_m == groups) | (groups == -1)).all(axis=1)
    ok &= (group_m[:, at + 1] == G_UBATCH) | (group_m[:, at + 1] == G_UBATCH_S)
    m = _leading(ok)
    return row_m[:m], group_m[:m, at + 1]


def _continuing(
    state: FeedState, idx: DrainIndex, col: RunColumns, shape: _Shape, rows: np.ndarray, u: np.ndarray
) -> int:
    """How many of the steps (`rows`, their micro-batches at `u`) in a row pass fast_step's
    checks: _decode_begin's context; one row of the last step's thread, context and sequence,
    continuing it (the next position, fed the token sampled before), the sampler reading that
    row; a cut of the cache that leaves the sequence whole; logits whole and in order; on
    llama-server the call that names the sequence's slot."""
    um = state.unmade
    assert um is not None
    f = idx.fast()
    at, k = shape.at, shape.k
    tid, ctx, seq = um.tid, f.ub_ctx[um.u], f.ub_seq[um.u]
    st = um.c.seqs[seq]
    db, agg, end, begin = rows[:, at], rows[:, at + 2], rows[:, at + 3], rows[:, at + 4]
    sample = rows[:, shape.size - 1 - shape.slot]
    sampled = col.s_a[sample]
    fed = col.ub_token[u]
    pos = st.max_pos + 1 + np.arange(len(rows))
    ok = (col.s_ctx[db] == ctx) & col.ub_one_row[u] & (col.ub_tid[u] == tid) & (col.ub_ctx[u] == ctx)
    ok &= (col.ub_seq[u] == seq) & (col.ub_pos[u] == pos)
    ok[1:] &= fed[1:] == sampled[:-1]
    if st.expect_token is not None:
        ok[0] &= fed[0] == st.expect_token
    ok &= (col.s_tid[end] == tid) & (col.s_tid[begin] == tid) & (col.s_ctx[begin] == ctx)
    ok &= (col.s_a[begin] == -1) | (col.s_a[begin] == 0)
    ok &= (col.s_tid[sample] == tid) & (col.s_ctx[sample] == ctx)
    ok &= (col.agg_tid[agg] == tid) & (col.agg_overlap[agg] == 0)
    if ev.EV_SEQ_RM in shape.before:  # a cut of this thread that leaves the sequence whole (the
        # step pops it: nothing else stays of it)
        rm = rows[:, shape.before.index(ev.EV_SEQ_RM)]
        cut = ((col.s_a[rm] == -1) | (col.s_a[rm] == seq)) & (col.s_b[rm] < pos)
        ok &= (col.s_tid[rm] == tid) & ~cut
    if k:  # the logits row, whole and in order (_logits)
        lg = rows[:, shape.logits]
        ok &= ((col.lg_tid[lg] == tid) & (col.lg_ctx[lg] == ctx)).all(axis=1)
        ok &= (col.lg_chunk[lg] == np.arange(k)).all(axis=1)
        n_vocab = col.lg_n_vocab[lg[:, -1]].astype(np.int64)  # (unsigned: negated, it wraps)
        ok &= -(-n_vocab // idx.logits_chunk) == k
    if shape.slot:  # llama-server: the call that names this sequence's slot
        ok &= (col.s_tid[rows[:, -1]] == tid) & (col.s_a[rows[:, -1]] == seq)
    return _leading(ok)


def _one_block(
    state: FeedState, found: list[AggRow | None]
) -> tuple[list[AggRow], tuple[list[int], list[int | None], bool]] | None:
    """The steps' aggregate records (`found`) as long as all their values are in one block and
    their attention records of one plan (the map's picks for it), when at least MIN_RUN."""
    first = found[0]
    if first is None or first.block is None:
        return None
    plan = state.attn_map.one_row_picks(first.attn)
    if plan is None:
        return None
    block, (masks, calls, _, flags) = first.block, first.attn
    pres: list[AggRow] = []
    for pre in found:  # (the counts may differ: the plan picks them)
        if pre is None or pre.block is not block:
            break
        if (pre.attn[0], pre.attn[1], pre.attn[3]) != (masks, calls, flags):
            break
        pres.append(pre)
    return (pres, plan) if len(pres) >= MIN_RUN else None


def _leading(ok: np.ndarray) -> int:
    """How many of ok's first values are all true."""
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if len(bad) else len(ok)


def _apply(
    state: FeedState,
    idx: DrainIndex,
    c: CtxState,
    st: SeqState,
    u: np.ndarray,
    rows: np.ndarray,
    sampled_a: np.ndarray,
    shape: _Shape,
    pres: list[AggRow],
    plan: tuple[list[int], list[int | None], bool],
) -> None:
    """The effect of _decode_begin and fast_step (its _plain_step) on each of the run's steps."""
    col = _columns(idx)
    m = len(u)
    um = state.unmade
    assert um is not None
    f = idx.fast()
    tid, seq = um.tid, f.ub_seq[um.u]
    positions = col.ub_pos[u].tolist()
    t_starts = col.ub_ts[u].tolist()
    t_ends = col.s_ts[rows[:, shape.at + 3]].tolist()
    step0, decode0 = state.next_step_id, c.decode_id + 1
    step_ids = list(range(step0, step0 + m))
    _steps_begin(state, c, st, tid, seq, col, int(rows[-1, shape.at]), m, positions[-1])
    last = pres[-1]
    state.unmade = UnmadeStep(
        c, step_ids[-1], c.decode_id, tid, t_starts[-1], t_ends[-1], f.ub_rows, int(u[-1]), last
    )
    c.rows = c.outputs = UNMADE_ROWS
    # _on_step_agg, _on_ubatch_end
    _layers_seen(state, pres, plan[0], m if plan[2] else 0)
    tokens = col.ub_token[u].tolist()
    state.steps.add_one_row_run(c.ctx_id, seq, tid, step_ids, decode0, t_starts, t_ends, tokens, positions)
    block = last.block
    assert block is not None
    block_rows = [pre.block_row for pre in pres]
    state.routes.one_row_blocks(step_ids, c.ctx_id, seq, positions, block, block_rows)
    # _on_sample_begin .. _on_sample_end (and on llama-server, _on_slot_token's check)
    c.sampling.pop(tid, None)
    if shape.slot and state.serving is not None:
        mismatch = col.s_b[rows[:, -1]] != sampled_a
        state.serving.counters.slot_token_mismatch += int(np.count_nonzero(mismatch))
    logits = _run_logits(state, idx, col, rows[:, shape.logits])
    attended, most = _attended([pre.attn[2] for pre in pres], plan[1])
    state.requests.one_row_tokens(
        c,
        st,
        step_ids,
        seq,
        positions,
        sampled_a.tolist(),
        tid,
        t_starts,
        t_ends,
        logits,
        attended,
        most,
        block,
        block_rows,
    )


def _steps_begin(
    state: FeedState,
    c: CtxState,
    st: SeqState,
    tid: int,
    seq: int,
    col: RunColumns,
    db: int,
    m: int,
    pos: int,
) -> None:
    """_decode_begin's and _step_begins' effect of m steps (the last decode call's public batch,
    at `db`, stays; `pos`: the last step's position)."""
    n_tok, tok0, pos0 = int(col.s_a[db]), int(col.s_b[db]), int(col.s_c[db])
    c.decode_id += m
    c.decode_seen = True
    c.public_batch = (n_tok, tok0, pos0) if n_tok >= 0 else None
    c.ubatches_seen += m
    state.next_step_id += m
    state.pending_clears.pop(tid, None)
    st.next_input_pending = None
    st.max_pos = max(st.max_pos, pos)
    if c.unsure:
        c.unsure.discard(seq)


def _layers_seen(state: FeedState, pres: list[AggRow], filled: list[int], passes: int) -> None:
    """The layers the steps' aggregate records saw (and the attention plan's), and the passes
    the attention map counts."""
    moe, ffn = state.layers_seen["moe"], state.layers_seen["ffn"]
    for pre in pres:
        moe.update(pre.moe_seen)
        ffn.update(pre.ffn_seen)
    state.layers_seen["attn"].update(filled)
    state.attn_map.passes_seen += passes


def _run_logits(
    state: FeedState, idx: DrainIndex, col: RunColumns, lg: np.ndarray
) -> list[list[LogitsChunk]] | None:
    """The steps' logits rows (their records `lg`, a line per step): one record per row, all as
    wide, reduced to their statistics at once (None then, and without logits); else each row's
    chunks."""
    k = lg.shape[1]
    widths = col.lg_n_vals[lg[:, 0]] if k == 1 else None
    if widths is not None and (widths == widths[0]).all():
        offsets = idx.arrays[G_LOGITS]["at"][lg[:, 0]]
        data = idx.logits_data if idx.logits_stats is None else idx.logits_stats
        state.requests.stats.add_run_at(len(state.requests.tokens), data, offsets, int(widths[0]))
        return None
    if not k:
        return None
    vals, n_vals = idx.logits_vals, col.lg_n_vals
    return [[vals(r)[: n_vals[r]] for r in chunk_rows] for chunk_rows in lg.tolist()]


def _attended(
    counts: list[list[int]], picks: list[int | None]
) -> tuple[list[list[int | None]], list[int | None]]:
    """Each step's attended cells per attention layer (its counts at `picks`, None where a layer
    has none) and the most of them: with itemgetter where it can (no Python call per step)."""
    valid = [i for i in picks if i is not None]
    if not valid:
        return [[None] * len(picks) for _ in counts], [None] * len(counts)
    if len(valid) == 1:
        most: list[int | None] = [c[valid[0]] for c in counts]
    else:
        most = list(map(max, map(itemgetter(*valid), counts)))
    if len(valid) == len(picks) and len(picks) > 1:
        return list(map(list, map(itemgetter(*valid), counts))), most
    return [[c[i] if i is not None else None for i in picks] for c in counts], most
