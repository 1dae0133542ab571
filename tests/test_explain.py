"""`report DIR --explain REQUEST[:DECODE_ORDER]` (views/explain.py, views/explain_print.py): on a
recording written through the real writer, the values printed and in --json are the recording's
own rows; the timing tables say in words when they are absent; strings from the recording are
escaped; on a real engine's recording, the token, its step and its decisions equal its frames."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from conftest import Engine, Recorder, run_cli

import sparseety_prof
from sparseety_prof.store import schema
from sparseety_prof.store.recording_writer import RecordingWriter
from sparseety_prof.views.explain import TIME_TABLES, TokenRef, parse_token_ref, table_state

MS = 1_000_000
ENV = {"COLUMNS": "200", "PATH": "/usr/bin:/bin"}
EVIL = "\x1b]0;title\x07\u202e"


#: cpu_stacks rows: (step_id, step_kind, tid, stack, samples); steps 1 and 2 are decode steps
STACKS = [
    (0, "prompt", 77, "main;ggml_graph_compute;ggml_vec_dot_q4", 40),
    (1, "decode", 77, "main;ggml_graph_compute;ggml_vec_dot_f16", 3),
    (1, "decode", 78, "start_thread;ggml_barrier", 2),
    (2, "decode", 77, "main;ggml_graph_compute;ggml_vec_dot_f16", 4),
    (2, "decode", 78, "start_thread;ggml_barrier", 6),
    (None, "between_steps", 77, "main;poll", 9),
]
#: op_times rows of step 1: (thread, node, op, name, dur_ns), two threads
OP_ROWS = [
    (0, 0, "MUL_MAT", "Qcur-0", 50_000),
    (1, 0, "MUL_MAT", "Qcur-0", 60_000),
    (0, 1, "ADD", "ffn_inp-0", 5_000),
    (1, 1, "ADD", "ffn_inp-0", 4_000),
    (0, 2, "MUL_MAT", "kq-0", 30_000),
    (1, 2, "MUL_MAT", "kq-0", 20_000),
]
#: layer_times rows of step 1: (layer, thread, dur_ns, lag_ns); thread 1 came late to layer 3
LAYER_ROWS = [
    (0, 0, None, 0),
    (0, 1, None, 20_000),
    (1, 0, 300_000, 0),
    (1, 1, 310_000, 10_000),
    (3, 0, 250_000, 0),
    (3, 1, 400_000, 150_000),
]


def _recording(
    path: Path,
    *,
    request: str = "chat:1",
    text2: str = " world",
    stacks: bool = False,
    layers: bool = False,
    ops: bool = False,
) -> None:
    """Three steps: a prompt and two decode steps; the request's third token waited longest."""
    meta = {"engine": {"name": "llama-cpp-python"}, "layers": {"moe": [1, 3], "ffn": [0, 1, 3], "attn": [0]}}
    w = RecordingWriter(path, meta)
    tables: dict[str, dict[str, list[object]]] = {
        "steps": {
            "step_id": [0, 1, 2],
            "t_start_ns": [0, 10 * MS, 20 * MS],
            "t_end_ns": [5 * MS, 11 * MS, 27 * MS],
            "phase": ["prefill", "decode", "decode"],
            "n_tokens": [4, 1, 1],
            "prompt_rows": [4, 0, 0],
            "decode_rows": [0, 1, 1],
            "seq_ids": [[0], [0], [0]],
            "tid": [77, 77, 77],
        },
        "tokens": {
            "request_id": [request] * 3,
            "decode_order": [0, 1, 2],
            "phase": ["prefill", "decode", "decode"],
            "pos": [4, 5, 6],
            "token_id": [11, 12, 13],
            "token_text": ["hello", text2, "!"],
            "log_prob": [-0.25, -1.5, -2.75],
            "entropy": [0.5, 1.0, 2.0],
            "top_ids": [[11, 12], [12, 11], [12, 13]],
            "top_log_probs": [[-0.25, -2.0], [-1.5, -1.75], [-0.5, -2.75]],
            "step_id": [0, 1, 2],
            "t_end_ns": [5 * MS, 11 * MS, 27 * MS],
            "partial": [False] * 3,
            "expert_ids": [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 7], [0, 6]]],
            "expert_weights": [[[0.75, 0.25], [0.5, 0.5]]] * 3,
            "act_zero_ratio": [[0.1, 0.2, 0.3]] * 3,
            "act_below_ratio": [[0.15, 0.25, 0.35]] * 3,
            "attn_attended": [[5], [6], [7]],
        },
    }
    if stacks:
        tables["cpu_stacks"] = {
            "step_id": [r[0] for r in STACKS],
            "step_kind": [r[1] for r in STACKS],
            "tid": [r[2] for r in STACKS],
            "stack": [r[3] for r in STACKS],
            "samples": [r[4] for r in STACKS],
        }
    if ops:
        tables["op_times"] = {
            "step_id": [1] * len(OP_ROWS),
            "tid": [77 + r[0] for r in OP_ROWS],
            "thread": [r[0] for r in OP_ROWS],
            "node": [r[1] for r in OP_ROWS],
            "op": [r[2] for r in OP_ROWS],
            "name": [r[3] for r in OP_ROWS],
            "layer": [0] * len(OP_ROWS),
            "t_start_ns": [10 * MS + 100_000 * r[1] for r in OP_ROWS],
            "dur_ns": [r[4] for r in OP_ROWS],
        }
    if layers:
        tables["layer_times"] = {
            "step_id": [1] * len(LAYER_ROWS),
            "layer": [r[0] for r in LAYER_ROWS],
            "thread": [r[1] for r in LAYER_ROWS],
            "tid": [77 + r[1] for r in LAYER_ROWS],
            "t_ns": [10 * MS + i for i in range(len(LAYER_ROWS))],
            "dur_ns": [r[2] for r in LAYER_ROWS],
            "lag_ns": [r[3] for r in LAYER_ROWS],
        }
    for table, cols in tables.items():
        w.append(table, schema.frame(table, cols, absent=schema.TABLES[table].keys() - cols.keys()))
    w.close(losses={"kernel_drops": 0, "seq_gaps": 0})


