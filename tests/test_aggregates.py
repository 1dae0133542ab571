"""The always-on aggregates (store/aggregates.py) and `--policy aggregate`: counts per bucket equal
to the rows they fold, whether handed out at once or bucket by bucket; on a real engine, the
aggregates of a recording that kept every row equal those counted independently from its rows, and
a recording under the aggregate policy keeps the same counts while its dropped rows are counted."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import Engine, Recorder

import sparseety_prof
from sparseety_prof.store import schema
from sparseety_prof.store.aggregates import Aggregator, combine
from sparseety_prof.store.array_rows import ArrayRows

PROMPTS = ["hello the expert router", "one two three four", "the sparse decode sample"]
LAYERS = {"moe": [1, 3, 5], "ffn": [0, 1, 3, 5]}


def _random_tokens(n: int, seed: int) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    cols: schema.Columns = {c: [None] * n for c in schema.TOKENS}
    cols["ts_unix_ms"] = [int(x) for x in np.sort(rng.integers(0, 60_000, n))]
    cols["log_prob"] = [float(x) for x in -rng.exponential(2.0, n)]
    cols["expert_ids"] = [
        [[int(e) for e in rng.choice(8, 2, replace=False)] for _ in LAYERS["moe"]] for _ in range(n)
    ]
    cols["act_zero_ratio"] = [[float(x) for x in rng.random(len(LAYERS["ffn"]))] for _ in range(n)]
    return schema.frame("tokens", cols)


def _count_by_hand(
    tokens: pl.DataFrame, bucket_s: int, layers: dict[str, list[int]]
) -> dict[tuple[int, str, int | None, int], int]:
    """The same counts with plain loops, for comparison."""
    out: dict[tuple[int, str, int | None, int], int] = {}

    def add(key: tuple[int, str, int | None, int]) -> None:
        out[key] = out.get(key, 0) + 1

    lp_edges = schema.AGGREGATE_EDGES["log_prob"]
    ratio_edges = schema.AGGREGATE_EDGES["act_zero_ratio"]

    def layer(kind: str, i: int) -> int | None:
        return layers[kind][i] if i < len(layers[kind]) else None  # past meta's layers: null

    for row in tokens.iter_rows(named=True):
        if row["ts_unix_ms"] is None:
            continue
        b = row["ts_unix_ms"] // (bucket_s * 1000) * bucket_s * 1000
        add((b, "tokens", None, 0))
        lp = row["log_prob"]
        if lp is not None:
            add((b, "log_prob", None, max(0, min(len(lp_edges) - 2, sum(e <= lp for e in lp_edges) - 1))))
        for i, ids in enumerate(row["expert_ids"] or []):
            for e in ids or []:
                if e is not None and e >= 0:
                    add((b, "expert_load", layer("moe", i), e))
        for metric in ("act_zero_ratio", "act_below_ratio"):
            for i, r in enumerate(row[metric] or []):
                if r is not None:
                    bin_ = max(0, min(len(ratio_edges) - 2, sum(e <= r for e in ratio_edges) - 1))
                    add((b, metric, layer("ffn", i), bin_))
    return out


def _as_dict(rows: pl.DataFrame) -> dict[tuple[int, str, int | None, int], int]:
    return {
        (b, m, lay, bi): c
        for b, m, lay, bi, c in combine(rows)
        .select("bucket_unix_ms", "metric", "layer", "bin", "count")
        .iter_rows()
    }


def test_aggregates_equal_the_counts_of_their_rows() -> None:
    tokens = _random_tokens(500, seed=1)
    agg = Aggregator(LAYERS, bucket_s=10)
    agg.add("tokens", tokens)
    rows = agg.take()
    assert dict(rows.schema) == schema.AGGREGATES
    assert _as_dict(rows) == _count_by_hand(tokens, 10, LAYERS)


def test_nulls_empty_lists_negative_ids_and_unknown_layers_are_counted_as_their_rows_say() -> None:
    """Rows without a timestamp are not counted; null log-probs, null or empty lists, null
    elements and negative expert ids (slots the engine left unset) count nothing; a list longer
    than meta.json's layers counts its extra elements under a null layer."""
    cols: schema.Columns = {c: [None] * 7 for c in schema.TOKENS}
    cols["ts_unix_ms"] = [1_000, None, 2_000, 12_000, 12_500, 13_000, 25_000]
    cols["log_prob"] = [-0.1, -0.2, None, -30.0, -3.0, None, -0.01]
    cols["expert_ids"] = [
        [[1, 2], [3, -1], [4, 5]],
        [[1, 2], [3, 4], [5, 6]],  # no timestamp
        None,
        [[], None, [7, 7]],
        [[1, 2], [3, 4], [5, 6], [7, 0]],  # a fourth MoE list: meta names three
        [],
        [[2, None], [0, 1], [6, 6]],
    ]
    cols["act_zero_ratio"] = [[0.1, None, 0.5, 1.0], None, [], [0.0, 0.05, 0.999, 0.2, 0.3], None, [0.5], []]
    cols["act_below_ratio"] = [[0.2] * 4, [0.3] * 4, None, [None] * 4, [0.9, 0.8, 0.7, 0.6], [], [0.4] * 4]
    tokens = schema.frame("tokens", cols)
    agg = Aggregator(LAYERS, bucket_s=10)
    agg.add("tokens", tokens)
    rows = agg.take()
    assert dict(rows.schema) == schema.AGGREGATES
    got, want = _as_dict(rows), _count_by_hand(tokens, 10, LAYERS)
    assert got == want
    assert (10_000, "expert_load", None, 7) in got and (10_000, "act_zero_ratio", None, 6) in got
    assert got[(10_000, "expert_load", 5, 7)] == 2 and (0, "expert_load", 3, 2**31 - 1) not in got
    assert sum(c for (_, m, _, _), c in got.items() if m == "tokens") == 6
    # nothing to count at all
    empty = Aggregator(LAYERS)
    empty.add("tokens", tokens.head(0))
    empty.add("tokens", tokens.slice(1, 1).with_columns(pl.lit(None, dtype=pl.Int64()).alias("ts_unix_ms")))
    assert empty.take().height == 0


