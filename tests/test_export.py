"""`sparseety-prof export`: the perfetto (Chrome trace-event JSON) and jsonl exports, parsed back and
compared with the recording they came from (counts, ids, exact times, flows, names)."""

from __future__ import annotations

import json
import os
import signal
import stat
from collections import defaultdict
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from conftest import Engine, Recorder
from test_recording import META, steps_frame, tokens_frame

import sparseety_prof
from sparseety_prof import cli
from sparseety_prof.store import schema
from sparseety_prof.store.recording_writer import RecordingWriter
from sparseety_prof.views.export import perfetto, token_events

LAYERS = {"moe": [1, 3], "ffn": [0, 1], "attn": [0, 1]}
MODEL = {"name": "sparse-moe-v7", "sha256": "ab" * 32}
HOSTILE = [
    '\x1b[2J"quoted"\\',
    "line\u2028sep\u2029",
    "\u202eevil\x07\x00",
    "tab\there\nnl",
    "日本\U0001f600",
]
KERNELS_PER_STEP = 3


def kernels_frame(n_steps: int) -> pl.DataFrame:
    """KERNELS_PER_STEP kernels for each step on two streams, then one kernel joined to no step and
    one whose device times CUPTI did not give."""
    rows: dict[str, list[object]] = {c: [] for c in schema.KERNELS}

    def add(step: int | None, k: int, start: int | None) -> None:
        rows["step_id"].append(step)
        rows["join"].append("thread" if step is not None else None)
        rows["join_error_ns"].append(0)
        rows["pid"].append(4242)
        rows["tid"].append(4243)
        rows["device"].append(0)
        rows["context_id"].append(1)
        rows["stream_id"].append(7 + k % 2)
        rows["correlation_id"].append(len(rows["correlation_id"]) + 1)
        rows["name"].append(f"_Z10mul_mat_q{k}Pfi")
        rows["api"].append("cuLaunchKernel")
        rows["launch_ns"].append((start or 0) - 5_000)
        rows["start_ns"].append(start)
        rows["end_ns"].append(None if start is None else start + 100_000 + 333)
        rows["grid"].append([64, 1, 1])
        rows["block"].append([128, 1, 1])
        rows["shared_mem_bytes"].append(0)
        rows["graph_id"].append(None)
        rows["graph_node_id"].append(None)
        rows["buffer_captured"].append(False)

    for s in range(n_steps):
        for k in range(KERNELS_PER_STEP):
            add(s, k, 1_000_000 * s + 100_001 + 200_000 * k)
    add(None, 0, 1_000_000 * n_steps + 7)
    add(5, 1, None)
    return schema.frame("kernels", rows)


def requests_frame(request_ids: list[str]) -> pl.DataFrame:
    rows: dict[str, list[object]] = {c: [None] * len(request_ids) for c in schema.REQUESTS}
    rows["request_id"] = list(request_ids)
    rows["id_source"] = ["segmented"] * len(request_ids)
    rows["seq_id"] = list(range(len(request_ids)))
    rows["parent_seq_id"] = [None] + [0] * (len(request_ids) - 1)
    return schema.frame("requests", rows)


def hostile_tokens(n: int) -> pl.DataFrame:
    t = tokens_frame(n)
    return t.with_columns(
        pl.Series("request_id", [HOSTILE[s % 2] for s in t["seq_id"].to_list()]),
        pl.Series("token_text", [HOSTILE[i % len(HOSTILE)] for i in range(n)]),
    )


def make_recording(
    path: Path, *, n_steps: int = 20, kernels: bool = True, hostile: bool = False, redact_text: bool = False
) -> Path:
    tokens = hostile_tokens(2 * n_steps) if hostile else tokens_frame(2 * n_steps)
    meta = {**META, "model": MODEL, "layers": LAYERS, "act_threshold": 0.01}
    with RecordingWriter(path, meta, redact_text=redact_text) as w:
        w.append("tokens", tokens)
        w.append("steps", steps_frame(n_steps))
        w.append("requests", requests_frame(tokens["request_id"].unique(maintain_order=True).to_list()))
        if kernels:
            w.append("kernels", kernels_frame(n_steps))
    return path


