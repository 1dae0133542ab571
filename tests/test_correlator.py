"""The correlator on synthetic probe records: no BPF, no engine, every rule pinned down."""

from __future__ import annotations

import itertools
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest

from sparseety_prof.capture import events as ev
from sparseety_prof.capture.events import EventBatch, SeqTracker, decode_records
from sparseety_prof.capture.plans import LayerSet
from sparseety_prof.correlate import block_tokens as block_tokens_module
from sparseety_prof.correlate import correlator as correlator_module
from sparseety_prof.correlate import fast_step as fast_step_module
from sparseety_prof.correlate import logit_stats as logit_stats_module
from sparseety_prof.correlate import logits as logits_module
from sparseety_prof.correlate import pass_arrays as pass_arrays_module
from sparseety_prof.correlate import plain_run as plain_run_module
from sparseety_prof.correlate import request_tokens as request_tokens_module
from sparseety_prof.correlate import routes as routes_module
from sparseety_prof.correlate import server_layout_check
from sparseety_prof.correlate import sparse_run as sparse_run_module
from sparseety_prof.correlate.attention_map import AttentionMap
from sparseety_prof.correlate.correlator import Correlator
from sparseety_prof.correlate.feed_state import FeedState
from sparseety_prof.correlate.logits_reduce import LogitsReducer
from sparseety_prof.correlate.pass_arrays import route_arrays
from sparseety_prof.correlate.request_tokens import RequestTokens
from sparseety_prof.correlate.routes import RoutesTables
from sparseety_prof.correlate.serving import ServingTracker
from sparseety_prof.correlate.state import Step
from sparseety_prof.correlate.step_sparse import StepSparse
from sparseety_prof.correlate.tables import NO_SPARSE_VALUES, SPARSE_TOKEN_COLUMNS, RowBuffer
from sparseety_prof.errors import UnsupportedEngineBuild
from sparseety_prof.session.drain_batches import DrainBatches
from sparseety_prof.store import schema
from sparseety_prof.store.array_rows import RowParts
from sparseety_prof.store.buffers import ColumnBuffer

N_VOCAB = 10
CTX = 0xAAAA
MEM = 0xBBBB
TID = 7


class Script:
    """Builds the records one engine thread would produce, with increasing seq and time."""

    def __init__(self) -> None:
        self.recs: list[bytes] = []
        self.seq = 0
        self.t = 1_000

    def _hdr(self, a: np.ndarray, kind: int, ctx: int = CTX) -> None:
        a["seq"], a["ts_ns"], a["ctx"], a["tid"], a["kind"] = self.seq, self.t, ctx, TID, kind
        self.seq += 1
        self.t += 100

    def small(self, kind: int, a: int = 0, b: int = 0, c: int = 0, ctx: int = CTX) -> None:
        r = np.zeros(1, ev.SMALL_DTYPE)
        self._hdr(r, kind, ctx)
        r["a"], r["b"], r["c"] = a, b, c
        self.recs.append(r.tobytes())

    def ubatch(
        self,
        tokens: list[int],
        pos: list[int],
        seqs: list[int] | None = None,
        outputs: list[int] | None = None,
    ) -> None:
        r = np.zeros(1, ev.UBATCH_DTYPE)
        self._hdr(r, ev.EV_UBATCH)
        n = len(tokens)
        r["n_tokens"] = r["n_copied"] = n
        r["token"][0, :n] = tokens
        r["pos"][0, :n] = pos
        r["seq_id"][0, :n] = seqs or [0] * n
        r["output"][0, :n] = outputs or [0] * (n - 1) + [1]
        self.recs.append(r.tobytes())
        self.small(ev.EV_UBATCH_END)

    def decode(self, tokens: list[int], pos: list[int], **kw: list[int]) -> None:
        self.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
        self.ubatch(tokens, pos, **kw)

    def sample(self, token: int, idx: int = -1, logits: np.ndarray | None = None) -> None:
        self.small(ev.EV_SAMPLE_BEGIN, idx, ev.SAMPLER_LLAMA)
        if logits is not None:
            r = np.zeros(1, ev.logits_dtype(1024))
            self._hdr(r, ev.EV_LOGITS)
            r["idx"], r["chunk"], r["n_vals"], r["n_vocab"] = idx, 0, len(logits), len(logits)
            r["vals"][0, : len(logits)] = logits
            self.recs.append(r.tobytes())
        self.small(ev.EV_SAMPLE_END, token, ev.SAMPLER_LLAMA, idx)


def run(s: Script) -> dict[str, list[object]]:
    c = Correlator(pid=1, n_vocab=N_VOCAB, wall_offset_ns=0, texts=lambda ids: [f"t{i}" for i in ids])
    c.feed(decode_records(s.recs, 1024))
    return dict(c.take_tables()["tokens"])


def test_request_lifecycle_and_fields() -> None:
    s = Script()
    logits = np.arange(N_VOCAB, dtype=np.float32)
    s.decode([1, 5, 6], [0, 1, 2])
    s.sample(9, logits=logits)
    s.decode([9], [3])
    s.sample(4)
    tok = run(s)
    assert tok["token_id"] == [9, 4]
    assert tok["decode_order"] == [0, 1]
    assert tok["logits_pos"] == [2, 3] and tok["pos"] == [3, 4]
    assert tok["phase"] == ["prefill", "decode"]
    assert tok["batch_size"] == [3, 1]
    assert tok["partial"] == [False, False]
    assert tok["token_text"] == ["t9", "t4"]
    expected = logits - np.log(np.exp(logits).sum())
    assert tok["log_prob"][0] == pytest.approx(float(expected[9]))
    assert tok["top_ids"][0] == [9, 8, 7, 6, 5]
    assert tok["log_prob"][1] is None  # no logits row seen: null, never invented
    assert len(set(tok["request_id"])) == 1


def test_new_request_when_input_is_not_the_continuation() -> None:
    s = Script()
    s.decode([1, 5], [0, 1])
    s.sample(3)
    s.decode([1, 7, 8], [0, 1, 2])  # the engine starts over: a new prompt at position 0
    s.sample(2)
    tok = run(s)
    assert len(set(tok["request_id"])) == 2
    assert tok["decode_order"] == [0, 0]


def test_new_request_after_cache_removal_even_when_input_continues() -> None:
    s = Script()
    s.decode([1, 5], [0, 1])
    s.sample(3)
    s.small(ev.EV_SEQ_RM, 0, 1, -1, ctx=MEM)  # drops positions >= 1: cached cells removed
    s.decode([3], [2])
    s.sample(4)
    tok = run(s)
    assert len(set(tok["request_id"])) == 2


def test_seq_rm_past_the_end_is_not_a_boundary() -> None:
    """llama-cpp-python calls seq_rm(-1, n_past, -1) before every eval: it removes nothing."""
    s = Script()
    s.decode([1, 5], [0, 1])
    s.sample(3)
    s.small(ev.EV_SEQ_RM, -1, 2, -1, ctx=MEM)
    s.decode([3], [2])
    s.sample(4)
    tok = run(s)
    assert len(set(tok["request_id"])) == 1 and tok["decode_order"] == [0, 1]


def test_attach_mid_request_is_partial() -> None:
    s = Script()
    s.decode([8], [40])
    s.sample(3)
    s.decode([3], [41])
    s.sample(5)
    tok = run(s)
    assert tok["partial"] == [True, True]
    assert tok["decode_order"] == [None, None]
    assert tok["phase"] == ["decode", "decode"]


def test_two_sequences_in_one_step_and_positive_index() -> None:
    s = Script()
    s.decode([1, 4, 1, 6], [0, 1, 0, 1], seqs=[0, 0, 1, 1], outputs=[0, 1, 0, 1])
    s.sample(7, idx=1)  # batch position 1 -> sequence 0's last row
    s.sample(8, idx=3)
    tok = run(s)
    assert tok["seq_id"] == [0, 1]
    assert tok["token_id"] == [7, 8]
    assert tok["logits_pos"] == [1, 1]
    assert tok["request_id"][0] != tok["request_id"][1]


def test_next_input_token_source_without_sampler() -> None:
    """An engine that samples outside llama.cpp: the token is read from the next forward pass."""
    s = Script()
    s.decode([1, 5], [0, 1])
    s.decode([6], [2])
    s.decode([2], [3])
    tok = run(s)
    assert tok["token_id"] == [6, 2]
    assert tok["token_source"] == ["next_input", "next_input"]
    assert tok["logits_pos"] == [1, 2]
    assert tok["decode_order"] == [0, 1]


def test_other_context_never_mixes() -> None:
    s = Script()
    s.decode([1, 5], [0, 1])
    s.small(ev.EV_DECODE_BEGIN, -1, -1, -1, ctx=0xDDDD)  # a draft context decodes in between
    s.sample(3)
    tok = run(s)
    assert tok["ctx_id"] == [0] and tok["logits_pos"] == [1]


def test_layout_verification_rejects_garbage() -> None:
    s = Script()
    s.decode([1, 500000], [0, 1])  # token id outside the vocabulary: the layout is wrong
    with pytest.raises(UnsupportedEngineBuild, match="failed verification"):
        run(s)
    s = Script()
    s.small(ev.EV_DECODE_BEGIN, 2, 9, 0)  # the public batch says token0 = 9
    s.ubatch([1, 5], [0, 1])
    with pytest.raises(UnsupportedEngineBuild, match="public llama_batch"):
        run(s)


def test_seq_tracker_counts_gaps_across_drains() -> None:
    t = SeqTracker()
    t.update(np.array([0, 1, 2, 5], np.uint64))
    t.update(np.array([3, 6, 9], np.uint64))
    t.update(np.empty(0, np.uint64), final=True)
    assert t.seen == 7 and t.gaps == 3  # 4, 7, 8 missing


def test_decode_rejects_unknown_record_size() -> None:
    with pytest.raises(ValueError, match="unexpected size"):
        decode_records([b"\0" * 13], 1024)
    assert len(EventBatch()) == 0


def test_header_mirror_sizes() -> None:
    assert ev.HDR_DTYPE.itemsize == 32
    assert ev.SMALL_DTYPE.itemsize == 56
    assert ev.UBATCH_DTYPE.itemsize == 32 + 16 + 13 * ev.MAX_UB_TOK
    assert ev.logits_dtype(4096).itemsize == 32 + 16 + 4 * 4096
    assert ev.logits_chunk_for(1200) == 2048 and ev.logits_chunk_for(32000) == 32768  # one record per row
    assert ev.logits_chunk_for(152064) == ev.LOGITS_CHUNK_MAX == 65536


def test_c_struct_sizes_match_the_python_mirror(tmp_path: Path) -> None:
    """Compile events.h with the C compiler and compare every record size with events.py."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is part of the build tools BCC needs"
    src = tmp_path / "sizes.c"
    src.write_text(
        '#include <stdio.h>\n#include <linux/types.h>\n#include "events.h"\n'
        'int main(void){printf("%zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu\\n",'
        " sizeof(struct ev_hdr), sizeof(struct ev_small), sizeof(struct ev_http),"
        " sizeof(struct ev_ubatch), sizeof(struct ev_logits), sizeof(struct ev_tensor_s),"
        " sizeof(struct ev_tensor_l), sizeof(struct ev_act), sizeof(struct ev_act_mask),"
        " sizeof(struct ev_attn), sizeof(struct ev_step_agg)); return 0;}\n"
    )
    exe = tmp_path / "sizes"
    subprocess.run([cc, f"-I{ev.PROBES_DIR}", "-DLOGITS_CHUNK=2048", str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    assert [int(x) for x in out] == [
        ev.HDR_DTYPE.itemsize,
        ev.SMALL_DTYPE.itemsize,
        ev.HTTP_DTYPE.itemsize,
        ev.UBATCH_DTYPE.itemsize,
        ev.logits_dtype(2048).itemsize,
        ev.TENSOR_S_DTYPE.itemsize,
        ev.TENSOR_L_DTYPE.itemsize,
        ev.ACT_DTYPE.itemsize,
        ev.ACT_MASK_DTYPE.itemsize,
        ev.ATTN_DTYPE.itemsize,
        ev.STEP_AGG_DTYPE.itemsize,
    ]


def test_prompt_chunks_are_not_next_input_tokens() -> None:
    """A prompt evaluated over several decode calls (every row an output, as with logits_all)
    before any sampler call: the chunks are one request's prompt, not sampled tokens."""
    s = Script()
    s.decode([1, 5, 6], [0, 1, 2], outputs=[1, 1, 1])
    s.decode([7, 8, 9], [3, 4, 5], outputs=[1, 1, 1])
    s.sample(4)
    tok = run(s)
    assert tok["token_id"] == [4] and tok["token_source"] == ["sampler"] and tok["decode_order"] == [0]
    assert tok["logits_pos"] == [5]


def test_reordered_split_is_unresolved_not_misattributed() -> None:
    """One decode split into two micro-batches holding outputs of two sequences (llama.cpp's
    split_equal): batch positions are unknown, so the samples are counted, never guessed."""
    s = Script()
    s.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
    s.ubatch([1, 5, 6, 1, 7], [0, 1, 2, 0, 1], seqs=[0, 0, 0, 1, 1], outputs=[0, 0, 0, 0, 1])
    s.ubatch([8, 9], [3, 4], seqs=[0, 0], outputs=[0, 1])
    s.sample(3, idx=4)
    s.sample(4, idx=6)
    c = Correlator(pid=1, n_vocab=N_VOCAB, wall_offset_ns=0)
    c.feed(decode_records(s.recs, 1024))
    tok = c.take_tables()["tokens"]
    assert tok["token_id"] == []
    assert c.counters.samples_unresolved == 2


def _step_with_aggregate(s: Script, ids: list[int], token: int) -> None:
    """A one-row decode step whose routing came as an aggregate record (layer 0, k = 2)."""
    s.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
    r = np.zeros(1, ev.UBATCH_DTYPE)
    s._hdr(r, ev.EV_UBATCH)
    r["n_tokens"] = r["n_copied"] = 1
    r["token"][0, 0], r["pos"][0, 0], r["output"][0, 0] = 5, 3, 1
    s.recs.append(r.tobytes())
    a = np.zeros(1, ev.STEP_AGG_DTYPE)
    s._hdr(a, ev.EV_STEP_AGG)
    a["k_ids"][0, 0] = a["k_wts"][0, 0] = 2
    a["ids"][0, 0, :2] = ids
    a["wts"][0, 0, :2] = [0.75, 0.25]
    s.recs.append(a.tobytes())
    s.small(ev.EV_UBATCH_END)
    s.sample(token)