def _token_arrays(n: int, seed: int) -> ArrayRows:
    """Token rows as the correlator sets them apart: per-layer columns arrays (some rows null,
    some with activations not counted), the others Python values (some null, a NaN log-prob)."""
    rng = np.random.default_rng(seed)
    arrays: dict[str, object] = {c: None for c in schema.TOKENS}
    ts = [int(x) for x in np.sort(rng.integers(0, 60_000, n))]
    ts[3] = None  # type: ignore[call-overload]
    lp: list[object] = [float(x) for x in -rng.exponential(2.0, n)]
    lp[5], lp[6] = None, float("nan")
    arrays["ts_unix_ms"], arrays["log_prob"] = ts, lp
    ids = rng.integers(-1, 8, (n, 4, 2)).astype(np.int32)  # one layer past meta's, some -1
    arrays["expert_ids"] = ids
    arrays["act_zero_ratio"] = rng.random((n, len(LAYERS["ffn"])))
    arrays["act_below_ratio"] = rng.random((n, len(LAYERS["ffn"])))
    uncounted = rng.random(n) < 0.3
    nulls = {"expert_ids": rng.random(n) < 0.1}
    return ArrayRows(n, arrays, nulls, {"act_zero_ratio": uncounted, "act_below_ratio": uncounted})  # type: ignore[arg-type]