def export(rec: Path, fmt: str, out: Path, *extra: str) -> int:
    return cli.main(["export", str(rec), "--format", fmt, "-o", str(out), *extra])


def read_trace(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_bytes())
    assert isinstance(doc, dict)
    return doc


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def slices(doc: dict[str, Any], cat: str) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == cat]


def names(doc: dict[str, Any], what: str) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == what}


def ns(origin: int, us: float) -> int:
    return origin + round(us * 1000)


def check_times(ev: dict[str, Any], origin: int, start: int, end: int) -> None:
    """The slice covers exactly [start, end] ns: the microseconds are the nanoseconds / 1000."""
    assert ev["ts"] == (start - origin) / 1000
    assert ns(origin, ev["ts"]) == start
    assert round(ev["dur"] * 1000) == end - start


# ------------------------------------------------------------------ perfetto
def test_perfetto_export_holds_every_step_token_and_kernel_with_exact_times(tmp_path: Path) -> None:
    src = make_recording(tmp_path / "rec")
    out = tmp_path / "trace.json"
    assert export(src, "perfetto", out) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    rec = sparseety_prof.open(src)
    doc = read_trace(out)
    origin = doc["otherData"]["ts_origin_ns"]
    assert origin == min(rec.steps()["t_start_ns"].min(), rec.tokens()["t_start_ns"].min())  # type: ignore[type-var]
    assert doc["otherData"]["clock"] == "CLOCK_MONOTONIC"
    # Perfetto takes a displayTimeUnit of "ns" as the unit of every ts, and stops reading at a key it
    # does not know: the events first, then only otherData
    assert list(doc) == ["traceEvents", "otherData"]

    steps = rec.steps().rows(named=True)
    got_steps = slices(doc, "step")
    assert len(got_steps) == len(steps)
    for ev, row in zip(got_steps, steps, strict=True):
        assert (ev["pid"], ev["tid"]) == (row["pid"], row["tid"])
        assert ev["args"] == row
        assert ev["name"] == f"{row['phase']} step"
        check_times(ev, origin, row["t_start_ns"], row["t_end_ns"])

    tokens = rec.tokens().rows(named=True)
    got_tokens = slices(doc, "token")
    assert len(got_tokens) == len(tokens)
    track_names = names(doc, "thread_name")
    for ev, row in zip(got_tokens, tokens, strict=True):
        assert ev["pid"] == perfetto.REQUESTS_PID
        assert track_names[(ev["pid"], ev["tid"])] == row["request_id"]
        a = ev["args"]
        assert (a["request_id"], a["seq_id"], a["decode_order"]) == (
            row["request_id"],
            row["seq_id"],
            row["decode_order"],
        )
        assert (a["token_id"], a["token_text"], a["sampling"]["log_prob"]) == (
            row["token_id"],
            row["token_text"],
            row["log_prob"],
        )
        assert a["router"]["expert_ids"] == row["expert_ids"]
        assert a["router"]["layers"] == LAYERS["moe"]
        assert ev["name"] == (
            row["token_text"] if row["token_text"] is not None else f"token {row['token_id']}"
        )
        check_times(ev, origin, row["t_start_ns"], row["t_end_ns"])
    assert len({e["tid"] for e in got_tokens}) == rec.tokens()["request_id"].n_unique()

    kernels = rec.kernels().filter(pl.col("start_ns").is_not_null()).rows(named=True)
    got_kernels = slices(doc, "kernel")
    assert len(got_kernels) == len(kernels) == 20 * KERNELS_PER_STEP + 1
    for ev, row in zip(got_kernels, kernels, strict=True):
        assert ev["pid"] == perfetto.GPU_PID
        assert ev["name"] == row["name"]
        assert ev["args"] == row
        assert track_names[(ev["pid"], ev["tid"])] == f"GPU {row['device']} stream {row['stream_id']}"
        check_times(ev, origin, row["start_ns"], row["end_ns"])
    assert doc["otherData"]["skipped_without_times"] == {"steps": 0, "tokens": 0, "kernels": 1}
    assert doc["otherData"]["events"] == {"steps": 20, "tokens": 40, "kernels": 61, "layers": 0, "waits": 0}

    processes = names(doc, "process_name")
    assert processes[(4242, 0)] == "engine (pid 4242)"
    assert processes[(perfetto.REQUESTS_PID, 0)] == "requests"
    assert processes[(perfetto.GPU_PID, 0)] == "GPU kernels"
    assert track_names[(4242, 4243)] == "engine thread 4243"
    # Perfetto names threads by tid alone: no tid is shared by two tracks
    assert len({tid for _, tid in track_names}) == len(track_names)