def _sparse_correlator() -> Correlator:
    return Correlator(
        pid=1, n_vocab=N_VOCAB, wall_offset_ns=0, layers=LayerSet(moe=(0,)), n_expert=8, n_expert_used=2
    )


def test_aggregate_routing_lands_in_the_token_row_and_routes() -> None:
    s = Script()
    _step_with_aggregate(s, [6, 2], token=9)
    c = _sparse_correlator()
    c.feed(decode_records(s.recs, 1024))
    tables = c.take_tables()
    tok, routes = tables["tokens"], tables["routes"]
    assert tok["expert_ids"] == [[[6, 2]]]
    assert tok["expert_weights"] == [[[0.75, 0.25]]]
    assert routes["expert_ids"] == [[6, 2]] and routes["pos"] == [3] and routes["layer"] == [0]
    assert c.counters.verified_sparse == 1


def test_graph_records_of_the_pass_running_at_attach_are_the_boundary_not_a_loss() -> None:
    """Graph-op records before any micro-batch began since the attach come from the forward pass
    the probes were attached in the middle of: counted apart. The same record once micro-batches
    have run is a real loss (no micro-batch claims it)."""

    def lone_aggregate(s: Script) -> None:
        a = np.zeros(1, ev.STEP_AGG_DTYPE)
        s._hdr(a, ev.EV_STEP_AGG)
        a["k_ids"][0, 0] = a["k_wts"][0, 0] = 2
        a["ids"][0, 0, :2] = [1, 2]
        s.recs.append(a.tobytes())

    s = Script()
    lone_aggregate(s)
    lone_aggregate(s)
    _step_with_aggregate(s, [6, 2], token=9)
    lone_aggregate(s)
    c = _sparse_correlator()
    c.feed(decode_records(s.recs, 1024))
    assert c.take_tables()["tokens"]["expert_ids"] == [[[6, 2]]]
    assert c.counters.sparse_before_first_step == 2
    assert c.counters.sparse_unattributed == 1


def test_routing_outside_the_models_experts_is_an_unsupported_build() -> None:
    """A tensor layout read wrongly shows up as expert ids the model cannot have."""
    s = Script()
    _step_with_aggregate(s, [6, 4711], token=9)
    with pytest.raises(UnsupportedEngineBuild, match="routing tensors failed verification"):
        _sparse_correlator().feed(decode_records(s.recs, 1024))


def test_row_buffer_keeps_rows_as_tuples_and_gives_columns() -> None:
    buf = RowBuffer(("a", "b"))
    assert buf.take() == {"a": [], "b": []}
    buf.add(a=1, b="x")
    buf.add(a=2, b=None)
    assert len(buf) == 2
    assert buf.take() == {"a": [1, 2], "b": ["x", None]}
    assert len(buf) == 0
    buf.add(a=3, b="y")
    with pytest.raises(ValueError, match="columns"):
        buf.add(a=4)  # a row must have every column
    with pytest.raises(ValueError, match="columns"):
        buf.add(b=4, a=5)  # ... in the buffer's order
    buf.add_values((4,))
    with pytest.raises(ValueError):
        buf.take()  # a row of values must have every column too
    # token rows with and without sparse values have as many sparse columns
    assert len(NO_SPARSE_VALUES) == len(SPARSE_TOKEN_COLUMNS)


def test_every_table_has_exactly_the_schema_columns() -> None:
    """take_tables hands over every column of each table, with rows or without: what
    schema.frame requires (a misspelt or forgotten column is an error there)."""
    for texts in (None, lambda ids: [f"t{i}" for i in ids]):
        c = _correlator(texts=texts, with_masks=True)
        empty = c.take_tables()
        c.feed(decode_records(_mixed_script().recs, 1024))
        for tables in (empty, c.take_tables(final=True)):
            assert tables.keys() == {"tokens", "steps", "routes", "masks", "layer_times", "requests"}
            for name, cols in tables.items():
                assert cols.keys() == schema.TABLES[name].keys(), name
                assert schema.frame(name, dict(cols)).height == len(
                    cols["step_id" if name != "requests" else "pid"]
                )
        assert tables["tokens"]["token_text"][0] == (None if texts is None else "t4")


# ---------------------------------------------------------------- one-row decode steps, fast path


def _agg_step(
    s: Script,
    token: int,
    pos: int,
    *,
    seq: int = 0,
    ctx: int = CTX,
    layers: int = 2,
    ops: bool = True,
    act: bool = True,
    moe: tuple[int, ...] | None = None,
) -> None:
    """A one-row micro-batch with its aggregate record (every layer FFN, and MoE with k = 2 unless
    `moe` names the MoE layers), as the probes send it for a decode step. Attention: the two
    set_input_kq_mask calls (full mask, a window of 4) and, with `ops`, the graph-op nodes of
    layers 0 (full) and 1 (window). Without `act`, no activation was counted (a step
    --act-every leaves out)."""
    r = np.zeros(1, ev.UBATCH_DTYPE)
    s._hdr(r, ev.EV_UBATCH, ctx)
    r["n_tokens"] = r["n_copied"] = 1
    r["token"][0, 0], r["pos"][0, 0], r["seq_id"][0, 0], r["output"][0, 0] = token, pos, seq, 1
    s.recs.append(r.tobytes())
    a = np.zeros(1, ev.STEP_AGG_DTYPE)
    s._hdr(a, ev.EV_STEP_AGG, ctx)
    for layer in range(layers):
        if moe is None or layer in moe:
            a["k_ids"][0, layer] = a["k_wts"][0, layer] = 2
            a["ids"][0, layer, :2] = [(pos + layer) % 8, (pos + layer + 3) % 8]
            a["wts"][0, layer, :2] = [0.5 + 0.01 * (pos % 10), 0.5 - 0.01 * (pos % 10)]
        if act:
            a["act_nr"][0, layer] = a["act_rows"][0, layer] = a["act_slots"][0, layer] = 2
            a["act_ne0"][0, layer] = 16
            a["act_zero"][0, layer] = pos % 7
            a["act_below"][0, layer] = pos % 11
    counts = [pos + 1, min(pos + 1, 4)]
    nodes = [(0x1000, 0, counts[0], ev.ATT_FLAG_KV_MASK), (0x2000, 1, counts[1], ev.ATT_FLAG_KV_MASK)]
    if ops:
        nodes += [(0x1000, 0, counts[0], 0), (0x2000, 1, counts[1], 0)]
    a["att_n"] = len(nodes)
    for col, values in zip(
        ("att_mask", "att_layer", "att_count", "att_flags"), zip(*nodes, strict=True), strict=True
    ):
        a[col][0, : len(nodes)] = values
    s.recs.append(a.tobytes())
    s.small(ev.EV_UBATCH_END, ctx=ctx)


def _mixed_script() -> Script:
    """Many one-row decode steps, and among them everything that must leave the fast path:
    prompts, cache removals (past the end and cutting), a token that is not the one sampled,
    incomplete logits, a second sampler call on the same step, a sampler call whose end was
    lost, other contexts (one whose decode calls are not probed), steps without an aggregate
    record, steps whose aggregate record saw nothing, samples by positive index."""
    s = Script()
    logits = np.linspace(-2, 2, N_VOCAB, dtype=np.float32)
    s.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
    s.sample(9)  # finishes a decode from before the attach: counted, not a token
    s.decode([1, 2, 3], [0, 1, 2])
    s.small(ev.EV_SAMPLE_BEGIN, -1, ev.SAMPLER_LLAMA)  # its end was lost: the next begin replaces it
    s.sample(4, logits=logits)
    pos, tok = 3, 4
    other_pos, other_tok = 0, 3
    for i in range(60):
        s.small(ev.EV_SEQ_RM, 0, pos + 5 if i % 3 else pos, -1, ctx=MEM)  # past the end: no boundary
        s.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
        if i % 17 == 5:
            s.ubatch([tok], [pos])  # no aggregate record (token mode)
        elif i % 11 == 7:  # nothing routed or counted: the sparse probes out (--duty-cycle)
            _agg_step(s, tok, pos, layers=0, ops=False)
        else:
            # layer 1 is seen only after verification, on steps that can take the fast path;
            # from step 30 on, attention comes from the learned map only (graph-op probes gone);
            # from step 36 on, every layer in the record: fast_step's _plain_step takes most
            _agg_step(s, tok, pos, layers=2 if 24 <= i < 30 or i >= 36 else 1, ops=i < 30)
        nxt = (tok * 7 + i) % N_VOCAB
        if i == 23:  # incomplete logits: two chunks expected, one seen
            s.small(ev.EV_SAMPLE_BEGIN, -1, ev.SAMPLER_LLAMA)
            r = np.zeros(1, ev.logits_dtype(1024))
            s._hdr(r, ev.EV_LOGITS)
            r["idx"], r["chunk"], r["n_vals"], r["n_vocab"] = -1, 0, 1024, 2000
            s.recs.append(r.tobytes())
            s.small(ev.EV_SAMPLE_END, nxt, ev.SAMPLER_LLAMA, -1)
        else:
            s.sample(nxt, idx=0 if i % 5 == 0 else -1, logits=logits + i)
        if i == 31:
            s.sample(nxt)  # a second sampler call on the same output row
        if i == 35:
            s.small(ev.EV_SAMPLE_BEGIN, -1, ev.SAMPLER_LLAMA)  # its end record was lost
        if i == 50:  # a begin, then another context's sampler call ends: two calls, not one
            s.small(ev.EV_SAMPLE_BEGIN, -1, ev.SAMPLER_LLAMA)
            s.small(ev.EV_SAMPLE_END, 5, ev.SAMPLER_LLAMA, -1, ctx=0xCCCC)
        pos, tok = pos + 1, nxt
        if i == 40:
            tok = (tok + 1) % N_VOCAB  # the next input is not the token sampled: a new request
        if i == 47:
            s.small(ev.EV_SEQ_RM, 0, 2, -1, ctx=MEM)  # cuts the sequence: a new request
        if i % 13 == 0:
            s.small(ev.EV_DECODE_BEGIN, -1, -1, -1, ctx=0xCCCC)  # another context's step
            _agg_step(s, 3, i, ctx=0xCCCC, layers=1)
            s.small(ev.EV_SAMPLE_BEGIN, -1, ev.SAMPLER_LLAMA, ctx=0xCCCC)
            s.small(ev.EV_SAMPLE_END, 5, ev.SAMPLER_LLAMA, -1, ctx=0xCCCC)
        if i >= 14 and i % 3 == 0:
            # a context without decode probes, first seen after verification: its first step
            # leaves a next_input row pending (no sampler seen yet), the following ones continue
            _agg_step(s, other_tok, other_pos, ctx=0xEEEE, layers=1)
            s.small(ev.EV_SAMPLE_BEGIN, -1, ev.SAMPLER_LLAMA, ctx=0xEEEE)
            s.small(ev.EV_SAMPLE_END, 6, ev.SAMPLER_LLAMA, -1, ctx=0xEEEE)
            other_pos, other_tok = other_pos + 1, 6
    return s


def _correlator(**kw: Any) -> Correlator:
    args: dict[str, Any] = {
        "pid": 1,
        "n_vocab": N_VOCAB,
        "wall_offset_ns": 0,
        "texts": lambda ids: [f"t{i}" for i in ids],
        "layers": LayerSet(moe=(0, 1), ffn=(0, 1), attn=(0, 1)),
        "n_expert": 8,
        "n_expert_used": 2,
    }
    return Correlator(**{**args, **kw})


def _plain(x: Any) -> Any:
    """`x` as plain values to compare with ==: dataclasses field by field (a Step through its
    accessors: its caches fill at different times on the two paths; a StepSparse through the
    values it makes when asked for, which one path may never ask), numpy arrays and scalars
    with their dtype (a value of another type is a difference too)."""
    if isinstance(x, Step):
        out = {
            f.name: _plain(getattr(x, f.name))
            for f in fields(x)
            if f.name not in ("_output_index", "_seq_rows", "_over_slots")
        }
        return {
            **out,
            "output_index": x.output_index(),
            "seq_rows": _plain(x.seq_rows()),
            "over_slots": x.over_slots(),
        }
    if isinstance(x, StepSparse):  # its per-row values are made when asked for (memos)
        memos = ("_row_cache", "_plan", "_pass_block", "_slot_block")
        out = {f.name: _plain(getattr(x, f.name)) for f in fields(x) if f.name not in memos}
        return {**out, "_agg_row": _plain(x._agg_values())}
    if is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in fields(x)}
    if isinstance(x, np.ndarray | np.generic):
        return (str(x.dtype), x.tolist())
    if isinstance(x, dict):
        return {_plain(k): _plain(v) for k, v in x.items()}
    if isinstance(x, itertools.count):  # compares by identity: its next value is its state
        return ("count", repr(x))
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple
        return {f: _plain(getattr(x, f)) for f in x._fields}
    if isinstance(x, list | tuple | set):
        return type(x)(_plain(v) for v in x)
    return (type(x).__name__, x)


def _state(c: Correlator) -> dict[str, Any]:
    """Everything the correlator keeps between records (every attribute, its FeedState's too, so
    a new one is covered too), but its output buffers (emptied by take_tables, compared as
    tables) and scratch."""
    skip = {"state", "requests", "routes", "steps", "agg_pre", "serving"}
    kept = {**vars(c), **{f.name: getattr(c.state, f.name) for f in fields(c.state)}}
    out = {name: _plain(v) for name, v in kept.items() if name not in skip}
    out["deferred"] = _plain(c.requests.deferred)
    if c.serving is not None:
        out["serving"] = _plain(vars(c.serving))
    return out


