"""Root tests: layer times per step and engine thread (layer_times table, the tokens' slowest
layer), on real engines: llama-cpp-python in-process and a llama-server build (xllamacpp).

Ground truth by construction: a thread's probe points split its step, so per (step, thread)
sum(dur_ns) + head + tail equals the step's duration exactly, with head and tail the edges the
schema states (step start to the first point, the last point to the step's end), every point
inside the step and in layer order; the engine's thread count bounds the thread indices, and
graph thread 0 is the thread that ran the step. The planted cause: a model whose layer 2 has an
FFN 64x the others' wide (synthetic preset wide_layer): the interval that ends at its probe point
holds two thirds of that FFN (gate and up), orders of magnitude above a narrow layer's, so it is
the slowest layer of most steps and of most tokens."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections import Counter
from itertools import pairwise
from pathlib import Path

import polars as pl
import pytest
from conftest import ENGINES, Engine, Recorder, free_port

import sparseety_prof
from sparseety_prof.capture.events import lt_threads_for
from sparseety_prof.store.recording import Recording
from sparseety_prof.synthetic import make_model

pytestmark = [pytest.mark.root, pytest.mark.engine]

PROMPT = "hello the expert router says the sparse decode sample is one two three"
THREADS = 2
WIDE_LAYER = 2  # the preset's wide FFN


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("layer_time_models")


def _model(model_dir: Path, preset: str) -> Path:
    path = model_dir / f"{preset}.gguf"
    if not path.exists():
        make_model(path, preset)
    return path


def _record_llama(model: Path, out: Path, max_tokens: int, threads: int = THREADS) -> Recording:
    e = Engine([str(ENGINES / "llama_engine.py"), str(model), "--threads", str(threads)])
    try:
        rec = Recorder(e.pid, out)
        e.generate([PROMPT], max_tokens=max_tokens)
        rc, err = rec.stop(signal.SIGINT)
        assert rc == 0, err
    finally:
        e.close()
    return sparseety_prof.open(out)


def check_layer_times(r: Recording, threads: int = THREADS) -> pl.DataFrame:
    """The identity and the edges, per (step, thread) of the first `threads` graph threads (the
    record's slots); returns the layer_times rows."""
    lt = r.table("layer_times")
    steps = r.steps()
    assert lt.height > 0
    assert r.meta["losses"]["layer_times_unjoined"] == 0
    by_step = {s["step_id"]: s for s in steps.iter_rows(named=True)}
    timed = set(lt["step_id"].to_list())
    # every step has layer times, the prompt's (several rows) and the decode steps' (one row)
    assert timed == set(by_step)
    assert {by_step[s]["n_tokens"] > 1 for s in timed} == {True, False}
    ffn_layers = r.meta["layers"]["ffn"]
    for (step_id, thread), g in lt.group_by(["step_id", "thread"]):
        s = by_step[step_id]
        g = g.sort("t_ns")
        t_start, t_end = s["t_start_ns"], s["t_end_ns"]
        times, durs = g["t_ns"].to_list(), g["dur_ns"].to_list()
        # every layer's probe point, in layer order, inside the step
        assert g["layer"].to_list() == ffn_layers, (step_id, thread)
        assert times == sorted(set(times))
        assert t_start < times[0] and times[-1] < t_end
        head, tail = times[0] - t_start, t_end - times[-1]
        # the thread's first point has no interval of its own (it is the head gap's end); each
        # later one's runs from the point before
        assert durs[0] is None and durs[1:] == [b - a for a, b in pairwise(times)]
        assert sum(durs[1:]) + head + tail == t_end - t_start
        assert 0 <= thread < threads
        assert g["tid"].n_unique() == 1
        if thread == 0:  # graph thread 0 is the caller: the thread that ran the step
            assert g["tid"][0] == s["tid"]
    # every thread slot at every layer of every step
    assert lt.height == len(timed) * threads * len(ffn_layers)
    # the lag: after the first thread at that layer of that step
    first = lt.group_by(["step_id", "layer"]).agg(pl.col("lag_ns").min())
    assert first["lag_ns"].to_list() == [0] * first.height
    return lt


def check_slowest(r: Recording, lt: pl.DataFrame) -> pl.DataFrame:
    """Each token's slowest layer is its step's largest interval; null without layer times."""
    best = (
        lt.drop_nulls("dur_ns")
        .sort(["step_id", "dur_ns"], descending=[False, True])
        .group_by("step_id", maintain_order=True)
        .first()
    )
    want = {b["step_id"]: (b["layer"], b["dur_ns"] / 1e6, b["tid"]) for b in best.iter_rows(named=True)}
    tokens = r.tokens()
    for t in tokens.iter_rows(named=True):
        got = (t["slowest_layer"], t["slowest_layer_ms"], t["slowest_tid"])
        if t["step_id"] in want:
            layer, ms, tid = want[t["step_id"]]
            assert got[0] == layer and got[2] == tid and got[1] == pytest.approx(ms), t["step_id"]
        else:
            assert got == (None, None, None)
    assert tokens["slowest_layer"].null_count() < tokens.height
    return tokens


@pytest.mark.parametrize("preset", ["dense", "moe"])
def test_layer_times_split_each_step_on_llama_cpp_python(
    model_dir: Path, tmp_path: Path, preset: str
) -> None:
    """dense: the probe point is the GLU node's entry; moe (every FFN an expert FFN): the weighted
    multiply's, where the activations are read."""
    r = _record_llama(_model(model_dir, preset), tmp_path / "rec", max_tokens=12)
    assert r.meta["losses"]["layer_points_lost"] == 0
    check_slowest(r, check_layer_times(r))


def test_no_layer_times_leaves_the_table_out_and_the_tokens_exact(model_dir: Path, tmp_path: Path) -> None:
    """--no-layer-times: no layer_times rows, null slowest columns, the capture says so, and the
    tokens (ids and log-probs the engine computed) and routes are recorded as without it."""
    e = Engine([str(ENGINES / "llama_engine.py"), str(_model(model_dir, "moe")), "--threads", str(THREADS)])
    try:
        rec = Recorder(e.pid, tmp_path / "rec", "--no-layer-times")
        (truth,) = e.generate([PROMPT], max_tokens=12)
        rc, err = rec.stop(signal.SIGINT)
        assert rc == 0, err
    finally:
        e.close()
    r = sparseety_prof.open(tmp_path / "rec")
    assert r.meta["capture"]["layer_times"] is False
    assert r.table("layer_times").height == 0
    assert r.meta["losses"]["layer_points_lost"] == 0
    tokens = r.tokens().sort("decode_order")
    assert tokens["token_id"].to_list() == truth["ids"]
    assert tokens["log_prob"].to_list() == pytest.approx(truth["log_probs"], abs=1e-4)
    assert tokens["slowest_layer"].null_count() == tokens.height
    decode = tokens.filter(pl.col("phase") == "decode")
    assert decode.height == len(truth["ids"]) - 1
    assert decode["expert_ids"].null_count() == 0  # the sparse capture itself goes on


def test_threads_past_the_records_slots_are_counted_not_dropped(model_dir: Path, tmp_path: Path) -> None:
    """Two engine threads more than the aggregate record has slots for (sized to this host's
    CPUs): each of their probe points is counted in losses.layer_points_lost, exactly, and the
    slots' threads still split their steps."""
    slots = lt_threads_for(os.cpu_count())
    r = _record_llama(_model(model_dir, "dense"), tmp_path / "rec", max_tokens=8, threads=slots + 2)
    assert r.meta["record_layout"]["lt_threads"] == slots
    lt = check_layer_times(r, threads=slots)
    assert sorted(set(lt["thread"].to_list())) == list(range(slots))
    n_steps, n_layers = lt["step_id"].n_unique(), len(r.meta["layers"]["ffn"])
    assert r.meta["losses"]["layer_points_lost"] == 2 * n_layers * n_steps


def test_layer_times_split_each_step_on_llama_server(model_dir: Path, tmp_path: Path) -> None:
    model = _model(model_dir, "dense")
    e = Engine(
        [str(ENGINES / "server_engine.py"), str(model), "--port", str(free_port()), "--threads", str(THREADS)]
    )
    try:
        rec = Recorder(e.pid, tmp_path / "rec")
        body = {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(
            e.ready["url"] + "/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            assert resp.status == 200
        rc, err = rec.stop(signal.SIGTERM)
        assert rc == 0, err
    finally:
        e.close()
    r = sparseety_prof.open(tmp_path / "rec")
    assert r.meta["losses"]["layer_points_lost"] == 0
    check_slowest(r, check_layer_times(r))


def test_a_much_wider_layer_dominates_its_steps(model_dir: Path, tmp_path: Path) -> None:
    r = _record_llama(_model(model_dir, "wide_layer"), tmp_path / "rec", max_tokens=24)
    lt = check_layer_times(r)
    tokens = check_slowest(r, lt)
    slowest = (
        lt.drop_nulls("dur_ns")
        .group_by("step_id")
        .agg(pl.col("layer").sort_by("dur_ns").last().alias("layer"))["layer"]
        .to_list()
    )
    counts = Counter(slowest)
    assert counts.most_common(1)[0][0] == WIDE_LAYER, counts
    assert counts[WIDE_LAYER] * 2 > len(slowest), counts
    per_token = Counter(tokens["slowest_layer"].drop_nulls().to_list())
    assert per_token.most_common(1)[0][0] == WIDE_LAYER, per_token