def layer_times_frame(n_steps: int, worker_tid: int) -> pl.DataFrame:
    """Layer times of the one-row steps of steps_frame (all but step 0) on the step's thread
    (4243, graph thread 0) and a worker: layer L's probe point 100 us x (L + 1) into the step."""
    rows: dict[str, list[object]] = {c: [] for c in schema.LAYER_TIMES}
    for step in range(1, n_steps):
        for thread, tid in ((0, 4243), (1, worker_tid)):
            prev = None
            for layer in range(4):
                t = 1_000_000 * step + 100_000 * (layer + 1) + 1_000 * thread
                for name, v in (
                    ("step_id", step),
                    ("ctx_id", 0),
                    ("layer", layer),
                    ("thread", thread),
                    ("tid", tid),
                    ("t_ns", t),
                    ("dur_ns", None if prev is None else t - prev),
                    ("lag_ns", 1_000 * thread),
                ):
                    rows[name].append(v)
                prev = t
    return schema.frame("layer_times", rows)


def test_perfetto_layer_slices_lie_under_their_step_on_each_thread(tmp_path: Path) -> None:
    src = make_recording(tmp_path / "rec", kernels=False)
    with RecordingWriter(tmp_path / "rec2", {**META, "model": MODEL, "layers": LAYERS}) as w:
        rec0 = sparseety_prof.open(src)
        for table in ("tokens", "steps", "requests"):
            w.append(table, rec0.table(table))
        w.append("layer_times", layer_times_frame(20, worker_tid=4250))
    out = tmp_path / "trace.json"
    assert export(tmp_path / "rec2", "perfetto", out) == 0
    rec = sparseety_prof.open(tmp_path / "rec2")
    doc = read_trace(out)
    origin = doc["otherData"]["ts_origin_ns"]
    want = rec.table("layer_times").drop_nulls("dur_ns").rows(named=True)
    got = slices(doc, "layer")
    assert len(got) == len(want) == 19 * 2 * 3 and doc["otherData"]["events"]["layers"] == len(want)
    steps = {r["step_id"]: r for r in rec.steps().rows(named=True)}
    for ev, row in zip(got, want, strict=True):
        assert (ev["pid"], ev["tid"]) == (4242, row["tid"]) and ev["name"] == f"layer {row['layer']}"
        assert ev["args"] == row
        check_times(ev, origin, row["t_ns"] - row["dur_ns"], row["t_ns"])
        step = steps[row["step_id"]]
        assert step["t_start_ns"] <= row["t_ns"] - row["dur_ns"] and row["t_ns"] <= step["t_end_ns"]
    track_names = names(doc, "thread_name")
    assert track_names[(4242, 4250)] == "engine thread 4250"
    assert track_names[(4242, 4243)] == "engine thread 4243"
    assert len(track_names) == len({tid for _, tid in track_names})


