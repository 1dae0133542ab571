"""Aggregate records (struct ev_step_agg): a one-row micro-batch's routing, activation counts and
attention nodes in one record, sent by the thread that ran it. Here they become the row's
per-layer values, for a whole drain at once."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from sparseety_prof.capture.plans import LayerSet
from sparseety_prof.correlate.attention_records import AggAttn

_AGG_LAYOUTS: dict[tuple[LayerSet, int], tuple[list[int], np.ndarray, list[int], np.ndarray]] = {}


def agg_layout(layers: LayerSet, capacity: int) -> tuple[list[int], np.ndarray, list[int], np.ndarray]:
    """The MoE and FFN layers an aggregate record of `capacity` layers (its AGG_LAYERS) can hold,
    as lists and index arrays (made once per layer set and capacity: indexing with a Python list
    converts it on every call)."""
    key = (layers, capacity)
    got = _AGG_LAYOUTS.get(key)
    if got is None:
        moe = [layer for layer in layers.moe if layer < capacity]
        ffn = [layer for layer in layers.ffn if layer < capacity]
        got = _AGG_LAYOUTS[key] = (moe, np.array(moe, dtype=np.intp), ffn, np.array(ffn, dtype=np.intp))
    return got


def agg_row_values(r: dict[str, Any], layers: LayerSet) -> tuple[dict[str, list[Any]], list[int], list[int]]:
    """One record's per-layer values of its row, as StepSparse.row_values gives them (but the
    attention), vectorised over layers; and the MoE and FFN layers it saw."""
    k_ids, nr = np.asarray(r["k_ids"]), np.asarray(r["act_nr"])
    moe, moe_idx, ffn, ffn_idx = agg_layout(layers, len(k_ids))
    kid, kwt = k_ids[moe_idx].tolist(), np.asarray(r["k_wts"])[moe_idx].tolist()
    ids_l = np.asarray(r["ids"])[moe_idx].tolist()
    wts_l = np.asarray(r["wts"])[moe_idx].view(np.float32).tolist()
    by_moe = {
        layer: (i[:a] if a else None, w[:b] if b else None)
        for layer, a, b, i, w in zip(moe, kid, kwt, ids_l, wts_l, strict=True)
    }
    # a layer counts when every row was counted and they are one token's rows
    rows, slots = np.asarray(r["act_rows"]), np.asarray(r["act_slots"])
    complete = (nr != 0) & (rows == nr) & (nr == np.maximum(slots, 1))
    ffn_seen = np.flatnonzero(complete).tolist()
    cols = [np.asarray(r[f])[ffn_idx].tolist() for f in ("act_nr", "act_zero", "act_below", "act_ne0")]
    ok = complete[ffn_idx].tolist()
    by_ffn: dict[int, tuple[float, float, int]] = {}
    for layer, good, n_r, zero, below, ne0 in zip(ffn, ok, *cols, strict=True):
        if good and ne0:
            n = n_r * ne0  # n_r == rows per token (k for MoE activations)
            by_ffn[layer] = (zero / n, below / n, n)
    none2 = (None, None)
    values: dict[str, list[Any]] = {
        "expert_ids": [by_moe.get(layer, none2)[0] for layer in layers.moe],
        "expert_weights": [by_moe.get(layer, none2)[1] for layer in layers.moe],
        "router_probs": [None] * len(layers.moe),
        "act_zero_ratio": [by_ffn[layer][0] if layer in by_ffn else None for layer in layers.ffn],
        "act_below_ratio": [by_ffn[layer][1] if layer in by_ffn else None for layer in layers.ffn],
        "act_values": [by_ffn[layer][2] if layer in by_ffn else 0 for layer in layers.ffn],
    }
    return values, np.flatnonzero(k_ids).tolist(), ffn_seen


class AggBlock(NamedTuple):
    """The per-layer values of a drain's aggregate records as arrays, one row per record, the
    routing's columns the model's MoE layers and the activations' its FFN layers: what the token
    and routes rows of a one-row step take without making them Python values. Copies, never
    views of the drained records (their memory is reused)."""

    expert_ids: np.ndarray  # int32 [records, MoE layers, k]
    expert_weights: np.ndarray  # float32 [records, MoE layers, k]
    act_zero_ratio: np.ndarray  # float64 [records, FFN layers]
    act_below_ratio: np.ndarray  # float64 [records, FFN layers]
    act_values: np.ndarray  # int64 [records, FFN layers]
    counted: np.ndarray  # bool [records]: its activations were counted (else the three above are null)
    # float32 [records, layers, k]: the router's probabilities of the chosen experts, where they
    # were captured (per-layer records: pass_arrays.pass_block); an aggregate record has none
    router_probs: np.ndarray | None = None


def block_row_values(block: AggBlock, row: int) -> dict[str, list[Any]]:
    """What agg_row_values gives for the record at `row` of `block`: made only when asked for
    (the token and routes rows of such a record read the block itself)."""
    n_moe, n_ffn = block.expert_ids.shape[1], block.act_zero_ratio.shape[1]
    counted = bool(block.counted[row])
    return {
        "expert_ids": block.expert_ids[row].tolist(),
        "expert_weights": block.expert_weights[row].tolist(),
        "router_probs": [None] * n_moe,
        "act_zero_ratio": block.act_zero_ratio[row].tolist() if counted else [None] * n_ffn,
        "act_below_ratio": block.act_below_ratio[row].tolist() if counted else [None] * n_ffn,
        "act_values": block.act_values[row].tolist(),  # 0 where not counted
    }


class AggRow(NamedTuple):
    """What the consumer needs of one aggregate record: the row's per-layer values (as
    agg_row_values makes them; None for a record whose values are all in the drain's AggBlock:
    every MoE layer routed with k experts, every FFN layer counted or none;
    block_row_values makes them from there), the MoE and FFN layers it saw, its attention
    columns; and for such a record, the block and its row.
    A named tuple: one is made per token, and a frozen dataclass costs several times more to make."""

    values: dict[str, list[Any]] | None
    moe_seen: list[int]
    ffn_seen: list[int]
    attn: AggAttn
    block: AggBlock | None = None
    block_row: int = -1


def agg_rows_batch(arr: np.ndarray, layers: LayerSet) -> list[AggRow] | None:
    """agg_row_values and the attention columns for every aggregate record of a drain at once:
    numpy over the [records, layers] arrays and one tolist per column, instead of ~15 numpy
    calls per record (the largest per-token cost of full mode's consumer). Rows whose layers are
    not all complete take agg_row_values; None when the model has layers beyond what the record
    holds (then the handler does it all, record by record)."""
    capacity = int(arr.dtype["k_ids"].shape[0])
    moe, moe_idx, ffn, ffn_idx = agg_layout(layers, capacity)
    if len(moe) != len(layers.moe) or len(ffn) != len(layers.ffn) or not len(arr):
        return None
    k_ids = arr["k_ids"]
    kid = k_ids[:, moe_idx]
    kwt = arr["k_wts"][:, moe_idx]
    k = int(kid.max(initial=0))
    ids_arr, wts_arr = arr["ids"][:, moe_idx, :k], arr["wts"][:, moe_idx, :k]  # copies (fancy indexing)
    # the common row: every MoE layer (and no other) with k ids and k weights, every FFN layer
    # (and no other) with all its rows counted; any other row takes agg_row_values
    moe_full = ((kid == k) & (kwt == k)).all(axis=1) & (k > 0 or not moe)
    moe_full &= (k_ids != 0).sum(axis=1) == len(moe)
    nr, rows, slots = arr["act_nr"], arr["act_rows"], arr["act_slots"]
    complete = (nr != 0) & (rows == nr) & (nr == np.maximum(slots, 1))
    ne0 = arr["act_ne0"]
    ffn_full = (complete[:, ffn_idx] & (ne0[:, ffn_idx] != 0)).all(axis=1) & (
        complete.sum(axis=1) == len(ffn)
    )
    # no FFN layer counted at all: a pass whose activations --act-every left out (agg_begin's
    # active = 2), the common row then too
    ffn_none = (nr == 0).all(axis=1)
    n_vals = nr[:, ffn_idx].astype(np.int64) * ne0[:, ffn_idx]
    # 0 where nothing was counted (those rows' ratios are null), not NaN: the block is kept
    counted_at = n_vals != 0
    zr_arr = np.divide(arr["act_zero"][:, ffn_idx], n_vals, out=np.zeros(n_vals.shape), where=counted_at)
    br_arr = np.divide(arr["act_below"][:, ffn_idx], n_vals, out=np.zeros(n_vals.shape), where=counted_at)
    # a model without MoE layers has no block: its rows' empty routing stays lists
    block = AggBlock(ids_arr, wts_arr, zr_arr, br_arr, n_vals, moe_full & ffn_full) if moe else None
    if block is None:  # the common rows' values as lists, made here
        ids_all, wts_all = ids_arr.tolist(), wts_arr.tolist()
        zr_all, br_all, nv_all = zr_arr.tolist(), br_arr.tolist(), n_vals.tolist()
    att_n = np.minimum(arr["att_n"], capacity).tolist()
    width = max(att_n, default=0)
    c_mask, c_layer, c_count, c_flags = (
        arr[f][:, :width].tolist() for f in ("att_mask", "att_layer", "att_count", "att_flags")
    )
    none_moe = [None] * len(layers.moe)
    none_ffn, zero_ffn = [None] * len(layers.ffn), [0] * len(layers.ffn)
    # nothing routed, nothing counted: a step the sparse probes did not see
    empty = (k_ids == 0).all(axis=1) & (arr["k_wts"] == 0).all(axis=1) & ffn_none
    nothing = _unseen_values(none_moe, none_ffn, zero_ffn)
    out: list[AggRow] = []
    rows_kind = zip(
        (moe_full & ffn_full).tolist(), (moe_full & ffn_none).tolist(), empty.tolist(), att_n, strict=True
    )
    for i, (full, no_act, unseen, n_att) in enumerate(rows_kind):
        at: AggBlock | None = None
        values: dict[str, list[Any]] | None
        if unseen and not no_act:  # (a model without MoE layers: its no_act rows are these)
            values, moe_seen, ffn_seen = nothing, [], []
        elif (full or no_act) and block is not None:
            at, values = block, None
            moe_seen, ffn_seen = moe, ffn if full else []
        elif full or no_act:
            moe_seen, ffn_seen = moe, ffn if full else []
            values = {
                "expert_ids": ids_all[i],
                "expert_weights": wts_all[i],
                "router_probs": none_moe,
                "act_zero_ratio": zr_all[i] if full else none_ffn,
                "act_below_ratio": br_all[i] if full else none_ffn,
                "act_values": nv_all[i] if full else zero_ffn,
            }
        else:
            values, moe_seen, ffn_seen = agg_row_values({f: arr[f][i] for f in _AGG_ROW_FIELDS}, layers)
        attn = (c_mask[i][:n_att], c_layer[i][:n_att], c_count[i][:n_att], c_flags[i][:n_att])
        out.append(AggRow(values, moe_seen, ffn_seen, attn, at, i))
    return out


def _unseen_values(none_moe: list[None], none_ffn: list[None], zero_ffn: list[int]) -> dict[str, list[Any]]:
    """agg_row_values' result for a record that routed and counted nothing: a step the sparse
    probes did not see (out between --duty-cycle windows, or gone from the engine's graph). One
    dict for all such rows of a drain: nothing changes a row's values once made."""
    return {
        "expert_ids": none_moe,
        "expert_weights": none_moe,
        "router_probs": none_moe,
        "act_zero_ratio": none_ffn,
        "act_below_ratio": none_ffn,
        "act_values": zero_ffn,
    }


_AGG_ROW_FIELDS = (
    "k_ids",
    "k_wts",
    "ids",
    "wts",
    "act_nr",
    "act_rows",
    "act_slots",
    "act_zero",
    "act_below",
    "act_ne0",
)