def test_rows_counted_from_their_arrays_count_as_their_frame() -> None:
    """add_rows (the rows the correlator sets apart, never framed) counts what add counts of the
    same rows' frame: tokens with per-layer arrays, null rows and lists, uncounted activations, a
    NaN log-prob, ids of no expert and past the layers; steps; and rows with per-row lists,
    counted as their frame."""
    parts = [_token_arrays(300, seed=4), _token_arrays(200, seed=5)]
    lists = ArrayRows(2, {**{c: None for c in schema.TOKENS}, "ts_unix_ms": [1000, 2000]})
    lists.arrays["expert_ids"] = [[[1, 2], None, [3, None]], None]  # type: ignore[index]
    steps = ArrayRows(
        3,
        {
            **{c: None for c in schema.STEPS},
            "ts_unix_ms": [10, 20_000, None],
            "t_start_ns": [5, 7_000_000, 1],
            "t_end_ns": [4_000_005, 9_000_000, 2],
        },
    )
    by_rows, by_frames = Aggregator(LAYERS, bucket_s=10), Aggregator(LAYERS, bucket_s=10)
    by_rows.add_rows("tokens", [*parts, lists])
    by_rows.add_rows("steps", [steps])
    for p in [*parts, lists]:
        by_frames.add("tokens", p.frame("tokens"))
    by_frames.add("steps", steps.frame("steps"))
    got, want = by_rows.take(), by_frames.take()
    assert _as_dict(got) == _as_dict(want)
    assert {m for (_, m, _, _) in _as_dict(got)} == {
        "tokens",
        "log_prob",
        "expert_load",
        "act_zero_ratio",
        "act_below_ratio",
        "step_ms",
    }


def test_buckets_handed_out_as_they_close_add_up_to_the_same_counts() -> None:
    tokens = _random_tokens(400, seed=2)
    agg = Aggregator(LAYERS, bucket_s=5, grace_s=2)
    parts = []
    for chunk in tokens.iter_slices(37):  # frames arrive in pieces, some late for their bucket
        agg.add("tokens", chunk.sample(fraction=1.0, shuffle=True, seed=3))
        now = int(chunk["ts_unix_ms"].cast(pl.Int64).max())  # type: ignore[arg-type]
        parts.append(agg.take(now))
        for p in parts[-1].iter_rows(named=True):  # only closed buckets are handed out
            assert p["bucket_unix_ms"] + 5000 + 2000 <= now
    parts.append(agg.take())
    assert _as_dict(pl.concat(parts)) == _count_by_hand(tokens, 5, LAYERS)


def test_a_take_in_steps_counts_a_metric_per_step_and_leaves_rows_added_between_for_later() -> None:
    """Aggregator.take_steps, the recorder's flush in pieces (session/flush_round.py): a step per
    metric, the closed buckets at the end; rows added between two steps are counted by a later
    take; everything adds up to the counts of the rows."""
    tokens = _random_tokens(400, seed=5)
    agg = Aggregator(LAYERS, bucket_s=5, grace_s=2)
    first, late = tokens.slice(0, 300), tokens.slice(300)
    agg.add("tokens", first)
    out: list[pl.DataFrame] = []
    now = int(first["ts_unix_ms"].cast(pl.Int64).max())  # type: ignore[arg-type]
    steps = agg.take_steps(now, out)
    assert next(steps) == "aggregates tokens"
    agg.add("tokens", late)  # a drain between two steps
    assert list(steps) == [
        "aggregates log_prob",
        "aggregates expert_load",
        "aggregates act_zero_ratio",
        "aggregates act_below_ratio",
    ]
    [closed] = out
    assert closed.height and (closed["bucket_unix_ms"] + 7000 <= now).all()
    assert agg._raw_rows == late.height  # waiting for a later take
    assert _as_dict(pl.concat([closed, agg.take()])) == _count_by_hand(tokens, 5, LAYERS)


def test_rows_waiting_to_be_counted_are_bounded_and_counted_alike() -> None:
    """Rows are counted when a bucket of theirs closes, or once FOLD_ROWS of them wait: a run
    whose buckets never close in time (a long grace) still holds at most FOLD_ROWS raw rows."""
    tokens = _random_tokens(400, seed=4)
    agg = Aggregator(LAYERS, bucket_s=5, grace_s=3600)
    agg.FOLD_ROWS = 50
    for chunk in tokens.iter_slices(23):
        agg.add("tokens", chunk)
        assert agg._raw_rows < 50
        assert agg.take(int(chunk["ts_unix_ms"].cast(pl.Int64).max())).height == 0  # type: ignore[arg-type]
    assert _as_dict(agg.take()) == _count_by_hand(tokens, 5, LAYERS)


