"""sparse.py: how probe records become per-(row, layer) values, on synthetic records."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sparseety_prof.capture import events as ev
from sparseety_prof.capture.bpf_loader import (
    PROBES,
    _wanted,
    fdinfo_recursion_misses,
    probe_files,
    task_storage_usable,
)
from sparseety_prof.capture.options import TOKENS_ONLY, Capture
from sparseety_prof.capture.plans import LayerSet, MoePlan, layer_set, moe_plan
from sparseety_prof.correlate.agg_record import agg_rows_batch
from sparseety_prof.correlate.node_names import parse_name
from sparseety_prof.correlate.step_sparse import FILL_ROWS_MIN, Problems, StepSparse

LAYERS = LayerSet(moe=(0, 1), ffn=(0, 1), attn=(0, 1))


def _tensor(
    name: bytes,
    tag: int,
    rows: np.ndarray,
    *,
    stride_vals: int | None = None,
    row0: int = 0,
    total: int | None = None,
) -> dict[str, object]:
    n, k = rows.shape
    stride_vals = stride_vals or k
    buf = np.zeros((n, stride_vals), dtype=rows.dtype)
    buf[:, :k] = rows
    return {
        "name": name,
        "tag": tag,
        "type": 26 if rows.dtype == np.int32 else 0,
        "row0": row0,
        "n_rows": n,
        "rows_total": total if total is not None else n,
        "ne0": k,
        "row_stride": stride_vals * 4,
        "n_bytes": buf.nbytes,
        "data": buf.tobytes() + b"\0" * 64,
    }


def test_parse_name_and_layer_set() -> None:
    assert parse_name(b"ffn_moe_weights-12\0\0") == ("ffn_moe_weights", 12)
    assert parse_name(b"ffn_moe_swiglu-3") == ("ffn_moe_swiglu", 3)
    assert parse_name(b"kq_soft_max-0") == ("kq_soft_max", 0)
    assert parse_name(b"attn_norm-1") is None
    assert parse_name(b"ffn_moe_weights-99999") == ("ffn_moe_weights", 99999)
    # a longer number is no model's layer (and would overflow the arrays layers are gathered in)
    assert parse_name(b"ffn_moe_weights-" + b"9" * 25) is None
    names = [
        "blk.0.ffn_gate_inp.weight",
        "blk.0.ffn_down_exps.weight",
        "blk.0.attn_output.weight",
        "blk.1.ffn_down.weight",
        "blk.1.attn_output.weight",
    ]
    assert layer_set(names, 2) == LayerSet(moe=(0,), ffn=(0, 1), attn=(0, 1))


def test_ids_view_rows_weights_and_output_only_rows() -> None:
    sp = StepSparse()
    # layer 0: all 3 batch rows; ids are a view of the argsort (stride n_expert = 8, k = 2)
    sp.add_tensor(
        _tensor(
            b"ffn_moe_weights-0",
            ev.TAG_EXPERT_IDS,
            np.array([[5, 1], [2, 7], [0, 3]], np.int32),
            stride_vals=8,
        )
    )
    sp.add_tensor(
        _tensor(
            b"ffn_moe_weighted-0",
            ev.TAG_EXPERT_WEIGHTS,
            np.array([[0.75, 0.25], [0.5, 0.5], [0.9, 0.1]], np.float32),
        )
    )
    # layer 1 (the last): computed for the output row only
    sp.add_tensor(
        _tensor(b"ffn_moe_weights-1", ev.TAG_EXPERT_IDS, np.array([[4, 6]], np.int32), stride_vals=8)
    )
    out_index = {2: 0}  # only batch row 2 produces logits
    p = Problems()
    v2 = sp.row_values(2, out_index, 3, LAYERS, p)
    assert v2["expert_ids"] == [[0, 3], [4, 6]]
    assert v2["expert_weights"][0] == [np.float32(0.9), np.float32(0.1)]
    v0 = sp.row_values(0, out_index, 3, LAYERS, p)
    assert v0["expert_ids"] == [[5, 1], None]  # layer 1 was not computed for row 0: nothing invented
    assert p.unmapped_rows == 0


def test_tensor_matching_neither_batch_nor_outputs_is_counted_not_guessed() -> None:
    sp = StepSparse()
    sp.add_tensor(_tensor(b"ffn_moe_weights-0", ev.TAG_EXPERT_IDS, np.array([[1, 2], [3, 4]], np.int32)))
    p = Problems()
    v = sp.row_values(0, {4: 0}, 5, LAYERS, p)
    assert v["expert_ids"][0] is None
    assert p.unmapped_rows == 1


def _act(sp: StepSparse, layer: int, row: int, n_tokens: int, p: Problems) -> tuple[object, object, object]:
    """One row's activation values of one layer: (zero ratio, below ratio, values counted)."""
    v = sp.row_values(row, {}, n_tokens, LayerSet(ffn=(layer,)), p)
    return v["act_zero_ratio"][0], v["act_below_ratio"][0], v["act_values"][0]


