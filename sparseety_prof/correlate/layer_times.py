"""Layer times: how long each layer of a step took on each engine thread, from the aggregate
records' timed probe points (agg_layer_time in probes/sparse_common.bpf.c: the sparse
probes' own hits, no probe of their own).

An aggregate record holds, per graph thread index and model layer, when the thread first reached
the layer's probe point, in ns after the step began (t0_ns: its micro-batch record's timestamp,
the step's t_start_ns). Here they become layer_times rows once their step is taken (the steps
table's rows: a step is joined on its thread and start, which are the record's thread and t0),
for a whole take at once with numpy, and each step's slowest (layer, thread) for its token rows.

A thread's probe points, in time order, split its step: the head (step start to the first
point), one interval per later point (from the point before: dur_ns), the tail (the last point
to the step's end). Their sum is the step's duration exactly; head and tail are the probes' own
gaps (schema.LAYER_TIMES)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sparseety_prof.store import schema
from sparseety_prof.store.array_rows import ArrayRows, RowParts

LAYER_TIME_ROW = schema.columns(
    "layer_times", "step_id", "ctx_id", "layer", "thread", "tid", "t_ns", "dur_ns", "lag_ns"
)
schema.check_columns("layer_times", LAYER_TIME_ROW)
#: a step's slowest layer: (layer, its duration in ms, the OS thread id)
Slowest = tuple[int, float, int]
NO_SLOWEST: tuple[None, None, None] = (None, None, None)

_FAR = np.iinfo(np.int64).max  # a probe point not reached sorts after every reached one

#: A drain's timed aggregate records: offsets [records, threads, layers], OS thread ids
#: [records, threads], t0_ns [records]
_Drain = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass
class LayerClock:
    """The timed aggregate records waiting for their steps, and the slowest layer of the steps
    taken lately (for their tokens, which may be taken a take later than their step). A
    dataclass: the correlator's tests compare its state field by field."""

    _drains: list[_Drain] = field(default_factory=list)
    # (thread that ran the step, t0_ns) -> (drain, record) of records since the last take
    _pending: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    # those of the take before (a step whose end came after that take), then dropped
    _carried: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    _carried_drains: list[_Drain] = field(default_factory=list)
    lost_points: int = 0  # probe points the probes could not time (lt_lost)
    unjoined: int = 0  # timed records whose step never reached the steps table
    _slowest: dict[int, Slowest] = field(default_factory=dict)
    _slowest_before: dict[int, Slowest] = field(default_factory=dict)

    def add_drain(self, arr: np.ndarray) -> None:
        """A drain's aggregate records (every one: those with another pass running meanwhile
        are not attributable, as for their routing, and those with no point timed hold none)."""
        if not len(arr):
            return
        self.lost_points += int(arr["lt_lost"].sum())
        off = arr["lt_off"]
        keep = np.flatnonzero((arr["overlap"] == 0) & off.reshape(len(arr), -1).any(axis=1))
        if not len(keep):
            return
        at = len(self._drains)
        self._drains.append((off[keep], arr["lt_tid"][keep], arr["t0_ns"][keep]))
        keys = zip(arr["tid"][keep].tolist(), arr["t0_ns"][keep].tolist(), strict=True)
        self._pending.update(zip(keys, ((at, i) for i in range(len(keep))), strict=True))

    def take(self, steps: Mapping[str, Sequence[Any]]) -> schema.Columns | RowParts:
        """The layer_times rows of `steps` (a take of the steps table's columns) whose records
        came, and their slowest layers kept for slowest_of(). Records not joined by the next take
        are dropped (counted in `unjoined`): their step went elsewhere (a head-dropped request's)."""
        self._slowest_before, self._slowest = self._slowest, {}
        drains = [*self._carried_drains, *self._drains]
        base = len(self._carried_drains)
        found: list[tuple[int, int, int]] = []  # (row in steps, drain, record)
        if self._pending or self._carried:
            pending, carried = self._pending, self._carried
            keys = zip(steps["tid"], steps["t_start_ns"], strict=True)
            for j, key in enumerate(keys):
                hit = pending.pop(key, None)
                if hit is not None:
                    found.append((j, base + hit[0], hit[1]))
                    continue
                old = carried.pop(key, None)
                if old is not None:
                    found.append((j, *old))
        self.unjoined += len(self._carried)
        self._carried = {k: (base + d, i) for k, (d, i) in self._pending.items()}
        self._carried_drains = drains if self._carried else []
        self._pending, self._drains = {}, []
        if not found:
            return empty_columns()
        return self._rows(steps, found, drains)

    def slowest_of(self, step_ids: list[int]) -> list[Slowest | tuple[None, None, None]]:
        """The slowest layer of each step of `step_ids` taken by the last two takes
        (NO_SLOWEST for one without layer times)."""
        now, before = self._slowest.get, self._slowest_before.get
        return [now(s) or before(s) or NO_SLOWEST for s in step_ids]

    def _rows(
        self, steps: Mapping[str, Sequence[Any]], found: list[tuple[int, int, int]], drains: list[_Drain]
    ) -> schema.Columns | RowParts:
        at = np.array(found, dtype=np.intp).reshape(-1, 3)
        at_step, of_drain, at_record = at[:, 0], at[:, 1], at[:, 2]
        # each drain's records taken at once (a take holds the records of a drain or two)
        first = drains[int(of_drain[0])]
        off = np.empty((len(at), *first[0].shape[1:]), dtype=np.int64)  # [S, T, L]
        tids = np.empty((len(at), *first[1].shape[1:]), dtype=np.int64)  # [S, T]
        t0 = np.empty(len(at), dtype=np.int64)
        for d in np.unique(of_drain).tolist():
            rows = of_drain == d
            recs = at_record[rows]
            off[rows], tids[rows], t0[rows] = (a[recs] for a in drains[d])
        step_id = np.asarray(steps["step_id"], dtype=np.int64)[at_step]
        ctx_id = np.asarray(steps["ctx_id"], dtype=np.int64)[at_step]
        # the thread slots and layers some step reached: the record has slots for every CPU and
        # the next power of two of layers, most of them empty
        reached = off != 0
        threads = np.flatnonzero(reached.any(axis=(0, 2)))
        layers = np.flatnonzero(reached.any(axis=(0, 1)))
        if not len(layers):
            return empty_columns()  # (add_drain keeps records with a point: not expected)
        off, tids = off[:, threads][:, :, layers], tids[:, threads]
        dur, first_point, lag = split_points(off)
        reached = off != 0
        n = int(np.count_nonzero(reached))
        shape = off.shape

        def each(per: np.ndarray) -> np.ndarray:
            """A value per (step, thread, layer) reached, in C order (as np.nonzero lists them)."""
            return np.broadcast_to(per, shape)[reached]

        arrays = {
            "step_id": each(step_id[:, None, None]),
            "ctx_id": each(ctx_id[:, None, None]),
            "layer": each(layers.astype(np.int64)),
            "thread": each(threads.astype(np.int64)[:, None]),
            "tid": each(tids[:, :, None]),
            "t_ns": (off + t0[:, None, None])[reached],
            "dur_ns": dur[reached],
            "lag_ns": lag[reached],
        }
        # each step's slowest (layer, thread): the largest interval, a head gap not counted
        timed = np.where(reached & ~first_point, dur, -1).reshape(len(at), -1)
        best = timed.argmax(axis=1)
        width = off.shape[2]
        longest = timed[np.arange(len(at)), best]
        has = longest >= 0
        b_thread, b_layer = best[has] // width, best[has] % width
        slowest = zip(
            layers[b_layer].tolist(),
            (longest[has] / 1e6).tolist(),
            tids[np.flatnonzero(has), b_thread].tolist(),
            strict=True,
        )
        self._slowest.update(zip(step_id[has].tolist(), slowest, strict=True))
        rows = ArrayRows(n, {name: arrays[name] for name in LAYER_TIME_ROW}, {"dur_ns": first_point[reached]})
        return RowParts({name: [] for name in LAYER_TIME_ROW}, [rows], np.ones(n, dtype=bool))