def _replay(
    s: Script,
    drains: int,
    *,
    with_masks: bool,
    server: bool = False,
    layers: LayerSet | None = None,
    routes_rows: bool = True,
    not_made: list[int] | None = None,
    losses: bool = False,
    reduce_every: int = 0,
    chunk: int = 1024,
    reducers: list[LogitsReducer] | None = None,
    states: bool = True,
) -> tuple[dict[str, dict[str, list[object]]], list[Any]]:
    """Feeds the script in `drains` drains; the tables concatenated over them, and the
    correlator's state after each. `server`: as on llama-server (slots name the samples);
    `layers`: the model's, when not _correlator's; `routes_rows`: the routes rows made, or only
    counted (their count added to `not_made`); `losses`: fed as after lost records (the script's
    sequence numbers have holes); `reduce_every`: as the recorder with the C backend, each
    drain's logits rows reduced as taken (logits_reduce.py) and the drains correlated
    `reduce_every` at a time (the state is then the one after each correlation); `chunk`: the
    floats per logits record; `states`: False leaves them out (a compiled correlator has no
    attributes to list: tests/test_compiled_correlator.py)."""
    kw: dict[str, Any] = {"serving": ServingTracker(pid=1), "slot_tokens": True} if server else {}
    if layers is not None:
        kw["layers"] = layers
    c = _correlator(with_masks=with_masks, routes_rows=routes_rows, **kw)
    out: dict[str, dict[str, list[object]]] = {}
    kept = []
    per = -(-len(s.recs) // drains)
    together = DrainBatches() if reduce_every else None
    if together is not None and reducers is not None:
        reducers.append(together.reducer)
    for d, k in enumerate(range(0, len(s.recs), per)):
        final = k + per >= len(s.recs)
        batches = [decode_records(s.recs[k : k + per], chunk)]
        if together is not None:
            together.add(batches[0], final=final)
            if not final and (d + 1) % reduce_every:
                continue
            batches = together.take()
        for b, batch in enumerate(batches):
            last = final and b == len(batches) - 1
            c.feed(batch, losses_seen=losses)
            for table, cols in c.take_tables(final=last).items():
                for name, values in cols.items():
                    out.setdefault(table, {}).setdefault(name, []).extend(values)
        if not_made is not None:
            not_made.append(c.routes.take_not_made())
        if states:
            kept.append(_state(c))
    return out, kept


def _assert_same(got: tuple[Any, list[Any]], want: tuple[Any, list[Any]]) -> None:
    """Two replays (_replay) left the same tables, column by column, and the same state after
    each drain."""
    (got_t, got_s), (want_t, want_s) = got, want
    for name in want_t:
        for col in want_t[name]:
            assert got_t[name][col] == want_t[name][col], f"{name}.{col}"
    for k, (g, w) in enumerate(zip(got_s, want_s, strict=True)):
        for attr in w:
            assert g[attr] == w[attr], f"drain {k}: {attr}"


def _count_taken(monkeypatch: pytest.MonkeyPatch, method: str) -> list[bool]:
    """Whether each record offered to a fast path of the correlator (`method`: _fast_step or
    _fast_sample, which return 0 for a record they leave to the handlers) was taken there."""
    taken: list[bool] = []
    fast = getattr(Correlator, method)

    def counting(self: Correlator, idx: Any, i: int) -> int:
        got: int = fast(self, idx, i)
        taken.append(got > 0)
        return got

    monkeypatch.setattr(Correlator, method, counting)
    return taken


def _count_plain(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int], list[int]]:
    """How many steps fast_step's _plain_step took, how many Steps make_unmade made after it,
    and how many steps of those plain_run took in runs (counted in the first too)."""
    plain, made, in_runs = [0], [0], [0]
    take, make, apply = fast_step_module._plain_step, fast_step_module.make_unmade, plain_run_module._apply

    def counting_runs(*a: Any) -> None:
        steps = len(a[4])  # (its u: the run's micro-batches)
        plain[0] += steps
        in_runs[0] += steps
        apply(*a)

    def counting_plain(*a: Any) -> int:
        plain[0] += 1
        return take(*a)

    def counting_make(state: FeedState) -> None:
        made[0] += 1
        make(state)

    monkeypatch.setattr(fast_step_module, "_plain_step", counting_plain)
    monkeypatch.setattr(fast_step_module, "make_unmade", counting_make)
    monkeypatch.setattr(correlator_module, "make_unmade", counting_make)
    monkeypatch.setattr(plain_run_module, "_apply", counting_runs)
    return plain, made, in_runs


@pytest.mark.parametrize("with_masks", [False, True])
@pytest.mark.parametrize("drains", [1, 7, 40])
def test_fast_one_row_steps_equal_the_record_by_record_path(
    monkeypatch: pytest.MonkeyPatch, drains: int, with_masks: bool
) -> None:
    """Every table, every column, and every piece of state after each drain: the fast path
    must leave exactly what the six handlers leave."""
    s = _mixed_script()
    taken = _count_taken(monkeypatch, "_fast_step")
    samples = _count_taken(monkeypatch, "_fast_sample")
    plain, made, _ = _count_plain(monkeypatch)
    got, got_states = _replay(s, drains, with_masks=with_masks)
    monkeypatch.setattr(Correlator, "_fast_step", lambda self, idx, i: 0)
    monkeypatch.setattr(Correlator, "_fast_sample", lambda self, idx, i: 0)
    want, want_states = _replay(s, drains, with_masks=with_masks)
    not_correlated = {"kernels", "aggregates", "cpu_stacks", "op_times", "thread_waits"}
    assert got.keys() == want.keys() == set(schema.TABLES) - not_correlated
    for name in want:
        assert got[name].keys() == want[name].keys() == schema.TABLES[name].keys(), name
        for col in want[name]:
            assert got[name][col] == want[name][col], f"{name}.{col}"
    for k, (g, w) in enumerate(zip(got_states, want_states, strict=True)):
        assert g.keys() == w.keys()
        for attr in w:
            assert g[attr] == w[attr], f"drain {k}: {attr}"
    assert len(want["tokens"]["token_id"]) > 60 and len(set(want["requests"]["request_id"])) >= 3
    assert want["tokens"]["log_prob"].count(None) >= 2  # the incomplete row and the second sampler call
    assert len(want["routes"]["step_id"]) > 60
    assert want_states[-1]["attn_map"]["layer_calls"] == _plain(
        {0: 0, 1: 1}
    )  # learned, and used from step 30
    last_pos = want["tokens"]["logits_pos"][-1]
    assert isinstance(last_pos, int) and want["tokens"]["attn_attended"][-1] == [last_pos + 1, 4]
    # most steps took the fast path once verification was done (16 micro-batches); with many
    # drains, fewer: a step split over two drains takes the handlers
    assert sum(taken) > (20 if drains == 40 else 30) and not all(taken)
    # the samples of the other steps (prompts, steps without an aggregate record, other contexts)
    # were mostly taken from the columns too; the incomplete, lost and split ones were not
    assert sum(samples) > 15 and not all(samples)
    # from step 36 on, most steps made their rows without a Step (none with the masks' rows); a
    # Step was made for some (another context's records, the end of a drain), not for most
    if with_masks:
        assert plain == [0]
    else:
        assert plain[0] > (10 if drains == 40 else 15) and 0 < made[0] < plain[0]


def _run_script() -> Script:
    """llama-cpp-python's decode loop as its probes record it, step after step: a cut of the
    cache past the position (SEQ_RM), the decode call, the one-row micro-batch with its
    aggregate, the sampler with its logits row. 150 steps, the runs broken by: a token fed
    that is not the one sampled (30), a cut back into the sequence (50), another context's
    step (70), a sampler call without logits (90), a position skipped (110), steps without a
    cut before them (i % 13 == 5), steps whose activations were not counted (i % 17 == 4)."""
    s = Script()
    logits = np.linspace(-2, 2, N_VOCAB, dtype=np.float32)
    s.small(ev.EV_SEQ_RM, -1, 0, -1, ctx=MEM)
    s.decode([1, 2, 3], [0, 1, 2])
    s.sample(4, logits=logits)
    pos, tok = 3, 4
    for i in range(150):
        if i == 30:
            tok = (tok + 1) % N_VOCAB
        if i == 50:
            pos -= 5
        if i == 110:
            pos += 1
        if i % 13 != 5:
            s.small(ev.EV_SEQ_RM, -1, pos, -1, ctx=MEM)
        s.small(ev.EV_DECODE_BEGIN, 1, tok, pos)
        _agg_step(s, tok, pos, ops=i < 8, act=i % 17 != 4)
        nxt = (tok * 7 + i) % N_VOCAB
        s.sample(nxt, logits=None if i == 90 else logits + 0.01 * i)
        pos, tok = pos + 1, nxt
        if i == 70:
            s.small(ev.EV_DECODE_BEGIN, -1, -1, -1, ctx=0xCCCC)
            _agg_step(s, 3, 9, ctx=0xCCCC)
            s.small(ev.EV_SAMPLE_BEGIN, -1, ev.SAMPLER_LLAMA, ctx=0xCCCC)
            s.small(ev.EV_SAMPLE_END, 5, ev.SAMPLER_LLAMA, -1, ctx=0xCCCC)
    return s


@pytest.mark.parametrize("backend", ["c", "numpy"])
@pytest.mark.parametrize("lost", [False, True])
@pytest.mark.parametrize("drains", [1, 4, 17])
def test_runs_of_plain_steps_equal_the_step_by_step_path(
    monkeypatch: pytest.MonkeyPatch, drains: int, lost: bool, backend: str
) -> None:
    """plain_run's runs leave every table and every piece of state as fast_step leaves them
    step by step, and as the handlers leave them record by record; with records lost inside
    runs too (a sampler's begin, a logits record: the run ends before the hole, where the feed
    loop marks the sequences unsure). The runs' logits rows go to the statistics as addresses
    (the C backend) or as arrays (numpy's)."""
    if backend == "c" and logits_module.BACKEND != "c":
        pytest.skip("the C backend is not built (sparseety_prof/native/build.sh)")
    monkeypatch.setattr(logit_stats_module, "BACKEND", backend)
    s = _run_script()
    if lost:
        step_len = len(s.recs) // 150
        for at in (60 * step_len + 9, 130 * step_len + 4):  # inside later runs
            del s.recs[at]
    plain, _, in_runs = _count_plain(monkeypatch)
    got = _replay(s, drains, with_masks=False, losses=lost)
    assert in_runs[0] > (60 if drains < 17 else 20) and plain[0] > in_runs[0]
    monkeypatch.setattr(correlator_module, "plain_run", lambda state, idx, p, stop: p)
    step_by_step = _replay(s, drains, with_masks=False, losses=lost)
    _assert_same(got, step_by_step)
    tok = got[0]["tokens"]
    assert len(tok["token_id"]) > 145 and len(set(tok["request_id"])) >= 3
    assert sum(lp is not None for lp in tok["log_prob"]) > 140
    if not lost:  # (the handlers mark a sequence unsure at a hole earlier than fast_step does)
        monkeypatch.setattr(Correlator, "_fast_step", lambda self, idx, i: 0)
        monkeypatch.setattr(Correlator, "_fast_sample", lambda self, idx, i: 0)
        _assert_same(got, _replay(s, drains, with_masks=False))


#: the block scripts' models: every layer MoE and FFN; a dense first layer (as DeepSeek's)
BLOCK_LAYOUTS = {
    "moe": LayerSet(moe=(0, 1), ffn=(0, 1), attn=(0, 1)),
    "dense_first": LayerSet(moe=(1, 2), ffn=(0, 1, 2), attn=(0, 1)),
}


def _block_script(layout: str = "moe") -> Script:
    """Prompts, then one-row steps whose routing and activations all came in their aggregate
    record (kept as arrays up to the frame), among steps whose activations were not counted,
    steps with a layer missing, and another context's steps; on a model of BLOCK_LAYOUTS."""
    s = Script()
    logits = np.linspace(-2, 2, N_VOCAB, dtype=np.float32)
    s.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
    s.decode([1, 2, 3], [0, 1, 2])
    s.sample(4, logits=logits)
    pos, tok = 3, 4
    moe = BLOCK_LAYOUTS[layout].moe
    n_layers = len(BLOCK_LAYOUTS[layout].ffn)
    for i in range(80):
        s.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
        layers = n_layers - 1 if i % 11 == 3 else n_layers
        # the graph-op probes gone after step 8 (the attention map learned): _plain_step's steps
        _agg_step(s, tok, pos, layers=layers, act=i % 7 != 2, moe=moe, ops=i < 8)
        nxt = (tok * 7 + i) % N_VOCAB
        s.sample(nxt, logits=logits + i)
        pos, tok = pos + 1, nxt
        if i % 9 == 0:
            s.small(ev.EV_DECODE_BEGIN, -1, -1, -1, ctx=0xCCCC)  # another context's step
            _agg_step(s, 3, i, ctx=0xCCCC, layers=n_layers, moe=moe)
            s.small(ev.EV_SAMPLE_BEGIN, -1, ev.SAMPLER_LLAMA, ctx=0xCCCC)
            s.small(ev.EV_SAMPLE_END, 5, ev.SAMPLER_LLAMA, -1, ctx=0xCCCC)
        if i == 40:  # a new prompt on the same sequence, after a cut
            s.small(ev.EV_SEQ_RM, 0, 0, -1, ctx=MEM)
            s.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
            s.decode([5, 6, 7, 8], [0, 1, 2, 3])
            s.sample(9, logits=logits)
            pos, tok = 4, 9
    return s


def _block_tokens_mode(monkeypatch: pytest.MonkeyPatch, mode: str) -> list[int]:
    """block_tokens made to take one of its ways (merged: as configured; split: block rows as
    arrays, the others as lists; lists: every row's lists made), and the block rows it is given,
    per call."""
    if mode != "merged":
        monkeypatch.setattr(block_tokens_module, "MAX_MERGED", -1)
        monkeypatch.setattr(block_tokens_module, "MAX_SPANS", 1000 if mode == "split" else 0)
    given: list[int] = []
    real = request_tokens_module.block_tokens

    def counting(tok: Any, blocks: Any) -> Any:
        given.append(len(blocks))
        return real(tok, blocks)

    monkeypatch.setattr(request_tokens_module, "block_tokens", counting)
    return given


