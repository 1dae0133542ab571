"""The kernel correlator on synthetic CUPTI records: no GPU, every join rule pinned to exact values."""

from __future__ import annotations

import random
import struct
from dataclasses import replace
from typing import Any

import polars as pl
import pytest

from sparseety_prof.gpu.correlate import KernelCorrelator, gpu_step_id, gpu_step_index
from sparseety_prof.gpu.kernel_rows import summarize
from sparseety_prof.gpu.records import (
    HostStep,
    KernelActivity,
    LaunchApi,
    MemcpyActivity,
    RingCounters,
    WatchedBuffer,
)
from sparseety_prof.store import schema

MS = 1_000_000
HORIZON = 10 * MS
LAG = 300_000  # launch enter -> kernel start on the device
DUR = 50_000
T0 = 1_000 * MS
Record = KernelActivity | LaunchApi | MemcpyActivity | WatchedBuffer | RingCounters


class Trace:
    """What one engine process produces: host steps per thread, launch callbacks with their kernel
    activity, copies and watched buffers, with correlation ids increasing in launch order."""

    def __init__(self) -> None:
        self.corr = 100
        self.steps: list[HostStep] = []
        self.launches: list[LaunchApi] = []
        self.kernels: list[KernelActivity] = []
        self.other: list[Record] = []

    def step(self, step_id: int, tid: int, t0: int, t1: int) -> HostStep:
        s = HostStep(step_id, tid, t0, t1, pid=42)
        self.steps.append(s)
        return s

    def launch(
        self, tid: int, t: int, name: str = "gemm", *, lag: int = LAG, api: str = "cuLaunchKernel"
    ) -> tuple[LaunchApi, KernelActivity]:
        self.corr += 1
        la = LaunchApi(self.corr, api, tid, t, t + 5_000, pid=42)
        k = KernelActivity(
            self.corr, name, t + lag, t + lag + DUR, stream_id=7, grid=(4, 1, 1), block=(128, 1, 1)
        )
        self.launches.append(la)
        self.kernels.append(k)
        return la, k

    def watched(
        self, tid: int, t: int, ids: list[list[int]], name: str = "moe_align", dtype: str = "int32"
    ) -> KernelActivity:
        la, k = self.launch(tid, t, name)
        code = {"int32": "i", "uint32": "I", "int64": "q"}[dtype]
        data = b"".join(struct.pack(f"<{len(r)}{code}", *r) for r in ids)
        self.other.append(
            WatchedBuffer(la.correlation_id, name, 0, dtype, (len(ids), len(ids[0])), data, tid, t)
        )
        return k

    def records(self) -> list[Record]:
        return [*self.launches, *self.kernels, *self.other]


def flush(c: KernelCorrelator, now_ns: int | None = None, *, final: bool = False) -> dict[str, pl.DataFrame]:
    """c.flush's tables as frames (schema.frame: every column must be there)."""
    tables = c.flush(now_ns, final=final)
    assert tables.keys() == {"kernels", "routes", "steps"}
    return {t: schema.frame(t, cols) for t, cols in tables.items()}


def run(
    c: KernelCorrelator, batches: list[list[Record]], steps: list[HostStep], *, final: bool = True
) -> dict[str, pl.DataFrame]:
    """Feeds the batches with a flush after each, then a final flush; concatenates what came out."""
    c.add_steps(steps)
    outs = []
    for b in batches:
        c.add(b)
        outs.append(flush(c))
    if final:
        outs.append(flush(c, final=True))
    return {t: pl.concat([o[t] for o in outs]) for t in ("kernels", "routes", "steps")}


def by_corr(kernels: pl.DataFrame) -> dict[int, dict[str, Any]]:
    rows = kernels.to_dicts()
    assert len({r["correlation_id"] for r in rows if r["correlation_id"]}) == len(
        [r for r in rows if r["correlation_id"]]
    ), "a kernel was emitted twice"
    return {r["correlation_id"]: r for r in rows}


