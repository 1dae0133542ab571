"""`record --trace-ops ON/PERIOD` (capture/op_trace.py, session/op_times.py): on a real engine, each
traced step's nodes are, thread by thread, the nodes the engine's own graph callback saw it compute
(tests/engines/llama_engine.py --graph-trace), each thread's intervals follow one another inside
the step; with short windows the node probes are out of the engine's code between windows."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from conftest import (
    ENGINES,
    Engine,
    Recorder,
    free_port,
    http_post,
    require_build,
    run_cli,
    server_builds,
    server_engine_args,
    start_build,
)
from probe_memory import INT3, runtime_address

import sparseety_prof
from sparseety_prof.capture.bpf_loader import AttachedProbe
from sparseety_prof.capture.op_trace import SYM_FUSED, SYM_NODE
from sparseety_prof.session.op_times import node_layer

PROMPTS = ["hello the expert router", "one two three four"]
#: nodes ggml-cpu's graph loop does not compute (ggml_op_is_empty), and nodes with no elements
#: (ggml_compute_forward returns before ggml_cpu_extra_compute_forward)
NOT_COMPUTED = {"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"}


def test_a_node_s_layer_is_its_name_s_number() -> None:
    assert node_layer("ffn_moe_gate-12") == 12
    assert node_layer("cache_k_l0 (view)") is None
    assert node_layer("embd") is None
    assert node_layer("x-1a") is None


def test_a_malformed_window_is_a_usage_error() -> None:
    r = run_cli("record", "--pid", "1", "-o", "/nonexistent/x", "--trace-ops", "1s")
    assert r.returncode == 2 and "--trace-ops: expected ON/PERIOD" in r.stderr


@pytest.mark.root
@pytest.mark.engine
def test_each_traced_step_holds_the_nodes_the_engine_computed_on_each_thread(
    models: dict[str, Path], tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    args = [str(ENGINES / "llama_engine.py"), str(models["moe"]), "--threads", "2"]
    engine = Engine([*args, "--graph-trace", str(trace)])
    try:
        out = tmp_path / "rec"
        rec = Recorder(engine.pid, out, "--trace-ops", "60s/120s")  # one window over the whole run
        engine.generate(PROMPTS, max_tokens=6)
        rc, err = rec.stop(signal.SIGINT)
        assert rc == 0, err
    finally:
        engine.close()
    r = sparseety_prof.open(out)
    ops, steps = r.table("op_times"), r.steps()
    meta = r.meta["trace_ops"]
    assert meta["lost"] == 0 and meta["steps"] == steps.height == ops["step_id"].n_unique()
    fuses = any(p["symbol"] == SYM_FUSED for p in meta["points"])
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    evals = {x["eval"]: x for x in lines if x["kind"] == "eval"}
    # an eval's (positions, tokens) -> the nodes computed
    computed: dict[tuple[tuple[int, ...], tuple[int, ...]], list[tuple[str, str]]] = {}
    for x in lines:
        if x["kind"] == "nodes":
            key = (tuple(evals[x["eval"]]["positions"]), tuple(evals[x["eval"]]["tokens"]))
            seen = _computed(x["nodes"], fuses=fuses)
            assert computed.setdefault(key, seen) == seen  # (two requests may feed the same row)
    threads = set()
    for step in steps.iter_rows(named=True):
        want = computed[(tuple(step["positions"]), tuple(step["token_ids"]))]
        mine = ops.filter(pl.col("step_id") == step["step_id"])
        threads.add(mine["thread"].n_unique())
        for (tid,), group in mine.group_by(["tid"]):
            nodes = group.sort("node")
            assert nodes["node"].to_list() == list(range(len(want))), tid
            assert list(zip(nodes["op"], nodes["name"], strict=True)) == want, tid
            assert nodes["layer"].to_list() == [node_layer(n) for _, n in want]
            starts, durs = nodes["t_start_ns"].to_list(), nodes["dur_ns"].to_list()
            assert all(d >= 0 for d in durs)
            # each node ends where the thread's next one begins, or at its graph's end (the graph
            # trace computes a step's graph in pieces: a piece's last node ends with the piece)
            assert all(s + d <= nxt for s, d, nxt in zip(starts, durs, starts[1:], strict=False))
            assert (
                sum(s + d == nxt for s, d, nxt in zip(starts, durs, starts[1:], strict=False))
                > len(want) // 2
            )
            assert step["t_start_ns"] <= starts[0] and starts[-1] + durs[-1] <= step["t_end_ns"]
    assert threads == {2}  # both graph threads, every step


def _computed(nodes: list[list[Any]], *, fuses: bool) -> list[tuple[str, str]]:
    """The graph trace's nodes as ggml-cpu computes them: without the nodes it skips, and, in a
    build that fuses them, a MUL right after the RMS_NORM it multiplies computed with it (the pair
    is one node, the RMS_NORM's: "RMS_NORM+MUL")."""
    out: list[tuple[str, str]] = []
    for op, name, empty, srcs in nodes:
        if op in NOT_COMPUTED or empty:
            continue
        if fuses and op == "MUL" and out and out[-1][0] == "RMS_NORM" and out[-1][1] in srcs:
            out[-1] = ("RMS_NORM+MUL", out[-1][1])
            continue
        out.append((op, name))
    return out


def _named(nodes: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Nodes with ggml's automatic names ("node_24": counters that differ between builds) blanked."""
    return [(op, "" if re.fullmatch(r"node_\d+", name) else name) for op, name in nodes]


@pytest.mark.root
@pytest.mark.engine
def test_a_llama_server_build_s_decode_steps_hold_the_nodes_of_the_same_graph(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """llama-server b11434 (static: ggml-cpu inside the executable, its barrier inlined): each
    decode step's nodes, thread by thread, are the decode graph llama-cpp-python's graph callback
    sees for the same model with flash attention (the server's default), ggml's automatic node
    names aside."""
    name, env = next(b for b in server_builds() if b[0] == "llama-server-b11434-static")
    require_build(env)
    trace = tmp_path / "trace.jsonl"
    oracle = Engine(
        [str(ENGINES / "llama_engine.py"), str(models["moe"]), "--flash-attn", "--graph-trace", str(trace)]
    )
    try:
        oracle.generate(PROMPTS[:1], max_tokens=3)
    finally:
        oracle.close()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    rows = {x["eval"]: x["n_batch_rows"] for x in lines if x["kind"] == "eval"}
    decode = {
        json.dumps(_computed(x["nodes"], fuses=True))
        for x in lines
        if x["kind"] == "nodes" and rows[x["eval"]] == 1
    }
    assert len(decode) == 1  # one decode graph
    want = _named([tuple(n) for n in json.loads(decode.pop())])

    port = free_port()
    server = start_build(name, [*server_engine_args(env, models["moe"], port), "--threads", "2"], env)
    try:
        out = tmp_path / "rec"
        rec = Recorder(server.pid, out, "--trace-ops", "60s/120s")
        http_post(f"http://127.0.0.1:{port}", "/completion", {"prompt": PROMPTS[0], "n_predict": 6})
        rc, err = rec.stop(signal.SIGINT)
        assert rc == 0, err
    finally:
        server.close()
    r = sparseety_prof.open(out)
    ops, steps = r.table("op_times"), r.steps()
    assert any(p["symbol"] == SYM_FUSED for p in r.meta["trace_ops"]["points"])
    decode_steps = steps.filter(pl.col("n_tokens") == 1)
    assert decode_steps.height == 5  # n_predict 6: the first token from the prompt's step
    for step in decode_steps.iter_rows(named=True):
        mine = ops.filter(pl.col("step_id") == step["step_id"])
        assert mine["thread"].n_unique() == 2
        for (tid,), group in mine.group_by(["tid"]):
            nodes = group.sort("node")
            assert _named(list(zip(nodes["op"], nodes["name"], strict=True))) == want, tid
            starts, durs = nodes["t_start_ns"].to_list(), nodes["dur_ns"].to_list()
            assert all(s + d == nxt for s, d, nxt in zip(starts, durs, starts[1:], strict=False))
            assert step["t_start_ns"] <= starts[0] and starts[-1] + durs[-1] <= step["t_end_ns"]


class _ByteReader:
    """The byte at an address of the engine's memory, read every few milliseconds (0xcc: int3, the
    breakpoint there while a uprobe is attached)."""

    def __init__(self, pid: int, address: int) -> None:
        self.pid, self.address = pid, address
        self.samples: list[tuple[int, int, bytes]] = []  # (read began, read done, byte)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with open(f"/proc/{self.pid}/mem", "rb", buffering=0) as mem:
            while not self._stop.wait(0.02):
                t0 = time.monotonic_ns()
                mem.seek(self.address)
                self.samples.append((t0, time.monotonic_ns(), mem.read(1)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.mark.root
@pytest.mark.engine
def test_the_node_probes_are_out_of_the_engine_between_windows(llama_engine: Engine, tmp_path: Path) -> None:
    out = tmp_path / "rec"
    rec = Recorder(llama_engine.pid, out, "--trace-ops", "1s/3s")
    deadline = time.monotonic() + 8
    reader: _ByteReader | None = None
    while time.monotonic() < deadline:
        llama_engine.generate(PROMPTS, max_tokens=8)
        if reader is None:  # the node probe's address: from the recorder's own tracer, via its maps
            reader = _ByteReader(llama_engine.pid, _node_probe_address(llama_engine.pid, out))
    assert reader is not None
    reader.stop()
    rc, err = rec.stop(signal.SIGINT)
    assert rc == 0, err
    meta: dict[str, Any] = sparseety_prof.open(out).meta["trace_ops"]
    windows = meta["windows_ns"]
    traced_windows = meta["traced_windows_ns"]  # [in, out]: the node probes' own
    assert meta["switch"]["disarms"] >= 2 and meta["switch"]["failures"] == 0
    node_point = next(p for p in meta["points"] if p["symbol"] == SYM_NODE)
    assert node_point["address"] == _points(out)[0]["address"]  # the address the bytes were read at

    def phase(t0: int, t1: int) -> str | None:
        for i, w in enumerate(windows):
            if w[1] <= t0 and t1 <= w[2]:
                return "in"
            nxt = windows[i + 1][0] if i + 1 < len(windows) else None
            if w[3] is not None and w[3] <= t0 and (nxt is None or t1 <= nxt):
                return "out"
        return None

    seen: dict[str, set[bytes]] = {"in": set(), "out": set()}
    for t0, t1, byte in reader.samples:
        p = phase(t0, t1)
        if p is not None:
            seen[p].add(byte)
    assert seen["in"] == {INT3}, seen
    assert len(seen["out"]) == 1 and INT3 not in seen["out"], seen
    # rows only for steps that ran whole in a window
    r = sparseety_prof.open(out)
    traced = set(r.table("op_times")["step_id"].unique().to_list())
    assert traced
    for s in r.steps().filter(pl.col("step_id").is_in(traced)).iter_rows(named=True):
        assert any(w[0] <= s["t_start_ns"] and s["t_end_ns"] <= w[1] for w in traced_windows)
    # and whole: each thread of a step has the same nodes, every step of one row the same
    ops = r.table("op_times").join(r.steps().select("step_id", "n_tokens"), on="step_id")
    lists = {
        (sid, tid): list(zip(g.sort("node")["op"], g.sort("node")["name"], strict=True))
        for (sid, tid), g in ops.group_by(["step_id", "tid"])
    }
    for (sid, _), nodes in lists.items():
        assert all(v == nodes for (s2, _), v in lists.items() if s2 == sid)
    one_row = {str(lists[k]) for k in lists if ops.filter(pl.col("step_id") == k[0])["n_tokens"][0] == 1}
    assert len(one_row) == 1


def _points(out: Path) -> list[dict[str, Any]]:
    """The node probes as the tracer attached them: where the same build puts them (the engine's
    own libraries, the same symbol lookup)."""
    from sparseety_prof.capture import target as tg
    from sparseety_prof.capture.elf import cheap_entry_probe_offset, read_at_vaddr
    from sparseety_prof.capture.op_trace import find_op_libs

    pid = json.loads((out / "meta.json").read_text())["target"]["pid"]
    lib = find_op_libs(lib.path for lib in tg.inspect(pid).libs)[SYM_NODE]
    vaddr = tg.elf_symbols(lib)[SYM_NODE][0]
    off = cheap_entry_probe_offset(read_at_vaddr(lib, vaddr, 32))
    return [{"symbol": SYM_NODE, "library": str(lib), "offset": off, "kind": "entry", "address": vaddr + off}]


def _node_probe_address(pid: int, out: Path) -> int:
    return runtime_address(pid, AttachedProbe(**_points(out)[0]))