def test_perfetto_waits_are_counters_over_each_step_and_name_who_took_the_cpu(tmp_path: Path) -> None:
    src = make_recording(tmp_path / "rec", kernels=False)
    rec0 = sparseety_prof.open(src)
    steps = rec0.steps().sort("step_id")
    waits = {c: [] for c in schema.THREAD_WAITS}  # type: dict[str, list[object]]
    for i, (sid, tid) in enumerate(steps.select("step_id", "tid").iter_rows()):
        row = {
            "step_id": sid,
            "pid": 4242,
            "tid": tid,
            "step_thread": True,
            "on_cpu_ns": 500_000,
            "runnable_ns": 100_000 * i,
            "sleep_ns": 7_000,
            "stopped_ns": 250_000 if i == 3 else 0,
            "waited_recorder_ns": 0,
            "waited_engine_ns": 0,
            "waited_other_ns": 100_000 * i,
            "top_pid": 881 if i % 2 else None,
            "top_comm": "stress\x1b[31m" if i % 2 else None,
            "top_ns": 100_000 * i if i % 2 else None,
        }
        for k, v in row.items():
            waits[k].append(v)
    with RecordingWriter(tmp_path / "rec2", {**META, "model": MODEL, "layers": LAYERS}) as w:
        for table in ("tokens", "steps", "requests"):
            w.append(table, rec0.table(table))
        w.append("thread_waits", schema.frame("thread_waits", waits))
    out = tmp_path / "trace.json"
    assert export(tmp_path / "rec2", "perfetto", out) == 0
    doc = read_trace(out)
    origin = doc["otherData"]["ts_origin_ns"]
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C"]
    assert len(counters) == 2 * steps.height and doc["otherData"]["events"]["waits"] == steps.height
    for i, r in enumerate(steps.rows(named=True)):
        up, down = counters[2 * i], counters[2 * i + 1]
        assert up["name"] == down["name"] == f"waits {r['tid']}" and up["pid"] == 4242
        assert ns(origin, up["ts"]) == r["t_start_ns"] and ns(origin, down["ts"]) == r["t_end_ns"]
        assert up["args"] == {
            "runnable_ms": 100_000 * i / 1e6,
            "stopped_ms": 0.25 if i == 3 else 0.0,
            "sleep_ms": 0.007,
        }
        assert down["args"] == {"runnable_ms": 0.0, "stopped_ms": 0.0, "sleep_ms": 0.0}
    named = [e for e in doc["traceEvents"] if e.get("cat") == "wait"]
    assert len(named) == steps.height // 2
    assert named[0]["name"] == "waited 0.10 ms for PID 881 (stress\\x1b[31m)"  # the escape made visible
    assert named[0]["tid"] == steps["tid"][1] and ns(origin, named[0]["ts"]) == steps["t_end_ns"][1]


def _enclosing(doc: dict[str, Any], origin: int, ev: dict[str, Any]) -> dict[str, Any]:
    """The one slice on ev's track whose span holds ev's time."""
    t = ns(origin, ev["ts"])
    found = [
        s
        for s in doc["traceEvents"]
        if s["ph"] == "X"
        and (s["pid"], s["tid"]) == (ev["pid"], ev["tid"])
        and ns(origin, s["ts"]) <= t <= ns(origin, s["ts"]) + round(s["dur"] * 1000)
    ]
    assert len(found) >= 1, ev
    return found[0]


def test_flows_lead_from_each_token_to_its_step_and_from_each_step_to_its_kernels(tmp_path: Path) -> None:
    src = make_recording(tmp_path / "rec", n_steps=8)
    out = tmp_path / "trace.json"
    assert export(src, "perfetto", out) == 0
    doc = read_trace(out)
    origin = doc["otherData"]["ts_origin_ns"]
    ends: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    for e in doc["traceEvents"]:
        if e["ph"] in ("s", "f"):
            assert e["ph"] not in ends[e["id"]], "a flow id is used twice"
            ends[e["id"]][e["ph"]] = e
    assert all(set(pair) == {"s", "f"} for pair in ends.values())
    assert all(pair["f"]["bp"] == "e" for pair in ends.values())
    token_flows = [p for p in ends.values() if p["s"]["name"] == "token -> step"]
    kernel_flows = [p for p in ends.values() if p["s"]["name"] == "step -> kernel"]
    assert len(token_flows) == 16  # every token's step is in the steps table
    assert len(kernel_flows) == 8 * KERNELS_PER_STEP  # none for the unjoined kernel nor the untimed one
    for pair in token_flows:
        token = _enclosing(doc, origin, pair["s"])
        step = _enclosing(doc, origin, pair["f"])
        assert (token["cat"], step["cat"]) == ("token", "step")
        assert token["args"]["batch"]["step_id"] == step["args"]["step_id"]
    seen_kernels = set()
    for pair in kernel_flows:
        step = _enclosing(doc, origin, pair["s"])
        kernel = _enclosing(doc, origin, pair["f"])
        assert (step["cat"], kernel["cat"]) == ("step", "kernel")
        assert kernel["args"]["step_id"] == step["args"]["step_id"]
        seen_kernels.add(kernel["args"]["correlation_id"])
    assert len(seen_kernels) == len(kernel_flows)