def two_steps() -> tuple[Trace, dict[int, int]]:
    """tid 7: step 10 [T0, T0+1ms], step 11 [T0+1ms+10us, T0+2ms]; four launches per step, the last
    one of step 10 so late that it executes during step 11."""
    tr = Trace()
    tr.step(10, 7, T0, T0 + MS)
    tr.step(11, 7, T0 + MS + 10_000, T0 + 2 * MS)
    want = {}
    for sid, base in ((10, T0), (11, T0 + MS + 10_000)):
        for i in range(4):
            la, _ = tr.launch(7, base + 150_000 + i * 200_000)
            want[la.correlation_id] = sid
    return tr, want


def test_thread_join_is_exact_with_shuffled_batches_and_kernels_before_their_launches() -> None:
    tr, want = two_steps()
    recs: list[Record] = [*tr.kernels, *tr.launches]  # every kernel before any launch record
    random.Random(1).shuffle(recs)
    batches = [recs[i : i + 3] for i in range(0, len(recs), 3)]
    c = KernelCorrelator(horizon_ns=HORIZON)
    out = run(c, batches, tr.steps, final=False)
    rows = by_corr(out["kernels"])
    assert {k: r["step_id"] for k, r in rows.items()} == want  # settled without waiting for the horizon
    assert {r["join"] for r in rows.values()} == {"thread"}
    assert {r["join_error_ns"] for r in rows.values()} == {0}
    late = rows[max(k for k, s in want.items() if s == 10)]
    assert late["start_ns"] > T0 + MS + 10_000  # ran during step 11, still joined to step 10
    assert late["tid"] == 7 and late["pid"] == 42 and late["api"] == "cuLaunchKernel"
    assert late["grid"] == [4, 1, 1] and late["block"] == [128, 1, 1] and late["buffer_captured"] is False
    assert out["kernels"].columns == list(schema.KERNELS)
    assert c.counters["joined_thread"] == 8 and c.counters["unjoined"] == 0
    assert c.counters["no_launch_record"] == 0


def test_kernel_waits_for_its_launch_record_until_the_horizon() -> None:
    tr, want = two_steps()
    c = KernelCorrelator(horizon_ns=HORIZON)
    c.add_steps(tr.steps)
    c.add(tr.kernels)
    assert flush(c)["kernels"].height == 0  # launch records may still come
    c.add(tr.launches)
    rows = by_corr(flush(c)["kernels"])
    assert {k: r["step_id"] for k, r in rows.items()} == want


def test_window_fallback_when_launch_records_are_lost_and_its_gpu_lag_error() -> None:
    tr, want = two_steps()
    c = KernelCorrelator(horizon_ns=HORIZON)
    c.add_steps(tr.steps)
    c.add(tr.kernels)  # no launch record at all
    assert flush(c, T0 + 2 * MS + HORIZON - 1)["kernels"].height == 0
    rows = by_corr(flush(c, T0 + 2 * MS + HORIZON + 1)["kernels"])
    got = {k: r["step_id"] for k, r in rows.items()}
    late = max(k for k, s in want.items() if s == 10)
    # the documented error: queued in step 10, executed during step 11, joined to 11 with error 0
    assert got == {**want, late: 11}
    assert rows[late]["join_error_ns"] == 0
    assert {r["join"] for r in rows.values()} == {"window"}
    assert rows[late]["tid"] is None and rows[late]["api"] is None and rows[late]["launch_ns"] is None
    assert c.counters["no_launch_record"] == 8 and c.counters["joined_window"] == 8