def _json(rec: Path, which: str) -> dict[str, Any]:
    r = run_cli("report", str(rec), "--explain", which, "--json", env=ENV)
    assert r.returncode == 0, r.stderr
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def test_a_request_id_with_a_colon_is_read_whole_when_it_is_one() -> None:
    assert parse_token_ref("chat:1", {"chat:1"}) == TokenRef("chat:1", None)
    assert parse_token_ref("chat:1:4", {"chat:1"}) == TokenRef("chat:1", 4)
    assert parse_token_ref("r0-0-1", set()) == TokenRef("r0-0-1", None)
    assert parse_token_ref("abc:x", set()) == TokenRef("abc:x", None)


def test_the_token_asked_for_is_explained_with_its_decisions_on_their_layers(tmp_path: Path) -> None:
    _recording(tmp_path / "rec")
    e = _json(tmp_path / "rec", "chat:1:1")
    assert e["chosen"] == "asked"
    t = e["token"]
    assert (t["request_id"], t["decode_order"], t["token_id"], t["token_text"]) == ("chat:1", 1, 12, " world")
    assert t["log_prob"] == -1.5 and t["step_id"] == 1
    assert t["step_ms"] == pytest.approx(1.0) and t["gap_ms"] == pytest.approx(6.0)
    assert [(a["token_id"], a["log_prob"], a["token_text"]) for a in e["alternatives"]] == [
        (12, -1.5, " world"),
        (11, -1.75, "hello"),
    ]
    by_layer = {d["layer"]: d for d in e["decisions"]}
    assert sorted(by_layer) == [0, 1, 3]
    assert by_layer[1]["expert_ids"] == [4, 5] and by_layer[3]["expert_ids"] == [6, 7]
    assert by_layer[0]["act_zero_ratio"] == pytest.approx(0.1) and by_layer[0]["attn_attended"] == 6
    assert "expert_ids" not in by_layer[0]
    assert e["step"]["n_tokens"] == 1 and e["step"]["tid"] == 77