def test_a_recording_without_kernels_has_no_gpu_process(tmp_path: Path) -> None:
    src = make_recording(tmp_path / "rec", kernels=False)
    out = tmp_path / "trace.json"
    assert export(src, "perfetto", out) == 0
    doc = read_trace(out)
    assert not slices(doc, "kernel")
    assert all(e["pid"] != perfetto.GPU_PID for e in doc["traceEvents"])
    assert len(slices(doc, "token")) == 40


def test_an_empty_recording_exports_valid_empty_files(tmp_path: Path) -> None:
    with RecordingWriter(tmp_path / "rec", META):
        pass
    assert export(tmp_path / "rec", "perfetto", tmp_path / "t.json") == 0
    doc = read_trace(tmp_path / "t.json")
    assert doc["traceEvents"] == [] and doc["otherData"]["ts_origin_ns"] == 0
    assert export(tmp_path / "rec", "jsonl", tmp_path / "t.jsonl") == 0
    assert (tmp_path / "t.jsonl").read_bytes() == b""


# ------------------------------------------------------------------ jsonl
def test_jsonl_has_one_event_per_token_in_the_brief_shape(tmp_path: Path) -> None:
    src = make_recording(tmp_path / "rec")
    out = tmp_path / "tokens.jsonl"
    assert export(src, "jsonl", out) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    rec = sparseety_prof.open(src)
    events = read_jsonl(out)
    rows = rec.tokens().rows(named=True)
    assert len(events) == len(rows) == 40
    batch = {r["step_id"]: r["seq_ids"] for r in rec.steps().rows(named=True)}
    parent = {r["request_id"]: r["parent_seq_id"] for r in rec.requests().rows(named=True)}
    for ev, row in zip(events, rows, strict=True):
        assert ev == {
            "request_id": row["request_id"],
            "seq_id": row["seq_id"],
            "parent_seq_id": parent[row["request_id"]],
            "ctx_id": row["ctx_id"],
            "decode_order": row["decode_order"],
            "position": row["pos"],
            "logits_pos": row["logits_pos"],
            "phase": row["phase"],
            "partial": row["partial"],
            "token_id": row["token_id"],
            "token_text": row["token_text"],
            "token_source": row["token_source"],
            "timestamp_unix_ms": row["ts_unix_ms"],
            "model_version": MODEL["name"],
            "model_sha256": MODEL["sha256"],
            "sampling": {
                "log_prob": row["log_prob"],
                "entropy": row["entropy"],
                "top_ids": row["top_ids"],
                "top_log_probs": row["top_log_probs"],
            },
            "router": {
                "layers": LAYERS["moe"],
                "expert_ids": row["expert_ids"],
                "weights": row["expert_weights"],
                "router_probs": row["router_probs"],
            },
            "activation_sparsity": {
                "layers": LAYERS["ffn"],
                "mlp_zero_ratio": row["act_zero_ratio"],
                "below_threshold_ratio": row["act_below_ratio"],
                "threshold": 0.01,
            },
            "attention": {
                "layers": LAYERS["attn"],
                "attended": row["attn_attended"],
                "total": row["attn_total"],
                "kv_cells_used": row["kv_cells_used"],
            },
            "batch": {"step_id": row["step_id"], "size": row["batch_size"], "seq_ids": batch[row["step_id"]]},
            "time": {"step_start_ns": row["t_start_ns"], "step_end_ns": row["t_end_ns"]},
            "process": {"pid": row["pid"], "tid": row["tid"]},
        }
    assert {e["parent_seq_id"] for e in events} == {None, 0}