def test_window_error_is_the_distance_to_the_chosen_window() -> None:
    tr = Trace()
    tr.step(0, 7, T0, T0 + MS)
    tr.step(1, 7, T0 + 3 * MS, T0 + 4 * MS)
    gap = KernelActivity(0, "gap", T0 + 2 * MS, T0 + 2 * MS + DUR)  # between steps: the earlier one
    before = KernelActivity(0, "before", T0 - 500_000, T0 - 400_000)  # before every step: the first
    after = KernelActivity(0, "after", T0 + 9 * MS, T0 + 9 * MS + DUR)
    c = KernelCorrelator(horizon_ns=HORIZON)
    out = run(c, [[gap, before, after]], tr.steps)
    rows = {r["name"]: r for r in out["kernels"].to_dicts()}
    assert (rows["gap"]["step_id"], rows["gap"]["join_error_ns"]) == (0, MS)
    assert (rows["before"]["step_id"], rows["before"]["join_error_ns"]) == (0, 500_000)
    assert (rows["after"]["step_id"], rows["after"]["join_error_ns"]) == (1, 5 * MS)
    assert c.counters["no_launch_record"] == 3


def test_launch_outside_every_step_of_its_thread_joins_by_launch_time() -> None:
    tr = Trace()
    tr.step(0, 7, T0, T0 + MS)
    tr.step(1, 7, T0 + MS + 10_000, T0 + 2 * MS)
    la, _ = tr.launch(9, T0 + 900_000)  # helper thread 9 has no steps; its kernel runs during step 1
    c = KernelCorrelator(horizon_ns=HORIZON)
    c.add_steps(tr.steps)
    c.add(tr.records())
    assert flush(c)["kernels"].height == 0  # its thread's step may still arrive
    row = flush(c, final=True)["kernels"].row(0, named=True)
    assert (row["step_id"], row["join"], row["join_error_ns"], row["tid"]) == (0, "window", 0, 9)
    assert row["launch_ns"] == la.enter_ns


def test_zero_timestamps_use_the_launch_or_stay_unjoined() -> None:
    tr = Trace()
    tr.step(0, 7, T0, T0 + MS)
    la, k = tr.launch(7, T0 + 100_000)
    tr.kernels[-1] = replace(k, start_ns=0, end_ns=0)
    untimed = KernelActivity(0, "untimed", 0, 0)  # no launch, no time: nothing to join on
    la2, k2 = tr.launch(9, T0 + 200_000)  # thread without steps: window by its launch time
    tr.kernels[-1] = replace(k2, start_ns=0, end_ns=0)
    c = KernelCorrelator(horizon_ns=HORIZON)
    out = run(c, [[*tr.records(), untimed]], tr.steps)
    rows = {r["name"] + str(r["correlation_id"]): r for r in out["kernels"].to_dicts()}
    thread = rows[f"gemm{la.correlation_id}"]
    assert (thread["step_id"], thread["join"], thread["start_ns"], thread["end_ns"]) == (
        0,
        "thread",
        None,
        None,
    )
    window = rows[f"gemm{la2.correlation_id}"]
    assert (window["step_id"], window["join"], window["join_error_ns"]) == (0, "window", 0)
    assert (rows["untimed0"]["step_id"], rows["untimed0"]["join"]) == (None, None)
    cnt = c.counters
    assert (cnt["zero_timestamp"], cnt["unjoined"], cnt["no_launch_record"]) == (3, 1, 1)
    assert cnt["causality_violations"] == 0


def test_drops_are_counted_and_the_ring_counters_reported() -> None:
    tr, want = two_steps()
    lost = {tr.launches[1].correlation_id, tr.launches[6].correlation_id}
    launches = [la for la in tr.launches if la.correlation_id not in lost]
    ring = RingCounters(activity_dropped=5, ring_dropped=2, buffers_failed=1, errors=["cuptiX failed"])
    c = KernelCorrelator(horizon_ns=HORIZON)
    out = run(c, [[*tr.kernels, *launches, RingCounters(activity_dropped=1), ring]], tr.steps)
    rows = by_corr(out["kernels"])
    assert {k: r["step_id"] for k, r in rows.items()} == want  # the lost ones by window, same steps here
    assert {k for k, r in rows.items() if r["join"] == "window"} == lost
    cnt = c.counters
    assert (cnt["no_launch_record"], cnt["joined_thread"], cnt["joined_window"]) == (2, 6, 2)
    assert (cnt["ring_activity_dropped"], cnt["ring_dropped"], cnt["ring_buffers_failed"]) == (5, 2, 1)
    assert cnt["ring_errors"] == 1
    assert (cnt["kernels_in"], cnt["kernels_out"]) == (8, 8)