@pytest.mark.parametrize("layout", list(BLOCK_LAYOUTS))
@pytest.mark.parametrize("mode", ["merged", "split", "lists"])
@pytest.mark.parametrize("drains", [1, 9])
def test_rows_kept_as_arrays_equal_the_per_row_lists(
    monkeypatch: pytest.MonkeyPatch, drains: int, mode: str, layout: str
) -> None:
    """The routes rows and the token rows' per-layer lists of one-row steps kept as their
    aggregate records' arrays (RowParts) read as the columns the per-row lists make, and make
    the same frames (in the buffer's order: list rows, then array rows); every other table,
    and the state, is the same either way; whichever way block_tokens takes (_block_tokens_mode:
    the few other rows of a drain made arrays too, the rows split in two kinds, or every row's
    lists made). On a model whose first layer is dense as well (routes rows of the FFN-only
    layer without routing)."""
    given = _block_tokens_mode(monkeypatch, mode)
    s = _block_script(layout)
    layers = BLOCK_LAYOUTS[layout]
    taken: dict[str, list[Any]] = {"routes": [], "tokens": []}
    take_routes, take_tokens = RoutesTables.take, RequestTokens.take_tokens

    def keeping_routes(self: RoutesTables) -> Any:
        got = take_routes(self)
        taken["routes"].append(got[0])
        return got

    def keeping_tokens(self: RequestTokens) -> Any:
        got = take_tokens(self)
        taken["tokens"].append(got)
        return got

    monkeypatch.setattr(RoutesTables, "take", keeping_routes)
    monkeypatch.setattr(RequestTokens, "take_tokens", keeping_tokens)
    got = _replay(s, drains, with_masks=False, layers=layers)
    parts = {table: list(v) for table, v in taken.items()}
    for v in taken.values():
        v.clear()
    monkeypatch.setattr(StepSparse, "agg_block_row", lambda self: None)
    # (and fast_step's _plain_step, which takes the blocks without asking agg_block_row, left out)
    monkeypatch.setattr(AttentionMap, "attend_one_row", lambda self, attn: None)
    want = _replay(s, drains, with_masks=False, layers=layers)
    for table, v in taken.items():
        assert not any(isinstance(r, RowParts) for r in v), table
    routes_arrays = sum(p.n for r in parts["routes"] if isinstance(r, RowParts) for p in r.arrays)
    token_arrays = sum(p.n for r in parts["tokens"] if isinstance(r, RowParts) for p in r.arrays)
    # most one-row steps' rows (two layers each) were arrays, and the rest lists
    assert routes_arrays >= 2 * 60 and routes_arrays < len(want[0]["routes"]["step_id"])
    blocks = sum(given)
    assert blocks >= 60 and blocks < len(want[0]["tokens"]["step_id"])
    if mode == "split":
        assert token_arrays == blocks
    elif mode == "lists":  # only drains of block rows alone (the many drains' fewer rows) keep them arrays
        assert token_arrays < (60 if drains > 1 else 1)
    # (merged: every drain here has an irregular other row, a prompt's token or a layer missing:
    # none is merged; the prompt and slot scripts below merge theirs)
    assert None in want[0]["routes"]["act_values"] and None in want[0]["routes"]["act_zero_ratio"]
    assert [None] * len(layers.ffn) in want[0]["tokens"]["act_zero_ratio"]  # activations not counted
    _assert_same(got, want)
    assert got[0]["routes"] == want[0]["routes"] and got[0]["tokens"] == want[0]["tokens"]
    # the frames: the buffer's, and the per-row lists' made as before
    for table, keys in (("routes", ["step_id", "row", "layer"]), ("tokens", ["step_id", "seq_id"])):
        buf = ColumnBuffer()
        for r in parts[table]:
            buf.add(table, r, final=False)
        frames = [df for _, df in buf.take_all()]
        assert pl.concat(frames).sort(keys).equals(schema.frame(table, want[0][table]).sort(keys)), table


def _server_script() -> Script:
    """llama-server's records: tasks posted and launched on slots, prompts, and one-row decode
    steps whose samples wait for the process_token call that names their slot; among them what
    must leave the fast path: a sample never handed to a slot, a task launched on a slot whose
    cached prompt makes its first step look like the continuation, a micro-batch of two slots.
    And a token handed to the slot that is not the one sampled (counted, on either path)."""
    s = Script()
    logits = np.linspace(-2, 2, N_VOCAB, dtype=np.float32)
    last: dict[int, tuple[int, int]] = {}
    for r in range(6):
        slot, task = r % 2, 100 + r
        s.small(ev.EV_TASK_POST, task, 1)
        s.small(ev.EV_SLOT_LAUNCH, slot, task)
        s.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
        if r == 3:  # the cached prompt: one row, the position and token slot 1 expects
            pos, tok = last[slot]
            _agg_step(s, tok, pos, seq=slot, layers=1)
            pos, tok = pos + 1, 4 + r
        else:
            s.ubatch([1, 2, 3], [0, 1, 2], seqs=[slot] * 3)
            pos, tok = 3, 4 + r
        s.sample(tok, idx=-1, logits=logits)
        s.small(ev.EV_SLOT_TOKEN, slot, tok)
        for i in range(14):
            s.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
            if r == 5 and i == 9:  # slot 0's request is still running beside slot 1's: one step each
                s.ubatch([tok, last[0][1]], [pos, last[0][0]], seqs=[1, 0], outputs=[1, 1])
                s.sample(7, idx=0)
                s.small(ev.EV_SLOT_TOKEN, 1, 7)
                s.sample(8, idx=1)
                s.small(ev.EV_SLOT_TOKEN, 0, 8)
                pos, tok = pos + 1, 7
                continue
            # from the second request on, every layer in the record and, but on every fifth
            # step, no graph-op node (the attention map learned): _plain_step's steps
            _agg_step(s, tok, pos, seq=slot, layers=1 if r == 0 else 2, ops=r == 0 or i % 5 == 0)
            nxt = (tok * 7 + i + r) % N_VOCAB
            s.sample(nxt, idx=0 if i % 4 == 0 else -1, logits=logits + i)
            unhanded = r == 2 and i == 5
            if not unhanded:
                s.small(ev.EV_SLOT_TOKEN, slot, nxt + (r == 4 and i == 7))
            pos, tok = pos + 1, nxt
            if unhanded:  # ... and not the next input either: the sequence's next rows are a new request
                tok = (nxt + 1) % N_VOCAB
        last[slot] = (pos, tok)
        if r != 4:  # slot 0's last request runs on beside the next one
            s.small(ev.EV_SLOT_RELEASE, slot)
    return s


@pytest.mark.parametrize("drains", [1, 7, 40])
def test_fast_one_row_steps_equal_the_handlers_on_the_server(
    monkeypatch: pytest.MonkeyPatch, drains: int
) -> None:
    """llama-server: the fast path defers each sample to the call that names its slot as the
    handlers do, and leaves every step it must leave to them."""
    monkeypatch.setattr(server_layout_check, "VERIFY_POSTS", 2)
    monkeypatch.setattr(server_layout_check, "VERIFY_LAUNCHES", 2)
    s = _server_script()
    taken = _count_taken(monkeypatch, "_fast_step")
    samples = _count_taken(monkeypatch, "_fast_sample")
    plain, made, in_runs = _count_plain(monkeypatch)
    to_slot: list[int] = []  # fast_sample's samples whose slot's call came next
    sample_to_slot = RequestTokens.sample_to_slot

    def counting_to_slot(self: RequestTokens, *a: Any) -> None:
        to_slot.append(a[-1])
        sample_to_slot(self, *a)

    monkeypatch.setattr(RequestTokens, "sample_to_slot", counting_to_slot)
    got, got_states = _replay(s, drains, with_masks=False, server=True)
    monkeypatch.setattr(Correlator, "_fast_step", lambda self, idx, i: 0)
    monkeypatch.setattr(Correlator, "_fast_sample", lambda self, idx, i: 0)
    want, want_states = _replay(s, drains, with_masks=False, server=True)
    _assert_same((got, got_states), (want, want_states))
    tok, req = want["tokens"], want["requests"]
    # every sample, handed to a slot or not; two in the two-slot step
    assert len(tok["token_id"]) == 6 * 15 + 1
    assert req["request_id"] == [
        *(f"task-1-{100 + r}" for r in (0, 1, 2)),
        "r0-0-4",
        "task-1-103",
        "task-1-105",
        "task-1-104",
    ]
    assert want_states[-1]["serving"][("str", "counters")]["slot_token_mismatch"] == ("int", 1)
    # fast_step took each step, or plain_run a run of them (llama-server's loop: a task posted,
    # the decode, the slot's call, over and over)
    assert sum(taken) + in_runs[0] > (40 if drains == 40 else 55) and not all(taken)
    if drains != 40:  # (40 drains hold too few steps each for a run)
        assert in_runs[0] > 10
    assert sum(samples) > 5  # the two-slot step's, the prompts'
    assert {0, 1} <= set(to_slot)  # the two-slot step's samples, each named its slot at once
    # the steps whose slot's call came next, without a Step made for most
    assert plain[0] > (20 if drains == 40 else 30) and 0 < made[0] < plain[0]


# ---------------------------------------------------------------- per-layer records of a pass, in runs


def _record_with_data(a: np.ndarray, data: bytes) -> bytes:
    """A record's bytes with `data` at the start of its void `data` field."""
    off = a.dtype.fields["data"][1]  # type: ignore[index]
    raw = bytearray(a.tobytes())
    raw[off : off + len(data)] = data
    return bytes(raw)


def _tensor_rec(
    s: Script,
    layer: int,
    tag: int,
    rows: np.ndarray,
    *,
    row0: int = 0,
    total: int | None = None,
    large: bool = False,
    name: bytes | None = None,
    n_bytes: int | None = None,
) -> None:
    """A routing tensor record (ids: int32 rows seen through an 8-wide argsort stride)."""
    a = np.zeros(1, ev.TENSOR_L_DTYPE if large else ev.TENSOR_S_DTYPE)
    s._hdr(a, ev.EV_TENSOR)
    n, k = rows.shape
    stride = 8 if rows.dtype == np.int32 else k
    buf = np.zeros((n, stride), dtype=rows.dtype)
    buf[:, :k] = rows
    a["name"] = (
        name or (b"ffn_moe_weights-%d" if tag == ev.TAG_EXPERT_IDS else b"ffn_moe_weighted-%d") % layer
    )
    a["tag"], a["type"], a["row0"], a["n_rows"] = tag, 26 if rows.dtype == np.int32 else 0, row0, n
    a["rows_total"], a["ne0"], a["row_stride"] = total if total is not None else n, k, stride * 4
    a["n_bytes"] = buf.nbytes if n_bytes is None else n_bytes
    s.recs.append(_record_with_data(a, buf.tobytes()))


def _act_rec(
    s: Script,
    layer: int,
    ir0: int,
    n: int,
    total: int,
    *,
    ith: int = 0,
    ne0: int = 16,
    base: int = 0,
    name: bytes | None = None,
) -> None:
    """The activation counts of node rows ir0..ir0+n of an expert GLU (2 slots per token)."""
    a = np.zeros(1, ev.ACT_DTYPE)
    s._hdr(a, ev.EV_ACT)
    a["name"], a["ne0"], a["ne1"], a["ir0"], a["n_rows"] = (
        name or b"ffn_moe_swiglu-%d" % layer,
        ne0,
        2,
        ir0,
        n,
    )
    a["nr_total"], a["ith"] = total, ith
    m = min(n, ev.ACT_MAX_ROWS)
    a["zeros"][0, :m] = (np.arange(m) + base + ir0) % ne0
    a["below"][0, :m] = (np.arange(m) * 3 + base) % ne0
    s.recs.append(a.tobytes())


def _attn_rec(s: Script, layer: int, positions: list[int]) -> None:
    a = np.zeros(1, ev.ATTN_DTYPE)
    s._hdr(a, ev.EV_ATTN)
    a["name"], a["mask"], a["n_kv"] = b"kq_soft_max-%d" % layer, 0x1000 + layer, max(positions) + 1
    a["n_rows"] = a["n_counted"] = len(positions)
    a["row"][0, : len(positions)] = range(len(positions))
    a["attended"][0, : len(positions)] = [p + 1 for p in positions]
    s.recs.append(a.tobytes())


def _multirow_script() -> Script:
    """Passes of several rows (four sequences a step, and prompts) with per-layer routing and
    activation records, and among them every run the handlers must take: a tensor in two chunks,
    a layer's tensor twice, a size the record cannot hold, a name no probe reads, a kind of
    tensor no probe sends, activation records counting a row twice, of two sizes for one layer,
    or of node rows that are not whole tokens, a layer's counts merged from two runs (an
    attention record between), records with no pass in flight; large tensor records, router
    probabilities, the last layer's rows for the outputs only, rows clipped."""
    s = Script()
    logits = np.linspace(-1, 1, N_VOCAB, dtype=np.float32)
    _act_rec(s, 0, 0, 2, 8)  # before any pass: the attach boundary
    pos = [5, 9, 2, 7]
    tok = [1, 2, 3, 4]
    for i in range(40):
        prompt = i % 9 == 4
        s.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
        if prompt:  # sequence 1 starts again: a prompt of 6 rows, the last one's logits wanted
            seqs, rows_tok, rows_pos, outputs = [1] * 6, [7, 8, 9, 1, 2, 3], list(range(6)), [0] * 5 + [1]
            pos[1], tok[1] = 6, 3
        else:
            seqs, rows_tok, rows_pos, outputs = [0, 1, 2, 3], list(tok), list(pos), [1, 1, 1, 1]
        n = len(seqs)
        r = np.zeros(1, ev.UBATCH_DTYPE)
        s._hdr(r, ev.EV_UBATCH)
        r["n_tokens"] = r["n_copied"] = n
        r["token"][0, :n], r["pos"][0, :n], r["seq_id"][0, :n], r["output"][0, :n] = (
            rows_tok,
            rows_pos,
            seqs,
            outputs,
        )
        s.recs.append(r.tobytes())
        for layer in (0, 1):
            n_out = n if layer == 0 or not prompt else 1  # the last layer: output rows only
            ids = np.array(
                [[(i + j + layer) % 8, (i + 3 * j + layer + 1) % 8] for j in range(n_out)], np.int32
            )
            if ids[0, 0] == ids[0, 1]:
                ids[0, 1] = (ids[0, 1] + 1) % 8
            ids[:, 1] = np.where(ids[:, 0] == ids[:, 1], (ids[:, 1] + 1) % 8, ids[:, 1])
            wts = np.array([[0.6 + 0.01 * j, 0.4 - 0.01 * j] for j in range(n_out)], np.float32)
            if i == 20 and layer == 0:  # in two chunks
                _tensor_rec(s, layer, ev.TAG_EXPERT_IDS, ids[:2], total=n_out)
                _tensor_rec(s, layer, ev.TAG_EXPERT_IDS, ids[2:], row0=2, total=n_out)
            else:
                _tensor_rec(s, layer, ev.TAG_EXPERT_IDS, ids, large=i % 5 == 1)
            if i == 22 and layer == 1:
                _tensor_rec(s, layer, ev.TAG_EXPERT_IDS, ids[:, ::-1].copy())  # twice, the last one kept
            _tensor_rec(s, layer, ev.TAG_EXPERT_WEIGHTS, wts, n_bytes=4 if i == 24 and layer == 0 else None)
            if i % 6 == 3:
                _tensor_rec(s, layer, ev.TAG_ROUTER_PROBS, np.full((n_out, 8), 0.125, np.float32))
            if i == 26 and layer == 1:
                _tensor_rec(s, layer, ev.TAG_EXPERT_IDS, ids, name=b"attn_norm-1")  # no probe reads it
            if i == 27 and layer == 1:
                _tensor_rec(s, layer, 99, ids)  # a kind of tensor no probe sends
            total = 2 * n_out
            half = total // 2
            if i == 28 and layer == 0:  # a node row counted twice
                _act_rec(s, layer, 0, half + 1, total)
                _act_rec(s, layer, half, total - half, total, ith=1)
            elif i == 30 and layer == 1:  # two sizes for one layer: the second one's rows kept
                _act_rec(s, layer, 0, half, total)
                _act_rec(s, layer, half, total - half, total + 2, ith=1)
            elif i == 32 and layer == 0:  # counts of layer 0 in two runs: an attention record between
                _act_rec(s, layer, 0, half, total)
                _attn_rec(s, 0, rows_pos)
                _act_rec(s, layer, half, total - half, total, ith=1)
            elif i == 34 and layer == 1:  # node rows that are not whole tokens (2 slots each)
                _act_rec(s, layer, 0, half, total + 1)
            else:
                _act_rec(s, layer, half, total - half + 3, total, ith=1, base=i)  # past the end: clipped
                _act_rec(s, layer, 0, half, total, base=i)
        if i % 4 == 0:
            _attn_rec(s, 1, rows_pos)
        s.small(ev.EV_UBATCH_END)
        if i == 34:
            _act_rec(s, 1, 0, 2, 8)  # between passes: no pass claims it
        for j in np.flatnonzero(outputs).tolist():
            nxt = (rows_tok[j] * 5 + i) % N_VOCAB
            s.sample(nxt, idx=j, logits=logits + i if j == 0 else None)
            seq = seqs[j]
            pos[seq], tok[seq] = rows_pos[j] + 1, nxt
    return s