def test_activation_counts_sum_over_expert_slots_and_threads() -> None:
    sp = StepSparse()
    base = {"name": b"ffn_moe_reglu-1", "ne0": 100, "ne1": 2, "nr_total": 4}  # 2 tokens x 2 slots
    z = [0] * ev.ACT_MAX_ROWS
    b = [0] * ev.ACT_MAX_ROWS
    sp.add_act(
        {**base, "ir0": 0, "n_rows": 2, "zeros": [40, 60, *z[2:]], "below": [50, 70, *b[2:]]}, with_bits=False
    )
    sp.add_act(
        {**base, "ir0": 2, "n_rows": 2, "zeros": [10, 0, *z[2:]], "below": [20, 5, *b[2:]]}, with_bits=False
    )
    p = Problems()
    assert _act(sp, 1, 0, 2, p) == (0.5, 0.6, 200)
    assert _act(sp, 1, 1, 2, p) == (0.05, 0.125, 200)
    rows = [sp.row_values(b, {}, 2, LayerSet(ffn=(1,)), p) for b in (0, 1)]
    assert [v["act_zero_ratio"] for v in rows] == [[0.5], [0.05]]


def test_uncounted_rows_give_null_not_zero() -> None:
    sp = StepSparse()
    rows = [7] * ev.ACT_MAX_ROWS
    sp.add_act(
        {
            "name": b"ffn_swiglu-0",
            "ne0": 64,
            "ne1": 3,
            "nr_total": 3,
            "ir0": 0,
            "n_rows": 2,
            "zeros": rows,
            "below": rows,
        },
        with_bits=False,
    )
    p = Problems()
    assert _act(sp, 0, 1, 3, p)[0] == 7 / 64
    assert _act(sp, 0, 2, 3, p) == (None, None, 0)  # row 2 never counted