def skewed(skew: int) -> tuple[Trace, list[KernelActivity], KernelActivity]:
    """Device clock `skew` ns off the host's; plus one kernel whose launch record is lost."""
    tr, _ = two_steps()
    kernels = [replace(k, start_ns=k.start_ns + skew, end_ns=k.end_ns + skew) for k in tr.kernels]
    orphan = KernelActivity(0, "orphan", T0 + 1_500_000 + skew, T0 + 1_550_000 + skew)  # runs in step 11
    return tr, kernels, orphan


def test_clock_skew_is_detected_by_causality_and_does_not_move_thread_joins() -> None:
    skew = -5 * MS  # device clock 5 ms behind the host
    tr, kernels, orphan = skewed(skew)
    _, want = two_steps()
    c = KernelCorrelator(horizon_ns=HORIZON)
    rows = by_corr(run(c, [[*kernels, *tr.launches, orphan]], tr.steps)["kernels"])
    assert {k: r["step_id"] for k, r in rows.items() if k} == want  # host-side launch times: unaffected
    assert rows[0]["step_id"] == 10  # the window join is fooled: 5 ms early lands in step 10
    assert c.counters["causality_violations"] == 8
    assert c.estimated_clock_offset_ns == skew + LAG  # median of (start - enter): skew plus queueing

    fixed = KernelCorrelator(horizon_ns=HORIZON, clock_offset_ns=skew)
    rows = by_corr(run(fixed, [[*kernels, *tr.launches, orphan]], tr.steps)["kernels"])
    assert {k: r["step_id"] for k, r in rows.items() if k} == want
    assert rows[0]["step_id"] == 11 and rows[0]["start_ns"] == T0 + 1_500_000  # corrected times out
    first = tr.kernels[0]
    assert rows[first.correlation_id]["start_ns"] == first.start_ns
    assert fixed.counters["causality_violations"] == 0 and fixed.estimated_clock_offset_ns is None


def test_graph_kernels_join_through_the_graph_launch_else_by_window() -> None:
    tr = Trace()
    tr.step(0, 7, T0, T0 + MS)
    tr.step(1, 7, T0 + MS + 10_000, T0 + 2 * MS)
    tr.corr += 1
    glaunch = LaunchApi(tr.corr, "cuGraphLaunch", 7, T0 + 800_000, T0 + 810_000, pid=42, graph_id=3)
    # the replay runs late, entirely during step 1: the graph launch still puts it in step 0
    nodes = [
        KernelActivity(
            tr.corr,
            f"node{n}",
            T0 + 1_200_000 + n * 60_000,
            T0 + 1_250_000 + n * 60_000,
            graph_id=3,
            graph_node_id=n,
        )
        for n in (1, 2, 3)
    ]
    orphans = [  # replay whose kernels carry correlation id 0: window on their start
        KernelActivity(
            0,
            f"orphan{n}",
            T0 + 1_700_000 + n * 60_000,
            T0 + 1_750_000 + n * 60_000,
            graph_id=4,
            graph_node_id=n,
        )
        for n in (1, 2)
    ]
    c = KernelCorrelator(horizon_ns=HORIZON)
    out = run(c, [[*orphans, nodes[2]], [glaunch, *nodes[:2]]], tr.steps)
    rows = {r["name"]: r for r in out["kernels"].to_dicts()}
    for n in (1, 2, 3):
        r = rows[f"node{n}"]
        assert (r["step_id"], r["join"], r["api"], r["tid"]) == (0, "thread", "cuGraphLaunch", 7)
        assert (r["graph_id"], r["graph_node_id"], r["launch_ns"]) == (3, n, T0 + 800_000)
    for n in (1, 2):
        r = rows[f"orphan{n}"]
        assert (r["step_id"], r["join"], r["graph_id"], r["graph_node_id"]) == (1, "window", 4, n)
    assert rows["node1"]["buffer_captured"] is False


