"""AttentionMap: the layer -> set_input_kq_mask call map is learned only from passes where every
attention layer's mask is one of the calls' and both counts of each mask agree; once learned,
layers without a graph-op record get their call's counts, and nothing is invented."""

from __future__ import annotations

from sparseety_prof.capture import events as ev
from sparseety_prof.correlate.attention_map import LEARN_PASSES, AttentionMap
from sparseety_prof.correlate.step_sparse import StepSparse

LAYERS = (0, 1, 2, 3)
FULL, SWA = 0x1000, 0x2000  # mask data pointers of the two calls


def _pass(*, ops: bool = True, op_count: int = 7, calls: tuple[int, ...] = (FULL, SWA)) -> StepSparse:
    """One decode pass as the aggregate carries it: the set_input calls (full mask: 7 cells, window:
    4) and, with `ops`, the graph-op nodes (layers 0, 2 full; 1, 3 window; first of each counted)."""
    sp = StepSparse()
    nodes: list[tuple[int, int, int, int]] = []  # (mask, layer or call, count, flags)
    for call, (mask, count) in enumerate(zip(calls, (7, 4), strict=False)):
        nodes.append((mask, call, count, ev.ATT_FLAG_KV_MASK))
    if ops:
        for layer, mask in ((0, FULL), (1, SWA), (2, FULL), (3, SWA)):
            if layer < 2:  # the first layer of each mask counts it
                nodes.append((mask, layer, op_count if mask == FULL else 4, 0))
            else:
                nodes.append((mask, layer, 0, ev.ATT_FLAG_CACHED | ev.ATT_FLAG_UNCOUNTED))
    masks, layers, counts, flags = (list(col) for col in zip(*nodes, strict=True))
    sp.add_agg_attn_lists((masks, layers, counts, flags), LAYERS)
    return sp


def test_learned_after_agreeing_passes_then_fills_layers_from_the_calls() -> None:
    amap = AttentionMap(LAYERS)
    for _ in range(LEARN_PASSES - 1):
        assert amap.observe(_pass()) == [] and not amap.ready
    amap.observe(_pass())
    assert amap.ready and amap.layer_calls == {0: 0, 1: 1, 2: 0, 3: 1}
    sp = _pass(ops=False)  # the graph-op probes are gone: only the calls' records
    assert sorted(amap.observe(sp)) == list(LAYERS)
    assert [sp.attn_counts[sp.attn_mask[layer]][0] for layer in LAYERS] == [7, 4, 7, 4]


def test_graph_op_records_win_over_the_map() -> None:
    amap = AttentionMap(LAYERS)
    for _ in range(LEARN_PASSES):
        amap.observe(_pass())
    sp = _pass()  # ops still attached (the detach comes at the next drain): nothing to fill
    assert amap.observe(sp) == []


def test_a_disagreeing_count_stops_the_learning() -> None:
    amap = AttentionMap(LAYERS)
    amap.observe(_pass())
    amap.observe(_pass(op_count=6))  # the op counted 6 cells of the mask the call counted 7 of
    for _ in range(2 * LEARN_PASSES):
        amap.observe(_pass())
    assert not amap.ready and amap.disagreements == 1
    assert amap.meta()["mask_read"] == "graph_ops"


def test_a_layer_on_no_call_mask_is_never_learned() -> None:
    amap = AttentionMap(LAYERS)
    for _ in range(2 * LEARN_PASSES):
        amap.observe(_pass(calls=(FULL,)))  # the window mask was not written by a call seen here
    assert not amap.ready


def test_a_call_missing_from_a_pass_leaves_its_layers_empty() -> None:
    amap = AttentionMap(LAYERS)
    for _ in range(LEARN_PASSES):
        amap.observe(_pass())
    sp = _pass(ops=False, calls=(FULL,))
    assert sorted(amap.observe(sp)) == [0, 2]
    assert 1 not in sp.attn_mask and 3 not in sp.attn_mask


def test_agreement_must_be_consecutive() -> None:
    amap = AttentionMap(LAYERS)
    for _ in range(LEARN_PASSES - 1):
        amap.observe(_pass())
    amap.observe(_pass(calls=(FULL,)))  # a pass that does not map every layer restarts the count
    for _ in range(LEARN_PASSES - 1):
        amap.observe(_pass())
    assert not amap.ready
    amap.observe(_pass())
    assert amap.ready


def test_attended_gives_each_layer_its_masks_count_of_the_row_and_none_where_nothing_counted() -> None:
    """StepSparse.attended, per attention layer: the count of the row under the layer's mask;
    None for a layer with no mask, a mask never counted, or a row its mask did not count."""
    sp = StepSparse()
    sp.attn_mask.update({0: FULL, 1: SWA, 2: FULL, 4: 0x3000})  # layer 3: no mask; 0x3000: no counts
    sp.attn_counts.update({FULL: {0: 7, 1: 8}, SWA: {0: 4}})
    layers = (0, 1, 2, 3, 4)
    assert sp.attended(0, layers) == [7, 4, 7, None, None]
    assert sp.attended(1, layers) == [8, None, 8, None, None]  # the window mask did not count row 1
    assert sp.attended(5, layers) == [None] * 5
    assert sp.attended(0, ()) == []
    assert _pass().attended(0, LAYERS) == [7, 4, 7, 4]
