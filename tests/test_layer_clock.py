"""The layer_times rows made from aggregate records' timed probe points (correlate/layer_times.py),
against values worked out by hand: the join to steps on (thread, start), each thread's intervals
in time order, the head gap, the lag, the slowest layer, and what cannot be joined or timed."""

from __future__ import annotations

import numpy as np
import polars as pl

from sparseety_prof.capture import events as ev
from sparseety_prof.capture.plans import LayerSet
from sparseety_prof.correlate.correlator import Correlator
from sparseety_prof.correlate.layer_times import NO_SLOWEST, LayerClock, split_points
from sparseety_prof.store import schema

LAYERS, THREADS = 8, 4
DT = ev.STEP_AGG_LAYOUTS[LAYERS, THREADS]


def _agg(tid: int, t0: int, off: dict[tuple[int, int], int], tids: dict[int, int], **kw: int) -> np.ndarray:
    a = np.zeros(1, DT)
    a["tid"], a["t0_ns"] = tid, t0
    for (thread, layer), v in off.items():
        a["lt_off"][0, thread, layer] = v
    for thread, os_tid in tids.items():
        a["lt_tid"][0, thread] = os_tid
    for k, v in kw.items():
        a[k] = v
    return a


def _steps(*rows: tuple[int, int, int, int]) -> dict[str, list[object]]:
    """(step_id, tid, t_start_ns, t_end_ns) -> the steps columns the clock reads."""
    return {
        "step_id": [r[0] for r in rows],
        "ctx_id": [0] * len(rows),
        "tid": [r[1] for r in rows],
        "t_start_ns": [r[2] for r in rows],
        "t_end_ns": [r[3] for r in rows],
    }


def _frame(cols: object) -> pl.DataFrame:
    return schema.frame("layer_times", dict(cols))  # type: ignore[call-overload]


def test_rows_intervals_lag_and_slowest_of_a_step() -> None:
    clock = LayerClock()
    # thread 0 (tid 100) reaches layers 1, 2, 3 at +10, +30, +90; thread 1 (tid 101) at +12, +31, +95
    off = {(0, 1): 10, (0, 2): 30, (0, 3): 90, (1, 1): 12, (1, 2): 31, (1, 3): 95}
    clock.add_drain(_agg(100, 1_000, off, {0: 100, 1: 101}))
    df = _frame(clock.take(_steps((7, 100, 1_000, 1_200)))).sort(["thread", "layer"])
    assert df["step_id"].to_list() == [7] * 6
    assert df["thread"].to_list() == [0, 0, 0, 1, 1, 1]
    assert df["layer"].to_list() == [1, 2, 3] * 2
    assert df["tid"].to_list() == [100] * 3 + [101] * 3
    assert df["t_ns"].to_list() == [1_010, 1_030, 1_090, 1_012, 1_031, 1_095]
    # the first point of each thread ends the head gap: no interval of its own
    assert df["dur_ns"].to_list() == [None, 20, 60, None, 19, 64]
    assert df["lag_ns"].to_list() == [0, 0, 0, 2, 1, 5]
    # the identity per thread: intervals + head + tail == the step
    for thread in (0, 1):
        times = df.filter(pl.col("thread") == thread)["t_ns"].to_list()
        durs = df.filter(pl.col("thread") == thread)["dur_ns"].drop_nulls().to_list()
        head, tail = min(times) - 1_000, 1_200 - max(times)
        assert sum(durs) + head + tail == 200
    assert clock.slowest_of([7, 8]) == [(3, 64 / 1e6, 101), NO_SLOWEST]


def test_points_out_of_layer_order_are_split_in_time_order() -> None:
    clock = LayerClock()
    clock.add_drain(_agg(5, 0, {(0, 0): 50, (0, 1): 20, (0, 2): 80}, {0: 5}))
    df = _frame(clock.take(_steps((1, 5, 0, 100)))).sort("layer")
    assert df["dur_ns"].to_list() == [30, None, 30]