def test_jsonl_is_written_a_slice_at_a_time_with_the_same_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_recording(tmp_path / "rec")
    assert export(src, "jsonl", tmp_path / "whole.jsonl") == 0
    monkeypatch.setattr(token_events, "SLICE_ROWS", 7)  # 40 rows: slices of 7 and a last one of 5
    assert export(src, "jsonl", tmp_path / "sliced.jsonl") == 0
    assert export(src, "perfetto", tmp_path / "sliced.json") == 0
    assert (tmp_path / "sliced.jsonl").read_bytes() == (tmp_path / "whole.jsonl").read_bytes()
    assert len(slices(read_trace(tmp_path / "sliced.json"), "token")) == 40


# ------------------------------------------------------------------ untrusted strings, redaction
def test_hostile_request_ids_and_token_text_round_trip_exactly_and_stay_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_recording(tmp_path / "rec", hostile=True)
    rec = sparseety_prof.open(src)
    for fmt, name in (("perfetto", "t.json"), ("jsonl", "t.jsonl")):
        assert export(src, fmt, tmp_path / name) == 0
        raw = (tmp_path / name).read_bytes()
        assert raw.isascii()  # every non-ASCII character, U+2028 included, is a \u escape
        assert not any(b < 0x20 and b != 0x0A for b in raw)  # control characters only escaped
    err = capsys.readouterr().err
    assert "\x1b" not in err
    events = read_jsonl(tmp_path / "t.jsonl")
    assert [e["request_id"] for e in events] == rec.tokens()["request_id"].to_list()
    assert [e["token_text"] for e in events] == rec.tokens()["token_text"].to_list()
    doc = read_trace(tmp_path / "t.json")
    tokens = slices(doc, "token")
    assert [e["name"] for e in tokens] == rec.tokens()["token_text"].to_list()
    assert [e["args"]["request_id"] for e in tokens] == rec.tokens()["request_id"].to_list()
    assert set(names(doc, "thread_name").values()) >= set(HOSTILE[:2])


def test_a_text_redacted_recording_exports_null_text(tmp_path: Path) -> None:
    src = make_recording(tmp_path / "rec", redact_text=True)
    assert export(src, "jsonl", tmp_path / "t.jsonl") == 0
    assert export(src, "perfetto", tmp_path / "t.json") == 0
    events = read_jsonl(tmp_path / "t.jsonl")
    assert len(events) == 40 and all(e["token_text"] is None for e in events)
    doc = read_trace(tmp_path / "t.json")
    tokens = slices(doc, "token")
    assert all(e["args"]["token_text"] is None for e in tokens)
    assert [e["name"] for e in tokens] == [f"token {e['args']['token_id']}" for e in tokens]
    assert doc["otherData"]["redacted_text"] is True


# ------------------------------------------------------------------ the output file
@pytest.mark.parametrize("fmt", ["perfetto", "jsonl"])
def test_an_existing_output_is_refused_unless_forced(
    tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_recording(tmp_path / "rec", n_steps=3)
    out = tmp_path / "out"
    out.write_text("keep me")
    assert export(src, fmt, out) == 2
    assert out.read_text() == "keep me"
    assert "--force" in capsys.readouterr().err
    assert export(src, fmt, out, "--force") == 0
    assert out.read_text() != "keep me"
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "rec"]  # no temporary file left


