"""Root tests on a real llama-cpp-python engine process: attach by PID while it runs, generate,
and compare every recorded token with the engine's own ground truth from the same run."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from conftest import ENGINES, ROOT, Engine, Recorder, bpf_prog_ids, uprobe_events

import sparseety_prof

pytestmark = [pytest.mark.root, pytest.mark.engine]

PROMPTS = [
    "hello the expert router",
    "the sparse decode sample",
    "one two three",
    "token expert router decode",
    "what is the time",
]
LOGPROB_TOL = 1e-4  # the engine's own log-softmax of the same logits row


def point_label(p: dict[str, Any]) -> str:
    """How scripts/bare_traps.py names a probe point of meta.json `probes` in the runs it prints."""
    return f"{p['kind']} {p['symbol']} {Path(p['library']).name}+{int(p['address']):#x}"


def _by_request(tokens: pl.DataFrame) -> list[pl.DataFrame]:
    order = tokens.group_by("request_id", maintain_order=True).agg(pl.col("t_end_ns").min()).sort("t_end_ns")
    return [tokens.filter(pl.col("request_id") == r).sort("t_end_ns") for r in order["request_id"]]


@pytest.mark.parametrize("together", [False, True])
def test_tokens_match_engine_ground_truth(
    llama_engine: Engine, tmp_path: Path, models: dict[str, Path], together: bool
) -> None:
    """Every token field against the engine's own values; `together`: with `--correlate-every`
    (each drain's logits rows reduced as taken, drains correlated together)."""
    rec = Recorder(llama_engine.pid, tmp_path / "rec", *(["--correlate-every", "1"] if together else []))
    truth = llama_engine.generate(PROMPTS, max_tokens=220)
    rc, err = rec.stop(signal.SIGINT)
    assert rc == 0, err
    r = sparseety_prof.open(tmp_path / "rec")
    tokens = r.tokens()
    assert r.complete
    assert sum(len(t["ids"]) for t in truth) >= 1000
    assert tokens.height == sum(len(t["ids"]) for t in truth)

    requests = _by_request(tokens)
    assert len(requests) == len(PROMPTS)
    for got, want in zip(requests, truth, strict=True):
        n_prompt = len(want["prompt_tokens"])
        assert got["token_id"].to_list() == want["ids"]
        assert got["decode_order"].to_list() == list(range(len(want["ids"])))
        assert got["logits_pos"].to_list() == list(range(n_prompt - 1, n_prompt - 1 + len(want["ids"])))
        assert got["pos"].to_list() == [p + 1 for p in got["logits_pos"].to_list()]
        assert set(got["seq_id"].to_list()) == {0}
        assert got["phase"].to_list() == ["prefill"] + ["decode"] * (len(want["ids"]) - 1)
        assert not got["partial"].any()
        assert got["token_source"].unique().to_list() == ["sampler"]
        diff = np.abs(got["log_prob"].to_numpy() - np.array(want["log_probs"]))
        assert diff.max() < LOGPROB_TOL, diff.max()
        # the chosen greedy token is the top-1 alternative
        assert [t[0] for t in got["top_ids"].to_list()] == want["ids"]

    losses = r.meta["losses"]
    assert losses["kernel_drops"] == 0 and losses["seq_gaps"] == 0
    assert losses["logits_incomplete"] == 0 and losses["samples_unresolved"] == 0
    assert r.meta["verification"]["verified_decodes"] > 0
    # each token row points at its step, with the step's timing
    steps = r.steps()
    joined = tokens.join(steps, on="step_id", suffix="_step")
    assert joined.height == tokens.height
    assert (joined["t_start_ns"] == joined["t_start_ns_step"]).all()
    assert (joined["batch_size"] == joined["n_tokens"]).all()
    assert (tokens["t_end_ns"] >= tokens["t_start_ns"]).all()
    # token text comes from the model's vocabulary
    assert tokens["token_text"].null_count() == 0
    meta = r.meta
    assert meta["engine"]["name"] == "llama-cpp-python"
    # hashed through the engine's own mapping of the file
    assert meta["model"]["sha256"] == hashlib.sha256(models["moe"].read_bytes()).hexdigest()
    assert meta["target"]["pid"] == llama_engine.pid
    consumer = meta["consumer"]
    assert consumer["correlate_every_s"] == (1 if together else 0)
    assert consumer["logits_token_mismatch"] == 0
    assert consumer["polars_threads"] == 1  # the CLI's default (session/thread_pools.py)
    assert consumer["ring_watch"] == "native"  # the watch's thread in C (ringwatch.c), built by setup
    # the watch reads the ring on its own only after a producer woke it (ring_watch.py)
    assert consumer["ring_watch_polls"] == 0 or consumer["ring_watch_wakeups"] > 0
    if together:  # no more correlations than drains (the drains of 1 s together)
        assert 0 < consumer["correlations"] <= consumer["drains"]


def test_output_identical_with_and_without_profiler(models: dict[str, Path], tmp_path: Path) -> None:
    prompts = PROMPTS[:3]
    plain = Engine([str(ENGINES / "llama_engine.py"), str(models["moe"])])
    try:
        want = plain.generate(prompts, max_tokens=48, temp=0.8, seed=7)
    finally:
        plain.close()
    traced = Engine([str(ENGINES / "llama_engine.py"), str(models["moe"])])
    try:
        rec = Recorder(traced.pid, tmp_path / "rec")
        got = traced.generate(prompts, max_tokens=48, temp=0.8, seed=7)
        rc, err = rec.stop()
        assert rc == 0, err
    finally:
        traced.close()
    assert [g["ids"] for g in got] == [w["ids"] for w in want]
    assert [g["log_probs"] for g in got] == [w["log_probs"] for w in want]
    # sampled (not greedy) tokens are still exactly what the engine chose
    recorded = _by_request(sparseety_prof.open(tmp_path / "rec").tokens())
    assert [r["token_id"].to_list() for r in recorded] == [g["ids"] for g in got]


def test_attach_mid_request_marks_rows_partial(models: dict[str, Path], tmp_path: Path) -> None:
    e = Engine([str(ENGINES / "llama_engine.py"), str(models["moe"]), "--n-ctx", "8192"])
    try:
        # the request runs until the recorder is attached and has seen some of its tokens,
        # however long attaching takes on a loaded machine (it ends at 8,000 tokens otherwise)
        stop = tmp_path / "stop-generating"
        e.send(
            {
                "prompts": ["hello the expert router"],
                "max_tokens": 8000,
                "temp": 0.0,
                "token_delay": 0.01,
                "stop_file": str(stop),
            }
        )
        time.sleep(0.3)  # the request is running now
        rec = Recorder(e.pid, tmp_path / "rec")
        time.sleep(1.0)
        stop.touch()
        first = e.read(timeout=300)["results"]
        assert len(first[0]["ids"]) < 8000, "the request ended before the recorder attached"
        nxt = e.generate(["one two three"], max_tokens=20)
        rc, err = rec.stop()
        assert rc == 0, err
    finally:
        e.close()
    reqs = _by_request(sparseety_prof.open(tmp_path / "rec").tokens())
    assert len(reqs) == 2
    running, fresh = reqs
    assert running["partial"].all() and running["decode_order"].null_count() == running.height
    # the partial rows are the tail of what the engine generated, token for token
    assert running["token_id"].to_list() == first[0]["ids"][-running.height :]
    assert not fresh["partial"].any()
    assert fresh["decode_order"].to_list() == list(range(20))
    assert fresh["token_id"].to_list() == nxt[0]["ids"]


def _assert_nothing_left(before: set[int]) -> None:
    # programs of other tools may come and go; ours must all be gone
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and bpf_prog_ids() - before:
        time.sleep(0.2)
    assert not (bpf_prog_ids() - before), "BPF programs left loaded"
    assert "sparseety" not in uprobe_events() and "p__" not in uprobe_events()


@pytest.mark.parametrize("kind", ["drain", "logits"])
def test_ablated_consumer_discards_after_its_start_up_work(
    models: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    """--ablate-consumer (the probes' cost alone, scripts/bench_sustained.py): the start-up work is
    recorded as usual, then every record is drained and dropped, counted in meta.json; the engine's
    output is unchanged and nothing stays attached. `logits` (the floor under a full-mode
    consumer) reduces each generated token's logits row before the discard."""
    before = bpf_prog_ids()
    e = Engine([str(ENGINES / "llama_engine.py"), str(models["moe"])])
    try:
        base = e.generate(PROMPTS[:2], max_tokens=64)
        flag = "--ablate-consumer" if kind == "drain" else f"--ablate-consumer={kind}"
        rec = Recorder(e.pid, tmp_path / "rec", flag)
        started = []  # requests until the start-up work is done (the attention map learned)
        for _ in range(20):
            started += e.generate(PROMPTS[:2], max_tokens=64)
            try:
                line = rec.wait_for("from now on its records are drained and discarded", timeout=2)
                break
            except TimeoutError:
                continue
        else:
            raise AssertionError("the recorder never began discarding")
        during = e.generate(PROMPTS[:2] * 2, max_tokens=64)
        rc, err = rec.stop(signal.SIGINT)
        assert rc == 0, err
        for got in (started[:2], during[:2], during[2:]):
            _assert_same_output(got, base)
    finally:
        e.close()
    _assert_nothing_left(before)
    r = sparseety_prof.open(tmp_path / "rec")
    assert r.complete
    ablated = r.meta["consumer"]["ablated"]
    assert ablated["began_after_s"] is not None and ablated["drains"] > 0
    assert ablated["records_discarded"] > 0 and ablated["bytes_discarded"] > 0
    tokens = r.tokens()
    # the start-up work's rows, then nothing
    assert 0 < tokens.height <= sum(len(t["ids"]) for t in started)
    assert f"({tokens.height} tokens recorded)" in line
    # every probe point of this build sits on an instruction the kernel emulates (no single-step)
    uprobes = [p for p in r.meta["probes"] if p["kind"] in ("entry", "return")]
    assert uprobes and all(p["emulated"] for p in uprobes), uprobes
    # the graph-op attention probes were detached before the discarding began
    assert r.meta["attention_masks"]["mask_read"] == "set_input_kq_mask"
    losses = r.meta["losses"]
    assert losses["kernel_drops"] == 0 and losses["seq_gaps"] == 0
    assert losses["records_seen"] >= ablated["records_discarded"]
    assert ablated["kind"] == kind
    if kind == "drain":
        assert ablated["logits_rows_reduced"] == 0
    else:  # one row per token sampled after the discarding began: every one of `during`'s
        after = sum(len(t["ids"]) for t in during)
        assert after <= ablated["logits_rows_reduced"] <= after + sum(len(t["ids"]) for t in started)
        assert r.meta["consumer"]["cpu_s_by_stage"]["logits"] > 0


def test_bare_traps_trap_at_the_recorders_points_and_change_nothing(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """scripts/bare_traps.py (scripts/bench_sustained.py --bare-traps, the traps' cost alone): a
    no-op program at each probe point a recording kept, each trapping as often as the recorder's
    own program there; the engine's output is unchanged and nothing stays attached."""
    before = bpf_prog_ids()
    e = Engine([str(ENGINES / "llama_engine.py"), str(models["moe"])])
    try:
        base = e.generate(PROMPTS[:2], max_tokens=48)
        # a recording long enough for the graph-op probes to go: the probe set a recording keeps
        rec = Recorder(e.pid, tmp_path / "rec", "--bpf-stats")
        for _ in range(20):
            e.generate(PROMPTS[:2], max_tokens=48)
            try:
                rec.wait_for("graph-op probes detached", timeout=2)
                break
            except TimeoutError:
                continue
        else:
            raise AssertionError("the recorder never detached its graph-op probes")
        rc, err = rec.stop(signal.SIGINT)
        assert rc == 0, err
        meta = sparseety_prof.open(tmp_path / "rec").meta
        # meta.json lists every point attached; the graph-op ones say they were detached
        kept = [p for p in meta["probes"] if not p["detached"]]
        gone = {p["symbol"] for p in meta["probes"] if p["detached"]}
        assert gone and gone <= {"ggml_compute_forward_soft_max", "ggml_compute_forward_flash_attn_ext"}
        cmd = [sys.executable, str(ROOT / "scripts" / "bare_traps.py"), "--pid", str(e.pid)]
        bare = subprocess.Popen(
            [*cmd, "--probes", str(tmp_path / "rec" / "meta.json"), "--stats"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert bare.stderr is not None
        line = bare.stderr.readline()
        assert f"attached to PID {e.pid} ({len(kept)} points, no-op programs)" in line, line
        during = e.generate(PROMPTS[:2], max_tokens=48)
        bare.send_signal(signal.SIGINT)
        out, err = bare.communicate(timeout=60)
        assert bare.returncode == 0, err
        _assert_same_output(during, base)
    finally:
        e.close()
    _assert_nothing_left(before)
    runs = json.loads(out.splitlines()[-1])["runs"]
    assert len(runs) == len(kept), runs
    # each program's points trap as often per token as the recorder's program there ran per token
    # of its own recording (the same requests; its runs from --bpf-stats)
    n_tokens = sum(len(t["ids"]) for t in during)
    bare_runs: dict[str, int] = {}
    for p in kept:
        bare_runs[p["program"]] = bare_runs.get(p["program"], 0) + runs[point_label(p)]
    recorded = meta["bpf_programs"]["programs"]
    assert {"moe_mul_enter", "logits_enter", "kvmask_enter"} <= set(bare_runs)
    for prog, n in bare_runs.items():  # (a cache-clearing call may not come at all: 0 and 0)
        want = recorded.get(prog, {"runs": 0})["runs"] / meta["counts"]["tokens"]
        assert n / n_tokens == pytest.approx(want, rel=0.25, abs=0.02), (prog, n, recorded.get(prog))


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGKILL", "target-exit"])
def test_detach_leaves_nothing_behind(models: dict[str, Path], tmp_path: Path, how: str) -> None:
    before = bpf_prog_ids()
    e = Engine([str(ENGINES / "llama_engine.py"), str(models["moe"])])
    try:
        base = e.generate(["hello the expert router"], max_tokens=16)
        rec = Recorder(e.pid, tmp_path / "rec")
        assert bpf_prog_ids() - before, "the recorder should have loaded programs"
        during = e.generate(["hello the expert router"], max_tokens=16)
        if how == "target-exit":
            e.close()
            rc, err = _wait(rec)
            assert rc == 0, err
            assert "target exited" in err
        else:
            rc, err = rec.stop(getattr(signal, how))
            if how == "SIGKILL":
                assert rc == -signal.SIGKILL
            else:
                assert rc == 0, err
                assert how in err
            after = e.generate(["hello the expert router"], max_tokens=16)
            _assert_same_output(after, base)  # the engine is undisturbed
        _assert_same_output(during, base)
    finally:
        e.close()
    _assert_nothing_left(before)
    if how != "SIGKILL":
        r = sparseety_prof.open(tmp_path / "rec")
        assert r.complete and r.tokens().height == 16


def test_two_recorders_on_one_engine_both_record_exactly(models: dict[str, Path], tmp_path: Path) -> None:
    """A second recorder on an engine that already has one is safe: each has its own programs,
    ring and probes (the kernel runs every program attached to a probe point), both recordings
    equal the engine's output, and stopping one leaves the other recording."""
    before = bpf_prog_ids()
    e = Engine([str(ENGINES / "llama_engine.py"), str(models["moe"])])
    try:
        first = Recorder(e.pid, tmp_path / "first")
        second = Recorder(e.pid, tmp_path / "second")
        both = e.generate(PROMPTS[:2], max_tokens=24)
        rc, err = first.stop(signal.SIGINT)
        assert rc == 0, err
        only_second = e.generate(PROMPTS[2:3], max_tokens=24)
        rc, err = second.stop(signal.SIGINT)
        assert rc == 0, err
    finally:
        e.close()
    _assert_nothing_left(before)
    for name, truth in (("first", both), ("second", both + only_second)):
        r = sparseety_prof.open(tmp_path / name)
        tokens = r.tokens()
        got = [g["token_id"].to_list() for g in _by_request(tokens)]
        assert got == [t["ids"] for t in truth], name
        losses = r.meta["losses"]
        assert losses["kernel_drops"] == 0 and losses["seq_gaps"] == 0 and losses["samples_unresolved"] == 0


def _assert_same_output(got: list[dict], want: list[dict]) -> None:
    # A repeated prompt hits llama-cpp-python's prefix cache, so the prompt is evaluated in another
    # batch shape: ids are equal, log-probs agree to float rounding.
    assert [g["ids"] for g in got] == [w["ids"] for w in want]
    for g, w in zip(got, want, strict=True):
        assert np.allclose(g["log_probs"], w["log_probs"], atol=1e-4)


def _wait(rec: Recorder) -> tuple[int, str]:
    return rec.wait(timeout=30)


def test_recording_files_private(
    llama_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # as if run through sudo by user 65534: the recording must belong to that user
    monkeypatch.setenv("SUDO_UID", "65534")
    monkeypatch.setenv("SUDO_GID", "65534")
    rec = Recorder(llama_engine.pid, tmp_path / "rec", "--redact-text")
    llama_engine.generate(["hello"], max_tokens=8)
    rc, err = rec.stop()
    assert rc == 0, err
    for p in [tmp_path / "rec", *(tmp_path / "rec").rglob("*")]:
        mode = p.stat().st_mode & 0o777
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))
    r = sparseety_prof.open(tmp_path / "rec")
    t = r.tokens()
    assert t.height == 8 and t["token_text"].null_count() == 8 and t["token_id"].null_count() == 0
    for p in [tmp_path / "rec", *(tmp_path / "rec").rglob("*")]:
        st = os.stat(p)
        assert (st.st_uid, st.st_gid) == (65534, 65534), p


@pytest.mark.parametrize("together", [False, True])
def test_large_vocabulary_rows_split_over_several_records(tmp_path: Path, together: bool) -> None:
    """A 40,000-entry vocabulary: each logits row crosses the ring buffer as three records (two
    full, one partial); reassembled, the statistics are still exact (also reduced as drained,
    `together`)."""
    from conftest import make_model

    model = make_model(tmp_path / "bigvocab.gguf", "moe", n_vocab_min=40_000)
    e = Engine([str(ENGINES / "llama_engine.py"), str(model)])
    try:
        assert e.ready["n_vocab"] >= 40_000
        rec = Recorder(e.pid, tmp_path / "rec", *(["--correlate-every", "1"] if together else []))
        truth = e.generate(PROMPTS[:2], max_tokens=40)
        rc, err = rec.stop()
        assert rc == 0, err
    finally:
        e.close()
    r = sparseety_prof.open(tmp_path / "rec")
    reqs = _by_request(r.tokens())
    assert [g["token_id"].to_list() for g in reqs] == [t["ids"] for t in truth]
    for got, want in zip(reqs, truth, strict=True):
        diff = np.abs(got["log_prob"].to_numpy() - np.array(want["log_probs"]))
        assert diff.max() < LOGPROB_TOL
    assert r.meta["losses"]["logits_incomplete"] == 0


def _record_long_prompt(model: Path, tmp_path: Path, *engine_args: str) -> list[dict]:
    """Record a 1,600-token prompt and 16 generated tokens into tmp_path/rec; the engine's truth."""
    e = Engine([str(ENGINES / "llama_engine.py"), str(model), "--n-ctx", "2048", *engine_args])
    try:
        rec = Recorder(e.pid, tmp_path / "rec")
        truth = e.generate(["hello the expert router " * 400], max_tokens=16)
        rc, err = rec.stop()
        assert rc == 0, err
    finally:
        e.close()
    return truth


def test_micro_batch_larger_than_the_probe_copies(models: dict[str, Path], tmp_path: Path) -> None:
    """A 1,600-token prompt in one 2,048-row micro-batch: the probe copies the last 1,024 rows,
    where the logits row is, so the first token is still exact and nothing is lost silently."""
    truth = _record_long_prompt(models["moe"], tmp_path, "--n-batch", "2048")
    n_prompt = len(truth[0]["prompt_tokens"])
    assert n_prompt > 1024
    r = sparseety_prof.open(tmp_path / "rec")
    tok = r.tokens()
    assert tok["token_id"].to_list() == truth[0]["ids"]
    assert tok["decode_order"].to_list() == list(range(16))
    assert tok["logits_pos"][0] == n_prompt - 1
    assert np.abs(tok["log_prob"].to_numpy() - np.array(truth[0]["log_probs"])).max() < LOGPROB_TOL
    first = r.steps().row(0, named=True)
    assert first["truncated"] and first["n_tokens"] == n_prompt and len(first["positions"]) == 1024
    assert first["positions"][-1] == n_prompt - 1 and first["output_rows"][-1] == n_prompt - 1
    assert r.meta["losses"]["ubatch_rows_not_copied"] == n_prompt - 1024
    assert r.meta["losses"]["samples_unresolved"] == 0


def test_long_prompt_over_several_decode_calls(models: dict[str, Path], tmp_path: Path) -> None:
    """llama-cpp-python evaluates a 1,600-token prompt as four decode calls of <= 512 tokens: one
    request, and the first token comes from the last row of the last one."""
    truth = _record_long_prompt(models["moe"], tmp_path)
    n_prompt = len(truth[0]["prompt_tokens"])
    r = sparseety_prof.open(tmp_path / "rec")
    tok, steps = r.tokens(), r.steps()
    assert tok["request_id"].n_unique() == 1
    assert tok["token_id"].to_list() == truth[0]["ids"]
    assert tok["logits_pos"][0] == n_prompt - 1 and tok["decode_order"].to_list() == list(range(16))
    prompt_steps = steps.filter(pl.col("phase") == "prefill")
    assert prompt_steps["n_tokens"].sum() == n_prompt and prompt_steps.height == -(-n_prompt // 512)
    assert prompt_steps["decode_id"].n_unique() == prompt_steps.height
    assert not steps["truncated"].any()
