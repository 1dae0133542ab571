"""Unit tests of the serving-context logic (no BPF): header parsing, the request -> task ->
slot chain, slot reuse, children of a parent task, and the check command's layer evaluation."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from sparseety_prof.correlate.serving import (
    ID_GENERATED,
    ID_HEADER,
    RequestAgg,
    ServingTracker,
    parse_request_head,
    percentile,
)
from sparseety_prof.session.request_check import evaluate, first_missing
from sparseety_prof.store import schema


def head(rid: str | None, path: str = "/completion", name: str = "X-Request-Id") -> bytes:
    h = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
    if rid is not None:
        h += f"{name}: {rid}\r\n"
    return (h + "\r\n{}").encode()


def test_parse_request_head() -> None:
    assert parse_request_head(head("abc"), "X-Request-Id") == ("POST", "/completion", "abc")
    assert parse_request_head(head("abc", name="x-request-id"), "X-Request-Id") == (
        "POST",
        "/completion",
        "abc",
    )
    assert parse_request_head(head(None), "X-Request-Id") == ("POST", "/completion", None)
    assert parse_request_head(b'{"prompt": "POST / HTTP/1.1"}', "X-Request-Id") is None
    assert parse_request_head(head("  spaced  "), "X-Request-Id") == ("POST", "/completion", "spaced")
    long = parse_request_head(head("x" * 1000), "X-Request-Id")
    assert long is not None and long[2] == "x" * 256


def test_chain_binds_ids_and_slot_reuse_takes_the_new_id() -> None:
    t = ServingTracker(pid=7)
    t.on_http(tid=11, t_ns=100, data=head("a"))
    t.on_http(tid=12, t_ns=101, data=head(None))
    t.on_task_post(tid=12, first_task=5, single=False, span_bytes=2352)
    t.on_task_post(tid=11, first_task=4, single=False, span_bytes=2352)
    t.on_task_post(tid=99, first_task=6, single=True, span_bytes=0)  # the main loop's own task
    la = t.on_slot_launch(t_ns=200, slot=0, task=4)
    lb = t.on_slot_launch(t_ns=201, slot=1, task=5)
    assert (la.request_id, la.id_source, la.t_received_ns) == ("a", ID_HEADER, 100)
    assert lb.id_source == ID_GENERATED and lb.request_id.startswith("gen-7-")
    # slot 0 reused by a later request: the later id, a later serial
    t.on_http(tid=11, t_ns=300, data=head("b"))
    t.on_task_post(tid=11, first_task=8, single=False, span_bytes=2352)
    lc = t.on_slot_launch(t_ns=400, slot=0, task=8)
    assert lc.request_id == "b" and lc.serial > la.serial and t.slots[0] is lc
    # a task nobody read (sent before attach): a generated id, counted
    ld = t.on_slot_launch(t_ns=500, slot=2, task=77)
    assert ld.request_id == "task-7-77" and t.counters.tasks_unbound == 1
    assert t.trace["a"] == {"entry_ns": [100], "tasks": [4], "slots": [0, 200]}


def test_a_get_without_task_is_replaced_and_multi_task_posts_bind_all() -> None:
    t = ServingTracker(pid=1)
    t.on_task_post(tid=3, first_task=1, single=False, span_bytes=100)  # learns the task size
    t.on_http(tid=3, t_ns=1, data=b"GET /health HTTP/1.1\r\n\r\n")
    t.on_http(tid=3, t_ns=2, data=head("multi"))
    t.on_task_post(tid=3, first_task=10, single=False, span_bytes=300)  # three prompts
    assert [t.on_slot_launch(5, s, 10 + s).request_id for s in range(3)] == ["multi"] * 3


def test_children_of_a_parent_task_are_forks() -> None:
    t = ServingTracker(pid=1)
    t.on_http(tid=3, t_ns=1, data=head("n2"))
    t.on_task_post(tid=3, first_task=20, single=True, span_bytes=0)
    t.on_slot_child(child=1, parent=0, task=20)
    parent = t.on_slot_launch(5, 0, 20)
    child = t.on_slot_launch(6, 1, 21)  # the child's own task id was never posted
    assert parent.parent_seq_id is None and child.parent_seq_id == 0 and child.request_id == "n2"


def _frames(rid: str, slot: int, n: int, with_experts: bool) -> tuple[pl.DataFrame, pl.DataFrame]:
    step_cols: dict[str, list[object]] = {"step_id": [1], "t_start_ns": [300], "seq_ids": [[slot]]}
    steps = schema.frame("steps", step_cols, absent=schema.STEPS.keys() - step_cols.keys())
    token_cols: dict[str, list[object]] = {
        "request_id": [rid] * n,
        "decode_order": list(range(n)),
        "token_id": [5 + i for i in range(n)],
        "expert_ids": [[[1, 2]] if with_experts else [] for _ in range(n)],
    }
    tokens = schema.frame("tokens", token_cols, absent=schema.TOKENS.keys() - token_cols.keys())
    return steps, tokens


def test_evaluate_names_the_first_missing_layer() -> None:
    answer = {"tokens": [5, 6, 7]}
    trace = {"entry_ns": [100], "tasks": [4], "slots": [2, 200]}
    steps, tokens = _frames("r", 2, 3, True)
    meta = {"layers": {"moe": [0, 1]}}
    res = evaluate("r", answer, trace, steps, tokens, meta)
    assert [r.layer for r in res] == ["entry", "task", "slot", "steps", "tokens", "routing"]
    assert first_missing(res) is None
    assert first_missing(evaluate("r", answer, {**trace, "tasks": []}, steps, tokens, meta)).layer == "task"  # type: ignore[union-attr]
    assert first_missing(evaluate("r", answer, {}, steps, tokens, meta)).layer == "entry"  # type: ignore[union-attr]
    other_slot = {**trace, "slots": [3, 200]}
    assert first_missing(evaluate("r", answer, other_slot, steps, tokens, meta)).layer == "steps"  # type: ignore[union-attr]
    assert first_missing(evaluate("r", {"tokens": [5, 6, 8]}, trace, steps, tokens, meta)).layer == "tokens"  # type: ignore[union-attr]
    _, plain = _frames("r", 2, 3, False)
    assert first_missing(evaluate("r", answer, trace, steps, plain, meta)).layer == "routing"  # type: ignore[union-attr]
    dense = evaluate("r", answer, trace, steps, plain, {"layers": {"moe": []}})
    assert first_missing(dense) is None and dense[-1].detail.startswith("n/a")


def test_environment_snapshot_keeps_engine_settings_and_hides_secrets() -> None:
    import subprocess
    import sys

    from sparseety_prof.session.snapshot import engine_environment

    env = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "3", "LLAMA_API_KEY": "s3cret", "HOME": "/root"}
    code = "import time; print('up', flush=True); time.sleep(30)"
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "up\n"  # exec'd: its own environ
        got = engine_environment(p.pid)
    finally:
        p.kill()
        p.wait()
    assert got == {"LLAMA_API_KEY": "<redacted>", "OMP_NUM_THREADS": "3"}


def test_request_latency_percentiles_are_numpys() -> None:
    """The requests table's inter-token p50/p99 (plain Python, per request) equal numpy's
    percentile, on the lengths and spreads requests have."""
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 5, 64, 101, 1000):
        for scale in (1e-3, 1.0, 250.0):
            v = np.sort(rng.exponential(scale, n))
            for q in (0, 1, 50, 90, 99, 99.9, 100):
                assert percentile(v.tolist(), q) == pytest.approx(
                    float(np.percentile(v, q)), rel=1e-13, abs=0
                )
    agg = RequestAgg("r", ID_GENERATED, 1, 0, 1, False, 1_000, t_token_ns=[2_000_000, 5_000_000, 6_500_000])
    row = agg.row()
    assert row["itl_p50_ms"] == np.percentile([3.0, 1.5], 50) and row["itl_p99_ms"] == pytest.approx(2.985)
    assert row["ttft_ms"] == 1.999 and row["t_last_token_ns"] == 6_500_000
    single = RequestAgg("s", ID_GENERATED, 1, 0, 1, False, 1_000, t_token_ns=[2_000_000]).row()
    assert single["itl_p50_ms"] is None and single["t_first_token_ns"] == 2_000_000