def _random_prompt_step(
    rng: np.random.Generator, n: int, layers: LayerSet
) -> tuple[StepSparse, dict[int, int]]:
    """A prompt pass's records as the engine may send them: MoE layers with every row, only the
    output rows, rows missing, or a row count that maps to nothing; FFN layers counted for every
    row, for some, for the outputs only, with expert slots; some layers absent."""
    sp = StepSparse()
    outputs = sorted(rng.choice(n, size=int(rng.integers(0, 3)), replace=False).tolist())
    out_index = {b: k for k, b in enumerate(outputs)}
    for layer in layers.moe:
        shape = rng.choice(["all", "outputs", "partial", "unmapped", "absent"])
        total = {"all": n, "partial": n, "outputs": len(outputs), "unmapped": n + 3, "absent": 0}[shape]
        if total == 0:
            continue
        ids = rng.integers(0, 8, (total, 2)).astype(np.int32)
        wts = rng.random((total, 2)).astype(np.float32)
        upto = total if shape != "partial" else int(rng.integers(1, total + 1))
        for tag, vals in ((ev.TAG_EXPERT_IDS, ids), (ev.TAG_EXPERT_WEIGHTS, wts), (ev.TAG_ROUTER_PROBS, wts)):
            if tag == ev.TAG_ROUTER_PROBS and rng.random() < 0.5:
                continue
            name = b"ffn_moe_weights-%d" % layer
            sp.add_tensor(_tensor(name, tag, vals[:upto], stride_vals=8, total=total))
    for layer in layers.ffn:
        shape = rng.choice(["all", "outputs", "partial", "absent"])
        tokens = {"all": n, "partial": n, "outputs": len(outputs), "absent": 0}[shape]
        if tokens == 0:
            continue
        slots = int(rng.integers(1, 3))
        kind = b"ffn_moe_reglu" if slots > 1 else b"ffn_swiglu"
        nr = tokens * slots
        upto = nr if shape != "partial" else int(rng.integers(1, nr + 1))
        for ir0 in range(0, upto, ev.ACT_MAX_ROWS):
            k = min(ev.ACT_MAX_ROWS, upto - ir0)
            zeros = [*rng.integers(0, 50, k).tolist(), *[0] * (ev.ACT_MAX_ROWS - k)]
            below = [*rng.integers(0, 60, k).tolist(), *[0] * (ev.ACT_MAX_ROWS - k)]
            r = {"name": b"%s-%d" % (kind, layer), "ne0": 64, "ne1": slots, "nr_total": nr}
            sp.add_act({**r, "ir0": ir0, "n_rows": k, "zeros": zeros, "below": below}, with_bits=False)
    return sp, out_index


def test_a_prompts_rows_made_at_once_equal_row_by_row() -> None:
    """StepSparse.fill_rows (a multi-row pass's rows at once, RoutesTables.emit) gives every row
    what row_values gives it alone, and counts the same problems."""
    rng = np.random.default_rng(3)
    layers = LayerSet(moe=(0, 2, 3), ffn=(0, 1, 2, 3), attn=())
    seen = {"ids": 0, "no ids": 0, "ratio": 0, "no ratio": 0, "unmapped": 0}
    for _ in range(300):
        n = int(rng.integers(FILL_ROWS_MIN, 60))
        sp, out_index = _random_prompt_step(rng, n, layers)
        alone = StepSparse(**{f: getattr(sp, f) for f in ("ids", "weights", "probs")})
        for f in ("act_zeros", "act_below", "act_width", "act_slots"):
            setattr(alone, f, getattr(sp, f))
        p_alone, p_once = Problems(), Problems()
        first = int(rng.integers(0, n))  # a row asked for before (the token row of a sample)
        sp.row_values(first, out_index, n, layers, p_once)
        sp.fill_rows(list(range(n)), out_index, n, layers, p_once)
        assert len(sp._row_cache) == (n if n - 1 >= FILL_ROWS_MIN else 1)
        for b in range(n):
            got = sp.row_values(b, out_index, n, layers, p_once)
            assert got == alone.row_values(b, out_index, n, layers, p_alone), (b, n, out_index)
            seen["ids"] += sum(v is not None for v in got["expert_ids"])
            seen["no ids"] += got["expert_ids"].count(None)
            seen["ratio"] += sum(v is not None for v in got["act_zero_ratio"])
            seen["no ratio"] += got["act_zero_ratio"].count(None)
        assert p_once.unmapped_rows == p_alone.unmapped_rows
        seen["unmapped"] += p_once.unmapped_rows
    assert min(seen.values()) > 100, seen  # every case was met, many times