def _split_by_definition(
    off: np.ndarray,
) -> tuple[dict[tuple[int, int, int], int], set[tuple[int, int, int]], dict[tuple[int, int, int], int]]:
    """split_points' values at the reached points, worked out point by point from its docstring."""
    dur, first, lag = {}, set(), {}
    steps, threads, layers = off.shape
    for s in range(steps):
        for t in range(threads):
            points = sorted((int(off[s, t, lay]), lay) for lay in range(layers) if off[s, t, lay])
            prev = 0
            for k, (v, lay) in enumerate(points):
                dur[s, t, lay] = v - prev
                if k == 0:
                    first.add((s, t, lay))
                prev = v
            for v, lay in points:
                lag[s, t, lay] = v - min(int(off[s, u, lay]) for u in range(threads) if off[s, u, lay])
    return dur, first, lag


def test_split_points_equals_its_definition_in_and_out_of_layer_order() -> None:
    """Random offsets, some points not reached: rows in layer order (the sort skipped) and rows
    out of it (sorted), each point against its definition."""
    rng = np.random.default_rng(7)
    for ordered in (True, False, None):
        off = rng.integers(1, 1_000, size=(20, 3, 6)).astype(np.int64)
        if ordered:
            off = np.sort(off, axis=2)
            off[:, 2, 4:] = 0  # a thread that stopped early: unreached points last
        elif ordered is None:
            off[rng.random(off.shape) < 0.3] = 0  # gaps anywhere
        dur, first, lag = split_points(off)
        want_dur, want_first, want_lag = _split_by_definition(off)
        for point, v in want_dur.items():
            assert dur[point] == v, (ordered, point)
            assert bool(first[point]) == (point in want_first), (ordered, point)
            assert lag[point] == want_lag[point], (ordered, point)


def test_a_take_over_two_drains_with_unused_slots_and_layers() -> None:
    """Steps whose records came in two drains, on thread slots 0 and 2 only and layers 1 and 5
    only: rows name the record's slot and layer, not their place among those used."""
    clock = LayerClock()
    clock.add_drain(_agg(5, 0, {(0, 1): 10, (2, 1): 12, (0, 5): 40, (2, 5): 41}, {0: 5, 2: 9}))
    clock.add_drain(_agg(5, 100, {(0, 1): 110, (0, 5): 190}, {0: 5}))
    df = _frame(clock.take(_steps((1, 5, 0, 50), (2, 5, 100, 200)))).sort(["step_id", "thread", "layer"])
    assert df["step_id"].to_list() == [1, 1, 1, 1, 2, 2]
    assert df["thread"].to_list() == [0, 0, 2, 2, 0, 0]
    assert df["layer"].to_list() == [1, 5, 1, 5, 1, 5]
    assert df["tid"].to_list() == [5, 5, 9, 9, 5, 5]
    assert df["dur_ns"].to_list() == [None, 30, None, 29, None, 80]
    assert df["lag_ns"].to_list() == [0, 0, 2, 1, 0, 0]
    assert clock.slowest_of([1, 2]) == [(5, 30 / 1e6, 5), (5, 80 / 1e6, 5)]


def test_a_step_taken_a_take_later_still_joins_then_records_are_dropped_and_counted() -> None:
    clock = LayerClock()
    clock.add_drain(_agg(5, 0, {(0, 0): 10, (0, 1): 20}, {0: 5}))
    clock.add_drain(_agg(5, 500, {(0, 0): 510, (0, 1): 520}, {0: 5}))
    # the first step ends in this take, the second in the next one; a third never comes
    assert _frame(clock.take(_steps((1, 5, 0, 100))))["step_id"].to_list() == [1, 1]
    clock.add_drain(_agg(6, 900, {(0, 0): 10}, {0: 6}))
    assert _frame(clock.take(_steps((2, 5, 500, 600))))["step_id"].to_list() == [2, 2]
    assert clock.unjoined == 0
    # the token of step 1 taken a take after its step still finds its slowest layer
    assert clock.slowest_of([1, 2]) == [(1, 10 / 1e6, 5), (1, 10 / 1e6, 5)]
    assert _frame(clock.take(_steps()))["step_id"].to_list() == []
    assert _frame(clock.take(_steps((3, 6, 900, 1_000))))["step_id"].to_list() == []
    assert clock.unjoined == 1