def test_steps_give_a_latency_histogram() -> None:
    cols: schema.Columns = {c: [None] * 4 for c in schema.STEPS}
    cols.update(
        ts_unix_ms=[0, 100, 11_000, 11_500],
        t_start_ns=[0, 0, 0, 0],
        t_end_ns=[300_000, 3_000_000, 3_100_000, 10**12],
    )
    agg = Aggregator({}, bucket_s=10)
    agg.add("steps", schema.frame("steps", cols))
    got = _as_dict(agg.take())
    edges = schema.AGGREGATE_EDGES["step_ms"]
    three_ms = next(i for i in range(len(edges) - 1) if edges[i] <= 3.0 < edges[i + 1])
    assert got == {
        (0, "step_ms", None, 0): 1,  # 0.3 ms
        (0, "step_ms", None, three_ms): 1,
        (10_000, "step_ms", None, three_ms): 1,
        (10_000, "step_ms", None, len(edges) - 2): 1,  # beyond the last edge: the last bin
    }


@pytest.mark.root
@pytest.mark.engine
def test_aggregate_policy_keeps_the_counts_of_a_full_recording_and_counts_what_it_dropped(
    llama_engine: Engine, tmp_path: Path
) -> None:
    full, agg_only = tmp_path / "full", tmp_path / "agg"
    a = Recorder(llama_engine.pid, full, "--aggregate-interval", "1")
    b = Recorder(llama_engine.pid, agg_only, "--policy", "aggregate", "--aggregate-interval", "1")
    truth = [r["ids"] for r in llama_engine.generate(PROMPTS * 2, max_tokens=24)]
    for rec in (a, b):
        rc, err = rec.stop(signal.SIGINT)
        assert rc == 0, err
    rf, ra = sparseety_prof.open(full), sparseety_prof.open(agg_only)
    generated = sum(len(ids) for ids in truth)
    tokens = rf.tokens()
    assert tokens.height == generated
    # the full recording's aggregates are its rows, counted independently
    layers = {k: v for k, v in rf.meta["layers"].items() if isinstance(v, list)}
    got = _as_dict(rf.aggregates())
    counted = {"tokens", "log_prob", "expert_load", "act_zero_ratio", "act_below_ratio"}
    assert {k: v for k, v in got.items() if k[1] in counted} == _count_by_hand(tokens, 1, layers)
    assert _summed(got, ("tokens",)) == {("tokens", None, 0): generated}
    assert _summed(got, ("expert_load",)) and _summed(got, ("act_zero_ratio",))  # the model is sparse
    assert sum(v for k, v in got.items() if k[1] == "step_ms") == rf.steps().height
    # the aggregate-only recording: no rows but the requests, the same counts, the drops counted
    assert ra.tokens().height == 0 and ra.steps().height == 0 and ra.routes().height == 0
    assert ra.meta["policy"]["rows_dropped"]["tokens"] == generated
    assert ra.meta["policy"]["rows_dropped"]["routes"] == rf.routes().height
    assert ra.meta["losses"]["seq_gaps"] == 0 and ra.meta["losses"]["kernel_drops"] == 0
    for metric in ("tokens", "log_prob", "expert_load", "act_zero_ratio", "act_below_ratio"):
        assert _summed(_as_dict(ra.aggregates()), (metric,)) == _summed(got, (metric,)), metric
    # each recorder times the steps with probes of its own: a step near a bin edge may fall on
    # either side, so only the number of steps is the same
    assert sum(_summed(_as_dict(ra.aggregates()), ("step_ms",)).values()) == rf.steps().height


def _summed(
    d: dict[tuple[int, str, int | None, int], int], metrics: tuple[str, ...]
) -> dict[tuple[str, int | None, int], int]:
    """Counts summed over the buckets (two recorders' clocks may put a row in adjacent buckets)."""
    out: dict[tuple[str, int | None, int], int] = {}
    for (_b, m, lay, bi), c in d.items():
        if m in metrics:
            out[(m, lay, bi)] = out.get((m, lay, bi), 0) + c
    return out