def test_aggregate_record_of_a_one_row_step() -> None:
    rec = np.zeros(1, dtype=ev.STEP_AGG_DTYPE)[0]
    rec["k_ids"][0] = 2
    rec["ids"][0, :2] = [6, 1]
    rec["k_wts"][0] = 2
    rec["wts"][0, :2] = [0.625, 0.375]
    rec["act_nr"][1], rec["act_rows"][1], rec["act_slots"][1], rec["act_ne0"][1] = 2, 2, 2, 50
    rec["act_zero"][1], rec["act_below"][1] = 30, 40
    rec["act_nr"][0], rec["act_rows"][0], rec["act_slots"][0], rec["act_ne0"][0] = 2, 1, 2, 50  # half counted
    r = {name: rec[name] for name in ev.STEP_AGG_DTYPE.names or ()}
    sp = StepSparse.from_agg(r)
    rec["ids"][0, :2] = [0, 0]  # the record's memory is reused later: values were copied
    v = sp.row_values(0, {0: 0}, 1, LayerSet(moe=(0,), ffn=(0, 1)), Problems())
    assert v["expert_ids"] == [[6, 1]]
    assert v["expert_weights"] == [[0.625, 0.375]]
    assert v["act_zero_ratio"] == [None, 0.3]  # layer 0 not fully counted: null
    assert v["act_below_ratio"] == [None, 0.4]


def test_attention_counts_shared_by_layers_with_one_mask_and_unnamed_nodes_in_order() -> None:
    sp = StepSparse()
    rows = [0] * ev.ATT_MAX_ROWS
    counted = {"row": [3, *rows[1:]], "attended": [4, *rows[1:]]}
    rec = {"n_kv": 256, "aflags": 0}
    sp.add_attn({"name": b"kq_soft_max-0", "mask": 0xAA, "n_counted": 1, **rec, **counted})
    sp.add_attn(
        {"name": b"kq_soft_max-1", "mask": 0xAA, "n_counted": 0, "row": rows, "attended": rows, **rec}
    )  # same mask: counted once
    assert sp.row_values(3, {3: 0}, 4, LAYERS, Problems())["attn_attended"] == [4, 4]
    sp2 = StepSparse()
    # the mask where the engine wrote it ("kq_mask-<n>", flagged): no layer of its own
    kv = {"name": b"kq_mask-0", "mask": 0xBB, "n_kv": 256, "n_counted": 1, "aflags": ev.ATT_FLAG_KV_MASK}
    assert sp2.add_attn({**kv, **counted}, (0, 1)) is None
    for _ in range(2):  # unnamed flash-attention nodes: the k-th is the k-th attention layer
        sp2.add_attn({"name": b"", "mask": 0xBB, "n_counted": 1, **rec, **counted}, (0, 1))
    assert set(sp2.attn_mask) == {0, 1}
    assert sp2.kv_masks == {0: 0xBB} and sp2.kv_counts == {0: {3: 4}}


def _agg_record() -> np.ndarray:
    rec = np.zeros(1, dtype=ev.STEP_AGG_DTYPE)[0]
    rec["k_ids"][0], rec["k_ids"][2] = 2, 2
    rec["ids"][0, :2], rec["ids"][2, :2] = [6, 1], [3, 4]
    rec["k_wts"][0] = 2  # layer 2's weights not captured: null, not zero
    rec["wts"][0, :2] = [0.625, 0.375]
    rec["act_nr"][1], rec["act_rows"][1], rec["act_slots"][1], rec["act_ne0"][1] = 2, 2, 2, 50
    rec["act_zero"][1], rec["act_below"][1] = 30, 40
    rec["act_nr"][0], rec["act_rows"][0], rec["act_slots"][0], rec["act_ne0"][0] = 2, 1, 2, 50  # half counted
    # attention: layer 0 counted, layer 1 shares its mask (uncounted), then two unnamed nodes
    rec["att_n"] = 4
    rec["att_mask"][:4] = [0xAA, 0xAA, 0xBB, 0xCC]
    rec["att_layer"][:4] = [0, 1, -1, -1]
    rec["att_count"][:4] = [17, 0, 9, 5]
    rec["att_flags"][:4] = [0, ev.ATT_FLAG_CACHED | ev.ATT_FLAG_UNCOUNTED, 0, 0]
    return rec