@pytest.mark.parametrize("cells", ["default", "none"])
@pytest.mark.parametrize("drains", [1, 6, 35])
def test_sparse_runs_equal_the_record_by_record_path(
    monkeypatch: pytest.MonkeyPatch, drains: int, cells: str
) -> None:
    """Every table, every column, and every piece of state after each drain: a run of per-layer
    records taken at once must leave exactly what sparse_record leaves record by record; and so
    must a drain whose activation counts are past what the runs gather at once
    (sparse_run._ACT_CELLS_MAX: then the handlers take them)."""
    if cells == "none":
        monkeypatch.setattr(sparse_run_module, "_ACT_CELLS_MAX", 0)
    planned: list[bool] = []  # per run met: whether the drain's plan could take it
    with_acts: list[bool] = []  # per run planned: whether it held activation counts
    store = sparse_run_module.SparseColumns.store_run

    def storing(self: Any, idx: Any, sp: StepSparse, i: int, j: int, seen: dict[str, set[int]]) -> bool:
        got = store(self, idx, sp, i, j, seen)
        run = (self._runs or {}).get(i)
        planned.append(run is not None)
        if run is not None:
            with_acts.append(bool(run.acts))
        return got

    monkeypatch.setattr(sparse_run_module.SparseColumns, "store_run", storing)
    s = _multirow_script()
    stored = []
    run, on_sparse = sparse_run_module.sparse_run, sparse_run_module.sparse_record

    def counting(state: FeedState, idx: Any, i: int) -> int:
        """The run, and whether it was stored at once (no record given to the handler)."""
        handled = []

        def handler(state: FeedState, r: dict[str, Any]) -> None:
            handled.append(r)
            on_sparse(state, r)

        with monkeypatch.context() as m:
            m.setattr(sparse_run_module, "sparse_record", handler)
            j = run(state, idx, i)
        stored.append(not handled)
        return j

    monkeypatch.setattr(correlator_module, "sparse_run", counting)
    got, got_states = _replay(s, drains, with_masks=False)

    def one_by_one(state: FeedState, idx: Any, i: int) -> int:
        on_sparse(state, idx.record(i))
        return i + 1

    monkeypatch.setattr(correlator_module, "sparse_run", one_by_one)
    want, want_states = _replay(s, drains, with_masks=False)
    _assert_same((got, got_states), (want, want_states))
    routes = want["routes"]
    assert len(want["tokens"]["token_id"]) > 120 and len(routes["step_id"]) > 300
    assert sum(v is None for v in routes["act_zero_ratio"]) < len(routes["step_id"]) // 4
    assert want_states[-1]["counters"]["sparse_before_first_step"] == ("int", 1)
    assert want_states[-1]["counters"]["sparse_unattributed"] == ("int", 1)
    # the four rows of the pass whose layer 1 counts came in two sizes: the last size fits no row
    assert want_states[-1]["problems"]["unmapped_rows"] == ("int", 4)
    if cells == "none":  # every run with activation counts went to the handlers
        assert planned and not any(with_acts)
        return
    assert sum(with_acts) >= 20
    # most runs were stored at once once verification was done; the planted ones were not
    assert sum(stored) >= 20 and not all(stored)
    # the plans of the planted runs (a node row counted twice, two sizes for a layer) refused them
    assert sum(planned) >= 20 and not all(planned)


def test_a_drains_run_plan_leaves_each_irregular_run_to_the_handlers() -> None:
    """sparse_run._plan_runs on one drain of runs (each between two small records): the regular
    ones planned with their layers' arrays as add_tensor and add_act make them, and each of the
    runs whose records taken at once could differ from the handlers' order refused: a routing
    tensor twice, a node row counted twice, a layer's records of two sizes, a layer's records
    in two stretches (another layer's between)."""
    s = Script()
    ids = np.array([[1, 2], [3, 4]], np.int32)
    wts = np.array([[0.6, 0.4], [0.7, 0.3]], np.float32)

    def run(kind: str) -> None:
        s.small(ev.EV_UBATCH_END)  # (a record of another kind ends the run before)
        for layer in (0, 1):
            _tensor_rec(s, layer, ev.TAG_EXPERT_IDS, ids)
            _tensor_rec(s, layer, ev.TAG_EXPERT_WEIGHTS, wts)
            if kind == "tensor twice" and layer == 1:
                _tensor_rec(s, layer, ev.TAG_EXPERT_IDS, ids)
            if kind == "row twice" and layer == 0:
                _act_rec(s, layer, 0, 3, 4)
                _act_rec(s, layer, 2, 2, 4, ith=1)
            elif kind == "two sizes" and layer == 1:
                _act_rec(s, layer, 0, 2, 4)
                _act_rec(s, layer, 2, 2, 6, ith=1)
            elif kind == "two stretches" and layer == 1:
                _act_rec(s, layer, 0, 2, 4)
                _act_rec(s, 0, 0, 0, 4, ith=1)  # (layer 0 again, between layer 1's)
                _act_rec(s, layer, 2, 2, 4, ith=1)
            else:
                _act_rec(s, layer, 0, 2, 4, base=layer)
                _act_rec(s, layer, 2, 2, 4, ith=1, base=layer)

    kinds = ["regular", "tensor twice", "row twice", "two sizes", "regular", "two stretches"]
    for kind in kinds:
        run(kind)
    s.small(ev.EV_UBATCH_END)
    batch = decode_records(s.recs, 1024)
    from sparseety_prof.correlate.drain_index import DrainIndex

    idx = DrainIndex(batch)
    cols = sparse_run_module.SparseColumns(idx)
    plan = sparse_run_module._plan_runs(cols, idx)
    starts = [
        i
        for i in range(1, len(idx))
        if idx.kinds[i] in sparse_run_module.RUN_KINDS and idx.kinds[i - 1] == ev.EV_UBATCH_END
    ]
    assert len(starts) == len(kinds)
    assert [k for k, i in zip(kinds, starts, strict=True) if i in plan] == ["regular", "regular"]
    for i in (starts[0], starts[4]):
        want = StepSparse()
        for k in range(i, plan[i].end):
            r = idx.record(k)
            if r["kind"] == ev.EV_TENSOR:
                want.add_tensor(r)
            else:
                want.add_act(r, with_bits=False)
        got = StepSparse()
        assert cols.store_run(idx, got, i, plan[i].end, {"moe": set(), "ffn": set()})
        for store in ("ids", "weights", "act_zeros", "act_below", "act_width", "act_slots"):
            g, w = getattr(got, store), getattr(want, store)
            assert g.keys() == w.keys() == {0, 1}, store
            for layer in (0, 1):
                assert _plain(g[layer]) == _plain(w[layer]), (store, layer)
        # a step that holds one of the run's layers already: the handlers merge, record by record
        assert not cols.store_run(idx, got, i, plan[i].end, {"moe": set(), "ffn": set()})


@pytest.mark.parametrize("drains", [1, 3])
def test_node_names_with_a_layer_number_past_any_model_are_ignored(drains: int) -> None:
    """Node names come from the target's memory: routing and activation records named with a
    layer of 25 digits (past any integer numpy holds) among a step's records, as a hostile or
    corrupted engine could plant them, crash nothing and leave every table and state as records
    of a name no probe reads do (they made the drain's arrays overflow: an OverflowError, or an
    IndexError from a wrapped key)."""

    def script(planted: bool) -> Script:
        s = Script()
        ids = np.array([[1, 2], [3, 4], [5, 6], [7, 0]], np.int32)
        wts = np.full((4, 2), 0.5, np.float32)
        for i in range(6):
            s.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
            r = np.zeros(1, ev.UBATCH_DTYPE)
            s._hdr(r, ev.EV_UBATCH)
            r["n_tokens"] = r["n_copied"] = 4
            r["token"][0, :4], r["pos"][0, :4] = [1 + i, 2, 3, 4], [10 + i, 20 + i, 30 + i, 40 + i]
            r["seq_id"][0, :4], r["output"][0, :4] = [0, 1, 2, 3], [1, 1, 1, 1]
            s.recs.append(r.tobytes())
            for layer in (0, 1):
                _tensor_rec(s, layer, ev.TAG_EXPERT_IDS, ids)
                _tensor_rec(s, layer, ev.TAG_EXPERT_WEIGHTS, wts)
                _act_rec(s, layer, 0, 4, 8, base=i)
                _act_rec(s, layer, 4, 4, 8, ith=1, base=i)
                huge = 10**25
                _tensor_rec(
                    s,
                    0,
                    ev.TAG_EXPERT_IDS,
                    ids,
                    name=b"ffn_moe_weights-%d" % huge if planted else b"attn_norm-0",
                )
                _tensor_rec(
                    s,
                    0,
                    ev.TAG_EXPERT_WEIGHTS,
                    wts,
                    name=b"ffn_moe_weighted-%d" % huge if planted else b"attn_norm-0",
                )
                _act_rec(s, 0, 0, 4, 8, name=b"ffn_moe_swiglu-%d" % huge if planted else b"attn_norm-0")
            s.small(ev.EV_UBATCH_END)
            for j in range(4):
                s.sample((i + j) % N_VOCAB, idx=j)
        return s

    got = _replay(script(True), drains, with_masks=False)
    want = _replay(script(False), drains, with_masks=False)
    assert len(want[0]["tokens"]["token_id"]) == 24
    _assert_same(got, want)


def _prompt_script(draws: list[bool] | None = None, uncounted: tuple[int, ...] = ()) -> Script:
    """Prompts of 5 to 9 rows with per-layer routing and activation records, the last layer's
    for the output row only (as llama.cpp computes it), each followed by a few decode steps; and
    among them what the arrays must leave to the per-row path: a layer's router probabilities
    alone, a row of a layer not counted, a layer with no routing, a layer's rows neither the
    batch's nor its outputs'. Router probabilities on every layer, every layer computed for every
    row, and two output rows take the arrays. With `draws`, each prompt's head-sampling draw by
    the probes (after its micro-batch record), and no logits row for a request drawn to drop.
    Passes in `uncounted` have no activation record and an end record that says the probes left
    them uncounted (head sampling in the probes: a dropped request's prompt)."""
    s = Script()
    logits = np.linspace(-1, 1, N_VOCAB, dtype=np.float32)
    for i in range(12):
        keep = draws is None or draws[i]
        n = 5 + i % 5
        outputs = [0] * (n - 1) + [1]
        if i == 9:
            outputs[1] = 1  # two outputs (logits of rows 1 and n - 1)
        s.small(ev.EV_SEQ_RM, 0, 0, -1, ctx=MEM)
        s.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
        r = np.zeros(1, ev.UBATCH_DTYPE)
        s._hdr(r, ev.EV_UBATCH)
        r["n_tokens"] = r["n_copied"] = n
        r["token"][0, :n], r["pos"][0, :n], r["seq_id"][0, :n] = [(i + j) % 9 for j in range(n)], range(n), 0
        r["output"][0, :n] = outputs
        s.recs.append(r.tobytes())
        if draws is not None:
            s.small(ev.EV_HEAD_DRAW, 0, int(keep), n - 1)
        n_out = sum(outputs)
        for layer in (0, 1):
            rows = n if layer == 0 or i == 7 else n_out  # the last layer: output rows only, but in pass 7
            if i == 11 and layer == 1:
                rows = n - 1  # neither the batch's rows nor its outputs'
            ids = np.array(
                [[(i + j + layer) % 8, (i + 3 * j + layer + 1) % 8] for j in range(rows)], np.int32
            )
            ids[:, 1] = np.where(ids[:, 0] == ids[:, 1], (ids[:, 1] + 1) % 8, ids[:, 1])
            wts = np.array([[0.6 + 0.01 * j, 0.4 - 0.01 * j] for j in range(rows)], np.float32)
            if not (i == 8 and layer == 1):  # pass 8: no routing for layer 1
                _tensor_rec(s, layer, ev.TAG_EXPERT_IDS, ids)
                _tensor_rec(s, layer, ev.TAG_EXPERT_WEIGHTS, wts)
            if i == 3 or (i == 4 and layer == 0):  # every layer's probabilities; then layer 0's alone
                probs = np.full((rows, 8), 0.125, np.float32)
                probs[:, layer] += 0.01 * i
                _tensor_rec(s, layer, ev.TAG_ROUTER_PROBS, probs)
            total = 2 * rows
            if i in uncounted:
                pass
            elif i == 5 and layer == 0:
                _act_rec(s, layer, 0, total - 2, total, base=i)  # the last row not counted
            else:
                _act_rec(s, layer, 0, total, total, base=i + layer)
        s.small(ev.EV_UBATCH_END, int(i in uncounted))
        for j in np.flatnonzero(outputs).tolist():
            s.sample((i * 5 + j) % N_VOCAB, idx=j, logits=logits + i if keep else None)
        tok = (i * 5 + n - 1) % N_VOCAB
        for k in range(3):
            s.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
            _agg_step(s, tok, n + k)
            s.sample((tok + k) % N_VOCAB, logits=logits if keep else None)
            tok = (tok + k) % N_VOCAB
    return s