def test_overlapping_passes_hold_no_times_and_lost_points_are_counted() -> None:
    clock = LayerClock()
    clock.add_drain(_agg(5, 0, {(0, 0): 10}, {0: 5}, overlap=1, lt_lost=3))
    clock.add_drain(_agg(5, 200, {}, {}, lt_lost=2))  # nothing timed
    assert _frame(clock.take(_steps((1, 5, 0, 100), (2, 5, 200, 300)))).height == 0
    assert clock.lost_points == 5


def test_empty_take_has_every_column() -> None:
    cols = LayerClock().take(_steps())
    assert list(cols) == list(schema.LAYER_TIMES)
    assert _frame(cols).height == 0


class _Records:
    """One engine thread's records, with increasing sequence numbers and times."""

    def __init__(self) -> None:
        self.recs: list[bytes] = []
        self.seq, self.t = 0, 1_000_000

    def put(self, a: np.ndarray, kind: int) -> int:
        a["seq"], a["ts_ns"], a["ctx"], a["tid"], a["kind"] = self.seq, self.t, 7, 100, kind
        self.seq += 1
        self.t += 100_000
        self.recs.append(a.tobytes())
        return int(a["ts_ns"][0])

    def small(self, kind: int, a: int = 0, b: int = 0, c: int = 0) -> None:
        r = np.zeros(1, ev.SMALL_DTYPE)
        r["a"], r["b"], r["c"] = a, b, c
        self.put(r, kind)

    def step(self, tokens: list[int], active: int, sampled: int) -> None:
        """A micro-batch, its aggregate record (`active`: 1 or AGG_TIMES_ONLY, the routing
        fields then stale values the correlator must not read), its end and a sampler call."""
        self.small(ev.EV_DECODE_BEGIN, -1, -1, -1)
        u = np.zeros(1, ev.UBATCH_DTYPE)
        n = len(tokens)
        u["n_tokens"] = u["n_copied"] = n
        u["token"][0, :n], u["pos"][0, :n] = tokens, range(self.pos, self.pos + n)
        u["output"][0, n - 1] = 1
        t0 = self.put(u, ev.EV_UBATCH)
        a = np.zeros(1, ev.STEP_AGG_DTYPE)
        a["active"], a["t0_ns"] = active, t0
        a["k_ids"][0, :2] = a["k_wts"][0, :2] = 2  # (stale in a times-only record)
        a["ids"][0, 0, :2], a["ids"][0, 1, :2] = [1, 2], [3, 4]
        a["lt_tid"][0, :2] = [100, 101]
        a["lt_off"][0, :2, :2] = [[20_000, 50_000], [21_000, 52_000]]
        self.put(a, ev.EV_STEP_AGG)
        self.small(ev.EV_UBATCH_END)
        self.small(ev.EV_SAMPLE_BEGIN, -1, ev.SAMPLER_LLAMA)
        self.small(ev.EV_SAMPLE_END, sampled, ev.SAMPLER_LLAMA, -1)
        self.pos += n

    pos = 0


def test_a_prompts_times_only_record_gives_layer_times_and_no_routing() -> None:
    r = _Records()
    r.step([1, 2, 3], ev.AGG_TIMES_ONLY, sampled=9)  # a prompt: its aggregate holds times alone
    r.step([9], 1, sampled=4)
    c = Correlator(pid=1, n_vocab=64, wall_offset_ns=0, layers=LayerSet(moe=(0, 1), ffn=(0, 1)), n_expert=8)
    c.feed(ev.decode_records(r.recs, 1024))
    tables = c.take_tables()
    lt = _frame(tables["layer_times"])
    steps = tables["steps"]
    assert sorted(set(lt["step_id"].to_list())) == steps["step_id"] and len(steps["step_id"]) == 2
    assert lt.height == 2 * 2 * 2  # steps x threads x layers
    tok = tables["tokens"]
    assert tok["batch_size"] == [3, 1]
    # the prompt's token: no routing from the times-only record's stale fields; the decode step's
    # token: its aggregate's routing
    assert tok["expert_ids"] == [None, [[1, 2], [3, 4]]]
    # both tokens' slowest layer: layer 1 on thread 1 (52 - 21 > 50 - 20 us)
    assert tok["slowest_layer"] == [1, 1] and tok["slowest_tid"] == [101, 101]
    assert tok["slowest_layer_ms"] == [0.031, 0.031]