def test_two_threads_stepping_at_once_each_kernel_on_its_own_threads_step() -> None:
    tr = Trace()
    want = {}
    for n in range(6):  # tid 7 steps 0, 2, 4, ...; tid 8 steps 1, 3, 5, ... overlapping by half
        tid, sid, t0 = 7 + n % 2, n, T0 + n * 500_000
        tr.step(sid, tid, t0, t0 + MS)
        for i in range(3):
            la, _ = tr.launch(tid, t0 + 100_000 + i * 300_000)
            want[la.correlation_id] = sid
    recs = tr.records()
    random.Random(7).shuffle(recs)
    c = KernelCorrelator(horizon_ns=HORIZON)
    rows = by_corr(run(c, [recs[:10], recs[10:20], recs[20:]], tr.steps, final=False)["kernels"])
    assert {k: r["step_id"] for k, r in rows.items()} == want
    assert {r["join"] for r in rows.values()} == {"thread"}
    assert all(r["tid"] == 7 + r["step_id"] % 2 for r in rows.values())


@pytest.mark.parametrize("dtype", ["int32", "uint32", "int64"])  # the index types of vLLM's top-k kernels
def test_watched_topk_buffers_become_routes_rows_in_launch_order(dtype: str) -> None:
    tr = Trace()
    tr.step(0, 7, T0, T0 + MS)
    tr.step(1, 7, T0 + MS + 10_000, T0 + 2 * MS)
    ids0 = [[[3, 1], [0, 2]], [[5, 4], [6, 7]], [[1, 0], [2, 3]]]  # layer 0, 1, 2 of step 0: 2 rows, k=2
    ids1 = [[[7, 6], [5, 4]], [[0, 1], [2, 3]]]
    w0 = [tr.watched(7, T0 + 100_000 + i * 200_000, ids, dtype=dtype) for i, ids in enumerate(ids0)]
    tr.launch(7, T0 + 150_000, "attn")  # not watched
    w1 = [tr.watched(7, T0 + MS + 100_000 + i * 200_000, ids, dtype=dtype) for i, ids in enumerate(ids1)]
    recs = tr.records()
    random.Random(3).shuffle(recs)
    c = KernelCorrelator(horizon_ns=HORIZON)
    c.add_steps(tr.steps)
    c.add(recs)
    first = flush(c)
    assert first["kernels"].height == 6 and first["routes"].height == 0  # routes wait for the horizon
    captured = dict(zip(first["kernels"]["correlation_id"], first["kernels"]["buffer_captured"], strict=True))
    assert [captured[k.correlation_id] for k in w0 + w1] == [True] * 5
    assert captured[tr.kernels[3].correlation_id] is False
    routes = flush(c, T0 + 2 * MS + HORIZON + 1)["routes"]
    assert routes.columns == list(schema.ROUTES)
    got = routes.sort("step_id", "layer", "row").select("step_id", "layer", "row", "expert_ids").rows()
    want = [
        (s, layer, r, ids[r])
        for s, lay in ((0, ids0), (1, ids1))
        for layer, ids in enumerate(lay)
        for r in (0, 1)
    ]
    assert got == want
    assert routes["seq_id"].null_count() == routes.height
    # a buffer for step 0 arriving now would renumber its layers: dropped and counted
    c.add([WatchedBuffer(w0[0].correlation_id, "moe_align", 1, "int32", (1, 2), b"\0" * 8, 7, T0 + 100_000)])
    assert flush(c, final=True)["routes"].height == 0
    assert c.counters["buffers_late"] == 1 and c.counters["routes_rows"] == 10


