"""The routes table (one row per batch row and FFN layer the engine computed, prompt rows
included: the long form of the token rows' sparse lists) and, with --capture-masks, the masks
table keyed the same way."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain, repeat
from typing import Any

import numpy as np

from sparseety_prof.capture.plans import LayerSet
from sparseety_prof.correlate.agg_record import AggBlock
from sparseety_prof.correlate.pass_arrays import PassArrays, pass_block
from sparseety_prof.correlate.slot_steps import shape_key, slot_runs
from sparseety_prof.correlate.state import HeadDropped, Step
from sparseety_prof.correlate.step_sparse import Problems, StepSparse
from sparseety_prof.correlate.tables import (
    MASK_ROW,
    ROUTE_KEYS,
    ROUTE_LAYER,
    ROUTE_ROW,
    ROUTE_VALUES,
    RowBuffer,
)
from sparseety_prof.store.array_rows import ArrayRows, RowParts
from sparseety_prof.store.schema import Columns

#: the routes table's layers, per layer its index in the per-row MoE and FFN value lists, and
#: whether every layer is both (the lists then line up with the table's layers)
RouteLayout = tuple[list[int], list[int | None], list[int | None], bool]
_IDS, _WEIGHTS, _PROBS, _ZERO, _BELOW, _VALUES = ROUTE_VALUES


class RoutesTables:
    def __init__(self, layers: LayerSet, problems: Problems, *, with_masks: bool, rows: bool = True) -> None:
        """`rows`: make the rows; without, only count them (rows_not_made), for a recording whose
        policy stores no routes row and no sink that reads them (--policy aggregate)."""
        if with_masks and not rows:
            raise ValueError("the masks table is keyed by the routes rows: they must be made")
        self.layers = layers
        self.problems = problems
        self.with_masks = with_masks
        self.make_rows = rows
        self.rows_not_made = 0  # rows counted but not made, since take_not_made
        # head sampling in the probes, with nothing but the recording reading routes rows: the
        # sequences whose request drew drop (None when every row is made). Their steps' rows are
        # counted instead of made (a run of steps over several slots only when every slot's
        # request drew drop): the policy would drop them.
        self.head_dropped: HeadDropped | None = None
        self.rows_head_dropped = 0  # such rows, since take_head_dropped
        self.rows_head_dropped_total = 0
        self._routes: Columns = {name: [] for name in ROUTE_ROW}
        self._layout: RouteLayout | None = None
        # rows of emit's common case not yet in _routes: (step_id, ctx_id, seq, pos, row, the
        # row's values)
        self._pending: list[tuple[int, int, int, int, int, dict[str, Any]]] = []
        # rows whose values are in an AggBlock (one-row steps): (step_id, ctx_id, seq, pos, row,
        # the block, the record's row in it); they stay arrays up to the frame (store/array_rows.py)
        self._blocks: list[tuple[int, int, int, int, int, AggBlock, int]] = []
        # steps over several slots waiting for the run they are part of to end (slot_steps.py)
        self._slot_steps: list[Step] = []
        # rows made arrays already (the blocks' rows before them, and multi-row passes'), in order
        self._arrays: list[ArrayRows] = []
        # the order rows came in, while any are block rows: (from a block, rows), per emission
        self._runs: list[tuple[bool, int]] = []
        self._masks = RowBuffer(MASK_ROW)

    def take_not_made(self) -> int:
        """The rows counted instead of made since the last call."""
        n, self.rows_not_made = self.rows_not_made, 0
        return n

    def take_head_dropped(self) -> int:
        """The rows of head-dropped requests counted instead of made since the last call."""
        n, self.rows_head_dropped = self.rows_head_dropped, 0
        return n

    def _count_head(self, rows: int) -> None:
        """Rows of head-dropped requests counted instead of made."""
        self.rows_head_dropped += rows
        self.rows_head_dropped_total += rows

    def take(self) -> tuple[Columns | RowParts, Columns]:
        """Routes and masks rows produced since the last call: columns, or RowParts when rows
        came from AggBlocks."""
        self._flush_slots()
        self._flush()
        routes: Columns | RowParts
        routes, self._routes = self._routes, {name: [] for name in ROUTE_ROW}
        runs, self._runs = self._runs, []
        self._arrays.extend(self._block_rows())
        if self._arrays:
            flags = np.fromiter((a for a, _ in runs), bool, len(runs))
            counts = np.fromiter((n for _, n in runs), np.int64, len(runs))
            routes = RowParts(routes, self._arrays, np.repeat(flags, counts))
            self._arrays = []
        return routes, self._masks.take()

    def _block_rows(self) -> list[ArrayRows]:
        """The block rows gathered so far as arrays, a part per run of rows of one block."""
        rows, self._blocks = self._blocks, []
        out: list[ArrayRows] = []
        start = 0
        for j in range(1, len(rows) + 1):
            if j == len(rows) or rows[j][5] is not rows[start][5]:
                out.append(self._block_part(rows[start:j]))
                start = j
        return out

    def _block_part(self, rows: list[tuple[int, int, int, int, int, AggBlock, int]]) -> ArrayRows:
        """Rows of one AggBlock: per row, one routes row per layer of the table, as emit's
        per-row path makes them: a layer's routing where it is an MoE layer, its activations
        where it is an FFN layer and they were counted (else null), and no row for a layer with
        neither (an FFN-only layer of a pass whose activations were not counted)."""
        all_layers, km_of, kf_of, identity = self.layout()
        n_rows, n_layers = len(rows), len(all_layers)
        blk = rows[0][5]
        at = np.fromiter((r[6] for r in rows), np.intp, n_rows)
        arrays = self._key_arrays(np.array([r[:5] for r in rows], dtype=np.int64).reshape(n_rows, -1))
        k = blk.expert_ids.shape[2]
        counted = blk.counted[at]
        ids, weights = blk.expert_ids[at], blk.expert_weights[at]
        zero, below, values = blk.act_zero_ratio[at], blk.act_below_ratio[at], blk.act_values[at]
        if identity:
            keep = None
            no_act = np.repeat(~counted, n_layers)
            no_moe = None
        else:  # the table's layers from the block's MoE and FFN columns
            km = np.array([-1 if j is None else j for j in km_of], dtype=np.intp)
            kf = np.array([-1 if j is None else j for j in kf_of], dtype=np.intp)
            ids, weights = ids[:, km.clip(0)], weights[:, km.clip(0)]
            zero, below, values = zero[:, kf.clip(0)], below[:, kf.clip(0)], values[:, kf.clip(0)]
            act = (kf >= 0)[None, :] & counted[:, None]  # [rows, layers]
            keep_2d = (km >= 0)[None, :] | act
            keep = keep_2d.reshape(-1)
            no_act = ~act.reshape(-1)[keep]
            no_moe = np.broadcast_to(km < 0, (n_rows, n_layers)).reshape(-1)[keep]
        arrays[_IDS] = ids.reshape(n_rows * n_layers, k)
        arrays[_WEIGHTS] = weights.reshape(n_rows * n_layers, k)
        arrays[_PROBS] = None  # not in an aggregate record
        arrays[_ZERO] = zero.reshape(-1)
        arrays[_BELOW] = below.reshape(-1)
        arrays[_VALUES] = values.reshape(-1)
        n = n_rows * n_layers
        if keep is not None:
            arrays = {name: None if a is None else a[keep] for name, a in arrays.items()}
            n = int(keep.sum())
        nulls = {}
        if no_act.any():
            nulls = {name: no_act for name in (_ZERO, _BELOW, _VALUES)}
        if no_moe is not None and no_moe.any():
            nulls.update({_IDS: no_moe, _WEIGHTS: no_moe})
        return ArrayRows(n, arrays, nulls)

    def _block_layers(self, block: tuple[AggBlock, int]) -> int:
        """The routes rows of a block row (_block_part): every layer's, but those of the FFN-only
        layers when its activations were not counted."""
        all_layers, km_of, _, identity = self.layout()
        if identity or block[0].counted[block[1]]:
            return len(all_layers)
        return sum(k is not None for k in km_of)

    def layout(self) -> RouteLayout:
        """Fixed for a recording: computed once."""
        if self._layout is None:
            layers = self.layers
            moe_pos = {layer: k for k, layer in enumerate(layers.moe)}
            ffn_pos = {layer: k for k, layer in enumerate(layers.ffn)}
            all_layers = sorted(set(layers.moe) | set(layers.ffn))
            km_of = [moe_pos.get(layer) for layer in all_layers]
            kf_of = [ffn_pos.get(layer) for layer in all_layers]
            identity = km_of == kf_of == list(range(len(all_layers)))
            self._layout = (all_layers, km_of, kf_of, identity)
        return self._layout

    def _flush(self) -> None:
        """The rows gathered so far by emit (every layer is MoE and FFN, all computed for the
        row: the common case), one extend per column for all of them."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        all_layers = self.layout()[0]
        n_layers = len(all_layers)
        cols = self._routes
        for k, name in enumerate(ROUTE_KEYS):
            cols[name].extend(chain.from_iterable(repeat(p[k], n_layers) for p in pending))
        cols[ROUTE_LAYER].extend(all_layers * len(pending))
        for name in ROUTE_VALUES:
            cols[name].extend(chain.from_iterable(p[5][name] for p in pending))

    def emit(self, step: Step) -> None:
        """The rows of a finished step. A step over several slots waits for the steps after it
        (slot_steps.py: their rows made arrays a run at a time, when the run ends); any other
        step's rows are made now, after those of the steps waiting."""
        if self.layout()[3] and not self.with_masks and step.over_slots():
            self._slot_steps.append(step)
            return
        self._flush_slots()
        if self.head_dropped and self.head_dropped.holds_all(step):
            self._count_head_dropped(step)
            return
        self._emit_now(step)

    def _count_head_dropped(self, step: Step) -> None:
        """A step of dropped requests only (a prompt; a one-row step whose values came per layer;
        a step over several slots the arrays cannot take): its rows counted as the policy
        without routes rows counts them (the same paths, exactly as many), as head's."""
        made, self.make_rows, before = self.make_rows, False, self.rows_not_made
        try:
            self._emit_now(step)
        finally:
            self.make_rows = made
        n, self.rows_not_made = self.rows_not_made - before, before
        self._count_head(n)

    def _flush_slots(self) -> None:
        """The rows of the steps over several slots waiting: each run of steps of one shape made
        arrays at once; a step the arrays cannot take, by the per-row path."""
        steps, self._slot_steps = self._slot_steps, []
        keys = [shape_key(s.sparse, len(s.seq), self.layers) for s in steps]  # type: ignore[arg-type]
        i = 0
        while i < len(steps):
            key = keys[i]
            j = i + 1
            while key is not None and j < len(steps) and keys[j] == key:
                j += 1
            # a run all of whose steps' requests drew drop (head sampling in the probes): its
            # token rows still read the arrays, its routes rows are counted (a run that mixes
            # makes them all, and the policy drops the dropped requests')
            dropped = self.head_dropped
            drops = dropped is not None and all(dropped.holds_all(s) for s in steps[i:j])
            rows = self.make_rows and not drops
            spans = slot_runs(steps[i:j], key, self.layers, rows=rows) if key is not None else []
            for a, b, run in spans or [(0, j - i, None)]:
                if run is None:
                    for s in steps[i + a : i + b]:
                        if drops:
                            self._count_head_dropped(s)
                        else:
                            self._emit_now(s)
                    continue
                for s, blk in zip(steps[i + a : i + b], run.blocks, strict=True):
                    s.sparse._slot_block = blk  # type: ignore[union-attr]
                if run.routes is None:
                    n = (b - a) * len(steps[i + a].seq) * len(self.layers.moe)
                    if drops:
                        self._count_head(n)
                    else:
                        self.rows_not_made += n
                else:
                    self._arrays.extend(self._block_rows())  # (the rows before them first)
                    self._arrays.append(run.routes)
                    self._runs.append((True, run.routes.n))
            i = j

    def one_row_block(
        self, step_id: int, ctx_id: int, seq: int, pos: int, block: tuple[AggBlock, int]
    ) -> None:
        """emit's effect for a one-row step whose values are all in `block` (its aggregate
        record's row), from the step's values (fast_step, before its Step is made)."""
        if self._slot_steps:
            self._flush_slots()
        self.add_block(step_id, ctx_id, seq, pos, 0, block)

    def one_row_blocks(
        self,
        step_ids: list[int],
        ctx_id: int,
        seq: int,
        positions: list[int],
        block: AggBlock,
        rows: list[int],
    ) -> None:
        """one_row_block for a run of one-row steps of one sequence whose values are all in
        `block`, at `rows` (plain_run.py)."""
        if self._slot_steps:
            self._flush_slots()
        n = len(step_ids)
        if self.head_dropped and self.head_dropped.holds(ctx_id, seq):
            self._count_head(sum(self._block_layers((block, r)) for r in rows))
            return
        if not self.make_rows:
            self.rows_not_made += sum(self._block_layers((block, r)) for r in rows)
            return
        self._blocks.extend(
            zip(step_ids, [ctx_id] * n, [seq] * n, positions, [0] * n, [block] * n, rows, strict=True)
        )
        self._runs.extend([(True, self._block_layers((block, r))) for r in rows])

    def add_block(
        self, step_id: int, ctx_id: int, seq: int, pos: int, row_offset: int, block: tuple[AggBlock, int]
    ) -> None:
        """A one-row step's rows, kept in the block (every MoE layer has its k ids there: the
        rows are the common case's, with no per-row values made)."""
        if self.head_dropped and self.head_dropped.holds(ctx_id, seq):
            self._count_head(self._block_layers(block))
            return
        if not self.make_rows:  # as many rows as the per-row path would make
            self.rows_not_made += self._block_layers(block)
            return
        self._blocks.append((step_id, ctx_id, seq, pos, row_offset, *block))
        self._runs.append((True, self._block_layers(block)))

    def _emit_now(self, step: Step) -> None:
        """The rows of a finished step, from the same per-row values the token rows use
        (computed once per row). Whole columns are extended at once per row: per-value appends
        were the largest consumer cost of full mode. Rows of the common case are gathered and
        extended once per drain (_flush)."""
        sp = step.sparse
        assert sp is not None
        # a one-row step whose values came whole from its aggregate record: kept in the block
        # (every MoE layer has its k ids there: the rows are the common case's, with no per-row
        # values made)
        one = step.n_tokens == 1 and bool(self.layers.moe) and not self.with_masks
        block = sp.agg_block_row() if one else None
        if block is not None:
            self.add_block(
                step.step_id, step.ctx_id, int(step.seq[0]), int(step.pos[0]), step.row_offset, block
            )
            return
        # a prompt: when it is regular, its rows as arrays, and its token rows take their lists
        # from the same arrays (pass_arrays.pass_block): no per-row values
        identity = self.layout()[3]
        got = (
            pass_block(step, self.layers) if len(step.seq) > 1 and identity and not self.with_masks else None
        )
        if got is None:
            self._emit_rows(step, sp)
        elif not self.make_rows:
            self.rows_not_made += int(got.arrays.present.sum())
        else:
            self._arrays.extend(self._block_rows())  # (the rows before it first)
            rows = slice(step.row_offset, step.row_offset + len(step.seq))
            part = self._pass_part(step, rows, got.arrays)
            self._arrays.append(part)
            self._runs.append((True, part.n))

    def _emit_rows(self, step: Step, sp: StepSparse) -> None:
        """The rows of a step that are neither in an aggregate block nor a regular prompt's
        arrays: from each batch row's values, a row per layer computed for it."""
        out_index = step.output_index()
        all_layers, km_of, kf_of, identity = self.layout()
        n_layers = len(all_layers)
        cols = self._routes
        if len(step.seq) > 1:  # a prompt's rows: their values made at once
            sp.fill_rows(
                list(range(step.row_offset, step.row_offset + len(step.seq))),
                out_index,
                step.n_tokens,
                self.layers,
                self.problems,
            )
        for i, (seq, pos) in enumerate(zip(step.seq.tolist(), step.pos.tolist(), strict=True)):
            b = step.row_offset + i
            v = sp.row_values(b, out_index, step.n_tokens, self.layers, self.problems)
            values: dict[str, Sequence[object]]
            if identity and None not in v["expert_ids"]:
                # every layer is MoE and FFN and its routing was read: the lists as they are, a
                # row per layer; a layer whose activations were not counted (--act-every, or
                # not captured) has no activation values, as below
                zr_v = v["act_zero_ratio"]
                if None in zr_v:
                    nv_v = [n if z is not None else None for n, z in zip(v["act_values"], zr_v, strict=True)]
                    v = {**v, "act_values": nv_v}
                if not self.make_rows:
                    self.rows_not_made += n_layers
                    continue
                if not self.with_masks:  # (mask rows follow each routes row: no gathering then)
                    self._pending.append((step.step_id, step.ctx_id, seq, pos, b, v))
                    self._runs.append((False, n_layers))
                    continue
                keep: Sequence[int] = range(n_layers)
                values = {"layer": all_layers, **{name: v[name] for name in ROUTE_VALUES}}
            else:
                keep, values = _mapped_values(v, all_layers, km_of, kf_of)
                if not self.make_rows:
                    self.rows_not_made += len(keep)
                    continue
                if not keep:
                    continue
            self._flush()  # rows keep the order of their steps
            n = len(keep)
            for name, value in zip(ROUTE_KEYS, (step.step_id, step.ctx_id, seq, pos, b), strict=True):
                cols[name].extend([value] * n)
            for name, vals in values.items():
                cols[name].extend(vals)
            self._runs.append((False, n))
            if self.with_masks:
                self._emit_masks(step, sp, seq, pos, b, keep, out_index)

    def _key_arrays(self, keys: np.ndarray) -> dict[str, np.ndarray | None]:
        """The key columns and the layer of the routes rows of batch rows whose keys are `keys`
        ([rows x ROUTE_KEYS]): per batch row, a row per layer of the table."""
        all_layers = self.layout()[0]
        arrays: dict[str, np.ndarray | None] = {
            name: np.repeat(keys[:, j], len(all_layers)) for j, name in enumerate(ROUTE_KEYS)
        }
        arrays[ROUTE_LAYER] = np.tile(np.asarray(all_layers, dtype=np.int64), len(keys))
        return arrays

    def _pass_part(self, step: Step, rows: slice, got: PassArrays) -> ArrayRows:
        """The routes rows of a regular prompt pass (pass_arrays.route_arrays): per batch row, a
        row per layer the engine computed for it, in the order of the per-row path."""
        n_rows = len(step.seq)
        n = n_rows * len(self.layout()[0])
        keep = got.present.reshape(n)
        keys = np.empty((n_rows, len(ROUTE_KEYS)), dtype=np.int64)  # in ROUTE_KEYS order
        keys[:, 0], keys[:, 1] = step.step_id, step.ctx_id
        keys[:, 2], keys[:, 3], keys[:, 4] = step.seq, step.pos, np.arange(rows.start, rows.stop)
        arrays = self._key_arrays(keys)
        for name in ROUTE_VALUES:
            v = got.values[name]
            arrays[name] = None if v is None else v.reshape(n, *v.shape[2:])
        if not keep.all():
            arrays = {name: None if a is None else a[keep] for name, a in arrays.items()}
        return ArrayRows(int(keep.sum()), arrays)

    def _emit_masks(
        self,
        step: Step,
        sp: StepSparse,
        seq: int,
        pos: int,
        b: int,
        keep: Iterable[int],
        out_index: dict[int, int],
    ) -> None:
        """Rows of the masks table for batch row b, for the routes layers at indices `keep`."""
        all_layers = self.layout()[0]
        for j in keep:
            layer = all_layers[j]
            bits = sp.act_mask_bits(layer, b, out_index, step.n_tokens)
            if bits is not None:
                self._masks.add(
                    step_id=step.step_id,
                    ctx_id=step.ctx_id,
                    seq_id=seq,
                    pos=pos,
                    row=b,
                    layer=layer,
                    n_values=len(bits),
                    nonzero_bits=np.packbits(bits).tobytes(),
                )


