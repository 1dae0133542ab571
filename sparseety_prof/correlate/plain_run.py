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
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from sparseety_prof.capture import events as ev
from sparseety_prof.correlate.agg_record import AggRow
from sparseety_prof.correlate.drain_index import (
    G_LOGITS,
    G_SMALL,
    G_STEP_AGG,
    G_UBATCH,
    G_UBATCH_S,
    DrainIndex,
)
from sparseety_prof.correlate.fast_step import UNMADE_ROWS, UnmadeStep
from sparseety_prof.correlate.state import CtxState, SeqState
from sparseety_prof.store.schema import PHASE_DECODE

if TYPE_CHECKING:
    from sparseety_prof.correlate.correlator import Correlator

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


def plain_run(corr: Correlator, idx: DrainIndex, p: int, stop: int) -> int:
    """After a _plain_step whose records end before record p: the plain steps that follow from
    p, before record `stop` (where records were lost: the feed loop marks that first), taken at
    once (Correlator._plain_run). Returns the index after them, or p when there are fewer than
    MIN_RUN."""
    um = corr._unmade
    kinds, n = idx.kinds, min(len(idx), stop)
    if um is None:
        return p
    # the step's shape, from the first: the calls before its decode (llama-cpp-python cuts the
    # cache past the position, llama-server posts its loop's task), its logits records (one per
    # chunk) and on llama-server the slot's call
    q = p
    while q < n and kinds[q] in _BEFORE and q - p < len(_BEFORE):
        q += 1
    before = kinds[p:q]
    at = len(before)  # the decode call's place in a step's records
    if q + len(_HEAD) >= n or kinds[q] != ev.EV_DECODE_BEGIN or len(set(before)) < len(before):
        return p
    q += len(_HEAD)
    while q < n and kinds[q] == ev.EV_LOGITS:
        q += 1
    k = q - p - at - len(_HEAD)
    slot = 1 if corr.slot_tokens else 0
    size = at + len(_HEAD) + k + 1 + slot
    m = (n - p) // size
    if m < MIN_RUN or k > ev.MAX_LOGITS_CHUNKS:
        return p
    col = _columns(idx)
    tail = (ev.EV_SAMPLE_END, ev.EV_SLOT_TOKEN)[: 1 + slot]
    shape = np.array([*before, *_HEAD, *[ev.EV_LOGITS] * k, *tail])
    groups = np.array([*[G_SMALL] * at, *_HEAD_GROUPS, *[G_LOGITS] * k, *[G_SMALL] * len(tail)])
    span = slice(p, p + m * size)
    kind_m, group_m, row_m = (a[span].reshape(m, size) for a in (col.kinds, col.group, col.row))
    ok = (kind_m == shape).all(axis=1) & ((group_m == groups) | (groups == -1)).all(axis=1)
    ok &= (group_m[:, at + 1] == G_UBATCH) | (group_m[:, at + 1] == G_UBATCH_S)
    m = _leading(ok)
    if m < MIN_RUN:
        return p
    f = idx.fast()
    rows, group_m = row_m[:m], group_m[:m]
    u = rows[:, at + 1] + np.where(group_m[:, at + 1] == G_UBATCH_S, f.ub_small_at, 0)
    db, agg, end, begin = rows[:, at], rows[:, at + 2], rows[:, at + 3], rows[:, at + 4]
    sample = rows[:, size - 1 - slot]
    tid, ctx, seq = um.tid, f.ub_ctx[um.u], f.ub_seq[um.u]
    c = um.c
    st = c.seqs[seq]
    sampled = col.s_a[sample]
    fed = col.ub_token[u]
    pos = st.max_pos + 1 + np.arange(m)
    # _decode_begin: this context; fast_step: one row of this thread, context and sequence,
    # continuing it (the next position, fed the token sampled before), the sampler reading that row
    ok = (col.s_ctx[db] == ctx) & col.ub_one_row[u] & (col.ub_tid[u] == tid) & (col.ub_ctx[u] == ctx)
    ok &= (col.ub_seq[u] == seq) & (col.ub_pos[u] == pos)
    ok[1:] &= fed[1:] == sampled[:-1]
    if st.expect_token is not None:
        ok[0] &= fed[0] == st.expect_token
    ok &= (col.s_tid[end] == tid) & (col.s_tid[begin] == tid) & (col.s_ctx[begin] == ctx)
    ok &= (col.s_a[begin] == -1) | (col.s_a[begin] == 0)
    ok &= (col.s_tid[sample] == tid) & (col.s_ctx[sample] == ctx)
    ok &= (col.agg_tid[agg] == tid) & (col.agg_overlap[agg] == 0)
    if ev.EV_SEQ_RM in before:  # a cut of this thread that leaves the sequence whole (the step
        # pops it: nothing else stays of it)
        rm = rows[:, before.index(ev.EV_SEQ_RM)]
        cut = ((col.s_a[rm] == -1) | (col.s_a[rm] == seq)) & (col.s_b[rm] < pos)
        ok &= (col.s_tid[rm] == tid) & ~cut
    if k:  # the logits row, whole and in order (_logits)
        lg = rows[:, at + len(_HEAD) : at + len(_HEAD) + k]
        ok &= ((col.lg_tid[lg] == tid) & (col.lg_ctx[lg] == ctx)).all(axis=1)
        ok &= (col.lg_chunk[lg] == np.arange(k)).all(axis=1)
        n_vocab = col.lg_n_vocab[lg[:, -1]].astype(np.int64)  # (unsigned: negated, it wraps)
        ok &= -(-n_vocab // idx.logits_chunk) == k
    if slot:  # llama-server: the call that names this sequence's slot
        ok &= (col.s_tid[rows[:, -1]] == tid) & (col.s_a[rows[:, -1]] == seq)
    m = _leading(ok)
    if m < MIN_RUN:
        return p
    # the aggregate records: all values in one block, and attention records of one plan
    found = [corr._agg_pre.get(s) for s in col.agg_seq[agg[:m]].tolist()]
    first = found[0]
    if first is None or first.block is None:
        return p
    plan = corr.attn_map.one_row_picks(first.attn)
    if plan is None:
        return p
    block, (masks, calls, _, flags) = first.block, first.attn
    pres: list[AggRow] = []
    for pre in found:  # (the counts may differ: the plan picks them)
        if pre is None or pre.block is not block:
            break
        if (pre.attn[0], pre.attn[1], pre.attn[3]) != (masks, calls, flags):
            break
        pres.append(pre)
    m = len(pres)
    if m < MIN_RUN:
        return p
    if ev.EV_TASK_POST in before:  # llama-server's loop's tasks: the serving state's (a plain
        # step reads none of it)
        posts = rows[:m, before.index(ev.EV_TASK_POST)]
        values = (col.s_tid[posts], col.s_a[posts], col.s_b[posts], col.s_ptr[posts])
        for post_tid, task, b, span_bytes in zip(*(v.tolist() for v in values), strict=True):
            corr._task_post(post_tid, task, b, span_bytes)
    _apply(corr, idx, c, st, u[:m], db[:m], end[:m], sampled[:m], rows[:m], at, k, slot, pres, plan)
    return p + m * size


def _leading(ok: np.ndarray) -> int:
    """How many of ok's first values are all true."""
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if len(bad) else len(ok)


def _apply(
    corr: Correlator,
    idx: DrainIndex,
    c: CtxState,
    st: SeqState,
    u: np.ndarray,
    db: np.ndarray,
    end: np.ndarray,
    sampled_a: np.ndarray,
    rows: np.ndarray,
    at: int,
    k: int,
    slot: int,
    pres: list[AggRow],
    plan: tuple[list[int], list[int | None], bool],
) -> None:
    """The effect of _decode_begin and fast_step (its _plain_step) on each of the run's steps."""
    col = _columns(idx)
    f = idx.fast()
    m = len(u)
    um = corr._unmade
    assert um is not None
    tid, seq = um.tid, f.ub_seq[um.u]
    positions = col.ub_pos[u].tolist()
    t_starts = col.ub_ts[u].tolist()
    t_ends = col.s_ts[end].tolist()
    sampled = sampled_a.tolist()
    step0, decode0 = corr.next_step_id, c.decode_id + 1
    step_ids = list(range(step0, step0 + m))
    # _decode_begin (the last one's public batch stays) and _step_begins
    n_tok, tok0, pos0 = (int(v) for v in (col.s_a[db[-1]], col.s_b[db[-1]], col.s_c[db[-1]]))
    c.decode_id += m
    c.decode_seen = True
    c.public_batch = (n_tok, tok0, pos0) if n_tok >= 0 else None
    c.ubatches_seen += m
    corr.next_step_id += m
    corr.pending_clears.pop(tid, None)
    st.next_input_pending = None
    st.max_pos = max(st.max_pos, positions[-1])
    if c.unsure:
        c.unsure.discard(seq)
    last = pres[-1]
    corr._unmade = UnmadeStep(
        c, step_ids[-1], c.decode_id, tid, t_starts[-1], t_ends[-1], f.ub_rows, int(u[-1]), last
    )
    c.rows = c.outputs = UNMADE_ROWS
    # _on_step_agg, _on_ubatch_end
    moe, ffn = corr.layers_seen["moe"], corr.layers_seen["ffn"]
    for pre in pres:
        moe.update(pre.moe_seen)
        ffn.update(pre.ffn_seen)
    filled, picks, counted = plan
    corr.layers_seen["attn"].update(filled)
    if counted:
        corr.attn_map.passes_seen += m
    one = [1] * m
    corr.step_rows(c.ctx_id, [seq]).extend_values(
        zip(
            step_ids,
            [c.ctx_id] * m,
            range(decode0, decode0 + m),
            t_starts,
            t_ends,
            [(t + corr.wall_offset_ns) // 1_000_000 for t in t_starts],
            one,
            one,
            [PHASE_DECODE] * m,
            [0] * m,
            one,
            [[seq] for _ in range(m)],
            [[t] for t in col.ub_token[u].tolist()],
            [[p] for p in positions],
            [[seq] for _ in range(m)],
            [[0] for _ in range(m)],
            [False] * m,
            [corr.pid] * m,
            [tid] * m,
            strict=True,
        )
    )
    block = last.block
    assert block is not None
    block_rows = [pre.block_row for pre in pres]
    corr.routes.one_row_blocks(step_ids, c.ctx_id, seq, positions, block, block_rows)
    # _on_sample_begin .. _on_sample_end (and on llama-server, _on_slot_token's check)
    c.sampling.pop(tid, None)
    if slot and corr.serving is not None:
        mismatch = col.s_b[rows[:, -1]] != sampled_a
        corr.serving.counters.slot_token_mismatch += int(np.count_nonzero(mismatch))
    logits = None
    lg = rows[:, at + len(_HEAD) : at + len(_HEAD) + k]
    widths = col.lg_n_vals[lg[:, 0]] if k == 1 else None
    if widths is not None and (widths == widths[0]).all():  # one record per row, all as wide
        offsets = idx.arrays[G_LOGITS]["at"][lg[:, 0]]
        data = idx.logits_data if idx.logits_stats is None else idx.logits_stats
        corr.requests.stats.add_run_at(len(corr.requests.tokens), data, offsets, int(widths[0]))
    elif k:
        vals, n_vals = idx.logits_vals, col.lg_n_vals
        logits = [[vals(r)[: n_vals[r]] for r in chunk_rows] for chunk_rows in lg.tolist()]
    attended, most = _attended([pre.attn[2] for pre in pres], picks)
    corr.requests.one_row_tokens(
        c,
        st,
        step_ids,
        seq,
        positions,
        sampled,
        tid,
        t_starts,
        t_ends,
        logits,
        attended,
        most,
        block,
        block_rows,
    )


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