def split_points(off: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For probe-point offsets [steps, threads, layers] (0: not reached): each point's time since
    the thread's previous point in time order, whether it is the thread's first (its dur is then
    the head gap, from the step's start), and how long after the first thread at that layer the
    thread reached it. Values where a point was not reached are meaningless."""
    reached = off != 0
    key = np.where(reached, off, _FAR)
    first_in_time = np.zeros(off.shape, dtype=bool)
    first_in_time[:, :, 0] = True
    lag = off - key.min(axis=1, keepdims=True)
    if bool((key[:, :, 1:] >= key[:, :, :-1]).all()):
        # every thread reached the layers in layer order (as a forward pass goes): no sort
        prev = np.concatenate([np.zeros_like(key[:, :, :1]), key[:, :, :-1]], axis=2)
        return key - prev, first_in_time, lag
    order = np.argsort(key, axis=2, kind="stable")
    in_time = np.take_along_axis(key, order, axis=2)
    prev = np.concatenate([np.zeros_like(in_time[:, :, :1]), in_time[:, :, :-1]], axis=2)
    dur = np.empty_like(off)
    np.put_along_axis(dur, order, in_time - prev, axis=2)
    first = np.empty(off.shape, dtype=bool)
    np.put_along_axis(first, order, first_in_time, axis=2)
    return dur, first, lag


def empty_columns() -> schema.Columns:
    return {name: [] for name in LAYER_TIME_ROW}