def test_aggregate_fast_path_equals_the_per_layer_stores() -> None:
    layers = LayerSet(moe=(0, 2), ffn=(0, 1, 2), attn=(0, 1, 2, 3))
    rec = _agg_record()
    r = {name: rec[name] for name in ev.STEP_AGG_DTYPE.names or ()}
    slow = StepSparse.from_agg(r)
    fast, moe_seen, ffn_seen = StepSparse.from_agg_row(r, layers)
    for sp in (slow, fast):
        assert sp.add_agg_attn(r, (2, 3)) == [0, 1, 2, 3]  # unnamed nodes: the remaining layers in order
    assert moe_seen == sorted(slow.ids) == [0, 2]
    assert ffn_seen == sorted(slow.act_zeros) == [1]
    v_slow = slow.row_values(0, {0: 0}, 1, layers, Problems())
    v_fast = fast.row_values(0, {0: 0}, 1, layers, Problems())
    assert v_fast == v_slow
    assert v_fast["expert_ids"] == [[6, 1], [3, 4]]
    assert v_fast["expert_weights"] == [[0.625, 0.375], None]
    assert v_fast["act_zero_ratio"] == [None, 0.3, None]
    assert v_fast["act_values"] == [0, 100, 0]
    assert v_fast["attn_attended"] == [17, 17, 9, 5]  # layer 1 shares layer 0's mask and count


def _complete_agg_record(i: int) -> np.ndarray:
    """A decode step's aggregate as the probes fill it: every layer of LAYERS_3 complete."""
    rec = np.zeros(1, dtype=ev.STEP_AGG_DTYPE)[0]
    rec["seq"] = 100 + i
    for layer in (0, 1, 2):
        rec["k_ids"][layer] = rec["k_wts"][layer] = 2
        rec["ids"][layer, :2] = [(i + layer) % 8, (i + layer + 3) % 8]
        rec["wts"][layer, :2] = np.array([0.7 - 0.01 * i, 0.3 + 0.01 * i], dtype=np.float32).view(np.uint32)
        rec["act_nr"][layer] = rec["act_rows"][layer] = rec["act_slots"][layer] = 2
        rec["act_ne0"][layer] = 64
        rec["act_zero"][layer], rec["act_below"][layer] = i + layer, 3 * i + layer
    rec["att_n"] = 2
    rec["att_mask"][:2] = [0xAA, 0xAA]
    rec["att_layer"][:2] = [0, 1]
    rec["att_count"][:2] = [10 + i, 0]
    rec["att_flags"][:2] = [0, ev.ATT_FLAG_CACHED | ev.ATT_FLAG_UNCOUNTED]
    return rec


LAYERS_3 = LayerSet(moe=(0, 1, 2), ffn=(0, 1, 2), attn=(0, 1, 2, 3))