@pytest.mark.parametrize("drains", [1, 5])
@pytest.mark.parametrize("uncounted", [(), (2, 6)])
def test_prompt_routes_rows_as_arrays_equal_the_per_row_path(
    monkeypatch: pytest.MonkeyPatch, drains: int, uncounted: tuple[int, ...]
) -> None:
    """A regular prompt's routes rows, and its token row's per-layer lists, made as arrays from its
    per-layer stores, equal the rows the per-row path makes, and so does every other table; an
    irregular prompt leaves them to the per-row path, which counts what it counts (the same
    problems either way). A prompt whose activations the probes left uncounted (`uncounted`: a
    head-dropped request's) still takes the arrays, its activation columns null in every row."""
    s = _prompt_script(uncounted=uncounted)
    _block_tokens_mode(monkeypatch, "split")  # block rows as arrays (counted), the others lists
    calls: list[bool] = []

    def counting(*a: Any) -> Any:
        got = route_arrays(*a)
        calls.append(got is not None)
        return got

    kept: list[Any] = []
    take_tokens = RequestTokens.take_tokens

    def keeping(self: RequestTokens) -> Any:
        got = take_tokens(self)
        kept.append(got)
        return got

    monkeypatch.setattr(pass_arrays_module, "route_arrays", counting)
    monkeypatch.setattr(RequestTokens, "take_tokens", keeping)
    got, got_states = _replay(s, drains, with_masks=False)
    token_arrays = sum(p.n for r in kept if isinstance(r, RowParts) for p in r.arrays)
    monkeypatch.setattr(pass_arrays_module, "route_arrays", lambda *a: None)
    want, want_states = _replay(s, drains, with_masks=False)
    # passes 4, 5, 8 and 11 take the per-row path, every other one the arrays
    assert calls == [i not in (4, 5, 8, 11) for i in range(12)]
    # the token rows of those prompts' output rows (pass 9 has two), and the decode steps' but
    # the first nine (their routing is checked against the model record by record: verification)
    assert token_arrays == 8 + 1 + 12 * 3 - 9
    for name in want:
        for col in want[name]:
            assert got[name][col] == want[name][col], f"{name}.{col}"
    assert got_states[-1]["problems"] == want_states[-1]["problems"]
    assert want_states[-1]["problems"]["unmapped_rows"] != ("int", 0)  # pass 11's rows
    r = want["routes"]
    assert any(v is not None for v in r["router_probs"]) and None in r["act_zero_ratio"]
    # rows of the last layer for the output rows only: fewer rows than rows x layers
    assert len(r["step_id"]) < 2 * sum(5 + i % 5 for i in range(12)) + 2 * 36
    if uncounted:  # against the same prompts counted: as many rows, routed, and in the rows of
        # passes 2 and 6 (7 + 1 and 6 + 1: the last layer for the output row only) and in their
        # output rows' token lists, every activation null
        counted, _ = _replay(_prompt_script(), drains, with_masks=False, states=False)
        c_r = counted["routes"]
        assert r["expert_ids"] == c_r["expert_ids"]

        def nulls(zero: list[Any]) -> int:
            return sum(z is None for z in zero)

        assert nulls(r["act_zero_ratio"]) == nulls(c_r["act_zero_ratio"]) + 8 + 7
        assert nulls(r["act_values"]) == nulls(c_r["act_values"]) + 8 + 7

        def all_null(lists: list[Any]) -> int:
            return sum(v is not None and all(x is None for x in v) for v in lists)

        assert all_null(want["tokens"]["act_zero_ratio"]) == all_null(counted["tokens"]["act_zero_ratio"]) + 2


def _slots_script(draws: dict[int, bool] | None = None) -> Script:
    """Two, then three sequences decoded together (as a server's slots are): each one's prompt
    (no sparse records), then steps of one row per sequence, all outputs, with per-layer routing
    and activation records; among them a one-row step of the first sequence alone, a step with
    router probabilities, a step whose activations were not counted, and what must take the
    per-row path: a row of layer 0 not counted, a layer whose routing is missing, a step with a
    prompt row (not an output). With `draws`, each sequence's head-sampling draw by the probes
    after its prompt's micro-batch record (the logits rows are sent either way, as the probes
    copy a row whose decode mixes draws)."""
    s = Script()
    logits = np.linspace(-1, 1, N_VOCAB, dtype=np.float32)
    toks = {0: 1, 1: 2, 2: 3}
    pos = {0: 3, 1: 3, 2: 3}
    for seq in (0, 1, 2):
        s.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
        s.ubatch([seq + 1, seq + 2, seq + 3], [0, 1, 2], seqs=[seq] * 3, outputs=[0, 0, 1])
        if draws is not None:
            end = s.recs.pop()
            s.small(ev.EV_HEAD_DRAW, seq, int(draws[seq]), 2)
            s.recs.append(end)
        s.sample(toks[seq], idx=2, logits=logits)
    for i in range(16):
        seqs = [0] if i == 9 else [0, 1, 2] if i >= 6 else [0, 1]
        outputs = [1] * len(seqs)
        if i == 12:  # a step with a new prompt's row of sequence 3 (not an output)
            seqs, outputs = [*seqs, 3], [*outputs, 0]
        n = len(seqs)
        tokens = [toks.get(q, 7) for q in seqs]
        s.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
        r = np.zeros(1, ev.UBATCH_DTYPE)  # the micro-batch, its records, then its end
        s._hdr(r, ev.EV_UBATCH)
        r["n_tokens"] = r["n_copied"] = n
        r["token"][0, :n], r["pos"][0, :n], r["seq_id"][0, :n] = tokens, [pos.get(q, 0) for q in seqs], seqs
        r["output"][0, :n] = outputs
        s.recs.append(r.tobytes())
        for layer in (0, 1):
            ids = np.array([[(i + j + layer) % 8, (i + j + layer + 3) % 8] for j in range(n)], np.int32)
            wts = np.array([[0.7 - 0.02 * j, 0.3 + 0.02 * j] for j in range(n)], np.float32)
            if not (i == 4 and layer == 1):  # pass 4: no routing for layer 1
                _tensor_rec(s, layer, ev.TAG_EXPERT_IDS, ids)
                _tensor_rec(s, layer, ev.TAG_EXPERT_WEIGHTS, wts)
            if i == 14:
                probs = np.full((n, 8), 0.125, np.float32)
                probs[:, layer] += 0.01 * i
                _tensor_rec(s, layer, ev.TAG_ROUTER_PROBS, probs)
            total = 2 * n
            counted = total - 1 if i == 2 and layer == 0 else total
            if i not in (9, 10):  # passes 9 and 10: no activations counted at all (--act-every)
                _act_rec(s, layer, 0, counted, total, base=i + layer)
        s.small(ev.EV_UBATCH_END)
        for j, seq in enumerate(seqs):
            if not outputs[j]:
                continue
            toks[seq] = (toks[seq] * 3 + i + j) % N_VOCAB
            pos[seq] += 1
            s.sample(toks[seq], idx=j, logits=logits + i + j)
    return s


@pytest.mark.parametrize("mode", ["split", "merged"])
@pytest.mark.parametrize("drains", [1, 6])
@pytest.mark.parametrize("rows", [True, False])
def test_steps_of_several_slots_as_arrays_equal_the_per_row_path(
    monkeypatch: pytest.MonkeyPatch, drains: int, rows: bool, mode: str
) -> None:
    """Steps over several sequences, every row an output, made arrays a run at a time: their
    routes rows and their token rows' per-layer lists equal what the per-row path makes (every
    table, the state and the problems counted), and so does the count of routes rows not made
    (--policy aggregate); a step the arrays cannot take is left to the per-row path. With the
    token rows split in two kinds (their block rows counted), and with a drain's few regular
    other rows made arrays with them (merged)."""
    given = _block_tokens_mode(monkeypatch, mode)
    s = _slots_script()
    kept: dict[str, list[Any]] = {"tokens": [], "routes": []}
    take_tokens, take_routes = RequestTokens.take_tokens, RoutesTables.take

    def keeping(self: RequestTokens) -> Any:
        got = take_tokens(self)
        kept["tokens"].append(got)
        return got

    def keeping_routes(self: RoutesTables) -> Any:
        got = take_routes(self)
        kept["routes"].append(got[0])
        return got

    def replay() -> tuple[Any, list[Any], int]:
        not_made: list[int] = []
        out, states = _replay(s, drains, with_masks=False, routes_rows=rows, not_made=not_made)
        return out, states, sum(not_made)

    monkeypatch.setattr(RequestTokens, "take_tokens", keeping)
    monkeypatch.setattr(RoutesTables, "take", keeping_routes)
    got, got_states, got_unmade = replay()
    parts = {table: list(v) for table, v in kept.items()}
    for v in kept.values():
        v.clear()
    monkeypatch.setattr(routes_module, "shape_key", lambda *a: None)
    want, want_states, want_unmade = replay()
    assert not any(isinstance(r, RowParts) for r in kept["tokens"])
    token_arrays = sum(p.n for r in parts["tokens"] if isinstance(r, RowParts) for p in r.arrays)
    # the steps of several slots but passes 2 (a row not counted), 4 (a layer's routing missing)
    # and 12 (a prompt row): 2 rows in 4 steps, 3 in 8; and pass 9's one row (its aggregate-less
    # one-row step takes the per-row path)
    assert sum(given) == 2 * 4 + 3 * 8
    if mode == "split":
        assert token_arrays == sum(given)
    elif drains > 1:  # the drains without a prompt's token or an irregular row: every row arrays
        assert token_arrays > sum(given)
    _assert_same((got, got_states), (want, want_states))
    assert got_unmade == want_unmade
    tok = want["tokens"]
    assert len(tok["token_id"]) == 3 + 2 * 6 + 3 * 9 + 1
    assert any(v is not None for v in tok["router_probs"])
    assert [None, None] in tok["act_zero_ratio"]  # pass 10's rows: activations not counted
    assert want_states[-1]["problems"]["unmapped_rows"] == ("int", 0)
    if rows:
        assert got_unmade == 0 and len(want["routes"]["step_id"]) > 2 * (2 * 6 + 3 * 9)
        # the frames equal those of the per-row lists
        for table, keys in (("tokens", ["step_id", "seq_id"]), ("routes", ["step_id", "row", "layer"])):
            buf = ColumnBuffer()
            for r in parts[table]:
                buf.add(table, r, final=False)
            frame = pl.concat([df for _, df in buf.take_all()])
            assert frame.sort(keys).equals(schema.frame(table, want[table]).sort(keys)), table
    else:
        assert got_unmade > 2 * (2 * 6 + 3 * 9)