def test_without_a_decode_order_the_slowest_token_is_explained(tmp_path: Path) -> None:
    _recording(tmp_path / "rec")
    e = _json(tmp_path / "rec", "chat:1")
    assert e["chosen"] == "slowest"
    assert e["token"]["decode_order"] == 2 and e["token"]["gap_ms"] == pytest.approx(16.0)
    r = run_cli("report", str(tmp_path / "rec"), "--explain", "chat:1", env=ENV)
    assert r.returncode == 0, r.stderr
    assert "token 2 (the request's slowest): '!' id 13" in r.stdout
    assert "gap 16.00 ms" in r.stdout and "step 2 7.00 ms" in r.stdout
    assert re.search(r"│ 3 +│ \[0, 6\] +│ \[0\.50, 0\.50\]", r.stdout)


def test_an_unknown_request_or_decode_order_is_a_usage_error_naming_what_is_there(tmp_path: Path) -> None:
    _recording(tmp_path / "rec")
    r = run_cli("report", str(tmp_path / "rec"), "--explain", "nope", env=ENV)
    assert r.returncode == 2 and "no request 'nope'" in r.stderr and "'chat:1'" in r.stderr
    r = run_cli("report", str(tmp_path / "rec"), "--explain", "chat:1:9", env=ENV)
    assert r.returncode == 2 and "decode orders: 0 to 2" in r.stderr
    r = run_cli("report", str(tmp_path / "rec"), "--explain", "chat:1", "--anomalies", env=ENV)
    assert r.returncode == 2


def test_each_timing_table_says_in_words_when_it_has_nothing_to_show(tmp_path: Path) -> None:
    _recording(tmp_path / "rec")
    rec = sparseety_prof.open(tmp_path / "rec")
    # the three states on tables whose presence the test controls
    assert table_state(rec, "no_such_table") == (
        "unknown",
        "no_such_table: this version of sparseety-prof has no no_such_table table",
    )
    assert (
        table_state(rec, "kernels")[0] == "empty"
        and "no rows in this recording" in table_state(rec, "kernels")[1]
    )
    del rec.meta["tables"]["kernels"]
    assert table_state(rec, "kernels") == (
        "absent",
        "kernels: not in this recording (it was written by a version of sparseety-prof without the "
        "kernels table)",
    )
    # a recording with no timing rows: every timing table's part is its sentence
    e = _json(tmp_path / "rec", "chat:1:1")
    r = run_cli("report", str(tmp_path / "rec"), "--explain", "chat:1:1", env=ENV)
    fresh = sparseety_prof.open(tmp_path / "rec")
    for name in TIME_TABLES:
        state, sentence = table_state(fresh, name)
        assert state in ("unknown", "empty"), name  # the writer lists every table it knows
        assert e["timing"][name] == {"table": name, "state": state, "note": sentence, "rows": []}
        assert sentence in r.stdout


def test_the_hottest_functions_are_those_of_the_token_s_step_kind(tmp_path: Path) -> None:
    _recording(tmp_path / "rec", stacks=True)
    section = _json(tmp_path / "rec", "chat:1:1")["timing"]["cpu_stacks"]
    assert section["state"] == "rows" and section["step_kind"] == "decode"
    # by hand: the decode steps' samples per innermost frame
    decode = [r for r in STACKS if r[1] == "decode"]
    total = sum(r[4] for r in decode)
    by_leaf: dict[str, int] = {}
    for row in decode:
        leaf = row[3].split(";")[-1]
        by_leaf[leaf] = by_leaf.get(leaf, 0) + row[4]
    assert section["kind_samples"] == total and section["step_samples"] == 5
    assert [(f["function"], f["samples"]) for f in section["rows"]] == sorted(
        by_leaf.items(), key=lambda kv: -kv[1]
    )
    assert section["rows"][0]["share"] == pytest.approx(8 / total)
    r = run_cli("report", str(tmp_path / "rec"), "--explain", "chat:1:1", env=ENV)
    assert "cpu_stacks: hottest functions of decode steps (15 samples, 5 in this step)" in r.stdout
    assert re.search(r"│ ggml_barrier +│ 8 +│ 0\.533 +│", r.stdout)
    # the prompt token: the prompt step's functions only
    prompt = _json(tmp_path / "rec", "chat:1:0")["timing"]["cpu_stacks"]
    assert [(f["function"], f["samples"]) for f in prompt["rows"]] == [("ggml_vec_dot_q4", 40)]