def test_malformed_and_unjoinable_buffers_are_counted() -> None:
    tr = Trace()
    tr.step(0, 7, T0, T0 + MS)
    k = tr.watched(7, T0 + 100_000, [[1, 2]])
    bad = WatchedBuffer(k.correlation_id, "moe_align", 2, "int32", (1, 3), b"\0" * 8, 7, T0 + 100_000)
    mask = WatchedBuffer(k.correlation_id, "moe_align", 3, "uint8", (4,), b"\1\0\1\0", 7, T0 + 100_000)
    lost = WatchedBuffer(999, "moe_align", 0, "int32", (1, 2), b"\0" * 8)  # no tid, time or launch
    # a rule that points at the wrong buffer (another revision of the engine): no expert ids
    huge = WatchedBuffer(
        k.correlation_id, "moe_align", 4, "int64", (1, 2), struct.pack("<2q", 1, 2**40), 7, T0 + 100_000
    )
    high = WatchedBuffer(
        k.correlation_id, "moe_align", 5, "uint32", (1, 2), struct.pack("<2I", 2**31, 1), 7, T0 + 100_000
    )
    c = KernelCorrelator(horizon_ns=HORIZON)
    out = run(c, [[*tr.records(), bad, mask, lost, huge, high]], tr.steps)
    assert out["routes"].select("step_id", "row", "layer", "expert_ids").rows() == [(0, 0, 0, [1, 2])]
    cnt = c.counters
    assert (cnt["buffers_malformed"], cnt["buffers_unjoined"], cnt["routes_rows"]) == (3, 1, 1)


def test_buffer_after_its_kernel_row_is_counted() -> None:
    tr = Trace()
    tr.step(0, 7, T0, T0 + MS)
    tr.watched(7, T0 + 100_000, [[1, 2]])
    c = KernelCorrelator(horizon_ns=HORIZON)
    c.add_steps(tr.steps)
    c.add([*tr.launches, *tr.kernels])
    assert flush(c)["kernels"]["buffer_captured"].to_list() == [False]
    c.add(tr.other)
    out = flush(c, final=True)
    assert out["routes"]["expert_ids"].to_list() == [[1, 2]]
    assert c.counters["buffers_after_kernel_row"] == 1


def gpu_loop() -> tuple[list[Record], dict[int, int | None]]:
    """A Python decode loop: no host steps; each step's kernels, then an 8-byte DtoH of the sampled
    token. Also a 1 MiB DtoH (not a close) and a watched-buffer copy (not a close)."""
    tr = Trace()
    recs: list[Record] = []
    want: dict[int, int | None] = {}
    t = T0
    for n in range(3):
        for i in range(3):
            la, _ = tr.launch(7, t + i * 100_000)
            want[la.correlation_id] = gpu_step_id(n)
        tr.corr += 1
        recs.append(MemcpyActivity(tr.corr, "DtoH", 1 << 20, t + 250_000, t + 260_000))  # too big
        w = tr.watched(7, t + 400_000, [[n, n + 1]])
        want[w.correlation_id] = gpu_step_id(n)
        recs.append(MemcpyActivity(w.correlation_id, "DtoH", 8, t + 800_000, t + 810_000))  # watched copy
        tr.corr += 1
        recs.append(LaunchApi(tr.corr, "cudaMemcpyAsync", 7, t + 820_000, t + 830_000, pid=42))
        recs.append(MemcpyActivity(tr.corr, "DtoH", 8, t + 900_000, t + 910_000))  # closes step n
        t += MS
    tail, _ = tr.launch(7, t)  # after the last close: its step never closed
    want[tail.correlation_id] = None
    return [*recs, *tr.records()], want