def _feed_counting(
    c: Correlator, s: Script, drains: int, take_counted: Callable[[], int]
) -> tuple[dict[str, dict[str, list[object]]], int]:
    """The script's records fed in `drains` drains: every table's columns, and the rows
    `take_counted` (a RoutesTables take_ method) said were counted instead of made."""
    got: dict[str, dict[str, list[object]]] = {}
    counted = 0
    per = -(-len(s.recs) // drains)
    for k in range(0, len(s.recs), per):
        c.feed(decode_records(s.recs[k : k + per], 1024))
        for table, cols in c.take_tables(final=k + per >= len(s.recs)).items():
            for name, values in cols.items():
                got.setdefault(table, {}).setdefault(name, []).extend(values)
        counted += take_counted()
    return got, counted


@pytest.mark.parametrize("script", ["mixed", "dense_first", "runs"])
@pytest.mark.parametrize("drains", [1, 7])
def test_routes_rows_counted_unmade_are_the_rows_made(drains: int, script: str) -> None:
    """Without routes rows (--policy aggregate, no sink reading them) the correlator counts the
    rows it would have made, exactly, prompt rows and rows with layers missing included, and
    every other table is the same; on a model whose first layer is dense too, and on runs of
    plain steps (plain_run)."""
    s = {"mixed": _mixed_script, "runs": _run_script}.get(script, lambda: _block_script(script))()
    layers = BLOCK_LAYOUTS.get(script)
    made, _ = _replay(s, drains, with_masks=False, layers=layers)
    c = _correlator(routes_rows=False, **({"layers": layers} if layers else {}))
    unmade, counted = _feed_counting(c, s, drains, c.routes.take_not_made)
    assert counted == len(made["routes"]["step_id"]) > 60
    assert not any(unmade["routes"].values())
    for table in made.keys() - {"routes"}:
        assert unmade[table] == made[table], table
    with pytest.raises(ValueError, match="must be made"):
        _correlator(routes_rows=False, with_masks=True)


def test_sample_of_a_decode_before_the_attach_is_counted_apart() -> None:
    """Probes attached between a decode and its sampler call: that sample has no recorded row.
    It is counted as the attach boundary, not as a sample the recording failed to resolve, and
    the recording starts with the next decode."""
    s = Script()
    s.sample(9)
    s.decode([9], [12])
    s.sample(4)
    c = Correlator(pid=1, n_vocab=N_VOCAB, wall_offset_ns=0)
    c.feed(decode_records(s.recs, 1024))
    tok = c.take_tables()["tokens"]
    assert tok["token_id"] == [4]
    assert c.counters.samples_before_first_step == 1 and c.counters.samples_unresolved == 0


def test_server_sample_never_handed_to_a_slot_stays_with_its_request() -> None:
    """A request running before the attach (no launch seen) whose last sample gets no
    process_token call, then a task launched on the same slot: the sample is emitted when the
    next micro-batch begins, still with the request it was sampled for, and the earlier samples
    of that request stay one request (they once split into one request per token)."""
    s = Script()
    for k, (fed, pos) in enumerate(((5, 2), (9, 3), (4, 4))):
        s.decode([fed], [pos])
        s.sample((9, 4, 6)[k], idx=0)  # none of them handed to a slot
    s.small(ev.EV_SLOT_LAUNCH, 0, 77)  # a new task on slot 0
    s.decode([1, 2, 3], [0, 1, 2])
    s.sample(8, idx=-1)
    s.small(ev.EV_SLOT_TOKEN, 0, 8)
    c = Correlator(pid=1, n_vocab=N_VOCAB, wall_offset_ns=0, slot_tokens=True, serving=ServingTracker(pid=1))
    c.feed(decode_records(s.recs, 1024))
    tok = c.take_tables()["tokens"]
    assert tok["token_id"] == [9, 4, 6, 8] and tok["logits_pos"] == [2, 3, 4, 2]
    rids = tok["request_id"]
    assert rids[0] == rids[1] == rids[2] != rids[3] and rids[3] == "task-1-77"
    assert tok["decode_order"][3] == 0
    assert c.counters.samples_unresolved == 0 and c.counters.slot_tokens_unresolved == 0


def test_server_sample_never_handed_to_a_slot_keeps_its_own_decode() -> None:
    """llama-server: a sample waits for the process_token call that names its slot. When none
    comes, it is emitted at the next sample, after another decode has run: it must still be the
    row of the decode it sampled from (position 3), not the new decode's row at the same index."""
    s = Script()
    s.decode([5], [2])
    s.sample(9, idx=0)  # no process_token call follows
    s.decode([9], [3])
    s.sample(7, idx=0)
    s.small(ev.EV_SLOT_TOKEN, 0, 7)
    c = Correlator(pid=1, n_vocab=N_VOCAB, wall_offset_ns=0, slot_tokens=True)
    c.feed(decode_records(s.recs, 1024))
    tok = c.take_tables()["tokens"]
    assert tok["token_id"] == [9, 7] and tok["logits_pos"] == [2, 3]
    assert c.counters.samples_unresolved == 0 and c.counters.slot_tokens_unresolved == 0


def _compact(recs: list[bytes], agg_layers: int) -> list[bytes]:
    """The records as the probes now send them: a micro-batch of up to UB_SMALL_TOK rows in the
    small layout, an aggregate record sized for `agg_layers` layers (events.agg_layers_for); the
    fields the same, every other record as it was."""
    out = []
    big_agg = ev.STEP_AGG_DTYPE
    for raw in recs:
        if len(raw) == ev.UBATCH_DTYPE.itemsize:
            r = np.frombuffer(raw, ev.UBATCH_DTYPE)
            if int(r["n_copied"][0]) <= ev.UB_SMALL_TOK:
                small = np.zeros(1, ev.UBATCH_S_DTYPE)
                for name in ev.UBATCH_DTYPE.names or ():
                    v = r[name]
                    small[name] = v[:, : ev.UB_SMALL_TOK] if v.ndim > 1 else v
                raw = small.tobytes()
        elif len(raw) == big_agg.itemsize:
            a = np.frombuffer(raw, big_agg)
            dt = ev.STEP_AGG_DTYPES[agg_layers]
            # nothing past the smaller record's layers: the probes send those as records
            assert not a["k_ids"][0, agg_layers:].any() and not a["act_nr"][0, agg_layers:].any()
            assert int(a["att_n"][0]) <= agg_layers
            small = np.zeros(1, dt)
            for name in dt.names or ():
                v = a[name]
                if name == "lt_off":  # [threads, layers]
                    small[name] = v[:, :, :agg_layers]
                else:  # lt_tid is per thread, not per layer
                    small[name] = v[:, :agg_layers] if v.ndim > 1 and name != "lt_tid" else v
            raw = small.tobytes()
        out.append(raw)
    return out


def test_ubatch_s_and_agg_records_sized_to_the_model_mirror_the_c_structs(tmp_path: Path) -> None:
    """The small micro-batch record and the aggregate record built for fewer layers (the loader's
    -DAGG_LAYERS) have the sizes of their C structs; agg_layers_for leaves room for every layer
    and the mask writes of a pass, and every size of a session routes to one layout."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc
    src = tmp_path / "sizes.c"
    src.write_text(
        '#include <stdio.h>\n#include <linux/types.h>\n#include "events.h"\n'
        'int main(void){printf("%zu %zu\\n", sizeof(struct ev_ubatch_s), sizeof(struct ev_step_agg));'
        " return 0;}\n"
    )
    for layers in ev.AGG_LAYER_CHOICES:
        exe = tmp_path / f"sizes{layers}"
        flags = [f"-DAGG_LAYERS={layers}", f"-DAGG_LAYER_MASK={layers - 1}"]
        subprocess.run([cc, f"-I{ev.PROBES_DIR}", *flags, str(src), "-o", str(exe)], check=True)
        out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
        assert [int(x) for x in out] == [ev.UBATCH_S_DTYPE.itemsize, ev.STEP_AGG_DTYPES[layers].itemsize]
    # and with the layer times' thread slots the loader passes (-DLT_THREADS)
    for threads in ev.LT_THREAD_CHOICES:
        exe = tmp_path / f"sizes_t{threads}"
        flags = [
            "-DAGG_LAYERS=16",
            "-DAGG_LAYER_MASK=15",
            f"-DLT_THREADS={threads}",
            f"-DLT_THREAD_MASK={threads - 1}",
        ]
        subprocess.run([cc, f"-I{ev.PROBES_DIR}", *flags, str(src), "-o", str(exe)], check=True)
        out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
        assert int(out[1]) == ev.STEP_AGG_LAYOUTS[16, threads].itemsize
    assert [ev.lt_threads_for(n) for n in (None, 1, 2, 4, 5, 16, 17, 32, 33, 256)] == [
        4, 4, 4, 4, 8, 16, 32, 32, 32, 32,
    ]  # fmt: skip
    assert [ev.agg_layers_for(n) for n in (None, 0, 1, 6, 7, 14, 30, 31, 62, 63, 126, 127, 300)] == [
        128, 128, 8, 8, 16, 16, 32, 64, 64, 128, 128, 128, 128,
    ]  # fmt: skip
    for chunk in (1024, 32768, 65536):
        for layers in ev.AGG_LAYER_CHOICES:
            sizes = ev.record_sizes(chunk, layers)
            assert ev.STEP_AGG_DTYPES[layers].itemsize in sizes and ev.UBATCH_S_DTYPE.itemsize in sizes
    # two aggregate sizes in one drain cannot both be this session's
    agg8, agg16 = np.zeros(1, ev.STEP_AGG_DTYPES[8]), np.zeros(1, ev.STEP_AGG_DTYPES[16])
    with pytest.raises(ValueError, match="two sizes"):
        decode_records([agg8.tobytes(), agg16.tobytes()], 1024)


@pytest.mark.parametrize("script", ["mixed", "server", "slots", "prompt", "multirow", "dense_first"])
@pytest.mark.parametrize("drains", [1, 7])
def test_small_records_read_as_the_large_ones(
    monkeypatch: pytest.MonkeyPatch, drains: int, script: str
) -> None:
    """Micro-batches of a few rows in the small record, and aggregate records sized to the model:
    the correlator makes the same tables and keeps the same state as from the large records (the
    one-row steps' fast path, the slot runs, prompts and the handlers alike), and the fast path
    takes the same steps."""
    makers = {
        "mixed": _mixed_script,
        "server": _server_script,
        "slots": _slots_script,
        "prompt": _prompt_script,
        "multirow": _multirow_script,
        "dense_first": lambda: _block_script("dense_first"),
    }
    s = makers[script]()
    small = Script()
    small.recs = _compact(s.recs, 8)
    assert small.recs != s.recs
    kw: dict[str, Any] = {"with_masks": False, "server": script in ("server", "slots")}
    if script == "dense_first":
        kw["layers"] = BLOCK_LAYOUTS["dense_first"]
    taken = _count_taken(monkeypatch, "_fast_step")
    got = _replay(small, drains, **kw)
    taken_small = taken[:]
    taken.clear()
    _assert_same(got, _replay(s, drains, **kw))
    assert taken_small == taken
    if script == "mixed":
        assert sum(taken) > 10


def _need_c_backend() -> None:
    if logits_module.BACKEND != "c":
        pytest.skip("the C backend is not built (sparseety_prof/native/build.sh)")


def _server_replay_kw(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setattr(server_layout_check, "VERIFY_POSTS", 2)
    monkeypatch.setattr(server_layout_check, "VERIFY_LAUNCHES", 2)
    return {"server": True}


_REDUCE_SCRIPTS = {
    "mixed": (lambda: _mixed_script(), False),
    "runs": (lambda: _run_script(), False),
    "blocks": (lambda: _block_script(), False),
    "server": (lambda: _server_script(), True),
    "multirow": (lambda: _multirow_script(), False),
    "prompts": (lambda: _prompt_script(), False),
    "slots": (lambda: _slots_script(), True),
}


@pytest.mark.parametrize("reduce_every", [1, 3])
@pytest.mark.parametrize("drains", [1, 7, 40])
@pytest.mark.parametrize("script", sorted(_REDUCE_SCRIPTS))
def test_logits_reduced_when_drained_equal_the_statistics_made_with_the_rows(
    monkeypatch: pytest.MonkeyPatch, script: str, drains: int, reduce_every: int
) -> None:
    """The recorder reduces each drain's logits rows to their statistics as it takes them and
    correlates several drains together (logits_reduce.py, session/drain_batches.py): every
    table, every column, and the counters at the end, as when each drain is correlated as taken
    and the statistics are made from the floats at take_tables. With 40 drains, sampler calls
    are cut between drains: their logits records wait for the next one."""
    _need_c_backend()
    make, server = _REDUCE_SCRIPTS[script]
    kw: dict[str, Any] = _server_replay_kw(monkeypatch) if server else {}
    reducers: list[LogitsReducer] = []
    got = _replay(make(), drains, with_masks=False, reduce_every=reduce_every, reducers=reducers, **kw)
    want = _replay(make(), drains, with_masks=False, **kw)
    for name in want[0]:
        assert got[0][name].keys() == want[0][name].keys(), name
        for col in want[0][name]:
            assert got[0][name][col] == want[0][name][col], f"{name}.{col}"
    assert got[1][-1]["counters"] == want[1][-1]["counters"]
    lps = want[0]["tokens"]["log_prob"]
    assert sum(lp is not None for lp in lps) >= 10  # statistics were compared, not only nulls
    if drains == 40 and script in ("runs", "mixed", "server"):
        assert reducers[0].carried > 0  # calls cut between drains were reduced with the next


def _chunked_sample(
    s: Script, token: int, logits: np.ndarray, chunk: int, *, reread: int = -1, skip: int = -1
) -> None:
    """A sampler call whose row comes in records of `chunk` floats; chunk `reread` read twice
    (the first read with other values), chunk `skip` never read."""
    s.small(ev.EV_SAMPLE_BEGIN, -1, ev.SAMPLER_LLAMA)
    for k, c0 in enumerate(range(0, len(logits), chunk)):
        for again in range(2 if k == reread else 1):
            if k == skip:
                continue
            part = logits[c0 : c0 + chunk] + (7.0 if k == reread and again == 0 else 0.0)
            r = np.zeros(1, ev.logits_dtype(chunk))
            s._hdr(r, ev.EV_LOGITS)
            r["idx"], r["chunk"], r["n_vals"], r["n_vocab"] = -1, k, len(part), len(logits)
            r["vals"][0, : len(part)] = part
            s.recs.append(r.tobytes())
    s.small(ev.EV_SAMPLE_END, token, ev.SAMPLER_LLAMA, -1)


def _chunked_script(rows: list[np.ndarray]) -> Script:
    """Decode steps whose logits rows span 3 records of 4 floats (N_VOCAB = 10), with a chunk read
    twice (step 5), a chunk never read (step 9), a call whose end was lost and another begun
    (step 12), and a call of the step ending the script without its end."""
    s = Script()
    s.decode([1, 2], [0, 1])
    tok = 3
    for i, row in enumerate(rows):
        s.decode([tok], [2 + i])
        nxt = (tok * 3 + i) % N_VOCAB
        if i == 12:  # a begin and a logits record whose end was lost, then the call again
            s.small(ev.EV_SAMPLE_BEGIN, -1, ev.SAMPLER_LLAMA)
            r = np.zeros(1, ev.logits_dtype(4))
            s._hdr(r, ev.EV_LOGITS)
            r["chunk"], r["n_vals"], r["n_vocab"] = 0, 4, N_VOCAB
            s.recs.append(r.tobytes())
        _chunked_sample(s, nxt, row, 4, reread=1 if i == 5 else -1, skip=2 if i == 9 else -1)
        tok = nxt
    s.decode([tok], [2 + len(rows)])
    s.small(ev.EV_SAMPLE_BEGIN, -1, ev.SAMPLER_LLAMA)
    r = np.zeros(1, ev.logits_dtype(4))
    s._hdr(r, ev.EV_LOGITS)
    r["chunk"], r["n_vals"], r["n_vocab"] = 0, 4, N_VOCAB
    s.recs.append(r.tobytes())
    return s


def chunked_rows() -> list[np.ndarray]:
    """Sixteen logits rows for _chunked_script (each over several records at chunk=4)."""
    rng = np.random.default_rng(5)
    return [rng.normal(0, 3, N_VOCAB).astype(np.float32) for _ in range(16)]


@pytest.mark.parametrize("reduce_every", [1, 2])
@pytest.mark.parametrize("drains", [1, 5, 23])
def test_logits_rows_of_several_records_reduced_as_the_correlator_assembles_them(
    drains: int, reduce_every: int
) -> None:
    """Rows over several records (vocabularies beyond a record's floats): put together in chunk
    order, a chunk read twice counts its last read, a row missing a chunk is incomplete (null,
    counted), a call begun again drops what it had read; and the log-probs are the row's."""
    _need_c_backend()
    rows = chunked_rows()
    reducers: list[LogitsReducer] = []
    got = _replay(
        _chunked_script(rows), drains, with_masks=False, chunk=4, reduce_every=reduce_every, reducers=reducers
    )
    want = _replay(_chunked_script(rows), drains, with_masks=False, chunk=4)
    for col in want[0]["tokens"]:
        assert got[0]["tokens"][col] == want[0]["tokens"][col], col
    assert got[1][-1]["counters"] == want[1][-1]["counters"]
    tok = want[0]["tokens"]
    # the prompt's input token, then one row per sampler call
    assert len(tok["token_id"]) == 17 and want[1][-1]["counters"]["logits_incomplete"] == ("int", 1)
    lps, ids = tok["log_prob"][1:], tok["token_id"][1:]
    assert lps[9] is None and all(lp is not None for i, lp in enumerate(lps) if i != 9)
    for i in (0, 5, 12):  # the row's own log-softmax (float64 reference)
        x = rows[i].astype(np.float64)
        ref = x - x.max() - np.log(np.exp(x - x.max()).sum())
        assert lps[i] == pytest.approx(ref[ids[i]], abs=1e-5)
    assert reducers[0].dropped_open == 1  # the last call never ended


def test_reduced_runs_leave_unpaired_and_other_token_rows_null() -> None:
    """A run of reduced rows (plain_run's add_run_at) with a record no call completed (`at` past
    every table) and a row whose statistics were of another token: both null, the second counted."""
    from sparseety_prof.capture.logits_rows import LogitsStats
    from sparseety_prof.correlate.logit_stats import PendingStats
    from sparseety_prof.correlate.logits_reduce import UNPAIRED

    table = LogitsStats(
        np.array([4, 6], np.int64),
        np.array([-0.5, -1.5]),
        np.array([[4, 1], [6, 2]], np.int64),
        np.array([[-0.5, -2.0], [-1.5, -2.5]]),
        np.array([0.7, 0.9]),
    )
    p = PendingStats()
    p.add_run_at(0, table, np.array([0, UNPAIRED, 1], np.uint64), 10)
    tok: dict[str, list[object]] = {"token_id": [4, 5, 7]}
    p.fill(tok)
    assert tok["log_prob"] == [-0.5, None, None] and tok["top_ids"] == [[4, 1], None, None]
    assert p.token_mismatch == 1


def _drawn_requests(draws: bool) -> Script:
    """Three requests on sequence 0, each a prompt then 12 one-row decode steps, with the
    probes' head-sampling draws where token_probes.bpf.c sends them (after the micro-batch
    record, at a sequence's output row that does not continue it): keep, drop, keep. The dropped
    request's sampler calls read no logits row (the probes copied none)."""
    s = Script()
    logits = np.arange(N_VOCAB, dtype=np.float32)
    for n, keep in enumerate((True, False, True)):
        prompt = [1, 2 + n, 3]
        s.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
        s.ubatch(prompt, [0, 1, 2])
        end = s.recs.pop()  # the micro-batch's end, which ubatch() appended last
        if draws:
            s.small(ev.EV_HEAD_DRAW, 0, int(keep), 2)
        else:
            s.t += 100  # the same clock either way
        s.recs.append(end)
        s.sample(4, logits=logits if keep else None)
        for i in range(12):
            s.decode([4 + i % 3], [3 + i])
            s.sample(4 + (i + 1) % 3, logits=logits if keep else None)
    return s


def test_head_draws_in_the_probes_give_each_request_its_first_tokens_verdict() -> None:
    verdicts: dict[str, bool] = {}
    c = Correlator(
        pid=1,
        n_vocab=N_VOCAB,
        wall_offset_ns=0,
        texts=lambda ids: [f"t{i}" for i in ids],
        head_verdicts=verdicts,
    )
    c.feed(decode_records(_drawn_requests(True).recs, 1024))
    tok = c.take_tables()["tokens"]
    rids = list(dict.fromkeys(tok["request_id"]))
    assert len(rids) == 3
    assert verdicts == {rids[0]: True, rids[1]: False, rids[2]: True}
    assert (c.counters.head_draws_kept, c.counters.head_draws_dropped) == (2, 1)
    # the draw records change no row: the same stream without them gives the same tokens
    plain = run(_drawn_requests(False))
    assert {k: list(v) for k, v in tok.items()} == plain
    dropped = [lp for r, lp in zip(tok["request_id"], tok["log_prob"], strict=True) if r == rids[1]]
    assert len(dropped) == 13 and set(dropped) == {None}


def test_a_request_the_probes_drew_nothing_for_takes_its_sequences_last_draw() -> None:
    """A new request the consumer segments where the probes saw a continuation (no draw) is
    judged by the sequence's last draw: the probes copy (or not) its rows by that one."""
    s = _drawn_requests(True)
    s.small(ev.EV_SEQ_RM, 0, 5, -1, ctx=MEM)  # cells removed: a new request for the consumer
    s.decode([9], [15])  # ... which continues the positions: the probes draw nothing
    s.sample(5, logits=np.arange(N_VOCAB, dtype=np.float32))
    verdicts: dict[str, bool] = {}
    c = Correlator(pid=1, n_vocab=N_VOCAB, wall_offset_ns=0, head_verdicts=verdicts)
    c.feed(decode_records(s.recs, 1024))
    rids = [str(r) for r in dict.fromkeys(c.take_tables()["tokens"]["request_id"])]
    assert len(rids) == 4 and verdicts[rids[3]] is True  # the third request's draw: keep


def _drawn_block_requests() -> Script:
    """Three requests on sequence 0 drawn keep, drop, keep by the probes (EV_HEAD_DRAW after the
    prompt's micro-batch record), each a prompt then one-row decode steps with their aggregate
    records: 24 for the first (the attention map learned on its first ones, its steps take the
    AggBlock: fast_step, then plain_run's runs), 10 for the others; the third restarts the
    sequence's positions, a new request on the dropped one's sequence."""
    s = Script()
    logits = np.linspace(-2, 2, N_VOCAB, dtype=np.float32)
    k = 0
    for n, keep in enumerate((True, False, True)):
        s.small(ev.EV_SEQ_RM, -1, 0, -1, ctx=MEM)
        s.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
        s.ubatch([1, 2 + n, 3], [0, 1, 2])
        end = s.recs.pop()
        s.small(ev.EV_HEAD_DRAW, 0, int(keep), 2)
        s.recs.append(end)
        tok = 4 + n
        s.sample(tok, logits=logits if keep else None)
        for i in range(24 if n == 0 else 10):
            pos = 3 + i
            s.small(ev.EV_SEQ_RM, -1, pos, -1, ctx=MEM)
            s.small(ev.EV_DECODE_BEGIN, 1, tok, pos)
            _agg_step(s, tok, pos, ops=k < 8)
            k += 1
            tok = (tok * 7 + i) % N_VOCAB
            s.sample(tok, logits=logits + 0.01 * i if keep else None)
    return s


#: the prompts' draws of _prompt_script in the head-sampling test: every kind of prompt both ways
_PROMPT_DRAWS = [True, False, False, True, False, True, True, False, False, True, False, True]


#: the sequences' draws of _slots_script in the head-sampling test
_SLOT_DRAWS = {"slots": {0: False, 1: False, 2: False}, "slots_mixed": {0: False, 1: True, 2: False}}


@pytest.mark.parametrize("script", ["decode", "prompts", "slots", "slots_mixed"])
@pytest.mark.parametrize("drains", [1, 5, 11])
def test_head_dropped_requests_routes_rows_are_counted_not_made(
    monkeypatch: pytest.MonkeyPatch, drains: int, script: str
) -> None:
    """With head sampling in the probes and nothing but the recording reading routes rows
    (`head_drops_routes`), the routes rows of a request the probes drew to drop are counted
    instead of made: its prompt's (the draw comes before them) and its one-row steps', and a
    step's over several slots when every slot's request drew drop. Only rows the policy's hold
    would drop (session/request_hold.py: a request owns its sequence's steps after the previous
    request's last token step, up to its own); every other row, and the verdicts, as without.
    `prompts`: _prompt_script's prompts, whose rows take the arrays and the per-row path;
    `slots`: _slots_script's steps over several slots, every request dropped (the stacked runs
    and the per-row path), and `slots_mixed`, one kept."""
    slots = _SLOT_DRAWS.get(script)
    if script == "decode":
        s, draws = _drawn_block_requests(), [True, False, True]
    elif slots is not None:
        s, draws = _slots_script(slots), [slots[q] for q in (0, 1, 2)]
    else:
        s, draws = _prompt_script(_PROMPT_DRAWS), _PROMPT_DRAWS
    plain, _, in_runs = _count_plain(monkeypatch)

    def replay(drop: bool) -> tuple[dict[str, dict[str, list[object]]], int, dict[str, bool]]:
        verdicts: dict[str, bool] = {}
        c = _correlator(head_verdicts=verdicts, head_drops_routes=drop)
        got, counted = _feed_counting(c, s, drains, c.routes.take_head_dropped)
        assert counted == c.routes.rows_head_dropped_total
        return got, counted, verdicts

    made, none, verdicts = replay(False)
    got, counted, same = replay(True)
    assert none == 0 and same == verdicts
    tokens = made["tokens"]
    rids = [str(r) for r in dict.fromkeys(tokens["request_id"])]
    assert [verdicts[r] for r in rids] == draws
    if script == "decode":  # steps one by one (fast_step) and in runs (plain_run) both
        assert 0 < in_runs[0] < plain[0]
    routes = made["routes"]
    if slots is not None:  # a step's rows when every sequence in it drew drop
        seqs_of = dict(zip(made["steps"]["step_id"], made["steps"]["seq_ids"], strict=True))
        dropped = [
            i
            for i, st in enumerate(routes["step_id"])
            if all(slots.get(q, True) is False for q in seqs_of[st])  # type: ignore[attr-defined]
        ]
    else:  # each request's steps, as the hold owns them: requests one after the other
        last = {str(r): int(str(st)) for r, st in zip(tokens["request_id"], tokens["step_id"], strict=True)}
        owner: dict[int, str] = {}
        prev = -1
        for rid in rids:
            owner.update((st, rid) for st in range(prev + 1, last[rid] + 1))
            prev = last[rid]
        dropped = [i for i, st in enumerate(routes["step_id"]) if not verdicts[owner[int(str(st))]]]
    assert counted == len(dropped) > 0
    kept = sorted(set(range(len(routes["step_id"]))) - set(dropped))
    names = list(routes)

    def rows(cols: dict[str, list[object]], at: list[int]) -> list[str]:
        return sorted(repr(tuple(cols[n][i] for n in names)) for i in at)

    assert rows(got["routes"], list(range(len(got["routes"]["step_id"])))) == rows(routes, kept)
    for table in made.keys() - {"routes"}:
        assert got[table] == made[table], table


#: the columns the head-sampling test sets apart: what the aggregates and the policy's hold read
_APART_COLUMNS = {
    "tokens": frozenset(
        {"request_id", "ctx_id", "seq_id", "step_id", "ts_unix_ms", "log_prob", "expert_ids"}
    ),
    "steps": frozenset({"ts_unix_ms", "t_start_ns", "t_end_ns"}),
}
#: the same with the attention columns (a policy that learns them)
_APART_COLUMNS_ATTENTION = {
    "tokens": _APART_COLUMNS["tokens"] | {"attn_attended", "kv_cells_used"},
    "steps": _APART_COLUMNS["steps"],
}


@pytest.mark.parametrize("script", ["decode", "prompts", "slots", "slots_mixed"])
@pytest.mark.parametrize("drains", [1, 5, 11])
@pytest.mark.parametrize("attention", [False, True])
def test_head_dropped_requests_token_and_step_rows_are_set_apart(
    drains: int, script: str, attention: bool
) -> None:
    """With head sampling in the probes and `head_rows_apart` (nothing but the recording and the
    aggregates reading token and steps rows), the token rows of every request the probes drew to
    drop, and the steps rows all of whose sequences drew drop, leave the tables for take_apart:
    each with the columns asked for, the others null; every other row, and every other table,
    as without. The rows set apart frame to the dropped rows' values in those columns. The policy
    takes each verdict away as it learns the request (request_verdicts.Head pops it), here after
    every drain: the correlator keeps its own. The attention of a dropped request's later tokens
    is not made when the columns set apart leave it out, and is, equal, when they keep it."""
    apart_columns = _APART_COLUMNS_ATTENTION if attention else _APART_COLUMNS
    slots = _SLOT_DRAWS.get(script)
    if script == "decode":
        s = _drawn_block_requests()
    elif slots is not None:
        s = _slots_script(slots)
    else:
        s = _prompt_script(_PROMPT_DRAWS)

    def replay(apart: bool) -> tuple[dict[str, list[pl.DataFrame]], dict[str, bool], Correlator]:
        verdicts: dict[str, bool] = {}
        taken: dict[str, bool] = {}
        c = _correlator(head_verdicts=verdicts, head_rows_apart=apart_columns if apart else None)
        frames: dict[str, list[pl.DataFrame]] = {}
        per = -(-len(s.recs) // drains)
        for k in range(0, len(s.recs), per):
            c.feed(decode_records(s.recs[k : k + per], 1024))
            final = k + per >= len(s.recs)
            for table, cols in c.take_tables(final=final).items():
                buf = ColumnBuffer()
                frames.setdefault(table, []).extend(buf.add(table, cols, final=True))
            for table, parts in c.take_apart().items():
                buf = ColumnBuffer()
                cols = RowParts({}, parts, np.ones(sum(p.n for p in parts), dtype=bool))
                frames.setdefault(f"{table}_apart", []).extend(buf.add(table, cols, final=True))
            taken.update(verdicts)  # the policy learns them
            verdicts.clear()
        assert not c.requests.dropped_requests  # every request finished: none left behind
        return frames, taken, c

    def one(frames: dict[str, list[pl.DataFrame]], table: str) -> pl.DataFrame:
        got = [df for df in frames.get(table, []) if df.height]
        return pl.concat(got) if got else schema.empty(table.removesuffix("_apart"))

    made, verdicts, _ = replay(False)
    got, same, c = replay(True)
    assert same == verdicts and False in verdicts.values()
    assert c.requests.apart_without_attention is not attention
    tokens, steps = one(made, "tokens"), one(made, "steps")
    dropped = [r for r, keep in verdicts.items() if not keep]
    is_dropped = pl.col("request_id").is_in(dropped)
    assert one(got, "tokens").equals(tokens.filter(~is_dropped))
    apart = one(got, "tokens_apart")
    assert apart.columns == tokens.columns  # every column, those not asked for null
    keys = ["step_id", "seq_id"]
    names = sorted(apart_columns["tokens"])
    assert apart.sort(keys).select(names).equals(tokens.filter(is_dropped).sort(keys).select(names))
    for name in set(tokens.columns) - apart_columns["tokens"]:
        assert apart[name].null_count() == apart.height, name
    # steps: those whose every sequence drew drop when it was made; none over no sequence
    kept_steps, apart_steps = one(got, "steps"), one(got, "steps_apart")
    assert apart_steps.height > 0 and kept_steps.height + apart_steps.height == steps.height
    step_names = sorted(_APART_COLUMNS["steps"])
    both = pl.concat([kept_steps.select(step_names), apart_steps.select(step_names)])
    assert both.sort(step_names).equals(steps.select(step_names).sort(step_names))
    assert kept_steps.equals(steps.filter(pl.col("step_id").is_in(kept_steps["step_id"].implode())))
    last = tokens.group_by("request_id").agg(pl.col("step_id").max().alias("hi"), pl.col("seq_id").first())
    for row in steps.filter(~pl.col("step_id").is_in(kept_steps["step_id"].implode())).iter_rows(named=True):
        # owned by a dropped request on each of its sequences: the next request's last token
        # step at or after it (what the policy's hold would judge it by)
        for q in row["seq_ids"]:
            owner = last.filter((pl.col("seq_id") == q) & (pl.col("hi") >= row["step_id"])).sort("hi")
            assert owner.height and not verdicts[owner["request_id"][0]], (row["step_id"], q)
    assert c.rows_set_apart == {"tokens": apart.height, "steps": apart_steps.height}
    for table in made.keys() - {"tokens", "steps"}:
        assert one(got, table).equals(one(made, table)), table