def test_a_symlink_at_the_output_path_is_never_written_through(tmp_path: Path) -> None:
    src = make_recording(tmp_path / "rec", n_steps=3)
    target = tmp_path / "victim"
    target.write_text("secret")
    link = tmp_path / "out.json"
    link.symlink_to(target)
    assert export(src, "perfetto", link) == 2
    assert link.is_symlink() and target.read_text() == "secret"
    assert export(src, "perfetto", link, "--force") == 0
    assert not link.is_symlink()  # the link itself was replaced
    assert target.read_text() == "secret"
    read_trace(link)


def test_a_directory_or_a_missing_folder_is_a_usage_error(tmp_path: Path) -> None:
    src = make_recording(tmp_path / "rec", n_steps=3)
    (tmp_path / "d").mkdir()
    assert export(src, "jsonl", tmp_path / "d", "--force") == 2
    assert export(src, "jsonl", tmp_path / "nowhere" / "t.jsonl") == 2


def test_a_damaged_recording_exits_7_with_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_recording(tmp_path / "rec", n_steps=3)
    seg = next((src / "tokens").iterdir())
    seg.write_bytes(seg.read_bytes()[:40])
    for fmt in ("perfetto", "jsonl"):
        assert export(src, fmt, tmp_path / "out") == 7
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "sparseety-prof: error:" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec"]


# ------------------------------------------------------------------ a real engine
@pytest.mark.root
@pytest.mark.engine
def test_export_of_a_real_llama_cpp_python_recording(llama_engine: Engine, tmp_path: Path) -> None:
    rec_dir = tmp_path / "rec"
    recorder = Recorder(llama_engine.pid, rec_dir)
    truth = llama_engine.generate(["hello the expert router", "one two three"], max_tokens=6)
    rc, err = recorder.stop(signal.SIGINT)
    assert rc == 0, err
    rec = sparseety_prof.open(rec_dir)
    tokens = rec.tokens()
    assert tokens.height == sum(len(t["ids"]) for t in truth)

    assert export(rec_dir, "jsonl", tmp_path / "t.jsonl") == 0
    events = read_jsonl(tmp_path / "t.jsonl")
    assert len(events) == tokens.height
    by_request: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_request[e["request_id"]].append(e)
    runs = sorted(by_request.values(), key=lambda evs: min(e["time"]["step_end_ns"] for e in evs))
    assert [[e["token_id"] for e in sorted(evs, key=lambda e: e["decode_order"])] for evs in runs] == [
        t["ids"] for t in truth
    ]
    assert [e["token_text"] for e in events] == tokens["token_text"].to_list()
    assert [e["router"]["expert_ids"] for e in events] == tokens["expert_ids"].to_list()
    assert all(e["router"]["layers"] == rec.meta["layers"]["moe"] for e in events)
    assert all(e["process"]["pid"] == llama_engine.pid for e in events)

    assert export(rec_dir, "perfetto", tmp_path / "t.json") == 0
    doc = read_trace(tmp_path / "t.json")
    origin = doc["otherData"]["ts_origin_ns"]
    got_tokens, got_steps = slices(doc, "token"), slices(doc, "step")
    assert len(got_tokens) == tokens.height and len(got_steps) == rec.steps().height
    assert [e["args"]["token_id"] for e in got_tokens] == tokens["token_id"].to_list()
    for ev, row in zip(got_steps, rec.steps().rows(named=True), strict=True):
        assert ev["pid"] == llama_engine.pid == row["pid"]
        check_times(ev, origin, row["t_start_ns"], row["t_end_ns"])
    flows = [e for e in doc["traceEvents"] if e["ph"] == "s" and e["name"] == "token -> step"]
    assert len(flows) == tokens.height
    assert os.stat(tmp_path / "t.json").st_size > 0


def test_json_text_writes_non_finite_floats_as_null_and_strings_as_ascii() -> None:
    from sparseety_prof.views.export.json_text import dumps

    assert dumps({"a": [1.5, float("nan")], "b": float("-inf")}) == '{"a":[1.5,null],"b":null}'
    assert dumps("\u2028\x1b\u202e") == '"\\u2028\\u001b\\u202e"'
    assert json.loads(dumps(HOSTILE)) == HOSTILE