def test_the_step_s_layer_times_are_shown_by_layer_and_thread(tmp_path: Path) -> None:
    _recording(tmp_path / "rec", layers=True)
    section = _json(tmp_path / "rec", "chat:1:1")["timing"]["layer_times"]
    assert section["state"] == "rows" and len(section["rows"]) == len(LAYER_ROWS)
    assert section["rows"][0]["dur_ns"] == 400_000  # the longest first
    assert section["by_layer"] == [
        {"layer": 0, "thread 0 ms": None, "thread 1 ms": None, "lag ms": pytest.approx(0.02)},
        {"layer": 1, "thread 0 ms": pytest.approx(0.3), "thread 1 ms": pytest.approx(0.31), "lag ms": 0.01},
        {"layer": 3, "thread 0 ms": 0.25, "thread 1 ms": pytest.approx(0.4), "lag ms": pytest.approx(0.15)},
    ]
    out = run_cli("report", str(tmp_path / "rec"), "--explain", "chat:1:1", env=ENV).stdout
    assert re.search(r"│ 3 +│ 0\.250 +│ 0\.400 +│ 0\.150 +│", out)
    # another step of the same request: none of its rows, said so
    other = _json(tmp_path / "rec", "chat:1:2")["timing"]["layer_times"]
    assert (
        other["rows"] == []
        and other["note"] == "layer_times: no rows for step 2 (its capture was not on then)"
    )


def test_the_step_s_operators_are_summed_over_threads(tmp_path: Path) -> None:
    _recording(tmp_path / "rec", ops=True)
    section = _json(tmp_path / "rec", "chat:1:1")["timing"]["op_times"]
    assert section["state"] == "rows" and [r["dur_ns"] for r in section["rows"]] == sorted(
        (r[4] for r in OP_ROWS), reverse=True
    )
    by_op = {r["op"]: r for r in section["by_op"]}
    assert list(by_op) == ["MUL_MAT", "ADD"]  # the larger total first
    assert by_op["MUL_MAT"]["nodes"] == 2 and by_op["ADD"]["nodes"] == 1
    assert by_op["MUL_MAT"]["total ms"] == pytest.approx(0.16)
    assert by_op["MUL_MAT"]["longest ms"] == pytest.approx(0.06)
    out = run_cli("report", str(tmp_path / "rec"), "--explain", "chat:1:1", env=ENV).stdout
    assert "op_times by operator" in out
    assert re.search(r"│ MUL_MAT +│ 2 +│ 0\.160 +│ 0\.060 +│", out)
    # instants from the step's start (step 1 began at 10 ms); the longest row first
    assert re.search(r"│ - +│ 78 +│ 1 +│ 0 +│ MUL_MAT +│ Qcur-0 +│ 0 +│ 0\.000 +│ 0\.060 +│", out)


def test_strings_from_the_recording_are_escaped(tmp_path: Path) -> None:
    _recording(tmp_path / "rec", request="r" + EVIL, text2="t" + EVIL)
    r = run_cli("report", str(tmp_path / "rec"), "--explain", "r" + EVIL + ":1", env=ENV)
    assert r.returncode == 0, r.stderr
    for raw in ("\x1b]", "\x07", "\u202e"):
        assert raw not in r.stdout
    assert "\\x1b]0;title\\x07\\u202e" in r.stdout
    j = run_cli("report", str(tmp_path / "rec"), "--explain", "r" + EVIL + ":1", "--json", env=ENV)
    assert "\u202e" not in j.stdout and json.loads(j.stdout)["token"]["token_text"] == "t" + EVIL