def test_aggregate_rows_of_a_drain_at_once_equal_the_per_record_path() -> None:
    """agg_rows_batch gives what from_agg_row and add_agg_attn give record by record, for
    complete rows (the batch path) and rows with missing layers, short k or half-counted
    activations among them (the per-layer fallback); for a dense model too."""
    recs = [_complete_agg_record(i) for i in range(5)]
    partial = _agg_record()
    partial["seq"] = 7
    short_k = _complete_agg_record(9)
    short_k["k_ids"][1] = short_k["k_wts"][1] = 1
    no_act = _complete_agg_record(11)  # a pass whose activations --act-every did not count
    no_act["active"] = 2
    for f in ("act_nr", "act_rows", "act_zero", "act_below", "act_ne0", "act_slots"):
        no_act[f][:] = 0
    # steps the sparse probes did not see (out between --duty-cycle windows): nothing routed or
    # counted, the attention nodes still there or not
    unseen_attn = _complete_agg_record(13)
    for f in (
        "k_ids",
        "k_wts",
        "ids",
        "wts",
        "act_nr",
        "act_rows",
        "act_zero",
        "act_below",
        "act_ne0",
        "act_slots",
    ):
        unseen_attn[f] = 0
    unseen = unseen_attn.copy()
    unseen["att_n"] = 0
    mixed = [recs[0], partial, recs[1], unseen, short_k, no_act, unseen_attn, *recs[2:]]
    all_unseen = [unseen, unseen_attn, unseen]
    drains = [np.array(d, dtype=ev.STEP_AGG_DTYPE) for d in (mixed, all_unseen)]
    layer_sets = (LAYERS_3, LayerSet(moe=(0, 2), ffn=(0, 1, 2), attn=(0, 1, 2, 3)), LayerSet(ffn=(0, 1)))
    for arr, layers in ((a, ls) for a in drains for ls in layer_sets):
        batch = agg_rows_batch(arr, layers)
        assert batch is not None and len(batch) == len(arr)
        for rec, pre in zip(arr, batch, strict=True):
            r = {name: rec[name] for name in ev.STEP_AGG_DTYPE.names or ()}
            one, moe_seen, ffn_seen = StepSparse.from_agg_row(r, layers)
            # a record whose values are all in the block has them made from there when asked
            assert (pre.values is None) == (pre.block is not None)
            assert StepSparse.from_pre(pre)._agg_values() == one._agg_row
            assert (pre.moe_seen, pre.ffn_seen) == (moe_seen, ffn_seen)
            a, b = StepSparse.from_pre(pre), StepSparse()
            assert a.add_agg_attn_lists(pre.attn, (2, 3)) == b.add_agg_attn(r, (2, 3))
            assert (a.attn_mask, a.attn_counts) == (b.attn_mask, b.attn_counts)
    # a layer beyond what the record holds: no batch, every record takes from_agg_row
    assert agg_rows_batch(drains[0], LayerSet(moe=(0, ev.AGG_MAX_LAYERS))) is None


def test_aggregate_attention_merges_into_records_that_came_first() -> None:
    rec = _agg_record()
    r = {name: rec[name] for name in ev.STEP_AGG_DTYPE.names or ()}
    sp = StepSparse()
    sp.add_act(
        {
            "name": b"ffn_moe_swiglu-2",
            "ne0": 50,
            "ne1": 2,
            "nr_total": 2,
            "ir0": 0,
            "n_rows": 2,
            "zeros": [5, 5],
            "below": [6, 6],
        },
        with_bits=False,
    )
    assert sp.from_records
    sp.merge(StepSparse.from_agg(r))
    sp.add_agg_attn(r, (2, 3))
    v = sp.row_values(0, {0: 0}, 1, LayerSet(moe=(0,), ffn=(1, 2), attn=(0, 1, 2, 3)), Problems())
    assert v["act_zero_ratio"] == [0.3, 0.1]
    assert v["attn_attended"] == [17, 17, 9, 5]


def _tensors(layers: dict[int, list[str]]) -> list[str]:
    return [f"blk.{i}.{t}.weight" for i, ts in layers.items() for t in ts]


EXPERTS = ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "attn_output"]


def test_moe_plan_reads_at_the_multiply_only_where_the_graph_allows() -> None:
    all_moe = _tensors({0: EXPERTS, 1: EXPERTS})
    ls = layer_set(all_moe, 2)
    assert moe_plan(all_moe, ls, "qwen3moe") == MoePlan(ids_at_mul=True, act_at_mul=True)
    # a dense FFN layer (deepseek's first layers) or shared experts have GLU nodes of their own:
    # activations stay at the GLU op, ids still come from the multiply
    dense_first = _tensors({0: ["ffn_down", "ffn_up", "ffn_gate", "attn_output"], 1: EXPERTS})
    assert moe_plan(dense_first, layer_set(dense_first, 2), "deepseek2") == MoePlan(True, False)
    shared = _tensors({0: [*EXPERTS, "ffn_down_shexp"], 1: [*EXPERTS, "ffn_down_shexp"]})
    assert moe_plan(shared, layer_set(shared, 2), "qwen2moe") == MoePlan(True, False)
    # weights applied before the experts: the multiply does not sit on the down projection
    assert moe_plan(all_moe, ls, "llama4") == MoePlan()
    dense = _tensors({0: ["ffn_down", "ffn_up", "attn_output"]})
    assert moe_plan(dense, layer_set(dense, 1), "llama") == MoePlan()
    assert MoePlan(True, True).cflags() == ["-DIDS_AT_MUL", "-DACT_AT_MUL"]