def _mapped_values(
    v: dict[str, Any],
    all_layers: list[int],
    km_of: list[int | None],
    kf_of: list[int | None],
) -> tuple[list[int], dict[str, Sequence[object]]]:
    """A batch row's routes rows when the table's layers are not each MoE and FFN (or a routing
    was not read): each layer's values taken from its MoE (km_of) and FFN (kf_of) lists, and the
    layers that get a row: a layer not computed for this row (or not captured) gets none, none
    is invented."""
    ids_v, zr_v, nv_v = v["expert_ids"], v["act_zero_ratio"], v["act_values"]
    ids = [ids_v[k] if k is not None else None for k in km_of]
    zr = [zr_v[k] if k is not None else None for k in kf_of]
    keep = [j for j in range(len(all_layers)) if ids[j] is not None or zr[j] is not None]
    w_v, p_v, br_v = v["expert_weights"], v["router_probs"], v["act_below_ratio"]
    values: dict[str, Sequence[object]] = {
        "layer": list(all_layers),
        "expert_ids": ids,
        "expert_weights": [w_v[k] if k is not None else None for k in km_of],
        "router_probs": [p_v[k] if k is not None else None for k in km_of],
        "act_zero_ratio": zr,
        "act_below_ratio": [br_v[k] if k is not None else None for k in kf_of],
        "act_values": [nv_v[k] if zr[j] is not None else None for j, k in enumerate(kf_of)],
    }
    if len(keep) < len(all_layers):
        values = {k: [vals[j] for j in keep] for k, vals in values.items()}
    return keep, values