PROMPTS = ["hello the expert router", "one two three four"]


@pytest.mark.root
@pytest.mark.engine
def test_a_real_recording_explains_its_tokens_with_their_own_rows(
    llama_engine: Engine, tmp_path: Path
) -> None:
    out = tmp_path / "rec"
    rec = Recorder(llama_engine.pid, out, "--trace-ops", "60s/120s")  # every step traced
    truth = llama_engine.generate(PROMPTS, max_tokens=12)
    rc, err = rec.stop(signal.SIGINT)
    assert rc == 0, err
    r = sparseety_prof.open(out)
    tokens, steps = r.tokens(), r.steps()
    assert tokens.height == sum(len(t["ids"]) for t in truth)
    layers = {k: v for k, v in r.meta["layers"].items() if isinstance(v, list)}
    request = tokens["request_id"][0]
    mine = tokens.filter(pl.col("request_id") == request).sort("decode_order")
    for order in (0, mine.height // 2, mine.height - 1):
        row = mine.filter(pl.col("decode_order") == order).row(0, named=True)
        e = _json(out, f"{request}:{order}")
        t = e["token"]
        assert (t["token_id"], t["step_id"], t["pos"]) == (row["token_id"], row["step_id"], row["pos"])
        assert t["log_prob"] == pytest.approx(row["log_prob"])
        step = steps.filter(pl.col("step_id") == row["step_id"]).row(0, named=True)
        assert e["step"]["n_tokens"] == step["n_tokens"]
        assert t["step_ms"] == pytest.approx((step["t_end_ns"] - step["t_start_ns"]) / MS)
        assert [a["token_id"] for a in e["alternatives"]] == row["top_ids"]
        got = {d["layer"]: d.get("expert_ids") for d in e["decisions"] if "expert_ids" in d}
        assert got == dict(zip(layers["moe"], row["expert_ids"], strict=True))
        assert got, "the MoE model's tokens have routes"
        # the step's operators: its op_times rows, summed by hand
        ops = r.table("op_times").filter(pl.col("step_id") == row["step_id"])
        section = e["timing"]["op_times"]
        assert ops.height and len(section["rows"]) == ops.height
        by_hand: dict[str, float] = {}
        for op, dur in zip(ops["op"], ops["dur_ns"], strict=True):
            by_hand[op] = by_hand.get(op, 0.0) + dur / MS
        assert {x["op"]: pytest.approx(x["total ms"]) for x in section["by_op"]} == by_hand
        # its layer times where the step has them (one-row steps), as a layer x thread grid
        if table_state(r, "layer_times")[0] == "rows":
            lt = r.table("layer_times").filter(pl.col("step_id") == row["step_id"])
            grid = {g["layer"]: g for g in e["timing"]["layer_times"].get("by_layer", [])}
            for x in lt.filter(pl.col("dur_ns").is_not_null()).iter_rows(named=True):
                cells = lt.filter((pl.col("layer") == x["layer"]) & (pl.col("thread") == x["thread"]))
                assert grid[x["layer"]][f"thread {x['thread']} ms"] == pytest.approx(
                    cells["dur_ns"].sum() / MS
                )
    # without a decode order: the token with the longest gap
    gaps = mine.sort("t_end_ns").with_columns(pl.col("t_end_ns").diff().alias("gap"))
    slowest = gaps.sort("gap", descending=True, nulls_last=True).row(0, named=True)
    assert _json(out, request)["token"]["decode_order"] == slowest["decode_order"]
    screen = run_cli("report", str(out), "--explain", request, env=ENV)
    assert screen.returncode == 0, screen.stderr
    assert f"token {slowest['decode_order']} (the request's slowest)" in screen.stdout
    for name in TIME_TABLES:
        state, sentence = table_state(r, name)
        if state != "rows":
            assert sentence in screen.stdout