def test_probes_follow_the_moe_plan() -> None:
    by_fn = {p.fn_entry: p for p in PROBES}
    get_rows, mul, glu = by_fn["moe_get_rows_enter"], by_fn["moe_mul_enter"], by_fn["glu_enter"]
    full, both = Capture(), MoePlan(ids_at_mul=True, act_at_mul=True)
    assert [_wanted(p, full, both) for p in (get_rows, mul, glu)] == [False, True, False]
    assert [_wanted(p, full, MoePlan()) for p in (get_rows, mul, glu)] == [True, True, True]
    # router probabilities come from get_rows whatever the plan
    assert _wanted(get_rows, Capture(router_probs=True), both)
    # activations alone still need the multiply when they are read there
    acts_only = Capture(routes=False, attention=False)
    assert [_wanted(p, acts_only, both) for p in (get_rows, mul, glu)] == [False, True, False]
    assert [_wanted(p, acts_only, MoePlan()) for p in (get_rows, mul, glu)] == [False, False, True]


def test_probe_files_follow_the_decisions_captured() -> None:
    common, act, moe, attn = (f"sparse_{d}.bpf.c" for d in ("common", "activation", "moe", "attention"))
    assert probe_files(TOKENS_ONLY, MoePlan()) == ["token_probes.bpf.c", "server_probes.bpf.c"]
    assert probe_files(Capture(), MoePlan())[1:-1] == [common, act, moe, attn]
    # activations read at the multiply need the MoE file without routes
    acts_only = Capture(routes=False, attention=False)
    assert probe_files(acts_only, MoePlan(act_at_mul=True))[1:-1] == [common, act, moe]
    assert probe_files(acts_only, MoePlan())[1:-1] == [common, act]
    assert probe_files(Capture(routes=False, activations=False), MoePlan())[1:-1] == [common, attn]


def test_probe_files_hold_every_program_the_loader_attaches() -> None:
    for routes, probs, acts, attention, ids_at_mul, act_at_mul in itertools.product((False, True), repeat=6):
        capture = Capture(routes=routes, router_probs=probs, activations=acts, attention=attention)
        # the plan as compile_and_attach narrows it to the capture
        moe = MoePlan(ids_at_mul=ids_at_mul and routes and not probs, act_at_mul=act_at_mul and acts)
        text = "\n".join((ev.PROBES_DIR / f).read_text() for f in probe_files(capture, moe))
        wanted = [p.fn_entry for p in PROBES if _wanted(p, capture, moe)]
        wanted += [p.fn_return for p in PROBES if _wanted(p, capture, moe)]
        wanted += ["glu_continue"] if acts else []  # tail-call targets, loaded by name
        wanted += ["kvmask_f16"] if attention else []
        missing = [fn for fn in wanted if fn and f"int {fn}(struct pt_regs *ctx)" not in text]
        assert not missing, (capture, moe, missing)


def test_task_storage_by_kernel_release(monkeypatch: pytest.MonkeyPatch) -> None:
    assert task_storage_usable("6.18.44-fc") and task_storage_usable("5.11.0")
    assert not task_storage_usable("5.10.200") and not task_storage_usable("4.19.0-x")
    monkeypatch.setenv("SPARSEETY_PROF_TASK_STORAGE", "0")
    assert not task_storage_usable("6.18.44-fc")


def test_program_misses_from_fdinfo() -> None:
    info = "prog_type:\t2\nrun_time_ns:\t0\nrun_cnt:\t5\nrecursion_misses:\t3\nverified_insns:\t2\n"
    assert fdinfo_recursion_misses(info) == 3
    assert fdinfo_recursion_misses("prog_type:\t2\n") == 0  # a kernel that does not report it