def test_gpu_step_mode_closes_steps_on_small_dtoh_copies() -> None:
    recs, want = gpu_loop()
    random.Random(5).shuffle(recs)
    c = KernelCorrelator(horizon_ns=HORIZON)
    c.add(recs)
    early = flush(c)  # closes wait for the horizon: a late, earlier close could still arrive
    assert (early["kernels"].height, early["steps"].height, c.mode) == (0, 0, "auto")
    out = flush(c, T0 + 3 * MS + HORIZON)
    rest = flush(c, final=True)
    assert c.mode == "gpu_step"
    steps = out["steps"].select("step_id", "t_start_ns", "t_end_ns", "tid", "n_tokens").rows()
    assert steps == [
        (-1, None, T0 + 910_000, 7, None),
        (-2, T0 + 910_000, T0 + MS + 910_000, 7, None),
        (-3, T0 + MS + 910_000, T0 + 2 * MS + 910_000, 7, None),
    ]
    assert [gpu_step_index(s[0]) for s in steps] == [0, 1, 2]
    rows = by_corr(pl.concat([out["kernels"], rest["kernels"]]))
    assert {k: r["step_id"] for k, r in rows.items()} == want
    assert {r["join"] for r in rows.values() if r["step_id"] is not None} == {"gpu_step"}
    assert out["routes"].select("step_id", "expert_ids").rows() == [(-1, [0, 1]), (-2, [1, 2]), (-3, [2, 3])]
    assert c.counters["gpu_steps"] == 3 and c.counters["unjoined"] == 1


def test_gpu_step_close_predicate_is_configurable() -> None:
    recs, _ = gpu_loop()
    c = KernelCorrelator(horizon_ns=HORIZON, step_close=lambda m: m.bytes > 1024)  # the 1 MiB copies
    c.add(recs)
    out = flush(c, final=True)
    assert out["steps"]["t_end_ns"].to_list() == [T0 + n * MS + 260_000 for n in range(3)]


def test_a_close_older_than_a_settled_one_is_late_and_counted() -> None:
    recs, _ = gpu_loop()
    first = next(r for r in recs if isinstance(r, MemcpyActivity) and r.end_ns == T0 + 910_000)
    c = KernelCorrelator(horizon_ns=HORIZON)
    c.add([r for r in recs if r is not first])
    out = flush(c, T0 + 3 * MS + HORIZON)
    assert out["steps"]["t_end_ns"].to_list() == [T0 + MS + 910_000, T0 + 2 * MS + 910_000]
    c.add([first])  # cannot reopen settled history: steps 0 and 1 stay merged
    out = flush(c, final=True)
    assert out["steps"].height == 0 and c.counters["late_closes"] == 1


def test_forced_gpu_step_mode_ignores_host_steps() -> None:
    recs, _ = gpu_loop()
    c = KernelCorrelator(mode="gpu_step", horizon_ns=HORIZON)
    c.add_steps([HostStep(0, 7, T0, T0 + MS)])
    c.add(recs)
    out = flush(c, final=True)
    assert out["steps"].height == 3 and c.counters["steps_ignored"] == 1
    forced = KernelCorrelator(mode="host", horizon_ns=HORIZON)
    forced.add(recs)
    out = flush(forced, final=True)
    assert out["steps"].height == 0 and out["kernels"]["step_id"].null_count() == out["kernels"].height


def test_unsettled_state_is_capped_dropping_the_oldest() -> None:
    tr, _ = two_steps()
    c = KernelCorrelator(horizon_ns=HORIZON, max_pending=3)
    c.add(tr.kernels)  # no steps, no launches: nothing settles
    assert c.counters["state_overflow"] == 5
    out = flush(c, final=True)
    assert out["kernels"]["correlation_id"].to_list() == [k.correlation_id for k in tr.kernels[-3:]]


def test_summarize_busy_time_is_the_union_of_kernel_intervals() -> None:
    given: dict[str, list[object]] = {
        "step_id": [0, 0, 0, 0, 1, None],
        "start_ns": [100, 150, 300, None, 1_000, 5],
        "end_ns": [200, 250, 400, None, 1_010, 6],
    }
    kernels = schema.frame("kernels", given, absent=[c for c in schema.KERNELS if c not in given])
    s = summarize(kernels).rows()
    assert s == [(0, 4, 250, 100, 400), (1, 1, 10, 1_000, 1_010), (None, 1, 1, 5, 6)]
    assert summarize(kernels).columns == ["step_id", "kernels", "busy_ns", "first_start_ns", "last_end_ns"]


def test_rejects_foreign_records() -> None:
    with pytest.raises(TypeError, match="not a GPU record"):
        KernelCorrelator().add([object()])  # type: ignore[list-item]
